"""hetfl's Flower server and nodes without Ray or processes: a Grid that hands each message to the
ClientApp in this process. Fast checks of what the simulation and deployment tests cannot afford
to cover method by method: personalised evaluation on the nodes, failures and quorum."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("flwr", reason='Flower is not installed: pip install "hetfl[flower]"')

import torch
from flwr.app import Array, Context, Error, Message, MetricRecord, RecordDict

from hetfl import config
from hetfl.algorithms import available
from hetfl.engine.experiment import Experiment
from hetfl.flower.client_app import app as client_app
from hetfl.flower.codec import encode_tensor
from hetfl.flower.protocol import NODES_DIR, TRUSTED_ROOTS_ENV
from hetfl.flower.server import FlowerFederation, FlowerRoundError
from tests.helpers import needs_accountant

SMALL = ["data.num_clients=3", "data.partition=dirichlet", "train.rounds=2", "train.batch_size=16",
         "train.local_steps=10", "model.options={hidden = [16]}", "runtime.progress=false", "runtime.threads=1"]
DROP = {"round_time_s", "eval_time_s", "failed_clients", "flower_bytes_down", "flower_bytes_up"}


@pytest.fixture(autouse=True)
def trusted_state_roots(tmp_path, monkeypatch):
    """The in-process nodes keep client state where the server says, under ``tmp_path``, as the simulation's
    nodes do under the run folders (their environment trusts them: hetfl.flower.node.state_root)."""
    monkeypatch.setenv(TRUSTED_ROOTS_ENV, str(tmp_path))


class LoopbackGrid:
    """A Flower Grid whose nodes are ClientApp calls in this process; after the greeting, ``dead``
    nodes never answer and ``broken`` ones answer with an error."""

    def __init__(self, num_nodes: int) -> None:
        from flwr.supercore.task_identity import TaskIdentity

        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # what a ServerApp runner sets
        self.ids = [1000 + i for i in range(num_nodes)]
        self.contexts = {n: Context(run_id=1, node_id=n, node_config={"partition-id": i, "num-partitions": num_nodes},
                                    state=RecordDict(), run_config={}) for i, n in enumerate(self.ids)}
        self.replies: dict[str, Message] = {}
        self.dead: set[int] = set()
        self.broken: set[int] = set()
        self.slow: set[int] = set()  # their replies wait in ``held`` until ``release``
        self.held: dict[str, Message] = {}
        self.tamper: dict[int, Any] = {}  # node -> function changing its training replies in place

    def get_node_ids(self) -> list[int]:
        return list(self.ids)

    def push_messages(self, messages: list[Message]) -> list[str]:
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            ids.append(message.metadata.message_id)
            node = message.metadata.dst_node_id
            hello = message.metadata.message_type == "query.hello"
            if node in self.dead and not hello:
                continue
            if node in self.broken and not hello:
                self.replies[message.metadata.message_id] = Message(Error(code=0, reason="disk full"), reply_to=message)
                continue
            answers = self.held if node in self.slow else self.replies
            try:
                answer = client_app(message, self.contexts[node])
            except Exception as err:  # what Flower's runtime does with a ClientApp's exception: an error reply
                answer = Message(Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=message)
            if node in self.tamper and message.metadata.message_type == "train" and not answer.has_error():
                self.tamper[node](answer.content)
            answers[message.metadata.message_id] = answer
        return ids

    def release(self) -> None:
        self.replies.update(self.held)
        self.held.clear()
        self.slow.clear()

    def pull_messages(self, message_ids: list[str]) -> list[Message]:
        return [self.replies.pop(i) for i in message_ids if i in self.replies]


def run_on(grid: LoopbackGrid, overrides: list[str], run_dir: Path, resume: bool = False) -> dict:
    exp = Experiment(config.load(None, [*overrides, "runtime.executor=flower"]))
    exp.federation = FlowerFederation(exp, grid, poll_s=0.01, state_root=str(run_dir / NODES_DIR))
    return exp.run(run_dir, resume=resume)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_nodes_give_the_sequential_numbers(overrides: list[str], tmp_path: Path) -> None:
    """The run on 3 loopback nodes gives the sequential executor's metrics (times aside), every client answering."""
    Experiment(config.load(None, overrides)).run(tmp_path / "sequential")
    run_on(LoopbackGrid(3), overrides, tmp_path / "flower")
    got = metrics(tmp_path / "flower")
    assert [{k: v for k, v in x.items() if k not in DROP} for x in got] == \
        [{k: v for k, v in x.items() if k not in DROP} for x in metrics(tmp_path / "sequential")]
    assert all(x["failed_clients"] == [] for x in got)


#: per method, what keeps its loopback run short (the numbers are compared, not the settings' defaults)
SHORT = {"fedbabu": ["algorithm.finetune_epochs=1"], "pfedme": ["algorithm.inner_steps=1"],
         "fedetf": ["algorithm.pers_cycles=1"], "fedrep": ["algorithm.head_epochs=1"]}


