"""CCVR's statistics: pooled client statistics equal those of all features pooled (eq. 3-4), and the additive
moments (count, sum, sum of outer products) summed over clients give the same Gaussians."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetfl.algorithms.gaussian_stats import (
    ClassMoments,
    class_moments,
    class_statistics,
    gaussian_factor,
    pool_statistics,
    sample_gaussian,
    stats_from_moments,
    sum_moments,
)

F64 = torch.float64
EPS = torch.finfo(F64).eps


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), clients=st.integers(1, 6), d=st.integers(1, 5))
def test_pooled_statistics_equal_statistics_of_concatenated_features(seed, clients, d):
    gen = torch.Generator().manual_seed(seed)
    num_classes = 3
    n = int(torch.randint(2, 40, (1,), generator=gen))
    z = torch.randn(n, d, generator=gen, dtype=torch.float64) * 3 + 1
    y = torch.randint(0, num_classes, (n,), generator=gen)
    owner = torch.randint(0, clients, (n,), generator=gen)  # random split: some clients get 0 or 1 of a class
    stats = [class_statistics(z[owner == k], y[owner == k], num_classes) for k in range(clients)]
    pooled = pool_statistics(stats)
    for c in range(num_classes):
        zc = z[y == c]
        assert pooled.counts[c] == len(zc)
        if len(zc) >= 1:
            torch.testing.assert_close(pooled.means[c], zc.mean(0), rtol=1e-10, atol=1e-10)
        if len(zc) >= 2:
            torch.testing.assert_close(pooled.covs[c], torch.cov(zc.T, correction=1).reshape(d, d),
                                       rtol=1e-9, atol=1e-9)
        else:
            assert torch.count_nonzero(pooled.covs[c]) == 0


def test_client_statistics_single_and_missing_classes():
    z = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 8.0]])
    y = torch.tensor([0, 0, 1])
    s = class_statistics(z, y, 3)
    assert s.counts.tolist() == [2, 1, 0]
    torch.testing.assert_close(s.means[0], torch.tensor([2.0, 3.0], dtype=torch.float64))
    torch.testing.assert_close(s.covs[0], torch.tensor([[2.0, 2.0], [2.0, 2.0]], dtype=torch.float64))  # ddof 1
    assert torch.count_nonzero(s.covs[1]) == 0 and torch.count_nonzero(s.means[2]) == 0
    assert s.num_floats == 2 * (1 + 2 + 3)


def test_sampling_is_robust_to_singular_covariances():
    v = torch.tensor([[1.0], [2.0], [0.0]], dtype=torch.float64)
    cov = v @ v.T  # rank 1
    factor = gaussian_factor(cov)
    torch.testing.assert_close(factor @ factor.T, cov, rtol=1e-9, atol=1e-9)
    draws = sample_gaussian(torch.tensor([1.0, -1.0, 0.5]), cov, 20_000, torch.Generator().manual_seed(0))
    assert torch.allclose(draws[:, 2], torch.tensor(0.5, dtype=torch.float64))  # no variance along that axis
    torch.testing.assert_close(torch.cov(draws.T), cov, rtol=0.05, atol=0.05)
    zero = sample_gaussian(torch.zeros(3), torch.zeros(3, 3), 5, torch.Generator().manual_seed(0))
    assert torch.count_nonzero(zero) == 0


def test_statistics_of_a_large_client_need_memory_per_class_not_per_sample():
    """20,000 samples of 512-d features (a large MNIST client under cnn2): a batch of per-sample
    outer products would be 42 GB; per-class products need 10 x 2 MB. Checked against
    ``torch.cov`` for each class."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(20_000, 512, generator=gen)
    y = torch.randint(0, 10, (20_000,), generator=gen)
    stats = class_statistics(z, y, 10)
    for c in (0, 9):
        want = torch.cov(z[y == c].double().T)
        assert torch.allclose(stats.covs[c], want, atol=1e-10)


