"""The node side: what hetfl's ClientApp does with each message.

A node holds one client: ``node_config["partition-id"]`` (Flower's simulation sets it; a
deployed ``flower-supernode`` is started with ``--node-config "partition-id=3 num-partitions=10"``).
From the resolved config in each message the node builds the same pieces as an
:class:`~hetfl.engine.experiment.Experiment` (dataset from its own data root, the partition
from the config's seed, model, method) once per process, and only ever touches its own
client's data: its training split (local training, features for FedPAC/CCVR, FedBR's inputs)
and its test split (personalised evaluation).

Node config keys (all optional but ``partition-id``): ``data-root`` (where this node's copy
of the dataset is; default: the config's ``data.root``), ``state-dir`` (a folder for the
client's persistent state, needed to resume a deployed run of a stateful method), ``threads``
(torch CPU threads), and the node's privacy floor: ``dp-epsilon`` and ``dp-delta`` (the most
this node's differentially private releases may spend: the smaller of the node's and the
server's setting is used; the whole noise in the node's own upload where the server would see it with
only a share: distributed noise without secure aggregation), ``dp-noise-source`` (``os`` or ``seed``:
``os`` wins where either side asks for it; a node that does not want the server to know its noise sets
``os``). A node with a
floor refuses a method that releases nothing under differential privacy, or a run with it
switched off. The server's accounting then bounds what such a node spends from above.

A floor is kept over the whole run (:class:`PrivateAnswers`): the node's noise is calibrated for
the releases the run plans, and a server that resumes after a crash asks some rounds again. The
node answers a round again only with what it answered before (seeded noise on the same inputs:
nothing new), or while its answers stay within the planned releases; a further answer would spend
more than its floor, and the node refuses it (the server goes on without this client, as for a
failed one). The count lives in Flower's context and, where the node has a state folder, on disk.

What the node does not take from the server: paths. Client state is written only inside the
node's own ``state-dir``; the run and session names in a message must be plain hexadecimal
names (what hetfl's server sends), never a path. A server's ``state-root`` (the simulation's
``RUN_DIR/flower_nodes``) is used only by a node without a ``state-dir`` whose environment lists
that folder (or one above it) in ``HETFL_TRUSTED_STATE_ROOTS`` (the simulation sets it for its nodes); a deployed
node without a ``state-dir`` keeps the state in Flower's context only.

Client state. What ``Algorithm.finish`` returns as the client's new persistent state
(SCAFFOLD's control variate, MOON's previous model, FedPAC's head, a personalised model ...)
stays on the node: in ``context.state`` (kept by Flower between a run's messages) and, when a
state folder is known, in ``<state-dir>/<run>/client_<c>/round_<r>-<session>.safetensors``.
Every version is tagged with the round after which it was written; a message for round ``r``
uses the newest version before ``r``, so a run resumed from a checkpoint at round ``R`` finds
exactly the state the uninterrupted run had (versions written after ``R`` by the interrupted
session are ignored, then deleted), and no later than the last round the server accepted the
client's training reply in (a straggler's version from a round the server left it out of is
ignored: the server went on as if the client had not trained). The server tells the node whether it has state for it;
a client seen for the first time gets ``Algorithm.init_client_state`` from the server, as in
the in-process executors.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
import tomllib
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from flwr.app import Array, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.compat.common import recorddict_compat as compat

from hetfl import config as config_mod
from hetfl.algorithms import algorithm_class, load_plugin, parse_name, plugin_files, posthoc_class, step_hyper
from hetfl.algorithms.base import SHARED, ServerState
from hetfl.algorithms.dp_moments import NOISE_SOURCES
from hetfl.data.base import DatasetError
from hetfl.engine import secure_sum
from hetfl.engine.checkpoint import load_tensors, save_tensors
from hetfl.engine.experiment import Experiment
from hetfl.engine.summary import Reporter
from hetfl.files import atomic_write_text
from hetfl.flower import protocol as P
from hetfl.flower import secagg
from hetfl.flower.app_plugins import load_app_plugins
from hetfl.flower.codec import client_data_digest, decode_tensor, from_record, to_record
from hetfl.flower.protocol import PLUGINS_ENV, TRUSTED_ROOTS_ENV
from hetfl.privacy import release_digest

_RUNTIME: dict[tuple[str, str, int, tuple], Experiment] = {}
_DIGESTS: dict[tuple[int, int], str] = {}  # (id of the node's experiment, client) -> client_data_digest
#: a run or session name the server may choose: what hetfl's server sends (hexadecimal digests), never a path
_NAME = re.compile(r"[0-9a-f]{1,64}")
#: the node's privacy floor: node config key -> the algorithms' setting it bounds
PRIVACY_KEYS = {"dp-epsilon": "dp_epsilon", "dp-delta": "dp_delta", "dp-noise-source": "dp_noise_source"}

log = logging.getLogger("hetfl")


class NodeError(RuntimeError):
    """A message this node cannot serve (another client's, state it does not have)."""


def header(message: Message) -> dict[str, Any]:
    return dict(message.content[P.HEADER])


def runtime(cfg_text: str, context: Context) -> Experiment:
    """The node's experiment pieces for a config, built once per process (one config at a time), with the
    node's own data root, thread count and privacy floor (:func:`with_privacy_floor`) over the server's."""
    data_root = str(context.node_config.get("data-root", ""))
    threads = int(context.node_config.get("threads", 0))
    floor = privacy_floor(context.node_config)
    key = (cfg_text, data_root, threads, tuple(sorted(floor.items())))
    if key not in _RUNTIME:
        import torch


        cfg = with_privacy_floor(config_mod.from_dict(tomllib.loads(cfg_text)), floor)
        if data_root:
            cfg = replace(cfg, data=replace(cfg.data, root=data_root))
        _RUNTIME.clear()
        _DIGESTS.clear()  # keyed by the experiment's id, which a new one may reuse
        load_listed_plugins()
        load_app_plugins(context.run_config)
        try:
            _RUNTIME[key] = Experiment(cfg)
        except DatasetError as err:  # named as this node's setting: the server's data.root is not the node's to set
            where = (f"node config data-root = {data_root!r}" if data_root else
                     f"no node config data-root: the server's data.root = {cfg.data.root!r}")
            raise NodeError(f"this node's copy of the dataset ({where}): {err}; start the node with --node-config "
                            "'... data-root=\"FOLDER\"' naming the folder that holds the dataset's files") from err
        if threads:  # the node's own setting wins over the config's runtime.threads
            torch.set_num_threads(threads)
    return _RUNTIME[key]


def load_listed_plugins() -> None:
    """Load the plug-in files the server's process loaded (:data:`PLUGINS_ENV`, set by the simulation) that this
    process has not: a simulated node is a process of its own (a Ray worker), which would not know their
    methods. (A deployed node loads them from the Flower App: :func:`hetfl.flower.app_plugins.load_app_plugins`.)"""
    loaded = set(plugin_files())
    for path in os.environ.get(PLUGINS_ENV, "").split(os.pathsep):
        if path and path not in loaded:
            load_plugin(path)


def privacy_floor(node_config: Any) -> dict[str, Any]:
    """The node's ``dp-epsilon`` (> 0), ``dp-delta`` (in (0, 1)) and ``dp-noise-source`` (os | seed) that it
    sets, as the algorithms' setting names; a NodeError naming a bad one."""
    floor: dict[str, Any] = {}
    for key, setting in PRIVACY_KEYS.items():
        if key not in node_config:
            continue
        value = node_config[key]
        if key == "dp-noise-source":
            if value not in NOISE_SOURCES:
                raise NodeError(f"node config {key} = {value!r}: must be one of {', '.join(NOISE_SOURCES)}")
            floor[setting] = value
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        upper = 1.0 if key == "dp-delta" else math.inf
        if not 0 < number < upper:
            raise NodeError(f"node config {key} = {value!r}: must be a number > 0" + (" and < 1" if upper < math.inf
                                                                                      else ""))
        floor[setting] = number
    return floor


def with_privacy_floor(cfg: Any, floor: dict[str, Any]) -> Any:
    """``cfg`` with the node's floor applied to each part of the method that releases under differential
    privacy (the trainer's and each post-hoc step's settings with a ``dp_epsilon``): the smaller epsilon and
    delta of the node's and the server's, and fresh noise ("os") where either asks for it (a floor only
    strengthens: seeded noise in place of the server's "os" could be recomputed from the run config by the
    server, which records "os"); and, with an epsilon floor, the whole noise in the node's own upload
    ("local") where the server would see it with only a share of the noise (distributed noise without
    secure aggregation; the server's sum is then noisier than its accounting assumes: its reported epsilon
    stays an upper bound). A NodeError when no part can honour it, or
    when the run has differential privacy off for such a part (the server would not expect noisy replies:
    their form and its calibration differ), so the node's floor is never silently unmet."""
    if not floor:
        return cfg

    trainer, steps = parse_name(cfg.algorithm.name)
    params = copy.deepcopy(cfg.algorithm.params)
    parts = [(algorithm_class(trainer).Hyper, params, "algorithm."),
             *((posthoc_class(s).Hyper, params.setdefault(s, {}), f"algorithm.{s}.") for s in steps)]
    private = [(hyper, table, prefix) for hyper, table, prefix in parts
               if "dp_epsilon" in {f.name for f in fields(hyper)}]
    if not private:
        raise NodeError(f"this node requires differential privacy ({_floor_text(floor)}); the run's method "
                        f"{cfg.algorithm.name} releases nothing under it, so this node does not take part")
    for hyper, table, prefix in private:
        defaults = {f.name: f.default for f in fields(hyper)}
        if not math.isfinite(float(table.get("dp_epsilon", defaults["dp_epsilon"]))):
            raise NodeError(f"this node requires differential privacy ({_floor_text(floor)}); the run has none for "
                            f"{prefix.rstrip('.')} ({prefix}dp_epsilon = inf), so this node does not take part")
        for setting, mine in floor.items():
            theirs = table.get(setting, defaults[setting])
            table[setting] = (("os" if "os" in (mine, theirs) else mine) if setting == "dp_noise_source"
                              else min(float(theirs), mine))
            if table[setting] != theirs:
                log.warning("hetfl node: %s%s = %r (the server's %r): the node's privacy floor", prefix, setting,
                            table[setting], theirs)
        noise = table.get("dp_noise", defaults.get("dp_noise"))
        if "dp_epsilon" in floor and noise == "distributed" and not cfg.runtime.secure_aggregation:
            # the server sees this upload on its own, which a share of the noise protects far less than the sum
            table["dp_noise"] = "local"
            log.warning("hetfl node: %sdp_noise = 'local' (the server's 'distributed'): without secure aggregation "
                        "the server sees each upload, and the node's dp-epsilon floor holds for its own upload "
                        "only with the whole noise in it", prefix)
    return replace(cfg, algorithm=replace(cfg.algorithm, params=params))


def server_step(cfg_text: str, exp: Experiment, index: int) -> Any:
    """Post-hoc step ``index`` with the server's settings (without this node's floor): under secure aggregation a
    reply is encoded with its public bounds, which the server decodes the sum with."""
    cfg = config_mod.from_dict(tomllib.loads(cfg_text))
    name = parse_name(cfg.algorithm.name)[1][index]
    return posthoc_class(name)(step_hyper(name, cfg.algorithm.params.get(name, {})), exp.setup)


def _floor_text(floor: dict[str, Any]) -> str:
    names = {v: k for k, v in PRIVACY_KEYS.items()}
    return ", ".join(f"{names[k]} = {v}" for k, v in floor.items())


def own_client(h: dict[str, Any], context: Context) -> int:
    client = int(h["client"])
    mine = context.node_config.get("partition-id")
    if mine is None or int(mine) != client:
        raise NodeError(f"a message for client {client} reached the node of partition-id {mine}")
    return client


class StateStore:
    """One client's persistent state on its node: every version the server may still ask for, in
    ``context.state`` and in a state folder (when there is one).

    A version is usable for a message of round ``r`` when it was written before ``r``, by this session or before
    the checkpoint this session started from, and in a round no later than the header's ``state-round`` (the
    last round the server accepted this client's training reply in): a straggler whose reply came too late has
    written a version the server never counted (it went on as if the client had not trained), and the node
    goes back to the version before it. Versions older than the newest one up to ``committed-state-round`` (the
    same at the server's last checkpoint, what a resume goes back to) are deleted."""

    _FILE = re.compile(r"round_(\d+)-([0-9a-f]+)\.safetensors")

    def __init__(self, context: Context, h: dict[str, Any], client: int, device: Any) -> None:
        self.context, self.client, self.device = context, client, device
        self.run, self.session = plain_name(h, "run"), plain_name(h, "session")
        self.start, self.committed = int(h["start"]), int(h["committed"])
        # a header without them (a server of an older hetfl): no version is refused for its round
        self.cap = int(h.get("state-round", 2**62))
        self.committed_cap = int(h.get("committed-state-round", self.committed))
        self.key = f"hetfl.{self.run}.{client}"
        root = state_root(context, h)
        self.folder = root / self.run / f"client_{client:04d}" if root is not None else None

    def _valid(self, version: int, session: str) -> bool:
        """Written by this session, or before the checkpoint this session started from."""
        return session == self.session or version <= self.start

    def _kept(self) -> list[tuple[int, str]]:
        """The versions in ``context.state`` (version, session)."""
        index = self.context.state.get(self.key + ".versions")
        return [] if index is None else [(int(v), str(s)) for v, s in json.loads(str(index["json"]))]

    def _files(self) -> list[tuple[int, str, Path]]:
        if self.folder is None or not self.folder.is_dir():
            return []
        out = []
        for path in self.folder.iterdir():
            m = self._FILE.fullmatch(path.name)
            if m:
                out.append((int(m.group(1)), m.group(2), path))
        return sorted(out)

    def load(self, before: int) -> dict | None:
        """The newest usable state written after a round < ``before``; None if there is none."""
        usable = [(v, s) for v, s in self._kept() if self._valid(v, s) and v < before and v <= self.cap]
        if usable:
            v, s = max(usable)
            return from_record(self.context.state[f"{self.key}.state.{v}-{s}"], self.device)
        files = [(v, p) for v, s, p in self._files() if self._valid(v, s) and v < before and v <= self.cap]
        if not files:
            return None
        return load_tensors(files[-1][1], self.device)

    def save(self, tensors: dict, version: int) -> None:
        kept = [x for x in self._kept() if x != (version, self.session)] + [(version, self.session)]
        self.context.state[f"{self.key}.state.{version}-{self.session}"] = to_record(tensors)
        self._index(kept)
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            save_tensors(self.folder / f"round_{version:05d}-{self.session}.safetensors",
                         {k: v.detach().cpu().clone() for k, v in tensors.items()})
        self.prune()

    def _index(self, kept: list[tuple[int, str]]) -> None:
        self.context.state[self.key + ".versions"] = ConfigRecord({"json": json.dumps(sorted(kept))})

    def _keep_from(self, versions: list[tuple[int, str]], upto: int) -> int:
        """The oldest version to keep: the newest valid one up to round ``upto``."""
        older = [v for v, s in versions if self._valid(v, s) and v <= upto]
        return max(older) if older else 0

    def prune(self) -> None:
        """In the folder, keep the version a resume from the server's last checkpoint needs and those after it;
        in ``context.state`` (a new Flower run for every resume), the one the server counts now and those after."""
        kept = self._kept()
        keep_from = self._keep_from(kept, self.cap)
        stale = [(v, s) for v, s in kept if not self._valid(v, s) or v < keep_from]
        for v, s in stale:
            del self.context.state[f"{self.key}.state.{v}-{s}"]
        if stale:
            self._index([x for x in kept if x not in stale])
        files = self._files()
        keep_from = self._keep_from([(v, s) for v, s, _ in files], min(self.committed, self.committed_cap))
        for v, s, p in files:
            if not self._valid(v, s) or v < keep_from:
                p.unlink(missing_ok=True)


class PrivateAnswers:
    """The differentially private answers a node with a privacy floor gave in one run: per method, each
    round's answer digests (:func:`hetfl.privacy.release_digest`), kept in ``context.state`` and, where the
    node has a state folder, in ``<state folder>/<run>/private_answers.json`` (written before the answer
    leaves the node, so a node restarted after answering still counts it)."""

    FILE = "private_answers.json"

    def __init__(self, context: Context, h: dict[str, Any]) -> None:
        self.context, self.run = context, plain_name(h, "run")
        self.key = f"hetfl.{self.run}.private-answers"
        root = state_root(context, h)
        self.path = None if root is None else root / self.run / self.FILE

    def _read(self) -> dict[str, dict[str, list[str]]]:
        kept = self.context.state.get(self.key)
        if kept is not None:
            return json.loads(str(kept["json"]))
        if self.path is not None and self.path.is_file():
            return json.loads(self.path.read_text())
        return {}

    def admit(self, method: str, round_: int, digest: str, planned: int, floor: dict[str, Any]) -> None:
        """Let this answer (``digest``) of ``method`` in round ``round_`` leave the node: a repeat of an answer
        already given reveals nothing new; another is admitted while the method's answers stay within the
        ``planned`` releases its noise is calibrated for. A NodeError otherwise (nothing recorded)."""
        answers = self._read()
        mine = answers.setdefault(method, {})
        if digest in mine.get(str(round_), []):
            return
        given = sum(len(d) for d in mine.values())
        if given >= planned:
            rounds = ", ".join(r for r, d in sorted(mine.items(), key=lambda x: int(x[0])) for _ in d)
            raise NodeError(f"this node's privacy floor ({_floor_text(floor)}) covers the {planned} release(s) of "
                            f"{method} the run plans; it has answered {given} (round(s) {rounds}), and another "
                            f"answer for round {round_} would spend more, so it does not answer")
        mine.setdefault(str(round_), []).append(digest)
        text = json.dumps(answers, sort_keys=True)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, text + "\n")
        self.context.state[self.key] = ConfigRecord({"json": text})


