"""How many CUDA graphs does a run of the vectorised executor make? Distinct call shapes over rounds.

In graph mode (CUDA, ``runtime.cuda_graph = true``) each distinct call shape of a round's plan
(:meth:`hetfl.engine.step_plan.Call.shape`: first step or not, steps, width, batch size, and where a
range of rows starts) is captured once as a CUDA graph and replayed whenever it comes back. With every
client in every round (CCVR's Table 2) the shapes repeat from round 1 on; with sampled clients each
round's clients have other sizes, so new shapes keep appearing. Each new shape costs a capture (an
eager run, the capture, a checked replay that waits for the device) and device memory for as long as
the graph is kept (:class:`hetfl.engine.vectorized.VectorizedCache` keeps at most ``max_calls``, the
least recently used dropped first). With ``runtime.compile`` each distinct step shape of full batches (rows
at once; since session 19 a client's short last batch of an epoch runs uncompiled) is also a compile by
``torch.compile`` (seconds each; kept for the process).

The plan depends on the clients' sample counts and the batch size only, not on the device or the
model, so this runs anywhere in seconds: client sizes from hetfl's Dirichlet split of 50,000 labels in
10 balanced classes (CIFAR-10's training set), clients sampled per round as the engine samples them,
each round planned by :func:`hetfl.engine.step_plan.plan_round` and its shapes run through the run's
cache policy.

    python benchmarks/graph_shapes.py --rounds 300 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from pathlib import Path

import numpy as np
import torch

from hetfl.algorithms.base import Stage
from hetfl.data.partition import split_dirichlet
from hetfl.engine.schedule import sampled_clients
from hetfl.engine.step_plan import BLOCK_STEPS, plan_round
from hetfl.engine.vectorized import MAX_KEPT_CALLS, VectorizedCache
from hetfl.optim import SGDConfig

# (clients, clients per round, batch size, local epochs, Dirichlet alpha): full participation (CCVR's
# Table 2 and the throughput benchmark's), then sampled federations from small to large
SETTINGS = [(10, 10, 64, 10, 0.5), (20, 20, 64, 1, 0.1), (100, 10, 64, 5, 0.1), (100, 10, 10, 1, 0.1),
            (100, 20, 50, 5, 0.3), (1000, 100, 50, 1, 0.5), (1000, 100, 10, 1, 0.5)]
MARKS = (1, 10, 50, 100, 200, 300, 500, 1000)


def client_sizes(clients: int, alpha: float, seed: int) -> list[int]:
    labels = np.repeat(np.arange(10), 5000)
    parts = split_dirichlet(labels, clients, np.random.default_rng(seed), alpha, min_size=1, max_retries=1000)
    return [len(p) for p in parts]


def measure(clients: int, per_round: int, batch_size: int, epochs: int, alpha: float, rounds: int, seed: int,
            max_calls: int, block_steps: int = BLOCK_STEPS) -> dict:
    sizes = client_sizes(clients, alpha, seed)
    stage = Stage("local", loss=None, trainable=(), sgd=SGDConfig(lr=0.1), epochs=epochs)  # type: ignore[arg-type]
    seen: set = set()
    step_shapes: set = set()  # what runtime.compile compiles for: rows at once, full batches only
    first_round_step_shapes = 0
    cache = VectorizedCache(max_calls=max_calls)
    distinct, new_late, captures_late, calls_late, calls = [], 0, 0, 0, 0
    build_steps, build_steps_late, build_steps_round1 = 0, 0, 0  # steps of captured calls: run twice in Python
    late = max(rounds - 50, 0)
    for r in range(1, rounds + 1):
        chosen = sampled_clients(seed, r, clients, per_round)
        chosen.sort(key=lambda c: -sizes[c])  # the executor orders a group's clients largest first
        gens = [torch.Generator().manual_seed(seed * 1_000_003 + r * 1009 + c) for c in chosen]
        plan = plan_round([stage], chosen, [sizes[c] for c in chosen], batch_size=batch_size, drop_last=False,
                          batch_gens=gens, augment_gens=gens, draw_gens=gens, stage_augment=lambda s, g: None,
                          global_indices=lambda c, idx: idx, device=torch.device("cpu"), block_steps=block_steps)
        for call in plan[0].calls:
            key = (len(chosen), call.shape())
            if call.size == batch_size:
                step_shapes.add((call.width, call.size))
            calls += 1
            fresh = key not in seen
            seen.add(key)
            captured = key not in cache.programs
            cache.programs[key] = None  # type: ignore[assignment]
            cache.used(key)
            build_steps += call.steps * captured
            if r > late:
                calls_late += 1
                new_late += fresh
                captures_late += captured
                build_steps_late += call.steps * captured
        distinct.append(len(seen))
        if r == 1:
            first_round_step_shapes = len(step_shapes)
            build_steps_round1 = build_steps
    return {
        "clients": clients, "per_round": per_round, "batch_size": batch_size, "epochs": epochs, "alpha": alpha,
        "rounds": rounds, "block_steps": block_steps, "calls_per_round": calls / rounds,
        "distinct_shapes": {m: distinct[m - 1] for m in MARKS if m <= rounds},
        "new_shapes_per_round_last50": new_late / min(50, rounds),
        "captures_per_round_last50": captures_late / min(50, rounds),
        "kept_at_end": len(cache.programs), "max_calls": max_calls,
        "step_shapes_round1": first_round_step_shapes, "step_shapes_at_end": len(step_shapes),
        "build_steps_round1": build_steps_round1, "build_steps_per_round_last50": build_steps_late / min(50, rounds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-calls", type=int, default=MAX_KEPT_CALLS)
    parser.add_argument("--block-steps", type=int, nargs="+", default=[BLOCK_STEPS],
                        help="most steps of a call (runtime.graph_steps), each value a row per setting")
    parser.add_argument("--out", type=Path, default=None, help="folder for graph_shapes.json (printed only if absent)")
    args = parser.parse_args()
    rows = []
    header = ("| clients | a round | batch | epochs | alpha | steps/call | calls/round | distinct shapes after rounds "
              f"{', '.join(str(m) for m in MARKS if m <= args.rounds)} | new shapes/round (last 50) | "
              f"captures/round, at most {args.max_calls} kept (last 50) | full-batch step shapes "
              "(torch.compile's compiles), round 1 / all rounds | steps run twice to build graphs: round 1 / "
              "a round (last 50) |")
    print(header)
    print("|" + "---|" * 12)
    for setting in SETTINGS:
        for block_steps in args.block_steps:
            row = measure(*setting, rounds=args.rounds, seed=args.seed, max_calls=args.max_calls,
                          block_steps=block_steps)
            rows.append(row)
            print(f"| {row['clients']} | {row['per_round']} | {row['batch_size']} | {row['epochs']} | {row['alpha']} | "
                  f"{block_steps} | {row['calls_per_round']:.0f} | "
                  f"{', '.join(str(v) for v in row['distinct_shapes'].values())} | "
                  f"{row['new_shapes_per_round_last50']:.2f} | {row['captures_per_round_last50']:.2f} | "
                  f"{row['step_shapes_round1']} / {row['step_shapes_at_end']} | "
                  f"{row['build_steps_round1']} / {row['build_steps_per_round_last50']:.1f} |", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        (args.out / "graph_shapes.json").write_text(json.dumps(
            {"commit": commit, "python": platform.python_version(), "torch": torch.__version__, "seed": args.seed,
             "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
