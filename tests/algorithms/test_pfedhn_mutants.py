"""pFedHN's forward pass, its server step (momentum, weight decay, clipping, embedding lr), buffers, output
scales and memory estimate (mutation testing, session 26; Shamsian et al., ICML 2021, Algorithm 1)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import ServerState, Upload
from tests.algorithms.test_personalized_baselines import bn_setup
from tests.helpers import context, initial_state, perturbed, tiny_setup

PLAIN = {"server_momentum": 0.0, "server_weight_decay": 0.0, "max_grad_norm": 0.0, "server_lr": 0.1, "hidden": 6,
         "chunk_size": 16, "chunk_embed_dim": 3, "n_hidden": 1}


def make(params=None, setup=None):
    setup = setup or tiny_setup()
    algo = build_algorithm("pfedhn", {**PLAIN, **(params or {})}, setup)
    return algo, algo.init_server(initial_state(setup))


def upload_of(algo, server, client, seed):
    payload = algo.payload(server, client)
    local = perturbed(payload, 0.1, seed)
    upload, _ = algo.finish(context(client, payload, {}), local, 1)
    return Upload(client, upload, 10, 1)


@pytest.mark.parametrize("chunk_size", [0, 16])
def test_the_generated_model_is_the_hypernetworks_forward_computed_by_hand(chunk_size):
    """``Linear(E, H)``, then n_hidden x (ReLU, ``Linear(H, H)``), then one head per tensor or the chunk layer
    ``W_out relu(W_c [r; c_tj] + b_c) + b_out``; no ReLU after the last body layer."""
    algo, server = make({"chunk_size": chunk_size, "n_hidden": 2})
    net = algo.hypernetwork(server)
    e = server.extra["pfedhn.embed"][1]
    r = F.linear(e, net["body.0.weight"], net["body.0.bias"])
    for i in (1, 2):
        r = F.linear(torch.relu(r), net[f"body.{i}.weight"], net[f"body.{i}.bias"])
    generated = algo.payload(server, 1)
    if chunk_size == 0:
        for n, p in algo.model.module.named_parameters():
            expected = (net[f"head.{n}.weight"] @ r + net[f"head.{n}.bias"]).view(p.shape)
            assert torch.allclose(generated[n], expected, atol=1e-6), n
        return
    flat = []
    for c in net["chunks"]:
        hidden = torch.relu(net["chunk.weight"] @ torch.cat([r, c]) + net["chunk.bias"])
        flat.append(net["out.weight"] @ hidden + net["out.bias"])
    flat = torch.cat(flat)
    start = 0
    for n, p in algo.model.module.named_parameters():
        k = math.ceil(p.numel() / 16)  # each tensor starts at a fresh chunk
        assert torch.allclose(generated[n], flat[16 * start:16 * start + p.numel()].view(p.shape), atol=1e-6), n
        start += k
    assert start == len(net["chunks"])


def test_the_server_step_has_momentum_weight_decay_and_its_own_embedding_lr():
    """``buf <- m buf + g + wd p``, ``p <- p - lr buf`` for phi; the embedding the same at ``embed_lr``."""
    m, wd, lr, elr = 0.5, 0.01, 0.1, 0.3
    algo, server = make({"server_momentum": m, "server_weight_decay": wd, "embed_lr": elr})
    first = upload_of(algo, server, 2, 1)
    g1, e1 = algo.gradients(server, first)
    one = algo.aggregate(server, [first], 1)
    second = upload_of(algo, one, 2, 2)
    g2, e2 = algo.gradients(one, second)
    two = algo.aggregate(one, [second], 2)
    for k in g1:
        p0 = server.extra["pfedhn.hn/" + k]
        buf1 = g1[k] + wd * p0
        p1 = p0 - lr * buf1
        assert torch.allclose(one.extra["pfedhn.hn/" + k], p1, atol=1e-6), k
        buf2 = m * buf1 + g2[k] + wd * p1
        assert torch.allclose(two.extra["pfedhn.hn/" + k], p1 - lr * buf2, atol=1e-6), k
    v0 = server.extra["pfedhn.embed"][2]
    b1 = e1 + wd * v0
    v1 = v0 - elr * b1
    assert torch.allclose(one.extra["pfedhn.embed"][2], v1, atol=1e-6)
    assert torch.allclose(two.extra["pfedhn.embed"][2], v1 - elr * (m * b1 + e2 + wd * v1), atol=1e-6)


def test_each_clients_gradient_is_clipped_to_max_grad_norm_before_the_sum():
    algo, server = make({"max_grad_norm": 1e-3})
    ups = [upload_of(algo, server, c, 10 + c) for c in (0, 3)]
    grads = [algo.gradients(server, u) for u in ups]
    new = algo.aggregate(server, ups, 1)
    scales = []
    for g_net, g_embed in grads:
        norm = torch.sqrt(sum((g ** 2).sum() for g in [*g_net.values(), g_embed]))
        assert norm > 1e-3  # the case clips
        scales.append(1e-3 / (norm + 1e-6))
    for k in grads[0][0]:
        step = sum(s * g[0][k] for s, g in zip(scales, grads, strict=True))
        assert torch.allclose(new.extra["pfedhn.hn/" + k], server.extra["pfedhn.hn/" + k] - 0.1 * step, atol=1e-7)
    for (_, g_embed), s, c in zip(grads, scales, (0, 3), strict=True):
        assert torch.allclose(new.extra["pfedhn.embed"][c], server.extra["pfedhn.embed"][c] - 0.1 * s * g_embed,
                              atol=1e-7)


def test_buffers_are_uploaded_and_averaged_by_data_size():
    algo, server = make(setup=bn_setup())
    ups = []
    for c, size in ((0, 10), (1, 30)):
        payload = algo.payload(server, c)
        local = {**payload, "encoder.1.running_mean": torch.full((8,), float(c + 1))}
        upload, _ = algo.finish(context(c, payload, {}), local, 1)
        assert torch.equal(upload["encoder.1.running_mean"], local["encoder.1.running_mean"])
        ups.append(Upload(c, upload, size, 1))
    new = algo.aggregate(server, ups, 1)
    assert torch.allclose(new.model["encoder.1.running_mean"], torch.full((8,), 0.25 * 1 + 0.75 * 2))


def test_a_zero_initialised_tensor_takes_its_modules_weight_scale():
    """BatchNorm's bias starts at 0 (no RMS to match): it is scaled as the BatchNorm weight."""
    algo, server = make({"output_scale": "init"}, setup=bn_setup())
    scales = algo.scales(server)
    assert set(scales) == {n for n, _ in algo.model.module.named_parameters()}
    assert torch.equal(scales["encoder.1.bias"], scales["encoder.1.weight"])
    assert not torch.equal(scales["encoder.1.weight"], scales["encoder.0.weight"])


