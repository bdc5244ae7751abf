"""The sequential executor's rounds with its in-place SGD update beside the functional one, in one process.

Since session 24 a client's own training (:func:`hetfl.engine.local.run_stages`) updates its parameters and
momentum buffers in place (:func:`hetfl.engine.local.sgd_step_`, multi-tensor kernels); before, every step
built new tensors (:func:`hetfl.engine.local.sgd_step`, four per parameter with momentum). Both give the same
values to the bit (``tests/engine/test_engine.py``). This script times whole training rounds of the sequential
executor (evaluation excluded) with each, alternating them round after round on the same experiment, so that
both see the same machine state, and prints the median and best seconds of each and their ratio.

    python benchmarks/sequential_update.py --data ../shared/datasets --models cnn2 simple_cnn --batch-size 10
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path
from unittest import mock

import torch

from hetfl import config
from hetfl.engine import local
from hetfl.engine.experiment import Experiment
from hetfl.engine.summary import Reporter


def functional_step_(stage, state, opt_state, batch, ctx, first_step, max_grad_norm=0.0, buffers=(),  # type: ignore[no-untyped-def]
                     precision="fp32"):
    """The update as it was before session 24: :func:`hetfl.engine.local.sgd_step`'s new tensors, put in
    the caller's dicts (``sgd_step_``'s interface)."""
    new, opt, loss, metrics = local.sgd_step(stage, state, opt_state, batch, ctx, first_step, max_grad_norm,
                                             buffers=buffers, precision=precision)
    metrics = {k: v.clone() for k, v in metrics.items()}
    state.update(new)
    opt_state.update(opt)
    return loss, metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/datasets")
    parser.add_argument("--models", nargs="+", default=["cnn2", "simple_cnn"])
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--local-steps", type=int, default=30, help="steps a client trains each round")
    parser.add_argument("--repeats", type=int, default=6, help="timed rounds of each update, alternated")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="", help="append the results as JSON lines to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for model in args.models:
        cfg = config.load(None, [
            "data.dataset=cifar10", f"data.root={args.data}/cifar10-jpeg.tar.gz", "data.partition=dirichlet",
            "data.alpha=0.1", f"data.num_clients={args.clients}", f"model.name={model}",
            f"train.batch_size={args.batch_size}", f"train.local_steps={args.local_steps}", "train.lr=0.01",
            "train.momentum=0.9", "data.augment=none", "runtime.executor=sequential", "runtime.progress=false",
            "runtime.checkpoint_every=0", f"runtime.threads={args.threads}"])
        exp = Experiment(cfg)
        server, _, _ = exp.setup_round(exp.initial_server())
        clients: dict = {}
        seconds: dict[str, list[float]] = {"in_place": [], "functional": []}
        for r in range(1, 2 * args.repeats + 2):
            name = "in_place" if r % 2 else "functional"
            patch = mock.patch.object(local, "sgd_step_", functional_step_) if name == "functional" \
                else contextlib.nullcontext()  # the executor's own update
            with patch:
                t0 = time.perf_counter()
                out = exp.round(server, clients, r, Reporter())
                if r > 1:  # round 1 warms up both (the first call of every kernel)
                    seconds[name].append(time.perf_counter() - t0)
            server = out["_server"]
        median = {k: statistics.median(v) for k, v in seconds.items()}
        row = {"model": model, "batch_size": args.batch_size, "clients": args.clients,
               "local_steps": args.local_steps, "threads": args.threads,
               "median_round_s": median, "best_round_s": {k: min(v) for k, v in seconds.items()},
               "functional_over_in_place": median["functional"] / median["in_place"],
               "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
               "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()}
        print(json.dumps(row), flush=True)
        if args.out:
            with Path(args.out).open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
