"""Figures for the analyses in :mod:`hetfl.analysis`, each written with the numbers behind it.

Every analysis has two functions: ``<analysis>_figure(...)`` draws it and returns the
matplotlib ``Figure`` (for tests and notebooks), and ``plot_<analysis>(..., out_dir)`` draws
it, writes ``<out_dir>/<name>.png`` and a data file (``.csv`` for tables, ``.json`` for
nested results) and returns ``{"png": path, "data": path}``. Figures are drawn on
matplotlib's non-interactive Agg canvas, created per call (``matplotlib.figure.Figure`` +
``FigureCanvasAgg``), so no pyplot state and no global backend switch are involved: safe in
scripts, servers, tests and notebooks alike.

What every figure does so that a reader is not misled:

- its title says what is shown; ``context`` (e.g. ``"run-dir: fedavg on mnist (cnn2), round 3"``)
  adds which run and round, and the sliced Wasserstein map names its feature layer and round;
- axes are labelled, with units where there are any; accuracies span the whole ``[0, 1]``;
- legends stay inside the figure: in the axes for a few entries, beside the axes (the
  constrained layout makes room) for more, and a colour bar instead of a legend when there are
  too many groups for distinct colours (:data:`CATEGORICAL_MAX`);
- the singular-value spectrum's log axis stops at numerical precision (:func:`precision_floor`);
- curves over seeds (:func:`plot_seed_bands`) say which std their bands are, how many seeds each
  label has (no band for one), which rounds were left out and which labels' curves coincide;
- heat maps have a labelled colour bar.
"""

from __future__ import annotations

import csv
import io
import json
import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from hetfl.files import atomic_write_bytes, atomic_write_text

from .cka import mean_off_diagonal
from .classifier import pearson, spearman
from .curves import Metrics, SeedBand, default_accuracy_key, load_metrics, rounds_to_target, run_curves, seed_band
from .spectrum import effective_rank_of_spectrum

DPI = 120
FLOAT32_EPS = float(np.finfo(np.float32).eps)
LEGEND_INSIDE_MAX = 4  # legends with more entries go beside the axes, not over the data
CATEGORICAL_MAX = 20  # more groups than this (tab20's colours) are coloured on a continuous scale with a colour bar
LEGEND_ROWS_MAX = 20  # entries per legend column beside the axes


def _figure(nrows: int = 1, ncols: int = 1, *, size: tuple[float, float] = (4.5, 3.5)) -> tuple[Any, np.ndarray]:
    """A constrained-layout Figure on an Agg canvas and its axes grid ``[nrows, ncols]``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _grid(count: int, max_cols: int = 4) -> tuple[int, int]:
    cols = max(1, min(max_cols, count))
    return math.ceil(count / cols), cols


def literal(text: Any) -> str:
    """``text`` as matplotlib should draw it, character for character: every ``$`` escaped. Matplotlib typesets
    the text between two ``$`` as mathtext, and labels and titles hold user strings (a swept ``data.root``, a run
    folder's name): ``cost $5 vs $10`` would show ``5 vs `` in math italics, and ``a$^$b`` cannot be drawn at all
    (a ParseException). hetfl's own texts use no mathtext."""
    return str(text).replace("$", r"\$")


def _heading(what: str, context: str | None = None, note: str | None = None, *, width: float = 80) -> str:
    """A title: what is shown, then which run and round, then a caveat, each wrapped to ``width``
    characters so that no line runs off the figure (each drawn as written: :func:`literal`)."""
    return "\n".join(literal(textwrap.fill(part, max(20, int(width)))) for part in (what, context, note) if part)


def _suptitle(fig: Any, what: str, context: str | None = None, note: str | None = None, *,
              fontsize: float = 12.0) -> Any:
    """Set the figure's title (:func:`_heading`, wrapped to the figure's width) and make the figure
    taller by the height of its lines, so that a long title takes no room from the axes."""
    text = _heading(what, context, note, width=_chars(fig, fontsize))
    fig.set_figheight(fig.get_figheight() + text.count("\n") * fontsize * 1.25 / 72.0)
    return fig.suptitle(text, fontsize=fontsize)


def _chars(fig: Any, fontsize: float = 12.0, share: float = 1.0) -> float:
    """About how many characters of a ``fontsize``-point title fit in ``share`` of the figure's width
    (an average glyph is about 0.6 em wide)."""
    return fig.get_figwidth() * share * 72.0 / (0.6 * fontsize) * 0.95


def png_bytes(fig: Any, dpi: int) -> bytes:
    """``fig`` as PNG bytes (written by the caller in one atomic write: a reader never sees half a PNG)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def _save(fig: Any, out_dir: str | Path, name: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    atomic_write_bytes(path, png_bytes(fig, dpi=DPI))
    return path


def json_safe(obj: Any) -> Any:
    """JSON-safe copy: tensors and arrays to lists, non-finite floats to ``None``."""
    if isinstance(obj, Tensor):
        obj = obj.detach().cpu().tolist()
    if isinstance(obj, np.ndarray):
        obj = obj.tolist()
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _write_json(out_dir: str | Path, name: str, data: Any) -> Path:
    path = Path(out_dir) / f"{name}.json"
    atomic_write_text(path, json.dumps(json_safe(data), indent=1) + "\n")
    return path


def _write_csv(out_dir: str | Path, name: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> Path:
    path = Path(out_dir) / f"{name}.csv"
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    writer.writerow(header)
    writer.writerows(rows)
    atomic_write_text(path, text.getvalue())
    return path


def _numpy(x: Tensor | np.ndarray | Sequence[Any]) -> np.ndarray:
    if isinstance(x, Tensor):
        return x.detach().cpu().double().numpy() if x.is_floating_point() else x.detach().cpu().numpy()
    return np.asarray(x)


def _hide_unused(axes: np.ndarray, used: int) -> None:
    for ax in axes.flat[used:]:
        ax.set_visible(False)


def _colormap(name: str) -> Any:
    import matplotlib

    return matplotlib.colormaps[name]


def _colours(count: int) -> list[Any]:
    """``count`` distinct colours: tab10, tab20, then evenly spaced on viridis (never a repeat)."""
    if count <= 10:
        return [_colormap("tab10")(i) for i in range(count)]
    if count <= CATEGORICAL_MAX:
        return [_colormap("tab20")(i) for i in range(count)]
    return [_colormap("viridis")(x) for x in np.linspace(0.0, 1.0, count)]


def _integer_ticks(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _legend(ax: Any, handles: Sequence[Any] | None = None, labels: Sequence[str] | None = None, *,
            title: str | None = None, markerscale: float = 1.0) -> Any:
    """The axes' legend: inside (``loc="best"``) with at most :data:`LEGEND_INSIDE_MAX` entries, else
    beside the axes on the right, in columns of at most :data:`LEGEND_ROWS_MAX` (the constrained layout
    shrinks the axes to keep it inside the figure). ``None`` when there is nothing to label."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return None
    labels = [literal(text) for text in (labels if labels is not None else [h.get_label() for h in handles])]
    if len(handles) <= LEGEND_INSIDE_MAX:
        return ax.legend(handles, labels, loc="best", fontsize="x-small", title=title, markerscale=markerscale)
    return ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
                     fontsize="x-small", title=title, title_fontsize="small", markerscale=markerscale,
                     ncols=math.ceil(len(handles) / LEGEND_ROWS_MAX))


