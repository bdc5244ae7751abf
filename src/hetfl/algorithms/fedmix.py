"""FedMix: Mixup with other clients' averaged data, approximated by a Taylor expansion.

Yoon, Shin, Hwang, Yang. "FedMix: Approximation of Mixup under Mean Augmented
Federated Learning." ICLR 2021. Mean-augmented FL: before training, every
client averages groups of ``mash_size`` of its own samples (inputs and one-hot
labels) and shares these means; the server sends the pooled set to every client
once. Global Mixup with another client's sample ``(x_j, y_j)`` is approximated
to first order in ``lam`` using only a mean ``(x̄_j, ȳ_j)`` (the paper's eq. 7):

    l = (1 - lam) CE(f((1 - lam) x_i), y_i) + lam CE(f((1 - lam) x_i), ȳ_j)
        + lam < d CE(f(u), y_i) / du |_{u = (1 - lam) x_i},  x̄_j >

with a fixed mixing ratio ``lam`` and, per sample i, a mean j drawn uniformly
from the pooled set. The input derivative is taken with ``torch.func.grad``, so
the term is differentiated through (a second-order term, as in the paper) and
composes with ``vmap``; that forward is the step's, so on a model with BatchNorm it
updates the running statistics once a step (on copies inside the transform, put
back after it). The server is FedAvg.

Departures from the paper/code: ``lam = 0.05`` as the paper's main runs;
``mash_size = 5`` is hetfl's default for M_k (the paper varies it; not
confirmed against its tables). The pooled means are sent once, before
training. Other implementations differ in the derivative term's scale, all
equal to first order in lam only up to that scale: Flower's baseline
(``baselines/fedmix``) differentiates ``(1 - lam) CE_mean`` (a factor
``1 - lam``) and mixes one mean per batch; FedBR's code (``FedMix.update``,
the baseline of its Tables 1 and 5) differentiates ``(1 - lam) CE_mean`` and
divides the summed products by B again, a term ``(1 - lam) / B`` of the
paper's (B = 32: 1/36 of it), with B fresh means per step, each of M = 10
samples drawn with replacement from one random client.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.func import grad

from hetfl.algorithms.base import (
    SHARED,
    Algorithm,
    Batch,
    ClientContext,
    ServerState,
    Stage,
    Tensors,
    check_reply_form,
    cross_entropy,
)
from hetfl.params import setting
from hetfl.rng import method_generator

MEAN_X, MEAN_Y = "fedmix.x", "fedmix.y"
PICK = "fedmix.pick"  # per-sample uniform numbers choosing a mean


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of ``-sum_k target_k log softmax(logits)_k``."""
    return -(target * F.log_softmax(logits, dim=1)).sum(dim=1).mean()


def averaged_data(
    x: torch.Tensor, y: torch.Tensor, num_classes: int, group_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Means of disjoint random groups of ``group_size`` samples (the last group may be
    smaller): (inputs [G, ...], soft labels [G, C])."""
    if len(y) == 0:
        return x[:0], torch.zeros(0, num_classes, device=x.device)
    order = torch.randperm(len(y), generator=generator).to(x.device)
    groups = torch.split(order, group_size)
    onehot = F.one_hot(y, num_classes).to(x.dtype)
    return torch.stack([x[g].mean(0) for g in groups]), torch.stack([onehot[g].mean(0) for g in groups])


@dataclass(frozen=True)
class FedMixHyper:
    """FedMix settings (Yoon et al. 2021).

    lam: the fixed mixing ratio lambda of the approximation (small: the
        expansion is first order in lambda; 0.05 in the paper's main runs).
    mash_size: samples averaged into one shared mean (M_k in the paper).
    """

    lam: float = setting(0.05, ge=0.0, lt=1.0, doc="mixing ratio lambda")
    mash_size: int = setting(5, ge=1, doc="samples per shared mean (M_k)")


class FedMix(Algorithm):
    name = "fedmix"
    Hyper = FedMixHyper
    citation = "Yoon et al., ICLR 2021"

    # ------------------------------------------------------------ set-up round
    def setup_query(self, ctx: ClientContext) -> Tensors:
        data = ctx.inputs()
        gen = method_generator(self.setup.seed, "fedmix.mash", ctx.client_id)
        x, y = averaged_data(data.x, data.y, self.setup.num_classes, self.hp.mash_size, gen)
        return {MEAN_X: x, MEAN_Y: y}

    def check_setup_reply(self, client: int, reply: Tensors) -> None:
        """A client's averaged data as :func:`averaged_data` makes it: ``ceil(n / mash_size)`` means of inputs of
        the data's shape and as many soft labels (rows of non-negative shares summing to 1), finite."""
        groups = math.ceil(self.setup.client_sizes[client] / self.hp.mash_size)
        floats = (torch.float32,)
        check_reply_form(reply, {MEAN_X: (groups, *self.setup.input_shape), MEAN_Y: (groups, self.setup.num_classes)},
                         {MEAN_X: floats, MEAN_Y: floats})
        shares = reply[MEAN_Y]
        if bool((shares < 0).any()) or not torch.allclose(shares.sum(1), torch.ones(groups), atol=1e-5):
            raise ValueError(f"{MEAN_Y!r} must hold soft labels: rows of non-negative shares that sum to 1")

    def setup_aggregate(self, server: ServerState, replies: dict[int, Tensors]) -> ServerState:
        ordered = [replies[c] for c in sorted(replies)]
        extra = dict(server.extra)
        extra[SHARED + MEAN_X] = torch.cat([r[MEAN_X] for r in ordered])
        extra[SHARED + MEAN_Y] = torch.cat([r[MEAN_Y] for r in ordered])
        return ServerState(model=server.model, extra=extra)

    # ------------------------------------------------------------ local steps
    def loss(self, state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        lam = self.hp.lam
        means_x, means_y = ctx.shared[MEAN_X], ctx.shared[MEAN_Y]
        pick = (batch.draws[PICK] * len(means_y)).long().clamp(max=len(means_y) - 1)
        x_bar, y_bar = means_x[pick], means_y[pick]
        scaled = (1 - lam) * batch.x

        buffers = self.model.buffer_names

        def own_loss(inputs: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, Tensors]]:
            # the step's forward: BatchNorm updates its running statistics in place, which torch.func.grad
            # allows only on tensors made inside it, so on copies, put back below
            stats = {name: state[name].clone() for name in buffers}
            logits = self.model.logits({**state, **stats}, inputs)
            return F.cross_entropy(logits, batch.y, reduction="sum"), (logits, stats)

        input_grad, (logits, stats) = grad(own_loss, has_aux=True)(scaled)
        for name, value in stats.items():  # the running statistics updated once, as a plain step's forward
            state[name].copy_(value)
        ce_own = cross_entropy(logits, batch.y)
        ce_mean = soft_cross_entropy(logits, y_bar)
        taylor = (input_grad * x_bar).flatten(1).sum(1).mean()
        loss = (1 - lam) * ce_own + lam * ce_mean + lam * taylor
        return loss, {"ce": ce_own.detach(), "ce_mean": ce_mean.detach(), "taylor": taylor.detach()}

    def stages(self, ctx: ClientContext) -> list[Stage]:
        def draw(generator: torch.Generator, batch_size: int) -> Tensors:
            return {PICK: torch.rand(batch_size, generator=generator)}

        return [dataclasses.replace(stage, draws=draw) for stage in super().stages(ctx)]
