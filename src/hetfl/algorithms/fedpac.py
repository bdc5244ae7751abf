"""FedPAC: personalised FL by feature alignment and classifier collaboration.

Xu, Tong, Huang. "Personalized Federated Learning with Feature Alignment and
Classifier Collaboration." ICLR 2023, Algorithm 1. The encoder is shared, each
client keeps its own classifier. Per round, client i:

1. with the received encoder and its own classifier, BEFORE training, computes
   ``h_i[k] = pi_k mu_k`` and the scalar
   ``v_i = [sum_k pi_k tr(E[z z^T | k]) - sum_k pi_k^2 ||mu_k||^2] / n_i``;
2. trains its classifier alone for one epoch (authors: lr 0.1, momentum 0.5,
   weight decay 5e-4);
3. trains the encoder for E epochs with the classifier frozen on
   ``CE + lam * mean ||f(x) - c_y||^2 / d`` (the feature-alignment regulariser,
   towards the global centroid of class y, or the client's own class mean
   when the server has none; off until the server has centroids);
4. uploads the encoder, its classifier, per-class centroids and counts after
   training, and ``h_i``, ``v_i``.

Server: encoder = data-size-weighted mean; centroid of class k = count-weighted
mean of client centroids; for each participating client i, the weights
``alpha_i = argmin a^T (diag(v) + D_i) a`` on the simplex with
``D_i[j1, j2] = sum_k <h_i[k] - h_j1[k], h_i[k] - h_j2[k]>`` combine the
uploaded classifiers into client i's personalised classifier (its own one if
the solve fails). Evaluation: each client's encoder + personalised classifier
on its own test split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetfl.algorithms.base import Algorithm, Batch, ClientContext, ServerState, Stage, Tensors, Upload
from hetfl.algorithms.simplex_qp import solve_simplex_qp
from hetfl.engine.optim import SGDConfig
from hetfl.params import setting

CENTROIDS, HAS_CENTROID = "fedpac.centroids", "fedpac.has_centroid"
HEAD, OWN_HEAD = "fedpac.head/", "fedpac.local_head/"


@dataclass(frozen=True)
class FedPACHyper:
    """FedPAC settings (Xu et al. 2023; defaults from the authors' code).

    lam: weight of the feature-alignment regulariser (1.0).
    head_epochs, head_lr, head_momentum, head_weight_decay: the classifier stage.
    """

    lam: float = setting(1.0, ge=0.0, doc="feature alignment weight")
    head_epochs: int = setting(1, ge=0, doc="classifier-stage epochs")
    head_lr: float = setting(0.1, gt=0.0, doc="classifier-stage lr")
    head_momentum: float = setting(0.5, ge=0.0, lt=1.0, doc="classifier-stage momentum")
    head_weight_decay: float = setting(5e-4, ge=0.0, doc="classifier-stage weight decay")


def class_means(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts [C], means [C, d]) of features per class; zero mean for absent classes."""
    counts = torch.bincount(labels, minlength=num_classes).to(features.dtype)
    sums = torch.zeros(num_classes, features.shape[1], dtype=features.dtype, device=features.device)
    sums.index_add_(0, labels, features)
    return counts, sums / counts.clamp(min=1).unsqueeze(1)


def feature_statistics(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, float]:
    """FedPAC's ``(h_i [C, d], v_i)`` of step 1."""
    z = features.double()
    n = len(labels)
    counts, means = class_means(z, labels, num_classes)
    pi = counts / max(n, 1)
    second = torch.zeros(num_classes, dtype=torch.float64, device=z.device).index_add_(0, labels, (z * z).sum(1))
    trace = second / counts.clamp(min=1)  # tr E[z z^T | k]
    v = float(((pi * trace).sum() - (pi**2 * (means**2).sum(1)).sum()) / max(n, 1))
    return pi.unsqueeze(1) * means, v


def combination_weights(h: list[torch.Tensor], v: list[float], i: int) -> torch.Tensor:
    """Client i's classifier-combination weights over the participants (eq. 9-11)."""
    flat = torch.stack([x.flatten() for x in h]).double()
    diff = flat[i] - flat  # row j: h_i - h_j
    p = torch.diag(torch.tensor(v, dtype=torch.float64)) + diff @ diff.T
    result = solve_simplex_qp(p)
    if not torch.isfinite(result.weights).all():
        fallback = torch.zeros(len(h), dtype=torch.float64)
        fallback[i] = 1.0
        return fallback
    return result.weights


class FedPAC(Algorithm):
    name = "fedpac"
    Hyper = FedPACHyper
    citation = "Xu et al., ICLR 2023"
    personalized = True

    @property
    def head_names(self) -> list[str]:
        return self.setup.groups["classifier"]

    def encoder_names(self) -> tuple[str, ...]:
        heads = set(self.head_names)
        return tuple(n for n in self.model.param_names if n not in heads)

    # --------------------------------------------------------------- server
    def init_server(self, model_state: Tensors) -> ServerState:
        weight = model_state[self.head_names[0]]
        extra = {CENTROIDS: torch.zeros(self.setup.num_classes, weight.shape[1], device=weight.device),
                 HAS_CENTROID: torch.zeros(self.setup.num_classes, device=weight.device)}
        return ServerState(model=model_state, extra=extra)

    def payload(self, server: ServerState, client_id: int) -> Tensors:
        heads = {HEAD + n: server.extra[f"head.{client_id}/{n}"] for n in self.head_names
                 if f"head.{client_id}/{n}" in server.extra}
        body = {n: t for n, t in server.model.items() if n not in self.head_names}
        return {**body, CENTROIDS: server.extra[CENTROIDS], HAS_CENTROID: server.extra[HAS_CENTROID], **heads}

    # --------------------------------------------------------------- client
    def init_client_state(self, client_id: int, server: ServerState) -> Tensors:
        return {OWN_HEAD + n: server.model[n].clone() for n in self.head_names}

    def start_state(self, ctx: ClientContext) -> Tensors:
        state = {n: ctx.payload[n] for n in self.model.state_names if n not in self.head_names}
        for n in self.head_names:  # the personalised head from the server, else the client's own
            state[n] = ctx.payload.get(HEAD + n, ctx.state[OWN_HEAD + n])
        return state

    def begin(self, ctx: ClientContext) -> Tensors:
        """Step 1: statistics with the received encoder, before any training."""
        feats, labels = ctx.features(self.start_state(ctx))  # type: ignore[misc]
        h, v = feature_statistics(feats, labels, self.setup.num_classes)
        _, own_means = class_means(feats.float(), labels, self.setup.num_classes)
        has = ctx.payload[HAS_CENTROID].unsqueeze(1) > 0
        target = torch.where(has, ctx.payload[CENTROIDS], own_means)
        align = float(ctx.payload[HAS_CENTROID].sum() > 0)
        return {"h": h, "v": torch.tensor(v), "target": target, "align": torch.tensor(align)}

    def alignment_loss(self, state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        z, logits = self.model.features_and_logits(state, batch.x)
        ce = F.cross_entropy(logits, batch.y)
        align = F.mse_loss(z, ctx.extras["target"][batch.y])  # (1/d) ||f(x) - c_y||^2, batch mean
        weight = self.hp.lam * ctx.extras["align"]
        return ce + weight * align, {"ce": ce.detach(), "alignment": align.detach()}

    def stages(self, ctx: ClientContext) -> list[Stage]:
        hp, train = self.hp, self.setup.train
        head_sgd = SGDConfig(hp.head_lr, hp.head_momentum, hp.head_weight_decay)
        stages = [Stage("classifier", self.loss, tuple(self.head_names), head_sgd, epochs=hp.head_epochs)]
        if hp.head_epochs == 0:
            stages = []
        stages.append(Stage("encoder", self.alignment_loss, self.encoder_names(), self.setup.sgd(ctx.lr),
                            epochs=train.local_epochs, steps=train.local_steps))
        return stages

    def finish(self, ctx: ClientContext, local: Tensors, steps: int) -> tuple[Tensors, Tensors]:
        feats, labels = ctx.features(local)  # type: ignore[misc]
        counts, centroids = class_means(feats.float(), labels, self.setup.num_classes)
        upload = {n: local[n] for n in self.model.state_names}
        upload.update({"fedpac.counts": counts, CENTROIDS: centroids, "fedpac.h": ctx.extras["h"],
                       "fedpac.v": ctx.extras["v"]})
        return upload, {OWN_HEAD + n: local[n] for n in self.head_names}

    def aggregate(self, server: ServerState, uploads: list[Upload], round: int) -> ServerState:
        sizes = torch.tensor([float(u.num_samples) for u in uploads])
        w = sizes / sizes.sum()
        model = dict(server.model)
        for n in self.model.state_names:
            stacked = torch.stack([u.tensors[n].float() for u in uploads])
            shaped = w.to(stacked.device).view(-1, *[1] * (stacked.dim() - 1))
            mean = (shaped * stacked).sum(0)
            model[n] = mean.to(server.model[n].dtype) if stacked.is_floating_point() else stacked[0]
        extra = dict(server.extra)
        counts = torch.stack([u.tensors["fedpac.counts"] for u in uploads])  # [m, C]
        cents = torch.stack([u.tensors[CENTROIDS] for u in uploads])  # [m, C, d]
        total = counts.sum(0)
        extra[CENTROIDS] = (counts.unsqueeze(2) * cents).sum(0) / total.clamp(min=1).unsqueeze(1)
        extra[HAS_CENTROID] = (total > 0).float()
        h = [u.tensors["fedpac.h"] for u in uploads]
        v = [float(u.tensors["fedpac.v"]) for u in uploads]
        for i, u in enumerate(uploads):
            alpha = combination_weights(h, v, i)
            for n in self.head_names:
                heads = torch.stack([x.tensors[n] for x in uploads]).double()
                combined = (alpha.to(heads.device).view(-1, *[1] * (heads.dim() - 1)) * heads).sum(0)
                extra[f"head.{u.client_id}/{n}"] = combined.to(u.tensors[n].dtype)
        return ServerState(model=model, extra=extra)

    # ----------------------------------------------------------- evaluation
    def client_model(self, server: ServerState, client_state: Tensors, client_id: int) -> Tensors:
        state = dict(server.model)
        for n in self.head_names:
            key = f"head.{client_id}/{n}"
            state[n] = server.extra[key] if key in server.extra else client_state[OWN_HEAD + n]
        return state
