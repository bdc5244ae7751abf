"""Cross-device scale: set-up time, seconds per round, peak memory and bytes written per round
at 1,000 / 10,000 / 100,000 devices.

The workload: FedProx's Synthetic(1, 1) with N devices, one client per device (the natural
partition), 100 clients a round, the 2-hidden-layer MLP, every other setting hetfl's default
(evaluation and a checkpoint every round). Each N runs in a fresh process (so that peak RSS and
set-up are its own), which reports:

* set-up: seconds from the process's start (its start time in ``/proc/self/stat``) to the
  first round's start, and the part of it spent building the experiment (data, partition,
  federated data, model);
* seconds per round: mean ``round_time_s`` of ``metrics.jsonl`` over rounds 2.. (round 1 also
  pays one-off costs), and the evaluation's share;
* peak RSS (``ru_maxrss``) and the data's own size (bytes of the train and test arrays:
  features, labels, device ids), and their ratio;
* bytes per round of ``metrics.jsonl`` and of ``client_metrics.jsonl``.

Results are appended to ``benchmarks/results/device_scale_<device>.{json,md}`` with the command,
the machine and its load. ``--src DIR`` runs another checkout's ``src`` (e.g. ``git archive``
of an older commit) for a before/after comparison; ``--profile`` adds the set-up's top
functions by cumulative time (cProfile) to the markdown.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/device_scale.py --devices 1000 10000 --rounds 20
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/device_scale.py --devices 100000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def process_start_time() -> float:
    """This process's start as a ``time.time()`` value (field 22 of /proc/self/stat, in clock ticks after boot)."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def overrides(devices: int, rounds: int, extra: list[str]) -> list[str]:
    return [
        "data.dataset=synthetic", f"data.options={{num_devices = {devices}}}", f"data.num_clients={devices}",
        "train.clients_per_round=100", "model.name=mlp", f"train.rounds={rounds}", "runtime.threads=1",
        "runtime.progress=false", *extra,
    ]


def child(devices: int, rounds: int, extra: list[str], profile: bool) -> dict[str, Any]:
    """One measurement in this (fresh) process."""
    import cProfile
    import io
    import pstats
    import resource

    from hetfl import config
    from hetfl.engine.experiment import Experiment
    from hetfl.engine.summary import Reporter

    started = process_start_time()

    class FirstRound(Reporter):
        at: float | None = None

        def round_start(self, round_: int, num_clients: int) -> None:
            if self.at is None:
                self.at = time.time()

    cfg = config.load(None, overrides(devices, rounds, extra))
    profiler = cProfile.Profile() if profile else None
    t0 = time.time()
    if profiler:
        profiler.enable()
    exp = Experiment(cfg)
    if profiler:
        profiler.disable()
    built = time.time() - t0
    setup_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
    ds = exp.dataset
    data_bytes = sum(t.numel() * t.element_size() for s in (ds.train, ds.test)
                     for t in (s.x, s.y, s.group) if t is not None)
    reporter = FirstRound()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        exp.run(run, reporter=reporter)
        lines = [json.loads(raw) for raw in (run / "metrics.jsonl").read_text().splitlines()]
        metrics_bytes = (run / "metrics.jsonl").stat().st_size
        clients_file = run / "client_metrics.jsonl"
        client_bytes = clients_file.stat().st_size if clients_file.exists() else 0
        client_rows = len(clients_file.read_text().splitlines()) if clients_file.exists() else 0
    later = lines[1:] or lines
    out = {
        "devices": devices, "rounds": rounds, "samples": len(ds.train.y) + len(ds.test.y),
        "setup_s": round((reporter.at or time.time()) - started, 2), "build_s": round(built, 2),
        "round_s": round(sum(m["round_time_s"] for m in later) / len(later), 3),
        "eval_s": round(sum(m.get("eval_time_s", 0.0) for m in later) / len(later), 3),
        "round1_s": lines[0]["round_time_s"],
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3, 1),
        "setup_peak_rss_mb": round(setup_peak, 1),
        "data_mb": round(data_bytes / 1e6, 1),
        "metrics_bytes_per_round": round(metrics_bytes / len(lines)),
        "client_metrics_bytes_per_row": round(client_bytes / client_rows) if client_rows else 0,
    }
    out["rss_over_data"] = round(out["peak_rss_mb"] / out["data_mb"], 2)
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(18)
        out["profile"] = text.getvalue().split("\n", 4)[-1].strip()
    return out


