"""Where the clients' side of a round runs: the :class:`Federation` the round loop talks to.

:class:`~hetfl.engine.experiment.Experiment` runs the server's side (sampling, ``payload``,
``aggregate``, post-hoc ``apply``, global evaluation, metrics, checkpoints) and hands every
client-side phase to ``Experiment.federation``. :class:`InProcessFederation` (the default) runs
those phases in this process, with the sequential or vectorised executor; ``hetfl.flower``'s
``FlowerFederation`` sends them to Flower nodes. The engine defines the protocol and never
imports a runtime: the layer above it (:mod:`hetfl.runtimes`) picks one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from hetfl.algorithms.base import Algorithm, ServerState, Tensors
from hetfl.algorithms.posthoc import Replies
from hetfl.engine import secure_sum
from hetfl.engine.evaluate import accuracies_vectorized, accuracy_and_loss
from hetfl.engine.messages import ClientUpdate, nbytes
from hetfl.engine.schedule import lr_at
from hetfl.engine.summary import Reporter

#: the Algorithm hooks that decide which model a client is evaluated with (``client_accuracy``); a method
#: that overrides none of them is evaluated with the global model on every client. (``init_client_state``
#: and ``payload`` are called there too, but only feed these; their draws, like every draw, come from
#: hetfl.rng's keyed streams, so leaving the calls out changes no later number.)
GLOBAL_EVAL_HOOKS = ("client_model", "personalize_stages", "predictor")


class PhaseStopped(RuntimeError):
    """A phase of a round stopped the run (too few clients answered) after the server had received some replies.

    ``received``: what it received and could use (a training phase's ``ClientUpdate`` list, a post-hoc step's
    replies by client; None: nothing). ``refused``: the uploads it received but refused (a reply with another
    sample count, oversized, undecodable, from a node holding other data), by client: a SHA-256 digest of each
    upload's bytes (None: none). The engine records the differentially private releases in them in the run's
    privacy ledger before the run stops: the server has them, and the resumed round releases again. The refused
    uploads count as a release of their own only when nothing usable came (:meth:`PrivateReleases.dp_refused`);
    otherwise the release of what it used already counts one upload of every client for the attempt."""

    def __init__(self, message: str, received: Any = None, refused: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.received = received
        self.refused = refused


class Federation(Protocol):
    """The clients of an experiment, as the round loop (:meth:`Experiment.round_loop`) reaches them.

    ``clients`` is the engine's store of client states (checkpointed with the server state): a
    federation whose clients run in this process reads and updates it; one whose clients keep their
    state themselves (Flower nodes) leaves it as it is.
    """

    def start(self, run_dir: str | Path, start_round: int, info: dict[str, Any]) -> None:
        """Once per run, before the set-up round and the first round, after the checkpoint (if
        any) is loaded: ``start_round`` is its round (0 for a new run), ``info`` its ``info``
        (what :meth:`checkpoint_info` returned when it was written; empty for a new run)."""
        ...

    def setup_replies(self, server: ServerState) -> dict[int, Tensors]:
        """Before round 1 of a new run, for a method with a set-up round (FedMix, FedBR): every
        client's ``Algorithm.setup_query`` reply, by client."""
        ...

    def train(self, server: ServerState, clients: dict[int, Tensors], sampled: list[int], round_: int, lr: float,
              reporter: Reporter) -> tuple[list[ClientUpdate], int]:
        """Each round, after sampling: the ``sampled`` clients' local round (``payload``, ``begin``,
        stages, ``finish``) at learning rate ``lr``; their updates in ``sampled`` order (clients that
        did not answer left out) and the bytes sent down. ``reporter.client_done()`` once per client."""
        ...

    def posthoc_replies(self, step: Any, raw: Tensors, round_: int) -> Replies:
        """After a round's aggregation, for each post-hoc step due (CCVR): every client's
        ``step.client_query`` on the features of its data under ``raw`` (the global model without
        feature transforms), by client. Under ``runtime.secure_aggregation``, for an additive step
        (``step.additive``): only the sum of the clients' dense replies, as a
        :class:`~hetfl.engine.secure_sum.SecureSum` (the fixed-point code of
        :mod:`hetfl.engine.secure_sum`: in-process, simulated; on Flower, SecAgg+), naming the
        clients summed."""
        ...

    def client_accuracies(self, server: ServerState, clients: dict[int, Tensors], round_: int,
                          global_correct: torch.Tensor | None) -> dict[int, float]:
        """On evaluated rounds, after the global model is scored: each client's evaluated model on its
        own test split, by client (clients without test samples, or without a reply, left out).
        ``global_correct``: the global model's per-sample correctness on the global test set (None
        for a purely personalised method)."""
        ...

    def round_info(self, round_: int) -> dict[str, Any]:
        """At the end of each round, before its metrics line is written: entries to add to it."""
        ...

    def checkpoint_info(self) -> dict[str, Any]:
        """When a checkpoint is written: entries to add to its ``info`` (given back to :meth:`start`
        on resume)."""
        ...

    def committed(self, round_: int) -> None:
        """After the checkpoint of ``round_`` is written: a resume starts after this round."""
        ...


def evaluates_with_global_model(algo: Algorithm) -> bool:
    """Whether every client of ``algo`` is evaluated with the global model itself: a method with one
    global model that keeps the base class's evaluation hooks (:data:`GLOBAL_EVAL_HOOKS`), whose
    per-client accuracies then follow from the global model's correctness on the global test set."""
    return not algo.personalized and all(getattr(type(algo), hook) is getattr(Algorithm, hook)
                                         for hook in GLOBAL_EVAL_HOOKS)


