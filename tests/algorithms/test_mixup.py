"""Mixup and FedMix: draws from the client's stream, mixed losses, FedMix's set-up round."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from hetfl import config
from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import SHARED, Batch, ServerState
from hetfl.algorithms.fedmix import MEAN_X, MEAN_Y, PICK, averaged_data
from hetfl.algorithms.mixup import LAM, PERM, mixup_draws
from hetfl.engine.experiment import Experiment
from tests.helpers import context, initial_state, tiny_setup


def test_mixup_draws_are_a_permutation_and_a_beta_weight_from_the_generator():
    draw = mixup_draws(0.4)
    first = draw(torch.Generator().manual_seed(3), 16)
    again = draw(torch.Generator().manual_seed(3), 16)
    assert torch.equal(first[PERM], again[PERM]) and torch.equal(first[LAM], again[LAM])
    assert sorted(first[PERM].tolist()) == list(range(16))
    lams = torch.stack([draw(torch.Generator().manual_seed(s), 4)[LAM] for s in range(400)])
    assert lams.min() >= 0 and lams.max() <= 1
    # each generator state gives its own lam (the Beta draw's seed spans 2^62 values, not a handful)
    assert len(set(lams.tolist())) > 350
    # Beta(0.4, 0.4): mean 1/2, variance 1 / (4 (2 alpha + 1)) = 0.1389
    assert lams.mean().item() == pytest.approx(0.5, abs=0.05)
    assert lams.var().item() == pytest.approx(1 / (4 * 1.8), abs=0.03)


def test_mixup_loss_is_the_mixed_cross_entropy():
    setup = tiny_setup()
    algo = build_algorithm("mixup", {}, setup)
    state = initial_state(setup)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 4, generator=gen), torch.tensor([0, 1, 2, 0, 1])
    perm, lam = torch.tensor([4, 3, 2, 1, 0]), torch.tensor(0.3)
    batch = Batch(x, y, {PERM: perm, LAM: lam})
    loss, metrics = algo.loss(state, batch, context(0, state))
    logits = setup.model.logits(state, 0.3 * x + 0.7 * x[perm])
    expected = 0.3 * F.cross_entropy(logits, y) + 0.7 * F.cross_entropy(logits, y[perm])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert metrics.keys() == {"ce"} and metrics["ce"].item() == pytest.approx(expected.item(), rel=1e-6)
    (stage,) = algo.stages(context(0, state))
    assert stage.draws is not None


def test_mixup_stage_draws_lam_from_the_configured_beta():
    setup = tiny_setup()
    algo = build_algorithm("mixup", {"alpha": 0.4}, setup)
    (stage,) = algo.stages(context(0, initial_state(setup)))
    got = stage.draws(torch.Generator().manual_seed(5), 8)
    want = mixup_draws(0.4)(torch.Generator().manual_seed(5), 8)
    assert torch.equal(got[PERM], want[PERM]) and torch.equal(got[LAM], want[LAM])
    assert not torch.equal(got[LAM], mixup_draws(1.0)(torch.Generator().manual_seed(5), 8)[LAM])


def test_averaged_data_means_disjoint_groups():
    x = torch.arange(7.0).unsqueeze(1)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0])
    means_x, means_y = averaged_data(x, y, 3, 3, torch.Generator().manual_seed(0))
    assert means_x.shape == (3, 1) and means_y.shape == (3, 3)  # groups of 3, 3 and 1
    # every sample is used exactly once: group sizes weight the means back to the total
    sizes = torch.tensor([3.0, 3.0, 1.0])
    assert (means_x.squeeze(1) * sizes).sum().item() == pytest.approx(x.sum().item())
    assert torch.allclose((means_y * sizes[:, None]).sum(0), torch.tensor([3.0, 2.0, 2.0]))
    assert torch.allclose(means_y.sum(1), torch.ones(3))


def test_fedmix_loss_and_gradient_match_the_taylor_formula():
    setup = tiny_setup()
    algo = build_algorithm("fedmix", {"lam": 0.2}, setup)
    state = initial_state(setup)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 4, generator=gen), torch.tensor([0, 1, 2, 1])
    means_x, means_y = torch.randn(3, 4, generator=gen), F.softmax(torch.randn(3, 3, generator=gen), 1)
    ctx = context(0, state)
    ctx.shared = {MEAN_X: means_x, MEAN_Y: means_y}
    pick_u = torch.tensor([0.1, 0.5, 0.9, 0.4])  # -> means 0, 1, 2, 1
    batch = Batch(x, y, {PICK: pick_u})
    params = {k: v.clone().requires_grad_() for k, v in state.items()}
    loss, _ = algo.loss(params, batch, ctx)
    got = torch.autograd.grad(loss, list(params.values()))

    # reference: the input derivative by autograd with create_graph
    ref_params = {k: v.clone().requires_grad_() for k, v in state.items()}
    scaled = (0.8 * x).requires_grad_()
    logits = setup.model.logits(ref_params, scaled)
    ce_sum = F.cross_entropy(logits, y, reduction="sum")
    (dx,) = torch.autograd.grad(ce_sum, scaled, create_graph=True)
    pick = torch.tensor([0, 1, 2, 1])
    ce_mean = -(means_y[pick] * F.log_softmax(logits, 1)).sum(1).mean()
    expected = 0.8 * F.cross_entropy(logits, y) + 0.2 * ce_mean + 0.2 * (dx * means_x[pick]).sum(1).mean()
    want = torch.autograd.grad(expected, list(ref_params.values()))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, atol=1e-6)


def test_fedmix_on_a_batchnorm_model_updates_the_running_statistics_once_a_step():
    """The input derivative's forward is the step's forward: on a model with BatchNorm (feduv_cnn, the ResNets)
    it updates the running statistics, once, as a plain training step's forward of the scaled batch would. Its
    update used to mutate the captured state inside torch.func.grad: every FedMix run on such a model stopped at
    its first step ("attempted to call in-place operation ... that would mutate a captured Tensor")."""
    import dataclasses

    from hetfl.algorithms.base import ModelCaller
    from tests.helpers import TinyNet

    model = TinyNet(projector=False, batchnorm=True).train()
    names = [n for n, _ in model.named_parameters()]
    setup = dataclasses.replace(tiny_setup(), model=ModelCaller(model), groups={
        "encoder": [n for n in names if n.startswith("encoder.")], "projector": [],
        "classifier": [n for n in names if n.startswith("classifier.")]})
    algo = build_algorithm("fedmix", {"lam": 0.2}, setup)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 4, generator=gen), torch.tensor([0, 1, 2, 1])
    ctx = context(0, state)
    ctx.shared = {MEAN_X: torch.randn(3, 4, generator=gen), MEAN_Y: F.softmax(torch.randn(3, 3, generator=gen), 1)}
    reference = {k: v.clone() for k, v in state.items()}
    want_logits = setup.model.logits(reference, 0.8 * x)  # a training step's forward of the scaled batch
    _, metrics = algo.loss(state, Batch(x, y, {PICK: torch.tensor([0.1, 0.5, 0.9, 0.4])}), ctx)
    assert metrics["ce"].item() == pytest.approx(F.cross_entropy(want_logits, y).item(), rel=1e-6)
    for name in ("encoder.1.running_mean", "encoder.1.running_var", "encoder.1.num_batches_tracked"):
        assert torch.equal(state[name], reference[name]), name  # updated, and once
    assert state["encoder.1.num_batches_tracked"].item() == 1


def test_fedmix_setup_round_pools_every_clients_means():
    setup = tiny_setup(num_clients=2)
    algo = build_algorithm("fedmix", {"mash_size": 2}, setup)
    server = algo.init_server(initial_state(setup))
    replies = {}
    for c in (1, 0):
        ctx = context(c, {})
        data = Batch(torch.full((4, 4), float(c)), torch.tensor([c, c, c, c]))
        ctx.inputs = lambda data=data: data
        replies[c] = algo.setup_query(ctx)
    new = algo.setup_aggregate(server, replies)
    assert isinstance(new, ServerState)
    pooled_x, pooled_y = new.extra[SHARED + MEAN_X], new.extra[SHARED + MEAN_Y]
    assert pooled_x.shape == (4, 4)
    assert torch.equal(pooled_x[:2], torch.zeros(2, 4)) and torch.equal(pooled_x[2:], torch.ones(2, 4))
    assert torch.equal(pooled_y[:2].argmax(1), torch.tensor([0, 0]))


def test_fedmix_run_counts_the_setup_traffic_once(tmp_path):
    base = ["train.rounds=2", "runtime.progress=false"]
    lines = {}
    for name in ("fedavg", "fedmix"):
        Experiment(config.load(None, [*base, f"algorithm.name={name}"])).run(tmp_path / name)
        lines[name] = [json.loads(raw) for raw in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    extra_up = lines["fedmix"][0]["bytes_up"] - lines["fedavg"][0]["bytes_up"]
    assert extra_up > 0  # the averaged data went up in the set-up round
    assert lines["fedmix"][1]["bytes_up"] == lines["fedavg"][1]["bytes_up"]  # and only then
    assert lines["fedmix"][1]["bytes_down"] == lines["fedavg"][1]["bytes_down"]
