"""FedETF (Li et al. 2023): the simplex ETF, the projected normalised features and scaled cosine
logits, the balanced softmax, the fixed classifier, the folded global classifier, the local
adaptation, learning and vectorisation."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from hetfl import config
from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import Batch, ClientContext, Upload
from hetfl.algorithms.fedetf import BETA, ETF, LOG_COUNTS, PROJ_B, PROJ_W, balanced_softmax_loss, simplex_etf
from hetfl.engine.experiment import Experiment
from hetfl.params import ConfigError
from tests.helpers import SMALL_MNIST, initial_state, needs_shared_data, perturbed, tiny_setup
from tests.helpers.executors import SYNTHETIC, compare_one_round

pytestmark = pytest.mark.usefixtures("one_thread")


def ready(params: dict | None = None):
    setup = tiny_setup()
    algo = build_algorithm("fedetf", params or {}, setup)
    server = algo.init_server(perturbed(initial_state(setup), 0.3, seed=1))
    x = torch.randn(9, 4, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 0, 0, 0, 0, 0, 2, 2, 0])  # class 1 absent
    ctx = ClientContext(0, 1, 9, 0.1, server.model, {}, inputs=lambda: Batch(x, labels))
    ctx.extras = algo.begin(ctx)
    return setup, algo, server, ctx


@pytest.mark.parametrize(("classes", "dim"), [(10, 10), (10, 64), (3, 8), (2, 5)])
def test_simplex_etf_has_unit_columns_and_equal_negative_cosines(classes, dim):
    m = simplex_etf(classes, dim, torch.Generator().manual_seed(0))
    assert m.shape == (dim, classes)
    gram = m.T @ m
    torch.testing.assert_close(torch.diagonal(gram), torch.ones(classes, dtype=torch.float64))
    off = gram[~torch.eye(classes, dtype=torch.bool)]
    torch.testing.assert_close(off, torch.full_like(off, -1.0 / (classes - 1)))
    torch.testing.assert_close(m.sum(1), torch.zeros(dim, dtype=torch.float64), atol=1e-12, rtol=0)  # centred
    assert torch.equal(m, simplex_etf(classes, dim, torch.Generator().manual_seed(0)))
    assert not torch.allclose(m, simplex_etf(classes, dim, torch.Generator().manual_seed(1)))


def test_simplex_etf_needs_enough_dimensions():
    with pytest.raises(ValueError, match="dimension"):
        simplex_etf(10, 9, torch.Generator().manual_seed(0))


def test_balanced_softmax_adds_log_counts():
    logits = torch.tensor([[1.0, 0.0, -1.0]])
    counts = torch.tensor([4.0, 1.0, 2.0])
    # shifted logits [1 + log 4, 0, -1 + log 2], label 2
    shifted = [1 + math.log(4), 0.0, -1 + math.log(2)]
    expected = -(shifted[2] - math.log(sum(math.exp(v) for v in shifted)))
    value = balanced_softmax_loss(logits, torch.tensor([2]), counts.log())
    assert value.item() == pytest.approx(expected, rel=1e-6)


def test_server_state_holds_the_etf_projection_and_temperature():
    setup, algo, server, ctx = ready()
    hp = algo.hp
    assert (hp.beta_init, hp.balanced, hp.personalize, hp.pers_cycles, hp.pers_epochs) == (1.0, True, True, 20, 3)
    assert (hp.pers_etf_lr, hp.pers_proj_lr) == (0.1, 0.05)
    m = server.model[ETF]
    assert m.shape == (8, 3)  # d = the model's feature dimension (8 >= 3 classes)
    torch.testing.assert_close(m.T @ m, torch.tensor([[1.0, -0.5, -0.5], [-0.5, 1.0, -0.5], [-0.5, -0.5, 1.0]]))
    assert server.model[PROJ_W].shape == (8, 8) and server.model[PROJ_B].shape == (8,)
    assert server.model[BETA].item() == 1.0
    assert build_algorithm("fedetf", {"etf_dim": 16}, setup).init_server(initial_state(setup)).model[ETF].shape == (
        16, 3)
    again = algo.init_server(perturbed(initial_state(setup), 0.3, seed=1))
    assert all(torch.equal(server.model[k], again.model[k]) for k in (ETF, PROJ_W, PROJ_B))
    # absent classes count 1 in the balanced softmax (the authors' code)
    torch.testing.assert_close(ctx.extras[LOG_COUNTS], torch.tensor([math.log(7), 0.0, math.log(2)]))


def test_logits_are_the_scaled_cosines_to_the_etf_vertices():
    setup, algo, _, ctx = ready()
    state = {**algo.start_state(ctx), BETA: torch.tensor(3.0)}
    x = torch.randn(6, 4)
    z, _ = setup.model.features_and_logits(state, x)
    h = F.linear(z, state[PROJ_W], state[PROJ_B])
    h = h / h.norm(dim=1, keepdim=True)
    expected = 3.0 * h @ state[ETF]
    logits = algo.etf_logits(state, z)
    torch.testing.assert_close(logits, expected)
    assert logits.abs().max() <= 3.0 + 1e-5  # |beta cos| <= beta
    batch = Batch(x, torch.tensor([0, 2, 0, 2, 0, 0]))
    loss, _ = algo.loss(state, batch, ctx)
    torch.testing.assert_close(loss, F.cross_entropy(expected + ctx.extras[LOG_COUNTS], batch.y))


def test_the_etf_is_fixed_never_trained_uploaded_or_averaged():
    setup, algo, server, ctx = ready()
    trainable = set(algo.trainable_names())
    assert ETF not in trainable and not trainable & set(setup.groups["classifier"])
    assert {PROJ_W, PROJ_B, BETA} <= trainable
    upload, _ = algo.finish(ctx, algo.start_state(ctx), 1)
    assert ETF not in upload and "classifier.weight" not in upload and {PROJ_W, BETA} <= set(upload)
    ups = [Upload(c, {k: v * s for k, v in upload.items()}, num_samples=10, steps=1) for c, s in ((0, 1.0), (1, 3.0))]
    new = algo.aggregate(server, ups, 1)
    assert torch.equal(new.model[ETF], server.model[ETF])
    torch.testing.assert_close(new.model[PROJ_W], 2 * server.model[PROJ_W])
    torch.testing.assert_close(new.model[BETA], 2 * server.model[BETA])
    # the model's linear classifier is refolded from the new projection and temperature
    torch.testing.assert_close(new.model["classifier.weight"],
                               new.model[BETA] * new.model[ETF].T @ new.model[PROJ_W])


@pytest.mark.parametrize("beta", [2.5, -0.7])
def test_folded_classifier_predicts_exactly_like_fedetf(beta):
    setup, algo, server, _ = ready()
    state = {**perturbed(server.model, 0.5, seed=4), ETF: server.model[ETF], BETA: torch.tensor(beta)}
    state = {**state, **algo.folded_classifier(state)}
    x = torch.randn(200, 4, generator=torch.Generator().manual_seed(9))
    z, plain_logits = setup.model.features_and_logits(state, x)
    assert torch.equal(plain_logits.argmax(1), algo.etf_logits(state, z).argmax(1))
    assert torch.equal(algo.predictor(state, None)(x), algo.etf_logits(state, z))


def test_personalisation_is_local_training_then_alternating_etf_and_projection_tuning():
    setup, algo, _, ctx = ready({"pers_cycles": 2, "pers_epochs": 4})
    stages = algo.personalize_stages(ctx)
    assert [s.name for s in stages] == ["local", "etf", "projection", "etf", "projection"]
    local, etf, proj = stages[:3]
    assert local.trainable == algo.trainable_names() and local.epochs == setup.train.local_epochs
    assert etf.trainable == (ETF,) and (etf.sgd.lr, etf.sgd.momentum, etf.sgd.weight_decay) == (0.1, 0.0, 0.0)
    assert proj.trainable == (PROJ_W, PROJ_B) and proj.sgd.lr == 0.05 and etf.epochs == proj.epochs == 4
    batch = Batch(torch.randn(4, 4), torch.tensor([0, 2, 0, 0]))
    state = algo.start_state(ctx)
    # the local stage uses the balanced loss with the client's counts; the tuning stages plain CE
    torch.testing.assert_close(local.loss(state, batch, ctx)[0], algo.loss(state, batch, ctx)[0])
    z, _ = setup.model.features_and_logits(state, batch.x)
    torch.testing.assert_close(etf.loss(state, batch, ctx)[0], F.cross_entropy(algo.etf_logits(state, z), batch.y))
    assert build_algorithm("fedetf", {"personalize": False}, setup).personalize_stages(ctx) == []


def test_settings_are_validated():
    with pytest.raises(ConfigError, match="algorithm.beta_init"):
        build_algorithm("fedetf", {"beta_init": 0.0}, tiny_setup())
    with pytest.raises(ConfigError, match="algorithm.pers_epochs"):
        build_algorithm("fedetf", {"pers_epochs": 0}, tiny_setup())


@pytest.mark.slow  # fast cover: tests/engine/test_vectorized.py's every-method test (fedetf)
def test_vectorised_equals_sequential():
    exp = Experiment(config.load(None, [*SYNTHETIC, "data.num_clients=12", "data.partition=dirichlet",
                                        "algorithm.name=fedetf"]))
    compare_one_round(exp)


@needs_shared_data
def test_fedetf_learns_global_and_personalised(tmp_path):
    cfg = config.load(None, [*SMALL_MNIST, "algorithm.name=fedetf", "algorithm.pers_cycles=2",
                             "algorithm.pers_epochs=1", "train.eval_every=3"])
    summary = Experiment(cfg).run(tmp_path)
    detail = json.dumps({k: v for k, v in summary.items() if k != "config"})
    assert summary["final_global_acc"] > 0.6, detail  # chance: about 0.1
    assert summary["final_client_acc_mean"] > 0.7, detail  # personalised on the clients' own splits
