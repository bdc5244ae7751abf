"""Partitions (:mod:`hetfl.data.partition`): tests written for the survivors of its mutation run (session 27,
``benchmarks/results/mutation/partition.survivors.txt``), beside ``tests/algorithms/test_partition_mutants.py``
(session 26). Each checks a property a user can see: the refusals' whole messages (the key, its value as given
and what is allowed), sizes, coverage and the draws' dependence on the seed only."""

from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest

from hetfl.data.partition import (
    Partition,
    PartitionError,
    _apportion,
    _deal_distinct,
    make_partition,
    partition_keys,
    split_dirichlet,
    split_quantity,
    split_shards,
    unused_settings,
)


def refusal(name: str, labels: np.ndarray, num_clients: int, **settings: object) -> str:
    with pytest.raises(PartitionError) as err:
        make_partition(name, labels, labels, num_clients, seed=settings.pop("seed", 0), **settings)
    return str(err.value)


def test_too_many_concept_groups_are_refused_with_the_true_count_of_label_maps():
    """The refusal states the two limits: the clients and the label permutations of the classes. Past 20
    classes the check caps the count at 20! (any number of clients is below it), but the message must not
    claim that 100 classes have 20! = 2432902008176640000 permutations."""
    few = np.arange(30) % 3
    assert refusal("concept", few, 10, concept_groups=7) == (
        "data.concept_groups = 7: must be at most the 10 clients and the 6 label permutations of 3 classes")
    many = np.arange(200) % 100
    assert refusal("concept", many, 5, concept_groups=6) == (
        "data.concept_groups = 6: must be at most the 5 clients and the 100! label permutations of 100 classes")
    # 20 classes: 20! itself is counted; 21: named
    assert refusal("concept", np.arange(40) % 20, 3, concept_groups=4) == (
        "data.concept_groups = 4: must be at most the 3 clients and the 2432902008176640000 label permutations of "
        "20 classes")
    assert refusal("concept", np.arange(42) % 21, 3, concept_groups=4) == (
        "data.concept_groups = 4: must be at most the 3 clients and the 21! label permutations of 21 classes")


