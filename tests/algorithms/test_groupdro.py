"""Group DRO (Sagawa et al. 2020): group losses, the exponentiated-gradient step on q, its
persistence across rounds, FedBR's client-level variant, learning and vectorisation."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from hetfl import config
from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import Batch, ClientContext, ModelCaller, Upload
from hetfl.algorithms.groupdro import (
    CLIENT_LOGQ,
    GLOBAL_LOSS,
    LOGQ,
    PRESENT,
    eg_update,
    group_losses,
    group_weights,
)
from hetfl.engine.checkpoint import load_checkpoint
from hetfl.engine.experiment import Experiment
from hetfl.engine.local import sgd_step
from hetfl.params import ConfigError
from tests.helpers import SMALL_MNIST, TinyNet, initial_state, needs_shared_data, perturbed, tiny_setup
from tests.helpers.executors import SYNTHETIC, compare_one_round

pytestmark = pytest.mark.usefixtures("one_thread")


def client_ctx(algo, state, labels: torch.Tensor, client: int = 0) -> ClientContext:
    x = torch.randn(len(labels), 4, generator=torch.Generator().manual_seed(client))
    ctx = ClientContext(client, 1, len(labels), 0.1, state, {}, inputs=lambda: Batch(x, labels))
    ctx.state = algo.init_client_state(client, algo.init_server(state))
    ctx.extras = algo.begin(ctx)
    return ctx


def test_group_losses_are_per_group_means():
    losses = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0])
    labels = torch.tensor([0, 0, 2, 2, 3])
    torch.testing.assert_close(group_losses(losses, labels, 5), torch.tensor([1.5, 0.0, 3.5, 10.0, 0.0]))


def test_group_weights_are_a_softmax_over_present_groups():
    q = group_weights(torch.log(torch.tensor([2.0, 5.0, 1.0, 1.0])), torch.tensor([1.0, 0.0, 1.0, 1.0]))
    torch.testing.assert_close(q, torch.tensor([0.5, 0.0, 0.25, 0.25]))


def test_eg_step_matches_a_hand_computation():
    """One q step is Sagawa et al.'s q_g <- q_g exp(eta L_g) / Z; the main step then weights by the new q."""
    setup = tiny_setup()
    algo = build_algorithm("groupdro", {"eta": 0.5}, setup)
    assert algo.hp.groups == "classes"
    state0 = perturbed(initial_state(setup), 0.5, seed=3)
    ctx = client_ctx(algo, state0, torch.tensor([0, 1, 2, 0, 1, 2]))
    state = algo.start_state(ctx)
    q0 = torch.tensor([0.5, 0.3, 0.2])
    state[LOGQ] = q0.log()
    batch = Batch(torch.randn(5, 4, generator=torch.Generator().manual_seed(7)), torch.tensor([0, 0, 1, 2, 2]))
    per_sample = F.cross_entropy(setup.model.logits(state, batch.x), batch.y, reduction="none").detach()
    losses = [per_sample[:2].mean().item(), per_sample[2].item(), per_sample[3:].mean().item()]
    weights = [q * math.exp(0.5 * loss) for q, loss in zip(q0.tolist(), losses, strict=True)]
    expected = torch.tensor([w / sum(weights) for w in weights])

    (stage,) = algo.stages(ctx)
    adversary = stage.adversary
    assert adversary is not None and adversary.trainable == (LOGQ,)
    assert (adversary.sgd.lr, adversary.sgd.momentum, adversary.sgd.weight_decay) == (0.5, 0.0, 0.0)
    new, _, _, _ = sgd_step(adversary, state, {}, batch, ctx, first_step=True)
    assert set(new) == {LOGQ}  # the q step moves q only
    q1 = group_weights(new[LOGQ], ctx.extras[PRESENT])
    torch.testing.assert_close(q1, expected)
    torch.testing.assert_close(q1, eg_update(q0, torch.tensor(losses), 0.5))
    gain = q1 / q0  # the group with the largest loss gains the most weight
    assert gain.argmax().item() == max(range(3), key=lambda g: losses[g])
    # the model step minimises sum_g q_g L_g with the updated q
    robust, metrics = algo.loss({**state, **new}, batch, ctx)
    assert robust.item() == pytest.approx(sum(q * loss for q, loss in zip(expected.tolist(), losses, strict=True)),
                                          rel=1e-5)
    assert metrics["ce"].item() == pytest.approx(per_sample.mean().item(), rel=1e-5)


