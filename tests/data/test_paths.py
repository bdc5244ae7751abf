"""Data stays inside data.root (hetfl.data.datasets.paths): each refusal word for word, naming the path and what to
do; hidden entries skipped; data.options.follow_links honoured by every entry point. (tests/data/test_data_links.py
and tests/test_bad_input.py have the links through the loaders.)"""

from __future__ import annotations

import errno

import pytest

from hetfl.data.base import DatasetError
from hetfl.data.datasets import paths


def refusal(call, *args, **kwargs) -> str:
    with pytest.raises(DatasetError) as err:
        call(*args, **kwargs)
    return str(err.value)


def test_a_missing_file_and_a_broken_link_are_named_as_such(tmp_path):
    missing = tmp_path / "missing.bin"
    assert refusal(paths.guard, missing, tmp_path) == (f"{missing}: not found (a broken link?) in data.root; remove "
                                                       "it or make it point to a file inside data.root")
    broken = tmp_path / "broken.bin"
    broken.symlink_to("nowhere.bin")
    assert refusal(paths.guard, broken, tmp_path) == (f"{broken}: a broken link (to 'nowhere.bin') in data.root; "
                                                      "remove it or make it point to a file inside data.root")


def test_a_link_loop_is_named_as_one(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    assert refusal(paths.guard, tmp_path / "a", tmp_path) == (f"{tmp_path / 'a'}: a symbolic link loop in data.root; "
                                                              "remove the link")


@pytest.mark.parametrize("error", [RuntimeError("Symlink loop"), OSError(errno.ELOOP, "Too many levels of links")],
                         ids=["RuntimeError", "ELOOP"])
def test_a_loop_is_named_as_one_however_python_reports_it(tmp_path, monkeypatch, error):
    """``Path.resolve(strict=True)`` reports a link loop as a RuntimeError before Python 3.13 and as an OSError
    (ELOOP) from 3.13 on: the same refusal either way."""
    link = tmp_path / "a"
    link.symlink_to(tmp_path / "a")
    resolve = type(link).resolve

    def resolve_reporting(self, strict=False):
        if strict and self == link:
            raise error
        return resolve(self, strict)

    monkeypatch.setattr(type(link), "resolve", resolve_reporting)
    assert refusal(paths.link_target, link, tmp_path, None) == f"{link}: a symbolic link loop in data.root; remove " \
                                                               "the link"


def test_a_link_leaving_the_root_says_how_to_read_it_only_where_the_loader_offers_it(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside.bin"
    root.mkdir()
    outside.write_bytes(b"x")
    link = root / "link.bin"
    link.symlink_to(outside)
    plain = (f"{link}: a symbolic link to {outside}, outside data.root ({root}); hetfl reads only files inside "
             "data.root; copy the file in")
    assert refusal(paths.guard, link, root) == plain
    assert refusal(paths.guard, link, root, False) == (plain + ", or set data.options.follow_links = true to read "
                                                       "linked files wherever they are")
    assert paths.read_file(link, root, True) == b"x"


def test_a_path_that_cannot_be_read_is_named_with_the_reason(tmp_path):
    (tmp_path / "folder").mkdir()
    assert refusal(paths.read_file, tmp_path / "folder", tmp_path) == f"{tmp_path / 'folder'}: cannot be read (Is a " \
                                                                        "directory)"
    (tmp_path / "file").write_bytes(b"x")
    assert refusal(paths.list_folder, tmp_path / "file", tmp_path) == f"{tmp_path / 'file'}: cannot be listed (Not " \
                                                                        "a directory)"


def test_hidden_entries_and_macos_folders_are_not_listed(tmp_path):
    for name in (".hetfl-cache/x.bin", "._a.png", "__MACOSX/a.png", "a/b.png", "c.png"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    assert [parts for parts, _ in paths.list_folder(tmp_path, tmp_path)] == [("a", "b.png"), ("c.png",)]


def test_a_folder_link_back_to_an_ancestor_is_a_loop_naming_where_it_leads(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "up").symlink_to(tmp_path / "d", target_is_directory=True)
    assert refusal(paths.list_folder, tmp_path, tmp_path) == (f"{tmp_path / 'd' / 'up'}: a symbolic link loop in "
                                                              f"data.root (it leads back to {tmp_path / 'd'}); remove "
                                                              "the link")


def test_follow_links_is_honoured_for_a_linked_source_folder(tmp_path):
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (elsewhere / "a.png").write_bytes(b"x")
    (root / "images").symlink_to(elsewhere, target_is_directory=True)
    assert [parts for parts, _ in paths.list_folder(root / "images", root, True)] == [("a.png",)]
    paths.check_source(root / "images", root, True)
    assert "outside data.root" in refusal(paths.check_source, root / "images", root, False)
    assert "outside data.root" in refusal(paths.list_folder, root / "images", root)
