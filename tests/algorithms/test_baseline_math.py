"""Hand-computed cases that pin which tensor plays which role in MOON's contrastive term and
FedNova's momentum-corrected normaliser (each fails on the mutant named in its docstring)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import Batch, Upload
from hetfl.algorithms.fednova import normalizing_factor
from hetfl.algorithms.moon import PREV, model_contrastive_loss
from tests.helpers import context, initial_state, perturbed, tiny_setup

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH = Batch(torch.randn(6, 4, generator=torch.Generator().manual_seed(3)), torch.tensor([0, 1, 2, 0, 1, 2]))


# ------------------------------------------------------------------------------ MOON
def test_moon_loss_has_the_global_model_as_positive_by_hand():
    """Li et al. 2021, eq. (2) with z = (1, 0), z_glob = (0.6, 0.8), z_prev = (0, 1), tau = 0.5:
    cos(z, z_glob) = 0.6 and cos(z, z_prev) = 0, so l = -log(e^1.2 / (e^1.2 + e^0)) = log(1 + e^-1.2).
    Swapping positive and negative gives log(1 + e^1.2) instead."""
    z = torch.tensor([[1.0, 0.0]])
    value = model_contrastive_loss(z, torch.tensor([[0.6, 0.8]]), torch.tensor([[0.0, 1.0]]), 0.5)
    assert value.item() == pytest.approx(math.log(1 + math.exp(-1.2)), rel=1e-6)  # 0.263, swapped: 1.463


def test_moon_gradient_pulls_towards_global_and_pushes_from_previous():
    """One gradient step on z raises cos(z, z_glob) and lowers cos(z, z_prev)."""
    z = torch.tensor([[1.0, 1.0, 0.0]], requires_grad=True)
    z_glob, z_prev = torch.tensor([[1.0, 0.0, 0.0]]), torch.tensor([[0.0, 1.0, 0.0]])
    model_contrastive_loss(z, z_glob, z_prev, 0.5).backward()
    stepped = (z - 0.1 * z.grad).detach()
    assert F.cosine_similarity(stepped, z_glob).item() > F.cosine_similarity(z.detach(), z_glob).item()
    assert F.cosine_similarity(stepped, z_prev).item() < F.cosine_similarity(z.detach(), z_prev).item()


def test_moon_algorithm_takes_payload_as_positive_and_stored_model_as_negative():
    """Moon.loss with distinct global (payload) and previous (client store) models equals
    CE + mu * l_con computed here with the global model's features as the positive pair."""
    setup = tiny_setup()
    algo = build_algorithm("moon", {"mu": 2.0, "temperature": 0.5}, setup)
    start = initial_state(setup)
    global_model, previous, local = perturbed(start, 0.3, 11), perturbed(start, 0.3, 12), perturbed(start, 0.3, 13)
    state = {PREV + n: previous[n] for n in algo.model.state_names}
    ctx = context(0, global_model, state)
    ctx.extras = algo.begin(ctx)
    loss, metrics = algo.loss(local, BATCH, ctx)
    z, logits = setup.model.features_and_logits(local, BATCH.x)
    z_glob = setup.model.reference_features(global_model, BATCH.x)
    z_prev = setup.model.reference_features(previous, BATCH.x)
    pos = F.cosine_similarity(z, z_glob, dim=-1) / 0.5
    neg = F.cosine_similarity(z, z_prev, dim=-1) / 0.5
    by_hand = (-(pos - torch.logaddexp(pos, neg))).mean()
    swapped = (-(neg - torch.logaddexp(pos, neg))).mean()
    assert abs(by_hand.item() - swapped.item()) > 1e-3  # the case tells the two apart
    torch.testing.assert_close(metrics["contrastive"], by_hand.detach())
    torch.testing.assert_close(loss, F.cross_entropy(logits, BATCH.y) + 2.0 * by_hand)


