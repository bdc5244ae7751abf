"""hetfl.analysis.swd: directions, quadrature, checks and closed forms (mutation audit, session 38)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from hetfl.analysis.swd import (
    GaussianMixture,
    _wpp,
    projected_quantiles,
    quantile_grid,
    random_directions,
    sliced_wasserstein,
    sliced_wasserstein_matrix,
)


def test_random_directions_are_unit_vectors_from_the_seed_or_the_generator():
    theta = random_directions(50, 3, seed=4)
    assert theta.shape == (50, 3) and theta.dtype == torch.float64
    torch.testing.assert_close(torch.linalg.vector_norm(theta, dim=1), torch.ones(50, dtype=torch.float64))
    torch.testing.assert_close(random_directions(50, 3, generator=torch.Generator().manual_seed(4)), theta)
    assert not torch.equal(random_directions(50, 3, seed=5), theta)


def test_orthogonal_directions_come_in_orthonormal_blocks():
    theta = random_directions(7, 3, seed=1, orthogonal=True)
    assert theta.shape == (7, 3) and theta.dtype == torch.float64
    for block in (theta[0:3], theta[3:6]):
        torch.testing.assert_close(block @ block.T, torch.eye(3, dtype=torch.float64))
    assert not torch.allclose(theta[0:3], theta[3:6])
    # uniform on the sphere: the signs of the first coordinate over many blocks are balanced
    many = random_directions(3000, 3, seed=2, orthogonal=True)
    assert abs(float((many[:, 0] > 0).double().mean()) - 0.5) < 0.05
    assert abs(float((many[:, 2] > 0).double().mean()) - 0.5) < 0.05


@pytest.mark.parametrize(("num", "dim"), [(0, 2), (2, 0)])
def test_random_directions_refuse_empty_shapes(num, dim):
    with pytest.raises(ValueError, match=rf"need num >= 1 and dim >= 1, got {num}, {dim}"):
        random_directions(num, dim)


def test_quantile_grid_is_the_trapezoid_rule_in_z():
    z, w = quantile_grid(5, 2.0)
    assert z.tolist() == [-2.0, -1.0, 0.0, 1.0, 2.0] and z.dtype == torch.float64
    raw = np.exp(-0.5 * np.array([4.0, 1.0, 0.0, 1.0, 4.0])) * np.array([0.5, 1, 1, 1, 0.5])
    np.testing.assert_allclose(w.numpy(), raw / raw.sum(), rtol=1e-14)
    z, w = quantile_grid()
    assert z.shape == (401,) and z[0] == -8.0 and z[-1] == 8.0 and float(w.sum()) == pytest.approx(1.0, abs=1e-15)
    # integrates the moments of the standard normal: E z^2 = 1
    assert float((w * z * z).sum()) == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize(("size", "z_max"), [(2, 8.0), (5, 0.0), (5, -1.0)])
def test_quantile_grid_refuses_a_degenerate_grid(size, z_max):
    with pytest.raises(ValueError, match=r"need grid_size >= 3 and z_max > 0"):
        quantile_grid(size, z_max)


def test_wpp_by_hand():
    qa = torch.tensor([[0.0, 1.0, 3.0]], dtype=torch.float64)
    qb = torch.tensor([[1.0, 1.0, 1.0]], dtype=torch.float64)
    w = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)
    assert _wpp(qa, qb, w, 1.0).tolist() == [0.25 + 1.0]
    assert _wpp(qa, qb, w, 2.0).tolist() == [0.25 + 2.0]
    assert _wpp(qa, qb, w, 3.0).tolist() == [0.25 + 4.0]


def test_projected_quantiles_of_a_two_component_mixture_match_scipy():
    mix = GaussianMixture(torch.tensor([1.0, 3.0]), torch.tensor([[-2.0], [1.0]]), torch.tensor([[[0.25]], [[4.0]]]))
    z = torch.tensor([-3.0, -1.0, -0.2, 0.0, 0.4, 2.5], dtype=torch.float64)
    q = projected_quantiles(mix, torch.tensor([[1.0], [-1.0]], dtype=torch.float64), z)[0].numpy()
    cdf = 0.25 * stats.norm.cdf(q, -2.0, 0.5) + 0.75 * stats.norm.cdf(q, 1.0, 2.0)
    np.testing.assert_allclose(cdf, stats.norm.cdf(z.numpy()), rtol=1e-10)
    q_neg = projected_quantiles(mix, torch.tensor([[-1.0]], dtype=torch.float64), z)[0].numpy()
    cdf_neg = 0.25 * stats.norm.cdf(q_neg, 2.0, 0.5) + 0.75 * stats.norm.cdf(q_neg, -1.0, 2.0)
    np.testing.assert_allclose(cdf_neg, stats.norm.cdf(z.numpy()), rtol=1e-10)


def test_projected_quantiles_refuse_directions_of_the_wrong_dimension():
    mix = GaussianMixture.gaussian(torch.zeros(2), torch.eye(2))
    with pytest.raises(ValueError, match=r"directions must be \[P, 2\], got \(3, 3\)"):
        projected_quantiles(mix, torch.ones(3, 3), torch.zeros(3))


def test_a_point_mass_has_its_point_as_every_quantile():
    mix = GaussianMixture.gaussian(torch.tensor([3.0, -1.0]), torch.zeros(2, 2))
    q = projected_quantiles(mix, torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([-2.0, 0.0, 2.0]))
    torch.testing.assert_close(q, torch.tensor([[3.0] * 3, [-1.0] * 3], dtype=torch.float64), rtol=0, atol=1e-9)


def test_swd_of_gaussians_differing_in_scale_is_the_closed_form():
    # 1-D N(0, 1) against N(0, 4): the quantiles differ by z, so W_2^2 = E z^2 = 1 and W_1 = E|z| = sqrt(2 / pi)
    a = GaussianMixture.gaussian(torch.zeros(1), torch.eye(1))
    b = GaussianMixture.gaussian(torch.zeros(1), 4 * torch.eye(1))
    assert sliced_wasserstein(a, b, num_projections=3) == pytest.approx(1.0, rel=1e-8)
    assert sliced_wasserstein(a, b, p=1, num_projections=3) == pytest.approx(math.sqrt(2 / math.pi), rel=1e-3)
    assert sliced_wasserstein(a, b, p=3, num_projections=3) == pytest.approx((2 * math.sqrt(2 / math.pi)) ** (1 / 3),
                                                                             rel=1e-4)  # E|z|^3 = 2 sqrt(2/pi)
    # (the trapezoid rule meets |z|'s kink at 0: W_1 within 2e-4)


def test_the_matrix_refuses_what_it_cannot_compare():
    one = GaussianMixture.gaussian(torch.zeros(2), torch.eye(2))
    with pytest.raises(ValueError, match="no mixtures given"):
        sliced_wasserstein_matrix([])
    with pytest.raises(ValueError, match=r"p must be >= 1, got 0.5"):
        sliced_wasserstein_matrix([one, one], p=0.5)
    assert sliced_wasserstein_matrix([one, one], p=1.0, num_projections=2).shape == (2, 2)
    with pytest.raises(ValueError, match=r"mixtures differ in dimension: \[2, 3\]"):
        sliced_wasserstein_matrix([one, GaussianMixture.gaussian(torch.zeros(3), torch.eye(3))])


def test_mixture_checks_and_normalises():
    mix = GaussianMixture(torch.tensor([2.0, 0.0, 6.0]), torch.tensor([[0.0], [1.0], [2.0]]), torch.ones(3, 1, 1))
    assert mix.weights.tolist() == [0.25, 0.75] and mix.means.tolist() == [[0.0], [2.0]] and mix.dim == 1
    assert mix.covs.shape == (2, 1, 1) and mix.weights.dtype == torch.float64
    with pytest.raises(ValueError, match=r"means must be \[K, d\] and covs \[K, d, d\]"):
        GaussianMixture(torch.ones(1), torch.zeros(1, 2), torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match=r"2 weights for 1 components"):
        GaussianMixture(torch.ones(2), torch.zeros(1, 2), torch.zeros(1, 2, 2))
    for bad in ([-1.0, 2.0], [0.0, 0.0], [math.inf, 1.0]):
        with pytest.raises(ValueError, match="weights must be finite, nonnegative and not all zero"):
            GaussianMixture(torch.tensor(bad), torch.zeros(2, 1), torch.ones(2, 1, 1))
    with pytest.raises(ValueError, match="means and covariances must be finite"):
        GaussianMixture(torch.ones(1), torch.tensor([[math.nan]]), torch.ones(1, 1, 1))
    with pytest.raises(ValueError, match="means and covariances must be finite"):
        GaussianMixture(torch.ones(1), torch.zeros(1, 1), torch.full((1, 1, 1), math.inf))


def test_mixture_from_features_adds_eps_and_checks_labels():
    feats = torch.tensor([[0.0, 0.0], [2.0, 0.0], [1.0, 1.0]])
    mix = GaussianMixture.from_features(feats, torch.tensor([0, 0, 2]), eps=0.5)
    assert mix.weights.tolist() == pytest.approx([2 / 3, 1 / 3])
    torch.testing.assert_close(mix.covs[0], torch.tensor([[2.5, 0.0], [0.0, 0.5]], dtype=torch.float64))
    torch.testing.assert_close(mix.covs[1], 0.5 * torch.eye(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"labels must be nonempty and in \[0, 2\)"):
        GaussianMixture.from_features(feats, torch.tensor([0, 0, 2]), 2)
    with pytest.raises(ValueError, match=r"labels must be nonempty and in \[0, 3\)"):
        GaussianMixture.from_features(feats, torch.tensor([0, -1, 2]), 3)
    with pytest.raises(ValueError, match=r"features must be \[n, d\] with labels \[n\]"):
        GaussianMixture.from_features(feats, torch.tensor([0, 1]))


def _mixture(seed: int, components: int, dim: int = 2) -> GaussianMixture:
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(components, dim, generator=g, dtype=torch.float64) + 0.1
    return GaussianMixture(torch.rand(components, generator=g, dtype=torch.float64) + 0.1,
                           torch.randn(components, dim, generator=g, dtype=torch.float64), torch.diag_embed(scale))


def test_directions_in_several_chunks_give_the_one_chunk_matrix(monkeypatch):
    """Large mixtures' matrices are computed in chunks of directions (memory: at most 2e6 quantiles of one
    mixture's components at once): 25 components on the default grid make chunks of 199 directions. The
    distances of every chunk add up to the one-chunk result (here chunks of 5 of 16 directions: 5, 5, 5, 1)."""
    from hetfl.analysis import swd

    assert [swd._chunks(256, 25, 401), swd._chunks(256, 2, 401), swd._chunks(3, 10**7, 401)] == [199, 256, 1]
    mixtures = [_mixture(s, 2) for s in range(3)]
    whole = sliced_wasserstein_matrix(mixtures, num_projections=16, grid_size=41)
    monkeypatch.setattr(swd, "_chunks", lambda num, mix_size, grid_size: 5)
    torch.testing.assert_close(sliced_wasserstein_matrix(mixtures, num_projections=16, grid_size=41), whole,
                               rtol=1e-12, atol=0)


def test_every_pair_of_the_matrix_is_its_own_distance_and_one_mixture_is_zero():
    mixtures = [_mixture(s, 2) for s in range(3)]
    mat = sliced_wasserstein_matrix(mixtures, num_projections=16, grid_size=41)
    for i in range(3):
        for j in range(3):
            expected = 0.0 if i == j else sliced_wasserstein(mixtures[i], mixtures[j], num_projections=16, grid_size=41)
            assert float(mat[i, j]) == pytest.approx(expected, rel=1e-12, abs=0)
    assert sliced_wasserstein_matrix(mixtures[:1]).tolist() == [[0.0]]
    with pytest.raises(ValueError, match="^no mixtures given$"):
        sliced_wasserstein_matrix([])


def test_the_defaults_are_256_directions_from_seed_0_on_the_401_point_grid_to_8():
    a, b = _mixture(0, 2), _mixture(1, 3)
    kwargs = {"p": 2.0, "num_projections": 256, "seed": 0, "orthogonal": False, "grid_size": 401, "z_max": 8.0}
    assert sliced_wasserstein(a, b) == sliced_wasserstein(a, b, **kwargs)
    assert torch.equal(sliced_wasserstein_matrix([a, b]), sliced_wasserstein_matrix([a, b], **kwargs))
    assert torch.equal(random_directions(5, 3), random_directions(5, 3, seed=0, orthogonal=False))
    # the quadrature's settings reach the matrix: a coarse or narrow grid gives another number
    for other in ({"grid_size": 5}, {"z_max": 1.0}):
        assert sliced_wasserstein(a, b, **{**kwargs, **other}) == float(sliced_wasserstein_matrix([a, b], **{
            **kwargs, **other})[0, 1]) != sliced_wasserstein(a, b)


def test_the_smallest_accepted_shapes():
    assert random_directions(1, 3).shape == (1, 3)
    assert quantile_grid(3, 0.5)[0].tolist() == [-0.5, 0.0, 0.5]


def test_orthogonal_directions_are_drawn_from_the_generator_given():
    """``orthogonal=True`` draws its rotations from the generator (or the seed) too: the same seed, the same
    directions, whatever the global random state; each block is a rotation (orthonormal rows)."""
    torch.manual_seed(1)
    a = random_directions(5, 3, seed=4, orthogonal=True)
    torch.manual_seed(2)
    b = random_directions(5, 3, generator=torch.Generator().manual_seed(4), orthogonal=True)
    assert torch.equal(a, b) and a.shape == (5, 3)
    torch.testing.assert_close(a[:3] @ a[:3].T, torch.eye(3, dtype=torch.float64))
    assert not torch.equal(a, random_directions(5, 3, seed=5, orthogonal=True))
