"""Statistics table and heat map of a partition (``hetfl partition``).

The table shows how heterogeneous a split is: per client its sizes, how many
classes it holds, the share of its largest class and the entropy of its label
distribution (log2 C bits for a balanced client, 0 for a single class), and
the total-variation distance between its training and personal test label
distributions (near 0 when the test split follows the training split). The
heat map (clients x classes, colour = training samples, on a log scale when
a few clients hold most samples) is the usual picture of a non-IID split
(e.g. NIID-Bench, Li et al. ICDE 2022, Fig. 2).
"""

from __future__ import annotations

import io
import os
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from hetfl.data.partition import Partition
from hetfl.files import atomic_write_bytes

ANNOTATE_MAX_CELLS = 400  # write the count in each cell up to this many cells


def _counts(parts: list[np.ndarray], labels: np.ndarray, num_classes: int) -> np.ndarray:
    labels = np.asarray(labels, dtype=np.int64)
    if not parts:
        return np.zeros((0, num_classes), dtype=np.int64)
    return np.stack([np.bincount(labels[np.asarray(idx, dtype=np.int64)], minlength=num_classes)[:num_classes]
                     for idx in parts])


def class_counts(partition: Partition, train_labels: np.ndarray, num_classes: int) -> np.ndarray:
    """``[num_clients, num_classes]`` int64: training samples of each class per client."""
    return _counts(partition.train, train_labels, num_classes)


def _entropy_bits(counts: np.ndarray) -> float:
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log2(p)).sum()) + 0.0  # + 0.0: a one-class client's -0.0 becomes 0.0


def partition_table(
    partition: Partition,
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    num_classes: int,
    *,
    summary: bool = False,
) -> list[dict[str, Any]]:
    """One row per client (plain Python values, JSON-ready).

    Keys: ``client``, ``group`` / ``angle`` (when the partition has them),
    ``n_train``, ``n_test``, ``n_classes`` (classes held), ``top_class`` and
    ``top_class_share`` (largest class and its share), ``entropy_bits`` (label
    entropy), ``test_tv`` (total-variation distance between the client's train
    and test label distributions). ``summary=True`` appends :func:`summary_row`.
    """
    train = _counts(partition.train, train_labels, num_classes)
    test = _counts(partition.test, test_labels, num_classes)
    rows: list[dict[str, Any]] = []
    for i, (row, trow) in enumerate(zip(train, test, strict=True)):
        total, ttotal = int(row.sum()), int(trow.sum())
        entry: dict[str, Any] = {"client": i}
        if partition.group is not None:
            entry["group"] = int(partition.group[i])
        if partition.rotation is not None:
            entry["angle"] = round(float(partition.rotation[i]), 2)
        p = row / max(total, 1)
        q = trow / max(ttotal, 1)
        entry.update({
            "n_train": total,
            "n_test": ttotal,
            "n_classes": int(np.count_nonzero(row)),
            "top_class": int(row.argmax()) if total else -1,
            "top_class_share": round(float(p.max(initial=0.0)), 4),
            "entropy_bits": round(_entropy_bits(row), 4),
            "test_tv": round(float(0.5 * np.abs(p - q).sum()), 4) if total and ttotal else 0.0,
        })
        rows.append(entry)
    return [*rows, summary_row(rows)] if summary and rows else rows


