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

:class:`Linear` is ``nn.Linear`` computed as a matrix product and then a bias add: for per-client
weights under ``vmap``, one batched product and one add, where PyTorch's generic rule for ``addmm``
also scales a copy of the bias by ``beta = 1`` (one more kernel per layer and step). No
``autograd.Function`` is needed: the two ops' own batching rules and derivatives give those kernels,
and in float32 ``nn.Linear``'s values and gradients bit for bit. Under autocast the product is rounded
to its precision before the bias is added, where ``addmm`` rounds once. Until session 18 this was a
custom rule (``_Linear``: the same kernels and bits, and 18% more host time per vmapped step of
simple_cnn at batch 2 on a CPU, none measurable at batch 64, since functorch rebuilds an
``autograd.Function`` at each call under ``grad``; ``benchmarks/results/layer_forms_cpu.md``).

Both take these paths only inside :func:`client_batching` (the vectorised executor's vmapped step):
elsewhere they are PyTorch's modules as they are (:class:`MaxPool2d` without an
``autograd.Function``'s Python cost per call: a sequential step on a GPU is bound by that host time).
That cost is larger under ``vmap`` and ``grad``: functorch runs each ``autograd.Function`` through Python
(a new single-level Function class per call and level, the arguments bound by signature, pytrees of
inputs and outputs), forward and backward. In a vmapped step of simple_cnn at batch 2 its two poolings
tripled the step's Python calls (4,881 -> 17,619; ``benchmarks/results/step_host_time_cpu.md``, session
27). So the vectorised executor keeps the layout rule only where a step is recorded once and replayed
(a CUDA graph's capture, and the ``static`` mode that stands for it), and its eager steps, which pay
their host time at every step, pool with PyTorch's own rule (``client_batching(pool_layout=False)``:
the copies instead, the same values and gradients bit for bit).

:class:`Conv2d` is ``nn.Conv2d`` with a choice of how per-client weights are batched
(``client_batching(conv=...)``, the config key ``runtime.conv_batching``): ``"grouped"`` is PyTorch's own
rule (one grouped convolution, ``groups = clients``); ``"per_client"`` runs one ordinary convolution per
client, forward and backward, on client-major activations ``[clients, samples, C, H, W]`` (each client's
slice contiguous), then stacks the results. Grouped convolutions are known to run far below the speed of
ordinary ones in cuDNN (pytorch/pytorch#70954, #73764; functorch#365), and a CUDA graph makes the extra
launches of a loop cheap; which is faster on a given device is measured by ``benchmarks/throughput.py``
and ``benchmarks/conv_kernels.py``. ``"per_client"`` runs the very kernels of a sequential step on the
same shapes, so each convolution's values and gradients are a sequential step's bit for bit (the rest of
a vmapped step, its batched products and reductions, still rounds in its own order).

:class:`BatchNorm1d` and :class:`BatchNorm2d` are PyTorch's, except that inside :func:`client_batching` on a
CPU a bfloat16 input with float32 statistics is normalised in float32 (:class:`_VmappableNorm`): PyTorch's
batching rule refuses that mix on the CPU, and every BatchNorm model's bf16 step fell back to sequential
clients.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_state = threading.local()


#: how :class:`Conv2d` batches per-client weights inside :func:`client_batching` (module docstring)
CONV_BATCHING = ("grouped", "per_client")


@contextlib.contextmanager
def client_batching(conv: str = "grouped", pool_layout: bool = True) -> Iterator[None]:
    """Inside (in this thread): :class:`MaxPool2d` (with ``pool_layout``) and :class:`Linear` use their
    batching rules, for a ``vmap`` over clients, and :class:`Conv2d` batches per-client weights as ``conv``
    says (one of :data:`CONV_BATCHING`; module docstring). ``pool_layout = False``: :class:`MaxPool2d` is
    PyTorch's own, for a step whose host time counts at every step (module docstring)."""
    if conv not in CONV_BATCHING:
        raise ValueError(f"conv = {conv!r}: must be one of {CONV_BATCHING}")
    depth = getattr(_state, "depth", 0)
    before = getattr(_state, "conv", "grouped"), getattr(_state, "pool_layout", True)
    _state.depth, _state.conv, _state.pool_layout = depth + 1, conv, pool_layout
    try:
        yield
    finally:
        _state.depth, (_state.conv, _state.pool_layout) = depth, before


def _client_batching() -> bool:
    return getattr(_state, "depth", 0) > 0


def _pool_layout() -> bool:
    return _client_batching() and _state.pool_layout


def _per_client_convolutions() -> bool:
    return _client_batching() and _state.conv == "per_client"


def _autocast(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``tensors`` as autocast casts a lower-precision op's inputs (float32 and half to its dtype; float64
    and non-floats left alone), cast outside an ``autograd.Function`` so that their gradients are cast
    back; unchanged where autocast is off."""
    device = next(t for t in tensors if t is not None).device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
                 for t in tensors)


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
    :func:`client_batching` with ``pool_layout`` (module docstring). Dilation and ``return_indices`` go to
    PyTorch's own pooling; so does evaluation without gradients, which needs no indices."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _pool_layout() or self.return_indices or _pair(self.dilation) != [1, 1] \
                or not torch.is_grad_enabled():
            return super().forward(x)
        # nn.MaxPool2d sets stride = kernel_size where none was given
        return _MaxPool2d.apply(x, _pair(self.kernel_size), _pair(self.stride), _pair(self.padding),
                                self.ceil_mode)[0]


class Linear(nn.Linear):
    """``nn.Linear`` (same arguments, same results) that, inside :func:`client_batching`, multiplies and
    then adds its bias (module docstring): under ``vmap`` with per-client weights, one batched product and
    one add, where PyTorch's rule for ``addmm`` also scales a copy of the bias. Inputs other than a batch
    of vectors, and layers without a bias, go to ``F.linear``. Under autocast the bias is taken to the
    product's precision, as ``nn.Linear``'s ``addmm`` takes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _client_batching() or self.bias is None or x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        product = F.linear(x, self.weight)
        return product + self.bias.to(product.dtype)


class _Conv2d(torch.autograd.Function):
    """``F.conv2d`` (zero padding given as numbers) whose batching rule runs one ordinary convolution per
    client (:meth:`vmap`); its gradient is :class:`_Conv2dBackward`, batched the same way."""

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # type: ignore[override]
                settings: tuple[list[int], list[int], list[int], int]) -> torch.Tensor:
        stride, padding, dilation, groups = settings
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        x, weight, bias, settings = inputs
        ctx.save_for_backward(x, weight)
        ctx.settings, ctx.has_bias = settings, bias is not None

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        mask = (needs[0], needs[1], ctx.has_bias and needs[2])
        grad_x, grad_weight, grad_bias = _Conv2dBackward.apply(grad, x, weight, ctx.settings, mask)
        return grad_x, grad_weight, grad_bias, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             settings: tuple) -> tuple:
        x_dim, weight_dim, bias_dim = in_dims[:3]
        size = info.batch_size
        if weight_dim is None and bias_dim is None:  # one layer for every client: their samples as one batch
            out = _Conv2d.apply(x.movedim(x_dim, 0).flatten(0, 1), weight, bias, settings)
            return out.unflatten(0, (size, -1)), 0
        xs, weights = _batch_dim_at(x, x_dim, 0, size), _batch_dim_at(weight, weight_dim, 0, size)
        biases = None if bias is None else _batch_dim_at(bias, bias_dim, 0, size)
        return torch.stack([_Conv2d.apply(xs[c], weights[c], None if biases is None else biases[c], settings)
                            for c in range(size)]), 0


