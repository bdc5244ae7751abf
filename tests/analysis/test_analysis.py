"""hetfl.analysis: known-answer tests for CKA, classifier norms, spectra, sliced Wasserstein,
t-SNE, learning curves and the plots that write them."""

from __future__ import annotations

import csv
import importlib.util
import itertools
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetfl.analysis import (
    GaussianMixture,
    accuracy_curves,
    average_ranks,
    class_weight_norms,
    client_spread,
    clients_norm_count_correlation,
    cumulative_bytes,
    effective_rank,
    effective_rank_of_spectrum,
    layer_features,
    linear_cka,
    load_metrics,
    mean_off_diagonal,
    mean_pairwise_cka,
    norm_count_correlation,
    numerical_rank,
    pairwise_cka,
    pearson,
    plot_cka,
    plot_curves,
    plot_spectrum,
    plot_swd_matrix,
    plot_tsne,
    plot_weight_norms,
    projected_quantiles,
    quantile_grid,
    random_directions,
    rounds_to_target,
    run_curves,
    singular_values,
    sliced_wasserstein,
    sliced_wasserstein_matrix,
    spearman,
    train_loss_curve,
    tsne_embedding,
)

pytestmark = pytest.mark.usefixtures("one_thread")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
HAS_SKLEARN = importlib.util.find_spec("sklearn") is not None


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed), dtype=torch.float64)


def random_orthogonal(d: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(randn(d, d, seed=seed))
    return q


def reference_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """CKA from its HSIC definition with the centring matrix H (Kornblith et al. 2019, eq. 1-3)."""
    n = x.shape[0]
    h = torch.eye(n, dtype=torch.float64) - 1.0 / n
    k, l_ = x.double() @ x.double().T, y.double() @ y.double().T

    def hsic(a, b):
        return torch.trace(a @ h @ b @ h)

    return float(hsic(k, l_) / torch.sqrt(hsic(k, k) * hsic(l_, l_)))


# ------------------------------------------------------------------ CKA
@pytest.mark.parametrize(("n", "d"), [(200, 10), (20, 50)])  # feature-space and Gram-matrix routes
def test_cka_of_identical_features_is_one(n, d):
    x = randn(n, d)
    assert linear_cka(x, x) == pytest.approx(1.0, abs=1e-12)
    assert linear_cka(x.float(), x.float()) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize(("n", "d1", "d2"), [(300, 8, 5), (30, 120, 90)])  # feature-space and Gram routes
def test_cka_matches_hsic_definition_and_is_symmetric(n, d1, d2):
    x = randn(n, d1, seed=1)
    y = x[:, :1].repeat(1, d2) * 0.5 + randn(n, d2, seed=2)
    value = linear_cka(x, y)
    assert value == pytest.approx(reference_cka(x, y), rel=1e-10)
    assert linear_cka(y, x) == pytest.approx(value, rel=1e-12)
    assert 0.05 < value < 0.95  # a nontrivial case


def test_cka_invariant_to_orthogonal_maps_and_isotropic_scaling_only():
    n, d1, d2 = 400, 12, 7
    x = randn(n, d1, seed=3)
    y = torch.tanh(x @ randn(d1, d2, seed=4)) + 0.5 * randn(n, d2, seed=5)
    base = linear_cka(x, y)
    assert 0.1 < base < 0.99
    q1, q2 = random_orthogonal(d1, 6), random_orthogonal(d2, 7)
    assert linear_cka(x @ q1, y) == pytest.approx(base, rel=1e-10)
    assert linear_cka(x, y @ q2) == pytest.approx(base, rel=1e-10)
    assert linear_cka(3.7 * x, y) == pytest.approx(base, rel=1e-10)
    assert linear_cka(x, 0.02 * y) == pytest.approx(base, rel=1e-10)
    assert linear_cka(x + 5.0, y - 2.0) == pytest.approx(base, rel=1e-10)  # centring
    # ... but not to an anisotropic rescaling: the test can tell invariance from a constant
    stretch = torch.linspace(0.1, 10.0, d1, dtype=torch.float64)
    assert abs(linear_cka(x * stretch, y) - base) > 1e-3


def test_cka_of_independent_features_is_small():
    x, y = randn(4000, 10, seed=8), randn(4000, 10, seed=9)
    assert linear_cka(x, y) < 0.2
    assert linear_cka(x, x @ random_orthogonal(10, 10)) == pytest.approx(1.0, abs=1e-10)


def test_cka_rejects_mismatched_inputs_and_constant_features_give_nan():
    with pytest.raises(ValueError, match="same inputs"):
        linear_cka(randn(10, 3), randn(11, 3))
    assert math.isnan(linear_cka(torch.ones(10, 3), randn(10, 3)))


def test_non_finite_features_are_a_clear_error_not_a_silent_nan_or_a_linalg_failure():
    # a diverged model's features: CKA used to return NaN as for a constant layer (which it is not), the spectrum
    # to fail inside the SVD ("linalg.svd: The algorithm failed to converge")
    bad = randn(20, 4)
    bad[3, 1] = math.nan
    with pytest.raises(ValueError, match="not finite"):
        linear_cka(bad, randn(20, 4))
    with pytest.raises(ValueError, match="not finite"):
        linear_cka(randn(20, 4), bad * math.inf)
    with pytest.raises(ValueError, match="not finite"):
        singular_values(bad)
    model = nn.Sequential(nn.Linear(3, 2))
    broken = {k: torch.full_like(v, math.nan) for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="not finite"):
        pairwise_cka([model.state_dict(), broken], model, randn(8, 3).float(), ["0"])


def small_convnet() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Dropout(0.5), nn.Linear(8, 3))


