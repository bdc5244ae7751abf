"""Image folders (hetfl.data.datasets.imagefolder): the per-(domain, class) split of the domain layout, class folders
checked against the classes asked for, and the refusals word for word. (tests/data/test_datasets.py has both layouts
end to end.)"""

from __future__ import annotations

import re

import numpy as np
import pytest

from hetfl.data.base import DatasetError
from hetfl.data.datasets import imagefolder, load_dataset
from hetfl.data.datasets.common import Context
from tests.helpers.datasets import make_split_folder, solid, write_png


def domain_arrays(sizes: dict[tuple[int, int], int]) -> dict[str, np.ndarray]:
    """``{(domain, class): n}`` -> the arrays of :func:`imagefolder.domain_arrays` with ``x`` = sample index."""
    y = np.concatenate([np.full(n, c) for (_, c), n in sizes.items()]).astype(np.int64)
    g = np.concatenate([np.full(n, d) for (d, _), n in sizes.items()]).astype(np.int64)
    return {"x": np.arange(len(y)), "y": y, "g": g, "domains": np.asarray(["a", "b", "c"])}


SIZES = {(0, 0): 5, (0, 1): 10, (0, 2): 15, (1, 0): 7, (1, 2): 4, (2, 1): 6}


def test_each_domain_and_class_puts_its_rounded_share_into_test():
    arrays = domain_arrays(SIZES)
    out = imagefolder.split_domains(arrays, ["c", "a"], 0.2, seed=3)
    test, train = out["test_x"], out["train_x"]
    assert len(np.intersect1d(test, train)) == 0
    chosen = np.flatnonzero(np.isin(arrays["g"], [2, 0]))
    assert np.array_equal(np.sort(np.concatenate([train, test])), chosen)
    for (d, c), n in SIZES.items():
        if d == 1:
            continue
        in_test = np.sum((arrays["g"][test] == d) & (arrays["y"][test] == c))
        assert in_test == round(0.2 * n), (d, c)
    assert set(out["test_g"][arrays["g"][test] == 2]) == {0} and set(out["train_g"][arrays["g"][train] == 0]) == {1}
    assert np.array_equal(out["test_y"], arrays["y"][test]) and np.all(np.diff(test) > 0)


def test_a_domains_split_does_not_depend_on_the_other_domains_chosen():
    arrays = domain_arrays(SIZES)
    alone = imagefolder.split_domains(arrays, ["a"], 0.3, seed=1)["test_x"]
    with_others = imagefolder.split_domains(arrays, ["b", "a", "c"], 0.3, seed=1)["test_x"]
    assert np.array_equal(alone, with_others[arrays["g"][with_others] == 0])
    assert not np.array_equal(alone, imagefolder.split_domains(arrays, ["a"], 0.3, seed=2)["test_x"])


def test_class_folders_outside_the_classes_asked_for_are_refused(tmp_path):
    entries = [(("train", "cat", "1.png"), np.zeros((3, 2, 2), np.uint8)),
               (("test", "cat", "2.png"), np.zeros((3, 2, 2), np.uint8)),
               (("test", "horse2", "3.png"), np.zeros((3, 2, 2), np.uint8))]
    with pytest.raises(DatasetError) as err:
        imagefolder.split_arrays(entries, tmp_path, (2, 2), classes=("cat", "dog"))
    assert str(err.value) == f"{tmp_path}: unexpected class folders ['horse2']; expected cat, dog"


def test_a_split_layout_without_a_test_split_names_what_it_found(tmp_path):
    entries = [(("train", "cat", "1.png"), np.zeros((3, 2, 2), np.uint8))]
    with pytest.raises(DatasetError) as err:
        imagefolder.split_arrays(entries, tmp_path, (2, 2))
    assert str(err.value) == (f"{tmp_path}: expected images under train/<class>/ and {{test,val}}/<class>/ (found top "
                              "folders: ['train'])")


