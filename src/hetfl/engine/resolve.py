"""Configurations resolved for their data before a plan of runs starts: the ``auto`` model and partition and the
method's default hyperparameters filled in as each run will fill them (:func:`hetfl.engine.setup.resolve`), so
that run folders can be compared with the runs planned there by resolved configuration
(:mod:`hetfl.engine.identity`)."""

from __future__ import annotations

import json
from typing import Any

from hetfl.data.datasets import check_run_splits, load_dataset
from hetfl.engine.setup import build_partition, check_method_fits_model, resolve

__all__ = ["resolve_configs"]


def resolve_configs(cfgs: list[Any]) -> list[Any]:
    """Each RunConfig resolved for its dataset (``auto`` model and partition, the method's default
    hyperparameters), as the run itself will resolve it, and checked for a model its method can use
    (a ConfigError naming ``model.name`` otherwise), for splits the run can use (``check_run_splits``) and for
    a partition that can be made (a PartitionError naming the key otherwise). Each distinct dataset setting is loaded
    once and dropped before the next (loaders cache decoded files, so this is quick)."""
    def key(cfg: Any) -> str:
        d = cfg.data
        return json.dumps([d.dataset, d.root, d.download, d.options, cfg.seed], sort_keys=True, default=str)

    by_dataset: dict[str, list[int]] = {}
    for i, cfg in enumerate(cfgs):
        by_dataset.setdefault(key(cfg), []).append(i)
    resolved: list[Any] = list(cfgs)
    for indices in by_dataset.values():
        d, seed = cfgs[indices[0]].data, cfgs[indices[0]].seed
        dataset = load_dataset(d.dataset, d.root or None, download=d.download, cache_dir=d.cache_dir, seed=seed,
                               **d.options)
        check_run_splits(d.dataset, d.options, dataset)  # an empty test or train split: before any run starts
        for i in indices:
            resolved[i] = resolve(cfgs[i], dataset)
            check_method_fits_model(resolved[i], dataset.info)  # before any run of the plan starts
            build_partition(resolved[i], dataset)  # a partition that cannot be made (PartitionError): likewise
        del dataset
    return resolved
