"""VHL (Tang et al. 2022): properties that mutation testing showed untested: the virtual data's generator
against a reference written from the module's docstring, the supervised contrastive loss against a loop over
its definition (classes of more than two samples), the draws' range, the virtual classifier's seeded stream,
the refusals' whole messages, the memory estimate, the virtual data's dtype and device, the loss parts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import hetfl.algorithms.vhl as vhl_module
from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import Batch, ClientContext
from hetfl.algorithms.vhl import HEAD, PICK, VIRTUAL_X, VIRTUAL_Y, generate_virtual, supervised_contrastive_loss
from hetfl.params import ConfigError
from tests.helpers import initial_state, perturbed, tiny_setup

pytestmark = pytest.mark.usefixtures("one_thread")


def ready(params: dict | None = None, x: torch.Tensor | None = None, **train):
    setup = tiny_setup(**train)
    algo = build_algorithm("vhl", {"num_virtual": 30, **(params or {})}, setup)
    server = algo.init_server(perturbed(initial_state(setup), 0.3, seed=1))
    x = torch.randn(9, 4, generator=torch.Generator().manual_seed(0)) if x is None else x
    ctx = ClientContext(0, 1, len(x), 0.1, server.model, {}, inputs=lambda: Batch(x, torch.arange(len(x)) % 3))
    ctx.extras = algo.begin(ctx)
    return setup, algo, server, ctx


# --------------------------------------------------------------------------- the virtual data's generator
def reference_virtual(seed: int, shape: tuple[int, ...], num_classes: int, per_class: int, upsamplings: int):
    """The docstring's generator, written out: class means ``N(0, I_64)``, latents ``m_c + 0.3 eps``; He weights
    ``N(0, 2 / fan_in)`` drawn in order; LeakyReLU 0.2; for images a linear map to 32 x 4 x 4, then
    ``upsamplings`` times (nearest 2x, 3x3 conv with zero padding 1, LeakyReLU), a 3x3 conv to the channels,
    tanh, bilinear resizing; every channel standardised over the whole set."""
    gen = torch.Generator().manual_seed(seed)

    def he(*size: int, fan_in: int) -> torch.Tensor:
        return torch.randn(size, generator=gen) * math.sqrt(2.0 / fan_in)

    def leaky(h: torch.Tensor) -> torch.Tensor:
        return torch.where(h > 0, h, 0.2 * h)

    means = torch.randn(num_classes, 64, generator=gen)
    labels = torch.tensor([c for c in range(num_classes) for _ in range(per_class)])
    z = means[labels] + 0.3 * torch.randn(len(labels), 64, generator=gen)
    if len(shape) == 1:
        x = torch.tanh(leaky(z @ he(64, 128, fan_in=64)) @ he(128, shape[0], fan_in=128))
    else:
        ch, height, width = shape
        h = leaky((z @ he(64, 32 * 16, fan_in=64)).reshape(-1, 32, 4, 4))
        for _ in range(upsamplings):
            h = h.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3)  # nearest 2x
            h = leaky(F.conv2d(F.pad(h, (1, 1, 1, 1)), he(32, 32, 3, 3, fan_in=32 * 9)))
        h = torch.tanh(F.conv2d(F.pad(h, (1, 1, 1, 1)), he(ch, 32, 3, 3, fan_in=32 * 9)))
        x = F.interpolate(h, size=(height, width), mode="bilinear", align_corners=False)
    dims = [0, *range(2, x.dim())]
    mean = x.mean(dim=dims, keepdim=True)
    std = ((x - mean) ** 2).sum(dim=dims, keepdim=True).div(x.numel() / x.shape[1] - 1).sqrt()
    return (x - mean) / std, labels


@pytest.mark.parametrize(("shape", "upsamplings"), [((6,), 0), ((3, 8, 8), 1), ((2, 6, 12), 2), ((1, 28, 28), 3)])
def test_the_virtual_data_is_the_documented_generators_output(monkeypatch, shape, upsamplings):
    """The generator's stream is replaced by a plain seeded one (its name is not what is tested), then every
    layer is compared with the reference: the latent noise per sample, the He scales, LeakyReLU's 0.2, the
    nearest upsampling until the size reaches max(H, W) (8 x 8: once; 6 x 12: twice, then resized), the
    convolutions' 3 x 3 kernels and padding 1."""
    monkeypatch.setattr(vhl_module, "method_generator", lambda seed, name: torch.Generator().manual_seed(seed + 7))
    x, y = generate_virtual(3, shape, num_classes=4, per_class=5)
    ref_x, ref_y = reference_virtual(10, shape, 4, 5, upsamplings)
    assert x.shape == (20, *shape) and torch.equal(y, ref_y)
    torch.testing.assert_close(x, ref_x, rtol=1e-4, atol=1e-5)