def test_an_empty_domain_tree_is_refused_naming_the_layout(tmp_path):
    with pytest.raises(DatasetError) as err:
        imagefolder.domain_arrays([], tmp_path, None)
    assert str(err.value) == f"{tmp_path}: no images found; expected {tmp_path}/<domain>/<class>/<image>"


def test_the_loaders_refusals_name_the_root_and_what_belongs_there(tmp_path):
    missing = tmp_path / "missing"  # load_dataset says so first; the loader itself too, called on its own
    with pytest.raises(DatasetError) as err:
        imagefolder.load_imagefolder(Context("imagefolder", missing, False, tmp_path / "c", 0), "auto", (), 0, 3, 0.2)
    assert str(err.value) == (f"imagefolder: data.root = {str(missing)!r} does not exist; set it to the folder with "
                              "<train|test>/<class>/<image> or <domain>/<class>/<image> files")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError) as err:
        load_dataset("imagefolder", tmp_path / "empty", download=False, cache_dir=tmp_path / "c", layout="split")
    empty = tmp_path / "empty"
    assert str(err.value) == (f"imagefolder: no image tree in {empty}; expected {empty}/<train|test>/<class>/<image> "
                              f"or {empty}/<domain>/<class>/<image> (or a .tar/.tar.gz/.zip of it); put the images "
                              "there or set data.root to their folder")
    make_split_folder(tmp_path / "split", {"cat": 10})
    with pytest.raises(DatasetError) as err:
        load_dataset("imagefolder", tmp_path / "split", download=False, cache_dir=tmp_path / "c", domains=["a"])
    assert str(err.value) == (f"data.options.domains = ['a']: {tmp_path / 'split'} has the split layout (train/test), "
                              "not domains; remove the option")


def test_a_split_folder_is_named_and_noted_with_its_source(tmp_path):
    make_split_folder(tmp_path / "split", {"cat": 10})
    ds = load_dataset("imagefolder", tmp_path / "split", download=False, cache_dir=tmp_path / "c")
    assert ds.info.name == "imagefolder" and ds.notes == [f"imagefolder from {tmp_path / 'split'}"]


def test_a_domain_dataset_that_differs_from_its_paper_says_how(tmp_path):
    for domain in ("photo", "sketch"):
        write_png(tmp_path / "pacs" / domain / "dog" / "0.png", solid(3, (8, 8)))
    ds = load_dataset("pacs", tmp_path / "pacs", download=False, cache_dir=tmp_path / "c", image_size=8)
    assert ds.notes[-1] == ("pacs: expected domains ['art_painting', 'cartoon', 'photo', 'sketch'] and 7 classes, "
                            "found ['photo', 'sketch'] and 1")
    with pytest.raises(DatasetError) as err:
        load_dataset("pacs", tmp_path / "pacs", download=False, cache_dir=tmp_path / "c", image_size=8,
                     domains=["cartoon"])
    assert str(err.value) == (f"data.options.domains = ['cartoon']: ['cartoon'] not in {tmp_path / 'pacs'}; "
                              "available: ['photo', 'sketch']")


def test_two_image_trees_in_data_root_are_refused_naming_both(tmp_path):
    for name in ("a", "b"):
        make_split_folder(tmp_path / "root" / name, {"cat": 10})
    with pytest.raises(DatasetError) as err:  # (with layout auto, a and b would be two domains)
        load_dataset("imagefolder", tmp_path / "root", download=False, cache_dir=tmp_path / "c", layout="split")
    assert str(err.value) == f"{tmp_path / 'root'} holds several image trees (a, b); set data.root to the one to use"


