"""The Algorithm base class and its helpers (``hetfl.algorithms.base``), checked directly: the loss contract's
refusals (whole messages), head transforms (registration, application, the unknown-key refusal), the model
caller, the run's SGD settings, cross-entropy's half-precision inputs, FedAvg's weighted mean, the model parts a
method may require, the privacy ledger's hooks and every FedAvg default hook."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetfl.algorithms import base
from hetfl.algorithms.base import (
    Algorithm,
    Batch,
    ClientContext,
    HeadTransform,
    MethodError,
    ModelCaller,
    NoHyper,
    PrivateReleases,
    ServerState,
    Stage,
    Upload,
    check_loss_output,
    cross_entropy,
    model_provides,
    register_head_transform,
    weighted_mean,
    without_feature_transforms,
)
from hetfl.optim import SGDConfig
from tests.helpers import initial_state, perturbed, tiny_setup

CONTRACT = ("must return (loss, parts): a scalar tensor and a dict of name -> tensor, each part logged as "
            "train_<name>, e.g. `return ce + w * pen, {\"ce\": ce.detach(), \"pen\": pen.detach()}`")
ONE = torch.tensor(1.0)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal dtype and shape, values within float32 rounding. (``torch.testing.assert_close`` imports sympy on its
    first call, seconds on a loaded machine: under mutation testing, where each mutant runs a few tests in a fresh
    process, that alone passed mutmut's time limit.)"""
    assert got.dtype == want.dtype and got.shape == want.shape, (got, want)
    assert torch.allclose(got, want, rtol=1.3e-6, atol=1e-5), (got, want)


def my_loss(state, batch, ctx):  # type: ignore[no-untyped-def]
    return ONE, {}


def local_stage(loss=my_loss) -> Stage:  # type: ignore[no-untyped-def]
    return Stage("local", loss, (), SGDConfig(0.1))


# --------------------------------------------------------------------------- the loss contract
@pytest.mark.parametrize(("out", "what"), [
    (ONE, "it returned a Tensor"),
    ((ONE,), "it returned a tuple of 1"),
    ((ONE, {}, {}), "it returned a tuple of 3"),
    ([ONE, {}], "it returned a list"),
    ((torch.ones(2), {}), "its loss is a tensor of shape (2,) (a mean over the batch is a scalar)"),
    ((1.5, {}), "its loss is a float (a mean over the batch is a scalar)"),
    ((ONE, [ONE]), "its parts are a list"),
    ((ONE, {"ce": ONE, "l2": 0.5}), "its part 'l2' is a float (`.item()` reads a value on the host: return "
                                    "`x.detach()`, a loss is a pure tensor function)"),
    ((ONE, {"n": 3}), "its part 'n' is a int (`.item()` reads a value on the host: return `x.detach()`, a loss "
                      "is a pure tensor function)"),
    ((ONE, {"name": "ce"}), "its part 'name' is a str"),
])
def test_a_loss_that_breaks_the_contract_is_refused_naming_it_its_stage_and_what_it_returned(out, what):
    with pytest.raises(MethodError) as err:
        check_loss_output(local_stage(), out)
    assert str(err.value) == f"my_loss (stage 'local') {CONTRACT}; {what}"
    assert isinstance(err.value, ValueError)


def test_a_loss_without_a_name_is_called_the_loss_and_a_good_output_is_returned_as_it_is():
    unnamed = functools.partial(my_loss)  # a partial has no __qualname__
    with pytest.raises(MethodError) as err:
        check_loss_output(Stage("classifier", unnamed, (), SGDConfig(0.1)), ONE)
    assert str(err.value) == f"the loss (stage 'classifier') {CONTRACT}; it returned a Tensor"
    parts = {"ce": ONE}
    loss, got = check_loss_output(local_stage(), (ONE, parts))
    assert loss is ONE and got is parts


# --------------------------------------------------------------------------- head transforms
@pytest.fixture
def transforms(monkeypatch):
    """A private registry, so that the test's transforms never reach other tests."""
    registry = dict(base.HEAD_TRANSFORMS)
    monkeypatch.setattr(base, "HEAD_TRANSFORMS", registry)
    return registry


SCALE_FEATURES = HeadTransform("feature_transform/test_scale", features=lambda z, v: z * v)
SCALE_ROWS = HeadTransform("classifier_transform/test_rows", weight=lambda w, v: w + v)


