"""The decoded-array cache (``hetfl.data.datasets.cache``): what mutation testing of the module
(``benchmarks/mutation.py`` target ``datasets_cache``, session 42) showed the loaders' tests leave unchecked.

The source files' fingerprint, which decides whether a cached entry still holds what the files decode to: it
names the folder (two copies of one dataset never share an entry) and each file's place in it (a class folder
renamed is other labels), skips hidden entries (a download's ``.part``, an atomic write's ``.tmp``), and finishes
on the links a folder may hold (one that leads nowhere, one back into an ancestor at any depth). The entry's name:
the same key whatever its order, a key with paths in it, the name an earlier release gave it (pinned).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from hetfl.data.datasets import cache


def folder_of_files(root: Path, names: dict[str, bytes]) -> Path:
    for name, data in names.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
        os.utime(root / name, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    return root


# ------------------------------------------------------------------ the fingerprint
def test_two_copies_of_one_folder_have_their_own_fingerprints(tmp_path):
    first = folder_of_files(tmp_path / "a", {"x.bin": b"1", "sub/y.bin": b"22"})
    second = tmp_path / "b"
    shutil.copytree(first, second)  # sizes and modification times copied too
    assert cache.fingerprint([first]) != cache.fingerprint([second])


def test_a_renamed_class_folder_changes_the_fingerprint(tmp_path):
    root = folder_of_files(tmp_path / "data", {"cat/1.png": b"1", "dog/2.png": b"2"})
    before = cache.fingerprint([root])
    (root / "dog").rename(root / "wolf")
    assert cache.fingerprint([root]) != before


def test_hidden_entries_do_not_change_the_fingerprint(tmp_path):
    root = folder_of_files(tmp_path / "data", {"cat/1.png": b"1"})
    before = cache.fingerprint([root])
    (root / ".f.bin.abcdefgh.part").write_bytes(b"half a download")
    (root / "cat" / ".1.png.abcdefgh.tmp").write_bytes(b"")
    assert cache.fingerprint([root]) == before
    (root / "cat" / "2.png").write_bytes(b"")
    assert cache.fingerprint([root]) != before


def test_a_link_that_leads_nowhere_counts_as_itself(tmp_path):
    root = folder_of_files(tmp_path / "data", {"cat/1.png": b"1"})
    (root / "cat" / "2.png").symlink_to(tmp_path / "gone.png")
    before = cache.fingerprint([root])
    assert cache.fingerprint([root]) == before
    (root / "cat" / "2.png").unlink()
    (root / "cat" / "2.png").symlink_to(tmp_path / "a-longer-name-that-is-also-gone.png")  # another link's size
    assert cache.fingerprint([root]) != before


def test_a_link_back_into_an_ancestor_deeper_down_ends_the_walk(tmp_path):
    root = folder_of_files(tmp_path / "data", {"a/b/1.png": b"1"})
    (root / "a" / "b" / "loop").symlink_to(root / "a")
    (root / "a" / "top").symlink_to(root)
    assert cache.fingerprint([root]) == cache.fingerprint([root])


def test_a_file_is_fingerprinted_by_its_path_size_and_time(tmp_path):
    one = folder_of_files(tmp_path, {"one.gz": b"12", "two.gz": b"12"})
    assert cache.fingerprint([one / "one.gz"]) != cache.fingerprint([one / "two.gz"])
    before = cache.fingerprint([one / "one.gz"])
    (one / "one.gz").write_bytes(b"123")
    assert cache.fingerprint([one / "one.gz"]) != before


# ------------------------------------------------------------------ the entry
def test_an_entry_is_named_by_its_key_whatever_the_keys_order(tmp_path):
    a = cache.entry_dir(tmp_path, {"dataset": "mnist", "size": 28, "source": "f1"})
    assert a == cache.entry_dir(tmp_path, {"source": "f1", "size": 28, "dataset": "mnist"})
    assert a.parent == tmp_path and a.name.startswith("mnist-") and len(a.name) == len("mnist-") + 20
    assert cache.entry_dir(tmp_path, {"size": 28}).name.startswith("data-")


def test_an_entrys_name_is_the_one_earlier_releases_gave_it():
    """A cache filled by an earlier release is found again (a changed name would decode every dataset again)."""
    key = {"version": 1, "dataset": "mnist", "source": "0123456789abcdef0123", "options": {"split": "b", "a": 1}}
    assert cache.entry_dir(Path("/c"), key) == Path("/c/mnist-8720e95996261ce9715d")


def test_a_key_holding_paths_is_stored_and_found(tmp_path):
    key = {"dataset": "imagefolder", "root": tmp_path / "data", "size": 8}
    arrays = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "y": np.array([0, 1])}
    assert cache.cached(tmp_path / "c", key, lambda: arrays) is arrays
    again = cache.cached(tmp_path / "c", key, lambda: pytest.fail("decoded again"))
    assert all(np.array_equal(again[k], arrays[k]) for k in arrays)
    manifest = (cache.entry_dir(tmp_path / "c", key) / "manifest.json").read_text()
    assert str(tmp_path / "data") in manifest


def test_an_array_of_python_objects_is_refused_by_name(tmp_path):
    with pytest.raises(TypeError, match=r"^cache array 'labels' has dtype object; only plain arrays are cached$"):
        cache.save_entry(tmp_path, {"dataset": "d"}, {"labels": np.array(["a", 1], dtype=object)})
