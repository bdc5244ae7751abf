"""Quadratic programs over the probability simplex: ``min_a a^T P a``, ``a >= 0``, ``sum a = 1``.

FedPAC's classifier-combination weights (Xu et al., ICLR 2023, eq. 9) solve
one such problem per client, with at most a few hundred variables. Solved
exactly in float64 by a primal active-set method after repairing ``P`` to the
nearest positive semidefinite matrix; no solver dependency is needed.
:func:`drop_small_eigenvalues` is the FedPAC authors' repair of a non-PSD
matrix (FedPAC applies it before solving, as their code does).
:func:`project_to_simplex` (Duchi et al. 2008) serves tests and callers that
need a projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def project_to_simplex(v: torch.Tensor) -> torch.Tensor:
    """Euclidean projection of ``v`` onto ``{a >= 0, sum a = 1}`` (Duchi et al., ICML 2008, Fig. 1)."""
    u, _ = torch.sort(v, descending=True)
    css = torch.cumsum(u, 0) - 1
    k = torch.arange(1, len(v) + 1, dtype=v.dtype, device=v.device)
    rho = int(torch.nonzero(u - css / k > 0).max())
    theta = css[rho] / (rho + 1)
    return torch.clamp(v - theta, min=0)


def nearest_psd(p: torch.Tensor) -> torch.Tensor:
    """Symmetrise and clamp negative eigenvalues (rounding, or an indefinite estimate) to zero."""
    sym = 0.5 * (p + p.T)
    values, vectors = torch.linalg.eigh(sym)
    return (vectors * values.clamp(min=0)) @ vectors.T


def drop_small_eigenvalues(p: torch.Tensor, floor: float) -> tuple[torch.Tensor, bool]:
    """FedPAC authors' repair of a QP matrix that is not positive semidefinite: ``(P', True)``
    with ``P' = sum of lambda u u^T`` over the eigenpairs of ``P`` with ``lambda >= floor``
    when ``P`` has a negative eigenvalue; ``(P, False)`` (unchanged) otherwise.

    JianXu95/FedPAC, tools.py, ``get_head_agg_weight`` (commit 7cf08f3e): the same test
    (any eigenvalue < 0) and the same absolute floor (0.01 there). Computed in float64 on
    the symmetrised matrix (the authors: float32, ``torch.eig``).
    """
    p = p.to(torch.float64)
    sym = 0.5 * (p + p.T)
    values, vectors = torch.linalg.eigh(sym)
    if float(values.min()) >= 0:
        return p, False
    keep = values >= floor
    return (vectors[:, keep] * values[keep]) @ vectors[:, keep].T, True


@dataclass
class SimplexQPResult:
    weights: torch.Tensor
    objective: float
    iterations: int
    converged: bool


def solve_simplex_qp(p: torch.Tensor, tol: float = 1e-10, max_iter: int = 1000) -> SimplexQPResult:
    """Minimise ``a^T P a`` over the simplex (P repaired to PSD first).

    Primal active-set method (Nocedal & Wright, Numerical Optimization, Alg.
    16.3): exact up to rounding, finite, and fast for the few hundred
    variables of FedPAC. The working set holds the coordinates fixed at zero;
    each iteration solves the equality-constrained problem on the free ones
    (a least-squares KKT solve, so singular ``P`` is fine), then either steps
    to the first blocking bound or frees the coordinate with the most negative
    multiplier.
    """
    if p.dim() != 2 or p.shape[0] != p.shape[1] or p.shape[0] == 0:
        raise ValueError(f"solve_simplex_qp: P must be a non-empty square matrix, got shape {tuple(p.shape)}")
    original = p.to(device="cpu", dtype=torch.float64)  # a few hundred variables: solved on the CPU
    if not torch.isfinite(original).all():
        raise ValueError("solve_simplex_qp: P has non-finite entries")
    # the minimiser does not depend on P's scale; solving on P / max|P| keeps the KKT matrix (entries
    # 2 P next to the constraint's ones) well conditioned at any scale (1e8 * I made LAPACK fail)
    scale = float(original.abs().max().clamp(min=1e-300))
    p = nearest_psd(original / scale)
    n = p.shape[0]
    k = int(torch.argmin(torch.diagonal(p)))
    a = torch.zeros(n, dtype=torch.float64)
    a[k] = 1.0  # start at the best vertex
    fixed = torch.ones(n, dtype=torch.bool)
    fixed[k] = False
    converged = False
    iterations = 0
    while iterations < max_iter:
        iterations += 1
        free = (~fixed).nonzero().flatten()
        m = len(free)
        grad = 2 * p @ a
        kkt = torch.zeros(m + 1, m + 1, dtype=torch.float64)
        kkt[:m, :m] = 2 * p[free][:, free]
        kkt[:m, m] = 1.0
        kkt[m, :m] = 1.0
        rhs = torch.cat([-grad[free], torch.zeros(1, dtype=torch.float64)])
        sol = torch.linalg.lstsq(kkt, rhs.unsqueeze(1), driver="gelsd").solution.flatten()
        step = torch.zeros(n, dtype=torch.float64)
        step[free] = sol[:m]
        if float(step.abs().max()) <= tol:
            mu = float(grad[free].mean())  # the gradient is equal on the free set at the optimum
            multipliers = grad - mu
            multipliers[~fixed] = 0.0
            worst = int(torch.argmin(multipliers))
            if not fixed.any() or float(multipliers[worst]) >= -tol:  # relative to max|P| (P scaled)
                converged = True
                break
            fixed[worst] = False
            continue
        shrinking = (step < 0) & ~fixed
        length, blocking = 1.0, -1
        if shrinking.any():
            ratios = torch.full((n,), float("inf"), dtype=torch.float64)
            ratios[shrinking] = -a[shrinking] / step[shrinking]
            j = int(torch.argmin(ratios))
            if float(ratios[j]) < 1.0:
                length, blocking = float(ratios[j]), j
        a = a + length * step
        if blocking >= 0:
            a[blocking] = 0.0
            fixed[blocking] = True
        a = a.clamp(min=0)
        a = a / a.sum()
    return SimplexQPResult(a, float(a @ nearest_psd(original) @ a), iterations, converged)


def kkt_residual(p: torch.Tensor, a: torch.Tensor) -> float:
    """Largest violation of the KKT conditions at ``a``: ``(Pa)_j = λ`` where ``a_j > 0``,
    ``(Pa)_j >= λ`` elsewhere, with ``λ = a^T P a`` (the multiplier of ``sum a = 1``)."""
    grad = p.to(torch.float64) @ a.to(torch.float64)
    lam = float(a.to(torch.float64) @ grad)
    active = a > 1e-9
    equal = (grad[active] - lam).abs().max() if active.any() else torch.tensor(0.0)
    below = (lam - grad[~active]).clamp(min=0).max() if (~active).any() else torch.tensor(0.0)
    return float(max(equal, below))
