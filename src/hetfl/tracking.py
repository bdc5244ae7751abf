"""Optional experiment tracking: a run's numbers also sent to TensorBoard and MLflow.

Both are off by default and switched on by the ``tracking`` table of the configuration
(:class:`hetfl.config.TrackingConfig`). The engine knows only :class:`Tracking`, which forwards
four calls to the backends switched on (:class:`TensorBoardTracker`, :class:`MLflowTracker`):

* ``start(cfg, run_dir, history)``: open the store; ``history`` holds the ``metrics.jsonl`` lines
  the run already has (a resumed run's rounds ``1..checkpoint``), of which the backend logs those
  it lacks (none when it was on from round 1; all when it is switched on at the resume);
* ``log_round(round, metrics)``: one ``metrics.jsonl`` line, its numbers with ``step = round``;
* ``finish(summary, run_dir)``: ``summary.json``'s numbers as ``summary/<key>`` and, for MLflow,
  the run folder's files as artifacts (``config.toml``, the ``*.jsonl`` logs, ``summary.json`` and any
  PNG in it: a run writes none itself, ``hetfl analyze`` writes them later into ``analysis/``);
* ``close(failed)``: flush and close (an MLflow run left by an error or Ctrl-C is marked KILLED
  or FAILED; it goes on, RUNNING again, when the run is resumed).

TensorBoard and MLflow are imported only when switched on; a missing package is a ConfigError
naming the extra to install (:func:`check`, called by the experiment's set-up, before anything is
written). What a resume needs lives in ``RUN_DIR/tracking.json`` (:data:`STATE_NAME`): the MLflow
store and run id, which a resumed run continues, and the TensorBoard folder with the rounds it
holds. Rounds after the checkpoint that were logged before an interruption are recomputed with the
same numbers on resume and are not logged twice: MLflow's store is asked which steps the run has,
and TensorBoard is reopened with ``purge_step`` = the first round written again, which makes
TensorBoard's readers drop the earlier copies. None of the ``tracking`` keys is part of a run's
identity (``identity.PRESENTATION_KEYS``).
"""

from __future__ import annotations

import importlib
import json
import math
import re
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from hetfl.engine.checkpoint import atomic_write_text
from hetfl.engine.identity import CONFIG_NAME, SUMMARY_NAME, flatten
from hetfl.params import ConfigError

#: the run folder's record of where tracking went (MLflow store and run id, TensorBoard folder)
STATE_NAME = "tracking.json"
#: the TensorBoard folder inside the run folder when ``tracking.tensorboard_dir`` is empty
TENSORBOARD_DIR = "tensorboard"
METRICS_NAME = "metrics.jsonl"
#: a key every metrics line has: the MLflow steps logged for it are the rounds the MLflow run holds
MARKER = "train_loss"
SUMMARY_PREFIX = "summary/"
#: MLflow's limits (mlflow.utils.validation): params per log_batch call, characters of a param value
PARAMS_PER_BATCH, PARAM_CHARS = 100, 6000


# ------------------------------------------------------------------ helpers
def numbers(line: dict[str, Any], skip: tuple[str, ...] = ("round",)) -> dict[str, float]:
    """The scalar numbers of a metrics line or summary (lists, strings and None left out; a bool is 0/1)."""
    return {k: float(v) for k, v in line.items() if k not in skip and isinstance(v, int | float)}


def param_text(value: Any) -> str:
    """A config value as an MLflow param or hparam: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def config_params(cfg: Any) -> dict[str, str]:
    """The resolved configuration flattened to ``{"train.lr": "0.05", ...}`` (every key, as MLflow params)."""
    from hetfl import config as config_mod

    return {k: param_text(v) for k, v in flatten(config_mod.to_tree(cfg)).items()}


def read_state(run_dir: Path) -> dict[str, Any]:
    """``tracking.json`` of a run folder; {} when absent or unreadable (then the backends start afresh)."""
    try:
        state = json.loads((run_dir / STATE_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def write_state(run_dir: Path, backend: str, entry: dict[str, Any]) -> None:
    """Replace one backend's entry of ``tracking.json`` (written whole, atomically)."""
    state = read_state(run_dir)
    state[backend] = entry
    atomic_write_text(run_dir / STATE_NAME, json.dumps(state, indent=2) + "\n")


