"""A run's set-up (``hetfl.engine.setup``): what mutation testing of the module (``benchmarks/mutation.py`` target
``engine_setup``, session 42) showed the whole-run tests leave unchecked.

The model ``model.name = "auto"`` stands for, at each boundary of the image width (cnn2 up to 28 pixels, MOON's
simple CNN up to 32, ResNet-18 with GroupNorm beyond, read from the width, not the height); the plan's check that
a method fits the model (FedPAC refused on logistic regression, an image model on feature vectors refused naming
``model.name``); a resume's configuration changes with and without the post-hoc settings.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hetfl import config
from hetfl.engine import setup
from hetfl.models.base import ModelError
from hetfl.params import ConfigError
from hetfl.rng import derive_seed


def dataset(shape: tuple[int, ...], name: str = "images", image: bool = True) -> SimpleNamespace:
    return SimpleNamespace(info=SimpleNamespace(is_image=image, input_shape=shape, name=name))


@pytest.mark.parametrize(("shape", "model"), [
    ((1, 28, 28), ("cnn2", {})),
    ((3, 64, 28), ("cnn2", {})),  # the width decides
    ((3, 29, 29), ("simple_cnn", {})),
    ((3, 32, 32), ("simple_cnn", {})),
    ((3, 20, 32), ("simple_cnn", {})),
    ((3, 33, 33), ("resnet18", {"norm": "gn"})),
    ((3, 32, 96), ("resnet18", {"norm": "gn"})),
])
def test_the_automatic_model_of_images_by_their_width(shape, model):
    assert setup.auto_model(dataset(shape)) == model


def test_the_automatic_model_of_feature_vectors():
    assert setup.auto_model(dataset((60,), "synthetic", image=False)) == ("mlp", {"hidden": []})  # FedProx's
    assert setup.auto_model(dataset((54,), "covtype", image=False)) == ("mlp", {"hidden": [200, 200]})


FEATURES = SimpleNamespace(input_shape=(60,), num_classes=10)


def test_a_plan_refuses_a_method_the_model_cannot_serve():
    cfg = config.load(None, ["algorithm.name=fedpac", "model.name=mlp", "model.options={hidden = []}"])
    with pytest.raises(ConfigError) as err:
        setup.check_method_fits_model(cfg, FEATURES)
    assert str(err.value) == ("model.name = 'mlp': fedpac needs an encoder with trainable parameters before the "
                              "classifier, and mlp with model.options = {'hidden': []} has none; mlp has it with its "
                              "default options: --set \"model.options={hidden = [200, 200]}\"; models that fit this "
                              "data (with their default options): mlp")  # the data's shape picks the models named
    setup.check_method_fits_model(config.load(None, ["algorithm.name=fedpac", "model.name=mlp"]), FEATURES)


def test_a_plan_refuses_an_image_model_on_feature_vectors_naming_the_setting():
    cfg = config.load(None, ["data.dataset=synthetic", "model.name=cnn2"])
    with pytest.raises(ModelError) as err:
        setup.check_method_fits_model(cfg, FEATURES)
    assert (err.value.key, err.value.value) == ("model.name", "cnn2")
    assert str(err.value) == ("model.name = 'cnn2': cnn2 needs images (C, H, W); use mlp for feature vectors "
                              "(data.dataset = 'synthetic': samples of shape (60,))")


def test_a_resumes_changes_with_and_without_the_post_hoc_settings():
    saved = config.to_tree(config.load(None, ["algorithm.name=fedavg+ccvr"]))
    post_hoc = config.load(None, ["algorithm.name=fedavg+ccvr", "algorithm.ccvr.epochs=7"])
    assert setup.config_changes(saved, post_hoc) == ["algorithm.ccvr.epochs: '(unset)' -> 7"]
    assert setup.config_changes(saved, post_hoc, training_only=True) == []
    training = config.load(None, ["algorithm.name=fedavg+ccvr", "train.lr=0.2"])
    assert setup.config_changes(saved, training, training_only=True) == ["train.lr: 0.05 -> 0.2"]
    assert setup.config_changes(None, training) == ["the checkpoint records no configuration"]


# ------------------------------------------------------------------ the device
def test_auto_is_the_environments_device_or_this_machines(monkeypatch):
    monkeypatch.setenv(setup.AUTO_DEVICE_ENV, "cpu")
    assert setup.pick_device("auto") == torch.device("cpu")
    for unset in ("", None):
        if unset is None:
            monkeypatch.delenv(setup.AUTO_DEVICE_ENV)
        else:
            monkeypatch.setenv(setup.AUTO_DEVICE_ENV, unset)
        assert setup.pick_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv(setup.AUTO_DEVICE_ENV, "gpu")
    with pytest.raises(ConfigError) as err:
        setup.pick_device("auto")
    assert str(err.value) == ("runtime.device = 'auto': the environment variable HETFL_DEVICE = 'gpu' must be cpu, "
                              "cuda or cuda:N (or unset)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_cuda_asked_for_where_there_is_none_is_refused(name):
    with pytest.raises(ConfigError) as err:
        setup.pick_device(name)
    assert str(err.value) == f"runtime.device = '{name}': CUDA is not available on this machine; use auto or cpu"


@pytest.mark.parametrize(("executor", "device", "vmap_on_cpu", "vmapped"), [
    ("vectorized", "cuda", False, True),
    ("vectorized", "cpu", False, False),  # one client at a time: faster on a CPU
    ("vectorized", "cpu", True, True),
    ("sequential", "cuda", True, False),
    ("flower", "cpu", True, False),
])
def test_a_rounds_clients_are_vmapped_by_the_vectorized_executor_on_an_accelerator_or_when_asked(
        executor, device, vmap_on_cpu, vmapped):
    runtime = SimpleNamespace(executor=executor, vmap_on_cpu=vmap_on_cpu)
    assert setup.vmap_clients(runtime, torch.device(device)) is vmapped


# ------------------------------------------------------------------ what auto stands for
def test_auto_partition_is_natural_for_a_dataset_with_groups_and_dirichlet_without():
    cfg = config.load(None, ["data.partition=auto", "model.name=mlp", "algorithm.name=fedavg+ccvr",
                             "algorithm.ccvr.epochs=7"])
    grouped = SimpleNamespace(info=SimpleNamespace(groups=("photo", "sketch"), is_image=False, input_shape=(4,),
                                                   name="pacs"))
    resolved = setup.resolve(cfg, grouped)
    assert resolved.data.partition == "natural" and resolved.model.name == "mlp"
    assert resolved.algorithm.params["ccvr"]["epochs"] == 7  # the step's own settings kept, its defaults filled
    assert resolved.algorithm.params["ccvr"]["num_virtual"] == 100
    plain = SimpleNamespace(info=SimpleNamespace(groups=(), is_image=False, input_shape=(4,), name="synthetic"))
    assert setup.resolve(cfg, plain).data.partition == "dirichlet"


@pytest.fixture
def gpus(monkeypatch):
    """A machine with ``n`` CUDA devices, for ``pick_device`` (torch's answers stood in for): returns the setter of
    ``n`` and the devices ``torch.cuda.set_device`` was given."""
    chosen: list = []
    count = [0]
    monkeypatch.setattr(setup.torch.cuda, "is_available", lambda: count[0] > 0)
    monkeypatch.setattr(setup.torch.cuda, "device_count", lambda: count[0])
    monkeypatch.setattr(setup.torch.cuda, "set_device", chosen.append)

    def machine(n: int) -> list:
        count[0] = n
        return chosen

    return machine


def test_auto_is_cuda_where_a_gpu_is_present(gpus, monkeypatch):
    monkeypatch.delenv(setup.AUTO_DEVICE_ENV)
    gpus(2)
    assert setup.pick_device("auto") == torch.device("cuda")


def test_a_gpus_index_becomes_the_current_device(gpus):
    chosen = gpus(2)
    assert setup.pick_device("cuda:1") == torch.device("cuda:1") and chosen == [torch.device("cuda:1")]
    assert setup.pick_device("cuda") == torch.device("cuda") and len(chosen) == 1  # no index: the current one


@pytest.mark.parametrize(("count", "present"), [(2, "2 CUDA devices (cuda:0, cuda:1)"), (1, "1 CUDA device (cuda:0)")])
def test_a_gpu_index_past_the_machines_is_refused_naming_those_present(gpus, count, present):
    chosen = gpus(count)
    with pytest.raises(ConfigError) as err:
        setup.pick_device(f"cuda:{count}")
    assert str(err.value) == (f"runtime.device = 'cuda:{count}': this machine has {present}; use one of them, cuda "
                              "or auto")
    assert chosen == []


# ------------------------------------------------------------------ the partition's settings
def test_every_data_setting_of_a_partition_reaches_it(monkeypatch):
    """``build_partition`` hands each ``data.`` key to :func:`hetfl.data.partition.make_partition` (a key dropped
    would silently give its default: a Dirichlet run at another alpha), with the labels, the groups and the run's
    partition seed; every value here differs from its default."""
    calls: list = []
    monkeypatch.setattr(setup, "make_partition", lambda *args, **kwargs: calls.append((args, kwargs)))
    cfg = config.load(None, [
        "seed=7", "data.partition=dirichlet", "data.num_clients=6", "data.alpha=0.3", "data.min_size=4",
        "data.classes_per_client=3", "data.uniform_share=0.4", "data.samples_per_client=50",
        "data.test_per_client=9", "data.dominant_groups=2", "data.classes_per_group=2",
        "data.reuse_samples=true", "data.quantity_sigma=0.5", "data.clients_per_domain=2",
        "data.angles=[0.0, 90.0]", "data.base=dirichlet", "data.concept_groups=3"])
    split = SimpleNamespace(y=torch.tensor([0, 1, 2, 1]), group=torch.tensor([0, 0, 1, 1]))
    test = SimpleNamespace(y=torch.tensor([2, 0]), group=torch.tensor([1, 0]))
    data = SimpleNamespace(train=split, test=test, info=SimpleNamespace(num_classes=3))
    setup.build_partition(cfg, data)
    ((args, kwargs),) = calls
    assert args[0] == "dirichlet" and args[3] == 6
    assert np.array_equal(args[1], [0, 1, 2, 1]) and np.array_equal(args[2], [2, 0])
    assert np.array_equal(kwargs.pop("train_groups"), [0, 0, 1, 1])
    assert np.array_equal(kwargs.pop("test_groups"), [1, 0])
    assert kwargs == {
        "seed": derive_seed(7, "partition"), "num_classes": 3, "alpha": 0.3, "min_size": 4, "classes_per_client": 3,
        "uniform_share": 0.4, "samples_per_client": 50, "test_per_client": 9, "dominant_groups": 2,
        "classes_per_group": 2, "group_classes": None, "reuse_samples": True, "quantity_sigma": 0.5,
        "clients_per_domain": 2, "angles": [0.0, 90.0], "base": "dirichlet", "concept_groups": 3}
    calls.clear()
    plain = config.load(None, ["data.group_classes=[[0, 1], [2]]"])
    setup.build_partition(plain, SimpleNamespace(train=SimpleNamespace(y=split.y, group=None),
                                                 test=SimpleNamespace(y=test.y, group=None),
                                                 info=SimpleNamespace(num_classes=3)))
    ((_, kwargs),) = calls
    assert kwargs["group_classes"] == [[0, 1], [2]] and kwargs["train_groups"] is None is kwargs["test_groups"]
    assert kwargs["test_per_client"] is None and kwargs["angles"] is None  # 0 and [] mean "the scheme's own"
