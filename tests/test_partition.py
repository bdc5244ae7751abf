"""Partitions: every sample once, minimum sizes, determinism, scheme-specific rules, errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetfl.data.partition import PartitionError, dominant_classes, make_partition
from hetfl.data.partition_report import class_counts, format_table, partition_table, plot_partition

LABEL_SCHEMES = ["iid", "dirichlet", "shards", "quantity", "rotation", "concept"]


def labels(n: int, classes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, classes, n)


@settings(max_examples=25, deadline=None)
@given(scheme=st.sampled_from(LABEL_SCHEMES), seed=st.integers(0, 1000), clients=st.integers(1, 12),
       n=st.integers(200, 800))
def test_every_training_sample_is_assigned_exactly_once(scheme, seed, clients, n):
    y, y_test = labels(n, 5, seed), labels(200, 5, seed + 1)
    kwargs = {"alpha": 1.0, "min_size": 2, "classes_per_client": 2, "concept_groups": min(2, clients)}
    part = make_partition(scheme, y, y_test, clients, seed=seed, **kwargs)
    joined = np.concatenate(part.train)
    assert len(joined) == n and np.array_equal(np.sort(joined), np.arange(n))
    assert all(np.all(np.diff(p) > 0) for p in part.train)  # sorted, no duplicates
    again = make_partition(scheme, y, y_test, clients, seed=seed, **kwargs)
    assert all(np.array_equal(a, b) for a, b in zip(part.train, again.train, strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(part.test, again.test, strict=True))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 1000), alpha=st.floats(0.05, 5.0), min_size=st.integers(0, 20))
def test_dirichlet_holds_minimum_size(seed, alpha, min_size):
    y = labels(2000, 10, seed)
    part = make_partition("dirichlet", y, y[:500], 10, seed=seed, alpha=alpha, min_size=min_size, max_retries=500)
    assert min(len(p) for p in part.train) >= min_size


def test_different_seeds_give_different_splits():
    y = labels(1000, 10, 0)
    a = make_partition("dirichlet", y, y, 10, seed=1, alpha=0.5)
    b = make_partition("dirichlet", y, y, 10, seed=2, alpha=0.5)
    assert any(not np.array_equal(p, q) for p, q in zip(a.train, b.train, strict=True))


def test_small_alpha_is_more_skewed_than_large_alpha():
    y = labels(5000, 10, 3)
    def classes_held(alpha):
        part = make_partition("dirichlet", y, y[:1000], 20, seed=0, alpha=alpha, min_size=0)
        return (class_counts(part, y, 10) > 0).sum(1).mean()
    assert classes_held(0.05) < 4 < 9.5 < classes_held(100.0)


def test_impossible_minimum_size_fails_clearly():
    y = labels(300, 10, 0)
    with pytest.raises(PartitionError, match=r"data.min_size = 29: .*smallest client.*larger data.alpha"):
        make_partition("dirichlet", y, y, 10, seed=0, alpha=0.01, min_size=29, max_retries=5)


def test_shards_give_k_classes_per_client():
    y = np.repeat(np.arange(10), 100)
    part = make_partition("shards", y, y, 20, seed=0, classes_per_client=2)
    held = (class_counts(part, y, 10) > 0).sum(1)
    assert held.max() <= 2 and held.min() >= 1 and all(len(p) == 50 for p in part.train)


def test_dominant_split_follows_fedpac():
    assert dominant_classes(10, 5, 3) == [[0, 1, 2], [2, 3, 4], [4, 5, 6], [6, 7, 8], [8, 9, 0]]
    y = np.repeat(np.arange(10), 2000)
    y_test = np.repeat(np.arange(10), 1000)
    part = make_partition("dominant", y, y_test, 20, seed=0, samples_per_client=600, uniform_share=0.2)
    counts = class_counts(part, y, 10)
    assert (counts.sum(1) == 600).all()
    for i, row in enumerate(counts):
        group = dominant_classes(10, 5, 3)[i % 5]
        share = row[group].sum() / 600
        assert 0.8 <= share <= 0.8 + 0.2 * 3 / 10 + 0.06  # 80% dominant + the uniform part's share of them
    assert all(len(t) == 300 for t in part.test)  # FedPAC: 600 train / 300 test per client
    joined = np.concatenate(part.train)
    assert len(np.unique(joined)) == len(joined)


def test_dominant_pool_exhaustion_is_reported():
    y = np.repeat(np.arange(10), 50)
    with pytest.raises(PartitionError, match="samples_per_client"):
        make_partition("dominant", y, y, 20, seed=0, samples_per_client=600)


def test_personal_test_split_follows_train_distribution():
    y, y_test = labels(20000, 10, 1), labels(10000, 10, 2)
    part = make_partition("dirichlet", y, y_test, 10, seed=0, alpha=0.3, test_per_client=1000)
    for tr, te in zip(part.train, part.test, strict=True):
        p = np.bincount(y[tr], minlength=10) / len(tr)
        q = np.bincount(y_test[te], minlength=10) / len(te)
        assert 0.5 * np.abs(p - q).sum() < 0.02


def test_domain_and_natural_use_groups():
    y = labels(600, 4, 0)
    g = np.repeat(np.arange(3), 200)
    gt = np.repeat(np.arange(3), 50)
    part = make_partition("domain", y, y[:150], 6, seed=0, train_groups=g, test_groups=gt, clients_per_domain=2)
    assert part.group == [0, 0, 1, 1, 2, 2]
    for i, idx in enumerate(part.train):
        assert set(g[idx]) == {part.group[i]}
        assert set(gt[part.test[i]]) == {part.group[i]}
    nat = make_partition("natural", y, y[:150], 3, seed=0, train_groups=g, test_groups=gt)
    assert [len(p) for p in nat.train] == [200, 200, 200]
    with pytest.raises(PartitionError, match="data.num_clients = 4"):
        make_partition("natural", y, y[:150], 4, seed=0, train_groups=g, test_groups=gt)
    with pytest.raises(PartitionError, match="natural groups"):
        make_partition("domain", y, y, 3, seed=0)


def test_rotation_and_concept_transforms():
    y = labels(400, 10, 0)
    rot = make_partition("rotation", y, y, 4, seed=0)
    assert rot.rotation == [0.0, 45.0, 90.0, 135.0]
    rot = make_partition("rotation", y, y, 2, seed=0, angles=[10, 20])
    assert rot.rotation == [10.0, 20.0]
    with pytest.raises(PartitionError, match="data.angles"):
        make_partition("rotation", y, y, 3, seed=0, angles=[10, 20])
    con = make_partition("concept", y, y, 6, seed=0, concept_groups=3)
    assert np.array_equal(con.label_perm[0], np.arange(10)) and np.array_equal(con.label_perm[3], np.arange(10))
    assert not np.array_equal(con.label_perm[1], np.arange(10))
    assert np.array_equal(con.label_perm[1], con.label_perm[4])
    assert sorted(con.label_perm[2].tolist()) == list(range(10))


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"name": "zipf"}, "data.partition"),
        ({"num_clients": 0}, "data.num_clients"),
        ({"num_clients": 10_000}, "data.num_clients"),
        ({"alpha": 0.0}, "data.alpha"),
        ({"alpha": -1.0}, "data.alpha"),
        ({"min_size": -1}, "data.min_size"),
        ({"name": "shards", "classes_per_client": 0}, "data.classes_per_client"),
        ({"name": "shards", "classes_per_client": 11}, "data.classes_per_client"),
        ({"uniform_share": 1.5}, "data.uniform_share"),
        ({"name": "rotation", "base": "zipf"}, "data.base"),
        ({"name": "concept", "concept_groups": 0}, "data.concept_groups"),
    ],
)
def test_bad_settings_name_the_key(kwargs, key):
    args = {"name": "dirichlet", "num_clients": 5, **kwargs}
    y = labels(500, 10, 0)
    with pytest.raises(PartitionError) as err:
        make_partition(args.pop("name"), y, y, args.pop("num_clients"), seed=0, **args)
    assert str(err.value).startswith(key)


def test_table_and_heat_map(tmp_path):
    y = labels(1000, 10, 0)
    part = make_partition("dirichlet", y, y, 5, seed=0, alpha=0.5)
    rows = partition_table(part, y, y, 10)
    assert [r["n_train"] for r in rows] == [len(p) for p in part.train]
    assert "5 clients" in format_table(rows)
    out = tmp_path / "map.png"
    plot_partition(part, y, 10, out, class_names=[str(i) for i in range(10)], title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["map.png"]  # no temporary file left
