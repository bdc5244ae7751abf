"""Tiny-ImageNet-200 (CS231n, Stanford) in its official layout.

``tiny-imagenet-200/wnids.txt`` (class order), ``train/<wnid>/images/*.JPEG``
(500 per class), ``val/images/*.JPEG`` labelled by ``val/val_annotations.txt``
(tab-separated: file, wnid, box) and used as the test split (the official test
images are unlabelled). Read from the extracted folder or straight from
``tiny-imagenet-200.zip`` (MD5 as torchvision-compatible loaders verify it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hetfl.data.base import Dataset, DatasetError
from hetfl.data.datasets import decode, tree
from hetfl.data.datasets.cache import cached, fingerprint
from hetfl.data.datasets.common import TINYIMAGENET_NORM, Context, image_dataset
from hetfl.data.datasets.download import Remote, ensure
from hetfl.data.datasets.imagefolder import is_image
from hetfl.data.datasets.paths import check_source, present

FORMAT = 1  # bump when the decoded arrays change
TINYIMAGENET = Remote("tiny-imagenet-200.zip", ("http://cs231n.stanford.edu/tiny-imagenet-200.zip",),
                      md5="90528d7ca1a48142e341f4ef8d21d0de")
TEXT_FILES = ("wnids.txt", "val_annotations.txt")
NATIVE = 64


def find_source(root: Path) -> Path | None:
    """The folder with ``wnids.txt`` or the official zip, at ``root``."""
    for candidate in (root / "tiny-imagenet-200", root):
        if present(candidate / "wnids.txt"):
            return candidate
    for candidate in (root, root / TINYIMAGENET.name):
        if present(candidate) and candidate.name == TINYIMAGENET.name:
            return candidate
    return None


def _wanted(parts: tuple[str, ...]) -> bool:
    if parts[-1] in TEXT_FILES:
        return True
    return is_image(parts) and (
        (len(parts) >= 4 and parts[-2] == "images" and parts[-4] == "train")
        or (len(parts) >= 3 and parts[-2] == "images" and parts[-3] == "val"))


def decode_tinyimagenet(source: Path, size: int, root: Path | None = None) -> dict[str, np.ndarray]:
    """Decode train and val images (in one pass over the folder or archive) with their labels; files
    must stay inside ``root`` (default ``source``; see :mod:`hetfl.data.datasets.paths`)."""
    texts: dict[str, str] = {}
    train: list[tuple[tuple[str, ...], str, np.ndarray]] = []
    val: list[tuple[tuple[str, ...], str, np.ndarray]] = []
    for parts, data in tree.walk(source, _wanted, root=source if root is None else root):
        if parts[-1] in TEXT_FILES:
            texts[parts[-1]] = data.decode()
            continue
        image = decode.decode(data, f"{source}/{'/'.join(parts)}", 3, (size, size))
        if parts[-4:-3] == ("train",):
            train.append((parts, parts[-3], image))
        else:
            val.append((parts, parts[-1], image))
    missing = [where for name, where in zip(TEXT_FILES, ("wnids.txt", "val/val_annotations.txt"), strict=True)
               if name not in texts]
    if missing:
        raise DatasetError(f"{source}: {' and '.join(missing)} missing; expected the extracted "
                           f"{TINYIMAGENET.name} (tiny-imagenet-200/wnids.txt, train/, val/)")
    wnids = texts["wnids.txt"].split()
    index = {w: i for i, w in enumerate(wnids)}
    val_wnid = dict(line.split("\t")[:2] for line in texts["val_annotations.txt"].splitlines() if "\t" in line)
    unlisted = [parts for parts, name, _ in val if name not in val_wnid]
    if unlisted:
        raise DatasetError(f"{source}: {'/'.join(unlisted[0][-3:])} is not listed in val/val_annotations.txt"
                           f"{f' (nor {len(unlisted) - 1} more val images)' if len(unlisted) > 1 else ''}; "
                           "remove it or use the official val/val_annotations.txt")
    arrays: dict[str, np.ndarray] = {"classes": np.asarray(wnids, dtype=str)}
    for key, items, label_of in (("train", train, lambda s: s), ("test", val, lambda s: val_wnid.get(s, ""))):
        items.sort(key=lambda item: item[0])
        if not items:
            raise DatasetError(f"{source}: no {'train/<wnid>/images' if key == 'train' else 'val/images'} images; "
                               "expected the official tiny-imagenet-200 layout")
        unknown = sorted({label_of(t) for _, t, _ in items} - set(index))
        if unknown:
            raise DatasetError(f"{source}: {key} images of classes {unknown[:3]} missing from wnids.txt (or from "
                               "val_annotations.txt); expected the official tiny-imagenet-200 layout")
        arrays[f"{key}_x"] = np.stack([img for _, _, img in items])
        arrays[f"{key}_y"] = np.asarray([index[label_of(t)] for _, t, _ in items], dtype=np.int64)
    return arrays


def load_tinyimagenet(ctx: Context, image_size: int) -> Dataset:
    """Tiny-ImageNet: 100,000 train + 10,000 val (as test) RGB images, 200 classes, 64x64 or ``image_size``."""
    source = find_source(ctx.root)
    if source is None:
        ensure(ctx.root, [TINYIMAGENET], download=ctx.download, dataset="tinyimagenet",
               alternative="(or the extracted tiny-imagenet-200/ folder)")
        source = ctx.root / TINYIMAGENET.name
    check_source(source, ctx.root)  # before the fingerprint follows any link
    size = image_size or NATIVE
    key = {"dataset": "tinyimagenet", "format": FORMAT, "image_size": size, "source": fingerprint([source])}
    arrays = dict(cached(ctx.cache_dir, key, lambda: decode_tinyimagenet(source, size, ctx.root)))
    classes = tuple(str(c) for c in arrays.pop("classes"))
    return image_dataset("tinyimagenet", arrays, classes, TINYIMAGENET_NORM,
                         notes=[f"tinyimagenet ({size}px, val split as test) from {source}"])
