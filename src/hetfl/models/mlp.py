"""Fully connected models: McMahan et al.'s 2NN and multinomial logistic regression."""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

from hetfl.models.base import FLModel, ModelError
from hetfl.models.layers import Linear


class MLP(FLModel):
    """Flatten, then ``hidden`` fully connected ReLU layers, then the classifier.

    ``hidden=(200, 200)`` (default) is the "2NN" of McMahan et al. (AISTATS
    2017): 199,210 parameters on MNIST. ``hidden=()`` is multinomial logistic
    regression, FedProx's model on Synthetic(alpha, beta) (Li et al., MLSys
    2020): the encoder is only ``nn.Flatten`` and ``feature_dim`` is the input size.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, *, hidden: Sequence[int] = (200, 200)) -> None:
        if len(input_shape) < 1 or any(int(s) < 1 for s in input_shape):
            raise ModelError("input_shape", tuple(input_shape), "mlp needs a non-empty shape of positive sizes")
        if (
            isinstance(hidden, str | bytes)
            or not isinstance(hidden, Sequence)
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in hidden)
        ):
            allowed = "must be a list of positive layer widths ([] = logistic regression)"
            raise ModelError("model.options.hidden", hidden, allowed)
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(int(s) for s in input_shape)
        for n in hidden:
            layers += [Linear(width, n), nn.ReLU()]
            width = n
        encoder = layers[0] if len(layers) == 1 else nn.Sequential(*layers)
        super().__init__(encoder, Linear(width, num_classes))
        self.hidden: tuple[int, ...] = tuple(hidden)
