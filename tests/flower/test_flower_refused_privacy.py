"""Audit privacy3: a noisy upload the Flower server received and then refused, or received and never got to use,
still counts in the privacy budget.

Each case runs on :class:`~tests.flower.test_flower_logic.LoopbackGrid` (the ClientApp in this process, no
waiting) with operating-system noise, so every attempt of a round is a fresh release. The spent epsilon is
computed by hand: each client's data went into some number of noisy uploads that reached the server, each a
Gaussian mechanism of the multiplier the run calibrated (``noise_multiplier(4, 1e-5, planned releases)``;
local noise: every upload carries the whole noise), composed with ``hetfl.privacy.epsilon_spent``; the
epsilon a run may report is at least the largest client's."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason='Flower is not installed: pip install "hetfl[flower]"')

import torch
from flwr.app import Array, ConfigRecord, Message, MetricRecord

from hetfl.flower.codec import encode_tensor
from hetfl.flower.server import FlowerRoundError
from hetfl.privacy import epsilon_spent, noise_multiplier
from tests.flower.test_flower_logic import SMALL, LoopbackGrid, run_on
from tests.helpers import needs_accountant

FEDPAC = ["algorithm.name=fedpac", "algorithm.dp_epsilon=4", "algorithm.dp_noise=local",
          "algorithm.dp_noise_source=os"]
CCVR = ["algorithm.name=fedavg+ccvr", "algorithm.ccvr.dp_epsilon=4", "algorithm.ccvr.every_round=true",
        "algorithm.ccvr.dp_noise=local", "algorithm.ccvr.epochs=1", "algorithm.ccvr.dp_noise_source=os"]


def _other_data(content) -> None:
    content["data"] = ConfigRecord({"digest": "0" * 32})  # a node whose data-root holds other files


def _inflated_samples(content) -> None:
    result = content["result"]
    result["num-samples"] = 10**9


def _oversized(content) -> None:
    content["upload"]["padding"] = encode_tensor(torch.zeros(40 * 2**20 // 4))


def _undecodable(content) -> None:
    record = content["upload"] if "upload" in content else content["reply"]
    name = next(iter(record.keys()))
    record[name] = Array(dtype="float32", shape=(2,), stype="pickle", data=b"\x80\x04not an array")


def _no_numbers(content) -> None:
    content["result"] = MetricRecord({"steps": 1})


def _no_upload(content) -> None:
    del content["upload"]


class RefusingGrid(LoopbackGrid):
    """The first time a ``kind`` message of round ``at`` is sent: node ``who``'s reply is changed by ``change`` (so
    that the server refuses it; ``change`` None: left as it is) and every other node answers with an error."""

    def __init__(self, num_nodes: int, who: int, at: int, kind: str, change: Callable | None,
                 answering: tuple[int, ...] = ()) -> None:
        super().__init__(num_nodes)
        self.node, self.at, self.kind, self.change = self.ids[who], str(at), kind, change
        self.answering = {self.ids[k] for k in answering}  # nodes that answer as usual all the same
        self.sent: set[int] = set()

    def push_messages(self, messages: list[Message]) -> list[str]:
        ids = []
        hits = {m.metadata.dst_node_id for m in messages
                if m.metadata.message_type == self.kind and m.metadata.group_id == self.at}
        fire = bool(hits) and not self.sent
        for message in messages:
            node = message.metadata.dst_node_id
            if fire and node in hits and node != self.node and node not in self.answering:
                self.broken.add(node)
            ids += super().push_messages([message])
            self.broken.discard(node)
            if fire and node == self.node and self.change is not None:
                self.change(self.replies[ids[-1]].content)
        if fire:
            self.sent = hits
        return ids


def ledger_rounds(run: Path) -> list[int]:
    return [e["round"] for e in json.loads((run / "privacy_ledger.json").read_text())["releases"]]


def stopped_then_resumed(grid: LoopbackGrid, overrides: list[str], run: Path, answered: int = 0) -> dict:
    """The run stops in the phase ``grid`` breaks (too few clients answered); resumed; its summary's privacy."""
    with pytest.raises(FlowerRoundError, match=rf"round 2, .*{answered} of 3 clients answered"):
        run_on(grid, overrides, run)
    run_on(grid, overrides, run, resume=True)
    return json.loads((run / "summary.json").read_text())["privacy"]


TRAINING_REFUSALS = {"other data": _other_data, "num-samples": _inflated_samples, "oversized": _oversized,
                     "undecodable": _undecodable, "no numbers": _no_numbers}


