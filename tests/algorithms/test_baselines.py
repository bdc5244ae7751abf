"""The defining rule of each baseline, checked on a tiny model with hand-built inputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import Batch, Upload, weighted_mean
from hetfl.algorithms.fednova import normalizing_factor
from hetfl.algorithms.moon import model_contrastive_loss
from hetfl.engine.local import sgd_step
from tests.helpers import context, initial_state, perturbed, tiny_setup

BATCH = Batch(torch.randn(6, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 0, 1, 2]))


def make(name, params=None, **setup_kw):
    setup = tiny_setup(**setup_kw)
    algo = build_algorithm(name, params or {}, setup)
    return algo, setup, algo.init_server(initial_state(setup))


def test_weighted_mean_weights_by_data_size():
    a, b = {"w": torch.tensor([0.0, 0.0])}, {"w": torch.tensor([4.0, 8.0])}
    assert torch.equal(weighted_mean([a, b], [3, 1])["w"], torch.tensor([1.0, 2.0]))


def test_fedprox_term_is_zero_at_the_global_model_and_pulls_back():
    algo, _, server = make("fedprox", {"mu": 0.5})
    ctx = context(0, server.model)
    _, metrics = algo.loss(server.model, BATCH, ctx)
    assert metrics["prox"] == 0
    moved = perturbed(server.model, 0.1, seed=2)
    loss, metrics = algo.loss(moved, BATCH, ctx)
    expected = sum(((moved[n] - server.model[n]) ** 2).sum() for n in algo.model.param_names)
    assert torch.allclose(metrics["prox"], expected)
    ce, _ = algo.__class__.__mro__[1].loss(algo, moved, BATCH, ctx)
    assert torch.allclose(loss, ce + 0.25 * expected)


def test_fedavgm_without_momentum_is_fedavg_and_momentum_accumulates():
    algo, _, server = make("fedavgm", {"server_momentum": 0.0})
    ups = [Upload(i, perturbed(server.model, 0.1, i), 10 * (i + 1), 5) for i in range(3)]
    new = algo.aggregate(server, ups, 1)
    plain = weighted_mean([u.tensors for u in ups], [u.num_samples for u in ups])
    for n in plain:
        assert torch.allclose(new.model[n], plain[n], atol=1e-6)
    algo, _, server = make("fedavgm", {"server_momentum": 0.5})
    target = perturbed(server.model, 0.1, 7)
    s1 = algo.aggregate(server, [Upload(0, target, 1, 1)], 1)
    s2 = algo.aggregate(s1, [Upload(0, {k: v.clone() for k, v in s1.model.items()}, 1, 1)], 2)
    n = algo.model.param_names[0]
    # round 2 has zero client update, yet the model keeps moving by β v
    assert torch.allclose(s2.model[n], s1.model[n] - 0.5 * s1.extra[n], atol=1e-6)


def test_scaffold_corrected_gradient_and_option_two_control_variate():
    algo, setup, server = make("scaffold", num_clients=4)
    n0 = algo.model.param_names[0]
    server.extra = {n: torch.full_like(t, 0.3) for n, t in server.extra.items()}
    c_i = {n: torch.full_like(t, -0.2) for n, t in server.extra.items()}
    payload = algo.payload(server, 0)
    ctx = context(0, payload, c_i, lr=0.1)
    grads = {n: torch.ones_like(server.model[n]) for n in algo.model.param_names}
    corrected = algo.corrected_gradient(grads, server.model, ctx)
    assert torch.allclose(corrected[n0], torch.full_like(grads[n0], 1 - (-0.2) + 0.3))
    # the stage really uses the correction: one step moves by lr * (g - c_i + c)
    (stage,) = algo.stages(ctx)
    plain = build_algorithm("fedavg", {}, setup).stages(ctx)[0]
    new_s, _, _, _ = sgd_step(stage, dict(server.model), {}, BATCH, ctx, True)
    new_p, _, _, _ = sgd_step(plain, dict(server.model), {}, BATCH, ctx, True)
    assert torch.allclose(new_p[n0] - new_s[n0], torch.full_like(new_s[n0], 0.1 * 0.5), atol=1e-6)
    # option II: c_i+ = c_i - c + (x - y) / (K lr)
    local = perturbed(server.model, 0.05, 3)
    upload, new_c = algo.finish(ctx, local, steps=4)
    expected = c_i[n0] - 0.3 + (server.model[n0] - local[n0]) / (4 * 0.1)
    assert torch.allclose(new_c[n0], expected, atol=1e-6)
    assert torch.allclose(upload["scaffold.c/" + n0], new_c[n0] - c_i[n0], atol=1e-6)
    # server: c <- c + |S|/N mean(dc); x <- x + mean(dy)
    new_server = algo.aggregate(server, [Upload(0, upload, 10, 4)], 1)
    assert torch.allclose(new_server.extra[n0], server.extra[n0] + 0.25 * upload["scaffold.c/" + n0], atol=1e-6)
    assert torch.allclose(new_server.model[n0], local[n0], atol=1e-6)


def test_scaffold_client_without_steps_keeps_its_control_variate():
    """A client with no sample (``data.min_size = 0``) takes no step: option II's ``(x - y) / (K lr)`` has
    nothing to average, so c_i stays and dc_i = 0. The guard ``max(K, 1)`` once made c_i+ = c_i - c (the
    server's variate, negated) and sent -c - c_i to the server: on a Dirichlet split with 19 of 30 clients
    empty, SCAFFOLD stayed at 11.6 % accuracy for 10 rounds (FedAvg: 82 %)."""
    algo, _, server = make("scaffold", num_clients=4)
    server.extra = {n: torch.full_like(t, 0.3) for n, t in server.extra.items()}
    c_i = {n: torch.full_like(t, -0.2) for n, t in server.extra.items()}
    ctx = context(0, algo.payload(server, 0), c_i, lr=0.1)
    upload, new_c = algo.finish(ctx, dict(server.model), steps=0)
    for n in algo.model.param_names:
        assert torch.equal(new_c[n], c_i[n])
        assert torch.equal(upload["scaffold.c/" + n], torch.zeros_like(c_i[n]))
        assert torch.equal(upload[n], server.model[n])


def test_feddyn_state_update_and_server_correction():
    algo, _, server = make("feddyn", {"alpha": 0.1}, num_clients=2)
    n0 = algo.model.param_names[0]
    h_i = algo.init_client_state(0, server)
    ctx = context(0, server.model, h_i)
    local = perturbed(server.model, 0.1, 4)
    _, new_h = algo.finish(ctx, local, 3)
    assert torch.allclose(new_h[n0], -0.1 * (local[n0] - server.model[n0]))
    # with a non-zero h_i the loss has the linear term -<h_i, w>
    h_i = {n: torch.ones_like(t) for n, t in h_i.items()}
    ctx = context(0, server.model, h_i)
    base, _ = build_algorithm("fedavg", {}, algo.setup).loss(server.model, BATCH, ctx)
    loss, _ = algo.loss(server.model, BATCH, ctx)
    linear = sum(server.model[n].sum() for n in algo.model.param_names)
    assert torch.allclose(loss, base - linear, atol=1e-5)
    new = algo.aggregate(server, [Upload(0, local, 10, 3)], 1)
    h = -(0.1 / 2) * (local[n0] - server.model[n0])
    assert torch.allclose(new.extra[n0], h, atol=1e-6)
    assert torch.allclose(new.model[n0], local[n0] - h / 0.1, atol=1e-6)


def test_fednova_normalising_factor_and_averaging():
    assert normalizing_factor(7, 0.0) == 7
    rho, tau = 0.9, 5
    by_hand = sum(sum(rho**j for j in range(k + 1)) for k in range(tau))  # a_i = sum_k sum_{j<=k} rho^j
    assert math.isclose(normalizing_factor(tau, rho), by_hand)
    algo, _, server = make("fednova")
    n0 = algo.model.param_names[0]
    ups = [Upload(0, perturbed(server.model, 0.1, 5), 30, 2), Upload(1, perturbed(server.model, 0.1, 6), 10, 8)]
    new = algo.aggregate(server, ups, 1)
    p, a = [0.75, 0.25], [2.0, 8.0]
    tau_eff = sum(pi * ai for pi, ai in zip(p, a, strict=True))
    d = sum(pi / ai * (server.model[n0] - u.tensors[n0]) for pi, ai, u in zip(p, a, ups, strict=True))
    assert torch.allclose(new.model[n0], server.model[n0] - tau_eff * d, atol=1e-6)
    # equal step counts: FedNova is FedAvg
    ups_equal = [Upload(u.client_id, u.tensors, u.num_samples, 4) for u in ups]
    fedavg = weighted_mean([u.tensors for u in ups_equal], [30, 10])
    assert torch.allclose(algo.aggregate(server, ups_equal, 1).model[n0], fedavg[n0], atol=1e-6)


def test_moon_term_is_zero_in_first_round_and_matches_hand_value():
    """In a client's first round (no previous model) the term adds exactly nothing: the loss and its gradient
    are the cross-entropy's to the bit (the received model stands in for the previous one, weighted by 0, so
    that first-timers run the returning clients' step)."""
    algo, _, server = make("moon", {"mu": 5.0})
    first = context(0, server.model, {})
    first.extras = algo.begin(first)
    local = perturbed(server.model, 0.2, 8)
    params = {n: local[n].clone().requires_grad_() for n in algo.model.param_names}
    loss, metrics = algo.loss({**local, **params}, BATCH, first)
    assert metrics["contrastive"].item() == 0.0 and torch.equal(loss, metrics["ce"])
    ce = F.cross_entropy(algo.model.logits({**local, **params}, BATCH.x), BATCH.y)
    assert torch.equal(loss, ce)
    for got, want in zip(torch.autograd.grad(loss, list(params.values())),
                         torch.autograd.grad(ce, list(params.values())), strict=True):
        assert torch.equal(got, want)
    _, state = algo.finish(first, server.model, 1)
    assert set(state) == {"moon.prev/" + n for n in algo.model.state_names}
    # previous model == global model: sim_pos == sim_neg, term = log 2
    later = context(0, server.model, state)
    later.extras = algo.begin(later)
    _, metrics = algo.loss(perturbed(server.model, 0.1, 9), BATCH, later)
    assert torch.allclose(metrics["contrastive"], torch.tensor(math.log(2)), atol=1e-6)
    z = torch.tensor([[1.0, 0.0]])
    value = model_contrastive_loss(z, torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]), 0.5)
    assert torch.allclose(value, torch.tensor(-math.log(math.exp(2) / (math.exp(2) + 1))))


