"""An experiment's set-up and validation before anything runs: the device, whether a round's clients
are vmapped, the model and partition ``auto`` stands for, the method's filled-in hyperparameters, the
partition itself, and the checks a resume (configuration changes) and a plan (method x model) make."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Iterator
from typing import Any

import torch

from hetfl import config as config_mod
from hetfl.algorithms import (
    PLUGIN_SOURCE,
    check_model_parts,
    hyperparameters,
    parse_name,
    plugin_source,
    step_hyper,
)
from hetfl.config import RunConfig
from hetfl.data.base import Dataset
from hetfl.data.partition import Partition, make_partition
from hetfl.engine import resources
from hetfl.engine.identity import as_written, differing_keys
from hetfl.models.base import ModelError, param_groups
from hetfl.params import ConfigError, to_dict
from hetfl.rng import derive_seed

#: The environment variable that names the device ``runtime.device = "auto"`` stands for (cpu, cuda or
#: cuda:N); unset or empty: cuda when present, else cpu. A run that names its device is not affected. The test
#: suite sets it to cpu (tests/conftest.py), so tests that pin numbers give them on a machine with CUDA too.
AUTO_DEVICE_ENV = "HETFL_DEVICE"


def pick_device(name: str) -> torch.device:
    """The device of ``runtime.device`` (auto, cpu, cuda, cuda:N), checked against this machine's GPUs.
    A device index becomes the current CUDA device, so that what runs on the current device (the
    vectorised executor's CUDA streams and graphs) runs on the chosen one."""
    if name == "auto":
        name = os.environ.get(AUTO_DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")
        if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", name):
            raise ConfigError("runtime.device", "auto", f"the environment variable {AUTO_DEVICE_ENV} = {name!r} "
                                                        "must be cpu, cuda or cuda:N (or unset)")
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ConfigError("runtime.device", name, "CUDA is not available on this machine; use auto or cpu")
    count = torch.cuda.device_count()
    if device.index is not None:
        if device.index >= count:
            present = ", ".join(f"cuda:{i}" for i in range(count))
            raise ConfigError("runtime.device", name, f"this machine has {count} CUDA device{'s' * (count != 1)} "
                                                      f"({present}); use one of them, cuda or auto")
        torch.cuda.set_device(device)
    return device


def vmap_clients(runtime: config_mod.RuntimeConfig, device: torch.device) -> bool:
    """Whether a round's clients are vmapped: the vectorised executor on an accelerator,
    or on the CPU when asked. On the CPU a vmapped step does the same arithmetic as the
    clients' steps one after another, through grouped convolutions and batched matrix
    products that are 1.5-2.5x slower there than the per-client kernels
    (``benchmarks/vmap_cpu_profile.py``), and a CPU has no idle parallel units for the
    batching to fill; so the vectorised executor runs clients one at a time on the CPU.
    """
    return runtime.executor == "vectorized" and (device.type != "cpu" or runtime.vmap_on_cpu)


def auto_model(dataset: Dataset) -> tuple[str, dict[str, Any]]:
    """The default model for a dataset: logistic regression for Synthetic (as FedProx),
    the 2-conv CNN for 28x28 images, MOON's simple CNN for 32x32, ResNet-18 beyond."""
    info = dataset.info
    if not info.is_image:
        return "mlp", {"hidden": [] if info.name == "synthetic" else [200, 200]}
    if info.input_shape[-1] <= 28:
        return "cnn2", {}
    if info.input_shape[-1] <= 32:
        return "simple_cnn", {}
    return "resnet18", {"norm": "gn"}


def resolve(cfg: RunConfig, dataset: Dataset) -> RunConfig:
    """Replace every ``auto`` by its value for this dataset, and fill the method's defaults."""
    data, model = cfg.data, cfg.model
    if data.partition == "auto":
        data = dataclasses.replace(data, partition="natural" if dataset.info.groups else "dirichlet")
    if model.name == "auto":
        name, options = auto_model(dataset)
        model = dataclasses.replace(model, name=name, options={**options, **model.options})
    params = cfg.algorithm.params
    _, steps = parse_name(cfg.algorithm.name)
    hyper = to_dict(hyperparameters(cfg.algorithm.name, params))
    full_params = {**hyper, **{s: to_dict(step_hyper(s, params.get(s, {}))) for s in steps}}
    source = plugin_source(cfg.algorithm.name)  # a plug-in's code as it is now (not a value the config carried)
    if source:
        full_params[PLUGIN_SOURCE] = source
    algorithm = dataclasses.replace(cfg.algorithm, params=full_params)
    return dataclasses.replace(cfg, data=data, model=model, algorithm=algorithm)


def build_partition(cfg: RunConfig, dataset: Dataset) -> Partition:
    d = cfg.data
    group = dataset.train.group
    test_group = dataset.test.group
    return make_partition(
        d.partition,
        dataset.train.y.numpy(),
        dataset.test.y.numpy(),
        d.num_clients,
        seed=derive_seed(cfg.seed, "partition"),
        num_classes=dataset.info.num_classes,
        train_groups=None if group is None else group.numpy(),
        test_groups=None if test_group is None else test_group.numpy(),
        alpha=d.alpha,
        min_size=d.min_size,
        classes_per_client=d.classes_per_client,
        uniform_share=d.uniform_share,
        samples_per_client=d.samples_per_client,
        test_per_client=d.test_per_client or None,
        dominant_groups=d.dominant_groups,
        classes_per_group=d.classes_per_group,
        group_classes=[list(g) for g in d.group_classes] or None,
        reuse_samples=d.reuse_samples,
        quantity_sigma=d.quantity_sigma,
        clients_per_domain=d.clients_per_domain,
        angles=list(d.angles) or None,
        base=d.base,
        concept_groups=d.concept_groups,
    )


def config_changes(saved: dict[str, Any] | None, cfg: RunConfig, *, training_only: bool = False) -> list[str]:
    """How ``cfg`` differs from the configuration a checkpoint was written with, as
    ``"key: saved -> now"`` lines (empty: the same run; ``training_only``: the same training,
    post-hoc settings aside, :func:`hetfl.engine.identity.training_keys`). The saved configuration is read
    through today's defaults first, so that a key added to hetfl after the checkpoint was
    written (with a default that leaves old runs unchanged) does not stop them resuming.
    Keys that change only what the terminal shows (``identity.PRESENTATION_KEYS``, e.g.
    ``--quiet``'s ``runtime.progress``) are not changes."""
    if saved is None:
        return ["the checkpoint records no configuration"]
    try:
        saved = config_mod.to_tree(config_mod.from_dict(as_written(saved)))
    except ConfigError as err:
        return [f"the checkpoint's configuration is no longer valid: {err}"]
    return differing_keys(saved, config_mod.to_tree(cfg), training_only=training_only)


def check_method_fits_model(cfg: RunConfig, info: Any) -> None:
    """The set-up's method x model check (:func:`check_model_parts`) on the model built on the meta
    device, for planning: ``hetfl compare``, sweeps and ``hetfl reproduce`` refuse a method the model
    cannot serve (FedPAC on logistic regression) before their first run starts."""
    with model_fits_data(cfg, info.input_shape):
        model = resources.meta_model(cfg.model.name, info.input_shape, info.num_classes, cfg.model.options)
    if model is not None:
        check_model_parts(cfg.algorithm.name, cfg.model, param_groups(model), info.input_shape, info.num_classes)


@contextlib.contextmanager
def model_fits_data(cfg: RunConfig, input_shape: tuple[int, ...]) -> Iterator[None]:
    """A model that cannot take the dataset's samples (an image model on feature vectors, images too small for
    its convolutions) refused naming what the user set, ``model.name`` and its value, and the data's shape:
    :func:`hetfl.models.build_model` names its own argument, ``input_shape``, which no configuration holds."""
    try:
        yield
    except ModelError as err:
        if err.key != "input_shape":
            raise
        raise ModelError("model.name", cfg.model.name,
                         f"{err.allowed} (data.dataset = {cfg.data.dataset!r}: samples of shape "
                         f"{tuple(input_shape)})") from None
