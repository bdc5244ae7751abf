"""Errors a user meets and what the CLI shows (issue 17).

* every method on every model kind either runs one round or is refused when the run is set up, with
  a ConfigError naming ``model.name`` and the models that fit (FedPAC on logistic regression used to
  end in a RuntimeError traceback after writing config.toml);
* a reproduction preset given to ``hetfl run`` is named as one, with the ``hetfl reproduce`` command;
* ``runtime.device = cuda:N`` is accepted and checked against the GPUs present;
* ``hetfl report`` has a default ``--out`` (inside the run, or the runs' common folder);
* ``hetfl list`` shows the post-hoc steps (CCVR) with their ``algorithm.<step>.<key>`` settings;
* square brackets in user-facing text (``hetfl[flower]``, ``[quick]``) reach the terminal as they are.
"""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

import hetfl.engine.experiment as experiment_mod
from hetfl import algorithms, config, reproduce
from hetfl.algorithms import _POSTHOC, algorithm_class, available, posthoc_class
from hetfl.algorithms.base import MODEL_PARTS, Algorithm, model_provides
from hetfl.algorithms.posthoc import PostHoc
from hetfl.cli import RichReporter, build_parser, main, make_console
from hetfl.data.base import Dataset, DatasetInfo, Split
from hetfl.engine.experiment import Experiment
from hetfl.engine.setup import pick_device
from hetfl.models import build_model, param_groups
from hetfl.params import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
PRESET = REPO / "configs" / "ccvr-table2.toml"
QUIET = ["--set", "train.rounds=1", "--quiet"]
# 4 synthetic devices of <= 20 samples, one round of one step: the cheapest run of a method
TINY = [
    "data.options={num_devices = 4, max_samples = 20, dim = 6, num_classes = 3}", "data.num_clients=4",
    "train.rounds=1", "train.local_steps=1", "train.batch_size=8", "train.eval_batch_size=64",
    "runtime.progress=false", "runtime.device=cpu", "runtime.checkpoint_every=0",
]
# the method settings that make one round cheap (the defaults train for seconds on a CPU)
CHEAP = {
    "vhl": ["algorithm.num_virtual=6"],
    "fedetf": ["algorithm.pers_cycles=1", "algorithm.pers_epochs=1"],
    "fedbabu": ["algorithm.finetune_epochs=1"],
    "fedrep": ["algorithm.head_epochs=1"],
    "pfedme": ["algorithm.inner_steps=1"],
    "fedmix": ["algorithm.mash_size=2"],
}
# the model kinds of hetfl: logistic regression (no encoder), an MLP, a CNN, a CNN with a projection head
KINDS = {
    "logistic": ["model.name=mlp", "model.options={hidden = []}"],
    "mlp": ["model.name=mlp", "model.options={hidden = [8]}"],
    "cnn2": ["model.name=cnn2", "data.partition=iid"],
    "simple_cnn": ["model.name=simple_cnn", "data.partition=iid"],
}
IMAGE_KINDS = {"cnn2", "simple_cnn"}


def tiny_images(name: str, root: str | None = None, *, download: bool = True, seed: int = 0, **options) -> Dataset:
    """24 training and 12 test 1x16x16 images of 3 classes (the smallest images cnn2 and simple_cnn take)."""
    gen = torch.Generator().manual_seed(seed)

    def split(n: int) -> Split:
        return Split(torch.randint(0, 256, (n, 1, 16, 16), dtype=torch.uint8, generator=gen), torch.arange(n) % 3)

    info = DatasetInfo("mnist", ("a", "b", "c"), (1, 16, 16), (0.5,), (0.5,))
    return Dataset(info, split(24), split(12))


@pytest.fixture
def images(monkeypatch):
    """Runs set up in this test load :func:`tiny_images` instead of a real dataset."""
    monkeypatch.setattr(experiment_mod, "load_dataset", tiny_images)


def kind_groups(kind: str) -> dict[str, list[str]]:
    cfg = config.load(None, [*TINY, *KINDS[kind]])
    shape = (1, 16, 16) if kind in IMAGE_KINDS else (6,)
    return param_groups(build_model(cfg.model.name, shape, 3, **cfg.model.options))


