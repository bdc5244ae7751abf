"""hetfl deployed on Flower: a SuperLink and SuperNodes as separate processes on the loopback.

The README's deployment over TLS (certificates made by the script) gives the sequential numbers; a run of a
plug-in's method where one SuperNode is SIGKILLed mid-run goes on without it.
Every process is started in its own process group and the script stops the groups, so nothing
is left behind. Skipped when Flower is not installed (``pip install "hetfl[flower]"``).

``examples/flower/deploy.py``: a bad pairing is refused as ``hetfl run`` refuses it, before any
process starts; a run prints its progress while it runs; a ServerApp that fails is reported with
its exception (``flwr run --stream`` itself exits 0 then).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason='Flower is not installed: pip install "hetfl[flower]"')

from hetfl import config
from hetfl.engine.experiment import Experiment
from hetfl.flower.deploy import LocalFederation, LogFollower, RunWatch, generate_tls, serverapp_error, start, wait_for
from tests.helpers.plugins import EMA_PLUGIN
from tests.helpers.readme import readme_command

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


def log_tail(fed: LocalFederation) -> str:
    return "\n".join(f"--- {p.name}\n" + p.log.read_text()[-2000:] for p in [fed.superlink, *fed.nodes]) + \
        "\n--- flwr run\n" + (fed.workdir / "flwr-run.log").read_text()[-3000:]


@pytest.mark.processes
@pytest.mark.slow  # ~60 s; fast cover: test_flower_logic.py's silent or failing client
def test_a_plugins_method_deployed_goes_on_without_a_supernode_killed_mid_run(script, tmp_path, monkeypatch,
                                                                               capsys):
    """Two checks on one federation (each start costs ~15 s): a researcher's own method (``--plugin``) deployed,
    and a SuperNode SIGKILLed (with its ClientApp processes) when round 1 is reported.

    The plug-in: the Flower App carries the file, the ServerApp and every ClientApp load it from there, and its
    client state (kept on the nodes between their ClientApp processes, read again in round 2) gives the numbers
    of the in-process Flower server whose client 2 is down in round 2. Before, the deployment's processes knew
    only hetfl's methods.
    The kill: the script says the node died, round 2 waits for it up to runtime.flower_timeout_s (25 s: a
    healthy training phase took 9.7 s on the shared 2-core machine, 11.5-13.5 s with a CPU-bound process beside
    it; a healthy phase must never time out), goes on with the two clients that answered
    (runtime.flower_min_replies=2) and records the third; nothing is left running."""
    from tests.flower.test_flower_logic import RoundGrid, run_on

    plugin = tmp_path / "ema_method.py"
    plugin.write_text(EMA_PLUGIN)
    sets = [*SMALL, "train.rounds=2", "algorithm.name=emaprox_test", "runtime.flower_min_replies=2"]
    feds: list[LocalFederation] = []
    said: list[str] = []

    class Recorded(LocalFederation):
        def start(self) -> LocalFederation:
            feds.append(self)
            return super().start()

    def say(message: str) -> None:
        said.append(message)
        if message.startswith("round 1/2: "):
            feds[0].nodes[2].kill(signal.SIGKILL)

    monkeypatch.setattr(script, "LocalFederation", Recorded)
    monkeypatch.setattr(script, "say", say)
    code = script.main(["--plugin", str(plugin), *[f"--set={x}" for x in [*sets, "runtime.flower_timeout_s=25"]],
                        "--out", str(tmp_path / "run"), "--workdir", str(tmp_path / "federation"), "--insecure",
                        "--timeout", "300"])
    out, err = capsys.readouterr()
    assert feds, out + err
    fed = feds[0]
    assert code == 0, out + err + log_tail(fed)
    groups = [p.popen.pid for p in [*fed.nodes, fed.superlink]]
    assert wait_for(lambda: not any(group_alive(g) for g in groups), 20), "processes left behind"
    died = [m for m in said if m.startswith("warning: supernode-2 (pid ") and "killed by SIGKILL" in m]
    assert len(died) == 1 and "or runtime.flower_timeout_s = 25 s passes: runtime.flower_grace_s = G" in died[0], said
    assert (tmp_path / "federation" / "app" / "hetfl_plugins" / "0" / "ema_method.py").read_text() == EMA_PLUGIN
    got = lines(tmp_path / "run")
    assert [x["failed_clients"] for x in got] == [[], [2]], "the killed node's client not recorded: " + log_tail(fed)
    assert got[1]["clients"] == 3 and 0 < got[1]["local_steps"] < got[0]["local_steps"]  # 2 of 3 trained
    run_on(RoundGrid(3, 2, 2, "lost"), [*sets, "runtime.flower_timeout_s=0.3"], tmp_path / "in_process")
    in_process = lines(tmp_path / "in_process")
    assert [x["failed_clients"] for x in in_process] == [[], [2]] and in_process[-1]["train_prox"] > 0
    assert [{k: v for k, v in x.items() if k not in DROP} for x in got] == \
        [{k: v for k, v in x.items() if k not in DROP} for x in in_process], "the plug-in's numbers differ"


def test_a_dead_nodes_warning_says_what_a_phase_waits_for_and_how_to_wait_less():
    from hetfl.flower.deploy import _dead_node_wait

    text = config.dumps(config.load(None, ["runtime.executor=flower", "runtime.flower_timeout_s=90"]))
    assert _dead_node_wait(text) == (
        "; a phase that asks it waits until Flower reports the node gone (two missed heartbeats, about a minute) or "
        "runtime.flower_timeout_s = 90 s passes: runtime.flower_grace_s = G ends the wait G s after the quorum "
        "answered")
    text = config.dumps(config.load(None, ["runtime.executor=flower", "runtime.flower_grace_s=3"]))
    assert _dead_node_wait(text) == ("; a phase waits at most 3 s for it once its quorum has answered "
                                     "(runtime.flower_grace_s)")
    assert _dead_node_wait("not toml [") == ""


def test_relative_folders_are_made_absolute_for_the_processes(tmp_path, monkeypatch):
    """The SuperLink runs in the federation's folder: a relative certificate path would point nowhere."""
    monkeypatch.chdir(tmp_path)
    tls = generate_tls("tls")
    assert all(p.is_absolute() and p.exists() for p in (tls.ca, tls.cert, tls.key))