def test_a_transform_registers_under_its_key_and_a_key_outside_the_namespaces_is_refused(transforms):
    assert register_head_transform(SCALE_FEATURES) is SCALE_FEATURES
    assert transforms[SCALE_FEATURES.key] is SCALE_FEATURES
    with pytest.raises(ValueError) as err:
        register_head_transform(HeadTransform("test_scale"))
    assert str(err.value) == ("head transform key 'test_scale' must start with one of "
                              "('feature_transform/', 'classifier_transform/')")
    assert "test_scale" not in transforms


class BiasFree(nn.Module):
    """4 -> 3 encoder (ReLU), 3 -> 2 classifier without bias."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
        self.classifier = nn.Linear(3, 2, bias=False)

    def forward(self, x, return_features: bool = False):  # type: ignore[no-untyped-def]
        z = self.encoder(x)
        return (z, self.classifier(z)) if return_features else self.classifier(z)


@pytest.mark.parametrize("bias", [True, False])
def test_the_caller_applies_each_registered_transform_of_the_state(transforms, bias):
    """A state holding a transform's key gets its features and rows transformed (the classifier's bias kept,
    none for a bias-free classifier); method tensors in the state are ignored."""
    register_head_transform(SCALE_FEATURES)
    register_head_transform(SCALE_ROWS)
    setup = tiny_setup()
    module = setup.model.module if bias else BiasFree()
    caller = ModelCaller(module)
    state = {**{k: v.detach().clone() for k, v in module.state_dict().items()}, "method/extra": torch.ones(5)}
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    z_raw, logits_raw = module(x, return_features=True)
    b = state.get("classifier.bias")
    assert torch.equal(caller.logits(state, x), logits_raw)
    z, logits = caller.features_and_logits(state, x)
    assert torch.equal(z, z_raw) and torch.equal(logits, logits_raw)

    both = {**state, SCALE_FEATURES.key: torch.tensor(2.0), SCALE_ROWS.key: torch.tensor(0.5)}
    z, logits = caller.features_and_logits(both, x)
    assert_close(z, 2 * z_raw)
    assert_close(logits, F.linear(2 * z_raw, state["classifier.weight"] + 0.5, b))
    assert_close(caller.logits(both, x), logits)
    rows_only = {**state, SCALE_ROWS.key: torch.tensor(-1.0)}
    z, logits = caller.features_and_logits(rows_only, x)
    assert_close(z, z_raw)
    assert_close(logits, F.linear(z_raw, state["classifier.weight"] - 1.0, b))


def test_only_the_feature_transforms_are_dropped_for_raw_features(transforms):
    register_head_transform(SCALE_FEATURES)
    register_head_transform(SCALE_ROWS)
    state = {"w": ONE, SCALE_FEATURES.key: ONE, SCALE_ROWS.key: ONE}
    assert set(without_feature_transforms(state)) == {"w", SCALE_ROWS.key}


def test_an_unregistered_transform_in_the_state_is_refused_naming_it(transforms):
    setup = tiny_setup()
    state = {**initial_state(setup), "classifier_transform/unknown": ONE, "other/key": ONE}
    with pytest.raises(KeyError) as err:
        setup.model.logits(state, torch.zeros(2, 4))
    assert err.value.args[0] == (
        "the model state holds head transform(s) ['classifier_transform/unknown'] that no loaded method "
        "registered; import the method that wrote them (e.g. hetfl.algorithms.ccvr)")


class Normed(nn.Module):
    """4 -> 3 with BatchNorm (training mode), 3 -> 2 classifier."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        self.classifier = nn.Linear(3, 2)

    def forward(self, x, return_features: bool = False):  # type: ignore[no-untyped-def]
        z = self.encoder(x)
        return (z, self.classifier(z)) if return_features else self.classifier(z)


