"""Comparing the vectorized executor with the sequential one over a round (used by the executor
tests and by the tests of methods with their own local training)."""

from __future__ import annotations

import pytest

from hetfl import config
from hetfl.engine.experiment import Experiment
from hetfl.engine.local import train_client
from hetfl.engine.schedule import lr_at
from hetfl.engine.summary import Reporter
from hetfl.engine.vectorized import VectorizedGroup, train_clients_vectorized

ATOL = 1e-4


# Synthetic(1, 1)'s 30 devices have very different sizes (42 to 1,000 training samples with the cap
# below, which shortens the largest device's 4,000 to the next one's size): short last batches and
# clients that finish early, so every path of the vectorised executor's plan is exercised.
SYNTHETIC = ["data.num_clients=30", "data.options={max_samples = 1250}", "train.local_epochs=2",
             "train.batch_size=16", "runtime.progress=false", "model.options={hidden = [32]}"]
# SYNTHETIC's devices capped at 300 samples (52 to 300, four at the cap; about 240 to train on): the same
# paths of the plan (blocks, short last batches, clients that finish early) in a quarter of the steps of
# the largest client (126 in two epochs at 1,250): for the tests that need those paths, not long clients.
CAPPED = "data.options={max_samples = 300}"


def round_contexts(exp: Experiment, server, clients, round_: int):
    algo = exp.algorithm
    ctxs = []
    for c in exp.sample_clients(round_):
        state = clients.get(c) or algo.init_client_state(c, server)
        ctxs.append(exp.client_context(c, round_, lr_at(exp.cfg, round_), algo.payload(server, c), state, server))
    return ctxs


def train_moon_with_nothing_declared_read(monkeypatch, settings: list[str]):
    """One vectorised round of MOON, whose step reads the payload (the global model's features), with its
    ``step_reads`` declared empty: the set-up of the tests that the read is refused by name."""
    exp = Experiment(config.load(None, [*settings, "algorithm.name=moon", "train.local_steps=2"]))
    monkeypatch.setattr(type(exp.algorithm), "step_reads", frozenset())
    return train_clients_vectorized(exp.algorithm, round_contexts(exp, exp.initial_server(), {}, 1)[:3], exp.data,
                                    seed=exp.cfg.seed, train_cfg=exp.cfg.train)


def compare_one_round(exp: Experiment, rounds_before: int = 1, chunk_size: int = 0,
                      step_mode: str | tuple[str, ...] = "eager", notes: list[str] | None = None,
                      history: Experiment | None = None) -> None:
    """Train round ``rounds_before + 1``'s clients both ways from the same state and compare; with
    several ``step_mode`` s, each vectorised run is compared with the one sequential run.

    ``history``: the experiment whose rounds make the state compared from (``exp`` by default). One of
    the same method and data with shorter local training leaves the same kinds of state (control
    variates, previous models, personal heads, server momentum) in a fraction of the time: a resumed
    run starts another ``Experiment`` from the server and client state alone, and gives the
    uninterrupted run's numbers (tests/engine/test_engine.py::test_every_method_resumes_to_the_bit)."""
    past = exp if history is None else history
    server, _, _ = past.setup_round(past.initial_server())
    clients: dict = {}
    for r in range(1, rounds_before + 1):  # a round of history: client state, server momentum...
        line = past.round(server, clients, r, Reporter())
        server = line["_server"]
    round_ = rounds_before + 1
    seq = [train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
           for ctx in round_contexts(exp, server, clients, round_)]
    notes = [] if notes is None else notes
    for mode in (step_mode,) if isinstance(step_mode, str) else step_mode:
        vec = train_clients_vectorized(exp.algorithm, round_contexts(exp, server, clients, round_), exp.data,
                                       seed=exp.cfg.seed, train_cfg=exp.cfg.train, chunk_size=chunk_size,
                                       step_mode=mode, log=notes.append,
                                       conv_batching=exp.cfg.runtime.conv_batching,
                                       compile_steps=exp.cfg.runtime.compile)
        assert not [n for n in notes if "falling back" in n], notes
        assert len(seq) == len(vec)
        for a, b in zip(seq, vec, strict=True):
            assert a.steps == b.steps
            assert a.loss_sum == pytest.approx(b.loss_sum, rel=1e-4, abs=1e-5)
            assert set(a.state) == set(b.state)
            for name in a.state:
                diff = (a.state[name].double() - b.state[name].double()).abs().max().item()
                assert diff <= ATOL, f"{exp.cfg.algorithm.name} ({mode}): {name} differs by {diff}"


