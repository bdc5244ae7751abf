"""How long the host plans a vectorised round: ``VectorizedGroup.plan`` timed, trees side by side.

At the start of each round the GPU waits for the host to draw and lay out the round's whole schedule
(:mod:`hetfl.engine.step_plan`: every client's batches, augmentation and draws, packed call by call and
copied to the device at once). This times that plan for one configuration at several call lengths
(``runtime.graph_steps``), for one or more source trees (``--trees``: folders holding a ``src`` with
hetfl, e.g. a ``git worktree`` of an older commit), each measured in its own process, the processes
interleaved (tree A, tree B, tree A, ...) so that a busy machine weighs on all alike; the median of
each tree's repetitions is reported. Appends to ``benchmarks/results/plan_time_cpu.md``.

    python benchmarks/plan_time.py --data ../shared/datasets --trees /tmp/old . --block-steps 16 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# CCVR's Table 2 round: 10 clients of CIFAR-10, Dirichlet 0.1, 10 epochs of batch 64, crops and flips
SETTING = ["data.dataset=cifar10", "data.partition=dirichlet", "data.alpha=0.1", "data.min_size=10",
           "data.num_clients=10", "model.name=simple_cnn", "train.batch_size=64", "train.local_epochs=10",
           "data.augment=crop_flip", "runtime.device=cpu", "runtime.progress=false", "runtime.threads=1"]

CHILD = r"""
import json, sys, time
from hetfl import config
from hetfl.engine.experiment import Experiment
from hetfl.engine.schedule import lr_at
from hetfl.engine.vectorized import ClientPlan, VectorizedGroup
overrides, block_steps, repeats = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
exp = Experiment(config.load(None, overrides))
server, _, _ = exp.setup_round(exp.initial_server())
algo, plans = exp.algorithm, []
for c in exp.sample_clients(1):
    ctx = exp.client_context(c, 1, lr_at(exp.cfg, 1), algo.payload(server, c), algo.init_client_state(c, server),
                             server)
    ctx.extras = algo.begin(ctx)
    plans.append(ClientPlan(ctx, algo.stages(ctx), algo.start_state(ctx)))
plans.sort(key=lambda p: -exp.data.client_sizes[p.ctx.client_id])
out = {}
for steps in block_steps:
    kwargs = {"block_steps": steps} if steps else {}
    group = VectorizedGroup(plans, exp.data, seed=0, batch_size=exp.cfg.train.batch_size, drop_last=False,
                            max_grad_norm=0.0, buffers=(), step_mode="static", **kwargs)
    calls = sum(len(p.calls) for p in group.plan())  # the first: warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        group.plan()
        times.append(1000 * (time.perf_counter() - t0))
    out[steps] = {"calls": calls, "ms": times}
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/datasets")
    parser.add_argument("--trees", nargs="+", default=["."], help="folders with hetfl's src (one process each)")
    parser.add_argument("--labels", nargs="+", default=None, help="a name per tree (default: the folders)")
    parser.add_argument("--block-steps", type=int, nargs="+", default=[16, 4])
    parser.add_argument("--rounds", type=int, default=3, help="processes per tree, interleaved")
    parser.add_argument("--repeats", type=int, default=10, help="plans timed per process and call length")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    labels = args.labels or args.trees
    overrides = [*SETTING, f"data.root={args.data}/cifar10-jpeg.tar.gz"]
    times: dict[str, dict[int, list[float]]] = {label: {b: [] for b in args.block_steps} for label in labels}
    calls: dict[str, dict[int, int]] = {label: {} for label in labels}
    for _ in range(args.rounds):
        for tree, label in zip(args.trees, labels, strict=True):
            env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve() / "src")}
            done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(overrides), json.dumps(args.block_steps),
                                   str(args.repeats)], env=env, capture_output=True, text=True, check=True)
            for steps, got in json.loads(done.stdout.strip().splitlines()[-1]).items():
                times[label][int(steps)] += got["ms"]
                calls[label][int(steps)] = got["calls"]
    lines = ["", f"`python benchmarks/plan_time.py --trees {' '.join(args.trees)} --labels {' '.join(labels)} "
             f"--block-steps {' '.join(map(str, args.block_steps))} --rounds {args.rounds} --repeats {args.repeats}`",
             "", "| tree | steps/call | calls | plan (ms, median) | min | max |", "|---|---|---|---|---|---|"]
    for label in labels:
        for steps in args.block_steps:
            t = times[label][steps]
            lines.append(f"| {label} | {steps} | {calls[label][steps]} | {statistics.median(t):.1f} | {min(t):.1f} | "
                         f"{max(t):.1f} |")
    print("\n".join(lines))
    path = Path(args.out) / "plan_time_cpu.md"
    if not path.exists():
        path.write_text("# The host's plan of a vectorised round (benchmarks/plan_time.py)\n\nCCVR's Table 2 round "
                        "(10 clients, Dirichlet 0.1, 10 epochs of batch 64, crops and flips), planned on the CPU; "
                        "the GPU waits for it at each round's start.\n")
    with path.open("a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
