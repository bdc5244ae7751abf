"""A bf16 step's bfloat16 weight copies (``hetfl.models.low_precision``): autocast's values, two casts a model call.

The step with copies must give autocast's step to the bit (the same roundings, the same kernels, each model
call's weight gradient summed into its float32 master as autocast's per-use casts are), in the sequential
step, the vmapped one and every path of the vectorised executor (views, gathered rows, one-row steps, the
static buffers of the CUDA-graph path), for methods that read the weights outside the model (FedProx, FedDyn),
call the model twice (MOON) or transform gradients (SCAFFOLD); and its casts must not grow with the layers.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import vmap

from hetfl import config
from hetfl.algorithms.base import Batch, ClientContext, ModelCaller, Stage, cross_entropy
from hetfl.algorithms.ccvr import FEATURE_BETA
from hetfl.algorithms.classifier_reg import CLASSIFIER_NORM
from hetfl.engine import vectorized
from hetfl.engine.experiment import Experiment
from hetfl.engine.local import autograd_grad, functional_grad, low_copies, step_gradients, train_client
from hetfl.engine.vectorized import VectorizedCache, train_clients_vectorized
from hetfl.models import build_model
from hetfl.models.low_precision import _CastUp, low_precision_names
from hetfl.optim import SGDConfig
from tests.engine.test_engine import crash_in_round_3_and_resume, metrics, quick
from tests.helpers.executors import SYNTHETIC, round_contexts
from tests.helpers.ops import OpCounter


def plain(model: ModelCaller):
    def loss(state, batch, ctx):
        return cross_entropy(model.logits(state, batch.x), batch.y), {}
    return loss


def proximal(model: ModelCaller):
    """FedProx's form: the weights read again outside the model, in float32."""
    def loss(state, batch, ctx):
        ce = cross_entropy(model.logits(state, batch.x), batch.y)
        prox = sum(((state[n] - ctx.payload[n]) ** 2).sum() for n in model.param_names)
        return ce + 0.1 * prox, {"ce": ce.detach()}
    return loss


def twice(model: ModelCaller):
    """Two model calls on the trained weights (FedBR's, VHL's form): two gradients per weight."""
    def loss(state, batch, ctx):
        first = cross_entropy(model.logits(state, batch.x), batch.y)
        return first + 0.5 * cross_entropy(model.logits(state, batch.x.flip(0)), batch.y), {}
    return loss


LOSSES = {"plain": plain, "proximal": proximal, "twice": twice}


def setup(seed: int = 0, model_name: str = "simple_cnn", **options):
    torch.manual_seed(seed)
    module = build_model(model_name, (3, 16, 16), 10, **options)
    model = ModelCaller(module)
    state = {n: t.detach().clone() for n, t in module.named_parameters()}
    state.update({n: t.detach().clone() for n, t in module.named_buffers()})
    payload = {n: t + 0.01 * torch.randn_like(t) for n, t in state.items()}
    ctx = ClientContext(client_id=0, round=1, num_samples=8, lr=0.1, payload=payload, state={})
    batch = Batch(torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,)))
    return model, state, ctx, batch


def stage_of(model: ModelCaller, loss: str, trainable: tuple[str, ...] | None = None) -> Stage:
    return Stage("local", LOSSES[loss](model), trainable or model.param_names, SGDConfig(lr=0.1))


@pytest.mark.parametrize("loss", LOSSES)
def test_the_step_with_copies_is_autocasts_step_to_the_bit(loss):
    model, state, ctx, batch = setup()
    stage = stage_of(model, loss)
    low = low_copies(state, model.low_precision_names, "bf16")
    assert low is not None and set(low) == set(model.param_names)  # simple_cnn: convolutions and linear layers
    want = step_gradients(stage, state, batch, ctx, grad_fn=autograd_grad, precision="bf16")
    got = step_gradients(stage, state, batch, ctx, grad_fn=autograd_grad, precision="bf16", low=low)
    assert want[2].item() == got[2].item()
    for name, g in want[0].items():
        assert got[0][name].dtype == torch.float32
        assert torch.equal(got[0][name], g), name


