"""A secure post-hoc round's bookkeeping on Flower (``hetfl.flower.secagg``): what mutation testing of the module
(``benchmarks/mutation.py`` target ``flower_secagg``, session 41) showed the whole secure rounds of
``test_flower_secagg.py`` leave unchecked.

The bytes a SecAgg+ round sends and receives (its arrays and its byte strings: keys, shares, masked vectors), which
``metrics.jsonl`` reports as ``flower_bytes_down`` / ``flower_bytes_up``; the failures recorded for a node that
answers with an error or not at all, named by client and stage; the strategy that hands the workflow one query per
node and keeps what it unmasked. Stand-ins for the federation and the messages: no Flower run.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason='Flower is not installed: pip install "hetfl[flower]"')

from flwr.common import FitIns, FitRes, Status, ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.common.secure_aggregation.secaggplus_constants import Key as SecAggKey

from hetfl.algorithms.ccvr_statistics import CCVRStatistics
from hetfl.flower import secagg
from hetfl.flower.server import FlowerFederation, FlowerRoundError


def content(arrays: tuple[int, ...] = (), blobs: dict | None = None, stage: str | None = None) -> SimpleNamespace:
    """A message's content: array records of ``arrays`` bytes each, config records holding ``blobs``."""
    configs = {"other": dict(blobs or {})}
    if stage is not None:
        configs[RECORD_KEY_CONFIGS] = {SecAggKey.STAGE: stage}
    return SimpleNamespace(array_records={"r": {f"a{i}": SimpleNamespace(data=b"x" * n) for i, n in enumerate(arrays)}},
                           config_records=configs)


def message(src: int = 0, dst: int = 0, *, body: SimpleNamespace | None = None, error: str | None = None):
    return SimpleNamespace(content=body or content(), metadata=SimpleNamespace(src_node_id=src, dst_node_id=dst),
                           has_error=lambda: error is not None, error=SimpleNamespace(reason=error))


class Federation:
    """What ``_Grid`` uses of a ``FlowerFederation``: its traffic counts, its failure records, its messaging."""

    def __init__(self, replies: list, late: list[int], why: str) -> None:
        self.traffic = [100, 200]
        self.failed: list[tuple[int, str]] = []
        self.answer = (replies, late, why)
        self.sent: list = []

    def _send_and_receive(self, messages):
        self.sent.append(messages)
        return self.answer

    def fail(self, client: int, reason: str) -> None:
        self.failed.append((client, reason))


def test_a_messages_bytes_are_its_arrays_and_its_byte_strings():
    body = content((10, 5), {"key": b"abc", "shares": [b"de", b"f", 3], "text": "not bytes", "n": 7})
    assert secagg._nbytes(body) == 10 + 5 + 3 + 2 + 1
    assert secagg._nbytes(content()) == 0


def test_a_stage_counts_the_bytes_both_ways_and_records_who_failed_and_where():
    error_reply = message(src=12, body=content((50,)), error="boom")  # first: the ones after it still count
    good_reply = message(src=11, body=content((7,), {"masked": b"12"}))
    stray_reply = message(src=99, body=content((1,)), error="lost")
    outgoing = [message(dst=d, body=content((n,), stage="share_keys")) for d, n in ((11, 4), (12, 5), (13, 6))]
    fed = Federation([error_reply, good_reply, stray_reply], late=[2], why="no reply within 3 s")
    grid = secagg._Grid(fed, {11: 1, 12: 2, 13: 3})
    assert grid.send_and_receive(iter(outgoing)) == [error_reply, good_reply, stray_reply]
    assert fed.sent == [outgoing]
    assert fed.traffic == [100 + 4 + 5 + 6, 200 + 7 + 2]  # an error reply's bytes are not counted as received
    assert fed.failed == [(2, "secure aggregation, stage share_keys: boom"),
                          (-1, "secure aggregation, stage share_keys: lost"),  # a node of no client
                          (3, "secure aggregation, stage share_keys: no reply within 3 s")]
    assert grid.stages == [("share_keys", 3, 1)]


