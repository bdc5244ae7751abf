"""How many operations does a vectorised step run? Counted on the CPU, for the GPU.

On a GPU a step of the vectorised executor is a CUDA graph replay whose time, at the small
batches of federated clients, is set by how many kernels it launches and how many bytes they
move, not by Python. Every ATen operation that is not a view is a kernel there. This script
runs one round of the vectorised executor in ``static`` step mode (the CUDA-graph path's logic,
without the capture) on the CPU under a dispatch-mode counter and reports, per step:

- the operations of the round's calls, split into calls that read their rows as views (a range
  of rows) and calls that gather them by index (and scatter them back);
- where they come from: the data (gather, crops, normalisation), autocast's casts (since session 27
  also the multi-tensor casts of a bf16 step's weight copies, ``hetfl.models.low_precision``), the model's
  forward and backward with the loss, the SGD update, the bookkeeping (metric sums, state
  gathers/writes) (since session 15; before, "model, loss, data" was one kind, and the bookkeeping
  was every ``add_``/``copy_``/index op wherever it ran);
- the steps on the round's critical path (calls run one after another) and the client-steps;
- the host's planning of the round (median of 5, ms): the GPU waits for it at each round's start.

Batches are gathered from images normalised once, as on a CUDA device with room for them (since
session 15; ``--raw-images``: each batch normalised, a CPU's path and every earlier tree's).

The counts are exact and deterministic (no timing), so runs on two trees compare directly.
Appends to ``benchmarks/results/step_ops_cpu.{json,md}``.

    python benchmarks/step_ops.py --data ../shared/datasets --model cnn2 --clients 20 --batch-size 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from collections import Counter
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

from hetfl import config
from hetfl.engine.data import FederatedData
from hetfl.engine.experiment import Experiment
from hetfl.engine.schedule import lr_at
from hetfl.engine.vectorized import ClientPlan, VectorizedGroup, train_clients_vectorized

VIEWS = {"aten.view", "aten._unsafe_view", "aten.t", "aten.transpose", "aten.permute", "aten.expand", "aten.slice",
         "aten.select", "aten.unsqueeze", "aten.squeeze", "aten.detach", "aten.alias", "aten.reshape",
         "aten.as_strided", "aten.unbind", "aten.split", "aten.split_with_sizes", "aten.empty", "aten.empty_like",
         "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided"}
CAST_ALL = "aten._foreach_copy_ (cast)"
BOOKKEEPING = {"aten.index_select", "aten.index_copy_", "aten.index_add_", "aten.add_", "aten.copy_"}


class StepCounter(TorchDispatchMode):
    """Counts the non-view ATen operations dispatched inside it, by phase: ``"model"`` inside the vmapped
    gradients (forward, loss, backward; :meth:`VectorizedGroup.vmapped_gradients`), ``"step"`` around it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[tuple[str, str]] = Counter()
        self.phase = "step"
        self.cloned = 0  # bytes written by layout copies (aten.clone: a batching rule's .contiguous())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func.overloadpacket)
        if name == "aten._foreach_copy_" and args[0] and args[0][0].dtype != args[1][0].dtype:
            name = CAST_ALL  # a bf16 step's casts of all its weights, one multi-tensor copy
        out = func(*args, **(kwargs or {}))
        if name not in VIEWS:
            self.ops[(self.phase, name)] += 1
        if name == "aten.clone":
            self.cloned += out.nbytes
        return out


def kind(phase: str, op: str) -> str:
    """Where an operation comes from: autocast's casts, the model's forward and backward with the loss
    (inside the vmapped gradients), the SGD update, the bookkeeping (metric sums, state gathers and writes)
    or the data (the batch's gather, crops, normalisation)."""
    if op in ("aten._to_copy", CAST_ALL):
        return "casts"
    if phase == "model":
        return "model, loss"
    if op.startswith("aten._foreach_"):
        return "sgd update"
    if op in BOOKKEEPING:
        return "bookkeeping"
    return "data"


