"""One writer per run directory, and a resume that checks the history it continues (issue 16).

Reproductions of the issue (each failed before the fix): two ``hetfl run`` on one ``--out`` at once,
two ``--resume`` of one directory at once, a finished run whose ``metrics.jsonl`` lost or cut a line
resumed as if nothing happened, ``run_experiment`` overwriting a directory that holds a run. Then a
fault-injection test: a run SIGKILLed at seeded random points (between a round's line and its
checkpoint, inside the checkpoint write, half-way through a line, before the summary) and resumed
writes the uninterrupted run's metrics; a live holder is named; a damaged file is refused naming
the file and the round. Kills happen in a driver process (``DRIVER``) that patches hetfl's own
functions to SIGKILL itself at the chosen point, so the points are exact and the test is fast; the
processes of the kill and race tests are forked from one driver that imported hetfl once (``Forks``).
"""

from __future__ import annotations

import json
import logging
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hetfl import config
from hetfl.cli import main
from hetfl.engine.checkpoint import load_checkpoint, save_checkpoint
from hetfl.engine.experiment import Experiment
from hetfl.engine.rundir import RunDirError
from hetfl.flower.deploy import wait_for
from hetfl.runtimes import run_experiment
from tests.helpers.runs import interrupted

pytestmark = pytest.mark.usefixtures("one_thread")

TIME_KEYS = {"round_time_s", "eval_time_s"}
# 4 clients of ~95 synthetic samples, logistic regression: a round takes a few ms
TINY = ["data.partition=iid", "data.num_clients=4", "data.options={num_devices=8, max_samples=60}",
        "runtime.progress=false", "runtime.threads=1"]
LOCK = ".lock"

# Runs ``hetfl.cli.main(argv)`` with one fault injected: SIGKILL at a chosen point (the checkpoint
# kinds: at the first checkpoint of round >= "round"), or a pause (the process then holds the run
# directory until it is killed), or none. argv[1]: the fault as JSON {"kind", "round", "marker"}; the
# rest: hetfl's command line. With argv[1] "serve", a fork server (``Forks``): it imports hetfl once
# and forks a process for each command it reads on stdin.
DRIVER = r'''
import json, os, signal, sys, time, traceback
from pathlib import Path

import hetfl.engine.checkpoint as ck
import hetfl.engine.experiment as ex
import hetfl.engine.rundir as rd
from hetfl.cli import main


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def inject(fault):
    kind, at = fault["kind"], fault.get("round")
    if kind == "pause":  # hold the run directory: wait at the start of round `at`
        original_round = ex.Experiment.round

        def round_(self, server, clients, round_, reporter):
            if round_ == at:
                Path(fault["marker"]).write_text(str(os.getpid()))
                time.sleep(600)
            return original_round(self, server, clients, round_, reporter)

        ex.Experiment.round = round_
    elif kind in ("after_line", "half_line"):  # metrics line of round `at` written (or half of it), no checkpoint
        original_append = rd.MetricsLog.append

        def append(self, line):
            if line["round"] == at:
                if kind == "half_line":
                    raw = (json.dumps(line) + "\n").encode()
                    self.file.write(raw[: len(raw) // 2])
                    self.file.flush()
                else:
                    original_append(self, line)
                die()
            original_append(self, line)

        rd.MetricsLog.append = append
    elif kind in ("in_checkpoint", "after_checkpoint"):
        original_save = ck.save_file  # safetensors' writer, called on the temporary file

        def save_file(tensors, filename, metadata=None):
            original_save(tensors, filename, metadata=metadata)
            if kind == "in_checkpoint" and int(metadata.get("round", 0)) >= at:
                die()  # temporary file written, not yet renamed over the checkpoint

        ck.save_file = save_file
        original_checkpoint = ex.save_checkpoint

        def save_checkpoint(run_dir, ckpt):
            original_checkpoint(run_dir, ckpt)
            if kind == "after_checkpoint" and ckpt.round >= at:
                die()

        ex.save_checkpoint = save_checkpoint
    elif kind == "before_summary":
        original_write = ex.atomic_write_text

        def atomic_write_text(path, text):
            if path.name == "summary.json":
                die()
            original_write(path, text)

        ex.atomic_write_text = atomic_write_text
    else:
        assert kind == "none", kind


def child(fault, argv, log):
    # the forked process: its output to `log`, its exit status main's (never back into the server's loop)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 1
    try:
        inject(fault)
        code = main(argv)
    except SystemExit as stop:
        code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve():
    # one JSON command a line: {"start": [fault, argv, log]} forks a process running it and answers its pid;
    # {"wait": pid} answers its exit status once it has ended (-9: SIGKILL), as Popen.returncode says it
    for line in sys.stdin:
        command = json.loads(line)
        if "start" in command:
            pid = os.fork()
            if pid == 0:
                child(*command["start"])
            answer = {"pid": pid}
        else:
            answer = {"status": os.waitstatus_to_exitcode(os.waitpid(command["wait"], 0)[1])}
        print(json.dumps(answer), flush=True)


if sys.argv[1] == "serve":
    serve()
else:
    inject(json.loads(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
'''
KILL_KINDS = ["after_line", "half_line", "in_checkpoint", "after_checkpoint", "before_summary"]


def metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIME_KEYS} for line in lines]


def tiny(*overrides: str) -> config.RunConfig:
    return config.load(None, [*TINY, *overrides])


def cli_args(*overrides: str) -> list[str]:
    return [a for o in [*TINY, *overrides] for a in ("--set", o)]


def driver(tmp_path: Path, fault: dict, *argv: str) -> subprocess.Popen:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(script), json.dumps(fault), *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class Forks:
    """hetfl commands in processes forked from one driver process (``DRIVER serve``), which imported hetfl
    once: each command is a process of its own (its pid in the lock file, killed by a real SIGKILL, its
    files written as any process writes them), without the ~2 s of CPU a fresh interpreter spends importing
    torch and hetfl (five such processes a seed made test_fault_injection_long's 12-20 s)."""

    def __init__(self, tmp_path: Path) -> None:
        script = tmp_path / "driver.py"
        script.write_text(DRIVER)
        self.tmp, self.logs, self.running = tmp_path, {}, set()
        self.err = (tmp_path / "driver.err").open("w")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, str(script), "serve"], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, bufsize=0)

    def ask(self, command: dict) -> dict:
        """Send ``command``, read the driver's one-line answer (120 s at most)."""
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        line = b""
        while not line.endswith(b"\n"):
            ready, _, _ = select.select([self.proc.stdout], [], [], 120)
            chunk = os.read(self.proc.stdout.fileno(), 1) if ready else b""
            assert chunk, f"no answer to {command}: {(self.tmp / 'driver.err').read_text()}"
            line += chunk
        return json.loads(line)

    def start(self, fault: dict, *argv: str) -> int:
        """Fork a process running ``hetfl argv`` with ``fault`` injected (DRIVER's kinds, or "none"); its pid."""
        log = self.tmp / f"fork-{len(self.logs)}.log"
        pid = self.ask({"start": [fault, list(argv), str(log)]})["pid"]
        self.logs[pid] = log
        self.running.add(pid)
        return pid

    def wait(self, pid: int) -> tuple[int, str]:
        """The process's exit status (as ``Popen.returncode``: -9 for SIGKILL) and its output."""
        status = self.ask({"wait": pid})["status"]
        self.running.discard(pid)
        return status, self.logs[pid].read_text()

    def close(self) -> None:
        for pid in list(self.running):  # a failed test's processes: ended, not left behind
            os.kill(pid, signal.SIGKILL)
            self.wait(pid)
        self.proc.kill()  # no process of its own left: not worth its interpreter's exit (~0.5 s)
        self.proc.wait(timeout=60)
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.err.close()


@pytest.fixture
def forks(tmp_path):
    driver = Forks(tmp_path)
    yield driver
    driver.close()


