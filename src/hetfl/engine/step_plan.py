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
   of an epoch) stops there, and the block ends where a client reaches a short
   batch that is not its last, so that
3. the clients at a short batch take it (one call per size), and the next block
   starts with every client that still trains in step with the others.

A block is cut into calls where one of its clients stops (each piece in powers of
two: few distinct lengths), so that every client of a call takes each of its steps.
A client's own steps stay in its order, so each client's result equals the
sequential executor's; clients that have finished drop out (the width shrinks).
The executor orders a group's clients by size, largest first, and the clients
advance in step (3.), so the clients still training are always consecutive rows:
every block reads and writes its rows as views of the stacked buffers (no gather,
no scatter, no padding; its width is exact).

Single steps whose rows do not start at row 0 (the short batches, which the clients
reach at different rows) are gathered by index and scattered back, their width
rounded up (:func:`bucket_width`), even where the rows are consecutive. Where a
view starts is part of a compiled call's shape (a CUDA graph reads fixed
addresses), and short batches of every size at every row would be new shapes, so
new graphs, in every round of a run with sampled clients: 1,000 Dirichlet clients,
100 a round, batch 50: 3,314 shapes after 300 rounds and 4.6 more a round;
gathered, 351, and 0.14 more a round (``benchmarks/graph_shapes.py``). A gathered
single step costs a copy of its rows' state in and out, once per short batch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hetfl.algorithms.base import Stage, Tensors, checked_stage_output
from hetfl.engine.schedule import batch_schedule_flat

# most steps of one call (runtime.graph_steps): a captured call replays them all at once. Each call shape is
# captured in the first round that meets it, its steps run twice in Python there (the eager reference and the
# capture): with 16, CCVR's Table 2 round (51 shapes, 308 calls) runs 281 steps twice to build its graphs, with 4,
# 73 (34 shapes, 511 calls); benchmarks/graph_shapes.py
BLOCK_STEPS = 4


@dataclass
class Call:
    """``steps`` consecutive steps of ``width`` rows with batches of ``size`` samples.

    Device tensors, step-major: ``rows`` ``[steps, width]`` (row indices into the
    stacked states; None: rows ``start..start+width-1`` at every step, which a step
    reads and writes as views, without gathering), ``idx``
    ``[steps, size, width]`` (indices into the training set, sample-major: a step's
    batch is gathered in the layout a grouped convolution reads; client-major,
    ``[steps, width, size]``, in a plan made with ``client_major``: each client's
    batch one block, as its own convolutions read it), ``augment``
    ``[steps, 3, size, width]`` (where the crops start, or None; ``[steps, 3, width,
    size]`` client-major) and ``draws`` (each ``[steps, width, ...]``: the stage's
    per-step random numbers).
    """

    first: bool
    steps: int
    width: int
    size: int
    rows: torch.Tensor | None
    idx: torch.Tensor
    augment: torch.Tensor | None
    draws: Tensors = field(default_factory=dict)
    start: int = 0

    def shape(self) -> tuple[bool, int, int, int, int | None]:
        """What a compiled call depends on (the values it reads live in buffers; a range of rows is
        read as views at a fixed place)."""
        return (self.first, self.steps, self.width, self.size, self.start if self.rows is None else None)


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
    """A block of ``steps`` slots cut into pieces of at most ``most`` (largest first), each the largest power
    of two left or ``most``, so that blocks of any length are made of few distinct call shapes: 13 -> [8, 4, 1]
    with ``most`` 8 or more, [4, 4, 4, 1] with the default 4; a ``most`` that is no power of two
    (``runtime.graph_steps = 3``) gives its own length too: 6 -> [3, 2, 1]."""
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


