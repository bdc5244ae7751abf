"""MNIST, Fashion-MNIST and EMNIST from their IDX files (hetfl.data.datasets.idx): the header's edges, the refusals
word for word (each names the file and says what to do), what a loaded dataset is called and normalised with, and
EMNIST's archive extracted inside data.root only. (tests/data/test_datasets.py has the formats, upright EMNIST and
the letters' shift; tests/data/test_damaged_files.py damaged files through load_dataset.)"""

from __future__ import annotations

import gzip
import hashlib
import zipfile

import numpy as np
import pytest
import torch

from hetfl.data.base import DatasetError
from hetfl.data.datasets import idx, load_dataset
from hetfl.data.datasets.common import EMNIST_NORM, MNIST_NORM
from hetfl.data.datasets.download import Remote
from tests.helpers.datasets import emnist_files, idx_bytes, make_mnist, write_idx

FILES = ", ".join(idx.FILES)


# ------------------------------------------------------------------ the header
def test_a_file_shorter_than_a_magic_number_is_refused_as_such():
    for data, shown in ((b"", "empty"), (b"\x00\x00\x08", "000008"), (b"\x00\x00\x08\x02" + bytes(8), "00000802")):
        with pytest.raises(DatasetError) as err:
            idx.parse_idx(data, "f.idx", 1)
        assert str(err.value) == (f"f.idx: bad magic number {shown} (expected 00000801, an IDX file of 1-D unsigned "
                                  "bytes); replace it with the official file")


def test_a_magic_number_without_its_sizes_is_a_truncated_header():
    for data in (b"\x00\x00\x08\x01", b"\x00\x00\x08\x03" + bytes(11)):
        with pytest.raises(DatasetError) as err:
            idx.parse_idx(data, "f.idx", data[3])
        assert str(err.value) == "f.idx: truncated IDX header; replace it with the official file"


def test_a_header_of_zero_items_is_an_empty_array():
    empty = idx.parse_idx(b"\x00\x00\x08\x01" + bytes(4), "f.idx", 1)
    assert empty.shape == (0,) and empty.dtype == np.uint8


def test_sizes_are_big_endian_words_one_after_another():
    array = np.arange(2 * 3 * 260, dtype=np.uint32).reshape(2, 3, 260).astype(np.uint8)  # 260 > one byte
    back = idx.parse_idx(idx_bytes(array), "f.idx", 3)
    assert back.shape == (2, 3, 260) and np.array_equal(back, array)


def test_every_byte_of_a_size_counts():
    """A size of 2^24 (its first byte 1, the others 0) with no body: refused for the 16,777,216 bytes it
    promises, in either word of the header (read as 0, it would pass as an empty array)."""
    for sizes in ((2**24,), (1, 2**24)):
        data = bytes([0, 0, 8, len(sizes)]) + b"".join(n.to_bytes(4, "big") for n in sizes)
        with pytest.raises(DatasetError, match=rf"header says \({sizes[0]}, ?{sizes[1] if len(sizes) > 1 else ''}\)"):
            idx.parse_idx(data, "f.idx", len(sizes))


def test_a_body_of_the_wrong_length_is_refused_naming_both_lengths():
    data = idx_bytes(np.zeros((2, 3), dtype=np.uint8))
    with pytest.raises(DatasetError) as err:
        idx.parse_idx(data[:-1], "f.idx", 2)
    assert str(err.value) == ("f.idx: truncated or corrupt (header says (2, 3), 5 bytes follow); replace it with the "
                              "official file")


# ------------------------------------------------------------------ the pairs and the labels
def test_images_of_another_size_and_pairs_of_other_lengths_are_refused_word_for_word(tmp_path):
    images = write_idx(tmp_path / "images.gz", np.zeros((3, 28, 27), dtype=np.uint8))
    labels = write_idx(tmp_path / "labels.gz", np.zeros(3, dtype=np.uint8))
    with pytest.raises(DatasetError) as err:
        idx.read_pair(images, labels)
    assert str(err.value) == f"{images}: images are 28x27, expected 28x28"
    write_idx(images, np.zeros((3, 28, 28), dtype=np.uint8))
    write_idx(labels, np.zeros(2, dtype=np.uint8))
    with pytest.raises(DatasetError) as err:
        idx.read_pair(images, labels)
    assert str(err.value) == (f"{images} (3 images) and {labels} (2 labels) differ in length; replace them with the "
                              "official files")