@needs_accountant
@pytest.mark.parametrize("case", list(TRAINING_REFUSALS))
def test_a_refused_fedpac_upload_of_a_round_stopped_with_nothing_usable_counts_after_the_resume(tmp_path, case):
    """FedPAC, local OS noise, 2 rounds (z = noise_multiplier(4, 1e-5, 2) per upload), a checkpoint every round,
    all 3 clients must answer. In round 2 nodes 0 and 1 answer with an error and node 2's reply, which carries its
    noisy centroid statistics, is refused (``case``): nothing usable, the run stops. Resumed, round 2 runs again
    and client 2 uploads a third time. Client 2's data went into 3 uploads at z: epsilon_spent([z] * 3) = 5.06
    spent. Before the fix the refused upload was never recorded: 2 releases, epsilon 4.0 reported."""
    run = tmp_path / "run"
    grid = RefusingGrid(3, 2, 2, "train", TRAINING_REFUSALS[case])
    privacy = stopped_then_resumed(grid, [*SMALL, *FEDPAC, "runtime.checkpoint_every=1",
                                          "runtime.flower_min_replies=0"], run)
    z = noise_multiplier(4.0, 1e-5, 2)
    spent = epsilon_spent([z] * 3, 1e-5)
    assert spent > 5.0
    assert ledger_rounds(run) == [1, 2, 2]
    assert privacy["releases"] == 3
    assert privacy["epsilon"] >= spent * (1 - 1e-9)
    assert privacy["epsilon"] == pytest.approx(spent, rel=1e-9)


@needs_accountant
def test_a_reply_without_an_upload_releases_nothing(tmp_path):
    """The same stop, but node 2's reply holds no upload record at all: no noisy statistics reached the server,
    and nothing is counted for it (2 releases, the target 4.0)."""
    run = tmp_path / "run"
    grid = RefusingGrid(3, 2, 2, "train", _no_upload)
    privacy = stopped_then_resumed(grid, [*SMALL, *FEDPAC, "runtime.checkpoint_every=1",
                                          "runtime.flower_min_replies=0"], run)
    assert ledger_rounds(run) == [1, 2]
    assert privacy["epsilon"] == pytest.approx(epsilon_spent([noise_multiplier(4.0, 1e-5, 2)] * 2, 1e-5), rel=1e-9)


@needs_accountant
def test_a_refused_upload_beside_a_usable_one_in_a_stopped_round_is_not_counted_twice(tmp_path):
    """Round 2: node 0 answers, node 1 errs, node 2's reply is refused (num-samples); 3 needed, the run stops with
    one usable upload, whose release (round 2) also counts client 2's refused upload (one upload of every client
    per release). Resumed: clients 0 and 2 uploaded 3 times: 3 releases, epsilon_spent([z] * 3) = 5.06, not a
    fourth release for the refused upload (5.99)."""
    run = tmp_path / "run"
    grid = RefusingGrid(3, 2, 2, "train", _inflated_samples, answering=(0,))
    privacy = stopped_then_resumed(grid, [*SMALL, *FEDPAC, "runtime.checkpoint_every=1",
                                          "runtime.flower_min_replies=0"], run, answered=1)
    assert ledger_rounds(run) == [1, 2, 2]
    assert privacy["epsilon"] == pytest.approx(epsilon_spent([noise_multiplier(4.0, 1e-5, 2)] * 3, 1e-5), rel=1e-9)


@needs_accountant
def test_a_seeded_round_stopped_with_some_replies_and_run_again_is_no_noiseless_difference(tmp_path):
    """The privacy fuzz's configuration 61 (session 36), reduced: FedPAC with seeded noise; in round 2 nodes 0 and 1
    answer, node 2's reply is refused (other data); 3 needed, the run stops with two usable uploads, recorded as
    round 2's release. Resumed, round 2 runs again with all three: a second release of round 2 with other content
    (a client more) under the same seeded noise, but each client's upload in it is the one it sent before, so
    nothing new reached the server. Reported: finite, every attempt counted for every client asked (3 releases:
    epsilon_spent([z] * 3), over the 2 each client's distinct uploads spent); before, inf."""
    run = tmp_path / "run"
    seeded = [x for x in FEDPAC if not x.startswith("algorithm.dp_noise_source=")] + ["algorithm.dp_noise_source=seed"]
    grid = RefusingGrid(3, 2, 2, "train", _other_data, answering=(0, 1))
    privacy = stopped_then_resumed(grid, [*SMALL, *seeded, "runtime.checkpoint_every=1",
                                          "runtime.flower_min_replies=0"], run, answered=2)
    ledger = json.loads((run / "privacy_ledger.json").read_text())["releases"]
    assert [e["round"] for e in ledger] == [1, 2, 2] and sorted(ledger[1]["uploads"]) == ["0", "1"]
    assert all(ledger[2]["uploads"][c] == d for c, d in ledger[1]["uploads"].items())  # the same uploads
    assert "noise_reused_rounds" not in privacy
    assert privacy["epsilon"] == pytest.approx(epsilon_spent([noise_multiplier(4.0, 1e-5, 2)] * 3, 1e-5), rel=1e-9)


