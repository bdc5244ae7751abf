"""Functional SGD over parameter dicts.

Same update as :class:`torch.optim.SGD` (momentum with dampening 0, optional
Nesterov, coupled weight decay), written as a pure function of tensors so that a
client's step can be run for one client or ``vmap``-ed over a round's clients.
``torch.optim.SGD`` itself mutates ``nn.Parameter`` objects in place, which is
what makes it unusable over stacked per-client parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class SGDConfig:
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False


def sgd_init(params: Tensors, cfg: SGDConfig) -> Tensors:
    """Optimiser state: one zero momentum buffer per parameter (none without momentum)."""
    if cfg.momentum == 0.0:
        return {}
    return {name: torch.zeros_like(p) for name, p in params.items()}


def sgd_update(
    params: Tensors, grads: Tensors, state: Tensors, cfg: SGDConfig, first_step: bool
) -> tuple[Tensors, Tensors]:
    """One SGD step; returns new parameters and new optimiser state.

    ``first_step`` reproduces torch.optim.SGD's initialisation of the momentum
    buffer with the first gradient (buf = g rather than buf = momentum * 0 + g,
    which is the same thing with dampening 0, kept explicit for clarity).
    """
    new_params, new_state = {}, {}
    for name, p in params.items():
        g = grads[name]
        if cfg.weight_decay:
            g = g + cfg.weight_decay * p
        if cfg.momentum:
            buf = g if first_step else cfg.momentum * state[name] + g
            new_state[name] = buf
            g = g + cfg.momentum * buf if cfg.nesterov else buf
        new_params[name] = p - cfg.lr * g
    return new_params, new_state