def finished_run(run_dir: Path, rounds: int = 6, *overrides: str) -> None:
    assert main(["run", "--out", str(run_dir), *cli_args(f"train.rounds={rounds}", *overrides), "--quiet"]) == 0


def interrupted_run(run_dir: Path, stop_after: int, monkeypatch, *overrides: str) -> None:
    """A run of ``tiny(*overrides)`` interrupted (KeyboardInterrupt) in round ``stop_after + 1``."""
    interrupted(run_dir, stop_after, monkeypatch, tiny(*overrides))


def resume(run_dir: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["run", "--resume", str(run_dir), "--quiet"])
    return code, capsys.readouterr().err


def lines_of(run_dir: Path) -> list[str]:
    return (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)


def write_lines(run_dir: Path, lines: list[str]) -> None:
    (run_dir / "metrics.jsonl").write_text("".join(lines))


# ------------------------------------------------------------- one writer
def test_two_runs_started_at_once_on_one_out_one_wins_the_other_exits_2(tmp_path, forks):
    """Issue: both exited 0 and the run directory mixed files of the two runs."""
    out = tmp_path / "same"
    a = forks.start({"kind": "none"}, "run", "--out", str(out), *cli_args("train.rounds=6", "seed=1"))
    b = forks.start({"kind": "none"}, "run", "--out", str(out), *cli_args("train.rounds=4", "seed=2"))
    results = [forks.wait(pid) for pid in (a, b)]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    winner = 6 if results[0][0] == 0 else 4
    loser_err = next(err for code, err in results if code == 2)
    # refused by the lock while the winner runs, or, started after it finished, for the run it left
    refusals = ("in use by another hetfl run (pid ", "already holds a run", "already exists and is not empty")
    assert str(out) in loser_err and any(r in loser_err for r in refusals), loser_err
    assert config.load(out / "config.toml").train.rounds == winner
    assert [m["round"] for m in metrics(out)] == list(range(1, winner + 1))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == winner and summary["config"]["train"]["rounds"] == winner
    assert load_checkpoint(out, torch.device("cpu")).round == winner
    assert not (out / LOCK).exists()


def test_two_resumes_at_once_write_each_round_once(tmp_path, monkeypatch, capsys, forks):
    """Issue: two ``--resume`` of one directory wrote rounds 4-10 twice (17 lines), both exit 0."""
    Experiment(tiny("train.rounds=10")).run(tmp_path / "full")
    run = tmp_path / "run"
    interrupted_run(run, 3, monkeypatch, "train.rounds=10")
    a, b = (forks.start({"kind": "none"}, "run", "--resume", str(run)) for _ in range(2))
    results = [forks.wait(pid) for pid in (a, b)]
    assert metrics(run) == metrics(tmp_path / "full"), "each round once, in order, the uninterrupted numbers"
    codes = sorted(code for code, _ in results)
    errs = " ".join(err for _, err in results)
    # the second either finds the first holding the lock, or (started late) finds the run finished
    assert (codes == [0, 2] and "in use by another hetfl run (pid " in errs) or (
        codes == [0, 0] and "already finished" in errs), results
    assert not (run / LOCK).exists()


def paused_run(tmp_path: Path, run: Path, *, pause_round: int, rounds: int) -> subprocess.Popen:
    """``hetfl run --out run`` in a process that pauses in ``pause_round`` (of ``rounds``), holding the folder's
    lock; returned once it is paused."""
    marker = tmp_path / "paused"
    holder = driver(tmp_path, {"kind": "pause", "round": pause_round, "marker": str(marker)},
                    "run", "--out", str(run), *cli_args(f"train.rounds={rounds}"))
    deadline = time.time() + 120
    while not marker.exists() and holder.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists(), holder.communicate()
    return holder