# ---------------------------------------------------------------- CKA
def cka_figure(
    cka: Mapping[str, Tensor], *, model_labels: Sequence[str] | None = None, context: str | None = None,
    note: str | None = None,
) -> Any:
    """The figure of :func:`plot_cka`: a bar per layer (mean CKA over pairs of models, on ``[0, 1]``)
    and a heat map per layer with one shared colour bar. ``note`` (e.g. why a layer is left out)
    is printed under the title."""
    layers = list(cka)
    if not layers:
        raise ValueError("no layers to plot")
    means = {layer: mean_off_diagonal(cka[layer]) for layer in layers}
    nrows, ncols = _grid(len(layers) + 1)
    fig, axes = _figure(nrows, ncols, size=(4.0, 3.6))
    _suptitle(fig, "Linear CKA of the same layer between clients' local models (CCVR Figs. 1-2)", context, note)
    ax = axes.flat[0]
    heights = [means[layer] if math.isfinite(means[layer]) else 0.0 for layer in layers]
    ax.bar(range(len(layers)), heights, color="tab:blue")
    for i, layer in enumerate(layers):
        if not math.isfinite(means[layer]):
            ax.text(i, 0.02, "n/a", ha="center", va="bottom", fontsize="small")
    ax.set_xticks(range(len(layers)), layers, rotation=45, ha="right")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("layer (input to output)")
    ax.set_ylabel("mean CKA over pairs of models")
    ax.set_title("mean per layer")
    image = None
    for i, layer in enumerate(layers, start=1):
        ax = axes.flat[i]
        mat = _numpy(cka[layer])
        image = ax.imshow(mat, vmin=0.0, vmax=1.0, cmap="viridis")
        m = mat.shape[0]
        ticks = list(model_labels) if model_labels is not None else [str(k) for k in range(m)]
        if m <= 16:
            ax.set_xticks(range(m), ticks, rotation=90)
            ax.set_yticks(range(m), ticks)
            ax.set_xlabel("model")
            ax.set_ylabel("model")
        else:
            ax.set_xlabel("model (position in the list)")
            ax.set_ylabel("model (position in the list)")
        mean = f"{means[layer]:.2f}" if math.isfinite(means[layer]) else "n/a"
        ax.set_title(f"{layer} (mean {mean})")
    _hide_unused(axes, len(layers) + 1)
    if image is not None:
        fig.colorbar(image, ax=list(axes.flat[1 : len(layers) + 1]), label="linear CKA", shrink=0.8)
    return fig


def plot_cka(
    cka: Mapping[str, Tensor], out_dir: str | Path, *, name: str = "cka", model_labels: Sequence[str] | None = None,
    context: str | None = None, note: str | None = None,
) -> dict[str, Path]:
    """Pairwise CKA per layer (CCVR Figures 1-2): a bar chart of each layer's mean
    off-diagonal CKA (similarity of the same layer across different clients' models) and one
    heat map per layer. ``cka`` is the output of :func:`~hetfl.analysis.cka.pairwise_cka`
    (layers in forward order). Data: JSON with the matrices, the means and ``note``."""
    fig = cka_figure(cka, model_labels=model_labels, context=context, note=note)
    png = _save(fig, out_dir, name)
    layers = list(cka)
    payload = {"layers": layers, "mean_off_diagonal": {layer: mean_off_diagonal(cka[layer]) for layer in layers},
               "matrices": {layer: cka[layer] for layer in layers}}
    if note:
        payload["note"] = note
    return {"png": png, "data": _write_json(out_dir, name, payload)}


