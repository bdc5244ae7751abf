"""Differential privacy (Dwork & Roth 2014): the Gaussian mechanism's noise for an (epsilon, delta)
budget and the budget a sequence of Gaussian releases spends.

The accounting is Google's ``dp-accounting`` (PyPI; the ``privacy`` extra): its exact conversion
between epsilon, delta and the noise of one Gaussian mechanism (``dp_accounting.gaussian_mechanism``,
the analytic Gaussian mechanism of Balle & Wang 2018, eq. 6), which is tight and takes milliseconds.
A sequence of Gaussian releases with noise multipliers ``z_1 .. z_k`` is composed exactly: its
privacy loss is that of ONE Gaussian mechanism of multiplier ``(sum_i z_i^-2)^(-1/2)`` (the privacy
loss of a Gaussian mechanism is itself Gaussian, ``N(mu^2 / 2, mu^2)`` with ``mu = 1 / z``, and those
of independent releases add up: Dong, Roth & Su 2022, Corollary 3.3). So the budget of ``k`` releases
costs one conversion whatever ``k`` (the PLD accountant's numerical composition, used before, grew in
time and memory with the releases and lost accuracy at extreme budgets; the tests check the two agree
where both are exact). The neighbouring relation is *add or remove one sample* (a training example of
one client): the sensitivities of the methods that use this module are stated for it.

A Gaussian mechanism with L2 sensitivity ``Delta`` and noise ``N(0, (z Delta)^2)`` per coordinate
has noise multiplier ``z``; its privacy depends on ``z`` alone. A method calibrates ``z`` for the
number of releases it will make in a run (:func:`noise_multiplier`) and reports what the releases
it actually made spent (:func:`epsilon_spent`: fewer clients answering than planned means less
noise and a larger epsilon).

Accepted budgets (:data:`EPSILON_RANGE`, :data:`DELTA_RANGE`, :func:`check_budget`): epsilon in
[0.001, 100], delta in [1e-15, 0.01]. The conversion is exact on a wider grid (checked against
60-digit arithmetic: within 1e-9 relative in delta for epsilon in [0.001, 300] and delta in [1e-300,
1)); the range excludes what is no guarantee (epsilon above 100 allows a factor e^100; delta above
0.01 lets one sample in a hundred be published outright) or is almost surely a typo (epsilon below
0.001, delta below 1e-15: noise hundreds of times the data's range).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from importlib import metadata
from typing import Any

import torch

EXTRA_HINT = "pip install 'hetfl[privacy]' (Google's dp-accounting)"
#: the epsilons and deltas hetfl accepts (inclusive): see the module's docstring
EPSILON_RANGE = (1e-3, 100.0)
DELTA_RANGE = (1e-15, 1e-2)


def epsilon_text(epsilon: float, digits: int = 3) -> str:
    """``epsilon`` to ``digits`` significant digits, rounded UP (``33.7155`` -> ``"33.8"``): a guarantee shown
    is never below the one computed (``:.3g`` rounds to nearest, down half the time)."""
    if not math.isfinite(epsilon) or epsilon <= 0:
        return f"{epsilon:g}"
    exact = Decimal(repr(epsilon))
    shown = exact.quantize(Decimal(1).scaleb(exact.adjusted() - digits + 1), rounding=ROUND_CEILING)
    return f"{float(shown):.{digits}g}"


def server_epsilon(privacy: Mapping[str, Any]) -> tuple[float, bool]:
    """The epsilon a run's server faces, from ``summary.json``'s ``privacy`` (the metrics line's ``dp_`` keys
    without the prefix), and whether it is the per-upload one. ``epsilon`` is the guarantee of what the server
    is meant to see: the sum, for distributed noise. Without secure aggregation the server sees each upload,
    which carries only its share of the noise: it then faces ``epsilon_per_upload``, far larger. A summary that
    does not say it had secure aggregation is taken not to have had it (the larger epsilon, never the smaller)."""
    epsilon = float(privacy["epsilon"])
    per_upload = privacy.get("epsilon_per_upload")
    if privacy.get("noise") == "distributed" and not privacy.get("secure_aggregation") and per_upload is not None:
        return max(epsilon, float(per_upload)), True
    return epsilon, False


def budget_text(epsilon: float, delta: float, per_upload: bool) -> str:
    """A budget as hetfl's tables show it: epsilon rounded up (:func:`epsilon_text`), ``per upload`` where that
    is what the server faced (:func:`server_epsilon`), delta in brackets: ``"33.8 per upload (1e-05)"``."""
    return f"{epsilon_text(epsilon)}{' per upload' if per_upload else ''} ({delta:g})"


@dataclass(frozen=True)
class Release:
    """One differentially private release, as a run's privacy ledger records it before the server uses it.

    multiplier: the noise multiplier the method accounts the release with (the same number it keeps in its
        server state: the sum's, for CCVR's and FedPAC's moments).
    digest: SHA-256 of the released tensors (:func:`release_digest`): a release made again with the same
        seeded noise on the same data is the same release (nothing new is revealed), and is recognised so.
    noise_source: where its noise came from ("seed" or "os").
    clients: the clients whose uploads it may hold: those its phase asked (a client not asked uploaded nothing),
        whether their replies came, came late or were refused; None: any client (counted for every one).
    uploads: per client, the digest of its noisy upload as the server received it (:func:`release_digest` of
        the noisy tensors), where the server sees each upload; None where it does not (a secure sum) or the
        method does not say. With seeded noise, the same client's round uploaded twice with different
        content is a noiseless difference; twice the same is nothing new (:meth:`PrivacyLedger.reused_seeded_noise`
        in ``hetfl.engine.ledger``).
    """

    multiplier: float
    digest: str
    noise_source: str
    clients: tuple[int, ...] | None = None
    uploads: Mapping[int, str] | None = None


def release_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over the named tensors in the given order (name, dtype, shape and bytes of each, on the CPU)."""
    h = hashlib.sha256()
    for name, t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def refused_digest(refused: Mapping[int, str]) -> str:
    """SHA-256 over the digests of uploads a server received and refused, by client (in client order): the
    digest of such a release in the privacy ledger."""
    h = hashlib.sha256(b"refused|")
    for client in sorted(refused):
        h.update(f"{int(client)}|{refused[client]}|".encode())
    return h.hexdigest()


def require_accountant():
    """Google's dp-accounting (its exact Gaussian-mechanism module); an ImportError that says how to install it."""
    try:
        import dp_accounting
        from dp_accounting import gaussian_mechanism
    except ImportError as err:  # pragma: no cover - the extra is part of the test install
        raise ImportError(f"differential privacy needs the accountant: {EXTRA_HINT}") from err
    return dp_accounting, gaussian_mechanism


def accountant_name() -> str:
    """The accountant, with its version, as recorded in a run's summary."""
    return (f"dp-accounting {metadata.version('dp-accounting')} analytic Gaussian (Balle & Wang 2018), "
            "releases composed exactly (add/remove one sample)")


def budget_problem(epsilon: float, delta: float) -> tuple[str, float, str] | None:
    """``(name, value, what is allowed)`` for the first of epsilon and delta outside the accepted range
    (:data:`EPSILON_RANGE`, :data:`DELTA_RANGE`), or None when both are inside."""
    for name, value, (lo, hi) in (("epsilon", epsilon, EPSILON_RANGE), ("delta", delta, DELTA_RANGE)):
        if not (isinstance(value, int | float) and lo <= value <= hi):
            return name, value, f"must lie in [{lo:g}, {hi:g}], the range hetfl's accountant accepts (docs/privacy.md)"
    return None


def check_budget(epsilon: float, delta: float) -> None:
    """A ValueError naming the value and the accepted range if (epsilon, delta) is outside it."""
    problem = budget_problem(epsilon, delta)
    if problem:
        name, value, allowed = problem
        raise ValueError(f"{name} = {value!r}: {allowed}")


@functools.lru_cache(maxsize=64)
def noise_multiplier(epsilon: float, delta: float, releases: int = 1) -> float:
    """The smallest noise multiplier ``z`` such that ``releases`` Gaussian mechanisms of multiplier ``z``
    together are (epsilon, delta)-DP: ``sqrt(releases)`` times that of one release (exact composition),
    in time and memory independent of ``releases``."""
    check_budget(epsilon, delta)
    if not (isinstance(releases, int) and releases >= 1):
        raise ValueError(f"releases = {releases!r}: must be an integer >= 1")
    _, gaussian = require_accountant()
    return math.sqrt(releases) * float(gaussian.get_sigma_gaussian(epsilon, delta))


def composed_multiplier(multipliers: Sequence[float]) -> float:
    """The multiplier of the one Gaussian mechanism whose privacy loss is exactly that of releases with these
    multipliers: ``(sum z_i^-2)^(-1/2)`` (0 if one of them is 0: a release without noise; inf for none)."""
    if not multipliers:
        return math.inf
    if min(multipliers) <= 0:
        return 0.0
    return 1.0 / math.sqrt(math.fsum(1.0 / (float(z) * float(z)) for z in multipliers))


def epsilon_spent(multipliers: Sequence[float], delta: float) -> float:
    """Epsilon at ``delta`` of the composition of Gaussian mechanisms with these noise multipliers
    (``inf`` if one of them is 0: a release without noise; 0 for none)."""
    z = composed_multiplier(multipliers)
    if z == math.inf:
        return 0.0
    if z == 0.0:
        return math.inf
    _, gaussian = require_accountant()
    return float(gaussian.get_epsilon_gaussian(z, delta))


def participation(clients: Sequence[Collection[int] | None]) -> torch.Tensor | None:
    """Who took part in each release (``clients``: per release, the clients it may hold, None for any client) as a
    boolean ``[releases, max client + 1]`` matrix, a row of None all True; None when no release names its clients
    (every client in every release). A client beyond the matrix's columns is in the all-True rows only, which
    every column is in too: it is never the worst (:func:`worst_client_multipliers`)."""
    named = [row for row in clients if row is not None]
    if not named:
        return None
    width = 1 + max((max(row) for row in named if row), default=0)
    matrix = torch.zeros(len(clients), width, dtype=torch.bool)
    for i, row in enumerate(clients):
        if row is None:
            matrix[i] = True
        elif row:
            matrix[i, list(row)] = True
    return matrix


def worst_client_multipliers(multipliers: Sequence[float], taken_part: torch.Tensor | None) -> list[float]:
    """The multipliers of the releases the most exposed client is in, in order: the client whose releases' privacy
    losses compose to the largest one (the largest ``sum z_i^-2``: exact composition, :func:`composed_multiplier`).
    ``taken_part``: :func:`participation`'s matrix for these releases; None: every client is in every release.

    Why per client: the neighbouring relation is one sample added or removed, and a sample lives at one client;
    a release whose phase did not ask that client is computed without its data. Who is asked is drawn from the
    run's seed, apart from the data, and known to the server, so this claims no amplification by sampling, only
    that a client's releases are those it took part in."""
    if taken_part is None:
        return list(multipliers)
    if taken_part.shape[0] != len(multipliers):
        raise ValueError(f"participation has {taken_part.shape[0]} rows for {len(multipliers)} releases")
    if not multipliers:
        return []
    z = torch.tensor([float(m) for m in multipliers], dtype=torch.float64)
    precision = torch.where(z > 0, z.clamp(min=1e-300).pow(-2), torch.full_like(z, math.inf))
    per_client = torch.where(taken_part, precision.unsqueeze(1), torch.zeros(())).sum(0)
    candidates = (per_client >= per_client.max() * (1 - 1e-12)).nonzero().flatten().tolist()  # then exactly
    columns = [[float(m) for m, took in zip(multipliers, taken_part[:, c].tolist(), strict=True) if took]
               for c in candidates]
    return min(columns, key=composed_multiplier)


def clip_rows(x: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Each row scaled to L2 norm at most ``max_norm`` (``x * min(1, max_norm / ||x||)``): the bound
    that gives a sum of rows its sensitivity."""
    norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    return x * (max_norm / norms.clamp(min=max_norm))


def symmetric_noise(shape: tuple[int, ...], std: float, generator: torch.Generator) -> torch.Tensor:
    """Gaussian noise for symmetric ``[..., d, d]`` matrices (float64): independent ``N(0, std^2)`` on
    the upper triangle with the diagonal, mirrored below it (the mechanism releases the upper
    triangle; the mirror is post-processing)."""
    g = torch.randn(shape, generator=generator, dtype=torch.float64) * std
    upper = torch.triu(g)
    return upper + torch.triu(g, diagonal=1).transpose(-1, -2)


__all__ = ["DELTA_RANGE", "EPSILON_RANGE", "Release", "accountant_name", "budget_problem", "check_budget",
           "clip_rows", "composed_multiplier", "epsilon_spent", "noise_multiplier", "participation", "refused_digest",
           "release_digest", "require_accountant", "symmetric_noise", "worst_client_multipliers"]
