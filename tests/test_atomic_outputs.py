"""Every file that hetfl writes for users and their scripts is written whole or not at all: interrupted while
writing it (Ctrl-C, a kill), the file from before is still there and readable, and no temporary file is left.

Each writer goes through :func:`hetfl.files.atomic_write_bytes` (a temporary file in the same folder, then
``os.replace``). The tests run each writer twice, the second time with ``os.replace`` raising
``KeyboardInterrupt``, as a Ctrl-C would between writing and publishing the file. A plain ``write_text``, as
these writers used before, would have published the second version (or half of it).
The run directory's own files (metrics, summary, checkpoints) have their tests in tests/engine."""

from __future__ import annotations

import fnmatch
import os
import shutil
from pathlib import Path

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from hetfl import config, reproduce
from hetfl.analysis import plots
from hetfl.cli import main
from hetfl.data.partition import make_partition
from hetfl.data.partition_report import plot_partition
from hetfl.engine.experiment import Experiment
from hetfl.report import build_report
from tests.helpers.runs import PRESET, TINY, fake_run


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def interrupted(monkeypatch: pytest.MonkeyPatch, write, *, raises: bool = True, only: str = "") -> None:
    """Call ``write`` with ``os.replace`` raising KeyboardInterrupt (only for files whose name matches the pattern
    ``only`` where one is given); it must raise it (not swallow it), unless ``raises`` is False (the CLI turns it
    into exit code 130)."""
    replace = os.replace

    def ctrl_c(source, target, *args, **kwargs):
        if only and not fnmatch.fnmatch(Path(target).name, only):
            return replace(source, target, *args, **kwargs)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", ctrl_c)
        if raises:
            with pytest.raises(KeyboardInterrupt):
                write()
        else:
            write()


def check_written_whole(folder: Path, first, second, monkeypatch, *, raises: bool = True,
                        only: str = "") -> dict[str, bytes]:
    """``first()`` writes files into ``folder``; ``second()``, interrupted, leaves every one as it was."""
    first()
    before = snapshot(folder)
    assert before, "the writer wrote nothing"
    interrupted(monkeypatch, second, raises=raises, only=only)
    assert snapshot(folder) == before, "an interrupted write changed a file or left a temporary file"
    return before


def test_analysis_figures_tables_and_csv(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    def write(value: float) -> None:
        fig = plt.figure()
        fig.gca().plot([0, value])
        plots._save(fig, tmp_path, "figure")
        plt.close(fig)
        plots._write_json(tmp_path, "table", {"value": value})
        plots._write_csv(tmp_path, "rows", ["a", "b"], [[value, 2 * value]])

    before = check_written_whole(tmp_path, lambda: write(1.0), lambda: write(2.0), monkeypatch)
    assert set(before) == {"figure.png", "table.json", "rows.csv"}
    assert before["rows.csv"] == b"a,b\r\n1.0,2.0\r\n"  # csv's own line ends, as open(newline="") wrote them


def test_partition_heat_map(tmp_path, monkeypatch):
    labels = np.repeat(np.arange(10), 30)
    part = make_partition("dirichlet", labels, labels, 5, seed=0, alpha=0.5)
    target = tmp_path / "map.png"
    check_written_whole(tmp_path, lambda: plot_partition(part, labels, 10, target, title="first"),
                        lambda: plot_partition(part, labels, 10, target, title="second"), monkeypatch)


def test_hetfl_partition_json(tmp_path, monkeypatch, capsys):
    out = tmp_path / "partition.json"

    def write(alpha: float, code: int) -> None:
        assert main(["partition", "--set", "data.partition=dirichlet", "--set", f"data.alpha={alpha}",
                     "--json", str(out)]) == code

    check_written_whole(tmp_path, lambda: write(0.5, 0), lambda: write(0.1, 130), monkeypatch, raises=False)


def test_reproduction_table_and_its_curves(tmp_path, monkeypatch):
    path = tmp_path / "toy.toml"
    path.write_text(PRESET)
    preset = reproduce.load_preset(str(path))
    out = tmp_path / "out"
    accs = {"fedavg": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], "fedprox": [0.9, 0.1, 0.8, 0.2, 0.7, 0.6]}
    reproduce.reproduce(preset, out, fake_run(accs))
    shutil.rmtree(out / "c")  # the runs (fake ones, without config.toml: not reusable), run again below
    before = snapshot(out)
    assert {"reproduction.json", "reproduction.md"} <= set(before)
    interrupted(monkeypatch, lambda: reproduce.reproduce(preset.variant(True), out, fake_run(accs)))
    after = snapshot(out)
    assert {k: after[k] for k in before} == before and not [k for k in after if k.endswith(".tmp")]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("run") / "run"
    Experiment(config.load(None, [*TINY, "model.name=mlp", "model.options={hidden=[8]}"])).run(run)
    return run


def test_report_pages(tiny_run, tmp_path, monkeypatch):
    out = tmp_path / "report"
    before = check_written_whole(out, lambda: build_report([tiny_run], out, title="first"),
                                 lambda: build_report([tiny_run], out, title="second"), monkeypatch,
                                 only="report.html")  # the figures before it are written again, the same
    assert {"report.html", "report.md"} <= set(before)


def test_report_copies_of_a_runs_analysis_figures(tiny_run, tmp_path, monkeypatch):
    from hetfl.analysis.run import analyze_run

    analyze_run(tiny_run, ["weight_norms"])
    out = tmp_path / "report"
    before = check_written_whole(out, lambda: build_report([tiny_run], out, title="first"),
                                 lambda: build_report([tiny_run], out, title="second"), monkeypatch,
                                 only="analysis_*.png")
    assert any(name.startswith("analysis_") for name in before)
    shutil.rmtree(tiny_run / "analysis")


def test_analysis_index(tiny_run, monkeypatch):
    from hetfl.analysis.run import analyze_run

    folder = tiny_run / "analysis"
    check_written_whole(folder, lambda: analyze_run(tiny_run, ["curves"]),
                        lambda: analyze_run(tiny_run, ["curves", "weight_norms"]), monkeypatch)
