"""Ditto: a personal model regularised towards the FedAvg global model.

Li, Hu, Beirami, Smith. "Ditto: Fair and Robust Federated Learning Through
Personalization." ICML 2021, eq. (2) and Algorithm 1. The global model ``w``
is trained exactly as FedAvg (E local epochs of cross-entropy from the
received ``w^t``, upload, data-size-weighted average). Each client also keeps
a personal model ``v_i`` (client store, ``ditto.personal/<name>``) trained on

    ``h_i(v; w^t) = F_i(v) + lam/2 ||v - w^t||^2``

i.e. ``v_i <- v_i - eta (grad F_i(v_i) + lam (v_i - w^t))`` (Algorithm 1),
with ``w^t`` the global model the client received this round.
Clients are evaluated with ``v_i``; the global model is evaluated too
(``global_acc``). A client that never trained is evaluated with the global model.

Departures from the paper/code: ``lam = 0.1`` is hetfl's choice (the paper tunes
lambda per data set from a small grid); the personal model takes as many
steps as the global one by default (Algorithm 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetfl.algorithms.base import Algorithm, Batch, ClientContext, ServerState, Stage, Tensors, cross_entropy
from hetfl.algorithms.fedprox import proximal_term
from hetfl.params import setting

PERSONAL = "ditto.personal/"


@dataclass(frozen=True)
class DittoHyper:
    """Ditto settings (Li et al. 2021).

    lam: weight of the pull towards the global model (0.1). The paper tunes
        lam per data set; 0.1 is hetfl's choice, a light pull that lets the
        personal model fit a skewed client. lam = 0 is local training only;
        large lam tends to the global model.
    personal_epochs: epochs on the personal model per round; 0 (default) means
        the run's ``train.local_epochs`` / ``train.local_steps``, the paper's
        setting of as many personal as global local updates.
    """

    lam: float = setting(0.1, ge=0.0, doc="proximal weight lambda towards the global model")
    personal_epochs: int = setting(0, ge=0, doc="personal-model epochs per round (0 = train.local_epochs)")


class Ditto(Algorithm):
    name = "ditto"
    Hyper = DittoHyper
    citation = "Li et al., ICML 2021"
    personalized = False  # the FedAvg global model is meaningful and evaluated too

    def personal(self, state: Tensors) -> Tensors:
        """The personal model ``v`` held under ``ditto.personal/`` in ``state``."""
        return {n: state[PERSONAL + n] for n in self.model.state_names}

    def init_client_state(self, client_id: int, server: ServerState) -> Tensors:
        # v_i starts as the global model of the client's first round
        return {PERSONAL + n: server.model[n].clone() for n in self.model.state_names}

    def start_state(self, ctx: ClientContext) -> Tensors:
        return {**{n: ctx.payload[n] for n in self.model.state_names}, **ctx.state}

    def running_buffers(self) -> tuple[str, ...]:
        """The global copy's buffers and the personal model's (its BatchNorm statistics train with it)."""
        return self.model.buffer_names + tuple(PERSONAL + n for n in self.model.buffer_names)

    def personal_loss(self, state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        """``F_i(v) + lam/2 ||v - w^t||^2``, w^t the received global model."""
        v = self.personal(state)
        ce = cross_entropy(self.model.logits(v, batch.x), batch.y)
        prox = proximal_term(v, ctx.payload, self.model.param_names)
        return ce + 0.5 * self.hp.lam * prox, {"ce_personal": ce.detach(), "prox": prox.detach()}

    def stages(self, ctx: ClientContext) -> list[Stage]:
        (global_stage,) = super().stages(ctx)
        train = self.setup.train
        epochs, steps = (self.hp.personal_epochs, 0) if self.hp.personal_epochs else (train.local_epochs,
                                                                                      train.local_steps)
        trainable = tuple(PERSONAL + n for n in self.model.param_names)
        personal = Stage("personal", self.personal_loss, trainable, self.setup.sgd(ctx.lr), epochs=epochs,
                         steps=steps)
        return [global_stage, personal]

    def finish(self, ctx: ClientContext, local: Tensors, steps: int) -> tuple[Tensors, Tensors]:
        upload = {n: local[n] for n in self.model.state_names}
        return upload, {PERSONAL + n: local[PERSONAL + n] for n in self.model.state_names}

    def client_model(self, server: ServerState, client_state: Tensors, client_id: int) -> Tensors:
        if PERSONAL + self.model.param_names[0] not in client_state:
            return server.model
        return self.personal(client_state)