Y = np.random.default_rng(0).integers(0, 10, 500)  # 500 samples of 10 classes, every class present
DIRICHLET = {"name": "dirichlet", "train_labels": Y, "test_labels": Y, "num_clients": 5, "seed": 0}
REFUSALS = [
    ({"name": "zipf"},
     "data.partition = 'zipf': allowed: iid, dirichlet, shards, dominant, quantity, domain, natural, rotation, "
     "concept"),
    ({"num_clients": 0}, "data.num_clients = 0: must be an integer in [1, 500] (at most the 500 training samples)"),
    ({"num_clients": 501},
     "data.num_clients = 501: must be an integer in [1, 500] (at most the 500 training samples)"),
    ({"num_clients": 2.5},
     "data.num_clients = 2.5: must be an integer in [1, 500] (at most the 500 training samples)"),
    ({"num_clients": True},
     "data.num_clients = true: must be an integer in [1, 500] (at most the 500 training samples)"),
    ({"seed": -1}, "seed = -1: must be a non-negative integer"),
    ({"seed": True}, "seed = true: must be a non-negative integer"),
    ({"seed": 1.0}, "seed = 1.0: must be a non-negative integer"),
    ({"alpha": 0.0}, "data.alpha = 0.0: must be a finite number > 0"),
    ({"alpha": "x"}, "data.alpha = 'x': must be a finite number > 0"),
    ({"alpha": None}, "data.alpha = None: must be a finite number > 0"),
    ({"train_labels": np.array([True, False] * 5)}, "train_labels = <bool array>: must hold integer labels"),
    # an infinite float label is no integer (cast to int64 it became -2**63, reported as a negative minimum)
    ({"test_labels": np.array([0.0, 1.0, np.inf])}, "test_labels = <float64 array>: must hold integer labels"),
    ({"test_labels": np.array([0, 1, 12]), "num_classes": 10},
     "num_classes = 10: must be an integer >= 13 (largest label + 1)"),
    ({"alpha": float("inf")}, "data.alpha = inf: must be a finite number > 0"),
    ({"min_size": -1}, "data.min_size = -1: must be an integer >= 0"),
    ({"min_size": 101}, "data.min_size = 101: 5 clients x 101 exceeds the 500 training samples"),
    ({"name": "quantity", "min_size": 101}, "data.min_size = 101: 5 clients x 101 exceeds the 500 training samples"),
    ({"name": "rotation", "base": "dirichlet", "min_size": 101},
     "data.min_size = 101: 5 clients x 101 exceeds the 500 training samples"),
    ({"max_retries": 0}, "max_retries = 0: must be an integer >= 1"),
    ({"name": "shards", "classes_per_client": 0}, "data.classes_per_client = 0: must be an integer >= 1"),
    ({"name": "shards", "classes_per_client": 11}, "data.classes_per_client = 11: must be in [1, 10]"),
    ({"uniform_share": 1.5}, "data.uniform_share = 1.5: must be a finite number >= 0 and <= 1"),
    ({"uniform_share": -0.1}, "data.uniform_share = -0.1: must be a finite number >= 0 and <= 1"),
    ({"name": "dominant", "samples_per_client": 0}, "data.samples_per_client = 0: must be an integer >= 1"),
    ({"name": "dominant", "dominant_groups": 0}, "data.dominant_groups = 0: must be an integer >= 1"),
    ({"name": "dominant", "classes_per_group": 0}, "data.classes_per_group = 0: must be an integer >= 1"),
    ({"name": "dominant", "classes_per_group": 11}, "data.classes_per_group = 11: must be in [1, 10]"),
    ({"test_per_client": -1}, "data.test_per_client = -1: must be an integer >= 0"),
    ({"quantity_sigma": -1.0}, "data.quantity_sigma = -1.0: must be a finite number >= 0"),
    ({"name": "quantity", "quantity_sigma": 1000.0},
     "data.quantity_sigma = 1000.0: the log-normal client sizes overflow (exp(sigma x a normal draw)); use a "
     "smaller sigma (at 5 one client already holds most samples)"),
    ({"clients_per_domain": 0}, "data.clients_per_domain = 0: must be an integer >= 1"),
    ({"concept_groups": 0}, "data.concept_groups = 0: must be an integer >= 1"),
    ({"name": "rotation", "base": "zipf"}, "data.base = 'zipf': allowed: iid, dirichlet"),
    ({"name": "concept", "concept_groups": 6},
     "data.concept_groups = 6: must be at most the 5 clients and the 3628800 label permutations of 10 classes"),
    ({"name": "rotation", "angles": [1, 2]}, "data.angles = [1, 2]: needs one angle per client (5)"),
    ({"name": "rotation", "angles": [1, 2, 3, 4, float("nan")]},
     "data.angles = [1, 2, 3, 4, nan]: angles must be finite numbers (degrees)"),
    ({"name": "rotation", "angles": [1, 2, 3, 4, "a"]},
     "data.angles = [1, 2, 3, 4, 'a']: angles must be finite numbers (degrees)"),
    ({"num_classes": 9}, "num_classes = 9: must be an integer >= 10 (largest label + 1)"),
    ({"train_labels": np.zeros((10, 2), dtype=np.int64)}, "train_labels = <array of shape (10, 2)>: must be 1-D"),
    ({"train_labels": np.array([0.5, 1.0, 2.0])}, "train_labels = <float64 array>: must hold integer labels"),
    ({"test_labels": np.array([-1, 0, 1])}, "test_labels = <array with minimum -1>: labels must be >= 0"),
    ({"train_labels": np.zeros(0, dtype=np.int64)},
     "train_labels = <empty array>: there are no training samples to split"),
    ({"alpha": 0.001, "min_size": 90, "max_retries": 2},
     "data.min_size = 90: no Dirichlet(alpha=0.001) split of 500 samples over 5 clients gave every client that "
     "many samples in 2 tries (best smallest client: BEST); use a larger data.alpha, a smaller data.min_size or "
     "fewer clients"),
]


