"""Fed-RoD's class prior, what its loss logs and its refusal (mutation testing, session 26; Chen & Chao,
ICLR 2022)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import Batch
from hetfl.algorithms.fedrod import log_class_prior
from tests.helpers import context, initial_state, tiny_setup

X, Y = torch.randn(6, 4, generator=torch.Generator().manual_seed(4)), torch.tensor([0, 1, 2, 0, 1, 0])


def make():
    setup = tiny_setup()
    algo = build_algorithm("fedrod", {}, setup)
    return algo, algo.init_server(initial_state(setup))


def test_a_client_with_one_sample_has_all_its_prior_on_that_class():
    """``pi[c] = n_c / n`` with n = 1: probability 1 (log 0) on the class held, log 1e-12 elsewhere."""
    prior = log_class_prior(torch.tensor([2]), 3)
    assert torch.allclose(prior, torch.tensor([math.log(1e-12), math.log(1e-12), 0.0]))
    empty = log_class_prior(torch.zeros(0, dtype=torch.long), 3)  # no labels: every class absent
    assert torch.allclose(empty, torch.full((3,), math.log(1e-12)))


def test_the_prior_is_computed_in_the_dtype_asked_for():
    prior = log_class_prior(torch.tensor([0, 0, 1]), 3, dtype=torch.float64)
    assert prior.dtype == torch.float64
    assert torch.allclose(prior[:2], torch.tensor([math.log(2 / 3), math.log(1 / 3)], dtype=torch.float64))


def test_the_loss_reports_its_balanced_softmax_and_the_personal_heads_cross_entropy():
    """The metrics become ``train_bsm`` and ``train_ce_personal`` in metrics.jsonl."""
    algo, server = make()
    head = {"fedrod.head/classifier.weight": 0.3 * torch.randn(3, 8, generator=torch.Generator().manual_seed(5)),
            "fedrod.head/classifier.bias": torch.tensor([0.1, -0.2, 0.3])}
    ctx = context(0, server.model, head)
    prior = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    ctx.extras = {"log_prior": prior}
    loss, metrics = algo.loss(algo.start_state(ctx), Batch(X, Y), ctx)
    z, generic = algo.model.features_and_logits(server.model, X)
    bsm = F.cross_entropy(generic + prior, Y)
    personal = F.cross_entropy(generic + F.linear(z, head["fedrod.head/classifier.weight"],
                                                  head["fedrod.head/classifier.bias"]), Y)
    assert set(metrics) == {"bsm", "ce_personal"}
    assert torch.allclose(metrics["bsm"], bsm) and torch.allclose(metrics["ce_personal"], personal)
    assert torch.allclose(loss, bsm + personal)


def test_fedrod_without_the_clients_labels_says_what_it_needs():
    algo, server = make()
    ctx = context(0, server.model, algo.init_client_state(0, server))
    ctx.inputs = None
    with pytest.raises(ValueError) as err:
        algo.begin(ctx)
    assert str(err.value) == "fedrod needs the client's labels (ClientContext.inputs)"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_prior_lives_on_the_labels_device():
    algo, server = make()
    ctx = context(0, server.model, algo.init_client_state(0, server))
    ctx.inputs = lambda: Batch(X.cuda(), Y.cuda())
    prior = algo.begin(ctx)["log_prior"]
    assert prior.device.type == "cuda"
    assert torch.allclose(prior.cpu(), log_class_prior(Y, 3))
