"""MNIST, Fashion-MNIST and EMNIST from their official IDX files (gzipped or not).

IDX format (LeCun et al., yann.lecun.com/exdb/mnist): a big-endian magic
number ``0x00 0x00 <type> <ndim>`` (type 0x08 = unsigned byte), ``ndim``
uint32 sizes, then the raw array. Images are ``idx3`` (N x 28 x 28), labels
``idx1`` (N).

Checksums: MNIST and Fashion-MNIST MD5s as published with the files (the same
values torchvision verifies); EMNIST's ``gzip.zip`` MD5 as in torchvision's
EMNIST (NIST publishes no checksum).
"""

from __future__ import annotations

import gzip
import zipfile
import zlib
from pathlib import Path

import numpy as np

from hetfl.data.base import Dataset, DatasetError
from hetfl.data.datasets.cache import cached, fingerprint
from hetfl.data.datasets.common import EMNIST_NORM, FMNIST_NORM, MNIST_NORM, Context, Norm, image_dataset
from hetfl.data.datasets.download import Remote, ensure, incomplete_folder
from hetfl.data.datasets.paths import guard, present, read_file
from hetfl.files import atomic_write_bytes

FORMAT = 1  # bump when the decoded arrays change
MNIST_MIRRORS = ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/")
FMNIST_MIRRORS = ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
                  "https://github.com/zalandoresearch/fashion-mnist/raw/master/data/fashion/")
FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
         "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
MNIST_MD5 = ("f68b3c2dcbeaaa9fbdd348bbdeb94873", "d53e105ee54ea40749a09fcbcd1e9432",
             "9fb629c4189551a2d022fa330f9573f3", "ec29112dd5afa0611ce80d1b7f02629c")
FMNIST_MD5 = ("8d4fb7e6c68d591d4c3dfef9ec88bf0d", "25c81989df183df01b3e8a0aad5dffbe",
              "bef4ecab320f06d8554ea6380940ec79", "bb300cfdad3c16e7a12a480ee83cd310")
# Module attributes (not constants captured elsewhere) so tests can point them at local file:// URLs.
MNIST = tuple(Remote(n, tuple(m + n for m in MNIST_MIRRORS), md5) for n, md5 in zip(FILES, MNIST_MD5, strict=True))
FMNIST = tuple(Remote(n, tuple(m + n for m in FMNIST_MIRRORS), md5) for n, md5 in zip(FILES, FMNIST_MD5, strict=True))
EMNIST_ZIP = Remote("gzip.zip", ("https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip",),
                    md5="58c8d27c78d21e728a6bc7b3cc06412e")

MNIST_CLASSES = tuple(str(i) for i in range(10))
FMNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                  "Ankle boot")
_DIGITS = [str(i) for i in range(10)]
_UPPER = [chr(c) for c in range(ord("A"), ord("Z") + 1)]
_LOWER = [chr(c) for c in range(ord("a"), ord("z") + 1)]
_MERGED_LOWER = ["a", "b", "d", "e", "f", "g", "h", "n", "q", "r", "t"]  # lower-case classes bymerge keeps
EMNIST_CLASSES: dict[str, tuple[str, ...]] = {  # Cohen et al. 2017, EMNIST, table II
    "byclass": tuple(_DIGITS + _UPPER + _LOWER),
    "bymerge": tuple(_DIGITS + _UPPER + _MERGED_LOWER),
    "balanced": tuple(_DIGITS + _UPPER + _MERGED_LOWER),
    "letters": tuple(_UPPER),
    "digits": tuple(_DIGITS),
    "mnist": tuple(_DIGITS),
}


