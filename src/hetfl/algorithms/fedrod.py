"""Fed-RoD: a generic model trained with balanced softmax plus a personal head.

Chen, Chao. "On Bridging Generic and Personalized Federated Learning for Image
Classification." ICLR 2022 (the linear personal head, "Fed-RoD (linear)").
The feature extractor ``f`` and the generic head ``g`` are shared and
averaged (FedAvg); client i trains them with the balanced softmax loss
(Ren et al., NeurIPS 2020), cross-entropy on logits shifted by the log of
its class prior,

    ``L_BSM = CE(g(f(x)) + log pi_i, y)``,  ``pi_i[c] = n_i[c] / n_i``,

so that the generic model estimates the class-balanced posterior. Its
personal head ``p_i`` (client store, ``fedrod.head/classifier.{weight,bias}``)
is a linear layer on the same features, trained at the same time on

    ``L_P = CE(stopgrad(g(f(x))) + p_i(stopgrad(f(x))), y)``,

so that it only corrects the generic logits for the client's own
distribution and never changes the shared parts. The personalised prediction
is ``g(f(x)) + p_i(f(x))``: both heads are linear on the same features, so the
evaluated model is the global model with classifier ``W_g + W_p``,
``b_g + b_p``. The generic model is evaluated too (``global_acc``).

Departures from the paper/code: absent classes get the finite log prior
log(1e-12) = -27.6 instead of log 0 = -inf (the same effect: they leave the
local balanced softmax). Consequence of the method, not a bug: a client that
holds a single class has a zero balanced-softmax loss and teaches the generic
model nothing, so on data where most samples sit on single-class clients (the
default Synthetic data: 78% of the samples) the generic head stays near chance
(benchmarks/results/below_chance.md) while the personalised heads do well.
Only the linear personal head ("Fed-RoD (linear)") is offered, not the
hypernetwork head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetfl.algorithms.base import Algorithm, Batch, ClientContext, ServerState, Stage, Tensors, cross_entropy
from hetfl.params import setting

HEAD = "fedrod.head/"
LOG_PRIOR = "log_prior"


@dataclass(frozen=True)
class FedRoDHyper:
    """Fed-RoD settings (Chen & Chao 2022).

    balanced: train the generic head with the balanced softmax (default, the
        paper's choice); false uses plain cross-entropy (an ablation).
    The personal head starts at zero, so a client's first personalised
    prediction is the generic one.
    """

    balanced: bool = setting(True, doc="balanced softmax for the generic head (false: plain CE)")


def log_class_prior(labels: torch.Tensor, num_classes: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``log(n_c / n)`` per class; absent classes get a very negative finite value (log 1e-12)."""
    counts = torch.bincount(labels, minlength=num_classes).to(dtype)
    return torch.log((counts / counts.sum().clamp(min=1)).clamp(min=1e-12))


class FedRoD(Algorithm):
    name = "fedrod"
    Hyper = FedRoDHyper
    citation = "Chen & Chao, ICLR 2022"
    personalized = False  # the generic model is meaningful and evaluated too

    @property
    def head_names(self) -> list[str]:
        return self.setup.groups["classifier"]

    def init_client_state(self, client_id: int, server: ServerState) -> Tensors:
        return {HEAD + n: torch.zeros_like(server.model[n]) for n in self.head_names}

    def begin(self, ctx: ClientContext) -> Tensors:
        """The client's class prior, from the labels of its whole training set."""
        if ctx.inputs is None:
            raise ValueError("fedrod needs the client's labels (ClientContext.inputs)")
        labels = ctx.inputs().y
        return {LOG_PRIOR: log_class_prior(labels, self.setup.num_classes).to(labels.device)}

    def start_state(self, ctx: ClientContext) -> Tensors:
        return {**{n: ctx.payload[n] for n in self.model.state_names}, **ctx.state}

    def loss(self, state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        z, generic = self.model.features_and_logits(state, batch.x)
        shifted = generic + ctx.extras[LOG_PRIOR] if self.hp.balanced else generic
        bsm = cross_entropy(shifted, batch.y)
        personal = F.linear(z.detach(), state[HEAD + "classifier.weight"], state.get(HEAD + "classifier.bias"))
        ce_personal = cross_entropy(generic.detach() + personal, batch.y)
        return bsm + ce_personal, {"bsm": bsm.detach(), "ce_personal": ce_personal.detach()}

    def stages(self, ctx: ClientContext) -> list[Stage]:
        (stage,) = super().stages(ctx)
        stage.trainable = self.model.param_names + tuple(HEAD + n for n in self.head_names)
        return [stage]

    def finish(self, ctx: ClientContext, local: Tensors, steps: int) -> tuple[Tensors, Tensors]:
        upload = {n: local[n] for n in self.model.state_names}
        return upload, {HEAD + n: local[HEAD + n] for n in self.head_names}

    def client_model(self, server: ServerState, client_state: Tensors, client_id: int) -> Tensors:
        """The generic model with the personal head added to its classifier."""
        if not all(HEAD + n in client_state for n in self.head_names):
            return server.model
        state = dict(server.model)
        state.update({n: server.model[n] + client_state[HEAD + n] for n in self.head_names})
        return state
