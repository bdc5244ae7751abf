"""FedPAC's dominant split with explicit class groups (EMNIST's digits / upper / lower) and with samples handed out
again when a class runs short (the authors' code, 100 clients on CIFAR-10 / FMNIST)."""

from __future__ import annotations

import numpy as np
import pytest

from hetfl.config import ConfigError, from_dict
from hetfl.data.partition import PartitionError, make_partition
from hetfl.data.partition_report import class_counts

#: FedPAC's EMNIST groups (JianXu95/FedPAC data_loader.py emnist_noniid_s; byclass labels: digits, A-Z, a-z)
EMNIST_GROUPS = [list(range(10)), list(range(10, 36)), list(range(36, 62))]


def test_explicit_groups_give_each_client_its_groups_classes_as_fedpacs_emnist_split():
    """62 classes, 3 groups of 10 / 26 / 26 classes, 1000 samples a client (the code's EMNIST local_size): 200
    uniform (3 or 4 of each class) and 800 over the group's classes (80 per digit; 30 or 31 per letter)."""
    y = np.repeat(np.arange(62), 300)
    part = make_partition("dominant", y, y, 6, seed=0, samples_per_client=1000, test_per_client=600,
                          group_classes=EMNIST_GROUPS)
    assert part.group == [0, 1, 2, 0, 1, 2]
    assert [len(p) for p in part.train] == [1000] * 6 and [len(t) for t in part.test] == [600] * 6
    for i, row in enumerate(class_counts(part, y, 62)):
        group = EMNIST_GROUPS[i % 3]
        others = np.setdiff1d(np.arange(62), group)
        assert set(row[others].tolist()) <= {3, 4}  # the uniform share only
        dominant = row[group] - 800 // len(group)  # the uniform share and the remainders
        assert dominant.min() >= 3 and dominant.max() <= 5, (i, row[group].tolist())
        assert row.sum() == 1000
    joined = np.concatenate(part.train)
    assert len(np.unique(joined)) == len(joined)  # enough samples: still drawn without replacement


def test_explicit_groups_equal_to_the_consecutive_ones_give_the_same_split():
    """group_classes only says which classes: FedPAC's CIFAR-10 groups written out are the default split."""
    y = np.repeat(np.arange(10), 2000)
    y_test = np.repeat(np.arange(10), 1000)
    default = make_partition("dominant", y, y_test, 20, seed=3)
    written = make_partition("dominant", y, y_test, 20, seed=3,
                             group_classes=[[0, 1, 2], [2, 3, 4], [4, 5, 6], [6, 7, 8], [8, 9, 0]])
    assert [p.tolist() for p in default.train] == [p.tolist() for p in written.train]
    assert [p.tolist() for p in default.test] == [p.tolist() for p in written.test]
    assert default.group == written.group
    other = make_partition("dominant", y, y_test, 10, seed=3, group_classes=[[0, 1], [5, 6, 7]])
    assert other.group == [i % 2 for i in range(10)]
    assert set(np.flatnonzero(class_counts(other, y, 10)[1] > 12).tolist()) == {5, 6, 7}


@pytest.mark.parametrize(("groups", "what"), [
    ({}, "at least one group"),
    ("0,1", "at least one group"),
    ([[0, 1], []], "group 1 is empty"),
    ([[0, 10]], "class 10 of group 0 is not a class"),
    ([[0, -1]], "class -1 of group 0 is not a class"),
    ([[0, 1, 1]], "group 0 lists class 1 twice"),
    ([[0, 1.5]], "integer"),
    ([3, 4], "a list of classes"),
])
def test_bad_groups_name_the_key_the_group_and_what_is_allowed(groups, what):
    y = np.repeat(np.arange(10), 100)
    with pytest.raises(PartitionError) as err:
        make_partition("dominant", y, y, 4, seed=0, samples_per_client=50, group_classes=groups)
    message = str(err.value)
    assert message.startswith("data.group_classes = ") and what in message and "\n" not in message


def test_group_classes_with_moved_group_counts_is_a_config_error():
    """dominant_groups and classes_per_group describe the consecutive groups; with explicit ones they would be
    ignored, so moving them too is refused, naming the key."""
    data = {"partition": "dominant", "group_classes": [[0, 1], [2, 3]]}
    assert from_dict({"data": data}).data.group_classes == [[0, 1], [2, 3]]
    for key, value in (("dominant_groups", 2), ("classes_per_group", 2)):
        with pytest.raises(ConfigError, match=rf"^data\.{key} = {value}: .*data\.group_classes"):
            from_dict({"data": {**data, key: value}})
    with pytest.raises(ConfigError, match=r"data\.group_classes\[0\]\[1\]"):
        from_dict({"data": {"group_classes": [[0, "a"]]}})


