"""Sweeps (hetfl.sweeps): grids over any configuration keys on the command line (``--grid``, ``--sweep``) and
in Python (``hetfl.sweep``), one table row per method and cell, resumable; the run counter and its time
left in compare, sweeps and reproduce; the presets' time estimates labelled measured or rough.

Tiny synthetic runs (4 clients, logistic regression, 1-2 rounds of 1-2 local steps): well under a second each.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
from pathlib import Path

import pytest
from rich.console import Console

import hetfl
from hetfl import config, reproduce, runs, runtimes, sweeps, tables
from hetfl.api import make_config
from hetfl.cli import main
from hetfl.config import parse_value
from hetfl.engine.experiment import Experiment
from hetfl.params import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


TINY = ["data.partition=iid", "data.num_clients=4", "data.options={num_devices=8, max_samples=60}",
        "train.rounds=2", "train.local_steps=2", "runtime.threads=1"]
GRID = {"train.lr": [0.05, 0.2]}


def files(run_dir: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(run_dir.iterdir()) if p.is_file()}


def set_args(assignments: list[str]) -> list[str]:
    return [a for kv in assignments for a in ("--set", kv)]


def no_runs(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a run started")

    monkeypatch.setattr(Experiment, "run", refuse)


# ------------------------------------------------------------- grid values, as --set parses them
def test_grid_options_parse_values_as_set_does_and_split_only_top_level_commas():
    assert sweeps.parse_grid_option("train.lr=0.01,0.1") == ("train.lr", [0.01, 0.1])
    assert sweeps.parse_grid_option("data.partition=iid, dirichlet") == ("data.partition", ["iid", "dirichlet"])
    key, values = sweeps.parse_grid_option('model.options={hidden = [16, 8]},{hidden = []}')
    assert key == "model.options" and values == [{"hidden": [16, 8]}, {"hidden": []}]
    assert sweeps.parse_grid_option('model.name="a,b",mlp') == ("model.name", ["a,b", "mlp"])
    assert sweeps.parse_grid_option("data.angles=[0, 90],[45]")[1] == [[0, 90], [45]]
    for value in (0.01, 1e-05, 3, True, "sgd", [1, 2.5], {"alpha": 1.0, "hidden": [4]}, "quote\"d"):
        assert parse_value(sweeps.toml_literal(value)) == value, value


def test_a_sweep_file_holds_a_grid_table(tmp_path):
    path = tmp_path / "sweep.toml"
    path.write_text('[grid]\n"train.lr" = [0.01, 0.1]\ndata.alpha = [0.1, 0.5]\n')
    assert sweeps.read_sweep_file(path) == {"train.lr": [0.01, 0.1], "data.alpha": [0.1, 0.5]}
    path.write_text('[grid]\n"train.lr" = 0.01\n')
    with pytest.raises(ConfigError, match="takes a list of values") as err:
        sweeps.read_sweep_file(path)
    assert err.value.key == "train.lr"
    path.write_text('[grids]\n"train.lr" = [0.01]\n')
    with pytest.raises(ConfigError, match=r"one \[grid\] table.*grids") as err:
        sweeps.read_sweep_file(path)
    assert err.value.key == "--sweep"


@pytest.mark.parametrize(("grid", "overrides", "key", "says"), [
    ({"train.lrr": [0.1]}, [], "train.lrr", "not a configuration key; train. has: rounds"),
    ({"optimizer.lr": [0.1]}, [], "optimizer.lr", "not a configuration key"),
    ({"train.lr.x": [0.1]}, [], "train.lr.x", "is a value, not a table"),
    ({"seed": [0, 1]}, [], "seed", "use --seeds"),
    ({"algorithm.name": ["fedavg"]}, [], "algorithm.name", "use --methods"),
    ({"runtime.progress": [True, False]}, [], "runtime.progress", "does not change a run's numbers"),
    ({"train.lr": []}, [], "train.lr", "at least one value"),
    ({"train.lr": 0.1}, [], "train.lr", "takes a list of values"),
    ({"train.lr": [0.1, 0.1]}, [], "train.lr", "given twice"),
    ({"model.options": [{}], "model.options.hidden": [[]]}, [], "model.options.hidden", "given twice in the grid"),
    ({"data.options.alpha": [1.0]}, [], "data.options.alpha", "also set with --set data.options"),
    ({"train.lr": [0.1, 0.2]}, ["train.lr=0.3"], "train.lr", "also set with --set train.lr"),
    ({"train.lr": [0.1, -1.0]}, [], "train.lr", "must be > 0"),  # a value the configuration refuses
    ({"algorithm.mu": [0.1]}, [], "algorithm.mu", "unknown key"),  # fedavg has no mu
])
def test_bad_grids_are_config_errors_naming_the_key_before_anything_is_written(tmp_path, monkeypatch, grid,
                                                                              overrides, key, says):
    no_runs(monkeypatch)
    out = tmp_path / "sweep"
    with pytest.raises(ConfigError, match=says) as err:
        hetfl.sweep(grid, methods=["fedavg"], overrides=[*TINY, *overrides], out=out)
    assert err.value.key == key
    assert not out.exists()


def test_bad_grid_options_on_the_command_line_exit_2_naming_the_key(tmp_path, capsys):
    out = tmp_path / "cmp"
    base = ["compare", "--methods", "fedavg", "--seeds", "0", "--out", str(out), *set_args(TINY)]
    cases = [(["--grid", "train.lr=0.1", "--grid", "train.lr=0.2"], "train.lr", "given twice"),
             (["--grid", "train.lr"], "--grid", "KEY=VALUE1,VALUE2"),
             (["--grid", "train.lr=0.1,"], "train.lr", "none empty"),
             (["--grid", "train.rounds=1,2", "--set", "train.rounds=3"], "train.rounds", "also set with --set")]
    for extra, key, says in cases:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert key in err and says in err, err
    sweep_file = tmp_path / "s.toml"
    sweep_file.write_text('[grid]\n"train.lr" = [0.1]\n')
    assert main([*base, "--grid", "train.lr=0.2", "--sweep", str(sweep_file)]) == 2
    assert "given twice" in capsys.readouterr().err
    assert not out.exists()


# ------------------------------------------------------------- cells, folders, rows
def test_grid_product_folder_layout_and_one_row_per_cell(tmp_path):
    out = tmp_path / "sweep"
    grid = {"train.lr": [0.05, 0.2], "train.batch_size": [8, 16]}
    table = hetfl.sweep(grid, methods="fedavg", seeds=[0, 1], overrides=TINY, out=out)
    cells = [("0.05", "8"), ("0.05", "16"), ("0.2", "8"), ("0.2", "16")]  # the first key varies slowest
    assert [(r.config.train.lr, r.config.train.batch_size, r.config.seed) for r in table.runs] == [
        (float(lr), int(batch), seed) for lr, batch in cells for seed in (0, 1)]
    for lr, batch in cells:  # the folder names keys in key order, whatever the grid's order
        cell = out / "fedavg" / f"train.batch_size={batch},train.lr={lr}"
        assert sorted(p.name for p in cell.iterdir()) == ["cell.json", "seed0", "seed1"]
        assert (cell / "cell.json").read_text() == (  # indented, for a reader
            f'{{\n  "method": "fedavg",\n  "grid": {{\n    "train.lr": {lr},\n'
            f'    "train.batch_size": {batch}\n  }}\n}}\n')
    assert [r.run_dir.relative_to(out).parts[-1] for r in table.runs] == ["seed0", "seed1"] * 4
    assert [(row["train.lr"], row["train.batch_size"], row["seeds"]) for row in table.rows] == [
        (lr, batch, 2) for lr, batch in cells]
    for i, row in enumerate(table.rows):
        pair = table.runs[2 * i:2 * i + 2]
        accs = [run.final_accuracy for run in pair]  # the rows hold fractions, as RunResult
        mean = sum(accs) / 2
        assert row["final_mean"] == pytest.approx(mean)
        # tables.py's std over seeds: the sample standard deviation (n - 1)
        assert row["final_std"] == pytest.approx(math.sqrt(sum((a - mean) ** 2 for a in accs) / (2 - 1)))
    assert len({row["setting_id"] for row in table.rows}) == 4
    assert "| method | train.batch_size | train.lr |" in table.markdown
    assert table.markdown == (out / "comparison.md").read_text()


def test_cell_names_are_safe_unique_and_depend_on_the_cells_own_values():
    plain = sweeps.Cell((("train.lr", 0.1), ("data.partition", "iid")))
    assert plain.dirname == "data.partition=iid,train.lr=0.1"
    assert sweeps.Cell((("data.partition", "iid"), ("train.lr", 0.1))).dirname == plain.dirname
    a = sweeps.Cell((("model.options", {"hidden": [16, 8]}),)).dirname
    b = sweeps.Cell((("model.options", {"hidden": [16, 8], "x": 1}),)).dirname
    assert a != b and a.startswith("model.options=_") and not set(a) & set('"/ {}[]')
    assert len(sweeps.Cell((("model.name", "m" * 300),)).dirname) <= sweeps.MAX_NAME


def test_cli_grid_and_api_sweep_give_the_same_rows(tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["compare", "--methods", "fedavg,fedprox", "--seeds", "0", "--grid", "train.lr=0.05,0.2", "--out",
            str(out), "--quiet", *set_args(TINY)]
    assert main(argv) == 0
    written = list(csv.DictReader(io.StringIO((out / "comparison.csv").read_text())))
    assert [(r["method"], r["train.lr"]) for r in written] == [
        ("fedavg", "0.05"), ("fedavg", "0.2"), ("fedprox", "0.05"), ("fedprox", "0.2")]
    assert (out / "fedprox" / "train.lr=0.2" / "seed0" / "summary.json").is_file()
    capsys.readouterr()
    table = hetfl.sweep(GRID, methods=["fedavg", "fedprox"], seeds=[0], overrides=TINY, out=out)
    assert [r.status for r in table.runs] == ["reused"] * 4
    assert [{k: "" if v is None else str(v) for k, v in row.items()} for row in table.rows] == written
    sweep_file = tmp_path / "sweep.toml"
    sweep_file.write_text('[grid]\n"train.lr" = [0.05, 0.2]\n')
    argv = ["compare", "--methods", "fedavg,fedprox", "--seeds", "0", "--sweep", str(sweep_file), "--out", str(out),
            "--quiet", *set_args(TINY)]
    assert main(argv) == 0
    assert capsys.readouterr().out.count("finished earlier, reusing") == 4


def test_folder_names_use_the_configured_value_however_it_was_typed(tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    assert main(["compare", "--methods", "fedavg", "--seeds", "0", "--grid", "train.lr=1", "--out", str(out),
                 "--quiet", *set_args(TINY)]) == 0
    assert (out / "fedavg" / "train.lr=1.0" / "seed0" / "summary.json").is_file()  # the float 1.0, as the API
    assert hetfl.sweep({"train.lr": [1.0]}, overrides=TINY, out=out).runs[0].status == "reused"
    no_runs(monkeypatch)
    with pytest.raises(ConfigError, match="two grid cells give the same configuration") as err:
        hetfl.sweep({"train.lr": [1, 1.0]}, overrides=TINY, out=tmp_path / "twice")
    assert err.value.key == "train.lr" and not (tmp_path / "twice").exists()


def test_without_a_grid_compare_keeps_its_layout(tmp_path):
    table = hetfl.sweep({}, methods=["fedavg"], seeds=[0], overrides=TINY, out=tmp_path / "cmp")
    assert [r.run_dir.name for r in table.runs] == ["fedavg-seed0"]


# ------------------------------------------------------------- resume, reuse, refuse
def test_rerun_reuses_finished_resumes_interrupted_and_adds_only_new_cells(tmp_path):
    out = tmp_path / "sweep"
    first = hetfl.sweep(GRID, seeds=[0, 1], overrides=TINY, out=out)
    before = {r.run_dir: files(r.run_dir) for r in first.runs}
    cut = first.runs[1].run_dir  # as if killed before its summary: an interrupted run of this configuration
    (cut / "summary.json").unlink()
    again = hetfl.sweep({"train.lr": [0.05, 0.2, 0.1]}, seeds=[0, 1], overrides=TINY, out=out)
    assert [r.status for r in again.runs] == ["reused", "resumed", "reused", "reused", "ran", "ran"]
    for run_dir, saved in before.items():
        if run_dir != cut:
            assert files(run_dir) == saved, f"{run_dir} was touched"
    assert again.runs[1].summary["final_global_acc"] == first.runs[1].summary["final_global_acc"]
    assert [row["train.lr"] for row in again.rows] == ["0.05", "0.2", "0.1"]


def test_another_configuration_in_a_cell_folder_is_refused_before_anything_runs(tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    hetfl.run(overrides=[*TINY, "train.lr=0.3", "seed=1"], out=out / "fedavg" / "train.lr=0.2" / "seed1")
    no_runs(monkeypatch)
    with pytest.raises(hetfl.RunDirError, match=r"train\.lr=0\.2/seed1: holds a run of another configuration "
                                                r"\(train\.lr: 0\.3 -> 0\.2"):
        hetfl.sweep(GRID, seeds=[0, 1], overrides=TINY, out=out)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_dir()) == [
        "fedavg", "fedavg/train.lr=0.2", "fedavg/train.lr=0.2/seed1"]


# ------------------------------------------------------------- the counter and the time left
def fake_clock(step: float):
    ticks = itertools.count(0.0, step)
    return lambda: next(ticks)


def test_counter_rate_comes_from_runs_computed_here_weighted_by_cost():
    runs = [sweeps.PlannedRun("a", 10, "new"), sweeps.PlannedRun("c", 20, "new"),
            sweeps.PlannedRun("b", 10, "finished"), sweeps.PlannedRun("d", 10, "unfinished")]
    said: list[str] = []
    counter = sweeps.RunCounter(runs, said.append, fake_clock(20.0))  # every start -> done pair takes 20 s
    # no recorded time of the finished run, no preset estimate: nothing to go on yet
    assert counter.start(0) == "run 1 of 4 (a): time left known once a run has finished"
    counter.done(0)  # 20 s for 10 units: 2 s per unit
    assert counter.start(1) == "run 2 of 4 (c): about 60 s left"  # (20 + 10) units x 2 s; the reused b is done
    counter.done(1)  # 40 s for 30 units in all
    counter.done(2)  # the reused run (as run_plan calls it): adds neither time nor work
    assert counter.start(3) == "run 4 of 4 (d): about 13 s left"  # 10 units x 4/3 s
    assert said == ["run 1 of 4 (a): time left known once a run has finished", "run 2 of 4 (c): about 60 s left",
                    "run 4 of 4 (d): about 13 s left"]


def test_run_cost_is_rounds_left_x_clients_x_local_work():
    cfg = make_config(None, ["train.rounds=3", "data.num_clients=4", "train.local_steps=2"])
    assert sweeps.run_cost(cfg) == 3 * 4 * 2 and sweeps.run_cost(cfg, done_rounds=1) == 2 * 4 * 2
    cfg = make_config(None, ["train.rounds=3", "data.num_clients=4", "train.clients_per_round=2",
                             "train.local_epochs=5"])
    assert sweeps.run_cost(cfg) == 3 * 2 * 5


def test_counter_before_any_run_here_is_rough_and_says_from_what():
    runs = [sweeps.PlannedRun("a", 10, "finished", recorded_s=60.0), sweeps.PlannedRun("b", 30, "new")]
    assert sweeps.RunCounter(runs).start(1) == (
        "run 2 of 2 (b): about 3 min left (rough: from the times of 1 run(s) found finished)")
    runs = [sweeps.PlannedRun("a", 10, "new"), sweeps.PlannedRun("b", 30, "new")]
    counter = sweeps.RunCounter(runs, prior_s=1200.0, prior_label="the preset's estimate, rough")
    assert counter.start(0) == "run 1 of 2 (a): about 20 min left (rough: the preset's estimate, rough)"
    assert sweeps.format_duration(5400) == "1.5 h"


def test_sweep_prints_the_counter_with_a_measured_eta(tmp_path):
    out = tmp_path / "sweep"
    text = io.StringIO()
    console = Console(file=text, width=200)
    configure = lambda extra: make_config(None, [*TINY, "runtime.progress=false", *extra])
    grid = sweeps.check_grid(GRID)
    sweeps.run_plan(["fedavg"], [0, 1], grid, configure, out, None, progress=None, console=console,
                    clock=fake_clock(60.0))
    lines = [line for line in text.getvalue().splitlines() if line.startswith("run ")]
    assert lines == ["run 1 of 4 (fedavg, seed 0, train.lr=0.05): time left known once a run has finished",
                     "run 2 of 4 (fedavg, seed 1, train.lr=0.05): about 3 min left",
                     "run 3 of 4 (fedavg, seed 0, train.lr=0.2): about 2 min left",
                     "run 4 of 4 (fedavg, seed 1, train.lr=0.2): about 60 s left"]
    (out / "fedavg" / "train.lr=0.2" / "seed0" / "summary.json").unlink()
    text.truncate(0)
    sweeps.run_plan(["fedavg"], [0, 1], grid, configure, out, None, progress=None, console=console,
                    clock=fake_clock(60.0))
    lines = [line for line in text.getvalue().splitlines() if line.startswith("run ")]
    assert len(lines) == 1 and lines[0].startswith("run 3 of 4 (fedavg, seed 0, train.lr=0.2): about ")
    assert lines[0].endswith("left (rough: from the times of 3 run(s) found finished)")


def test_the_api_is_silent_unless_progress(tmp_path, capsys):
    hetfl.sweep(GRID, overrides=TINY, out=tmp_path / "quiet")
    assert capsys.readouterr().out == ""
    hetfl.sweep(GRID, overrides=TINY, out=tmp_path / "loud", progress=True)
    assert "run 2 of 2 (fedavg, seed 0, train.lr=0.2): about " in capsys.readouterr().out


def test_counter_lines_are_text_not_rich_markup():
    text = io.StringIO()
    sweeps._printer(Console(file=text, markup=True, width=200))("run 1 of 1 (fedavg, seed 0, x=[bold]): soon")
    assert text.getvalue().strip() == "run 1 of 1 (fedavg, seed 0, x=[bold]): soon"


PRESET = """
[preset]
title = "toy"
paper = "nobody"
metric = "final_global_acc"
seeds = [0, 1]
quick_cpu_minutes = 2
[base.train]
rounds = 6
[[columns]]
id = "c"
label = "C"
[[rows]]
label = "A"
algorithm = "fedavg"
[[rows]]
label = "B"
algorithm = "fedprox"
"""


def test_reproduce_counts_its_runs_with_the_presets_estimate_as_the_rough_start(tmp_path):
    path = tmp_path / "toy.toml"
    path.write_text(PRESET)
    preset = reproduce.load_preset(str(path)).variant(True)  # quick: seed 0, two runs

    def run(cfg, run_dir, resume):
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text(json.dumps({"round": 1, "global_acc": 0.5}) + "\n")
        (run_dir / "summary.json").write_text(json.dumps({"final_global_acc": 0.5, "wall_time_s": 1.0}))

    said: list[str] = []
    reproduce.reproduce(preset, tmp_path / "out", run, say=said.append, clock=fake_clock(30.0))
    assert said == ["run 1 of 2 (c, fedavg, seed 0): about 2 min left (rough: the preset's estimate, not measured)",
                    "run 2 of 2 (c, fedprox, seed 0): about 30 s left"]


def test_reproduce_list_labels_estimates_measured_or_rough(capsys, monkeypatch):
    """Since session 22 every preset's quick estimate is measured: each row says how; one made rough here
    (its measurement removed) shows "~N (rough)"."""
    from dataclasses import replace

    load = reproduce.load_preset
    monkeypatch.setattr(reproduce, "load_preset", lambda name: replace(load(name), quick_cpu_measured="")
                        if name == "feduv-table1" else load(name))
    monkeypatch.setenv("COLUMNS", "400")  # one line per preset
    assert main(["reproduce", "--list"]) == 0
    shown = capsys.readouterr().out
    assert "(rough, not measured)" in shown  # the GPU minutes: none measured yet
    rows = {line.split()[1]: line for line in shown.splitlines() if line.startswith("│")}
    assert "~3 (rough)" in rows.pop("feduv-table1")
    for name, row in rows.items():
        measured = load(name).quick_cpu_measured
        assert measured and f"(measured): {measured}" in row, name


# ------------------------------------------------------------------ the runtime's checks in planning
def test_a_sweep_refuses_what_the_runtime_cannot_run_before_the_first_run(tmp_path, capsys):
    """A cell its executor refuses (Flower cannot save client models) is exit 2 naming the key before any
    run of the plan starts; it used to run the cells before it first (the sequential cell here)."""
    pytest.importorskip("flwr", reason='Flower is not installed: pip install "hetfl[flower]"')
    out = tmp_path / "sweep"
    argv = ["compare", "--methods", "fedavg", "--seeds", "0", "--out", str(out), "--quiet",
            "--grid", "runtime.executor=sequential,flower", *set_args([*TINY, "runtime.save_client_models=[1]"])]
    assert main(argv) == 2
    assert "runtime.save_client_models" in capsys.readouterr().err
    assert not list(out.rglob("metrics.jsonl"))


def test_a_sweep_refuses_a_partition_it_cannot_make_before_the_first_run(tmp_path, capsys):
    """A cell whose partition cannot be made (more clients than the samples) is exit 2 naming the key before
    any run of the plan starts; it used to run the cells before it first (the 4-client cell here)."""
    out = tmp_path / "sweep"
    argv = ["compare", "--methods", "fedavg", "--seeds", "0", "--out", str(out), "--quiet",
            "--grid", "data.num_clients=4,100000", *set_args([kv for kv in TINY if "num_clients" not in kv])]
    assert main(argv) == 2
    assert "data.num_clients = 100000" in capsys.readouterr().err
    assert not list(out.rglob("metrics.jsonl"))


def test_reproduce_refuses_what_the_runtime_cannot_run_before_the_first_run(tmp_path, capsys):
    from tests.helpers.runs import PRESET

    pytest.importorskip("flwr", reason='Flower is not installed: pip install "hetfl[flower]"')
    flower_row = 'metric = "best5:global_acc"\nset = { runtime = { executor = "flower", save_client_models = [1] } }'
    preset = PRESET.replace('metric = "best5:global_acc"', flower_row)
    assert flower_row in preset
    path, out = tmp_path / "toy.toml", tmp_path / "rep"
    path.write_text(preset)
    assert main(["reproduce", str(path), "--quick", "--out", str(out), "--quiet", *set_args(TINY[:3])]) == 2
    assert "runtime.save_client_models" in capsys.readouterr().err
    assert not list(out.rglob("metrics.jsonl"))  # row A (fedavg, sequential) did not run first


# ------------------------------------------------------------- huge sweeps (issue 26, item 10)
HUGE = {"train.lr": [round(0.001 * (i + 1), 3) for i in range(100)],
        "train.momentum": [round(0.009 * i, 3) for i in range(100)]}


def planning_stops_after(monkeypatch, calls: int) -> None:
    """Make configuring more than ``calls`` runs an error: a plan that configures every run up front fails."""
    from hetfl import api

    original, seen = api.make_config, []

    def counted(*args, **kwargs):
        seen.append(1)
        if len(seen) > calls:
            raise AssertionError(f"configured more than {calls} runs before asking")
        return original(*args, **kwargs)

    monkeypatch.setattr(api, "make_config", counted)


def test_a_huge_sweep_is_counted_and_refused_above_max_runs_before_any_planning(tmp_path, monkeypatch):
    planning_stops_after(monkeypatch, 0)
    out = tmp_path / "huge"
    with pytest.raises(ConfigError, match=r"10000 runs.*max_runs") as err:
        hetfl.sweep(HUGE, overrides=TINY, out=out)
    assert err.value.key == "max_runs"
    assert not out.exists()
    with pytest.raises(ConfigError, match="max_runs"):
        hetfl.sweep(HUGE, overrides=TINY, out=out, max_runs=0)


def test_the_cli_prints_the_count_first_and_asks_for_yes(tmp_path, monkeypatch, capsys):
    from hetfl import config as config_mod

    seen = []
    load = config_mod.load
    monkeypatch.setattr(config_mod, "load", lambda *a, **k: seen.append(1) or load(*a, **k))
    values = ",".join(str(v) for v in HUGE["train.lr"][:40])
    argv = ["compare", "--methods", "fedavg", "--seeds", "0", "--out", str(tmp_path / "c"), "--grid",
            f"train.lr={values}", "--grid", f"train.momentum={','.join(str(v) for v in HUGE['train.momentum'][:40])}",
            *set_args(TINY)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0] == "plan: 1600 runs (1 method x 1600 grid cells x 1 seed)"
    assert "--yes" in captured.err and "1600 runs" in captured.err
    assert seen == [] and not (tmp_path / "c").exists()


def test_runs_are_planned_lazily_and_cell_folders_made_only_when_their_run_starts(tmp_path, monkeypatch):
    """A sweep stopped in its first run has made no other cell's folder (before: every cell.json first)."""
    from hetfl import runs

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runs, "execute", stop)
    out = tmp_path / "sweep"
    with pytest.raises(KeyboardInterrupt):
        hetfl.sweep({"train.lr": [0.05, 0.2, 0.3]}, overrides=TINY, out=out)
    assert sorted(p.name for p in (out / "fedavg").iterdir()) == ["train.lr=0.05"]


