"""hetfl.data.partition_report: the partition's statistics by hand (mutation audit, session 38)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hetfl.data.partition import Partition
from hetfl.data.partition_report import _counts, _entropy_bits, class_counts, partition_table, summary_row

TRAIN_LABELS = np.array([0, 0, 1, 2, 2, 2, 1, 0])
TEST_LABELS = np.array([0, 1, 2, 0])


def _partition(**extra) -> Partition:
    idx = [np.array(v, dtype=np.int64) for v in ([0, 1, 2], [3, 4, 5], [], [6, 7])]
    tidx = [np.array(v, dtype=np.int64) for v in ([0, 1], [2, 3], [3], [])]
    return Partition(idx, tidx, **extra)


def test_class_counts_by_hand():
    counts = class_counts(_partition(), TRAIN_LABELS, 3)
    assert counts.dtype == np.int64
    assert counts.tolist() == [[2, 1, 0], [0, 0, 3], [0, 0, 0], [1, 1, 0]]
    assert _counts([], TRAIN_LABELS, 3).shape == (0, 3)
    assert _counts([], TRAIN_LABELS, 3).dtype == np.int64
    assert class_counts(_partition(), TRAIN_LABELS, 4).tolist()[1] == [0, 0, 3, 0]


def test_entropy_in_bits():
    assert _entropy_bits(np.array([1, 1, 0])) == pytest.approx(1.0, abs=1e-15)
    assert _entropy_bits(np.array([1, 1, 1, 1])) == pytest.approx(2.0, abs=1e-15)
    assert _entropy_bits(np.array([2, 1])) == pytest.approx(-(2 / 3) * math.log2(2 / 3) - (1 / 3) * math.log2(1 / 3))
    zero = _entropy_bits(np.array([0, 5, 0]))
    assert zero == 0.0 and math.copysign(1.0, zero) == 1.0  # not -0.0
    assert _entropy_bits(np.array([0, 0])) == 0.0


def test_partition_table_by_hand():
    rows = partition_table(_partition(), TRAIN_LABELS, TEST_LABELS, 3)
    h = round(-(2 / 3) * math.log2(2 / 3) - (1 / 3) * math.log2(1 / 3), 4)
    assert rows == [
        {"client": 0, "n_train": 3, "n_test": 2, "n_classes": 2, "top_class": 0, "top_class_share": 0.6667,
         "entropy_bits": h, "test_tv": 0.1667},
        {"client": 1, "n_train": 3, "n_test": 2, "n_classes": 1, "top_class": 2, "top_class_share": 1.0,
         "entropy_bits": 0.0, "test_tv": 0.5},
        {"client": 2, "n_train": 0, "n_test": 1, "n_classes": 0, "top_class": -1, "top_class_share": 0.0,
         "entropy_bits": 0.0, "test_tv": 0.0},
        {"client": 3, "n_train": 2, "n_test": 0, "n_classes": 2, "top_class": 0, "top_class_share": 0.5,
         "entropy_bits": 1.0, "test_tv": 0.0},
    ]
    assert math.copysign(1.0, rows[1]["entropy_bits"]) == 1.0
    assert partition_table(_partition(), TRAIN_LABELS, TEST_LABELS, 3, summary=False) == rows


def test_group_angle_and_the_summary_row():
    part = _partition(group=[0, 1, 1, 0], rotation=[0.0, 12.3456, 90.0, 180.0])
    rows = partition_table(part, TRAIN_LABELS, TEST_LABELS, 3, summary=True)
    assert [r["group"] for r in rows[:4]] == [0, 1, 1, 0]
    assert [r["angle"] for r in rows[:4]] == [0.0, 12.35, 90.0, 180.0]
    assert list(rows[0])[:3] == ["client", "group", "angle"]
    assert rows[4] == {"client": "all", "group": 2, "angle": round((12.35 + 270) / 4, 4), "n_train": 8, "n_test": 5,
                       "n_classes": 1.25, "top_class": "-", "top_class_share": round((0.6667 + 1 + 0.5) / 4, 4),
                       "entropy_bits": round((rows[0]["entropy_bits"] + 1.0) / 4, 4),
                       "test_tv": round((0.1667 + 0.5) / 4, 4)}
    assert type(rows[4]["n_train"]) is int and type(rows[4]["n_classes"]) is float
    assert summary_row(rows) == rows[4]  # an `all` row already there is not averaged in
    assert summary_row([]) == {}


def test_counts_cast_float_labels_and_plain_index_lists():
    # labels read as floats (a CSV, a float tensor) and a client's indices as a plain (possibly empty) list
    assert _counts([[], [0, 2]], np.array([0.0, 1.0, 2.0]), 3).tolist() == [[0, 0, 0], [1, 0, 1]]


def test_a_client_with_one_sample_holds_its_class_whole():
    part = Partition([np.array([0], dtype=np.int64)], [np.array([1], dtype=np.int64)])
    rows = partition_table(part, np.array([2]), np.array([0, 2]), 3, summary=True)
    assert rows[0] == {"client": 0, "n_train": 1, "n_test": 1, "n_classes": 1, "top_class": 2,
                       "top_class_share": 1.0, "entropy_bits": 0.0, "test_tv": 0.0}
    assert rows[1] == {"client": "all", "n_train": 1, "n_test": 1, "n_classes": 1.0, "top_class": "-",
                       "top_class_share": 1.0, "entropy_bits": 0.0, "test_tv": 0.0}
    part = Partition([np.array([0], dtype=np.int64)], [np.array([0], dtype=np.int64)])
    assert partition_table(part, np.array([2]), np.array([0]), 3)[0]["test_tv"] == 1.0


def test_the_table_rounds_to_four_digits():
    part = Partition([np.array([0, 1, 2, 3], dtype=np.int64)], [np.array([0, 1, 2], dtype=np.int64)])
    (row,) = partition_table(part, np.array([0, 1, 1, 1]), np.array([0, 0, 1]), 2)
    # p = (1/4, 3/4): H = 2 - (3/4) log2 3 = 0.811278..., top share 0.75, TV |1/4 - 2/3| = 0.416666...
    assert row["entropy_bits"] == 0.8113 and row["top_class_share"] == 0.75 and row["test_tv"] == 0.4167