def test_local_only_never_communicates_and_keeps_own_model():
    algo, _, server = make("local")
    assert algo.payload(server, 0) == {}
    state = algo.init_client_state(0, server)
    local = perturbed(state, 0.1, 1)
    upload, new_state = algo.finish(context(0, {}, state), local, 3)
    assert upload == {} and torch.equal(new_state[algo.model.param_names[0]], local[algo.model.param_names[0]])
    assert algo.aggregate(server, [], 1) is server
    assert algo.client_model(server, new_state, 0) is new_state


@pytest.mark.parametrize("name", ["freeze", "fedbabu"])
def test_frozen_classifier_is_orthogonal_and_never_trained(name):
    algo, _, server = make(name)
    weight = server.model["classifier.weight"]
    assert torch.allclose(weight @ weight.T, torch.eye(3), atol=1e-5)  # orthonormal rows
    assert "classifier.weight" not in algo.trainable_names()
    ctx = context(0, server.model)
    (stage,) = algo.stages(ctx)
    new, _, _, _ = sgd_step(stage, dict(server.model), {}, BATCH, ctx, True)
    assert "classifier.weight" not in new
    upload, _ = algo.finish(ctx, {**server.model, **new}, 1)
    assert "classifier.weight" not in upload
    agg = algo.aggregate(server, [Upload(0, upload, 10, 1)], 1)
    assert torch.equal(agg.model["classifier.weight"], weight)


def test_fedbabu_fine_tunes_the_head_only_at_evaluation():
    algo, _, server = make("fedbabu", {"finetune_epochs": 2})
    (stage,) = algo.personalize_stages(context(0, server.model))
    assert set(stage.trainable) == {"classifier.weight", "classifier.bias"} and stage.epochs == 2
    algo_full, _, _ = make("fedbabu", {"finetune_part": "full"})
    (stage,) = algo_full.personalize_stages(context(0, server.model))
    assert set(stage.trainable) == set(algo_full.model.param_names)
