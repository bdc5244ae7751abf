"""What ``overwrite=True`` deletes (``hetfl.runs.clear_run_dir``): what mutation testing of the module
(``benchmarks/mutation.py`` target ``runs``, session 42) showed the API's tests leave unchecked.

Only a folder holding a hetfl run, or nothing, is cleared; only hetfl's own files; nothing while a file of the
user's is there; a link inside the run is removed, never followed (its target is the user's); a path that is a
file or a link is refused; and before a privacy ledger is deleted, the releases it recorded are said (they stay
spent). The refusals name the option, the folder and the files, word for word.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from hetfl import config, runs
from hetfl.engine.ledger import LEDGER_VERSION
from hetfl.engine.rundir import RunDirError


def make_run(folder: Path, *, ledger: str | None = None) -> Path:
    """A folder holding what a finished run leaves: its configuration, metrics, summary, a sub-folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text(config.dumps(config.load(None, [])))
    (folder / "metrics.jsonl").write_text('{"round": 1}\n')
    (folder / "summary.json").write_text("{}")
    (folder / "tensorboard").mkdir()
    (folder / "tensorboard" / "events").write_text("e")
    if ledger is not None:
        (folder / "privacy_ledger.json").write_text(ledger)
    return folder


def test_a_run_is_its_readable_configuration_and_one_of_its_outputs(tmp_path):
    run = make_run(tmp_path / "r")
    assert runs.holds_run(run)
    for output in ("metrics.jsonl", "summary.json"):
        (run / output).unlink()
    assert not runs.holds_run(run)  # a configuration alone is no run
    (run / "checkpoint.safetensors").write_bytes(b"")
    assert runs.holds_run(run)
    (run / "config.toml").write_text("this is [not toml")
    assert not runs.holds_run(run)


def test_overwrite_removes_hetfls_files_and_keeps_the_folder(tmp_path):
    run = make_run(tmp_path / "r")
    runs.clear_run_dir(run)
    assert run.is_dir() and list(run.iterdir()) == []  # the lock it was cleared under released too


def test_a_link_inside_a_run_is_removed_and_its_target_kept(tmp_path):
    run = make_run(tmp_path / "r")
    theirs = tmp_path / "their_reports"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("mine")
    (run / "report").symlink_to(theirs, target_is_directory=True)
    runs.clear_run_dir(run)
    assert list(run.iterdir()) == [] and (theirs / "keep.txt").read_text() == "mine"


def test_nothing_is_removed_while_a_file_of_the_users_is_beside_the_run(tmp_path):
    run = make_run(tmp_path / "r")
    (run / "notes.txt").write_text("mine")
    before = sorted(p.name for p in run.iterdir())
    with pytest.raises(RunDirError) as err:
        runs.clear_run_dir(run, "out")
    assert str(err.value) == (f"out {run}: holds files not written by hetfl (notes.txt) beside its run; "
                              "overwrite=True removes only hetfl's files and deletes nothing while others are there. "
                              "Move them out, or pick another out")
    assert sorted(p.name for p in run.iterdir()) == before


