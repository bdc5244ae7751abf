"""Vectorised client execution: a round's clients trained as one batched computation.

The clients' local states are stacked along a leading client axis and every
local step is ``torch.func.vmap`` of the gradient half of the very step the
sequential executor runs (:func:`hetfl.engine.local.step_gradients`, with
``torch.func.grad``), so each algorithm's loss, gradient transform and adversary
step run unchanged (a step of a single client of the group runs that step itself,
unbatched: :meth:`VectorizedGroup.single_client_gradients`); the SGD update then
runs once for all rows, in place in the stacked buffers, with multi-tensor
kernels (:func:`hetfl.optim.sgd_update_`, the same arithmetic as the sequential
:func:`hetfl.optim.sgd_update`).

Exactness. Every client draws its batch order, augmentation and per-step
random numbers from its own generators, in the same order as in
:func:`hetfl.engine.local.run_stages`, before the round's first step
(:mod:`hetfl.engine.step_plan`: the plan goes to the device in one copy, and a
step never waits for the host; with the graphs' cache the next round's plan is
drawn while the device runs this round's calls, :meth:`VectorizedGroup.plan_ahead`).
A step of some rows computes only those rows (a range of rows sliced as views, or
rows gathered and scattered back; padding
entries compute on a scratch row whose results are never read), so no batch is
padded and no loss needs masking: a client's result equals the sequential one
up to floating-point reassociation in batched kernels.

Speed on CUDA. Each call shape of the plan (a block of up to ``runtime.graph_steps``
steps, a first step, a short last batch) is captured once as a CUDA graph and replayed, in
later rounds too (:class:`CompiledCall`; :class:`VectorizedCache` keeps the
``MAX_KEPT_CALLS`` most recently used). With ``runtime.compile`` each step's gradients
are compiled by ``torch.compile`` first (:mod:`hetfl.engine.compiled_step`: fewer, fused
kernels per step).

Fallback. Clients whose stage structure or per-client tensor shapes differ are
run in separate groups (of the context's dicts, only those the steps read count:
``Algorithm.step_reads``, so a sampled round's first-timers join the returning
clients wherever the method allows); a group whose step cannot be vmapped (data-dependent
Python control flow, ``.item()``, random ops in the model such as dropout) is
run sequentially, and the reason is reported once through ``log``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from hetfl.algorithms.base import Algorithm, Batch, ClientContext, MethodError, Stage, Tensors, check_stage_start
from hetfl.engine import step_plan
from hetfl.engine.compiled_step import (
    PER_CLIENT_VALUES,
    PerClientValueRead,
    StepContext,
    run_compiled,
    vmapped_step,
)
from hetfl.engine.data import FederatedData
from hetfl.engine.local import LocalResult, run_stages, step_gradients, unaliased
from hetfl.engine.step_plan import Call, StagePlan, plan_round
from hetfl.models.layers import CONV_BATCHING, client_batching
from hetfl.models.low_precision import bf16_copies, refresh_copies
from hetfl.optim import sgd_init, sgd_update_
from hetfl.rng import torch_generator

Log = Callable[[str], None]


# torch's code, the engine's and the model caller's (hetfl.algorithms.base): not where a method reads or calls
_NOT_THE_METHODS = (str(Path(torch.__file__).parent), str(Path(__file__).parent),
                    str(Path(__file__).parents[1] / "algorithms" / "base.py"))


def where_in_method(err: BaseException) -> str:
    """`` (at FILE:LINE, in FUNCTION)``: the innermost line of ``err``'s traceback in a method's code, not in torch's
    or the engine's (the loss line that called ``.item()``), so that a fallback's message says where; '' if none."""
    return _in_method(traceback.extract_tb(err.__traceback__))


def _in_method(frames: traceback.StackSummary) -> str:
    """`` (at FILE:LINE, in FUNCTION)`` of the innermost of ``frames`` in a method's code; '' if none is."""
    mine = [f for f in frames if not f.filename.startswith(_NOT_THE_METHODS)]
    return f" (at {mine[-1].filename}:{mine[-1].lineno}, in {mine[-1].name})" if mine else ""


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
    """What a stage's compiled steps depend on. Not its learning rate: the update reads that from a
    tensor (:attr:`GroupBuffers.lr`), so a schedule that changes it every round keeps the graphs."""
    if stage is None:
        return None
    return (stage.name, callable_key(stage.loss), stage.trainable, replace(stage.sgd, lr=0.0), stage.epochs,
            stage.steps, callable_key(stage.grad_transform), callable_key(stage.draws), stage_key(stage.adversary))


def tensors_key(tensors: Tensors) -> tuple[Any, ...]:
    return tuple((name, tuple(t.shape), t.dtype) for name, t in sorted(tensors.items()))


STEP_DICTS = ("payload", "state")  # the context's per-client dicts an algorithm's steps may read


@dataclass
class ClientPlan:
    """One client's round, prepared: its context, stages and starting state. ``unread`` names the
    context's per-client dicts (:data:`STEP_DICTS`) that the stages do not read
    (``Algorithm.step_reads``); ``seen`` is the context as the steps see it, those dicts empty, so
    that they neither split the round's clients into groups nor are stacked."""

    ctx: ClientContext
    stages: list[Stage]
    start: Tensors
    unread: frozenset[str] = frozenset()
    seen: ClientContext = field(init=False)

    def __post_init__(self) -> None:
        self.seen = replace(self.ctx, **{name: {} for name in self.unread}) if self.unread else self.ctx

    @classmethod
    def of(cls, algorithm: Algorithm, ctx: ClientContext) -> ClientPlan:
        """``ctx``'s round under ``algorithm``: its extras (``begin``, set on ``ctx``), stages and start."""
        ctx.extras = algorithm.begin(ctx)
        unread = frozenset(STEP_DICTS) - algorithm.step_reads
        stages, start = algorithm.stages(ctx), algorithm.start_state(ctx)
        check_stage_start(stages, start)
        return cls(ctx, stages, start, unread)

    def key(self) -> tuple[Any, ...]:
        ctx = self.seen
        return (tuple(stage_key(s) for s in self.stages), tensors_key(self.start), tensors_key(ctx.payload),
                tensors_key(ctx.state), tensors_key(ctx.extras))


def client_axes(dicts: Sequence[Tensors]) -> dict[str, int | None]:
    """For each tensor name of the clients' dicts: 0 where the clients hold their own tensors (stacked
    along a client axis), None where every client holds the same object (the global model in a payload:
    kept once, unbatched under ``vmap``)."""
    return {name: None if all(d[name] is dicts[0][name] for d in dicts) else 0 for name in dicts[0]}


