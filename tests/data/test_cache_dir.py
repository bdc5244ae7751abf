"""``data.cache_dir`` (issue 17): decoded datasets are cached in the user's cache directory, never next to the data.

The cache used to be written into ``<data.root>/.hetfl-cache`` (53 MB into a dataset folder that may be
shared or read-only). Now ``data.cache_dir`` names the folder (``""`` = ``$XDG_CACHE_HOME/hetfl/datasets``,
else ``~/.cache/hetfl/datasets``); entries stay keyed by a fingerprint of the source files; a read-only data
folder loads and is cached like any other; and the setting is no part of a run's identity. Tiny fake MNIST
files and one-round synthetic runs: well under a second each.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hetfl import config as config_mod
from hetfl.cli import main
from hetfl.data.datasets import cache as cache_mod
from hetfl.data.datasets import idx, load_dataset
from hetfl.engine import identity
from hetfl.engine.experiment import Experiment
from hetfl.params import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


def _idx_gz(path: Path, array: np.ndarray) -> None:
    """``array`` (uint8) as a gzipped IDX file: magic 0x00 0x00 0x08 ndim, big-endian sizes, the bytes."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in array.shape)
    path.write_bytes(gzip.compress(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()))


def fake_mnist(root: Path, seed: int = 0, n_train: int = 20, n_test: int = 10) -> dict[str, np.ndarray]:
    """The four MNIST files with random images and labels 0..9 (shifted by ``seed``) in ``root``."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    data = {"train_x": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
            "train_y": ((np.arange(n_train) + seed) % 10).astype(np.uint8),
            "test_x": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
            "test_y": ((np.arange(n_test) + seed) % 10).astype(np.uint8)}
    for prefix, split in (("train", "train"), ("t10k", "test")):
        _idx_gz(root / f"{prefix}-images-idx3-ubyte.gz", data[f"{split}_x"])
        _idx_gz(root / f"{prefix}-labels-idx1-ubyte.gz", data[f"{split}_y"])
    return data


def snapshot(folder: Path) -> list[tuple[str, int, int]]:
    """Every entry under ``folder``, hidden ones included: name, size, mtime."""
    return sorted((str(p.relative_to(folder)), p.lstat().st_size, p.lstat().st_mtime_ns) for p in folder.rglob("*"))


def entries(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in cache_dir.iterdir()) if cache_dir.is_dir() else []


def _no_decoding(*args, **kwargs):
    raise AssertionError("decoded again instead of reading the cache")


# ------------------------------------------------------------------ where the cache goes
def test_default_cache_is_the_user_cache_directory_not_the_data_folder(tmp_path, home, monkeypatch):
    data = fake_mnist(tmp_path / "data")
    before = snapshot(tmp_path / "data")
    ds = load_dataset("mnist", tmp_path / "data", download=False)
    assert ds.train.y.tolist() == data["train_y"].tolist()
    assert snapshot(tmp_path / "data") == before  # nothing written next to the data (no .hetfl-cache)
    default = home / ".cache" / "hetfl" / "datasets"
    assert cache_mod.default_cache_dir() == default and [e[:6] for e in entries(default)] == ["mnist-"]

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_mod.resolve_cache_dir("") == tmp_path / "xdg" / "hetfl" / "datasets"
    load_dataset("mnist", tmp_path / "data", download=False, cache_dir="")  # "" is the default, as in the config
    assert [e[:6] for e in entries(tmp_path / "xdg" / "hetfl" / "datasets")] == ["mnist-"]
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # not absolute: ignored, as the XDG rule says
    assert cache_mod.default_cache_dir() == default
    monkeypatch.setenv("HOME", str(tmp_path / "other"))
    assert cache_mod.resolve_cache_dir("~/c") == tmp_path / "other" / "c"


def test_read_only_data_folder_loads_then_loads_from_the_cache(tmp_path, home, monkeypatch):
    data = fake_mnist(tmp_path / "data")
    for path in tmp_path.joinpath("data").iterdir():
        path.chmod(0o444)
    (tmp_path / "data").chmod(0o555)  # as root (who may write anyway) the test still sees any write
    try:
        before = snapshot(tmp_path / "data")
        first = load_dataset("mnist", tmp_path / "data", download=False)  # the default cache folder
        assert len(entries(cache_mod.default_cache_dir())) == 1
        monkeypatch.setattr(idx, "read_idx", _no_decoding)
        second = load_dataset("mnist", tmp_path / "data", download=False)
        assert torch.equal(first.train.x, second.train.x) and second.test.y.tolist() == data["test_y"].tolist()
        assert snapshot(tmp_path / "data") == before
    finally:
        (tmp_path / "data").chmod(0o755)


def test_an_unwritable_cache_folder_costs_time_not_correctness(tmp_path, home):
    data = fake_mnist(tmp_path / "data")
    (tmp_path / "blocker").write_text("")  # a cache folder below a file can never be created
    ds = load_dataset("mnist", tmp_path / "data", download=False, cache_dir=tmp_path / "blocker" / "cache")
    assert ds.train.y.tolist() == data["train_y"].tolist()


def test_one_cache_folder_never_mixes_two_datasets(tmp_path, home):
    cache_dir = tmp_path / "cache"
    a, b = fake_mnist(tmp_path / "a", seed=0), fake_mnist(tmp_path / "b", seed=3)
    for _ in range(2):  # the second pass reads both from the cache
        assert load_dataset("mnist", tmp_path / "a", download=False, cache_dir=cache_dir).train.y.tolist() == \
            a["train_y"].tolist()
        assert load_dataset("mnist", tmp_path / "b", download=False, cache_dir=cache_dir).train.y.tolist() == \
            b["train_y"].tolist()
    load_dataset("fmnist", tmp_path / "a", download=False, cache_dir=cache_dir)  # same files, another dataset
    assert [e[:6] for e in entries(cache_dir)] == ["fmnist", "mnist-", "mnist-"]
    keys = [json.loads((cache_dir / e / "manifest.json").read_text())["key"] for e in entries(cache_dir)]
    assert len({k["source"] for k in keys if k["dataset"] == "mnist"}) == 2  # keyed by the source fingerprint


def test_a_cache_dir_that_is_a_file_is_refused_before_anything_is_written(tmp_path, home, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError) as err:
        load_dataset("synthetic", cache_dir=tmp_path / "file")
    assert err.value.key == "data.cache_dir" and err.value.value == str(tmp_path / "file")
    assert "is a file; set it to a folder" in str(err.value)
    assert main(["run", "--out", str(tmp_path / "run"), "--set", f"data.cache_dir={tmp_path / 'file'}",
                 "--set", "train.rounds=1", "--quiet"]) == 2
    assert "data.cache_dir" in capsys.readouterr().err and not (tmp_path / "run").exists()


# ------------------------------------------------------------------ the setting reaches every loader call
MNIST_SETS = ["data.dataset=mnist", "data.download=false", "data.partition=iid", "data.num_clients=2",
              "model.name=mlp", "train.rounds=1", "runtime.progress=false", "runtime.threads=1"]


def test_experiment_and_partition_use_data_cache_dir(tmp_path, home):
    fake_mnist(tmp_path / "data")
    sets = [*MNIST_SETS, f"data.root={tmp_path / 'data'}"]
    Experiment(config_mod.load(None, [*sets, f"data.cache_dir={tmp_path / 'run-cache'}"]))
    assert len(entries(tmp_path / "run-cache")) == 1
    args = [a for kv in (*sets, f"data.cache_dir={tmp_path / 'cli-cache'}") for a in ("--set", kv)]
    assert main(["partition", *args]) == 0
    assert len(entries(tmp_path / "cli-cache")) == 1
    assert not (home / ".cache").exists() and not any(p.name.startswith(".") for p in (tmp_path / "data").iterdir())


# ------------------------------------------------------------------ identity
TINY = ["data.partition=dirichlet", "data.num_clients=10", "train.rounds=1", "runtime.progress=false",
        "runtime.threads=1"]


def test_cache_dir_is_not_part_of_a_runs_identity(tmp_path, home, capsys):
    trees = [config_mod.to_tree(config_mod.load(None, [*TINY, f"data.cache_dir={tmp_path / c}"])) for c in "ab"]
    assert identity.setting_id(trees[0]) == identity.setting_id(trees[1])
    assert identity.run_id(trees[0]) == identity.run_id(trees[1]) and not identity.differing_keys(*trees)
    out = tmp_path / "cmp"

    def compare(cache: str) -> int:
        sets = [a for kv in (*TINY, f"data.cache_dir={tmp_path / cache}") for a in ("--set", kv)]
        return main(["compare", "--methods", "fedavg", "--seeds", "0", "--out", str(out), *sets, "--quiet"])

    assert compare("a") == 0
    summary = (out / "fedavg-seed0" / "summary.json").read_text()
    capsys.readouterr()
    assert compare("b") == 0  # another cache folder: the same run, reused
    assert "finished earlier, reusing" in capsys.readouterr().out
    assert (out / "fedavg-seed0" / "summary.json").read_text() == summary
