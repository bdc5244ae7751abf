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

TensorBoard and MLflow are imported only when switched on; a missing package, or a store that cannot
be used, is a ConfigError naming the key (:func:`check`, called by the experiment's set-up, before
anything is written): an MLflow URI of a scheme MLflow does not know, a server (MLflow over HTTP, a
database server) that does not accept a connection within :data:`CONNECT_TIMEOUT_S`, an SQLite database
or a folder (MLflow's file store, ``tracking.tensorboard_dir``) that cannot be made there, a file that
is no SQLite database. A store that fails once the run is going loses the run nothing: the backend is
dropped with one warning, and the run folder (``metrics.jsonl``, ``summary.json``) stays the record.
Requests to an MLflow server get a bounded time (``MLFLOW_HTTP_REQUEST_TIMEOUT``, default here
:data:`HTTP_TIMEOUT_S`) and few retries (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, default here
:data:`HTTP_RETRIES`) unless the environment sets them.

What a resume needs lives in ``RUN_DIR/tracking.json`` (:data:`STATE_NAME`): the MLflow
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
import logging
import math
import os
import re
import socket
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from hetfl import config as config_mod
from hetfl.engine.identity import CONFIG_NAME, SUMMARY_NAME, flatten, run_id, setting_id
from hetfl.files import atomic_write_text
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
#: seconds a tracking server (MLflow over HTTP, a database server) gets to accept a connection at the check
CONNECT_TIMEOUT_S = 5.0
#: MLflow's request timeout (s) and retries for a server, unless the environment sets them (MLflow's defaults,
#: 120 s and 7 retries with backoff, would hold a run for many minutes on a server gone away)
HTTP_TIMEOUT_S, HTTP_RETRIES = 30, 2
#: the port a server URI without one uses, by scheme (the part before a ``+driver``)
DEFAULT_PORTS = {"http": 80, "https": 443, "postgresql": 5432, "mysql": 3306, "mssql": 1433}
SQLITE_HEADER = b"SQLite format 3\x00"

log = logging.getLogger("hetfl")


# ------------------------------------------------------------------ helpers
def numbers(line: dict[str, Any], skip: tuple[str, ...] = ("round",)) -> dict[str, float]:
    """The scalar numbers of a metrics line or summary (lists, strings and None left out; a bool is 0/1)."""
    return {k: float(v) for k, v in line.items() if k not in skip and isinstance(v, int | float)}


def param_text(value: Any) -> str:
    """A config value as an MLflow param or hparam: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def config_params(cfg: Any) -> dict[str, str]:
    """The resolved configuration flattened to ``{"train.lr": "0.05", ...}`` (every key, as MLflow params)."""
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
    """The packages of the backends switched on are importable (ConfigError naming the extra otherwise) and
    their stores can be used (:func:`check_mlflow_store`, :func:`check_folder`). Called by the experiment's
    set-up, before anything is written."""
    t = cfg.tracking
    if t.tensorboard:
        require("tensorboard", "tracking.tensorboard", "TensorBoard", "tensorboard")
        require("torch.utils.tensorboard", "tracking.tensorboard", "TensorBoard", "tensorboard")
        if t.tensorboard_dir:
            check_folder("tracking.tensorboard_dir", t.tensorboard_dir, Path(t.tensorboard_dir).expanduser())
    if t.mlflow:
        require("mlflow", "tracking.mlflow", "MLflow", "mlflow")
        check_mlflow_store(cfg)


def check_folder(key: str, value: str, path: Path) -> None:
    """A folder that can be made (or is there) and written: its nearest existing ancestor is a folder in which a
    temporary folder can be made (and is removed at once). A ConfigError naming ``key`` otherwise."""
    existing = path.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(key, value, f"{existing} is a file, not a folder: name a folder that can hold it")
    try:
        tempfile.TemporaryDirectory(dir=existing, prefix=".hetfl-check-").cleanup()
    except OSError as err:
        raise ConfigError(key, value, f"no folder can be made in {existing} ({err.strerror or err}): name a "
                                      "writable folder") from None


def check_mlflow_store(cfg: Any) -> None:
    """``tracking.mlflow_uri`` (or MLflow's default store when empty) names a store this MLflow can use: a scheme
    it knows, a file store it allows in a folder that can be made, an SQLite database that is one (or can be
    made), a server that accepts a connection within :data:`CONNECT_TIMEOUT_S`. ConfigError naming the key."""
    import mlflow

    value = cfg.tracking.mlflow_uri
    uri = absolute_uri(value) if value else absolute_uri(str(mlflow.get_tracking_uri()))
    shown = value or uri
    check_scheme(shown, uri)
    scheme = uri.partition(":")[0].lower() if re.match(r"[A-Za-z][A-Za-z0-9+.-]+:", uri) else ""
    if scheme == "file":
        check_file_store(cfg, uri)
        check_folder("tracking.mlflow_uri", shown, Path(urllib.request.url2pathname(urllib.parse.urlparse(uri).path)))
    elif scheme == "sqlite":
        check_sqlite(shown, uri)
    elif scheme.partition("+")[0] in DEFAULT_PORTS:
        check_reachable(shown, uri, scheme.partition("+")[0])


def check_scheme(shown: str, uri: str) -> None:
    """MLflow has a store for ``uri``'s scheme (its registry of tracking stores, plugins included)."""
    try:
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry as registry
    except ImportError:  # another MLflow layout: its own error comes when the store is opened
        return
    try:
        registry.get_store_builder(uri)
    except Exception:
        schemes = ", ".join(sorted(s for s in registry._registry if s))
        scheme = uri.partition(":")[0] if ":" in uri else uri
        raise ConfigError("tracking.mlflow_uri", shown, f"is not a store MLflow knows: its scheme {scheme!r} is none "
                                                        f"of {schemes} (or a plain folder path)") from None


def check_sqlite(shown: str, uri: str) -> None:
    """An SQLite store: the database file is one (or empty), or its folder can be made and written."""
    if not uri.startswith("sqlite:///"):  # sqlite:// : a database in memory
        return
    path_text = uri[len("sqlite:///"):].partition("?")[0]  # absolute_uri made a relative path absolute
    if path_text in ("", ":memory:"):
        return
    path = Path(path_text)
    key = "tracking.mlflow_uri"
    if path.is_dir():
        raise ConfigError(key, shown, f"{path} is a folder, not an SQLite database")
    if path.exists():
        try:
            with open(path, "rb") as f:
                head = f.read(len(SQLITE_HEADER))
        except OSError as err:
            raise ConfigError(key, shown, f"{path} cannot be read ({err.strerror or err})") from None
        if head and head != SQLITE_HEADER:
            raise ConfigError(key, shown, f"{path} is not an SQLite database (a file of another kind); name a new "
                                          "file or an MLflow database")
        return
    check_folder(key, shown, path.parent)  # MLflow makes the database's folders


def check_reachable(shown: str, uri: str, scheme: str) -> None:
    """A server store (MLflow over HTTP, a database server) accepts a TCP connection within
    :data:`CONNECT_TIMEOUT_S` seconds (a bounded check: MLflow's own retries take minutes to give up)."""
    key = "tracking.mlflow_uri"
    try:
        parsed = urllib.parse.urlparse(uri)
        host, port = parsed.hostname, parsed.port or DEFAULT_PORTS[scheme]
    except ValueError as err:
        raise ConfigError(key, shown, f"is not a valid server URI ({err})") from None
    if not host:
        raise ConfigError(key, shown, "names no host (e.g. http://127.0.0.1:5000)")
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as err:
        raise ConfigError(key, shown, f"cannot connect to {host}:{port} within {CONNECT_TIMEOUT_S:g} s "
                                      f"({err.strerror or err}); start the server, or fix the URI") from None


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

        if self.uri.startswith(("http:", "https:")):  # bounded requests, unless the environment says otherwise
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(HTTP_TIMEOUT_S))
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(HTTP_RETRIES))
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
    knows no backend). Built by :func:`open_tracking` before the run writes anything. A backend whose store
    fails during the run (an exception other than a ConfigError) is dropped with one warning and the run goes
    on: its numbers are all in the run folder, which is the record (:meth:`drop`)."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def _each(self, call: str, *args: Any) -> None:
        """``call`` on every backend still on; one that raises is dropped."""
        for tracker in list(self.trackers):
            try:
                getattr(tracker, call)(*args)
            except ConfigError:  # a setting to fix (a deleted MLflow experiment): exit 2, as before
                raise
            except Exception as err:
                self.drop(tracker, call, err)

    def drop(self, tracker: Tracker, call: str, err: Exception) -> None:
        """Stop sending to ``tracker`` after its store failed in ``call``; said once, as a warning."""
        self.trackers.remove(tracker)
        log.warning("tracking: %s stopped (%s failed: %s: %s); the run goes on without it and loses nothing: "
                    "metrics.jsonl and summary.json in the run folder hold every number", tracker.name, call,
                    type(err).__name__, " ".join(str(err).split())[:300])
        with suppress(Exception):
            tracker.close(failed=True)

    def start(self, cfg: Any, run_dir: Path, history: list[dict[str, Any]]) -> None:
        self._each("start", cfg, run_dir, history)

    def log_round(self, round_: int, metrics: dict[str, Any]) -> None:
        self._each("log_round", round_, metrics)

    def finish(self, summary: dict[str, Any], run_dir: Path) -> None:
        self._each("finish", summary, run_dir)

    def close(self, failed: bool = False, interrupted: bool = False) -> None:
        self._each("close", failed, interrupted)

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


class Backends:
    """hetfl's tracking backends as the engine is handed them (:class:`hetfl.engine.tracker.Trackers`):
    ``Experiment(cfg, trackers=TRACKERS)``, which :func:`hetfl.runtimes.set_up` does."""

    def check(self, cfg: Any) -> None:
        check(cfg)

    def open(self, cfg: Any, run_dir: Path) -> Tracking:
        return open_tracking(cfg, run_dir)


#: what the engine is handed (:mod:`hetfl.engine.tracker`)
TRACKERS = Backends()

__all__ = ["NO_TRACKING", "STATE_NAME", "TRACKERS", "Backends", "MLflowTracker", "TensorBoardTracker", "Tracker",
           "Tracking", "check", "open_tracking"]
