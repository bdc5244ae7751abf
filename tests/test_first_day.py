"""A researcher's first day (issue 27): one unit for accuracies, tables that show what was varied, hints that
name the real thing, files others can read, piped output that is never cut."""

from __future__ import annotations

import json

import pytest

from hetfl import tables
from hetfl.engine import identity


def _record(method: str, seed: int, final: float, best: float | None = None, **settings: object) -> tables.RunRecord:
    """A finished run of ``method`` (its resolved configuration: defaults plus ``settings``, dotted keys
    with ``__`` for ``.``) without training: what the tables read."""
    tree: dict = {"algorithm": {"name": method}, "seed": seed}
    for key, value in settings.items():
        *parents, last = key.split("__")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    summary = {"final_global_acc": final, "best_global_acc": best if best is not None else final,
               "wall_time_s": 1.0}
    metrics = [{"round": 1, "global_acc": final / 2}, {"round": 2, "global_acc": final}]
    return tables.RunRecord(method, seed, summary, metrics, identity.canonical_tree(tree))


# ----------------------------------------------------------------- item 5: one unit
def test_table_rows_hold_fractions_as_run_results_do_and_the_rendered_table_percent():
    records = [_record("fedavg", 0, 0.75), _record("fedavg", 1, 0.77, best=0.8)]
    (row,) = tables.table_rows(records, target=0.7)
    assert row["final_mean"] == pytest.approx(0.76)  # the unit of RunResult.final_accuracy and summary.json
    assert row["best_mean"] == pytest.approx(0.775)
    assert row["final_std"] == pytest.approx(0.0141421356, rel=1e-6)
    markdown = tables.to_markdown([row], target=0.7)
    assert "76.00 ± 1.41" in markdown and "final acc (%)" in markdown and "rounds to 70%" in markdown
    assert "0.76" in tables.to_csv([row]).splitlines()[1]


def test_reproduction_json_holds_fractions_and_its_markdown_percent(tmp_path):
    from hetfl import reproduce
    from tests.helpers.runs import PRESET, fake_run

    (tmp_path / "toy.toml").write_text(PRESET)
    preset = reproduce.load_preset("toy", tmp_path)
    accs = {"fedavg": [0.2, 0.4, 0.6], "fedprox": [0.1, 0.9, 0.8, 0.7, 0.6, 0.2]}
    result = reproduce.reproduce(preset, tmp_path / "out", fake_run(accs), resolve=lambda cfgs: cfgs)
    cell = json.loads((tmp_path / "out" / "reproduction.json").read_text())["table"]["A"]["c"]
    assert cell["ours"] == pytest.approx(0.605) and cell["paper"] == pytest.approx(0.5)
    assert cell["diff"] == pytest.approx(0.105) and cell["std"] == pytest.approx(0.5 ** 0.5 / 100)
    assert "| A | 60.50 ± 0.71 | 50.00 | +10.50 |" in reproduce.markdown(result)


@pytest.mark.parametrize(("text", "fraction"), [("0.6", 0.6), ("60%", 0.6), ("82.5 %", 0.825), ("1", 1.0)])
def test_target_takes_a_fraction_or_the_tables_percent(text, fraction):
    from hetfl.cli import parse_target

    assert parse_target(text) == pytest.approx(fraction)


@pytest.mark.parametrize("text", ["60", "0", "120%", "-0.1", "sixty"])
def test_target_out_of_range_names_both_units(text, capsys):
    from hetfl.cli import main

    assert main(["report", "nowhere", "--target", text]) == 2
    error = capsys.readouterr().err
    assert "--target" in error and "0.6" in error and "60%" in error


# ----------------------------------------------------------------- item 4: what was varied
def test_comparison_of_two_methods_shows_no_column_for_either_methods_defaults():
    rows = tables.table_rows([_record("fedavg+ccvr", 0, 0.5), _record("fedpac", 0, 0.6)], target=None)
    assert tables.key_columns(rows) == []
    markdown = tables.to_markdown(rows, None)
    assert markdown.splitlines()[0].startswith("| method | metric |")
    assert "Rows differ in: method;" in markdown
    scaffold = tables.table_rows([_record("fedavg", 0, 0.5), _record("scaffold", 0, 0.6)], target=None)
    assert "algorithm.server_lr" not in tables.to_markdown(scaffold, None)


def test_a_setting_the_user_changed_gets_its_column():
    records = [_record("fedavg", 0, 0.5), _record("fedprox", 0, 0.6),
               _record("fedprox", 0, 0.6, algorithm__mu=0.1), _record("fedavg", 0, 0.4, train__lr=0.1)]
    rows = tables.table_rows(records, target=None)
    assert tables.key_columns(rows) == ["algorithm.mu", "train.lr"]
    assert [r["algorithm.mu"] for r in rows] == ["-", "0.01", "0.1", "-"]


def test_curve_labels_name_the_method_and_what_the_user_varied():
    from hetfl.report import record_groups

    labels = list(record_groups([_record("fedavg+ccvr", 0, 0.5), _record("fedpac", 0, 0.6),
                                 _record("fedavg", 0, 0.4, train__lr=0.1)]))
    assert labels == ["fedavg+ccvr (train.lr=0.05)", "fedpac (train.lr=0.05)", "fedavg (train.lr=0.1)"]
