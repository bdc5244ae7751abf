"""Image bytes -> uint8 ``[C, H, W]`` arrays with Pillow (an optional dependency, ``hetfl[images]``)."""

from __future__ import annotations

import io
from types import ModuleType
from typing import Any

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


def _to_8_bits(img: Any, image_mod: ModuleType, source: str) -> Any:
    """``img`` with 8-bit values: a 16-bit image (mode ``I;16*``, as Pillow opens 16-bit grayscale PNG and
    TIFF) scaled by 255/65535, which Pillow's ``convert`` would clip at 255 (white above 255 of 65,535); a
    32-bit integer or float image (mode ``I`` / ``F``) kept when its values lie in 0..255, else refused: it has
    no known range to scale from. Other modes are returned as they are."""
    if img.mode.startswith("I;16"):
        values = np.asarray(img, dtype=np.float64)
        return image_mod.fromarray(np.round(values / 257.0).astype(np.uint8), mode="L")
    if img.mode in ("I", "F"):
        values = np.asarray(img, dtype=np.float64)
        low, high = (values.min(), values.max()) if values.size else (0.0, 0.0)
        if low < 0 or high > 255:
            raise DatasetError(f"{source}: a {'32-bit integer' if img.mode == 'I' else 'float'} image (mode "
                               f"{img.mode}) with values {low:g}..{high:g}; hetfl reads 8-bit and 16-bit images: "
                               "save it as an 8-bit (or 16-bit) image")
        return image_mod.fromarray(np.round(values).astype(np.uint8), mode="L")
    return img


def decode(data: bytes, source: str, channels: int, size: Size | None = None) -> np.ndarray:
    """Decode one image to ``channels`` (1 = grayscale, 3 = RGB), resized to ``size`` if given; values beyond
    8 bits are scaled or refused, never clipped (:func:`_to_8_bits`)."""
    image_mod = pillow()
    try:
        with image_mod.open(io.BytesIO(data)) as img:
            img = _to_8_bits(img, image_mod, source).convert("RGB" if channels == 3 else "L")
            if size is not None and img.size != (size[1], size[0]):
                img = img.resize((size[1], size[0]), image_mod.BILINEAR)
            arr = np.asarray(img, dtype=np.uint8)
    except DatasetError:  # already says what is wrong with the file (:func:`_to_8_bits`)
        raise
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
