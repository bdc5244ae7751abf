"""VGG-11 for CIFAR (Simonyan & Zisserman, ICLR 2015), as FedMA and FedBR use it.

The CIFAR version of Cheng-Yang Fu's ``pytorch-vgg-cifar10`` (FedMA's VGG-11;
FedBR's is the same conv stack without the hidden fc layers, ``hidden = 0``): the VGG "A" convolution stack
[64, M, 128, M, 256, 256, M, 512, 512, M, 512, 512, M] (3x3, padding 1, ReLU;
optional norm after each conv), then fc 512 -> 512, ReLU, fc 512 -> 512, ReLU,
and a 512 -> C classifier.

Split: the encoder is the conv stack plus both hidden fc layers, so the
feature vector (feature_dim 512) is the input of the last linear layer, as the
methods (CCVR, FedBR, FedUV...) require: they treat the final linear layer as
"the classifier" and everything before it as the representation.

Choices, documented:
* Pools use ``ceil_mode=True``: identical to the source for 32x32 (32 -> 1),
  and lets 28x28 inputs reach 1x1 too (28 -> 14 -> 7 -> 4 -> 2 -> 1). Larger
  inputs keep their spatial map, flattened (e.g. 64x64 -> 512 * 2 * 2).
* The source's dropout (0.5) before each hidden fc layer is off by default
  (``dropout=0.0``) so forward is deterministic and vmappable; with
  ``dropout > 0`` a vectorised runtime needs ``vmap(randomness="different")``.
* ``norm``: "none" (default, FedMA's VGG-11), "bn" (``vgg11_bn``) or "gn".
* ``hidden``: the hidden fc layers, 2 (default, the source's) or 0: the conv stack, a global average
  pool and the classifier on its 512 features, as FedBR's code (``fedbr/networks.py`` ``CIFAR_Vgg``:
  torchvision's ``vgg11().features``; 9,225,610 parameters for 3x32x32 and 10 classes, the "9.2 M" of
  FedBR's Table 7). ``dropout`` acts before hidden layers only, so it needs ``hidden = 2``.
* Initialisation as the source: conv weights ~ N(0, 2 / (k*k*out_channels)),
  conv biases 0; linear layers PyTorch default.

3x32x32, 10 classes, no norm: 9,750,922 parameters.
"""

from __future__ import annotations

import math

from torch import nn

from hetfl.models.base import FLModel, ModelError, check_choice, check_positive_int, image_shape, make_norm
from hetfl.models.layers import Conv2d, Linear, MaxPool2d

VGG11_CONFIG: tuple[int | str, ...] = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class VGG11(FLModel):
    """VGG-11, CIFAR head (two 512-wide fc layers in the encoder, or none: ``hidden``; one linear classifier)."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        *,
        norm: str = "none",
        gn_groups: int = 2,
        dropout: float = 0.0,
        hidden: int = 2,
    ) -> None:
        c, h, w = image_shape("vgg11", input_shape)
        check_choice("norm", norm, ("none", "bn", "gn"))
        check_choice("hidden", hidden, (0, 2))
        check_positive_int("gn_groups", gn_groups)
        if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
            raise ModelError("model.options.dropout", dropout, "must be a probability in [0, 1)")
        if dropout > 0 and hidden == 0:
            raise ModelError("model.options.dropout", dropout, "must be 0 with hidden = 0 (it acts before hidden fc)")
        layers: list[nn.Module] = []
        inp = c
        for v in VGG11_CONFIG:
            if v == "M":
                layers.append(MaxPool2d(2, ceil_mode=True))
                h, w = math.ceil(h / 2), math.ceil(w / 2)
                continue
            assert isinstance(v, int)
            conv = Conv2d(inp, v, 3, padding=1)
            nn.init.normal_(conv.weight, 0.0, math.sqrt(2.0 / (9 * v)))
            nn.init.zeros_(conv.bias)
            layers.append(conv)
            if norm != "none":
                layers.append(make_norm(norm, v, gn_groups))
            layers.append(nn.ReLU())
            inp = v
        if hidden == 0:  # FedBR's code: global average pool of the conv stack, the classifier on its 512 channels
            layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
            super().__init__(nn.Sequential(*layers), Linear(inp, num_classes))
            return
        layers.append(nn.Flatten())
        width = inp * h * w
        for _ in range(hidden):
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            layers += [Linear(width, 512), nn.ReLU()]
            width = 512
        super().__init__(nn.Sequential(*layers), Linear(512, num_classes))
