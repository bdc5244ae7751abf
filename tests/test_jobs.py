"""Several runs of a plan at once (``hetfl compare --jobs``, ``hetfl reproduce --jobs``, :mod:`hetfl.jobs`):
the same numbers as one after another, dependencies kept, a failure stops the plan and names the run."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import hetfl
from hetfl import jobs, reproduce
from hetfl.algorithms import _CLASSES, plugin_files, register
from hetfl.algorithms.fedavg import FedAvg
from hetfl.cli import main
from hetfl.engine.checkpoint import TRAINED_NAME
from hetfl.params import ConfigError
from tests.helpers.runs import TINY

TIMES = ("round_time_s", "eval_time_s", "wall_time_s")


def lines(run_dir: Path) -> list[dict]:
    """A run's metrics lines without their times."""
    return [{k: v for k, v in json.loads(line).items() if k not in TIMES}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


PLUGIN = ("from hetfl.algorithms import register\nfrom hetfl.algorithms.fedavg import FedAvg\n\n\n"
          "@register\nclass Mine(FedAvg):\n    name = 'mine_from_file'\n")


@pytest.mark.processes
@pytest.mark.slow  # two worker processes and the runs one after another: ~6 s
def test_compare_with_two_jobs_gives_the_numbers_of_runs_one_after_another(tmp_path, monkeypatch):
    """Also a --plugin file's method, which the workers (fresh interpreters) must load from the file: one pool of
    workers serves both checks (each pool start imports torch twice). The registry is put back after the test
    (tests/conftest.py)."""
    plugin = tmp_path / "mine.py"
    plugin.write_text(PLUGIN)
    methods = ["fedavg", "scaffold", "mine_from_file"]
    one = hetfl.compare(methods, seeds=[1], overrides=TINY, out=tmp_path / "one", plugins=[plugin])
    two = hetfl.compare(methods, seeds=[1], overrides=TINY, out=tmp_path / "two", jobs=2, plugins=[plugin])
    assert [r.status for r in two.runs] == ["ran"] * 3
    for run in ("fedavg-seed1", "scaffold-seed1", "mine_from_file-seed1"):
        assert lines(tmp_path / "two" / run) == lines(tmp_path / "one" / run), f"{run}: not the sequential numbers"
    assert lines(tmp_path / "two" / "fedavg-seed1") != lines(tmp_path / "two" / "scaffold-seed1")  # two runs apart
    assert two.rows[2]["method"] == "mine_from_file"
    assert lines(tmp_path / "two" / "mine_from_file-seed1") == lines(tmp_path / "two" / "fedavg-seed1"), \
        "the plug-in's method (FedAvg by another name) did not run as FedAvg in a worker"
    assert [{k: v for k, v in r.items() if k != "wall_time_s"} for r in two.rows] == \
        [{k: v for k, v in r.items() if k != "wall_time_s"} for r in one.rows]
    started = []
    monkeypatch.setattr(multiprocessing, "get_context", lambda *a: started.append(a))
    again = hetfl.compare(methods, seeds=[1], overrides=TINY, out=tmp_path / "two", jobs=2, plugins=[plugin])
    assert [r.status for r in again.runs] == ["reused"] * 3 and started == []  # nothing to compute: no worker


# ----------------------------------------------------------------- the scheduler, with a worker that only waits
def waiting_worker(tree: dict, run_dir: str, state: str, trained: str | None) -> tuple[str, float, str | None]:
    """Stands for a run: writes when it starts and ends (and what it calibrates), waits ``tree["wait"]`` s, and
    fails when asked to."""
    folder = Path(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "started").write_text(f"{time.time()!r} {trained}")
    time.sleep(tree["wait"])
    if tree.get("fail"):
        return "failed", tree["wait"], "ValueError: the features overflowed"
    (folder / TRAINED_NAME).write_text("model")
    (folder / "ended").write_text(repr(time.time()))
    return "ran", tree["wait"], None


def job(tmp_path: Path, name: str, wait: float, **kw) -> jobs.Job:
    return jobs.Job(name, {"wait": wait, "fail": kw.pop("fail", False)}, tmp_path / name, "new", **kw)


@pytest.mark.slow  # worker processes, 3 s
def test_a_run_that_calibrates_another_runs_training_starts_once_that_run_has_ended(tmp_path):
    plan = [job(tmp_path, "trains", 1.0), job(tmp_path, "other", 0.1),
            job(tmp_path, "calibrates", 0.1, source=tmp_path / "trains", after=0)]
    said: list[str] = []
    assert jobs.run_jobs(plan, 2, said.append, worker=waiting_worker, threads=2) == {0: "ran", 1: "ran", 2: "ran"}
    started, trained = (tmp_path / "calibrates" / "started").read_text().split()
    assert float(started) >= float((tmp_path / "trains" / "ended").read_text())  # not before, though a worker was free
    assert trained == str(tmp_path / "trains")  # and on that run's kept model
    assert said[0] == "run 1 of 3 (trains): started" and said[1] == "run 2 of 3 (other): started"
    assert any(line.startswith("run 3 of 3 (calibrates; post-hoc steps only, on ") for line in said)
    assert said[-1].startswith("run 3 of 3 (calibrates): ran in") and said[-1].endswith("none left")


def test_never_more_workers_than_runs_to_compute(tmp_path, monkeypatch):
    """``--jobs 1024`` for two runs asks for a pool of two processes, not 1024. The pool is not started: its
    size is all this test needs (that two workers run a plan, the other tests here show)."""

    class NotStarted(Exception):
        """Raised in place of starting the pool."""

    sizes = []

    def pool(processes, *args, **kwargs):
        sizes.append(processes)
        raise NotStarted

    monkeypatch.setattr(multiprocessing, "get_context", lambda *a: SimpleNamespace(Pool=pool))
    plan = [job(tmp_path, "a", 0.0), job(tmp_path, "b", 0.0)]
    with pytest.raises(NotStarted):
        jobs.run_jobs(plan, 1024, worker=waiting_worker, threads=2)
    assert sizes == [2], f"pools of {sizes} worker processes for 2 runs"


def test_a_failed_run_stops_the_plan_naming_its_folder_and_its_cause(tmp_path):
    plan = [job(tmp_path, "long", 30.0), job(tmp_path, "fails", 0.2, fail=True), job(tmp_path, "never", 0.1)]
    begun = time.monotonic()
    with pytest.raises(jobs.RunFailed) as err:
        jobs.run_jobs(plan, 2, worker=waiting_worker, threads=2)
    assert time.monotonic() - begun < 20  # the long run was stopped, not waited for
    assert str(err.value).startswith(f"run 2 of 3 (fails) in {tmp_path / 'fails'} failed: ValueError: the features "
                                     "overflowed. The other runs were stopped; run the same command again")
    assert not (tmp_path / "long" / "ended").exists() and not (tmp_path / "never").exists()


# ----------------------------------------------------------------- refused before anything runs
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2", 1025, 10**6])
def test_jobs_must_be_a_number_of_runs_at_once(tmp_path, value):
    with pytest.raises(ConfigError, match=r"^jobs = .*: must be a number of runs at once from 1 to 1024"):
        hetfl.compare(["fedavg"], overrides=TINY, out=tmp_path / "cmp", jobs=value)
    assert not (tmp_path / "cmp").exists()


def test_the_command_line_refuses_jobs_0_naming_the_option(tmp_path, capsys):
    assert main(["compare", "--methods", "fedavg", "--seeds", "0", "--jobs", "0", "--out", str(tmp_path / "c"),
                 "--quiet"]) == 2
    assert capsys.readouterr().err.startswith("hetfl: error: --jobs = 0: must be a number of runs at once from 1 to "
                                              "1024")


def test_a_method_registered_outside_a_plugin_file_is_refused_with_jobs(tmp_path):
    """A worker process cannot import a method a notebook registered; one in a --plugin file it can."""
    class Notebook(FedAvg):
        name = "notebook_method"

    register(Notebook)
    try:
        with pytest.raises(ConfigError, match="notebook_method were registered in this process, not by a plug-in "
                                              "file.*--plugin FILE"):
            hetfl.compare(["notebook_method"], overrides=TINY, out=tmp_path / "cmp", jobs=2)
        assert not (tmp_path / "cmp").exists()
        hetfl.compare(["notebook_method"], overrides=TINY, out=tmp_path / "cmp", jobs=1)  # in this process: fine
    finally:
        _CLASSES.pop("notebook_method")


# ----------------------------------------------------------------- a preset
ORACLE_PRESET = """
[preset]
title = "toy"
paper = "nobody"
metric = "final_global_acc"
seeds = [0]
[base.data]
partition = "iid"
num_clients = 4
options = { num_devices = 8, max_samples = 60 }
[base.train]
rounds = 2
local_steps = 2
[base.runtime]
threads = 1
[[columns]]
id = "c"
label = "C"
[[rows]]
label = "FedAvg + CCVR"
algorithm = "fedavg+ccvr"
set = { "algorithm.ccvr.epochs" = 2 }
[[rows]]
label = "FedAvg + oracle"
algorithm = "fedavg+ccvr"
set = { "algorithm.ccvr.oracle" = "all", "algorithm.ccvr.epochs" = 2 }
[[rows]]
label = "FedProx"
algorithm = "fedprox"
"""


@pytest.mark.processes
@pytest.mark.slow  # two worker processes and the runs one after another: ~9 s
def test_reproduce_with_two_jobs_gives_the_table_of_one_after_another(tmp_path, capsys):
    """The oracle row calibrates the CCVR run's training in both; the tables are equal."""
    path = tmp_path / "toy.toml"
    path.write_text(ORACLE_PRESET)
    assert main(["reproduce", str(path), "--out", str(tmp_path / "one"), "--quiet"]) == 0
    assert main(["reproduce", str(path), "--out", str(tmp_path / "two"), "--quiet", "--jobs", "2"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "(c, fedavg+ccvr (ccvr.epochs=2, ccvr.oracle=all), seed 0; post-hoc steps only, on" in printed
    one, two = (json.loads((tmp_path / d / "reproduction.json").read_text())["table"] for d in ("one", "two"))
    assert one == two and set(one) == {"FedAvg + CCVR", "FedAvg + oracle", "FedProx"}
    assert reproduce.load_preset(str(path)).name == "toy"


def test_the_time_left_counts_what_the_running_runs_have_left(tmp_path):
    """At 10 s per unit of cost: two runs waiting (10 s each) and one running for 4 s (6 s left), on two workers."""
    plan = [job(tmp_path, name, 0.0) for name in ("a", "b", "c", "d")]
    assert jobs._time_left(plan, [2, 3], {1: 96.0}, 10.0, 2, now=100.0) == "about 13 s left"
    assert jobs._time_left(plan, [], {1: 50.0}, 10.0, 2, now=100.0) == "about 1 s left"  # overdue: at least 1 s
    assert jobs._time_left(plan, [2], {}, None, 2, now=0.0) == "time left known once a run with work has finished"
    assert jobs._time_left(plan, [], {}, 10.0, 2, now=0.0) == "none left"


def test_the_command_line_reports_a_failed_parallel_run_as_an_error_line(tmp_path, monkeypatch, capsys):
    """A run that fails in a worker is :class:`hetfl.jobs.RunFailed`, whose message names the run, its folder and
    the cause: ``hetfl compare --jobs N`` prints it as its error line (exit 1), not as a traceback of this
    process's plumbing (the worker's own traceback is not there to show)."""
    def fails(plan, workers, say):
        raise jobs.RunFailed(f"run 1 of 2 ({plan[0].label}) in {plan[0].run_dir} failed: RuntimeError: boom")

    monkeypatch.setattr("hetfl.sweeps.run_jobs", fails)
    out = tmp_path / "c"
    code = main(["compare", "--methods", "fedavg", "--seeds", "0,1", "--jobs", "2", "--out", str(out), "--quiet",
                 *[a for kv in TINY for a in ("--set", kv)]])
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert err.splitlines()[0] == (f"hetfl: error: run 1 of 2 (fedavg, seed 0) in {out / 'fedavg-seed0'} failed: "
                                   "RuntimeError: boom")
    assert "Traceback" not in err


# ----------------------------------------------------------------- this process killed outright
def pid_worker(tree: dict, run_dir: str, state: str, trained: str | None) -> tuple[str, float, str | None]:
    """Stands for a long run: writes its process id, then waits ``tree["wait"]`` s."""
    (Path(run_dir) / "pid").write_text(str(os.getpid()))
    time.sleep(tree["wait"])
    return "ran", tree["wait"], None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie left for its reaper does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


@pytest.mark.slow  # worker processes killed with their parent, 3.4 s
@pytest.mark.processes
@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads process states from /proc (Linux)")
def test_workers_stop_when_this_process_is_killed_outright(tmp_path):
    """``kill -9`` of ``hetfl compare --jobs N`` (or the OOM killer) gives it no chance to stop its workers: each
    worker sees its parent gone and stops itself (SIGTERM: a run releases its folder, to resume from its last
    checkpoint), rather than computing on, orphaned, holding the folder that the same command run again needs."""
    root = Path(__file__).resolve().parents[1]
    driver = (f"import sys; sys.path[:0] = [{str(root)!r}, {str(root / 'src')!r}]\n"
              "from pathlib import Path\nfrom hetfl import jobs\nfrom tests.test_jobs import pid_worker\n"
              f"jobs.run_jobs([jobs.Job('long', {{'wait': 300}}, Path({str(tmp_path)!r}), 'new')], 1, "
              "worker=pid_worker, threads=1)\n")
    parent = subprocess.Popen([sys.executable, "-c", driver])
    try:
        for _ in range(600):  # the worker starts (a fresh interpreter importing torch) and writes its pid
            if ((tmp_path / "pid").is_file() and (tmp_path / "pid").read_text()) or parent.poll() is not None:
                break
            time.sleep(0.1)
        worker = int((tmp_path / "pid").read_text())
        assert _alive(worker)
    finally:
        parent.kill()
        parent.wait()
    for _ in range(300):
        if not _alive(worker):
            break
        time.sleep(0.1)
    else:
        os.kill(worker, signal.SIGKILL)  # leave no orphan behind the failed test
        pytest.fail(f"worker {worker} still runs 30 s after its parent was killed")


# ----------------------------------------------------------------- session 48: what mutation testing found untested
def test_jobs_accepts_its_whole_range_and_names_the_option_it_is_given():
    """1 and :data:`hetfl.jobs.MAX_JOBS` are accepted (the bound is inclusive); a refusal names ``--jobs`` by
    default, else the option given (the API's ``jobs``), and says what 1 means."""
    assert jobs.check_jobs(1) == 1 and jobs.check_jobs(jobs.MAX_JOBS) == jobs.MAX_JOBS == 1024
    with pytest.raises(ConfigError) as err:
        jobs.check_jobs(0)
    assert str(err.value) == "--jobs = 0: must be a number of runs at once from 1 to 1024 (1: one after another)"
    with pytest.raises(ConfigError, match=r"^jobs = 1025: "):
        jobs.check_jobs(1025, "jobs")


def test_a_method_a_worker_cannot_know_is_refused_naming_the_option_and_every_such_method():
    class First(FedAvg):
        name = "notebook_first"

    class Second(FedAvg):
        name = "notebook_second"

    register(First)
    register(Second)
    try:
        with pytest.raises(ConfigError) as err:
            jobs.check_shippable(["fedavg", "notebook_first", "notebook_second"], 4)
        assert str(err.value) == (
            "--jobs = 4: the method(s) notebook_first, notebook_second were registered in this process, not by a "
            "plug-in file, so a worker process cannot know them; put them in a file and pass it as --plugin FILE "
            "(plugins= in Python), or run one at a time (jobs = 1)")
        with pytest.raises(ConfigError, match=r"^jobs = 2: the method\(s\) notebook_first were"):
            jobs.check_shippable(["notebook_first"], 2, "jobs")
        jobs.check_shippable(["fedavg", "fedprox"], 2)  # built-in methods: every worker knows them
    finally:
        _CLASSES.pop("notebook_first")
        _CLASSES.pop("notebook_second")


@pytest.mark.parametrize(("seconds", "shown"), [(0.2, "1 s"), (40, "40 s"), (89.4, "89 s"), (90, "2 min"),
                                                (150, "2 min"), (720, "12 min"), (5399, "90 min"), (5400, "1.5 h"),
                                                (5581, "1.6 h"),  # 1.5503 h: an hour is 3,600 s
                                                (9000, "2.5 h"), (36000, "10.0 h")])
def test_durations_are_shown_in_seconds_minutes_or_hours(seconds, shown):
    assert jobs.format_duration(seconds) == shown


@pytest.mark.parametrize(("threads", "workers", "each"), [(16, 4, 4), (5, 2, 2), (1, 2, 1), (3, 8, 1)])
def test_each_worker_starts_from_its_share_of_the_threads(tmp_path, monkeypatch, threads, workers, each):
    """A worker's torch thread count is this process's divided by the workers (rounded down, at least 1): an
    integer, as ``torch.set_num_threads`` takes. The pool is not started: its initialiser's arguments are all
    this test needs."""

    class NotStarted(Exception):
        """Raised in place of starting the pool."""

    given, methods = [], []

    def pool(processes, initializer, initargs):
        given.append((processes, initializer, initargs))
        raise NotStarted

    monkeypatch.setattr(multiprocessing, "get_context", lambda *a: methods.append(a) or SimpleNamespace(Pool=pool))
    plan = [job(tmp_path, str(i), 0.0) for i in range(workers)]
    with pytest.raises(NotStarted):
        jobs.run_jobs(plan, workers, worker=waiting_worker, threads=threads)
    ((processes, initializer, (plugins, count, parent)),) = given
    assert methods == [("spawn",)]  # fresh interpreters (a fork would share this process's threads and state)
    assert (processes, initializer, parent) == (workers, jobs._start_worker, os.getpid())
    assert plugins == plugin_files()  # the plug-in files this process loaded, for each worker to load
    assert count == each and type(count) is int


def reporting_worker(tree: dict, run_dir: str, state: str, trained: str | None) -> tuple[str, float, str | None]:
    """Stands for a run that took ``tree["seconds"]`` (at once), or raises as a worker's own plumbing could (an
    exception that escapes :func:`hetfl.jobs._run`, e.g. a result that cannot be pickled)."""
    if tree.get("raise"):
        raise ValueError("cannot pickle the result")
    return "ran", tree["seconds"], None


@pytest.mark.slow  # a worker process, 3 s
@pytest.mark.processes
def test_the_time_left_is_the_seconds_per_cost_of_the_runs_done_and_an_escaped_error_stops_the_plan(tmp_path):
    """One worker; a run with no work left (cost 0: no rate yet), then runs of cost 1 taking 600 s each (a clock
    that stands still: the lines' times are the runs'): after the second, two runs wait (20 min); after the
    third, one (10 min). The last run's worker raises rather than returning its error as text: the plan stops all
    the same, naming the run and the exception."""
    plan = [jobs.Job(name, {"seconds": 600.0 * (name != "a"), "raise": name == "d"}, tmp_path / name, "new",
                     cost=float(name != "a")) for name in "abcd"]
    said: list[str] = []
    with pytest.raises(jobs.RunFailed) as err:
        jobs.run_jobs(plan, 1, said.append, worker=reporting_worker, threads=1, clock=lambda: 1000.0)
    ended = [line for line in said if "done after" in line]
    assert ended == ["run 1 of 4 (a): ran in 1 s; 1 of 4 done after 1 s, time left known once a run with work has "
                     "finished",
                     "run 2 of 4 (b): ran in 10 min; 2 of 4 done after 1 s, about 20 min left",
                     "run 3 of 4 (c): ran in 10 min; 3 of 4 done after 1 s, about 10 min left"]
    assert str(err.value) == (f"run 4 of 4 (d) in {tmp_path / 'd'} failed: ValueError('cannot pickle the result'). "
                              "The other runs were stopped; run the same command again to resume them all")


def test_runs_past_their_estimate_count_nothing_toward_the_time_left(tmp_path):
    """Three running runs all past their estimate (10 s per unit of cost, started 50 s ago), none waiting, one
    worker: none left of theirs to count; the line says at least 1 s, not 3."""
    plan = [job(tmp_path, name, 0.0) for name in ("a", "b", "c")]
    assert jobs._time_left(plan, [], {0: 50.0, 1: 50.0, 2: 50.0}, 10.0, 1, now=100.0) == "about 1 s left"
    assert jobs._time_left(plan, [], {0: 95.0, 1: 50.0, 2: 50.0}, 10.0, 1, now=100.0) == "about 5 s left"


def threads_worker(tree: dict, run_dir: str, state: str, trained: str | None) -> tuple[str, float, str | None]:
    """Stands for a run: reports as its status the thread count its worker started from (hetfl's and torch's)."""
    import torch

    from hetfl.engine import threads as threads_mod

    return f"{threads_mod.PROCESS_THREADS},{torch.get_num_threads()}", 0.0, None


@pytest.mark.slow  # two worker processes, 3 s
@pytest.mark.processes
def test_a_worker_runs_from_its_share_of_the_threads(tmp_path):
    """Six threads over two workers: each run sees three, as hetfl's process count (what ``runtime.threads``
    resolves against) and as torch's."""
    plan = [job(tmp_path, name, 0.0) for name in "ab"]
    assert jobs.run_jobs(plan, 2, worker=threads_worker, threads=6) == {0: "3,3", 1: "3,3"}


def test_a_run_that_fails_in_a_worker_reports_its_exception_by_type_and_message(tmp_path):
    """:func:`hetfl.jobs._run` (here in this process) sends an exception back as text: not every exception can
    be pickled back intact."""
    status, seconds, error = jobs._run({"train": {"rounds": 0}}, str(tmp_path / "run"), "new", None)
    assert status == "failed" and 0 <= seconds < 30
    assert error is not None and error.startswith("ConfigError: train.rounds = 0: "), error
