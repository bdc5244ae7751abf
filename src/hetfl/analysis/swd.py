"""Sliced Wasserstein distance between Gaussian mixtures, without sampling.

CCVR (Luo et al., NeurIPS 2021, appendix) measures how far apart clients'
class-conditional feature distributions are by fitting a Gaussian per class and
comparing the resulting mixtures with the sliced Wasserstein distance

    SW_p(A, B) = ( E_theta[ W_p^p(theta#A, theta#B) ] )^(1/p),

``theta`` uniform on the unit sphere and ``theta#A`` the 1-D law of ``theta . X``
for ``X ~ A`` (Bonneel et al., "Sliced and Radon Wasserstein barycenters of
measures", JMIV 2015). The expectation is estimated with ``num_projections``
random directions drawn from an explicit generator.

The projection of a Gaussian mixture ``sum_k w_k N(mu_k, S_k)`` on ``theta`` is the
1-D mixture ``sum_k w_k N(theta . mu_k, theta^T S_k theta)``, and for 1-D laws

    W_p^p(a, b) = int_0^1 |Q_a(u) - Q_b(u)|^p du

with ``Q`` the quantile function. Here that integral is computed deterministically:
the levels are ``u = Phi(z)`` on a uniform grid of ``z`` in ``[-z_max, z_max]``, so
``du = phi(z) dz`` and the (normalised) trapezoid rule in ``z`` puts fine resolution
in the tails where quantiles diverge; the neglected tail mass is ``2 Phi(-z_max)``
(1.2e-15 for ``z_max = 8``). Each ``Q(u)`` is the root of the mixture CDF, found to
about 1e-13 relative precision by Newton's method on ``log F`` safeguarded by
bisection inside the exact bracket ``[min_k(m_k + z s_k), max_k(m_k + z s_k)]``
(levels above 1/2 are solved on the mirrored mixture, so upper tails keep full
precision). For a single Gaussian the bracket is the point ``m + z s`` itself.

Consequences: the same mixture (same tensors, same component order) gives exactly 0; the result is exactly symmetric;
for two mixtures that differ by a translation ``delta`` each ``W_p`` is exactly
``|theta . delta|``, so ``SW_2^2`` averages ``(theta . delta)^2``, whose expectation
over the sphere is ``||delta||^2 / d``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from hetfl.algorithms.gaussian_stats import class_statistics

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass(frozen=True)
class GaussianMixture:
    """``sum_k weights[k] N(means[k], covs[k])``: ``weights [K]`` (normalised to sum 1 on
    construction), ``means [K, d]``, ``covs [K, d, d]`` (symmetric positive semi-definite);
    all stored as float64 on the CPU. Components with zero weight are dropped."""

    weights: Tensor
    means: Tensor
    covs: Tensor

    def __post_init__(self) -> None:
        w = torch.as_tensor(self.weights).detach().to(torch.float64).cpu().flatten()
        mu = torch.as_tensor(self.means).detach().to(torch.float64).cpu()
        cov = torch.as_tensor(self.covs).detach().to(torch.float64).cpu()
        if mu.dim() != 2 or cov.dim() != 3 or cov.shape != (mu.shape[0], mu.shape[1], mu.shape[1]):
            raise ValueError(f"means must be [K, d] and covs [K, d, d]; got {tuple(mu.shape)}, {tuple(cov.shape)}")
        if w.numel() != mu.shape[0]:
            raise ValueError(f"{w.numel()} weights for {mu.shape[0]} components")
        if (w < 0).any() or not torch.isfinite(w).all() or w.sum() <= 0:
            raise ValueError("weights must be finite, nonnegative and not all zero")
        if not (torch.isfinite(mu).all() and torch.isfinite(cov).all()):
            raise ValueError("means and covariances must be finite")
        keep = w > 0
        object.__setattr__(self, "weights", w[keep] / w[keep].sum())
        object.__setattr__(self, "means", mu[keep])
        object.__setattr__(self, "covs", cov[keep])

    @property
    def dim(self) -> int:
        """Dimension ``d`` of the space."""
        return self.means.shape[1]

    @classmethod
    def gaussian(cls, mean: Tensor, cov: Tensor) -> GaussianMixture:
        """A single Gaussian ``N(mean [d], cov [d, d])``."""
        mean = torch.as_tensor(mean, dtype=torch.float64)
        return cls(torch.ones(1), mean.reshape(1, -1), torch.as_tensor(cov, dtype=torch.float64).unsqueeze(0))

    @classmethod
    def from_features(
        cls, features: Tensor, labels: Tensor, num_classes: int | None = None, *, eps: float = 0.0
    ) -> GaussianMixture:
        """One Gaussian per class present in ``labels``, weighted by its frequency, with the class
        mean and unbiased covariance (zero for a single sample) plus ``eps * I`` — the per-class
        statistics of CCVR eq. 2 seen as a mixture (a client's class-conditional feature law)."""
        z = features.detach().to(torch.float64).cpu()
        y = labels.detach().long().cpu()
        if z.dim() != 2 or y.shape != (z.shape[0],):
            raise ValueError(f"features must be [n, d] with labels [n]; got {tuple(z.shape)}, {tuple(y.shape)}")
        c = int(num_classes if num_classes is not None else int(y.max()) + 1)
        if y.numel() == 0 or int(y.min()) < 0 or int(y.max()) >= c:
            raise ValueError(f"labels must be nonempty and in [0, {c})")
        stats = class_statistics(z, y, c)
        return cls(stats.counts, stats.means, stats.covs + eps * torch.eye(z.shape[1], dtype=torch.float64))


def random_directions(
    num: int, dim: int, *, seed: int = 0, generator: torch.Generator | None = None, orthogonal: bool = False
) -> Tensor:
    """``num`` unit vectors in ``R^dim`` (``[num, dim]`` float64), uniform on the sphere.

    Drawn from ``generator`` if given, else from a fresh generator seeded with ``seed``.
    ``orthogonal=True`` draws them in blocks of ``dim`` rows of a uniformly random rotation
    (orthogonal estimation, Rowland et al., AISTATS 2019): each row is still uniform on the
    sphere, but a full block sums ``(theta . x)^2`` to ``||x||^2`` exactly, lowering variance.
    """
    if num < 1 or dim < 1:
        raise ValueError(f"need num >= 1 and dim >= 1, got {num}, {dim}")
    if generator is None:
        generator = torch.Generator().manual_seed(seed)
    if not orthogonal:
        g = torch.randn(num, dim, generator=generator, dtype=torch.float64)
        return g / torch.linalg.vector_norm(g, dim=1, keepdim=True)
    blocks = []
    for _ in range(-(-num // dim)):
        q, r = torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=torch.float64))
        blocks.append((q * torch.sign(torch.diagonal(r))).T)  # Haar-distributed rotation (Mezzadri 2007)
    return torch.cat(blocks)[:num]


def quantile_grid(grid_size: int = 401, z_max: float = 8.0) -> tuple[Tensor, Tensor]:
    """Standard-normal scores ``z [G]`` and quadrature weights ``[G]`` (summing to 1) for
    ``int_0^1 g(u) du = int g(Phi(z)) phi(z) dz`` by the trapezoid rule in ``z``."""
    if grid_size < 3 or z_max <= 0:
        raise ValueError(f"need grid_size >= 3 and z_max > 0, got {grid_size}, {z_max}")
    z = torch.linspace(-z_max, z_max, grid_size, dtype=torch.float64)
    w = torch.exp(-0.5 * z * z)
    w[0] *= 0.5
    w[-1] *= 0.5
    return z, w / w.sum()


def _projected(mix: GaussianMixture, directions: Tensor) -> tuple[Tensor, Tensor]:
    """Means and standard deviations ``[P, K]`` of the mixture's components projected on each direction."""
    m = directions @ mix.means.T
    var = torch.einsum("pd,kde,pe->pk", directions, mix.covs, directions)
    scale = torch.maximum(m.abs().amax(dim=1, keepdim=True), var.clamp(min=0).sqrt().amax(dim=1, keepdim=True))
    floor = (1e-12 * (scale + 1e-150)) ** 2  # a degenerate direction behaves as a point mass
    return m, var.clamp(min=0).maximum(floor).sqrt()


def _log_cdf_and_ratio(x: Tensor, m: Tensor, s: Tensor, log_w: Tensor) -> tuple[Tensor, Tensor]:
    """``log F(x)`` and ``F'(x) / F(x)`` of 1-D mixtures ``[N, K]`` at points ``x [N]``, in log space:
    ``F'/F = sum_k softmax_k(log w_k + log Phi(a_k)) * phi(a_k) / (Phi(a_k) s_k)``, ``a_k = (x - m_k) / s_k``
    (the inverse Mills ratio ``phi / Phi`` stays finite where ``Phi`` underflows)."""
    a = (x.unsqueeze(1) - m) / s
    log_cdf = torch.special.log_ndtr(a)
    terms = log_w + log_cdf
    top = terms.amax(dim=1, keepdim=True)
    e = torch.exp(terms - top)
    total = e.sum(dim=1)
    mills = torch.exp(-0.5 * a * a - _LOG_SQRT_2PI - log_cdf) / s
    return top.squeeze(1) + total.log(), (e * mills).sum(dim=1) / total


def projected_quantiles(
    mix: GaussianMixture, directions: Tensor, z: Tensor, *, max_iter: int = 200, rtol: float = 1e-13
) -> Tensor:
    """Quantiles ``[P, G]`` of the mixture projected on each direction ``[P, d]``, at the
    levels ``u = Phi(z)`` for standard-normal scores ``z [G]`` (see the module docstring)."""
    directions = directions.to(torch.float64)
    z = z.to(torch.float64)
    if directions.dim() != 2 or directions.shape[1] != mix.dim:
        raise ValueError(f"directions must be [P, {mix.dim}], got {tuple(directions.shape)}")
    m, s = _projected(mix, directions)  # [P, K]
    sign = torch.where(z > 0, -1.0, 1.0).to(torch.float64)  # levels above 1/2: solve on -X
    zn = -z.abs()
    num_p, num_g, k = m.shape[0], z.shape[0], m.shape[1]
    m = (m.unsqueeze(1) * sign.view(1, -1, 1)).reshape(-1, k)  # [P * G, K]
    s = s.unsqueeze(1).expand(num_p, num_g, k).reshape(-1, k)
    zn = zn.repeat(num_p)
    log_w = mix.weights.log()
    log_target = torch.special.log_ndtr(zn)
    ends = m + zn.unsqueeze(1) * s
    lo, hi = ends.amin(dim=1), ends.amax(dim=1)  # F(lo) <= u <= F(hi)
    x = (ends @ mix.weights).clamp(lo, hi)
    tol = rtol * (x.abs() + s.amax(dim=1))
    active = torch.nonzero(hi - lo > tol).squeeze(1)  # a single component: lo = hi = m + z s
    for _ in range(max_iter):
        if active.numel() == 0:
            break
        xa, la, ha, ma, sa = x[active], lo[active], hi[active], m[active], s[active]
        log_f, ratio = _log_cdf_and_ratio(xa, ma, sa, log_w)
        g = log_f - log_target[active]
        below = g < 0
        la = torch.where(below, xa, la)
        ha = torch.where(below, ha, xa)
        newton = xa - g / ratio
        ok = torch.isfinite(newton) & (newton >= la) & (newton <= ha)
        new = torch.where(ok, newton, 0.5 * (la + ha))
        new = torch.where(g == 0, xa, new)
        x[active], lo[active], hi[active] = new, la, ha
        ta = tol[active]
        active = active[((new - xa).abs() > ta) & (ha - la > ta)]
    return (x * sign.repeat(num_p)).reshape(num_p, num_g)


def _wpp(qa: Tensor, qb: Tensor, weights: Tensor, p: float) -> Tensor:
    """``W_p^p`` per projection from quantiles ``[P, G]`` and quadrature weights ``[G]``."""
    return ((qa - qb).abs() ** p) @ weights


def _chunks(num: int, mix_size: int, grid_size: int) -> int:
    return max(1, min(num, 2_000_000 // max(1, mix_size * grid_size)))


def sliced_wasserstein_matrix(
    mixtures: Sequence[GaussianMixture],
    *,
    p: float = 2.0,
    num_projections: int = 256,
    seed: int = 0,
    generator: torch.Generator | None = None,
    orthogonal: bool = False,
    grid_size: int = 401,
    z_max: float = 8.0,
) -> Tensor:
    """``SW_p`` between every pair of mixtures, ``[m, m]`` float64, symmetric with a zero diagonal.

    All pairs use the same ``num_projections`` directions (from ``generator``, else ``seed``),
    so entries are comparable and each mixture's quantiles are computed once per direction.
    See :func:`sliced_wasserstein` for the arguments.
    """
    if not mixtures:
        raise ValueError("no mixtures given")
    if p < 1:
        raise ValueError(f"p must be >= 1, got {p}")
    d = mixtures[0].dim
    if any(mix.dim != d for mix in mixtures):
        raise ValueError(f"mixtures differ in dimension: {[mix.dim for mix in mixtures]}")
    theta = random_directions(num_projections, d, seed=seed, generator=generator, orthogonal=orthogonal)
    z, weights = quantile_grid(grid_size, z_max)
    n = len(mixtures)
    total = torch.zeros(n, n, dtype=torch.float64)
    step = _chunks(num_projections, max(mix.means.shape[0] for mix in mixtures), grid_size)
    for start in range(0, num_projections, step):
        q = [projected_quantiles(mix, theta[start : start + step], z) for mix in mixtures]
        for i in range(n):
            for j in range(i + 1, n):
                total[i, j] += _wpp(q[i], q[j], weights, p).sum()
    out = (total / num_projections) ** (1.0 / p)
    return out + out.T


def sliced_wasserstein(
    a: GaussianMixture,
    b: GaussianMixture,
    *,
    p: float = 2.0,
    num_projections: int = 256,
    seed: int = 0,
    generator: torch.Generator | None = None,
    orthogonal: bool = False,
    grid_size: int = 401,
    z_max: float = 8.0,
) -> float:
    """Sliced ``p``-Wasserstein distance between two Gaussian mixtures, sampling-free.

    Args:
        a, b: the mixtures (same dimension).
        p: order of the distance (>= 1); the result is ``(mean_theta W_p^p)^(1/p)``.
        num_projections: random unit directions ``theta``.
        seed: seed of a fresh generator for the directions, used when ``generator`` is ``None``.
        generator: draw the directions from this generator instead (advances it).
        orthogonal: draw directions in blocks of random orthonormal bases (lower variance).
        grid_size, z_max: quadrature of the 1-D distances over levels ``Phi(z)``, ``|z| <= z_max``.
    """
    mat = sliced_wasserstein_matrix(
        [a, b], p=p, num_projections=num_projections, seed=seed, generator=generator,
        orthogonal=orthogonal, grid_size=grid_size, z_max=z_max,
    )
    return float(mat[0, 1])
