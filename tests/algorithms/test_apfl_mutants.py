"""APFL's alpha step, its chunked gradient, the projections and what it logs (mutation testing, session 26;
Deng, Kamani, Mahdavi 2020, Algorithm 1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import Batch
from hetfl.engine.local import sgd_step
from hetfl.optim import sgd_init
from tests.algorithms.test_personalized_baselines import bn_setup
from tests.helpers import context, initial_state, perturbed, tiny_setup

X, Y = torch.randn(6, 4, generator=torch.Generator().manual_seed(8)), torch.tensor([0, 1, 2, 0, 1, 2])


def make(params=None, setup=None, **train):
    setup = setup or tiny_setup(**train)
    algo = build_algorithm("apfl", params or {}, setup)
    return algo, algo.init_server(initial_state(setup))


def client(algo, server, alpha, lr=0.1):
    """A client with a local model away from the global one, mixing weight ``alpha``, data ``X, Y``."""
    v = perturbed(server.model, 0.3, 9)
    state = {**{"apfl.local/" + n: v[n] for n in algo.model.state_names}, "apfl.alpha": torch.tensor(alpha)}
    ctx = context(0, server.model, state, lr=lr)
    ctx.inputs = lambda: Batch(X, Y)
    return ctx, v


def alpha_gradient_by_hand(algo, v, w, alpha):
    """``d/d alpha`` of the mean cross-entropy of ``alpha v + (1 - alpha) w`` over ``X, Y``."""
    a = torch.tensor(alpha, requires_grad=True)
    mixed = {n: a * v[n] + (1 - a) * w[n] for n in algo.model.param_names}
    return torch.autograd.grad(F.cross_entropy(algo.model.logits({**v, **mixed}, X), Y), a)[0]


def test_the_alpha_gradient_over_chunks_is_the_whole_sets_gradient():
    """``eval_batch_size = 4`` over 6 samples: chunks of 4 and 2 sum to the mean over all 6."""
    algo, server = make(eval_batch_size=4)
    ctx, v = client(algo, server, 0.4)
    expected = alpha_gradient_by_hand(algo, v, server.model, 0.4)
    assert torch.allclose(algo.alpha_gradient(ctx), expected, atol=1e-6)


def test_the_once_per_round_alpha_step_takes_the_client_lr_by_default_and_is_projected():
    algo, server = make()
    ctx, v = client(algo, server, 0.4, lr=0.1)
    g = alpha_gradient_by_hand(algo, v, server.model, 0.4)
    assert torch.allclose(algo.begin(ctx)["apfl.alpha"], (0.4 - 0.1 * g).clamp(0, 1), atol=1e-6)
    big, _ = make({"alpha_lr": 1e6})
    for alpha in (0.0, 0.5, 1.0):  # a huge step leaves [0, 1] and stops at the edge it heads for
        ctx, _ = client(big, server, alpha)
        g = alpha_gradient_by_hand(big, v, server.model, alpha)
        assert float(big.begin(ctx)["apfl.alpha"]) == (0.0 if g > 0 else 1.0)


def test_the_alpha_gradient_leaves_the_batchnorm_statistics_alone():
    algo, server = make(setup=bn_setup())
    ctx, _ = client(algo, server, 0.5)
    before = {k: t.clone() for k, t in ctx.state.items()}
    algo.alpha_gradient(ctx)
    for k, t in ctx.state.items():
        assert torch.equal(t, before[k]), k


def test_apfl_without_the_clients_data_says_what_it_needs():
    algo, server = make()
    ctx, _ = client(algo, server, 0.5)
    ctx.inputs = None
    with pytest.raises(ValueError) as err:
        algo.begin(ctx)
    assert str(err.value) == "apfl needs the client's data (ClientContext.inputs)"


@pytest.mark.parametrize("lr", [0.1, 0.0])
def test_a_per_step_alpha_update_lands_on_the_projected_step_despite_weight_decay(lr):
    """``alpha <- P_[0,1](alpha - eta <v - w, grad f(v_bar)>)`` through the stage's SGD with weight decay;
    at lr 0 nothing moves."""
    algo, server = make({"alpha_every": "step"}, weight_decay=0.3)
    ctx, v = client(algo, server, 0.4, lr=lr)
    state = algo.start_state(ctx)
    (stage,) = algo.stages(ctx)
    new, _, _, metrics = sgd_step(stage, dict(state), sgd_init({n: state[n] for n in stage.trainable}, stage.sgd),
                                  Batch(X, Y), ctx, True)
    g = alpha_gradient_by_hand(algo, v, server.model, 0.4)
    assert torch.allclose(new["apfl.alpha"], (0.4 - lr * g).clamp(0, 1), atol=1e-6)
    assert set(metrics) == {"ce", "ce_personal", "alpha"}  # train_ce, train_ce_personal, train_alpha
    assert torch.allclose(metrics["ce"], F.cross_entropy(algo.model.logits(server.model, X), Y))
    mixed = {n: 0.4 * v[n] + 0.6 * server.model[n] for n in algo.model.param_names}
    assert torch.allclose(metrics["ce_personal"], F.cross_entropy(algo.model.logits({**v, **mixed}, X), Y))
    assert float(metrics["alpha"]) == pytest.approx(0.4)


def test_the_stored_alpha_is_projected_and_a_client_that_never_trained_is_evaluated_with_the_global_model():
    algo, server = make()
    ctx, _ = client(algo, server, 0.4)
    local = {**algo.start_state(ctx), "apfl.alpha": torch.tensor(1.7)}
    _, state = algo.finish(ctx, local, 1)
    assert float(state["apfl.alpha"]) == 1.0
    _, state = algo.finish(ctx, {**local, "apfl.alpha": torch.tensor(-0.2)}, 1)
    assert float(state["apfl.alpha"]) == 0.0
    assert algo.client_model(server, {}, 0) is server.model
    assert float(algo.init_client_state(0, server)["apfl.alpha"]) == 0.5


@pytest.mark.parametrize(("grad", "expected"), [(-1e6, 1.0), (1e6, 0.0)])
def test_a_per_step_alpha_step_out_of_the_unit_interval_stops_at_its_edge(grad, expected):
    """``P_[0,1]``: a huge step up lands on 1, a huge step down on 0 (through the stage's SGD, weight decay
    cancelled)."""
    algo, server = make({"alpha_every": "step"}, weight_decay=0.3)
    ctx, _ = client(algo, server, 0.4, lr=0.05)
    state = algo.start_state(ctx)
    transformed = algo.alpha_step({"apfl.alpha": torch.tensor(grad)}, state, ctx)
    new = state["apfl.alpha"] - 0.05 * (transformed["apfl.alpha"] + 0.3 * state["apfl.alpha"])
    assert torch.allclose(new, torch.tensor(expected), atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_alpha_lives_on_the_models_device():
    setup = tiny_setup()
    setup.model.module.cuda()
    algo = build_algorithm("apfl", {}, setup)
    server = algo.init_server({n: t.cuda() for n, t in initial_state(setup).items()})
    alpha = algo.init_client_state(0, server)["apfl.alpha"]
    assert alpha.device.type == "cuda" and alpha.dtype == torch.float32
