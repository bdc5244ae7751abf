"""A method setting read only in some mode (``when=`` in its declaration) that a run moves from its default
while that mode is off changes nothing: the run says so, and the declarations are proven truthful."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from hetfl import config
from hetfl.algorithms import algorithm_class, available, posthoc_class
from hetfl.cli import main
from hetfl.engine.experiment import Experiment
from hetfl.params import FINITE, Condition, above, build, inactive_settings, setting, when_text


def test_a_run_says_a_method_setting_its_mode_ignores_has_no_effect(tmp_path, capsys, caplog, one_thread):
    """algorithm.proxy_dataset = 'cifar100' under FedBR's default pseudo_source made the default run, silently."""
    argv = ["run", "--set", "algorithm.name=fedbr", "--set", "algorithm.proxy_dataset=cifar100",
            "--set", "train.rounds=1", "--set", "data.options={max_samples = 150}", "--set", "train.local_steps=1",
            "--quiet", "--out", str(tmp_path / "r")]
    assert main(argv) == 0
    said = capsys.readouterr().err + caplog.text
    assert ("algorithm.proxy_dataset = 'cifar100' has no effect: it is read only when "
            "algorithm.pseudo_source = 'proxy' (here algorithm.pseudo_source = 'rsm_clients')") in said


# ------------------------------------------------------------------ the declarations

#: every setting read only in some mode, and that mode: (method, key) -> condition, in words (a declaration
#: removed or changed fails here; the runs below prove each one)
DECLARED = {
    ("apfl", "alpha_every"): "learn_alpha = true",
    ("apfl", "alpha_lr"): "learn_alpha = true",
    ("fedbr", "lam"): "components is 'both' or 'classifier'",
    ("fedbr", "mu"): "components is 'both' or 'features'",
    ("fedbr", "tau1"): "components is 'both' or 'features'",
    ("fedbr", "tau2"): "components is 'both' or 'features'",
    ("fedbr", "proxy_dataset"): "pseudo_source = 'proxy'",
    ("fedbr", "proxy_root"): "pseudo_source = 'proxy'",
    ("fedbr", "max_step"): "components is 'both' or 'features'",
    ("fedbr", "head_lr"): "max_step = true and components is 'both' or 'features'",
    ("fedbr", "max_forward"): "max_step = true and components is 'both' or 'features'",
    ("fedbr", "mixup_alpha"): "mixup = true",
    ("fedetf", "pers_cycles"): "personalize = true",
    ("fedetf", "pers_epochs"): "personalize = true",
    ("fedetf", "pers_etf_lr"): "personalize = true",
    ("fedetf", "pers_proj_lr"): "personalize = true",
    ("fedavg_ft", "finetune_part"): "finetune_epochs > 0",
    ("fedavg_ft", "finetune_lr"): "finetune_epochs > 0",
    ("fedbabu", "finetune_part"): "finetune_epochs > 0",
    ("fedbabu", "finetune_lr"): "finetune_epochs > 0",
    ("fedpac", "head_lr"): "head_epochs > 0",
    ("fedpac", "head_momentum"): "head_epochs > 0",
    ("fedpac", "head_weight_decay"): "head_epochs > 0",
    ("fedpac", "clip_norm"): "dp_epsilon < inf",
    ("fedpac", "dp_delta"): "dp_epsilon < inf",
    ("fedpac", "dp_noise"): "dp_epsilon < inf",
    ("fedpac", "dp_noise_source"): "dp_epsilon < inf",
    ("pfedhn", "chunk_embed_dim"): "chunk_size > 0",
    ("ccvr", "num_virtual"): "oracle = 'none'",
    ("ccvr", "proportional"): "oracle = 'none'",
    ("ccvr", "tukey_beta"): "transform = 'relu_tukey'",
    ("ccvr", "oracle_per_class"): "oracle = 'per_class'",
    ("ccvr", "dp_delta"): "dp_epsilon < inf",
    ("ccvr", "dp_noise"): "dp_epsilon < inf",
    ("ccvr", "dp_noise_source"): "dp_epsilon < inf",
}
STEPS = ("ccvr",)


