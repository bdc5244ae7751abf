"""CCVR's side studies (Luo et al. 2021, sec. 3.3 and Table 2/10): clsnorm, clsprox,
oracle calibration on real features, calibration after every round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hetfl import config
from hetfl.algorithms import build_algorithm, build_posthoc
from hetfl.algorithms.base import Batch, ServerState
from hetfl.algorithms.classifier_reg import CLASSIFIER_NORM
from hetfl.algorithms.posthoc import ClassifierTraining, retrain_classifier, stream
from hetfl.engine.experiment import Experiment
from hetfl.engine.local import sgd_step
from tests.helpers import context, initial_state, needs_shared_data, tiny_setup

MNIST = Path(__file__).resolve().parents[3] / "shared" / "datasets" / "mnist"
X = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
Y = torch.tensor([0, 1, 2, 0, 1, 2])


def test_clsnorm_logits_use_unit_classifier_rows_in_training_and_inference():
    setup = tiny_setup()
    algo = build_algorithm("clsnorm", {}, setup)
    server = algo.init_server(initial_state(setup))
    assert CLASSIFIER_NORM in server.model
    z = setup.model.module.features(X)
    w = server.model["classifier.weight"]
    expected = z @ F.normalize(w, dim=1).T + server.model["classifier.bias"]
    with torch.no_grad():
        assert torch.allclose(setup.model.logits(server.model, X), expected, atol=1e-6)
        scaled = {**server.model, "classifier.weight": 3 * w}  # the weight norms no longer matter
        assert torch.allclose(setup.model.logits(scaled, X), expected, atol=1e-6)
    ctx = context(0, server.model)
    upload, _ = algo.finish(ctx, algo.start_state(ctx), 1)
    assert CLASSIFIER_NORM in upload  # the global model keeps normalising after aggregation


def test_clsprox_pulls_only_the_classifier():
    setup = tiny_setup()
    plain = build_algorithm("fedavg", {}, setup)
    prox = build_algorithm("clsprox", {"mu": 0.5}, setup)
    server = ServerState(initial_state(setup))
    ctx = context(0, server.model)
    moved = {k: v + 0.1 for k, v in server.model.items()}
    batch = Batch(X, Y)
    new_plain, *_ = sgd_step(plain.stages(ctx)[0], moved, {}, batch, ctx, True)
    new_prox, *_ = sgd_step(prox.stages(ctx)[0], moved, {}, batch, ctx, True)
    lr = ctx.lr
    for name in setup.model.param_names:
        pull = new_plain[name] - new_prox[name]
        if name.startswith("classifier."):  # gradient + mu (phi - phi_global), phi - phi_global = 0.1
            assert torch.allclose(pull, torch.full_like(pull, lr * 0.5 * 0.1), atol=1e-6)
        else:
            assert torch.allclose(pull, torch.zeros_like(pull), atol=1e-7)


def oracle_replies(step, server):
    gen = torch.Generator().manual_seed(1)
    replies = {}
    for c in range(3):
        feats = torch.randn(40, 8, generator=gen) + c
        labels = torch.tensor([c] * 30 + [(c + 1) % 3] * 10)
        replies[c] = step.client_query(server.model, feats, labels, client=c, round_=1)
    return replies


def test_oracle_calibrates_on_all_real_features():
    setup = tiny_setup()
    params = {"ccvr": {"oracle": "all", "epochs": 2, "transform": "none"}}
    (step,) = build_posthoc("fedavg+ccvr", params, setup)
    server = ServerState(initial_state(setup))
    replies = oracle_replies(step, server)
    assert set(replies[0]) == {"features", "labels"}
    new, info = step.apply(server, replies, 1)
    assert info["ccvr_virtual_features"] == 120
    # the same as re-training the classifier on the class-sorted real features
    x = torch.cat([replies[c]["features"] for c in range(3)])
    y = torch.cat([replies[c]["labels"] for c in range(3)])
    order = torch.cat([(y == c).nonzero().flatten() for c in range(3)])
    w, b = retrain_classifier(server.model["classifier.weight"], server.model["classifier.bias"], x[order],
                              y[order], ClassifierTraining(2, 0.001, 0.9, 1e-5, 64), stream(setup, 1, "ccvr"))
    assert torch.allclose(new.model["classifier.weight"], w) and torch.allclose(new.model["classifier.bias"], b)


def test_oracle_per_class_draws_k_features_per_class():
    setup = tiny_setup()
    (step,) = build_posthoc("fedavg+ccvr", {"ccvr": {"oracle": "per_class", "oracle_per_class": 25}}, setup)
    server = ServerState(initial_state(setup))
    feats, labels = step.real_features(oracle_replies(step, server), torch.Generator().manual_seed(0))
    assert [len(f) for f in feats] == [25, 25, 25]
    assert [set(lab.tolist()) for lab in labels] == [{0}, {1}, {2}]


def test_calibrating_a_clsnorm_model_starts_from_its_normalised_rows():
    setup = tiny_setup()
    server = build_algorithm("clsnorm", {}, setup).init_server(initial_state(setup))
    server.model["classifier.weight"] = 5 * server.model["classifier.weight"]
    (step,) = build_posthoc("clsnorm+ccvr", {"ccvr": {"oracle": "all", "lr": 1e-12, "transform": "none"}}, setup)
    new, _ = step.apply(server, oracle_replies(step, server), 1)
    assert CLASSIFIER_NORM not in new.model  # a calibrated classifier is a plain linear layer
    with torch.no_grad():  # ... that predicts as the normalised one did (a negligible lr)
        assert torch.allclose(setup.model.logits(new.model, X), setup.model.logits(server.model, X), atol=1e-5)


@pytest.mark.slow  # two 3-round MNIST runs of 80 local steps, ~3 s (accuracy 0.83 and 0.66 on seed 0)
@needs_shared_data
def test_every_round_calibration_and_side_study_trainers_run(tmp_path):
    base = ["data.dataset=mnist", f"data.root={MNIST}", "data.download=false", "data.partition=dirichlet",
            "data.alpha=0.1", "data.num_clients=10", "model.name=mlp", "model.options={hidden = [64]}",
            "train.rounds=3", "train.local_steps=80", "runtime.progress=false"]
    cfg = config.load(None, [*base, "algorithm.name=clsnorm+ccvr", "algorithm.ccvr.every_round=true"])
    summary = Experiment(cfg).run(tmp_path / "every")
    lines = [json.loads(x) for x in (tmp_path / "every" / "metrics.jsonl").read_text().splitlines()]
    assert all("global_acc_before_ccvr" in line for line in lines)
    assert summary["final_global_acc"] > 0.6
    summary = Experiment(config.load(None, [*base, "algorithm.name=clsprox"])).run(tmp_path / "prox")
    assert summary["final_global_acc"] > 0.6
