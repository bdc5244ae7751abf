"""FedProx's Synthetic(alpha, beta) (hetfl.data.datasets.synthetic): the loader's arrays are the generator's split by
device, device sizes follow the reference code's power law, the draws follow the generative model, and what alpha
does (nothing, as in the reference code). tests/data/test_datasets.py has shapes, determinism and label skew."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from hetfl.data.datasets import load_dataset, synthetic


@pytest.mark.parametrize(("iid", "test_fraction", "max_samples"), [(False, 0.3, 300), (True, 0.2, 0), (False, 0.0, 60)])
def test_the_loader_holds_the_generators_arrays_split_by_device(iid, test_fraction, max_samples):
    """load_synthetic writes each device's rows straight to their places: the same arrays as ``generate``, then
    ``split_by_group`` and indexing (its docstring's claim), for both variants."""
    opts = {"num_devices": 9, "dim": 7, "num_classes": 4, "alpha": 0.5, "beta": 2.0, "iid": iid,
            "test_fraction": test_fraction, "max_samples": max_samples}
    ds = load_dataset("synthetic", seed=5, **opts)
    x, y, g = synthetic.generate(0.5, 2.0, 9, 7, 4, iid, seed=5, max_samples=max_samples)
    train, test = synthetic.split_by_group(g, test_fraction, seed=5)
    assert np.array_equal(ds.train.x.numpy(), x[train]) and np.array_equal(ds.test.x.numpy(), x[test])
    assert np.array_equal(ds.train.y.numpy(), y[train]) and np.array_equal(ds.test.y.numpy(), y[test])
    assert np.array_equal(ds.train.group.numpy(), g[train]) and np.array_equal(ds.test.group.numpy(), g[test])
    assert ds.info.groups == tuple(f"device{k}" for k in range(9)) and ds.info.classes == ("0", "1", "2", "3")
    assert ds.info.name == "synthetic" and ds.info.input_shape == (7,)
    kind = "IID" if iid else "alpha=0.5, beta=2.0"
    assert ds.notes == [f"FedProx Synthetic({kind}), 9 devices, {len(y)} samples, seed 5"]


def test_a_devices_test_share_is_its_rounded_fraction_drawn_at_random():
    g = np.repeat(np.arange(3), [10, 7, 5])
    train, test = synthetic.split_by_group(g, 0.25, seed=1)
    assert np.bincount(g[test], minlength=3).tolist() == [round(2.5), round(1.75), round(1.25)]
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(22))
    assert np.all(np.diff(train) > 0) and np.all(np.diff(test) > 0)
    picks = {tuple(synthetic.split_by_group(g, 0.25, seed=s)[1]) for s in range(8)}
    assert len(picks) > 1  # random, not the first rows


def test_device_sizes_follow_the_lognormal_4_2_plus_50_power_law():
    """The reference code's ``lognormal(4, 2) + 50``: at least 50 (and exactly 50 for the ~2% below 1), median
    e^4 + 50, the log's spread 2; capped at ``max_samples`` (0: no cap). 4,000 devices."""
    sizes = synthetic.device_sizes(4000, seed=0, max_samples=0)
    assert sizes.min() == 50 and sizes.max() > 5000
    assert np.median(sizes - 50) == pytest.approx(np.exp(4), rel=0.1)
    assert np.quantile(np.log(sizes - 50 + 0.5), 0.8413) == pytest.approx(6.0, abs=0.15)  # mu + sigma
    assert synthetic.device_sizes(1000, seed=0).max() == 5000  # the default cap, as the loader's
    _, _, g = synthetic.generate(1.0, 1.0, 300, 2, 2, False, seed=0)
    assert np.bincount(g).max() == 5000
    capped = synthetic.device_sizes(4000, seed=0, max_samples=300)
    assert np.array_equal(capped, np.minimum(sizes, 300))
    _, _, g = synthetic.generate(1.0, 1.0, 12, 3, 2, False, seed=4, max_samples=500)
    assert np.array_equal(np.bincount(g, minlength=12), synthetic.device_sizes(12, seed=4, max_samples=500))


def test_inputs_are_centred_on_each_devices_mean_with_the_papers_covariance():
    """``x ~ N(v_k, diag(j^-1.2))``: within a device, the spread of coordinate j is j^-0.6 (not its variance)."""
    assert np.allclose(synthetic.sigma_diagonal(4), [1.0, 2**-1.2, 3**-1.2, 4**-1.2])
    x, _, g = synthetic.generate(1.0, 1.0, 4, 30, 3, False, seed=2, max_samples=0)
    for k in range(4):
        rows = x[g == k].astype(np.float64)
        if len(rows) < 400:
            continue
        ratio = rows.var(axis=0) / synthetic.sigma_diagonal(30)
        assert np.allclose(ratio, 1.0, atol=0.2), (k, ratio)


