"""The local objectives' cross-entropy (:func:`hetfl.algorithms.base.cross_entropy`): F.cross_entropy's
gradient to the last bit, in far fewer operations under ``vmap``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

from hetfl.algorithms.base import cross_entropy
from tests.helpers.ops import OpCounter


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 7, 64, 333])
def test_same_gradient_as_torch_to_the_last_bit_and_the_same_value(dtype, n):
    gen = torch.Generator().manual_seed(n)
    for _ in range(5):
        logits = (3 * torch.randn(n, 10, generator=gen)).to(dtype)
        labels = torch.randint(0, 10, (n,), generator=gen)
        want = grad(F.cross_entropy)(logits, labels)
        got = grad(cross_entropy)(logits, labels)
        assert torch.equal(got, want)
        torch.testing.assert_close(cross_entropy(logits, labels), F.cross_entropy(logits, labels))


def test_under_bf16_autocast_it_is_computed_in_float32_like_torchs():
    logits, labels = torch.randn(16, 10).bfloat16(), torch.randint(0, 10, (16,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = cross_entropy(logits, labels), F.cross_entropy(logits, labels)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want)


def test_vmapped_gradient_needs_half_the_operations_of_torchs():
    """What the vectorised executor runs per step: F.cross_entropy's batching rule masks ignore_index
    (26 operations, most of them tiny kernels); this one runs 10."""
    logits, labels = torch.randn(4, 64, 10), torch.randint(0, 10, (4, 64))
    counts = {}
    for name, fn in (("torch", F.cross_entropy), ("hetfl", cross_entropy)):
        counter = OpCounter()
        with counter:
            vmap(grad(fn))(logits, labels)
        counts[name] = counter.kernels()
    assert counts["hetfl"] <= 10 < 2 * counts["hetfl"] <= counts["torch"], counts


def test_under_plain_autograd_it_is_torchs_fused_loss_with_its_gradient():
    """A client's step under plain autograd (the sequential executor's; the vectorised executor's step
    of one client alone) runs F.cross_entropy itself: 5 operations forward and backward instead of 10,
    the same gradient to the last bit and the same value."""
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(64, 10, generator=gen)).requires_grad_()
    labels = torch.randint(0, 10, (64,), generator=gen)
    counts, grads, values = {}, {}, {}
    for name, fn in (("torch", F.cross_entropy), ("hetfl", cross_entropy)):
        counter = OpCounter()
        with counter:
            values[name] = fn(logits, labels)
            (grads[name],) = torch.autograd.grad(values[name], logits)
        counts[name] = counter.kernels()
    assert torch.equal(values["hetfl"], values["torch"]) and torch.equal(grads["hetfl"], grads["torch"])
    assert counts["hetfl"] == counts["torch"] <= 5, counts
    with OpCounter() as counter:
        torch.autograd.grad(-logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).mean(), logits)
    assert counter.kernels() >= 2 * counts["hetfl"], counter.kernels()  # the transforms' form, unbatched