class TemplateContext(ClientContext):
    """The context a vmapped step sees: one client's, with the per-client tensors swapped in
    inside ``vmap``. It records which of the round's plain values (``round``, ``lr``...) the
    step reads, so that a compiled step (a CUDA graph, in which such a value is a constant) is
    reused in a later round only where those values are the same. The values that differ between the
    group's clients (``client_id``, ``num_samples``, ``features``, ``inputs``) a step cannot read:
    :class:`~hetfl.engine.compiled_step.PerClientValueRead`, and the group runs one client at a time."""

    SCALARS = ("round", "lr")

    def __getattribute__(self, name: str) -> Any:
        if name in PER_CLIENT_VALUES:
            raise PerClientValueRead(name)
        if name in TemplateContext.SCALARS:
            object.__getattribute__(self, "reads").add(name)
        return object.__getattribute__(self, name)

    @classmethod
    def of(cls, ctx: ClientContext, unread: frozenset[str] = frozenset()) -> TemplateContext:
        """The template of ``ctx``'s group; the dicts named in ``unread`` (``ClientPlan.unread``) are
        :class:`NotReadBySteps` in every step's context."""
        template = cls.__new__(cls)
        template.__dict__.update(ctx.__dict__)
        template.__dict__.update(client_id=-1, num_samples=0, features=None, inputs=None, reads=set(),
                                 unread={name: NotReadBySteps(name) for name in unread})
        return template

    def scalars(self, names: set[str]) -> tuple[Any, ...]:
        return tuple((n, object.__getattribute__(self, n)) for n in sorted(names))

    def with_tensors(self, payload: Tensors, state: Tensors, extras: Tensors) -> TemplateContext:
        ctx = copy.copy(self)
        ctx.__dict__.update(payload=payload, state=state, extras=extras)
        ctx.__dict__.update(object.__getattribute__(self, "unread"))
        return ctx


class StepReadError(MethodError, LookupError):
    """A step read a context dict that its algorithm's ``step_reads`` leaves out: the method's declaration is
    wrong (a :class:`MethodError`: ``hetfl`` exits 2 with the message, naming the step's line)."""


class NotReadBySteps(Mapping[str, torch.Tensor]):
    """A step's ``ctx.payload`` or ``ctx.state`` where the algorithm declares that its steps do not read it
    (``Algorithm.step_reads``): the vectorised executor did not stack it, so any use (an entry, its
    length, its truth value, iterating it) raises :class:`StepReadError` naming the declaration, rather
    than the step computing with an empty dict."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _refuse(self, use: str) -> StepReadError:
        where = _in_method(traceback.extract_stack())
        return StepReadError(f"a step used ctx.{self.name}{use}{where}, but its algorithm's step_reads leaves "
                             f"{self.name!r} out: add it to the algorithm's step_reads")

    def __getitem__(self, key: str) -> torch.Tensor:
        raise self._refuse(f"[{key!r}]")

    def __iter__(self) -> Iterator[str]:
        raise self._refuse(" (iterated)")

    def __len__(self) -> int:
        raise self._refuse(" (its length or truth value)")


class GroupBuffers:
    """The stacked tensors a group's steps read and write in place: the clients' states,
    payloads, persistent states and extras (a row per client, plus the scratch row ``k`` that
    padding entries of a call point at), each stage's optimiser states and the per-row sums of
    loss and metrics. Kept across rounds (for the compiled steps that read them) and loaded
    with a round's values by :meth:`load`. ``low``: bfloat16 copies of the states' weights named in
    ``low_names`` (a bf16 step reads them: :mod:`hetfl.models.low_precision`), kept equal to them rounded
    (refreshed after each update); derived, never a result."""

    def __init__(self, plans: list[ClientPlan], device: torch.device, low_names: tuple[str, ...] = ()) -> None:
        self.k, self.device = len(plans), device
        ctxs = [p.seen for p in plans]
        self.state = self._rows([p.start for p in plans])
        names = [n for n in low_names if n in self.state and self.state[n].dtype == torch.float32]
        self.low = dict(zip(names, bf16_copies([self.state[n] for n in names]), strict=True))
        self.payload, self.payload_dims = self._shared_or_rows([c.payload for c in ctxs])
        self.cstate, self.cstate_dims = self._shared_or_rows([c.state for c in ctxs])
        self.extras, self.extras_dims = self._shared_or_rows([c.extras for c in ctxs])
        # data every client received once (ctx.shared, FedMix's means): one copy the steps read
        self.shared = {n: t.detach().clone().to(device) for n, t in ctxs[0].shared.items()}
        stages = plans[0].stages
        self.opt = [sgd_init({n: self.state[n] for n in s.trainable}, s.sgd) for s in stages]
        self.adv_opt = [sgd_init({n: self.state[n] for n in s.adversary.trainable}, s.adversary.sgd)
                        if s.adversary else {} for s in stages]
        # each stage's (and its adversary's) learning rate this round, read by the update on the device
        self.lr = [torch.zeros((), device=device) for _ in stages]
        self.adv_lr = [torch.zeros((), device=device) for _ in stages]
        self.load_rates(stages)
        self.sums: dict[str, torch.Tensor] = {"": torch.zeros(self.k + 1, device=device)}  # "" = the loss

    def _rows(self, dicts: Sequence[Tensors]) -> Tensors:
        """Per-client tensors stacked on the training device (a method's scalar made on the CPU too:
        a step indexes these with device rows), the first client's repeated as the scratch row."""
        return {n: torch.stack([*(d[n].detach() for d in dicts), dicts[0][n].detach()]).to(self.device)
                for n in dicts[0]}

    def _shared_or_rows(self, dicts: Sequence[Tensors]) -> tuple[Tensors, dict[str, int | None]]:
        """Per-client tensors stacked with the scratch row (:meth:`_rows`); a tensor every client shares
        (:func:`client_axes`) is kept once, a copy of its own on the training device too."""
        dims = client_axes(dicts)
        rows = self._rows([{n: d[n] for n in dicts[0] if dims[n] == 0} for d in dicts])
        return {n: dicts[0][n].detach().clone().to(self.device) if dims[n] is None else rows[n]
                for n in dims}, dims

    def fits(self, plans: list[ClientPlan]) -> bool:
        """Whether ``plans`` share these buffers' layout (the same structure is checked by the caller)."""
        return len(plans) == self.k and client_axes([p.seen.payload for p in plans]) == self.payload_dims \
            and tensors_key(plans[0].seen.shared) == tensors_key(self.shared) \
            and client_axes([p.seen.state for p in plans]) == self.cstate_dims \
            and client_axes([p.seen.extras for p in plans]) == self.extras_dims

    def load(self, plans: list[ClientPlan]) -> None:
        """This round's start states, payloads, client states and extras, in place; sums and
        optimiser states zeroed."""
        every_row = dict.fromkeys(self.state, 0)
        for target, dims, dicts in ((self.state, every_row, [p.start for p in plans]),
                                    (self.payload, self.payload_dims, [p.seen.payload for p in plans]),
                                    (self.cstate, self.cstate_dims, [p.seen.state for p in plans]),
                                    (self.extras, self.extras_dims, [p.seen.extras for p in plans])):
            for name, buffer in target.items():
                if dims[name] is None:
                    buffer.copy_(dicts[0][name])
                else:
                    buffer.copy_(torch.stack([*(d[name] for d in dicts), dicts[0][name]]))
        refresh_copies(self.low, self.state, list(self.low))
        for name, buffer in self.shared.items():
            buffer.copy_(plans[0].seen.shared[name])
        for d in (*self.opt, *self.adv_opt):
            for t in d.values():
                t.zero_()
        for t in self.sums.values():
            t.zero_()
        self.load_rates(plans[0].stages)

    def load_rates(self, stages: list[Stage]) -> None:
        for stage, lr, adv_lr in zip(stages, self.lr, self.adv_lr, strict=True):
            lr.fill_(stage.sgd.lr)
            if stage.adversary is not None:
                adv_lr.fill_(stage.adversary.sgd.lr)

    def tensors(self, stage_index: int) -> list[Tensors]:
        """What a stage's steps write: the states, its optimiser states, the sums and the states' bfloat16
        copies."""
        return [self.state, self.opt[stage_index], self.adv_opt[stage_index], self.sums, self.low]


