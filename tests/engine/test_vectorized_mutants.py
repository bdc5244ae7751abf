"""Paths of the vectorised executor that its mutation run (``benchmarks/mutation.py``'s ``engine_vectorized``,
session 39) found untested: each test below failed on mutants that every other test of the executor let pass.

* **Buffers kept across rounds** (the CUDA-graph path's cache; ``static`` steps here): a later round loads its own
  values into the group's kept buffers (:meth:`hetfl.engine.vectorized.GroupBuffers.load`). Every earlier test of
  it started each round from the initial server, so all clients started equal and a load that gave every client
  client 0's start, or that failed for a group of one client, went unseen.
* **Per-client convolutions on channels-last batches** (``runtime.conv_batching = "per_client"``): the layout each
  client's convolutions read.
* **Clients of two structures in one round** (FedFomo's sampled round): two groups, and the log says so.
* **Device memory**: what fits sizes the groups (and is said), and running out frees what the cache kept.
* **A client training alone** (:meth:`~hetfl.engine.vectorized.VectorizedGroup.single_client_gradients`, the
  sequential step on its row): its gradient clipping, and a client state that every client shares (kept once,
  read as it is).
"""

from __future__ import annotations

import pytest
import torch

from hetfl import config
from hetfl.algorithms.base import Batch
from hetfl.engine import vectorized
from hetfl.engine.experiment import Experiment
from hetfl.engine.local import step_gradients, train_client
from hetfl.engine.summary import Reporter
from hetfl.engine.vectorized import (
    ClientPlan,
    GroupBuffers,
    VectorizedCache,
    VectorizedGroup,
    client_channels_last,
    train_clients_vectorized,
)
from tests.helpers import MNIST, needs_shared_data
from tests.helpers.executors import ATOL, SYNTHETIC, compare_one_round, round_contexts

# eight Synthetic(1, 1) devices, capped at 300 samples: clients that finish early, short batches,
# a client that trains alone at the end, in a tenth of the 30 devices' time
FEW = [*SYNTHETIC, "data.num_clients=8", "data.options={max_samples = 300, num_devices = 8}",
       "train.local_epochs=1", "train.momentum=0.5"]


def assert_same_clients(seq, vec, what: str) -> None:
    assert [a.steps for a in seq] == [b.steps for b in vec], what
    for a, b in zip(seq, vec, strict=True):
        assert a.loss_sum == pytest.approx(b.loss_sum, rel=1e-4, abs=1e-5), what
        assert a.metric_sums.keys() == b.metric_sums.keys(), what  # no metric lost, none made up
        for key, value in a.metric_sums.items():
            assert value == pytest.approx(b.metric_sums[key], rel=1e-4, abs=1e-5), f"{what}: {key}"
        for name in a.state:
            diff = (a.state[name].double() - b.state[name].double()).abs().max().item()
            assert diff <= ATOL, f"{what}: {name} differs by {diff}"


