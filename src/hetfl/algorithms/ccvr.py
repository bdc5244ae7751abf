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
noise is added. Steps 1-2 with those two (not in the paper) are
:mod:`hetfl.algorithms.ccvr_statistics`; this module draws and calibrates (3-4).

The transform is part of the calibrated model: real features get the same
ReLU + Tukey before the classifier at inference (``FEATURE_BETA`` in the
model state; ``transform = "none"`` skips it everywhere). The paper transforms
only the virtual features; applying it on one side only would feed the
classifier features of another scale than it was trained on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hetfl.algorithms.base import (
    HeadTransform,
    ServerState,
    Setup,
    Tensors,
    check_class_indices,
    check_reply_form,
    register_head_transform,
)
from hetfl.algorithms.ccvr_statistics import DP_RELEASES, CCVRStatistics, check_finite, floats_per_client
from hetfl.algorithms.classifier_reg import CLASSIFIER_NORM
from hetfl.algorithms.dp_moments import NOISE_MODES, NOISE_SOURCES, check_settings
from hetfl.algorithms.gaussian_stats import ClassStats, sample_gaussian
from hetfl.algorithms.posthoc import ClassifierTraining, Replies, retrain_classifier, stream
from hetfl.params import FINITE, FLOAT32_MAX, ConfigError, setting

FEATURE_BETA = "feature_transform/tukey_beta"  # in a calibrated model's state: Tukey's beta


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

    num_virtual: int = setting(100, when={"oracle": ("none",)}, ge=1, doc="virtual features per class M_c")
    proportional: bool = setting(False, when={"oracle": ("none",)}, doc="M_c proportional to class frequency")
    transform: str = setting("relu_tukey", choices=("relu_tukey", "none"), doc="feature transform")
    tukey_beta: float = setting(0.5, when={"transform": ("relu_tukey",)}, ge=0.0, doc="Tukey beta")
    epochs: int = setting(10, ge=1, doc="classifier re-training epochs")
    lr: float = setting(0.001, gt=0.0, lt=FLOAT32_MAX, doc="re-training lr")
    momentum: float = setting(0.9, ge=0.0, lt=1.0, doc="re-training momentum")
    weight_decay: float = setting(1e-5, ge=0.0, lt=FLOAT32_MAX, doc="re-training weight decay")
    batch_size: int = setting(64, ge=1, doc="re-training batch size")
    every_round: bool = setting(False, doc="calibrate after every round")
    oracle: str = setting("none", choices=("none", "all", "per_class"),
                          doc="calibrate on real features (not private): all, or oracle_per_class per class")
    oracle_per_class: int = setting(100, when={"oracle": ("per_class",)}, ge=1,
                                    doc="real features per class for oracle = per_class")
    clip_norm: float = setting(10.0, gt=0.0, doc="L2 bound on each feature vector under differential privacy or "
                                                 "secure aggregation (plain CCVR never clips)")
    dp_epsilon: float = setting(math.inf, gt=0.0, finite=False,
                                doc="differential privacy of the statistics: the run's epsilon (inf = no DP)")
    dp_delta: float = setting(1e-5, when={"dp_epsilon": FINITE}, gt=0.0, lt=1.0, doc="differential privacy: delta")
    dp_noise: str = setting("distributed", when={"dp_epsilon": FINITE}, choices=NOISE_MODES,
                            doc="distributed: the clients' noise adds up to the budget in the sum (use with secure "
                                "aggregation); local: each upload carries the whole noise")
    dp_noise_source: str = setting("seed", when={"dp_epsilon": FINITE}, choices=NOISE_SOURCES,
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


class CCVR(CCVRStatistics):
    """Algorithm 1: the clients' per-class moments pooled into Gaussians (:class:`CCVRStatistics`, with
    secure aggregation and differential privacy), virtual features drawn from them, the classifier
    re-trained on those."""

    name = "ccvr"
    Hyper = CCVRHyper
    citation = "Luo et al., NeurIPS 2021"

    def __init__(self, hyper: CCVRHyper, setup: Setup) -> None:
        if math.isfinite(hyper.dp_epsilon) and hyper.oracle != "none":  # refused at set-up
            raise ConfigError("algorithm.ccvr.oracle", hyper.oracle, "the oracle uploads the clients' raw "
                              "features: it cannot be private (algorithm.ccvr.dp_epsilon must stay inf)")
        super().__init__(hyper, setup)

    @property
    def additive(self) -> bool:  # type: ignore[override]
        """Moments pool by their sum (the oracle's raw features do not)."""
        return self.hp.oracle == "none"

    def client_query(self, model_state: Tensors, features: torch.Tensor, labels: torch.Tensor, *, client: int,
                     round_: int) -> Tensors:
        """Algorithm 1, lines 5-9: the client's per-class moments (eq. 2 in additive form,
        :meth:`~CCVRStatistics.moments_reply`); the oracle uploads the features themselves."""
        if self.hp.oracle != "none":
            return {"features": features, "labels": labels}
        return self.moments_reply(features, labels, client=client, round_=round_)

    def check_reply(self, reply: Tensors, model_state: Tensors) -> None:
        """The moments (:meth:`CCVRStatistics.check_reply`), or the oracle's features (float32 rows of the
        classifier's input size, finite) and their labels (class indices)."""
        if self.hp.oracle == "none":
            super().check_reply(reply, model_state)
            return
        rows = len(reply["labels"]) if "labels" in reply else 0
        dim = int(model_state["classifier.weight"].shape[1])
        check_reply_form(reply, {"features": (rows, dim), "labels": (rows,)},
                         {"features": (torch.float32,), "labels": (torch.int64,)})
        check_class_indices("labels", reply["labels"], self.setup.num_classes, distinct=False)

    def memory_needs(self, feature_dim: int) -> list[tuple[str, Any, int, str]]:
        """The virtual features: num_virtual x C draws (proportional counts sum to about as many) of
        ``feature_dim`` entries, each held about three times at once (the float64 noise and draws, their
        float32 copy and its transform: 24 bytes an entry). The oracle holds the real features instead."""
        if self.hp.oracle != "none":
            return []
        count = self.hp.num_virtual * self.setup.num_classes
        return [("algorithm.ccvr.num_virtual", self.hp.num_virtual, 24 * count * feature_dim,
                 f"CCVR's {count:,} virtual features of {feature_dim} dimensions")]

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
            "ccvr_floats_per_client": floats_per_client(replies),
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
