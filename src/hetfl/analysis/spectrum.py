"""Singular value spectrum of the feature covariance: dimensional collapse.

Shi et al. ("Towards Understanding and Mitigating Dimensional Collapse in
Heterogeneous Federated Learning", ICLR 2023, sec. 3, Figures 2-3) show that
with heterogeneous clients the representations of local and global models
collapse onto a few directions: the sorted singular values of the feature
covariance ``Sigma = 1/(n-1) sum_i (z_i - mean)(z_i - mean)^T`` fall off sharply
(plotted on a log10 scale). FedUV (Son et al., CVPR 2024) uses the same view to
motivate its variance and uniformity regularisers.

:func:`effective_rank` summarises a spectrum by one number: ``exp(H(p))`` with
``p_i = s_i / sum_j s_j`` and ``H`` the Shannon entropy (Roy & Vetterli, "The
effective rank: a measure of effective dimensionality", EUSIPCO 2007). It is
``d`` for isotropic features and ``k`` for ``k`` equal nonzero singular values.
"""

from __future__ import annotations

import torch
from torch import Tensor


def feature_covariance(features: Tensor) -> Tensor:
    """Unbiased covariance ``[d, d]`` (float64) of features ``[n, d]`` (rows are samples); a ValueError
    for non-finite features."""
    if features.dim() != 2:
        raise ValueError(f"features must be [n, d], got shape {tuple(features.shape)}")
    n = features.shape[0]
    if n < 2:
        raise ValueError("the covariance needs at least 2 samples")
    z = features.detach().to(torch.float64)
    if not bool(torch.isfinite(z).all()):
        raise ValueError("features are not finite (NaN or inf; a diverged model?): no covariance to analyse")
    z = z - z.mean(dim=0, keepdim=True)
    return z.T @ z / (n - 1)


def singular_values(features: Tensor, *, normalize: bool = False, log10: bool = False) -> Tensor:
    """Singular values of the feature covariance in descending order, ``[d]`` float64 (on the CPU).

    Args:
        features: ``[n, d]``, one row per sample.
        normalize: divide by the largest singular value (the curve then starts at 1).
        log10: return ``log10`` of the values (exact zeros become ``-inf``), as the papers plot.
    """
    s = torch.linalg.svdvals(feature_covariance(features)).cpu()  # already descending
    if normalize:
        top = s[0] if s.numel() else torch.tensor(0.0, dtype=torch.float64)
        s = s / top if top > 0 else torch.zeros_like(s)
    if log10:
        s = torch.log10(s)
    return s


def effective_rank_of_spectrum(values: Tensor) -> float:
    """``exp`` of the Shannon entropy of ``values / values.sum()`` (nonnegative singular values,
    not log-scaled); 0 for an all-zero spectrum."""
    s = values.detach().to(torch.float64).flatten().clamp(min=0.0)
    total = s.sum()
    if total <= 0:
        return 0.0
    p = s[s > 0] / total
    return float(torch.exp(-(p * p.log()).sum()))


def effective_rank(features: Tensor) -> float:
    """Effective rank (Roy & Vetterli 2007) of the feature covariance's singular values:
    between 1 (all variance on one direction) and ``d`` (isotropic features)."""
    return effective_rank_of_spectrum(singular_values(features))


def numerical_rank(features: Tensor, rtol: float = 1e-6) -> int:
    """Number of covariance singular values above ``rtol`` times the largest one."""
    s = singular_values(features, normalize=True)
    return int((s > rtol).sum())
