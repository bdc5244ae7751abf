"""Vectorised client execution: a round's clients trained as one batched computation.

The clients' local states are stacked along a leading client axis and every
local step is ``torch.func.vmap`` of the very step the sequential executor runs
(:func:`hetfl.engine.local.sgd_step`, with ``torch.func.grad``), so each
algorithm's loss, gradient transform and adversary step run unchanged.

Exactness. Every client draws its batch order, augmentation and per-step
random numbers from its own generators, in the same order as in
:func:`hetfl.engine.local.run_stages`. Clients are not padded: at each step the
active clients are grouped by batch size (the short last batch of an epoch,
clients that have finished take no step), and each group is one vmapped call.
No loss needs masking, and a client's result equals the sequential one up to
floating-point reassociation in batched kernels.

Fallback. Clients whose stage structure or per-client tensor shapes differ are
run in separate groups; a group whose step cannot be vmapped (data-dependent
Python control flow, ``.item()``, random ops in the model such as dropout) is
run sequentially, and the reason is reported once through ``log``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.func import vmap

from hetfl.algorithms.base import Algorithm, Batch, ClientContext, Stage, Tensors
from hetfl.engine.data import FederatedData
from hetfl.engine.local import LocalResult, functional_grad, run_stages, sgd_step
from hetfl.engine.schedule import batch_schedule
from hetfl.optim import sgd_init
from hetfl.rng import torch_generator

Log = Callable[[str], None]


def callable_key(fn: Callable[..., Any] | None) -> Any:
    """A comparable identity of a loss/transform/draw function: bound methods by
    function and instance, closures by code and captured values."""
    if fn is None:
        return None
    if hasattr(fn, "__self__") and hasattr(fn, "__func__"):
        return ("method", fn.__func__, id(fn.__self__))
    code = getattr(fn, "__code__", None)
    if code is None:
        return ("object", id(fn))
    cells = tuple(
        c.cell_contents if isinstance(c.cell_contents, int | float | str | bool | tuple) else id(c.cell_contents)
        for c in (fn.__closure__ or ())
    )
    return ("function", code, cells)


def stage_key(stage: Stage | None) -> Any:
    if stage is None:
        return None
    return (stage.name, callable_key(stage.loss), stage.trainable, stage.sgd, stage.epochs, stage.steps,
            callable_key(stage.grad_transform), callable_key(stage.draws), stage_key(stage.adversary))


def tensors_key(tensors: Tensors) -> tuple[Any, ...]:
    return tuple((name, tuple(t.shape), t.dtype) for name, t in sorted(tensors.items()))


@dataclass
class ClientPlan:
    """One client's round, prepared: its context, stages and starting state."""

    ctx: ClientContext
    stages: list[Stage]
    start: Tensors

    def key(self) -> tuple[Any, ...]:
        ctx = self.ctx
        return (tuple(stage_key(s) for s in self.stages), tensors_key(self.start), tensors_key(ctx.payload),
                tensors_key(ctx.state), tensors_key(ctx.extras))


def stack_states(states: Sequence[Tensors]) -> Tensors:
    return {name: torch.stack([s[name] for s in states]) for name in states[0]}


def batch_dicts(dicts: Sequence[Tensors]) -> tuple[Tensors, dict[str, int | None]]:
    """Stack per-client tensors along a client axis; a tensor every client shares
    (the same object: the global model in a payload) stays unstacked (in_dim None)."""
    out: Tensors = {}
    dims: dict[str, int | None] = {}
    for name in dicts[0]:
        items = [d[name] for d in dicts]
        if all(t is items[0] for t in items):
            out[name], dims[name] = items[0], None
        else:
            out[name], dims[name] = torch.stack(items), 0
    return out, dims


def select(tensors: Tensors, dims: dict[str, int | None] | None, index: torch.Tensor | None) -> Tensors:
    """The rows ``index`` of the stacked entries (all of them when ``index`` is None)."""
    if index is None:
        return tensors
    return {n: t if dims is not None and dims[n] is None else t[index] for n, t in tensors.items()}


