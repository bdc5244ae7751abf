"""Decoded arrays cached as ``.npy`` files (never pickle), written atomically."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np


def default_cache_dir(root: Path | None) -> Path:
    """``<root>/.hetfl-cache`` when writable, else ``~/.cache/hetfl``."""
    if root is not None and root.is_dir() and os.access(root, os.W_OK):
        return root / ".hetfl-cache"
    return Path.home() / ".cache" / "hetfl"


def fingerprint(paths: list[Path]) -> str:
    """Cheap identity of source files: names, sizes and modification times."""
    parts = []
    for p in paths:
        st = p.stat()
        parts.append(f"{p.resolve()}:{st.st_size}:{int(st.st_mtime)}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _save_npy(path: Path, array: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            np.save(fh, array, allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cached(
    cache_dir: Path, key: dict, build: Callable[[], dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """Arrays for ``key`` from the cache, or ``build()`` them and store them.

    The arrays are written first and a small JSON manifest last, so a cache
    entry is complete exactly when its manifest exists.
    """
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    folder = cache_dir / f"{key.get('dataset', 'data')}-{digest}"
    manifest = folder / "manifest.json"
    if manifest.exists():
        names = json.loads(manifest.read_text())["arrays"]
        return {name: np.load(folder / f"{name}.npy", allow_pickle=False) for name in names}
    arrays = build()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, array in arrays.items():
            _save_npy(folder / f"{name}.npy", np.ascontiguousarray(array))
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".manifest.", suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump({"key": key, "arrays": list(arrays)}, fh)
        os.replace(tmp, manifest)
    except OSError:
        pass  # an unwritable cache costs time, not correctness
    return arrays
