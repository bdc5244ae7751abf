"""The run directory's guarantees, function by function (``hetfl.engine.rundir``): what mutation testing of the
module (``benchmarks/mutation.py`` target ``engine_rundir``, session 41) showed the whole-run tests of
``test_run_dir_safety.py`` leave unchecked.

The lock: who holds it and how a refusal names them, a holder still writing its name waited for, a holder that
lets go within the retry window, a lock file replaced while it was being taken, a stale holder's warning (dead, or
its pid reused), re-entry by the process that holds it, the folder a lock created removed when nothing was written
to it, SIGTERM as an interrupt only where the program left it to its default. The history: the lines a resume
keeps and the messages of the ones it refuses, the per-client file cut back to its record, ``History``'s reads.
Each test uses the module's functions directly: no run, a few milliseconds each.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hetfl.engine import rundir
from hetfl.engine.rundir import (
    CLIENT_METRICS_NAME,
    CLIENT_RECORD_KEY,
    LOCK_NAME,
    ClientMetricsLog,
    History,
    MetricsLog,
    RunDirError,
    Terminated,
    check_no_run,
    check_unlocked,
    foreign_entries,
    is_run_entry,
    line_digest,
    lock_run_dir,
    remove_temp_files,
    restore_client_metrics,
    restore_metrics,
    split_lines,
)


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    return int(done.stdout)


class OtherHolder:
    """Another open file of a run directory's lock with the flock held, as another process would hold it (a flock
    belongs to an open file, so it excludes this process's other opens too), naming ``holder`` in the file."""

    def __init__(self, run_dir: Path, holder: dict | None = None) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if holder is not None:
            os.pwrite(self.fd, json.dumps(holder).encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@pytest.fixture
def other_holder():
    made: list[OtherHolder] = []

    def make(run_dir: Path, holder: dict | None = None) -> OtherHolder:
        made.append(OtherHolder(run_dir, holder))
        return made[-1]

    yield make
    for h in made:
        h.release()


def flock_free(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------ the holder
def test_a_lock_files_holder_is_read_with_a_placeholder_for_a_missing_start_and_none_for_anything_else():
    assert rundir._parse_holder(b'{"pid": "12", "host": 7}') == rundir.Holder(12, "7", "?")
    assert rundir._parse_holder(b'{"pid": 3, "host": "h", "started": "t"}').describe() == \
        "pid 3 on host h, started t"
    for raw in (b"", b"{", b'{"host": "h"}', b'{"pid": 1}', b"[1, 2]", b'{"pid": "x", "host": "h"}'):
        assert rundir._parse_holder(raw) is None, raw


def test_this_holder_is_this_process_on_this_host_with_its_start_to_the_second():
    me = rundir.this_holder()
    assert (me.pid, me.host) == (os.getpid(), socket.gethostname())
    assert len(me.started) == len("2026-11-29T09:00:00+00:00") and me.started[10] == "T"


def test_a_holder_still_writing_its_name_is_waited_for_and_a_file_that_never_names_one_is_not_waited_on_forever(
        tmp_path):
    path = tmp_path / LOCK_NAME
    assert rundir._read_holder(path, wait_s=0.05) is None  # no file
    path.write_bytes(b"")
    timer = threading.Timer(0.15, lambda: path.write_text('{"pid": 5, "host": "h", "started": "s"}'))
    timer.start()
    try:
        started = time.monotonic()
        assert rundir._read_holder(path) == rundir.Holder(5, "h", "s")
        assert time.monotonic() - started >= 0.1
    finally:
        timer.join()
    path.write_bytes(b"{half")
    started = time.monotonic()
    assert rundir._read_holder(path, wait_s=0.2) is None
    assert 0.2 <= time.monotonic() - started < 2


class FakeClock:
    """``rundir.time`` stood in for: ``sleep`` advances ``monotonic`` at once and is recorded."""

    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(rundir, "time", fake)
    return fake


def test_a_holders_name_is_polled_every_20_ms_for_a_second(tmp_path, clock):
    path = tmp_path / LOCK_NAME
    path.write_bytes(b"{half")
    assert rundir._read_holder(path) is None
    assert set(clock.sleeps) == {0.02} and 1.0 <= clock.now < 1.03


def test_a_held_flock_is_tried_six_times_with_five_pauses_of_50_ms(tmp_path, clock, monkeypatch):
    tries = []
    monkeypatch.setattr(rundir, "_flock", lambda fd, run_dir: tries.append(fd) or False)
    assert rundir._flock_patiently(3, tmp_path) is False
    assert (len(tries), clock.sleeps) == (6, [0.05] * 5)
    tries.clear()
    clock.sleeps.clear()
    assert rundir._flock_patiently(3, tmp_path, tries=2, pause_s=0.5) is False
    assert (len(tries), clock.sleeps) == (2, [0.5])
    monkeypatch.setattr(rundir, "_flock", lambda fd, run_dir: tries.append(fd) or len(tries) == 2)
    tries.clear()
    clock.sleeps.clear()
    assert rundir._flock_patiently(3, tmp_path) is True
    assert (len(tries), clock.sleeps) == (2, [0.05])


def test_a_pid_is_alive_while_its_process_runs_also_when_it_is_anothers(monkeypatch):
    assert rundir._pid_alive(os.getpid())
    assert not rundir._pid_alive(dead_pid())

    def not_ours(pid, sig):
        assert sig == 0  # a probe, no signal sent
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(rundir.os, "kill", not_ours)
    assert rundir._pid_alive(1)


# ------------------------------------------------------------------------------------------------ the lock
def test_another_holder_is_named_by_a_new_lock_and_by_the_check_before_set_up(tmp_path, other_holder):
    run = tmp_path / "run"
    other_holder(run, {"pid": 4242, "host": "here", "started": "noon"})
    message = (f"{run} is in use by another hetfl run (pid 4242 on host here, started noon); wait for it to "
               "finish, or use another directory")
    with pytest.raises(RunDirError) as err, lock_run_dir(run):
        pass
    assert str(err.value) == message
    with pytest.raises(RunDirError) as err:
        check_unlocked(run)
    assert str(err.value) == message


def test_a_holder_that_has_not_written_its_name_yet_is_said_to_be_one(tmp_path, other_holder, monkeypatch):
    run = tmp_path / "run"
    other_holder(run)
    monkeypatch.setattr(rundir, "_read_holder", lambda path, wait_s=1.0: None)
    with pytest.raises(RunDirError, match=r"in use by another hetfl run \(a process that has not written its pid "
                                          r"yet\)"), lock_run_dir(run):
        pass


def test_a_holder_that_lets_go_within_the_retries_gives_the_lock_and_one_that_does_not_is_refused(
        tmp_path, other_holder):
    run = tmp_path / "run"
    holder = other_holder(run)
    timer = threading.Timer(0.1, holder.release)  # within 6 tries 0.05 s apart
    timer.start()
    try:
        with lock_run_dir(run) as took:
            assert took and json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        timer.join()
    other_holder(run, {"pid": 1, "host": "h", "started": "s"})
    started = time.monotonic()
    with pytest.raises(RunDirError, match="in use"), lock_run_dir(run):
        pass
    assert time.monotonic() - started >= 0.25  # 6 tries, 5 pauses of 0.05 s, before the refusal


def test_a_held_lock_leaves_the_check_before_set_up_alone_in_the_process_that_holds_it(tmp_path):
    run = tmp_path / "run"
    check_unlocked(run)  # no folder, no lock file: nothing to say
    with lock_run_dir(run):
        check_unlocked(run)
        assert not flock_free(run / LOCK_NAME)  # the check took nothing away
    (run / "kept").mkdir(parents=True)
    (run / LOCK_NAME).write_text('{"pid": 1, "host": "h"}')  # a stale file: its flock is free
    check_unlocked(run)
    assert flock_free(run / LOCK_NAME)  # and the check did not keep it


def test_the_lock_file_is_readable_by_all_and_writable_by_its_owner(tmp_path):
    before = os.umask(0o022)
    try:
        with lock_run_dir(tmp_path / "run"):
            mode = stat.S_IMODE(os.stat(tmp_path / "run" / LOCK_NAME).st_mode)
    finally:
        os.umask(before)
    assert mode == 0o644


def test_the_lock_is_reentrant_in_its_process_and_held_until_the_outer_block_ends(tmp_path):
    run = tmp_path / "run"
    with lock_run_dir(run) as outer:
        with lock_run_dir(run) as inner:
            assert (outer, inner) == (True, False)
            with lock_run_dir(run) as third:
                assert third is False
        assert rundir._held[str(run.resolve())].depth == 1
        assert (run / LOCK_NAME).exists() and not flock_free(run / LOCK_NAME)
        (run / "metrics.jsonl").write_text("")
    assert str(run.resolve()) not in rundir._held
    assert not (run / LOCK_NAME).exists() and (run / "metrics.jsonl").exists()
    with lock_run_dir(run) as again:  # taken anew once let go
        assert again is True


def test_a_folder_the_lock_created_goes_when_nothing_was_written_and_a_folder_that_was_there_stays(
        tmp_path, other_holder, monkeypatch):
    new = tmp_path / "a" / "new"
    with lock_run_dir(new):
        assert new.is_dir()
    assert not new.exists() and (tmp_path / "a").is_dir()  # only the folder itself
    there = tmp_path / "there"
    there.mkdir()
    with lock_run_dir(there):
        pass
    assert there.is_dir() and list(there.iterdir()) == []
    busy = tmp_path / "busy"
    other_holder(busy, {"pid": 1, "host": "h", "started": "s"})  # a refused lock leaves a folder that was there
    with pytest.raises(RunDirError), lock_run_dir(busy):
        pass
    assert (busy / LOCK_NAME).exists()
    def cannot(run_dir):
        raise RunDirError("no lock file can be made here")

    monkeypatch.setattr(rundir, "_acquire", cannot)
    refused = tmp_path / "refused"
    with pytest.raises(RunDirError, match="no lock file"), lock_run_dir(refused):
        pass
    assert not refused.exists()  # ... and removes one it made (a race's winner's lock file would keep it)


def test_a_lock_file_replaced_while_it_was_taken_is_taken_anew_and_one_that_keeps_being_replaced_is_refused(
        tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    real = rundir._flock_patiently
    calls = []

    def replaced_once(fd, run_dir, tries=6, pause_s=0.05):
        calls.append(fd)
        if len(calls) == 1:  # the holder removed it while letting go: this open file is no longer the lock
            os.remove(run_dir / LOCK_NAME)
        return real(fd, run_dir, tries, pause_s)

    monkeypatch.setattr(rundir, "_flock_patiently", replaced_once)
    with lock_run_dir(run):
        assert len(calls) == 2
        assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
        assert not flock_free(run / LOCK_NAME)

    def always_replaced(fd, run_dir, tries=6, pause_s=0.05):
        calls.append(fd)
        os.remove(run_dir / LOCK_NAME)
        return True

    calls.clear()
    monkeypatch.setattr(rundir, "_flock_patiently", always_replaced)
    with pytest.raises(RunDirError) as err, lock_run_dir(run):
        pass
    assert str(err.value) == f"{run}: could not take {LOCK_NAME} (it keeps being replaced)"
    assert len(calls) == 50


@pytest.mark.parametrize("alive", [False, True])
def test_a_stale_lock_is_taken_over_saying_whether_its_holder_died_or_its_pid_was_reused(tmp_path, caplog, alive):
    run = tmp_path / "run"
    run.mkdir()
    pid = os.getpid() if alive else dead_pid()
    (run / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": "then"}))
    with caplog.at_level(logging.WARNING, logger="hetfl"), lock_run_dir(run):
        written = json.loads((run / LOCK_NAME).read_text())
    state = "still running but not holding it (its pid was reused)" if alive else "no longer running"
    assert [r.getMessage() for r in caplog.records] == [
        f"{run}: taking over the stale lock of pid {pid} on host {socket.gethostname()}, started then ({state}; "
        "the run crashed or was killed)"]
    assert written["pid"] == os.getpid() and written["host"] == socket.gethostname()
    assert written["started"] != "then" and set(written) == {"pid", "host", "started"}


def test_a_lock_file_without_a_holder_is_taken_without_a_word_and_its_old_bytes_do_not_linger(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text(" " * 500 + "not json")
    with caplog.at_level(logging.WARNING, logger="hetfl"), lock_run_dir(run):
        raw = (run / LOCK_NAME).read_bytes()
    assert caplog.records == []
    assert json.loads(raw)["pid"] == os.getpid()  # the file is exactly the new holder, no tail of the old one


def test_a_lock_on_another_host_names_the_file_to_delete(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text('{"pid": 7, "host": "far.example", "started": "s"}')
    with pytest.raises(RunDirError) as err, lock_run_dir(run):
        pass
    assert str(err.value) == (f"{run}: {LOCK_NAME} names pid 7 on host far.example, started s, another host, whose "
                              f"lock this host cannot see; if that run is no longer running, delete {run / LOCK_NAME}")


def test_a_file_system_without_flock_is_named(tmp_path, monkeypatch):
    def no_flock(fd, how):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(rundir.fcntl, "flock", no_flock)
    with pytest.raises(RunDirError) as err, lock_run_dir(tmp_path / "run"):
        pass
    assert str(err.value) == (f"{tmp_path / 'run'}: cannot lock {LOCK_NAME} on this file system ([Errno 38] Function "
                              "not implemented); use a run directory on a local disk")
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / LOCK_NAME).write_text("")
    with pytest.raises(RunDirError) as err:
        check_unlocked(tmp_path / "held")
    assert str(err.value).startswith(f"{tmp_path / 'held'}: cannot lock {LOCK_NAME} on this file system")
    monkeypatch.setattr(rundir, "fcntl", None)
    with pytest.raises(RunDirError, match="locked with fcntl.flock, which this system lacks"), \
            lock_run_dir(tmp_path / "run"):
        pass


def test_letting_go_removes_only_the_lock_file_it_holds(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    fd = rundir._acquire(run)
    os.remove(run / LOCK_NAME)
    (run / LOCK_NAME).write_text("another's")  # a new file under the name: not this lock's
    rundir._release(run, fd, created=False)
    assert (run / LOCK_NAME).read_text() == "another's"
    with pytest.raises(OSError):
        os.fstat(fd)  # closed


# ------------------------------------------------------------------------------------------------ SIGTERM
def test_sigterm_interrupts_a_locked_block_of_the_main_thread_and_is_default_again_after_it(tmp_path):
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    with pytest.raises(Terminated, match=r"terminated by signal 15 \(SIGTERM\)"), lock_run_dir(tmp_path / "run"):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert not (tmp_path / "run").exists()
    assert issubclass(Terminated, KeyboardInterrupt)


def test_sigterm_is_left_to_a_programs_own_handler_and_to_the_main_thread(tmp_path):
    seen = []

    def own(signum, frame):
        seen.append(signum)

    before = signal.signal(signal.SIGTERM, own)
    try:
        with lock_run_dir(tmp_path / "a"):
            assert signal.getsignal(signal.SIGTERM) is own
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
        assert seen == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, before)
    handlers = []

    def in_a_thread():
        with lock_run_dir(tmp_path / "b"):
            handlers.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert handlers == [signal.SIG_DFL]


# ------------------------------------------------------------------------------------------------ the folder
def test_a_new_run_needs_a_folder_with_nothing_but_its_lock_and_the_refusal_lists_five_names(tmp_path):
    (tmp_path / LOCK_NAME).write_text("")
    check_no_run(tmp_path)
    for name in "fedcba":
        (tmp_path / name).write_text("")
    with pytest.raises(RunDirError) as err:
        check_no_run(tmp_path)
    assert str(err.value) == (f"{tmp_path} already holds a run or other files (a, b, c, d, e, ...); continue it with "
                              f"`hetfl run --resume {tmp_path}` (library: resume=True) or use another directory")
    (tmp_path / "f").unlink()
    with pytest.raises(RunDirError, match=r"files \(a, b, c, d, e\); continue"):
        check_no_run(tmp_path)


def test_hetfls_own_entries_and_temporary_files_are_told_from_the_users(tmp_path):
    assert is_run_entry("metrics.jsonl") and is_run_entry(CLIENT_METRICS_NAME) and is_run_entry(LOCK_NAME)
    assert is_run_entry(".summary.json.ab12.tmp")
    assert not is_run_entry("notes.tmp") and not is_run_entry(".hidden") and not is_run_entry("my.jsonl")
    for name in ("config.toml", "notes.txt", ".x.tmp", "b.tmp", "analysis", ".a"):
        (tmp_path / name).write_text("")
    assert foreign_entries(tmp_path) == [".a", "b.tmp", "notes.txt"]


def test_a_killed_writes_temporary_files_are_removed_when_the_lock_is_taken_and_nothing_else(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for name in (".metrics.jsonl.x1.tmp", ".config.toml.tmp", "keep.tmp", ".keep", "summary.json"):
        (run / name).write_text("")
    (run / ".dir.tmp").mkdir()  # not a file: left alone, not an error
    with lock_run_dir(run):
        assert sorted(p.name for p in run.iterdir()) == [".dir.tmp", ".keep", LOCK_NAME, "keep.tmp", "summary.json"]
    remove_temp_files(run)
    assert sorted(p.name for p in run.iterdir()) == [".dir.tmp", ".keep", "keep.tmp", "summary.json"]


# ------------------------------------------------------------------------------------------------ the history
def lines_of(*rounds: int | str) -> bytes:
    return b"".join((json.dumps({"round": r, "train_loss": 1.0}) + "\n").encode() for r in rounds)


def test_split_lines_keeps_newlines_and_a_cut_last_piece():
    assert split_lines(b"") == []
    assert split_lines(b"a\n") == [b"a\n"]
    assert split_lines(b"a\nb") == [b"a\n", b"b"]
    assert split_lines(b"a\n\nb\n") == [b"a\n", b"\n", b"b\n"]


def test_a_line_digest_is_a_64_bit_prefix_of_its_sha256():
    assert line_digest(b"x\n") == hashlib.sha256(b"x\n").hexdigest()[:16]


def test_the_metrics_log_records_each_lines_digest_the_whole_sha256_and_the_per_client_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path, [], []) as metrics:
        metrics.append({"round": 1, "train_loss": 0.5})
        metrics.clients.append({"round": 1, "client_acc": [0.5, None]})
        metrics.append({"round": 2, "train_loss": 0.25})
        record = metrics.record()
    raws = split_lines(path.read_bytes())
    assert raws == [b'{"round": 1, "train_loss": 0.5}\n', b'{"round": 2, "train_loss": 0.25}\n']
    client_bytes = b'{"round":1,"client_acc":[0.5,null]}\n'
    assert (tmp_path / CLIENT_METRICS_NAME).read_bytes() == client_bytes
    assert record == {"rounds": 2, "sha256": hashlib.sha256(b"".join(raws)).hexdigest(),
                      "lines": [line_digest(r) for r in raws],
                      CLIENT_RECORD_KEY: {"bytes": len(client_bytes),
                                          "sha256": hashlib.sha256(client_bytes).hexdigest()}}
    assert list(metrics.history) == [{"round": 1, "train_loss": 0.5}, {"round": 2, "train_loss": 0.25}]
    assert metrics.file.closed and metrics.clients.file.closed


def test_a_metrics_log_is_not_made_from_kept_lines_and_bytes_that_differ_in_number(tmp_path):
    with pytest.raises(ValueError, match="zip"):
        MetricsLog(tmp_path / "metrics.jsonl", [{"round": 1}], [])


def test_a_per_client_file_is_made_by_its_first_line_and_records_nothing_before_it(tmp_path):
    log = ClientMetricsLog(tmp_path / CLIENT_METRICS_NAME)
    assert log.record() == {"bytes": 0, "sha256": hashlib.sha256().hexdigest()}
    log.close()
    assert not (tmp_path / CLIENT_METRICS_NAME).exists()


def test_history_reads_lines_back_by_index_slice_and_step_and_tracks_the_first_nonfinite_loss(tmp_path):
    path = tmp_path / "metrics.jsonl"
    losses = [1.0, float("inf"), 2.0, float("nan"), 3.0]
    with MetricsLog(path, [], []) as metrics:
        for r, loss in enumerate(losses, 1):
            metrics.append({"round": r, "train_loss": loss})
    history = metrics.history
    assert len(history) == 5 and history.first_nonfinite == 2
    assert history[0]["round"] == 1 and history[4]["round"] == 5 and history[-1]["round"] == 5
    assert history[-5]["round"] == 1
    assert [x["round"] for x in history[1:4]] == [2, 3, 4]
    assert [x["round"] for x in history[::2]] == [1, 3, 5]
    assert [x["round"] for x in history[::-1]] == [5, 4, 3, 2, 1]
    assert [x["round"] for x in history[3:1:-1]] == [4, 3]
    assert history[0:0] == [] and history[3:3] == [] and history[4:2] == []
    assert [x["round"] for x in history] == [1, 2, 3, 4, 5]
    for bad in (5, -6):
        with pytest.raises(IndexError, match=f"line {bad} of 5"):
            history[bad]
    reads = []
    lines = History._lines
    history._lines = lambda start, stop: reads.append((start, stop)) or lines(history, start, stop)
    assert [x["round"] for x in history[1:5]] == [2, 3, 4, 5] and reads == [(1, 5)]  # one read of the file
    fresh = History(path)
    assert list(fresh) == [] and fresh[:] == []
    fresh.add(b"x\n", {"round": 1, "train_loss": "inf"})  # not a float: not counted
    fresh.add(b"y\n", {"round": 2})
    assert fresh.first_nonfinite is None


def test_a_resume_keeps_the_checkpoints_lines_drops_the_rest_and_says_which(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    kept = lines_of(1, 2)
    path.write_bytes(kept + lines_of(3) + b'{"round": 4, "tra')
    with caplog.at_level(logging.WARNING, logger="hetfl"):
        metrics = restore_metrics(path, 2, None)
    assert metrics.record()["lines"] == [line_digest(r) for r in split_lines(kept)]
    metrics.close()
    assert path.read_bytes() == kept
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: dropping 2 line(s) after the checkpoint's round 2 (rounds [3, 'cut']), to be recomputed"]
    assert [x["round"] for x in metrics.history] == [1, 2]


def test_a_resume_with_nothing_to_drop_leaves_the_file_as_it_is(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(lines_of(1, 2))
    rewritten = []
    monkeypatch.setattr(rundir, "atomic_write_bytes", lambda *args: rewritten.append(args))
    restore_metrics(path, 2, None).close()
    assert rewritten == []
    first = tmp_path / "new" / "metrics.jsonl"
    first.parent.mkdir()
    monkeypatch.undo()
    restore_metrics(first, 0, None).close()  # a checkpoint of round 0: the file is made, empty
    assert first.read_bytes() == b""


@pytest.mark.parametrize(("content", "last_round", "message"), [
    (None, 2, "round 1: the file is missing"),
    (None, 1, "round 1: the file is missing"),
    (lines_of(1), 3, "round 2: missing (the file ends before it)"),
    (lines_of(1, 3), 2, "round 2: missing: line 2 holds round 3"),
    (lines_of(1, 1), 2, "round 2: out of order or repeated: line 2 holds round 1"),
    (lines_of(1, "2"), 2, "round 2: out of order or repeated: line 2 holds round '2'"),
    (lines_of(1) + b"[2]\n", 2, "round 2: out of order or repeated: line 2 holds round None"),
    (lines_of(1) + b"{2\n", 2, "round 2: the line is not whole JSON"),
    (lines_of(1) + b'{"round": 2}', 2, "round 2: the line is cut (no newline at its end)"),
])
def test_a_history_a_resume_cannot_continue_is_refused_naming_the_round_and_why(tmp_path, content, last_round,
                                                                               message):
    path = tmp_path / "metrics.jsonl"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(RunDirError) as err:
        restore_metrics(path, last_round, None)
    assert str(err.value) == (f"{path}: {message}; the checkpoint is at round {last_round}, so rounds 1-{last_round} "
                              "must be there once each, in order, whole and unchanged. Restore the file, or start "
                              "the run again in a new directory")


def record_of(raws: list[bytes]) -> dict:
    return {"rounds": len(raws), "sha256": hashlib.sha256(b"".join(raws)).hexdigest(),
            "lines": [line_digest(r) for r in raws]}


def test_lines_that_differ_from_the_checkpoints_record_are_refused_naming_the_first(tmp_path):
    path = tmp_path / "metrics.jsonl"
    raws = split_lines(lines_of(1, 2, 3))
    path.write_bytes(b"".join(raws))
    restore_metrics(path, 3, record_of(raws)).close()
    edited = [raws[0], raws[1].replace(b"1.0", b"2.0"), raws[2]]
    path.write_bytes(b"".join(edited))
    tail = ("; the checkpoint is at round 3, so rounds 1-3 must be there once each, in order, whole and unchanged. "
            "Restore the file, or start the run again in a new directory")
    with pytest.raises(RunDirError) as err:
        restore_metrics(path, 3, record_of(raws))
    assert str(err.value) == f"{path}: round 2: the line differs from the one the checkpoint recorded (edited){tail}"
    path.write_bytes(b"".join(raws))
    short = record_of(raws)
    short["lines"] = short["lines"][:2]  # digests of two lines: the third is checked by the whole file's SHA-256
    short["sha256"] = "0" * 64
    with pytest.raises(RunDirError) as err:
        restore_metrics(path, 3, short)
    assert str(err.value) == f"{path}: round 3: the lines differ from those the checkpoint recorded{tail}"
    no_lines = {k: v for k, v in record_of(raws).items() if k != "lines"}  # the whole file's SHA-256 alone
    restore_metrics(path, 3, no_lines).close()
    path.write_bytes(raws[0])
    with pytest.raises(RunDirError, match="covers None rounds, not its round 1"):  # no count is not a count of 1
        restore_metrics(path, 1, {k: v for k, v in record_of(raws[:1]).items() if k != "rounds"})
    path.write_bytes(b"".join(raws))
    for rounds in (2, None):
        wrong = {**record_of(raws), "rounds": rounds} if rounds else {k: v for k, v in record_of(raws).items()
                                                                        if k != "rounds"}
        with pytest.raises(RunDirError) as err:
            restore_metrics(path, 3, wrong)
        assert str(err.value) == (f"{path}: the checkpoint's history record covers {rounds!r} rounds, not its round "
                                  "3; the checkpoint is damaged")


def client_lines(*rounds: int) -> bytes:
    return b"".join(f'{{"round":{r},"client_acc":[0.5]}}\n'.encode() for r in rounds)


def test_the_per_client_file_is_cut_back_to_its_recorded_bytes_and_a_shorter_or_other_file_is_refused(
        tmp_path, caplog):
    path = tmp_path / CLIENT_METRICS_NAME
    kept = client_lines(1, 2)
    path.write_bytes(kept + client_lines(3))
    record = {"bytes": len(kept), "sha256": hashlib.sha256(kept).hexdigest()}
    with caplog.at_level(logging.WARNING, logger="hetfl"):
        log = restore_client_metrics(path, 2, record)
    assert path.read_bytes() == kept and log.size == len(kept)
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: dropping {len(client_lines(3))} byte(s) after the checkpoint's round 2, to be recomputed"]
    log.append({"round": 3, "client_acc": [0.5]})
    assert log.record() == {"bytes": len(kept + client_lines(3)),
                            "sha256": hashlib.sha256(kept + client_lines(3)).hexdigest()}
    log.close()
    for bad in ({"bytes": len(kept) + len(client_lines(3)) + 1, "sha256": record["sha256"]},  # longer than the file
                {"bytes": len(kept), "sha256": "0" * 64}, {"sha256": record["sha256"]}):
        path.write_bytes(kept)
        with pytest.raises(RunDirError) as err:
            restore_client_metrics(path, 2, bad)
        assert str(err.value) == (f"{path}: the file is shorter than or differs from the {bad.get('bytes', -1)} bytes "
                                  "the checkpoint of round 2 recorded; restore it, or start the run again in a new "
                                  "directory")
    empty = {"bytes": 0, "sha256": hashlib.sha256().hexdigest()}
    restore_client_metrics(tmp_path / "absent.jsonl", 0, empty).close()  # no file, nothing recorded: fine


def test_a_resumed_metrics_log_goes_on_from_the_per_client_files_kept_bytes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    raws = split_lines(lines_of(1, 2))
    path.write_bytes(b"".join(raws))
    kept = client_lines(1, 2)
    (tmp_path / CLIENT_METRICS_NAME).write_bytes(kept + client_lines(3))
    clients = {"bytes": len(kept), "sha256": hashlib.sha256(kept).hexdigest()}
    with restore_metrics(path, 2, {**record_of(raws), CLIENT_RECORD_KEY: clients}) as metrics:
        assert metrics.record()[CLIENT_RECORD_KEY] == clients
    assert (tmp_path / CLIENT_METRICS_NAME).read_bytes() == kept


def test_the_per_client_files_record_is_hashed_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir, "HASH_CHUNK", 7)
    path = tmp_path / CLIENT_METRICS_NAME
    kept = client_lines(1, 2, 3)
    path.write_bytes(kept + client_lines(4))
    restore_client_metrics(path, 3, {"bytes": len(kept), "sha256": hashlib.sha256(kept).hexdigest()}).close()
    assert path.read_bytes() == kept


@pytest.mark.parametrize(("content", "kept"), [
    (client_lines(1, 2, 3), client_lines(1, 2)),  # a round after the checkpoint's
    (client_lines(1, 2) + b'{"round":3', client_lines(1, 2)),  # a cut line
    (client_lines(1) + client_lines(2)[:-1], client_lines(1)),  # cut before its newline only
    (client_lines(1, 1, 2), client_lines(1)),  # a repeated round ends what is kept
    (client_lines(2, 1), client_lines(2)),
    (client_lines(1) + b"[3]\n" + client_lines(2), client_lines(1)),  # not a line of a round
    (client_lines(0, 1), b""),
    (b"", b""),
])
def test_without_a_record_the_per_client_file_keeps_its_whole_lines_of_increasing_rounds_up_to_the_checkpoint(
        tmp_path, content, kept):
    path = tmp_path / CLIENT_METRICS_NAME
    path.write_bytes(content)
    log = restore_client_metrics(path, 2, None)
    log.close()
    assert path.read_bytes() == kept
    assert (log.size, log.whole.hexdigest()) == (len(kept), hashlib.sha256(kept).hexdigest())


def test_a_missing_per_client_file_without_a_record_is_an_empty_one(tmp_path):
    log = restore_client_metrics(tmp_path / CLIENT_METRICS_NAME, 3, None)
    assert (log.size, log.whole.hexdigest()) == (0, hashlib.sha256().hexdigest())
    assert not (tmp_path / CLIENT_METRICS_NAME).exists()


def test_a_dropped_lines_round_is_its_number_a_question_mark_or_cut():
    assert rundir._parse_round(b'{"round": 3}\n') == 3
    assert rundir._parse_round(b'{"loss": 1}\n') == "?"
    assert rundir._parse_round(b'{"round": 3') == "cut"
    assert rundir._parse_round(b"[1]\n") == "cut"