def test_a_live_holder_is_named_and_a_killed_holders_lock_is_taken_over(tmp_path, capsys, caplog):
    """A run paused in round 3 holds the directory: a new run and a resume there exit 2 naming its pid
    and host; once it is SIGKILLed, its lock file is stale, and a resume takes it over (logged)."""
    run = tmp_path / "run"
    holder = paused_run(tmp_path, run, pause_round=3, rounds=5)
    try:
        info = json.loads((run / LOCK).read_text())
        assert info["pid"] == holder.pid and info["host"] == socket.gethostname() and info["started"]
        for argv in (["run", "--out", str(run), *cli_args("train.rounds=5", "seed=3")], ["run", "--resume", str(run)]):
            capsys.readouterr()
            assert main([*argv, "--quiet"]) == 2
            err = capsys.readouterr().err
            assert f"in use by another hetfl run (pid {holder.pid} on host {socket.gethostname()}" in err, err
        with pytest.raises(RunDirError, match=f"pid {holder.pid}"):
            run_experiment(tiny("train.rounds=5"), run, resume=True)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate()
    assert json.loads((run / LOCK).read_text())["pid"] == holder.pid  # left behind by the kill
    with caplog.at_level(logging.WARNING, logger="hetfl"):
        code, err = resume(run, capsys)
    assert code == 0, err
    assert any("stale lock" in r.getMessage() and f"pid {holder.pid}" in r.getMessage() for r in caplog.records)
    Experiment(tiny("train.rounds=5")).run(tmp_path / "full")
    assert metrics(run) == metrics(tmp_path / "full")
    assert not (run / LOCK).exists()


@pytest.mark.slow
def test_sigterm_removes_the_lock_and_the_run_resumes(tmp_path, capsys):
    """Issue 26, item 6: a run stopped with SIGTERM (a service manager, ``kill``, a batch system's time limit)
    ends as Ctrl-C does: exit 130, its lock file removed (the README's promise), resumable."""
    run = tmp_path / "run"
    holder = paused_run(tmp_path, run, pause_round=2, rounds=3)
    try:
        holder.send_signal(signal.SIGTERM)
        _, err = holder.communicate(timeout=120)
    finally:
        if holder.poll() is None:
            holder.send_signal(signal.SIGKILL)
            holder.communicate()
    assert holder.returncode == 130, err
    assert "interrupted" in err
    assert not (run / LOCK).exists()
    code, err = resume(run, capsys)
    assert code == 0, err


def test_a_lock_left_on_another_host_is_refused_not_taken_over(tmp_path, monkeypatch):
    run = tmp_path / "run"
    interrupted_run(run, 2, monkeypatch, "train.rounds=4")
    (run / LOCK).write_text(json.dumps({"pid": 12345, "host": "elsewhere.example", "started": "x"}))
    with pytest.raises(RunDirError, match=r"pid 12345 on host elsewhere\.example.*delete .*\.lock"):
        Experiment(tiny("train.rounds=4")).run(run, resume=True)
    assert json.loads((run / LOCK).read_text())["host"] == "elsewhere.example"


def test_the_lock_is_released_on_an_exception_and_on_ctrl_c(tmp_path, monkeypatch):
    original = Experiment.round
    seen = {}

    def fail(self, server, clients, round_, reporter):
        seen[round_] = json.loads((tmp_path / "r" / LOCK).read_text())  # held while the rounds run
        if round_ == 2:
            raise RuntimeError("boom")
        return original(self, server, clients, round_, reporter)

    monkeypatch.setattr(Experiment, "round", fail)
    with pytest.raises(RuntimeError, match="boom"):
        Experiment(tiny("train.rounds=3")).run(tmp_path / "r")
    assert seen[1]["pid"] == os.getpid() and not (tmp_path / "r" / LOCK).exists()
    monkeypatch.setattr(Experiment, "round", original)
    interrupted_run(tmp_path / "k", 1, monkeypatch, "train.rounds=3")
    assert not (tmp_path / "k" / LOCK).exists()
    assert Experiment(tiny("train.rounds=3")).run(tmp_path / "k", resume=True)["rounds"] == 3


