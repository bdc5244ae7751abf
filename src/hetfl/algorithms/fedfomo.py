"""FedFomo: each client combines the models of other clients by first-order weights.

Zhang, Sapra, Fidler, Yeung, Alvarez. "Personalized Federated Learning with
First Order Model Optimization." ICLR 2021. The server keeps every
client's latest model (``ServerState.extra``) and sends client i the models of
M other clients. Client i, with its current model ``theta_i`` (client store,
``fedfomo.model/<name>``), measures the loss ``L_i`` of every model on a
validation split of its own data and weights each downloaded model by

    ``w_n = max(0, (L_i(theta_i) - L_i(theta_n)) / ||theta_n - theta_i||)``,

normalised to sum to one, then starts local training from

    ``theta_i <- theta_i + sum_n w_n (theta_n - theta_i)``

(its own model when every weight is zero: no downloaded model helps). It
uploads the trained model, which the server stores for the next rounds.
Clients are evaluated with their own model (``personalized = True``).

Differences from the paper, kept simple on purpose:
- the M models are a uniform random choice among the clients the server has
  a model of (the paper's server samples by an affinity matrix with
  epsilon-greedy exploration), drawn from a generator derived from
  ``(seed, round, client)``;
- the validation split is a fixed random ``val_fraction`` of the client's
  training data (drawn from ``(seed, client)``) which, as hetfl trains on the
  whole local set, is also trained on (the paper holds it out).

Departures from the paper/code: listed above (uniform choice of the M = 5
models instead of the affinity-based epsilon-greedy sampling with M = 8; the
validation split is also trained on); ``distance = "l2"`` is the paper's
formula, the authors' code defaults to l1.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetfl.algorithms.base import Algorithm, Batch, ClientContext, ModelCaller, ServerState, Tensors, Upload
from hetfl.params import setting
from hetfl.rng import torch_generator

OWN = "fedfomo.model/"  # client store: the client's own latest model
ROUND = "fedfomo.round"  # server: the last aggregated round
IDS = "fedfomo.candidate_ids"  # payload: which clients' models were sent
START = "fedfomo.start/"  # extras: the combined model training starts from
STREAM = 0x464F4D4F  # "FOMO": keeps FedFomo's random draws apart from other methods'
_SELECT, _VALIDATION = 1, 2


def stored_key(client: int, name: str) -> str:
    """Server-side name of client ``client``'s latest model tensor ``name``."""
    return f"fedfomo.client{client}/{name}"


def candidate_key(slot: int, name: str) -> str:
    """Payload name of the ``slot``-th downloaded model's tensor ``name``."""
    return f"fedfomo.candidate{slot}/{name}"


@dataclass(frozen=True)
class FedFomoHyper:
    """FedFomo settings (Zhang et al. 2021).

    num_models: M, models downloaded per round (5: a handful, cheap to
        download; the authors' config uses 8); all stored ones when fewer.
    val_fraction: share of the client's training data its validation losses
        are measured on (0.2, the validation share of the authors' config).
    distance: norm of ``theta_n - theta_i`` in the weights, "l2" (the paper's
        formula, default) or "l1" (the authors' code default).
    """

    num_models: int = setting(5, ge=1, doc="M, other clients' models downloaded per round")
    val_fraction: float = setting(0.2, gt=0.0, le=1.0, doc="share of local data used as validation split")
    distance: str = setting("l2", choices=("l2", "l1"), doc="norm of the model difference")


def fomo_weights(own_loss: torch.Tensor, losses: torch.Tensor, distances: torch.Tensor) -> torch.Tensor:
    """Normalised FedFomo weights: ``max(0, (L_own - L_n) / d_n)`` over the sum (all zero if none is positive).

    A model at distance zero from the client's own gets weight zero.
    """
    safe = torch.where(distances > 0, distances, torch.ones_like(distances))
    raw = torch.where(distances > 0, (own_loss - losses) / safe, torch.zeros_like(losses)).clamp(min=0)
    total = raw.sum()
    return raw / total if total > 0 else raw


@contextmanager
def eval_mode(model: ModelCaller) -> Iterator[None]:
    was_training = model.module.training
    model.module.eval()
    try:
        yield
    finally:
        model.module.train(was_training)


