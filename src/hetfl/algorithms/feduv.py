"""FedUV: classifier-variance and representation-uniformity regularisers.

Son, Kim, Kim, Lee. "FedUV: Uniformity and Variance for Heterogeneous
Federated Learning." CVPR 2024. Local loss ``CE + λ L_V + μ L_U``; the server
is FedAvg.

- ``L_V`` (eq. 2-3): hinge on the per-class standard deviation (ddof 1) of
  the softmax probabilities across the batch, ``mean_j max(0, c - std(P_j))``
  with ``c`` the mean column std of the D x D identity (``1/sqrt(D)``).
- ``L_U`` (eq. 4): mean Gaussian potential ``exp(-||z_i - z_j||² / (2σ))``
  over pairs i < j of classifier-input features, σ = median of the non-zero
  squared distances (the paper; the authors' code divides by σ, option
  ``bandwidth = "code"``). σ is treated as a constant (no gradient).

A batch of one sample has no spread: both terms are zero there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetfl.algorithms.base import Algorithm, Batch, ClientContext, Tensors
from hetfl.params import setting


def identity_std(num_classes: int) -> float:
    """``c`` of eq. 3: mean unbiased std of the identity's columns, ``1/sqrt(D)``."""
    return 1.0 / math.sqrt(num_classes)


def variance_loss(logits: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """``L_V`` (eq. 2) of a batch of logits ``[B, D]`` (0 for B < 2).

    The std is ``sqrt(var + eps)`` (VICReg's variance term, which FedUV's builds on):
    the plain std has an infinite gradient where a class's probability is the same
    for the whole batch (collapsed features, dead ReLUs), which turns training to NaN.
    """
    if logits.shape[0] < 2:
        return logits.sum() * 0.0
    probs = F.softmax(logits, dim=1)
    std = torch.sqrt(probs.var(dim=0, correction=1) + eps)
    return F.relu(identity_std(logits.shape[1]) - std).mean()


def uniformity_loss(features: torch.Tensor, bandwidth: str = "paper", normalize: bool = False) -> torch.Tensor:
    """``L_U`` (eq. 4) of features ``[B, d]`` (0 for B < 2)."""
    n = features.shape[0]
    if n < 2:
        return features.sum() * 0.0
    z = F.normalize(features, dim=1) if normalize else features
    i, j = torch.triu_indices(n, n, offset=1, device=z.device)
    sq = ((z[i] - z[j]) ** 2).sum(dim=1)
    sigma = torch.nanmedian(torch.where(sq > 0, sq, torch.full_like(sq, float("nan")))).detach()
    sigma = torch.nan_to_num(sigma, nan=1.0)  # all points equal: any bandwidth gives exp(0) = 1
    scale = 2.0 * sigma if bandwidth == "paper" else sigma
    return torch.exp(-sq / scale).mean()


@dataclass(frozen=True)
class FedUVHyper:
    """FedUV settings (Son et al. 2024).

    lam: weight λ of L_V; -1 = D/4, the paper's rule (the authors' code uses 2.5).
    mu: weight μ of L_U (0.5 in the paper).
    bandwidth: "paper" divides by 2σ (eq. 4), "code" by σ (the authors' code).
    normalize: L2-normalise the features before L_U (the paper's hypersphere
        view; its Eq. 4 and the authors' code use the raw features). Recommended
        under strong label skew: on raw features L_U's gradient has an outward
        radial part (the bandwidth is held constant within a step), the features
        grow without bound where CE is easy (one-class clients) and training can
        diverge (benchmarks/results/seed_methods_findings.md).
    eps: the std in L_V is ``sqrt(var + eps)`` (1e-4 as VICReg): without it a
        batch whose class probabilities do not vary has an infinite gradient.
    """

    lam: float = setting(-1.0, doc="weight of L_V (-1 = num_classes / 4)")
    mu: float = setting(0.5, ge=0.0, doc="weight of L_U")
    bandwidth: str = setting("paper", choices=("paper", "code"), doc="2*sigma (paper) or sigma (code)")
    normalize: bool = setting(False, doc="L2-normalise features in L_U")
    eps: float = setting(1e-4, gt=0.0, doc="std = sqrt(var + eps) in L_V (finite gradients)")

    def check(self, prefix: str) -> None:
        if self.lam < 0 and self.lam != -1.0:
            from hetfl.params import ConfigError

            raise ConfigError(prefix + "lam", self.lam, "must be >= 0, or -1 for num_classes / 4")


class FedUV(Algorithm):
    name = "feduv"
    Hyper = FedUVHyper
    citation = "Son et al., CVPR 2024"

    @property
    def variance_weight(self) -> float:
        return self.setup.num_classes / 4 if self.hp.lam == -1.0 else self.hp.lam

    def loss(self, state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        features, logits = self.model.features_and_logits(state, batch.x)
        ce = F.cross_entropy(logits, batch.y)
        lv = variance_loss(logits, self.hp.eps)
        lu = uniformity_loss(features, self.hp.bandwidth, self.hp.normalize)
        loss = ce + self.variance_weight * lv + self.hp.mu * lu
        return loss, {"ce": ce.detach(), "variance": lv.detach(), "uniformity": lu.detach()}
