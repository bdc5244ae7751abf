"""The in-memory dataset type every loader returns.

A dataset is two splits of tensors (uint8 images ``[N, C, H, W]`` or float32
feature vectors ``[N, d]``, with int64 labels ``[N]``) plus metadata. Nothing is
read from disk after loading: the engine moves the tensors to the training
device once and gathers batches by index (DESIGN.md, property 4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class DatasetError(ValueError):
    """A dataset cannot be loaded: missing or corrupt files, bad options.

    The message always says what is wrong and what to do about it (which files
    to put where, which option values are allowed).
    """


@dataclass(frozen=True)
class DatasetInfo:
    """Metadata of a dataset.

    Attributes:
        name: registry name (``mnist``, ``cifar10``, ``synthetic`` ...).
        classes: class names, index = label.
        input_shape: ``(C, H, W)`` for images, ``(d,)`` for feature vectors.
        mean, std: per-channel normalisation for images scaled to [0, 1];
            ``None`` for feature datasets (used as they are).
        groups: names of the dataset's natural groups (domains of PACS /
            Office-Home, devices of FedProx's synthetic data); ``()`` if none.
    """

    name: str
    classes: tuple[str, ...]
    input_shape: tuple[int, ...]
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    groups: tuple[str, ...] = ()

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def is_image(self) -> bool:
        return len(self.input_shape) == 3


@dataclass
class Split:
    """One split (train or test): inputs, labels and optional group ids."""

    x: torch.Tensor
    y: torch.Tensor
    group: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.y.dtype != torch.int64 or self.y.dim() != 1:
            raise DatasetError(f"labels must be a 1-D int64 tensor, got {self.y.dtype} {tuple(self.y.shape)}")
        if len(self.x) != len(self.y):
            raise DatasetError(f"inputs ({len(self.x)}) and labels ({len(self.y)}) differ in length")
        if self.x.dtype not in (torch.uint8, torch.float32):
            raise DatasetError(f"inputs must be uint8 images or float32 features, got {self.x.dtype}")
        if self.group is not None and len(self.group) != len(self.y):
            raise DatasetError("group ids and labels differ in length")

    def __len__(self) -> int:
        return len(self.y)


@dataclass
class Dataset:
    """A loaded dataset: metadata plus train and test splits."""

    info: DatasetInfo
    train: Split
    test: Split
    notes: list[str] = field(default_factory=list)
