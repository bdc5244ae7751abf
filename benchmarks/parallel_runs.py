"""A preset's quick variant run one run after another and with ``--jobs N``, side by side: wall time, CPU time
and whether the two tables are equal (``hetfl reproduce --jobs``, :mod:`hetfl.jobs`).

Each configuration is the README's command as a user types it (a fresh ``hetfl`` process, default threads),
timed by the operating system (``resource.getrusage`` of the children: CPU seconds and the largest process's
peak memory), into its own output folder. Appends a section to ``benchmarks/results/jobs_<device>.md``.

    python benchmarks/parallel_runs.py fedpac-cifar10 --jobs 1 2 \
        --set data.root=../shared/datasets/cifar10-jpeg.tar.gz
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def timed_reproduce(preset: str, jobs: int, sets: list[str], out: Path) -> dict:
    """One ``hetfl reproduce PRESET --quick --jobs N`` in a fresh process: wall and CPU seconds, peak RSS."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    command = [str(Path(sys.executable).parent / "hetfl"), "reproduce", preset, "--quick", "--quiet",
               "--jobs", str(jobs), "--out", str(out), *(x for s in sets for x in ("--set", s))]
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    table = json.loads((out / "reproduction.json").read_text())["table"]
    return {"jobs": jobs, "wall_s": wall, "cpu_s": cpu, "peak_rss_gb": after.ru_maxrss / 2**20, "table": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset")
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--note", default="", help="a line about the machine's state, for the results file")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="hetfl-jobs-"))
    try:
        rows = [timed_reproduce(args.preset, n, args.set, scratch / f"jobs{n}") for n in args.jobs]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    base = rows[0]
    lines = [f"\n## `{args.preset}` --quick on {os.cpu_count()} cores ({platform.machine()}, Python "
             f"{platform.python_version()}), {time.strftime('%Y-%m-%d')}\n",
             f"`python benchmarks/parallel_runs.py {args.preset} --jobs {' '.join(map(str, args.jobs))}"
             + "".join(f" --set {s}" for s in args.set) + "`" + (f" ({args.note})" if args.note else "") + "\n",
             "| --jobs | wall | CPU s | peak RSS of one process (GB) | speed-up | table equal to --jobs "
             f"{base['jobs']} |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['jobs']} | {r['wall_s'] / 60:.1f} min | {r['cpu_s']:.0f} | {r['peak_rss_gb']:.1f} | "
                     f"{base['wall_s'] / r['wall_s']:.2f}x | {'yes' if r['table'] == base['table'] else 'NO'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    path = RESULTS / "jobs_cpu.md"
    if not path.exists():
        path.write_text("# Runs of a plan at once (`hetfl reproduce/compare --jobs N`): wall time and equal tables\n")
    with path.open("a") as f:
        f.write(text)


if __name__ == "__main__":
    main()
