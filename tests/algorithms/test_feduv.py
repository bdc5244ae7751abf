"""FedUV's regularisers: the authors' numbers, hand-computed examples and the combined loss."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import Batch, ClientContext
from hetfl.algorithms.feduv import (
    column_std,
    identity_std,
    median_bandwidth,
    pair_sq_distances,
    uniformity_loss,
    variance_loss,
)
from hetfl.params import ConfigError
from tests.helpers import tiny_setup

# Golden values from the authors' code: github.com/sonhamin/FedUV, algs/feduv.py, class UVReg, forward()
# (std_loss = mean(relu(batch_gamma - softmax(X).std(0))) with batch_gamma = eye(D).std(0).mean();
# unif_loss = exp(-pdist(pro1)^2 / median(non-zero pdist^2)).mean(), the median not detached),
# commit dd2e3c59fba20662a4234810f93061f4a4edc1b7. Transcribed into a scratch script outside this repository and
# run with torch 2.13 on: torch.manual_seed(0); logits = randn(8, 10, float64); features = randn(8, 16, float64).
# The loss values and the gradients w.r.t. logits / features are pinned here.
# fmt: off
GOLDEN_LV = 0.2188056618680494
GOLDEN_LU = 0.3770800056756686
# GOLDEN_DLV: shape 8 x 10, row-major
GOLDEN_DLV = (
    2.4669952342e-04, 1.0898083015e-03, 7.0298733414e-04, 1.5054229001e-03, 7.4007682306e-04, 5.6299273023e-04,
    5.5754462795e-04, 5.7343552064e-04, 4.3104935254e-04, -6.4100171135e-03, 1.1912558983e-03, -7.4933529126e-03,
    3.7121730619e-04, 4.8726206565e-04, 1.2106082592e-03, 1.4454412611e-03, 8.2310615820e-04, 7.0095977123e-04,
    3.9607974859e-04, 8.6742244402e-04, 7.6292957082e-04, 1.2986340117e-03, 1.0433703227e-03, 7.2754541849e-04,
    -4.6809282647e-03, 9.3584488046e-04, 5.7017963466e-04, 3.2288207551e-04, 5.7038726553e-04, -1.5508449150e-03,
    7.3904578166e-04, 6.6436283013e-04, 9.3955896543e-04, 1.8187268928e-03, 5.1878510640e-04, 5.1507807682e-04,
    4.3879748032e-04, 4.5345788974e-04, -7.2077800974e-03, 1.1199670741e-03, -7.8924305561e-04, 1.0736844601e-03,
    4.7342396275e-04, -3.9681546649e-03, 7.3196107395e-04, 7.7671045537e-04, 3.5107811334e-04, 5.6661502708e-05,
    5.5226403908e-05, 1.2386517484e-03, -1.4874753308e-03, 4.7698655701e-04, 5.5027334890e-04, -4.1189014508e-03,
    1.2534407943e-03, 1.4949700970e-03, 2.5163546250e-04, 1.2468685771e-04, 7.4504924268e-04, 7.0933442150e-04,
    7.7122162562e-04, 1.1983111964e-03, -4.3537842357e-03, 1.1385760112e-03, 4.4440782577e-04, 8.7435722511e-04,
    -3.3315851507e-03, 5.9104381354e-04, 6.6988484079e-04, 1.9975668479e-03, 2.0200440702e-04, 1.6984931928e-03,
    1.3590093698e-03, 5.7540198241e-04, 9.1812515362e-04, -5.5841795393e-03, 7.2122627049e-04, -3.2014126142e-03,
    7.3269585417e-04, 2.5786359231e-03,
)
# GOLDEN_DLU: shape 8 x 16, row-major
GOLDEN_DLU = (
    3.8403026600e-03, -4.8715797315e-03, 5.0793961911e-03, -4.7716989504e-04, -8.1265471396e-03, -6.6016368795e-03,
    -2.9434093267e-03, -7.2380145453e-03, 3.8298645202e-03, -8.6862174697e-03, -3.9444893636e-03, 3.0903288797e-03,
    5.4022221657e-03, -6.2457323466e-03, 9.8682263134e-03, -8.8867730082e-03, 1.7872700072e-03, -5.0264271375e-03,
    7.0172625915e-03, -6.8190911167e-03, -2.1663403410e-03, 7.2573858959e-04, -1.6267346573e-03, 5.9045597489e-03,
    -3.8793327491e-04, 1.2965506011e-03, 4.7407239418e-04, 1.0444202569e-04, 3.3938665790e-03, -1.9256960980e-02,
    6.9401909931e-03, -3.2568681901e-03, 3.0552920915e-03, -2.7100065963e-03, -1.2165468735e-02, -7.3533557906e-05,
    -1.0998385929e-02, -3.0793351814e-03, -1.4471566905e-03, 2.8303012066e-03, -7.4996637514e-03, 5.5259382151e-03,
    -4.6118697455e-03, 1.0279191043e-03, -1.8627495975e-03, -3.5070064737e-04, -1.5687992008e-02, 3.1900000128e-03,
    -3.1579819763e-03, -3.0147669932e-03, 1.3284259906e-02, 7.1821072543e-03, -8.5419114559e-03, 1.5967980979e-03,
    -2.0211615605e-03, -2.0231220191e-04, -5.6515606759e-04, 4.1659886782e-03, 4.0536963029e-04, -5.2076238364e-04,
    -5.8185816210e-03, 1.3889947646e-02, 5.6130659492e-03, 2.0999393875e-03, -2.3160833675e-03, 2.5436417133e-03,
    3.3409928089e-03, 2.3333754349e-03, 9.1544759278e-03, 1.3344047024e-02, -7.6979318292e-03, 6.9210055373e-03,
    4.8546980877e-03, 7.9259486487e-03, 2.7527736697e-03, 2.2801406217e-03, -6.5101314065e-03, -3.5366612694e-03,
    5.4131084201e-04, 1.2064756615e-02, -6.7401926922e-03, 9.1022144079e-03, -8.1034257226e-03, 2.7348530511e-03,
    9.3267097343e-03, -5.1492980531e-03, 1.3605839298e-02, 2.0791869745e-03, 1.2438403439e-03, 3.7140753793e-04,
    -5.1615674275e-03, -5.9276453006e-03, 7.9686217522e-03, -8.8459224071e-04, -6.5128932893e-04, 1.0653137915e-03,
    1.7941084285e-02, -3.2551709593e-02, 4.6043468643e-02, -4.5728562339e-03, 3.6798048319e-02, 3.1833145500e-02,
    2.1965370174e-02, -2.1030855116e-02, 2.3706220167e-02, 7.8506535979e-03, 2.3721333311e-02, 3.2588757798e-02,
    2.5262418740e-02, 2.9370683799e-02, -3.3270548389e-02, -4.7677624262e-02, -1.4409691008e-02, 3.6528633930e-02,
    -5.4496485683e-02, -3.0768493671e-04, -2.5446049115e-02, -3.2669459098e-02, -1.9834815408e-02, 1.0736128396e-02,
    -2.5181870025e-02, -1.8450269809e-02, -1.3635622468e-02, -3.2643180745e-02, -2.7835666611e-02, -1.2985983961e-02,
    2.6647035629e-02, 4.1401255653e-02,
)
# fmt: on


def golden_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 10, dtype=torch.float64, generator=gen).requires_grad_()
    features = torch.randn(8, 16, dtype=torch.float64, generator=gen).requires_grad_()
    return logits, features


def test_variance_loss_matches_the_authors_value_and_gradient():
    logits, _ = golden_inputs()
    lv = variance_loss(logits)
    lv.backward()
    # the code's threshold eye(D).std(0).mean() is computed in float32 (3e-8 from 1/sqrt(10))
    assert lv.item() == pytest.approx(GOLDEN_LV, abs=1e-7)
    expected = torch.tensor(GOLDEN_DLV, dtype=torch.float64).reshape(8, 10)
    torch.testing.assert_close(logits.grad, expected, rtol=1e-6, atol=1e-12)


def test_uniformity_loss_matches_the_authors_value_and_gradient():
    """Code bandwidth (σ), the other settings at their defaults: the gradient flows through the median."""
    _, features = golden_inputs()
    lu = uniformity_loss(features, bandwidth="code")
    lu.backward()
    assert lu.item() == pytest.approx(GOLDEN_LU, rel=1e-12)
    expected = torch.tensor(GOLDEN_DLU, dtype=torch.float64).reshape(8, 16)
    torch.testing.assert_close(features.grad, expected, rtol=1e-6, atol=1e-12)


def test_uniformity_loss_is_scale_invariant_so_it_has_no_radial_gradient():
    """With the gradient through σ, L_U(c z) = L_U(z): Σ_i <z_i, ∂L_U/∂z_i> = 0. With σ detached (the ablation)
    the gradient points inwards, so descent pushes every feature outwards (what made raw features blow up)."""
    for bandwidth in ("paper", "code"):
        _, z = golden_inputs()
        uniformity_loss(z, bandwidth).backward()
        assert (z * z.grad).sum().item() == pytest.approx(0.0, abs=1e-12)
        assert uniformity_loss(3 * z.detach(), bandwidth).item() == pytest.approx(uniformity_loss(z, bandwidth).item())
        _, z = golden_inputs()
        uniformity_loss(z, bandwidth, sigma_grad=False).backward()
        cosine = (z * z.grad).sum().item() / (z.norm() * z.grad.norm()).item()
        assert cosine < -0.8  # the gradient is mostly radial and inward: descent pushes the features outwards


def test_threshold_is_the_identity_column_std():
    assert identity_std(10) == pytest.approx(0.316227766)
    assert identity_std(7) == pytest.approx(torch.eye(7).std(0, correction=1).mean().item())


def test_variance_loss_hand_values():
    # probabilities [[.5, .5], [.75, .25]]: column std (ddof 1) = sqrt(1/32) for both columns; c = 1/sqrt(2)
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    expected = 1 / math.sqrt(2) - math.sqrt(1 / 32)
    assert variance_loss(logits).item() == pytest.approx(expected, rel=1e-6)
    assert variance_loss(logits, eps=1e-4).item() == pytest.approx(1 / math.sqrt(2) - math.sqrt(1 / 32 + 1e-4))
    # a balanced one-hot batch meets the threshold: no penalty
    assert variance_loss(torch.eye(5) * 50).item() == pytest.approx(0.0, abs=1e-6)
    # identical rows have no spread: the full hinge c
    assert variance_loss(torch.zeros(4, 5)).item() == pytest.approx(identity_std(5))
    assert variance_loss(torch.zeros(4, 5), eps=1e-4).item() == pytest.approx(identity_std(5) - 0.01)


def test_variance_loss_gradient_is_finite_when_nothing_varies():
    """Collapsed features give the same probabilities for the whole batch: the plain std's gradient is 0/0
    there (NaN, seen on MNIST). Such a column gets gradient 0; the other columns keep theirs."""
    logits = torch.zeros(8, 10, requires_grad=True)
    variance_loss(logits).backward()
    assert torch.isfinite(logits.grad).all()
    mixed = torch.zeros(6, 3)
    mixed[:, 0] = torch.linspace(-1, 1, 6)
    mixed.requires_grad_()
    variance_loss(mixed).backward()
    assert torch.isfinite(mixed.grad).all() and mixed.grad.abs().sum() > 0


def test_uniformity_loss_hand_values():
    z = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])  # squared distances 1, 4, 5; median 4
    paper = (math.exp(-1 / 8) + math.exp(-4 / 8) + math.exp(-5 / 8)) / 3
    code = (math.exp(-1 / 4) + math.exp(-1) + math.exp(-5 / 4)) / 3
    assert uniformity_loss(z).item() == pytest.approx(paper, rel=1e-6)
    assert uniformity_loss(z, bandwidth="code").item() == pytest.approx(code, rel=1e-6)
    assert uniformity_loss(z, sigma_grad=False).item() == pytest.approx(paper, rel=1e-6)
    normalised = uniformity_loss(torch.tensor([[3.0, 0.0], [0.0, 5.0]]), normalize=True)
    assert normalised.item() == pytest.approx(math.exp(-2 / 4), rel=1e-6)  # unit vectors 2 apart squared


def test_batches_of_one_and_of_equal_points_are_safe():
    z = torch.randn(1, 4, requires_grad=True)
    logits = torch.randn(1, 3, requires_grad=True)
    total = variance_loss(logits) + uniformity_loss(z)
    total.backward()
    assert total.item() == 0 and torch.count_nonzero(z.grad) == 0 and torch.count_nonzero(logits.grad) == 0
    same = torch.ones(3, 4, requires_grad=True)
    loss = uniformity_loss(same)
    loss.backward()
    assert loss.item() == pytest.approx(1.0) and torch.isfinite(same.grad).all()


def test_feduv_weights_and_bad_lam():
    setup = tiny_setup()
    assert build_algorithm("feduv", {}, setup).variance_weight == 3 / 4  # D/4 with D = 3
    assert build_algorithm("feduv", {"lam": 2.5}, setup).variance_weight == 2.5
    assert build_algorithm("feduv", {"lam": 0.5}, setup).variance_weight == 0.5
    assert build_algorithm("feduv", {"lam": 0.0}, setup).variance_weight == 0.0  # L_V off: allowed
    with pytest.raises(ConfigError, match=r"algorithm\.lam = -2\.0: must be >= 0, or -1 for num_classes / 4"):
        build_algorithm("feduv", {"lam": -2.0}, setup)


def test_uniformity_bandwidth_counts_every_nonzero_distance_even_small_ones():
    """Features at 1/100 of the golden ones: every squared distance is below 1 and still counts for σ
    (L_U is scale-free, so the value is the golden one)."""
    _, z = golden_inputs()
    small = 0.01 * z.detach()
    assert pair_sq_distances(small).max() < 1
    assert uniformity_loss(small).item() == pytest.approx(uniformity_loss(z.detach()).item(), rel=1e-9)


def test_normalize_puts_uniformity_on_the_unit_sphere():
    """normalize=True: L_U of the rows scaled to unit norm (so one row's length changes nothing)."""
    _, z = golden_inputs()
    z = z.detach()
    unit = z / z.norm(dim=1, keepdim=True)
    assert uniformity_loss(z, normalize=True).item() == pytest.approx(uniformity_loss(unit).item(), rel=1e-12)
    stretched = z.clone()
    stretched[0] *= 7
    assert uniformity_loss(stretched, normalize=True).item() == pytest.approx(
        uniformity_loss(z, normalize=True).item(), rel=1e-12)
    assert uniformity_loss(stretched).item() != pytest.approx(uniformity_loss(z).item(), rel=1e-6)


@pytest.mark.parametrize("options", [{}, {"bandwidth": "code", "lam": 2.5, "mu": 0.2},
                                     {"normalize": True, "sigma_grad": False, "eps": 1e-3}])
def test_feduv_loss_is_ce_plus_weighted_terms_on_logits_and_features(options):
    """Each term computed here from the model's own features (classifier input) and logits, with the
    functions' defaults (σ not detached): loss, logged terms and the gradient w.r.t. the weights agree."""
    setup = tiny_setup()
    algo = build_algorithm("feduv", options, setup)
    state = {
        k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in setup.model.module.state_dict().items()
    }
    weights = [v for v in state.values() if v.requires_grad]
    gen = torch.Generator().manual_seed(1)
    batch = Batch(torch.randn(6, 4, generator=gen), torch.tensor([0, 1, 2, 0, 1, 2]))
    loss, m = algo.loss(state, batch, ClientContext(0, 1, 6, 0.1, state, {}))
    features, logits = setup.model.features_and_logits(state, batch.x)
    assert not torch.allclose(uniformity_loss(features), uniformity_loss(logits))  # the test can tell them apart
    lam, mu = options.get("lam", 3 / 4), options.get("mu", 0.5)
    ce = torch.nn.functional.cross_entropy(logits, batch.y)
    lv = variance_loss(logits, options.get("eps", 0.0))
    lu = uniformity_loss(features, options.get("bandwidth", "paper"), options.get("normalize", False),
                         options.get("sigma_grad", True))
    assert set(m) == {"ce", "variance", "uniformity"}
    torch.testing.assert_close(m["ce"], ce.detach())
    torch.testing.assert_close(m["variance"], lv.detach())
    torch.testing.assert_close(m["uniformity"], lu.detach())
    expected = ce + lam * lv + mu * lu
    torch.testing.assert_close(loss, expected)
    got = torch.autograd.grad(loss, weights, allow_unused=True, retain_graph=True)
    want = torch.autograd.grad(expected, weights, allow_unused=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_column_std_default_is_the_plain_unbiased_std():
    """``column_std(p)`` without eps: torch's std with ddof 1 per column (eq. 3), no eps added."""
    probs = torch.tensor([[0.5, 0.5], [0.75, 0.25], [0.2, 0.8]], dtype=torch.float64)
    torch.testing.assert_close(column_std(probs), probs.std(dim=0, correction=1), rtol=1e-15, atol=0)


def test_median_bandwidth_default_lets_the_gradient_reach_the_median_distance():
    """By default σ keeps its graph (the authors' code): ∂σ/∂sq is 1 at the (lower) median entry, 0 elsewhere;
    ``sigma_grad=False`` detaches it."""
    sq = torch.tensor([4.0, 1.0, 9.0, 0.0, 16.0], requires_grad=True)  # non-zero: 1, 4, 9, 16; lower median 4
    sigma = median_bandwidth(sq)
    assert sigma.item() == 4.0
    sigma.backward()
    torch.testing.assert_close(sq.grad, torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0]))
    assert not median_bandwidth(sq, sigma_grad=False).requires_grad


def test_regularisers_emit_no_warnings():
    """The terms run every step: no (deprecation) warning may flood the training log."""
    logits, features = golden_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (variance_loss(logits) + variance_loss(logits, eps=1e-3)).backward()
        uniformity_loss(features, normalize=True).backward()