def admit_private_answer(context: Context, h: dict[str, Any], method: Any, answer: dict[str, Any]) -> None:
    """Count ``answer`` (the tensors of ``method``'s reply that carry its noise) against the node's privacy
    floor (:class:`PrivateAnswers`); nothing for a node without a floor or a method without a mechanism."""
    floor = privacy_floor(context.node_config)
    mechanism = getattr(method, "mechanism", None)
    if not floor or mechanism is None:
        return
    digest = release_digest(sorted(answer.items()))
    PrivateAnswers(context, h).admit(method.name, int(h["round"]), digest, mechanism.releases, floor)


def plain_name(h: dict[str, Any], field: str) -> str:
    """The header's ``run`` or ``session``: a NodeError unless it is a plain hexadecimal name (a path such as
    ``../../x`` would take the node's writes and prunes out of its state folder)."""
    value = str(h.get(field, ""))
    if not _NAME.fullmatch(value):
        raise NodeError(f"the server's {field} name {value!r} is not a plain hexadecimal name; refused (this node "
                        "writes only inside its own state folder)")
    return value


def state_root(context: Context, h: dict[str, Any]) -> Path | None:
    """Where this node keeps client state on disk: its own ``state-dir``; else the server's ``state-root`` when
    the node's environment trusts it (:data:`TRUSTED_ROOTS_ENV` lists it or a folder above it; the simulation
    sets it); else nowhere (Flower's context only)."""
    own = str(context.node_config.get("state-dir", ""))
    if own:
        return Path(own)
    offered = str(h.get("state-root", ""))
    if not offered:
        return None
    real = Path(os.path.realpath(offered))
    trusted = [Path(os.path.realpath(p)) for p in os.environ.get(TRUSTED_ROOTS_ENV, "").split(os.pathsep) if p]
    return Path(offered) if any(real.is_relative_to(folder) for folder in trusted) else None


