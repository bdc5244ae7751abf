"""Paths of the vectorised executor's bookkeeping that its second mutation run (``benchmarks/mutation.py``'s
``engine_vectorized_calls``, session 40) found untested: each test below failed on mutants that every other test
of the executor let pass.

* **Where a fallback happened**: the message of a step that could not be vmapped, or that read a context dict its
  algorithm declared unread, names the innermost line of the method's own code (not torch's, not the engine's).
* **The run's caches**: which call :meth:`~hetfl.engine.vectorized.VectorizedCache.used` reports as the first one
  dropped (the log says it once), what running out of memory makes the cache forget, and a plan drawn ahead for
  other data.
* **The CUDA-graph capture** (:meth:`~hetfl.engine.vectorized.CompiledCall.capture`), with ``torch.cuda``'s graph
  API standing in on the CPU: one memory pool per run, what the capture records, and the graph replayed.
* **The memory probe** (:func:`~hetfl.engine.vectorized.probe_client_bytes`): one step of one client, on the
  group's device, with the bfloat16 copies a bf16 run keeps.
* **The build phases** that ``benchmarks/profile_round.py --round 1`` adds up, by name.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hetfl import config
from hetfl.algorithms.base import SHARED
from hetfl.engine import vectorized
from hetfl.engine.experiment import Experiment
from hetfl.engine.local import train_client
from hetfl.engine.vectorized import (
    BUILD_PHASE,
    NotReadBySteps,
    StepReadError,
    VectorizedCache,
    VectorizedGroup,
    graphs_capturable,
    train_clients_vectorized,
    where_in_method,
)
from tests.helpers.executors import (
    ATOL,
    SYNTHETIC,
    graph_groups_on_the_cpu,
    round_contexts,
    train_moon_with_nothing_declared_read,
)

# eight Synthetic(1, 1) devices capped at 300 samples: clients that finish early, short batches, blocks of steps
SMALL = [*SYNTHETIC, "data.num_clients=8", "data.options={max_samples = 300, num_devices = 8}",
         "train.local_epochs=1", "train.momentum=0.5"]
THIS_FILE = str(Path(__file__).resolve())


def frame(filename: str, lineno: int, name: str) -> traceback.FrameSummary:
    return traceback.FrameSummary(filename, lineno, name, lookup_line=False)


def test_a_fallbacks_place_is_the_innermost_line_of_the_methods_own_code():
    """Of a traceback's frames (outermost first), the innermost one outside torch, the engine and the model
    caller: the method's loss line that called ``.item()``, not torch's frames under it."""
    torch_dir = str(Path(torch.__file__).parent)
    engine_file = str(Path(vectorized.__file__))
    frames = traceback.StackSummary.from_list([
        frame(engine_file, 10, "step"), frame("/plugins/runner.py", 12, "train"),
        frame("/plugins/my_method.py", 41, "stages"), frame("/plugins/my_loss.py", 57, "loss"),
        frame(f"{torch_dir}/_tensor.py", 99, "item"), frame(engine_file, 12, "write")])
    assert vectorized._in_method(frames) == " (at /plugins/my_loss.py:57, in loss)"
    assert vectorized._in_method(traceback.StackSummary.from_list([frame(engine_file, 1, "run")])) == ""
    assert vectorized._in_method(traceback.StackSummary.from_list([])) == ""


def test_a_caught_errors_place_comes_from_its_own_traceback():
    def loss_that_calls_item():
        raise RuntimeError("a Tensor with 2 elements cannot be converted to Scalar")

    line = loss_that_calls_item.__code__.co_firstlineno + 1
    try:
        loss_that_calls_item()
    except RuntimeError as err:
        assert where_in_method(err) == f" (at {THIS_FILE}:{line}, in loss_that_calls_item)"


@pytest.mark.parametrize(("use", "said"), [
    (lambda d: d["head.weight"], "ctx.payload['head.weight']"),
    (lambda d: list(d), "ctx.payload (iterated)"),
    (lambda d: len(d), "ctx.payload (its length or truth value)"),
    (lambda d: bool(d), "ctx.payload (its length or truth value)"),
])
def test_every_use_of_a_dict_declared_unread_is_refused_naming_the_use_the_line_and_the_fix(use, said):
    guard = NotReadBySteps("payload")
    with pytest.raises(StepReadError) as caught:
        use(guard)
    # the line is this test's (under a mutation tool, its trampoline's: the place itself is tested above)
    assert re.fullmatch(rf"a step used {re.escape(said)} \(at [^()]+:\d+, in [\w<>]+\), but its algorithm's step_reads "
                        r"leaves 'payload' out: add it to the algorithm's step_reads", str(caught.value)), caught.value


def test_the_cache_says_when_it_drops_its_first_compiled_call_and_only_then():
    cache = VectorizedCache(max_calls=1)
    said = []
    for key in ("a", "b", "c", "b"):
        cache.programs.setdefault(key, None)  # type: ignore[arg-type]
        said.append(cache.used(key))
    assert said == [False, True, False, False] and cache.dropped == 3 and list(cache.programs) == ["b"]


def test_running_out_of_memory_forgets_only_what_groups_of_that_size_kept():
    """A chunk of 4 clients that ran out of memory: the buffers and compiled calls of groups of 4 go (a
    smaller chunk comes next); those of groups of 2 stay, and so do the other structures' compiled calls."""
    cache = VectorizedCache()
    groups = [("fedavg", 4), ("fedavg", 2), ("moon", 4)]
    for group in groups:
        cache.buffers[group] = object()  # type: ignore[assignment]
        for index in range(2):
            cache.programs[(group, index, "stage", (4, 16))] = object()  # type: ignore[assignment]
    cache.drop(4)
    assert list(cache.buffers) == [("fedavg", 2)]
    assert [key[0] for key in cache.programs] == [("fedavg", 2), ("fedavg", 2)]
    cache.forget(lambda group: group[0] == "fedavg")
    assert not cache.programs and list(cache.buffers) == [("fedavg", 2)]  # forget leaves the buffers


