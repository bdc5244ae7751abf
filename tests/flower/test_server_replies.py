"""What hetfl's Flower server accepts from a node, case by case (hetfl.flower.server): the numbers of a reply
(whole counts, accuracies in [0, 1]), an upload's size, shapes and sample count, the digest of a refused upload
kept for the privacy ledger, a node found holding other data, and the reasons the log gives. The whole runs of
test_flower_logic.py and test_flower_refused_privacy.py exercise the same paths on loopback nodes."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("flwr", reason='Flower is not installed: pip install "hetfl[flower]"')

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from hetfl import config
from hetfl.engine.experiment import Experiment
from hetfl.flower import protocol as P
from hetfl.flower import server as S
from hetfl.flower.codec import client_data_digest, encode_tensor, record_nbytes
from tests.flower.test_flower_logic import SMALL as LOOPBACK
from tests.flower.test_flower_logic import LoopbackGrid, run_on

SMALL = ["data.num_clients=3", "data.partition=dirichlet", "train.rounds=1", "train.batch_size=16",
         "model.options={hidden = [8]}", "runtime.progress=false", "runtime.threads=1", "runtime.executor=flower"]


@pytest.fixture(scope="module")
def fed() -> S.FlowerFederation:
    """A server side of three clients (FedAvg on Synthetic), never connected: its reply checks run on their own."""
    return S.FlowerFederation(Experiment(config.load(None, SMALL)), grid=None)


@pytest.fixture(autouse=True)
def fresh(fed):
    fed.failed, fed.refused, fed.nodes, fed.other_data_nodes = {}, {}, {}, {}


def test_a_reply_accuracy_is_a_number_in_the_closed_unit_interval_or_empty():
    assert S._accuracy({"acc": 1.0}) == 1.0 and S._accuracy({"acc": 0.0}) == 0.0 and S._accuracy({"acc": 0.25}) == 0.25
    assert S._accuracy({"empty": 1}) is None  # a client without a test split
    for acc in (1.0000001, 1.5, 2.0, -1e-9):
        with pytest.raises(S.MalformedReply) as err:
            S._accuracy({"acc": acc})
        assert str(err.value) == f"malformed reply: acc = {acc!r} is outside [0, 1]"
    with pytest.raises(S.MalformedReply) as err:
        S._accuracy({"loss": 0.5})
    assert str(err.value) == "malformed reply: neither acc nor empty"


@pytest.mark.parametrize("value", [-1, 2.5, True, "3", None, float("nan"), float("inf"), -float("inf")])
def test_a_count_in_a_reply_is_a_whole_number_at_least_zero(value):
    with pytest.raises(S.MalformedReply) as err:
        S._whole({"steps": value}, "steps")
    assert str(err.value) == f"malformed reply: steps = {value!r} is no whole number >= 0"


def test_whole_counts_are_read_as_ints():
    assert [S._whole({"n": v}, "n") for v in (0, 7, 7.0, 2**40)] == [0, 7, 7, 2**40]
    assert type(S._whole({"n": 7.0}, "n")) is int


def test_the_reason_of_a_malformed_reply_names_what_was_raised():
    assert S._why(S.MalformedReply("malformed reply: no upload")) == "malformed reply: no upload"
    assert S._why(KeyError("upload")) == "malformed reply (KeyError: 'upload')"
    assert S._why(ValueError("bad")) == "malformed reply (ValueError: bad)"


def upload_record(**tensors: torch.Tensor) -> ArrayRecord:
    return ArrayRecord({name: encode_tensor(t) for name, t in tensors.items()})


def test_the_digest_of_an_upload_covers_every_array_and_nothing_else():
    a, b = torch.arange(6.0).reshape(2, 3), torch.ones(4, dtype=torch.int64)
    content = RecordDict({P.UPLOAD: upload_record(w=a, n=b), P.RESULT: MetricRecord({"loss-sum": 1.0})})
    digest = S.upload_digest(content, P.UPLOAD)
    h = hashlib.sha256()
    for key in ("n", "w"):
        arr = content[P.UPLOAD][key]
        h.update(f"{key}|{arr.dtype}|{arr.stype}|{tuple(arr.shape)}|{len(arr.data)}|".encode())
        h.update(arr.data)
    assert digest == h.hexdigest()
    assert S.upload_digest(RecordDict({P.UPLOAD: upload_record(n=b, w=a)}), P.UPLOAD) == digest  # name order
    assert S.upload_digest(RecordDict({P.UPLOAD: upload_record(w=a, n=b + 1)}), P.UPLOAD) != digest
    assert S.upload_digest(RecordDict({P.UPLOAD: upload_record(w=a.reshape(3, 2), n=b)}), P.UPLOAD) != digest
    assert S.upload_digest(content, "") is None and S.upload_digest(content, P.REPLY) is None
    assert S.upload_digest(RecordDict({P.UPLOAD: ConfigRecord({"x": 1})}), P.UPLOAD) is None  # no arrays
    assert S.upload_digest(None, P.UPLOAD) is None  # no content at all


def test_a_refused_training_or_posthoc_upload_is_kept_as_its_digest(fed):
    upload = RecordDict({P.UPLOAD: upload_record(w=torch.ones(3))})
    reply = RecordDict({P.REPLY: upload_record(mean=torch.zeros(2))})
    fed.refuse(0, upload, P.TRAIN)
    fed.refuse(1, reply, P.POSTHOC)
    fed.refuse(2, upload, P.EVALUATE)  # an evaluation reply carries no release
    assert fed.refused == {0: S.upload_digest(upload, P.UPLOAD), 1: S.upload_digest(reply, P.REPLY)}
    assert all(isinstance(d, str) and len(d) == 64 for d in fed.refused.values())


def test_a_node_found_holding_other_data_is_left_out_until_it_restarts(fed):
    fed.nodes = {0: 11, 1: 12}
    fed.other_data_nodes = {0: (11, "the node holds other data"), 1: (99, "the node holds other data")}
    assert fed.holds_other_data(0) == "the node holds other data"
    assert fed.holds_other_data(1) == ""  # client 1's node restarted (another id): asked again, its reply checked
    assert fed.holds_other_data(2) == ""


def test_a_reply_without_a_digest_of_the_clients_data_is_refused_naming_why(fed):
    ours = client_data_digest(fed.exp.data, 1)
    assert fed.other_data(1, RecordDict({P.DATA: ConfigRecord({"digest": ours})})) == ""
    assert fed.other_data(1, RecordDict({})) == ("malformed reply: no digest of the client's data (a node running "
                                                 "another hetfl version?)")
    other = fed.other_data(1, RecordDict({P.DATA: ConfigRecord({"digest": "0" * 32})}))
    assert other == (f"the node holds other data than the server's for client 1 (digest of its training and test "
                     f"samples {'0' * 32}, the server's {ours}): give the node a copy of the dataset files of the "
                     "server's data.root (synthetic) in its node config data-root; refused")


def test_an_upload_at_its_size_limit_is_read_and_one_byte_more_is_refused(fed):
    server = SimpleNamespace(model={"w": torch.zeros(4)})
    record = upload_record(w=torch.ones(4))
    size = record_nbytes([record])
    content = RecordDict({P.UPLOAD: record, P.RESULT: MetricRecord(
        {"num-samples": fed.exp.data.client_sizes[0], "steps": 3, "loss-sum": 1.5, "has-state": 1,
         P.LOSS_PART + "ce": 1.25})})
    sent = 0
    slack, S.UPLOAD_SLACK = S.UPLOAD_SLACK, size  # the limit: UPLOAD_FACTOR x 0 bytes sent + this slack
    try:
        update, has_state = fed.read_update(0, content, sent, server)
        assert (update.client_id, update.num_samples, update.steps, update.loss_sum) == (
            0, fed.exp.data.client_sizes[0], 3, 1.5)
        assert update.part_sums == {"ce": 1.25} and has_state is True
        assert torch.equal(update.upload["w"], torch.ones(4)) and update.upload["w"].device == fed.exp.device
        S.UPLOAD_SLACK = size - 1
        with pytest.raises(S.MalformedReply) as err:
            fed.read_update(0, content, sent, server)
        assert str(err.value) == (f"oversized reply: an upload of {size} bytes, more than {size - 1} "
                                  f"({S.UPLOAD_FACTOR} x the 0 bytes sent + {size - 1})")
    finally:
        S.UPLOAD_SLACK = slack


def test_a_reply_with_an_infinite_count_is_refused_not_the_end_of_the_run(fed):
    """``steps = inf`` in a node's reply raised OverflowError (``int(inf)``), which is no malformed reply to the
    server: the whole run stopped on one node's reply. Now that reply is refused, its upload kept as refused, and
    the other clients' replies are read."""
    server = SimpleNamespace(model={"w": torch.zeros(2)})

    def reply(steps: float) -> RecordDict:
        return RecordDict({P.UPLOAD: upload_record(w=torch.ones(2)), P.RESULT: MetricRecord(
            {"num-samples": fed.exp.data.client_sizes[0], "steps": steps, "loss-sum": 1.0, "has-state": 0})})

    sent = RecordDict({P.PAYLOAD: upload_record(w=torch.zeros(2))})
    replies = {0: reply(float("inf")), 1: reply(2)}
    replies[1][P.RESULT]["num-samples"] = fed.exp.data.client_sizes[1]
    read = fed.read_updates([0, 1], {0: sent, 1: sent}, replies, server)
    assert [update.client_id for update, _ in read] == [1]
    assert fed.failed == {0: "train: malformed reply: steps = inf is no whole number >= 0"}
    assert fed.refused == {0: S.upload_digest(replies[0], P.UPLOAD)}


