"""Image folders: ``root/{train,test}/<class>/*`` or ``root/<domain>/<class>/*``.

Serves CINIC-10 (``train/valid/test``), the CIFAR-10 JPEG copy, PACS,
Office-Home and DomainNet (domain layout) and Tiny-ImageNet (its own layout).
The folder may also be a ``.tar``/``.tar.gz`` archive of such a tree: images
are decoded straight from the archive. Decoding uses Pillow (optional
dependency ``hetfl[images]``); the result is cached by the caller.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import numpy as np

from hetfl.data.base import DatasetError

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".ppm", ".tif", ".tiff"}


def _pillow():  # type: ignore[no-untyped-def]
    try:
        from PIL import Image
    except ImportError:
        raise DatasetError("image folders need Pillow: pip install pillow (or pip install 'hetfl[images]')") from None
    return Image


def is_archive(path: Path) -> bool:
    return path.is_file() and any(path.name.endswith(s) for s in (".tar", ".tar.gz", ".tgz"))


def list_images(root: Path) -> Iterator[tuple[tuple[str, ...], bytes]]:
    """(path parts relative to the tree's top, file bytes) of every image under ``root``.

    For an archive whose members share one top folder (``cifar10-jpeg/...``),
    that folder is stripped so the layout starts at ``train/`` or ``<domain>/``.
    """
    if is_archive(root):
        with tarfile.open(root, "r:*") as tar:
            members, strip = _archive_images(tar)
            for m in members:
                fh = tar.extractfile(m)
                if fh is not None:
                    yield PurePosixPath(m.name).parts[strip:], fh.read()
        return
    for path in sorted(root.rglob("*")):
        if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file() and ".hetfl-cache" not in path.parts:
            yield path.relative_to(root).parts, path.read_bytes()


def _archive_images(tar: tarfile.TarFile) -> tuple[list[tarfile.TarInfo], int]:
    """Image members sorted by name, and how many leading folders to strip (1 if all share one top)."""
    members = sorted((m for m in tar.getmembers() if m.isfile() and PurePosixPath(m.name).suffix.lower()
                      in IMAGE_SUFFIXES), key=lambda m: m.name)
    tops = {PurePosixPath(m.name).parts[0] for m in members}
    strip = 1 if len(tops) == 1 and all(len(PurePosixPath(m.name).parts) > 3 for m in members) else 0
    return members, strip


def top_folders(root: Path) -> set[str]:
    """First path component of every image (after stripping an archive's single top folder)."""
    if is_archive(root):
        with tarfile.open(root, "r:*") as tar:
            members, strip = _archive_images(tar)
        return {PurePosixPath(m.name).parts[strip] for m in members}
    return {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")}


def decode(data: bytes, source: str, size: tuple[int, int] | None, channels: int) -> np.ndarray:
    """Image bytes -> uint8 ``[C, H, W]`` (resized to ``size`` = (H, W) when given)."""
    image_mod = _pillow()
    try:
        with image_mod.open(io.BytesIO(data)) as img:
            img = img.convert("RGB" if channels == 3 else "L")
            if size is not None and img.size != (size[1], size[0]):
                img = img.resize((size[1], size[0]), image_mod.BILINEAR)
            arr = np.asarray(img, dtype=np.uint8)
    except (OSError, ValueError) as err:
        raise DatasetError(f"{source}: cannot decode image ({err})") from None
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


def load_split_folder(
    root: Path, image_size: int | None, channels: int, splits: tuple[str, str] = ("train", "test"),
    classes: tuple[str, ...] | None = None,
) -> tuple[dict[str, np.ndarray], tuple[str, ...]]:
    """``root/{train,test}/<class>/*`` -> arrays and the class names (sorted unless given)."""
    items: dict[str, list[tuple[str, bytes]]] = {s: [] for s in splits}
    for parts, data in list_images(root):
        if len(parts) >= 3 and parts[0] in items:
            items[parts[0]].append((parts[1], data))
    for split in splits:
        if not items[split]:
            raise DatasetError(f"{root}: no images under {split}/<class>/; expected the layout "
                               f"{root}/{{{','.join(splits)}}}/<class>/<image>")
    names = classes or tuple(sorted({c for s in splits for c, _ in items[s]}))
    index = {c: i for i, c in enumerate(names)}
    size = (image_size, image_size) if image_size else None
    arrays = {}
    for split, key in zip(splits, ("train", "test"), strict=True):
        unknown = {c for c, _ in items[split]} - set(index)
        if unknown:
            raise DatasetError(f"{root}/{split}: unexpected class folders {sorted(unknown)[:5]}")
        if size is None:
            first = decode(items[split][0][1], str(root), None, channels)
            size = (first.shape[1], first.shape[2])
        arrays[f"{key}_x"] = np.stack([decode(d, f"{root}/{split}/{c}", size, channels) for c, d in items[split]])
        arrays[f"{key}_y"] = np.asarray([index[c] for c, _ in items[split]], dtype=np.int64)
    return arrays, names


def load_domain_folder(
    root: Path, image_size: int | None, channels: int, domains: tuple[str, ...] | None, test_fraction: float,
    seed: int,
) -> tuple[dict[str, np.ndarray], tuple[str, ...], tuple[str, ...]]:
    """``root/<domain>/<class>/*`` -> arrays with per-sample domain ids, classes, domains.

    Each domain is split into train and test deterministically (``test_fraction``, ``seed``).
    """
    by_domain: dict[str, list[tuple[str, bytes]]] = {}
    for parts, data in list_images(root):
        if len(parts) >= 3:
            by_domain.setdefault(parts[0], []).append((parts[1], data))
    available = tuple(sorted(by_domain))
    if not available:
        raise DatasetError(f"{root}: no images found; expected {root}/<domain>/<class>/<image>")
    chosen = domains or available
    missing = [d for d in chosen if d not in by_domain]
    if missing:
        raise DatasetError(f"data.options.domains = {list(chosen)}: {missing} not found; available: {list(available)}")
    names = tuple(sorted({c for d in chosen for c, _ in by_domain[d]}))
    index = {c: i for i, c in enumerate(names)}
    size = (image_size, image_size) if image_size else None
    if size is None:
        first = decode(by_domain[chosen[0]][0][1], str(root), None, channels)
        size = (first.shape[1], first.shape[2])
    rng = np.random.default_rng(seed)
    out: dict[str, list[np.ndarray]] = {k: [] for k in ("train_x", "train_y", "train_g", "test_x", "test_y", "test_g")}
    for g, domain in enumerate(chosen):
        entries = by_domain[domain]
        x = np.stack([decode(d, f"{root}/{domain}/{c}", size, channels) for c, d in entries])
        y = np.asarray([index[c] for c, _ in entries], dtype=np.int64)
        order = rng.permutation(len(entries))
        n_test = round(test_fraction * len(entries))
        for key, idx in (("test", order[:n_test]), ("train", order[n_test:])):
            out[f"{key}_x"].append(x[idx])
            out[f"{key}_y"].append(y[idx])
            out[f"{key}_g"].append(np.full(len(idx), g, dtype=np.int64))
    return {k: np.concatenate(v) for k, v in out.items()}, names, tuple(chosen)


def load_tinyimagenet(root: Path, image_size: int | None) -> tuple[dict[str, np.ndarray], tuple[str, ...]]:
    """Tiny-ImageNet-200's official layout: ``wnids.txt``, ``train/<wnid>/images/*``,
    ``val/images/*`` labelled by ``val/val_annotations.txt`` (used as the test split)."""
    base = root / "tiny-imagenet-200" if (root / "tiny-imagenet-200").is_dir() else root
    wnids_file, annotations = base / "wnids.txt", base / "val" / "val_annotations.txt"
    if not wnids_file.exists() or not annotations.exists():
        raise DatasetError(f"tinyimagenet: expected {base}/wnids.txt and {base}/val/val_annotations.txt "
                           "(the extracted tiny-imagenet-200.zip)")
    wnids = tuple(wnids_file.read_text().split())
    index = {w: i for i, w in enumerate(wnids)}
    val_label = {}
    for line in annotations.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) >= 2:
            val_label[fields[0]] = index[fields[1]]
    size = (image_size, image_size) if image_size else (64, 64)
    train = [(p, index[p.parts[-3]]) for p in sorted((base / "train").glob("*/images/*")) if p.parts[-3] in index]
    test = [(p, val_label[p.name]) for p in sorted((base / "val" / "images").glob("*")) if p.name in val_label]
    arrays = {}
    for key, entries in (("train", train), ("test", test)):
        if not entries:
            raise DatasetError(f"tinyimagenet: no {key} images under {base}")
        arrays[f"{key}_x"] = np.stack([decode(p.read_bytes(), str(p), size, 3) for p, _ in entries])
        arrays[f"{key}_y"] = np.asarray([y for _, y in entries], dtype=np.int64)
    return arrays, wnids