def test_a_plan_drawn_ahead_for_other_data_is_not_taken():
    """One cache and one algorithm, two data objects of one configuration (the same clients and sizes: only the
    data's identity differs): the plan drawn ahead on the first for round 2 is not taken on the second, whose
    own plan ahead is then taken in round 3."""
    exps = [Experiment(config.load(None, [*SMALL, "algorithm.name=fedavg"])) for _ in range(2)]
    exp, cache = exps[0], VectorizedCache()
    server = exp.initial_server()
    for data, round_, hits in ((exps[0].data, 1, 0), (exps[1].data, 2, 0), (exps[1].data, 3, 1)):
        train_clients_vectorized(exp.algorithm, round_contexts(exp, server, {}, round_), data, seed=exp.cfg.seed,
                                 train_cfg=exp.cfg.train, step_mode="static", cache=cache)
        assert cache.ahead_hits == hits, round_


def test_graphs_are_captured_on_cuda_devices_only():
    assert graphs_capturable(torch.device("cuda", 0)) and graphs_capturable(torch.device("cuda"))
    assert not graphs_capturable(torch.device("cpu")) and not graphs_capturable(torch.device("meta"))


class CudaGraphsOnTheCpu:
    """``torch.cuda``'s graph API standing in on the CPU: ``graph(g, pool=p)`` records what runs inside it (the
    group's body), puts the buffers back as a capture leaves them (it runs nothing), and ``g.replay()`` runs the
    recorded body again. Counts the pools made and records every capture's graph and pool."""

    def __init__(self, monkeypatch) -> None:
        self.pools: list[object] = []
        self.captures: list[tuple[object, object]] = []
        self.recording: CudaGraphsOnTheCpu.Graph | None = None
        api = self

        class Graph:
            def __init__(self) -> None:
                self.bodies: list[tuple] = []
                self.replays = 0

            def replay(self) -> None:
                self.replays += 1
                for group, stage, index, call in self.bodies:
                    real_body(group, stage, index, call)

        class Capture:
            def __init__(self, graph, pool=None) -> None:
                self.graph, self.pool = graph, pool

            def __enter__(self):
                api.captures.append((self.graph, self.pool))
                api.recording, api.saved = self.graph, None
                return self

            def __exit__(self, *exc):
                api.recording = None
                if api.saved is not None:
                    vectorized.restore(*api.saved)
                return False

        def pool_handle():
            api.pools.append(object())
            return api.pools[-1]

        real_body = VectorizedGroup.body

        def body(group, stage, index, call):
            if api.recording is not None:
                if api.saved is None:
                    tensors = group.buffers.tensors(index)
                    api.saved = (tensors, [{n: t.clone() for n, t in d.items()} for d in tensors])
                api.recording.bodies.append((group, stage, index, call))
            return real_body(group, stage, index, call)

        self.Graph = Graph
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", Capture)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", pool_handle)
        monkeypatch.setattr(VectorizedGroup, "body", body)
        graph_groups_on_the_cpu(monkeypatch)


