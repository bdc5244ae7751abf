"""FedPAC: personalised FL by feature alignment and classifier collaboration.

Xu, Tong, Huang. "Personalized Federated Learning with Feature Alignment and
Classifier Collaboration." ICLR 2023, Algorithm 1; details the paper leaves
open follow the authors' code (github.com/JianXu95/FedPAC, commit 7cf08f3e:
``methods/fedpac.py``, ``tools.py``, ``running.py``). The encoder is shared,
each client keeps its own classifier. Per round, client i:

1. with the received encoder and its own (personalised) classifier, BEFORE
   training, computes on its training data (features = classifier input,
   eval mode, no augmentation) ``h_i[k] = pi_k mu_k`` and the scalar
   ``v_i = [sum_k pi_k tr(E[z z^T | k]) - sum_k pi_k^2 ||mu_k||^2] / n_i``
   (``statistics_extraction`` in the code);
2. trains its classifier alone for one epoch (authors: lr 0.1, momentum 0.5,
   weight decay 5e-4);
3. trains the encoder for E epochs with the classifier frozen on
   ``CE + lam * mean ||f(x) - c_y||^2 / d`` (the feature-alignment regulariser
   R_i, towards the global centroid of class y, or the client's own class mean
   when the server has none; off until the server has centroids);
4. uploads the encoder, its classifier, per class its count and the sum of its
   features after training (the centroid ``c_hat_{i,k}`` times the count, in
   float64), and ``h_i``, ``v_i``.

Server: encoder = data-size-weighted mean; centroid of class k = the clients'
feature sums of class k summed, divided by their counts summed: the mean of the
client centroids weighted by the clients' counts of class k (the code's
``protos_aggregation``) from additive uploads; for each participating client i,
the weights ``alpha_i = argmin a^T P_i a`` on the simplex, ``P_i = diag(v) + D_i`` with
``D_i[j1, j2] = sum_k <h_i[k] - h_j1[k], h_i[k] - h_j2[k]>`` (eq. 11; the code's
``get_head_agg_weight``), combine the uploaded classifiers into client i's
personalised classifier. As in the code:

- if ``P_i`` has a negative eigenvalue it is replaced by its eigen-components
  with eigenvalue >= ``qp_eig_floor`` (0.01);
- weights <= ``min_weight`` (1e-3) are zeroed and the rest renormalised
  (``agg_classifier_weighted_p`` divides by their sum);
- when there is no solution the client keeps its own classifier.

Evaluation: each client's encoder + personalised classifier on its own test
split.

What the server needs additively and what per client (for secure aggregation,
where a server learns only the sum over clients):

- additive: the per-class counts and feature sums (``fedpac.counts``,
  ``fedpac.centroid_sums``); the server needs only their sums over clients, the
  global centroids. (The encoder's data-size-weighted mean is a sum too,
  ``sum_i n_i theta_i / sum_i n_i``; it is sent as each client's parameters here,
  as in every FedAvg-style method of hetfl.)
- per client, and why: ``h_i``, ``v_i`` and the classifier. Client i's QP matrix
  ``P_i = diag(v) + D_i`` holds every participant's own ``v_j`` on its diagonal
  and, in ``D_i[j1, j2] = sum_k <h_i[k] - h_j1[k], h_i[k] - h_j2[k]>``, inner
  products between pairs of clients' ``h``: no sum over clients gives them.
  Client i's personalised classifier ``sum_j alpha_ij g_j`` weights the
  participants' classifiers differently for every i, with weights computed from
  those per-client statistics. So under secure aggregation FedPAC's classifier
  collaboration still shows the server each participant's ``h_i`` (class
  frequencies times class means), ``v_i`` and classifier; only the centroids (and
  the encoder) can be hidden in a sum.

Remaining departures from the paper and the authors' code:

- The QP is solved exactly (active set, float64, :mod:`simplex_qp`); the code
  uses cvxpy (OSQP by default) on float32 statistics. On the pinned inputs of
  tests/algorithms/test_fedpac.py the weights agree with the code's within 1.1e-7 (OSQP)
  and 2.3e-6 (CLARABEL, the solver of the pinned values). Measured on the 80 QPs of a FedPAC run (MNIST, dominant-class
  split, 8 clients x 200 samples, MLP [64], 10 rounds) and on 200 random
  ones (10 clients, v in [1e-4, 1]): the authors' whole pipeline (cvxpy,
  float32) and this one differ by at most 2.3e-8; the eigenvalue repair never
  triggered (``P_i`` is PSD by construction, ``D_i`` a Gram matrix and
  ``v >= 0``; smallest eigenvalue / max |P_i| = 0.011 on MNIST), neither in
  float64 nor in the authors' float32 test; the threshold is not a no-op
  for the exact optimum: it removed 38 weights in (0, 1e-3] on MNIST and
  moved a weight by up to 0.0015 (0.005 on the random QPs), hence kept.
- "No solution": the code falls back when the repaired matrix still shows a
  negative eigenvalue in ``np.linalg.eigvals``, which the rounding of the zero
  eigenvalues the repair creates can cause (not reproduced); here the fallback is
  taken when a client's statistics are not finite, the solver does not
  converge, returns non-finite weights or no weight survives the threshold.
- The encoder stage uses the run's optimiser settings (``train.lr``,
  ``train.momentum``, ``train.weight_decay``); the code hard-codes momentum 0.5
  and weight decay 5e-4 (set them in the config to match).
- Statistics and centroids are computed in eval mode without augmentation;
  the code uses the training loader in whatever mode the model was left.
- Alignment is on once the server has centroids (the code: from its second
  round, ``round > 0``); the same after any round with participants.
- A client that has not taken part yet (``train.clients_per_round`` below the
  number of clients) starts, and is evaluated, with the initial model's
  classifier (``first_head = "initial"``, the default since 2026-11-28), as in
  the authors' code: every client's local model is a copy of the initial model
  (``federated_main.py`` l. 49-51), the global encoder goes to every client after
  each round (``running.py`` l. 226-229) but a combined classifier only to the
  round's participants (l. 232-242), so a client keeps the initial classifier
  until it trains. The initial classifier is kept in the server state
  (``fedpac.initial_head/<name>``, checkpointed with it). ``first_head =
  "server"`` gives hetfl's former rule: the server model's classifier, the
  data-size-weighted mean of the last round's uploaded classifiers (a run written
  before the setting existed is read with it: ``setting(former=...)``). Every
  client's encoder is the global one in both.

Differential privacy (``dp_epsilon`` finite; not in the paper): the additive uploads, per-class counts
and feature sums, go through the Gaussian mechanism of :mod:`hetfl.algorithms.dp_moments` (features
clipped to ``clip_norm``; sensitivity sqrt(2) per sample: count and sum / C), every round, with the
budget split over the run's rounds (a client may take part in each). Each upload carries the whole
noise (``dp_noise = "local"``; "distributed" is refused): FedPAC's uploads are never securely
aggregated, so the server sees each of them. A class's noisy total count must exceed three standard
deviations of the summed count noise for the class to get a global centroid (an absent class would
otherwise get a centroid of pure noise divided by a count near zero); clients align to their own means
otherwise. The guarantee
covers these statistics only: ``h_i``, ``v_i`` (computed from the same features), the classifiers and
the encoder go up unprotected, so FedPAC under DP is not a private method, and the metrics line
says so (``dp_covers``).

Compositions: FedPAC is personalised, so post-hoc steps that calibrate one
global classifier (``fedpac+ccvr``) are refused at configuration time.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetfl.algorithms.base import (
    Algorithm,
    Batch,
    ClientContext,
    ServerState,
    Setup,
    Stage,
    Tensors,
    Upload,
    cross_entropy,
    weighted_mean,
)
from hetfl.algorithms.dp_moments import (
    NOISE_MODES,
    NOISE_SOURCES,
    MomentsMechanism,
    check_settings,
    noise_generator,
    nonfinite_bounds,
)
from hetfl.algorithms.gaussian_stats import NonFiniteStatistics
from hetfl.algorithms.simplex_qp import drop_small_eigenvalues, solve_simplex_qp
from hetfl.params import FINITE, FLOAT32_MAX, ConfigError, above, setting
from hetfl.privacy import Release, accountant_name, release_digest, require_accountant
from hetfl.rng import most_rounds_asked

CENTROIDS, HAS_CENTROID = "fedpac.centroids", "fedpac.has_centroid"
COUNTS, CENTROID_SUMS = "fedpac.counts", "fedpac.centroid_sums"  # a client's upload: additive over clients
HEAD, OWN_HEAD = "fedpac.head/", "fedpac.local_head/"
INITIAL_HEAD = "fedpac.initial_head/"  # server extra (first_head = "initial"): the initial model's classifier
FIRST_HEADS = ("initial", "server")
DP_RELEASES = "fedpac/dp_multipliers"  # server extra: the noise multiplier of each round's summed statistics
DP_COVERS = ("per-class counts and feature sums (the centroids); not the sample count n_i (the aggregation weight), "
             "h_i, v_i, the classifiers or the encoder")


@dataclass(frozen=True)
class FedPACHyper:
    """FedPAC settings (Xu et al. 2023; defaults from the authors' code).

    lam: weight of the feature-alignment regulariser (1.0).
    head_epochs, head_lr, head_momentum, head_weight_decay: the classifier stage.
    qp_eig_floor: a QP matrix with a negative eigenvalue keeps only its
        eigen-components with eigenvalue >= this (authors' code: 0.01).
    min_weight: classifier-combination weights <= this are zeroed, the rest
        renormalised (authors' code: 1e-3; 0 keeps the exact solution).
    first_head: the classifier a client that has not taken part yet starts, and
        is evaluated, with: "initial" (the initial model's, as the authors' code)
        or "server" (the server model's, the size-weighted mean of the last
        round's uploaded classifiers; hetfl's rule before 2026-11-28).
    clip_norm, dp_*: differential privacy of the centroid statistics (module
        docstring; ``dp_epsilon = inf``: none).
    """

    lam: float = setting(1.0, ge=0.0, doc="feature alignment weight")
    head_epochs: int = setting(1, ge=0, doc="classifier-stage epochs")
    head_lr: float = setting(0.1, when={"head_epochs": above(0)}, gt=0.0, lt=FLOAT32_MAX, doc="classifier-stage lr")
    head_momentum: float = setting(0.5, when={"head_epochs": above(0)}, ge=0.0, lt=1.0, doc="classifier-stage momentum")
    head_weight_decay: float = setting(5e-4, when={"head_epochs": above(0)}, ge=0.0, lt=FLOAT32_MAX,
                                       doc="classifier-stage weight decay")
    first_head: str = setting("initial", choices=FIRST_HEADS, former="server",
                              doc="classifier of a client that has not taken part yet: initial (the initial "
                                  "model's, as the authors' code) or server (the server model's, the mean of the "
                                  "last round's uploaded classifiers)")
    qp_eig_floor: float = setting(0.01, ge=0.0, doc="eigenvalues kept when repairing a non-PSD QP matrix")
    min_weight: float = setting(1e-3, ge=0.0, lt=1.0, doc="combination weights <= this are zeroed")
    clip_norm: float = setting(10.0, when={"dp_epsilon": FINITE}, gt=0.0,
                               doc="L2 bound on each feature vector under differential privacy")
    dp_epsilon: float = setting(math.inf, gt=0.0, finite=False,
                                doc="differential privacy of the centroid statistics over the run (inf = none)")
    dp_delta: float = setting(1e-5, when={"dp_epsilon": FINITE}, gt=0.0, lt=1.0, doc="differential privacy: delta")
    dp_noise: str = setting("local", when={"dp_epsilon": FINITE}, choices=NOISE_MODES,
                            doc="local: each upload carries the whole noise (the server sees each); distributed "
                                "is refused: FedPAC's uploads are never securely aggregated")
    dp_noise_source: str = setting("seed", when={"dp_epsilon": FINITE}, choices=NOISE_SOURCES,
                                   doc="seed: noise from the run's seed (simulations); os: from the operating system")

    def check(self, prefix: str) -> None:
        """The budget within the accountant's accepted range, a finite clip norm, and no distributed noise:
        FedPAC's uploads are never securely aggregated, so the server sees each one, with ``1/sqrt(m)`` of
        the noise a distributed budget puts in their sum (epsilon 33.7 per upload for a headline 4)."""
        check_settings(prefix, self.dp_epsilon, self.dp_delta, self.clip_norm, with_outer=False)
        if math.isfinite(self.dp_epsilon) and self.dp_noise == "distributed":
            raise ConfigError(f"{prefix}dp_noise", self.dp_noise,
                              "FedPAC's uploads are never securely aggregated: the server sees each one, and "
                              "distributed noise would protect only their sum; use 'local' (each upload carries "
                              "the whole noise and is (dp_epsilon, dp_delta)-DP on its own)")


def class_means(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts [C], means [C, d]) of features per class; zero mean for absent classes."""
    counts = torch.bincount(labels, minlength=num_classes).to(features.dtype)
    sums = torch.zeros(num_classes, features.shape[1], dtype=features.dtype, device=features.device)
    sums.index_add_(0, labels, features)
    return counts, sums / counts.clamp(min=1).unsqueeze(1)


def class_sums(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts [C], sums [C, d]) of features per class, float64: additive over clients (their sums over clients
    give the global centroids ``sums / counts``)."""
    z = features.detach().double()
    counts = torch.bincount(labels, minlength=num_classes).double()
    return counts, torch.zeros(num_classes, z.shape[1], dtype=torch.float64, device=z.device).index_add_(0, labels, z)


def global_centroids(counts: list[torch.Tensor], sums: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The global centroid of every class and whether it has one, from the clients' per-class counts and feature
    sums: ``c_k = sum_i s_ik / sum_i n_ik`` (= the count-weighted mean of the client centroids; zero for a class
    no client holds). Only the sums over clients enter, which secure aggregation can compute."""
    total = torch.stack(counts).sum(0)
    centroids = torch.stack(sums).sum(0) / total.clamp(min=1).unsqueeze(1)
    return centroids, total > 0


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


def qp_matrix(h: list[torch.Tensor], v: list[float], i: int) -> torch.Tensor:
    """``P_i = diag(v) + D_i`` of eq. 11, ``D_i[j1, j2] = sum_k <h_i[k] - h_j1[k], h_i[k] - h_j2[k]>``
    (float64): the variance term plus the bias term of client i's expected test loss."""
    flat = torch.stack([x.flatten().double().cpu() for x in h])
    diff = flat[i] - flat  # row j: h_i - h_j
    return torch.diag(torch.tensor(v, dtype=torch.float64)) + diff @ diff.T


def threshold_weights(alpha: torch.Tensor, min_weight: float) -> torch.Tensor | None:
    """Weights <= ``min_weight`` set to zero and the rest renormalised to sum 1 (the authors' code);
    None when none is left."""
    kept = torch.where(alpha > min_weight, alpha, torch.zeros_like(alpha))
    total = float(kept.sum())
    return kept / total if total > 0 and math.isfinite(total) else None


def combination_weights(
    h: list[torch.Tensor], v: list[float], i: int, eig_floor: float = 0.01, min_weight: float = 1e-3
) -> torch.Tensor:
    """Client i's classifier-combination weights over the participants (eq. 11), float64:
    the exact simplex QP on ``P_i`` (repaired as the authors do if not PSD), thresholded;
    the one-hot vector of client i (its own classifier) when there is no solution."""
    matrix = qp_matrix(h, v, i)
    alpha = None
    if torch.isfinite(matrix).all():  # a client's non-finite statistics: no solution, own head
        p, _ = drop_small_eigenvalues(matrix, eig_floor)
        result = solve_simplex_qp(p)
        alpha = threshold_weights(result.weights, min_weight) if result.converged else None
    if alpha is None or not torch.isfinite(alpha).all():
        alpha = torch.zeros(len(h), dtype=torch.float64)
        alpha[i] = 1.0
    return alpha


class FedPAC(Algorithm):
    name = "fedpac"
    Hyper = FedPACHyper
    citation = "Xu et al., ICLR 2023"
    personalized = True
    model_requires = ("encoder",)  # feature alignment trains the encoder, apart from the classifier
    dp_releases_key = DP_RELEASES
    dp_upload_keys = (COUNTS, CENTROID_SUMS)
    # the steps read the state and the extras only: clients with and without a personalised head in their
    # payload (a sampled round's first-timers) train as one vectorised group
    step_reads = frozenset()

    def __init__(self, hyper: FedPACHyper, setup: Setup) -> None:
        super().__init__(hyper, setup)
        if math.isfinite(hyper.dp_epsilon):
            try:  # refused at set-up, before anything is written
                require_accountant()
            except ImportError as err:
                raise ConfigError("algorithm.dp_epsilon", hyper.dp_epsilon, str(err)) from None
            std = self.mechanism.upload_std()  # counts and sums: FedPAC uploads no outer products
            bad = nonfinite_bounds({f"noise std of {k}": v for k, v in std.items()})
            if bad:  # refused at set-up, as the keys' own ranges are; the sums' std is clip_norm x the counts'
                limit = torch.finfo(torch.float64).max / std["counts"]
                raise ConfigError("algorithm.clip_norm", hyper.clip_norm,
                                  f"the derived {', '.join(bad)} ({' and '.join(std)} are what FedPAC uploads) "
                                  f"{'is' if len(bad) == 1 else 'are'} not a finite float64; must be at most "
                                  f"{limit:.3g} at this budget; choose a clip norm near the features' norms")

    @functools.cached_property
    def mechanism(self) -> MomentsMechanism | None:
        """The Gaussian mechanism of the counts and feature sums (None without differential privacy): the
        budget split over the most rounds one client is asked in (every round without client sampling; with
        it, drawn from the run's seed apart from the data: :func:`hetfl.rng.most_rounds_asked`), the noise
        shared by a round's participants when distributed."""
        if not math.isfinite(self.hp.dp_epsilon):
            return None
        train = self.setup.train
        participants = train.clients_per_round or self.setup.num_clients
        releases = max(1, most_rounds_asked(self.setup.seed, train.rounds, self.setup.num_clients,
                                            train.clients_per_round))
        return MomentsMechanism(self.hp.dp_epsilon, self.hp.dp_delta, self.hp.clip_norm, participants,
                                releases, self.hp.dp_noise, with_outer=False)

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
        if self.hp.first_head == "initial":  # a copy: kept whatever happens to the model's tensors
            extra.update({INITIAL_HEAD + n: model_state[n].detach().clone() for n in self.head_names})
        return ServerState(model=model_state, extra=extra)

    def payload(self, server: ServerState, client_id: int) -> Tensors:
        heads = {HEAD + n: server.extra[f"head.{client_id}/{n}"] for n in self.head_names
                 if f"head.{client_id}/{n}" in server.extra}
        body = {n: t for n, t in server.model.items() if n not in self.head_names}
        return {**body, CENTROIDS: server.extra[CENTROIDS], HAS_CENTROID: server.extra[HAS_CENTROID], **heads}

    # --------------------------------------------------------------- client
    def init_client_state(self, client_id: int, server: ServerState) -> Tensors:
        """A client that has not taken part yet: the classifier ``first_head`` names (the initial model's, kept
        in the server state, or the server model's)."""
        if self.hp.first_head == "initial":
            return {OWN_HEAD + n: server.extra[INITIAL_HEAD + n].clone() for n in self.head_names}
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
        device = feats.device  # on the training device, like every tensor a step reads
        return {"h": h.to(device), "v": torch.tensor(v, device=device), "target": target.to(device),
                "align": torch.tensor(align, device=device)}

    def alignment_loss(self, state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        z, logits = self.model.features_and_logits(state, batch.x)
        ce = cross_entropy(logits, batch.y)
        # (1/d) ||f(x) - c_y||^2, batch mean; index_select, not target[y] (the same gather): torch.compile
        # replays a vmapped advanced index as a view that the strides refuse (runtime.compile)
        align = F.mse_loss(z, ctx.extras["target"].index_select(0, batch.y))
        weight = self.hp.lam * ctx.extras["align"]
        return ce + weight * align, {"ce": ce.detach(), "alignment": align.detach()}

    def stages(self, ctx: ClientContext) -> list[Stage]:
        hp, train = self.hp, self.setup.train
        head_sgd = self.setup.sgd(hp.head_lr, momentum=hp.head_momentum, weight_decay=hp.head_weight_decay)
        stages = [Stage("classifier", self.loss, tuple(self.head_names), head_sgd, epochs=hp.head_epochs)]
        if hp.head_epochs == 0:
            stages = []
        stages.append(Stage("encoder", self.alignment_loss, self.encoder_names(), self.setup.sgd(ctx.lr),
                            epochs=train.local_epochs, steps=train.local_steps))
        return stages

    def centroid_statistics(self, ctx: ClientContext, local: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 4's additive uploads: per class the count and the sum of the features after training
        (under differential privacy: of the clipped features, with the mechanism's noise)."""
        feats, labels = ctx.features(local)  # type: ignore[misc]
        if self.mechanism is None:
            return class_sums(feats, labels, self.setup.num_classes)
        gen = noise_generator(self.hp.dp_noise_source, self.setup.seed, self.name, ctx.round, ctx.client_id)
        noisy = self.mechanism.privatize(feats, labels, self.setup.num_classes, gen)
        return noisy.counts.to(feats.device), noisy.sums.to(feats.device)

    def finish(self, ctx: ClientContext, local: Tensors, steps: int) -> tuple[Tensors, Tensors]:
        counts, sums = self.centroid_statistics(ctx, local)
        upload = {n: local[n] for n in self.model.state_names}
        upload.update({COUNTS: counts, CENTROID_SUMS: sums, "fedpac.h": ctx.extras["h"], "fedpac.v": ctx.extras["v"]})
        return upload, {OWN_HEAD + n: local[n] for n in self.head_names}

    def dp_release(self, received: list[Upload]) -> Release | None:
        """The round's release (under differential privacy): the multiplier of the noise in the sum of the
        counts and feature sums the server got, and the digest of what it got (for the run's ledger)."""
        if self.mechanism is None:
            return None
        named = [(f"{u.client_id}/{k}", u.tensors[k]) for u in received for k in self.dp_upload_keys]
        uploads = {u.client_id: release_digest([(k, u.tensors[k]) for k in self.dp_upload_keys]) for u in received}
        return Release(self.mechanism.sum_multiplier(len(received)), release_digest(named), self.hp.dp_noise_source,
                       uploads=uploads)

    def dp_refused(self, refused: Mapping[int, str]) -> Release | None:
        """The noisy centroid statistics in training replies the server received and refused in a round with
        nothing usable (another sample count, oversized, a node with other data): a release of those uploads."""
        if self.mechanism is None:
            return None
        return self.mechanism.refused_release(refused, self.hp.dp_noise_source)

    def aggregate(self, server: ServerState, uploads: list[Upload], round: int) -> ServerState:
        model = dict(server.model)  # the shared model: FedAvg's mean, train.weighting's (integer buffers: max)
        model.update(weighted_mean([{n: u.tensors[n] for n in self.model.state_names} for u in uploads],
                                   self.client_weights(uploads)))
        extra = dict(server.extra)
        centroids, has = global_centroids([u.tensors[COUNTS] for u in uploads],
                                          [u.tensors[CENTROID_SUMS] for u in uploads])
        if self.mechanism is not None:  # a noisy total near zero is no class: its "centroid" would be noise / ~0
            if not bool(torch.isfinite(centroids).all()):
                raise NonFiniteStatistics(f"FedPAC round {round}: the private centroids are not finite (inf or NaN): "
                                          "the features overflowed (check algorithm.clip_norm and train_loss)")
            noise_std = self.mechanism.upload_std()["counts"] * math.sqrt(len(uploads))
            has = has & (torch.stack([u.tensors[COUNTS] for u in uploads]).sum(0) > 3.0 * noise_std)
            before = server.extra.get(DP_RELEASES)
            multipliers = ([] if before is None else before.tolist()) + [self.mechanism.sum_multiplier(len(uploads))]
            extra[DP_RELEASES] = torch.tensor(multipliers, dtype=torch.float64)
        extra[CENTROIDS] = centroids.to(server.extra[CENTROIDS].dtype)
        extra[HAS_CENTROID] = has.to(server.extra[HAS_CENTROID].dtype)
        h = [u.tensors["fedpac.h"] for u in uploads]
        v = [float(u.tensors["fedpac.v"]) for u in uploads]
        for i, u in enumerate(uploads):
            alpha = combination_weights(h, v, i, self.hp.qp_eig_floor, self.hp.min_weight)
            for n in self.head_names:
                heads = torch.stack([x.tensors[n] for x in uploads]).double()
                combined = (alpha.to(heads.device).view(-1, *[1] * (heads.dim() - 1)) * heads).sum(0)
                extra[f"head.{u.client_id}/{n}"] = combined.to(u.tensors[n].dtype)
        return ServerState(model=model, extra=extra)

    def round_info(self, server: ServerState, uploads: list[Upload], round: int) -> dict:
        """The privacy budget the centroid statistics spent so far (none without differential privacy)."""
        if self.mechanism is None or DP_RELEASES not in server.extra:
            return {}
        multipliers = server.extra[DP_RELEASES].tolist()
        taken_part = self.dp_participation(server, len(multipliers))
        return {**self.mechanism.guarantee(multipliers, taken_part), "dp_accountant": accountant_name(),
                "dp_summed_clients": len(uploads), "dp_secure_aggregation": False,  # never: the server sees each
                "dp_covers": DP_COVERS}

    # ----------------------------------------------------------- evaluation
    def client_model(self, server: ServerState, client_state: Tensors, client_id: int) -> Tensors:
        state = dict(server.model)
        for n in self.head_names:
            key = f"head.{client_id}/{n}"
            state[n] = server.extra[key] if key in server.extra else client_state[OWN_HEAD + n]
        return state
