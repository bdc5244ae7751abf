"""MobileNetV2 (Sandler et al., CVPR 2018), CIFAR variant.

Blocks as in the paper (and torchvision): inverted residuals with a 1x1
expansion (factor t), a 3x3 depthwise convolution and a linear 1x1
projection; the identity shortcut only where stride is 1 and the channel count
is unchanged; ReLU6; width multiplier applied to every stage, channels rounded
to multiples of 8.

CIFAR adaptation (as Kuang Liu's ``pytorch-cifar``): the stem convolution has
stride 1 instead of 2 and the second stage (24 channels) stride 1 instead of
2, so the total stride is 8 (32x32 -> 4x4) instead of 32. The encoder ends
with the 1x1 convolution to ``1280 * max(1, width)`` channels and global average
pooling (feature_dim 1280 for ``width <= 1``). The classifier is one linear
layer; the ImageNet model's dropout before it is left out, so that forward is
deterministic (and vmappable without a randomness mode). PyTorch default
initialisation, as ``pytorch-cifar``.

``width=1``, 3x32x32, 10 classes: 2,236,682 parameters (torchvision's
``mobilenet_v2(num_classes=10)`` count; the stride changes add none).
``norm``/``gn_groups`` as for ResNet (GroupNorm default 2 groups).
"""

from __future__ import annotations

from torch import Tensor, nn

from hetfl.models.base import NORMS, FLModel, ModelError, check_choice, check_positive_int, image_shape, make_norm
from hetfl.models.layers import Conv2d, Linear

# t (expansion), c (output channels), n (blocks), s (stride of the first block); CIFAR strides
CIFAR_SETTINGS: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1),
    (6, 24, 2, 1),  # 2 in the ImageNet model
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


def make_divisible(v: float, divisor: int = 8) -> int:
    """Round to the nearest multiple of ``divisor``, not going below 90 % of ``v`` (the reference code's rule)."""
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


def _conv_norm_act(
    inp: int, out: int, kernel: int, stride: int, groups: int, norm: str, gn_groups: int
) -> list[nn.Module]:
    conv = Conv2d(inp, out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False)
    return [conv, make_norm(norm, out, gn_groups), nn.ReLU6()]


class InvertedResidual(nn.Module):
    """Expand (1x1) -> depthwise 3x3 -> linear projection (1x1), identity shortcut when shapes match."""

    def __init__(self, inp: int, out: int, stride: int, expand: int, norm: str, gn_groups: int) -> None:
        super().__init__()
        hidden = inp * expand
        self.use_res = stride == 1 and inp == out
        layers: list[nn.Module] = []
        if expand != 1:
            layers += _conv_norm_act(inp, hidden, 1, 1, 1, norm, gn_groups)
        layers += _conv_norm_act(hidden, hidden, 3, stride, hidden, norm, gn_groups)
        layers += [Conv2d(hidden, out, 1, bias=False), make_norm(norm, out, gn_groups)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2(FLModel):
    """MobileNetV2 for small images; see the module docstring for the CIFAR changes."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        *,
        width: float = 1.0,
        norm: str = "bn",
        gn_groups: int = 2,
    ) -> None:
        c, _, _ = image_shape("mobilenetv2", input_shape)
        check_choice("norm", norm, NORMS)
        check_positive_int("gn_groups", gn_groups)
        if isinstance(width, bool) or not isinstance(width, int | float) or not width > 0:
            allowed = "must be a positive number (width multiplier, 1.0 = standard)"
            raise ModelError("model.options.width", width, allowed)
        inp = make_divisible(32 * width)
        last = make_divisible(1280 * max(1.0, width))
        layers: list[nn.Module] = [nn.Sequential(*_conv_norm_act(c, inp, 3, 1, 1, norm, gn_groups))]
        for t, ch, n, s in CIFAR_SETTINGS:
            out = make_divisible(ch * width)
            for i in range(n):
                layers.append(InvertedResidual(inp, out, s if i == 0 else 1, t, norm, gn_groups))
                inp = out
        layers.append(nn.Sequential(*_conv_norm_act(inp, last, 1, 1, 1, norm, gn_groups)))
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        super().__init__(nn.Sequential(*layers), Linear(last, num_classes))
        self.width = float(width)
