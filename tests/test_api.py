"""The Python API (issue 18, "A Python API"): ``hetfl.run`` and ``hetfl.compare`` from a config
object, a dict or a TOML path plus overrides; result objects; errors as exceptions, never
``SystemExit``; an existing run directory reused, resumed, refused or (explicitly) overwritten.

Tiny synthetic runs (4 clients, logistic regression, 2 rounds of 2 local steps): well under a second each.
"""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

import hetfl
from hetfl import api
from hetfl import config as config_mod
from hetfl.cli import main
from hetfl.engine.experiment import Experiment
from hetfl.params import ConfigError
from tests.helpers.runs import TINY

pytestmark = pytest.mark.usefixtures("one_thread")

#: the same configuration as TINY, as the dict a TOML file gives
TINY_TREE = {"data": {"partition": "iid", "num_clients": 4, "options": {"num_devices": 8, "max_samples": 60}},
             "train": {"rounds": 2, "local_steps": 2}, "runtime": {"threads": 1}}
TINY_TOML = """\
[data]
partition = "iid"
num_clients = 4
options = {num_devices = 8, max_samples = 60}
[train]
rounds = 2
local_steps = 2
[runtime]
threads = 1
"""
TIME_KEYS = {"round_time_s", "eval_time_s", "wall_time_s"}


def numbers(result: hetfl.RunResult) -> tuple[list[dict], dict]:
    """A result's metrics and summary without the wall-clock fields."""
    rows = [{k: v for k, v in m.items() if k not in TIME_KEYS} for m in result.metrics]
    return rows, {k: v for k, v in result.summary.items() if k not in TIME_KEYS}


def files(run_dir: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(run_dir.iterdir()) if p.is_file()}


def interrupt_in_round(monkeypatch, round_: int) -> None:
    """Make the next run stop (KeyboardInterrupt, as Ctrl-C) at the start of ``round_``."""
    original = Experiment.round

    def stop(self, server, clients, r, reporter):
        if r == round_:
            monkeypatch.setattr(Experiment, "round", original)
            raise KeyboardInterrupt
        return original(self, server, clients, r, reporter)

    monkeypatch.setattr(Experiment, "round", stop)


# ------------------------------------------------------------- configuration forms
def test_the_three_config_forms_give_the_same_resolved_config_and_numbers(tmp_path):
    toml = tmp_path / "tiny.toml"
    toml.write_text(TINY_TOML)
    extra = ["train.lr=0.1", "seed=3"]  # overrides apply on top of every form
    by_path = hetfl.run(toml, overrides=extra, out=tmp_path / "path")
    by_dict = hetfl.run(TINY_TREE, overrides=extra, out=tmp_path / "dict")
    by_object = hetfl.run(config_mod.load(None, TINY), overrides=extra, out=tmp_path / "object")
    for result in (by_path, by_dict, by_object):
        assert result.status == "ran" and result.config.train.lr == 0.1 and result.config.seed == 3
        assert len(result.metrics) == 2 and 0 < result.final_accuracy <= 1
    assert by_path.config == by_dict.config == by_object.config
    assert by_path.config.model.name == "mlp", "the resolved configuration (auto model filled in)"
    assert by_path.run_id == by_dict.run_id == by_object.run_id != ""
    assert numbers(by_path) == numbers(by_dict) == numbers(by_object)
    assert TINY_TREE["train"] == {"rounds": 2, "local_steps": 2}, "the caller's dict is not modified"


def test_make_config_rejects_what_is_not_a_config():
    with pytest.raises(ConfigError) as err:
        api.make_config(42)
    assert err.value.key == "config"
    with pytest.raises(ConfigError) as err:
        api.make_config(None, "train.lr=0.1")  # a bare string would be read letter by letter
    assert err.value.key == "overrides"


