"""How the linear layer's form changes a vmapped step's host time, kernels and copies (CPU).

One vmapped local step (``vmap(grad(loss))``, forward and backward, no optimiser) of simple_cnn for
K clients with their own weights, inside ``layers.client_batching`` as the vectorised executor runs
it, with its five linear layers in three forms:

- ``tree``: the tree's ``hetfl.models.layers.Linear`` (run this script with an older tree's ``src`` on
  ``PYTHONPATH`` to measure that tree's form: before session 18, a custom ``autograd.Function`` rule);
- ``product_then_bias``: ``F.linear(x, w) + b`` (the bias cast to the product's dtype), spelled here;
- ``addmm``: ``F.linear(x, w, b)``, PyTorch's own batching rule for ``addmm``.

The forms are timed interleaved (``--repeats`` rounds of ``--steps`` steps each, one thread), and the
median per step is reported with the non-view ATen operations a step dispatches (each a kernel on a
GPU), the MB its layout copies write, and whether its gradients equal the tree's bit for bit. Appends
to ``benchmarks/results/layer_forms_cpu.md``.

    python benchmarks/layer_forms.py --batch-sizes 2 64
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
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from hetfl.algorithms.base import cross_entropy
from hetfl.models import build_model, layers
from hetfl.models.layers import client_batching

sys.path.insert(0, str(Path(__file__).parent))
from step_ops import StepCounter


def product_then_bias(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if not layers._client_batching() or self.bias is None or x.dim() != 2:
        return F.linear(x, self.weight, self.bias)
    product = F.linear(x, self.weight)
    return product + self.bias.to(product.dtype)


def addmm(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, self.weight, self.bias)


FORMS = {"tree": layers.Linear.forward, "product_then_bias": product_then_bias, "addmm": addmm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[2, 64])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--label", default="", help="what tree this is")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("simple_cnn", (3, 32, 32), 10)
    k = args.clients
    stacked = {n: (p.detach().unsqueeze(0) + 0.01 * torch.randn(k, *p.shape)).contiguous()
               for n, p in model.named_parameters()}

    def loss(params, x, y):  # type: ignore[no-untyped-def]
        return cross_entropy(functional_call(model, params, (x,)), y)

    rows = []
    for batch in args.batch_sizes:
        x, y = torch.randn(k, batch, 3, 32, 32), torch.randint(0, 10, (k, batch))

        def step(form: str, x: torch.Tensor = x, y: torch.Tensor = y) -> dict[str, torch.Tensor]:
            layers.Linear.forward = FORMS[form]  # type: ignore[method-assign]
            try:
                with client_batching():
                    return vmap(grad(loss))(stacked, x, y)
            finally:
                layers.Linear.forward = FORMS["tree"]  # type: ignore[method-assign]

        reference = step("tree")
        times: dict[str, list[float]] = {form: [] for form in FORMS}
        for _ in range(args.repeats):
            for form in FORMS:  # interleaved: a drift in the machine's load reaches every form alike
                step(form)
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step(form)
                times[form].append((time.perf_counter() - t0) / args.steps * 1e3)
        for form in FORMS:
            counter = StepCounter()
            with counter:
                got = step(form)
            rows.append({"batch": batch, "form": form, "ms": statistics.median(times[form]),
                         "ops": sum(counter.ops.values()), "cloned_mb": counter.cloned / 1e6,
                         "equal": all(torch.equal(got[n], reference[n]) for n in reference)})
            print(rows[-1], flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [f"`python benchmarks/layer_forms.py --clients {k} --batch-sizes {' '.join(map(str, args.batch_sizes))} "
             f"--steps {args.steps} --repeats {args.repeats}` at {commit}"
             f"{': ' + args.label if args.label else ''}; {platform.processor() or 'cpu'}, 1 thread, "
             f"torch {torch.__version__}", "",
             "| batch | linear form | ms a step (median) | vs tree | ops a step | copies (MB) | gradients = tree's |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        tree = next(t for t in rows if t["batch"] == r["batch"] and t["form"] == "tree")
        lines.append(f"| {r['batch']} | {r['form']} | {r['ms']:.2f} | {r['ms'] / tree['ms']:.2f} | {r['ops']} | "
                     f"{r['cloned_mb']:.2f} | {'yes' if r['equal'] else 'no'} |")
    path = Path(args.out) / "layer_forms_cpu.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "" if path.exists() else ("# The linear layer's form in a vmapped step (benchmarks/layer_forms.py)\n\n"
                                       "simple_cnn, its five linear layers per client; `tree` = the measured tree's "
                                       "`layers.Linear`.\n\n")
    with path.open("a") as f:
        f.write(header + "\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()
