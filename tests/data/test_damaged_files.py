"""Damaged archives and folders hetfl cannot write to: refused with a DatasetError that names the file and
says what to do, never a smaller dataset or a raw traceback (the data audit, benchmarks/results/data_audit.md).

Each archive is built in memory with one known defect: a damaged member header in the middle of a tar
(which Python's tarfile takes for the end of the archive), a gzip stream whose CRC-32 does not match its
contents, a zip member whose deflate data is broken (zlib.error). Running as root, a read-only folder
cannot be made with chmod here, so an unwritable folder is simulated where the write starts
(``tempfile.mkstemp``), raising the PermissionError that a read-only folder raises.
"""

from __future__ import annotations

import bz2
import errno
import gzip
import hashlib
import http.server
import io
import lzma
import tarfile
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest

from hetfl.data.base import DatasetError
from hetfl.data.datasets import download, idx, load_dataset, tree
from tests.helpers.datasets import (
    emnist_files,
    make_cifar10,
    make_mnist,
    make_split_folder,
    make_stl10,
    make_tinyimagenet,
    solid,
    tar_folder,
    write_png,
)

PIL = pytest.importorskip("PIL.Image")
MEMBERS = {f"a/{i}.bin": bytes([i]) * 700 for i in range(10)}  # 10 members of 700 bytes, 2 blocks each


def tar_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def damaged_header_tar(member: int = 5) -> bytes:
    """``MEMBERS`` as a tar whose ``member``-th header has a wrong checksum (as from a flipped byte)."""
    raw = bytearray(tar_bytes(MEMBERS))
    offset = member * 3 * 512  # each member: a header block and two data blocks
    assert raw[offset:offset + 100].rstrip(b"\0") == f"a/{member}.bin".encode()
    raw[offset + 10] ^= 0xFF  # in the name field: the header checksum no longer matches
    return bytes(raw)


def walk_all(archive: Path) -> list[tuple[str, ...]]:
    return [parts for parts, _ in tree.walk(archive, lambda parts: True, root=archive.parent)]


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz"])
def test_a_damaged_header_in_the_middle_of_a_tar_is_refused_not_taken_for_its_end(tmp_path, suffix):
    """tarfile stops at a damaged header after the first and reports nothing: the five members after it
    were silently dropped (a dataset short of a part of its images)."""
    raw = damaged_header_tar()
    archive = tmp_path / f"data{suffix}"
    archive.write_bytes(gzip.compress(raw, mtime=0) if suffix == ".tar.gz" else raw)
    with pytest.raises(DatasetError) as err:
        walk_all(archive)
    msg = str(err.value)
    assert msg.startswith(f"{archive}: unreadable or corrupt archive") and "replace it with a complete copy" in msg
    assert "header" in msg


def test_an_intact_tar_is_read_whole_whatever_its_compression(tmp_path):
    raw = tar_bytes(MEMBERS)
    for suffix, data in ((".tar", raw), (".tar.gz", gzip.compress(raw)), (".tar.bz2", bz2.compress(raw)),
                         (".tar.xz", lzma.compress(raw))):
        archive = tmp_path / f"data{suffix}"
        archive.write_bytes(data)
        assert dict(tree.walk(archive, lambda parts: True, root=tmp_path)) == {
            tuple(name.split("/")): content for name, content in MEMBERS.items()}, suffix


def test_a_tar_gz_whose_checksum_does_not_match_is_refused(tmp_path):
    """A .tar.gz whose decompressed bytes are not the ones compressed (the gzip trailer's CRC-32 says so)
    loaded silently: damage inside member data leaves every tar header intact."""
    packed = bytearray(gzip.compress(tar_bytes(MEMBERS), mtime=0))
    packed[-8] ^= 0x01  # CRC-32 of the uncompressed data: the first of the trailer's 8 bytes
    archive = tmp_path / "data.tar.gz"
    archive.write_bytes(bytes(packed))
    with pytest.raises(DatasetError, match=r"unreadable or corrupt archive .*CRC"):
        walk_all(archive)


def test_a_cut_tar_gz_is_refused(tmp_path):
    packed = gzip.compress(tar_bytes(MEMBERS), mtime=0)
    archive = tmp_path / "data.tar.gz"
    archive.write_bytes(packed[: len(packed) - 20])
    with pytest.raises(DatasetError, match="unreadable or corrupt archive"):
        walk_all(archive)


def break_deflate(path: Path, member: int) -> Path:
    """Zip ``path`` with the deflate data of its ``member``-th member starting with an invalid block type."""
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        info = archive.infolist()[member]
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)  # after the local header
    raw[start] |= 0b111  # BFINAL = 1, BTYPE = 11: a block type deflate does not have
    path.write_bytes(bytes(raw))
    return path