def unmet(method: str, kind: str) -> set[str]:
    """What ``method`` (a trainer and its post-hoc steps) requires and the model kind lacks."""
    trainer, *steps = method.split("+")
    required = {*algorithm_class(trainer).model_requires, *(r for s in steps for r in posthoc_class(s).model_requires)}
    return required - model_provides(kind_groups(kind))


# ------------------------------------------------------------------ method x model
def test_fedpac_on_the_default_model_exits_2_naming_model_name_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["run", "--out", str(out), "--set", "algorithm.name=fedpac", *QUIET])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "model.name = 'mlp'" in err and "fedpac needs an encoder" in err and "Traceback" not in err
    assert re.search(r"models that fit this data \(with their default options\): mlp$", err), err
    assert not out.exists()


def test_the_refusal_of_autos_logistic_regression_names_the_setting_that_gives_it_an_encoder(tmp_path, capsys):
    """Synthetic's automatic model is ``mlp`` with ``hidden = []``; the error says which ``--set`` gives the
    mlp its default hidden layers, and that setting runs."""
    assert main(["run", "--out", str(tmp_path / "refused"), "--set", "algorithm.name=freeze", *QUIET]) == 2
    err = capsys.readouterr().err.strip()
    hint = re.search(r'mlp has it with its default options: --set "(model\.options=\{hidden = \[200, 200\]\})"; ', err)
    assert hint, err
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), "--set", "algorithm.name=freeze", "--set", hint.group(1),
                 "--set", "train.local_steps=1", *QUIET]) == 0
    assert config.load(out / "config.toml").model.options == {"hidden": [200, 200]}


def test_compare_refuses_a_method_the_model_cannot_serve_before_its_first_run(tmp_path, capsys):
    """fedavg ran to the end before fedpac was refused at its own set-up; the plan checks every pairing first."""
    out = tmp_path / "cmp"
    code = main(["compare", "--methods", "fedavg,fedpac", "--seeds", "0", "--out", str(out), *QUIET])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "model.name = 'mlp'" in err and "fedpac needs an encoder" in err, err
    assert not out.exists()  # not even fedavg's folder


def test_the_declared_requirements_are_model_parts():
    for name in available():
        assert set(algorithm_class(name).model_requires) <= set(MODEL_PARTS), name
    for step in _POSTHOC:
        assert set(posthoc_class(step).model_requires) <= set(MODEL_PARTS), step
    assert model_provides(kind_groups("logistic")) == frozenset()
    assert model_provides(kind_groups("mlp")) == {"encoder"}
    assert model_provides(kind_groups("simple_cnn")) == {"encoder", "projector"}


def test_methods_that_split_encoder_and_classifier_are_refused_on_logistic_regression():
    refused = {name for name in available() if unmet(name, "logistic")}
    assert {"fedpac", "freeze", "fedbabu", "fedper", "fedrep", "lgfedavg"} <= refused
    assert not {name for name in available() if unmet(name, "simple_cnn")}  # every part is there


MATRIX = [(method, kind) for kind in KINDS for method in [*available(), *(f"fedavg+{s}" for s in _POSTHOC)]]


@pytest.mark.parametrize(("method", "kind"), MATRIX, ids=[f"{m}-{k}" for m, k in MATRIX])
def test_every_method_on_every_model_kind_runs_a_round_or_is_refused_at_set_up(method, kind, tmp_path, monkeypatch):
    if kind in IMAGE_KINDS:
        monkeypatch.setattr(experiment_mod, "load_dataset", tiny_images)
    step = ["algorithm.ccvr={num_virtual = 4, epochs = 1}"] if "+ccvr" in method else []
    trainer = method.split("+")[0]
    cfg = config.load(None, [*TINY, *KINDS[kind], *CHEAP.get(trainer, []), *step, f"algorithm.name={method}"])
    run_dir = tmp_path / "run"
    missing = unmet(method, kind)
    if missing:
        with pytest.raises(ConfigError) as err:
            Experiment(cfg)
        assert err.value.key == "model.name" and err.value.value == cfg.model.name
        assert f"{method.split('+')[-1] if '+' in method else method} needs" in err.value.allowed
        assert not run_dir.exists()
        return
    summary = Experiment(cfg).run(run_dir)
    assert summary["rounds"] == 1 and summary["final_train_loss"] == summary["final_train_loss"]  # not NaN


