"""Functional SGD over parameter dicts.

Same update as :class:`torch.optim.SGD`, to float32 rounding (momentum with dampening 0, optional
Nesterov, coupled weight decay), written as a pure function of tensors so that a
client's step can be run for one client or ``vmap``-ed over a round's clients.
``torch.optim.SGD`` itself mutates ``nn.Parameter`` objects in place, which is
what makes it unusable over stacked per-client parameters. :func:`sgd_update_` is
the same update in place, with multi-tensor kernels, for tensors that already hold
the clients' rows (the vectorised executor's buffers).
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
    which is the same thing with dampening 0, kept explicit for clarity). Weight
    decay and momentum are the operations :class:`torch.optim.SGD` runs (``add``
    with ``alpha``, ``mul`` then ``add``); the step is ``p - g * lr``, two roundings,
    so that a learning rate held in a tensor (:func:`sgd_update_`, the vectorised
    executor's) gives the same values to the last bit; torch.optim.SGD's
    ``p + (-lr) * g`` can differ from it in the last bit.
    """
    new_params, new_state = {}, {}
    for name, p in params.items():
        g = grads[name]
        if cfg.weight_decay:
            g = g.add(p, alpha=cfg.weight_decay)
        if cfg.momentum:
            buf = g if first_step else state[name].mul(cfg.momentum).add_(g)
            new_state[name] = buf
            g = g.add(buf, alpha=cfg.momentum) if cfg.nesterov else buf
        new_params[name] = p.sub(g.mul(cfg.lr))
    return new_params, new_state


def sgd_update_(
    params: list[torch.Tensor], grads: list[torch.Tensor], bufs: list[torch.Tensor], cfg: SGDConfig,
    first_step: bool, lr: float | torch.Tensor | None = None,
) -> None:
    """:func:`sgd_update` in place, on lists of tensors (``bufs``: the momentum buffers, empty
    without momentum), with multi-tensor (``torch._foreach_*``) kernels: a handful of kernel
    launches for all of a model's tensors instead of four per tensor, and each tensor read and
    written once per operation instead of copied into new ones. This is the update the
    vectorised executor applies to its stacked clients (a row per client), where the tensors
    are views of its buffers: the update writes the clients' new parameters where they live.

    ``lr`` (default ``cfg.lr``) may be a 0-dim tensor on the tensors' device: a CUDA graph that
    captured the update then reads the rate when it is replayed, so a schedule that changes it
    every round (cosine) replays the same graph."""
    if not params:
        return
    if cfg.weight_decay:
        grads = torch._foreach_add(grads, params, alpha=cfg.weight_decay)
    step = grads
    if cfg.momentum:
        if first_step:
            torch._foreach_copy_(bufs, grads)
        else:
            torch._foreach_mul_(bufs, cfg.momentum)
            torch._foreach_add_(bufs, grads)
        step = torch._foreach_add(grads, bufs, alpha=cfg.momentum) if cfg.nesterov else bufs
    torch._foreach_sub_(params, torch._foreach_mul(step, cfg.lr if lr is None else lr))
