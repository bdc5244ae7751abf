"""Model registry: every model is an :class:`FLModel` with ``encoder`` / ``projector`` / ``classifier``.

``build_model(name, input_shape, num_classes, **options)`` builds one; an unknown
name, an unknown or bad option, or an input shape the model cannot take raises
:class:`ModelError` (a ``ValueError`` whose message names the parameter, the
value and what is allowed). ``model_options(name)`` lists a model's options with
their defaults.

Models (options with defaults; feature_dim = classifier input size):

* ``simple_cnn``: MOON / CCVR simple CNN with projection head; ``projector=True``; 256 (84 without projector).
* ``cnn2``: McMahan et al. 2017 CNN as PFLlib's FedAvgCNN; ``padding=0`` (2 = "same"); 512.
* ``mlp``: McMahan's 2NN, or logistic regression (FedProx); ``hidden=(200, 200)`` (``()`` = logistic); last width.
* ``resnet18`` / ``resnet50``: CIFAR stem; ``norm="bn"`` (or "gn"), ``gn_groups=2``, ``width=64`` (first stage's
  channels; stages width x 1, 2, 4, 8); 512 / 2048 (8 / 32 x width).
* ``mobilenetv2``: CIFAR strides; ``width=1.0``, ``norm="bn"``, ``gn_groups=2``; 1280.
* ``vgg11``: FedMA / FedBR CIFAR VGG-11; ``norm="none"`` (or "bn", "gn"), ``gn_groups=2``, ``dropout=0.0``; 512.
* ``fedpac_cnn``: FedPAC's CNN (authors' code); ``convs="auto"`` (3 for 3-channel inputs, else 2); 128.
* ``feduv_cnn``: FedUV's 10-layer CNN (authors' code) with BatchNorm; ``width=1``, ``out_dim=256``; out_dim.
* ``feduv_resnet18``: FedUV's ResNet-18 (authors' code: stride-2 first stage, 2-layer BatchNorm projection head);
  ``out_dim=256``; out_dim.
* ``feduv_resnet50``: FedUV's ResNet-50 (authors' code: 7x7 stride-2 stem without max pool, 2-layer BatchNorm
  projection head); ``out_dim=256``; out_dim.
* ``fedbr_cnn``: FedBR's RotatedMNIST CNN (authors' code: DomainBed's MNIST_CNN, 4 convs with GroupNorm); 128.
* ``cct``: Compact Convolutional Transformer, CCT-7/3x1 by default (FedBR's CIFAR-100 model); ``num_layers=7``,
  ``embed_dim=256``, ``num_heads=4``, ``mlp_ratio=2.0``, ``kernel_size=3``, ``conv_layers=1``, ``dropout=0.0``,
  ``attention_dropout=0.0``, ``stochastic_depth=0.0``; embed_dim.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from hetfl.models.base import FLModel, ModelError, orthogonal_classifier_, param_groups
from hetfl.models.cct import CCT
from hetfl.models.cnn import CNN2, SimpleCNN
from hetfl.models.mlp import MLP
from hetfl.models.mobilenet import MobileNetV2
from hetfl.models.paper_cnns import FedBRCNN, FedPACCNN, FedUVCNN, FedUVResNet18, FedUVResNet50
from hetfl.models.resnet import ResNet, resnet18, resnet50
from hetfl.models.vgg import VGG11
from hetfl.params import did_you_mean

__all__ = [
    "CCT",
    "CNN2",
    "MLP",
    "MODELS",
    "VGG11",
    "FLModel",
    "FedBRCNN",
    "FedPACCNN",
    "FedUVCNN",
    "FedUVResNet18",
    "FedUVResNet50",
    "MobileNetV2",
    "ModelError",
    "ResNet",
    "SimpleCNN",
    "build_model",
    "model_options",
    "orthogonal_classifier_",
    "param_groups",
]

_BUILDERS: dict[str, Callable[..., FLModel]] = {
    "simple_cnn": SimpleCNN,
    "cnn2": CNN2,
    "mlp": MLP,
    "resnet18": resnet18,
    "resnet50": resnet50,
    "mobilenetv2": MobileNetV2,
    "vgg11": VGG11,
    "fedpac_cnn": FedPACCNN,
    "feduv_cnn": FedUVCNN,
    "feduv_resnet18": FedUVResNet18,
    "feduv_resnet50": FedUVResNet50,
    "fedbr_cnn": FedBRCNN,
    "cct": CCT,
}

MODELS: tuple[str, ...] = tuple(_BUILDERS)


def _check_name(name: str) -> Callable[..., FLModel]:
    if name not in _BUILDERS:
        raise ModelError("model.name", name, did_you_mean(name, MODELS) + "allowed: " + ", ".join(MODELS))
    return _BUILDERS[name]


def describe_model(name: str) -> str:
    """What model ``name`` is: the first paragraph of its builder's docstring, on one line."""
    return " ".join((_check_name(name).__doc__ or "").strip().split("\n\n")[0].split())


def model_options(name: str) -> dict[str, Any]:
    """The options ``build_model`` accepts for ``name``, with their defaults."""
    params = inspect.signature(_check_name(name)).parameters.values()
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, **options: Any) -> FLModel:
    """Build model ``name`` for inputs of shape ``input_shape`` (no batch dim) and ``num_classes`` outputs.

    Parameters are initialised from the global torch RNG (seed it, or fork it, for reproducibility).
    """
    builder = _check_name(name)
    allowed = model_options(name)
    for key, value in options.items():
        if key not in allowed:
            choices = ", ".join(allowed) if allowed else "none"
            raise ModelError(f"model.options.{key}", value, f"not an option of {name}; options: {choices}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ModelError("num_classes", num_classes, "must be a positive integer")
    try:
        shape = tuple(int(s) for s in input_shape)
    except (TypeError, ValueError):
        raise ModelError("input_shape", input_shape, "must be a tuple of positive integers") from None
    return builder(shape, num_classes, **options)