def other_state(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = gen(seed)
    return {k: torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def test_layer_features_shapes_and_values_equal_a_manual_forward():
    model = small_convnet()
    model.train()
    state = other_state(model, 1)  # not the module's own weights: the state must be the one used
    x = torch.randn(5, 1, 4, 4, generator=gen(2))
    feats = layer_features(model, state, x, ["0", "1", "3", "4"])
    assert {k: tuple(v.shape) for k, v in feats.items()} == {"0": (5, 8), "1": (5, 8), "3": (5, 8), "4": (5, 3)}
    conv = F.conv2d(x, state["0.weight"], state["0.bias"])
    relu = conv.relu().flatten(1)
    logits = F.linear(relu, state["4.weight"], state["4.bias"])  # eval mode: dropout is the identity
    torch.testing.assert_close(feats["0"], conv.flatten(1))
    torch.testing.assert_close(feats["1"], relu)
    torch.testing.assert_close(feats["3"], relu)
    torch.testing.assert_close(feats["4"], logits)
    assert model.training  # the mode is restored
    assert not any(m._forward_hooks for m in model.modules())  # hooks are removed
    chunked = layer_features(model, state, x, ["4"], batch_size=2)
    torch.testing.assert_close(chunked["4"], logits)


def test_layer_features_errors_name_the_problem():
    model = small_convnet()
    state = other_state(model, 1)
    x = torch.randn(3, 1, 4, 4)
    with pytest.raises(KeyError, match="no submodule"):
        layer_features(model, state, x, ["7"])
    with pytest.raises(KeyError, match="4.bias"):
        layer_features(model, {k: v for k, v in state.items() if k != "4.bias"}, x, ["4"])
    relu = nn.ReLU()
    shared = nn.Sequential(nn.Linear(3, 3), relu, nn.Linear(3, 3), relu)
    with pytest.raises(ValueError, match="more than once"):
        layer_features(shared, shared.state_dict(), torch.randn(2, 3), ["1"])


def test_pairwise_cka_and_its_mean_off_diagonal():
    model = small_convnet()
    s0, s1 = other_state(model, 1), other_state(model, 2)
    x = torch.randn(64, 1, 4, 4, generator=gen(3))
    out = pairwise_cka([s0, s0, s1], model, x, ["1", "4"])
    assert set(out) == {"1", "4"}
    for layer, mat in out.items():
        assert mat.shape == (3, 3) and mat.dtype == torch.float64
        torch.testing.assert_close(mat, mat.T)
        torch.testing.assert_close(torch.diagonal(mat), torch.ones(3, dtype=torch.float64))
        assert mat[0, 1] == pytest.approx(1.0, abs=1e-12)  # the same model twice
        f0 = layer_features(model, s0, x, [layer])[layer]
        f1 = layer_features(model, s1, x, [layer])[layer]
        assert mat[0, 2] == pytest.approx(linear_cka(f0, f1), abs=1e-12)
        assert mat[0, 2] < 0.999
    means = mean_pairwise_cka(out)
    assert means["4"] == pytest.approx((1 + 2 * float(out["4"][0, 2])) / 3, abs=1e-12)
    few = x[:5]  # fewer probes than features: the Gram-matrix route
    gram_route = pairwise_cka([s0, s1], model, few, ["1"])["1"]
    f0, f1 = (layer_features(model, s, few, ["1"])["1"] for s in (s0, s1))
    assert gram_route[0, 1] == pytest.approx(reference_cka(f0, f1), rel=1e-10)
    hand = torch.tensor([[1.0, 0.2, 0.4], [0.2, 1.0, 0.6], [0.4, 0.6, 1.0]])
    assert mean_off_diagonal(hand) == pytest.approx(0.4)


# ------------------------------------------------------------------ classifier norms
def test_weight_norms_equal_row_norms():
    w = torch.randn(10, 16, generator=gen(0))
    torch.testing.assert_close(class_weight_norms(w), torch.linalg.norm(w.double(), dim=1))


def test_norm_count_correlation_signs():
    counts = torch.tensor([5.0, 120.0, 0.0, 33.0, 800.0, 7.0])
    directions = F.normalize(torch.randn(6, 16, generator=gen(1), dtype=torch.float64), dim=1)
    proportional = norm_count_correlation(directions * (0.01 * counts + 0.5).unsqueeze(1), counts)
    assert proportional["pearson"] == pytest.approx(1.0, abs=1e-12)
    assert proportional["spearman"] == pytest.approx(1.0, abs=1e-12)
    reversed_ = norm_count_correlation(directions * (10.0 - 0.01 * counts).unsqueeze(1), counts)
    assert reversed_["pearson"] == pytest.approx(-1.0, abs=1e-12)
    assert reversed_["spearman"] == pytest.approx(-1.0, abs=1e-12)
    logs = torch.log1p(counts)  # monotone but not linear: Spearman 1, Pearson below 1
    assert spearman(logs, counts) == pytest.approx(1.0)
    assert pearson(logs, counts) < 0.9


def test_average_ranks_and_spearman_with_ties():
    expected = torch.tensor([4.0, 1.0, 2.5, 2.5], dtype=torch.float64)
    torch.testing.assert_close(average_ranks([3.0, 1.0, 2.0, 2.0]), expected)
    # Spearman with ties = Pearson of average ranks, worked by hand: ranks a=[1,2.5,2.5,4], b=[1,2,3,4]
    assert spearman([1, 2, 2, 3], [10, 20, 30, 40]) == pytest.approx(4.5 / math.sqrt(4.5 * 5.0))
    assert math.isnan(pearson([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))


def test_spearman_of_nan_values_is_nan_as_scipy_not_a_rank_correlation_of_the_nan_positions():
    # a diverged classifier's row norms are all NaN: the ranks used to be the NaNs' positions (1..C), so
    # spearman(NaN norms, counts) came out as +-1 (and 0.4 with one NaN) in the weight-norm figure's title
    stats = pytest.importorskip("scipy.stats")
    counts = [1.0, 2.0, 3.0, 4.0, 5.0]
    for norms in ([math.nan] * 5, [1.0, math.nan, 3.0, 4.0, 5.0]):
        assert math.isnan(stats.spearmanr(norms, counts).statistic)  # the reference (nan_policy="propagate")
        assert math.isnan(spearman(norms, counts)), norms
        assert math.isnan(norm_count_correlation(torch.tensor(norms).unsqueeze(1), counts)["spearman"])
    assert torch.isnan(average_ranks([2.0, math.nan, 1.0])).all()
    a, b = [0.3, -1.0, 2.0, 2.0, 5.0, math.inf], [4.0, 1.0, 1.0, 3.0, 0.0, 2.0]  # inf ranks like any number
    assert spearman(a, b) == pytest.approx(stats.spearmanr(a, b).statistic, abs=1e-12)


def test_clients_norm_count_correlation():
    counts = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    weights = [torch.diag(torch.tensor([1.0, 2.0, 3.0])), torch.diag(torch.tensor([1.0, 2.0, 3.0]))]
    out = clients_norm_count_correlation(weights, counts)
    assert out["pearson"] == pytest.approx([1.0, -1.0])
    assert out["spearman"] == pytest.approx([1.0, -1.0])
    assert out["norms"] == [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]
    with pytest.raises(ValueError):
        clients_norm_count_correlation(weights, counts[:1])


# ------------------------------------------------------------------ spectrum
@pytest.mark.parametrize("k", [1, 3, 7])
def test_spectrum_of_rank_k_features(k):
    d = 16
    feats = randn(300, k, seed=k) @ randn(k, d, seed=10 + k)
    s = singular_values(feats, normalize=True)
    assert s.shape == (d,)
    assert torch.all(s[:-1] >= s[1:])  # descending
    assert s[0] == 1.0
    assert int((s > 1e-6).sum()) == k
    assert numerical_rank(feats) == k
    torch.testing.assert_close(singular_values(feats, normalize=True, log10=True)[:k], torch.log10(s[:k]))


def test_singular_values_equal_numpy_covariance_eigenvalues():
    feats = randn(50, 6, seed=3) * torch.arange(1, 7, dtype=torch.float64)
    expected = np.sort(np.linalg.eigvalsh(np.cov(feats.numpy().T)))[::-1].copy()
    torch.testing.assert_close(singular_values(feats), torch.from_numpy(expected))


def test_effective_rank():
    d = 16
    assert effective_rank(randn(5000, d, seed=4)) > 0.97 * d  # isotropic: near d
    assert effective_rank(randn(500, 2, seed=5) @ randn(2, d, seed=6)) < 2.0 + 1e-6
    assert effective_rank_of_spectrum(torch.tensor([2.0, 2.0, 2.0, 0.0, 0.0])) == pytest.approx(3.0)
    assert effective_rank_of_spectrum(torch.tensor([5.0, 0.0])) == pytest.approx(1.0)


# ------------------------------------------------------------------ sliced Wasserstein
def random_mixture(k: int, d: int, seed: int) -> GaussianMixture:
    g = gen(seed)
    a = torch.randn(k, d, d, generator=g, dtype=torch.float64)
    covs = a @ a.transpose(1, 2) / d + 0.1 * torch.eye(d, dtype=torch.float64)
    return GaussianMixture(torch.rand(k, generator=g) + 0.1, 3 * torch.randn(k, d, generator=g), covs)


def test_swd_of_identical_mixtures_is_zero_and_symmetric():
    a, a_again, b = random_mixture(3, 5, 0), random_mixture(3, 5, 0), random_mixture(4, 5, 1)
    assert sliced_wasserstein(a, a_again, num_projections=64) == 0.0
    ab = sliced_wasserstein(a, b, num_projections=64)
    assert ab > 0.5
    assert sliced_wasserstein(b, a, num_projections=64) == pytest.approx(ab, rel=1e-12)


def test_swd_grows_with_mean_shift():
    a = random_mixture(2, 4, 2)
    b = GaussianMixture(a.weights, a.means, 1.7 * a.covs)  # same means, wider: SW > 0 at zero shift
    delta = torch.tensor([1.0, -0.5, 0.3, 0.8], dtype=torch.float64)
    values = [
        sliced_wasserstein(a, GaussianMixture(b.weights, b.means + t * delta, b.covs), num_projections=32)
        for t in [0.0, 0.25, 0.5, 1.0, 2.0, 4.0]
    ]
    assert values[0] > 0
    assert all(u < v for u, v in itertools.pairwise(values)), values


def test_swd_of_two_gaussians_with_a_mean_difference():
    d = 6
    c = randn(d, d, seed=3)
    cov = c @ c.T / d + torch.eye(d, dtype=torch.float64)
    delta = randn(d, seed=4)
    a, b = GaussianMixture.gaussian(torch.zeros(d), cov), GaussianMixture.gaussian(delta, cov)
    expected = float(delta.square().sum()) / d  # E_theta[(theta . delta)^2]
    assert sliced_wasserstein(a, b, num_projections=4000, seed=0) ** 2 == pytest.approx(expected, rel=0.1)
    # orthogonal directions in full blocks sum (theta . delta)^2 to ||delta||^2 exactly
    assert sliced_wasserstein(a, b, num_projections=3 * d, orthogonal=True) ** 2 == pytest.approx(expected, rel=1e-9)
    # per direction the 1-D distance is exactly |theta . delta|
    theta = random_directions(5, d, seed=1)
    z, _ = quantile_grid()
    diff = projected_quantiles(b, theta, z) - projected_quantiles(a, theta, z)
    torch.testing.assert_close(diff, (theta @ delta).unsqueeze(1).expand_as(diff), rtol=0, atol=1e-12)


def test_swd_one_dimensional_closed_forms():
    a = GaussianMixture.gaussian(torch.zeros(1), torch.eye(1))
    b = GaussianMixture.gaussian(torch.ones(1), 4 * torch.eye(1))
    # W_2^2 between N(m1, s1^2) and N(m2, s2^2) is (m1 - m2)^2 + (s1 - s2)^2 = 1 + 1
    assert sliced_wasserstein(a, b, num_projections=4) ** 2 == pytest.approx(2.0, rel=1e-9)
    # W_1 = E|1 + Z| = 2 phi(1) + 2 Phi(1) - 1 (the kink at Z = -1 limits the quadrature to ~1e-4)
    w1 = 2 * math.exp(-0.5) / math.sqrt(2 * math.pi) + math.erf(1 / math.sqrt(2))
    assert sliced_wasserstein(a, b, p=1, num_projections=4) == pytest.approx(w1, rel=1e-3)
    # a multimodal mixture and its translate: W_p = |shift| for every p
    mix = GaussianMixture(
        torch.tensor([0.3, 0.5, 0.2]), torch.tensor([[-5.0], [0.0], [7.0]]), torch.tensor([[[1.0]], [[0.25]], [[4.0]]])
    )
    moved = GaussianMixture(mix.weights, mix.means + 0.7, mix.covs)
    for p in (1.0, 2.0, 3.0):
        assert sliced_wasserstein(mix, moved, p=p, num_projections=4) == pytest.approx(0.7, rel=1e-9)


def test_projected_quantiles_invert_the_mixture_cdf():
    mix = GaussianMixture(
        torch.tensor([0.3, 0.5, 0.2]), torch.tensor([[-5.0], [0.0], [7.0]]), torch.tensor([[[1.0]], [[0.25]], [[4.0]]])
    )
    z, _ = quantile_grid(201)
    q = projected_quantiles(mix, torch.ones(1, 1, dtype=torch.float64), z)[0]
    assert torch.all(q[1:] > q[:-1])
    sd, mu, logw = mix.covs[:, 0, 0].sqrt(), mix.means[:, 0], mix.weights.log()
    a = (q.unsqueeze(1) - mu) / sd
    log_cdf = torch.logsumexp(logw + torch.special.log_ndtr(a), dim=1)  # lower levels
    log_sf = torch.logsumexp(logw + torch.special.log_ndtr(-a), dim=1)  # upper levels, tail-exact
    err = torch.where(z <= 0, log_cdf - torch.special.log_ndtr(z), log_sf - torch.special.log_ndtr(-z))
    assert err.abs().max() < 1e-10


def test_swd_is_deterministic_and_the_matrix_matches_pairs():
    mixes = [random_mixture(3, 4, s) for s in range(3)]
    one = sliced_wasserstein(mixes[0], mixes[1], num_projections=16, seed=5)
    assert sliced_wasserstein(mixes[0], mixes[1], num_projections=16, seed=5) == one
    assert sliced_wasserstein(mixes[0], mixes[1], num_projections=16, generator=gen(5)) == one
    assert sliced_wasserstein(mixes[0], mixes[1], num_projections=16, seed=6) != one
    mat = sliced_wasserstein_matrix(mixes, num_projections=16, seed=5)
    assert mat.shape == (3, 3)
    torch.testing.assert_close(mat, mat.T, rtol=0, atol=0)
    assert torch.all(torch.diagonal(mat) == 0)
    assert mat[0, 1] == pytest.approx(one, rel=1e-12)
    assert mat[1, 2] == pytest.approx(sliced_wasserstein(mixes[1], mixes[2], num_projections=16, seed=5), rel=1e-12)


def test_mixture_from_features():
    feats = torch.tensor([[0.0, 0.0], [2.0, 0.0], [5.0, 5.0], [5.0, 7.0], [5.0, 9.0]])
    labels = torch.tensor([0, 0, 2, 2, 2])
    mix = GaussianMixture.from_features(feats, labels, num_classes=4)  # classes 1 and 3 absent: dropped
    torch.testing.assert_close(mix.weights, torch.tensor([0.4, 0.6], dtype=torch.float64))
    torch.testing.assert_close(mix.means, torch.tensor([[1.0, 0.0], [5.0, 7.0]], dtype=torch.float64))
    torch.testing.assert_close(mix.covs[1], torch.tensor([[0.0, 0.0], [0.0, 4.0]], dtype=torch.float64))
    with pytest.raises(ValueError):
        GaussianMixture(torch.tensor([1.0, -1.0]), torch.zeros(2, 2), torch.zeros(2, 2, 2))


# ------------------------------------------------------------------ t-SNE
@pytest.mark.skipif(not HAS_SKLEARN, reason="scikit-learn is not installed (optional extra hetfl[analysis])")
def test_tsne_embedding_is_seeded():
    feats = torch.cat([randn(20, 8, seed=1), randn(20, 8, seed=2) + 6.0]).float()
    emb = tsne_embedding(feats, seed=3, perplexity=5.0)
    assert emb.shape == (40, 2) and emb.dtype == torch.float32
    torch.testing.assert_close(tsne_embedding(feats, seed=3, perplexity=5.0), emb)


def test_tsne_without_sklearn_tells_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.manifold", None)  # makes the import fail
    with pytest.raises(ImportError, match=r'pip install "hetfl\[analysis\]"'):
        tsne_embedding(torch.randn(10, 3))


# ------------------------------------------------------------------ curves
def metrics_rows(personalised: bool = False) -> list[dict]:
    rows = []
    evaluated = {2: (0.30, [0.1, 0.4, 0.2, 0.8]), 4: (0.55, [0.5, 0.5, 0.6, 0.7]), 5: (0.62, [0.6, 0.6, 0.6, 0.9])}
    for r in range(1, 6):
        row = {"round": r, "train_loss": 1.0 / r, "bytes_up": 100 * r, "bytes_down": 1000, "round_time_s": 0.5}
        if r in evaluated:
            acc, clients = evaluated[r]
            if not personalised:
                row["global_acc"] = acc
            row.update(client_acc_mean=float(np.mean(clients)), client_acc_std=float(np.std(clients)),
                       client_acc=clients)
        rows.append(row)
    return rows


def write_metrics(run_dir: Path, rows: list[dict], tail: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return run_dir


def test_rounds_to_target(tmp_path):
    rows = load_metrics(write_metrics(tmp_path / "run", metrics_rows()))
    assert rounds_to_target(rows, 0.5) == 4
    assert rounds_to_target(rows, 0.55) == 4  # reaching the target exactly counts
    assert rounds_to_target(rows, 0.3) == 2
    assert rounds_to_target(rows, 0.62) == 5
    assert rounds_to_target(rows, 0.7) is None
    # client means: round 2 0.375, round 4 0.575, round 5 0.675
    assert rounds_to_target(rows, 0.57, key="client_acc_mean") == 4
    assert rounds_to_target(rows, 0.6, key="client_acc_mean") == 5
    personal = metrics_rows(personalised=True)
    assert rounds_to_target(personal, 0.5) == 4  # no global_acc: falls back to client_acc_mean


def test_client_spread_quartiles_by_hand():
    spread = client_spread(metrics_rows())
    assert spread["round"] == [2, 4, 5]
    # round 2: sorted [0.1, 0.2, 0.4, 0.8]; q25 at position 0.75 -> 0.175, median 0.3, q75 at 2.25 -> 0.5
    assert spread["min"][0] == pytest.approx(0.1)
    assert spread["q25"][0] == pytest.approx(0.175)
    assert spread["median"][0] == pytest.approx(0.3)
    assert spread["q75"][0] == pytest.approx(0.5)
    assert spread["max"][0] == pytest.approx(0.8)
    assert spread["num_clients"] == [4, 4, 4]


def test_curves_accuracy_loss_and_bytes(tmp_path):
    rows = metrics_rows()
    acc = accuracy_curves(rows)
    assert acc["round"] == [2, 4, 5]
    assert acc["global_acc"] == [0.30, 0.55, 0.62]
    assert accuracy_curves(metrics_rows(personalised=True))["global_acc"] == [None, None, None]
    assert train_loss_curve(rows) == {"round": [1, 2, 3, 4, 5], "train_loss": [1.0, 0.5, 1 / 3, 0.25, 0.2]}
    traffic = cumulative_bytes(rows)
    assert traffic["bytes_up"] == [100, 300, 600, 1000, 1500]
    assert traffic["bytes_down"] == [1000, 2000, 3000, 4000, 5000]
    assert traffic["bytes_total"] == [1100, 2300, 3600, 5000, 6500]
    everything = run_curves(write_metrics(tmp_path / "run", rows))
    assert everything["accuracy_key"] == "global_acc" and everything["wall_time_s"] == pytest.approx(2.5)


def test_load_metrics_skips_a_half_written_last_line_only(tmp_path):
    rows = metrics_rows()
    assert len(load_metrics(write_metrics(tmp_path / "a", rows, tail='{"round": 6, "train_')) ) == 5
    bad = tmp_path / "b"
    write_metrics(bad, rows[:2])
    (bad / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\nnot json\n" + json.dumps(rows[1]) + "\n")
    with pytest.raises(ValueError, match=":2:"):
        load_metrics(bad / "metrics.jsonl")


# ------------------------------------------------------------------ plots
def assert_written(paths: dict[str, Path]) -> None:
    png = paths["png"].read_bytes()
    assert png[:8] == PNG_SIGNATURE and len(png) > 2000
    assert paths["data"].stat().st_size > 0


def read_csv(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_plot_cka(tmp_path):
    mats = {"conv": torch.tensor([[1.0, 0.9], [0.9, 1.0]]), "fc": torch.tensor([[1.0, 0.3], [0.3, 1.0]])}
    paths = plot_cka(mats, tmp_path)
    assert_written(paths)
    data = json.loads(paths["data"].read_text())
    assert data["mean_off_diagonal"] == pytest.approx({"conv": 0.9, "fc": 0.3})


def test_plot_weight_norms(tmp_path):
    counts = torch.tensor([[5.0, 50.0, 0.0], [10.0, 10.0, 80.0]])
    norms = torch.tensor([[0.5, 1.5, 0.2], [0.8, 0.7, 2.0]])
    paths = plot_weight_norms(norms, counts, tmp_path)
    assert_written(paths)
    rows = read_csv(paths["data"])
    assert rows[0] == ["client", "class", "count", "norm"] and len(rows) == 1 + 6
    assert_written(plot_weight_norms(norms[0], counts[0], tmp_path, name="one_client"))


def test_plot_spectrum(tmp_path):
    spectra = {"global": singular_values(randn(100, 8, seed=1)),
               "collapsed": singular_values(randn(100, 2, seed=2) @ randn(2, 8, seed=3))}
    paths = plot_spectrum(spectra, tmp_path)
    assert_written(paths)
    rows = read_csv(paths["data"])
    assert rows[0] == ["index", "global", "collapsed"] and len(rows) == 1 + 8


def test_plot_swd_matrix(tmp_path):
    mixes = [random_mixture(2, 3, s) for s in range(3)]
    mat = sliced_wasserstein_matrix(mixes, num_projections=8)
    paths = plot_swd_matrix(mat, tmp_path, labels=["a", "b", "c"])
    assert_written(paths)
    rows = read_csv(paths["data"])
    assert rows[0] == ["", "a", "b", "c"] and float(rows[1][2]) == pytest.approx(float(mat[0, 1]))


def test_plot_tsne(tmp_path):
    emb = torch.randn(60, 2, generator=gen(0))
    labels = torch.arange(60) % 5
    clients = torch.arange(60) // 20
    paths = plot_tsne(emb, labels, tmp_path, clients=clients)
    assert_written(paths)
    rows = read_csv(paths["data"])
    assert rows[0] == ["x", "y", "label", "client"] and len(rows) == 61
    assert_written(plot_tsne(emb, labels, tmp_path, name="classes_only"))


def test_plot_curves(tmp_path):
    run = write_metrics(tmp_path / "run", metrics_rows())
    paths = plot_curves(run, tmp_path / "single")
    assert_written(paths)
    paths = plot_curves({"fedavg": run, "personal": metrics_rows(personalised=True)}, tmp_path / "two", target=0.5)
    assert_written(paths)
    data = json.loads(paths["data"].read_text())
    assert data["fedavg"]["rounds_to_target"] == {"target": 0.5, "round": 4}
    assert data["personal"]["accuracy"]["global_acc"] == [None, None, None]
