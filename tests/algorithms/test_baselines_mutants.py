"""The baselines' update rules: behaviours that mutation testing (benchmarks/mutation.py) found untested.

Each test kills surviving mutants of ``src/hetfl/algorithms/{scaffold,feddyn,fednova,moon}.py``:
SCAFFOLD's first-round control variate and option II with one local step, FedDyn's local objective
with a non-trivial state and a moved model, FedNova with a one-step client and a server state that
stays checkpointable, MOON's logged metric names and the device of its targets (the ``meta`` device
stands in for a GPU). The mutants that no input can tell apart are listed, with reasons, in
``benchmarks/results/mutation/<target>.equivalent.md``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import Batch, Upload
from hetfl.algorithms.moon import PREV, model_contrastive_loss
from hetfl.algorithms.scaffold import C
from hetfl.engine.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from tests.helpers import context, initial_state, perturbed, tiny_setup

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH = Batch(torch.randn(6, 4, generator=torch.Generator().manual_seed(5)), torch.tensor([0, 1, 2, 0, 1, 2]))


def make(name, params=None, **setup_kw):
    setup = tiny_setup(**setup_kw)
    algo = build_algorithm(name, params or {}, setup)
    return algo, setup, algo.init_server(initial_state(setup))


def random_like(state, names, seed):
    """Tensors of ``names`` shaped as in ``state``, entries N(0, 1) (non-zero, not all equal)."""
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(state[n].shape, generator=gen) for n in names}


# ------------------------------------------------------------------------------ SCAFFOLD
def test_scaffold_client_control_variate_starts_at_zero():
    """Karimireddy et al. 2020, Algorithm 1: c_i is initialised to 0, one tensor per parameter shaped as
    the server's c, whatever c is by the time the client first participates."""
    algo, _, server = make("scaffold")
    server.extra = {n: torch.full_like(t, 0.7) for n, t in server.extra.items()}
    c_i = algo.init_client_state(3, server)
    assert set(c_i) == set(algo.model.param_names)
    for n in algo.model.param_names:
        assert c_i[n].shape == server.model[n].shape
        assert torch.count_nonzero(c_i[n]) == 0


def test_scaffold_option_two_with_a_single_local_step():
    """Option II with K = 1: c_i+ = c_i - c + (x - y) / eta_l (K counts the steps actually taken)."""
    algo, _, server = make("scaffold")
    server.extra = random_like(server.model, algo.model.param_names, 1)
    c_i = random_like(server.model, algo.model.param_names, 2)
    ctx = context(0, algo.payload(server, 0), c_i, lr=0.1)
    local = perturbed(server.model, 0.05, 3)
    upload, new_c = algo.finish(ctx, local, steps=1)
    for n in algo.model.param_names:
        expected = c_i[n] - server.extra[n] + (server.model[n] - local[n]) / 0.1
        torch.testing.assert_close(new_c[n], expected)
        torch.testing.assert_close(upload[C + n], expected - c_i[n])


# ------------------------------------------------------------------------------ FedDyn
def test_feddyn_local_objective_by_hand():
    """Acar et al. 2021, Algorithm 1: L_k(w) - <grad L_k(w_k^{t-1}), w> + alpha/2 ||w - w^{t-1}||^2, with a
    random client state (the stored gradient) and a local model away from the global one (alpha = 0.1)."""
    algo, _, server = make("feddyn", {"alpha": 0.1})
    names = algo.model.param_names
    grad_prev = random_like(server.model, names, 7)
    local = perturbed(server.model, 0.3, 8)
    ctx = context(0, server.model, grad_prev)
    loss, _ = algo.loss(local, BATCH, ctx)
    ce = F.cross_entropy(algo.model.logits(local, BATCH.x), BATCH.y)
    linear = sum((local[n] * grad_prev[n]).sum() for n in names)
    quadratic = sum(((local[n] - server.model[n]) ** 2).sum() for n in names)
    assert 0.05 * quadratic > 0.1  # the quadratic term is well above the tolerance
    torch.testing.assert_close(loss, ce - linear + 0.05 * quadratic)


