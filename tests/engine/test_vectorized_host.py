"""No host in the loop: the vectorised executor's steps only read device tensors.

A round's schedule (every client's batch indices, augmentation and per-step draws)
is drawn before the first step and moved to the device at once
(:mod:`hetfl.engine.step_plan`); a step then does no host synchronisation and no
copy from the host. Counted on the CPU with a dispatch mode that sees every ATen
op the steps run, and on CUDA with ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from hetfl import config
from hetfl.engine.experiment import Experiment
from hetfl.engine.step_plan import bucket_width, split_steps
from hetfl.engine.vectorized import ClientPlan, CompiledCall, VectorizedGroup, train_clients_vectorized
from tests.helpers import MNIST, needs_shared_data
from tests.helpers.executors import SYNTHETIC, compare_one_round, round_contexts
from tests.helpers.ops import OpCounter

# ops that wait for the device (a value read back to the host) or copy a host value to it
HOST_OPS = {"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.is_nonzero", "aten.equal",
            "aten.lift_fresh", "aten.lift_fresh_copy"}


def counted_round(monkeypatch, steps: int, method: str, step_mode: str) -> tuple[Counter[str], int, float]:
    """The ops that one round's steps ran (plan and results excluded), the steps taken, and the
    most ops a call ran per step."""
    counter = OpCounter()
    original = CompiledCall.run
    per_step: list[float] = []

    def run_counted(self, call):
        before = sum(counter.ops.values())
        with counter:
            out = original(self, call)
        per_step.append((sum(counter.ops.values()) - before) / call.steps)
        return out

    monkeypatch.setattr(CompiledCall, "run", run_counted)
    exp = Experiment(config.load(None, [*SYNTHETIC, f"algorithm.name={method}", f"train.local_steps={steps}",
                                        "runtime.device=cpu"]))
    ctxs = round_contexts(exp, exp.initial_server(), {}, 1)
    results = train_clients_vectorized(exp.algorithm, ctxs, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train,
                                       step_mode=step_mode)
    monkeypatch.setattr(CompiledCall, "run", original)
    return counter.ops, sum(r.steps for r in results), max(per_step)


@pytest.mark.parametrize("method", ["fedavg", "scaffold", "mixup"])
@pytest.mark.parametrize("step_mode", ["eager", "static"])
def test_steps_never_wait_for_or_copy_from_the_host(monkeypatch, method, step_mode):
    short, short_steps, per_step_short = counted_round(monkeypatch, 12, method, step_mode)
    long, long_steps, per_step_long = counted_round(monkeypatch, 48, method, step_mode)
    assert long_steps == 4 * short_steps
    assert not {op: n for op, n in (short + long).items() if op in HOST_OPS}
    # the work of a step does not grow with the steps: no call's steps cost more in the longer round
    assert per_step_long <= per_step_short


def test_the_old_per_step_host_path_is_what_the_counter_sees(monkeypatch):
    """The counter catches a host copy: a row index made from a Python list in a step, as the
    executor did before the round was planned."""
    counter = OpCounter()
    with counter:
        torch.tensor([0, 2, 3], device="cpu")
        torch.zeros(3).sum().item()
    assert {"aten.lift_fresh", "aten._local_scalar_dense"} <= set(counter.ops)


def test_block_widths_and_lengths_come_from_few_shapes():
    assert [bucket_width(w, 20) for w in (1, 4, 5, 6, 19, 20)] == [1, 4, 6, 6, 20, 20]
    assert all(bucket_width(w, 20) >= w and bucket_width(w, 20) - w < 3 for w in range(1, 21))
    assert split_steps(13, 16) == [8, 4, 1] and split_steps(40, 16) == [16, 16, 8] and split_steps(0) == []
    assert split_steps(13, 4) == [4, 4, 4, 1] and split_steps(7, 4) == [4, 2, 1]
    assert {len(split_steps(n, 16)) for n in range(1, 17)} <= {1, 2, 3, 4, 5}


@pytest.mark.parametrize("block_steps", [1, 3, 16])
def test_any_block_length_gives_the_sequential_clients(monkeypatch, block_steps):
    """Clients wait at a short batch until their block ends: any block length keeps each client's order."""
    from hetfl.engine import step_plan

    monkeypatch.setattr(step_plan, "BLOCK_STEPS", block_steps)
    exp = Experiment(config.load(None, [*SYNTHETIC, "algorithm.name=fedprox", "train.momentum=0.9",
                                        "runtime.device=cpu"]))
    compare_one_round(exp, step_mode="static")


