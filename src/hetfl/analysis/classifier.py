"""Classifier weight norms against class frequencies (CCVR, Luo et al., NeurIPS 2021, sec. 3, Figure 3).

CCVR observes that a client's local classifier is biased towards the classes it
holds most: the L2 norm of each class's weight row ``||w_c||_2`` grows with the
client's number of samples of that class. This module computes those norms and
their Pearson and Spearman correlation with the class counts, for one client or
for many.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def class_weight_norms(weight: Tensor) -> Tensor:
    """L2 norm of each row of a classifier weight ``[C, d]`` (one row per class): ``[C]`` float64."""
    if weight.dim() != 2:
        raise ValueError(f"classifier weight must be [num_classes, dim], got shape {tuple(weight.shape)}")
    return torch.linalg.vector_norm(weight.detach().to(torch.float64), dim=1)


def _as_float64(v: Tensor | Sequence[float]) -> Tensor:
    """``v`` as a flat float64 CPU tensor; Python floats are read as float64 (``torch.as_tensor`` alone would make
    a list of them float32, rounding e.g. 1e8 + 1 and 1e8 + 2 to one value)."""
    return torch.as_tensor(v, dtype=torch.float64).detach().flatten().cpu()


def _vector(v: Tensor | Sequence[float], name: str) -> Tensor:
    t = _as_float64(v)
    if t.numel() < 2:
        raise ValueError(f"{name} needs at least 2 values")
    return t


def pearson(a: Tensor | Sequence[float], b: Tensor | Sequence[float]) -> float:
    """Pearson correlation coefficient of two equally long vectors; ``nan`` if either is constant."""
    x, y = _vector(a, "a"), _vector(b, "b")
    if x.shape != y.shape:
        raise ValueError(f"vectors differ in length: {x.numel()} vs {y.numel()}")
    x, y = x - x.mean(), y - y.mean()
    denom = torch.linalg.vector_norm(x) * torch.linalg.vector_norm(y)
    if denom == 0:
        return float("nan")
    return float((x @ y / denom).clamp(-1.0, 1.0))


def average_ranks(v: Tensor | Sequence[float]) -> Tensor:
    """1-based ranks of ``v`` with ties given the mean of the ranks they span (float64); all NaN when
    ``v`` holds a NaN (as ``scipy.stats.rankdata``'s default: a NaN has no rank, and ranking by its position
    would make e.g. a diverged model's NaN norms look perfectly correlated)."""
    x = _as_float64(v)
    if torch.isnan(x).any():
        return torch.full_like(x, float("nan"))
    order = torch.argsort(x, stable=True)
    sorted_x = x[order]
    ranks = torch.empty_like(x)
    n = x.numel()
    i = 0
    while i < n:
        j = i
        while j + 1 < n and sorted_x[j + 1] == sorted_x[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: Tensor | Sequence[float], b: Tensor | Sequence[float]) -> float:
    """Spearman rank correlation: Pearson correlation of the average ranks (handles ties); ``nan`` if
    either holds a NaN or is constant."""
    return pearson(average_ranks(a), average_ranks(b))


def norm_count_correlation(weight: Tensor, counts: Tensor | Sequence[float]) -> dict[str, float]:
    """Pearson and Spearman correlation between a classifier's per-class weight norms and a
    client's per-class sample counts (CCVR Figure 3); positive means the classifier favours
    the classes the client holds most."""
    norms = class_weight_norms(weight)
    c = _vector(counts, "counts")
    if c.numel() != norms.numel():
        raise ValueError(f"{norms.numel()} classifier rows but {c.numel()} class counts")
    return {"pearson": pearson(norms, c), "spearman": spearman(norms, c)}


def clients_norm_count_correlation(
    weights: Sequence[Tensor], counts: Tensor | Sequence[Sequence[float]]
) -> dict[str, list[float]]:
    """:func:`norm_count_correlation` for many clients.

    Args:
        weights: each client's classifier weight ``[C, d]``.
        counts: class counts ``[m, C]``, row ``k`` for client ``k``.

    Returns:
        ``{"pearson": [m], "spearman": [m], "norms": [m][C]}`` as plain lists.
    """
    c = torch.as_tensor(counts, dtype=torch.float64)
    if c.dim() != 2 or c.shape[0] != len(weights):
        raise ValueError(f"counts must be [{len(weights)}, num_classes], got shape {tuple(c.shape)}")
    out: dict[str, list] = {"pearson": [], "spearman": [], "norms": []}
    for w, row in zip(weights, c, strict=True):
        r = norm_count_correlation(w, row)
        out["pearson"].append(r["pearson"])
        out["spearman"].append(r["spearman"])
        out["norms"].append(class_weight_norms(w).tolist())
    return out