@pytest.mark.parametrize("params", [{}, {"chunk_size": 0}, {"n_hidden": 6, "hidden": 50}, {"n_hidden": 4}])
def test_the_memory_estimate_is_three_copies_of_the_hypernetwork_it_builds(params):
    """Each part named by the setting that sizes it; together 3 float32 copies (weights, momentum, summed
    gradient) of every hypernetwork and embedding tensor."""
    setup = tiny_setup()
    algo = build_algorithm("pfedhn", params, setup)
    needs = algo.memory_needs((4,), 8)
    built = algo.init_hypernetwork(torch.device("cpu"))
    assert sum(need for _, _, need, _ in needs) == 12 * sum(t.numel() for t in built.values())
    hp, what = algo.hp, "pFedHN's hypernetwork"
    # the blocks are named by the setting further from its default (hidden 100, n_hidden 3)
    blocks = ("algorithm.hidden", hp.hidden) if "n_hidden" not in params else ("algorithm.n_hidden", hp.n_hidden)
    expected = [("algorithm.embed_dim", 2, what + "'s first layer and client embeddings"),
                (*blocks, what + "'s hidden blocks")]
    if hp.chunk_size:
        expected += [("algorithm.chunk_embed_dim", hp.chunk_embed_dim, what + "'s chunk embeddings"),
                     ("algorithm.chunk_size", hp.chunk_size, what + "'s output layer")]
    else:
        expected.append(("algorithm.hidden", hp.hidden, what + "'s output heads"))
    assert [(k, v, text) for k, v, _, text in needs] == expected


def test_an_unchanged_server_keeps_its_buffers_when_the_model_has_none():
    algo, server = make()
    new = algo.aggregate(server, [upload_of(algo, server, 0, 3)], 1)
    assert new.model.keys() == server.model.keys()
    assert all(torch.equal(new.model[n], server.model[n]) for n in server.model)
    assert isinstance(new, ServerState)


