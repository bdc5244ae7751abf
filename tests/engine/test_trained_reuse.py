"""A run that differs from a finished one only in its post-hoc settings starts from that run's training
(``trained.safetensors``: the model after the last round's training, before CCVR's calibration) and gives
the numbers it would have given trained itself (issue 27, item 11: the CCVR preset's oracle rows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetfl import config
from hetfl.engine.checkpoint import CHECKPOINT_NAME, TRAINED_NAME
from hetfl.engine.experiment import Experiment
from hetfl.engine.ledger import PrivacyLedger
from hetfl.engine.rundir import CLIENT_METRICS_NAME, RunDirError
from hetfl.params import ConfigError
from hetfl.privacy import Release

BASE = ["data.num_clients=4", "data.partition=dirichlet", "data.alpha=0.1", "model.name=mlp",
        "model.options={hidden = [16]}", "train.rounds=3", "train.local_steps=5", "runtime.progress=false",
        "runtime.client_metrics_every=1", "algorithm.name=fedavg+ccvr", "algorithm.ccvr.epochs=2"]
ORACLE = [*BASE, "algorithm.ccvr.oracle=all", "algorithm.ccvr.epochs=4", "algorithm.ccvr.lr=0.05"]
TIMES = {"round_time_s", "eval_time_s", "train_time_s"}


def lines(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if k not in TIMES}
            for x in (run / "metrics.jsonl").read_text().splitlines()]


def summary(run: Path) -> dict:
    return {k: v for k, v in json.loads((run / "summary.json").read_text()).items()
            if k not in {"wall_time_s", "trained_in"}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A CCVR run, and its oracle trained from scratch: what a run started from the first must give."""
    root = tmp_path_factory.mktemp("trained")
    Experiment(config.load(None, BASE)).run(root / "ccvr")
    Experiment(config.load(None, ORACLE)).run(root / "oracle")
    return root


def test_a_run_with_final_posthoc_steps_keeps_its_model_before_them(runs):
    assert (runs / "ccvr" / TRAINED_NAME).is_file() and (runs / "ccvr" / CHECKPOINT_NAME).is_file()
    no_posthoc = runs / "plain"
    Experiment(config.load(None, [*BASE[:-2], "algorithm.name=fedavg"])).run(no_posthoc)
    assert not (no_posthoc / TRAINED_NAME).exists()


def test_a_run_started_from_another_ones_training_equals_the_run_trained_itself(runs, tmp_path, monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError("a round was trained")

    exp = Experiment(config.load(None, ORACLE))
    monkeypatch.setattr(exp, "round", no_training)
    result = exp.run(tmp_path / "forked", trained=runs / "ccvr")
    assert lines(tmp_path / "forked") == lines(runs / "oracle")
    assert summary(tmp_path / "forked") == summary(runs / "oracle")
    assert result["trained_in"] == str((runs / "ccvr").resolve())
    per_client = [(run / CLIENT_METRICS_NAME).read_text() for run in (tmp_path / "forked", runs / "oracle")]
    assert per_client[0] == per_client[1]
    # the calibration did change the model: the oracle's accuracy is not the trained run's
    assert lines(tmp_path / "forked")[-1]["global_acc"] != lines(runs / "ccvr")[-1]["global_acc"]
    # and the wall time counts the training it reused (the rounds before the last: their lines are that run's)
    raw = [json.loads(x) for x in (tmp_path / "forked" / "metrics.jsonl").read_text().splitlines()]
    wall = json.loads((tmp_path / "forked" / "summary.json").read_text())["wall_time_s"]
    assert wall == pytest.approx(sum(x["round_time_s"] for x in raw), abs=0.01)
    assert wall > sum(x["round_time_s"] for x in raw[:-1])


def test_a_run_started_from_training_and_interrupted_in_its_calibration_resumes_without_training(
        runs, tmp_path, monkeypatch):
    exp = Experiment(config.load(None, ORACLE))
    step = exp.posthoc[0]
    monkeypatch.setattr(step, "apply", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        exp.run(tmp_path / "forked", trained=runs / "ccvr")
    again = Experiment(config.load(None, ORACLE))
    monkeypatch.setattr(again, "round", lambda *a, **k: pytest.fail("a round was trained on resume"))
    again.run(tmp_path / "forked", resume=True)
    assert lines(tmp_path / "forked") == lines(runs / "oracle")
    assert json.loads((tmp_path / "forked" / "summary.json").read_text())["trained_in"] == \
        str((runs / "ccvr").resolve())


@pytest.mark.parametrize("override, named", [("train.lr=0.02", "train.lr"), ("seed=1", "seed"),
                                              ("algorithm.ccvr.every_round=true", "every_round")])
def test_another_training_is_refused_naming_what_differs(runs, tmp_path, override, named):
    with pytest.raises((RunDirError, ConfigError), match=named):
        Experiment(config.load(None, [*ORACLE, override])).run(tmp_path / "forked", trained=runs / "ccvr")
    assert not (tmp_path / "forked").exists() or not any((tmp_path / "forked").iterdir())


def test_another_training_is_refused_naming_five_of_its_changes(runs, tmp_path):
    with pytest.raises(RunDirError) as err:
        Experiment(config.load(None, [*ORACLE, "train.lr=0.02", "seed=1", "train.rounds=4", "train.local_steps=6",
                                      "data.alpha=0.2", "train.momentum=0.5"])).run(tmp_path / "forked",
                                                                                   trained=runs / "ccvr")
    assert str(err.value) == (f"{runs / 'ccvr'}: its training is another configuration's (data.alpha: 0.1 -> 0.2; "
                              "seed: 0 -> 1; train.local_steps: 5 -> 6; train.lr: 0.05 -> 0.02; train.momentum: 0.0 "
                              "-> 0.5; there -> now); only the post-hoc steps' settings may differ")


def test_a_folder_without_a_trained_model_is_refused(runs, tmp_path):
    with pytest.raises(RunDirError) as err:
        Experiment(config.load(None, ORACLE)).run(tmp_path / "forked", trained=tmp_path)
    assert str(err.value) == (f"{tmp_path}: no {TRAINED_NAME} (the model before the post-hoc steps) to start from; it "
                              "is written by a finished run with post-hoc steps and checkpoints on")
    with pytest.raises(ValueError, match="one of them"):
        Experiment(config.load(None, ORACLE)).run(tmp_path / "forked", trained=runs / "ccvr", resume=True)


def test_a_training_that_released_private_data_is_not_reused(runs, tmp_path):
    """Its releases are in that run's ledger, not this one's: the budget this run would report would miss them."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(runs / "ccvr", base)
    PrivacyLedger(base).record("fedavg", 1, Release(1.0, "0" * 64, "seed"))
    with pytest.raises(RunDirError) as err:
        Experiment(config.load(None, ORACLE)).run(tmp_path / "forked", trained=base)
    assert str(err.value) == (f"{base}: its training made differentially private releases; a run started from it "
                              "would not account for them: train this run itself")


def test_the_header_says_whose_training_the_run_calibrates(runs, tmp_path):
    import io

    from rich.console import Console

    from hetfl.console import RichReporter

    console = Console(file=io.StringIO(), width=400)
    reporter = RichReporter(console, enabled=True)
    Experiment(config.load(None, ORACLE)).run(tmp_path / "forked", trained=runs / "ccvr", reporter=reporter)
    reporter.close()
    header = console.file.getvalue().splitlines()[0]
    assert f"post-hoc steps on the model trained in {(runs / 'ccvr').resolve()} (rounds 1-3)" in header
    assert "resuming" not in header
