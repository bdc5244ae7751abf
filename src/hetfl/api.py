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
import dataclasses
import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from hetfl import config as config_mod
from hetfl import tables
from hetfl.config import RunConfig
from hetfl.engine import identity
from hetfl.params import ConfigError
from hetfl.sweeps import MAX_RUNS

if TYPE_CHECKING:
    from rich.console import Console

    from hetfl.engine.experiment import Experiment

ConfigLike = RunConfig | Mapping[str, Any] | str | os.PathLike[str] | None
#: how a result's run came about: computed now, continued from its checkpoint, found finished, read by ``load``
Status = Literal["ran", "resumed", "reused", "loaded"]
#: what a run directory holds for a planned run (:func:`hetfl.engine.identity.check_run_dir`)
State = Literal["new", "finished", "unfinished"]

__all__ = ["CompareResult", "RunResult", "compare", "make_config", "run", "run_comparison"]


# ----------------------------------------------------------------- configuration
def _override_list(overrides: Sequence[str]) -> list[str]:
    """``overrides`` as a list of ``KEY=VALUE`` strings; a bare string (which would be read letter by
    letter) or a non-string item is a ConfigError."""
    if isinstance(overrides, str) or not isinstance(overrides, Sequence):
        raise ConfigError("overrides", overrides, "must be a list of 'KEY=VALUE' strings, e.g. ['train.lr=0.01']")
    for item in overrides:
        if not isinstance(item, str):
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
        return config_mod.load(config, assignments)
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


def _with_progress(cfg: RunConfig, progress: bool | None) -> RunConfig:
    """``cfg`` with ``runtime.progress`` set (None: as configured); display only, not part of a run's identity."""
    if progress is None or cfg.runtime.progress == progress:
        return cfg
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, progress=progress))


def _load_plugins(plugins: Sequence[str | os.PathLike[str]]) -> None:
    """Import plugin files that register methods (``--plugin FILE`` of the command line)."""
    from hetfl.algorithms import load_plugin

    if isinstance(plugins, str | os.PathLike):
        plugins = [plugins]
    for plugin in plugins:
        load_plugin(str(plugin))


# ----------------------------------------------------------------- results
@dataclass(frozen=True)
class RunResult:
    """One run directory's numbers.

    ``summary`` is ``summary.json``; ``metrics`` the rows of ``metrics.jsonl`` (one dict per round:
    ``round``, ``train_loss``, ``global_acc``, ``client_acc_mean``, ...); ``config`` the resolved
    configuration of ``config.toml``; ``status`` says whether the run was computed by this call
    (``"ran"``), continued (``"resumed"``), found finished (``"reused"``) or read by :meth:`load`.

    >>> result = RunResult.load("runs/demo")  # doctest: +SKIP
    >>> result.final_accuracy, result.metric  # doctest: +SKIP
    (0.71, 'global')
    """

    run_dir: Path
    config: RunConfig
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    status: Status = "loaded"
    #: the resolved configuration tree the tables group by (identity.saved_tree of the folder)
    _tree: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def load(cls, run_dir: str | os.PathLike[str], *, status: Status = "loaded") -> RunResult:
        """Read a finished run directory (``config.toml``, ``summary.json``, ``metrics.jsonl``).
        Raises RunDirError for a folder that holds no finished run."""
        from hetfl.engine.experiment import CONFIG_NAME, METRICS_NAME, SUMMARY_NAME
        from hetfl.engine.rundir import RunDirError

        path = Path(run_dir)
        if not (path / CONFIG_NAME).is_file():
            raise RunDirError(f"{path}: no {CONFIG_NAME}; is it a hetfl run directory?")
        if not (path / SUMMARY_NAME).is_file() or not (path / METRICS_NAME).is_file():
            raise RunDirError(f"{path}: no {SUMMARY_NAME} or {METRICS_NAME}: the run has not finished; continue it "
                              f"with hetfl.run({str(path / CONFIG_NAME)!r}, out={str(path)!r}, resume=True)")
        cfg = config_mod.load(path / CONFIG_NAME)
        record = tables.read_run(path, cfg.algorithm.name, cfg.seed)
        return cls(path, cfg, record.summary, record.metrics, status, record.config)

    def record(self, method: str | None = None) -> tables.RunRecord:
        """This run as a row input of the comparison tables (:mod:`hetfl.tables`), labelled ``method``."""
        return tables.RunRecord(method or self.config.algorithm.name, self.config.seed, self.summary,
                                     self.metrics, self._tree)

    @property
    def metric(self) -> str:
        """Which accuracy the tables report for this run: ``"global"`` (the global model on the global
        test set) or ``"client mean"`` (each client's model on its own test split; personalised methods)."""
        return "global" if self.record().metric_key == "final_global_acc" else "client mean"

    @property
    def final_accuracy(self) -> float:
        """The accuracy (0..1) after the last round, of the kind :attr:`metric` names, as the tables pick it."""
        return float(self.summary[self.record().metric_key])

    @property
    def best_accuracy(self) -> float:
        """The best evaluated accuracy (0..1) over the rounds, of the kind :attr:`metric` names."""
        return float(self.summary[self.record().metric_key.replace("final_", "best_")])

    @property
    def setting_id(self) -> str:
        """Hash of the resolved configuration without the seed (the table row the run belongs to)."""
        return identity.setting_id(self._tree) if self._tree else ""

    @property
    def run_id(self) -> str:
        """Hash of the resolved configuration, seed included (the run itself)."""
        return identity.run_id(self._tree) if self._tree else ""

    def to_dataframe(self) -> Any:
        """The per-round metrics as a pandas DataFrame (one row per round). Needs pandas, which hetfl does
        not depend on: an ImportError naming it when it is not installed (the rows are in :attr:`metrics`)."""
        return _dataframe(self.metrics, "RunResult.to_dataframe", "metrics")


