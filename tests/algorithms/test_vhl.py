"""VHL (Tang et al. 2022): the seeded virtual dataset, the supervised contrastive loss, the local
loss with extra virtual classes, per-step draws, learning and vectorisation."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hetfl import config
from hetfl.algorithms import build_algorithm
from hetfl.algorithms import vhl as vhl_module
from hetfl.algorithms.base import Batch, ClientContext, Upload
from hetfl.algorithms.vhl import HEAD, PICK, VIRTUAL_X, VIRTUAL_Y, generate_virtual, supervised_contrastive_loss
from hetfl.engine.experiment import Experiment
from hetfl.params import ConfigError
from tests.helpers import SMALL_MNIST, initial_state, needs_shared_data, perturbed, tiny_setup
from tests.helpers.executors import SYNTHETIC, compare_one_round

pytestmark = pytest.mark.usefixtures("one_thread")


def ready(params: dict | None = None, client: int = 0):
    setup = tiny_setup()
    algo = build_algorithm("vhl", {"num_virtual": 30, **(params or {})}, setup)
    server = algo.init_server(perturbed(initial_state(setup), 0.3, seed=1))
    x = torch.randn(9, 4, generator=torch.Generator().manual_seed(client))
    ctx = ClientContext(client, 1, 9, 0.1, server.model, {}, inputs=lambda: Batch(x, torch.arange(9) % 3))
    ctx.extras = algo.begin(ctx)
    return setup, algo, server, ctx


# --------------------------------------------------------------------------- virtual data
def test_virtual_data_is_deterministic_for_a_seed_and_differs_across_seeds():
    x, y = generate_virtual(0, (1, 28, 28), num_classes=10, per_class=5)
    assert x.shape == (50, 1, 28, 28) and x.dtype == torch.float32
    assert y.tolist() == [c for c in range(10) for _ in range(5)]
    again, _ = generate_virtual(0, (1, 28, 28), 10, 5)
    assert torch.equal(x, again)
    other, _ = generate_virtual(1, (1, 28, 28), 10, 5)
    assert (x - other).abs().mean() > 0.1
    # standardised per channel over the whole set, like normalised real inputs
    rgb, _ = generate_virtual(0, (3, 32, 32), 10, 20)
    assert rgb.shape == (200, 3, 32, 32)
    torch.testing.assert_close(rgb.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(rgb.std(dim=(0, 2, 3)), torch.ones(3), atol=1e-4, rtol=0)
    vectors, _ = generate_virtual(0, (60,), 10, 20)
    assert vectors.shape == (200, 60) and torch.isfinite(vectors).all()
    with pytest.raises(ValueError, match="shape"):
        generate_virtual(0, (3, 8), 10, 2)


def test_virtual_data_is_generated_in_chunks_of_bounded_memory(monkeypatch):
    """The generator's activations (32 channels up to the input's size: 128 KB a 32x32 sample in float32) are
    computed a chunk of samples at a time: 20,000 virtual CIFAR samples (FedBR Table 2's VHL row) peaked at 7.9 GB
    of host memory (27.6 s) when the whole set went through each layer at once, for a 245 MB result (0.76 GB in
    chunks of 512, written into the result and standardised in place: the same tensor to the bit). The chunks
    give the whole set's tensor: the same draws (latents, then the layers' weights), the same layers, and the
    standardisation over the whole set afterwards."""
    import hetfl.algorithms.vhl as vhl

    whole, y = generate_virtual(0, (3, 32, 32), 10, 30, chunk_size=1000)
    seen: list[int] = []
    conv2d = vhl.F.conv2d

    def recording(x, *args, **kwargs):
        seen.append(x.shape[0])
        return conv2d(x, *args, **kwargs)

    monkeypatch.setattr(vhl.F, "conv2d", recording)
    chunked, y2 = generate_virtual(0, (3, 32, 32), 10, 30, chunk_size=7)
    assert seen and max(seen) == 7 and sum(seen) == 300 * 4  # three upsampling convs and the output conv
    assert torch.equal(y, y2)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=0)
    seen.clear()
    generate_virtual(0, (3, 32, 32), 10, 30)  # the default chunk
    assert max(seen) <= vhl.GENERATE_CHUNK
    with pytest.raises(ValueError, match="chunk_size"):
        generate_virtual(0, (3, 32, 32), 10, 3, chunk_size=0)


def test_virtual_classes_are_separated():
    """Each class comes from its own latent Gaussian: samples are nearer their own class mean."""
    for shape in ((1, 28, 28), (60,)):
        x, y = generate_virtual(0, shape, num_classes=10, per_class=20)
        flat = x.flatten(1)
        means = torch.stack([flat[y == c].mean(0) for c in range(10)])
        nearest = torch.cdist(flat, means).argmin(1)
        assert (nearest == y).float().mean() > 0.9, shape


# --------------------------------------------------------------------------- SupCon
def test_supervised_contrastive_loss_on_a_hand_computed_case():
    # z1 = z2 (class 0), z3 orthogonal (class 1), temperature 1:
    # anchors 1 and 2: one positive (cos 1) over {positive (1), z3 (0)}: -(1 - log(e + 1))
    # anchor 3: no positive, counts 0; the mean runs over the 3 anchors
    feats = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 3.0]])
    labels = torch.tensor([0, 0, 1])
    expected = -2 * (1 - math.log(math.e + 1)) / 3
    assert supervised_contrastive_loss(feats, labels, 1.0).item() == pytest.approx(expected, rel=1e-6)
    # temperature 0.5, a fourth sample (class 1, opposite to z1): each anchor, its positives and all others
    feats = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    labels = torch.tensor([0, 0, 1, 1])
    t = 0.5
    a1 = 1 / t - math.log(math.exp(1 / t) + math.exp(0) + math.exp(-1 / t))  # anchors 1, 2
    a3 = 0 - math.log(math.exp(0) + math.exp(0) + math.exp(0))  # anchor 3: positive 4 (cos 0)
    a4 = 0 - math.log(math.exp(-1 / t) + math.exp(-1 / t) + math.exp(0))  # anchor 4: positive 3 (cos 0)
    expected = -(2 * a1 + a3 + a4) / 4
    assert supervised_contrastive_loss(feats, labels, t).item() == pytest.approx(expected, rel=1e-6)


def test_supervised_contrastive_loss_is_finite_on_degenerate_batches():
    one = torch.randn(1, 3, requires_grad=True)
    value = supervised_contrastive_loss(one, torch.tensor([0]), 0.07)
    value.backward()
    assert value.item() == 0 and torch.count_nonzero(one.grad) == 0
    zeros = torch.zeros(3, 4, requires_grad=True)  # dead features: normalised to 0, still finite
    value = supervised_contrastive_loss(zeros, torch.tensor([0, 0, 1]), 0.07)
    value.backward()
    assert math.isfinite(value.item()) and torch.isfinite(zeros.grad).all()


def test_supervised_contrastive_loss_pulls_classes_together():
    torch.manual_seed(0)
    labels = torch.tensor([0, 1, 2] * 4)
    tight = torch.eye(3)[labels] + 0.01 * torch.randn(12, 3)
    mixed = torch.randn(12, 3)
    assert supervised_contrastive_loss(tight, labels, 0.07) < supervised_contrastive_loss(mixed, labels, 0.07)


# --------------------------------------------------------------------------- the method
def test_defaults_and_settings():
    setup = tiny_setup()
    algo = build_algorithm("vhl", {}, setup)
    hp = algo.hp
    assert (hp.num_virtual, hp.alpha, hp.align_weight, hp.virtual_weight, hp.temperature, hp.labels) == (
        2000, 1.0, 1.0, 0.1, 0.07, "extra")
    with pytest.raises(ConfigError, match="algorithm.num_virtual"):
        build_algorithm("vhl", {"num_virtual": 2}, setup)  # fewer than the 3 classes
    with pytest.raises(ConfigError, match="algorithm.labels"):
        build_algorithm("vhl", {"labels": "new"}, setup)


def test_begin_shares_one_virtual_set_shaped_like_the_inputs():
    setup, algo, _, ctx = ready()
    x_v, y_v = ctx.extras[VIRTUAL_X], ctx.extras[VIRTUAL_Y]
    assert x_v.shape == (30, 4) and y_v.tolist() == [c for c in range(3) for _ in range(10)]
    expected, _ = generate_virtual(setup.seed, (4,), 3, 10)
    assert torch.equal(x_v, expected)
    _, _, _, other = ready(client=3)
    assert torch.equal(other.extras[VIRTUAL_X], x_v)
    assert algo.begin(ctx)[VIRTUAL_X] is x_v  # generated once, the same tensor for every client


def in_cache(cache: Path, params: dict | None = None, seed: int = 0, features: int = 4):
    """A fresh VHL (as a new process builds it) whose virtual set is kept in ``cache``; its first client's set."""
    setup = dataclasses.replace(tiny_setup(), cache_dir=str(cache), seed=seed)
    algo = build_algorithm("vhl", {"num_virtual": 30, **(params or {})}, setup)
    x = torch.randn(9, features, generator=torch.Generator().manual_seed(0))
    ctx = ClientContext(0, 1, 9, 0.1, algo.init_server(initial_state(setup)).model, {},
                        inputs=lambda: Batch(x, torch.arange(9) % 3))
    return algo.begin(ctx)