def test_virtual_samples_of_a_class_differ():
    """Each sample has its own latent noise ``0.3 eps`` around its class mean: no two samples are equal."""
    x, _ = generate_virtual(0, (6,), num_classes=3, per_class=4)
    assert torch.pdist(x).min() > 1e-3


# --------------------------------------------------------------------------- supervised contrastive loss
def supcon_by_definition(features: torch.Tensor, labels: torch.Tensor, t: float) -> float:
    """Khosla et al.'s ``L^sup_out``, one view, by its definition: loops over anchors and positives."""
    z = F.normalize(features.double(), dim=1)
    n, total = len(z), 0.0
    for i in range(n):
        positives = [p for p in range(n) if p != i and labels[p] == labels[i]]
        denominator = sum(math.exp(z[i] @ z[a] / t) for a in range(n) if a != i)
        if positives:
            total += -sum(math.log(math.exp(z[i] @ z[p] / t) / denominator) for p in positives) / len(positives)
    return total / n


def test_the_contrastive_loss_averages_over_each_anchors_positives():
    """Classes of three and two samples and a lone one: an anchor's log-probabilities are averaged over its
    positives (divided by their number, here 2 or 1), then over all anchors."""
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(6, 5, generator=gen)
    labels = torch.tensor([0, 0, 0, 1, 1, 2])
    for t in (1.0, 0.3):
        got = supervised_contrastive_loss(features, labels, t).item()
        assert got == pytest.approx(supcon_by_definition(features, labels, t), rel=1e-5)
    # by hand: three equal class-0 features and one orthogonal (class 1), temperature 1. Each class-0 anchor has
    # 2 positives (cos 1) over the denominator e + e + 1; the class-1 anchor none (counts 0)
    features = torch.tensor([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0], [0.0, 1.0]])
    expected = 3 * -(1 - math.log(2 * math.e + 1)) / 4
    got = supervised_contrastive_loss(features, torch.tensor([0, 0, 0, 1]), 1.0).item()
    assert got == pytest.approx(expected, rel=1e-6)


# --------------------------------------------------------------------------- draws, set-up, refusals
def test_draws_cover_the_whole_virtual_set_uniformly():
    """Indices are uniform on ``[0, C * (num_virtual // C))``: the first and the last virtual sample are drawn."""
    _, algo, _, ctx = ready({"num_virtual": 31, "virtual_batch": 3000})
    (stage,) = algo.stages(ctx)
    picks = stage.draws(torch.Generator().manual_seed(0), 7)[PICK]
    counts = torch.bincount(picks, minlength=30)
    assert len(counts) == 30 and counts.min() > 50 and counts.max() < 150  # expected 100 each


def test_as_many_virtual_samples_as_classes_is_allowed_and_fewer_refused_with_the_whole_message():
    setup = tiny_setup()
    algo = build_algorithm("vhl", {"num_virtual": 3}, setup)
    assert algo.hp.num_virtual == 3
    with pytest.raises(ConfigError) as err:
        build_algorithm("vhl", {"num_virtual": 2}, setup)
    assert str(err.value) == "algorithm.num_virtual = 2: must be >= the number of classes (3)"


def test_virtual_data_without_the_clients_inputs_is_refused_with_the_whole_message():
    setup = tiny_setup()
    algo = build_algorithm("vhl", {"num_virtual": 30}, setup)
    ctx = ClientContext(0, 1, 9, 0.1, {}, {})
    with pytest.raises(ValueError) as err:
        algo.begin(ctx)
    assert str(err.value) == "vhl needs the client's inputs (ClientContext.inputs) to shape the virtual data"


