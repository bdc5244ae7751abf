"""Graph mode's build of a call, on the CPU: the reference run, the capture, the checked replay.

A CUDA graph records a call's kernels and replays them. Here a stand-in records the call's body
(run when replayed, as the graph's kernels are) so that what graph mode does around the capture runs
where CUDA does not: the state put back after the reference run, the first replay checked against
that reference, the fallback to eager steps when they disagree, the replays of later rounds, and with
``runtime.compile`` the compiled step's run before the capture as the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from torch._dynamo.utils import counters

from hetfl import config
from hetfl.engine import compiled_step, vectorized
from hetfl.engine.experiment import Experiment
from tests.engine.test_compiled_step import compiling_torch
from tests.helpers.executors import SYNTHETIC, compare_one_round


@dataclass
class Captures:
    replays: list[str] = field(default_factory=list)  # the stage of each replay
    compiled_in_capture: list[int] = field(default_factory=list)  # graphs torch.compile made, per capture


class RecordedBody:
    """Stands in for a captured CUDA graph: replaying runs the call's body on its static inputs."""

    def __init__(self, call: vectorized.CompiledCall, replays: list[str]) -> None:
        self.call, self.replays = call, replays

    def replay(self) -> None:
        self.replays.append(self.call.stage.name)
        self.call.group.body(self.call.stage, self.call.index, self.call.inputs)


@pytest.fixture
def recorded_graphs(monkeypatch):
    """Graph mode on the CPU, each capture recorded as a :class:`RecordedBody`; the replays, by stage.
    A capture runs the body once and puts the state back (a real capture runs nothing), to count the
    graphs torch.compile made while capturing (``compiled_in_capture``: a compile cannot be captured)."""
    graphs = Captures()

    def capture(self):  # type: ignore[no-untyped-def]
        tensors = self.group.buffers.tensors(self.index)
        saved = [{n: t.clone() for n, t in d.items()} for d in tensors]
        compiled_before = counters["stats"]["unique_graphs"]
        self.group.body(self.stage, self.index, self.inputs)
        graphs.compiled_in_capture.append(counters["stats"]["unique_graphs"] - compiled_before)
        vectorized.restore(self.group.buffers.tensors(self.index), saved)
        self.graph = RecordedBody(self, graphs.replays)

    monkeypatch.setattr(vectorized, "graphs_capturable", lambda device: True)
    monkeypatch.setattr(vectorized.CompiledCall, "capture", capture)
    return graphs


# 10 sampled clients, two full batches of 16 each, then a whole epoch: blocks and short batches
STEPS = [*SYNTHETIC, "train.clients_per_round=10", "train.momentum=0.5"]


@pytest.mark.parametrize("method", ["fedavg", "scaffold", "dann"])
def test_graph_mode_gives_the_sequential_clients(method, recorded_graphs):
    exp = Experiment(config.load(None, [*STEPS, "train.local_steps=5", f"algorithm.name={method}"]))
    notes: list[str] = []
    compare_one_round(exp, step_mode="graph", notes=notes)
    assert not [n for n in notes if "disagrees" in n or "capture failed" in n], notes
    assert recorded_graphs.replays


def test_a_replay_that_disagrees_with_its_reference_falls_back_to_eager_steps(recorded_graphs, monkeypatch):
    """A graph whose replay writes nothing (a lost write) is caught by the first replay's check: the
    stage runs eagerly from then on, with the reason logged, and the round's results are still right."""
    monkeypatch.setattr(RecordedBody, "replay", lambda self: None)
    exp = Experiment(config.load(None, [*STEPS, "train.local_steps=5", "algorithm.name=fedavg"]))
    notes: list[str] = []
    compare_one_round(exp, step_mode="graph", notes=notes)
    assert [n for n in notes if "disagrees with the eager step" in n], notes


@compiling_torch
def test_compiled_steps_in_graph_mode_give_the_sequential_clients(recorded_graphs, compiled_calls, monkeypatch):
    """runtime.compile in graph mode: a call's first run uncompiled (the values it reads), the compiled
    step's run before the capture as the reference, the replays compiled; traced with aot_eager."""
    monkeypatch.setattr(compiled_step, "BACKEND", "aot_eager")
    exp = Experiment(config.load(None, [*STEPS, "train.local_steps=2", "algorithm.name=fedavg",
                                        "runtime.compile=true"]))
    notes: list[str] = []
    compare_one_round(exp, step_mode="graph", notes=notes)
    assert not [n for n in notes if "disagrees" in n or "could not compile" in n], notes
    assert compiled_calls["n"] > 0 and recorded_graphs.replays
    assert not any(recorded_graphs.compiled_in_capture), "torch.compile compiled while a graph was captured"