def test_non_iid_labels_come_from_each_devices_own_model_and_iid_labels_from_one():
    """IID: every device labels with the shared ``W, b``: a sample's label does not depend on its device. Checked
    by fitting: one linear rule (the argmax of a least-squares fit) labels the IID data far better than the
    non-IID data, whose devices each have their own ``W_k, b_k``."""
    def one_rule_accuracy(x, y):
        features = np.hstack([x, np.ones((len(x), 1))])
        targets = np.eye(5)[y]
        w, *_ = np.linalg.lstsq(features, targets, rcond=None)
        return float((np.argmax(features @ w, axis=1) == y).mean())

    iid = synthetic.generate(1.0, 0.0, 20, 10, 5, True, seed=3, max_samples=400)
    non_iid = synthetic.generate(1.0, 0.0, 20, 10, 5, False, seed=3, max_samples=400)
    assert one_rule_accuracy(*iid[:2]) > 0.75 > 0.7 > one_rule_accuracy(*non_iid[:2])  # 0.82 and 0.60


def test_alpha_changes_nothing_in_the_data_as_in_the_reference_code():
    """``W_k, b_k ~ N(u_k, 1)``: ``u_k`` adds ``u_k (sum_j x_j + 1)`` to every class's logit alike, so the argmax,
    the label, does not depend on it; and ``u_k`` takes one draw of the device's generator whatever its variance.
    The reference code (litian96/FedProx, generate_synthetic.py) has the same structure: its Synthetic(0, 0),
    (0.5, 0.5) and (1, 1) differ through beta alone. Held here so that a change of the generator is noticed."""
    x0, y0, g0 = synthetic.generate(0.0, 1.0, 20, 60, 10, False, seed=0)
    for alpha in (0.5, 1.0, 100.0):
        x, y, g = synthetic.generate(alpha, 1.0, 20, 60, 10, False, seed=0)
        assert np.array_equal(x, x0) and np.array_equal(y, y0) and np.array_equal(g, g0), alpha
    x1, _, _ = synthetic.generate(0.0, 4.0, 20, 60, 10, False, seed=0)  # beta moves the inputs
    assert not np.array_equal(x1, x0)


def test_beta_is_the_variance_of_the_devices_input_means():
    """``v_k ~ N(B_k, 1)``, ``B_k ~ N(0, beta)``: a device's mean input coordinate is ``B_k`` up to ``1/sqrt(dim)``
    and its samples' noise; over 400 devices their variance is beta + 1/dim + (a little)."""
    for beta in (0.0, 1.0, 9.0):
        x, _, g = synthetic.generate(1.0, beta, 400, 100, 3, False, seed=7, max_samples=55)
        means = np.array([x[g == k].mean() for k in range(400)])
        assert means.var() == pytest.approx(beta + 1 / 100, abs=0.15 + 0.15 * beta), beta
    # at beta = 0 the spread is v_k's own N(0, 1) over 10 coordinates: 1/10 (0.102 measured; 0.4 were it N(0, 2))
    x, _, g = synthetic.generate(1.0, 0.0, 400, 10, 3, False, seed=7, max_samples=55)
    assert np.var([x[g == k].mean() for k in range(400)]) == pytest.approx(0.1, rel=0.2)


def digest(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(a.tobytes())
    return h.hexdigest()[:32]


@pytest.mark.parametrize(("iid", "expected"), [(False, "fbd09b1285c620c78940d1072808a022"),
                                                (True, "d429e6fcd694addec19e8fa262b2494e")])
def test_a_seed_gives_the_same_data_on_every_machine(iid, expected):
    """The generator's promise (its docstring): every device draws from its own stream of ``SeedSequence(seed)``
    in the reference code's order, so a seed's data is these bytes, here and on the machine that reproduces a
    table. Pinned (numpy 2.4, session 45): a change of the draws' order or of a distribution's parameters that
    the statistical tests cannot see (a sign of ``v_k`` or ``b_k``, a scale of 2 for 1) fails here; so would a
    NumPy whose streams changed, which users would need to be told of."""
    x, y, g = synthetic.generate(1.0, 1.0, 6, 5, 3, iid, seed=0, max_samples=200)
    assert len(y) == 883
    assert digest(x, y, g) == expected
