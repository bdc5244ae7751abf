"""``runtime.compile``: the vectorised step's gradients by ``torch.compile`` give the sequential clients.

What hetfl adds to ``torch.compile`` (the step as one traceable function, its context, the guards on the
round's values, compiling before a capture, the fallback) is traced here with the "aot_eager" backend
(Dynamo and AOTAutograd, no generated code). Inductor's generated kernels take 10-20 s of C++
compiles per step shape on two cores: one test runs them, on request (``HETFL_TEST_INDUCTOR=1``, set
by ``benchmarks/gpu_check.sh``; on a CPU it needs a C++ compiler).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from hetfl import config
from hetfl.algorithms.base import ClientContext
from hetfl.engine import compiled_step, vectorized
from hetfl.engine.compiled_step import StepContext
from hetfl.engine.experiment import Experiment
from hetfl.engine.local import train_client
from tests.helpers import MNIST, needs_shared_data
from tests.helpers.executors import CAPPED, SYNTHETIC, compare_one_round, round_contexts

needs_cpp_compiler = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                                        reason="Inductor compiles the CPU kernels with a C++ compiler")
# Inductor's own code generation: 13 s of C++ compiles on two cores with a cold cache, a twentieth of the
# whole suite's time budget, for what PyTorch tests itself; benchmarks/gpu_check.sh runs it (set there)
inductor_on_request = pytest.mark.skipif(os.environ.get("HETFL_TEST_INDUCTOR") != "1",
                                         reason="Inductor's code generation (13 s of C++ compiles on two cores): "
                                                "HETFL_TEST_INDUCTOR=1 runs it")

# what torch.compile traces and compiles: skipped on a torch whose Dynamo cannot trace the step (runtime.compile
# then runs it uncompiled, test_a_torch_that_cannot_compile_the_step_runs_it_uncompiled_saying_why)
compiling_torch = pytest.mark.skipif(bool(compiled_step.unsupported()), reason=compiled_step.unsupported())

# Dynamo's tracing takes seconds per step shape on two cores (18 s for the file): run with the slow tests (CI's
# --run-slow), so that plain `pytest -q` stays under five minutes on two cores (session 47: 322 s before)
pytestmark = [pytest.mark.slow, pytest.mark.engine_slow]

# 10 sampled clients, two full batches of 16 each (every client has 42 samples or more): one step shape
ONE_SHAPE = [*SYNTHETIC, "train.clients_per_round=10", "train.local_steps=2", "train.momentum=0.5",
             "runtime.compile=true"]


@pytest.fixture(autouse=True)
def traced_only(monkeypatch, request):
    """Dynamo and AOTAutograd without Inductor's code generation, except in tests marked ``inductor``."""
    if "inductor" not in request.keywords:
        monkeypatch.setattr(compiled_step, "BACKEND", "aot_eager")


@compiling_torch
@pytest.mark.parametrize(("method", "modes"), [("fedavg", ("eager", "static")), ("scaffold", ("eager",)),
                                               ("moon", ("eager",)), ("fedpac", ("eager",))])
def test_compiled_steps_give_the_sequential_clients(method, modes, compiled_calls):
    """Plain SGD, a gradient transform with client state (SCAFFOLD), extra models (MOON), per-client class
    targets picked by label (FedPAC's alignment stage, alone here: its classifier stage trains whole epochs,
    many step shapes; that stage used to fall back, a vmapped advanced index that AOTAutograd replayed as a
    view the runtime strides refused); eager steps, and the static-buffer steps a CUDA graph captures (a
    call's first run, its reference, uncompiled; the later runs of its shape compiled), against one
    sequential run."""
    alone = ["algorithm.head_epochs=0"] if method == "fedpac" else []
    exp = Experiment(config.load(None, [*ONE_SHAPE, f"algorithm.name={method}", *alone]))
    notes: list[str] = []
    compare_one_round(exp, step_mode=modes, notes=notes)
    assert not [n for n in notes if "could not compile" in n], notes
    assert compiled_calls["n"] > 0


