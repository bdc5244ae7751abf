"""FedLC and FedRS: classes seen once, the configured scaling rule, the refusal without labels, the metrics.

Written for the survivors of ``python benchmarks/mutation.py --only logit_adjust`` (session 26)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import Batch, ClientContext
from hetfl.algorithms.logit_adjust import FEDRS_SCALE, restriction_scale
from tests.helpers import initial_state, tiny_setup


def client_ctx(state, labels=None) -> ClientContext:
    if labels is None:
        return ClientContext(0, 1, 0, 0.1, state, {}, {})
    x = torch.randn(len(labels), 4, generator=torch.Generator().manual_seed(0))
    return ClientContext(0, 1, len(labels), 0.1, state, {}, {}, inputs=lambda: Batch(x, labels))


def test_a_class_seen_once_is_present():
    counts = torch.tensor([1.0, 0.0, 3.0])
    torch.testing.assert_close(restriction_scale(counts, 0.25), torch.tensor([1.0, 0.25, 1.0]))
    # proportional: the largest class (here of one sample) has scale 1
    torch.testing.assert_close(restriction_scale(torch.tensor([1.0, 0.0, 1.0]), 0.25, "proportional"),
                               torch.tensor([1.0, 0.25, 1.0]))


def test_fedrs_uses_the_configured_scaling_rule():
    setup = tiny_setup()
    state = initial_state(setup)
    labels = torch.tensor([0, 0, 0, 0, 2])  # counts 4, 0, 1
    algo = build_algorithm("fedrs", {"scaling": "proportional", "alpha": 0.5}, setup)
    scale = algo.begin(client_ctx(state, labels))[FEDRS_SCALE]
    torch.testing.assert_close(scale, torch.tensor([1.0, 0.5, 0.5 + 0.5 / 4]))


@pytest.mark.parametrize("name", ["fedlc", "fedrs"])
def test_a_client_without_labels_is_refused_naming_the_method(name):
    setup = tiny_setup()
    algo = build_algorithm(name, {}, setup)
    with pytest.raises(ValueError, match=rf"^{name} needs the client's labels \(ClientContext.inputs\)$"):
        algo.begin(client_ctx(initial_state(setup)))


def test_fedrs_reports_its_restricted_cross_entropy():
    setup = tiny_setup()
    state = initial_state(setup)
    algo = build_algorithm("fedrs", {}, setup)
    ctx = client_ctx(state, torch.tensor([0, 2, 2]))
    ctx.extras = algo.begin(ctx)
    batch = Batch(torch.randn(3, 4, generator=torch.Generator().manual_seed(2)), torch.tensor([0, 2, 2]))
    loss, metrics = algo.loss(state, batch, ctx)
    logits = setup.model.logits(state, batch.x) * torch.tensor([1.0, 0.5, 1.0])
    assert metrics.keys() == {"restricted_ce"} and torch.equal(metrics["restricted_ce"], loss.detach())
    assert metrics["restricted_ce"].item() == pytest.approx(F.cross_entropy(logits, batch.y).item(), rel=1e-6)
