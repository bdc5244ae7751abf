"""Curves over seeds as mean ± std bands: what the figure shows (lines, shaded bands and their edges,
axes, legend with seed counts, per-seed lines, the single-seed case), the CSV beside it, and that
``hetfl compare``, ``hetfl report`` and ``hetfl reproduce`` write the figure and link it.

The figure tests use hand-made metrics (no training); the wiring tests use four tiny synthetic runs
(logistic regression, 4 clients, 2 rounds of 2 local steps) shared by the module.
"""

from __future__ import annotations

import csv
import json
import re
import statistics
import urllib.parse

import numpy as np
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_rgb

import hetfl
from hetfl import reproduce
from hetfl.analysis.curves import seed_band
from hetfl.analysis.plots import plot_seed_bands, seed_bands_figure
from hetfl.cli import main
from tests.helpers.figures import assert_inside_figure, data_axes, extent, flat, overlaps
from tests.helpers.runs import PRESET, TINY, fake_run

pytestmark = pytest.mark.usefixtures("one_thread")

IMAGE_LINK = re.compile(r"!\[[^\]]*\]\(([^)]+)\)")


# ------------------------------------------------------------------ inputs and helpers
def metrics(seed: int, rounds: int = 5, *, personal: bool = False, every: int = 1, scale: float = 1.0) -> list[dict]:
    """A run's ``metrics.jsonl`` rows: accuracy logged every ``every`` rounds (and the last), loss every round;
    the seed shifts the values (by an uneven amount, so that the std differs from round to round)."""
    rows = []
    for r in range(1, rounds + 1):
        row = {"round": r, "train_loss": scale * (1.0 + 0.1 * seed * r) / r}
        if r % every == 0 or r == rounds:
            row["client_acc_mean"] = 0.3 + 0.05 * r + 0.02 * seed
            if not personal:
                row["global_acc"] = 0.2 + 0.05 * r + 0.002 * seed * seed * r
        rows.append(row)
    return rows


GROUPS = {"FedAvg": {s: metrics(s) for s in (0, 1, 2)},
          "FedProx": {s: metrics(s, scale=3.0) for s in (4, 7)},
          "FedNova": {0: metrics(0, scale=0.5)}}


def expected(runs: dict[int, list[dict]], key: str, std=statistics.stdev) -> tuple[list, list, list]:
    """Rounds, mean and std over seeds, computed with :mod:`statistics` from the rows (not from our code)."""
    rounds = sorted(m["round"] for m in next(iter(runs.values())) if key in m)
    per_round = [[next(m[key] for m in rows if m["round"] == r) for rows in runs.values()] for r in rounds]
    return rounds, [statistics.fmean(v) for v in per_round], [std(v) if len(v) > 1 else 0.0 for v in per_round]


def bands_of(ax) -> list[PolyCollection]:
    return [c for c in ax.collections if isinstance(c, PolyCollection)]


def band_edges(band: PolyCollection) -> tuple[list[float], list[float], list[float]]:
    """The x positions of a filled band and its lower and upper edge at each."""
    vertices = band.get_paths()[0].vertices
    xs = sorted(set(vertices[:, 0].tolist()))
    lower = [vertices[vertices[:, 0] == x, 1].min() for x in xs]
    upper = [vertices[vertices[:, 0] == x, 1].max() for x in xs]
    return xs, lower, upper


def band_for(ax, line) -> PolyCollection:
    """The band drawn in ``line``'s colour."""
    (band,) = [b for b in bands_of(ax) if np.allclose(b.get_facecolor()[0][:3], to_rgb(line.get_color()))]
    return band


def mean_lines(ax) -> list:
    """The thick lines (means), in drawing order; thin ones are single seeds, dotted ones the target."""
    return [line for line in ax.lines if line.get_linewidth() > 1.5]


def legend_texts(fig) -> list[str]:
    (legend,) = fig.legends
    return [" ".join(t.get_text().split()) for t in legend.get_texts()]


