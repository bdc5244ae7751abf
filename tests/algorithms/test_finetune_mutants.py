"""FedAvg+FT's fine-tuning settings reach the fine-tuning stage (mutation testing, session 26)."""

from __future__ import annotations

import pytest

from hetfl.algorithms import build_algorithm
from tests.helpers import context, initial_state, tiny_setup


@pytest.mark.parametrize("finetune_lr, expected", [(0.3, 0.3), (0.0, 0.05)])
def test_fine_tuning_runs_at_finetune_lr_and_falls_back_to_the_runs_lr(finetune_lr, expected):
    """``finetune_lr`` is the fine-tuning stage's step size; 0 means the run's ``train.lr``."""
    setup = tiny_setup(lr=0.05)
    algo = build_algorithm("fedavg_ft", {"finetune_lr": finetune_lr, "finetune_epochs": 2}, setup)
    server = algo.init_server(initial_state(setup))
    (stage,) = algo.personalize_stages(context(0, server.model))
    assert stage.sgd.lr == pytest.approx(expected)
    assert stage.epochs == 2
