"""What the hardware allows: a plain ``vmap`` + CUDA-graph round, and a step's time by width.

Issue 29 quotes a prototype (plain ``vmap`` of one client's step, the round in a CUDA graph) that trained
433,000 samples/s at batch 64 and 145,000 at batch 10 on an H100 in bf16, where hetfl's best variant gets
232,000 and 85,000 (``results/throughput_cuda.md``, session 17). This script is such a prototype, kept in
the repository so that its numbers and hetfl's come from the same run on the same machine, and so that the
gap can be taken apart. On the round of ``throughput.py`` (CIFAR-10 under Dirichlet 0.1, one local epoch,
SGD with momentum 0.9, the model's own PyTorch modules under ``torch.func``, no hetfl executor code):

- **lockstep**: every client takes a step at each of the round's steps (as many as its largest client
  has); a client that has finished, or whose batch is short, has its missing samples weighted 0 and, once
  finished, its update masked (its momentum and weights kept as they are). Every step has the full width.
- **shrinking**: hetfl's layout: clients ordered by size, largest first; a step runs the clients that still
  have a batch (rows ``0..w-1``, a view), so the width shrinks as clients finish; no masking.

Both run the round's steps as one CUDA graph (``--no-graph``: eagerly), the parameters of all clients in
one flat ``[clients, parameters]`` buffer, each step four kernels besides the model's forward, loss and
backward (gather, concatenation of the gradients, two in-place updates; a convolution's weights, strided
across clients in that buffer, are copied once a step by vmap's rule), fp32 or under bf16 autocast.

- **shrinking, hetfl's layers**: the same with the step inside ``hetfl.models.layers.client_batching``, as
  hetfl's executor runs it (its max-pooling that keeps the layout, its linear layers' product then bias):
  what hetfl's layer rules do to the kernels' time, apart from the rest of hetfl's step.

- **widths**: the time of one step at widths 1, 2, 4, ... up to the clients, in a graph of ``--width-steps``
  steps replayed: the curve that decides between the layouts (a shrinking round costs the sum over its steps
  of this curve at their widths; a lockstep one, its steps times the curve at full width) and tells what a
  step costs at the widths hetfl's rounds spend their time at (CCVR's largest client trains alone for 480
  of its 1,580 steps).

``--ccvr`` (with ``--model simple_cnn --clients 10 --batch-sizes 64``): CCVR's Table 2 round as hetfl's executor
lays it out (``VectorizedGroup.plan`` of round 1: its steps by width, one after another) priced with the width
curve (linear between the widths measured; short batches at the full batch's price): the seconds a round of
that setting would take at this plain step's speed, beside hetfl's measured round (``ccvr_time_to_accuracy.py``).

``--check`` (any device, small): the lockstep and shrinking rounds' parameters against each client trained
alone with ``torch.optim.SGD`` on the same batches (the masking is exact: a finished client's parameters
do not move). Appends to ``benchmarks/results/vmap_reference_<device>.md``.

    python benchmarks/vmap_reference.py --data ../shared/datasets --model cnn2 --clients 20 --batch-sizes 64 10
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import math
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from hetfl import config
from hetfl.engine.experiment import Experiment
from hetfl.models.layers import client_batching

LR, MOMENTUM = 0.01, 0.9
#: the rounds timed: lockstep, shrinking (hetfl's layout), and shrinking with the steps inside hetfl's
#: ``client_batching`` (its layers' batching rules: max-pooling where the activation lies, a product then the bias)
LAYOUTS = ("lockstep", "shrinking", "shrinking_layers")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class FlatClients:
    """Every client's copy of ``model``'s parameters as rows of one flat ``[clients, P]`` buffer, with its
    momentum buffer, and the SGD step of a group of rows (:meth:`step`)."""

    def __init__(self, model: torch.nn.Module, clients: int, bf16: bool) -> None:
        if list(model.buffers()):
            raise ValueError(f"model {type(model).__name__} has buffers: this reference trains parameters only")
        self.model, self.bf16 = model, bf16
        self.hetfl_layers = False  # the steps inside hetfl.models.layers.client_batching (its batching rules)
        params = dict(model.named_parameters())
        self.names = list(params)
        self.shapes = [p.shape for p in params.values()]
        self.sizes = [p.numel() for p in params.values()]
        self.start = torch.cat([p.detach().flatten() for p in params.values()])
        self.flat = self.start.repeat(clients, 1)
        self.momentum = torch.zeros_like(self.flat)

    def reset(self) -> None:
        self.flat.copy_(self.start.expand_as(self.flat))
        self.momentum.zero_()

    def views(self, rows: slice) -> dict[str, torch.Tensor]:
        """The parameters of rows ``rows``, as views of the flat buffer."""
        parts = self.flat[rows].split(self.sizes, dim=1)
        return {n: p.unflatten(1, s) for n, p, s in zip(self.names, parts, self.shapes, strict=True)}

    def loss(self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
             weight: torch.Tensor) -> torch.Tensor:
        """One client's mean cross-entropy over the samples weighted 1 (``weight``: 1 or 0 per sample)."""
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.bf16, cache_enabled=False):
            logits = functional_call(self.model, params, (x,))
        ce = F.cross_entropy(logits.float(), y, reduction="none")
        return (ce * weight).sum() / weight.sum().clamp(min=1)

    def step(self, rows: slice, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
             keep: torch.Tensor | None, rate: torch.Tensor | None) -> None:
        """One SGD step (momentum 0.9, lr 0.01, torch.optim.SGD's) of rows ``rows`` on ``x [w, b, ...]``;
        ``keep``/``rate`` (``[w, 1]``, lockstep only): the momentum's factor (1: a finished row's buffer
        kept) and the learning rate (0: its weights kept)."""
        with client_batching() if self.hetfl_layers else contextlib.nullcontext():
            grads = vmap(grad(self.loss))(self.views(rows), x, y, weight)
        g = torch.cat([grads[n].flatten(1) for n in self.names], dim=1)
        momentum, flat = self.momentum[rows], self.flat[rows]
        if keep is None:
            momentum.mul_(MOMENTUM).add_(g)
            flat.add_(momentum, alpha=-LR)
        else:
            momentum.mul_(keep).add_(g)
            flat.addcmul_(momentum, rate, value=-1)