def test_labels_outside_the_classes_are_refused_naming_the_file(tmp_path):
    with pytest.raises(DatasetError) as err:
        idx.check_labels(np.array([0, 10, 3]), 10, tmp_path / "labels.gz")
    assert str(err.value) == (f"{tmp_path / 'labels.gz'}: labels span 0..10, expected 0..9; replace it with the "
                              "official file")
    idx.check_labels(np.array([], dtype=np.int64), 10, tmp_path / "labels.gz")


def test_an_emnist_label_outside_its_split_names_its_labels_file(tmp_path):
    upright = np.zeros((2, 28, 28), dtype=np.uint8)
    emnist_files(tmp_path, "digits", upright, np.array([3, 10], dtype=np.uint8))
    with pytest.raises(DatasetError) as err:
        load_dataset("emnist", tmp_path, download=False, cache_dir=tmp_path / "c", split="digits")
    assert str(err.value).startswith(f"{tmp_path / 'emnist-digits-train-labels-idx1-ubyte.gz'}: labels span 3..10")


# ------------------------------------------------------------------ what a loaded dataset is
def test_mnist_is_named_normalised_and_noted_with_its_folder(tmp_path):
    make_mnist(tmp_path / "m")
    ds = load_dataset("mnist", tmp_path / "m", download=False, cache_dir=tmp_path / "c")
    assert ds.info.name == "mnist" and ds.notes == [f"mnist from {tmp_path / 'm'}"]
    assert (ds.info.mean, ds.info.std) == tuple(MNIST_NORM)
    assert ds.train.y.dtype == torch.int64


def test_emnist_is_named_normalised_and_noted_with_its_split_and_folder(tmp_path):
    emnist_files(tmp_path, "digits", np.zeros((2, 28, 28), dtype=np.uint8), np.array([3, 9], dtype=np.uint8))
    ds = load_dataset("emnist", tmp_path, download=False, cache_dir=tmp_path / "c", split="digits")
    assert ds.info.name == "emnist" and ds.notes == [f"emnist-digits from {tmp_path}"]
    assert (ds.info.mean, ds.info.std) == tuple(EMNIST_NORM)


def test_a_file_as_data_root_is_refused_naming_the_files_to_put_there(tmp_path):
    root = tmp_path / "mnist.gz"
    root.write_bytes(b"x")
    with pytest.raises(DatasetError) as err:
        load_dataset("mnist", root, download=False, cache_dir=tmp_path / "c")
    assert str(err.value) == f"mnist: data.root = {str(root)!r} is a file; set it to the folder holding {FILES}"


def test_missing_emnist_files_name_the_archive_and_the_extracted_files(tmp_path):
    with pytest.raises(DatasetError) as err:
        load_dataset("emnist", tmp_path, download=False, cache_dir=tmp_path / "c", split="digits")
    names = ", ".join(idx.emnist_files("digits"))
    assert str(err.value) == (f"emnist: gzip.zip not found in {tmp_path} and downloading is off (data.download = "
                              f"false). Put the official file(s) (or the extracted {names}) into {tmp_path}, or set "
                              "data.root to the folder that holds them")


def test_an_incomplete_emnist_folder_counts_uncompressed_files_as_there(tmp_path):
    names = idx.emnist_files("digits")
    emnist_files(tmp_path, "digits", np.zeros((1, 28, 28), dtype=np.uint8), np.array([1], dtype=np.uint8))
    (tmp_path / names[0]).rename(tmp_path / names[0].removesuffix(".gz"))  # gzipped or not, as MNIST's
    (tmp_path / names[0].removesuffix(".gz")).write_bytes(gzip.decompress((tmp_path / names[1]).read_bytes()))
    (tmp_path / names[3]).unlink()
    with pytest.raises(DatasetError) as err:
        load_dataset("emnist", tmp_path, download=False, cache_dir=tmp_path / "c", split="digits")
    assert f"{tmp_path} lacks {names[3]} (it holds 3 of the 4 files)" in str(err.value)


def test_emnist_downloads_its_archive_when_asked(tmp_path, monkeypatch):
    files = emnist_files(tmp_path / "src", "digits", np.zeros((2, 28, 28), dtype=np.uint8),
                         np.array([4, 7], dtype=np.uint8))
    server = tmp_path / "server"
    server.mkdir()
    with zipfile.ZipFile(server / "gzip.zip", "w") as archive:
        for name, data in files.items():
            archive.writestr(f"gzip/{name}", data)
    md5 = hashlib.md5((server / "gzip.zip").read_bytes()).hexdigest()
    monkeypatch.setattr(idx, "EMNIST_ZIP", Remote("gzip.zip", ((server / "gzip.zip").as_uri(),), md5=md5))
    (tmp_path / "root").mkdir()
    ds = load_dataset("emnist", tmp_path / "root", download=True, cache_dir=tmp_path / "c", split="digits")
    assert ds.test.y.tolist() == [4, 7]