def deflated_zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def test_a_zip_member_with_broken_deflate_data_is_a_dataset_error(tmp_path):
    """zipfile raises zlib.error (not a BadZipFile) for broken deflate data: it escaped as a raw traceback."""
    archive = break_deflate(deflated_zip(tmp_path / "data.zip", MEMBERS), 3)
    with pytest.raises(DatasetError, match=r"data\.zip: unreadable or corrupt archive \(error: .*invalid block"):
        walk_all(archive)


def test_a_damaged_cifar10_image_archive_is_refused_not_loaded_short(tmp_path):
    """The user's view: a CIFAR-10 image folder packed as .tar.gz (the layout of the JPEG copy) with one
    damaged header loaded with a part of its images missing; now the run stops, naming the archive."""
    folder = tmp_path / "cifar10-jpeg"
    make_split_folder(folder, {"cat": 100, "dog": 150}, per_split=(6, 2), size=(32, 32))
    intact = tar_folder(folder, tmp_path / "intact.tar.gz", "cifar10-jpeg")
    raw = bytearray(gzip.decompress(intact.read_bytes()))
    with tarfile.open(fileobj=io.BytesIO(bytes(raw))) as tar:
        offset = [m for m in tar.getmembers() if m.isfile()][5].offset
    raw[offset + 3] ^= 0xFF
    root = tmp_path / "root"
    root.mkdir()
    (root / "cifar10-jpeg.tar.gz").write_bytes(gzip.compress(bytes(raw), mtime=0))
    with pytest.raises(DatasetError) as err:
        load_dataset("cifar10", root, download=False, cache_dir=tmp_path / "c")
    assert str(root / "cifar10-jpeg.tar.gz") in str(err.value) and "corrupt archive" in str(err.value)
    whole = load_dataset("cifar10", intact, download=False, cache_dir=tmp_path / "c")
    assert len(whole.train.y) == 12 and len(whole.test.y) == 4


# ------------------------------------------------------------------ folders hetfl cannot write to
def unwritable(*args, dir=None, prefix="", suffix="", **kwargs):
    """``tempfile.mkstemp`` in a read-only folder."""
    raise PermissionError(errno.EACCES, "Permission denied", str(Path(dir) / f"{prefix}XXXXXX{suffix}"))


def test_a_download_into_a_folder_that_cannot_be_written_is_a_dataset_error(tmp_path, monkeypatch):
    """data.root read-only and a file missing: a raw PermissionError (a traceback from the CLI) before; now
    the loader's message: what is missing, that the folder cannot be written, and where to put the file."""
    made = tmp_path / "made"
    make_mnist(made)
    remotes = tuple(download.Remote(p.name, (p.as_uri(),), md5=hashlib.md5(p.read_bytes()).hexdigest())
                    for p in sorted(made.iterdir()))
    monkeypatch.setattr(idx, "MNIST", remotes)
    root = tmp_path / "shared"
    root.mkdir()
    monkeypatch.setattr(download.tempfile, "mkstemp", unwritable)
    with pytest.raises(DatasetError) as err:
        load_dataset("mnist", root, download=True, cache_dir=tmp_path / "c")
    msg = str(err.value)
    assert msg.startswith("mnist: t10k-images-idx3-ubyte.gz, ") and f"not found in {root}" in msg
    assert f"cannot write into {root}" in msg and "Permission denied" in msg
    assert f"Put the official file(s) (gzipped or not) into {root}" in msg
    assert not list(root.iterdir())
    monkeypatch.undo()  # writable again: the same call downloads
    monkeypatch.setattr(idx, "MNIST", remotes)
    assert len(load_dataset("mnist", root, download=True, cache_dir=tmp_path / "c").train.y) == 12