# --------------------------------------------------------------------------------------- samples handed out again
def fedpac_100(reuse: bool, seed: int = 0, classes: int = 10, per_class: int = 5000):
    y = np.repeat(np.arange(classes), per_class)
    return y, make_partition("dominant", y, np.repeat(np.arange(classes), 1000), 100, seed=seed,
                             reuse_samples=reuse)


def test_a_short_class_is_an_error_unless_samples_may_be_handed_out_again():
    """100 clients of 600 on CIFAR-10 (5,000 a class): classes 0, 2, 4, 6, 8 are dominant in two groups, 40
    clients x 160 + 100 x 12 = 7,600 samples each. The authors' code starts a class over when it runs out;
    reuse_samples does the same, and a client still holds no sample twice."""
    with pytest.raises(PartitionError, match=r"7600 training samples of class 0 but only 5000 exist.*reuse_samples"):
        fedpac_100(False)
    y, part = fedpac_100(True)
    assert [len(p) for p in part.train] == [600] * 100
    assert all(np.all(np.diff(p) > 0) for p in part.train)  # sorted, no sample twice within a client
    for i, row in enumerate(class_counts(part, y, 10)):
        group = [[0, 1, 2], [2, 3, 4], [4, 5, 6], [6, 7, 8], [8, 9, 0]][i % 5]
        expected = np.full(10, 12)
        expected[group] += 160
        assert np.array_equal(row, expected), i
    uses = np.bincount(np.concatenate(part.train), minlength=len(y))
    for c in range(10):
        used = uses[y == c]
        need = 7600 if c % 2 == 0 else 4400
        assert used.sum() == need
        # every sample once before any twice: a short class's samples are used 1 or 2 times, a long one's 0 or 1
        assert set(used.tolist()) <= ({1, 2} if need > 5000 else {0, 1}), (c, np.unique(used))


def test_reuse_changes_nothing_when_no_class_runs_short():
    """20 clients (1,520 of a class at most): the split with reuse_samples is the one without."""
    y = np.repeat(np.arange(10), 5000)
    y_test = np.repeat(np.arange(10), 1000)
    for seed in (0, 1):
        plain, reuse = (make_partition("dominant", y, y_test, 20, seed=seed, reuse_samples=r) for r in (False, True))
        assert [p.tolist() for p in plain.train] == [p.tolist() for p in reuse.train]
        assert [p.tolist() for p in plain.test] == [p.tolist() for p in reuse.test]


def test_a_client_that_needs_more_of_a_class_than_exist_is_refused_even_with_reuse():
    y = np.repeat(np.arange(10), 50)
    with pytest.raises(PartitionError, match=r"^data.samples_per_client = 600: a client needs \d+ training samples "
                                             r"of class 0 but only 50 exist"):
        make_partition("dominant", y, y, 2, seed=0, reuse_samples=True)


def test_a_runs_group_classes_and_reuse_samples_reach_its_partition():
    """data.group_classes and data.reuse_samples, as a run configures them, make the split: 3 EMNIST-style groups,
    and 6 clients of 200 from 30 samples a class, which only a split that hands samples out again can give."""
    import torch

    from hetfl.data.base import Dataset, DatasetInfo, Split
    from hetfl.engine.setup import build_partition

    y = torch.arange(62).repeat_interleave(30)
    split = Split(torch.zeros(len(y), 1, 2, 2, dtype=torch.uint8), y)
    dataset = Dataset(DatasetInfo("toy", tuple(map(str, range(62))), (1, 2, 2)), split, split)
    data = {"partition": "dominant", "num_clients": 6, "samples_per_client": 200, "group_classes": EMNIST_GROUPS}
    with pytest.raises(PartitionError, match="reuse_samples"):
        build_partition(from_dict({"data": data}), dataset)
    part = build_partition(from_dict({"data": {**data, "reuse_samples": True}}), dataset)
    assert part.group == [0, 1, 2, 0, 1, 2] and [len(p) for p in part.train] == [200] * 6
    digits = class_counts(part, y.numpy(), 62)[:, :10].sum(axis=1)
    assert digits[[0, 3]].min() >= 160 > 40 >= digits[[1, 2, 4, 5]].max()  # 160 dominant + uniform
