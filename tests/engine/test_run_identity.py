"""A run's identity (issue 16, "Run identity"): commands that reuse or group runs decide by the
full resolved configuration, never by a folder name.

Each reproduction of the issue is a test here: ``hetfl compare`` / ``hetfl reproduce`` into a folder
that holds a run of another configuration is an error naming the differing keys (it used to reuse the
old run and table it as the new one); ``hetfl report`` puts runs in one row only when they differ in
nothing but the seed (it used to merge runs of 3 and 6 rounds, or of lr 0.05 and 0.01, into one
"seeds 2" row). Tiny synthetic runs: a second or less each.
"""

from __future__ import annotations

import csv
import json
import re
import tomllib
from pathlib import Path

import pytest

from hetfl import config as config_mod
from hetfl.cli import main
from hetfl.engine import identity
from hetfl.engine.experiment import Experiment
from hetfl.engine.summary import Reporter

pytestmark = pytest.mark.usefixtures("one_thread")


# 10 clients of the synthetic dataset, Dirichlet split, one round: about 0.2 s per run
TINY = ["data.partition=dirichlet", "data.num_clients=10", "train.rounds=1", "runtime.progress=false",
        "runtime.threads=1"]


def sets(*extra: str) -> list[str]:
    return [arg for kv in (*TINY, *extra) for arg in ("--set", kv)]


def compare(out: Path, *extra: str, methods: str = "fedavg", seeds: str = "0", quiet: bool = True) -> int:
    return main(["compare", "--methods", methods, "--seeds", seeds, "--out", str(out), *sets(*extra),
                 *(["--quiet"] if quiet else [])])


def run(out: Path, *extra: str) -> Path:
    assert main(["run", "--out", str(out), *sets(*extra), "--quiet"]) == 0
    return out


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


# ------------------------------------------------------------------ compare
@pytest.mark.parametrize(("key", "first", "second"), [
    ("train.lr", "0.05", "0.5"),
    ("data.alpha", "0.1", "0.5"),
    ("train.rounds", "1", "2"),
])
def test_compare_into_a_folder_with_another_config_is_an_error_naming_the_keys(tmp_path, capsys, key, first,
                                                                               second):
    out = tmp_path / "cmp"
    assert compare(out, f"{key}={first}") == 0
    before = summary(out / "fedavg-seed0")
    table = (out / "comparison.md").read_text()
    capsys.readouterr()
    assert compare(out, f"{key}={second}") == 2
    captured = capsys.readouterr()
    assert "reusing" not in captured.out
    message = captured.err
    assert key in message and first in message and second in message, message
    assert "--out" in message  # tells the user what to do
    assert summary(out / "fedavg-seed0") == before  # the old run is left alone
    assert (out / "comparison.md").read_text() == table  # and no table claims it is the new setting


def test_compare_checks_every_run_before_running_any(tmp_path, capsys):
    """The refusal comes before anything is written: seed 1 (new) is not run when seed 0 clashes."""
    out = tmp_path / "cmp"
    assert compare(out, "train.lr=0.05") == 0
    assert compare(out, "train.lr=0.5", seeds="1,0") == 2
    assert not (out / "fedavg-seed1").exists()


