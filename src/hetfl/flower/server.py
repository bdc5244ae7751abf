"""The server side: an :class:`~hetfl.engine.experiment.Experiment` whose clients are Flower nodes.

:class:`FlowerFederation` plugs into ``Experiment.federation`` (it implements the engine's
:class:`~hetfl.engine.federation.Federation` protocol): the experiment's round loop
(sampling, ``payload``, ``aggregate``, post-hoc ``apply``, global evaluation, metrics,
checkpoints, resume) runs unchanged in the ServerApp, and each of its client-side phases
becomes one exchange of messages with the nodes (:mod:`hetfl.flower.protocol`):

1. once: ``query.hello`` to every node, to learn which client (partition) each holds;
2. before round 1, for methods with one, the set-up round (``query.setup``: FedMix, FedBR);
3. each round: ``train`` to the sampled clients (payload, plus ``init_client_state`` for a
   client the first time and the shared tensors once), their uploads aggregated in client order;
4. post-hoc steps when due (``query.posthoc``, every client: CCVR's statistics), then ``apply``;
   under ``runtime.secure_aggregation`` an additive step's replies are summed by Flower's SecAgg+
   instead (four stages of ``train`` messages, :mod:`hetfl.flower.secagg`): the server sees the sum;
5. evaluation rounds: the global model on the server's test set; clients whose evaluated
   model is the global model itself are scored from the same predictions (as the in-process
   executors do); the others (personalised models, fine-tuning, kNN-Per's datastore) are
   evaluated on their nodes (``evaluate``) with the server-state entries ``client_model`` reads.

Failures: a phase waits ``runtime.flower_timeout_s`` for its replies, or, once its quorum has answered,
``runtime.flower_grace_s`` more at most; clients that do not
answer (or answer with an error) are left out of that phase and listed in the round's
``failed_clients``; fewer answers than ``runtime.flower_min_replies`` stop the run with a
:class:`FlowerRoundError` (the last checkpoint resumes it). A reply the server cannot use counts as
no answer, its reason logged: malformed (a record or number missing, tensors that do not decode, an
upload tensor of another shape or dtype than the model's, an upload whose tensors' names, shapes or dtypes
differ from most of the round's other uploads, a post-hoc reply its step's ``check_reply`` refuses, a sample
count other than the client's, a count that is no whole number, an accuracy outside [0, 1]) or
oversized (a training upload of more than :data:`UPLOAD_FACTOR` times the bytes sent to the client plus
:data:`UPLOAD_SLACK` bytes), or computed on other data: a digest of the
client's samples on its node other than the server's (:meth:`FlowerFederation.other_data`). Such a reply
reached the server all the same: the upload it carries is kept (a digest of its bytes, ``refused``) and, under
differential privacy, recorded in the privacy ledger when its phase stops with nothing usable
(``docs/privacy.md``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from hetfl import config as config_mod
from hetfl.algorithms.base import SHARED, Algorithm, ServerState, Tensors
from hetfl.algorithms.posthoc import Replies
from hetfl.engine.federation import PhaseStopped
from hetfl.engine.messages import ClientUpdate, nbytes
from hetfl.engine.schedule import lr_at
from hetfl.flower import protocol as P
from hetfl.flower import secagg
from hetfl.flower.codec import client_data_digest, decode_tensor, encode_tensor, from_record, record_nbytes

if TYPE_CHECKING:
    from hetfl.engine.experiment import Experiment
    from hetfl.engine.summary import Reporter

log = logging.getLogger("hetfl")


#: a training upload may hold at most this many times the tensor bytes sent to the client (model, payload, client
#: state), plus UPLOAD_SLACK bytes: every hetfl method uploads about a model's worth (SCAFFOLD: two)
UPLOAD_FACTOR, UPLOAD_SLACK = 8, 16 * 2**20
#: what reading a reply of a client raises when the reply is malformed (a missing record or number, bad tensors)
MALFORMED = (KeyError, TypeError, ValueError, RuntimeError, AttributeError)
#: the record of a phase's reply that carries the client's upload (under differential privacy, its noise)
UPLOAD_RECORDS = {P.TRAIN: P.UPLOAD, P.POSTHOC: P.REPLY}


class MalformedReply(ValueError):
    """A client's reply the server cannot use (its reason is logged, the client counts as not answering)."""


class FlowerRoundError(PhaseStopped):
    """Too few clients answered a phase of a round (``received``: the replies the server had, for the
    privacy ledger)."""


class FlowerStopped(PhaseStopped):
    """The federation was told to stop (the simulation ended under it: Ctrl-C, an error). Stopped while it waited
    for a phase's replies, ``received`` and ``refused`` hold those already in (:class:`PhaseStopped`): they
    reached the server, and the privacy ledger records their releases before the run ends. ``messages``: the
    raw replies in when the wait stopped; ``contents``: the same by client (for the phase to read)."""

    messages: list[Message] | None = None
    contents: dict[int, RecordDict] | None = None


