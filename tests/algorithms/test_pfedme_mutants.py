"""pFedMe's inner problem with weight decay, its plain-SGD outer step, a zero learning rate and what it logs
(mutation testing, session 26; T. Dinh et al., NeurIPS 2020, Algorithm 1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import Batch, ServerState, Upload
from hetfl.engine.local import sgd_step
from hetfl.optim import SGDConfig, sgd_init
from tests.helpers import context, initial_state, perturbed, tiny_setup

X, Y = torch.randn(6, 4, generator=torch.Generator().manual_seed(7)), torch.tensor([0, 1, 2, 0, 1, 2])
LAM, K, PLR = 2.0, 3, 0.05


def make(**train):
    setup = tiny_setup(**train)
    algo = build_algorithm("pfedme", {"lam": LAM, "inner_steps": K, "personal_lr": PLR}, setup)
    return algo, algo.init_server(initial_state(setup))


def start(algo, server, lr):
    ctx = context(0, server.model, {}, lr=lr)
    state = algo.start_state(ctx)
    theta0 = perturbed({n: server.model[n] for n in algo.model.param_names}, 0.1, 10)
    state.update({"pfedme.theta/" + n: theta0[n] for n in algo.model.param_names})
    return ctx, state, theta0


def inner_by_hand(algo, w, theta, wd):
    """K gradient steps on ``f + lam/2 ||theta - w||^2`` with the run's weight decay on theta."""
    names = algo.model.param_names
    for _ in range(K):
        leaves = {n: theta[n].clone().requires_grad_() for n in names}
        value = F.cross_entropy(algo.model.logits({**w, **leaves}, X), Y) + LAM / 2 * sum(
            ((leaves[n] - w[n]) ** 2).sum() for n in names)
        grads = torch.autograd.grad(value, [leaves[n] for n in names])
        theta = {n: theta[n] - PLR * (g + wd * theta[n]) for n, g in zip(names, grads, strict=True)}
    return theta


def step(algo, state, ctx):
    (stage,) = algo.stages(ctx)
    new, _, loss, metrics = sgd_step(stage, dict(state), sgd_init({n: state[n] for n in stage.trainable}, stage.sgd),
                                     Batch(X, Y), ctx, True)
    return {**state, **new}, loss, metrics


def test_the_runs_weight_decay_applies_in_the_inner_problem_and_the_outer_step_is_plain_sgd():
    """``theta <- theta - personal_lr (grad + wd theta)``; the outer step ``w <- w - eta lam (w - theta_hat)``
    takes neither the run's momentum nor its weight decay."""
    algo, server = make(momentum=0.9, weight_decay=0.1)
    ctx, state, theta0 = start(algo, server, 0.1)
    (stage,) = algo.stages(ctx)
    assert stage.sgd == SGDConfig(lr=0.1, momentum=0.0, weight_decay=0.0)
    theta = inner_by_hand(algo, server.model, theta0, 0.1)
    after, _, _ = step(algo, state, ctx)
    for n in algo.model.param_names:
        assert torch.allclose(after["pfedme.theta/" + n], theta[n], atol=1e-5), n
        assert torch.allclose(after[n], server.model[n] - 0.1 * LAM * (server.model[n] - theta[n]), atol=1e-5), n


def test_a_zero_learning_rate_leaves_the_models_where_they_are_and_logs_the_envelope():
    """At lr 0 (a schedule's end) the step moves nothing and the loss is the finite envelope value
    ``f(theta_hat) + lam/2 ||theta_hat - w||^2``, logged with the inner solution's cross-entropy."""
    algo, server = make()
    ctx, state, theta0 = start(algo, server, 0.0)
    theta = inner_by_hand(algo, server.model, theta0, 0.0)
    after, loss, metrics = step(algo, state, ctx)
    for n in state:
        assert torch.equal(after[n], state[n]), n
    ce = F.cross_entropy(algo.model.logits({**server.model, **theta}, X), Y)
    envelope = ce + LAM / 2 * sum(((theta[n] - server.model[n]) ** 2).sum() for n in algo.model.param_names)
    assert torch.isfinite(loss) and torch.allclose(loss, envelope, atol=1e-5)
    assert set(metrics) == {"ce_personal", "envelope"}  # train_ce_personal, train_envelope in metrics.jsonl
    assert torch.allclose(metrics["ce_personal"], ce, atol=1e-5)
    assert torch.allclose(metrics["envelope"], envelope, atol=1e-5)


def test_the_server_step_keeps_the_servers_other_tensors():
    algo, server = make()
    server = ServerState(model=server.model, extra={"kept": torch.arange(3)})
    new = algo.aggregate(server, [Upload(0, perturbed(server.model, 0.1, 1), 10, 1)], 1)
    assert new.extra.keys() == {"kept"} and torch.equal(new.extra["kept"], torch.arange(3))


def test_the_local_stage_runs_the_runs_epochs_or_steps():
    for train, expected in (({"local_epochs": 3}, (3, 0)), ({"local_steps": 7}, (1, 7))):
        algo, server = make(**train)
        (stage,) = algo.stages(context(0, server.model, {}, lr=0.1))
        assert stage.name == "local" and (stage.epochs, stage.steps) == expected, train
