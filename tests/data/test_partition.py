"""Partitions: every sample once, minimum sizes, determinism, scheme-specific rules, errors, report and heat map."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hetfl.data.partition import (
    PARTITIONS,
    Partition,
    PartitionError,
    _deal_distinct,
    dominant_classes,
    make_partition,
)
from hetfl.data.partition_report import (
    class_counts,
    format_table,
    partition_table,
    plot_partition,
    summary_row,
)

COVERING = ["iid", "dirichlet", "shards", "quantity", "rotation", "concept"]  # every training sample handed out


def labels(n: int, classes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, classes, n)


def same(a: Partition, b: Partition) -> bool:
    pairs = [*zip(a.train, b.train, strict=True), *zip(a.test, b.test, strict=True)]
    if a.label_perm is not None and b.label_perm is not None:
        pairs += list(zip(a.label_perm, b.label_perm, strict=True))
    return all(np.array_equal(x, y) for x, y in pairs) and a.rotation == b.rotation and a.group == b.group


def tv(p: np.ndarray, q: np.ndarray) -> float:
    return 0.5 * float(np.abs(p / p.sum() - q / q.sum()).sum())


# ------------------------------------------------------------------ properties
@settings(max_examples=40, deadline=None)
@given(scheme=st.sampled_from(COVERING), base=st.sampled_from(["iid", "dirichlet"]), seed=st.integers(0, 10_000),
       clients=st.integers(1, 12), classes=st.integers(2, 6), n=st.integers(200, 600), k=st.integers(1, 3))
def test_every_training_sample_is_assigned_exactly_once(scheme, base, seed, clients, classes, n, k):
    if scheme == "shards":
        assume(k <= classes <= clients * k)
    y, y_test = labels(n, classes, seed), labels(150, classes, seed + 1)
    kwargs = {"alpha": 1.0, "min_size": 2, "classes_per_client": k, "concept_groups": min(2, clients), "base": base}
    part = make_partition(scheme, y, y_test, clients, seed=seed, **kwargs)
    assert part.num_clients == clients and part.scheme == scheme
    joined = np.concatenate(part.train)
    assert joined.dtype == np.int64 and np.array_equal(np.sort(joined), np.arange(n))  # disjoint and complete
    assert all(np.all(np.diff(p) > 0) for p in part.train)  # each sorted, no duplicates
    assert all(t.dtype == np.int64 and np.all(np.diff(t) > 0) and (t.size == 0 or t.max() < 150) for t in part.test)
    if scheme == "shards":
        assert ((class_counts(part, y, classes) > 0).sum(1) == k).all()  # exactly k classes each
    assert same(part, make_partition(scheme, y, y_test, clients, seed=seed, **kwargs))  # same seed, same split


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), clients=st.integers(1, 12), samples=st.integers(20, 120),
       share=st.sampled_from([0.0, 0.2, 0.5, 1.0]), groups=st.integers(1, 5), per_group=st.integers(1, 4))
def test_dominant_is_disjoint_with_exact_sizes(seed, clients, samples, share, groups, per_group):
    y = labels(3000, 10, seed)
    try:
        part = make_partition("dominant", y, y[:500], clients, seed=seed, samples_per_client=samples,
                              uniform_share=share, dominant_groups=groups, classes_per_group=per_group)
    except PartitionError as err:  # a concentrated demand can exceed a class's ~300 samples
        assert str(err).startswith("data.samples_per_client") and "only" in str(err)
        return
    joined = np.concatenate(part.train)
    assert len(np.unique(joined)) == len(joined) == clients * samples
    assert [len(p) for p in part.train] == [samples] * clients
    assert part.group == [i % groups for i in range(clients)]
    n_uniform = round(samples * share)
    n_dominant = samples - n_uniform
    for i, row in enumerate(class_counts(part, y, 10)):
        dominant = dominant_classes(10, groups, per_group)[i % groups]
        others = np.setdiff1d(np.arange(10), dominant)
        assert set(row[others].tolist()) <= {n_uniform // 10, n_uniform // 10 + 1}  # uniform part only
        extra = row[dominant] - n_uniform // 10 - n_dominant // per_group  # remainders: 0, 1 or 2
        assert extra.min() >= 0 and extra.max() <= 2


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), alpha=st.floats(0.05, 5.0), min_size=st.integers(0, 40),
       scheme=st.sampled_from(["dirichlet", "quantity"]), sigma=st.floats(0.0, 3.0))
def test_minimum_size_is_held(seed, alpha, min_size, scheme, sigma):
    y = labels(2000, 10, seed)
    part = make_partition(scheme, y, y[:500], 10, seed=seed, alpha=alpha, min_size=min_size, max_retries=1000,
                          quantity_sigma=sigma)
    assert min(len(p) for p in part.train) >= min_size


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), clients=st.integers(2, 30), k=st.integers(1, 5), classes=st.integers(2, 12))
def test_distinct_deal_never_repeats_a_class(seed, clients, k, classes):
    rng = np.random.default_rng(seed)
    per_class = np.zeros(classes, dtype=np.int64)  # random shard counts, each at most `clients`
    for c in rng.integers(0, classes, clients * k):
        per_class[c] += 1
    assume(per_class.max() <= clients)
    shard_class = np.repeat(np.arange(classes), per_class)
    deal = _deal_distinct(shard_class, clients, k, rng)
    assert np.array_equal(np.sort(deal.ravel()), np.arange(clients * k))
    assert all(len(set(shard_class[row])) == k for row in deal)


# ------------------------------------------------------------------ schemes
def test_different_seeds_give_different_splits():
    y = labels(1000, 10, 0)
    for scheme in ("iid", "dirichlet", "shards", "quantity", "dominant"):
        kwargs = {"samples_per_client": 50} if scheme == "dominant" else {}
        parts = [make_partition(scheme, y, y, 10, seed=s, **kwargs) for s in range(3)]
        assert not same(parts[0], parts[1]) and not same(parts[1], parts[2]), scheme


def test_test_split_settings_do_not_change_the_training_split():
    y = labels(2000, 10, 5)
    a = make_partition("dirichlet", y, y, 8, seed=3, test_per_client=50)
    b = make_partition("dirichlet", y, y, 8, seed=3, test_per_client=200)
    assert all(np.array_equal(p, q) for p, q in zip(a.train, b.train, strict=True))


def test_small_alpha_is_more_skewed_than_large_alpha():
    y = labels(5000, 10, 3)

    def classes_held(alpha: float) -> float:
        part = make_partition("dirichlet", y, y[:1000], 20, seed=0, alpha=alpha, min_size=0)
        return (class_counts(part, y, 10) > 0).sum(1).mean()

    assert classes_held(0.05) < 4 < 9.5 < classes_held(100.0)


def test_dirichlet_balancing_rule_caps_client_growth():
    """NIID-Bench's rule: a client holding >= N / clients gets no more classes, so no client
    exceeds the cap by more than one class's worth."""
    y = np.repeat(np.arange(10), 500)
    part = make_partition("dirichlet", y, y, 10, seed=4, alpha=0.1, min_size=0)
    assert max(len(p) for p in part.train) < 500 + 500


