"""Data stays inside ``data.root``: the one guarded way every loader lists and opens files under it.

A loader never opens a file it found under ``data.root`` directly; it calls
:func:`read_file` (one file), :func:`list_folder` (a folder's files, links
checked) or :func:`hetfl.data.datasets.tree.walk` (a folder or an archive, built
on both), and checks its whole source with :func:`check_source` before the
cache is consulted. All of them end in :func:`link_target`: a path that leads
(through a symbolic link, of the file or of a folder above it) outside
``data.root`` is a DatasetError naming it, unless the loader offers
``data.options.follow_links`` and it is on; a link loop or a broken link is a
DatasetError too. Links that stay inside the root are always followed.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from hetfl.data.base import DatasetError

Listing = list[tuple[tuple[str, ...], Path]]


def link_target(path: Path, root: Path, follow_links: bool | None) -> Path:
    """Where link (or file/folder/archive) ``path`` really is; a DatasetError naming ``path`` when that is a
    loop, nowhere (broken link), or outside ``root`` while ``follow_links`` is off (False: the loader
    offers ``data.options.follow_links``; None: it does not)."""
    try:
        real = path.resolve(strict=True)
    except RuntimeError:  # Python < 3.13 reports a loop this way
        real = None
    except OSError as err:
        if err.errno != errno.ELOOP:
            what = f"a broken link (to {os.readlink(path)!r})" if path.is_symlink() else "not found (a broken link?)"
            raise DatasetError(f"{path}: {what} in data.root; remove it or make it point to a file inside "
                               "data.root") from None
        real = None
    if real is None:
        raise DatasetError(f"{path}: a symbolic link loop in data.root; remove the link") from None
    boundary = root.resolve()
    if not follow_links and real != boundary and not real.is_relative_to(boundary):
        option = "" if follow_links is None else (", or set data.options.follow_links = true to read linked "
                                                  "files wherever they are")
        raise DatasetError(f"{path}: a symbolic link to {real}, outside data.root ({boundary}); hetfl reads only "
                           f"files inside data.root; copy the file in{option}")
    return real


def present(path: Path) -> bool:
    """Whether file ``path`` is there to be read, counting a broken or looping link (so that reading it
    reports the link instead of calling the file missing)."""
    return path.is_file() or path.is_symlink()


def guard(path: Path, root: Path, follow_links: bool | None = None) -> Path:
    """``path`` itself when it (and every folder above it) stays inside ``root`` without links; else
    checked by :func:`link_target` (DatasetError naming ``path`` when it leaves ``root``, loops or is broken)."""
    if path.is_symlink() or not path.exists() or not path.resolve().is_relative_to(root.resolve()):
        link_target(path, root, follow_links)
    return path


def read_file(path: Path, root: Path, follow_links: bool | None = None) -> bytes:
    """The bytes of file ``path`` found under ``root``, after :func:`guard`; an unreadable file is a
    DatasetError naming it."""
    guard(path, root, follow_links)
    try:
        return path.read_bytes()
    except OSError as err:
        raise DatasetError(f"{path}: cannot be read ({err.strerror or err})") from None


def list_folder(source: Path, root: Path, follow_links: bool | None = None) -> Listing:
    """Every visible file under folder ``source`` as (path parts relative to ``source``, path).

    Hidden entries (``.hetfl-cache``, ``._x``, ``__MACOSX``) are skipped. Symbolic links are checked by
    :func:`link_target` (inside ``root``, or ``follow_links``); linked folders are descended into, and a
    folder that leads back to one of its own ancestors is a link loop (DatasetError).
    """
    files: Listing = []

    def visit(folder: Path, rel: tuple[str, ...], ancestors: frozenset[Path]) -> None:
        try:
            with os.scandir(folder) as it:
                entries = sorted((e for e in it if not e.name.startswith(".") and e.name != "__MACOSX"),
                                 key=lambda e: e.name)
        except OSError as err:
            raise DatasetError(f"{folder}: cannot be listed ({err.strerror or err})") from None
        for entry in entries:
            path, parts = Path(entry.path), (*rel, entry.name)
            real = link_target(path, root, follow_links) if entry.is_symlink() else None
            if entry.is_dir():
                real = real or path.resolve()
                if real in ancestors:
                    raise DatasetError(f"{path}: a symbolic link loop in data.root (it leads back to {real}); "
                                       "remove the link")
                visit(path, parts, ancestors | {real})
            else:
                files.append((parts, path))

    guard(source, root, follow_links)
    visit(source, (), frozenset({source.resolve()}))
    return files


def check_source(source: Path, root: Path, follow_links: bool | None = None) -> None:
    """The file, archive or folder ``source`` found in ``root`` must lie inside it (it may be a link that
    stays inside): a DatasetError naming it otherwise (see :func:`link_target`); a folder's links are
    checked too. Called before the cache is consulted, so a cached copy never hides a bad link."""
    guard(source, root, follow_links)
    if source.is_dir():
        list_folder(source, root, follow_links)