@pytest.mark.parametrize(("settings", "message"), REFUSALS, ids=[m.split(":")[0] for _, m in REFUSALS])
def test_every_refusal_of_make_partition_is_one_whole_line(settings, message):
    """The whole message, not a prefix: a refusal that names the wrong limit, drops the value or the allowed
    range, or words the reason wrongly would pass a check of its key alone."""
    args = {**DIRICHLET, **settings}
    with pytest.raises(PartitionError) as err:
        make_partition(args.pop("name"), args.pop("train_labels"), args.pop("test_labels"), args.pop("num_clients"),
                       **args)
    if "BEST" not in message:
        assert str(err.value) == message
        return
    # the smallest client's best size over the tries is a draw: a count below min_size, not pinned
    found = re.fullmatch(re.escape(message).replace("BEST", r"(\d+)"), str(err.value))
    assert found and 0 < int(found.group(1)) < settings["min_size"]


GROUPS = np.arange(12) % 3  # 3 groups of 4 samples
GROUP_REFUSALS = [
    ("natural", 4, {},
     "data.num_clients = 4: the natural partition makes one client per group and this dataset has 3 groups; "
     "set data.num_clients = 3"),
    ("domain", 4, {}, "data.num_clients = 4: 3 domains x 1 clients per domain (data.clients_per_domain) = 3 clients"),
    ("domain", 6, {}, "data.num_clients = 6: 3 domains x 1 clients per domain (data.clients_per_domain) = 3 "
                      "clients; set data.clients_per_domain = 2 for 6 clients"),
    ("domain", 3, {"test_groups": None}, "data.partition = 'domain': needs a dataset with natural groups (domains "
                                         "or devices); test_groups is None"),
    ("natural", 3, {"train_groups": None}, "data.partition = 'natural': needs a dataset with natural groups "
                                           "(domains or devices); train_groups is None"),
    ("natural", 3, {"train_groups": GROUPS[:-1]},
     "train_groups = <11 / 12 ids>: needs one group id per train / test sample (12 / 12)"),
    ("natural", 3, {"test_groups": GROUPS[:-2]},
     "train_groups = <12 / 10 ids>: needs one group id per train / test sample (12 / 12)"),
    ("natural", 3, {"test_groups": GROUPS + 0.5}, "test_groups = <float64 array>: must hold integer labels"),
    ("natural", 3, {"train_groups": GROUPS + 0.5}, "train_groups = <float64 array>: must hold integer labels"),
    ("domain", 6, {"clients_per_domain": 3}, "data.num_clients = 6: 3 domains x 3 clients per domain "
                                             "(data.clients_per_domain) = 9 clients; set data.clients_per_domain "
                                             "= 2 for 6 clients"),
]


@pytest.mark.parametrize(("name", "clients", "settings", "message"), GROUP_REFUSALS)
def test_group_partitions_refuse_a_mismatch_naming_the_count_that_would_fit(name, clients, settings, message):
    args = {"train_groups": GROUPS, "test_groups": GROUPS, **settings}
    assert refusal(name, GROUPS, clients, **args) == message


def test_the_limits_themselves_are_allowed():
    """Each bound is inclusive where the message says so: one client per sample, min_size filling every client
    exactly, num_classes equal to the largest label + 1, uniform_share 0 and 1, concept groups = clients."""
    y = np.arange(20) % 4
    assert len(make_partition("iid", y, y, 20, seed=0).train) == 20
    assert [len(p) for p in make_partition("quantity", y, y, 4, seed=0, min_size=5).train] == [5] * 4
    assert make_partition("iid", y, y, 2, seed=0, num_classes=4).num_clients == 2
    for share in (0.0, 1.0):
        part = make_partition("dominant", y, y, 2, seed=0, uniform_share=share, samples_per_client=4,
                              dominant_groups=2, classes_per_group=2)
        assert [len(p) for p in part.train] == [4, 4]
    assert make_partition("concept", y, y, 4, seed=0, concept_groups=4).group == [0, 1, 2, 3]
    assert make_partition("iid", y, y, 2, seed=0, alpha=1e-9, quantity_sigma=0.0).num_clients == 2


