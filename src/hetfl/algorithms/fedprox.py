"""FedProx: FedAvg with a proximal term that keeps local models near the global one.

Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith. "Federated Optimization in
Heterogeneous Networks." MLSys 2020, eq. (2):
``h_k(w; w^t) = F_k(w) + mu/2 ||w - w^t||^2``.

Departures from the paper/code: ``mu = 0.01`` is the value of the CCVR / MOON /
FedUV comparisons; the FedProx paper tunes mu per data set over {0.001, 0.01,
0.1, 1} (1 on its Synthetic data). The paper's inexact solver with
heterogeneous local work (stragglers doing fewer steps) is not modelled: every
client runs the run's epochs / steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetfl.algorithms.base import Algorithm, Batch, ClientContext, Tensors
from hetfl.params import setting


def proximal_term(state: Tensors, anchor: Tensors, names: tuple[str, ...]) -> torch.Tensor:
    """``sum ||w - w_anchor||^2`` over ``names`` (without the mu/2 factor)."""
    return sum(((state[n] - anchor[n]) ** 2).sum() for n in names)  # type: ignore[return-value]


@dataclass(frozen=True)
class FedProxHyper:
    """FedProx settings (Li et al. 2020).

    mu: weight of the proximal term; CCVR uses 0.01 / 0.001, FedUV 0.01.
    """

    mu: float = setting(0.01, ge=0.0, doc="proximal weight mu")


class FedProx(Algorithm):
    name = "fedprox"
    Hyper = FedProxHyper
    citation = "Li et al., MLSys 2020"

    def loss(self, state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        ce, metrics = super().loss(state, batch, ctx)
        prox = proximal_term(state, ctx.payload, self.model.param_names)
        return ce + 0.5 * self.hp.mu * prox, {**metrics, "prox": prox.detach()}