# ------------------------------------------------------------- errors are exceptions
@pytest.mark.parametrize("form", ["overrides", "dict"])
@pytest.mark.parametrize(("key", "value", "error_key"), [
    ("train.lrr", "0.1", "train.lrr"),  # a bad key
    ("train.lr", "-1", "train.lr"),  # a bad value
    ("algorithm.name", "fedpac", "model.name"),  # a method that needs an encoder, on logistic regression
])
def test_bad_input_raises_a_config_error_naming_the_key_before_anything_is_written(tmp_path, form, key, value,
                                                                                   error_key):
    out = tmp_path / "run"
    if form == "overrides":
        config, overrides = None, [*TINY, f"{key}={value}"]
    else:
        tree = json.loads(json.dumps(TINY_TREE))
        config_mod.apply_override(tree, f"{key}={value}")
        config, overrides = tree, []
    with pytest.raises(ConfigError) as err:  # a SystemExit would escape pytest.raises and fail the test
        hetfl.run(config, overrides=overrides, out=out)
    assert err.value.key == error_key
    assert not out.exists()


def test_compare_errors_are_exceptions(tmp_path):
    out = tmp_path / "cmp"
    with pytest.raises(ConfigError) as err:
        hetfl.compare(["fedavg", "fedavg"], out=out, overrides=TINY)
    assert err.value.key == "methods"
    with pytest.raises(ConfigError) as err:
        hetfl.compare(["fedavg"], seeds=[0, "1"], out=out, overrides=TINY)
    assert err.value.key == "seeds"
    with pytest.raises(ConfigError) as err:
        hetfl.compare(["fedavg"], target=1.5, out=out, overrides=TINY)
    assert err.value.key == "target"
    with pytest.raises(ConfigError) as err:
        hetfl.compare(["fedavg"], out=out, overrides=[*TINY, "train.momentum=2"])
    assert err.value.key == "train.momentum"
    with pytest.raises(ConfigError) as err:
        hetfl.compare(["nosuchmethod"], out=out, overrides=TINY)
    assert err.value.key == "algorithm.name"
    assert not out.exists()


# ------------------------------------------------------------- an existing run directory
def test_a_finished_run_of_the_same_config_is_returned_not_recomputed(tmp_path, monkeypatch):
    out = tmp_path / "run"
    first = hetfl.run(overrides=TINY, out=out)
    before = files(out)

    def no_run(*args, **kwargs):
        raise AssertionError("a finished run was recomputed")

    monkeypatch.setattr(Experiment, "run", no_run)
    again = hetfl.run(TINY_TREE, out=out, progress=True)  # another form; progress is display only
    assert again.status == "reused"
    assert again.summary == first.summary and again.metrics == first.metrics
    assert files(out) == before, "nothing rewritten"
    loaded = hetfl.RunResult.load(out)
    assert loaded.status == "loaded" and loaded.summary == first.summary and loaded.config == first.config