@pytest.mark.parametrize("method", sorted(available()))
def test_every_method_on_the_nodes_gives_the_sequential_numbers(method, tmp_path):
    """Every registered method, run through hetfl's Flower server and ClientApp (three loopback nodes), gives the
    sequential executor's metrics, personalised evaluation included: what a method keeps on the server (SCAFFOLD's
    and FedDyn's state, GroupDRO's weights, pFedHN's hypernetwork), on the nodes (pFedMe's, Ditto's and APFL's
    personal models, FedRep's, FedPer's and FedRoD's heads), in the payload (FedFomo's other clients' models), on
    the node's data (kNN-Per's predictor, FedBABU's fine-tuning) or sent once (FedBR's pseudo-data, FedMix's
    means, VHL's generated set) reaches the nodes as it reaches the sequential clients. A method added to the
    registry is checked here without a line more."""
    assert_nodes_give_the_sequential_numbers([*SMALL, f"algorithm.name={method}", *SHORT.get(method, [])], tmp_path)


@pytest.mark.parametrize("first_head", ["initial", "server"])
def test_fedpac_clients_not_yet_sampled_get_the_sequential_numbers_on_the_nodes(first_head, tmp_path):
    """One of 3 clients a round: the clients that have not trained are evaluated (and later start) with the
    classifier ``first_head`` names, the server's initial state sent as their node's first state, as the
    sequential executor does."""
    overrides = [*SMALL, "algorithm.name=fedpac", "train.clients_per_round=1", "train.rounds=3",
                 f"algorithm.first_head={first_head}"]
    assert_nodes_give_the_sequential_numbers(overrides, tmp_path)