@pytest.fixture
def failing_captures(monkeypatch) -> list:
    """Graph mode on the CPU whose every capture fails (as a stage with a host sync would); the calls whose capture
    was tried, in order."""
    CudaGraphsOnTheCpu(monkeypatch)
    captures: list = []

    def failing(self):  # type: ignore[no-untyped-def]
        captures.append(self)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(vectorized.CompiledCall, "capture", failing)
    return captures


def graph_rounds(exp: Experiment, rounds: range, cache: VectorizedCache | None, notes: list[str]) -> None:
    """Rounds of ``exp``'s clients in graph mode, each compared with the sequential clients."""
    server = exp.initial_server()
    for round_ in rounds:
        vec = train_clients_vectorized(exp.algorithm, round_contexts(exp, server, {}, round_), exp.data,
                                       seed=exp.cfg.seed, train_cfg=exp.cfg.train, step_mode="graph", cache=cache,
                                       log=notes.append)
        seq = [train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
               for ctx in round_contexts(exp, server, {}, round_)]
        for a, b in zip(seq, vec, strict=True):
            assert a.steps == b.steps
            for name in a.state:
                assert (a.state[name] - b.state[name]).abs().max().item() <= ATOL, name


def test_a_capture_records_the_calls_body_into_one_pool_per_run_and_the_graph_is_replayed(monkeypatch):
    """Every capture of a run shares one memory pool (the graphs' temporaries never outlive a replay); the
    capture records the call's own body (its stage, its index, its static inputs) into the graph that each later
    call of its shape replays; a capture without a cache has no shared pool."""
    cuda = CudaGraphsOnTheCpu(monkeypatch)
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedprox"]))
    cache, notes = VectorizedCache(), []
    graph_rounds(exp, range(1, 3), cache, notes)
    assert not notes, notes
    assert len(cuda.pools) == 1 and cache.pool is cuda.pools[0]
    assert len(cuda.captures) == len(cache.programs) > 1
    assert all(pool is cache.pool for _, pool in cuda.captures)
    assert sorted(id(call.graph) for call in cache.programs.values()) == sorted(id(graph) for graph, _ in cuda.captures)
    for call in cache.programs.values():
        # what round 1's group recorded: the buffers kept for round 2's (a graph replays on the kept buffers)
        assert [(g.buffers, s, i, c) for g, s, i, c in call.graph.bodies] == [(call.group.buffers, call.stage,
                                                                               call.index, call.inputs)]
        assert call.graph.replays >= 2  # the check's replay, then round 2's at least
    cuda.captures.clear()
    graph_rounds(exp, range(1, 2), None, notes)
    assert cuda.captures and all(pool is None for _, pool in cuda.captures) and len(cuda.pools) == 1
    assert not notes, notes


