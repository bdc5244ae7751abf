"""The seed papers' models: FedPAC's CNN, FedUV's CNN and CCT-7/3x1.

Parameter counts are derived here from layer shapes (not by asking the model),
then compared with the built models.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, stack_module_state, vmap

from hetfl.models import MODELS, ModelError, build_model, model_options, param_groups
from hetfl.models.cct import DropPath

pytestmark = pytest.mark.usefixtures("one_thread")

MNIST, CIFAR, STL = (1, 28, 28), (3, 32, 32), (3, 96, 96)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def conv(cin: int, cout: int, k: int, bias: bool = True) -> int:
    return cin * cout * k * k + (cout if bias else 0)


def linear(fan_in: int, fan_out: int, bias: bool = True) -> int:
    return fan_in * fan_out + (fan_out if bias else 0)


def norm(channels: int) -> int:  # BatchNorm / LayerNorm affine parameters
    return 2 * channels


# ---------------------------------------------------------------- FedPAC's CNN
def fedpac_count(channels: int, flat: int, classes: int, three_convs: bool) -> int:
    total = conv(channels, 16, 5) + conv(16, 32, 5)
    if three_convs:
        total += conv(32, 64, 3)
    return total + linear(flat, 128) + linear(128, classes)


@pytest.mark.parametrize(
    ("shape", "classes", "options", "flat", "three", "expected"),
    [
        # 28 -k5-> 24 -pool-> 12 -k5 p1-> 10 -pool-> 5: 32*5*5
        (MNIST, 10, {}, 32 * 5 * 5, False, 117_066),  # FMNIST
        (MNIST, 62, {}, 32 * 5 * 5, False, 123_774),  # EMNIST (the code's num_classes = 62)
        # 32 -> 28 -> 14 -> 12 -> 6 -k3 p1-> 6 -> 3: 64*3*3
        (CIFAR, 10, {}, 64 * 3 * 3, True, 107_690),  # CIFAR-10 / CINIC-10
        (CIFAR, 10, {"convs": 2}, 32 * 6 * 6, False, None),
        (MNIST, 10, {"convs": 3}, 64 * 2 * 2, True, None),
    ],
)
def test_fedpac_cnn_counts(shape, classes, options, flat, three, expected) -> None:
    model = build_model("fedpac_cnn", shape, classes, **options)
    count = fedpac_count(shape[0], flat, classes, three)
    if expected is not None:
        assert count == expected
    assert n_params(model) == count
    assert model.feature_dim == 128 and model.projector is None
    assert sum(isinstance(m, torch.nn.LeakyReLU) for m in model.modules()) == (4 if three else 3)


# ---------------------------------------------------------------- FedUV's CNN
def feduv_count(channels: int, classes: int, width: int = 1, out_dim: int = 256) -> int:
    spec = [(16, 3), (16, 1), (32, 3), (32, 3), (32, 1), (64, 3), (64, 3), (64, 1)]
    total, cin = 0, channels
    for c, k in spec:
        total += conv(cin, c * width, k, bias=False) + norm(c * width)
        cin = c * width
    total += linear(cin, out_dim) + norm(out_dim) + linear(out_dim, out_dim) + norm(out_dim)
    return total + linear(out_dim, classes)


@pytest.mark.parametrize("shape", [STL, CIFAR])
def test_feduv_cnn_counts_and_features(shape) -> None:
    model = build_model("feduv_cnn", shape, 10)
    assert feduv_count(3, 10) == 161_594
    assert n_params(model) == 161_594  # global average pooling: independent of the input size
    assert model.feature_dim == 256
    model.train()
    z, logits = model(torch.randn(2, *shape), return_features=True)
    assert z.shape == (2, 256) and logits.shape == (2, 10)
    assert (z >= 0).all()  # the feature is the projector's last ReLU output
    convs = [m for m in model.encoder.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [c.stride[0] for c in convs] == [1, 1, 2, 1, 1, 2, 1, 1] and all(c.bias is None for c in convs)
    groups = param_groups(model)
    assert groups["classifier"] == ["classifier.weight", "classifier.bias"] and len(groups["projector"]) == 8


def test_feduv_cnn_options() -> None:
    model = build_model("feduv_cnn", CIFAR, 7, width=2, out_dim=64)
    assert n_params(model) == feduv_count(3, 7, width=2, out_dim=64)
    assert model.feature_dim == 64
    assert n_params(build_model("feduv_cnn", (1, 21, 21), 10)) == feduv_count(1, 10)  # the smallest input


# ---------------------------------------------------------------- FedUV's ResNet-18
def feduv_resnet18_count(classes: int, out_dim: int = 256) -> int:
    """The authors' ResNet_18 (sonhamin/FedUV nets/models.py): every stage's first block has stride 2 and a
    1x1 conv + BN shortcut (the first stage's too), then fc1/BN/fc2/BN and fc3. Built by hand from the code
    (commit dd2e3c59) in a scratch script: 11,396,900 parameters with 100 classes."""
    total, cin = conv(3, 64, 3, bias=False) + norm(64), 64
    for c in (64, 128, 256, 512):
        total += conv(cin, c, 3, bias=False) + norm(c) + conv(c, c, 3, bias=False) + norm(c)  # first block
        total += conv(cin, c, 1, bias=False) + norm(c)  # its projection shortcut
        total += 2 * (conv(c, c, 3, bias=False) + norm(c))  # second block
        cin = c
    total += linear(512, out_dim) + norm(out_dim) + linear(out_dim, out_dim) + norm(out_dim)
    return total + linear(out_dim, classes)


def test_feduv_resnet18_matches_the_authors_model() -> None:
    assert feduv_resnet18_count(100) == 11_396_900  # the authors' ResNet_18(out_dim=256, num_class=100)
    model = build_model("feduv_resnet18", CIFAR, 100)
    assert n_params(model) == 11_396_900 and model.feature_dim == 256
    assert n_params(build_model("feduv_resnet18", CIFAR, 10, out_dim=64)) == feduv_resnet18_count(10, 64)
    convs = [m for m in model.encoder.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3)]
    assert [c.stride[0] for c in convs] == [1, 2, 1, 1, 1, 2, 1, 1, 1, 2, 1, 1, 1, 2, 1, 1, 1]
    model.train()
    z, logits = model(torch.randn(2, *CIFAR), return_features=True)
    assert z.shape == (2, 256) and logits.shape == (2, 100) and (z >= 0).all()  # projector's last ReLU
    assert model.encoder[:4](torch.randn(1, *CIFAR)).shape == (1, 64, 16, 16)  # the first stage downsamples
    assert len(param_groups(model)["projector"]) == 8


# ---------------------------------------------------------------- FedUV's ResNet-50
def bottleneck_count(cin: int, planes: int, shortcut: bool) -> int:
    """torchvision's Bottleneck (sonhamin/FedUV nets/resnet_utils.py): conv1x1, conv3x3, conv1x1 (x4), a BN each."""
    total = conv(cin, planes, 1, bias=False) + norm(planes) + conv(planes, planes, 3, bias=False) + norm(planes)
    total += conv(planes, 4 * planes, 1, bias=False) + norm(4 * planes)
    return total + (conv(cin, 4 * planes, 1, bias=False) + norm(4 * planes) if shortcut else 0)


def feduv_resnet50_count(channels: int, classes: int, out_dim: int) -> int:
    """The authors' ResNet_50 (nets/models.py): initial_conv 7x7 (no bias) + BN; layer1..4 of 3, 4, 6, 3
    bottlenecks, each first one with a conv1x1 + BN downsample; fc1/fc1_bn/fc2/fc2_bn/fc3."""
    total, cin = conv(channels, 64, 7, bias=False) + norm(64), 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        total += bottleneck_count(cin, planes, True) + (blocks - 1) * bottleneck_count(4 * planes, planes, False)
        cin = 4 * planes
    total += linear(2048, out_dim) + norm(out_dim) + linear(out_dim, out_dim) + norm(out_dim)
    return total + linear(out_dim, classes)


def test_feduv_resnet50_matches_the_authors_model() -> None:
    tiny, office = (3, 64, 64), (3, 96, 96)
    assert feduv_resnet50_count(3, 200, 2048) == 32_318_728  # Tiny-ImageNet, the paper's 2048-wide projector
    assert n_params(build_model("feduv_resnet50", tiny, 200, out_dim=2048)) == 32_318_728
    model = build_model("feduv_resnet50", office, 65, out_dim=2048)
    assert n_params(model) == feduv_resnet50_count(3, 65, 2048) == 32_042_113
    assert model.feature_dim == 2048 and len(param_groups(model)["projector"]) == 8
    small = build_model("feduv_resnet50", tiny, 10)  # the code's --out_dim default, 256
    assert n_params(small) == feduv_resnet50_count(3, 10, 256) and small.feature_dim == 256
    stem = model.encoder[0]
    assert stem.kernel_size == (7, 7) and stem.stride == (2, 2) and stem.padding == (3, 3) and stem.bias is None
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in model.modules())  # the code comments it out
    with torch.no_grad():  # 64 -> 32 (stem) -> 32 -> 16 -> 8 -> 4
        assert model.encoder[:4](torch.randn(1, *tiny)).shape == (1, 256, 32, 32)
        assert model.encoder[:7](torch.randn(1, *tiny)).shape == (1, 2048, 4, 4)
    model.train()
    z, logits = model(torch.randn(2, *office), return_features=True)
    assert z.shape == (2, 2048) and logits.shape == (2, 65) and (z >= 0).all()  # the projector's last ReLU


