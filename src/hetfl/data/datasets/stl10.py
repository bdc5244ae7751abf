"""STL-10 (Coates, Lee, Ng, AISTATS 2011) from the official binary release.

``stl10_binary/{train,test}_X.bin``: uint8 images 3x96x96 stored column-major
(each channel transposed); ``*_y.bin``: labels 1..10, shifted to 0..9 here.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np

from hetfl.data.base import DatasetError
from hetfl.data.datasets.download import Remote

STL10 = Remote("stl10_binary.tar.gz", ("http://ai.stanford.edu/~acoates/stl10/stl10_binary.tar.gz",),
               "91f7769df0f17e558f3565bffb0c7dfb")
STL10_CLASSES = ("airplane", "bird", "car", "cat", "deer", "dog", "horse", "monkey", "ship", "truck")
STL10_FILES = ("train_X.bin", "train_y.bin", "test_X.bin", "test_y.bin")


def _read(root: Path, name: str) -> bytes:
    for path in (root / "stl10_binary" / name, root / name):
        if path.exists():
            return path.read_bytes()
    archive = root / STL10.name
    try:
        with tarfile.open(archive, "r:*") as tar:
            fh = tar.extractfile(f"stl10_binary/{name}")
            if fh is None:
                raise KeyError(name)
            return fh.read()
    except (tarfile.TarError, KeyError, OSError) as err:
        raise DatasetError(f"stl10: cannot read {name} from {root} or {archive} ({err})") from None


def load_stl10(root: Path) -> dict[str, np.ndarray]:
    arrays = {}
    for split in ("train", "test"):
        x = np.frombuffer(_read(root, f"{split}_X.bin"), dtype=np.uint8)
        y = np.frombuffer(_read(root, f"{split}_y.bin"), dtype=np.uint8).astype(np.int64) - 1
        if x.size != len(y) * 3 * 96 * 96:
            raise DatasetError(f"stl10: {split}_X.bin holds {x.size} bytes, expected {len(y)} x 3x96x96")
        if y.size and (y.min() < 0 or y.max() > 9):
            raise DatasetError(f"stl10: {split}_y.bin labels outside 1..10")
        arrays[f"{split}_x"] = x.reshape(-1, 3, 96, 96).transpose(0, 1, 3, 2).copy()
        arrays[f"{split}_y"] = y
    return arrays
