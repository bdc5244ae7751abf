"""Partial model sharing: part of the model is averaged, the rest stays on each client.

Every hetfl model is ``encoder -> [projector] -> classifier``; these methods
split it along those parts. The personal part of client i lives in the client
store (``<method>.personal/<name>``), starts as the common initial model, is
never sent, and is combined with the server's shared part for training and
for evaluation on the client's own test split (``personalized = True``).

FedPer (Arivazhagan, Aggarwal, Singh, Choudhary. "Federated Learning with
    Personalization Layers." arXiv:1912.00818, 2019): base layers (encoder and
    projector) shared, personalisation layers (the classifier) personal; the
    whole model is trained jointly for E local epochs, only the base is
    uploaded and averaged, ``w_B = sum_i n_i/n w_B,i``.
FedRep (Collins, Hassani, Mokhtari, Shakkottai. "Exploiting Shared
    Representations for Personalized Federated Learning." ICML 2021,
    Algorithm 1): the same split; per round, first ``tau_h`` epochs on the
    personal head with the representation frozen, ``h_i <- GRD(f_i(h, phi^t), h, eta)``,
    then ``tau_phi`` epochs on the representation with the new head frozen,
    ``phi_i <- GRD(f_i(h_i, phi), phi, eta)``; only ``phi`` is averaged.
LG-FedAvg (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov,
    Morency. "Think Locally, Act Globally: Federated Learning with Local and
    Global Representations." arXiv:2001.01523, 2020): the
    opposite split; the representation (encoder) is local, the top layers
    (projector and classifier) are global and averaged.

Departures from the paper/code: FedRep's default split is 10 head epochs then 1
body epoch per round. In the authors' code (``Update.py``: ``head_eps =
local_ep - local_rep_ep``, head first) the argparse defaults ``local_ep = 10``,
``local_rep_ep = 1`` give 9 + 1; their FEMNIST / Sent140 scripts
(``--local_ep 15 --local_rep_ep 5``) 10 + 5; a CIFAR-10 script of code built on
theirs (FedBKD) ``--local_ep 11 --local_rep_ep 1``, i.e. 10 + 1 (the authors'
own CIFAR scripts were not found in the code index). Both stages use the run's optimiser
settings (the authors' code: SGD momentum 0.5, weight decay 1e-4 on weights
only). FedPer and LG-FedAvg split at hetfl's model parts (classifier;
encoder), the papers at a per-architecture number of layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetfl.algorithms.base import Algorithm, ClientContext, ServerState, Setup, Stage, Tensors, Upload, weighted_mean
from hetfl.params import ConfigError, setting


def part_names(setup: Setup, parts: tuple[str, ...]) -> tuple[str, ...]:
    """State names (parameters and buffers) of the model parts ``parts``, in state order.

    Parameters come from ``setup.groups``; a buffer belongs to the part its name starts with.
    """
    params = {n for part in parts for n in setup.groups.get(part, [])}
    model = setup.model
    return tuple(n for n in model.state_names
                 if n in params or (n in model.buffer_names and n.split(".", 1)[0] in parts))


class PartialSharing(Algorithm):
    """Shared part averaged on the server, personal part kept in the client store.

    Subclasses set ``prefix`` and ``split_key`` (the setting that names the
    personal parts, for error messages) and implement :meth:`personal_parts`.
    """

    personalized = True
    model_requires = ("encoder",)  # the model is split between encoder and classifier (and projector)
    prefix = "partial"
    split_key = "personal"

    def __init__(self, hyper: object, setup: Setup) -> None:
        super().__init__(hyper, setup)
        personal = set(self.personal_names())
        value = getattr(hyper, self.split_key)
        if not any(n in personal for n in self.model.param_names):
            raise ConfigError(f"algorithm.{self.split_key}", value, "the model has no parameters in that part")
        if all(n in personal for n in self.model.param_names):
            raise ConfigError(f"algorithm.{self.split_key}", value, "nothing of the model would be shared")

    def personal_parts(self) -> tuple[str, ...]:
        raise NotImplementedError

    def personal_names(self) -> tuple[str, ...]:
        return part_names(self.setup, self.personal_parts())

    def shared_names(self) -> tuple[str, ...]:
        personal = set(self.personal_names())
        return tuple(n for n in self.model.state_names if n not in personal)

    def personal_params(self) -> tuple[str, ...]:
        personal = set(self.personal_names())
        return tuple(n for n in self.model.param_names if n in personal)

    def shared_params(self) -> tuple[str, ...]:
        personal = set(self.personal_names())
        return tuple(n for n in self.model.param_names if n not in personal)

    @property
    def key(self) -> str:
        return f"{self.prefix}.personal/"

    # --------------------------------------------------------------- server
    def payload(self, server: ServerState, client_id: int) -> Tensors:
        return {n: server.model[n] for n in self.shared_names()}

    def aggregate(self, server: ServerState, uploads: list[Upload], round: int) -> ServerState:
        mean = weighted_mean([u.tensors for u in uploads], self.client_weights(uploads))
        return ServerState(model={**server.model, **mean}, extra=server.extra)

    # --------------------------------------------------------------- client
    def init_client_state(self, client_id: int, server: ServerState) -> Tensors:
        # the personal part starts from the common initial model (the server never updates it)
        return {self.key + n: server.model[n].clone() for n in self.personal_names()}

    def start_state(self, ctx: ClientContext) -> Tensors:
        state = {n: ctx.payload[n] for n in self.shared_names()}
        state.update({n: ctx.state[self.key + n] for n in self.personal_names()})
        return state

    def finish(self, ctx: ClientContext, local: Tensors, steps: int) -> tuple[Tensors, Tensors]:
        upload = {n: local[n] for n in self.shared_names()}
        return upload, {self.key + n: local[n] for n in self.personal_names()}

    # ----------------------------------------------------------- evaluation
    def client_model(self, server: ServerState, client_state: Tensors, client_id: int) -> Tensors:
        state = dict(server.model)
        state.update({n: client_state[self.key + n] for n in self.personal_names()})
        return state


HEAD_CHOICES = {"classifier": ("classifier",), "projector+classifier": ("projector", "classifier")}
LOCAL_CHOICES = {"encoder": ("encoder",), "encoder+projector": ("encoder", "projector")}


@dataclass(frozen=True)
class FedPerHyper:
    """FedPer settings (Arivazhagan et al. 2019).

    personal: the personalisation layers, "classifier" (default: the last
        layer, one personalisation layer, as in the FedRep and FedPAC
        comparisons) or "projector+classifier" (the top two parts, on models
        with a projector).
    """

    personal: str = setting("classifier", choices=tuple(HEAD_CHOICES), doc="personal layers")


class FedPer(PartialSharing):
    name = "fedper"
    Hyper = FedPerHyper
    citation = "Arivazhagan et al., arXiv 2019"
    prefix = "fedper"

    def personal_parts(self) -> tuple[str, ...]:
        return HEAD_CHOICES[self.hp.personal]


@dataclass(frozen=True)
class FedRepHyper:
    """FedRep settings (Collins et al. 2021; defaults from the paper and its code).

    personal: the head, "classifier" (default, the paper's last layer) or
        "projector+classifier".
    head_epochs: tau_h, epochs on the head with the body frozen (10, the
        paper's and code's ``local_ep``).
    body_epochs: tau_phi, epochs on the body with the head frozen (1, the
        code's ``local_rep_ep``); 0 means the run's ``train.local_epochs`` /
        ``train.local_steps``.
    Both stages use the run's learning rate, momentum and weight decay.
    """

    personal: str = setting("classifier", choices=tuple(HEAD_CHOICES), doc="personal head")
    head_epochs: int = setting(10, ge=0, doc="head epochs per round, body frozen")
    body_epochs: int = setting(1, ge=0, doc="body epochs per round, head frozen (0 = train.local_epochs)")


class FedRep(PartialSharing):
    name = "fedrep"
    Hyper = FedRepHyper
    citation = "Collins et al., ICML 2021"
    prefix = "fedrep"

    def personal_parts(self) -> tuple[str, ...]:
        return HEAD_CHOICES[self.hp.personal]

    def stages(self, ctx: ClientContext) -> list[Stage]:
        """Head first (body frozen), then body (head frozen), as FedRep's Algorithm 1."""
        sgd, train = self.setup.sgd(ctx.lr), self.setup.train
        stages = []
        if self.hp.head_epochs:
            stages.append(Stage("head", self.loss, self.personal_params(), sgd, epochs=self.hp.head_epochs))
        if self.hp.body_epochs:
            stages.append(Stage("body", self.loss, self.shared_params(), sgd, epochs=self.hp.body_epochs))
        else:
            stages.append(Stage("body", self.loss, self.shared_params(), sgd, epochs=train.local_epochs,
                                steps=train.local_steps))
        return stages


@dataclass(frozen=True)
class LGFedAvgHyper:
    """LG-FedAvg settings (Liang et al. 2020).

    local: the local representation, "encoder" (default: everything below the
        top layers; the projector, if any, stays global with the classifier)
        or "encoder+projector".
    """

    local: str = setting("encoder", choices=tuple(LOCAL_CHOICES), doc="local (personal) layers")


class LGFedAvg(PartialSharing):
    name = "lgfedavg"
    Hyper = LGFedAvgHyper
    citation = "Liang et al., arXiv 2020"
    prefix = "lgfedavg"
    split_key = "local"

    def personal_parts(self) -> tuple[str, ...]:
        return LOCAL_CHOICES[self.hp.local]
