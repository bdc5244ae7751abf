"""A run's identity, function by function (``hetfl.engine.identity``): what mutation testing of the module
(``benchmarks/mutation.py`` target ``engine_identity``, session 41) showed the command-level tests of
``test_run_identity.py`` leave unchecked.

Which keys differ between two configurations (a key only one of them has, values compared whatever their
tables' order, values that are not JSON), which vary over a set of runs, which settings act only after training
(the post-hoc steps' own, but ``every_round``), what a folder holds for a planned run and the refusals' words.
Plain config trees, no run.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path

import pytest

from hetfl import config as config_mod
from hetfl.engine import identity
from hetfl.engine.identity import (
    check_run_dir,
    differing_keys,
    posthoc_keys,
    run_dir_ids,
    run_id,
    setting_id,
    training_id,
    training_keys,
    varying_keys,
)
from hetfl.engine.rundir import RunDirError


def tree(*sets: str) -> dict:
    """A resolved configuration tree, as a run directory's config.toml holds it."""
    return config_mod.to_tree(config_mod.load(None, list(sets)))


def test_flatten_names_nested_keys_and_keeps_empty_tables():
    assert identity.flatten({"a": {"b": 1, "c": {"d": [2]}}, "e": {}, "f": "x"}) == {
        "a.b": 1, "a.c.d": [2], "e": {}, "f": "x"}
    assert identity.flatten({"b": 1}, "a.") == {"a.b": 1}


def test_ids_are_12_hex_digits_of_the_keys_whatever_their_order_and_the_seed_only_in_the_run_id():
    a, b = {"train": {"lr": 0.1, "rounds": 2}, "seed": 0}, {"seed": 1, "train": {"rounds": 2, "lr": 0.1}}
    assert setting_id(a) == setting_id(b) and run_id(a) != run_id(b)
    assert len(run_id(a)) == 12 and int(run_id(a), 16) >= 0
    assert run_id(a) == run_id({"train": {"rounds": 2, "lr": 0.1}, "seed": 0})
    assert setting_id({"runtime": {"progress": True}, "seed": 0}) == setting_id({"runtime": {"progress": False}})
    assert setting_id({"x": Path("a")}) != setting_id({"x": Path("b")})  # not JSON: compared as text
    # a table inside a list is one value, compared whatever its keys' order
    assert run_id({"x": [{"p": 1, "q": 2}]}) == run_id({"x": [{"q": 2, "p": 1}]})


def test_an_id_is_the_sha256_of_the_keys_as_compact_sorted_json():
    """Pinned: summaries and tables of runs written by earlier releases carry these ids."""
    expected = hashlib.sha256(b'{"seed":0,"train.lr":0.1,"x":[{"p":1,"q":2}]}').hexdigest()[:12]
    assert run_id({"train": {"lr": 0.1}, "x": [{"q": 2, "p": 1}], "seed": 0}) == expected


def test_the_post_hoc_steps_own_settings_are_post_hoc_but_every_round():
    t = {"algorithm": {"name": "fedavg+ccvr+finetune", "lr": 0.1,
                       "ccvr": {"epochs": 5, "every_round": False}, "finetune": {"steps": 3}},
         "ccvr": {"epochs": 1}}
    assert posthoc_keys(t) == {"algorithm.ccvr.epochs", "algorithm.finetune.steps"}
    assert posthoc_keys({"algorithm": {"name": "fedavg", "ccvr": {"epochs": 5}}}) == set()
    assert posthoc_keys({"seed": 0}) == set()
    assert training_keys(t) == {"algorithm.name": "fedavg+ccvr+finetune", "algorithm.lr": 0.1,
                                "algorithm.ccvr.every_round": False, "ccvr.epochs": 1}


def test_runs_that_differ_only_after_training_share_a_training_id():
    def resolved(*sets: str) -> dict:  # the post-hoc step's settings filled in, as a run directory is read
        return identity.canonical_tree(tree("algorithm.name=fedavg+ccvr", *sets))

    base, later, every = resolved(), resolved("algorithm.ccvr.epochs=7"), resolved("algorithm.ccvr.every_round=true")
    epochs = base["algorithm"]["ccvr"]["epochs"]
    assert epochs != 7 and base["algorithm"]["ccvr"]["every_round"] is False
    assert training_id(base) == training_id(later) and run_id(base) != run_id(later)
    assert training_id(every) != training_id(base)  # a step after every round changes the training after it
    assert training_id(resolved("seed=1")) != training_id(base)
    assert differing_keys(base, later, training_only=True) == []
    assert differing_keys(base, later) == [f"algorithm.ccvr.epochs: {epochs!r} -> 7"]
    assert differing_keys(base, every, training_only=True) == ["algorithm.ccvr.every_round: False -> True"]


def test_differing_keys_names_each_key_with_both_values_and_unset_for_a_missing_one():
    a = {"seed": 0, "train": {"lr": 0.1, "rounds": 2}, "algorithm": {"name": "fedavg"}}
    b = {"seed": 1, "train": {"lr": 0.5, "rounds": 2}, "algorithm": {"name": "fedprox", "mu": 0.01}}
    assert differing_keys(a, b) == ["algorithm.mu: '(unset)' -> 0.01", "algorithm.name: 'fedavg' -> 'fedprox'",
                                    "seed: 0 -> 1", "train.lr: 0.1 -> 0.5"]
    assert differing_keys(b, a, with_seed=False) == ["algorithm.mu: 0.01 -> '(unset)'",
                                                     "algorithm.name: 'fedprox' -> 'fedavg'", "train.lr: 0.5 -> 0.1"]
    assert differing_keys(a, a) == []


