"""hetfl.engine.local: what the round reference and the in-place step's tests left open, found by mutation testing
(benchmarks/mutation.py, target engine_local): gradient clipping (no test reached it), the random streams a
client's round draws from, the stages' optimiser states and metrics, and the functional step's settings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hetfl import config
from hetfl.algorithms.base import Batch, ClientContext, MethodError, Stage
from hetfl.engine import local
from hetfl.engine.experiment import Experiment
from hetfl.engine.local import clip_grads, run_stages
from hetfl.optim import SGDConfig
from hetfl.rng import torch_generator
from tests.helpers.executors import round_contexts

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ clipping
def test_clipping_scales_every_gradient_by_max_norm_over_their_joint_norm():
    grads = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([[4.0]])}  # joint L2 norm 5
    clipped = clip_grads(grads, 1.0)
    scale = 1.0 / (5.0 + 1e-6)
    torch.testing.assert_close(clipped["a"], torch.tensor([3.0 * scale, 0.0]), rtol=1e-7, atol=0)
    torch.testing.assert_close(clipped["b"], torch.tensor([[4.0 * scale]]), rtol=1e-7, atol=0)
    half = clip_grads(grads, 2.5)
    torch.testing.assert_close(half["a"], torch.tensor([3.0 * 2.5 / (5.0 + 1e-6), 0.0]), rtol=1e-7, atol=0)


def test_gradients_within_the_norm_are_left_as_they_are():
    grads = {"a": torch.tensor([0.3, -0.4]), "b": torch.tensor([0.0])}  # norm 0.5
    for max_norm in (0.5 + 2e-6, 1.0, 100.0):
        out = clip_grads(grads, max_norm)
        assert torch.equal(out["a"], grads["a"]) and torch.equal(out["b"], grads["b"])
    assert clip_grads({"a": torch.zeros(3)}, 1.0)["a"].tolist() == [0.0, 0.0, 0.0]  # no 0/0


def test_the_norm_of_half_precision_gradients_is_taken_in_float32():
    # 300^2 + 400^2 overflows float16 (largest 65504): squared in float16 the norm is inf and the scale 0
    out = clip_grads({"a": torch.tensor([300.0, 400.0], dtype=torch.float16)}, 1.0)
    assert out["a"].dtype == torch.float16
    torch.testing.assert_close(out["a"], torch.tensor([0.6, 0.8], dtype=torch.float16), rtol=1e-3, atol=0)


# ------------------------------------------------------------------ the functional step and a client's stages
def sgd(lr: float = 0.1, momentum: float = 0.0) -> SGDConfig:
    return SGDConfig(lr=lr, momentum=momentum)


def linear_loss(scale: float = 1.0):  # type: ignore[no-untyped-def]
    """``scale`` times the cross-entropy of ``x @ w + b``: a matrix product, so that bfloat16 autocast shows."""

    def loss(state, batch, ctx):  # type: ignore[no-untyped-def]
        value = scale * F.cross_entropy(F.linear(batch.x, state["w"].T, state["b"]), batch.y)
        return value, {"ce": value.detach()}

    return loss


def linear_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(6, 3, generator=g), "b": torch.zeros(3)}


def linear_batch(seed: int = 1, n: int = 8) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def ctx(client: int = 0, round_: int = 1) -> ClientContext:
    return ClientContext(client, round_, 10, 0.1, {}, {})


def test_a_step_by_default_is_float32_sgd_on_the_unclipped_gradient():
    state, batch = linear_state(), linear_batch()
    stage = Stage("local", linear_loss(scale=50.0), ("w", "b"), sgd(lr=0.01))  # gradient norm far above 1
    leaves = {k: v.clone().requires_grad_() for k, v in state.items()}
    loss, _ = stage.loss(leaves, batch, ctx())
    grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True))
    assert torch.sqrt(sum((g ** 2).sum() for g in grads.values())) > 10
    new, _, got_loss, metrics = local.sgd_step(stage, state, {}, batch, ctx(), first_step=True)
    for name in ("w", "b"):
        torch.testing.assert_close(new[name], state[name] - grads[name] * 0.01, rtol=1e-6, atol=1e-7)
    want = float(loss.detach())
    assert got_loss == pytest.approx(want, rel=1e-6) and metrics["ce"] == pytest.approx(want, rel=1e-6)
    default_grads, _, _, _ = local.step_gradients(stage, state, batch, ctx())  # the gradients' defaults alike
    for name in ("w", "b"):
        torch.testing.assert_close(default_grads[name], grads[name], rtol=1e-6, atol=1e-7)
    in_place = {k: v.clone() for k, v in state.items()}
    local.sgd_step_(stage, in_place, {}, batch, ctx(), first_step=True)  # the in-place step's defaults alike
    for name in ("w", "b"):
        assert torch.equal(in_place[name], new[name])


def test_the_first_step_starts_the_momentum_buffer_at_the_gradient_whatever_the_state_held():
    state, batch = linear_state(), linear_batch()
    stage = Stage("local", linear_loss(), ("w", "b"), sgd(lr=0.1, momentum=0.9))
    stale = {name: torch.full_like(t, 5.0) for name, t in state.items()}
    _, fresh_buf, _, _ = local.sgd_step(stage, state, {n: torch.zeros_like(t) for n, t in state.items()}, batch,
                                        ctx(), first_step=True)
    new, buf, _, _ = local.sgd_step(stage, state, stale, batch, ctx(), first_step=True)
    for name in ("w", "b"):
        assert torch.equal(buf[name], fresh_buf[name])
        torch.testing.assert_close(new[name], state[name] - 0.1 * fresh_buf[name], rtol=0, atol=1e-7)
    _, later, _, _ = local.sgd_step(stage, state, stale, batch, ctx(), first_step=False)
    torch.testing.assert_close(later["w"], 0.9 * 5.0 + fresh_buf["w"], rtol=1e-6, atol=1e-6)
    in_place = {k: v.clone() for k, v in state.items()}
    stale = {name: torch.full_like(t, 5.0) for name, t in state.items()}
    local.sgd_step_(stage, in_place, stale, batch, ctx(), first_step=True)  # the in-place step alike
    for name in ("w", "b"):
        assert torch.equal(stale[name], fresh_buf[name]) and torch.equal(in_place[name], new[name])


def batchnorm_loss(state, batch, ctx):  # type: ignore[no-untyped-def]
    h = F.batch_norm(F.linear(batch.x, state["w"].T), state["rm"], state["rv"], training=True, momentum=0.1)
    value = F.cross_entropy(h + state["b"], batch.y)
    return value, {}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_functional_step_updates_the_running_buffers_and_runs_in_the_precision_asked(precision):
    state = {**linear_state(), "rm": torch.zeros(3), "rv": torch.ones(3)}
    batch = linear_batch()
    stage = Stage("local", batchnorm_loss, ("w", "b"), sgd())
    new, _, loss, _ = local.sgd_step(stage, state, {}, batch, ctx(), True, buffers=("rm", "rv"), precision=precision)
    in_place = {k: v.clone() for k, v in state.items()}
    loss_, _ = local.sgd_step_(stage, in_place, {}, batch, ctx(), True, buffers=("rm", "rv"), precision=precision)
    assert torch.equal(loss, loss_)
    for name in ("w", "b", "rm", "rv"):
        assert torch.equal(new[name], in_place[name]), name
    h = batch.x @ state["w"]
    torch.testing.assert_close(new["rm"], 0.1 * h.mean(0), rtol=0.02 if precision == "bf16" else 1e-5, atol=1e-3)
    assert torch.equal(state["rm"], torch.zeros(3))  # on a copy
    fp32, _, _, _ = local.sgd_step(stage, state, {}, batch, ctx(), True, buffers=("rm", "rv"))
    assert torch.equal(fp32["w"], new["w"]) == (precision == "fp32")


@pytest.fixture(scope="module")
def data():  # type: ignore[no-untyped-def]
    """Synthetic(1, 1)'s devices (60-dimensional inputs, 10 classes), 30 of them capped at 200 samples."""
    return Experiment(config.load(None, ["data.num_clients=30", "data.options={max_samples = 200}",
                                         "runtime.progress=false"])).data