def test_runtime_graph_steps_is_the_most_steps_of_a_call(monkeypatch, tmp_path):
    """``runtime.graph_steps`` reaches the plan: a run's calls hold at most that many steps (the graphs'
    length on CUDA), with the same numbers as another length; its default is the planner's."""
    from hetfl.engine import step_plan

    assert config.RuntimeConfig().graph_steps == step_plan.BLOCK_STEPS
    longest: dict[int, int] = {}
    original = VectorizedGroup.plan

    def plan(self, stages=None):
        made = original(self, stages)
        longest[self.block_steps] = max([longest.get(self.block_steps, 0),
                                         *(c.steps for p in made for c in p.calls)])
        return made

    monkeypatch.setattr(VectorizedGroup, "plan", plan)
    base = [*SYNTHETIC, "train.rounds=1", "train.clients_per_round=4", "runtime.executor=vectorized",
            "runtime.vmap_on_cpu=true", "runtime.device=cpu", "train.batch_size=4"]
    summaries = {steps: Experiment(config.load(None, [*base, f"runtime.graph_steps={steps}"])).run(
        tmp_path / str(steps)) for steps in (1, 4)}
    assert longest == {1: 1, 4: 4}
    assert summaries[1]["final_train_loss"] == summaries[4]["final_train_loss"]
    assert summaries[1]["final_global_acc"] == summaries[4]["final_global_acc"]


def test_runtime_graph_steps_below_one_is_refused_by_name():
    with pytest.raises(config.ConfigError, match=r"runtime\.graph_steps.*0"):
        config.load(None, ["runtime.graph_steps=0"])


def round_plan(epochs: int):
    """The calls of round 1 of SYNTHETIC (30 Dirichlet clients of very different sizes), fedavg."""
    exp = Experiment(config.load(None, [*SYNTHETIC, f"train.local_epochs={epochs}", "runtime.device=cpu"]))
    plans = [ClientPlan(c, exp.algorithm.stages(c), exp.algorithm.start_state(c))
             for c in round_contexts(exp, exp.initial_server(), {}, 1)]
    plans.sort(key=lambda p: -exp.data.client_sizes[p.ctx.client_id])  # as the executor orders a group
    group = VectorizedGroup(plans, exp.data, seed=0, batch_size=exp.cfg.train.batch_size, drop_last=False,
                            max_grad_norm=0.0, buffers=(), step_mode="static")
    stage_plan = group.plan()[0]
    return stage_plan.calls, stage_plan.steps


def real_entries(calls: list, k: int) -> int:
    """Client-steps the calls compute for real rows (a gathered call's padding points at the scratch row ``k``)."""
    return sum(c.steps * c.width if c.rows is None else int((c.rows < k).sum()) for c in calls)


def test_a_one_epoch_round_steps_ranges_of_rows_in_place_without_padding():
    """Clients largest first: the clients still training are consecutive rows from row 0, and a block is
    cut where one stops, so every block reads and writes its rows as views (no gather, no scatter) and
    computes no padding row. The short last batches, which clients reach at different rows, are single
    steps gathered by index (a view's place is part of its graph's shape: views at every row would be
    new graphs in every round of sampled clients)."""
    calls, steps = round_plan(epochs=1)
    k = len(steps)
    assert all(c.rows is None for c in calls if c.steps > 1 or c.size == 16)
    assert {c.start for c in calls if c.rows is None} == {0}
    gathered = [c for c in calls if c.rows is not None]
    assert gathered and all(c.steps == 1 and c.size < 16 for c in gathered)
    assert sum(c.steps * c.width for c in calls if c.rows is None) + real_entries(gathered, k) == sum(steps)