def shared_tensors(message: Message, context: Context, h: dict[str, Any], device: Any) -> dict:
    """The server's ``shared/`` tensors: from this message (and kept) or as kept before."""
    key = f"hetfl.{h['run']}.shared"
    if P.SHARED in message.content:
        context.state[key] = message.content[P.SHARED]
    return from_record(context.state.get(key), device)


def client_state(store: StateStore, message: Message, before: int, device: Any) -> tuple[dict, bool]:
    """(the client's state for a message of round ``before`` - 1 or before, whether it was kept here):
    the kept state, else the server's ``init_client_state``."""
    state = store.load(before)
    if state is not None:
        return state, True
    if P.INIT not in message.content:
        raise NodeError(f"client {store.client}: the server expects this node to hold the client's state, "
                        "and it has none (node restarted without a state-dir?)")
    return from_record(message.content[P.INIT], device), False


def server_view(message: Message, shared: dict, device: Any) -> Any:
    """A ServerState with what the node was sent of the server's (plus the shared tensors)."""
    extra = from_record(message.content.get(P.VIEW_EXTRA), device)
    extra.update({SHARED + k: v for k, v in shared.items()})
    return ServerState(model=from_record(message.content.get(P.VIEW_MODEL), device), extra=extra)


def reply(message: Message, records: dict[str, Any]) -> Message:
    return Message(RecordDict(records), reply_to=message)


