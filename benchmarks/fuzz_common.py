"""What the differential fuzzes share (``config_fuzz.py``, ``flower_fuzz.py``, ``resume_fuzz.py``): their
common command-line arguments, the loop that draws a configuration, checks it and logs its record, and the
head of their Markdown reports.

A fuzz supplies ``trial(rng, scratch) -> record``: it draws one configuration from ``rng`` (so a seed gives
the same sequence of configurations), runs what it compares in the empty folder ``scratch`` and returns a
JSON-able record whose ``findings`` list is empty when nothing is wrong. Each record is appended to the
``.jsonl`` beside ``--out`` as soon as it is made (a fuzz stopped half-way keeps what it found), as
``{"seed": ..., "i": ..., **record}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"

#: the datasets drawn from by default (repeats weigh: synthetic and MNIST runs are quick)
DEFAULT_DATASETS = ("synthetic", "synthetic", "mnist", "mnist", "cifar10")


def add_arguments(parser: argparse.ArgumentParser, *, count: int, datasets: Sequence[str],
                  dataset_names: Sequence[str], out: str) -> None:
    """``--data``, ``--count``, ``--seed``, ``--datasets`` (one of ``dataset_names`` each), ``--budget-s`` and
    ``--out`` (default ``benchmarks/results/<out>``)."""
    parser.add_argument("--data", default="../shared/datasets", help="folder holding mnist/ and cifar10-jpeg.tar.gz")
    parser.add_argument("--count", type=int, default=count, help="configurations to draw")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws")
    parser.add_argument("--datasets", nargs="+", default=list(datasets), choices=sorted(set(dataset_names)),
                        help="drawn from, with repeats as weights")
    parser.add_argument("--budget-s", type=float, default=math.inf, help="stop drawing after this many seconds")
    parser.add_argument("--out", default=str(RESULTS / out))


def run_trials(args: argparse.Namespace, trial: Callable[[random.Random, Path], dict], run: str,
               label: Callable[[dict], str], *, prepare: Callable[[Path], None] | None = None) -> list[dict]:
    """Up to ``args.count`` trials (fewer once ``args.budget_s`` seconds have passed), each in its own folder
    of one temporary directory (``prepare(it)`` first, if given); every record logged and printed as it
    comes: its number, ``FINDING ...`` or the outcome of its run ``run``, and ``label(record)``."""
    rng = random.Random(args.seed)
    log = Path(args.out).with_suffix(".jsonl")
    records: list[dict] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if prepare is not None:
            prepare(Path(tmp))
        for i in range(args.count):
            if time.perf_counter() - start > args.budget_s:
                break
            record = trial(rng, Path(tmp) / str(i))
            records.append(record)
            with log.open("a") as f:
                f.write(json.dumps({"seed": args.seed, "i": i, **record}) + "\n")
            said = "FINDING " + "; ".join(record["findings"]) if record["findings"] else record[run]["outcome"]
            print(i, said, label(record), flush=True)
    return records


def outcome(record: dict, run: str) -> str:
    """``finding`` for a record with findings, else the outcome of its run ``run`` (``ok``, ``refused``...)."""
    return "finding" if record["findings"] else record[run]["outcome"]


def report_head(title: str, command: str, records: list[dict], run: str,
                finding: Callable[[dict], str] | None = None) -> list[str]:
    """A report's first lines: the title, the command, the machine and the outcome counts, then the
    findings, one line each (``finding(record)``; by default the configuration's settings)."""
    counts: dict[str, int] = {}
    for r in records:
        counts[outcome(r, run)] = counts.get(outcome(r, run), 0) + 1
    finding = finding or (lambda r: f"`{' '.join(r['sets'])}`")
    lines = [f"# {title}", "",
             f"`{command}` on {platform.machine()} ({torch.get_num_threads()} threads, torch {torch.__version__}), "
             f"{dt.date.today()}: {len(records)} configurations; "
             + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), "", "## Findings", ""]
    found = [r for r in records if r["findings"]]
    return lines + ([f"- {finding(r)}: " + "; ".join(r["findings"]) for r in found] or ["none"])


def table_outcome(record: dict, run: str) -> str:
    """The outcome column of a report's table: a refusal names what refused (its message's first part)."""
    said = outcome(record, run)
    return said + ": " + record[run]["error"].split(":", 1)[0] if said == "refused" else said


def settings(record: dict) -> dict[str, str]:
    """The record's ``--set`` overrides as a mapping (key to value text)."""
    return dict(s.split("=", 1) for s in record["sets"] if "=" in s)


def command_line(script: str, argv: list[str] | None) -> str:
    """How the report says it was made: ``python benchmarks/<script> <arguments>``."""
    return f"python benchmarks/{script} " + " ".join(sys.argv[1:] if argv is None else argv)


def note_exception(out: dict, err: Exception, refused: bool) -> None:
    """Record a run's exception in ``out`` (inside its ``except`` block): ``refused`` (one of hetfl's refusals)
    or ``crash`` (with the traceback's end), and the error, both cut to a readable length."""
    out.update(outcome="refused" if refused else "crash", error=f"{type(err).__name__}: {err}"[:500])
    if out["outcome"] == "crash":
        out["trace"] = traceback.format_exc()[-2000:]


def two_run_table(records: list[dict], first: str, second: str, seconds: str) -> list[str]:
    """The report's table of a fuzz that runs each configuration twice (runs ``first`` and ``second`` of a
    record): number, method, model, outcome and each run's seconds (column header ``seconds``)."""
    lines = ["", "## Every configuration", "", f"| # | method | model | outcome | {seconds} |", "|---|---|---|---|---|"]
    for i, r in enumerate(records):
        get = settings(r)
        took = f"{r[first]['seconds']} / {r.get(second, {}).get('seconds', '-')}"
        lines.append(f"| {i} | {get.get('algorithm.name')} | {get.get('model.name')} | {table_outcome(r, first)} | "
                     f"{took} |")
    return lines
