"""The Python API: run an experiment or a comparison from a notebook or a script, and get its numbers back.

Example (FedAvg on the default Synthetic(1,1) data, 3 rounds; then two methods side by side)::

    import hetfl

    result = hetfl.run({"train": {"rounds": 3}}, out="runs/demo")
    result.final_accuracy              # the global model's accuracy after the last round (0..1)
    result.metrics[-1]["train_loss"]   # one dict per line of metrics.jsonl
    table = hetfl.compare(["fedavg", "fedprox"], seeds=[0, 1], overrides=["train.rounds=3"], out="runs/cmp")
    print(table.markdown)              # comparison.md, also written under out

A configuration is given as a :class:`~hetfl.config.RunConfig`, a dict in the TOML file's layout
(``{"train": {"lr": 0.01}}``), a path to a TOML file, or None (the defaults), plus ``overrides`` in
``--set`` syntax (``["train.lr=0.01"]``); all three forms go through the same validation as the
command line and give the same resolved configuration.

The API and the ``hetfl`` command line share their machinery (``hetfl compare`` calls
:func:`run_comparison`). Errors are raised, never ``SystemExit``: :class:`~hetfl.params.ConfigError`
names the key, the value and what is allowed; :class:`~hetfl.engine.rundir.RunDirError` is an output
folder that cannot be used; dataset, partition, model and checkpoint errors have their own classes
(all ``ValueError``). A run directory is never overwritten silently: what it holds is compared with
the run asked for by resolved configuration (:mod:`hetfl.engine.identity`); a finished run of the
same configuration is returned as it is, an interrupted one is continued only with ``resume=True``,
a run of another configuration is an error naming the differing keys, and ``overwrite=True``
deletes a folder's run first (only a folder holding a hetfl run, or an empty one; only the files hetfl
wrote, and nothing while the folder holds files of the user's).

Result types: :class:`RunResult` (one run directory) and :class:`CompareResult` (a table over runs,
one row per setting, as ``comparison.md``); a sweep returns a :class:`CompareResult` too.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetfl import config as config_mod
from hetfl import reproduce, runs, runtimes
from hetfl.algorithms import load_plugin
from hetfl.config import RunConfig
from hetfl.console import check_output_dir, default_run_dir, make_console
from hetfl.engine.rundir import check_unlocked
from hetfl.params import ConfigError
from hetfl.report import with_curves
from hetfl.runs import CompareResult, RunResult
from hetfl.sweeps import MAX_RUNS, check_grid, run_plan

if TYPE_CHECKING:
    from rich.console import Console

ConfigLike = RunConfig | Mapping[str, Any] | str | os.PathLike[str] | None

__all__ = ["CompareResult", "RunResult", "compare", "make_config", "run", "run_comparison", "sweep"]


# ----------------------------------------------------------------- configuration
def _override_list(overrides: Sequence[str]) -> list[str]:
    """``overrides`` as a list of ``KEY=VALUE`` strings; a bare string (which would be read letter by
    letter) or a non-string item is a ConfigError."""
    if isinstance(overrides, str) or not isinstance(overrides, Sequence):
        raise ConfigError("overrides", overrides, "must be a list of 'KEY=VALUE' strings, e.g. ['train.lr=0.01']")
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:  # named as the API's argument, not the CLI's --set
            raise ConfigError("overrides", item, "each override must be a 'KEY=VALUE' string, e.g. 'train.lr=0.01'")
    return list(overrides)


def make_config(config: ConfigLike = None, overrides: Sequence[str] = ()) -> RunConfig:
    """A validated RunConfig from any of the API's configuration forms plus ``--set``-style overrides.

    ``config`` is a RunConfig, a dict in the TOML layout, a path to a TOML file, or None (defaults);
    the dict and the RunConfig are not modified. Raises ConfigError naming the first bad key.

    >>> make_config({"train": {"rounds": 3}}, ["train.lr=0.01"]).train.rounds
    3
    """
    assignments = _override_list(overrides)
    if config is None or isinstance(config, str | os.PathLike):
        try:
            return config_mod.load(config, assignments)
        except config_mod.PresetFileError as err:  # named as `hetfl reproduce` knows it
            raise config_mod.PresetFileError(err.path, reproduce.preset_name(err.path)) from None
    if isinstance(config, RunConfig):
        tree = config_mod.to_tree(config)
    elif isinstance(config, Mapping):
        tree = copy.deepcopy(dict(config))
    else:
        raise ConfigError("config", config, "must be a RunConfig, a dict in the TOML layout, a path to a TOML "
                                            "file, or None (the defaults)")
    for assignment in assignments:
        config_mod.apply_override(tree, assignment)
    return config_mod.from_dict(tree)


def _load_plugins(plugins: Sequence[str | os.PathLike[str]]) -> None:
    """Import plugin files that register methods (``--plugin FILE`` of the command line)."""
    if isinstance(plugins, str | os.PathLike):
        plugins = [plugins]
    for plugin in plugins:
        load_plugin(str(plugin))


# ----------------------------------------------------------------- run
def run(config: ConfigLike = None, *, overrides: Sequence[str] = (), out: str | os.PathLike[str] | None = None,
        resume: bool = False, overwrite: bool = False, progress: bool = False,
        plugins: Sequence[str | os.PathLike[str]] = ()) -> RunResult:
    """Run one experiment into a run directory and return its numbers.

    ``config``: a RunConfig, a dict in the TOML layout, a path to a TOML file, or None (defaults);
    ``overrides``: ``--set``-style ``"KEY=VALUE"`` strings applied on top. ``out``: the run directory
    (None: ``runs/<time>-<method>-<dataset>-seed<k>``, as ``hetfl run``). ``progress``: progress bars
    and the summary table on the terminal. ``plugins``: Python files that register methods.

    What ``out`` already holds decides what happens, by resolved configuration (``runtime.progress``
    and ``data.cache_dir`` aside):

    - nothing (or an empty folder): the run is computed;
    - a finished run of the identical configuration: it is returned as it is, nothing is recomputed
      (``status == "reused"``);
    - an interrupted run of the identical configuration: continued from its checkpoint with
      ``resume=True`` (``status == "resumed"``), else a RunDirError saying so;
    - a run of another configuration, or files that are no run: a RunDirError naming the differing keys;
    - ``overwrite=True``: a folder holding a hetfl run (or nothing) is cleared of hetfl's files first and the
      run computed again; any other folder, or one holding files hetfl did not write, is refused, never
      deleted. Cannot be combined with ``resume=True``.

    To continue an interrupted run from its own configuration:
    ``hetfl.run("DIR/config.toml", out="DIR", resume=True)``.

    Raises ConfigError (naming the key) for bad settings, RunDirError for an unusable ``out``,
    DatasetError, PartitionError, ModelError or CheckpointError as ``hetfl run`` exits 2 on them;
    all before anything is written. Never ``SystemExit``.

    >>> import hetfl
    >>> result = hetfl.run(overrides=["train.rounds=2"], out="runs/demo")  # doctest: +SKIP
    >>> round(result.final_accuracy, 3), len(result.metrics)  # doctest: +SKIP
    (0.62, 2)
    """
    _load_plugins(plugins)
    if resume and overwrite:
        raise ConfigError("overwrite", overwrite, "cannot be combined with resume=True (resume continues the run in "
                                                  "out, overwrite deletes it)")
    cfg = runs.with_progress(make_config(config, overrides), progress)
    run_dir = Path(out) if out is not None else default_run_dir(cfg)
    check_output_dir(run_dir, "out")
    check_unlocked(run_dir)
    console = make_console() if progress else None
    if overwrite:
        experiment = runtimes.set_up(cfg)  # everything validated (runtimes.set_up's one pass) before a run is deleted
        runs.clear_run_dir(run_dir)
        status = runs.execute(cfg, run_dir, "new", console, experiment)
    else:
        state = runs.state_or_overwrite_hint(cfg, run_dir)
        if state == "unfinished" and not resume:
            raise runs.unfinished_error(run_dir)
        status = runs.execute(cfg, run_dir, state, console)
    return RunResult.load(run_dir, status=status)


# ----------------------------------------------------------------- compare
def run_comparison(methods: list[str], seeds: list[int], configure: Callable[[list[str]], RunConfig], out: Path,
                   target: float | None, *, progress: bool | None, console: Console | None,
                   option: str = "--out", grid: Mapping[str, list[Any]] | None = None,
                   max_runs: int | None = MAX_RUNS, jobs: int = 1) -> CompareResult:
    """Every method x seed into ``out/<method>-seed<k>`` (with a ``grid``: every method x grid cell x seed
    into ``out/<method>/<cell>/seed<k>``, see :mod:`hetfl.sweeps`), then ``comparison.md`` and
    ``comparison.csv``, one row per method (and cell) (``hetfl compare``, :func:`compare`, :func:`hetfl.sweep`).

    ``configure(extra)`` gives the RunConfig with the ``--set``-style ``extra`` overrides
    (``algorithm.name``, ``seed``, the cell's grid values) applied last; ``progress`` sets
    ``runtime.progress`` (None: as configured); ``console`` shows progress, reuse notes and
    ``run k of n (...): about M min left`` before each run (None: silent). Every configuration and
    every folder is checked before any run starts: a folder holding a finished run of the same resolved
    configuration is reused, an interrupted one resumed, another configuration is a RunDirError naming
    the keys (``option`` names the argument to change). ``max_runs``: a plan of more runs is refused before
    any is configured (None: no limit; ``hetfl compare --yes``); ``jobs``: runs at once, each in a worker
    process (:mod:`hetfl.jobs`; 1: one after another in this process)."""
    return with_curves(run_plan(methods, seeds, check_grid(grid), configure, out, target, progress=progress,
                                console=console, option=option, max_runs=max_runs,
                                jobs=jobs))  # + curves.png, in comparison.md


def _folder(out: Any) -> Path:
    """``out`` of :func:`compare` and :func:`sweep` as a path, else a ConfigError naming it (not a TypeError)."""
    if not isinstance(out, str | os.PathLike) or not str(out):
        raise ConfigError("out", out, "must be a folder path for the runs and comparison.md, e.g. 'runs/cmp'")
    return Path(out)


def _method_list(methods: str | Sequence[str]) -> list[str]:
    items = methods.split(",") if isinstance(methods, str) else methods
    if not isinstance(items, Sequence) or not all(isinstance(m, str) for m in items):
        raise ConfigError("methods", methods, "must be a list of method names, e.g. ['fedavg', 'fedprox']")
    names = [m.strip() for m in items]
    if not all(names):  # "fedavg,,fedprox": a typo, perhaps a method left out; not to be guessed past
        raise ConfigError("methods", methods, "has an empty method name; name each method, e.g. 'fedavg,fedprox'")
    if not names or len(set(names)) < len(names):
        raise ConfigError("methods", methods, "must name at least one method, none twice")
    return names


def _seed_list(seeds: int | Sequence[int]) -> list[int]:
    items = [seeds] if isinstance(seeds, int) else seeds
    if (not isinstance(items, Sequence) or isinstance(items, str)
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in items)):
        raise ConfigError("seeds", seeds, "must be a list of integers, e.g. [0, 1, 2]")
    if not items or len(set(items)) < len(items):
        raise ConfigError("seeds", seeds, "must hold at least one seed, none twice")
    return list(items)


def compare(methods: str | Sequence[str], seeds: int | Sequence[int] = (0,), *, config: ConfigLike = None,
            overrides: Sequence[str] = (), out: str | os.PathLike[str], target: float | None = None,
            progress: bool = False, plugins: Sequence[str | os.PathLike[str]] = (), jobs: int = 1) -> CompareResult:
    """Run several methods x seeds on one setting and table them, as ``hetfl compare``.

    ``methods``: names (or one comma-separated string), each set as ``algorithm.name`` on top of
    ``config`` and ``overrides`` (the forms :func:`run` takes); ``seeds``: the seeds of each method;
    ``out``: the folder for the runs (``out/<method>-seed<k>``) and ``comparison.md``/``.csv``;
    ``target``: an accuracy in (0, 1] for the rounds-to-target column. Folders already holding runs
    are reused (finished, same resolved configuration) or resumed (interrupted); another configuration
    there is a RunDirError naming the differing keys, raised before any run starts. ``jobs``: runs at once,
    each in a worker process (the same numbers: :mod:`hetfl.jobs`).

    Returns a :class:`CompareResult`: ``.rows`` as ``comparison.csv`` (one per setting; accuracies in
    fractions like :attr:`RunResult.final_accuracy`, mean and std over seeds), ``.markdown`` as
    ``comparison.md`` (the one place they are in percent, for reading), ``.runs`` every run.

    >>> import hetfl
    >>> table = hetfl.compare(["fedavg", "fedprox"], seeds=[0, 1], overrides=["train.rounds=2"],
    ...                       out="runs/cmp")  # doctest: +SKIP
    >>> [(row["method"], round(row["final_mean"], 3)) for row in table.rows]  # doctest: +SKIP
    [('fedavg', 0.619), ('fedprox', 0.617)]
    """
    _load_plugins(plugins)
    names, seed_list, assignments = _method_list(methods), _seed_list(seeds), _override_list(overrides)
    if target is not None and not (isinstance(target, int | float) and 0 < target <= 1):
        raise ConfigError("target", target, "must be an accuracy in (0, 1]")
    return run_comparison(names, seed_list, lambda extra: make_config(config, [*assignments, *extra]), _folder(out),
                          target, progress=progress, console=make_console() if progress else None, option="out",
                          jobs=jobs)


def sweep(grid: Mapping[str, Sequence[Any]], methods: str | Sequence[str] = ("fedavg",),
          seeds: int | Sequence[int] = (0,), *, config: ConfigLike = None, overrides: Sequence[str] = (),
          out: str | os.PathLike[str], target: float | None = None, progress: bool = False,
          plugins: Sequence[str | os.PathLike[str]] = (), max_runs: int | None = MAX_RUNS,
          jobs: int = 1) -> CompareResult:
    """Run methods x grid cells x seeds and table them: one row per method and cell (the grid's keys that
    vary a column each), mean ± std over seeds; ``hetfl compare --grid`` from Python.

    ``grid``: dotted configuration keys -> lists of values (``{"train.lr": [0.01, 0.1], "data.alpha":
    [0.1, 0.5]}``), Python values as a TOML file would give them; ``methods``, ``seeds``, ``config``,
    ``overrides``, ``out``, ``target``, ``progress``, ``plugins`` and ``jobs`` as :func:`hetfl.compare`. Runs go to
    ``out/<method>/<cell>/seed<k>`` (see :mod:`hetfl.sweeps`); finished runs of the same resolved
    configuration are reused, interrupted ones resumed, another configuration in a folder is a
    RunDirError naming the keys, all decided before any run starts. ``progress=True`` prints the plan's size,
    progress bars and ``run k of n (...): about M min left`` before each run. ``max_runs``: a plan of more runs
    (methods x cells x seeds) is a ConfigError before anything is planned (None: no limit).

    >>> import hetfl
    >>> table = hetfl.sweep({"train.lr": [0.01, 0.1]}, methods=["fedavg"], seeds=[0, 1],
    ...                     overrides=["train.rounds=2"], out="runs/sweep")  # doctest: +SKIP
    >>> [(row["train.lr"], round(row["final_mean"], 3)) for row in table.rows]  # doctest: +SKIP
    [('0.01', 0.552), ('0.1', 0.63)]
    """
    _load_plugins(plugins)
    names, seed_list, assignments = _method_list(methods), _seed_list(seeds), _override_list(overrides)
    checked = check_grid(grid, assignments)
    if target is not None and not (isinstance(target, int | float) and 0 < target <= 1):
        raise ConfigError("target", target, "must be an accuracy in (0, 1]")
    if max_runs is not None and (isinstance(max_runs, bool) or not isinstance(max_runs, int) or max_runs < 0):
        raise ConfigError("max_runs", max_runs, "must be a number of runs >= 0, or None (no limit)")
    return run_comparison(names, seed_list, lambda extra: make_config(config, [*assignments, *extra]), _folder(out),
                          target, progress=progress, console=make_console() if progress else None, option="out",
                          grid=checked, max_runs=max_runs, jobs=jobs)
