"""CCVR as a post-hoc step: composition, calibration effect, consistency of the feature transform."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hetfl import config
from hetfl.algorithms import build_posthoc, hyperparameters
from hetfl.algorithms.base import ServerState
from hetfl.algorithms.ccvr import FEATURE_BETA, relu_tukey
from hetfl.algorithms.posthoc import ClassifierTraining, retrain_classifier, stream
from hetfl.engine.experiment import Experiment
from hetfl.params import ConfigError
from tests.helpers import initial_state, needs_shared_data, tiny_setup

MNIST = Path(__file__).resolve().parents[3] / "shared" / "datasets" / "mnist"
SKEWED = [
    "data.dataset=mnist", f"data.root={MNIST}", "data.download=false", "data.partition=dirichlet",
    "data.alpha=0.05", "data.min_size=0", "data.num_clients=10", "model.name=mlp", "model.options={hidden = [64]}",
    "train.rounds=2", "runtime.progress=false",
]


def test_step_settings_are_validated():
    hyperparameters("fedavg+ccvr", {"ccvr": {"num_virtual": 5}})
    with pytest.raises(ConfigError, match="algorithm.ccvr.colour"):
        hyperparameters("fedavg+ccvr", {"ccvr": {"colour": 1}})
    with pytest.raises(ConfigError, match="algorithm.ccvr.num_virtual"):
        hyperparameters("moon+ccvr", {"ccvr": {"num_virtual": 0}})


def test_virtual_features_that_cannot_fit_in_memory_are_refused_before_training(tmp_path, capsys):
    """``algorithm.ccvr.num_virtual`` draws num_virtual x classes virtual features of the feature dimension
    (float64): a count no machine can hold is refused when the run is set up, naming the key, exit 2, nothing
    written. It once trained every round, wrote the run folder and then died in the calibration with torch's
    'DefaultCPUAllocator: can't allocate memory' traceback (exit 1)."""
    from hetfl.cli import main

    out = tmp_path / "r"
    sets = ["data.partition=iid", "data.num_clients=4", "data.options={num_devices = 8, max_samples = 60}",
            "train.rounds=1", "model.options={hidden = [8]}", "algorithm.name=fedavg+ccvr",
            "algorithm.ccvr.num_virtual=1000000000"]
    assert main(["run", "--out", str(out), "--quiet", *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    assert "algorithm.ccvr.num_virtual = 1000000000" in err and "virtual features" in err and not out.exists()
    # the paper's largest setting on CIFAR-100 features: about a gigabyte, not refused
    import dataclasses

    setup = dataclasses.replace(tiny_setup(), num_classes=100)
    step = build_posthoc("fedavg+ccvr", {"ccvr": {"num_virtual": 1000}}, setup)[0]
    assert 0 < step.memory_needs(512)[0][2] < 2e9


@pytest.mark.parametrize("proportional", [False, True])
def test_the_virtual_features_memory_is_24_bytes_an_entry_and_the_oracle_needs_none(proportional):
    """The estimate ``memory_needs`` states, whole: num_virtual x classes draws of feature_dim entries, 24 bytes
    an entry (the float64 noise and draws, their float32 copy and its transform), named by the key and its
    value (proportional counts sum to about as many); the oracles calibrate on real features and draw none."""
    import dataclasses

    setup = dataclasses.replace(tiny_setup(), num_classes=100)
    (step,) = build_posthoc("fedavg+ccvr", {"ccvr": {"num_virtual": 1000, "proportional": proportional}}, setup)
    assert step.memory_needs(512) == [("algorithm.ccvr.num_virtual", 1000, 24 * 100_000 * 512,
                                       "CCVR's 100,000 virtual features of 512 dimensions")]
    for oracle in ("all", "per_class"):
        (real,) = build_posthoc("fedavg+ccvr", {"ccvr": {"num_virtual": 1000, "oracle": oracle}}, setup)
        assert real.memory_needs(512) == []


def test_relu_tukey():
    z = torch.tensor([-1.0, 0.0, 4.0])
    assert relu_tukey(z, 0.5).tolist() == [0.0, 0.0, 2.0]
    # beta = 0 is log(x + 1e-6): finite where ReLU gave 0
    assert torch.equal(relu_tukey(z, 0.0), torch.log(torch.tensor([0.0, 0.0, 4.0]) + 1e-6))


def test_relu_tukey_keeps_float64_features_in_float64():
    """beta is taken at the features' precision: x^0.3 of float64 features is numpy's float64 power
    (a float32 beta would give 0.30000001192... and differ in the 8th digit). Compared to 1e-13 relative,
    not bitwise: torch's and numpy's float64 pow may differ in the last bit on another CPU."""
    z = torch.tensor([0.5, 2.0, 7.0], dtype=torch.float64)
    out = relu_tukey(z, 0.3)
    assert out.dtype == torch.float64
    np.testing.assert_allclose(out.numpy(), z.numpy() ** 0.3, rtol=1e-13, atol=0)
    float32_beta = z.numpy() ** float(np.float32(0.3))
    assert np.all(np.abs(out.numpy() - float32_beta) > 1e-10 * float32_beta)  # the tolerance tells them apart


def test_head_transforms_apply_where_registered_and_an_unknown_one_is_refused():
    """The model state names its head transforms; the caller applies each registered one and
    refuses a key in their namespace that nobody registered (never silently the plain head)."""
    from hetfl.algorithms.base import without_feature_transforms
    from hetfl.algorithms.classifier_reg import CLASSIFIER_NORM

    setup = tiny_setup()
    state = initial_state(setup)
    x = torch.randn(5, 4)
    with torch.no_grad():
        z = setup.model.module.features(x)
        w, b = state["classifier.weight"], state["classifier.bias"]
        both = {**state, FEATURE_BETA: torch.tensor(0.5), CLASSIFIER_NORM: torch.ones(())}
        expected = relu_tukey(z, 0.5) @ torch.nn.functional.normalize(w, dim=1).T + b
        assert torch.allclose(setup.model.logits(both, x), expected, atol=1e-6)
        raw = without_feature_transforms(both)
        assert FEATURE_BETA not in raw and CLASSIFIER_NORM in raw  # only the feature transform goes
        with pytest.raises(KeyError, match="feature_transform/unknown"):
            setup.model.logits({**state, "feature_transform/unknown": torch.ones(())}, x)


def test_calibration_replaces_only_the_classifier_and_records_the_transform():
    setup = tiny_setup()
    (step,) = build_posthoc("fedavg+ccvr", {"ccvr": {"num_virtual": 20, "epochs": 2}}, setup)
    server = ServerState(initial_state(setup))
    gen = torch.Generator().manual_seed(0)
    replies = {}
    for c in range(3):
        feats = torch.randn(30, 8, generator=gen) + c
        labels = torch.randint(0, 2, (30,), generator=gen)  # class 2 never occurs
        replies[c] = step.client_query(server.model, feats, labels, client=c, round_=1)
    assert replies[0]["classes"].tolist() == [0, 1]  # only the classes a client holds are uploaded
    new, info = step.apply(server, replies, round_=1)
    assert info["ccvr_virtual_features"] == 40 and info["ccvr_classes_without_virtual"] == 1
    assert not torch.equal(new.model["classifier.weight"], server.model["classifier.weight"])
    for name in setup.model.state_names:
        if not name.startswith("classifier."):
            assert torch.equal(new.model[name], server.model[name])
    assert new.model[FEATURE_BETA].item() == 0.5
    # inference applies the same ReLU + Tukey to real features before the calibrated classifier
    x = torch.randn(5, 4)
    z = setup.model.module.features(x)
    expected = relu_tukey(z, 0.5) @ new.model["classifier.weight"].T + new.model["classifier.bias"]
    with torch.no_grad():
        assert torch.allclose(setup.model.logits(new.model, x), expected.detach(), atol=1e-6)
    (plain,) = build_posthoc("fedavg+ccvr", {"ccvr": {"transform": "none", "epochs": 1}}, setup)
    assert FEATURE_BETA not in plain.apply(server, replies, 1)[0].model



def _skewed_replies(step, server, classes_by_client):
    """Client k holds 6 samples of each class in ``classes_by_client[k]`` (8-d features)."""
    gen = torch.Generator().manual_seed(4)
    replies = {}
    for k, classes in enumerate(classes_by_client):
        labels = torch.tensor(classes).repeat_interleave(6)
        feats = torch.randn(len(labels), 8, generator=gen) + k
        replies[k] = step.client_query(server.model, feats, labels, client=k, round_=1)
    return replies


def test_apply_reports_the_mean_number_of_floats_a_client_uploads():
    """Per class held: its index, count, sum of features (d = 8) and sum of outer products (8 x 8): 74 floats.
    Clients with 3 and 1 classes upload 222 and 74 floats: 148 per client on average; one client alone: its
    own 222."""
    setup = tiny_setup()
    (step,) = build_posthoc("fedavg+ccvr", {"ccvr": {"num_virtual": 5, "epochs": 1}}, setup)
    server = ServerState(initial_state(setup))
    replies = _skewed_replies(step, server, [[0, 1, 2], [1]])
    assert sum(t.numel() for t in replies[0].values()) == 3 * (1 + 1 + 8 + 64)
    _, info = step.apply(server, replies, round_=1)
    assert info["ccvr_floats_per_client"] == pytest.approx((222 + 74) / 2)
    _, info = step.apply(server, {0: replies[0]}, round_=1)
    assert info["ccvr_floats_per_client"] == pytest.approx(222)


def test_apply_keeps_the_trainers_server_state():
    """Calibration replaces the classifier only: the trainer's own server tensors (``extra``: server momentum,
    control variates, ...) go on unchanged to the next round (every_round calibration)."""
    setup = tiny_setup()
    (step,) = build_posthoc("fedavg+ccvr", {"ccvr": {"num_virtual": 5, "epochs": 1}}, setup)
    extra = {"momentum": torch.arange(3.0)}
    server = ServerState(initial_state(setup), extra=extra)
    new, _ = step.apply(server, _skewed_replies(step, server, [[0, 1], [2]]), round_=1)
    assert set(new.extra) == {"momentum"} and torch.equal(new.extra["momentum"], extra["momentum"])


def test_recalibration_without_transform_drops_an_earlier_feature_transform():
    """A model calibrated before with ReLU + Tukey (every_round) and re-calibrated with transform = none: the
    new classifier is trained on raw features, so inference must not transform them any more."""
    setup = tiny_setup()
    (tukey,) = build_posthoc("fedavg+ccvr", {"ccvr": {"num_virtual": 5, "epochs": 1}}, setup)
    (plain,) = build_posthoc("fedavg+ccvr", {"ccvr": {"num_virtual": 5, "epochs": 1, "transform": "none"}}, setup)
    server = ServerState(initial_state(setup))
    replies = _skewed_replies(tukey, server, [[0, 1], [1, 2]])
    calibrated, _ = tukey.apply(server, replies, round_=1)
    assert FEATURE_BETA in calibrated.model
    again, _ = plain.apply(calibrated, replies, round_=2)
    assert FEATURE_BETA not in again.model
    x = torch.randn(5, 4)
    expected = setup.model.module.features(x) @ again.model["classifier.weight"].T + again.model["classifier.bias"]
    with torch.no_grad():
        torch.testing.assert_close(setup.model.logits(again.model, x), expected.detach())


def _oracle_replies(step, server):
    """Three clients, 40 real features per class in all (30 of class k at client k, 10 of class k + 1)."""
    gen = torch.Generator().manual_seed(1)
    return {k: step.client_query(server.model, torch.randn(40, 8, generator=gen) + k,
                                 torch.tensor([k] * 30 + [(k + 1) % 3] * 10), client=k, round_=1) for k in range(3)}


def test_oracle_all_keeps_every_real_feature_whatever_oracle_per_class():
    setup = tiny_setup()
    (step,) = build_posthoc("fedavg+ccvr", {"ccvr": {"oracle": "all", "oracle_per_class": 5}}, setup)
    feats, labels = step.real_features(_oracle_replies(step, ServerState(initial_state(setup))),
                                       torch.Generator().manual_seed(0))
    assert [len(f) for f in feats] == [40, 40, 40] and [len(y) for y in labels] == [40, 40, 40]


def test_oracle_per_class_with_k_at_least_the_class_size_is_the_all_oracle():
    """k >= N_c leaves nothing to draw: every real feature in its order, the stream untouched, so the
    calibrated classifier equals the 'all' oracle's (k = N_c = 40 and k = 1000)."""
    setup = tiny_setup()
    server = ServerState(initial_state(setup))
    common = {"epochs": 2, "lr": 0.05, "transform": "none"}
    (everything,) = build_posthoc("fedavg+ccvr", {"ccvr": {**common, "oracle": "all"}}, setup)
    want, _ = everything.apply(server, _oracle_replies(everything, server), round_=3)
    for k in (40, 1000):
        (step,) = build_posthoc("fedavg+ccvr", {"ccvr": {**common, "oracle": "per_class", "oracle_per_class": k}},
                                setup)
        got, info = step.apply(server, _oracle_replies(step, server), round_=3)
        assert info["ccvr_virtual_features"] == 120
        torch.testing.assert_close(got.model["classifier.weight"], want.model["classifier.weight"])
        torch.testing.assert_close(got.model["classifier.bias"], want.model["classifier.bias"])


def test_oracle_per_class_draws_from_the_given_stream_only():
    """The k real features per class come from the step's generator: the same generator seed gives the same
    features whatever the global torch seed (reproducible runs), another seed other features."""
    setup = tiny_setup()
    (step,) = build_posthoc("fedavg+ccvr", {"ccvr": {"oracle": "per_class", "oracle_per_class": 7}}, setup)
    replies = _oracle_replies(step, ServerState(initial_state(setup)))
    drawn = []
    with torch.random.fork_rng(devices=[]):
        for global_seed, seed in ((0, 5), (1, 5), (0, 6)):
            torch.manual_seed(global_seed)
            feats, _ = step.real_features(replies, torch.Generator().manual_seed(seed))
            assert [len(f) for f in feats] == [7, 7, 7]
            drawn.append(torch.cat(feats))
    assert torch.equal(drawn[0], drawn[1]) and not torch.equal(drawn[0], drawn[2])


def test_apply_oracle_per_class_is_drawn_and_trained_on_the_steps_stream():
    """apply with the per-class oracle = the k features per class drawn from the step's stream of the round,
    then re-training on the same stream (independent of the global torch seed)."""
    setup = tiny_setup()
    hp = {"oracle": "per_class", "oracle_per_class": 7, "epochs": 2, "lr": 0.05, "transform": "none"}
    (step,) = build_posthoc("fedavg+ccvr", {"ccvr": hp}, setup)
    server = ServerState(initial_state(setup))
    replies = _oracle_replies(step, server)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(123)
        new, _ = step.apply(server, replies, round_=2)
    own = stream(setup, 2, "ccvr")
    feats, labels = step.real_features(replies, own)
    w, b = retrain_classifier(server.model["classifier.weight"], server.model["classifier.bias"], torch.cat(feats),
                              torch.cat(labels), ClassifierTraining(2, 0.05, 0.9, 1e-5, 64), own)
    torch.testing.assert_close(new.model["classifier.weight"], w)
    torch.testing.assert_close(new.model["classifier.bias"], b)


@pytest.mark.slow  # two end-to-end MNIST runs, 8 s
@needs_shared_data
@pytest.mark.parametrize("trainer", ["fedavg", "moon"])
def test_ccvr_composes_and_raises_accuracy_under_label_skew(trainer, tmp_path):
    cfg = config.load(None, [*SKEWED, f"algorithm.name={trainer}+ccvr"])
    summary = Experiment(cfg).run(tmp_path / "run")
    before, after = summary["final_global_acc_before_ccvr"], summary["final_global_acc"]
    assert after > before + 0.02, (before, after)
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert line["ccvr_floats_per_client"] > 0 and line["ccvr_virtual_features"] == 1000