def test_a_folder_of_files_that_is_no_run_is_refused_naming_five_of_them(tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    for name in ("f", "e", "d", "c", "b", "a"):
        (folder / name).write_text("")
    with pytest.raises(RunDirError) as err:
        runs.clear_run_dir(folder, "runs_dir")
    assert str(err.value) == (f"runs_dir {folder}: holds files (a, b, c, d, e, ...) but no hetfl run; overwrite=True "
                              "removes only a hetfl run directory or an empty folder. Pick another runs_dir")
    assert len(list(folder.iterdir())) == 6
    assert runs._shown(["b", "a"]) == "a, b" and runs._shown([]) == ""
    assert runs._shown("abcde") == "a, b, c, d, e"


def test_an_empty_folder_or_none_is_left_as_it_is(tmp_path):
    runs.clear_run_dir(tmp_path / "nowhere")
    assert not (tmp_path / "nowhere").exists()
    (tmp_path / "empty").mkdir()
    runs.clear_run_dir(tmp_path / "empty")
    assert (tmp_path / "empty").is_dir()


@pytest.mark.parametrize("kind", ["file", "link"])
def test_a_path_that_is_no_folder_is_refused(tmp_path, kind):
    run = make_run(tmp_path / "r")
    path = tmp_path / "out"
    if kind == "file":
        path.write_text("")
    else:
        path.symlink_to(run, target_is_directory=True)  # a link to a run: the run is not cleared through it
    with pytest.raises(RunDirError) as err:
        runs.clear_run_dir(path, "out")
    assert str(err.value) == (f"out {path}: is not a folder; overwrite=True removes only a folder holding a hetfl "
                              "run. Pick another out")
    assert runs.holds_run(run) and (run / "tensorboard" / "events").is_file()


def test_a_deleted_ledger_says_how_many_releases_it_recorded(tmp_path, caplog):
    release = {"method": "ccvr", "round": 1, "multiplier": 1.5, "noise_source": "seeded", "digest": "ab"}
    ledger = json.dumps({"version": LEDGER_VERSION, "releases": [release, {**release, "round": 2}]})
    run = make_run(tmp_path / "r", ledger=ledger)
    with caplog.at_level(logging.WARNING, logger="hetfl"):
        runs.warn_spent_releases(run, run / "privacy_ledger.json")
    (said,) = [r.getMessage() for r in caplog.records]
    assert said == (f"overwrite=True: {run} held a run whose privacy ledger recorded 2 differentially private "
                    "release(s) of its clients' data; deleting the record does not undo them, and the new run's "
                    "privacy report counts only its own releases")
    caplog.clear()
    (run / "privacy_ledger.json").write_text("{broken")
    with caplog.at_level(logging.WARNING, logger="hetfl"):
        runs.clear_run_dir(run)
    (message,) = [r.getMessage() for r in caplog.records]
    assert message == (f"overwrite=True: {run} held a run whose privacy ledger recorded an unreadable number of "
                       "differentially private release(s) of its clients' data; deleting the record does not undo "
                       "them, and the new run's privacy report counts only its own releases")
    assert list(run.iterdir()) == []


def test_the_option_named_by_default_is_out(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(RunDirError, match=rf"^out {tmp_path / 'f'}: is not a folder;"):
        runs.clear_run_dir(tmp_path / "f")


def test_the_releases_are_said_on_hetfls_logger(tmp_path, caplog):
    run = make_run(tmp_path / "r", ledger="{}")
    with caplog.at_level(logging.WARNING, logger="hetfl"):
        runs.warn_spent_releases(run, run / "privacy_ledger.json")
    assert [r.name for r in caplog.records] == ["hetfl"]


def test_an_interrupted_run_is_named_with_the_rounds_it_logged(tmp_path):
    run = make_run(tmp_path / "r")
    (run / "metrics.jsonl").write_text('{"round": 1}\n\n{"round": 2}\n')  # a blank line is no round
    assert str(runs.unfinished_error(run)) == (
        f"out {run}: holds an interrupted run of this configuration (2 round(s) in metrics.jsonl, no summary.json); "
        "pass resume=True to continue it, or overwrite=True to start it again")
    (run / "metrics.jsonl").unlink()
    assert "(0 round(s) in metrics.jsonl" in str(runs.unfinished_error(run))


def test_overwrite_is_suggested_for_a_run_of_another_configuration_only(tmp_path):
    run = make_run(tmp_path / "r")
    other = config.load(None, ["train.lr=0.2"])
    with pytest.raises(RunDirError) as err:
        runs.state_or_overwrite_hint(other, run)
    assert str(err.value).startswith(f"{run}: holds a run of another configuration (")
    assert str(err.value).endswith(f". Pick another out for this configuration, or delete {run} to replace that "
                                   "run, or pass overwrite=True to replace it")
    files = tmp_path / "files"
    files.mkdir()
    (files / "x").write_text("")
    with pytest.raises(RunDirError) as err:
        runs.state_or_overwrite_hint(other, files)
    assert str(err.value) == (f"{files}: holds files but no readable config.toml, so no hetfl run to reuse or resume; "
                              "pick another out (or empty that folder)")
