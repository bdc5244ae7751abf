"""FedAvgM: FedAvg with momentum on the server.

Hsu, Qi, Brown. "Measuring the Effects of Non-Identical Data Distribution for
Federated Visual Classification." arXiv:1909.06335, 2019 (section 3):
the averaged update ``Δ = w^t - Σ_k n_k/n w_k`` is fed to server SGD with
momentum: ``v ← β v + Δ``, ``w^{t+1} = w^t - η_s v``. CCVR uses β = 0.1.

Departures from the paper/code: the default ``beta = 0.1`` is CCVR's; Hsu et al.
sweep beta up to 0.99 together with the server learning rate (their best runs
use large beta with a reduced effective step). ``server_lr = 1`` by default.
The NIID-Bench / MOON code (QinbinLi/MOON ``--server_momentum``) damps the
update, ``v <- beta v + (1 - beta) Delta``, ``w <- w - v``: that is this rule with
``server_lr = 1 - beta`` (its v is (1 - beta) times this one's), e.g. 0.9 at beta 0.1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetfl.algorithms.base import Algorithm, ServerState, Tensors, Upload, weighted_mean
from hetfl.params import FLOAT32_MAX, setting


@dataclass(frozen=True)
class FedAvgMHyper:
    """FedAvgM settings (Hsu et al. 2019).

    server_momentum: β of the server momentum buffer (CCVR: 0.1).
    server_lr: η_s, the server learning rate (1.0 = FedAvg when β = 0).
    """

    server_momentum: float = setting(0.1, ge=0.0, lt=1.0, doc="server momentum beta")
    server_lr: float = setting(1.0, gt=0.0, lt=FLOAT32_MAX, doc="server learning rate")


class FedAvgM(Algorithm):
    name = "fedavgm"
    Hyper = FedAvgMHyper
    citation = "Hsu et al., arXiv:1909.06335"

    def init_server(self, model_state: Tensors) -> ServerState:
        momentum = {n: torch.zeros_like(model_state[n]) for n in self.model.param_names}
        return ServerState(model=model_state, extra=momentum)

    def aggregate(self, server: ServerState, uploads: list[Upload], round: int) -> ServerState:
        mean = weighted_mean([u.tensors for u in uploads], self.client_weights(uploads))
        model, velocity = dict(mean), {}
        for name in self.model.param_names:  # buffers (BatchNorm statistics) are plainly averaged
            delta = server.model[name] - mean[name]
            velocity[name] = self.hp.server_momentum * server.extra[name] + delta
            model[name] = server.model[name] - self.hp.server_lr * velocity[name]
        return ServerState(model=model, extra=velocity)
