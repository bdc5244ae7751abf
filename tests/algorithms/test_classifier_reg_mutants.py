"""clsprox and clsnorm: the proximal term at every mu, its metric, the normalisation flag's device.

Written for the survivors of ``python benchmarks/mutation.py --only classifier_reg`` (session 26)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import Batch
from hetfl.algorithms.classifier_reg import CLASSIFIER_NORM
from tests.helpers import context, initial_state, perturbed, tiny_setup

X = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
Y = torch.tensor([0, 1, 2, 0, 1, 2])


@pytest.mark.parametrize("mu", [1.0, 0.3])
def test_clsprox_loss_is_ce_plus_half_mu_the_classifiers_squared_distance(mu):
    setup = tiny_setup()
    algo = build_algorithm("clsprox", {"mu": mu}, setup)
    glob = initial_state(setup)
    local = perturbed(glob, 0.2, seed=3)
    loss, metrics = algo.loss(local, Batch(X, Y), context(0, glob))
    ce = F.cross_entropy(setup.model.logits(local, X), Y)
    dist = sum(((local[n] - glob[n]) ** 2).sum() for n in ("classifier.weight", "classifier.bias"))
    assert metrics.keys() == {"ce", "cls_prox"}
    assert metrics["cls_prox"].item() == pytest.approx(dist.item(), rel=1e-6)
    assert loss.item() == pytest.approx((ce + 0.5 * mu * dist).item(), rel=1e-6)


def test_clsprox_at_mu_zero_is_plain_cross_entropy_with_no_proximal_metric():
    setup = tiny_setup()
    algo = build_algorithm("clsprox", {"mu": 0.0}, setup)
    glob = initial_state(setup)
    local = perturbed(glob, 0.2, seed=3)
    loss, metrics = algo.loss(local, Batch(X, Y), context(0, glob))
    assert metrics.keys() == {"ce"}
    assert loss.item() == pytest.approx(F.cross_entropy(setup.model.logits(local, X), Y).item(), rel=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_normalisation_flag_lives_on_the_models_device():
    setup = tiny_setup()
    algo = build_algorithm("clsnorm", {}, setup)
    state = {k: v.cuda() for k, v in initial_state(setup).items()}
    server = algo.init_server(state)
    assert server.model[CLASSIFIER_NORM].device.type == "cuda"
    start = algo.start_state(context(0, server.model))
    assert start[CLASSIFIER_NORM].device.type == "cuda"