# ------------------------------------------------------------------ the numbers
def test_seed_band_is_the_mean_and_std_over_seeds_on_shared_rounds():
    band = seed_band(GROUPS["FedAvg"], "global_acc")
    rounds, mean, std = expected(GROUPS["FedAvg"], "global_acc")
    assert band.rounds == rounds and band.seeds == [0, 1, 2] and band.n == 3 and band.dropped == []
    assert band.mean == pytest.approx(mean) and band.std == pytest.approx(std)
    assert max(std) > 2 * min(std) > 0  # the std varies over rounds: a std of the wrong axis would not match
    population = seed_band(GROUPS["FedAvg"], "global_acc", ddof=0)
    assert population.std == pytest.approx(expected(GROUPS["FedAvg"], "global_acc", statistics.pstdev)[2])
    assert seed_band(GROUPS["FedNova"], "global_acc").std.tolist() == [0.0] * 5  # one seed: no spread


def test_rounds_not_evaluated_by_every_seed_are_left_out_and_disjoint_rounds_are_refused():
    runs = {0: metrics(0, 6, every=2), 1: metrics(1, 6, every=3)}  # rounds 2, 4, 6 vs 3, 6
    band = seed_band(runs, "global_acc")
    assert band.rounds == [6] and band.dropped == [2, 3, 4]
    assert band.mean == pytest.approx([statistics.fmean([runs[0][5]["global_acc"], runs[1][5]["global_acc"]])])
    disjoint = {0: [{"round": 1, "global_acc": 0.5}], 1: [{"round": 2, "global_acc": 0.6}]}
    with pytest.raises(ValueError, match=r"FedAvg: the seeds share no round that logged 'global_acc'"):
        seed_band(disjoint, "global_acc", label="FedAvg")
    with pytest.raises(ValueError, match=r"seed 1 logged no 'global_acc'"):
        seed_band({0: metrics(0), 1: metrics(1, personal=True)}, "global_acc")
    with pytest.raises(ValueError, match="ddof 2"):
        seed_band(runs, "global_acc", ddof=2)


# ------------------------------------------------------------------ the figure
def test_each_label_is_a_mean_line_and_a_band_of_mean_plus_minus_std():
    fig = seed_bands_figure(GROUPS, target=0.6, context="3 methods on synthetic")
    acc_ax, loss_ax = data_axes(fig)
    for ax, key in ((acc_ax, "global_acc"), (loss_ax, "train_loss")):
        lines = mean_lines(ax)
        assert len(lines) == 3 and len(bands_of(ax)) == 2  # a line per label; no band for the single seed
        assert len({line.get_color() for line in lines}) == 3
        for line, (label, runs) in zip(lines, GROUPS.items(), strict=True):
            rounds, mean, std = expected(runs, key)
            assert line.get_xdata().tolist() == rounds and line.get_ydata() == pytest.approx(mean)
            if len(runs) > 1:
                xs, lower, upper = band_edges(band_for(ax, line))
                assert xs == rounds, label
                assert lower == pytest.approx(np.subtract(mean, std)) and upper == pytest.approx(np.add(mean, std))
        assert ax.get_xlabel() == "round"
    assert acc_ax.get_ylabel() == "test accuracy (global model, pooled test set)"
    assert -0.03 <= acc_ax.get_ylim()[0] <= 0.0 and 1.0 <= acc_ax.get_ylim()[1] <= 1.03  # the whole [0, 1]
    assert [t.get_text() for t in acc_ax.get_legend().get_texts()] == ["target 0.6"]
    assert loss_ax.get_ylabel().startswith("train loss")
    assert legend_texts(fig) == ["FedAvg (3 seeds)", "FedProx (2 seeds)", "FedNova (1 seed, no band)"]
    title = flat(fig._suptitle.get_text())
    assert "3 methods on synthetic" in title and "sample std" in title and "one seed, no band: FedNova" in title
    assert_inside_figure(fig, fig.legends[0])
    assert not any(overlaps(fig, fig.legends[0], ax) for ax in (acc_ax, loss_ax))