def test_a_new_process_reads_the_virtual_set_its_first_one_stored(tmp_path, monkeypatch):
    """A Flower deployment starts a process for every message: each would generate the set again (30 s for
    FedBR Table 2's 20,000 CIFAR samples on a 2-core CPU). The first stores it in data.cache_dir, the others
    read it: the same tensors to the bit, no generation."""
    calls = []
    real = vhl_module.generate_virtual

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(vhl_module, "generate_virtual", counted)
    first = in_cache(tmp_path)
    assert len(calls) == 1 + len(vhl_module.PROBES)  # the set, and the digest's probes
    (entry,) = [p for p in tmp_path.iterdir() if p.name.startswith("vhl-virtual-")]
    assert (entry / "manifest.json").exists()
    expected, labels = real(0, (4,), 3, 10)
    assert torch.equal(first[VIRTUAL_X], expected) and torch.equal(first[VIRTUAL_Y], labels)
    calls.clear()
    again = in_cache(tmp_path)
    assert [c for c in calls if c[1] == (4,)] == []  # read, not generated
    assert torch.equal(again[VIRTUAL_X], expected) and torch.equal(again[VIRTUAL_Y], labels)


@pytest.mark.parametrize("change", ["seed", "shape", "size", "generator"])
def test_a_virtual_set_is_read_only_by_runs_that_would_generate_it(tmp_path, monkeypatch, change):
    """Another seed, input shape, set size or generator is a different set: never read from another's entry."""
    in_cache(tmp_path)
    kwargs: dict = {}
    if change == "seed":
        kwargs["seed"] = 1
    elif change == "shape":
        kwargs["features"] = 5
    elif change == "size":
        kwargs["params"] = {"num_virtual": 60}
    else:  # a generator that computes otherwise with the same source text (as a mutation tool's trampoline):
        leaky_relu = F.leaky_relu  # its probes give other values
        monkeypatch.setattr(vhl_module.F, "leaky_relu", lambda x, slope: leaky_relu(x, slope + 0.1))
    got = in_cache(tmp_path, **kwargs)
    seed, features = kwargs.get("seed", 0), kwargs.get("features", 4)
    per_class = 20 if change == "size" else 10
    expected, _ = vhl_module.generate_virtual(seed, (features,), 3, per_class)
    assert torch.equal(got[VIRTUAL_X], expected)
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("vhl-virtual-")]) == 2