def hyper_classes() -> dict[str, type]:
    return {**{m: algorithm_class(m).Hyper for m in available()}, **{s: posthoc_class(s).Hyper for s in STEPS}}


def declarations() -> list[tuple[str, dataclasses.Field]]:
    return [(method, f) for method, cls in hyper_classes().items() for f in dataclasses.fields(cls)
            if f.metadata.get("when")]


def test_the_declared_conditions_are_the_known_ones():
    classes = hyper_classes()
    found = {(method, f.name): when_text(f) for method, f in declarations()}
    assert found == DECLARED
    for method, f in declarations():  # each condition names a setting of the class and values it can take
        fields = {g.name: g for g in dataclasses.fields(classes[method])}
        for key, cond in f.metadata["when"].items():
            assert key in fields and key != f.name, (method, f.name, key)
            choices = fields[key].metadata.get("choices")
            if isinstance(cond, tuple) and choices is not None:
                assert set(cond) < set(choices), (method, f.name, key)


def _default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def unmet(cond, field: dataclasses.Field):
    """A value of the other setting under which ``cond`` does not hold."""
    if isinstance(cond, Condition):
        return next(v for v in (0, math.inf) if not cond.holds(v))
    choices = field.metadata.get("choices") or (True, False)
    return next(v for v in choices if v not in cond)


def moved(f: dataclasses.Field):
    """A valid value other than ``f``'s default."""
    value = _default(f)
    if isinstance(value, bool):
        return not value
    if f.metadata.get("choices"):
        return next(c for c in f.metadata["choices"] if c != value)
    if isinstance(value, str):
        return "cifar100"
    if isinstance(value, int):
        return value + 1
    return value / 2 if value else 0.5


def toml(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


TINY = ["train.rounds=2", "runtime.progress=false", "data.options={max_samples = 150}", "train.clients_per_round=4",
        "model.options={hidden = [16]}", "train.local_steps=2"]
# the methods' own inner epochs: the suite's time (the same code runs)
METHOD_SETTINGS = {"fedetf": ["pers_cycles=1", "pers_epochs=1"], "fedbabu": ["finetune_epochs=1"]}
# APFL's alpha has no gradient while a client's personal model is the global one: 3 rounds of 4 clients in 6
RUN_SETTINGS = {"apfl": ["train.rounds=3", "data.partition=iid", "data.num_clients=6"]}
TIME_KEYS = {"round_time_s", "eval_time_s"}


def run_metrics(run_dir: Path, method: str, settings: dict) -> list[dict]:
    name, prefix = (f"fedavg+{method}", f"algorithm.{method}.") if method in STEPS else (method, "algorithm.")
    own = [f"{prefix}{s}" for s in METHOD_SETTINGS.get(method, []) if s.split("=")[0] not in settings]
    cfg = config.load(None, [*TINY, *RUN_SETTINGS.get(method, []), f"algorithm.name={name}", *own,
                             *[f"{prefix}{k}={toml(v)}" for k, v in settings.items()]])
    Experiment(cfg).run(run_dir)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIME_KEYS} for line in lines]


@pytest.mark.parametrize("method, key", sorted(DECLARED))
def test_a_setting_outside_its_mode_changes_nothing(method, key, tmp_path, one_thread):
    """The declaration is truthful: with its condition unmet, the setting moved from its default gives the
    default's metrics to the bit (and the note says so)."""
    fields = {f.name: f for f in dataclasses.fields(hyper_classes()[method])}
    f = fields[key]
    base = {k: unmet(cond, fields[k]) for k, cond in f.metadata["when"].items()}
    base = {k: v for k, v in base.items() if v != _default(fields[k])}  # only what the default does not already
    changed = {**base, key: moved(f)}
    assert inactive_settings(build(hyper_classes()[method], changed), "algorithm.")  # the run would say so
    assert run_metrics(tmp_path / "moved", method, changed) == run_metrics(tmp_path / "default", method, base)


