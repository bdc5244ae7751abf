"""Quadratic programs over the probability simplex: ``min_a a^T P a``, ``a >= 0``, ``sum a = 1``.

FedPAC's classifier-combination weights (Xu et al., ICLR 2023, eq. 9) solve
one such problem per client, with at most a few hundred variables. Solved in
float64 by accelerated projected gradient (FISTA with the exact Euclidean
projection onto the simplex of Duchi et al. 2008) after repairing ``P`` to the
nearest positive semidefinite matrix; no solver dependency is needed.
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


@dataclass
class SimplexQPResult:
    weights: torch.Tensor
    objective: float
    iterations: int
    converged: bool


def solve_simplex_qp(p: torch.Tensor, tol: float = 1e-12, max_iter: int = 20_000) -> SimplexQPResult:
    """Minimise ``a^T P a`` over the simplex (P repaired to PSD first)."""
    p = nearest_psd(p.to(torch.float64))
    n = p.shape[0]
    lipschitz = 2 * float(torch.linalg.eigvalsh(p).max().clamp(min=1e-12))
    a = torch.full((n,), 1.0 / n, dtype=torch.float64)
    y, t = a.clone(), 1.0
    converged = False
    iterations = 0
    while iterations < max_iter:
        iterations += 1
        a_next = project_to_simplex(y - (2 * p @ y) / lipschitz)
        t_next = (1 + (1 + 4 * t * t) ** 0.5) / 2
        y = a_next + ((t - 1) / t_next) * (a_next - a)
        step = float((a_next - a).abs().max())
        a, t = a_next, t_next
        if step < tol:
            converged = True
            break
    return SimplexQPResult(a, float(a @ p @ a), iterations, converged)


def kkt_residual(p: torch.Tensor, a: torch.Tensor) -> float:
    """Largest violation of the KKT conditions at ``a``: ``(Pa)_j = λ`` where ``a_j > 0``,
    ``(Pa)_j >= λ`` elsewhere, with ``λ = a^T P a`` (the multiplier of ``sum a = 1``)."""
    grad = p.to(torch.float64) @ a.to(torch.float64)
    lam = float(a.to(torch.float64) @ grad)
    active = a > 1e-9
    equal = (grad[active] - lam).abs().max() if active.any() else torch.tensor(0.0)
    below = (lam - grad[~active]).clamp(min=0).max() if (~active).any() else torch.tensor(0.0)
    return float(max(equal, below))
