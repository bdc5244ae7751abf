"""pFedMe's inner step size on FedPAC's CNN: the quick variant of fedpac-cifar10's pFedMe run with a given
``algorithm.personal_lr`` (session 28; benchmarks/results/pfedme_fedpac_cnn.md).

    python benchmarks/pfedme_step_check.py 0.01 --data ../shared/datasets/cifar10-jpeg.tar.gz
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hetfl import reproduce
from hetfl.engine.experiment import Experiment


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("personal_lr", type=float)
    parser.add_argument("--data", default="../shared/datasets/cifar10-jpeg.tar.gz")
    parser.add_argument("--out", default="runs/pfedme-step-check")
    args = parser.parse_args()
    preset = reproduce.load_preset("fedpac-cifar10").variant(True)
    spec = next(s for s in set(reproduce.run_specs(preset).values()) if s.algorithm == "pfedme")
    cfg = reproduce.build_config(preset, spec, [f"data.root={args.data}", f"algorithm.personal_lr={args.personal_lr}"])
    summary = Experiment(cfg).run(Path(args.out) / f"lr-{args.personal_lr:g}")
    print(f"personal_lr {args.personal_lr:g}: final client_acc_mean {100 * summary['final_client_acc_mean']:.2f} %, "
          f"{summary['wall_time_s']:.0f} s")


if __name__ == "__main__":
    main()