def test_the_q_step_leaves_batchnorm_statistics_to_the_model_step():
    setup = tiny_setup()
    model = TinyNet(projector=False, batchnorm=True)
    names = [n for n, _ in model.named_parameters()]
    setup.model = ModelCaller(model)
    setup.groups = {"encoder": [n for n in names if n.startswith("encoder.")], "projector": [],
                    "classifier": [n for n in names if n.startswith("classifier.")]}
    algo = build_algorithm("groupdro", {}, setup)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ctx = client_ctx(algo, state, torch.tensor([0, 1, 2]))
    (stage,) = algo.stages(ctx)
    local = algo.start_state(ctx)
    batch = Batch(torch.randn(6, 4, generator=torch.Generator().manual_seed(1)) + 3.0, torch.tensor([0, 1, 2] * 2))
    buffers = setup.model.buffer_names
    new, *_ = sgd_step(stage.adversary, local, {}, batch, ctx, first_step=True, buffers=buffers)
    assert torch.equal(new["encoder.1.running_mean"], local["encoder.1.running_mean"])  # no second update
    new, *_ = sgd_step(stage, local, {}, batch, ctx, first_step=True, buffers=buffers)
    assert not torch.equal(new["encoder.1.running_mean"], local["encoder.1.running_mean"])


def test_absent_classes_are_outside_the_simplex_and_q_persists():
    setup = tiny_setup()
    algo = build_algorithm("groupdro", {"eta": 1.0}, setup)
    state = initial_state(setup)
    ctx = client_ctx(algo, state, torch.tensor([0, 2, 2, 0, 2]))  # class 1 absent
    assert ctx.extras[PRESENT].tolist() == [1.0, 0.0, 1.0]
    local = algo.start_state(ctx)
    torch.testing.assert_close(group_weights(local[LOGQ], ctx.extras[PRESENT]), torch.tensor([0.5, 0.0, 0.5]))
    (stage,) = algo.stages(ctx)
    for i in range(3):
        batch = Batch(torch.randn(4, 4, generator=torch.Generator().manual_seed(i)), torch.tensor([0, 2, 0, 2]))
        new, *_ = sgd_step(stage.adversary, local, {}, batch, ctx, first_step=i == 0)
        local = {**local, **new}
    upload, new_state = algo.finish(ctx, local, 3)
    assert LOGQ not in upload and set(upload) == set(setup.model.state_names)  # q never leaves the client
    q = group_weights(new_state[LOGQ], ctx.extras[PRESENT])
    assert q[1] == 0 and q.sum().item() == pytest.approx(1.0)
    torch.testing.assert_close(q, group_weights(local[LOGQ], ctx.extras[PRESENT]))
    assert torch.logsumexp(new_state[LOGQ][[0, 2]], 0).item() == pytest.approx(0.0, abs=1e-6)  # stored as log q
    # the next round starts from it
    nxt = ClientContext(0, 2, 5, 0.1, state, new_state, ctx.extras, inputs=ctx.inputs)
    assert torch.equal(algo.start_state(nxt)[LOGQ], new_state[LOGQ])