# ---------------------------------------------------------------- classifier norms
def weight_norms_figure(
    norms: Tensor | np.ndarray, counts: Tensor | np.ndarray, *, client_labels: Sequence[str] | None = None,
    context: str | None = None,
) -> Any:
    """The figure of :func:`plot_weight_norms`: a panel per client, bars (left axis, from 0) for its
    class counts and a line (right axis, from 0, so a small spread of norms is not blown up) for the
    classifier's row norms; one legend for all panels, under them."""
    n, c = np.atleast_2d(_numpy(norms)).astype(np.float64), np.atleast_2d(_numpy(counts)).astype(np.float64)
    if n.shape != c.shape:
        raise ValueError(f"norms {n.shape} and counts {c.shape} differ in shape")
    m, num_classes = n.shape
    labels = list(client_labels) if client_labels is not None else [f"client {k}" for k in range(m)]
    nrows, ncols = _grid(m, 3)
    fig, axes = _figure(nrows, ncols, size=(4.5, 3.2))
    _suptitle(fig, "Classifier row norm vs class count (CCVR Fig. 3); r: Pearson, ρ: Spearman", context)
    classes = np.arange(num_classes)
    handles: list[Any] = []
    for k in range(m):
        ax = axes.flat[k]
        bars = ax.bar(classes, c[k], color="tab:gray", alpha=0.6, label="training samples of the class (left axis)")
        ax.set_xlabel("class")
        ax.set_ylabel("training samples")
        ax.set_ylim(bottom=0)
        if num_classes <= 20:
            ax.set_xticks(classes)
        twin = ax.twinx()
        (line,) = twin.plot(classes, n[k], "o-", color="tab:red", markersize=3,
                            label="classifier row norm ‖w_c‖₂ (right axis)")
        twin.set_ylabel("‖w_c‖₂", color="tab:red")
        twin.set_ylim(0, max(float(np.nanmax(n[k], initial=0.0)) * 1.08, 1e-12))
        ax.set_title(f"{labels[k]}: r={pearson(n[k], c[k]):.2f}, ρ={spearman(n[k], c[k]):.2f}", fontsize="medium")
        handles = [bars, line]
    _hide_unused(axes, m)
    # side by side under two panels or more; stacked under one, whose width holds one entry (the global model's
    # figure, all a run without saved client models has)
    fig.legend(handles, [h.get_label() for h in handles], loc="outside lower center", ncols=min(2, ncols),
               fontsize="small")
    return fig


def plot_weight_norms(
    norms: Tensor | np.ndarray,
    counts: Tensor | np.ndarray,
    out_dir: str | Path,
    *,
    name: str = "weight_norms",
    client_labels: Sequence[str] | None = None,
    context: str | None = None,
) -> dict[str, Path]:
    """Per-class classifier weight norms against class counts (CCVR Figure 3), one panel per
    client: bars are the client's sample counts, the line its classifier's row norms; the panel
    title gives their Pearson and Spearman correlation. ``norms`` and ``counts`` are ``[C]``
    (one client) or ``[m, C]``. Data: CSV ``client, class, count, norm``."""
    fig = weight_norms_figure(norms, counts, client_labels=client_labels, context=context)
    png = _save(fig, out_dir, name)
    n, c = np.atleast_2d(_numpy(norms)).astype(np.float64), np.atleast_2d(_numpy(counts)).astype(np.float64)
    labels = list(client_labels) if client_labels is not None else [f"client {k}" for k in range(n.shape[0])]
    rows = [[labels[k], j, c[k, j], n[k, j]] for k in range(n.shape[0]) for j in range(n.shape[1])]
    return {"png": png, "data": _write_csv(out_dir, name, ["client", "class", "count", "norm"], rows)}


# ---------------------------------------------------------------- spectrum
def precision_floor(values: np.ndarray, eps: float = FLOAT32_EPS) -> float:
    """Smallest singular value of a feature covariance that is above rounding noise:
    ``s_max * eps * d`` for ``d`` values. Features come out of float32 forward passes, whose
    relative rounding error ``eps`` perturbs every singular value by about ``s_max * eps`` per
    dimension accumulated; what lies below (1e-20 and the like) is noise, not collapse."""
    s = np.asarray(values, dtype=np.float64).ravel()
    top = float(np.nanmax(s, initial=0.0))
    return top * eps * max(s.size, 1)


def spectrum_figure(
    spectra: Mapping[str, Tensor | np.ndarray], *, normalize: bool = True, context: str | None = None,
    note: str | None = None,
) -> Any:
    """The figure of :func:`plot_spectrum`: one curve per spectrum on a log10 axis whose lower end is
    the numerical-precision floor (:func:`precision_floor`); values below it are not drawn, and the
    title says so. A legend of more than :data:`LEGEND_INSIDE_MAX` curves sits beside the axes."""
    if not spectra:
        raise ValueError("no spectra to plot")
    fig, axes = _figure(1, 1, size=(6.5, 4.2))
    ax = axes[0, 0]
    colours = _colours(len(spectra))
    floors, tops = [], []
    for colour, (label, values) in zip(colours, spectra.items(), strict=True):
        s = _numpy(values).astype(np.float64).ravel()
        scale = float(s.max(initial=0.0)) if normalize else 1.0
        y = s / scale if scale > 0 else s.copy()
        floor = precision_floor(y)
        y[~(y > floor)] = np.nan  # rounding noise (and zeros) have no place on the log axis
        floors.append(floor)
        tops.append(float(np.nanmax(y, initial=0.0)) if np.isfinite(y).any() else 0.0)
        erank = effective_rank_of_spectrum(torch.from_numpy(s))
        ax.plot(np.arange(1, s.size + 1), y, color=colour, label=f"{label} (erank {erank:.1f})")
    ax.set_yscale("log")
    positive = [f for f in floors if f > 0]
    bottom = min(positive) if positive else 1e-12
    ax.set_ylim(bottom, max(max(tops, default=1.0), bottom * 10) * 1.5)
    ax.set_xlim(0, max(_numpy(v).size for v in spectra.values()) + 1)  # every index, drawn or under the floor
    ax.set_xlabel("index i (singular values in descending order)")
    ax.set_ylabel("σ_i / σ_1 (log scale)" if normalize else "σ_i (log scale)")
    _integer_ticks(ax)
    cut = f"{bottom:.1e}" if normalize else f"{bottom:.1e} (smallest of the curves)"
    floor_note = f"Not drawn: values below σ_1·eps(float32)·d = {cut}, rounding noise"
    _suptitle(fig, "Singular values of the feature covariance", context,
              floor_note if not note else f"{note}. {floor_note}", fontsize=10.0)
    _legend(ax, title="features (effective rank)")
    return fig


