"""FedETF: a fixed simplex-ETF classifier, a learnable projection and normalised features.

Li, Shang, He, Lin, Wu. "No Fear of Classifier Biases: Neural Collapse
Inspired Federated Learning with Synthetic and Fixed Classifier." ICCV 2023,
the method section (section and equation numbers not checked against the PDF;
details from the authors' code, github.com/ZexiLee/ICCV-2023-FedETF:
``proto_classifiers.py``, ``client_funct.py``, ``models_dict/cnn.py``).

- Classifier: the simplex equiangular tight frame
  ``M = sqrt(C / (C - 1)) U (I_C - 1_C 1_C^T / C)``, ``U`` a random ``d x C``
  matrix with orthonormal columns (QR of a uniform random matrix, as the code;
  drawn from the run seed): unit-norm columns with pairwise cosine
  ``-1 / (C - 1)``. It is synthetic and fixed: never trained in federated
  training and never averaged (not uploaded; the server keeps its own copy and
  sends it with the model, as the code does; clients could derive it from the
  seed).
- Features: the model's classifier input ``z`` goes through a learnable
  projection layer ``u = W_p z + b_p`` (``d x feature_dim``, averaged like the
  model) and is L2-normalised, ``h = u / ||u||``; the logits are
  ``beta h^T M`` with a learnable temperature ``beta`` (the model's
  ``scaling_train``; averaged). Its initial value in the code depends on the
  model: 10.0 for its CIFAR-10 CNN and VGG (whose ETF has d = 64, the feature
  size), 1.0 for LeNet-5 and the ResNet / DenseNet / MobileNet / EfficientNet
  models (d = C). hetfl's default is 1.0 (``beta_init``); the argument
  ``--scaling_train`` (default 1.0) is FedNH's fixed scale, not this one.
  Deliberate difference: the code's default run (``args.py``: ``--dataset
  cifar10``, ``--local_model CNN``) is ``CNNCifar10``, which starts at 10.0
  (ZexiLee/ICCV-2023-FedETF 092ace3, ``models_dict/cnn.py`` l. 27; ``vgg.py``
  l. 30; 1.0 at ``cnn.py`` l. 66 for LeNet-5 and in ``resnet.py``,
  ``densenet.py``, ``mobilenetv2.py``, ``efficientnet.py``). hetfl has one default
  for every model and its own ``etf_dim`` rule (the feature dimension, not the
  code's per-model 64 or C), so it takes the value the code gives most of its
  architectures, 1.0, rather than the one its CIFAR-10 CNN and VGG carry; the
  paper gives no value (it is not among the papers hetfl holds). ``beta`` is
  learned and averaged either way; set ``beta_init = 10.0`` to match the code's
  CNN / VGG runs.
- Local loss: balanced softmax (Ren et al., NeurIPS 2020),
  ``CE(logits + log n_c, y)`` with ``n_c`` the client's count of class c
  (absent classes count 1, as the code does). The server is FedAvg (over
  encoder, projection and beta).
- Local adaptation for personalisation (the code's
  ``Client_personalization``): from the global model, ``train.local_epochs`` of
  local training as above, then ``pers_cycles`` (20) cycles of
  ``pers_epochs`` (3) epochs of cross-entropy on the ETF classifier alone (SGD
  lr 0.1, no momentum or weight decay) followed by ``pers_epochs`` on the
  projection layer alone (lr 0.05 with the run's momentum and weight decay).
  hetfl runs it through ``personalize_stages`` before every evaluation of the
  clients (the code runs it once, after the last round): it costs
  ``1 + 2 * pers_cycles * pers_epochs / local_epochs`` rounds of local
  training per evaluation, so raise ``train.eval_every`` or set
  ``personalize = false`` when only the global accuracy matters.

hetfl specifics (choices of this implementation):

- ``d`` (``etf_dim``, 0 = the model's feature dimension, at least C): the
  code uses 64 for its CNN (its feature size) and C for LeNet-5.
- The model's own linear classifier is not used in training. After every
  aggregation the server writes into it the linear map with the same argmax as
  FedETF's prediction, ``W = beta M^T W_p`` and ``b = beta M^T b_p``
  (normalising ``u`` scales each sample's logits by ``1 / ||u|| > 0``), so
  every evaluation of the global model (``global_acc``, post-hoc steps,
  analyses) predicts exactly as FedETF; ``global_loss`` is then the
  cross-entropy of these unnormalised logits, not of ``beta h^T M``. For
  models without a classifier bias the projection has no bias either. Each
  client's (personalised) model is evaluated with the exact FedETF logits
  (``predictor``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hetfl.algorithms.base import Algorithm, Batch, ClientContext, ServerState, Stage, Tensors, Upload, cross_entropy
from hetfl.algorithms.logit_adjust import client_counts
from hetfl.params import FLOAT32_MAX, setting
from hetfl.rng import method_generator

ETF, PROJ_W, PROJ_B, BETA = "fedetf.etf", "fedetf.proj.weight", "fedetf.proj.bias", "fedetf.beta"
LOG_COUNTS = "fedetf.log_counts"  # extras: log of the client's class counts (absent classes: log 1)


def simplex_etf(num_classes: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """``M = sqrt(C / (C - 1)) U (I - 11^T / C)`` ``[dim, C]`` with ``U`` the orthonormal factor of a
    uniform random ``dim x C`` matrix (float64; ``dim >= C``)."""
    if dim < num_classes:
        raise ValueError(f"a simplex ETF of {num_classes} classes needs dimension >= {num_classes}, got {dim}")
    u, _ = torch.linalg.qr(torch.rand(dim, num_classes, generator=generator, dtype=torch.float64))
    centring = torch.eye(num_classes, dtype=torch.float64) - 1.0 / num_classes
    return math.sqrt(num_classes / (num_classes - 1)) * u @ centring


def balanced_softmax_loss(logits: torch.Tensor, labels: torch.Tensor, log_counts: torch.Tensor) -> torch.Tensor:
    """Balanced softmax (Ren et al. 2020): ``CE(logits + log n_c, y)``."""
    return cross_entropy(logits + log_counts.to(logits.dtype), labels)


@dataclass(frozen=True)
class FedETFHyper:
    """FedETF settings (Li et al. 2023; defaults from the authors' code).

    etf_dim: dimension d of the ETF and the projection (0 = the model's feature
        dimension, at least the number of classes).
    beta_init: initial learnable temperature (1.0: the code's value for LeNet-5 and its
        ResNets; its CIFAR-10 CNN and VGG, the code's default run, start at 10.0;
        module docstring: why 1.0).
    balanced: balanced-softmax local loss (the paper's); false: cross-entropy.
    personalize: run the local adaptation before each client's evaluation.
    pers_cycles: alternations of ETF and projection fine-tuning (20).
    pers_epochs: epochs of each part per cycle (3).
    pers_etf_lr: lr of the ETF fine-tuning (0.1). pers_proj_lr: of the projection's (0.05).
    """

    etf_dim: int = setting(0, ge=0, doc="ETF / projection dimension (0 = feature dim, >= C)")
    beta_init: float = setting(1.0, gt=0.0, doc="initial learnable temperature beta")
    balanced: bool = setting(True, doc="balanced-softmax local loss")
    personalize: bool = setting(True, doc="local adaptation before each client's evaluation")
    pers_cycles: int = setting(20, when={"personalize": (True,)}, ge=0, doc="ETF/projection fine-tuning cycles")
    pers_epochs: int = setting(3, when={"personalize": (True,)}, ge=1, doc="epochs of each part per cycle")
    pers_etf_lr: float = setting(0.1, when={"personalize": (True,)}, gt=0.0, lt=FLOAT32_MAX,
                                 doc="lr of the ETF fine-tuning")
    pers_proj_lr: float = setting(0.05, when={"personalize": (True,)}, gt=0.0, lt=FLOAT32_MAX,
                                  doc="lr of the projection fine-tuning")


class FedETF(Algorithm):
    name = "fedetf"
    Hyper = FedETFHyper
    citation = "Li et al., ICCV 2023"

    @property
    def with_bias(self) -> bool:
        return "classifier.bias" in self.model.state_names

    def projection_names(self) -> tuple[str, ...]:
        return (PROJ_W, PROJ_B) if self.with_bias else (PROJ_W,)

    def etf_dim(self, feature_dim: int) -> int:
        return max(self.hp.etf_dim or feature_dim, self.setup.num_classes)

    # ------------------------------------------------------------------ model
    def etf_logits(self, state: Tensors, z: torch.Tensor) -> torch.Tensor:
        """``beta normalize(W_p z + b_p)^T M`` for features ``z``."""
        h = F.normalize(F.linear(z, state[PROJ_W], state.get(PROJ_B)), dim=1)
        return state[BETA] * (h @ state[ETF])

    def folded_classifier(self, state: Tensors) -> Tensors:
        """The linear classifier with FedETF's argmax: ``beta M^T W_p`` and ``beta M^T b_p``."""
        m_t = state[ETF].T * state[BETA]
        out = {"classifier.weight": m_t @ state[PROJ_W]}
        if self.with_bias:
            out["classifier.bias"] = m_t @ state[PROJ_B]
        return out

    def memory_needs(self, input_shape: tuple[int, ...], feature_dim: int) -> list[tuple[str, Any, int, str]]:
        """The ETF ``d x C`` and the projection ``d x feature_dim`` (drawn in float64, kept in float32 with a
        client's copy, gradient and momentum: about 24 bytes an entry)."""
        d = self.etf_dim(feature_dim)
        count = d * (self.setup.num_classes + feature_dim + 1)
        return [("algorithm.etf_dim", self.hp.etf_dim, 24 * count, f"FedETF's ETF and projection ({d} dimensions)")]

    # ------------------------------------------------------------------ server
    def init_server(self, model_state: Tensors) -> ServerState:
        classifier = model_state["classifier.weight"]
        feature_dim, dtype, device = classifier.shape[1], classifier.dtype, classifier.device
        d = self.etf_dim(feature_dim)
        etf = simplex_etf(self.setup.num_classes, d, method_generator(self.setup.seed, "fedetf.etf"))
        gen = method_generator(self.setup.seed, "fedetf.projection")
        bound = 1.0 / math.sqrt(feature_dim)  # PyTorch's default Linear initialisation
        extra = {
            ETF: etf.to(dtype=dtype, device=device),
            PROJ_W: ((2 * torch.rand(d, feature_dim, generator=gen, dtype=torch.float64) - 1) * bound).to(
                dtype=dtype, device=device),
            BETA: torch.tensor(self.hp.beta_init, dtype=dtype, device=device),
        }
        if self.with_bias:
            extra[PROJ_B] = ((2 * torch.rand(d, generator=gen, dtype=torch.float64) - 1) * bound).to(
                dtype=dtype, device=device)
        state = {**model_state, **extra}
        return ServerState(model={**state, **self.folded_classifier(state)})

    def aggregate(self, server: ServerState, uploads: list[Upload], round: int) -> ServerState:
        averaged = super().aggregate(server, uploads, round)
        state = {**server.model, **averaged.model}  # the fixed ETF and the classifier come from the server
        return ServerState(model={**state, **self.folded_classifier(state)}, extra=averaged.extra)

    # ------------------------------------------------------------------ client
    def uploaded_names(self) -> tuple[str, ...]:
        classifier = set(self.setup.groups["classifier"])
        own = tuple(n for n in self.model.state_names if n not in classifier)
        return (*own, *self.projection_names(), BETA)

    def trainable_names(self) -> tuple[str, ...]:
        classifier = set(self.setup.groups["classifier"])
        own = tuple(n for n in self.model.param_names if n not in classifier)
        return (*own, *self.projection_names(), BETA)

    def begin(self, ctx: ClientContext) -> Tensors:
        if not self.hp.balanced:
            return {}
        counts = client_counts(ctx, self.setup.num_classes, self.name)
        return {LOG_COUNTS: counts.clamp(min=1.0).log()}

    def start_state(self, ctx: ClientContext) -> Tensors:
        return {name: ctx.payload[name] for name in (*self.model.state_names, *self.projection_names(), BETA, ETF)}

    def local_loss(self, state: Tensors, batch: Batch, log_counts: torch.Tensor | None) -> tuple[torch.Tensor, Tensors]:
        """The local training loss: balanced softmax on ``beta h^T M`` (cross-entropy without counts)."""
        z, _ = self.model.features_and_logits(state, batch.x)
        logits = self.etf_logits(state, z)
        if log_counts is not None:
            loss = balanced_softmax_loss(logits, batch.y, log_counts)
            return loss, {"balanced_ce": loss.detach(), "beta": state[BETA].detach()}
        loss = cross_entropy(logits, batch.y)
        return loss, {"ce": loss.detach(), "beta": state[BETA].detach()}

    def loss(self, state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        return self.local_loss(state, batch, ctx.extras.get(LOG_COUNTS))

    def ce_loss(self, state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        """Plain cross-entropy on FedETF's logits (the local adaptation's loss)."""
        z, _ = self.model.features_and_logits(state, batch.x)
        loss = cross_entropy(self.etf_logits(state, z), batch.y)
        return loss, {"ce": loss.detach()}

    def finish(self, ctx: ClientContext, local: Tensors, steps: int) -> tuple[Tensors, Tensors]:
        return {name: local[name] for name in self.uploaded_names()}, ctx.state

    # ------------------------------------------------------------- evaluation
    def run_notes(self) -> list[str]:
        """The cost of the personalisation, said when a run starts: it runs before every evaluation of the
        clients and is many epochs of local training (on the default data, one thread: 11 s an evaluation against
        0.1 s of a round's training, and FedAvg's whole round 0.07 s; docs audit, benchmarks/results/docs_audit.md)."""
        if not self.hp.personalize or self.hp.pers_cycles == 0:
            return []
        epochs = 2 * self.hp.pers_cycles * self.hp.pers_epochs
        return [f"fedetf: before every evaluation each client is personalised: local training, then {epochs} epochs "
                f"of ETF/projection fine-tuning (algorithm.pers_cycles = {self.hp.pers_cycles} x 2 x "
                f"algorithm.pers_epochs = {self.hp.pers_epochs}): each evaluation costs every client {epochs} epochs "
                "on its data, many times a round of training (on the default data 11 s against 0.1 s); for a quick "
                "run lower algorithm.pers_cycles (e.g. 2), raise train.eval_every, or set "
                "algorithm.personalize = false"]

    def personalize_stages(self, ctx: ClientContext) -> list[Stage]:
        """Local training, then alternating ETF / projection fine-tuning (the code's personalisation)."""
        if not self.hp.personalize:
            return []
        train = self.setup.train
        log_counts = self.begin(ctx).get(LOG_COUNTS)  # evaluation does not run ``begin``

        def local(state: Tensors, batch: Batch, _ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
            return self.local_loss(state, batch, log_counts)

        stages = [Stage("local", local, self.trainable_names(), self.setup.sgd(ctx.lr),
                        epochs=train.local_epochs, steps=train.local_steps)]
        etf_sgd = self.setup.sgd(self.hp.pers_etf_lr, momentum=0.0, weight_decay=0.0)
        proj_sgd = self.setup.sgd(self.hp.pers_proj_lr)
        for _ in range(self.hp.pers_cycles):
            stages.append(Stage("etf", self.ce_loss, (ETF,), etf_sgd, epochs=self.hp.pers_epochs))
            stages.append(Stage("projection", self.ce_loss, self.projection_names(), proj_sgd,
                                epochs=self.hp.pers_epochs))
        return stages

    def predictor(self, state: Tensors, ctx: ClientContext) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Each client's model predicts with the exact FedETF logits (its own, fine-tuned ETF and projection)."""

        def predict(x: torch.Tensor) -> torch.Tensor:
            z, _ = self.model.features_and_logits(state, x)
            return self.etf_logits(state, z)

        return predict
