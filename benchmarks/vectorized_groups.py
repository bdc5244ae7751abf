"""How many vectorised groups each method's sampled rounds split into (a GPU runs a round's groups one after another).

Every registered method, vmapped (``runtime.vmap_on_cpu``), a few rounds of Synthetic(1, 1) with a few of its
30 clients sampled a round: the number of clients of each ``VectorizedGroup`` a round ran. One group per round
is the aim: clients whose steps read different structures (``Algorithm.step_reads``) cannot share one.

    python benchmarks/vectorized_groups.py --rounds 4 --clients-per-round 6
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from hetfl import config
from hetfl.algorithms import available
from hetfl.engine import experiment as experiment_module
from hetfl.engine import vectorized
from hetfl.engine.experiment import Experiment


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--clients-per-round", type=int, default=6)
    parser.add_argument("--methods", nargs="+", default=None)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    sizes: list[int] = []
    real_run = vectorized.VectorizedGroup.run

    def run(self):  # type: ignore[no-untyped-def]
        sizes.append(len(self.plans))
        return real_run(self)

    vectorized.VectorizedGroup.run = run  # type: ignore[method-assign]
    real_train = experiment_module.train_clients_vectorized
    rows = []
    for method in args.methods or available():
        rounds: list[list[int]] = []

        def train(*a, rounds=rounds, **k):  # type: ignore[no-untyped-def]
            sizes.clear()
            out = real_train(*a, **k)
            rounds.append(list(sizes))
            return out

        experiment_module.train_clients_vectorized = train  # type: ignore[assignment]
        cfg = config.load(None, [
            f"algorithm.name={method}", f"train.rounds={args.rounds}", "data.options={max_samples = 150}",
            f"train.clients_per_round={args.clients_per_round}", "model.options={hidden = [16]}",
            "train.local_steps=3", "runtime.progress=false", "runtime.executor=vectorized",
            "runtime.vmap_on_cpu=true", *(["algorithm.pers_cycles=1"] if method == "fedetf" else [])])
        with tempfile.TemporaryDirectory() as folder:
            Experiment(cfg).run(Path(folder) / "run")
        experiment_module.train_clients_vectorized = real_train
        rows.append((method, rounds))
        print(method, rounds, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    split = [m for m, r in rows if any(len(groups) > 1 for groups in r)]
    lines = [f"`python benchmarks/vectorized_groups.py --rounds {args.rounds} --clients-per-round "
             f"{args.clients_per_round}` at {commit} (CPU, vmapped anyway)", "",
             "| method | clients of each group, round by round |", "|---|---|"]
    lines += [f"| {m} | {' '.join(str(g) for g in r)} |" for m, r in rows]
    lines += ["", f"Methods whose rounds split into more than one group: {', '.join(split) or 'none'}."]
    path = Path(args.out) / "vectorized_groups_cpu.md"
    header = "" if path.exists() else \
        "# Vectorised groups a sampled round splits into (benchmarks/vectorized_groups.py)\n\n"
    with path.open("a", encoding="utf-8") as f:
        f.write(header + "\n".join(lines) + "\n\n")
    print(f"appended to {path}")


if __name__ == "__main__":
    main()