def test_vhls_virtual_set_on_the_nodes_is_the_sequential_one_generated_once(tmp_path, monkeypatch):
    """VHL's shared virtual set, generated from the run seed on every node (nothing sent): the nodes give the
    sequential numbers, and with data.cache_dir shared the set is generated once for the whole federation (a
    deployment's per-message processes read what the first one stored)."""
    from hetfl.algorithms import vhl

    calls = []
    real = vhl.generate_virtual
    monkeypatch.setattr(vhl, "generate_virtual", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    overrides = [*SMALL, "algorithm.name=vhl", "algorithm.num_virtual=60", f"data.cache_dir={tmp_path / 'cache'}"]
    assert_nodes_give_the_sequential_numbers(overrides, tmp_path)
    assert calls.count((60,)) == 1, calls  # the synthetic data's 60 features: the set; the rest are the probes


def test_a_silent_or_failing_client_is_left_out_and_recorded(tmp_path, caplog):
    grid = LoopbackGrid(3)
    grid.dead.add(grid.ids[2])
    grid.broken.add(grid.ids[0])
    # the loopback's replies are in when their messages are pushed: the timeout is only the dead node's wait
    run_on(grid, [*SMALL, "algorithm.name=fedpac", "runtime.flower_timeout_s=0.1"], tmp_path / "r")
    got = metrics(tmp_path / "r")
    assert [x["failed_clients"] for x in got] == [[0, 2], [0, 2]]
    assert all(x["clients"] == 3 and x["clients_evaluated"] == 1 for x in got)  # only client 1 trained, evaluated
    rows = [json.loads(raw) for raw in (tmp_path / "r" / "client_metrics.jsonl").read_text().splitlines()]
    assert [[acc is not None for acc in row["client_acc"]] for row in rows] == [[False, True, False]] * 2
    assert "disk full" in caplog.text and "no reply within 0.1 s" in caplog.text


def test_too_few_replies_stop_the_run_with_the_reasons(tmp_path):
    grid = LoopbackGrid(3)
    grid.broken.add(grid.ids[1])
    with pytest.raises(FlowerRoundError, match=r"round 1, training: 2 of 3 clients answered.*disk full"):
        run_on(grid, [*SMALL, "algorithm.name=fedavg", "runtime.flower_min_replies=0"], tmp_path / "r")
    assert not (tmp_path / "r" / "summary.json").exists()


def test_a_node_that_answers_the_greeting_late_joins_at_the_next_phase(tmp_path):
    grid = LoopbackGrid(3)
    grid.slow.add(grid.ids[2])
    exp = Experiment(config.load(None, [*SMALL, "runtime.executor=flower", "runtime.flower_timeout_s=0.3"]))
    federation = FlowerFederation(exp, grid, poll_s=0.01)
    federation.start(tmp_path, 0, {})
    assert federation.nodes == {0: grid.ids[0], 1: grid.ids[1]}
    grid.release()
    federation.refresh()  # what every phase does first: no new greeting, the late answer is read
    assert federation.nodes == {0: grid.ids[0], 1: grid.ids[1], 2: grid.ids[2]}


def crash_scaffold_in_round(crash_round: int, monkeypatch) -> Any:
    """SCAFFOLD's server raises ``RuntimeError("simulated crash")`` when it aggregates round ``crash_round``;
    returns the real ``aggregate``, to put back for the resume."""
    from hetfl.algorithms.scaffold import Scaffold

    aggregate = Scaffold.aggregate

    def crash(self, server, uploads, round):
        if round == crash_round:
            raise RuntimeError("simulated crash")
        return aggregate(self, server, uploads, round)

    monkeypatch.setattr(Scaffold, "aggregate", crash)
    return aggregate


def test_a_crashed_run_resumes_with_the_node_states_of_its_checkpoint(tmp_path, monkeypatch):
    """SCAFFOLD crashes after its nodes trained round 3 (their round-3 control variates written, the
    checkpoint still at round 2); resumed as a new Flower run (fresh node contexts: only the nodes'
    state folders remain), the nodes go back to their round-2 states: the uninterrupted numbers."""
    from hetfl.algorithms.scaffold import Scaffold

    overrides = [*SMALL, "train.rounds=4", "algorithm.name=scaffold"]
    Experiment(config.load(None, overrides)).run(tmp_path / "reference")
    aggregate = crash_scaffold_in_round(3, monkeypatch)
    run = tmp_path / "flower"
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_on(LoopbackGrid(3), overrides, run)
    assert [x["round"] for x in metrics(run)] == [1, 2]
    stale = list((run / NODES_DIR).rglob("round_00003-*.safetensors"))
    assert len(stale) == 3, "each node kept its round-3 state"
    monkeypatch.setattr(Scaffold, "aggregate", aggregate)
    run_on(LoopbackGrid(3), overrides, run, resume=True)
    assert [{k: v for k, v in x.items() if k not in DROP} for x in metrics(run)] == \
        [{k: v for k, v in x.items() if k not in DROP} for x in metrics(tmp_path / "reference")]
    assert not any(p.exists() for p in stale), "states of the interrupted session are dropped"


# ------------------------------------------------------------- malformed and oversized replies (issue 26, item 13)
def _drop_upload(content) -> None:
    del content["upload"]


def _wrong_shape(content) -> None:
    upload = content["upload"]
    name = next(iter(upload.keys()))
    upload[name] = encode_tensor(torch.zeros(3, 3, 3))


def _undecodable(content) -> None:
    upload = content["upload"]
    name = next(iter(upload.keys()))
    upload[name] = Array(dtype="float32", shape=(2,), stype="pickle", data=b"\x80\x04not an array")


def _oversized(content) -> None:
    content["upload"]["padding"] = encode_tensor(torch.zeros(40 * 2**20 // 4))  # 40 MiB the server did not ask for


def _inflated_samples(content) -> None:
    result = content["result"]
    result["num-samples"] = 10**9  # to outweigh every other client in the mean


def _not_numbers(content) -> None:
    content["result"] = MetricRecord({"steps": 1})


TAMPERS = {"no upload": (_drop_upload, "malformed"), "wrong shape": (_wrong_shape, "shape"),
           "undecodable": (_undecodable, "malformed"), "oversized": (_oversized, "oversized"),
           "inflated sample count": (_inflated_samples, "num-samples"), "no numbers": (_not_numbers, "malformed")}


@pytest.mark.parametrize("case", list(TAMPERS))
def test_a_malformed_or_oversized_reply_is_dropped_with_its_reason_and_the_round_goes_on(tmp_path, caplog, case):
    tamper, reason = TAMPERS[case]
    grid = LoopbackGrid(3)
    grid.tamper[grid.ids[1]] = tamper
    run_on(grid, [*SMALL, "algorithm.name=fedavg", "runtime.flower_min_replies=2"], tmp_path / "r")
    got = metrics(tmp_path / "r")
    assert [x["failed_clients"] for x in got] == [[1], [1]]
    assert (tmp_path / "r" / "summary.json").is_file()
    said = [r.getMessage() for r in caplog.records if "client 1 failed" in r.getMessage()]
    assert len(said) == 2 and all(reason in line for line in said), said  # once a round


def test_malformed_replies_below_the_quorum_stop_the_run_with_the_reason(tmp_path):
    grid = LoopbackGrid(3)
    grid.tamper[grid.ids[2]] = _drop_upload
    with pytest.raises(FlowerRoundError, match=r"round 1, training: 2 of 3 clients answered.*client 2: .*malformed"):
        run_on(grid, [*SMALL, "algorithm.name=fedavg", "runtime.flower_min_replies=0"], tmp_path / "r")
    assert not (tmp_path / "r" / "summary.json").exists()


def killed_then_resumed(grid: LoopbackGrid, overrides: list[str], run: Path, kill_round: int, monkeypatch) -> None:
    """A run on ``grid`` whose server is killed at the start of round ``kill_round``, then resumed to its end."""
    original = Experiment.round

    def killed(self, server, clients, round_, reporter):  # type: ignore[no-untyped-def]
        if round_ == kill_round:
            raise KeyboardInterrupt
        return original(self, server, clients, round_, reporter)

    monkeypatch.setattr(Experiment, "round", killed)
    with pytest.raises(KeyboardInterrupt):
        run_on(grid, overrides, run)
    monkeypatch.setattr(Experiment, "round", original)
    run_on(grid, overrides, run, resume=True)


def answers_per_round(context: Context, method: str) -> dict[str, int]:
    """How many private answers a node gave ``method`` in each round (its floor's count, in its context)."""
    kept = next(v for k, v in context.state.items() if k.endswith("private-answers"))
    return {r: len(d) for r, d in json.loads(str(kept["json"]))[method].items()}


@needs_accountant
def test_a_node_keeps_its_privacy_floor_when_the_server_resumes(tmp_path, monkeypatch):
    """CCVR calibrates every round with fresh noise (4 releases planned), a checkpoint every 2 rounds; the
    server is killed at the start of round 4 (round 3 answered, not checkpointed) and resumed, so it asks
    round 3 again. The node with a privacy floor answers it (its fourth release, the last its noise is
    calibrated for) and refuses round 4; the server goes on without it there. Nodes without a floor answer all
    five times (their operators set no bound; the server's ledger counts every release it received)."""
    overrides = [*SMALL, "algorithm.name=fedavg+ccvr", "algorithm.ccvr.dp_epsilon=4", "algorithm.ccvr.every_round=true",
                 "algorithm.ccvr.epochs=1", "algorithm.ccvr.dp_noise_source=os", "train.rounds=4",
                 "train.local_steps=2", "runtime.checkpoint_every=2", "runtime.flower_min_replies=2"]
    grid = LoopbackGrid(3)
    floored = grid.contexts[grid.ids[0]]
    floored.node_config["dp-epsilon"] = 8.0  # the server's 4 is stricter: its calibration, and the count
    run = tmp_path / "run"
    killed_then_resumed(grid, overrides, run, 4, monkeypatch)
    got = metrics(run)
    assert [x["round"] for x in got] == [1, 2, 3, 4]
    assert got[2]["failed_clients"] == [] and got[3]["failed_clients"] == [0], got
    assert answers_per_round(floored, "ccvr") == {"1": 1, "2": 1, "3": 2}
    assert not any(k.endswith("private-answers") for k in grid.contexts[grid.ids[1]].state)


@needs_accountant
def test_a_fedpac_node_keeps_its_privacy_floor_when_the_server_resumes(tmp_path, monkeypatch):
    """FedPAC's uploads carry their noise (counts and feature sums, one release a round: 2 planned); the
    server is killed at the start of round 2 before any checkpoint and resumed from the start, so it asks
    round 1 again. The node with a floor answers it with fresh noise (its second release) and refuses round 2."""
    overrides = [*SMALL, "algorithm.name=fedpac", "algorithm.dp_epsilon=4", "algorithm.dp_noise=local",
                 "algorithm.dp_noise_source=os", "runtime.checkpoint_every=2", "runtime.flower_min_replies=2"]
    grid = LoopbackGrid(3)
    floored = grid.contexts[grid.ids[1]]
    floored.node_config["dp-epsilon"] = 4.0
    run = tmp_path / "run"
    killed_then_resumed(grid, overrides, run, 2, monkeypatch)
    got = metrics(run)
    assert [x["failed_clients"] for x in got] == [[], [1]], got
    assert answers_per_round(floored, "fedpac") == {"1": 2}


@needs_accountant
@pytest.mark.parametrize("method", ["fedpac", "ccvr"])
def test_uploads_received_in_a_round_stopped_by_the_quorum_count_after_the_resume(method, tmp_path, monkeypatch):
    """Audit of session 27 (failed before its fix): with OS noise, round 2 stopped by the quorum (a node answered
    with an error) after the server had received and decoded the two other clients' noisy uploads; the stop
    recorded nothing in the privacy ledger, and the resumed round 2 released fresh noise. The summary counted 2
    releases where those clients made 3 (FedPAC: epsilon 4.0 reported, 5.06 spent). The uploads a stopped round
    received are recorded before the run stops, so the resumed run counts them."""
    from hetfl.privacy import epsilon_spent, noise_multiplier

    private = (["algorithm.name=fedpac", "algorithm.dp_epsilon=4", "algorithm.dp_noise=local",
                "algorithm.dp_noise_source=os"] if method == "fedpac" else
               ["algorithm.name=fedavg+ccvr", "algorithm.ccvr.dp_epsilon=4", "algorithm.ccvr.every_round=true",
                "algorithm.ccvr.dp_noise=local", "algorithm.ccvr.epochs=1", "algorithm.ccvr.dp_noise_source=os"])
    overrides = [*SMALL, *private, "runtime.checkpoint_every=1", "runtime.flower_min_replies=0"]
    grid, run = LoopbackGrid(3), tmp_path / "run"
    original = FlowerFederation.exchange

    def exchange(self, kind, contents, round_):  # the third node fails its round-2 private phase
        phase = "train" if method == "fedpac" else "posthoc"
        if round_ == 2 and kind.endswith(phase):
            grid.broken.add(grid.ids[2])
        try:
            return original(self, kind, contents, round_)
        finally:
            grid.broken.clear()

    monkeypatch.setattr(FlowerFederation, "exchange", exchange)
    with pytest.raises(FlowerRoundError, match=r"round 2, .*2 of 3 clients answered"):
        run_on(grid, overrides, run)
    monkeypatch.setattr(FlowerFederation, "exchange", original)
    ledger = json.loads((run / "privacy_ledger.json").read_text())["releases"]
    assert [e["round"] for e in ledger] == [1, 2]  # round 2: the two uploads the server received before stopping
    run_on(grid, overrides, run, resume=True)
    ledger = json.loads((run / "privacy_ledger.json").read_text())["releases"]
    assert [e["round"] for e in ledger] == [1, 2, 2]
    privacy = json.loads((run / "summary.json").read_text())["privacy"]
    assert privacy["releases"] == 3
    assert privacy["epsilon"] == pytest.approx(epsilon_spent([noise_multiplier(4.0, 1e-5, 2)] * 3, 1e-5), rel=1e-9)


# ------------------------------------------------------------- a node with other data than the server's
def _write_mnist(root: Path, images: np.ndarray, labels: np.ndarray) -> Path:
    """MNIST's four IDX files (gzip) in ``root``: ``images``/``labels`` for training, their first 30 for testing."""
    import gzip

    root.mkdir(parents=True, exist_ok=True)

    def idx(array: np.ndarray) -> bytes:
        header = bytes([0, 0, 8, array.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in array.shape)
        return gzip.compress(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())

    for prefix, x, y in (("train", images, labels), ("t10k", images[:30], labels[:30])):
        (root / f"{prefix}-images-idx3-ubyte.gz").write_bytes(idx(x))
        (root / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(idx(y))
    return root


def test_a_node_whose_data_root_holds_other_data_is_refused_naming_the_cause(tmp_path, caplog):
    """An IID split (or any split whose client sizes do not depend on the data) gives every client the
    same sample count whatever the files hold: a node whose ``data-root`` holds other images (another
    dataset in MNIST's format, a corrupted copy) used to train on them unnoticed, its upload averaged in."""
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (90, 28, 28), dtype=np.uint8), (np.arange(90) % 10).astype(np.uint8)
    server_root = _write_mnist(tmp_path / "server", images, labels)
    other = _write_mnist(tmp_path / "node1", 255 - images, labels)  # same shapes and labels, other pixels
    grid = LoopbackGrid(3)
    grid.contexts[grid.ids[1]].node_config["data-root"] = str(other)
    grid.contexts[grid.ids[2]].node_config["data-root"] = str(_write_mnist(tmp_path / "node2", images, labels))
    overrides = ["data.dataset=mnist", f"data.root={server_root}", "data.partition=iid", "data.num_clients=3",
                 "train.rounds=2", "train.batch_size=10", "model.name=mlp", "model.options={hidden = [8]}",
                 "algorithm.name=fedavg", "runtime.progress=false", "runtime.threads=1"]
    run_on(grid, overrides, tmp_path / "r")
    assert [x["failed_clients"] for x in metrics(tmp_path / "r")] == [[1], [1]]  # node 2: a copy, the same data
    said = [r.getMessage() for r in caplog.records if "client 1 failed" in r.getMessage()]
    assert len(said) == 2 and all("other data than the server's" in x and "data-root" in x for x in said), said


def test_too_few_replies_say_what_to_do(tmp_path):
    """The quorum's error says what went wrong (above) and what to do: the checkpoint is kept, resume once the
    nodes can answer."""
    grid = LoopbackGrid(2)
    grid.broken.add(grid.ids[1])
    with pytest.raises(FlowerRoundError, match=r"disk full\).*last checkpoint.*resume"):
        run_on(grid, [*SMALL, "data.num_clients=2", "algorithm.name=fedavg", "runtime.flower_min_replies=0"],
               tmp_path / "r")


def test_hetfl_run_reports_a_stopped_flower_round_in_two_lines_with_the_resume_command(tmp_path, monkeypatch,
                                                                                        capsys):
    """``hetfl run --set runtime.executor=flower`` whose clients do not answer (simulation nodes timing out) used
    to end in a 50-line Python traceback; now the error and the command that continues the run, exit 1."""
    from hetfl import runtimes
    from hetfl.cli import main as hetfl_main

    def stopped(exp, run_dir, **kwargs):
        Path(run_dir).mkdir(parents=True)
        (Path(run_dir) / "config.toml").write_text(config.dumps(exp.cfg))  # what a run writes before round 1
        raise FlowerRoundError("round 1, training: 0 of 2 clients answered; runtime.flower_min_replies = 1 needs 1")

    monkeypatch.setattr(runtimes, "run_experiment", stopped)
    run = tmp_path / "r"
    code = hetfl_main(["run", "--set", "runtime.executor=flower", *(f"--set={s}" for s in SMALL), "--out", str(run)])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("hetfl: error: round 1, training: 0 of 2 clients answered") and "Traceback" not in err, err
    assert f"hetfl run --resume {run}" in err.splitlines()[-1], err


def test_a_node_without_the_dataset_names_its_own_setting(tmp_path, caplog):
    """A node whose ``data-root`` is missing: the reason logged for its client names the node's setting (the
    node config's ``data-root``), not only the server's ``data.root`` it was told to change before (a key of
    the server's config that the node's operator cannot set)."""
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (60, 28, 28), dtype=np.uint8), (np.arange(60) % 10).astype(np.uint8)
    grid = LoopbackGrid(2)
    grid.contexts[grid.ids[1]].node_config["data-root"] = str(tmp_path / "missing")
    overrides = ["data.dataset=mnist", f"data.root={_write_mnist(tmp_path / 'server', images, labels)}",
                 "data.partition=iid", "data.num_clients=2", "train.rounds=1", "train.batch_size=10", "model.name=mlp",
                 "model.options={hidden = [8]}", "algorithm.name=fedavg", "runtime.progress=false", "runtime.threads=1"]
    run_on(grid, overrides, tmp_path / "r")
    assert [x["failed_clients"] for x in metrics(tmp_path / "r")] == [[1]]
    said = next(r.getMessage() for r in caplog.records if "client 1 failed" in r.getMessage())
    assert f"node config data-root = '{tmp_path / 'missing'}'" in said and "does not exist" in said, said


# ------------------------------------------------------------- a straggler's client state
class RoundGrid(LoopbackGrid):
    """Node ``who``'s training in round ``at``: ``mode`` "lost" (it never runs: the node was down) or "late" (it
    runs and keeps its new client state, but its reply comes after runtime.flower_timeout_s: a straggler)."""

    def __init__(self, num_nodes: int, who: int, at: int, mode: str) -> None:
        super().__init__(num_nodes)
        self.node, self.at, self.mode = self.ids[who], str(at), mode

    def push_messages(self, messages: list[Message]) -> list[str]:
        ids = []
        for message in messages:
            hit = (message.metadata.message_type == "train" and message.metadata.group_id == self.at
                   and message.metadata.dst_node_id == self.node)
            if hit:
                (self.dead if self.mode == "lost" else self.slow).add(self.node)
            ids += super().push_messages([message])
            self.dead.discard(self.node)
            self.slow.discard(self.node)
        return ids


# the nodes' state store (context, else files) is the same for every method: both kinds of node for SCAFFOLD only
@pytest.mark.parametrize(("method", "nodes_keep"), [("scaffold", "state-dir"), ("scaffold", "context"),
                                                    ("moon", "state-dir"), ("ditto", "state-dir")])
def test_a_stragglers_unaccepted_round_leaves_no_trace_in_its_client_state(tmp_path, monkeypatch, method, nodes_keep):
    """A client whose round-2 reply comes too late is left out of round 2 by the server, which goes on as if the
    client had not trained (SCAFFOLD's server control variate gets no share of its update): the node must
    not keep the state that round made either. It used to (the node had written it), so the run went on with
    a control variate the server never counted (c != mean c_i), and differed from the run where the same
    client was down in round 2 (from round 3 on). FedPAC: its head, evaluated on the node. Both the state
    folder and Flower's context (a node without a state-dir) are checked. 3 rounds: round 3 is the first to read
    the straggler's state (each method's numbers differ there when the node keeps round 2's state)."""
    if nodes_keep == "context":
        monkeypatch.delenv(TRUSTED_ROOTS_ENV)  # the nodes keep their state in Flower's context only
    overrides = [*SMALL, "train.rounds=3", f"algorithm.name={method}", "runtime.flower_timeout_s=0.3"]
    run_on(RoundGrid(3, 2, 2, "lost"), overrides, tmp_path / "lost")
    run_on(RoundGrid(3, 2, 2, "late"), overrides, tmp_path / "late")
    lost, late = metrics(tmp_path / "lost"), metrics(tmp_path / "late")
    assert [x["failed_clients"] for x in late] == [[], [2], []] == [x["failed_clients"] for x in lost]
    assert [{k: v for k, v in x.items() if k not in DROP} for x in late] == \
        [{k: v for k, v in x.items() if k not in DROP} for x in lost]


def test_a_run_resumed_after_a_straggler_goes_back_to_its_accepted_state(tmp_path, monkeypatch):
    """Client 2 straggles in round 2 (its round-2 state is not the server's); the run crashes in round 3, after
    the nodes trained (checkpoint at round 2), and resumes: client 2's node must still hold its round-1 state,
    the one the checkpoint counts, though a newer one (round 2's) is older than the checkpoint. The numbers
    are those of the uninterrupted run."""
    from hetfl.algorithms.scaffold import Scaffold

    overrides = [*SMALL, "train.rounds=4", "algorithm.name=scaffold", "runtime.flower_timeout_s=0.3"]
    run_on(RoundGrid(3, 2, 2, "late"), overrides, tmp_path / "reference")
    aggregate = crash_scaffold_in_round(3, monkeypatch)
    run = tmp_path / "flower"
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_on(RoundGrid(3, 2, 2, "late"), overrides, run)
    monkeypatch.setattr(Scaffold, "aggregate", aggregate)
    run_on(RoundGrid(3, 2, 2, "late"), overrides, run, resume=True)
    assert [x["failed_clients"] for x in metrics(run)] == [[], [2], [], []]
    assert [{k: v for k, v in x.items() if k not in DROP} for x in metrics(run)] == \
        [{k: v for k, v in x.items() if k not in DROP} for x in metrics(tmp_path / "reference")]


@pytest.fixture
def polls(monkeypatch) -> list[float]:
    """The server's clock moves one second per poll and only then (no real waiting): the polls' times."""
    import hetfl.flower.server as server

    now: list[float] = []
    monkeypatch.setattr(server, "time", SimpleNamespace(monotonic=lambda: len(now)))
    monkeypatch.setattr(FlowerFederation, "_sleep", lambda self: now.append(float(len(now) + 1)))
    return now


def failures(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "failed:" in r.getMessage()]


def test_once_the_quorum_has_answered_the_others_get_the_grace_not_the_timeout(tmp_path, polls, caplog):
    """Client 2's node is down in round 2; 2 of 3 must answer. Its training phase ends runtime.flower_grace_s
    (5 s) after the two others answered, not after the 1000 s timeout; the client is recorded as failed with
    the grace as its reason, and the numbers are those of the run that waited the whole timeout."""
    sets = [*SMALL, "algorithm.name=fedavg", "runtime.flower_min_replies=2", "runtime.flower_timeout_s=1000"]
    run_on(RoundGrid(3, 2, 2, "lost"), [*sets, "runtime.flower_grace_s=5"], tmp_path / "grace")
    assert polls == [1, 2, 3, 4, 5, 6]  # the wait ends at the first poll past the grace
    assert failures(caplog) == ["flower: client 2 failed: train: no reply within 5 s of the quorum's (2 clients; "
                                "runtime.flower_grace_s)"]
    polls.clear()
    caplog.clear()
    run_on(RoundGrid(3, 2, 2, "lost"), sets, tmp_path / "timeout")  # the default grace: inf
    assert len(polls) == 1001 and failures(caplog) == [
        "flower: client 2 failed: train: no reply within 1000 s (runtime.flower_timeout_s)"]
    got, waited = metrics(tmp_path / "grace"), metrics(tmp_path / "timeout")
    assert [x["failed_clients"] for x in got] == [[], [2]]
    assert [{k: v for k, v in x.items() if k not in DROP} for x in got] == \
        [{k: v for k, v in x.items() if k not in DROP} for x in waited]


def test_a_grace_longer_than_what_is_left_of_the_timeout_does_not_extend_it(tmp_path, polls):
    run_on(RoundGrid(3, 2, 2, "lost"), [*SMALL, "algorithm.name=fedavg", "runtime.flower_min_replies=2",
                                        "runtime.flower_timeout_s=3", "runtime.flower_grace_s=50"], tmp_path / "r")
    assert polls == [1, 2, 3, 4]


@pytest.mark.parametrize("case", ["all asked", "an error reply"])
def test_the_grace_starts_only_once_the_quorum_has_answered_without_an_error(tmp_path, polls, case):
    """Below the quorum the phase waits the whole timeout, with any grace (an error reply is no answer),
    then stops the run."""
    grid = LoopbackGrid(3)
    grid.dead.add(grid.ids[2])
    sets = [*SMALL, "algorithm.name=fedavg", "runtime.flower_timeout_s=10", "runtime.flower_grace_s=0"]
    if case == "all asked":
        sets.append("runtime.flower_min_replies=0")
    else:
        grid.broken.add(grid.ids[0])
        sets.append("runtime.flower_min_replies=2")
    with pytest.raises(FlowerRoundError, match=r"round 1, training: [12] of 3 clients answered"):
        run_on(grid, sets, tmp_path / "r")
    assert len(polls) == 11


class LateGrid:
    """Replies to every message at the third poll (a grid for the server's wait alone)."""

    def __init__(self) -> None:
        self.pulls = 0

    def push_messages(self, messages: list[Any]) -> list[str]:
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, ids: list[str]) -> list[Any]:
        self.pulls += 1
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i), has_error=lambda: False)
                for i in ids] if self.pulls == 3 else []