class ClientSide(Protocol):
    """What :class:`InProcessFederation` reaches of its experiment: the data, the method, the model caller and
    the client-side steps (an :class:`~hetfl.engine.experiment.Experiment`, which imports this module)."""

    cfg: Any
    data: Any
    algorithm: Algorithm
    caller: Any
    vmap_clients: int
    run_dir: Path | None

    def client_context(self, *args: Any, **kwargs: Any) -> Any: ...

    def train_clients(self, *args: Any, **kwargs: Any) -> Any: ...

    def save_client_models(self, *args: Any, **kwargs: Any) -> Any: ...

    def client_features(self, *args: Any, **kwargs: Any) -> Any: ...

    def client_accuracy(self, *args: Any, **kwargs: Any) -> Any: ...


class InProcessFederation:
    """The clients in this process: the sequential and vectorised executors (``runtime.executor``)."""

    def __init__(self, exp: ClientSide) -> None:
        self.exp = exp

    def start(self, run_dir: str | Path, start_round: int, info: dict[str, Any]) -> None:
        pass

    def setup_replies(self, server: ServerState) -> dict[int, Tensors]:
        exp = self.exp
        replies = {}
        for c in range(exp.data.num_clients):
            ctx = exp.client_context(c, 0, lr_at(exp.cfg, 1), {}, {}, server)
            replies[c] = exp.algorithm.setup_query(ctx)
        return replies

    def train(self, server: ServerState, clients: dict[int, Tensors], sampled: list[int], round_: int, lr: float,
              reporter: Reporter) -> tuple[list[ClientUpdate], int]:
        """The client side of a round for the ``sampled`` clients (``begin``, stages, ``finish``;
        ``clients`` updated in place): their updates in ``sampled`` order, and the bytes sent down."""
        exp = self.exp
        cfg, algo = exp.cfg, exp.algorithm
        bytes_down = 0
        ctxs = []
        for c in sampled:
            state_c = clients.get(c)
            if state_c is None:
                state_c = algo.init_client_state(c, server)
            payload = algo.payload(server, c)
            bytes_down += nbytes(payload)
            ctxs.append(exp.client_context(c, round_, lr, payload, state_c, server))
        results = exp.train_clients(ctxs, reporter)
        if round_ in cfg.runtime.save_client_models and exp.run_dir is not None:
            exp.save_client_models(round_, ctxs, results)
        updates = []
        for ctx, result in zip(ctxs, results, strict=True):
            c = ctx.client_id
            upload, new_state = algo.finish(ctx, result.state, result.steps)
            if new_state:
                clients[c] = new_state
            updates.append(ClientUpdate(c, upload, exp.data.client_sizes[c], result.steps, result.loss_sum,
                                        result.metric_sums))
        return updates, bytes_down

    def posthoc_replies(self, step: Any, raw: Tensors, round_: int) -> Replies:
        """Every client's reply, by client; under secure aggregation (additive steps) their exact
        fixed-point sum (:func:`hetfl.engine.secure_sum.simulate`: the numbers Flower's SecAgg+ gives)."""
        exp = self.exp
        replies = {}
        for c in range(exp.data.num_clients):
            feats, labels = exp.client_features(raw, c)
            replies[c] = step.client_query(raw, feats, labels, client=c, round_=round_)
        if exp.cfg.runtime.secure_aggregation and step.additive:
            return secure_sum.simulate(step, replies, secure_sum.quantization_range(exp.data.num_clients))
        return replies

    def client_accuracies(self, server: ServerState, clients: dict[int, Tensors], round_: int,
                          global_correct: torch.Tensor | None) -> dict[int, float]:
        """Each client's evaluated model on its own test split (clients without test samples left out).
        A method evaluated with the global model everywhere (:func:`evaluates_with_global_model`) gets all
        clients' accuracies at once from the global model's per-sample correctness: no per-client work."""
        exp = self.exp
        data, bs = exp.data, exp.cfg.train.eval_batch_size
        if global_correct is not None and not data.transformed and evaluates_with_global_model(exp.algorithm):
            return data.client_test_accuracies(global_correct)
        accs: dict[int, float] = {}
        own_models: dict[int, Tensors] = {}  # plain personalised models: evaluated together when vectorised
        for c in range(data.num_clients):
            state_c = clients.get(c) or exp.algorithm.init_client_state(c, server)
            acc, deferred = exp.client_accuracy(c, server, state_c, round_, global_correct, defer=exp.vmap_clients)
            if deferred is not None:
                own_models[c] = deferred
            elif acc is not None:
                accs[c] = acc
        if own_models:
            order = list(own_models)
            batched = accuracies_vectorized(exp.caller, [own_models[c] for c in order],
                                            [data.client_tests[c].x for c in order],
                                            [data.client_tests[c].y for c in order], data, bs)
            for i, c in enumerate(order):
                test = data.client_tests[c]
                accs[c] = batched[i] if batched is not None else accuracy_and_loss(
                    exp.caller, own_models[c], test.x, test.y, data, bs)[1]
        return accs

    def round_info(self, round_: int) -> dict[str, Any]:
        return {}

    def checkpoint_info(self) -> dict[str, Any]:
        return {}

    def committed(self, round_: int) -> None:
        pass