def test_a_grid_over_calibration_settings_trains_once_per_seed(tmp_path, monkeypatch):
    """``fedavg+ccvr`` over two ``algorithm.ccvr.epochs``: the second cell calibrates the first cell's model
    (one training per seed, the counter says so) and gives what that cell trained itself gives."""
    trained_from: list = []
    real_run = Experiment.run
    monkeypatch.setattr(Experiment, "run", lambda self, run_dir, **kw: trained_from.append(kw.get("trained"))
                        or real_run(self, run_dir, **kw))
    out = tmp_path / "sweep"
    said: list[str] = []
    console = Console(file=io.StringIO(), width=400)
    monkeypatch.setattr(sweeps, "_printer", lambda _console: said.append)
    overrides = [*TINY, "model.name=mlp", "model.options={hidden = [16]}", "train.rounds=2"]
    table = sweeps.run_plan(["fedavg+ccvr"], [0], {"algorithm.ccvr.epochs": [2, 5]},
                            lambda extra: make_config(overrides=[*overrides, *extra]), out, None,
                            progress=False, console=console)
    first = table.runs[0].run_dir
    assert trained_from == [None, first]
    assert any("post-hoc steps only, on run 1's training" in line for line in said), said
    alone = Experiment(make_config(overrides=[*overrides, "algorithm.name=fedavg+ccvr", "algorithm.ccvr.epochs=5"]))
    summary = alone.run(tmp_path / "alone")
    assert table.runs[1].final_accuracy == summary["final_global_acc"]
    assert table.runs[0].final_accuracy != table.runs[1].final_accuracy