def test_a_wait_without_a_quorum_greetings_and_secure_aggregation_has_no_grace(polls):
    """The greeting and SecAgg+'s stages wait for every node up to the timeout, whatever the grace: a stage
    of the secure sum closed early would drop clients the protocol could still count."""
    exp = Experiment(config.load(None, [*SMALL, "runtime.executor=flower", "runtime.flower_grace_s=0"]))
    federation = FlowerFederation(exp, LateGrid())
    messages = [SimpleNamespace(metadata=SimpleNamespace(message_id=f"m{k}")) for k in range(3)]
    replies, unanswered, _ = federation._send_and_receive(messages)
    assert len(replies) == 3 and unanswered == [] and polls == [1, 2]


def test_a_negative_or_nan_grace_is_refused_naming_the_key():
    for bad in ("-1", "nan"):
        with pytest.raises(config.ConfigError, match=f"runtime.flower_grace_s = {bad}"):
            config.load(None, [f"runtime.flower_grace_s={bad}"])


def test_waiting_for_nodes_that_have_not_connected_is_said_before_the_wait(tmp_path, caplog):
    """A node that never connects: the server waits runtime.flower_timeout_s for it before round 1, and says so
    when the wait begins (before, nothing was logged until the wait had passed: 10 minutes by default)."""
    exp = Experiment(config.load(None, [*SMALL, "runtime.executor=flower", "runtime.flower_timeout_s=0.3"]))
    federation = FlowerFederation(exp, LoopbackGrid(2), poll_s=0.01)  # 3 clients, 2 nodes
    federation.start(tmp_path, 0, {})
    said = [r.getMessage() for r in caplog.records]
    waiting = next(i for i, x in enumerate(said) if "2 of the 3 clients' nodes connected" in x)
    assert "waiting up to 0.3 s (runtime.flower_timeout_s)" in said[waiting], said
    assert waiting < next(i for i, x in enumerate(said) if "no node holds clients [2]" in x)