def build_phases(exp: Experiment, **settings) -> set[str]:
    """The ``hetfl.build/<phase>`` ranges a profiled vectorised round 1 of ``exp``'s clients records."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train_clients_vectorized(exp.algorithm, round_contexts(exp, exp.initial_server(), {}, 1), exp.data,
                                 seed=exp.cfg.seed, train_cfg=exp.cfg.train, cache=VectorizedCache(), **settings)
    return {e.key.removeprefix(f"{BUILD_PHASE}/") for e in prof.key_averages() if e.key.startswith(BUILD_PHASE)}


@pytest.mark.slow  # a whole round under torch.profiler, 5 s
@pytest.mark.engine_slow
def test_a_profiled_rounds_build_phases_are_named_for_the_profile_script(monkeypatch):
    """``benchmarks/profile_round.py --round 1`` adds up the ``hetfl.build/<phase>`` ranges: a static call's first
    run; a graph's reference, capture and check; with compiled steps (``torch.compile`` standing in: the step
    uncompiled), the compiled step's own reference before the capture."""
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedavg"]))
    assert build_phases(exp, step_mode="static") == {"first run"}
    CudaGraphsOnTheCpu(monkeypatch)
    assert build_phases(exp, step_mode="graph") == {"reference", "capture", "check"}
    compiled: list[int] = []

    def uncompiled(*args):  # type: ignore[no-untyped-def]
        compiled.append(1)
        return vectorized.vmapped_step(*args)

    monkeypatch.setattr(vectorized, "run_compiled", uncompiled)
    assert build_phases(exp, step_mode="graph", compile_steps=True) == {"reference", "compiled reference", "capture",
                                                                        "check"}
    assert compiled


def test_a_stage_whose_capture_failed_runs_eagerly_in_later_rounds_too(failing_captures):
    """The call whose capture failed stays in the run's cache, run eagerly: round 2 equals the sequential
    clients, nothing is captured again, and the reason was said once."""
    captures = failing_captures
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedprox"]))
    notes: list[str] = []
    graph_rounds(exp, range(1, 3), VectorizedCache(), notes)
    assert len(captures) == 1 and len(notes) == 1 and "capture failed for stage 'local'" in notes[0], notes


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_memory_probe_runs_one_step_of_one_client_on_the_groups_device(monkeypatch, precision):
    """The probe's step is the first of the first stage, of one row, measured on the data's device with CUDA's
    counters (standing in here); in bf16 it adds the weights' bfloat16 copies that a client's row keeps."""
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=scaffold", f"train.precision={precision}"]))
    ctx = round_contexts(exp, exp.initial_server(), {}, 1)[0]
    plan = vectorized.ClientPlan.of(exp.algorithm, ctx)
    devices: list = []

    def counter(value):
        return lambda device=None: (devices.append(device), value)[1]

    monkeypatch.setattr(torch.cuda, "synchronize", counter(None))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", counter(None))
    monkeypatch.setattr(torch.cuda, "memory_allocated", counter(1_000))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", counter(5_000))
    bodies: list = []
    real_body = VectorizedGroup.body
    monkeypatch.setattr(VectorizedGroup, "body", lambda self, stage, index, call: (
        bodies.append((stage, index, call.steps, call.width, self.buffers.k)), real_body(self, stage, index, call))[1])
    low_names = exp.algorithm.model.low_precision_names
    settings = {"batch_size": 16, "drop_last": False, "max_grad_norm": 0.0, "buffers": (), "precision": precision,
                "low_names": low_names}
    low = sum(plan.start[n].numel() * 2 for n in low_names) if precision == "bf16" else 0
    assert precision == "fp32" or low > 0
    state_bytes = sum(t.nbytes for t in plan.start.values())
    assert vectorized.probe_client_bytes(plan, exp.data, seed=0, **settings) == 4_000 + state_bytes + low
    assert bodies == [(plan.stages[0], 0, 1, 1, 1)]
    assert devices and all(d == exp.data.device for d in devices), devices


