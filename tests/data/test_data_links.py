"""Data stays inside ``data.root`` for every loader (issue 16): a file link leaving the root is refused.

Each case builds a tiny dataset in its official layout under ``tmp/root``, then
replaces one file the loader reads by a symbolic link: to a copy outside the
root (a DatasetError naming the link), to a copy inside the root (still
loads), to itself (a loop) or to nothing (a broken link): both clear
DatasetErrors, never an OSError traceback.
"""

from __future__ import annotations

import re
import shutil
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import hetfl.data.datasets as datasets_pkg
from hetfl.data.base import DatasetError
from hetfl.data.datasets import load_dataset, tree
from tests.helpers.datasets import (
    cifar_records,
    emnist_files,
    fake_rows,
    make_cifar10,
    make_mnist,
    make_release,
    make_split_folder,
    make_stl10,
    make_tinyimagenet,
    tar_folder,
)

pytest.importorskip("PIL.Image")

Build = Callable[[Path], tuple[str, Path, dict]]  # root -> (dataset, file to replace, options)


def _mnist(root: Path) -> tuple[str, Path, dict]:
    make_mnist(root, n_train=4, n_test=2)
    return "mnist", root / "train-images-idx3-ubyte.gz", {}


def _emnist(root: Path) -> tuple[str, Path, dict]:
    emnist_files(root / "gzip", "digits", np.zeros((2, 28, 28), np.uint8), np.array([1, 2], np.uint8))
    return "emnist", root / "gzip" / "emnist-digits-test-labels-idx1-ubyte.gz", {"split": "digits"}


def _cifar10_batches(root: Path) -> tuple[str, Path, dict]:
    make_cifar10(root / "cifar-10-batches-bin")
    return "cifar10", root / "cifar-10-batches-bin" / "data_batch_3.bin", {}


def _cifar10_archive(root: Path) -> tuple[str, Path, dict]:
    make_cifar10(root.parent / "build" / "cifar-10-batches-bin")
    root.mkdir()
    tar_folder(root.parent / "build" / "cifar-10-batches-bin", root / "cifar-10-binary.tar.gz", "cifar-10-batches-bin")
    return "cifar10", root / "cifar-10-binary.tar.gz", {}


def _cifar100(root: Path) -> tuple[str, Path, dict]:
    (root / "cifar-100-binary").mkdir(parents=True)
    (root / "cifar-100-binary" / "train.bin").write_bytes(cifar_records([(1, 2), (3, 4)], seed=1)[0])
    (root / "cifar-100-binary" / "test.bin").write_bytes(cifar_records([(5, 6)], seed=2)[0])
    return "cifar100", root / "cifar-100-binary" / "test.bin", {}


def _cifar10_folder(root: Path) -> tuple[str, Path, dict]:
    make_split_folder(root, {"cat": 100, "ship": 200}, per_split=(2, 1), size=(32, 32))
    return "cifar10", root / "train" / "cat" / "0001.png", {}


def _cinic10(root: Path) -> tuple[str, Path, dict]:
    make_split_folder(root, {"bird": 20, "ship": 80}, per_split=(2, 1), size=(32, 32))
    return "cinic10", root / "test" / "ship" / "0000.png", {}


def _stl10_folder(root: Path) -> tuple[str, Path, dict]:
    make_stl10(root / "stl10_binary", n_train=2, n_test=1)
    return "stl10", root / "stl10_binary" / "train_X.bin", {}


def _stl10_archive(root: Path) -> tuple[str, Path, dict]:
    make_stl10(root.parent / "build" / "stl10_binary", n_train=2, n_test=1)
    root.mkdir()
    tar_folder(root.parent / "build" / "stl10_binary", root / "stl10_binary.tar.gz", "stl10_binary")
    return "stl10", root / "stl10_binary.tar.gz", {}


def _tinyimagenet(root: Path) -> tuple[str, Path, dict]:
    make_tinyimagenet(root / "tiny-imagenet-200")
    return "tinyimagenet", root / "tiny-imagenet-200" / "train" / "n01" / "images" / "n01_1.JPEG", {"image_size": 8}


def _tinyimagenet_labels(root: Path) -> tuple[str, Path, dict]:
    make_tinyimagenet(root / "tiny-imagenet-200")
    return "tinyimagenet", root / "tiny-imagenet-200" / "val" / "val_annotations.txt", {"image_size": 8}


def _tinyimagenet_zip(root: Path) -> tuple[str, Path, dict]:
    make_tinyimagenet(root.parent / "build" / "tiny-imagenet-200")
    root.mkdir()
    with zipfile.ZipFile(root / "tiny-imagenet-200.zip", "w") as archive:
        for path in sorted((root.parent / "build").rglob("*")):
            archive.write(path, str(path.relative_to(root.parent / "build")))
    return "tinyimagenet", root / "tiny-imagenet-200.zip", {"image_size": 8}


def _ham_rows() -> list[list[str]]:
    return [row for i, row in enumerate(fake_rows()) if i % 4 == 0]


def _ham10000_image(root: Path) -> tuple[str, Path, dict]:
    make_release(root, _ham_rows(), zipped=False)
    return "ham10000", root / "HAM10000_images_part_2" / f"{_ham_rows()[-1][1]}.jpg", {"image_size": 8}


def _ham10000_metadata(root: Path) -> tuple[str, Path, dict]:
    make_release(root, _ham_rows())
    return "ham10000", root / "HAM10000_metadata.csv", {"image_size": 8}


def _ham10000_zip(root: Path) -> tuple[str, Path, dict]:
    make_release(root, _ham_rows())
    return "ham10000", root / "HAM10000_images_part_1.zip", {"image_size": 8}