# ------------------------------------------------------------- privacy of a phase closed by the grace (audit privacy2)
class PhaseGrid(LoopbackGrid):
    """Node ``who`` computes its reply to the ``kind`` message of round ``at`` but the reply stays held (a straggler
    whose noisy upload reaches the link after the phase closed)."""

    def __init__(self, num_nodes: int, who: int, at: int, kind: str, once: bool = False) -> None:
        super().__init__(num_nodes)
        self.node, self.at, self.kind, self.once = self.ids[who], str(at), kind, once

    def push_messages(self, messages: list[Message]) -> list[str]:
        ids = []
        for message in messages:
            hit = (message.metadata.message_type == self.kind and message.metadata.group_id == self.at
                   and message.metadata.dst_node_id == self.node)
            if hit:
                self.slow.add(self.node)
                self.at = "" if self.once else self.at
            ids += super().push_messages([message])
            self.slow.discard(self.node)
        return ids


@needs_accountant
@pytest.mark.parametrize("case", ["ccvr distributed", "ccvr local", "fedpac local"])
def test_a_straggler_closed_out_by_the_grace_is_accounted_from_the_uploads_summed(tmp_path, polls, case):
    """3 clients, 2 must answer, a grace of 2 s: client 2 computes its noisy upload of the private phase but its
    reply comes after the grace. The server sums 2 uploads: with distributed noise (each client 1/3 of the variance)
    the sum carries 2/3 of the planned variance, and the epsilon reported is that of multiplier z sqrt(2/3) (hand
    computation: 5.06 for a target of 4); the straggler's own upload, were the server to read it, is covered by
    epsilon_per_upload (multiplier z / sqrt(3)). With local noise every upload carries the whole noise: the target."""
    from hetfl.privacy import epsilon_spent, noise_multiplier

    if case == "fedpac local":
        private, kind, releases = ["algorithm.name=fedpac", "algorithm.dp_epsilon=4", "algorithm.dp_noise=local"], \
            "train", 2
    else:
        private, kind, releases = ["algorithm.name=fedavg+ccvr", "algorithm.ccvr.dp_epsilon=4",
                                   "algorithm.ccvr.epochs=1", f"algorithm.ccvr.dp_noise={case.split()[1]}"], \
            "query.posthoc", 1
    sets = [*SMALL, *private, "runtime.flower_min_replies=2", "runtime.flower_timeout_s=1000",
            "runtime.flower_grace_s=2"]
    grid = PhaseGrid(3, 2, 2, kind)
    privacy = run_on(grid, sets, tmp_path / "r")["privacy"]
    assert len(grid.held) == 1  # the straggler computed and sent its reply; the server did not wait for it
    assert len(polls) < 10  # the grace closed the phase, not the 1000 s timeout
    z = noise_multiplier(4.0, 1e-5, releases)
    ledger = json.loads((tmp_path / "r" / "privacy_ledger.json").read_text())["releases"]
    assert len(ledger) == privacy["releases"] == releases and privacy["summed_clients"] == 2
    if case == "ccvr distributed":
        assert ledger[0]["multiplier"] == pytest.approx(z * (2 / 3) ** 0.5, rel=1e-12)
        assert privacy["epsilon"] == pytest.approx(epsilon_spent([z * (2 / 3) ** 0.5], 1e-5), rel=1e-9)
        assert privacy["epsilon"] > 5.0
        assert privacy["epsilon_per_upload"] == pytest.approx(epsilon_spent([z / 3 ** 0.5], 1e-5), rel=1e-9)
    else:
        assert privacy["epsilon"] == pytest.approx(epsilon_spent([z] * releases, 1e-5), rel=1e-9)
        assert privacy["epsilon"] == pytest.approx(4.0, rel=1e-9)


