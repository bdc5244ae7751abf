"""Fetching official files: download with checksum verification, atomic writes,
and errors that tell an offline user which files to put where."""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hetfl.data.base import DatasetError


@dataclass(frozen=True)
class Remote:
    """One official file: its name, mirror URLs (tried in order) and MD5."""

    name: str
    urls: tuple[str, ...]
    md5: str


def md5sum(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(url: str, dest: Path, md5: str, timeout: float = 60.0) -> None:
    """Download ``url`` to ``dest`` via a temporary file; keep it only if its MD5 matches."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as response:
            while block := response.read(1 << 20):
                out.write(block)
        got = md5sum(Path(tmp))
        if got != md5:
            raise DatasetError(f"{url}: checksum mismatch (MD5 {got}, expected {md5}); the file was discarded")
        os.replace(tmp, dest)
    finally:
        Path(tmp).unlink(missing_ok=True)


def ensure(root: Path, files: Sequence[Remote], download: bool, dataset: str) -> list[Path]:
    """Paths of ``files`` under ``root``, downloading the missing ones if allowed.

    Files already present are accepted as they are (a user's local copy may be
    re-compressed; the loaders check their format instead of their checksum).
    """
    missing = [f for f in files if not (root / f.name).exists()]
    errors = []
    if missing and download:
        for f in missing:
            for url in f.urls:
                try:
                    fetch(url, root / f.name, f.md5)
                    break
                except DatasetError:
                    raise
                except (urllib.error.URLError, OSError, TimeoutError) as err:
                    errors.append(f"{url}: {getattr(err, 'reason', err)}")
        missing = [f for f in missing if not (root / f.name).exists()]
    if missing:
        names = ", ".join(f.name for f in missing)
        how = "download failed (" + "; ".join(errors[:2]) + ")" if errors else "downloading is off"
        raise DatasetError(
            f"{dataset}: missing {names} in {root}; {how}. Put the official files there, or point "
            f"data.root at a folder that holds them"
        )
    return [root / f.name for f in files]
