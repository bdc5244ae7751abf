"""An additive post-hoc step's round (CCVR's statistics) under Flower's SecAgg+: the server learns the
sum of the clients' replies and nothing else.

Flower's own, unmodified protocol runs it: :class:`flwr.server.workflow.SecAggPlusWorkflow` on the
server, :func:`flwr.client.mod.secaggplus_mod` on the nodes. The workflow is written for a legacy
``Strategy`` whose clients train and return a weighted average; here:

server (:func:`secure_posthoc`)
    a :class:`_SumStrategy` whose ``configure_fit`` gives each client's node a ``FitIns`` holding
    hetfl's header (config, client, round, step index, grid) and the global model, and whose
    ``aggregate_fit`` keeps what the workflow unmasked. The workflow's four stages of ``train``
    messages go through the federation's own messaging (:class:`_Grid`: its polling, timeout, stop
    and failure records). Flower's server returns ``avg = sum_i x_i / n`` over the ``n`` clients whose
    masked vectors were unmasked (weights 1); ``hetfl.engine.secure_sum`` recovers the exact integer
    sum from it and decodes it.
node (:func:`secure_aggregation_mod`; the query itself: :func:`hetfl.flower.node.handle_secure_query`)
    the mod passes hetfl's own ``train`` messages through and hands SecAgg+'s to ``secaggplus_mod``;
    at stage 2 (collect masked vectors) that calls the node's train handler, which answers the
    secure post-hoc query with the client's dense reply on Flower's grid
    (``secure_sum.encode`` + ``to_grid``) as the FitRes parameters, ``num_examples = 1`` (=
    ``max_weight``: weight ratio exactly 1). ``secaggplus_mod`` masks them; the floats themselves
    never leave the node.

The encoding is the in-process simulation's (``runtime.executor = sequential | vectorized``), so a
Flower run gives its numbers bit for bit. Clients that drop out during the protocol are left out of
the sum (SecAgg+ removes their masks with the shares their neighbours hold); a stop of the protocol
(fewer than ``runtime.secagg_reconstruction_threshold`` neighbours left for some client) or fewer
survivors than ``runtime.flower_min_replies`` ends the run with a :class:`FlowerRoundError`.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.common import FitIns, Parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.common.secure_aggregation.secaggplus_constants import Key as SecAggKey
from flwr.server import ServerConfig, SimpleClientManager
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey

from hetfl.engine import secure_sum
from hetfl.flower.codec import encode_tensor

if TYPE_CHECKING:
    from hetfl.algorithms.base import Tensors

#: the federation a secure post-hoc round runs on: a ``FlowerFederation`` (:mod:`hetfl.flower.server`, which
#: imports this module; its push / poll / pull, failure records, traffic counts and quorum check are used here)
FlowerFederation = Any


class SecAggStopped(RuntimeError):
    """SecAgg+ stopped before it summed (too few neighbours left for some client); the server makes it the
    round's ``FlowerRoundError``."""

log = logging.getLogger("hetfl")

FITINS_CONFIG = "fitins.config"  # where a secure post-hoc query's header is (compat.fitins_to_recorddict)
FITINS_PARAMETERS = "fitins.parameters"
MARK = "secure-posthoc"  # in that header: this FitIns is a secure post-hoc query
MODEL_LAYOUT = "model-layout"  # JSON: [[name, dtype, stype, shape], ...] of the model's arrays, in order


# ------------------------------------------------------------------------------ server
class _SumStrategy(Strategy):
    """The smallest legacy Strategy SecAggPlusWorkflow needs: one FitIns per client's node, and the
    unmasked average kept (with the node ids it was summed over)."""

    def __init__(self, fitins: dict[int, FitIns], grid: Any) -> None:
        self.fitins = fitins
        self.grid = grid
        self.result: tuple[list[int], list[np.ndarray]] | None = None

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: Any
                      ) -> list[tuple[Any, FitIns]]:
        return [(GridClientProxy(node, self.grid, 0), ins) for node, ins in self.fitins.items()]

    def aggregate_fit(self, server_round: int, results: list, failures: list) -> tuple[None, dict]:
        nodes = [proxy.node_id for proxy, _ in results]
        average = parameters_to_ndarrays(results[0][1].parameters) if results else []
        self.result = (nodes, average)
        return None, {}

    def initialize_parameters(self, client_manager: Any) -> None:
        return None

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: Any) -> list:
        return []

    def aggregate_evaluate(self, server_round: int, results: list, failures: list) -> tuple[None, dict]:
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters) -> None:
        return None


class _Grid:
    """The Grid SecAggPlusWorkflow talks to: the federation's push / poll / pull (its timeout, its stop
    event, its failure records and traffic counts), and a record of each stage's answers."""

    def __init__(self, fed: FlowerFederation, client_of: dict[int, int]) -> None:
        self.fed, self.client_of = fed, client_of
        self.stages: list[tuple[str, int, int]] = []  # (stage, asked, answered)

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        stage = str(messages[0].content.config_records[RECORD_KEY_CONFIGS].get(SecAggKey.STAGE, "?")) \
            if messages else "?"
        self.fed.traffic[0] += sum(_nbytes(m.content) for m in messages)
        replies, late, why = self.fed._send_and_receive(messages)
        answered = []
        for message in replies:
            client = self.client_of.get(message.metadata.src_node_id, -1)
            if message.has_error():
                self.fed.fail(client, f"secure aggregation, stage {stage}: {message.error.reason}")
                continue
            self.fed.traffic[1] += _nbytes(message.content)
            answered.append(message)
        for k in late:
            self.fed.fail(self.client_of.get(messages[k].metadata.dst_node_id, -1),
                          f"secure aggregation, stage {stage}: {why}")
        self.stages.append((stage, len(messages), len(answered)))
        return replies


