"""Statistics table and heat map of a partition (``hetfl partition``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from hetfl.data.partition import Partition


def class_counts(partition: Partition, train_labels: np.ndarray, num_classes: int) -> np.ndarray:
    """``[num_clients, num_classes]`` training samples of each class per client."""
    return np.stack([np.bincount(train_labels[idx], minlength=num_classes) for idx in partition.train])


def partition_table(
    partition: Partition, train_labels: np.ndarray, test_labels: np.ndarray, num_classes: int
) -> list[dict[str, Any]]:
    """Per client: sizes, classes held, share of its largest class, label entropy (bits)."""
    counts = class_counts(partition, train_labels, num_classes)
    rows = []
    for i, row in enumerate(counts):
        total = int(row.sum())
        p = row[row > 0] / max(total, 1)
        rows.append({
            "client": i,
            "n_train": total,
            "n_test": len(partition.test[i]),
            "classes": int((row > 0).sum()),
            "top_class_share": round(float(row.max() / max(total, 1)), 4),
            "entropy_bits": round(float(-(p * np.log2(p)).sum()), 4),
        })
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Plain-text table with a summary line (mean / min / max of client sizes)."""
    if not rows:
        return "(no clients)"
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in keys}
    lines = ["  ".join(k.rjust(widths[k]) for k in keys)]
    lines += ["  ".join(str(r[k]).rjust(widths[k]) for k in keys) for r in rows]
    sizes = [r["n_train"] for r in rows]
    lines.append(
        f"{len(rows)} clients; train samples mean {np.mean(sizes):.1f}, min {min(sizes)}, max {max(sizes)}; "
        f"classes per client mean {np.mean([r['classes'] for r in rows]):.2f}"
    )
    return "\n".join(lines)


def plot_partition(
    partition: Partition,
    train_labels: np.ndarray,
    num_classes: int,
    path: str | os.PathLike,
    class_names: list[str] | None = None,
    title: str | None = None,
) -> None:
    """PNG heat map of class counts per client (clients down, classes across), written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = class_counts(partition, train_labels, num_classes)
    k = counts.shape[0]
    fig, ax = plt.subplots(figsize=(min(2 + 0.45 * num_classes, 24), min(1.5 + 0.3 * k, 30)))
    image = ax.imshow(counts, aspect="auto", cmap="viridis")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    labels = class_names if class_names and num_classes <= 30 else None
    ax.set_xticks(range(num_classes) if num_classes <= 30 else [])
    if labels:
        ax.set_xticklabels(labels, rotation=45, ha="right")
    if k <= 40:
        ax.set_yticks(range(k))
    if k * num_classes <= 400:
        top = counts.max() or 1
        for (i, j), value in np.ndenumerate(counts):
            ax.text(j, i, str(value), ha="center", va="center", fontsize=7,
                    color="black" if value > 0.6 * top else "white")
    fig.colorbar(image, ax=ax, label="training samples")
    ax.set_title(title or f"{k} clients x {num_classes} classes")
    fig.tight_layout()
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, format="png", dpi=110)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
