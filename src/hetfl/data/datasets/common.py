"""What every loader shares: the call context and numpy arrays -> :class:`Dataset`.

Loaders decode files into plain numpy arrays (so they can be cached as
``.npy``) and turn them into tensors only at the end, here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hetfl.data.base import Dataset, DatasetError, DatasetInfo, Split

Norm = tuple[tuple[float, ...], tuple[float, ...]]

# Published per-channel mean/std of images scaled to [0, 1].
MNIST_NORM: Norm = ((0.1307,), (0.3081,))
FMNIST_NORM: Norm = ((0.2860,), (0.3530,))
EMNIST_NORM: Norm = ((0.1751,), (0.3332,))  # EMNIST balanced
CIFAR10_NORM: Norm = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
CIFAR100_NORM: Norm = ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
STL10_NORM: Norm = ((0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713))
CINIC10_NORM: Norm = ((0.4789, 0.4723, 0.4305), (0.2421, 0.2383, 0.2587))  # CINIC-10 README
TINYIMAGENET_NORM: Norm = ((0.4802, 0.4481, 0.3975), (0.2770, 0.2691, 0.2821))
IMAGENET_NORM: Norm = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # PACS, Office-Home, DomainNet


@dataclass(frozen=True)
class Context:
    """Where a loader reads (``root``: folder or archive), caches, and whether it may download."""

    name: str
    root: Path
    download: bool
    cache_dir: Path
    seed: int


def choose_domains(domains: Sequence[str], available: Sequence[str], source: object) -> tuple[str, ...]:
    """The domains ``data.options.domains`` asks for, in that order (all of ``available`` when empty);
    a DatasetError naming the option, the missing ones, ``source`` and what is available otherwise."""
    missing = [d for d in domains if d not in available]
    if missing:
        raise DatasetError(f"data.options.domains = {list(domains)}: {missing} not in {source}; "
                           f"available: {list(available)}")
    return tuple(domains) or tuple(available)


def split(x: np.ndarray, y: np.ndarray, group: np.ndarray | None = None) -> Split:
    """numpy arrays -> a :class:`Split` (no copy when already contiguous and writable)."""

    def tensor(a: np.ndarray, dtype: type | None = None) -> torch.Tensor:
        return torch.from_numpy(np.require(a, dtype=dtype, requirements=["C", "W"]))

    return Split(tensor(x), tensor(y, np.int64), None if group is None else tensor(group, np.int64))


def channel_stats(x: np.ndarray) -> Norm:
    """Per-channel mean/std of uint8 ``[N, C, H, W]`` images scaled to [0, 1], from <= ~5000 images.

    For image folders without published constants.
    """
    sample = x[:: max(1, len(x) // 5000)].astype(np.float64) / 255.0
    mean = tuple(round(float(v), 4) for v in sample.mean(axis=(0, 2, 3)))
    std = tuple(round(float(max(v, 1e-3)), 4) for v in sample.std(axis=(0, 2, 3)))
    return mean, std


def image_dataset(
    name: str,
    arrays: dict[str, np.ndarray],
    classes: Sequence[str],
    norm: Norm | None,
    groups: Sequence[str] = (),
    notes: Sequence[str] = (),
) -> Dataset:
    """Arrays ``{train,test}_{x,y}`` (and optional ``{train,test}_g``) -> an image :class:`Dataset`.

    ``norm`` ``None`` computes the constants from the training images.
    """
    mean, std = norm or channel_stats(arrays["train_x"])
    info = DatasetInfo(name, tuple(classes), tuple(int(s) for s in arrays["train_x"].shape[1:]), mean, std,
                       tuple(groups))
    return Dataset(
        info,
        split(arrays["train_x"], arrays["train_y"], arrays.get("train_g")),
        split(arrays["test_x"], arrays["test_y"], arrays.get("test_g")),
        notes=list(notes),
    )
