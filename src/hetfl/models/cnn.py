"""Small CNNs of the FL literature: MOON's simple CNN and the FedAvg 2-conv CNN."""

from __future__ import annotations

from torch import nn

from hetfl.models.base import FLModel, ModelError, check_bool, check_choice, conv_out, image_shape
from hetfl.models.layers import Conv2d, Linear, MaxPool2d


def _conv_pool_side(size: int, padding: int) -> int:
    """One spatial side after two (conv k5 with ``padding`` -> maxpool 2) stages."""
    for _ in range(2):
        size = conv_out(size, 5, 1, padding) // 2
    return size


def _conv_pool_size(name: str, input_shape: tuple[int, int, int], padding: int) -> int:
    """Spatial size (pixels) after two (conv k5 with ``padding`` -> maxpool 2) stages; ModelError naming the
    smallest side that leaves a pixel (16 unpadded, 4 with ``padding=2``) if it vanishes."""
    _, h, w = input_shape
    h, w = _conv_pool_side(h, padding), _conv_pool_side(w, padding)
    if h < 1 or w < 1:
        smallest = next(s for s in range(1, 64) if _conv_pool_side(s, padding) >= 1)
        raise ModelError("input_shape", input_shape, f"{name} needs images of at least {smallest} px a side")
    return h * w


class SimpleCNN(FLModel):
    """MOON's simple CNN (Li, He, Song, CVPR 2021), CCVR's CIFAR-10 model (Luo et al., NeurIPS 2021).

    Encoder: conv C->6 k5, ReLU, maxpool 2; conv 6->16 k5, ReLU, maxpool 2;
    flatten; fc -> 120, ReLU; fc 120 -> 84, ReLU. Projector (MOON's projection
    head, ``projector=True``): fc 84 -> 84, ReLU, fc 84 -> 256. Classifier:
    256 -> C (84 -> C without the projector).

    3x32x32, 10 classes: flatten 400, 92,626 parameters (62,006 without the
    projector). 1x28x28: flatten 256 (MOON's ``SimpleCNNMNIST``).
    PyTorch default initialisation, as in MOON's code.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, *, projector: bool = True) -> None:
        c, h, w = image_shape("simple_cnn", input_shape)
        flat = 16 * _conv_pool_size("simple_cnn", (c, h, w), 0)
        encoder = nn.Sequential(
            Conv2d(c, 6, 5), nn.ReLU(), MaxPool2d(2),
            Conv2d(6, 16, 5), nn.ReLU(), MaxPool2d(2),
            nn.Flatten(),
            Linear(flat, 120), nn.ReLU(),
            Linear(120, 84), nn.ReLU(),
        )  # fmt: skip
        head = None
        if check_bool("projector", projector):
            head = nn.Sequential(Linear(84, 84), nn.ReLU(), Linear(84, 256))
        super().__init__(encoder, Linear(256 if head is not None else 84, num_classes), head)


class CNN2(FLModel):
    """The 2-conv CNN of McMahan et al. (AISTATS 2017), as PFLlib's ``FedAvgCNN``.

    Encoder: conv C->32 k5, ReLU, maxpool 2; conv 32->64 k5, ReLU, maxpool 2;
    flatten; fc -> 512, ReLU. Classifier: 512 -> C.

    ``padding=0`` (default) is PFLlib's: flatten 1024 for 1x28x28 (582,026
    parameters, 10 classes) and 1600 for 3x32x32 (878,538 parameters).
    ``padding=2`` ("same", as the TensorFlow original) gives flatten 3136 for
    MNIST and McMahan et al.'s reported 1,663,370 parameters.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, *, padding: int = 0) -> None:
        c, h, w = image_shape("cnn2", input_shape)
        check_choice("padding", padding, (0, 2))
        flat = 64 * _conv_pool_size("cnn2", (c, h, w), padding)
        encoder = nn.Sequential(
            Conv2d(c, 32, 5, padding=padding), nn.ReLU(), MaxPool2d(2),
            Conv2d(32, 64, 5, padding=padding), nn.ReLU(), MaxPool2d(2),
            nn.Flatten(),
            Linear(flat, 512), nn.ReLU(),
        )  # fmt: skip
        super().__init__(encoder, Linear(512, num_classes))
