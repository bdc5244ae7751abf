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

``--tree LABEL=SRC`` (repeated): the same measurement of several source trees (an older commit's ``src``,
checked out with ``git worktree add``), each in its own process with ``PYTHONPATH=SRC``, the trees
interleaved in every one of the ``--repeats`` rounds (a shared machine's load falls on all of them alike);
one row per tree. A tree older than ``VectorizedGroup.vmapped_gradients`` (session 17) times only its whole
step, and one without ``hetfl.models.layers`` (session 11) no plain step.

    python benchmarks/step_host_time.py --model simple_cnn --tree s11=/work/wt-old-s11/src --tree main=src

``--count``: instead of times, what the host does per step of the full-width calls of an eager round
(after a warm-up round), exact and the same on any machine: Python function calls (``cProfile``), of
which in ``torch.utils._pytree`` (``vmap`` and ``grad`` flatten their inputs and outputs; functorch's
handling of an ``autograd.Function`` flattens its arguments at every level), ``autograd.Function``
applies, and ATen operations (a dispatch mode: the kernels that ``vmap``'s batching rules run); one run
per tree. Appends to ``results/step_host_time_cpu.md`` too.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hetfl import config
from hetfl.engine.experiment import Experiment
from hetfl.engine.vectorized import VectorizedGroup, train_clients_vectorized

sys.path.insert(0, str(Path(__file__).parent))
from step_ops import first_round_contexts

# what a step's time is read from: wall time, or (--clock cpu) this thread's CPU time, which a shared
# machine's other processes do not add to while they hold the core (main())
clock = time.perf_counter


def hetfl_round(exp: Experiment, clients: int) -> tuple[list[float], list[float]]:
    """One eager vectorised round: seconds per step of the full-width calls, and of their vmapped gradients."""
    body = VectorizedGroup.body
    gradients = getattr(VectorizedGroup, "vmapped_gradients", None)  # a tree before session 17: none
    steps: list[float] = []
    cores: list[float] = []

    def timed_body(self, stage, index, call):  # type: ignore[no-untyped-def]
        t0 = clock()
        body(self, stage, index, call)
        if call.width == clients:
            steps.append((clock() - t0) / call.steps)

    def timed_gradients(self, *args):  # type: ignore[no-untyped-def]
        t0 = clock()
        out = gradients(self, *args)
        state = args[1]
        if next(iter(state.values())).shape[0] == clients:  # the rows stepped: a full-width call
            cores.append(clock() - t0)
        return out

    VectorizedGroup.body = timed_body  # type: ignore[method-assign]
    if gradients is not None:
        VectorizedGroup.vmapped_gradients = timed_gradients  # type: ignore[method-assign]
    try:
        train_clients_vectorized(exp.algorithm, first_round_contexts(exp), exp.data, seed=exp.cfg.seed,
                                 train_cfg=exp.cfg.train, step_mode="eager")
    finally:
        VectorizedGroup.body = body  # type: ignore[method-assign]
        if gradients is not None:
            VectorizedGroup.vmapped_gradients = gradients  # type: ignore[method-assign]
    return steps, cores


def plain_steps(exp: Experiment, clients: int, batch_size: int, steps: int) -> list[float]:
    """Seconds per step of vmap_reference's plain step at the same width and batch size (none in a tree
    without ``hetfl.models.layers``, which vmap_reference imports)."""
    try:
        from vmap_reference import FlatClients
    except ImportError:
        return []
    flat = FlatClients(exp.model, clients, bf16=False)
    x_all, y_all = exp.data.prepare(exp.data.train_x[:4096]), exp.data.train_y[:4096]
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, len(x_all), (steps, clients, batch_size), generator=gen)
    weight = torch.ones(steps, clients, batch_size)
    out = []
    for t in range(steps):
        t0 = clock()
        flat.step(slice(0, clients), x_all[idx[t]], y_all[idx[t]], weight[t], None, None)
        out.append(clock() - t0)
    return out


class Ops(TorchDispatchMode):
    """Counts the ATen operations dispatched inside."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.n += 1
        return func(*args, **(kwargs or {}))


def count_round(exp: Experiment, clients: int) -> dict[str, float]:
    """Per step of the full-width calls of an eager round (``--count``): Python calls (a round under
    ``cProfile``), of which in ``torch.utils._pytree``, then autograd.Function applies and ATen operations
    (another round, under a dispatch mode: its own Python calls are not in the first count)."""
    body = VectorizedGroup.body
    profile, ops, applies, steps = cProfile.Profile(), Ops(), Counter[str](), Counter[str]()
    original = torch.autograd.Function.__dict__["apply"]  # the classmethod itself, put back after
    apply = original.__func__

    def counted_apply(cls, *args, **kwargs):  # type: ignore[no-untyped-def]
        applies[cls.__name__] += 1
        return apply(cls, *args, **kwargs)

    def counted_body(self, stage, index, call, mode):  # type: ignore[no-untyped-def]
        if call.width != clients or call.first:
            return body(self, stage, index, call)
        steps[mode] += call.steps
        if mode == "profile":
            profile.enable()
            try:
                return body(self, stage, index, call)
            finally:
                profile.disable()
        torch.autograd.Function.apply = classmethod(counted_apply)  # type: ignore[method-assign,assignment]
        try:
            with ops:
                return body(self, stage, index, call)
        finally:
            torch.autograd.Function.apply = original  # type: ignore[method-assign]

    def round_() -> None:
        train_clients_vectorized(exp.algorithm, first_round_contexts(exp), exp.data, seed=exp.cfg.seed,
                                 train_cfg=exp.cfg.train, step_mode="eager")

    round_()  # warm-up: first calls, caches
    try:
        for mode in ("profile", "dispatch"):
            VectorizedGroup.body = lambda *a, mode=mode: counted_body(*a, mode)  # type: ignore[method-assign]
            round_()
    finally:
        VectorizedGroup.body = body  # type: ignore[method-assign]
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    calls = sum(v[1] for v in stats.values())
    pytree = sum(v[1] for k, v in stats.items() if k[0].endswith("_pytree.py"))
    return {"python": calls / steps["profile"], "pytree": pytree / steps["profile"],
            "functions": sum(applies.values()) / steps["dispatch"], "ops": ops.n / steps["dispatch"]}


def experiment(args: argparse.Namespace) -> Experiment:
    torch.set_num_threads(1)
    return Experiment(config.load(None, [
        "data.dataset=cifar10", f"data.root={args.data}/cifar10-jpeg.tar.gz", "data.partition=iid",
        f"data.num_clients={args.clients}", f"model.name={args.model}", f"train.batch_size={args.batch_size}",
        f"train.local_steps={args.steps}", "train.momentum=0.9", "runtime.device=cpu", "runtime.progress=false",
        "runtime.threads=1"]))


def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds per step over ``args.repeats`` rounds, in this process: hetfl's step, its vmapped gradients
    and the plain step, interleaved (``--count``: the counts of :func:`count_round`, each as a list of one)."""
    exp = experiment(args)
    if args.count:
        return {key: [value] for key, value in count_round(exp, args.clients).items()}
    times: dict[str, list[float]] = {"hetfl": [], "core": [], "plain": []}
    for _ in range(args.repeats):
        steps, cores = hetfl_round(exp, args.clients)
        times["hetfl"] += steps
        times["core"] += cores
        times["plain"] += plain_steps(exp, args.clients, args.batch_size, args.steps)
    return times


def compare_trees(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Seconds per step of each ``--tree``, a process per tree and round, the trees interleaved (their
    order turned by one each round, so that none is always first after another's load)."""
    trees = [tree.split("=", 1) for tree in args.tree]
    if any(len(tree) != 2 or not Path(tree[1]).is_dir() for tree in trees):
        raise SystemExit(f"--tree {args.tree!r}: each must be LABEL=SRC with SRC a source directory")
    times: dict[str, dict[str, list[float]]] = {label: {} for label, _ in trees}
    command = [sys.executable, __file__, "--json", "--repeats", "1", "--data", args.data, "--model", args.model,
               "--clients", str(args.clients), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
               "--clock", args.clock, *(["--count"] if args.count else [])]
    for r in range(1 if args.count else args.repeats):  # counts are exact: one run
        for label, src in trees[r % len(trees):] + trees[: r % len(trees)]:
            env = {**os.environ, "PYTHONPATH": str(Path(src).resolve()), "OMP_NUM_THREADS": "1"}
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
            for key, values in json.loads(out.splitlines()[-1]).items():
                times[label].setdefault(key, []).extend(values)
    return times


def tree_commit(src: str) -> str:
    """The short commit of the tree holding ``src`` (``+`` where its files differ from that commit)."""
    def git(*words: str) -> str:
        return subprocess.run(["git", "-C", src, *words], capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+" if git("status", "--porcelain", "--", ".") else "")


def row(label: str, args: argparse.Namespace, times: dict[str, list[float]]) -> str:
    """A table row: medians in ms (``-`` where a tree has no such time); with ``--count``, the counts."""
    if args.count:
        cells = " | ".join(f"{times[key][0]:,.0f}" for key in ("python", "pytree", "functions", "ops"))
        return f"| {label}{args.model} | {args.clients} | {args.batch_size} | {cells} |"
    ms = {k: 1000 * statistics.median(v) if v else None for k, v in times.items()}

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    ratio = "-" if ms["plain"] is None else f"{ms['hetfl'] / ms['plain']:.2f}"  # type: ignore[operator]
    return (f"| {label}{args.model} | {args.clients} | {args.batch_size} | {cell(ms['hetfl'])} | {cell(ms['core'])} | "
            f"{cell(ms['plain'])} | {ratio} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/datasets")
    parser.add_argument("--model", default="simple_cnn")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="local steps of each client")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time steps by the wall clock or by this thread's CPU time (a shared machine)")
    parser.add_argument("--tree", action="append", default=[], metavar="LABEL=SRC",
                        help="measure these source trees, interleaved (module docstring)")
    parser.add_argument("--count", action="store_true",
                        help="count Python calls, pytree calls, autograd.Function applies and ATen ops a step")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # a --tree's process: raw times
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    global clock
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    if args.json:
        print(json.dumps(measure(args)))
        return
    if args.tree:
        by_tree = compare_trees(args)
        labels = {label: f"{label} ({tree_commit(src)})" for label, src in (t.split("=", 1) for t in args.tree)}
        rows = [row(labels[label] + " ", args, times) for label, times in by_tree.items()]
        head, commits = "| tree model |", "; ".join(labels.values())
    else:
        rows, head = [row("", args, measure(args))], "| model |"
        commits = tree_commit(".")
    print("\n".join(rows))
    path = Path(args.out) / "step_host_time_cpu.md"
    title = "" if path.exists() else (
        "# Host time of an eager vectorised step (benchmarks/step_host_time.py)\n\nms a step, medians, one "
        "thread; hetfl's step, of which its vmapped gradients, and vmap_reference.py's plain step.\n")
    trees = "".join(f" --tree {t}" for t in args.tree)
    mode = "--count" if args.count else f"--repeats {args.repeats} --clock {args.clock}"
    columns = ("Python calls a step | of which pytree | autograd.Function applies | ATen ops" if args.count else
               "hetfl step | of which vmapped gradients | plain step | hetfl / plain")
    with path.open("a") as f:
        f.write(title + f"\n`python benchmarks/step_host_time.py --model {args.model} --clients {args.clients} "
                f"--batch-size {args.batch_size} --steps {args.steps} {mode}{trees}` at {commits} "
                f"on {platform.processor() or 'cpu'} (torch {torch.__version__})\n\n"
                f"{head} clients | batch | {columns} |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