def test_a_late_node_of_no_client_and_a_stage_without_a_name_are_recorded_as_such():
    outgoing = [message(dst=40, body=content((2,), stage=None))]
    outgoing[0].content.config_records[RECORD_KEY_CONFIGS] = {}
    fed = Federation([], late=[0], why="stopped")
    grid = secagg._Grid(fed, {})
    assert grid.send_and_receive(outgoing) == []
    assert fed.failed == [(-1, "secure aggregation, stage ?: stopped")]
    assert grid.stages == [("?", 1, 0)] and fed.traffic == [102, 200]
    empty = Federation([], late=[], why="")
    grid = secagg._Grid(empty, {})
    assert grid.send_and_receive([]) == [] and grid.stages == [("?", 0, 0)] and empty.traffic == [100, 200]


def test_the_strategy_asks_each_node_on_the_federations_grid_and_keeps_the_first_unmasked_average():
    grid = object()
    fitins = {5: FitIns(ndarrays_to_parameters([]), {"a": 1}), 6: FitIns(ndarrays_to_parameters([]), {"a": 2})}
    strategy = secagg._SumStrategy(fitins, grid)
    asked = strategy.configure_fit(1, ndarrays_to_parameters([]), None)
    assert [(p.node_id, p.grid, p.run_id, ins) for p, ins in asked] == [(5, grid, 0, fitins[5]),
                                                                         (6, grid, 0, fitins[6])]
    average = [np.arange(3.0)]

    def fit_res(values):
        return FitRes(Status(0, ""), ndarrays_to_parameters(values), 1, {})

    results = [(SimpleNamespace(node_id=6), fit_res(average)), (SimpleNamespace(node_id=5), fit_res([np.ones(2)]))]
    assert strategy.aggregate_fit(1, results, []) == (None, {})
    nodes, kept = strategy.result
    assert nodes == [6, 5] and len(kept) == 1 and np.array_equal(kept[0], average[0])
    strategy.aggregate_fit(1, [], [])
    assert strategy.result == ([], [])



# ------------------------------------------------------------------ whole secure rounds (in-process Flower)
@pytest.fixture
def secure_round(tmp_path, monkeypatch):
    """test_flower_secagg.py's in-process secure post-hoc round (its nodes' state roots trusted): (the federation,
    the SecAgg+ sum, the in-process sum over the clients it names)."""
    from flwr.common.secure_aggregation.secaggplus_constants import Stage

    from hetfl.flower.protocol import TRUSTED_ROOTS_ENV
    from tests.flower.test_flower_secagg import BASE, WireGrid, _survivors_sum

    monkeypatch.setenv(TRUSTED_ROOTS_ENV, str(tmp_path))

    def run(sets: list[str], nodes: int, fail_at: tuple[int, ...] = ()):
        grid = WireGrid(nodes)
        for i in fail_at:
            grid.fail_at[grid.ids[i]] = Stage.COLLECT_MASKED_VECTORS
        return _survivors_sum([*BASE, *sets], grid, tmp_path)

    return run


def test_two_clients_are_enough_for_a_secure_sum(secure_round):
    fed, got, want = secure_round(["data.num_clients=2", "runtime.secagg_reconstruction_threshold=2"], 2)
    assert got.clients == (0, 1) and fed.failed == {}
    assert all(torch.equal(got.total[k], want.total[k]) for k in want.total)


def test_a_client_without_a_node_is_recorded_and_left_out_of_the_sum(secure_round):
    # the federation waits runtime.flower_timeout_s for the fourth node to connect
    fed, got, want = secure_round(["data.num_clients=4", "runtime.flower_min_replies=3",
                                   "runtime.flower_timeout_s=0.5"], 3)
    assert got.clients == (0, 1, 2) and fed.failed == {3: "no node holds this client's partition"}
    assert all(torch.equal(got.total[k], want.total[k]) for k in want.total)


