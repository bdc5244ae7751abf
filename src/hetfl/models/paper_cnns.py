"""Networks of the seed papers, as in the authors' code: FedPAC's CNN, FedUV's 10-layer CNN, ResNet-18 and
ResNet-50, and FedBR's RotatedMNIST CNN (DomainBed's ``MNIST_CNN``)."""

from __future__ import annotations

from torch import nn

from hetfl.models.base import FLModel, ModelError, check_choice, check_positive_int, conv_out, image_shape
from hetfl.models.layers import BatchNorm1d, BatchNorm2d, Conv2d, Linear, MaxPool2d
from hetfl.models.resnet import BasicBlock, Bottleneck


# --------------------------------------------------------------------------- FedPAC
def _fedpac_side(size: int, convs: int) -> int:
    """Spatial side after FedPAC's stages: conv k5 p0, pool 2; conv k5 p1, pool 2; [conv k3 p1, pool 2]."""
    size = conv_out(size, 5, 1, 0) // 2
    size = conv_out(size, 5, 1, 1) // 2
    if convs == 3:
        size = conv_out(size, 3, 1, 1) // 2
    return size


def _fedpac_min_side(convs: int) -> int:
    return next(s for s in range(1, 64) if _fedpac_side(s, convs) >= 1)


class FedPACCNN(FLModel):
    """The CNN of FedPAC (Xu, Tong, Huang, ICLR 2023), as in the authors' code
    (github.com/JianXu95/FedPAC, ``models/cnn.py``: ``CifarCNN`` and ``CNN_FMNIST``).

    Encoder, each conv followed by LeakyReLU (slope 0.01) then max-pool 2 (the
    code's ``pool(leaky_relu(conv(x)))``):

    * conv C->16 k5 padding 0; conv 16->32 k5 padding 1;
    * [conv 32->64 k3 padding 1: the 3-conv ``CifarCNN`` of CIFAR-10 / CINIC-10];
    * flatten; fc -> 128, LeakyReLU: the 128-d feature (classifier input).

    Classifier: 128 -> C. ``convs="auto"`` (default) uses 3 convs for 3-channel
    inputs (``CifarCNN``) and 2 otherwise (``CNN_FMNIST``, the code's FMNIST and
    EMNIST model); ``convs=2`` / ``3`` forces either. PyTorch default
    initialisation, as in the code.

    Parameter counts (weights + biases):

    * 1x28x28, 2 convs: 28 -> 24 -> 12 -> 10 -> 5, flatten 32*5*5 = 800:
      416 + 12,832 + 102,528 + classifier; 117,066 with 10 classes (FMNIST),
      123,774 with 62 (EMNIST, as the code sets ``num_classes = 62``).
    * 3x32x32, 3 convs: 32 -> 28 -> 14 -> 12 -> 6 -> 6 -> 3, flatten 64*3*3 = 576:
      1,216 + 12,832 + 18,496 + 73,856 + classifier; 107,690 with 10 classes.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, *, convs: str | int = "auto") -> None:
        c, h, w = image_shape("fedpac_cnn", input_shape)
        check_choice("convs", convs, ("auto", 2, 3))
        n = (3 if c == 3 else 2) if convs == "auto" else int(convs)
        sh, sw = _fedpac_side(h, n), _fedpac_side(w, n)
        if sh < 1 or sw < 1:
            allowed = f"fedpac_cnn with {n} convs needs images of at least {_fedpac_min_side(n)} px a side"
            raise ModelError("input_shape", (c, h, w), allowed)
        layers: list[nn.Module] = [
            Conv2d(c, 16, 5, padding=0), nn.LeakyReLU(), MaxPool2d(2),
            Conv2d(16, 32, 5, padding=1), nn.LeakyReLU(), MaxPool2d(2),
        ]  # fmt: skip
        channels = 32
        if n == 3:
            layers += [Conv2d(32, 64, 3, padding=1), nn.LeakyReLU(), MaxPool2d(2)]
            channels = 64
        layers += [nn.Flatten(), Linear(channels * sh * sw, 128), nn.LeakyReLU()]
        super().__init__(nn.Sequential(*layers), Linear(128, num_classes))
        self.convs: int = n


# --------------------------------------------------------------------------- FedUV
# (out_channels / width, kernel, stride) of the 8 convs of the authors' SimpleCNN; no padding, no bias.
FEDUV_CONVS: tuple[tuple[int, int, int], ...] = (
    (16, 3, 1), (16, 1, 1),
    (32, 3, 2), (32, 3, 1), (32, 1, 1),
    (64, 3, 2), (64, 3, 1), (64, 1, 1),
)  # fmt: skip


def _feduv_side(size: int) -> int:
    for _, k, s in FEDUV_CONVS:
        size = conv_out(size, k, s, 0)
    return size


class FedUVCNN(FLModel):
    """FedUV's small CNN for STL-10 (Son, Kim, Kim, Lee, CVPR 2024), as in the authors'
    code (github.com/sonhamin/FedUV, ``nets/models.py``: ``SimpleCNN``, built by
    ``train_fl.py`` with ``out_dim = 256``, ``simp_width = 1``).

    Ten weight layers: eight convs, each without bias and followed by
    BatchNorm2d and ReLU, no padding, widths ``16w, 16w | 32w, 32w, 32w |
    64w, 64w, 64w`` with kernels ``3, 1 | 3 (stride 2), 3, 1 | 3 (stride 2), 3, 1``;
    then global average pooling (the code's ``AdaptiveAvgPool2d(1)``; there is no
    max-pooling: the two stride-2 convs downsample), then the projector
    fc 64w -> out_dim, BatchNorm1d, ReLU, fc out_dim -> out_dim, BatchNorm1d, ReLU
    (the code's ``fc1``/``fc2``: its returned feature, the classifier input, and
    what FedUV's uniformity loss acts on), and the classifier out_dim -> C (``fc3``).

    Options: ``width`` (``simp_width``, 1) and ``out_dim`` (256). PyTorch default
    initialisation, as in the code. Any input of at least 21 px a side works
    (96 -> 94 -> 46 -> 44 -> 21 -> 19 for STL-10; 32 -> 30 -> 14 -> 12 -> 5 -> 3);
    the code hard-codes 3 input channels, here it follows the input.

    Parameters (3 channels, width 1, out_dim 256, 10 classes; independent of the
    input size): convs 74,928 + BatchNorm2d 640 + fc1 16,640 + BatchNorm1d 512
    + fc2 65,792 + BatchNorm1d 512 + classifier 2,570 = 161,594.

    Not confirmed from the code: which network the PACS experiments used (its
    non-CIFAR/STL path calls ``load_feature_shift``, which the repository does
    not define) and the paper's layer table (not checked here). The BatchNorm1d
    layers need batches of at least 2 samples in training mode.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, *, width: int = 1, out_dim: int = 256) -> None:
        c, h, w = image_shape("feduv_cnn", input_shape)
        check_positive_int("width", width)
        check_positive_int("out_dim", out_dim)
        if _feduv_side(h) < 1 or _feduv_side(w) < 1:
            raise ModelError("input_shape", (c, h, w), "feduv_cnn needs images of at least 21 px a side")
        layers: list[nn.Module] = []
        inp = c
        for channels, kernel, stride in FEDUV_CONVS:
            out = channels * width
            layers += [Conv2d(inp, out, kernel, stride=stride, bias=False), BatchNorm2d(out), nn.ReLU()]
            inp = out
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        projector = nn.Sequential(
            Linear(inp, out_dim), BatchNorm1d(out_dim), nn.ReLU(),
            Linear(out_dim, out_dim), BatchNorm1d(out_dim), nn.ReLU(),
        )  # fmt: skip
        super().__init__(nn.Sequential(*layers), Linear(out_dim, num_classes), projector)


