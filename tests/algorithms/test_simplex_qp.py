"""FedPAC's simplex QP solver: closed forms, KKT optimality, brute force, indefinite input."""

from __future__ import annotations

import itertools
import re

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


# ------------------------------------------------------------------ the active-set path, tolerances and limits
def f64(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_iterates_of_the_active_set_method_by_hand():
    """diag(1, 2): start at vertex 0 (smallest diagonal); iteration 1 finds no step on {0} and frees
    coordinate 1 (multiplier -2); iteration 2 steps to the minimiser (2/3, 1/3) on {0, 1}; iteration 3
    finds no step and no fixed coordinate left: optimal (Nocedal & Wright, Alg. 16.3)."""
    p = torch.diag(f64([1.0, 2.0]))
    first = solve_simplex_qp(p, max_iter=1)
    assert first.weights.tolist() == [1.0, 0.0] and first.iterations == 1 and first.converged is False
    second = solve_simplex_qp(p, max_iter=2)
    assert torch.allclose(second.weights, f64([2 / 3, 1 / 3]), rtol=0, atol=1e-14)
    assert second.iterations == 2 and second.converged is False
    done = solve_simplex_qp(p)
    assert done.iterations == 3 and done.converged is True
    assert done.objective == pytest.approx(2 / 3, rel=1e-14)


def test_default_iteration_limit_is_1000():
    res = solve_simplex_qp(torch.diag(f64([1.0, 3.0])), tol=-1.0)  # a tolerance no step can meet
    assert res.iterations == 1000 and res.converged is False and res.weights.tolist() == [1.0, 0.0]


def test_tolerance_is_relative_to_the_largest_entry_of_p():
    d = f64([1.0, 2.0, 4.0])
    expected = (1 / d) / (1 / d).sum()
    for scale in (1e-12, 1.0, 1e6):
        res = solve_simplex_qp(scale * torch.diag(d))
        assert res.converged and torch.allclose(res.weights, expected, rtol=0, atol=1e-9), scale


def test_a_multiplier_of_exactly_minus_tol_times_scale_is_accepted():
    """diag(1, 1.5, 8) at its start vertex 0: the fixed coordinates' multipliers are -2 = -0.25 * max|P|."""
    p = torch.diag(f64([1.0, 1.5, 8.0]))
    loose = solve_simplex_qp(p, tol=0.25)
    assert loose.converged and loose.iterations == 1 and loose.weights.tolist() == [1.0, 0.0, 0.0]
    tighter = solve_simplex_qp(p, tol=0.2)  # -2 < -1.6: free coordinate 1, stop at the edge's minimiser
    assert tighter.converged and torch.allclose(tighter.weights, f64([0.6, 0.4, 0.0]), rtol=0, atol=1e-12)


def test_zero_matrix_with_zero_tolerance_stops_at_once():
    res = solve_simplex_qp(torch.zeros(3, 3, dtype=torch.float64), tol=0.0)  # the zero step is no step
    assert res.converged and res.iterations == 1 and res.weights.tolist() == [1.0, 0.0, 0.0]


def test_float32_input_is_solved_in_float64():
    res = solve_simplex_qp(torch.diag(torch.tensor([1.0, 2.0, 4.0])))
    assert res.weights.dtype == torch.float64
    assert torch.allclose(res.weights, f64([4 / 7, 2 / 7, 1 / 7]), rtol=0, atol=1e-12)


def test_symmetric_pair_splits_evenly():
    res = solve_simplex_qp(f64([[5.0, -3.0], [-3.0, 5.0]]))
    assert res.converged and torch.allclose(res.weights, f64([0.5, 0.5]), rtol=0, atol=1e-12)


def test_a_dyadic_problem_whose_steps_leave_some_free_weights_unchanged():
    p = f64([[1.4375, -0.8125, -0.875, -1.125, -0.125, -0.8125, 0.5625],
             [-0.8125, 0.6875, 0.125, 0.5625, 0.25, 0.75, -0.375],
             [-0.875, 0.125, 1.75, 1.0625, -0.125, -0.1875, -0.0625],
             [-1.125, 0.5625, 1.0625, 1.3125, 0.0, 0.5, -0.4375],
             [-0.125, 0.25, -0.125, 0.0, 0.625, 0.0, 0.375],
             [-0.8125, 0.75, -0.1875, 0.5, 0.0, 1.25, -0.8125],
             [0.5625, -0.375, -0.0625, -0.4375, 0.375, -0.8125, 1.0]])
    res = solve_simplex_qp(p)
    assert res.converged and torch.isfinite(res.weights).all() and kkt_residual(p, res.weights) < 1e-12
    assert abs(float(res.weights.sum()) - 1) < 1e-12 and float(res.weights.min()) >= 0


def test_authors_repair_boundaries_and_precision():
    from hetfl.algorithms.simplex_qp import drop_small_eigenvalues

    # an exactly zero eigenvalue is not negative: left alone (the code: all eigenvalues >= 0)
    psd = torch.diag(f64([2.0, 0.005, 0.0]))
    kept, changed = drop_small_eigenvalues(psd, 0.01)
    assert not changed and torch.equal(kept, psd)
    # an eigenvalue equal to the floor is kept (the code: evals >= 0.01)
    repaired, changed = drop_small_eigenvalues(torch.diag(f64([2.0, 0.01, -1.0])), 0.01)
    assert changed and torch.equal(repaired.abs(), torch.diag(f64([2.0, 0.01, 0.0])))
    # float32 input: computed and returned in float64
    q, _ = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    p64 = q @ torch.diag(f64([2.0, 0.3, -1.0])) @ q.T
    p64 = 0.5 * (p64 + p64.T)
    out, changed = drop_small_eigenvalues(p64.float(), 0.01)
    exact, _ = drop_small_eigenvalues(p64.float().double(), 0.01)
    assert changed and out.dtype == torch.float64 and torch.allclose(out, exact, rtol=0, atol=1e-13)
    same, changed = drop_small_eigenvalues(psd.float(), 0.01)
    assert not changed and same.dtype == torch.float64


def test_kkt_residual_by_hand():
    # diag(1, 4) at (3/4, 1/4): grad = (3/4, 1), lambda = 13/16: both active, off by 1/16 and 3/16
    assert kkt_residual(torch.diag(f64([1.0, 4.0])), f64([0.75, 0.25])) == pytest.approx(0.1875, rel=1e-14)
    # diag(1, 2) at vertex 1: lambda = 2 but coordinate 0's gradient is 0 < lambda
    assert kkt_residual(torch.diag(f64([1.0, 2.0])), f64([0.0, 1.0])) == pytest.approx(2.0, rel=1e-14)
    # no positive weight at all: only the inequality part, here satisfied
    assert kkt_residual(torch.diag(f64([1.0, 2.0])), torch.zeros(2, dtype=torch.float64)) == 0.0
    # weights up to 1e-9 (rounding noise) count as zero: their large gradient is no violation
    p = f64([[1.0, 6.0], [6.0, 40.0]])
    assert kkt_residual(p, f64([1 - 1e-9, 1e-9])) < 1e-7
    # float32 inputs are evaluated in float64
    p32, a32 = torch.diag(torch.tensor([1.0, 4.0])), torch.tensor([0.75, 0.25])
    assert kkt_residual(p32, a32) == pytest.approx(0.1875, rel=1e-14)


def test_projection_allocates_on_the_inputs_device_not_torchs_default():
    """As on a GPU, where the default device (the CPU) is not the input's: the default is switched to
    ``meta`` here, so a tensor made without the input's device lands apart from it."""
    v = f64([0.5, 0.4, -0.2])
    with torch.device("meta"):
        out = project_to_simplex(v)
    assert out.device.type == "cpu" and torch.allclose(out, f64([0.55, 0.45, 0.0]), rtol=0, atol=1e-15)


@pytest.mark.parametrize("scale", [1e-12, 1.0, 1e8, 1e12])
def test_the_solution_does_not_depend_on_the_scale_of_p(scale):
    """min a^T (s D) a over the simplex has a_i proportional to 1/d_i at any s > 0; FedPAC's P grows like
    |h|^2, so unnormalised features reach s = 1e8, where the unscaled KKT solve made LAPACK fail."""
    d = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    result = solve_simplex_qp(scale * torch.diag(d))
    assert result.converged
    assert torch.allclose(result.weights, torch.tensor([4 / 7, 2 / 7, 1 / 7], dtype=torch.float64), atol=1e-12)
    assert result.objective == pytest.approx(scale * 4 / 7, rel=1e-12)


def test_a_non_finite_matrix_is_an_error_not_a_lapack_crash():
    with pytest.raises(ValueError, match="non-finite"):
        solve_simplex_qp(torch.tensor([[1.0, float("nan")], [float("nan"), 1.0]]))


# ------------------------------------------- mutation testing (issue 15): steps, messages, reproducibility
def test_the_non_finite_error_message_names_the_function_and_the_matrix():
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError) as caught:
            solve_simplex_qp(f64([[1.0, bad], [bad, 1.0]]))
        assert str(caught.value) == "solve_simplex_qp: P has non-finite entries"


