"""hetfl.analysis.curves: known answers for the learning curves and seed bands (mutation audit, session 38).

Every expected value is computed by hand or by numpy independently of the module."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hetfl.analysis.curves import (
    accuracy_curves,
    client_spread,
    cumulative_bytes,
    default_accuracy_key,
    load_metrics,
    rounds_to_target,
    run_curves,
    seed_band,
    train_loss_curve,
)


def test_load_metrics_reads_a_directory_skips_blank_lines_and_a_torn_last_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"round": 1}\n\n{"round": 2}\n{"round": 3, "glo')
    assert load_metrics(tmp_path) == [{"round": 1}, {"round": 2}]
    assert load_metrics(tmp_path / "metrics.jsonl") == [{"round": 1}, {"round": 2}]


def test_load_metrics_names_the_line_of_a_torn_line_in_the_middle(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"round": 1}\n\nnot json\n{"round": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:3: not a JSON line"):
        load_metrics(path)


def test_a_valid_last_line_is_kept(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"round": 1}\n{"round": 2}\n')
    assert load_metrics(tmp_path) == [{"round": 1}, {"round": 2}]


def test_accuracy_curves_keep_only_evaluated_rounds_with_none_for_missing_keys():
    metrics = [{"round": 1, "train_loss": 2.0},
               {"round": 2, "client_acc_mean": 0.5, "client_acc_std": 0.1},
               {"round": 3, "global_acc": 0.7}]
    assert accuracy_curves(metrics) == {"round": [2, 3], "global_acc": [None, 0.7],
                                        "client_acc_mean": [0.5, None], "client_acc_std": [0.1, None]}


def test_client_spread_from_summaries_and_from_an_old_list():
    new = {"round": 1, "client_acc_min": 0.1, "client_acc_q25": 0.2, "client_acc_median": 0.3,
           "client_acc_q75": 0.4, "client_acc_max": 0.5, "clients_evaluated": 7}
    old = {"round": 2, "client_acc": [0.0, 1.0, 0.5, 0.25, 0.75]}  # sorted 0, .25, .5, .75, 1
    partial = {"round": 3, "client_acc_min": 0.1}  # neither form: left out
    out = client_spread([new, old, partial, {"round": 4, "client_acc": []}])
    assert out == {"round": [1, 2], "min": [0.1, 0.0], "q25": [0.2, 0.25], "median": [0.3, 0.5],
                   "q75": [0.4, 0.75], "max": [0.5, 1.0], "num_clients": [7, 5]}
    assert all(type(v) is float for k in ("min", "q25", "median", "q75", "max") for v in out[k])


def test_client_spread_quartiles_interpolate_linearly():
    out = client_spread([{"round": 1, "client_acc": [0.0, 1.0]}])
    assert out["q25"] == [0.25] and out["median"] == [0.5] and out["q75"] == [0.75]


def test_train_loss_curve_and_cumulative_bytes_in_round_order():
    metrics = [{"round": 2, "bytes_up": 10, "bytes_down": 100, "train_loss": 1.5},
               {"round": 1, "bytes_up": 1, "bytes_down": 2},
               {"round": 3, "train_loss": 1}]
    assert train_loss_curve(metrics) == {"round": [2, 3], "train_loss": [1.5, 1.0]}
    assert cumulative_bytes(metrics) == {"round": [1, 2, 3], "bytes_up": [1, 11, 11], "bytes_down": [2, 102, 102],
                                         "bytes_total": [3, 113, 113]}


def test_default_key_and_rounds_to_target_sort_rounds_and_skip_missing_values():
    personal = [{"round": 1, "global_acc": None, "client_acc_mean": 0.2}, {"round": 2, "client_acc_mean": 0.6}]
    assert default_accuracy_key(personal) == "client_acc_mean"
    assert default_accuracy_key([{"round": 1}, {"round": 2, "global_acc": 0.1}]) == "global_acc"
    unordered = [{"round": 5, "global_acc": 0.9}, {"round": 3, "global_acc": 0.5}, {"round": 1, "global_acc": 0.1},
                 {"round": 4, "global_acc": None}]
    assert rounds_to_target(unordered, 0.5) == 3  # reaching the target exactly counts
    assert rounds_to_target(unordered, 0.50001) == 5
    assert rounds_to_target(unordered, 0.95) is None
    assert rounds_to_target(personal, 0.5) == 2
    assert rounds_to_target(personal, 0.1, key="global_acc") is None
    assert type(rounds_to_target([{"round": 2.0, "global_acc": 1.0}], 0.5)) is int


def test_run_curves_bundles_everything_and_sums_round_times(tmp_path):
    rows = [{"round": 1, "global_acc": 0.3, "round_time_s": 1.25}, {"round": 2, "global_acc": 0.4, "round_time_s": 2}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    for source in (rows, tmp_path, str(tmp_path)):
        out = run_curves(source)
        assert out["wall_time_s"] == 3.25 and type(out["wall_time_s"]) is float
        assert out["accuracy_key"] == "global_acc"
        assert out["accuracy"]["global_acc"] == [0.3, 0.4]
        assert out["bytes"]["bytes_total"] == [0, 0]
        assert out["spread"]["round"] == [] and out["train_loss"]["round"] == []


def _runs():
    return {
        0: [{"round": 1, "acc": 0.1}, {"round": 2, "acc": 0.4}, {"round": 3, "acc": 0.2}],
        1: [{"round": 1, "acc": 0.3}, {"round": 2, "acc": 0.8}, {"round": 4, "acc": 0.9}],
        2: [{"round": 2, "acc": 0.6}, {"round": 1, "acc": 0.5}, {"round": 5}],
    }


@pytest.mark.parametrize("ddof", [0, 1])
def test_seed_band_is_numpys_mean_and_std_over_the_shared_rounds(ddof):
    band = seed_band(_runs(), "acc", ddof=ddof)
    assert band.key == "acc" and band.seeds == [0, 1, 2] and band.n == 3 and band.ddof == ddof
    assert band.rounds == [1, 2]
    assert band.dropped == [3, 4]
    expected = np.array([[0.1, 0.4], [0.3, 0.8], [0.5, 0.6]])
    np.testing.assert_allclose(band.values, expected, rtol=0, atol=0)
    np.testing.assert_allclose(band.mean, [0.3, 0.6], rtol=1e-12)
    # by hand: deviations (-0.2, 0, 0.2) and (-0.2, 0.2, 0): sum of squares 0.08 over n - ddof
    np.testing.assert_allclose(band.std, [math.sqrt(0.08 / (3 - ddof))] * 2, rtol=1e-12)


def test_a_single_seed_has_zero_std_and_a_diverged_value_is_nan():
    band = seed_band({7: [{"round": 1, "acc": 0.5}, {"round": 2, "acc": 0.6}]}, "acc")
    assert band.std.tolist() == [0.0, 0.0] and band.mean.tolist() == [0.5, 0.6] and band.dropped == []
    band = seed_band({0: [{"round": 1, "acc": float("inf")}, {"round": 2, "acc": 0.2}],
                      1: [{"round": 1, "acc": 0.3}, {"round": 2, "acc": 0.4}]}, "acc", ddof=0)
    assert math.isnan(band.values[0, 0]) and math.isnan(band.mean[0]) and math.isnan(band.std[0])
    assert band.mean[1] == pytest.approx(0.3) and band.std[1] == pytest.approx(0.1)


def test_seed_band_refuses_what_it_cannot_average():
    with pytest.raises(ValueError, match=r"^ddof 2: must be 0"):
        seed_band(_runs(), "acc", ddof=2)
    with pytest.raises(ValueError, match=r"^mine: no runs"):
        seed_band({}, "acc", label="mine")
    with pytest.raises(ValueError, match=r"^no runs"):
        seed_band({}, "acc")
    with pytest.raises(ValueError, match=r"^mine: seed 3 logged no 'acc'"):
        seed_band({0: [{"round": 1, "acc": 1.0}], 3: [{"round": 1}]}, "acc", label="mine")
    with pytest.raises(ValueError, match=r"share no round .*seed 0: rounds \[1\]; seed 1: rounds \[2\]"):
        seed_band({0: [{"round": 1, "acc": 1.0}], 1: [{"round": 2, "acc": 1.0}]}, "acc")


def test_seeds_without_a_shared_round_are_refused_listing_their_first_five_rounds():
    """The message names each seed's first five logged rounds (sorted), then what to give, word for word."""
    runs = {0: [{"round": r, "acc": 0.5} for r in (12, 2, 4, 6, 8, 10)], 1: [{"round": 3, "acc": 0.5}]}
    with pytest.raises(ValueError) as refused:
        seed_band(runs, "acc", label="mine")
    assert str(refused.value) == ("mine: the seeds share no round that logged 'acc' (seed 0: rounds [2, 4, 6, 8, 10]; "
                                  "seed 1: rounds [3]): give runs of one setting (the same train.eval_every)")