def client_batches(sizes: list[int], batch_size: int, gen: torch.Generator) -> list[list[torch.Tensor]]:
    """Each client's batches of one epoch: positions into its samples, shuffled, the last one short."""
    return [list(torch.randperm(n, generator=gen).split(batch_size)) for n in sizes]


def lockstep_plan(batches: list[list[torch.Tensor]], client_idx: list[torch.Tensor], batch_size: int,
                  device: torch.device) -> tuple[torch.Tensor, ...]:
    """``idx [T, W, b]`` (training-set indices; 0 where a slot is empty), ``weight [T, W, b]``, ``keep`` and
    ``rate [T, W, 1]`` for a round whose every step has every client."""
    steps, width = max(len(b) for b in batches), len(batches)
    idx = torch.zeros(steps, width, batch_size, dtype=torch.long)
    weight = torch.zeros(steps, width, batch_size)
    active = torch.zeros(steps, width, 1)
    for c, bs in enumerate(batches):
        for t, pos in enumerate(bs):
            idx[t, c, : len(pos)] = client_idx[c][pos]
            weight[t, c, : len(pos)] = 1.0
            active[t, c] = 1.0
    keep = torch.where(active > 0, torch.tensor(MOMENTUM), torch.tensor(1.0))
    return tuple(t.to(device) for t in (idx, weight, keep, active * LR))