def test_per_seed_lines_in_the_label_colour_and_population_std_on_request():
    fig = seed_bands_figure(GROUPS, per_seed=True, ddof=0)
    acc_ax, _ = data_axes(fig)
    assert len(acc_ax.lines) == 3 + (3 + 2 + 1)  # a mean per label and a thin line per seed
    for line in mean_lines(acc_ax):
        label = next(k for k, v in GROUPS.items() if expected(v, "global_acc")[1] == pytest.approx(line.get_ydata()))
        thin = [t for t in acc_ax.lines if t.get_linewidth() < 1 and t.get_color() == line.get_color()]
        seeds = [[m["global_acc"] for m in rows] for rows in GROUPS[label].values()]
        np.testing.assert_allclose([t.get_ydata() for t in thin], seeds)
    fedavg = mean_lines(acc_ax)[0]
    _, lower, _ = band_edges(band_for(acc_ax, fedavg))
    _, mean, std = expected(GROUPS["FedAvg"], "global_acc", statistics.pstdev)
    assert lower == pytest.approx(np.subtract(mean, std))
    assert "population std" in flat(fig._suptitle.get_text()) and "thin lines: each seed" in fig._suptitle.get_text()


def test_a_single_seed_is_a_line_without_a_band_and_says_so():
    fig = seed_bands_figure({"FedAvg": [metrics(0)]})
    acc_ax, loss_ax = data_axes(fig)
    assert len(acc_ax.lines) == 1 and bands_of(acc_ax) == [] and bands_of(loss_ax) == []
    assert legend_texts(fig) == ["FedAvg (1 seed, no band)"]
    title = flat(fig._suptitle.get_text())
    assert "line: one seed (no bands)" in title and "FedAvg" not in title  # said once, not listed again
    assert "band: ±" not in title


def test_a_single_evaluated_round_still_shows_its_band():
    fig = seed_bands_figure({"FedAvg": {s: metrics(s, 1) for s in (0, 1)}})
    acc_ax, _ = data_axes(fig)
    (band,) = bands_of(acc_ax)
    xs, lower, upper = band_edges(band)
    _, mean, std = expected({s: metrics(s, 1) for s in (0, 1)}, "global_acc")
    assert xs == [0.75, 1.25] and lower == pytest.approx([mean[0] - std[0]] * 2) and upper == pytest.approx(
        [mean[0] + std[0]] * 2)


def test_personalised_labels_show_the_client_mean_dashed_with_a_style_key():
    groups = {"FedAvg": {s: metrics(s) for s in (0, 1)}, "FedPAC": {s: metrics(s, personal=True) for s in (0, 1)}}
    fig = seed_bands_figure(groups)
    acc_ax, _ = data_axes(fig)
    fedavg, fedpac = mean_lines(acc_ax)
    assert fedavg.get_linestyle() == "-" and fedpac.get_linestyle() == "--"
    assert fedpac.get_ydata() == pytest.approx(expected(groups["FedPAC"], "client_acc_mean")[1])
    assert [t.get_text() for t in acc_ax.get_legend().get_texts()] == [
        "global model, pooled test set", "mean over clients, own test splits"]
    assert acc_ax.get_ylabel() == "test accuracy"
    only_personal = seed_bands_figure({"FedPAC": groups["FedPAC"]})
    assert data_axes(only_personal)[0].get_ylabel() == "test accuracy (mean over clients, own test splits)"


def test_dropped_rounds_are_noted_in_the_title():
    fig = seed_bands_figure({"FedAvg": {0: metrics(0, 6, every=2), 1: metrics(1, 6, every=3)}})
    assert "FedAvg: 3 round(s) of global_acc not logged by every seed left out" in flat(fig._suptitle.get_text())
    assert mean_lines(data_axes(fig)[0])[0].get_xdata().tolist() == [6]