@dataclass
class _Row:
    """One client's batches of a stage, in order: ``order[j]`` is ``("full", i)`` (row ``i`` of the
    stacked full batches) or ``("short", batch)``."""

    order: list[tuple[str, object]]
    full_idx: torch.Tensor  # [full batches, batch_size]
    full_augment: torch.Tensor | None  # [full batches, 3, batch_size]
    full_draws: Tensors  # each [full batches, ...]
    runs: list[int] = field(default_factory=list)  # runs[j]: full batches in a row from batch j (0: short or done)

    def __post_init__(self) -> None:
        self.runs = [0] * (len(self.order) + 1)
        for j in range(len(self.order) - 1, -1, -1):
            self.runs[j] = self.runs[j + 1] + 1 if self.order[j][0] == "full" else 0

    def batch(self, j: int) -> _HostBatch:
        kind, what = self.order[j]
        if kind == "short":
            return what  # type: ignore[return-value]
        i = int(what)  # type: ignore[call-overload]
        return _HostBatch(self.full_idx[i], None if self.full_augment is None else self.full_augment[i],
                          {n: d[i] for n, d in self.full_draws.items()})

    def is_full(self, j: int) -> bool:
        return self.run(j) > 0

    def run(self, j: int) -> int:
        """How many full batches follow one another from batch ``j`` on."""
        return self.runs[j] if j < len(self.order) else 0

    def full_index(self, j: int) -> int:
        return int(self.order[j][1])  # type: ignore[call-overload]


class _Packer:
    """Collects host tensors and moves them to the device in one copy per dtype."""

    def __init__(self) -> None:
        self.parts: dict[torch.dtype, list[torch.Tensor]] = {}
        self.sizes: dict[torch.dtype, int] = {}
        self.slots: list[tuple[torch.dtype, int, tuple[int, ...]]] = []

    def add(self, t: torch.Tensor) -> int:
        offset = self.sizes.get(t.dtype, 0)
        self.parts.setdefault(t.dtype, []).append(t.reshape(-1))
        self.sizes[t.dtype] = offset + t.numel()
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
    stage_augment: Callable[[list[int], torch.Generator], torch.Tensor | None],
    global_indices: Callable[[int, torch.Tensor], torch.Tensor],
    device: torch.device,
    block_steps: int = BLOCK_STEPS,
    client_major: bool = False,
) -> list[StagePlan]:
    """Every stage's calls for the clients ``clients`` (rows ``0..k-1``; ``sizes``: their sample counts),
    drawn from their generators in the sequential executor's order and moved to ``device`` at once;
    the batches' indices laid out client-major with ``client_major`` (:class:`Call`)."""
    k = len(clients)
    packer = _Packer()
    layouts = []
    for stage in stages:
        rows = []
        for r in range(k):
            flat, batches = batch_schedule_flat(sizes[r], batch_size, stage.epochs, stage.steps, drop_last,
                                                batch_gens[r])
            rows.append(_row(batches, global_indices(clients[r], flat) if batches else None, batch_size, stage,
                             stage_augment(batches, augment_gens[r]), draw_gens[r]))
        layouts.append(_layout(rows, k, batch_size, block_steps, packer, client_major))
    view = packer.to(device)
    return [StagePlan([_device_call(c, view) for c in calls], steps) for calls, steps in layouts]


def _row(sizes: list[int], flat_global: torch.Tensor | None, batch_size: int, stage: Stage,
         augment: torch.Tensor | None, draw_gen: torch.Generator) -> _Row:
    """A client's batches of a stage (``sizes[j]`` samples each; their global indices ``flat_global``, batch
    after batch) with their augmentation (``augment``: the stage's ``[3, samples]``, batch after batch) and
    per-step draws (drawn batch by batch, in the sequential executor's order). The full batches are
    gathered at once (a round of CCVR's 10 epochs has 7,860)."""
    flat = torch.zeros(0, dtype=torch.long) if flat_global is None else flat_global  # None: no batches
    offsets = [0, *itertools.accumulate(sizes)]
    draws = [checked_stage_output(stage, "draws", stage.draws(draw_gen, n)) for n in sizes] \
        if stage.draws is not None else [{}] * len(sizes)
    full = [j for j, n in enumerate(sizes) if n == batch_size]
    columns = torch.tensor([offsets[j] for j in full], dtype=torch.long).view(-1, 1) + torch.arange(batch_size)
    place = {j: i for i, j in enumerate(full)}  # batch -> its row among the full batches
    order: list[tuple[str, object]] = []
    for j, n in enumerate(sizes):
        if n == batch_size:
            order.append(("full", place[j]))
        else:
            a, z = offsets[j], offsets[j + 1]
            order.append(("short", _HostBatch(flat[a:z], None if augment is None else augment[:, a:z], draws[j])))
    return _Row(
        order,
        flat[columns] if full else torch.zeros(0, batch_size, dtype=torch.long),
        augment[:, columns].transpose(0, 1) if full and augment is not None else None,
        {n: torch.stack([draws[j][n] for j in full]) for n in draws[full[0]]} if full else {},
    )


