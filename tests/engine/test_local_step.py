"""A client's own training updates its state in place (``sgd_step_``): the functional step's values, to the bit.

The reference is :func:`hetfl.engine.local.sgd_step`, the same step written as a pure function (new tensors each
step), put in place of ``sgd_step_`` in :func:`hetfl.engine.local.run_stages`. The methods cover every path of
the in-place step: momentum and weight decay (FedAvg), a gradient transform (SCAFFOLD), an adversary's max step
before each min step (FedBR), two stages with their own optimiser states (FedPAC) and a loss that logs a
trained tensor itself (FedETF's ``beta``).
"""

from __future__ import annotations

import pytest
import torch

from hetfl import config
from hetfl.engine import local
from hetfl.engine.experiment import Experiment
from hetfl.engine.local import sgd_step, train_client
from tests.helpers.executors import round_contexts

SMALL = ["data.num_clients=30", "data.options={max_samples = 200}", "train.batch_size=16", "train.local_steps=6",
         "train.momentum=0.9", "train.weight_decay=0.001", "runtime.progress=false", "model.options={hidden = [16]}"]
SETTINGS = {"fedetf": ["algorithm.pers_cycles=1", "algorithm.pers_epochs=1"]}


def functional_step_(stage, state, opt_state, batch, ctx, first_step, max_grad_norm=0.0, buffers=(),  # type: ignore[no-untyped-def]
                     precision="fp32", low=None):
    """``sgd_step_``'s interface over the functional step: new tensors, put in the caller's dicts (float32:
    no bfloat16 weight copies)."""
    assert low is None
    new, opt, loss, metrics = sgd_step(stage, state, opt_state, batch, ctx, first_step, max_grad_norm,
                                       buffers=buffers, precision=precision)
    state.update(new)
    opt_state.update(opt)
    return loss, {k: v.clone() for k, v in metrics.items()}


def train_round(exp: Experiment, clients: int = 3) -> list[local.LocalResult]:
    return [train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
            for ctx in round_contexts(exp, exp.initial_server(), {}, 1)[:clients]]


@pytest.mark.parametrize("method", ["fedavg", "scaffold", "fedbr", "fedpac", "fedetf"])
def test_the_in_place_update_gives_the_functional_steps_values_to_the_bit(method, monkeypatch):
    exp = Experiment(config.load(None, [*SMALL, f"algorithm.name={method}", *SETTINGS.get(method, [])]))
    got = train_round(exp)
    monkeypatch.setattr(local, "sgd_step_", functional_step_)
    want = train_round(exp)
    for a, b in zip(got, want, strict=True):
        assert a.steps == b.steps > 0
        assert a.loss_sum == b.loss_sum
        assert a.metric_sums == b.metric_sums  # FedETF's beta: the value each step used, not the updated one
        assert set(a.state) == set(b.state)
        for name in a.state:
            assert torch.equal(a.state[name], b.state[name]), f"{method}: {name}"


def test_training_leaves_the_start_state_and_the_payload_as_they_were():
    """The update writes in place into a copy of the start: the server's tensors are never touched."""
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedavg"]))
    ctx = round_contexts(exp, exp.initial_server(), {}, 1)[0]
    start = exp.algorithm.start_state(ctx)
    before = {name: t.clone() for name, t in {**start, **ctx.payload}.items()}
    result = train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
    assert not torch.equal(result.state["classifier.weight"], before["classifier.weight"])  # it trained
    for name, t in {**start, **ctx.payload}.items():
        assert torch.equal(t, before[name]), name


def test_a_logged_trained_tensor_is_the_value_the_step_used():
    """A loss may log a trainable tensor itself; the in-place update must not change what was logged."""
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedavg"]))
    ctx = round_contexts(exp, exp.initial_server(), {}, 1)[0]
    stage = exp.algorithm.stages(ctx)[0]
    plain_loss = stage.loss

    def logging_loss(state, batch, ctx):  # type: ignore[no-untyped-def]
        loss, metrics = plain_loss(state, batch, ctx)
        return loss, {**metrics, "bias": state["classifier.bias"]}

    stage.loss = logging_loss
    state = {name: t.clone() for name, t in exp.algorithm.start_state(ctx).items()}
    used = state["classifier.bias"].clone()
    batch = next(exp.data.train_batches(0, [torch.arange(16)], torch.Generator()))
    _, metrics = local.sgd_step_(stage, state, {n: torch.zeros_like(state[n]) for n in stage.trainable}, batch, ctx,
                                 first_step=True)
    assert not torch.equal(state["classifier.bias"], used)
    assert torch.equal(metrics["bias"], used)