def client_reply(message: Message, exp: Experiment, client: int, records: dict[str, Any]) -> Message:
    """A reply for ``client`` with the digest of the samples this node holds for it (:data:`P.DATA`): the
    server refuses the reply if its own differs (this node's ``data-root`` holds other data)."""
    key = (id(exp), client)
    if key not in _DIGESTS:  # once per client and experiment (a simulation's actor answers many messages)
        _DIGESTS[key] = client_data_digest(exp.data, client)
    return reply(message, {**records, P.DATA: ConfigRecord({"digest": _DIGESTS[key]})})


# ------------------------------------------------------------------------------ handlers
def handle_hello(message: Message, context: Context) -> Message:
    cfg = context.node_config
    return reply(message, {P.RESULT: MetricRecord({
        "partition-id": int(cfg.get("partition-id", -1)), "num-partitions": int(cfg.get("num-partitions", 0))})})


def handle_setup(message: Message, context: Context) -> Message:
    h = header(message)
    exp = runtime(h["config"], context)
    c = own_client(h, context)
    shared = shared_tensors(message, context, h, exp.device)
    ctx = exp.client_context(c, 0, float(h["lr"]), {}, {}, server_view(message, shared, exp.device))
    return client_reply(message, exp, c, {P.REPLY: to_record(exp.algorithm.setup_query(ctx))})