def quadratic(name: str, target: float):  # type: ignore[no-untyped-def]
    """``sum((state[name] - target)^2)``, whatever the batch; its value logged as ``q``."""

    def loss(state, batch, ctx):  # type: ignore[no-untyped-def]
        value = (state[name] - target).square().sum()
        return value, {"q": value.detach()}

    return loss


def test_an_adversarys_step_runs_before_each_step_with_its_own_tensors_and_its_metrics_named_by_it(data):
    adversary = Stage("max", quadratic("v", -2.0), ("v",), sgd(lr=0.1))
    stage = Stage("min", quadratic("w", 1.0), ("w",), sgd(lr=0.1), steps=3, adversary=adversary)
    start = {"w": torch.tensor([0.0, 3.0]), "v": torch.tensor([1.0])}
    out = run_stages([stage], start, ctx(client=2), data, seed=0, batch_size=16, drop_last=False)
    # each step: x <- x - 0.1 * 2 (x - target) = target + 0.8 (x - target)
    torch.testing.assert_close(out.state["w"], 1.0 + 0.8 ** 3 * (start["w"] - 1.0))
    torch.testing.assert_close(out.state["v"], -2.0 + 0.8 ** 3 * (start["v"] + 2.0))
    assert out.steps == 3
    w_losses = [float(((start["w"] - 1.0) * 0.8 ** k).square().sum()) for k in range(3)]
    v_losses = [float(((start["v"] + 2.0) * 0.8 ** k).square().sum()) for k in range(3)]
    assert out.loss_sum == pytest.approx(sum(w_losses), rel=1e-6)
    assert out.metric_sums == pytest.approx({"q": sum(w_losses), "max/q": sum(v_losses)}, rel=1e-6)


