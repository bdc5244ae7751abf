"""Per-class feature statistics, their exact pooling across clients, and robust
Gaussian sampling: the mathematics of CCVR (Luo et al., NeurIPS 2021, sec. 4).

Clients compute, for every class they hold, the count ``N_ck``, the mean
``mu_ck`` and the unbiased covariance ``S_ck`` (eq. 2; zero for a single
sample). The server pools them exactly (eq. 3-4): the pooled values equal the
mean and unbiased covariance of all clients' features concatenated. All
arithmetic is in float64, where the identity holds to rounding error.

Additive form (:class:`ClassMoments`): clients may instead send, per class, the
count, the sum of features and the sum of their outer products. These pool by
plain addition (:func:`sum_moments`), which secure aggregation can compute without
the server seeing any one client's values, and give the same Gaussians
(:func:`stats_from_moments`; the rounding difference is measured in its docstring).
CCVR uses this form; :func:`class_statistics` and :func:`pool_statistics` stay as
the paper's eq. 2-4, the reference of the tests and the per-class statistics of
the analyses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class NonFiniteStatistics(ArithmeticError):
    """Statistics a calibration would use are not finite (overflowed or NaN features): the run stops with
    this error (exit 1) rather than calibrating a model on them and reporting it as a result."""


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


@dataclass
class ClassMoments:
    """Additive per-class moments: ``counts [C]``, ``sums [C, d]`` (sum of the class's features z),
    ``outer [C, d, d]`` (sum of ``z z^T``), all float64.

    Unlike ``ClassStats`` they pool by plain addition (:func:`sum_moments`), so a server that only
    learns the SUM over clients (secure aggregation, then noise for differential privacy on that sum)
    can still derive the pooled Gaussians (:func:`stats_from_moments`).
    """

    counts: torch.Tensor
    sums: torch.Tensor
    outer: torch.Tensor

    @property
    def num_floats(self) -> int:
        """Floats a client needs to upload for these moments (only classes it holds, upper triangle of
        the symmetric ``outer``): the same as ``ClassStats.num_floats``."""
        d = self.sums.shape[1]
        present = int((self.counts > 0).sum())
        return present * (1 + d + d * (d + 1) // 2)


def class_moments(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> ClassMoments:
    """Count, sum and sum of outer products of ``features`` per class (float64).

    ``n_c = |{l: y_l = c}|``, ``s_c = sum_{y_l = c} z_l``, ``Q_c = sum_{y_l = c} z_l z_l^T``. One
    ``[d, d]`` product per class present, as :func:`class_statistics`: memory d^2 per class, never a
    batch of n per-sample outer products. Features of float32 (or lower) precision are products exact
    in float64 (24 + 24 significant bits < 53): only the summation rounds.
    """
    z = features.detach().to(torch.float64)
    d = z.shape[1]
    counts = torch.bincount(labels, minlength=num_classes).to(torch.float64)
    sums = torch.zeros(num_classes, d, dtype=torch.float64, device=z.device).index_add_(0, labels, z)
    outer = torch.zeros(num_classes, d, d, dtype=torch.float64, device=z.device)
    for c in torch.unique(labels).tolist():
        rows = z[labels == c]
        outer[c] = rows.T @ rows
    return ClassMoments(counts, sums, outer)


def sum_moments(clients: list[ClassMoments]) -> ClassMoments:
    """The clients' moments pooled: their plain sum (what secure aggregation can compute).

    A client without class c has zero count, sum and outer there and adds nothing.
    """
    return ClassMoments(torch.stack([m.counts for m in clients]).sum(0), torch.stack([m.sums for m in clients]).sum(0),
                        torch.stack([m.outer for m in clients]).sum(0))


def stats_from_moments(moments: ClassMoments) -> ClassStats:
    """Per-class mean and unbiased covariance from (summed) moments.

    ``mu_c = s_c / n_c``; ``S_c = (Q_c - n_c mu_c mu_c^T) / (n_c - 1)``, symmetrised; zero mean for
    ``n_c = 0``, zero covariance for ``n_c < 2``. With ``s_c = sum_k N_ck mu_ck`` and
    ``Q_c = sum_k [(N_ck - 1) S_ck + N_ck mu_ck mu_ck^T]`` this is CCVR's eq. 3-4 term by term, so
    in exact arithmetic the result is that of :func:`pool_statistics` of the clients' statistics
    and the mean and unbiased covariance of all clients' features stacked.

    Numerics. ``Q_c - n_c mu_c mu_c^T`` subtracts two matrices of size ~ n (S + mu mu^T) to leave
    (n - 1) S: the rounding of ``Q_c``'s sum (relative ~1e-16) grows by |mu|^2 / sigma^2, so the
    error grows with the square of the mean against the spread. Eq. 2-4 centre each client's
    features first; only their between-client term (client means against the pooled mean)
    cancels the same way, over K client means instead of n samples. Measured in float64
    (``benchmarks/moments_numerics.py``, results in ``benchmarks/results/moments_numerics.md``:
    20,000 MNIST samples over 10 clients, Dirichlet 0.1; max over classes of max_ij |difference|
    / max_ij |S_c|; ratio = max_c ||mu_c|| / sqrt(tr S_c)):

    - ReLU features of an MLP [64] trained two epochs (ratio 1.5): 1.4e-14 from eq. 2-4 (2.9e-14
      for the worst single variance); FedPAC's CNN at initialisation, 128-d LeakyReLU features
      (ratio 2.7): 6.4e-14 (1.5e-13). Eq. 2-4 itself is 3e-15 to 8e-15 from a two-pass
      extended-precision reference.
    - The MLP's features shifted by 10 / 100 / 1000 x their standard deviation: 7e-12 / 8e-10 /
      8e-8 (eq. 2-4: 5e-14 / 6e-12 / 4e-10); the relative error of a coordinate whose spread within
      a class is far below the shift reaches 2e-6 / 3e-4 / 3e-3 (eq. 2-4: 2e-8 / 8e-7 / 2e-4).
    - Adversarial: Gaussian features with mean 1e4 x std (ratio 1.6e4): 2.0e-6 (eq. 2-4: 2.4e-7).

    Means agree with eq. 3 to 3e-16 in every case. So the raw moments cost nothing at the
    ratios features have in practice, and even at 1e4 stay far below the sampling error of the
    virtual features (a covariance seen through M = 100-2000 draws is off by ~sqrt(2 / M), 3-14%).
    Rounding can leave a (near-)singular covariance slightly indefinite; :func:`gaussian_factor`
    clamps its negative eigenvalues. (Moments of ``z - c`` for a public ``c`` common to all
    clients would be just as additive, should a use ever need better conditioning.)
    """
    n = moments.counts
    mu = torch.where((n > 0).unsqueeze(1), moments.sums / n.clamp(min=1).unsqueeze(1), torch.zeros_like(moments.sums))
    scatter = moments.outer - n.view(-1, 1, 1) * torch.einsum("ci,cj->cij", mu, mu)
    sigma = scatter / (n - 1).clamp(min=1).view(-1, 1, 1)
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
