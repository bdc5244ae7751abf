"""DANN (Ganin et al. 2016) with clients as domains: the gradient reversal layer, the domain
head as averaged method tensors, the loss's gradients, learning and vectorisation."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

from hetfl import config
from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import Batch, ClientContext, Upload
from hetfl.algorithms.dann import DOMAIN, HEAD, ganin_lambda, gradient_reversal, mlp
from hetfl.engine.experiment import Experiment
from hetfl.params import ConfigError
from tests.helpers import SMALL_MNIST, initial_state, needs_shared_data, tiny_setup
from tests.helpers.executors import SYNTHETIC, compare_one_round

pytestmark = pytest.mark.usefixtures("one_thread")


def test_gradient_reversal_is_identity_forward_and_flips_and_scales_the_gradient():
    x = torch.randn(5, 3, requires_grad=True)
    w = torch.randn(5, 3)
    y = gradient_reversal(x, 0.3)
    assert torch.equal(y, x)  # exactly the identity forward
    (w * y).sum().backward()
    torch.testing.assert_close(x.grad, -0.3 * w)
    # lam = 0: the features get no gradient from the domain loss, the value is still x
    x0 = x.detach().clone().requires_grad_()
    (w * gradient_reversal(x0, 0.0)).sum().backward()
    assert torch.count_nonzero(x0.grad) == 0


def test_gradient_reversal_scales_the_gradient_with_one_rounding_at_small_lambdas():
    """At FedBR's lam = 0.01 the reversed gradient is ``-lam g`` rounded once: no cancellation of
    ``g - (1 + lam) g``, which lost about seven bits (a rounding difference upstream, e.g. a batched
    matrix product on a GPU against a plain one, came out a hundred times larger)."""
    torch.manual_seed(0)
    x = torch.randn(256, 64, requires_grad=True)
    w = torch.randn(256, 64)
    for lam in (0.01, 1e-4, 0.3):
        x.grad = None
        (w * gradient_reversal(x, lam)).sum().backward()
        assert torch.equal(x.grad, -(lam * w)), lam


def test_gradient_reversal_composes_with_torch_func():
    w = torch.randn(4, 3)
    xs = torch.randn(2, 4, 3)
    grads = vmap(grad(lambda x: (w * gradient_reversal(x, 2.0)).sum()))(xs)
    torch.testing.assert_close(grads, -2.0 * w.expand(2, 4, 3))


def test_ganin_schedule_ramps_from_zero_to_lambda():
    assert ganin_lambda(0.5, 0.0) == 0.0
    assert ganin_lambda(0.5, 1.0) == pytest.approx(0.5 * (2 / (1 + math.exp(-10)) - 1))
    values = [ganin_lambda(1.0, p / 10) for p in range(11)]
    assert all(a < b for a, b in itertools.pairwise(values))
    setup = tiny_setup(rounds=5)
    algo = build_algorithm("dann", {"schedule": "ganin", "lam": 0.2}, setup)
    assert algo.lam_at(1) == 0.0 and algo.lam_at(5) == pytest.approx(ganin_lambda(0.2, 0.8))
    assert build_algorithm("dann", {"lam": 0.2}, setup).lam_at(1) == 0.2  # constant (FedBR's code)


def test_domain_head_is_seeded_method_tensors_averaged_with_the_model():
    setup = tiny_setup(num_clients=4)
    algo = build_algorithm("dann", {"hidden": 16}, setup)
    assert (algo.hp.lam, algo.hp.schedule) == (0.01, "constant")
    server = algo.init_server(initial_state(setup))
    shapes = {n: tuple(server.model[n].shape) for n in algo.head_names()}
    assert shapes == {HEAD + "0.weight": (16, 8), HEAD + "0.bias": (16,), HEAD + "1.weight": (16, 16),
                      HEAD + "1.bias": (16,), HEAD + "2.weight": (4, 16), HEAD + "2.bias": (4,)}  # 4 clients
    assert server.model[HEAD + "0.weight"].abs().max() <= 1 / math.sqrt(8)
    again = algo.init_server(initial_state(setup))
    assert all(torch.equal(server.model[n], again.model[n]) for n in algo.head_names())
    ctx = ClientContext(2, 1, 10, 0.1, server.model, {})
    assert set(algo.start_state(ctx)) == set(setup.model.state_names) | set(algo.head_names())
    assert set(algo.trainable_names()) == set(setup.model.param_names) | set(algo.head_names())
    upload, _ = algo.finish(ctx, algo.start_state(ctx), 1)
    assert set(algo.head_names()) <= set(upload)
    ups = [Upload(c, {k: v * s for k, v in upload.items()}, num_samples=10, steps=1) for c, s in ((0, 1.0), (1, 3.0))]
    new = algo.aggregate(server, ups, 1)
    for name in algo.head_names():
        torch.testing.assert_close(new.model[name], 2 * server.model[name])


def test_loss_trains_the_head_to_find_the_client_and_the_features_to_hide_it():
    """Gradients: the head descends the domain loss; the encoder descends CE and ascends lam * domain loss."""
    setup = tiny_setup(num_clients=3)
    lam = 0.7
    algo = build_algorithm("dann", {"lam": lam, "hidden": 8}, setup)
    server = algo.init_server(initial_state(setup))
    ctx = ClientContext(2, 1, 6, 0.1, server.model, {})
    ctx.extras = algo.begin(ctx)
    assert ctx.extras[DOMAIN].item() == 2 and ctx.extras[DOMAIN].dtype == torch.long
    batch = Batch(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 0, 1, 2]))
    state = algo.start_state(ctx)
    names = algo.trainable_names()
    leaves = {n: state[n].clone().requires_grad_() for n in names}
    loss, metrics = algo.loss({**state, **leaves}, batch, ctx)
    grads = dict(zip(names, torch.autograd.grad(loss, [leaves[n] for n in names]), strict=True))

    plain = {n: state[n].clone().requires_grad_() for n in names}
    z, logits = setup.model.features_and_logits({**state, **plain}, batch.x)
    ce = F.cross_entropy(logits, batch.y)
    domain_ce = F.cross_entropy(mlp(plain, HEAD, 3, z), torch.full((6,), 2))
    assert metrics["ce"].item() == pytest.approx(ce.item(), rel=1e-6)
    assert metrics["domain_ce"].item() == pytest.approx(domain_ce.item(), rel=1e-6)
    assert loss.item() == pytest.approx((ce + domain_ce).item(), rel=1e-6)
    g_ce = dict(zip(names, torch.autograd.grad(ce, [plain[n] for n in names], allow_unused=True, retain_graph=True),
                    strict=True))
    g_dom = dict(zip(names, torch.autograd.grad(domain_ce, [plain[n] for n in names], allow_unused=True), strict=True))
    zero = torch.zeros(())
    for name in names:
        a = g_ce[name] if g_ce[name] is not None else zero
        b = g_dom[name] if g_dom[name] is not None else zero
        if name.startswith(HEAD):  # the domain classifier: plain descent on the domain loss
            torch.testing.assert_close(grads[name], b + 0 * a)
        elif name.startswith("classifier."):  # the label classifier never sees the domain loss
            torch.testing.assert_close(grads[name], a)
        else:  # the feature extractor: reversed and scaled by lam
            torch.testing.assert_close(grads[name], a - lam * b, rtol=1e-5, atol=1e-7)
            assert torch.count_nonzero(b) > 0


def test_settings_are_validated():
    with pytest.raises(ConfigError, match="algorithm.schedule"):
        build_algorithm("dann", {"schedule": "linear"}, tiny_setup())
    with pytest.raises(ConfigError, match="algorithm.lam"):
        build_algorithm("dann", {"lam": -1.0}, tiny_setup())


@pytest.mark.slow  # fast cover: tests/engine/test_vectorized.py's every-method test (dann)
def test_vectorised_equals_sequential():
    exp = Experiment(config.load(None, [*SYNTHETIC, "data.num_clients=12", "data.partition=dirichlet",
                                        "algorithm.name=dann", "algorithm.lam=0.5", "algorithm.hidden=32"]))
    compare_one_round(exp)


@needs_shared_data
def test_dann_learns(tmp_path):
    cfg = config.load(None, [*SMALL_MNIST, "algorithm.name=dann", "algorithm.lam=0.1"])
    summary = Experiment(cfg).run(tmp_path)
    detail = json.dumps({k: v for k, v in summary.items() if k != "config"})
    assert summary["final_global_acc"] > 0.6, detail  # chance: about 0.1
    assert summary["final_client_acc_mean"] > 0.6, detail