def test_a_stages_draws_come_from_the_clients_draw_stream_one_set_a_batch(data):
    seen: list[torch.Tensor] = []

    def loss(state, batch, ctx):  # type: ignore[no-untyped-def]
        seen.append(batch.draws["u"].clone())
        assert len(batch.draws["u"]) == len(batch.y)
        return (state["w"] * batch.draws["u"].mean()).sum(), {}

    def draws(gen, n):  # type: ignore[no-untyped-def]
        return {"u": torch.rand(n, generator=gen)}

    stage = Stage("local", loss, ("w",), sgd(), epochs=1, draws=draws)
    client, round_, stream = 4, 3, 1
    out = run_stages([stage], {"w": torch.ones(2)}, ctx(client, round_), data, seed=7, batch_size=64, drop_last=False,
                     stream=stream)
    n = data.client_sizes[client]
    sizes = [min(64, n - start) for start in range(0, n, 64)]
    gen = torch_generator(7, "draws", round_, client, stream)
    want = [torch.rand(size, generator=gen) for size in sizes]
    assert out.steps == len(want) == len(seen) > 1
    for got, expected in zip(seen, want, strict=True):
        assert torch.equal(got, expected)


def test_draws_that_are_not_a_dict_of_tensors_are_refused_naming_the_stage_and_its_draws(data):
    stage = Stage("mixing", quadratic("w", 0.0), ("w",), sgd(), steps=1, draws=lambda gen, n: [torch.rand(n)])
    with pytest.raises(MethodError, match=r"^stage 'mixing' of quadratic: its draws must return "):
        run_stages([stage], {"w": torch.ones(2)}, ctx(), data, seed=0, batch_size=8, drop_last=False)


def test_the_batches_are_augmented_from_the_clients_augment_stream(data, monkeypatch):
    states: list[torch.Tensor] = []
    real = type(data).train_batches

    def spy(self, client, schedule, augment_gen):  # type: ignore[no-untyped-def]
        states.append(augment_gen.get_state())
        return real(self, client, schedule, augment_gen)

    monkeypatch.setattr(type(data), "train_batches", spy)
    stage = Stage("local", quadratic("w", 0.0), ("w",), sgd(), steps=2)
    run_stages([stage], {"w": torch.ones(2)}, ctx(5, 2), data, seed=3, batch_size=8, drop_last=False, stream=1)
    assert len(states) == 1
    assert torch.equal(states[0], torch_generator(3, "augment", 2, 5, 1).get_state())


