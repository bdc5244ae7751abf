"""CCVR's statistics under Flower's SecAgg+ (hetfl.flower.secagg): the in-process secure run's numbers,
a client dropping out during the protocol, too few clients left.

The protocol tests run the server and the ClientApps in this process on a Grid that serialises each
message (a deep copy, as the wire does: SecAgg+'s mod edits what it receives); one Ray simulation
(slow) checks the real engine."""

from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason='Flower is not installed: pip install "hetfl[flower]"')

import torch
from flwr.app import Error, Message
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from hetfl import config
from hetfl.algorithms.base import without_feature_transforms
from hetfl.engine import secure_sum
from hetfl.engine.experiment import Experiment
from hetfl.flower.client_app import app as client_app
from hetfl.flower.protocol import NODES_DIR, TRUSTED_ROOTS_ENV
from hetfl.flower.server import FlowerFederation, FlowerRoundError
from tests.flower.test_flower_logic import LoopbackGrid
from tests.helpers import needs_accountant

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = ["algorithm.name=fedavg+ccvr", "data.partition=dirichlet", "train.rounds=2", "train.batch_size=16",
        "train.local_steps=5", "algorithm.ccvr.epochs=1", "model.options={hidden = [16]}", "runtime.progress=false",
        "runtime.threads=1", "runtime.secure_aggregation=true"]
DROP = {"round_time_s", "eval_time_s", "failed_clients", "flower_bytes_down", "flower_bytes_up"}


@pytest.fixture(autouse=True)
def trusted_state_roots(tmp_path, monkeypatch):
    """The in-process nodes keep client state where the server says, under ``tmp_path``, as the simulation's
    nodes do under the run folders (their environment trusts them: hetfl.flower.node.state_root)."""
    monkeypatch.setenv(TRUSTED_ROOTS_ENV, str(tmp_path))


class WireGrid(LoopbackGrid):
    """LoopbackGrid whose nodes get a copy of each message (as after serialisation); a node in
    ``fail_at`` answers SecAgg+'s message of that stage with an error (a node raising there)."""

    def __init__(self, num_nodes: int) -> None:
        super().__init__(num_nodes)
        self.fail_at: dict[int, str] = {}

    def push_messages(self, messages: list[Message]) -> list[str]:
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            ids.append(message.metadata.message_id)
            node = message.metadata.dst_node_id
            secagg = message.content.config_records.get(RECORD_KEY_CONFIGS)
            if secagg is not None and secagg.get(Key.STAGE) == self.fail_at.get(node):
                self.replies[message.metadata.message_id] = Message(Error(code=0, reason="node crashed"),
                                                                    reply_to=message)
                continue
            self.replies[message.metadata.message_id] = client_app(copy.deepcopy(message), self.contexts[node])
        return ids


def lines(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if k not in DROP}
            for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def federation(grid: WireGrid, overrides: list[str], run_dir: Path) -> tuple[Experiment, FlowerFederation]:
    exp = Experiment(config.load(None, [*overrides, "runtime.executor=flower"]))
    exp.federation = fed = FlowerFederation(exp, grid, poll_s=0.01, state_root=str(run_dir / NODES_DIR))
    return exp, fed


def test_secagg_on_flower_gives_the_in_process_secure_run_bit_for_bit(tmp_path):
    overrides = [*BASE, "data.num_clients=4"]
    Experiment(config.load(None, overrides)).run(tmp_path / "in_process")
    exp, _ = federation(WireGrid(4), overrides, tmp_path / "flower")
    exp.run(tmp_path / "flower")
    got = lines(tmp_path / "flower")
    assert got == lines(tmp_path / "in_process")
    assert got[-1]["secagg_clients"] == 4 and "ccvr_virtual_features" in got[-1]
    raw = json.loads((tmp_path / "flower" / "metrics.jsonl").read_text().splitlines()[-1])
    assert raw["failed_clients"] == []


def _survivors_sum(overrides: list[str], grid: WireGrid, tmp_path: Path, round_: int = 1):
    """(the SecAgg+ sum over the federation, the in-process code's sum over the clients it names)."""
    exp, fed = federation(grid, overrides, tmp_path)
    fed.start(tmp_path, 0, {})
    step = exp.posthoc[0]
    raw = without_feature_transforms(exp.initial_server().model)
    got = fed.posthoc_replies(step, raw, round_)
    replies = {}
    for c in got.clients:
        feats, labels = exp.client_features(raw, c)
        replies[c] = step.client_query(raw, feats, labels, client=c, round_=round_)
    return fed, got, secure_sum.simulate(step, replies, secure_sum.quantization_range(exp.cfg.data.num_clients))


