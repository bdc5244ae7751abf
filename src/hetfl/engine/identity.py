"""A run's identity: which resolved configuration produced its numbers.

Every command that reuses a run directory or groups runs into one table row
decides by these functions, never by a folder name: a run is reused only for
an identical resolved configuration, and runs share a row only when their
configurations differ in nothing but the seed.

``setting_id`` is a short hash of the resolved configuration without the seed
(the row a run belongs to); ``run_id`` includes the seed (the run itself).
Keys that do not change the numbers (``runtime.progress``: what the terminal
shows; ``data.cache_dir``: where decoded data is cached; ``tracking.*``: where the
numbers are also sent) are left out of both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from pathlib import Path
from typing import Any

from hetfl import config as config_mod
from hetfl.algorithms import PLUGIN_SOURCE, as_written_params, hyperparameters, parse_name, step_hyper
from hetfl.engine.rundir import RunDirError
from hetfl.params import ConfigError, to_dict

#: keys that do not change a run's numbers and are left out of its identity: what the terminal shows,
#: where decoded data is cached (the cache is keyed by the source files, so any folder gives the same arrays),
#: where the numbers are also sent (hetfl.tracking: a run resumed or compared with tracking on is the same run),
#: how often the per-client accuracies are also written (client_metrics.jsonl; the metrics line is the same),
#: whether freed CPU memory stays in the process (hetfl.engine.host_memory: where a tensor lives, not its values)
PRESENTATION_KEYS = frozenset({
    "runtime.progress", "data.cache_dir", "runtime.client_metrics_every", "runtime.keep_freed_memory",
    "tracking.tensorboard", "tracking.tensorboard_dir", "tracking.mlflow", "tracking.mlflow_uri",
    "tracking.experiment", "tracking.run_name",
})
#: run-directory files (the same names as hetfl.engine.experiment's, which imports this module through
#: hetfl.engine.setup)
CONFIG_NAME, SUMMARY_NAME = "config.toml", "summary.json"
#: files that do not make a folder hold a run: a lock left by a process killed before it wrote config.toml
#: (hetfl.engine.rundir.LOCK_NAME; the run itself then refuses a live holder)
IGNORED = frozenset({".lock"})


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config tree as ``{"train.lr": 0.05, ...}``; empty tables stay as ``{}`` values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _canonical(flat: dict[str, Any]) -> str:
    return json.dumps({k: flat[k] for k in sorted(flat)}, sort_keys=True, default=str, separators=(",", ":"))


def _digest(flat: dict[str, Any]) -> str:
    return hashlib.sha256(_canonical(flat).encode()).hexdigest()[:12]


def identity_keys(tree: dict[str, Any], *, with_seed: bool) -> dict[str, Any]:
    """The flattened keys that make up a run's identity."""
    flat = flatten(tree)
    return {k: v for k, v in flat.items() if k not in PRESENTATION_KEYS and (with_seed or k != "seed")}


def setting_id(tree: dict[str, Any]) -> str:
    """Hash of a resolved config tree without its seed: runs with equal ids differ only by seed."""
    return _digest(identity_keys(tree, with_seed=False))


def run_id(tree: dict[str, Any]) -> str:
    """Hash of a resolved config tree, seed included: equal ids are the same run."""
    return _digest(identity_keys(tree, with_seed=True))


def posthoc_keys(tree: dict[str, Any]) -> set[str]:
    """The flattened keys of a run's post-hoc steps' settings (``algorithm.ccvr.epochs`` ...) that act only
    after the last round's training: all of ``algorithm.<step>.*`` but ``every_round`` (a step run after
    every round changes the training that follows it)."""
    steps = str(tree.get("algorithm", {}).get("name", "")).split("+")[1:]
    prefixes = tuple(f"algorithm.{step}." for step in steps)
    return {k for k in flatten(tree) if k.startswith(prefixes) and not k.endswith(".every_round")}


def training_keys(tree: dict[str, Any]) -> dict[str, Any]:
    """The identity keys (seed included) that decide a run's training: all but its post-hoc settings
    (:func:`posthoc_keys`). Two runs with equal training keys train the same model."""
    after = posthoc_keys(tree)
    return {k: v for k, v in identity_keys(tree, with_seed=True).items() if k not in after}


def training_id(tree: dict[str, Any]) -> str:
    """Hash of a resolved config tree's :func:`training_keys`: runs with equal ids train the same model and
    differ at most in what their post-hoc steps do with it."""
    return _digest(training_keys(tree))


def differing_keys(a: dict[str, Any], b: dict[str, Any], *, with_seed: bool = True,
                   training_only: bool = False) -> list[str]:
    """Identity keys whose values differ between two config trees, as ``"key: a -> b"`` lines
    (``training_only``: the :func:`training_keys` only)."""
    if training_only:
        fa, fb = training_keys(a), training_keys(b)
    else:
        fa, fb = identity_keys(a, with_seed=with_seed), identity_keys(b, with_seed=with_seed)
    same = lambda k: json.dumps(fa.get(k), sort_keys=True, default=str) == json.dumps(fb.get(k), sort_keys=True,
                                                                                        default=str)
    return [f"{k}: {fa.get(k, '(unset)')!r} -> {fb.get(k, '(unset)')!r}"
            for k in sorted(fa.keys() | fb.keys()) if not same(k)]


