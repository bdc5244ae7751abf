"""How a training step's time depends on torch's CPU thread count, by the step's size.

One local SGD step (forward, cross-entropy, backward, update) of hetfl's models at the usual batch
sizes, timed on each thread count given (median of the steps after two warm-ups, at most
``--seconds`` per case), beside the step's forward FLOPs as ``runtime.threads = 0`` (auto) counts
them (:func:`hetfl.engine.threads.forward_flops`). The auto rule uses one thread below
``ONE_THREAD_BELOW_FLOPS``: this table is where that number comes from. Prints a markdown table.

    python benchmarks/threads.py [--threads 1 2] [--seconds 2]
    taskset -c 0,1 python benchmarks/threads.py      # as on a 2-core machine
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from hetfl.engine.threads import ONE_THREAD_BELOW_FLOPS, forward_flops
from hetfl.models import build_model

#: (model, options, input shape, batch size): the default models of the datasets, smallest first
CASES = [
    ("mlp", {"hidden": []}, (60,), 32),             # Synthetic's default: logistic regression
    ("mlp", {"hidden": [200, 200]}, (784,), 32),
    ("simple_cnn", {}, (3, 32, 32), 32),
    ("simple_cnn", {}, (3, 32, 32), 64),
    ("cnn2", {}, (1, 28, 28), 32),
    ("fedpac_cnn", {}, (3, 32, 32), 64),
    ("cnn2", {}, (1, 28, 28), 64),
    ("vgg11", {}, (3, 32, 32), 32),
    ("resnet18", {"norm": "gn"}, (3, 32, 32), 32),
]


def step_seconds(name: str, options: dict, shape: tuple[int, ...], batch: int, budget_s: float) -> float:
    """Median seconds of one SGD step of a fresh model on a random batch."""
    torch.manual_seed(0)
    model = build_model(name, shape, 10, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 32 and (len(times) < 5 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seconds", type=float, default=2.0, help="at most this long per case and count")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"{platform.machine()}, {cores} cores usable, torch {torch.__version__}, load average "
          f"{os.getloadavg()[0]:.1f}; auto uses one thread below {ONE_THREAD_BELOW_FLOPS:.0e} forward FLOPs/step\n")
    counts = " | ".join(f"{t} thr ms" for t in args.threads)
    print(f"| model | batch | fwd FLOPs/step | {counts} | best |")
    print("|---|---|---|" + "---|" * len(args.threads) + "---|")
    for name, options, shape, batch in CASES:
        flops = (forward_flops(build_model(name, shape, 10, **options), shape) or 0) * batch
        ms = {}
        for count in args.threads:
            torch.set_num_threads(count)
            ms[count] = 1e3 * step_seconds(name, options, shape, batch, args.seconds)
        label = f"{name} {options or ''}".strip()
        cells = " | ".join(f"{ms[t]:.2f}" for t in args.threads)
        print(f"| {label} | {batch} | {flops:.2e} | {cells} | {min(ms, key=ms.get)} |", flush=True)


if __name__ == "__main__":
    main()
