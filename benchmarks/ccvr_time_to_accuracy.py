"""Seconds per round and wall time to a target accuracy in CCVR's CIFAR-10 setting.

The setting of CCVR's Table 2 (Luo et al. 2021; ``configs/ccvr-table2.toml``):
CIFAR-10, MOON's simple CNN, 10 clients all training every round, Dirichlet
alpha 0.1, 10 local epochs of batch 64, SGD lr 0.01 momentum 0.9 wd 1e-5,
100 rounds, FedAvg + CCVR; the global model is evaluated every round here so
that the time to the target accuracy is known to the round. Issue 7's target:
the 100 rounds in under 5 minutes on one H100.

Each variant (an executor and its flags) is one ``hetfl run`` in its own
process and run directory. A variant that does not finish within ``--budget-s``
is stopped and resumed from its last checkpoint by the next invocation (hetfl
runs resume exactly), so the whole table can be built in several short calls.
Wall time counts each round's own ``round_time_s`` (training, aggregation,
evaluation), not process start-up or dataset loading, which ``startup_s``
records apart. Writes ``benchmarks/results/ccvr_time_<device>.{json,md}``.

    python benchmarks/ccvr_time_to_accuracy.py --data ../shared/datasets \
        --variants vectorized graph graph_bf16 --budget-s 540
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

VARIANTS = {
    "sequential": ["runtime.executor=sequential"],
    "vectorized": ["runtime.executor=vectorized", "runtime.cuda_graph=false"],
    "graph": ["runtime.executor=vectorized", "runtime.cuda_graph=true"],
    "graph_bf16": ["runtime.executor=vectorized", "runtime.cuda_graph=true", "train.precision=bf16"],
    # calls of up to 16 steps, a CUDA graph each (the default until session 19: 4): 51 graphs to build in round 1
    # instead of 34, from 281 steps run twice in Python instead of 73 (benchmarks/graph_shapes.py)
    "graph_bf16_b16": ["runtime.executor=vectorized", "runtime.cuda_graph=true", "train.precision=bf16",
                       "runtime.graph_steps=16"],
    # the steps compiled by torch.compile: one compile per step shape, in round 1's time
    "graph_bf16_compiled": ["runtime.executor=vectorized", "runtime.cuda_graph=true", "train.precision=bf16",
                            "runtime.compile=true"],
}


def setting(args: argparse.Namespace) -> list[str]:
    """CCVR's CIFAR-10 alpha 0.1 setting (``--rounds`` / ``--local-epochs`` shrink it for a smoke run)."""
    return [
        "algorithm.name=fedavg+ccvr", "data.dataset=cifar10", f"data.root={args.data}/cifar10-jpeg.tar.gz",
        "data.download=false", "data.partition=dirichlet", f"data.alpha={args.alpha}", "data.num_clients=10",
        "data.min_size=10", "model.name=simple_cnn", f"train.rounds={args.rounds}",
        f"train.local_epochs={args.local_epochs}", "train.batch_size=64", "train.lr=0.01", "train.momentum=0.9",
        "train.weight_decay=1e-5", "train.eval_every=1", "algorithm.ccvr.num_virtual=2000",
        "algorithm.ccvr.epochs=10", f"seed={args.seed}", "runtime.progress=false",
    ]