def test_each_client_steps_read_their_own_payload(monkeypatch):
    """A payload that differs between clients (a per-client anchor of FedProx's proximal term, as a
    personalised method's server sends) is stacked, and each row's step reads its client's own."""
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedprox", "algorithm.mu=1.0", "train.local_steps=3"]))
    base = type(exp.algorithm).payload

    def anchors(self, server, client_id):  # type: ignore[no-untyped-def]
        return {n: t + 0.05 * (client_id + 1) if t.is_floating_point() else t
                for n, t in base(self, server, client_id).items()}

    monkeypatch.setattr(type(exp.algorithm), "payload", anchors)
    server = exp.initial_server()
    seq = [train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
           for ctx in round_contexts(exp, server, {}, 1)]
    vec = train_clients_vectorized(exp.algorithm, round_contexts(exp, server, {}, 1), exp.data, seed=exp.cfg.seed,
                                   train_cfg=exp.cfg.train)
    for a, b in zip(seq, vec, strict=True):
        assert b.metric_sums["prox"] == pytest.approx(a.metric_sums["prox"], rel=1e-4)
        for name in a.state:
            assert (a.state[name] - b.state[name]).abs().max().item() <= ATOL, name


def test_a_graph_that_disagreed_leaves_its_call_running_eagerly_in_later_rounds(monkeypatch):
    """The call whose graph disagreed with its eager reference stays in the run's cache without a graph: round 2
    runs it eagerly (equal to the sequential clients) and nothing is captured again."""
    CudaGraphsOnTheCpu(monkeypatch)
    captured: list = []

    class Corrupt:
        def __init__(self, call) -> None:
            self.call = call

        def replay(self) -> None:
            c = self.call
            c.group.body(c.stage, c.index, c.inputs)
            for t in c.group.buffers.state.values():
                if t.is_floating_point():
                    t.add_(0.01)

    def capture(self):
        captured.append(self)
        self.graph = Corrupt(self)

    monkeypatch.setattr(vectorized.CompiledCall, "capture", capture)
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedprox"]))
    notes: list[str] = []
    graph_rounds(exp, range(1, 3), VectorizedCache(), notes)
    assert len(captured) == 1 and len(notes) == 1 and "disagrees with the eager step" in notes[0], notes


def test_free_device_memory_is_cudas_for_the_groups_device(monkeypatch):
    asked: list = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (asked.append(device), (123_456, 10**9))[1])
    assert vectorized.free_memory_bytes(torch.device("cuda", 1)) == 123_456
    assert asked == [torch.device("cuda", 1)]
    assert vectorized.free_memory_bytes(torch.device("cpu")) is None and len(asked) == 1


@pytest.mark.parametrize(("free", "fit"), [(10_000, 7), (1_000, 1)])
def test_what_fits_is_probed_with_the_groups_plan_data_seed_and_settings(monkeypatch, free, fit):
    """0.7 of the free memory over one client's probe (at least one client: a single client that does not fit is
    the run's out-of-memory error), the probe run on the plan, the data, the seed and the settings given."""
    probed: list = []
    monkeypatch.setattr(vectorized, "free_memory_bytes", lambda device: (probed.append(device), free)[1])
    monkeypatch.setattr(vectorized, "probe_client_bytes",
                        lambda plan, data, **kw: (probed.append((plan, data, kw)), 1_000)[1])
    plan, data = object(), SimpleNamespace(device=torch.device("cuda", 0))
    settings = {"batch_size": 16, "drop_last": True, "max_grad_norm": 0.5, "buffers": ("bn.running_mean",)}
    assert vectorized.clients_that_fit(plan, data, seed=7, **settings) == fit  # type: ignore[arg-type]
    assert probed == [data.device, (plan, data, {"seed": 7, **settings})]