# ------------------------------------------------------------------ the generic function
@dataclasses.dataclass(frozen=True)
class _Hyper:
    source: str = setting("a", choices=("a", "proxy"))
    epochs: int = setting(0, ge=0)
    epsilon: float = setting(math.inf, gt=0.0, finite=False)
    name: str = setting("", when={"source": ("proxy",)}, doc="the proxy")
    lr: float = setting(0.0, when={"epochs": above(0), "source": ("a",)})
    delta: float = setting(1e-5, when={"epsilon": FINITE})


def test_inactive_settings_names_a_moved_setting_whose_condition_is_unmet():
    assert inactive_settings(_Hyper()) == []
    assert inactive_settings(_Hyper(name="c100"), "algorithm.") == [
        "algorithm.name = 'c100' has no effect: it is read only when algorithm.source = 'proxy' "
        "(here algorithm.source = 'a')"]
    assert inactive_settings(_Hyper(source="proxy", name="c100")) == []  # met
    assert inactive_settings(_Hyper(lr=0.1)) == [
        "lr = 0.1 has no effect: it is read only when epochs > 0 and source = 'a' (here epochs = 0)"]
    assert inactive_settings(_Hyper(lr=0.1, epochs=2)) == []
    assert inactive_settings(_Hyper(lr=0.1, epochs=2, source="proxy")) == [
        "lr = 0.1 has no effect: it is read only when epochs > 0 and source = 'a' (here source = 'proxy')"]
    assert inactive_settings(_Hyper(delta=1e-3)) == [
        "delta = 0.001 has no effect: it is read only when epsilon < inf (here epsilon = inf)"]
    assert inactive_settings(_Hyper(delta=1e-3, epsilon=4.0)) == []
    assert inactive_settings(_Hyper(source="proxy")) == []  # a mode setting itself is never a note


# ------------------------------------------------------------------ the runtime's settings

#: the runtime settings read only by the Flower executor, and when (``hetfl.config.ON_FLOWER``)
RUNTIME_DECLARED = {
    "flower_timeout_s": "runtime.executor = 'flower'",
    "flower_min_replies": "runtime.executor = 'flower'",
    "flower_grace_s": "runtime.executor = 'flower'",
    "flower_client_cpus": "runtime.executor = 'flower'",
    "flower_client_gpus": "runtime.executor = 'flower'",
    "secagg_num_shares": "runtime.executor = 'flower' and runtime.secure_aggregation = true",
    "secagg_reconstruction_threshold": "runtime.executor = 'flower' and runtime.secure_aggregation = true",
}
FLOWER_MOVED = ["runtime.flower_timeout_s=3", "runtime.flower_min_replies=0", "runtime.flower_grace_s=1",
                "runtime.flower_client_cpus=2", "runtime.flower_client_gpus=0.5", "runtime.secagg_num_shares=4",
                "runtime.secagg_reconstruction_threshold=2"]


def test_the_runtimes_declared_conditions_are_the_flower_executors():
    found = {f.name: when_text(f, "runtime.") for f in dataclasses.fields(config.RuntimeConfig)
             if f.metadata.get("when")}
    assert found == RUNTIME_DECLARED
    assert sorted(s.split("=")[0].removeprefix("runtime.") for s in FLOWER_MOVED) == sorted(RUNTIME_DECLARED)


def test_the_flower_executors_settings_on_another_executor_say_so_and_change_nothing(tmp_path, caplog, one_thread):
    """runtime.flower_grace_s = 1 without runtime.executor = flower used to pass silently: the run was an
    in-process one, with every reply."""
    base = [*TINY, "algorithm.name=fedavg"]
    Experiment(config.load(None, base)).run(tmp_path / "default")
    with caplog.at_level("WARNING", logger="hetfl"):
        Experiment(config.load(None, [*base, *FLOWER_MOVED])).run(tmp_path / "moved")
    said = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    assert said[2] == ("runtime.flower_grace_s = 1.0 has no effect: it is read only when runtime.executor = "
                       "'flower' (here runtime.executor = 'sequential')"), said
    assert [x.split(" = ")[0] for x in said] == [f"runtime.{k}" for k in RUNTIME_DECLARED]
    runs = [[{k: v for k, v in json.loads(x).items() if k not in TIME_KEYS}
             for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()] for name in ("default", "moved")]
    assert runs[0] == runs[1]
