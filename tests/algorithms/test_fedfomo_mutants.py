"""FedFomo's validation split, its distances, evaluation mode and integer buffers (mutation testing,
session 26; Zhang et al., ICLR 2021)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import Batch, Upload
from hetfl.algorithms.fedfomo import fomo_weights
from tests.algorithms.test_personalized_baselines import bn_setup
from tests.helpers import context, initial_state, perturbed, tiny_setup

X = torch.randn(10, 4, generator=torch.Generator().manual_seed(11))
Y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])


def make(params=None, setup=None):
    setup = setup or tiny_setup()
    algo = build_algorithm("fedfomo", params or {}, setup)
    return algo, algo.init_server(initial_state(setup))


def own_context(algo, server, client=1, data=(X, Y)):
    state = {"fedfomo.model/" + n: t for n, t in server.model.items()}
    ctx = context(client, algo.payload(server, client), state)
    ctx.inputs = lambda: Batch(*data)
    return ctx


@pytest.mark.parametrize(("fraction", "n", "size"), [(0.2, 10, 2), (0.25, 10, 3), (0.1, 3, 1), (1.0, 10, 10)])
def test_the_validation_split_is_a_fixed_ceil_share_of_at_least_one_sample(fraction, n, size):
    """``ceil(val_fraction * n)`` samples (at least one), the same in every round, rows of the client's data."""
    algo, server = make({"val_fraction": fraction})
    ctx = own_context(algo, server, data=(X[:n], Y[:n]))
    batch = algo.validation_batch(ctx)
    assert len(batch.y) == size == len(set(map(tuple, batch.x.tolist())))
    rows = {tuple(r) for r in X[:n].tolist()}
    assert all(tuple(r) in rows for r in batch.x.tolist())
    ctx.round = 7
    assert torch.equal(algo.validation_batch(ctx).x, batch.x)


def test_fedfomo_without_the_clients_data_says_what_it_needs():
    algo, server = make()
    ctx = own_context(algo, server)
    ctx.inputs = None
    with pytest.raises(ValueError) as err:
        algo.validation_batch(ctx)
    assert str(err.value) == "fedfomo needs the client's data (ClientContext.inputs)"


@pytest.mark.parametrize(("distance", "order"), [("l2", 2), ("l1", 1)])
def test_the_model_distance_is_the_chosen_norm_of_all_parameters(distance, order):
    algo, server = make({"distance": distance})
    other = perturbed(server.model, 0.3, 12)
    diff = torch.cat([(other[n] - server.model[n]).flatten() for n in algo.model.param_names])
    assert torch.allclose(algo.distance(other, server.model), diff.norm(p=order))


def test_validation_losses_are_measured_in_evaluation_mode_and_change_no_statistics():
    """BatchNorm normalises with the stored running statistics, which stay as they were; the module's
    training flag is put back."""
    algo, server = make(setup=bn_setup())
    state = perturbed(server.model, 0.2, 13)
    state = {n: (server.model[n] if not t.is_floating_point() else t) for n, t in state.items()}
    state["encoder.1.running_var"] = state["encoder.1.running_var"].abs() + 0.5
    before = {n: t.clone() for n, t in state.items()}
    module = algo.model.module
    module.train()
    loss = algo.validation_loss(state, Batch(X, Y))
    assert module.training
    assert all(torch.equal(state[n], before[n]) for n in state)
    module.eval()
    expected = F.cross_entropy(torch.func.functional_call(module, before, (X,)), Y)
    module.train()
    assert torch.allclose(loss, expected, atol=1e-6)


def test_the_combination_leaves_integer_buffers_at_the_clients_own():
    """``num_batches_tracked`` is a count, not a weight: the start model keeps the client's own."""
    algo, server = make({"num_models": 2, "val_fraction": 1.0}, setup=bn_setup())
    models = {c: perturbed(server.model, 0.2, 40 + c) for c in range(3)}
    for c, m in models.items():
        m["encoder.1.num_batches_tracked"] = torch.tensor(10 * (c + 1))
        m["encoder.1.running_var"] = m["encoder.1.running_var"].abs() + 0.5
    server = algo.aggregate(server, [Upload(c, models[c], 10, 1) for c in range(3)], 1)
    own = {n: (t + 3.0 * torch.randn(t.shape, generator=torch.Generator().manual_seed(14))
               if t.is_floating_point() and "running" not in n else t) for n, t in models[1].items()}
    ctx = context(1, algo.payload(server, 1), {"fedfomo.model/" + n: t for n, t in own.items()})
    ctx.inputs = lambda: Batch(X, Y)
    ctx.extras = algo.begin(ctx)
    assert ctx.extras["weights"].sum() > 0  # a far-off own model: the downloaded ones help
    start = algo.start_state(ctx)
    count = start["encoder.1.num_batches_tracked"]
    assert count.dtype == torch.long and int(count) == 20
    assert int(server.extra["fedfomo.round"]) == 1


def test_a_client_with_nothing_downloaded_starts_from_its_own_model():
    algo, server = make()
    ctx = own_context(algo, server)
    extras = algo.begin(ctx)
    assert extras["weights"].numel() == 0
    ctx.extras = extras
    assert all(torch.equal(algo.start_state(ctx)[n], server.model[n]) for n in server.model)


def test_weights_divide_the_loss_gain_by_distances_below_one_too():
    """``(L_own - L_n) / d_n`` with d_n = 0.5 and 2: raw 0.2 / 0.5 = 0.4 and 0.2 / 2 = 0.1."""
    w = fomo_weights(torch.tensor(1.0), torch.tensor([0.8, 0.8]), torch.tensor([0.5, 2.0]))
    assert torch.allclose(w, torch.tensor([0.8, 0.2]))


def test_one_model_is_downloaded_when_num_models_is_one():
    algo, server = make({"num_models": 1})
    models = {c: perturbed(server.model, 0.2, 30 + c) for c in range(4)}
    server = algo.aggregate(server, [Upload(c, models[c], 10, 1) for c in range(4)], 1)
    ids = algo.payload(server, 2)["fedfomo.candidate_ids"]
    assert ids.dtype == torch.long and len(ids) == 1 and int(ids[0]) != 2
    assert algo.payload(algo.init_server(server.model), 2)["fedfomo.candidate_ids"].dtype == torch.long


def test_clients_draw_their_models_and_validation_splits_independently():
    """Each client's draws come from its own stream: over a few rounds, clients do not all pick the same
    positions among the others; clients with the same data do not all validate on the same rows."""
    algo, server = make({"num_models": 2})
    models = {c: perturbed(server.model, 0.2, 30 + c) for c in range(4)}
    patterns = set()
    for round_ in range(1, 6):
        server = algo.aggregate(server, [Upload(c, models[c], 10, 1) for c in range(4)], round_)
        for c in range(4):
            others = [o for o in range(4) if o != c]
            ids = algo.payload(server, c)["fedfomo.candidate_ids"].tolist()
            patterns.add((round_, tuple(others.index(i) for i in ids)))
    assert len(patterns) > 5  # not one pattern per round shared by all clients
    rows = set()
    for c in range(4):
        ctx = own_context(algo, server, client=c)
        rows.add(tuple(map(tuple, algo.validation_batch(ctx).x.tolist())))
    assert len(rows) > 1
