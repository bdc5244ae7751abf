"""The other commands: list, partition, compare."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

from hetfl.cli import main


def test_python_dash_m_hetfl_is_the_hetfl_command(tmp_path):
    """`python -m hetfl` (a cluster job, an environment whose scripts are not on PATH) runs the command line,
    exit codes included."""
    # conftest.py put this copy's sources first on PYTHONPATH, before what was there (carried wheels, say)
    done = subprocess.run([sys.executable, "-m", "hetfl", "run", "--set", "train.local_epoch=2"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("hetfl: error: train.local_epoch = 2: unknown key; "
                                  "did you mean 'train.local_epochs'?")


def test_list_shows_methods_datasets_and_keys(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for word in ("scaffold", "Karimireddy", "cifar10", "dirichlet", "resnet18", "train.lr", "server_momentum"):
        assert word in out


def test_list_a_dataset_model_or_partition_shows_what_it_is_and_the_settings_it_takes(capsys, monkeypatch):
    """`hetfl list cifar100` / `resnet18` / `dirichlet`: a line on what it is, then its data.options, model.options
    or the data.* keys the split reads, with defaults (the options were only named by the error for a wrong one)."""
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["list", "cifar100"]) == 0
    out = capsys.readouterr().out
    assert "100 fine or 20 coarse classes" in out
    assert re.search(r"label_mode\s+│ 'fine'\s+│ one of 'fine', 'coarse'", out)
    assert main(["list", "resnet18"]) == 0
    out = capsys.readouterr().out
    assert "ResNet-18" in out and re.search(r"norm\s+│ 'bn'", out) and re.search(r"width\s+│ 64", out)
    assert main(["list", "dirichlet"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"data\.alpha\s+│ 0\.5", out) and "data.classes_per_client" not in out
    assert main(["list", "shards"]) == 0
    out = capsys.readouterr().out
    assert "data.classes_per_client" in out and "data.alpha" not in out
    assert main(["list", "mnsit"]) == 2
    assert "did you mean 'mnist'?" in capsys.readouterr().err


def test_every_dataset_model_and_partition_is_listed_with_a_description():
    from hetfl.cli import component_tables
    from hetfl.data.datasets import DATASETS
    from hetfl.data.partition import PARTITION_DOCS, PARTITIONS
    from hetfl.models import MODELS

    assert set(PARTITION_DOCS) == set(PARTITIONS)
    for name in (*DATASETS, *MODELS, *PARTITIONS):
        line, table = component_tables(name)[:2]
        assert len(line.plain.split(": ", 1)[1]) > 20 and table.row_count >= 1, name


def test_list_a_method_shows_its_settings_with_their_meaning(capsys, monkeypatch):
    """`hetfl list algorithms` gives each method's defaults only (feduv's lam=-1.0: what is it?); `hetfl list
    feduv` gives each key to set, its default and its meaning, post-hoc steps' keys included."""
    monkeypatch.setenv("COLUMNS", "200")  # a table cell's words on one line
    assert main(["list", "feduv"]) == 0
    out = capsys.readouterr().out
    assert "algorithm.lam" in out and "num_classes / 4" in out and "algorithm.mu" in out
    assert main(["list", "fedavg+ccvr"]) == 0
    assert "algorithm.ccvr.num_virtual" in capsys.readouterr().out
    assert main(["list", "config"]) == 0
    # where the algorithm.* keys are (words compared: a narrow console, as another test may leave, wraps the line)
    assert "hetfl list METHOD" in " ".join(capsys.readouterr().out.split())
    assert main(["list", "fedvu"]) == 2
    assert "did you mean 'feduv'?" in capsys.readouterr().err


def test_partition_prints_table_and_writes_heat_map(tmp_path, capsys):
    png, stats = tmp_path / "map.png", tmp_path / "stats.json"
    code = main(["partition", "--set", "data.partition=dirichlet", "--set", "data.alpha=0.1",
                 "--set", "data.num_clients=6", "--plot", str(png), "--json", str(stats)])
    assert code == 0
    assert "6 clients" in capsys.readouterr().out
    assert png.read_bytes()[:4] == b"\x89PNG"
    rows = json.loads(stats.read_text())
    assert len(rows) == 6 and sum(r["n_train"] for r in rows) > 0


