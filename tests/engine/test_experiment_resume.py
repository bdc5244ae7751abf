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
from tests.helpers import needs_accountant

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
    assert str(err.value) == ("algorithm.ccvr.every_round = true: a step run after every round changes the training "
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


def test_a_resume_keeps_the_config_toml_the_run_was_started_with(tmp_path, monkeypatch):
    """config.toml is the configuration the run was started with: a resume that changes a key that changes no
    number (``identity.PRESENTATION_KEYS``) runs with it but does not rewrite the file."""
    run = tmp_path / "run"
    killed_after(monkeypatch, config.load(None, [*TINY, "runtime.keep_freed_memory=false"]), run, 2)
    started = (run / "config.toml").read_bytes()
    assert b"keep_freed_memory = false" in started
    set_up(config.load(None, [*TINY, "runtime.keep_freed_memory=true"])).run(run, resume=True)
    assert (run / "summary.json").is_file() and (run / "config.toml").read_bytes() == started


@pytest.mark.parametrize(("overrides", "kwargs", "error", "message"), [
    (["runtime.executor=flower"], {}, ConfigError,
     "runtime.executor = 'flower': Experiment.run runs the clients in this process only; run a Flower experiment "
     "with hetfl.runtimes.run_experiment (or `hetfl run`), which starts Flower"),
    (["tracking.tensorboard=true"], {}, ConfigError,
     "tracking.tensorboard = true: this Experiment was handed no trackers; run it with "
     "hetfl.runtimes.run_experiment (or `hetfl run`, hetfl.run), or set it up with hetfl.runtimes.set_up(cfg), "
     "which hands hetfl.tracking's"),
    (["algorithm.name=fedavg+ccvr"], {"resume": True, "trained": "elsewhere"}, ValueError,
     "resume=True continues the run in run_dir from its own checkpoint; trained= starts a new run from another's "
     "training: give one of them"),
], ids=["flower", "untracked", "resume and trained"])
def test_what_experiment_run_cannot_do_is_refused_before_anything_is_written(tmp_path, overrides, kwargs, error,
                                                                             message):
    exp = Experiment(config.load(None, [*TINY, *overrides]))  # no trackers handed, no Flower federation
    with pytest.raises(error) as err:
        exp.run(tmp_path / "run", **kwargs)
    assert str(err.value) == message
    assert list(tmp_path.iterdir()) == []


def test_a_resume_under_another_configuration_is_refused_naming_five_of_its_changes(tmp_path, monkeypatch):
    run = tmp_path / "run"
    killed_after(monkeypatch, config.load(None, TINY), run, 2)  # the checkpoint of round 2
    other = config.load(None, [*TINY, "train.lr=0.5", "seed=3", "train.weight_decay=0.1", "train.batch_size=8",
                               "train.momentum=0.5", "data.alpha=0.3"])
    with pytest.raises(RunDirError) as err:
        set_up(other).run(run, resume=True)
    assert str(err.value) == (f"{run}: the checkpoint belongs to a different configuration (data.alpha: 0.5 -> 0.3; "
                              "seed: 0 -> 3; train.batch_size: 32 -> 8; train.lr: 0.05 -> 0.5; train.momentum: 0.0 "
                              "-> 0.5)")  # the sixth, train.weight_decay, left out


def test_a_run_stopped_before_its_first_checkpoint_with_an_unreadable_config_toml_is_not_resumed(tmp_path,
                                                                                               monkeypatch):
    """Its config.toml is the only record of what the run started with (its releases, its rounds): unreadable,
    the resume cannot tell whether this configuration is that one."""
    cfg = config.load(None, [*TINY, "runtime.checkpoint_every=2"])
    run = tmp_path / "run"
    killed_after(monkeypatch, cfg, run, 1)
    (run / "config.toml").write_text("seed = [unclosed\n")
    with pytest.raises(RunDirError) as err:
        set_up(cfg).run(run, resume=True)
    assert str(err.value) == (f"{run / 'config.toml'}: the interrupted run there (no checkpoint yet) has a different "
                              "configuration (config.toml cannot be read; there -> now)")


def test_a_run_says_at_its_start_what_its_settings_hide_and_which_of_them_have_no_effect(tmp_path):
    """Said once, before the first round, through the reporter: the method's cost its settings hide, a data
    setting the partition ignores, and settings their mode does not read (the runtime's, the method's, a
    post-hoc step's), each named with its prefix."""
    cfg = config.load(None, [*TINY, "train.rounds=1", "algorithm.name=fedbr+ccvr", "algorithm.components=classifier",
                             "algorithm.mu=0.7", "algorithm.ccvr.epochs=1", "algorithm.ccvr.oracle_per_class=50",
                             "runtime.flower_timeout_s=5", "data.alpha=0.3"])
    exp, reporter = set_up(cfg), Notes()
    exp.algorithm.run_notes = lambda: ["fedbr: a cost the settings hide"]
    exp.run(tmp_path / "run", reporter=reporter)
    assert reporter.notes == [
        "fedbr: a cost the settings hide",
        "data.alpha = 0.3 has no effect: the iid partition does not use it (it is read by dirichlet, rotation with "
        "data.base = 'dirichlet', concept with data.base = 'dirichlet'); set data.partition to one of those to use it",
        "runtime.flower_timeout_s = 5.0 has no effect: it is read only when runtime.executor = 'flower' (here "
        "runtime.executor = 'sequential')",
        "algorithm.mu = 0.7 has no effect: it is read only when algorithm.components is 'both' or 'features' (here "
        "algorithm.components = 'classifier')",
        "algorithm.ccvr.oracle_per_class = 50 has no effect: it is read only when algorithm.ccvr.oracle = 'per_class' "
        "(here algorithm.ccvr.oracle = 'none')"]


def test_a_run_started_from_another_ones_training_copies_exactly_the_lines_it_shares(trained_run, tmp_path, caplog):
    """The lines of the rounds before the kept model, of both metrics files, and nothing after: no line of the
    other run's last round is copied to be dropped again (which the check on opening would say)."""
    import logging

    forked = tmp_path / "forked"
    exp = Experiment(config.load(None, [*TINY, "algorithm.name=fedavg+ccvr", "algorithm.ccvr.epochs=2"]))
    with caplog.at_level(logging.WARNING):
        exp.run(forked, trained=trained_run)
    assert [r.getMessage() for r in caplog.records if "dropping" in r.getMessage()] == []
    for name in ("metrics.jsonl", "client_metrics.jsonl"):
        mine, theirs = ((run / name).read_text().splitlines() for run in (forked, trained_run))
        assert len(mine) == len(theirs) == 3 and mine[:2] == theirs[:2], name


def test_the_run_a_training_came_from_is_named_by_its_absolute_path(trained_run, tmp_path, monkeypatch):
    """``trained`` given relative to the working folder: summary.json's ``trained_in`` names the folder wherever
    the summary is read from (and the resume of the new run finds the same)."""
    monkeypatch.chdir(trained_run.parent)
    exp = Experiment(config.load(None, [*TINY, "algorithm.name=fedavg+ccvr", "algorithm.ccvr.epochs=2"]))
    summary = exp.run(tmp_path / "forked", trained=trained_run.name)
    assert summary["trained_in"] == str(trained_run.resolve())
    assert json.loads((tmp_path / "forked" / "summary.json").read_text())["trained_in"] == str(trained_run.resolve())


def test_a_resume_before_the_first_checkpoint_under_another_configuration_names_five_changes(tmp_path, monkeypatch):
    run = tmp_path / "run"
    killed_after(monkeypatch, config.load(None, [*TINY, "runtime.checkpoint_every=2"]), run, 1)  # no checkpoint
    other = config.load(None, [*TINY, "runtime.checkpoint_every=2", "train.lr=0.5", "seed=3", "train.weight_decay=0.1",
                               "train.batch_size=8", "train.momentum=0.5", "data.alpha=0.3"])
    with pytest.raises(RunDirError) as err:
        set_up(other).run(run, resume=True)
    assert str(err.value) == (f"{run / 'config.toml'}: the interrupted run there (no checkpoint yet) has a different "
                              "configuration (data.alpha: 0.5 -> 0.3; seed: 0 -> 3; train.batch_size: 32 -> 8; "
                              "train.lr: 0.05 -> 0.5; train.momentum: 0.0 -> 0.5; there -> now)")


@needs_accountant
def test_a_resumed_private_run_keeps_its_ledger_and_names_the_release_its_checkpoint_missed(tmp_path, monkeypatch):
    """FedPAC with noise from the operating system, stopped after round 2's release and before its checkpoint:
    the resume opens the run's ledger (every release appended to it), checks it against the checkpoint of
    round 1 and says, through the reporter, that round 2's release counts again."""
    cfg = config.load(None, [*TINY, "algorithm.name=fedpac", "algorithm.dp_epsilon=4",
                             "algorithm.dp_noise_source=os"])
    run = tmp_path / "run"
    killed_after(monkeypatch, cfg, run, 2)
    reporter = Notes()
    summary = set_up(cfg).run(run, resume=True, reporter=reporter)
    ledger = json.loads((run / "privacy_ledger.json").read_text())["releases"]
    assert [e["round"] for e in ledger] == [1, 2, 2, 3] and summary["privacy"]["releases"] == 4
    assert [n for n in reporter.notes if n.startswith("privacy: 1 release")] == [
        "privacy: 1 release(s) of fedpac (round(s) 2) reached the server after the last checkpoint; their noise "
        "came from the operating system, so the rounds run again release fresh noise and every release counts: "
        "the epsilon reported (summary.json privacy.epsilon) will exceed the target"]


def test_a_resume_checks_the_metrics_lines_against_its_checkpoints_record(tmp_path, monkeypatch):
    """A number edited in an earlier round's line of metrics.jsonl (the file still well formed, its rounds in
    order) is caught by the checkpoint's digests of the lines, not continued."""
    run = tmp_path / "run"
    killed_after(monkeypatch, config.load(None, TINY), run, 3)  # the checkpoint of round 2
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    first = json.loads(lines[0])
    lines[0] = json.dumps({**first, "train_loss": first["train_loss"] + 1.0}) + "\n"
    (run / "metrics.jsonl").write_text("".join(lines))
    with pytest.raises(RunDirError, match=r"metrics\.jsonl.*round 1.*the line differs from the one the checkpoint "
                                          r"recorded \(edited\)"):
        set_up(config.load(None, TINY)).run(run, resume=True)


def test_a_resume_of_a_run_stopped_before_it_wrote_anything_writes_its_config_toml(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    set_up(config.load(None, TINY)).run(run, resume=True)
    assert config.load(run / "config.toml") == config.load(None, TINY)


@pytest.mark.parametrize("base", ["dirichlet", "iid"])
def test_a_setting_the_partitions_base_reads_is_not_called_ignored(tmp_path, base):
    """The concept-shift split over a Dirichlet base reads ``data.alpha``; over an IID base it does not."""
    cfg = config.load(None, [*TINY, "train.rounds=1", "data.partition=concept", f"data.base={base}",
                             "data.alpha=0.3"])
    reporter = Notes()
    set_up(cfg).run(tmp_path / "run", reporter=reporter)
    ignored = [n for n in reporter.notes if n.startswith("data.alpha = 0.3 has no effect: the concept partition")]
    assert len(ignored) == (base == "iid")