def test_each_scheme_reads_exactly_the_settings_its_docstring_names():
    """make_partition's docstring: alpha (dirichlet, and a dirichlet base), min_size (dirichlet, quantity),
    classes_per_client (shards), FedPAC's six settings (dominant), quantity_sigma (quantity),
    clients_per_domain (domain), angles (rotation), base (rotation, concept), concept_groups (concept);
    test_per_client for every label scheme (domain and natural keep each group's own test samples)."""
    dominant = {"uniform_share", "samples_per_client", "dominant_groups", "classes_per_group", "group_classes",
                "reuse_samples"}
    want = {
        ("iid", "iid"): set(), ("dirichlet", "iid"): {"alpha", "min_size"}, ("shards", "iid"): {"classes_per_client"},
        ("dominant", "iid"): dominant, ("quantity", "iid"): {"min_size", "quantity_sigma"},
        ("rotation", "iid"): {"angles", "base"}, ("concept", "iid"): {"concept_groups", "base"},
        ("rotation", "dirichlet"): {"angles", "base", "alpha", "min_size"},
        ("concept", "dirichlet"): {"concept_groups", "base", "alpha", "min_size"},
    }
    for (name, base), keys in want.items():
        assert partition_keys(name, base) == keys | {"test_per_client"}, (name, base)
    assert partition_keys("domain") == {"clients_per_domain"} and partition_keys("natural") == set()
    assert partition_keys("dirichlet", "dirichlet") == partition_keys("dirichlet")  # base only under the two


def test_a_setting_a_scheme_ignores_gets_one_note_naming_the_schemes_that_read_it():
    """One note per setting moved from its default and not read, in PARTITION_SETTINGS' order; a setting at its
    default, or one the scheme reads, gets none."""
    values = {"alpha": 0.1, "min_size": 10, "angles": [1.0], "test_per_client": 3}
    defaults = {"alpha": 0.5, "min_size": 10, "test_per_client": 0}
    tail = "; set data.partition to one of those to use it"
    assert unused_settings("natural", "iid", values, defaults) == [
        "data.alpha = 0.1 has no effect: the natural partition does not use it (it is read by dirichlet, rotation "
        "with data.base = 'dirichlet', concept with data.base = 'dirichlet')" + tail,
        "data.test_per_client = 3 has no effect: the natural partition does not use it (it is read by iid, "
        "dirichlet, shards, dominant, quantity, rotation, concept)" + tail,
        "data.angles = [1.0] has no effect: the natural partition does not use it (it is read by rotation)" + tail,
    ]
    assert unused_settings("rotation", "dirichlet", {"alpha": 0.1, "min_size": 3}, {"alpha": 0.5, "min_size": 10}) == []
    assert unused_settings("rotation", "iid", {"alpha": 0.1, "min_size": 3}, {"alpha": 0.5, "min_size": 3}) == [
        "data.alpha = 0.1 has no effect: the rotation partition does not use it (it is read by dirichlet, rotation "
        "with data.base = 'dirichlet', concept with data.base = 'dirichlet')" + tail]


