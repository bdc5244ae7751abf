"""A run directory's life in ``hetfl.engine.experiment``: a finished run resumed, the model kept before the post-hoc
steps, and a run that starts from another's training refused where it cannot.

Written with the mutation target ``experiment_resume`` (session 44), whose survivors showed these untested: a
finished run whose ``summary.json`` was lost or cut gets it rebuilt (it lacked ``environment`` and
``trained_in``, which the README promises, until this session), one whose checkpoint is of an earlier round is
refused, which runs keep ``trained.safetensors``, and the refusals of ``trained=`` word for word. The whole runs
are in ``test_engine.py``, ``test_run_dir_safety.py`` and ``test_trained_reuse.py``.
"""

from __future__ import annotations

import contextlib
import json
import shutil

import pytest

from hetfl import config
from hetfl.engine import rundir
from hetfl.engine.checkpoint import CHECKPOINT_NAME, TRAINED_NAME
from hetfl.engine.experiment import Experiment, keeps_trained_model
from hetfl.engine.rundir import RunDirError
from hetfl.engine.summary import Reporter
from hetfl.params import ConfigError
from hetfl.runtimes import set_up

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["data.partition=iid", "data.num_clients=4", "data.options={num_devices=8, max_samples=60}",
        "model.name=mlp", "runtime.progress=false", "runtime.threads=1", "runtime.device=cpu",
        "train.rounds=3", "train.local_steps=2"]


class Notes(Reporter):
    shows_notes = True

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.finished: list[dict] = []

    def note(self, message: str) -> None:
        self.notes.append(message)

    def finish(self, summary: dict) -> None:
        self.finished.append(summary)


class Killed(KeyboardInterrupt):
    pass


def killed_after(monkeypatch, cfg, run, round_: int) -> None:
    """The run in ``run`` stopped by a KeyboardInterrupt once round ``round_``'s metrics line is written."""
    append = rundir.MetricsLog.append

    def appended(self, line):
        append(self, line)
        if line["round"] == round_:
            raise Killed

    with monkeypatch.context() as m:
        m.setattr(rundir.MetricsLog, "append", appended)
        with contextlib.suppress(Killed):
            set_up(cfg).run(run)


@pytest.mark.parametrize(("loss", "checkpoints"), [("cut", 1), ("cut", 0), ("deleted", 1)],
                         ids=["cut", "cut, no checkpoint", "deleted"])
