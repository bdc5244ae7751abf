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
from hetfl.engine.optim import sgd_init
from hetfl.engine.rng import torch_generator
from hetfl.engine.schedule import batch_schedule

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
    """Clients with one stage structure and tensor shapes, trained together."""

    def __init__(
        self, plans: list[ClientPlan], data: FederatedData, *, seed: int, batch_size: int, drop_last: bool,
        max_grad_norm: float, buffers: tuple[str, ...], precision: str = "fp32",
    ) -> None:
        self.plans, self.data, self.buffers, self.precision = plans, data, buffers, precision
        self.batch_size, self.drop_last, self.max_grad_norm = batch_size, drop_last, max_grad_norm
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

    def run(self) -> list[LocalResult]:
        k = len(self.plans)
        device = self.data.device
        state = stack_states([{n: t.detach() for n, t in p.start.items()} for p in self.plans])
        state = {n: t.clone() for n, t in state.items()}
        steps = [0] * k
        loss_sum = torch.zeros(k, device=device)
        metric_sums: dict[str, torch.Tensor] = {}
        for stage in self.plans[0].stages:
            schedules = [
                batch_schedule(self.data.client_sizes[c], self.batch_size, stage.epochs, stage.steps, self.drop_last,
                               gen)
                for c, gen in zip(self.clients, self.batch_gens, strict=True)
            ]
            opt = sgd_init({n: state[n] for n in stage.trainable}, stage.sgd)
            adversary = stage.adversary
            adv_opt = sgd_init({n: state[n] for n in adversary.trainable}, adversary.sgd) if adversary else {}
            for t in range(max((len(s) for s in schedules), default=0)):
                by_size: dict[int, list[int]] = {}
                for row, schedule in enumerate(schedules):
                    if t < len(schedule):
                        by_size.setdefault(len(schedule[t]), []).append(row)
                for size, rows in by_size.items():
                    index = None if len(rows) == k else torch.tensor(rows, device=device)
                    batch = self.data.clients_batch([self.clients[r] for r in rows], [schedules[r][t] for r in rows],
                                                    [self.augment_gens[r] for r in rows])
                    batch = Batch(batch.x.view(len(rows), size, *batch.x.shape[1:]), batch.y.view(len(rows), size))
                    if stage.draws is not None:
                        draws = [stage.draws(self.draw_gens[r], size) for r in rows]
                        batch.draws = {n: torch.stack([d[n] for d in draws]).to(device) for n in draws[0]}
                    sub = select(state, None, index)
                    if adversary is not None:
                        new, sub_adv, _, adv_metrics = self.step(adversary, sub, select(adv_opt, None, index), batch,
                                                                 index, t == 0)
                        sub = {**sub, **new}
                        adv_opt = write_rows(adv_opt, sub_adv, index)
                        for key, value in adv_metrics.items():
                            add_rows(metric_sums, f"{adversary.name}/{key}", value, index, k)
                    new, sub_opt, loss, metrics = self.step(stage, sub, select(opt, None, index), batch, index, t == 0)
                    sub = {**sub, **new}
                    state = write_rows(state, sub, index)
                    opt = write_rows(opt, sub_opt, index)
                    add_rows({"": loss_sum}, "", loss, index, k)
                    for key, value in metrics.items():
                        add_rows(metric_sums, key, value, index, k)
                    for r in rows:
                        steps[r] += 1
        return [
            LocalResult(
                state={n: t[row] for n, t in state.items()},
                steps=steps[row],
                loss_sum=float(loss_sum[row]),
                metric_sums={key: float(v[row]) for key, v in metric_sums.items()},
            )
            for row in range(k)
        ]


def write_rows(full: Tensors, part: Tensors, index: torch.Tensor | None) -> Tensors:
    """``full`` with rows ``index`` replaced by ``part`` (``part`` itself when index is None)."""
    if index is None:
        return {**full, **part}
    out = dict(full)
    for name, value in part.items():
        updated = full[name].clone()
        updated[index] = value
        out[name] = updated
    return out


def add_rows(sums: dict[str, torch.Tensor], key: str, value: torch.Tensor, index: torch.Tensor | None, k: int) -> None:
    if key not in sums:
        sums[key] = torch.zeros(k, device=value.device)
    if index is None:
        sums[key] += value.float()
    else:
        sums[key].index_add_(0, index, value.float())


def train_clients_vectorized(
    algorithm: Algorithm,
    ctxs: list[ClientContext],
    data: FederatedData,
    *,
    seed: int,
    train_cfg: Any,
    chunk_size: int = 0,
    log: Log | None = None,
) -> list[LocalResult]:
    """Local training of all ``ctxs`` (one round), vectorised; results in the order of ``ctxs``.

    ``chunk_size`` > 0 trains at most that many clients at once (memory); any
    chunking gives the same results.
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
    for members in groups.values():
        size = chunk_size or len(members)
        for start in range(0, len(members), size):
            chunk = members[start : start + size]
            try:
                out = VectorizedGroup([plans[i] for i in chunk], data, seed=seed, **settings).run()
            except RuntimeError as err:  # an op without a batching rule, .item(), random ops...
                if log is not None:
                    log(f"vectorized: falling back to sequential clients for {algorithm.name}: {err}")
                out = [run_stages(plans[i].stages, plans[i].start, plans[i].ctx, data, seed=seed, **settings)
                       for i in chunk]
            for i, result in zip(chunk, out, strict=True):
                results[i] = result
    return results  # type: ignore[return-value]