def test_curves_hidden_under_another_label_are_named_in_the_title():
    same = {s: metrics(s) for s in (0, 1)}
    shifted = {s: [{**m, "global_acc": m["global_acc"] + 0.01} for m in metrics(s)] for s in (0, 1)}
    fig = seed_bands_figure({"fedavg": same, "fedprox (mu=0.01)": same, "scaffold": shifted})
    title = flat(fig._suptitle.get_text())
    assert title.split("accuracy curves coincide (one hides the other): ")[1] == "fedavg = fedprox (mu=0.01)"
    assert "coincide" not in seed_bands_figure(GROUPS)._suptitle.get_text()


@pytest.mark.parametrize("count", [2, 12])
def test_the_legend_of_many_long_labels_stays_inside_the_figure_and_off_the_panels(count):
    groups = {f"method{k} (data.alpha=0.{k}, train.lr=0.0{k}, algorithm.mu=0.{k}, model.name=cnn2)": {
        s: metrics(s, scale=1.0 + k) for s in (0, 1)} for k in range(count)}
    fig = seed_bands_figure(groups)
    (legend,) = fig.legends
    assert len(legend.get_texts()) == count and all(t.endswith("(2 seeds)") for t in legend_texts(fig))
    assert_inside_figure(fig, legend)
    for ax in data_axes(fig):
        assert not overlaps(fig, legend, ax)
        assert extent(fig, ax).height > 150  # the panels keep their room: the figure grows for the legend


def test_plot_seed_bands_writes_the_png_and_the_numbers_behind_it(tmp_path):
    written = plot_seed_bands(GROUPS, tmp_path, name="bands", per_seed=True)
    assert written["png"].read_bytes()[:4] == b"\x89PNG"
    rows = list(csv.DictReader(written["data"].open()))
    assert list(rows[0]) == ["round", "label", "metric", "mean", "std", "n", "seed_0", "seed_1", "seed_2", "seed_4",
                             "seed_7"]
    for label, runs in GROUPS.items():
        for key in ("global_acc", "train_loss"):
            mine = [r for r in rows if r["label"] == label and r["metric"] == key]
            rounds, mean, std = expected(runs, key)
            assert [int(r["round"]) for r in mine] == rounds
            assert [float(r["mean"]) for r in mine] == pytest.approx(mean)
            assert [float(r["std"]) for r in mine] == pytest.approx(std)
            assert {r["n"] for r in mine} == {str(len(runs))}
            for seed, seed_rows in runs.items():
                assert [float(r[f"seed_{seed}"]) for r in mine] == pytest.approx([m[key] for m in seed_rows])
            assert all(r[f"seed_{s}"] == "" for r in mine for s in (0, 1, 2, 4, 7) if s not in runs)
    plain = list(csv.DictReader(plot_seed_bands(GROUPS, tmp_path, name="plain")["data"].open()))
    assert list(plain[0]) == ["round", "label", "metric", "mean", "std", "n"]


def test_run_directories_are_read_from_disk(tmp_path):
    for seed in (0, 1):
        (tmp_path / f"s{seed}").mkdir()
        (tmp_path / f"s{seed}" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics(seed)))
    fig = seed_bands_figure({"FedAvg": {0: tmp_path / "s0", 1: tmp_path / "s1" / "metrics.jsonl"}})
    line = mean_lines(data_axes(fig)[0])[0]
    assert line.get_ydata() == pytest.approx(expected({s: metrics(s) for s in (0, 1)}, "global_acc")[1])


# ------------------------------------------------------------------ compare, report, reproduce
def links(md_path) -> list[str]:
    """The images a Markdown file links, each checked to be a relative path to a file beside it."""
    targets = [urllib.parse.unquote(t) for t in IMAGE_LINK.findall(md_path.read_text())]
    for target in targets:
        assert not target.startswith("/") and ".." not in target, target
        assert (md_path.parent / target).is_file(), target
    return targets


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("bands") / "cmp"
    return hetfl.compare("fedavg,local", seeds=[0, 1], overrides=TINY, out=out, target=0.5)


