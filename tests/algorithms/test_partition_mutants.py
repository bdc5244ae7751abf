"""Partitions (:mod:`hetfl.data.partition`) beyond ``tests/data/test_partition.py``: the concept-shift label
maps when the classes are few enough for collisions to happen, and the refusals' whole messages (a message
names the key, its value as given, and what is allowed: a description in angle brackets shown as is)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from hetfl.data.partition import (
    Partition,
    PartitionError,
    _deal_distinct,
    concept_permutations,
    dominant_classes,
    group_test,
    make_partition,
    personal_test,
    split_dirichlet,
    split_dominant,
    split_groups,
    split_shards,
)


@pytest.mark.parametrize(("num_classes", "groups"), [(3, 6), (3, 4), (4, 24), (10, 3)])
def test_concept_maps_are_distinct_int_permutations_one_per_group(num_classes, groups):
    """3 classes, 6 groups: the 6 label maps must be all of S_3, the identity first (a repeated map would
    silently merge two concept groups)."""
    perms = concept_permutations(num_classes, groups, np.random.default_rng(0))
    assert len(perms) == groups
    assert all(p.dtype == np.int64 and sorted(p.tolist()) == list(range(num_classes)) for p in perms)
    assert perms[0].tolist() == list(range(num_classes))
    assert len({tuple(p.tolist()) for p in perms}) == groups
    if groups == math.factorial(num_classes):
        assert {tuple(p.tolist()) for p in perms} == set(itertools.permutations(range(num_classes)))


def test_a_partition_of_mismatched_lengths_says_how_many_entries_it_got():
    idx = [np.array([0, 1]), np.array([2])]
    with pytest.raises(PartitionError) as err:
        Partition(idx, idx[:1])
    assert str(err.value) == "Partition.test = <1 entries>: needs one entry per client (2)"
    with pytest.raises(PartitionError) as err:
        Partition(idx, idx, group=[0, 1, 2])
    assert str(err.value) == "Partition.group = <3 entries>: needs one entry per client (2)"


def test_shards_per_class_are_proportional_to_class_sizes_capped_at_the_clients():
    """split_shards' docstring: each class gets a number of shards proportional to its size, at least one and
    at most ``num_clients``. Classes of 600, 300 and 100 samples, 4 clients x 2 shards = 8 shards: exact shares
    4.8, 2.4 and 0.8; the first capped at 4 clients, the 4 left shared 2.4 : 0.8 -> 3 and 1. As no client
    holds two shards of one class, a class's shard count is the number of clients holding it."""
    y = np.repeat([0, 1, 2], [600, 300, 100])
    for seed in range(3):
        parts = split_shards(y, 4, np.random.default_rng(seed), 2)
        holders = [sum(int(np.any(y[p] == c)) for p in parts) for c in range(3)]
        assert holders == [4, 3, 1], seed
        assert sorted(np.concatenate(parts).tolist()) == list(range(1000))
    # 5 classes of 500, 200, 150, 100, 50 samples, 10 clients x 2 shards: shares 10, 4, 3, 2, 1 exactly
    y = np.repeat(np.arange(5), [500, 200, 150, 100, 50])
    parts = split_shards(y, 10, np.random.default_rng(0), 2)
    assert [sum(int(np.any(y[p] == c)) for p in parts) for c in range(5)] == [10, 4, 3, 2, 1]
    assert all(len(p) == 100 for p in parts)  # equal shards of 50: every client 100 samples


def test_a_repaired_deal_stays_random_not_the_round_robin_fallback():
    """MNIST's 200 shards (20 per class) over 100 clients: the fallback pairs class c with class c + 5 only; the
    random deal with repairs gives many pairs, every shard dealt once, no client holding a class twice."""
    shard_class = np.repeat(np.arange(10), 20)
    deal = _deal_distinct(shard_class, 100, 2, np.random.default_rng(0))
    assert sorted(deal.ravel().tolist()) == list(range(200))
    pairs = {tuple(sorted(shard_class[row].tolist())) for row in deal}
    assert all(a != b for a, b in pairs) and len(pairs) > 20


def test_a_domain_needs_as_many_samples_as_its_clients_and_says_which_falls_short():
    """A group of exactly ``clients_per_domain`` samples gives each of its clients one; one fewer is refused
    naming the first group short of samples and its count."""
    y = np.arange(9) % 3
    groups = np.array([0, 0, 1, 1, 1, 1, 2, 2, 2])  # group 0: 2 samples
    part = split_groups(groups, np.random.default_rng(0), 2)
    assert [len(p) for p in part[0]][:2] == [1, 1] and part[1] == [0, 0, 1, 1, 2, 2]
    assert sorted(np.concatenate(part[0]).tolist()) == list(range(9))
    with pytest.raises(PartitionError) as err:
        make_partition("domain", y, y, 9, seed=0, train_groups=np.array([5, 5, 7, 7, 7, 9, 9, 9, 9]),
                       test_groups=np.array([5, 5, 7, 7, 7, 9, 9, 9, 9]), clients_per_domain=3)
    assert str(err.value) == "data.clients_per_domain = 3: group 5 has only 2 training samples"


