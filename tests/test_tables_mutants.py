"""hetfl.tables: the compare table's numbers by hand (mutation audit, session 38).

Runs are built in memory (no configuration: rows group by method), so every number is computed here."""

from __future__ import annotations

import math
import statistics

import pytest

from hetfl.tables import (
    CHANCE_MARGIN,
    RunRecord,
    at_chance,
    diverged_count,
    mean_std,
    percent,
    rounds_to_target,
    table_rows,
    traffic_mb,
    with_spread,
)


def _run(method, seed, final, best, curve, **summary):
    metrics = [{"round": r, "global_acc": a} for r, a in curve]
    summary = {"final_global_acc": final, "best_global_acc": best, "wall_time_s": 10.0 * (seed + 1), **summary}
    return RunRecord(method, seed, summary, metrics)


def test_rounds_to_target_is_the_first_round_at_or_above_it():
    curve = [(1, 0.2), (2, 0.5), (3, 0.4), (4, 0.7)]
    assert rounds_to_target(curve, 0.5) == 2
    assert rounds_to_target(curve, 0.6) == 4
    assert rounds_to_target(curve, 0.2) == 1
    assert rounds_to_target(curve, 0.71) is None
    assert rounds_to_target([], 0.1) is None


def test_mean_std_is_the_sample_std_over_seeds():
    m, s = mean_std([0.5, 0.7, 0.9])
    assert m == pytest.approx(0.7) and s == pytest.approx(0.2)  # sqrt((0.04 + 0 + 0.04) / 2)
    assert s == pytest.approx(statistics.stdev([0.5, 0.7, 0.9]))
    assert mean_std([0.4]) == (0.4, 0.0)
    m, s = mean_std([])
    assert math.isnan(m) and math.isnan(s)


def test_with_spread_and_percent():
    assert with_spread(71.234, 1.5, 3) == "71.23 ± 1.50"
    assert with_spread(71.234, 1.5, 2) == "71.23 ± 1.50"
    assert with_spread(71.236, 0.0, 1) == "71.24"
    assert percent(0.7123) == pytest.approx(71.23)


def test_at_chance_and_diverged_count_and_traffic():
    assert at_chance(0.5, []) == (None, False)
    assert at_chance(0.5, [0.1, None]) == (None, False)
    chance, flag = at_chance(0.104, [0.1, 0.1])
    assert chance == pytest.approx(0.1) and flag
    assert at_chance(0.1 + CHANCE_MARGIN + 1e-9, [0.1])[1] is False
    assert at_chance(0.1 - CHANCE_MARGIN + 1e-6, [0.1])[1] is True
    assert at_chance(0.1 - CHANCE_MARGIN - 1e-6, [0.1])[1] is False
    assert at_chance(0.3, [0.1, 0.2]) == (pytest.approx(0.15), False)
    runs = [_run("a", 0, 0.5, 0.5, [], diverged_round=3, bytes_up_total=2_000_000),
            _run("a", 1, 0.5, 0.5, [], diverged_round=None, bytes_up_total=4_000_000),
            _run("a", 2, 0.5, 0.5, [], diverged_round=0, bytes_up_total=6_000_000)]
    assert diverged_count(runs) == 2
    assert diverged_count(runs[1:2]) == 0
    assert traffic_mb(runs, "bytes_up_total") == 4.0  # 10^6 bytes a MB, exactly
    assert traffic_mb(runs[:1], "bytes_up_total") == 2.0
    assert traffic_mb(runs, "bytes_down_total") is None
    assert traffic_mb([*runs[:1], _run("a", 1, 0.5, 0.5, [])], "bytes_up_total") is None