# ------------------------------------------------------------------ examples/flower/deploy.py
def test_a_bad_pairing_exits_2_with_hetfl_runs_message_and_starts_nothing(script, tmp_path, monkeypatch, capsys):
    """FedPAC on the default model (logistic regression: no encoder): the one line ``hetfl run`` prints,
    exit 2, no process started and no folder made (it used to fail inside the ServerApp, minutes later)."""
    from hetfl.cli import main as hetfl_main

    pairing = ["--set", "algorithm.name=fedpac", "--set", "data.num_clients=3", "--set", "data.partition=dirichlet",
               "--set", "runtime.threads=1"]
    assert hetfl_main(["run", *pairing, "--out", str(tmp_path / "cli-run")]) == 2
    expected = capsys.readouterr().err

    def no_process(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    code = script.main([*pairing, "--out", str(tmp_path / "run"), "--workdir", str(tmp_path / "federation")])
    err = capsys.readouterr().err
    assert code == 2
    assert err == expected and err.count("\n") == 1, err
    assert err.startswith("hetfl: error: model.name = 'mlp': fedpac needs an encoder"), err
    assert not (tmp_path / "run").exists() and not (tmp_path / "federation").exists()


@pytest.mark.parametrize("extra", [["--set", "train.rounds=5"], ["run.toml"]])
def test_resume_refuses_a_config_or_a_set_that_changes_the_numbers_as_hetfl_run_does(script, tmp_path, monkeypatch,
                                                                                         capsys, extra):
    """``--resume`` continues the run of ``--out``'s config.toml: a ``--set train.rounds=5`` (to run longer) or a
    CONFIG used to be ignored without a word (the run resumed with its 3 rounds); now exit 2 before any process
    starts, naming what was given, as ``hetfl run --resume`` does."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(config.dumps(config.load(None, [*SMALL, "train.rounds=3"])))
    (tmp_path / "run.toml").write_text("[train]\nrounds = 5\n")
    monkeypatch.chdir(tmp_path)

    def no_process(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    for argv in ([*extra, "--resume", "--out", str(run)], [*extra, "--resume", "--out", str(run),
                                                           "--write-run-config", "o.toml"]):
        assert script.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("hetfl: error: --resume") and err.count("\n") == 1, err
        assert ("train.rounds" in err) if "--set" in extra else ("CONFIG" in err), err
    assert not (tmp_path / "o.toml").exists()
    assert script.main(["--resume", "--out", str(run), "--set", "runtime.client_metrics_every=7", "--write-run-config",
                        "o.toml"]) == 0  # a key that changes no number is taken, as by hetfl run --resume
    assert "client_metrics_every = 7" in (tmp_path / "o.toml").read_text()


class _FakeFederation:
    """What deploy.py drives, without processes: ``run`` writes the run's config.toml (as the ServerApp does
    before round 1), then fails or is interrupted as told."""

    outcome: object = None

    def __init__(self, workdir, *args, **kwargs) -> None:
        self.workdir, self.address = workdir, "127.0.0.1:1"

    def start(self):
        return self

    def stop(self) -> None:
        _FakeFederation.stopped = True

    def run(self, config_text, run_dir, **kwargs):
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        (Path(run_dir) / "config.toml").write_text(config_text)
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


@pytest.mark.parametrize("how", ["failed", "interrupted"])
def test_a_failed_or_interrupted_deployment_says_how_to_continue_it(script, tmp_path, monkeypatch, capsys, how):
    """A run stopped by its quorum (a SuperNode killed) or by Ctrl-C keeps its checkpoint and its nodes' state in
    --workdir; the script used to say only the cause (or print a KeyboardInterrupt traceback): now also the
    command that continues it, with the same --workdir, --data-root and --insecure."""
    from hetfl.flower.deploy import RunOutcome

    _FakeFederation.outcome = RunOutcome(False, "the ServerApp failed: FlowerRoundError: round 2, training: 1 of 2 "
                                                "clients answered") if how == "failed" else KeyboardInterrupt()
    _FakeFederation.stopped = False
    monkeypatch.setattr(script, "LocalFederation", _FakeFederation)
    run, work = tmp_path / "run", tmp_path / "fed"
    code = script.main([*[f"--set={x}" for x in SMALL], "--out", str(run), "--workdir", str(work), "--insecure",
                        "--data-root", str(tmp_path / "data")])
    err = capsys.readouterr().err
    assert code == (1 if how == "failed" else 130) and _FakeFederation.stopped
    assert "Traceback" not in err
    hint = err.splitlines()[-1]
    assert f"--resume --out {run} --workdir {work} --data-root {tmp_path / 'data'} --insecure" in hint, err
    assert hint.startswith("deploy: to continue from the run's last checkpoint") and "deploy.py" in hint, err


FLOWER_201_LOG = """\
Using SuperLink: hetfl (127.0.0.1:46399)
Successfully started run 17780116649122260120
\x1b[92mINFO \x1b[0m:      Start `flwr-serverapp` process
\x1b[91mERROR \x1b[0m:     ServerApp raised an exception
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/flwr/server/run_serverapp.py", line 60, in run
    server_app(grid=grid, context=context)
  File "/src/hetfl/engine/experiment.py", line 246, in __init__
    check_model_parts(cfg.algorithm.name, cfg.model, param_groups(self.model), info.input_shape, info.num_classes)
hetfl.params.ConfigError: model.name = 'mlp': fedpac needs an encoder
\x1b[91mERROR \x1b[0m:     Exit Code: 201

An unhandled exception occurred in the ServerApp.
"""


def test_the_serverapps_exception_is_found_in_flwr_runs_log():
    """What Flower 1.41 streams when the ServerApp raised (and flwr run exits 0): the exception line,
    Flower's exit code and the innermost frames are the cause; the watch sees the failure."""
    cause = serverapp_error(FLOWER_201_LOG)
    assert cause.splitlines()[0] == "hetfl.params.ConfigError: model.name = 'mlp': fedpac needs an encoder " \
                                    "(Flower exit code 201)"
    assert 'File "/src/hetfl/engine/experiment.py", line 246, in __init__' in cause
    assert serverapp_error(FLOWER_201_LOG.replace("Traceback", "Trace")) == ""
    said: list[str] = []
    watch = RunWatch(said.append, rounds=2)
    for line in FLOWER_201_LOG.splitlines():
        watch.feed(line.replace("\x1b[92m", "").replace("\x1b[91m", "").replace("\x1b[0m", ""))
    assert watch.raised and watch.phase.startswith("the ServerApp to start")
    assert said[0] == "SuperLink: started run 17780116649122260120; starting the ServerApp"
    watch.feed('hetfl: {"round": 1, "train_loss": 0.5, "client_acc_mean": 0.25, "failed_clients": [2], '
               '"round_time_s": 3.0}')
    assert said[-1] == "round 1/2: loss 0.5000, client acc 25.00%, failed clients [2], 3.0 s"
    assert watch.phase.startswith("round 2 of 2")


def test_a_dead_process_is_reported_with_its_signal_and_last_log_lines(tmp_path):
    """What the script says of a SuperNode or SuperLink that died: how it ended and what it logged last."""
    import sys

    proc = start("supernode-1", [sys.executable, "-c", "print('\\x1b[92mINFO \\x1b[0m: node up', flush=True); "
                                 "import time; time.sleep(60)"], tmp_path, dict(os.environ))
    try:
        assert wait_for(lambda: "node up" in proc.log.read_text(), 30, poll_s=0.1)
        proc.kill(signal.SIGKILL)
        proc.popen.wait(10)
        report = proc.exit_report()
    finally:
        proc.stop()
    assert report.splitlines()[0] == f"supernode-1 (pid {proc.popen.pid}) was killed by SIGKILL (exit code -9)"
    assert report.splitlines()[-1] == "  INFO : node up"  # colour codes removed


def test_stopping_a_federation_signals_every_process_before_waiting_for_any(tmp_path, monkeypatch):
    """Each Flower process takes about a second to end after its SIGTERM: stopped one after the other, a
    federation took ~4 s (at the end of every run of deploy.py, and on Ctrl-C). All are signalled first, then
    each is waited for and its group SIGKILLed (what a leader left behind)."""
    from hetfl.flower.deploy import Process

    events: list[tuple] = []

    class Popen:
        def __init__(self, pid: int) -> None:
            self.pid = pid

        def wait(self, timeout: float) -> int:
            events.append(("wait", self.pid))
            return 0

    monkeypatch.setattr(os, "killpg", lambda pid, sig: events.append((signal.Signals(sig).name, pid)))
    fed = LocalFederation(tmp_path, 2)
    fed.nodes = [Process(f"supernode-{c}", Popen(10 + c), tmp_path / "log") for c in range(2)]
    fed.superlink = Process("superlink", Popen(20), tmp_path / "log")
    fed.stop()
    first_wait = next(i for i, e in enumerate(events) if e[0] == "wait")
    assert sorted(events[:first_wait]) == [("SIGTERM", 10), ("SIGTERM", 11), ("SIGTERM", 20)], events
    assert all(events.index(("SIGKILL", pid)) > events.index(("wait", pid)) for pid in (10, 11, 20)), events


def test_the_log_is_followed_line_by_line_as_it_grows(tmp_path):
    log = tmp_path / "flwr-run.log"
    log.write_text("old run\n")
    follower = LogFollower(log, log.stat().st_size)
    with open(log, "a") as fh:
        fh.write("hetfl: one\nhetfl: tw")
        fh.flush()
        assert follower.new_lines() == ["hetfl: one"]  # a partial line waits for its end
        fh.write("o\n")
    assert follower.new_lines() == ["hetfl: two"] and follower.new_lines() == []
    assert follower.since_start() == "hetfl: one\nhetfl: two\n"


@pytest.mark.processes
@pytest.mark.slow  # a SuperLink and 2 SuperNodes as processes, ~40 s
def test_the_readmes_deploy_command_prints_its_progress_and_gives_the_sequential_numbers(script, tmp_path,
                                                                                          monkeypatch, capsys):
    """The README's ``python examples/flower/deploy.py ...`` (SCAFFOLD over TLS, made small: 2 SuperNodes, 2
    rounds, as few as keep a control variate per node and one round reading it, and show round 1 while the
    run goes on: with 1 round its line came after summary.json; the README test leaves it to this test): the
    SuperLink, the nodes connecting and each round are printed as they happen (round 1's line before the
    run's summary.json exists), then the summary; the run directory is hetfl's and its numbers are the
    in-process sequential executor's (each SuperNode keeps its client's control variate between its ClientApp
    processes)."""
    said: list[tuple[float, str, bool]] = []
    run = tmp_path / "run"

    def say(message: str) -> None:
        said.append((time.time(), message, (run / "summary.json").exists()))
        print(message)

    args = readme_command("python examples/flower/deploy.py")[2:]
    args[args.index("--out") + 1] = str(run)
    small = {"data.num_clients": "2", "train.rounds": "2"}
    args = [f"{a.split('=')[0]}={small[a.split('=')[0]]}" if a.split("=")[0] in small else a for a in args]
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    assert "--insecure" not in args and {"algorithm.name=scaffold", "data.num_clients=2", "train.rounds=2"} <= set(sets)
    small_rest = [x for x in SMALL if not x.startswith("data.num_clients=")]  # the command's count stays
    Experiment(config.load(None, [*small_rest, *sets])).run(tmp_path / "sequential")
    monkeypatch.setattr(script, "say", say)
    code = script.main([*args, *[f"--set={x}" for x in small_rest], "--workdir", str(tmp_path / "federation"),
                        "--timeout", "400"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    messages = [m for _, m, _ in said]
    order = ["SuperLink up on 127.0.0.1:", "SuperNodes connected: 2/2", "run submitted", "SuperLink: started run",
             "ServerApp: scaffold, 2 clients, 2 rounds;", "round 1/2: loss", "round 2/2: loss", "ServerApp finished"]
    found = [next((i for i, m in enumerate(messages) if m.startswith(p)), None) for p in order]
    assert None not in found and found == sorted(found), messages
    assert "(TLS)" in messages[found[0]]
    got = lines(run)
    for r, line in enumerate(got, 1):
        shown = next(m for m in messages if m.startswith(f"round {r}/2: "))
        assert f"loss {line['train_loss']:.4f}" in shown and f"global acc {100 * line['global_acc']:.2f}%" in shown
    assert not said[found[5]][2], "round 1 was printed only after the run had ended"
    assert '"rounds": 2' in out and f"run directory: {run}" in out
    assert {"config.toml", "metrics.jsonl", "summary.json", "checkpoint.safetensors"} <= {p.name for p in run.iterdir()}
    assert [x["failed_clients"] for x in got] == [[], []]
    assert [{k: v for k, v in x.items() if k not in DROP} for x in got] == \
        [{k: v for k, v in x.items() if k not in DROP} for x in lines(tmp_path / "sequential")]


@pytest.mark.processes
@pytest.mark.slow
def test_a_failure_inside_the_serverapp_is_reported_with_its_cause(script, tmp_path, capsys):
    """A setting that passes every check but fails in the ServerApp (no node can answer its greeting
    within runtime.flower_timeout_s = 0.01 s): flwr run exits 0, the script exits 1 naming the
    exception, not just an exit code."""
    code = script.main([*[f"--set={x}" for x in [*SMALL, "data.num_clients=2", "train.rounds=1",
                                                   "runtime.flower_timeout_s=0.01"]],
                        "--out", str(tmp_path / "run"), "--workdir", str(tmp_path / "federation"), "--insecure",
                        "--timeout", "300"])
    out, err = capsys.readouterr()
    assert code == 1, out + err
    assert "ServerApp raised an exception" in out
    assert "deploy: the run failed: the ServerApp failed: hetfl.flower.server.FlowerRoundError: no Flower node " \
           "holding one of the 2 clients answered within 0.01 s (Flower exit code 201)" in err, err
    assert "exit code 0" not in err
    assert not (tmp_path / "run" / "summary.json").exists()