def test_files_that_are_not_images_and_stray_top_level_images_are_left_out(tmp_path):
    make_split_folder(tmp_path / "split", {"cat": 10})
    (tmp_path / "split" / "train" / "cat" / "README.txt").write_text("not an image")
    write_png(tmp_path / "split" / "stray.png", solid(1, (8, 8)))
    ds = load_dataset("imagefolder", tmp_path / "split", download=False, cache_dir=tmp_path / "c")
    assert len(ds.train) == 3 and len(ds.test) == 2
    for domain in ("photo", "sketch"):
        write_png(tmp_path / "dom" / domain / "dog" / "0.png", solid(3, (8, 8)))
    write_png(tmp_path / "dom" / "stray.png", solid(1, (8, 8)))
    assert load_dataset("imagefolder", tmp_path / "dom", download=False, cache_dir=tmp_path / "c").info.groups == (
        "photo", "sketch")


def test_without_an_image_size_the_first_training_image_sets_it(tmp_path):
    write_png(tmp_path / "split" / "train" / "cat" / "0.png", solid(1, (6, 8)))
    write_png(tmp_path / "split" / "train" / "cat" / "1.png", solid(2, (8, 10)))
    write_png(tmp_path / "split" / "test" / "cat" / "0.png", solid(3, (4, 4)))
    ds = load_dataset("imagefolder", tmp_path / "split", download=False, cache_dir=tmp_path / "c")
    assert ds.train.x.shape == (2, 3, 6, 8) and ds.test.x.shape == (1, 3, 6, 8)


def test_a_domain_named_train_is_a_domain_and_an_explicit_layout_is_kept(tmp_path):
    for domain in ("photo", "train"):
        write_png(tmp_path / "dom" / domain / "dog" / "0.png", solid(3, (8, 8)))
    ds = load_dataset("imagefolder", tmp_path / "dom", download=False, cache_dir=tmp_path / "c")
    assert ds.info.groups == ("photo", "train")
    make_split_folder(tmp_path / "split", {"cat": 10})
    ds = load_dataset("imagefolder", tmp_path / "split", download=False, cache_dir=tmp_path / "c2", layout="domain")
    assert ds.info.groups == ("test", "train")


def test_the_loader_on_its_own_refuses_links_leaving_data_root(tmp_path):
    make_split_folder(tmp_path / "elsewhere", {"cat": 10})
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "tree").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(DatasetError, match="outside data.root"):
        imagefolder.load_imagefolder(Context("imagefolder", tmp_path / "root", False, tmp_path / "c", 0), "auto", (),
                                     0, 3, 0.2)


def test_a_domain_dataset_as_its_paper_describes_it_gets_no_note_and_one_class_short_gets_one(tmp_path):
    domains = ("art_painting", "cartoon", "photo", "sketch")
    for domain in domains:
        for c in range(7):
            write_png(tmp_path / "pacs" / domain / f"class{c}" / "0.png", solid(c, (4, 4)))
    ds = load_dataset("pacs", tmp_path / "pacs", download=False, cache_dir=tmp_path / "c", image_size=4)
    assert ds.notes == [f"pacs from {tmp_path / 'pacs'}"]
    for domain in domains:
        (tmp_path / "pacs" / domain / "class6" / "0.png").unlink()
        (tmp_path / "pacs" / domain / "class6").rmdir()
    ds = load_dataset("pacs", tmp_path / "pacs", download=False, cache_dir=tmp_path / "c2", image_size=4)
    assert ds.notes[-1].endswith("found ['art_painting', 'cartoon', 'photo', 'sketch'] and 6")


def test_long_lists_in_refusals_are_cut_to_their_first_entries(tmp_path):
    image = np.zeros((3, 2, 2), np.uint8)
    tops = [((f"top{i}", "cat", "1.png"), image) for i in range(10)] + [(("train", "cat", "1.png"), image)]
    with pytest.raises(DatasetError) as err:
        imagefolder.split_arrays(tops, tmp_path, (2, 2))
    assert str(err.value).endswith(f"(found top folders: {sorted(['train', *(f'top{i}' for i in range(10))])[:8]})")
    classes = [(("train", f"c{i}", "1.png"), image) for i in range(8)] + [(("test", "c0", "1.png"), image)]
    with pytest.raises(DatasetError) as err:
        imagefolder.split_arrays(classes, tmp_path, (2, 2), classes=("c0",))
    assert str(err.value) == f"{tmp_path}: unexpected class folders ['c1', 'c2', 'c3', 'c4', 'c5']; expected c0"


