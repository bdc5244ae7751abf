"""FedMix: empty and one-sample clients, the groupings' and picks' random streams.

Written for the survivors of ``python benchmarks/mutation.py --only fedmix`` (session 26)."""

from __future__ import annotations

import warnings

import pytest
import torch

from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import SHARED, Batch
from hetfl.algorithms.fedmix import MEAN_X, MEAN_Y, PICK, averaged_data, soft_cross_entropy
from tests.helpers import context, initial_state, tiny_setup


def test_a_client_without_samples_shares_no_means_and_the_pool_still_forms():
    means_x, means_y = averaged_data(torch.zeros(0, 2, 5), torch.zeros(0, dtype=torch.long), 4, 3,
                                     torch.Generator().manual_seed(0))
    assert means_x.shape == (0, 2, 5) and means_y.shape == (0, 4)
    setup = tiny_setup(num_clients=2)
    algo = build_algorithm("fedmix", {"mash_size": 2}, setup)
    replies = {}
    for c, n in ((0, 0), (1, 3)):
        ctx = context(c, {})
        data = Batch(torch.ones(n, 4), torch.full((n,), 2))
        ctx.inputs = lambda data=data: data
        replies[c] = algo.setup_query(ctx)
    pooled = algo.setup_aggregate(algo.init_server(initial_state(setup)), replies).extra
    assert pooled[SHARED + MEAN_X].shape == (2, 4) and pooled[SHARED + MEAN_Y].shape == (2, 3)


def test_a_client_with_one_sample_shares_that_sample():
    x, y = torch.tensor([[1.0, -2.0]]), torch.tensor([1])
    means_x, means_y = averaged_data(x, y, 3, 5, torch.Generator().manual_seed(0))
    assert torch.equal(means_x, x) and torch.equal(means_y, torch.tensor([[0.0, 1.0, 0.0]]))


def test_the_grouping_comes_from_the_given_generator():
    x, y = torch.arange(12.0).unsqueeze(1), torch.arange(12) % 3
    first = averaged_data(x, y, 3, 3, torch.Generator().manual_seed(4))
    torch.manual_seed(99)  # the global stream plays no part
    again = averaged_data(x, y, 3, 3, torch.Generator().manual_seed(4))
    other = averaged_data(x, y, 3, 3, torch.Generator().manual_seed(5))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0])


def test_each_client_groups_its_samples_with_its_own_stream():
    """The groupings are a function of the run seed and the client: the same run gives the same means, and two
    clients holding the same data group them differently (independent streams)."""
    setup = tiny_setup(num_clients=2)
    algo = build_algorithm("fedmix", {"mash_size": 3}, setup)
    data = Batch(torch.arange(24.0).reshape(12, 2), torch.arange(12) % 3)

    def query(client):
        ctx = context(client, {})
        ctx.inputs = lambda: data
        return algo.setup_query(ctx)

    first = query(0)
    torch.manual_seed(99)
    assert torch.equal(query(0)[MEAN_X], first[MEAN_X])
    assert not torch.equal(query(1)[MEAN_X], first[MEAN_X])


def test_the_picks_come_from_the_clients_stream():
    setup = tiny_setup()
    algo = build_algorithm("fedmix", {}, setup)
    (stage,) = algo.stages(context(0, initial_state(setup)))
    first = stage.draws(torch.Generator().manual_seed(3), 16)[PICK]
    torch.manual_seed(99)
    assert torch.equal(stage.draws(torch.Generator().manual_seed(3), 16)[PICK], first)
    assert not torch.equal(stage.draws(torch.Generator().manual_seed(4), 16)[PICK], first)
    assert first.shape == (16,) and first.min() >= 0 and first.max() < 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_empty_clients_means_live_on_its_device():
    _, means_y = averaged_data(torch.zeros(0, 4, device="cuda"), torch.zeros(0, dtype=torch.long, device="cuda"),
                               3, 5, torch.Generator().manual_seed(0))
    assert means_y.device.type == "cuda"


def test_the_loss_parts_are_reported_by_name():
    """metrics.jsonl's train_ce, train_ce_mean and train_taylor: the parts the loss combines (eq. 7)."""
    setup = tiny_setup()
    algo = build_algorithm("fedmix", {"lam": 0.2}, setup)
    state = initial_state(setup)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 4, generator=gen), torch.tensor([0, 1, 2, 1])
    ctx = context(0, state)
    ctx.shared = {MEAN_X: torch.randn(3, 4, generator=gen), MEAN_Y: torch.full((3, 3), 1 / 3)}
    loss, metrics = algo.loss(state, Batch(x, y, {PICK: torch.tensor([0.1, 0.5, 0.9, 0.4])}), ctx)
    assert metrics.keys() == {"ce", "ce_mean", "taylor"}
    logits = setup.model.logits(state, 0.8 * x)
    assert metrics["ce"].item() == pytest.approx(torch.nn.functional.cross_entropy(logits, y).item(), rel=1e-6)
    uniform = -torch.log_softmax(logits, 1).mean(1).mean()  # soft labels 1/3 each
    assert metrics["ce_mean"].item() == pytest.approx(uniform.item(), rel=1e-6)
    combined = 0.8 * metrics["ce"] + 0.2 * metrics["ce_mean"] + 0.2 * metrics["taylor"]
    assert loss.item() == pytest.approx(combined.item(), rel=1e-6)


def test_soft_cross_entropy_normalises_over_classes_without_a_warning():
    """``-sum_k t_k log softmax_k`` over the class dimension, named explicitly (an implicit one warns every step)."""
    logits, target = torch.tensor([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]]), torch.tensor([[0.2, 0.8, 0.0], [0.0, 0.0, 1.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        value = soft_cross_entropy(logits, target)
    expected = -(target * torch.log_softmax(logits, dim=1)).sum(1).mean()
    assert value.item() == pytest.approx(expected.item(), rel=1e-6)
