"""CIFAR-10 / CIFAR-100 from the official *binary* archives (never the pickled ones).

Binary layout (Krizhevsky 2009, cs.toronto.edu/~kriz/cifar.html): fixed-size
records; CIFAR-10 ``<1 label byte><3072 pixel bytes>``, CIFAR-100
``<1 coarse byte><1 fine byte><3072 pixel bytes>``, pixels channel-major
(1024 R, 1024 G, 1024 B), row-major 32x32. Members are read straight from the
tar archive, nothing else in it is touched.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np

from hetfl.data.base import DatasetError
from hetfl.data.datasets.download import Remote

CIFAR10 = Remote("cifar-10-binary.tar.gz", ("https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",),
                 "c32a1d4ab5d03f1284b67883e8d87530")
CIFAR100 = Remote("cifar-100-binary.tar.gz", ("https://www.cs.toronto.edu/~kriz/cifar-100-binary.tar.gz",),
                  "03b5dce01913d631647c71ecec9e9cb8")
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR10_FILES = {"train": [f"cifar-10-batches-bin/data_batch_{i}.bin" for i in range(1, 6)],
                 "test": ["cifar-10-batches-bin/test_batch.bin"]}
CIFAR100_FILES = {"train": ["cifar-100-binary/train.bin"], "test": ["cifar-100-binary/test.bin"]}


def parse_records(data: bytes, label_bytes: int, label_index: int, source: str) -> tuple[np.ndarray, np.ndarray]:
    record = label_bytes + 3072
    if len(data) % record:
        raise DatasetError(f"{source}: size {len(data)} is not a multiple of the {record}-byte CIFAR record")
    rows = np.frombuffer(data, dtype=np.uint8).reshape(-1, record)
    images = rows[:, label_bytes:].reshape(-1, 3, 32, 32).copy()
    return images, rows[:, label_index].astype(np.int64)


def read_members(root: Path, archive: str, members: dict[str, list[str]]) -> dict[str, list[bytes]]:
    """Bytes of each member, from extracted files under ``root`` or from ``root/archive``."""
    out: dict[str, list[bytes]] = {}
    if all((root / m).exists() for ms in members.values() for m in ms):
        return {split: [(root / m).read_bytes() for m in ms] for split, ms in members.items()}
    tar_path = root / archive
    try:
        with tarfile.open(tar_path, "r:*") as tar:
            for split, ms in members.items():
                out[split] = []
                for m in ms:
                    fh = tar.extractfile(m)
                    if fh is None:
                        raise KeyError(m)
                    out[split].append(fh.read())
    except (tarfile.TarError, KeyError, EOFError, OSError) as err:
        raise DatasetError(f"{tar_path}: not the official archive or corrupt ({type(err).__name__}: {err})") from None
    return out


def load_cifar(root: Path, which: str, label_mode: str = "fine") -> dict[str, np.ndarray]:
    """Arrays ``train_x, train_y, test_x, test_y`` of CIFAR-10 (``which="10"``) or CIFAR-100."""
    if which == "10":
        raw = read_members(root, CIFAR10.name, CIFAR10_FILES)
        label_bytes, label_index, num = 1, 0, 10
    else:
        raw = read_members(root, CIFAR100.name, CIFAR100_FILES)
        label_bytes, label_index, num = 2, (1 if label_mode == "fine" else 0), (100 if label_mode == "fine" else 20)
    arrays = {}
    for split, chunks in raw.items():
        parts = [parse_records(c, label_bytes, label_index, f"{root} ({split})") for c in chunks]
        arrays[f"{split}_x"] = np.concatenate([p[0] for p in parts])
        arrays[f"{split}_y"] = np.concatenate([p[1] for p in parts])
        if arrays[f"{split}_y"].max(initial=0) >= num:
            raise DatasetError(f"{root}: CIFAR labels out of range (>= {num}); corrupt file?")
    return arrays