def handle_train(message: Message, context: Context) -> Message:
    """A local round; or, inside Flower's SecAgg+ (stage 2), a secure post-hoc query (:mod:`hetfl.flower.secagg`)."""
    if secagg.is_query(message):
        return handle_secure_query(message, context)
    h = header(message)
    exp = runtime(h["config"], context)
    c, round_ = own_client(h, context), int(h["round"])
    store = StateStore(context, h, c, exp.device)
    state, had_state = client_state(store, message, round_, exp.device)
    shared = shared_tensors(message, context, h, exp.device)
    payload = from_record(message.content[P.PAYLOAD], exp.device)
    ctx = exp.client_context(c, round_, float(h["lr"]), payload, state, server_view(message, shared, exp.device))
    result = exp.train_clients([ctx], Reporter())[0]  # the sequential executor's local round
    upload, new_state = exp.algorithm.finish(ctx, result.state, result.steps)
    admit_private_answer(context, h, exp.algorithm, {k: upload[k] for k in exp.algorithm.dp_upload_keys})
    if new_state:
        store.save(new_state, round_)
    return client_reply(message, exp, c, {
        P.UPLOAD: to_record(upload),
        P.RESULT: MetricRecord({"steps": result.steps, "loss-sum": float(result.loss_sum),
                                "num-samples": exp.data.client_sizes[c],
                                "has-state": int(had_state or bool(new_state)),
                                **{P.LOSS_PART + k: float(v) for k, v in result.metric_sums.items()}}),
    })