class FedUVResNet18(FLModel):
    """FedUV's ResNet-18 for CIFAR-100 (Son, Kim, Kim, Lee, CVPR 2024), as in the authors'
    code (github.com/sonhamin/FedUV, ``nets/models.py``: ``ResNet_18``, ``out_dim = 256``;
    commit dd2e3c59fba20662a4234810f93061f4a4edc1b7).

    Differs from hetfl's ``resnet18`` in two places, both from that code:

    * the first stage also downsamples: its first BasicBlock has stride 2 and a 1x1
      projection shortcut (conv + BatchNorm), so 32x32 inputs go 32 -> 16 -> 8 -> 4 -> 2;
      stem 3x3 conv stride 1 + BatchNorm + ReLU, no max pool;
    * after global average pooling, the projection head fc 512 -> out_dim,
      BatchNorm1d, ReLU, fc out_dim -> out_dim, BatchNorm1d, ReLU (``fc1``/``fc2``:
      its returned feature ``pro1``, the classifier input, and what FedUV's
      uniformity loss acts on), then the classifier out_dim -> C (``fc3``).

    Parameters (3x32x32, out_dim 256): 11,396,900 with 100 classes, 11,373,770 with
    10. PyTorch default initialisation, as in the code. BatchNorm1d needs batches
    of at least 2 samples in training mode (the code's loader drops the last
    incomplete batch: ``train.drop_last = true``).
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, *, out_dim: int = 256) -> None:
        c, _, _ = image_shape("feduv_resnet18", input_shape)
        check_positive_int("out_dim", out_dim)
        layers: list[nn.Module] = [Conv2d(c, 64, 3, 1, 1, bias=False), BatchNorm2d(64), nn.ReLU()]
        inp = 64
        for planes in (64, 128, 256, 512):
            # stride 2 in every stage, the first included: each first block has a 1x1 projection shortcut
            layers.append(nn.Sequential(BasicBlock(inp, planes, 2, "bn", 2), BasicBlock(planes, planes, 1, "bn", 2)))
            inp = planes
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        super().__init__(nn.Sequential(*layers), Linear(out_dim, num_classes), _feduv_projector(512, out_dim))


def _feduv_projector(width: int, out_dim: int) -> nn.Sequential:
    """FedUV's projection head (``fc1``/``fc1_bn``/``fc2``/``fc2_bn``): its output, after the last ReLU, is the
    classifier input and what the uniformity loss acts on."""
    return nn.Sequential(
        Linear(width, out_dim), BatchNorm1d(out_dim), nn.ReLU(),
        Linear(out_dim, out_dim), BatchNorm1d(out_dim), nn.ReLU(),
    )  # fmt: skip


class FedUVResNet50(FLModel):
    """FedUV's ResNet-50 for Tiny-ImageNet and Office-Home (Son, Kim, Kim, Lee, CVPR 2024), as in the authors'
    code (github.com/sonhamin/FedUV, ``nets/models.py``: ``ResNet_50``; commit dd2e3c59).

    Differs from hetfl's ``resnet50`` (the CIFAR stem) in two places, both from that code:

    * the ImageNet stem: a 7x7 convolution with stride 2 and padding 3 (no bias) + BatchNorm + ReLU, and
      no max pool (the code comments it out), so 64x64 inputs go 64 -> 32 -> 32 -> 16 -> 8 -> 4 and 96x96
      ones 96 -> 48 -> 48 -> 24 -> 12 -> 6: a quarter of the CIFAR stem's positions at every layer;
    * after global average pooling, the projection head fc 2048 -> out_dim, BatchNorm1d, ReLU,
      fc out_dim -> out_dim, BatchNorm1d, ReLU, then the classifier out_dim -> C (``fc3``). The paper gives
      ResNet-50 a 2048-wide projector (section 4.1); the code's ``--out_dim`` default is 256, hence the
      option (the presets set 2048).

    Bottleneck blocks [3, 4, 6, 3] as torchvision's (ResNet v1.5: the stride on the 3x3 convolution), each
    stage's first block with a 1x1 convolution + BatchNorm shortcut (stride 1 in the first stage).
    PyTorch default initialisation, as in the code. BatchNorm1d needs batches of at least 2 samples in
    training mode (the code's loader drops the last incomplete batch: ``train.drop_last = true``).

    Parameters (3 channels, out_dim 2048): encoder 23,508,032 + projector 8,400,896 + classifier;
    32,318,728 with 200 classes (Tiny-ImageNet), 32,042,113 with 65 (Office-Home).
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, *, out_dim: int = 256) -> None:
        c, _, _ = image_shape("feduv_resnet50", input_shape)
        check_positive_int("out_dim", out_dim)
        layers: list[nn.Module] = [Conv2d(c, 64, 7, 2, 3, bias=False), BatchNorm2d(64), nn.ReLU()]
        inp = 64
        for i, (planes, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True)):
            stage = [Bottleneck(inp if j == 0 else planes * 4, planes, 2 if (i > 0 and j == 0) else 1, "bn", 2)
                     for j in range(blocks)]
            layers.append(nn.Sequential(*stage))
            inp = planes * 4
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        super().__init__(nn.Sequential(*layers), Linear(out_dim, num_classes), _feduv_projector(inp, out_dim))