@pytest.mark.parametrize("key", [CLASSIFIER_NORM, FEATURE_BETA])
def test_a_head_transform_reads_the_float32_classifier_as_under_autocast(key):
    """clsnorm's normalised rows and CCVR's transformed features: ``ModelCaller`` applies the classifier itself,
    from the state's float32 weight (normalised in float32), as under autocast; the model's own classifier call
    (its logits unused) reads the copy and gives it no gradient."""
    model, state, ctx, batch = setup()
    state[key] = torch.tensor(0.5)
    stage = stage_of(model, "plain")
    low = low_copies(state, model.low_precision_names, "bf16")
    want = step_gradients(stage, state, batch, ctx, grad_fn=autograd_grad, precision="bf16")
    got = step_gradients(stage, state, batch, ctx, grad_fn=autograd_grad, precision="bf16", low=low)
    for name, g in want[0].items():
        assert torch.equal(got[0][name], g), name


def test_frozen_weights_are_read_from_their_copies_and_get_no_gradient():
    """A stage that trains the classifier only (CCVR's calibration, FedBABU's fine-tuning): the frozen layers'
    forward casts are gone too, and one multi-tensor copy casts the classifier's two gradients up."""
    model, state, ctx, batch = setup()
    stage = stage_of(model, "proximal", ("classifier.weight", "classifier.bias"))
    low = low_copies(state, model.low_precision_names, "bf16")
    with OpCounter() as autocast:
        want = step_gradients(stage, state, batch, ctx, grad_fn=autograd_grad, precision="bf16")
    with OpCounter() as copies:
        got = step_gradients(stage, state, batch, ctx, grad_fn=autograd_grad, precision="bf16", low=low)
    assert set(got[0]) == set(want[0]) == {"classifier.weight", "classifier.bias"}
    for name, g in want[0].items():
        assert torch.equal(got[0][name], g), name
    frozen = len(low) - 2
    assert autocast.ops["aten._to_copy"] - copies.ops["aten._to_copy"] == frozen + 2 * 2
    assert copies.ops["aten._foreach_copy_"] == 1


@pytest.mark.parametrize("loss", LOSSES)
def test_the_vmapped_step_with_copies_is_autocasts_to_the_bit(loss):
    model, state, ctx, batch = setup()
    stage = stage_of(model, loss)
    rows = {n: torch.stack([t, t * 0.9, t * 1.1]) for n, t in state.items()}
    xs, ys = torch.stack([batch.x, batch.x.flip(0), -batch.x]), torch.stack([batch.y, batch.y.flip(0), batch.y])
    low = low_copies(rows, model.low_precision_names, "bf16")

    def one(state_c, x, y, low_c):  # type: ignore[no-untyped-def]
        return step_gradients(stage, state_c, Batch(x, y), ctx, grad_fn=functional_grad, precision="bf16",
                              low=low_c)

    want = vmap(one, in_dims=(0, 0, 0, None))(rows, xs, ys, None)
    got = vmap(one)(rows, xs, ys, low)
    for name, g in want[0].items():
        assert torch.equal(got[0][name], g), name


def test_only_the_layers_that_autocast_casts_get_copies():
    """BatchNorm's weights stay float32 (autocast keeps them so); convolutions and linear layers get copies."""
    module = build_model("resnet18", (3, 32, 32), 10)
    names = low_precision_names(module)
    layers = {n for n, m in module.named_modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))}
    norms = {n for n, m in module.named_modules() if isinstance(m, torch.nn.BatchNorm2d)}
    assert layers and norms
    assert {p.rsplit(".", 1)[0] for p in names} == layers
    assert set(names) == {n for n, _ in module.named_parameters() if n.rsplit(".", 1)[0] in layers}
    assert not low_precision_names(torch.nn.Sequential(torch.nn.BatchNorm1d(4)))


