"""Host time of hetfl's eager vectorised step beside a plain ``vmap`` step, on one CPU thread.

On a GPU an eager step (no CUDA graph: a graph's first, reference run in round 1, and every step of a stage
that cannot be captured) costs what its host spends dispatching it. Session 17 saw 35-41 ms a step there.
This script tells how much of a step's host time is hetfl's own (the plan's views, the batch gather, the
stage's context, the SGD update, the metric sums) and how much is ``vmap(grad(...))`` itself. At batch 2
the arithmetic is negligible, so the time is the host's. It times three things on the same model and width:

- hetfl's step: ``VectorizedGroup.body`` per step of a width-``clients`` call, eager mode;
- of which ``VectorizedGroup.vmapped_gradients``: the vmapped forward, loss and backward;
- the plain step of ``vmap_reference.py``: ``vmap(grad(loss))`` of ``functional_call``, a concatenation and
  two in-place updates.

The two are interleaved over ``--repeats`` rounds; medians over all steps.

    python benchmarks/step_host_time.py --data ../shared/datasets --model simple_cnn --clients 10 --batch-size 2
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from hetfl import config
from hetfl.engine.experiment import Experiment
from hetfl.engine.vectorized import VectorizedGroup, train_clients_vectorized

sys.path.insert(0, str(Path(__file__).parent))
from step_ops import first_round_contexts
from vmap_reference import FlatClients


def hetfl_round(exp: Experiment, clients: int) -> tuple[list[float], list[float]]:
    """One eager vectorised round: seconds per step of the full-width calls, and of their vmapped gradients."""
    body, gradients = VectorizedGroup.body, VectorizedGroup.vmapped_gradients
    steps: list[float] = []
    cores: list[float] = []

    def timed_body(self, stage, index, call):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        body(self, stage, index, call)
        if call.width == clients:
            steps.append((time.perf_counter() - t0) / call.steps)

    def timed_gradients(self, *args):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = gradients(self, *args)
        state = args[1]
        if next(iter(state.values())).shape[0] == clients:  # the rows stepped: a full-width call
            cores.append(time.perf_counter() - t0)
        return out

    VectorizedGroup.body, VectorizedGroup.vmapped_gradients = timed_body, timed_gradients  # type: ignore[method-assign]
    try:
        train_clients_vectorized(exp.algorithm, first_round_contexts(exp), exp.data, seed=exp.cfg.seed,
                                 train_cfg=exp.cfg.train, step_mode="eager")
    finally:
        VectorizedGroup.body, VectorizedGroup.vmapped_gradients = body, gradients  # type: ignore[method-assign]
    return steps, cores


def plain_steps(exp: Experiment, clients: int, batch_size: int, steps: int) -> list[float]:
    """Seconds per step of vmap_reference's plain step at the same width and batch size."""
    flat = FlatClients(exp.model, clients, bf16=False)
    x_all, y_all = exp.data.prepare(exp.data.train_x[:4096]), exp.data.train_y[:4096]
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, len(x_all), (steps, clients, batch_size), generator=gen)
    weight = torch.ones(steps, clients, batch_size)
    out = []
    for t in range(steps):
        t0 = time.perf_counter()
        flat.step(slice(0, clients), x_all[idx[t]], y_all[idx[t]], weight[t], None, None)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/datasets")
    parser.add_argument("--model", default="simple_cnn")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="local steps of each client")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    exp = Experiment(config.load(None, [
        "data.dataset=cifar10", f"data.root={args.data}/cifar10-jpeg.tar.gz", "data.partition=iid",
        f"data.num_clients={args.clients}", f"model.name={args.model}", f"train.batch_size={args.batch_size}",
        f"train.local_steps={args.steps}", "train.momentum=0.9", "runtime.device=cpu", "runtime.progress=false",
        "runtime.threads=1"]))
    hetfl: list[float] = []
    core: list[float] = []
    plain: list[float] = []
    for _ in range(args.repeats):
        steps, cores = hetfl_round(exp, args.clients)
        hetfl += steps
        core += cores
        plain += plain_steps(exp, args.clients, args.batch_size, args.steps)
    ms = {k: 1000 * statistics.median(v) for k, v in (("hetfl", hetfl), ("core", core), ("plain", plain))}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    row = (f"| {args.model} | {args.clients} | {args.batch_size} | {ms['hetfl']:.2f} | {ms['core']:.2f} | "
           f"{ms['plain']:.2f} | {ms['hetfl'] / ms['plain']:.2f} |")
    print(row)
    path = Path(args.out) / "step_host_time_cpu.md"
    head = "" if path.exists() else (
        "# Host time of an eager vectorised step (benchmarks/step_host_time.py)\n\nms a step, medians, one "
        "thread; hetfl's step, of which its vmapped gradients, and vmap_reference.py's plain step.\n")
    with path.open("a") as f:
        f.write(head + f"\n`python benchmarks/step_host_time.py --model {args.model} --clients {args.clients} "
                f"--batch-size {args.batch_size} --steps {args.steps} --repeats {args.repeats}` at {commit} on "
                f"{platform.processor() or 'cpu'} (torch {torch.__version__})\n\n"
                "| model | clients | batch | hetfl step | of which vmapped gradients | plain step | hetfl / plain |\n"
                "|---|---|---|---|---|---|---|\n" + row + "\n")


if __name__ == "__main__":
    main()