# --------------------------------------------------------------------------- FedBR
class FedBRCNN(FLModel):
    """FedBR's RotatedMNIST network (Guo, Tang, Lin, ICML 2023), as in the authors' code
    (github.com/LINs-lab/FedBR, ``fedbr/networks.py``: DomainBed's ``MNIST_CNN``, the featurizer its
    ``Featurizer`` builds for 28x28 inputs, and the linear ``Classifier``).

    Encoder: conv C->64 k3 padding 1; conv 64->128 k3 stride 2 padding 1; conv 128->128 k3 padding 1;
    conv 128->128 k3 padding 1; each conv (with bias) followed by ReLU, then GroupNorm(8 groups) (the
    code's order: ``bn(relu(conv(x)))``); global average pooling: the 128-d feature (the code's
    ``n_outputs``). Classifier: 128 -> C. No BatchNorm, so nothing to average but parameters. PyTorch
    default initialisation, as in the code. Any input size works (global pooling).

    Parameters (1 channel, 10 classes): convs 640 + 73,856 + 2 x 147,584 + GroupNorm 2 x (64 + 3 x 128)
    + classifier 1,290 = 371,850.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        c, _, _ = image_shape("fedbr_cnn", input_shape)
        layers: list[nn.Module] = []
        for cin, cout, stride in ((c, 64, 1), (64, 128, 2), (128, 128, 1), (128, 128, 1)):
            layers += [Conv2d(cin, cout, 3, stride, 1), nn.ReLU(), nn.GroupNorm(8, cout)]
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        super().__init__(nn.Sequential(*layers), Linear(128, num_classes))
