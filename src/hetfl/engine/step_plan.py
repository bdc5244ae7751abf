"""A round of vectorised local training, planned on the host before its first step.

Which samples every client sees at every step, and how each batch is augmented,
does not depend on what training computes: it is drawn from the clients' own
generators (:func:`hetfl.rng.torch_generator`), in the order the sequential
executor draws it (:func:`hetfl.engine.local.run_stages`). So the vectorised
executor draws a round's whole schedule first, lays it out as a list of
:class:`Call` s (each: some steps of some clients, with batches of one size) and
moves it to the device in one copy. A step then only reads device tensors: no
host synchronisation, no host-to-device copy (DESIGN.md, property 4).

The layout. Rows are the clients of a vectorised group (row ``k`` is a scratch row
that padding entries point at: its results are discarded). Each stage is

1. its first step, every client at once (one call per batch size): the step that
   initialises the momentum buffer;
2. then blocks of at most ``block_steps`` steps, in each of which every client
   whose next batch is full takes it; a client whose next batch is short (the last
   of an epoch) waits for the block's end, where
3. the waiting clients take their short batch (one call per size), and the next
   block starts.

A client's own steps stay in its order, so each client's result equals the
sequential executor's; clients that have finished drop out of the blocks (their
width shrinks), so no computation is spent on them beyond the width's rounding
(:func:`bucket_width`), which keeps the number of distinct call shapes (and of
CUDA graphs) small.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hetfl.algorithms.base import Stage, Tensors
from hetfl.engine.schedule import batch_schedule

# steps of one block; a captured block replays them all at once
BLOCK_STEPS = 16


@dataclass
class Call:
    """``steps`` consecutive steps of ``width`` rows with batches of ``size`` samples.

    Device tensors, step-major: ``rows`` ``[steps, width]`` (row indices into the
    stacked states; None: rows ``0..width-1`` in order at every step), ``idx``
    ``[steps, width, size]`` (indices into the training set), ``augment``
    ``[steps, 3, width, size]`` (crop offsets and flip, or None) and ``draws``
    (each ``[steps, width, ...]``: the stage's per-step random numbers).
    """

    first: bool
    steps: int
    width: int
    size: int
    rows: torch.Tensor | None
    idx: torch.Tensor
    augment: torch.Tensor | None
    draws: Tensors = field(default_factory=dict)

    def shape(self) -> tuple[bool, int, int, int, bool]:
        """What a compiled call depends on (the values it reads live in buffers)."""
        return (self.first, self.steps, self.width, self.size, self.rows is None)


@dataclass
class StagePlan:
    calls: list[Call]
    steps: list[int]  # per row: steps taken in this stage


def bucket_width(width: int, rows: int) -> int:
    """The width a call of ``width`` active rows (of ``rows`` in the group) is computed at: up to 4
    exactly, else rounded up to a multiple of ``ceil(rows / 8)`` (at most 8 widths above 4, and at
    most an eighth of the group computed in vain)."""
    if width <= 4:
        return width
    quantum = max(1, math.ceil(rows / 8))
    return min(rows, math.ceil(width / quantum) * quantum)


def split_steps(steps: int, most: int = BLOCK_STEPS) -> list[int]:
    """A block of ``steps`` slots cut into powers of two (largest first), so that blocks of any length
    are made of few distinct call shapes: 13 -> [8, 4, 1]."""
    parts = []
    while steps:
        part = min(most, 1 << (steps.bit_length() - 1))
        parts.append(part)
        steps -= part
    return parts


@dataclass
class _HostBatch:
    idx: torch.Tensor  # global sample indices (CPU)
    augment: torch.Tensor | None  # [3, n]
    draws: Tensors


class _Packer:
    """Collects host tensors and moves them to the device in one copy per dtype."""

    def __init__(self) -> None:
        self.parts: dict[torch.dtype, list[torch.Tensor]] = {}
        self.slots: list[tuple[torch.dtype, int, tuple[int, ...]]] = []

    def add(self, t: torch.Tensor) -> int:
        parts = self.parts.setdefault(t.dtype, [])
        offset = sum(p.numel() for p in parts)
        parts.append(t.reshape(-1))
        self.slots.append((t.dtype, offset, tuple(t.shape)))
        return len(self.slots) - 1

    def to(self, device: torch.device) -> Callable[[int], torch.Tensor]:
        flat = {}
        for dtype, parts in self.parts.items():
            host = torch.cat(parts)
            if device.type == "cuda":
                host = host.pin_memory()
            flat[dtype] = host.to(device, non_blocking=True)

        def view(slot: int) -> torch.Tensor:
            dtype, offset, shape = self.slots[slot]
            return flat[dtype][offset : offset + math.prod(shape)].view(shape)

        return view


def plan_round(
    stages: list[Stage],
    clients: list[int],
    sizes: list[int],
    *,
    batch_size: int,
    drop_last: bool,
    batch_gens: list[torch.Generator],
    augment_gens: list[torch.Generator],
    draw_gens: list[torch.Generator],
    augment_draws: Callable[[int, torch.Generator], torch.Tensor | None],
    global_indices: Callable[[int, torch.Tensor], torch.Tensor],
    device: torch.device,
    block_steps: int = BLOCK_STEPS,
) -> list[StagePlan]:
    """Every stage's calls for the clients ``clients`` (rows ``0..k-1``; ``sizes``: their sample counts),
    drawn from their generators in the sequential executor's order and moved to ``device`` at once."""
    k = len(clients)
    packer = _Packer()
    layouts = []
    for stage in stages:
        batches: list[list[_HostBatch]] = []
        for r in range(k):
            schedule = batch_schedule(sizes[r], batch_size, stage.epochs, stage.steps, drop_last, batch_gens[r])
            row = []
            for local in schedule:
                augment = augment_draws(len(local), augment_gens[r])
                draws = {} if stage.draws is None else stage.draws(draw_gens[r], len(local))
                row.append(_HostBatch(global_indices(clients[r], local), augment, draws))
            batches.append(row)
        layouts.append(_layout(batches, k, batch_size, block_steps, packer))
    view = packer.to(device)
    return [StagePlan([_device_call(c, view) for c in calls], steps) for calls, steps in layouts]


@dataclass
class _HostCall:
    first: bool
    size: int
    slots: list[list[tuple[int, _HostBatch]]]  # per step: (row, batch) of the active rows
    width: int
    all_rows: bool = False
    packed: dict[str, int] = field(default_factory=dict)


def _layout(batches: list[list[_HostBatch]], k: int, batch_size: int, block_steps: int, packer: _Packer):
    """The calls of one stage (see the module docstring), packed into ``packer``."""
    pos = [0] * k
    calls: list[_HostCall] = []

    def head(r: int) -> _HostBatch | None:
        return batches[r][pos[r]] if pos[r] < len(batches[r]) else None

    def by_size(rows: list[int], first: bool) -> None:
        groups: dict[int, list[int]] = {}
        for r in rows:
            groups.setdefault(len(head(r).idx), []).append(r)  # type: ignore[union-attr]
        for size, members in groups.items():
            slot = [(r, head(r)) for r in members]
            calls.append(_HostCall(first, size, [slot], len(members), members == list(range(k))))  # type: ignore[arg-type]
            for r in members:
                pos[r] += 1

    by_size([r for r in range(k) if head(r) is not None], first=True)
    while True:
        slots = []
        while len(slots) < block_steps:
            active = [r for r in range(k) if (b := head(r)) is not None and len(b.idx) == batch_size]
            if not active:
                break
            slots.append([(r, head(r)) for r in active])
            for r in active:
                pos[r] += 1
        start = 0
        for part in split_steps(len(slots), block_steps):
            block = slots[start : start + part]
            start += part
            width = bucket_width(max(len(s) for s in block), k)
            all_rows = width == k and all(len(s) == k for s in block)
            calls.append(_HostCall(False, batch_size, block, width, all_rows))  # type: ignore[arg-type]
        waiting = [r for r in range(k) if (b := head(r)) is not None and len(b.idx) < batch_size]
        if not slots and not waiting:
            break
        by_size(waiting, first=False)
    for call in calls:
        _pack(call, k, packer)
    return calls, pos


def _pack(call: _HostCall, k: int, packer: _Packer) -> None:
    """The call's rows, indices, augmentation and draws as step-major tensors, padded to its width
    with the scratch row ``k`` (sample 0, zero offsets, zero draws)."""
    steps, width, size = len(call.slots), call.width, call.size
    rows = torch.full((steps, width), k, dtype=torch.long)
    idx = torch.zeros(steps, width, size, dtype=torch.long)
    some = call.slots[0][0][1]
    augment = None if some.augment is None else torch.zeros(steps, 3, width, size, dtype=torch.long)
    draws = {n: torch.zeros(steps, width, *d.shape, dtype=d.dtype) for n, d in some.draws.items()}
    for s, slot in enumerate(call.slots):
        for w, (r, b) in enumerate(slot):
            rows[s, w] = r
            idx[s, w] = b.idx
            if augment is not None:
                augment[s, :, w] = b.augment
            for n, d in b.draws.items():
                draws[n][s, w] = d
    if not call.all_rows:
        call.packed["rows"] = packer.add(rows)
    call.packed["idx"] = packer.add(idx)
    if augment is not None:
        call.packed["augment"] = packer.add(augment)
    for n, d in draws.items():
        call.packed[f"draws/{n}"] = packer.add(d)


def _device_call(call: _HostCall, view: Callable[[int], torch.Tensor]) -> Call:
    p = call.packed
    return Call(
        first=call.first, steps=len(call.slots), width=call.width, size=call.size,
        rows=view(p["rows"]) if "rows" in p else None,
        idx=view(p["idx"]),
        augment=view(p["augment"]) if "augment" in p else None,
        draws={n[len("draws/"):]: view(slot) for n, slot in p.items() if n.startswith("draws/")},
    )
