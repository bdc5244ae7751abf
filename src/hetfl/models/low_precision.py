"""bfloat16 copies of the trained float32 weights: a bf16 step without a cast per layer.

Under bfloat16 autocast every convolution and linear layer casts its float32 weight and bias to
bfloat16 in the forward pass (one kernel each, at every use: hetfl's autocast keeps no cache, a
captured CUDA graph must not reuse casts made before it), and the backward pass casts each of their
bfloat16 gradients back to float32 (one kernel each): two kernels per tensor and step, 28 of the 31
casts of a vectorised step's 95 operations in CCVR's Table 2 shape, and a step at federated batch
sizes is bound by its number of kernels. With the copies the step has 5 casts and 69 operations
(float32: 64), cnn2's 50 instead of 64 (float32: 45) (``benchmarks/results/step_ops_cpu.md``).

Mixed precision with float32 master weights does the same arithmetic with two multi-tensor kernels:
the executor keeps a bfloat16 copy of the float32 weights that the convolutions and linear layers
read (:func:`low_precision_names`), refreshed by one ``torch._foreach_copy_`` after each SGD update,
which stays in float32 on the master weights. A model call (``hetfl.algorithms.base.ModelCaller``)
inside :func:`low_precision_weights` reads the copies through :class:`_CastDown`: a node that hands
the copies to the layers without a kernel, as autocast's cast would hand its result, and whose
backward casts that call's bfloat16 weight gradients up to float32 in one ``_foreach_copy_``
(:class:`_CastUp`) and gives them to the float32 masters, as autocast's cast's backward does one by
one. Everything else autocast does is unchanged: the input's and the logits' casts, float32 ops
(losses, norms, softmax) and any use of a master outside the model's layers (FedProx's proximal term
reads the float32 weight, as under autocast).

The values are autocast's to the bit: ``_foreach_copy_`` and ``_to_copy`` both round to nearest even,
the layers run the same kernels on the same bfloat16 tensors, and each model call's weight gradient
reaches its master in float32, summed there with the master's other uses, as autocast's per-use
casts are (``tests/engine/test_low_precision.py``). One assumption: a layer is called once per model
call (no module applied twice in a forward pass, which autocast would cast twice and whose two
gradients it would sum in float32, where the copy sums them in bfloat16): true of hetfl's models.

On CUDA, ``_foreach_copy_`` takes its multi-tensor path across dtypes where each list holds one dtype
and the two lists the same sizes and strides (PyTorch's ``foreach_tensor_copy_list_kernel_cuda_``):
true of the copies and masters (views of buffers of one layout) and of the gradients cast up (into
``empty_like`` tensors); otherwise it copies one tensor at a time, with the same values. The GPU's
kernel count is not measured yet (the CPU counts the dispatched operations).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hetfl.models.layers import Conv2d, Linear

_state = threading.local()

# the modules whose every parameter autocast casts to bfloat16 at each use (convolutions and linear layers
# are on its lower-precision list, which casts all their floating inputs) and that read them nowhere else:
# exact types, since a subclass may read its weight in a float32 op (a normalised classifier)
LAYERS: tuple[type[nn.Module], ...] = (nn.Linear, Linear, nn.Conv1d, nn.Conv2d, Conv2d, nn.Conv3d)


def low_precision_names(model: nn.Module) -> tuple[str, ...]:
    """The names of ``model``'s parameters (as ``named_parameters`` gives them) that its convolutions and
    linear layers read (:data:`LAYERS`), and no other module: those a bf16 step reads from its bfloat16 copy.
    A parameter shared with another module is left out (read in float32 there)."""
    owners: dict[int, list[nn.Module]] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
    return tuple(name for name, p in model.named_parameters()
                 if all(type(m) in LAYERS for m in owners[id(p)]) and len({id(m) for m in owners[id(p)]}) == 1)


def bf16_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """New bfloat16 tensors of ``tensors``' values (rounded to nearest even), in one multi-tensor copy."""
    copies = [torch.empty_like(t, dtype=torch.bfloat16) for t in tensors]
    if copies:
        torch._foreach_copy_(copies, tensors)
    return copies


def refresh_copies(low: dict[str, torch.Tensor], masters: dict[str, torch.Tensor], names: list[str]) -> None:
    """``low``'s copies of the masters ``names`` (those it holds) set to their values, in one multi-tensor
    copy: after an update of the masters."""
    held = [n for n in names if n in low]
    if held:
        torch._foreach_copy_([low[n] for n in held], [masters[n] for n in held])


@contextlib.contextmanager
def low_precision_weights(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """Inside (in this thread), a model call whose state holds, under one of ``pairs``' names, that pair's
    float32 master (the very tensor object) reads the pair's bfloat16 copy instead (:func:`substitute`)."""
    before = getattr(_state, "pairs", None)
    _state.pairs = pairs
    try:
        yield
    finally:
        _state.pairs = before


def substitute(own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``own`` (a model call's tensors by name) with each float32 master of :func:`low_precision_weights`
    replaced by its bfloat16 copy, through one :class:`_CastDown` node for this call; ``own`` as it is
    outside that context."""
    pairs = getattr(_state, "pairs", None)
    if not pairs:
        return own
    names = [n for n, (master, _) in pairs.items() if own.get(n) is master]
    if not names:
        return own
    lows = _CastDown.apply(len(names), *(pairs[n][0] for n in names), *(pairs[n][1] for n in names))
    return {**own, **dict(zip(names, lows, strict=True))}


class _CastDown(torch.autograd.Function):
    """Float32 masters to their bfloat16 copies (given: made by the executor), without a kernel; the
    backward casts the copies' gradients up in one multi-tensor copy (:class:`_CastUp`), as the backward
    of autocast's casts does one tensor at a time."""

    @staticmethod
    def forward(n: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(t.view_as(t) for t in tensors[n:])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.n = inputs[0]
        ctx.set_materialize_grads(False)  # no zeros for a copy the call did not use

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:  # type: ignore[override]
        used = [i for i, g in enumerate(grads) if g is not None]
        ups = _CastUp.apply(*(grads[i] for i in used)) if used else ()
        out: list[torch.Tensor | None] = [None] * ctx.n
        for i, g in zip(used, ups, strict=True):
            out[i] = g
        return (None, *out, *([None] * ctx.n))

    @staticmethod
    def vmap(info: Any, in_dims: tuple, n: int, *tensors: torch.Tensor) -> tuple:
        return _CastDown.apply(n, *tensors), tuple(in_dims[1 + n:])


class _CastUp(torch.autograd.Function):
    """bfloat16 gradients to float32 in one ``torch._foreach_copy_`` (under ``vmap``: on the batched
    tensors as they lie, one copy for all)."""

    @staticmethod
    def forward(*grads: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ups = [torch.empty_like(g, dtype=torch.float32) for g in grads]
        torch._foreach_copy_(ups, list(grads))
        return tuple(ups)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:  # type: ignore[override]
        return tuple(None if g is None else g.to(torch.bfloat16) for g in grads)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, *grads: torch.Tensor) -> tuple:
        return _CastUp.apply(*grads), tuple(in_dims)