def test_a_tiny_update_is_applied_unclipped():
    """A gradient far below ``max_grad_norm`` (norm under 1e-6) is not rescaled: ``phi <- phi - lr g``."""
    algo, server = make({"max_grad_norm": 50.0})
    up = upload_of(algo, server, 1, 5)
    tiny = Upload(1, {k: 1e-9 * t for k, t in up.tensors.items()}, 10, 1)
    g_net, g_embed = algo.gradients(server, tiny)
    assert torch.sqrt(sum((g ** 2).sum() for g in [*g_net.values(), g_embed])) < 1e-6
    new = algo.aggregate(server, [tiny], 1)
    for k, g in g_net.items():
        assert torch.allclose(new.extra["pfedhn.hn/" + k], server.extra["pfedhn.hn/" + k] - 0.1 * g, atol=1e-12)


def test_a_hypernetwork_that_generates_zeros_gets_unit_output_scales():
    """No generated RMS to match (an all-zero output layer): every tensor keeps scale 1, none is infinite."""
    algo, server = make({"output_scale": "init"})
    net = {k: (torch.zeros_like(t) if k.startswith("out.") else t) for k, t in algo.hypernetwork(server).items()}
    scales = algo.output_scales(net, server.extra["pfedhn.embed"])
    assert set(scales) == {n for n, _ in algo.model.module.named_parameters()}
    assert all(float(v) == 1.0 for v in scales.values())


def test_the_server_gradient_goes_through_the_output_scales():
    """With ``output_scale = "init"`` the generated model is ``s * h(v; phi)``: the vector-Jacobian product
    carries the factor s."""
    algo, server = make({"output_scale": "init", "chunk_size": 0})
    assert any(abs(float(s) - 1.0) > 0.1 for s in algo.scales(server).values())
    up = upload_of(algo, server, 2, 6)
    net = {k: t.detach().clone().requires_grad_() for k, t in algo.hypernetwork(server).items()}
    embed = server.extra["pfedhn.embed"][2].detach().clone().requires_grad_()
    theta = algo.generate(net, embed, algo.scales(server))
    inner = sum((theta[n] * -up.tensors["pfedhn.delta/" + n]).sum() for n in theta)
    expected = torch.autograd.grad(inner, [*net.values(), embed])
    g_net, g_embed = algo.gradients(server, up)
    for (k, g), e in zip(g_net.items(), expected[:-1], strict=True):
        assert torch.allclose(g, e, atol=1e-6), k
    assert torch.allclose(g_embed, expected[-1], atol=1e-6)


def test_a_gradient_below_max_grad_norm_is_applied_as_it_is():
    algo, server = make({"max_grad_norm": 1e6})
    up = upload_of(algo, server, 1, 7)
    g_net, _ = algo.gradients(server, up)
    new = algo.aggregate(server, [up], 1)
    for k, g in g_net.items():
        assert torch.allclose(new.extra["pfedhn.hn/" + k], server.extra["pfedhn.hn/" + k] - 0.1 * g, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_hypernetwork_lives_on_the_models_device():
    algo, server = make({"output_scale": "init"})
    on_gpu = algo.init_server({n: t.cuda() for n, t in server.model.items()})
    assert any(k.startswith("pfedhn.scale/") for k in on_gpu.extra)
    assert all(t.device.type == "cuda" for t in on_gpu.extra.values())
    assert torch.allclose(on_gpu.extra["pfedhn.embed"].cpu(), server.extra["pfedhn.embed"])


@pytest.mark.parametrize("chunk_size", [16, 0])
def test_the_initialisation_depends_on_the_run_seed_alone(chunk_size):
    """Every hypernetwork tensor and embedding is drawn from the run seed's own stream: torch's global
    generator does not change it; another run seed does."""
    setup = tiny_setup()
    algo = build_algorithm("pfedhn", {**PLAIN, "chunk_size": chunk_size}, setup)
    torch.manual_seed(123)
    a = algo.init_hypernetwork(torch.device("cpu"))
    torch.manual_seed(456)
    b = algo.init_hypernetwork(torch.device("cpu"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    setup.seed = 1
    other = build_algorithm("pfedhn", {**PLAIN, "chunk_size": chunk_size}, setup).init_hypernetwork(
        torch.device("cpu"))
    assert all(not torch.equal(a[k], other[k]) for k in a)


def test_linear_layers_start_uniform_in_plus_minus_one_over_sqrt_fan_in():
    from hetfl.algorithms.pfedhn import linear_init

    weight, bias = linear_init(2000, 25, torch.Generator().manual_seed(0))
    for t in (weight, bias):
        assert t.min() >= -0.2 and t.max() <= 0.2  # bound 1 / sqrt(25)
        assert t.min() < -0.19 and t.max() > 0.19  # the whole interval is reached
