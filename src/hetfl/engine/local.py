"""Local training of one client: the stages of an algorithm, step by step.

A step is the gradient of the stage's loss with respect to the stage's
trainable tensors, an optional gradient transform, and an SGD update. Written
over plain dicts of tensors so that the same step can be ``vmap``-ed across
clients by a vectorised executor. A client's own training (:func:`run_stages`)
applies the update in place (:func:`sgd_step_`) on the state it owns;
:func:`sgd_step` is the same step as a pure function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.func import grad

from hetfl.algorithms.base import (
    Algorithm,
    Batch,
    ClientContext,
    Stage,
    Tensors,
    check_loss_output,
    check_stage_start,
    checked_stage_output,
)
from hetfl.engine.schedule import batch_schedule
from hetfl.models.low_precision import bf16_copies, low_precision_weights, refresh_copies
from hetfl.optim import sgd_init, sgd_update, sgd_update_
from hetfl.rng import torch_generator

if TYPE_CHECKING:
    from hetfl.engine.data import FederatedData


@dataclass
class LocalResult:
    state: Tensors
    steps: int
    loss_sum: float
    metric_sums: dict[str, float]


def clip_grads(grads: Tensors, max_norm: float) -> Tensors:
    """Scale gradients so their global L2 norm is at most ``max_norm``."""
    norm = torch.sqrt(sum((g.float() ** 2).sum() for g in grads.values()))
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return {name: g * scale for name, g in grads.items()}


Objective = Callable[[Tensors], tuple[torch.Tensor, tuple[torch.Tensor, Tensors]]]
GradFn = Callable[[Objective, Tensors], tuple[Tensors, tuple[torch.Tensor, Tensors]]]


def autograd_grad(objective: Objective, trainable: Tensors) -> tuple[Tensors, tuple[torch.Tensor, Tensors]]:
    """Gradient of ``objective`` by reverse-mode autograd on detached leaf copies.

    Same value as ``torch.func.grad``; faster for a single client on the CPU
    (measured 1.5x on the 2-conv CNN), so the sequential executor uses it and
    the vectorised executor, which needs ``vmap``, uses :func:`functional_grad`.
    """
    leaves = {name: t.detach().requires_grad_() for name, t in trainable.items()}
    with torch.enable_grad():
        loss, aux = objective(leaves)
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return {
        name: torch.zeros_like(t) if g is None else g for (name, t), g in zip(leaves.items(), grads, strict=True)
    }, aux


def functional_grad(objective: Objective, trainable: Tensors) -> tuple[Tensors, tuple[torch.Tensor, Tensors]]:
    """Gradient of ``objective`` with ``torch.func.grad`` (composable with ``vmap``)."""
    return grad(objective, has_aux=True)(trainable)


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward pass's autocast context: none for ``fp32``, bfloat16 autocast for ``bf16``
    (matrix products and convolutions in bfloat16, reductions and losses in float32).

    The cache of casted weights is off: a captured CUDA graph must not reuse casts made
    before its capture, and each weight is cast once per step anyway."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=False)


def weights_read_low(state: Tensors, low: Tensors | None) -> contextlib.AbstractContextManager:
    """The model calls on ``state`` read ``low``'s bfloat16 copies of its weights (none without ``low``)."""
    if not low:
        return contextlib.nullcontext()
    return low_precision_weights({name: (state[name], copy) for name, copy in low.items()})