def _nbytes(content: RecordDict) -> int:
    """Serialised bytes of a message's arrays and of its byte strings (SecAgg+'s keys and masked vectors)."""
    arrays = sum(len(a.data) for r in content.array_records.values() for a in r.values())
    blobs = 0
    for record in content.config_records.values():
        for value in record.values():
            items = value if isinstance(value, list) else [value]
            blobs += sum(len(v) for v in items if isinstance(v, bytes))
    return arrays + blobs


def _model_parameters(raw: Tensors) -> tuple[Parameters, str]:
    """The global model as legacy Parameters (hetfl's bit-exact arrays) and their layout (JSON)."""
    arrays = [(name, encode_tensor(t)) for name, t in raw.items()]
    layout = json.dumps([[name, a.dtype, a.stype, list(a.shape)] for name, a in arrays])
    return Parameters(tensors=[a.data for _, a in arrays], tensor_type="hetfl"), layout


def secure_posthoc(fed: FlowerFederation, step: Any, raw: Tensors, round_: int) -> secure_sum.SecureSum:
    """The sum of every client's dense reply to ``step`` under SecAgg+ (see the module's docstring)."""
    exp, rt = fed.exp, fed.exp.cfg.runtime
    fed.refresh()
    asked = [c for c in range(fed.num_clients) if c in fed.nodes and not fed.holds_other_data(c)]
    for c in range(fed.num_clients):
        if c not in fed.nodes:
            fed.fail(c, "no node holds this client's partition")
        elif fed.holds_other_data(c):  # SecAgg+'s replies carry no digest: a node found out before is not asked
            fed.fail(c, f"secure aggregation: {fed.holds_other_data(c)}")
    levels = secure_sum.quantization_range(fed.num_clients)  # fixed by the clients of the run, as in-process
    parameters, layout = _model_parameters(raw)
    index = exp.posthoc.index(step)
    fitins = {fed.nodes[c]: FitIns(parameters, {**fed.header(c, round_, step=index, levels=levels),
                                                MARK: 1, MODEL_LAYOUT: layout}) for c in asked}
    client_of = {fed.nodes[c]: c for c in asked}
    grid = _Grid(fed, client_of)
    strategy = _SumStrategy(fitins, fed.grid)
    context = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                            config=ServerConfig(num_rounds=1), strategy=strategy,
                            client_manager=SimpleClientManager())
    context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: round_})
    workflow = SecAggPlusWorkflow(rt.secagg_num_shares, rt.secagg_reconstruction_threshold, max_weight=1.0,
                                  clipping_range=secure_sum.CLIPPING_RANGE, quantization_range=levels,
                                  modulus_range=secure_sum.MODULUS_RANGE, timeout=fed.timeout)
    phase = f"post-hoc {step.name} (secure aggregation)"
    if len(asked) >= 2:
        workflow(grid, context)  # type: ignore[arg-type]
    if strategy.result is None:
        stages = "; ".join(f"stage {s}: {a} of {n} answered" for s, n, a in grid.stages) or \
            f"{len(asked)} client(s) reachable, SecAgg+ needs at least 2"
        reasons = "; ".join(f"client {c}: {r}" for c, r in sorted(fed.failed.items())[:5])
        raise SecAggStopped(
            f"round {round_}, {phase}: SecAgg+ stopped ({stages}); every client must keep "
            f"runtime.secagg_reconstruction_threshold = {rt.secagg_reconstruction_threshold} of its "
            f"min(runtime.secagg_num_shares = {rt.secagg_num_shares}, {len(asked)}) neighbours"
            + (f" ({reasons})" if reasons else ""))
    nodes, average = strategy.result
    survivors = sorted(client_of[n] for n in nodes)
    for c in asked:
        if c not in survivors and c not in fed.failed:
            fed.fail(c, f"{phase}: its masked vector was not summed")
    names = sorted(step.reply_bounds())
    sums = secure_sum.from_grid_sums(secure_sum.from_grid_average(average, len(survivors), levels), names)
    total = secure_sum.decode_sum(sums.values, step.reply_bounds(), len(survivors), levels)
    received = secure_sum.SecureSum({k: v.to(exp.device) for k, v in total.items()}, tuple(survivors),
                                    clipped=sums.clipped, bytes_per_client=secure_sum.upload_bytes(sums.values))
    # the server holds the survivors' sum whether or not the quorum lets the run go on: a stop carries it, so
    # that the privacy ledger records the release (a resumed round releases again, and both count)
    fed.check_quorum(len(survivors), fed.num_clients, round_, phase, received)
    return received


# ------------------------------------------------------------------------------ node
def secure_aggregation_mod(message: Message, context: Context, call_next: Any) -> Message:
    """Flower's ``secaggplus_mod`` for SecAgg+'s messages (those with its config record); hetfl's own
    ``train`` messages go straight to the handler."""
    if RECORD_KEY_CONFIGS not in message.content.config_records:
        return call_next(message, context)
    return secaggplus_mod(message, context, call_next)


def is_query(message: Message) -> bool:
    """Whether a ``train`` message is SecAgg+'s stage 2 carrying a secure post-hoc query."""
    header = message.content.config_records.get(FITINS_CONFIG)
    return header is not None and MARK in header
