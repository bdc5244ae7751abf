"""Dataset loaders: tiny files in each official format, cache, download, errors, Synthetic, real data."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import sys
import tarfile
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from hetfl import files
from hetfl.data.base import DatasetError
from hetfl.data.datasets import (
    DATASETS,
    check_run_splits,
    cifar,
    dataset_options,
    decode,
    download,
    idx,
    load_dataset,
    stl10,
    synthetic,
    tinyimagenet,
)
from hetfl.data.datasets import cache as cache_mod
from hetfl.data.datasets.common import IMAGENET_NORM
from tests.helpers import needs_shared_data
from tests.helpers.datasets import (
    cifar_records,
    emnist_files,
    idx_bytes,
    make_cifar10,
    make_mnist,
    make_split_folder,
    make_stl10,
    make_tinyimagenet,
    solid,
    tar_folder,
    write_png,
)

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "datasets"
PIL = pytest.importorskip("PIL.Image")


# ------------------------------------------------------------------ writers (more in tests/helpers/datasets.py)
def make_domain_folder(root: Path, domains: tuple[str, ...], classes: tuple[str, ...], per_cell: int = 5) -> None:
    for d, domain in enumerate(domains):
        for c, cls in enumerate(classes):
            for i in range(per_cell):
                write_png(root / domain / cls / f"{i}.png", solid(40 * d + 10 * c + i))


def no_temp_files(folder: Path) -> bool:
    return not [p for p in folder.rglob("*") if p.name.endswith((".tmp", ".part"))]


# ---------------------------------------------------------------- registry
def test_registry_names_and_options():
    assert set(DATASETS) >= {"synthetic", "mnist", "fmnist", "emnist", "cifar10", "cifar100", "stl10", "cinic10",
                             "tinyimagenet", "imagefolder", "pacs", "officehome", "domainnet"}
    assert dataset_options("emnist") == {"split": "balanced"}
    assert dataset_options("synthetic")["num_devices"] == 30
    assert dataset_options("mnist") == {}


@pytest.mark.parametrize(
    ("name", "options", "expected"),
    [
        ("mnist", {"foo": 1}, "data.options.foo is not an option of mnist; it takes no options"),
        ("emnist", {"splits": "letters"}, "its options are split"),
        ("emnist", {"split": "bogus"}, "data.options.split = 'bogus' is not valid for emnist: expected one of"),
        ("cifar100", {"label_mode": "super"}, "'fine', 'coarse'"),
        ("stl10", {"image_size": "32"}, "data.options.image_size = '32'"),
        ("stl10", {"image_size": -1}, "an integer >= 0"),
        ("imagefolder", {"layout": "flat"}, "'auto', 'split', 'domain'"),
        ("imagefolder", {"channels": 2}, "one of 1, 3"),
        ("synthetic", {"alpha": -1.0}, "data.options.alpha = -1.0 is not valid for synthetic: expected a number >= 0"),
        ("synthetic", {"test_fraction": 1.0}, "< 1.0"),
        ("synthetic", {"iid": 1}, "true or false"),
        ("synthetic", {"num_devices": 2.5}, "an integer >= 1"),
    ],
)
def test_bad_options(tmp_path, name, options, expected):
    with pytest.raises(DatasetError) as err:
        load_dataset(name, tmp_path, download=False, cache_dir=tmp_path / "c", **options)
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("options", "split"), [({"test_fraction": 0.0}, "no test samples"),
                                                ({"test_fraction": 0.001, "max_samples": 20}, "no test samples"),
                                                ({"test_fraction": 0.99, "max_samples": 20}, "no training samples")])
def test_a_test_fraction_that_empties_a_split_is_refused_naming_it(options, split, tmp_path, capsys):
    """A split left empty by ``test_fraction`` (0, or rounded to nothing per device) is, for a run, a
    DatasetError naming the option, exit 2 with nothing written; it once ran, wrote ``global_acc: NaN`` into
    metrics.jsonl and summary.json (not JSON, and not a fraction in [0, 1]) and exited 0."""
    dataset = load_dataset("synthetic", seed=0, num_devices=4, **options)  # a loader may give it (its tests do)
    with pytest.raises(DatasetError) as err:
        check_run_splits("synthetic", options, dataset)
    assert f"data.options.test_fraction = {options['test_fraction']!r}" in str(err.value) and split in str(err.value)
    from hetfl.cli import main

    sets = [f"data.options={{num_devices = 4, {', '.join(f'{k} = {v}' for k, v in options.items())}}}"]
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), "--quiet", *[a for s in sets for a in ("--set", s)]]) == 2
    assert "data.options.test_fraction" in capsys.readouterr().err and not out.exists()
    # a plan of runs is refused before its first run starts (a good cell first, then this one)
    sweep = tmp_path / "sweep.toml"
    bad = ", ".join(f"{k} = {v}" for k, v in options.items())
    cells = f"{{num_devices = 4, max_samples = 20}}, {{num_devices = 4, {bad}}}"
    sweep.write_text(f"[grid]\n\"data.options\" = [{cells}]\n")
    args = ["compare", "--methods", "fedavg", "--seeds", "0", "--out", str(tmp_path / "cmp"), "--quiet",
            "--sweep", str(sweep), "--set", "train.rounds=1", "--set", "data.num_clients=4"]
    assert main(args) == 2
    assert "data.options.test_fraction" in capsys.readouterr().err
    assert not list((tmp_path / "cmp").rglob("metrics.jsonl")), "no run of the plan started"


def test_unknown_dataset_and_missing_root(tmp_path):
    with pytest.raises(DatasetError, match="data.dataset = 'imagenet' is unknown; allowed: synthetic, mnist"):
        load_dataset("imagenet")
    with pytest.raises(DatasetError, match="data.root = .*nowhere.* does not exist"):
        load_dataset("mnist", tmp_path / "nowhere")


# --------------------------------------------------------------------- IDX
@pytest.mark.parametrize("gz", [True, False])
def test_mnist_idx(tmp_path, gz):
    data = make_mnist(tmp_path / "mnist", gz=gz)
    ds = load_dataset("mnist", tmp_path / "mnist", download=False, cache_dir=tmp_path / "cache")
    assert ds.train.x.shape == (12, 1, 28, 28) and ds.test.x.shape == (6, 1, 28, 28)
    assert ds.train.x.dtype == torch.uint8 and ds.train.y.dtype == torch.int64
    assert np.array_equal(ds.train.x[:, 0].numpy(), data["train_x"])
    assert ds.train.y.tolist() == data["train_y"].tolist() and ds.test.y.tolist() == data["test_y"].tolist()
    assert ds.info.input_shape == (1, 28, 28) and ds.info.num_classes == 10
    assert ds.info.mean == (0.1307,) and ds.info.std == (0.3081,)
    assert ds.train.group is None


def test_fmnist_classes(tmp_path):
    make_mnist(tmp_path)
    ds = load_dataset("fmnist", tmp_path, download=False, cache_dir=tmp_path / "cache")
    assert ds.info.classes[0] == "T-shirt/top" and ds.info.classes[9] == "Ankle boot"
    assert ds.info.mean == (0.2860,)


def test_emnist_upright_and_letters_shift(tmp_path):
    upright = np.zeros((4, 28, 28), dtype=np.uint8)
    upright[:, 0, :] = 255  # a bar along the top row; stored transposed it is the left column
    emnist_files(tmp_path, "letters", upright, np.array([1, 2, 26, 5], dtype=np.uint8))
    ds = load_dataset("emnist", tmp_path, download=False, cache_dir=tmp_path / "c", split="letters")
    assert ds.train.x.shape == (4, 1, 28, 28)
    assert (ds.train.x[:, 0, 0, :] == 255).all() and (ds.train.x[:, 0, 1:, :] == 0).all()
    assert ds.train.y.tolist() == [0, 1, 25, 4]
    assert ds.info.num_classes == 26 and ds.info.classes[0] == "A"


def test_emnist_from_gzip_zip(tmp_path):
    upright = np.random.default_rng(0).integers(0, 256, (3, 28, 28), dtype=np.uint8)
    files = emnist_files(tmp_path / "src", "balanced", upright, np.array([0, 46, 10], dtype=np.uint8))
    root = tmp_path / "root"
    root.mkdir()
    with zipfile.ZipFile(root / "gzip.zip", "w") as archive:
        for name, data in files.items():
            archive.writestr(f"gzip/{name}", data)
    ds = load_dataset("emnist", root, download=False, cache_dir=tmp_path / "c")
    assert np.array_equal(ds.test.x[:, 0].numpy(), upright)
    assert ds.test.y.tolist() == [0, 46, 10] and ds.info.num_classes == 47
    assert sorted(p.name for p in (root / "gzip").iterdir()) == sorted(files) and no_temp_files(root)


def test_emnist_missing_names_files(tmp_path):
    with pytest.raises(DatasetError) as err:
        load_dataset("emnist", tmp_path, download=False, cache_dir=tmp_path / "c", split="digits")
    msg = str(err.value)
    assert "gzip.zip" in msg and "emnist-digits-train-images-idx3-ubyte.gz" in msg and str(tmp_path) in msg


def test_idx_bad_magic_names_file(tmp_path):
    make_mnist(tmp_path)
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(b"\x00\x00\x08\x03" + b"\x00" * 20))
    with pytest.raises(DatasetError, match=r"train-labels-idx1-ubyte\.gz: bad magic number 00000803"):
        load_dataset("mnist", tmp_path, download=False, cache_dir=tmp_path / "c")


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [  # gzip's header holds a time stamp unless mtime is given; the ids name the case, not the bytes
        pytest.param("t10k-images-idx3-ubyte.gz",
                     gzip.compress(idx_bytes(np.zeros((6, 28, 28), np.uint8)), mtime=0)[:-9], "corrupt gzip",
                     id="images-corrupt-gzip"),
        pytest.param("t10k-images-idx3-ubyte.gz",
                     gzip.compress(idx_bytes(np.zeros((6, 28, 28), np.uint8))[:-5], mtime=0), "truncated",
                     id="images-truncated"),
        pytest.param("t10k-images-idx3-ubyte.gz",
                     gzip.compress(idx_bytes(np.zeros((6, 14, 14), np.uint8)), mtime=0), "expected 28x28",
                     id="images-14x14"),
        pytest.param("t10k-labels-idx1-ubyte.gz",
                     gzip.compress(idx_bytes(np.full(6, 10, np.uint8)), mtime=0), "expected 0..9",
                     id="labels-out-of-range"),
        pytest.param("t10k-labels-idx1-ubyte.gz",
                     gzip.compress(idx_bytes(np.zeros(5, np.uint8)), mtime=0), "differ in length",
                     id="labels-too-few"),
    ],
)
def test_idx_corrupt_files(tmp_path, name, content, expected):
    make_mnist(tmp_path)
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DatasetError, match=expected) as err:
        load_dataset("mnist", tmp_path, download=False, cache_dir=tmp_path / "c")
    assert "t10k-" in str(err.value)


def test_mnist_missing_files_message(tmp_path):
    make_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DatasetError) as err:
        load_dataset("mnist", tmp_path, download=False, cache_dir=tmp_path / "c")
    msg = str(err.value)
    assert f"t10k-labels-idx1-ubyte.gz not found in {tmp_path}" in msg
    assert "data.download = false" in msg and "data.root" in msg and "train-images" not in msg


# ---------------------------------------------------------------- download
def _remotes(tmp_path: Path, data: dict[str, bytes], bad: set[str] = frozenset(), mirrors: int = 1):
    src = tmp_path / "server"
    src.mkdir(exist_ok=True)
    out = []
    for name, content in data.items():
        (src / name).write_bytes(content)
        md5 = "0" * 32 if name in bad else hashlib.md5(content).hexdigest()
        urls = [(src / f"missing{i}" / name).as_uri() for i in range(mirrors - 1)] + [(src / name).as_uri()]
        out.append(download.Remote(name, tuple(urls), md5=md5))
    return tuple(out)


def _mnist_payload(tmp_path: Path) -> tuple[dict, dict[str, bytes]]:
    data = make_mnist(tmp_path / "made")
    return data, {p.name: p.read_bytes() for p in sorted((tmp_path / "made").iterdir())}


def test_download_with_checksum(tmp_path, monkeypatch, home):
    data, payload = _mnist_payload(tmp_path)
    monkeypatch.setattr(idx, "MNIST", _remotes(tmp_path, payload, mirrors=2))  # first mirror fails, second works
    ds = load_dataset("mnist", download=True)  # root None -> ~/.cache/hetfl/data/mnist
    root = home / ".cache" / "hetfl" / "data" / "mnist"
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == sorted(payload)
    assert no_temp_files(root)
    assert ds.train.y.tolist() == data["train_y"].tolist()
    assert not (root / ".hetfl-cache").exists()  # default cache: the user's (data.cache_dir), not next to the data
    assert (home / ".cache" / "hetfl" / "datasets").is_dir()


def test_download_checksum_mismatch(tmp_path, monkeypatch):
    _, payload = _mnist_payload(tmp_path)
    monkeypatch.setattr(idx, "MNIST", _remotes(tmp_path, payload, bad={"t10k-images-idx3-ubyte.gz"}))
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(DatasetError) as err:
        load_dataset("mnist", root, download=True, cache_dir=tmp_path / "c")
    msg = str(err.value)
    assert "checksum mismatch" in msg and "t10k-images-idx3-ubyte.gz" in msg and "discarded" in msg
    assert not (root / "t10k-images-idx3-ubyte.gz").exists() and no_temp_files(root)


def test_fetch_sha256_and_network_failure(tmp_path):
    (tmp_path / "f.bin").write_bytes(b"hello")
    good = download.Remote("f.bin", ((tmp_path / "f.bin").as_uri(),), sha256=hashlib.sha256(b"hello").hexdigest())
    assert download.fetch(good, tmp_path / "dl").read_bytes() == b"hello"
    offline = download.Remote("g.bin", ("http://127.0.0.1:9/g.bin",), md5="0" * 32)  # port 9: refused
    with pytest.raises(DatasetError) as err:
        download.ensure(tmp_path / "dl", [offline], download=True, dataset="demo", alternative="(or g/)")
    msg = str(err.value)
    assert msg.startswith(f"demo: g.bin not found in {tmp_path / 'dl'} and could not download g.bin (")
    assert "Put the official file(s) (or g/) into" in msg and "data.root" in msg and no_temp_files(tmp_path)


# ------------------------------------------------------------------- CIFAR


def test_cifar10_binary_archive_and_extracted(tmp_path):
    train, test = make_cifar10(tmp_path / "x" / "cifar-10-batches-bin")
    root = tmp_path / "root"
    root.mkdir()
    tar_folder(tmp_path / "x" / "cifar-10-batches-bin", root / "cifar-10-binary.tar.gz", "cifar-10-batches-bin")
    for source in (root, root / "cifar-10-binary.tar.gz", tmp_path / "x", tmp_path / "x" / "cifar-10-batches-bin"):
        ds = load_dataset("cifar10", source, download=False, cache_dir=tmp_path / "c")
        assert ds.train.x.shape == (10, 3, 32, 32) and ds.test.x.shape == (3, 3, 32, 32)
        assert np.array_equal(ds.train.x.numpy(), train) and np.array_equal(ds.test.x.numpy(), test)
        assert ds.train.y.tolist() == [1, 9, 2, 9, 3, 9, 4, 9, 5, 9] and ds.test.y.tolist() == [3, 0, 7]
        assert ds.info.classes[3] == "cat" and ds.info.mean == (0.4914, 0.4822, 0.4465)


def test_cifar10_corrupt_batch(tmp_path):
    make_cifar10(tmp_path)
    (tmp_path / "test_batch.bin").write_bytes(b"\x00" * 3000)
    with pytest.raises(DatasetError, match="not a whole number of 3073-byte CIFAR records"):
        load_dataset("cifar10", tmp_path, download=False, cache_dir=tmp_path / "c")


def test_cifar10_missing_files_message(tmp_path):
    with pytest.raises(DatasetError) as err:
        load_dataset("cifar10", tmp_path, download=False, cache_dir=tmp_path / "c")
    msg = str(err.value)
    assert f"cifar-10-binary.tar.gz not found in {tmp_path}" in msg and "cifar-10-batches-bin" in msg


@pytest.mark.parametrize("label_mode", ["fine", "coarse"])
def test_cifar100_label_modes(tmp_path, label_mode):
    folder = tmp_path / "cifar-100-binary"
    folder.mkdir()
    data, train = cifar_records([(19, 99), (0, 5)], seed=1)
    (folder / "train.bin").write_bytes(data)
    data, _ = cifar_records([(4, 30)], seed=2)
    (folder / "test.bin").write_bytes(data)
    with tarfile.open(tmp_path / "cifar-100-binary.tar.gz", "w:gz") as tar:
        tar.add(folder, arcname="cifar-100-binary")
    ds = load_dataset("cifar100", tmp_path / "cifar-100-binary.tar.gz", download=False, cache_dir=tmp_path / "c",
                      label_mode=label_mode)
    assert np.array_equal(ds.train.x.numpy(), train)
    if label_mode == "fine":
        assert ds.train.y.tolist() == [99, 5] and ds.test.y.tolist() == [30] and ds.info.num_classes == 100
        assert ds.info.classes[99] == "worm"
    else:
        assert ds.train.y.tolist() == [19, 0] and ds.test.y.tolist() == [4] and ds.info.num_classes == 20
        assert ds.info.classes[19] == "vehicles_2"


def test_cifar10_image_folder_uses_cifar_class_order(tmp_path):
    tree = tmp_path / "cifar10-jpeg"
    make_split_folder(tree, {"truck": 200, "airplane": 10, "cat": 100}, size=(32, 32))
    (tmp_path / "holder").mkdir()
    tar_folder(tree, tmp_path / "holder" / "cifar10-jpeg.tar.gz", "cifar10-jpeg")
    for source in (tree, tmp_path / "holder" / "cifar10-jpeg.tar.gz", tmp_path / "holder"):
        ds = load_dataset("cifar10", source, download=False, cache_dir=tmp_path / "c")
        assert ds.train.y.tolist() == [0, 0, 0, 3, 3, 3, 9, 9, 9] and ds.test.y.tolist() == [0, 0, 3, 3, 9, 9]
        assert ds.train.x.shape == (9, 3, 32, 32) and ds.train.x[3, :, 0, 0].tolist() == [100] * 3
        assert ds.info.classes == cifar.CIFAR10_CLASSES and "image folder" in ds.notes[0]


# ------------------------------------------------------------------ STL-10


def test_stl10_column_major_labels_and_resize(tmp_path):
    train, test = make_stl10(tmp_path / "stl10_binary")
    ds = load_dataset("stl10", tmp_path, download=False, cache_dir=tmp_path / "c")
    assert np.array_equal(ds.train.x.numpy(), train) and np.array_equal(ds.test.x.numpy(), test)
    assert ds.train.y.tolist() == [0, 1, 2] and ds.info.input_shape == (3, 96, 96)
    small = load_dataset("stl10", tmp_path, download=False, cache_dir=tmp_path / "c", image_size=32)
    assert small.train.x.shape == (3, 3, 32, 32) and small.info.input_shape == (3, 32, 32)
    expected = train[:, :, :3, :3].reshape(3, 3, -1).astype(float).mean(-1)  # area = mean of 3x3 blocks
    assert np.abs(small.train.x[:, :, 0, 0].numpy() - expected).max() <= 0.5 + 1e-6


def test_stl10_from_archive_and_bad_size(tmp_path):
    train, _ = make_stl10(tmp_path / "src" / "stl10_binary")
    tar_folder(tmp_path / "src" / "stl10_binary", tmp_path / "stl10_binary.tar.gz", "stl10_binary")
    ds = load_dataset("stl10", tmp_path, download=False, cache_dir=tmp_path / "c")
    assert np.array_equal(ds.train.x.numpy(), train)
    (tmp_path / "src" / "stl10_binary" / "test_X.bin").write_bytes(b"\x00" * 100)
    with pytest.raises(DatasetError, match="test_X.bin holds 100 bytes"):
        load_dataset("stl10", tmp_path / "src", download=False, cache_dir=tmp_path / "c")


# ------------------------------------------------------------ image folders
def test_imagefolder_split_layout(tmp_path):
    make_split_folder(tmp_path / "data", {"zebra": 100, "ant": 10}, per_split=(3, 2))
    write_png(tmp_path / "data" / "train" / "zebra" / "9999.png", solid(7, (16, 12)))  # other size: resized
    ds = load_dataset("imagefolder", tmp_path / "data", download=False, cache_dir=tmp_path / "c")
    assert ds.info.classes == ("ant", "zebra") and ds.info.input_shape == (3, 8, 8)
    assert ds.train.y.tolist() == [0, 0, 0, 1, 1, 1, 1] and ds.test.y.tolist() == [0, 0, 1, 1]
    assert ds.train.x[6].unique().tolist() == [7] and ds.info.groups == () and ds.train.group is None
    assert ds.info.mean is not None and len(ds.info.mean) == 3
    gray = load_dataset("imagefolder", tmp_path / "data", download=False, cache_dir=tmp_path / "c",
                        image_size=4, channels=1)
    assert gray.train.x.shape == (7, 1, 4, 4) and gray.test.x[0].unique().tolist() == [10]
    with pytest.raises(DatasetError, match="split layout"):
        load_dataset("imagefolder", tmp_path / "data", cache_dir=tmp_path / "c", domains=["a"])


def test_imagefolder_domain_layout(tmp_path):
    make_domain_folder(tmp_path / "pacs", ("photo", "art_painting", "sketch"), ("dog", "cat"), per_cell=5)
    kwargs = {"download": False, "cache_dir": tmp_path / "c"}
    ds = load_dataset("imagefolder", tmp_path / "pacs", **kwargs)
    assert ds.info.groups == ("art_painting", "photo", "sketch") and ds.info.classes == ("cat", "dog")
    assert len(ds.train) == 24 and len(ds.test) == 6  # round(0.2 * 5) = 1 per (domain, class)
    for split in (ds.train, ds.test):
        for g, domain in enumerate(ds.info.groups):
            d = ("photo", "art_painting", "sketch").index(domain)
            values = split.x[split.group == g][:, 0, 0, 0]
            assert ((values >= 40 * d) & (values < 40 * d + 20)).all()
    again = load_dataset("imagefolder", tmp_path / "pacs", **kwargs)
    assert torch.equal(again.test.x, ds.test.x)
    other = load_dataset("imagefolder", tmp_path / "pacs", seed=1, **kwargs)
    assert not torch.equal(other.test.x, ds.test.x)
    two = load_dataset("imagefolder", tmp_path / "pacs", domains=["sketch", "photo"], test_fraction=0.4, **kwargs)
    assert two.info.groups == ("sketch", "photo") and len(two.test) == 8 and set(two.test.group.tolist()) == {0, 1}
    with pytest.raises(DatasetError, match=r"\['clipart'\] not in .*available: \['art_painting', 'photo', 'sketch'\]"):
        load_dataset("imagefolder", tmp_path / "pacs", domains=["clipart"], **kwargs)


def test_domain_alias_from_archive(tmp_path):
    make_domain_folder(tmp_path / "src", ("art_painting", "cartoon"), ("dog",), per_cell=4)
    with zipfile.ZipFile(tmp_path / "PACS.zip", "w") as archive:
        for path in sorted((tmp_path / "src").rglob("*.png")):
            archive.write(path, f"PACS/{path.relative_to(tmp_path / 'src')}")
    ds = load_dataset("pacs", tmp_path / "PACS.zip", download=False, cache_dir=tmp_path / "c", image_size=6)
    assert ds.info.name == "pacs" and ds.info.groups == ("art_painting", "cartoon")
    assert ds.info.input_shape == (3, 6, 6) and (ds.info.mean, ds.info.std) == IMAGENET_NORM
    assert "expected domains" in ds.notes[-1]  # only 2 of PACS's 4 domains, 1 of 7 classes


def test_imagefolder_errors(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no image tree in"):
        load_dataset("imagefolder", tmp_path / "empty", cache_dir=tmp_path / "c")
    write_png(tmp_path / "bad" / "train" / "a" / "0.png", solid(1))
    (tmp_path / "bad" / "test" / "a").mkdir(parents=True)
    (tmp_path / "bad" / "test" / "a" / "0.png").write_bytes(b"not a png")
    with pytest.raises(DatasetError, match=r"test/a/0\.png: cannot decode this image"):
        load_dataset("imagefolder", tmp_path / "bad", cache_dir=tmp_path / "c")
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(DatasetError, match=r"pip install pillow \(or pip install 'hetfl\[images\]'\)"):
        load_dataset("imagefolder", tmp_path / "bad", cache_dir=tmp_path / "c2")


def test_cinic10_skips_valid(tmp_path):
    make_split_folder(tmp_path / "cinic", {"bird": 20, "ship": 80}, per_split=(2, 1), size=(32, 32))
    make_split_folder(tmp_path / "cinic", {"frog": 60}, per_split=(0, 3), size=(32, 32), test_name="valid")
    ds = load_dataset("cinic10", tmp_path / "cinic", download=False, cache_dir=tmp_path / "c")
    assert ds.train.y.tolist() == [2, 2, 8, 8] and ds.test.y.tolist() == [2, 8]
    assert ds.info.classes == cifar.CIFAR10_CLASSES and ds.info.mean[0] == pytest.approx(0.4789)


@pytest.mark.parametrize("packed", [False, True])
def test_tinyimagenet_layout(tmp_path, packed):
    make_tinyimagenet(tmp_path / "src" / "tiny-imagenet-200")
    root = tmp_path / "src"
    if packed:
        root = tmp_path / "zipped"
        root.mkdir()
        with zipfile.ZipFile(root / "tiny-imagenet-200.zip", "w") as archive:
            for path in sorted((tmp_path / "src").rglob("*")):
                archive.write(path, str(path.relative_to(tmp_path / "src")))
    ds = load_dataset("tinyimagenet", root, download=False, cache_dir=tmp_path / "c", image_size=16)
    assert ds.info.classes == ("n02", "n01", "n03") and ds.info.input_shape == (3, 16, 16)
    assert ds.train.y.tolist() == [1, 1, 0, 0, 2, 2]  # sorted paths: n01, n02, n03
    assert ds.train.x[:, 0, 0, 0].tolist() == [10, 11, 0, 1, 20, 21]
    assert ds.test.y.tolist() == [2, 0, 2, 1] and ds.test.x[:, 0, 0, 0].tolist() == [100, 101, 102, 103]


def test_tinyimagenet_missing(tmp_path):
    with pytest.raises(DatasetError) as err:
        load_dataset("tinyimagenet", tmp_path, download=False, cache_dir=tmp_path / "c")
    assert "tiny-imagenet-200.zip not found in" in str(err.value) and "tiny-imagenet-200/ folder" in str(err.value)
    assert tinyimagenet.TINYIMAGENET.md5 == "90528d7ca1a48142e341f4ef8d21d0de"


# ------------------------------------------------------------------- cache
def _fail(*args, **kwargs):
    raise AssertionError("decoded again instead of reading the cache")


def test_cache_reuse_without_decoding(tmp_path, monkeypatch, home):
    make_mnist(tmp_path / "mnist")
    make_split_folder(tmp_path / "folder", {"a": 10, "b": 20})
    first = load_dataset("mnist", tmp_path / "mnist", download=False)  # default cache: ~/.cache/hetfl/datasets
    folder_first = load_dataset("imagefolder", tmp_path / "folder", download=False)
    assert len(list((home / ".cache" / "hetfl" / "datasets").iterdir())) == 2
    monkeypatch.setattr(idx, "read_idx", _fail)
    monkeypatch.setattr(decode, "decode", _fail)
    second = load_dataset("mnist", tmp_path / "mnist", download=False)
    folder_second = load_dataset("imagefolder", tmp_path / "folder", download=False)
    assert torch.equal(first.train.x, second.train.x) and torch.equal(folder_first.train.x, folder_second.train.x)
    assert folder_second.info == folder_first.info
    write_png(tmp_path / "folder" / "train" / "a" / "0000.png", solid(99))  # changed source: decoded again
    with pytest.raises(AssertionError, match="decoded again"):
        load_dataset("imagefolder", tmp_path / "folder", download=False)


def test_cache_files_are_plain_npy(tmp_path):
    make_split_folder(tmp_path / "data", {"a": 1})
    load_dataset("imagefolder", tmp_path / "data", download=False, cache_dir=tmp_path / "c")
    (entry,) = (tmp_path / "c").iterdir()
    names = sorted(p.name for p in entry.iterdir())
    assert names == ["classes.npy", "manifest.json", "test_x.npy", "test_y.npy", "train_x.npy", "train_y.npy"]
    for path in entry.glob("*.npy"):
        np.load(path, allow_pickle=False)
    assert json.loads((entry / "manifest.json").read_text())["key"]["dataset"] == "imagefolder"


def test_cache_write_is_atomic(tmp_path, monkeypatch):
    key = {"dataset": "demo", "n": 1}
    arrays = {"a": np.arange(3), "b": np.ones((2, 2), np.uint8)}
    real_save = np.save
    calls = []

    def flaky_save(fh, array, allow_pickle=False):
        calls.append(1)
        if len(calls) == 2:
            fh.write(b"partial")
            raise OSError("disk full")
        real_save(fh, array, allow_pickle=allow_pickle)

    monkeypatch.setattr(np, "save", flaky_save)
    assert cache_mod.cached(tmp_path, key, lambda: arrays)["b"].shape == (2, 2)  # a failed write is not fatal
    entry = cache_mod.entry_dir(tmp_path, key)
    assert sorted(p.name for p in entry.iterdir()) == ["a.npy"] and cache_mod.load_entry(tmp_path, key) is None
    monkeypatch.setattr(np, "save", real_save)
    cache_mod.cached(tmp_path, key, lambda: arrays)
    loaded = cache_mod.load_entry(tmp_path, key)
    assert loaded is not None and np.array_equal(loaded["a"], arrays["a"]) and no_temp_files(tmp_path)
    (entry / "b.npy").write_bytes(b"garbage")  # a damaged entry is rebuilt, not trusted
    assert cache_mod.load_entry(tmp_path, key) is None


def test_atomic_write_keeps_old_file_on_error(tmp_path):
    target = tmp_path / "f.txt"
    target.write_text("old")

    def broken(fh):
        fh.write(b"new but incomplete")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        files.atomic_write(target, broken)
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]


def test_default_cache_dir(tmp_path, home):  # more in tests/data/test_cache_dir.py
    assert cache_mod.default_cache_dir() == home / ".cache" / "hetfl" / "datasets"


def test_fingerprint_ignores_cache_folder(tmp_path):
    make_split_folder(tmp_path, {"a": 1})
    before = cache_mod.fingerprint([tmp_path])
    (tmp_path / ".hetfl-cache" / "x").mkdir(parents=True)
    assert cache_mod.fingerprint([tmp_path]) == before
    os.utime(tmp_path / "train" / "a" / "0000.png", ns=(1, 1))
    assert cache_mod.fingerprint([tmp_path]) != before


# --------------------------------------------------------------- synthetic
def test_synthetic_shapes_and_determinism():
    a = load_dataset("synthetic", seed=3)
    b = load_dataset("synthetic", seed=3)
    c = load_dataset("synthetic", seed=4)
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.test.y, b.test.y)
    assert not torch.equal(a.train.x[:50], c.train.x[:50])
    assert a.train.x.dtype == torch.float32 and a.train.y.dtype == torch.int64 and a.train.x.shape[1] == 60
    assert a.info.input_shape == (60,) and a.info.num_classes == 10 and a.info.mean is None
    assert a.info.groups == tuple(f"device{k}" for k in range(30))
    sizes = torch.bincount(a.train.group, minlength=30) + torch.bincount(a.test.group, minlength=30)
    assert sizes.min() >= 50 and sizes.max() <= 5000
    test_sizes = torch.bincount(a.test.group, minlength=30)
    assert torch.equal(test_sizes, torch.round(0.2 * sizes.double()).long())
    small = load_dataset("synthetic", num_devices=5, dim=8, num_classes=3)
    assert small.train.x.shape[1] == 8 and set(small.train.group.tolist()) == set(range(5))
    # device k's data does not depend on how many devices there are
    x5, _, g5 = synthetic.generate(1.0, 1.0, 5, 60, 10, False, seed=3)
    x30, _, g30 = synthetic.generate(1.0, 1.0, 30, 60, 10, False, seed=3)
    assert np.array_equal(x5[g5 == 4], x30[g30 == 4])


def _label_skew(x_y_g: tuple[np.ndarray, np.ndarray, np.ndarray], num_classes: int = 10) -> float:
    """Mean total-variation distance of the devices' label distributions from the pooled one."""
    _, y, g = x_y_g
    pooled = np.bincount(y, minlength=num_classes) / len(y)
    dists = [np.bincount(y[g == k], minlength=num_classes) / (g == k).sum() for k in np.unique(g)]
    return float(np.mean([0.5 * np.abs(d - pooled).sum() for d in dists]))


