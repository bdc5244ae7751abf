"""The vectorised step compiled by ``torch.compile`` (``runtime.compile``): fused kernels per step.

On a GPU, at the small batches of federated clients, a vectorised step's time is its number of
kernels times their latency: the elementwise ops around each layer, the pooling, the casts of
bfloat16 autocast and the layout copies that ``vmap``'s batching rules make are each a kernel
(benchmarks/results/step_ops_cpu.md). Inductor fuses them into a few generated kernels around
cuDNN's convolutions and cuBLAS's matrix products: ``benchmarks/conv_kernels.py`` measured cnn2's
encoder step 1.55x faster than plain ``vmap`` on an H100 (1.36x faster than hetfl's own batching
rules, and faster than one model's step on all the clients' samples together).

What is compiled is exactly the function the eager step runs: ``vmap`` over the clients of
:func:`hetfl.engine.local.step_gradients` (the loss, its gradient and transform). The SGD update
and the bookkeeping stay outside, as in the eager step, so a compiled step changes nothing but
floating-point rounding. hetfl's layers run their plain PyTorch forms here (not their batching
rules under :func:`hetfl.models.layers.client_batching`, whose ``autograd.Function`` s Dynamo
cannot trace): what those rules save (layout copies), Inductor fuses.

Compilation. One compile per step shape (clients at once and batch size: Dynamo specialises
``vmap``'s batch size), seconds each, paid in the first round that meets the shape and kept by
Dynamo for the process; Inductor's on-disk cache makes a later process's compiles quicker. Only
full batches are compiled (:meth:`hetfl.engine.vectorized.VectorizedGroup.compiles`): every
client's short last batch of an epoch is a size of its own, a step or two a round, and runs
uncompiled. The step reads the round's plain values (round, learning rate...) through
:class:`StepContext`, so Dynamo guards on (and recompiles for) only those the method reads. A
step that cannot be compiled (an op Dynamo cannot trace, no C++ compiler for Inductor on a CPU,
too many shapes) runs uncompiled, with the reason logged once. Before torch 2.5 Dynamo cannot trace the
step at all (:func:`unsupported`): the steps run uncompiled, saying so once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.func import vmap

from hetfl.algorithms.base import Batch, ClientContext, Stage, Tensors
from hetfl.engine.local import functional_grad, step_gradients

# step shapes Dynamo may compile the step for in a process (its default, 8, is a handful of shapes): a
# full federation meets 18-35 (CCVR's Table 2, the throughput benchmark), 1,000 sampled devices 259 in 300
# rounds (benchmarks/graph_shapes.py); beyond it the stage runs uncompiled, with the reason logged
RECOMPILE_LIMIT = 1024

#: the first torch release whose Dynamo traces the vmapped step: 2.4.1's stops at ``torch.func.functional_call``
#: ("Unsupported: call_function args: NNModuleVariable() ConstDictVariable() ..."); 2.5.1 compiles it
#: (checked on the development CPU with torch 2.4.1 and 2.5.1, tests/engine/test_compiled_step.py)
FIRST_TORCH = (2, 5)


def torch_release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string ("2.4.1+cu121" -> (2, 4); a nightly "2.5.0.dev20240801"
    is 2.5)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def unsupported(version: str | None = None) -> str:
    """Why this torch (or ``version``) cannot compile the vectorised step ("" where it can): ``runtime.compile``
    then runs the steps uncompiled, as it does a step Dynamo cannot trace."""
    version = str(torch.__version__) if version is None else version
    if torch_release(version) >= FIRST_TORCH:
        return ""
    return (f"runtime.compile needs torch >= {'.'.join(map(str, FIRST_TORCH))} (Dynamo before it cannot trace the "
            f"vmapped step's torch.func.functional_call); this is torch {version}: the steps run uncompiled")


#: a client context's plain values that differ between the clients of a vectorised group, which one step trains
#: at once: a step sees no client's own value of these (the sequential executor's step does)
PER_CLIENT_VALUES = ("client_id", "num_samples", "features", "inputs")


class PerClientValueRead(RuntimeError):
    """A vectorised step read one of :data:`PER_CLIENT_VALUES`. A RuntimeError, as vmap's own refusals (``.item()``,
    a random op): the vectorised executor runs the group's clients one at a time instead, saying why."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"a step read ctx.{name}, which differs between the clients that one vectorised step trains, so the "
            f"step cannot see its client's own value; the sequential executor's step can. To keep the clients "
            f"vectorised, read ctx.{name} in the method's begin() and hand the step a tensor in the extras it "
            f"returns (`{{\"my.size\": torch.tensor(float(ctx.num_samples))}}`, read as ctx.extras[\"my.size\"])")


