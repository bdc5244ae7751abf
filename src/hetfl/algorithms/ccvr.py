"""CCVR: Classifier Calibration with Virtual Representations.

Luo, Chen, Hu, Zhang, Liang, Feng. "No Fear of Heterogeneity: Classifier
Calibration for Federated Learning with Non-IID Data." NeurIPS 2021, sec. 4,
Algorithm 1. A post-hoc step (``X+ccvr``) after any federated training:

1. each client, with the final global encoder (eval mode, no augmentation),
   computes per class it holds its count ``N_ck``, the sum of its features
   ``s_ck`` and the sum of their outer products ``Q_ck`` and uploads them
   (the paper's per-class mean ``mu_ck`` and unbiased covariance ``S_ck`` of
   eq. 2 in additive form: ``s_ck = N_ck mu_ck``,
   ``Q_ck = (N_ck - 1) S_ck + N_ck mu_ck mu_ck^T``);
2. the server sums them over clients and derives ``N(mu_c, S_c)``: the exact
   pooling of eq. 3-4 (``mu_c = s_c / N_c``,
   ``S_c = (Q_c - N_c mu_c mu_c^T) / (N_c - 1)``), up to float64 rounding
   (1e-14 to 6e-14 relative on realistic features, 2e-6 for features whose mean is 1e4
   times their spread: ``gaussian_stats.stats_from_moments``);
3. draws ``M_c`` virtual features per class (robustly for singular
   covariances; classes with ``N_c < 2`` get none and are reported);
4. applies ReLU + Tukey's transform (beta 0.5, sec. 5.1) to them and re-trains
   the classifier, initialised from the global one, with cross-entropy and
   SGD (lr 0.001, momentum 0.9, weight decay 1e-5, batch 64; Table 8).

Why sums: the server's pooling is then a plain sum over clients, the one
operation secure aggregation (Flower's SecAgg+) gives a server that must not see
any single client's statistics, and the quantity to which differential-privacy
noise is added. (The uploads here still name the classes a client holds and go
to the server in the clear; a secure-aggregation round would send every class,
absent ones as zeros, so that all uploads have one shape.)

The transform is part of the calibrated model: real features get the same
ReLU + Tukey before the classifier at inference (``FEATURE_BETA`` in the
model state; ``transform = "none"`` skips it everywhere). The paper transforms
only the virtual features; applying it on one side only would feed the
classifier features of another scale than it was trained on.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetfl.algorithms.base import HeadTransform, ServerState, Setup, Tensors, register_head_transform
from hetfl.algorithms.classifier_reg import CLASSIFIER_NORM
from hetfl.algorithms.dp_moments import (
    NOISE_MODES,
    NOISE_SOURCES,
    MomentsMechanism,
    check_settings,
    nearest_psd,
    noise_generator,
    nonfinite_bounds,
)
from hetfl.algorithms.gaussian_stats import (
    ClassMoments,
    ClassStats,
    NonFiniteStatistics,
    class_moments,
    sample_gaussian,
    stats_from_moments,
    sum_moments,
)
from hetfl.algorithms.posthoc import ClassifierTraining, PostHoc, Replies, SummedReplies, retrain_classifier, stream
from hetfl.params import ConfigError, setting
from hetfl.privacy import Release, accountant_name, clip_rows, epsilon_text, release_digest, require_accountant

FEATURE_BETA = "feature_transform/tukey_beta"  # in a calibrated model's state: Tukey's beta
DP_RELEASES = "ccvr/dp_multipliers"  # server extra: the noise multiplier of each release's sum so far


def relu_tukey(features: torch.Tensor, beta: torch.Tensor | float) -> torch.Tensor:
    """ReLU then Tukey's ladder of powers: ``x^beta`` (``log x`` for beta = 0, on ``x + 1e-6``).

    The transform CCVR applies to features before re-training the classifier
    (Luo et al. 2021, sec. 5.1; Tukey 1977).
    """
    z = F.relu(features)
    beta = torch.as_tensor(beta, dtype=z.dtype, device=z.device)
    safe_beta = torch.where(beta == 0, torch.ones_like(beta), beta)
    return torch.where(beta == 0, torch.log(z + 1e-6), z.pow(safe_beta))


# a calibrated classifier sees the transformed real features it was trained on
register_head_transform(HeadTransform(FEATURE_BETA, features=relu_tukey))


@dataclass(frozen=True)
class CCVRHyper:
    """CCVR settings (Luo et al. 2021; defaults: the paper's CIFAR-10 values).

    num_virtual: virtual features per class M_c (paper: 100 / 500 / 1000 for
        CIFAR-10 / CIFAR-100 / CINIC-10; Table 8: 2000 at alpha 0.1 and 0.05).
    proportional: M_c proportional to the class's share N_c / N of all data
        (total num_virtual * C), the paper's alternative.
    transform: "relu_tukey" (paper) or "none".
    tukey_beta: beta of Tukey's transform (0.5; 0 = log).
    epochs, lr, momentum, weight_decay, batch_size: classifier re-training
        (Table 8: 10-50 epochs, lr 0.001 (1e-5 for CIFAR-100), batch 64).
    every_round: calibrate after every round (the paper's side study), not
        only after the last.
    clip_norm, dp_*: private calibration (not in the paper): the statistics of
        features clipped to ``clip_norm`` under the Gaussian mechanism of
        ``dp_moments`` with an (dp_epsilon, dp_delta) budget for the run
        (``dp_epsilon = inf``: no noise). ``clip_norm`` also bounds the
        statistics under secure aggregation.
    oracle: the paper's upper bound (sec. 3.3, Table 2 "Oracle", Table 10
        "Partial Data"): calibrate on the clients' real features instead of
        virtual ones, all of them or ``oracle_per_class`` drawn per class.
        Clients then upload raw features: an experiment, not a private protocol.
    """

    num_virtual: int = setting(100, ge=1, doc="virtual features per class M_c")
    proportional: bool = setting(False, doc="M_c proportional to class frequency")
    transform: str = setting("relu_tukey", choices=("relu_tukey", "none"), doc="feature transform")
    tukey_beta: float = setting(0.5, ge=0.0, doc="Tukey beta")
    epochs: int = setting(10, ge=1, doc="classifier re-training epochs")
    lr: float = setting(0.001, gt=0.0, doc="re-training lr")
    momentum: float = setting(0.9, ge=0.0, lt=1.0, doc="re-training momentum")
    weight_decay: float = setting(1e-5, ge=0.0, doc="re-training weight decay")
    batch_size: int = setting(64, ge=1, doc="re-training batch size")
    every_round: bool = setting(False, doc="calibrate after every round")
    oracle: str = setting("none", choices=("none", "all", "per_class"),
                          doc="calibrate on real features (not private): all, or oracle_per_class per class")
    oracle_per_class: int = setting(100, ge=1, doc="real features per class for oracle = per_class")
    clip_norm: float = setting(10.0, gt=0.0, doc="L2 bound on each feature vector under differential privacy or "
                                                 "secure aggregation (plain CCVR never clips)")
    dp_epsilon: float = setting(math.inf, gt=0.0, finite=False,
                                doc="differential privacy of the statistics: the run's epsilon (inf = no DP)")
    dp_delta: float = setting(1e-5, gt=0.0, lt=1.0, doc="differential privacy: delta")
    dp_noise: str = setting("distributed", choices=NOISE_MODES,
                            doc="distributed: the clients' noise adds up to the budget in the sum (use with secure "
                                "aggregation); local: each upload carries the whole noise")
    dp_noise_source: str = setting("seed", choices=NOISE_SOURCES,
                                   doc="seed: noise from the run's seed (reproducible simulations); os: from the "
                                       "operating system (deployments)")

    def check(self, prefix: str) -> None:
        """The budget within the accountant's accepted range and a clip norm whose square is a finite float
        (:func:`hetfl.algorithms.dp_moments.check_settings`): refused while the settings are read."""
        check_settings(prefix, self.dp_epsilon, self.dp_delta, self.clip_norm, with_outer=True)


def virtual_counts(pooled: ClassStats, num_virtual: int, proportional: bool) -> torch.Tensor:
    """M_c per class: fixed, or proportional to N_c; zero for classes with N_c < 2."""
    n = pooled.counts
    if proportional:
        m = torch.round(num_virtual * len(n) * n / n.sum().clamp(min=1)).long()
    else:
        m = torch.full_like(n, num_virtual, dtype=torch.long)
    return torch.where(n >= 2, m, torch.zeros_like(m))


class CCVR(PostHoc):
    name = "ccvr"
    Hyper = CCVRHyper
    citation = "Luo et al., NeurIPS 2021"
    dp_releases_key = DP_RELEASES

    def __init__(self, hyper: CCVRHyper, setup: Setup) -> None:
        super().__init__(hyper, setup)
        self.psd_removed = 0.0  # share of the last noisy covariances' spectrum the PSD repair removed
        if self.private:  # refused at set-up, before anything is written
            if hyper.oracle != "none":
                raise ConfigError("algorithm.ccvr.oracle", hyper.oracle, "the oracle uploads the clients' raw "
                                  "features: it cannot be private (algorithm.ccvr.dp_epsilon must stay inf)")
            try:
                require_accountant()
            except ImportError as err:
                raise ConfigError("algorithm.ccvr.dp_epsilon", hyper.dp_epsilon, str(err)) from None
        if setup is not None:  # built without a federation only to read the step's settings (secure_sum.check_config)
            self.check_derived_bounds()

    def check_derived_bounds(self) -> None:
        """The bounds that follow from ``clip_norm`` (the noise's standard deviations, the public reply bounds
        of secure aggregation) must be finite: a ConfigError naming ``algorithm.ccvr.clip_norm`` otherwise,
        at set-up (``clip_norm = 1e300`` once overflowed ``C^2`` into NaN covariances and a run that exited 0)."""
        bounds: dict[str, float] = {}
        if self.mechanism is not None:
            bounds.update({f"noise std of {k}": v for k, v in self.mechanism.upload_std().items()})
        if self.mechanism is not None or self.setup.secure_aggregation:
            bounds.update({f"reply bound of {k}": v for k, v in self.reply_bounds().items()})
        bad = nonfinite_bounds(bounds)
        if bad:
            raise ConfigError("algorithm.ccvr.clip_norm", self.hp.clip_norm,
                              f"the derived {', '.join(bad)} are not finite; choose a clip norm near the features' "
                              "norms (e.g. 10 for MNIST's MLP)")

    @property
    def private(self) -> bool:
        """Differential privacy is on (a finite ``dp_epsilon``)."""
        return math.isfinite(self.hp.dp_epsilon)

    @functools.cached_property
    def mechanism(self) -> MomentsMechanism | None:
        """The Gaussian mechanism of the clients' moments (None without differential privacy): the budget
        of the run's releases (one, or one per round with ``every_round``) over all clients."""
        if not self.private:
            return None
        releases = self.setup.train.rounds if self.hp.every_round else 1
        return MomentsMechanism(self.hp.dp_epsilon, self.hp.dp_delta, self.hp.clip_norm, self.setup.num_clients,
                                releases, self.hp.dp_noise)

    @property
    def additive(self) -> bool:  # type: ignore[override]
        """Moments pool by their sum (the oracle's raw features do not)."""
        return self.hp.oracle == "none"

    def client_query(self, model_state: Tensors, features: torch.Tensor, labels: torch.Tensor, *, client: int,
                     round_: int) -> Tensors:
        """Algorithm 1, lines 5-9 (eq. 2 in additive form): the client's per-class count, sum of
        features and sum of outer products (float64), classes it holds only (the oracle uploads the
        features themselves). Per class held: its index, 1 + d + d^2 floats (the full symmetric
        ``outer``; its upper triangle, ``ClassMoments.num_floats``, would be enough)."""
        if self.hp.oracle != "none":
            return {"features": features, "labels": labels}
        if self.mechanism is not None:  # dense: a private reply must not say which classes the client holds
            gen = noise_generator(self.hp.dp_noise_source, self.setup.seed, self.name, round_, client)
            moments = self.mechanism.privatize(features, labels, self.setup.num_classes, gen)
            return {"counts": moments.counts, "sums": moments.sums, "outer": moments.outer}
        if self.setup.secure_aggregation:  # bounded for the fixed-point encoding (reply_bounds)
            features = clip_rows(features.detach().to(torch.float64), self.hp.clip_norm)
        moments = class_moments(features, labels, self.setup.num_classes)
        present = moments.counts > 0
        return {"classes": present.nonzero().flatten(), "counts": moments.counts[present],
                "sums": moments.sums[present], "outer": moments.outer[present]}

    def dense_reply(self, reply: Tensors) -> Tensors:
        """A reply as moments of every class, zero for the classes the client does not hold: the same
        shapes at every client, so that replies can be summed without naming anyone's classes."""
        if "classes" not in reply:
            return reply
        c, dim = self.setup.num_classes, reply["sums"].shape[1]
        counts = torch.zeros(c, dtype=torch.float64)
        sums = torch.zeros(c, dim, dtype=torch.float64)
        outer = torch.zeros(c, dim, dim, dtype=torch.float64)
        idx = reply["classes"].cpu()
        counts[idx], sums[idx], outer[idx] = reply["counts"].cpu(), reply["sums"].cpu(), reply["outer"].cpu()
        return {"counts": counts, "sums": sums, "outer": outer}

    def reply_bounds(self) -> dict[str, float]:
        """Public bounds on a dense reply's entries: a client holds at most ``N_max`` (the largest
        client's training set) samples of a class, each of norm at most ``clip_norm`` after clipping;
        under differential privacy, plus 8 standard deviations of the client's noise."""
        n_max, clip = float(max(self.setup.client_sizes)), float(self.hp.clip_norm)
        bounds = {"counts": n_max, "sums": n_max * clip, "outer": n_max * clip * clip}
        if self.mechanism is not None:
            std = self.mechanism.upload_std()
            bounds = {k: v + 8.0 * std[k] for k, v in bounds.items()}
        return bounds

    def dp_release(self, received: Replies) -> Release | None:
        """The release the server got in a statistics round under differential privacy: the multiplier of the
        noise in the sum of the uploads it got, and the digest of what it got (for the run's ledger)."""
        if self.mechanism is None:
            return None
        if isinstance(received, SummedReplies):
            named = [(f"sum/{k}", received.total[k]) for k in sorted(received.total)]
            named.append(("clients", torch.tensor(received.clients, dtype=torch.int64)))
        else:
            named = [(f"{c}/{k}", received[c][k]) for c in sorted(received) for k in sorted(received[c])]
        return Release(self.mechanism.sum_multiplier(_summed_clients(received)), release_digest(named),
                       self.hp.dp_noise_source)

    def server_sees(self) -> str:
        """What the server receives of the private statistics, in words (``privacy.server_sees``)."""
        if self.setup.secure_aggregation:
            return "the sum of the uploads only (secure aggregation): epsilon is the guarantee it faces"
        if self.hp.dp_noise == "local":
            return "each upload, each carrying the whole noise: epsilon is the guarantee of every upload"
        return ("each upload (no secure aggregation), with 1/sqrt(clients) of the noise: the guarantee it faces "
                "is epsilon_per_upload; epsilon holds for the sum alone")

    def privacy_notice(self) -> str | None:
        """Without secure aggregation, the guarantee a server that sees every upload faces (the run's first
        line): with distributed noise, far weaker than the headline epsilon, which holds for the sum."""
        if self.mechanism is None or self.setup.secure_aggregation:
            return None
        per_upload = self.mechanism.guarantee([self.mechanism.sum_multiplier(self.setup.num_clients)]
                                              * self.mechanism.releases)["dp_epsilon_per_upload"]
        if self.hp.dp_noise == "local":
            return (f"privacy: without secure aggregation the server sees each client's upload; each is "
                    f"({epsilon_text(per_upload)}, {self.hp.dp_delta:g})-DP on its own "
                    "(algorithm.ccvr.dp_noise = 'local')")
        return (f"privacy: algorithm.ccvr.dp_epsilon = {self.hp.dp_epsilon:g} holds for the SUM of the uploads only; "
                f"without secure aggregation the server sees each upload, at epsilon {epsilon_text(per_upload)} "
                "per upload "
                "(set runtime.secure_aggregation = true, or algorithm.ccvr.dp_noise = 'local')")

    def summed_moments(self, replies: Replies) -> ClassMoments:
        """The sum of the clients' moments: added here, or (secure aggregation) already summed."""
        if isinstance(replies, SummedReplies):
            return _moments(replies.total)
        return sum_moments([_moments(self.dense_reply(r)) for r in replies.values()])

    def pooled_statistics(self, replies: Replies) -> ClassStats:
        """Algorithm 1, line 12 (eq. 3-4): the per-class Gaussians from the sum of the clients' moments
        (under differential privacy, noisy: covariances repaired by :func:`nearest_psd`)."""
        pooled = stats_from_moments(self.summed_moments(replies))
        check_finite("the pooled per-class counts, means and covariances",
                     pooled.counts, pooled.means, pooled.covs)
        if self.mechanism is not None:
            pooled.covs, self.psd_removed = nearest_psd(pooled.covs)
            check_finite("the covariances after the PSD repair", pooled.covs)
        return pooled

    def virtual_features(
        self, replies: Replies, gen: torch.Generator
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Algorithm 1, lines 12-16: pool (eq. 3-4) and draw M_c virtual features per class."""
        pooled = self.pooled_statistics(replies)
        counts = virtual_counts(pooled, self.hp.num_virtual, self.hp.proportional)
        feats, labels = [], []
        for c in range(self.setup.num_classes):
            if counts[c] > 0:
                feats.append(sample_gaussian(pooled.means[c], pooled.covs[c], int(counts[c]), gen))
                labels.append(torch.full((int(counts[c]),), c, dtype=torch.long))
        return feats, labels

    def real_features(
        self, replies: dict[int, Tensors], gen: torch.Generator
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The oracle's calibration set: the clients' real features, all or k per class."""
        x = torch.cat([replies[c]["features"] for c in sorted(replies)]).cpu()
        y = torch.cat([replies[c]["labels"] for c in sorted(replies)]).cpu()
        feats, labels = [], []
        for c in range(self.setup.num_classes):
            idx = (y == c).nonzero().flatten()
            if self.hp.oracle == "per_class" and len(idx) > self.hp.oracle_per_class:
                idx = idx[torch.randperm(len(idx), generator=gen)[: self.hp.oracle_per_class]]
            if len(idx):
                feats.append(x[idx])
                labels.append(y[idx])
        return feats, labels

    def apply(self, server: ServerState, replies: Replies, round_: int) -> tuple[ServerState, dict]:
        """Algorithm 1, lines 12-16, then classifier re-training (sec. 4)."""
        weight = server.model["classifier.weight"]
        gen = stream(self.setup, round_, self.name)
        if self.hp.oracle != "none":
            feats, labels = self.real_features(replies, gen)
        else:
            feats, labels = self.virtual_features(replies, gen)
        info = {
            **self.privacy_info(server, replies),
            "ccvr_virtual_features": sum(len(f) for f in feats),
            "ccvr_classes_without_virtual": self.setup.num_classes - len(feats),
            "ccvr_floats_per_client": _floats_per_client(replies),
        }
        extra = server.extra
        if self.mechanism is not None:
            extra = {**server.extra, DP_RELEASES: torch.tensor(info.pop("_dp_multipliers"), dtype=torch.float64)}
        if not feats:
            return ServerState(model=server.model, extra=extra), info
        virtual = torch.cat(feats).float()
        model = dict(server.model)
        model.pop(FEATURE_BETA, None)
        if model.pop(CLASSIFIER_NORM, None) is not None:  # clsnorm: start from the normalised rows
            weight = F.normalize(weight, dim=1)
        if self.hp.transform == "relu_tukey":
            virtual = relu_tukey(virtual, self.hp.tukey_beta)
            model[FEATURE_BETA] = torch.tensor(self.hp.tukey_beta, device=weight.device)
        training = ClassifierTraining(self.hp.epochs, self.hp.lr, self.hp.momentum, self.hp.weight_decay,
                                      self.hp.batch_size)
        check_finite("the virtual features", virtual)
        w, b = retrain_classifier(weight, model.get("classifier.bias"), virtual, torch.cat(labels), training, gen)
        check_finite("the re-trained classifier", w, *([] if b is None else [b]))
        model["classifier.weight"] = w
        if b is not None:
            model["classifier.bias"] = b
        return ServerState(model=model, extra=extra), info

    def privacy_info(self, server: ServerState, replies: Replies) -> dict:
        """The budget spent with this release (``MomentsMechanism.guarantee``), the share of the noisy
        covariances' spectrum the PSD repair removed, and the releases' multipliers (kept in the
        server state, so that a resumed run accounts for the releases before it)."""
        if self.mechanism is None:
            return {}
        summed = _summed_clients(replies)
        before = server.extra.get(DP_RELEASES)
        multipliers = ([] if before is None else before.tolist()) + [self.mechanism.sum_multiplier(summed)]
        return {**self.mechanism.guarantee(multipliers), "dp_accountant": accountant_name(),
                "dp_secure_aggregation": self.setup.secure_aggregation,
                "dp_covers": "CCVR's per-class statistics; not the training rounds' model updates",
                "dp_psd_removed": self.psd_removed, "dp_summed_clients": summed,
                "dp_server_sees": self.server_sees(),
                "_dp_multipliers": multipliers}


def check_finite(what: str, *tensors: torch.Tensor) -> None:
    """A calibration whose statistics are not finite fails loudly (:class:`NonFiniteStatistics`), instead of
    re-training the classifier on NaN and reporting a ruined model with exit 0."""
    if all(bool(torch.isfinite(t).all()) for t in tensors):
        return
    raise NonFiniteStatistics(f"CCVR's calibration: {what} are not finite (inf or NaN); the features overflowed "
                              "(check algorithm.ccvr.clip_norm and the training's train_loss in metrics.jsonl); "
                              "nothing was calibrated")


def _summed_clients(replies: Replies) -> int:
    """How many clients' uploads the server's sum holds."""
    return len(replies.clients) if isinstance(replies, SummedReplies) else len(replies)


def _moments(dense: Tensors) -> ClassMoments:
    return ClassMoments(dense["counts"].cpu(), dense["sums"].cpu(), dense["outer"].cpu())


def _floats_per_client(replies: Replies) -> float:
    """Floats a client uploads, on average (under secure aggregation: the dense reply every client sends)."""
    if isinstance(replies, SummedReplies):
        return float(sum(t.numel() for t in replies.total.values()))
    return sum(sum(t.numel() for t in r.values()) for r in replies.values()) / max(len(replies), 1)
