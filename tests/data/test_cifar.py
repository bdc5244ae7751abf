"""CIFAR-10/100 (hetfl.data.datasets.cifar): records and labels checked with refusals word for word (naming the
file, the batch and the bound), the binary source preferred and found under a wrapper folder, downloads, and what
a loaded dataset is called, normalised and noted with. (tests/data/test_datasets.py has the formats and orders.)"""

from __future__ import annotations

import hashlib
import tarfile

import numpy as np
import pytest

from hetfl.data.base import DatasetError
from hetfl.data.datasets import cifar, load_dataset
from hetfl.data.datasets.common import CIFAR10_NORM, CIFAR100_NORM
from hetfl.data.datasets.download import Remote
from tests.helpers.datasets import cifar_records, make_cifar10, make_split_folder, tar_folder


def load(name: str, root, tmp_path, **options):
    return load_dataset(name, root, download=False, cache_dir=tmp_path / "cache", **options)


def refusal(name: str, root, tmp_path, **options) -> str:
    with pytest.raises(DatasetError) as err:
        load(name, root, tmp_path, **options)
    return str(err.value)


def make_cifar100(folder, train_labels=((19, 99), (0, 5)), test_labels=((4, 30),)):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.bin").write_bytes(cifar_records(list(train_labels), seed=1)[0])
    (folder / "test.bin").write_bytes(cifar_records(list(test_labels), seed=2)[0])


# ------------------------------------------------------------------ records and labels
def test_records_are_split_into_images_and_int64_labels_and_an_empty_file_is_refused():
    data, images = cifar_records([(3, 7), (1, 2)], seed=0)
    x, y = cifar.parse_records(data, 2, "f.bin")
    assert np.array_equal(x, images) and y.dtype == np.int64 and y.tolist() == [[3, 7], [1, 2]]
    with pytest.raises(DatasetError) as err:
        cifar.parse_records(b"", 1, "f.bin")
    assert str(err.value) == ("f.bin: 0 bytes is not a whole number of 3073-byte CIFAR records; replace it with the "
                              "file from the official binary archive")


def test_a_damaged_batch_is_named_by_its_split_and_number(tmp_path):
    make_cifar10(tmp_path)
    (tmp_path / "data_batch_2.bin").write_bytes(b"\x00" * 3000)
    assert refusal("cifar10", tmp_path, tmp_path).startswith(f"{tmp_path} (train batch 2): 3000 bytes is not")


@pytest.mark.parametrize(("labels", "bound"), [((9,), None), ((10,), "(10,)")])
def test_a_cifar10_label_of_10_or_more_is_refused(tmp_path, labels, bound):
    make_cifar10(tmp_path)
    (tmp_path / "test_batch.bin").write_bytes(cifar_records([labels], seed=3)[0])
    if bound is None:
        assert load("cifar10", tmp_path, tmp_path).test.y.tolist() == [9]
    else:
        assert refusal("cifar10", tmp_path, tmp_path) == (f"{tmp_path}: test labels out of range (>= {bound}); "
                                                          "corrupt file, replace it")


@pytest.mark.parametrize(("labels", "ok"), [((19, 99), True), ((20, 5), False), ((3, 100), False)])
def test_cifar100_coarse_labels_stop_at_20_and_fine_ones_at_100(tmp_path, labels, ok):
    make_cifar100(tmp_path / "cifar-100-binary", test_labels=(labels,))
    if ok:
        assert load("cifar100", tmp_path, tmp_path).test.y.tolist() == [labels[1]]
    else:
        assert refusal("cifar100", tmp_path, tmp_path) == (f"{tmp_path / 'cifar-100-binary'}: test labels out of "
                                                           "range (>= (20, 100)); corrupt file, replace it")


