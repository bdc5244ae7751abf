"""Where a run's numbers are also sent, as the engine sees it: the interface the engine owns and is handed,
as it is handed its :class:`~hetfl.engine.federation.Federation`.

:class:`Trackers` is what :class:`~hetfl.engine.experiment.Experiment` is given (``Experiment(cfg,
trackers=...)``): it checks the ``tracking.*`` keys before any work and opens a :class:`RunTracker` for a run.
:mod:`hetfl.tracking` implements it (TensorBoard, MLflow: ``hetfl.tracking.TRACKERS``), above the engine;
:func:`hetfl.runtimes.set_up` hands it, so every run of ``hetfl run``, :func:`hetfl.run`, compare, sweeps
and reproduce is tracked as configured. The engine knows no backend: without trackers (:data:`NO_TRACKERS`,
the default) a configuration that switches tracking on is refused by :meth:`Experiment.run
<hetfl.engine.experiment.Experiment.run>` before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Protocol

from hetfl.config import RunConfig

#: the ``tracking.*`` switches that send a run's numbers somewhere
SWITCHES = ("tensorboard", "mlflow")


class RunTracker(Protocol):
    """One run's trackers: opened around the rounds (``session``), told each round's metrics line and the
    summary."""

    def session(self, cfg: Any, run_dir: Path, history: list[dict[str, Any]]) -> AbstractContextManager[Any]:
        """``start`` (logging ``history``, the rounds already run) ... ``close`` around the rounds."""
        ...

    def log_round(self, round_: int, metrics: dict[str, Any]) -> None: ...

    def finish(self, summary: dict[str, Any], run_dir: Path) -> None: ...


class Trackers(Protocol):
    """What the engine is handed: checks the ``tracking.*`` keys (a ConfigError before any work) and opens a
    run's :class:`RunTracker` (its stores checked; writes nothing until the session starts)."""

    def check(self, cfg: RunConfig) -> None: ...

    def open(self, cfg: RunConfig, run_dir: Path) -> RunTracker: ...


class _NoRunTracker:
    """Tracking off: every call does nothing."""

    @contextmanager
    def session(self, cfg: Any, run_dir: Path, history: list[dict[str, Any]]) -> Iterator[_NoRunTracker]:
        yield self

    def log_round(self, round_: int, metrics: dict[str, Any]) -> None:
        pass

    def finish(self, summary: dict[str, Any], run_dir: Path) -> None:
        pass


class _NoTrackers:
    """No backend handed: nothing to check, nothing opened (:meth:`Experiment.run` refuses a configuration
    that switches tracking on, see :func:`untracked_switch`)."""

    def check(self, cfg: RunConfig) -> None:
        pass

    def open(self, cfg: RunConfig, run_dir: Path) -> RunTracker:
        return NO_RUN_TRACKER


NO_RUN_TRACKER = _NoRunTracker()
NO_TRACKERS: Trackers = _NoTrackers()


def untracked_switch(cfg: RunConfig, trackers: Trackers) -> str | None:
    """The first ``tracking.*`` switch ``cfg`` turns on that no handed trackers can honour (None: none)."""
    if trackers is not NO_TRACKERS:
        return None
    return next((f"tracking.{name}" for name in SWITCHES if getattr(cfg.tracking, name)), None)


__all__ = ["NO_RUN_TRACKER", "NO_TRACKERS", "RunTracker", "Trackers", "untracked_switch"]