def test_the_summary_line_counts_sizes_classes_groups_angles_and_distinct_label_maps():
    """Client 0 holds labels 0, 0, 1 (2 classes), client 1 labels 2, 2, 2 (1), client 2 labels 1, 0 (2): 5/3
    classes per client; groups 0, 1, 0 are 2 groups; angles given unsorted; two clients share a label map."""
    y = np.array([0, 0, 1, 2, 2, 2, 1, 0])
    perm = np.array([2, 0, 1])
    part = Partition([np.array([0, 1, 2]), np.array([3, 4, 5]), np.array([6, 7])],
                     [np.array([0]), np.array([1, 2, 3]), np.array([4, 5])], rotation=[30.0, 0.0, 12.5],
                     label_perm=[np.arange(3), perm, perm.copy()], group=[0, 1, 0], scheme="concept")
    head = ("concept partition: 3 clients; train 8 samples (2-3 per client, mean 2.7); test 1-3 per client")
    tail = "; 2 groups; angles 0-30 deg; 2 label permutations"
    assert part.summary() == head + tail
    assert part.summary(y, 5) == head + "; classes per client 1.67 of 5" + tail
    assert part.summary(y) == head + "; classes per client 1.67 of 3" + tail  # classes: the largest label + 1
    plain = Partition([np.array([0]), np.array([1, 2])], [np.zeros(0, dtype=np.int64), np.array([0])])
    assert plain.summary() == "2 clients; train 3 samples (1-2 per client, mean 1.5); test 0-1 per client"
    assert Partition([], []).summary() == "0 clients"
    assert Partition([], [], scheme="iid").summary() == "iid partition: 0 clients"


class FirstDeal:
    """A generator whose first ``permutation`` is the given deal (the rest are a seeded generator's draws)."""

    def __init__(self, first: list[int], seed: int) -> None:
        self.first, self.rng = first, np.random.default_rng(seed)

    def permutation(self, n: int) -> np.ndarray:
        if self.first is not None:
            first, self.first = np.array(self.first), None
            return first
        return self.rng.permutation(n)

    def integers(self, *args: object) -> object:
        return self.rng.integers(*args)


def test_a_deal_no_swap_can_repair_falls_back_to_the_round_robin_of_class_sorted_shards():
    """_deal_distinct's docstring: if no swap removes a duplicate, the class-sorted shards are dealt round-robin
    (position p to client p mod num_clients), the clients in random order. Three classes of 5 shards (ids 0-4,
    5-9, 10-14) over 5 clients x 3: client 0 holds classes 0, 0, 1 and the only client without class 0 holds
    1, 1, 1 (no class-2 shard to swap in), so client r gets shards p, p + 5, p + 10 for p = perm[r]."""
    shard_class = np.repeat([0, 1, 2], 5)
    stuck = [0, 1, 5, 6, 7, 8, 2, 10, 11, 3, 12, 13, 4, 14, 9]
    deal = _deal_distinct(shard_class, 5, 3, FirstDeal(stuck, seed=3))
    clients = np.random.default_rng(3).permutation(5)  # the fallback's one draw
    assert deal.tolist() == [[p, p + 5, p + 10] for p in clients.tolist()]
    assert clients.tolist() != list(range(5))  # the order is the draw's, not the clients' own
    # reached from seeded draws too: every deal of 3 classes x 5 shards over 5 clients x 3 gives each client all
    # 3 classes (seed 9 of these ends in the fallback), through split_shards in equal shards of 10 samples
    y = np.repeat([0, 1, 2], 50)
    for seed in range(12):
        parts = split_shards(y, 5, np.random.default_rng(seed), 3)
        assert all(sorted(set(y[p].tolist())) == [0, 1, 2] and len(p) == 30 for p in parts), seed
        assert sorted(np.concatenate(parts).tolist()) == list(range(150))