# ------------------------------------------------------------------ where the batches are
def test_an_archive_missing_a_batch_is_not_the_official_one(tmp_path):
    folder = tmp_path / "x" / "cifar-10-batches-bin"
    make_cifar10(folder)
    (folder / "data_batch_3.bin").unlink()
    (tmp_path / "root").mkdir()
    archive = tar_folder(folder, tmp_path / "root" / "cifar-10-binary.tar.gz", "cifar-10-batches-bin")
    assert refusal("cifar10", archive, tmp_path) == (f"{archive}: not the official archive "
                                                     "(cifar-10-batches-bin/data_batch_3.bin missing); replace it")


def test_an_archive_with_a_wrapper_folder_is_read(tmp_path):
    train, _ = make_cifar10(tmp_path / "x" / "cifar-10-batches-bin")
    (tmp_path / "root").mkdir()
    archive = tar_folder(tmp_path / "x", tmp_path / "root" / "cifar-10-binary.tar.gz", "wrapper")
    assert np.array_equal(load("cifar10", archive, tmp_path).train.x.numpy(), train)


def test_the_batches_are_read_inside_their_own_folder_by_default(tmp_path):
    make_cifar10(tmp_path / "b")
    chunks = cifar.read_binary(tmp_path / "b", cifar.CIFAR10_DIR, cifar.CIFAR10_FILES)
    assert [len(c) for c in chunks["train"]] == [2 * 3073] * 5 and [len(c) for c in chunks["test"]] == [3 * 3073]


def test_the_binary_batches_win_over_an_image_folder_beside_them(tmp_path):
    train, _ = make_cifar10(tmp_path / "cifar-10-batches-bin")
    make_split_folder(tmp_path, {"cat": 10}, size=(32, 32))
    ds = load("cifar10", tmp_path, tmp_path)
    assert np.array_equal(ds.train.x.numpy(), train)
    assert ds.notes == [f"cifar10 from {tmp_path / 'cifar-10-batches-bin'}"]


def test_a_cifar100_archive_beside_a_cifar10_image_archive_is_not_taken_for_images(tmp_path):
    make_cifar100(tmp_path / "src" / "cifar-100-binary")
    (tmp_path / "root").mkdir()
    tar_folder(tmp_path / "src" / "cifar-100-binary", tmp_path / "root" / "cifar-100-binary.tar.gz", "cifar-100-binary")
    make_split_folder(tmp_path / "tree", {"cat": 10}, size=(32, 32))
    tar_folder(tmp_path / "tree", tmp_path / "root" / "cifar10-png.tar.gz", "cifar10-png")
    ds = load("cifar10", tmp_path / "root", tmp_path)
    assert ds.train.y.tolist() == [3, 3, 3] and "image folder" in ds.notes[0]


def test_an_image_folder_is_resized_to_32_and_named_normalised_as_cifar10(tmp_path):
    make_split_folder(tmp_path / "tree", {"cat": 10, "dog": 20}, size=(40, 40))
    ds = load("cifar10", tmp_path / "tree", tmp_path)
    assert ds.train.x.shape == (6, 3, 32, 32) and ds.info.name == "cifar10"
    assert (ds.info.mean, ds.info.std) == tuple(CIFAR10_NORM)
    assert ds.notes == [f"cifar10 from the image folder {tmp_path / 'tree'} (not the official binary files)"]


def test_binary_datasets_are_named_normalised_and_noted_with_their_source(tmp_path):
    make_cifar10(tmp_path / "ten")
    ds = load("cifar10", tmp_path / "ten", tmp_path)
    assert ds.info.name == "cifar10" and (ds.info.mean, ds.info.std) == tuple(CIFAR10_NORM)
    assert ds.notes == [f"cifar10 from {tmp_path / 'ten'}"]
    make_cifar100(tmp_path / "hundred")
    ds = load("cifar100", tmp_path / "hundred", tmp_path, label_mode="coarse")
    assert ds.info.name == "cifar100" and (ds.info.mean, ds.info.std) == tuple(CIFAR100_NORM)
    assert ds.notes == [f"cifar100 (coarse labels) from {tmp_path / 'hundred'}"]


