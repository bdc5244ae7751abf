"""Image bytes -> uint8 ``[C, H, W]`` arrays with Pillow (an optional dependency, ``hetfl[images]``)."""

from __future__ import annotations

import io
from types import ModuleType

import numpy as np

from hetfl.data.base import DatasetError

Size = tuple[int, int]  # (height, width)


def pillow() -> ModuleType:
    """``PIL.Image``, or a :class:`DatasetError` saying how to install it."""
    try:
        from PIL import Image
    except ImportError:
        raise DatasetError("decoding image files needs Pillow: pip install pillow (or pip install 'hetfl[images]')"
                           ) from None
    return Image


def decode(data: bytes, source: str, channels: int, size: Size | None = None) -> np.ndarray:
    """Decode one image to ``channels`` (1 = grayscale, 3 = RGB), resized to ``size`` if given."""
    image_mod = pillow()
    try:
        with image_mod.open(io.BytesIO(data)) as img:
            img = img.convert("RGB" if channels == 3 else "L")
            if size is not None and img.size != (size[1], size[0]):
                img = img.resize((size[1], size[0]), image_mod.BILINEAR)
            arr = np.asarray(img, dtype=np.uint8)
    except (OSError, ValueError, SyntaxError) as err:  # PIL raises SyntaxError for some broken files
        raise DatasetError(f"{source}: cannot decode this image ({err}); delete or replace the file") from None
    return arr[None].copy() if arr.ndim == 2 else arr.transpose(2, 0, 1).copy()


def resize(image: np.ndarray, size: Size) -> np.ndarray:
    """Resize a uint8 ``[C, H, W]`` array to ``size`` (bilinear, antialiased as Pillow does)."""
    if image.shape[1:] == size:
        return image
    image_mod = pillow()
    channels = image.shape[0]
    pil = image_mod.fromarray(image[0] if channels == 1 else image.transpose(1, 2, 0))
    out = np.asarray(pil.resize((size[1], size[0]), image_mod.BILINEAR), dtype=np.uint8)
    return out[None].copy() if out.ndim == 2 else out.transpose(2, 0, 1).copy()


def stack(images: list[np.ndarray], size: Size | None) -> np.ndarray:
    """Stack ``[C, H, W]`` images into ``[N, C, H, W]``, resizing to ``size`` (default: the first image's)."""
    if not images:
        raise ValueError("no images to stack")
    target = size or (int(images[0].shape[1]), int(images[0].shape[2]))
    return np.stack([resize(img, target) for img in images])