class _Reads(dict):
    """A dict that records which keys are read (``client_model``'s use of the server state)."""

    def __init__(self, data: dict) -> None:
        super().__init__(data)
        self.read: set = set()

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.add(key)
        return super().__contains__(key)

    def __iter__(self):  # type: ignore[override]
        self.read.update(super().keys())
        return super().__iter__()

    def keys(self):  # type: ignore[override]
        self.read.update(super().keys())
        return super().keys()

    def items(self):  # type: ignore[override]
        self.read.update(super().keys())
        return super().items()

    def values(self):  # type: ignore[override]
        self.read.update(super().keys())
        return super().values()

    def copy(self) -> dict:
        self.update_read()
        return dict(super().items())

    def update_read(self) -> None:
        """Mark every key read (the dict itself was used)."""
        self.read.update(super().keys())


class _Encoder:
    """Tensors -> ArrayRecord, each tensor object encoded once per phase (the global model sent to
    every client is serialised once)."""

    def __init__(self) -> None:
        self.cache: dict[int, tuple[torch.Tensor, Any]] = {}

    def record(self, tensors: Tensors) -> ArrayRecord:
        out = {}
        for name, t in tensors.items():
            hit = self.cache.get(id(t))
            if hit is None or hit[0] is not t:
                hit = (t, encode_tensor(t))
                self.cache[id(t)] = hit
            out[name] = hit[1]
        return ArrayRecord(out)


def node_config(cfg: config_mod.RunConfig, simulation: bool) -> config_mod.RunConfig:
    """The config the nodes build their experiment from.

    In a simulation with ``runtime.threads = 0`` (auto) the nodes get this process's
    thread count: Ray starts each actor with one thread per CPU it was given, and torch's CPU
    kernels split reductions by thread count, so a node on another count than the sequential
    executor differs from it in the last bits (and, rounds later, in accuracy). With equal
    counts the simulation gives the sequential executor's numbers bit for bit.
    """
    if simulation and cfg.runtime.threads == 0:
        return replace(cfg, runtime=replace(cfg.runtime, threads=torch.get_num_threads()))
    return cfg


