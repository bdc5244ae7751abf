"""FedBR set-ups for the tests: the algorithm on tiny_setup's four clients, their data, contexts and set-up round."""

from __future__ import annotations

import torch

from hetfl.algorithms import build_algorithm
from hetfl.algorithms import fedbr as fedbr_module
from hetfl.algorithms.base import SHARED, Batch, ClientContext, ServerState
from tests.helpers import initial_state, tiny_setup

SIZES = (10, 6, 3, 8)  # samples of the four clients of tiny_setup in these tests


def make(setup=None, **params):
    setup = setup or tiny_setup(batch_size=4)
    algo = build_algorithm("fedbr", params, setup)
    server = algo.init_server(initial_state(setup))
    return setup, algo, server


def data_batch(n: int = 4, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    return Batch(torch.randn(n, 4, generator=gen), torch.randint(0, 3, (n,), generator=gen))


def client_data() -> list[Batch]:
    return [data_batch(n, seed=10 + c) for c, n in enumerate(SIZES)]


def client_context(c: int, server: ServerState, algo, round_: int = 1, data: list[Batch] | None = None):
    """What the engine gives client ``c`` (as Experiment.client_context): payload, shared data, inputs."""
    data = data or client_data()
    shared = {k[len(SHARED):]: v for k, v in server.extra.items() if k.startswith(SHARED)}
    ctx = ClientContext(c, round_, len(data[c].y), 0.1, algo.payload(server, c), {}, shared=shared)
    ctx.inputs = lambda: data[c]
    return ctx


def set_up(algo, server: ServerState, data: list[Batch] | None = None) -> tuple[ServerState, dict]:
    """The set-up round over every client, as Experiment.setup_round."""
    replies = {c: algo.setup_query(client_context(c, server, algo, 0, data)) for c in range(len(SIZES))}
    return algo.setup_aggregate(server, replies), replies


def sized_setup(**train):
    setup = tiny_setup(batch_size=4, **train)
    setup.client_sizes = list(SIZES)
    return setup


def ready(params=None, client: int = 0, round_: int = 1):
    """An algorithm after its set-up round and client ``client``'s context with ``begin``'s extras."""
    setup, algo, server = make(sized_setup(), **(params or {}))
    server, _ = set_up(algo, server)
    ctx = client_context(client, server, algo, round_)
    ctx.extras = algo.begin(ctx)
    return setup, algo, server, ctx


def fake_proxy(monkeypatch):
    proxy = torch.randn(30, 4, generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(fedbr_module, "load_proxy", lambda hp, seed, cache_dir="": (proxy, lambda raw: 2 * raw))
    return proxy