# ------------------------------------------------------------------------------ FedNova
def test_fednova_normaliser_with_momentum_by_hand():
    """Wang et al. 2020, App. (momentum SGD): a_i = [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho).
    rho = 0.9: tau = 2 gives (2 - 0.9 * 1.9) / 0.1 = 2.9; tau = 3 gives (3 - 0.9 * 2.71) / 0.1 = 5.61,
    i.e. 1 + 1.9 + 2.71, the sum of the momentum buffer's cumulative weights (the authors' code)."""
    assert normalizing_factor(2, 0.9) == pytest.approx(2.9, rel=1e-12)
    assert normalizing_factor(3, 0.9) == pytest.approx(5.61, rel=1e-12)
    assert normalizing_factor(3, 0.0) == 3


def test_fednova_aggregation_uses_the_runs_momentum():
    """With train.momentum = 0.9 the server uses a_i = 2.9 and 5.61 for 2 and 3 local steps, not 2 and 3:
    w <- w - tau_eff sum_i p_i (w - w_i) / a_i, tau_eff = sum_i p_i a_i, p = (3/4, 1/4)."""
    setup = tiny_setup(momentum=0.9)
    algo = build_algorithm("fednova", {}, setup)
    server = algo.init_server(initial_state(setup))
    ups = [Upload(0, perturbed(server.model, 0.1, 21), 30, 2), Upload(1, perturbed(server.model, 0.1, 22), 10, 3)]
    new = algo.aggregate(server, ups, 1)
    p, a = (0.75, 0.25), (2.9, 5.61)
    tau_eff = 0.75 * 2.9 + 0.25 * 5.61
    for n in algo.model.param_names:
        w = server.model[n]
        direction = sum(pi / ai * (w - u.tensors[n]) for pi, ai, u in zip(p, a, ups, strict=True))
        torch.testing.assert_close(new.model[n], w - tau_eff * direction, rtol=1e-5, atol=1e-6)
    # without the correction (a_i = steps) the result differs by far more than the tolerance
    plain = sum(pi / ai * (server.model["classifier.weight"] - u.tensors["classifier.weight"])
                for pi, ai, u in zip(p, (2.0, 3.0), ups, strict=True))
    uncorrected = server.model["classifier.weight"] - (0.75 * 2 + 0.25 * 3) * plain
    assert (uncorrected - new.model["classifier.weight"]).abs().max() > 1e-3


# ------------------------------------------------------------------------------ Fed-RoD on one-class clients
def test_fedrod_single_class_client_teaches_the_generic_model_nothing():
    """Why Fed-RoD's generic model stays near chance on the default Synthetic data
    (benchmarks/results/below_chance.md): with the balanced softmax an absent class leaves the
    local softmax, so a client holding one class has a ~zero generic loss and no gradient on the
    shared parts, while its personal head still trains. With plain CE (balanced = false) it does train."""
    setup = tiny_setup()
    labels = torch.zeros(6, dtype=torch.long)
    batch = Batch(BATCH.x, labels)
    for balanced, trains in ((True, False), (False, True)):
        algo = build_algorithm("fedrod", {"balanced": balanced}, setup)
        server = algo.init_server(initial_state(setup))
        ctx = context(0, server.model, algo.init_client_state(0, server))
        ctx.inputs = lambda: batch
        ctx.extras = algo.begin(ctx)
        start = {n: t.clone().requires_grad_(True) for n, t in algo.start_state(ctx).items()
                 if n in algo.stages(ctx)[0].trainable}
        state = {**algo.start_state(ctx), **start}
        loss, metrics = algo.loss(state, batch, ctx)
        loss.backward()
        shared = max(start[n].grad.abs().max().item() for n in algo.model.param_names)
        head = max(start[n].grad.abs().max().item() for n in start if n.startswith("fedrod.head/"))
        assert head > 1e-3  # the personal head always learns the client's class
        assert (shared > 1e-4) is trains, (balanced, shared)
        assert (metrics["bsm"].item() < 1e-6) is not trains
