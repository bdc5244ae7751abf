"""The torch CPU thread count of a run (``runtime.threads``).

A number > 0 is used as given. ``0`` (the default, "auto") fits the count to the work of one
training step on a CPU device: a step whose forward pass is small (logistic regression, the MLPs,
the small CNNs at the usual batch sizes) runs on **one** thread, anything larger on the process's
count before hetfl changed it (torch's default: one thread per core). A split operation waits for
every thread; on a machine whose cores are busy with other jobs a small step waits for a thread
that is not scheduled: the default Synthetic run took 71 s on torch's default count and 5 s on one thread on a
busy 2-core machine (issue 27), while on idle cores a second thread gains small steps little
(``benchmarks/results/threads.md`` has the measurements behind :data:`ONE_THREAD_BELOW_FLOPS`).
On a CUDA device a run gets the process's count too (the work is on the GPU).

The count is a function of the configuration, the model and the process's starting count only
(never of the machine's load or of an earlier run in the process), so a run and its resume use the
same count: torch's CPU reductions split by thread count, and a different count changes results in
the last bits.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hetfl.config import RunConfig
from hetfl.engine import resources

#: Forward-pass floating-point operations of one training step (per-sample forward FLOPs x batch size
#: x clients stepped at once) below which a CPU run uses one thread. Measured (benchmarks/threads.py,
#: benchmarks/results/threads.md): on 2 idle cores a second thread makes such steps at most 1.6x faster
#: (logistic regression not at all); on a busy 2-core machine one thread made them 2-8x faster. Larger
#: steps (VGG-11, ResNet-18: ~1e10) gain ~2x from a second idle core and keep torch's count.
ONE_THREAD_BELOW_FLOPS = 1e9
#: The process's count when hetfl's engine was first imported (torch's default: a thread per core, or
#: ``OMP_NUM_THREADS``, or what the program set before): the count ``auto`` gives a large step, also after
#: an earlier run in this process went down to one thread.
PROCESS_THREADS = torch.get_num_threads()


def layer_flops(module: nn.Module, output: torch.Tensor) -> int:
    """Floating-point operations (2 per multiply-add) of a linear or convolutional layer's forward pass
    that produced ``output``; 0 for any other layer (their cost is small beside these)."""
    if isinstance(module, nn.Linear):
        return 2 * output.numel() * module.in_features
    if isinstance(module, nn.modules.conv._ConvNd):
        return 2 * output.numel() * (module.in_channels // module.groups) * math.prod(module.kernel_size)
    return 0


def forward_flops(model: nn.Module, input_shape: tuple[int, ...]) -> int | None:
    """Floating-point operations of one sample's forward pass through ``model`` (on the CPU): its linear
    and convolutional layers, counted by forward hooks on a pass of zeros without gradients in eval mode
    (no running statistic moves, no random number is drawn; the model's mode is put back). A pass on the
    meta device would import torch's Python decompositions (about 2 s); this one costs a sample's forward
    pass. None where the pass fails."""
    counted: list[int] = []
    hooks = [m.register_forward_hook(lambda m, _, out: counted.append(layer_flops(m, out))) for m in model.modules()
             if isinstance(m, nn.Linear | nn.modules.conv._ConvNd)]
    training = model.training
    try:
        with torch.no_grad():
            model.eval()(torch.zeros((1, *input_shape)))
    except Exception:  # a model this pass does not fit: no estimate, no change
        return None
    finally:
        model.train(training)
        for hook in hooks:
            hook.remove()
    return sum(counted)


def step_flops(cfg: RunConfig, model: nn.Module, input_shape: tuple[int, ...], vmap: bool) -> int | None:
    """Forward FLOPs of one local step: a batch through the model, for every client stepped at once."""
    per_sample = forward_flops(model, input_shape)
    if per_sample is None:
        return None
    return per_sample * cfg.train.batch_size * resources.clients_at_once(cfg, vmap)


def auto_threads(cfg: RunConfig, device: torch.device, model: nn.Module, input_shape: tuple[int, ...],
                 vmap: bool) -> int:
    """The count ``runtime.threads = 0`` stands for: 1 for a small step on a CPU device; otherwise (a large
    step, an accelerator, a step that cannot be estimated) :data:`PROCESS_THREADS`, so that a run gets the
    same count whatever ran before it in this process (a sweep, a notebook)."""
    if device.type == "cpu":
        flops = step_flops(cfg, model, input_shape, vmap)
        if flops is not None and flops < ONE_THREAD_BELOW_FLOPS:
            return 1
    return PROCESS_THREADS


def fit_threads(cfg: RunConfig, device: torch.device, model: nn.Module, input_shape: tuple[int, ...],
                vmap: bool) -> int:
    """Set torch's (process-wide) CPU thread count for this run of ``model`` (built, still on the CPU):
    ``runtime.threads`` when > 0, else :func:`auto_threads`; return it."""
    count = cfg.runtime.threads or auto_threads(cfg, device, model, input_shape, vmap)
    if count != torch.get_num_threads():
        torch.set_num_threads(count)
    return count