def test_an_interrupted_run_needs_resume_true_and_then_matches_an_uninterrupted_one(tmp_path, monkeypatch):
    config = [*TINY, "train.rounds=3"]
    out = tmp_path / "run"
    interrupt_in_round(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        hetfl.run(overrides=config, out=out)
    assert not (out / "summary.json").exists() and (out / "config.toml").exists()
    with pytest.raises(hetfl.RunDirError, match=r"interrupted run .*1 round.*resume=True"):
        hetfl.run(overrides=config, out=out)
    with pytest.raises(hetfl.RunDirError, match="not finished"):
        hetfl.RunResult.load(out)
    resumed = hetfl.run(overrides=config, out=out, resume=True)
    assert resumed.status == "resumed" and len(resumed.metrics) == 3
    whole = hetfl.run(overrides=config, out=tmp_path / "whole")
    assert numbers(resumed) == numbers(whole)
    assert hetfl.run(out / "config.toml", out=out, resume=True).status == "reused", "a run's own config.toml"


def test_a_run_of_another_config_is_refused_naming_the_key(tmp_path):
    out = tmp_path / "run"
    hetfl.run(overrides=TINY, out=out)
    before = files(out)
    with pytest.raises(hetfl.RunDirError, match=r"another configuration \(train\.lr: 0\.05 -> 0\.2"):
        hetfl.run(overrides=[*TINY, "train.lr=0.2"], out=out)
    with pytest.raises(hetfl.RunDirError, match="another configuration"):
        hetfl.run(overrides=[*TINY, "train.lr=0.2"], out=out, resume=True)
    assert files(out) == before


def test_overwrite_replaces_a_run_but_never_deletes_another_folder(tmp_path):
    out = tmp_path / "run"
    hetfl.run(overrides=TINY, out=out)
    (out / "analysis").mkdir()  # what hetfl analyze adds to a run directory goes with it
    (out / "analysis" / "curves.png").write_bytes(b"png")
    replaced = hetfl.run(overrides=[*TINY, "train.lr=0.2"], out=out, overwrite=True)
    assert replaced.status == "ran" and replaced.config.train.lr == 0.2
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.safetensors", "client_metrics.jsonl", "config.toml",
                                                     "metrics.jsonl", "summary.json"]
    again = hetfl.run(overrides=[*TINY, "train.lr=0.2"], out=out, overwrite=True)  # the same config: recomputed
    assert again.status == "ran"

    notes = tmp_path / "notes"  # a folder of other files, given by mistake
    notes.mkdir()
    (notes / "mine.txt").write_text("keep me")
    (notes / "config.toml").write_text(config_mod.dumps(config_mod.load(None, TINY)))  # a config alone is no run
    with pytest.raises(hetfl.RunDirError, match=r"holds files \(config.toml, mine.txt\) but no hetfl run"):
        hetfl.run(overrides=TINY, out=notes, overwrite=True)
    assert sorted(p.name for p in notes.iterdir()) == ["config.toml", "mine.txt"]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert hetfl.run(overrides=TINY, out=empty, overwrite=True).status == "ran"


def test_overwrite_never_deletes_the_users_files_in_a_run_folder(tmp_path):
    """Issue 26, item 11: a finished run folder holding the user's NOTES.md and my_notes/ beside hetfl's files:
    overwrite=True refuses, naming them, and deletes nothing (not even hetfl's own files)."""
    out = tmp_path / "run"
    hetfl.run(overrides=TINY, out=out)
    (out / "NOTES.md").write_text("my notes")
    (out / "my_notes").mkdir()
    (out / "my_notes" / "day1.txt").write_text("keep me")
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    with pytest.raises(hetfl.RunDirError, match=r"NOTES\.md, my_notes") as err:
        hetfl.run(overrides=[*TINY, "train.lr=0.2"], out=out, overwrite=True)
    assert "not written by hetfl" in str(err.value)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before
    assert (out / "my_notes" / "day1.txt").read_text() == "keep me"


def test_overwrite_removes_every_file_hetfl_writes_in_a_run_folder(tmp_path):
    """What hetfl itself writes in a run folder (tracking state, TensorBoard events, client models, the Flower
    nodes' state, hetfl analyze's and hetfl report's folders) goes with the run; the names are the modules' own."""
    from hetfl import tracking
    from hetfl.analysis.run import OUT_DIR
    from hetfl.engine.checkpoint import CHECKPOINT_NAME, TRAINED_NAME
    from hetfl.engine.experiment import CLIENT_MODELS_DIR
    from hetfl.engine.ledger import LEDGER_NAME
    from hetfl.engine.rundir import RUN_ENTRIES
    from hetfl.flower.protocol import NODES_DIR

    assert {tracking.STATE_NAME, tracking.TENSORBOARD_DIR, OUT_DIR, CLIENT_MODELS_DIR, NODES_DIR, "report",
            LEDGER_NAME, CHECKPOINT_NAME, TRAINED_NAME} <= RUN_ENTRIES
    out = tmp_path / "run"
    hetfl.run(overrides=TINY, out=out)
    for folder in (tracking.TENSORBOARD_DIR, OUT_DIR, CLIENT_MODELS_DIR, NODES_DIR, "report"):
        (out / folder).mkdir()
        (out / folder / "x.bin").write_bytes(b"x")
    (out / tracking.STATE_NAME).write_text("{}")
    assert hetfl.run(overrides=[*TINY, "train.lr=0.2"], out=out, overwrite=True).status == "ran"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.safetensors", "client_metrics.jsonl", "config.toml",
                                                     "metrics.jsonl", "summary.json"]