def test_hidden_folders_and_plain_files_at_the_root_are_no_image_trees(tmp_path):
    make_split_folder(tmp_path / "root" / "data", {"cat": 10})
    make_split_folder(tmp_path / "root" / ".cache", {"dog": 20})
    ds = load_dataset("imagefolder", tmp_path / "root", download=False, cache_dir=tmp_path / "c", layout="split")
    assert ds.info.classes == ("cat",)
    (tmp_path / "bare" / ".hidden").mkdir(parents=True)
    (tmp_path / "bare" / "README").write_text("no images here")
    with pytest.raises(DatasetError, match=r"^imagefolder: no image tree in "):
        load_dataset("imagefolder", tmp_path / "bare", download=False, cache_dir=tmp_path / "c")


def test_an_archive_given_as_data_root_is_the_tree_unless_excluded(tmp_path):
    archive = tmp_path / "tree.tar"
    archive.write_bytes(b"")  # is_archive goes by the name; nothing is read here
    assert imagefolder.find_source(archive, needs_train=True) == archive
    assert imagefolder.find_source(archive, needs_train=True, exclude=lambda p: p == archive) is None


def test_read_images_decodes_at_the_size_asked_for_inside_its_own_folder_by_default(tmp_path):
    write_png(tmp_path / "tree" / "train" / "cat" / "0.png", solid(7, (6, 10)))
    entries = imagefolder.read_images(tmp_path / "tree", 3, (4, 5))  # no root: the folder itself is the boundary
    assert [(parts, image.shape) for parts, image in entries] == [(("train", "cat", "0.png"), (3, 4, 5))]
    assert imagefolder.read_images(tmp_path / "tree", 1, None)[0][1].shape == (1, 6, 10)


def test_links_that_leave_the_tree_but_stay_inside_data_root_are_followed(tmp_path):
    make_split_folder(tmp_path / "root" / "tree", {"cat": 10})
    write_png(tmp_path / "root" / "extra" / "dog.png", solid(200, (8, 8)))
    (tmp_path / "root" / "tree" / "train" / "cat" / "linked.png").symlink_to(tmp_path / "root" / "extra" / "dog.png")
    ds = imagefolder.load_imagefolder(Context("imagefolder", tmp_path / "root", False, tmp_path / "c", 0), "split",
                                      (), 0, 3, 0.2)
    assert len(ds.train) == 4 and ds.notes == [f"imagefolder from {tmp_path / 'root' / 'tree'}"]


def test_the_loaders_own_refusals_of_a_tree_name_the_tree(tmp_path):
    make_split_folder(tmp_path / "root" / "tree", {"cat": 10})
    for image in (tmp_path / "root" / "tree" / "test").rglob("*.png"):
        image.unlink()
    tree = tmp_path / "root" / "tree"
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(tree))}: expected images under train/<class>/"):
        imagefolder.load_imagefolder(Context("imagefolder", tmp_path / "root", False, tmp_path / "c", 0), "split",
                                     (), 0, 3, 0.2)
    (tmp_path / "bare" / "domain" / "cat").mkdir(parents=True)
    with pytest.raises(DatasetError, match="^" + re.escape(f"{tmp_path / 'bare'}: no images found")):
        imagefolder.load_imagefolder(Context("imagefolder", tmp_path / "bare", False, tmp_path / "c", 0), "domain",
                                     (), 0, 3, 0.2)


def test_published_normalisation_constants_are_kept(tmp_path):
    make_split_folder(tmp_path / "split", {"cat": 10})
    norm = ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    ds = imagefolder.load_imagefolder(Context("imagefolder", tmp_path / "split", False, tmp_path / "c", 0), "auto",
                                      (), 0, 3, 0.2, norm=norm)
    assert (ds.info.mean, ds.info.std) == norm