def test_the_first_compiled_call_dropped_is_said_once_with_what_it_costs(monkeypatch):
    CudaGraphsOnTheCpu(monkeypatch)
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedprox"]))
    notes: list[str] = []
    graph_rounds(exp, range(1, 3), VectorizedCache(max_calls=2), notes)
    assert notes == ["vectorized: more than 2 call shapes met; the least recently used CUDA graphs are dropped (and "
                     "captured again if their shape returns)"]


class Weighted:
    def __init__(self, weight: float) -> None:
        self.weight = weight

    def loss(self, state, batch, ctx):  # type: ignore[no-untyped-def]
        return self.weight * state["w"].sum(), {}

    def __call__(self, state, batch, ctx):  # type: ignore[no-untyped-def]
        return self.loss(state, batch, ctx)


def scaled(factor):  # type: ignore[no-untyped-def]
    return lambda state, batch, ctx: (factor * state["w"].sum(), {})


def test_what_a_stages_compiled_steps_depend_on():
    """Two stages share compiled steps (and clients share a group) only where their steps compute the same: a
    loss that is a method of another object, or a closure over other values, is another step; the same method
    looked up again (a new bound-method object each time), the same closure values and another learning rate
    (read from a tensor) are the same step."""
    from hetfl.algorithms.base import Stage
    from hetfl.optim import SGDConfig

    first, second = Weighted(1.0), Weighted(2.0)
    stage = Stage("local", first.loss, ("w",), SGDConfig(lr=0.1, momentum=0.9))
    key = vectorized.stage_key
    assert key(stage) == key(replace(stage, loss=first.loss))
    assert key(stage) != key(replace(stage, loss=second.loss))
    assert key(replace(stage, loss=scaled(2))) == key(replace(stage, loss=scaled(2)))
    assert key(replace(stage, loss=scaled(2))) != key(replace(stage, loss=scaled(3)))
    weights = [float(x) for x in ("0.25", "0.25")]  # equal values in two objects (a weight computed each round)
    assert weights[0] is not weights[1] and key(replace(stage, loss=scaled(weights[0]))) == \
        key(replace(stage, loss=scaled(weights[1])))
    anchor = torch.zeros(2)
    assert key(replace(stage, loss=scaled(anchor))) != key(replace(stage, loss=scaled(torch.zeros(2))))
    assert key(replace(stage, loss=first)) != key(replace(stage, loss=second))  # objects without code: by identity
    assert key(replace(stage, draws=torch.randn)) == key(replace(stage, draws=torch.randn))  # and builtins
    assert key(replace(stage, draws=torch.randn)) != key(replace(stage, draws=torch.rand))
    assert key(stage) == key(replace(stage, sgd=SGDConfig(lr=0.5, momentum=0.9)))
    for changed in (replace(stage, name="classifier"), replace(stage, trainable=("w", "b")),
                    replace(stage, sgd=SGDConfig(lr=0.1, momentum=0.5)), replace(stage, epochs=2),
                    replace(stage, steps=3), replace(stage, grad_transform=second.loss),
                    replace(stage, draws=second.loss), replace(stage, adversary=replace(stage, name="max"))):
        assert key(changed) != key(stage), changed
    assert key(replace(stage, adversary=replace(stage, loss=first.loss))) == \
        key(replace(stage, adversary=replace(stage, loss=first.loss)))
    assert key(None) is None and vectorized.callable_key(None) is None


def test_a_built_call_is_reused_only_where_the_plain_values_its_step_read_are_the_same():
    """A CUDA graph bakes in the round's plain values that its step read (here ``round``): in a later round it is
    reused only where they are equal; a call not built yet has read nothing."""
    call = vectorized.CompiledCall.__new__(vectorized.CompiledCall)
    call.built, call.reads, call.scalars = False, set(), ()

    def template(**values):  # type: ignore[no-untyped-def]
        return SimpleNamespace(scalars=lambda names: tuple((n, values[n]) for n in sorted(names)))

    assert call.reusable(template(round=2, lr=0.1))
    call.built, call.reads, call.scalars = True, {"round"}, (("round", 1),)
    assert call.reusable(template(round=1, lr=0.5)) and not call.reusable(template(round=2, lr=0.1))