def test_a_clients_stages_by_default_run_float32_sgd_on_the_unclipped_gradient(data):
    def loss(state, batch, ctx):  # type: ignore[no-untyped-def]
        return 50.0 * F.cross_entropy(F.linear(batch.x, state["w"]), batch.y), {}

    stage = Stage("local", loss, ("w",), sgd(lr=0.001), steps=2)
    start = {"w": 0.1 * torch.randn(10, data.client_tests[0].x.shape[1], generator=torch.Generator().manual_seed(0))}
    settings = {"seed": 0, "batch_size": 16, "drop_last": False}
    default = run_stages([stage], start, ctx(), data, **settings)
    explicit = run_stages([stage], start, ctx(), data, **settings, max_grad_norm=0.0, precision="fp32")
    clipped = run_stages([stage], start, ctx(), data, **settings, max_grad_norm=1.0)
    assert torch.equal(default.state["w"], explicit.state["w"])
    assert not torch.allclose(clipped.state["w"], explicit.state["w"], rtol=1e-3, atol=0)  # the norm is above 1
    bf16 = run_stages([stage], start, ctx(), data, **settings, precision="bf16")
    assert not torch.allclose(bf16.state["w"], explicit.state["w"], rtol=1e-4, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_draws_are_moved_to_the_data_and_the_losses_summed_there():
    def loss(state, batch, ctx):  # type: ignore[no-untyped-def]
        assert batch.draws["u"].device == batch.x.device == state["w"].device
        return (state["w"] * batch.draws["u"].mean()).sum(), {}

    stage = Stage("local", loss, ("w",), sgd(), steps=3, draws=lambda gen, n: {"u": torch.rand(n, generator=gen)})
    settings = ["data.num_clients=30", "data.options={max_samples = 200}", "runtime.progress=false"]
    results = {}
    for device in ("cpu", "cuda"):
        gpu_data = Experiment(config.load(None, [*settings, f"runtime.device={device}"])).data
        results[device] = run_stages([stage], {"w": torch.ones(2, device=device)}, ctx(), gpu_data, seed=0,
                                     batch_size=8, drop_last=False)
    assert results["cuda"].loss_sum == pytest.approx(results["cpu"].loss_sum, rel=1e-6)


def test_a_clients_round_runs_its_stages_with_the_train_settings_and_the_methods_buffers(monkeypatch):
    exp = Experiment(config.load(None, ["data.num_clients=30", "data.options={max_samples = 200}",
                                        "runtime.progress=false", "train.max_grad_norm=0.5", "train.precision=bf16",
                                        "train.batch_size=12", "train.drop_last=true"]))
    algo = exp.algorithm
    monkeypatch.setattr(algo, "running_buffers", lambda: ("bn.running_mean", "bn.running_var"))
    monkeypatch.setattr(algo.model, "low_precision_names", ("encoder.0.weight",))
    calls: list[tuple] = []

    def spy(stages, start, ctx, data, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((stages, start, ctx, data, kwargs))
        return local.LocalResult(start, 0, 0.0, {})

    monkeypatch.setattr(local, "run_stages", spy)
    ctx_ = round_contexts(exp, exp.initial_server(), {}, 1)[0]
    local.train_client(algo, ctx_, exp.data, seed=11, train_cfg=exp.cfg.train)
    (_, _, got_ctx, got_data, kwargs), = calls
    assert got_ctx is ctx_ and got_data is exp.data
    assert kwargs == {"seed": 11, "batch_size": 12, "drop_last": True, "max_grad_norm": 0.5,
                      "buffers": ("bn.running_mean", "bn.running_var"), "precision": "bf16",
                      "low_names": ("encoder.0.weight",)}
    # a training configuration without a precision (an older or a runtime's own) trains in float32
    bare = SimpleNamespace(batch_size=12, drop_last=False, max_grad_norm=0.0)
    local.train_client(algo, ctx_, exp.data, seed=11, train_cfg=bare)
    assert calls[-1][4]["precision"] == "fp32"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_adversarys_steps_get_the_stages_settings_as_a_by_hand_loop_of_steps(data, precision):
    """run_stages against its loop written out with sgd_step_: the same batches, and the adversary's step (FedBR's
    max step) with the clipping, running buffers and precision of the run and momentum started at its first step."""
    from hetfl.engine.schedule import batch_schedule

    def logits(state, batch):  # type: ignore[no-untyped-def]
        return F.batch_norm(F.linear(batch.x, state["w"]), state["rm"], state["rv"], training=True) + state["v"]

    def max_loss(state, batch, ctx):  # type: ignore[no-untyped-def]
        value = -F.cross_entropy(logits(state, batch), batch.y)
        return value, {"ce": -value.detach()}

    def min_loss(state, batch, ctx):  # type: ignore[no-untyped-def]
        value = F.cross_entropy(logits(state, batch), batch.y)
        return value, {"ce": value.detach()}

    adversary = Stage("max", max_loss, ("v",), sgd(lr=0.5, momentum=0.9))
    stage = Stage("min", min_loss, ("w",), sgd(lr=0.5, momentum=0.9), steps=4, adversary=adversary)
    g = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(10, 60, generator=g), "v": torch.zeros(10), "rm": torch.zeros(10), "rv": torch.ones(10)}
    settings = {"max_grad_norm": 0.05, "buffers": ("rm", "rv"), "precision": precision}
    out = run_stages([stage], start, ctx(client=2, round_=3), data, seed=5, batch_size=16, drop_last=False,
                     **settings)
    state = {k: v.clone() for k, v in start.items()}
    schedule = batch_schedule(data.client_sizes[2], 16, 1, 4, False, torch_generator(5, "batches", 3, 2, 0))
    bufs, adv_bufs = ({n: torch.zeros_like(state[n]) for n in s.trainable} for s in (stage, adversary))
    loss_sum, sums = 0.0, {"ce": 0.0, "max/ce": 0.0}
    for i, batch in enumerate(data.train_batches(2, schedule, torch_generator(5, "augment", 3, 2, 0))):
        _, adv = local.sgd_step_(adversary, state, adv_bufs, batch, ctx(2, 3), i == 0, **settings)
        loss, metrics = local.sgd_step_(stage, state, bufs, batch, ctx(2, 3), i == 0, **settings)
        loss_sum += float(loss)
        sums["ce"] += float(metrics["ce"])
        sums["max/ce"] += float(adv["ce"])
    assert out.steps == 4
    for name in start:
        assert torch.equal(out.state[name], state[name]), name
    assert out.loss_sum == pytest.approx(loss_sum, rel=1e-6)
    assert out.metric_sums == pytest.approx(sums, rel=1e-6)


def test_a_trained_tensor_the_loss_does_not_use_gets_a_zero_gradient_and_stays():
    state, batch = {**linear_state(), "unused": torch.tensor([1.5, -2.0])}, linear_batch()
    stage = Stage("local", linear_loss(), ("w", "b", "unused"), sgd(lr=0.1, momentum=0.9))
    grads, _, _, _ = local.step_gradients(stage, state, batch, ctx())
    assert torch.equal(grads["unused"], torch.zeros(2))
    new, _, _, _ = local.sgd_step(stage, state, {n: torch.zeros_like(state[n]) for n in stage.trainable}, batch,
                                  ctx(), first_step=True)
    assert torch.equal(new["unused"], state["unused"]) and not torch.equal(new["w"], state["w"])
    in_place = {k: v.clone() for k, v in state.items()}
    local.sgd_step_(stage, in_place, {n: torch.zeros_like(state[n]) for n in stage.trainable}, batch, ctx(), True)
    assert torch.equal(in_place["unused"], state["unused"])


def test_bf16_copies_are_made_of_the_named_float32_weights_the_state_holds_only():
    state = {"w": torch.randn(3, 2), "b": torch.randn(2), "count": torch.tensor(4), "half": torch.ones(2).bfloat16()}
    low = local.low_copies(state, ("w", "count", "half", "absent"), "bf16")
    assert list(low) == ["w"] and low["w"].dtype == torch.bfloat16
    assert torch.equal(low["w"], state["w"].bfloat16())
    assert local.low_copies(state, ("w",), "fp32") is None
    assert local.low_copies(state, ("count", "absent"), "bf16") is None


def test_a_broken_loss_or_gradient_transform_is_refused_naming_its_stage():
    state, batch = linear_state(), linear_batch()

    def scalar_only(state, batch, ctx):  # type: ignore[no-untyped-def]
        return state["w"].sum()  # no parts

    with pytest.raises(MethodError, match=r"^test_a_broken_loss_or_gradient_transform_is_refused_naming_its_stage"
                                          r"\.<locals>\.scalar_only \(stage 'mine'\) "):
        local.step_gradients(Stage("mine", scalar_only, ("w",), sgd()), state, batch, ctx())
    listed = Stage("mine", linear_loss(), ("w", "b"), sgd(), grad_transform=lambda grads, state, ctx: list(grads))
    with pytest.raises(MethodError, match=r"^stage 'mine' of linear_loss: its grad_transform must return "):
        local.step_gradients(listed, state, batch, ctx())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_bf16_autocasts_to_bfloat16_on_every_device(device):
    # torch.autocast's default low precision is bfloat16 on the CPU but float16 on CUDA
    with local.autocast("bf16", torch.device(device)):
        assert torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16
        out = torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)
    assert out.dtype == torch.bfloat16
    with local.autocast("fp32", torch.device(device)):
        assert not torch.is_autocast_enabled(device)


