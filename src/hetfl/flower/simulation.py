"""``runtime.executor = "flower"``: an experiment's clients on Flower's simulation engine (Ray).

One virtual SuperNode per client (``node_config = {"partition-id": c, ...}``), each ClientApp
call in a Ray actor with ``runtime.flower_client_cpus`` CPUs; the ServerApp runs the
experiment's round loop in this process, so the run directory, metrics and summary are the
same files as with the other executors. Client state stays on the nodes (``context.state``)
and in ``RUN_DIR/flower_nodes/`` (what a resumed run reads back).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetfl.algorithms import plugin_files, registered_outside_files
from hetfl.engine.rundir import check_no_run, lock_run_dir
from hetfl.flower import INSTALL_HINT, check_flower, offline_defaults, require_flwr
from hetfl.flower.client_app import app as client_app
from hetfl.flower.protocol import NODES_DIR, PLUGINS_ENV, TRUSTED_ROOTS_ENV
from hetfl.flower.server import FlowerFederation
from hetfl.params import ConfigError

if TYPE_CHECKING:
    from hetfl.engine.experiment import Experiment
    from hetfl.engine.summary import Reporter


def run_simulation(exp: Experiment, run_dir: str | Path, *, resume: bool = False,
                   reporter: Reporter | None = None) -> dict[str, Any]:
    """Run (or continue) ``exp`` in ``run_dir`` with its clients on Flower's simulation engine."""
    return run_simulations([(exp, run_dir, resume)], reporter=reporter)[0]


def run_simulations(jobs: list[tuple[Experiment, str | Path, bool]], *, reporter: Reporter | None = None,
                    verbose: bool = False) -> list[dict[str, Any]]:
    """Several experiments one after another in one Flower simulation (one Ray start-up):
    ``jobs`` of (experiment, run directory, resume); their summaries."""
    require_flwr()
    if importlib.util.find_spec("ray") is None:
        raise ConfigError("runtime.executor", "flower",
                          f"the simulation needs Ray, which is not installed: {INSTALL_HINT}")
    for exp, _, _ in jobs:
        check_flower(exp.cfg)  # settings the Flower executor cannot honour, before any run directory is touched
    check_nodes_know([exp.cfg.algorithm.name for exp, _, _ in jobs])
    offline_defaults()
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp


    summaries: list[dict[str, Any]] = []
    stop = threading.Event()  # ends the ServerApp thread's round loop when the engine stops under it
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        for exp, run_dir, resume in jobs:
            state_root = str(Path(run_dir).resolve() / NODES_DIR)
            in_process = exp.federation
            exp.federation = FlowerFederation(exp, grid, state_root=state_root, poll_s=0.01, simulation=True,
                                              stop=stop, startup_s=900.0)
            try:
                summaries.append(exp.run(run_dir, resume=resume, reporter=reporter))
            finally:
                exp.federation = in_process

    with contextlib.ExitStack() as locks:  # every job's run directory, for the whole simulation
        for _, run_dir, resume in jobs:
            if locks.enter_context(lock_run_dir(Path(run_dir))) and not resume:
                check_no_run(Path(run_dir))
        with _trusted_state_roots([str(Path(run_dir).resolve() / NODES_DIR) for _, run_dir, _ in jobs]), \
                _listed(PLUGINS_ENV, plugin_files()):
            _simulate(server_app, client_app, jobs, stop, verbose)
    if len(summaries) != len(jobs):
        raise RuntimeError("the Flower simulation ended before its runs finished (see the log above)")
    return summaries


def check_nodes_know(methods: list[str]) -> None:
    """Refuse, before anything runs, a method that the simulated nodes (Ray's worker processes) cannot import:
    one registered in this process by code outside a plug-in file (a notebook's cell). A plug-in file's methods
    they load themselves (:data:`PLUGINS_ENV`)."""
    unknown = registered_outside_files(methods)
    if unknown:
        raise ConfigError("runtime.executor", "flower",
                          f"the method(s) {', '.join(unknown)} were registered in this process, not by a plug-in "
                          "file, so the simulation's nodes (separate processes) cannot know them; put them in a "
                          "file and pass it as --plugin FILE (plugins= in Python)")


@contextlib.contextmanager
def _trusted_state_roots(roots: list[str]) -> Iterator[None]:
    """The simulation's nodes may keep client state in the run folders' ``flower_nodes/`` that the server
    names: the folders listed in the environment the nodes (Ray's workers, started now) inherit, for the
    simulation's duration. A node trusts no server-chosen folder otherwise (:func:`hetfl.flower.node.state_root`)."""
    with _listed(TRUSTED_ROOTS_ENV, roots):
        yield


@contextlib.contextmanager
def _listed(variable: str, values: list[str]) -> Iterator[None]:
    """``values`` listed (os.pathsep-separated) in the environment variable ``variable`` before what it held, for
    the simulation's duration: the nodes (Ray's workers, started inside) inherit it."""
    before = os.environ.get(variable)
    os.environ[variable] = os.pathsep.join([*values, *([before] if before else [])])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = before


def _simulate(server_app: Any, client_app: Any, jobs: list[tuple[Experiment, str | Path, bool]],
              stop: threading.Event, verbose: bool) -> None:
    """Flower's simulation engine running ``server_app`` (the jobs' round loops) to its end."""
    from flwr.simulation import run_simulation as flower_run_simulation

    runtime = jobs[0][0].cfg.runtime
    backend_config = {
        "client_resources": {"num_cpus": runtime.flower_client_cpus, "num_gpus": runtime.flower_client_gpus},
        "init_args": {"logging_level": "error", "log_to_driver": verbose, "include_dashboard": False},
    }
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    if not verbose:
        flwr_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)
            flower_run_simulation(server_app=server_app, client_app=client_app,
                                  num_supernodes=max(exp.cfg.data.num_clients for exp, _, _ in jobs),
                                  backend_config=backend_config, verbose_logging=verbose)
    finally:
        stop.set()  # Ctrl-C or an error in the engine: the ServerApp thread stops at its next poll
        flwr_log.setLevel(level)
