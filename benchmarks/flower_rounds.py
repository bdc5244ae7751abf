"""Seconds per round and bytes per round: the same experiment in-process and on Flower.

For each method, the same configuration and seed runs on

- ``sequential``: hetfl's in-process sequential executor;
- ``simulation``: ``runtime.executor = "flower"``, Flower's simulation engine (Ray, one CPU per
  client; every method in one simulation, so Ray starts once);
- ``deployment``: a Flower SuperLink and one SuperNode per client as separate processes on this
  machine (loopback, TLS unless ``--insecure``), each method submitted with ``flwr run``
  to the same SuperLink and nodes.

It records seconds per round (the first round apart: it carries the nodes' start-up, and on
Flower 1.41 every message starts a ClientApp process in deployment), the fixed cost of each
mode (Ray start-up; SuperLink/SuperNodes start-up and the per-run ServerApp start), the
algorithm's bytes per round (``bytes_up``/``bytes_down``: tensors as counted by every executor)
and the bytes Flower actually carried (``flower_bytes_*``: serialised arrays, headers included),
and whether the three modes give the same metrics (they should, bit for bit).

Default: MNIST, FedPAC's dominant-class split over 5 clients of 2,000 samples, the 2-conv CNN,
3 rounds of 1 local epoch, 1 torch thread per process. Writes ``benchmarks/results/flower_cpu.{json,md}``.

    python benchmarks/flower_rounds.py --data ../shared/datasets
    python benchmarks/flower_rounds.py --tiny          # a 1-minute check that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from hetfl import config
from hetfl.engine.experiment import Experiment

BASE = ["data.dataset=mnist", "data.root={data}/mnist", "data.partition=dominant", "data.samples_per_client=2000",
        "data.num_clients=5", "model.name=cnn2", "train.rounds=3", "train.local_epochs=1", "train.batch_size=32",
        "train.lr=0.05", "runtime.progress=false", "runtime.flower_timeout_s=900"]
TINY = ["data.dataset=synthetic", "data.partition=dirichlet", "data.num_clients=3", "model.options={hidden = [16]}",
        "train.rounds=2", "train.batch_size=16", "runtime.progress=false", "runtime.flower_timeout_s=300"]
METHODS = ["fedavg", "scaffold", "fedpac", "fedavg+ccvr"]
TIMING = {"round_time_s", "eval_time_s", "failed_clients", "flower_bytes_down", "flower_bytes_up"}


def lines(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def round_stats(run_dir: Path, wall: float) -> dict[str, Any]:
    got = lines(run_dir)
    times = [x["round_time_s"] for x in got]
    later = times[1:] or times
    out = {
        "rounds": len(got),
        "first_round_s": round(times[0], 3),
        "s_per_round": round(statistics.mean(later), 3),
        "s_per_round_median": round(statistics.median(later), 3),
        "wall_s": round(wall, 2),
        "bytes_up_per_round": statistics.mean(x["bytes_up"] for x in got),
        "bytes_down_per_round": statistics.mean(x["bytes_down"] for x in got),
        "failed_clients": sorted({c for x in got for c in x.get("failed_clients", [])}),
    }
    if "flower_bytes_down" in got[0]:
        out["flower_bytes_down_per_round"] = statistics.mean(x["flower_bytes_down"] for x in got)
        out["flower_bytes_up_per_round"] = statistics.mean(x["flower_bytes_up"] for x in got)
    return out


def numbers(run_dir: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in x.items() if k not in TIMING} for x in lines(run_dir)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/datasets")
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--modes", nargs="+", default=["sequential", "simulation", "deployment"],
                        choices=["sequential", "simulation", "deployment"])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every process (0 = default)")
    parser.add_argument("--insecure", action="store_true", help="deployment without TLS")
    parser.add_argument("--tiny", action="store_true", help="Synthetic, 3 clients, 2 rounds, fedavg: a quick check")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--runs", default="runs/bench-flower")
    args = parser.parse_args()
    if args.tiny:
        base, methods, stem = TINY, (args.methods if args.methods != METHODS else ["fedavg"]), "flower_tiny_cpu"
    else:
        base, methods, stem = [b.format(data=args.data) for b in BASE], args.methods, "flower_cpu"
    base = [*base, f"runtime.threads={args.threads}", *args.set]
    runs = Path(args.runs)
    shutil.rmtree(runs, ignore_errors=True)
    runs.mkdir(parents=True)
    cfgs = {m: config.load(None, [*base, f"algorithm.name={m}"]) for m in methods}
    results: dict[str, dict[str, Any]] = {m: {} for m in methods}
    overhead: dict[str, float] = {}

    if "sequential" in args.modes:
        for m in methods:
            t0 = time.perf_counter()
            Experiment(cfgs[m]).run(runs / "sequential" / m)
            results[m]["sequential"] = round_stats(runs / "sequential" / m, time.perf_counter() - t0)
            print(m, "sequential", results[m]["sequential"], flush=True)

    flower = {m: config.load(None, [*base, f"algorithm.name={m}", "runtime.executor=flower"]) for m in methods}
    if "simulation" in args.modes:
        from hetfl.flower.simulation import run_simulations

        t0 = time.perf_counter()
        jobs = [(Experiment(flower[m]), runs / "simulation" / m, False) for m in methods]
        run_simulations(jobs)
        total = time.perf_counter() - t0
        for m in methods:
            wall = sum(x["round_time_s"] for x in lines(runs / "simulation" / m))
            results[m]["simulation"] = round_stats(runs / "simulation" / m, wall)
            print(m, "simulation", results[m]["simulation"], flush=True)
        overhead["simulation_startup_s"] = round(total - sum(r["simulation"]["wall_s"] for r in results.values()), 2)

    if "deployment" in args.modes:
        from hetfl.flower.deploy import LocalFederation, generate_tls

        work = runs / "deployment-federation"
        tls = None if args.insecure else generate_tls(work / "tls")
        num_clients = cfgs[methods[0]].data.num_clients
        t0 = time.perf_counter()
        with LocalFederation(work, num_clients, tls=tls) as fed:
            overhead["deployment_federation_startup_s"] = round(time.perf_counter() - t0, 2)
            for m in methods:
                t0 = time.perf_counter()
                result = fed.submit(config.dumps(flower[m]), runs / "deployment" / m, timeout_s=3600)
                wall = time.perf_counter() - t0
                if result.returncode != 0 or not (runs / "deployment" / m / "summary.json").exists():
                    results[m]["deployment"] = {"error": f"flwr run exit {result.returncode}; see {work}"}
                    continue
                stats = round_stats(runs / "deployment" / m, wall)
                # flwr run, ServerApp process start, loading the data, greeting the nodes
                stats["run_startup_s"] = round(wall - sum(x["round_time_s"] for x in lines(runs / "deployment" / m)), 2)
                results[m]["deployment"] = stats
                print(m, "deployment", stats, flush=True)
        overhead["deployment_tls"] = tls is not None

    for m in methods:
        done = [mode for mode in args.modes if "error" not in results[m].get(mode, {"error": 1})]
        if len(done) > 1:
            ref = numbers(runs / done[0] / m)
            results[m]["same_metrics_as_" + done[0]] = {mode: numbers(runs / mode / m) == ref for mode in done[1:]}

    report = {
        "command": "python benchmarks/flower_rounds.py " + " ".join(
            ([f"--data {args.data}"] if not args.tiny else ["--tiny"]) + [f"--set {s}" for s in args.set]),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "torch_threads_per_process": args.threads or "default",
                    "torch": torch.__version__, "flwr": _flwr_version()},
        "config": base,
        "overhead": overhead,
        "results": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown(report, args.modes))
    print(f"wrote {out / stem}.json and .md")


def _flwr_version() -> str:
    try:
        import flwr

        return str(flwr.__version__)
    except ImportError:
        return "not installed"


def markdown(report: dict[str, Any], modes: list[str]) -> str:
    rows = ["| method | mode | s/round (after round 1) | round 1 s | bytes up / down per round | "
            "Flower bytes down / up per round | failed | same metrics |",
            "|---|---|---|---|---|---|---|---|"]
    for m, by_mode in report["results"].items():
        same = by_mode.get(next((k for k in by_mode if k.startswith("same_metrics_as_")), ""), {})
        for mode in modes:
            r = by_mode.get(mode)
            if r is None:
                continue
            if "error" in r:
                rows.append(f"| {m} | {mode} | error: {r['error']} | | | | | |")
                continue
            fl = (f"{r['flower_bytes_down_per_round']:,.0f} / {r['flower_bytes_up_per_round']:,.0f}"
                  if "flower_bytes_down_per_round" in r else "")
            rows.append(f"| {m} | {mode} | {r['s_per_round']:.3f} | {r['first_round_s']:.2f} | "
                        f"{r['bytes_up_per_round']:,.0f} / {r['bytes_down_per_round']:,.0f} | {fl} | "
                        f"{r['failed_clients'] or ''} | {same.get(mode, 'reference' if mode == modes[0] else '')} |")
    return (f"# Flower rounds: sequential vs Flower simulation vs Flower deployment\n\n"
            f"`{report['command']}`\n\nMachine: {report['machine']}\n\nConfig: `{' '.join(report['config'])}`\n\n"
            f"Fixed costs: {report['overhead']}\n\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
