"""A folder tree, a tar or a zip read alike (hetfl.data.datasets.tree): the refusal of a damaged archive word for
word, member names as a dataset expects them, hidden and macOS entries skipped in archives too, follow_links honoured
for an archive, and the common top folders an image tree drops. (tests/data/test_damaged_files.py has the kinds of
damage.)"""

from __future__ import annotations

import io
import tarfile
import zipfile

import pytest

from hetfl.data.base import DatasetError
from hetfl.data.datasets import tree
from tests.data.test_damaged_files import damaged_header_tar, tar_bytes


def walk_all(archive, root, **kwargs) -> dict:
    return dict(tree.walk(archive, lambda parts: True, root=root, **kwargs))


def test_a_damaged_tar_header_is_refused_naming_the_archive_and_the_byte(tmp_path):
    archive = tmp_path / "data.tar"
    archive.write_bytes(damaged_header_tar(member=5))
    with pytest.raises(DatasetError) as err:
        walk_all(archive, tmp_path)
    assert str(err.value).startswith(f"{archive}: unreadable or corrupt archive (ReadError: damaged member header at "
                                     f"byte {5 * 3 * 512}: ")
    assert str(err.value).endswith("; replace it with a complete copy")


def test_absolute_and_dotted_member_names_are_read_relative_to_the_archive(tmp_path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name in ("/train/cat/1.png", "./train/dog/2.png"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    (tmp_path / "data.tar").write_bytes(buffer.getvalue())
    assert sorted(walk_all(tmp_path / "data.tar", tmp_path)) == [("train", "cat", "1.png"), ("train", "dog", "2.png")]


def test_hidden_and_macos_entries_of_an_archive_are_skipped(tmp_path):
    names = ("train/cat/1.png", "__MACOSX/train/cat/._1.png", "train/.DS_Store", "train/__MACOSX/x.png")
    with zipfile.ZipFile(tmp_path / "data.zip", "w") as archive:
        for name in names:
            archive.writestr(name, b"x")
    assert list(walk_all(tmp_path / "data.zip", tmp_path)) == [("train", "cat", "1.png")]
    (tmp_path / "data.tar").write_bytes(tar_bytes(dict.fromkeys(names, b"x")))
    assert list(walk_all(tmp_path / "data.tar", tmp_path)) == [("train", "cat", "1.png")]


def test_an_archive_linked_from_outside_is_read_when_links_are_followed(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "data.tar").write_bytes(tar_bytes({"a/1.bin": b"x"}))
    (root / "data.tar").symlink_to(tmp_path / "data.tar")
    assert walk_all(root / "data.tar", root, follow_links=True) == {("a", "1.bin"): b"x"}
    with pytest.raises(DatasetError, match="outside data.root"):
        walk_all(root / "data.tar", root, follow_links=False)


@pytest.mark.parametrize(("paths", "min_depth", "strip"), [
    ([("cifar10-jpeg", "train", "cat", "1.jpg"), ("cifar10-jpeg", "test", "dog", "2.jpg")], 3, 1),
    ([("a", "b", "train", "cat", "1.jpg"), ("a", "b", "test", "dog", "2.jpg")], 3, 2),
    ([("train", "cat", "1.jpg"), ("test", "dog", "2.jpg")], 3, 0),  # nothing common
    ([("x", "train", "cat", "1.jpg"), ("x", "cat", "2.jpg")], 3, 0),  # one path would be left too short
    ([("x", "y", "1.jpg"), ("x", "y", "2.jpg")], 3, 0),  # exactly min_depth: kept whole
    ([("x", "y", "z", "1.jpg")], 2, 2),
    ([], 3, 0),
])
def test_the_common_top_folders_dropped_keep_every_path_at_least_min_depth_deep(paths, min_depth, strip):
    assert tree.strip_common_top(paths, min_depth) == strip