def plot_spectrum(
    spectra: Mapping[str, Tensor | np.ndarray], out_dir: str | Path, *, name: str = "spectrum", normalize: bool = True,
    context: str | None = None, note: str | None = None,
) -> dict[str, Path]:
    """Singular values of feature covariances (dimensional collapse, Shi et al. ICLR 2023 Fig. 2;
    FedUV): one curve per entry of ``spectra`` (label -> descending singular values, as from
    :func:`~hetfl.analysis.spectrum.singular_values`), on a log10 axis floored at numerical
    precision, divided by the largest if ``normalize``; the legend gives each effective rank.
    Data: CSV with one column per label (every value, including those below the floor)."""
    fig = spectrum_figure(spectra, normalize=normalize, context=context, note=note)
    png = _save(fig, out_dir, name)
    columns = {label: _numpy(values).astype(np.float64).ravel() for label, values in spectra.items()}
    length = max(v.size for v in columns.values())
    rows = [[i + 1] + [v[i] if i < v.size else "" for v in columns.values()] for i in range(length)]
    return {"png": png, "data": _write_csv(out_dir, name, ["index", *columns], rows)}


# ---------------------------------------------------------------- sliced Wasserstein
def swd_figure(
    matrix: Tensor | np.ndarray,
    *,
    labels: Sequence[str] | None = None,
    title: str = "Sliced Wasserstein distance",
    axis_label: str = "client",
    layer: str | None = None,
    round: int | None = None,
    context: str | None = None,
    value_label: str = "sliced W2 distance (feature units)",
) -> Any:
    """The figure of :func:`plot_swd_matrix`: a heat map with a colour bar starting at 0; the title
    names the feature ``layer`` and the ``round`` whose model produced the features."""
    mat = _numpy(matrix).astype(np.float64)
    if mat.ndim != 2 or mat.shape[0] != mat.shape[1]:
        raise ValueError(f"expected a square matrix, got shape {mat.shape}")
    m = mat.shape[0]
    names = [literal(name) for name in labels] if labels is not None else [str(k) for k in range(m)]
    side = min(10.0, 3.5 + 0.45 * m)
    fig, axes = _figure(1, 1, size=(side + 1.0, side + 0.6))
    ax = axes[0, 0]
    top = float(np.nanmax(mat)) if np.isfinite(mat).any() else 1.0
    image = ax.imshow(mat, cmap="magma_r", vmin=0.0, vmax=top if top > 0 else 1.0)
    if m <= 30:
        ax.set_xticks(range(m), names, rotation=90)
        ax.set_yticks(range(m), names)
    if m <= 12:
        for i in range(m):
            for j in range(m):
                colour = "white" if mat[i, j] > 0.6 * top else "black"
                ax.text(j, i, f"{mat[i, j]:.2g}", ha="center", va="center", fontsize="x-small", color=colour)
    ax.set_xlabel(axis_label)
    ax.set_ylabel(axis_label)
    where = ", ".join(part for part in (layer, None if round is None else f"round {round}") if part)
    _suptitle(fig, title, where, context, fontsize=10.0)
    fig.colorbar(image, ax=ax, label=value_label)
    return fig


def plot_swd_matrix(
    matrix: Tensor | np.ndarray,
    out_dir: str | Path,
    *,
    name: str = "swd",
    labels: Sequence[str] | None = None,
    title: str = "Sliced Wasserstein distance",
    axis_label: str = "client",
    layer: str | None = None,
    round: int | None = None,
    context: str | None = None,
    value_label: str = "sliced W2 distance (feature units)",
) -> dict[str, Path]:
    """Heat map of a pairwise distance matrix ``[m, m]`` (e.g. from
    :func:`~hetfl.analysis.swd.sliced_wasserstein_matrix` over clients' feature mixtures),
    with the values written in the cells when ``m <= 12``; ``layer`` and ``round`` say which
    features were compared. Data: CSV matrix with labels."""
    fig = swd_figure(matrix, labels=labels, title=title, axis_label=axis_label, layer=layer, round=round,
                     context=context, value_label=value_label)
    png = _save(fig, out_dir, name)
    mat = _numpy(matrix).astype(np.float64)
    names = list(labels) if labels is not None else [str(k) for k in range(mat.shape[0])]
    rows = [[names[i], *mat[i].tolist()] for i in range(mat.shape[0])]
    return {"png": png, "data": _write_csv(out_dir, name, ["", *names], rows)}


# ---------------------------------------------------------------- t-SNE
def _scatter_by(fig: Any, ax: Any, xy: np.ndarray, groups: np.ndarray, what: str) -> None:
    """Points coloured by group: distinct colours and a legend beside the axes for up to
    :data:`CATEGORICAL_MAX` groups, else a continuous colour map with a colour bar (repeated
    categorical colours would merge different groups)."""
    values = np.unique(groups)
    if values.size <= CATEGORICAL_MAX:
        for colour, v in zip(_colours(values.size), values, strict=True):
            sel = groups == v
            ax.scatter(xy[sel, 0], xy[sel, 1], s=6, color=colour, label=str(v), alpha=0.8, linewidths=0)
        _legend(ax, title=what, markerscale=2)
    else:
        index = np.searchsorted(values, groups)
        points = ax.scatter(xy[:, 0], xy[:, 1], s=6, c=index, cmap="viridis", alpha=0.8, linewidths=0,
                            vmin=0, vmax=values.size - 1)
        bar = fig.colorbar(points, ax=ax, label=what)
        if np.issubdtype(values.dtype, np.number):
            ticks = np.linspace(0, values.size - 1, min(values.size, 6)).round().astype(int)
            bar.set_ticks(ticks, labels=[str(values[t]) for t in ticks])
    ax.set_xlabel("t-SNE 1 (arbitrary units)")
    ax.set_ylabel("t-SNE 2 (arbitrary units)")
    ax.set_title(f"coloured by {what}")


