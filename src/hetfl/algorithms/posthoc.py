"""Post-hoc steps: server-side procedures run after federated training, composable
with any trainer through ``+`` (``fedavg+ccvr``, ``moon+ccvr``).

A step has one client hook and one server hook, so that it runs unchanged in
one process or as a query round of a real federation:

``client_query(model_state, features, labels, client=, round_=)``
    what a client computes from its own training data, given the features the
    current global encoder gives them (eval mode, no augmentation); the
    returned tensors are what it uploads (``client`` and ``round_`` name the
    client's own random stream, e.g. for differential-privacy noise).
``apply(server, replies, round)``
    the new server state from all clients' replies, plus numbers to log.

Additive steps (``additive = True``, CCVR) need only the SUM of the clients'
replies. Such a step can run under secure aggregation: each reply is made dense
(``dense_reply``: the same tensors and shapes at every client), bounded by the
public ``reply_bounds``, encoded in fixed point and summed so that the server
learns the sum alone; ``apply`` then receives a :class:`SummedReplies` instead of
the replies by client.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from hetfl.algorithms.base import NoHyper, PrivateReleases, ServerState, Setup, Tensors
from hetfl.rng import torch_generator


@dataclass(frozen=True)
class SummedReplies:
    """What a server learns from an additive step's round under secure aggregation: the sum of the
    dense replies (``PostHoc.dense_reply``) of ``clients``, and nothing about any one of them."""

    total: Tensors
    clients: tuple[int, ...]


Replies = Mapping[int, Tensors] | SummedReplies  # replies by client, or (secure aggregation) their sum


class PostHoc(PrivateReleases):
    """Base class of post-hoc steps. ``every_round`` steps also run after each round.

    ``needs_global_model``: the step works on the server's single global model (its
    encoder gives the clients' features, its classifier is what it changes); such a step
    is refused after a personalised method (``Algorithm.personalized``) at configuration
    time (``hetfl.algorithms.composition_error``). A step that handles personalised
    models itself sets it to False.
    """

    name: ClassVar[str] = ""
    Hyper: ClassVar[type] = NoHyper
    citation: ClassVar[str] = ""
    needs_global_model: ClassVar[bool] = True
    # model parts (keys of base.MODEL_PARTS) the step cannot work without; checked when a run is set up
    model_requires: ClassVar[tuple[str, ...]] = ()
    # the server needs only the sum of the replies (``dense_reply``, ``reply_bounds``): secure aggregation applies
    additive: ClassVar[bool] = False

    def __init__(self, hyper: Any, setup: Setup) -> None:
        self.hp = hyper
        self.setup = setup

    @property
    def every_round(self) -> bool:
        return bool(getattr(self.hp, "every_round", False))

    def client_query(self, model_state: Tensors, features: torch.Tensor, labels: torch.Tensor, *, client: int,
                     round_: int) -> Tensors:
        raise NotImplementedError

    def dense_reply(self, reply: Tensors) -> Tensors:
        """An additive step's reply with the same tensor names and shapes at every client (float64), so that
        replies can be summed entry by entry (secure aggregation)."""
        raise NotImplementedError(f"{self.name} is not additive")

    def reply_bounds(self) -> dict[str, float]:
        """A public bound on ``|entry|`` of each tensor of a dense reply (by name): the range of its
        fixed-point encoding under secure aggregation. Known to every party before the round; values
        beyond it are clipped."""
        raise NotImplementedError(f"{self.name} is not additive")

    def apply(self, server: ServerState, replies: Replies, round_: int) -> tuple[ServerState, dict]:
        raise NotImplementedError

    def check_reply(self, reply: Tensors, model_state: Tensors) -> None:
        """What the server checks of one client's reply before ``apply`` reads it, where the reply crossed a
        network (a Flower node may run another hetfl version or a faulty plug-in): a ValueError saying what in
        ``reply`` is not what ``client_query`` returns for the global model ``model_state``, so that the server
        leaves that client out instead of stopping in ``apply``. Accepts any reply by default."""

    def memory_needs(self, feature_dim: int) -> list[tuple[str, Any, int, str]]:
        """What the step's settings make it hold in host memory for features of ``feature_dim`` entries, as
        ``(key, value, bytes, what)`` (``hetfl.engine.resources.require`` refuses a total past the machine's
        memory when a run is set up, naming the key); none by default."""
        return []


@dataclass(frozen=True)
class ClassifierTraining:
    """SGD settings for re-training the classifier on fixed features."""

    epochs: int
    lr: float
    momentum: float
    weight_decay: float
    batch_size: int


def retrain_classifier(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    features: torch.Tensor,
    labels: torch.Tensor,
    cfg: ClassifierTraining,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Cross-entropy SGD (momentum, weight decay) of a linear classifier on fixed features,
    starting from ``(weight, bias)``; batches shuffled by ``generator``. Returns new tensors."""
    w = weight.detach().clone().requires_grad_()
    b = bias.detach().clone().requires_grad_() if bias is not None else None
    params = [p for p in (w, b) if p is not None]
    opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    x = features.to(weight.device, weight.dtype)
    y = labels.to(weight.device)
    with torch.enable_grad():
        for _ in range(cfg.epochs):
            order = torch.randperm(len(y), generator=generator).to(weight.device)
            for start in range(0, len(y), cfg.batch_size):
                idx = order[start : start + cfg.batch_size]
                loss = F.cross_entropy(F.linear(x[idx], w, b), y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
    return w.detach(), (b.detach() if b is not None else None)


def stream(setup: Setup, round_: int, step: str) -> torch.Generator:
    """The random stream of a post-hoc step in a round (independent of client execution)."""
    import zlib

    return torch_generator(setup.seed, "algorithm", round_, zlib.crc32(step.encode()))
