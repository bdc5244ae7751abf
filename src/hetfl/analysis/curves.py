"""Learning curves from a run directory's ``metrics.jsonl``.

Every line of ``metrics.jsonl`` is one round: always ``round``, ``train_loss``,
``bytes_up``, ``bytes_down``, ``round_time_s``; on evaluated rounds also
``client_acc_mean``, ``client_acc_std``, the quartiles ``client_acc_min`` ...
``client_acc_max`` and ``clients_evaluated`` (each client's model on its own test
split; the per-client values themselves are in ``client_metrics.jsonl``, and runs
written before that file carry them as a ``client_acc`` list) and, for methods
with one global model, ``global_acc``.
These helpers turn that log into plain lists for plots and tables: accuracy
curves, the spread of per-client accuracy (CCVR and FedUV report personalised
accuracy as a mean; the quartiles show who is left behind), train loss, rounds
to reach a target accuracy (the communication-efficiency measure of FedAvg,
McMahan et al., AISTATS 2017, Table 2) and cumulative traffic.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

METRICS_NAME = "metrics.jsonl"

Metrics = Sequence[dict[str, Any]]


def load_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rounds logged in ``path`` (a run directory or a ``metrics.jsonl`` file), in file order.

    Blank lines are skipped, and so is an unparsable *last* line (a run killed while writing
    it); an unparsable line anywhere else is an error.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_NAME
    lines = [(i, line) for i, line in enumerate(path.read_text().splitlines(), start=1) if line.strip()]
    out = []
    for pos, (number, line) in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as err:
            if pos == len(lines) - 1:
                break
            raise ValueError(f"{path}:{number}: not a JSON line ({err})") from err
    return out


def _evaluated(metrics: Metrics) -> list[dict[str, Any]]:
    return [m for m in metrics if "client_acc_mean" in m or "global_acc" in m]


def accuracy_curves(metrics: Metrics) -> dict[str, list]:
    """Accuracy per evaluated round.

    Returns ``{"round", "global_acc", "client_acc_mean", "client_acc_std"}``, lists of equal
    length over the rounds that were evaluated; a value a round did not log is ``None``
    (``global_acc`` for personalised methods).
    """
    ev = _evaluated(metrics)
    return {
        "round": [m["round"] for m in ev],
        **{key: [m.get(key) for m in ev] for key in ("global_acc", "client_acc_mean", "client_acc_std")},
    }


def client_spread(metrics: Metrics) -> dict[str, list]:
    """Distribution of per-client accuracy per evaluated round: ``{"round", "min", "q25",
    "median", "q75", "max", "num_clients"}``. A line written since the per-client arrays left
    the metrics line carries these as ``client_acc_min`` ... ``client_acc_max`` and
    ``clients_evaluated``; an older line's ``client_acc`` list is summarised here the same way
    (quartiles by numpy's default linear interpolation between order statistics). Rounds with
    neither are left out."""
    keys = ("min", "q25", "median", "q75", "max")
    out: dict[str, list] = {"round": [], **{k: [] for k in keys}, "num_clients": []}
    for m in metrics:
        if all(f"client_acc_{k}" in m for k in keys):
            values, count = [m[f"client_acc_{k}"] for k in keys], m.get("clients_evaluated")
        elif m.get("client_acc"):  # a run directory written before client_metrics.jsonl
            accs = m["client_acc"]
            values, count = np.percentile(np.asarray(accs, dtype=np.float64), [0, 25, 50, 75, 100]), len(accs)
        else:
            continue
        out["round"].append(m["round"])
        for k, v in zip(keys, values, strict=True):
            out[k].append(float(v))
        out["num_clients"].append(count)
    return out


def train_loss_curve(metrics: Metrics) -> dict[str, list]:
    """``{"round", "train_loss"}`` over every logged round."""
    rows = [m for m in metrics if "train_loss" in m]
    return {"round": [m["round"] for m in rows], "train_loss": [float(m["train_loss"]) for m in rows]}


def default_accuracy_key(metrics: Metrics) -> str:
    """``"global_acc"`` if any round logged it, else ``"client_acc_mean"`` (personalised methods)."""
    return "global_acc" if any(m.get("global_acc") is not None for m in metrics) else "client_acc_mean"


def rounds_to_target(metrics: Metrics, target: float, key: str | None = None) -> int | None:
    """The first round whose accuracy ``key`` is ``>= target``, or ``None`` if none reaches it.

    ``key`` defaults to :func:`default_accuracy_key`. Only evaluated rounds count, so with
    ``eval_every > 1`` the answer is a multiple of the evaluation period (or the last round).
    """
    key = key or default_accuracy_key(metrics)
    for m in sorted(metrics, key=lambda m: m["round"]):
        value = m.get(key)
        if value is not None and value >= target:
            return int(m["round"])
    return None


def cumulative_bytes(metrics: Metrics) -> dict[str, list]:
    """Traffic up to and including each round: ``{"round", "bytes_up", "bytes_down", "bytes_total"}``
    (integers, cumulative over the rounds in order)."""
    out: dict[str, list] = {"round": [], "bytes_up": [], "bytes_down": [], "bytes_total": []}
    up = down = 0
    for m in sorted(metrics, key=lambda m: m["round"]):
        up += int(m.get("bytes_up", 0))
        down += int(m.get("bytes_down", 0))
        out["round"].append(m["round"])
        out["bytes_up"].append(up)
        out["bytes_down"].append(down)
        out["bytes_total"].append(up + down)
    return out


def run_curves(metrics_or_path: Metrics | str | Path) -> dict[str, Any]:
    """All of the above for one run: ``{"accuracy", "spread", "train_loss", "bytes",
    "accuracy_key", "wall_time_s"}`` (``wall_time_s`` sums ``round_time_s``)."""
    metrics = (
        load_metrics(metrics_or_path) if isinstance(metrics_or_path, str | Path) else list(metrics_or_path)
    )
    return {
        "accuracy": accuracy_curves(metrics),
        "spread": client_spread(metrics),
        "train_loss": train_loss_curve(metrics),
        "bytes": cumulative_bytes(metrics),
        "accuracy_key": default_accuracy_key(metrics),
        "wall_time_s": float(sum(m.get("round_time_s", 0.0) for m in metrics)),
    }


@dataclass(frozen=True)
class SeedBand:
    """One metric of one setting over its seeds, on the rounds every seed logged (:func:`seed_band`).

    ``values[i, j]`` is seed ``seeds[i]``'s value at ``rounds[j]``; ``mean`` and ``std`` are over seeds
    (axis 0; ``std`` with ``ddof`` as given, 0 for a single seed); ``dropped`` lists the rounds that some
    seeds logged and others did not (left out, never averaged over fewer seeds)."""

    key: str
    seeds: list[Any]
    rounds: list[int]
    values: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    ddof: int
    dropped: list[int]

    @property
    def n(self) -> int:
        """The number of seeds behind every point of the band."""
        return len(self.seeds)


def _series(metrics: Metrics, key: str) -> dict[int, float]:
    """``round -> value`` over the rounds that logged ``key`` (non-finite values kept as NaN)."""
    out = {}
    for m in metrics:
        value = m.get(key)
        if value is not None:
            out[int(m["round"])] = float(value) if math.isfinite(float(value)) else math.nan
    return out


def seed_band(runs: Mapping[Any, Metrics], key: str, *, ddof: int = 1, label: str = "") -> SeedBand:
    """Mean and standard deviation over seeds of the per-round metric ``key``.

    ``runs`` maps a seed to its metrics (rows of ``metrics.jsonl``). Seeds are aligned on the rounds
    that *every* seed logged ``key`` for (with equal ``train.eval_every`` these are all evaluated
    rounds); rounds only some seeds logged are left out and listed in ``dropped``, so that no point
    is a mean over fewer seeds than the legend says. ``ddof=1`` is the sample std (n-1, as the tables
    of ``comparison.md`` and ``reproduction.md`` via :func:`hetfl.tables.mean_std`), ``ddof=0`` the
    population std (n); a single seed has std 0. A non-finite value
    (a diverged seed) makes that round's mean and std NaN, i.e. not drawn.

    Raises ValueError (naming ``label``, the seed and ``key``) when there are no runs, a seed never
    logged ``key``, or the seeds share no round.
    """
    where = f"{label}: " if label else ""
    if ddof not in (0, 1):
        raise ValueError(f"ddof {ddof!r}: must be 0 (population std) or 1 (sample std)")
    if not runs:
        raise ValueError(f"{where}no runs to average over")
    series = {seed: _series(metrics, key) for seed, metrics in runs.items()}
    for seed, values in series.items():
        if not values:
            raise ValueError(f"{where}seed {seed} logged no {key!r} in any round")
    shared = set.intersection(*(set(v) for v in series.values()))
    every = set.union(*(set(v) for v in series.values()))
    if not shared:
        listed = "; ".join(f"seed {s}: rounds {sorted(v)[:5]}" for s, v in series.items())
        raise ValueError(f"{where}the seeds share no round that logged {key!r} ({listed}): give runs of one setting "
                         "(the same train.eval_every)")
    rounds = sorted(shared)
    values = np.array([[series[seed][r] for r in rounds] for seed in series], dtype=np.float64)
    std = values.std(axis=0, ddof=ddof) if len(series) > 1 else np.zeros(len(rounds))
    return SeedBand(key, list(series), rounds, values, values.mean(axis=0), std, ddof, sorted(every - shared))