# ------------------------------------------------------------- whole runs: one node's reply the others' form
class TamperedGrid(LoopbackGrid):
    """Loopback nodes; node 1's replies to ``kind`` messages changed in place by ``tamper`` (``train``: its
    upload record; ``query.posthoc``: its reply record)."""

    def __init__(self, kind: str, tamper: Callable[[ArrayRecord], None]) -> None:
        super().__init__(3)
        self.kind, self.change = kind, tamper

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        for message, i in zip(messages, ids, strict=True):
            answer = self.replies.get(i)
            if (message.metadata.message_type == self.kind and message.metadata.dst_node_id == self.ids[1]
                    and answer is not None and not answer.has_error()):
                self.change(answer.content[P.UPLOAD if self.kind == P.TRAIN else P.REPLY])
        return ids


def failures(run: Path) -> list[list[int]]:
    return [json.loads(x)["failed_clients"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "client 1 failed" in r.getMessage()]


def drop_first(record: ArrayRecord) -> None:
    del record[sorted(record.keys())[0]]


def as_int64(record: ArrayRecord) -> None:
    name = sorted(record.keys())[0]
    record[name] = encode_tensor(torch.ones(tuple(record[name].shape), dtype=torch.int64))


def control_of_another_shape(record: ArrayRecord) -> None:
    record["scaffold.c/classifier.bias"] = encode_tensor(torch.ones(2, 2))


@pytest.mark.parametrize(("method", "tamper", "reason"), [
    ("fedavg", drop_first, "lacks 'classifier.bias'"),
    ("fedavg", as_int64, "'classifier.bias' is torch.int64, the model's torch.float32"),
    ("scaffold", control_of_another_shape, "'scaffold.c/classifier.bias' has shape [2, 2], theirs [10]"),
], ids=["missing-tensor", "int64-weights", "control-variate-shape"])
def test_an_upload_unlike_the_rounds_other_uploads_is_refused_not_the_end_of_the_run(method, tamper, reason,
                                                                                     tmp_path, caplog):
    """A node whose upload lacks one of the method's tensors, or holds one of another shape or dtype (another
    hetfl version, a plug-in's bug), stopped the whole run inside ``aggregate`` (a KeyError or a shape error), or
    was averaged in as integers. Every method's uploads have the same tensors at every client: the one that
    differs from the round's others is refused, the run goes on without it."""
    run_on(TamperedGrid(P.TRAIN, tamper), [*LOOPBACK, f"algorithm.name={method}"], tmp_path / "r")
    assert failures(tmp_path / "r") == [[1], [1]]
    assert said(caplog) and all(reason in x for x in said(caplog)), said(caplog)


def test_a_malformed_ccvr_reply_is_refused_and_the_others_calibrate(tmp_path, caplog):
    """A node's CCVR statistics with a float tensor for the class indices stopped the run (an IndexError in the
    pooling); now that reply is refused and the server pools the other clients' statistics."""
    def float_classes(record: ArrayRecord) -> None:
        record["classes"] = encode_tensor(torch.ones(3, 7, dtype=torch.float64))

    run_on(TamperedGrid(P.POSTHOC, float_classes), [*LOOPBACK, "algorithm.name=fedavg+ccvr"], tmp_path / "r")
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["failed_clients"] == [1] and lines[-1]["ccvr_virtual_features"] > 0
    assert any("classes" in x for x in said(caplog)), said(caplog)


# ------------------------------------------------------------- the phases' messages, counts and stops
class CountingGrid(LoopbackGrid):
    """Loopback nodes that keep each pushed message's type, round, TTL and array bytes, and each reply's bytes."""

    def __init__(self, num_nodes: int = 3) -> None:
        super().__init__(num_nodes)
        self.pushed: list[tuple[str, str, float, int]] = []
        self.pulled: list[tuple[str, int]] = []
        self.kinds: dict[str, tuple[str, str]] = {}

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        for message, i in zip(messages, ids, strict=True):
            meta = message.metadata
            self.kinds[i] = (meta.message_type, meta.group_id)
            self.pushed.append((meta.message_type, meta.group_id, meta.ttl,
                                record_nbytes(r for r in message.content.values() if isinstance(r, ArrayRecord))))
        return ids

    def pull_messages(self, message_ids):
        got = super().pull_messages(message_ids)
        for m in got:
            if not m.has_error():
                self.pulled.append((self.kinds[m.metadata.reply_to_message_id][1],
                                    record_nbytes(r for r in m.content.values() if isinstance(r, ArrayRecord))))
        return got


def test_the_phases_messages_carry_their_ttl_and_a_rounds_traffic_is_their_bytes(tmp_path):
    grid = CountingGrid()
    exp = Experiment(config.load(None, [*LOOPBACK, "algorithm.name=fedavg", "runtime.executor=flower"]))
    fed = exp.federation = S.FlowerFederation(exp, grid, poll_s=0.01, state_root=str(tmp_path / "nodes"))
    exp.run(tmp_path / "r")
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        group = str(line["round"])
        sent = [n for kind, g, _, n in grid.pushed if kind == P.TRAIN and g == group]
        assert len(sent) == 3 and line["flower_bytes_down"] == sum(sent) > 0
        assert line["flower_bytes_up"] == sum(n for g, n in grid.pulled if g == group) > 0
    assert {ttl for kind, _, ttl, _ in grid.pushed if kind != P.HELLO} == {fed.ttl} and fed.ttl == fed.timeout + 60


def test_a_client_that_no_node_holds_is_left_out_and_the_others_train(tmp_path, caplog):
    grid = CountingGrid(3)
    grid.ids = [grid.ids[0], grid.ids[2]]  # nobody holds client 1
    run_on(grid, [*LOOPBACK, "algorithm.name=fedavg", "runtime.flower_min_replies=1",
                  "runtime.flower_timeout_s=0.2"], tmp_path / "r")
    assert failures(tmp_path / "r") == [[1], [1]]
    assert [g for kind, g, _, _ in grid.pushed if kind == P.TRAIN] == ["1", "1", "2", "2"]  # clients 0 and 2
    assert said(caplog) == ["flower: client 1 failed: no node holds this client's partition"] * 2


def test_a_round_whose_one_client_does_not_answer_stops_the_run(tmp_path):
    grid = LoopbackGrid(3)
    grid.dead.update(grid.ids)
    with pytest.raises(S.FlowerRoundError, match=r"^round 1, training: 0 of 1 clients answered"):
        run_on(grid, [*LOOPBACK, "algorithm.name=fedavg", "train.clients_per_round=1",
                      "runtime.flower_timeout_s=0.2"], tmp_path / "r")


def test_too_few_answers_name_the_first_five_failures_and_what_to_do(fed):
    fed.min_replies = 0
    fed.failed = {c: f"reason {c}" for c in range(6)}
    with pytest.raises(S.FlowerRoundError) as err:
        fed.check_quorum(0, 6, 3, "training")
    assert str(err.value) == (
        "round 3, training: 0 of 6 clients answered; runtime.flower_min_replies = 0 needs 6 (client 0: reason 0; "
        "client 1: reason 1; client 2: reason 2; client 3: reason 3; client 4: reason 4). The run stops with its "
        "last checkpoint kept: once enough clients' nodes can answer (see the reasons), resume it")
    fed.check_quorum(6, 6, 3, "training")
    fed.check_quorum(0, 0, 3, "evaluation")  # nothing asked: nothing to answer


def test_a_reply_is_read_onto_the_servers_device_and_its_refusals_say_why(fed, monkeypatch):
    """Uploads and post-hoc replies are decoded onto the experiment's device (``meta`` here: where no tensor
    comes by default); a reply without the method's noisy statistics, or with another client's sample count, is
    refused naming them."""
    monkeypatch.setattr(fed.exp, "device", torch.device("meta"))
    server = SimpleNamespace(model={"w": torch.zeros(2)})
    result = {"num-samples": fed.exp.data.client_sizes[0], "steps": 1, "loss-sum": 1.0, "has-state": 0}
    content = RecordDict({P.UPLOAD: upload_record(w=torch.ones(2)), P.RESULT: MetricRecord(result)})
    update, _ = fed.read_update(0, content, 10**6, server)
    assert update.upload["w"].device.type == "meta"
    replies = fed.tensor_replies(P.POSTHOC, {2: RecordDict({P.REPLY: upload_record(m=torch.ones(3))}),
                                             1: RecordDict({})})
    assert list(replies) == [2] and replies[2]["m"].device.type == "meta"
    assert fed.failed == {1: "query.posthoc: malformed reply (KeyError: 'reply')"}
    monkeypatch.setattr(fed.exp.algorithm, "dp_upload_keys", ("noisy/counts", "noisy/sums"))
    with pytest.raises(S.MalformedReply) as err:
        fed.read_update(0, content, 10**6, server)
    assert str(err.value) == "malformed reply: the upload lacks noisy/counts, noisy/sums"
    monkeypatch.setattr(fed.exp.algorithm, "dp_upload_keys", ())
    result["num-samples"] += 1
    with pytest.raises(S.MalformedReply) as err:
        fed.read_update(0, RecordDict({P.UPLOAD: upload_record(w=torch.ones(2)), P.RESULT: MetricRecord(result)}),
                        10**6, server)
    assert str(err.value) == (f"malformed reply: num-samples = {result['num-samples']}, but client 0 holds "
                              f"{result['num-samples'] - 1} training samples")


# ------------------------------------------------------------- the set-up round's replies
class TamperedSetupGrid(LoopbackGrid):
    """Loopback nodes; node 1's set-up reply changed in place by ``tamper``."""

    def __init__(self, tamper: Callable[[ArrayRecord], None]) -> None:
        super().__init__(3)
        self.change = tamper

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        for message, i in zip(messages, ids, strict=True):
            answer = self.replies.get(i)
            if message.metadata.message_type == P.SETUP and message.metadata.dst_node_id == self.ids[1] \
                    and answer is not None and not answer.has_error():
                self.change(answer.content[P.REPLY])
        return ids


def test_a_malformed_fedmix_setup_reply_is_refused_and_the_others_means_are_shared(tmp_path, caplog):
    """FedMix's averaged data with labels of another class count: ``torch.cat`` in ``setup_aggregate`` stopped the
    run; now the reply is refused (FedMix's ``check_setup_reply``) and, with a quorum of 2, the other clients'
    means are shared."""
    def other_labels(record: ArrayRecord) -> None:
        record["fedmix.y"] = encode_tensor(torch.full((2, 7), 1 / 7))

    grid = TamperedSetupGrid(other_labels)
    run_on(grid, [*LOOPBACK, "algorithm.name=fedmix", "runtime.flower_min_replies=2"], tmp_path / "r")
    assert failures(tmp_path / "r") == [[1], []]  # the set-up round's failure is counted in round 1
    assert any("query.setup: malformed reply (ValueError: 'fedmix.y' has shape [2, 7]" in x for x in said(caplog))


def test_an_error_reply_in_before_the_run_was_stopped_is_logged_with_its_phase(tmp_path, caplog, monkeypatch):
    """Stopped while it waited for a phase's replies (Ctrl-C), the server reads those already in, an error reply
    among them recorded for its client under the phase's name."""
    class SlowTraining(LoopbackGrid):
        def push_messages(self, messages):  # node 2's training reply never comes: the server waits, is stopped
            self.slow = {self.ids[2]} if messages[0].metadata.message_type == P.TRAIN else set()
            return super().push_messages(messages)

    grid = SlowTraining(3)
    grid.broken.add(grid.ids[1])

    def stopped(self) -> None:
        raise S.FlowerStopped("the Flower run was stopped")

    monkeypatch.setattr(S.FlowerFederation, "_sleep", stopped)
    with pytest.raises(S.FlowerStopped):
        run_on(grid, [*LOOPBACK, "algorithm.name=fedavg"], tmp_path / "r")
    assert said(caplog) == ["flower: client 1 failed: train: disk full"]


def test_a_reply_to_no_message_of_the_phase_is_passed_over(fed):
    """``by_client`` reads the replies to the phase's messages only; one that answers another message (a grid's
    stray reply) is passed over, and the replies after it are read."""
    from flwr.app import Message

    def message(client: int) -> Message:
        m = Message(RecordDict({}), dst_node_id=100 + client, message_type=P.TRAIN)
        m.metadata.__dict__["_message_id"] = f"m{client}"
        return m

    def reply_to(m: Message, digest: str) -> Message:
        return Message(RecordDict({P.DATA: ConfigRecord({"digest": digest})}), reply_to=m)

    asked = [message(0), message(2)]
    stray = reply_to(message(1), client_data_digest(fed.exp.data, 1))
    answers = [stray, *(reply_to(m, client_data_digest(fed.exp.data, c)) for m, c in zip(asked, (0, 2), strict=True))]
    assert sorted(fed.by_client(P.TRAIN, answers, asked, [0, 2])) == [0, 2]


# ------------------------------------------------------------- the nodes' greetings
@pytest.mark.parametrize("greeting", [None, ConfigRecord({"partition-id": "abc", "num-partitions": 3}),
                                      MetricRecord({"partition-id": float("inf"), "num-partitions": 3}),
                                      MetricRecord({"partition-id": 1})],
                         ids=["no-result", "text", "infinite", "no-num-partitions"])
def test_a_malformed_greeting_leaves_its_node_out_not_the_end_of_the_run(greeting, tmp_path, caplog):
    """A node whose answer to ``query.hello`` lacks its partition or names it with something else than a whole
    number (another app on the SuperLink, another hetfl version) stopped the server at its first phase (KeyError,
    ValueError, OverflowError). Now the node is left out, its client counted as failed, the run goes on."""
    class Greeting(LoopbackGrid):
        def push_messages(self, messages):
            ids = super().push_messages(messages)
            for message, i in zip(messages, ids, strict=True):
                if message.metadata.message_type == P.HELLO and message.metadata.dst_node_id == self.ids[1]:
                    content = self.replies[i].content
                    del content[P.RESULT]
                    if greeting is not None:
                        content[P.RESULT] = greeting
            return ids

    grid = Greeting(3)
    run_on(grid, [*LOOPBACK, "algorithm.name=fedavg", "runtime.flower_min_replies=1",
                  "runtime.flower_timeout_s=0.2"], tmp_path / "r")
    assert failures(tmp_path / "r") == [[1], [1]]
    why = {None: "malformed reply (KeyError: 'result')",
           "text": "malformed reply: partition-id = 'abc' is no whole number >= 0",
           "infinite": "malformed reply: partition-id = inf is no whole number >= 0",
           "no-num-partitions": "malformed reply (KeyError: 'num-partitions')"}
    case = None if greeting is None else "text" if isinstance(greeting, ConfigRecord) else \
        "infinite" if "num-partitions" in greeting else "no-num-partitions"
    warned = [r.getMessage() for r in caplog.records if f"node {grid.ids[1]}" in r.getMessage()]
    assert warned == [f"flower: node {grid.ids[1]}'s greeting is malformed ({why[case]}); it is left out"]


class InOrderGrid(LoopbackGrid):
    """Loopback nodes whose replies come in the order their messages were pushed (node 0's greeting first)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.order: list[str] = []

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        self.order += ids
        return ids

    def pull_messages(self, message_ids):
        return super().pull_messages(sorted(message_ids, key=self.order.index))


def test_a_greeting_that_is_an_error_leaves_that_node_out_and_the_others_in(tmp_path):
    from flwr.app import Error, Message

    class ErrorGreeting(InOrderGrid):
        def push_messages(self, messages):
            ids = super().push_messages(messages)
            for message, i in zip(messages, ids, strict=True):
                if message.metadata.message_type == P.HELLO and message.metadata.dst_node_id == self.ids[0]:
                    self.replies[i] = Message(Error(code=0, reason="starting"), reply_to=message)
            return ids

    run_on(ErrorGreeting(3), [*LOOPBACK, "algorithm.name=fedavg", "runtime.flower_min_replies=1",
                              "runtime.flower_timeout_s=0.2"], tmp_path / "r")
    assert failures(tmp_path / "r") == [[0], [0]]  # nodes 1 and 2, greeted after node 0's error, hold their clients


@pytest.mark.parametrize("simulation", [False, True])
def test_a_node_outside_the_runs_partitions_is_left_out_and_named_outside_a_simulation(simulation, tmp_path, caplog):
    """Four nodes for three clients: the first greeting names partition 3 (num-partitions 4): that node is left
    out and the others still greeted; a deployment says so (and that num-partitions differs), a simulation (whose
    nodes Flower numbers itself) does not."""
    grid = InOrderGrid(4)
    for node, partition in zip(grid.ids, (3, 0, 1, 2), strict=True):
        grid.contexts[node].node_config["partition-id"] = partition
    exp = Experiment(config.load(None, [*LOOPBACK, "algorithm.name=fedavg", "runtime.executor=flower"]))
    exp.federation = S.FlowerFederation(exp, grid, poll_s=0.01, state_root=str(tmp_path / "n"), simulation=simulation)
    exp.run(tmp_path / "r")
    assert failures(tmp_path / "r") == [[], []]
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("flower: node")]
    expected = [f"flower: node {grid.ids[0]} holds partition-id 3, not one of this run's 3 clients",
                *(f"flower: node {n} says num-partitions = 4; this run has 3 clients (data.num_clients)"
                  for n in grid.ids[1:])]
    assert sorted(warned) == ([] if simulation else sorted(expected))


def test_uploads_of_a_method_whose_uploads_differ_by_client_are_all_read(fed, monkeypatch):
    model = fed.exp.initial_server().model
    sent = RecordDict({P.PAYLOAD: upload_record(w=torch.zeros(2))})

    def reply(c: int) -> RecordDict:
        tensors = {**model, "extra": torch.zeros(c + 1)}  # a form of its own at every client
        return RecordDict({P.UPLOAD: ArrayRecord({k: encode_tensor(v) for k, v in tensors.items()}),
                           P.RESULT: MetricRecord({"num-samples": fed.exp.data.client_sizes[c], "steps": 1,
                                                   "loss-sum": 1.0, "has-state": 0})})

    replies = {c: reply(c) for c in range(3)}
    server = SimpleNamespace(model=model)
    # the default (every method's uploads have one form): three forms, none that of most: none is used
    assert fed.read_updates([0, 1, 2], dict.fromkeys(range(3), sent), replies, server) == []
    fed.failed, fed.refused = {}, {}
    monkeypatch.setattr(fed.exp.algorithm, "uniform_upload", False)
    read = fed.read_updates([0, 1, 2], dict.fromkeys(range(3), sent), replies, server)
    assert [u.client_id for u, _ in read] == [0, 1, 2] and fed.failed == {}


def test_a_setup_reply_fedbr_cannot_do_without_stops_the_run_naming_the_client(tmp_path):
    """FedBR's pseudo-data plan assigns samples to clients: without one's set-up reply (its node failed, with a
    quorum that allows it) ``setup_aggregate`` stopped in a ValueError; now the run stops as a phase without
    enough answers does (resumable), naming the client and why."""
    class FailingSetup(LoopbackGrid):
        def push_messages(self, messages):
            self.broken = {self.ids[1]} if messages[0].metadata.message_type == P.SETUP else set()
            return super().push_messages(messages)

    with pytest.raises(S.FlowerRoundError) as err:
        run_on(FailingSetup(3), [*LOOPBACK, "algorithm.name=fedbr", "runtime.flower_min_replies=2"], tmp_path / "r")
    assert str(err.value) == ("set-up round: fedbr cannot build its set-up without client(s) [1] (client 1: "
                              "query.setup: disk full). The run stops: once their nodes can answer, resume it")


def test_the_setup_messages_are_round_0_at_round_1s_rate_without_client_states(tmp_path):
    """The set-up round's messages, as the in-process executors' set-up: round 0 (its group), the learning rate of
    round 1 (under a cosine schedule, round 2's is another), no initial client state (the set-up reads none)."""
    seen: list = []

    class Capturing(LoopbackGrid):
        def push_messages(self, messages):
            seen.extend(m for m in messages if m.metadata.message_type == P.SETUP)
            return super().push_messages(messages)

    overrides = [*LOOPBACK, "algorithm.name=fedmix", "train.lr_schedule=cosine", "train.lr=0.1", "train.lr_min=0.01"]
    run_on(Capturing(3), overrides, tmp_path / "r")
    assert len(seen) == 3
    for message in seen:
        header = message.content[P.HEADER]
        assert (header["round"], header["lr"], message.metadata.group_id) == (0, 0.1, "0")
        assert set(message.content.keys()) == {P.HEADER}


def test_a_setup_round_short_of_answers_stops_naming_it_and_the_needed_clients(tmp_path):
    class FailingSetup(LoopbackGrid):
        def __init__(self, n: int, failing: set[int]) -> None:
            super().__init__(n)
            self.failing = {self.ids[i] for i in failing}

        def push_messages(self, messages):
            self.broken = self.failing if messages[0].metadata.message_type == P.SETUP else set()
            return super().push_messages(messages)

    with pytest.raises(S.FlowerRoundError, match=r"^round 1, set-up round: 2 of 3 clients answered; "):
        run_on(FailingSetup(3, {1}), [*LOOPBACK, "algorithm.name=fedmix", "runtime.flower_min_replies=0"],
               tmp_path / "a")
    many = [*LOOPBACK, "data.num_clients=8", "algorithm.name=fedbr", "algorithm.num_pseudo=64",
            "runtime.flower_min_replies=1"]
    with pytest.raises(S.FlowerRoundError) as err:
        run_on(FailingSetup(8, {1, 2, 3, 4, 5, 6}), many, tmp_path / "b")
    assert str(err.value) == (
        "set-up round: fedbr cannot build its set-up without client(s) [1, 2, 3, 4, 5, 6] ("
        + "; ".join(f"client {c}: query.setup: disk full" for c in range(1, 6))
        + "). The run stops: once their nodes can answer, resume it")


def test_an_uploads_form_and_how_it_differs_from_the_rounds(fed):
    f32, f64 = torch.zeros(2), torch.zeros(2, dtype=torch.float64)
    assert S.upload_form({"w": torch.zeros(2, 3), "b": torch.zeros(1, dtype=torch.int64)}) == (
        ("b", (1,), "torch.int64"), ("w", (2, 3), "torch.float32"))
    theirs = S.upload_form({"a": f32, "b": f32, "c": f32, "d": f32, "e": f32})
    assert S.form_difference(S.upload_form({"a": f64, "b": f32, "c": f32, "d": f32, "e": f32}), theirs) == (
        "'a' is torch.float64, theirs torch.float32")
    three = S.upload_form({"a": f64, "b": torch.zeros(3), "c": f32, "d": f32})
    assert S.form_difference(three, theirs) == ("lacks 'e'; 'a' is torch.float64, theirs torch.float32; 'b' has shape "
                                                "[3], theirs [2]")
    four = S.upload_form({"a": f64, "b": torch.zeros(3), "c": f32, "d": f32, "x": f32})
    assert S.form_difference(four, theirs) == ("lacks 'e'; has 'x', which they lack; 'a' is torch.float64, theirs "
                                               "torch.float32 and 1 more")
    five = S.upload_form({"a": f64, "b": torch.zeros(3), "x": f32, "y": f32})
    assert S.form_difference(five, theirs) == "lacks 'c'; lacks 'd'; lacks 'e' and 4 more"
    # a round of three: the one upload whose control variate is float64 is refused, its upload kept as refused
    updates = [(S.ClientUpdate(c, {"w": f32, "c/w": f64 if c == 2 else f32}, 10, 1, 1.0), False) for c in range(3)]
    replies = {c: RecordDict({P.UPLOAD: upload_record(w=f32)}) for c in range(3)}
    kept = fed.of_the_rounds_form(updates, replies)
    assert [u.client_id for u, _ in kept] == [0, 1]
    assert fed.failed == {2: "train: malformed reply: its upload differs from the round's 2 other uploads: 'c/w' is "
                             "torch.float64, theirs torch.float32"}
    assert fed.refused == {2: S.upload_digest(replies[2], P.UPLOAD)}
    fed.failed, fed.refused = {}, {}
    assert fed.of_the_rounds_form(updates[1:], replies) == []  # one against one: neither can be told right
    assert fed.failed[1] == fed.failed[2] == ("train: malformed reply: the round's 2 uploads differ in their tensors' "
                                              "names, shapes or dtypes (2 forms) and no form is that of most of them; "
                                              "none is used")


def test_shared_tensors_a_method_holds_before_its_setup_round_go_with_it_once(tmp_path, monkeypatch):
    """A method whose server holds ``shared/`` tensors from the start and has a set-up round (no built-in one
    has both: a plug-in may): the set-up messages carry them, and round 1's training messages do not send them
    again (the nodes acknowledged them)."""
    from hetfl import algorithms
    from hetfl.algorithms.base import SHARED, ServerState
    from hetfl.algorithms.fedbr import FedBR

    class SharedBeforeSetup(FedBR):
        name = "shared_before_setup_demo"

        def init_server(self, model_state):
            server = super().init_server(model_state)
            return ServerState(model=server.model, extra={**server.extra, SHARED + "marker": torch.arange(3.0)})

    monkeypatch.setattr(algorithms, "_CLASSES", {})
    algorithms.register(SharedBeforeSetup)
    seen: list = []

    class Capturing(LoopbackGrid):
        def push_messages(self, messages):
            seen.extend((m.metadata.message_type, m.metadata.group_id, set(m.content.keys())) for m in messages)
            return super().push_messages(messages)

    run_on(Capturing(3), [*LOOPBACK, "algorithm.name=shared_before_setup_demo", "algorithm.pseudo_source=per_client"],
           tmp_path / "r")
    assert [keys for kind, _, keys in seen if kind == P.SETUP] == [{P.HEADER, P.SHARED}] * 3
    assert all(P.SHARED not in keys for kind, _, keys in seen if kind == P.TRAIN)


def test_two_nodes_holding_one_partition_are_named_and_the_newer_is_used(tmp_path, caplog):
    grid = InOrderGrid(4)
    grid.contexts[grid.ids[3]].node_config["partition-id"] = 2  # nodes 1002 and 1003 both hold client 2
    for node in grid.ids:
        grid.contexts[node].node_config["num-partitions"] = 3
    exp = Experiment(config.load(None, [*LOOPBACK, "algorithm.name=fedavg", "runtime.executor=flower"]))
    fed = exp.federation = S.FlowerFederation(exp, grid, poll_s=0.01, state_root=str(tmp_path / "n"))
    exp.run(tmp_path / "r")
    assert fed.nodes == {0: grid.ids[0], 1: grid.ids[1], 2: grid.ids[3]}
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("flower: node")]
    assert warned == [f"flower: nodes {grid.ids[2]} and {grid.ids[3]} both hold partition-id 2; using {grid.ids[3]}, "
                      "the newer"]


def test_a_restarted_node_gets_the_shared_tensors_again(tmp_path, caplog):
    """Client 1's node restarts (a new node id, nothing kept) after round 1 of FedMix, whose averaged data are
    shared once per node: the next round's message to the new node carries them again, and it trains (its first
    round used to fail: the round's messages were built before the restart was seen)."""
    from flwr.app import Context

    class Restarting(LoopbackGrid):
        rounds_pushed = 0

        def push_messages(self, messages):
            if messages[0].metadata.message_type == P.TRAIN:
                self.rounds_pushed += 1
            return super().push_messages(messages)

        def get_node_ids(self):
            if self.rounds_pushed == 1 and self.ids[1] != 2001:
                self.ids[1] = 2001
                self.contexts[2001] = Context(run_id=1, node_id=2001, node_config={"partition-id": 1,
                                              "num-partitions": 3}, state=RecordDict(), run_config={})
            return super().get_node_ids()

    run_on(Restarting(3), [*LOOPBACK, "algorithm.name=fedmix", "train.rounds=3", "runtime.flower_min_replies=2"],
           tmp_path / "r")
    assert failures(tmp_path / "r") == [[], [], []]
    assert not [r for r in caplog.records if "both hold" in r.getMessage()]  # a restart: no two nodes at once
