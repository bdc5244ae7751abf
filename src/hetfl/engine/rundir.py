"""Run-directory safety: one writer per run directory, and a metrics history that resume checks.

**Lock.** A run holds ``RUN_DIR/.lock`` for as long as it writes there: an exclusive
``fcntl.flock`` on that file, which holds ``{"pid", "host", "started"}`` of the holder so that a
refused process can name it. The kernel drops a flock when its process dies however it dies
(SIGKILL included), so a lock file left by a crash is recognised as stale (its flock is free),
taken over and logged; the file is removed on every normal exit, exceptions, Ctrl-C and SIGTERM included
(while a run holds its lock in the main thread, SIGTERM raises :class:`Terminated`, a KeyboardInterrupt, unless
the program has a SIGTERM handler of its own).
A lock file written on another host whose flock is free is refused, not taken over: a flock
may not reach across hosts on a network file system, and hetfl cannot see whether that process
still runs. The lock is re-entrant within one process (the Flower simulation's ServerApp thread
runs the round loop of the run that took it).

**History.** ``metrics.jsonl`` is appended one whole line per round, flushed, and synced before
each checkpoint; the checkpoint records a digest of the exact bytes of the lines of rounds
``1..r`` (a SHA-256 of them all and a short SHA-256 per line). On resume those lines must be
there once each, in order, whole and unchanged; lines after round ``r`` (a kill between a
round's line and its checkpoint, a half-written last line) are dropped and recomputed, which
gives the same lines. Anything else is refused naming the file and the first bad round:
metrics of past rounds cannot be recomputed from a later checkpoint.

**Per-client file.** ``client_metrics.jsonl`` holds the per-client arrays the metrics line
no longer carries (one line per written round, see :class:`ClientMetricsLog`); the same
record holds its byte length and SHA-256 at the checkpoint, and resume cuts it back to
exactly those bytes (refusing a file that is shorter or differs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import logging
import math
import os
import signal
import socket
import threading
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, overload

from hetfl.files import atomic_write_bytes

try:
    import fcntl
except ImportError:  # not a POSIX system
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".lock"
#: checkpoint ``info`` key holding the digest of the metrics lines up to the checkpoint's round
HISTORY_KEY = "metrics_history"
#: the per-client file beside ``metrics.jsonl``, and its key in the history record
CLIENT_METRICS_NAME = "client_metrics.jsonl"
CLIENT_RECORD_KEY = "client_metrics"
HASH_CHUNK = 1 << 20
#: every name hetfl itself writes at the top of a run directory: the run's files (config.toml, the logs, the
#: summary, the checkpoint, its lock), tracking's record and TensorBoard folder (hetfl.tracking), the saved
#: client models, the Flower simulation's node state (hetfl.flower.protocol.NODES_DIR), and what ``hetfl
#: analyze`` and ``hetfl report`` add (``analysis/``, ``report/``). Named here, below the modules that own them
#: (tests check the names match): ``overwrite=True`` deletes these and nothing else.
RUN_ENTRIES = frozenset({
    "config.toml", "metrics.jsonl", CLIENT_METRICS_NAME, "summary.json", "checkpoint.safetensors", LOCK_NAME,
    "trained.safetensors",  # hetfl.engine.checkpoint.TRAINED_NAME: the model before the post-hoc steps
    "tracking.json", "tensorboard", "client_models", "flower_nodes", "analysis", "report",
    "privacy_ledger.json",  # hetfl.engine.ledger.LEDGER_NAME (which imports this module)
})
LINE_DIGEST_CHARS = 16  # a 64-bit prefix of each line's SHA-256: enough to tell an edited line

log = logging.getLogger("hetfl")


class RunDirError(ValueError):
    """The output directory cannot be used (in use by another process, holds another run,
    nothing to resume, a damaged history); the CLI exits with code 2."""


class Terminated(KeyboardInterrupt):
    """The process was sent SIGTERM while it held a run directory: raised in the main thread so that the run
    ends as on Ctrl-C (its lock file removed, trackers closed, exit 130 from the CLI, resumable)."""


# ------------------------------------------------------------------ lock
@dataclass(frozen=True)
class Holder:
    """Who holds (or last held) a run directory's lock."""

    pid: int
    host: str
    started: str

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started}"


def this_holder() -> Holder:
    return Holder(os.getpid(), socket.gethostname(), dt.datetime.now().astimezone().isoformat(timespec="seconds"))


