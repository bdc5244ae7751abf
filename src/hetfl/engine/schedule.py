"""Which samples each local step of a client sees, and at which learning rate each round trains."""

from __future__ import annotations

import math

import torch

from hetfl.config import RunConfig
from hetfl.rng import sampled_clients as sampled_clients  # re-exported: the engine's name for it


def batch_schedule(
    n: int, batch_size: int, epochs: int, steps: int, drop_last: bool, generator: torch.Generator
) -> list[torch.Tensor]:
    """Index batches (into a client's own samples) for one stage of local training.

    Epoch mode: ``epochs`` passes over a fresh permutation each. Step mode
    (``steps`` > 0): passes continue until ``steps`` batches were produced.
    ``drop_last`` drops a pass's incomplete final batch, unless the client has
    fewer samples than one batch (then that single batch is kept: a client
    never trains on nothing). The batches of :func:`batch_schedule_flat`, one tensor each.
    """
    flat, sizes = batch_schedule_flat(n, batch_size, epochs, steps, drop_last, generator)
    return list(flat.split(sizes)) if sizes else []


def batch_schedule_flat(
    n: int, batch_size: int, epochs: int, steps: int, drop_last: bool, generator: torch.Generator
) -> tuple[torch.Tensor, list[int]]:
    """Every batch's indices of :func:`batch_schedule`, batch after batch in one tensor, and each batch's
    size: a fresh permutation per pass (drawn whether used or not), cut into batches. One tensor, not one
    a batch: the vectorised executor plans a round's thousands of batches at once (CCVR's 10 epochs: 7,860)."""
    if n == 0:
        return torch.zeros(0, dtype=torch.long), []
    keep_partial = not drop_last or n < batch_size
    per_pass = n // batch_size + (1 if keep_partial and n % batch_size else 0)
    passes = epochs if steps == 0 else math.ceil(steps / per_pass)
    parts: list[torch.Tensor] = []
    sizes: list[int] = []
    for _ in range(passes):
        perm = torch.randperm(n, generator=generator)  # every pass draws its permutation, used or not
        wanted = per_pass if steps == 0 else min(per_pass, steps - len(sizes))
        taken = [min(batch_size, n - i * batch_size) for i in range(wanted)]
        parts.append(perm[: sum(taken)])
        sizes.extend(taken)
    return torch.cat(parts), sizes


def lr_at(cfg: RunConfig, round_: int) -> float:
    """Client learning rate of a 1-based round under the schedule.

    ``cosine`` is PyTorch's ``CosineAnnealingLR`` with ``T_max = rounds`` stepped once per
    round, as in FedUV's code: round r trains at ``lr_min + (lr - lr_min)(1 + cos(pi (r-1) / R)) / 2``,
    so the last round still trains (above ``lr_min``) and ``lr_min`` is where it would go next.
    """
    t = cfg.train
    if t.lr_schedule == "cosine":
        return t.lr_min + (t.lr - t.lr_min) * 0.5 * (1 + math.cos(math.pi * (round_ - 1) / t.rounds))
    return t.lr