def shrinking_plan(batches: list[list[torch.Tensor]], client_idx: list[torch.Tensor], batch_size: int,
                   device: torch.device) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Clients must come largest first. ``widths[t]`` (clients with a batch at step t, rows ``0..w-1``),
    ``idx``/``weight [T, W, b]`` as in :func:`lockstep_plan` (a short batch padded with weight 0)."""
    idx, weight, _, _ = lockstep_plan(batches, client_idx, batch_size, device)
    widths = [sum(1 for b in batches if len(b) > t) for t in range(idx.shape[0])]
    if widths != sorted(widths, reverse=True) or any(widths[t] and len(batches[widths[t] - 1]) <= t
                                                     for t in range(len(widths))):
        raise ValueError("shrinking_plan: clients must be ordered largest first")
    return widths, idx, weight


def round_fn(clients: FlatClients, x_all: torch.Tensor, y_all: torch.Tensor, layout: str,
             plan: tuple, max_steps: int | None) -> Callable[[bool], None]:
    """The round's steps as one function (captured as one CUDA graph by :func:`graphed`); called with
    True, only the first step of each width (a warm-up of every shape the round has)."""
    clients.hetfl_layers = layout == "shrinking_layers"
    if layout == "lockstep":
        idx, weight, keep, rate = plan
        widths = [idx.shape[1]] * idx.shape[0]
    else:
        widths, idx, weight = plan
        keep = rate = None
    steps = len(widths) if max_steps is None else min(max_steps, len(widths))

    def run(warm_up: bool = False) -> None:
        for t in range(steps):
            w = widths[t]
            if warm_up and t and widths[t - 1] == w:
                continue
            rows = slice(0, w)
            i = idx[t, :w]
            clients.step(rows, x_all[i], y_all[i], weight[t, :w], None if keep is None else keep[t, :w],
                         None if rate is None else rate[t, :w])

    return run


def graphed(fn: Callable[[bool], None], reset: Callable[[], None], device: torch.device,
            use_graph: bool) -> Callable[[], None]:
    """``fn`` captured as one CUDA graph (after ``fn(True)``, a step of each shape, run on a side stream
    as a warm-up: cuBLAS's and cuDNN's choices and workspaces), or ``fn`` itself; the state ``reset``
    before returning, so the first timed run starts where an untimed one would."""
    if device.type != "cuda" or not use_graph:
        fn(True)
        reset()
        return fn
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(True)
    torch.cuda.current_stream().wait_stream(stream)
    reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    reset()
    return graph.replay


def timed_runs(run: Callable[[], None], reset: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median seconds of ``repeats`` runs, each from the reset state (the reset untimed)."""
    times = []
    for _ in range(repeats):
        reset()
        sync(device)
        t0 = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check(model: torch.nn.Module, batches: list[list[torch.Tensor]], client_idx: list[torch.Tensor],
          x_all: torch.Tensor, y_all: torch.Tensor, clients: FlatClients, layout: str, plan: tuple,
          max_steps: int | None) -> float:
    """Largest difference between the layout's parameters after its round and each client trained alone
    with ``torch.optim.SGD`` on the same batches."""
    clients.reset()
    round_fn(clients, x_all, y_all, layout, plan, max_steps)()
    worst = 0.0
    for c, bs in enumerate(batches):
        alone = copy.deepcopy(model)
        opt = torch.optim.SGD(alone.parameters(), lr=LR, momentum=MOMENTUM)
        for pos in bs[:max_steps]:
            i = client_idx[c][pos].to(x_all.device)
            opt.zero_grad()
            with torch.autocast(x_all.device.type, dtype=torch.bfloat16, enabled=clients.bf16):
                logits = alone(x_all[i])
            F.cross_entropy(logits.float(), y_all[i]).backward()
            opt.step()
        trained = torch.cat([p.detach().flatten() for p in alone.parameters()])
        worst = max(worst, (trained - clients.flat[c]).abs().max().item())
    return worst