def _parse_holder(raw: bytes) -> Holder | None:
    try:
        data = json.loads(raw)
        return Holder(int(data["pid"]), str(data["host"]), str(data.get("started", "?")))
    except (ValueError, KeyError, TypeError):
        return None


def _read_holder(path: Path, wait_s: float = 1.0) -> Holder | None:
    """The holder named in a lock file; waits briefly for a holder that is still writing it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            holder = _parse_holder(path.read_bytes())
        except FileNotFoundError:
            holder = None
        if holder is not None or time.monotonic() >= deadline:
            return holder
        time.sleep(0.02)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _in_use(run_dir: Path, holder: Holder | None) -> RunDirError:
    who = holder.describe() if holder else "a process that has not written its pid yet"
    return RunDirError(f"{run_dir} is in use by another hetfl run ({who}); wait for it to finish, "
                       "or use another directory")


@dataclass
class _Held:
    fd: int
    depth: int


_held: dict[str, _Held] = {}
_held_guard = threading.Lock()


def _flock(fd: int, run_dir: Path) -> bool:
    """Try the exclusive flock; False when another open file holds it."""
    if fcntl is None:
        raise RunDirError(f"{run_dir}: run directories are locked with fcntl.flock, which this system lacks")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as err:
        raise RunDirError(f"{run_dir}: cannot lock {LOCK_NAME} on this file system ({err}); "
                          "use a run directory on a local disk") from None
    return True


def _flock_patiently(fd: int, run_dir: Path, tries: int = 6, pause_s: float = 0.05) -> bool:
    """The flock, retried briefly: ``check_unlocked`` in another process holds it for an instant."""
    for attempt in range(tries):
        if _flock(fd, run_dir):
            return True
        if attempt + 1 < tries:
            time.sleep(pause_s)
    return False


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _take_over(fd: int, path: Path, run_dir: Path) -> None:
    """Called with the flock held: a lock file that still names a holder was left by a crash."""
    previous = _parse_holder(os.pread(fd, 4096, 0))
    if previous is None:  # a fresh file, or one whose holder was killed before writing it
        return
    if previous.host != socket.gethostname():
        raise RunDirError(f"{run_dir}: {path.name} names {previous.describe()}, another host, whose lock this "
                          f"host cannot see; if that run is no longer running, delete {path}")
    state = "still running but not holding it (its pid was reused)" if _pid_alive(previous.pid) else "no longer running"
    log.warning("%s: taking over the stale lock of %s (%s; the run crashed or was killed)",
                run_dir, previous.describe(), state)


def _acquire(run_dir: Path) -> int:
    """Take ``run_dir``'s lock: the open lock file's descriptor, with the flock held and our JSON written."""
    path = run_dir / LOCK_NAME
    for _ in range(50):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not _flock_patiently(fd, run_dir):
                raise _in_use(run_dir, _read_holder(path))
            if not _same_file(fd, path):  # the holder removed it while releasing: lock the new file
                os.close(fd)
                continue
            _take_over(fd, path, run_dir)
            data = json.dumps(dataclasses.asdict(this_holder())).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
            return fd
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
    raise RunDirError(f"{run_dir}: could not take {LOCK_NAME} (it keeps being replaced)")


def _release(run_dir: Path, fd: int, created: bool) -> None:
    """Remove the lock file, then drop the flock (in that order: a waiting process that opened the
    old file sees it unlinked and retries on a new one)."""
    path = run_dir / LOCK_NAME
    if _same_file(fd, path):
        path.unlink(missing_ok=True)
    os.close(fd)
    if created:
        with contextlib.suppress(OSError):  # not empty: the run wrote something, keep it
            run_dir.rmdir()


@contextlib.contextmanager
def lock_run_dir(run_dir: Path) -> Iterator[bool]:
    """Hold ``run_dir``'s lock (creating the folder) for the ``with`` block; yields True when this
    call took it, False when this process already held it. Raises RunDirError, naming the holder,
    when another process holds it. A folder this call created and nothing was written to is removed."""
    key = str(run_dir.resolve())
    with _held_guard:
        held = _held.get(key)
        if held is not None:
            held.depth += 1
    if held is not None:
        try:
            yield False
        finally:
            with _held_guard:
                held.depth -= 1
        return
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = _acquire(run_dir)
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                run_dir.rmdir()
        raise
    with _held_guard:
        _held[key] = _Held(fd, 1)
    try:
        with _sigterm_as_interrupt():
            remove_temp_files(run_dir)
            yield True
    finally:
        with _held_guard:
            del _held[key]
        _release(run_dir, fd, created)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` for the ``with`` block, when this is the main thread and the program
    left SIGTERM to its default (which would end the process with no ``finally`` run, leaving the lock file)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise Terminated(f"terminated by signal {signum} (SIGTERM)")

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def check_unlocked(run_dir: Path) -> None:
    """RunDirError naming the holder if another process holds ``run_dir``'s lock now (a check before
    the work of setting a run up; the lock itself is what excludes a second writer)."""
    path = run_dir / LOCK_NAME
    if not path.is_file() or str(run_dir.resolve()) in _held:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        if fcntl is not None and not _flock(fd, run_dir):
            raise _in_use(run_dir, _read_holder(path))
    finally:
        os.close(fd)  # drops the flock this check may have taken


def check_no_run(run_dir: Path) -> None:
    """A new (not resumed) run needs a folder that holds nothing but its lock file; checked under the lock,
    so two runs started at once into one folder cannot both pass."""
    others = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_NAME)
    if others:
        shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        raise RunDirError(f"{run_dir} already holds a run or other files ({shown}); continue it with "
                          f"`hetfl run --resume {run_dir}` (library: resume=True) or use another directory")


def is_run_entry(name: str) -> bool:
    """Whether hetfl wrote a run directory entry of this name (:data:`RUN_ENTRIES`, or the temporary file
    of an atomic write, ``.NAME.XXXX.tmp``)."""
    return name in RUN_ENTRIES or (name.startswith(".") and name.endswith(".tmp"))


def foreign_entries(run_dir: Path) -> list[str]:
    """The names at the top of ``run_dir`` that hetfl did not write (the user's files), sorted."""
    return sorted(p.name for p in run_dir.iterdir() if not is_run_entry(p.name))


def remove_temp_files(run_dir: Path) -> None:
    """Temporary files of an atomic write (``.NAME.XXXX.tmp``) left by a killed run; safe under the lock."""
    for p in run_dir.glob(".*.tmp"):
        with contextlib.suppress(OSError):
            p.unlink()


# --------------------------------------------------------------- history
def line_digest(raw: bytes) -> str:
    """Short SHA-256 of one metrics line's bytes (newline included)."""
    return hashlib.sha256(raw).hexdigest()[:LINE_DIGEST_CHARS]


class ClientMetricsLog:
    """``client_metrics.jsonl``, open for appending: one line per written round, ``{"round": r,
    "client_acc": [...]}``, each client's accuracy on its own test split by client id (null for a
    client without one). Nothing is kept in memory but the byte count and a running SHA-256, which a
    checkpoint records; the file is created by its first line."""

    def __init__(self, path: Path, kept: hashlib._Hash | None = None, size: int = 0) -> None:
        self.path, self.size = path, size
        self.whole = kept if kept is not None else hashlib.sha256()
        self.file: BinaryIO | None = None

    def append(self, row: dict[str, Any]) -> None:
        """Write one round's row whole (compact JSON) and flush it."""
        raw = (json.dumps(row, separators=(",", ":")) + "\n").encode()
        if self.file is None:
            self.file = open(self.path, "ab")  # noqa: SIM115 (closed by close())
        self.file.write(raw)
        self.file.flush()
        self.size += len(raw)
        self.whole.update(raw)

    def record(self) -> dict[str, Any]:
        """Byte count and SHA-256 of the file so far, synced to disk first."""
        if self.file is not None:
            os.fsync(self.file.fileno())
        return {"bytes": self.size, "sha256": self.whole.hexdigest()}

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class History(Sequence[dict[str, Any]]):
    """A run's metrics lines, read-only, read back from ``metrics.jsonl`` itself when asked for
    (``make_summary`` reads them once at the end; resume's tracking the restored ones): in memory,
    8 bytes a round (where each line ends). Not a dict per round: each round's dict and its floats,
    kept for thousands of rounds among the round's short-lived objects, grew RSS by 1.5 kB a round
    (``benchmarks/memory_long.py``). ``first_nonfinite`` is the first round whose train loss is inf or
    NaN (None: none), tracked as lines are added."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._ends = array("q")
        self.first_nonfinite: int | None = None

    def add(self, raw: bytes, line: dict[str, Any]) -> None:
        self._ends.append((self._ends[-1] if self._ends else 0) + len(raw))
        loss = line.get("train_loss")
        if self.first_nonfinite is None and isinstance(loss, float) and not math.isfinite(loss):
            self.first_nonfinite = line.get("round")

    def __len__(self) -> int:
        return len(self._ends)

    def _lines(self, start: int, stop: int) -> list[dict[str, Any]]:
        if start >= stop:
            return []
        first = self._ends[start - 1] if start else 0
        with open(self.path, "rb") as f:
            f.seek(first)
            data = f.read(self._ends[stop - 1] - first)
        return [json.loads(raw) for raw in split_lines(data)]

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, i: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            return self._lines(start, stop)[::step] if step > 0 else [self[j] for j in range(start, stop, step)]
        if not -len(self) <= i < len(self):
            raise IndexError(f"line {i} of {len(self)}")
        j = i % len(self)
        return self._lines(j, j + 1)[0]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self._lines(0, len(self)))


class MetricsLog:
    """``metrics.jsonl`` open for appending whole lines, with the lines kept (``history``, a
    :class:`History`) and the digests a checkpoint records (8 bytes a line, in one buffer);
    ``clients`` is the per-client file beside it."""

    def __init__(self, path: Path, history: list[dict[str, Any]], raws: list[bytes],
                 clients: ClientMetricsLog | None = None) -> None:
        self.path, self.history = path, History(path)
        self.digests = bytearray()
        self.whole = hashlib.sha256()
        for raw, line in zip(raws, history, strict=True):
            self._keep(raw, line)
        self.clients = clients if clients is not None else ClientMetricsLog(path.with_name(CLIENT_METRICS_NAME))
        self.file: BinaryIO = open(path, "ab")  # noqa: SIM115 (closed by close())

    def _keep(self, raw: bytes, line: dict[str, Any]) -> None:
        self.history.add(raw, line)
        self.digests += bytes.fromhex(line_digest(raw))
        self.whole.update(raw)

    def append(self, line: dict[str, Any]) -> None:
        """Write one round's line whole and flush it (one ``write`` of the complete line)."""
        raw = (json.dumps(line) + "\n").encode()
        self.file.write(raw)
        self.file.flush()
        self._keep(raw, line)

    def record(self) -> dict[str, Any]:
        """The checkpoint's record of the lines written so far; syncs them to disk first, so that a
        checkpoint never gets ahead of the history it describes."""
        os.fsync(self.file.fileno())
        size = LINE_DIGEST_CHARS // 2
        lines = [self.digests[i : i + size].hex() for i in range(0, len(self.digests), size)]
        return {"rounds": len(lines), "sha256": self.whole.hexdigest(), "lines": lines,
                CLIENT_RECORD_KEY: self.clients.record()}

    def close(self) -> None:
        self.file.close()
        self.clients.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _history_error(path: Path, round_: int, problem: str, last_round: int) -> RunDirError:
    return RunDirError(f"{path}: round {round_}: {problem}; the checkpoint is at round {last_round}, so rounds "
                       f"1-{last_round} must be there once each, in order, whole and unchanged. Restore the file, "
                       "or start the run again in a new directory")


def _check_line(path: Path, raw: bytes, expected: int, last_round: int) -> dict[str, Any]:
    if not raw.endswith(b"\n"):
        raise _history_error(path, expected, "the line is cut (no newline at its end)", last_round)
    try:
        line = json.loads(raw)
    except ValueError:
        raise _history_error(path, expected, "the line is not whole JSON", last_round) from None
    got = line.get("round") if isinstance(line, dict) else None
    if got != expected:
        what = "missing" if isinstance(got, int) and got > expected else "out of order or repeated"
        raise _history_error(path, expected, f"{what}: line {expected} holds round {got!r}", last_round)
    return line


def _check_digests(path: Path, raws: list[bytes], record: dict[str, Any], last_round: int) -> None:
    if int(record.get("rounds", -1)) != last_round:
        raise RunDirError(f"{path}: the checkpoint's history record covers {record.get('rounds')!r} rounds, "
                          f"not its round {last_round}; the checkpoint is damaged")
    for i, (raw, digest) in enumerate(zip(raws, record.get("lines", []), strict=False), start=1):
        if line_digest(raw) != digest:
            raise _history_error(path, i, "the line differs from the one the checkpoint recorded (edited)", last_round)
    if hashlib.sha256(b"".join(raws)).hexdigest() != record.get("sha256"):
        raise _history_error(path, last_round, "the lines differ from those the checkpoint recorded", last_round)


def split_lines(data: bytes) -> list[bytes]:
    """``data`` cut after each newline (newlines kept); a last piece without one is a cut line."""
    pieces = [piece + b"\n" for piece in data.split(b"\n")]
    pieces[-1] = pieces[-1][:-1]
    return pieces if pieces[-1] else pieces[:-1]


def restore_metrics(path: Path, last_round: int, record: dict[str, Any] | None) -> MetricsLog:
    """Check ``metrics.jsonl`` against a checkpoint of round ``last_round`` and cut it back to that round.

    ``record`` is the checkpoint's digest of the lines (None: a checkpoint written before digests
    were kept, checked for rounds ``1..last_round`` present once, in order, whole). Lines after
    ``last_round`` are dropped (they are recomputed, identically). Raises RunDirError naming the file
    and the first bad round. Returns the log, open for appending, holding the kept lines."""
    if not path.exists() and last_round > 0:
        raise _history_error(path, 1, "the file is missing", last_round)
    chunks = split_lines(path.read_bytes()) if path.exists() else []
    raws, tail = chunks[:last_round], chunks[last_round:]
    history = [_check_line(path, raw, i, last_round) for i, raw in enumerate(raws, start=1)]
    if len(raws) < last_round:
        raise _history_error(path, len(raws) + 1, "missing (the file ends before it)", last_round)
    if record is not None:
        _check_digests(path, raws, record, last_round)
    if tail:
        log.warning("%s: dropping %d line(s) after the checkpoint's round %d (rounds %s), to be recomputed",
                    path, len(tail), last_round, [_parse_round(raw) for raw in tail])
    if tail or not path.exists():
        atomic_write_bytes(path, b"".join(raws))
    clients = restore_client_metrics(path.with_name(CLIENT_METRICS_NAME), last_round,
                                     record.get(CLIENT_RECORD_KEY) if record else None)
    return MetricsLog(path, history, raws, clients)


def restore_client_metrics(path: Path, last_round: int, record: dict[str, Any] | None) -> ClientMetricsLog:
    """Cut ``client_metrics.jsonl`` back to a checkpoint of round ``last_round``: to the byte count its
    ``record`` holds, after checking those bytes' SHA-256 (a shorter or different file is refused, as an
    edited ``metrics.jsonl`` is). Without a record (a checkpoint written before the file was recorded):
    whole lines of rounds up to ``last_round``, in increasing order, are kept. Returns the log, open for
    appending after the kept bytes; read in chunks, never whole."""
    size = path.stat().st_size if path.exists() else 0
    if record is not None:
        keep = int(record.get("bytes", -1))
        whole = _hash_prefix(path, keep) if 0 <= keep <= size else None
        if whole is None or whole.hexdigest() != record.get("sha256"):
            raise RunDirError(f"{path}: the file is shorter than or differs from the {keep} bytes the checkpoint of "
                              f"round {last_round} recorded; restore it, or start the run again in a new directory")
    else:
        whole, keep = _whole_lines_up_to(path, last_round)
    if keep < size:
        log.warning("%s: dropping %d byte(s) after the checkpoint's round %d, to be recomputed", path, size - keep,
                    last_round)
        os.truncate(path, keep)
    return ClientMetricsLog(path, whole, keep)


def _hash_prefix(path: Path, size: int) -> hashlib._Hash:
    """SHA-256 of the first ``size`` bytes of ``path`` (which has at least that many)."""
    whole = hashlib.sha256()
    if size == 0:
        return whole
    with open(path, "rb") as f:
        left = size
        while left:
            chunk = f.read(min(HASH_CHUNK, left))
            whole.update(chunk)
            left -= len(chunk)
    return whole


def _whole_lines_up_to(path: Path, last_round: int) -> tuple[hashlib._Hash, int]:
    """(SHA-256, byte count) of the leading whole lines of ``path`` whose rounds increase up to ``last_round``."""
    whole, keep, previous = hashlib.sha256(), 0, 0
    if not path.exists():
        return whole, 0
    with open(path, "rb") as f:
        for raw in f:
            got = _parse_round(raw) if raw.endswith(b"\n") else None
            if not isinstance(got, int) or not previous < got <= last_round:
                break
            whole.update(raw)
            keep += len(raw)
            previous = got
    return whole, keep


def _parse_round(raw: bytes) -> Any:
    try:
        return json.loads(raw).get("round", "?")
    except (ValueError, AttributeError):
        return "cut"