def _per_client(name: str) -> property:
    """An attribute of :class:`StepContext` that no vectorised step may read (:class:`PerClientValueRead`)."""

    def refuse(self: StepContext) -> Any:
        raise PerClientValueRead(name)

    return property(refuse, doc=f"``{name}``: differs between the clients of a step (refused)")


def _from_base(name: str) -> property:
    """A read-only attribute of :class:`StepContext`: the template's value, read when the step reads it."""
    return property(lambda self: getattr(self.base, name), doc=f"the round's ``{name}`` (``base.{name}``)")


class StepContext(ClientContext):
    """The context a compiled step sees: one client's tensors (swapped in inside ``vmap``) and the
    round's plain values, read from ``base`` only when the step reads them, so that Dynamo guards on
    only those. A plain object that Dynamo traces (the eager step's
    :class:`hetfl.engine.vectorized.TemplateContext` records reads with a ``__getattribute__`` hook,
    which Dynamo cannot trace)."""

    client_id = _per_client("client_id")
    round = _from_base("round")
    num_samples = _per_client("num_samples")
    lr = _from_base("lr")
    features = _per_client("features")
    inputs = _per_client("inputs")
    shared = _from_base("shared")

    def __init__(self, base: ClientContext, payload: Tensors, state: Tensors, extras: Tensors) -> None:
        self.base = base
        self.payload, self.state, self.extras = payload, state, extras


def vmapped_step(stage: Stage, context: Callable[[Tensors, Tensors, Tensors], ClientContext], max_norm: float,
                 buffers: tuple[str, ...], precision: str, in_dims: tuple[Any, ...], state: Tensors, x: torch.Tensor,
                 y: torch.Tensor, draws: Tensors, payload: Tensors, cstate: Tensors,
                 extras: Tensors, low: Tensors) -> tuple[Tensors, Tensors, torch.Tensor, Tensors]:
    """:func:`~hetfl.engine.local.step_gradients` of ``stage`` for every client row, vmapped over the
    rows of the tensors (``in_dims``): the rows' gradients, model buffers, losses and metrics. Each
    row's context is ``context(payload, client state, extras)`` of its own tensors: the eager step's
    template (which records the round's values read), or, compiled, a :class:`StepContext`. ``low``: the
    rows' bfloat16 copies of their weights that a bf16 step reads (:mod:`hetfl.models.low_precision`;
    empty: autocast casts them, as a compiled step does, whose casts Inductor fuses)."""

    def one(state_c, x_c, y_c, draws_c, payload_c, cstate_c, extras_c, low_c):  # type: ignore[no-untyped-def]
        ctx = context(payload_c, cstate_c, extras_c)
        return step_gradients(stage, state_c, Batch(x_c, y_c, draws_c), ctx, max_norm, grad_fn=functional_grad,
                              buffers=buffers, precision=precision, low=low_c)

    return vmap(one, in_dims=(*in_dims, 0), randomness="error")(state, x, y, draws, payload, cstate, extras, low)


# torch.compile's backend: Inductor (generated fused kernels). The tests trace with "aot_eager" (Dynamo and
# AOTAutograd, no code generation: seconds less per shape on a CPU), and one test with Inductor.
BACKEND = "inductor"


@functools.cache
def compiled_vmapped_step(backend: str) -> Callable[..., Any]:
    """:func:`vmapped_step` under ``torch.compile`` (made once per backend: Dynamo keeps the compiled
    shapes on the function's code); ``fullgraph``: a step Dynamo would split is refused, not run in pieces."""
    return torch.compile(vmapped_step, backend=backend, fullgraph=True, dynamic=False)


def run_compiled(*args: Any) -> tuple[Tensors, Tensors, torch.Tensor, Tensors]:
    """:func:`compiled_vmapped_step` of ``args`` (those of :func:`vmapped_step`), compiling its
    shape on first use; raises what Dynamo or Inductor raise when it cannot be compiled."""
    import torch._dynamo  # imported on first use: it takes a while

    # the settings' names since torch 2.6 (cache_size_limit before): per function, and over all functions
    names = ("recompile_limit", "accumulated_recompile_limit") if hasattr(torch._dynamo.config, "recompile_limit") \
        else ("cache_size_limit", "accumulated_cache_size_limit")
    with torch._dynamo.config.patch(**dict.fromkeys(names, RECOMPILE_LIMIT)):
        return compiled_vmapped_step(BACKEND)(*args)