# ---------------------------------------------------------------- FedBR's RotatedMNIST CNN
def test_fedbr_cnn_is_domainbeds_mnist_cnn() -> None:
    """LINs-lab/FedBR fedbr/networks.py MNIST_CNN: convs 64, 128 (stride 2), 128, 128, 3x3 padding 1 with bias,
    GroupNorm(8) each, global average pooling (n_outputs 128), then the linear Classifier."""
    count = conv(1, 64, 3) + norm(64) + conv(64, 128, 3) + 3 * norm(128) + 2 * conv(128, 128, 3) + linear(128, 10)
    assert count == 371_850
    model = build_model("fedbr_cnn", MNIST, 10)
    assert n_params(model) == count and model.feature_dim == 128 and model.projector is None
    norms = [m for m in model.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert [(m.num_groups, m.num_channels) for m in norms] == [(8, 64), (8, 128), (8, 128), (8, 128)]
    assert [c.stride[0] for c in model.modules() if isinstance(c, torch.nn.Conv2d)] == [1, 2, 1, 1]
    assert n_params(build_model("fedbr_cnn", CIFAR, 10)) == count + conv(3, 64, 3) - conv(1, 64, 3)


# ---------------------------------------------------------------- CCT-7/3x1
def cct_encoder_count(channels: int, tokens: int, dim: int = 256, layers: int = 7, mlp: int = 512) -> int:
    tokenizer = conv(channels, dim, 3, bias=False)
    layer = norm(dim) + linear(dim, 3 * dim, bias=False) + linear(dim, dim) + linear(dim, mlp) + norm(dim)
    layer += linear(mlp, dim)
    return tokenizer + tokens * dim + layers * layer + norm(dim) + linear(dim, 1)


def test_cct_counts_and_split() -> None:
    # 32x32 -> conv k3 s1 p1 -> 32x32 -> max-pool 3/2/1 -> 16x16 = 256 tokens
    encoder = cct_encoder_count(3, 256)
    assert encoder == 3_757_569
    # The paper reports 3.76M for CCT-7/3x1 (the count with 10 classes): equal to two decimals in millions,
    # the precision of the reported figure, so the tolerance is half a unit of the last digit, 5,000.
    ten = build_model("cct", CIFAR, 10)
    assert n_params(ten) == encoder + linear(256, 10) == 3_760_139
    assert abs(n_params(ten) - 3.76e6) <= 5_000
    # CIFAR-100 (FedBR): 90 more classifier rows of 257
    hundred = build_model("cct", CIFAR, 100)
    assert n_params(hundred) == encoder + linear(256, 100) == 3_783_269
    groups = param_groups(hundred)
    assert groups["classifier"] == ["classifier.weight", "classifier.bias"] and groups["projector"] == []
    assert "encoder.positional_emb" in groups["encoder"] and "encoder.attention_pool.weight" in groups["encoder"]
    assert sum(p.numel() for n, p in hundred.named_parameters() if n in groups["encoder"]) == encoder
    assert hundred.feature_dim == 256 and hundred.encoder.positional_emb.shape == (1, 256, 256)
    # 28x28 -> 14x14 = 196 tokens
    assert n_params(build_model("cct", MNIST, 10)) == cct_encoder_count(1, 196) + linear(256, 10)


def test_cct_options_and_regularisation_defaults() -> None:
    small = build_model("cct", (3, 16, 16), 5, num_layers=2, embed_dim=32, num_heads=2, mlp_ratio=1.5)
    assert n_params(small) == cct_encoder_count(3, 64, dim=32, layers=2, mlp=48) + linear(32, 5)
    two_convs = build_model("cct", (3, 16, 16), 5, num_layers=1, embed_dim=32, conv_layers=2)
    # 16 -> 8 -> 4: 16 tokens; conv 3->64 then 64->32
    assert two_convs.encoder.positional_emb.shape == (1, 16, 32)
    # off by default: deterministic forward in training mode
    model = build_model("cct", (3, 8, 8), 4, num_layers=2, embed_dim=16, num_heads=2)
    model.train()
    assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout | DropPath))
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(model(x), model(x), atol=0, rtol=0)
    regular = build_model(
        "cct", (3, 8, 8), 4, num_layers=3, embed_dim=16, dropout=0.1, attention_dropout=0.1, stochastic_depth=0.1
    )
    assert [b.drop_path.p for b in regular.encoder.blocks] == pytest.approx([0.0, 0.05, 0.1])  # linspace, as CCT
    assert {m.p for m in regular.modules() if isinstance(m, torch.nn.Dropout)} == {0.1}


