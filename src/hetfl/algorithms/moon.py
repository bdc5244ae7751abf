"""MOON: model-contrastive federated learning.

Li, He, Song. "Model-Contrastive Federated Learning." CVPR 2021, eq. (2)-(3):
``ℓ_con = -log( exp(sim(z, z_glob)/τ) / (exp(sim(z, z_glob)/τ) + exp(sim(z, z_prev)/τ)) )``
with z the projection-head output (the classifier input of hetfl's models with
a projector), z_glob from the received global model, z_prev from the
client's own model of its previous round; the local loss is ``CE + μ ℓ_con``.

The previous local model lives in the client store. In a client's first round
it has none, and the contrastive term is zero (so is the reference code's in
round 1: its pool of previous models is empty, the logits hold the positive pair
alone, and their cross-entropy is 0; in a later round the code's negative for a
client never sampled is that client's own untrained initial network). ``begin``
hands the step its previous model and a flag (1 with one, 0 in the first
round: the received model stands in, and the term, weighted by the flag, adds
exactly nothing), so that a sampled round's first-timers and returning clients
run the same step: the vectorised executor trains them as one group.

Departures from the paper/code: ``mu = 1`` is the authors' code default
(``--mu 1``) and their CIFAR-100 / Tiny-ImageNet value; their CIFAR-10 runs
(the README's example, and the paper's CIFAR-10 setting) use ``mu = 5``: set
``algorithm.mu = 5`` there.
Temperature 0.5 and one previous model (``model_buffer_size = 1``) as the code.
The global and previous models give their representations in eval mode, as in the
code (``global_model.eval()``, ``net.eval()`` for the pool of previous models; the
paper does not say): BatchNorm normalises by each reference model's own running
statistics, while the local model trains on the batch's; dropout is off in them.
``reference_mode = "train"`` runs them in the local model's (training) mode instead
(hetfl's behaviour before this was checked against the code, 2026-11-28; a run written
before then is read with it: ``setting(former=...)``). Models without
BatchNorm or dropout (MOON's simple CNN) give the same numbers either way.
The first-round term is 0 here and in the code. The authors' local optimiser (SGD lr
0.01, momentum 0.9, weight decay 1e-5, batch 64, 10 epochs) is the run's
``train.*``, not fixed by the method.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetfl.algorithms.base import Algorithm, Batch, ClientContext, Tensors, cross_entropy
from hetfl.params import setting

PREV = "moon.prev/"
HAS_PREV = "moon.has_prev"  # 1.0 where the client has a previous model, else 0.0


def model_contrastive_loss(
    z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, temperature: float
) -> torch.Tensor:
    """MOON's ℓ_con (eq. 2), averaged over the batch: cross-entropy with the
    global model's representation as the positive and the previous one as the negative."""
    positive = F.cosine_similarity(z, z_glob, dim=-1)
    negative = F.cosine_similarity(z, z_prev, dim=-1)
    logits = torch.stack([positive, negative], dim=1) / temperature
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


@dataclass(frozen=True)
class MoonHyper:
    """MOON settings (Li et al. 2021).

    mu: weight of the model-contrastive loss (CCVR: 5 at α=0.05, else 1; FedUV: 1).
    temperature: τ (0.5 in the paper).
    reference_mode: the mode of the global and previous models when they give z_glob and z_prev:
        "eval" (the authors' code: BatchNorm by their running statistics) or "train" (by the batch's).
    """

    mu: float = setting(1.0, ge=0.0, doc="contrastive weight mu")
    temperature: float = setting(0.5, gt=0.0, doc="temperature tau")
    reference_mode: str = setting("eval", choices=("eval", "train"), former="train",
                                  doc="mode of the global and previous models (eval: the authors' code)")


class Moon(Algorithm):
    name = "moon"
    Hyper = MoonHyper
    citation = "Li et al., CVPR 2021"

    step_reads = frozenset({"payload"})  # the previous model comes through the extras (begin)

    def begin(self, ctx: ClientContext) -> Tensors:
        """The previous local model and whether there is one; in a client's first round the received
        model stands in, with the flag 0."""
        source, prefix = (ctx.state, PREV) if ctx.state else (ctx.payload, "")
        previous = {PREV + n: source[prefix + n] for n in self.model.state_names}
        device = next(iter(previous.values())).device
        return {**previous, HAS_PREV: torch.tensor(float(bool(ctx.state)), device=device)}

    def loss(self, state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        z, logits = self.model.features_and_logits(state, batch.x)
        ce = cross_entropy(logits, batch.y)
        eval_mode = self.hp.reference_mode == "eval"
        z_glob = self.model.reference_features(ctx.payload, batch.x, eval_mode)
        previous = {n: ctx.extras[PREV + n] for n in self.model.state_names}
        z_prev = self.model.reference_features(previous, batch.x, eval_mode)
        # weighted by the flag: 0 x the term in a first round, nothing added to the loss or its gradient
        con = ctx.extras[HAS_PREV] * model_contrastive_loss(z, z_glob, z_prev, self.hp.temperature)
        return ce + self.hp.mu * con, {"ce": ce.detach(), "contrastive": con.detach()}

    def finish(self, ctx: ClientContext, local: Tensors, steps: int) -> tuple[Tensors, Tensors]:
        model = {n: local[n] for n in self.model.state_names}
        return model, {PREV + n: t for n, t in model.items()}