class VectorizedGroup:
    """Clients with one stage structure and tensor shapes, trained together.

    ``step_mode`` picks how the steady-state steps (every client of the group
    with a full batch, after a stage's first step) run:

    - ``"eager"``: each step is a vmapped call over the clients that take it;
    - ``"graph"`` (CUDA): the step over all the group's clients is captured once
      per stage as a CUDA graph and replayed, with static input buffers and a
      client mask (clients without a full batch in that step are computed and
      discarded). One replay launches the whole step; see :class:`StaticStep`;
    - ``"static"``: the same static-buffer, masked computation without a graph
      (the graph path's logic on any device; used by the tests on the CPU).

    Short batches and a stage's first step always run eagerly, so the result is
    the eager one in every mode.
    """

    def __init__(
        self, plans: list[ClientPlan], data: FederatedData, *, seed: int, batch_size: int, drop_last: bool,
        max_grad_norm: float, buffers: tuple[str, ...], precision: str = "fp32", step_mode: str = "eager",
        log: Log | None = None,
    ) -> None:
        if step_mode not in STEP_MODES:
            raise ValueError(f"step_mode = {step_mode!r}: must be one of {STEP_MODES}")
        if step_mode == "graph" and data.device.type != "cuda":
            raise ValueError(f"step_mode = 'graph' needs a CUDA device, not {data.device}")
        self.plans, self.data, self.buffers, self.precision = plans, data, buffers, precision
        self.batch_size, self.drop_last, self.max_grad_norm = batch_size, drop_last, max_grad_norm
        self.step_mode, self.log = step_mode, log
        ctxs = [p.ctx for p in plans]
        self.clients = [c.client_id for c in ctxs]
        rnd = ctxs[0].round
        self.batch_gens = [torch_generator(seed, "batches", rnd, c, 0) for c in self.clients]
        self.augment_gens = [torch_generator(seed, "augment", rnd, c, 0) for c in self.clients]
        self.draw_gens = [torch_generator(seed, "draws", rnd, c, 0) for c in self.clients]
        self.payload, self.payload_dims = batch_dicts([c.payload for c in ctxs])
        self.cstate, self.cstate_dims = batch_dicts([c.state for c in ctxs])
        self.extras, self.extras_dims = batch_dicts([c.extras for c in ctxs])
        # a template context: the per-client tensors are swapped in inside vmap
        self.template = replace(ctxs[0], client_id=-1, num_samples=0, features=None, inputs=None)

    def step(
        self, stage: Stage, state: Tensors, opt: Tensors, batch: Batch, index: torch.Tensor | None, first: bool
    ) -> tuple[Tensors, Tensors, torch.Tensor, Tensors]:
        """One vmapped ``sgd_step`` of ``stage`` for the clients at rows ``index``."""
        template, max_norm, buffers, precision = self.template, self.max_grad_norm, self.buffers, self.precision

        def one(state_c, opt_c, x, y, draws, payload, cstate, extras):  # type: ignore[no-untyped-def]
            ctx = replace(template, payload=payload, state=cstate, extras=extras)
            return sgd_step(stage, state_c, opt_c, Batch(x, y, draws), ctx, first, max_norm, grad_fn=functional_grad,
                            buffers=buffers, precision=precision)

        in_dims = (0, 0, 0, 0, 0, self.payload_dims, self.cstate_dims, self.extras_dims)
        return vmap(one, in_dims=in_dims, randomness="error")(
            state, opt, batch.x, batch.y, batch.draws,
            select(self.payload, self.payload_dims, index),
            select(self.cstate, self.cstate_dims, index),
            select(self.extras, self.extras_dims, index),
        )

    def stage_step(self, stage: Stage, state: Tensors, opt: Tensors, adv_opt: Tensors, batch: Batch,
                   index: torch.Tensor | None, first: bool) -> tuple[Tensors, Tensors, Tensors, torch.Tensor, Tensors]:
        """The adversary's step (if any) then the stage's step, for the rows ``index`` of
        ``state``: (new tensors, opt state, adversary opt state, loss, metrics)."""
        sub, changed, metrics, new_adv_opt = select(state, None, index), {}, {}, adv_opt
        if stage.adversary is not None:
            new, new_adv_opt, _, adv_metrics = self.step(stage.adversary, sub, adv_opt, batch, index, first)
            sub, changed = {**sub, **new}, new
            metrics = {f"{stage.adversary.name}/{key}": value for key, value in adv_metrics.items()}
        new, new_opt, loss, stage_metrics = self.step(stage, sub, opt, batch, index, first)
        return {**changed, **new}, new_opt, new_adv_opt, loss, {**metrics, **stage_metrics}

    def gather(self, rows: list[int], t: int, schedules: list[list[torch.Tensor]], stage: Stage) -> Batch:
        """Step ``t``'s batch of the clients at ``rows`` (equal batch sizes), shaped [rows, batch, ...]."""
        size = len(schedules[rows[0]][t])
        batch = self.data.clients_batch([self.clients[r] for r in rows], [schedules[r][t] for r in rows],
                                        [self.augment_gens[r] for r in rows])
        batch = Batch(batch.x.view(len(rows), size, *batch.x.shape[1:]), batch.y.view(len(rows), size))
        if stage.draws is not None:
            draws = [stage.draws(self.draw_gens[r], size) for r in rows]
            batch.draws = {n: torch.stack([d[n] for d in draws]).to(self.data.device) for n in draws[0]}
        return batch

    def run(self) -> list[LocalResult]:
        k = len(self.plans)
        device = self.data.device
        state = stack_states([{n: t.detach() for n, t in p.start.items()} for p in self.plans])
        state = {n: t.clone() for n, t in state.items()}
        steps = [0] * k
        sums: dict[str, torch.Tensor] = {"": torch.zeros(k, device=device)}  # "" = the loss
        for stage in self.plans[0].stages:
            schedules = [
                batch_schedule(self.data.client_sizes[c], self.batch_size, stage.epochs, stage.steps, self.drop_last,
                               gen)
                for c, gen in zip(self.clients, self.batch_gens, strict=True)
            ]
            opt = sgd_init({n: state[n] for n in stage.trainable}, stage.sgd)
            adversary = stage.adversary
            adv_opt = sgd_init({n: state[n] for n in adversary.trainable}, adversary.sgd) if adversary else {}
            static: StaticStep | None = None
            use_static = self.step_mode != "eager"  # until this stage's capture fails
            for t in range(max((len(s) for s in schedules), default=0)):
                by_size: dict[int, list[int]] = {}
                for row, schedule in enumerate(schedules):
                    if t < len(schedule):
                        by_size.setdefault(len(schedule[t]), []).append(row)
                for size, rows in by_size.items():
                    for r in rows:
                        steps[r] += 1
                    batch = self.gather(rows, t, schedules, stage)
                    if t > 0 and size == self.batch_size and use_static:
                        if static is None:
                            static = StaticStep.build(self, stage, state, opt, adv_opt, sums, batch, rows)
                        if static is not None:
                            static.run(batch, rows)
                            continue
                        use_static = False  # could not be captured (the reason is logged): eager steps
                    index = None if len(rows) == k else torch.tensor(rows, device=device)
                    new, sub_opt, sub_adv, loss, metrics = self.stage_step(
                        stage, state, select(opt, None, index), select(adv_opt, None, index), batch, index, t == 0)
                    # in place once a captured step reads these very tensors
                    rebind = static is None or static.graph is None
                    write_rows_(state, new, index, rebind)
                    write_rows_(opt, sub_opt, index, rebind)
                    write_rows_(adv_opt, sub_adv, index, rebind)
                    for key, value in {"": loss, **metrics}.items():
                        add_rows(sums, key, value, index, k)
        loss_sum = sums.pop("")
        return [
            LocalResult(
                state={n: t[row] for n, t in state.items()},
                steps=steps[row],
                loss_sum=float(loss_sum[row]),
                metric_sums={key: float(v[row]) for key, v in sums.items()},
            )
            for row in range(k)
        ]