class SharedWeight(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.b.weight = self.a.weight


def test_a_weight_two_layers_share_gets_no_copy():
    """Autocast casts it twice and sums its two gradients in float32; a copy would sum them in bfloat16."""
    assert low_precision_names(SharedWeight()) == ("a.bias", "b.bias")


def casts_per_round(hidden: list[int], copies: bool) -> tuple[int, int]:
    """(casts, steps run: the SGD updates) of one vectorised bf16 round of an MLP of hidden widths ``hidden``."""
    exp = Experiment(config.load(None, [*SYNTHETIC, "train.clients_per_round=4", "train.local_steps=3",
                                        f"model.options={{hidden = {hidden}}}", "train.precision=bf16"]))
    if not copies:
        exp.algorithm.model.low_precision_names = ()
    ctxs = round_contexts(exp, exp.initial_server(), {}, 1)
    with OpCounter() as counter:
        out = train_clients_vectorized(exp.algorithm, ctxs, exp.data, seed=0, train_cfg=exp.cfg.train,
                                       step_mode="static")
    assert max(r.steps for r in out) == 3
    return counter.ops["aten._to_copy"] + counter.ops["aten._foreach_copy_"], counter.ops["aten._foreach_sub_"]


def test_a_steps_casts_do_not_grow_with_the_layers():
    """With copies a step casts the input and the logits, its weights' gradients up (one multi-tensor copy)
    and refreshes the copies (one more): the same for 1 hidden layer and for 4; autocast casts each weight
    and each weight gradient, 2 more casts a step for each layer's weight and bias (12 for 3 more layers)."""
    shallow, steps = casts_per_round([16], copies=True)
    deep, deep_steps = casts_per_round([16, 16, 16, 16], copies=True)
    assert steps == deep_steps > 0
    assert deep == shallow
    shallow_autocast, _ = casts_per_round([16], copies=False)
    deep_autocast, _ = casts_per_round([16, 16, 16, 16], copies=False)
    assert deep_autocast - shallow_autocast == steps * 12
    assert shallow < shallow_autocast


VECTORISED = [*SYNTHETIC, "train.clients_per_round=6", "train.local_epochs=2", "model.options={hidden = [32, 32]}",
              "train.momentum=0.9", "train.precision=bf16"]


def train_round(exp: Experiment, executor: str) -> list:
    ctxs = round_contexts(exp, exp.initial_server(), {}, 1)
    if executor == "sequential":
        return [train_client(exp.algorithm, ctx, exp.data, seed=0, train_cfg=exp.cfg.train) for ctx in ctxs]
    return train_clients_vectorized(exp.algorithm, ctxs, exp.data, seed=0, train_cfg=exp.cfg.train,
                                    step_mode=executor)


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "feddyn", "scaffold", "moon"])
def test_the_round_with_copies_is_autocasts_to_the_bit(method):
    """The sequential executor and every path of the vectorised one (views, gathered short batches, one-row
    steps; eager and the static buffers of the CUDA-graph path) give the autocast round's states, losses and
    metrics, with the same rounding."""
    exp = Experiment(config.load(None, [*VECTORISED, f"algorithm.name={method}"]))
    names = exp.algorithm.model.low_precision_names
    assert names
    for executor in ("sequential", "eager", "static"):
        runs = []
        for low in (names, ()):
            exp.algorithm.model.low_precision_names = low
            runs.append(train_round(exp, executor))
        for a, b in zip(*runs, strict=True):
            assert (a.steps, a.loss_sum, a.metric_sums) == (b.steps, b.loss_sum, b.metric_sums)
            for name in a.state:
                assert torch.equal(a.state[name], b.state[name]), f"{method} ({executor}): {name}"