def test_compare_writes_curves_png_linked_from_comparison_md(compared):
    out = compared.out
    assert links(out / "comparison.md") == ["curves.png"]
    assert compared.markdown == (out / "comparison.md").read_text()
    assert compared.markdown.index("| fedavg |") < compared.markdown.index("![")  # under the table
    rows = list(csv.DictReader((out / "curves.csv").open()))
    assert [r["label"] for r in rows if r["round"] == "1" and r["metric"] != "train_loss"] == ["fedavg", "local"]
    assert {r["metric"] for r in rows} == {"global_acc", "client_acc_mean", "train_loss"}  # local is personalised
    fedavg = {r.config.seed: r.metrics for r in compared.runs if r.config.algorithm.name == "fedavg"}
    mine = [r for r in rows if r["label"] == "fedavg" and r["metric"] == "global_acc"]
    _, mean, std = expected(fedavg, "global_acc")
    assert [float(r["mean"]) for r in mine] == pytest.approx(mean)
    assert [float(r["std"]) for r in mine] == pytest.approx(std)
    assert {r["n"] for r in rows} == {"2"}


def test_report_over_a_comparison_draws_bands_per_setting_and_per_seed_lines_on_request(compared, tmp_path,
                                                                                         monkeypatch):
    monkeypatch.setattr("hetfl.report.partition_plot", lambda run, out: None)  # not under test here; 2/3 of the time
    run_dirs = [str(r.run_dir) for r in compared.runs]
    assert main(["report", *run_dirs, "--out", str(tmp_path / "r")]) == 0
    md = tmp_path / "r" / "report.md"
    assert "seed_bands.png" in links(md) and "curves.png" not in links(md)  # bands instead of a line per seed
    rows = list(csv.DictReader((tmp_path / "r" / "seed_bands.csv").open()))
    assert {r["label"] for r in rows} == {"fedavg", "local"} and {r["n"] for r in rows} == {"2"}
    assert "seed_0" not in rows[0]
    assert main(["report", *run_dirs, "--out", str(tmp_path / "p"), "--per-seed"]) == 0
    shown = links(tmp_path / "p" / "report.md")
    assert shown[:2] == ["seed_bands.png", "curves.png"]  # bands with seed lines, then one line per run
    assert next(csv.DictReader((tmp_path / "p" / "seed_bands.csv").open())).keys() >= {"seed_0", "seed_1"}
    page = (tmp_path / "p" / "report.html").read_text()
    assert page.count('alt="seed_bands"') == 1 and page.count('alt="curves"') == 1


TWIN = PRESET + """
[[rows]]
label = "A again"
algorithm = "fedavg"
"""


def test_reproduce_writes_a_bands_figure_per_column_linked_from_reproduction_md(tmp_path):
    path = tmp_path / "toy.toml"
    path.write_text(TWIN)
    preset = reproduce.load_preset(str(path))
    accs = {"fedavg": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], "fedprox": [0.9, 0.1, 0.8, 0.2, 0.7, 0.6]}
    out = tmp_path / "out"
    result = reproduce.reproduce(preset, out, fake_run(accs))
    assert result["curves"] == {"c": {"png": "curves_c.png", "csv": "curves_c.csv"}}
    assert json.loads((out / "reproduction.json").read_text())["curves"] == result["curves"]
    assert links(out / "reproduction.md") == ["curves_c.png"]
    rows = list(csv.DictReader((out / "curves_c.csv").open()))
    assert [r["label"] for r in rows if r["round"] == "6"] == ["A, A again: same runs", "B"]  # one band per run set
    a6 = next(r for r in rows if r["round"] == "6" and r["label"].startswith("A"))
    seeds = [0.6 + 0.01 * s for s in (0, 1)]
    assert float(a6["mean"]) == pytest.approx(statistics.fmean(seeds))
    assert float(a6["std"]) == pytest.approx(statistics.stdev(seeds))  # sample std, as reproduction.md's table
    assert {r["metric"] for r in rows} == {"global_acc"}  # the fake runs log no train loss: that panel says so