def test_run_experiment_refuses_a_directory_that_holds_a_run(tmp_path):
    """Related issue: the library entry silently overwrote an existing run directory."""
    run = tmp_path / "run"
    run_experiment(tiny("train.rounds=2"), run)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    with pytest.raises(RunDirError, match="already holds a run.*resume"):
        run_experiment(tiny("train.rounds=3", "seed=5"), run)
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    other = tmp_path / "notes"
    other.mkdir()
    (other / "mine.txt").write_text("x")
    with pytest.raises(RunDirError, match="mine.txt"):
        run_experiment(tiny("train.rounds=2"), other)
    assert sorted(p.name for p in other.iterdir()) == ["mine.txt"]


class EngineStopped(Exception):
    """Raised by the stand-in for Flower's engine."""


def test_the_flower_simulation_holds_every_jobs_lock_and_checks_them_first(tmp_path, monkeypatch):
    """``run_simulations`` locks each job's run directory (and refuses one holding a run) before
    Flower's engine starts, and holds the locks until it stops; the engine itself is stubbed here."""
    pytest.importorskip("flwr")
    pytest.importorskip("ray")
    from hetfl.flower import simulation

    exps = [Experiment(tiny("train.rounds=1", "runtime.executor=flower")) for _ in range(2)]
    seen = []

    def engine(server_app, client_app, jobs, stop, verbose):
        seen.extend(json.loads((Path(run_dir) / LOCK).read_text())["pid"] for _, run_dir, _ in jobs)
        raise EngineStopped

    monkeypatch.setattr(simulation, "_simulate", engine)
    with pytest.raises(EngineStopped):
        simulation.run_simulations([(exps[0], tmp_path / "a", False), (exps[1], tmp_path / "b", False)])
    assert seen == [os.getpid()] * 2 and not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.jsonl").write_text("")
    with pytest.raises(RunDirError, match="already holds a run"):
        run_experiment(exps[0], tmp_path / "b")  # the flower runtime: the simulation, under the lock
    assert len(seen) == 2 and not (tmp_path / "b" / LOCK).exists()


# ------------------------------------------------------- checked history
@pytest.mark.parametrize(("damage", "bad_round"), [
    ("delete_last", 6), ("cut_last", 6), ("delete_middle", 3), ("delete_file", 1),
    ("edit_value", 2), ("duplicate", 4), ("swap", 2)])
def test_a_damaged_history_is_refused_naming_the_file_and_round(tmp_path, capsys, damage, bad_round):
    """Issue: a finished 6-round run whose last line was deleted or cut resumed with exit 0 and 5 rounds;
    a deleted middle line left rounds [1,2,4,5,6]; a deleted metrics.jsonl gave ``rounds: 0``."""
    run = tmp_path / "run"
    finished_run(run)
    lines = lines_of(run)
    if damage == "delete_last":
        lines = lines[:-1]
    elif damage == "cut_last":
        lines[-1] = lines[-1][: len(lines[-1]) // 2]
    elif damage == "delete_middle":
        del lines[2]
    elif damage == "edit_value":
        line = json.loads(lines[1])
        line["train_loss"] += 0.25
        lines[1] = json.dumps(line) + "\n"
    elif damage == "duplicate":
        lines.insert(3, lines[2])
    elif damage == "swap":
        lines[1], lines[2] = lines[2], lines[1]
    if damage == "delete_file":
        (run / "metrics.jsonl").unlink()
    else:
        write_lines(run, lines)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    code, err = resume(run, capsys)
    assert code == 2, err
    assert f"{run / 'metrics.jsonl'}: round {bad_round}:" in err, err
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before, "a refused resume changes nothing"


def test_a_finished_run_resumed_says_so_and_recomputes_nothing(tmp_path, capsys, caplog):
    run = tmp_path / "run"
    finished_run(run, 3)
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in run.iterdir()}
    with caplog.at_level(logging.WARNING, logger="hetfl"):
        code, err = resume(run, capsys)
    assert code == 0, err
    assert any("already finished" in r.getMessage() for r in caplog.records)
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in run.iterdir()} == before