def tsne_figure(
    embedding: Tensor | np.ndarray,
    labels: Tensor | np.ndarray | Sequence[int],
    *,
    clients: Tensor | np.ndarray | Sequence[int] | None = None,
    context: str | None = None,
    what: str = "features",
) -> Any:
    """The figure of :func:`plot_tsne`: a panel coloured by class and, with ``clients``, one by client."""
    xy = _numpy(embedding).astype(np.float64)
    y = _numpy(labels).ravel()
    if xy.ndim != 2 or xy.shape[1] != 2 or y.shape[0] != xy.shape[0]:
        raise ValueError(f"expected an embedding [n, 2] and labels [n]; got {xy.shape}, {y.shape}")
    k = None if clients is None else _numpy(clients).ravel()
    if k is not None and k.shape[0] != xy.shape[0]:
        raise ValueError(f"{k.shape[0]} client ids for {xy.shape[0]} points")
    fig, axes = _figure(1, 1 if k is None else 2, size=(5.5, 4.5))
    _scatter_by(fig, axes[0, 0], xy, y, "class")
    if k is not None:
        _scatter_by(fig, axes[0, 1], xy, k, "client")
    _suptitle(fig, f"t-SNE of {what} ({xy.shape[0]} points)", context)
    return fig


def plot_tsne(
    embedding: Tensor | np.ndarray,
    labels: Tensor | np.ndarray | Sequence[int],
    out_dir: str | Path,
    *,
    clients: Tensor | np.ndarray | Sequence[int] | None = None,
    name: str = "tsne",
    context: str | None = None,
    what: str = "features",
) -> dict[str, Path]:
    """2-D embedding (from :func:`~hetfl.analysis.tsne.tsne_embedding`) as a scatter coloured by
    class and, when ``clients`` is given, a second panel coloured by client (do a client's
    features form their own island, or mix with others' of the same class?).
    Data: CSV ``x, y, label[, client]``."""
    fig = tsne_figure(embedding, labels, clients=clients, context=context, what=what)
    png = _save(fig, out_dir, name)
    xy, y = _numpy(embedding).astype(np.float64), _numpy(labels).ravel()
    k = None if clients is None else _numpy(clients).ravel()
    header = ["x", "y", "label"] + ([] if k is None else ["client"])
    rows = [[xy[i, 0], xy[i, 1], y[i].item()] + ([] if k is None else [k[i].item()]) for i in range(xy.shape[0])]
    return {"png": png, "data": _write_csv(out_dir, name, header, rows)}


# ---------------------------------------------------------------- curves
def _load_curves(
    runs: Mapping[str, Metrics | str | Path] | Metrics | str | Path, target: float | None
) -> dict[str, dict[str, Any]]:
    """:func:`~hetfl.analysis.curves.run_curves` per run label, with ``rounds_to_target`` when ``target``."""
    if isinstance(runs, str | Path) or not isinstance(runs, Mapping):
        runs = {"run": runs}
    loaded = {label: load_metrics(m) if isinstance(m, str | Path) else list(m) for label, m in runs.items()}
    curves = {label: run_curves(metrics) for label, metrics in loaded.items()}
    if target is not None:
        for label, cur in curves.items():
            cur["rounds_to_target"] = {"target": target, "round": rounds_to_target(loaded[label], target)}
    return curves


def _style_key(ax: Any, entries: Sequence[tuple[str, dict[str, Any]]], patch: str | None = None) -> None:
    """A legend of line styles (black lines; a grey patch for a band), not of runs."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Any] = [Line2D([], [], **{"color": "black", **style}) for _, style in entries]
    labels = [text for text, _ in entries]
    if patch is not None:
        handles.append(Patch(color="gray", alpha=0.3))
        labels.append(patch)
    if handles:
        ax.legend(handles, labels, loc="best", fontsize="x-small")


def _accuracy_axis(ax: Any, values: Sequence[float | None]) -> None:
    """Accuracies on the whole ``[0, 1]`` (a truncated axis would magnify small differences), with a
    2 % margin so that a curve at 0 or 1 is not hidden by the frame."""
    top = max(1.0, max((v for v in values if v is not None), default=1.0))
    ax.set_ylim(-0.02 * top, 1.02 * top)


def _draw_accuracy(ax: Any, acc: dict[str, list], colour: Any) -> set[str]:
    drawn = set()
    for key, style in (("global_acc", "-"), ("client_acc_mean", "--")):
        pairs = [(r, v) for r, v in zip(acc["round"], acc[key], strict=True) if v is not None]
        if pairs:
            ax.plot(*zip(*pairs, strict=True), style, color=colour)
            drawn.add(key)
    return drawn


def curves_figure(
    runs: Mapping[str, Metrics | str | Path] | Metrics | str | Path,
    *,
    target: float | None = None,
    context: str | None = None,
) -> Any:
    """The figure of :func:`plot_curves` (``runs`` as there)."""
    return _curves_figure(_load_curves(runs, target), target, context)


def _curves_figure(curves: Mapping[str, dict[str, Any]], target: float | None, context: str | None) -> Any:
    """Four panels; one colour per run, named in a legend under the panels (when there are several
    runs); each panel's own legend explains its line styles."""
    rows = math.ceil(len(curves) / 3) if len(curves) > 1 else 0
    fig, axes = _figure(2, 2, size=(5.5, 3.8 + 0.12 * rows))
    acc_ax, spread_ax, loss_ax, bytes_ax = axes.flat
    colours = _colours(len(curves))
    drawn: set[str] = set()
    accuracies: list[float | None] = []
    for colour, cur in zip(colours, curves.values(), strict=True):
        drawn |= _draw_accuracy(acc_ax, cur["accuracy"], colour)
        accuracies += cur["accuracy"]["global_acc"] + cur["accuracy"]["client_acc_mean"]
        spread = cur["spread"]
        if spread["round"]:
            spread_ax.plot(spread["round"], spread["median"], color=colour)
            spread_ax.fill_between(spread["round"], spread["q25"], spread["q75"], color=colour, alpha=0.25)
            spread_ax.plot(spread["round"], spread["min"], ":", color=colour, linewidth=1)
            spread_ax.plot(spread["round"], spread["max"], ":", color=colour, linewidth=1)
            accuracies += spread["max"]
        loss = cur["train_loss"]
        loss_ax.plot(loss["round"], loss["train_loss"], color=colour)
        traffic = cur["bytes"]
        bytes_ax.plot(traffic["round"], np.asarray(traffic["bytes_total"], dtype=np.float64) / 1e6, color=colour)
    keys = [(text, {"linestyle": style}) for key, text, style in
            (("global_acc", "global model, pooled test set", "-"),
             ("client_acc_mean", "mean over clients, own test splits", "--")) if key in drawn]
    if target is not None:
        acc_ax.axhline(target, color="gray", linestyle=":")
        keys.append((f"target {target:g}", {"linestyle": ":", "color": "gray"}))
    _style_key(acc_ax, keys)
    if any(cur["spread"]["round"] for cur in curves.values()):
        _style_key(spread_ax, [("median", {"linestyle": "-"}), ("min / max", {"linestyle": ":"})],
                   patch="interquartile range")
    acc_ax.set(xlabel="round", ylabel="test accuracy", title="Accuracy")
    spread_ax.set(xlabel="round", ylabel="client test accuracy (own split)", title="Per-client accuracy spread")
    _accuracy_axis(acc_ax, accuracies)
    _accuracy_axis(spread_ax, accuracies)
    losses = [v for cur in curves.values() for v in cur["train_loss"]["train_loss"]]
    log_loss = bool(losses) and min(losses) > 0 and max(losses) / min(losses) > 10
    if log_loss:
        loss_ax.set_yscale("log")
    loss_ax.set(xlabel="round", ylabel="train loss" + (" (log scale)" if log_loss else ""), title="Train loss")
    bytes_ax.set(xlabel="round", ylabel="MB (10⁶ bytes, up + down)", title="Cumulative traffic")
    bytes_ax.set_ylim(bottom=0)
    for ax in axes.flat:
        _integer_ticks(ax)
    if len(curves) > 1:
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], color=c) for c in colours]
        fig.legend(handles, [literal(label) for label in curves], loc="outside lower center",
                   ncols=min(3, len(curves)), fontsize="x-small")
    single = next(iter(curves)) if len(curves) == 1 and next(iter(curves)) != "run" else None
    _suptitle(fig, "Learning curves", context or single)
    return fig


