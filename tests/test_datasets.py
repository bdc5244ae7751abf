"""Dataset loaders on tiny files written in each official format, and on the real copies."""

from __future__ import annotations

import gzip
import hashlib
import io
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from hetfl.data.base import DatasetError
from hetfl.data.datasets import idx as idx_mod
from hetfl.data.datasets import imagefolder, load_dataset
from hetfl.data.datasets.download import Remote, ensure, fetch

SHARED = Path(__file__).resolve().parents[2] / "shared" / "datasets"


def idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", s) for s in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_mnist(root: Path, n_train: int = 12, n_test: int = 6, prefix: str = "", classes: int = 10) -> dict:
    rng = np.random.default_rng(0)
    data = {}
    for part, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, classes, n, dtype=np.uint8)
        (root / f"{prefix}{part}-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_bytes(images)))
        (root / f"{prefix}{part}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(labels)))
        data[part] = (images, labels)
    return data


def test_mnist_idx_roundtrip_and_cache(tmp_path, monkeypatch):
    data = write_mnist(tmp_path)
    ds = load_dataset("mnist", tmp_path, download=False)
    assert ds.train.x.shape == (12, 1, 28, 28) and ds.train.x.dtype == torch.uint8
    assert np.array_equal(ds.train.x[:, 0].numpy(), data["train"][0])
    assert np.array_equal(ds.test.y.numpy(), data["t10k"][1].astype(np.int64)) and ds.test.y.dtype == torch.int64
    assert ds.info.num_classes == 10 and ds.info.mean == (0.1307,)
    monkeypatch.setattr(idx_mod, "read_idx", lambda *a: (_ for _ in ()).throw(AssertionError("decoded twice")))
    again = load_dataset("mnist", tmp_path, download=False)  # from the .npy cache
    assert torch.equal(again.train.x, ds.train.x)
    cache = tmp_path / ".hetfl-cache"
    assert list(cache.rglob("*.npy")) and not list(cache.rglob("*.tmp"))


def test_uncompressed_idx_and_fashion_mnist(tmp_path):
    write_mnist(tmp_path)
    for p in tmp_path.glob("*.gz"):
        p.with_suffix("").write_bytes(gzip.decompress(p.read_bytes()))
        p.unlink()
    ds = load_dataset("fmnist", tmp_path, download=False)
    assert ds.info.classes[0] == "T-shirt/top" and len(ds.train) == 12


def test_missing_files_say_which_and_where(tmp_path):
    with pytest.raises(DatasetError) as err:
        load_dataset("mnist", tmp_path, download=False)
    message = str(err.value)
    assert "train-images-idx3-ubyte.gz" in message and str(tmp_path) in message and "data.root" in message


def test_corrupt_idx_is_named(tmp_path):
    write_mnist(tmp_path)
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(b"\x00\x00\x09\x01garbage"))
    with pytest.raises(DatasetError, match=r"train-labels-idx1-ubyte.gz.*magic"):
        load_dataset("mnist", tmp_path, download=False)


def test_labels_out_of_range_are_rejected(tmp_path):
    write_mnist(tmp_path, classes=12)
    with pytest.raises(DatasetError, match="labels"):
        load_dataset("mnist", tmp_path, download=False)


def test_emnist_is_transposed_upright_and_letters_shifted(tmp_path):
    rng = np.random.default_rng(1)
    stored = {}
    for part, n in (("train", 5), ("test", 3)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(1, 27, n, dtype=np.uint8)
        (tmp_path / f"emnist-letters-{part}-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_bytes(images)))
        (tmp_path / f"emnist-letters-{part}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(labels)))
        stored[part] = (images, labels)
    ds = load_dataset("emnist", tmp_path, download=False, split="letters")
    assert np.array_equal(ds.train.x[:, 0].numpy(), stored["train"][0].transpose(0, 2, 1))
    assert np.array_equal(ds.train.y.numpy(), stored["train"][1] - 1)
    assert ds.info.classes[0] == "A" and ds.info.num_classes == 26
    with pytest.raises(DatasetError, match="data.options.split"):
        load_dataset("emnist", tmp_path, download=False, split="cursive")


def cifar_records(n: int, label_bytes: int, rng: np.random.Generator) -> tuple[bytes, np.ndarray, np.ndarray]:
    images = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
    labels = rng.integers(0, 10, (n, label_bytes), dtype=np.uint8)
    rows = np.concatenate([labels, images.reshape(n, -1)], axis=1)
    return rows.tobytes(), images, labels


def add_to_tar(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def test_cifar10_binary_archive(tmp_path):
    rng = np.random.default_rng(2)
    expected = {}
    with tarfile.open(tmp_path / "cifar-10-binary.tar.gz", "w:gz") as tar:
        for i in range(1, 6):
            data, images, labels = cifar_records(4, 1, rng)
            add_to_tar(tar, f"cifar-10-batches-bin/data_batch_{i}.bin", data)
            expected.setdefault("train", []).append((images, labels))
        data, images, labels = cifar_records(3, 1, rng)
        add_to_tar(tar, "cifar-10-batches-bin/test_batch.bin", data)
        expected["test"] = [(images, labels)]
    ds = load_dataset("cifar10", tmp_path, download=False)
    assert ds.train.x.shape == (20, 3, 32, 32) and len(ds.test) == 3
    assert np.array_equal(ds.train.x[:4].numpy(), expected["train"][0][0])
    assert np.array_equal(ds.test.y.numpy(), expected["test"][0][1][:, 0])
    assert ds.info.classes[0] == "airplane"


def test_cifar100_fine_and_coarse(tmp_path):
    rng = np.random.default_rng(3)
    folder = tmp_path / "cifar-100-binary"
    folder.mkdir()
    data, _, labels = cifar_records(6, 2, rng)
    (folder / "train.bin").write_bytes(data)
    (folder / "test.bin").write_bytes(data)
    fine = load_dataset("cifar100", tmp_path, download=False)
    coarse = load_dataset("cifar100", tmp_path, download=False, label_mode="coarse")
    assert np.array_equal(fine.train.y.numpy(), labels[:, 1]) and np.array_equal(coarse.train.y.numpy(), labels[:, 0])
    assert fine.info.num_classes == 100 and coarse.info.num_classes == 20
    (folder / "test.bin").write_bytes(data[:-5])
    with pytest.raises(DatasetError, match="record"):
        load_dataset("cifar100", tmp_path, download=False, cache_dir=tmp_path / "other")


def test_stl10_binary_is_column_major(tmp_path):
    rng = np.random.default_rng(4)
    folder = tmp_path / "stl10_binary"
    folder.mkdir()
    upright = {}
    for split, n in (("train", 3), ("test", 2)):
        images = rng.integers(0, 256, (n, 3, 96, 96), dtype=np.uint8)
        (folder / f"{split}_X.bin").write_bytes(images.transpose(0, 1, 3, 2).tobytes())  # stored column-major
        (folder / f"{split}_y.bin").write_bytes(np.array([1, 10, 5][:n], dtype=np.uint8).tobytes())
        upright[split] = images
    ds = load_dataset("stl10", tmp_path, download=False)
    assert np.array_equal(ds.train.x.numpy(), upright["train"])
    assert ds.train.y.tolist() == [0, 9, 4]
    small = load_dataset("stl10", tmp_path, download=False, image_size=32)
    assert small.train.x.shape == (3, 3, 32, 32)


def png(color: tuple[int, int, int], size: int = 8) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="PNG")
    return buf.getvalue()


def write_tree(root: Path, layout: dict[str, dict[str, int]]) -> None:
    colors = {"cat": (255, 0, 0), "dog": (0, 255, 0), "fox": (0, 0, 255)}
    for top, classes in layout.items():
        for cls, n in classes.items():
            (root / top / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                (root / top / cls / f"{i}.png").write_bytes(png(colors[cls]))


def test_image_folder_split_layout_and_archive(tmp_path):
    tree = tmp_path / "tree"
    write_tree(tree, {"train": {"cat": 3, "dog": 2}, "test": {"cat": 1, "dog": 1}})
    ds = load_dataset("imagefolder", tree, download=False)
    assert ds.info.classes == ("cat", "dog") and ds.train.x.shape == (5, 3, 8, 8)
    assert ds.train.y.tolist() == [0, 0, 0, 1, 1]
    assert ds.train.x[0, 0].float().mean() == 255 and ds.train.x[0, 1].float().mean() == 0  # red cat
    archive = tmp_path / "tree.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tree, arcname="top")
    from_tar = load_dataset("imagefolder", archive, download=False, image_size=4)
    assert from_tar.train.x.shape == (5, 3, 4, 4) and from_tar.train.y.tolist() == ds.train.y.tolist()


def test_image_folder_domain_layout(tmp_path):
    write_tree(tmp_path, {"photo": {"cat": 5, "dog": 5}, "sketch": {"cat": 5, "fox": 5}})
    ds = load_dataset("imagefolder", tmp_path, download=False, test_fraction=0.2)
    assert ds.info.groups == ("photo", "sketch") and ds.info.classes == ("cat", "dog", "fox")
    assert len(ds.train) == 16 and len(ds.test) == 4
    assert set(ds.test.group.tolist()) == {0, 1}
    only = load_dataset("imagefolder", tmp_path, download=False, domains=["sketch"])
    assert only.info.groups == ("sketch",)
    with pytest.raises(DatasetError, match="domains"):
        load_dataset("imagefolder", tmp_path, download=False, domains=["cartoon"])


def test_tiny_imagenet_layout(tmp_path):
    base = tmp_path / "tiny-imagenet-200"
    (base / "val" / "images").mkdir(parents=True)
    (base / "wnids.txt").write_text("n01\nn02\n")
    for wnid, color in (("n01", (255, 0, 0)), ("n02", (0, 255, 0))):
        (base / "train" / wnid / "images").mkdir(parents=True)
        (base / "train" / wnid / "images" / f"{wnid}_0.JPEG").write_bytes(png(color, 64))
    (base / "val" / "images" / "val_0.JPEG").write_bytes(png((0, 255, 0), 64))
    (base / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn02\t0\t0\t10\t10\n")
    ds = load_dataset("tinyimagenet", tmp_path, download=False)
    assert ds.train.y.tolist() == [0, 1] and ds.test.y.tolist() == [1] and ds.train.x.shape == (2, 3, 64, 64)


def test_unknown_dataset_and_options(tmp_path):
    with pytest.raises(DatasetError, match="data.dataset"):
        load_dataset("imagenet22k")
    with pytest.raises(DatasetError, match=r"data.options.colour.*options: alpha"):
        load_dataset("synthetic", colour=1)
    with pytest.raises(DatasetError, match="data.options.alpha"):
        load_dataset("synthetic", alpha="high")
    with pytest.raises(DatasetError, match="data.root"):
        load_dataset("mnist", tmp_path / "nowhere", download=False)


def test_download_verifies_checksum_and_writes_atomically(tmp_path):
    source = tmp_path / "source.bin"
    source.write_bytes(b"official bytes")
    md5 = hashlib.md5(b"official bytes").hexdigest()
    dest = tmp_path / "out" / "file.bin"
    fetch(source.as_uri(), dest, md5)
    assert dest.read_bytes() == b"official bytes"
    with pytest.raises(DatasetError, match="checksum mismatch"):
        fetch(source.as_uri(), tmp_path / "out" / "bad.bin", "0" * 32)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["file.bin"]  # nothing half-written
    remote = Remote("x.bin", ("http://127.0.0.1:9/x.bin", source.as_uri()), md5)  # first mirror fails
    (path,) = ensure(tmp_path / "mirror", [remote], download=True, dataset="demo")
    assert path.read_bytes() == b"official bytes"
    with pytest.raises(DatasetError, match=r"missing y.bin .*download failed"):
        ensure(tmp_path / "mirror", [Remote("y.bin", ("http://127.0.0.1:9/y.bin",), md5)], True, "demo")


def test_imagefolder_needs_pillow_message(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pil(name, *args, **kwargs):
        if name == "PIL":
            raise ImportError("no PIL")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pil)
    with pytest.raises(DatasetError, match="pip install pillow"):
        imagefolder.decode(b"", "x", None, 3)


def test_synthetic_is_deterministic_and_heterogeneous():
    a = load_dataset("synthetic", seed=0)
    b = load_dataset("synthetic", seed=0)
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.train.y, b.train.y)
    assert a.train.x.dtype == torch.float32 and a.info.input_shape == (60,) and len(a.info.groups) == 30
    assert not torch.equal(load_dataset("synthetic", seed=1).train.x[:10], a.train.x[:10])
    # within a device, input variance along dimension j is j^-1.2 (the diagonal Sigma)
    iid = load_dataset("synthetic", seed=0, iid=True, num_devices=5)
    x = torch.cat([iid.train.x, iid.test.x]).double()
    var = x.var(0)
    expected = torch.arange(1, 61, dtype=torch.float64) ** -1.2
    assert torch.allclose(var, expected, rtol=0.2)
    # label distributions differ across devices far more in Synthetic(1,1) than in the IID variant
    def spread(ds):
        y, g = ds.train.y, ds.train.group
        dists = torch.stack([torch.bincount(y[g == k], minlength=10).double() / (g == k).sum() for k in g.unique()])
        return (dists - dists.mean(0)).abs().sum(1).mean().item()
    assert spread(a) > 2 * spread(iid)


@pytest.mark.skipif(not (SHARED / "mnist").is_dir(), reason="needs ../shared/datasets/mnist")
def test_real_mnist(tmp_path):
    ds = load_dataset("mnist", SHARED / "mnist", download=False, cache_dir=tmp_path)
    assert (len(ds.train), len(ds.test)) == (60000, 10000)
    assert ds.train.y[:8].tolist() == [5, 0, 4, 1, 9, 2, 1, 3]
    assert ds.test.y[:8].tolist() == [7, 2, 1, 0, 4, 1, 4, 9]


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "cifar10-jpeg.tar.gz").exists(), reason="needs the CIFAR-10 JPEG copy")
def test_real_cifar10_jpeg_copy(tmp_path):
    ds = load_dataset("cifar10", SHARED / "cifar10-jpeg.tar.gz", download=False, cache_dir=tmp_path)
    assert (len(ds.train), len(ds.test)) == (50000, 10000)
    assert torch.bincount(ds.train.y).tolist() == [5000] * 10
    assert ds.train.x.shape[1:] == (3, 32, 32)
