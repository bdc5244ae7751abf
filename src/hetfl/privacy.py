"""Differential privacy (Dwork & Roth 2014): the Gaussian mechanism's noise for an (epsilon, delta)
budget and the budget a sequence of Gaussian releases spends.

The accounting is Google's ``dp-accounting`` (PyPI; the ``privacy`` extra), its privacy-loss-
distribution (PLD) accountant, which is tight for compositions of Gaussian mechanisms; nothing of it
is re-derived here. The neighbouring relation is *add or remove one sample* (a training example of
one client): the sensitivities of the methods that use this module are stated for it.

A Gaussian mechanism with L2 sensitivity ``Delta`` and noise ``N(0, (z Delta)^2)`` per coordinate
has noise multiplier ``z``; its privacy depends on ``z`` alone. A method calibrates ``z`` for the
number of releases it will make in a run (:func:`noise_multiplier`) and reports what the releases
it actually made spent (:func:`epsilon_spent`: fewer clients answering than planned means less
noise and a larger epsilon).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from importlib import metadata

import torch

EXTRA_HINT = "pip install 'hetfl[privacy]' (Google's dp-accounting)"


def require_accountant():
    """Google's dp-accounting (and its PLD module); an ImportError that says how to install it."""
    try:
        import dp_accounting
        from dp_accounting import pld
    except ImportError as err:  # pragma: no cover - the extra is part of the test install
        raise ImportError(f"differential privacy needs the accountant: {EXTRA_HINT}") from err
    return dp_accounting, pld


def accountant_name() -> str:
    """The accountant, with its version, as recorded in a run's summary."""
    return f"dp-accounting {metadata.version('dp-accounting')} PLD (add/remove one sample)"


@functools.lru_cache(maxsize=64)
def noise_multiplier(epsilon: float, delta: float, releases: int = 1) -> float:
    """The smallest noise multiplier ``z`` (to the accountant's tolerance) such that ``releases``
    Gaussian mechanisms of multiplier ``z`` together are (epsilon, delta)-DP."""
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon = {epsilon!r}: must be a finite number > 0")
    if not 0 < delta < 1:
        raise ValueError(f"delta = {delta!r}: must lie in (0, 1)")
    if releases < 1:
        raise ValueError(f"releases = {releases!r}: must be >= 1")
    dp, pld = require_accountant()

    def event(z: float):
        return dp.SelfComposedDpEvent(dp.GaussianDpEvent(z), releases)

    return float(dp.calibrate_dp_mechanism(pld.PLDAccountant, event, epsilon, delta))


def epsilon_spent(multipliers: Sequence[float], delta: float) -> float:
    """Epsilon at ``delta`` of the composition of Gaussian mechanisms with these noise multipliers
    (``inf`` if one of them is 0: a release without noise)."""
    if not multipliers:
        return 0.0
    if min(multipliers) <= 0:
        return math.inf
    dp, pld = require_accountant()
    accountant = pld.PLDAccountant()
    for z in multipliers:
        accountant.compose(dp.GaussianDpEvent(float(z)))
    return float(accountant.get_epsilon(delta))


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


__all__ = ["accountant_name", "clip_rows", "epsilon_spent", "noise_multiplier", "require_accountant", "symmetric_noise"]
