"""What a run reports (``hetfl.engine.summary``): what mutation testing of the module (``benchmarks/mutation.py``
target ``engine_summary``, session 42) showed the whole-run tests leave unchecked.

``summary.json`` is an outside contract (``../shared/DESIGN.md``: users' scripts and hetfl's tables read its keys),
so it is checked here key for key from a history written by hand: the totals, the final and best accuracies, a
post-hoc step's accuracy before it (``final_global_acc_before_<step>``, the tables' "before" rows), the privacy
budget spent (the last line that states one), the wall time to the millisecond. Also the metrics line's summary
of the clients' accuracies and its loss parts.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from hetfl import config
from hetfl.engine import summary
from hetfl.engine.identity import run_id, setting_id
from hetfl.engine.rundir import History

EXP = SimpleNamespace(num_params=1234, device="cpu", chance_acc=0.125)


def line(round_: int, loss: float = 1.0, **more: float) -> dict:
    return {"round": round_, "train_loss": loss, "bytes_up": 10 * round_, "bytes_down": 100 * round_, **more}


def test_a_summary_key_for_key():
    cfg = config.load(None, ["algorithm.name=fedavg+ccvr", "train.rounds=3"])
    history = [
        line(1, 2.0, global_acc=0.7, client_acc_mean=0.4),
        line(2, 1.5, dp_epsilon=0.5, dp_delta=1e-5),  # not evaluated; a release's budget
        line(3, 0.5, global_acc=0.6, client_acc_mean=0.35, global_acc_before_ccvr=0.55, dp_epsilon=1.25,
             dp_delta=1e-5, dp_releases=2),
    ]
    tree = config.to_tree(cfg)
    assert summary.make_summary(cfg, history, 12.34567, EXP) == {
        "algorithm": "fedavg+ccvr", "rounds": 3, "wall_time_s": 12.346, "num_params": 1234,
        "bytes_up_total": 60, "bytes_down_total": 600,
        "final_global_acc": 0.6, "best_global_acc": 0.7, "chance_global_acc": 0.125,
        "final_global_acc_before_ccvr": 0.55,
        "final_client_acc_mean": 0.35, "best_client_acc_mean": 0.4,
        "privacy": {"epsilon": 1.25, "delta": 1e-5, "releases": 2},
        "final_train_loss": 0.5, "diverged_round": None,
        "config": tree, "setting_id": setting_id(tree), "run_id": run_id(tree),
    }


def test_the_budget_reported_is_the_last_one_a_line_states():
    cfg = config.load(None, [])
    history = [line(1, dp_epsilon=2.0), line(2, dp_epsilon=3.0), line(3)]  # a later line without a release
    assert summary.make_summary(cfg, history, 0.0, EXP)["privacy"] == {"epsilon": 3.0}


def test_a_summary_without_accuracies_or_rounds_says_so_by_leaving_them_out():
    cfg = config.load(None, [])
    personal = summary.make_summary(cfg, [line(1, client_acc_mean=0.5)], 1.0, EXP)  # no global model
    assert "final_global_acc" not in personal and "chance_global_acc" not in personal
    assert personal["final_client_acc_mean"] == personal["best_client_acc_mean"] == 0.5
    empty = summary.make_summary(cfg, [], 1.0, EXP)
    assert empty["rounds"] == 0 and empty["final_train_loss"] is None and empty["diverged_round"] is None
    assert not {k for k in empty if k.startswith(("final_global", "best_", "final_client", "privacy"))}


def test_a_diverged_round_is_the_first_nonfinite_train_loss():
    history = [line(1, 1.0), line(2, math.inf), line(3, math.nan)]
    assert summary.diverged_round(history) == 2
    assert summary.diverged_round([line(1), line(2)]) is None


def test_a_history_read_from_the_file_answers_from_what_it_tracked(tmp_path):
    history = History(tmp_path / "metrics.jsonl")
    history.first_nonfinite = 7  # what History tracked as its lines were added: not recomputed
    assert summary.diverged_round(history) == 7


def test_the_clients_spread_is_mean_std_count_and_quartiles_of_the_rounded_accuracies():
    accs = [0.1, 0.2, 0.30000004, 0.4, 0.5]
    out = summary.client_acc_summary(accs)
    assert out.pop("client_acc_mean") == pytest.approx(0.300000008, rel=1e-12)  # the accuracies as they are
    assert out.pop("client_acc_std") == pytest.approx(0.1414213562373095, rel=1e-9)
    assert out == {"clients_evaluated": 5, "client_acc_min": 0.1, "client_acc_q25": 0.2, "client_acc_median": 0.3,
                   "client_acc_q75": 0.4, "client_acc_max": 0.5}  # rounded to 6 decimals first
    assert list(out)[1:] == ["client_acc_min", "client_acc_q25", "client_acc_median", "client_acc_q75",
                             "client_acc_max"]
    assert summary.client_acc_summary([0.0, 1.0])["client_acc_q25"] == 0.25  # linear interpolation
    with pytest.warns(RuntimeWarning):
        none = summary.client_acc_summary([])
    assert none["clients_evaluated"] == 0 and not any(k in none for k in ("client_acc_min", "client_acc_max"))


def test_a_client_row_has_each_clients_accuracy_rounded_and_null_for_one_not_evaluated():
    assert summary.client_row(4, {0: 0.1234567, 2: 1.0}, 3) == {"round": 4, "client_acc": [0.123457, None, 1.0]}


def test_the_loss_parts_are_means_per_step_under_names_that_cannot_shadow_the_lines_own():
    parts = summary.loss_parts({"penalty": 3.0, "ce": 6.0, "loss": 1.5, "part": 0.75}, steps=3)
    assert parts == {"train_ce": 2.0, "train_part_loss": 0.5, "train_part_part": 0.25, "train_penalty": 1.0}
    assert list(parts) == ["train_ce", "train_part_loss", "train_part_part", "train_penalty"]
    assert summary.loss_parts({"ce": 2.0}, steps=0) == {"train_ce": 2.0}  # no step: the sums as they are
