"""What a run reports: the metrics line's summary of the clients' accuracies, the lines of
``client_metrics.jsonl``, ``summary.json``, and the progress callbacks (:class:`Reporter`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from hetfl import config as config_mod
from hetfl.config import RunConfig
from hetfl.engine.identity import run_id, setting_id
from hetfl.engine.rundir import History


class SetUp(Protocol):
    """What a summary and a :class:`Reporter` read of the experiment they report (an
    :class:`~hetfl.engine.experiment.Experiment`, which imports this module)."""

    num_params: int
    device: Any
    chance_acc: float  # the global test set's largest class share: a constant prediction's accuracy

#: the quantiles of the clients' accuracies in the metrics line, as ``client_acc_<key>``
SPREAD_KEYS = ("min", "q25", "median", "q75", "max")


def client_acc_summary(accs: list[float]) -> dict[str, Any]:
    """The metrics line's constant-size summary of the evaluated clients' accuracies (in client order):
    mean and standard deviation (as before), the number of clients, and the quartiles with min and max of
    the accuracies rounded to 6 decimals (numpy's default linear interpolation): the numbers
    ``analysis.curves.client_spread`` used to compute from the per-client list the line carried."""
    out: dict[str, Any] = {"client_acc_mean": float(np.mean(accs)), "client_acc_std": float(np.std(accs)),
                           "clients_evaluated": len(accs)}
    if accs:
        values = np.percentile(np.asarray([round(a, 6) for a in accs], dtype=np.float64), [0, 25, 50, 75, 100])
        out.update({f"client_acc_{k}": float(v) for k, v in zip(SPREAD_KEYS, values, strict=True)})
    return out


def client_row(round_: int, by_client: dict[int, float], num_clients: int) -> dict[str, Any]:
    """A line of ``client_metrics.jsonl``: each client's accuracy (6 decimals) by client id, None (null)
    for a client not evaluated (no test split, or no reply from a Flower node)."""
    return {"round": round_, "client_acc": [None if c not in by_client else round(by_client[c], 6)
                                            for c in range(num_clients)]}


#: metrics-line keys a loss part may not take (it is then written as ``train_part_<name>``)
_LINE_KEYS = frozenset({"train_loss", "train_part"})


def loss_parts(part_sums: dict[str, float], steps: int) -> dict[str, float]:
    """The metrics line's parts of the train loss: each part a method's loss returns (``{"ce": ...,
    "penalty": ...}``; an adversary stage's as ``max/contrastive``) as ``train_<part>``, its mean per local
    step over the round's clients, as ``train_loss`` is. Keys in sorted order, so every executor writes
    the same line."""
    out = {}
    for name in sorted(part_sums):
        key = f"train_{name}"
        out[key if key not in _LINE_KEYS else f"train_part_{name}"] = part_sums[name] / max(steps, 1)
    return out


def diverged_round(history: Sequence[dict[str, Any]]) -> int | None:
    """The first round whose train loss is inf or NaN (``metrics.jsonl`` lines), or None."""
    if isinstance(history, History):  # tracked as its lines were added: no parse of every line each round
        return history.first_nonfinite
    return next((m["round"] for m in history if not math.isfinite(m["train_loss"])), None)


def make_summary(cfg: RunConfig, history: Sequence[dict[str, Any]], wall: float, exp: SetUp) -> dict[str, Any]:
    evaluated = [m for m in history if "client_acc_mean" in m]
    summary: dict[str, Any] = {
        "algorithm": cfg.algorithm.name,
        "rounds": len(history),
        "wall_time_s": round(wall, 3),
        "num_params": exp.num_params,
        "bytes_up_total": sum(m["bytes_up"] for m in history),
        "bytes_down_total": sum(m["bytes_down"] for m in history),
    }
    if evaluated and "global_acc" in evaluated[-1]:
        summary["final_global_acc"] = evaluated[-1]["global_acc"]
        summary["best_global_acc"] = max(m["global_acc"] for m in evaluated)
        summary["chance_global_acc"] = exp.chance_acc
    for key in (history[-1] if history else {}):
        if key.startswith("global_acc_before_"):
            summary["final_" + key] = history[-1][key]
    if evaluated:
        summary["final_client_acc_mean"] = evaluated[-1]["client_acc_mean"]
        summary["best_client_acc_mean"] = max(m["client_acc_mean"] for m in evaluated)
    private = next((m for m in reversed(history) if "dp_epsilon" in m), None)
    if private is not None:  # the budget the run's differentially private releases spent (hetfl.privacy)
        summary["privacy"] = {k[len("dp_"):]: v for k, v in private.items() if k.startswith("dp_")}
    summary["final_train_loss"] = history[-1]["train_loss"] if history else None
    summary["diverged_round"] = diverged_round(history)
    summary["config"] = config_mod.to_tree(cfg)
    summary["setting_id"] = setting_id(summary["config"])
    summary["run_id"] = run_id(summary["config"])
    return summary


class Reporter:
    """Progress callbacks of a run; the base class is silent (see hetfl.console for the rich one)."""

    def start(self, cfg: RunConfig, start_round: int, exp: SetUp) -> None: ...
    def round_start(self, round_: int, num_clients: int) -> None: ...
    def client_done(self) -> None: ...
    def round_end(self, line: dict[str, Any]) -> None: ...
    def finish(self, summary: dict[str, Any]) -> None: ...

    def note(self, message: str) -> None:
        """A remark about how the run executes (an executor's fallback); shown once per run."""
