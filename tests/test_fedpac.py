"""FedPAC's statistics, classifier combination and personalised heads."""

from __future__ import annotations

import pytest
import torch

from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import Upload
from hetfl.algorithms.fedpac import CENTROIDS, HAS_CENTROID, combination_weights, feature_statistics
from tests.helpers import context, initial_state, perturbed, tiny_setup


def test_feature_statistics_by_hand():
    z = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [0.0, 2.0]])
    y = torch.tensor([0, 0, 1, 1])
    h, v = feature_statistics(z, y, num_classes=3)
    # pi = (1/2, 1/2, 0); mu_0 = (2, 0), mu_1 = (0, 2); h_k = pi_k mu_k
    assert torch.allclose(h, torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=torch.float64))
    # tr E[zz^T|0] = (1 + 9)/2 = 5, tr E[zz^T|1] = 4; v = [(5 + 4)/2 - (4 + 4)/4] / 4 = 2.5 / 4
    assert v == pytest.approx(2.5 / 4)


def test_identical_clients_share_equally_and_unique_ones_keep_their_own():
    h = [torch.ones(3, 2) for _ in range(4)]
    alpha = combination_weights(h, [1.0] * 4, 0)
    assert torch.allclose(alpha, torch.full((4,), 0.25, dtype=torch.float64), atol=1e-8)
    far = [torch.zeros(3, 2)] + [torch.full((3, 2), 100.0) for _ in range(3)]
    alpha = combination_weights(far, [1e-3] * 4, 0)
    assert alpha[0] > 0.99


def test_round_trip_of_personalised_heads_and_centroids():
    setup = tiny_setup(num_clients=2)
    algo = build_algorithm("fedpac", {}, setup)
    server = algo.init_server(initial_state(setup))
    assert server.extra[HAS_CENTROID].sum() == 0
    uploads = []
    for c, shift in ((0, 0.0), (1, 5.0)):
        local = perturbed(server.model, 0.3, c)
        counts = torch.tensor([4.0 + 8 * c, 0.0, 2.0])
        cents = torch.full((3, 8), shift)
        tensors = {**{n: local[n] for n in setup.model.state_names}, "fedpac.counts": counts, CENTROIDS: cents,
                   "fedpac.h": torch.rand(3, 8, dtype=torch.float64), "fedpac.v": torch.tensor(0.1)}
        uploads.append(Upload(c, tensors, 10 * (c + 1), 3))
    new = algo.aggregate(server, uploads, 1)
    assert new.extra[HAS_CENTROID].tolist() == [1.0, 0.0, 1.0]
    assert torch.allclose(new.extra[CENTROIDS][0], torch.full((8,), 5.0 * 12 / 16))  # weighted by class counts
    for c in (0, 1):
        head = new.extra[f"head.{c}/classifier.weight"]
        lo = torch.minimum(uploads[0].tensors["classifier.weight"], uploads[1].tensors["classifier.weight"])
        hi = torch.maximum(uploads[0].tensors["classifier.weight"], uploads[1].tensors["classifier.weight"])
        assert ((head >= lo - 1e-6) & (head <= hi + 1e-6)).all()  # a convex combination of the uploaded heads
    payload = algo.payload(new, 1)
    assert "fedpac.head/classifier.weight" in payload and "classifier.weight" not in payload
    state = algo.start_state(context(1, payload, algo.init_client_state(1, new)))
    assert torch.equal(state["classifier.weight"], new.extra["head.1/classifier.weight"])
    assert torch.equal(algo.client_model(new, {}, 1)["classifier.weight"], new.extra["head.1/classifier.weight"])


def test_stages_train_head_then_encoder_with_alignment_off_until_centroids_exist():
    setup = tiny_setup()
    algo = build_algorithm("fedpac", {"lam": 2.0}, setup)
    server = algo.init_server(initial_state(setup))
    ctx = context(0, algo.payload(server, 0), algo.init_client_state(0, server))
    ctx.features = lambda state: (setup.model.module.features(torch.randn(6, 4)).detach(), torch.tensor([0, 1, 2] * 2))
    ctx.extras = algo.begin(ctx)
    head, encoder = algo.stages(ctx)
    assert set(head.trainable) == {"classifier.weight", "classifier.bias"} and head.sgd.lr == 0.1
    assert not set(encoder.trainable) & set(head.trainable)
    assert ctx.extras["align"] == 0  # no global centroids in the first round