def summary_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``all`` row: sample counts summed, every other column averaged over clients."""
    clients = [r for r in rows if r.get("client") != "all"]
    out: dict[str, Any] = {}
    for key in clients[0] if clients else ():
        values = [r[key] for r in clients]
        if key == "client":
            out[key] = "all"
        elif key in ("n_train", "n_test"):
            out[key] = int(sum(values))
        elif key == "group":
            out[key] = len(set(values))  # number of groups
        elif key == "top_class":
            out[key] = "-"
        else:
            out[key] = round(float(np.mean(values)), 4)
    return out


def format_table(rows: list[dict[str, Any]]) -> str:
    """Plain-text table (right-aligned columns) with an ``all`` row (sums of
    sample counts, means of the rest; ``group`` there = number of groups) and
    a one-line size summary."""
    clients = [r for r in rows if r.get("client") != "all"]
    if not clients:
        return "(no clients)"
    table = [*clients, summary_row(clients)]
    keys = list(clients[0])
    cells = [[str(r.get(k, "")) for k in keys] for r in table]
    widths = [max(len(k), *(len(c[j]) for c in cells)) for j, k in enumerate(keys)]
    line = lambda values: "  ".join(v.rjust(w) for v, w in zip(values, widths, strict=True))
    lines = [line(keys), *(line(c) for c in cells[:-1]), "-" * len(line(keys)), line(cells[-1])]
    sizes = np.array([r["n_train"] for r in clients])
    lines.append(
        f"{len(clients)} clients; train samples per client mean {sizes.mean():.1f}, min {sizes.min()}, "
        f"max {sizes.max()} (coefficient of variation {sizes.std() / max(sizes.mean(), 1e-12):.2f}); "
        f"classes per client mean {np.mean([r['n_classes'] for r in clients]):.2f}"
    )
    return "\n".join(lines)


LOG_COLOUR_RATIO = 50.0  # counts spanning more than this factor get a log colour scale


def _literal(text: object) -> str:
    """``text`` drawn by matplotlib as written, each ``$`` escaped: class names (an image folder's) and titles are
    user strings, and matplotlib typesets the text between two ``$`` as mathtext (``hetfl.analysis.plots.literal``,
    which this layer cannot import)."""
    return str(text).replace("$", r"\$")


def partition_figure(
    partition: Partition,
    train_labels: np.ndarray,
    num_classes: int,
    class_names: list[str] | None = None,
    title: str | None = None,
) -> Any:
    """The heat map of :func:`plot_partition` as a matplotlib ``Figure`` (Agg canvas, no pyplot).

    Rows are clients, columns classes, colour the training samples, with a labelled colour bar.
    When the nonzero counts span more than :data:`LOG_COLOUR_RATIO` (quantity skew: one client
    with thousands of samples would paint every other cell the colour of zero) the colour scale
    is logarithmic, empty cells are drawn white, and the colour bar says so. ``title`` (e.g. the
    dataset, partition and number of clients) goes under a first line saying what is shown.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm, Normalize
    from matplotlib.figure import Figure

    counts = class_counts(partition, train_labels, num_classes)
    k = counts.shape[0]
    fig = Figure(figsize=(min(3.5 + 0.45 * num_classes, 24), min(2.5 + 0.3 * k, 30)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    top = int(counts.max(initial=0)) or 1
    nonzero = counts[counts > 0]
    log = nonzero.size > 0 and top / nonzero.min() > LOG_COLOUR_RATIO
    cmap = _colormap("viridis").with_extremes(bad="white")
    norm = LogNorm(vmin=1, vmax=top) if log else Normalize(vmin=0, vmax=top)
    shown = np.ma.masked_equal(counts, 0) if log else counts
    image = ax.imshow(shown, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    if num_classes <= 30:
        ax.set_xticks(range(num_classes))
        if class_names is not None and len(class_names) == num_classes:
            ax.set_xticklabels([_literal(name) for name in class_names], rotation=45, ha="right")
    if k <= 40:
        ax.set_yticks(range(k))
    if 0 < k * num_classes <= ANNOTATE_MAX_CELLS:
        for (i, j), value in np.ndenumerate(counts):
            light = value > 0 and norm(value) > 0.6
            ax.text(j, i, str(value), ha="center", va="center", fontsize=7,
                    color="black" if light or (log and value == 0) else "white")
    label = "training samples (log scale; white = none)" if log else "training samples"
    fig.colorbar(image, ax=ax, label=label)
    width = max(20, int(fig.get_figwidth() * 0.7 * 72 / 6.0))  # characters of a 10-point title over the axes
    what = f"Training samples per client and class ({k} clients x {num_classes} classes)"
    ax.set_title(_literal("\n".join(textwrap.fill(part, width) for part in (what, title) if part)), fontsize="medium")
    return fig


def _colormap(name: str) -> Any:
    import matplotlib

    return matplotlib.colormaps[name]


def plot_partition(
    partition: Partition,
    train_labels: np.ndarray,
    num_classes: int,
    path: str | os.PathLike[str],
    class_names: list[str] | None = None,
    title: str | None = None,
) -> None:
    """Write a PNG heat map of training samples per client (rows) and class
    (columns), with a colour bar (:func:`partition_figure`); counts are written in
    the cells when there are at most ``ANNOTATE_MAX_CELLS`` of them.

    Uses matplotlib's Agg canvas directly (no pyplot, so the caller's backend
    and figure state are untouched) and writes atomically (:func:`hetfl.files.atomic_write_bytes`: a
    temporary file in the target folder, then ``os.replace``), so a reader never sees half a PNG and a
    failure leaves nothing behind.
    """
    fig = partition_figure(partition, train_labels, num_classes, class_names, title)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(target, png.getvalue())