def step_gradients(
    stage: Stage,
    state: Tensors,
    batch: Batch,
    ctx: ClientContext,
    max_grad_norm: float = 0.0,
    grad_fn: GradFn = autograd_grad,
    buffers: tuple[str, ...] = (),
    precision: str = "fp32",
    low: Tensors | None = None,
) -> tuple[Tensors, Tensors, torch.Tensor, Tensors]:
    """The first half of a step of ``stage``: returns (gradients of its trainable tensors after its
    gradient transform and clipping, the model buffers the forward pass updated, loss, metrics).

    The buffers are the model's ``buffers`` that the stage does not train (BatchNorm running
    statistics), updated by the forward pass on copies made inside the differentiated function,
    so that ``torch.func`` transforms see no mutation of captured tensors. ``precision = "bf16"``
    runs the loss under bfloat16 autocast; the gradients stay float32. ``low``: bfloat16 copies of
    some of ``state``'s float32 weights (equal to them rounded), which the model's layers then read
    instead of casting the weights at each use (:mod:`hetfl.models.low_precision`: the same values,
    two multi-tensor casts a model call instead of two casts a weight).
    """
    trainable = {name: state[name] for name in stage.trainable}
    frozen = {name: t for name, t in state.items() if name not in trainable}
    mutable = tuple(name for name in buffers if name in frozen)

    def objective(train: Tensors) -> tuple[torch.Tensor, tuple[torch.Tensor, Tensors, Tensors]]:
        copies = {name: frozen[name].clone() for name in mutable}
        full = {**frozen, **copies, **train}
        with autocast(precision, batch.x.device), weights_read_low(full, low):
            loss, metrics = check_loss_output(stage, stage.loss(full, batch, ctx))
        loss = loss.float()
        return loss, (loss.detach(), {k: v.detach() for k, v in metrics.items()}, copies)

    grads, (loss, metrics, new_buffers) = grad_fn(objective, trainable)
    if stage.grad_transform is not None:
        grads = checked_stage_output(stage, "grad_transform", stage.grad_transform(grads, state, ctx))
    if max_grad_norm > 0:
        grads = clip_grads(grads, max_grad_norm)
    return grads, new_buffers, loss, metrics


def sgd_step(
    stage: Stage,
    state: Tensors,
    opt_state: Tensors,
    batch: Batch,
    ctx: ClientContext,
    first_step: bool,
    max_grad_norm: float = 0.0,
    grad_fn: GradFn = autograd_grad,
    buffers: tuple[str, ...] = (),
    precision: str = "fp32",
) -> tuple[Tensors, Tensors, torch.Tensor, Tensors]:
    """One optimisation step of ``stage``: :func:`step_gradients`, then the SGD update of the
    stage's trainable tensors; returns (new tensors: the trainable ones and the updated model
    buffers, opt_state, loss, metrics)."""
    grads, new_buffers, loss, metrics = step_gradients(stage, state, batch, ctx, max_grad_norm, grad_fn, buffers,
                                                       precision)
    trainable = {name: state[name] for name in stage.trainable}
    new_trainable, opt_state = sgd_update(trainable, grads, opt_state, stage.sgd, first_step)
    return {**new_buffers, **new_trainable}, opt_state, loss, metrics


def unaliased(metrics: Tensors, written: Sequence[torch.Tensor]) -> Tensors:
    """``metrics`` with a copy of each that shares memory with the tensors a step's update is about to
    write in place (a loss may log a trainable tensor itself: FedETF's ``beta``; ``torch.autograd`` and
    ``vmap`` hand it back as a view of the trained tensor), so that a metric is the value the step used,
    not the updated one. Copies only where memory is shared: no kernel otherwise."""
    storages = {t.untyped_storage().data_ptr() for t in written}
    return {key: value.clone() if value.untyped_storage().data_ptr() in storages else value
            for key, value in metrics.items()}


def sgd_step_(
    stage: Stage,
    state: Tensors,
    opt_state: Tensors,
    batch: Batch,
    ctx: ClientContext,
    first_step: bool,
    max_grad_norm: float = 0.0,
    buffers: tuple[str, ...] = (),
    precision: str = "fp32",
    low: Tensors | None = None,
) -> tuple[torch.Tensor, Tensors]:
    """:func:`sgd_step` in place: the stage's trainable tensors of ``state`` and its momentum buffers
    ``opt_state`` are updated where they are (:func:`hetfl.optim.sgd_update_`, the same arithmetic to the
    bit), and the updated model buffers are put in ``state``; returns (loss, metrics). ``low``: the
    bfloat16 copies of ``state``'s weights that the step reads (:func:`step_gradients`), refreshed after
    the update in one multi-tensor copy.

    For a state the caller owns (:func:`run_stages` trains a copy of its start): no new parameter
    tensors a step. On one CPU thread a round of the 2-conv CNN at batch 10 took 1.08x as long with
    the functional update (``benchmarks/results/sequential_update_cpu.md``)."""
    grads, new_buffers, loss, metrics = step_gradients(stage, state, batch, ctx, max_grad_norm, autograd_grad,
                                                       buffers, precision, low)
    names = list(stage.trainable)
    params = [state[n] for n in names]
    metrics = unaliased(metrics, params)
    sgd_update_(params, [grads[n] for n in names], [opt_state[n] for n in names] if opt_state else [], stage.sgd,
                first_step)
    if low:
        refresh_copies(low, state, names)
    state.update(new_buffers)
    return loss, metrics


