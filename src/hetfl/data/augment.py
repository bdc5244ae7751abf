"""Batched input preparation and augmentation on the training device.

DESIGN.md, property 4: no per-sample Python loops and no DataLoader workers.
A whole batch ``[B, C, H, W]`` is cropped and flipped by one gather with
per-sample offsets; the training loop's batches are cropped in their gather
from the once-padded dataset itself (:func:`gather_crops`: one kernel with two
small index computations, where padding, cropping, flipping and a layout copy
took twelve); rotations are one ``affine_grid`` + ``grid_sample``.

Random numbers are drawn on the CPU from an explicit ``torch.Generator`` and
then moved to the data's device, so a seed gives the same augmentation on CPU
and GPU. :func:`augment_params` and :func:`apply_crop_flip` are the two halves
of :func:`random_crop_flip`, so that an executor can draw the parameters
outside a ``torch.func.vmap``-ed step and apply them inside it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def to_float(x_uint8: Tensor, mean: Sequence[float] | None, std: Sequence[float] | None) -> Tensor:
    """uint8 images ``[..., C, H, W]`` -> float32 ``(x / 255 - mean) / std`` per channel, on ``x``'s device.

    ``mean`` / ``std`` ``None`` only scales to [0, 1].
    """
    x = x_uint8.to(torch.float32).div_(255.0)
    if mean is not None:
        x = x.sub_(torch.as_tensor(mean, dtype=torch.float32, device=x.device).view(-1, 1, 1))
    if std is not None:
        x = x.div_(torch.as_tensor(std, dtype=torch.float32, device=x.device).view(-1, 1, 1))
    return x


def augment_params(
    batch_size: int, padding: int, flip: bool, generator: torch.Generator | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample crop offsets and flip flags, drawn on the CPU from ``generator``.

    Returns ``(dx, dy, flips)``: int64 column and row offsets into the padded
    image, uniform in ``[0, 2 * padding]`` (as torchvision's
    ``RandomCrop(size, padding)``), and bool flags, each true with probability
    1/2 (all false if not ``flip``). Draw order: dx, dy, flips.
    """
    if padding < 0:
        raise ValueError(f"padding = {padding}: must be >= 0")
    dx = torch.randint(0, 2 * padding + 1, (batch_size,), generator=generator)
    dy = torch.randint(0, 2 * padding + 1, (batch_size,), generator=generator)
    no_flips = torch.zeros(batch_size, dtype=torch.bool)
    flips = torch.rand(batch_size, generator=generator) < 0.5 if flip else no_flips
    return dx, dy, flips


def crop_starts(dx: Tensor, dy: Tensor, flips: Tensor, width: int) -> Tensor:
    """Where each crop starts in the padded image and which way it is read: ``[3, *dx.shape]`` int64
    rows ``(first row, first column, column step)``, from the draws of :func:`augment_params`.

    A flipped crop reads its columns right to left: it starts at column ``dx + width - 1`` with step
    -1; an unflipped one at ``dx`` with step +1. In this form a batch's crops are one gather
    (:func:`gather_crops`) with no per-step branching."""
    flip = flips.long()
    return torch.stack([dy, dx + flip * (width - 1), 1 - 2 * flip])


