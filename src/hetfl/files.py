"""File modes: files hetfl writes follow the process's umask, as ``open()`` would create them.

An atomic write goes through a temporary file made by :func:`tempfile.mkstemp`, which is private
(0600) whatever the umask, and the rename keeps that mode: a run folder shared with colleagues
(umask 022) would hold files only its owner can read. :func:`follow_umask` gives such a file the
mode a plain ``open(path, "w")`` would have given it (0666 minus the umask). Secrets (the TLS keys of
:mod:`hetfl.flower.deploy`) are written 0600 on purpose and do not go through here.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def current_umask() -> int:
    """The process's umask, read from ``/proc/self/status`` where it is there (Linux), else by setting
    and restoring it (which other threads could observe for an instant)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(target: int | str | os.PathLike[str]) -> None:
    """Give a file (an open descriptor or a path) the mode ``open()`` creates files with: 0666 & ~umask."""
    mode = 0o666 & ~current_umask()
    if isinstance(target, int):
        os.fchmod(target, mode)
    else:
        os.chmod(target, mode)


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush ``path`` to the disk: a file's bytes, or a folder's entries (a rename in it). A no-op where the
    system cannot open or sync it (a folder on some platforms): durability is then the system's."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write ``path`` by ``write(file)`` (a binary file) into a temporary file in the same folder, synced to the
    disk, then ``os.replace``-d into place: a reader sees the old file or the whole new one, never a part, and a
    write that fails (an error, an interrupt) leaves nothing behind. The temporary file is ``.NAME.XXXXXXXX.tmp``,
    hidden, the name :mod:`hetfl.engine.rundir`'s clean-up looks for; the file's mode follows the umask
    (:func:`follow_umask`), as a plain write's would."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        follow_umask(fd)
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """:func:`atomic_write` of ``data``."""
    atomic_write(path, lambda fh: fh.write(data))


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())