def test_in_bf16_the_weights_an_adversary_trains_are_read_fresh_by_the_next_step():
    """The bfloat16 copies of the weights (hetfl.models.low_precision) are refreshed after each step of the
    stage that trained them: an adversary training the classifier hands the next min step its new copy. The run
    against its loop written out with sgd_step_ and the same copies, through the model's caller."""
    from hetfl.engine.schedule import batch_schedule

    exp = Experiment(config.load(None, ["data.num_clients=30", "data.options={max_samples = 200}",
                                        "runtime.progress=false", "model.options={hidden = [16]}"]))
    caller, data = exp.algorithm.model, exp.data

    def ce(state, batch):  # type: ignore[no-untyped-def]
        return F.cross_entropy(caller(state, batch.x).float(), batch.y)

    adversary = Stage("max", lambda s, b, c: (-ce(s, b), {}), ("classifier.weight", "classifier.bias"), sgd(lr=0.5))
    stage = Stage("min", lambda s, b, c: (ce(s, b), {}), ("encoder.1.weight", "encoder.1.bias"), sgd(lr=0.5),
                  steps=3, adversary=adversary)
    start = {k: v.clone() for k, v in exp.initial_server().model.items()}
    names = caller.low_precision_names
    out = run_stages([stage], start, ctx(1, 1), data, seed=0, batch_size=16, drop_last=False, precision="bf16",
                     low_names=names)
    state = {k: v.clone() for k, v in start.items()}
    low = local.low_copies(state, names, "bf16")
    schedule = batch_schedule(data.client_sizes[1], 16, 1, 3, False, torch_generator(0, "batches", 1, 1, 0))
    for i, batch in enumerate(data.train_batches(1, schedule, torch_generator(0, "augment", 1, 1, 0))):
        local.sgd_step_(adversary, state, {}, batch, ctx(1, 1), i == 0, precision="bf16", low=low)
        local.sgd_step_(stage, state, {}, batch, ctx(1, 1), i == 0, precision="bf16", low=low)
    for name in start:
        assert torch.equal(out.state[name], state[name]), name


def test_the_gradient_transform_sees_the_steps_gradients_state_and_context():
    state, batch, context = linear_state(), linear_batch(), ctx(3, 2)
    seen = []

    def transform(grads, state_, ctx_):  # type: ignore[no-untyped-def]
        seen.append((state_, ctx_))
        return {k: g - state_["b"].sum() - 1.0 for k, g in grads.items()}  # SCAFFOLD-like: reads the state

    plain, _, _, _ = local.step_gradients(Stage("s", linear_loss(), ("w", "b"), sgd()), state, batch, context)
    grads, _, _, _ = local.step_gradients(Stage("s", linear_loss(), ("w", "b"), sgd(), grad_transform=transform),
                                          state, batch, context)
    assert len(seen) == 1 and seen[0][0] is state and seen[0][1] is context
    for name in ("w", "b"):
        assert torch.equal(grads[name], plain[name] - 1.0)
