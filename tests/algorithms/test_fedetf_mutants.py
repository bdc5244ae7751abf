"""FedETF: properties that mutation testing showed untested (the personalisation's settings under a run with
momentum, weight decay and several local epochs, the adaptation loss's metric name, the run note)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import Batch, ClientContext, ModelCaller, Upload
from hetfl.algorithms.fedetf import BETA, ETF, LOG_COUNTS, PROJ_B, PROJ_W
from tests.helpers import TinyNet, initial_state, perturbed, tiny_setup


def personalisation(params: dict):
    setup = tiny_setup(momentum=0.9, weight_decay=1e-3, local_epochs=3, local_steps=4)
    algo = build_algorithm("fedetf", params, setup)
    server = algo.init_server(perturbed(initial_state(setup), 0.3, seed=1))
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 0, 2, 2, 0, 1])
    ctx = ClientContext(0, 1, 6, 0.2, server.model, {}, inputs=lambda: Batch(x, labels))
    return setup, algo, ctx


def test_the_etf_tuning_ignores_the_runs_momentum_and_weight_decay_and_the_projection_uses_them():
    """The code's ETF fine-tuning is plain SGD (lr 0.1, no momentum, no weight decay); the projection's is the
    run's optimiser at lr 0.05; the local-training stage takes ``train.local_epochs`` and ``train.local_steps``
    at the round's lr."""
    _, algo, ctx = personalisation({"pers_cycles": 1, "pers_epochs": 2})
    local, etf, proj = algo.personalize_stages(ctx)
    assert (local.sgd.lr, local.sgd.momentum, local.sgd.weight_decay) == (0.2, 0.9, 1e-3)
    assert (local.epochs, local.steps) == (3, 4)
    assert (etf.sgd.lr, etf.sgd.momentum, etf.sgd.weight_decay) == (0.1, 0.0, 0.0)
    assert (proj.sgd.lr, proj.sgd.momentum, proj.sgd.weight_decay) == (0.05, 0.9, 1e-3)
    assert etf.trainable == (ETF,) and proj.trainable == (PROJ_W, PROJ_B)


def test_the_adaptation_loss_reports_its_cross_entropy_as_ce():
    _, algo, ctx = personalisation({})
    batch = Batch(torch.randn(4, 4, generator=torch.Generator().manual_seed(2)), torch.tensor([0, 2, 1, 0]))
    loss, metrics = algo.ce_loss(algo.start_state(ctx), batch, ctx)
    assert set(metrics) == {"ce"} and torch.equal(metrics["ce"], loss.detach())


def test_the_run_note_states_the_personalisations_cost_and_how_to_lower_it():
    setup = tiny_setup()
    algo = build_algorithm("fedetf", {"pers_cycles": 2, "pers_epochs": 5}, setup)
    assert algo.run_notes() == [
        "fedetf: before every evaluation each client is personalised: local training, then 20 epochs "
        "of ETF/projection fine-tuning (algorithm.pers_cycles = 2 x 2 x algorithm.pers_epochs = 5): each "
        "evaluation costs every client 20 epochs on its data, many times a round of training (on the default "
        "data 11 s against 0.1 s); for a quick run lower algorithm.pers_cycles (e.g. 2), raise "
        "train.eval_every, or set algorithm.personalize = false"]
    # no personalisation, or no fine-tuning cycle: nothing to warn about
    assert build_algorithm("fedetf", {"personalize": False}, setup).run_notes() == []
    assert build_algorithm("fedetf", {"pers_cycles": 0}, setup).run_notes() == []
    assert len(build_algorithm("fedetf", {"pers_cycles": 1}, setup).run_notes()) == 1


def test_the_memory_estimate_counts_the_etf_and_projection_entries_it_builds():
    """24 bytes (float32 copies) per entry of the ETF ``d x C`` and the projection ``d x feature_dim`` plus its
    bias, checked against the tensors ``init_server`` builds (feature_dim 8 here; d = 8, then 5)."""
    setup = tiny_setup()
    for params, d in (({}, 8), ({"etf_dim": 5}, 5)):
        algo = build_algorithm("fedetf", params, setup)
        built = algo.init_server(initial_state(setup)).model
        entries = sum(built[name].numel() for name in (ETF, PROJ_W, PROJ_B))
        assert algo.memory_needs((4,), 8) == [
            ("algorithm.etf_dim", params.get("etf_dim", 0), 24 * entries,
             f"FedETF's ETF and projection ({d} dimensions)")]


