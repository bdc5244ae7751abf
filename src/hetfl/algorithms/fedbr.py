"""FedBR: local learning bias reduction with pseudo-data and an adversarial projection.

Guo, Tang, Lin. "FedBR: Improving Federated Learning on Heterogeneous Data via
Local Learning Bias Reduction." ICML 2023, Algorithm 1 and eq. (2)-(7); checked
against the authors' code, LINs-lab/FedBR at commit 3e24f7fa
(``fedbr/algorithms.py`` class ``FedBR``, ``fedbr/algorithms_fed.py``,
``fedbr/scripts/train_fed.py`` at d382a37a), and its defaults against their
latest code commit, 01dc5c6 (2023-06-01; later commits change only the licence).

One pseudo dataset ``D_p`` of ``B`` samples (B = the batch size, 32 in the
paper: "pseudo-data only transfer once (32 pseudo-data)") with soft labels
``q = 1/C`` is built once, before round 1, and sent to every client
(``pseudo_source``, ``pseudo_refresh`` below). At each local step on a real
batch ``x`` a client then takes:

1. max step (eq. 2): the projection head ``theta`` (a d -> 2d -> 2d -> d MLP on
   the classifier-input features, averaged by the server like the model) takes
   one ascent step of its own optimiser on ``L_con`` with the features detached.
   The code computes the features once a step (``all_unlabeled_z``, ``all_self_z``
   on the whole pseudo set and batch) and both steps project them; here the max
   step runs first, so it recomputes them (``max_forward = "step"``): the same
   values, without gradient and without updating BatchNorm running statistics,
   which the min step's forward updates once, as the code's. Before 2026-11-28
   the max step ran a forward of its own on the first ``pairs`` samples of each,
   which updated the statistics a second time each step (and, with fewer pseudo
   samples than the batch, normalised the real features by a part of the batch);
   ``max_forward = "separate"`` keeps that rule, and a run written before reads
   it (``setting(former=...)``). Models without BatchNorm (every FedBR preset's)
   compute the same numbers under both;
2. min step (eq. 3): encoder and classifier take one step on
   ``CE(x, y) + lam * softCE(g(f(P)), q) + mu * L_con``.

``L_con`` (eq. 5-7) pairs pseudo sample i with real sample i of the batch:
``-log(f1 / (f1 + f2))`` with ``f1 = exp(cos(θ(f(P_i)), θ(f_g(P_i))) / tau1)``
(``f_g``: the round's received global model, computed once per round) and
``f2 = exp(cos(θ(f(P_i)), θ(f(x_i))) / tau2)``.

Where ``D_p`` comes from (``pseudo_source``):

- ``"rsm_clients"`` (default; the paper's RSM and the code's
  ``get_augmentation_mean_data``): each pseudo sample is the mean of ``rsm_size``
  (K = 10) samples drawn with replacement from one client chosen uniformly at
  random. In a set-up round every client replays the draw plan from a seed all
  share (it needs only the clients' sizes) and uploads the means assigned to it;
  the server assembles ``D_p`` and sends it to every client. Cost: ``B`` samples
  up in total and ``B`` samples down per client, once (round 1's ``bytes_up`` /
  ``bytes_down``). What it reveals: every client, and the server, sees averages of
  10 of another client's raw inputs (in the model's input space), which expose
  that client's typical content and, through the classes visible in an average,
  its label skew; the paper calls them privacy-protected because each is a mean,
  but no formal guarantee comes with them.
- ``"proxy"``: means of ``rsm_size`` samples drawn with replacement from a proxy
  dataset the server holds (``proxy_dataset``, ``proxy_root``; its own train split,
  normalised with its own statistics, as the code does with its proxy). Nothing
  of the clients' data leaves them; ``B`` samples go down per client.
- ``"per_client"`` (hetfl's earlier variant, kept for comparison): every client
  builds its own ``B`` means from its own data; nothing is sent.

``pseudo_refresh = "every_round"`` is Figure 6(b)'s alternative to transferring
once: a new ``D_p`` each round (``"proxy"``: drawn by the server for each round and
sent in every payload; ``"per_client"``: redrawn by each client).

The kind of pseudo-data (``pseudo``, Figure 6(c)): ``"rsm"`` uses ``D_p`` as it
is; ``"mixture"`` (eq. 4 with K = 1, the code's ``get_unlabeled_by_self``) mixes,
at every step, pseudo sample i 50/50 with the real sample at a random position
of the batch (drawn per step), label ``(1/C + y)/2`` (``y`` the real sample's
one-hot label, or its Mixup label under FedBR + Mixup).

The server averages the participating clients' models and heads with uniform
weights ``1/M`` (the code's ``FedAvg.p = 1``); ``weighting = "size"`` weights them
by their number of samples. FedBR's own ``weighting`` sets its weights whatever the
run-wide ``train.weighting`` (whose default, "size", is for the other methods); the
one contradiction a configuration can state, ``train.weighting = "uniform"`` with
``weighting = "size"``, is refused.

Ablations (Table 4): ``components = "classifier"`` (component 1: the pseudo-data
CE only), ``"features"`` (component 2: ``L_con`` with its max step only),
``max_step = false`` (component 2 without the max step: a fixed random
projection). ``mixup = true`` is "FedBR + Mixup": the real batch is mixed with
a shuffled copy of itself, ``lam ~ Beta(mixup_alpha, mixup_alpha)`` once per
batch (0.2, the code's ``get_new_all_x``).

hetfl's defaults are the authors' latest code's (01dc5c6): Mixup and Mixture off
(the code's ``--use_Mixup`` / ``--use_Mixture`` flags, off unless given; here
``mixup = true``, ``pseudo = "mixture"``), no FedDecorr term (commented out in
``FedBR.update``), and plain SGD without momentum for the model and the head
(``gen_opt``, ``disc_opt``: the run's lr and weight decay), which is
``train.momentum = 0``, hetfl's default. Their first commit, 3e24f7fa, the
snapshot of its CIFAR-100 runs, differed: its ``update`` always applied Mixup
(Beta(0.2, 0.2)), always mixed the pseudo-data, added ``0.1 * FedDecorr`` of the
real features, and gave the head momentum 0.9. Its README's "By default, FedBR
generates 32 pseudo-data (using Mixture)" (unchanged up to 6c4c539) describes that
first commit, whose pseudo-data were means of a proxy dataset mixed with the batch
at every step; since d382a37 the code's Mixture needs ``--use_Mixture`` and its
default is RSM over the clients' data, which hetfl follows (``pseudo = "mixture"``
with ``pseudo_source = "proxy"`` is the README's).

Departures from the paper and the authors' code that remain:

- the head's optimiser is the run's client SGD (``train.momentum``,
  ``train.weight_decay``; lr ``head_lr`` or the client lr), as the latest code's
  ``disc_opt`` (same lr and weight decay, no momentum) at ``train.momentum = 0``;
  with momentum the max step is no longer a plain ascent step;
- a model with dropout draws the max step's masks apart from the min step's (the
  code's two steps share one forward, so one mask);
- the min step's forward runs the real batch before the pseudo-data, the code's
  the pseudo-data first: with BatchNorm the running statistics weigh the two
  batches' statistics the other way round (momentum m: ``m`` for the last one,
  ``m (1 - m)`` for the first), with dropout the masks are drawn in the other
  order; no other model is affected;
- under ``"mixture"`` the code computes the global features once per round on
  the first step's mixed pseudo-data and reuses them at later steps (whose
  mixtures differ); here they are computed at each step from the step's
  mixtures;
- the code's Mixture uses a proxy dataset only when run with ``--use_Mixture``
  (CIFAR-100 for CIFAR-10 runs, CIFAR-10 for CIFAR-100 runs, nothing for
  RotatedMNIST); its RSM uses the clients' data, whatever the paper's text says
  about proxy data;
- the code draws ``D_p`` from all clients' in-splits in one process; the
  federated set-up round here gives the same draws (same plan) when every client
  is non-empty;
- ``"rsm_clients"`` with ``"every_round"`` is refused: it would need every client
  (not only the round's participants) to send new means each round, which no
  hetfl hook does (the code's commented-out regeneration reads all clients' data
  on the server).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hetfl.algorithms.base import (
    SHARED,
    Algorithm,
    Batch,
    ClientContext,
    DrawFn,
    ServerState,
    Setup,
    Stage,
    Tensors,
    Upload,
    check_reply_form,
    cross_entropy,
    weighted_mean,
)
from hetfl.algorithms.fedmix import soft_cross_entropy
from hetfl.algorithms.mixup import LAM, PERM, mix_inputs, mixup_cross_entropy, mixup_draws
from hetfl.algorithms.pseudo_data import Slot, assemble, draw_plan, plan_means, proxy_means
from hetfl.data import datasets
from hetfl.data.augment import to_float
from hetfl.data.base import DatasetError
from hetfl.params import FLOAT32_MAX, ConfigError, setting
from hetfl.rng import method_generator

HEAD = "fedbr.head/"
PSEUDO, PSEUDO_Q, GLOBAL_FEATURES = "fedbr.pseudo", "fedbr.pseudo_q", "fedbr.global_features"
MIX_INDEX = "fedbr.mix_index"  # per step: the batch position each pseudo sample is mixed with ("mixture")


@dataclass(frozen=True)
class FedBRHyper:
    """FedBR settings (Guo et al. 2023; defaults from the paper and the authors' code).

    lam: weight of the pseudo-data soft cross-entropy (component 1), 1.0.
    mu: weight of the contrastive term (component 2), 0.5.
    tau1, tau2: temperatures of f1 and f2; 0.5 (the code multiplies cosines by 2).
    pseudo: "rsm" or "mixture" (sec. 4.3, Figure 6(c)).
    pseudo_source: "rsm_clients", "proxy" or "per_client" (where D_p comes from).
    pseudo_refresh: "once" (the paper's setting) or "every_round" (Figure 6(b)).
    proxy_dataset, proxy_root: the proxy dataset of ``pseudo_source = "proxy"``
        (a registry name such as "cifar10", and the folder or archive of its files).
    num_pseudo: pseudo samples B (0 = train.batch_size, the paper's B).
    rsm_size: samples averaged into one pseudo sample (K = 10).
    weighting: server weights, "uniform" (1/M, the code) or "size" (by samples).
    components: "both", "classifier" (component 1 only) or "features" (component 2 only).
    max_step: train the projection head by the max step (off: a fixed random head).
    head_lr: learning rate of the max step (0 = the round's client lr).
    max_forward: where the max step's features come from: "step" (the values of the step's
        forward: the whole pseudo set and batch in training mode, without updating BatchNorm
        statistics, as the code) or "separate" (hetfl's former rule; see the module docstring).
    mixup: FedBR + Mixup on the real batch.
    mixup_alpha: its Beta(alpha, alpha) parameter, 0.2 as the code.
    """

    lam: float = setting(1.0, ge=0.0, when={"components": ("both", "classifier")}, doc="pseudo-data CE weight lambda")
    mu: float = setting(0.5, ge=0.0, when={"components": ("both", "features")}, doc="contrastive weight mu")
    tau1: float = setting(0.5, gt=0.0, when={"components": ("both", "features")},
                          doc="temperature of the global-pseudo pair")
    tau2: float = setting(0.5, gt=0.0, when={"components": ("both", "features")},
                          doc="temperature of the pseudo-real pair")
    pseudo: str = setting("rsm", choices=("rsm", "mixture"), doc="kind of pseudo-data")
    pseudo_source: str = setting("rsm_clients", choices=("rsm_clients", "proxy", "per_client"),
                                 doc="where the pseudo dataset comes from")
    pseudo_refresh: str = setting("once", choices=("once", "every_round"), doc="send D_p once or each round")
    proxy_dataset: str = setting("", when={"pseudo_source": ("proxy",)}, doc="proxy dataset name")
    proxy_root: str = setting("", when={"pseudo_source": ("proxy",)},
                              doc="proxy dataset files (empty = the dataset's default folder)")
    num_pseudo: int = setting(0, ge=0, doc="pseudo samples (0 = batch size)")
    rsm_size: int = setting(10, ge=1, doc="samples averaged per pseudo sample (K)")
    weighting: str = setting("uniform", choices=("uniform", "size"), doc="server weights of the clients")
    components: str = setting("both", choices=("both", "classifier", "features"), doc="ablation")
    max_step: bool = setting(True, when={"components": ("both", "features")},
                             doc="train the projection head adversarially")
    head_lr: float = setting(0.0, ge=0.0, lt=FLOAT32_MAX,
                             when={"max_step": (True,), "components": ("both", "features")},
                             doc="max-step lr (0 = client lr)")
    max_forward: str = setting("step", choices=("step", "separate"), former="separate",
                               when={"max_step": (True,), "components": ("both", "features")},
                               doc="max-step features: step (the step's forward values, BatchNorm statistics "
                                   "left to the min step, as the code's one forward a step) or separate (a forward "
                                   "of the first pairs of its own that updates them: hetfl before 2026-11-28)")
    mixup: bool = setting(False, doc="FedBR + Mixup on the real batch")
    mixup_alpha: float = setting(0.2, gt=0.0, when={"mixup": (True,)}, doc="Beta(alpha, alpha) of FedBR + Mixup")

    def __post_init__(self) -> None:
        if self.pseudo_source == "proxy" and not self.proxy_dataset:
            raise ConfigError("algorithm.proxy_dataset", self.proxy_dataset,
                              'must name a dataset (e.g. "cifar10") when algorithm.pseudo_source = "proxy"')
        if self.pseudo_source == "rsm_clients" and self.pseudo_refresh == "every_round":
            raise ConfigError("algorithm.pseudo_refresh", self.pseudo_refresh,
                              'with algorithm.pseudo_source = "rsm_clients" only "once" (every client would have to '
                              'send new means each round); use pseudo_source = "proxy" or "per_client"')


def contrastive_loss(
    pseudo_local: torch.Tensor,
    pseudo_global: torch.Tensor,
    real_local: torch.Tensor,
    tau1: float,
    tau2: float,
) -> torch.Tensor:
    """``L_con`` (eq. 7) averaged over pairs: ``-log(f1 / (f1 + f2))`` with
    ``f1 = exp(cos(pseudo_local, pseudo_global) / tau1)`` and
    ``f2 = exp(cos(pseudo_local, real_local) / tau2)`` (inputs already projected)."""
    positive = F.cosine_similarity(pseudo_local, pseudo_global, dim=-1) / tau1
    negative = F.cosine_similarity(pseudo_local, real_local, dim=-1) / tau2
    return (torch.logaddexp(positive, negative) - positive).mean()


def init_head(feature_dim: int, generator: torch.Generator, dtype: torch.dtype, device: torch.device) -> Tensors:
    """The projection head d -> 2d -> 2d -> d with PyTorch's default Linear initialisation
    (U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases), drawn from ``generator``."""
    sizes = [feature_dim, 2 * feature_dim, 2 * feature_dim, feature_dim]
    head: Tensors = {}
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        bound = 1.0 / math.sqrt(fan_in)
        for kind, shape in (("weight", (fan_out, fan_in)), ("bias", (fan_out,))):
            u = torch.rand(shape, generator=generator, dtype=torch.float64)
            head[f"{HEAD}{i}.{kind}"] = ((2 * u - 1) * bound).to(dtype=dtype, device=device)
    return head


def project(state: Tensors, z: torch.Tensor) -> torch.Tensor:
    """The projection head ``theta`` applied to features ``z``."""
    for i in range(3):
        z = F.linear(z, state[f"{HEAD}{i}.weight"], state[f"{HEAD}{i}.bias"])
        if i < 2:
            z = F.relu(z)
    return z


def load_proxy(hp: FedBRHyper, seed: int, cache_dir: str = "") -> tuple[torch.Tensor, Any]:
    """The proxy dataset's training inputs (as stored) and a function making them model inputs
    (normalised with the proxy's own statistics), its decoded files cached in ``cache_dir`` (the run's
    ``data.cache_dir``; '' = the default cache folder). A ConfigError names the setting on failure."""
    try:
        dataset = datasets.load_dataset(hp.proxy_dataset, hp.proxy_root or None, download=False,
                                        cache_dir=cache_dir or None, seed=seed)
    except DatasetError as err:
        raise ConfigError("algorithm.proxy_root", hp.proxy_root,
                          f"must hold the files of algorithm.proxy_dataset = {hp.proxy_dataset!r} ({err})") from None
    info = dataset.info
    x = torch.as_tensor(dataset.train.x)

    def prepare(raw: torch.Tensor) -> torch.Tensor:
        return to_float(raw, info.mean, info.std) if raw.dtype == torch.uint8 else raw.float()

    return x, prepare


class FedBR(Algorithm):
    name = "fedbr"
    Hyper = FedBRHyper
    citation = "Guo, Tang, Lin, ICML 2023"

    def __init__(self, hyper: FedBRHyper, setup: Setup) -> None:
        super().__init__(hyper, setup)
        if setup.train.weighting == "uniform" and hyper.weighting == "size":  # asked for both: refused, not guessed
            raise ConfigError("train.weighting", setup.train.weighting,
                              "contradicts algorithm.weighting = 'size'; FedBR's own key sets its server weights "
                              "(its default, 'uniform', is 1/M as Algorithm 1): drop one of the two")
        self.proxy: tuple[torch.Tensor, Any] | None = None
        if hyper.pseudo_source == "proxy":
            self.proxy = load_proxy(hyper, setup.seed, setup.cache_dir)
            self.check_proxy_fits()

    def check_proxy_fits(self) -> None:
        """A proxy whose images the model cannot take is refused before the run starts."""
        x, prepare = self.proxy  # type: ignore[misc]
        state = {**dict(self.model.module.named_parameters()), **dict(self.model.module.named_buffers())}
        try:
            self.model.reference_features(state, prepare(x[:2]).to(next(iter(state.values())).device))
        except (RuntimeError, ValueError) as err:
            raise ConfigError("algorithm.proxy_dataset", self.hp.proxy_dataset,
                              f"its inputs of shape {tuple(x.shape[1:])} do not fit the model ({err})") from None

    @property
    def uses_features(self) -> bool:
        return self.hp.components in ("both", "features") and self.hp.mu > 0

    @property
    def uses_pseudo_ce(self) -> bool:
        return self.hp.components in ("both", "classifier") and self.hp.lam > 0

    def head_names(self) -> tuple[str, ...]:
        return tuple(f"{HEAD}{i}.{kind}" for i in range(3) for kind in ("weight", "bias"))

    def num_pseudo(self) -> int:
        return self.hp.num_pseudo or self.setup.train.batch_size

    # ------------------------------------------------------------------ server
    def init_server(self, model_state: Tensors) -> ServerState:
        classifier = model_state["classifier.weight"]
        gen = method_generator(self.setup.seed, "fedbr.head")
        head = init_head(classifier.shape[1], gen, classifier.dtype, classifier.device)
        return ServerState(model={**model_state, **head})

    def plan(self) -> list[Slot]:
        """The draw plan of ``D_p`` over the clients' data (``"rsm_clients"``), the same for everyone."""
        gen = method_generator(self.setup.seed, "fedbr.pseudo")
        return draw_plan(self.setup.client_sizes, self.num_pseudo(), self.hp.rsm_size, gen)

    def proxy_pseudo(self, round_: int, device: torch.device) -> torch.Tensor:
        """``D_p`` for round ``round_`` from the proxy dataset (the server's draws)."""
        x, prepare = self.proxy  # type: ignore[misc]
        gen = method_generator(self.setup.seed, "fedbr.proxy", round_)
        return proxy_means(x, self.num_pseudo(), self.hp.rsm_size, gen, prepare).to(device)

    def setup_query(self, ctx: ClientContext) -> Tensors:
        """Set-up round, client side: under ``"rsm_clients"`` the means of ``D_p`` assigned to this
        client by the shared plan (possibly none); otherwise nothing."""
        if self.hp.pseudo_source != "rsm_clients":
            return {}
        return {PSEUDO: plan_means(self.plan(), ctx.client_id, ctx.inputs().x)}

    def check_setup_reply(self, client: int, reply: Tensors) -> None:
        """A client's set-up reply as :meth:`setup_query` makes it: under ``"rsm_clients"`` the means of its slots
        of the plan (inputs of the data's shape, finite), otherwise nothing."""
        if self.hp.pseudo_source != "rsm_clients":
            check_reply_form(reply, {}, {})
            return
        slots = sum(slot.client == client for slot in self.plan())
        check_reply_form(reply, {PSEUDO: (slots, *self.setup.input_shape)}, {PSEUDO: (torch.float32,)})

    def setup_reply_needed(self, client: int) -> bool:
        """Under ``"rsm_clients"``, a client the plan assigns pseudo samples to: ``D_p`` is not whole without it."""
        return self.hp.pseudo_source == "rsm_clients" and any(slot.client == client for slot in self.plan())

    def setup_aggregate(self, server: ServerState, replies: dict[int, Tensors]) -> ServerState:
        """Set-up round, server side: ``D_p`` assembled (``"rsm_clients"``) or drawn from the proxy,
        stored to be sent once (``shared/``) or in round 1's payload (``"every_round"``)."""
        device = server.model["classifier.weight"].device
        if self.hp.pseudo_source == "rsm_clients":
            pseudo = assemble(self.plan(), {c: r[PSEUDO] for c, r in replies.items()}).to(device)
        elif self.hp.pseudo_source == "proxy":
            pseudo = self.proxy_pseudo(1, device)
        else:
            return server
        key = SHARED + PSEUDO if self.hp.pseudo_refresh == "once" else PSEUDO
        return ServerState(model=server.model, extra={**server.extra, key: pseudo})

    def payload(self, server: ServerState, client_id: int) -> Tensors:
        if PSEUDO in server.extra:  # "every_round": this round's D_p travels with the model
            return {**server.model, PSEUDO: server.extra[PSEUDO]}
        return server.model

    def aggregate(self, server: ServerState, uploads: list[Upload], round: int) -> ServerState:
        """Average of the uploads, weights ``1/M`` (the code) or by size; a new proxy ``D_p``
        for the next round under ``"every_round"``."""
        weights = [1.0] * len(uploads) if self.hp.weighting == "uniform" else [u.num_samples for u in uploads]
        model = weighted_mean([u.tensors for u in uploads], weights)
        extra = dict(server.extra)
        if PSEUDO in extra and self.hp.pseudo_source == "proxy":
            extra[PSEUDO] = self.proxy_pseudo(round + 1, extra[PSEUDO].device)
        return ServerState(model=model, extra=extra)

    # ------------------------------------------------------------------ client
    def pseudo_data(self, ctx: ClientContext) -> torch.Tensor:
        """This round's ``D_p``: as received (once, or in this round's payload) or, under
        ``"per_client"``, the client's own means (redrawn each round under ``"every_round"``)."""
        # a fresh copy: a tensor read back from a checkpoint may sit at an address whose alignment
        # changes the rounding of the matrix products, and a resumed run must repeat the run exactly
        if PSEUDO in ctx.shared:
            return ctx.shared[PSEUDO].clone()
        if PSEUDO in ctx.payload:
            return ctx.payload[PSEUDO].clone()
        x = ctx.inputs().x
        coords = (ctx.client_id,) if self.hp.pseudo_refresh == "once" else (ctx.client_id, ctx.round)
        gen = method_generator(self.setup.seed, "fedbr.own_pseudo", *coords)
        plan = draw_plan([len(x)], self.num_pseudo(), self.hp.rsm_size, gen)
        return plan_means(plan, 0, x)

    def begin(self, ctx: ClientContext) -> Tensors:
        """``D_p``, its labels ``1/C`` and (``"rsm"``) its features under the received global model."""
        pseudo = self.pseudo_data(ctx)
        c = self.setup.num_classes
        extras = {PSEUDO: pseudo, PSEUDO_Q: torch.full((len(pseudo), c), 1.0 / c, device=pseudo.device)}
        if self.uses_features and self.hp.pseudo == "rsm":
            extras[GLOBAL_FEATURES] = self.model.reference_features(ctx.payload, pseudo)
        return extras

    def start_state(self, ctx: ClientContext) -> Tensors:
        return {name: ctx.payload[name] for name in (*self.model.state_names, *self.head_names())}

    def real_inputs(self, batch: Batch) -> torch.Tensor:
        return mix_inputs(batch) if self.hp.mixup else batch.x

    def real_targets(self, batch: Batch) -> torch.Tensor:
        """Soft labels of the (mixed) real batch."""
        onehot = F.one_hot(batch.y, self.setup.num_classes).float()
        if not self.hp.mixup:
            return onehot
        lam = batch.draws[LAM]
        return lam * onehot + (1 - lam) * onehot[batch.draws[PERM]]

    def pseudo_batch(self, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(pseudo inputs, their soft labels, number of pseudo/real pairs) for this step."""
        pseudo, q = ctx.extras[PSEUDO], ctx.extras[PSEUDO_Q]
        pairs = min(len(pseudo), len(batch.y))
        if self.hp.pseudo == "mixture":  # eq. 4 with K = 1: each with the real sample at a drawn position
            index = batch.draws[MIX_INDEX][: len(pseudo)]
            pseudo = (pseudo + self.real_inputs(batch)[index]) / 2
            q = (q + self.real_targets(batch)[index].to(q)) / 2
        return pseudo, q, pairs

    def global_features(self, ctx: ClientContext, pseudo: torch.Tensor, pairs: int) -> torch.Tensor:
        if GLOBAL_FEATURES in ctx.extras:
            return ctx.extras[GLOBAL_FEATURES][:pairs]
        return self.model.reference_features(ctx.payload, pseudo[:pairs])

    def max_loss(self, state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        """The max step's objective, ``-L_con`` over the head with features detached (eq. 2).

        ``max_forward = "step"``: the features the min step's forward gives (the whole pseudo set and
        batch, training mode), without gradient and without updating BatchNorm statistics (the min
        step's forward does, once a step, as the code's one forward a step); ``"separate"``: a forward
        of the first ``pairs`` samples of each, which updates them too (hetfl's former rule)."""
        pseudo, _, pairs = self.pseudo_batch(batch, ctx)
        if self.hp.max_forward == "step":
            z_pseudo = self.model.reference_features(state, pseudo)[:pairs]
            z_real = self.model.reference_features(state, self.real_inputs(batch))[:pairs]
        else:
            z_pseudo = self.model.features_and_logits(state, pseudo[:pairs])[0].detach()
            z_real = self.model.features_and_logits(state, self.real_inputs(batch)[:pairs])[0].detach()
        z_global = self.global_features(ctx, pseudo, pairs)
        con = contrastive_loss(project(state, z_pseudo), project(state, z_global), project(state, z_real),
                               self.hp.tau1, self.hp.tau2)
        return -con, {"contrastive": con.detach()}

    def loss(self, state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        """The min step's objective (eq. 3)."""
        x = self.real_inputs(batch)
        z_real, logits = self.model.features_and_logits(state, x)
        ce = mixup_cross_entropy(logits, batch) if self.hp.mixup else cross_entropy(logits, batch.y)
        loss, metrics = ce, {"ce": ce.detach()}
        if not (self.uses_pseudo_ce or self.uses_features):
            return loss, metrics
        pseudo, q, pairs = self.pseudo_batch(batch, ctx)
        z_pseudo, pseudo_logits = self.model.features_and_logits(state, pseudo)
        if self.uses_pseudo_ce:
            pseudo_ce = soft_cross_entropy(pseudo_logits, q)
            loss = loss + self.hp.lam * pseudo_ce
            metrics["pseudo_ce"] = pseudo_ce.detach()
        if self.uses_features:
            z_global = self.global_features(ctx, pseudo, pairs)
            con = contrastive_loss(project(state, z_pseudo[:pairs]), project(state, z_global),
                                   project(state, z_real[:pairs]), self.hp.tau1, self.hp.tau2)
            loss = loss + self.hp.mu * con
            metrics["contrastive"] = con.detach()
        return loss, metrics

    def draws(self) -> DrawFn | None:
        """Per-step random numbers: Mixup's (FedBR + Mixup) and the mixture positions."""
        mixup = mixup_draws(self.hp.mixup_alpha) if self.hp.mixup else None
        mixture = self.hp.pseudo == "mixture" and (self.uses_pseudo_ce or self.uses_features)
        if mixup is None and not mixture:
            return None
        count = self.num_pseudo()

        def draw(generator: torch.Generator, batch_size: int) -> Tensors:
            out = mixup(generator, batch_size) if mixup is not None else {}
            if mixture:
                out[MIX_INDEX] = torch.randint(0, batch_size, (count,), generator=generator)
            return out

        return draw

    def stages(self, ctx: ClientContext) -> list[Stage]:
        train = self.setup.train
        adversary = None
        if self.uses_features and self.hp.max_step:
            adversary = Stage("max", self.max_loss, self.head_names(), self.setup.sgd(self.hp.head_lr or ctx.lr))
        return [
            Stage(
                name="min",
                loss=self.loss,
                trainable=self.model.param_names,
                sgd=self.setup.sgd(ctx.lr),
                epochs=train.local_epochs,
                steps=train.local_steps,
                draws=self.draws(),
                adversary=adversary,
            )
        ]

    def finish(self, ctx: ClientContext, local: Tensors, steps: int) -> tuple[Tensors, Tensors]:
        return {name: local[name] for name in (*self.model.state_names, *self.head_names())}, ctx.state
