"""Per-class feature statistics, their exact pooling across clients, and robust
Gaussian sampling: the mathematics of CCVR (Luo et al., NeurIPS 2021, sec. 4).

Clients compute, for every class they hold, the count ``N_ck``, the mean
``mu_ck`` and the unbiased covariance ``S_ck`` (eq. 2; zero for a single
sample). The server pools them exactly (eq. 3-4): the pooled values equal the
mean and unbiased covariance of all clients' features concatenated. All
arithmetic is in float64, where the identity holds to rounding error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ClassStats:
    """Per-class statistics: ``counts [C]``, ``means [C, d]``, ``covs [C, d, d]`` (float64).

    Classes with count 0 have zero mean and covariance; count 1 has zero covariance.
    """

    counts: torch.Tensor
    means: torch.Tensor
    covs: torch.Tensor

    @property
    def num_floats(self) -> int:
        """Floats a client uploads for these statistics (only classes it holds)."""
        d = self.means.shape[1]
        present = int((self.counts > 0).sum())
        return present * (1 + d + d * (d + 1) // 2)  # count, mean, upper triangle of a symmetric matrix


def class_statistics(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> ClassStats:
    """Count, mean and unbiased covariance of ``features`` per class (CCVR eq. 2)."""
    z = features.detach().to(torch.float64)
    d = z.shape[1]
    counts = torch.bincount(labels, minlength=num_classes).to(torch.float64)
    sums = torch.zeros(num_classes, d, dtype=torch.float64, device=z.device).index_add_(0, labels, z)
    means = sums / counts.clamp(min=1).unsqueeze(1)
    centred = z - means[labels]
    # one [d, d] product per class present: memory d^2 per class, not n * d^2 (n = 12,800 samples of
    # 512-d features would be 26 GB as a batch of outer products)
    scatter = torch.zeros(num_classes, d, d, dtype=torch.float64, device=z.device)
    for c in torch.unique(labels).tolist():
        rows = centred[labels == c]
        scatter[c] = rows.T @ rows
    covs = scatter / (counts - 1).clamp(min=1).view(-1, 1, 1)
    return ClassStats(counts, means, covs)


def pool_statistics(clients: list[ClassStats]) -> ClassStats:
    """Global per-class mean and covariance from the clients' statistics (CCVR eq. 3-4).

    ``mu_c = sum_k N_ck/N_c mu_ck``;
    ``S_c = sum_k (N_ck-1)/(N_c-1) S_ck + sum_k N_ck/(N_c-1) mu_ck mu_ck^T - N_c/(N_c-1) mu_c mu_c^T``.
    Clients without class c contribute nothing (their N_ck = 0 terms vanish;
    the ``N_ck - 1 = -1`` factor multiplies a zero covariance). Classes with
    ``N_c < 2`` get a zero covariance.
    """
    counts = torch.stack([s.counts for s in clients])  # [K, C]
    means = torch.stack([s.means for s in clients])  # [K, C, d]
    covs = torch.stack([s.covs for s in clients])  # [K, C, d, d]
    n = counts.sum(0)  # [C]
    mu = (counts.unsqueeze(-1) * means).sum(0) / n.clamp(min=1).unsqueeze(-1)  # eq. (3)
    denom = (n - 1).clamp(min=1).view(-1, 1, 1)
    within = ((counts - 1).clamp(min=0).view(*counts.shape, 1, 1) * covs).sum(0)
    between = torch.einsum("kc,kci,kcj->cij", counts, means, means)
    sigma = (within + between - n.view(-1, 1, 1) * torch.einsum("ci,cj->cij", mu, mu)) / denom  # eq. (4)
    sigma = torch.where((n >= 2).view(-1, 1, 1), sigma, torch.zeros_like(sigma))
    return ClassStats(n, mu, 0.5 * (sigma + sigma.transpose(1, 2)))


def gaussian_factor(cov: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """A matrix ``L`` with ``L L^T = cov``, for any symmetric PSD (possibly singular) ``cov``.

    Eigen-decomposition with negative eigenvalues (rounding) clamped to zero:
    never fails on singular covariances, unlike a Cholesky factorisation.
    """
    values, vectors = torch.linalg.eigh(cov.to(torch.float64))
    scale = values.clamp(min=0.0).sqrt()
    scale = torch.where(values > eps * values.abs().max().clamp(min=eps), scale, torch.zeros_like(scale))
    return vectors * scale.unsqueeze(0)


def sample_gaussian(
    mean: torch.Tensor, cov: torch.Tensor, num: int, generator: torch.Generator
) -> torch.Tensor:
    """``num`` draws from ``N(mean, cov)`` (float64, on the CPU generator's stream)."""
    factor = gaussian_factor(cov.cpu())
    noise = torch.randn(num, mean.numel(), generator=generator, dtype=torch.float64)
    return mean.cpu().to(torch.float64) + noise @ factor.T
