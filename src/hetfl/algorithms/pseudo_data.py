"""Pseudo-data by random sample means (RSM), FedBR's pseudo dataset ``D_p``.

Guo, Tang, Lin, ICML 2023, sec. 4.3: one pseudo sample is the mean of ``K``
random samples (K = 10), with the uniform soft label ``1/C``. The authors' code
(LINs-lab/FedBR, ``fedbr/scripts/train_fed.py``) builds ``B`` of them once:

- ``get_augmentation_mean_data`` (RSM over the clients' data, the default of
  the code): for each pseudo sample, a client chosen uniformly at random, then
  ``K`` indices into that client's samples drawn with replacement;
- ``get_augmentation_proxy_data`` (the proxy data of "Mixture"): ``K`` indices
  drawn with replacement from a proxy dataset.

:func:`draw_plan` makes exactly the draws of the first, in the same order, from
one generator; it needs only the clients' sizes, so in a federation every
client can replay the plan from a seed they share and compute, from its own
data only, the pseudo samples assigned to it (:func:`plan_means`); the server
puts them in plan order (:func:`assemble`). :func:`proxy_means` is the second.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Slot:
    """One pseudo sample of a plan: the mean of ``indices`` of client ``client``'s samples."""

    client: int
    indices: torch.Tensor  # int64 [K], into the client's own samples


def draw_plan(sizes: Sequence[int], count: int, size: int, generator: torch.Generator) -> list[Slot]:
    """``count`` slots: per slot a group drawn uniformly among the non-empty ones of ``sizes``
    (one ``randint``), then ``size`` indices into it with replacement (one ``randint``): the
    draws of the authors' ``get_augmentation_mean_data`` when every group is non-empty."""
    groups = [g for g, n in enumerate(sizes) if n > 0]
    if not groups:
        raise ValueError("random sample means need at least one non-empty group of samples")
    plan = []
    for _ in range(count):
        group = groups[int(torch.randint(0, len(groups), (1,), generator=generator))]
        plan.append(Slot(group, torch.randint(0, sizes[group], (size,), generator=generator)))
    return plan


def plan_means(plan: Sequence[Slot], client: int, x: torch.Tensor) -> torch.Tensor:
    """The means of the slots of ``plan`` that belong to ``client``, in plan order
    (``[n, ...]``, n possibly 0), from the client's own samples ``x``."""
    rows = [x[slot.indices.to(x.device)].mean(0) for slot in plan if slot.client == client]
    return torch.stack(rows) if rows else x[:0]


def assemble(plan: Sequence[Slot], means: dict[int, torch.Tensor]) -> torch.Tensor:
    """The pseudo dataset in plan order from each client's :func:`plan_means`."""
    counts = {client: sum(slot.client == client for slot in plan) for client in {*means, *(s.client for s in plan)}}
    for client, count in counts.items():
        sent = len(means[client]) if client in means else 0
        if sent != count:
            raise ValueError(f"client {client} sent {sent} pseudo samples; the plan assigns {count}")
    taken = dict.fromkeys(means, 0)
    rows = []
    for slot in plan:
        rows.append(means[slot.client][taken[slot.client]])
        taken[slot.client] += 1
    return torch.stack(rows)


def proxy_means(
    x: torch.Tensor,
    count: int,
    size: int,
    generator: torch.Generator,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``count`` means of ``size`` samples of ``x`` drawn with replacement (one ``randint`` each):
    the authors' ``get_augmentation_proxy_data``. ``transform`` (uint8 images -> normalised
    floats) is applied to the drawn samples before averaging, as the code's data transform."""
    picks = torch.stack([torch.randint(0, len(x), (size,), generator=generator) for _ in range(count)])
    chosen = x[picks.flatten().to(x.device)]
    if transform is not None:
        chosen = transform(chosen)
    return chosen.view(count, size, *chosen.shape[1:]).mean(1)
