"""Which samples each local step sees (``hetfl.engine.schedule.batch_schedule``)."""

from __future__ import annotations

import math

import pytest
import torch

from hetfl.engine.schedule import batch_schedule, batch_schedule_flat


def test_epoch_mode_is_one_fresh_permutation_per_epoch_in_batches():
    got = batch_schedule(10, 4, epochs=2, steps=0, drop_last=False, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(1)
    first, second = torch.randperm(10, generator=gen), torch.randperm(10, generator=gen)
    assert [len(b) for b in got] == [4, 4, 2, 4, 4, 2]
    assert torch.equal(torch.cat(got[:3]), first) and torch.equal(torch.cat(got[3:]), second)


@pytest.mark.parametrize(("n", "batch_size", "steps", "drop_last"),
                         [(10, 4, 7, False), (10, 4, 7, True), (3, 4, 5, True), (12, 4, 3, False), (12, 4, 6, False)])
def test_step_mode_batches_are_the_passes_cut_at_the_step_count(n, batch_size, steps, drop_last):
    """``steps`` batches: whole passes over fresh permutations (a pass's incomplete last batch kept
    or dropped), cut after the last step; the generator left where the passes leave it."""
    got_gen, want_gen = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    got = batch_schedule(n, batch_size, epochs=1, steps=steps, drop_last=drop_last, generator=got_gen)
    keep_partial = not drop_last or n < batch_size
    per_pass = n // batch_size + (1 if keep_partial and n % batch_size else 0)
    want = []
    for _ in range(math.ceil(steps / per_pass)):
        perm = torch.randperm(n, generator=want_gen)
        want += [perm[i * batch_size : (i + 1) * batch_size] for i in range(per_pass)]
    assert len(got) == steps
    assert all(torch.equal(a, b) for a, b in zip(got, want[:steps], strict=True))
    assert torch.equal(torch.randperm(n, generator=got_gen), torch.randperm(n, generator=want_gen))


@pytest.mark.parametrize(("n", "batch_size", "epochs", "steps", "drop_last"),
                         [(10, 4, 2, 0, False), (10, 4, 2, 0, True), (3, 4, 3, 0, True), (12, 4, 1, 0, False),
                          (10, 4, 1, 7, False), (10, 4, 1, 7, True), (3, 4, 1, 5, True), (12, 4, 1, 6, False),
                          (0, 4, 2, 0, False), (9517, 64, 10, 0, False)])
def test_the_flat_schedule_is_the_batches_one_after_another(n, batch_size, epochs, steps, drop_last):
    """The vectorised executor's plan reads the schedule flat: the sequential executor's batches, in
    order, with their sizes, and the generator left where they leave it."""
    flat_gen, batches_gen = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    flat, sizes = batch_schedule_flat(n, batch_size, epochs, steps, drop_last, flat_gen)
    batches = batch_schedule(n, batch_size, epochs, steps, drop_last, batches_gen)
    assert sizes == [len(b) for b in batches]
    assert flat.dtype == torch.long and torch.equal(flat, torch.cat(batches) if batches else torch.zeros(0).long())
    assert torch.equal(torch.randint(1 << 30, (4,), generator=flat_gen),
                       torch.randint(1 << 30, (4,), generator=batches_gen))