def first_round_contexts(exp: Experiment) -> list:
    """The client contexts of round 1 (its sampled clients) from the initial server, as the engine makes them."""
    server, _, _ = exp.setup_round(exp.initial_server())
    algo = exp.algorithm
    return [exp.client_context(c, 1, lr_at(exp.cfg, 1), algo.payload(server, c), algo.init_client_state(c, server),
                               server) for c in exp.sample_clients(1)]


def client_plans(exp: Experiment, ctxs: list) -> list[ClientPlan]:
    """The vectorised executor's plans of ``ctxs``, largest client first (its row order)."""
    algo = exp.algorithm
    plans = []
    for ctx in ctxs:
        ctx.extras = algo.begin(ctx)
        plans.append(ClientPlan(ctx, algo.stages(ctx), algo.start_state(ctx)))
    return sorted(plans, key=lambda p: -exp.data.client_sizes[p.ctx.client_id])


def static_group(exp: Experiment, plans: list[ClientPlan]) -> VectorizedGroup:
    """A group of ``plans`` in ``static`` step mode (a CUDA graph's logic, without the capture)."""
    return VectorizedGroup(plans, exp.data, seed=exp.cfg.seed, batch_size=exp.cfg.train.batch_size,
                           drop_last=exp.cfg.train.drop_last, max_grad_norm=0.0, buffers=(), step_mode="static")


def plan_ms(exp: Experiment, ctxs: list) -> float:
    """Median wall time of planning the round (the executor's host work before its first step)."""
    plans = client_plans(exp, ctxs)
    times = []
    for _ in range(5):
        group = static_group(exp, plans)
        t0 = time.perf_counter()
        group.plan()
        times.append(1000 * (time.perf_counter() - t0))
    return round(statistics.median(times), 1)


