"""Fetching official files: download with checksum verification and atomic writes.

A download goes to a temporary file next to its destination, is checked
against the official checksum written in the code (the loaders' modules cite
where each comes from) and only then ``os.replace``-d into place; a mismatch
deletes it. Files a user already has are never checksummed (a local copy may
be re-compressed: the loaders check the format instead). When a download is
impossible (no network, download off) the error names the files to put where.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import tempfile
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hetfl.data.base import DatasetError
from hetfl.files import follow_umask

TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Remote:
    """One official file: its name, mirror URLs (tried in order) and checksum (MD5 or SHA-256)."""

    name: str
    urls: tuple[str, ...]
    md5: str = ""
    sha256: str = ""

    def __post_init__(self) -> None:
        if not (self.md5 or self.sha256):
            raise ValueError(f"{self.name}: a Remote needs an md5 or sha256 checksum")


def file_digest(path: Path, algorithm: str) -> str:
    """Hex digest of ``path`` (``md5`` or ``sha256``), read in 1 MiB blocks."""
    digest = hashlib.new(algorithm, usedforsecurity=False)  # an integrity check, not security
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _expected(remote: Remote) -> tuple[str, str]:
    return ("sha256", remote.sha256.lower()) if remote.sha256 else ("md5", remote.md5.lower())


def _temporary(folder: Path, name: str) -> tuple[int, str]:
    """A new temporary file for downloading ``name`` into ``folder`` (created if missing): its descriptor
    and path; a DatasetError when ``folder`` cannot be written (read-only, not ours, full)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".part")
    except OSError as err:
        raise DatasetError(f"cannot write into {folder} to download {name} ({err.strerror or err})") from None


def _announced_size(response: object) -> int | None:
    """The byte count an HTTP response announces (its Content-Length), or None (another scheme, or none)."""
    headers = getattr(response, "headers", None)
    value = headers.get("Content-Length") if headers is not None else None
    try:
        return int(value) if value is not None and getattr(response, "status", None) == 200 else None
    except ValueError:
        return None


def fetch(remote: Remote, folder: Path) -> Path:
    """Download ``remote`` into ``folder``, trying each mirror; the checksum must match.

    Raises :class:`DatasetError` listing every mirror's failure when none worked, or saying that
    ``folder`` cannot be written (a read-only ``data.root``: no mirror is tried).
    """
    dest = folder / remote.name
    algorithm, expected = _expected(remote)
    failures = []
    for url in remote.urls:
        fd, tmp = _temporary(folder, remote.name)
        try:
            follow_umask(fd)  # data.root may be shared: the download is readable as the umask allows
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
                announced = _announced_size(response)
                while block := response.read(1 << 20):
                    out.write(block)
                received = out.tell()
            if announced is not None and received != announced:  # a cut connection: read() just ends early
                failures.append(f"{url}: incomplete download ({received} of {announced} bytes; the connection "
                                "was cut?), discarded")
                continue
            got = file_digest(Path(tmp), algorithm)
            if got != expected:
                failures.append(f"{url}: checksum mismatch ({algorithm} {got}, expected {expected}), discarded")
                continue
            os.replace(tmp, dest)
            return dest
        except (OSError, http.client.HTTPException, ValueError) as err:
            failures.append(f"{url}: {getattr(err, 'reason', None) or err}")
        finally:
            Path(tmp).unlink(missing_ok=True)
    raise DatasetError(f"could not download {remote.name} (" + "; ".join(failures) + ")")


def incomplete_folder(folders: Sequence[Path], names: Sequence[str],
                      has: Callable[[Path], bool] = lambda path: path.is_file() or path.is_symlink()) -> str:
    """``"<folder> lacks <names> (it holds k of the n files)"`` for the first of ``folders`` that holds some
    but not all of ``names`` (an archive partly extracted or copied), else ``""``: for :func:`ensure`'s
    message, which otherwise says only that the archive is missing while the folder is right there.
    ``has``: whether a file counts as there (default: a file, or a link, which reading reports)."""
    for folder in folders:
        if not folder.is_dir():
            continue
        lacking = [n for n in names if not has(folder / n)]
        if 0 < len(lacking) < len(names):
            return (f"{folder} lacks {', '.join(lacking)} (it holds {len(names) - len(lacking)} of the "
                    f"{len(names)} files)")
    return ""


def ensure(root: Path, remotes: Sequence[Remote], *, download: bool, dataset: str, alternative: str = "",
           incomplete: str = "") -> list[Path]:
    """Paths of ``remotes`` under folder ``root``, downloading the missing ones when ``download``.

    Files already there are taken as they are. ``alternative`` describes other
    accepted local layouts for the error message (e.g. "or the extracted folder");
    ``incomplete`` (from :func:`incomplete_folder`) ends it, naming what such a layout lacks.
    """
    missing = [r for r in remotes if not (root / r.name).is_file()]
    problem = "downloading is off (data.download = false)"
    if missing and download:
        if root.exists() and not root.is_dir():
            raise DatasetError(f"{dataset}: data.root = {str(root)!r} is a file, not a folder to download into; "
                               f"set data.root to a folder")
        try:
            for remote in missing:
                fetch(remote, root)
            return [root / r.name for r in remotes]
        except DatasetError as err:
            problem = str(err)
    if missing:
        names = ", ".join(r.name for r in missing)
        other = f" {alternative}" if alternative else ""
        raise DatasetError(
            f"{dataset}: {names} not found in {root} and {problem}. Put the official file(s){other} into {root}, "
            f"or set data.root to the folder that holds them" + (f". {incomplete}" if incomplete else "")
        )
    return [root / r.name for r in remotes]