CASES: dict[str, Build] = {
    "mnist": _mnist, "emnist": _emnist, "cifar10-batches": _cifar10_batches, "cifar10-archive": _cifar10_archive,
    "cifar100": _cifar100, "cifar10-folder": _cifar10_folder, "cinic10": _cinic10, "stl10-folder": _stl10_folder,
    "stl10-archive": _stl10_archive, "tinyimagenet-image": _tinyimagenet, "tinyimagenet-labels": _tinyimagenet_labels,
    "tinyimagenet-zip": _tinyimagenet_zip, "ham10000-image": _ham10000_image,
    "ham10000-metadata": _ham10000_metadata, "ham10000-zip": _ham10000_zip,
}


def _load(name: str, root: Path, cache: Path, options: dict):
    return load_dataset(name, root, download=False, cache_dir=cache, **options)


def _relink(path: Path, target: Path) -> Path:
    """Move ``path``'s file to ``target`` and put a symbolic link to it in its place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(path, target)
    path.symlink_to(target)
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_file_link_leaving_the_root_is_refused_and_inside_is_read(case, tmp_path):
    root = tmp_path / "root"
    name, victim, options = CASES[case](root)
    expected = _load(name, root, tmp_path / "c0", options)
    _relink(victim, root / ".kept" / victim.name)  # a hidden folder inside the root: not a sample itself
    inside = _load(name, root, tmp_path / "c1", options)
    assert np.array_equal(inside.train.x.numpy(), expected.train.x.numpy())
    assert np.array_equal(inside.test.y.numpy(), expected.test.y.numpy())
    victim.unlink()
    (tmp_path / "outside").mkdir()
    shutil.move(root / ".kept" / victim.name, tmp_path / "outside" / victim.name)
    victim.symlink_to(tmp_path / "outside" / victim.name)
    for cache in (tmp_path / "c2", tmp_path / "c1"):  # fresh, and a cache filled while the link stayed inside
        with pytest.raises(DatasetError) as err:
            _load(name, root, cache, options)
        assert str(victim) in str(err.value) and "outside data.root" in str(err.value)


@pytest.mark.parametrize("case", ["mnist", "cifar10-batches", "stl10-archive", "tinyimagenet-image",
                                  "ham10000-image", "ham10000-metadata"])
@pytest.mark.parametrize("kind", ["loop", "broken"])
def test_file_link_loop_or_broken_is_a_clear_error(case, kind, tmp_path):
    root = tmp_path / "root"
    name, victim, options = CASES[case](root)
    victim.unlink()
    victim.symlink_to(victim if kind == "loop" else tmp_path / "nowhere")
    with pytest.raises(DatasetError) as err:
        _load(name, root, tmp_path / "c", options)
    assert str(victim) in str(err.value)
    assert re.search("symbolic link loop" if kind == "loop" else "broken link", str(err.value))


@pytest.mark.parametrize("case", ["stl10-folder", "tinyimagenet-image", "ham10000-image", "emnist"])
def test_folder_link_leaving_the_root_is_refused(case, tmp_path):
    root = tmp_path / "root"
    name, victim, options = CASES[case](root)
    folder = victim.parent
    shutil.move(folder, tmp_path / "outside")
    folder.symlink_to(tmp_path / "outside", target_is_directory=True)
    with pytest.raises(DatasetError) as err:
        _load(name, root, tmp_path / "c", options)
    assert "outside data.root" in str(err.value) and str(folder) in str(err.value)


def test_emnist_never_extracts_outside_the_root(tmp_path):
    files = emnist_files(tmp_path / "src", "digits", np.zeros((2, 28, 28), np.uint8), np.array([1, 2], np.uint8))
    root = tmp_path / "root"
    root.mkdir()
    with zipfile.ZipFile(root / "gzip.zip", "w") as archive:
        for member, data in files.items():
            archive.writestr(f"gzip/{member}", data)
    (tmp_path / "elsewhere").mkdir()
    (root / "gzip").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(DatasetError) as err:
        _load("emnist", root, tmp_path / "c", {"split": "digits"})
    assert str(root / "gzip") in str(err.value) and "outside data.root" in str(err.value)
    assert not list((tmp_path / "elsewhere").iterdir())


def test_archive_members_are_read_never_extracted(tmp_path):
    """A tar member named ``../escape`` and a link member are skipped, plain members read as bytes; nothing
    is written anywhere."""
    archive = tmp_path / "root" / "data.tar"
    archive.parent.mkdir()
    (tmp_path / "payload").write_bytes(b"abc")
    with tarfile.open(archive, "w") as tar:
        tar.add(tmp_path / "payload", arcname="../escape")
        tar.add(tmp_path / "payload", arcname="a/ok")
        link = tarfile.TarInfo("a/link")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert list(tree.walk(archive, lambda parts: True, root=archive.parent)) == [(("a", "ok"), b"abc")]
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_every_loader_opens_files_through_the_guarded_helpers():
    """No dataset module reads a file under data.root by itself: only ``paths`` does (``tree`` opens the
    archive ``paths.guard`` checked; ``download``/``cache`` touch only their own downloads and cache)."""
    folder = Path(datasets_pkg.__file__).parent
    allowed = {"paths.py", "download.py", "cache.py"}
    for module in sorted(folder.glob("*.py")):
        if module.name in allowed:
            continue
        text = module.read_text()
        assert not re.search(r"\.read_bytes\(|\.read_text\(|(?<![\w.])open\(|os\.walk\(", text), module.name
