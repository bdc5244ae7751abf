"""FedDecorr: a decorrelation penalty on the features against dimensional collapse.

Shi, Liang, Zhang, Tan, Bai. "Towards Understanding and Mitigating Dimensional
Collapse in Heterogeneous Federated Learning." ICLR 2023, the FedDecorr
regulariser (equation numbers not checked against the PDF): the local loss is
``CE + beta * L_FedDecorr`` on the batch's classifier-input features ``F [N, d]``.
The server is FedAvg. Two forms (``form``):

- ``"code"`` (default): the authors' code (github.com/bytedance/FedDecorr,
  ``loss.py``, ``FedDecorrLoss``): standardise each dimension with the
  unbiased variance, ``Z = (F - mean) / sqrt(var + eps)``, take ``C = Z^T Z``
  (no ``1/N``) and return the mean of its squared off-diagonal entries divided
  by N, ``sum_{i != j} C_ij^2 / (d (d - 1) N)``: 0 for decorrelated features,
  ``(N - 1)^2 / N`` when all columns are identical. The authors'
  coefficients (0.1 CIFAR-10 / TinyImageNet, 0.05 CIFAR-100) were tuned on
  this scale, so this is the default.
- ``"paper"``: the printed formula ``||K||_F^2 / d^2`` with ``K = Z^T Z / N``
  the correlation matrix of features standardised with the population
  variance. Its minimum, for decorrelated features (``K = I``), is ``1/d``;
  identical columns give 1. As ``C ~ (N - 1) K``, the code's value is about
  ``N`` times the off-diagonal part of this one: at the same ``beta`` the
  paper form is some 30-60 times weaker at batch sizes 32-64.

A batch of one sample has no correlation: the penalty is 0 there (decided on
the static batch shape, so the loss stays vmappable).

Departures from the paper/code: none at the defaults (form "code", beta 0.1,
eps 1e-8 are the code's). The features are hetfl's classifier input (the
code's ``return_features`` output, the pooled penultimate features).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetfl.algorithms.base import Algorithm, Batch, ClientContext, Tensors, cross_entropy
from hetfl.params import setting


def decorrelation_loss(features: torch.Tensor, eps: float = 1e-8, form: str = "code") -> torch.Tensor:
    """``L_FedDecorr`` of features ``[N, d]`` ("paper" or "code" form; 0 for N < 2)."""
    n, d = features.shape
    if n < 2 or (form == "code" and d < 2):
        return features.sum() * 0.0
    centred = features - features.mean(dim=0, keepdim=True)
    if form == "code":
        z = centred / torch.sqrt(eps + centred.var(dim=0, correction=1, keepdim=True))
        corr = z.T @ z
        off = corr - torch.diag_embed(torch.diagonal(corr))
        return off.pow(2).sum() / (d * (d - 1)) / n
    z = centred / torch.sqrt(centred.var(dim=0, correction=0, keepdim=True) + eps)
    corr = z.T @ z / n
    return corr.pow(2).sum() / d**2


@dataclass(frozen=True)
class FedDecorrHyper:
    """FedDecorr settings (Shi et al. 2023).

    beta: weight of the penalty (0.1, the authors' CIFAR-10 / TinyImageNet
        coefficient and their ``--feddecorr_coef`` default; 0.05 for CIFAR-100).
        With ``form = "paper"`` the same beta acts about N (batch size) times
        more weakly than with the code's form.
    eps: added to the variance in the standardisation (1e-8, the code's).
    form: "code" (default: the authors' loss.py, on which beta was tuned) or
        "paper" (``||K||_F^2 / d^2``).
    """

    beta: float = setting(0.1, ge=0.0, doc="weight of the decorrelation penalty")
    eps: float = setting(1e-8, gt=0.0, doc="variance epsilon in the standardisation")
    form: str = setting("code", choices=("code", "paper"), doc="the authors' code (default) or the paper formula")


class FedDecorr(Algorithm):
    name = "feddecorr"
    Hyper = FedDecorrHyper
    citation = "Shi et al., ICLR 2023"

    def loss(self, state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        features, logits = self.model.features_and_logits(state, batch.x)
        ce = cross_entropy(logits, batch.y)
        decorr = decorrelation_loss(features, self.hp.eps, self.hp.form)
        return ce + self.hp.beta * decorr, {"ce": ce.detach(), "decorr": decorr.detach()}