@dataclass(frozen=True)
class CompareResult:
    """A table over runs: ``rows`` are the rows of ``comparison.md`` / ``comparison.csv`` as dicts (one per
    setting: mean and std over seeds of the final and best accuracy, as fractions like
    :attr:`RunResult.final_accuracy`, ...), ``markdown`` the
    table as written, ``runs`` every run (a :class:`RunResult` each), ``out`` the folder holding them."""

    out: Path
    runs: list[RunResult]
    rows: list[dict[str, Any]]
    markdown: str
    target: float | None = None

    @property
    def csv(self) -> str:
        """The table as ``comparison.csv`` holds it."""
        return tables.to_csv(self.rows)

    def to_dataframe(self) -> Any:
        """The rows as a pandas DataFrame (needs pandas: an ImportError naming it otherwise)."""
        return _dataframe(self.rows, "CompareResult.to_dataframe", "rows")


def _dataframe(rows: list[dict[str, Any]], what: str, attribute: str) -> Any:
    try:
        import pandas as pd
    except ImportError:
        raise ImportError(f"{what} needs pandas, which is not installed (hetfl does not depend on it): "
                          f"pip install pandas; the same rows are in .{attribute}, a list of dicts") from None
    return pd.DataFrame(rows)


# ----------------------------------------------------------------- run directories
def plan_states(cfgs: list[RunConfig], run_dirs: list[Path], option: str) -> list[State]:
    """What each run directory holds for the run planned there, compared by resolved configuration:
    ``"new"``, ``"finished"`` (reuse) or ``"unfinished"`` (resume). Every folder is checked before any
    run starts: one holding another configuration or files that are no run is a RunDirError naming
    the differing keys (``option`` names the argument to change)."""
    resolved = identity.resolve_configs(cfgs)
    return [identity.check_run_dir(run_dir, config_mod.to_tree(full), option=option)  # type: ignore[misc]
            for run_dir, full in zip(run_dirs, resolved, strict=True)]


def execute(cfg: RunConfig, run_dir: Path, state: State, console: Console | None,
            experiment: Experiment | None = None,
            on_round: Callable[[dict[str, Any]], object] | None = None) -> Status:
    """Bring the run of ``cfg`` in ``run_dir`` to its end from ``state``: a finished run is reused as it is
    (said on ``console``), an interrupted one goes on from its own ``config.toml`` (as ``hetfl run
    --resume``; the checkpoint's configuration is checked against it), a new one runs (``experiment``:
    already set up for ``cfg``). Progress is shown on ``console`` when ``cfg.runtime.progress``; ``on_round``
    gets each round's metrics line as it is written (the run counter's early estimate)."""
    from hetfl.cli import RichReporter, make_console
    from hetfl.engine.experiment import CONFIG_NAME
    from hetfl.runtimes import run_experiment

    if state == "finished":
        if console is not None:
            console.print(f"{run_dir}: finished earlier, reusing (same configuration)")
        return "reused"
    # what runs: a configuration (set up by run_experiment, after its runtime's checks) or the experiment
    target: RunConfig | Experiment = cfg if experiment is None else experiment
    if state == "unfinished":
        target = config_mod.load(run_dir / CONFIG_NAME)
    reporter = RichReporter(console or make_console(), console is not None and cfg.runtime.progress, on_round)
    try:
        run_experiment(target, run_dir, resume=state == "unfinished", reporter=reporter)
    finally:
        reporter.close()
    return "resumed" if state == "unfinished" else "ran"