def test_overwrite_checks_the_new_config_before_deleting_the_old_run(tmp_path):
    out = tmp_path / "run"
    hetfl.run(overrides=TINY, out=out)
    before = files(out)
    with pytest.raises(ConfigError) as err:
        hetfl.run(overrides=[*TINY, "algorithm.name=fedpac"], out=out, overwrite=True)
    assert err.value.key == "model.name"
    with pytest.raises(ConfigError) as err:
        hetfl.run(overrides=TINY, out=out, overwrite=True, resume=True)
    assert err.value.key == "overwrite"
    assert files(out) == before


def test_the_default_run_dir_is_the_clis(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = hetfl.run(overrides=[*TINY, "seed=2"])
    assert result.run_dir.parent == Path("runs") and result.run_dir.name.endswith("-fedavg-synthetic-seed2")
    assert (tmp_path / result.run_dir / "summary.json").is_file()


def test_default_run_dirs_of_runs_started_in_the_same_second_are_distinct(tmp_path, monkeypatch, capsys):
    """The default folder names the second a run starts: runs started in the same second (a loop of tiny runs,
    ``hetfl run ... &`` twice) each get their own folder. The second once got the first's folder: hetfl.run
    refused it as "a run of another configuration" and suggested deleting it or overwrite=True (the first
    run, which the user never named), hetfl run exited 2 with "in use by another hetfl run"."""
    import datetime as real_dt

    class FrozenDatetime(real_dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 1, 2, 3, 4, 5)

    monkeypatch.setattr("hetfl.console.dt", types.SimpleNamespace(datetime=FrozenDatetime))
    monkeypatch.chdir(tmp_path)
    dirs = [hetfl.run(overrides=[*TINY, f"train.lr={lr}"]).run_dir for lr in (0.01, 0.1)]
    assert main(["run", "--quiet", *[a for kv in [*TINY, "train.lr=0.2"] for a in ("--set", kv)]]) == 0
    dirs.append(Path(capsys.readouterr().out.split("run directory: ")[1].strip()))
    assert len(set(dirs)) == 3 and all(d.name.endswith("-fedavg-synthetic-seed0") for d in dirs), dirs
    assert sorted(dirs) == dirs, "in the order they started"
    assert [config_mod.load(tmp_path / d / "config.toml").train.lr for d in dirs] == [0.01, 0.1, 0.2]


# ------------------------------------------------------------- results
def test_final_accuracy_is_the_metric_the_tables_pick(tmp_path):
    global_run = hetfl.run(overrides=TINY, out=tmp_path / "fedavg")
    assert global_run.metric == "global"
    assert global_run.final_accuracy == global_run.summary["final_global_acc"] == global_run.metrics[-1]["global_acc"]
    assert global_run.best_accuracy == max(m["global_acc"] for m in global_run.metrics)
    personal = hetfl.run(overrides=[*TINY, "algorithm.name=local"], out=tmp_path / "local")
    assert personal.metric == "client mean" and "final_global_acc" not in personal.summary
    assert personal.final_accuracy == personal.summary["final_client_acc_mean"] != global_run.final_accuracy


def test_to_dataframe_needs_pandas_and_says_so(tmp_path, monkeypatch):
    result = hetfl.run(overrides=TINY, out=tmp_path / "run")
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas raises ImportError
    with pytest.raises(ImportError, match="needs pandas.*pip install pandas"):
        result.to_dataframe()
    fake = types.ModuleType("pandas")
    fake.DataFrame = lambda rows: ("frame", rows)
    monkeypatch.setitem(sys.modules, "pandas", fake)
    assert result.to_dataframe() == ("frame", result.metrics)


# ------------------------------------------------------------- compare
def test_compare_returns_the_rows_hetfl_compare_writes(tmp_path, capsys):
    out = tmp_path / "cmp"
    table = hetfl.compare("fedavg,local", seeds=[0, 1], overrides=TINY, out=out, target=0.5)
    assert [r.status for r in table.runs] == ["ran"] * 4
    assert [(r.config.algorithm.name, r.config.seed) for r in table.runs] == [
        ("fedavg", 0), ("fedavg", 1), ("local", 0), ("local", 1)]
    assert [(row["method"], row["metric"], row["seeds"]) for row in table.rows] == [
        ("fedavg", "global", 2), ("local", "client mean", 2)]
    mean = sum(r.final_accuracy for r in table.runs[:2]) / 2
    assert table.rows[0]["final_mean"] == pytest.approx(mean)  # one unit: fractions, as RunResult
    assert table.markdown == (out / "comparison.md").read_text()
    assert table.csv == (out / "comparison.csv").read_bytes().decode()

    # the same call on the command line reuses the four runs and writes the same tables
    argv = ["compare", "--methods", "fedavg,local", "--seeds", "0,1", "--out", str(out), "--target", "0.5", "--quiet"]
    assert main([*argv, *(a for kv in TINY for a in ("--set", kv))]) == 0
    assert capsys.readouterr().out.count("finished earlier, reusing") == 4
    written = list(csv.DictReader(io.StringIO((out / "comparison.csv").read_text())))
    assert written == [{k: "" if v is None else str(v) for k, v in row.items()} for row in table.rows]
    assert (out / "comparison.md").read_text() == table.markdown
    again = hetfl.compare(["fedavg", "local"], seeds=(0, 1), overrides=TINY, out=out, target=0.5)
    assert [r.status for r in again.runs] == ["reused"] * 4 and again.rows == table.rows


def test_compare_refuses_a_folder_of_another_config_before_running_anything(tmp_path):
    out = tmp_path / "cmp"
    hetfl.compare(["fedavg"], overrides=TINY, out=out)
    with pytest.raises(hetfl.RunDirError, match=r"fedavg-seed0: holds a run of another configuration.*train\.lr"):
        hetfl.compare(["fedprox", "fedavg"], overrides=[*TINY, "train.lr=0.2"], out=out)
    assert sorted(p.name for p in out.iterdir()) == ["comparison.csv", "comparison.md", "curves.csv", "curves.png",
                                                    "fedavg-seed0"]


# ------------------------------------------------------------- the package
def test_the_api_is_served_lazily_and_import_hetfl_stays_cheap():
    from hetfl import api, tables

    assert hetfl.compare is api.compare and hetfl.run is api.run and tables.table_rows is not None
    code = ("import sys, hetfl; assert 'torch' not in sys.modules, 'import hetfl pulls torch';"
            "from hetfl import compare, run; assert callable(compare) and callable(run); print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("out", [None, "", 3])
def test_compare_and_sweep_need_a_folder_named_out(out):
    """Not pathlib's TypeError: the API's own error, naming out."""
    for call in (lambda: hetfl.compare(["fedavg"], out=out), lambda: hetfl.sweep({"train.lr": [0.1]}, out=out)):
        with pytest.raises(ConfigError, match=r"^out = .*: must be a folder path for the runs and comparison\.md"):
            call()


def test_an_override_without_a_value_is_named_as_the_apis_argument(tmp_path):
    for call in (lambda: hetfl.run(None, overrides=["train.rounds"], out=tmp_path / "r"),
                 lambda: hetfl.compare(["fedavg"], overrides=["train.rounds"], out=tmp_path / "c")):
        with pytest.raises(ConfigError, match=r"^overrides = 'train.rounds': each override must be a 'KEY=VALUE'"):
            call()
    assert not (tmp_path / "r").exists() and not (tmp_path / "c").exists()


@pytest.mark.parametrize("methods", ["fedavg,,fedprox", "fedavg,", ["fedavg", ""], ["fedavg", " "]])
def test_an_empty_method_name_is_refused_not_skipped(tmp_path, methods):
    """``"fedavg,,fedprox"`` is a typo (a method left out?): a ConfigError naming ``methods``, before anything is
    written, as ``hetfl compare --methods`` refuses it."""
    with pytest.raises(ConfigError, match=r"^methods = .*empty"):
        hetfl.compare(methods, overrides=["train.rounds=1"], out=tmp_path / "c")
    assert not (tmp_path / "c").exists()