def plot_curves(
    runs: Mapping[str, Metrics | str | Path] | Metrics | str | Path,
    out_dir: str | Path,
    *,
    name: str = "curves",
    target: float | None = None,
    context: str | None = None,
) -> dict[str, Path]:
    """Learning curves of one run or several (label -> metrics list, run directory or
    ``metrics.jsonl``): accuracy (global solid, client mean dashed), per-client accuracy
    spread (median, interquartile band, min and max dotted), train loss (log axis when it spans
    more than a decade), cumulative traffic in MB. Accuracy axes span ``[0, 1]``. With
    ``target`` the accuracy panel marks it and the data records the rounds to reach it.
    Data: JSON of :func:`~hetfl.analysis.curves.run_curves` per run."""
    curves = _load_curves(runs, target)
    png = _save(_curves_figure(curves, target, context), out_dir, name)
    return {"png": png, "data": _write_json(out_dir, name, curves)}


# ---------------------------------------------------------------- curves over seeds
#: label -> that setting's runs: seed -> metrics list, run directory or ``metrics.jsonl`` (a list: seeds 0, 1, ...)
SeedGroups = Mapping[str, Mapping[Any, Metrics | str | Path] | Sequence[Metrics | str | Path]]
ACCURACY_TEXT = {"global_acc": "global model, pooled test set", "client_acc_mean": "mean over clients, own test splits"}
STD_TEXT = {0: "population std (÷n)", 1: "sample std (÷(n−1))"}
LEGEND_FONT_PT = 7.0  # "x-small" at matplotlib's default 10 pt
COINCIDE_TOL = 1e-3  # mean accuracies closer than this at every round are drawn on top of each other: said in the title


def _seed_runs(groups: SeedGroups) -> dict[str, dict[Any, list[dict[str, Any]]]]:
    """``groups`` with every run loaded: label -> seed -> metrics list."""
    if not groups:
        raise ValueError("no runs to plot")
    loaded = {}
    for label, runs in groups.items():
        items = runs.items() if isinstance(runs, Mapping) else enumerate(runs)
        loaded[label] = {seed: load_metrics(m) if isinstance(m, str | Path) else list(m) for seed, m in items}
        if not loaded[label]:
            raise ValueError(f"{label}: no runs to plot")
    return loaded


def _accuracy_key(label: str, runs: Mapping[Any, Metrics], metric: str | Mapping[str, str] | None) -> str:
    """The accuracy a label's band shows: ``metric`` (one key, or one per label), else
    :func:`~hetfl.analysis.curves.default_accuracy_key` over all its seeds."""
    if isinstance(metric, str):
        return metric
    if isinstance(metric, Mapping) and label in metric:
        return metric[label]
    return default_accuracy_key([m for metrics in runs.values() for m in metrics])


def seed_bands(groups: SeedGroups, *, metric: str | Mapping[str, str] | None = None,
               ddof: int = 1) -> dict[str, dict[str, SeedBand | None]]:
    """Per label, ``{"accuracy": SeedBand, "train_loss": SeedBand | None}`` over its seeds
    (:func:`~hetfl.analysis.curves.seed_band`; ``train_loss`` is None when no seed logged it)."""
    out: dict[str, dict[str, SeedBand | None]] = {}
    for label, runs in _seed_runs(groups).items():
        logged_loss = any("train_loss" in m for metrics in runs.values() for m in metrics)
        out[label] = {"accuracy": seed_band(runs, _accuracy_key(label, runs, metric), ddof=ddof, label=label),
                      "train_loss": seed_band(runs, "train_loss", ddof=ddof, label=label) if logged_loss else None}
    return out