class FlowerFederation:
    """The clients of an experiment, reached through a Flower ``Grid``."""

    def __init__(self, exp: Experiment, grid: Any, *, state_root: str = "", poll_s: float = 0.5,
                 simulation: bool = False, stop: threading.Event | None = None, startup_s: float = 0.0) -> None:
        self.exp, self.grid = exp, grid
        self.stop = stop or threading.Event()  # set by whoever runs the Flower engine when it ends early
        cfg = exp.cfg
        self.config_text = config_mod.dumps(node_config(cfg, simulation))
        self.num_clients = cfg.data.num_clients
        self.timeout = float(cfg.runtime.flower_timeout_s)
        # how long the first greeting may take (nodes starting: Ray actors importing torch on a busy machine)
        self.startup_s = max(self.timeout, startup_s)
        self.min_replies = int(cfg.runtime.flower_min_replies)
        self.grace = float(cfg.runtime.flower_grace_s)
        self.state_root, self.poll_s, self.simulation = state_root, poll_s, simulation
        self.nodes: dict[int, int] = {}  # client -> node id
        self.greeted: set[int] = set()  # node ids asked which client they hold (once per node id)
        self.pending_hello: dict[str, int] = {}  # greetings not answered yet: message id -> node id
        self.has_state: set[int] = set()  # clients whose node keeps a persistent state
        # client -> the round of the last training reply accepted from it (its node's state is the newest version
        # written up to that round: a version a straggler wrote in a round the server left it out of is not)
        self.state_round: dict[int, int] = {}
        self.committed_state_round: dict[int, int] = {}  # the same at the last checkpoint (what a resume needs)
        self.shared_sent: dict[int, tuple] = {}  # client -> version of the shared tensors it holds
        self.failed: dict[int, str] = {}  # this round's failures: client -> reason
        self.traffic = [0, 0]  # this round's serialised bytes down / up
        self.run_key = self.session = ""
        self.start_round = self.committed_round = 0
        self.digests: dict[int, str] = {}  # client -> digest of its samples here (client_data_digest)
        # client -> (node, reason): a node found holding other data for the client, left out of SecAgg+ too
        self.other_data_nodes: dict[int, tuple[int, str]] = {}
        # this phase's replies received and refused that carry an upload: client -> digest of its bytes (upload_digest)
        self.refused: dict[int, str] = {}

    # ------------------------------------------------------------------ run hooks
    def start(self, run_dir: str | Path, start_round: int, info: dict[str, Any]) -> None:
        """Called by ``Experiment.run`` before the first round (after loading a checkpoint, if any)."""
        run_dir = Path(run_dir).resolve()
        self.run_key = hashlib.sha1((self.config_text + "\0" + str(run_dir)).encode()).hexdigest()[:16]
        self.session = uuid.uuid4().hex[:12]
        self.start_round = self.committed_round = start_round
        self.has_state = {int(c) for c in info.get("flower_clients_with_state", [])}
        # a checkpoint from before these rounds were kept: every version up to the checkpoint is the server's
        rounds = info.get("flower_state_rounds", [[c, start_round] for c in sorted(self.has_state)])
        self.state_round = {int(c): int(r) for c, r in rounds}
        self.committed_state_round = dict(self.state_round)
        self.connect()

    def checkpoint_info(self) -> dict[str, Any]:
        return {"flower_clients_with_state": sorted(self.has_state),
                "flower_state_rounds": [[c, r] for c, r in sorted(self.state_round.items())]}

    def committed(self, round_: int) -> None:
        self.committed_round = round_
        self.committed_state_round = dict(self.state_round)

    def round_info(self, round_: int) -> dict[str, Any]:
        """The round's Flower numbers for metrics.jsonl (and a fresh count for the next round)."""
        out = {"failed_clients": sorted(self.failed), "flower_bytes_down": self.traffic[0],
               "flower_bytes_up": self.traffic[1]}
        self.failed, self.traffic = {}, [0, 0]
        return out

    # ------------------------------------------------------------------ messaging
    def header(self, client: int, round_: int, **extra: Any) -> dict[str, Any]:
        return {"config": self.config_text, "run": self.run_key, "session": self.session,
                "start": self.start_round, "committed": self.committed_round, "state-root": self.state_root,
                "state-round": self.state_round.get(client, 0),
                "committed-state-round": self.committed_state_round.get(client, 0),
                "client": client, "round": round_, **extra}

    def fail(self, client: int, reason: str) -> None:
        lines = [x.strip() for x in reason.replace("\\n", "\n").splitlines() if x.strip()]
        if len(lines) > 1:  # a node's traceback: its first and last lines say enough
            reason = f"{lines[0][:120]} ... {lines[-1][:300]}"
        if client not in self.failed:
            log.warning("flower: client %d failed: %s", client, reason)
        self.failed[client] = reason

    def connect(self) -> None:
        """Wait for the nodes (up to the timeout) and learn which client each holds."""
        deadline, said = time.monotonic() + self.timeout, False
        while True:
            ids = set(self.grid.get_node_ids())
            if len(ids) >= self.num_clients or time.monotonic() > deadline:
                break
            if not said:  # a node that never connects costs the whole timeout: say so when the wait begins
                log.warning("flower: %d of the %d clients' nodes connected; waiting up to %g s "
                            "(runtime.flower_timeout_s) for the others", len(ids), self.num_clients, self.timeout)
                said = True
            self._sleep()
        self.refresh(ids, self.startup_s)
        missing = [c for c in range(self.num_clients) if c not in self.nodes]
        if len(self.nodes) == 0:
            raise FlowerRoundError(f"no Flower node holding one of the {self.num_clients} clients answered "
                                   f"within {self.startup_s:g} s")
        if missing:
            log.warning("flower: no node holds clients %s; they count as failed when asked", missing)

    def refresh(self, ids: set[int] | None = None, timeout: float | None = None) -> None:
        """Forget nodes that left; greet new ones, waiting ``timeout`` (default: the phases' timeout).
        A node that answers late is taken in at a later refresh, without waiting for it again."""
        ids = set(self.grid.get_node_ids()) if ids is None else ids
        for c, node in list(self.nodes.items()):
            if node not in ids:
                del self.nodes[c]
        self.greeted &= ids
        self.pending_hello = {m: n for m, n in self.pending_hello.items() if n in ids}
        if self.pending_hello:
            late = list(self.grid.pull_messages(list(self.pending_hello)))
            for message in late:
                self.pending_hello.pop(message.metadata.reply_to_message_id, None)
            self._greeted(late, ids)
        new = sorted(ids - self.greeted)
        if not new:
            return
        self.greeted.update(new)
        messages = [Message(RecordDict({P.HEADER: ConfigRecord({"config": ""})}), dst_node_id=n,
                            message_type=P.HELLO) for n in new]  # default TTL: a late answer still counts
        replies, unanswered, _ = self._send_and_receive(messages, timeout)
        for k in unanswered:
            if messages[k].metadata.message_id:
                self.pending_hello[messages[k].metadata.message_id] = new[k]
        self._greeted(replies, ids)

    def _greeted(self, replies: list[Message], ids: set[int]) -> None:
        for message in replies:
            if message.has_error():
                continue
            node = message.metadata.src_node_id
            try:
                result = message.content[P.RESULT]
                client, parts = _whole(result, "partition-id"), _whole(result, "num-partitions")
            except MALFORMED as err:  # another app on the SuperLink, another hetfl version: not the run's end
                log.warning("flower: node %d's greeting is malformed (%s); it is left out", node, _why(err))
                continue
            if not 0 <= client < self.num_clients:
                if not self.simulation:
                    log.warning("flower: node %d holds partition-id %d, not one of this run's %d clients",
                                node, client, self.num_clients)
                continue
            if parts != self.num_clients and not self.simulation:
                log.warning("flower: node %d says num-partitions = %d; this run has %d clients (data.num_clients)",
                            node, parts, self.num_clients)
            old = self.nodes.get(client)
            if old is not None and old != node and old in ids:  # a restarted node, or two nodes misconfigured
                log.warning("flower: nodes %d and %d both hold partition-id %d; using %d, the newer", old, node,
                            client, node)
            if old != node:
                self.shared_sent.pop(client, None)  # a new node for this client: send it the shared data
            self.nodes[client] = node

    @property
    def ttl(self) -> float:
        return self.timeout + 60.0

    def _sleep(self) -> None:
        if self.stop.wait(self.poll_s):
            raise FlowerStopped("the Flower run was stopped")

    def _send_and_receive(self, messages: list[Message], timeout: float | None = None, quorum: int = 0
                          ) -> tuple[list[Message], list[int], str]:
        """Push, then pull until every reply is in or the timeout passes (polling every ``poll_s``); once
        ``quorum`` (> 0) replies without an error are in, wait at most ``runtime.flower_grace_s`` more:
        (replies, indices of the messages without a reply, why those have none)."""
        if not messages:
            return [], [], ""
        if self.stop.is_set():
            raise FlowerStopped("the Flower run was stopped")
        pushed = [i for i in self.grid.push_messages(messages) if i]
        index = {m.metadata.message_id: k for k, m in enumerate(messages)}
        pending = {i for i in pushed if i in index}
        lost = [k for i, k in index.items() if i not in pending]
        replies: list[Message] = []
        timeout = self.timeout if timeout is None else timeout
        deadline, why = time.monotonic() + timeout, f"no reply within {timeout:g} s (runtime.flower_timeout_s)"
        answered, graced = 0, False
        while pending:
            got = list(self.grid.pull_messages(list(pending)))
            for message in got:
                pending.discard(message.metadata.reply_to_message_id)
                answered += not message.has_error()
            replies += got
            if 0 < quorum <= answered and not graced and pending:
                graced = True  # the quorum is in: the others get the grace, if it ends before the timeout
                if time.monotonic() + self.grace < deadline:
                    deadline = time.monotonic() + self.grace
                    why = (f"no reply within {self.grace:g} s of the quorum's ({quorum} clients; "
                           "runtime.flower_grace_s)")
            if not pending or time.monotonic() > deadline:
                break
            try:
                self._sleep()
            except FlowerStopped as err:  # what is in reached the server: the phase reads it before the stop goes on
                err.messages = replies
                raise
        return replies, sorted(lost + [index[i] for i in pending]), why

    def exchange(self, kind: str, contents: dict[int, RecordDict], round_: int) -> dict[int, RecordDict]:
        """One phase: a message per client, the replies by client (failures recorded; the uploads in replies
        refused here or later in the phase kept in ``refused``, for the privacy ledger). The phase has refreshed
        the nodes (:meth:`refresh`) before building ``contents``: what a message carries depends on its node (a
        restarted node has not received the shared tensors)."""
        self.refused = {}
        clients, messages = [], []
        for c, content in contents.items():
            node = self.nodes.get(c)
            if node is None:
                self.fail(c, "no node holds this client's partition")
                continue
            clients.append(c)
            messages.append(Message(content, dst_node_id=node, message_type=kind, ttl=self.ttl,
                                    group_id=str(round_)))
            self.traffic[0] += record_nbytes(r for r in content.values() if isinstance(r, ArrayRecord))
        try:
            replies, late, why = self._send_and_receive(messages, quorum=self.quorum(len(contents)))
        except FlowerStopped as err:
            err.contents = self.by_client(kind, err.messages or [], messages, clients)
            raise
        out = self.by_client(kind, replies, messages, clients)
        for k in late:
            self.fail(clients[k], f"{kind}: {why}")
        return out

    def by_client(self, kind: str, replies: list[Message], messages: list[Message], clients: list[int]
                  ) -> dict[int, RecordDict]:
        """The replies to a ``kind`` phase's ``messages`` (pushed: their ids set; one for each of ``clients``) by
        client, without the error replies and those of a node holding other data (failures recorded, refused
        uploads kept)."""
        owner = {m.metadata.message_id: c for m, c in zip(messages, clients, strict=True)}
        out: dict[int, RecordDict] = {}
        for message in replies:
            c = owner.get(message.metadata.reply_to_message_id)
            if c is None:
                continue
            if message.has_error():
                self.fail(c, f"{kind}: {message.error.reason}")
                continue
            other = self.other_data(c, message.content)
            if other:
                self.other_data_nodes[c] = (message.metadata.src_node_id, other)
                self.fail(c, f"{kind}: {other}")
                self.refuse(c, message.content, kind)
                continue
            out[c] = message.content
            self.traffic[1] += record_nbytes(r for r in message.content.values() if isinstance(r, ArrayRecord))
        return out

    def refuse(self, c: int, content: RecordDict, kind: str) -> None:
        """Keep a digest of the upload in client ``c``'s refused reply to a ``kind`` message, if it carries one
        (:data:`UPLOAD_RECORDS`): the server received it all the same, and under differential privacy it is a
        noisy release of the client's data (recorded when the phase stops with nothing usable:
        :class:`~hetfl.engine.federation.PhaseStopped`'s ``refused``)."""
        digest = upload_digest(content, UPLOAD_RECORDS.get(kind, ""))
        if digest is not None:
            self.refused[c] = digest

    def holds_other_data(self, c: int) -> str:
        """Why client ``c``'s present node is known to hold other data than the server's for it; "" if not (a
        node that restarted is given the benefit of the doubt: its next reply is checked again)."""
        node, reason = self.other_data_nodes.get(c, (None, ""))
        return reason if node is not None and node == self.nodes.get(c) else ""

    def other_data(self, c: int, content: RecordDict) -> str:
        """Why client ``c``'s reply comes from other samples than the server's for ``c`` (its node's
        ``data-root`` holds other files: another dataset in the same format, a changed copy); "" if the
        digests agree (:func:`~hetfl.flower.codec.client_data_digest`)."""
        if c not in self.digests:
            self.digests[c] = client_data_digest(self.exp.data, c)
        try:
            theirs = str(content[P.DATA]["digest"])
        except MALFORMED:
            return "malformed reply: no digest of the client's data (a node running another hetfl version?)"
        if theirs == self.digests[c]:
            return ""
        return (f"the node holds other data than the server's for client {c} (digest of its training and test "
                f"samples {theirs}, the server's {self.digests[c]}): give the node a copy of the dataset files "
                f"of the server's data.root ({self.exp.cfg.data.dataset}) in its node config data-root; refused")

    def quorum(self, asked: int) -> int:
        """How many of ``asked`` clients must answer a phase for the run to go on (runtime.flower_min_replies)."""
        return max(asked if self.min_replies == 0 else min(self.min_replies, asked), 1)

    def check_quorum(self, answered: int, asked: int, round_: int, phase: str, received: Any = None,
                     refused: dict[int, str] | None = None) -> None:
        if asked == 0:
            return
        need = self.quorum(asked)
        if answered < need:
            reasons = "; ".join(f"client {c}: {r}" for c, r in sorted(self.failed.items())[:5])
            raise FlowerRoundError(
                f"round {round_}, {phase}: {answered} of {asked} clients answered; runtime.flower_min_replies = "
                f"{self.min_replies} needs {need} ({reasons}). The run stops with its last checkpoint kept: once "
                "enough clients' nodes can answer (see the reasons), resume it", received, refused)

    def shared_version(self, server: ServerState) -> tuple[Tensors, tuple]:
        shared = {k[len(SHARED):]: v for k, v in server.extra.items() if k.startswith(SHARED)}
        return shared, tuple((k, id(v), tuple(v.shape)) for k, v in sorted(shared.items()))

    def add_client_records(self, records: dict[str, Any], header: dict[str, Any], c: int, server: ServerState,
                           encoder: _Encoder, *, with_init: bool = True) -> None:
        """The shared tensors if the client's node lacks them; the initial client state if it has none."""
        shared, version = self.shared_version(server)
        if shared and self.shared_sent.get(c) != version:
            records[P.SHARED] = encoder.record(shared)
            header["shared-version"] = repr(version)
        if with_init and c not in self.has_state:
            records[P.INIT] = encoder.record(self.exp.algorithm.init_client_state(c, server))

    def acknowledge(self, c: int, server: ServerState) -> None:
        shared, version = self.shared_version(server)
        if shared:
            self.shared_sent[c] = version

    # ------------------------------------------------------------------ phases
    def setup_replies(self, server: ServerState) -> dict[int, Tensors]:
        self.refresh()
        encoder, lr = _Encoder(), lr_at(self.exp.cfg, 1)
        contents = {}
        for c in range(self.num_clients):
            records: dict[str, Any] = {}
            h = self.header(c, 0, lr=lr)
            self.add_client_records(records, h, c, server, encoder, with_init=False)
            contents[c] = RecordDict({**records, P.HEADER: ConfigRecord(h)})
        replies = self.tensor_replies(P.SETUP, self.exchange(P.SETUP, contents, 0),
                                      self.exp.algorithm.check_setup_reply)
        for c in replies:
            self.acknowledge(c, server)
        self.check_quorum(len(replies), self.num_clients, 1, "set-up round")
        needed = [c for c in range(self.num_clients) if c not in replies and self.exp.algorithm.setup_reply_needed(c)]
        if needed:
            reasons = "; ".join(f"client {c}: {self.failed.get(c, 'no reply')}" for c in needed[:5])
            raise FlowerRoundError(
                f"set-up round: {self.exp.cfg.algorithm.name} cannot build its set-up without client(s) {needed} "
                f"({reasons}). The run stops: once their nodes can answer, resume it")
        return replies

    def train(self, server: ServerState, clients: dict[int, Tensors], sampled: list[int], round_: int, lr: float,
              reporter: Reporter) -> tuple[list[ClientUpdate], int]:
        """``clients`` (the engine's store of client states) is left as it is: the states stay on the nodes."""
        self.refresh()
        algo, encoder = self.exp.algorithm, _Encoder()
        contents, bytes_down = {}, 0
        for c in sampled:
            payload = algo.payload(server, c)
            bytes_down += nbytes(payload)
            records: dict[str, Any] = {P.PAYLOAD: encoder.record(payload)}
            h = self.header(c, round_, lr=lr)
            self.add_client_records(records, h, c, server, encoder)
            contents[c] = RecordDict({**records, P.HEADER: ConfigRecord(h)})
        try:
            replies = self.exchange(P.TRAIN, contents, round_)
        except FlowerStopped as err:  # the uploads already in reached the server: recorded before the run ends
            read = self.read_updates(sampled, contents, err.contents or {}, server)
            raise FlowerStopped(str(err), [u for u, _ in read], self.refused) from None
        updates = []
        for update, has_state in self.read_updates(sampled, contents, replies, server):
            c = update.client_id
            updates.append(update)
            self.state_round[c] = round_  # this round's state is the node's (a late reply's never is)
            if has_state:
                self.has_state.add(c)
            self.acknowledge(c, server)
            reporter.client_done()
        self.check_quorum(len(updates), len(sampled), round_, "training", updates, self.refused)
        return updates, bytes_down

    def read_updates(self, sampled: list[int], contents: dict[int, RecordDict], replies: dict[int, RecordDict],
                     server: ServerState) -> list[tuple[ClientUpdate, bool]]:
        """The training replies as updates, in ``sampled`` order (:meth:`read_update`); a reply the server cannot
        use is recorded as failed and its upload kept in ``refused``."""
        out = []
        for c in sampled:
            if c not in replies:
                continue
            sent = record_nbytes(r for r in contents[c].values() if isinstance(r, ArrayRecord))
            try:
                out.append(self.read_update(c, replies[c], sent, server))
            except MALFORMED as err:
                self.fail(c, f"{P.TRAIN}: {_why(err)}")
                self.refuse(c, replies[c], P.TRAIN)
        return self.of_the_rounds_form(out, replies) if self.exp.algorithm.uniform_upload else out

    def of_the_rounds_form(self, read: list[tuple[ClientUpdate, bool]], replies: dict[int, RecordDict]
                           ) -> list[tuple[ClientUpdate, bool]]:
        """The ``read`` updates whose uploads have the tensor names, shapes and dtypes of more than half of them
        (every client's upload has one form: ``Algorithm.uniform_upload``); the client of each other one is
        recorded as failed (naming the difference) and its upload kept in ``refused``. Where no form is that of
        more than half, none is used: which one is right cannot be told."""
        forms = [upload_form(update.upload) for update, _ in read]
        common, count = Counter(forms).most_common(1)[0] if forms else ((), 0)
        majority = 2 * count > len(read)
        kept = []
        for (update, has_state), form in zip(read, forms, strict=True):
            if majority and form == common:
                kept.append((update, has_state))
                continue
            if majority:
                why = f"its upload differs from the round's {count} other uploads: {form_difference(form, common)}"
            else:
                why = (f"the round's {len(read)} uploads differ in their tensors' names, shapes or dtypes "
                       f"({len(set(forms))} forms) and no form is that of most of them; none is used")
            self.fail(update.client_id, f"{P.TRAIN}: malformed reply: {why}")
            self.refuse(update.client_id, replies[update.client_id], P.TRAIN)
        return kept

    def read_update(self, c: int, content: RecordDict, sent: int, server: ServerState) -> tuple[ClientUpdate, bool]:
        """Client ``c``'s training reply as an update (and whether its node now keeps state for it), checked: an
        upload of at most :data:`UPLOAD_FACTOR` x ``sent`` + :data:`UPLOAD_SLACK` bytes, tensors that decode, the
        model's shape for each of the model's tensors, the method's noisy statistics (``dp_upload_keys``), the
        client's own sample count, whole numbers. Raises one of
        :data:`MALFORMED` (:class:`MalformedReply` with the reason) otherwise."""
        record, result = content[P.UPLOAD], content[P.RESULT]
        size, limit = record_nbytes([record]), UPLOAD_FACTOR * sent + UPLOAD_SLACK
        if size > limit:
            raise MalformedReply(f"oversized reply: an upload of {size} bytes, more than {limit} ({UPLOAD_FACTOR} "
                                 f"x the {sent} bytes sent + {UPLOAD_SLACK})")
        upload = {k: decode_tensor(a, self.exp.device) for k, a in record.items()}
        missing = [k for k in self.exp.algorithm.dp_upload_keys if k not in upload]
        if missing:  # the method's noisy statistics: the privacy ledger's digest of the round reads them
            raise MalformedReply(f"malformed reply: the upload lacks {', '.join(missing)}")
        for name, t in upload.items():
            expected = server.model.get(name)
            if expected is not None and t.shape != expected.shape:
                raise MalformedReply(f"malformed reply: upload {name!r} has shape {list(t.shape)}, the model's is "
                                     f"{list(expected.shape)}")
            if expected is not None and t.dtype != expected.dtype:
                raise MalformedReply(f"malformed reply: upload {name!r} is {t.dtype}, the model's {expected.dtype}")
        samples, size_c = _whole(result, "num-samples"), self.exp.data.client_sizes[c]
        if samples != size_c:
            raise MalformedReply(f"malformed reply: num-samples = {samples}, but client {c} holds {size_c} training "
                                 "samples")
        parts = {k.removeprefix(P.LOSS_PART): float(v) for k, v in result.items() if k.startswith(P.LOSS_PART)}
        update = ClientUpdate(c, upload, samples, _whole(result, "steps"), float(result["loss-sum"]), parts)
        return update, bool(_whole(result, "has-state"))

    def tensor_replies(self, kind: str, replies: dict[int, RecordDict],
                       check: Callable[[int, Tensors], None] | None = None) -> dict[int, Tensors]:
        """The ``reply`` tensors of each client's reply; a client whose reply lacks them, does not decode or fails
        ``check(client, tensors)`` (a ValueError saying what is wrong: the method's ``check_setup_reply``, a
        post-hoc step's ``check_reply``) is recorded as failed (malformed) and left out."""
        out = {}
        for c in sorted(replies):
            try:
                tensors = from_record(replies[c][P.REPLY], self.exp.device)
                if check is not None:
                    check(c, tensors)
                out[c] = tensors
            except MALFORMED as err:
                self.fail(c, f"{kind}: {_why(err)}")
                self.refuse(c, replies[c], kind)
        return out

    def posthoc_replies(self, step: Any, raw: Tensors, round_: int) -> Replies:
        """Every client's reply, by client; for an additive step under ``runtime.secure_aggregation``, their
        sum through Flower's SecAgg+ (:mod:`hetfl.flower.secagg`)."""
        if self.exp.cfg.runtime.secure_aggregation and step.additive:
            try:
                return secagg.secure_posthoc(self, step, raw, round_)
            except secagg.SecAggStopped as err:
                raise FlowerRoundError(str(err)) from None
        self.refresh()
        encoder, index = _Encoder(), self.exp.posthoc.index(step)
        contents = {c: RecordDict({P.MODEL: encoder.record(raw),
                                   P.HEADER: ConfigRecord(self.header(c, round_, step=index))})
                    for c in range(self.num_clients)}

        def check(client: int, reply: Tensors) -> None:
            step.check_reply(reply, raw)

        try:
            replies = self.tensor_replies(P.POSTHOC, self.exchange(P.POSTHOC, contents, round_), check)
        except FlowerStopped as err:  # the replies already in reached the server: recorded before the run ends
            raise FlowerStopped(str(err), self.tensor_replies(P.POSTHOC, err.contents or {}, check),
                                self.refused) from None
        self.check_quorum(len(replies), self.num_clients, round_, f"post-hoc {step.name}", replies, self.refused)
        return replies

    def client_accuracies(self, server: ServerState, clients: dict[int, Tensors], round_: int,
                          global_correct: torch.Tensor | None) -> dict[int, float]:
        """``clients`` (the engine's store of client states) is not read: each client's state is on its node."""
        self.refresh()
        exp, algo = self.exp, self.exp.algorithm
        lr = lr_at(exp.cfg, round_)
        custom_predictor = type(algo).predictor is not Algorithm.predictor
        accs: dict[int, float] = {}
        encoder, contents = _Encoder(), {}
        for c in range(self.num_clients):
            # decide with the state a new client starts from; the node's own state decides instead when
            # the client has one there and client_model or personalize_stages looked at the state
            state = _Reads(algo.init_client_state(c, server))
            view = ServerState(_Reads(server.model), _Reads(server.extra))
            model_c = algo.client_model(view, state, c)
            payload = algo.payload(server, c)
            tune = algo.personalize_stages(exp.client_context(c, round_, lr, payload, state, server))
            settled = c not in self.has_state or not state.read
            if settled and model_c is view.model and not tune and not custom_predictor:
                # the global model itself: scored here from the global test set's predictions
                acc, _ = exp.client_accuracy(c, server, dict(state), round_, global_correct, payload=payload)
                if acc is not None:
                    accs[c] = acc
                continue
            if model_c is view.model or not settled:  # the global model, whole (fine-tuned, wrapped, mixed)
                view.model.update_read()  # type: ignore[attr-defined]
            model_keys, extra_keys = view.model.read, view.extra.read  # type: ignore[attr-defined]
            records: dict[str, Any] = {
                P.VIEW_MODEL: encoder.record({k: v for k, v in server.model.items() if k in model_keys}),
                P.VIEW_EXTRA: encoder.record({k: v for k, v in server.extra.items()
                                              if k in extra_keys and not k.startswith(SHARED)}),
            }
            if tune or custom_predictor or not settled:  # fine-tuning losses and predictors may read it
                records[P.PAYLOAD] = encoder.record(payload)
            h = self.header(c, round_, lr=lr)
            self.add_client_records(records, h, c, server, encoder)
            contents[c] = RecordDict({**records, P.HEADER: ConfigRecord(h)})
        if contents:
            replies = self.exchange(P.EVALUATE, contents, round_)
            answered = 0
            for c in sorted(replies):
                try:
                    acc = _accuracy(replies[c][P.RESULT])
                except MALFORMED as err:
                    self.fail(c, f"{P.EVALUATE}: {_why(err)}")
                    continue
                answered += 1
                self.acknowledge(c, server)
                if acc is not None:
                    accs[c] = acc
            self.check_quorum(answered, len(contents), round_, "evaluation")
        return accs


