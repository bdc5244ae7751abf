"""The comparison table's cells and notes, computed by hand for a small table that has every kind of column
(``hetfl.tables``): what a researcher reads of a comparison, every cell and note, whole (session 38: the first
mutation run of tables.py left cells, edges and notes that no test read whole).

The table: FedAvg+CCVR, two seeds (one diverged), private with distributed noise and no secure aggregation,
traffic known; FedProx, one seed, at chance, nothing private, no traffic recorded. Target accuracy 70%, which
one seed reaches exactly at round 1 and the other exactly at round 2 (the first round *at or above* it)."""

from __future__ import annotations

import math

import pytest

from hetfl import tables

PRIVACY = {"epsilon": 2.0, "delta": 1e-5, "noise": "distributed", "secure_aggregation": False,
           "epsilon_per_upload": 33.71, "covers": "CCVR's class statistics"}


def _run(method: str, seed: int, curve: list[float], best: float, **summary: object) -> tables.RunRecord:
    metrics = [{"round": r, "global_acc": acc} for r, acc in enumerate(curve, 1)]
    return tables.RunRecord(method, seed, {"final_global_acc": curve[-1], "best_global_acc": best, **summary},
                            metrics)


def records() -> list[tables.RunRecord]:
    return [
        _run("fedavg+ccvr", 0, [0.7, 0.8], 0.85, final_global_acc_before_ccvr=0.6, wall_time_s=10.0,
             bytes_up_total=5e6, bytes_down_total=2e7, chance_global_acc=0.1, privacy=PRIVACY),
        _run("fedavg+ccvr", 1, [0.6, 0.7], 0.75, final_global_acc_before_ccvr=0.5, wall_time_s=12.0,
             bytes_up_total=5e6, bytes_down_total=2e7, chance_global_acc=0.1, privacy=PRIVACY, diverged_round=2),
        _run("fedprox", 0, [0.1], 0.1, wall_time_s=3.0, chance_global_acc=0.1),
    ]


def test_every_cell_of_a_table_with_every_kind_of_column():
    rows = tables.table_rows(records(), target=0.7)
    head, body = tables.table_cells(rows, 0.7)
    assert head == ["method", "metric", "seeds", "diverged", "final before ccvr (%)", "final acc (%)", "best acc (%)",
                    "rounds to 70%", "privacy: epsilon (delta)", "MB up / down", "time (s)", "setting"]
    std = f"{100 * math.sqrt(0.005):.2f}"  # the sample std (n - 1) of two values 0.1 apart: 7.07 points
    assert body == [
        ["fedavg+ccvr", "global", "2", "1 of 2", f"55.00 ± {std}", f"75.00 ± {std}", f"80.00 ± {std}", "1.5 (2/2)",
         "33.8 per upload (1e-05)", "5 / 20.0", "11.0", "?"],
        ["fedprox", "global", "1", "0 of 1", "-", "10.00 (chance)", "10.00", "not reached", "none", "?", "3.0", "?"],
    ]


def test_the_rows_hold_what_the_cells_show_as_fractions_and_counts():
    ccvr, prox = tables.table_rows(records(), target=0.7)
    assert ccvr["rounds_to_target"] == 1.5 and ccvr["reached"] == "2/2"
    assert prox["rounds_to_target"] is None and prox["reached"] == "0/1"
    assert (ccvr["mb_up"], ccvr["mb_down"]) == (5.0, 20.0) and (prox["mb_up"], prox["mb_down"]) == (None, None)
    assert ccvr["diverged"] == 1 and prox["diverged"] == 0
    assert (ccvr["at_chance"], prox["at_chance"]) == (False, True) and prox["chance"] == pytest.approx(0.1)
    assert {k: ccvr[k] for k in ("dp_epsilon", "dp_delta", "dp_per_upload", "dp_covers")} == {
        "dp_epsilon": 33.71, "dp_delta": 1e-5, "dp_per_upload": True, "dp_covers": "CCVR's class statistics"}
    assert {k: prox[k] for k in ("dp_epsilon", "dp_delta", "dp_per_upload", "dp_covers")} == {
        "dp_epsilon": None, "dp_delta": None, "dp_per_upload": None, "dp_covers": None}