def gather_crops(padded: Tensor, idx: Tensor, starts: Tensor, grid: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """The crops of images ``idx`` of ``padded`` (``[N, C, H + 2p, W + 2p]``, any dtype) at ``starts``
    (``[3, *idx.shape]`` from :func:`crop_starts`), as ``[*idx.shape, C, H, W]``: one advanced-indexing
    gather, whose indices are all adjacent so that the result is laid out channels-first as it is (no
    copy into another layout). ``grid`` holds ``arange(C)``, ``arange(H)`` and ``arange(W)`` on
    ``padded``'s device (a caller making many batches keeps them: three kernels fewer per batch).
    ``idx`` of any shape: a vectorised step gathers ``[samples, clients]`` at once."""
    channels, height, width = grid
    lead = idx.shape
    rows = (starts[0].unsqueeze(-1) + height).view(*lead, 1, -1, 1)
    cols = torch.addcmul(starts[1].unsqueeze(-1), starts[2].unsqueeze(-1), width).view(*lead, 1, 1, -1)
    return padded[idx.view(*lead, 1, 1, 1), channels.view(-1, 1, 1), rows, cols]


def pixel_grid(c: int, h: int, w: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """``arange(c)``, ``arange(h)``, ``arange(w)`` on ``device``: the ``grid`` of :func:`gather_crops`."""
    return tuple(torch.arange(n, device=device) for n in (c, h, w))  # type: ignore[return-value]


def apply_crop_flip(x: Tensor, dx: Tensor, dy: Tensor, flips: Tensor, padding: int) -> Tensor:
    """Crop each image of ``x`` ``[B, C, H, W]`` at ``(dy, dx)`` of its zero-padded copy, then flip where ``flips``.

    Equivalent to torchvision's ``RandomCrop(H, padding)`` followed by
    ``RandomHorizontalFlip`` with the given draws, for the whole batch in one
    gather (any dtype; ``dx``, ``dy``, ``flips`` of shape ``[B]`` on ``x``'s
    device). ``padding=0`` with zero offsets is a pure flip.
    """
    b, c, h, w = x.shape
    padded = F.pad(x, (padding, padding, padding, padding)) if padding > 0 else x
    idx = torch.arange(b, device=x.device)
    return gather_crops(padded, idx, crop_starts(dx, dy, flips, w), pixel_grid(c, h, w, x.device))


def random_crop_flip(x: Tensor, padding: int, flip: bool, generator: torch.Generator | None) -> Tensor:
    """Random crop with zero ``padding`` and random horizontal flip, per sample, batched.

    Draws from ``generator`` on the CPU (device-independent, reproducible), then
    applies :func:`apply_crop_flip` on ``x``'s device.
    """
    dx, dy, flips = augment_params(x.shape[0], padding, flip, generator)
    dev = x.device
    return apply_crop_flip(x, dx.to(dev), dy.to(dev), flips.to(dev), padding)


def rotate(x: Tensor, degrees: float | Tensor, mode: str = "bilinear") -> Tensor:
    """Rotate images ``[B, C, H, W]`` (or ``[C, H, W]``) about their centre, zero fill.

    Convention: a positive angle turns the image counter-clockwise as displayed
    (row 0 at the top), like ``torchvision.transforms.functional.rotate``; so
    ``rotate(x, 90)`` equals ``torch.rot90(x, 1, dims=(-2, -1))`` for square
    images. ``degrees`` is one angle or a tensor of ``B`` per-sample angles.
    Rotation is in pixel units (non-square images are not sheared). ``mode``
    is "bilinear" (default, as DomainBed's RotatedMNIST) or "nearest". uint8 input
    gives uint8 output (rounded), float input float output.
    """
    if mode not in ("bilinear", "nearest"):
        raise ValueError(f"mode = {mode!r}: allowed 'bilinear', 'nearest'")
    single = x.dim() == 3
    if single:
        x = x.unsqueeze(0)
    b, _, h, w = x.shape
    angle = torch.as_tensor(degrees, dtype=torch.float64).to(x.device) * (math.pi / 180.0)
    angle = angle.expand(b) if angle.dim() == 0 else angle.reshape(b)
    cos, sin = torch.cos(angle), torch.sin(angle)
    zero = torch.zeros_like(cos)
    # output (x, y) in normalised coords (y down) -> input coords: inverse of a counter-clockwise turn
    theta = torch.stack(
        [torch.stack([cos, -sin * (h / w), zero], 1), torch.stack([sin * (w / h), cos, zero], 1)], 1
    ).to(torch.float32)
    src = x.to(torch.float32) if not x.is_floating_point() else x
    grid = F.affine_grid(theta.to(src.dtype), [b, x.shape[1], h, w], align_corners=False)
    out = F.grid_sample(src, grid, mode=mode, padding_mode="zeros", align_corners=False)
    if x.dtype == torch.uint8:
        out = out.round_().clamp_(0, 255).to(torch.uint8)
    elif not x.is_floating_point():
        out = out.round_().to(x.dtype)
    return out.squeeze(0) if single else out
