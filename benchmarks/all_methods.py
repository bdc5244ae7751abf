"""One short comparison run of every method hetfl has, on the same partition (CPU-sized).

Every registered method (``hetfl list``), plus CCVR composed with two trainers
(``fedavg+ccvr``, ``fedlc+ccvr``), is run with its default settings on one
partition and one seed: MNIST under FedPAC's dominant-class split (20 clients
with 300 training samples each, 20% uniform and 80% from the client group's 3
dominant classes; each client's test split follows its own training
distribution), the 2-conv CNN, 5 rounds of 1 local epoch, batch 32, SGD lr 0.05.

It records, per method, the global model's accuracy on MNIST's test set (not
for personalised methods, which have no single model), the mean accuracy of
the clients' own models on their own test splits, and seconds per round.
Short runs rank methods by their first rounds, not by what they reach: this
is a check that every method runs and learns on one footing, not a table to
quote (the presets of ``hetfl reproduce`` are).

Writes ``benchmarks/results/all_methods_<device>.{json,md}``; finished runs
are read back, not re-run.

    python benchmarks/all_methods.py --data ../shared/datasets [--methods fedavg fedpac]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
from seed_methods import run_one, run_threads

from hetfl.algorithms import available

BASE = ["data.dataset=mnist", "data.root={data}/mnist", "data.partition=dominant", "data.num_clients=20",
        "data.samples_per_client=300", "model.name=cnn2", "train.rounds=5", "train.local_epochs=1",
        "train.batch_size=32", "train.lr=0.05", "train.eval_every=5"]
COMPOSED = ["fedavg+ccvr", "fedlc+ccvr"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/datasets")
    parser.add_argument("--methods", nargs="+", default=None, help="default: all registered, plus X+ccvr")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--runs", default="runs/bench-all-methods")
    parser.add_argument("--collect-only", action="store_true", help="tabulate finished runs, train nothing")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of every run (e.g. runtime.threads=1 beside other jobs)")
    args = parser.parse_args()
    methods = args.methods or [*available(), *COMPOSED]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    stem = Path(args.out) / f"all_methods_{device}"
    rows = json.loads(stem.with_suffix(".json").read_text())["rows"] if stem.with_suffix(".json").exists() else {}
    for method in methods:
        try:
            result = run_one([*BASE, *args.set], method, args.seed, Path(args.runs), args.data, args.collect_only)
        except Exception as err:  # a benchmark records a failure and goes on with the next method
            result = {"error": f"{type(err).__name__}: {err}"}
            print(method, "FAILED", result["error"], flush=True)
        if result is not None:
            rows[method] = result
    machine = {"device": device, "cpu": platform.processor() or platform.machine(),
               "threads": run_threads(args.set), "torch": torch.__version__}
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(machine, rows, args.data))


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def markdown(machine: dict, rows: dict, data: str) -> str:
    lines = [f"# Every method, one short run on one partition ({machine['device']}, {machine['threads']} threads, "
             f"torch {machine['torch']})", "",
             "MNIST, dominant-class split (20 clients x 300 samples), 2-conv CNN, 5 rounds of 1 epoch, one seed. "
             "Global: the global model on MNIST's test set. Clients: mean accuracy of each client's model on its "
             "own test split. A check that every method runs and learns on one footing, not a ranking "
             "(5 rounds favour fast starters).", "",
             "| method | global acc % | clients' acc % | s/round |", "|---|---|---|---|"]
    for method, row in sorted(rows.items(), key=lambda kv: -(kv[1].get("final_client_acc_mean") or 0)):
        if "error" in row:
            lines.append(f"| {method} | failed: {row['error']} | | |")
            continue
        before = row.get("final_global_acc_before_ccvr")
        extra = f" (before CCVR {pct(before)})" if before is not None else ""
        if row.get("diverged_round"):
            extra += f" (diverged: train loss NaN/inf from round {row['diverged_round']})"
        lines.append(f"| {method} | {pct(row.get('final_global_acc'))}{extra} | "
                     f"{pct(row.get('final_client_acc_mean'))} | {row['seconds_per_round']:.1f} |")
    command = "hetfl run " + " ".join(f"--set {o.format(data=data)}" for o in BASE) + " --set algorithm.name=METHOD"
    lines += ["", f"Command of each run: `{command}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