def low_copies(state: Tensors, names: Sequence[str], precision: str) -> Tensors | None:
    """bfloat16 copies of ``state``'s float32 weights named in ``names``, which a ``bf16`` step reads
    (:mod:`hetfl.models.low_precision`); None in ``fp32``."""
    names = [n for n in names if n in state and state[n].dtype == torch.float32]
    if precision != "bf16" or not names:
        return None
    return dict(zip(names, bf16_copies([state[n] for n in names]), strict=True))


def run_stages(
    stages: list[Stage],
    start: Tensors,
    ctx: ClientContext,
    data: FederatedData,
    *,
    seed: int,
    batch_size: int,
    drop_last: bool,
    max_grad_norm: float = 0.0,
    stream: int = 0,
    buffers: tuple[str, ...] = (),
    precision: str = "fp32",
    low_names: tuple[str, ...] = (),
) -> LocalResult:
    """Run ``stages`` on client ``ctx.client_id``'s data, starting from ``start``.

    Batch order and augmentation come from generators derived from
    ``(seed, round, client, stream)`` (stream 0: training, 1: fine-tuning at
    evaluation), so a client's result does not depend on what ran before it.
    In ``bf16`` the steps read bfloat16 copies of the weights named in ``low_names``
    (:func:`step_gradients`), made here and refreshed after each update: derived state, never returned.
    """
    check_stage_start(stages, start)
    client = ctx.client_id
    batch_gen = torch_generator(seed, "batches", ctx.round, client, stream)
    augment_gen = torch_generator(seed, "augment", ctx.round, client, stream)
    state = {name: t.detach().clone() for name, t in start.items()}
    low = low_copies(state, low_names, precision)
    n_samples = data.client_sizes[client]
    steps, loss_sum = 0, torch.zeros((), device=data.device)
    metric_sums: dict[str, torch.Tensor] = {}
    draw_gen = torch_generator(seed, "draws", ctx.round, client, stream)
    for stage in stages:
        schedule = batch_schedule(n_samples, batch_size, stage.epochs, stage.steps, drop_last, batch_gen)
        opt_state = sgd_init({n: state[n] for n in stage.trainable}, stage.sgd)
        adversary = stage.adversary
        adv_state = sgd_init({n: state[n] for n in adversary.trainable}, adversary.sgd) if adversary else {}
        for i, batch in enumerate(data.train_batches(client, schedule, augment_gen)):
            if stage.draws is not None:
                drawn = checked_stage_output(stage, "draws", stage.draws(draw_gen, len(batch.y)))
                batch.draws = {k: v.to(data.device) for k, v in drawn.items()}
            if adversary is not None:
                _, adv_metrics = sgd_step_(adversary, state, adv_state, batch, ctx, first_step=(i == 0),
                                           max_grad_norm=max_grad_norm, buffers=buffers, precision=precision,
                                           low=low)
                for key, value in adv_metrics.items():
                    key = f"{adversary.name}/{key}"
                    metric_sums[key] = metric_sums.get(key, 0.0) + value.float()
            loss, metrics = sgd_step_(stage, state, opt_state, batch, ctx, first_step=(i == 0),
                                      max_grad_norm=max_grad_norm, buffers=buffers, precision=precision,
                                      low=low)
            steps += 1
            loss_sum += loss
            for key, value in metrics.items():
                metric_sums[key] = metric_sums.get(key, 0.0) + value.float()
    return LocalResult(
        state=state,
        steps=steps,
        loss_sum=float(loss_sum),
        metric_sums={k: float(v) for k, v in metric_sums.items()},
    )


def train_client(
    algorithm: Algorithm, ctx: ClientContext, data: FederatedData, *, seed: int, train_cfg: object
) -> LocalResult:
    """A client's whole local round: ``begin``, the algorithm's stages, from ``start_state``."""
    ctx.extras = algorithm.begin(ctx)
    return run_stages(
        algorithm.stages(ctx),
        algorithm.start_state(ctx),
        ctx,
        data,
        seed=seed,
        batch_size=train_cfg.batch_size,  # type: ignore[attr-defined]
        drop_last=train_cfg.drop_last,  # type: ignore[attr-defined]
        max_grad_norm=train_cfg.max_grad_norm,  # type: ignore[attr-defined]
        buffers=algorithm.running_buffers(),
        precision=getattr(train_cfg, "precision", "fp32"),
        low_names=algorithm.model.low_precision_names,
    )
