"""The vectorised executor's static-buffer step (the computation a CUDA graph captures),
its checks and fallbacks, and automatic chunking, on the CPU.

The ``static`` step mode runs each stage's steady-state step over all clients of a
group on static buffers with a client mask, exactly as the captured graph does, but
without the capture; a CUDA graph differs from it only in replaying the recorded
kernels. The capture itself needs a GPU (tests/engine/test_precision.py-style CUDA tests are
skipped here); its check and fallback logic is exercised with stand-in graphs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hetfl import config
from hetfl.algorithms import available
from hetfl.engine import vectorized
from hetfl.engine.experiment import Experiment
from hetfl.engine.local import train_client
from hetfl.engine.vectorized import (
    ClientPlan,
    CompiledCall,
    NotReadBySteps,
    StepReadError,
    VectorizedCache,
    VectorizedGroup,
    train_clients_vectorized,
)
from tests.helpers import MNIST, needs_shared_data
from tests.helpers.executors import (
    CAPPED,
    SYNTHETIC,
    compare_one_round,
    graph_groups_on_the_cpu,
    local_training,
    local_training_on_cuda,
    round_contexts,
    train_moon_with_nothing_declared_read,
)

# one epoch: still clients of very different sizes (short last batches, clients that finish
# early while others take full batches: calls of shrinking ranges of rows)
SMALL = [*SYNTHETIC, "train.local_epochs=1", "train.momentum=0.5"]
# the same on devices capped at 300 samples (42 to 240 to train on: the same kinds of calls, in fewer
# steps), for the tests of the plan and its cache that run several rounds
SMALL_CAPPED = [*SMALL, CAPPED]


def test_static_calls_pad_gathered_rows_with_the_scratch_row(compiled_runs, monkeypatch):
    """Rows that are not consecutive (short batches of one size, taken together) are gathered, their
    width rounded up with the scratch row (here one padding entry in every such call): what the padding
    computes is never read."""
    from hetfl.engine import step_plan

    monkeypatch.setattr(step_plan, "bucket_width", lambda width, rows: width + 1)
    exp = Experiment(config.load(None, [*SYNTHETIC, CAPPED, "algorithm.name=scaffold", "train.momentum=0.9"]))
    compare_one_round(exp, step_mode="static")
    assert compiled_runs["blocks"] > 0 and compiled_runs["padded"] > 0


class StandInGraph:
    """A CUDA graph's role on the CPU: ``replay`` runs the captured body on the static inputs;
    ``corrupt`` makes it lose a write, as a graph reading a stale buffer would."""

    def __init__(self, compiled: CompiledCall, corrupt: bool) -> None:
        self.compiled, self.corrupt, self.replays = compiled, corrupt, 0

    def replay(self) -> None:
        self.replays += 1
        c = self.compiled
        c.group.body(c.stage, c.index, c.inputs)
        if self.corrupt:
            for t in c.group.buffers.state.values():
                if t.is_floating_point():
                    t.add_(0.01)


def graph_mode_on_cpu(monkeypatch, capture) -> None:
    """The vectorised executor in graph mode with ``capture`` standing in for the CUDA capture."""
    monkeypatch.setattr(CompiledCall, "capture", capture)
    graph_groups_on_the_cpu(monkeypatch)


def graph_round(monkeypatch, capture, method="fedprox", round_=1, cache=None, exp=None):
    """One round of the vectorised executor in graph mode on the CPU; returns (results, notes, sequential results)."""
    graph_mode_on_cpu(monkeypatch, capture)
    exp = exp or Experiment(config.load(None, [*SMALL, f"algorithm.name={method}"]))
    server = exp.initial_server()
    notes: list[str] = []
    vec = train_clients_vectorized(exp.algorithm, round_contexts(exp, server, {}, round_), exp.data,
                                   seed=exp.cfg.seed, train_cfg=exp.cfg.train, step_mode="graph", log=notes.append,
                                   cache=cache)
    seq = [train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
           for ctx in round_contexts(exp, server, {}, round_)]
    return vec, notes, seq


def assert_same_clients(vec, seq) -> None:
    for a, b in zip(seq, vec, strict=True):
        assert a.steps == b.steps
        for name in a.state:
            assert torch.allclose(a.state[name], b.state[name], atol=1e-5), name


def test_a_faithful_graph_is_replayed_for_every_later_call_of_its_shape(monkeypatch):
    graphs: list[StandInGraph] = []

    def capture(self):
        graphs.append(StandInGraph(self, corrupt=False))
        self.graph = graphs[-1]

    vec, notes, seq = graph_round(monkeypatch, capture)
    assert_same_clients(vec, seq)
    assert not notes
    assert len(graphs) > 1 and sum(g.replays for g in graphs) > len(graphs)


def test_a_graph_that_disagrees_with_the_eager_call_is_dropped(monkeypatch):
    graphs: list[StandInGraph] = []

    def capture(self):
        graphs.append(StandInGraph(self, corrupt=True))
        self.graph = graphs[-1]

    vec, notes, seq = graph_round(monkeypatch, capture)
    assert_same_clients(vec, seq)  # the bad replay was undone, the stage went on eagerly
    assert graphs[0].replays == 1 and len(graphs) == 1  # the stage is not captured again
    assert any("disagrees with the eager step" in n for n in notes), notes


def test_a_capture_that_fails_falls_back_to_eager_steps_with_the_reason(monkeypatch):
    captures = []

    def capture(self):
        captures.append(self)
        raise RuntimeError("operation not permitted when stream is capturing")

    vec, notes, seq = graph_round(monkeypatch, capture)
    assert_same_clients(vec, seq)
    assert len(captures) == 1
    assert any("capture failed" in n and "not permitted" in n for n in notes), notes


@needs_shared_data
def test_a_capture_records_the_pooling_that_keeps_the_layout_and_eager_runs_pytorchs(monkeypatch):
    """In graph mode a call's eager runs (its reference, a replay's stand-in here) pool with PyTorch's rule,
    cheaper on the host at every step, and the capture records hetfl's layout rule (hetfl.models.layers.MaxPool2d:
    no layout copies among the kernels replayed at every step); the two agree, so the graphs are kept."""
    from hetfl.models import layers

    pooled = {"eager": 0, "capture": 0}
    phase = ["eager"]
    apply = layers._MaxPool2d.apply
    monkeypatch.setattr(layers._MaxPool2d, "apply",
                        lambda *a: (pooled.__setitem__(phase[0], pooled[phase[0]] + 1), apply(*a))[1])
    capturing = vectorized.is_capturing
    graphs: list[StandInGraph] = []

    def capture(self):
        tensors = self.group.buffers.tensors(self.index)
        before = [{n: t.clone() for n, t in d.items()} for d in tensors]
        monkeypatch.setattr(vectorized, "is_capturing", lambda: True)
        phase[0] = "capture"
        try:
            self.group.body(self.stage, self.index, self.inputs)  # what a capture records
        finally:
            phase[0] = "eager"
            monkeypatch.setattr(vectorized, "is_capturing", capturing)
        vectorized.restore(tensors, before)  # a capture runs nothing
        graphs.append(StandInGraph(self, corrupt=False))
        self.graph = graphs[-1]

    exp = Experiment(config.load(None, [
        "data.dataset=mnist", f"data.root={MNIST}", "data.download=false", "data.partition=dominant",
        "data.samples_per_client=48", "data.num_clients=3", "model.name=simple_cnn", "train.batch_size=16",
        "train.local_steps=10", "train.momentum=0.9", "runtime.device=cpu", "runtime.progress=false"]))
    vec, notes, seq = graph_round(monkeypatch, capture, exp=exp)
    assert_same_clients(vec, seq)
    assert not notes and graphs and sum(g.replays for g in graphs) > len(graphs)
    assert pooled["capture"] > 0 and pooled["eager"] == 0


@pytest.mark.slow  # 3 rounds of 4 methods, ~4 s
def test_graphs_are_kept_across_rounds_and_recaptured_when_a_step_reads_the_round(monkeypatch):
    """With a cache, round 2 replays round 1's graphs (FedProx: every shape again, nothing captured);
    DANN's loss reads ``ctx.round`` (its gradient-reversal weight), a constant inside a graph, so
    its graphs are captured again for round 2, and both rounds equal the sequential executor."""
    for method, recaptured in (("fedprox", False), ("dann", True)):
        graphs: list[StandInGraph] = []

        def capture(self, graphs=graphs):
            graphs.append(StandInGraph(self, corrupt=False))
            self.graph = graphs[-1]

        cache = VectorizedCache()
        exp = Experiment(config.load(None, [*SMALL_CAPPED, f"algorithm.name={method}"]))
        vec, _, seq = graph_round(monkeypatch, capture, round_=1, cache=cache, exp=exp)
        assert_same_clients(vec, seq)
        first = len(graphs)
        vec, _, seq = graph_round(monkeypatch, capture, round_=2, cache=cache, exp=exp)
        assert_same_clients(vec, seq)
        assert (len(graphs) > first) == recaptured, method
        assert sum(g.replays for g in graphs[:first]) > first * (not recaptured)


def static_round(exp, round_, cache):
    """Round ``round_``'s clients (from the initial server) trained vectorised in static mode with ``cache``,
    and sequentially."""
    server = exp.initial_server()
    vec = train_clients_vectorized(exp.algorithm, round_contexts(exp, server, {}, round_), exp.data,
                                   seed=exp.cfg.seed, train_cfg=exp.cfg.train, step_mode="static", cache=cache)
    seq = [train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
           for ctx in round_contexts(exp, server, {}, round_)]
    return vec, seq


def plan_tensors(stage_plans):
    return [[(c.shape(), c.rows, c.idx, c.augment, c.draws) for c in p.calls] + [p.steps] for p in stage_plans]


def assert_same_plans(a, b) -> None:
    for x, y in zip(plan_tensors(a), plan_tensors(b), strict=True):
        for u, v in zip(x, y, strict=True):
            if isinstance(u, tuple):
                assert u[0] == v[0]
                for t, w in zip(u[1:4], v[1:4], strict=True):
                    assert (t is None and w is None) or torch.equal(t, w)
                assert u[4].keys() == v[4].keys() and all(torch.equal(u[4][n], v[4][n]) for n in u[4])
            else:
                assert u == v


@pytest.fixture
def drawn(monkeypatch):
    """The rounds whose plans the groups draw (VectorizedGroup.plan), in order."""
    rounds: list[int] = []
    plan = VectorizedGroup.plan

    def counted(self, stages=None, round_=None):
        rounds.append(self.round if round_ is None else round_)
        return plan(self, stages, round_)

    monkeypatch.setattr(VectorizedGroup, "plan", counted)
    return rounds


def test_the_next_rounds_plan_is_drawn_while_this_round_runs_and_is_that_rounds_plan(drawn):
    """With every client in every round, each group draws the next round's plan after launching its
    calls (the device busy, the host otherwise waiting), and the next round takes it instead of planning:
    it is the plan that round draws itself (mixup: per-step draws too), and the clients are the
    sequential ones."""
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=mixup"]))
    cache = VectorizedCache()
    vec, seq = static_round(exp, 1, cache)
    assert_same_clients(vec, seq)
    assert drawn == [1, 2] and cache.ahead_tries == 1
    ((inputs, ahead, _),) = cache.ahead.values()
    assert inputs[0] == 2
    plans = [ClientPlan(c, exp.algorithm.stages(c), exp.algorithm.start_state(c))
             for c in round_contexts(exp, exp.initial_server(), {}, 2)]
    plans.sort(key=lambda p: -exp.data.client_sizes[p.ctx.client_id])
    group = VectorizedGroup(plans, exp.data, seed=exp.cfg.seed, batch_size=exp.cfg.train.batch_size,
                            drop_last=False, max_grad_norm=0.0, buffers=(), step_mode="static")
    assert_same_plans(ahead, group.plan())  # drawn ahead from round 2's generators: round 2's own plan
    drawn.clear()
    vec, seq = static_round(exp, 2, cache)
    assert_same_clients(vec, seq)
    assert drawn == [3] and cache.ahead_hits == 1  # round 2 took its plan, and drew round 3's


def test_a_plan_drawn_ahead_from_other_inputs_is_not_taken(drawn):
    """The same clients, but a plan drawn from other inputs (here: told it was drawn for 16 steps a
    call): the next round plans itself."""
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedavg"]))
    cache = VectorizedCache()
    static_round(exp, 1, cache)
    ((key, (inputs, ahead, stages)),) = cache.ahead.items()
    assert inputs[7] == 4  # block_steps
    cache.ahead[key] = ((*inputs[:7], 16, *inputs[8:]), ahead, stages)
    drawn.clear()
    vec, seq = static_round(exp, 2, cache)
    assert_same_clients(vec, seq)
    assert drawn == [2, 3] and cache.ahead_hits == 0  # planned itself, and drew round 3's


def test_a_plan_drawn_for_a_draw_function_that_holds_other_values_is_not_taken(drawn, monkeypatch):
    """A method of one's own whose per-step draws read a value made anew each round (here Mixup's weight,
    held in a new list each round): its draw function is another object each round, keyed by identity
    (``stage_key``; the plan drawn ahead holds the stages it was drawn for, so that no new object takes
    an old one's identity), so the next round plans itself, and its clients are the sequential ones."""
    from hetfl.algorithms.mixup import LAM, mixup_draws

    exp = Experiment(config.load(None, [*SMALL_CAPPED, "algorithm.name=mixup"]))
    stages = exp.algorithm.stages
    this_round: dict = {}  # the round's draw function, one for all its clients (so one group)

    def own_stages(ctx):
        if this_round.get("round") != ctx.round:
            weight = [0.25 + 0.5 * (ctx.round % 2)]  # 0.75 in odd rounds, 0.25 in even ones
            base = mixup_draws(1.0)

            def draw(generator, batch_size):
                return {**base(generator, batch_size), LAM: torch.tensor(weight[0])}

            this_round.update(round=ctx.round, draw=draw)
        return [dataclasses.replace(stage, draws=this_round["draw"]) for stage in stages(ctx)]

    monkeypatch.setattr(exp.algorithm, "stages", own_stages)
    cache = VectorizedCache()
    for round_ in (1, 2, 3):
        vec, seq = static_round(exp, round_, cache)
        assert_same_clients(vec, seq)
    assert cache.ahead_hits == 0 and drawn.count(2) == 2  # round 2's plan: drawn ahead, then drawn again


def test_a_plan_ahead_that_runs_out_of_memory_is_left_out_and_the_round_stands(monkeypatch):
    """Drawing ahead is an optimisation: out of device memory there, the round's results stand (not
    retried in halves as a round that runs out of memory is) and the next round plans itself."""
    plan = VectorizedGroup.plan

    def no_room_ahead(self, stages=None, round_=None):
        if round_ is not None:
            raise torch.cuda.OutOfMemoryError("no room for the plan ahead")
        return plan(self, stages, round_)

    monkeypatch.setattr(VectorizedGroup, "plan", no_room_ahead)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedavg"]))
    cache = VectorizedCache()
    notes: list[str] = []
    server = exp.initial_server()
    vec = train_clients_vectorized(exp.algorithm, round_contexts(exp, server, {}, 1), exp.data, seed=exp.cfg.seed,
                                   train_cfg=exp.cfg.train, step_mode="static", cache=cache, log=notes.append)
    seq = [train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
           for ctx in round_contexts(exp, server, {}, 1)]
    assert_same_clients(vec, seq)
    assert not notes and not cache.ahead


def test_a_plan_drawn_ahead_for_other_clients_is_not_taken_and_none_is_drawn_again(monkeypatch):
    """Sampled clients: each round's group is other clients, so it plans itself; once the plans drawn
    ahead in two rounds were all missed, none is drawn, and the one left over is dropped when its round
    has passed."""
    exp = Experiment(config.load(None, [*SMALL, "train.clients_per_round=6", "algorithm.name=fedavg"]))
    cache = VectorizedCache()
    for round_ in (1, 2, 3, 4):
        vec, seq = static_round(exp, round_, cache)
        assert_same_clients(vec, seq)
        assert cache.ahead_tries == min(round_, 2) and cache.ahead_hits == 0
    assert not cache.ahead


@pytest.mark.parametrize(("step_reads", "hits"), [(None, 3), (frozenset({"payload", "state"}), 2)])
def test_a_plan_drawn_ahead_is_missed_where_the_structure_the_steps_read_changes(monkeypatch, step_reads, hits):
    """MOON's clients hold their previous local model from round 2 on. Its steps read it from the extras,
    which hold the received model in round 1: the plan drawn ahead in round 1 is taken in round 2. Had its
    steps read the client state (``step_reads`` with "state", as a plug-in's may), whose entries appear in
    round 2, that plan would be missed and the later ones taken. Either way the run is the sequential one."""
    from hetfl.engine import experiment as experiment_module
    from hetfl.engine.summary import Reporter

    real = experiment_module.train_clients_vectorized
    monkeypatch.setattr(experiment_module, "train_clients_vectorized",
                        lambda *args, **kwargs: real(*args, **{**kwargs, "step_mode": "static"}))
    if step_reads is not None:
        from hetfl.algorithms.moon import Moon
        monkeypatch.setattr(Moon, "step_reads", step_reads)
    base = [*SMALL_CAPPED, "algorithm.name=moon", "train.rounds=4"]
    finals = {}
    for executor in ("vectorized", "sequential"):
        exp = Experiment(config.load(None, [*base, f"runtime.executor={executor}", "runtime.vmap_on_cpu=true"]))
        server, _, _ = exp.setup_round(exp.initial_server())
        clients: dict = {}
        for round_ in (1, 2, 3, 4):
            server = exp.round(server, clients, round_, Reporter())["_server"]
        finals[executor] = server.model
        if executor == "vectorized":
            assert (exp.vectorized_cache.ahead_tries, exp.vectorized_cache.ahead_hits) == (4, hits)
    for name, value in finals["sequential"].items():
        assert torch.allclose(finals["vectorized"][name], value, atol=1e-5), name


def test_a_compiled_call_used_again_is_kept_over_one_used_longer_ago():
    cache = VectorizedCache(max_calls=3)
    for key in ("a", "b", "c", "a", "d"):  # "a" used again before "d" arrives: "b" is the least recently used
        cache.programs.setdefault(key, None)  # type: ignore[arg-type]
        cache.used(key)
    assert list(cache.programs) == ["c", "a", "d"] and cache.dropped == 1


def test_the_run_keeps_at_most_max_calls_graphs_dropping_the_least_recently_used(monkeypatch):
    """A run of sampled clients meets new call shapes for many rounds, and each kept graph holds device
    memory: the cache keeps ``max_calls`` (here 3), drops the least recently used, captures a dropped
    shape again when it comes back, and the rounds still equal the sequential executor."""
    graphs: list[StandInGraph] = []

    def capture(self):
        graphs.append(StandInGraph(self, corrupt=False))
        self.graph = graphs[-1]

    cache = VectorizedCache(max_calls=3)
    order: list = []  # every use of a compiled call, in order
    real_used = cache.used
    monkeypatch.setattr(cache, "used", lambda key: (order.append(key), real_used(key))[1])
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedprox"]))
    for round_ in (1, 2):
        vec, notes, seq = graph_round(monkeypatch, capture, round_=round_, cache=cache, exp=exp)
        assert_same_clients(vec, seq)
        assert len(cache.programs) == 3
        # said once, when the first graph is dropped
        assert [n for n in notes if "more than 3 call shapes met" in n] == notes and len(notes) == (round_ == 1)
        last_three = list(dict.fromkeys(reversed(order)))[:3][::-1]
        assert list(cache.programs) == last_three  # the three most recently used, oldest first
    shapes = {g.compiled.inputs.shape() for g in graphs}
    assert cache.dropped == len(graphs) - 3 and len(graphs) > len(shapes)  # dropped shapes were captured again
    unbounded = VectorizedCache()
    graph_round(monkeypatch, capture, round_=1, cache=unbounded, exp=exp)
    assert unbounded.dropped == 0 and len(unbounded.programs) == len(shapes) > 3


def test_a_learning_rate_that_changes_every_round_reuses_the_graphs(monkeypatch):
    """Under the cosine schedule (FedUV's preset) every round trains at another learning rate: the
    update reads it from a device tensor, so round 2 replays round 1's graphs (a graph that baked the
    rate in would be captured again every round) and both rounds equal the sequential executor."""
    graphs: list[StandInGraph] = []

    def capture(self):
        graphs.append(StandInGraph(self, corrupt=False))
        self.graph = graphs[-1]

    cache = VectorizedCache()
    exp = Experiment(config.load(None, [*SMALL_CAPPED, "algorithm.name=fedprox", "train.lr_schedule=cosine",
                                        "train.rounds=4", "train.weight_decay=1e-3"]))
    vec, notes, seq = graph_round(monkeypatch, capture, round_=1, cache=cache, exp=exp)
    assert_same_clients(vec, seq)
    first = len(graphs)
    vec, notes, seq = graph_round(monkeypatch, capture, round_=2, cache=cache, exp=exp)
    assert_same_clients(vec, seq)
    assert len(graphs) == first and not notes
    assert all(g.replays >= 1 for g in graphs)


def test_running_out_of_memory_halves_the_chunk_and_gives_the_same_clients(monkeypatch):
    real_run = VectorizedGroup.run
    sizes: list[int] = []

    def run_fitting_four(self):
        sizes.append(len(self.plans))
        if len(self.plans) > 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_run(self)

    monkeypatch.setattr(VectorizedGroup, "run", run_fitting_four)
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedavg"]))
    server = exp.initial_server()
    notes: list[str] = []
    memo: dict = {}
    vec = train_clients_vectorized(exp.algorithm, round_contexts(exp, server, {}, 1), exp.data, seed=exp.cfg.seed,
                                   train_cfg=exp.cfg.train, log=notes.append, memo=memo)
    seq = [train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
           for ctx in round_contexts(exp, server, {}, 1)]
    assert_same_clients(vec, seq)
    assert sizes[:4] == [30, 15, 7, 3] and list(memo.values()) == [3]
    assert any("ran out of device memory" in n for n in notes)
    sizes.clear()  # the next round starts at the size that fitted
    train_clients_vectorized(exp.algorithm, round_contexts(exp, server, {}, 2), exp.data, seed=exp.cfg.seed,
                             train_cfg=exp.cfg.train, memo=memo)
    assert set(sizes) == {3}


@pytest.fixture
def group_sizes(monkeypatch) -> list[int]:
    """The number of clients of every vectorised group run (``VectorizedGroup.run``), in order."""
    real_run = VectorizedGroup.run
    sizes: list[int] = []

    def run(self):
        sizes.append(len(self.plans))
        return real_run(self)

    monkeypatch.setattr(VectorizedGroup, "run", run)
    return sizes


@pytest.mark.parametrize("free", [None, 10_000])
def test_a_group_first_met_with_few_clients_later_trains_as_many_as_fit_at_once(monkeypatch, free, group_sizes):
    """What the executor keeps for a group structure is how many clients fit at once, not how many the group
    held when first met. MOON's clients with a previous model are one in its second round and three in its
    third: they then trained one at a time for the rest of the run (and a resumed run, meeting them first as
    three, trained them together: another rounding). CPU (no limit known), and 7 that fit: 0.7 x 10,000 bytes
    free / 1,000 a client."""
    monkeypatch.setattr(vectorized, "free_memory_bytes", lambda device: free)
    monkeypatch.setattr(vectorized, "probe_client_bytes", lambda plan, data, **kw: 1_000)
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedavg"]))
    server, memo = exp.initial_server(), {}
    for round_, clients in ((1, 1), (2, 10)):
        train_clients_vectorized(exp.algorithm, round_contexts(exp, server, {}, round_)[:clients], exp.data,
                                 seed=exp.cfg.seed, train_cfg=exp.cfg.train, memo=memo)
    assert group_sizes == ([1, 10] if free is None else [1, 7, 3])


@pytest.mark.parametrize("method", ["moon", "fedpac", "pfedme"])
def test_a_sampled_rounds_first_timers_train_in_one_group_with_returning_clients(method, group_sizes):
    """A client's first round lacks what its later rounds carry: MOON's and pFedMe's kept state, FedPAC's
    personalised head in the payload. Their steps read neither (``Algorithm.step_reads``), so a sampled round's
    first-timers and returning clients train as one vmapped group (a GPU runs groups one after another), with
    the sequential clients' values. Round 2 of 6 of 30 clients a round: 1 returning client, 5 first-timers."""
    exp = Experiment(config.load(None, [*SMALL, f"algorithm.name={method}", "train.clients_per_round=6",
                                        "train.local_steps=4"]))
    returning = set(exp.sample_clients(1)) & set(exp.sample_clients(2))
    assert len(returning) == 1  # the case holds both kinds
    notes: list[str] = []
    compare_one_round(exp, rounds_before=1, notes=notes)
    assert group_sizes == [6] and not [n for n in notes if "client groups" in n], notes


def test_a_step_that_reads_what_its_algorithm_leaves_out_of_step_reads_is_refused_by_name(monkeypatch):
    """MOON's step reads the payload (the global model's features): declared away, the step's
    ``ctx.payload`` is not stacked, and reading it is an error that names the declaration, not a step on
    an empty dict; so is asking it whether it is empty."""
    with pytest.raises(StepReadError, match=r"a step used ctx\.payload\['.*'\] \(at .*moon\.py:\d+, in loss\), but its "
                                            r"algorithm's step_reads leaves 'payload' out: add it to the algorithm's "
                                            r"step_reads"):
        train_moon_with_nothing_declared_read(monkeypatch, SMALL)
    guard = NotReadBySteps("state")
    for use in (bool, len, list, lambda d: "x" in d, lambda d: d.get("x")):
        with pytest.raises(StepReadError, match="ctx.state"):
            use(guard)


def test_a_metric_that_is_a_trainable_tensor_is_logged_as_the_step_used_it():
    """FedETF logs its learnable temperature ``beta``, the tensor itself. ``vmap`` hands it back as a view of
    the group's buffer, which the step's update then writes in place: the vectorised clients logged the updated
    value (1e-2 from the sequential clients' sums over 4 steps). They now log what the step used."""
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedetf", "algorithm.pers_cycles=1",
                                        "algorithm.pers_epochs=1", "train.local_steps=4"]))
    server = exp.initial_server()
    seq = [train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
           for ctx in round_contexts(exp, server, {}, 1)[:4]]
    vec = train_clients_vectorized(exp.algorithm, round_contexts(exp, server, {}, 1)[:4], exp.data,
                                   seed=exp.cfg.seed, train_cfg=exp.cfg.train)
    for a, b in zip(seq, vec, strict=True):
        assert b.metric_sums["beta"] == pytest.approx(a.metric_sums["beta"], abs=1e-6)