def _band_x(band: SeedBand) -> np.ndarray:
    """The band's x: its rounds; a single round is widened to ±0.25 so that its band is visible."""
    if len(band.rounds) == 1:
        return np.array([band.rounds[0] - 0.25, band.rounds[0] + 0.25])
    return np.asarray(band.rounds, dtype=np.float64)


def _draw_band(ax: Any, band: SeedBand, colour: Any, style: str, per_seed: bool) -> Any:
    """The mean as a line, ± std as a shaded band (only with 2+ seeds) and, with ``per_seed``, each
    seed as a thin line of the same colour; returns the legend handle (line over band patch)."""
    from matplotlib.patches import Patch

    marker = "o" if len(band.rounds) <= 12 else None
    (line,) = ax.plot(band.rounds, band.mean, style, color=colour, linewidth=1.8, marker=marker, markersize=3)
    if per_seed:
        for row in band.values:
            ax.plot(band.rounds, row, style, color=colour, linewidth=0.7, alpha=0.55)
    if band.n < 2:
        return line
    x = _band_x(band)
    lower, upper = band.mean - band.std, band.mean + band.std
    if len(band.rounds) == 1:
        lower, upper = np.repeat(lower, 2), np.repeat(upper, 2)
    ax.fill_between(x, lower, upper, color=colour, alpha=0.22, linewidth=0)
    return (Patch(color=colour, alpha=0.22), line)


def _legend_text(label: str, band: SeedBand) -> str:
    return f"{label} ({band.n} seeds)" if band.n > 1 else f"{label} (1 seed, no band)"