def test_an_unwritable_cache_costs_the_generation_not_the_run(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # the cache folder cannot be made under a file (the tests may run as root)
    got = in_cache(blocked / "cache")
    assert torch.equal(got[VIRTUAL_X], generate_virtual(0, (4,), 3, 10)[0])
    assert blocked.read_text() == ""


def test_draws_pick_virtual_samples_from_the_clients_stream():
    _, algo, _, ctx = ready()
    (stage,) = algo.stages(ctx)
    picks = stage.draws(torch.Generator().manual_seed(5), 7)[PICK]
    assert picks.shape == (7,) and picks.min() >= 0 and picks.max() < 30
    assert torch.equal(picks, stage.draws(torch.Generator().manual_seed(5), 7)[PICK])
    _, algo16, _, ctx16 = ready({"virtual_batch": 16})
    assert algo16.stages(ctx16)[0].draws(torch.Generator().manual_seed(5), 7)[PICK].shape == (16,)


def test_loss_is_ce_plus_virtual_ce_plus_feature_calibration():
    setup, algo, server, ctx = ready({"alpha": 0.5, "align_weight": 0.7, "virtual_weight": 0.2, "temperature": 0.5})
    state = algo.start_state(ctx)
    assert set(algo.head_names()) == {HEAD + "weight", HEAD + "bias"}
    assert server.model[HEAD + "weight"].shape == (3, 8)  # C virtual classes on the d features
    pick = torch.tensor([0, 11, 25, 3])
    batch = Batch(torch.randn(5, 4, generator=torch.Generator().manual_seed(2)), torch.tensor([0, 1, 2, 1, 0]),
                  draws={PICK: pick})
    loss, metrics = algo.loss(state, batch, ctx)

    x_v, y_v = ctx.extras[VIRTUAL_X][pick], ctx.extras[VIRTUAL_Y][pick]
    assert y_v.tolist() == [0, 1, 2, 0]
    z, logits = setup.model.features_and_logits(state, batch.x)
    z_v, logits_v = setup.model.features_and_logits(state, x_v)

    def head(f: torch.Tensor) -> torch.Tensor:
        return F.linear(f, state[HEAD + "weight"], state[HEAD + "bias"])

    ce = F.cross_entropy(torch.cat([logits, head(z)], 1), batch.y)  # C + C_v outputs
    ce_v = F.cross_entropy(torch.cat([logits_v, head(z_v)], 1), y_v + 3)  # virtual class c is class C + c
    align = supervised_contrastive_loss(torch.cat([z, z_v]), torch.cat([batch.y, y_v]), 0.5)
    virt = supervised_contrastive_loss(z_v, y_v, 0.5)
    assert metrics["ce"].item() == pytest.approx(ce.item(), rel=1e-5)
    assert metrics["virtual_ce"].item() == pytest.approx(ce_v.item(), rel=1e-5)
    assert metrics["align"].item() == pytest.approx(align.item(), rel=1e-5)
    assert metrics["virtual_contrast"].item() == pytest.approx(virt.item(), rel=1e-5)
    assert loss.item() == pytest.approx((ce + 0.5 * ce_v + 0.7 * align + 0.2 * virt).item(), rel=1e-5)


def test_virtual_features_are_fixed_anchors_in_the_alignment_term():
    """With only the alignment term, the gradient equals that of L_SC with detached virtual features."""
    setup, algo, _, ctx = ready({"alpha": 0.0, "virtual_weight": 0.0, "labels": "shared"})
    state = algo.start_state(ctx)
    assert algo.head_names() == ()
    batch = Batch(torch.randn(4, 4, generator=torch.Generator().manual_seed(4)), torch.tensor([0, 1, 2, 0]),
                  draws={PICK: torch.tensor([1, 12, 22, 5])})
    names = setup.model.param_names
    enc = [n for n in names if not n.startswith("classifier.")]

    def grads_of(fn):
        leaves = {n: state[n].clone().requires_grad_() for n in names}
        out = fn({**state, **leaves})
        return torch.autograd.grad(out, [leaves[n] for n in enc])

    x_v, y_v = ctx.extras[VIRTUAL_X][batch.draws[PICK]], ctx.extras[VIRTUAL_Y][batch.draws[PICK]]

    def manual(s, detach):
        z, logits = setup.model.features_and_logits(s, batch.x)
        z_v, _ = setup.model.features_and_logits(s, x_v)
        z_v = z_v.detach() if detach else z_v
        return F.cross_entropy(logits, batch.y) + supervised_contrastive_loss(
            torch.cat([z, z_v]), torch.cat([batch.y, y_v]), 0.07)

    got = grads_of(lambda s: algo.loss(s, batch, ctx)[0])
    for a, b in zip(got, grads_of(lambda s: manual(s, True)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(got, grads_of(lambda s: manual(s, False)), strict=True))


def test_virtual_classifier_is_averaged_with_the_model():
    _, algo, server, ctx = ready()
    upload, _ = algo.finish(ctx, algo.start_state(ctx), 1)
    assert {HEAD + "weight", HEAD + "bias"} <= set(upload) and VIRTUAL_X not in upload  # nothing virtual is sent
    ups = [Upload(c, {k: v * s for k, v in upload.items()}, num_samples=10, steps=1) for c, s in ((0, 1.0), (1, 3.0))]
    new = algo.aggregate(server, ups, 1)
    torch.testing.assert_close(new.model[HEAD + "weight"], 2 * server.model[HEAD + "weight"])


@pytest.mark.slow  # fast cover: tests/engine/test_vectorized.py's every-method test (vhl)
def test_vectorised_equals_sequential():
    exp = Experiment(config.load(None, [*SYNTHETIC, "data.num_clients=12", "data.partition=dirichlet",
                                        "algorithm.name=vhl", "algorithm.num_virtual=200", "train.local_epochs=1"]))
    compare_one_round(exp)


@pytest.mark.parametrize("labels", ["shared", "extra"])
def test_with_its_terms_off_vhl_is_fedavg_in_the_shared_label_space(tmp_path, labels):
    """alpha = align_weight = virtual_weight = 0: in the shared label space VHL trains FedAvg's steps (the
    virtual draws come from their own stream, the virtual batch changes no real logit, the server averages as
    FedAvg) up to rounding (real and virtual rows go through the model as one batch, whose matrix products may
    round the real rows' last bits otherwise); with extra labels the real cross-entropy still runs over C + C_v
    outputs, as VHL's code (``VHL_label_style = "extra"``), so the numbers differ."""
    small = ["data.num_clients=4", "data.partition=dirichlet", "data.options={max_samples = 120}", "train.rounds=2",
             "train.batch_size=16", "runtime.progress=false", "model.options={hidden = [16]}"]
    off = ["algorithm.name=vhl", "algorithm.num_virtual=60", "algorithm.alpha=0", "algorithm.align_weight=0",
           "algorithm.virtual_weight=0", f"algorithm.labels={labels}", f"data.cache_dir={tmp_path / 'cache'}"]
    Experiment(config.load(None, [*small, *off])).run(tmp_path / "vhl")
    Experiment(config.load(None, [*small, "algorithm.name=fedavg"])).run(tmp_path / "fedavg")

    def curve(run, key):
        return [json.loads(x)[key] for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    for key in ("train_loss", "global_loss", "client_acc_mean"):
        vhl, fedavg = curve("vhl", key), curve("fedavg", key)
        if labels == "shared":
            assert vhl == pytest.approx(fedavg, rel=1e-5, abs=1e-7), key
        elif key == "train_loss":
            assert all(abs(a - b) > 1e-3 for a, b in zip(vhl, fedavg, strict=True)), (vhl, fedavg)


@needs_shared_data
def test_vhl_learns(tmp_path):
    cfg = config.load(None, [*SMALL_MNIST, "algorithm.name=vhl", "algorithm.num_virtual=500"])
    summary = Experiment(cfg).run(tmp_path)
    detail = json.dumps({k: v for k, v in summary.items() if k != "config"})
    assert summary["final_global_acc"] > 0.6, detail  # chance: about 0.1
    assert summary["final_client_acc_mean"] > 0.6, detail
    assert summary["bytes_down_total"] == summary["bytes_up_total"]  # the virtual data cost no traffic