def test_feddyn_local_gradient_is_ce_minus_state_plus_alpha_drift():
    """The gradient of the local objective is grad CE - grad L_k(w_k^{t-1}) + alpha (w - w^{t-1}): the
    client's first-order condition behind the state update of Algorithm 1."""
    algo, _, server = make("feddyn", {"alpha": 0.1})
    names = algo.model.param_names
    grad_prev = random_like(server.model, names, 9)
    local = {n: t.clone().requires_grad_(n in names) for n, t in perturbed(server.model, 0.3, 10).items()}
    loss, _ = algo.loss(local, BATCH, context(0, server.model, grad_prev))
    grads = torch.autograd.grad(loss, [local[n] for n in names])
    ce = F.cross_entropy(algo.model.logits(local, BATCH.x), BATCH.y)
    ce_grads = torch.autograd.grad(ce, [local[n] for n in names])
    for n, g, g_ce in zip(names, grads, ce_grads, strict=True):
        torch.testing.assert_close(g, g_ce - grad_prev[n] + 0.1 * (local[n] - server.model[n]).detach())


# ------------------------------------------------------------------------------ FedNova
def test_fednova_client_with_one_local_step_has_a_equal_one():
    """Wang et al. 2020, eq. (6)-(7) without momentum: a_i = tau_i, so a client that took one step has
    a_i = 1 (p = (1/2, 1/2), tau = (1, 3): tau_eff = 2)."""
    algo, _, server = make("fednova")
    ups = [Upload(0, perturbed(server.model, 0.1, 11), 20, 1), Upload(1, perturbed(server.model, 0.1, 12), 20, 3)]
    new = algo.aggregate(server, ups, 1)
    for n in algo.model.param_names:
        w = server.model[n]
        direction = 0.5 / 1 * (w - ups[0].tensors[n]) + 0.5 / 3 * (w - ups[1].tensors[n])
        torch.testing.assert_close(new.model[n], w - 2.0 * direction)


def test_fednova_server_state_survives_a_checkpoint(tmp_path):
    """FedNova keeps no method tensors on the server; its aggregated state is saved and restored as is
    (the engine checkpoints ``server.extra`` and reads it every round)."""
    algo, _, server = make("fednova")
    ups = [Upload(0, perturbed(server.model, 0.1, 13), 20, 2), Upload(1, perturbed(server.model, 0.1, 14), 10, 4)]
    new = algo.aggregate(server, ups, 1)
    save_checkpoint(tmp_path, Checkpoint(round=1, server=new, clients={}, info={}))
    loaded = load_checkpoint(tmp_path, torch.device("cpu"))
    assert loaded is not None and loaded.server.extra == {}
    for n, t in new.model.items():
        torch.testing.assert_close(loaded.server.model[n], t)


# ------------------------------------------------------------------------------ MOON
def test_moon_logs_cross_entropy_and_contrastive_term_by_name():
    """After the first round the logged metrics are ``ce`` (the plain cross-entropy) and ``contrastive``."""
    algo, _, server = make("moon", {"mu": 1.0})
    previous = perturbed(server.model, 0.3, 15)
    local = perturbed(server.model, 0.3, 16)
    ctx = context(0, server.model, {PREV + n: t for n, t in previous.items()})
    ctx.extras = algo.begin(ctx)
    _, metrics = algo.loss(local, BATCH, ctx)
    assert set(metrics) == {"ce", "contrastive"}
    torch.testing.assert_close(metrics["ce"], F.cross_entropy(algo.model.logits(local, BATCH.x), BATCH.y))


def test_moon_contrastive_targets_follow_the_inputs_device():
    """The loss's class targets are made on z's device, not on torch's default device (a CUDA run would
    otherwise mix devices); under a ``meta`` default device CPU inputs still give the hand value of
    test_moon_loss_has_the_global_model_as_positive_by_hand, log(1 + e^-1.2), on the CPU."""
    z, z_glob, z_prev = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.6, 0.8]]), torch.tensor([[0.0, 1.0]])
    with torch.device("meta"):
        value = model_contrastive_loss(z, z_glob, z_prev, 0.5)
    assert value.device.type == "cpu"
    assert value.item() == pytest.approx(math.log(1 + math.exp(-1.2)), rel=1e-6)