@dataclass
class _HostCall:
    first: bool
    size: int
    steps: int
    width: int
    # (row, first batch, batches taken): the row's column is its place in this list
    members: list[tuple[int, _Row, int, int]]
    # the members are the rows start..start+width-1, each at every step (no row index needed); None: they
    # are gathered by index
    start: int | None = None
    packed: dict[str, int] = field(default_factory=dict)


def _layout(rows: list[_Row], k: int, batch_size: int, block_steps: int, packer: _Packer, client_major: bool):
    """The calls of one stage (see the module docstring), packed into ``packer``."""
    pos = [0] * k
    calls: list[_HostCall] = []

    def add(first: bool, size: int, steps: int, members: list[tuple[int, _Row, int, int]]) -> None:
        """A call of ``members`` each taking ``steps`` batches of ``size``: a range of rows if they are
        consecutive and either take several steps or start at row 0 (exact width), else gathered by index
        (width rounded by :func:`bucket_width`); see the module docstring."""
        ids = [m[0] for m in members]
        view = ids == list(range(ids[0], ids[0] + len(ids))) and (steps > 1 or ids[0] == 0)
        width = len(ids) if view else bucket_width(len(ids), k)
        calls.append(_HostCall(first, size, steps, width, members, ids[0] if view else None))

    def singles(members: list[int], first: bool) -> None:
        """One step of each of ``members`` (its next batch), one call per batch size."""
        groups: dict[int, list[int]] = {}
        for r in members:
            groups.setdefault(rows[r].batch(pos[r]).idx.shape[0], []).append(r)
        for size, group in groups.items():
            add(first, size, 1, [(r, rows[r], pos[r], 1) for r in group])
            for r in group:
                pos[r] += 1

    singles([r for r in range(k) if pos[r] < len(rows[r].order)], first=True)
    while True:
        active = [r for r in range(k) if rows[r].is_full(pos[r])]
        if active:  # a block, until a row reaches a short batch that is not its last
            start = {r: pos[r] for r in active}
            runs = {r: rows[r].run(pos[r]) for r in active}
            mid_stage = [run for r, run in runs.items() if pos[r] + run < len(rows[r].order) - 1]
            steps = min([block_steps, max(runs.values()), *mid_stage])
            taken = {r: min(run, steps) for r, run in runs.items()}
            for r in active:
                pos[r] += taken[r]
            # cut where a row stops, so that each call's rows all take each of its steps; each piece in
            # powers of two (few distinct lengths)
            done = 0
            for stop in sorted(set(taken.values())):
                members = [r for r in active if taken[r] >= stop]
                for part in split_steps(stop - done, block_steps):
                    add(False, batch_size, part, [(r, rows[r], start[r] + done, part) for r in members])
                    done += part
        waiting = [r for r in range(k) if pos[r] < len(rows[r].order) and not rows[r].is_full(pos[r])]
        if not active and not waiting:
            break
        singles(waiting, first=False)
    full = _FullBatches(rows, batch_size)
    for call in calls:
        _pack(call, k, packer, client_major, full)
    return calls, pos


