"""Why the vectorised executor trains clients one at a time on a CPU: a profile.

One local step (forward, backward; no optimiser) of K clients, each with its
own weights and a batch of B samples, computed four ways side by side in one
process:

- ``sequential``: K autograd steps one after another (hetfl's sequential executor);
- ``sequential_func``: the same with ``torch.func.grad`` (what vmap wraps);
- ``vmap``: one ``vmap(grad(loss))`` over the stacked weights (the vectorised executor);
- ``ceiling``: one model on a batch of K*B samples (no per-client weights).

and the operator that makes the difference: a convolution of K clients as one
grouped convolution (what vmap's batching rule for ``conv2d`` with batched
weights lowers to) against K separate convolutions, forward and backward.
The operators where the vmapped step spends its time are listed from
``torch.profiler``. Writes ``benchmarks/results/vmap_cpu_profile.{json,md}``.

    python benchmarks/vmap_cpu_profile.py [--threads 2] [--clients 10] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap
from torch.profiler import profile

from hetfl.models import build_model

MODELS = {"simple_cnn": (3, 32, 32), "cnn2": (1, 28, 28), "mlp": (1, 28, 28)}


def seconds(fn: Callable[[], object], repeat: int) -> float:
    """Median wall time of ``fn`` over ``repeat`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def step_timings(model_name: str, k: int, b: int, repeat: int) -> tuple[dict[str, float], list[list]]:
    shape = MODELS[model_name]
    torch.manual_seed(0)
    model = build_model(model_name, shape, 10)
    params = {n: p.detach() for n, p in model.named_parameters()}
    x, y = torch.randn(k, b, *shape), torch.randint(0, 10, (k, b))
    stacked = {n: p.unsqueeze(0).repeat(k, *([1] * p.dim())) for n, p in params.items()}

    def loss(p: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, p, (xb,)), yb)

    def sequential() -> None:
        for c in range(k):
            leaves = {n: t.clone().requires_grad_() for n, t in params.items()}
            torch.autograd.grad(loss(leaves, x[c], y[c]), list(leaves.values()))

    def sequential_func() -> None:
        for c in range(k):
            grad(loss)(params, x[c], y[c])

    def vmapped() -> None:
        vmap(grad(loss))(stacked, x, y)

    def ceiling() -> None:
        leaves = {n: t.clone().requires_grad_() for n, t in params.items()}
        torch.autograd.grad(loss(leaves, x.view(k * b, *shape), y.view(-1)), list(leaves.values()))

    out = {f.__name__: seconds(f, repeat) for f in (sequential, sequential_func, vmapped, ceiling)}
    with profile() as prof:
        vmapped()
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:6]
    ops = [[e.key, e.count, round(e.self_cpu_time_total / 1e3, 2)] for e in top]
    return out, ops


def conv_timings(k: int, b: int, repeat: int) -> list[dict[str, float | int]]:
    """K clients' convolutions (forward + weight gradient) as one grouped conv vs K convs."""
    rows = []
    for c_in, c_out, hw in ((3, 6, 32), (6, 16, 14), (32, 64, 14)):
        torch.manual_seed(0)
        x = torch.randn(b, k * c_in, hw, hw)
        w = torch.randn(k * c_out, c_in, 5, 5, requires_grad=True)
        xs = list(x.view(b, k, c_in, hw, hw).unbind(1))
        ws = [torch.randn(c_out, c_in, 5, 5, requires_grad=True) for _ in range(k)]

        def grouped(x: torch.Tensor = x, w: torch.Tensor = w) -> None:
            F.conv2d(x, w, groups=k).sum().backward()

        def separate(xs: list = xs, ws: list = ws) -> None:
            for xc, wc in zip(xs, ws, strict=True):
                F.conv2d(xc, wc).sum().backward()

        rows.append({"in": c_in, "out": c_out, "hw": hw, "grouped_s": seconds(grouped, repeat),
                     "separate_s": seconds(separate, repeat)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    k, b = args.clients, args.batch
    steps = {}
    for name in MODELS:
        timing, ops = step_timings(name, k, b, args.repeat)
        steps[name] = {"seconds": timing, "vmap_top_ops_ms": ops}
        print(name, json.dumps(timing), flush=True)
    convs = conv_timings(k, b, args.repeat)
    machine = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "torch": torch.__version__}
    command = f"python benchmarks/vmap_cpu_profile.py --threads {args.threads} --clients {k} --batch {b}"
    result = {"machine": machine, "command": command, "clients": k, "batch": b, "steps": steps, "convs": convs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vmap_cpu_profile.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# vmap on the CPU: one local step of K clients, four ways", "",
        f"Machine: {machine['cpu']}, {machine['threads']} threads, torch {machine['torch']}. "
        f"K = {k} clients, batch {b}. Command: `{command}`.", "",
        "| model | sequential (autograd) | sequential (torch.func) | vmap | ceiling (one model, K*B batch) "
        "| vmap / sequential speed |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in steps.items():
        t = s["seconds"]
        lines.append(f"| {name} | {t['sequential']:.4f} s | {t['sequential_func']:.4f} s | {t['vmapped']:.4f} s "
                     f"| {t['ceiling']:.4f} s | {t['sequential'] / t['vmapped']:.2f}x |")
    lines += ["", "Where the vmapped step spends its time (self CPU ms, top operators):", ""]
    for name, s in steps.items():
        ops = ", ".join(f"{op} x{n}: {ms}" for op, n, ms in s["vmap_top_ops_ms"])
        lines.append(f"- {name}: {ops}")
    lines += ["", "K convolutions (5x5, forward + backward) as one grouped convolution vs K separate ones:", "",
              "| in | out | size | grouped | separate | grouped / separate time |", "|---|---|---|---|---|---|"]
    for r in convs:
        lines.append(f"| {r['in']} | {r['out']} | {r['hw']} | {r['grouped_s']:.4f} s | {r['separate_s']:.4f} s "
                     f"| {r['grouped_s'] / r['separate_s']:.2f} |")
    (out / "vmap_cpu_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