def _legend_layout(texts: Sequence[str], fig_width: float) -> tuple[int, list[str], int]:
    """Columns (at most 3, as many as the longest entry allows in ``fig_width`` inches), the entries
    wrapped to a column's width (so that none runs off the figure) and the legend's number of text lines."""
    width = fig_width * 72.0 / (0.6 * LEGEND_FONT_PT) * 0.95 - 6  # the key's line and padding: ~6 characters
    longest = max(len(t) for t in texts)
    ncols = max(1, min(3, len(texts), int(width // (longest + 6))))
    wrapped = [textwrap.fill(t, max(20, int(width / ncols) - 6)) for t in texts]
    lines = sum(max(t.count("\n") + 1 for t in wrapped[i:i + ncols]) for i in range(0, len(wrapped), ncols))
    return ncols, wrapped, lines


def _seed_note(bands: Mapping[str, Mapping[str, SeedBand | None]], ddof: int, per_seed: bool) -> str:
    """What the lines and bands are, and what was left out."""
    parts = [f"line: mean over seeds; band: ± 1 {STD_TEXT[ddof]}" + ("; thin lines: each seed" if per_seed else "")]
    single = [label for label, b in bands.items() if b["accuracy"] is not None and b["accuracy"].n < 2]
    if single and len(single) == len(bands):  # every label: the legend says it for each, the title once
        parts[0] = "line: one seed (no bands)" + ("; thin lines: each seed" if per_seed else "")
    elif single:
        parts.append(f"one seed, no band: {', '.join(single)}")
    for label, b in bands.items():
        for band in b.values():
            if band is not None and band.dropped:
                parts.append(f"{label}: {len(band.dropped)} round(s) of {band.key} not logged by every seed "
                             "left out")
    parts += [f"accuracy curves coincide (one hides the other): {' = '.join(group)}" for group in _coinciding(bands)]
    return "; ".join(parts)


def _coinciding(bands: Mapping[str, Mapping[str, SeedBand | None]], tol: float = COINCIDE_TOL) -> list[list[str]]:
    """Groups of labels whose mean accuracy curves are the same within ``tol`` at every round (drawn on top
    of each other, only the last drawn would be seen; the title names them instead)."""
    groups: list[list[str]] = []
    for label, b in bands.items():
        acc = b["accuracy"]
        for group in groups:
            other = bands[group[0]]["accuracy"]
            if (acc is not None and other is not None and acc.key == other.key and acc.rounds == other.rounds
                    and np.allclose(acc.mean, other.mean, rtol=0.0, atol=tol, equal_nan=True)):
                group.append(label)
                break
        else:
            groups.append([label])
    return [group for group in groups if len(group) > 1]


def _accuracy_panel(ax: Any, bands: Mapping[str, Mapping[str, SeedBand | None]], target: float | None) -> None:
    """Labels, title and [0, 1] range of the accuracy panel; a style key when labels show different accuracies."""
    keys = sorted({b["accuracy"].key for b in bands.values() if b["accuracy"] is not None}, key=_key_order)
    if len(keys) == 1:
        ax.set_ylabel(f"test accuracy ({ACCURACY_TEXT.get(keys[0], keys[0])})", fontsize="small")
    else:
        ax.set_ylabel("test accuracy")
    entries = [(ACCURACY_TEXT.get(k, k), {"linestyle": _accuracy_style(k, keys)}) for k in keys if len(keys) > 1]
    if target is not None:
        ax.axhline(target, color="gray", linestyle=":")
        entries.append((f"target {target:g}", {"linestyle": ":", "color": "gray"}))
    _style_key(ax, entries)
    ax.set(xlabel="round", title="Accuracy")
    _accuracy_axis(ax, [v for b in bands.values() for v in np.nan_to_num(b["accuracy"].mean + b["accuracy"].std)])


def _key_order(key: str) -> tuple[int, str]:
    """Global accuracy first, then the client mean, then any other key by name."""
    return ({"global_acc": 0, "client_acc_mean": 1}.get(key, 2), key)


def _accuracy_style(key: str, keys: Sequence[str]) -> str:
    """Solid for the global model, dashed for the client mean (as :func:`curves_figure`), when both are shown."""
    return "--" if len(keys) > 1 and key == "client_acc_mean" else "-"


def _loss_panel(ax: Any, bands: Mapping[str, Mapping[str, SeedBand | None]]) -> None:
    """Labels and scale of the train-loss panel: log when the means span more than a decade."""
    means = [v for b in bands.values() if b["train_loss"] is not None for v in b["train_loss"].mean.tolist()]
    finite = [v for v in means if math.isfinite(v)]
    if not means:
        ax.text(0.5, 0.5, "no train loss logged", ha="center", va="center", transform=ax.transAxes)
        ax.set(xticks=[], yticks=[])
    log_loss = bool(finite) and min(finite) > 0 and max(finite) / min(finite) > 10
    if log_loss:
        ax.set_yscale("log")
    ax.set(xlabel="round", ylabel="train loss" + (" (log scale)" if log_loss else ""), title="Train loss")


def seed_bands_figure(
    groups: SeedGroups,
    *,
    metric: str | Mapping[str, str] | None = None,
    per_seed: bool = False,
    ddof: int = 1,
    target: float | None = None,
    context: str | None = None,
) -> Any:
    """The figure of :func:`plot_seed_bands` (arguments as there)."""
    return _seed_bands_figure(seed_bands(groups, metric=metric, ddof=ddof), per_seed, ddof, target, context)


def _seed_bands_figure(bands: Mapping[str, Mapping[str, SeedBand | None]], per_seed: bool, ddof: int,
                       target: float | None, context: str | None) -> Any:
    """Two panels (accuracy, train loss); one colour per label, named once in a legend under the panels."""
    texts = [_legend_text(label, b["accuracy"]) for label, b in bands.items()]  # type: ignore[arg-type]
    ncols, wrapped, lines = _legend_layout(texts, 2 * 5.2)
    fig, axes = _figure(1, 2, size=(5.2, 3.9 + lines * LEGEND_FONT_PT * 1.6 / 72.0))  # room for the legend
    acc_ax, loss_ax = axes.flat
    keys = sorted({b["accuracy"].key for b in bands.values() if b["accuracy"] is not None}, key=_key_order)
    handles = []
    for colour, b in zip(_colours(len(bands)), bands.values(), strict=True):
        acc = b["accuracy"]
        assert acc is not None
        handles.append(_draw_band(acc_ax, acc, colour, _accuracy_style(acc.key, keys), per_seed))
        if b["train_loss"] is not None:
            _draw_band(loss_ax, b["train_loss"], colour, "-", per_seed)
    _accuracy_panel(acc_ax, bands, target)
    _loss_panel(loss_ax, bands)
    for ax in (acc_ax, loss_ax):
        _integer_ticks(ax)
    fig.legend(handles, [literal(text) for text in wrapped], loc="outside lower center", ncols=ncols,
               fontsize=LEGEND_FONT_PT)
    _suptitle(fig, "Learning curves over seeds", context, _seed_note(bands, ddof, per_seed), fontsize=11.0)
    return fig


def _seed_rows(bands: Mapping[str, Mapping[str, SeedBand | None]], per_seed: bool) -> tuple[list[str], list[list]]:
    """The CSV of :func:`plot_seed_bands`: header and rows ``round, label, metric, mean, std, n[, seed_<k> ...]``."""
    seeds = list(dict.fromkeys(s for b in bands.values() for band in b.values() if band is not None
                               for s in band.seeds)) if per_seed else []
    header = ["round", "label", "metric", "mean", "std", "n", *(f"seed_{s}" for s in seeds)]
    rows = []
    for label, b in bands.items():
        for band in b.values():
            if band is None:
                continue
            column = {s: i for i, s in enumerate(band.seeds)}
            for j, r in enumerate(band.rounds):
                cells = [band.values[column[s], j] if s in column else "" for s in seeds]
                rows.append([r, label, band.key, band.mean[j], band.std[j], band.n, *cells])
    return header, rows


def plot_seed_bands(
    groups: SeedGroups,
    out_dir: str | Path,
    *,
    name: str = "seed_bands",
    metric: str | Mapping[str, str] | None = None,
    per_seed: bool = False,
    ddof: int = 1,
    target: float | None = None,
    context: str | None = None,
) -> dict[str, Path]:
    """Learning curves over seeds as mean ± std bands: per label (a setting or method), the mean over
    its seeds as a line and ± one standard deviation as a shaded band of the same colour, in two panels,
    test accuracy (on ``[0, 1]``) and train loss (log axis when it spans more than a decade).

    ``groups`` maps a label to its runs, ``seed -> metrics`` (a metrics list, a run directory or a
    ``metrics.jsonl``). Seeds are aligned on the rounds that every seed logged
    (:func:`~hetfl.analysis.curves.seed_band`): rounds only some seeds logged are left out, and the
    title says how many; seeds that share no round are a ValueError. The accuracy is ``metric`` (a
    per-round key, one for all labels or one per label), by default ``global_acc`` where logged and
    ``client_acc_mean`` for personalised methods (:func:`~hetfl.analysis.curves.default_accuracy_key`);
    when labels show different ones, the client mean is dashed. ``ddof``: 1 for the sample std (as the
    tables of ``comparison.md`` and ``reproduction.md``), 0 for the population std; the title says which.
    ``per_seed`` adds each seed as a thin line; a label with one seed is a line without a band, and
    its legend entry says so ("FedAvg (1 seed, no band)", else "FedAvg (3 seeds)"). ``target`` marks
    an accuracy. Data: CSV ``round, label, metric, mean, std, n`` (+ ``seed_<k>`` per seed with
    ``per_seed``)."""
    bands = seed_bands(groups, metric=metric, ddof=ddof)
    png = _save(_seed_bands_figure(bands, per_seed, ddof, target, context), out_dir, name)
    header, rows = _seed_rows(bands, per_seed)
    return {"png": png, "data": _write_csv(out_dir, name, header, rows)}