def holds_run(run_dir: Path) -> bool:
    """Whether a folder holds a hetfl run: a readable configuration (``config.toml``) and at least one of
    the files a run writes (``metrics.jsonl``, ``summary.json``, ``checkpoint.safetensors``)."""
    from hetfl.engine.checkpoint import CHECKPOINT_NAME
    from hetfl.engine.experiment import CONFIG_NAME, METRICS_NAME, SUMMARY_NAME

    outputs = (METRICS_NAME, SUMMARY_NAME, CHECKPOINT_NAME)
    return ((run_dir / CONFIG_NAME).is_file() and identity.saved_tree(run_dir) is not None
            and any((run_dir / name).is_file() for name in outputs))


def clear_run_dir(run_dir: Path, option: str = "out") -> None:
    """``overwrite=True``: remove the run in ``run_dir`` under its lock, when it holds a hetfl run
    (:func:`holds_run`) or nothing. Only what hetfl writes there is removed (:data:`~hetfl.engine.rundir.RUN_ENTRIES`);
    a folder holding anything else (the user's notes beside a run, files that are no run) is refused with a
    RunDirError naming those files and left as it is, hetfl's own files included."""
    from hetfl.engine.rundir import RunDirError, foreign_entries, lock_run_dir

    if not run_dir.exists() and not run_dir.is_symlink():
        return
    if run_dir.is_symlink() or not run_dir.is_dir():
        raise RunDirError(f"{option} {run_dir}: is not a folder; overwrite=True removes only a folder holding a "
                          f"hetfl run. Pick another {option}")
    with lock_run_dir(run_dir):
        entries = [p for p in run_dir.iterdir() if p.name not in identity.IGNORED]
        if not entries:
            return
        if not holds_run(run_dir):
            raise RunDirError(f"{option} {run_dir}: holds files ({_shown(p.name for p in entries)}) but no hetfl "
                              f"run; overwrite=True removes only a hetfl run directory or an empty folder. Pick "
                              f"another {option}")
        foreign = foreign_entries(run_dir)
        if foreign:
            raise RunDirError(f"{option} {run_dir}: holds files not written by hetfl ({_shown(foreign)}) beside its "
                              f"run; overwrite=True removes only hetfl's files and deletes nothing while others are "
                              f"there. Move them out, or pick another {option}")
        for p in entries:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()


def _shown(names: Iterable[str], limit: int = 5) -> str:
    """Up to ``limit`` names, sorted, joined by commas (``...`` when there are more)."""
    ordered = sorted(names)
    return ", ".join(ordered[:limit]) + (", ..." if len(ordered) > limit else "")


def _unfinished_error(run_dir: Path) -> Exception:
    from hetfl.engine.experiment import METRICS_NAME
    from hetfl.engine.rundir import RunDirError

    path = run_dir / METRICS_NAME
    done = sum(1 for line in path.read_text().splitlines() if line.strip()) if path.is_file() else 0
    return RunDirError(f"out {run_dir}: holds an interrupted run of this configuration ({done} round(s) in "
                       f"{METRICS_NAME}, no summary.json); pass resume=True to continue it, or overwrite=True to "
                       "start it again")


