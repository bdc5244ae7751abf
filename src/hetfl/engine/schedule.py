"""Which samples each local step of a client sees."""

from __future__ import annotations

import math

import torch


def batch_schedule(
    n: int, batch_size: int, epochs: int, steps: int, drop_last: bool, generator: torch.Generator
) -> list[torch.Tensor]:
    """Index batches (into a client's own samples) for one stage of local training.

    Epoch mode: ``epochs`` passes over a fresh permutation each. Step mode
    (``steps`` > 0): passes continue until ``steps`` batches were produced.
    ``drop_last`` drops a pass's incomplete final batch, unless the client has
    fewer samples than one batch (then that single batch is kept: a client
    never trains on nothing).
    """
    if n == 0:
        return []
    keep_partial = not drop_last or n < batch_size
    per_pass = n // batch_size + (1 if keep_partial and n % batch_size else 0)
    passes = epochs if steps == 0 else math.ceil(steps / per_pass)
    batches: list[torch.Tensor] = []
    for _ in range(passes):
        perm = torch.randperm(n, generator=generator)
        batches.extend(perm[i * batch_size : (i + 1) * batch_size] for i in range(per_pass))
    return batches[:steps] if steps else batches
