"""Group DRO: minimise the loss of the worst group, with exponentiated-gradient group weights.

Sagawa, Koh, Hashimoto, Liang. "Distributionally Robust Neural Networks for
Group Shifts: On the Importance of Regularization for Worst-Case
Generalization." ICLR 2020, Algorithm 1 (online group DRO): the objective
``min_theta max_{q in simplex} sum_g q_g L_g(theta)`` is optimised by
alternating, at every step,

    ``q_g <- q_g exp(eta L_g(theta; batch))``, then ``q <- q / sum(q)``  (the EG ascent step on q),
    ``theta <- theta - lr grad_theta sum_g q_g L_g(theta; batch)``      (q held fixed),

with ``L_g`` the mean loss of the batch's samples of group g (0 for a group
absent from the batch, whose weight then only shrinks by the renormalisation).
As in the authors' code, groups are handled per minibatch (every group of the
batch updates its weight), not one sampled group per step as printed in
Algorithm 1.

Two federated versions (``groups``):

- ``"classes"`` (default): each client runs Algorithm 1 over the classes it
  holds (groups = the labels present in its own training set, found in
  ``begin``; absent classes are outside the simplex). q is the client's
  persistent state, carried across rounds (start: uniform over present
  classes). The engine has no per-step mutable method state, so the EG step is
  written as an *adversary* stage (``Stage.adversary``, run on the same batch
  before every step of the main stage, as FedBR's max step): it holds
  ``a = log q`` and takes one plain SGD step (lr = eta, no momentum, no weight
  decay) on ``-sum_g a_g L_g`` (``L_g`` detached), i.e. ``a_g <- a_g + eta L_g``,
  which is exactly the multiplicative update of q in log space (the
  normalisation is the softmax, shift-invariant). The main step then uses
  ``q = softmax(a)`` over present classes, detached. The q step evaluates the
  batch's group losses without gradient and leaves BatchNorm statistics to the
  model step (one update per step, as with plain training). ``a`` is
  renormalised to ``log q`` when the round ends. With ``train.max_grad_norm > 0`` the engine
  clips the q-step's gradient too.
- ``"clients"``: what FedBR's code runs as its "GroupDRO" baseline (Guo et al.
  ICML 2023, Table 1; github.com/LINs-lab/FedBR, ``algorithms_fed.FedGroupDRO``):
  groups are clients; local training is plain cross-entropy (one group per
  client); the server keeps ``log q`` over clients, adds ``eta L_k`` for every
  participating client k, and averages the uploads with weights proportional
  to ``q_k`` (normalised over the round's clients) instead of data sizes
  (``train.weighting`` is not read there: q is the method's weighting).
  ``L_k`` is the received global model's cross-entropy on client k's whole
  training set (eval mode; uploaded as one scalar), where FedBR's code uses the
  loss of the round's first local step. Two more differences from that code:
  its local steps are ``GroupDRO.update``, which Mixes every batch with a
  shuffled copy of itself (lambda ~ Beta(0.2, 0.2), ``get_new_all_x``,
  unconditionally) before a one-group DRO step (plain mixed cross-entropy), and
  its ``p`` belongs to a slot of ``local_algorithms`` that holds another random
  client each round (as DANN's labels), not to a client.

The local model is averaged by FedAvg (``"classes"``); q never leaves the client.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetfl.algorithms.base import (
    Algorithm,
    Batch,
    ClientContext,
    ServerState,
    Stage,
    Tensors,
    Upload,
    weighted_mean,
)
from hetfl.algorithms.logit_adjust import client_counts
from hetfl.params import setting

LOGQ = "groupdro.logq"  # client state ("classes"): log of the group weights over classes
PRESENT = "groupdro.present"  # extras: 1 for classes the client holds
CLIENT_LOGQ = "groupdro.client_logq"  # server extra ("clients"): log weights over clients
GLOBAL_LOSS = "groupdro.loss"  # upload ("clients"): the global model's loss on the client's data


@dataclass(frozen=True)
class GroupDROHyper:
    """Group DRO settings (Sagawa et al. 2020).

    eta: step size of the exponentiated-gradient update of q (0.01, the
        paper's and FedBR's code's ``groupdro_eta``).
    groups: "classes" (each client's own classes, q per client, updated every
        step) or "clients" (FedBR's federated version: q over clients on the
        server, updated every round, used as aggregation weights).
    """

    eta: float = setting(0.01, ge=0.0, doc="EG step size of the group weights")
    groups: str = setting("classes", choices=("classes", "clients"), doc="what a group is")


def group_losses(losses: torch.Tensor, labels: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Mean of per-sample ``losses`` within each group ``[num_groups]`` (0 for a group absent from the batch)."""
    groups = torch.arange(num_groups, device=labels.device)
    onehot = (labels.unsqueeze(1) == groups).to(losses.dtype)  # not F.one_hot: it checks values (no vmap)
    counts = onehot.sum(0)
    return (onehot * losses.unsqueeze(1)).sum(0) / counts.clamp(min=1.0)


def group_weights(log_q: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """``q = softmax(log_q)`` over the present groups (0 for the others)."""
    masked = torch.where(present > 0, log_q, torch.full_like(log_q, -torch.inf))
    return torch.softmax(masked, dim=-1)


def eg_update(q: torch.Tensor, losses: torch.Tensor, eta: float) -> torch.Tensor:
    """Sagawa et al.'s update ``q_g exp(eta L_g) / sum_h q_h exp(eta L_h)`` (reference form)."""
    unnormalised = q * torch.exp(eta * losses)
    return unnormalised / unnormalised.sum()


class GroupDRO(Algorithm):
    name = "groupdro"
    Hyper = GroupDROHyper
    citation = "Sagawa et al., ICLR 2020 (as a FedBR baseline: Guo et al., ICML 2023)"

    @property
    def per_class(self) -> bool:
        return self.hp.groups == "classes"

    # ------------------------------------------------------------------ server
    def init_server(self, model_state: Tensors) -> ServerState:
        if self.per_class:
            return ServerState(model=model_state)
        like = model_state["classifier.weight"]
        logq = torch.zeros(self.setup.num_clients, dtype=torch.float32, device=like.device)
        return ServerState(model=model_state, extra={CLIENT_LOGQ: logq})

    def aggregate(self, server: ServerState, uploads: list[Upload], round: int) -> ServerState:
        if self.per_class:
            return super().aggregate(server, uploads, round)
        logq = server.extra[CLIENT_LOGQ].clone()
        for u in uploads:
            logq[u.client_id] += self.hp.eta * u.tensors[GLOBAL_LOSS].to(logq)
        ids = torch.tensor([u.client_id for u in uploads], device=logq.device)
        weights = torch.softmax(logq[ids].double(), dim=0).tolist()
        models = [{k: v for k, v in u.tensors.items() if k != GLOBAL_LOSS} for u in uploads]
        return ServerState(model=weighted_mean(models, weights), extra={**server.extra, CLIENT_LOGQ: logq})

    # ------------------------------------------------------------------ client
    def init_client_state(self, client_id: int, server: ServerState) -> Tensors:
        if not self.per_class:
            return {}
        like = server.model["classifier.weight"]
        return {LOGQ: torch.zeros(self.setup.num_classes, dtype=like.dtype, device=like.device)}

    def begin(self, ctx: ClientContext) -> Tensors:
        if self.per_class:
            counts = client_counts(ctx, self.setup.num_classes, self.name)
            return {PRESENT: (counts > 0).to(torch.float32)}
        if ctx.features is None:
            raise ValueError("groupdro (groups = 'clients') needs the client's features (ClientContext.features)")
        z, y = ctx.features(ctx.payload)
        logits = F.linear(z, ctx.payload["classifier.weight"], ctx.payload.get("classifier.bias"))
        loss = F.cross_entropy(logits, y) if len(y) else logits.sum() * 0.0
        return {GLOBAL_LOSS: loss.detach().reshape(())}

    def start_state(self, ctx: ClientContext) -> Tensors:
        state = super().start_state(ctx)
        if self.per_class:
            state[LOGQ] = ctx.state[LOGQ]
        return state

    def q_loss(self, state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        """The EG step as a descent step on ``a = log q``: ``-sum_g a_g L_g`` (grad ``-L_g``).

        The group losses are those of the current model on the batch, computed without
        gradient and without touching BatchNorm statistics (the main step's forward does)."""
        z = self.model.reference_features(state, batch.x)
        logits = F.linear(z, state["classifier.weight"], state.get("classifier.bias"))
        losses = group_losses(F.cross_entropy(logits, batch.y, reduction="none"), batch.y, self.setup.num_classes)
        present = ctx.extras[PRESENT]
        objective = -(state[LOGQ] * (losses * present).detach()).sum()
        return objective, {"worst_group_loss": (losses * present).max().detach()}

    def loss(self, state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        logits = self.model.logits(state, batch.x)
        per_sample = F.cross_entropy(logits, batch.y, reduction="none")
        if not self.per_class:
            ce = per_sample.mean()
            return ce, {"ce": ce.detach()}
        losses = group_losses(per_sample, batch.y, self.setup.num_classes)
        q = group_weights(state[LOGQ], ctx.extras[PRESENT]).detach()
        robust = (q * losses).sum()
        return robust, {"robust_loss": robust.detach(), "ce": per_sample.mean().detach()}

    def stages(self, ctx: ClientContext) -> list[Stage]:
        stages = super().stages(ctx)
        if self.per_class:
            sgd = self.setup.sgd(self.hp.eta, momentum=0.0, weight_decay=0.0)
            stages[0].adversary = Stage("q", self.q_loss, (LOGQ,), sgd)
        return stages

    def finish(self, ctx: ClientContext, local: Tensors, steps: int) -> tuple[Tensors, Tensors]:
        model = {name: local[name] for name in self.model.state_names}
        if not self.per_class:
            return {**model, GLOBAL_LOSS: ctx.extras[GLOBAL_LOSS]}, ctx.state
        q = group_weights(local[LOGQ], ctx.extras[PRESENT])
        present = ctx.extras[PRESENT] > 0
        logq = torch.where(present, torch.log(q.clamp(min=1e-30)), torch.zeros_like(q))
        return model, {LOGQ: logq}