def test_clients_whose_stages_differ_train_in_groups_of_their_own(monkeypatch):
    """Clients whose tensors agree but whose stages do not (here: half of them take more local steps, as a
    method with a per-client budget would give them) are not one vmapped group: each group runs its own stages,
    and every client equals its sequential run."""
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedavg", "train.local_steps=3"]))
    base = type(exp.algorithm).stages
    monkeypatch.setattr(type(exp.algorithm), "stages", lambda self, ctx: [
        replace(s, steps=s.steps + 2 * (ctx.client_id % 2)) for s in base(self, ctx)])
    server = exp.initial_server()
    seq = [train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
           for ctx in round_contexts(exp, server, {}, 1)]
    notes: list[str] = []
    vec = train_clients_vectorized(exp.algorithm, round_contexts(exp, server, {}, 1), exp.data, seed=exp.cfg.seed,
                                   train_cfg=exp.cfg.train, log=notes.append)
    assert notes == ["vectorized: 2 client groups with different stage structures or tensor shapes"]
    assert sorted({r.steps for r in seq}) == [3, 5] and [r.steps for r in vec] == [r.steps for r in seq]
    for a, b in zip(seq, vec, strict=True):
        for name in a.state:
            assert (a.state[name] - b.state[name]).abs().max().item() <= ATOL, name


def test_a_step_reading_a_dict_its_algorithm_declared_unread_is_refused_naming_it(monkeypatch):
    """MOON's step reads the payload (the global model's features): declared away, reading it is refused, naming
    the dict, the entry and the fix (the line is moon.py's; under a mutation tool, its trampoline's)."""
    with pytest.raises(StepReadError, match=r"^a step used ctx\.payload\['[\w.]+'\] \(at [^()]+:\d+, in [\w<>]+\), "
                                            r"but its algorithm's step_reads leaves 'payload' out: add it to the "
                                            r"algorithm's step_reads$"):
        train_moon_with_nothing_declared_read(monkeypatch, SMALL)


@pytest.mark.parametrize(("setting", "said"), [
    ({"step_mode": "fast"}, "step_mode = 'fast': must be one of ('eager', 'static', 'graph')"),
    ({"step_mode": "graph"}, "step_mode = 'graph' needs a CUDA device, not cpu"),
    ({"conv_batching": "fused"}, "conv_batching = 'fused': must be one of ('grouped', 'per_client')"),
])
def test_a_groups_bad_setting_is_refused_naming_it_and_what_is_allowed(setting, said):
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedavg"]))
    plans = [vectorized.ClientPlan.of(exp.algorithm, ctx) for ctx in round_contexts(exp, exp.initial_server(), {}, 1)]
    with pytest.raises(ValueError) as caught:
        VectorizedGroup(plans, exp.data, seed=0, batch_size=16, drop_last=False, max_grad_norm=0.0, buffers=(),
                        **setting)
    assert str(caught.value) == said


def test_the_memory_probe_runs_in_the_layout_of_the_groups_steps(monkeypatch):
    """What fits is probed with the run's settings and the layout its steps will run in (channels-last batches,
    per-client convolutions): their activations and workspaces are what the group will hold."""
    probed: list[dict] = []
    monkeypatch.setattr(vectorized, "free_memory_bytes", lambda device: 10_000)
    monkeypatch.setattr(vectorized, "probe_client_bytes", lambda plan, data, **kw: (probed.append(kw), 1_000)[1])
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedavg", "train.local_steps=2"]))
    train_clients_vectorized(exp.algorithm, round_contexts(exp, exp.initial_server(), {}, 1), exp.data,
                             seed=exp.cfg.seed, train_cfg=exp.cfg.train, channels_last=True, conv_batching="per_client")
    assert len(probed) == 1
    assert {k: probed[0][k] for k in ("seed", "channels_last", "conv_batching", "batch_size", "precision")} == {
        "seed": exp.cfg.seed, "channels_last": True, "conv_batching": "per_client", "batch_size": 16,
        "precision": "fp32"}