def test_shards_at_exactly_the_cap_are_dealt_and_impossible_ones_refused_whole():
    """Every class in at most one shard per client: two classes of 50 over 2 clients x 2 shards need exactly
    the 4 shards the cap allows (each client both classes); the refusals name the key, k and the reason."""
    y = np.repeat([0, 1], 50)
    parts = split_shards(y, 2, np.random.default_rng(0), 2)
    assert [sorted(set(y[p].tolist())) for p in parts] == [[0, 1], [0, 1]]
    cases = [
        (np.repeat([0, 1], 10), 2, 3, "data.classes_per_client = 3: only 2 classes occur in the training labels"),
        (np.repeat(np.arange(5), 10), 2, 2, "data.classes_per_client = 2: 2 clients x 2 shards cannot cover the "
                                           "5 classes; use more clients or more classes per client"),
        (np.repeat([0, 1, 2], [1, 1, 50]), 3, 2, "data.classes_per_client = 2: the class sizes [1, 1, 50] cannot "
                                                 "give each of 3 clients 2 distinct classes; use fewer clients or "
                                                 "classes per client"),
    ]
    for labels, clients, k, message in cases:
        with pytest.raises(PartitionError) as err:
            split_shards(labels, clients, np.random.default_rng(0), k)
        assert str(err.value) == message


def niid_bench_dirichlet(labels, num_clients, rng, alpha, min_size):
    """NIID-Bench's Dirichlet loop (Li et al., ICDE 2022, ``partition_data``, 'noniid-labeldir'), written as
    there, with hetfl's draw order per class (the proportions, then the class's shuffle): a client already
    holding N / num_clients samples gets none of the next class; redrawn until every client has min_size."""
    n = len(labels)
    smallest = -1
    while smallest < min_size:
        batches = [[] for _ in range(num_clients)]
        for k in range(labels.max() + 1):
            idx_k = np.flatnonzero(labels == k)
            if not len(idx_k):
                continue
            proportions = rng.dirichlet(np.repeat(alpha, num_clients))
            idx_k = rng.permutation(idx_k)
            proportions = np.array([p * (len(b) < n / num_clients) for p, b in zip(proportions, batches, strict=True)])
            proportions = proportions / proportions.sum()
            cuts = (np.cumsum(proportions) * len(idx_k)).astype(int)[:-1]
            batches = [b + part.tolist() for b, part in zip(batches, np.split(idx_k, cuts), strict=True)]
        smallest = min(len(b) for b in batches)
    return [np.sort(np.array(b, dtype=np.int64)) for b in batches]


@pytest.mark.parametrize(("alpha", "min_size", "clients"), [(0.1, 0, 5), (0.5, 10, 8), (100.0, 1, 4), (0.05, 15, 6)])
def test_dirichlet_split_is_niid_benchs_loop(alpha, min_size, clients):
    y = np.random.default_rng(7).integers(0, 10, 600)
    y[y == 3] = 4  # a label that does not occur
    got = split_dirichlet(y, clients, np.random.default_rng(1), alpha, min_size, 1000)
    want = niid_bench_dirichlet(y, clients, np.random.default_rng(1), alpha, min_size)
    assert [p.tolist() for p in got] == [p.tolist() for p in want]


def test_dominant_classes_step_by_one_when_there_are_as_many_groups_as_classes():
    assert dominant_classes(10, 5, 3) == [[0, 1, 2], [2, 3, 4], [4, 5, 6], [6, 7, 8], [8, 9, 0]]  # FedPAC's sets
    assert dominant_classes(4, 4, 2) == [[0, 1], [1, 2], [2, 3], [3, 0]]


def test_a_dominant_split_may_use_every_sample_of_a_class_and_refuses_a_missing_class_clearly():
    y = np.repeat([0, 1], 5)
    parts, wanted = split_dominant(y, 1, np.random.default_rng(0), 2, 10, 0.0, 1, 2)
    assert wanted.tolist() == [[5, 5]] and parts[0].tolist() == list(range(10))
    with pytest.raises(PartitionError) as err:
        split_dominant(np.repeat([0, 1], 50), 2, np.random.default_rng(0), 3, 30, 0.2, 1, 3)
    assert str(err.value).startswith("data.samples_per_client = 30: 2 clients need 20 training samples of class 2 "
                                     "but only 0 exist")


@pytest.mark.parametrize("test_groups", [[0, 0, 2, 2], [0, 0, 1, 1]])
def test_a_group_without_test_samples_gives_its_clients_an_empty_test_split(test_groups):
    """Client c of group ``owner[c]``: the groups' test samples whole (one client per group); a group absent
    from the test split (in the middle or past the last test group) gets an empty, int64 split."""
    got = group_test(np.array(test_groups), [0, 1, 2], np.random.default_rng(0))
    want = {0: [0, 1], 1: [2, 3] if test_groups[2] == 1 else [], 2: [2, 3] if test_groups[2] == 2 else []}
    assert [g.tolist() for g in got] == [want[0], want[1], want[2]]
    assert all(g.dtype == np.int64 for g in got)


def test_a_client_without_samples_or_without_matching_test_classes_gets_an_empty_int64_test_split():
    train, test = np.array([0, 0, 1, 2, 2]), np.array([0, 0, 1, 1, 0])
    parts = [np.array([0, 1, 2]), np.zeros(0, dtype=np.int64), np.array([3, 4])]  # client 2: only class 2
    got = personal_test(train, test, parts, 3, 3, np.random.default_rng(0))
    assert [g.dtype for g in got] == [np.int64] * 3
    assert sorted(test[got[0]].tolist()) == [0, 0, 1] and got[1].size == 0 and got[2].size == 0