# ------------------------------------------------------------- honesty of the table
def _record(seed: int, acc: float, diverged: int | None) -> tables.RunRecord:
    summary = {"final_global_acc": acc, "best_global_acc": acc, "wall_time_s": 1.0, "diverged_round": diverged}
    return tables.RunRecord("fedavg", seed, summary, [{"round": 1, "global_acc": acc}])


def test_a_row_with_a_diverged_seed_says_so_in_every_output():
    """A run whose train loss went inf/NaN still ends with an accuracy (often a plausible one) and stays in its
    row's mean, as it ended; the row counts it (``diverged``) and the rendered table shows it, so a mean over
    diverged seeds never reads like a healthy one."""
    rows = tables.table_rows([_record(0, 0.8, None), _record(1, 0.7, 1), _record(2, 0.6, 3)], None)
    assert rows[0]["seeds"] == 3 and rows[0]["diverged"] == 2
    assert rows[0]["final_mean"] == pytest.approx(0.7)  # kept in the mean, not dropped
    head, body = tables.table_cells(rows, None)
    assert body[0][head.index("diverged")] == "2 of 3"
    markdown = tables.to_markdown(rows, None)
    assert "| diverged |" in markdown and "| 2 of 3 |" in markdown and "(summary.json: diverged_round)" in markdown
    written = next(csv.DictReader(io.StringIO(tables.to_csv(rows))))
    assert written["diverged"] == "2"


