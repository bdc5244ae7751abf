"""Mixup as a local-training baseline ("FedAvg + Mixup" in FedBR's Table 1).

Zhang, Cisse, Dauphin, Lopez-Paz. "mixup: Beyond Empirical Risk Minimization."
ICLR 2018, eq. (1): each step trains on ``x~ = lam x_i + (1 - lam) x_j`` with the
loss ``lam CE(f(x~), y_i) + (1 - lam) CE(f(x~), y_j)``, ``lam ~ Beta(alpha, alpha)``
drawn once per batch and ``j`` a random permutation of the batch. The server is
FedAvg. The draws come from the client's own random stream (``Stage.draws``),
so a run is deterministic and the vectorised executor can precompute them.

Departures from the paper/code: none in the rule; one lambda per batch (the
paper's implementation), alpha 1.0 (its CIFAR-10 setting).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from hetfl.algorithms.base import Algorithm, Batch, ClientContext, DrawFn, Stage, Tensors, cross_entropy
from hetfl.params import setting

PERM, LAM = "mixup.perm", "mixup.lam"


def mixup_draws(alpha: float) -> DrawFn:
    """Per-batch draws of Mixup: a permutation of the batch and ``lam ~ Beta(alpha, alpha)``."""

    def draw(generator: torch.Generator, batch_size: int) -> Tensors:
        perm = torch.randperm(batch_size, generator=generator)
        beta_seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        lam = np.random.default_rng(beta_seed).beta(alpha, alpha)
        return {PERM: perm, LAM: torch.tensor(float(lam))}

    return draw


def mix_inputs(batch: Batch) -> torch.Tensor:
    """``lam x + (1 - lam) x[perm]`` for the batch's draws."""
    lam, perm = batch.draws[LAM], batch.draws[PERM]
    return lam * batch.x + (1 - lam) * batch.x[perm]


def mixup_cross_entropy(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``lam CE(logits, y) + (1 - lam) CE(logits, y[perm])`` (Zhang et al. 2018, eq. 1)."""
    lam, perm = batch.draws[LAM], batch.draws[PERM]
    return lam * cross_entropy(logits, batch.y) + (1 - lam) * cross_entropy(logits, batch.y[perm])


@dataclass(frozen=True)
class MixupHyper:
    """Mixup settings (Zhang et al. 2018).

    alpha: the Beta(alpha, alpha) parameter of the mixing weight; 1.0 (uniform) is
        the paper's CIFAR-10 setting.
    """

    alpha: float = setting(1.0, gt=0.0, doc="Beta(alpha, alpha) of the mixing weight")


class Mixup(Algorithm):
    name = "mixup"
    Hyper = MixupHyper
    citation = "Zhang et al., ICLR 2018 (as a FedAvg baseline in Guo et al., ICML 2023)"

    def loss(self, state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        logits = self.model.logits(state, mix_inputs(batch))
        loss = mixup_cross_entropy(logits, batch)
        return loss, {"ce": loss.detach()}

    def stages(self, ctx: ClientContext) -> list[Stage]:
        return [dataclasses.replace(stage, draws=mixup_draws(self.hp.alpha)) for stage in super().stages(ctx)]