def test_cct_sequence_pooling_is_attention_pooling() -> None:
    torch.manual_seed(0)
    model = build_model("cct", (3, 8, 8), 3, num_layers=1, embed_dim=16, num_heads=2).eval()
    x = torch.randn(2, 3, 8, 8)
    enc = model.encoder
    with torch.no_grad():
        tokens = enc.tokenizer(x).flatten(2).transpose(1, 2) + enc.positional_emb
        seq = enc.norm(enc.blocks(tokens))
        w = torch.softmax(seq @ enc.attention_pool.weight.T + enc.attention_pool.bias, dim=1)  # [B, T, 1]
        expected = (w * seq).sum(1)
        torch.testing.assert_close(model.features(x), expected)


# ---------------------------------------------------------------- functional use
SMALL = [
    ("fedpac_cnn", MNIST, {}),
    ("fedpac_cnn", CIFAR, {}),
    ("feduv_cnn", (3, 24, 24), {"out_dim": 32}),  # train mode: BatchNorm batch statistics, stacked running stats
    ("cct", (3, 12, 12), {"num_layers": 2, "embed_dim": 32, "num_heads": 4}),
]


@pytest.mark.parametrize(("name", "shape", "options"), SMALL)
def test_functional_call_with_explicit_state(name, shape, options) -> None:
    torch.manual_seed(0)
    model = build_model(name, shape, 5, **options).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["classifier.bias"] = state["classifier.bias"] + 1.0
    x = torch.randn(3, *shape)
    z, logits = functional_call(model, state, (x,), {"return_features": True})
    with torch.no_grad():
        torch.testing.assert_close(z, model.features(x))
        torch.testing.assert_close(logits, model(x) + 1.0)