def test_a_table_without_a_diverged_run_counts_zero_and_shows_no_column():
    rows = tables.table_rows([_record(0, 0.8, None), _record(1, 0.7, None)], None)
    assert rows[0]["diverged"] == 0
    assert "diverged" not in tables.table_cells(rows, None)[0]
    assert "diverged" not in tables.to_markdown(rows, None)


def _curve_record(seed: int, accs: list[float | None]) -> tables.RunRecord:
    """A run evaluated on the rounds whose accuracy is not None (``train.eval_every`` = 2: rounds 2, 4, ...)."""
    metrics = [{"round": r, "train_loss": 1.0, **({} if a is None else {"global_acc": a})}
               for r, a in enumerate(accs, start=1)]
    evaluated = [a for a in accs if a is not None]
    summary = {"final_global_acc": evaluated[-1], "best_global_acc": max(evaluated), "wall_time_s": 1.0}
    return tables.RunRecord("fedavg", seed, summary, metrics)


def test_the_table_says_which_std_and_how_rounds_to_target_are_averaged():
    """The cells against numpy on the runs' own numbers, and a note under the table that says how they were
    aggregated: the sample std (n - 1), and rounds to the target as the first evaluated round at or above it,
    averaged over the seeds that reached it (k/n). Before, comparison.md and report.md said neither (only the
    curves' line named the sample std), so "3.0 (2/3)" and "80.78 ± 1.81" could be read several ways."""
    import numpy as np

    runs = [_curve_record(0, [None, 0.81, None, 0.82]), _curve_record(1, [None, 0.74, None, 0.815]),
            _curve_record(2, [None, 0.71, None, 0.79])]
    rows = tables.table_rows(runs, 0.8)
    head, (cells,) = tables.table_cells(rows, 0.8)
    final = 100 * np.array([0.82, 0.815, 0.79])
    best = 100 * np.array([0.82, 0.815, 0.79])
    assert cells[head.index("final acc (%)")] == f"{final.mean():.2f} ± {final.std(ddof=1):.2f}" == "80.83 ± 1.61"
    assert cells[head.index("best acc (%)")] == f"{best.mean():.2f} ± {best.std(ddof=1):.2f}"
    assert cells[head.index("rounds to 80%")] == f"{np.mean([2, 4]):.1f} (2/3)"  # round 2, round 4, never
    markdown = tables.to_markdown(rows, 0.8)
    note = tables.aggregation_line(rows, 0.8)
    assert note in markdown.replace("\\", "")
    assert "sample std (n − 1) over the row's seeds" in note and "one seed: its value alone" in note
    assert "first evaluated round whose accuracy is at or above 80%" in note
    assert "mean over the seeds that reached it" in note and "(k/n): k of the row's n seeds" in note
    assert "rounds to" not in tables.aggregation_line(rows, None)


