"""A run in its folder, for the API, the sweeps and the reproductions alike: what a folder holds for the run
planned there (:func:`plan_states`), bringing that run to its end (:func:`execute`: run, resume or reuse),
clearing a folder for ``overwrite=True`` (:func:`clear_run_dir`), and the results read back from folders
(:class:`RunResult`, :class:`CompareResult`).

Below :mod:`hetfl.api`, :mod:`hetfl.sweeps`, :mod:`hetfl.report` and :mod:`hetfl.reproduce` (which all use it),
above :mod:`hetfl.runtimes` (which runs what it plans) and :mod:`hetfl.console` (progress).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from hetfl import config as config_mod
from hetfl import runtimes, tables
from hetfl.config import RunConfig
from hetfl.console import RichReporter, make_console
from hetfl.engine import identity
from hetfl.engine.checkpoint import CHECKPOINT_NAME
from hetfl.engine.experiment import CONFIG_NAME, METRICS_NAME, SUMMARY_NAME
from hetfl.engine.ledger import LEDGER_NAME, read_entries
from hetfl.engine.resolve import resolve_configs
from hetfl.engine.rundir import RunDirError, foreign_entries, lock_run_dir

if TYPE_CHECKING:
    import os

    from rich.console import Console

    from hetfl.engine.resolve import resolve_configs
from hetfl.engine.experiment import Experiment

#: how a result's run came about: computed now, continued from its checkpoint, found finished, read by ``load``
Status = Literal["ran", "resumed", "reused", "loaded"]
#: what a run directory holds for a planned run (:func:`hetfl.engine.identity.check_run_dir`)
State = Literal["new", "finished", "unfinished"]

__all__ = ["CompareResult", "RunResult", "State", "Status", "clear_run_dir", "execute", "holds_run", "plan_states",
           "with_progress"]


def with_progress(cfg: RunConfig, progress: bool | None) -> RunConfig:
    """``cfg`` with ``runtime.progress`` set (None: as configured); display only, not part of a run's identity."""
    if progress is None or cfg.runtime.progress == progress:
        return cfg
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, progress=progress))


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
        path = Path(run_dir)
        if not (path / CONFIG_NAME).is_file():
            raise RunDirError(f"{path}: no {CONFIG_NAME}; is it a hetfl run directory?")
        if not (path / SUMMARY_NAME).is_file() or not (path / METRICS_NAME).is_file():
            raise RunDirError(f"{path}: no {SUMMARY_NAME} or {METRICS_NAME}: the run has not finished; continue it "
                              f"with hetfl.run({str(path / CONFIG_NAME)!r}, out={str(path)!r}, resume=True)")
        cfg = identity.load_run_config(path / CONFIG_NAME)
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
        import pandas as pd  # optional: hetfl does not depend on pandas
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
    resolved = resolve_configs(cfgs)
    return [identity.check_run_dir(run_dir, config_mod.to_tree(full), option=option)  # type: ignore[misc]
            for run_dir, full in zip(run_dirs, resolved, strict=True)]


def execute(cfg: RunConfig, run_dir: Path, state: State, console: Console | None,
            experiment: Experiment | None = None,
            on_round: Callable[[dict[str, Any]], object] | None = None, trained: Path | None = None) -> Status:
    """Bring the run of ``cfg`` in ``run_dir`` to its end from ``state``: a finished run is reused as it is
    (said on ``console``), an interrupted one goes on from its own ``config.toml`` (as ``hetfl run
    --resume``; the checkpoint's configuration is checked against it), a new one runs (``experiment``:
    already set up for ``cfg``; ``trained``: from that run's training, its post-hoc steps only). Progress is
    shown on ``console`` when ``cfg.runtime.progress``; ``on_round`` gets each round's metrics line as it is
    written (the run counter's early estimate)."""
    if state == "finished":
        if console is not None:
            console.print(f"{run_dir}: finished earlier, reusing (same configuration)")
        return "reused"
    # what runs: a configuration (set up by run_experiment, after its runtime's checks) or the experiment
    target: RunConfig | Experiment = cfg if experiment is None else experiment
    if state == "unfinished":
        target = identity.load_run_config(run_dir / CONFIG_NAME)
    reporter = RichReporter(console or make_console(), console is not None and cfg.runtime.progress, on_round)
    try:
        runtimes.run_experiment(target, run_dir, resume=state == "unfinished", reporter=reporter,
                                trained=trained if state == "new" else None)
    finally:
        reporter.close()
    return "resumed" if state == "unfinished" else "ran"


def holds_run(run_dir: Path) -> bool:
    """Whether a folder holds a hetfl run: a readable configuration (``config.toml``) and at least one of
    the files a run writes (``metrics.jsonl``, ``summary.json``, ``checkpoint.safetensors``)."""
    outputs = (METRICS_NAME, SUMMARY_NAME, CHECKPOINT_NAME)
    return ((run_dir / CONFIG_NAME).is_file() and identity.saved_tree(run_dir) is not None
            and any((run_dir / name).is_file() for name in outputs))


def clear_run_dir(run_dir: Path, option: str = "out") -> None:
    """``overwrite=True``: remove the run in ``run_dir`` under its lock, when it holds a hetfl run
    (:func:`holds_run`) or nothing. Only what hetfl writes there is removed (:data:`~hetfl.engine.rundir.RUN_ENTRIES`);
    a folder holding anything else (the user's notes beside a run, files that are no run) is refused with a
    RunDirError naming those files and left as it is, hetfl's own files included."""
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
        ledger = run_dir / LEDGER_NAME
        if ledger.is_file():
            warn_spent_releases(run_dir, ledger)
        for p in entries:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()


def warn_spent_releases(run_dir: Path, ledger: Path) -> None:
    """Say, before an overwrite deletes it, how many differentially private releases the run's ledger
    recorded: they were made from the clients' data, and what they spent stays spent, while the new run's
    privacy report counts only its own releases."""
    try:
        releases = len(read_entries(ledger))
    except (OSError, ValueError):  # unreadable: say so rather than a count
        releases = None
    made = "an unreadable number of" if releases is None else f"{releases}"
    logging.getLogger("hetfl").warning(
        "overwrite=True: %s held a run whose privacy ledger recorded %s differentially private release(s) of its "
        "clients' data; deleting the record does not undo them, and the new run's privacy report counts only its "
        "own releases", run_dir, made)


def _shown(names: Iterable[str], limit: int = 5) -> str:
    """Up to ``limit`` names, sorted, joined by commas (``...`` when there are more)."""
    ordered = sorted(names)
    return ", ".join(ordered[:limit]) + (", ..." if len(ordered) > limit else "")


def unfinished_error(run_dir: Path) -> Exception:
    path = run_dir / METRICS_NAME
    done = sum(1 for line in path.read_text().splitlines() if line.strip()) if path.is_file() else 0
    return RunDirError(f"out {run_dir}: holds an interrupted run of this configuration ({done} round(s) in "
                       f"{METRICS_NAME}, no summary.json); pass resume=True to continue it, or overwrite=True to "
                       "start it again")


def state_or_overwrite_hint(cfg: RunConfig, run_dir: Path) -> State:
    """:func:`plan_states` for one run; where ``run_dir`` holds a run of another configuration, the error
    also names ``overwrite=True``, which replaces it (never a folder of other files)."""
    try:
        return plan_states([cfg], [run_dir], "out")[0]
    except RunDirError as err:
        if not holds_run(run_dir):
            raise
        raise RunDirError(f"{err}, or pass overwrite=True to replace it") from None