@pytest.mark.parametrize("epochs", [2, 3])
def test_rounds_of_several_epochs_keep_the_clients_in_step(epochs):
    """A block ends where a client reaches a short batch in the middle of its round, which it takes at
    once: so the clients still training stay consecutive rows from row 0 (no block gathers its rows) and
    no block computes a padding row."""
    calls, steps = round_plan(epochs=epochs)
    assert all(c.rows is None and c.start == 0 for c in calls if c.steps > 1 or c.size == 16)
    assert real_entries(calls, len(steps)) == sum(steps)


def sampled_round_shapes(rounds: int, clients: int = 1000, per_round: int = 100, batch_size: int = 50):
    """The call shapes of each round of a federation whose clients (sizes spread over two orders of
    magnitude, as under a Dirichlet split) are sampled ``per_round`` at a time, planned as the executor
    plans them (largest first)."""
    import numpy as np

    from hetfl.algorithms.base import Stage
    from hetfl.engine.step_plan import plan_round
    from hetfl.optim import SGDConfig

    rng = np.random.default_rng(0)
    sizes = (np.exp(rng.normal(3.5, 1.0, clients)) + 1).astype(int).tolist()
    stage = Stage("local", loss=None, trainable=(), sgd=SGDConfig(lr=0.1))
    out = []
    for _ in range(rounds):
        chosen = sorted(rng.choice(clients, per_round, replace=False).tolist(), key=lambda c: -sizes[c])
        gens = [torch.Generator().manual_seed(c) for c in chosen]
        plan = plan_round([stage], chosen, [sizes[c] for c in chosen], batch_size=batch_size, drop_last=False,
                          batch_gens=gens, augment_gens=gens, draw_gens=gens, stage_augment=lambda s, g: None,
                          global_indices=lambda c, idx: idx, device=torch.device("cpu"))
        out.append([c.shape() for c in plan[0].calls])
    return out


def test_sampled_rounds_soon_stop_meeting_new_call_shapes():
    """Each distinct call shape is a CUDA graph to capture and keep. Blocks start at row 0; a single step
    (a short batch) starting elsewhere is gathered with a rounded width, not viewed at its row, so its
    shape is (size, width bucket) and recurs: here rounds 51-100 meet 32 new shapes in 3,161 calls;
    with a view wherever rows were consecutive they met 983 (benchmarks/graph_shapes.py: over 300
    rounds the latter kept growing by about 5 a round)."""
    rounds = sampled_round_shapes(100)
    assert all(shape[4] in (None, 0) for shapes in rounds for shape in shapes if shape[1] == 1)
    seen = {shape for shapes in rounds[:50] for shape in shapes}
    new = {shape for shapes in rounds[50:] for shape in shapes} - seen
    assert len(new) < 100, len(new)


def prefix_step_ops(monkeypatch, hidden: str) -> Counter[str]:
    """The ops of one step of the round's first block in which every row trains (rows as views)."""
    counter, seen = OpCounter(), []
    original = VectorizedGroup.body

    def body_counted(self, stage, index, call):
        if seen or call.rows is not None or call.first or call.steps != 1:
            return original(self, stage, index, call)
        seen.append(call)
        with counter:
            return original(self, stage, index, call)

    monkeypatch.setattr(VectorizedGroup, "body", body_counted)
    exp = Experiment(config.load(None, [*SYNTHETIC, "algorithm.name=fedavg", "train.momentum=0.9",
                                        "train.weight_decay=1e-4", f"model.options={{hidden = {hidden}}}",
                                        "runtime.device=cpu"]))
    ctxs = round_contexts(exp, exp.initial_server(), {}, 1)
    train_clients_vectorized(exp.algorithm, ctxs, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train,
                             step_mode="static")
    monkeypatch.setattr(VectorizedGroup, "body", original)
    assert seen
    return counter.ops