class _FullBatches:
    """Every row's full batches of a stage, stacked, and a zero batch last (the padding's): a call of
    full batches then gathers its indices, augmentation and draws with one index each."""

    def __init__(self, rows: list[_Row], batch_size: int) -> None:
        counts = [row.full_idx.shape[0] for row in rows]
        self.first = [0, *itertools.accumulate(counts)]  # row r's full batches start at first[r]
        self.pad = self.first[-1]
        with_full = [row for row, n in zip(rows, counts, strict=True) if n]
        self.idx = torch.cat([*(row.full_idx for row in with_full), torch.zeros(1, batch_size, dtype=torch.long)])
        self.augment = None
        if with_full and with_full[0].full_augment is not None:
            self.augment = torch.cat([*(row.full_augment for row in with_full),  # type: ignore[misc]
                                      torch.zeros(1, 3, batch_size, dtype=torch.long)])
        names = with_full[0].full_draws if with_full else {}
        self.draws = {n: torch.cat([*(row.full_draws[n] for row in with_full), torch.zeros_like(d[:1])])
                      for n, d in names.items()}


def _pack(call: _HostCall, k: int, packer: _Packer, client_major: bool, full: _FullBatches) -> None:
    """The call's rows, indices, augmentation and draws as step-major tensors, padded to its width
    with the scratch row ``k`` (sample 0, zero offsets, zero draws). Every member takes each of the
    call's steps: a call of full batches gathers member ``(r, first)``'s batches ``first ..
    first + steps - 1`` from ``full`` (one index per tensor); a call of short batches (one step)
    copies each member's. ``client_major``: the indices and augmentation stored with the column
    before the sample (:class:`Call`)."""
    steps, width, size = call.steps, call.width, call.size
    padding = [k] * (width - len(call.members))
    rows = torch.tensor([[r for r, *_ in call.members] + padding] * steps, dtype=torch.long)
    if size == full.idx.shape[1]:  # full batches: [steps, width] positions in ``full``, the padding at its end
        at = [full.first[r] + row.full_index(first) for r, row, first, _ in call.members]
        grid = torch.tensor([[a + step for a in at] + [full.pad] * len(padding) for step in range(steps)],
                            dtype=torch.long)
        by_column = full.idx[grid]  # [steps, width, size]
        idx = by_column if client_major else by_column.transpose(1, 2)
        augment = None
        if full.augment is not None:
            augment = full.augment[grid].permute(0, 2, 1, 3) if client_major else full.augment[grid].permute(0, 2, 3, 1)
        draws = {n: d[grid] for n, d in full.draws.items()}
    else:  # short batches: one step
        idx = torch.zeros(1, size, width, dtype=torch.long)
        sample = call.members[0][1].batch(call.members[0][2])
        augment = None if sample.augment is None else torch.zeros(1, 3, size, width, dtype=torch.long)
        draws = {n: torch.zeros(1, width, *d.shape, dtype=d.dtype) for n, d in sample.draws.items()}
        for col, (_, row, first, _) in enumerate(call.members):
            b = row.batch(first)
            idx[0, :, col] = b.idx
            if augment is not None:
                augment[0, :, :, col] = b.augment
            for n, d in b.draws.items():
                draws[n][0, col] = d
        if client_major:  # packed in this order on the host, so that no step copies (or gathers by) a transposed index
            idx = idx.transpose(1, 2)
            augment = None if augment is None else augment.transpose(2, 3)
    if call.start is None:
        call.packed["rows"] = packer.add(rows)
    call.packed["idx"] = packer.add(idx)
    if augment is not None:
        call.packed["augment"] = packer.add(augment)
    for n, d in draws.items():
        call.packed[f"draws/{n}"] = packer.add(d)


def _device_call(call: _HostCall, view: Callable[[int], torch.Tensor]) -> Call:
    p = call.packed
    return Call(
        first=call.first, steps=call.steps, width=call.width, size=call.size,
        rows=view(p["rows"]) if "rows" in p else None,
        idx=view(p["idx"]),
        augment=view(p["augment"]) if "augment" in p else None,
        draws={n[len("draws/"):]: view(slot) for n, slot in p.items() if n.startswith("draws/")},
        start=call.start or 0,
    )