def test_clients_variant_weights_the_average_by_exponentiated_losses():
    setup = tiny_setup(num_clients=3)
    algo = build_algorithm("groupdro", {"groups": "clients", "eta": 0.5}, setup)
    server = algo.init_server(initial_state(setup))
    assert torch.equal(server.extra[CLIENT_LOGQ], torch.zeros(3))
    assert algo.stages(ClientContext(0, 1, 5, 0.1, server.model, {}))[0].adversary is None
    # begin: the received model's cross-entropy on the client's data, from its features
    z, y = torch.randn(6, 8), torch.tensor([0, 1, 2, 2, 1, 0])
    ctx = ClientContext(1, 1, 6, 0.1, server.model, {}, features=lambda s: (z, y))
    ctx.extras = algo.begin(ctx)
    expected = F.cross_entropy(F.linear(z, server.model["classifier.weight"], server.model["classifier.bias"]), y)
    torch.testing.assert_close(ctx.extras[GLOBAL_LOSS], expected)
    upload, _ = algo.finish(ctx, algo.start_state(ctx), 1)
    assert GLOBAL_LOSS in upload
    # aggregation: weights proportional to q_k, q_k accumulating exp(eta L_k) over rounds
    models = [{k: v + c for k, v in server.model.items()} for c in range(3)]
    losses = [1.0, 2.0, 4.0]
    ups = [Upload(c, {**models[c], GLOBAL_LOSS: torch.tensor(losses[c])}, num_samples=10 * (c + 1), steps=1)
           for c in (0, 2)]
    new = algo.aggregate(server, ups, 1)
    torch.testing.assert_close(new.extra[CLIENT_LOGQ], torch.tensor([0.5, 0.0, 2.0]))
    w0, w2 = math.exp(0.5), math.exp(2.0)
    for name, value in server.model.items():
        torch.testing.assert_close(new.model[name], value + 2 * w2 / (w0 + w2), rtol=1e-5, atol=1e-6)
    assert GLOBAL_LOSS not in new.model
    again = algo.aggregate(new, ups, 2)
    torch.testing.assert_close(again.extra[CLIENT_LOGQ], torch.tensor([1.0, 0.0, 4.0]))


def test_settings_are_validated():
    with pytest.raises(ConfigError, match="algorithm.groups"):
        build_algorithm("groupdro", {"groups": "domains"}, tiny_setup())
    with pytest.raises(ConfigError, match="algorithm.eta"):
        build_algorithm("groupdro", {"eta": -0.1}, tiny_setup())


@pytest.mark.slow  # fast cover: tests/engine/test_vectorized.py's every-method test (groupdro)
@pytest.mark.parametrize("groups", ["classes", "clients"])
def test_vectorised_equals_sequential(groups):
    exp = Experiment(config.load(None, [*SYNTHETIC, "data.num_clients=12", "data.partition=dirichlet",
                                        "algorithm.name=groupdro", f"algorithm.groups={groups}", "algorithm.eta=0.2"]))
    compare_one_round(exp)


@needs_shared_data
@pytest.mark.parametrize("groups", ["classes", "clients"])
def test_groupdro_learns(groups, tmp_path):
    cfg = config.load(None, [*SMALL_MNIST, "algorithm.name=groupdro", f"algorithm.groups={groups}"])
    summary = Experiment(cfg).run(tmp_path)
    detail = json.dumps({k: v for k, v in summary.items() if k != "config"})
    assert summary["final_global_acc"] > 0.6, detail  # chance: about 0.1
    assert summary["final_client_acc_mean"] > 0.6, detail
    ckpt = load_checkpoint(tmp_path, torch.device("cpu"))
    if groups == "classes":  # every client's q moved away from uniform and stays on the simplex
        for state in ckpt.clients.values():
            q = torch.softmax(state[LOGQ], 0)
            assert q.max() - q.min() > 1e-4
    else:
        assert (ckpt.server.extra[CLIENT_LOGQ] > 0).all()


def test_the_worst_group_metric_is_the_largest_loss_of_a_group_the_client_holds():
    """``worst_group_loss`` (the q step's metric) is max_g L_g over the client's classes: a class it lacks (here
    class 1) has no loss and is no group, so it neither enters the maximum nor makes it undefined."""
    setup = tiny_setup()
    algo = build_algorithm("groupdro", {"eta": 0.5}, setup)
    ctx = client_ctx(algo, perturbed(initial_state(setup), 0.5, seed=3), torch.tensor([0, 0, 2, 2]))
    state = algo.start_state(ctx)
    batch = Batch(torch.randn(4, 4, generator=torch.Generator().manual_seed(7)), torch.tensor([0, 2, 2, 0]))
    per_sample = F.cross_entropy(setup.model.logits(state, batch.x), batch.y, reduction="none").detach()
    by_class = [per_sample[batch.y == c].mean().item() for c in (0, 2)]
    _, metrics = algo.q_loss(state, batch, ctx)
    assert metrics["worst_group_loss"].item() == pytest.approx(max(by_class), rel=1e-6)