def upload_digest(content: Any, name: str) -> str | None:
    """SHA-256 of the arrays in record ``name`` of a reply (name, dtype, stype, shape and bytes of each, in name
    order), read without decoding them (an oversized or undecodable upload too); None where the reply carries
    no such record of arrays (no upload reached the server)."""
    try:
        record = content[name] if name and name in content else None
    except MALFORMED:
        return None
    if not isinstance(record, ArrayRecord):
        return None
    h = hashlib.sha256()
    for key in sorted(record.keys()):
        a = record[key]
        h.update(f"{key}|{a.dtype}|{a.stype}|{tuple(a.shape)}|{len(a.data)}|".encode())
        h.update(a.data)
    return h.hexdigest()


Form = tuple[tuple[str, tuple[int, ...], str], ...]


def upload_form(upload: Tensors) -> Form:
    """The names, shapes and dtypes of an upload's tensors, in name order (what a round's uploads share)."""
    return tuple((name, tuple(t.shape), str(t.dtype)) for name, t in sorted(upload.items()))


def form_difference(mine: Form, theirs: Form) -> str:
    """How an upload's form differs from the round's others (the first three differences), for the log."""
    a, b = {n: (s, d) for n, s, d in mine}, {n: (s, d) for n, s, d in theirs}
    found = [f"lacks {n!r}" for n in b if n not in a] + [f"has {n!r}, which they lack" for n in a if n not in b]
    for name in sorted(a.keys() & b.keys()):
        (shape, dtype), (their_shape, their_dtype) = a[name], b[name]
        if shape != their_shape:
            found.append(f"{name!r} has shape {list(shape)}, theirs {list(their_shape)}")
        elif dtype != their_dtype:
            found.append(f"{name!r} is {dtype}, theirs {their_dtype}")
    return "; ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")


def _why(err: BaseException) -> str:
    """A malformed reply's reason for the log: a MalformedReply says it; anything else is named as such."""
    if isinstance(err, MalformedReply):
        return str(err)
    return f"malformed reply ({type(err).__name__}: {err})"


def _whole(result: Any, key: str) -> int:
    """A reply's whole number ``key`` (>= 0); a ValueError for anything else (an infinite one too: ``int(inf)``
    would raise OverflowError, which is no malformed reply to the server and would stop the run)."""
    value = result[key]
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or (isinstance(value, float) and not math.isfinite(value)) or value < 0 or value != int(value)):
        raise MalformedReply(f"malformed reply: {key} = {value!r} is no whole number >= 0")
    return int(value)


def _accuracy(result: Any) -> float | None:
    """An evaluation reply's accuracy (None: the client has no test split); a ValueError outside [0, 1]."""
    if "acc" not in result:
        if "empty" not in result:
            raise MalformedReply("malformed reply: neither acc nor empty")
        return None
    acc = float(result["acc"])
    if not 0.0 <= acc <= 1.0:
        raise MalformedReply(f"malformed reply: acc = {acc!r} is outside [0, 1]")
    return acc