def test_the_virtual_data_takes_the_inputs_dtype():
    """float64 inputs (a float64 run) get float64 virtual data: the float32 generator's output, cast."""
    x = torch.randn(9, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    setup, _, _, ctx = ready(x=x)
    assert ctx.extras[VIRTUAL_X].dtype == torch.float64
    expected, _ = generate_virtual(setup.seed, (4,), 3, 10)
    assert torch.equal(ctx.extras[VIRTUAL_X], expected.double())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_virtual_data_and_classifier_live_on_the_models_device():
    x = torch.randn(9, 4, generator=torch.Generator().manual_seed(0)).cuda()
    setup = tiny_setup()
    algo = build_algorithm("vhl", {"num_virtual": 30}, setup)
    server = algo.init_server({k: v.cuda() for k, v in initial_state(setup).items()})
    assert all(server.model[n].device.type == "cuda" for n in algo.head_names())
    ctx = ClientContext(0, 1, 9, 0.1, server.model, {}, inputs=lambda: Batch(x, torch.arange(9).cuda() % 3))
    extras = algo.begin(ctx)
    assert extras[VIRTUAL_X].device.type == "cuda" and extras[VIRTUAL_Y].device.type == "cuda"
    features = torch.randn(5, 3, device="cuda")
    assert supervised_contrastive_loss(features, torch.tensor([0, 0, 1, 1, 2], device="cuda"), 0.5).isfinite()


def test_the_virtual_classifier_is_drawn_from_its_own_stream_of_the_run_seed():
    """The virtual classes' rows come from the run seed's ``vhl.classifier`` stream, not torch's global one: the
    same head whatever the global generator's state, another head for another run seed; PyTorch's default
    initialisation ``U(-1/sqrt(d), 1/sqrt(d))`` (d = 8 features)."""
    setup = tiny_setup()
    state = initial_state(setup)
    heads = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        heads.append(build_algorithm("vhl", {"num_virtual": 30}, setup).init_server(state).model)
    for name in (HEAD + "weight", HEAD + "bias"):
        assert torch.equal(heads[0][name], heads[1][name])
        assert heads[0][name].abs().max() <= 1 / math.sqrt(8)
    other = tiny_setup()
    other.seed = 1
    again = build_algorithm("vhl", {"num_virtual": 30}, other).init_server(state).model
    assert not torch.equal(again[HEAD + "weight"], heads[0][HEAD + "weight"])


def test_the_memory_estimate_is_two_copies_of_the_virtual_set_and_of_a_virtual_batch():
    """Bytes of the virtual set as generated (float32), twice, and of a step's virtual batch (its own size, or
    the run's batch size when 0), twice."""
    for params, batch in (({}, 10), ({"virtual_batch": 7}, 7)):
        _, algo, _, ctx = ready(params, batch_size=10)
        x_v = ctx.extras[VIRTUAL_X]
        one = x_v.element_size() * x_v[0].numel()
        assert algo.memory_needs((4,), 8) == [
            ("algorithm.num_virtual", 30, 2 * one * 30, "VHL's virtual dataset (30 samples)"),
            ("algorithm.virtual_batch", params.get("virtual_batch", 0), 2 * one * batch,
             f"VHL's virtual batch of {batch} samples")]


def test_without_the_virtual_contrast_the_loss_has_no_such_part():
    """``virtual_weight = 0`` drops the virtual-only term: not computed, not logged."""
    _, algo, _, ctx = ready({"virtual_weight": 0.0})
    batch = Batch(torch.randn(5, 4, generator=torch.Generator().manual_seed(2)), torch.tensor([0, 1, 2, 1, 0]),
                  draws={PICK: torch.tensor([0, 11, 25, 3])})
    loss, metrics = algo.loss(algo.start_state(ctx), batch, ctx)
    assert set(metrics) == {"ce", "virtual_ce", "align"}
    assert loss.item() == pytest.approx((metrics["ce"] + metrics["virtual_ce"] + metrics["align"]).item(), rel=1e-6)