def test_a_finished_run_whose_summary_was_lost_gets_it_back_as_it_was(tmp_path, checkpoints, loss):
    """Resumed, a finished run trains nothing and returns its summary; one that is unreadable (a copy cut short)
    is rebuilt from the checked metrics: the same numbers and wall time, the environments its checkpoint
    recorded (none known without one). One deleted is a run stopped before writing it: its last checkpoint is
    its last round, so there is nothing left to run (without a checkpoint it would run again from round 1)."""
    cfg = config.load(None, [*TINY, f"runtime.checkpoint_every={checkpoints}"])
    run = tmp_path / "run"
    original = set_up(cfg).run(run)
    text = (run / "summary.json").read_text()
    if loss == "cut":
        (run / "summary.json").write_text(text[: len(text) // 2])
    else:
        (run / "summary.json").unlink()
    reporter = Notes()
    exp = set_up(cfg)
    exp.round = lambda *a, **k: pytest.fail("a finished run trained a round")
    rebuilt = exp.run(run, resume=True, reporter=reporter)
    expected = dict(original) if checkpoints else {**original, "environment": []}
    assert rebuilt == expected
    assert json.loads((run / "summary.json").read_text()) == expected
    assert reporter.finished == [expected]
    finished = f"{run}: the run already finished (3 rounds, summary.json); nothing to do"
    assert reporter.notes == ([finished] if loss == "cut" else [])
    assert set_up(cfg).run(run, resume=True) == expected  # readable now: returned as it is


def test_a_finished_run_is_returned_as_its_summary_says_without_rewriting_it(tmp_path):
    cfg = config.load(None, TINY)
    run = tmp_path / "run"
    set_up(cfg).run(run)
    said = {**json.loads((run / "summary.json").read_text()), "note": "kept"}
    (run / "summary.json").write_text(json.dumps(said))
    assert set_up(cfg).run(run, resume=True) == said
    assert json.loads((run / "summary.json").read_text()) == said


def test_a_finished_run_whose_checkpoint_is_of_an_earlier_round_is_refused(tmp_path, monkeypatch):
    """summary.json says the run finished; its checkpoint (copied from a run stopped after round 2) says it did
    not: which files belong together cannot be told, so nothing is returned or rewritten."""
    cfg = config.load(None, TINY)
    run, stopped = tmp_path / "run", tmp_path / "stopped"
    set_up(cfg).run(run)
    killed_after(monkeypatch, cfg, stopped, 3)  # round 3's line written, its checkpoint not: the one of round 2
    shutil.copy2(stopped / CHECKPOINT_NAME, run / CHECKPOINT_NAME)
    summary = (run / "summary.json").read_bytes()
    with pytest.raises(RunDirError) as err:
        set_up(cfg).run(run, resume=True)
    assert str(err.value) == (f"{run}: summary.json says the run finished but the checkpoint is at round 2 of 3")
    assert (run / "summary.json").read_bytes() == summary


@pytest.mark.parametrize(("overrides", "keeps"), [
    (["algorithm.name=fedavg+ccvr"], True),
    (["algorithm.name=fedavg+ccvr", "algorithm.ccvr.every_round=true"], False),  # it changes the training after it
    (["algorithm.name=fedavg+ccvr", "algorithm.ccvr.every_round=false"], True),
    (["algorithm.name=fedavg"], False),  # nothing after the training: the run's checkpoint is the model
    (["algorithm.name=fedavg+ccvr", "runtime.checkpoint_every=0"], False),  # no checkpoints asked for
    (["algorithm.name=fedavg+ccvr", "runtime.executor=flower"], False),  # the server's process is not the clients'
], ids=["ccvr", "ccvr every round", "ccvr every_round false", "fedavg", "no checkpoints", "flower"])
def test_which_runs_keep_their_model_before_the_post_hoc_steps(overrides, keeps):
    assert keeps_trained_model(config.load(None, [*TINY, *overrides])) is keeps


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A finished fedavg+ccvr run: it keeps trained.safetensors."""
    run = tmp_path_factory.mktemp("trained") / "ccvr"
    Experiment(config.load(None, [*TINY, "algorithm.name=fedavg+ccvr", "algorithm.ccvr.epochs=1"])).run(run)
    assert (run / TRAINED_NAME).is_file()
    return run


def test_a_run_with_a_step_after_every_round_cannot_start_from_another_ones_training(trained_run, tmp_path):
    exp = Experiment(config.load(None, [*TINY, "algorithm.name=fedavg+ccvr", "algorithm.ccvr.every_round=true"]))
    with pytest.raises(ConfigError) as err:
        exp.run(tmp_path / "forked", trained=trained_run)
    assert str(err.value) == ("algorithm.ccvr.every_round = True: a step run after every round changes the training "
                              "that follows it, so this run cannot start from another's training (trained=)")
    assert not (tmp_path / "forked").exists()


def test_a_run_without_post_hoc_steps_cannot_start_from_another_ones_training(trained_run, tmp_path):
    exp = Experiment(config.load(None, TINY))
    with pytest.raises(ConfigError) as err:
        exp.run(tmp_path / "forked", trained=trained_run)
    assert str(err.value) == ("algorithm.name = 'fedavg': a run without post-hoc steps would repeat the other's "
                              "run; trained= starts a run whose post-hoc settings differ (e.g. fedavg+ccvr with "
                              "other algorithm.ccvr.*)")
    assert not (tmp_path / "forked").exists()


def test_a_run_whose_clients_are_elsewhere_cannot_start_from_another_ones_training(trained_run, tmp_path):
    """A federation attached by a runtime above the engine (Flower's nodes): the trained model is in this
    process, its post-hoc steps' clients are not."""
    exp = Experiment(config.load(None, [*TINY, "algorithm.name=fedavg+ccvr"]))
    exp.federation = object()  # not this process's clients
    with pytest.raises(ConfigError) as err:
        exp.run(tmp_path / "forked", trained=trained_run)
    assert str(err.value) == ("runtime.executor = 'sequential': a run that starts from another's training "
                              "(trained=) runs in this process")
    assert not (tmp_path / "forked").exists()
