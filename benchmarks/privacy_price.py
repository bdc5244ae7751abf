"""The price of privacy (hetfl issue 19, item 4): FedAvg+CCVR's accuracy against the differential-privacy
budget epsilon of its statistics, and the accuracy of FedAvg and of CCVR without privacy beside it.

Two federations (CPU-sized, 10 clients):

- ``mnist``: MNIST, Dirichlet alpha 0.05, hetfl's MLP, 5 rounds of 1 local epoch (SGD lr 0.01, momentum
  0.9, weight decay 1e-5, batch 64);
- ``cifar10``: the CIFAR-10 JPEG copy at Dirichlet alpha 0.1 with MOON's simple CNN: the quick setting of
  ``hetfl reproduce ccvr-table2`` (5 rounds of 1 local epoch; CCVR with M_c = 2000, 10 epochs).

Each (epsilon, seed) is one ordinary ``fedavg+ccvr`` run through ``hetfl.api.run`` (a finished run in the
output folder is reused), with ``algorithm.ccvr.dp_epsilon`` set (``inf``: no privacy), delta 1e-5,
distributed noise (the sum of the 10 clients' noise carries the budget: what a server behind secure
aggregation sees) and the clip norm of ``CLIP`` (per suite) unless ``--clip`` says otherwise. Training
does not depend on epsilon, so every run of a seed has the same FedAvg model before calibration: the script checks it.

    python benchmarks/privacy_price.py --data ../shared/datasets [--suite mnist cifar10] [--seeds 0 1 2]

Writes ``benchmarks/results/privacy_price.{json,md,png}`` (runs under ``--runs``, default
``runs/privacy_price``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path
from statistics import mean, pstdev

import torch

from hetfl import api

EPSILONS = [math.inf, 8.0, 4.0, 2.0, 1.0, 0.5]
COMMON = ["data.partition=dirichlet", "data.num_clients=10", "data.min_size=10", "train.rounds=5",
          "train.local_epochs=1", "train.batch_size=64", "train.lr=0.01", "train.momentum=0.9",
          "train.weight_decay=1e-5", "train.eval_every=1", "runtime.executor=sequential",
          "algorithm.name=fedavg+ccvr", "algorithm.ccvr.num_virtual=2000", "algorithm.ccvr.epochs=10"]
SUITES = {
    "mnist": ["data.dataset=mnist", "data.root={data}/mnist", "data.alpha=0.05", "model.name=mlp"],
    "cifar10": ["data.dataset=cifar10", "data.root={data}/cifar10-jpeg.tar.gz", "data.alpha=0.1",
                "model.name=simple_cnn"],
}
# algorithm.ccvr.clip_norm per suite: about the 90th percentile of the feature norms of the same federation's
# FedAvg model after 5 rounds, without privacy (MNIST MLP: median 7.9, 90% 10.2, 99% 12.4; CIFAR-10 simple CNN:
# median 3.8, 90% 5.2, 99% 7.4). A deployment would take it from public data or an earlier run, not from the
# private statistics.
CLIP = {"mnist": 10.0, "cifar10": 5.0}
LABELS = {"mnist": "MNIST, Dirichlet 0.05, MLP", "cifar10": "CIFAR-10 (JPEG copy), Dirichlet 0.1, simple CNN"}


def eps_text(eps: float) -> str:
    return "none" if math.isinf(eps) else f"{eps:g}"


def run_suite(suite: str, data: str, seeds: list[int], clip: float | None, runs: Path) -> list[dict]:
    rows = []
    for eps in EPSILONS:
        for seed in seeds:
            overrides = [s.format(data=data) for s in SUITES[suite]] + COMMON + [f"seed={seed}",
                                                                                f"algorithm.ccvr.dp_epsilon={eps}"]
            overrides.append(f"algorithm.ccvr.clip_norm={CLIP[suite] if clip is None else clip}")
            out = runs / suite / f"eps{eps_text(eps)}-seed{seed}"
            start = time.perf_counter()
            result = api.run(overrides=overrides, out=out)
            s = result.summary
            rows.append({"suite": suite, "epsilon": eps_text(eps), "seed": seed,
                         "acc": s["final_global_acc"], "acc_before_ccvr": s["final_global_acc_before_ccvr"],
                         "privacy": s.get("privacy"), "wall_s": round(time.perf_counter() - start, 1),
                         "status": result.status,
                         "command": "hetfl run " + " ".join(f"--set {o}" for o in overrides)})
            print(f"{suite} eps={eps_text(eps)} seed={seed}: {100 * s['final_global_acc']:.2f}% "
                  f"(before CCVR {100 * s['final_global_acc_before_ccvr']:.2f}%) [{result.status}]", flush=True)
    before = {(r["seed"], r["acc_before_ccvr"]) for r in rows}
    if len(before) != len(seeds):
        raise SystemExit(f"{suite}: the FedAvg model before calibration differs between runs of one seed: {before}")
    return rows


def band(values: list[float]) -> str:
    return f"{100 * mean(values):.2f} ± {100 * pstdev(values):.2f}"


def table(rows: list[dict], suites: list[str]) -> list[str]:
    lines = ["| epsilon | " + " | ".join(LABELS[s] for s in suites) + " |",
             "|---|" + "---|" * len(suites)]
    lines.append("| FedAvg (no calibration) | " + " | ".join(
        band([r["acc_before_ccvr"] for r in rows if r["suite"] == s and r["epsilon"] == "none"]) for s in suites)
        + " |")
    for eps in EPSILONS:
        label = "CCVR, no DP" if math.isinf(eps) else f"CCVR, epsilon {eps:g}"
        lines.append(f"| {label} | " + " | ".join(
            band([r["acc"] for r in rows if r["suite"] == s and r["epsilon"] == eps_text(eps)]) for s in suites) + " |")
    return lines


def plot(rows: list[dict], suites: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(suites), figsize=(5.5 * len(suites), 4), squeeze=False)
    finite = [e for e in EPSILONS if math.isfinite(e)]
    for ax, suite in zip(axes[0], suites, strict=True):
        def accs(eps: float, key: str = "acc", suite: str = suite) -> list[float]:
            return [100 * r[key] for r in rows if r["suite"] == suite and r["epsilon"] == eps_text(eps)]

        means = [mean(accs(e)) for e in finite]
        stds = [pstdev(accs(e)) for e in finite]
        ax.errorbar(finite, means, yerr=stds, marker="o", capsize=3, label="FedAvg+CCVR under DP (mean ± std)")
        ax.axhline(mean(accs(math.inf)), color="tab:green", linestyle="--", label="FedAvg+CCVR, no DP")
        ax.axhline(mean(accs(math.inf, "acc_before_ccvr")), color="tab:red", linestyle=":", label="FedAvg")
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(finite, [f"{e:g}" for e in finite])
        ax.set_xlabel("epsilon (delta = 1e-5)")
        ax.set_ylabel("global test accuracy (%)")
        ax.set_title(LABELS[suite], fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="../shared/datasets")
    parser.add_argument("--suite", nargs="+", default=list(SUITES), choices=list(SUITES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--clip", type=float, default=None, help="algorithm.ccvr.clip_norm (default: per suite)")
    parser.add_argument("--runs", default="runs/privacy_price")
    parser.add_argument("--results", default="benchmarks/results/privacy_price")
    args = parser.parse_args()
    rows = []
    for suite in args.suite:
        rows += run_suite(suite, args.data, args.seeds, args.clip, Path(args.runs))
    out = Path(args.results)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, CPU"
    out.with_suffix(".json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")
    plot(rows, args.suite, out.with_suffix(".png"))
    text = ["# The price of privacy: FedAvg+CCVR against epsilon", "",
            f"`python benchmarks/privacy_price.py --suite {' '.join(args.suite)} --seeds "
            f"{' '.join(map(str, args.seeds))}` on {machine}. Global test accuracy (%), mean ± std over seeds "
            f"{args.seeds}; delta 1e-5, distributed noise over the 10 clients, clip norm "
            f"{args.clip if args.clip is not None else CLIP} (the script's docstring says how it was chosen).", "",
            *table(rows, args.suite), "",
            f"![accuracy against epsilon]({out.with_suffix('.png').name})", "",
            "Each cell is ordinary runs; their commands are in the json (`command`)."]
    out.with_suffix(".md").write_text("\n".join(text) + "\n")
    print("\n".join(table(rows, args.suite)))


if __name__ == "__main__":
    main()
