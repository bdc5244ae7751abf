"""Models built on the ``meta`` device: shapes only, nothing allocated, no random draws (milliseconds). The
engine's resource checks count parameters on them; the methods' model-part check finds the models that fit."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from hetfl.models import ModelError, build_model

__all__ = ["NoRandomInit", "meta_model"]


class NoRandomInit(TorchFunctionMode):
    """Skips in-place random fills while a model is built on the meta device: they have no values
    to fill there, and meta's ``normal_`` is a Python decomposition that imports TorchDynamo (~3 s)."""

    FILLS = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.random_, torch.Tensor.bernoulli_,
                       torch.Tensor.exponential_, torch.Tensor.log_normal_, torch.Tensor.cauchy_,
                       torch.Tensor.geometric_})

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in self.FILLS or getattr(func, "__module__", "") == "torch.nn.init":  # init functions return it
            return args[0] if args else (kwargs or {}).get("tensor")
        return func(*args, **(kwargs or {}))


def meta_model(name: str, input_shape: tuple[int, ...], num_classes: int, options: Mapping[str, Any]) -> Any:
    """Model ``name`` built on the ``meta`` device (shapes only: nothing allocated, no random draws),
    or None where it cannot be built there (a check that needs it then refuses nothing; the real build
    reports the problem). A ModelError for bad options propagates, as the real build would raise it."""
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"), NoRandomInit():
            return build_model(name, tuple(input_shape), num_classes, **dict(options))
    except ModelError:
        raise
    except Exception:
        return None