def test_synthetic_heterogeneity_and_statistics():
    non_iid = synthetic.generate(1.0, 1.0, 30, 60, 10, False, seed=0)
    iid = synthetic.generate(1.0, 1.0, 30, 60, 10, True, seed=0)
    assert _label_skew(non_iid) > 0.4 > 0.15 > _label_skew(iid)
    x, _, _ = synthetic.generate(0.0, 0.0, 40, 60, 10, True, seed=1, max_samples=2000)
    var = x.astype(np.float64).var(axis=0)
    assert np.allclose(var / synthetic.sigma_diagonal(60), 1.0, atol=0.1)  # Sigma_jj = j^-1.2
    assert np.abs(x.mean(axis=0)).max() < 0.1  # IID inputs are centred
    # beta is a variance: device means v_k ~ N(B_k, 1) with B_k ~ N(0, beta)
    for beta, low, high in ((0.0, 0.0, 0.1), (4.0, 2.0, 8.0)):
        x, _, g = synthetic.generate(1.0, beta, 200, 60, 10, False, seed=2, max_samples=60)
        shift = np.array([x[g == k].mean() for k in range(200)])
        assert low <= shift.var() <= high, (beta, shift.var())


# ---------------------------------------------------------------- real data
@needs_shared_data
def test_real_mnist(tmp_path):
    ds = load_dataset("mnist", SHARED / "mnist", download=False, cache_dir=tmp_path)
    assert len(ds.train) == 60000 and len(ds.test) == 10000
    assert ds.train.y[:8].tolist() == [5, 0, 4, 1, 9, 2, 1, 3]
    assert ds.test.y[:8].tolist() == [7, 2, 1, 0, 4, 1, 4, 9]
    assert ds.train.x.shape == (60000, 1, 28, 28) and 0.12 < ds.train.x.float().mean().item() / 255 < 0.14


