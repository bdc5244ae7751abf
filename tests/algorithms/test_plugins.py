"""A researcher's own methods (plug-ins): the mistakes of a first plug-in are named, and the executors give a
plug-in's method the numbers they give a built-in one (session 27's audit, benchmarks/results/plugin_audit.md)."""

from __future__ import annotations

import pytest

from hetfl import algorithms, config
from hetfl.algorithms import register
from hetfl.algorithms.base import Algorithm, cross_entropy
from hetfl.engine.experiment import Experiment
from hetfl.engine.local import train_client
from hetfl.engine.vectorized import train_clients_vectorized
from tests.helpers.executors import ATOL, SYNTHETIC, round_contexts


@pytest.fixture
def registry(monkeypatch):
    """The method registry as it is, restored after the test (a test's plug-ins register into it)."""
    monkeypatch.setattr(algorithms, "_CLASSES", dict(algorithms._CLASSES))
    monkeypatch.setattr(algorithms, "_PLUGIN_FILES", dict(algorithms._PLUGIN_FILES))
    return algorithms._CLASSES


class SizeWeighted(Algorithm):
    """A loss that reads the client's plain values in its step: weighted by the client's size and id."""

    name = "sizeweighted"
    citation = "a test"

    def loss(self, state, batch, ctx):
        ce = cross_entropy(self.model.logits(state, batch.x), batch.y)
        weight = 1.0 + ctx.num_samples / 100.0 + ctx.client_id % 2
        return weight * ce, {"ce": ce.detach()}


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_a_step_reading_the_clients_size_or_id_gets_its_own_values_when_vectorised(registry, mode):
    """The vectorised executor runs one step for a group of clients, whose sizes and ids differ: a step that
    reads ctx.num_samples or ctx.client_id saw 0 and -1 there (session 27: train_loss 2.52 against the
    sequential 33.95 in round 1, silently). It now runs those clients one at a time, with the sequential
    numbers, and says which value the step read."""
    register(SizeWeighted)
    exp = Experiment(config.load(None, [*SYNTHETIC, "algorithm.name=sizeweighted", "train.local_steps=3"]))
    server, _, _ = exp.setup_round(exp.initial_server())
    seq = [train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
           for ctx in round_contexts(exp, server, {}, 1)]
    notes: list[str] = []
    vec = train_clients_vectorized(exp.algorithm, round_contexts(exp, server, {}, 1), exp.data, seed=exp.cfg.seed,
                                   train_cfg=exp.cfg.train, step_mode=mode, log=notes.append)
    for a, b in zip(seq, vec, strict=True):
        assert b.loss_sum == pytest.approx(a.loss_sum, rel=1e-5)
        for name in a.state:
            assert (a.state[name] - b.state[name]).abs().max().item() <= ATOL
    said = [n for n in notes if "falling back" in n]
    assert said and "ctx.num_samples" in said[0] and "begin" in said[0], notes
    assert f"(at {__file__}:" in said[0] and "in loss)" in said[0]  # where: the plug-in's line


def test_a_compiled_step_cannot_read_the_clients_size_or_id_either():
    """runtime.compile's steps see a StepContext built from the group's template: its client_id and num_samples
    were the template's -1 and 0; now reading them refuses, and the stage runs uncompiled, then per client."""
    from hetfl.algorithms.base import ClientContext
    from hetfl.engine.compiled_step import PerClientValueRead, StepContext

    base = ClientContext(client_id=-1, round=3, num_samples=0, lr=0.1, payload={}, state={})
    ctx = StepContext(base, {}, {}, {})
    assert (ctx.round, ctx.lr) == (3, 0.1)
    for name in ("client_id", "num_samples", "features", "inputs"):
        with pytest.raises(PerClientValueRead, match=f"ctx.{name}"):
            getattr(ctx, name)