def test_emnist_files_in_a_gzip_folder_count_as_found(tmp_path):
    emnist_files(tmp_path / "gzip", "mnist", np.zeros((2, 28, 28), dtype=np.uint8), np.array([1, 2], dtype=np.uint8))
    ds = load_dataset("emnist", tmp_path, download=False, cache_dir=tmp_path / "c", split="mnist")
    assert ds.train.y.tolist() == [1, 2]
    (tmp_path / "gzip" / idx.emnist_files("mnist")[3]).unlink()  # three of four: the archive is asked for
    with pytest.raises(DatasetError, match="gzip.zip"):
        load_dataset("emnist", tmp_path, download=False, cache_dir=tmp_path / "c2", split="mnist")


def test_emnist_files_linked_elsewhere_inside_data_root_are_read(tmp_path):
    """data.root bounds where files may lie, not each file's folder: an image file in ``gzip/`` that is a link to
    another folder of data.root is read (a link leaving data.root is refused: test_data_links.py)."""
    names = idx.emnist_files("digits")
    emnist_files(tmp_path / "gzip", "digits", np.zeros((1, 28, 28), dtype=np.uint8), np.array([2], dtype=np.uint8))
    (tmp_path / "store").mkdir()
    for name in (names[0], names[1]):
        (tmp_path / "gzip" / name).rename(tmp_path / "store" / name)
        (tmp_path / "gzip" / name).symlink_to(tmp_path / "store" / name)
    ds = load_dataset("emnist", tmp_path, download=False, cache_dir=tmp_path / "c", split="digits")
    assert ds.train.y.tolist() == [2]


# ------------------------------------------------------------------ EMNIST's archive
def test_only_plain_file_names_are_extracted(tmp_path):
    for bad in (["../x.gz"], ["sub/x.gz"], [""], ["."], [".."]):
        with pytest.raises(DatasetError) as err:
            idx._extract_emnist(tmp_path, bad)
        assert str(err.value) == f"EMNIST file names {bad} are not plain file names"


def test_a_dangling_gzip_link_leaving_data_root_is_refused_before_anything_is_written(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    files = emnist_files(tmp_path / "src", "digits", np.zeros((1, 28, 28), dtype=np.uint8), np.array([1], np.uint8))
    with zipfile.ZipFile(root / "gzip.zip", "w") as archive:
        for name, data in files.items():
            archive.writestr(f"gzip/{name}", data)
    (root / "gzip").symlink_to(outside / "target", target_is_directory=True)  # dangling
    with pytest.raises(DatasetError) as err:
        idx._extract_emnist(root, list(files))
    assert str(err.value).startswith(f"{root / 'gzip'}: ") and "cannot write" not in str(err.value)
    assert "outside" in str(err.value) and not outside.exists()


def test_a_folder_that_cannot_be_written_says_to_extract_elsewhere(tmp_path, monkeypatch):
    def refuse(path, data):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(idx, "atomic_write_bytes", refuse)
    archive = tmp_path / "gzip.zip"
    with pytest.raises(DatasetError) as err:
        idx._write_extracted(tmp_path / "gzip", "a.gz", b"x", archive, ["a.gz", "b.gz"])
    assert str(err.value) == (f"{tmp_path / 'gzip'}: cannot write the files extracted from {archive} (Permission "
                              "denied); extract gzip/a.gz, gzip/b.gz from it into a folder and set data.root to that "
                              "folder, or make data.root writable")


def test_a_gzipped_idx_file_is_read_through_its_folder_or_the_root_given(tmp_path):
    (tmp_path / "sub").mkdir()
    path = write_idx(tmp_path / "sub" / "labels.gz", np.array([1, 2], dtype=np.uint8))
    assert idx.read_idx(path, 1).tolist() == [1, 2]
    assert idx.read_idx(path, 1, tmp_path).tolist() == [1, 2]
    (tmp_path / "sub" / "link.gz").symlink_to(tmp_path / "elsewhere.gz")
    (tmp_path / "elsewhere.gz").write_bytes(gzip.compress(idx_bytes(np.array([5], dtype=np.uint8))))
    assert idx.read_idx(tmp_path / "sub" / "link.gz", 1, tmp_path).tolist() == [5]  # inside the root given
    with pytest.raises(DatasetError):
        idx.read_idx(tmp_path / "sub" / "link.gz", 1)  # outside its own folder
