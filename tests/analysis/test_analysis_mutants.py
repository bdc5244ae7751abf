"""hetfl.analysis: the cases the known-answer tests of test_analysis.py left open, found by mutation testing
(benchmarks/mutation.py, targets analysis_cka, analysis_spectrum, analysis_classifier): the edges of the
spectrum (no features, constant features, tiny scales, exactly two samples, low-precision inputs), the refusals'
whole messages, and the identities of CKA and the correlations on inputs where a wrong term shows."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from hetfl.analysis import (
    average_ranks,
    class_weight_norms,
    clients_norm_count_correlation,
    effective_rank,
    effective_rank_of_spectrum,
    norm_count_correlation,
    numerical_rank,
    pearson,
    singular_values,
    spearman,
)
from hetfl.analysis.spectrum import feature_covariance

pytestmark = pytest.mark.usefixtures("one_thread")


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def entropy_rank(values: list[float]) -> float:
    """``exp(H(p))``, ``p = values / sum(values)`` over the positive values, in Python floats (Roy & Vetterli)."""
    total = sum(values)
    return math.exp(-sum(v / total * math.log(v / total) for v in values if v > 0))


# ------------------------------------------------------------------ spectrum
def test_the_covariance_is_float64_whatever_the_features_dtype_and_equals_numpys():
    feats = randn(40, 5, seed=1).float() * torch.arange(1, 6)
    cov = feature_covariance(feats)
    assert cov.dtype == torch.float64
    torch.testing.assert_close(cov, torch.from_numpy(np.cov(feats.double().numpy().T)), rtol=1e-12, atol=0)


def test_two_samples_are_enough_for_a_covariance():
    feats = torch.tensor([[1.0, 5.0], [3.0, 1.0]], dtype=torch.float64)
    # centred rows (-1, 2), (1, -2); divided by n - 1 = 1
    torch.testing.assert_close(feature_covariance(feats), torch.tensor([[2.0, -4.0], [-4.0, 8.0]],
                                                                       dtype=torch.float64))
    assert numerical_rank(feats) == 1


def test_the_covariances_refusals_name_the_problem_whole():
    with pytest.raises(ValueError, match=re.escape("features must be [n, d], got shape (2, 3, 4)")):
        feature_covariance(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="^the covariance needs at least 2 samples$"):
        feature_covariance(torch.zeros(1, 3))
    bad = torch.zeros(3, 2)
    bad[1, 0] = math.nan
    with pytest.raises(ValueError, match=re.escape(
            "features are not finite (NaN or inf; a diverged model?): no covariance to analyse")):
        feature_covariance(bad)


def test_normalised_spectra_of_tiny_constant_and_empty_features():
    feats = randn(30, 4, seed=2) @ randn(4, 4, seed=3)
    tiny = singular_values(1e-3 * feats, normalize=True)  # the largest value is far below 1: still divided by it
    assert tiny[0] == 1.0
    torch.testing.assert_close(tiny, singular_values(feats, normalize=True), rtol=1e-10, atol=0)
    constant = singular_values(torch.full((6, 3), 2.5), normalize=True)  # no variance: zeros, not 0/0
    assert torch.equal(constant, torch.zeros(3, dtype=torch.float64))
    empty = singular_values(torch.zeros(5, 0), normalize=True)  # no features: no values, no index error
    assert empty.shape == (0,) and empty.dtype == torch.float64


def test_the_numerical_rank_is_relative_to_the_largest_value_and_strict():
    feats = randn(200, 3, seed=4) @ randn(3, 8, seed=5)
    assert numerical_rank(feats) == 3
    assert numerical_rank(1e-4 * feats) == 3  # covariance values ~1e-8, below rtol in absolute terms
    assert numerical_rank(feats, rtol=1.0) == 0  # none is strictly above the largest itself


def test_the_effective_rank_of_a_spectrum_is_its_entropys_exponential_at_any_scale_and_dtype():
    assert effective_rank_of_spectrum(torch.zeros(4)) == 0.0  # all zero: 0 (an empty p would give exp(0) = 1)
    assert effective_rank(torch.full((5, 3), 7.0)) == 0.0  # constant features: no variance
    assert effective_rank_of_spectrum(torch.full((4,), 0.25)) == pytest.approx(4.0, rel=1e-12)  # sums to 1
    assert effective_rank_of_spectrum(torch.tensor([0.3, 0.1, 0.0], dtype=torch.float64)) == pytest.approx(entropy_rank([0.3, 0.1]),
                                                                                       rel=1e-12)
    low = torch.tensor([3.0, 1.0, 1.0], dtype=torch.bfloat16)  # exact in bfloat16; computed in float64
    assert effective_rank_of_spectrum(low) == pytest.approx(entropy_rank([3.0, 1.0, 1.0]), rel=1e-12)


# ------------------------------------------------------------------ classifier norms and correlations
def test_python_floats_are_correlated_in_float64_not_first_rounded_to_float32():
    # torch.as_tensor made a list of Python floats float32 before the float64 computation: 1e8 + 1, + 2 and + 4
    # are one float32 (its spacing there is 8), so both correlations came out nan (constant), the ranks all tied
    big = [1e8 + 1, 1e8 + 2, 1e8 + 4]
    assert pearson(big, [1, 2, 4]) == pytest.approx(1.0, abs=1e-12)
    assert spearman(big, [3, 2, 1]) == pytest.approx(-1.0, abs=1e-12)
    assert average_ranks(big).tolist() == [1.0, 2.0, 3.0]
    assert pearson([0.1, 0.2, 0.7], [1, 2, 3]) == pytest.approx(float(np.corrcoef([0.1, 0.2, 0.7], [1, 2, 3])[0, 1]),
                                                                 rel=1e-14)
    weight = torch.diag(torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64))
    assert norm_count_correlation(weight, big) == pytest.approx({"pearson": 1.0, "spearman": 1.0}, abs=1e-12)
    assert clients_norm_count_correlation([weight], [big])["pearson"] == pytest.approx([1.0], abs=1e-12)


def test_two_values_are_enough_to_correlate():
    assert pearson([1.0, 2.0], [3.0, 5.0]) == pytest.approx(1.0)
    assert spearman([1.0, 2.0], [5.0, 3.0]) == pytest.approx(-1.0)
    assert norm_count_correlation(torch.diag(torch.tensor([1.0, 3.0])), [7, 2])["pearson"] == pytest.approx(-1.0)


def test_a_correlation_of_unit_norm_centred_vectors_is_their_dot_product_not_nan():
    a = [0.5, -0.5, 0.5, -0.5]  # centred, norm 1: the denominator is exactly 1
    b = [0.5, 0.5, -0.5, -0.5]
    assert pearson(a, a) == 1.0
    assert pearson(a, b) == 0.0


def test_correlations_stay_within_minus_one_and_one_where_rounding_overshoots():
    # the raw ratio x.y / (|x| |y|) of a vector with itself (or its negative) is 1 (-1) only up to rounding, and
    # exceeds it for some vectors; the result is clamped to [-1, 1]
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        v = torch.randn(7, generator=g, dtype=torch.float64) * 10.0 ** int(torch.randint(-3, 4, (1,), generator=g))
        assert -1.0 <= pearson(v, v) <= 1.0
        assert -1.0 <= pearson(v, -v) <= 1.0
        assert pearson(v, v) == pytest.approx(1.0, abs=1e-15)
        assert pearson(v, -v) == pytest.approx(-1.0, abs=1e-15)


def test_ties_at_the_end_share_their_average_rank():
    assert average_ranks([1.0, 2.0, 2.0]).tolist() == [1.0, 2.5, 2.5]
    assert average_ranks([5.0, 5.0, 5.0]).tolist() == [2.0, 2.0, 2.0]
    assert average_ranks([4.0, 3.0, 9.0, 9.0, 0.0]).tolist() == [3.0, 2.0, 4.5, 4.5, 1.0]


def test_the_classifier_refusals_name_the_problem_whole():
    with pytest.raises(ValueError, match=re.escape("classifier weight must be [num_classes, dim], got shape (3,)")):
        class_weight_norms(torch.ones(3))
    with pytest.raises(ValueError, match="^a needs at least 2 values$"):
        pearson([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="^b needs at least 2 values$"):
        pearson([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="^vectors differ in length: 3 vs 2$"):
        pearson([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="^counts needs at least 2 values$"):
        norm_count_correlation(torch.ones(1, 4), [3])
    with pytest.raises(ValueError, match="^3 classifier rows but 2 class counts$"):
        norm_count_correlation(torch.ones(3, 4), [3, 1])
    weights = [torch.eye(3), torch.eye(3)]
    with pytest.raises(ValueError, match=re.escape("counts must be [2, num_classes], got shape (1, 3)")):
        clients_norm_count_correlation(weights, [[1.0, 2.0, 3.0]])
    with pytest.raises(ValueError, match=re.escape("counts must be [2, num_classes], got shape (2,)")):
        clients_norm_count_correlation(weights, [1.0, 2.0])