def test_compare_reuses_an_identical_config_whatever_the_progress_setting(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert compare(out, "train.lr=0.05") == 0
    before = summary(out / "fedavg-seed0")
    capsys.readouterr()
    assert compare(out, "train.lr=0.05", "runtime.progress=true", quiet=False) == 0  # progress: display only
    assert "finished earlier, reusing" in capsys.readouterr().out
    assert summary(out / "fedavg-seed0") == before  # not run again


def test_compare_reuse_compares_resolved_configs(tmp_path, capsys):
    """'auto' model and a method's default hyperparameters are filled in before comparing, and a
    config.toml written before a key existed is read through today's default for it."""
    out = tmp_path / "cmp"
    assert compare(out, methods="fedprox") == 0
    config_path = out / "fedprox-seed0" / "config.toml"
    config_path.write_text(config_path.read_text().replace('precision = "fp32"\n', ""))  # an older hetfl's run
    before = summary(out / "fedprox-seed0")
    capsys.readouterr()
    spelled_out = ["model.name=mlp", "model.options={hidden = []}", "algorithm.mu=0.01", "train.precision=fp32"]
    assert compare(out, *spelled_out, methods="fedprox") == 0
    assert "finished earlier, reusing" in capsys.readouterr().out
    assert summary(out / "fedprox-seed0") == before
    assert compare(out, "algorithm.mu=0.1", methods="fedprox") == 2
    assert "algorithm.mu: 0.01 -> 0.1" in capsys.readouterr().err


class StopAfterRound1(Reporter):
    def round_end(self, line):
        raise KeyboardInterrupt


def interrupted_run(run_dir: Path, *extra: str) -> None:
    """A compare run killed after round 1 of 2: config.toml and a checkpoint, no summary."""
    cfg = config_mod.load(None, [*TINY, "train.rounds=2", *extra, "algorithm.name=fedavg", "seed=0"])
    with pytest.raises(KeyboardInterrupt):
        Experiment(cfg).run(run_dir, reporter=StopAfterRound1())
    assert (run_dir / "checkpoint.safetensors").is_file() and not (run_dir / "summary.json").exists()


def test_compare_resumes_an_unfinished_run_of_the_same_config(tmp_path, capsys):
    out = tmp_path / "cmp"
    interrupted_run(out / "fedavg-seed0")
    assert compare(out, "train.rounds=2") == 0
    result = summary(out / "fedavg-seed0")
    assert result["rounds"] == 2
    lines = (out / "fedavg-seed0" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [1, 2]  # round 1 kept, round 2 added


def test_compare_refuses_an_unfinished_run_of_another_config(tmp_path, capsys):
    out = tmp_path / "cmp"
    interrupted_run(out / "fedavg-seed0")
    assert compare(out, "train.rounds=2", "train.lr=0.5") == 2
    assert "train.lr" in capsys.readouterr().err
    assert not (out / "fedavg-seed0" / "summary.json").exists()


def test_compare_refuses_a_non_empty_folder_that_holds_no_run(tmp_path, capsys):
    run_dir = tmp_path / "cmp" / "fedavg-seed0"
    run_dir.mkdir(parents=True)
    (run_dir / "notes.txt").write_text("mine")
    assert compare(tmp_path / "cmp") == 2
    assert "config.toml" in capsys.readouterr().err
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]


def test_compare_rejects_a_repeated_seed(tmp_path, capsys):
    assert compare(tmp_path / "cmp", seeds="0,0") == 2
    assert "--seeds" in capsys.readouterr().err


def test_compare_tables_carry_setting_ids_and_the_keys_that_vary(tmp_path):
    out = tmp_path / "cmp"
    assert compare(out, methods="fedavg,fedprox", seeds="0,1") == 0
    ids = {m: {summary(out / f"{m}-seed{s}")["setting_id"] for s in (0, 1)} for m in ("fedavg", "fedprox")}
    assert all(len(v) == 1 for v in ids.values()) and ids["fedavg"] != ids["fedprox"]
    rows = list(csv.DictReader((out / "comparison.csv").open()))
    assert [(r["method"], r["setting_id"]) for r in rows] == [(m, *ids[m]) for m in ("fedavg", "fedprox")]
    assert "algorithm.mu" not in rows[0]  # fedprox's default mu: no column (the run folders keep it)
    table = (out / "comparison.md").read_text()
    assert "Rows differ in: method;" in table
    for m in ("fedavg", "fedprox"):
        assert f"| {next(iter(ids[m]))} |" in table


def test_compare_help_says_what_is_reused_and_what_is_refused(capsys):
    for command in ("compare", "reproduce"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "reused" in text and "another configuration" in text and "error" in text, command


# ------------------------------------------------------------------ ids in summary.json
def test_summary_holds_setting_and_run_ids_of_the_resolved_config(tmp_path):
    runs = [run(tmp_path / f"s{seed}", f"seed={seed}") for seed in (0, 1)]
    s0, s1 = summary(runs[0]), summary(runs[1])
    assert s0["setting_id"] == s1["setting_id"] and s0["run_id"] != s1["run_id"]
    saved = tomllib.loads((runs[0] / "config.toml").read_text())
    assert saved["model"]["name"] == "mlp"  # resolved: no 'auto' left
    assert (s0["setting_id"], s0["run_id"]) == identity.run_dir_ids(runs[0])  # recomputed from config.toml
    other = summary(run(tmp_path / "lr", "train.lr=0.01"))
    assert other["setting_id"] != s0["setting_id"]


def test_identity_ignores_display_keys_and_names_differences():
    a = config_mod.to_tree(config_mod.load(None, ["train.lr=0.05", "runtime.progress=true"]))
    b = config_mod.to_tree(config_mod.load(None, ["train.lr=0.05", "runtime.progress=false", "seed=3"]))
    c = config_mod.to_tree(config_mod.load(None, ["train.lr=0.5"]))
    assert identity.setting_id(a) == identity.setting_id(b) and identity.run_id(a) != identity.run_id(b)
    assert identity.differing_keys(a, c) == ["train.lr: 0.05 -> 0.5"]
    assert identity.varying_keys([a, b, c]) == ["train.lr"]


# ------------------------------------------------------------------ report
def report(root: Path) -> tuple[str, dict[str, Path]]:
    """One report (plots take seconds) over: a base run, the same with 2 rounds, the same with lr 0.01,
    and the base setting with seed 1 (shown with progress bars, and with a summary from before ids)."""
    runs = {"base": run(root / "base"), "rounds2": run(root / "rounds2", "train.rounds=2"),
            "lr0.01": run(root / "lr0.01", "train.lr=0.01"),
            "seed1": run(root / "seed1", "seed=1", "runtime.progress=true")}
    old = summary(runs["seed1"])
    old.pop("setting_id", None), old.pop("run_id", None)  # a run written before summaries had ids
    (runs["seed1"] / "summary.json").write_text(json.dumps(old))
    out = root / "out"
    assert main(["report", *map(str, runs.values()), "--out", str(out)]) == 0
    return (out / "report.md").read_text(), runs


def row_of(md: str, pattern: str) -> str:
    """The one table row matching ``pattern`` (method, lr, rounds, metric, seeds, ...)."""
    rows = [line for line in md.splitlines() if re.match(pattern, line)]
    assert len(rows) == 1, (pattern, [line for line in md.splitlines() if line.startswith("| ")])
    return rows[0]


@pytest.mark.slow  # 4 runs and a report's plots, ~4 s
def test_report_keeps_runs_of_other_rounds_and_rates_apart_and_groups_seeds_also_for_old_runs(tmp_path):
    """Each check made on one report (three tests once shared it as a module fixture, which pytest-xdist
    then built in each worker that ran one of them): runs of 2 rounds, and of lr 0.01, each in a row of
    their own; the base setting's seeds 0 and 1 in one row, though seed 1's summary predates ids."""
    md, runs = report(tmp_path)
    # runs of different rounds apart: lr 0.05, 2 rounds, its own row, one seed
    row = row_of(md, r"\| fedavg \| 0\.05 \| 2 \| global \| 1 \|")
    assert "| method | train.lr | train.rounds | metric | seeds |" in md
    assert row.endswith(f"| {summary(runs['rounds2']).get('setting_id')} |"), "rounds: " + row
    # runs of different learning rates apart
    row = row_of(md, r"\| fedavg \| 0\.01 \| 1 \| global \| 1 \|")
    assert "Rows differ in: train.lr, train.rounds;" in md
    assert row.endswith(f"| {summary(runs['lr0.01']).get('setting_id')} |"), "learning rate: " + row
    # seeds of one setting grouped, also for a run from before ids: seeds 0 and 1 together
    row = row_of(md, r"\| fedavg \| 0\.05 \| 1 \| global \| 2 \|")
    assert "4 run(s), 3 setting(s)" in md
    assert len([line for line in md.splitlines() if line.startswith("| fedavg")]) == 3, md
    assert row.endswith(f"| {summary(runs['base']).get('setting_id')} |"), "seeds: " + row


def test_report_refuses_the_same_run_twice(tmp_path, capsys):
    one = run(tmp_path / "a")
    assert main(["report", str(one), str(one), "--out", str(tmp_path / "r")]) == 2
    assert "same run" in capsys.readouterr().err


# ------------------------------------------------------------------ reproduce
PRESET = """
[preset]
title = "toy"
paper = "nobody"
metric = "final_global_acc"
seeds = [0]
[base.data]
partition = "dirichlet"
num_clients = 10
[base.train]
rounds = 1
[[columns]]
id = "c"
label = "C"
[[rows]]
label = "A"
algorithm = "fedavg"
"""


def test_reproduce_refuses_a_run_folder_of_another_config_and_reuses_an_identical_one(tmp_path, capsys):
    path = tmp_path / "toy.toml"
    path.write_text(PRESET)
    out = tmp_path / "out"
    argv = ["reproduce", str(path), "--out", str(out), "--quiet", "--set", "runtime.threads=1"]
    assert main(argv) == 0
    run_dir = out / "c" / "fedavg-seed0"
    before, table = summary(run_dir), (out / "reproduction.json").read_text()
    assert main([*argv, "--set", "train.lr=0.5"]) == 2
    message = capsys.readouterr().err
    assert "train.lr" in message and "0.5" in message and "--out" in message, message
    assert summary(run_dir) == before and (out / "reproduction.json").read_text() == table
    assert main(argv) == 0  # identical: reused, not run again
    assert summary(run_dir) == before


# ------------------------------------------------------------------ analyze
def test_analyze_refuses_a_checkpoint_of_another_config_than_config_toml(tmp_path, capsys):
    run_dir = run(tmp_path / "a")
    text = (run_dir / "config.toml").read_text()
    (run_dir / "config.toml").write_text(text.replace("lr = 0.05", "lr = 0.5"))
    assert main(["analyze", str(run_dir), "--only", "curves"]) == 2
    assert "train.lr" in capsys.readouterr().err


def test_analyze_index_names_the_run_it_analysed(tmp_path):
    run_dir = run(tmp_path / "a")
    assert main(["analyze", str(run_dir), "--only", "curves"]) == 0
    index = json.loads((run_dir / "analysis" / "index.json").read_text())
    assert index["run_id"] == summary(run_dir)["run_id"]