def run_name(cfg: Any, run_dir: Path) -> str:
    """``tracking.run_name``, or the run folder's name."""
    return cfg.tracking.run_name or run_dir.resolve().name


def require(module: str, key: str, what: str, extra: str) -> Any:
    """Import ``module`` for the backend switched on by ``key``; a ConfigError naming the extra if absent."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(key, True, f"needs {what}, which is not installed ({err}): "
                                     f"pip install 'hetfl[{extra}]'") from None


def check(cfg: Any) -> None:
    """The packages of the backends switched on are importable (ConfigError naming the extra otherwise).
    Called by the experiment's set-up, before anything is written."""
    t = cfg.tracking
    if t.tensorboard:
        require("tensorboard", "tracking.tensorboard", "TensorBoard", "tensorboard")
        require("torch.utils.tensorboard", "tracking.tensorboard", "TensorBoard", "tensorboard")
    if t.mlflow:
        require("mlflow", "tracking.mlflow", "MLflow", "mlflow")


# ------------------------------------------------------------------ MLflow store
def absolute_uri(uri: str) -> str:
    """A tracking URI that names the same store from any folder: a plain path or a relative ``file:`` or
    ``sqlite:`` location is made absolute against the current folder; other URIs are kept."""
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]+):", uri)
    if uri == "databricks":  # MLflow's name of the Databricks workspace's store
        return uri
    if scheme is None:  # a plain path: a file store
        return Path(uri).expanduser().absolute().as_uri()
    name = scheme.group(1).lower()
    if name == "file":
        parsed = urllib.parse.urlparse(uri)
        if parsed.netloc in ("", "localhost"):
            return Path(urllib.parse.unquote(parsed.path)).expanduser().absolute().as_uri()
    if name == "sqlite" and uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        rest = uri[len("sqlite:///"):]
        path, sep, query = rest.partition("?")
        if path and path != ":memory:":
            return "sqlite:///" + str(Path(path).expanduser().absolute()) + sep + query
    return uri


def mlflow_uri(cfg: Any, recorded: str | None) -> str:
    """The store this run logs to: ``tracking.mlflow_uri``; if empty, the store the run started in (a
    resume continues there, from any folder), else MLflow's own default (``$MLFLOW_TRACKING_URI``, else
    ``sqlite:///mlflow.db`` in the current folder); always absolute."""
    if cfg.tracking.mlflow_uri:
        return absolute_uri(cfg.tracking.mlflow_uri)
    if recorded:
        return recorded
    import mlflow

    return absolute_uri(str(mlflow.get_tracking_uri()))


def check_file_store(cfg: Any, uri: str) -> None:
    """MLflow 3 refuses its file store (``file:`` URIs, plain paths) unless ``MLFLOW_ALLOW_FILE_STORE``
    is true: said as a ConfigError before anything is written, not as MLflow's exception mid-run."""
    if not uri.startswith("file:"):
        return
    env = importlib.import_module("mlflow.environment_variables")
    allow = getattr(env, "MLFLOW_ALLOW_FILE_STORE", None)
    if allow is not None and not allow.get():
        raise ConfigError("tracking.mlflow_uri", cfg.tracking.mlflow_uri or uri,
                          "is an MLflow file store, which this MLflow refuses unless the environment sets "
                          "MLFLOW_ALLOW_FILE_STORE=true; set that, or use a database store such as "
                          "sqlite:///mlflow.db ('' = MLflow's default)")