def test_a_zero_step_component_is_not_a_blocking_one():
    """diag(0, 1) at its start vertex 0: the gradient there is zero, so the KKT right-hand side and the
    step are exactly zero. Only coordinates with ``p_i < 0`` can block (N&W Alg. 16.3); a zero component
    must leave the iterate where it is (a ratio ``-a_i / 0`` would send it to infinity). ``tol=-1`` keeps
    the zero step from ending the iteration, so the step update itself runs."""
    res = solve_simplex_qp(torch.diag(f64([0.0, 1.0])), tol=-1.0, max_iter=3)
    assert res.weights.tolist() == [1.0, 0.0] and res.iterations == 3 and res.converged is False
    assert res.objective == 0.0


def test_a_singular_problem_whose_last_step_leaves_a_free_weight_unchanged():
    """P = [[5, 4, -7], [4, 5, -8], [-7, -8, 13]] has rank 2 and null vector (1, 4, 3): the only zero-cost
    point of the simplex is (1/8, 1/2, 3/8). By hand: vertex 0; free 2; step to the edge minimiser
    (5/8, 0, 3/8); free 1; step to (1/8, 1/2, 3/8), where weight 2 keeps its value (a zero step
    component); stop: 5 iterations."""
    p = f64([[5.0, 4.0, -7.0], [4.0, 5.0, -8.0], [-7.0, -8.0, 13.0]])
    assert torch.allclose(solve_simplex_qp(p, max_iter=2).weights, f64([5 / 8, 0.0, 3 / 8]), rtol=0, atol=1e-13)
    res = solve_simplex_qp(p)
    assert res.converged and res.iterations == 5
    assert torch.allclose(res.weights, f64([1 / 8, 1 / 2, 3 / 8]), rtol=0, atol=1e-13)
    assert abs(res.objective) < 1e-13


