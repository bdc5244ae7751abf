"""CCVR's mathematics against hand-computed cases (CCVR has no public code to pin golden values from).

Luo et al., NeurIPS 2021: client statistics (eq. 2), exact pooling (eq. 3-4), virtual
features drawn from the pooled Gaussians, ReLU + Tukey (sec. 5.1), classifier re-training.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetfl.algorithms import build_posthoc
from hetfl.algorithms.base import ServerState
from hetfl.algorithms.ccvr import FEATURE_BETA, relu_tukey, virtual_counts
from hetfl.algorithms.gaussian_stats import ClassStats, class_moments, class_statistics, pool_statistics
from hetfl.algorithms.posthoc import ClassifierTraining, retrain_classifier, stream
from tests.helpers import initial_state, tiny_setup

F64 = torch.float64


def test_pooling_by_hand():
    """Client A holds (0,0), (2,0); client B holds (4,2) (one sample: zero covariance).
    By hand, the three points pooled: mean (2, 2/3); deviations (-2,-2/3), (0,-2/3), (2,4/3);
    unbiased covariance [[8, 4], [4, 8/3]] / 2 = [[4, 2], [2, 4/3]]."""
    a = class_statistics(torch.tensor([[0.0, 0.0], [2.0, 0.0]]), torch.tensor([0, 0]), 2)
    b = class_statistics(torch.tensor([[4.0, 2.0]]), torch.tensor([0]), 2)
    torch.testing.assert_close(a.means[0], torch.tensor([1.0, 0.0], dtype=F64))
    torch.testing.assert_close(a.covs[0], torch.tensor([[2.0, 0.0], [0.0, 0.0]], dtype=F64))
    assert torch.count_nonzero(b.covs[0]) == 0
    pooled = pool_statistics([a, b])
    assert pooled.counts.tolist() == [3.0, 0.0]
    torch.testing.assert_close(pooled.means[0], torch.tensor([2.0, 2.0 / 3.0], dtype=F64))
    torch.testing.assert_close(pooled.covs[0], torch.tensor([[4.0, 2.0], [2.0, 4.0 / 3.0]], dtype=F64))
    assert torch.count_nonzero(pooled.means[1]) == 0 and torch.count_nonzero(pooled.covs[1]) == 0


def test_pooling_a_class_split_evenly_by_hand():
    """Two clients with two samples each of one 1-d class: {0, 2} and {4, 6}.
    Pooled mean 3; unbiased variance ((9 + 1 + 1 + 9) / 3) = 20/3."""
    a = class_statistics(torch.tensor([[0.0], [2.0]]), torch.tensor([0, 0]), 1)
    b = class_statistics(torch.tensor([[4.0], [6.0]]), torch.tensor([0, 0]), 1)
    pooled = pool_statistics([a, b])
    assert pooled.means[0].item() == pytest.approx(3.0)
    assert pooled.covs[0, 0, 0].item() == pytest.approx(20.0 / 3.0)


def test_virtual_counts_fixed_and_proportional():
    stats = ClassStats(torch.tensor([30.0, 10.0, 1.0, 0.0], dtype=F64), torch.zeros(4, 2, dtype=F64),
                       torch.zeros(4, 2, 2, dtype=F64))
    assert virtual_counts(stats, 5, proportional=False).tolist() == [5, 5, 0, 0]  # N_c < 2: none
    # proportional: M_c = round(M * C * N_c / N) = round(5 * 4 * N_c / 41)
    assert virtual_counts(stats, 5, proportional=True).tolist() == [15, 5, 0, 0]


def test_virtual_counts_are_integer_sizes_from_two_samples_on():
    """N_c = 2 is the smallest class with a covariance (eq. 2): it gets its M_c; N_c = 1 and 0 get none. The
    counts are integers usable as sizes (here: the labels of the virtual features)."""
    stats = ClassStats(torch.tensor([2.0, 1.0, 0.0, 3.0], dtype=F64), torch.zeros(4, 2, dtype=F64),
                       torch.zeros(4, 2, 2, dtype=F64))
    for proportional, want in ((False, [4, 0, 0, 4]), (True, [5, 0, 0, 8])):  # round(4 * 4 * N_c / 6)
        m = virtual_counts(stats, 4, proportional)
        assert m.tolist() == want
        assert torch.arange(4).repeat_interleave(m).tolist() == [c for c in range(4) for _ in range(want[c])]


def _replies(step, server, feats_by_client, labels_by_client):
    return {k: step.client_query(server.model, f, y, client=k, round_=1) for k, (f, y) in
            enumerate(zip(feats_by_client, labels_by_client, strict=True))}


def test_virtual_features_follow_the_pooled_gaussians():
    """The drawn virtual features have the pooled mean and covariance of each class, and its label."""
    setup = tiny_setup()
    (step,) = build_posthoc("fedavg+ccvr", {"ccvr": {"num_virtual": 20_000}}, setup)
    server = ServerState(initial_state(setup))
    gen = torch.Generator().manual_seed(1)
    feats = [torch.randn(40, 8, generator=gen) * (k + 1) + 3 * k for k in range(3)]
    labels = [torch.randint(0, 3, (40,), generator=gen) for _ in range(3)]
    replies = _replies(step, server, feats, labels)
    z, y = torch.cat(feats).double(), torch.cat(labels)
    virtual, virtual_labels = step.virtual_features(replies, torch.Generator().manual_seed(0))
    for c, (v, lab) in enumerate(zip(virtual, virtual_labels, strict=True)):
        assert (lab == c).all() and len(v) == 20_000
        zc = z[y == c]
        scale = zc.std(0).max().item()
        torch.testing.assert_close(v.mean(0), zc.mean(0), atol=0.05 * scale, rtol=0)
        torch.testing.assert_close(torch.cov(v.T), torch.cov(zc.T), atol=0.08 * scale**2, rtol=0)


def test_a_class_held_by_single_samples_is_uploaded_and_calibrated():
    """A client uploads every class it holds, a single sample too (count 1, the sample as sum, its outer product;
    alone: the sample as mean, zero covariance): class 2, one sample at each of two clients, pools to N_2 = 2 and
    gets its virtual features."""
    setup = tiny_setup()
    (step,) = build_posthoc("fedavg+ccvr", {"ccvr": {"num_virtual": 4, "epochs": 1}}, setup)
    server = ServerState(initial_state(setup))
    gen = torch.Generator().manual_seed(6)
    feats = [torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)]
    labels = [torch.tensor([0, 0, 0, 2]), torch.tensor([1, 1, 1, 2])]
    replies = _replies(step, server, feats, labels)
    assert replies[0]["classes"].tolist() == [0, 2] and replies[0]["counts"].tolist() == [3.0, 1.0]
    z = feats[0][3].double()
    torch.testing.assert_close(replies[0]["sums"][1], z, rtol=0, atol=0)
    torch.testing.assert_close(replies[0]["outer"][1], torch.outer(z, z), rtol=0, atol=0)  # float32 products: exact
    alone = step.pooled_statistics({0: replies[0]})
    torch.testing.assert_close(alone.means[2], z, rtol=0, atol=0)
    assert torch.count_nonzero(alone.covs[2]) == 0
    _, info = step.apply(server, replies, round_=1)
    assert info["ccvr_virtual_features"] == 12 and info["ccvr_classes_without_virtual"] == 0


def test_replies_are_additive_and_pool_to_eq_3_4():
    """Two clients' replies (client 0 lacks class 1, class 2 has one sample at each): the server's Gaussians equal
    eq. 3-4 pooling of the clients' (count, mean, covariance) and the statistics of their features stacked; adding
    the two replies' tensors class by class into one reply (what secure aggregation would hand the server) gives
    the same Gaussians, bit for bit. Every reply value is a named tensor (Flower messages carry nothing else).

    Tolerance: 8 eps max_l ||z_l||_inf^2 per class for covariances and 8 eps max_l ||z_l||_inf for means, the
    float64 rounding measured in tests/algorithms/test_gaussian_stats.py (up to 2.2 and 0.8 units)."""
    setup = tiny_setup()
    (step,) = build_posthoc("fedavg+ccvr", {}, setup)
    server = ServerState(initial_state(setup))
    gen = torch.Generator().manual_seed(8)
    labels = [torch.tensor([0] * 9 + [2]), torch.tensor([0] * 4 + [1] * 7 + [2])]
    feats = [torch.randn(len(y), 8, generator=gen) * 2 + 3 for y in labels]
    replies = _replies(step, server, feats, labels)
    for r in replies.values():
        assert set(r) == {"classes", "counts", "sums", "outer"}
        assert all(isinstance(t, torch.Tensor) for t in r.values())
        assert r["counts"].dtype == r["sums"].dtype == r["outer"].dtype == F64
    assert replies[0]["classes"].tolist() == [0, 2] and replies[1]["classes"].tolist() == [0, 1, 2]
    got = step.pooled_statistics(replies)
    eq = pool_statistics([class_statistics(f, y, 3) for f, y in zip(feats, labels, strict=True)])
    z, y = torch.cat(feats).double(), torch.cat(labels)
    eps = torch.finfo(F64).eps
    assert got.counts.tolist() == eq.counts.tolist() == [13.0, 7.0, 2.0]
    for c in range(3):
        scale = float(z[y == c].abs().max())
        for means, covs in ((eq.means[c], eq.covs[c]), (z[y == c].mean(0), torch.cov(z[y == c].T))):
            torch.testing.assert_close(got.means[c], means, rtol=0, atol=8 * eps * scale)
            torch.testing.assert_close(got.covs[c], covs, rtol=0, atol=8 * eps * scale**2)
    dense = [class_moments(f, lab, 3) for f, lab in zip(feats, labels, strict=True)]
    summed = {"classes": torch.arange(3), "counts": dense[0].counts + dense[1].counts,
              "sums": dense[0].sums + dense[1].sums, "outer": dense[0].outer + dense[1].outer}
    one = step.pooled_statistics({0: summed})
    for a, b in ((one.counts, got.counts), (one.means, got.means), (one.covs, got.covs)):
        assert torch.equal(a, b)


def test_replies_pass_through_flower_records_unchanged():
    """A reply is what ``query.posthoc`` sends back: encoded as a Flower record and decoded, every tensor is the
    same (dtype, shape, bits), so the server pools exactly what the client computed."""
    pytest.importorskip("flwr", reason='Flower is not installed: pip install "hetfl[flower]"')
    from hetfl.flower.codec import from_record, to_record

    setup = tiny_setup()
    (step,) = build_posthoc("fedavg+ccvr", {}, setup)
    gen = torch.Generator().manual_seed(9)
    reply = step.client_query(initial_state(setup), torch.randn(12, 8, generator=gen), torch.tensor([0, 2] * 6),
                              client=0, round_=1)
    back = from_record(to_record(reply))
    assert set(back) == set(reply)
    for name, t in reply.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_virtual_features_per_class_counts_fixed_proportional_and_one():
    """M_c reaches the drawing: proportional = round(M * C * N_c / N) per class; M = 1 draws one feature."""
    setup = tiny_setup()
    server = ServerState(initial_state(setup))
    gen = torch.Generator().manual_seed(5)
    feats = [torch.randn(20, 8, generator=gen), torch.randn(10, 8, generator=gen)]
    labels = [torch.tensor([0] * 12 + [1] * 8), torch.tensor([1] * 2 + [2] * 8)]  # N_c = 12, 10, 8; N = 30
    for hp, want in (({"num_virtual": 10, "proportional": True}, [12, 10, 8]), ({"num_virtual": 1}, [1, 1, 1])):
        (step,) = build_posthoc("fedavg+ccvr", {"ccvr": hp}, setup)
        virtual, virtual_labels = step.virtual_features(_replies(step, server, feats, labels),
                                                        torch.Generator().manual_seed(0))
        assert [len(v) for v in virtual] == want
        assert [lab.tolist() for lab in virtual_labels] == [[c] * n for c, n in enumerate(want)]


def test_apply_is_algorithm_1_composed_of_its_parts():
    """apply = pool, draw from the step's stream, ReLU + Tukey(beta), re-train the classifier from the
    global one with the configured SGD: the same numbers when composed by hand."""
    setup = tiny_setup()
    hp = {"num_virtual": 30, "epochs": 3, "lr": 0.05, "momentum": 0.5, "weight_decay": 0.01, "batch_size": 16,
          "tukey_beta": 0.3}
    (step,) = build_posthoc("fedavg+ccvr", {"ccvr": hp}, setup)
    server = ServerState(initial_state(setup))
    gen = torch.Generator().manual_seed(2)
    feats = [torch.randn(25, 8, generator=gen) - 0.5 for _ in range(2)]
    labels = [torch.randint(0, 3, (25,), generator=gen) for _ in range(2)]
    replies = _replies(step, server, feats, labels)
    new, _ = step.apply(server, replies, round_=4)

    own = stream(setup, 4, "ccvr")
    virtual, virtual_labels = step.virtual_features(replies, own)
    x = relu_tukey(torch.cat(virtual).float(), 0.3)
    training = ClassifierTraining(3, 0.05, 0.5, 0.01, 16)
    w, b = retrain_classifier(server.model["classifier.weight"], server.model["classifier.bias"], x,
                              torch.cat(virtual_labels), training, own)
    torch.testing.assert_close(new.model["classifier.weight"], w)
    torch.testing.assert_close(new.model["classifier.bias"], b)
    assert new.model[FEATURE_BETA].item() == pytest.approx(0.3)


def test_retrain_classifier_is_sgd_with_momentum_and_weight_decay():
    """One full batch, two steps, by hand: g = grad CE + wd * w; v1 = g1, v2 = m v1 + g2; w -= lr v."""
    torch.manual_seed(0)
    w0, b0 = torch.randn(3, 4), torch.randn(3)
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    lr, m, wd = 0.1, 0.9, 0.01
    w, b = retrain_classifier(w0, b0, x, y, ClassifierTraining(2, lr, m, wd, 6), torch.Generator().manual_seed(0))
    ww, bb = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    vw = vb = None
    for _ in range(2):
        loss = F.cross_entropy(x @ ww.T + bb, y)
        gw, gb = torch.autograd.grad(loss, (ww, bb))
        gw, gb = gw + wd * ww.detach(), gb + wd * bb.detach()
        vw = gw if vw is None else m * vw + gw
        vb = gb if vb is None else m * vb + gb
        ww = (ww.detach() - lr * vw).requires_grad_()
        bb = (bb.detach() - lr * vb).requires_grad_()
    torch.testing.assert_close(w, ww.detach())
    torch.testing.assert_close(b, bb.detach())


def test_calibration_removes_a_classifier_biased_towards_one_class():
    """The global classifier predicts class 0 for everything (bias +5); features of the three classes are
    well separated Gaussians. After calibration on virtual features the classifier separates them."""
    setup = tiny_setup()
    (step,) = build_posthoc("fedavg+ccvr", {"ccvr": {"num_virtual": 200, "epochs": 20, "lr": 0.1,
                                                      "transform": "none"}}, setup)
    model = dict(initial_state(setup))
    model["classifier.weight"] = torch.zeros_like(model["classifier.weight"])
    model["classifier.bias"] = torch.tensor([5.0, 0.0, 0.0])
    server = ServerState(model)
    gen = torch.Generator().manual_seed(3)
    centres = torch.zeros(3, 8)
    centres[0, 0], centres[1, 1], centres[2, 2] = 4.0, 4.0, 4.0
    y = torch.arange(3).repeat_interleave(50)
    z = centres[y] + 0.5 * torch.randn(150, 8, generator=gen)
    replies = _replies(step, server, [z[:75], z[75:]], [y[:75], y[75:]])  # label-skewed: client 0 lacks class 2
    before = (F.linear(z, model["classifier.weight"], model["classifier.bias"]).argmax(1) == y).float().mean()
    new, _ = step.apply(server, replies, round_=1)
    after = (F.linear(z, new.model["classifier.weight"], new.model["classifier.bias"]).argmax(1) == y).float().mean()
    assert before.item() == pytest.approx(1 / 3)
    assert after.item() > 0.95