def test_a_client_dropping_out_during_secagg_is_left_out_of_the_sum_and_the_round_completes(tmp_path):
    """One node of ten fails at stage 2 (collect masked vectors), after sharing its keys: its neighbours'
    shares remove its pairwise masks, the server gets the exact sum of the other nine."""
    grid = WireGrid(10)
    dropped = grid.ids[6]
    grid.fail_at[dropped] = Stage.COLLECT_MASKED_VECTORS
    fed, got, want = _survivors_sum([*BASE, "data.num_clients=10"], grid, tmp_path)
    assert got.clients == (0, 1, 2, 3, 4, 5, 7, 8, 9)
    assert all(torch.equal(got.total[k], want.total[k]) for k in want.total)
    assert got.clipped == want.clipped and got.bytes_per_client == want.bytes_per_client
    assert 6 in fed.failed and "collect_masked_vectors" in fed.failed[6]


def test_a_whole_run_with_a_dropout_logs_nine_summed_clients(tmp_path):
    grid = WireGrid(10)
    grid.fail_at[grid.ids[2]] = Stage.COLLECT_MASKED_VECTORS
    exp, _ = federation(grid, [*BASE, "data.num_clients=10", "train.rounds=1"], tmp_path / "r")
    exp.run(tmp_path / "r")
    line = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[-1])
    assert line["secagg_clients"] == 9 and line["failed_clients"] == [2]


def test_too_few_clients_left_stop_the_run_naming_the_phase_and_the_counts(tmp_path):
    grid = WireGrid(4)  # threshold 3 of 4 neighbours: two dropouts leave 2
    for node in grid.ids[:2]:
        grid.fail_at[node] = Stage.COLLECT_MASKED_VECTORS
    with pytest.raises(FlowerRoundError, match=r"round 1, post-hoc ccvr \(secure aggregation\): SecAgg\+ stopped "
                                               r"\(.*stage collect_masked_vectors: 2 of 4 answered\).*"
                                               r"secagg_reconstruction_threshold = 3"):
        _survivors_sum([*BASE, "data.num_clients=4"], grid, tmp_path)


def test_fewer_survivors_than_flower_min_replies_stop_the_run(tmp_path):
    grid = WireGrid(4)
    grid.fail_at[grid.ids[1]] = Stage.COLLECT_MASKED_VECTORS
    with pytest.raises(FlowerRoundError, match=r"post-hoc ccvr \(secure aggregation\): 3 of 4 clients answered"):
        _survivors_sum([*BASE, "data.num_clients=4", "runtime.flower_min_replies=0"], grid, tmp_path)


@needs_accountant
@pytest.mark.processes
@pytest.mark.slow
def test_the_readmes_secure_private_flower_command_gives_the_in_process_numbers(tmp_path):
    """The README's ``hetfl run --set runtime.executor=flower --set runtime.secure_aggregation=true ...`` (CCVR's
    moments with differential privacy, summed by SecAgg+; made small; the README test leaves it to this test):
    Flower's simulation engine (Ray), three nodes, SecAgg+ over real message passing, the in-process secure
    run's numbers and the budget it was asked for."""
    pytest.importorskip("ray", reason="Flower's simulation engine (Ray) is not installed")
    from hetfl.cli import main
    from tests.helpers.readme import readme_command

    args = readme_command("hetfl run --set runtime.executor=flower --set runtime.secure_aggregation=true")[1:]
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    assert {"algorithm.name=fedavg+ccvr", "algorithm.ccvr.dp_epsilon=4"} <= set(sets)
    small = [*BASE, "data.num_clients=3"]
    Experiment(config.load(None, [*small, *[x for x in sets if x != "runtime.executor=flower"]])).run(
        tmp_path / "in_process")
    assert main([*args, *[f"--set={x}" for x in small], "--out", str(tmp_path / "flower"), "--quiet"]) == 0
    got = lines(tmp_path / "flower")
    assert got == lines(tmp_path / "in_process") and got[-1]["secagg_clients"] == 3
    privacy = json.loads((tmp_path / "flower" / "summary.json").read_text())["privacy"]
    assert privacy["epsilon"] == pytest.approx(4.0, rel=1e-3) and privacy["summed_clients"] == 3


@needs_accountant
def test_differential_privacy_under_secagg_on_flower_matches_in_process_and_reports_the_budget(tmp_path):
    """The issue's command through Flower with SecAgg+ on: noisy moments summed by SecAgg+ give the in-process
    secure run's numbers, and the summary reports the epsilon spent (all clients summed: the target)."""
    overrides = [*BASE, "data.num_clients=4", "algorithm.ccvr.dp_epsilon=4"]
    Experiment(config.load(None, overrides)).run(tmp_path / "in_process")
    exp, _ = federation(WireGrid(4), overrides, tmp_path / "flower")
    summary = exp.run(tmp_path / "flower")
    assert lines(tmp_path / "flower") == lines(tmp_path / "in_process")
    privacy = summary["privacy"]
    assert privacy["epsilon"] == pytest.approx(4.0, rel=1e-3) and privacy["summed_clients"] == 4
    assert privacy["accountant"].startswith("dp-accounting") and privacy["noise"] == "distributed"
    assert lines(tmp_path / "flower")[-1]["secagg_clipped_entries"] == 0  # the noise stays within the bounds


