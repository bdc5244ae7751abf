"""The model base class with the encoder / projector / classifier split.

Every hetfl model is an :class:`FLModel` (DESIGN.md, property 2): the
``encoder`` maps an input to a feature vector, the optional ``projector``
(MOON's projection head) maps it further, and the ``classifier`` is the final
``nn.Linear``. CCVR, FedUV, FedBR, FedPAC, MOON, Freeze/FedBABU and FedRep act
on this split by parameter name prefix (see :func:`param_groups`).

``forward`` is the only entry point of training code, which calls it through
``torch.func.functional_call`` (and ``torch.func.vmap`` over stacked client
parameters): it is a pure function of the parameters, buffers and input, with
no Python-side state and no data-dependent control flow.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from hetfl.models.layers import BatchNorm2d

PARTS = ("encoder", "projector", "classifier")


class ModelError(ValueError):
    """An unknown model, a bad model option or an input shape the model cannot take.

    The message names the parameter, the value and what is allowed, in the form
    ``key = value: allowed`` (like ``hetfl.params.ConfigError``).
    """

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key} = {value!r}: {allowed}")


class FLModel(nn.Module):
    """A classifier split into ``encoder`` -> optional ``projector`` -> ``classifier``.

    Attributes:
        encoder: everything up to the feature vector (ends flattened, ``[B, d_enc]``).
        projector: optional head between encoder and classifier (``None`` if absent).
        classifier: the final ``nn.Linear``; its input is :meth:`features`.
        feature_dim: size of the classifier input.
        num_classes: number of outputs.
    """

    encoder: nn.Module
    projector: nn.Module | None
    classifier: nn.Linear

    def __init__(self, encoder: nn.Module, classifier: nn.Linear, projector: nn.Module | None = None) -> None:
        super().__init__()
        self.encoder = encoder
        self.register_module("projector", projector)
        self.classifier = classifier
        self.feature_dim: int = classifier.in_features
        self.num_classes: int = classifier.out_features

    def features(self, x: Tensor) -> Tensor:
        """The classifier input ``[B, feature_dim]``: ``projector(encoder(x))``, or ``encoder(x)``."""
        z = self.encoder(x)
        if self.projector is not None:
            z = self.projector(z)
        return z.flatten(1)

    def forward(self, x: Tensor, return_features: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Logits ``[B, num_classes]``, or ``(features, logits)`` if ``return_features``."""
        z = self.features(x)
        logits = self.classifier(z)
        return (z, logits) if return_features else logits


def param_groups(model: nn.Module) -> dict[str, list[str]]:
    """Parameter names (as in ``named_parameters``) of ``"encoder"``, ``"projector"``, ``"classifier"``.

    The ``"projector"`` list is empty for models without one. Raises
    ``ValueError`` if a parameter belongs to none of the three parts.
    """
    groups: dict[str, list[str]] = {part: [] for part in PARTS}
    for name, _ in model.named_parameters():
        part = name.split(".", 1)[0]
        if part not in groups:
            raise ValueError(f"parameter {name!r} is outside encoder/projector/classifier")
        groups[part].append(name)
    return groups


def orthogonal_classifier_(model: FLModel, gain: float = 1.0, *, generator: torch.Generator | None = None) -> None:
    """Orthogonal initialisation of the classifier weight and a zero bias, in place.

    The fixed random head of Freeze / FedBABU (Oh et al., ICLR 2022; FedUV's
    "Freeze" baseline). ``generator`` makes it reproducible independently of
    the global RNG.
    """
    with torch.no_grad():
        nn.init.orthogonal_(model.classifier.weight, gain=gain, generator=generator)
        if model.classifier.bias is not None:
            model.classifier.bias.zero_()


# --------------------------------------------------------------- building blocks
NORMS = ("bn", "gn")


def make_norm(norm: str, channels: int, gn_groups: int) -> nn.Module:
    """``BatchNorm2d(channels)`` for ``"bn"``, ``GroupNorm(gn_groups, channels)`` for ``"gn"``."""
    if norm == "bn":
        return BatchNorm2d(channels)
    if channels % gn_groups:
        raise ModelError("model.options.gn_groups", gn_groups, f"must divide every layer's channels ({channels} here)")
    return nn.GroupNorm(gn_groups, channels)


def check_choice(key: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise ModelError(f"model.options.{key}", value, "allowed: " + ", ".join(repr(c) for c in choices))


def check_positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelError(f"model.options.{key}", value, "must be a positive integer")
    return value


def check_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ModelError(f"model.options.{key}", value, "must be true or false")
    return value


def image_shape(name: str, input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """``(C, H, W)`` of an image input, or a ModelError naming the model."""
    if len(input_shape) != 3 or any(int(s) < 1 for s in input_shape):
        allowed = f"{name} needs images (C, H, W); use mlp for feature vectors"
        raise ModelError("input_shape", tuple(input_shape), allowed)
    c, h, w = (int(s) for s in input_shape)
    return c, h, w


def conv_out(size: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    """Output length of a convolution / pooling along one spatial axis (floor mode)."""
    return (size + 2 * padding - kernel) // stride + 1
