"""Freeze and FedBABU: a randomly initialised classifier that is never trained.

Freeze (the FedUV paper's baseline, Son et al. CVPR 2024, sec. 5): the
classifier is initialised orthogonally, frozen, and only the encoder is
trained and averaged.

FedBABU (Oh, Kim, Yun. "FedBABU: Toward Enhanced Representation for Federated
Image Classification." ICLR 2022): the same body-only federated training; at
evaluation each client fine-tunes a copy of the global model on its own
training data (the head by default, as in hetfl's issue; ``finetune_part =
"full"`` fine-tunes the whole model, the paper's main setting) before being
evaluated on its own test split.

Departures from the paper/code: the head is initialised orthogonally (the FedUV
paper's Freeze baseline); FedBABU's paper only says "randomly initialized".
FedBABU's fine-tuning default here is the head only (``finetune_part =
"head"``, a deliberate hetfl choice: the cheapest personalisation, and what
the paper's abstract describes, "the head is fine-tuned for
personalization"); the paper's main personalised results fine-tune the whole
network (5 epochs at the training lr; the PDF was not re-read for this note):
set ``finetune_part = "full"`` to reproduce them. Fine-tuning uses the run's
batch size, lr (``finetune_lr = 0``), momentum and weight decay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetfl.algorithms.base import (
    Algorithm,
    ClientContext,
    ServerState,
    Setup,
    Stage,
    Tensors,
    Upload,
    weighted_mean,
)
from hetfl.params import FLOAT32_MAX, ConfigError, above, setting
from hetfl.rng import torch_generator


def orthogonal_(weight: torch.Tensor, generator: torch.Generator, gain: float = 1.0) -> torch.Tensor:
    """Orthogonal matrix of ``weight``'s shape drawn from ``generator`` (Saxe et al. 2014)."""
    rows, cols = weight.shape
    flat = torch.randn(max(rows, cols), min(rows, cols), generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(flat)
    q = q * torch.sign(torch.diagonal(r))  # unique, uniformly distributed
    q = q if rows >= cols else q.T
    return (gain * q[:rows, :cols]).to(weight.dtype).to(weight.device)


@dataclass(frozen=True)
class FreezeHyper:
    """Freeze settings: gain of the orthogonal classifier initialisation."""

    gain: float = setting(1.0, gt=0.0, doc="gain of the orthogonal classifier init")


class Freeze(Algorithm):
    name = "freeze"
    Hyper = FreezeHyper
    citation = "FedUV's baseline, Son et al., CVPR 2024"
    model_requires = ("encoder",)  # the classifier is frozen: only an encoder trains

    def __init__(self, hyper: FreezeHyper, setup: Setup) -> None:
        super().__init__(hyper, setup)
        if not self.trainable_names():
            raise ConfigError("algorithm.name", self.name, "the model has no parameters outside its classifier "
                              "(logistic regression?): nothing to train; use a model with an encoder")

    def classifier_names(self) -> list[str]:
        return self.setup.groups["classifier"]

    def init_server(self, model_state: Tensors) -> ServerState:
        state = dict(model_state)
        gen = torch_generator(self.setup.seed, "init", 1)
        for name in self.classifier_names():
            t = state[name]
            state[name] = orthogonal_(t, gen, self.hp.gain) if t.dim() == 2 else torch.zeros_like(t)
        return ServerState(model=state)

    def trainable_names(self) -> tuple[str, ...]:
        frozen = set(self.classifier_names())
        return tuple(n for n in self.model.param_names if n not in frozen)

    def finish(self, ctx: ClientContext, local: Tensors, steps: int) -> tuple[Tensors, Tensors]:
        frozen = set(self.classifier_names())  # the head never changes: not uploaded
        return {n: local[n] for n in self.model.state_names if n not in frozen}, ctx.state

    def aggregate(self, server: ServerState, uploads: list[Upload], round: int) -> ServerState:
        model = weighted_mean([u.tensors for u in uploads], self.client_weights(uploads))
        model.update({n: server.model[n] for n in self.classifier_names()})
        return ServerState(model=model, extra=server.extra)


@dataclass(frozen=True)
class FedBABUHyper:
    """FedBABU settings (Oh et al. 2022).

    gain: orthogonal init gain of the frozen head.
    finetune_epochs: local fine-tuning epochs before personalised evaluation.
    finetune_part: "head" (classifier only) or "full" (whole model).
    finetune_lr: fine-tuning learning rate (0 = the run's train.lr).
    """

    gain: float = setting(1.0, gt=0.0, doc="gain of the orthogonal classifier init")
    finetune_epochs: int = setting(5, ge=0, doc="fine-tuning epochs at evaluation")
    finetune_part: str = setting("head", when={"finetune_epochs": above(0)}, choices=("head", "full"),
                                 doc="what is fine-tuned")
    finetune_lr: float = setting(0.0, when={"finetune_epochs": above(0)}, ge=0.0, lt=FLOAT32_MAX,
                                 doc="fine-tuning lr (0 = train.lr)")


class FedBABU(Freeze):
    name = "fedbabu"
    Hyper = FedBABUHyper
    citation = "Oh et al., ICLR 2022"

    def personalize_stages(self, ctx: ClientContext) -> list[Stage]:
        return self.finetune_stages(self.hp.finetune_epochs, self.hp.finetune_part, self.hp.finetune_lr)