# ------------------------------------------------------------- session 48: the plan handed to the worker processes
def test_the_parallel_plan_gives_each_run_its_training_source_order_and_cost_and_reuses_finished_runs(
        tmp_path, monkeypatch):
    """``--jobs 2`` of ``fedavg+ccvr`` over ``algorithm.ccvr.epochs``: what :func:`hetfl.sweeps._run_parallel`
    hands :func:`hetfl.jobs.run_jobs` (the runs to compute, each as a configuration tree, its state and cost, and
    for a calibration the folder of the training it reads and that run's place in the plan). The runs are done
    here, in this process, as a worker does them (:func:`hetfl.jobs._run`: a calibration on its source's model,
    an interrupted run resumed), to keep the test fast. Run again with one more seed and one more cell, a
    calibration interrupted: the finished runs are reused (and said to be), the interrupted one resumes, the new
    seed's calibration waits for the new seed's training (its place among the runs still to compute), and the new
    cell's calibrates a training finished earlier (no run to wait for)."""
    from hetfl import jobs

    handed: list[list[jobs.Job]] = []

    def inline(plan, workers, say):
        handed.append(plan)
        assert workers == 2 and say is not None  # the lines as each run starts and ends, on the console given
        statuses = {}
        for i, job in enumerate(plan):
            assert job.after is None or job.after in statuses  # the order run_jobs keeps
            trained = jobs.trained_folder(job.state, job.source)
            status, seconds, error = jobs._run(job.tree, str(job.run_dir), job.state, None if trained is None else
                                               str(trained))
            assert error is None, error
            assert 0 < seconds < 30, seconds  # the run's own seconds (a tiny run: well under one)
            statuses[i] = status
        return statuses

    monkeypatch.setattr(sweeps, "run_jobs", inline)
    real_run, started = runtimes.run_experiment, []
    monkeypatch.setattr(runtimes, "run_experiment", lambda target, run_dir, **kw: started.append(
        (run_dir, kw["resume"], kw["trained"])) or real_run(target, run_dir, **kw))
    overrides = [*TINY, "model.name=mlp", "model.options={hidden = [16]}"]
    configure = lambda extra: make_config(overrides=[*overrides, *extra])
    out = tmp_path / "sweep"
    printed = io.StringIO()
    first = sweeps.run_plan(["fedavg+ccvr"], [0], {"algorithm.ccvr.epochs": [2, 5]}, configure, out, None,
                            progress=False, console=Console(file=io.StringIO()), jobs=2)
    (plan,) = handed
    train, calibrate = (out / "fedavg-ccvr" / f"algorithm.ccvr.epochs={e}" / "seed0" for e in (2, 5))
    full = sweeps.run_cost(configure(["algorithm.name=fedavg+ccvr"]))
    last_round = full / 2  # 2 rounds: the calibration run computes its last only
    assert [(j.run_dir, j.state, j.cost, j.source, j.after) for j in plan] == [
        (train, "new", full, None, None), (calibrate, "new", last_round, train, 0)]
    assert plan[1].tree == config.to_tree(runs.with_progress(configure(
        ["algorithm.name=fedavg+ccvr", "seed=0", "algorithm.ccvr.epochs=5"]), False))
    assert [r.status for r in first.runs] == ["ran", "ran"]
    assert started == [(train, False, None), (calibrate, False, train)]  # post-hoc steps only, on train's model

    handed.clear()
    started.clear()
    (calibrate / "summary.json").unlink()  # as if killed before its summary: resumed, from its own checkpoint
    again = sweeps.run_plan(["fedavg+ccvr"], [0, 1], {"algorithm.ccvr.epochs": [2, 5, 9]}, configure, out, None,
                            progress=False, console=Console(file=printed, width=400), jobs=2)
    (plan,) = handed
    train1, calibrate1 = (out / "fedavg-ccvr" / f"algorithm.ccvr.epochs={e}" / "seed1" for e in (2, 5))
    nine0, nine1 = (out / "fedavg-ccvr" / "algorithm.ccvr.epochs=9" / f"seed{s}" for s in (0, 1))
    assert [(j.run_dir, j.state, j.cost, j.source, j.after) for j in plan] == [
        (train1, "new", full, None, None), (calibrate, "unfinished", 0.0, train, None),
        (calibrate1, "new", last_round, train1, 0), (nine0, "new", last_round, train, None),
        (nine1, "new", last_round, train1, 0)]
    assert [r.status for r in again.runs] == ["reused", "ran", "resumed", "ran", "ran", "ran"]
    assert started == [(train1, False, None), (calibrate, True, None), (calibrate1, False, train1),
                       (nine0, False, train), (nine1, False, train1)]
    assert printed.getvalue().count("finished earlier, reusing (same configuration)") == 1
    assert f"{train}: finished earlier, reusing" in " ".join(printed.getvalue().split())