def emnist_zip(root: Path) -> dict[str, bytes]:
    upright = np.random.default_rng(0).integers(0, 256, (3, 28, 28), dtype=np.uint8)
    files = emnist_files(root.parent / "src", "digits", upright, np.array([0, 4, 9], dtype=np.uint8))
    root.mkdir()
    with zipfile.ZipFile(root / "gzip.zip", "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(f"gzip/{name}", data)
    return files


def test_emnist_gzip_zip_in_a_folder_that_cannot_be_written_is_not_called_corrupt(tmp_path, monkeypatch):
    """NIST's gzip.zip in a read-only data.root: the files extracted from it cannot be written. It was
    reported as "not NIST's EMNIST gzip.zip or corrupt ...; replace it", sending the user after a good file."""
    root = tmp_path / "root"
    emnist_zip(root)
    monkeypatch.setattr(download.tempfile, "mkstemp", unwritable)  # the one tempfile module atomic_write uses
    with pytest.raises(DatasetError) as err:
        load_dataset("emnist", root, download=False, cache_dir=tmp_path / "c", split="digits")
    msg = str(err.value)
    assert "corrupt" not in msg and "replace it" not in msg
    assert msg.startswith(f"{root / 'gzip'}: cannot write the files extracted from {root / 'gzip.zip'}")
    assert "Permission denied" in msg and "emnist-digits-train-images-idx3-ubyte.gz" in msg and "data.root" in msg


def test_emnist_gzip_zip_with_broken_deflate_data_is_called_corrupt(tmp_path):
    """The same zlib.error in NIST's gzip.zip escaped EMNIST's extraction as a raw traceback."""
    root = tmp_path / "root"
    files = emnist_zip(root)
    break_deflate(deflated_zip(root / "gzip.zip", {f"gzip/{n}": d for n, d in files.items()}), 0)
    with pytest.raises(DatasetError) as err:
        load_dataset("emnist", root, download=False, cache_dir=tmp_path / "c", split="digits")
    assert str(err.value).startswith(f"{root / 'gzip.zip'}: not NIST's EMNIST gzip.zip or corrupt")


# ------------------------------------------------------------------ a damaged cache entry
def test_a_cache_entry_with_an_empty_array_file_is_decoded_again(tmp_path):
    """An empty ``.npy`` under its final name (what a crash can leave on a file system that renamed the
    file before writing its data) made np.load raise EOFError, which escaped the cache: every later load
    of the dataset failed with a raw traceback until the user found and deleted the entry."""
    make_mnist(tmp_path / "mnist")
    first = load_dataset("mnist", tmp_path / "mnist", download=False, cache_dir=tmp_path / "c")
    (entry,) = (tmp_path / "c").iterdir()
    (entry / "train_x.npy").write_bytes(b"")
    again = load_dataset("mnist", tmp_path / "mnist", download=False, cache_dir=tmp_path / "c")
    assert np.array_equal(again.train.x.numpy(), first.train.x.numpy())
    assert np.array_equal(np.load(entry / "train_x.npy"), first.train.x.numpy())  # and the entry is rewritten


# ------------------------------------------------------------------ a download cut short
class _CutServer(http.server.BaseHTTPRequestHandler):
    """Announces ``PAYLOAD`` (its Content-Length), sends its first third, and closes the connection."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(PAYLOAD)))
        self.end_headers()
        self.wfile.write(PAYLOAD[: len(PAYLOAD) // 3])
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


PAYLOAD = bytes(range(256)) * 12


def test_a_download_cut_short_says_so_not_only_checksum_mismatch(tmp_path):
    """A connection cut mid-download was reported as a checksum mismatch (urllib's read returns the
    short body without an error), which reads as a wrong file on the server; now the byte counts say
    what happened. Nothing is left behind, and the next try downloads the file."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CutServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/f.bin"
        remote = download.Remote("f.bin", (url,), md5=hashlib.md5(PAYLOAD).hexdigest())
        with pytest.raises(DatasetError) as err:
            download.fetch(remote, tmp_path)
    finally:
        server.shutdown()
        server.server_close()
    msg = str(err.value)
    assert f"{url}: incomplete download ({len(PAYLOAD) // 3} of {len(PAYLOAD)} bytes" in msg
    assert "discarded" in msg and "checksum" not in msg and not list(tmp_path.iterdir())
    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "f.bin").write_bytes(PAYLOAD)
    retry = download.Remote("f.bin", ((tmp_path / "served" / "f.bin").as_uri(),), md5=remote.md5)
    assert download.fetch(retry, tmp_path / "root").read_bytes() == PAYLOAD


# ------------------------------------------------------------------ Tiny-ImageNet folders with a file missing or extra
def test_tinyimagenet_names_the_one_text_file_missing(tmp_path):
    """Only val_annotations.txt missing: the message said "wnids.txt and val/val_annotations.txt missing"."""
    source = tmp_path / "tiny-imagenet-200"
    make_tinyimagenet(source)
    (source / "val" / "val_annotations.txt").unlink()
    with pytest.raises(DatasetError) as err:
        load_dataset("tinyimagenet", tmp_path, download=False, cache_dir=tmp_path / "c")
    msg = str(err.value)
    assert msg.startswith(f"{source}: val/val_annotations.txt missing;") and "wnids.txt and" not in msg