# Local games whose trajectories separate: a difference in the last bit grows by
# orders of magnitude within tens of steps (FedBR's min-max game; FedDecorr's
# standardisation by near-zero variances of dead ReLU features). Run in float64,
# both executors still agree to 1e-8 (FedBR) and 1e-11 (FedDecorr) after 50 steps,
# but in float32 the two-epoch round (up to 500 steps) ends 1e-3 to 1e-1 apart,
# by CPU (AVX2 vs AVX-512 kernels). They are compared over 10 steps, where float32
# rounding is still 2e-7.
CHAOTIC_LOCAL_TRAINING = {"fedbr", "feddecorr"}
# pFedMe takes 5 inner steps per step (20 s for the two-epoch round on 2 cores): compared over 10 steps
# too, of 2 inner steps (the same loop, its second pass starting from the first's solution: 3 s less), at
# a personal lr of 0.01: with 2 inner steps at the default 0.1 (lam 15) the personal models diverge on
# these synthetic devices (4e6 after two rounds, where a last-bit change of the start moves them by 2.5;
# with the default 5 inner steps they do not), so the two executors agreed on the CPU only because their
# kernels were the same; on an H200 they ended 0.5 apart (session 45). At 0.01 the weights stay below 0.5
# and a last-bit change moves them by 9e-8.
SHORT_LOCAL_TRAINING = CHAOTIC_LOCAL_TRAINING | {"pfedme"}
METHOD_TRAINING = {"pfedme": ["algorithm.inner_steps=2", "algorithm.personal_lr=0.01"]}
# compared over one step on CUDA, where rounding moves a hidden unit across its ReLU's kink (below)
KINKED_ON_CUDA = {"dann"}


def local_training(method: str) -> list[str]:
    """The overrides a method's executor comparison trains with: 10 local steps for the methods above
    (pFedMe: of 2 inner steps)."""
    return (["train.local_steps=10"] if method in SHORT_LOCAL_TRAINING else []) + METHOD_TRAINING.get(method, [])


def local_training_on_cuda(method: str) -> list[str]:
    """The same on a GPU, where a vmapped step's kernels are not the sequential step's (a batched
    matrix product for a plain one, a grouped convolution for an ordinary one) and round differently:
    a chaotic method is compared over one step there. Measured: FedDecorr's 10 steps ended 1.1e-3
    apart on an H100; on a CPU, one changed rounding (``F.linear`` computed in float64, then rounded)
    moves FedDecorr's weights by 1.3e-7 after 1 step, 1.3e-4 after 2 and 3.5e-3 after 10 (DANN's and
    FedAvg's by 6e-8 after their round). One step still compares the vmapped loss's gradients.

    DANN too (``KINKED_ON_CUDA``): its round ended 2.2e-4 apart on an H100 and an H200 (sessions 17, 45), in
    one hidden unit of its 256-wide domain head. On the CPU, noise of 3e-6 (relative) at its ReLUs' inputs
    moves that round by 2.2e-4 in one unit too (noise of 1e-6: by 1e-7): a client of 3 steps has
    a pre-activation of 4.8e-7 at its second step, which the noise (or CUDA's rounding) moves across the
    kink; the unit's gradient then flows, or does not, for one sample (lr x gradient: 2e-4). Not a
    vectorisation error: a round of a wide ReLU network is only as reproducible as its smallest margin
    (``benchmarks/kink_sensitivity.py``)."""
    return ["train.local_steps=1"] if method in CHAOTIC_LOCAL_TRAINING | KINKED_ON_CUDA else local_training(method)



# One method per way of training locally, compared by the quick subset (-m "not slow"); the
# every-method comparisons run the others too, marked slow (the whole suite, as CI runs it, has them
# all): plain SGD, a loss reading the payload (FedProx), a gradient transform and client state
# (SCAFFOLD), extra models (MOON), a regulariser (FedUV), several stages and extras (FedPAC, FedRep),
# an adversary (FedBR), per-step draws (Mixup), data shared once (FedMix), a step reading the round
# (DANN), a personal stage (Ditto). (pFedMe's inner steps take 20 s here: slow.)
FAMILIES = ("fedavg", "fedprox", "scaffold", "moon", "feduv", "fedpac", "fedrep", "fedbr", "mixup", "fedmix",
            "dann", "ditto")


def methods_by_family(quick: tuple[str, ...] = FAMILIES) -> list:
    """Every method as a test parameter, those outside ``quick`` marked slow."""
    from hetfl.algorithms import available

    return [m if m in quick else pytest.param(m, marks=pytest.mark.slow) for m in available()]


def graph_groups_on_the_cpu(monkeypatch) -> None:
    """Vectorised groups asked for graph mode run it on the CPU: built in ``static`` mode (graph mode refuses a CPU
    device), then switched to ``graph``, so that their calls take the capture path (the capture itself stood in
    for by the test)."""
    real_init = VectorizedGroup.__init__

    def init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        real_init(self, *args, **{**kwargs, "step_mode": "static"})
        self.step_mode = "graph"

    monkeypatch.setattr(VectorizedGroup, "__init__", init)