@pytest.mark.parametrize("executor", [[], ["runtime.executor=vectorized", "runtime.vmap_on_cpu=true"]])
def test_a_bf16_run_resumes_to_the_bit(executor, tmp_path, monkeypatch):
    """The copies are derived state, made at each round's start: a resumed bf16 run is the uninterrupted one."""
    cfg = quick("train.rounds=3", "data.options={max_samples = 150}", "train.clients_per_round=6",
                "model.options={hidden = [16]}", "train.local_steps=3", "train.precision=bf16", *executor)
    Experiment(cfg).run(tmp_path / "full")
    crash_in_round_3_and_resume(cfg, tmp_path / "crashed", monkeypatch)
    assert metrics(tmp_path / "crashed") == metrics(tmp_path / "full")


def test_kept_buffers_copy_each_rounds_start_states():
    """With a cache (the CUDA-graph path's, here in static mode) a group's buffers, copies included, are kept
    across rounds and loaded with each round's start states: round 2 reads the copies of its own start."""
    exp = Experiment(config.load(None, [*VECTORISED, "algorithm.name=fedavg"]))
    names = exp.algorithm.model.low_precision_names
    runs = []
    for low in (names, ()):
        exp.algorithm.model.low_precision_names = low
        cache = VectorizedCache()
        for round_ in (1, 2):
            ctxs = round_contexts(exp, exp.initial_server(), {}, round_)
            out = train_clients_vectorized(exp.algorithm, ctxs, exp.data, seed=0, train_cfg=exp.cfg.train,
                                           step_mode="static", cache=cache)
        assert len(cache.buffers) == 1  # kept from round 1
        runs.append(out)
    for a, b in zip(*runs, strict=True):
        for name in a.state:
            assert torch.equal(a.state[name], b.state[name]), name


def test_the_memory_probe_counts_a_clients_copies(monkeypatch):
    """What each further client of a vmapped group adds includes its row of bfloat16 copies (half its weights'
    float32 bytes); the probe's arithmetic on the CPU, with CUDA's memory counters standing in."""
    exp = Experiment(config.load(None, [*VECTORISED, "algorithm.name=fedavg"]))
    ctx = round_contexts(exp, exp.initial_server(), {}, 1)[0]
    ctx.extras = exp.algorithm.begin(ctx)
    plan = vectorized.ClientPlan(ctx, exp.algorithm.stages(ctx), exp.algorithm.start_state(ctx))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1_000)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 5_000)
    names = exp.algorithm.model.low_precision_names
    settings = {"batch_size": 16, "drop_last": False, "max_grad_norm": 0.0, "buffers": (), "precision": "bf16",
                "low_names": names}
    state_bytes = sum(t.nbytes for t in plan.start.values())
    copy_bytes = sum(plan.start[n].nbytes for n in names) // 2
    assert copy_bytes > 0
    assert vectorized.probe_client_bytes(plan, exp.data, seed=0, **settings) == 4_000 + state_bytes + copy_bytes


def test_the_cast_up_of_gradients_is_differentiable_back_to_bfloat16():
    """``_CastUp`` (the bf16 weight gradients cast up in one multi-tensor copy) is itself differentiable as a
    cast is: float32 values of the bfloat16 inputs forward, the gradient cast back down to bfloat16 backward
    (a second-order method differentiating through a bf16 step would read it)."""
    gen = torch.Generator().manual_seed(0)
    g1 = torch.randn(3, generator=gen).to(torch.bfloat16).requires_grad_()
    g2 = torch.randn(2, 2, generator=gen).to(torch.bfloat16).requires_grad_()
    up1, up2 = _CastUp.apply(g1, g2)
    assert (up1.dtype, up2.dtype) == (torch.float32, torch.float32)
    assert torch.equal(up1, g1.detach().float()) and torch.equal(up2, g2.detach().float())
    w1, w2 = torch.randn(3, generator=gen), torch.randn(2, 2, generator=gen)
    ((up1 * w1).sum() + (up2 * w2).sum()).backward()
    assert g1.grad.dtype == g2.grad.dtype == torch.bfloat16
    assert torch.equal(g1.grad, w1.to(torch.bfloat16)) and torch.equal(g2.grad, w2.to(torch.bfloat16))