def count_round(overrides: list[str], prepared: bool = True) -> dict:
    """One vectorised round of the configuration, counted per call; ``prepared``: batches gathered from
    images normalised once, as on a CUDA device with room for them (hetfl.engine.data.FederatedData)."""
    room = FederatedData._room_for
    FederatedData._room_for = lambda self, raw, padding: prepared  # type: ignore[method-assign]
    try:
        exp = Experiment(config.load(None, [*overrides, "runtime.device=cpu", "runtime.progress=false"]))
    finally:
        FederatedData._room_for = room  # type: ignore[method-assign]
    calls: list[dict] = []
    original = VectorizedGroup.body

    gradients = VectorizedGroup.vmapped_gradients
    counters: list[StepCounter] = []

    def counted(self, stage, index, call):  # type: ignore[no-untyped-def]
        counter = StepCounter()
        counters.append(counter)
        with counter:
            original(self, stage, index, call)
        calls.append({"steps": call.steps, "width": call.width, "gathered": call.rows is not None,
                      "ops": counter.ops, "cloned": counter.cloned})

    def in_model(self, *args):  # type: ignore[no-untyped-def]
        counters[-1].phase = "model"
        try:
            return gradients(self, *args)
        finally:
            counters[-1].phase = "step"

    VectorizedGroup.body = counted  # type: ignore[method-assign]
    VectorizedGroup.vmapped_gradients = in_model  # type: ignore[method-assign]
    try:
        train_clients_vectorized(exp.algorithm, first_round_contexts(exp), exp.data, seed=exp.cfg.seed,
                                 train_cfg=exp.cfg.train, step_mode="static")
    finally:
        VectorizedGroup.body = original  # type: ignore[method-assign]
        VectorizedGroup.vmapped_gradients = gradients  # type: ignore[method-assign]
    row: dict = {"critical_steps": sum(c["steps"] for c in calls), "client_steps": sum(c["steps"] * c["width"]
                                                                                        for c in calls),
                 "calls": len(calls), "plan_ms": plan_ms(exp, first_round_contexts(exp)),
                 "cloned_mb": round(sum(c["cloned"] for c in calls) / 1e6, 1)}
    # since session 18 a view call of one row (one client training alone) runs the step unbatched
    for label, chosen in (("views", [c for c in calls if not c["gathered"]]),
                          ("gathered", [c for c in calls if c["gathered"]]),
                          ("one_row", [c for c in calls if not c["gathered"] and c["width"] == 1])):
        steps = sum(c["steps"] for c in chosen)
        total: Counter[tuple[str, str]] = sum((c["ops"] for c in chosen), Counter())
        by_kind: Counter[str] = Counter()
        for (phase, op), n in total.items():
            by_kind[kind(phase, op)] += n
        row[label] = {"steps": steps, "ops_per_step": round(sum(total.values()) / steps, 1) if steps else None,
                      "by_kind": {k: round(v / steps, 1) for k, v in sorted(by_kind.items())} if steps else {}}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/datasets")
    parser.add_argument("--model", default="cnn2")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--augment", default="none", choices=("none", "crop_flip"))
    parser.add_argument("--raw-images", action="store_true",
                        help="normalise each batch (a CPU's path) instead of gathering prepared images (a GPU's)")
    parser.add_argument("--label", default="", help="what tree this is (e.g. a commit and what it changed)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    base = ["data.dataset=cifar10", f"data.root={args.data}/cifar10-jpeg.tar.gz", "data.partition=dirichlet",
            "data.alpha=0.1", f"data.num_clients={args.clients}", f"model.name={args.model}",
            f"train.batch_size={args.batch_size}", f"train.local_epochs={args.epochs}", "train.momentum=0.9",
            f"data.augment={args.augment}", "runtime.threads=1"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    entry = {"commit": commit, "label": args.label, "command": "python benchmarks/step_ops.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}" for k, v in vars(args).items()
        if k not in ("out", "data", "label", "raw_images")) + (" --raw-images" if args.raw_images else ""),
        "rows": {}}
    for precision in args.precisions:
        overrides = [*base, f"train.precision={precision}"]
        entry["rows"][precision] = row = count_round(overrides, prepared=not args.raw_images)
        print(precision, json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "step_ops_cpu.json"
    entries = json.loads(path.read_text()) if path.exists() else []
    entries.append(entry)
    path.write_text(json.dumps(entries, indent=2) + "\n")
    (out / "step_ops_cpu.md").write_text(render(entries))


def render(entries: list[dict]) -> str:
    lines = ["# Operations per vectorised step (CPU count, for the GPU)", "",
             "Non-view ATen operations per step of one round in `static` step mode (each one a kernel launch on "
             "a GPU), for calls that read their rows as views and calls that gather them; `critical` = steps "
             "run one after another, `client-steps` = steps times rows; `cloned` = MB written by layout copies "
             "(`aten.clone`, a batching rule making a tensor contiguous) in the whole round (recorded since "
             "session 14). benchmarks/step_ops.py.", ""]
    for e in entries:
        lines += [f"`{e['command']}` at {e['commit']}{': ' + e['label'] if e.get('label') else ''}", "",
                  "| precision | critical steps | client-steps | calls | plan (ms) | view steps | ops/step (views) | "
                  "of which one row: steps, ops/step | gathered steps | ops/step (gathered) | cloned (MB) | "
                  "per step, by kind (views) |", "|---" * 12 + "|"]
        for precision, r in e["rows"].items():
            v, g, one = r["views"], r["gathered"], r.get("one_row")
            kinds = ", ".join(f"{k} {n}" for k, n in v["by_kind"].items())
            alone = f"{one['steps']}, {one['ops_per_step'] or '-'}" if one else "-"
            lines.append(f"| {precision} | {r['critical_steps']} | {r['client_steps']} | {r['calls']} | "
                         f"{r.get('plan_ms', '-')} | {v['steps']} | "
                         f"{v['ops_per_step'] or '-'} | {alone} | {g['steps']} | {g['ops_per_step'] or '-'} | "
                         f"{r.get('cloned_mb', '-')} | {kinds} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
