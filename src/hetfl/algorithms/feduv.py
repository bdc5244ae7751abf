"""FedUV: classifier-variance and representation-uniformity regularisers.

Son, Kim, Kim, Lee. "FedUV: Uniformity and Variance for Heterogeneous
Federated Learning." CVPR 2024. Local loss ``CE + λ L_V + μ L_U``; the server
is FedAvg. Reference code: github.com/sonhamin/FedUV, ``algs/feduv.py``
(``UVReg``), commit dd2e3c59fba20662a4234810f93061f4a4edc1b7.

- ``L_V`` (eq. 2-3): hinge on the per-class standard deviation (ddof 1) of
  the softmax probabilities across the batch, ``mean_j max(0, c - std(P_j))``
  with ``c`` the mean column std of the D x D identity (``1/sqrt(D)``). Same
  as the authors' code (std, not variance; hinge, not squared).
- ``L_U`` (eq. 4): mean Gaussian potential ``exp(-||z_i - z_j||² / (2σ))``
  over pairs i < j of the classifier-input features (the output of the
  projection head where the model has one, as the code's ``pro1``), with
  σ = the (lower) median of the non-zero squared distances. As in the
  authors' code the gradient flows through σ (``torch.median`` is not
  detached there). This makes L_U invariant to the scale of the features:
  its gradient has no radial part (``Σ_i <z_i, ∂L_U/∂z_i> = 0``), so it only
  spreads the features. ``sigma_grad = false`` treats σ as a constant, an
  ablation kept for comparison: L_U then also pushes every feature outwards
  (on a random batch almost the whole gradient is radial), the features grow
  without bound where CE is easy (one-class clients) and training diverged
  at Dirichlet α = 0.01 (benchmarks/results/seed_methods_findings.md).

Defaults and departures:

- bandwidth: ``"paper"`` (default, METHODS.md rule: paper first) divides by
  2σ as eq. 4; ``"code"`` divides by σ as ``UVReg`` does. With ``"code"``
  and the other defaults, both terms equal the authors' functions in value
  and gradient (tests/algorithms/test_feduv.py pins their numbers).
- λ: ``-1`` = D/4, the paper's rule; the authors' ``train_fl.py`` default is
  ``std_coeff = 2.5`` (= D/4 for D = 10). μ = 0.5 in both.
- The std in L_V: where a class's probability is exactly the same for the
  whole batch (saturated softmax, collapsed features) the plain std has an
  undefined (0/0) gradient, which turns the code's training to NaN; here
  that column's std gets gradient 0 and the same value (0). Elsewhere equal
  to the code. ``eps > 0`` uses ``sqrt(var + eps)`` instead (VICReg's form;
  an option, not the default).
- ``normalize = true`` L2-normalises the features before L_U (the paper's
  hypersphere view); both eq. 4 and the code use the raw features (default).
- A batch of one sample has no spread: both terms are zero there (the code
  never sees one: its loader drops the last incomplete batch, which
  ``train.drop_last = true`` reproduces, as the feduv-table1 preset sets).
- Pairs with zero distance (duplicate samples) are excluded from the median
  as in the code; when all points coincide σ falls back to 1 (every term is
  ``exp(0) = 1`` whatever σ is; the code divides by the median of an empty
  tensor, NaN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetfl.algorithms.base import Algorithm, Batch, ClientContext, Tensors, cross_entropy
from hetfl.params import ConfigError, setting


def identity_std(num_classes: int) -> float:
    """``c`` of eq. 3: mean unbiased std of the identity's columns, ``1/sqrt(D)``."""
    return 1.0 / math.sqrt(num_classes)


