"""Resident memory over a long run: is it flat, or does it grow every round?

Runs one experiment in this process (by default the workload of the memory issue:
FedProx's Synthetic(1, 1) with 1,000 devices, one client per device, 100 clients a
round, the 2-hidden-layer MLP, every other setting hetfl's default, so evaluation and
a checkpoint every round) and samples the process's resident set size (``/proc/self/statm``)
every ``--every`` rounds. Writes, under ``benchmarks/results/``:

* ``<name>.csv``: round, RSS in MB, seconds since the first round began;
* ``<name>.png``: the curve;
* ``<name>.md``: RSS at round 100 and at the last round, their ratio, the least-squares
  slope in kB per round over rounds >= 100, the command, the machine and its load.

On CUDA (``--set runtime.device=cuda``) every sample also records the device memory torch holds
(allocated and reserved) and, with the vectorised executor, the CUDA graphs the run keeps and has
dropped: whether a long run of sampled clients keeps its device memory flat, and what a kept graph
costs (``--set runtime.executor=vectorized``; ``benchmarks/gpu_check.sh memory``).

Diagnosis options: ``--tracemalloc A B`` diffs Python allocations between rounds A and B
(the top lines go into the markdown); ``--malloc-trim`` calls glibc's ``malloc_trim(0)``
before each sample, so that memory freed but kept by the allocator (fragmentation) is
told apart from memory still referenced (a leak).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory_long.py --rounds 2000 --every 20
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

from hetfl import config
from hetfl.engine.experiment import Experiment
from hetfl.engine.summary import Reporter

RESULTS = Path(__file__).resolve().parent / "results"
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb() -> float:
    """The resident set size of this process now, in MB (second field of /proc/self/statm, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 1e6


def rss_parts_mb() -> tuple[float, float]:
    """(anonymous, file-backed) resident memory in MB (``RssAnon``, ``RssFile`` of /proc/self/status): heap
    growth shows in the first; pages of shared libraries touched for the first time late in a run in the second."""
    parts = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                name, value, _ = line.split()
                parts[name] = int(value) / 1e3
    return parts.get("RssAnon:", float("nan")), parts.get("RssFile:", float("nan"))


def malloc_trim() -> None:
    """Give memory glibc holds free back to the system (no-op where glibc is absent)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set`` assignments of the workload."""
    n = args.devices
    return [
        "data.dataset=synthetic", f"data.options={{num_devices = {n}}}", f"data.num_clients={n}",
        f"train.clients_per_round={args.per_round}", "model.name=mlp", f"train.rounds={args.rounds}",
        f"runtime.threads={args.threads}", "runtime.progress=false", *args.set,
    ]


class Sampler(Reporter):
    """Samples RSS at the end of every ``every``-th round (and of round 1 and the last);
    snapshots Python allocations at the two ``trace`` rounds. With ``cuda`` (the run's device is CUDA)
    each sample also holds the device memory and the vectorised executor's kept and dropped graphs
    (``cache``: the experiment's :class:`~hetfl.engine.vectorized.VectorizedCache`)."""

    def __init__(self, every: int, last: int, trim: bool, trace: tuple[int, int] | None, cuda: bool = False,
                 cache: Any = None) -> None:
        self.every, self.last, self.trim, self.trace = every, last, trim, trace
        self.cuda, self.cache = cuda, cache
        self.rows: list[tuple[int, float, float]] = []
        self.parts: list[tuple[float, float]] = []
        self.device: list[tuple[float, float, int, int]] = []  # CUDA: allocated MB, reserved MB, graphs kept, dropped
        self.snapshots: dict[int, tracemalloc.Snapshot] = {}
        self.t0: float | None = None

    def round_start(self, round_: int, num_clients: int) -> None:
        if self.t0 is None:
            self.t0 = time.perf_counter()

    def round_end(self, line: dict[str, Any]) -> None:
        r = line["round"]
        if self.trace and r == self.trace[0]:  # traced from here on: what is allocated later and still held
            tracemalloc.start(1)
        if self.trace and r in self.trace:
            self.snapshots[r] = tracemalloc.take_snapshot()
        if r == 1 or r % self.every == 0 or r == self.last:
            if self.trim:
                malloc_trim()
            self.rows.append((r, rss_mb(), time.perf_counter() - (self.t0 or 0.0)))
            self.parts.append(rss_parts_mb())
            if self.cuda:
                self.device.append(device_sample(self.cache))
            if r % (self.every * 10) == 0:
                print(f"round {r}: RSS {self.rows[-1][1]:.1f} MB, {self.rows[-1][2]:.0f} s", flush=True)


def device_sample(cache: Any) -> tuple[float, float, int, int]:
    """CUDA memory torch holds now (allocated, reserved; MB) and the graphs the vectorised executor keeps
    and has dropped (0 and 0 for another executor)."""
    import torch

    programs = getattr(cache, "programs", {})
    graphs = sum(getattr(c, "graph", None) is not None for c in programs.values())
    return torch.cuda.memory_allocated() / 1e6, torch.cuda.memory_reserved() / 1e6, graphs, getattr(cache, "dropped", 0)


def slope_kb_per_round(rows: list[tuple[int, float, float]], start: int) -> float:
    """Least-squares slope of RSS over rounds >= ``start``, in kB per round."""
    pts = np.array([(r, m) for r, m, _ in rows if r >= start], dtype=np.float64)
    if len(pts) < 2:
        return float("nan")
    return float(np.polyfit(pts[:, 0], pts[:, 1], 1)[0] * 1e3)


def reference_round(rounds: int) -> int:
    """The round RSS is compared from: 100 (past set-up and the first rounds' one-off allocations),
    or half of a shorter run."""
    return 100 if rounds > 100 else max(1, rounds // 2)


def anon_at(sampler: Sampler, round_: int) -> tuple[float, float]:
    """(anonymous, file-backed) RSS at the sample closest to ``round_``."""
    i = min(range(len(sampler.rows)), key=lambda j: abs(sampler.rows[j][0] - round_))
    return sampler.parts[i]


def window_mean(rows: list[tuple[int, float, float]], first: int, last: int) -> float:
    """Mean RSS of the samples of rounds ``first..last``: a single sample moves by about 1% with what the
    allocator holds at that moment (torch's CPU tensors of the round just trained), a window's mean less."""
    values = [m for r, m, _ in rows if first <= r <= last]
    return float(np.mean(values)) if values else float("nan")


def rss_at(rows: list[tuple[int, float, float]], round_: int) -> float:
    """RSS at the sample closest to ``round_``."""
    return min(rows, key=lambda row: abs(row[0] - round_))[1]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"


def load() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return "?"


def write_outputs(args: argparse.Namespace, sampler: Sampler, load_before: str, diff: list[str]) -> Path:
    """CSV, PNG and markdown under ``--out``; returns the markdown's path."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = sampler.rows
    device = sampler.device or [None] * len(rows)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["round", "rss_mb", "rss_anon_mb", "rss_file_mb", "elapsed_s",
                         *(["cuda_allocated_mb", "cuda_reserved_mb", "graphs_kept", "graphs_dropped"]
                           if sampler.device else [])])
        writer.writerows((r, f"{m:.2f}", f"{a:.2f}", f"{fb:.2f}", f"{t:.1f}",
                          *([f"{d[0]:.2f}", f"{d[1]:.2f}", d[2], d[3]] if d else []))
                         for (r, m, t), (a, fb), d in zip(rows, sampler.parts, device, strict=True))
    try:
        plot(rows, out.with_suffix(".png"), args)
    except ImportError as err:  # matplotlib absent (a bare GPU machine): the numbers still go to the CSV and markdown
        print(f"no curve: {err}")
    ref = reference_round(args.rounds)
    first, last = rss_at(rows, ref), rows[-1][1]
    slope = slope_kb_per_round(rows, ref)
    seconds = rows[-1][2] / max(rows[-1][0], 1)
    span = max(args.rounds // 10, args.every)  # the windows: rounds ref..ref+span and the last span rounds
    early, late = window_mean(rows, ref, ref + span), window_mean(rows, rows[-1][0] - span, rows[-1][0])
    lines = [
        f"# RSS over {args.rounds} rounds ({args.devices} synthetic devices, {args.per_round} a round, MLP)",
        "",
        f"Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} {shlex.join([sys.executable, *sys.argv])}`",
        "",
        f"Workload (`--set`): `{' '.join(overrides(args))}`",
        "",
        f"Machine: {machine()}; load before: `{load_before}`; load after: `{load()}`",
        "",
        "| measure | value |",
        "|---|---|",
        f"| RSS at round {ref} | {first:.1f} MB |",
        f"| RSS at round {rows[-1][0]} | {last:.1f} MB |",
        f"| change | {100 * (last - first) / first:+.2f}% |",
        f"| mean RSS, rounds {ref}-{ref + span} / {rows[-1][0] - span}-{rows[-1][0]} | {early:.1f} / {late:.1f} MB "
        f"({100 * (late - early) / early:+.2f}%) |",
        f"| least-squares slope over rounds >= {ref} | {slope:+.2f} kB/round |",
        "| anonymous / file-backed RSS at round {} | {:.1f} / {:.1f} MB |".format(ref, *anon_at(sampler, ref)),
        f"| anonymous / file-backed RSS at round {rows[-1][0]} | {sampler.parts[-1][0]:.1f} / "
        f"{sampler.parts[-1][1]:.1f} MB |",
        f"| seconds per round | {seconds:.3f} |",
        f"| malloc_trim(0) before each sample | {'yes' if args.malloc_trim else 'no'} |",
        *device_rows(sampler, ref),
        "",
        f"Curve: `{out.with_suffix('.png').name}`; samples: `{out.with_suffix('.csv').name}`.",
    ]
    if diff:
        lines += ["", f"## tracemalloc: allocations grown between rounds {args.tracemalloc[0]} and "
                      f"{args.tracemalloc[1]} (top 15)", "", "```", *diff, "```"]
    md = out.with_suffix(".md")
    md.write_text("\n".join(lines) + "\n")
    return md


def device_rows(sampler: Sampler, ref: int) -> list[str]:
    """The markdown rows of the CUDA samples (none on the CPU)."""
    if not sampler.device:
        return []
    i = min(range(len(sampler.rows)), key=lambda j: abs(sampler.rows[j][0] - ref))
    (a0, r0, g0, _), (a1, r1, g1, d1) = sampler.device[i], sampler.device[-1]
    pts = np.array([(row[0], d[0]) for row, d in zip(sampler.rows, sampler.device, strict=True) if row[0] >= ref])
    slope = float(np.polyfit(pts[:, 0], pts[:, 1], 1)[0] * 1e3) if len(pts) >= 2 else float("nan")
    last = sampler.rows[-1][0]
    return [
        f"| CUDA allocated / reserved at round {ref} | {a0:.1f} / {r0:.1f} MB |",
        f"| CUDA allocated / reserved at round {last} | {a1:.1f} / {r1:.1f} MB |",
        f"| least-squares slope of CUDA allocated over rounds >= {ref} | {slope:+.2f} kB/round |",
        f"| CUDA graphs kept at round {ref} / {last}; dropped by {last} | {g0} / {g1}; {d1} |",
    ]


def plot(rows: list[tuple[int, float, float]], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r for r, _, _ in rows], [m for _, m, _ in rows], lw=1.2)
    ref = reference_round(args.rounds)
    ax.axhline(rss_at(rows, ref) * 1.02, color="grey", ls="--", lw=0.8, label=f"RSS({ref}) + 2%")
    ax.set_xlabel("round")
    ax.set_ylabel("RSS (MB)")
    ax.set_ylim(0, max(m for _, m, _ in rows) * 1.15)
    ax.set_title(f"RSS, {args.devices} synthetic devices, {args.per_round} a round, MLP")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--every", type=int, default=20, help="sample RSS every this many rounds")
    p.add_argument("--devices", type=int, default=1000)
    p.add_argument("--per-round", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--set", action="append", default=[], help="further KEY=VALUE overrides")
    p.add_argument("--malloc-trim", action="store_true", help="malloc_trim(0) before each sample")
    p.add_argument("--tracemalloc", type=int, nargs=2, metavar=("A", "B"),
                   help="trace Python allocations from the end of round A and list those still held at the "
                        "end of round B (tracing only in between: it slows every allocation)")
    p.add_argument("--run-dir", default="", help="run directory (default: a temporary one)")
    p.add_argument("--out", default=str(RESULTS / "memory_long"), help="results path without suffix")
    args = p.parse_args()
    load_before = load()
    cfg = config.load(None, overrides(args))
    exp = Experiment(cfg)
    sampler = Sampler(args.every, args.rounds, args.malloc_trim, tuple(args.tracemalloc or ()) or None,
                      cuda=exp.device.type == "cuda", cache=exp.vectorized_cache)
    with tempfile.TemporaryDirectory() as tmp:
        exp.run(Path(args.run_dir or Path(tmp) / "run"), reporter=sampler)
    diff: list[str] = []
    if args.tracemalloc and len(sampler.snapshots) == 2:
        a, b = (sampler.snapshots[r] for r in args.tracemalloc)
        diff = [str(stat) for stat in b.compare_to(a, "lineno")[:15]]
    md = write_outputs(args, sampler, load_before, diff)
    print(md.read_text())


if __name__ == "__main__":
    main()
