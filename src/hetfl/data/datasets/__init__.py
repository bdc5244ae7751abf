"""Dataset registry: ``load_dataset(name, root, download=..., cache_dir=..., seed=..., **options)``.

Every loader returns a :class:`hetfl.data.base.Dataset` of tensors. Real
datasets are read in their official formats from ``root`` (a folder, or an
archive for the image-folder datasets; default ``~/.cache/hetfl/data/<name>``),
downloaded from the official source with checksum verification when missing
and allowed, and decoded once into a ``.npy`` cache in the user's cache
directory (``data.cache_dir``; default ``$XDG_CACHE_HOME/hetfl/datasets``, else
``~/.cache/hetfl/datasets``; never next to the data, which may be shared or
read-only). Every failure is a
:class:`~hetfl.data.base.DatasetError` that says what to fix.

Modules: ``idx`` (MNIST, Fashion-MNIST, EMNIST), ``cifar``, ``stl10``,
``cinic10``, ``tinyimagenet``, ``imagefolder`` (generic, PACS, Office-Home,
DomainNet), ``ham10000`` (images + metadata table, source domains),
``synthetic`` (FedProx); ``download``, ``cache``, ``tree`` (folders and archives
alike), ``decode`` (Pillow) and ``common`` serve them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from hetfl.data.base import Dataset, DatasetError
from hetfl.data.datasets.cache import resolve_cache_dir, user_cache_dir
from hetfl.data.datasets.cifar import load_cifar10, load_cifar100
from hetfl.data.datasets.cinic10 import load_cinic10
from hetfl.data.datasets.common import IMAGENET_NORM, Context
from hetfl.data.datasets.ham10000 import DEFAULT_SIZE as HAM10000_SIZE
from hetfl.data.datasets.ham10000 import SPLIT_BY as HAM10000_SPLIT_BY
from hetfl.data.datasets.ham10000 import load_ham10000
from hetfl.data.datasets.idx import EMNIST_CLASSES, load_emnist, load_fmnist, load_mnist
from hetfl.data.datasets.imagefolder import load_imagefolder
from hetfl.data.datasets.stl10 import load_stl10
from hetfl.data.datasets.synthetic import load_synthetic
from hetfl.data.datasets.tinyimagenet import load_tinyimagenet

__all__ = ["DATASETS", "Option", "check_run_splits", "checked_options", "dataset_options", "load_dataset"]


@dataclass(frozen=True)
class Option:
    """A loader option: default, validity check, and what is allowed (for error messages)."""

    default: Any
    check: Callable[[Any], bool]
    allowed: str
    convert: Callable[[Any], Any] = lambda v: v


def _int(default: int, low: int, allowed: str = "") -> Option:
    return Option(default, lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low,
                  allowed or f"an integer >= {low}")


def _float(default: float, low: float, high: float | None = None, high_open: bool = False) -> Option:
    def ok(v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < low:
            return False
        return high is None or (v < high if high_open else v <= high)

    bound = "" if high is None else f" and {'<' if high_open else '<='} {high}"
    return Option(default, ok, f"a number >= {low}{bound}, not inf or nan", float)


def _choice(default: Any, *values: Any) -> Option:
    return Option(default, lambda v: v in values and type(v) is type(default),
                  "one of " + ", ".join(repr(v) for v in values))


def _bool(default: bool) -> Option:
    return Option(default, lambda v: isinstance(v, bool), "true or false")


def _names() -> Option:
    return Option((), lambda v: isinstance(v, list | tuple) and all(isinstance(s, str) for s in v),
                  "a list of domain folder names ([] = all)", tuple)


_FOLDER = {
    "image_size": _int(0, 0, "an integer >= 0 (side in pixels; 0 = the first image's size)"),
    "channels": _choice(3, 1, 3),
    "domains": _names(),
    "test_fraction": _float(0.2, 0.0, 1.0, high_open=True),
    "follow_links": _bool(False),  # read symlinks that lead out of data.root (refused by default)
}


@dataclass(frozen=True)
class _Entry:
    load: Callable[..., Dataset]
    options: Mapping[str, Option]
    files: bool = True  # reads files (False: generated)
    doc: str = ""  # what the dataset is, where its loader's docstring does not say (hetfl list NAME)


def _domain_dataset(default_size: int, doc: str) -> _Entry:
    options = {**_FOLDER, "image_size": _int(default_size, 0, "an integer >= 0 (side in pixels; 0 = first image's)")}
    return _Entry(partial(load_imagefolder, layout="domain", norm=IMAGENET_NORM), options, doc=doc)


_REGISTRY: dict[str, _Entry] = {
    "synthetic": _Entry(load_synthetic, {
        "alpha": _float(1.0, 0.0), "beta": _float(1.0, 0.0), "num_devices": _int(30, 1), "dim": _int(60, 1),
        "num_classes": _int(10, 2), "iid": _bool(False), "test_fraction": _float(0.2, 0.0, 1.0, high_open=True),
        "max_samples": _int(5000, 0, "an integer >= 0 (per-device cap; 0 = none)"),
    }, files=False),
    "mnist": _Entry(load_mnist, {}),
    "fmnist": _Entry(load_fmnist, {}),
    "emnist": _Entry(load_emnist, {"split": _choice("balanced", *EMNIST_CLASSES)}),
    "cifar10": _Entry(load_cifar10, {}),
    "cifar100": _Entry(load_cifar100, {"label_mode": _choice("fine", "fine", "coarse")}),
    "stl10": _Entry(load_stl10, {"image_size": _int(0, 0, "an integer >= 0 (side in pixels; 0 = native 96)")}),
    "cinic10": _Entry(load_cinic10, {}),
    "tinyimagenet": _Entry(load_tinyimagenet, {
        "image_size": _int(0, 0, "an integer >= 0 (side in pixels; 0 = native 64)")}),
    "imagefolder": _Entry(load_imagefolder, {"layout": _choice("auto", "auto", "split", "domain"), **_FOLDER}),
    "pacs": _domain_dataset(96, "PACS (Li et al. 2017): 7 classes in 4 domains (photo, art painting, cartoon, "
                                "sketch), read from data.root as one folder per domain, one per class inside"),
    "officehome": _domain_dataset(96, "Office-Home (Venkateswara et al. 2017): 65 classes in 4 domains (Art, "
                                      "Clipart, Product, Real World), one folder per domain, one per class inside"),
    "domainnet": _domain_dataset(96, "DomainNet (Peng et al. 2019): 345 classes in 6 domains, one folder per "
                                     "domain, one per class inside (a subset of domains: the domains option)"),
    "ham10000": _Entry(load_ham10000, {
        "image_size": _int(HAM10000_SIZE, 0, f"an integer >= 0 (side in pixels; 0 = {HAM10000_SIZE})"),
        "test_fraction": _float(0.2, 0.0, 1.0, high_open=True),
        "split_by": _choice(HAM10000_SPLIT_BY[0], *HAM10000_SPLIT_BY),
        "domains": _names(),
    }),
}
DATASETS: tuple[str, ...] = tuple(_REGISTRY)


def describe_dataset(name: str) -> tuple[str, list[tuple[str, Any, str]]]:
    """What dataset ``name`` is (its loader's summary) and its ``data.options``: (option, default, allowed)."""
    entry = _REGISTRY[name]
    loader = entry.load.func if isinstance(entry.load, partial) else entry.load
    text = entry.doc or " ".join((loader.__doc__ or "").strip().split("\n\n")[0].split())
    return text, [(key, option.default, option.allowed) for key, option in entry.options.items()]


def dataset_options(name: str) -> dict[str, Any]:
    """The options of dataset ``name`` with their defaults."""
    if name not in _REGISTRY:
        raise DatasetError(f"data.dataset = {name!r} is unknown; allowed: {', '.join(DATASETS)}")
    return {key: option.default for key, option in _REGISTRY[name].options.items()}


def _resolve_options(name: str, entry: _Entry, options: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - set(entry.options))
    if unknown:
        allowed = f"its options are {', '.join(entry.options)}" if entry.options else "it takes no options"
        raise DatasetError(f"data.options.{unknown[0]} is not an option of {name}; {allowed}")
    resolved = {}
    for key, option in entry.options.items():
        value = options.get(key, option.default)
        if not option.check(value):
            raise DatasetError(f"data.options.{key} = {value!r} is not valid for {name}: expected {option.allowed}")
        resolved[key] = option.convert(value)
    return resolved


def checked_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Dataset ``name``'s ``options`` validated (DatasetError naming the bad one) with the defaults filled in:
    what :func:`load_dataset` will use, known before anything is read or generated."""
    if name not in _REGISTRY:
        raise DatasetError(f"data.dataset = {name!r} is unknown; allowed: {', '.join(DATASETS)}")
    return _resolve_options(name, _REGISTRY[name], options)


def default_root(name: str) -> Path:
    """Where ``name``'s files go when no root is given: ``~/.cache/hetfl/data/<name>``."""
    return user_cache_dir() / "data" / name


def load_dataset(
    name: str,
    root: str | os.PathLike | None = None,
    *,
    download: bool = True,
    cache_dir: str | os.PathLike | None = None,
    seed: int = 0,
    **options: Any,
) -> Dataset:
    """Load dataset ``name`` (one of :data:`DATASETS`).

    Args:
        root: folder with the dataset's files (or, for image-folder datasets,
            an archive of the tree); ``None``: ``~/.cache/hetfl/data/<name>``.
        download: fetch missing official files (checksum-verified).
        cache_dir: where decoded ``.npy`` arrays go (``data.cache_dir``); ``None`` or ``""``:
            ``$XDG_CACHE_HOME/hetfl/datasets``, else ``~/.cache/hetfl/datasets``. Entries are keyed
            by a fingerprint of the source files, so one folder serves every dataset and root.
        seed: randomness of generated data and of derived train/test splits.
        options: dataset-specific, see :func:`dataset_options`.
    """
    if name not in _REGISTRY:
        raise DatasetError(f"data.dataset = {name!r} is unknown; allowed: {', '.join(DATASETS)}")
    entry = _REGISTRY[name]
    resolved = _resolve_options(name, entry, options)
    cache = resolve_cache_dir(cache_dir)  # a bad data.cache_dir is refused for every dataset alike
    if not entry.files:
        return entry.load(Context(name, Path(), download, Path(), seed), **resolved)
    if root is None or str(root) == "":
        base = default_root(name)
        try:
            base.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise DatasetError(f"{name}: cannot create {base} ({err}); set data.root to a folder with the files"
                               ) from None
    else:
        base = Path(root).expanduser()
        if not base.exists():
            raise DatasetError(f"data.root = {str(root)!r} does not exist; create it (to download into it) or set "
                               f"data.root to the folder holding the {name} files")
    return entry.load(Context(name, base, download, cache, seed), **resolved)


def check_run_splits(name: str, options: Mapping[str, Any], dataset: Dataset) -> None:
    """A DatasetError when ``dataset`` (loaded as ``name`` with the user's ``options``) has an empty test or
    train split and ``data.options.test_fraction`` made it (0, or a fraction that rounds to nothing in each
    cell): a run of it would report NaN accuracies or train on nothing. Loading such a dataset is fine (a
    loader's tests do); a run checks it before anything is written."""
    if name not in _REGISTRY or "test_fraction" not in _REGISTRY[name].options:
        return
    options = _resolve_options(name, _REGISTRY[name], options)
    for split, what, fix in ((dataset.test, "test", "raise it"), (dataset.train, "training", "lower it")):
        if len(split.y) == 0:
            total = len(dataset.train.y) + len(dataset.test.y)
            raise DatasetError(f"data.options.test_fraction = {options['test_fraction']!r} leaves {name} no {what} "
                               f"samples (of {total}; the fraction is rounded per cell, or the files hold none); "
                               f"{fix} (allowed: > 0 and < 1, default 0.2)")
