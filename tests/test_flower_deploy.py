"""hetfl deployed on Flower: a SuperLink and 3 SuperNodes as separate processes on the loopback.

TLS with a CA and certificate made here; then a run where one SuperNode is SIGKILLed mid-run.
Every process is started in its own process group and the fixture kills the groups, so nothing
is left behind. Skipped when Flower is not installed (``pip install "hetfl[flower]"``).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason='Flower is not installed: pip install "hetfl[flower]"')

from hetfl import config
from hetfl.engine.experiment import Experiment
from hetfl.flower.deploy import LocalFederation, generate_tls, wait_for

SMALL = ["data.num_clients=3", "data.partition=dirichlet", "train.batch_size=16", "train.local_steps=10",
         "model.options={hidden = [16]}", "runtime.progress=false", "runtime.threads=1"]
DROP = {"round_time_s", "eval_time_s", "failed_clients", "flower_bytes_down", "flower_bytes_up"}


def lines(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def federation(tmp_path):
    started: list[LocalFederation] = []

    def make(num_nodes: int, tls: bool) -> LocalFederation:
        fed = LocalFederation(tmp_path / "federation", num_nodes,
                              tls=generate_tls(tmp_path / "tls") if tls else None)
        started.append(fed)
        return fed.start()

    yield make
    for fed in started:
        groups = [p.popen.pid for p in [*fed.nodes, fed.superlink] if p is not None]
        fed.stop()
        assert wait_for(lambda groups=groups: not any(group_alive(g) for g in groups), 20), "processes left behind"


def log_tail(fed: LocalFederation) -> str:
    return "\n".join(f"--- {p.name}\n" + p.log.read_text()[-2000:] for p in [fed.superlink, *fed.nodes]) + \
        "\n--- flwr run\n" + (fed.workdir / "flwr-run.log").read_text()[-3000:]


def test_deployed_run_over_tls_gives_the_sequential_numbers(federation, tmp_path):
    """SCAFFOLD (client state kept by each SuperNode between its ClientApp processes) over TLS:
    the same metrics as the in-process sequential executor."""
    overrides = [*SMALL, "train.rounds=2", "algorithm.name=scaffold", "runtime.flower_timeout_s=120"]
    Experiment(config.load(None, overrides)).run(tmp_path / "sequential")
    fed = federation(3, tls=True)
    cfg = config.load(None, [*overrides, "runtime.executor=flower"])
    result = fed.submit(config.dumps(cfg), tmp_path / "deployed", timeout_s=240)
    run = tmp_path / "deployed"
    assert result.returncode == 0 and (run / "summary.json").exists(), log_tail(fed)
    assert "--insecure" not in " ".join(fed.superlink.popen.args)
    assert {"config.toml", "metrics.jsonl", "summary.json", "checkpoint.safetensors"} <= {p.name for p in run.iterdir()}
    got = lines(run)
    assert [x["failed_clients"] for x in got] == [[], []]
    assert [{k: v for k, v in x.items() if k not in DROP} for x in got] == \
        [{k: v for k, v in x.items() if k not in DROP} for x in lines(tmp_path / "sequential")]


def test_a_supernode_killed_mid_run_is_recorded_and_the_run_finishes(federation, tmp_path):
    """SIGKILL one SuperNode (and its ClientApp processes) after round 1: round 2 waits for it up
    to runtime.flower_timeout_s, goes on with the two clients that answered, and says so."""
    fed = federation(3, tls=False)  # --insecure: loopback only
    cfg = config.load(None, [*SMALL, "train.rounds=2", "algorithm.name=fedavg", "runtime.flower_timeout_s=25",
                             "runtime.flower_min_replies=2"])
    run = tmp_path / "deployed"
    import threading

    submitted: dict = {}
    thread = threading.Thread(target=lambda: submitted.update(
        result=fed.submit(config.dumps(cfg), run, timeout_s=240)))
    thread.start()
    try:
        assert wait_for(lambda: len(lines(run)) >= 1 or not thread.is_alive(), 180, poll_s=0.2), log_tail(fed)
        fed.nodes[2].kill(signal.SIGKILL)
    finally:
        thread.join(260)
    assert submitted["result"].returncode == 0 and (run / "summary.json").exists(), log_tail(fed)
    got = lines(run)
    assert [x["round"] for x in got] == [1, 2]
    assert got[0]["failed_clients"] == [] and got[0]["local_steps"] > 0
    assert got[1]["failed_clients"] == [2], log_tail(fed)
    assert got[1]["clients"] == 3 and 0 < got[1]["local_steps"] < got[0]["local_steps"]  # 2 of 3 trained


def test_relative_folders_are_made_absolute_for_the_processes(tmp_path, monkeypatch):
    """The SuperLink runs in the federation's folder: a relative certificate path would point nowhere."""
    monkeypatch.chdir(tmp_path)
    tls = generate_tls("tls")
    assert all(p.is_absolute() and p.exists() for p in (tls.ca, tls.cert, tls.key))