class _Conv2dBackward(torch.autograd.Function):
    """The gradients of :class:`_Conv2d` (``aten.convolution_backward``: input, weight and bias, as
    ``mask`` asks; None for the others), one ordinary call per client under ``vmap``; differentiable
    again (``aten._convolution_double_backward``, batched by PyTorch's rule)."""

    @staticmethod
    def forward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                settings: tuple[list[int], list[int], list[int], int], mask: tuple[bool, bool, bool]) -> tuple:
        stride, padding, dilation, groups = settings
        return tuple(torch.ops.aten.convolution_backward(
            grad, x, weight, [weight.shape[0]] if mask[2] else None, stride, padding, dilation, False, [0, 0],
            groups, list(mask)))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        grad, x, weight, settings, _ = inputs
        ctx.save_for_backward(grad, x, weight)
        ctx.settings = settings
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, grad_grad_x: torch.Tensor | None, grad_grad_weight: torch.Tensor | None,  # type: ignore[override]
                 grad_grad_bias: torch.Tensor | None) -> tuple:
        grad, x, weight = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.settings
        needs = ctx.needs_input_grad
        if not any(needs[:3]) or (grad_grad_x is None and grad_grad_weight is None and grad_grad_bias is None):
            return None, None, None, None, None
        # PyTorch's formula for convolution_backward's own derivative (derivatives.yaml): the gradients of
        # (grad, input, weight)
        of_grad, of_x, of_weight = torch.ops.aten._convolution_double_backward(
            grad_grad_x, grad_grad_weight, grad_grad_bias, grad, weight, x, stride, padding, dilation, False,
            [0, 0], groups, list(needs[:3]))
        return of_grad, of_x, of_weight, None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, settings: tuple,
             mask: tuple[bool, bool, bool]) -> tuple:
        size = info.batch_size
        grad_dim, x_dim, weight_dim = in_dims[:3]
        if weight_dim is None and not mask[1] and not mask[2]:  # a shared layer's input gradient: one call
            flat = [_batch_dim_at(t, d, 0, size).flatten(0, 1) for t, d in ((grad, grad_dim), (x, x_dim))]
            grad_x = _Conv2dBackward.apply(*flat, weight, settings, mask)[0]
            return (grad_x.unflatten(0, (size, -1)), None, None), (0, None, None)
        grads, xs, weights = (_batch_dim_at(t, d, 0, size) for t, d in ((grad, grad_dim), (x, x_dim),
                                                                       (weight, weight_dim)))
        per_client = [_Conv2dBackward.apply(grads[c], xs[c], weights[c], settings, mask) for c in range(size)]
        outs = tuple(torch.stack([p[i] for p in per_client]) if mask[i] else None for i in range(3))
        return outs, tuple(0 if mask[i] else None for i in range(3))


