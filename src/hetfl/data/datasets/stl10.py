"""STL-10 (Coates, Lee, Ng, AISTATS 2011) from the official binary release.

``stl10_binary/{train,test}_X.bin``: uint8 images 3x96x96, each channel
stored column-major (the reference reader transposes them); ``*_y.bin``:
one label byte per image, 1..10, shifted to 0..9 here. The 100,000 unlabeled
images are not used. Download: https://cs.stanford.edu/~acoates/stl10/ ; MD5
of ``stl10_binary.tar.gz`` as torchvision verifies it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hetfl.data.base import Dataset, DatasetError
from hetfl.data.datasets import tree
from hetfl.data.datasets.cache import cached, fingerprint
from hetfl.data.datasets.common import STL10_NORM, Context, image_dataset
from hetfl.data.datasets.download import Remote, ensure, incomplete_folder
from hetfl.data.datasets.paths import guard, present, read_file

FORMAT = 1  # bump when the decoded arrays change
STL10 = Remote("stl10_binary.tar.gz", ("http://ai.stanford.edu/~acoates/stl10/stl10_binary.tar.gz",),
               md5="91f7769df0f17e558f3565bffb0c7dfb")
STL10_CLASSES = ("airplane", "bird", "car", "cat", "deer", "dog", "horse", "monkey", "ship", "truck")
STL10_FILES = ("train_X.bin", "train_y.bin", "test_X.bin", "test_y.bin")
NATIVE = 96


def find_source(root: Path) -> Path | None:
    """The folder holding the four ``.bin`` files, or the official archive, at ``root``."""
    for candidate in (root / "stl10_binary", root):
        if candidate.is_dir() and all(present(candidate / n) for n in STL10_FILES):
            return candidate
    for candidate in (root, root / STL10.name):
        if present(candidate) and candidate.name == STL10.name:
            return candidate
    return None


def read_files(source: Path, root: Path | None = None) -> dict[str, bytes]:
    """The four files' bytes, from the folder or streamed from the archive (skipping ``unlabeled_X.bin``);
    they must stay inside ``root`` (default ``source``; see :mod:`hetfl.data.datasets.paths`)."""
    root = source if root is None else root
    if source.is_dir():
        return {n: read_file(source / n, root) for n in STL10_FILES}
    found = {parts[-1]: data for parts, data in tree.walk(source, lambda p: p[-1] in STL10_FILES, root=root)}
    missing = [n for n in STL10_FILES if n not in found]
    if missing:
        raise DatasetError(f"{source}: not the official archive ({', '.join(missing)} missing); replace it")
    return found


def _sources(source: Path) -> list[Path]:
    """The paths read from ``source``: the four files of a folder, or the archive itself."""
    return [source / n for n in STL10_FILES] if source.is_dir() else [source]


def decode_stl10(files: dict[str, bytes], source: Path) -> dict[str, np.ndarray]:
    """Raw bytes -> upright ``[N, 3, 96, 96]`` images and labels 0..9."""
    arrays = {}
    for split in ("train", "test"):
        x = np.frombuffer(files[f"{split}_X.bin"], dtype=np.uint8)
        y = np.frombuffer(files[f"{split}_y.bin"], dtype=np.uint8).astype(np.int64) - 1
        if x.size != len(y) * 3 * NATIVE * NATIVE:
            raise DatasetError(f"{source}: {split}_X.bin holds {x.size} bytes, expected {len(y)} images x 3x96x96 "
                               f"(per {split}_y.bin); replace them with the official files")
        if y.size and (y.min() < 0 or y.max() > 9):
            raise DatasetError(f"{source}: {split}_y.bin has labels outside 1..10; replace it with the official file")
        arrays[f"{split}_x"] = x.reshape(-1, 3, NATIVE, NATIVE).transpose(0, 1, 3, 2).copy()
        arrays[f"{split}_y"] = y
    return arrays


def resize_batch(x: np.ndarray, size: int) -> np.ndarray:
    """Resize uint8 ``[N, C, H, W]`` images with torch (area averaging down, bilinear up), in chunks."""
    out = []
    for start in range(0, len(x), 1024):
        chunk = torch.from_numpy(x[start : start + 1024]).float()
        mode = "area" if size < x.shape[-1] else "bilinear"
        kwargs = {} if mode == "area" else {"align_corners": False}
        chunk = torch.nn.functional.interpolate(chunk, size=(size, size), mode=mode, **kwargs)
        out.append(chunk.round().clamp(0, 255).to(torch.uint8).numpy())
    return np.concatenate(out) if out else np.zeros((0, x.shape[1], size, size), dtype=np.uint8)


def load_stl10(ctx: Context, image_size: int) -> Dataset:
    """STL-10's labelled images (5,000 train, 8,000 test), 96x96 or resized to ``image_size``."""
    source = find_source(ctx.root)
    if source is None:
        ensure(ctx.root, [STL10], download=ctx.download, dataset="stl10",
               alternative=f"(or its extracted stl10_binary/ with {', '.join(STL10_FILES)})",
               incomplete=incomplete_folder([ctx.root / "stl10_binary", ctx.root], STL10_FILES))
        source = ctx.root / STL10.name
    for path in _sources(source):  # before the fingerprint follows any link
        guard(path, ctx.root)
    size = image_size or NATIVE

    def build() -> dict[str, np.ndarray]:
        arrays = decode_stl10(read_files(source, ctx.root), source)
        if size != NATIVE:
            for split in ("train", "test"):
                arrays[f"{split}_x"] = resize_batch(arrays[f"{split}_x"], size)
        return arrays

    key = {"dataset": "stl10", "format": FORMAT, "image_size": size, "source": fingerprint([source])}
    arrays = cached(ctx.cache_dir, key, build)
    return image_dataset("stl10", arrays, STL10_CLASSES, STL10_NORM, notes=[f"stl10 ({size}px) from {source}"])
