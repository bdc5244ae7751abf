"""Random image datasets that stand in for a real one (``monkeypatch.setattr(experiment_mod, "load_dataset",
random_images(...))``): a run's whole procedure on images without MNIST's 10,000 test images to evaluate."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hetfl.data.base import Dataset, DatasetInfo, Split


def random_images(n_train: int, n_test: int, side: int, classes: int) -> Callable[..., Dataset]:
    """A ``load_dataset`` stand-in: ``n_train`` + ``n_test`` uniform random 1 x side x side uint8 images, labels
    cycling through ``classes``, the same for every call with one seed."""

    def load(name: str, root: str | None = None, *, download: bool = True, seed: int = 0, **options: Any) -> Dataset:
        gen = torch.Generator().manual_seed(seed)

        def split(n: int) -> Split:
            x = torch.randint(0, 256, (n, 1, side, side), dtype=torch.uint8, generator=gen)
            return Split(x, torch.arange(n) % classes)

        info = DatasetInfo("mnist", tuple(str(c) for c in range(classes)), (1, side, side), (0.5,), (0.5,))
        return Dataset(info, split(n_train), split(n_test))

    return load