# ------------------------------------------------------------- session 48: what mutation testing found untested
def refusal(call, *args) -> str:
    """The message of the ConfigError ``call(*args)`` raises."""
    with pytest.raises(ConfigError) as err:
        call(*args)
    return str(err.value)


def test_grid_values_split_at_top_level_commas_with_toml_strings_escapes_and_any_letters():
    """A double-quoted string's ``\\"`` and ``\\\\`` are escapes (the quote after ``\\\\`` closes it); a single-quoted
    (literal) string has none; letters, upper case too, neither quote nor nest."""
    assert sweeps.split_values(r'"a\",b",c') == [r'"a\",b"', "c"]
    assert sweeps.split_values(r'"a\\",b') == [r'"a\\"', "b"]
    assert sweeps.split_values(r"'a\',b") == [r"'a\'", "b"]
    assert sweeps.split_values("MAX,MIN, X") == ["MAX", "MIN", "X"]
    assert sweeps.split_values('[1, "]"],{a = "}"},x') == ['[1, "]"]', '{a = "}"}', "x"]
    assert sweeps.parse_grid_option(r'model.name="a\",b",X') == ("model.name", ['a",b', "X"])


def test_grid_and_sweep_file_errors_say_the_option_the_value_and_what_is_allowed(tmp_path):
    assert refusal(sweeps.parse_grid_option, "train.lr") == (
        "--grid = 'train.lr': must look like KEY=VALUE1,VALUE2, e.g. train.lr=0.01,0.1")
    missing = tmp_path / "none.toml"
    assert refusal(sweeps.read_sweep_file, missing) == f"--sweep = '{missing}': no such file"
    path = tmp_path / "s.toml"
    path.write_bytes(b"[grid\n")
    assert refusal(sweeps.read_sweep_file, path).startswith(f"--sweep = '{path}': not a readable UTF-8 TOML file (")
    path.write_bytes(b'[grid]\n"train.lr" = ["\xff"]\n')
    assert refusal(sweeps.read_sweep_file, path).startswith(f"--sweep = '{path}': not a readable UTF-8 TOML file (")
    for text, found in [('[grid]\n"train.lr" = [0.1]\n[seeds]\nx = 1\n[more]\n', "more, seeds"), ("", "no [grid]"),
                        ("grid = 3\n", "no [grid]")]:
        path.write_text(text)
        assert refusal(sweeps.read_sweep_file, path) == (
            f"--sweep = '{path}': must hold one [grid] table of KEY = [values] (found: {found})")
    path.write_text('[grid.data]\noptions.alpha = 0.5\n')
    assert refusal(sweeps.read_sweep_file, path) == (
        f"data.options.alpha = 0.5: in --sweep {path}: a grid key takes a list of values, e.g. [0.01, 0.1]")