def machine() -> str:
    cpu = platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def measure(devices: int, args: argparse.Namespace) -> dict[str, Any]:
    """Run one N in a fresh process (with ``--src``'s code when given); its result with the load around it."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if args.src:
        env["PYTHONPATH"] = str(Path(args.src).resolve())
    rounds = args.rounds_large if devices >= 100_000 and args.rounds_large else args.rounds
    cmd = [sys.executable, __file__, "--child", str(devices), "--rounds", str(rounds),
           *(["--profile"] if args.profile else []), *[a for s in args.set for a in ("--set", s)]]
    before = load()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        return {"devices": devices, "rounds": rounds, "error": proc.stderr.strip()[-2000:], "load_before": before}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(load_before=before, load_after=load(), code=args.src or "this checkout")
    return result


def write(results: list[dict[str, Any]], args: argparse.Namespace) -> Path:
    import torch

    RESULTS.mkdir(exist_ok=True)
    base = RESULTS / f"device_scale_{args.device_name}"
    stored = json.loads(base.with_suffix(".json").read_text()) if base.with_suffix(".json").exists() else []
    command = f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} {shlex.join([sys.executable, *sys.argv])}"
    entry = {"command": command, "machine": machine(), "torch": torch.__version__,
             "date": time.strftime("%Y-%m-%d %H:%M"), "results": results}
    stored.append(entry)
    base.with_suffix(".json").write_text(json.dumps(stored, indent=1) + "\n")
    base.with_suffix(".md").write_text(render(stored))
    return base.with_suffix(".md")


def render(stored: list[dict[str, Any]]) -> str:
    """The markdown of every stored entry (``--render`` rebuilds it from the JSON), with each entry's
    ``note`` under its table."""
    md = [
        "# Cross-device scale (Synthetic(1, 1), one client per device, 100 a round, MLP 200-200)", "",
        "Set-up: process start to the first round's start (build: the experiment object alone). Round: mean "
        "`round_time_s` over rounds 2.. (evaluation of every client and the global model each round included; "
        "eval: its share). Peak RSS: `ru_maxrss`. Data: bytes of the train and test arrays (features float32, "
        "labels and device ids int64). Bytes: per round of `metrics.jsonl`, per row of `client_metrics.jsonl`.",
        "",
    ]
    for e in stored:
        md += [f"## {e['date']}: `{e['command']}`", "", f"Machine: {e['machine']}, torch {e['torch']}", "",
               "| code | devices | samples | rounds | set-up s | build s | s/round | eval s | peak RSS MB | data MB "
               "| RSS/data | metrics B/round | client B/row | load before |",
               "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in e["results"]:
            if "error" in r:
                md.append(f"| {r.get('code', '')} | {r['devices']} | | {r['rounds']} | failed: "
                          f"{r['error'].splitlines()[-1] if r['error'] else '?'} | | | | | | | | | |")
                continue
            md.append(f"| {r['code']} | {r['devices']:,} | {r['samples']:,} | {r['rounds']} | {r['setup_s']} | "
                      f"{r['build_s']} | {r['round_s']} | {r['eval_s']} | {r['peak_rss_mb']:,} | {r['data_mb']:,} | "
                      f"{r['rss_over_data']} | {r['metrics_bytes_per_round']:,} | "
                      f"{r['client_metrics_bytes_per_row']:,} | `{r['load_before'].split('load average:')[-1]}` |")
        if e.get("note"):
            md += ["", e["note"]]
        for r in e["results"]:
            if r.get("profile"):
                md += ["", f"Set-up profile at {r['devices']:,} devices (cumulative time, top 18):", "", "```",
                       r["profile"], "```"]
        md.append("")
    return "\n".join(md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, nargs="+", default=[1000, 10_000, 100_000])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--rounds-large", type=int, default=5, help="rounds at 100,000 devices and more (0 = --rounds)")
    p.add_argument("--set", action="append", default=[], help="further KEY=VALUE overrides")
    p.add_argument("--src", default="", help="run the code of this src folder instead (before/after comparisons)")
    p.add_argument("--profile", action="store_true", help="cProfile the set-up")
    p.add_argument("--device-name", default="cpu", help="results file suffix")
    p.add_argument("--render", action="store_true", help="only rebuild the markdown from the stored JSON")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.render:
        base = RESULTS / f"device_scale_{args.device_name}"
        base.with_suffix(".md").write_text(render(json.loads(base.with_suffix(".json").read_text())))
        return
    if args.child:
        print(json.dumps(child(args.child, args.rounds, args.set, args.profile)))
        return
    results = []
    for n in args.devices:
        results.append(measure(n, args))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "profile"}), flush=True)
    print(write(results, args).read_text())


if __name__ == "__main__":
    main()
