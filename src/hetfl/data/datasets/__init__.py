"""Dataset registry: ``load_dataset(name, root, download=..., **options)``.

Every loader returns a :class:`hetfl.data.base.Dataset` of tensors. Real
datasets are read in their official formats from ``root`` (default
``~/.cache/hetfl/data/<name>``), downloaded from the official source with
checksum verification when missing and allowed, and decoded once into a
``.npy`` cache. Every failure is a :class:`DatasetError` naming what to fix.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetfl.data.base import Dataset, DatasetError, DatasetInfo, Split
from hetfl.data.datasets import cifar, idx, imagefolder, stl10, synthetic
from hetfl.data.datasets.cache import cached, default_cache_dir, fingerprint
from hetfl.data.datasets.download import Remote, ensure

CIFAR10_NORM = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
CINIC10 = Remote("CINIC-10.tar.gz", ("https://datashare.ed.ac.uk/bitstream/handle/10283/3192/CINIC-10.tar.gz",),
                 "6ee4d0c996905fe93221de577967a372")
TINYIMAGENET_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"


@dataclass(frozen=True)
class _Spec:
    options: dict[str, Any]
    load: Callable[..., Dataset]


def _default_root(name: str) -> Path:
    return Path(os.environ.get("HETFL_DATA", Path.home() / ".cache" / "hetfl" / "data")) / name


def _split(x: np.ndarray, y: np.ndarray, g: np.ndarray | None = None) -> Split:
    tensor_x = torch.from_numpy(np.ascontiguousarray(x))
    return Split(tensor_x, torch.from_numpy(y.astype(np.int64)), None if g is None else torch.from_numpy(g))


def _stats(x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 images scaled to [0, 1] (for folders without published values)."""
    sample = x[:: max(1, len(x) // 5000)].astype(np.float64) / 255.0
    return tuple(sample.mean(axis=(0, 2, 3)).round(4)), tuple(sample.std(axis=(0, 2, 3)).round(4))


def _images(name: str, arrays: dict[str, np.ndarray], classes: tuple[str, ...],
            norm: tuple[tuple[float, ...], tuple[float, ...]] | None, groups: tuple[str, ...] = ()) -> Dataset:
    mean, std = norm or _stats(arrays["train_x"])
    info = DatasetInfo(name, tuple(classes), tuple(arrays["train_x"].shape[1:]), mean, std, groups)
    return Dataset(info, _split(arrays["train_x"], arrays["train_y"], arrays.get("train_g")),
                   _split(arrays["test_x"], arrays["test_y"], arrays.get("test_g")))


# ------------------------------------------------------------------- loaders
def _load_synthetic(root, download, cache_dir, seed, alpha, beta, num_devices, dim, num_classes, iid,
                    test_fraction, max_samples) -> Dataset:
    for key, value, ok in (("alpha", alpha, alpha >= 0), ("beta", beta, beta >= 0),
                           ("num_devices", num_devices, num_devices >= 1), ("dim", dim, dim >= 1),
                           ("num_classes", num_classes, num_classes >= 2),
                           ("test_fraction", test_fraction, 0 <= test_fraction < 1)):
        if not ok:
            raise DatasetError(f"data.options.{key} = {value!r}: out of range for synthetic")
    x, y, g = synthetic.generate_synthetic(alpha, beta, num_devices, dim, num_classes, iid, seed, max_samples)
    train, test = synthetic.split_by_group(g, test_fraction, seed)
    info = DatasetInfo("synthetic", tuple(str(c) for c in range(num_classes)), (dim,),
                       groups=tuple(f"device{k}" for k in range(num_devices)))
    return Dataset(info, _split(x[train], y[train], g[train]), _split(x[test], y[test], g[test]),
                   notes=[f"Synthetic(alpha={alpha}, beta={beta}){' IID' if iid else ''}, {num_devices} devices"])


def _mnist_like(name: str, mirrors: tuple[str, ...], md5: dict[str, str], classes: tuple[str, ...],
                norm: tuple[tuple[float, ...], tuple[float, ...]]) -> Callable[..., Dataset]:
    def load(root: Path, download: bool, cache_dir: Path, seed: int) -> Dataset:
        idx.fetch_mnist_like(root, download, name, mirrors, md5)
        files = [p for n in md5 if (p := idx._locate(root, n)) is not None]

        def build() -> dict[str, np.ndarray]:
            tx, ty = idx.load_idx_pair(root, "train", len(classes))
            vx, vy = idx.load_idx_pair(root, "t10k", len(classes))
            return {"train_x": tx, "train_y": ty, "test_x": vx, "test_y": vy}

        arrays = cached(cache_dir, {"dataset": name, "source": fingerprint(files)}, build)
        return _images(name, arrays, classes, norm)

    return load


def _load_emnist(root, download, cache_dir, seed, split) -> Dataset:
    if split not in idx.EMNIST_CLASSES:
        raise DatasetError(f"data.options.split = {split!r}: allowed: {', '.join(idx.EMNIST_CLASSES)}")
    sources = sorted(root.glob("**/emnist-*")) + sorted(root.glob("gzip.zip"))
    key = {"dataset": "emnist", "split": split, "source": fingerprint(sources) if sources else "none"}
    arrays = cached(cache_dir, key, lambda: idx.load_emnist(root, split, download)) if sources else \
        idx.load_emnist(root, split, download)
    return _images("emnist", arrays, idx.emnist_classes(split), ((0.1751,), (0.3332,)))


def _folder_root(root: Path) -> Path | None:
    """``root`` itself if it is an image tree or archive of one, or the single archive inside it."""
    if imagefolder.is_archive(root) or (root / "train").is_dir():
        return root
    archives = [p for p in root.glob("*") if imagefolder.is_archive(p) and "binary" not in p.name] \
        if root.is_dir() else []
    return archives[0] if len(archives) == 1 else None


def _load_cifar10(root, download, cache_dir, seed) -> Dataset:
    folder = _folder_root(root)
    if folder is not None and not (root / cifar.CIFAR10.name).exists():
        key = {"dataset": "cifar10", "layout": "folder", "source": fingerprint([folder])}
        arrays = cached(cache_dir, key, lambda: imagefolder.load_split_folder(
            folder, 32, 3, classes=cifar.CIFAR10_CLASSES)[0])
        return _images("cifar10", arrays, cifar.CIFAR10_CLASSES, CIFAR10_NORM)
    extracted = all((root / m).exists() for ms in cifar.CIFAR10_FILES.values() for m in ms)
    files = [root / m for ms in cifar.CIFAR10_FILES.values() for m in ms] if extracted else \
        ensure(root, [cifar.CIFAR10], download, "cifar10")
    key = {"dataset": "cifar10", "source": fingerprint(files)}
    arrays = cached(cache_dir, key, lambda: cifar.load_cifar(root, "10"))
    return _images("cifar10", arrays, cifar.CIFAR10_CLASSES, CIFAR10_NORM)


def _load_cifar100(root, download, cache_dir, seed, label_mode) -> Dataset:
    if label_mode not in ("fine", "coarse"):
        raise DatasetError(f"data.options.label_mode = {label_mode!r}: allowed: fine, coarse")
    extracted = all((root / m).exists() for ms in cifar.CIFAR100_FILES.values() for m in ms)
    files = [root / m for ms in cifar.CIFAR100_FILES.values() for m in ms] if extracted else \
        ensure(root, [cifar.CIFAR100], download, "cifar100")
    key = {"dataset": "cifar100", "label_mode": label_mode, "source": fingerprint(files)}
    arrays = cached(cache_dir, key, lambda: cifar.load_cifar(root, "100", label_mode))
    classes = tuple(str(i) for i in range(100 if label_mode == "fine" else 20))
    return _images("cifar100", arrays, classes, ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)))


