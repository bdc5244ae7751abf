"""What travels between the server and the clients of a round, and how its size is counted."""

from __future__ import annotations

import dataclasses

from hetfl.algorithms.base import Tensors


def nbytes(tensors: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@dataclasses.dataclass
class ClientUpdate:
    """What the server receives from one client after its local round (``Algorithm.finish``'s
    upload and the numbers the round's metrics need: the loss and the parts of it the method's loss
    returns, ``{"ce": ..., "penalty": ...}``, each summed over the local steps)."""

    client_id: int
    upload: Tensors
    num_samples: int
    steps: int
    loss_sum: float
    part_sums: dict[str, float] = dataclasses.field(default_factory=dict)