@pytest.mark.parametrize("balanced", [True, False])
def test_the_local_loss_and_its_metrics_with_and_without_the_balanced_softmax(balanced):
    """``balanced = false`` trains on plain cross-entropy of ``beta h^T M`` (no class counts: ``begin`` makes
    none); metrics.jsonl names the loss ``balanced_ce`` or ``ce`` and reports the temperature ``beta``."""
    setup, algo, ctx = personalisation({"balanced": balanced})
    ctx.extras = algo.begin(ctx)
    assert (LOG_COUNTS in ctx.extras) == balanced
    state = {**algo.start_state(ctx), BETA: torch.tensor(1.7)}
    batch = Batch(torch.randn(5, 4, generator=torch.Generator().manual_seed(3)), torch.tensor([0, 2, 1, 0, 0]))
    z, _ = setup.model.features_and_logits(state, batch.x)
    h = F.normalize(F.linear(z, state[PROJ_W], state[PROJ_B]), dim=1)
    logits = 1.7 * h @ state[ETF]
    if balanced:  # the client's counts 3, 1, 2
        logits = logits + torch.tensor([3.0, 1.0, 2.0]).log()
    expected = F.cross_entropy(logits, batch.y)
    loss, metrics = algo.loss(state, batch, ctx)
    torch.testing.assert_close(loss, expected)
    name = "balanced_ce" if balanced else "ce"
    assert set(metrics) == {name, "beta"}
    torch.testing.assert_close(metrics[name], expected)
    assert metrics["beta"].item() == pytest.approx(1.7)


def test_a_model_without_classifier_bias_gets_a_projection_without_bias():
    """The docstring: for models without a classifier bias the projection has no bias either; training,
    the upload, the aggregation and the folded classifier then work on ``W_p`` alone."""
    setup = tiny_setup()
    model = TinyNet()
    model.classifier = torch.nn.Linear(8, 3, bias=False)
    names = [n for n, _ in model.named_parameters()]
    setup.model = ModelCaller(model)
    setup.groups = {part: [n for n in names if n.startswith(part + ".")]
                    for part in ("encoder", "projector", "classifier")}
    algo = build_algorithm("fedetf", {}, setup)
    server = algo.init_server(initial_state(setup))
    assert PROJ_W in server.model and PROJ_B not in server.model and "classifier.bias" not in server.model
    assert algo.projection_names() == (PROJ_W,) and PROJ_B not in algo.trainable_names()
    x, labels = torch.randn(4, 4, generator=torch.Generator().manual_seed(5)), torch.tensor([0, 1, 2, 0])
    ctx = ClientContext(0, 1, 4, 0.1, server.model, {}, inputs=lambda: Batch(x, labels))
    ctx.extras = algo.begin(ctx)
    state = algo.start_state(ctx)
    loss, _ = algo.loss(state, Batch(x, labels), ctx)
    assert torch.isfinite(loss)
    upload, _ = algo.finish(ctx, state, 1)
    assert PROJ_B not in upload
    new = algo.aggregate(server, [Upload(0, upload, num_samples=4, steps=1)], 1)
    folded = server.model[BETA] * server.model[ETF].T @ server.model[PROJ_W]
    torch.testing.assert_close(new.model["classifier.weight"], folded)
    assert algo.personalize_stages(ctx)[2].trainable == (PROJ_W,)


def test_a_client_without_labels_is_refused_naming_the_method():
    setup = tiny_setup()
    algo = build_algorithm("fedetf", {}, setup)
    with pytest.raises(ValueError, match=r"^fedetf needs the client's labels \(ClientContext.inputs\)$"):
        algo.begin(ClientContext(0, 1, 3, 0.1, initial_state(setup), {}))


def test_the_projection_starts_as_pytorchs_default_linear_layer():
    """``W_p`` and ``b_p`` start uniform in ``+-1/sqrt(feature_dim)`` (PyTorch's Linear default; feature_dim 8):
    inside the bound, and filling it (d = 64: 512 and 64 draws all stay below 0.7 of it with probability
    below 1e-9, whatever the seed)."""
    setup = tiny_setup()
    model = build_algorithm("fedetf", {"etf_dim": 64}, setup).init_server(initial_state(setup)).model
    bound = 1 / math.sqrt(8)
    for name in (PROJ_W, PROJ_B):
        largest = model[name].abs().max().item()
        assert 0.7 * bound < largest <= bound, (name, largest)
        assert model[name].min() < 0 < model[name].max()


def test_the_method_tensors_follow_the_models_precision():
    setup = tiny_setup()
    state = {k: v.double() for k, v in initial_state(setup).items()}
    model = build_algorithm("fedetf", {}, setup).init_server(state).model
    assert {model[name].dtype for name in (ETF, PROJ_W, PROJ_B, BETA)} == {torch.float64}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_method_tensors_live_on_the_models_device():
    setup = tiny_setup()
    state = {k: v.cuda() for k, v in initial_state(setup).items()}
    model = build_algorithm("fedetf", {}, setup).init_server(state).model
    assert {model[name].device.type for name in (ETF, PROJ_W, PROJ_B, BETA)} == {"cuda"}
