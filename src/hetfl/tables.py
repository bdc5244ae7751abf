"""Comparison tables: several methods x several seeds on one setting.

Reads finished run directories (``summary.json`` + ``metrics.jsonl``) and
reports, per setting, mean ± std over seeds of the final and best accuracy and
the rounds needed to reach a target accuracy, as Markdown and CSV.

One unit: the rows (``comparison.csv``, :attr:`hetfl.api.CompareResult.rows`) hold accuracies as fractions
in [0, 1], as ``summary.json``, ``metrics.jsonl`` and :attr:`hetfl.api.RunResult.final_accuracy` do; only
the rendered table (:func:`to_markdown`) shows them in percent, for reading.

A row is one setting: runs whose resolved configurations differ only in the
seed (equal :func:`hetfl.engine.identity.setting_id`). Each row carries its
setting id, and the configuration keys that someone changed and that differ
between rows get a column each (dotted names, as for ``--set``; :func:`shown_keys`):
a grid's keys, a ``--set`` that differs between runs. Keys that differ only
because the methods differ (each method's own default settings) stay in the
run folders' ``config.toml``, so two rows never look like one setting and a
table of two methods is not 29 columns of defaults.
"""

from __future__ import annotations

import csv
import html
import io
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from statistics import mean, stdev
from typing import Any

from hetfl.engine import identity
from hetfl.params import ConfigError
from hetfl.privacy import budget_text, server_epsilon

#: shown in a key's column for a row whose configuration does not have that key (another method's setting)
UNSET = "-"


@dataclass
class RunRecord:
    method: str
    seed: int
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)  # the resolved configuration (empty: unknown)

    @property
    def setting_id(self) -> str:
        """The run's setting (hash of its resolved config without the seed); '' when its config is unknown."""
        return identity.setting_id(self.config) if self.config else ""

    @property
    def metric_key(self) -> str:
        """global_acc for methods with a global model, else client_acc_mean."""
        return "final_global_acc" if "final_global_acc" in self.summary else "final_client_acc_mean"

    def curve(self) -> list[tuple[int, float]]:
        key = "global_acc" if self.metric_key == "final_global_acc" else "client_acc_mean"
        return [(m["round"], m[key]) for m in self.metrics if key in m]


def read_run(run_dir: Path, method: str, seed: int) -> RunRecord:
    """A finished run: its summary, metrics and resolved configuration (``config.toml``, read
    through today's defaults, so runs written before a key existed group with new ones)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return RunRecord(method, seed, summary, metrics, identity.saved_tree(run_dir) or {})


def rounds_to_target(curve: list[tuple[int, float]], target: float) -> int | None:
    """First evaluated round whose accuracy is >= target (None if never reached)."""
    return next((r for r, acc in curve if acc >= target), None)


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1) over seeds, the spread every hetfl table and band
    reports; 0 for a single seed, NaN for none."""
    if not values:
        return math.nan, math.nan
    return mean(values), (stdev(values) if len(values) > 1 else 0.0)


def with_spread(mean_value: float, std: float, seeds: int) -> str:
    """``mean ± std`` for two or more seeds; the mean alone for one (a single seed has no spread to show:
    ``± 0.00`` would claim one). Values as given: the tables pass percent (:func:`percent`)."""
    return f"{mean_value:.2f} ± {std:.2f}" if seeds > 1 else f"{mean_value:.2f}"


def percent(fraction: float) -> float:
    """An accuracy fraction in percent, for a table rendered to be read (files and objects keep fractions)."""
    return 100 * fraction