def test_the_sgd_update_of_all_rows_is_a_few_multi_tensor_ops_in_place(monkeypatch):
    """The update (weight decay, momentum, step) of every row and every tensor is one multi-tensor op
    per line of the algorithm, written where the rows live: no op per parameter tensor, no copy of
    new parameters or momentum into the buffers. Four layers cost no more update ops than one."""
    small, deep = prefix_step_ops(monkeypatch, "[32]"), prefix_step_ops(monkeypatch, "[32, 32, 32, 32]")
    for ops in (small, deep):
        # weight decay, momentum (mul, add), the step (times the rate held in a tensor, subtracted)
        assert sum(n for op, n in ops.items() if op.startswith("aten._foreach_")) == 5
        assert ops["aten.copy_"] + ops["aten.index_copy_"] == 0
    update_ops = ("aten.mul", "aten.sub", "aten.add")  # a per-tensor update: one of each per tensor
    grown = {op: deep[op] - small[op] for op in update_ops}
    # the three extra layers add one of each to the forward pass (vmap's linear: bmm, then the bias as
    # mul and add); an update per tensor would add 6 tensors x (2 mul, add, sub)
    assert all(n <= 3 for n in grown.values()), grown


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("step_mode", ["eager", "graph"])
def test_cuda_steps_do_not_synchronise(monkeypatch, step_mode):
    """On a GPU: every step after a call shape's first (capture and its check may read back) runs
    under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising op."""
    original = CompiledCall.run

    def run_strict(self, call):
        if not self.eager and not self.built:
            return original(self, call)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return original(self, call)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(CompiledCall, "run", run_strict)
    exp = Experiment(config.load(None, [*SYNTHETIC, "algorithm.name=fedavg", "runtime.device=cuda"]))
    compare_one_round(exp, step_mode=step_mode)