def _load_stl10(root, download, cache_dir, seed, image_size) -> Dataset:
    have = all((root / "stl10_binary" / n).exists() or (root / n).exists() for n in stl10.STL10_FILES)
    files = [root] if have else ensure(root, [stl10.STL10], download, "stl10")
    key = {"dataset": "stl10", "image_size": image_size, "source": fingerprint(files)}

    def build() -> dict[str, np.ndarray]:
        arrays = stl10.load_stl10(root)
        if image_size and image_size != 96:
            for split in ("train", "test"):
                x = torch.from_numpy(arrays[f"{split}_x"]).float()
                x = torch.nn.functional.interpolate(x, size=(image_size, image_size), mode="area")
                arrays[f"{split}_x"] = x.round().clamp(0, 255).to(torch.uint8).numpy()
        return arrays

    arrays = cached(cache_dir, key, build)
    return _images("stl10", arrays, stl10.STL10_CLASSES, ((0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713)))


def _load_cinic10(root, download, cache_dir, seed) -> Dataset:
    folder = _folder_root(root)
    if folder is None:
        ensure(root, [CINIC10], download, "cinic10")
        folder = root / CINIC10.name
    key = {"dataset": "cinic10", "source": fingerprint([folder])}
    arrays = cached(cache_dir, key,
                    lambda: imagefolder.load_split_folder(folder, 32, 3, classes=cifar.CIFAR10_CLASSES)[0])
    return _images("cinic10", arrays, cifar.CIFAR10_CLASSES, ((0.4789, 0.4723, 0.4305), (0.2421, 0.2383, 0.2587)))