@compiling_torch
def test_only_full_batches_are_compiled(monkeypatch):
    """A compile per step shape, and each client's short last batch of an epoch is a shape of its own
    (CCVR's Table 2 round: 19 step shapes, 9 of them one short batch): those few steps run uncompiled,
    the full batches that recur compiled, and the clients are the sequential ones (devices capped at
    300 samples: the six sampled clients still end their epoch on short batches)."""
    sizes: dict[str, set[int]] = {"compiled": set(), "uncompiled": set()}
    real_compiled, real_vmapped = vectorized.run_compiled, vectorized.vmapped_step

    def compiled(*args):  # type: ignore[no-untyped-def]
        sizes["compiled"].add(args[8].shape[1])  # y: [rows, batch size]
        return real_compiled(*args)

    def vmapped(*args):  # type: ignore[no-untyped-def]
        sizes["uncompiled"].add(args[8].shape[1])
        return real_vmapped(*args)

    real_single = vectorized.VectorizedGroup.single_client_gradients

    def single(self, stage, state, batch, *rest):  # type: ignore[no-untyped-def]
        sizes["uncompiled"].add(batch.y.shape[1])  # one row of several: the sequential step, unbatched
        return real_single(self, stage, state, batch, *rest)

    monkeypatch.setattr(vectorized, "run_compiled", compiled)
    monkeypatch.setattr(vectorized, "vmapped_step", vmapped)
    monkeypatch.setattr(vectorized.VectorizedGroup, "single_client_gradients", single)
    exp = Experiment(config.load(None, [*SYNTHETIC, CAPPED, "train.clients_per_round=6", "train.local_epochs=1",
                                        "runtime.compile=true", "algorithm.name=fedavg"]))
    notes: list[str] = []
    compare_one_round(exp, step_mode=("eager", "static"), notes=notes)
    assert not [n for n in notes if "could not compile" in n], notes
    assert sizes["compiled"] == {16}
    assert sizes["uncompiled"] - {16}, sizes  # the short batches ran, uncompiled


@compiling_torch
def test_a_compiled_step_reads_this_rounds_values(compiled_calls):
    """DANN's ramped lambda is a function of the round that the step reads through its context: the
    compiled step of round 2 (compiled again: Dynamo guards on the value) equals the sequential one,
    as does round 3's."""
    exp = Experiment(config.load(None, [*ONE_SHAPE, "algorithm.name=dann", "algorithm.schedule=ganin",
                                        "algorithm.lam=1.0", "train.rounds=10"]))
    compare_one_round(exp, rounds_before=1)
    compare_one_round(exp, rounds_before=2)
    assert compiled_calls["n"] > 0


@compiling_torch
@needs_shared_data
def test_compiled_image_steps_give_the_sequential_clients(compiled_calls):
    """A convolutional model with max pooling and crops and flips (hetfl's layers in their plain forms
    inside the compiled step)."""
    exp = Experiment(config.load(None, [
        "data.dataset=mnist", f"data.root={MNIST}", "data.download=false", "data.num_clients=20",
        "train.clients_per_round=4", "model.name=simple_cnn", "train.batch_size=8", "train.local_steps=2",
        "data.augment=crop_flip", "runtime.compile=true", "runtime.progress=false"]))
    compare_one_round(exp)
    assert compiled_calls["n"] > 0


@compiling_torch
@needs_cpp_compiler
@inductor_on_request
@pytest.mark.inductor
def test_inductors_generated_kernels_give_the_sequential_clients(compiled_calls, monkeypatch):
    """The step compiled by Inductor (C++ kernels on a CPU), not only traced: the MLP's one step shape."""
    exp = Experiment(config.load(None, [*ONE_SHAPE, "algorithm.name=fedavg"]))
    notes: list[str] = []
    compare_one_round(exp, notes=notes)
    assert not [n for n in notes if "could not compile" in n], notes
    assert compiled_calls["n"] > 0


@compiling_torch
@needs_shared_data
def test_compiled_bf16_steps_are_the_sequential_bf16_steps(compiled_calls):
    """bfloat16 autocast inside the compiled step: the sequential bf16 clients to bf16's precision (the
    compiled step casts where autocast casts plain layers, not where hetfl's batching rules cast)."""
    exp = Experiment(config.load(None, [
        "data.dataset=mnist", f"data.root={MNIST}", "data.download=false", "data.num_clients=20",
        "train.clients_per_round=4", "model.name=cnn2", "train.batch_size=8", "train.local_steps=2",
        "train.precision=bf16", "runtime.compile=true", "runtime.progress=false"]))
    server, _, _ = exp.setup_round(exp.initial_server())
    seq = [train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
           for ctx in round_contexts(exp, server, {}, 1)]
    vec = vectorized.train_clients_vectorized(exp.algorithm, round_contexts(exp, server, {}, 1), exp.data,
                                              seed=exp.cfg.seed, train_cfg=exp.cfg.train, compile_steps=True)
    assert compiled_calls["n"] > 0
    for a, b in zip(seq, vec, strict=True):
        for name in a.state:  # bf16 rounds each product to 8 bits of mantissa (tests/engine/test_precision.py)
            assert (a.state[name] - b.state[name]).abs().max().item() < 2e-2, name


