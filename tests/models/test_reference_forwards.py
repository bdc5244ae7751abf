"""Each paper's model against its forward pass as the authors' code (or the paper's layer table) writes it.

The references are written here with ``torch.nn.functional`` from the published definitions, layer by
layer, in their own order of convolution, normalisation, activation and pooling; they read only the
built model's weights, in the order the model declares them (encoder, projector, classifier), so
any difference of activation, pooling, norm placement, residual, stride or padding shows in the
outputs. The feature (classifier input: where CCVR's statistics, FedPAC's centroids, FedUV's and
MOON's losses act) is checked as well as the logits. Sources:

* ``simple_cnn``: MOON's ``ModelFedCon`` + ``SimpleCNN_header`` (QinbinLi/MOON ``model.py``), CCVR's Table 6;
* ``fedpac_cnn``: JianXu95/FedPAC ``models/cnn.py`` (``CifarCNN``, ``CNN_FMNIST``);
* ``feduv_cnn`` / ``feduv_resnet18``: sonhamin/FedUV ``nets/models.py`` (``SimpleCNN``, ``ResNet_18``, torchvision's
  BasicBlock);
* ``feduv_resnet50``: sonhamin/FedUV ``nets/models.py`` ``ResNet_50`` (torchvision's Bottleneck);
* ``fedbr_cnn``: LINs-lab/FedBR ``networks.py`` ``MNIST_CNN`` (DomainBed's) and its linear ``Classifier``;
* ``mobilenetv2``: CCVR's Table 7 (App. E.2), the layer list typed in below, with Sandler et al.'s BN and ReLU6;
* ``vgg11`` (``hidden = 0``): LINs-lab/FedBR ``networks.py`` ``CIFAR_Vgg`` (torchvision ``vgg11().features``,
  adaptive average pool) and its linear ``Classifier``;
* ``cnn2``: PFLlib's ``FedAvgCNN``;
* ``cct``: FedBR's ``src/utils/transformers.py`` ``TransformerClassifier`` (``cct_7_3x1_32_c100``, fc removed).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetfl.models import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


class Weights:
    """The model's layers with weights, in declaration order, handed out one by one."""

    def __init__(self, model: nn.Module) -> None:
        kinds = (nn.Conv2d, nn.Linear, nn.BatchNorm2d, nn.BatchNorm1d, nn.LayerNorm, nn.GroupNorm)
        self.layers = [m for m in model.modules() if isinstance(m, kinds)]
        self.i = 0

    def take(self, kind: type) -> nn.Module:
        layer = self.layers[self.i]
        assert isinstance(layer, kind), f"layer {self.i}: {type(layer).__name__}, reference expects {kind.__name__}"
        self.i += 1
        return layer

    def take_group_norm(self) -> nn.GroupNorm:
        return self.take(nn.GroupNorm)  # type: ignore[return-value]

    def done(self) -> None:
        assert self.i == len(self.layers), f"{len(self.layers) - self.i} layers left unused by the reference"


def conv(w: Weights, x: torch.Tensor, stride: int = 1, padding: int = 0, groups: int = 1) -> torch.Tensor:
    c = w.take(nn.Conv2d)
    assert c.stride == (stride, stride) and c.padding == (padding, padding) and c.groups == groups
    return F.conv2d(x, c.weight, c.bias, stride, padding, 1, groups)


def fc(w: Weights, x: torch.Tensor) -> torch.Tensor:
    lin = w.take(nn.Linear)
    return F.linear(x, lin.weight, lin.bias)


def bn(w: Weights, x: torch.Tensor, training: bool) -> torch.Tensor:
    b = w.take(nn.BatchNorm2d if x.dim() == 4 else nn.BatchNorm1d)
    # reference statistics: a copy, so that the model's own running buffers are compared untouched
    mean, var = b.running_mean.clone(), b.running_var.clone()
    return F.batch_norm(x, mean, var, b.weight, b.bias, training, b.momentum, b.eps)


