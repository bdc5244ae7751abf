"""How far apart are the vectorised and the sequential clients of a method on a GPU, and why?

``tests/engine/test_vectorized_static.py::test_every_method_vectorises_on_cuda_as_on_the_cpu`` compares
one round of both executors on CUDA to 1e-4. On an H100 (session 17) DANN's domain head ended 2.2e-4
apart, while on the CPU the two agree to 4e-8 and a last-bit change of DANN's start moves its round by
9e-8 (not a chaotic method, unlike FedDecorr). This prints, per method and number of local steps, the
largest parameter difference of:

- ``vec``: the vectorised clients against the sequential ones (what the test checks);
- ``seq_again``: the sequential clients against themselves, run twice (nondeterministic kernels);
- ``vec_no_tf32``: ``vec`` with TF32 off for cuDNN and cuBLAS (a difference that TF32 makes vanishes);

so that a difference that grows step by step (rounding, amplified), one that is there after one step (a
different computation), and one from TF32 or nondeterminism can be told apart. CUDA only (on a CPU it
runs, as a smoke test).

    python benchmarks/cuda_equality.py --methods dann fedavg --steps 1 2 5 10
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers.executors import SYNTHETIC, round_contexts

from hetfl import config
from hetfl.engine.experiment import Experiment
from hetfl.engine.local import train_client
from hetfl.engine.summary import Reporter
from hetfl.engine.vectorized import train_clients_vectorized


def largest_difference(a: list, b: list) -> tuple[float, str]:
    return max(((x.state[n].double() - y.state[n].double()).abs().max().item(), n)
               for x, y in zip(a, b, strict=True) for n in x.state)


def compare(method: str, steps: int, device: str) -> dict[str, tuple[float, str]]:
    exp = Experiment(config.load(None, [*SYNTHETIC, "train.local_epochs=1", "train.momentum=0.5",
                                        f"algorithm.name={method}", f"runtime.device={device}",
                                        f"train.local_steps={steps}"]))
    server, _, _ = exp.setup_round(exp.initial_server())
    clients: dict = {}
    server = exp.round(server, clients, 1, Reporter())["_server"]

    def sequential() -> list:
        return [train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
                for ctx in round_contexts(exp, server, clients, 2)]

    def vectorised() -> list:
        return train_clients_vectorized(exp.algorithm, round_contexts(exp, server, clients, 2), exp.data,
                                        seed=exp.cfg.seed, train_cfg=exp.cfg.train)

    seq = sequential()
    out = {"vec": largest_difference(seq, vectorised()), "seq_again": largest_difference(seq, sequential())}
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        out["vec_no_tf32"] = largest_difference(sequential(), vectorised())
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=["dann", "fedavg"])
    parser.add_argument("--steps", nargs="+", type=int, default=[1, 2, 5, 10])
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}")
    print("| method | local steps | vec | seq_again | vec_no_tf32 |\n|---|---|---|---|---|")
    for method in args.methods:
        for steps in args.steps:
            d = compare(method, steps, device)
            cells = " | ".join(f"{d[k][0]:.2e} ({d[k][1]})" for k in ("vec", "seq_again", "vec_no_tf32"))
            print(f"| {method} | {steps} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