class _NeedsProjector(Algorithm):
    name = "needs_projector_demo"
    model_requires = ("projector",)


class NeedsEncoderStep(PostHoc):
    name = "needs_encoder_demo"
    model_requires = ("encoder",)


def test_a_method_requiring_a_projector_lists_the_models_that_have_one(images, monkeypatch):
    monkeypatch.setattr(algorithms, "_CLASSES", {})
    algorithms.register(_NeedsProjector)
    base = [*TINY, "algorithm.name=needs_projector_demo", "data.partition=iid"]
    with pytest.raises(ConfigError) as err:
        Experiment(config.load(None, [*base, "model.name=cnn2"]))
    assert err.value.key == "model.name" and err.value.value == "cnn2"
    assert "needs_projector_demo needs a projection head" in err.value.allowed
    fits = err.value.allowed.rsplit(": ", 1)[1].split(", ")
    assert "simple_cnn" in fits and "cnn2" not in fits and "mlp" not in fits
    Experiment(config.load(None, [*base, "model.name=simple_cnn"]))  # has one: set up without complaint


def test_a_post_hoc_steps_requirements_are_checked_too(monkeypatch):
    monkeypatch.setitem(_POSTHOC, "needs_encoder_demo", f"{__name__}:NeedsEncoderStep")
    with pytest.raises(ConfigError) as err:
        Experiment(config.load(None, [*TINY, *KINDS["logistic"], "algorithm.name=fedavg+needs_encoder_demo"]))
    assert err.value.key == "model.name" and "needs_encoder_demo needs an encoder" in err.value.allowed
    Experiment(config.load(None, [*TINY, *KINDS["mlp"], "algorithm.name=fedavg+needs_encoder_demo"]))