def test_compare_writes_mean_std_tables_and_reuses_finished_runs(tmp_path, capsys):
    out = tmp_path / "cmp"
    argv = ["compare", "--methods", "fedavg,fedprox", "--seeds", "0,1", "--target", "0.3", "--out", str(out),
            "--set", "train.rounds=2", "--quiet"]
    assert main(argv) == 0
    table = (out / "comparison.md").read_text()
    # fedprox's mu is its default: no column (item 4 of issue 27); the run folders keep it
    assert "| fedavg | global | 2 |" in table and "| fedprox | global | 2 |" in table and "rounds to 30%" in table
    rows = list(csv.DictReader((out / "comparison.csv").open()))
    assert [r["method"] for r in rows] == ["fedavg", "fedprox"]
    finals = [json.loads((out / f"fedavg-seed{s}" / "summary.json").read_text())["final_global_acc"] for s in (0, 1)]
    assert abs(float(rows[0]["final_mean"]) - sum(finals) / 2) < 1e-9  # fractions, as summary.json
    capsys.readouterr()
    assert main(argv) == 0
    assert "finished earlier, reusing" in capsys.readouterr().out


def test_compare_tables_each_settings_traffic_as_its_runs_metrics_count_it(tmp_path):
    """The MB up / down column: the mean over a row's seeds of the bytes its runs' metrics.jsonl count up and
    down; SCAFFOLD's control variates double FedAvg's traffic both ways."""
    out = tmp_path / "cmp"
    assert main(["compare", "--methods", "fedavg,scaffold", "--seeds", "0,1", "--out", str(out),
                 "--set", "train.rounds=2", "--quiet"]) == 0
    rows = {r["method"]: r for r in csv.DictReader((out / "comparison.csv").open())}
    table = (out / "comparison.md").read_text()
    for method in ("fedavg", "scaffold"):
        lines = [[json.loads(x) for x in (out / f"{method}-seed{s}" / "metrics.jsonl").read_text().splitlines()]
                 for s in (0, 1)]
        up, down = (sum(sum(m[key] for m in run) for run in lines) / 2 / 1e6 for key in ("bytes_up", "bytes_down"))
        assert up > 0 and down > 0
        assert abs(float(rows[method]["mb_up"]) - up) < 1e-9 and abs(float(rows[method]["mb_down"]) - down) < 1e-9
        assert f"| {up:.3g} / {down:.3g} |" in table, table  # under 10 MB: three significant digits
    assert float(rows["scaffold"]["mb_up"]) == 2 * float(rows["fedavg"]["mb_up"])
    assert "MB up / down" in table and "the bytes each run's clients sent and received" in table


def test_resume_takes_the_settings_that_change_no_number(tmp_path, capsys):
    """A run made with --quiet keeps runtime.progress = false in its config.toml; its resume may turn the
    progress back on (or change any other key that changes no number: identity.PRESENTATION_KEYS), while a
    key that changes the numbers is still refused, naming what --resume takes."""
    run_dir = tmp_path / "run"
    assert main(["run", "--out", str(run_dir), "--set", "train.rounds=1", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["run", "--resume", str(run_dir), "--set", "runtime.progress=true"]) == 0
    assert "already finished" in " ".join(capsys.readouterr().out.split())
    assert main(["run", "--resume", str(run_dir), "--set", "train.lr=0.5"]) == 2
    err = capsys.readouterr().err
    assert "train.lr" in err and "runtime.progress" in err and "tracking." in err


def test_help_version_and_a_mistyped_option_answer_without_loading_torch():
    """cli.py's promise: the commands import their subsystems inside their functions, so `hetfl --help`,
    `--version` and a mistyped option answer at once (0.15 s, against 1.8 s when the console's summary table
    imported hetfl.privacy, and so torch, at module level)."""
    code = ("import sys; from hetfl.cli import main\n"
            "for argv in (['--help'], ['--version'], ['run', '--sett', 'x']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "assert 'torch' not in sys.modules, 'the CLI loaded torch'; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def test_a_process_a_test_starts_imports_the_hetfl_the_tests_import(tmp_path):
    """tests/conftest.py puts this hetfl's folder first on PYTHONPATH: a ``hetfl run`` a test starts runs the
    sources under test (a git worktree's, mutmut's scratch copy), not the environment's installed hetfl (a
    killed-and-resumed privacy test failed on every mutant of a scratch copy whose config had a key the installed
    sources lacked, and mutmut counted those mutants killed)."""
    import hetfl

    done = subprocess.run([sys.executable, "-c", "import hetfl; print(hetfl.__file__)"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=True)
    assert Path(done.stdout.strip()).resolve() == Path(hetfl.__file__).resolve()
