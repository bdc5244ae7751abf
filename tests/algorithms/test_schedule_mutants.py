"""The learning rate of each round (``lr_at``) and the clients of each round (``sampled_clients``), checked
against hand-computed values: every method's local training reads both, so a wrong cosine or a wrong draw
changes every number a run reports."""

from __future__ import annotations

import math

import pytest

from hetfl.config import load
from hetfl.engine.schedule import batch_schedule, lr_at, sampled_clients
from hetfl.rng import numpy_generator


def cosine_cfg(lr: float, lr_min: float, rounds: int):
    return load(overrides=["train.lr_schedule=cosine", f"train.lr={lr}", f"train.lr_min={lr_min}",
                           f"train.rounds={rounds}"])


def test_constant_schedule_trains_every_round_at_lr():
    cfg = load(overrides=["train.lr=0.03", "train.rounds=5", "train.lr_min=0.01"])
    assert [lr_at(cfg, r) for r in range(1, 6)] == [0.03] * 5


def test_cosine_is_torch_cosine_annealing_stepped_once_per_round():
    """Round r of R trains at lr_min + (lr - lr_min)(1 + cos(pi (r - 1) / R)) / 2 (PyTorch's
    CosineAnnealingLR, T_max = R): round 1 at lr, the middle round halfway, the last above lr_min."""
    cfg = cosine_cfg(0.1, 0.02, 4)
    got = [lr_at(cfg, r) for r in range(1, 5)]
    # by hand: cos(0) = 1, cos(pi/4) = sqrt(2)/2, cos(pi/2) = 0, cos(3 pi/4) = -sqrt(2)/2
    want = [0.1, 0.02 + 0.08 * (1 + math.sqrt(0.5)) / 2, 0.06, 0.02 + 0.08 * (1 - math.sqrt(0.5)) / 2]
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert got[-1] > 0.02


def test_cosine_matches_torch_scheduler():
    torch = pytest.importorskip("torch")
    cfg = cosine_cfg(0.05, 0.001, 7)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=7, eta_min=0.001)
    want = []
    for _ in range(7):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert [lr_at(cfg, r) for r in range(1, 8)] == pytest.approx(want, rel=1e-12, abs=0)


@pytest.mark.parametrize(("num_clients", "per_round"), [(5, 0), (5, 5), (5, 9)])
def test_every_client_trains_when_per_round_is_zero_or_covers_them_all(num_clients, per_round):
    assert sampled_clients(3, 2, num_clients, per_round) == list(range(num_clients))


def test_a_sampled_round_is_its_own_streams_draw_without_replacement_sorted():
    rng = numpy_generator(11, "sample", 4)
    want = sorted(int(c) for c in rng.choice(10, size=4, replace=False))
    got = sampled_clients(11, 4, 10, 4)
    assert got == want and len(set(got)) == 4 and all(type(c) is int for c in got)
    assert got == sorted(got)
    # another round or seed draws from another stream
    draws = {tuple(sampled_clients(11, r, 10, 4)) for r in range(1, 9)}
    assert len(draws) > 1


def test_per_round_one_less_than_all_still_samples():
    """per_round = num_clients - 1 is a draw (one client left out), not everyone."""
    got = sampled_clients(0, 1, 6, 5)
    assert len(got) == 5 and len(set(got)) == 5 and set(got) < set(range(6))


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("steps", [0, 3])
def test_a_client_of_one_sample_trains_on_it_every_step(drop_last, steps):
    """A single sample is a batch of one each pass (never an empty schedule), with or without drop_last."""
    import torch

    got = batch_schedule(1, 4, epochs=2, steps=steps, drop_last=drop_last, generator=torch.Generator().manual_seed(0))
    assert [b.tolist() for b in got] == [[0]] * (steps or 2)