@pytest.mark.parametrize(("name", "shape", "options"), SMALL)
def test_vmap_over_two_stacked_states(name, shape, options) -> None:
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(build_model(name, shape, 6, **options).train())
    params, buffers = stack_module_state(models)
    x = torch.randn(2, 3, *shape)  # a batch of 3 per state

    def call(p: dict, b: dict, xb: torch.Tensor):
        return functional_call(models[0], (p, b), (xb,), {"return_features": True})

    z, logits = vmap(call, randomness="error")(params, buffers, x)
    for i, m in enumerate(models):
        zi, li = m(x[i], return_features=True)
        torch.testing.assert_close(logits[i], li, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(z[i], zi, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- registry and errors
def test_registered_with_defaults() -> None:
    assert {"fedpac_cnn", "feduv_cnn", "cct"} <= set(MODELS)
    assert model_options("fedpac_cnn") == {"convs": "auto"}
    assert model_options("feduv_cnn") == {"width": 1, "out_dim": 256}
    assert model_options("cct") == {
        "num_layers": 7, "embed_dim": 256, "num_heads": 4, "mlp_ratio": 2.0, "kernel_size": 3, "conv_layers": 1,
        "dropout": 0.0, "attention_dropout": 0.0, "stochastic_depth": 0.0,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("name", "shape", "options", "fragments"),
    [
        ("fedpac_cnn", MNIST, {"convs": 4}, ["model.options.convs", "4", "'auto', 2, 3"]),
        ("fedpac_cnn", (1, 11, 11), {}, ["input_shape", "(1, 11, 11)", "at least 12"]),
        ("fedpac_cnn", (3, 15, 15), {}, ["input_shape", "at least 16"]),
        ("fedpac_cnn", (60,), {}, ["input_shape", "(C, H, W)"]),
        ("feduv_cnn", CIFAR, {"width": 0}, ["model.options.width", "0", "positive integer"]),
        ("feduv_cnn", CIFAR, {"out_dim": 2.5}, ["model.options.out_dim", "2.5", "positive integer"]),
        ("feduv_cnn", (3, 20, 20), {}, ["input_shape", "(3, 20, 20)", "at least 21"]),
        ("cct", CIFAR, {"num_layers": 0}, ["model.options.num_layers", "0", "positive integer"]),
        ("cct", CIFAR, {"embed_dim": True}, ["model.options.embed_dim", "True", "positive integer"]),
        ("cct", CIFAR, {"num_heads": 3}, ["model.options.num_heads", "3", "divide embed_dim (256)"]),
        ("cct", CIFAR, {"mlp_ratio": 0}, ["model.options.mlp_ratio", "0", "positive number"]),
        ("cct", CIFAR, {"mlp_ratio": 0.001}, ["model.options.mlp_ratio", "0.001", ">= 1"]),
        ("cct", CIFAR, {"kernel_size": "3"}, ["model.options.kernel_size", "'3'", "positive integer"]),
        ("cct", CIFAR, {"conv_layers": -1}, ["model.options.conv_layers", "-1", "positive integer"]),
        ("cct", CIFAR, {"dropout": 1.0}, ["model.options.dropout", "1.0", "[0, 1)"]),
        ("cct", CIFAR, {"attention_dropout": -0.1}, ["model.options.attention_dropout", "-0.1", "[0, 1)"]),
        ("cct", CIFAR, {"stochastic_depth": "0.1"}, ["model.options.stochastic_depth", "'0.1'", "[0, 1)"]),
        ("cct", CIFAR, {"heads": 4}, ["model.options.heads", "not an option of cct", "num_heads"]),
    ],
)
def test_option_errors(name, shape, options, fragments) -> None:
    with pytest.raises(ModelError) as info:
        build_model(name, shape, 10, **options)
    for fragment in fragments:
        assert fragment in str(info.value)