def test_one_client_that_does_not_fit_is_an_error(monkeypatch):
    def never_fits(self):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(VectorizedGroup, "run", never_fits)
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedavg"]))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        train_clients_vectorized(exp.algorithm, round_contexts(exp, exp.initial_server(), {}, 1), exp.data,
                                 seed=exp.cfg.seed, train_cfg=exp.cfg.train)


def test_automatic_chunk_size_from_free_memory(monkeypatch):
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedavg"]))
    ctxs = round_contexts(exp, exp.initial_server(), {}, 1)
    plans = [vectorized.ClientPlan(c, exp.algorithm.stages(c), exp.algorithm.start_state(c)) for c in ctxs]
    settings = {"batch_size": 16, "drop_last": False, "max_grad_norm": 0.0, "buffers": ()}
    assert vectorized.clients_that_fit(plans[0], exp.data, seed=0, **settings) is None  # CPU: no limit
    monkeypatch.setattr(vectorized, "free_memory_bytes", lambda device: 10_000)
    monkeypatch.setattr(vectorized, "probe_client_bytes", lambda plan, data, **kw: 1_000)
    assert vectorized.clients_that_fit(plans[0], exp.data, seed=0, **settings) == 7  # 0.7 * 10,000 / 1,000 bytes


def test_cuda_graph_on_a_cpu_device_changes_nothing(tmp_path):
    import json

    base = [*SMALL, "train.rounds=1", "algorithm.name=fedavg", "runtime.device=cpu", "runtime.executor=vectorized",
            "runtime.vmap_on_cpu=true"]
    Experiment(config.load(None, [*base, "runtime.cuda_graph=false"])).run(tmp_path / "plain")
    exp = Experiment(config.load(None, [*base, "runtime.cuda_graph=true"]))
    exp.run(tmp_path / "graph")
    drop = ("round_time_s", "eval_time_s")
    lines = [{k: v for k, v in json.loads((tmp_path / d / "metrics.jsonl").read_text().splitlines()[0]).items()
              if k not in drop} for d in ("plain", "graph")]
    assert lines[0] == lines[1]