@needs_accountant
def test_a_round_with_a_straggler_lost_after_the_checkpoint_counts_both_of_its_releases(tmp_path, polls, monkeypatch):
    """CCVR every round (4 releases planned), distributed OS noise, a checkpoint every 2 rounds; in round 3 client
    2's reply comes after the grace (the server sums 2 uploads: multiplier z sqrt(2/3)); the server is killed at
    the start of round 4 and resumes from round 2's checkpoint; round 3 runs again, all 3 answer (multiplier z).
    The ledger holds both releases of round 3 and the summary composes all five (hand composition: 4.81 for a
    target of 4), not the four of the history the resumed run computed with (4.0)."""
    from hetfl.privacy import epsilon_spent, noise_multiplier

    sets = [*SMALL, "train.rounds=4", "train.local_steps=2", "algorithm.name=fedavg+ccvr",
            "algorithm.ccvr.dp_epsilon=4", "algorithm.ccvr.every_round=true", "algorithm.ccvr.epochs=1",
            "algorithm.ccvr.dp_noise_source=os", "runtime.checkpoint_every=2", "runtime.flower_min_replies=2",
            "runtime.flower_timeout_s=1000", "runtime.flower_grace_s=2"]
    run = tmp_path / "run"
    killed_then_resumed(PhaseGrid(3, 2, 3, "query.posthoc", once=True), sets, run, 4, monkeypatch)
    z = noise_multiplier(4.0, 1e-5, 4)
    ledger = json.loads((run / "privacy_ledger.json").read_text())["releases"]
    assert [e["round"] for e in ledger] == [1, 2, 3, 3, 4]
    want = [z, z, z * (2 / 3) ** 0.5, z, z]
    assert [e["multiplier"] for e in ledger] == pytest.approx(want, rel=1e-12)
    privacy = json.loads((run / "summary.json").read_text())["privacy"]
    assert privacy["releases"] == 5
    assert privacy["epsilon"] == pytest.approx(epsilon_spent(want, 1e-5), rel=1e-9) and privacy["epsilon"] > 4.8