def parse_idx(data: bytes, source: str, ndim: int) -> np.ndarray:
    """Decode an IDX byte string of unsigned bytes that must have ``ndim`` dimensions."""
    if len(data) < 4 or data[:3] != b"\x00\x00\x08" or data[3] != ndim:
        raise DatasetError(f"{source}: bad magic number {data[:4].hex() or 'empty'} (expected 000008{ndim:02x}, "
                           f"an IDX file of {ndim}-D unsigned bytes); replace it with the official file")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DatasetError(f"{source}: truncated IDX header; replace it with the official file")
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    if len(data) - header != int(np.prod(shape)):
        raise DatasetError(f"{source}: truncated or corrupt (header says {shape}, {len(data) - header} bytes "
                           "follow); replace it with the official file")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def read_idx(path: Path, ndim: int, root: Path | None = None) -> np.ndarray:
    """Read a (possibly gzipped) IDX file, which must stay inside ``root`` (default its folder; see
    :mod:`hetfl.data.datasets.paths`)."""
    raw = read_file(path, path.parent if root is None else root)
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as err:
            raise DatasetError(f"{path}: corrupt gzip file ({err}); replace it with the official file") from None
    return parse_idx(raw, str(path), ndim)


def read_pair(images_path: Path, labels_path: Path, root: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Images ``[N, 28, 28]`` and int64 labels, checked for 28x28 images and equal counts."""
    images = read_idx(images_path, 3, root)
    labels = read_idx(labels_path, 1, root).astype(np.int64)
    if images.shape[1:] != (28, 28):
        raise DatasetError(f"{images_path}: images are {images.shape[1]}x{images.shape[2]}, expected 28x28")
    if len(images) != len(labels):
        raise DatasetError(f"{images_path} ({len(images)} images) and {labels_path} ({len(labels)} labels) "
                           "differ in length; replace them with the official files")
    return images, labels


def check_labels(labels: np.ndarray, num_classes: int, source: Path) -> None:
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DatasetError(f"{source}: labels span {labels.min()}..{labels.max()}, expected 0..{num_classes - 1}; "
                           "replace it with the official file")


def locate(folder: Path, name: str) -> Path | None:
    """``folder/name`` (``.gz``) or its uncompressed twin, whichever exists (a broken link counts, so that
    reading it reports it)."""
    for candidate in (folder / name, folder / name.removesuffix(".gz")):
        if present(candidate):
            return candidate
    return None


def _load_mnist_like(ctx: Context, remotes: tuple[Remote, ...], classes: tuple[str, ...], norm: Norm) -> Dataset:
    if ctx.root.is_file():
        raise DatasetError(f"{ctx.name}: data.root = {str(ctx.root)!r} is a file; set it to the folder holding "
                           f"{', '.join(FILES)}")
    missing = [r for r in remotes if locate(ctx.root, r.name) is None]
    if missing:
        ensure(ctx.root, missing, download=ctx.download, dataset=ctx.name, alternative="(gzipped or not)")
    files = [p for name in FILES if (p := locate(ctx.root, name)) is not None]  # train images, labels, test ...
    for path in files:  # before the fingerprint follows any link
        guard(path, ctx.root)

    def build() -> dict[str, np.ndarray]:
        arrays = {}
        for split, (images, labels) in (("train", files[:2]), ("test", files[2:])):
            x, y = read_pair(images, labels, ctx.root)
            check_labels(y, len(classes), labels)
            arrays[f"{split}_x"], arrays[f"{split}_y"] = x[:, None], y
        return arrays

    arrays = cached(ctx.cache_dir, {"dataset": ctx.name, "format": FORMAT, "source": fingerprint(files)}, build)
    return image_dataset(ctx.name, arrays, classes, norm, notes=[f"{ctx.name} from {ctx.root}"])


def load_mnist(ctx: Context) -> Dataset:
    """MNIST (LeCun et al. 1998): 60,000 + 10,000 digits, 1x28x28."""
    return _load_mnist_like(ctx, MNIST, MNIST_CLASSES, MNIST_NORM)


def load_fmnist(ctx: Context) -> Dataset:
    """Fashion-MNIST (Xiao et al. 2017): 60,000 + 10,000 clothing images, 1x28x28."""
    return _load_mnist_like(ctx, FMNIST, FMNIST_CLASSES, FMNIST_NORM)


def emnist_files(split: str) -> list[str]:
    """The four official file names of EMNIST ``split`` (train images, train labels, test images, test labels)."""
    return [f"emnist-{split}-{part}-{kind}-ubyte.gz"
            for part in ("train", "test") for kind in ("images-idx3", "labels-idx1")]


def _write_extracted(folder: Path, name: str, data: bytes, archive_path: Path, wanted: list[str]) -> None:
    """Write ``folder/name`` atomically; a folder that cannot be written (a read-only data.root) is a
    DatasetError saying so, not taken for a damaged archive."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(folder / name, data)
    except OSError as err:
        raise DatasetError(f"{folder}: cannot write the files extracted from {archive_path} "
                           f"({err.strerror or err}); extract gzip/{', gzip/'.join(wanted)} from it into a folder "
                           "and set data.root to that folder, or make data.root writable") from None


def _extract_emnist(root: Path, names: list[str]) -> Path:
    """Extract ``names`` from NIST's ``gzip.zip`` (members ``gzip/<name>``) into ``root/gzip``, atomically.

    Only these fixed plain names are written (never a member's own path), into a folder that must stay
    inside ``root``, from an archive that must too: nothing is written or read outside ``data.root``.
    A damaged archive and a folder that cannot be written are different DatasetErrors (replace the
    archive; extract it elsewhere).
    """
    archive_path, folder = root / EMNIST_ZIP.name, root / "gzip"
    bad = [n for n in names if Path(n).name != n or n in ("", ".", "..")]
    if bad:
        raise DatasetError(f"EMNIST file names {bad} are not plain file names")
    guard(archive_path, root)
    if folder.exists() or folder.is_symlink():
        guard(folder, root)
    wanted = [name for name in names if not (folder / name).is_file()]
    try:
        with zipfile.ZipFile(archive_path) as archive:
            for name in wanted:  # one member in memory at a time
                data = archive.read(f"gzip/{name}")
                _write_extracted(folder, name, data, archive_path, wanted)
    except (zipfile.BadZipFile, KeyError, OSError, EOFError, zlib.error) as err:
        raise DatasetError(f"{archive_path}: not NIST's EMNIST gzip.zip or corrupt ({err}); replace it") from None
    return folder


def load_emnist(ctx: Context, split: str) -> Dataset:
    """EMNIST (Cohen et al. 2017) ``split``, from ``emnist-<split>-*`` files in root or root/gzip, or gzip.zip.

    The official images are stored transposed; they are turned upright here.
    ``letters`` labels run 1..26 in the files and become 0..25.
    """
    names = emnist_files(split)
    folder = next((d for d in (ctx.root, ctx.root / "gzip") if all(locate(d, n) for n in names)), None)
    if folder is None:
        alternative = f"(or the extracted {', '.join(names)})"
        incomplete = incomplete_folder([ctx.root, ctx.root / "gzip"], names,
                                       lambda path: locate(path.parent, path.name) is not None)
        ensure(ctx.root, [EMNIST_ZIP], download=ctx.download, dataset="emnist", alternative=alternative,
               incomplete=incomplete)
        folder = _extract_emnist(ctx.root, names)
    files = [p for n in names if (p := locate(folder, n)) is not None]
    for path in files:  # before the fingerprint follows any link
        guard(path, ctx.root)
    classes = EMNIST_CLASSES[split]

    def build() -> dict[str, np.ndarray]:
        arrays = {}
        for part, (images, labels) in (("train", files[:2]), ("test", files[2:])):
            x, y = read_pair(images, labels, ctx.root)
            y = y - 1 if split == "letters" else y
            check_labels(y, len(classes), labels)
            arrays[f"{part}_x"], arrays[f"{part}_y"] = x.transpose(0, 2, 1)[:, None].copy(), y
        return arrays

    key = {"dataset": "emnist", "split": split, "format": FORMAT, "source": fingerprint(files)}
    arrays = cached(ctx.cache_dir, key, build)
    return image_dataset("emnist", arrays, classes, EMNIST_NORM, notes=[f"emnist-{split} from {folder}"])