def test_table_rows_by_hand():
    runs = [
        _run("fedavg", 0, 0.60, 0.62, [(1, 0.3), (2, 0.55), (3, 0.6)], bytes_up_total=1e6, bytes_down_total=3e6,
             chance_global_acc=0.1),
        _run("fedavg", 1, 0.70, 0.74, [(1, 0.5), (2, 0.7), (3, 0.7)], bytes_up_total=3e6, bytes_down_total=5e6,
             chance_global_acc=0.1, diverged_round=None),
        _run("fedavg", 2, 0.80, 0.81, [(1, 0.2), (2, 0.4), (3, 0.45)], bytes_up_total=2e6, bytes_down_total=4e6,
             chance_global_acc=0.1, diverged_round=2),
        _run("fedprox", 0, 0.102, 0.3, [(1, 0.3)], chance_global_acc=0.1),
    ]
    rows = table_rows(runs, target=0.5)
    assert [r["method"] for r in rows] == ["fedavg", "fedprox"]
    a, b = rows
    assert a["seeds"] == 3 and a["metric"] == "global" and a["diverged"] == 1
    assert a["final_mean"] == pytest.approx(0.7) and a["final_std"] == pytest.approx(0.1)
    assert a["best_mean"] == pytest.approx((0.62 + 0.74 + 0.81) / 3)
    assert a["best_std"] == pytest.approx(statistics.stdev([0.62, 0.74, 0.81]))
    assert a["rounds_to_target"] == pytest.approx(1.5)  # seeds 0 and 1 reach 0.5 at rounds 2 and 1; seed 2 never
    assert a["reached"] == "2/3"
    assert a["wall_time_s"] == pytest.approx(20.0)
    assert a["mb_up"] == pytest.approx(2.0) and a["mb_down"] == pytest.approx(4.0)
    assert a["chance"] == pytest.approx(0.1) and a["at_chance"] is False
    assert a["setting_id"] == ""
    assert b["seeds"] == 1 and b["final_mean"] == 0.102 and b["final_std"] == 0.0 and b["best_mean"] == 0.3
    assert b["rounds_to_target"] is None and b["reached"] == "0/1"
    assert b["at_chance"] is True and b["diverged"] == 0 and b["mb_up"] is None
    assert "rounds_to_target" not in table_rows(runs, target=None)[0]
    assert "reached" not in table_rows(runs, target=None)[0]


def test_table_rows_of_a_personalised_method_use_the_client_mean():
    runs = [RunRecord("ditto", s, {"final_client_acc_mean": f, "best_client_acc_mean": f + 0.1,
                                   "wall_time_s": 1.0, "chance_global_acc": 0.1},
                      [{"round": 1, "client_acc_mean": f - 0.2, "global_acc": 0.99},
                       {"round": 2, "client_acc_mean": f}])
            for s, f in ((0, 0.6), (1, 0.8))]
    (row,) = table_rows(runs, target=0.55)
    assert row["metric"] == "client mean"
    assert row["final_mean"] == pytest.approx(0.7) and row["best_mean"] == pytest.approx(0.8)
    assert row["final_std"] == pytest.approx(math.sqrt(0.02))
    assert row["rounds_to_target"] == pytest.approx(1.5) and row["reached"] == "2/2"  # rounds 2 and 1
    assert row["chance"] is None and row["at_chance"] is False  # a personalised metric has no chance level


def test_a_key_a_row_lacks_shows_unset_and_privacy_columns_only_for_private_tables():
    summary = {"final_global_acc": 0.5, "best_global_acc": 0.5, "wall_time_s": 1.0}
    with_key = RunRecord("x", 0, dict(summary), [], {"algorithm": {"name": "nosuch1"}, "a": {"b": 1}})
    without = RunRecord("y", 0, dict(summary), [], {"algorithm": {"name": "nosuch2"}})
    rows = table_rows([with_key, without], None)
    assert [r["a.b"] for r in rows] == ["1", "-"]
    assert not any(k.startswith("dp_") for r in rows for k in r)
    private = RunRecord("y", 1, {**summary, "privacy": {"epsilon": 2.5, "delta": 1e-5}}, [], without.config)
    rows = table_rows([with_key, without, private], None)
    assert rows[0]["dp_epsilon"] is None and rows[0]["dp_delta"] is None
    assert rows[1]["seeds"] == 2 and rows[1]["dp_epsilon"] == float("inf")  # one seed made no release
    assert rows[1]["dp_delta"] == 1e-5


def test_a_mean_exactly_the_margin_from_chance_is_not_at_chance():
    assert at_chance(CHANCE_MARGIN, [0.0]) == (0.0, False)  # "within": strictly less than the margin
    assert at_chance(0.0, [CHANCE_MARGIN]) == (CHANCE_MARGIN, False)
