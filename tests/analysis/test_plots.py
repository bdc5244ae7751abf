"""What every figure hetfl draws shows: titles (what, which run, layer and round), axis labels,
scales and limits, the number of series, colour bars, and legends inside the figure.

Each test builds a figure from tiny synthetic inputs with the ``*_figure`` function that the
matching ``plot_*`` writer uses, and inspects the matplotlib objects (Agg canvas, no pyplot).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from hetfl.analysis import plot_cka, plot_spectrum, plot_swd_matrix, singular_values
from hetfl.analysis.plots import (
    CATEGORICAL_MAX,
    FLOAT32_EPS,
    cka_figure,
    curves_figure,
    precision_floor,
    spectrum_figure,
    swd_figure,
    tsne_figure,
    weight_norms_figure,
)
from hetfl.data.partition import Partition
from hetfl.data.partition_report import class_counts, partition_figure
from tests.helpers.figures import assert_inside_figure, data_axes, extent, flat, overlaps

CONTEXT = "run-a: fedavg on mnist (cnn2), round 3"
LONG = ("the model has no hidden layer: the input layer's CKA is trivially 1 (every model sees the same probe "
        "inputs) and is left out; only the logits are compared")


# ------------------------------------------------------------------ helpers
def headings(fig) -> str:
    """The figure's suptitle and every visible axes title, one string."""
    parts = [fig._suptitle.get_text() if fig._suptitle is not None else ""]
    parts += [ax.get_title() for ax in fig.axes if ax.get_visible()]
    return "\n".join(parts)


def assert_titles_inside(fig) -> None:
    """The suptitle and every axes title fit in the figure (long ones are wrapped, not cut off)."""
    titles = [fig._suptitle] if fig._suptitle is not None else []
    titles += [ax.title for ax in fig.axes if ax.get_visible() and ax.get_title()]
    assert titles
    for title in titles:
        assert_inside_figure(fig, title)


def colorbars(fig) -> list:
    """The colour bars of the figure's images and scatters."""
    mappables = [m for ax in fig.axes for m in (*ax.images, *ax.collections)]
    return [m.colorbar for m in mappables if getattr(m, "colorbar", None) is not None]


def rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ CKA
def test_cka_figure_bars_heat_maps_and_one_colour_bar():
    mats = {"encoder.0": torch.tensor([[1.0, 0.9, 0.7], [0.9, 1.0, 0.8], [0.7, 0.8, 1.0]]),
            "classifier": torch.tensor([[1.0, 0.3, 0.2], [0.3, 1.0, 0.1], [0.2, 0.1, 1.0]])}
    fig = cka_figure(mats, model_labels=["client 0", "client 4", "client 9"], context=CONTEXT, note="a caveat")
    bars_ax, *maps = data_axes(fig)
    assert [p.get_height() for p in bars_ax.patches] == pytest.approx([0.8, 0.2])
    assert bars_ax.get_ylim() == pytest.approx((0.0, 1.05))  # CKA's whole range
    assert "layer" in bars_ax.get_xlabel() and "CKA" in bars_ax.get_ylabel()
    assert [t.get_text() for t in bars_ax.get_xticklabels()] == ["encoder.0", "classifier"]
    assert len(maps) == 2 and all(len(ax.images) == 1 for ax in maps)
    assert [ax.get_title() for ax in maps] == ["encoder.0 (mean 0.80)", "classifier (mean 0.20)"]
    assert [t.get_text() for t in maps[0].get_yticklabels()] == ["client 0", "client 4", "client 9"]
    assert all(ax.images[0].get_clim() == (0.0, 1.0) for ax in maps)  # the same scale in every map
    (bar,) = {id(cb): cb for cb in colorbars(fig)}.values()  # one shared colour bar
    assert bar.ax.get_ylabel() == "linear CKA"
    title = flat(fig._suptitle.get_text())
    assert "CKA" in title and CONTEXT in title and "a caveat" in title


def test_cka_figure_marks_an_undefined_layer_and_hides_spare_panels():
    mats = {f"layer{i}": torch.eye(2) for i in range(5)}
    mats["layer4"] = torch.tensor([[float("nan"), float("nan")], [float("nan"), float("nan")]])
    fig = cka_figure(mats)
    assert len(data_axes(fig)) == 6  # bars + 5 maps; the grid's other 2 panels are hidden
    bars_ax = data_axes(fig)[0]
    assert [t.get_text() for t in bars_ax.texts] == ["n/a"] and bars_ax.patches[4].get_height() == 0.0
    assert "layer4 (mean n/a)" in headings(fig)