def _state_or_overwrite_hint(cfg: RunConfig, run_dir: Path) -> State:
    """:func:`plan_states` for one run; where ``run_dir`` holds a run of another configuration, the error
    also names ``overwrite=True``, which replaces it (never a folder of other files)."""
    from hetfl.engine.rundir import RunDirError

    try:
        return plan_states([cfg], [run_dir], "out")[0]
    except RunDirError as err:
        if not holds_run(run_dir):
            raise
        raise RunDirError(f"{err}, or pass overwrite=True to replace it") from None


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
    from hetfl.cli import check_output_dir, default_run_dir, make_console
    from hetfl.engine.experiment import Experiment
    from hetfl.engine.rundir import check_unlocked
    from hetfl.runtimes import check_runtime

    _load_plugins(plugins)
    if resume and overwrite:
        raise ConfigError("overwrite", overwrite, "cannot be combined with resume=True (resume continues the run in "
                                                  "out, overwrite deletes it)")
    cfg = _with_progress(make_config(config, overrides), progress)
    run_dir = Path(out) if out is not None else default_run_dir(cfg)
    check_output_dir(run_dir, "out")
    check_unlocked(run_dir)
    console = make_console() if progress else None
    if overwrite:
        check_runtime(cfg)  # everything validated before a run is deleted: the executor's checks, the set-up
        experiment = Experiment(cfg)
        clear_run_dir(run_dir)
        status = execute(cfg, run_dir, "new", console, experiment)
    else:
        state = _state_or_overwrite_hint(cfg, run_dir)
        if state == "unfinished" and not resume:
            raise _unfinished_error(run_dir)
        status = execute(cfg, run_dir, state, console)
    return RunResult.load(run_dir, status=status)


# ----------------------------------------------------------------- compare
def run_comparison(methods: list[str], seeds: list[int], configure: Callable[[list[str]], RunConfig], out: Path,
                   target: float | None, *, progress: bool | None, console: Console | None,
                   option: str = "--out", grid: Mapping[str, list[Any]] | None = None,
                   max_runs: int | None = MAX_RUNS) -> CompareResult:
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
    any is configured (None: no limit; ``hetfl compare --yes``)."""
    from hetfl.report import with_curves
    from hetfl.sweeps import check_grid, run_plan

    return with_curves(run_plan(methods, seeds, check_grid(grid), configure, out, target, progress=progress,
                                console=console, option=option, max_runs=max_runs))  # + curves.png, in comparison.md


def _method_list(methods: str | Sequence[str]) -> list[str]:
    items = methods.split(",") if isinstance(methods, str) else methods
    if not isinstance(items, Sequence) or not all(isinstance(m, str) for m in items):
        raise ConfigError("methods", methods, "must be a list of method names, e.g. ['fedavg', 'fedprox']")
    names = [m.strip() for m in items if m.strip()]
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
            progress: bool = False, plugins: Sequence[str | os.PathLike[str]] = ()) -> CompareResult:
    """Run several methods x seeds on one setting and table them, as ``hetfl compare``.

    ``methods``: names (or one comma-separated string), each set as ``algorithm.name`` on top of
    ``config`` and ``overrides`` (the forms :func:`run` takes); ``seeds``: the seeds of each method;
    ``out``: the folder for the runs (``out/<method>-seed<k>``) and ``comparison.md``/``.csv``;
    ``target``: an accuracy in (0, 1] for the rounds-to-target column. Folders already holding runs
    are reused (finished, same resolved configuration) or resumed (interrupted); another configuration
    there is a RunDirError naming the differing keys, raised before any run starts.

    Returns a :class:`CompareResult`: ``.rows`` as ``comparison.csv`` (one per setting; accuracies in
    fractions like :attr:`RunResult.final_accuracy`, mean and std over seeds), ``.markdown`` as
    ``comparison.md`` (the one place they are in percent, for reading), ``.runs`` every run.

    >>> import hetfl
    >>> table = hetfl.compare(["fedavg", "fedprox"], seeds=[0, 1], overrides=["train.rounds=2"],
    ...                       out="runs/cmp")  # doctest: +SKIP
    >>> [(row["method"], round(row["final_mean"], 3)) for row in table.rows]  # doctest: +SKIP
    [('fedavg', 0.619), ('fedprox', 0.617)]
    """
    from hetfl.cli import make_console

    _load_plugins(plugins)
    names, seed_list, assignments = _method_list(methods), _seed_list(seeds), _override_list(overrides)
    if target is not None and not (isinstance(target, int | float) and 0 < target <= 1):
        raise ConfigError("target", target, "must be an accuracy in (0, 1]")
    return run_comparison(names, seed_list, lambda extra: make_config(config, [*assignments, *extra]), Path(out),
                          target, progress=progress, console=make_console() if progress else None, option="out")
