"""Every method x post-hoc step pair is either run (one tiny round) or refused at configuration
time with a ConfigError naming algorithm.name, the value and why; none crashes."""

from __future__ import annotations

import pytest

from hetfl import config
from hetfl.algorithms import _POSTHOC, algorithm_class, available, composition_error, parse_name, posthoc_class
from hetfl.cli import main
from hetfl.engine.experiment import Experiment
from hetfl.params import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

PAIRS = [(a, s) for a in available() for s in _POSTHOC]
# 4 synthetic devices x <= 60 samples, an MLP (so that freeze/fedbabu have an encoder), one round
TINY = [
    "data.options={num_devices = 4, max_samples = 60, dim = 10, num_classes = 4}", "data.num_clients=4",
    "model.name=mlp", "model.options={hidden = [16]}", "train.rounds=1", "train.local_epochs=1",
    "train.batch_size=16", "runtime.progress=false", "runtime.threads=1",
]
TINY_STEP = {"ccvr": "algorithm.ccvr={num_virtual = 5, epochs = 1}"}


def refused(trainer: str, step: str) -> bool:
    return composition_error(algorithm_class(trainer), posthoc_class(step)) is not None


def test_the_registry_has_steps_and_both_outcomes():
    assert "ccvr" in _POSTHOC
    assert any(refused(a, s) for a, s in PAIRS) and not all(refused(a, s) for a, s in PAIRS)


@pytest.mark.parametrize("trainer", ["fedpac", "local", "fedper", "fedrep", "lgfedavg", "fedfomo", "pfedhn"])
def test_personalised_methods_refuse_ccvr_with_the_reason(trainer):
    with pytest.raises(ConfigError) as err:
        parse_name(f"{trainer}+ccvr")
    assert err.value.key == "algorithm.name" and err.value.value == f"{trainer}+ccvr"
    assert "personalised" in err.value.allowed and "global model" in err.value.allowed


def test_refusal_follows_the_personalized_flag_and_the_steps_needs():
    for trainer, step in PAIRS:
        expected = algorithm_class(trainer).personalized and posthoc_class(step).needs_global_model
        assert refused(trainer, step) == expected, (trainer, step)


def test_a_step_given_twice_is_refused():
    with pytest.raises(ConfigError, match="given twice"):
        parse_name("fedavg+ccvr+ccvr")


@pytest.mark.parametrize(("trainer", "step"), PAIRS, ids=[f"{a}+{s}" for a, s in PAIRS])
def test_every_pair_runs_one_round_or_is_refused_before_anything_is_written(trainer, step, tmp_path):
    name = f"{trainer}+{step}"
    cfg = config.load(None, [*TINY, TINY_STEP[step], f"algorithm.name={name}"])
    run_dir = tmp_path / "run"
    if refused(trainer, step):
        with pytest.raises(ConfigError, match="algorithm.name"):
            Experiment(cfg).run(run_dir)
        assert not run_dir.exists()
        return
    summary = Experiment(cfg).run(run_dir)
    assert summary["rounds"] == 1 and f"final_global_acc_before_{step}" in summary


def test_cli_refuses_fedpac_ccvr_in_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["run", "--out", str(out), "--set", "algorithm.name=fedpac+ccvr", "--set", "train.rounds=1",
                 "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "algorithm.name = 'fedpac+ccvr'" in err and "personalised" in err
    assert not out.exists()