def column_std(probs: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """Unbiased std of each column of ``probs`` ``[B, D]``.

    ``eps = 0``: the plain std, except that a column with zero variance gets
    gradient 0 instead of NaN (0/0). ``eps > 0``: ``sqrt(var + eps)``.
    """
    var = probs.var(dim=0, correction=1)
    if eps > 0:
        return torch.sqrt(var + eps)
    positive = var > 0
    return torch.where(positive, torch.sqrt(torch.where(positive, var, torch.ones_like(var))), torch.zeros_like(var))


def variance_loss(logits: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """``L_V`` (eq. 2) of a batch of logits ``[B, D]`` (0 for B < 2)."""
    if logits.shape[0] < 2:
        return logits.sum() * 0.0
    std = column_std(F.softmax(logits, dim=1), eps)
    return F.relu(identity_std(logits.shape[1]) - std).mean()


def pair_sq_distances(z: torch.Tensor) -> torch.Tensor:
    """Squared Euclidean distances of the pairs i < j of rows of ``z`` (``torch.pdist(z) ** 2`` order)."""
    n = z.shape[0]
    i, j = torch.triu_indices(n, n, offset=1, device=z.device)
    return ((z[i] - z[j]) ** 2).sum(dim=1)


def median_bandwidth(sq: torch.Tensor, sigma_grad: bool = True) -> torch.Tensor:
    """σ of eq. 4: the lower median of the non-zero squared distances (1 if there are none).

    ``sigma_grad``: gradient flows into the median entry, as in the authors' code.
    """
    sigma = torch.nanmedian(torch.where(sq > 0, sq, torch.full_like(sq, float("nan"))))
    sigma = torch.nan_to_num(sigma, nan=1.0)  # all points equal: any bandwidth gives exp(0) = 1
    return sigma if sigma_grad else sigma.detach()


def uniformity_loss(
    features: torch.Tensor, bandwidth: str = "paper", normalize: bool = False, sigma_grad: bool = True
) -> torch.Tensor:
    """``L_U`` (eq. 4) of features ``[B, d]`` (0 for B < 2): ``mean_{i<j} exp(-d_ij / (2σ))`` ("paper")
    or ``exp(-d_ij / σ)`` ("code")."""
    if features.shape[0] < 2:
        return features.sum() * 0.0
    z = F.normalize(features, dim=1) if normalize else features
    sq = pair_sq_distances(z)
    sigma = median_bandwidth(sq, sigma_grad)
    scale = 2.0 * sigma if bandwidth == "paper" else sigma
    return torch.exp(-sq / scale).mean()


@dataclass(frozen=True)
class FedUVHyper:
    """FedUV settings (Son et al. 2024); the module docstring lists the departures.

    lam: weight λ of L_V; -1 = D/4, the paper's rule (the authors' code uses 2.5).
    mu: weight μ of L_U (0.5 in the paper and the code).
    bandwidth: "paper" divides by 2σ (eq. 4), "code" by σ (the authors' code).
    sigma_grad: gradient through σ (the median), as the authors' code (default).
        false = σ held constant within a step: an ablation; L_U then has an
        outward radial gradient and training diverged under strong label skew.
    normalize: L2-normalise the features before L_U (the paper's hypersphere
        view; eq. 4 and the authors' code use the raw features).
    eps: 0 = the plain std in L_V (the code's; 0 gradient where a column does
        not vary); > 0 = ``sqrt(var + eps)`` (VICReg's form).
    """

    lam: float = setting(-1.0, doc="weight of L_V (-1 = num_classes / 4)")
    mu: float = setting(0.5, ge=0.0, doc="weight of L_U")
    bandwidth: str = setting("paper", choices=("paper", "code"), doc="2*sigma (paper) or sigma (code)")
    sigma_grad: bool = setting(True, former=False,
                               doc="gradient through the median bandwidth (authors' code); false = detached")
    normalize: bool = setting(False, doc="L2-normalise features in L_U")
    eps: float = setting(0.0, ge=0.0, doc="std = sqrt(var + eps) in L_V when > 0; 0 = plain std")

    def check(self, prefix: str) -> None:
        if self.lam < 0 and self.lam != -1.0:
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
        ce = cross_entropy(logits, batch.y)
        lv = variance_loss(logits, self.hp.eps)
        lu = uniformity_loss(features, self.hp.bandwidth, self.hp.normalize, self.hp.sigma_grad)
        loss = ce + self.variance_weight * lv + self.hp.mu * lu
        return loss, {"ce": ce.detach(), "variance": lv.detach(), "uniformity": lu.detach()}