@needs_accountant
@pytest.mark.parametrize("case", ["other data", "undecodable"])
def test_a_refused_ccvr_reply_of_a_round_stopped_with_nothing_usable_counts_after_the_resume(tmp_path, case):
    """CCVR's statistics every round (2 planned releases), local OS noise; in round 2's statistics phase nodes 0
    and 1 answer with an error and node 2's noisy statistics are refused (``case``): the run stops; resumed, the
    phase runs again. Client 2's data went into 3 noisy uploads: epsilon_spent([z] * 3) = 5.06 (4.0 reported
    before the fix)."""
    run = tmp_path / "run"
    grid = RefusingGrid(3, 2, 2, "query.posthoc", {"other data": _other_data, "undecodable": _undecodable}[case])
    privacy = stopped_then_resumed(grid, [*SMALL, *CCVR, "train.local_steps=2", "runtime.checkpoint_every=1",
                                          "runtime.flower_min_replies=0"], run)
    spent = epsilon_spent([noise_multiplier(4.0, 1e-5, 2)] * 3, 1e-5)
    assert ledger_rounds(run) == [1, 2, 2]
    assert privacy["releases"] == 3
    assert privacy["epsilon"] == pytest.approx(spent, rel=1e-9)


# ------------------------------------------------------------- replies in when the Flower run is stopped mid-phase
class StoppingGrid(LoopbackGrid):
    """The first time a ``kind`` message of round ``at`` is sent, node ``who`` does not answer and the Flower run is
    stopped (``stop`` set: the simulation ended under the server, Ctrl-C) while the server waits for it; the other
    nodes' replies are in."""

    def __init__(self, num_nodes: int, who: int, at: int, kind: str) -> None:
        super().__init__(num_nodes)
        self.node, self.at, self.kind = self.ids[who], str(at), kind
        self.stop = threading.Event()
        self.fired = False

    def push_messages(self, messages: list[Message]) -> list[str]:
        fire = not self.fired and any(m.metadata.message_type == self.kind and m.metadata.group_id == self.at
                                      for m in messages)
        if fire:
            self.fired = True
            self.dead.add(self.node)
            self.stop.set()
        try:
            return super().push_messages(messages)
        finally:
            self.dead.discard(self.node)


@needs_accountant
@pytest.mark.parametrize("method", ["fedpac", "ccvr"])
def test_uploads_in_when_the_flower_run_is_stopped_mid_phase_count_after_the_resume(tmp_path, method):
    """Local OS noise, 2 planned releases, a checkpoint every round. In round 2's private phase clients 0 and 1
    answer (their noisy uploads reach the server) and the run is stopped while the server waits for client 2
    (FlowerStopped). Resumed, round 2 runs again: clients 0 and 1 uploaded 3 times, epsilon_spent([z] * 3) = 5.06
    spent. Before the fix the replies in hand when the stop came were dropped unrecorded: 4.0 reported."""
    from hetfl import config
    from hetfl.engine.experiment import Experiment
    from hetfl.flower.protocol import NODES_DIR
    from hetfl.flower.server import FlowerFederation, FlowerStopped

    private = FEDPAC if method == "fedpac" else [*CCVR, "train.local_steps=2"]
    overrides = [*SMALL, *private, "runtime.checkpoint_every=1", "runtime.flower_min_replies=0"]
    grid, run = StoppingGrid(3, 2, 2, "train" if method == "fedpac" else "query.posthoc"), tmp_path / "run"
    exp = Experiment(config.load(None, [*overrides, "runtime.executor=flower"]))
    exp.federation = FlowerFederation(exp, grid, poll_s=0.01, state_root=str(run / NODES_DIR), stop=grid.stop)
    with pytest.raises(FlowerStopped):
        exp.run(run)
    assert ledger_rounds(run) == [1, 2]  # round 2: the two uploads in hand when the stop came
    run_on(grid, overrides, run, resume=True)
    assert ledger_rounds(run) == [1, 2, 2]
    privacy = json.loads((run / "summary.json").read_text())["privacy"]
    assert privacy["releases"] == 3
    assert privacy["epsilon"] == pytest.approx(epsilon_spent([noise_multiplier(4.0, 1e-5, 2)] * 3, 1e-5), rel=1e-9)


# ------------------------------------------------------------- an accepted reply the ledger cannot read
def _no_counts(content) -> None:
    del content["upload"]["fedpac.counts"]  # the model's tensors and the feature sums are there


@needs_accountant
def test_a_fedpac_reply_without_its_noisy_counts_is_refused_not_a_crash_before_the_ledger(tmp_path):
    """FedPAC, local OS noise, 2 of 3 must answer. Node 2's round-2 training reply lacks the noisy class counts.
    The server accepted it (only the model's tensors were checked) and the ledger's digest of the round's release
    then raised KeyError: the run crashed with clients 0 and 1's noisy uploads received and unrecorded (resumed, 2
    releases and 4.0 reported where they made 3: 5.06). The reply is refused like any malformed one; the round
    goes on and its release is recorded."""
    grid = LoopbackGrid(3)
    grid.tamper[grid.ids[2]] = _no_counts
    run = tmp_path / "run"
    privacy = run_on(grid, [*SMALL, *FEDPAC, "train.rounds=1", "runtime.flower_min_replies=2"], run)["privacy"]
    assert ledger_rounds(run) == [1]
    assert privacy["summed_clients"] == 2 and privacy["epsilon"] == pytest.approx(4.0, rel=1e-9)
    assert [json.loads(x)["failed_clients"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [[2]]