def channels_last_for_vmap(x: torch.Tensor) -> torch.Tensor:
    """Images ``[clients, batch, C, H, W]`` stored so that a vmapped convolution sees them in the
    channels-last layout cuDNN prefers (its tensor-core kernels work in NHWC; an NCHW input is
    converted there and back at every convolution).

    ``vmap`` runs a convolution of per-client weights as one grouped convolution, with the
    clients folded into the channels: ``[batch, clients * C, H, W]``. That view is channels-last
    when memory holds ``[batch, H, W, clients, C]``: this function copies ``x`` into that order
    and returns the same logical tensor (equal values; only the strides differ)."""
    return x.permute(1, 3, 4, 0, 2).contiguous().permute(3, 0, 4, 1, 2)


def client_channels_last(x: torch.Tensor) -> torch.Tensor:
    """Images ``[clients, batch, C, H, W]`` with each client's ``[batch, C, H, W]`` stored channels-last
    (what per-client convolutions read in cuDNN's preferred layout); the same logical tensor."""
    return x.permute(0, 1, 3, 4, 2).contiguous().permute(0, 1, 4, 2, 3)


class VectorizedGroup:
    """Clients with one stage structure and tensor shapes, trained together.

    The round is planned first (:func:`hetfl.engine.step_plan.plan_round`: every
    client's batches and random draws, moved to the device in one copy); each
    :class:`~hetfl.engine.step_plan.Call` of the plan then runs as a :class:`CompiledCall`.
    ``step_mode`` picks how:

    - ``"eager"``: each step is a vmapped call, reading the plan's tensors directly;
    - ``"graph"`` (CUDA): each call shape is captured once as a CUDA graph (a block of
      up to ``block_steps`` steps in one graph) over static input buffers, checked against an eager
      run of the same call once, and replayed; with ``cache`` the graphs and the buffers
      they read are kept for later rounds;
    - ``"static"``: the graph path's logic (static input buffers, the same checks) without
      the capture, on any device (what the tests run on the CPU).

    Each mode computes the same steps from the same inputs.
    """

    def __init__(
        self, plans: list[ClientPlan], data: FederatedData, *, seed: int, batch_size: int, drop_last: bool,
        max_grad_norm: float, buffers: tuple[str, ...], precision: str = "fp32", step_mode: str = "eager",
        log: Log | None = None, cache: VectorizedCache | None = None, block_steps: int | None = None,
        channels_last: bool = False, conv_batching: str = "grouped", compile_steps: bool = False,
        low_names: tuple[str, ...] = (),
    ) -> None:
        if step_mode not in STEP_MODES:
            raise ValueError(f"step_mode = {step_mode!r}: must be one of {STEP_MODES}")
        if step_mode == "graph" and not graphs_capturable(data.device):
            raise ValueError(f"step_mode = 'graph' needs a CUDA device, not {data.device}")
        if conv_batching not in CONV_BATCHING:
            raise ValueError(f"conv_batching = {conv_batching!r}: must be one of {CONV_BATCHING}")
        self.plans, self.data, self.model_buffers, self.precision = plans, data, buffers, precision
        # bf16: the weights the steps read from bfloat16 copies (hetfl.models.low_precision)
        self.low_names = low_names if precision == "bf16" else ()
        self.batch_size, self.drop_last, self.max_grad_norm = batch_size, drop_last, max_grad_norm
        self.step_mode, self.log = step_mode, log
        self.channels_last = channels_last and len(data.info.input_shape) == 3
        # per-client convolutions read each client's batch as one contiguous block: batches gathered
        # client-major; grouped ones read [samples, clients x channels, H, W]: sample-major
        self.conv_batching, self.client_major = conv_batching, conv_batching == "per_client"
        self.block_steps = step_plan.BLOCK_STEPS if block_steps is None else block_steps
        ctxs = [p.ctx for p in plans]
        self.clients = [c.client_id for c in ctxs]
        self.seed, self.round = seed, ctxs[0].round
        self.batch_gens, self.augment_gens, self.draw_gens = self.generators(self.round)
        self.template = TemplateContext.of(plans[0].seen, plans[0].unread)
        self.cache = cache if step_mode != "eager" else None
        self.uncapturable = self.cache.uncapturable if self.cache is not None else set()
        self.programs: dict[Any, CompiledCall] = self.cache.programs if self.cache is not None else {}
        self.key = (plans[0].key(), len(plans))
        self.buffers = self._buffers()
        self.template.__dict__["shared"] = self.buffers.shared  # what a captured step reads: kept buffers
        # runtime.compile: the steps' gradients by torch.compile (hetfl.engine.compiled_step), from a plain
        # copy of the template's values; off while a call's reference runs (CompiledCall.build)
        self.compile_steps = compile_steps
        base = ClientContext(**{f.name: object.__getattribute__(self.template, f.name) for f in fields(ClientContext)})
        self.step_context = functools.partial(StepContext, base)
        self.uncompilable = self.cache.uncompilable if self.cache is not None else set()

    def _buffers(self) -> GroupBuffers:
        if self.cache is not None:
            kept = self.cache.buffers.get(self.key)
            if kept is not None and kept.fits(self.plans):
                kept.load(self.plans)
                return kept
            self.cache.forget(lambda key: key == self.key)  # compiled for buffers that are replaced
        made = GroupBuffers(self.plans, self.data.device, self.low_names)
        if self.cache is not None:
            self.cache.buffers[self.key] = made
        return made

    def generators(self, round_: int) -> tuple[list[torch.Generator], ...]:
        """The clients' batch, augmentation and draw generators of round ``round_`` (those of
        :func:`hetfl.engine.local.run_stages`)."""
        return tuple([torch_generator(self.seed, kind, round_, c, 0) for c in self.clients]
                     for kind in ("batches", "augment", "draws"))

    def plan(self, stages: list[Stage] | None = None, round_: int | None = None) -> list[StagePlan]:
        """The round's calls (all stages unless ``stages``), drawn from the clients' generators (fresh ones
        of round ``round_`` if given: a plan drawn ahead, :meth:`plan_ahead`)."""
        batch_gens, augment_gens, draw_gens = (self.batch_gens, self.augment_gens, self.draw_gens) \
            if round_ is None else self.generators(round_)
        return plan_round(
            self.plans[0].stages if stages is None else stages, self.clients,
            [self.data.client_sizes[c] for c in self.clients], batch_size=self.batch_size,
            drop_last=self.drop_last, batch_gens=batch_gens, augment_gens=augment_gens,
            draw_gens=draw_gens, stage_augment=self.data.stage_augment,
            global_indices=self.data.global_indices, device=self.data.device, block_steps=self.block_steps,
            client_major=self.client_major)

    def plan_inputs(self, round_: int) -> tuple[Any, ...]:
        """What the plan of round ``round_`` of this group's clients is a function of, besides their
        generators of that round: the stages (their epochs, steps and draw functions, by
        :func:`stage_key`, as the kept CUDA graphs are), the clients and their sizes, the batching."""
        return (round_, self.seed, tuple(self.clients), tuple(self.data.client_sizes[c] for c in self.clients),
                tuple(stage_key(s) for s in self.plans[0].stages), self.batch_size, self.drop_last,
                self.block_steps, self.client_major, id(self.data))

    def planned_ahead(self) -> list[StagePlan] | None:
        """This round's plan if the previous round drew it (:meth:`plan_ahead`) from the same inputs."""
        if self.cache is None:
            return None
        for key in [k for k, (inputs, *_) in self.cache.ahead.items() if inputs[0] < self.round]:  # never taken
            del self.cache.ahead[key]
        found = self.cache.ahead.pop((self.key, tuple(self.clients)), None)
        if found is None or found[0] != self.plan_inputs(self.round):
            return None
        self.cache.ahead_hits += 1
        return found[1]

    def plan_ahead(self) -> None:
        """Draw the next round's plan of these clients now, while the device runs this round's calls (the
        host would otherwise wait for them in :meth:`results`, and the device for the plan at the next
        round's start: CCVR's Table 2 round takes 46 ms to plan on the development CPU,
        ``benchmarks/plan_time.py``), and keep it for the next round's group (:meth:`planned_ahead`).
        With every client in every round (CCVR's Table 2, the throughput benchmark) the next round's
        group has the same clients and stages and takes it; where its clients or stages differ, it plans
        afresh. A method whose clients' state or payload first appears after round 1 (MOON's previous
        local model, FedPAC's heads) misses once, in round 2; sampled clients miss every round, so once
        plans drawn ahead in two rounds have all been missed, none is drawn again. A plan is a function
        of :meth:`plan_inputs` and the round's generators, so one drawn ahead is the plan (tested)."""
        cache = self.cache
        if cache is None or (cache.ahead_tries >= 2 and not cache.ahead_hits):
            return
        if cache.ahead_round != self.round:
            cache.ahead_tries, cache.ahead_round = cache.ahead_tries + 1, self.round
        after = self.round + 1
        try:  # the entry holds this round's stages, so that the identities in the inputs' keys stay unique
            cache.ahead[(self.key, tuple(self.clients))] = (self.plan_inputs(after), self.plan(round_=after),
                                                            self.plans[0].stages)
        except torch.cuda.OutOfMemoryError:  # a plan ahead is an optimisation: the next round plans itself
            torch.cuda.empty_cache()

    # ---------------------------------------------------------------- one step
    def vmapped_gradients(
        self, stage: Stage, state: Tensors, batch: Batch, payload: Tensors, cstate: Tensors, extras: Tensors,
        low: Tensors,
    ) -> tuple[Tensors, Tensors, torch.Tensor, Tensors]:
        """:func:`~hetfl.engine.local.step_gradients` of ``stage`` for every row of ``state``, vmapped
        (:func:`hetfl.engine.compiled_step.vmapped_step`; compiled with ``runtime.compile``): the rows'
        gradients, updated model buffers, losses and metrics. Uncompiled, a step of one row of a group of
        several runs unbatched (:meth:`single_client_gradients`). ``low``: the rows' bfloat16 copies of
        their weights, read by an uncompiled bf16 step (a compiled one casts, and Inductor fuses the casts)."""
        b = self.buffers
        settings = (self.max_grad_norm, self.model_buffers, self.precision,
                    (0, 0, 0, 0, b.payload_dims, b.cstate_dims, b.extras_dims))
        tensors = (state, batch.x, batch.y, batch.draws, payload, cstate, extras)
        if self.compiles(batch.y.shape[1]) and (key := stage_key(stage)) not in self.uncompilable:
            try:
                return run_compiled(stage, self.step_context, *settings, *tensors, {})
            except torch.cuda.OutOfMemoryError:  # the chunk is halved (train_clients_vectorized), still compiled
                raise
            except Exception as err:  # Dynamo's and Inductor's errors have no common base
                self.uncompilable.add(key)
                if self.log is not None:
                    self.log(f"vectorized: torch.compile could not compile stage {stage.name!r}; running it "
                             f"uncompiled: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        if batch.y.shape[0] == 1 and b.k > 1:
            return self.single_client_gradients(stage, state, batch, payload, cstate, extras, low)
        # hetfl's layers batch the clients without layout copies (the pooling only where the step is replayed);
        # bf16's weight copies likewise: read through autograd.Functions, whose Python cost under vmap and grad
        # an eager step would pay at every step (cnn2, 10 clients, 4 steps: 24,162 Python calls a round with
        # them, 9,206 without); eager, autocast casts the weights, to the same values
        with client_batching(self.conv_batching, pool_layout=self.replayed()):
            return vmapped_step(stage, self.template.with_tensors, *settings, *tensors,
                                low if self.replayed() else {})

    def replayed(self) -> bool:
        """Whether the step being run is recorded to be replayed: a CUDA graph's capture, or any step of the
        ``static`` mode, which stands for one on any device. Only there does the pooling keep the layout
        (:class:`hetfl.models.layers.MaxPool2d`'s ``autograd.Function``: its Python cost under ``vmap`` and
        ``grad`` paid once, the copies it saves at every replay); an eager step pays that cost at every step
        and is bound by its host time, so it pools with PyTorch's rule (the copies instead; the same values
        and gradients, bit for bit). simple_cnn at batch 2 on one CPU thread: 3.6x the Python calls a step
        with the layout rule (``benchmarks/results/step_host_time_cpu.md``)."""
        return self.step_mode == "static" or is_capturing()

    def compiles(self, size: int) -> bool:
        """Whether steps on batches of ``size`` samples are compiled (``runtime.compile``): only full
        batches. A compile per step shape (rows x batch size), seconds each, and every client's short last
        batch of an epoch is a size of its own, a step or two a round (CCVR's Table 2 round: 19 step
        shapes, 9 of them short batches): those run uncompiled."""
        return self.compile_steps and size == self.batch_size

    def single_client_gradients(
        self, stage: Stage, state: Tensors, batch: Batch, payload: Tensors, cstate: Tensors, extras: Tensors,
        low: Tensors,
    ) -> tuple[Tensors, Tensors, torch.Tensor, Tensors]:
        """:meth:`vmapped_gradients` of a step of one row, unbatched: the sequential executor's
        :func:`~hetfl.engine.local.step_gradients` (reverse-mode autograd, PyTorch's layers as they
        are) on the row, returned with a client axis of one.

        A round's largest client often trains alone for a long stretch (CCVR's Table 2 setting:
        480 of its 1,580 steps one after another). ``vmap`` of one row runs the batched forms of
        its layers (a batched product then the bias added; a convolution then its bias), where the
        plain layers fuse them (``addmm``; a convolution with its bias), and the loss is
        F.cross_entropy's (:func:`hetfl.algorithms.base.cross_entropy`): 43 operations of the model
        and loss a step instead of 57 (``benchmarks/step_ops.py``), less host work, and the
        sequential executor's very values. Only in groups of several clients: their
        stage's first step, all rows at once, ran vmapped, and so proved that the step has no
        random op and no ``.item()`` (which vmap refuses, and the sequential fallback handles)."""
        b = self.buffers

        def row(tensors: Tensors, dims: dict[str, int | None] | None = None) -> Tensors:
            return {n: t if dims is not None and dims[n] is None else t[0] for n, t in tensors.items()}

        ctx = self.template.with_tensors(row(payload, b.payload_dims), row(cstate, b.cstate_dims),
                                         row(extras, b.extras_dims))
        grads, new_buffers, loss, metrics = step_gradients(
            stage, row(state), Batch(batch.x[0], batch.y[0], row(batch.draws)), ctx, self.max_grad_norm,
            buffers=self.model_buffers, precision=self.precision, low=row(low))

        def batched(tensors: Tensors) -> Tensors:
            return {n: t.unsqueeze(0) for n, t in tensors.items()}

        return batched(grads), batched(new_buffers), loss.unsqueeze(0), batched(metrics)

    @contextlib.contextmanager
    def uncompiled(self) -> Iterator[None]:
        """Steps run uncompiled inside (a call's reference run: it records the plain values read)."""
        compile_steps, self.compile_steps = self.compile_steps, False
        try:
            yield
        finally:
            self.compile_steps = compile_steps

    def step(self, stage: Stage, index: int, first: bool, rows: torch.Tensor | None, idx: torch.Tensor,
             augment: torch.Tensor | None, draws: Tensors, start: int = 0) -> None:
        """One step of ``stage`` (the ``index``-th) for the rows ``rows`` (``[width]``; None: the ``width``
        rows from ``start``) on the samples ``idx`` (``[size, width]``, sample-major; ``augment``
        ``[3, size, width]``; client-major, ``[width, size]`` and ``[3, width, size]``, with per-client
        convolutions): the adversary's step (if any), then the stage's, written into the group's buffers in
        place."""
        b = self.buffers
        if self.client_major:  # idx [width, size]: each client's batch contiguous, as its own convolutions read it
            width = idx.shape[0]
            gathered = self.data.batch_at(idx, augment)
            x, y = gathered.x, gathered.y
        else:
            width = idx.shape[1]
            # gathered sample-major ([size, width, ...] in memory, seen as [width, size, ...]): a grouped
            # convolution of per-client weights reads its input as [samples, clients x channels, H, W], a view
            # of this layout (a client-major batch is copied into it, forward and backward)
            sample_major = self.data.batch_at(idx, augment)
            x, y = sample_major.x.transpose(0, 1), sample_major.y.t()
        if self.channels_last:
            x = client_channels_last(x) if self.client_major else channels_last_for_vmap(x)
        batch = Batch(x, y, draws)

        def take(t: torch.Tensor) -> torch.Tensor:
            return t[start : start + width] if rows is None else t.index_select(0, rows)

        def shared_or_take(tensors: Tensors, dims: dict[str, int | None]) -> Tensors:
            return {n: t if dims[n] is None else take(t) for n, t in tensors.items()}

        payload, cstate = shared_or_take(b.payload, b.payload_dims), shared_or_take(b.cstate, b.cstate_dims)
        extras = shared_or_take(b.extras, b.extras_dims)
        # the rows' states: views of the buffers (a range of rows), or gathered copies written back after
        # the step
        state = {n: take(t) for n, t in b.state.items()}
        # their bfloat16 copies (bf16): views of the kept copies, or, for gathered rows, made from the gathered
        # states in one multi-tensor cast (rather than gathered and scattered one tensor at a time)
        low = {n: take(t) for n, t in b.low.items()} if rows is None else \
            dict(zip(b.low, bf16_copies([state[n] for n in b.low]), strict=True))
        metrics: Tensors = {}
        if stage.adversary is not None:
            _, adv_metrics = self.train(stage.adversary, state, b.adv_opt[index], b.adv_lr[index], batch, payload,
                                        cstate, extras, first, rows, take, low)
            metrics.update({f"{stage.adversary.name}/{key}": value for key, value in adv_metrics.items()})
        loss, stage_metrics = self.train(stage, state, b.opt[index], b.lr[index], batch, payload, cstate, extras,
                                         first, rows, take, low)
        for key, value in {"": loss, **metrics, **stage_metrics}.items():
            if key not in b.sums:
                if is_capturing():
                    raise RuntimeError(f"metric {key!r} first appears while a CUDA graph is captured")
                b.sums[key] = torch.zeros(b.k + 1, device=value.device)
            if rows is None:
                take(b.sums[key]).add_(value.float())
            else:
                b.sums[key].index_add_(0, rows, value.float())

    def train(self, stage: Stage, state: Tensors, opt: Tensors, lr: torch.Tensor, batch: Batch, payload: Tensors,
              cstate: Tensors, extras: Tensors, first: bool, rows: torch.Tensor | None,
              take: Callable[[torch.Tensor], torch.Tensor], low: Tensors) -> tuple[torch.Tensor, Tensors]:
        """One SGD step of ``stage`` for the step's rows (``take``: a buffer's rows, as views or, with
        ``rows``, gathered): the vmapped gradients, then :func:`hetfl.optim.sgd_update_` at the rate
        ``lr`` (a device tensor) on all rows at once, in place in ``state`` (and so in the group's
        buffers) and in the stage's optimiser state ``opt``; returns (losses, metrics). The rows' bfloat16
        copies ``low`` of the updated weights are refreshed after it (one multi-tensor copy; gathered rows: the
        kept copies of all rows too, from the buffers the rows were written back to)."""
        grads, new_buffers, loss, metrics = self.vmapped_gradients(stage, state, batch, payload, cstate, extras, low)
        for name, value in new_buffers.items():
            state[name].copy_(value)
        names = list(grads)
        metrics = unaliased(metrics, [state[n] for n in names])
        mine = {n: take(t) for n, t in opt.items()}
        sgd_update_([state[n] for n in names], [grads[n] for n in names], [mine[n] for n in names] if mine else [],
                    stage.sgd, first, lr)
        refresh_copies(low, state, names)
        if rows is not None:  # gathered copies: back into the buffers' rows
            self.write(self.buffers.state, {n: state[n] for n in (*new_buffers, *names)}, rows)
            self.write(opt, mine, rows)
            refresh_copies(self.buffers.low, self.buffers.state, names)
        return loss, metrics

    @staticmethod
    def write(full: Tensors, part: Tensors, rows: torch.Tensor) -> None:
        """``part``'s rows into ``full``'s rows ``rows``, in place."""
        for name, value in part.items():
            full[name].index_copy_(0, rows, value.to(full[name].dtype))

    def body(self, stage: Stage, index: int, call: Call) -> None:
        """All steps of ``call``."""
        for s in range(call.steps):
            rows = None if call.rows is None else call.rows[s]
            augment = None if call.augment is None else call.augment[s]
            self.step(stage, index, call.first, rows, call.idx[s], augment, {n: d[s] for n, d in call.draws.items()},
                      call.start)

    # ---------------------------------------------------------------- the round
    def run(self) -> list[LocalResult]:
        k = self.buffers.k
        steps = [0] * k
        stages = self.plans[0].stages
        for index, (stage, stage_plan) in enumerate(zip(stages, self.planned_ahead() or self.plan(), strict=True)):
            for call in stage_plan.calls:
                self.compiled(stage, index, call).run(call)
            steps = [a + b for a, b in zip(steps, stage_plan.steps, strict=True)]
        self.plan_ahead()  # while the device runs the calls just launched
        return self.results(steps)

    def compiled(self, stage: Stage, index: int, call: Call) -> CompiledCall:
        """The compiled form of ``call``'s shape: made once (per round, or per run with a cache)."""
        if self.step_mode == "eager":
            return CompiledCall(self, stage, index, call)
        programs = self.programs
        key = (self.key, index, stage_key(stage), call.shape())
        found = programs.get(key)
        if found is None or not found.reusable(self.template):
            found = programs[key] = CompiledCall(self, stage, index, call)
        found.group = self
        if self.cache is not None and self.cache.used(key) and self.log is not None:
            self.log(f"vectorized: more than {self.cache.max_calls} call shapes met; the least recently used "
                     "CUDA graphs are dropped (and captured again if their shape returns)")
        return found

    def results(self, steps: list[int]) -> list[LocalResult]:
        b = self.buffers
        sums = {key: v[: b.k].tolist() for key, v in b.sums.items()}  # one transfer per key
        loss = sums.pop("")
        return [
            LocalResult(
                state={n: t[row].clone() for n, t in b.state.items()},
                steps=steps[row],
                loss_sum=float(loss[row]),
                metric_sums={key: float(v[row]) for key, v in sums.items()},
            )
            for row in range(b.k)
        ]


STEP_MODES = ("eager", "static", "graph")


# compiled calls (CUDA graphs and their static inputs) a run keeps at most: the least recently used go first
MAX_KEPT_CALLS = 1024


@dataclass
class VectorizedCache:
    """What the vectorised executor keeps across rounds (the caller holds it): in graph mode each
    group's buffers and compiled calls, at most ``max_calls`` of the latter (the least recently used
    are dropped first, and captured again if their shape comes back): a run of sampled clients meets
    new call shapes for many rounds (``benchmarks/graph_shapes.py``), and each graph holds device memory."""

    buffers: dict[Any, GroupBuffers] = field(default_factory=dict)
    programs: OrderedDict[Any, CompiledCall] = field(default_factory=OrderedDict)
    uncapturable: set[Any] = field(default_factory=set)  # stage keys whose capture failed: run eagerly
    uncompilable: set[Any] = field(default_factory=set)  # stage keys torch.compile failed on: run uncompiled
    pool: Any = None  # the CUDA graphs' shared memory pool (their temporaries never outlive a replay)
    # the next round's plans, drawn while this round's calls run (VectorizedGroup.plan_ahead): by group and
    # clients, (the plan's inputs, the plan, the stages it was drawn for); in how many rounds plans were drawn
    # (the last: ahead_round), and how many were taken
    ahead: dict[Any, tuple[Any, list[StagePlan], list[Stage]]] = field(default_factory=dict)
    ahead_tries: int = 0
    ahead_round: int = -1
    ahead_hits: int = 0
    max_calls: int = MAX_KEPT_CALLS
    dropped: int = 0  # compiled calls dropped to keep within max_calls

    def __post_init__(self) -> None:
        if self.max_calls < 1:
            raise ValueError(f"max_calls = {self.max_calls!r}: must be at least 1 (the call being run is kept)")

    def used(self, key: Any) -> bool:
        """Mark the compiled call ``key`` as the most recently used, and drop the least recently used
        ones beyond ``max_calls``; true when this drops the run's first."""
        self.programs.move_to_end(key)
        first = self.dropped == 0
        while len(self.programs) > self.max_calls:
            self.programs.popitem(last=False)
            self.dropped += 1
        return first and self.dropped > 0

    def drop(self, clients: int) -> None:
        """Forget the buffers and compiled calls of groups of ``clients`` clients."""
        for key in [k for k in self.buffers if k[1] == clients]:
            del self.buffers[key]
        self.forget(lambda group: group[1] == clients)

    def forget(self, groups: Callable[[Any], bool]) -> None:
        """Forget the compiled calls of the groups (keys) for which ``groups`` is true, in place (a group's
        ``programs`` is this very dict)."""
        for key in [k for k in self.programs if groups(k[0])]:
            del self.programs[key]


def is_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class CompiledCall:
    """A call shape of a stage, ready to run: eagerly, or (graph/static modes) on static input
    buffers that each run copies its call's tensors into (device to device), then one CUDA
    graph replay (graph) or the body itself (static).

    Capture (once per shape): the call's body runs eagerly from the current state (warming up
    the kernels, and giving the reference), the state is put back, the body is captured, the
    graph is replayed and its result compared with the reference. A capture that fails, or a
    replay that disagrees, leaves the eager result in place and the stage runs eagerly from
    then on, with the reason logged once. The stage (and through it, every callable the step
    calls) is held by the compiled call, so that the identities in its key stay unique."""

    def __init__(self, group: VectorizedGroup, stage: Stage, index: int, call: Call) -> None:
        self.group, self.stage, self.index = group, stage, index
        self.graph: Any = None
        self.eager = group.step_mode == "eager"
        self.built = False
        self.reads: set[str] = set()
        self.scalars: tuple[Any, ...] = ()
        if not self.eager:
            self.inputs = Call(call.first, call.steps, call.width, call.size,
                               None if call.rows is None else call.rows.clone(), call.idx.clone(),
                               None if call.augment is None else call.augment.clone(),
                               {n: d.clone() for n, d in call.draws.items()}, call.start)

    def reusable(self, template: TemplateContext) -> bool:
        """Whether the round's plain values that the step read are those it was compiled with."""
        return not self.built or template.scalars(self.reads) == self.scalars

    def load(self, call: Call) -> None:
        target = self.inputs
        for mine, theirs in ((target.rows, call.rows), (target.idx, call.idx), (target.augment, call.augment)):
            if mine is not None:
                mine.copy_(theirs)  # type: ignore[arg-type]
        for name, value in call.draws.items():
            target.draws[name].copy_(value)

    def run(self, call: Call) -> None:
        group = self.group
        if self.eager:
            group.body(self.stage, self.index, call)
            return
        self.load(call)
        if not self.built:
            self.build()
            return
        if self.graph is not None:
            self.graph.replay()
        else:
            group.body(self.stage, self.index, self.inputs)

    def build(self) -> None:
        """Run this first call eagerly (the reference) and, in graph mode, capture and check its graph."""
        group, template = self.group, self.group.template
        template.reads.clear()
        if group.step_mode != "graph" or stage_key(self.stage) in group.uncapturable:
            with group.uncompiled(), build_phase("first run"):
                group.body(self.stage, self.index, self.inputs)
            self._built(template)
            return
        tensors = group.buffers.tensors(self.index)
        before = [{n: t.clone() for n, t in d.items()} for d in tensors]
        with side_stream(group.data.device), group.uncompiled(), build_phase("reference"):
            group.body(self.stage, self.index, self.inputs)  # warm-up, and the reference
        self._built(template)
        tensors = group.buffers.tensors(self.index)  # the warm-up may have added a metric's sums
        if group.compiles(self.inputs.size):
            # the compiled step's own run is the reference (the graph replays its kernels, which round
            # otherwise than the uncompiled step's), compiled before the capture, which must not compile
            restore(tensors, before)
            with side_stream(group.data.device), build_phase("compiled reference"):
                group.body(self.stage, self.index, self.inputs)
        reference = [{n: t.clone() for n, t in d.items()} for d in tensors]
        restore(tensors, before)
        try:
            with build_phase("capture"):
                self.capture()
        except RuntimeError as err:  # an op that cannot be captured (a host sync, a CPU tensor...)
            restore(tensors, reference)
            self.graph = None
            group.uncapturable.add(stage_key(self.stage))
            self.note(f"vectorized: CUDA graph capture failed for stage {self.stage.name!r}, running it eagerly: "
                      f"{err}")
            return
        with build_phase("check"):
            self.graph.replay()
            gaps = [(got.double() - want[n].double()).abs().max()
                    for d, want in zip(tensors[:3], reference[:3], strict=True) for n, got in d.items() if got.numel()]
            worst = torch.stack(gaps).max().item() if gaps else 0.0  # one wait for the device, not one a tensor
        if worst > GRAPH_CHECK_ATOL:
            restore(tensors, reference)
            self.graph = None
            group.uncapturable.add(stage_key(self.stage))
            self.note(f"vectorized: the CUDA graph of stage {self.stage.name!r} disagrees with the eager step by "
                      f"{worst:.3g}; running eagerly")

    def _built(self, template: TemplateContext) -> None:
        self.built = True
        self.reads = set(template.reads)
        self.scalars = template.scalars(self.reads)

    def capture(self) -> None:
        """Capture the body as a CUDA graph (kernels recorded, not run)."""
        group = self.group
        cache = group.cache
        pool = None
        if cache is not None:
            if cache.pool is None:
                cache.pool = torch.cuda.graph_pool_handle()
            pool = cache.pool
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            group.body(self.stage, self.index, self.inputs)
        self.graph = graph

    def note(self, message: str) -> None:
        if self.group.log is not None:
            self.group.log(message)


def build_phase(name: str) -> contextlib.AbstractContextManager:
    """A named range of a compiled call's build (``hetfl.build/<name>``: the first run, the reference,
    the compiled reference, the capture, the check), which ``torch.profiler`` records and
    ``benchmarks/profile_round.py --round 1`` adds up: where a run's first round goes."""
    return torch.profiler.record_function(f"{BUILD_PHASE}/{name}")


BUILD_PHASE = "hetfl.build"


def graphs_capturable(device: torch.device) -> bool:
    """Whether CUDA graphs can be captured on ``device`` (graph mode's precondition)."""
    return device.type == "cuda"


@contextlib.contextmanager
def side_stream(device: torch.device) -> Iterator[None]:
    """Work on a side stream, joined to the current one after (on CUDA: the warm-up before a
    capture runs there, as PyTorch's CUDA-graph notes ask); elsewhere nothing changes."""
    if device.type != "cuda":
        yield
        return
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream(device).wait_stream(side)


def restore(tensors: list[Tensors], saved: list[Tensors]) -> None:
    """``saved``'s values back into ``tensors`` in place (a sum that did not exist yet: zero)."""
    for d, values in zip(tensors, saved, strict=True):
        for name, t in d.items():
            if name in values:
                t.copy_(values[name])
            else:
                t.zero_()


# A replay runs the kernels of the eager step on the same inputs; anything but rounding
# (a stale buffer, a lost write) shows as a difference of the size of a step's update.
GRAPH_CHECK_ATOL = 1e-5


def free_memory_bytes(device: torch.device) -> int | None:
    """Bytes free for new tensors on ``device``: CUDA's free memory, or None (not known / CPU)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def probe_client_bytes(plan: ClientPlan, data: FederatedData, *, seed: int, **settings: Any) -> int:
    """Peak device memory of one client's eager first step of its first stage (state, optimiser,
    activations, gradients): what each further client of a vmapped group adds. The probe
    has its own generators and buffers and changes nothing of the real round (CUDA only)."""
    group = VectorizedGroup([plan], data, seed=seed, **{**settings, "step_mode": "eager"})
    stage = plan.stages[0]
    first = group.plan([replace(stage, epochs=1, steps=1)])[0].calls[0]
    device = data.device
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    group.body(stage, 0, first)
    torch.cuda.synchronize(device)
    # the client's state and, in bf16, its weights' bfloat16 copies (group.buffers.low: a row each)
    kept = sum(t.nbytes for t in plan.start.values()) + sum(t[0].nbytes for t in group.buffers.low.values())
    return max(1, torch.cuda.max_memory_allocated(device) - base + kept)


# share of the free memory a vmapped group may take (the rest: the allocator's slack, evaluation)
MEMORY_SHARE = 0.7


def clients_that_fit(plan: ClientPlan, data: FederatedData, *, seed: int, **settings: Any) -> int | None:
    """Most clients of ``plan``'s group structure that fit in ``MEMORY_SHARE`` of the free device memory,
    from a one-client probe; None where free memory is not known (the CPU: no limit)."""
    free = free_memory_bytes(data.device)
    if free is None:
        return None
    return max(1, int(free * MEMORY_SHARE) // probe_client_bytes(plan, data, seed=seed, **settings))


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
    memo: dict[Any, int | None] | None = None,
    cache: VectorizedCache | None = None,
    channels_last: bool = False,
    conv_batching: str = "grouped",
    compile_steps: bool = False,
    block_steps: int | None = None,
) -> list[LocalResult]:
    """Local training of all ``ctxs`` (one round), vectorised; results in the order of ``ctxs``.

    ``chunk_size`` > 0 trains at most that many clients at once; 0 picks it from the
    free device memory (:func:`clients_that_fit`), and a chunk that runs out of memory
    is retried in halves. Any chunking gives the same results. ``memo`` (kept by the
    caller across rounds) remembers, for each group structure, how many clients fit at once (None: no limit).
    ``step_mode``: see :class:`VectorizedGroup`; ``cache`` (kept by the caller) keeps the
    compiled calls (CUDA graphs) and their buffers for the next rounds; ``conv_batching``: how
    convolutions of per-client weights are batched (:mod:`hetfl.models.layers`); ``compile_steps``: each
    step's gradients by ``torch.compile`` (:mod:`hetfl.engine.compiled_step`); ``block_steps``: most steps
    of a call (:mod:`hetfl.engine.step_plan`; default ``step_plan.BLOCK_STEPS``).
    """
    plans = [ClientPlan.of(algorithm, ctx) for ctx in ctxs]
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, plan in enumerate(plans):
        groups.setdefault(plan.key(), []).append(i)
    if len(groups) > 1 and log is not None:
        log(f"vectorized: {len(groups)} client groups with different stage structures or tensor shapes")
    results: list[LocalResult | None] = [None] * len(plans)
    settings = {"batch_size": train_cfg.batch_size, "drop_last": train_cfg.drop_last,
                "max_grad_norm": train_cfg.max_grad_norm, "buffers": algorithm.running_buffers(),
                "precision": getattr(train_cfg, "precision", "fp32"),
                "low_names": algorithm.model.low_precision_names}
    memo = {} if memo is None else memo
    for key, members in groups.items():
        # largest clients first: the rows still training are then a prefix (hetfl.engine.step_plan)
        members.sort(key=lambda i: -data.client_sizes[plans[i].ctx.client_id])
        if chunk_size:
            size = chunk_size
        else:  # what fits is kept by group structure: a later round may bring more of its clients
            if key not in memo:
                # probed in the layout the group's steps will run in (activations, cuDNN's workspaces)
                memo[key] = clients_that_fit(plans[members[0]], data, seed=seed, channels_last=channels_last,
                                             conv_batching=conv_batching, **settings)
                if memo[key] is not None and memo[key] < len(members) and log is not None:
                    log(f"vectorized: {memo[key]} of {len(members)} clients at once fit in the free device memory")
            size = len(members) if memo[key] is None else min(len(members), memo[key])
        start = 0
        while start < len(members):
            chunk = members[start : start + size]
            try:
                out = VectorizedGroup([plans[i] for i in chunk], data, seed=seed, step_mode=step_mode, log=log,
                                      cache=cache, channels_last=channels_last, conv_batching=conv_batching,
                                      compile_steps=compile_steps, block_steps=block_steps, **settings).run()
            except torch.cuda.OutOfMemoryError:
                if cache is not None:  # free what this chunk size kept: a smaller one is tried next
                    cache.drop(len(chunk))
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
                    log(f"vectorized: falling back to sequential clients for {algorithm.name}{where_in_method(err)}: "
                        f"{err}")
                out = [run_stages(plans[i].stages, plans[i].start, plans[i].ctx, data, seed=seed, **settings)
                       for i in chunk]
            for i, result in zip(chunk, out, strict=True):
                results[i] = result
            start += len(chunk)
    return results  # type: ignore[return-value]