def _load_tinyimagenet(root, download, cache_dir, seed, image_size) -> Dataset:
    base = root / "tiny-imagenet-200" if (root / "tiny-imagenet-200").is_dir() else root
    if not (base / "wnids.txt").exists():
        raise DatasetError(f"tinyimagenet: no wnids.txt under {root}; download {TINYIMAGENET_URL} "
                           "(MD5 90528d7ca1a48142e341f4ef8d21d0de), extract it there and set data.root")
    key = {"dataset": "tinyimagenet", "image_size": image_size, "source": fingerprint([base / "wnids.txt"])}
    box: dict[str, tuple[str, ...]] = {}

    def build() -> dict[str, np.ndarray]:
        arrays, wnids = imagefolder.load_tinyimagenet(root, image_size or None)
        box["classes"] = wnids
        return arrays

    arrays = cached(cache_dir, key, build)
    classes = box.get("classes") or tuple((base / "wnids.txt").read_text().split())
    return _images("tinyimagenet", arrays, classes, ((0.4802, 0.4481, 0.3975), (0.2770, 0.2691, 0.2821)))


def _folder_loader(name: str) -> Callable[..., Dataset]:
    def load(root, download, cache_dir, seed, layout, domains, image_size, channels, test_fraction) -> Dataset:
        if layout not in ("auto", "split", "domain"):
            raise DatasetError(f"data.options.layout = {layout!r}: allowed: auto, split, domain")
        if channels not in (1, 3):
            raise DatasetError(f"data.options.channels = {channels!r}: allowed: 1, 3")
        if not (root.exists()):
            raise DatasetError(f"{name}: {root} does not exist; set data.root to the folder with "
                               "<split or domain>/<class>/<image> files")
        folder = _folder_root(root) or root
        if layout == "auto":
            layout = "split" if {"train", "test"} <= imagefolder.top_folders(folder) else "domain"
        key = {"dataset": name, "layout": layout, "domains": list(domains), "image_size": image_size,
               "channels": channels, "test_fraction": test_fraction, "seed": seed if layout == "domain" else 0,
               "source": fingerprint([folder])}
        meta: dict[str, tuple[str, ...]] = {}

        def build() -> dict[str, np.ndarray]:
            if layout == "split":
                arrays, classes = imagefolder.load_split_folder(folder, image_size or None, channels)
                doms: tuple[str, ...] = ()
            else:
                arrays, classes, doms = imagefolder.load_domain_folder(
                    folder, image_size or None, channels, tuple(domains) or None, test_fraction, seed)
            arrays["classes"] = np.asarray(classes)
            arrays["domains"] = np.asarray(doms, dtype=str)
            return arrays

        arrays = cached(cache_dir, key, build)
        classes = tuple(str(c) for c in arrays.pop("classes"))
        meta["domains"] = tuple(str(d) for d in arrays.pop("domains"))
        return _images(name, arrays, classes, None, meta["domains"])

    return load


