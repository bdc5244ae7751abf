"""ResNet-18 / ResNet-50 with the CIFAR stem (He et al., CVPR 2016).

The CIFAR adaptation of Kuang Liu's ``pytorch-cifar`` (used by MOON, FedUV and
most FL papers on CIFAR): a 3x3, stride 1 stem convolution and no max pool, so
32x32 inputs reach the last stage at 4x4; then global average pooling. 1x1
projection shortcuts (with a norm layer) where the shape changes. PyTorch
default initialisation, as that code.

``norm="bn"`` is BatchNorm; ``norm="gn"`` replaces every BatchNorm by
``GroupNorm(gn_groups, channels)``, the usual FL substitute under non-IID data
(Hsieh et al., ICML 2020, "The Non-IID Data Quagmire", who use 2 groups, hence
the default ``gn_groups=2``). Parameter counts are the same for both (affine
weight and bias per channel); GroupNorm has no running-statistics buffers and
is safe under ``torch.func.vmap``.

ResNet-18, 3x32x32, 10 classes: 11,173,962 parameters; ResNet-50: 23,520,842.
"""

from __future__ import annotations

from torch import Tensor, nn

from hetfl.models.base import NORMS, FLModel, check_choice, check_positive_int, image_shape, make_norm
from hetfl.models.layers import Conv2d, Linear


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (ResNet-18/34)."""

    expansion = 1

    def __init__(self, inp: int, planes: int, stride: int, norm: str, gn_groups: int) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = Conv2d(inp, planes, 3, stride, 1, bias=False)
        self.bn1 = make_norm(norm, planes, gn_groups)
        self.conv2 = Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = make_norm(norm, planes, gn_groups)
        self.relu = nn.ReLU()
        self.shortcut = _shortcut(inp, out, stride, norm, gn_groups)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4) with a residual connection (ResNet-50/101/152)."""

    expansion = 4

    def __init__(self, inp: int, planes: int, stride: int, norm: str, gn_groups: int) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = Conv2d(inp, planes, 1, bias=False)
        self.bn1 = make_norm(norm, planes, gn_groups)
        self.conv2 = Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = make_norm(norm, planes, gn_groups)
        self.conv3 = Conv2d(planes, out, 1, bias=False)
        self.bn3 = make_norm(norm, out, gn_groups)
        self.relu = nn.ReLU()
        self.shortcut = _shortcut(inp, out, stride, norm, gn_groups)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


def _shortcut(inp: int, out: int, stride: int, norm: str, gn_groups: int) -> nn.Module:
    if stride == 1 and inp == out:
        return nn.Identity()
    return nn.Sequential(Conv2d(inp, out, 1, stride, bias=False), make_norm(norm, out, gn_groups))


class ResNet(FLModel):
    """CIFAR-stem ResNet; encoder ends with global average pooling (feature_dim = 8 * width * expansion: 512 *
    expansion at the standard ``width = 64``). ``width``: the first stage's channels (the stages have width,
    2 width, 4 width, 8 width), for narrower networks of the same depth and shape (quick experiments, tests)."""

    def __init__(
        self,
        block: type[BasicBlock | Bottleneck],
        num_blocks: tuple[int, int, int, int],
        input_shape: tuple[int, ...],
        num_classes: int,
        *,
        norm: str = "bn",
        gn_groups: int = 2,
        name: str = "resnet",
        width: int = 64,
    ) -> None:
        c, _, _ = image_shape(name, input_shape)
        check_choice("norm", norm, NORMS)
        check_positive_int("gn_groups", gn_groups)
        check_positive_int("width", width)
        layers: list[nn.Module] = [Conv2d(c, width, 3, 1, 1, bias=False), make_norm(norm, width, gn_groups),
                                   nn.ReLU()]
        inp = width
        for i, (planes, n) in enumerate(zip((width, 2 * width, 4 * width, 8 * width), num_blocks, strict=True)):
            stage = []
            for j in range(n):
                stage.append(block(inp, planes, 2 if (i > 0 and j == 0) else 1, norm, gn_groups))
                inp = planes * block.expansion
            layers.append(nn.Sequential(*stage))
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        super().__init__(nn.Sequential(*layers), Linear(inp, num_classes))


def resnet18(input_shape: tuple[int, ...], num_classes: int, *, norm: str = "bn", gn_groups: int = 2,
             width: int = 64) -> ResNet:
    """ResNet-18 (BasicBlock x [2, 2, 2, 2]), feature_dim 8 * width (512)."""
    return ResNet(BasicBlock, (2, 2, 2, 2), input_shape, num_classes, norm=norm, gn_groups=gn_groups, name="resnet18",
                  width=width)


def resnet50(input_shape: tuple[int, ...], num_classes: int, *, norm: str = "bn", gn_groups: int = 2,
             width: int = 64) -> ResNet:
    """ResNet-50 (Bottleneck x [3, 4, 6, 3]), feature_dim 32 * width (2048)."""
    return ResNet(Bottleneck, (3, 4, 6, 3), input_shape, num_classes, norm=norm, gn_groups=gn_groups, name="resnet50",
                  width=width)