def width_curve(clients: FlatClients, x_all: torch.Tensor, y_all: torch.Tensor, batch_size: int,
                max_width: int, steps: int, device: torch.device, use_graph: bool) -> dict[int, float]:
    """Milliseconds per step at widths 1, 2, 4, ... and ``max_width`` (``steps`` steps a graph)."""
    gen = torch.Generator().manual_seed(1)
    out: dict[int, float] = {}
    widths = sorted({*(2**k for k in range(int(math.log2(max_width)) + 1)), max_width})
    for w in widths:
        idx = torch.randint(0, len(x_all), (steps, w, batch_size), generator=gen).to(device)
        weight = torch.ones(steps, w, batch_size, device=device)

        def run(warm_up: bool = False, idx: torch.Tensor = idx, weight: torch.Tensor = weight, w: int = w) -> None:
            for t in range(1 if warm_up else steps):
                clients.step(slice(0, w), x_all[idx[t]], y_all[idx[t]], weight[t], None, None)

        fn = graphed(run, clients.reset, device, use_graph)
        out[w] = 1000 * timed_runs(fn, clients.reset, device, 5) / steps
    return out


@functools.cache
def ccvr_widths(data_root: str, device: torch.device) -> dict[int, int]:
    """Steps by width, one after another, of round 1 of CCVR's Table 2 setting as hetfl's executor plans it
    (``ccvr_time_to_accuracy.setting``: 10 clients, Dirichlet 0.1, 10 epochs of batch 64, seed 0)."""
    from ccvr_time_to_accuracy import setting
    from step_ops import client_plans, first_round_contexts, static_group

    args = argparse.Namespace(data=data_root, alpha=0.1, rounds=1, local_epochs=10, seed=0)
    exp = Experiment(config.load(None, [*setting(args), f"runtime.device={device.type}"]))
    group = static_group(exp, client_plans(exp, first_round_contexts(exp)))
    widths: dict[int, int] = {}
    for stage in group.plan():
        for call in stage.calls:
            widths[call.width] = widths.get(call.width, 0) + call.steps
    return dict(sorted(widths.items()))


