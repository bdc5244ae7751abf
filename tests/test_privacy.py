"""hetfl.privacy: the Gaussian mechanism's calibration through Google's accountant, checked against
the exact privacy profile of a Gaussian mechanism (Balle & Wang 2018, Theorem 8), which the
accountant does not use."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from scipy.stats import norm

from hetfl.privacy import (
    accountant_name,
    clip_rows,
    epsilon_spent,
    noise_multiplier,
    require_accountant,
    symmetric_noise,
)
from tests.helpers import needs_accountant


def exact_delta(epsilon: float, sigma: float) -> float:
    """delta(epsilon) of the Gaussian mechanism N(0, sigma^2) with sensitivity 1 (analytic Gaussian mechanism)."""
    return norm.cdf(0.5 / sigma - epsilon * sigma) - math.exp(epsilon) * norm.cdf(-0.5 / sigma - epsilon * sigma)


@needs_accountant
@pytest.mark.parametrize(("epsilon", "delta"), [(8.0, 1e-5), (4.0, 1e-5), (1.0, 1e-5), (0.5, 1e-6), (2.0, 1e-3)])
def test_calibrated_multiplier_meets_the_exact_gaussian_profile(epsilon, delta):
    z = noise_multiplier(epsilon, delta)
    # at the calibrated z the exact delta at epsilon is delta (within the accountant's discretisation), and a
    # 2% smaller z would break the budget: the calibration is tight, and z is sigma / sensitivity, not its inverse
    assert exact_delta(epsilon, z) == pytest.approx(delta, rel=0.02)
    assert exact_delta(epsilon, 0.98 * z) > 1.05 * delta
    assert epsilon_spent([z], delta) == pytest.approx(epsilon, rel=1e-3)


@needs_accountant
def test_composition_of_releases():
    z = noise_multiplier(4.0, 1e-5, releases=10)
    assert epsilon_spent([z] * 10, 1e-5) == pytest.approx(4.0, rel=1e-3)
    # ten Gaussian releases of multiplier z are one of multiplier z / sqrt(10)
    assert z == pytest.approx(math.sqrt(10) * noise_multiplier(4.0, 1e-5), rel=2e-3)
    assert epsilon_spent([z] * 5, 1e-5) < 4.0 < epsilon_spent([z] * 20, 1e-5)
    assert epsilon_spent([], 1e-5) == 0.0 and epsilon_spent([z, 0.0], 1e-5) == math.inf


@pytest.mark.parametrize(("epsilon", "delta", "releases"), [(0.0, 1e-5, 1), (-1.0, 1e-5, 1), (math.inf, 1e-5, 1),
                                                            (1.0, 0.0, 1), (1.0, 1.0, 1), (1.0, 1e-5, 0)])
def test_invalid_budgets_are_refused(epsilon, delta, releases):
    with pytest.raises(ValueError, match="epsilon|delta|releases"):
        noise_multiplier(epsilon, delta, releases)


@needs_accountant
def test_accountant_is_named_with_its_version():
    assert accountant_name().startswith("dp-accounting ") and "analytic Gaussian" in accountant_name()


def test_clip_rows_bounds_norms_and_keeps_short_rows():
    x = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]], dtype=torch.float64)
    out = clip_rows(x, 1.0)
    assert torch.allclose(out[0], torch.tensor([0.6, 0.8], dtype=torch.float64))
    assert torch.equal(out[1:], x[1:])


def test_symmetric_noise_is_symmetric_with_the_stated_spread():
    e = symmetric_noise((4, 30, 30), 2.0, torch.Generator().manual_seed(0))
    assert e.dtype == torch.float64  # as documented: the moments it is added to are float64
    assert torch.equal(e, e.transpose(-1, -2))
    upper = e[:, *torch.triu_indices(30, 30)]
    assert upper.std().item() == pytest.approx(2.0, rel=0.05) and abs(upper.mean().item()) < 0.1


def test_symmetric_noise_comes_from_the_generator_it_is_given():
    """The noise of a seeded run is the generator's (noise_source "seed" repeats), not torch's global stream."""
    torch.manual_seed(0)
    a = symmetric_noise((2, 5, 5), 1.0, torch.Generator().manual_seed(7))
    b = symmetric_noise((2, 5, 5), 1.0, torch.Generator().manual_seed(7))
    c = symmetric_noise((2, 5, 5), 1.0, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_a_missing_accountant_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # import dp_accounting then raises ImportError
    with pytest.raises(ImportError, match=r"differential privacy needs the accountant: .*hetfl\[privacy\]"):
        require_accountant()


# ------------------------------------------------------------------ the budget a report shows
SUM_ONLY = {"epsilon": 4.0, "epsilon_per_upload": 33.7, "delta": 1e-5}


@pytest.mark.parametrize(("privacy", "faced"), [
    ({**SUM_ONLY, "noise": "distributed", "secure_aggregation": False}, (33.7, True)),  # the server saw each upload
    ({**SUM_ONLY, "noise": "distributed"}, (33.7, True)),  # not said: taken as not secure (the larger epsilon)
    ({**SUM_ONLY, "noise": "distributed", "secure_aggregation": True}, (4.0, False)),  # it saw the sum only
    ({"epsilon": 2.0, "epsilon_per_upload": 2.0, "delta": 1e-5, "noise": "local"}, (2.0, False)),
])
def test_the_epsilon_a_server_faces_is_the_per_upload_one_unless_it_saw_only_the_sum(privacy, faced):
    from hetfl.privacy import server_epsilon

    assert server_epsilon(privacy) == faced