def test_values_are_compared_whatever_their_tables_order_and_also_when_they_are_not_json():
    a = {"model": {"options": {"hidden": [16], "act": "relu"}}, "data": {"root": Path("/d")}}
    b = {"model": {"options": {"act": "relu", "hidden": [16]}}, "data": {"root": Path("/d")}}
    # flatten keeps a non-empty table as keys; a table inside a list is compared as one value
    a["x"], b["x"] = [{"q": 2, "p": 1}], [{"p": 1, "q": 2}]
    assert differing_keys(a, b) == [] and differing_keys(b, a) == []
    assert varying_keys([a, b]) == []
    b["data"]["root"] = Path("/e")
    assert differing_keys(a, b) == ["data.root: PosixPath('/d') -> PosixPath('/e')"]


def test_varying_keys_are_those_not_equal_in_every_tree_without_the_seed():
    trees = [{"seed": s, "train": {"lr": lr, "rounds": 2}} for s, lr in ((0, 0.1), (1, 0.1), (2, 0.5))]
    assert varying_keys(trees) == ["train.lr"]
    assert varying_keys(trees[:2]) == []
    assert varying_keys([{"seed": 0}, {"seed": 0, "extra": 1}]) == ["extra"]
    assert varying_keys([]) == []


def test_a_plug_ins_recorded_code_stays_in_the_configuration_read_back():
    t = tree()
    t["algorithm"]["plugin_source"] = "my_method.py sha256:0123456789abcdef"
    assert identity.canonical_tree(t)["algorithm"]["plugin_source"] == "my_method.py sha256:0123456789abcdef"


@pytest.mark.parametrize("written", [{"algorithm": "fedavg"}, {"algorithm": {"lr": 1}}, {"seed": 0},
                                     {"algorithm": {"name": 3}}])
def test_a_tree_without_a_methods_name_is_read_as_written(written):
    assert identity.as_written(written) is written


# ------------------------------------------------------------------ run directories
def write_run(run_dir: Path, t: dict, *, finished: bool) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text(config_mod.dumps(config_mod.from_tree(t)))
    if finished:
        (run_dir / "summary.json").write_text("{}")
    return run_dir


def test_what_a_folder_holds_for_a_planned_run(tmp_path):
    planned = tree("train.rounds=2")
    assert check_run_dir(tmp_path / "absent", planned) == "new"
    (tmp_path / "empty").mkdir()
    assert check_run_dir(tmp_path / "empty", planned) == "new"
    (tmp_path / "locked").mkdir()
    (tmp_path / "locked" / ".lock").write_text("")
    assert check_run_dir(tmp_path / "locked", planned) == "new"
    assert check_run_dir(write_run(tmp_path / "done", planned, finished=True), planned) == "finished"
    assert check_run_dir(write_run(tmp_path / "cut", planned, finished=False), planned) == "unfinished"


def test_a_folder_that_cannot_hold_the_planned_run_is_refused_in_words_that_say_what_to_do(tmp_path):
    planned = tree("train.rounds=2")
    (tmp_path / "file").write_text("")
    with pytest.raises(RunDirError) as err:
        check_run_dir(tmp_path / "file", planned, option="--runs")
    assert str(err.value) == f"{tmp_path / 'file'}: exists and is not a folder; pick another --runs"
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("")
    with pytest.raises(RunDirError) as err:
        check_run_dir(tmp_path / "notes", planned)
    assert str(err.value) == (f"{tmp_path / 'notes'}: holds files but no readable config.toml, so no hetfl run to "
                              "reuse or resume; pick another --out (or empty that folder)")


@pytest.mark.parametrize("changed", [1, 4, 5, 6])
def test_a_run_of_another_configuration_is_refused_naming_four_differences_and_counting_the_rest(tmp_path, changed):
    sets = ["train.rounds=3", "train.lr=0.5", "train.batch_size=7", "train.local_steps=3", "data.alpha=0.7",
            "seed=9"][:changed]
    saved, planned = tree(*sets), tree()
    run = write_run(tmp_path / "run", saved, finished=True)
    diffs = differing_keys(identity.saved_tree(run), planned)
    assert len(diffs) == changed
    with pytest.raises(RunDirError) as err:
        check_run_dir(run, planned)
    more = f"; and {changed - 4} more" if changed > 4 else ""
    assert str(err.value) == (f"{run}: holds a run of another configuration ({'; '.join(diffs[:4])}{more}; there -> "
                              f"now). Pick another --out for this configuration, or delete {run} to replace that run")


def test_a_folder_without_a_configuration_has_no_ids(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"final_global_acc": 0.5}))
    with pytest.raises(FileNotFoundError) as err:
        run_dir_ids(tmp_path)
    assert str(err.value) == f"{tmp_path}: no config.toml"


def test_a_summarys_configuration_stands_for_a_missing_config_toml_and_damaged_files_for_none(tmp_path):
    t = tree("train.rounds=3")
    (tmp_path / "summary.json").write_text(json.dumps({"config": t}))
    assert run_dir_ids(tmp_path) == (setting_id(t), run_id(t))
    (tmp_path / "summary.json").write_text("{cut")
    assert identity.saved_tree(tmp_path) is None
    (tmp_path / "config.toml").write_text("[train\n")
    assert identity.saved_tree(tmp_path) is None


def test_a_saved_configuration_with_overrides_is_what_a_resume_goes_by(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(config_mod.dumps(config_mod.load(None, ["train.rounds=3"])))
    cfg = identity.load_run_config(path, ["runtime.progress=false"])
    assert cfg.train.rounds == 3 and cfg.runtime.progress is False
    assert identity.load_run_config(path).runtime.progress is True
    assert tomllib.loads(path.read_text())["train"]["rounds"] == 3
