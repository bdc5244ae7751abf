"""What a file hetfl writes is when a write is cut, and the mode it gets (``hetfl.files``).

An atomic write goes through a temporary file named ``.NAME.XXXX.tmp`` in the target's folder: that name is
what a run directory's lock removes after a killed write and what ``overwrite=True`` counts as hetfl's
(``hetfl.engine.rundir``). Files get the mode a plain ``open()`` gives (0666 minus the umask), the umask read from
``/proc`` on Linux without setting it (another thread could create a file under the set value). Written for the
survivors of the mutation target ``files`` (session 41).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hetfl import files
from hetfl.engine import rundir
from hetfl.files import atomic_write_bytes, atomic_write_text, current_umask, follow_umask


@pytest.fixture
def umask():
    """Set the process's umask for a test; the one before is put back."""
    before = os.umask(0o022)
    os.umask(before)

    def set_to(mask: int) -> int:
        os.umask(mask)
        return mask

    yield set_to
    os.umask(before)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002, 0o027, 0o000])
def test_the_umask_is_read_without_being_set(umask, monkeypatch, mask):
    umask(mask)

    def must_not_set(value):
        raise AssertionError(f"os.umask({value:o}) called: on Linux the umask is read from /proc/self/status")

    if Path("/proc/self/status").exists():
        monkeypatch.setattr(files.os, "umask", must_not_set)
    assert current_umask() == mask


class NoProc:
    """``files.Path`` where ``/proc`` cannot be read (not Linux)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def read_text(self) -> str:
        raise OSError(2, "No such file or directory", self.path)


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_without_proc_the_umask_is_read_by_setting_it_and_put_back(umask, monkeypatch, mask):
    umask(mask)
    monkeypatch.setattr(files, "Path", NoProc)
    assert current_umask() == mask
    assert current_umask() == mask  # put back: read again, the same


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_a_written_file_has_the_mode_open_would_give_it(tmp_path, umask, mask):
    umask(mask)
    atomic_write_text(tmp_path / "a.json", "{}")
    assert mode_of(tmp_path / "a.json") == 0o666 & ~mask
    by_path = tmp_path / "b"
    by_path.write_text("")
    os.chmod(by_path, 0o600)
    follow_umask(str(by_path))
    assert mode_of(by_path) == 0o666 & ~mask
    fd = os.open(tmp_path / "c", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        follow_umask(fd)
    finally:
        os.close(fd)
    assert mode_of(tmp_path / "c") == 0o666 & ~mask


def test_a_write_goes_through_a_temporary_file_that_a_run_directory_knows_as_hetfls(tmp_path, monkeypatch):
    seen = []
    replace = os.replace

    def watched(src, dst):
        seen.append((Path(src), Path(dst), Path(src).read_bytes()))
        replace(src, dst)

    monkeypatch.setattr(files.os, "replace", watched)
    atomic_write_bytes(tmp_path / "summary.json", b"{}")
    [(tmp, target, data)] = seen
    assert target == tmp_path / "summary.json" and data == b"{}" and target.read_bytes() == b"{}"
    assert tmp.parent == tmp_path  # same folder: the rename is atomic
    assert tmp.name.startswith(".summary.json.") and tmp.name.endswith(".tmp")
    assert rundir.is_run_entry(tmp.name)  # overwrite=True removes it as hetfl's
    tmp.write_bytes(b"left by a killed write")
    rundir.remove_temp_files(tmp_path)  # and the next lock removes it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_a_cut_write_leaves_the_old_file_and_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "config.toml"
    target.write_text("old")

    def fail(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "replace", fail)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_text(target, "new")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"]


def test_syncing_a_path_that_cannot_be_opened_or_synced_is_left_to_the_system(tmp_path, monkeypatch):
    files.fsync_path(tmp_path / "absent")  # no error
    files.fsync_path(tmp_path)  # a folder: its entries
    closed = []
    real_close = os.close

    def no_fsync(fd):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(files.os, "fsync", no_fsync)
    monkeypatch.setattr(files.os, "close", lambda fd: closed.append(fd) or real_close(fd))
    files.fsync_path(tmp_path)
    assert len(closed) == 1  # the descriptor is closed all the same