_FOLDER_OPTIONS = {"layout": "auto", "domains": [], "image_size": 0, "channels": 3, "test_fraction": 0.2}
_SPECS: dict[str, _Spec] = {
    "synthetic": _Spec({"alpha": 1.0, "beta": 1.0, "num_devices": 30, "dim": 60, "num_classes": 10, "iid": False,
                        "test_fraction": 0.2, "max_samples": 0}, _load_synthetic),
    "mnist": _Spec({}, _mnist_like("mnist", idx.MNIST_MIRRORS, idx.MNIST_MD5, idx.MNIST_CLASSES,
                                   ((0.1307,), (0.3081,)))),
    "fmnist": _Spec({}, _mnist_like("fmnist", idx.FMNIST_MIRRORS, idx.FMNIST_MD5, idx.FMNIST_CLASSES,
                                    ((0.2860,), (0.3530,)))),
    "emnist": _Spec({"split": "balanced"}, _load_emnist),
    "cifar10": _Spec({}, _load_cifar10),
    "cifar100": _Spec({"label_mode": "fine"}, _load_cifar100),
    "stl10": _Spec({"image_size": 0}, _load_stl10),
    "cinic10": _Spec({}, _load_cinic10),
    "tinyimagenet": _Spec({"image_size": 0}, _load_tinyimagenet),
    "imagefolder": _Spec(dict(_FOLDER_OPTIONS), _folder_loader("imagefolder")),
    "pacs": _Spec({**_FOLDER_OPTIONS, "layout": "domain", "image_size": 96}, _folder_loader("pacs")),
    "officehome": _Spec({**_FOLDER_OPTIONS, "layout": "domain", "image_size": 96}, _folder_loader("officehome")),
    "domainnet": _Spec({**_FOLDER_OPTIONS, "layout": "domain", "image_size": 96}, _folder_loader("domainnet")),
}
DATASETS: tuple[str, ...] = tuple(_SPECS)


def load_dataset(
    name: str,
    root: str | os.PathLike | None = None,
    *,
    download: bool = True,
    cache_dir: str | os.PathLike | None = None,
    seed: int = 0,
    **options: Any,
) -> Dataset:
    """Load dataset ``name`` (see :data:`DATASETS`) with loader ``options``."""
    if name not in _SPECS:
        raise DatasetError(f"data.dataset = {name!r}: allowed: {', '.join(DATASETS)}")
    spec = _SPECS[name]
    for key, value in options.items():
        if key not in spec.options:
            allowed = ", ".join(spec.options) or "none"
            raise DatasetError(f"data.options.{key} = {value!r}: not an option of {name}; options: {allowed}")
        default = spec.options[key]
        if isinstance(default, bool) != isinstance(value, bool) or (
                not isinstance(value, type(default)) and not (isinstance(default, float) and isinstance(value, int))):
            raise DatasetError(f"data.options.{key} = {value!r}: must be a {type(default).__name__} like {default!r}")
    kwargs = {**spec.options, **options}
    if name == "synthetic":
        return spec.load(None, download, None, seed, **kwargs)
    base = Path(root).expanduser() if root else _default_root(name)
    if root and not base.exists():
        raise DatasetError(f"data.root = {str(root)!r}: no such file or directory")
    if not root:
        base.mkdir(parents=True, exist_ok=True)
    cache = Path(cache_dir) if cache_dir else default_cache_dir(base if base.is_dir() else base.parent)
    return spec.load(base, download, cache, seed, **kwargs)