class Clones(OpCounter):
    """Also each layout copy's (``aten.clone``: a batching rule's ``.contiguous()``) dtype, shape and bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.clones: list[tuple[torch.dtype, tuple[int, ...], int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if str(func.overloadpacket) == "aten.clone":
            self.clones.append((out.dtype, tuple(out.shape), out.nbytes))
        return out


@needs_shared_data
@pytest.mark.parametrize("conv", ["grouped", "per_client"])
@pytest.mark.parametrize("model", ["cnn2", "simple_cnn"])
def test_a_vmapped_step_of_a_pooling_cnn_copies_no_image_or_activation(monkeypatch, model, conv):
    """The batch is gathered in the layout a vmapped convolution reads (sample-major for a grouped
    convolution, client-major for per-client ones), and the pooling keeps the layout a convolution leaves
    (hetfl.models.layers.MaxPool2d): no step copies an image batch or a convolution's activation into
    another layout. The largest copy is the flattened features the first linear layer reads client-major (a
    vector per sample); per-client convolutions stack their outputs (a concatenation, not a layout copy)."""
    counter, per_sample = Clones(), []
    original = VectorizedGroup.body

    def body_counted(self, stage, index, call):
        if call.rows is not None:
            return original(self, stage, index, call)
        per_sample.append(call.steps * call.width * call.size)
        with counter:
            return original(self, stage, index, call)

    monkeypatch.setattr(VectorizedGroup, "body", body_counted)
    inputs = []
    gradients = VectorizedGroup.vmapped_gradients

    def recorded(self, stage, state, batch, *rest):
        inputs.append(batch.x)
        return gradients(self, stage, state, batch, *rest)

    monkeypatch.setattr(VectorizedGroup, "vmapped_gradients", recorded)
    exp = Experiment(config.load(None, [
        "data.dataset=mnist", f"data.root={MNIST}", "data.download=false", "data.partition=dominant",
        "data.samples_per_client=48", "data.num_clients=3", f"model.name={model}", "data.augment=crop_flip",
        "train.batch_size=16", "train.local_steps=3", "runtime.device=cpu", "runtime.progress=false"]))
    train_clients_vectorized(exp.algorithm, round_contexts(exp, exp.initial_server(), {}, 1), exp.data,
                             seed=exp.cfg.seed, train_cfg=exp.cfg.train, step_mode="static", conv_batching=conv)
    assert per_sample and counter.ops["aten.convolution"] > 0
    # the batch [clients, samples, C, H, W] lies sample-major in memory for a grouped convolution (with MNIST's
    # one channel a client-major batch would be read without a copy too; with three it would not), client-major
    # for per-client ones
    layout = (lambda x: x.transpose(0, 1).is_contiguous()) if conv == "grouped" else (lambda x: x.is_contiguous())
    assert all(layout(x) for x in inputs if x.shape[0] > 1) and len(inputs) > 1
    features = next(m for m in exp.algorithm.model.module.modules() if isinstance(m, torch.nn.Linear)).in_features
    largest = max((c[2] for c in counter.clones), default=0)
    assert largest <= 4 * features * 3 * 16, counter.clones  # a step: 3 clients x 16 samples


class FunctionsApplied:
    """Counts the ``torch.autograd.Function`` s applied inside (by class name)."""

    def __init__(self, monkeypatch) -> None:
        self.applied: Counter[str] = Counter()
        original = torch.autograd.Function.apply.__func__

        def counted(cls, *args, **kwargs):
            self.applied[cls.__name__] += 1
            return original(cls, *args, **kwargs)

        monkeypatch.setattr(torch.autograd.Function, "apply", classmethod(counted))


@needs_shared_data
@pytest.mark.parametrize(("model", "precision"), [("cnn2", "fp32"), ("simple_cnn", "fp32"), ("cnn2", "bf16")])
def test_an_eager_step_runs_no_autograd_function_and_the_static_steps_bits(monkeypatch, model, precision):
    """An eager step pays its host time every step (a GPU waits on it): its pooling is PyTorch's own rule,
    no autograd.Function (under vmap and grad functorch runs one through Python machinery at every call: in
    session 17 3.6x the Python calls of a step of simple_cnn). The static step, which a CUDA graph captures
    once and replays, keeps the layout rule (hetfl.models.layers.MaxPool2d: no copies). Both give the same
    parameters, bit for bit. In bf16 the same holds of the weights' bfloat16 copies (read through
    autograd.Functions, hetfl.models.low_precision): eager steps let autocast cast, static steps read them."""
    counter = FunctionsApplied(monkeypatch)
    exp = Experiment(config.load(None, [
        "data.dataset=mnist", f"data.root={MNIST}", "data.download=false", "data.partition=dominant",
        "data.samples_per_client=48", "data.num_clients=3", f"model.name={model}", "data.augment=crop_flip",
        "train.batch_size=16", "train.local_steps=3", "train.momentum=0.9", "runtime.device=cpu",
        "runtime.progress=false", f"train.precision={precision}"]))
    results = {}
    for mode in ("eager", "static"):
        counter.applied.clear()
        results[mode] = train_clients_vectorized(exp.algorithm, round_contexts(exp, exp.initial_server(), {}, 1),
                                                 exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train,
                                                 step_mode=mode)
        if mode == "eager":
            assert not counter.applied
        else:
            assert counter.applied["_MaxPool2d"] > 0 and counter.applied["_MaxPool2dBackward"] > 0
            assert (counter.applied["_CastDown"] > 0) == (precision == "bf16")
    for eager, static in zip(results["eager"], results["static"], strict=True):
        assert eager.steps == static.steps == 3
        for name, value in eager.state.items():
            assert torch.equal(value, static.state[name]), name
