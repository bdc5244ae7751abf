"""FedDyn: dynamic regularisation aligning local and global stationary points.

Acar, Zhao, Matas, Mattina, Whatmough, Saligrama. "Federated Learning Based on
Dynamic Regularization." ICLR 2021, Algorithm 1:

- local objective: ``L_k(θ) - <∇L_k(θ_k^{t-1}), θ> + α/2 ||θ - θ^{t-1}||²``
- client state: ``∇L_k(θ_k^t) = ∇L_k(θ_k^{t-1}) - α (θ_k^t - θ^{t-1})``
- server: ``h^t = h^{t-1} - α/m Σ_{k∈P_t} (θ_k^t - θ^{t-1})``,
  ``θ^t = mean_{P_t}(θ_k^t) - h^t / α``  (m = number of all clients)

Departures from the paper/code: ``alpha = 0.01`` (the paper uses 0.1 / 0.01 /
0.001 by setting). The authors' code divides alpha per client by the client's
relative data size (``alpha / (n_k / mean n)``); hetfl uses one alpha for all
clients, as Algorithm 1 does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetfl.algorithms.base import Algorithm, Batch, ClientContext, ServerState, Tensors, Upload, weighted_mean
from hetfl.params import setting


@dataclass(frozen=True)
class FedDynHyper:
    """FedDyn settings (Acar et al. 2021). alpha: regularisation weight (paper: 0.01 - 0.1)."""

    alpha: float = setting(0.01, gt=0.0, doc="dynamic regulariser weight alpha")


class FedDyn(Algorithm):
    name = "feddyn"
    Hyper = FedDynHyper
    citation = "Acar et al., ICLR 2021"

    def init_server(self, model_state: Tensors) -> ServerState:
        h = {n: torch.zeros_like(model_state[n]) for n in self.model.param_names}
        return ServerState(model=model_state, extra=h)

    def init_client_state(self, client_id: int, server: ServerState) -> Tensors:
        return {n: torch.zeros_like(h) for n, h in server.extra.items()}

    def loss(self, state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        ce, metrics = super().loss(state, batch, ctx)
        linear = sum((state[n] * ctx.state[n]).sum() for n in self.model.param_names)
        prox = sum(((state[n] - ctx.payload[n]) ** 2).sum() for n in self.model.param_names)
        return ce - linear + 0.5 * self.hp.alpha * prox, metrics

    def finish(self, ctx: ClientContext, local: Tensors, steps: int) -> tuple[Tensors, Tensors]:
        grad_state = {n: ctx.state[n] - self.hp.alpha * (local[n] - ctx.payload[n]) for n in self.model.param_names}
        return {n: local[n] for n in self.model.state_names}, grad_state

    def aggregate(self, server: ServerState, uploads: list[Upload], round: int) -> ServerState:
        # 1/|P_t| over the participants (Algorithm 1), whatever train.weighting says: h's update is the
        # uniform sum of the drifts, and the model's correction h / alpha assumes the same average
        mean = weighted_mean([u.tensors for u in uploads], [1.0] * len(uploads))
        m, a = self.setup.num_clients, self.hp.alpha
        h, model = {}, dict(mean)
        for n in self.model.param_names:
            drift = sum(u.tensors[n] - server.model[n] for u in uploads)
            h[n] = server.extra[n] - (a / m) * drift
            model[n] = mean[n] - h[n] / a
        return ServerState(model=model, extra=h)
