"""hetfl.analysis: the cases the known-answer tests of test_analysis.py left open, found by mutation testing
(benchmarks/mutation.py, targets analysis_cka, analysis_spectrum, analysis_classifier): the edges of the
spectrum (no features, constant features, tiny scales, exactly two samples, low-precision inputs), the refusals'
whole messages, and the identities of CKA and the correlations on inputs where a wrong term shows."""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest
import torch
from torch import nn

from hetfl.analysis import (
    average_ranks,
    class_weight_norms,
    clients_norm_count_correlation,
    effective_rank,
    effective_rank_of_spectrum,
    layer_features,
    linear_cka,
    mean_off_diagonal,
    norm_count_correlation,
    numerical_rank,
    pairwise_cka,
    pearson,
    singular_values,
    spearman,
)
from hetfl.analysis import cka as cka_module
from hetfl.analysis.spectrum import feature_covariance

pytestmark = pytest.mark.usefixtures("one_thread")


def whole(message: str, key_error: bool = False) -> str:
    """A ``match`` pattern for exactly ``message`` (a KeyError's text is the repr of its message)."""
    return f"^{re.escape(repr(message) if key_error else message)}$"


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
    with pytest.raises(ValueError, match=whole("features must be [n, d], got shape (2, 3, 4)")):
        feature_covariance(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="^the covariance needs at least 2 samples$"):
        feature_covariance(torch.zeros(1, 3))
    bad = torch.zeros(3, 2)
    bad[1, 0] = math.nan
    with pytest.raises(ValueError, match=whole(
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
    spectrum = torch.tensor([0.3, 0.1, 0.0], dtype=torch.float64)
    assert effective_rank_of_spectrum(spectrum) == pytest.approx(entropy_rank([0.3, 0.1]), rel=1e-12)
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
    with pytest.raises(ValueError, match=whole("classifier weight must be [num_classes, dim], got shape (3,)")):
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
    with pytest.raises(ValueError, match=whole("counts must be [2, num_classes], got shape (1, 3)")):
        clients_norm_count_correlation(weights, [[1.0, 2.0, 3.0]])
    with pytest.raises(ValueError, match=whole("counts must be [2, num_classes], got shape (2,)")):
        clients_norm_count_correlation(weights, [1.0, 2.0])


# ------------------------------------------------------------------ CKA
def reference_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Kornblith et al. 2019, linear kernel: ||Yc^T Xc||_F^2 / (||Xc^T Xc||_F ||Yc^T Yc||_F), column-centred."""
    xc, yc = x.double() - x.double().mean(0), y.double() - y.double().mean(0)
    return float((yc.T @ xc).square().sum() / (torch.linalg.norm(xc.T @ xc) * torch.linalg.norm(yc.T @ yc)))


def test_cka_is_invariant_to_isotropic_scaling_at_any_scale():
    x, y = randn(30, 6, seed=1), randn(30, 4, seed=2) + randn(30, 1, seed=3)
    base = linear_cka(x, y)
    assert base == pytest.approx(reference_cka(x, y), rel=1e-10)
    for scale in (1e-8, 1e-4, 1e4, 1e8):  # a constant layer is judged relative to the features' norm, not absolutely
        assert linear_cka(scale * x, y) == pytest.approx(base, rel=1e-9), scale
        assert linear_cka(x, scale * y) == pytest.approx(base, rel=1e-9), scale
    # variation below 1e-12 of the features' norm is rounding: the layer counts as constant, CKA is undefined
    assert math.isnan(linear_cka(1e6 + 1e-9 * x, y))


def test_cka_of_unit_norm_features_is_one_not_nan():
    x = torch.tensor([[0.5], [-0.5], [0.5], [-0.5]], dtype=torch.float64)  # centred, X^T X = 1: denominator 1
    assert linear_cka(x, x) == 1.0
    assert linear_cka(x, torch.tensor([[1.0], [2.0], [3.0], [4.0]])) == pytest.approx(
        reference_cka(x, torch.tensor([[1.0], [2.0], [3.0], [4.0]])), rel=1e-12)


def test_cka_of_two_inputs_and_of_single_columns():
    # two inputs: the centred features are +-v and +-w, so every pair of non-constant representations has CKA 1
    assert linear_cka(randn(2, 5, seed=4), randn(2, 3, seed=5)) == pytest.approx(1.0, abs=1e-12)
    x, y = randn(10, 1, seed=6), randn(10, 1, seed=7)  # one feature each: the squared correlation
    r = float(torch.corrcoef(torch.cat([x, y], 1).T)[0, 1])
    assert linear_cka(x, y) == pytest.approx(r * r, rel=1e-10)


def test_cka_takes_the_cheaper_route_by_its_cost():
    # n d1 d2 for Y^T X against n^2 (d1 + d2) for the Gram matrices: the Grams only when strictly cheaper
    routes = []
    real = cka_module._cka

    def spy(rx, ry, gram, nx, ny):  # type: ignore[no-untyped-def]
        routes.append(gram)
        return real(rx, ry, gram, nx, ny)

    cases = {(2, 4, 4): False, (2, 5, 4): True, (3, 12, 4): False, (3, 13, 4): True, (20, 3, 50): False,
             (4, 100, 5): True, (6, 7, 30): False, (6, 8, 30): True}  # (2, 4, 4), (3, 12, 4): equal costs
    with pytest.MonkeyPatch.context() as m:
        m.setattr(cka_module, "_cka", spy)
        for (n, d1, d2), gram in cases.items():
            x, y = randn(n, d1, seed=n + d1), randn(n, d2, seed=d2)
            value = linear_cka(x, y)
            assert routes.pop() is gram, (n, d1, d2)
            assert value == pytest.approx(reference_cka(x, y), rel=1e-9)


def test_the_cka_refusals_name_the_problem_whole():
    with pytest.raises(ValueError, match=whole("x and y must describe the same inputs: 10 vs 11 rows")):
        linear_cka(randn(10, 3), randn(11, 5))
    with pytest.raises(ValueError, match="^CKA needs at least 2 inputs$"):
        linear_cka(randn(1, 3), randn(1, 3))
    with pytest.raises(ValueError, match=whole("features must be a matrix [n, d], got shape (4, 2, 2)")):
        linear_cka(torch.zeros(4, 2, 2), randn(4, 3))
    bad = randn(5, 2)
    bad[0, 0] = math.inf
    with pytest.raises(ValueError, match=whole(
            "features are not finite (NaN or inf; a diverged model?): CKA is undefined")):
        linear_cka(randn(5, 2), bad)
    with pytest.raises(ValueError, match="^pairwise_cka needs at least one state$"):
        pairwise_cka([], nn.Linear(2, 2), torch.zeros(3, 2), [""])


def test_mean_off_diagonal_of_one_model_and_of_non_square_matrices():
    assert math.isnan(mean_off_diagonal(torch.ones(1, 1)))
    for shape in ((2, 3), (2, 2, 2), (4,)):
        with pytest.raises(ValueError, match=whole(f"expected a square matrix, got shape {shape}")):
            mean_off_diagonal(torch.ones(shape))


class Pair(nn.Module):
    """A layer returning a tuple (as an LSTM does): its first element is its output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return h, -h


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair = Pair()
        self.spare = nn.Linear(2, 2)  # never called
        self.head = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pair(x)[0])


class Named(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": x}


def test_layer_features_of_a_tuple_output_is_its_first_element_and_the_errors_are_whole():
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(4, 3)
    state = net.state_dict()
    feats = layer_features(net, state, x, ["pair"])
    torch.testing.assert_close(feats["pair"], net.pair.lin(x).detach())
    with pytest.raises(KeyError, match=whole(
            "no submodule named ['nope'] in the model; available: 'pair', 'pair.lin', 'spare', 'head'", True)):
        layer_features(net, state, x, ["nope"])
    with pytest.raises(KeyError, match=whole("state lacks the model tensors ['spare.weight', 'head.bias']", True)):
        layer_features(net, {k: v for k, v in state.items() if k not in {"spare.weight", "head.bias"}}, x, ["pair"])
    with pytest.raises(RuntimeError, match=whole("layer 'spare' was not called in the forward pass")):
        layer_features(net, state, x, ["spare"])
    with pytest.raises(TypeError, match=whole("layer '0' returned dict, not a tensor")):
        layer_features(nn.Sequential(Named()), {}, x, ["0"])


def test_a_shared_layers_refusal_is_whole():
    relu = nn.ReLU()
    shared = nn.Sequential(nn.Linear(3, 3), relu, nn.Linear(3, 3), relu)
    with pytest.raises(ValueError, match=whole(
            "layers ['1'] run more than once per forward pass (a shared module, e.g. one ReLU used twice): their "
            "outputs are ambiguous; hook another module")):
        layer_features(shared, shared.state_dict(), torch.randn(2, 3), ["1"])


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def mlp_state(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: scale * torch.randn(v.shape, generator=g) for k, v in mlp().state_dict().items()}


def test_pairwise_cka_has_exact_ones_on_the_diagonal_and_equals_linear_cka_with_as_many_probes_as_features():
    model = mlp()
    states = [mlp_state(s) for s in range(4)]
    for n in (6, 3, 40):  # layer "0" is 6 wide: n = d (the feature route, at its edge), n < d (Grams), n > d
        x = torch.randn(n, 4, generator=torch.Generator().manual_seed(n))
        out = pairwise_cka(states, model, x, ["0", "2"])
        for layer, mat in out.items():
            assert torch.equal(torch.diagonal(mat), torch.ones(4, dtype=torch.float64)), (n, layer)
            feats = [layer_features(model, s, x, [layer])[layer] for s in states]
            for i, j in itertools.combinations(range(4), 2):
                assert mat[i, j] == mat[j, i] == pytest.approx(reference_cka(feats[i], feats[j]), rel=1e-9)


def test_pairwise_cka_of_one_model_of_a_constant_layer_and_of_a_small_one():
    model = mlp()
    x = torch.randn(10, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(pairwise_cka([mlp_state(1)], model, x, ["2"])["2"], torch.ones(1, 1, dtype=torch.float64))
    constant = {**mlp_state(1), "2.weight": torch.zeros(3, 6)}  # the head outputs its bias for every input
    mat = pairwise_cka([mlp_state(1), constant], model, x, ["2"])["2"]
    assert mat[0, 0] == 1.0 and torch.isnan(mat[1, 1]) and torch.isnan(mat[0, 1])
    small = pairwise_cka([mlp_state(1, 1e-3), mlp_state(2, 1e-3)], model, x, ["2"])["2"]  # ||X^T X|| far below 1
    assert torch.equal(torch.diagonal(small), torch.ones(2, dtype=torch.float64))


def test_pairwise_cka_runs_the_probes_in_batches_of_batch_size():
    model = mlp()
    sizes: list[int] = []
    handle = model.register_forward_pre_hook(lambda _m, args: sizes.append(len(args[0])))
    x = torch.randn(7, 4, generator=torch.Generator().manual_seed(0))
    whole = pairwise_cka([mlp_state(1), mlp_state(2)], model, x, ["0"])["0"]
    assert sizes == [7, 7]
    sizes.clear()
    chunked = pairwise_cka([mlp_state(1), mlp_state(2)], model, x, ["0"], batch_size=3)["0"]
    handle.remove()
    assert sizes == [3, 3, 1, 3, 3, 1]
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cka_of_features_on_two_devices_and_the_mean_of_a_cuda_matrix():
    x, y = randn(20, 4, seed=1), randn(20, 3, seed=2)
    assert linear_cka(x.cuda(), y) == pytest.approx(linear_cka(x, y), rel=1e-10)
    hand = torch.tensor([[1.0, 0.2, 0.4], [0.2, 1.0, 0.6], [0.4, 0.6, 1.0]], device="cuda")
    assert mean_off_diagonal(hand) == pytest.approx(0.4)