def test_the_notes_under_the_table_say_what_its_cells_mean():
    rows = tables.table_rows(records(), target=0.7)
    assert tables.differences_line(rows) == "Rows differ in: method; the runs of a row differ only in the seed."
    assert tables.differences_line(rows[:1]) == "One setting; its runs differ only in the seed."
    assert tables.aggregation_line(rows, 0.7) == (
        "Accuracies in %: mean ± sample std (n − 1) over the row's seeds (one seed: its value alone); final: the "
        "last evaluated round's accuracy (after any post-hoc step), best: the highest evaluated one; MB up / down: "
        "the bytes each run's clients sent and received over the whole run (10^6 bytes), and time (s): each "
        "run's wall time, each the mean over the seeds. Rounds to 70%: each seed's first evaluated round whose "
        "accuracy is at or above 70% (rounds are evaluated every train.eval_every and at the last), the mean over "
        "the seeds that reached it; (k/n): k of the row's n seeds reached it.")
    assert tables.aggregation_line([], 0.7) == ""
    assert tables.diverged_line(rows) == (
        "Diverged: a row's runs whose train loss became inf or NaN (summary.json: diverged_round); their final and "
        "best accuracies are in the row's mean and std as they ended.")
    assert tables.diverged_line(rows[1:]) == ""
    assert tables.chance_line(rows) == (
        "(chance): the mean is within 0.5 point of what always predicting the test set's largest class scores "
        "(10.00%): those runs have learned nothing this metric sees yet, and their order among themselves says "
        "nothing.")
    assert tables.privacy_line(rows) == (
        "Privacy: the (epsilon, delta) differential-privacy budget each private row's releases spent, the largest "
        "over its seeds, as its server faces it (per upload where it saw each client's upload, without secure "
        "aggregation), rounded up. It covers: CCVR's class statistics.")
    assert tables.privacy_line(rows[1:]) == ""


def test_the_markdown_is_the_cells_and_the_notes_escaped():
    rows = tables.table_rows(records(), target=0.7)
    head, body = tables.table_cells(rows, 0.7)
    text = tables.to_markdown(rows, 0.7)
    lines = text.split("\n")
    assert lines[0] == "| " + " | ".join(head) + " |" and lines[1] == "|" + "---|" * len(head)
    assert lines[2] == "| " + " | ".join(body[0]) + " |" and lines[3] == "| " + " | ".join(body[1]) + " |"
    notes = [tables.differences_line(rows), tables.aggregation_line(rows, 0.7), tables.diverged_line(rows),
             tables.chance_line(rows), tables.privacy_line(rows)]
    assert text == "\n".join(lines[:4]) + "\n\n" + "\n\n".join(map(tables.markdown_text, notes)) + "\n"


def test_the_csv_has_a_column_per_row_key_and_a_line_per_row():
    rows = tables.table_rows(records(), target=0.7)
    text = tables.to_csv(rows)
    lines = text.splitlines()
    assert lines[0] == ",".join(rows[0]) and len(lines) == 3
    assert lines[2].startswith("fedprox,global,1,0,") and ",not reached," not in text  # values, not cells
    assert tables.to_csv([]) == "method\r\n"


def test_a_seed_without_its_private_release_leaves_the_row_no_single_budget():
    runs = records()[:2]
    del runs[1].summary["privacy"]
    (row,) = tables.table_rows(runs, target=None)
    assert row["dp_epsilon"] == math.inf and row["dp_per_upload"] is False
    assert tables.privacy_cell(row) == "no single budget (a seed made no private release)"
    covers = [{**PRIVACY, "covers": c} for c in ("b", "a", "", "b")]
    assert tables._privacy([tables.RunRecord("m", i, {"privacy": p}, []) for i, p in enumerate(covers)])[
        "dp_covers"] == "a; b"


@pytest.mark.parametrize(("up", "down", "shown"), [
    (9.99, 10.0, "9.99 / 10.0"), (0.01234, 123.456, "0.0123 / 123.5"), (None, 1.0, "?"), (1.0, None, "?")])
def test_traffic_is_three_significant_digits_below_10_mb_and_one_decimal_from_10(up, down, shown):
    assert tables.traffic_cell({"mb_up": up, "mb_down": down}) == shown


def test_a_personalised_runs_curve_is_its_mean_client_accuracy():
    run = tables.RunRecord("fedper", 0, {"final_client_acc_mean": 0.9, "best_client_acc_mean": 0.9, "wall_time_s": 1.0},
                           [{"round": 1, "global_acc": 0.2, "client_acc_mean": 0.6},
                            {"round": 2, "global_acc": 0.3, "client_acc_mean": 0.9}])
    assert run.metric_key == "final_client_acc_mean" and run.curve() == [(1, 0.6), (2, 0.9)]
    (row,) = tables.table_rows([run], target=0.8)
    assert row["metric"] == "client mean" and row["rounds_to_target"] == 2


def test_a_configuration_value_shows_as_typed_and_a_non_json_value_as_its_text():
    from pathlib import Path

    assert tables._cell("sgd") == "sgd" and tables._cell(0.1) == "0.1" and tables._cell([1, 2]) == "[1, 2]"
    assert tables._cell(Path("/data")) == '"/data"'