def test_statistics_stay_on_the_features_device_whatever_torchs_default_device():
    """With another default device (a user's ``torch.set_default_device("cuda")``; here "meta", which needs no
    GPU) the statistics of CPU features are computed on the CPU, with the same values."""
    z = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 8.0]])
    y = torch.tensor([0, 0, 1])
    with torch.device("meta"):
        s = class_statistics(z, y, 3)
    assert {s.counts.device.type, s.means.device.type, s.covs.device.type} == {"cpu"}
    torch.testing.assert_close(s.means, torch.tensor([[2.0, 3.0], [5.0, 8.0], [0.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(s.covs[0], torch.tensor([[2.0, 2.0], [2.0, 2.0]], dtype=torch.float64))
    assert s.counts.dtype == torch.float64  # counts are uploaded and pooled as float64, never int64


def test_moments_stay_on_the_features_device_whatever_torchs_default_device():
    """As the statistics: with another default device ("meta" standing in for a user's CUDA default), the
    moments of CPU features are computed on the CPU, with the same values."""
    z = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 8.0]])
    y = torch.tensor([0, 0, 1])
    with torch.device("meta"):
        m = class_moments(z, y, 3)
    assert {m.counts.device.type, m.sums.device.type, m.outer.device.type} == {"cpu"}
    torch.testing.assert_close(m.sums, torch.tensor([[4.0, 6.0], [5.0, 8.0], [0.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(m.outer[0], torch.tensor([[10.0, 14.0], [14.0, 20.0]], dtype=torch.float64))


def test_pooled_covariance_is_exactly_symmetric():
    """Pooling sums products in different orders above and below the diagonal; the result is symmetrised, so
    ``eigh`` (which reads one triangle) and any consumer see one symmetric matrix."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(300, 30, generator=gen, dtype=torch.float64) * 3 + 1
    y = torch.randint(0, 2, (300,), generator=gen)
    owner = torch.randint(0, 3, (300,), generator=gen)
    pooled = pool_statistics([class_statistics(z[owner == k], y[owner == k], 2) for k in range(3)])
    for c in range(2):
        assert torch.equal(pooled.covs[c], pooled.covs[c].T)
        torch.testing.assert_close(pooled.covs[c], torch.cov(z[y == c].T), rtol=1e-9, atol=1e-9)


def test_gaussian_factor_of_a_covariance_with_eigenvalues_below_one():
    """Small but real variances (eigenvalues 0.25, 0.09, 1e-3) are kept as they are: ``L L^T = cov``."""
    rotation, _ = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    cov = rotation @ torch.diag(torch.tensor([0.25, 0.09, 1e-3], dtype=torch.float64)) @ rotation.T
    factor = gaussian_factor(cov)
    torch.testing.assert_close(factor @ factor.T, cov, rtol=1e-12, atol=1e-14)


def test_gaussian_factor_drops_eigenvalues_up_to_eps_times_the_largest():
    """Eigenvalues ``<= eps * max |lambda|`` are rounding noise of a singular covariance and get no variance:
    relative to the largest eigenvalue, not absolute (diag(4, 1, 0.5), eps 0.25: threshold 1; default eps 1e-8
    on diag(1e4, 1e-5): threshold 1e-4)."""
    factor = gaussian_factor(torch.diag(torch.tensor([4.0, 1.0, 0.5], dtype=torch.float64)), eps=0.25)
    torch.testing.assert_close(factor @ factor.T, torch.diag(torch.tensor([4.0, 0.0, 0.0], dtype=torch.float64)))
    factor = gaussian_factor(torch.diag(torch.tensor([1e4, 1e-5], dtype=torch.float64)))
    torch.testing.assert_close(factor @ factor.T, torch.diag(torch.tensor([1e4, 0.0], dtype=torch.float64)),
                               rtol=0, atol=1e-12)


def test_sample_gaussian_is_the_mean_plus_the_factor_times_the_streams_normals():
    """The draws, from the given generator: ``mean + L z`` with ``z ~ N(0, I)`` (num x d, float64) from that
    stream and ``L`` = ``gaussian_factor(cov)``; a float32 mean gives float64 draws."""
    mean = torch.tensor([1.0, -2.0, 0.5])
    a = torch.randn(3, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    cov = a @ a.T
    draws = sample_gaussian(mean, cov, 6, torch.Generator().manual_seed(3))
    noise = torch.randn(6, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert draws.dtype == torch.float64
    torch.testing.assert_close(draws, mean.double() + noise @ gaussian_factor(cov).T, rtol=1e-14, atol=1e-14)


# ---------------------------------------------------------------- additive moments
def test_class_moments_by_hand():
    """Class 0 holds (1, 2), (3, 4): sum (4, 6), sum of z z^T [[1 + 9, 2 + 12], [2 + 12, 4 + 16]]; class 1 holds
    (5, 8) alone; class 2 nothing. Raw (uncentred) products, the sum in ``sums`` and the products in ``outer``."""
    m = class_moments(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 8.0]]), torch.tensor([0, 0, 1]), 3)
    assert m.counts.dtype == m.sums.dtype == m.outer.dtype == F64
    assert m.counts.tolist() == [2.0, 1.0, 0.0]
    assert m.sums.tolist() == [[4.0, 6.0], [5.0, 8.0], [0.0, 0.0]]
    assert m.outer.tolist() == [[[10.0, 14.0], [14.0, 20.0]], [[25.0, 40.0], [40.0, 64.0]], [[0.0, 0.0], [0.0, 0.0]]]
    assert m.num_floats == 2 * (1 + 2 + 3)  # what a client holding 2 classes needs to send (upper triangle)


def test_statistics_from_moments_by_hand():
    """From the moments above: mu_0 = (2, 3), S_0 = (Q - 2 mu mu^T) / (2 - 1) = [[10 - 8, 14 - 12], [14 - 12,
    20 - 18]] = [[2, 2], [2, 2]] (ddof 1: dividing by n would give [[1, 1], [1, 1]]); one sample: its value as mean,
    zero covariance; no sample: zero mean and covariance. The same as ``class_statistics`` (eq. 2)."""
    z, y = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 8.0]]), torch.tensor([0, 0, 1])
    s = stats_from_moments(class_moments(z, y, 3))
    assert s.counts.tolist() == [2.0, 1.0, 0.0]
    assert s.means.tolist() == [[2.0, 3.0], [5.0, 8.0], [0.0, 0.0]]
    assert s.covs.tolist() == [[[2.0, 2.0], [2.0, 2.0]], [[0.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]]
    want = class_statistics(z, y, 3)
    for got, ref in ((s.counts, want.counts), (s.means, want.means), (s.covs, want.covs)):
        assert torch.equal(got, ref)


def test_statistics_from_moments_of_empty_and_single_classes_whatever_the_sums():
    """n = 0 gives a zero mean and n < 2 a zero covariance from the counts alone, not because the sums happen to
    be zero (noise added to summed moments for differential privacy leaves non-zero sums there)."""
    m = ClassMoments(torch.tensor([0.0, 1.0, 3.0], dtype=F64), torch.tensor([[0.5], [2.0], [3.0]], dtype=F64),
                     torch.tensor([[[0.7]], [[9.0]], [[5.0]]], dtype=F64))
    s = stats_from_moments(m)
    assert s.means.tolist() == [[0.0], [2.0], [1.0]]
    assert s.covs.tolist() == [[[0.0]], [[0.0]], [[(5.0 - 3.0 * 1.0) / 2.0]]]


def test_statistics_from_moments_are_symmetric_whatever_the_outer_products():
    """Summed outer products need not be exactly symmetric (noise added to every entry of the full d x d matrix
    for differential privacy, a GPU product): the covariance is the symmetric part, ``eigh`` reads one triangle."""
    outer = torch.tensor([[[4.0, 1.0], [3.0, 6.0]]], dtype=F64)
    s = stats_from_moments(ClassMoments(torch.tensor([3.0], dtype=F64), torch.zeros(1, 2, dtype=F64), outer))
    assert s.covs[0].tolist() == [[2.0, 1.0], [1.0, 3.0]]  # (Q + Q^T) / 2 / (3 - 1), mean zero


def test_sum_of_moments_is_the_plain_sum_of_every_client():
    """Three clients with distinct powers of two as counts, sums and products: every client's share is visible
    in the sum (a client left out, or counted twice, changes it)."""
    clients = [ClassMoments(torch.tensor([2.0**k, 0.0], dtype=F64), torch.full((2, 1), 8.0**k, dtype=F64),
                            torch.full((2, 1, 1), 64.0**k, dtype=F64)) for k in range(3)]
    total = sum_moments(clients)
    assert total.counts.tolist() == [7.0, 0.0]
    assert total.sums.flatten().tolist() == [73.0, 73.0]
    assert total.outer.flatten().tolist() == [4161.0, 4161.0]


def _clients(seed: int, clients: int, d: int, sizes: list[int]):
    """Class c has ``sizes[c]`` samples in all (0, 1, 2 ... included), each at a random client (so clients miss
    classes or hold one sample of them); float32 features with per-class offsets and per-coordinate spreads."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(len(sizes)).repeat_interleave(torch.tensor(sizes, dtype=torch.long))
    offset = 5 * torch.randn(len(sizes), d, generator=gen, dtype=F64)
    spread = 3 * (torch.rand(d, generator=gen, dtype=F64) + 0.1)
    z = (torch.randn(len(y), d, generator=gen, dtype=F64) * spread + offset[y]).float()
    owner = torch.randint(0, clients, (len(y),), generator=gen)
    return z, y, [(z[owner == k], y[owner == k]) for k in range(clients)]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), clients=st.integers(1, 5), d=st.integers(1, 6),
       sizes=st.lists(st.sampled_from([0, 1, 2, 3, 17, 40]), min_size=4, max_size=4))
def test_moments_summed_over_clients_equal_eq_2_to_4_and_the_stacked_features(seed, clients, d, sizes):
    """Three ways to the same Gaussians: the clients' moments summed (the additive upload), the clients'
    (count, mean, covariance) pooled by eq. 3-4, and the mean and unbiased covariance of all features stacked.

    Tolerance: float64 rounding, in units of ``eps`` times the size of what is summed: ``sum_l ||z_l||_inf`` and
    ``sum_l ||z_l||_inf^2`` over the class's samples for the sums and outer products (summed per client or all
    at once: another order of the same terms), ``max_l ||z_l||_inf^2`` for covariances (those sums divided by
    n - 1) and ``max_l ||z_l||_inf`` for means. Measured over 2 x 15,000 random draws of this test's inputs: up to
    3.4 units for the outer products, 2.2 for covariances (from moments or eq. 3-4, against ``torch.cov`` and
    against a two-pass extended-precision reference), 0.8 for means, 0 for the sums. Allowed: 8 units (the
    worst-case bound of a sum of n terms is ~n units, 40 here). Every mutation
    of the formula (no ``n mu mu^T``, n for n - 1, centred products, a client left out) is off by a fraction
    of the covariance itself, 1e12 units and more."""
    num_classes = len(sizes)
    z, y, parts = _clients(seed, clients, d, sizes)
    per_client = [class_moments(f, lab, num_classes) for f, lab in parts]
    summed = sum_moments(per_client)
    stacked = class_moments(z, y, num_classes)  # additivity: the moments of everything
    mom = stats_from_moments(summed)
    eq = pool_statistics([class_statistics(f, lab, num_classes) for f, lab in parts])
    assert summed.counts.tolist() == eq.counts.tolist() == [float(n) for n in sizes]
    zd = z.double()
    for c in range(num_classes):
        zc = zd[y == c]
        if len(zc) == 0:
            assert torch.count_nonzero(mom.means[c]) == 0 and torch.count_nonzero(mom.covs[c]) == 0
            continue
        size = zc.abs().amax(1)  # ||z_l||_inf: the terms of the sums are up to size_l and size_l^2
        torch.testing.assert_close(summed.sums[c], stacked.sums[c], rtol=0, atol=8 * EPS * float(size.sum()))
        torch.testing.assert_close(summed.outer[c], stacked.outer[c], rtol=0, atol=8 * EPS * float((size**2).sum()))
        unit = EPS * float(size.max()) ** 2
        for means in (eq.means[c], zc.mean(0)):
            torch.testing.assert_close(mom.means[c], means, rtol=0, atol=8 * EPS * float(zc.abs().max()))
        if len(zc) == 1:
            assert torch.count_nonzero(mom.covs[c]) == 0
            continue
        for covs in (eq.covs[c], torch.cov(zc.T, correction=1).reshape(d, d)):
            torch.testing.assert_close(mom.covs[c], covs, rtol=0, atol=8 * unit)
        assert torch.equal(mom.covs[c], mom.covs[c].T)
