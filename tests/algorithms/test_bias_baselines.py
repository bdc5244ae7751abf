"""FedLC, FedRS and FedDecorr: their defining rules on hand-computed examples."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap

from hetfl.algorithms import build_algorithm, build_posthoc
from hetfl.algorithms.base import Batch, ClientContext
from hetfl.algorithms.feddecorr import decorrelation_loss
from hetfl.algorithms.logit_adjust import (
    FEDLC_SHIFT,
    FEDRS_SCALE,
    calibrated_cross_entropy,
    calibration_shift,
    label_counts,
    restricted_cross_entropy,
    restriction_scale,
)
from hetfl.params import ConfigError
from tests.helpers import initial_state, perturbed, tiny_setup

pytestmark = pytest.mark.usefixtures("one_thread")


def client_ctx(state, labels: torch.Tensor, extras=None) -> ClientContext:
    x = torch.randn(len(labels), 4, generator=torch.Generator().manual_seed(0))
    return ClientContext(0, 1, len(labels), 0.1, state, {}, extras or {}, inputs=lambda: Batch(x, labels))


# ------------------------------------------------------------------------------ FedLC
def test_label_counts_and_calibration_shift():
    counts = label_counts(torch.tensor([0, 0, 2, 0, 0] * 4 + [2, 2]), 4)
    assert counts.tolist() == [16.0, 0.0, 6.0, 0.0]
    shift = calibration_shift(torch.tensor([16.0, 1.0, 0.0, 81.0]), tau=2.0)
    # 2 * 16^(-1/4) = 1, 2 * 1 = 2, absent: 2 * (1e-8)^(-1/4) = 200, 2 * 81^(-1/4) = 2/3
    torch.testing.assert_close(shift, torch.tensor([1.0, 2.0, 200.0, 2.0 / 3.0]))
    # min_count 1: an absent class gets the margin of a class seen once
    torch.testing.assert_close(
        calibration_shift(torch.tensor([16.0, 0.0]), 2.0, min_count=1.0), torch.tensor([1.0, 2.0])
    )


def test_calibrated_ce_is_ce_of_shifted_logits():
    logits = torch.tensor([[0.0, 0.0, 0.0], [1.0, 3.0, -1.0]])
    labels = torch.tensor([0, 1])
    shift = torch.tensor([1.0, 2.0, 200.0])
    # shifted: [-1, -2, -200] and [0, 1, -201]; the absent class drops out of the softmax
    first = 1.0 + math.log(math.exp(-1) + math.exp(-2) + math.exp(-200))
    second = -1.0 + math.log(math.exp(0) + math.exp(1) + math.exp(-201))
    value = calibrated_cross_entropy(logits, labels, shift)
    assert value.item() == pytest.approx((first + second) / 2, rel=1e-6)
    torch.testing.assert_close(value, F.cross_entropy(logits - shift, labels))
    # a rarer class gets a larger margin: its logit must be larger for the same loss
    assert calibration_shift(torch.tensor([1.0, 10.0, 100.0]), 1.0).diff().lt(0).all()


def test_fedlc_begin_and_loss():
    setup = tiny_setup()
    algo = build_algorithm("fedlc", {}, setup)
    assert (algo.hp.tau, algo.hp.min_count) == (1.0, 1e-8)
    state = initial_state(setup)
    labels = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1])  # 16 x class 0, 1 x class 1, no 2
    ctx = client_ctx(state, labels)
    ctx.extras = algo.begin(ctx)
    torch.testing.assert_close(ctx.extras[FEDLC_SHIFT], torch.tensor([0.5, 1.0, 100.0]))
    batch = Batch(torch.randn(5, 4), torch.tensor([0, 1, 0, 1, 0]))
    loss, metrics = algo.loss(state, batch, ctx)
    expected = F.cross_entropy(setup.model.logits(state, batch.x) - torch.tensor([0.5, 1.0, 100.0]), batch.y)
    torch.testing.assert_close(loss, expected)
    assert metrics["calibrated_ce"].item() == pytest.approx(loss.item())
    # tau = 0 is FedAvg's cross-entropy
    plain = build_algorithm("fedlc", {"tau": 0.0}, setup)
    ctx.extras = plain.begin(ctx)
    torch.testing.assert_close(
        plain.loss(state, batch, ctx)[0], F.cross_entropy(setup.model.logits(state, batch.x), batch.y)
    )


def test_fedlc_single_class_client_has_no_loss_by_default():
    setup = tiny_setup()
    state = initial_state(setup)
    labels = torch.tensor([1, 1, 1, 1])
    batch = Batch(torch.randn(4, 4), labels)
    algo = build_algorithm("fedlc", {}, setup)
    ctx = client_ctx(state, labels)
    ctx.extras = algo.begin(ctx)
    assert algo.loss(state, batch, ctx)[0].item() < 1e-30  # the other classes left the softmax
    kept = build_algorithm("fedlc", {"min_count": 1.0}, setup)
    ctx.extras = kept.begin(ctx)
    logits = setup.model.logits(state, batch.x)
    expected = F.cross_entropy(logits - torch.tensor([1.0, 4**-0.25, 1.0]), labels)  # absent: 1^(-1/4) = 1
    torch.testing.assert_close(kept.loss(state, batch, ctx)[0], expected)


# ------------------------------------------------------------------------------ FedRS
def test_restriction_scale_rules():
    counts = torch.tensor([3.0, 0.0, 2.0, 0.0])
    torch.testing.assert_close(restriction_scale(counts, 0.5), torch.tensor([1.0, 0.5, 1.0, 0.5]))
    # the authors' code: alpha + (1 - alpha) n_c / max n
    torch.testing.assert_close(
        restriction_scale(counts, 0.5, "proportional"), torch.tensor([1.0, 0.5, 0.5 + 0.5 * 2 / 3, 0.5])
    )
    torch.testing.assert_close(restriction_scale(counts, 0.0), torch.tensor([1.0, 0.0, 1.0, 0.0]))


def test_restricted_ce_keeps_present_logits_and_scales_absent_ones():
    logits = torch.tensor([[2.0, 4.0, 1.0]])
    scale = torch.tensor([1.0, 0.5, 1.0])  # class 1 absent
    # restricted logits [2, 2, 1]: -2 + log(2 e^2 + e^1)
    expected = -2.0 + math.log(2 * math.exp(2) + math.exp(1))
    assert restricted_cross_entropy(logits, torch.tensor([0]), scale).item() == pytest.approx(expected, rel=1e-6)


def test_fedrs_begin_and_loss():
    setup = tiny_setup()
    algo = build_algorithm("fedrs", {}, setup)
    assert (algo.hp.alpha, algo.hp.scaling) == (0.5, "binary")
    state = perturbed(initial_state(setup), 0.5, seed=1)
    ctx = client_ctx(state, torch.tensor([0, 2, 2, 0, 2]))  # class 1 absent
    ctx.extras = algo.begin(ctx)
    torch.testing.assert_close(ctx.extras[FEDRS_SCALE], torch.tensor([1.0, 0.5, 1.0]))
    batch = Batch(torch.randn(4, 4), torch.tensor([0, 2, 2, 0]))
    logits = setup.model.logits(state, batch.x)
    restricted = logits.clone()
    restricted[:, 1] = 0.5 * logits[:, 1]  # present classes unchanged, the absent one halved
    loss, _ = algo.loss(state, batch, ctx)
    torch.testing.assert_close(loss, F.cross_entropy(restricted, batch.y))
    one = build_algorithm("fedrs", {"alpha": 1.0}, setup)
    ctx.extras = one.begin(ctx)
    torch.testing.assert_close(one.loss(state, batch, ctx)[0], F.cross_entropy(logits, batch.y))  # alpha 1: FedAvg


# ------------------------------------------------------------------------------ FedDecorr
DECORRELATED = torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]])  # zero mean, unit var, cov 0


def test_feddecorr_hand_values():
    # decorrelated: K = I, ||K||_F^2 / d^2 = d / d^2 = 1/2; the code's off-diagonal form is 0
    assert decorrelation_loss(DECORRELATED, form="paper").item() == pytest.approx(0.5, rel=1e-6)
    assert decorrelation_loss(DECORRELATED, form="code").item() == pytest.approx(0.0, abs=1e-7)
    # three mutually orthogonal +-1 columns (rows of a Hadamard matrix): 1/d = 1/3
    hadamard = torch.tensor([[1.0, 1.0, 1.0], [-1.0, 1.0, -1.0], [1.0, -1.0, -1.0], [-1.0, -1.0, 1.0]])
    assert decorrelation_loss(hadamard, form="paper").item() == pytest.approx(1 / 3, rel=1e-6)
    # identical columns: K = all ones, paper 1; code: C_ij = (N - 1) off the diagonal, (N - 1)^2 / N = 9/4
    same = torch.tensor([1.0, 2.0, 3.0, 4.0]).unsqueeze(1).repeat(1, 3)
    assert decorrelation_loss(same, form="paper").item() == pytest.approx(1.0, rel=1e-6)
    assert decorrelation_loss(same, form="code").item() == pytest.approx(9 / 4, rel=1e-6)
    # correlation 1/sqrt(3): a = [1,-1,1,-1], b = [1,1,1,-1] (cov 1/2, var_a 1, var_b 3/4)
    # paper (2 + 2/3) / 4 = 2/3; code: C_ab = (N-1) rho, (9 * 1/3) / 4 = 3/4
    ab = torch.tensor([[1.0, 1.0], [-1.0, 1.0], [1.0, 1.0], [-1.0, -1.0]])
    assert decorrelation_loss(ab, form="paper").item() == pytest.approx(2 / 3, rel=1e-6)
    assert decorrelation_loss(ab, form="code").item() == pytest.approx(3 / 4, rel=1e-6)
    # standardised: invariant to per-dimension shift and scale
    moved = ab * torch.tensor([5.0, 0.1]) + torch.tensor([3.0, -7.0])
    assert decorrelation_loss(moved, form="paper").item() == pytest.approx(2 / 3, rel=1e-5)


# Golden values from the authors' loss, transcribed into a scratch script (not in this repository) and run in
# float64: bytedance/FedDecorr, loss.py, FedDecorrLoss.forward, commit 973e4af2d416e8dacda1fb19a328e440f9e815af.
GOLDEN_X = (torch.arange(24, dtype=torch.float64).reshape(6, 4) * 0.37).sin() + torch.tensor(
    [0.0, 1.0, 0.0, 2.0], dtype=torch.float64) * (torch.arange(6, dtype=torch.float64).reshape(6, 1) / 5)
GOLDEN_Y = torch.tensor([[1.0, 2.0, 0.5], [-1.0, 0.0, 1.5], [0.5, -2.0, 2.0], [2.0, 1.0, -1.0], [0.0, 0.5, 0.0]],
                        dtype=torch.float64)


def test_feddecorr_default_is_the_authors_loss():
    """The default form reproduces FedDecorrLoss (value and gradient), about N times the paper form here."""
    assert decorrelation_loss(GOLDEN_X).item() == pytest.approx(2.1288683041053633, rel=1e-12)
    assert decorrelation_loss(GOLDEN_Y).item() == pytest.approx(1.0917862695628116, rel=1e-12)
    same01 = GOLDEN_X.clone()
    same01[:, 1] = same01[:, 0]
    assert decorrelation_loss(same01).item() == pytest.approx(1.8784777718858416, rel=1e-12)
    x = GOLDEN_X.clone().requires_grad_(True)
    decorrelation_loss(x).backward()
    expected = torch.tensor([0.08790037978226768, 0.2990700781906205, -0.6029831593391879, 0.09909416198739686],
                            dtype=torch.float64)
    torch.testing.assert_close(x.grad[0], expected, rtol=1e-9, atol=1e-12)
    # the paper form is ~3.4 times weaker at N = 6 (the ratio grows ~N: 30-60 at batches of 32-64)
    assert decorrelation_loss(GOLDEN_X, form="paper").item() == pytest.approx(0.6331962837124775, rel=1e-9)


def test_feddecorr_degenerate_batches_are_safe():
    one = torch.randn(1, 3, requires_grad=True)
    value = decorrelation_loss(one) + decorrelation_loss(one, form="code")
    value.backward()
    assert value.item() == 0 and torch.count_nonzero(one.grad) == 0
    constant = torch.ones(5, 2, requires_grad=True)  # zero variance: eps keeps it finite
    value = decorrelation_loss(constant)
    value.backward()
    assert math.isfinite(value.item()) and torch.isfinite(constant.grad).all()
    assert decorrelation_loss(torch.randn(6, 1), form="code").item() == 0  # d = 1: no off-diagonal entries


def test_feddecorr_loss_combines_ce_and_penalty():
    setup = tiny_setup()
    algo = build_algorithm("feddecorr", {}, setup)
    assert (algo.hp.beta, algo.hp.eps, algo.hp.form) == (0.1, 1e-8, "code")  # the authors' code
    state = initial_state(setup)
    batch = Batch(torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2]))
    loss, m = algo.loss(state, batch, ClientContext(0, 1, 6, 0.1, state, {}))
    features, logits = setup.model.features_and_logits(state, batch.x)
    assert m["decorr"].item() == pytest.approx(decorrelation_loss(features).item(), rel=1e-6)
    assert m["ce"].item() == pytest.approx(F.cross_entropy(logits, batch.y).item(), rel=1e-6)
    assert loss.item() == pytest.approx((m["ce"] + 0.1 * m["decorr"]).item(), rel=1e-6)
    # the configured form reaches the penalty
    paper = build_algorithm("feddecorr", {"form": "paper", "beta": 0.5}, setup)
    loss, m = paper.loss(state, batch, ClientContext(0, 1, 6, 0.1, state, {}))
    assert m["decorr"].item() == pytest.approx(decorrelation_loss(features, form="paper").item(), rel=1e-6)
    assert loss.item() == pytest.approx((m["ce"] + 0.5 * m["decorr"]).item(), rel=1e-6)


def test_feddecorr_two_samples_are_perfectly_correlated():
    """Two samples are the smallest batch with a correlation: every pair of columns is +-1 correlated."""
    two = torch.tensor([[0.3, -1.0, 2.0], [1.5, 4.0, -0.5]])
    # code: C_ij = +-(N - 1) = +-1 off the diagonal, mean square / N = 1/2; paper: K_ij = +-1, ||K||^2 / d^2 = 1
    assert decorrelation_loss(two).item() == pytest.approx(0.5, rel=1e-5)
    assert decorrelation_loss(two, form="paper").item() == pytest.approx(1.0, rel=1e-5)


# ------------------------------------------------------------------------------ shared
@pytest.mark.parametrize("name", ["fedlc", "fedrs", "feddecorr"])
def test_losses_vmap_over_clients(name):
    """The executor vmaps loss(state, batch, ctx) over clients with their own extras."""
    setup = tiny_setup()
    algo = build_algorithm(name, {}, setup)
    states = [perturbed(initial_state(setup), 0.3, seed=s) for s in (1, 2)]
    label_sets = [torch.tensor([0, 0, 1, 1, 1]), torch.tensor([2, 2, 2, 0, 2])]
    extras = [algo.begin(client_ctx(s, y)) for s, y in zip(states, label_sets, strict=True)]
    xs = torch.randn(2, 5, 4)
    ys = torch.stack(label_sets)

    def one(state, x, y, extra):
        return algo.loss(state, Batch(x, y), ClientContext(0, 1, 5, 0.1, state, {}, extra))[0]

    stack = lambda dicts: {k: torch.stack([d[k] for d in dicts]) for k in dicts[0]}
    batched = vmap(one, randomness="error")(stack(states), xs, ys, stack(extras))
    for i in range(2):
        assert batched[i].item() == pytest.approx(one(states[i], xs[i], ys[i], extras[i]).item(), rel=1e-5)


@pytest.mark.parametrize(
    ("name", "params", "attr", "value"),
    [
        ("fedlc", {"tau": 0.5}, "tau", 0.5),
        ("fedrs", {"alpha": 0.25}, "alpha", 0.25),
        ("feddecorr", {"beta": 0.05}, "beta", 0.05),
    ],
)
def test_composes_with_ccvr(name, params, attr, value):
    setup = tiny_setup()
    full = f"{name}+ccvr"
    options = {**params, "ccvr": {"num_virtual": 10}}
    algo = build_algorithm(full, options, setup)
    assert algo.name == name and getattr(algo.hp, attr) == value
    (step,) = build_posthoc(full, options, setup)
    assert type(step).__name__ == "CCVR" and step.hp.num_virtual == 10


@pytest.mark.parametrize(
    ("name", "params", "key"),
    [
        ("fedlc", {"tau": -1.0}, "algorithm.tau"),
        ("fedlc", {"min_count": 0.0}, "algorithm.min_count"),
        ("fedrs", {"alpha": 1.5}, "algorithm.alpha"),
        ("fedrs", {"scaling": "linear"}, "algorithm.scaling"),
        ("feddecorr", {"form": "torch"}, "algorithm.form"),
        ("feddecorr", {"eps": 0.0}, "algorithm.eps"),
        ("feddecorr", {"lam": 0.1}, "algorithm.lam"),
    ],
)
def test_settings_are_validated(name, params, key):
    with pytest.raises(ConfigError, match=key):
        build_algorithm(name, params, tiny_setup())


def test_label_methods_need_the_clients_labels():
    setup = tiny_setup()
    state = initial_state(setup)
    for name in ("fedlc", "fedrs"):
        with pytest.raises(ValueError, match="labels"):
            build_algorithm(name, {}, setup).begin(ClientContext(0, 1, 5, 0.1, state, {}))