def varying_keys(trees: list[dict[str, Any]]) -> list[str]:
    """Identity keys (seed excluded) whose values are not the same in every tree."""
    flats = [identity_keys(t, with_seed=False) for t in trees]
    keys = set().union(*flats) if flats else set()
    return sorted(k for k in keys
                  if len({json.dumps(f.get(k), sort_keys=True, default=str) for f in flats}) > 1)


# ----------------------------------------------------------------- run directories
def canonical_tree(tree: dict[str, Any]) -> dict[str, Any]:
    """A saved config tree read through today's code: keys added to hetfl since the run was
    written get their defaults, values their types, and the method's (and post-hoc steps')
    hyperparameters are filled in as :func:`hetfl.engine.setup.resolve` does; so an old
    run and a new one of the same setting get the same ids. Raises ConfigError for a tree that
    is no longer a valid configuration."""
    cfg = config_mod.from_dict(tree)
    params = cfg.algorithm.params
    _, steps = parse_name(cfg.algorithm.name)
    full = {**to_dict(hyperparameters(cfg.algorithm.name, params)),
            **{s: to_dict(step_hyper(s, params.get(s, {}))) for s in steps}}
    if PLUGIN_SOURCE in params:  # the plug-in's code the run ran, as recorded (never today's file)
        full[PLUGIN_SOURCE] = params[PLUGIN_SOURCE]
    return config_mod.to_tree(dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, params=full)))


def as_written(tree: dict[str, Any]) -> dict[str, Any]:
    """A configuration tree that a run wrote (``config.toml``, a checkpoint's or a summary's ``config``) as
    that run computed: the method settings added to hetfl after it, whose defaults changed the computation,
    at the values it ran with (:func:`hetfl.algorithms.as_written_params`). A run of MOON written before
    ``reference_mode`` existed is read as ``reference_mode = "train"``: it resumes as it started, and a
    table that plans the new default does not take its numbers for the new default's."""
    algorithm = tree.get("algorithm")
    if not isinstance(algorithm, dict) or not isinstance(algorithm.get("name"), str):
        return tree
    params = {k: v for k, v in algorithm.items() if k != "name"}
    return {**tree, "algorithm": {"name": algorithm["name"], **as_written_params(algorithm["name"], params)}}


def load_run_config(path: Path, overrides: list[str] | tuple[str, ...] = ()) -> config_mod.RunConfig:
    """The configuration of the run whose ``config.toml`` is ``path`` (:func:`as_written`), with ``overrides``
    (``--set`` of keys that change no number, on a resume) applied: what ``--resume``, reuse and reading a
    finished run go by."""
    return config_mod.from_tree(as_written(config_mod.read_tree(path)), overrides)


def saved_tree(run_dir: Path) -> dict[str, Any] | None:
    """The resolved configuration a run directory holds (``config.toml``, else the ``config`` of
    its ``summary.json``), read through :func:`canonical_tree` where it is still valid; None if
    the folder holds neither."""
    config_path, summary_path = run_dir / CONFIG_NAME, run_dir / SUMMARY_NAME
    try:
        if config_path.is_file():
            tree = tomllib.loads(config_path.read_text())
        elif summary_path.is_file() and "config" in (summary := json.loads(summary_path.read_text())):
            tree = summary["config"]
        else:
            return None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError):  # damaged: no known config
        return None
    try:
        return canonical_tree(as_written(tree))
    except ConfigError:  # a method or key this hetfl no longer knows: compare the tree as written
        return tree


def run_dir_ids(run_dir: Path) -> tuple[str, str]:
    """(setting_id, run_id) of a run directory, recomputed from its saved configuration (runs
    written before summaries carried ids get them too)."""
    tree = saved_tree(run_dir)
    if tree is None:
        raise FileNotFoundError(f"{run_dir}: no {CONFIG_NAME}")
    return setting_id(tree), run_id(tree)


def check_run_dir(run_dir: Path, planned: dict[str, Any], *, option: str = "--out") -> str:
    """Whether the run ``planned`` (a resolved config tree) can go into ``run_dir``: ``"new"`` (no
    folder, or an empty one), ``"finished"`` (it holds this very run: reuse it) or ``"unfinished"``
    (it holds this run, interrupted: resume it). A folder holding a run of another configuration,
    or files that are no run, raises RunDirError naming the differing keys: its numbers would
    otherwise be tabled as the planned run's."""
    if not run_dir.exists() or (run_dir.is_dir() and not any(p.name not in IGNORED for p in run_dir.iterdir())):
        return "new"
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir}: exists and is not a folder; pick another {option}")
    saved = saved_tree(run_dir)
    if saved is None:
        raise RunDirError(f"{run_dir}: holds files but no readable {CONFIG_NAME}, so no hetfl run to reuse or resume; "
                          f"pick another {option} (or empty that folder)")
    diffs = differing_keys(saved, planned)
    if diffs:
        shown = "; ".join(diffs[:4]) + (f"; and {len(diffs) - 4} more" if len(diffs) > 4 else "")
        raise RunDirError(f"{run_dir}: holds a run of another configuration ({shown}; there -> now). "
                          f"Pick another {option} for this configuration, or delete {run_dir} to replace "
                          "that run")
    return "finished" if (run_dir / SUMMARY_NAME).is_file() else "unfinished"
