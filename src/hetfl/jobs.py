"""Several runs of a plan at once, each in a worker process (``hetfl compare --jobs N``, ``hetfl reproduce --jobs N``).

A plan (methods x seeds x grid cells, or a preset's distinct runs) is a list of independent runs but for one
dependency: a run that calibrates the model another run trained (:func:`hetfl.sweeps.training_sources`) starts
once that run has finished. ``workers`` processes (``spawn``: fresh interpreters that share nothing with this
one) take the runs in plan order; each run writes only its own folder, under that folder's lock, as it would
alone. Plug-in files this process loaded are loaded in every worker; a method registered by code outside a
file (a notebook cell) cannot be, and is refused before any run (:func:`check_shippable`).

What stays the same: a run's numbers. A run's configuration and seed fix all its random streams, and nothing a
worker ran before changes them. The torch CPU thread count is the one input that differs: each worker starts
from ``max(1, threads // workers)`` threads (``threads``: this process's count,
:data:`hetfl.engine.threads.PROCESS_THREADS`), so that the runs do not fight over the cores. A small CPU step
runs on one thread whatever the count (``runtime.threads = 0``), so its numbers equal those of ``--jobs 1``; a
large step's may differ in the last bits, as under another ``OMP_NUM_THREADS``; ``runtime.threads = k`` is kept.

What changes: the terminal. Workers show no progress bars; this process says when each run starts and ends,
with the time left. A run that fails stops the plan: the other workers are stopped (each of their runs resumes
from its last checkpoint when the command is run again) and :class:`RunFailed` names the run's folder and its
cause. Ctrl-C stops them alike, and a worker whose parent was killed outright (``kill -9``) stops itself.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetfl import config as config_mod
from hetfl import runs
from hetfl.algorithms import load_plugin, plugin_files, registered_outside_files
from hetfl.engine.checkpoint import TRAINED_NAME
from hetfl.params import ConfigError


@dataclass(frozen=True)
class Job:
    """A run of a plan that still computes: its folder and how it stands (``new`` or ``unfinished``), its
    configuration as a plain tree (:func:`hetfl.config.to_tree`), its counter label and cost
    (:func:`hetfl.sweeps.run_cost`), and, for a run that calibrates another run's training, that run's folder
    (``source``) and, when that run is a job of this plan too, its index (``after``: started once it is done)."""

    label: str
    tree: dict[str, Any]
    run_dir: Path
    state: str
    cost: float = 1.0
    source: Path | None = None
    after: int | None = None


class RunFailed(RuntimeError):
    """A run of a parallel plan failed: the error names its folder and the cause the worker reported."""


#: most runs at once (as ``runtime.threads``' bound): a typo such as ``--jobs 1000000`` is refused, not obeyed
MAX_JOBS = 1024


def check_jobs(jobs: Any, option: str = "--jobs") -> int:
    """``jobs`` as a number of runs at once (1 to :data:`MAX_JOBS`), else a ConfigError naming ``option``."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or not 1 <= jobs <= MAX_JOBS:
        raise ConfigError(option, jobs, f"must be a number of runs at once from 1 to {MAX_JOBS} (1: one after "
                                        "another)")
    return jobs


def check_shippable(methods: Iterable[str], jobs: int, option: str = "--jobs") -> None:
    """Refuse ``jobs`` runs at once (in worker processes) of a method registered outside a plug-in file (a
    worker cannot import it), before any run starts."""
    unknown = registered_outside_files(methods)
    if unknown:
        raise ConfigError(option, jobs, f"the method(s) {', '.join(unknown)} were registered in this process, not "
                                         "by a plug-in file, so a worker process cannot know them; put them in a "
                                         "file and pass it as --plugin FILE (plugins= in Python), or run one at a "
                                         "time (jobs = 1)")


def trained_folder(state: str, source: Path | None) -> Path | None:
    """The folder a run in ``state`` takes its training from: ``source`` (the folder of the first run of its
    training, :func:`hetfl.sweeps.training_sources`) for a new run, when that run kept its trained model
    (``trained.safetensors``: it ran earlier in this plan, or in an earlier invocation); else None."""
    if state != "new" or source is None or not (source / TRAINED_NAME).is_file():
        return None
    return source


def format_duration(seconds: float) -> str:
    """``40 s``, ``12 min``, ``2.5 h``."""
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# ----------------------------------------------------------------- in the worker processes
#: seconds between a worker's looks at whether its parent still runs (:func:`_watch_parent`)
PARENT_POLL_S = 0.5


def _watch_parent(parent: int, poll_s: float = PARENT_POLL_S) -> None:
    """Stop this worker once ``parent`` (the process that started it) is gone: killed outright (``kill -9``, the
    OOM killer), it could not stop its workers, and an orphan would compute on, holding its run's folder, which
    the same command run again needs. SIGTERM, as :meth:`multiprocessing.pool.Pool.terminate` sends: a run
    releases its folder and resumes from its last checkpoint next time."""
    while os.getppid() == parent:
        time.sleep(poll_s)
    os.kill(os.getpid(), signal.SIGTERM)


