"""HAM10000 loader on a tiny fake release in the official layout (metadata table + zipped or extracted JPEGs)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hetfl.config import DATASET_NAMES
from hetfl.data.base import DatasetError
from hetfl.data.datasets import DATASETS, dataset_options, load_dataset
from hetfl.data.datasets import ham10000 as ham
from hetfl.data.partition import make_partition
from tests.helpers.datasets import HEADER, fake_rows, make_release

PIL = pytest.importorskip("PIL.Image")


def load(root: Path, cache: Path, **options):
    return load_dataset("ham10000", root, download=False, cache_dir=cache, **options)


def test_registered_with_its_options():
    assert "ham10000" in DATASETS and "ham10000" in DATASET_NAMES
    assert dataset_options("ham10000") == {"image_size": 96, "test_fraction": 0.2, "split_by": "lesion",
                                           "domains": ()}


@pytest.mark.parametrize(("tab", "zipped"), [(False, True), (True, False)])
def test_release_decodes_labels_domains_and_size(tmp_path, tab, zipped):
    rows = fake_rows()
    root = make_release(tmp_path / "ham", rows, tab=tab, zipped=zipped)
    ds = load(root, tmp_path / "c", image_size=16)
    assert ds.info.classes == ham.CLASSES and ds.info.input_shape == (3, 16, 16)
    assert ds.info.groups == ("rosendahl", "vidir_modern")
    assert len(ds.train) + len(ds.test) == len(rows)
    # every image keeps its own label and source: the grey level encodes the row number
    for split in (ds.train, ds.test):
        level = split.x[:, 0, 8, 8].numpy().astype(int)
        row = np.rint((level - 10) / 5).astype(int)
        assert [ham.CLASSES.index(rows[r][2]) for r in row] == split.y.tolist()
        assert [("rosendahl", "vidir_modern").index(rows[r][7]) for r in row] == split.group.tolist()


def test_split_is_seeded_stratified_and_keeps_lesions_whole(tmp_path):
    rows = fake_rows()
    root = make_release(tmp_path / "ham", rows)
    a = load(root, tmp_path / "c", image_size=8, test_fraction=0.2)
    lesion_of = {10 + 5 * n: rows[n][0] for n in range(len(rows))}

    def lesions(split):
        return {lesion_of[int(v)] for v in np.rint(split.x[:, 0, 4, 4].numpy()).astype(int)}

    assert not lesions(a.train) & lesions(a.test)
    # per (domain, class) cell: round(0.2 * n) images, whole lesions (nv of vidir_modern: 9 images in lesions of 3)
    for g in (0, 1):
        for label in range(7):
            cell = int(((a.test.group == g) & (a.test.y == label)).sum())
            size = 9 if label == ham.CLASSES.index("nv") else 2
            expected = 3 if (g, label) == (1, 5) else round(0.2 * size)
            assert cell == expected, (g, label, cell)
    same = load(root, tmp_path / "c", image_size=8, test_fraction=0.2)
    assert same.test.x.equal(a.test.x)
    others = [load_dataset("ham10000", root, download=False, cache_dir=tmp_path / "c", image_size=8, seed=s)
              for s in range(1, 6)]
    assert any(not o.test.x.equal(a.test.x) for o in others)  # the run seed draws the split


def test_image_split_and_domain_selection(tmp_path):
    root = make_release(tmp_path / "ham", fake_rows())
    by_image = load(root, tmp_path / "c", image_size=8, split_by="image", test_fraction=0.5)
    nv = ham.CLASSES.index("nv")
    assert int(((by_image.test.group == 1) & (by_image.test.y == nv)).sum()) == round(0.5 * 9)
    one = load(root, tmp_path / "c", image_size=8, domains=["vidir_modern"])
    assert one.info.groups == ("vidir_modern",) and set(one.train.group.tolist()) == {0}
    assert len(one.train) + len(one.test) == 7 * 2 + 7  # 2 per class + 7 more nv
    with pytest.raises(DatasetError, match="not in"):
        load(root, tmp_path / "c", domains=["vienna_dias"])


def test_domain_partition_gives_one_client_per_source(tmp_path):
    ds = load(make_release(tmp_path / "ham", fake_rows()), tmp_path / "c", image_size=8)
    parts = make_partition("domain", ds.train.y.numpy(), ds.test.y.numpy(), 2, seed=0, num_classes=7,
                           train_groups=ds.train.group.numpy(), test_groups=ds.test.group.numpy())
    for client, idx in enumerate(parts.train):
        assert set(ds.train.group[idx].tolist()) == {client}


def test_missing_files_name_the_source_and_never_download(tmp_path):
    (tmp_path / "empty").mkdir()
    for download in (True, False):
        with pytest.raises(DatasetError, match="10.7910/DVN/DBW86T") as err:
            load_dataset("ham10000", tmp_path / "empty", download=download, cache_dir=tmp_path / "c")
        assert "HAM10000_images_part_1.zip" in str(err.value)
        assert ("does not download" in str(err.value)) == download
    rows = fake_rows()
    root = make_release(tmp_path / "ham", rows)
    (root / ham.IMAGE_ARCHIVES[1]).unlink()
    with pytest.raises(DatasetError, match=f"{len(rows) - len(rows) // 2} of the {len(rows)} images"):
        load(root, tmp_path / "c2")


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda rows: [[*r[:2], "melanoma", *r[3:]] for r in rows], "dx = 'melanoma' is not one of"),
        (lambda rows: [*rows, rows[0]], "appears twice"),
    ],
)
def test_bad_metadata(tmp_path, edit, expected):
    root = make_release(tmp_path / "ham", edit(fake_rows()))
    with pytest.raises(DatasetError, match=expected):
        load(root, tmp_path / "c")


def test_metadata_without_required_column_or_without_sources(tmp_path):
    rows = fake_rows()
    no_dx = make_release(tmp_path / "a", [r[:2] for r in rows], header=HEADER[:2])
    with pytest.raises(DatasetError, match=r"column\(s\) \['dx'\] missing"):
        load(no_dx, tmp_path / "c")
    old = make_release(tmp_path / "b", rows, header=HEADER[:7])  # the first release had no 'dataset' column
    ds = load(old, tmp_path / "c", image_size=8)
    assert ds.info.groups == () and ds.train.group is None
    assert any("no 'dataset' column" in n for n in ds.notes)


def test_cache_is_reused(tmp_path, monkeypatch):
    root = make_release(tmp_path / "ham", fake_rows())
    load(root, tmp_path / "c", image_size=8)

    def fail(*args, **kwargs):
        raise AssertionError("decoded again")

    monkeypatch.setattr(ham, "decode_ham10000", fail)
    again = load(root, tmp_path / "c", image_size=8, test_fraction=0.3)  # a new split, no new decoding
    assert len(again.test) > 0