def test_tinyimagenet_names_a_val_image_its_annotations_do_not_list(tmp_path):
    """A val image absent from val_annotations.txt was reported as "test images of classes ['']": no file."""
    source = tmp_path / "tiny-imagenet-200"
    make_tinyimagenet(source)
    write_png(source / "val" / "images" / "val_9.JPEG", solid(1, (64, 64)))
    with pytest.raises(DatasetError) as err:
        load_dataset("tinyimagenet", tmp_path, download=False, cache_dir=tmp_path / "c")
    msg = str(err.value)
    assert msg.startswith(f"{source}: val/images/val_9.JPEG is not listed in val/val_annotations.txt")
    assert "['']" not in msg


# ------------------------------------------------------------------ an extracted folder with a file missing
def _cifar10(folder: Path) -> None:
    make_cifar10(folder)
    (folder / "data_batch_3.bin").unlink()


def _cifar100(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "train.bin").write_bytes(b"\0" * 3074)


def _stl10(folder: Path) -> None:
    make_stl10(folder)
    (folder / "test_y.bin").unlink()


def _emnist(folder: Path) -> None:
    emnist_files(folder, "digits", np.zeros((2, 28, 28), np.uint8), np.zeros(2, np.uint8))
    (folder / "emnist-digits-test-labels-idx1-ubyte.gz").unlink()


@pytest.mark.parametrize(("name", "options", "sub", "make", "lacking"), [
    ("cifar10", {}, "cifar-10-batches-bin", _cifar10, "data_batch_3.bin"),
    ("cifar10", {}, "", _cifar10, "data_batch_3.bin"),  # data.root = the extracted folder itself
    ("cifar100", {}, "cifar-100-binary", _cifar100, "test.bin"),
    ("stl10", {}, "stl10_binary", _stl10, "test_y.bin"),
    ("emnist", {"split": "digits"}, "gzip", _emnist, "emnist-digits-test-labels-idx1-ubyte.gz"),
])
def test_an_extracted_folder_with_a_file_missing_is_named_with_the_file(tmp_path, name, options, sub, make, lacking):
    """A partly extracted archive (a batch file lost) was reported only as the archive not found, "or its
    extracted folder": the folder was right there, and the message did not say what it lacked."""
    root = tmp_path / "root"
    folder = root / sub if sub else root
    make(folder)
    with pytest.raises(DatasetError) as err:
        load_dataset(name, root, download=False, cache_dir=tmp_path / "c", **options)
    msg = str(err.value)
    assert "not found in" in msg and f"{folder} lacks {lacking} (" in msg


# ------------------------------------------------------------------ a user's own images beyond 8 bits
@pytest.mark.parametrize("channels", [1, 3])
def test_16_bit_images_are_scaled_to_8_bits_not_clipped(tmp_path, channels):
    """16-bit grayscale PNGs (common for scans and medical images) went through Pillow's convert, which clips
    at 255: every pixel above 255 of 65,535 became white, and the dataset loaded as if nothing were wrong."""
    values = (np.arange(64, dtype=np.uint16).reshape(8, 8) * 1000 + 7)  # 7 .. 63,007
    for split in ("train", "test"):
        for cls in ("a", "b"):
            path = tmp_path / "data" / split / cls / "0.png"
            path.parent.mkdir(parents=True)
            PIL.fromarray(values).save(path)
    ds = load_dataset("imagefolder", tmp_path / "data", download=False, cache_dir=tmp_path / "c", channels=channels)
    expected = np.round(values / 257).astype(np.uint8)  # 65,535 -> 255, the full range kept
    assert ds.train.x.shape == (2, channels, 8, 8)
    assert all(np.array_equal(ds.train.x[0, c].numpy(), expected) for c in range(channels))


def test_32_bit_images_beyond_8_bits_are_refused_naming_the_file(tmp_path):
    """A 32-bit integer (mode I) or float (mode F) image holds no range to scale from: refused, not clipped."""
    values = np.arange(64, dtype=np.int32).reshape(8, 8) * 1000
    for split in ("train", "test"):
        path = tmp_path / "data" / split / "a" / "0.tif"
        path.parent.mkdir(parents=True)
        PIL.fromarray(values).save(path)
    with pytest.raises(DatasetError) as err:
        load_dataset("imagefolder", tmp_path / "data", download=False, cache_dir=tmp_path / "c", channels=1)
    msg = str(err.value)
    assert msg.startswith(f"{tmp_path / 'data'}/test/a/0.tif: a 32-bit integer image (mode I) with values 0..63000")
    assert "8-bit" in msg and "cannot decode" not in msg