def test_apportion_gives_the_largest_remainders_their_ceiling_and_ties_to_the_earlier_weights():
    """Hamilton's method: floors of the exact shares, then one more for the largest remainders until the total
    is reached; among equal remainders the earlier weights first (a stable sort: numpy's default sort orders
    equal keys its own way, which may differ between CPUs, so the same seed could split differently)."""
    assert _apportion(10, np.array([1.0, 1.0, 1.0])).tolist() == [4, 3, 3]  # a single unit short
    assert _apportion(7, np.array([0.45, 0.35, 0.2])).tolist() == [3, 3, 1]  # 3.15, 2.45, 1.4: the 0.45 wins
    assert _apportion(6, np.array([1.0, 2.0, 3.0])).tolist() == [1, 2, 3]  # exact: nothing short
    alternating = np.tile([1.0, 2.0], 10)  # 3 units over 20 weights: every 2 has share 0.2, every 1 share 0.1
    assert np.flatnonzero(_apportion(3, alternating)).tolist() == [1, 3, 5]


class FixedDirichlet:
    """A generator whose Dirichlet draws are the given vectors (its shuffles a seeded generator's)."""

    def __init__(self, draws: list[list[float]]) -> None:
        self.draws, self.rng = list(draws), np.random.default_rng(0)

    def dirichlet(self, alpha: np.ndarray) -> np.ndarray:
        return np.array(self.draws.pop(0))

    def permutation(self, x: object) -> np.ndarray:
        return self.rng.permutation(x)


def test_a_class_drawn_only_onto_full_clients_is_split_evenly_over_the_open_ones():
    """Two classes of 6 over 3 clients (cap 12 / 3 = 4). Class 0 all to client 0, which is then full; class 1's
    draw puts all its mass on client 0 too: masked, nothing is left, so it goes evenly to the open clients 1 and
    2 (NIID-Bench's loop divides 0 by 0 there)."""
    y = np.repeat([0, 1], 6)
    parts = split_dirichlet(y, 3, FixedDirichlet([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), 0.5, 0, 1)
    assert parts[0].tolist() == list(range(6))
    assert [len(p) for p in parts] == [6, 3, 3] and all(set(y[p].tolist()) == {1} for p in parts[1:])


def test_dirichlet_min_size_is_a_lower_bound_met_with_equality_and_its_refusal_reports_zero():
    """One class over 3 clients with alpha near 0: every draw gives the class to one client, so the smallest
    client has 0 samples. min_size = 0 accepts that first draw (>=, not >); min_size = 1 is refused after the
    tries, reporting 0 as the best smallest client. No samples at all: empty clients."""
    y = np.zeros(30, dtype=np.int64)
    parts = split_dirichlet(y, 3, np.random.default_rng(0), 1e-9, 0, 1)
    assert sorted(len(p) for p in parts) == [0, 0, 30]
    with pytest.raises(PartitionError, match=r"in 3 tries \(best smallest client: 0\)"):
        split_dirichlet(y, 3, np.random.default_rng(0), 1e-9, 1, 3)
    empty = split_dirichlet(np.zeros(0, dtype=np.int64), 3, np.random.default_rng(0), 0.5, 0, 1)
    assert [p.tolist() for p in empty] == [[], [], []] and all(p.dtype == np.int64 for p in empty)


def test_quantity_sizes_are_refused_exactly_when_their_shares_overflow():
    """exp(sigma z) for the largest of the 4 clients' normal draws z set just below float64's edge: 1e306 (the
    shares total * w / sum(w) stay finite: one client takes the 100 samples) is split, 1e307 (100 x 1e307
    overflows) is refused naming sigma, without a floating-point warning on the way."""
    z_max = float(np.random.default_rng(0).standard_normal(4).max())
    y = np.zeros(100, dtype=np.int64)
    near = math.log(1e306) / z_max
    assert sorted(len(p) for p in split_quantity(y, 4, np.random.default_rng(0), near, 0)) == [0, 0, 0, 100]
    over = math.log(1e307) / z_max
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(PartitionError, match=rf"^data.quantity_sigma = {over!r}: the log-normal client sizes"):
            split_quantity(y, 4, np.random.default_rng(0), over, 0)


def test_the_summary_counts_classes_up_to_the_largest_label_when_not_given():
    """num_classes defaults to the largest label + 1 (1 when every label is 0, or there are none)."""
    zeros = Partition([np.array([0, 1])], [np.array([0])])
    assert zeros.summary(np.zeros(2, dtype=np.int64)).endswith("; classes per client 1.00 of 1")
    none = Partition([np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)])
    assert none.summary(np.zeros(0, dtype=np.int64)).endswith("; classes per client 0.00 of 1")


