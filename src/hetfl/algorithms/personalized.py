"""Personalised baselines: every client keeps a model of its own.

Local-only: each client trains only on its own data, nothing is averaged or
communicated; the lower bound of every personalised FL comparison (FedPAC,
Xu et al. ICLR 2023, Table 1; FedBR, Table 1).

Departures from the paper/code: none (no method parameters).
"""

from __future__ import annotations

from hetfl.algorithms.base import Algorithm, ClientContext, ServerState, Tensors, Upload


class LocalOnly(Algorithm):
    name = "local"
    citation = "no federation (each client alone)"
    personalized = True

    def payload(self, server: ServerState, client_id: int) -> Tensors:
        return {}

    def init_client_state(self, client_id: int, server: ServerState) -> Tensors:
        # every client starts from the same initial model (the seed's)
        return {n: t.clone() for n, t in server.model.items()}

    def start_state(self, ctx: ClientContext) -> Tensors:
        return ctx.state

    def finish(self, ctx: ClientContext, local: Tensors, steps: int) -> tuple[Tensors, Tensors]:
        return {}, {n: local[n] for n in self.model.state_names}

    def aggregate(self, server: ServerState, uploads: list[Upload], round: int) -> ServerState:
        return server

    def client_model(self, server: ServerState, client_state: Tensors, client_id: int) -> Tensors:
        return client_state