@pytest.mark.parametrize("layers", [1, 3])
def test_cka_figure_long_note_is_wrapped_inside_the_figure(layers):
    fig = cka_figure({f"layer{i}": torch.eye(3) for i in range(layers)}, context=CONTEXT, note=LONG)
    assert_titles_inside(fig)
    assert flat(fig._suptitle.get_text()).endswith(LONG)  # wrapped, nothing dropped


def test_plot_cka_writes_the_note_with_the_numbers(tmp_path):
    paths = plot_cka({"classifier": torch.tensor([[1.0, 0.5], [0.5, 1.0]])}, tmp_path, note="no hidden layer")
    assert json.loads(paths["data"].read_text())["note"] == "no hidden layer"


# ------------------------------------------------------------------ classifier norms
def test_weight_norms_figure_panels_axes_from_zero_and_one_legend_inside():
    counts = np.array([[5.0, 50.0, 0.0], [10.0, 10.0, 80.0], [1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    norms = np.array([[1.40, 1.50, 1.45], [0.8, 0.7, 2.0], [1.0, 1.1, 1.2], [1.0, 1.1, 1.2]])
    fig = weight_norms_figure(norms, counts, context=CONTEXT)
    panels = [ax for ax in data_axes(fig) if ax.patches]
    twins = [ax for ax in data_axes(fig) if ax.lines]
    assert len(panels) == 4 and len(twins) == 4  # 4 clients on a 2 x 3 grid: 2 panels hidden
    assert sum(not ax.get_visible() for ax in fig.axes) == 2
    assert [len(ax.patches) for ax in panels] == [3, 3, 3, 3]
    assert [p.get_height() for p in panels[1].patches] == [10.0, 10.0, 80.0]
    assert twins[0].lines[0].get_ydata() == pytest.approx(norms[0])
    # norms 1.40-1.50 on an axis from 0: a spread of 7 % is not drawn as a spread of 100 %
    assert all(ax.get_ylim()[0] == 0.0 for ax in panels + twins)
    assert panels[0].get_xlabel() == "class" and "samples" in panels[0].get_ylabel()
    assert "w_c" in twins[0].get_ylabel()
    assert panels[3].get_title() == "client 3: r=-1.00, ρ=-1.00"
    (legend,) = fig.legends
    assert len(legend.get_texts()) == 2
    assert_inside_figure(fig, legend)
    assert not any(overlaps(fig, legend, ax) for ax in panels) and not overlaps(fig, legend, fig._suptitle)
    assert CONTEXT in flat(fig._suptitle.get_text()) and "Pearson" in flat(fig._suptitle.get_text())
    assert_titles_inside(weight_norms_figure(norms[:1], counts[:1], context=CONTEXT))  # one narrow panel


def test_the_weight_norms_legend_of_one_panel_stays_inside():
    """A run without saved client models gets one panel (the global model): its legend, whose two entries side
    by side are wider than the panel, was cut at both edges of the PNG."""
    fig = weight_norms_figure(np.array([[1.0, 1.1, 1.2]]), np.array([[5.0, 50.0, 0.0]]), context=CONTEXT)
    (legend,) = fig.legends
    assert_inside_figure(fig, legend)
    assert not any(overlaps(fig, legend, ax) for ax in data_axes(fig) if ax.patches)


# ------------------------------------------------------------------ spectrum
def spectra(count: int, d: int = 16) -> dict[str, torch.Tensor]:
    """Spectra of rank-4 features: 12 of the 16 singular values are rounding noise (~1e-17)."""
    base = torch.randn(200, 4, generator=rng(0), dtype=torch.float64)
    out = {}
    for k in range(count):
        mix = torch.randn(4, d, generator=rng(k + 1), dtype=torch.float64)
        out[f"client {k}"] = singular_values(base @ mix)
    return out


def test_spectrum_axis_stops_at_numerical_precision():
    data = spectra(2)
    assert float(data["client 0"][-1] / data["client 0"][0]) < 1e-15  # the values the old axis ran down to
    fig = spectrum_figure(data, context=CONTEXT)
    (ax,) = data_axes(fig)
    floor = FLOAT32_EPS * 16
    assert precision_floor(np.ones(16)) == pytest.approx(floor)
    assert ax.get_yscale() == "log"
    assert ax.get_ylim()[0] == pytest.approx(floor)
    assert len(ax.lines) == 2 and ax.get_xlim()[1] >= 16  # the x axis shows all 16 indices, drawn or not
    for line in ax.lines:
        y = np.asarray(line.get_ydata(), dtype=np.float64)
        assert np.all(np.isnan(y) | (y > floor))  # nothing drawn under the floor...
        assert np.isfinite(y).sum() == 4  # ...and the 4 real directions all drawn
        assert y[0] == pytest.approx(1.0)
    title = flat(fig._suptitle.get_text())
    assert "Singular values" in title and "eps(float32)" in title and f"{floor:.1e}" in title and CONTEXT in title
    assert "σ_i / σ_1" in ax.get_ylabel() and "index" in ax.get_xlabel()
    assert_titles_inside(spectrum_figure(data, context=CONTEXT, note=LONG))


def test_spectrum_unnormalised_floor_follows_the_largest_value():
    s = torch.tensor([1e3, 1e2, 1e-9, 0.0], dtype=torch.float64)
    fig = spectrum_figure({"raw": s}, normalize=False)
    (ax,) = data_axes(fig)
    assert ax.get_ylim()[0] == pytest.approx(1e3 * FLOAT32_EPS * 4)
    assert np.isfinite(np.asarray(ax.lines[0].get_ydata(), dtype=np.float64)).sum() == 2
    assert ax.get_ylabel() == "σ_i (log scale)"


@pytest.mark.parametrize("count", [2, 9])
def test_spectrum_legend_inside_the_figure_and_off_the_curves_when_long(count):
    fig = spectrum_figure(spectra(count))
    (ax,) = data_axes(fig)
    legend = ax.get_legend()
    assert len(legend.get_texts()) == count and "erank" in legend.get_texts()[0].get_text()
    assert_inside_figure(fig, legend)
    if count == 9:  # a long legend goes beside the axes: it covers no curve
        assert extent(fig, legend).x0 >= extent(fig, ax).x1
    else:  # a short one stays in the axes
        assert extent(fig, ax).contains(*extent(fig, legend).p0) and extent(fig, ax).contains(*extent(fig, legend).p1)
    colours = {tuple(line.get_color()) for line in ax.lines}
    assert len(colours) == count  # no two curves share a colour


def test_plot_spectrum_keeps_every_value_in_the_data(tmp_path):
    paths = plot_spectrum(spectra(1), tmp_path)
    rows = paths["data"].read_text().splitlines()
    assert len(rows) == 1 + 16 and float(rows[-1].split(",")[1]) < 1e-10  # the noise is in the CSV, not the plot


# ------------------------------------------------------------------ sliced Wasserstein
def test_swd_figure_title_names_layer_and_round_and_colour_bar_starts_at_zero():
    mat = np.array([[0.0, 1.0, 2.0], [1.0, 0.0, 3.0], [2.0, 3.0, 0.0]])
    fig = swd_figure(mat, labels=["0", "3", "7"], layer="features = classifier input (encoder output, d=84)",
                     round=7, context=CONTEXT)
    (ax,) = data_axes(fig)
    title = flat(fig._suptitle.get_text())
    assert "Sliced Wasserstein" in title and "encoder output, d=84" in title and "round 7" in title
    assert CONTEXT in title
    assert len(ax.images) == 1 and ax.images[0].get_clim() == (0.0, 3.0)
    assert len(ax.texts) == 9 and ax.texts[1].get_text() == "1"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "3", "7"]
    assert ax.get_xlabel() == "client" == ax.get_ylabel()
    (bar,) = colorbars(fig)
    assert "distance" in bar.ax.get_ylabel() and "feature units" in bar.ax.get_ylabel()
    assert_titles_inside(fig)


def test_swd_figure_many_clients_no_cell_values_and_default_title():
    mat = np.abs(np.subtract.outer(np.arange(40.0), np.arange(40.0)))
    fig = swd_figure(mat)
    (ax,) = data_axes(fig)
    assert len(ax.texts) == 0 and fig._suptitle.get_text() == "Sliced Wasserstein distance"


def test_plot_swd_matrix_still_accepts_the_old_arguments(tmp_path):
    paths = plot_swd_matrix(np.zeros((2, 2)), tmp_path, labels=["a", "b"], title="t", axis_label="group")
    assert paths["png"].is_file() and paths["data"].read_text().startswith(",a,b")


# ------------------------------------------------------------------ t-SNE
def test_tsne_figure_legend_for_few_groups_colour_bar_for_many():
    n = 120
    xy = torch.randn(n, 2, generator=rng(0))
    labels, clients = torch.arange(n) % 5, torch.arange(n) % 30
    fig = tsne_figure(xy, labels, clients=clients, context=CONTEXT, what="global-model features")
    class_ax, client_ax = data_axes(fig)
    assert len(class_ax.collections) == 5 and sum(len(c.get_offsets()) for c in class_ax.collections) == n
    legend = class_ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["0", "1", "2", "3", "4"]
    assert legend.get_title().get_text() == "class"
    assert_inside_figure(fig, legend)
    # 30 clients > CATEGORICAL_MAX: a colour bar, not a legend with repeated colours
    assert CATEGORICAL_MAX < 30 and client_ax.get_legend() is None
    (bar,) = colorbars(fig)
    assert bar.ax.get_ylabel() == "client" and len(client_ax.collections) == 1
    assert "t-SNE 1" in class_ax.get_xlabel() and "t-SNE 2" in client_ax.get_ylabel()
    assert "global-model features" in flat(fig._suptitle.get_text()) and CONTEXT in flat(fig._suptitle.get_text())
    assert [class_ax.get_title(), client_ax.get_title()] == ["coloured by class", "coloured by client"]
    assert_titles_inside(tsne_figure(xy, labels, context=CONTEXT, what="inputs (the model has no hidden layer)"))


def test_tsne_figure_long_legend_goes_beside_the_axes_inside_the_figure():
    n = 200
    fig = tsne_figure(torch.randn(n, 2, generator=rng(1)), torch.arange(n) % 20)
    (ax,) = data_axes(fig)
    legend = ax.get_legend()
    assert len(legend.get_texts()) == 20
    assert len({tuple(c.get_facecolor()[0]) for c in ax.collections}) == 20  # 20 distinct colours
    assert_inside_figure(fig, legend)
    assert extent(fig, legend).x0 >= extent(fig, ax).x1


# ------------------------------------------------------------------ curves
def metrics(rounds: int = 4, *, personal: bool = False, scale: float = 1.0) -> list[dict]:
    rows = []
    for r in range(1, rounds + 1):
        row = {"round": r, "train_loss": scale / r ** 2, "bytes_up": 1_000_000, "bytes_down": 1_000_000,
               "client_acc_mean": 0.5 + 0.01 * r, "client_acc": [0.4 + 0.01 * r, 0.5, 0.6, 0.7]}
        if not personal:
            row["global_acc"] = 0.80 + 0.01 * r
        rows.append(row)
    return rows


def test_curves_figure_one_run_full_accuracy_axes_and_units():
    fig = curves_figure(metrics(), target=0.82, context=CONTEXT)
    acc_ax, spread_ax, loss_ax, bytes_ax = data_axes(fig)
    assert len(acc_ax.lines) == 3  # global, client mean, target
    assert acc_ax.lines[0].get_ydata() == pytest.approx([0.81, 0.82, 0.83, 0.84])
    # accuracies 0.81-0.84 on [0, 1]: the axis is not cut to the data
    for ax in (acc_ax, spread_ax):
        assert -0.03 <= ax.get_ylim()[0] <= 0.0 and 1.0 <= ax.get_ylim()[1] <= 1.03
    assert len(spread_ax.lines) == 3 and len(spread_ax.collections) == 1  # median, min, max; quartile band
    keys = [t.get_text() for t in acc_ax.get_legend().get_texts()]
    assert keys == ["global model, pooled test set", "mean over clients, own test splits", "target 0.82"]
    assert [t.get_text() for t in spread_ax.get_legend().get_texts()] == ["median", "min / max", "interquartile range"]
    assert loss_ax.get_yscale() == "log" and "log" in loss_ax.get_ylabel()  # 1 to 1/16 spans a decade
    assert bytes_ax.lines[0].get_ydata() == pytest.approx([2.0, 4.0, 6.0, 8.0]) and "MB" in bytes_ax.get_ylabel()
    assert all(ax.get_xlabel() == "round" for ax in (acc_ax, spread_ax, loss_ax, bytes_ax))
    assert fig.legends == []  # one run: nothing to tell apart; its name is in the title
    assert CONTEXT in flat(fig._suptitle.get_text())
    for ax in (acc_ax, spread_ax):
        assert_inside_figure(fig, ax.get_legend())


def test_curves_figure_many_runs_share_a_legend_inside_the_figure():
    runs = {f"method {k} (alpha=0.{k}) seed 0": metrics(personal=k % 2 == 1, scale=1.0 + k) for k in range(12)}
    fig = curves_figure(runs)
    acc_ax, _, loss_ax, _ = data_axes(fig)
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == list(runs)
    assert_inside_figure(fig, legend)
    assert not any(overlaps(fig, legend, ax) for ax in data_axes(fig))
    assert len(loss_ax.lines) == 12 and len({line.get_color() for line in loss_ax.lines}) == 12  # no reused colour
    assert len(acc_ax.lines) == 6 * 2 + 6  # global + client mean for 6 runs, client mean only for 6
    assert len(acc_ax.get_legend().get_texts()) == 2  # a style key, not 18 entries over the curves


def test_curves_figure_narrow_loss_stays_linear():
    rows = metrics()
    for row in rows:
        row["train_loss"] = 0.40 + 0.01 * row["round"]
    _, _, loss_ax, _ = data_axes(curves_figure(rows))
    assert loss_ax.get_yscale() == "linear" and loss_ax.get_ylabel() == "train loss"


# ------------------------------------------------------------------ partition heat map
def partition(sizes: list[list[int]]) -> tuple[Partition, np.ndarray]:
    """A hand-made partition: client k holds ``sizes[k][c]`` samples of class c."""
    labels, train, start = [], [], 0
    for row in sizes:
        idx = []
        for c, count in enumerate(row):
            labels += [c] * count
            idx += list(range(start, start + count))
            start += count
        train.append(np.asarray(idx, dtype=np.int64))
    return Partition(train=train, test=[np.zeros(0, dtype=np.int64)] * len(sizes)), np.asarray(labels)


def test_partition_figure_linear_heat_map_with_counts():
    part, y = partition([[5, 0, 3], [0, 8, 1]])
    fig = partition_figure(part, y, 3, class_names=["a", "b", "c"], title="mnist, dirichlet, 2 clients")
    (ax,) = data_axes(fig)
    assert np.asarray(ax.images[0].get_array()).tolist() == class_counts(part, y, 3).tolist() == [[5, 0, 3], [0, 8, 1]]
    assert ax.images[0].get_clim() == (0.0, 8.0)
    assert [t.get_text() for t in ax.texts] == ["5", "0", "3", "0", "8", "1"]
    assert ax.get_xlabel() == "class" and ax.get_ylabel() == "client"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c"]
    assert "per client and class" in flat(ax.get_title()) and "mnist, dirichlet, 2 clients" in flat(ax.get_title())
    (bar,) = colorbars(fig)
    assert bar.ax.get_ylabel() == "training samples"
    assert_titles_inside(fig)


def test_partition_figure_log_colours_under_quantity_skew():
    part, y = partition([[4000, 0], [3, 40], [0, 7]])
    fig = partition_figure(part, y, 2)
    (ax,) = data_axes(fig)
    image = ax.images[0]
    assert type(image.norm).__name__ == "LogNorm" and image.get_clim() == (1.0, 4000.0)
    # on a linear scale 40 of 4000 would be 1 % of the colour range; on the log scale it is 44 %
    assert image.norm(40) == pytest.approx(math.log(40) / math.log(4000))
    assert bool(np.ma.getmaskarray(image.get_array())[0, 1])  # an empty cell is masked (white), not "1 sample"
    (bar,) = colorbars(fig)
    assert "log scale" in bar.ax.get_ylabel()


# ------------------------------------------------------------------ hetfl analyze: logistic regression
def analysis_of(model, tmp_path, clients: int = 3):
    """A :class:`RunAnalysis` of ``model`` with perturbed local models, built without a run
    (its ``__init__`` rebuilds a whole experiment; these tests need only what ``cka`` and
    ``spectrum`` read)."""
    from types import SimpleNamespace

    from hetfl.algorithms.base import ModelCaller
    from hetfl.analysis.run import RunAnalysis

    run = object.__new__(RunAnalysis)
    cfg = SimpleNamespace(algorithm=SimpleNamespace(name="fedavg"), data=SimpleNamespace(dataset="synthetic"),
                          model=SimpleNamespace(name="mlp"))
    run.exp = SimpleNamespace(model=model, caller=ModelCaller(model), cfg=cfg)
    run.run_dir, run.out, run.round, run.local_round = tmp_path / "run-a", tmp_path, 5, 5
    base = dict(model.state_dict())
    run.local_models = {c: {n: t + 0.3 * torch.randn(t.shape, generator=rng(c)) for n, t in base.items()}
                        for c in range(clients)}
    run.server = SimpleNamespace(model=base)
    run.probe_x = torch.randn(64, 6, generator=rng(99))
    return run


def test_cka_of_logistic_regression_leaves_out_the_trivial_input_layer_and_says_why(tmp_path):
    from hetfl.models.mlp import MLP

    result = analysis_of(MLP((6,), 3, hidden=()), tmp_path).cka()
    assert list(result["mean_cka"]) == ["classifier"]  # no "encoder" (= the inputs) at CKA 1.0
    assert 0.0 < result["mean_cka"]["classifier"] < 1.0
    assert "no hidden layer" in result["note"] and "trivially 1" in result["note"]
    assert json.loads((tmp_path / "cka.json").read_text())["note"] == result["note"]


def test_cka_of_a_model_with_a_hidden_layer_keeps_it_without_a_note(tmp_path):
    from hetfl.models.mlp import MLP

    result = analysis_of(MLP((6,), 3, hidden=(8,)), tmp_path).cka()
    assert list(result["mean_cka"]) == ["encoder.1", "classifier"] and "note" not in result


def test_spectrum_of_logistic_regression_is_one_curve_of_the_inputs(tmp_path):
    from hetfl.models.mlp import MLP

    result = analysis_of(MLP((6,), 3, hidden=()), tmp_path).spectrum()
    header = (tmp_path / "spectrum.csv").read_text().splitlines()[0]
    assert header == "index,probe inputs" and "no hidden layer" in result["note"]
    hidden = analysis_of(MLP((6,), 3, hidden=(8,)), tmp_path).spectrum()
    assert (tmp_path / "spectrum.csv").read_text().splitlines()[0] == "index,global,client 0,client 1,client 2"
    assert "note" not in hidden


# ------------------------------------------------------------------ user strings drawn as written
#: a label (a swept ``data.root``, a run folder's name) that matplotlib would read as mathtext: two ``$`` make
#: "5 vs " math italics; ``$^$`` is no valid mathtext at all, and drawing it raises
DOLLARS = ["cost $5 vs $10", "a$^$b"]


def shown(text) -> tuple[str, bool]:
    """What matplotlib draws for a Text artist: the characters, and whether it typesets them as mathtext."""
    drawn, math_mode = text._preprocess_math(text.get_text())
    return drawn, bool(math_mode)


@pytest.mark.parametrize("label", DOLLARS)
def test_dollar_signs_in_labels_and_titles_are_drawn_as_written(label):
    """Issue: run labels and folder names are user strings; matplotlib typesets the text between two ``$`` as
    math, so the legend showed other characters than the table's row (or the figure could not be drawn, and
    ``hetfl report`` stopped with a mathtext ParseException). Every label and title shows its characters."""
    from hetfl.analysis.plots import png_bytes, seed_bands_figure

    rows = [{"round": r, "train_loss": 1.0 / r, "global_acc": 0.1 * r, "client_acc_mean": 0.1 * r}
            for r in (1, 2, 3)]
    for fig, legend in ((curves_figure({label: rows, "other": rows}, context=f"runs in {label}"), [label, "other"]),
                        (seed_bands_figure({label: {0: rows, 1: rows}}, context=f"runs in {label}"),
                         [f"{label} (2 seeds)"])):
        assert [shown(t) for t in fig.legends[0].get_texts()] == [(text, False) for text in legend]
        title, math_mode = shown(fig._suptitle)
        assert not math_mode and f"runs in {label}" in " ".join(title.split())
        assert png_bytes(fig, 40).startswith(b"\x89PNG")  # drawn without a mathtext error


def test_partition_class_names_and_title_with_dollar_signs_are_drawn_as_written():
    """An image folder's class names and the report's title line are user strings too (see above)."""
    from hetfl.analysis.plots import png_bytes

    part, y = partition([[5, 0], [0, 8]])
    fig = partition_figure(part, y, 2, class_names=DOLLARS, title="folder a$^$b")
    (ax,) = data_axes(fig)
    assert [shown(t) for t in ax.get_xticklabels()] == [(name, False) for name in DOLLARS]
    title, math_mode = shown(ax.title)
    assert not math_mode and "folder a$^$b" in flat(title)
    assert png_bytes(fig, 40).startswith(b"\x89PNG")