def test_reference_features_take_no_gradient_and_leave_the_states_statistics_alone():
    module = Normed()
    caller = ModelCaller(module)
    assert caller.param_names == ("encoder.0.weight", "encoder.0.bias", "encoder.1.weight", "encoder.1.bias",
                                  "classifier.weight", "classifier.bias")
    assert caller.buffer_names == ("encoder.1.running_mean", "encoder.1.running_var",
                                   "encoder.1.num_batches_tracked")
    assert caller.state_names == caller.param_names + caller.buffer_names
    state = {k: v.detach().clone().requires_grad_(v.is_floating_point()) if k in caller.param_names else
             v.detach().clone() for k, v in module.state_dict().items()}
    before = {k: v.detach().clone() for k, v in state.items()}
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    feats = caller.reference_features(state, x)
    assert not feats.requires_grad
    for name in caller.buffer_names:
        assert torch.equal(state[name], before[name]), name
    want, _ = module(x, return_features=True)  # the module's own buffers (the same values) are updated instead
    assert_close(feats, want.detach())


# --------------------------------------------------------------------------- settings, cross-entropy, FedAvg
def test_the_runs_sgd_settings_are_overridable_per_stage_even_to_zero():
    setup = tiny_setup(momentum=0.9, weight_decay=1e-3)
    assert setup.sgd(0.2) == SGDConfig(0.2, 0.9, 1e-3)
    assert setup.sgd(0.2, momentum=0.0, weight_decay=0.0) == SGDConfig(0.2, 0.0, 0.0)
    assert setup.sgd(0.3, momentum=0.5) == SGDConfig(0.3, 0.5, 1e-3)
    assert setup.sgd(0.3, weight_decay=0.25) == SGDConfig(0.3, 0.9, 0.25)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_are_taken_to_float32(dtype):
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(0)).to(dtype)
    labels = torch.tensor([0, 1, 2, 3, 0, 1])
    got = cross_entropy(logits, labels)
    assert got.dtype == torch.float32
    assert_close(got, F.cross_entropy(logits.float(), labels))


def test_the_weighted_mean_normalises_the_weights_and_takes_integer_buffers_maximum_entry_by_entry():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3), "counts": torch.tensor([4, 0, 9])}
    b = {"w": torch.tensor([5.0, -2.0]), "n": torch.tensor(7), "counts": torch.tensor([1, 6, 2])}
    out = weighted_mean([a, b], [1, 3])
    assert_close(out["w"], torch.tensor([4.0, -1.0]))  # (a + 3 b) / 4
    assert out["n"].item() == 7 and out["n"].dtype == torch.int64
    assert out["counts"].tolist() == [4, 6, 9]  # entry by entry
    assert_close(weighted_mean([a, b], [0, 2])["w"], b["w"])  # a zero weight is allowed
    assert torch.equal(a["w"], torch.tensor([1.0, 2.0]))  # the inputs are not written to
    with pytest.raises(ValueError, match="zip"):  # one weight per state: a missing one is not silently dropped
        weighted_mean([a, b, b], [1, 3])
    for weights in ([0, 0], [1, -1], [-1, -2]):
        with pytest.raises(ValueError) as err:
            weighted_mean([a, b], weights)
        assert str(err.value) == "weighted_mean needs a positive total weight"


def test_a_model_provides_the_parts_that_hold_parameters():
    assert model_provides({"encoder": ["e.w"], "projector": [], "classifier": ["c.w"]}) == frozenset({"encoder"})
    assert model_provides({"encoder": ["e.w"], "projector": ["p.w"]}) == frozenset({"encoder", "projector"})
    assert model_provides({"classifier": ["c.w"]}) == frozenset()


# --------------------------------------------------------------------------- the privacy ledger's hooks
class Releasing(PrivateReleases):
    dp_releases_key = "dp/releases"


def test_the_releases_recorded_in_a_server_state_and_a_state_accounting_for_given_ones():
    model = {"w": ONE}
    server = ServerState(model=model, extra={"dp/releases": torch.tensor([1.5, 2.0], dtype=torch.float64),
                                             "other": ONE})
    method = Releasing()
    recorded = method.dp_recorded(server)
    assert recorded == [1.5, 2.0] and all(type(z) is float for z in recorded)
    assert method.dp_recorded(ServerState(model=model)) == []
    past = method.dp_with_past(server, [0.5])
    assert past.model is model and set(past.extra) == {"dp/releases", "other"}
    assert past.extra["dp/releases"].dtype == torch.float64 and past.extra["dp/releases"].tolist() == [0.5]
    assert server.extra["dp/releases"].tolist() == [1.5, 2.0]  # not written to
    none = method.dp_with_past(server, [])
    assert set(none.extra) == {"other"} and none.model is model
    # a method that makes no release: nothing recorded, the state as it is
    plain = PrivateReleases()
    assert plain.dp_recorded(server) == [] and plain.dp_with_past(server, [0.5]) is server
    assert plain.dp_release(None) is None and plain.privacy_notice() is None


