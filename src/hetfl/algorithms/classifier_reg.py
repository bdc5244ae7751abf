"""Classifier regularisation during training: CCVR's side study (Luo et al. 2021, sec. 3.3).

- ``clsnorm``: the classifier's weight vectors are L2-normalised in the forward
  pass, in training and at inference:
  ``g(z)_i = softmax_i(phi_i^T z / ||phi_i||)`` (the paper's unnumbered equation
  in sec. 3.3). The model state carries :data:`CLASSIFIER_NORM`, so every
  evaluation of the global model normalises too; the stored weights stay
  unnormalised (their norms set the effective step size, as in the paper).
- ``clsprox``: FedProx's proximal term on the classifier only,
  ``CE + mu/2 ||phi_k - phi||^2`` (sec. 3.3, Table 1; mu 0.01 in Table 8).

Both are FedAvg otherwise; ``clsnorm`` with ``mu > 0`` is the paper's
"FedAvg + clsnorm + clsprox". The paper finds both help little and that
post-hoc calibration (``fedavg+ccvr``) helps much more.

Departures from the paper/code: none in the rules; clsprox ``mu = 0.01`` is the
paper's Table 8 value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetfl.algorithms.base import (
    Algorithm,
    Batch,
    ClientContext,
    HeadTransform,
    ServerState,
    Tensors,
    register_head_transform,
)
from hetfl.algorithms.fedprox import proximal_term
from hetfl.params import setting

# in a model state: its classifier rows are L2-normalised in the forward pass (sec. 3.3), training and inference
CLASSIFIER_NORM = "classifier_transform/normalize"
register_head_transform(HeadTransform(CLASSIFIER_NORM, weight=lambda w, _: F.normalize(w, dim=1)))


@dataclass(frozen=True)
class ClsNormHyper:
    """clsnorm settings. mu: weight of an optional classifier proximal term (0 = off;
    0.01 gives "FedAvg + clsnorm + clsprox")."""

    mu: float = setting(0.0, ge=0.0, doc="classifier proximal weight (0 = clsnorm alone)")


@dataclass(frozen=True)
class ClsProxHyper:
    """clsprox settings. mu: weight of the classifier proximal term (Luo et al. Table 8: 0.01)."""

    mu: float = setting(0.01, ge=0.0, doc="classifier proximal weight mu")


class ClsProx(Algorithm):
    name = "clsprox"
    Hyper = ClsProxHyper
    citation = "Luo et al., NeurIPS 2021, sec. 3.3"

    def loss(self, state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        ce, metrics = super().loss(state, batch, ctx)
        if self.hp.mu == 0:
            return ce, metrics
        prox = proximal_term(state, ctx.payload, tuple(self.setup.groups["classifier"]))
        return ce + 0.5 * self.hp.mu * prox, {**metrics, "cls_prox": prox.detach()}


class ClsNorm(ClsProx):
    name = "clsnorm"
    Hyper = ClsNormHyper

    def init_server(self, model_state: Tensors) -> ServerState:
        weight = model_state["classifier.weight"]
        return ServerState(model={**model_state, CLASSIFIER_NORM: torch.ones((), device=weight.device)})

    def start_state(self, ctx: ClientContext) -> Tensors:
        # always normalised in local training, also after a calibration (every_round CCVR) dropped the flag
        start = super().start_state(ctx)
        return {**start, CLASSIFIER_NORM: torch.ones((), device=start["classifier.weight"].device)}

    def finish(self, ctx: ClientContext, local: Tensors, steps: int) -> tuple[Tensors, Tensors]:
        upload, state = super().finish(ctx, local, steps)
        return {**upload, CLASSIFIER_NORM: local[CLASSIFIER_NORM]}, state
