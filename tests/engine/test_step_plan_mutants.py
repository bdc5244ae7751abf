"""A vectorised round's plan replayed call by call (session 38, mutation testing of hetfl.engine.step_plan):
each client's steps are, in order, the batches, augmentation and per-step draws the sequential executor draws
from the same generators; padding columns point at the scratch row with zero entries; the layout by hand."""

from __future__ import annotations

import itertools

import pytest
import torch

from hetfl.algorithms.base import MethodError, Stage
from hetfl.engine.schedule import batch_schedule
from hetfl.engine.step_plan import BLOCK_STEPS, Call, bucket_width, plan_round, split_steps
from hetfl.optim import SGDConfig

CPU = torch.device("cpu")


def _draws(g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    return {"u": torch.rand(n, generator=g), "v": torch.randint(0, 9, (2,), generator=g)}


def _augment(sizes: list[int], g: torch.Generator) -> torch.Tensor | None:
    return torch.randint(1, 50, (3, sum(sizes)), generator=g) if sizes else None


def _gens(tag: int, k: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(1000 * tag + r) for r in range(k)]


def _global(c: int, idx: torch.Tensor) -> torch.Tensor:
    return idx * 100 + c + 1  # never 0: a padding entry is sample 0


def _reference(stages, clients, sizes, batch_size, drop_last, augment, draws):
    """Per row, every stage's batches as the sequential executor draws them: (first, idx, augment, draws)."""
    k = len(clients)
    bg, ag, dg = _gens(1, k), _gens(2, k), _gens(3, k)
    out = []
    for stage in stages:
        per_row = []
        for r in range(k):
            # local.run_stages' order: the stage's schedule, its augmentation (FederatedData.train_batches:
            # one stage_augment), then a step's draws before each step
            schedule = batch_schedule(sizes[r], batch_size, stage.epochs, stage.steps, drop_last, bg[r])
            batches = [len(b) for b in schedule]
            aug = _augment(batches, ag[r]) if augment else None
            seq, a = [], 0
            for j, b in enumerate(schedule):
                d = _draws(dg[r], len(b)) if draws else {}
                seq.append((j == 0, _global(clients[r], b), None if aug is None else aug[:, a:a + len(b)], d))
                a += len(b)
            per_row.append(seq)
        out.append(per_row)
    return out


def _replay(plan, k: int, client_major: bool, ordered: bool = True):
    out = []
    for sp in plan:
        per_row: list[list] = [[] for _ in range(k)]
        for call in sp.calls:
            assert call.idx.shape == ((call.steps, call.width, call.size) if client_major
                                      else (call.steps, call.size, call.width))
            # what a step indexes with is int64 (a float index cannot gather), the draws keep their own dtype
            assert call.idx.dtype == torch.long and (call.rows is None or call.rows.dtype == torch.long)
            assert call.augment is None or call.augment.dtype == torch.long
            assert call.augment is None or call.augment.shape == (
                (call.steps, 3, call.width, call.size) if client_major else (call.steps, 3, call.size, call.width))
            assert all(t.shape[:2] == (call.steps, call.width) for t in call.draws.values())
            assert {n: t.dtype for n, t in call.draws.items()} == ({"u": torch.float32, "v": torch.long}
                                                                   if call.draws else {})
            if call.rows is None:
                assert call.start + call.width <= k
            else:
                assert call.rows.shape == (call.steps, call.width)
                assert call.steps == 1 or not ordered  # clients largest first: only single steps are gathered
                # rows that are one run and take several steps are read as views, never gathered
                members = [int(r) for r in call.rows[0] if r < k]
                assert call.steps == 1 or members != list(range(members[0], members[0] + len(members)))
            for s, col in itertools.product(range(call.steps), range(call.width)):
                row = call.start + col if call.rows is None else int(call.rows[s, col])
                idx = call.idx[s, col] if client_major else call.idx[s, :, col]
                aug = None if call.augment is None else (call.augment[s, :, col] if client_major
                                                         else call.augment[s, :, :, col])
                d = {n: t[s, col] for n, t in call.draws.items()}
                if row == k:  # padding: sample 0, no offset, no draw
                    assert not idx.any() and (aug is None or not aug.any()) and not any(t.any() for t in d.values())
                    continue
                per_row[row].append((call.first, idx, aug, d))
        assert sp.steps == [len(seq) for seq in per_row]
        out.append(per_row)
    return out


def _same(got, want) -> None:
    for stage_got, stage_want in zip(got, want, strict=True):
        for row_got, row_want in zip(stage_got, stage_want, strict=True):
            assert len(row_got) == len(row_want)
            for (f1, i1, a1, d1), (f2, i2, a2, d2) in zip(row_got, row_want, strict=True):
                assert f1 == f2 and torch.equal(i1, i2)
                assert (a1 is None) == (a2 is None) and (a1 is None or torch.equal(a1, a2))
                assert d1.keys() == d2.keys() and all(torch.equal(d1[n], d2[n]) for n in d1)


CASES = [  # sizes (largest first, as the executor orders them), batch size, drop_last, stages (epochs, steps)
    ([23, 17, 9, 4, 0], 4, False, [(1, 0)]),
    ([23, 17, 9, 4, 3], 4, False, [(3, 0), (0, 5)]),
    ([40, 40, 21, 8, 7, 2], 5, True, [(2, 0)]),
    ([12, 9], 3, False, [(0, 7), (1, 0)]),
    ([30, 29, 28, 27, 26, 25, 24, 6, 5], 4, False, [(2, 0)]),
    ([5, 5, 5], 8, True, [(1, 0)]),
    # not largest first (the executor sorts; the layout does not rely on it): blocks of rows that start past row 0
    ([4, 17, 9, 23], 4, False, [(2, 0)]),
    ([9, 3, 2], 4, False, [(1, 0)]),  # one row alone has full batches
    # five rows of twelve take short batches of 2 (the others of 1): a gathered call of width 6, one padding column
    ([41] * 7 + [14] * 5, 4, False, [(1, 0)]),
    # row 0's first batch short (not largest first): rows 1-4 and 8's first, full, batches gathered, padded to 6
    ([3, 17, 17, 17, 17, 2, 2, 2, 9], 4, False, [(1, 0)]),
]
PADDED = {len(CASES) - 2, len(CASES) - 1}  # the cases with a gathered call wider than its rows


@pytest.mark.parametrize("client_major", [False, True], ids=["sample_major", "client_major"])
@pytest.mark.parametrize(("augment", "draws"), [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("block_steps", [1, 3, BLOCK_STEPS, 16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_plan_replays_the_sequential_draws_row_by_row(case, block_steps, augment, draws, client_major):
    sizes, batch_size, drop_last, stage_spec = CASES[case]
    clients = [7 * r + 2 for r in range(len(sizes))]
    stages = [Stage(f"s{i}", loss=None, trainable=(), sgd=SGDConfig(lr=0.1), epochs=e, steps=s,
                    draws=_draws if draws else None) for i, (e, s) in enumerate(stage_spec)]
    k = len(sizes)
    plan = plan_round(stages, clients, sizes, batch_size=batch_size, drop_last=drop_last,
                      batch_gens=_gens(1, k), augment_gens=_gens(2, k), draw_gens=_gens(3, k),
                      stage_augment=_augment if augment else (lambda s, g: None), global_indices=_global,
                      device=CPU, block_steps=block_steps, client_major=client_major)
    ordered = sizes == sorted(sizes, reverse=True)
    _same(_replay(plan, k, client_major, ordered),
          _reference(stages, clients, sizes, batch_size, drop_last, augment, draws))
    padded = False
    for sp in plan:
        assert all(c.steps <= block_steps for c in sp.calls)
        for c in sp.calls:
            if c.rows is not None:  # gathered: the members, then the scratch row up to the rounded width
                members = int((c.rows[0] < k).sum())
                assert c.width == bucket_width(members, k) and (c.rows[0, members:] == k).all()
                padded |= c.width > members
    assert padded == (case in PADDED)


def test_a_one_epoch_layout_by_hand():
    """Sizes 9, 6, 2 with batch 2: full batches 4, 3, 1 and short 1, 0, 0. First step all three at once;
    then a block while rows take full batches: rows 0 and 1 take 2 full (row 2 has none left, row 1's
    3rd is its last batch: no short batch cuts the block), then row 0's last full batch, then its short batch,
    a single step at row 0 (a view)."""
    stage = Stage("s", loss=None, trainable=(), sgd=SGDConfig(lr=0.1))
    plan = plan_round([stage], [0, 1, 2], [9, 6, 2], batch_size=2, drop_last=False,
                      batch_gens=_gens(1, 3), augment_gens=_gens(2, 3), draw_gens=_gens(3, 3),
                      stage_augment=lambda s, g: None, global_indices=_global, device=CPU)
    (sp,) = plan
    assert sp.steps == [5, 3, 1]
    got = [(c.first, c.steps, c.width, c.size, c.start, None if c.rows is None else c.rows.tolist())
           for c in sp.calls]
    assert got == [(True, 1, 3, 2, 0, None),  # everyone's first batch, one view of rows 0..2
                   (False, 2, 2, 2, 0, None),  # rows 0, 1: two full batches each, rows 0..1 viewed
                   (False, 1, 1, 2, 0, None),  # row 0: its last full batch
                   (False, 1, 1, 1, 0, None)]  # row 0's short batch: a single step at row 0, viewed


def test_a_block_runs_on_past_a_short_batch_that_is_a_rows_last():
    """Sizes 9 and 5 with batch 2: row 0 takes 4 full batches and a short one, row 1 2 full and a short one.
    After the first step, row 1's short batch is its last, so it does not end the block: the block runs until
    row 0's short batch (3 steps: both rows 1, row 0 alone 2 more), and both short batches are one call, a
    view at row 0. Ending the block at row 1's short batch would take row 1's short batch alone, gathered."""
    stage = Stage("s", loss=None, trainable=(), sgd=SGDConfig(lr=0.1))
    (sp,) = plan_round([stage], [0, 1], [9, 5], batch_size=2, drop_last=False, batch_gens=_gens(1, 2),
                       augment_gens=_gens(2, 2), draw_gens=_gens(3, 2), stage_augment=lambda s, g: None,
                       global_indices=_global, device=CPU)
    assert sp.steps == [5, 3]
    got = [(c.first, c.steps, c.width, c.size, c.start, c.rows) for c in sp.calls]
    assert got == [(True, 1, 2, 2, 0, None), (False, 1, 2, 2, 0, None), (False, 2, 1, 2, 0, None),
                   (False, 1, 2, 1, 0, None)]


def test_a_short_batch_before_a_rows_last_ends_the_block():
    """A stage of 4 steps, sizes 16 and 9 with batch 4: row 0 takes 4 full batches, row 1 full, full, short
    (its epoch's end), full. Row 1's short batch is not its last, so the block ends there: one step of both,
    row 1's short batch alone (gathered: it is not at row 0), then both again for one step, row 0 its last."""
    stage = Stage("s", loss=None, trainable=(), sgd=SGDConfig(lr=0.1), epochs=0, steps=4)
    (sp,) = plan_round([stage], [0, 1], [16, 9], batch_size=4, drop_last=False, batch_gens=_gens(1, 2),
                       augment_gens=_gens(2, 2), draw_gens=_gens(3, 2), stage_augment=lambda s, g: None,
                       global_indices=_global, device=CPU)
    assert sp.steps == [4, 4]
    got = [(c.first, c.steps, c.width, c.size, c.start, None if c.rows is None else c.rows.tolist())
           for c in sp.calls]
    assert got == [(True, 1, 2, 4, 0, None), (False, 1, 2, 4, 0, None), (False, 1, 1, 1, 0, [[1]]),
                   (False, 1, 2, 4, 0, None), (False, 1, 1, 4, 0, None)]


def test_blocks_are_as_long_as_the_graph_steps_allow():
    """One client, 20 full batches of 2: its first step, then blocks of at most ``block_steps`` steps, each cut
    into powers of two no longer than ``block_steps`` (16 + 2 + 1 with 16; 4 + 4 + 4 + 4 + 2 + 1 by default).
    The plan is sample-major unless asked: ``idx`` ``[steps, size, width]``."""
    stage = Stage("s", loss=None, trainable=(), sgd=SGDConfig(lr=0.1))

    def steps(**kwargs) -> list[int]:
        (sp,) = plan_round([stage], [0], [40], batch_size=2, drop_last=False, batch_gens=_gens(1, 1),
                           augment_gens=_gens(2, 1), draw_gens=_gens(3, 1), stage_augment=lambda s, g: None,
                           global_indices=_global, device=CPU, **kwargs)
        assert all(c.idx.shape == (c.steps, 2, 1) for c in sp.calls)
        return [c.steps for c in sp.calls]

    assert steps(block_steps=16) == [1, 16, 2, 1]
    assert steps() == [1, 4, 4, 4, 4, 2, 1]


def test_a_calls_shape_holds_where_its_view_starts_and_not_a_gathered_calls_start():
    """``Call.shape``, what a compiled call is keyed on: a view of rows reads fixed addresses, so where it starts
    is part of it; a gathered call reads its rows by index, so its ``start`` (unused, 0) is not."""
    idx = torch.zeros(1, 2, 3, dtype=torch.long)
    view = Call(False, 1, 3, 2, None, idx, None, start=2)
    gathered = Call(False, 1, 3, 2, torch.tensor([[0, 4, 5]]), idx, None)
    assert view.shape() == (False, 1, 3, 2, 2)
    assert gathered.shape() == (False, 1, 3, 2, None)


def test_a_stages_draws_that_are_no_tensors_are_refused_naming_the_stage():
    stage = Stage("warmup", loss=None, trainable=(), sgd=SGDConfig(lr=0.1), draws=lambda g, n: [1, 2])
    with pytest.raises(MethodError) as refused:
        plan_round([stage], [0], [5], batch_size=2, drop_last=False, batch_gens=_gens(1, 1),
                   augment_gens=_gens(2, 1), draw_gens=_gens(3, 1), stage_augment=lambda s, g: None,
                   global_indices=_global, device=CPU)
    assert str(refused.value) == ("stage 'warmup' of ?: its draws must return a dict of name -> tensor; "
                                  "it returned a list")


def test_split_steps_and_bucket_width_by_hand():
    assert split_steps(13, 16) == [8, 4, 1] and split_steps(13) == [4, 4, 4, 1] and split_steps(0) == []
    assert split_steps(6, 3) == [3, 2, 1] and split_steps(1, 1) == [1]
    assert [bucket_width(w, 100) for w in (1, 4, 5, 13, 14, 100)] == [1, 4, 13, 13, 26, 100]
    assert [bucket_width(w, 9) for w in (5, 6, 9)] == [6, 6, 9] and bucket_width(7, 7) == 7
    assert bucket_width(5, 5) == 5 and bucket_width(6, 8) == 6 and bucket_width(5, 8) == 5 and bucket_width(7, 8) == 7


def test_the_whole_plan_is_moved_to_the_device_in_its_layout():
    """A step reads device tensors only (issue 29, item 1): every tensor of every call is on the run's device,
    in the shapes and dtypes of the plan made on the CPU. On the ``meta`` device, so that a tensor left on the
    host (a copy's device dropped) shows without a GPU."""
    sizes, batch_size, drop_last, stage_spec = CASES[1]
    clients = [7 * r + 2 for r in range(len(sizes))]
    stages = [Stage(f"s{i}", loss=None, trainable=(), sgd=SGDConfig(lr=0.1), epochs=e, steps=s, draws=_draws)
              for i, (e, s) in enumerate(stage_spec)]
    k = len(sizes)

    def plan(device: torch.device):
        return plan_round(stages, clients, sizes, batch_size=batch_size, drop_last=drop_last,
                          batch_gens=_gens(1, k), augment_gens=_gens(2, k), draw_gens=_gens(3, k),
                          stage_augment=_augment, global_indices=_global, device=device)

    def layout(stage_plans):
        return [[(c.first, c.steps, c.width, c.size, c.start,
                  {n: (t.device.type, t.dtype, tuple(t.shape))
                   for n, t in (("rows", c.rows), ("idx", c.idx), ("augment", c.augment), *c.draws.items())
                   if t is not None}) for c in sp.calls] for sp in stage_plans]

    on_cpu, on_meta = layout(plan(CPU)), layout(plan(torch.device("meta")))
    assert any(c[5].keys() >= {"rows", "idx", "augment", "u", "v"} for calls in on_cpu for c in calls)
    assert on_meta == [[(*c[:5], {n: ("meta", *what[1:]) for n, what in c[5].items()}) for c in calls]
                       for calls in on_cpu]