def test_impossible_minimum_size_fails_clearly():
    y = labels(300, 10, 0)
    expected = r"^data.min_size = 29: .*5 tries.*smallest client: \d+.*larger data.alpha"
    with pytest.raises(PartitionError, match=expected):
        make_partition("dirichlet", y, y, 10, seed=0, alpha=0.01, min_size=29, max_retries=5)


def test_shards_follow_mcmahan_with_exactly_k_classes():
    y = np.repeat(np.arange(10), 100)
    part = make_partition("shards", y, y, 20, seed=0, classes_per_client=2)
    held = class_counts(part, y, 10)
    assert ((held > 0).sum(1) == 2).all() and all(len(p) == 50 for p in part.train)  # 40 shards of 25
    assert set(np.unique(held)) == {0, 25}
    skewed = np.concatenate([np.zeros(700, dtype=np.int64), np.arange(1, 10).repeat(30)])  # one huge class
    part = make_partition("shards", skewed, skewed, 10, seed=1, classes_per_client=3)
    assert ((class_counts(part, skewed, 10) > 0).sum(1) == 3).all()
    assert sorted(np.concatenate(part.train).tolist()) == list(range(len(skewed)))


def test_dominant_split_follows_fedpac():
    assert dominant_classes(10, 5, 3) == [[0, 1, 2], [2, 3, 4], [4, 5, 6], [6, 7, 8], [8, 9, 0]]
    y = np.repeat(np.arange(10), 2000)
    y_test = np.repeat(np.arange(10), 1000)
    part = make_partition("dominant", y, y_test, 20, seed=0)  # FedPAC: 600 per client, s = 20 %
    counts = class_counts(part, y, 10)
    for i, row in enumerate(counts):
        group = dominant_classes(10, 5, 3)[i % 5]
        expected = np.full(10, 12)  # 120 uniform samples: 12 per class
        expected[group] += 160  # 480 = 80 % from the group's 3 classes
        assert np.array_equal(row, expected)
        test_row = np.bincount(y_test[part.test[i]], minlength=10)
        assert np.array_equal(test_row, expected // 2)  # 300 test samples with the same distribution
    joined = np.concatenate(part.train)
    assert len(np.unique(joined)) == len(joined) == 12_000
    assert part.group == [i % 5 for i in range(20)]


def test_dominant_pool_exhaustion_is_reported():
    y = np.repeat(np.arange(10), 50)
    with pytest.raises(PartitionError, match=r"^data.samples_per_client = 600: 20 clients need \d+ .* only 50 exist"):
        make_partition("dominant", y, y, 20, seed=0)


def test_quantity_sizes_vary_with_iid_labels():
    y = labels(20000, 10, 2)
    part = make_partition("quantity", y, y[:2000], 20, seed=0, quantity_sigma=1.0, min_size=50)
    sizes = np.array([len(p) for p in part.train])
    assert sizes.min() >= 50 and sizes.max() > 3 * sizes.min()
    big = int(sizes.argmax())
    assert tv(np.bincount(y[part.train[big]], minlength=10), np.bincount(y, minlength=10)) < 0.05
    flat = make_partition("quantity", y, y[:2000], 20, seed=0, quantity_sigma=0.0, min_size=0)
    assert {len(p) for p in flat.train} == {1000}


def test_personal_test_split_follows_train_distribution():
    y, y_test = labels(20000, 10, 1), labels(10000, 10, 2)
    part = make_partition("dirichlet", y, y_test, 10, seed=0, alpha=0.3, test_per_client=1000)
    for tr, te in zip(part.train, part.test, strict=True):
        assert tv(np.bincount(y[tr], minlength=10), np.bincount(y_test[te], minlength=10)) < 0.02
        assert len(te) <= 1000
    default = make_partition("iid", y, y_test, 10, seed=0)
    assert [len(t) for t in default.test] == [1000] * 10  # default: len(test) // clients


def test_personal_test_takes_what_exists_of_a_rare_class():
    y = np.repeat(np.arange(2), 500)
    y_test = np.array([0] * 5 + [1] * 500)
    part = make_partition("shards", y, y_test, 2, seed=0, classes_per_client=1, test_per_client=100)
    sizes = sorted(len(t) for t in part.test)
    assert sizes == [5, 100]


def test_domain_and_natural_use_groups():
    y = labels(600, 4, 0)
    g = np.repeat(np.arange(3), 200)
    gt = np.repeat(np.arange(3), 50)
    part = make_partition("domain", y, y[:150], 6, seed=0, train_groups=g, test_groups=gt, clients_per_domain=2)
    assert part.group == [0, 0, 1, 1, 2, 2]
    assert sorted(np.concatenate(part.train).tolist()) == list(range(600))
    for i, idx in enumerate(part.train):
        assert set(g[idx]) == {part.group[i]} and len(idx) == 100
        assert set(gt[part.test[i]]) == {part.group[i]} and len(part.test[i]) == 25
    assert not set(part.test[0]) & set(part.test[1])  # a domain's test data split among its clients
    nat = make_partition("natural", y, y[:150], 3, seed=0, train_groups=g + 7, test_groups=gt + 7)
    assert [len(p) for p in nat.train] == [200, 200, 200] and nat.group == [7, 8, 9]
    assert [len(t) for t in nat.test] == [50, 50, 50]
    with pytest.raises(PartitionError, match=r"^data.num_clients = 4: .*3 groups; set data.num_clients = 3"):
        make_partition("natural", y, y[:150], 4, seed=0, train_groups=g, test_groups=gt)
    with pytest.raises(PartitionError, match=r"^data.num_clients = 9: .*set data.clients_per_domain = 3"):
        make_partition("domain", y, y[:150], 9, seed=0, train_groups=g, test_groups=gt)
    with pytest.raises(PartitionError, match=r"^data.partition = 'domain': needs a dataset with natural groups"):
        make_partition("domain", y, y, 3, seed=0)
    with pytest.raises(PartitionError, match=r"^train_groups"):
        make_partition("natural", y, y[:150], 3, seed=0, train_groups=g[:-1], test_groups=gt)


def test_rotation_angles():
    y = labels(400, 10, 0)
    rot = make_partition("rotation", y, y, 10, seed=0)
    assert rot.rotation == [15.0 * i for i in range(10)]  # FedBR's RotatedMNIST: 0, 15, ..., 135
    assert make_partition("rotation", y, y, 4, seed=0).rotation == [0.0, 37.5, 75.0, 112.5]
    rot = make_partition("rotation", y, y, 2, seed=0, angles=[10, 20.5])
    assert rot.rotation == [10.0, 20.5] and rot.label_perm is None
    with pytest.raises(PartitionError, match=r"^data.angles = \[10, 20\]: needs one angle per client \(3\)"):
        make_partition("rotation", y, y, 3, seed=0, angles=[10, 20])
    with pytest.raises(PartitionError, match=r"^data.angles"):
        make_partition("rotation", y, y, 2, seed=0, angles=[10, float("nan")])
    skewed = make_partition("rotation", y, y, 4, seed=0, base="dirichlet", alpha=0.1, min_size=0)
    assert not same(skewed, make_partition("rotation", y, y, 4, seed=0))


def test_concept_permutations():
    y = labels(600, 10, 0)
    con = make_partition("concept", y, y, 7, seed=0, concept_groups=3)
    assert con.group == [0, 1, 2, 0, 1, 2, 0]
    identity = np.arange(10)
    for i, perm in enumerate(con.label_perm):
        assert sorted(perm.tolist()) == list(range(10))
        assert np.array_equal(perm, con.label_perm[i % 3])
        assert np.array_equal(perm, identity) == (i % 3 == 0)
    assert not np.array_equal(con.label_perm[1], con.label_perm[2])
    two = make_partition("concept", labels(100, 2, 0), labels(100, 2, 1), 4, seed=0, concept_groups=2)
    assert two.label_perm[1].tolist() == [1, 0]  # the only non-identity map of 2 classes
    with pytest.raises(PartitionError, match=r"^data.concept_groups = 3: .*2 label permutations"):
        make_partition("concept", labels(100, 2, 0), labels(100, 2, 1), 4, seed=0, concept_groups=3)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"name": "zipf"}, "data.partition"),
        ({"num_clients": 0}, "data.num_clients"),
        ({"num_clients": 10_000}, "data.num_clients"),
        ({"num_clients": 2.5}, "data.num_clients"),
        ({"seed": -1}, "seed"),
        ({"alpha": 0.0}, "data.alpha"),
        ({"alpha": -1.0}, "data.alpha"),
        ({"alpha": float("nan")}, "data.alpha"),
        ({"min_size": -1}, "data.min_size"),
        ({"min_size": 200}, "data.min_size"),
        ({"max_retries": 0}, "max_retries"),
        ({"name": "shards", "classes_per_client": 0}, "data.classes_per_client"),
        ({"name": "shards", "classes_per_client": 11}, "data.classes_per_client"),
        ({"name": "shards", "num_clients": 2, "classes_per_client": 3}, "data.classes_per_client"),
        ({"uniform_share": 1.5}, "data.uniform_share"),
        ({"uniform_share": -0.1}, "data.uniform_share"),
        ({"name": "dominant", "samples_per_client": 0}, "data.samples_per_client"),
        ({"name": "dominant", "dominant_groups": 0}, "data.dominant_groups"),
        ({"name": "dominant", "classes_per_group": 11}, "data.classes_per_group"),
        ({"test_per_client": -1}, "data.test_per_client"),
        ({"quantity_sigma": -1.0}, "data.quantity_sigma"),
        # log-normal sizes past float64 (exp(1000 z)): once a ValueError from np.repeat of NaN sizes
        ({"name": "quantity", "quantity_sigma": 1000.0}, "data.quantity_sigma"),
        ({"clients_per_domain": 0}, "data.clients_per_domain"),
        ({"name": "rotation", "base": "zipf"}, "data.base"),
        ({"name": "concept", "concept_groups": 0}, "data.concept_groups"),
        ({"name": "concept", "concept_groups": 6}, "data.concept_groups"),
        ({"num_classes": 5}, "num_classes"),
        ({"train_labels": np.zeros((10, 2), dtype=np.int64)}, "train_labels"),
        ({"train_labels": np.array([0.5, 1.0, 2.0])}, "train_labels"),
        ({"test_labels": np.array([-1, 0, 1])}, "test_labels"),
        ({"train_labels": np.zeros(0, dtype=np.int64)}, "train_labels"),
    ],
)
def test_bad_settings_name_the_key(kwargs, key):
    y = labels(500, 10, 0)
    args = {"name": "dirichlet", "train_labels": y, "test_labels": y, "num_clients": 5, "seed": 0, **kwargs}
    with pytest.raises(PartitionError) as err:
        make_partition(args.pop("name"), args.pop("train_labels"), args.pop("test_labels"), args.pop("num_clients"),
                       **args)
    message = str(err.value)
    assert message.startswith(f"{key} = ") and "\n" not in message
    assert isinstance(err.value, ValueError)