def test_lines_after_the_checkpoint_are_dropped_and_recomputed(tmp_path, monkeypatch, capsys):
    """checkpoint_every = 2, interrupted in round 4: line 3 is after the checkpoint of round 2; with a
    half-written line after it, both are dropped and the resumed run matches an uninterrupted one."""
    overrides = ("train.rounds=5", "runtime.checkpoint_every=2")
    Experiment(tiny(*overrides)).run(tmp_path / "full")
    run = tmp_path / "run"
    interrupted_run(run, 3, monkeypatch, *overrides)
    assert load_checkpoint(run, torch.device("cpu")).round == 2 and len(lines_of(run)) == 3
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"round": 4, "train_lo')
    code, err = resume(run, capsys)
    assert code == 0, err
    assert metrics(run) == metrics(tmp_path / "full")
    assert json.loads((run / "summary.json").read_text())["rounds"] == 5


def test_a_checkpoint_without_a_history_digest_still_resumes_with_the_weaker_check(tmp_path, monkeypatch, capsys):
    """Checkpoints written before digests were kept: rounds 1..r must be there once, in order, whole."""
    Experiment(tiny("train.rounds=5")).run(tmp_path / "full")
    run = tmp_path / "run"
    interrupted_run(run, 3, monkeypatch, "train.rounds=5")
    ckpt = load_checkpoint(run, torch.device("cpu"))
    ckpt.info = {k: v for k, v in ckpt.info.items() if k != "metrics_history"}
    save_checkpoint(run, ckpt)
    good = lines_of(run)
    write_lines(run, [good[0], good[2]])
    code, err = resume(run, capsys)
    assert code == 2 and f"{run / 'metrics.jsonl'}: round 2:" in err, err
    write_lines(run, good)
    code, err = resume(run, capsys)
    assert code == 0, err
    assert metrics(run) == metrics(tmp_path / "full")


# --------------------------------------------------------- fault injection
def kill_and_resume(tmp_path: Path, capsys, forks: Forks, points: list[tuple[str, int]], rounds: int) -> None:
    """SIGKILL a run at each of ``points`` in turn (each kill in a resume of the last), then resume
    to the end: the metrics are the uninterrupted run's, and no lock or temporary file is left."""
    overrides = (f"train.rounds={rounds}", "runtime.checkpoint_every=2")
    Experiment(tiny(*overrides)).run(tmp_path / "full")
    run = tmp_path / "run"
    argv = ["run", "--out", str(run), *cli_args(*overrides)]
    for kind, at in points:  # every point is met (random_points): each process dies there
        code, err = forks.wait(forks.start({"kind": kind, "round": at}, *argv, "--quiet"))
        assert code == -signal.SIGKILL, (f"the kill point {kind} at round {at} was not met", points, code, err)
        argv = ["run", "--resume", str(run)]
    code, err = resume(run, capsys)
    assert code == 0, (points, err)
    assert metrics(run) == metrics(tmp_path / "full"), points
    summary, full = (json.loads((d / "summary.json").read_text()) for d in (run, tmp_path / "full"))
    assert summary["rounds"] == rounds and summary["final_global_acc"] == full["final_global_acc"]
    clients = "client_metrics.jsonl"  # the per-client file: cut back and recomputed like metrics.jsonl
    assert (run / clients).read_bytes() == (tmp_path / "full" / clients).read_bytes(), points
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint.safetensors", clients, "config.toml",
                                                     "metrics.jsonl", "summary.json"], points


def rounds_written(run: Path) -> int:
    """The number of whole lines in ``run``'s metrics.jsonl (0 before it exists)."""
    path = run / "metrics.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


CHECKPOINT_KINDS = {"in_checkpoint", "after_checkpoint"}


