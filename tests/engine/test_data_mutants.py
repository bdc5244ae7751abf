"""FederatedData by hand (session 38, mutation testing of hetfl.engine.data): the clients' test splits and
accuracies, label permutations and rotations, the augmentation's resolution and draws, a stage's batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetfl.config import ConfigError
from hetfl.data.augment import augment_params, crop_starts, rotate
from hetfl.data.base import Dataset, DatasetInfo, Split
from hetfl.data.partition import Partition
from hetfl.engine.data import FederatedData

CPU = torch.device("cpu")


def _features(partition: Partition) -> tuple[FederatedData, Dataset]:
    x = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])
    info = DatasetInfo("feat", ("a", "b", "c"), (4,), None, None)
    dataset = Dataset(info, Split(x, y), Split(x[:8] + 100, y[:8]))
    return FederatedData(dataset, partition, CPU, "auto"), dataset


def test_client_test_splits_and_accuracies_by_hand():
    part = Partition([np.arange(0, 6), np.arange(6, 10), np.array([], dtype=np.int64)],
                     [np.arange(2, 5), np.array([0, 5, 7]), np.array([], dtype=np.int64)])
    fd, ds = _features(part)
    assert fd.augment == "none" and fd.padding == 0 and fd.num_clients == 3 and fd.client_sizes == [6, 4, 0]
    assert torch.equal(fd.client_tests[0].x, ds.test.x[2:5]) and torch.equal(fd.client_tests[1].y, ds.test.y[[0, 5, 7]])
    assert fd.client_tests[2].x.shape[0] == 0
    correct = torch.tensor([1, 0, 1, 1, 0, 1, 0, 1], dtype=torch.bool)
    # client 0: samples 2, 3, 4 -> 2/3; client 1: samples 0, 5, 7 -> 3/3; client 2 holds no test sample
    assert fd.client_test_accuracies(correct) == {0: pytest.approx(2 / 3), 1: 1.0}
    assert fd.client_test_accuracies(~correct) == {0: pytest.approx(1 / 3), 1: 0.0}  # the cached segments again
    # the same floats as each client's float32 mean (not float64's 2/3)
    assert fd.client_test_accuracies(correct)[0] == correct[2:5].float().mean().item() != 2 / 3
    x, y = fd.client_train_split(1)
    assert torch.equal(x, ds.train.x[6:10]) and torch.equal(y, ds.train.y[6:10])
    assert torch.equal(fd.global_indices(1, torch.tensor([3, 0])), torch.tensor([9, 6]))


def test_a_view_only_for_one_ascending_run():
    fd, ds = _features(Partition([np.arange(10)], [np.array([1, 3, 4])]))
    assert torch.equal(fd._client_view(np.array([1, 3, 4])).x, ds.test.x[[1, 3, 4]])
    assert torch.equal(fd._client_view(np.array([4, 5, 6])).y, ds.test.y[4:7])
    assert torch.equal(fd._client_view(np.array([2, 2, 4])).x, ds.test.x[[2, 2, 4]])  # first..last spans 3, not a run
    assert fd._client_view(np.array([], dtype=np.int64)).x.shape[0] == 0
    base = fd.test_x.untyped_storage().data_ptr()
    assert fd._client_view(np.array([4, 5, 6])).x.untyped_storage().data_ptr() == base  # a view, not a copy
    assert fd._client_view(np.array([0])).y.untyped_storage().data_ptr() == fd.test_y.untyped_storage().data_ptr()
    for gathered in ([1, 3, 4], [2, 2, 4], [4, 5, 7], [3, 4, 6, 7]):
        assert fd._client_view(np.array(gathered)).x.untyped_storage().data_ptr() != base


def test_permuted_labels_in_training_and_test():
    perm = [np.array([0, 1, 2]), np.array([2, 0, 1])]
    part = Partition([np.arange(0, 5), np.arange(5, 10)], [np.arange(0, 4), np.arange(4, 8)], label_perm=perm)
    fd, ds = _features(part)
    assert fd.transformed
    assert torch.equal(fd.train_y[:5], ds.train.y[:5])
    assert torch.equal(fd.train_y[5:], torch.tensor(perm[1])[ds.train.y[5:]])
    assert torch.equal(fd.client_tests[1].y, torch.tensor(perm[1])[ds.test.y[4:8]])
    assert torch.equal(fd.test_y, torch.cat([ds.test.y[:4], torch.tensor(perm[1])[ds.test.y[4:8]]]))
    assert torch.equal(fd.test_x, ds.test.x[:8])
    assert torch.equal(ds.train.y, torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0]))  # the dataset itself untouched


def _images(augment: str, shape=(3, 32, 32), rotation=None) -> tuple[FederatedData, Dataset]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (8, *shape), dtype=torch.uint8, generator=gen)
    y = torch.randint(0, 10, (8,), generator=gen)
    info = DatasetInfo("img", tuple(str(i) for i in range(10)), shape, (0.5,) * shape[0], (0.25,) * shape[0])
    ds = Dataset(info, Split(x.clone(), y), Split(x[:4].clone(), y[:4]))
    part = Partition([np.arange(0, 4), np.arange(4, 8)], [np.arange(0, 2), np.arange(2, 4)], rotation=rotation)
    return FederatedData(ds, part, CPU, augment), ds


@pytest.mark.parametrize(("shape", "want"), [((3, 32, 32), "crop_flip"), ((3, 96, 96), "crop_flip"),
                                             ((3, 31, 31), "none"), ((3, 97, 97), "none"), ((1, 32, 32), "none")])
def test_auto_augments_rgb_images_of_32_to_96_pixels(shape, want):
    fd, _ = _images("auto", shape)
    assert fd.augment == want and fd.padding == shape[-1] // 8


def test_augmenting_feature_vectors_is_refused_by_name():
    part = Partition([np.arange(10)], [np.arange(8)])
    x = torch.zeros(10, 4)
    info = DatasetInfo("feat", ("a", "b"), (4,), None, None)
    y = torch.zeros(10, dtype=torch.long)
    with pytest.raises(ConfigError) as refused:
        FederatedData(Dataset(info, Split(x, y), Split(x, y)), part, CPU, "flip")
    assert str(refused.value) == "data.augment = 'flip': needs image data; feat has feature vectors"


@pytest.mark.parametrize(("shape", "want"), [((3, 20, 40), "crop_flip"), ((3, 40, 20), "none")])
def test_auto_decides_by_the_images_width(shape, want):
    """``auto`` reads the width (the last axis), not the height: a wide RGB image of 40 columns and 20 rows is
    augmented (padded by 40 // 8), a tall one of 20 columns is not."""
    fd, _ = _images("auto", shape)
    assert fd.augment == want and fd.padding == shape[-1] // 8


@pytest.mark.parametrize(("width", "padding"), [(4, 1), (8, 1), (15, 1), (16, 2), (28, 3)])
def test_small_images_are_padded_by_one_pixel_at_least(width, padding):
    """The crop's padding is an eighth of the width (4 pixels at 32), never below 1 pixel: an image narrower
    than 16 pixels is padded by exactly 1, its crops shifted by at most one pixel either way."""
    fd, _ = _images("crop_flip", (1, width, width))
    assert fd.padding == padding
    starts = fd.augment_draws(400, torch.Generator().manual_seed(0))
    dx, dy, flips = augment_params(400, padding, True, torch.Generator().manual_seed(0))
    assert torch.equal(starts, crop_starts(dx, dy, flips, width))
    assert int(dx.max()) == 2 * padding and int(dy.max()) == 2 * padding


@pytest.mark.parametrize("augment", ["crop_flip", "flip"])
def test_augment_draws_are_augment_params_on_one_stream(augment):
    fd, _ = _images(augment)
    got = fd.augment_draws(5, torch.Generator().manual_seed(3))
    dx, dy, flips = augment_params(5, 4, True, torch.Generator().manual_seed(3))
    if augment == "flip":
        dx, dy = torch.zeros_like(dx), torch.zeros_like(dy)
    assert torch.equal(got, crop_starts(dx, dy, flips, 32))
    assert fd.stage_augment([], torch.Generator()) is None
    assert torch.equal(fd.stage_augment([2, 3], torch.Generator().manual_seed(3)), got)
    assert _images("none")[0].augment_draws(5, torch.Generator()) is None


def test_a_stages_batches_are_its_draws_split_by_batch():
    fd, ds = _images("crop_flip")
    schedule = [torch.tensor([3, 0]), torch.tensor([1, 2, 3])]
    batches = list(fd.train_batches(1, schedule, torch.Generator().manual_seed(5)))
    every = fd.stage_augment([2, 3], torch.Generator().manual_seed(5))
    for b, local, aug in zip(batches, schedule, every.split([2, 3], dim=1), strict=True):
        ref = fd.batch_at(fd.global_indices(1, local), aug)
        assert torch.equal(b.x, ref.x) and torch.equal(b.y, ds.train.y[local + 4])
    plain, _ = _images("none")
    b, c = plain.train_batches(0, [torch.tensor([2, 1]), torch.tensor([0])], torch.Generator())
    assert torch.equal(b.x, plain.prepare(ds.train.x[[2, 1]])) and torch.equal(b.y, ds.train.y[[2, 1]])
    assert torch.equal(c.x, plain.prepare(ds.train.x[[0]]))


def test_rotated_clients_train_and_test_on_rotated_images():

    fd, ds = _images("none", rotation=[0.0, 90.0])
    assert fd.transformed
    assert torch.equal(fd.train_x[:4], ds.train.x[:4])
    assert torch.equal(fd.train_x[4:], rotate(ds.train.x[4:], 90.0))
    assert torch.equal(fd.client_tests[1].x, rotate(ds.test.x[2:4], 90.0))
    assert torch.equal(fd.client_tests[0].x, ds.test.x[:2])


def test_the_crops_of_wide_images_run_along_their_width():
    fd, _ = _images("crop_flip", shape=(3, 16, 24))
    got = fd.augment_draws(4, torch.Generator().manual_seed(2))
    dx, dy, flips = augment_params(4, 3, True, torch.Generator().manual_seed(2))
    assert torch.equal(got, crop_starts(dx, dy, flips, 24))


META = torch.device("meta")  # tensors without storage: a CPU stands in for a GPU in where each tensor is held


@pytest.mark.parametrize("rotation", [None, [0.0, 90.0]])
@pytest.mark.parametrize(("augment", "prepared"), [("crop_flip", True), ("crop_flip", False), ("none", False)])
def test_everything_a_step_reads_is_held_on_the_device(rotation, augment, prepared):
    """DESIGN.md property 4 (and issue 29's host-free step): the training and test tensors, the normalisation,
    the crop grid and the clients' indices live on the run's device, moved there once; only the index lists the
    host assembles a step's batches from stay on the CPU. On the ``meta`` device, so that a tensor left on the
    CPU (a ``.to(device)`` dropped) shows without a GPU; a client's test split that is a gather (client 1: test
    samples 0 and 3) included."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8, generator=gen)
    y = torch.randint(0, 10, (8,), generator=gen)
    info = DatasetInfo("img", tuple(str(i) for i in range(10)), (3, 32, 32), (0.5,) * 3, (0.25,) * 3)
    ds = Dataset(info, Split(x, y), Split(x[:4].clone(), y[:4]))
    part = Partition([np.arange(0, 4), np.arange(4, 8)], [np.arange(0, 2), np.array([0, 3])], rotation=rotation)
    fd = FederatedData(ds, part, META, augment, prepared=prepared)
    held = {name: value for name, value in vars(fd).items() if isinstance(value, torch.Tensor)}
    assert set(held) == {"train_x", "train_y", "test_x", "test_y", "_mean", "_std", "_source", "_interior"}
    assert {name: value.device for name, value in held.items()} == dict.fromkeys(held, META)
    assert all(t.x.device == META and t.y.device == META for t in fd.client_tests)
    assert [idx.device for idx in fd.client_train] == [META, META]
    assert [idx.device.type for idx in fd.client_train_cpu] == ["cpu", "cpu"]
    assert fd._grid is None if augment == "none" else all(g.device == META for g in fd._grid)
    schedule = [torch.tensor([3, 0]), torch.tensor([1])]
    for batch in fd.train_batches(1, schedule, torch.Generator().manual_seed(0)):
        assert batch.x.device == META and batch.y.device == META and batch.x.dtype == torch.float32


@pytest.mark.parametrize("augment", ["none", "flip", "crop_flip"])
def test_the_training_images_are_held_once(augment):
    """Without crops the batches are gathered from the training images themselves, with crops from their padded
    copy, whose interior ``train_x`` then is: one copy of the training set on the device, never two."""
    fd, _ = _images(augment)
    assert fd._source.untyped_storage().data_ptr() == fd.train_x.untyped_storage().data_ptr()
    assert fd._source.shape[-1] == 32 + (8 if augment == "crop_flip" else 0)