def randomise_norms(model: nn.Module) -> None:
    """Running statistics and affine parameters away from their 0/1 start, so that eval mode is tested."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=gen) * 0.1)


def compare(model: nn.Module, reference, shape: tuple[int, ...], training: bool, batch: int = 4) -> None:
    torch.manual_seed(0)
    x = torch.randn(batch, *shape)
    model.train(training)
    w = Weights(model)
    with torch.no_grad():
        want_z, want_y = reference(w, x, training)
        w.done()
        got_z, got_y = model(x, return_features=True)
    torch.testing.assert_close(got_z, want_z, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_y, want_y, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- MOON / CCVR simple CNN
def moon_simple_cnn(w: Weights, x: torch.Tensor, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = F.max_pool2d(F.relu(conv(w, x)), 2, 2)
    x = F.max_pool2d(F.relu(conv(w, x)), 2, 2)
    x = x.flatten(1)
    h = F.relu(fc(w, F.relu(fc(w, x))))  # SimpleCNN_header: fc1, relu, fc2, relu
    z = fc(w, F.relu(fc(w, h)))  # ModelFedCon: l1, relu, l2 (no activation after l2)
    return z, fc(w, z)  # l3


# --------------------------------------------------------------------------- FedPAC
def fedpac_cnn(w: Weights, x: torch.Tensor, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    convs = 3 if x.shape[1] == 3 else 2
    x = F.max_pool2d(F.leaky_relu(conv(w, x, padding=0)), 2, 2)
    x = F.max_pool2d(F.leaky_relu(conv(w, x, padding=1)), 2, 2)
    if convs == 3:
        x = F.max_pool2d(F.leaky_relu(conv(w, x, padding=1)), 2, 2)
    z = F.leaky_relu(fc(w, x.flatten(1)))
    return z, fc(w, z)


# --------------------------------------------------------------------------- FedUV
def feduv_head(w: Weights, x: torch.Tensor, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = F.adaptive_avg_pool2d(x, 1).flatten(1)
    x = F.relu(bn(w, fc(w, x), training))
    z = F.relu(bn(w, fc(w, x), training))
    return z, fc(w, z)


def feduv_cnn(w: Weights, x: torch.Tensor, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    for stride in (1, 1, 2, 1, 1, 2, 1, 1):  # conv1..conv8, no padding, no bias
        x = F.relu(bn(w, conv(w, x, stride=stride), training))
    return feduv_head(w, x, training)


def basic_block(w: Weights, x: torch.Tensor, stride: int, downsample: bool, training: bool) -> torch.Tensor:
    out = F.relu(bn(w, conv(w, x, stride, 1), training))
    out = bn(w, conv(w, out, 1, 1), training)
    identity = bn(w, conv(w, x, stride, 0), training) if downsample else x
    return F.relu(out + identity)


def feduv_resnet18(w: Weights, x: torch.Tensor, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = F.relu(bn(w, conv(w, x, 1, 1), training))  # initial_conv, no max pool
    for _ in range(4):  # layer1..layer4: every first block stride 2 with a 1x1 conv + BN downsample
        x = basic_block(w, x, 2, True, training)
        x = basic_block(w, x, 1, False, training)
    return feduv_head(w, x, training)


def bottleneck(w: Weights, x: torch.Tensor, stride: int, downsample: bool, training: bool) -> torch.Tensor:
    """torchvision's Bottleneck (v1.5: the stride on the 3x3), as FedUV's resnet_utils.py."""
    out = F.relu(bn(w, conv(w, x), training))
    out = F.relu(bn(w, conv(w, out, stride, 1), training))
    out = bn(w, conv(w, out), training)
    identity = bn(w, conv(w, x, stride, 0), training) if downsample else x
    return F.relu(out + identity)


def feduv_resnet50(w: Weights, x: torch.Tensor, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = F.relu(bn(w, conv(w, x, 2, 3), training))  # initial_conv: 7x7 stride 2 padding 3; no max pool
    for i, blocks in enumerate((3, 4, 6, 3)):
        x = bottleneck(w, x, 1 if i == 0 else 2, True, training)
        for _ in range(blocks - 1):
            x = bottleneck(w, x, 1, False, training)
    return feduv_head(w, x, training)


# --------------------------------------------------------------------------- FedBR's RotatedMNIST CNN
def domainbed_mnist_cnn(w: Weights, x: torch.Tensor, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DomainBed's MNIST_CNN.forward: conv, relu, then the GroupNorm (named bn0..bn3 in the code)."""
    for stride in (1, 2, 1, 1):
        x = F.relu(conv(w, x, stride, 1))
        g = w.take_group_norm()
        x = F.group_norm(x, g.num_groups, g.weight, g.bias, g.eps)
    z = F.adaptive_avg_pool2d(x, 1).flatten(1)
    return z, fc(w, z)