def _cell(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


@cache
def _method_defaults(method: str) -> dict[str, str] | None:
    """The flattened default configuration of ``method`` (its own settings filled in), each value as a
    table cell shows it; None for a method this process does not know (a plug-in not loaded)."""
    try:
        tree = identity.canonical_tree({"algorithm": {"name": method}})
    except ConfigError:
        return None
    return {k: _cell(v) for k, v in identity.flatten(tree).items()}


def shown_keys(configs: list[dict[str, Any]]) -> list[str]:
    """The keys of the resolved configuration trees ``configs`` (one per setting) that get a column: those
    that vary between them (``algorithm.name`` aside: the method column) and differ from their method's
    default in at least one setting, i.e. keys someone set or swept. A key that varies only because the
    methods differ (SCAFFOLD's ``algorithm.server_lr`` beside FedAvg) is no column: its values are each
    method's defaults, and the run folders keep them. Where a method is unknown, every varying key shows."""
    varying = [k for k in identity.varying_keys(configs) if k != "algorithm.name"]
    flats = [identity.flatten(c) for c in configs]
    defaults = [_method_defaults(str(c.get("algorithm", {}).get("name", ""))) for c in configs]

    def changed(key: str) -> bool:
        return any(d is None or (key in f and _cell(f[key]) != d.get(key)) for f, d in zip(flats, defaults,
                                                                                             strict=True))

    return [k for k in varying if changed(k)]


#: summary.json's accuracy of the global model before a post-hoc step, ``final_global_acc_before_<step>``
BEFORE_PREFIX = "final_global_acc_before_"


def posthoc_steps(records: Sequence[RunRecord]) -> list[str]:
    """The post-hoc steps (``ccvr``, ...) whose accuracy before the step some run's summary records."""
    return sorted({k.removeprefix(BEFORE_PREFIX) for r in records for k in r.summary if k.startswith(BEFORE_PREFIX)})


def _before_steps(runs: list[RunRecord], steps: list[str]) -> dict[str, float | None]:
    """``final_before_<step>_mean`` / ``_std`` of a row: the global accuracy before each post-hoc step, over
    seeds (fractions); None where the row's runs have no such step."""
    out: dict[str, float | None] = {}
    for step in steps:
        values = [float(r.summary[BEFORE_PREFIX + step]) for r in runs if BEFORE_PREFIX + step in r.summary]
        mean_value, std = mean_std(values) if len(values) == len(runs) else (None, None)
        out[f"final_before_{step}_mean"], out[f"final_before_{step}_std"] = mean_value, std
    return out


def _privacy(runs: list[RunRecord]) -> dict[str, Any]:
    """A row's differential privacy, from its runs' summaries: ``dp_epsilon``, the largest over seeds of the
    epsilon the server faces (:func:`hetfl.privacy.server_epsilon`: the per-upload one where the server saw
    each upload), with ``dp_delta``, ``dp_per_upload`` and what the budget covers (``dp_covers``); all None
    for a row whose runs made no private release."""
    private = [r.summary["privacy"] for r in runs if "privacy" in r.summary]
    if not private:
        return {"dp_epsilon": None, "dp_delta": None, "dp_per_upload": None, "dp_covers": None}
    faced = [server_epsilon(p) for p in private]
    if len(private) < len(runs):  # a seed without the release it was configured for: no single budget holds
        faced.append((math.inf, False))
    epsilon, per_upload = max(faced)
    return {"dp_epsilon": epsilon, "dp_delta": max(float(p["delta"]) for p in private), "dp_per_upload": per_upload,
            "dp_covers": "; ".join(sorted({str(p.get("covers", "")) for p in private} - {""})) or None}


#: a mean accuracy within this of its runs' accuracy at chance (``summary.json``'s ``chance_global_acc``: always
#: predicting the test set's largest class) is at chance: the runs learned nothing the metric sees
CHANCE_MARGIN = 0.005


def at_chance(value: float, chances: list[float | None]) -> tuple[float | None, bool]:
    """The mean of runs' accuracies at chance (None where a run did not record one: a personalised metric, or a
    run from before hetfl recorded it) and whether ``value``, their mean accuracy, is at chance."""
    if not chances or None in chances:
        return None, False
    chance = mean(chances)  # type: ignore[arg-type]
    return chance, abs(value - chance) < CHANCE_MARGIN


def chance_line(rows: list[dict[str, Any]]) -> str:
    """What a "(chance)" mark means, naming the accuracies at chance, for a table with one ('' otherwise)."""
    chances = sorted({percent(row["chance"]) for row in rows if row.get("at_chance")})
    if not chances:
        return ""
    return (f"(chance): the mean is within {percent(CHANCE_MARGIN):g} point of what always predicting the test set's "
            f"largest class scores ({', '.join(f'{c:.2f}%' for c in chances)}): those runs have learned nothing this "
            "metric sees yet, and their order among themselves says nothing.")


def diverged_count(runs: list[RunRecord]) -> int:
    """How many of a row's runs diverged (``summary.json``'s ``diverged_round`` set: the train loss became inf
    or NaN). They stay in the row's mean as they ended (dropping them would flatter the setting); the count
    says how many seeds that mean stands on are such runs."""
    return sum(1 for r in runs if r.summary.get("diverged_round") is not None)


def table_rows(records: list[RunRecord], target: float | None) -> list[dict[str, Any]]:
    """One row per setting (records with equal setting ids; by method label where a record's
    config is unknown), in first-seen order. The keys of :func:`shown_keys` become columns named by
    the dotted key. Accuracies are fractions (``final_mean``, ``final_std``, ``best_mean``, ``best_std``);
    ``rounds_to_target`` counts rounds; ``diverged`` counts the row's runs that diverged (:func:`diverged_count`).
    Where a run has a post-hoc step (``fedavg+ccvr``), its accuracy
    before the step is there too (``final_before_ccvr_mean``/``_std``; None for rows without it)."""
    groups: dict[str, list[RunRecord]] = {}
    for r in records:
        groups.setdefault(r.setting_id or f"method:{r.method}", []).append(r)
    varying = shown_keys([runs[0].config for runs in groups.values() if runs[0].config])
    steps = posthoc_steps(records)
    private = any("privacy" in r.summary for r in records)
    rows = []
    for runs in groups.values():
        flat = identity.flatten(runs[0].config)
        key = runs[0].metric_key
        best_key = key.replace("final_", "best_")
        final_m, final_s = mean_std([r.summary[key] for r in runs])
        best_m, best_s = mean_std([r.summary[best_key] for r in runs])
        row: dict[str, Any] = {"method": runs[0].method}
        row.update({k: _cell(flat[k]) if k in flat else UNSET for k in varying})
        row.update({
            "metric": "global" if key == "final_global_acc" else "client mean",
            "seeds": len(runs),
            "diverged": diverged_count(runs),
            **_before_steps(runs, steps),
            "final_mean": final_m, "final_std": final_s,
            "best_mean": best_m, "best_std": best_s,
            "wall_time_s": mean(r.summary["wall_time_s"] for r in runs),
            "mb_up": traffic_mb(runs, "bytes_up_total"), "mb_down": traffic_mb(runs, "bytes_down_total"),
        })
        row["chance"], row["at_chance"] = at_chance(final_m, [r.summary.get("chance_global_acc") if key ==
                                                              "final_global_acc" else None for r in runs])
        if private:
            row.update(_privacy(runs))
        if target is not None:
            reached = [rounds_to_target(r.curve(), target) for r in runs]
            hits = [x for x in reached if x is not None]
            row["rounds_to_target"] = mean(hits) if hits else None
            row["reached"] = f"{len(hits)}/{len(runs)}"
        row["setting_id"] = runs[0].setting_id
        rows.append(row)
    return rows


def traffic_mb(runs: list[RunRecord], key: str) -> float | None:
    """A row's traffic in MB (10^6 bytes), the mean over its seeds of ``summary.json``'s ``key``
    (``bytes_up_total``: the bytes of every tensor the clients sent the server, the set-up round's and
    post-hoc steps' included; ``bytes_down_total``: of every tensor sent to them). Methods differ in it as
    much as in accuracy (SCAFFOLD's control variates double both ways, FedPAC uploads centroids, CCVR
    per-class statistics).
    None where a run's summary does not say it."""
    values = [r.summary.get(key) for r in runs]
    return None if any(v is None for v in values) else mean(values) / 1e6


def traffic_cell(row: dict[str, Any]) -> str:
    """``"12.3 / 24.6"``: a row's mean MB up and down (:func:`traffic_mb`), three significant digits below 10
    MB (a small model's runs move a fraction of one), ``"?"`` where unknown."""
    up, down = row.get("mb_up"), row.get("mb_down")
    if up is None or down is None:
        return "?"
    return " / ".join(f"{mb:.1f}" if mb >= 10 else f"{mb:.3g}" for mb in (up, down))


def key_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The configuration keys that vary between rows (the dotted columns of :func:`table_rows`)."""
    return [k for k in (rows[0] if rows else {}) if "." in k]


def differences_line(rows: list[dict[str, Any]]) -> str:
    """One sentence saying what distinguishes the rows (and that a row's runs differ only by seed)."""
    keys = (["method"] if len({r["method"] for r in rows}) > 1 else []) + key_columns(rows)
    if len(rows) <= 1:
        return "One setting; its runs differ only in the seed."
    return f"Rows differ in: {', '.join(keys)}; the runs of a row differ only in the seed."


#: characters that start Markdown markup anywhere in a line (``|`` splits a table row); ``_`` only at a word's edge
_MARKUP = re.compile(r"[\\`*\[\]|~]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")


def markdown_text(text: Any) -> str:
    """``text`` (a user's value, a path, a name) shown literally in Markdown, in running text, a heading or a
    table cell: on one line, HTML escaped (``<img ...>`` stays text) and Markdown's markup characters
    backslash-escaped (a ``|`` adds no column, ``**b**`` is no emphasis)."""
    flat = " ".join(str(text).splitlines())
    return _MARKUP.sub(lambda m: "\\" + m.group(0), html.escape(flat, quote=False))


def table_cells(rows: list[dict[str, Any]], target: float | None) -> tuple[list[str], list[list[str]]]:
    """The comparison table as data: its header and one list of cell texts per row, unescaped (each output
    escapes them its own way: :func:`to_markdown`, the HTML report). Accuracies in percent, for reading."""
    keys = key_columns(rows)
    steps = [k.removeprefix("final_before_").removesuffix("_mean") for k in (rows[0] if rows else {})
             if k.startswith("final_before_") and k.endswith("_mean")]
    diverged = any(row.get("diverged") for row in rows)
    head = ["method", *keys, "metric", "seeds", *(["diverged"] if diverged else []),
            *(f"final before {s} (%)" for s in steps), "final acc (%)", "best acc (%)"]
    if target is not None:
        head += [f"rounds to {percent(target):g}%"]
    private = bool(rows) and "dp_epsilon" in rows[0]
    if private:
        head += ["privacy: epsilon (delta)"]
    head += ["MB up / down", "time (s)", "setting"]
    body = []
    for row in rows:
        cells = [row["method"], *(row[k] for k in keys), row["metric"], str(row["seeds"]),
                 *([f"{row.get('diverged', 0)} of {row['seeds']}"] if diverged else []),
                 *(_before_cell(row, s) for s in steps),
                 with_spread(percent(row["final_mean"]), percent(row["final_std"]), row["seeds"])
                 + (" (chance)" if row.get("at_chance") else ""),
                 with_spread(percent(row["best_mean"]), percent(row["best_std"]), row["seeds"])]
        if target is not None:
            rtt = row["rounds_to_target"]
            cells.append("not reached" if rtt is None else f"{rtt:.1f} ({row['reached']})")
        if private:
            cells.append(privacy_cell(row))
        cells += [traffic_cell(row), f"{row['wall_time_s']:.1f}", row["setting_id"] or "?"]
        body.append([str(cell) for cell in cells])
    return head, body


def privacy_cell(row: dict[str, Any]) -> str:
    """A row's budget as the server faces it, rounded up (:func:`hetfl.privacy.epsilon_text`): ``"4 (1e-05)"``,
    ``"33.8 per upload (1e-05)"`` where the server saw each upload, ``"none"`` for a row without privacy."""
    if row["dp_epsilon"] is None:
        return "none"
    if not math.isfinite(row["dp_epsilon"]):
        return "no single budget (a seed made no private release)"
    return budget_text(row["dp_epsilon"], row["dp_delta"], row["dp_per_upload"])


def aggregation_line(rows: list[dict[str, Any]], target: float | None) -> str:
    """How the table's cells aggregate a row's seeds (:func:`mean_std`, :func:`rounds_to_target`), said under it:
    the reader of ``80.78 ± 1.81`` or ``3.0 (2/3)`` should not have to guess which std or which mean."""
    if not rows:
        return ""
    line = ("Accuracies in %: mean ± sample std (n − 1) over the row's seeds (one seed: its value alone); final: the "
            "last evaluated round's accuracy (after any post-hoc step), best: the highest evaluated one; MB up / down: "
            "the bytes each run's clients sent and received over the whole run (10^6 bytes), and time (s): each "
            "run's wall time, each the mean over the seeds.")
    if target is None:
        return line
    return line + (f" Rounds to {percent(target):g}%: each seed's first evaluated round whose accuracy is at or above "
                   f"{percent(target):g}% (rounds are evaluated every train.eval_every and at the last), the mean over "
                   "the seeds that reached it; (k/n): k of the row's n seeds reached it.")


def diverged_line(rows: list[dict[str, Any]]) -> str:
    """What the diverged column means, for a table that has one ('' otherwise)."""
    if not any(row.get("diverged") for row in rows):
        return ""
    return ("Diverged: a row's runs whose train loss became inf or NaN (summary.json: diverged_round); their "
            "final and best accuracies are in the row's mean and std as they ended.")


def privacy_line(rows: list[dict[str, Any]]) -> str:
    """What the privacy column means, for a table that has one ('' otherwise): the budget each private row
    spent, as its server faces it, and what it covers (a method's private statistics, not everything sent)."""
    covers = sorted({row["dp_covers"] for row in rows if row.get("dp_covers")})
    if not covers:
        return ""
    return ("Privacy: the (epsilon, delta) differential-privacy budget each private row's releases spent, the "
            "largest over its seeds, as its server faces it (per upload where it saw each client's upload, "
            "without secure aggregation), rounded up. It covers: " + "; ".join(covers) + ".")


def to_markdown(rows: list[dict[str, Any]], target: float | None) -> str:
    """The table as Markdown (every cell escaped: :func:`markdown_text`), followed by :func:`differences_line`,
    :func:`aggregation_line` and, for a table with private rows, :func:`privacy_line`."""
    head, body = table_cells(rows, target)
    lines = ["| " + " | ".join(map(markdown_text, head)) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(map(markdown_text, cells)) + " |" for cells in body]
    notes = [markdown_text(line) for line in (differences_line(rows), aggregation_line(rows, target),
                                              diverged_line(rows), chance_line(rows), privacy_line(rows)) if line]
    return "\n".join(lines) + "\n\n" + "\n\n".join(notes) + "\n"


def _before_cell(row: dict[str, Any], step: str) -> str:
    """The accuracy before post-hoc ``step`` in percent, or :data:`UNSET` for a row without that step."""
    mean_value = row[f"final_before_{step}_mean"]
    if mean_value is None:
        return UNSET
    return with_spread(percent(mean_value), percent(row[f"final_before_{step}_std"]), row["seeds"])


def to_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    fields = list(rows[0].keys()) if rows else ["method"]
    writer = csv.DictWriter(buf, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()