@needs_accountant
def test_a_dropout_under_differential_privacy_spends_more_than_the_target(tmp_path):
    """Nine of ten noise shares summed: less noise than planned; the epsilon reported is the one spent."""
    grid = WireGrid(10)
    grid.fail_at[grid.ids[2]] = Stage.COLLECT_MASKED_VECTORS
    overrides = [*BASE, "data.num_clients=10", "train.rounds=1", "algorithm.ccvr.dp_epsilon=4"]
    exp, _ = federation(grid, overrides, tmp_path / "r")
    privacy = exp.run(tmp_path / "r")["privacy"]
    assert privacy["summed_clients"] == 9
    z = privacy["noise_multiplier"]
    from hetfl.privacy import epsilon_spent

    assert privacy["epsilon"] == pytest.approx(epsilon_spent([z * (9 / 10) ** 0.5], 1e-5))
    assert privacy["epsilon"] > 4.0


@needs_accountant
@pytest.mark.slow
def test_a_nodes_privacy_floor_encodes_its_reply_on_the_servers_grid(tmp_path, monkeypatch):
    """Issue 26, item 12: a node whose dp-epsilon floor is stricter than the server's adds more noise, but
    encodes its reply with the public bounds of the server's settings, which the server decodes the sum with."""
    seen = []
    encode = secure_sum.encode
    monkeypatch.setattr(secure_sum, "encode",
                        lambda dense, bounds, levels: seen.append(dict(bounds)) or encode(dense, bounds, levels))
    grid = WireGrid(4)
    grid.contexts[grid.ids[1]].node_config["dp-epsilon"] = 2.0
    exp, _ = federation(grid, [*BASE, "data.num_clients=4", "algorithm.ccvr.dp_epsilon=8"], tmp_path / "r")
    exp.run(tmp_path / "r")
    assert len(seen) == 4 and all(bounds == exp.posthoc[0].reply_bounds() for bounds in seen), seen


def test_a_node_found_with_other_data_is_left_out_of_the_secure_sum(tmp_path, caplog):
    """SecAgg+'s messages carry no digest of the node's data; a node whose training replies were refused for
    holding other data than the server's (tests/flower/test_flower_logic.py) used to be asked for its CCVR
    statistics all the same, and they went into the sum (4 clients summed). Now it is left out of the secure
    phase with the reason (3 summed)."""
    import numpy as np

    from tests.flower.test_flower_logic import _write_mnist

    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (120, 28, 28), dtype=np.uint8), (np.arange(120) % 10).astype(np.uint8)
    grid = WireGrid(4)
    grid.contexts[grid.ids[1]].node_config["data-root"] = str(_write_mnist(tmp_path / "node1", 255 - images, labels))
    overrides = [*BASE, "data.dataset=mnist", f"data.root={_write_mnist(tmp_path / 'server', images, labels)}",
                 "data.partition=iid", "data.num_clients=4", "train.rounds=1", "model.name=mlp"]
    exp, _ = federation(grid, overrides, tmp_path / "r")
    exp.run(tmp_path / "r")
    line = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[-1])
    assert line["failed_clients"] == [1] and line["secagg_clients"] == 3, line
    said = [r.getMessage() for r in caplog.records if "client 1 failed" in r.getMessage()]
    assert said and all("other data than the server's" in x for x in said), said


@needs_accountant
def test_a_secure_sum_received_in_a_round_stopped_by_the_quorum_counts_after_the_resume(tmp_path):
    """Audit privacy2 (failed before its fix): 4 clients, OS noise, every client must answer; client 1 drops out of
    SecAgg+ after sharing its keys, the protocol still gives the server the noisy sum of the 3 others, and only
    then does the quorum stop the run. That sum was recorded nowhere (the stop carried no ``received``), so the
    resumed round's full sum was the one release counted: epsilon 4.0 reported, where the server had received
    the sums of 3 (multiplier z sqrt(3/4)) and of 4 clients (z), together epsilon 6.57."""
    from hetfl.privacy import epsilon_spent, noise_multiplier

    overrides = [*BASE, "data.num_clients=4", "train.rounds=1", "algorithm.ccvr.dp_epsilon=4",
                 "algorithm.ccvr.dp_noise_source=os", "runtime.flower_min_replies=0"]
    grid, run = WireGrid(4), tmp_path / "r"
    grid.fail_at[grid.ids[1]] = Stage.COLLECT_MASKED_VECTORS
    exp, _ = federation(grid, overrides, run)
    with pytest.raises(FlowerRoundError, match=r"3 of 4 clients answered"):
        exp.run(run)
    z = noise_multiplier(4.0, 1e-5, 1)
    ledger = json.loads((run / "privacy_ledger.json").read_text())["releases"]
    assert [(e["round"], e["multiplier"]) for e in ledger] == [(1, pytest.approx(z * (3 / 4) ** 0.5, rel=1e-12))]
    grid.fail_at.clear()
    exp, _ = federation(grid, overrides, run)
    privacy = exp.run(run, resume=True)["privacy"]
    assert privacy["releases"] == 2
    want = epsilon_spent([z * (3 / 4) ** 0.5, z], 1e-5)  # a hand composition of the two sums the server got
    assert privacy["epsilon"] == pytest.approx(want, rel=1e-9) and want > 6.0
