"""Augmentation (:mod:`hetfl.data.augment`) beyond the square images and uint8 inputs of
``tests/data/test_augment.py``: rotation of non-square images in pixel units (RotatedMNIST's domains are
rotations; a swapped aspect factor would shear), integer inputs other than uint8, and the refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetfl.data.augment import apply_crop_flip, augment_params, rotate


def reference_rot90(x: torch.Tensor) -> torch.Tensor:
    """A quarter turn counter-clockwise as displayed about the image's centre, in pixel units, zero fill:
    output pixel at offset (a, b) from the centre ((h-1)/2, (w-1)/2) reads the input at offset (b, -a),
    as ``torch.rot90(x, 1)`` does for a square image (``out[i, j] = x[j, n - 1 - i]``)."""
    h, w = x.shape[-2:]
    out = torch.zeros_like(x)
    cy, cx = (h - 1) / 2, (w - 1) / 2
    for i in range(h):
        for j in range(w):
            a, b = i - cy, j - cx
            r, c = cy + b, cx - a
            if 0 <= r <= h - 1 and 0 <= c <= w - 1:
                out[..., i, j] = x[..., int(r), int(c)]
    return out


@pytest.mark.parametrize(("h", "w"), [(6, 10), (10, 6)])
def test_a_quarter_turn_of_a_non_square_image_is_in_pixel_units(h, w):
    x = torch.randint(1, 256, (2, 1, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    got = rotate(x, 90.0, mode="nearest")
    want = reference_rot90(x)
    assert torch.equal(got, want)
    assert int((want > 0).sum()) == 2 * min(h, w) ** 2  # the centred square survives, the rest is zero fill


def test_integer_images_other_than_uint8_keep_their_dtype_and_are_rounded():
    x = torch.randint(-300, 300, (3, 2, 7, 7), dtype=torch.int64, generator=torch.Generator().manual_seed(1))
    r = rotate(x, 90.0)
    assert r.dtype == torch.int64 and torch.equal(r, torch.rot90(x, 1, dims=(-2, -1)))
    half = rotate(x, 45.0)  # bilinear values rounded to the nearest integer, not truncated
    ref = rotate(x.double(), 45.0).round().long()
    assert half.dtype == torch.int64 and torch.equal(half, ref)


def test_refusals_name_the_parameter_and_what_is_allowed():
    with pytest.raises(ValueError, match=r"^padding = -1: must be >= 0$"):
        augment_params(4, -1, True, torch.Generator())
    with pytest.raises(ValueError, match=r"^mode = 'bicubic': allowed 'bilinear', 'nearest'$"):
        rotate(torch.zeros(1, 1, 4, 4), 10.0, mode="bicubic")
    dx, dy, _ = augment_params(50, 0, False, torch.Generator().manual_seed(0))
    assert not dx.any() and not dy.any()  # no padding: the crop is the image


def test_a_padding_of_one_pixel_crops_from_the_padded_image():
    """padding = 1 (the smallest real padding): offsets in [0, 2] of the zero-padded copy, as torchvision's
    RandomCrop(size, padding=1)."""
    x = torch.randint(1, 256, (3, 2, 5, 6), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    dx, dy, flips = torch.tensor([0, 2, 1]), torch.tensor([2, 0, 1]), torch.tensor([True, False, False])
    padded = F.pad(x, (1, 1, 1, 1))
    want = torch.stack([padded[i, :, int(dy[i]):int(dy[i]) + 5, int(dx[i]):int(dx[i]) + 6] for i in range(3)])
    want[0] = want[0].flip(-1)
    assert torch.equal(apply_crop_flip(x, dx, dy, flips, 1), want)


def test_flip_flags_are_bool_with_or_without_flipping():
    for flip in (True, False):
        *_, flips = augment_params(6, 2, flip, torch.Generator().manual_seed(0))
        assert flips.dtype == torch.bool and flips.shape == (6,)


def test_per_sample_angles_in_any_layout_of_one_per_image():
    x = torch.randint(0, 256, (4, 1, 7, 7), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    angles = torch.tensor([0.0, 90.0, 180.0, 270.0])
    assert torch.equal(rotate(x, angles.view(4, 1)), rotate(x, angles))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_float_images_keep_their_dtype(dtype):
    x = torch.rand(2, 3, 6, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64).to(dtype)
    r = rotate(x, 30.0)
    assert r.dtype == dtype
    torch.testing.assert_close(rotate(x, 90.0), torch.rot90(x, 1, dims=(-2, -1)), atol=1e-5, rtol=0)


def test_nearest_rotation_only_copies_pixels_and_differs_from_bilinear():
    x = torch.randint(1, 256, (2, 1, 9, 9), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    near, bil = rotate(x, 30.0, mode="nearest"), rotate(x, 30.0)
    for i in range(2):  # every output pixel is one of its image's pixels or the zero fill
        assert set(near[i].unique().tolist()) <= set(x[i].unique().tolist()) | {0}
    assert not torch.equal(near, bil)
