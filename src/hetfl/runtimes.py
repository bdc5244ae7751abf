"""Which runtime runs an experiment (``runtime.executor``): the layer above the engine that picks one.

The engine (:class:`~hetfl.engine.experiment.Experiment`) runs the round loop and reaches the clients
only through its :class:`~hetfl.engine.federation.Federation`; it imports no runtime. ``sequential``
and ``vectorized`` run the clients in this process (the experiment's own federation, ``Experiment.run``);
``flower`` runs them on Flower's simulation engine (:mod:`hetfl.flower.simulation`, which attaches a
``FlowerFederation``). ``hetfl run``, the Python API, ``hetfl compare`` and sweeps, and ``hetfl reproduce``
run experiments through :func:`run_experiment`. :func:`set_up` sets an experiment up with what the engine is
handed from above: hetfl's trackers (:mod:`hetfl.tracking`: TensorBoard, MLflow).

Flower, an optional dependency, is imported only when its executor is asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetfl import tracking
from hetfl.config import RunConfig
from hetfl.engine.experiment import Experiment
from hetfl.params import ConfigError

if TYPE_CHECKING:
    from hetfl.engine.summary import Reporter

Runner = Callable[["Experiment", Path, bool, "Reporter | None"], dict[str, Any]]


@dataclass(frozen=True)
class Runtime:
    """An executor: ``check`` refuses what it cannot run (a missing package, a setting it cannot honour)
    with a ConfigError before any work; ``run`` runs a set-up experiment into a run directory and
    returns its summary."""

    check: Callable[[RunConfig], None]
    run: Runner


def _no_check(cfg: RunConfig) -> None:
    pass


def _in_process(exp: Experiment, run_dir: Path, resume: bool, reporter: Reporter | None) -> dict[str, Any]:
    return exp.run(run_dir, resume=resume, reporter=reporter)


def _check_flower(cfg: RunConfig) -> None:
    from hetfl.flower import check_flower  # optional dependency (hetfl[flower]): imported when asked for

    check_flower(cfg)


def _flower_simulation(exp: Experiment, run_dir: Path, resume: bool, reporter: Reporter | None) -> dict[str, Any]:
    from hetfl.flower.simulation import run_simulation  # optional (hetfl[flower]): the clients on Flower

    return run_simulation(exp, run_dir, resume=resume, reporter=reporter)


#: ``runtime.executor`` -> its runtime
RUNTIMES: dict[str, Runtime] = {
    "sequential": Runtime(_no_check, _in_process),
    "vectorized": Runtime(_no_check, _in_process),
    "flower": Runtime(_check_flower, _flower_simulation),
}


def runtime_of(cfg: RunConfig) -> Runtime:
    name = cfg.runtime.executor
    if name not in RUNTIMES:
        raise ConfigError("runtime.executor", name, f"must be one of {', '.join(RUNTIMES)}")
    return RUNTIMES[name]


def check_runtime(cfg: RunConfig) -> None:
    """The executor's own checks (Flower installed, settings it supports): a ConfigError before any output."""
    runtime_of(cfg).check(cfg)


def set_up(cfg: RunConfig) -> Experiment:
    """The experiment of ``cfg``, resolved in one pass down the layers, each key checked by the module that owns
    it, every key that needs no data before any data is read, and nothing written (a run folder is made only by
    ``Experiment.run``). ``cfg``'s syntax and types were checked when it was made (:mod:`hetfl.config`,
    :mod:`hetfl.params`); then, in this order:

    1. runtimes (here): ``runtime.executor`` and what its runtime cannot honour (Flower installed, ...);
    2. engine, before the data (:func:`hetfl.engine.experiment.check_config`): ``runtime.device``, ``algorithm.*``
       (the methods' registry), ``runtime.secure_aggregation``, ``tracking.*`` (the trackers handed here:
       :data:`hetfl.tracking.TRACKERS`), ``runtime.save_client_models``, what must fit in memory;
    3. data: the dataset read (``data.*``, :mod:`hetfl.data.datasets`), ``auto`` model and partition and the
       method's defaults resolved (:func:`hetfl.engine.setup.resolve`), ``train.clients_per_round``, the
       partition (:mod:`hetfl.data.partition`), the step plan's and the model's memory;
    4. model and method: the model built (:mod:`hetfl.models`), the parts the method needs
       (:func:`hetfl.algorithms.check_model_parts`), the method and its post-hoc steps built."""
    check_runtime(cfg)
    return Experiment(cfg, trackers=tracking.TRACKERS)


def run_experiment(cfg_or_experiment: RunConfig | Experiment, run_dir: str | Path, *, resume: bool = False,
                   reporter: Reporter | None = None, trained: str | Path | None = None) -> dict[str, Any]:
    """Run (or continue, ``resume``) an experiment in ``run_dir`` with the runtime its ``runtime.executor``
    names; returns the summary. ``cfg_or_experiment``: a RunConfig (set up here, after the runtime's
    checks) or an :class:`~hetfl.engine.experiment.Experiment` already set up. ``trained``: a finished
    run to take the training from (only the post-hoc steps run: ``Experiment.run``'s ``trained``; in this
    process). Raises what the set-up and ``Experiment.run`` raise, the runtime's ConfigErrors first, all
    before anything is written."""
    cfg = cfg_or_experiment if isinstance(cfg_or_experiment, RunConfig) else cfg_or_experiment.cfg
    if trained is not None and cfg.runtime.executor == "flower":
        raise ConfigError("runtime.executor", "flower", "a run that starts from another's training (trained=) "
                          "runs only its post-hoc steps, in this process: use sequential or vectorized")
    if isinstance(cfg_or_experiment, RunConfig):
        exp = set_up(cfg_or_experiment)  # the runtime's checks first
    else:
        exp = cfg_or_experiment
        check_runtime(exp.cfg)  # set up elsewhere: the runtime's checks, before anything is written
    if trained is not None:
        return exp.run(Path(run_dir), reporter=reporter, trained=trained)
    return runtime_of(exp.cfg).run(exp, Path(run_dir), resume, reporter)


__all__ = ["RUNTIMES", "Runtime", "check_runtime", "run_experiment", "set_up"]