def run_variant(name: str, run_dir: Path, overrides: list[str], budget_s: float) -> dict:
    """Run (or resume) one variant for at most ``budget_s`` seconds; its state afterwards."""
    done = (run_dir / "summary.json").exists()
    startup_s = None
    if not done and budget_s > 0:
        resume = (run_dir / "config.toml").exists()  # an earlier call started it (checkpoint or not)
        command = [sys.executable, "-c", "import sys; from hetfl.cli import main; sys.exit(main())", "run", "--quiet"]
        if resume:  # the run's own config.toml is used
            command += ["--resume", str(run_dir)]
        else:
            command += ["--out", str(run_dir)]
            for item in overrides:
                command += ["--set", item]
        t0 = time.perf_counter()
        try:
            subprocess.run(command, check=True, timeout=budget_s)
        except subprocess.TimeoutExpired:
            print(f"{name}: stopped after {budget_s:.0f} s; run again to resume", flush=True)
        wall = time.perf_counter() - t0
        if (run_dir / "summary.json").exists() and not resume:
            startup_s = wall  # minus the rounds' own time, below
    result = summarise(name, run_dir)
    if startup_s is not None:
        result["startup_s"] = round(startup_s - result["wall_s"], 2)
    return result


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarise(name: str, run_dir: Path) -> dict:
    lines = read_metrics(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    round_s = [line["round_time_s"] for line in lines]
    eval_s = [line.get("eval_time_s", 0.0) for line in lines]
    return {
        "variant": name, "rounds_done": len(lines), "finished": bool(summary),
        "median_round_s": statistics.median(round_s) if round_s else None,
        "median_eval_s": statistics.median(eval_s) if eval_s else None,
        "wall_s": sum(round_s), "startup_s": None, "round_s": round_s,
        "acc": [line.get("global_acc") for line in lines],
        "final_global_acc": summary.get("final_global_acc"),
        "final_global_acc_before_ccvr": summary.get("final_global_acc_before_ccvr"),
    }


def time_to(result: dict, target: float) -> tuple[int, float] | None:
    """(round, cumulative seconds) at which the global accuracy first reaches ``target``."""
    total = 0.0
    for i, (acc, s) in enumerate(zip(result["acc"], result["round_s"], strict=True)):
        total += s
        if acc is not None and acc >= target:
            return i + 1, total
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/datasets")
    parser.add_argument("--variants", nargs="+", default=["sequential", "vectorized"], choices=list(VARIANTS))
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--local-epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.55,
                        help="global accuracy whose first round and wall time are reported (CCVR's FedAvg: 0.5855)")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="seconds for this invocation, shared by the unfinished variants in order")
    parser.add_argument("--budget-each-s", type=float, default=None,
                        help="seconds for each variant instead (side by side on one lease: each gets its "
                             "round 1 and enough rounds for a median)")
    parser.add_argument("--runs", default="runs/ccvr_time", help="run directories (resumed when present)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    deadline = time.perf_counter() + args.budget_s
    tag = f"a{args.alpha}_r{args.rounds}_e{args.local_epochs}_s{args.seed}"
    results = []
    for name in args.variants:
        run_dir = Path(args.runs) / f"{tag}_{name}"
        budget = deadline - time.perf_counter() if args.budget_each_s is None else args.budget_each_s
        result = run_variant(name, run_dir, [*setting(args), *VARIANTS[name]], budget)
        reached = time_to(result, args.target)
        result["target_round"], result["target_wall_s"] = reached if reached else (None, None)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k not in ("acc", "round_s")}), flush=True)
    machine = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
               "threads": torch.get_num_threads(), "torch": torch.__version__}
    command = (f"python benchmarks/ccvr_time_to_accuracy.py --variants {' '.join(args.variants)} --alpha {args.alpha} "
               f"--rounds {args.rounds} --local-epochs {args.local_epochs} --seed {args.seed} --target {args.target}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"ccvr_time_{device}"
    entries = json.loads(stem.with_suffix(".json").read_text()) if stem.with_suffix(".json").exists() else []
    entries = [e for e in entries if e["command"] != command]  # a resumed measurement replaces its partial one
    entries.append({"machine": machine, "command": command, "rounds": args.rounds, "target": args.target,
                    "results": results})
    stem.with_suffix(".json").write_text(json.dumps(entries, indent=2) + "\n")
    stem.with_suffix(".md").write_text(render(entries, device))


def render(entries: list[dict], device: str) -> str:
    lines = [f"# CCVR's CIFAR-10 setting: seconds per round and time to accuracy ({device})", "",
             "Wall = the sum of the rounds' own times (training, aggregation, evaluation every round); a variant "
             "that has not finished shows the rounds done and the wall projected from its first round (which builds "
             "the CUDA graphs) and its median round for the others (before session 19: the median round times the "
             "rounds).",
             ""]
    for e in entries:
        lines += [f"`{e['command']}` on {e['machine']['device']} ({e['machine']['threads']} threads, torch "
                  f"{e['machine']['torch']})", "",
                  "| variant | rounds | round 1 (s) | s/round (median) | of which eval | wall (projected) | first "
                  "round >= target | wall to target | final acc before CCVR | after CCVR |", "|---" * 10 + "|"]
        for r in e["results"]:
            median = r["median_round_s"]
            first = r["round_s"][0] if r["round_s"] else None
            projected = "" if r["finished"] or median is None else \
                f" ({first + median * (e['rounds'] - 1):.0f} s)"
            wall = f"{r['wall_s']:.1f} s{projected}"
            target = "-" if r["target_round"] is None else str(r["target_round"])
            to_target = "-" if r["target_wall_s"] is None else f"{r['target_wall_s']:.1f} s"

            lines.append(f"| {r['variant']} | {r['rounds_done']}/{e['rounds']} | {seconds(first)} | "
                         f"{seconds(median)} | {seconds(r['median_eval_s'])} | {wall} | {target} | {to_target} | "
                         f"{percent(r['final_global_acc_before_ccvr'])} | {percent(r['final_global_acc'])} |")
        lines.append("")
        if e.get("reading"):
            lines += [e["reading"], ""]
    return "\n".join(lines)


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


if __name__ == "__main__":
    main()
