"""The other networks of the papers' tables held to their docstrings (session 43, mutation testing of
hetfl.models.cnn, .vgg and .mobilenet): the smallest images, the padding option's forward, VGG-11's
initialisation, heads and norms, MobileNetV2's width multiplier and channel rounding, the refusals word for word."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hetfl.models.base import ModelError
from hetfl.models.cnn import CNN2, SimpleCNN
from hetfl.models.layers import BatchNorm2d
from hetfl.models.mobilenet import CIFAR_SETTINGS, InvertedResidual, MobileNetV2, make_divisible
from hetfl.models.vgg import VGG11


def _refusal(build, *args, **kwargs) -> str:
    with pytest.raises(ModelError) as refused:
        build(*args, **kwargs)
    return str(refused.value)


@pytest.mark.parametrize(("build", "name"), [(CNN2, "cnn2"), (SimpleCNN, "simple_cnn"), (VGG11, "vgg11"),
                                             (MobileNetV2, "mobilenetv2")])
def test_feature_vectors_are_refused_naming_the_model(build, name):
    assert _refusal(build, (10,), 3) == (f"input_shape = (10,): {name} needs images (C, H, W); use mlp for "
                                         f"feature vectors")


@pytest.mark.parametrize(("build", "options", "smallest"), [(SimpleCNN, {}, 16), (CNN2, {}, 16),
                                                             (CNN2, {"padding": 2}, 4)])
def test_the_small_cnns_take_images_down_to_their_smallest_side_on_either_axis(build, options, smallest):
    """Two (conv k5, pool 2) stages must leave a pixel: 16 px unpadded, 4 with ``padding=2`` (the message named
    8 there, 16 - 4 * padding, until session 43: 4 to 7 px were accepted with a refusal that said 8)."""
    name = "cnn2" if build is CNN2 else "simple_cnn"
    model = build((1, smallest, smallest), 10, **options)
    assert model(torch.zeros(2, 1, smallest, smallest)).shape == (2, 10)
    for shape in ((1, smallest - 1, smallest), (1, smallest, smallest - 1)):
        assert _refusal(build, shape, 10, **options) == (f"input_shape = {shape}: {name} needs images of at least "
                                                         f"{smallest} px a side")


def test_cnn2_with_same_padding_is_mcmahans_network():
    """``padding=2``: McMahan et al.'s 1,663,370 parameters, and each conv padded (the forward runs)."""
    model = CNN2((1, 28, 28), 10, padding=2)
    assert sum(p.numel() for p in model.parameters()) == 1_663_370
    assert [m.padding for m in model.modules() if isinstance(m, nn.Conv2d)] == [(2, 2), (2, 2)]
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_vgg11_initialises_its_convolutions_as_the_source():
    """Conv weights ~ N(0, 2 / (9 * out_channels)), biases 0: checked on the 512-channel convs (2.4 M weights
    each, the sample std within 0.5 %) and the mean on all."""
    torch.manual_seed(0)
    convs = [m for m in VGG11((3, 32, 32), 10).modules() if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [64, 128, 256, 256, 512, 512, 512, 512]
    for conv in convs:
        want = math.sqrt(2.0 / (9 * conv.out_channels))
        w = conv.weight.detach().double()
        assert abs(w.mean().item()) < 5 * want / math.sqrt(w.numel())
        assert not conv.bias.any()
        if conv.out_channels == 512:
            assert w.std().item() == pytest.approx(want, rel=5e-3)


def test_vgg11_heads_and_norms():
    """``hidden=0`` (FedBR's): a global average pool, so larger images give the same 512 features (9,225,610
    parameters at 3x32x32); ``hidden=2``: the map flattened, its size from ceil-mode pools on each axis alone;
    ``bn``/``gn``: a norm after every conv, GroupNorm of 2 groups."""
    assert sum(p.numel() for p in VGG11((3, 32, 32), 10, hidden=0).parameters()) == 9_225_610
    assert VGG11((3, 64, 64), 10, hidden=0)(torch.zeros(2, 3, 64, 64)).shape == (2, 10)
    for shape, flat in (((3, 64, 32), 512 * 2 * 1), ((3, 32, 64), 512 * 1 * 2), ((3, 28, 28), 512)):
        model = VGG11(shape, 10)
        assert next(m for m in model.encoder if isinstance(m, nn.Linear)).in_features == flat
        assert model(torch.zeros(2, *shape)).shape == (2, 10)
    bn = [type(m) for m in VGG11((3, 32, 32), 10, norm="bn").encoder if isinstance(m, nn.BatchNorm2d | nn.GroupNorm)]
    assert bn == [BatchNorm2d] * 8
    gn = [m for m in VGG11((3, 32, 32), 10, norm="gn").encoder if isinstance(m, nn.GroupNorm)]
    assert len(gn) == 8 and all(m.num_groups == 2 for m in gn)


def test_vgg11_refusals_word_for_word():
    shape = (3, 32, 32)
    assert _refusal(VGG11, shape, 10, norm="xx") == "model.options.norm = 'xx': allowed: 'none', 'bn', 'gn'"
    assert _refusal(VGG11, shape, 10, gn_groups=0) == "model.options.gn_groups = 0: must be a positive integer"
    for bad in (1.5, "0.5", True):
        assert _refusal(VGG11, shape, 10, dropout=bad) == (f"model.options.dropout = {bad!r}: must be a probability "
                                                           f"in [0, 1)")
    assert _refusal(VGG11, shape, 10, dropout=0.5, hidden=0) == (
        "model.options.dropout = 0.5: must be 0 with hidden = 0 (it acts before hidden fc)")


def test_make_divisible_rounds_to_eights_keeping_ninety_percent():
    """The reference rule (torchvision's ``_make_divisible``): the nearest multiple of 8, at least 8, one more 8
    where that loses more than 10 % (10 -> 8 is 80 %: 16); exactly 90 % is kept."""
    assert [make_divisible(v) for v in (3, 10, 12, 16, 27, 100, 1280)] == [8, 16, 16, 16, 32, 104, 1280]
    assert make_divisible(16 / 0.9) == 16 and make_divisible(24, divisor=16) == 32


@pytest.mark.parametrize("width", [0.27, 0.5, 1.0, 1.003, 2.0])
def test_mobilenetv2_widths_scale_every_layer(width):
    """The stem ``make_divisible(32 w)``, each stage ``make_divisible(c w)``, the last conv
    ``make_divisible(1280 max(1, w))`` (never narrower than 1280), as the reference code."""
    model = MobileNetV2((3, 32, 32), 10, width=width)
    assert model.width == width
    stem = next(m for m in model.encoder[0] if isinstance(m, nn.Conv2d))
    assert stem.out_channels == make_divisible(32 * width)
    blocks = [m for m in model.encoder if isinstance(m, InvertedResidual)]
    outs = [next(m for m in reversed(list(b.conv)) if isinstance(m, nn.Conv2d)).out_channels for b in blocks]
    assert outs == [make_divisible(ch * width) for _, ch, n, _ in CIFAR_SETTINGS for _ in range(n)]
    assert model.classifier.in_features == make_divisible(1280 * max(1.0, width))


def test_mobilenetv2_refusals_word_for_word():
    shape = (3, 32, 32)
    for bad in (0, -1.0, "1", True):
        assert _refusal(MobileNetV2, shape, 10, width=bad) == (
            f"model.options.width = {bad!r}: must be a positive number (width multiplier, 1.0 = standard)")
    assert _refusal(MobileNetV2, shape, 10, norm="xx").startswith("model.options.norm = 'xx': allowed: ")
    assert _refusal(MobileNetV2, shape, 10, gn_groups=0) == "model.options.gn_groups = 0: must be a positive integer"
