"""Ditto's personal stage and what it logs (mutation testing, session 26; Li et al. ICML 2021, Algorithm 1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import Batch
from tests.helpers import context, initial_state, perturbed, tiny_setup

X, Y = torch.randn(6, 4, generator=torch.Generator().manual_seed(3)), torch.tensor([0, 1, 2, 0, 1, 2])


def make(params=None, **train):
    setup = tiny_setup(**train)
    algo = build_algorithm("ditto", params or {}, setup)
    return algo, algo.init_server(initial_state(setup))


@pytest.mark.parametrize("train", [{"local_epochs": 3}, {"local_steps": 7}], ids=["epochs", "steps"])
def test_the_personal_model_takes_as_many_updates_as_the_global_one_by_default(train):
    """``personal_epochs = 0``: the personal stage runs the global stage's epochs or steps (Algorithm 1)."""
    algo, server = make(**train)
    ctx = context(0, server.model, algo.init_client_state(0, server))
    global_stage, personal = algo.stages(ctx)
    assert [global_stage.name, personal.name] == ["local", "personal"]  # the names the logs show
    assert (personal.epochs, personal.steps) == (global_stage.epochs, global_stage.steps)
    assert (personal.epochs, personal.steps) == (train.get("local_epochs", 1), train.get("local_steps", 0))


def test_personal_epochs_set_the_personal_stage_in_epochs_even_when_the_run_counts_steps():
    algo, server = make({"personal_epochs": 4}, local_steps=7)
    ctx = context(0, server.model, algo.init_client_state(0, server))
    global_stage, personal = algo.stages(ctx)
    assert (global_stage.epochs, global_stage.steps) == (1, 7)
    assert (personal.epochs, personal.steps) == (4, 0)  # 0 steps: the epochs count


def test_the_personal_loss_reports_its_cross_entropy_and_its_distance_to_the_global_model():
    """The metrics become ``train_ce_personal`` and ``train_prox`` in metrics.jsonl:
    ``CE(v)`` and ``||v - w^t||^2`` (without lam / 2)."""
    algo, server = make({"lam": 0.7})
    w = server.model
    v = perturbed(w, 0.2, 6)
    ctx = context(0, w, {"ditto.personal/" + n: t for n, t in v.items()})
    loss, metrics = algo.personal_loss(algo.start_state(ctx), Batch(X, Y), ctx)
    ce = F.cross_entropy(algo.model.logits(v, X), Y)
    prox = sum(((v[n] - w[n]) ** 2).sum() for n in algo.model.param_names)
    assert set(metrics) == {"ce_personal", "prox"}
    assert torch.allclose(metrics["ce_personal"], ce) and torch.allclose(metrics["prox"], prox)
    assert torch.allclose(loss, ce + 0.35 * prox)
