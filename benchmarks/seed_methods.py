"""Each seed method against its paper's baseline on real data, same seeds (CPU-sized).

Suites (each a list of methods run on one partition with the same seed):

- ``mnist``: MNIST, Dirichlet alpha 0.05, 10 clients, the 2-conv CNN:
  FedAvg vs FedAvg+CCVR, FedUV, FedBR (global accuracy; CCVR, FedUV and FedBR
  should raise FedAvg's).
- ``cifar10``: the CIFAR-10 JPEG copy, Dirichlet alpha 0.1, 10 clients, MOON's
  simple CNN, 6 rounds of 1 epoch (CPU-sized): the same methods.
- ``dominant``: FedPAC's setting scaled down: CIFAR-10, 20 clients with 600
  training samples each (20% uniform, 80% from the group's 3 dominant classes),
  FedPAC vs FedAvg vs Local-only (personalised accuracy: FedPAC should beat both).

Suites at each paper's own local-training settings (fewer rounds than the
papers; the first three above use one shared CPU-sized optimiser instead; FedBR's
own local training is the ``fedbr-table1`` preset of ``hetfl reproduce``):

- ``feduv_paper``: CIFAR-10 copy, Dirichlet alpha 0.05, 10 clients, MOON's
  simple CNN, FedUV's optimiser (SGD lr 0.01, momentum 0.9, wd 1e-5, batch
  128, cosine decay over rounds), 2 local epochs, 20 rounds: FedAvg vs FedUV,
  as in the authors' code (L_U on raw features) and with L_U on L2-normalised
  features (``algorithm.normalize``, the paper's hypersphere).
- ``fedpac_paper``: FedPAC's split with FedPAC's CNN and optimiser (20 clients
  x 600 samples, batch 50, lr 0.02, momentum 0.5, wd 5e-4), 2 local epochs,
  30 rounds: FedPAC vs FedAvg vs Local-only.

Writes ``benchmarks/results/seed_methods_<device>.json`` and ``.md`` with the
accuracies, their differences to the baseline and the time per round.

    python benchmarks/seed_methods.py --data ../shared/datasets [--suite mnist] [--seeds 0 1]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
from pathlib import Path
from statistics import mean, pstdev

import torch

from hetfl import config
from hetfl.engine.summary import diverged_round
from hetfl.runtimes import run_experiment

MNIST = ["data.dataset=mnist", "data.root={data}/mnist", "data.partition=dirichlet", "data.alpha=0.05",
         "data.num_clients=10", "model.name=cnn2", "train.rounds=8", "train.local_epochs=1",
         "train.batch_size=32", "train.lr=0.05"]
CIFAR = ["data.dataset=cifar10", "data.root={data}/cifar10-jpeg.tar.gz", "data.partition=dirichlet",
         "data.alpha=0.1", "data.num_clients=10", "model.name=simple_cnn", "train.rounds=6",
         "train.local_epochs=1", "train.batch_size=64", "train.lr=0.02", "train.momentum=0.9",
         "train.weight_decay=1e-5"]
DOMINANT = ["data.dataset=cifar10", "data.root={data}/cifar10-jpeg.tar.gz", "data.partition=dominant",
            "data.num_clients=20", "data.samples_per_client=600", "model.name=simple_cnn", "train.rounds=15",
            "train.local_epochs=2", "train.batch_size=50", "train.lr=0.02", "train.momentum=0.5",
            "train.weight_decay=5e-4"]

FEDUV_PAPER = ["data.dataset=cifar10", "data.root={data}/cifar10-jpeg.tar.gz", "data.partition=dirichlet",
               "data.alpha=0.05", "data.num_clients=10", "model.name=simple_cnn", "train.rounds=20",
               "train.local_epochs=2", "train.batch_size=128", "train.lr=0.01", "train.momentum=0.9",
               "train.weight_decay=1e-5", "train.lr_schedule=cosine", "train.eval_every=5"]
FEDPAC_PAPER = ["data.dataset=cifar10", "data.root={data}/cifar10-jpeg.tar.gz", "data.partition=dominant",
                "data.num_clients=20", "data.samples_per_client=600", "data.test_per_client=300",
                "model.name=fedpac_cnn", "train.rounds=30", "train.local_epochs=2", "train.batch_size=50",
                "train.lr=0.02", "train.momentum=0.5", "train.weight_decay=5e-4", "train.eval_every=5"]

SUITES: dict[str, tuple[list[str], str, str, list[str]]] = {
    # name: (base overrides, metric, baseline, methods)
    "mnist": (MNIST, "final_global_acc", "fedavg", ["fedavg", "fedavg+ccvr", "feduv", "fedbr"]),
    "cifar10": (CIFAR, "final_global_acc", "fedavg", ["fedavg", "fedavg+ccvr", "feduv", "fedbr"]),
    "dominant": (DOMINANT, "final_client_acc_mean", "fedavg", ["fedavg", "local", "fedpac"]),
    "feduv_paper": (FEDUV_PAPER, "final_global_acc", "fedavg", ["fedavg", "feduv", "feduv[normalize=true]"]),
    "fedpac_paper": (FEDPAC_PAPER, "final_client_acc_mean", "fedavg", ["fedavg", "local", "fedpac"]),
}


def parse_method(spec: str) -> tuple[str, list[str]]:
    """``"feduv[normalize=true,mu=0]"`` -> ``("feduv", ["algorithm.normalize=true", "algorithm.mu=0"])``:
    a method with some of its settings changed, as one row of a suite."""
    name, _, options = spec.partition("[")
    if not options:
        return name, []
    if not options.endswith("]"):
        raise ValueError(f"method {spec!r}: expected NAME or NAME[key=value,...]")
    return name, [f"algorithm.{kv.strip()}" for kv in options[:-1].split(",") if kv.strip()]


def run_folder(spec: str, seed: int) -> str:
    """Run folder of a method spec: ``feduv[normalize=true]`` -> ``feduv-normalize-true-seed0``."""
    name = re.sub(r"[^A-Za-z0-9_.]+", "-", spec).strip("-")
    return f"{name}-seed{seed}"


def run_one(base: list[str], method: str, seed: int, runs: Path, data: str, collect_only: bool = False) -> dict | None:
    name, options = parse_method(method)
    overrides = [o.format(data=data) for o in base] + [f"algorithm.name={name}", *options, f"seed={seed}"]
    run_dir = runs / run_folder(method, seed)
    if collect_only or (run_dir / "summary.json").exists():  # a finished run is read, never re-run
        if not (run_dir / "summary.json").exists():
            return None
        summary = json.loads((run_dir / "summary.json").read_text())
    else:
        cfg = config.load(None, [*overrides, "runtime.progress=false"])
        summary = run_experiment(cfg, run_dir, resume=(run_dir / "checkpoint.safetensors").exists())
    out = {k: summary.get(k) for k in ("final_global_acc", "final_client_acc_mean", "wall_time_s", "rounds")}
    out["final_global_acc_before_ccvr"] = summary.get("final_global_acc_before_ccvr")
    out["seconds_per_round"] = summary["wall_time_s"] / summary["rounds"]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    out["diverged_round"] = diverged_round([json.loads(line) for line in lines])  # summaries before the key
    out["command"] = "hetfl run " + " ".join(f"--set {o}" for o in overrides)
    print(method, seed, json.dumps({k: v for k, v in out.items() if k != "command"}), flush=True)
    return out


def run_threads(overrides: list[str]) -> int:
    """Torch threads each run used: ``runtime.threads`` when the runs were given it, else this process's."""
    for o in overrides:
        key, _, value = o.partition("=")
        if key.strip() == "runtime.threads" and int(value) > 0:
            return int(value)
    return torch.get_num_threads()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", default="../shared/datasets")
    parser.add_argument("--suite", choices=list(SUITES), action="append")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--runs", default="runs/bench-seed-methods")
    parser.add_argument("--collect-only", action="store_true", help="tabulate finished runs, train nothing")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of the suite's runs (e.g. train.rounds=60)")
    parser.add_argument("--tag", default="", help="suffix of the suite's name in the results (variants)")
    parser.add_argument("--methods", nargs="+", help="only these of the suite's methods (default: all)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.out)
    stem = out / f"seed_methods_{device}"
    previous = json.loads(stem.with_suffix(".json").read_text()) if stem.with_suffix(".json").exists() else {}
    suites = previous.get("suites", {})
    for suite in args.suite or list(SUITES):
        base, metric, baseline, methods = SUITES[suite]
        base = [*base, *args.set]
        rows = {}
        for method in methods:
            if args.methods and method not in args.methods:
                continue
            per_seed = [run_one(base, method, s, Path(args.runs) / (suite + args.tag), args.data, args.collect_only)
                        for s in args.seeds]
            done = [r for r in per_seed if r is not None]
            if done:
                rows[method] = {"metric": [r[metric] for r in done], "runs": done}
        if baseline in rows:
            suites[suite + args.tag] = {"metric": metric, "baseline": baseline, "seeds": args.seeds, "rows": rows,
                                        "threads_per_run": run_threads(args.set)}
    machine = {"device": device, "cpu": platform.processor() or platform.machine(), "torch": torch.__version__}
    out.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({"machine": machine, "suites": suites}, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(machine, suites))


def markdown(machine: dict, suites: dict) -> str:
    lines = [f"# Seed methods against their baselines ({machine['device']}, torch {machine['torch']})", "",
             "What came out as the papers say and what did not, with the reasons found: "
             "`seed_methods_findings.md`.", ""]
    for suite, body in suites.items():
        metric, baseline = body["metric"], body["baseline"]
        base = mean(body["rows"][baseline]["metric"])
        threads = f", {body['threads_per_run']} torch thread(s) per run" if "threads_per_run" in body else ""
        lines += [f"## {suite}: {metric}, seeds {body['seeds']}{threads}", "",
                  f"| method | {metric} (mean ± std) | vs {baseline} | s/round |", "|---|---|---|---|"]
        for method, row in body["rows"].items():
            values = row["metric"]
            spr = mean(r["seconds_per_round"] for r in row["runs"])
            before = row["runs"][0].get("final_global_acc_before_ccvr")
            note = f" (before CCVR {100 * before:.2f}%)" if before is not None else ""
            diverged = [r["diverged_round"] for r in row["runs"] if r.get("diverged_round")]
            note += f" (diverged: train loss inf/NaN from round {diverged[0]})" if diverged else ""
            lines.append(f"| {method} | {100 * mean(values):.2f}% ± {100 * pstdev(values):.2f}{note} | "
                         f"{100 * (mean(values) - base):+.2f} | {spr:.1f} |")
        lines += ["", "Command of the baseline run: `" + body["rows"][baseline]["runs"][0]["command"] + "`", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
