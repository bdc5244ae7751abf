"""Layers whose batching under ``torch.func.vmap`` keeps the memory layout it is given.

The vectorised executor runs a round's clients as ``vmap`` of one client's step. Under ``vmap`` a
convolution with per-client weights is one grouped convolution over ``[samples, clients x channels,
H, W]``: its output holds the clients next to the channels. PyTorch's batching rule for max-pooling
instead folds the clients into the samples (``[clients x samples, channels, H, W]``), which that
layout cannot give without a copy; the next convolution then needs the first layout back (another
copy), and the backward pass copies again at each step. In a convolutional network that is two full
copies of every pooled activation per step, forward and backward, on top of the arithmetic.

:class:`MaxPool2d` is ``nn.MaxPool2d`` with a batching rule that pools the tensor where it lies:
clients next to the channels are folded into the channels, since pooling treats every channel of
every sample alike. The values, indices and gradients are those of ``F.max_pool2d`` (the same kernels
on the same planes, bit for bit, batched or not); only the copies are gone
(``tests/models/test_layers.py`` counts them).

:class:`Linear` is ``nn.Linear`` whose batching rule, for per-client weights, is one batched matrix
product and an in-place bias add: PyTorch's generic rule for ``addmm`` also scales a copy of the bias
by ``beta = 1``, one more kernel per layer and step. Unbatched, it runs ``addmm`` and the derivative
formulas autograd uses for it, so its values and gradients are ``nn.Linear``'s bit for bit.

Both take these paths only inside :func:`client_batching` (the vectorised executor's vmapped step):
elsewhere they are PyTorch's modules as they are, without an ``autograd.Function``'s Python cost per
call (a sequential step on a GPU is bound by that host time).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_state = threading.local()


@contextlib.contextmanager
def client_batching() -> Iterator[None]:
    """Inside (in this thread): :class:`MaxPool2d` and :class:`Linear` use their batching rules, for a
    ``vmap`` over clients (module docstring)."""
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        yield
    finally:
        _state.depth = depth


def _client_batching() -> bool:
    return getattr(_state, "depth", 0) > 0


def _foldable(t: torch.Tensor, dim: int) -> bool:
    """Whether dims ``dim`` and ``dim + 1`` of ``t`` can be flattened into one as a view."""
    return t.stride(dim) == t.size(dim + 1) * t.stride(dim + 1) or t.size(dim) == 1


def _batch_dim_at(t: torch.Tensor, dim: int | None, at: int, size: int) -> torch.Tensor:
    """``t`` with its batch dim (``dim``; None: not batched, expanded) moved to ``at``."""
    if dim is None:
        return t.unsqueeze(at).expand(*t.shape[:at], size, *t.shape[at:])
    return t.movedim(dim, at)


class _MaxPool2d(torch.autograd.Function):
    """``aten.max_pool2d_with_indices`` with a layout-keeping batching rule (:meth:`vmap`)."""

    @staticmethod
    def forward(x: torch.Tensor, kernel: list[int], stride: list[int], padding: list[int],  # type: ignore[override]
                ceil_mode: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.aten.max_pool2d_with_indices(x, kernel, stride, padding, [1, 1], ceil_mode)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        x, kernel, stride, padding, ceil_mode = inputs
        ctx.save_for_backward(x, output[1])
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)  # no zeros made for the indices' (absent) gradient
        ctx.settings = (kernel, stride, padding, ceil_mode)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, _: Any) -> tuple:  # type: ignore[override]
        if grad_out is None:  # the pooled values were not used
            return None, None, None, None, None
        x, indices = ctx.saved_tensors
        return _MaxPool2dBackward.apply(grad_out, x, indices, *ctx.settings), None, None, None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: torch.Tensor, kernel: list[int], stride: list[int], padding: list[int],
             ceil_mode: bool) -> tuple:
        dim, size = in_dims[0], info.batch_size
        x1 = x.movedim(dim, 1)  # [samples, clients, channels, H, W]: the clients folded into the channels if
        if x.dim() == 5 and _foldable(x1, 1):  # memory holds them so (a vmapped convolution's output)
            out, indices = _MaxPool2d.apply(x1.flatten(1, 2), kernel, stride, padding, ceil_mode)
            return (out.unflatten(1, (size, -1)), indices.unflatten(1, (size, -1))), (1, 1)
        out, indices = _MaxPool2d.apply(x.movedim(dim, 0).flatten(0, 1), kernel, stride, padding, ceil_mode)
        return (out.unflatten(0, (size, -1)), indices.unflatten(0, (size, -1))), (0, 0)


class _MaxPool2dBackward(torch.autograd.Function):
    """The gradient of :class:`_MaxPool2d` (``aten.max_pool2d_with_indices_backward``), batched in the
    layout of the saved input; differentiable in the incoming gradient (a gather at the indices)."""

    @staticmethod
    def forward(grad_out: torch.Tensor, x: torch.Tensor, indices: torch.Tensor, kernel: list[int],  # type: ignore[override]
                stride: list[int], padding: list[int], ceil_mode: bool) -> torch.Tensor:
        return torch.ops.aten.max_pool2d_with_indices_backward(grad_out, x, kernel, stride, padding, [1, 1],
                                                               ceil_mode, indices)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[2])
        ctx.out_shape = inputs[0].shape

    @staticmethod
    def backward(ctx: Any, grad_grad: torch.Tensor) -> tuple:  # type: ignore[override]
        (indices,) = ctx.saved_tensors
        picked = grad_grad.flatten(-2).gather(-1, indices.flatten(-2)).view(ctx.out_shape)
        return picked, None, None, None, None, None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, grad_out: torch.Tensor, x: torch.Tensor, indices: torch.Tensor,
             kernel: list[int], stride: list[int], padding: list[int], ceil_mode: bool) -> tuple:
        size = info.batch_size
        grad_dim, x_dim, indices_dim = in_dims[:3]
        x1, indices1 = _batch_dim_at(x, x_dim, 1, size), _batch_dim_at(indices, indices_dim, 1, size)
        if x1.dim() == 5 and _foldable(x1, 1) and _foldable(indices1, 1):  # the forward's layout: into the channels
            grad1 = _batch_dim_at(grad_out, grad_dim, 1, size)
            if not _foldable(grad1, 1):
                grad1 = grad1.contiguous()  # the smaller tensor is copied, not the input and the indices
            out = _MaxPool2dBackward.apply(grad1.flatten(1, 2), x1.flatten(1, 2), indices1.flatten(1, 2), kernel,
                                           stride, padding, ceil_mode)
            return out.unflatten(1, (size, -1)), 1
        flat = [_batch_dim_at(t, d, 0, size).flatten(0, 1) for t, d in ((grad_out, grad_dim), (x, x_dim),
                                                                         (indices, indices_dim))]
        out = _MaxPool2dBackward.apply(*flat, kernel, stride, padding, ceil_mode)
        return out.unflatten(0, (size, -1)), 0


def _pair(v: int | tuple[int, ...]) -> list[int]:
    return [v, v] if isinstance(v, int) else list(v)


class MaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` (same arguments, same results) that keeps the layout of a vmapped input inside
    :func:`client_batching` (module docstring). Dilation and ``return_indices`` go to PyTorch's own
    pooling; so does evaluation without gradients, which needs no indices."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _client_batching() or self.return_indices or _pair(self.dilation) != [1, 1] \
                or not torch.is_grad_enabled():
            return super().forward(x)
        # nn.MaxPool2d sets stride = kernel_size where none was given
        return _MaxPool2d.apply(x, _pair(self.kernel_size), _pair(self.stride), _pair(self.padding),
                                self.ceil_mode)[0]


class _Linear(torch.autograd.Function):
    """``F.linear`` of a 2-D input with a bias (``aten.addmm``) with a lean batching rule (:meth:`vmap`)."""

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.addmm(bias, x, weight.t())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        x, weight, _ = inputs
        ctx.save_for_backward(x, weight)
        ctx.column_major = _column_major(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        """``addmm``'s derivative formulas (PyTorch's ``mm_mat1_backward``, ``mm_mat2_backward`` and the
        bias's sum): the same products in the same orientation, so the same bits; differentiable again."""
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:  # an input stored column-major gets its gradient in that order
            grad_x = weight.t().mm(grad.t()).t() if ctx.column_major else grad.mm(weight)
        if ctx.needs_input_grad[1]:
            grad_weight = grad.t().mm(x)
        if ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_x, grad_weight, grad_bias

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> tuple:
        x_dim, weight_dim, bias_dim = in_dims
        if weight_dim is None and bias_dim is None:  # one layer for every client: their samples as one batch
            return F.linear(x.movedim(x_dim, 0), weight, bias), 0
        size = info.batch_size
        x, weight, bias = (_batch_dim_at(t, d, 0, size) for t, d in ((x, x_dim), (weight, weight_dim),
                                                                     (bias, bias_dim)))
        return torch.bmm(x, weight.transpose(1, 2)).add_(bias.unsqueeze(1)), 0


def _column_major(x: torch.Tensor) -> bool:
    """Whether the matrix ``x`` is stored column by column (what ``mm_mat1_backward`` asks)."""
    try:
        return x.stride(0) == 1 and x.stride(1) == x.size(0)
    except RuntimeError:  # a tensor without strides (a batched one in some PyTorch versions): either order
        return False


class Linear(nn.Linear):
    """``nn.Linear`` (same arguments, same results) with a lean batching rule for per-client weights
    inside :func:`client_batching` (module docstring). Inputs other than a batch of vectors, and layers
    without a bias, go to ``F.linear``. Under autocast the inputs are cast as autocast casts them, then
    multiplied in that precision: what ``nn.Linear`` does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _client_batching() or self.bias is None or x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        device = x.device.type
        if not torch.is_autocast_enabled(device):
            return _Linear.apply(x, self.weight, self.bias)
        dtype = torch.get_autocast_dtype(device)  # what autocast makes of float32 and half tensors (not float64)
        return _Linear.apply(*(t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t
                               for t in (x, self.weight, self.bias)))