def test_each_per_client_list_of_a_partition_is_checked_under_its_own_name():
    idx = [np.array([0, 1]), np.array([2])]
    for key, value in (("rotation", [0.0]), ("label_perm", [np.arange(3)]), ("group", [0, 1, 1])):
        with pytest.raises(PartitionError) as err:
            Partition(idx, idx, **{key: value})
        assert str(err.value) == f"Partition.{key} = <{len(value)} entries>: needs one entry per client (2)"


def test_every_setting_at_its_lower_bound_and_numpy_integers_are_accepted():
    """The bounds the refusals state are inclusive: one client, min_size 0, one retry, one class per client or
    group, one group, one client per domain, one sample per client, test_per_client 0 (the default); numpy
    integers count as integers and integral float labels as labels."""
    y = np.arange(12) % 3
    one = np.int64(1)
    assert [p.tolist() for p in make_partition("dirichlet", y, y, one, seed=np.int64(0), min_size=0,
                                               max_retries=1).train] == [list(range(12))]
    assert len(make_partition("shards", y, y, 3, seed=0, classes_per_client=one).train) == 3
    part = make_partition("dominant", y, y, 2, seed=0, dominant_groups=1, classes_per_group=1, samples_per_client=1,
                          test_per_client=0)
    assert [len(p) for p in part.train] == [1, 1] and part.group == [0, 0]
    assert [len(t) for t in part.test] == [1, 1]  # test_per_client 0: the default, max(1, 1 // 2)
    assert make_partition("concept", y, y, 2, seed=0, concept_groups=1).group == [0, 0]
    groups = np.arange(12) % 2
    assert make_partition("domain", y, y, 2, seed=0, train_groups=groups, test_groups=groups,
                          clients_per_domain=1).group == [0, 1]
    floats = make_partition("iid", y.astype(np.float64), y.astype(np.float32), 2, seed=0)
    assert sorted(np.concatenate(floats.train).tolist()) == list(range(12))


def test_the_default_personal_test_size_is_the_test_set_over_the_clients_at_least_one():
    """len(test) // num_clients per client, at least 1; none at all when the test split is empty."""
    y = np.arange(40) % 4
    assert [len(t) for t in make_partition("iid", y, y, 4, seed=0).test] == [10] * 4
    assert [len(t) for t in make_partition("iid", y, y[:8], 16, seed=0).test] == [1] * 16
    # 22 test samples over 6 clients: 3 each (22 // 6), the same split as test_per_client = 3 given
    train, test = (np.random.default_rng(s).integers(0, 4, n) for s, n in ((1, 60), (2, 22)))
    for seed in range(5):
        default, given = (make_partition("dirichlet", train, test, 6, seed=seed, min_size=0, test_per_client=t)
                          for t in (None, 3))
        assert [t.tolist() for t in default.test] == [t.tolist() for t in given.test], seed
    empty = make_partition("iid", y, np.zeros(0, dtype=np.float64), 2, seed=0)
    assert [t.tolist() for t in empty.test] == [[], []] and all(t.dtype == np.int64 for t in empty.test)
    angles = make_partition("rotation", y, y, 2, seed=0, angles=np.array([5, 10], dtype=np.float32)).rotation
    assert angles == [5.0, 10.0] and all(type(a) is float for a in angles)