def test_every_scheme_is_listed_and_partition_checks_lengths():
    assert set(PARTITIONS) == {"iid", "dirichlet", "shards", "dominant", "quantity", "domain", "natural",
                               "rotation", "concept"}
    idx = [np.array([0, 1]), np.array([2])]
    with pytest.raises(PartitionError, match="Partition.test"):
        Partition(idx, idx[:1])
    with pytest.raises(PartitionError, match="Partition.rotation"):
        Partition(idx, idx, rotation=[0.0])


# ------------------------------------------------------------------ report
def test_table_summary_and_heat_map(tmp_path):
    y = labels(3000, 10, 0)
    part = make_partition("dominant", y, y, 5, seed=0, samples_per_client=150)
    rows = partition_table(part, y, y, 10)
    assert [r["n_train"] for r in rows] == [150] * 5 and [r["group"] for r in rows] == [0, 1, 2, 3, 4]
    assert all(r["n_classes"] == 10 and r["n_test"] == 75 and r["test_tv"] < 0.05 for r in rows)
    assert abs(rows[0]["top_class_share"] - 43 / 150) < 1e-4  # 3 uniform + 40 dominant of 150
    assert 0 < rows[0]["entropy_bits"] < np.log2(10)
    total = partition_table(part, y, y, 10, summary=True)[-1]
    assert total == summary_row(rows) and total["client"] == "all" and total["n_train"] == 750 and total["group"] == 5
    text = format_table(rows)
    assert "5 clients" in text and "all" in text and len(text.splitlines()) == 1 + 5 + 2 + 1
    assert "dominant partition: 5 clients" in part.summary(y, 10)

    out = tmp_path / "plots" / "map.png"  # the folder is created
    plot_partition(part, y, 10, out, class_names=[str(i) for i in range(10)], title="t")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert [p.name for p in out.parent.iterdir()] == ["map.png"]  # no temporary file left
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o666 & ~umask  # an ordinary file, not mkstemp's 0600
    many = make_partition("iid", labels(3000, 10, 1), y, 60, seed=0)  # no per-cell numbers, no client ticks
    plot_partition(many, labels(3000, 10, 1), 10, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in out.parent.iterdir()] == ["map.png"]


