"""CIFAR-10 / CIFAR-100 from the official *binary* archives (never the pickled Python version), or a
CIFAR-10 image folder.

Binary layout (Krizhevsky 2009, https://www.cs.toronto.edu/~kriz/cifar.html):
fixed-size records, CIFAR-10 ``<1 label byte><3072 pixel bytes>``, CIFAR-100
``<1 coarse label byte><1 fine label byte><3072 pixel bytes>``; pixels
channel-major (1024 R, 1024 G, 1024 B), each channel row-major 32x32. The MD5s
are the ones published on that page.

Sources, first match wins: the extracted ``cifar-10-batches-bin/`` (or
``root`` being that folder), the archive (``root`` or inside it), for CIFAR-10
an image folder ``train/<class>/*`` + ``test/<class>/*`` (extracted or a
``.tar.gz``, e.g. the JPEG copy in ``../shared/datasets``), else a download.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hetfl.data.base import Dataset, DatasetError
from hetfl.data.datasets import imagefolder, tree
from hetfl.data.datasets.cache import cached, fingerprint
from hetfl.data.datasets.common import CIFAR10_NORM, CIFAR100_NORM, Context, image_dataset
from hetfl.data.datasets.download import Remote, ensure, incomplete_folder
from hetfl.data.datasets.paths import check_source, guard, present, read_file

FORMAT = 1  # bump when the decoded arrays change
CIFAR10 = Remote("cifar-10-binary.tar.gz", ("https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",),
                 md5="c32a1d4ab5d03f1284b67883e8d87530")
CIFAR100 = Remote("cifar-100-binary.tar.gz", ("https://www.cs.toronto.edu/~kriz/cifar-100-binary.tar.gz",),
                  md5="03b5dce01913d631647c71ecec9e9cb8")
CIFAR10_DIR, CIFAR100_DIR = "cifar-10-batches-bin", "cifar-100-binary"
CIFAR10_FILES = {"train": [f"data_batch_{i}.bin" for i in range(1, 6)], "test": ["test_batch.bin"]}
CIFAR100_FILES = {"train": ["train.bin"], "test": ["test.bin"]}
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR100_FINE = (  # fine_label_names.txt of the binary archive
    "apple", "aquarium_fish", "baby", "bear", "beaver", "bed", "bee", "beetle", "bicycle", "bottle", "bowl", "boy",
    "bridge", "bus", "butterfly", "camel", "can", "castle", "caterpillar", "cattle", "chair", "chimpanzee", "clock",
    "cloud", "cockroach", "couch", "crab", "crocodile", "cup", "dinosaur", "dolphin", "elephant", "flatfish",
    "forest", "fox", "girl", "hamster", "house", "kangaroo", "keyboard", "lamp", "lawn_mower", "leopard", "lion",
    "lizard", "lobster", "man", "maple_tree", "motorcycle", "mountain", "mouse", "mushroom", "oak_tree", "orange",
    "orchid", "otter", "palm_tree", "pear", "pickup_truck", "pine_tree", "plain", "plate", "poppy", "porcupine",
    "possum", "rabbit", "raccoon", "ray", "road", "rocket", "rose", "sea", "seal", "shark", "shrew", "skunk",
    "skyscraper", "snail", "snake", "spider", "squirrel", "streetcar", "sunflower", "sweet_pepper", "table", "tank",
    "telephone", "television", "tiger", "tractor", "train", "trout", "tulip", "turtle", "wardrobe", "whale",
    "willow_tree", "wolf", "woman", "worm",
)
CIFAR100_COARSE = (  # coarse_label_names.txt of the binary archive
    "aquatic_mammals", "fish", "flowers", "food_containers", "fruit_and_vegetables", "household_electrical_devices",
    "household_furniture", "insects", "large_carnivores", "large_man-made_outdoor_things",
    "large_natural_outdoor_scenes", "large_omnivores_and_herbivores", "medium_mammals", "non-insect_invertebrates",
    "people", "reptiles", "small_mammals", "trees", "vehicles_1", "vehicles_2",
)


def parse_records(data: bytes, label_bytes: int, source: str) -> tuple[np.ndarray, np.ndarray]:
    """Records -> images ``[N, 3, 32, 32]`` and the label bytes ``[N, label_bytes]``."""
    record = label_bytes + 3072
    if not data or len(data) % record:
        raise DatasetError(f"{source}: {len(data)} bytes is not a whole number of {record}-byte CIFAR records; "
                           "replace it with the file from the official binary archive")
    rows = np.frombuffer(data, dtype=np.uint8).reshape(-1, record)
    return rows[:, label_bytes:].reshape(-1, 3, 32, 32).copy(), rows[:, :label_bytes].astype(np.int64)


def _members(folder: str, files: dict[str, list[str]]) -> list[str]:
    return [f"{folder}/{name}" for names in files.values() for name in names]


def _binary_source(root: Path, remote: Remote, folder: str, files: dict[str, list[str]]) -> Path | None:
    """The extracted batches folder or the official archive at ``root``, if any."""
    for candidate in (root / folder, root):
        if candidate.is_dir() and all(present(candidate / n) for ns in files.values() for n in ns):
            return candidate
    for candidate in (root, root / remote.name):
        if present(candidate) and candidate.name == remote.name:
            return candidate
    return None


def _incomplete(root: Path, folder: str, files: dict[str, list[str]]) -> str:
    """What an extracted batches folder at ``root`` lacks, if it holds some of the batch files (else "")."""
    return incomplete_folder([root / folder, root], [n for names in files.values() for n in names])


def read_binary(source: Path, folder: str, files: dict[str, list[str]],
                root: Path | None = None) -> dict[str, list[bytes]]:
    """The bytes of each batch file, from the extracted folder or streamed from the archive; they must
    stay inside ``root`` (default ``source``; see :mod:`hetfl.data.datasets.paths`)."""
    root = source if root is None else root
    if source.is_dir():
        return {split: [read_file(source / n, root) for n in names] for split, names in files.items()}
    wanted = set(_members(folder, files))
    found = {"/".join(parts[-2:]): data
             for parts, data in tree.walk(source, lambda p: "/".join(p[-2:]) in wanted, root=root)}
    missing = sorted(wanted - set(found))
    if missing:
        raise DatasetError(f"{source}: not the official archive ({', '.join(missing)} missing); replace it")
    return {split: [found[f"{folder}/{n}"] for n in names] for split, names in files.items()}


def check_binary(source: Path, files: dict[str, list[str]], root: Path) -> None:
    """The batch files of folder ``source`` (or archive ``source``) must stay inside ``root``; checked
    before the fingerprint follows any link (see :mod:`hetfl.data.datasets.paths`)."""
    for path in [source / n for ns in files.values() for n in ns] if source.is_dir() else [source]:
        guard(path, root)


def _decode_binary(source: Path, folder: str, files: dict[str, list[str]], label_bytes: int,
                   num_classes: int, root: Path) -> dict[str, np.ndarray]:
    arrays = {}
    for split, chunks in read_binary(source, folder, files, root).items():
        parts = [parse_records(c, label_bytes, f"{source} ({split} batch {i + 1})") for i, c in enumerate(chunks)]
        labels = np.concatenate([p[1] for p in parts])
        limits = (20, num_classes) if label_bytes == 2 else (num_classes,)  # CIFAR-100: 20 coarse, 100 fine
        if any(labels[:, i].max(initial=0) >= limit for i, limit in enumerate(limits)):
            raise DatasetError(f"{source}: {split} labels out of range (>= {limits}); corrupt file, replace it")
        arrays[f"{split}_x"] = np.concatenate([p[0] for p in parts])
        arrays[f"{split}_y"] = labels[:, -1].copy()  # CIFAR-10: the label; CIFAR-100: the fine label
        if label_bytes == 2:
            arrays[f"{split}_coarse"] = labels[:, 0].copy()
    return arrays


def _not_binary(path: Path) -> bool:
    return path.name in (CIFAR10.name, CIFAR100.name)


def load_cifar10(ctx: Context) -> Dataset:
    """CIFAR-10: 50,000 + 10,000 RGB 32x32 images of 10 classes (binary files or an image folder)."""
    source = _binary_source(ctx.root, CIFAR10, CIFAR10_DIR, CIFAR10_FILES)
    folder = None if source else imagefolder.find_source(ctx.root, needs_train=True, exclude=_not_binary)
    if folder is not None:
        check_source(folder, ctx.root)  # before the fingerprint follows any link
        key = {"dataset": "cifar10", "format": FORMAT, "layout": "folder", "source": fingerprint([folder])}

        def build_folder() -> dict[str, np.ndarray]:
            entries = imagefolder.read_images(folder, 3, (32, 32), root=ctx.root)
            arrays = imagefolder.split_arrays(entries, folder, (32, 32), classes=CIFAR10_CLASSES,
                                              test_split="test")
            del arrays["classes"]
            return arrays

        arrays = cached(ctx.cache_dir, key, build_folder)
        return image_dataset("cifar10", arrays, CIFAR10_CLASSES, CIFAR10_NORM,
                             notes=[f"cifar10 from the image folder {folder} (not the official binary files)"])
    if source is None:
        ensure(ctx.root, [CIFAR10], download=ctx.download, dataset="cifar10",
               alternative=f"(or its extracted {CIFAR10_DIR}/, or an image folder train/<class>/, test/<class>/)",
               incomplete=_incomplete(ctx.root, CIFAR10_DIR, CIFAR10_FILES))
        source = ctx.root / CIFAR10.name
    check_binary(source, CIFAR10_FILES, ctx.root)
    key = {"dataset": "cifar10", "format": FORMAT, "source": fingerprint([source])}
    arrays = cached(ctx.cache_dir, key, lambda: _decode_binary(source, CIFAR10_DIR, CIFAR10_FILES, 1, 10, ctx.root))
    return image_dataset("cifar10", arrays, CIFAR10_CLASSES, CIFAR10_NORM, notes=[f"cifar10 from {source}"])


def load_cifar100(ctx: Context, label_mode: str) -> Dataset:
    """CIFAR-100: 50,000 + 10,000 RGB 32x32 images, 100 fine or 20 coarse classes (``label_mode``)."""
    source = _binary_source(ctx.root, CIFAR100, CIFAR100_DIR, CIFAR100_FILES)
    if source is None:
        ensure(ctx.root, [CIFAR100], download=ctx.download, dataset="cifar100",
               alternative=f"(or its extracted {CIFAR100_DIR}/train.bin, test.bin)",
               incomplete=_incomplete(ctx.root, CIFAR100_DIR, CIFAR100_FILES))
        source = ctx.root / CIFAR100.name
    check_binary(source, CIFAR100_FILES, ctx.root)
    key = {"dataset": "cifar100", "format": FORMAT, "source": fingerprint([source])}
    arrays = dict(cached(ctx.cache_dir, key,
                         lambda: _decode_binary(source, CIFAR100_DIR, CIFAR100_FILES, 2, 100, ctx.root)))
    classes = CIFAR100_FINE
    if label_mode == "coarse":
        arrays["train_y"], arrays["test_y"], classes = arrays["train_coarse"], arrays["test_coarse"], CIFAR100_COARSE
    return image_dataset("cifar100", arrays, classes, CIFAR100_NORM,
                         notes=[f"cifar100 ({label_mode} labels) from {source}"])
