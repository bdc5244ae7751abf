"""What a SuperNode that dies mid-run costs a real Flower deployment, with and without a grace.

Starts the README's local deployment (``examples/flower/deploy.py``: a SuperLink and one SuperNode per client,
separate processes on the loopback), SIGKILLs client 2's SuperNode when round 1 is reported, and reads each
round's wall time (``round_time_s``) and failed clients from the run's ``metrics.jsonl``. Once with
``runtime.flower_grace_s = inf`` (the default: a phase waits for every reply, up to ``runtime.flower_timeout_s``,
so the dead node is waited for until Flower reports it gone), once with each ``--grace`` given.

    python benchmarks/flower_dead_node.py --out benchmarks/results/flower_dead_node_cpu.md
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "examples" / "flower" / "deploy.py"
SETTING = ["data.num_clients=3", "data.partition=dirichlet", "train.batch_size=16", "train.local_steps=10",
           "model.options={hidden = [16]}", "runtime.progress=false", "runtime.threads=1", "algorithm.name=fedavg",
           "runtime.flower_min_replies=2", "runtime.flower_timeout_s=600"]


def deployed_run(grace: str, rounds: int, work: Path) -> tuple[list[dict], float]:
    spec = importlib.util.spec_from_file_location("hetfl_deploy_example", DEPLOY)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    feds = []

    class Recorded(script.LocalFederation):
        def start(self):
            feds.append(self)
            return super().start()

    def say(message: str) -> None:
        print(f"  [{grace}] {message}", flush=True)
        if message.startswith(f"round 1/{rounds}: "):
            feds[0].nodes[2].kill(signal.SIGKILL)

    script.LocalFederation, script.say = Recorded, say
    sets = [*SETTING, f"train.rounds={rounds}", f"runtime.flower_grace_s={grace}"]
    begin = time.perf_counter()
    code = script.main([*[f"--set={x}" for x in sets], "--out", str(work / "run"), "--workdir",
                        str(work / "federation"), "--insecure", "--timeout", "900"])
    wall = time.perf_counter() - begin
    if code != 0:
        raise SystemExit(f"the deployment with grace {grace} exited {code}")
    lines = (work / "run" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines], wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grace", nargs="+", default=["3"], help="grace values to compare with inf")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="a Markdown file for the table")
    args = parser.parse_args(argv)
    rows = []
    for grace in ["inf", *args.grace]:
        with tempfile.TemporaryDirectory() as tmp:
            got, wall = deployed_run(grace, args.rounds, Path(tmp))
        rows.append((grace, got, wall))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    head = "| `runtime.flower_grace_s` | " + " | ".join(f"round {r + 1} (s)" for r in range(args.rounds)) + \
        " | failed clients by round | final accuracy | deployment wall (s) |"
    table = [head, "|" + "---|" * (args.rounds + 4)]
    for grace, got, wall in rows:
        times = " | ".join(f"{x['round_time_s']:.1f}" for x in got)
        acc = next((x["global_acc"] for x in reversed(got) if x.get("global_acc") is not None), float("nan"))
        table.append(f"| {grace} | {times} | {[x['failed_clients'] for x in got]} | {acc:.4f} | {wall:.0f} |")
    text = "\n".join([
        "# A SuperNode killed mid-run: each round's wall time with and without a grace",
        "",
        f"`python benchmarks/flower_dead_node.py {' '.join(argv if argv is not None else sys.argv[1:])}` at "
        f"{commit}, {platform.node() or 'this machine'} ({os.cpu_count()} CPU cores, "
        f"torch {torch.__version__}, Python {platform.python_version()})",
        "",
        "3 clients (Synthetic data, an MLP, 10 local steps), one SuperNode each on the loopback; client 2's node "
        "SIGKILLed when round 1 is reported; `runtime.flower_min_replies = 2`, `runtime.flower_timeout_s = 600`.",
        "",
        *table, ""])
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