class Conv2d(nn.Conv2d):
    """``nn.Conv2d`` (same arguments, same results) whose per-client weights, inside
    ``client_batching(conv="per_client")``, are batched as one ordinary convolution per client (module
    docstring). Elsewhere, and for padding given by name or not zeros, or inputs other than a batch of
    images, it is PyTorch's module as it is. Under autocast the inputs are cast as autocast casts them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _per_client_convolutions() or x.dim() != 4 or isinstance(self.padding, str) \
                or self.padding_mode != "zeros":
            return super().forward(x)
        settings = (list(self.stride), list(self.padding), list(self.dilation), self.groups)
        x, weight, bias = _autocast(x, self.weight, self.bias)
        return _Conv2d.apply(x, weight, bias, settings)


class _VmappableNorm(nn.modules.batchnorm._BatchNorm):
    """A batch norm whose bfloat16 input, inside :func:`client_batching` on a CPU, is normalised in float32.

    Under bfloat16 autocast a batch norm gets the bfloat16 output of a convolution and keeps float32
    statistics and affine weights (autocast casts neither): PyTorch's kernels take that mix and compute in
    float32. Under ``vmap`` with per-client running statistics, PyTorch's batching rule calls the CPU kernel
    without the weight (applied after it), and that kernel then reads the float32 statistics as bfloat16 and
    refuses them ("expected scalar type BFloat16 but found Float", torch 2.13; training and eval mode,
    1d and 2d), so every BatchNorm model fell back to sequential clients in a bf16 vmapped step. Here the
    input is cast to the statistics' dtype and the output back: the mixed kernel's arithmetic (float32
    inside, the output rounded to bfloat16 once), to the rounding of its sums
    (``tests/engine/test_precision.py``). CUDA's kernel chooses its arithmetic by the statistics' dtype
    (``batch_norm_cuda_out``), so CUDA steps are left as they are (not yet run on a GPU: that test's CUDA case
    checks it), as are steps outside ``vmap``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stats = self.running_mean if self.running_mean is not None else self.weight
        if _client_batching() and x.device.type == "cpu" and stats is not None and x.dtype != stats.dtype \
                and x.is_floating_point():
            return super().forward(x.to(stats.dtype)).to(x.dtype)
        return super().forward(x)


class BatchNorm1d(_VmappableNorm, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` (same arguments, results and state) that vmaps in bf16 on a CPU (:class:`_VmappableNorm`)."""


class BatchNorm2d(_VmappableNorm, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` (same arguments, results and state) that vmaps in bf16 on a CPU (:class:`_VmappableNorm`)."""


class InferenceBatchNorm(nn.Module):
    """A BatchNorm layer in eval mode written as elementwise ops: ``(x - running_mean) / sqrt(running_var +
    eps) * weight + bias`` over dimension 1. The values of ``F.batch_norm(training=False)`` to float32
    rounding; unlike it, batched by ``vmap`` without a per-client loop (PyTorch has no batching rule for
    ``_native_batch_norm_legit_no_training``). Holds the tensors of the layer it stands for, by the same
    names, so that a state dict of the model calls it (:func:`inference_copy`)."""

    def __init__(self, norm: nn.modules.batchnorm._BatchNorm) -> None:
        super().__init__()
        self.eps = norm.eps
        self.weight = norm.weight
        self.bias = norm.bias
        self.register_buffer("running_mean", norm.running_mean)
        self.register_buffer("running_var", norm.running_var)
        self.register_buffer("num_batches_tracked", norm.num_batches_tracked)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        out = (x - self.running_mean.view(shape)) * torch.rsqrt(self.running_var.view(shape) + self.eps)
        if self.weight is not None:
            out = out * self.weight.view(shape)
        if self.bias is not None:
            out = out + self.bias.view(shape)
        return out


#: layers whose forward pass depends on the module's mode (train: batch statistics, dropout; eval: neither)
MODE_DEPENDENT = (nn.modules.batchnorm._NormBase, nn.modules.dropout._DropoutNd)


def inference_copy(model: nn.Module) -> nn.Module:
    """``model`` in eval mode, for calls with an explicit state (``functional_call``): ``model`` itself where
    no layer depends on the mode, else a copy on the meta device (every call hands it all its tensors, so it
    holds none of its own) in eval mode, its BatchNorm layers with running statistics made
    :class:`InferenceBatchNorm`."""
    if not any(isinstance(m, MODE_DEPENDENT) for m in model.modules()):
        return model
    twin = copy.deepcopy(model).to("meta").eval()
    for name, module in list(twin.named_modules()):
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            parent, _, child = name.rpartition(".")
            setattr(twin.get_submodule(parent) if parent else twin, child, InferenceBatchNorm(module).eval())
    return twin