def test_the_memory_probe_measures_one_clients_step_without_touching_the_round(monkeypatch):
    """The probe's arithmetic on the CPU, with CUDA's memory counters standing in."""
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=scaffold"]))
    ctx = round_contexts(exp, exp.initial_server(), {}, 1)[0]
    ctx.extras = exp.algorithm.begin(ctx)
    plan = vectorized.ClientPlan(ctx, exp.algorithm.stages(ctx), exp.algorithm.start_state(ctx))
    start = {n: t.clone() for n, t in plan.start.items()}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1_000)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 5_000)
    settings = {"batch_size": 16, "drop_last": False, "max_grad_norm": 0.0, "buffers": ()}
    state_bytes = sum(t.nbytes for t in plan.start.values())
    assert vectorized.probe_client_bytes(plan, exp.data, seed=0, **settings) == 4_000 + state_bytes
    assert all(torch.equal(start[n], plan.start[n]) for n in start)


CUDA_METHODS = ["fedavg", "fedprox", "scaffold", "moon", "fedbr", "fedpac", "feduv", "fedrep"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("method", CUDA_METHODS)
def test_cuda_graph_steps_equal_sequential_on_cuda(method):
    """On a GPU: the captured steps give the sequential executor's clients, and capture works
    for the methods with extra models, adversaries and several stages."""
    steps = local_training(method)
    exp = Experiment(config.load(None, [*SMALL, f"algorithm.name={method}", "runtime.device=cuda", *steps]))
    notes: list[str] = []
    compare_one_round(exp, step_mode="graph", notes=notes)
    assert not [n for n in notes if "capture failed" in n or "disagrees" in n], notes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", available())
def test_every_method_vectorises_on_cuda_as_on_the_cpu(method):
    """No method falls back to sequential clients on a GPU (compare_one_round fails on a
    "falling back" note), and its vmapped clients equal its sequential ones there."""
    steps = local_training_on_cuda(method)
    exp = Experiment(config.load(None, [*SMALL, f"algorithm.name={method}", "runtime.device=cuda", *steps]))
    compare_one_round(exp, step_mode="eager")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["fedprox", "fedmix", "dann", "scaffold"])
def test_graphs_kept_across_rounds_give_the_sequential_run_on_cuda(tmp_path, method):
    """Three rounds with the graphs of round 1 replayed in rounds 2 and 3 (FedMix's loss reads the
    data shared once, DANN's the round): the metrics of the sequential executor on the same GPU."""
    import json

    base = [*SMALL, "train.rounds=3", f"algorithm.name={method}", "runtime.device=cuda"]
    lines = {}
    for name, keys in (("seq", ["runtime.executor=sequential"]),
                       ("graph", ["runtime.executor=vectorized", "runtime.cuda_graph=true"])):
        exp = Experiment(config.load(None, [*base, *keys]))
        exp.run(tmp_path / name)
        assert not [n for n in exp.__dict__.get("_notes", ()) if "falling back" in n or "disagrees" in n]
        lines[name] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(lines["seq"], lines["graph"], strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-3, abs=1e-4)
        assert b["global_acc"] == pytest.approx(a["global_acc"], abs=0.02)