def _start_worker(plugins: list[str], threads: int, parent: int | None = None) -> None:
    """A worker's set-up: Ctrl-C is this process's to handle (it stops the workers), the thread count the
    runs start from, the plug-in files this process loaded, and a watch that stops the worker when ``parent``
    (this process's id) is gone (:func:`_watch_parent`)."""
    import torch

    from hetfl.engine import threads as threads_mod

    if parent is not None:
        threading.Thread(target=_watch_parent, args=(parent,), name="hetfl-parent-watch", daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    threads_mod.PROCESS_THREADS = threads
    for plugin in plugins:
        load_plugin(plugin)


def _run(tree: dict[str, Any], run_dir: str, state: str, trained: str | None) -> tuple[str, float, str | None]:
    """One run in a worker, as ``hetfl compare`` runs it alone (:func:`hetfl.runs.execute`, no console):
    its status, its seconds, and the error it raised as text (None: it finished). An exception is sent back
    as text: not every exception can be pickled back intact."""
    started = time.monotonic()
    try:
        status = runs.execute(config_mod.from_dict(tree), Path(run_dir), state, None,  # type: ignore[arg-type]
                              trained=None if trained is None else Path(trained))
    except Exception as err:  # reported to the parent, with the run's folder
        return "failed", time.monotonic() - started, f"{type(err).__name__}: {err}"
    except KeyboardInterrupt:  # stopped by the parent (SIGTERM: hetfl.engine.rundir.Terminated), folder released
        os._exit(143)  # quietly: the parent says what happened and how to go on
    return status, time.monotonic() - started, None


# ----------------------------------------------------------------- in this process
def run_jobs(jobs: list[Job], workers: int, say: Callable[[str], None] | None = None, *,
             worker: Callable[..., tuple[str, float, str | None]] = _run, threads: int | None = None,
             clock: Callable[[], float] = time.monotonic) -> dict[int, str]:
    """Run ``jobs`` on ``workers`` processes, in order as far as their dependencies allow; return each one's
    status by index. ``say`` gets a line as each run starts and ends (with the time left: the seconds per unit
    of cost of the runs done, times the cost left, shared over the workers). ``worker`` and ``threads``
    (default: this process's count) are for tests. A failed run raises :class:`RunFailed` once the other
    workers are stopped."""
    from hetfl.engine.threads import PROCESS_THREADS

    if not jobs:  # every run of the plan finished earlier: no worker to start
        return {}
    workers = min(workers, len(jobs))  # never more processes than runs to compute
    count = max(1, (PROCESS_THREADS if threads is None else threads) // workers)
    statuses: dict[int, str] = {}
    finished: queue.Queue = queue.Queue()
    waiting = list(range(len(jobs)))
    running: dict[int, float] = {}  # index -> when it started
    spent = done_cost = 0.0
    started_at = clock()
    pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_start_worker,
                                                     initargs=(plugin_files(), count, os.getpid()))
    try:
        while waiting or running:
            for i in [i for i in waiting if jobs[i].after is None or jobs[i].after in statuses]:
                if len(running) >= workers:
                    break
                waiting.remove(i)
                running[i] = clock()
                job = jobs[i]
                trained = trained_folder(job.state, job.source)
                pool.apply_async(worker, (job.tree, str(job.run_dir), job.state, None if trained is None else
                                          str(trained)), callback=lambda result, i=i: finished.put((i, result)),
                                 error_callback=lambda err, i=i: finished.put((i, ("failed", 0.0, repr(err)))))
                if say is not None:
                    on = f"; post-hoc steps only, on {trained}'s training" if trained is not None else ""
                    say(f"run {i + 1} of {len(jobs)} ({job.label}{on}): started")
            i, (status, seconds, error) = _next(finished)
            running.pop(i)
            if error is not None:
                raise RunFailed(f"run {i + 1} of {len(jobs)} ({jobs[i].label}) in {jobs[i].run_dir} failed: {error}. "
                                "The other runs were stopped; run the same command again to resume them all")
            statuses[i] = status
            spent += seconds
            done_cost += jobs[i].cost
            if say is not None:
                eta = _time_left(jobs, waiting, running, spent / done_cost if done_cost > 0 else None, workers,
                                 clock())
                say(f"run {i + 1} of {len(jobs)} ({jobs[i].label}): {status} in {format_duration(seconds)}; "
                    f"{len(statuses)} of {len(jobs)} done after {format_duration(clock() - started_at)}, {eta}")
    except BaseException:
        pool.terminate()  # SIGTERM: each run releases its folder's lock and resumes from its last checkpoint
        pool.join()
        raise
    pool.close()
    pool.join()
    return statuses


def _time_left(jobs: list[Job], waiting: list[int], running: dict[int, float], rate: float | None, workers: int,
               now: float) -> str:
    """The time left: the seconds per unit of cost of the runs done (``rate``) times the cost of the runs waiting,
    plus what the running ones have left of theirs at that rate, shared over the workers."""
    if not waiting and not running:
        return "none left"
    if rate is None:
        return "time left known once a run with work has finished"
    left = sum(jobs[k].cost * rate for k in waiting)
    left += sum(max(jobs[k].cost * rate - (now - started), 0.0) for k, started in running.items())
    return f"about {format_duration(left / workers)} left"


def _next(finished: queue.Queue) -> tuple[int, tuple[str, float, str | None]]:
    """The next finished run, waiting in short slices so that Ctrl-C is seen at once."""
    while True:
        try:
            return finished.get(timeout=0.2)
        except queue.Empty:
            continue
