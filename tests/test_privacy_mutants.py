"""hetfl.privacy's texts, digests and edges, each against a reference written here (mutation testing,
``benchmarks/mutation.py`` target ``privacy``, session 31).

The digests are recomputed with ``hashlib`` from the layout their docstrings state; epsilon at an exact
multiplier of 1 from the analytic Gaussian mechanism's privacy profile (Balle & Wang 2018, Theorem 8)
written with ``math.erfc``; the accepted range's four edges from :data:`EPSILON_RANGE` / :data:`DELTA_RANGE`.
"""

from __future__ import annotations

import hashlib
import math
from importlib import metadata

import pytest
import torch

from hetfl.privacy import (
    DELTA_RANGE,
    EPSILON_RANGE,
    accountant_name,
    budget_problem,
    budget_text,
    check_budget,
    epsilon_spent,
    epsilon_text,
    refused_digest,
    release_digest,
)
from tests.helpers import needs_accountant, release_digest_reference


def phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def profile_delta(epsilon: float, z: float) -> float:
    """delta(epsilon) of one Gaussian mechanism of noise multiplier z (Balle & Wang 2018, Theorem 8)."""
    return phi(0.5 / z - epsilon * z) - math.exp(epsilon) * phi(-0.5 / z - epsilon * z)


@needs_accountant
def test_the_accountant_is_named_whole():
    """The name a run's summary records: the package, its version, the conversion and the composition."""
    assert accountant_name() == (f"dp-accounting {metadata.version('dp-accounting')} analytic Gaussian "
                                 "(Balle & Wang 2018), releases composed exactly (add/remove one sample)")


@pytest.mark.parametrize("epsilon", EPSILON_RANGE)
@pytest.mark.parametrize("delta", DELTA_RANGE)
def test_each_edge_of_the_accepted_range_is_accepted_and_the_next_float_beyond_it_is_not(epsilon, delta):
    assert budget_problem(epsilon, delta) is None
    check_budget(epsilon, delta)
    outside_eps = math.nextafter(epsilon, 0.0 if epsilon == EPSILON_RANGE[0] else math.inf)
    outside_delta = math.nextafter(delta, 0.0 if delta == DELTA_RANGE[0] else math.inf)
    assert budget_problem(outside_eps, delta)[:2] == ("epsilon", outside_eps)
    assert budget_problem(epsilon, outside_delta)[:2] == ("delta", outside_delta)


def test_a_budget_is_shown_rounded_up_per_upload_where_the_server_faced_that():
    assert budget_text(33.71551, 1e-5, True) == "33.8 per upload (1e-05)"
    assert budget_text(33.71551, 1e-5, False) == "33.8 (1e-05)"


@pytest.mark.parametrize(("epsilon", "text"), [(math.inf, "inf"), (math.nan, "nan"), (0.0, "0"), (-1.5, "-1.5")])
def test_an_epsilon_that_is_no_positive_number_is_shown_as_it_is(epsilon, text):
    assert epsilon_text(epsilon) == text


@needs_accountant
def test_one_release_of_multiplier_exactly_one_spends_a_finite_epsilon_on_the_gaussian_profile():
    """z = 1 is an ordinary multiplier (only z = 0, no noise, spends inf): the epsilon returned is where the
    exact profile of N(0, 1) at sensitivity 1 reaches delta."""
    epsilon = epsilon_spent([1.0], 1e-5)
    assert math.isfinite(epsilon) and 4.0 < epsilon < 5.0
    assert profile_delta(epsilon, 1.0) == pytest.approx(1e-5, rel=1e-6)


def test_a_release_digest_is_sha256_of_each_tensors_name_dtype_shape_and_bytes_in_order():
    a = torch.tensor([[1.5, -2.0]], dtype=torch.float32)
    b = torch.arange(3, dtype=torch.int64)
    empty = torch.empty(0, 2, dtype=torch.float64)
    assert release_digest([("a", a), ("b", b)]) == release_digest_reference([("a", a), ("b", b)])
    assert release_digest([("e", empty)]) == release_digest_reference([("e", empty)]) \
        == hashlib.sha256(b"e|torch.float64|(0, 2)|").hexdigest()
    assert release_digest([("b", b), ("a", a)]) != release_digest([("a", a), ("b", b)])


def test_a_refused_releases_digest_hashes_the_uploads_digests_in_client_order():
    refused = {3: "bb", 1: "aa"}  # given out of order: the digest is the clients' in order
    assert refused_digest(refused) == hashlib.sha256(b"refused|1|aa|3|bb|").hexdigest()
    assert refused_digest({}) == hashlib.sha256(b"refused|").hexdigest()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_release_on_the_gpu_has_the_digest_of_its_cpu_copy():
    a = torch.tensor([[1.5, -2.0]], dtype=torch.float32)
    assert release_digest([("a", a.cuda())]) == release_digest([("a", a)]) == release_digest_reference([("a", a)])
