"""hetfl's Flower ServerApp for deployment (``hetfl.flower.server_app:app``), run by ``flwr run``.

Run config keys (``[tool.flwr.app.config]`` of the app, or ``flwr run --run-config FILE``):

``hetfl-config``  the hetfl run configuration, TOML text (what ``hetfl run`` would read)
``run-dir``       the run directory on the SuperLink's machine (config.toml, metrics.jsonl,
                  summary.json, checkpoint.safetensors are written there)
``resume``        true to continue the run in ``run-dir`` from its checkpoint
``poll-s``        seconds between the server's polls for replies (default 0.5)
``plugins``       the plug-in files the app holds, loaded here and on every node before the run is set up
                  (:mod:`hetfl.flower.app_plugins`; written by :func:`hetfl.flower.deploy.write_run_config`)
"""

from __future__ import annotations

import json
import logging
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from hetfl import config as config_mod
from hetfl import tracking
from hetfl.engine.experiment import Experiment
from hetfl.engine.rundir import RunDirError
from hetfl.flower import check_flower, offline_defaults
from hetfl.flower.app_plugins import load_app_plugins
from hetfl.flower.server import FlowerFederation

offline_defaults()
app = ServerApp()
log = logging.getLogger("hetfl")


class LogReporter:
    """Progress as log lines (the ServerApp has no terminal)."""

    shows_notes = True  # note() logs them: the experiment does not log them a second time

    def start(self, cfg: Any, start_round: int, exp: Any) -> None:
        rounds = cfg.train.rounds
        log.warning("hetfl on Flower: %s, %d clients, %d round%s%s", cfg.algorithm.name, cfg.data.num_clients,
                    rounds, "" if rounds == 1 else "s", f", resuming after round {start_round}" if start_round else "")

    def round_start(self, round_: int, num_clients: int) -> None: ...
    def client_done(self) -> None: ...

    def round_end(self, line: dict[str, Any]) -> None:
        keys = ("round", "train_loss", "global_acc", "client_acc_mean", "failed_clients", "round_time_s")
        log.warning("hetfl: %s", json.dumps({k: line[k] for k in keys if k in line}))

    def finish(self, summary: dict[str, Any]) -> None:
        log.warning("hetfl: finished, %s", json.dumps({k: v for k, v in summary.items() if k != "config"}))

    def note(self, message: str) -> None:
        log.warning("hetfl: %s", message)


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_config = context.run_config
    load_app_plugins(run_config)  # before the config: its method may be a plug-in's
    cfg = config_mod.from_dict(tomllib.loads(str(run_config["hetfl-config"])))
    cfg = replace(cfg, runtime=replace(cfg.runtime, executor="flower"))  # what config.toml will say
    check_flower(cfg)  # settings the Flower executor cannot honour
    run_dir = Path(str(run_config["run-dir"]))
    resume = bool(run_config.get("resume", False))
    if not resume and run_dir.exists() and any(run_dir.iterdir()):
        raise RunDirError(f"run-dir {run_dir}: already exists and is not empty; set resume = true or another run-dir")
    exp = Experiment(cfg, trackers=tracking.TRACKERS)  # tracked as hetfl run tracks (hetfl.tracking)
    exp.federation = FlowerFederation(exp, grid, poll_s=float(run_config.get("poll-s", 0.5)))
    exp.run(run_dir, resume=resume, reporter=LogReporter())  # type: ignore[arg-type]
