"""kNN-Per's kernel, datastore and refusals (mutation testing, session 26; Marfoq et al. ICML 2022)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from hetfl.algorithms import build_algorithm
from hetfl.algorithms.knnper import interpolated_log_probs, knn_probabilities
from tests.helpers import context, initial_state, tiny_setup

KEYS = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [5.0, 5.0]])
LABELS = torch.tensor([0, 1, 1, 2])


def make(params=None):
    setup = tiny_setup()
    algo = build_algorithm("knnper", params or {}, setup)
    return algo, algo.init_server(initial_state(setup))


@pytest.mark.parametrize("scale", [0.5, 4.0])
def test_the_kernels_length_scale_divides_the_squared_distance_with_the_feature_size(scale):
    """``s_j = exp(-||phi(x) - phi(x_j)||^2 / (d * scale))``, d = 2 here."""
    p = knn_probabilities(torch.tensor([[0.0, 0.0]]), KEYS, LABELS, k=3, num_classes=3, scale=scale)
    s = [math.exp(-d2 / (2 * scale)) for d2 in (0.0, 1.0, 4.0)]
    expected = torch.tensor([[s[0], s[1] + s[2], 0.0]]) / sum(s)
    assert torch.allclose(p, expected)


def test_the_interpolation_warns_nothing():
    """The log-softmax over the classes names its dimension: no deprecation warning at every evaluation."""
    logits = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    p_knn = torch.softmax(torch.randn(5, 3, generator=torch.Generator().manual_seed(1)), dim=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = interpolated_log_probs(logits, p_knn, 0.4)
        model = interpolated_log_probs(logits, p_knn, 0.0)
    assert torch.allclose(out.exp(), 0.4 * p_knn + 0.6 * torch.softmax(logits, dim=1), atol=1e-6)
    assert torch.allclose(model, torch.log_softmax(logits, dim=1))


def test_a_datastore_of_one_sample_is_used_and_an_empty_one_leaves_the_model_alone():
    algo, server = make({"lam": 1.0})  # lam = 1: the kNN distribution alone
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(2))
    ctx = context(0, server.model)
    ctx.features = lambda state: (algo.model.features_and_logits(state, x[:1])[0].detach(), torch.tensor([2]))
    predict = algo.predictor(server.model, ctx)
    assert predict is not None
    # every query's single neighbour is the stored sample: all probability on its label
    assert torch.allclose(predict(x).exp(), torch.tensor([[0.0, 0.0, 1.0]]).expand(4, 3))
    ctx.features = lambda state: (torch.zeros(0, 8), torch.zeros(0, dtype=torch.long))
    assert algo.predictor(server.model, ctx) is None


def test_knnper_without_the_clients_features_says_what_it_needs():
    algo, server = make()
    ctx = context(0, server.model)
    ctx.features = None
    with pytest.raises(ValueError) as err:
        algo.predictor(server.model, ctx)
    assert str(err.value) == "knnper needs the client's training features (ClientContext.features)"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_knn_distribution_lives_on_the_features_device():
    p = knn_probabilities(torch.tensor([[0.0, 0.0]], device="cuda"), KEYS.cuda(), LABELS.cuda(), k=3,
                          num_classes=3, scale=1.0)
    assert p.device.type == "cuda"
    assert torch.allclose(p.cpu(), knn_probabilities(torch.tensor([[0.0, 0.0]]), KEYS, LABELS, 3, 3, 1.0))
