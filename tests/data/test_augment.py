"""Batched augmentation: crop/flip against a per-sample reference, reproducibility, rotation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap

from hetfl.data.augment import (
    apply_crop_flip,
    augment_params,
    crop_starts,
    gather_crops,
    pixel_grid,
    random_crop_flip,
    rotate,
    to_float,
)


def images(b: int = 6, c: int = 3, h: int = 8, w: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (b, c, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def reference_crop_flip(x, dx, dy, flips, padding):
    """torchvision semantics, one sample at a time: pad, crop at (dy, dx), then flip."""
    out = []
    h, w = x.shape[-2:]
    for i in range(x.shape[0]):
        p = F.pad(x[i], (padding,) * 4)
        crop = p[:, int(dy[i]) : int(dy[i]) + h, int(dx[i]) : int(dx[i]) + w]
        out.append(crop.flip(-1) if flips[i] else crop)
    return torch.stack(out)


def test_to_float() -> None:
    x = images()
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.5)
    y = to_float(x, mean, std)
    assert y.dtype == torch.float32 and y.device == x.device and y.shape == x.shape
    expected = (x.float() / 255 - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(to_float(x, None, None), x.float() / 255)
    assert x.dtype == torch.uint8  # input untouched


def test_augment_params_ranges() -> None:
    dx, dy, flips = augment_params(1000, 4, True, torch.Generator().manual_seed(0))
    assert dx.dtype == dy.dtype == torch.int64 and flips.dtype == torch.bool
    assert int(dx.min()) == 0 and int(dx.max()) == 8 and int(dy.min()) == 0 and int(dy.max()) == 8
    assert 0.4 < flips.float().mean() < 0.6
    _, _, none = augment_params(10, 4, False, torch.Generator().manual_seed(0))
    assert not none.any()


def test_identity_and_flip() -> None:
    x = images()
    assert torch.equal(random_crop_flip(x, 0, False, torch.Generator().manual_seed(0)), x)
    zeros = torch.zeros(6, dtype=torch.long)
    assert torch.equal(apply_crop_flip(x, zeros, zeros, torch.ones(6, dtype=torch.bool), 0), x.flip(-1))
    centre = torch.full((6,), 2, dtype=torch.long)  # offset = padding: the unpadded image
    assert torch.equal(apply_crop_flip(x, centre, centre, torch.zeros(6, dtype=torch.bool), 2), x)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_crop_flip_matches_per_sample_reference(dtype: torch.dtype) -> None:
    x = images(b=16).to(dtype)
    dx, dy, flips = augment_params(16, 3, True, torch.Generator().manual_seed(5))
    out = apply_crop_flip(x, dx, dy, flips, 3)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, reference_crop_flip(x, dx, dy, flips, 3))


def test_crop_starts_read_a_flipped_crop_right_to_left() -> None:
    dx, dy = torch.tensor([0, 3, 8]), torch.tensor([5, 0, 2])
    starts = crop_starts(dx, dy, torch.tensor([False, True, True]), 10)
    assert starts.dtype == torch.int64
    assert starts.tolist() == [[5, 0, 2], [0, 12, 17], [1, -1, -1]]  # first row, first column, column step


@pytest.mark.parametrize("lead", [(12,), (4, 3)])
def test_gather_crops_of_any_index_shape_match_the_per_sample_reference(lead: tuple[int, ...]) -> None:
    """A batch ``[*S]`` of dataset indices (a vectorised step's ``[samples, clients]``) is cropped and flipped
    in its gather from the padded dataset: the per-sample reference's values, laid out contiguously as
    ``[*S, C, H, W]`` (no copy into another layout follows)."""
    data = images(b=20, h=8, w=10, seed=3)
    padded = F.pad(data, (2, 2, 2, 2))
    idx = torch.randint(0, 20, lead, generator=torch.Generator().manual_seed(1))
    dx, dy, flips = augment_params(idx.numel(), 2, True, torch.Generator().manual_seed(2))
    starts = crop_starts(dx, dy, flips, 10).view(3, *lead)
    out = gather_crops(padded, idx, starts, pixel_grid(3, 8, 10, padded.device))
    assert out.shape == (*lead, 3, 8, 10) and out.is_contiguous()
    expected = reference_crop_flip(data[idx.reshape(-1)], dx, dy, flips, 2)
    assert torch.equal(out.reshape(-1, 3, 8, 10), expected)


def test_same_seed_same_output() -> None:
    x = images(b=32)
    a = random_crop_flip(x, 4, True, torch.Generator().manual_seed(7))
    b = random_crop_flip(x, 4, True, torch.Generator().manual_seed(7))
    c = random_crop_flip(x, 4, True, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    dx, dy, flips = augment_params(32, 4, True, torch.Generator().manual_seed(7))
    assert torch.equal(a, apply_crop_flip(x, dx, dy, flips, 4))  # the two halves compose to the whole


def test_apply_crop_flip_under_vmap() -> None:
    x = images(b=12).view(3, 4, 3, 8, 10)  # 3 clients x 4 samples
    dx, dy, flips = (t.view(3, 4) for t in augment_params(12, 2, True, torch.Generator().manual_seed(0)))
    out = vmap(apply_crop_flip, in_dims=(0, 0, 0, 0, None))(x, dx, dy, flips, 2)
    for k in range(3):
        assert torch.equal(out[k], apply_crop_flip(x[k], dx[k], dy[k], flips[k], 2))


def test_rotate() -> None:
    x = images(h=9, w=9)
    assert torch.equal(rotate(x, 0.0), x)
    r90 = rotate(x, 90.0)
    assert r90.dtype == torch.uint8
    # positive angle = counter-clockwise as displayed = torch.rot90(k=1) over (H, W)
    assert torch.equal(r90, torch.rot90(x, 1, dims=(-2, -1)))
    assert torch.equal(rotate(x, -90.0, mode="nearest"), torch.rot90(x, -1, dims=(-2, -1)))
    assert torch.equal(rotate(x, 180.0), torch.rot90(x, 2, dims=(-2, -1)))
    xf = x.float()
    torch.testing.assert_close(rotate(xf, 90.0), torch.rot90(xf, 1, dims=(-2, -1)), atol=1e-3, rtol=0)
    # per-sample angles, and a single [C, H, W] image
    angles = torch.tensor([0.0, 90.0, 180.0, 270.0, 0.0, 90.0])
    per = rotate(x, angles)
    for i, k in enumerate([0, 1, 2, 3, 0, 1]):
        assert torch.equal(per[i], torch.rot90(x[i], k, dims=(-2, -1)))
    assert torch.equal(rotate(x[0], 90.0), torch.rot90(x[0], 1, dims=(-2, -1)))


def test_rotate_zero_fill() -> None:
    x = torch.full((1, 1, 8, 8), 200, dtype=torch.uint8)
    r = rotate(x, 45.0)
    assert r.dtype == torch.uint8 and int(r[0, 0, 0, 0]) == 0 and int(r[0, 0, 4, 4]) == 200


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_independent() -> None:
    x = images(b=64, h=32, w=32)
    cpu = random_crop_flip(x, 4, True, torch.Generator().manual_seed(3))
    gpu = random_crop_flip(x.cuda(), 4, True, torch.Generator().manual_seed(3))
    assert gpu.device.type == "cuda" and torch.equal(gpu.cpu(), cpu)
    assert torch.equal(rotate(x.cuda(), 90.0).cpu(), torch.rot90(x, 1, dims=(-2, -1)))
    y = to_float(x.cuda(), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    assert y.device.type == "cuda"
    torch.testing.assert_close(y.cpu(), to_float(x, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)))