class FedFomo(Algorithm):
    name = "fedfomo"
    Hyper = FedFomoHyper
    citation = "Zhang et al., ICLR 2021"
    personalized = True

    # --------------------------------------------------------------- server
    def init_server(self, model_state: Tensors) -> ServerState:
        return ServerState(model=model_state, extra={ROUND: torch.zeros((), dtype=torch.long)})

    def stored_clients(self, server: ServerState) -> list[int]:
        first = self.model.param_names[0]
        return [c for c in range(self.setup.num_clients) if stored_key(c, first) in server.extra]

    def candidates(self, server: ServerState, client_id: int) -> list[int]:
        """The other clients whose models client ``client_id`` downloads in the coming round."""
        others = [c for c in self.stored_clients(server) if c != client_id]
        m = min(self.hp.num_models, len(others))
        if m == 0:
            return []
        round_ = int(server.extra[ROUND]) + 1
        gen = torch_generator(self.setup.seed, "algorithm", STREAM, _SELECT, round_, client_id)
        picked = torch.randperm(len(others), generator=gen)[:m]
        return sorted(others[int(i)] for i in picked)

    def payload(self, server: ServerState, client_id: int) -> Tensors:
        chosen = self.candidates(server, client_id)
        out = {candidate_key(slot, n): server.extra[stored_key(c, n)]
               for slot, c in enumerate(chosen) for n in self.model.state_names}
        out[IDS] = torch.tensor(chosen, dtype=torch.long)
        return out

    def aggregate(self, server: ServerState, uploads: list[Upload], round: int) -> ServerState:
        extra = dict(server.extra)
        for u in uploads:
            extra.update({stored_key(u.client_id, n): u.tensors[n] for n in self.model.state_names})
        extra[ROUND] = torch.tensor(round, dtype=torch.long)
        return ServerState(model=server.model, extra=extra)

    # --------------------------------------------------------------- client
    def init_client_state(self, client_id: int, server: ServerState) -> Tensors:
        return {OWN + n: server.model[n].clone() for n in self.model.state_names}

    def validation_batch(self, ctx: ClientContext) -> Batch:
        """A fixed random ``val_fraction`` of the client's training data."""
        if ctx.inputs is None:
            raise ValueError("fedfomo needs the client's data (ClientContext.inputs)")
        data = ctx.inputs()
        n = len(data.y)
        size = min(n, max(1, math.ceil(self.hp.val_fraction * n)))
        gen = torch_generator(self.setup.seed, "algorithm", STREAM, _VALIDATION, ctx.client_id)
        idx = torch.randperm(n, generator=gen)[:size].to(data.y.device)
        return Batch(data.x[idx], data.y[idx])

    def validation_loss(self, state: Tensors, batch: Batch) -> torch.Tensor:
        with torch.no_grad(), eval_mode(self.model):
            return F.cross_entropy(self.model.logits(state, batch.x), batch.y)

    def distance(self, a: Tensors, b: Tensors) -> torch.Tensor:
        diffs = [(a[n] - b[n]).flatten() for n in self.model.param_names]
        return torch.linalg.vector_norm(torch.cat(diffs), ord=2 if self.hp.distance == "l2" else 1)

    def begin(self, ctx: ClientContext) -> Tensors:
        """Weights of the downloaded models and the combined start model."""
        own = {n: ctx.state[OWN + n] for n in self.model.state_names}
        slots = len(ctx.payload[IDS])
        if slots == 0:
            return {"weights": torch.zeros(0), **{START + n: t for n, t in own.items()}}
        models = [{n: ctx.payload[candidate_key(s, n)] for n in self.model.state_names} for s in range(slots)]
        batch = self.validation_batch(ctx)
        own_loss = self.validation_loss(own, batch)
        losses = torch.stack([self.validation_loss(m, batch) for m in models])
        distances = torch.stack([self.distance(m, own) for m in models])
        weights = fomo_weights(own_loss, losses, distances)
        start = {}
        for n, t in own.items():
            if t.is_floating_point():
                start[n] = t + sum(w * (m[n] - t) for w, m in zip(weights, models, strict=True))
            else:
                start[n] = t
        return {"weights": weights, **{START + n: t for n, t in start.items()}}

    def start_state(self, ctx: ClientContext) -> Tensors:
        return {n: ctx.extras[START + n] for n in self.model.state_names}

    def finish(self, ctx: ClientContext, local: Tensors, steps: int) -> tuple[Tensors, Tensors]:
        model = {n: local[n] for n in self.model.state_names}
        # the server stores the upload: the client's copy must not share memory with it (checkpoints)
        return model, {OWN + n: t.clone() for n, t in model.items()}

    # ----------------------------------------------------------- evaluation
    def client_model(self, server: ServerState, client_state: Tensors, client_id: int) -> Tensors:
        return {n: client_state[OWN + n] for n in self.model.state_names}
