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


EMA_PLUGIN = '''
from hetfl.algorithms import register
from hetfl.algorithms.base import Algorithm, cross_entropy

EMA = "ema/"


@register
class EmaProx(Algorithm):
    """A pull towards the client's own moving average of its models, kept in its persistent state."""

    name = "emaprox_test"
    citation = "a test"

    def init_client_state(self, client_id, server):
        return {EMA + n: server.model[n].clone() for n in self.model.param_names}

    def loss(self, state, batch, ctx):
        ce = cross_entropy(self.model.logits(state, batch.x), batch.y)
        prox = sum((state[n] - ctx.state[EMA + n]).pow(2).sum() for n in self.model.param_names)
        return ce + 0.05 * prox, {"ce": ce.detach(), "prox": prox.detach()}

    def finish(self, ctx, local, steps):
        upload = {n: local[n] for n in self.model.state_names}
        return upload, {EMA + n: 0.5 * ctx.state[EMA + n] + 0.5 * local[n] for n in self.model.param_names}
'''


def test_a_simulated_flower_node_loads_the_plugins_the_server_loaded(registry, tmp_path, monkeypatch):
    """A simulated node is a Ray worker process: it knew only the built-in methods, so every client of a
    plug-in's run failed ('unknown method') and the run stopped. The simulation lists the server's plug-in files
    in the nodes' environment, and a node loads them before building its experiment."""
    from hetfl.flower import node
    from hetfl.flower.protocol import PLUGINS_ENV

    plugin = tmp_path / "ema_plugin.py"
    plugin.write_text(EMA_PLUGIN)
    monkeypatch.setenv(PLUGINS_ENV, str(plugin))
    node.load_listed_plugins()
    assert "emaprox_test" in algorithms._CLASSES
    algorithms._CLASSES.pop("emaprox_test")
    node.load_listed_plugins()  # loaded once per process: a plug-in file it holds is not run again
    assert "emaprox_test" not in algorithms._CLASSES


def test_a_method_registered_outside_a_plugin_file_is_refused_on_flower_before_anything_runs(registry, tmp_path):
    """A notebook's method cannot reach the simulation's node processes: refused naming it, nothing written."""
    pytest.importorskip("flwr")
    from hetfl.flower.simulation import check_nodes_know
    from hetfl.params import ConfigError

    register(SizeWeighted)
    with pytest.raises(ConfigError, match="sizeweighted.*--plugin FILE"):
        check_nodes_know(["sizeweighted"])
    check_nodes_know(["fedavg", "scaffold"])


@pytest.mark.processes
@pytest.mark.slow  # Ray's start, ~20 s
def test_a_plugins_method_on_flower_gives_the_sequential_numbers(registry, tmp_path, one_thread):
    """The README: every method runs unchanged on Flower's simulation, with the sequential executor's numbers;
    a plug-in's method (its client state kept on the nodes) too."""
    pytest.importorskip("flwr")
    pytest.importorskip("ray")
    import json

    from hetfl.cli import main

    plugin = tmp_path / "ema_plugin.py"
    plugin.write_text(EMA_PLUGIN)
    common = ["--plugin", str(plugin), "--set", "algorithm.name=emaprox_test", "--set", "model.name=mlp",
              "--set", "model.options={hidden=[16]}", "--set", "train.rounds=2", "--set", "train.local_steps=3",
              "--set", "data.partition=dirichlet", "--set", "data.num_clients=3", "--set", "runtime.threads=1",
              "--quiet"]
    assert main(["run", *common, "--out", str(tmp_path / "seq")]) == 0
    assert main(["run", *common, "--set", "runtime.executor=flower", "--out", str(tmp_path / "flower")]) == 0

    def lines(run):
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in row.items() if not k.endswith("time_s") and k != "failed_clients"
                 and not k.startswith("flower_")} for row in rows]

    assert lines("flower") == lines("seq") and lines("seq")[-1]["train_prox"] > 0