# ------------------------------------------------------------------ missing files and downloads
def test_missing_files_are_named_with_what_else_would_do(tmp_path):
    assert refusal("cifar10", tmp_path, tmp_path) == (
        f"cifar10: cifar-10-binary.tar.gz not found in {tmp_path} and downloading is off (data.download = false). "
        "Put the official file(s) (or its extracted cifar-10-batches-bin/, or an image folder train/<class>/, "
        f"test/<class>/) into {tmp_path}, or set data.root to the folder that holds them")
    assert refusal("cifar100", tmp_path, tmp_path) == (
        f"cifar100: cifar-100-binary.tar.gz not found in {tmp_path} and downloading is off (data.download = false). "
        "Put the official file(s) (or its extracted cifar-100-binary/train.bin, test.bin) into "
        f"{tmp_path}, or set data.root to the folder that holds them")


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_the_official_archive_is_downloaded_when_asked(tmp_path, monkeypatch, name):
    server = tmp_path / "server"
    if name == "cifar10":
        make_cifar10(tmp_path / "src" / cifar.CIFAR10_DIR)
        folder, attr, remote_name = cifar.CIFAR10_DIR, "CIFAR10", cifar.CIFAR10.name
    else:
        make_cifar100(tmp_path / "src" / cifar.CIFAR100_DIR)
        folder, attr, remote_name = cifar.CIFAR100_DIR, "CIFAR100", cifar.CIFAR100.name
    server.mkdir()
    with tarfile.open(server / remote_name, "w:gz") as tar:
        tar.add(tmp_path / "src" / folder, arcname=folder)
    md5 = hashlib.md5((server / remote_name).read_bytes()).hexdigest()
    monkeypatch.setattr(cifar, attr, Remote(remote_name, ((server / remote_name).as_uri(),), md5=md5))
    (tmp_path / "root").mkdir()
    ds = load_dataset(name, tmp_path / "root", download=True, cache_dir=tmp_path / "cache")
    assert len(ds.train) > 0 and (tmp_path / "root" / remote_name).is_file()
    assert ds.notes[0].endswith(f"from {tmp_path / 'root' / remote_name}")


def test_two_missing_batches_are_listed_comma_separated(tmp_path):
    folder = tmp_path / "x" / "cifar-10-batches-bin"
    make_cifar10(folder)
    (folder / "data_batch_3.bin").unlink()
    (folder / "test_batch.bin").unlink()
    (tmp_path / "root").mkdir()
    archive = tar_folder(folder, tmp_path / "root" / "cifar-10-binary.tar.gz", "cifar-10-batches-bin")
    assert "(cifar-10-batches-bin/data_batch_3.bin, cifar-10-batches-bin/test_batch.bin missing)" in refusal(
        "cifar10", archive, tmp_path)


def test_an_image_folder_needs_its_test_split_named_test(tmp_path):
    make_split_folder(tmp_path / "tree", {"cat": 10}, size=(32, 32), test_name="val")
    assert refusal("cifar10", tmp_path / "tree", tmp_path).startswith(
        f"{tmp_path / 'tree'}: expected images under train/<class>/ and test/<class>/ (found top folders: ")


def test_an_image_folders_images_may_link_elsewhere_inside_data_root(tmp_path):
    make_split_folder(tmp_path / "root" / "tree", {"cat": 10}, size=(32, 32))
    image = tmp_path / "root" / "tree" / "train" / "cat" / "0000.png"
    (tmp_path / "root" / "store").mkdir()
    image.rename(tmp_path / "root" / "store" / "0000.png")
    image.symlink_to(tmp_path / "root" / "store" / "0000.png")
    assert load("cifar10", tmp_path / "root", tmp_path).train.y.tolist() == [3, 3, 3]  # data.root holds both
