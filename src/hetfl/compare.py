"""Comparison tables: several methods x several seeds on one setting.

Reads finished run directories (``summary.json`` + ``metrics.jsonl``) and
reports, per method, mean ± std over seeds of the final and best accuracy and
the rounds needed to reach a target accuracy, as Markdown and CSV.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from statistics import mean, stdev
from typing import Any


@dataclass
class RunRecord:
    method: str
    seed: int
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]

    @property
    def metric_key(self) -> str:
        """global_acc for methods with a global model, else client_acc_mean."""
        return "final_global_acc" if "final_global_acc" in self.summary else "final_client_acc_mean"

    def curve(self) -> list[tuple[int, float]]:
        key = "global_acc" if self.metric_key == "final_global_acc" else "client_acc_mean"
        return [(m["round"], m[key]) for m in self.metrics if key in m]


def read_run(run_dir: Path, method: str, seed: int) -> RunRecord:
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return RunRecord(method, seed, summary, metrics)


def rounds_to_target(curve: list[tuple[int, float]], target: float) -> int | None:
    """First evaluated round whose accuracy is >= target (None if never reached)."""
    return next((r for r, acc in curve if acc >= target), None)


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return mean(values), (stdev(values) if len(values) > 1 else 0.0)


def table_rows(records: list[RunRecord], target: float | None) -> list[dict[str, Any]]:
    """One row per method, in first-seen order."""
    methods = list(dict.fromkeys(r.method for r in records))
    rows = []
    for method in methods:
        runs = [r for r in records if r.method == method]
        key = runs[0].metric_key
        best_key = key.replace("final_", "best_")
        final_m, final_s = _mean_std([100 * r.summary[key] for r in runs])
        best_m, best_s = _mean_std([100 * r.summary[best_key] for r in runs])
        row: dict[str, Any] = {
            "method": method,
            "metric": "global" if key == "final_global_acc" else "client mean",
            "seeds": len(runs),
            "final_mean": final_m, "final_std": final_s,
            "best_mean": best_m, "best_std": best_s,
            "wall_time_s": mean(r.summary["wall_time_s"] for r in runs),
        }
        if target is not None:
            reached = [rounds_to_target(r.curve(), target) for r in runs]
            hits = [x for x in reached if x is not None]
            row["rounds_to_target"] = mean(hits) if hits else None
            row["reached"] = f"{len(hits)}/{len(runs)}"
        rows.append(row)
    return rows


def to_markdown(rows: list[dict[str, Any]], target: float | None) -> str:
    head = ["method", "metric", "seeds", "final acc (%)", "best acc (%)"]
    if target is not None:
        head += [f"rounds to {100 * target:g}%"]
    head += ["time (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["method"], row["metric"], str(row["seeds"]),
                 f"{row['final_mean']:.2f} ± {row['final_std']:.2f}",
                 f"{row['best_mean']:.2f} ± {row['best_std']:.2f}"]
        if target is not None:
            rtt = row["rounds_to_target"]
            cells.append("not reached" if rtt is None else f"{rtt:.1f} ({row['reached']})")
        cells.append(f"{row['wall_time_s']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def to_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    fields = list(rows[0].keys()) if rows else ["method"]
    writer = csv.DictWriter(buf, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()
