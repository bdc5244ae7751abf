"""Decoded arrays cached as ``.npy`` files (never pickle), every file written atomically.

An entry is a folder ``<cache_dir>/<dataset>-<digest>/`` holding one
``<name>.npy`` per array and a ``manifest.json`` written last, so an entry is
complete exactly when its manifest exists; a crash mid-write leaves at most
stray hidden temporary files, never a half-written array under its final name
(each file is written by :func:`hetfl.files.atomic_write`). The
digest is over a JSON key: dataset name, the options that change the decoded
arrays, a format version and a cheap fingerprint of the source files (paths,
sizes, modification times), so editing or replacing the source invalidates it,
and two datasets (or two copies of one in different folders) never share an entry.

The cache lives in the user's cache directory (``data.cache_dir``; default
``$XDG_CACHE_HOME/hetfl/datasets``, else ``~/.cache/hetfl/datasets``), never
next to the data: a dataset folder may be shared between users or read-only
(hetfl writes there only to download missing files).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hetfl.files import atomic_write, atomic_write_text
from hetfl.params import ConfigError

#: sub-folder of the user's cache directory holding decoded datasets
DATASETS_DIRNAME = "datasets"


def user_cache_dir() -> Path:
    """``~/.cache/hetfl``: where datasets are downloaded when ``data.root`` is ``""`` (``<this>/data/<name>``)."""
    return Path.home() / ".cache" / "hetfl"


def default_cache_dir() -> Path:
    """Where decoded datasets go when ``data.cache_dir`` is ``""``: ``$XDG_CACHE_HOME/hetfl/datasets``, or
    ``~/.cache/hetfl/datasets`` when ``XDG_CACHE_HOME`` is unset or not absolute (the XDG Base Directory rule)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "hetfl" / DATASETS_DIRNAME


def resolve_cache_dir(setting: str | os.PathLike | None) -> Path:
    """The cache folder a ``data.cache_dir`` value names (``""``/``None``: :func:`default_cache_dir`; ``~``
    expanded). A path that exists and is not a folder is a ConfigError, raised before anything is read or
    written. A folder that cannot be created or written is allowed: loading works, only without a cache."""
    if setting is None or str(setting) == "":
        return default_cache_dir()
    path = Path(setting).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError("data.cache_dir", str(setting),
                          f"is a file; set it to a folder for decoded datasets ('' = {default_cache_dir()})")
    return path


def fingerprint(paths: Iterable[Path]) -> str:
    """Cheap identity of source files and folders: relative names, sizes and mtimes, hashed.

    Folders are walked (hidden entries, such as the ``.hetfl-cache`` folder
    that hetfl wrote inside data folders before ``data.cache_dir``, are
    skipped, and the folders' own mtimes are ignored, so a stray hidden file
    does not change a data folder's fingerprint). About 0.5 s for
    60,000 files. Links are followed (their targets are what a loader reads),
    except into a folder's own ancestor (a link loop), and a link that leads
    nowhere counts as itself: the fingerprint never fails or recurses without
    end; the loaders report such links (``imagefolder.list_folder``).
    """
    lines: list[str] = []

    def walk(folder: str, rel: str, ancestors: frozenset[str]) -> None:
        with os.scandir(folder) as it:
            entries = sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
        for entry in entries:
            try:
                is_dir, st = entry.is_dir(), entry.stat()
            except OSError:  # a broken link or a file link loop
                is_dir, st = False, entry.stat(follow_symlinks=False)
            real = os.path.realpath(entry.path) if is_dir else ""
            if is_dir and real not in ancestors:
                walk(entry.path, f"{rel}{entry.name}/", ancestors | {real})
            else:
                lines.append(f"{rel}{entry.name}:{st.st_size}:{st.st_mtime_ns}")

    for path in paths:
        path = Path(path).resolve()
        lines.append(str(path))
        if path.is_dir():
            walk(str(path), "", frozenset({str(path)}))
        else:
            st = path.stat()
            lines.append(f":{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\0".join(lines).encode()).hexdigest()[:20]


def entry_dir(cache_dir: Path, key: Mapping[str, Any]) -> Path:
    """The cache folder of ``key``."""
    text = json.dumps(key, sort_keys=True, default=str)
    return Path(cache_dir) / f"{key.get('dataset', 'data')}-{hashlib.sha256(text.encode()).hexdigest()[:20]}"


def _normalised(key: Mapping[str, Any]) -> Any:
    return json.loads(json.dumps(key, sort_keys=True, default=str))


def load_entry(cache_dir: Path, key: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
    """The cached arrays of ``key``, or ``None`` if absent or unreadable (then they are decoded again and
    the entry rewritten; np.load raises EOFError for an empty ``.npy``, as a crash may leave one)."""
    folder = entry_dir(cache_dir, key)
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        if manifest["key"] != _normalised(key):
            return None
        return {name: np.load(folder / f"{name}.npy", allow_pickle=False) for name in manifest["arrays"]}
    except (OSError, ValueError, KeyError, TypeError, EOFError):
        return None


def save_entry(cache_dir: Path, key: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> Path:
    """Store ``arrays`` under ``key``: each array atomically, the manifest last."""
    folder = entry_dir(cache_dir, key)
    folder.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        if array.dtype == object:
            raise TypeError(f"cache array {name!r} has dtype object; only plain arrays are cached")
        atomic_write(folder / f"{name}.npy", lambda fh, a=array: np.save(fh, np.ascontiguousarray(a),
                                                                           allow_pickle=False))
    manifest = {"key": _normalised(key), "arrays": list(arrays)}
    atomic_write_text(folder / "manifest.json", json.dumps(manifest, indent=1))
    return folder


def cached(
    cache_dir: Path, key: Mapping[str, Any], build: Callable[[], dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """Arrays for ``key`` from the cache, or ``build()`` them and store them.

    An unwritable cache costs time on the next load, not correctness, so a
    failed write is ignored.
    """
    arrays = load_entry(cache_dir, key)
    if arrays is not None:
        return arrays
    arrays = build()
    with contextlib.suppress(OSError):
        save_entry(cache_dir, key, arrays)
    return arrays