def test_a_step_that_cannot_be_compiled_runs_uncompiled_and_says_why_once(monkeypatch):
    """Dynamo or Inductor refusing a step (here: raising at once) leaves the round's results those of the
    uncompiled step, with one note naming the stage and the error."""
    tries = {"n": 0}

    def refuses(*args):  # type: ignore[no-untyped-def]
        tries["n"] += 1
        raise RuntimeError("Dynamo cannot trace this\nmore lines")

    monkeypatch.setattr(vectorized, "run_compiled", refuses)
    exp = Experiment(config.load(None, [*ONE_SHAPE, "algorithm.name=fedavg"]))
    notes: list[str] = []
    compare_one_round(exp, notes=notes)
    refusals = [n for n in notes if "could not compile" in n]
    assert len(refusals) == 1, notes
    assert refusals[0].endswith("RuntimeError: Dynamo cannot trace this"), refusals
    assert tries["n"] == 1


def test_off_by_default_the_step_is_not_compiled(monkeypatch):
    monkeypatch.setattr(vectorized, "run_compiled", lambda *a: pytest.fail("compiled without runtime.compile"))
    exp = Experiment(config.load(None, [*SYNTHETIC, "train.local_steps=2", "algorithm.name=fedavg"]))
    assert exp.cfg.runtime.compile is False
    compare_one_round(exp, step_mode=("eager", "static"))


def test_the_compiled_steps_context_reads_its_values_from_the_template_and_its_tensors_from_the_row():
    """The round's values come from the template, the tensors from the row; what differs between the clients
    of one step (their id, size, features, inputs) is refused, so that the executor trains them one at a time."""
    base = ClientContext(client_id=3, round=7, num_samples=40, lr=0.05, payload={}, state={},
                                    shared={"m": torch.ones(1)})
    payload, state, extras = {"w": torch.zeros(2)}, {"c": torch.ones(2)}, {"e": torch.full((2,), 2.0)}
    ctx = StepContext(base, payload, state, extras)
    assert (ctx.round, ctx.lr) == (7, 0.05)
    assert ctx.payload is payload and ctx.state is state and ctx.extras is extras
    assert ctx.shared is base.shared
    for name in compiled_step.PER_CLIENT_VALUES:
        with pytest.raises(compiled_step.PerClientValueRead, match=f"a step read ctx.{name}, which differs"):
            getattr(ctx, name)


def test_compile_without_vmapped_clients_says_it_does_nothing(tmp_path, caplog):
    """runtime.compile with the sequential executor (or the vectorized one on a CPU, one client at a time)
    compiles nothing, and says so once."""
    exp = Experiment(config.load(None, [*SYNTHETIC, "train.local_steps=1", "train.rounds=2", "runtime.compile=true",
                                        "runtime.executor=sequential"]))
    with caplog.at_level("WARNING", logger="hetfl"):
        exp.run(tmp_path / "run")
    said = [r.getMessage() for r in caplog.records if "runtime.compile" in r.getMessage()]
    assert said == ["runtime.compile compiles the vectorized executor's vmapped steps; these clients are trained "
                    "one at a time, uncompiled"]


@pytest.mark.parametrize(("version", "compiles"), [("2.4.1+cu121", False), ("2.4.0", False), ("2.5.1+cu124", True),
                                                   ("2.5.0.dev20240801", True), ("2.10.0", True), ("3.0.0", True)])
def test_the_first_torch_that_compiles_the_step_is_2_5(version, compiles):
    why = compiled_step.unsupported(version)
    assert (why == "") == compiles
    if not compiles:
        assert why == (f"runtime.compile needs torch >= 2.5 (Dynamo before it cannot trace the vmapped step's "
                       f"torch.func.functional_call); this is torch {version}: the steps run uncompiled")


def test_a_torch_that_cannot_compile_the_step_runs_it_uncompiled_saying_why(tmp_path, caplog, monkeypatch):
    """On torch 2.4 every compile failed inside Dynamo, with its own message, once per stage: the run now says
    once what is needed and does not try."""
    monkeypatch.setattr(torch, "__version__", "2.4.1+cu121")
    monkeypatch.setattr(vectorized, "run_compiled", lambda *a: pytest.fail("tried to compile on torch 2.4"))
    exp = Experiment(config.load(None, [*ONE_SHAPE, "algorithm.name=fedavg", "train.rounds=2",
                                        "runtime.executor=vectorized", "runtime.vmap_on_cpu=true"]))
    with caplog.at_level("WARNING", logger="hetfl"):
        exp.run(tmp_path / "run")
    said = [r.getMessage() for r in caplog.records if "runtime.compile" in r.getMessage()]
    assert said == [compiled_step.unsupported("2.4.1+cu121")]