def handle_posthoc(message: Message, context: Context) -> Message:
    h = header(message)
    exp = runtime(h["config"], context)
    c = own_client(h, context)
    step = exp.posthoc[int(h["step"])]
    model = from_record(message.content[P.MODEL], exp.device)
    features, labels = exp.client_features(model, c)
    query = step.client_query(model, features, labels, client=c, round_=int(h["round"]))
    admit_private_answer(context, h, step, query)
    return client_reply(message, exp, c, {P.REPLY: to_record(query)})


def handle_evaluate(message: Message, context: Context) -> Message:
    h = header(message)
    exp = runtime(h["config"], context)
    c, round_ = own_client(h, context), int(h["round"])
    store = StateStore(context, h, c, exp.device)
    state, _ = client_state(store, message, round_ + 1, exp.device)
    shared = shared_tensors(message, context, h, exp.device)
    payload = from_record(message.content.get(P.PAYLOAD), exp.device)
    acc, _ = exp.client_accuracy(c, server_view(message, shared, exp.device), state, round_, payload=payload)
    result = {"empty": 1} if acc is None else {"acc": float(acc)}
    return client_reply(message, exp, c, {P.RESULT: MetricRecord(result)})


def handle_secure_query(message: Message, context: Context) -> Message:
    """The client's dense reply to the post-hoc step, on Flower's grid, as a FitRes (``num_examples = 1``)."""
    h = dict(message.content.config_records[secagg.FITINS_CONFIG])
    exp = runtime(str(h["config"]), context)
    c, levels = own_client(h, context), int(h["levels"])
    step = exp.posthoc[int(h["step"])]
    stored = list(message.content.array_records[secagg.FITINS_PARAMETERS].values())
    layout = json.loads(str(h[secagg.MODEL_LAYOUT]))
    model = {name: decode_tensor(Array(dtype=dtype, shape=tuple(shape), stype=stype, data=a.data), exp.device)
             for (name, dtype, stype, shape), a in zip(layout, stored, strict=True)}
    features, labels = exp.client_features(model, c)
    query = step.client_query(model, features, labels, client=c, round_=int(h["round"]))
    admit_private_answer(context, h, step, query)
    # the server's bounds (a node's privacy floor may have changed this node's): the grid the sum is decoded on
    bounds = server_step(str(h["config"]), exp, int(h["step"])).reply_bounds() \
        if privacy_floor(context.node_config) else step.reply_bounds()
    encoded = secure_sum.encode(step.dense_reply(query), bounds, levels)
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(secure_sum.to_grid(encoded, levels)),
                    num_examples=1, metrics={})
    return Message(compat.fitres_to_recorddict(fitres, keep_input=False), reply_to=message)
