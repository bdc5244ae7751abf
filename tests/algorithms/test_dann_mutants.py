"""DANN: the domain classifier's layers, its memory estimate, the schedule inside the loss, the devices.

Written for the survivors of ``python benchmarks/mutation.py --only dann`` (session 26)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import Batch, ClientContext
from hetfl.algorithms.dann import DOMAIN, HEAD, ganin_lambda, mlp
from tests.helpers import initial_state, tiny_setup

ENCODER = "encoder.0.weight"  # TinyNet's first layer


def test_mlp_is_linear_relu_linear_relu_linear():
    """ReLU between the layers, none on the output (the domain logits may be negative)."""
    gen = torch.Generator().manual_seed(0)
    state = {f"h/{i}.weight": torch.randn(3, 3, generator=gen) for i in range(3)}
    state |= {f"h/{i}.bias": torch.randn(3, generator=gen) for i in range(3)}
    z = torch.randn(5, 3, generator=gen)
    hidden = F.relu(z @ state["h/0.weight"].T + state["h/0.bias"])
    hidden = F.relu(hidden @ state["h/1.weight"].T + state["h/1.bias"])
    expected = hidden @ state["h/2.weight"].T + state["h/2.bias"]
    assert (expected < 0).any()  # an output ReLU would show
    torch.testing.assert_close(mlp(state, "h/", 3, z), expected)


def test_memory_estimate_counts_the_domain_classifiers_parameters():
    setup = tiny_setup(num_clients=5)
    algo = build_algorithm("dann", {"hidden": 7}, setup)
    server = algo.init_server(initial_state(setup))
    count = sum(server.model[n].numel() for n in algo.head_names())  # (8+1)7 + (7+1)7 + (7+1)5
    assert count == 9 * 7 + 8 * 7 + 8 * 5
    feature_dim = server.model["classifier.weight"].shape[1]
    assert feature_dim == 8
    assert algo.memory_needs((4,), feature_dim) == [
        ("algorithm.hidden", 7, 16 * count, f"DANN's domain classifier ({count:,} parameters)")]


def test_the_ganin_schedule_sets_the_reversed_gradient_of_the_round():
    """At round r the features ascend ``lam_r`` times the domain loss, lam_r = ganin_lambda(lam, (r - 1) / R)."""
    setup = tiny_setup(num_clients=3, rounds=4)
    algo = build_algorithm("dann", {"lam": 0.9, "hidden": 8, "schedule": "ganin"}, setup)
    server = algo.init_server(initial_state(setup))
    batch = Batch(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 0, 1, 2]))
    grads = {}
    for round_ in (1, 3):
        ctx = ClientContext(1, round_, 6, 0.1, server.model, {})
        ctx.extras = algo.begin(ctx)
        leaves = {n: server.model[n].clone().requires_grad_() for n in algo.trainable_names()}
        loss, _ = algo.loss(leaves, batch, ctx)
        grads[round_] = torch.autograd.grad(loss, leaves[ENCODER])[0]
    plain = {n: server.model[n].clone().requires_grad_() for n in algo.trainable_names()}
    z, logits = setup.model.features_and_logits(plain, batch.x)
    g_ce = torch.autograd.grad(F.cross_entropy(logits, batch.y), plain[ENCODER], retain_graph=True)[0]
    g_dom = torch.autograd.grad(F.cross_entropy(mlp(plain, HEAD, 3, z), torch.full((6,), 1)),
                                plain[ENCODER])[0]
    torch.testing.assert_close(grads[1], g_ce, rtol=1e-5, atol=1e-7)  # p = 0: lam_1 = 0
    lam_3 = ganin_lambda(0.9, 2 / 4)
    assert 0 < lam_3 < 0.9
    torch.testing.assert_close(grads[3], g_ce - lam_3 * g_dom, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_domain_classifier_and_the_domain_label_live_on_the_models_device():
    setup = tiny_setup(num_clients=3)
    algo = build_algorithm("dann", {"hidden": 8}, setup)
    server = algo.init_server({k: v.cuda() for k, v in initial_state(setup).items()})
    assert all(server.model[n].device.type == "cuda" for n in algo.head_names())
    ctx = ClientContext(1, 1, 6, 0.1, server.model, {})
    assert algo.begin(ctx)[DOMAIN].device.type == "cuda"
