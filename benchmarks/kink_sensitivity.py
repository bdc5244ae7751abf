"""How far a method's round moves when its ReLUs' inputs carry rounding-sized noise (CPU, sequential clients).

The executor comparison on CUDA (``tests/engine/test_vectorized_static.py::
test_every_method_vectorises_on_cuda_as_on_the_cpu``) found DANN's vectorised and sequential clients 2.2e-4
apart after a round, on an H100 (session 17) and an H200 (session 45), where FedAvg's agree to 1e-7. This
reproduces the effect on the CPU without vectorising anything: the same round of sequential clients, once
plainly and once with every ``F.relu`` input multiplied by ``1 + rel * N(0, 1)`` (a stand-in for another
kernel's rounding), printing the largest parameter difference, the client and the tensor it is in. A
difference that grows in proportion to ``rel`` is rounding carried along; one that jumps, the same at
several ``rel``, is a hidden unit whose pre-activation (4.8e-7 for DANN's) crosses the ReLU's kink: its
gradient flows, or does not, for one sample, and the round moves by a learning rate times that gradient.

    python benchmarks/kink_sensitivity.py --methods dann fedavg --rel 1e-6 3e-6 1e-5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers.executors import SYNTHETIC, round_contexts

from hetfl import config
from hetfl.engine.experiment import Experiment
from hetfl.engine.local import train_client
from hetfl.engine.summary import Reporter

#: the comparison's setting (test_vectorized_static.py's SMALL): 30 synthetic devices, one local epoch
SMALL = [*SYNTHETIC, "train.local_epochs=1", "train.momentum=0.5"]


def second_round(exp: Experiment, server, rel: float) -> list:
    """Round 2's clients trained one after another, with ``rel`` noise at every ReLU input (0: none)."""
    relu = F.relu
    generator = torch.Generator().manual_seed(3)
    if rel:
        F.relu = lambda z, inplace=False: relu(z * (1 + rel * torch.randn(z.shape, generator=generator)))
    try:
        return [train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
                for ctx in round_contexts(exp, server, {}, 2)]
    finally:
        F.relu = relu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=["dann", "fedavg"])
    parser.add_argument("--rel", nargs="+", type=float, default=[1e-7, 1e-6, 3e-6, 1e-5])
    args = parser.parse_args()
    print("| method | relative noise | largest difference | client (its steps) | tensor |")
    print("|---|---|---|---|---|")
    for method in args.methods:
        exp = Experiment(config.load(None, [*SMALL, f"algorithm.name={method}"]))
        server, _, _ = exp.setup_round(exp.initial_server())
        server = exp.round(server, {}, 1, Reporter())["_server"]
        plain = second_round(exp, server, 0.0)
        for rel in args.rel:
            noisy = second_round(exp, server, rel)
            diff, client, steps, name = max(
                ((a.state[n].double() - b.state[n].double()).abs().max().item(), i, a.steps, n)
                for i, (a, b) in enumerate(zip(plain, noisy, strict=True))
                for n in a.state if a.state[n].is_floating_point())
            print(f"| {method} | {rel:.0e} | {diff:.2e} | {client} ({steps}) | `{name}` |")


if __name__ == "__main__":
    main()
