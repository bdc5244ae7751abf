"""MNIST, Fashion-MNIST and EMNIST in their official IDX format (optionally gzipped).

IDX (LeCun et al.): a big-endian header ``0x00 0x00 <dtype> <ndim>``, ``ndim``
uint32 sizes, then the raw array. Only unsigned-byte data is used here.
"""

from __future__ import annotations

import gzip
import zipfile
from pathlib import Path

import numpy as np

from hetfl.data.base import DatasetError
from hetfl.data.datasets.download import Remote, ensure

MNIST_MIRRORS = ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/")
# official MD5s (yann.lecun.com, as torchvision lists them)
MNIST_MD5 = {
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}
FMNIST_MIRRORS = ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",)
FMNIST_MD5 = {  # Zalando Research's published checksums
    "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
    "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
    "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
}
EMNIST_ZIP = Remote("gzip.zip", ("https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip",),
                    "58c8d27c78d21e728a6bc7b3cc06412e")
EMNIST_CLASSES = {
    "byclass": 62, "bymerge": 47, "balanced": 47, "letters": 26, "digits": 10, "mnist": 10,
}
MNIST_CLASSES = tuple(str(i) for i in range(10))
FMNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                  "Ankle boot")


def parse_idx(data: bytes, source: str, ndim: int) -> np.ndarray:
    """Decode an IDX byte string holding unsigned bytes with ``ndim`` dimensions."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08 or data[3] != ndim:
        raise DatasetError(f"{source}: not an IDX file of {ndim}-D unsigned bytes (bad magic number); "
                           "replace it with the official file")
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    offset = 4 + 4 * ndim
    if len(data) != offset + int(np.prod(shape)):
        raise DatasetError(f"{source}: truncated or corrupt (header says {shape}, {len(data) - offset} bytes follow)")
    return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(shape)


def read_idx(path: Path, ndim: int) -> np.ndarray:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as err:
            raise DatasetError(f"{path}: corrupt gzip file ({err})") from None
    return parse_idx(raw, str(path), ndim)


def _locate(root: Path, name: str) -> Path | None:
    """``name`` (gzipped) or its uncompressed twin under ``root``."""
    for candidate in (root / name, root / name.removesuffix(".gz")):
        if candidate.exists():
            return candidate
    return None


def load_idx_pair(root: Path, prefix: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    images = read_idx(_require(root, f"{prefix}-images-idx3-ubyte.gz"), 3)
    labels = read_idx(_require(root, f"{prefix}-labels-idx1-ubyte.gz"), 1).astype(np.int64)
    if len(images) != len(labels):
        raise DatasetError(f"{root}: {prefix} images ({len(images)}) and labels ({len(labels)}) differ in number")
    if labels.size and labels.max() >= num_classes:
        raise DatasetError(f"{root}: {prefix} labels go up to {labels.max()}, expected < {num_classes}")
    return images[:, None, :, :].copy(), labels


def _require(root: Path, name: str) -> Path:
    path = _locate(root, name)
    if path is None:
        raise DatasetError(f"missing {name} in {root}")
    return path


def fetch_mnist_like(root: Path, download: bool, dataset: str, mirrors: tuple[str, ...], md5: dict[str, str]) -> None:
    """Make sure the four official files are under ``root`` (plain or gzipped)."""
    missing = [n for n in md5 if _locate(root, n) is None]
    if missing:
        ensure(root, [Remote(n, tuple(m + n for m in mirrors), md5[n]) for n in missing], download, dataset)


def load_emnist(root: Path, split: str, download: bool) -> dict[str, np.ndarray]:
    """EMNIST (Cohen et al. 2017) ``split`` from ``emnist-<split>-*.gz`` files or NIST's ``gzip.zip``.

    The official images are stored transposed; they are turned upright here.
    ``letters`` labels run 1..26 in the files and become 0..25.
    """
    names = [f"emnist-{split}-{part}-{kind}-idx{d}-ubyte.gz"
             for part in ("train", "test") for kind, d in (("images", 3), ("labels", 1))]
    folder = next((d for d in (root, root / "gzip") if all(_locate(d, n) for n in names)), None)
    if folder is None:
        if not (root / EMNIST_ZIP.name).exists():
            try:
                ensure(root, [EMNIST_ZIP], download, "emnist")
            except DatasetError as err:
                raise DatasetError(f"{err} (or the extracted {', '.join(names)})") from None
        folder = root / "gzip"
        with zipfile.ZipFile(root / EMNIST_ZIP.name) as archive:
            for n in names:
                target = folder / n
                if not target.exists():
                    folder.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(archive.read(f"gzip/{n}"))
    arrays = {}
    for part in ("train", "test"):
        images = read_idx(_require(folder, f"emnist-{split}-{part}-images-idx3-ubyte.gz"), 3)
        labels = read_idx(_require(folder, f"emnist-{split}-{part}-labels-idx1-ubyte.gz"), 1).astype(np.int64)
        if split == "letters":
            labels = labels - 1
        if labels.size and (labels.min() < 0 or labels.max() >= EMNIST_CLASSES[split]):
            raise DatasetError(f"{folder}: emnist-{split} labels outside 0..{EMNIST_CLASSES[split] - 1}")
        arrays[f"{part}_x"] = images.transpose(0, 2, 1)[:, None].copy()
        arrays[f"{part}_y"] = labels
    return arrays


def emnist_classes(split: str) -> tuple[str, ...]:
    digits = [str(i) for i in range(10)]
    upper = [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    lower = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    if split == "letters":
        return tuple(upper)
    if split in ("digits", "mnist"):
        return tuple(digits)
    if split == "byclass":
        return tuple(digits + upper + lower)
    merged_lower = ["a", "b", "d", "e", "f", "g", "h", "n", "q", "r", "t"]  # the 11 lower-case classes kept
    return tuple(digits + upper + merged_lower)