def test_a_key_inside_a_table_setting_is_a_grid_key():
    """``data.options`` is a table (``dict[str, Any]``): a key inside it is a sweep axis; inside a value it is not."""
    sweeps.check_key("data.options.alpha", [0.1])
    sweeps.check_key("model.options.hidden", [[16]])
    with pytest.raises(ConfigError, match="train.lr is a value, not a table"):
        sweeps.check_key("train.lr.x", [0.1])


def test_the_rounds_an_interrupted_run_wrote_are_its_metrics_lines(tmp_path):
    assert sweeps.rounds_done(tmp_path) == 0
    (tmp_path / "metrics.jsonl").write_text('{"round": 1}\n\n{"round": 2}\n{"round": 3}\n')
    assert sweeps.rounds_done(tmp_path) == 3
    (tmp_path / "metrics.jsonl").write_text("")
    assert sweeps.rounds_done(tmp_path) == 0


def test_a_calibration_of_another_runs_training_counts_as_its_last_round():
    cfg = make_config(None, ["train.rounds=3", "data.num_clients=4", "train.local_steps=2"])
    planned = sweeps.PlannedRun("fedavg+ccvr, seed 0", sweeps.run_cost(cfg), "new", None, 3)
    assert sweeps.posthoc_only(planned, cfg, 2) == sweeps.PlannedRun(
        "fedavg+ccvr, seed 0; post-hoc steps only, on run 3's training", 4 * 2, "new", None, 1)


@pytest.mark.parametrize(("key", "values", "message"), [
    (3, [1], "grid = 3: keys are dotted configuration keys, e.g. train.lr"),
    ("", [1], "grid = '': keys are dotted configuration keys, e.g. train.lr"),
    ("train..lr", [1], "grid = 'train..lr': keys are dotted configuration keys, e.g. train.lr"),
    ("seed", [0, 1], "seed = [0, 1]: seeds are their own axis: use --seeds (seeds= in Python)"),
    ("runtime.progress", [True], "runtime.progress = [true]: does not change a run's numbers, so it is no sweep axis"),
    ("optimizer.lr", [0.1], "optimizer.lr = [0.1]: not a configuration key (see hetfl list config); sections: "
                            "algorithm.*, data.*, model.*, train.*, runtime.*, tracking.*"),
    ("train", [1], "train = [1]: not a configuration key (see hetfl list config); sections: algorithm.*, data.*, "
                   "model.*, train.*, runtime.*, tracking.*"),
    ("train.lrr", [0.1], "train.lrr = [0.1]: not a configuration key; train. has: rounds, clients_per_round, "
                         "local_epochs, local_steps, batch_size, drop_last, lr, lr_schedule, lr_min, momentum, "
                         "weight_decay, max_grad_norm, weighting, precision, eval_every, eval_batch_size"),
    ("train.lr.x", [0.1], "train.lr.x = [0.1]: not a configuration key: train.lr is a value, not a table"),
])
def test_a_key_that_is_no_sweep_axis_is_refused_with_the_whole_reason(key, values, message):
    with pytest.raises(ConfigError) as err:
        sweeps.check_key(key, values)
    assert str(err.value) == message