def test_failed_plot_leaves_nothing(tmp_path):
    part = make_partition("iid", labels(100, 3, 0), labels(30, 3, 0), 2, seed=0)
    (tmp_path / "map.png").mkdir()  # the target is a folder: the final rename fails
    with pytest.raises(IsADirectoryError):
        plot_partition(part, labels(100, 3, 0), 3, tmp_path / "map.png")
    assert [p.name for p in tmp_path.iterdir()] == ["map.png"]  # the temporary file is gone


# ------------------------------------------------------------------ which settings a scheme reads
_OTHER_VALUES = {"alpha": 0.05, "min_size": 3, "classes_per_client": 3, "uniform_share": 0.5,
                 "samples_per_client": 40, "test_per_client": 7, "dominant_groups": 2, "classes_per_group": 2,
                 "group_classes": [[1, 2], [3]], "reuse_samples": True,
                 "quantity_sigma": 2.0, "angles": [0.0, 10.0, 20.0, 30.0, 40.0], "base": "dirichlet",
                 "concept_groups": 3}


@pytest.mark.parametrize("scheme, base", [(p, "iid") for p in PARTITIONS] + [("rotation", "dirichlet"),
                                                                             ("concept", "dirichlet")])
def test_partition_keys_names_every_setting_a_scheme_reads(scheme, base):
    """A setting outside ``partition_keys`` changes nothing: a run that says such a setting has no effect is
    right."""
    from hetfl.data.partition import PARTITION_SETTINGS, partition_keys

    rng = np.random.default_rng(0)
    train, test = rng.integers(0, 10, 5000), rng.integers(0, 10, 1000)
    groups = {"train_groups": np.arange(5000) % 5, "test_groups": np.arange(1000) % 5}

    def split(**settings):
        settings = {"base": base, **settings}
        p = make_partition(scheme, train, test, 5, seed=0, **groups, **settings)
        perms = None if p.label_perm is None else [q.tolist() for q in p.label_perm]
        return [c.tolist() for c in p.train], [c.tolist() for c in p.test], p.rotation, perms

    used = partition_keys(scheme, base)
    assert used <= set(PARTITION_SETTINGS)
    same = split()
    for key, value in _OTHER_VALUES.items():
        if key == "base" and scheme in ("rotation", "concept"):
            continue  # the parametrisation covers both bases
        if key not in used:
            assert split(**{key: value}) == same, key


def test_a_run_says_a_partition_setting_it_ignores_has_no_effect(tmp_path, capsys, caplog, one_thread):
    """data.alpha = 0.1 on the default data (its natural split) made the same run as without it, silently."""
    from hetfl.cli import main

    argv = ["run", "--set", "data.alpha=0.1", "--set", "train.rounds=1", "--set", "data.options={max_samples = 150}",
            "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "natural")]) == 0
    said = capsys.readouterr().err + caplog.text
    assert "data.alpha = 0.1 has no effect: the natural partition does not use it (it is read by dirichlet" in said
    caplog.clear()
    assert main([*argv, "--set", "data.partition=dirichlet", "--set", "data.num_clients=3",
                 "--out", str(tmp_path / "dirichlet")]) == 0
    assert "no effect" not in capsys.readouterr().err + caplog.text