def test_a_full_step_that_more_than_halves_a_weight_is_not_overshot():
    """P = [[2, -3, -2], [-3, 11, 7], [-2, 7, 6]] by hand (N&W Alg. 16.3): vertex 0 (gradient (4, -6, -4),
    multipliers -10 and -8: free 1); step to the edge minimiser (14/19, 5/19, 0); gradient 2 (13, 13, 7) / 19:
    free 2; step to (11/16, 1/8, 3/16), where P a = (5/8) 1. Weight 1 falls from 5/19 to 1/8, more than half
    way to zero but not past it (blocking ratio 40/21 > 1): a full step, no bound hit; stop at iteration 5."""
    p = f64([[2.0, -3.0, -2.0], [-3.0, 11.0, 7.0], [-2.0, 7.0, 6.0]])
    edge = solve_simplex_qp(p, max_iter=2).weights
    assert torch.allclose(edge, f64([14 / 19, 5 / 19, 0.0]), rtol=0, atol=1e-13)
    face = solve_simplex_qp(p, max_iter=4).weights
    assert torch.allclose(face, f64([11 / 16, 1 / 8, 3 / 16]), rtol=0, atol=1e-13)
    res = solve_simplex_qp(p)
    assert res.converged and res.iterations == 5 and torch.allclose(res.weights, face, rtol=0, atol=0)
    assert res.objective == pytest.approx(5 / 8, rel=1e-13)


def test_forty_variables_stay_on_the_simplex_through_many_steps():
    """diag(1, ..., 40): every coordinate enters the support, one per free-then-step pair (2 n - 1 = 79
    iterations); the weights must stay normalised through the 39 steps (a_i proportional to 1 / d_i)."""
    d = torch.arange(1, 41, dtype=torch.float64)
    res = solve_simplex_qp(torch.diag(d))
    assert res.converged and res.iterations == 79
    assert abs(float(res.weights.sum()) - 1) < 1e-13
    assert torch.allclose(res.weights, (1 / d) / (1 / d).sum(), rtol=0, atol=1e-13)
    assert res.objective == pytest.approx(float(1 / (1 / d).sum()), rel=1e-12)


def test_the_solver_is_bitwise_reproducible():
    """The same P gives bitwise the same weights and path on every call (the project's determinism rule:
    FedPAC's combination weights feed the next round). The SVD-based least-squares driver is; others
    (MKL's pivoted-QR gelsy) return last-bit different steps from call to call on problems like this."""
    p = f64([[13, -6, 3, -1, 6, -6], [-6, 16, 0, -8, 0, 0], [3, 0, 2, -1, -1, 1],
             [-1, -8, -1, 6, -2, 3], [6, 0, -1, -2, 10, -9], [-6, 0, 1, 3, -9, 10]])
    first = solve_simplex_qp(p)
    assert first.converged and kkt_residual(p, first.weights) < 1e-12
    for _ in range(20):
        again = solve_simplex_qp(p)
        assert torch.equal(again.weights, first.weights) and again.iterations == first.iterations


@pytest.mark.parametrize("shape", [(1, 3), (3,), (2, 3), (0, 0), (2, 2, 2)])
def test_a_matrix_that_is_not_square_is_refused_with_its_shape(shape):
    """(1, n) used to broadcast to n x n inside the PSD repair and return a 'solution'."""
    with pytest.raises(ValueError, match=r"square matrix, got shape " + re.escape(str(shape))):
        solve_simplex_qp(torch.ones(shape, dtype=torch.float64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_matrix_is_solved_on_the_cpu():
    """FedPAC's P may live on the GPU; the solver's least-squares driver (gelsd) exists only on the CPU."""
    p = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
    on_cpu = solve_simplex_qp(p)
    on_gpu = solve_simplex_qp(p.cuda())
    assert on_gpu.weights.device.type == "cpu" and torch.equal(on_gpu.weights, on_cpu.weights)