def test_a_stop_names_each_stages_answers_and_the_failed_clients(secure_round):
    with pytest.raises(FlowerRoundError) as err:
        secure_round(["data.num_clients=4"], 4, fail_at=(0, 1))
    crashed = "secure aggregation, stage collect_masked_vectors: node crashed"
    assert str(err.value).startswith(
        "round 1, post-hoc ccvr (secure aggregation): SecAgg+ stopped (stage setup: 4 of 4 answered; stage "
        "share_keys: 4 of 4 answered; stage collect_masked_vectors: 2 of 4 answered); every client must keep "
        "runtime.secagg_reconstruction_threshold = 3 of its min(runtime.secagg_num_shares = "), str(err.value)
    assert f"(client 0: {crashed}; client 1: {crashed})" in str(err.value)


def test_a_node_found_holding_other_data_is_not_asked_and_its_reason_is_recorded(secure_round, monkeypatch):
    why = "its node's data-root holds other samples (digest 1234 of 5678)"
    monkeypatch.setattr(FlowerFederation, "holds_other_data", lambda self, c: why if c == 3 else "")
    fed, got, want = secure_round(["data.num_clients=4", "runtime.flower_min_replies=3"], 4)
    assert got.clients == (0, 1, 2) and fed.failed == {3: f"secure aggregation: {why}"}
    assert all(torch.equal(got.total[k], want.total[k]) for k in want.total)


def test_a_node_the_workflow_leaves_out_of_the_sum_without_a_failure_is_recorded(secure_round, monkeypatch):
    """SecAgg+ leaves out a node whose neighbours hold too few of its shares, although the node answered every
    stage: no failure of the grid names it, so the round records why it is not among the summed clients."""
    workflow = secagg.SecAggPlusWorkflow

    class DropsTheLastNode(workflow):
        def __call__(self, grid, context):
            super().__call__(grid, context)
            nodes, average = context.strategy.result
            context.strategy.result = (nodes[:-1], average)

    monkeypatch.setattr(secagg, "SecAggPlusWorkflow", DropsTheLastNode)
    fed, got, _ = secure_round(["data.num_clients=4", "runtime.flower_min_replies=3"], 4)
    assert len(got.clients) == 3
    (left_out,) = set(range(4)) - set(got.clients)
    assert fed.failed == {left_out: "post-hoc ccvr (secure aggregation): its masked vector was not summed"}


def test_the_clipped_entries_of_a_secure_round_are_counted_as_in_process(secure_round, monkeypatch):
    bounds = CCVRStatistics.reply_bounds
    monkeypatch.setattr(CCVRStatistics, "reply_bounds",
                        lambda self: {k: v / 1000 for k, v in bounds(self).items()})  # most entries clip
    _, got, want = secure_round(["data.num_clients=4"], 4)
    assert got.clipped == want.clipped > 0


def test_a_stop_names_at_most_five_failed_clients(secure_round):
    with pytest.raises(FlowerRoundError) as err:
        secure_round(["data.num_clients=8"], 8, fail_at=(0, 1, 2, 3, 4, 5))
    crashed = "secure aggregation, stage collect_masked_vectors: node crashed"
    assert str(err.value).endswith("; ".join(f"client {c}: {crashed}" for c in range(5)) + ")")


def test_a_stop_with_no_failed_client_ends_with_the_neighbours_rule(secure_round, monkeypatch):
    """A workflow that ends without a sum and without a failure on the grid (none of Flower's does today): the
    stop names no client."""
    monkeypatch.setattr(secagg, "SecAggPlusWorkflow", lambda *args, **kwargs: lambda grid, context: None)
    with pytest.raises(FlowerRoundError) as err:
        secure_round(["data.num_clients=2", "runtime.secagg_reconstruction_threshold=2"], 2)
    assert str(err.value) == (
        "round 1, post-hoc ccvr (secure aggregation): SecAgg+ stopped (2 client(s) reachable, SecAgg+ needs at "
        "least 2); every client must keep runtime.secagg_reconstruction_threshold = 2 of its "
        "min(runtime.secagg_num_shares = 5, 2) neighbours")


def test_a_secure_round_short_of_its_quorum_names_its_round(secure_round):
    with pytest.raises(FlowerRoundError) as err:
        secure_round(["data.num_clients=4", "runtime.flower_min_replies=4"], 4, fail_at=(2,))
    assert str(err.value).startswith("round 1, post-hoc ccvr (secure aggregation): 3 of 4 clients answered"), \
        str(err.value)