def priced(widths: dict[int, int], curve: dict[int, float]) -> float:
    """Seconds of ``widths`` (steps by width) at ``curve``'s ms a step, linear between measured widths."""
    known = sorted(curve)

    def ms(w: int) -> float:
        if w in curve:
            return curve[w]
        below, above = max(k for k in known if k < w), min(k for k in known if k > w)
        return curve[below] + (curve[above] - curve[below]) * (w - below) / (above - below)

    return sum(steps * ms(w) for w, steps in widths.items()) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/datasets")
    parser.add_argument("--model", default="cnn2")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 10])
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp32"], choices=("fp32", "bf16"))
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=LAYOUTS,
                        help="the rounds to time (none: the width curve alone)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--width-steps", type=int, default=20, help="steps per graph in the width curve (0: none)")
    parser.add_argument("--max-steps", type=int, default=None, help="the rounds' first steps only (a CPU smoke run)")
    parser.add_argument("--no-graph", action="store_true", help="on CUDA, run the steps eagerly")
    parser.add_argument("--ccvr", action="store_true", help="price CCVR's Table 2 round with the width curve")
    parser.add_argument("--check", action="store_true", help="compare both layouts with clients trained alone")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use_graph = not args.no_graph
    write = None if args.check else results_file(args, device)
    for bs in args.batch_sizes:
        exp = Experiment(config.load(None, [
            "data.dataset=cifar10", f"data.root={args.data}/cifar10-jpeg.tar.gz", "data.partition=dirichlet",
            "data.alpha=0.1", f"data.num_clients={args.clients}", f"model.name={args.model}",
            f"train.batch_size={bs}", "runtime.progress=false", f"runtime.device={device.type}"]))
        data = exp.data
        order = sorted(range(data.num_clients), key=lambda c: -data.client_sizes[c])  # largest first
        client_idx = [data.client_train[c].cpu() for c in order]
        batches = client_batches([data.client_sizes[c] for c in order], bs, torch.Generator().manual_seed(0))
        x_all, y_all = data.prepare(data.train_x), data.train_y
        samples = sum(data.client_sizes) if args.max_steps is None else sum(
            len(p) for b in batches for p in b[: args.max_steps])
        shrinking = shrinking_plan(batches, client_idx, bs, device)
        plans = {"lockstep": lockstep_plan(batches, client_idx, bs, device), "shrinking": shrinking,
                 "shrinking_layers": shrinking}
        for precision in args.precisions:
            clients = FlatClients(exp.model.to(device), data.num_clients, bf16=precision == "bf16")
            if args.check:
                for layout, plan in plans.items():
                    worst = check(exp.model, batches, client_idx, x_all, y_all, clients, layout, plan,
                                  args.max_steps)
                    print(f"check bs {bs} {precision} {layout}: largest difference to clients trained alone "
                          f"{worst:.2e}", flush=True)
                continue
            row = {}
            for layout, plan in ((k, v) for k, v in plans.items() if k in args.layouts):
                fn = graphed(round_fn(clients, x_all, y_all, layout, plan, args.max_steps), clients.reset,
                             device, use_graph)
                seconds = timed_runs(fn, clients.reset, device, args.repeats)
                row[layout] = samples / seconds
            steps = len(plans["shrinking"][0]) if args.max_steps is None else args.max_steps
            client_steps = sum(plans["shrinking"][0][:steps])
            clients.hetfl_layers = False
            curve = width_curve(clients, x_all, y_all, bs, data.num_clients, args.width_steps, device,
                                use_graph) if args.width_steps else {}
            text = (f"| {args.model} | {args.clients} | {bs} | {precision} | {steps} | {client_steps} | "
                    + " | ".join(f"{row[k]:,.0f}" if k in row else "-" for k in plans) + " | "
                    + ", ".join(f"{w}: {ms:.3f}" for w, ms in curve.items()) + " |")
            print(text, flush=True)
            if write is not None:
                write(text)
            if args.ccvr and curve:
                widths = ccvr_widths(args.data, device)
                note = (f"CCVR's Table 2 round 1 as hetfl plans it, steps by width {widths} "
                        f"({sum(widths.values())} one after another), at this {precision} plain step: "
                        f"{priced(widths, curve):.2f} s a round")
                print(note, flush=True)
                if write is not None:
                    write(f"\n{note}\n")


def results_file(args: argparse.Namespace, device: torch.device) -> Callable[[str], None]:
    """A function that appends a row to ``vmap_reference_<device>.md`` (after this run's heading, written
    with the first row): a run cut at a time limit keeps its finished rows."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    command = (f"python benchmarks/vmap_reference.py --model {args.model} --clients {args.clients} --batch-sizes "
               f"{' '.join(map(str, args.batch_sizes))} --precisions {' '.join(args.precisions)}"
               + ("" if args.layouts == list(LAYOUTS) else f" --layouts {' '.join(args.layouts)}".rstrip())
               + (f" --width-steps {args.width_steps}" if args.width_steps != 20 else "")
               + (" --no-graph" if args.no_graph else "") + (" --ccvr" if args.ccvr else "")
               + (f" --max-steps {args.max_steps}" if args.max_steps else ""))
    path = Path(args.out) / f"vmap_reference_{device.type}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    head = "" if path.exists() else (
        "# A plain vmap + CUDA-graph round (benchmarks/vmap_reference.py)\n\nSamples/s of local training "
        "(the round's steps as one CUDA graph, on CUDA); ms per step by width (a graph of steps at that "
        "width).\n")
    table = ["", f"`{command}` at {commit} on {name} (torch {torch.__version__})", "",
             "| model | clients | batch | precision | critical steps | client-steps | lockstep | shrinking | "
             "shrinking, hetfl's layers | ms/step by width (plain) |", "|---|---|---|---|---|---|---|---|---|---|"]
    written = []

    def write(row: str) -> None:
        with path.open("a") as f:
            f.write((head + "\n".join(table) + "\n" if not written else "") + row + "\n")
        written.append(row)

    return write


if __name__ == "__main__":
    main()
