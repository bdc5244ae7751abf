"""The Gaussian mechanism on additive per-class moments: what CCVR's (and FedPAC's) clients upload
under differential privacy, and the budget it spends.

Each client clips its features to L2 norm ``C`` (``clip_norm``), computes per class the count
``n_c``, the sum ``s_c`` and (CCVR) the sum of outer products ``Q_c`` (:func:`class_moments`), and
adds Gaussian noise to every entry of every class, the classes it does not hold included (a reply
must not reveal which classes a client holds; it is dense).

Sensitivity (add or remove one sample ``z`` of class c, ``||z|| <= C``): ``n_c`` changes by 1,
``s_c`` by ``z`` (norm <= C), the upper triangle of ``Q_c`` by that of ``z z^T`` (norm <= ``||z z^T||_F
= ||z||^2 <= C^2``); nothing else changes. Scaled by ``1, 1/C, 1/C^2`` the three parts form one
vector of L2 sensitivity ``Delta = sqrt(3)`` (``sqrt(2)`` without ``Q``), and noise
``N(0, (z Delta)^2)`` on each scaled coordinate is the Gaussian mechanism of multiplier ``z``:
standard deviations ``z Delta``, ``z Delta C`` and ``z Delta C^2`` on counts, sums and outer products.
Equal weight to the three parts is a choice, not an optimum.

Where the noise comes from (``noise``):

- ``"distributed"``: each of the ``m`` clients asked adds the share ``z^2 / m`` of the variance, so
  the SUM over all ``m`` carries ``N(0, (z Delta)^2)``: the sum is (epsilon, delta)-DP. This protects
  against a server that sees only the sum (secure aggregation); a server that sees each upload
  gets multiplier ``z / sqrt(m)`` per upload (reported as ``epsilon_per_upload``). If only ``k < m``
  uploads are summed, the sum carries ``k z^2 / m``: the spent epsilon is computed with that.
- ``"local"``: each client adds the whole ``z^2``: every upload is (epsilon, delta)-DP on its own
  (a sample lives at one client only), whatever the server sees; the sum carries ``m`` times the
  noise, the price of not trusting the aggregation.

The server's post-processing (means, covariances, sampling) keeps the guarantee. Noisy second
moments give covariances that need not be positive semi-definite: :func:`nearest_psd` clips their
negative eigenvalues to zero (the Frobenius-nearest PSD matrix) and reports how much it removed.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hetfl.algorithms.gaussian_stats import ClassMoments, class_moments
from hetfl.params import ConfigError
from hetfl.privacy import (
    Release,
    budget_problem,
    clip_rows,
    epsilon_spent,
    noise_multiplier,
    refused_digest,
    symmetric_noise,
    worst_client_multipliers,
)
from hetfl.rng import method_generator

NOISE_MODES = ("distributed", "local")
NOISE_SOURCES = ("seed", "os")


def check_settings(prefix: str, epsilon: float, delta: float, clip_norm: float, *, with_outer: bool) -> None:
    """Refuse, naming the key (``prefix`` + its name), a budget outside the accountant's accepted range
    (:func:`hetfl.privacy.budget_problem`; ``epsilon = inf`` is no privacy and passes) and a clip norm whose
    powers in the statistics (``C``, and ``C^2`` for outer products) are not finite floats: a ConfigError
    raised while the settings are read, before any work."""
    if math.isfinite(epsilon):
        problem = budget_problem(epsilon, delta)
        if problem:
            name, value, allowed = problem
            raise ConfigError(f"{prefix}dp_{name}", value, allowed)
    scale = clip_norm * clip_norm if with_outer else clip_norm
    if not math.isfinite(scale):  # the largest C whose power is finite (the check applies no other bound)
        power = "clip_norm^2 (the outer products' bound)" if with_outer else "clip_norm"
        largest = torch.finfo(torch.float64).max
        raise ConfigError(f"{prefix}clip_norm", clip_norm, f"{power} is not a finite float64; "
                          f"must be at most {math.sqrt(largest) if with_outer else largest:.3g}")


def nonfinite_bounds(bounds: dict[str, float]) -> list[str]:
    """The names of the bounds (upload noise or reply bounds, by tensor) that are not finite."""
    return [name for name, value in bounds.items() if not math.isfinite(value)]


@dataclass(frozen=True)
class MomentsMechanism:
    """The Gaussian mechanism of one method's moment uploads in a run.

    epsilon, delta: the budget of the run's whole release (``releases`` rounds of uploads).
    clip_norm: the L2 bound ``C`` on each feature vector.
    clients: ``m``, the clients whose uploads the noise shares assume are summed (all asked).
    noise: "distributed" or "local" (module docstring).
    with_outer: the uploads include the outer products (CCVR), or only counts and sums (FedPAC).
    """

    epsilon: float
    delta: float
    clip_norm: float
    clients: int
    releases: int = 1
    noise: str = "distributed"
    with_outer: bool = True

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of one sample's (count, sum / C, upper(Q) / C^2)."""
        return math.sqrt(3.0 if self.with_outer else 2.0)

    @property
    def multiplier(self) -> float:
        """``z`` for the sum of all ``m`` uploads (distributed) or for each upload (local)."""
        return noise_multiplier(self.epsilon, self.delta, self.releases)

    @property
    def share(self) -> float:
        """The fraction of ``(z Delta)^2`` one upload's noise carries."""
        return 1.0 / self.clients if self.noise == "distributed" else 1.0

    def upload_std(self) -> dict[str, float]:
        """Noise standard deviation per entry of one client's upload, by tensor: the tensors it uploads only
        (no ``outer`` without :attr:`with_outer`: FedPAC's bounds and refusals name what it sends)."""
        base = self.multiplier * self.sensitivity * math.sqrt(self.share)
        c = self.clip_norm
        std = {"counts": base, "sums": base * c}
        if self.with_outer:
            std["outer"] = base * c * c
        return std

    def privatize(self, features: torch.Tensor, labels: torch.Tensor, num_classes: int,
                  generator: torch.Generator) -> ClassMoments:
        """A client's dense noisy moments (float64, on the CPU): clipped features, every class."""
        clipped = clip_rows(features.detach().to(torch.float64), self.clip_norm)
        moments = class_moments(clipped, labels, num_classes)
        std = self.upload_std()
        d = clipped.shape[1]
        counts = moments.counts.cpu() + torch.randn(num_classes, generator=generator,
                                                    dtype=torch.float64) * std["counts"]
        sums = moments.sums.cpu() + torch.randn(num_classes, d, generator=generator, dtype=torch.float64) * std["sums"]
        outer = moments.outer.cpu()
        if self.with_outer:
            outer = outer + symmetric_noise((num_classes, d, d), std["outer"], generator)
        return ClassMoments(counts, sums, outer)

    def sum_multiplier(self, summed: int) -> float:
        """The multiplier of the noise in a sum of ``summed`` uploads (against the sum alone)."""
        return self.multiplier * math.sqrt(summed * self.share)

    def upload_multiplier(self) -> float:
        """The multiplier of one upload's own noise (against a server that sees each upload)."""
        return self.multiplier * math.sqrt(self.share)

    def refused_release(self, refused: Mapping[int, str], noise_source: str) -> Release:
        """The release in the noisy uploads the server received and refused (by client: the digest of each
        upload's bytes), when nothing usable came in that attempt: accounted as the sum of those uploads (the
        multiplier of the noise in ``len(refused)`` uploads), like the uploads a stopped phase received; each
        refused upload is one of its client's uploads, covered per upload as a release's are."""
        return Release(self.sum_multiplier(len(refused)), refused_digest(refused), noise_source)

    def guarantee(self, sum_multipliers: list[float], taken_part: torch.Tensor | None = None) -> dict[str, float | str]:
        """The budget spent by the releases so far (their sums' multipliers, in order), for the metrics
        line and the summary: ``dp_epsilon`` against what the server is meant to see (the sum, for
        distributed noise; each upload, for local noise) and ``dp_epsilon_per_upload``, each that of the most
        exposed client (:func:`hetfl.privacy.worst_client_multipliers`; ``taken_part``: who was asked in each
        release, None: every client in every release). ``dp_releases``: the releases the server received;
        ``dp_client_releases``: the most of them one client took part in."""
        per_upload = worst_client_multipliers([self.upload_multiplier()] * len(sum_multipliers), taken_part)
        upload_eps = epsilon_spent(per_upload, self.delta)
        eps = (epsilon_spent(worst_client_multipliers(sum_multipliers, taken_part), self.delta)
               if self.noise == "distributed" else upload_eps)
        return {"dp_epsilon": eps, "dp_delta": self.delta, "dp_epsilon_target": self.epsilon,
                "dp_epsilon_per_upload": upload_eps, "dp_noise_multiplier": self.multiplier,
                "dp_noise": self.noise, "dp_clip_norm": self.clip_norm, "dp_releases": len(sum_multipliers),
                "dp_client_releases": len(per_upload)}


def noise_generator(source: str, seed: int, method: str, round_: int, client: int) -> torch.Generator:
    """The noise's random stream. ``"seed"``: from the run's seed (reproducible: a simulation's numbers
    repeat, and anyone who knows the config can recompute the noise, so it protects nothing in a real
    deployment). ``"os"``: from the operating system's randomness (deployments; not reproducible)."""
    if source == "os":
        return torch.Generator().manual_seed(secrets.randbits(63))
    return method_generator(seed, f"{method}.dp_noise", round_, client)


def nearest_psd(covs: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Each symmetric ``[d, d]`` matrix with its negative eigenvalues set to zero (the nearest PSD matrix
    in Frobenius norm), and the share of the spectrum removed: sum |negative eigenvalues| / sum |all|."""
    values, vectors = torch.linalg.eigh(covs)
    removed = float(values.clamp(max=0).abs().sum() / values.abs().sum().clamp(min=1e-300))
    repaired = vectors @ torch.diag_embed(values.clamp(min=0)) @ vectors.transpose(-1, -2)
    return 0.5 * (repaired + repaired.transpose(-1, -2)), removed
