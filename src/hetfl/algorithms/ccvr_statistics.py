"""CCVR's statistics as a protocol: what clients upload and how the server pools it.

Algorithm 1's lines 5-12 (Luo et al., NeurIPS 2021, eq. 2-4) in additive form: each client uploads,
per class, its count ``N_ck``, feature sum ``s_ck`` and sum of outer products ``Q_ck``; the server sums
them over clients and derives the per-class Gaussians (:mod:`hetfl.algorithms.ccvr` then samples and
calibrates). Sums are what a server can receive three ways, all beyond the paper:

- in the clear: the classes a client holds only (their indices named);
- under secure aggregation (``runtime.secure_aggregation``): every class (absent ones as zeros, so that
  all uploads have one shape: :meth:`CCVRStatistics.dense_reply`), features clipped to ``clip_norm`` so
  that each entry lies within the public :meth:`CCVRStatistics.reply_bounds` of the fixed-point encoding;
  the server learns the sum only;
- under differential privacy (``dp_epsilon`` finite): the Gaussian mechanism of
  :mod:`hetfl.algorithms.dp_moments` on the clipped moments, the run's budget over its releases, the
  noisy covariances repaired to PSD, and what was spent reported in each metrics line
  (:meth:`CCVRStatistics.privacy_info`), as the server faces it (:meth:`CCVRStatistics.server_sees`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import torch

from hetfl.algorithms.base import ServerState, Setup, Tensors, check_class_indices, check_reply_form
from hetfl.algorithms.dp_moments import MomentsMechanism, nearest_psd, noise_generator, nonfinite_bounds
from hetfl.algorithms.gaussian_stats import (
    ClassMoments,
    ClassStats,
    NonFiniteStatistics,
    class_moments,
    stats_from_moments,
    sum_moments,
)
from hetfl.algorithms.posthoc import PostHoc, Replies, SummedReplies
from hetfl.params import ConfigError
from hetfl.privacy import Release, accountant_name, clip_rows, epsilon_text, release_digest, require_accountant

DP_RELEASES = "ccvr/dp_multipliers"  # server extra: the noise multiplier of each release's sum so far


class CCVRStatistics(PostHoc):
    """The upload and pooling of CCVR's per-class moments (module docstring), for a step whose settings
    ``hp`` hold ``clip_norm``, ``dp_epsilon``, ``dp_delta``, ``dp_noise``, ``dp_noise_source`` and
    ``every_round`` (:class:`hetfl.algorithms.ccvr.CCVRHyper`)."""

    dp_releases_key = DP_RELEASES

    def __init__(self, hyper: Any, setup: Setup) -> None:
        super().__init__(hyper, setup)
        self.psd_removed = 0.0  # share of the last noisy covariances' spectrum the PSD repair removed
        if self.private:  # refused at set-up, before anything is written
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

    # ------------------------------------------------------------------ client
    def moments_reply(self, features: torch.Tensor, labels: torch.Tensor, *, client: int, round_: int) -> Tensors:
        """Algorithm 1, lines 5-9 (eq. 2 in additive form): the client's per-class count, sum of features and
        sum of outer products (float64), classes it holds only. Per class held: its index, 1 + d + d^2 floats
        (the full symmetric ``outer``; its upper triangle, ``ClassMoments.num_floats``, would be enough)."""
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

    # ------------------------------------------------------------------ server
    def check_reply(self, reply: Tensors, model_state: Tensors) -> None:
        """A client's moments as :meth:`moments_reply` makes them for features of the classifier's input size
        (float64, finite): under differential privacy every class; in the clear the classes held (distinct
        indices, each with a whole count of at least 1). A ValueError naming what differs."""
        classes, dim = self.setup.num_classes, int(model_state["classifier.weight"].shape[1])
        floats = (torch.float64,)
        if self.mechanism is not None:
            check_reply_form(reply, {"counts": (classes,), "sums": (classes, dim), "outer": (classes, dim, dim)},
                             dict.fromkeys(("counts", "sums", "outer"), floats))
            return
        if "classes" in reply:
            check_class_indices("classes", reply["classes"], classes, distinct=True)
        held = len(reply["classes"]) if "classes" in reply else 0
        check_reply_form(reply, {"classes": (held,), "counts": (held,), "sums": (held, dim), "outer": (held, dim, dim)},
                         {"classes": (torch.int64,), **dict.fromkeys(("counts", "sums", "outer"), floats)})
        counts = reply["counts"]
        if bool((counts < 1).any()) or not bool((counts == counts.round()).all()):
            raise ValueError("'counts' must be whole numbers of at least 1 (the classes the client holds)")

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

    # ----------------------------------------------------------------- privacy
    def dp_release(self, received: Replies) -> Release | None:
        """The release the server got in a statistics round under differential privacy: the multiplier of the
        noise in the sum of the uploads it got, and the digest of what it got (for the run's ledger)."""
        if self.mechanism is None:
            return None
        uploads = None  # a secure sum: the server never saw an upload
        if isinstance(received, SummedReplies):
            named = [(f"sum/{k}", received.total[k]) for k in sorted(received.total)]
            named.append(("clients", torch.tensor(received.clients, dtype=torch.int64)))
        else:
            named = [(f"{c}/{k}", received[c][k]) for c in sorted(received) for k in sorted(received[c])]
            uploads = {c: release_digest([(k, received[c][k]) for k in sorted(received[c])]) for c in received}
        return Release(self.mechanism.sum_multiplier(_summed_clients(received)), release_digest(named),
                       self.hp.dp_noise_source, uploads=uploads)

    def dp_refused(self, refused: Mapping[int, str]) -> Release | None:
        """The noisy statistics the server received and refused in a phase with nothing usable (a node with
        other data, a reply that does not decode): a release of those uploads (``MomentsMechanism.refused_release``)."""
        if self.mechanism is None:
            return None
        return self.mechanism.refused_release(refused, self.hp.dp_noise_source)

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

    def privacy_info(self, server: ServerState, replies: Replies) -> dict:
        """The budget spent with this release (``MomentsMechanism.guarantee``), the share of the noisy
        covariances' spectrum the PSD repair removed, and the releases' multipliers (kept in the
        server state, so that a resumed run accounts for the releases before it)."""
        if self.mechanism is None:
            return {}
        summed = _summed_clients(replies)
        before = server.extra.get(DP_RELEASES)
        multipliers = ([] if before is None else before.tolist()) + [self.mechanism.sum_multiplier(summed)]
        taken_part = self.dp_participation(server, len(multipliers))
        return {**self.mechanism.guarantee(multipliers, taken_part), "dp_accountant": accountant_name(),
                "dp_secure_aggregation": self.setup.secure_aggregation,
                "dp_covers": "CCVR's per-class statistics; not the training rounds' model updates, nor what a "
                             "set-up round uploads (FedMix's and FedBR's rsm_clients averaged inputs)",
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


def floats_per_client(replies: Replies) -> float:
    """Floats a client uploads, on average (under secure aggregation: the dense reply every client sends)."""
    if isinstance(replies, SummedReplies):
        return float(sum(t.numel() for t in replies.total.values()))
    return sum(sum(t.numel() for t in r.values()) for r in replies.values()) / max(len(replies), 1)


def _summed_clients(replies: Replies) -> int:
    """How many clients' uploads the server's sum holds."""
    return len(replies.clients) if isinstance(replies, SummedReplies) else len(replies)


def _moments(dense: Tensors) -> ClassMoments:
    return ClassMoments(dense["counts"].cpu(), dense["sums"].cpu(), dense["outer"].cpu())
