"""FedPAC's simplex QP solver: closed forms, KKT optimality, brute force, indefinite input."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetfl.algorithms.simplex_qp import kkt_residual, project_to_simplex, solve_simplex_qp


def test_projection_onto_simplex():
    assert torch.allclose(project_to_simplex(torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)),
                          torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64))
    assert project_to_simplex(torch.tensor([5.0, 0.0, -1.0])).tolist() == [1.0, 0.0, 0.0]
    out = project_to_simplex(torch.tensor([0.5, 0.5, 0.5]))
    assert torch.allclose(out, torch.full((3,), 1 / 3))


def test_diagonal_closed_form():
    d = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    res = solve_simplex_qp(torch.diag(d))
    expected = (1 / d) / (1 / d).sum()  # minimiser of sum d_j a_j^2 on the simplex
    assert torch.allclose(res.weights, expected, atol=1e-8) and res.converged


def test_rank_one_with_a_free_direction_puts_weight_where_cost_is_zero():
    p = torch.diag(torch.tensor([3.0, 0.0, 5.0], dtype=torch.float64))
    assert torch.allclose(solve_simplex_qp(p).weights, torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64), atol=1e-9)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 8))
def test_kkt_conditions_hold(seed, n):
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(n, n, generator=gen, dtype=torch.float64)
    p = m @ m.T + 0.01 * torch.eye(n, dtype=torch.float64)
    res = solve_simplex_qp(p)
    assert abs(float(res.weights.sum()) - 1) < 1e-12 and float(res.weights.min()) >= 0
    assert kkt_residual(p, res.weights) < 1e-6


@pytest.mark.parametrize("seed", range(5))
def test_agrees_with_brute_force_on_a_grid(seed):
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(3, 3, generator=gen, dtype=torch.float64)
    p = m @ m.T
    res = solve_simplex_qp(p)
    steps = 200
    best = min(
        float(a @ p @ a)
        for i, j in itertools.product(range(steps + 1), repeat=2) if i + j <= steps
        for a in [torch.tensor([i / steps, j / steps, (steps - i - j) / steps], dtype=torch.float64)]
    )
    assert res.objective <= best + 1e-12
    assert res.objective >= best - 1e-3  # the grid is within its spacing of the optimum


@pytest.mark.parametrize("n", [5, 20, 60])
def test_ill_conditioned_fedpac_like_problems_are_solved_exactly(n):
    gen = torch.Generator().manual_seed(n)
    h = torch.randn(n, 500, generator=gen, dtype=torch.float64) * 0.1
    for i in range(3):
        diff = h[i] - h
        p = torch.diag(torch.rand(n, generator=gen, dtype=torch.float64) * 1e-4) + diff @ diff.T
        res = solve_simplex_qp(p)
        assert res.converged and kkt_residual(p, res.weights) < 1e-9 * float(p.abs().max())
        assert res.weights[i] < 1.0  # trading a little bias for the others' variance always pays here


def test_indefinite_matrix_is_repaired_not_fatal():
    p = torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=torch.float64)  # eigenvalues 3 and -1
    res = solve_simplex_qp(p)
    assert torch.isfinite(res.weights).all() and abs(float(res.weights.sum()) - 1) < 1e-12


def test_authors_repair_drops_small_eigenvalues_only_when_indefinite():
    from hetfl.algorithms.simplex_qp import drop_small_eigenvalues

    q, _ = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    indefinite = q @ torch.diag(torch.tensor([2.0, 0.005, -1.0], dtype=torch.float64)) @ q.T
    repaired, changed = drop_small_eigenvalues(indefinite, 0.01)  # 0.005 < 0.01 goes too, as in the code
    assert changed and torch.allclose(repaired, 2.0 * q[:, :1] @ q[:, :1].T, atol=1e-12)
    psd = q @ torch.diag(torch.tensor([2.0, 0.005, 0.0], dtype=torch.float64)) @ q.T
    psd = 0.5 * (psd + psd.T)
    kept, changed = drop_small_eigenvalues(psd + 1e-9 * torch.eye(3, dtype=torch.float64), 0.01)
    assert not changed and torch.allclose(kept, psd + 1e-9 * torch.eye(3, dtype=torch.float64))