# ------------------------------------------------------------------ backends
class Tracker:
    """One tracking backend; the base class does nothing (tracking off)."""

    name = "none"

    def start(self, cfg: Any, run_dir: Path, history: list[dict[str, Any]]) -> None:
        """Open the store; log the lines of ``history`` (rounds already run) that the store lacks."""

    def log_round(self, round_: int, metrics: dict[str, Any]) -> None:
        """One round's ``metrics.jsonl`` line, its numbers at ``step = round_``."""

    def finish(self, summary: dict[str, Any], run_dir: Path) -> None:
        """The run finished: its summary (and, where the backend keeps files, the run folder's files)."""

    def close(self, failed: bool = False, interrupted: bool = False) -> None:
        """Flush and close; ``failed``: the run stopped with an exception (``interrupted``: Ctrl-C)."""


class TensorBoardTracker(Tracker):
    """TensorBoard events through ``torch.utils.tensorboard.SummaryWriter``: each round's numbers as
    scalars (tag = the metrics key, step = the round, double precision), the resolved configuration as
    text (tag ``config/text_summary``, step 0) and, at the end, the summary's numbers as ``summary/<key>`` scalars
    and as the metrics of an hparams record of the configuration."""

    name = "tensorboard"

    def __init__(self, cfg: Any, run_dir: Path) -> None:
        """Resolve the folder; a shared ``tracking.tensorboard_dir`` whose ``<run name>`` folder holds
        another run's events is a ConfigError (their steps would mix). Writes nothing."""
        t = cfg.tracking
        inside = not t.tensorboard_dir
        root = run_dir if inside else Path(t.tensorboard_dir).expanduser()
        self.dir = (root / (TENSORBOARD_DIR if inside else run_name(cfg, run_dir))).absolute()
        self.run_dir = run_dir
        recorded = read_state(run_dir).get(self.name, {})
        self.recorded_rounds = int(recorded.get("rounds", 0)) if recorded.get("dir") == str(self.dir) else None
        if not inside and self.recorded_rounds is None and any(self.dir.glob("events.out.tfevents.*")):
            raise ConfigError("tracking.run_name", t.run_name,
                              f"{self.dir} already holds TensorBoard events of another run; set tracking.run_name "
                              "(or tracking.tensorboard_dir) so that this run gets a folder of its own")
        self.writer: Any = None
        self.rounds = 0  # rounds 1..rounds are in the folder

    def start(self, cfg: Any, run_dir: Path, history: list[dict[str, Any]]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        done = min(self.recorded_rounds or 0, len(history))
        # every session starts with a SessionLog.START at its first step; TensorBoard's readers take each
        # START after the first as a restart and drop the steps from it on that earlier sessions wrote
        # (rounds logged after the checkpoint, before an interruption; they are written again now)
        self.writer = SummaryWriter(str(self.dir), purge_step=done + 1)
        if self.recorded_rounds is None:
            from hetfl import config as config_mod

            text = "\n".join("    " + line for line in config_mod.dumps(cfg).splitlines())  # markdown code block
            self.writer.add_text("config", text, 0)
        self.rounds = done
        for line in history[done:]:
            self.log_round(int(line["round"]), line)
        self.writer.flush()
        self.save()

    def save(self) -> None:
        write_state(self.run_dir, self.name, {"dir": str(self.dir), "rounds": self.rounds})

    def log_round(self, round_: int, metrics: dict[str, Any]) -> None:
        if round_ <= self.rounds:
            return
        for tag, value in numbers(metrics).items():
            self.writer.add_scalar(tag, value, round_, new_style=True, double_precision=True)
        self.writer.flush()  # a killed run keeps every round it logged
        self.rounds = round_

    def finish(self, summary: dict[str, Any], run_dir: Path) -> None:
        from torch.utils.tensorboard.summary import hparams

        step = int(summary.get("rounds") or self.rounds)
        final = {SUMMARY_PREFIX + k: v for k, v in numbers(summary, skip=()).items() if math.isfinite(v)}
        for tag, value in final.items():
            self.writer.add_scalar(tag, value, step, new_style=True, double_precision=True)
        config = {k: param_text(v) if not isinstance(v, int | float) else v
                  for k, v in flatten(summary.get("config", {})).items()}
        for record in hparams(config, final):
            self.writer.file_writer.add_summary(record, step)
        self.writer.flush()

    def close(self, failed: bool = False, interrupted: bool = False) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
            self.save()


class MLflowTracker(Tracker):
    """An MLflow run through ``mlflow.tracking.MlflowClient`` (no global active run, so a notebook's own
    MLflow use is left alone): the flattened resolved configuration as params, each round's numbers as
    metrics (step = round), the summary's numbers as ``summary/<key>`` metrics, the run folder's files
    as artifacts, tags ``hetfl.run_id``/``hetfl.setting_id`` (the run's identity) and ``hetfl.run_dir``."""

    name = "mlflow"

    def __init__(self, cfg: Any, run_dir: Path) -> None:
        """Resolve the store (a file store MLflow would refuse is a ConfigError). Writes nothing."""
        self.run_dir = run_dir
        self.recorded = read_state(run_dir).get(self.name, {})
        self.uri = mlflow_uri(cfg, self.recorded.get("uri"))
        check_file_store(cfg, self.uri)
        self.client: Any = None
        self.run_id = ""
        self.logged: set[int] = set()
        self.finished = False

    def start(self, cfg: Any, run_dir: Path, history: list[dict[str, Any]]) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        self.run_id = self.continued_run() or self.new_run(cfg, run_dir)
        write_state(run_dir, self.name, {"uri": self.uri, "run_id": self.run_id,
                                         "experiment": cfg.tracking.experiment})
        for line in history:
            self.log_round(int(line["round"]), line)

    def continued_run(self) -> str | None:
        """The run recorded in ``tracking.json`` when it is in this store and not deleted (RUNNING again,
        with the rounds it holds read from the store); None otherwise."""
        run_id = self.recorded.get("run_id")
        if not run_id or self.recorded.get("uri") != self.uri:
            return None
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            return None
        if run.info.lifecycle_stage != "active":
            return None
        self.client.update_run(run_id, status="RUNNING")
        self.logged = {int(m.step) for m in self.client.get_metric_history(run_id, MARKER)}
        return run_id

    def experiment_id(self, name: str) -> str:
        """The id of experiment ``name``, created when absent (another process creating it at the same time
        is fine); a deleted one is a ConfigError (MLflow refuses runs in it)."""
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(name)
        if found is None:
            try:
                return self.client.create_experiment(name)
            except MlflowException:
                found = self.client.get_experiment_by_name(name)
                if found is None:
                    raise
        if found.lifecycle_stage != "active":
            raise ConfigError("tracking.experiment", name, f"is a deleted MLflow experiment in {self.uri}; restore "
                                                           "it (mlflow experiments restore) or pick another name")
        return found.experiment_id

    def new_run(self, cfg: Any, run_dir: Path) -> str:
        """A new MLflow run with the configuration as params and the run's identity as tags."""
        from mlflow.entities import Param

        from hetfl import config as config_mod
        from hetfl.engine.identity import run_id, setting_id

        tree = config_mod.to_tree(cfg)
        tags = {"hetfl.run_id": run_id(tree), "hetfl.setting_id": setting_id(tree),
                "hetfl.run_dir": str(run_dir.resolve()), "hetfl.algorithm": cfg.algorithm.name}
        run = self.client.create_run(self.experiment_id(cfg.tracking.experiment), run_name=run_name(cfg, run_dir),
                                     tags=tags)
        params = [Param(k, v[:PARAM_CHARS]) for k, v in config_params(cfg).items()]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(run.info.run_id, params=params[i : i + PARAMS_PER_BATCH])
        return run.info.run_id

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # the marker last: a batch cut short by a kill is then logged again in full on resume
        order = sorted(values, key=lambda k: k == MARKER)
        self.client.log_batch(self.run_id, metrics=[Metric(k, values[k], now, step) for k in order])

    def log_round(self, round_: int, metrics: dict[str, Any]) -> None:
        if round_ in self.logged:
            return
        self.log_metrics(numbers(metrics), round_)
        self.logged.add(round_)

    def finish(self, summary: dict[str, Any], run_dir: Path) -> None:
        step = int(summary.get("rounds") or max(self.logged, default=0))
        self.log_metrics({SUMMARY_PREFIX + k: v for k, v in numbers(summary, skip=()).items()}, step)
        for path in artifacts(run_dir):
            folder = path.parent.relative_to(run_dir).as_posix()
            self.client.log_artifact(self.run_id, str(path), None if folder == "." else folder)
        self.client.set_terminated(self.run_id, "FINISHED")
        self.finished = True

    def close(self, failed: bool = False, interrupted: bool = False) -> None:
        if self.client is not None and self.run_id and not self.finished:
            with suppress(Exception):  # the run's own error is the one to report
                self.client.set_terminated(self.run_id, "KILLED" if interrupted or not failed else "FAILED")
        self.client = None


def artifacts(run_dir: Path) -> list[Path]:
    """The run folder's files an MLflow run keeps: ``config.toml``, ``summary.json``, the per-round logs
    (``metrics.jsonl`` and any other ``*.jsonl`` beside it) and any PNG in the folder (``hetfl analyze``'s
    plots, when it ran before; the TensorBoard folder is left out). Checkpoints and models are not kept."""
    logs = sorted(p for p in run_dir.glob("*.jsonl") if p.name != METRICS_NAME)
    files = [run_dir / CONFIG_NAME, run_dir / METRICS_NAME, *logs, run_dir / SUMMARY_NAME]
    pngs = sorted(p for p in run_dir.rglob("*.png") if TENSORBOARD_DIR not in p.relative_to(run_dir).parts)
    return [p for p in [*files, *pngs] if p.is_file()]


BACKENDS: dict[str, type[Tracker]] = {"tensorboard": TensorBoardTracker, "mlflow": MLflowTracker}


# ------------------------------------------------------------------ what the engine calls
class Tracking:
    """The backends a run's configuration switches on, as one :class:`Tracker` for the engine (which
    knows no backend). Built by :func:`open_tracking` before the run writes anything."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def start(self, cfg: Any, run_dir: Path, history: list[dict[str, Any]]) -> None:
        for tracker in self.trackers:
            tracker.start(cfg, run_dir, history)

    def log_round(self, round_: int, metrics: dict[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log_round(round_, metrics)

    def finish(self, summary: dict[str, Any], run_dir: Path) -> None:
        for tracker in self.trackers:
            tracker.finish(summary, run_dir)

    def close(self, failed: bool = False, interrupted: bool = False) -> None:
        for tracker in self.trackers:
            tracker.close(failed, interrupted)

    @contextmanager
    def session(self, cfg: Any, run_dir: Path, history: list[dict[str, Any]]) -> Iterator[Tracking]:
        """``start`` … ``close`` around the rounds; an exception closes the backends as failed (Ctrl-C:
        interrupted) and goes on."""
        try:
            self.start(cfg, run_dir, history)
            yield self
        except BaseException as err:
            self.close(failed=True, interrupted=isinstance(err, KeyboardInterrupt))
            raise
        self.close()


#: tracking off: what the engine holds outside a run
NO_TRACKING = Tracking([])


def open_tracking(cfg: Any, run_dir: Path) -> Tracking:
    """The backends ``cfg.tracking`` switches on for ``run_dir``, with their stores resolved and checked
    (ConfigError before anything is written); nothing is opened or written until ``start``."""
    t = cfg.tracking
    if not (t.tensorboard or t.mlflow):
        return NO_TRACKING
    check(cfg)
    return Tracking([cls(cfg, run_dir) for name, cls in BACKENDS.items() if getattr(t, name)])


__all__ = ["NO_TRACKING", "STATE_NAME", "MLflowTracker", "TensorBoardTracker", "Tracker", "Tracking", "check",
           "open_tracking"]
