"""Freed CPU memory kept in the process (``runtime.keep_freed_memory``, :mod:`hetfl.engine.host_memory`).

The setting is process-wide and cannot be undone, so what it does to malloc is checked in fresh processes.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from hetfl import config
from hetfl.engine import experiment, host_memory
from hetfl.engine.experiment import Experiment

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# 20 blocks of 40 MB, each written then freed: above glibc's largest mmap threshold (32 MiB), so by
# default each is a fresh mapping, unmapped on free, and faults in its 10,000 pages again
FAULTS = """
import ctypes, json, resource, sys
from hetfl.engine import host_memory
kept = host_memory.keep_freed_memory() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    block = libc.malloc(40_000_000)
    ctypes.memset(block, 1, 40_000_000)
    libc.free(ctypes.c_void_p(block))
print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def page_faults(mode: str, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True,
                          env={**os.environ, **(env or {})})
    return json.loads(done.stdout)


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
@pytest.mark.processes
def test_kept_memory_is_not_faulted_in_again_at_every_allocation():
    plain, kept = page_faults("plain"), page_faults("keep")
    assert not plain["kept"] and kept["kept"]
    assert plain["faults"] > 20 * 9_000  # every block's pages, every time
    assert kept["faults"] < 2 * 9_800  # the first block's pages only


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
@pytest.mark.processes
def test_a_malloc_setting_of_the_user_is_left_alone():
    chosen = page_faults("keep", {"MALLOC_ARENA_MAX": "4"})
    assert not chosen["kept"] and chosen["faults"] > 20 * 9_000


@pytest.mark.parametrize(("env", "choice"), [
    ({}, None),
    ({"PATH": "/usr/bin", "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F"}, None),
    ({"LD_PRELOAD": "/usr/lib/libasan.so"}, None),
    ({"MALLOC_ARENA_MAX": "2"}, "MALLOC_ARENA_MAX"),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"}, "GLIBC_TUNABLES"),
    ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "LD_PRELOAD=/usr/lib/libjemalloc.so.2"),
])
def test_what_counts_as_the_users_choice_of_allocator(env, choice):
    assert host_memory.allocator_choice(env) == choice


@pytest.mark.parametrize(("keep", "called"), [(True, 1), (False, 0)])
def test_a_cpu_run_keeps_freed_memory_unless_told_not_to_and_gives_it_back_at_its_end(keep, called, monkeypatch,
                                                                                      tmp_path):
    calls = {"keep": 0, "release": 0}
    def count(name: str):  # type: ignore[no-untyped-def]
        return lambda: calls.__setitem__(name, calls[name] + 1)

    monkeypatch.setattr(experiment.host_memory, "keep_freed_memory", count("keep"))
    monkeypatch.setattr(experiment.host_memory, "release_freed_memory", count("release"))
    exp = Experiment(config.load(None, ["train.rounds=1", "runtime.progress=false", "runtime.device=cpu",
                                        f"runtime.keep_freed_memory={str(keep).lower()}"]))
    assert calls["keep"] == called
    exp.run(tmp_path / "run")
    assert calls["release"] == 1


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
@pytest.mark.processes
@pytest.mark.slow  # two `hetfl run`s as processes: ~7 s
def test_keeping_freed_memory_changes_no_number(tmp_path):
    """The same run in two fresh processes, with and without the setting: the same metrics, and the same run
    (the key is not part of a run's identity)."""
    lines = {}
    for keep in ("true", "false"):
        out = tmp_path / keep
        subprocess.run([sys.executable, "-m", "hetfl.cli", "run", "--quiet", "--out", str(out),
                        "--set", "train.rounds=2", "--set", "runtime.progress=false", "--set", "runtime.device=cpu",
                        "--set", f"runtime.keep_freed_memory={keep}"], check=True, capture_output=True)
        lines[keep] = [{k: v for k, v in json.loads(line).items() if not k.endswith("time_s")}
                       for line in Path(out / "metrics.jsonl").read_text().splitlines()]
        lines[keep + "_id"] = json.loads((out / "summary.json").read_text())["setting_id"]
    assert lines["true"] == lines["false"] and len(lines["true"]) == 2
    assert lines["true_id"] == lines["false_id"]
