"""Models: parameter counts, shapes, the encoder/projector/classifier split, functional use, errors."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, stack_module_state, vmap

from hetfl.models import MODELS, FLModel, ModelError, build_model, model_options, orthogonal_classifier_, param_groups

MNIST, CIFAR = (1, 28, 28), (3, 32, 32)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# Hand-derived counts (weights + biases):
# simple_cnn 3x32x32: conv 3-6 k5 456, conv 6-16 k5 2,416, fc 400-120 48,120, fc 120-84 10,164,
#   projector 84-84 7,140 + 84-256 21,760, classifier 256-10 2,570 = 92,626.
#   Without projector: 92,626 - 28,900 - 2,570 + 850 (84-10) = 62,006.
# cnn2 (padding 0, PFLlib FedAvgCNN): 28 -> 24 -> 12 -> 8 -> 4, flatten 64*4*4 = 1,024:
#   conv 1-32 k5 832, conv 32-64 k5 51,264, fc 1,024-512 524,800, classifier 512-10 5,130 = 582,026.
#   3x32x32: 32 -> 28 -> 14 -> 10 -> 5, flatten 1,600: conv 3-32 k5 2,432 + 51,264 + fc 819,712 + 5,130 = 878,538.
#   padding 2 ("same", McMahan et al.): flatten 7*7*64 = 3,136, fc 1,606,144: 832 + 51,264 + 1,606,144 + 5,130
#   = 1,663,370, the count McMahan et al. report.
# mlp (200, 200) on MNIST: 157,000 + 40,200 + 2,010 = 199,210 (McMahan's 2NN); hidden () = 784*10 + 10 = 7,850.
# vgg11: convs 9,220,480 + fc 512-512 x2 525,312 + classifier 5,130 = 9,750,922.
#   hidden 0 (FedBR's code: torchvision vgg11 features, global average pool, classifier): 9,220,480 + 5,130
#   = 9,225,610, the "9.2" million FedBR's slides (Table 7) give for VGG-11 with FedAvg.
@pytest.mark.parametrize(
    ("name", "shape", "options", "expected"),
    [
        ("simple_cnn", CIFAR, {}, 92_626),
        ("simple_cnn", CIFAR, {"projector": False}, 62_006),
        ("cnn2", MNIST, {}, 582_026),
        ("cnn2", CIFAR, {}, 878_538),
        ("cnn2", MNIST, {"padding": 2}, 1_663_370),
        ("mlp", MNIST, {}, 199_210),
        ("mlp", MNIST, {"hidden": []}, 7_850),
        ("resnet18", CIFAR, {}, 11_173_962),
        ("resnet18", CIFAR, {"norm": "gn"}, 11_173_962),
        ("mobilenetv2", CIFAR, {}, 2_236_682),  # = torchvision mobilenet_v2(num_classes=10)
        ("vgg11", CIFAR, {}, 9_750_922),
        ("vgg11", CIFAR, {"hidden": 0}, 9_225_610),
    ],
)
def test_parameter_counts(name: str, shape: tuple[int, ...], options: dict, expected: int) -> None:
    assert n_params(build_model(name, shape, 10, **options)) == expected


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("shape", [MNIST, CIFAR])
def test_forward_shapes_and_split(name: str, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = build_model(name, shape, 7)
    assert isinstance(model, FLModel) and model.num_classes == 7
    assert isinstance(model.classifier, torch.nn.Linear) and model.classifier.in_features == model.feature_dim
    model.train()
    assert model(torch.randn(2, *shape)).shape == (2, 7)  # train mode: batch >= 2 (BatchNorm)
    model.eval()
    x = torch.randn(1, *shape)
    with torch.no_grad():
        z, logits = model(x, return_features=True)
        assert z.shape == (1, model.feature_dim) and logits.shape == (1, 7)
        torch.testing.assert_close(logits, model.classifier(z))
        torch.testing.assert_close(z, model.features(x))
        torch.testing.assert_close(model(x), logits)


def test_feature_dims() -> None:
    dims = {"simple_cnn": 256, "cnn2": 512, "mlp": 200, "resnet18": 512, "mobilenetv2": 1280, "vgg11": 512}
    for name, dim in dims.items():
        assert build_model(name, CIFAR, 10).feature_dim == dim
    assert build_model("resnet50", (3, 8, 8), 10).feature_dim == 2048
    assert build_model("simple_cnn", CIFAR, 10, projector=False).feature_dim == 84
    assert build_model("mlp", (60,), 10, hidden=()).feature_dim == 60
    assert build_model("mobilenetv2", (3, 8, 8), 10, width=0.5).feature_dim == 1280


def test_param_groups() -> None:
    model = build_model("simple_cnn", CIFAR, 10)
    groups = param_groups(model)
    assert groups["classifier"] == ["classifier.weight", "classifier.bias"]
    assert groups["projector"] == ["projector.0.weight", "projector.0.bias", "projector.2.weight", "projector.2.bias"]
    assert all(n.startswith("encoder.") for n in groups["encoder"]) and len(groups["encoder"]) == 8
    assert sorted(n for names in groups.values() for n in names) == sorted(n for n, _ in model.named_parameters())
    plain = build_model("simple_cnn", CIFAR, 10, projector=False)
    assert plain.projector is None and param_groups(plain)["projector"] == []
    logistic = param_groups(build_model("mlp", (60,), 10, hidden=[]))
    assert logistic == {"encoder": [], "projector": [], "classifier": ["classifier.weight", "classifier.bias"]}


def test_orthogonal_classifier() -> None:
    model = build_model("simple_cnn", CIFAR, 10)
    orthogonal_classifier_(model, gain=2.0, generator=torch.Generator().manual_seed(1))
    w = model.classifier.weight.detach()
    torch.testing.assert_close(w @ w.T, 4.0 * torch.eye(10), atol=1e-5, rtol=0)
    assert not model.classifier.bias.detach().any()
    other = build_model("simple_cnn", CIFAR, 10)
    orthogonal_classifier_(other, gain=2.0, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(other.classifier.weight, model.classifier.weight)


def test_functional_call_with_features() -> None:
    torch.manual_seed(0)
    model = build_model("resnet18", (3, 8, 8), 5, norm="bn").eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["classifier.bias"] = state["classifier.bias"] + 1.0
    x = torch.randn(3, 3, 8, 8)
    z, logits = functional_call(model, state, (x,), {"return_features": True})
    with torch.no_grad():
        torch.testing.assert_close(z, model.features(x))
        torch.testing.assert_close(logits, model(x) + 1.0)


@pytest.mark.parametrize(
    ("name", "shape", "options"),
    [
        ("simple_cnn", CIFAR, {}),
        ("mlp", (60,), {"hidden": [16]}),
        ("resnet18", (3, 8, 8), {"norm": "gn"}),
        ("resnet18", (3, 8, 8), {"norm": "bn"}),  # train mode: batch statistics, stacked running stats
    ],
)
def test_vmap_over_stacked_params(name: str, shape: tuple[int, ...], options: dict) -> None:
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(build_model(name, shape, 10, **options))
    params, buffers = stack_module_state(models)
    x = torch.randn(2, 4, *shape)  # one batch per copy

    def call(p: dict, b: dict, xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return functional_call(models[0], (p, b), (xb,), {"return_features": True})

    z, logits = vmap(call)(params, buffers, x)
    for i, m in enumerate(models):
        zi, li = m(x[i], return_features=True)
        torch.testing.assert_close(logits[i], li, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(z[i], zi, atol=1e-4, rtol=1e-4)


def test_build_is_seeded() -> None:
    torch.manual_seed(3)
    a = build_model("vgg11", MNIST, 10, norm="bn")
    torch.manual_seed(3)
    b = build_model("vgg11", MNIST, 10, norm="bn")
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(ta, tb)


def test_options_and_defaults() -> None:
    assert model_options("resnet18") == {"norm": "bn", "gn_groups": 2, "width": 64}
    assert model_options("vgg11") == {"norm": "none", "gn_groups": 2, "dropout": 0.0, "hidden": 2}
    gn = build_model("resnet18", CIFAR, 10, norm="gn", gn_groups=4)
    assert not list(gn.buffers()) and any(isinstance(m, torch.nn.GroupNorm) for m in gn.modules())
    assert any(isinstance(m, torch.nn.Dropout) for m in build_model("vgg11", CIFAR, 10, dropout=0.5).modules())
    assert not any(isinstance(m, torch.nn.Dropout) for m in build_model("vgg11", CIFAR, 10).modules())
    mobile = build_model("mobilenetv2", (3, 8, 8), 10, norm="gn")
    assert any(isinstance(m, torch.nn.GroupNorm) for m in mobile.modules())


@pytest.mark.parametrize(
    ("call", "fragments"),
    [
        (lambda: build_model("lenet", CIFAR, 10), ["model.name", "'lenet'", "simple_cnn", "vgg11"]),
        (lambda: build_model("resnet18", CIFAR, 10, depth=34), ["model.options.depth", "34", "norm, gn_groups"]),
        (lambda: build_model("resnet18", CIFAR, 10, norm="ln"), ["model.options.norm", "'ln'", "'bn', 'gn'"]),
        (lambda: build_model("resnet18", CIFAR, 10, norm="gn", gn_groups=3), ["options.gn_groups", "3", "divide"]),
        (lambda: build_model("simple_cnn", (60,), 10), ["input_shape", "(60,)", "(C, H, W)"]),
        (lambda: build_model("simple_cnn", (3, 8, 8), 10), ["input_shape", "(3, 8, 8)", "at least 16"]),
        (lambda: build_model("mlp", (60,), 10, hidden=[0]), ["model.options.hidden", "[0]", "positive"]),
        (lambda: build_model("cnn2", MNIST, 10, padding=1), ["model.options.padding", "1", "0, 2"]),
        (lambda: build_model("simple_cnn", CIFAR, 10, projector="no"), ["model.options.projector", "'no'"]),
        (lambda: build_model("mobilenetv2", CIFAR, 10, width=0), ["model.options.width", "0", "positive"]),
        (lambda: build_model("resnet18", CIFAR, 10, width=0), ["model.options.width", "0", "positive"]),
        (lambda: build_model("resnet18", CIFAR, 10, norm="gn", gn_groups=4, width=6),
         ["options.gn_groups", "4", "divide"]),
        (lambda: build_model("vgg11", CIFAR, 10, dropout=1.0), ["model.options.dropout", "1.0", "[0, 1)"]),
        (lambda: build_model("vgg11", CIFAR, 10, hidden=1), ["model.options.hidden", "1", "0, 2"]),
        (lambda: build_model("vgg11", CIFAR, 10, hidden=0, dropout=0.5), ["options.dropout", "0.5", "hidden = 0"]),
        (lambda: build_model("mlp", (60,), 0), ["num_classes", "0", "positive"]),
    ],
)
def test_model_errors(call, fragments: list[str]) -> None:
    with pytest.raises(ModelError) as info:
        call()
    assert isinstance(info.value, ValueError)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", MODELS)
def test_cuda_matches_cpu(name: str) -> None:
    torch.manual_seed(0)
    model = build_model(name, CIFAR, 10).eval()
    x = torch.randn(4, *CIFAR)
    with torch.no_grad():
        z, logits = model(x, return_features=True)
        zc, lc = model.cuda()(x.cuda(), return_features=True)
    torch.testing.assert_close(lc.cpu(), logits, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(zc.cpu(), z, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize(("name", "expansion"), [("resnet18", 1), ("resnet50", 4)])
def test_a_narrow_resnet_is_the_same_network_with_fewer_channels(name, expansion):
    """``model.options.width``: the stages' channels are width x (1, 2, 4, 8) (x 4 in ResNet-50's bottlenecks'
    outputs), the blocks and strides those of the standard network (width 64, unchanged: 11.17 M parameters for
    ResNet-18 on CIFAR-10)."""
    standard, narrow = build_model(name, CIFAR, 10), build_model(name, CIFAR, 10, width=16)
    assert standard.feature_dim == 512 * expansion and narrow.feature_dim == 128 * expansion
    convs = lambda m: [x.weight.shape for x in m.modules() if isinstance(x, torch.nn.Conv2d)]
    assert [(o // 4, i // 4 if i > 3 else i, *k) for o, i, *k in convs(standard)] == [tuple(w) for w in convs(narrow)]
    if name == "resnet18":
        assert sum(p.numel() for p in standard.parameters()) == 11_173_962
    x = torch.randn(2, *CIFAR)
    features, logits = narrow(x, return_features=True)
    assert features.shape == (2, 128 * expansion) and logits.shape == (2, 10)