# --------------------------------------------------------------------------- CCVR's MobileNetV2 (Table 7)
# Table 7 row by row: (input channels, expansion conv output or None, output channels, depthwise stride), x rep.
TABLE7 = [
    (32, None, 16, 1, 1),
    (16, 96, 24, 1, 1), (24, 144, 24, 1, 1),
    (24, 144, 32, 2, 1), (32, 192, 32, 1, 2),
    (32, 192, 64, 2, 1), (64, 384, 64, 1, 3),
    (64, 384, 96, 1, 1), (96, 576, 96, 1, 2),
    (96, 576, 160, 2, 1), (160, 960, 160, 1, 2),
    (160, 960, 320, 1, 1),
]  # fmt: skip


def table7_mobilenetv2(w: Weights, x: torch.Tensor, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = F.relu6(bn(w, conv(w, x, 1, 1), training))  # Conv2d(3, 32, k3, s1, p1)
    for cin, hidden, cout, stride, rep in TABLE7:
        for _ in range(rep):
            h = x
            if hidden is not None:
                h = F.relu6(bn(w, conv(w, h), training))
            channels = h.shape[1]
            h = F.relu6(bn(w, conv(w, h, stride, 1, groups=channels), training))
            h = bn(w, conv(w, h), training)  # the linear bottleneck: no activation
            # "skip connections where the input channels equal the output channels and the stride is 1"
            x = x + h if (cin == cout and stride == 1) else h
            cin = cout
            stride = 1 if rep > 1 else stride
    z = F.avg_pool2d(F.relu6(bn(w, conv(w, x), training)), 4).flatten(1)  # Conv2d(320, 1280, k1), AvgPool 4
    return z, fc(w, z)


def table7_count(classes: int) -> int:
    """Table 7's parameters: convolutions without bias (each followed by a BatchNorm: 2 per channel),
    depthwise convolutions k*k per channel, and the classifier."""
    total = 3 * 32 * 9 + 2 * 32
    for cin, hidden, cout, _, rep in TABLE7:
        for _ in range(rep):
            mid = cin
            if hidden is not None:
                total += cin * hidden + 2 * hidden
                mid = hidden
            total += mid * 9 + 2 * mid + mid * cout + 2 * cout
            cin = cout
    total += 320 * 1280 + 2 * 1280
    return total + 1280 * classes + classes


# --------------------------------------------------------------------------- FedBR's VGG-11 and PFLlib's CNN
def fedbr_vgg11(w: Weights, x: torch.Tensor, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    for v in (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"):  # torchvision cfgs["A"]
        x = F.max_pool2d(x, 2, 2) if v == "M" else F.relu(conv(w, x, 1, 1))
    z = F.adaptive_avg_pool2d(x, 1).flatten(1)
    return z, fc(w, z)


def pfllib_fedavg_cnn(w: Weights, x: torch.Tensor, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = F.max_pool2d(F.relu(conv(w, x)), 2)
    x = F.max_pool2d(F.relu(conv(w, x)), 2)
    z = F.relu(fc(w, x.flatten(1)))
    return z, fc(w, z)


# --------------------------------------------------------------------------- CCT (FedBR's CIFAR-100 model)
def ln(n: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, n.normalized_shape, n.weight, n.bias, n.eps)


def lin(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def cct_layer(layer: nn.Module, src: torch.Tensor, heads: int) -> torch.Tensor:
    """FedBR's ``TransformerEncoderLayer.forward`` (its layers' names; dropout and drop path off)."""
    b, t, c = src.shape
    attn_mod = layer.self_attn
    assert attn_mod.qkv.bias is None
    q, k, v = lin(attn_mod.qkv, ln(layer.pre_norm, src)).reshape(b, t, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
    attn = ((q @ k.transpose(-2, -1)) * (c // heads) ** -0.5).softmax(-1)
    src = src + lin(attn_mod.proj, (attn @ v).transpose(1, 2).reshape(b, t, c))
    src = ln(layer.norm1, src)  # norm1 on the residual stream itself
    return src + lin(layer.linear2, F.gelu(lin(layer.linear1, src)))


CASES = [
    ("simple_cnn", (3, 32, 32), {}, moon_simple_cnn),
    ("simple_cnn", (1, 28, 28), {}, moon_simple_cnn),
    ("fedpac_cnn", (3, 32, 32), {}, fedpac_cnn),
    ("fedpac_cnn", (1, 28, 28), {}, fedpac_cnn),
    ("feduv_cnn", (3, 32, 32), {"out_dim": 32}, feduv_cnn),
    ("feduv_resnet18", (3, 32, 32), {"out_dim": 32}, feduv_resnet18),
    ("feduv_resnet50", (3, 64, 64), {"out_dim": 32}, feduv_resnet50),
    ("fedbr_cnn", (1, 28, 28), {}, domainbed_mnist_cnn),
    ("mobilenetv2", (3, 32, 32), {}, table7_mobilenetv2),
    ("vgg11", (3, 32, 32), {"hidden": 0}, fedbr_vgg11),
    ("cnn2", (1, 28, 28), {}, pfllib_fedavg_cnn),
    ("cnn2", (3, 32, 32), {}, pfllib_fedavg_cnn),
]


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize(("name", "shape", "options", "reference"), CASES, ids=[f"{c[0]}-{c[1][1]}" for c in CASES])
def test_the_model_is_the_authors_forward(name, shape, options, reference, training) -> None:
    torch.manual_seed(1)
    model = build_model(name, shape, 10, **options)
    randomise_norms(model)
    compare(model, reference, shape, training)


def test_mobilenetv2_has_table7s_parameters() -> None:
    assert table7_count(10) == 2_236_682
    assert sum(p.numel() for p in build_model("mobilenetv2", (3, 32, 32), 100).parameters()) == table7_count(100)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_cct_is_fedbrs_transformer_classifier(training) -> None:
    torch.manual_seed(1)
    heads = 2
    model = build_model("cct", (3, 12, 12), 10, num_layers=2, embed_dim=16, num_heads=heads, mlp_ratio=2.0)
    model.train(training)
    enc = model.encoder
    inputs = torch.randn(3, 3, 12, 12)
    with torch.no_grad():
        tok = enc.tokenizer[0]
        assert tok.bias is None and tok.stride == (1, 1) and tok.padding == (1, 1)  # k3: stride 1, padding 1
        x = F.max_pool2d(F.relu(F.conv2d(inputs, tok.weight, None, 1, 1)), 3, 2, 1)  # Tokenizer
        src = x.flatten(2).transpose(1, 2) + enc.positional_emb  # 6 x 6 = 36 tokens, learnable embedding
        for layer in enc.blocks:
            src = cct_layer(layer, src, heads)
        src = ln(enc.norm, src)
        z = (F.softmax(lin(enc.attention_pool, src), dim=1).transpose(-1, -2) @ src).squeeze(-2)  # seq_pool
        y = lin(model.classifier, z)  # FedBR's Classifier on the encoder's embed_dim output
        got_z, got_y = model(inputs, return_features=True)
    torch.testing.assert_close(got_z, z, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_y, y, atol=1e-5, rtol=1e-5)
