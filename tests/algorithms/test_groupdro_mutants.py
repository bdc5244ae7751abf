"""Group DRO: properties that mutation testing showed untested (the group losses' device, the loss parts'
names in metrics.jsonl)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import Batch, ClientContext
from hetfl.algorithms.groupdro import CLIENT_LOGQ, GLOBAL_LOSS, LOGQ, PRESENT, group_losses
from tests.helpers import initial_state, perturbed, tiny_setup


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_group_losses_follow_the_labels_device():
    """The group index built to compare with the labels lives on their device (a CPU index against CUDA labels
    raises)."""
    labels = torch.tensor([0, 2, 2], device="cuda")
    out = group_losses(torch.tensor([1.0, 2.0, 4.0], device="cuda"), labels, 3)
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), torch.tensor([1.0, 0.0, 3.0]))


@pytest.mark.parametrize("groups", ["classes", "clients"])
def test_the_loss_parts_names_in_the_metrics(groups):
    """metrics.jsonl names the model step's parts: ``robust_loss`` (sum_g q_g L_g) and ``ce`` for "classes";
    ``ce`` alone for "clients" (plain local cross-entropy), the batch's mean cross-entropy either way."""
    setup = tiny_setup()
    algo = build_algorithm("groupdro", {"groups": groups}, setup)
    state = perturbed(initial_state(setup), 0.5, seed=3)
    x, labels = torch.randn(4, 4, generator=torch.Generator().manual_seed(7)), torch.tensor([0, 2, 2, 1])
    z = torch.randn(4, 8)
    ctx = ClientContext(0, 1, 4, 0.1, state, {}, inputs=lambda: Batch(x, labels), features=lambda s: (z, labels))
    ctx.state = algo.init_client_state(0, algo.init_server(state))
    ctx.extras = algo.begin(ctx)
    loss, metrics = algo.loss(algo.start_state(ctx), Batch(x, labels), ctx)
    ce = F.cross_entropy(setup.model.logits(state, x), labels)
    assert set(metrics) == ({"robust_loss", "ce"} if groups == "classes" else {"ce"})
    torch.testing.assert_close(metrics["ce"], ce)
    if groups == "classes":
        torch.testing.assert_close(metrics["robust_loss"], loss.detach())
    else:
        torch.testing.assert_close(loss, ce)


def test_the_q_step_is_plain_sgd_named_q_whatever_the_runs_momentum_and_weight_decay():
    """The EG step on log q is one plain SGD step at lr eta (no momentum, no weight decay: either would break
    ``a_g <- a_g + eta L_g``), even in a run with momentum and weight decay; the model step keeps the run's.
    Its metrics reach metrics.jsonl under the stage's name (``train_q/worst_group_loss``)."""
    setup = tiny_setup(momentum=0.9, weight_decay=1e-3)
    algo = build_algorithm("groupdro", {"eta": 0.3}, setup)
    state = initial_state(setup)
    ctx = ClientContext(0, 1, 3, 0.1, state, {}, inputs=lambda: Batch(torch.randn(3, 4), torch.tensor([0, 1, 2])))
    ctx.state = algo.init_client_state(0, algo.init_server(state))
    ctx.extras = algo.begin(ctx)
    (stage,) = algo.stages(ctx)
    q = stage.adversary
    assert q.name == "q" and (q.sgd.lr, q.sgd.momentum, q.sgd.weight_decay) == (0.3, 0.0, 0.0)
    assert (stage.sgd.momentum, stage.sgd.weight_decay) == (0.9, 1e-3)


def test_log_q_follows_the_models_precision():
    """q is kept in the model's dtype (a float64 run keeps its group weights in float64), as every local
    tensor; the EG step then runs in that precision."""
    setup = tiny_setup()
    algo = build_algorithm("groupdro", {}, setup)
    state = {k: v.double() for k, v in initial_state(setup).items()}
    logq = algo.init_client_state(0, algo.init_server(state))[LOGQ]
    assert logq.dtype == torch.float64 and torch.equal(logq, torch.zeros(3, dtype=torch.float64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_log_q_lives_on_the_models_device():
    setup = tiny_setup()
    algo = build_algorithm("groupdro", {}, setup)
    state = {k: v.cuda() for k, v in initial_state(setup).items()}
    assert algo.init_client_state(0, algo.init_server(state))[LOGQ].device.type == "cuda"
    clients = build_algorithm("groupdro", {"groups": "clients"}, setup)
    assert clients.init_server(state).extra[CLIENT_LOGQ].device.type == "cuda"


def test_a_client_without_labels_is_refused_naming_the_method():
    setup = tiny_setup()
    algo = build_algorithm("groupdro", {}, setup)
    with pytest.raises(ValueError, match=r"^groupdro needs the client's labels \(ClientContext.inputs\)$"):
        algo.begin(ClientContext(0, 1, 3, 0.1, initial_state(setup), {}))


def test_a_class_seen_once_is_a_group():
    """A group is a class the client holds at all: one sample is enough (here class 1)."""
    setup = tiny_setup()
    algo = build_algorithm("groupdro", {}, setup)
    ctx = ClientContext(0, 1, 5, 0.1, initial_state(setup), {},
                        inputs=lambda: Batch(torch.randn(5, 4), torch.tensor([0, 0, 1, 2, 2])))
    assert algo.begin(ctx)[PRESENT].tolist() == [1.0, 1.0, 1.0]


def test_the_clients_variant_refuses_a_client_without_features():
    algo = build_algorithm("groupdro", {"groups": "clients"}, tiny_setup())
    message = r"^groupdro \(groups = 'clients'\) needs the client's features \(ClientContext.features\)$"
    with pytest.raises(ValueError, match=message):
        algo.begin(ClientContext(0, 1, 3, 0.1, initial_state(tiny_setup()), {}))


def test_a_client_without_training_data_reports_a_zero_loss():
    """An empty client's cross-entropy would be NaN (a mean over nothing); it reports 0, so its log q_k is
    unchanged and the aggregation weights stay finite."""
    setup = tiny_setup()
    algo = build_algorithm("groupdro", {"groups": "clients", "eta": 0.5}, setup)
    server = algo.init_server(initial_state(setup))
    ctx = ClientContext(0, 1, 0, 0.1, server.model, {},
                        features=lambda s: (torch.zeros(0, 8), torch.zeros(0, dtype=torch.long)))
    loss = algo.begin(ctx)[GLOBAL_LOSS]
    assert loss.shape == () and loss.item() == 0.0