def test_a_split_without_settings_is_the_one_the_configs_defaults_make():
    """A split made through the Python API without settings is the one a run's defaults make (DataConfig, the
    README's table of data.* keys): each scheme's split with no settings equals the split with the config's
    values given; samples_per_client None is FedPAC's 600, test_per_client None the scheme's default."""
    from hetfl.config import DataConfig

    defaults = DataConfig()
    given = {key: getattr(defaults, key) for key in (
        "alpha", "min_size", "classes_per_client", "uniform_share", "samples_per_client", "dominant_groups",
        "classes_per_group", "group_classes", "reuse_samples", "quantity_sigma", "clients_per_domain", "base",
        "concept_groups")}
    train, test = (np.random.default_rng(s).integers(0, 10, n) for s, n in ((1, 20_000), (2, 2_000)))
    for name in ("dirichlet", "shards", "dominant", "quantity", "concept", "rotation"):
        plain, explicit = make_partition(name, train, test, 10, seed=0), make_partition(name, train, test, 10,
                                                                                         seed=0, **given)
        assert [p.tolist() for p in plain.train] == [p.tolist() for p in explicit.train], name
        assert plain.group == explicit.group and plain.rotation == explicit.rotation, name
    assert refusal("dirichlet", np.arange(25) % 2, 3) == (
        "data.min_size = 10: 3 clients x 10 exceeds the 25 training samples")
    assert defaults.test_per_client == 0  # the scheme's default, as None


def test_an_impossible_dirichlet_split_is_refused_after_the_default_100_tries():
    """One class with alpha near 0 always goes whole to one client: min_size 1 can never be met."""
    y = np.zeros(30, dtype=np.int64)
    assert refusal("dirichlet", y, 3, alpha=1e-9, min_size=1) == (
        "data.min_size = 1: no Dirichlet(alpha=1e-09) split of 30 samples over 3 clients gave every client that many "
        "samples in 100 tries (best smallest client: 0); use a larger data.alpha, a smaller data.min_size or fewer "
        "clients")


def test_labels_that_are_all_zero_make_one_class():
    """The class count defaults to the largest label + 1, over both splits: 1 when every label is 0."""
    zeros = np.zeros(10, dtype=np.int64)
    assert make_partition("iid", zeros, zeros, 2, seed=0, num_classes=1).num_clients == 2
    assert refusal("shards", zeros, 2, classes_per_client=2) == "data.classes_per_client = 2: must be in [1, 1]"


def test_group_partitions_name_their_scheme_and_natural_ignores_clients_per_domain():
    y = np.arange(12) % 3
    groups = np.arange(12) % 3
    natural = make_partition("natural", y, y, 3, seed=0, train_groups=groups, test_groups=groups,
                             clients_per_domain=2)
    assert natural.scheme == "natural" and natural.group == [0, 1, 2]
    domain = make_partition("domain", y, y, 6, seed=0, train_groups=groups, test_groups=groups, clients_per_domain=2)
    assert domain.scheme == "domain" and domain.group == [0, 0, 1, 1, 2, 2]


def test_a_scheme_may_use_every_class_per_client_or_group():
    """classes_per_client and classes_per_group are allowed up to the number of classes, inclusive."""
    y = np.arange(30) % 3
    shards = make_partition("shards", y, y, 3, seed=0, classes_per_client=3)
    assert all(sorted(set(y[p].tolist())) == [0, 1, 2] for p in shards.train)
    dominant = make_partition("dominant", y, y, 2, seed=0, classes_per_group=3, dominant_groups=1,
                              samples_per_client=6, uniform_share=0.0)
    assert all(np.bincount(y[p], minlength=3).tolist() == [2, 2, 2] for p in dominant.train)


def test_the_dominant_default_test_size_is_half_the_training_samples_rounded_down():
    """FedPAC's 600 / 300; for an odd samples_per_client the integer half, as test_per_client given."""
    train, test = (np.random.default_rng(s).integers(0, 5, n) for s, n in ((1, 400), (2, 200)))
    for seed in range(5):
        default, given = (make_partition("dominant", train, test, 4, seed=seed, samples_per_client=15,
                                         dominant_groups=2, classes_per_group=2, test_per_client=t) for t in (None, 7))
        assert [t.tolist() for t in default.test] == [t.tolist() for t in given.test], seed
