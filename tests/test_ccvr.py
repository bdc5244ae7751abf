"""CCVR as a post-hoc step: composition, calibration effect, consistency of the feature transform."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hetfl import config
from hetfl.algorithms import build_posthoc, hyperparameters
from hetfl.algorithms.base import FEATURE_BETA, ServerState, relu_tukey
from hetfl.engine.experiment import Experiment
from hetfl.params import ConfigError
from tests.helpers import initial_state, needs_shared_data, tiny_setup

MNIST = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "mnist"
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


def test_relu_tukey():
    z = torch.tensor([-1.0, 0.0, 4.0])
    assert relu_tukey(z, 0.5).tolist() == [0.0, 0.0, 2.0]
    assert torch.allclose(relu_tukey(z, 0.0)[2], torch.log(torch.tensor(4.0 + 1e-6)))


def test_calibration_replaces_only_the_classifier_and_records_the_transform():
    setup = tiny_setup()
    (step,) = build_posthoc("fedavg+ccvr", {"ccvr": {"num_virtual": 20, "epochs": 2}}, setup)
    server = ServerState(initial_state(setup))
    gen = torch.Generator().manual_seed(0)
    replies = {}
    for c in range(3):
        feats = torch.randn(30, 8, generator=gen) + c
        labels = torch.randint(0, 2, (30,), generator=gen)  # class 2 never occurs
        replies[c] = step.client_query(server.model, feats, labels)
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


@needs_shared_data
@pytest.mark.parametrize("trainer", ["fedavg", "moon"])
def test_ccvr_composes_and_raises_accuracy_under_label_skew(trainer, tmp_path):
    cfg = config.load(None, [*SKEWED, f"algorithm.name={trainer}+ccvr"])
    summary = Experiment(cfg).run(tmp_path / "run")
    before, after = summary["final_global_acc_before_ccvr"], summary["final_global_acc"]
    assert after > before + 0.02, (before, after)
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert line["ccvr_floats_per_client"] > 0 and line["ccvr_virtual_features"] == 1000
