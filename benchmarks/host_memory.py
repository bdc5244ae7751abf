"""Training rounds on a CPU with freed memory kept in the process (``runtime.keep_freed_memory``) and without.

The setting changes malloc for the whole process and cannot be undone in it, so each measurement is a fresh
process: one warm-up round, then ``--rounds`` timed training rounds (evaluation excluded) of the sequential
executor, with the minor page faults each round took (``getrusage``). The two settings alternate,
``--repeats`` processes each (kept, glibc's default, kept, ...), so that both see the same machine; the table
gives each one's median and best round and median faults a round.

    python benchmarks/host_memory.py --data ../shared/datasets --models cnn2 simple_cnn --batch-sizes 10 64
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def child(args: argparse.Namespace) -> None:
    """One process: the rounds of one setting; prints one JSON line."""
    from hetfl import config
    from hetfl.engine import host_memory
    from hetfl.engine.experiment import Experiment
    from hetfl.engine.summary import Reporter

    cfg = config.load(None, [
        "data.dataset=cifar10", f"data.root={args.data}/cifar10-jpeg.tar.gz", "data.partition=dirichlet",
        "data.alpha=0.1", f"data.num_clients={args.clients}", f"model.name={args.models[0]}",
        f"train.batch_size={args.batch_sizes[0]}", f"train.local_steps={args.local_steps}", "train.lr=0.01",
        "train.momentum=0.9", "data.augment=none", "runtime.executor=sequential", "runtime.progress=false",
        "runtime.checkpoint_every=0", f"runtime.threads={args.threads}", f"runtime.keep_freed_memory={args.child}"])
    exp = Experiment(cfg)
    server, _, _ = exp.setup_round(exp.initial_server())
    clients: dict = {}
    seconds, faults = [], []
    for r in range(1, args.rounds + 2):
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        server = exp.round(server, clients, r, Reporter())["_server"]
        if r > 1:
            seconds.append(time.perf_counter() - t0)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    print(json.dumps({"kept": host_memory.kept(), "seconds": seconds, "faults": faults}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/datasets")
    parser.add_argument("--models", nargs="+", default=["cnn2"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--local-steps", type=int, default=30, help="steps a client trains each round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds a process")
    parser.add_argument("--repeats", type=int, default=3, help="processes of each setting, alternated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="", help="append the rows as JSON lines to this file")
    parser.add_argument("--child", choices=("true", "false"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    for model in args.models:
        for bs in args.batch_sizes:
            runs: dict[str, list[dict]] = {"true": [], "false": []}
            for _ in range(args.repeats):
                for keep in runs:
                    command = [sys.executable, __file__, "--child", keep, "--data", args.data, "--models", model,
                               "--batch-sizes", str(bs), "--clients", str(args.clients), "--local-steps",
                               str(args.local_steps), "--rounds", str(args.rounds), "--threads", str(args.threads)]
                    done = subprocess.run(command, capture_output=True, text=True, check=True)
                    runs[keep].append(json.loads(done.stdout.strip().splitlines()[-1]))
            row = {"model": model, "batch_size": bs, "clients": args.clients, "local_steps": args.local_steps,
                   "threads": args.threads, "torch": torch.__version__, "glibc": platform.libc_ver()[1],
                   "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                            text=True).stdout.strip()}
            for keep, name in (("true", "kept"), ("false", "glibc_default")):
                seconds = [s for run in runs[keep] for s in run["seconds"]]
                row[name] = {"applied": all(run["kept"] for run in runs[keep]),
                             "median_round_s": statistics.median(seconds), "best_round_s": min(seconds),
                             "median_faults": statistics.median(f for run in runs[keep] for f in run["faults"])}
            row["default_over_kept"] = row["glibc_default"]["median_round_s"] / row["kept"]["median_round_s"]
            print(json.dumps(row), flush=True)
            if args.out:
                with Path(args.out).open("a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