def test_grid_option_and_grid_errors_in_full(tmp_path):
    assert refusal(sweeps.parse_grid_option, "train.lr=0.1,") == (
        "train.lr = '0.1,': needs comma-separated values, none empty, e.g. 0.01,0.1")
    assert refusal(sweeps.parse_grid_option, " =1,,2") == (
        "--grid = '1,,2': needs comma-separated values, none empty, e.g. 0.01,0.1")
    path = tmp_path / "s.toml"
    path.write_text('[grid]\n"train.lr" = [0.1]\n')
    assert refusal(sweeps.grid_from_cli, ["train.lr=0.2"], str(path), []) == (
        "train.lr = [0.1]: given twice (--grid options and the --sweep file together)")
    # a table value given twice in another key order is the same value; keys within one another in either order,
    # in the grid or with --set
    assert refusal(sweeps.check_grid, {"model.options": [{"a": 1, "b": 2}, {"b": 2, "a": 1}]}) == (
        "model.options = [{'a': 1, 'b': 2}, {'b': 2, 'a': 1}]: the value {'b': 2, 'a': 1} is given twice")
    assert refusal(sweeps.check_grid, {"model.options.hidden": [[4]], "model.options": [{}]}) == (
        "model.options = [{}]: given twice in the grid (with model.options.hidden)")
    assert refusal(sweeps.check_grid, {"data.options": [{}]}, ["data.options.alpha=0.5"]) == (
        "data.options = [{}]: is also set with --set data.options.alpha=...: a key is either fixed or swept; drop one")


def test_a_false_grid_value_is_set_as_false():
    assert sweeps.toml_literal(False) == "false" and sweeps.toml_literal(True) == "true"
    assert sweeps.Cell((("train.drop_last", False),)).assignments() == ["train.drop_last=false"]


def test_grid_values_toml_can_hold_are_written_back_as_it_reads_them_and_others_refused():
    assert [sweeps.toml_literal(v) for v in (math.nan, math.inf, -math.inf, 0.5)] == ["nan", "inf", "-inf", "0.5"]
    assert sweeps.toml_literal("façade") == '"façade"'  # not "fa\\u00e7ade": readable in a folder name
    for value in (math.inf, -math.inf, "façade", [True, False]):
        assert parse_value(sweeps.toml_literal(value)) == value
    with pytest.raises(ConfigError) as err:
        sweeps.toml_literal({1, 2})
    assert str(err.value) == "grid = {1, 2}: values must be numbers, booleans, strings, lists or tables"


@pytest.mark.parametrize(("grid", "message"), [
    ([("train.lr", [0.1])], "grid = [['train.lr', [0.1]]]: must map configuration keys to lists of values, e.g. "
                            "{'train.lr': [0.01, 0.1]}"),
    ({"seed": [0, 1]}, "seed = [0, 1]: seeds are their own axis: use --seeds (seeds= in Python)"),
    ({"train.lr": "0.1"}, "train.lr = '0.1': takes a list of values, e.g. [0.01, 0.1]"),
    ({"train.lr": []}, "train.lr = []: needs at least one value"),
    ({"train.lr": [0.1, 0.2, 0.1]}, "train.lr = [0.1, 0.2, 0.1]: the value 0.1 is given twice"),
    ({"data.options": [{}], "data.options.alpha": [0.5]},
     "data.options.alpha = [0.5]: given twice in the grid (with data.options)"),
])
def test_a_bad_grid_is_refused_with_the_whole_reason(grid, message):
    with pytest.raises(ConfigError) as err:
        sweeps.check_grid(grid)
    assert str(err.value) == message


def test_two_cells_of_one_configuration_are_refused_naming_the_folder_they_would_share(tmp_path):
    cfg = make_config(overrides=["train.lr=1.0"])
    cell = sweeps.Cell((("train.lr", 1.0),))
    item = sweeps.PlanItem("fedavg", cell, 0, cfg, tmp_path / "fedavg" / "train.lr=1.0" / "seed0")
    seen: dict = {}
    sweeps.check_distinct(item, seen)
    assert seen == {item.run_dir: cell}
    with pytest.raises(ConfigError) as err:
        sweeps.check_distinct(item, seen)
    assert str(err.value) == (f"train.lr = 'train.lr=1.0': two grid cells give the same configuration "
                              f"({item.run_dir}); give each value once")
    plain = sweeps.PlanItem("mine", sweeps.Cell(), 0, cfg, tmp_path / "mine-seed0")  # no grid: named "grid"
    sweeps.check_distinct(plain, seen)
    with pytest.raises(ConfigError, match=r"^grid = '': two grid cells give the same configuration"):
        sweeps.check_distinct(plain, seen)


def test_a_table_value_names_its_cell_as_given_when_the_configuration_holds_it_as_inner_keys():
    """The configuration's flat form holds ``model.options.hidden``, not ``model.options``: the cell keeps the
    table as given (and its folder is named by it)."""
    cfg = make_config(overrides=["model.options={hidden = [16]}"])
    cell = sweeps.as_configured(sweeps.Cell((("model.options", {"hidden": [16]}),)), cfg)
    assert cell == sweeps.Cell((("model.options", {"hidden": [16]}),))
    assert cell.dirname.startswith('model.options=__hidden_____16__-h')  # {"hidden" = [16]}, made safe


def test_a_cells_file_of_other_text_is_rewritten_in_its_existing_folder(tmp_path):
    cfg = make_config(overrides=["train.lr=0.5"])
    item = sweeps.PlanItem("fedavg", sweeps.Cell((("train.lr", 0.5),)), 0, cfg,
                           tmp_path / "fedavg" / "train.lr=0.5" / "seed0")
    path = item.run_dir.parent / "cell.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"method": "fedavg", "grid": {"train.lr": 0.5}}')  # an older writer's form
    sweeps._write_cell_file(item)
    assert path.read_text() == '{\n  "method": "fedavg",\n  "grid": {\n    "train.lr": 0.5\n  }\n}\n'