# ------------------------------------------------------------------ presets given to hetfl run
def test_a_preset_given_to_run_is_named_with_the_reproduce_command(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --out would be runs/... here
    code = main(["run", str(PRESET), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "reproduction preset" in err and "not a run configuration" in err
    assert "`hetfl reproduce ccvr-table2`" in err and "unknown key" not in err
    assert not (tmp_path / "runs").exists()


def test_a_preset_outside_configs_points_to_its_path(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(PRESET.read_text())
    with pytest.raises(ConfigError) as err:
        config.load(path)
    assert err.value.key == "CONFIG" and err.value.value == str(path)
    assert f"`hetfl reproduce {path}`" in err.value.allowed



def test_a_preset_is_named_by_reproduce_which_alone_knows_where_presets_live():
    """Issue 28: the configuration says that a file is a preset (config.PresetFileError, naming its path); the
    API asks hetfl.reproduce, which knows the presets' folder, for the name `hetfl reproduce` takes."""
    from hetfl.api import make_config

    with pytest.raises(config.PresetFileError) as by_config:
        config.load(PRESET)
    assert f"`hetfl reproduce {PRESET}`" in by_config.value.allowed
    with pytest.raises(config.PresetFileError) as by_api:
        make_config(str(PRESET), ["train.rounds=1"])
    assert by_api.value.key == "CONFIG" and by_api.value.value == str(PRESET)
    assert "`hetfl reproduce ccvr-table2`" in by_api.value.allowed
    assert reproduce.preset_name(PRESET) == "ccvr-table2"


# ------------------------------------------------------------------ runtime.device
@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:1", "cuda:12"])
def test_device_indices_are_valid_settings(device):
    assert config.load(None, [f"runtime.device={device}"]).runtime.device == device


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "cuda:-1", "cuda:01x", "cpu:0", "CUDA"])
def test_malformed_devices_are_refused_with_the_forms_allowed(device):
    with pytest.raises(ConfigError) as err:
        config.load(None, [f"runtime.device={device}"])
    assert err.value.key == "runtime.device" and err.value.value == device
    assert "cuda:N" in err.value.allowed


def test_a_device_index_is_checked_against_the_gpus_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert pick_device("cuda:1") == torch.device("cuda", 1) and chosen == [torch.device("cuda", 1)]
    with pytest.raises(ConfigError) as err:
        pick_device("cuda:2")
    assert err.value.key == "runtime.device" and err.value.value == "cuda:2"
    assert "2 CUDA devices" in err.value.allowed and "cuda:0, cuda:1" in err.value.allowed


def test_a_device_index_without_cuda_exits_2_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "run"
    code = main(["run", "--out", str(out), "--set", "runtime.device=cuda:1", *QUIET])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "runtime.device = 'cuda:1'" in err and "CUDA is not available" in err
    assert not out.exists()


# ------------------------------------------------------------------ hetfl report without --out
def _tiny_run(path: Path, seed: int = 0) -> None:
    argv = ["run", "--out", str(path), *[a for kv in TINY for a in ("--set", kv)], "--set", f"seed={seed}", "--quiet"]
    assert main(argv) == 0


def test_report_without_out_writes_into_the_run_or_the_runs_common_folder(tmp_path, capsys):
    one, two = tmp_path / "cmp" / "fedavg-seed0", tmp_path / "cmp" / "fedavg-seed1"
    _tiny_run(one, 0)
    _tiny_run(two, 1)
    capsys.readouterr()
    assert main(["report", str(one)]) == 0
    assert (one / "report" / "report.html").is_file() and (one / "report" / "report.md").is_file()
    assert str(one / "report" / "report.html") in capsys.readouterr().out
    assert main(["report", str(one), str(two)]) == 0
    assert (tmp_path / "cmp" / "report" / "report.html").is_file()
    assert "2 run(s)" in (tmp_path / "cmp" / "report" / "report.md").read_text()


def test_report_help_states_the_default_out():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    help_text = sub.choices["report"].format_help()
    assert "default" in help_text and "RUN_DIR/report" in help_text


# ------------------------------------------------------------------ hetfl list
def test_list_shows_every_method_and_every_post_hoc_step_with_its_keys(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["list", "algorithms"]) == 0
    out = capsys.readouterr().out
    for name in available():
        assert re.search(rf"^│ {re.escape(name)} ", out, re.M), name
    for step in _POSTHOC:
        cls = posthoc_class(step)
        assert re.search(rf"^│ {step} ", out, re.M) and cls.citation in out
        for key in ("num_virtual", "every_round", "oracle", "oracle_per_class", "tukey_beta"):
            assert f"algorithm.{step}.{key}=" in out
    assert "fedavg+ccvr" in out  # how a step composes


# ------------------------------------------------------------------ square brackets reach the terminal
def test_brackets_survive_in_list_config(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["list", "config"]) == 0
    assert 'pip install "hetfl[flower]"' in capsys.readouterr().out


def test_brackets_survive_in_the_preset_list(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    folder = tmp_path / "presets"
    folder.mkdir()
    text = PRESET.read_text().replace('title = "CCVR Table 2:', 'title = "Demo [quick] of hetfl[flower] [bold]x[/]:')
    (folder / "demo.toml").write_text(text)
    load = reproduce.load_preset
    monkeypatch.setattr(reproduce, "available", lambda directory=folder: ["demo"])
    monkeypatch.setattr(reproduce, "load_preset", lambda name, directory=folder: load(name, directory))
    assert main(["reproduce", "--list"]) == 0
    out = capsys.readouterr().out
    assert "Demo [quick] of hetfl[flower] [bold]x[/]:" in out and "NAME [--quick]" in out


def test_brackets_survive_in_notes_and_error_messages(tmp_path, capsys, monkeypatch):
    RichReporter(make_console(), enabled=True).note("see the preset's [quick] table; pip install \"hetfl[flower]\"")
    assert "see the preset's [quick] table; pip install \"hetfl[flower]\"" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "flwr", None)  # Flower not installed
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), "--set", "runtime.executor=flower", *QUIET]) == 2
    assert 'pip install "hetfl[flower]"' in capsys.readouterr().err and not out.exists()


def test_the_console_prints_user_text_literally():
    console = make_console()
    buffer = io.StringIO()
    console.file = buffer
    console.print("[red]not a style[/] :smile: hetfl[flower]")
    assert buffer.getvalue().strip() == "[red]not a style[/] :smile: hetfl[flower]"
    assert isinstance(console, Console)