STEP_MODES = ("eager", "static", "graph")


class StaticStep:
    """A stage's steady-state step over all clients of a group, on static buffers.

    Everything the step reads or writes lives in tensors allocated once: the
    stacked client state and optimiser state (updated in place), an input buffer
    ``[clients, batch, ...]`` and a client mask. A step copies the batch of the
    clients that take it into their rows, sets the mask, and calls ``body``: the
    vmapped step of every row, whose results are written back only where the
    mask is set (``torch.where``, so that whatever a masked row computes on stale
    inputs is discarded), loss and metrics added likewise.

    On CUDA ``body`` is captured once as a CUDA graph (after warm-up calls on a
    side stream with an empty mask, which change nothing) and each step is one
    ``replay``. The first replay is checked against an eager step from the same
    state; a capture that fails or disagrees is dropped with a logged reason and
    the stage goes on eagerly (from the state before that step).
    """

    WARMUP_CALLS = 2

    def __init__(self, group: VectorizedGroup, stage: Stage, state: Tensors, opt: Tensors, adv_opt: Tensors,
                 sums: dict[str, torch.Tensor], batch: Batch) -> None:
        k = len(group.plans)
        self.group, self.stage, self.state, self.opt, self.adv_opt, self.sums = group, stage, state, opt, adv_opt, sums
        device = group.data.device
        self.x = torch.zeros(k, *batch.x.shape[1:], dtype=batch.x.dtype, device=device)
        self.y = torch.zeros(k, *batch.y.shape[1:], dtype=batch.y.dtype, device=device)
        self.draws = None if batch.draws is None else {
            n: torch.zeros(k, *d.shape[1:], dtype=d.dtype, device=device) for n, d in batch.draws.items()}
        self.mask = torch.zeros(k, dtype=torch.bool, device=device)
        self.graph: Any = None
        self.checked = group.step_mode != "graph"

    @classmethod
    def build(cls, group: VectorizedGroup, stage: Stage, state: Tensors, opt: Tensors, adv_opt: Tensors,
              sums: dict[str, torch.Tensor], batch: Batch, rows: list[int]) -> StaticStep | None:
        """The static step of ``stage`` (captured on CUDA), or None with a logged reason."""
        static = cls(group, stage, state, opt, adv_opt, sums, batch)
        if group.step_mode != "graph":
            return static
        try:
            static.capture()
        except RuntimeError as err:  # an op that cannot be captured (a host sync, a CPU tensor...)
            if group.log is not None:
                group.log(f"vectorized: CUDA graph capture failed for stage {stage.name!r}, running it eagerly: "
                          f"{err}")
            return None
        return static

    def body(self) -> None:
        """The step of every row, written back where ``mask`` is set."""
        batch = Batch(self.x, self.y, self.draws)
        new, new_opt, new_adv, loss, metrics = self.group.stage_step(self.stage, self.state, self.opt, self.adv_opt,
                                                                     batch, None, False)
        for target, values in ((self.state, new), (self.opt, new_opt), (self.adv_opt, new_adv)):
            for name, value in values.items():
                mask = self.mask.view(-1, *[1] * (value.dim() - 1))
                target[name].copy_(torch.where(mask, value.to(target[name].dtype), target[name]))
        for key, value in {"": loss, **metrics}.items():
            if key not in self.sums:
                raise RuntimeError(f"metric {key!r} first appears in a steady-state step; it cannot be captured")
            self.sums[key].add_(torch.where(self.mask, value.float(), torch.zeros_like(self.sums[key])))

    def capture(self) -> None:
        """Warm up on a side stream (empty mask: no effect), then capture ``body`` as a CUDA graph."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP_CALLS):
                self.body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.body()
        self.graph = graph

    def run(self, batch: Batch, rows: list[int]) -> None:
        """One step for the clients at ``rows`` (full batches in ``batch``)."""
        k = len(self.mask)
        if len(rows) == k:
            self.x.copy_(batch.x)
            self.y.copy_(batch.y)
            if self.draws is not None:
                for name, value in (batch.draws or {}).items():
                    self.draws[name].copy_(value)
            self.mask.fill_(True)
        else:
            index = torch.tensor(rows, device=self.mask.device)
            self.x[index] = batch.x
            self.y[index] = batch.y
            if self.draws is not None:
                for name, value in (batch.draws or {}).items():
                    self.draws[name][index] = value
            self.mask.fill_(False)
            self.mask[index] = True
        if self.checked:
            self.graph.replay() if self.graph is not None else self.body()
            return
        self.check_first_replay()

    def check_first_replay(self) -> None:
        """Replay once and compare with an eager step from the same state; on disagreement
        restore that state, drop the graph and take the eager result."""
        buffers = (self.state, self.opt, self.adv_opt, self.sums)
        before = [{n: t.clone() for n, t in d.items()} for d in buffers]
        self.graph.replay()
        replayed = [{n: t.clone() for n, t in d.items()} for d in buffers]
        for d, saved in zip(buffers, before, strict=True):
            for name, t in d.items():
                t.copy_(saved[name])
        self.body()  # eager, the reference
        worst = max(((got[n].double() - t.double()).abs().max().item()
                     for d, got in zip(buffers[:3], replayed, strict=False) for n, t in d.items()), default=0.0)
        self.checked = True
        if worst <= GRAPH_CHECK_ATOL:
            return
        self.graph = None
        self.group.step_mode = "static"
        if self.group.log is not None:
            self.group.log(f"vectorized: the CUDA graph of stage {self.stage.name!r} disagrees with the eager step "
                           f"by {worst:.3g}; running eagerly")


# A replay runs the kernels of the eager step on the same inputs; anything but rounding
# (a stale buffer, a lost write) shows as a difference of the size of a step's update.
GRAPH_CHECK_ATOL = 1e-5


def write_rows_(full: Tensors, part: Tensors, index: torch.Tensor | None, rebind: bool = False) -> None:
    """Write ``part`` into the rows ``index`` of ``full``'s tensors, in place. All rows (index
    None) with ``rebind``: ``full``'s entries become ``part``'s tensors (no copy), for tensors
    no captured graph reads."""
    if index is None and rebind:
        full.update(part)
        return
    for name, value in part.items():
        if index is None:
            full[name].copy_(value)
        else:
            full[name][index] = value.to(full[name].dtype)


def add_rows(sums: dict[str, torch.Tensor], key: str, value: torch.Tensor, index: torch.Tensor | None, k: int) -> None:
    if key not in sums:
        sums[key] = torch.zeros(k, device=value.device)
    if index is None:
        sums[key] += value.float()
    else:
        sums[key].index_add_(0, index, value.float())


def free_memory_bytes(device: torch.device) -> int | None:
    """Bytes free for new tensors on ``device``: CUDA's free memory, or None (not known / CPU)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def probe_client_bytes(plan: ClientPlan, data: FederatedData, *, seed: int, **settings: Any) -> int:
    """Peak device memory of one client's eager step of its first stage (state, optimiser,
    activations, gradients): what each further client of a vmapped group adds. The probe
    has its own generators and changes nothing of the real round (CUDA only)."""
    group = VectorizedGroup([plan], data, seed=seed, **{**settings, "step_mode": "eager"})
    stage = plan.stages[0]
    state = {n: t.detach().clone().unsqueeze(0) for n, t in plan.start.items()}
    opt = sgd_init({n: state[n] for n in stage.trainable}, stage.sgd)
    adv_opt = sgd_init({n: state[n] for n in stage.adversary.trainable}, stage.adversary.sgd) if stage.adversary else {}
    schedule = batch_schedule(data.client_sizes[plan.ctx.client_id], group.batch_size, 1, 1, False,
                              group.batch_gens[0])
    device = data.device
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    batch = group.gather([0], 0, [schedule], stage)
    group.stage_step(stage, state, opt, adv_opt, batch, None, True)
    torch.cuda.synchronize(device)
    return max(1, torch.cuda.max_memory_allocated(device) - base + sum(t.nbytes for t in state.values()))