def test_a_stage_whose_capture_failed_is_not_captured_again_for_a_later_rounds_new_shapes(failing_captures):
    """Sampled clients bring new call shapes in round 2: the run's cache remembers that the stage cannot be
    captured, so they are built eagerly, not captured (and failed) again."""
    captures = failing_captures
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedprox", "train.clients_per_round=4"]))
    assert set(exp.sample_clients(1)) != set(exp.sample_clients(2))
    cache, notes = VectorizedCache(), []
    graph_rounds(exp, range(1, 2), cache, notes)
    built = len(cache.programs)
    graph_rounds(exp, range(2, 3), cache, notes)
    assert len(cache.programs) > built  # round 2 met new shapes
    assert len(captures) == 1 and len(notes) == 1, notes


def test_a_graph_reads_the_shared_data_the_cache_keeps_so_a_later_rounds_values_reach_it(monkeypatch):
    """FedMix's clients read the means every client received (``ctx.shared``); a captured step reads them from
    the buffers the run's cache keeps, which each round loads with its own values: round 2, whose means differ,
    equals the sequential clients (a graph reading round 1's tensors would replay round 1's means)."""
    CudaGraphsOnTheCpu(monkeypatch)
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedmix", "train.local_steps=3"]))
    server, _, _ = exp.setup_round(exp.initial_server())
    assert any(name.startswith(SHARED) for name in server.extra)
    cache = VectorizedCache()
    for round_, scale in ((1, 1.0), (2, 3.0)):
        sent = replace(server, extra={n: t * scale if n.startswith(SHARED) else t for n, t in server.extra.items()})
        seq = [train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
               for ctx in round_contexts(exp, sent, {}, round_)]
        notes: list[str] = []
        vec = train_clients_vectorized(exp.algorithm, round_contexts(exp, sent, {}, round_), exp.data,
                                       seed=exp.cfg.seed, train_cfg=exp.cfg.train, step_mode="graph", cache=cache,
                                       log=notes.append)
        assert not notes, notes
        for a, b in zip(seq, vec, strict=True):
            for name in a.state:
                assert (a.state[name] - b.state[name]).abs().max().item() <= ATOL, (round_, name)


def test_a_cache_that_keeps_no_call_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match=r"^max_calls = 0: must be at least 1 \(the call being run is kept\)$"):
        VectorizedCache(max_calls=0)


def test_a_stage_torch_compile_failed_on_runs_uncompiled_in_later_rounds_without_trying_again(monkeypatch):
    """Three rounds: the first runs the steps uncompiled while their call is built (``CompiledCall.build``), the
    second tries torch.compile, which fails; the third, a new group, must know it from the cache (a set of its
    own, mutant ``VectorizedGroup.__init__`` 87 of session 41, tried again)."""
    tries: list[int] = []

    def failing(*args):  # type: ignore[no-untyped-def]
        tries.append(1)
        raise NotImplementedError("an op Dynamo cannot trace")

    monkeypatch.setattr(vectorized, "run_compiled", failing)
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedavg", "train.local_steps=3"]))
    cache, notes = VectorizedCache(), []
    server = exp.initial_server()
    for round_ in (1, 2, 3):
        train_clients_vectorized(exp.algorithm, round_contexts(exp, server, {}, round_), exp.data, seed=exp.cfg.seed,
                                 train_cfg=exp.cfg.train, step_mode="static", cache=cache, compile_steps=True,
                                 log=notes.append)
    assert len(tries) == 1 and notes == ["vectorized: torch.compile could not compile stage 'local'; running it "
                                         "uncompiled: NotImplementedError: an op Dynamo cannot trace"], notes
