"""Read the files of a folder tree, a tar archive (.tar, .tar.gz, .tgz ...) or a zip archive alike.

Image datasets ship as trees (``train/<class>/x.jpg``) either extracted or
packed. Reading them straight from the archive avoids writing tens of
thousands of small files; tar archives are streamed in storage order, so a
compressed tar is decompressed exactly once. Hidden entries (``.hetfl-cache``,
``._x`` resource forks, ``__MACOSX``) are skipped.
"""

from __future__ import annotations

import tarfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

from hetfl.data.base import DatasetError
from hetfl.data.datasets import paths

Parts = tuple[str, ...]
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
ARCHIVE_SUFFIXES = (*TAR_SUFFIXES, ".zip")


def is_archive(path: Path) -> bool:
    """Whether ``path`` is a file named like a tar or zip archive."""
    return path.is_file() and path.name.lower().endswith(ARCHIVE_SUFFIXES)


def _visible(parts: Parts) -> bool:
    return bool(parts) and not any(p.startswith(".") or p == "__MACOSX" for p in parts)


def walk(source: Path, select: Callable[[Parts], bool], *, root: Path,
         follow_links: bool | None = None) -> Iterator[tuple[Parts, bytes]]:
    """``(path parts, bytes)`` of each file under ``source`` (folder or archive) for which ``select(parts)``.

    Parts are relative to the folder or to the archive's root; folders are
    visited in sorted order, archives in storage order. ``source`` and every
    file read must stay inside ``root`` (``data.root``; see
    :mod:`hetfl.data.datasets.paths`): folders are listed and read through its
    guarded helpers, an archive is checked before it is opened. Archive
    members are only read, never extracted, and link members are skipped.
    """
    if source.is_dir():
        for parts, path in paths.list_folder(source, root, follow_links):
            if _visible(parts) and select(parts):
                yield parts, paths.read_file(path, root, follow_links)
        return
    paths.guard(source, root, follow_links)
    try:
        if source.name.lower().endswith(".zip"):
            with zipfile.ZipFile(source) as archive:
                for info in archive.infolist():
                    parts = PurePosixPath(info.filename).parts
                    if not info.is_dir() and _visible(parts) and select(parts):
                        yield parts, archive.read(info)
            return
        with tarfile.open(source, "r|*") as archive:
            for member in archive:
                parts = tuple(p for p in PurePosixPath(member.name).parts if p not in (".", "/"))
                if member.isfile() and _visible(parts) and select(parts):
                    fh = archive.extractfile(member)
                    if fh is not None:
                        yield parts, fh.read()
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as err:
        raise DatasetError(f"{source}: unreadable or corrupt archive ({type(err).__name__}: {err}); "
                           "replace it with a complete copy") from None


def strip_common_top(paths: list[Parts], min_depth: int) -> int:
    """How many leading folders all ``paths`` share and can drop while keeping ``min_depth`` parts.

    E.g. ``cifar10-jpeg/train/cat/1.jpg`` -> 1 with ``min_depth=3``.
    """
    strip = 0
    while paths and all(len(p) > strip + min_depth for p in paths) and len({p[strip] for p in paths}) == 1:
        strip += 1
    return strip
