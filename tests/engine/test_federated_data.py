"""FederatedData's batches: augmented in their gather from the dataset, equal to the per-sample reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetfl.data.augment import augment_params, to_float
from hetfl.data.base import Dataset, DatasetInfo, Split
from hetfl.data.partition import Partition
from hetfl.engine.data import FederatedData
from tests.data.test_augment import reference_crop_flip
from tests.helpers import SMALL_MNIST, needs_shared_data
from tests.helpers.ops import VIEWS, OpCounter

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.5)


def federated(augment: str, prepared: bool | None = None) -> tuple[FederatedData, torch.Tensor]:
    """30 RGB images of 16 x 16 (padding 2) over two clients, and the raw training images."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (30, 3, 16, 16), dtype=torch.uint8, generator=gen)
    y = torch.randint(0, 10, (30,), generator=gen)
    info = DatasetInfo("tiny", tuple(str(i) for i in range(10)), (3, 16, 16), MEAN, STD)
    dataset = Dataset(info, Split(x.clone(), y), Split(x[:6].clone(), y[:6]))
    partition = Partition([np.arange(0, 20), np.arange(20, 30)], [np.arange(3), np.arange(3, 6)])
    return FederatedData(dataset, partition, torch.device("cpu"), augment, prepared), x


@pytest.mark.parametrize("prepared", [False, True], ids=["uint8", "prepared"])
@pytest.mark.parametrize("augment", ["crop_flip", "flip"])
def test_an_augmented_batch_of_any_shape_equals_the_per_sample_reference(augment: str, prepared: bool) -> None:
    """From the raw images or from normalised floats made once: the reference's values bit for bit."""
    data, raw = federated(augment, prepared)
    padding = data.padding if augment == "crop_flip" else 0
    assert torch.equal(data.train_x, raw)  # the interior of the padded copy: the same images
    idx = torch.randint(0, 30, (5, 4), generator=torch.Generator().manual_seed(1))  # [samples, clients]
    gen = torch.Generator().manual_seed(2)
    draws = data.augment_draws(idx.numel(), gen).view(3, 5, 4)
    dx, dy, flips = augment_params(idx.numel(), data.padding, True, torch.Generator().manual_seed(2))
    if augment == "flip":
        dx, dy = torch.zeros_like(dx), torch.zeros_like(dy)
    batch = data.batch_at(idx, draws)
    assert batch.x.shape == (5, 4, 3, 16, 16) and batch.x.is_contiguous() and torch.equal(batch.y, data.train_y[idx])
    expected = to_float(reference_crop_flip(raw[idx.reshape(-1)], dx, dy, flips, padding), MEAN, STD)
    assert torch.equal(batch.x.reshape(-1, 3, 16, 16), expected)


def test_random_crops_keep_one_padded_copy_of_the_training_images() -> None:
    data, _ = federated("crop_flip", prepared=False)
    source = data._source
    assert source.shape == (30, 3, 20, 20)
    assert data.train_x.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()


@pytest.mark.parametrize("prepared", [False, True], ids=["uint8", "prepared"])
@pytest.mark.parametrize("augment", ["crop_flip", "flip", "none"])
def test_a_batch_is_one_gather_then_the_normalisation(augment: str, prepared: bool) -> None:
    """Kernels of one batch: the images' gather (crops and flips included: two index computations), the
    labels' gather and, from raw images, the four of the uint8 -> float normalisation; no padding,
    flipping, branching or layout copy per batch."""
    data, _ = federated(augment, prepared)
    idx = torch.arange(8).view(4, 2)
    draws = data.augment_draws(8, torch.Generator().manual_seed(0))
    with OpCounter() as counter:
        data.batch_at(idx, None if draws is None else draws.view(3, 4, 2))
    cropping = {"aten.add": 1, "aten.addcmul": 1} if augment != "none" else {}
    normalise = {} if prepared else {"aten._to_copy": 1, "aten.div_": 2, "aten.sub_": 1}
    assert {op: n for op, n in counter.ops.items() if op not in VIEWS} \
        == {"aten.index": 2, **cropping, **normalise}


@pytest.mark.parametrize("augment", ["crop_flip", "none"])
def test_an_unaugmented_batch_from_prepared_images_equals_the_raw_path(augment: str) -> None:
    """Batches without draws (a data.augment = "none" run, or the unpadded interior of a padded source), and
    the raw training images kept for everything else (client splits, statistics)."""
    (raw_data, raw), (prepared, _) = federated(augment, False), federated(augment, True)
    idx = torch.randint(0, 30, (6, 3), generator=torch.Generator().manual_seed(4))
    a, b = raw_data.batch_at(idx, None), prepared.batch_at(idx, None)
    assert b.x.dtype == torch.float32 and torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert torch.equal(prepared.train_x, raw) and prepared.train_x.dtype == torch.uint8


def test_images_are_prepared_by_default_only_on_a_cuda_device_with_room(monkeypatch) -> None:
    data, _ = federated("crop_flip")
    assert not data._prepared  # a CPU: steps are not bound by kernel launches
    monkeypatch.setattr(FederatedData, "_room_for", lambda self, raw, padding: True)
    assert federated("crop_flip")[0]._prepared
    features = Dataset(DatasetInfo("f", ("a", "b"), (5,)), Split(torch.zeros(4, 5), torch.zeros(4, dtype=torch.long)),
                       Split(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long)))
    data = FederatedData(features, Partition([np.arange(4)], [np.arange(2)]), torch.device("cpu"), "none", True)
    assert not data._prepared  # float features are their own model inputs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_images_are_prepared_and_batches_equal_the_cpus() -> None:
    cpu, raw = federated("crop_flip", prepared=False)
    gpu = FederatedData(Dataset(cpu.info, Split(raw.clone(), cpu.train_y.clone()), Split(raw[:6].clone(),
                                                                                      cpu.train_y[:6].clone())),
                        cpu.partition, torch.device("cuda"), "crop_flip")
    assert gpu._prepared
    idx = torch.randint(0, 30, (5, 4), generator=torch.Generator().manual_seed(1))
    draws = cpu.augment_draws(20, torch.Generator().manual_seed(2)).view(3, 5, 4)
    torch.testing.assert_close(gpu.batch_at(idx.cuda(), draws.cuda()).x.cpu(), cpu.batch_at(idx, draws).x,
                               rtol=1e-6, atol=1e-6)  # CUDA divides by 255 as a product with 1/255


@needs_shared_data
@pytest.mark.parametrize("executor", ["sequential", "vectorized", "flower"])
def test_flower_nodes_keep_no_prepared_copy(monkeypatch, executor: str) -> None:
    """Flower's nodes are a process each, several of which may share one GPU: each would hold its own copy."""
    from hetfl import config
    from hetfl.engine.experiment import Experiment

    monkeypatch.setattr(FederatedData, "_room_for", lambda self, raw, padding: True)  # as on a roomy GPU
    exp = Experiment(config.load(None, [*SMALL_MNIST, f"runtime.executor={executor}", "runtime.progress=false"]))
    assert exp.data._prepared == (executor != "flower")