def rounds_with_kept_buffers(monkeypatch, overrides: list[str], rounds: int, chunk_size: int = 0) -> list[int]:
    """``rounds`` rounds of a run (each advanced by the engine's own round, so that later rounds start from their
    clients' own states), whose clients are also trained vectorised in static mode with one cache kept across
    the rounds, and compared with the sequential clients; returns how many group buffers each round made."""
    exp = Experiment(config.load(None, overrides))
    server, _, _ = exp.setup_round(exp.initial_server())
    clients: dict = {}
    cache, made = VectorizedCache(), []
    init = GroupBuffers.__init__

    def counting(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        made[-1] += 1
        init(self, *args, **kwargs)

    monkeypatch.setattr(GroupBuffers, "__init__", counting)
    for round_ in range(1, rounds + 1):
        seq = [train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
               for ctx in round_contexts(exp, server, clients, round_)]
        notes: list[str] = []
        made.append(0)
        vec = train_clients_vectorized(exp.algorithm, round_contexts(exp, server, clients, round_), exp.data,
                                       seed=exp.cfg.seed, train_cfg=exp.cfg.train, chunk_size=chunk_size,
                                       step_mode="static", cache=cache, log=notes.append)
        assert not [n for n in notes if "falling back" in n], notes
        assert_same_clients(seq, vec, f"round {round_}")
        server = exp.round(server, clients, round_, Reporter())["_server"]
    return made


@pytest.mark.parametrize("method", ["fedrep", "scaffold"])
def test_kept_buffers_are_loaded_with_each_clients_own_start_and_state(monkeypatch, method):
    """FedRep: from round 2 each client starts from its own head (the clients' start states differ); SCAFFOLD:
    each client's own control variate in its state. Round 1 makes the group's buffers, rounds 2 and 3 load
    theirs into them (none made), and every round gives the sequential clients."""
    made = rounds_with_kept_buffers(monkeypatch, [*FEW, f"algorithm.name={method}"], rounds=3)
    assert made[0] > 0 and made[1:] == [0, 0], made


@pytest.mark.parametrize("method", ["fedrep", "fedmix"])
def test_kept_buffers_of_groups_of_one_client_are_loaded_too(monkeypatch, method):
    """``runtime.chunk_size = 1``: groups of one client (no second row to read), kept and loaded in round 2;
    FedMix's steps also read the data every client received once (``ctx.shared``: the clients' mean batches)."""
    three = [*FEW, "data.num_clients=3", "data.options={max_samples = 300, num_devices = 3}"]
    made = rounds_with_kept_buffers(monkeypatch, [*three, f"algorithm.name={method}"], rounds=2, chunk_size=1)
    assert made[0] > 0 and made[1] == 0, made


def test_a_client_training_alone_clips_its_gradient():
    """``train.max_grad_norm``: the steps of the largest client after the others finished (the sequential step
    on its row) clip as the vmapped steps and the sequential executor do; a bound this small clips every step."""
    exp = Experiment(config.load(None, [*FEW, "algorithm.name=fedavg", "train.max_grad_norm=0.05"]))
    compare_one_round(exp)


def test_a_client_state_every_client_shares_is_read_whole_by_a_client_training_alone():
    """A client state tensor that is one object for every client (kept once, unbatched: ``client_axes`` None) is
    read as it is by the steps of a client that trains alone, not indexed as a row: SCAFFOLD whose clients all
    hold the same control variate (random values: constant ones would hide a row taken for the whole; the run's
    own state is per client)."""
    exp = Experiment(config.load(None, [*FEW, "algorithm.name=scaffold"]))
    server, _, _ = exp.setup_round(exp.initial_server())
    shared = exp.algorithm.init_client_state(0, server)
    assert shared and all(t.dim() > 0 for t in shared.values())
    gen = torch.Generator().manual_seed(0)
    shared = {n: 0.01 * torch.randn(t.shape, generator=gen) for n, t in shared.items()}
    clients = {c: shared for c in range(exp.cfg.data.num_clients)}  # one dict, the same tensors for every client
    seq = [train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
           for ctx in round_contexts(exp, server, clients, 2)]
    notes: list[str] = []
    vec = train_clients_vectorized(exp.algorithm, round_contexts(exp, server, clients, 2), exp.data,
                                   seed=exp.cfg.seed, train_cfg=exp.cfg.train, log=notes.append)
    assert not [n for n in notes if "falling back" in n], notes
    assert_same_clients(seq, vec, "shared client state")


def test_the_per_client_channels_last_copy_is_each_clients_nhwc_layout():
    """``client_channels_last``: the same values, each client's ``[batch, C, H, W]`` one channels-last block (what
    per-client convolutions read), the clients one after another."""
    x = torch.randn(4, 5, 3, 8, 8)  # clients, batch, C, H, W
    y = client_channels_last(x)
    assert torch.equal(x, y) and y.shape == x.shape
    assert all(y[i].is_contiguous(memory_format=torch.channels_last) for i in range(4))
    assert [y[i].data_ptr() - y.data_ptr() for i in range(4)] == [i * 5 * 3 * 8 * 8 * 4 for i in range(4)]


@needs_shared_data
@pytest.mark.parametrize(("batching", "layout"), [("per_client", "client_channels_last"),
                                                  ("grouped", "channels_last_for_vmap")])
def test_channels_last_batches_are_laid_out_for_the_convolutions_batching(monkeypatch, batching, layout):
    """``runtime.channels_last`` with either ``runtime.conv_batching``: the steps lay the batch out for the way
    the clients' convolutions are batched (each client's batch one channels-last block for per-client
    convolutions, :func:`client_channels_last`; the grouped convolution's folded NHWC view,
    :func:`channels_last_for_vmap`), and the clients equal those trained on NCHW batches to float rounding."""
    calls: dict[str, int] = {"client_channels_last": 0, "channels_last_for_vmap": 0}

    def counted(name: str):  # type: ignore[no-untyped-def]
        real = getattr(vectorized, name)

        def recorded(x: torch.Tensor) -> torch.Tensor:
            calls[name] += 1
            return real(x)

        return recorded

    for name in calls:
        monkeypatch.setattr(vectorized, name, counted(name))
    exp = Experiment(config.load(None, [
        "data.dataset=mnist", f"data.root={MNIST}", "data.download=false", "data.partition=dominant",
        "data.samples_per_client=32", "data.num_clients=2", "model.name=cnn2", "train.batch_size=16",
        "train.local_steps=2", "train.lr=0.01", "train.momentum=0.9", "runtime.progress=false",
        "algorithm.name=fedavg", "runtime.device=cpu",
    ]))
    server = exp.initial_server()
    runs = [train_clients_vectorized(exp.algorithm, round_contexts(exp, server, {}, 1), exp.data, seed=0,
                                     train_cfg=exp.cfg.train, channels_last=channels_last, conv_batching=batching)
            for channels_last in (False, True)]
    assert calls == {name: 2 if name == layout else 0 for name in calls}  # a call a step, both clients in it
    for a, b in zip(*runs, strict=True):
        for name in a.state:
            diff = (a.state[name].double() - b.state[name].double()).abs().max().item()
            assert diff <= ATOL, f"{name} differs by {diff}"


@needs_shared_data
def test_a_lone_clients_step_is_the_sequential_step_with_the_runs_settings():
    """The step of one row of a group of several (:meth:`VectorizedGroup.single_client_gradients`, the path of a
    client training alone) gives the sequential executor's step of that client under the run's settings: its
    gradients clipped to ``train.max_grad_norm``, the BatchNorm running statistics it updates, bf16 autocast.
    (A round whose clients all hold the same number of samples never takes this path: tested directly.)"""
    exp = Experiment(config.load(None, [
        "data.dataset=mnist", f"data.root={MNIST}", "data.download=false", "data.partition=dominant",
        "data.samples_per_client=16", "data.num_clients=2", "model.name=feduv_cnn", "model.options={out_dim = 16}",
        "train.batch_size=8", "train.max_grad_norm=0.01", "train.precision=bf16", "runtime.progress=false",
        "algorithm.name=fedavg", "runtime.device=cpu",
    ]))
    algorithm = exp.algorithm
    plans = [ClientPlan.of(algorithm, ctx) for ctx in round_contexts(exp, exp.initial_server(), {}, 1)]
    running = algorithm.running_buffers()
    assert running  # BatchNorm's statistics
    group = VectorizedGroup(plans, exp.data, seed=0, batch_size=8, drop_last=False, max_grad_norm=0.01,
                            buffers=running, precision="bf16", low_names=algorithm.model.low_precision_names)
    b = group.buffers
    assert b.low  # the weights' bfloat16 copies a bf16 step reads

    def first_row(tensors, dims=None):
        return {n: t if dims is not None and dims[n] is None else t[:1] for n, t in tensors.items()}

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(1, 8, 1, 28, 28, generator=gen), torch.randint(0, 10, (1, 8), generator=gen)
    stage = plans[0].stages[0]
    grads, new_buffers, loss, _ = group.vmapped_gradients(
        stage, first_row(b.state), Batch(x, y, {}), first_row(b.payload, b.payload_dims),
        first_row(b.cstate, b.cstate_dims), first_row(b.extras, b.extras_dims), first_row(b.low))
    want_grads, want_buffers, want_loss, _ = step_gradients(
        stage, {n: t.clone() for n, t in plans[0].start.items()}, Batch(x[0], y[0], {}), plans[0].ctx, 0.01,
        buffers=running, precision="bf16")
    assert want_buffers  # the running statistics the step updated
    assert torch.equal(loss[0], want_loss)
    for got, want in ((grads, want_grads), (new_buffers, want_buffers)):
        assert set(got) == set(want)
        for name in want:
            assert torch.equal(got[name][0], want[name]), name


def test_clients_of_two_structures_train_as_two_groups_and_the_log_says_so():
    """A sampled round of FedFomo mixes clients of two tensor structures (those that trained before hold the
    models they downloaded); they train as two vectorised groups, each giving the sequential clients, and the
    log names the number of groups."""
    exp = Experiment(config.load(None, [*FEW, "algorithm.name=fedfomo", "train.clients_per_round=4"]))
    notes: list[str] = []
    compare_one_round(exp, notes=notes)
    assert [n for n in notes if "client groups" in n] == [
        "vectorized: 2 client groups with different stage structures or tensor shapes"], notes


@pytest.mark.parametrize(("fit", "said"), [(3, True), (8, False)])
def test_what_fits_in_device_memory_sizes_the_groups_and_is_said_when_it_splits_them(monkeypatch, fit, said):
    """The number of clients that fit in the free device memory (the probe's answer, CUDA only: stood in for
    here) sizes the groups, is kept by group structure for later rounds, and is said once where it splits
    the round's clients (8 here), not where all of them fit."""
    monkeypatch.setattr(vectorized, "clients_that_fit", lambda *args, **kwargs: fit)
    sizes: list[int] = []
    real_run = VectorizedGroup.run

    def recorded(self):  # type: ignore[no-untyped-def]
        sizes.append(len(self.plans))
        return real_run(self)

    monkeypatch.setattr(VectorizedGroup, "run", recorded)
    exp = Experiment(config.load(None, [*FEW, "algorithm.name=fedavg"]))
    notes: list[str] = []
    memo: dict = {}
    vec = train_clients_vectorized(exp.algorithm, round_contexts(exp, exp.initial_server(), {}, 1), exp.data,
                                   seed=exp.cfg.seed, train_cfg=exp.cfg.train, log=notes.append, memo=memo)
    seq = [train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
           for ctx in round_contexts(exp, exp.initial_server(), {}, 1)]
    assert_same_clients(seq, vec, f"{fit} at once")
    assert sizes == ([3, 3, 2] if said else [8]) and list(memo.values()) == [fit]
    assert notes == (["vectorized: 3 of 8 clients at once fit in the free device memory"] if said else [])


def test_running_out_of_memory_drops_what_the_cache_kept_for_that_group_size(monkeypatch):
    """A chunk that runs out of device memory frees the buffers (and compiled calls) the cache kept for groups
    of its size before a smaller one is tried; the clients are the sequential ones."""
    real_run = VectorizedGroup.run

    def run_fitting_four(self):  # type: ignore[no-untyped-def]
        if len(self.plans) > 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_run(self)

    monkeypatch.setattr(VectorizedGroup, "run", run_fitting_four)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    exp = Experiment(config.load(None, [*FEW, "algorithm.name=fedavg"]))
    cache = VectorizedCache()
    notes: list[str] = []
    vec = train_clients_vectorized(exp.algorithm, round_contexts(exp, exp.initial_server(), {}, 1), exp.data,
                                   seed=exp.cfg.seed, train_cfg=exp.cfg.train, step_mode="static", cache=cache,
                                   log=notes.append)
    seq = [train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
           for ctx in round_contexts(exp, exp.initial_server(), {}, 1)]
    assert_same_clients(seq, vec, "after running out of memory")
    assert notes == ["vectorized: 8 clients at once ran out of device memory; now 4 at once (set runtime.chunk_size "
                     "to choose)"]
    assert sorted(key[1] for key in cache.buffers) == [4]  # the 8 clients' buffers dropped; the two 4s share one
    assert all(key[0][1] == 4 for key in cache.programs)


def test_a_single_client_that_does_not_fit_raises_after_halving_down_to_one(monkeypatch):
    """Chunks are halved down to one client; one client that still runs out of device memory raises the error
    (nothing smaller to try) rather than trying again."""
    sizes: list[int] = []

    def never_fits(self):  # type: ignore[no-untyped-def]
        sizes.append(len(self.plans))
        if len(sizes) > 10:
            raise AssertionError(f"still trying: {sizes}")
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(VectorizedGroup, "run", never_fits)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    exp = Experiment(config.load(None, [*FEW, "algorithm.name=fedavg"]))
    with pytest.raises(torch.cuda.OutOfMemoryError, match="simulated"):
        train_clients_vectorized(exp.algorithm, round_contexts(exp, exp.initial_server(), {}, 1), exp.data,
                                 seed=exp.cfg.seed, train_cfg=exp.cfg.train)
    assert sizes == [8, 4, 2, 1]


def test_the_global_model_every_client_receives_is_kept_once_and_the_clients_own_states_as_rows():
    """``client_axes``: a payload tensor that is one object for every client (FedProx's global model) is kept
    once, unbatched; tensors the clients hold each their own (SCAFFOLD's control variates, one per client)
    get a row per client, plus the scratch row."""
    exp = Experiment(config.load(None, [*FEW, "algorithm.name=scaffold"]))
    server, _, _ = exp.setup_round(exp.initial_server())
    ctxs = round_contexts(exp, server, {}, 1)
    plans = [ClientPlan.of(exp.algorithm, ctx) for ctx in ctxs]
    buffers = GroupBuffers(plans, exp.data.device)
    assert buffers.payload_dims and set(buffers.payload_dims.values()) == {None}
    for name, t in buffers.payload.items():
        assert t.shape == ctxs[0].payload[name].shape, name
    assert buffers.cstate_dims and set(buffers.cstate_dims.values()) == {0}
    for name, t in buffers.cstate.items():
        assert t.shape == (len(ctxs) + 1, *ctxs[0].state[name].shape), name


def test_a_compile_error_without_a_message_is_reported_by_its_type(monkeypatch):
    """A step that ``torch.compile`` refuses with an exception whose message is empty runs uncompiled, and the
    note names the error's type (the first line of an empty message is not asked for)."""
    def refuses(*args):  # type: ignore[no-untyped-def]
        raise NotImplementedError()

    monkeypatch.setattr(vectorized, "run_compiled", refuses)
    exp = Experiment(config.load(None, [*FEW, "train.local_steps=2", "runtime.compile=true",
                                        "algorithm.name=fedavg"]))
    notes: list[str] = []
    compare_one_round(exp, notes=notes)
    assert [n for n in notes if "could not compile" in n] == [
        "vectorized: torch.compile could not compile stage 'local'; running it uncompiled: NotImplementedError: "]


@pytest.mark.parametrize(("method", "kinds"), [
    ("scaffold", {"payload", "cstate"}), ("fedmix", {"payload", "shared"}), ("fedbr", {"payload", "extras", "shared"}),
    ("moon", {"payload", "extras"})])
def test_a_groups_buffers_are_all_on_the_training_device(method, kinds):
    """Everything a group's steps read and write (issue 29: a step copies nothing from the host) is on the
    training device: the stacked states and their bf16 copies, the payload, client states and extras (those every
    client shares, kept once, too: the global model, MOON's previous model), the data sent once (FedMix's means,
    FedBR's pseudo-data), the optimiser's momentum (FedBR's max step's too), the rates and the sums. On the
    ``meta`` device, from contexts made on the CPU: a tensor left where it was made shows without a GPU."""
    exp = Experiment(config.load(None, [*FEW, f"algorithm.name={method}", "train.momentum=0.9"]))
    server, _, _ = exp.setup_round(exp.initial_server())
    plans = [ClientPlan.of(exp.algorithm, ctx) for ctx in round_contexts(exp, server, {}, 1)]
    meta = torch.device("meta")
    buffers = GroupBuffers(plans, meta, low_names=tuple(exp.algorithm.model.low_precision_names))
    held = {kind: getattr(buffers, kind) for kind in ("state", "low", "payload", "cstate", "extras", "shared", "sums")}
    held |= {f"opt{i}": d for i, d in enumerate(buffers.opt + buffers.adv_opt)}
    held["rates"] = dict(enumerate(buffers.lr + buffers.adv_lr))
    assert {kind for kind in ("payload", "cstate", "extras", "shared") if held[kind]} == kinds
    assert held["state"] and held["low"] and held["opt0"] and held["sums"]
    assert method != "fedbr" or held[f"opt{len(buffers.opt)}"]  # the max step's momentum
    assert {f"{kind}.{name}": t.device for kind, d in held.items() for name, t in d.items()} == {
        f"{kind}.{name}": meta for kind, d in held.items() for name in d}