def random_points(seed: int, count: int, rounds: int, every: int = 2) -> list[tuple[str, int]]:
    """``count`` kill points of distinct kinds at seeded random rounds, in the order a run meets them, each met
    by the resume after the previous kill (``kill_and_resume`` checks it).

    A checkpoint kind kills at the first checkpoint (every ``every`` rounds, and the last round's) of its
    round or later: its round is drawn up to the last checkpoint before the final one. A kill at the final
    checkpoint leaves a resume nothing to recompute, and the points after it are never met (seed 1 of the
    long test once killed after round 8's checkpoint of 8, and its other points checked nothing). Sorted by
    the round where each kill happens, and within a round in the order of a round's writes (its line, then
    its checkpoint), every point lies after the checkpoint the previous kill's resume starts from. The summary is
    written after the last round, whatever round its point names."""
    rng = random.Random(seed)
    last_before_final = (rounds - 1) // every * every
    points = [(kind, rng.randint(1, rounds)) for kind in rng.sample(KILL_KINDS, count)]
    points = [(kind, min(at, last_before_final) if kind in CHECKPOINT_KINDS else at) for kind, at in points]

    def killed_at(point: tuple[str, int]) -> tuple[int, int]:
        kind, at = point
        where = rounds + 1 if kind == "before_summary" else -(-at // every) * every if kind in CHECKPOINT_KINDS else at
        return where, KILL_KINDS.index(kind)

    return sorted(points, key=killed_at)


def test_fault_injection_short(tmp_path, capsys, forks):
    """Short form (CI): a run SIGKILLed at two seeded random points (seed 8: inside the checkpoint
    write of round 2, then half-way through the line of round 4), resumed after each; then a
    damaged file is refused naming the file and the round."""
    points = random_points(8, 2, rounds=5)
    assert points == [("in_checkpoint", 2), ("half_line", 4)]
    kill_and_resume(tmp_path, capsys, forks, points, rounds=5)
    run = tmp_path / "run"
    lines = lines_of(run)
    write_lines(run, lines[:1] + lines[2:])
    code, err = resume(run, capsys)
    assert code == 2 and f"{run / 'metrics.jsonl'}: round 2:" in err, err


def test_a_run_killed_before_its_summary_gets_the_same_summary_and_no_temp_files(tmp_path, capsys):
    run = tmp_path / "run"
    finished_run(run, 3)
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").unlink()
    (run / ".checkpoint.safetensors.k1ll3d.tmp").write_bytes(b"half a checkpoint")
    code, err = resume(run, capsys)
    assert code == 0, err
    assert json.loads((run / "summary.json").read_text()) == summary
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint.safetensors", "client_metrics.jsonl", "config.toml",
                                                     "metrics.jsonl", "summary.json"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2))
def test_fault_injection_long(tmp_path, capsys, forks, seed):
    """Long form: four kill points of distinct kinds per run, and a kill at a random moment of a run of 100
    rounds: once its metrics show a seeded random number of rounds (1 to 60), after a random pause of up to 5 ms,
    wherever the run then is (between two rounds, in a line or a checkpoint). The run must still be running
    when killed (a round takes milliseconds: a kill at a random wall-clock time once mostly came after the run
    had ended, and checked nothing)."""
    kill_and_resume(tmp_path, capsys, forks, random_points(seed, 4, rounds=8), rounds=8)
    run, rng = tmp_path / "timed", random.Random(seed)
    overrides = ("train.rounds=100", "runtime.checkpoint_every=3")
    lines, pause = rng.randint(1, 60), rng.uniform(0.0, 0.005)
    pid = forks.start({"kind": "none"}, "run", "--out", str(run), *cli_args(*overrides))
    assert wait_for(lambda: rounds_written(run) >= lines, 120, poll_s=0.001), (lines, rounds_written(run))
    time.sleep(pause)
    os.kill(pid, signal.SIGKILL)
    code, _ = forks.wait(pid)
    assert code == -signal.SIGKILL and not (run / "summary.json").exists(), (lines, pause, code)
    code, err = resume(run, capsys)
    assert code == 0, err
    Experiment(tiny(*overrides)).run(tmp_path / "timed-full")
    assert metrics(run) == metrics(tmp_path / "timed-full")