def _first_of_each_folder(archive: Path, out: Path, keep: int) -> Counter:
    """Copy the first ``keep`` images of every ``{split}/{class}/`` folder of ``archive`` into the archive
    ``out`` (same layout); return how many images every folder of ``archive`` holds."""
    counts: Counter = Counter()
    with tarfile.open(archive, "r|gz") as source, tarfile.open(out, "w:gz") as copy:
        for member in source:
            if not member.isfile():
                continue
            folder = tuple(member.name.split("/")[-3:-1])
            counts[folder] += 1
            if counts[folder] <= keep:
                copy.addfile(member, source.extractfile(member))
    return counts


@needs_shared_data
def test_real_cifar10_jpeg(tmp_path, monkeypatch):
    """The JPEG copy of CIFAR-10: its archive holds 5,000 train and 1,000 test images of each class, and the
    loader reads its real JPEGs (a copy cut to the first 20 images of each folder, so that the test decodes
    400 images, not 60,000 in 15 s): labels from the class folders in CIFAR-10's order, each image the pixels
    that Pillow decodes from its file, and a second load from the decoded cache."""
    from PIL import Image

    tarball = SHARED / "cifar10-jpeg.tar.gz"
    cut = tmp_path / "cifar10-jpeg.tar.gz"
    counts = _first_of_each_folder(tarball, cut, keep=20)
    assert counts == {**{("train", c): 5000 for c in cifar.CIFAR10_CLASSES},
                      **{("test", c): 1000 for c in cifar.CIFAR10_CLASSES}}
    ds = load_dataset("cifar10", cut, download=False, cache_dir=tmp_path / "cache")
    assert len(ds.train) == len(ds.test) == 200 and ds.train.x.shape[1:] == (3, 32, 32)
    assert torch.bincount(ds.train.y).tolist() == [20] * 10 and torch.bincount(ds.test.y).tolist() == [20] * 10
    with tarfile.open(cut) as tar:
        for label, name in enumerate(cifar.CIFAR10_CLASSES):
            member = next(m for m in tar if m.name.endswith(f"/train/{name}/0000.jpg"))
            pixels = np.asarray(Image.open(tar.extractfile(member)).convert("RGB")).transpose(2, 0, 1)
            assert torch.equal(ds.train.x[ds.train.y == label][0], torch.from_numpy(pixels.copy())), name
    monkeypatch.setattr(decode, "decode", _fail)  # the second load reads the decoded cache: no JPEG decoded
    again = load_dataset("cifar10", cut, download=False, cache_dir=tmp_path / "cache")
    assert torch.equal(again.test.x, ds.test.x)


def test_download_constants_are_official():
    assert [r.md5 for r in idx.MNIST] == list(idx.MNIST_MD5) and idx.MNIST[0].urls[0].startswith("https://ossci")
    assert cifar.CIFAR10.md5 == "c32a1d4ab5d03f1284b67883e8d87530"
    assert cifar.CIFAR100.md5 == "03b5dce01913d631647c71ecec9e9cb8"
    assert stl10.STL10.md5 == "91f7769df0f17e558f3565bffb0c7dfb"
    assert len(cifar.CIFAR100_FINE) == 100 and len(cifar.CIFAR100_COARSE) == 20
