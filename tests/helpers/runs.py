"""Run configurations and fake runs for the tests of the API, ``hetfl reproduce`` and the seed bands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

TINY = ["data.partition=iid", "data.num_clients=4", "data.options={num_devices=8, max_samples=60}",
        "train.rounds=2", "train.local_steps=2", "runtime.threads=1"]


PRESET = """
[preset]
title = "toy"
paper = "nobody"
metric = "final_global_acc"
seeds = [0, 1]
[base.train]
rounds = 6
[[columns]]
id = "c"
label = "C"
[[rows]]
label = "A"
algorithm = "fedavg"
paper = { "c" = 50.0 }
[[rows]]
label = "B"
algorithm = "fedprox"
metric = "best5:global_acc"
[quick]
seeds = [0]
"""


def fake_run(accs):
    def run(cfg, run_dir, resume):
        assert not resume
        run_dir.mkdir(parents=True)
        curve = [a + 0.01 * cfg.seed for a in accs[cfg.algorithm.name]]
        lines = [json.dumps({"round": i + 1, "global_acc": a}) for i, a in enumerate(curve)]
        (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        (run_dir / "summary.json").write_text(json.dumps({"final_global_acc": curve[-1]}))

    return run


def interrupted(run_dir: Path, stop_after: int, monkeypatch: Any, cfg: Any, *, resume: bool = False) -> None:
    """``cfg`` (a RunConfig) run into ``run_dir`` (``resume``: resumed there) and interrupted (KeyboardInterrupt)
    at the start of round ``stop_after + 1``, as Ctrl-C would."""
    from hetfl.engine.experiment import Experiment
    from hetfl.runtimes import set_up

    original = Experiment.round

    def crash(self, server, clients, round_, reporter):
        if round_ == stop_after + 1:
            raise KeyboardInterrupt
        return original(self, server, clients, round_, reporter)

    monkeypatch.setattr(Experiment, "round", crash)
    with pytest.raises(KeyboardInterrupt):
        set_up(cfg).run(run_dir, resume=resume)  # tracked as configured (hetfl.tracking)
    monkeypatch.setattr(Experiment, "round", original)