# share of the free memory a vmapped group may take (the rest: the allocator's slack, evaluation)
MEMORY_SHARE = 0.7


def auto_chunk_size(plans: list[ClientPlan], data: FederatedData, *, seed: int, **settings: Any) -> int:
    """Most clients of one group that fit in ``MEMORY_SHARE`` of the free device memory,
    from a one-client probe (all of them where free memory is not known: the CPU)."""
    free = free_memory_bytes(data.device)
    if free is None:
        return len(plans)
    per_client = probe_client_bytes(plans[0], data, seed=seed, **settings)
    return max(1, min(len(plans), int(free * MEMORY_SHARE) // per_client))


def train_clients_vectorized(
    algorithm: Algorithm,
    ctxs: list[ClientContext],
    data: FederatedData,
    *,
    seed: int,
    train_cfg: Any,
    chunk_size: int = 0,
    step_mode: str = "eager",
    log: Log | None = None,
    memo: dict[Any, int] | None = None,
) -> list[LocalResult]:
    """Local training of all ``ctxs`` (one round), vectorised; results in the order of ``ctxs``.

    ``chunk_size`` > 0 trains at most that many clients at once; 0 picks it from the
    free device memory (:func:`auto_chunk_size`), and a chunk that runs out of memory
    is retried in halves. Any chunking gives the same results. ``memo`` (kept by the
    caller across rounds) remembers the chunk size found for each group structure.
    ``step_mode``: see :class:`VectorizedGroup`.
    """
    plans = []
    for ctx in ctxs:
        ctx.extras = algorithm.begin(ctx)
        plans.append(ClientPlan(ctx, algorithm.stages(ctx), algorithm.start_state(ctx)))
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, plan in enumerate(plans):
        groups.setdefault(plan.key(), []).append(i)
    if len(groups) > 1 and log is not None:
        log(f"vectorized: {len(groups)} client groups with different stage structures or tensor shapes")
    results: list[LocalResult | None] = [None] * len(plans)
    settings = {"batch_size": train_cfg.batch_size, "drop_last": train_cfg.drop_last,
                "max_grad_norm": train_cfg.max_grad_norm, "buffers": algorithm.model.buffer_names,
                "precision": getattr(train_cfg, "precision", "fp32")}
    memo = {} if memo is None else memo
    for key, members in groups.items():
        if chunk_size:
            size = chunk_size
        elif key in memo:
            size = memo[key]
        else:
            size = memo[key] = auto_chunk_size([plans[i] for i in members], data, seed=seed, **settings)
            if size < len(members) and log is not None:
                log(f"vectorized: {size} of {len(members)} clients at once fit in the free device memory")
        start = 0
        while start < len(members):
            chunk = members[start : start + size]
            try:
                out = VectorizedGroup([plans[i] for i in chunk], data, seed=seed, step_mode=step_mode, log=log,
                                      **settings).run()
            except torch.cuda.OutOfMemoryError:
                if len(chunk) == 1:
                    raise
                size = memo[key] = max(1, len(chunk) // 2)
                torch.cuda.empty_cache()
                if log is not None:
                    log(f"vectorized: {len(chunk)} clients at once ran out of device memory; now {size} at once "
                        "(set runtime.chunk_size to choose)")
                continue
            except RuntimeError as err:  # an op without a batching rule, .item(), random ops...
                if log is not None:
                    log(f"vectorized: falling back to sequential clients for {algorithm.name}: {err}")
                out = [run_stages(plans[i].stages, plans[i].start, plans[i].ctx, data, seed=seed, **settings)
                       for i in chunk]
            for i, result in zip(chunk, out, strict=True):
                results[i] = result
            start += len(chunk)
    return results  # type: ignore[return-value]
