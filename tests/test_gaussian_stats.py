"""CCVR's statistics: pooled client statistics equal those of all features pooled (eq. 3-4)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetfl.algorithms.gaussian_stats import (
    class_statistics,
    gaussian_factor,
    pool_statistics,
    sample_gaussian,
)


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
