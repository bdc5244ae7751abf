"""Profile one vectorised round on a GPU: where the host waits and what the GPU does.

One untimed warm-up round (captures the CUDA graphs), then one round under
``torch.profiler`` (``--round 1``: the first round itself, its CUDA graphs' builds
included, with the host time of each build phase: the eager reference run, the capture,
the checked replay; ``hetfl.engine.vectorized.build_phase``). Prints and appends to
``benchmarks/results/profile_<device>.md``:
graph replays, host synchronisations (``cudaStreamSynchronize``/``cudaDeviceSynchronize``
and their host time), host-to-device copies, kernels launched outside graphs, the
round's wall time and the GPU's busy share (kernel time over wall time), the kernels
run and GPU time by kind (convolutions, matrix products, layout conversions, pooling,
indexing, elementwise and reductions), and the top kernels by GPU time.

    python benchmarks/profile_round.py --data ../shared/datasets --model cnn2 --clients 20 \\
        --batch-size 64 --variant graph_bf16
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from hetfl import config
from hetfl.engine.experiment import Experiment
from hetfl.engine.summary import Reporter
from hetfl.engine.vectorized import BUILD_PHASE

VARIANTS = {
    "vectorized": ["runtime.executor=vectorized", "runtime.cuda_graph=false"],
    "graph": ["runtime.executor=vectorized", "runtime.cuda_graph=true"],
    "graph_bf16": ["runtime.executor=vectorized", "runtime.cuda_graph=true", "train.precision=bf16"],
    "graph_bf16_compiled": ["runtime.executor=vectorized", "runtime.cuda_graph=true", "train.precision=bf16",
                            "runtime.compile=true"],
}


KINDS = (("layout conversion", ("nchwtonhwc", "nhwctonchw")), ("pooling", ("pool",)),
         ("convolution", ("conv", "wgrad", "dgrad", "fprop", "implicit")), ("matrix product", ("gemm", "cutlass")),
         ("indexing", ("index", "gather", "scatter")), ("elementwise", ("elementwise", "multi_tensor", "foreach")),
         ("reduction", ("reduce",)))


def kernel_kind(name: str) -> str:
    """A coarse kind of a CUDA kernel, from its name."""
    lowered = name.lower()
    return next((kind for kind, marks in KINDS if any(m in lowered for m in marks)), "other")


def build_phases(events, wall_s: float) -> list[str]:  # type: ignore[no-untyped-def]
    """The table of the compiled calls' build phases (``hetfl.build/...`` ranges): count, host ms, share
    of the round's wall time (under the profiler, whose own overhead inflates host time)."""
    phases = [e for e in events if e.key.startswith(f"{BUILD_PHASE}/")]
    if not phases:
        return []
    lines = ["", "Compiled calls' builds (host time of each phase, nested phases not subtracted):", "",
             "| phase | count | host ms | share of the round |", "|---|---|---|---|"]
    for e in sorted(phases, key=lambda e: -e.cpu_time_total):
        ms = e.cpu_time_total / 1e3
        lines.append(f"| {e.key.removeprefix(BUILD_PHASE + '/')} | {e.count} | {ms:.0f} | {ms / 1e3 / wall_s:.0%} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", default="../shared/datasets")
    parser.add_argument("--model", default="cnn2")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--variant", default="graph_bf16", choices=list(VARIANTS))
    parser.add_argument("--round", type=int, default=2, choices=(1, 2),
                        help="2: a round after the warm-up; 1: the first round, its builds included")
    parser.add_argument("--augment", default="none", choices=("none", "crop_flip"))
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_round.py profiles a CUDA round; no CUDA device here")
    exp = Experiment(config.load(None, [
        "data.dataset=cifar10", f"data.root={args.data}/cifar10-jpeg.tar.gz", "data.partition=dirichlet",
        "data.alpha=0.1", f"data.num_clients={args.clients}", f"model.name={args.model}",
        f"train.batch_size={args.batch_size}", f"train.local_epochs={args.local_epochs}", "train.lr=0.01",
        "train.momentum=0.9", "runtime.progress=false", "runtime.checkpoint_every=0", f"data.augment={args.augment}",
        *VARIANTS[args.variant]]))
    server, _, _ = exp.setup_round(exp.initial_server())
    clients: dict = {}
    if args.round == 2:
        server = exp.round(server, clients, 1, Reporter())["_server"]  # warm-up: graphs captured
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        exp.round(server, clients, args.round, Reporter())
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()

    def count(*names: str) -> tuple[int, float]:
        hits = [e for e in events if e.key in names]
        return sum(e.count for e in hits), sum(e.cpu_time_total for e in hits) / 1e3

    replays, _ = count("cudaGraphLaunch")
    syncs, sync_ms = count("cudaStreamSynchronize", "cudaDeviceSynchronize")
    launches, _ = count("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
    h2d = sum(e.count for e in events if "HtoD" in e.key)
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.device_time_total for e in kernels) / 1e3
    samples = sum(exp.data.client_sizes) * args.local_epochs
    lines = [
        f"## {args.variant}, {args.model}, {args.clients} clients, batch {args.batch_size}, "
        f"{args.local_epochs} epoch(s), round {args.round} on {torch.cuda.get_device_name()} "
        f"(torch {torch.__version__})", "",
        f"`python benchmarks/profile_round.py --model {args.model} --clients {args.clients} --batch-size "
        f"{args.batch_size} --local-epochs {args.local_epochs} --variant {args.variant} --round {args.round} "
        f"--augment {args.augment}`", "",
        "| round wall (ms) | samples/s | graph replays | host syncs (ms) | HtoD copies | launches outside graphs "
        "| GPU busy |",
        "|---|---|---|---|---|---|---|",
        f"| {wall * 1e3:.0f} | {samples / wall:,.0f} | {replays} | {syncs} ({sync_ms:.0f}) | {h2d} | {launches} | "
        f"{min(1.0, gpu_ms / 1e3 / wall):.0%} |", "",
        f"GPU time by kind ({sum(e.count for e in kernels):,} kernels):", "",
        "| kind | kernels | GPU ms | share |", "|---|---|---|---|",
    ]
    kinds: dict[str, list[float]] = {}
    for e in kernels:
        entry = kinds.setdefault(kernel_kind(e.key), [0, 0.0])
        entry[0] += e.count
        entry[1] += e.device_time_total / 1e3
    for kind, (n, ms) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {kind} | {int(n):,} | {ms:.1f} | {ms / max(gpu_ms, 1e-9):.0%} |")
    lines += build_phases(events, wall)
    lines += ["", "Top kernels by GPU time:", "", "| kernel | calls | GPU ms | share |", "|---|---|---|---|"]
    for e in sorted(kernels, key=lambda e: -e.device_time_total)[:12]:
        lines.append(f"| `{e.key[:90]}` | {e.count} | {e.device_time_total / 1e3:.1f} | "
                     f"{e.device_time_total / 1e3 / max(gpu_ms, 1e-9):.0%} |")
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    out = Path(args.out) / "profile_cuda.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    header = "" if out.exists() else "# Profiles of one vectorised round (benchmarks/profile_round.py)\n\n"
    with out.open("a") as f:
        f.write(header + text + "\n")


if __name__ == "__main__":
    main()