# --------------------------------------------------------------------------- FedAvg's default hooks
def fedavg(**train):  # type: ignore[no-untyped-def]
    setup = tiny_setup(momentum=0.9, weight_decay=1e-3, **train)
    algo = Algorithm(NoHyper(), setup)
    server = algo.init_server(perturbed(initial_state(setup), 0.3, seed=1))
    return setup, algo, server


def test_the_server_hooks_default_to_fedavg():
    setup, algo, server = fedavg()
    state = initial_state(setup)
    init = algo.init_server(state)
    assert init.model is state and init.extra == {}
    assert algo.payload(server, 3) is server.model
    server = ServerState(model=server.model, extra={"kept": ONE})
    ups = [Upload(c, {k: v * s for k, v in server.model.items()}, num_samples=n, steps=1)
           for c, s, n in ((0, 1.0, 1), (1, 3.0, 3))]
    new = algo.aggregate(server, ups, 1)
    assert new.extra is server.extra
    for name, value in server.model.items():
        assert_close(new.model[name], 2.5 * value)  # (1 * 1 + 3 * 3) / 4
    assert algo.memory_needs((4,), 8) == [] and algo.run_notes() == [] and algo.round_info(server, ups, 1) == {}
    assert algo.setup_query(None) == {} and algo.setup_aggregate(server, {0: {}}) is server  # type: ignore[arg-type]
    assert not algo.has_setup_round()

    class Sharing(Algorithm):
        def setup_query(self, ctx):  # type: ignore[no-untyped-def]
            return {"x": ONE}

    assert Sharing(NoHyper(), setup).has_setup_round()


def test_the_client_hooks_default_to_fedavg():
    setup, algo, server = fedavg(local_epochs=3, local_steps=4)
    payload = {**server.model, "method/extra": ONE}
    ctx = ClientContext(2, 1, 10, 0.2, payload, {"kept": ONE})
    assert algo.init_client_state(2, server) == {} and algo.begin(ctx) == {}
    start = algo.start_state(ctx)
    assert tuple(start) == setup.model.state_names and all(start[k] is payload[k] for k in start)
    assert algo.trainable_names() == setup.model.param_names
    batch = Batch(torch.randn(5, 4, generator=torch.Generator().manual_seed(2)), torch.tensor([0, 1, 2, 1, 0]))
    loss, parts = algo.loss(start, batch, ctx)
    assert set(parts) == {"ce"} and torch.equal(parts["ce"], loss.detach())
    assert_close(loss, F.cross_entropy(setup.model.logits(start, batch.x), batch.y))
    (stage,) = algo.stages(ctx)
    assert (stage.name, stage.loss, stage.trainable) == ("local", algo.loss, setup.model.param_names)
    assert stage.sgd == SGDConfig(0.2, 0.9, 1e-3) and (stage.epochs, stage.steps) == (3, 4)
    assert stage.grad_transform is None and stage.draws is None and stage.adversary is None
    upload, state = algo.finish(ctx, {**start, "method/extra": ONE}, 7)
    assert tuple(upload) == setup.model.state_names and state is ctx.state
    assert algo.client_model(server, {}, 2) is server.model
    assert algo.predictor(start, ctx) is None and algo.personalize_stages(ctx) == []


def test_fine_tuning_stages_train_the_head_or_the_whole_model_at_their_own_or_the_runs_lr():
    setup, algo, _ = fedavg(lr=0.07)
    assert algo.finetune_stages(0, "head", 0.1) == []
    (head,) = algo.finetune_stages(2, "head", 0.0)
    assert (head.name, head.loss, head.epochs, head.steps) == ("finetune", algo.loss, 2, 0)
    assert head.trainable == ("classifier.weight", "classifier.bias") and head.sgd == SGDConfig(0.07, 0.9, 1e-3)
    (whole,) = algo.finetune_stages(1, "all", 0.3)
    assert whole.trainable == setup.model.param_names and whole.sgd == SGDConfig(0.3, 0.9, 1e-3)
    assert whole.epochs == 1
