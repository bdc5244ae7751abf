"""The vectorised executor gives the sequential executor's results.

Tolerance: float32, ``atol = 1e-4`` on parameters after a round (and 1e-4 on
metrics after several rounds). Batched kernels (``bmm``, grouped convolutions
under ``vmap``) sum in another order than the per-client ones, so the two agree
to rounding, not bit for bit; everything else (batches, augmentation, per-step
draws) is identical. Typical differences are 1e-7 to 1e-6; methods with many
inner steps (pFedMe at its default 5 inner steps per step, lr 0.1, lambda 15) and deep
models reach 3e-5 to 4e-5 depending on the CPU thread count. A real error
(wrong batch, wrong client state) shows as 1e-2 or more.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hetfl import config
from hetfl.engine import vectorized
from hetfl.engine.experiment import Experiment
from hetfl.engine.local import train_client
from hetfl.engine.summary import Reporter
from hetfl.engine.vectorized import train_clients_vectorized
from tests.helpers import needs_shared_data
from tests.helpers.executors import (
    CAPPED,
    SHORT_LOCAL_TRAINING,
    SYNTHETIC,
    compare_one_round,
    local_training,
    methods_by_family,
    round_contexts,
)

MNIST = Path(__file__).resolve().parents[3] / "shared" / "datasets" / "mnist"


@pytest.mark.parametrize("method", methods_by_family())
def test_every_method_vectorised_equals_sequential(method, compiled_runs):
    """A round of every method, vectorised with eager steps and with the static-buffer steps a CUDA
    graph captures (both compared with one sequential run): two epochs with momentum, so that blocks,
    short batches, clients that finish early and the momentum's first step all occur. The devices are
    capped at 300 samples (SYNTHETIC's 1,250 made the largest client train 126 steps, half the test's
    time): the 30 clients still hold 52 to 300 samples, so all of those occur (fedrep: 84 blocks of
    steps; the methods compared over 10 steps have no block of several, as before). The round of history
    before it (every client's state: control variates, previous models, personal heads) trains one local
    step a client: the same kinds of state as a round of two epochs, in a tenth of its time (it was half
    of the test's time)."""
    overrides = [*SYNTHETIC, CAPPED, "train.momentum=0.5", f"algorithm.name={method}", *local_training(method)]
    exp = Experiment(config.load(None, overrides))
    history = Experiment(config.load(None, [*overrides, "train.local_steps=1"]))
    compare_one_round(exp, step_mode=("eager", "static"), history=history)
    assert compiled_runs["runs"] > 0
    assert compiled_runs["blocks"] > 0 or method in SHORT_LOCAL_TRAINING  # 10 steps: no block of several


@pytest.mark.parametrize("chunk_size", [1, 7])
def test_any_chunk_size_gives_the_same_clients(chunk_size):
    """Groups of 1 and of 7 of the 30 clients (the last group short), devices capped at 300 samples."""
    exp = Experiment(config.load(None, [*SYNTHETIC, CAPPED, "algorithm.name=scaffold"]))
    compare_one_round(exp, chunk_size=chunk_size)


def test_sampled_clients_and_step_mode():
    exp = Experiment(config.load(None, [*SYNTHETIC, "algorithm.name=moon", "train.clients_per_round=9",
                                        "train.local_steps=5", "train.drop_last=true"]))
    compare_one_round(exp, rounds_before=2)


# ResNet-18 at a quarter of its channels (model.options.width = 16): the same blocks, strides and norms, 16x
# fewer multiply-adds (session 27: these three cases 14.8 s -> 2.6 s on one thread, the BN case still failing
# when the clients' BatchNorm statistics are averaged)
NARROW_BN, NARROW_GN = "{norm = \"bn\", width = 16}", "{norm = \"gn\", width = 16}"


@needs_shared_data
@pytest.mark.parametrize(("model", "options"), [pytest.param("resnet18", NARROW_BN, marks=pytest.mark.slow),
                                                pytest.param("resnet18", NARROW_GN, marks=pytest.mark.slow),
                                                ("cnn2", "{}")])
def test_images_with_batchnorm_groupnorm_and_no_norm(model, options):
    """Per-client BatchNorm running statistics are kept per client under vmap (two clients suffice:
    their statistics differ, and running statistics averaged over the clients fail the comparison).

    (With batches of 8 and lr 0.05, BatchNorm training here is so ill-conditioned that a
    1e-7 perturbation of the start moves the sequential result by 2e-3: the comparison
    uses a well-conditioned setting so that it tests the executor, not the rounding.)"""
    exp = Experiment(config.load(None, [
        "data.dataset=mnist", f"data.root={MNIST}", "data.download=false", "data.partition=dominant",
        "data.samples_per_client=32", "data.num_clients=2", f"model.name={model}", f"model.options={options}",
        "train.batch_size=16", "train.local_steps=2", "train.lr=0.01", "train.momentum=0.9",
        "runtime.progress=false", "algorithm.name=fedprox",
    ]))
    compare_one_round(exp, rounds_before=0)


@needs_shared_data
@pytest.mark.slow
def test_fedmix_input_derivative_on_batchnorm_clients_equals_sequential():
    """FedMix's input derivative is a forward under torch.func.grad inside the step: on BatchNorm clients under
    vmap it updates each client's running statistics once, as the sequential step (it stopped every such run
    at its first step before: an in-place update of a captured tensor)."""
    exp = Experiment(config.load(None, [
        "data.dataset=mnist", f"data.root={MNIST}", "data.download=false", "data.partition=dominant",
        "data.samples_per_client=32", "data.num_clients=2", "model.name=resnet18", f"model.options={NARROW_BN}",
        "train.batch_size=16", "train.local_steps=2", "train.lr=0.01", "train.momentum=0.9",
        "runtime.progress=false", "algorithm.name=fedmix",
    ]))
    compare_one_round(exp, rounds_before=1)


@needs_shared_data
@pytest.mark.parametrize("augment", ["crop_flip", "flip"])
def test_augmented_clients_see_the_same_images_as_in_the_sequential_executor(augment):
    """Crops and flips are drawn with the round's plan, before its first step; each client's batch gets
    the draws the sequential executor gives it (two epochs: short batches in the middle of the round)."""
    exp = Experiment(config.load(None, [
        "data.dataset=mnist", f"data.root={MNIST}", "data.download=false", "data.partition=dominant",
        "data.num_clients=4", "data.samples_per_client=40", f"data.augment={augment}",
        "model.name=cnn2", "train.batch_size=16", "train.local_epochs=2", "train.lr=0.01", "train.momentum=0.9",
        "runtime.progress=false",
    ]))
    assert exp.data.augment == augment
    compare_one_round(exp, rounds_before=0, step_mode="static")


@needs_shared_data
@pytest.mark.parametrize(("model", "training"), [("cnn2", ["data.augment=crop_flip", "train.local_epochs=2"])])
def test_per_client_convolutions_give_the_sequential_clients(model, training):
    """runtime.conv_batching = "per_client": the clients' batches gathered client-major, each client's
    convolutions its own (cnn2 with crops and flips over two epochs), eager and as the static steps a CUDA
    graph captures. (Strides, dilation, groups and depthwise convolutions: tests/models/test_layers.py; a
    ResNet-18 here took 10 s of the suite for no path those do not cover.)"""
    exp = Experiment(config.load(None, [
        "data.dataset=mnist", f"data.root={MNIST}", "data.download=false", "data.partition=dominant",
        "data.num_clients=4", "data.samples_per_client=40", f"model.name={model}", *training,
        "train.batch_size=16", "train.lr=0.01", "train.momentum=0.9",
        "runtime.progress=false", "runtime.conv_batching=per_client",
    ]))
    compare_one_round(exp, rounds_before=0, step_mode=("eager", "static"))


@needs_shared_data
def test_per_client_convolutions_read_each_clients_batch_as_one_contiguous_block(monkeypatch):
    """The run's setting reaches the vectorised step: its batch is client-major and contiguous (no layout
    copy before a client's convolution), and the convolutions are hetfl's per-client ones. (A round of the
    run's Experiment, the path ``run`` trains by, without the evaluation on MNIST's 10,000 test images that
    took most of the test's time.)"""
    from hetfl.engine.vectorized import VectorizedGroup
    from hetfl.models import layers

    seen, convs = [], []
    original = VectorizedGroup.vmapped_gradients

    def record(self, stage, state, batch, *rest):  # type: ignore[no-untyped-def]
        seen.append((batch.x.is_contiguous(), batch.x.shape[:2], batch.y.is_contiguous()))
        return original(self, stage, state, batch, *rest)

    monkeypatch.setattr(VectorizedGroup, "vmapped_gradients", record)
    apply = layers._Conv2d.apply
    monkeypatch.setattr(layers._Conv2d, "apply", lambda *a: (convs.append(1), apply(*a))[1])
    exp = Experiment(config.load(None, [
        "data.dataset=mnist", f"data.root={MNIST}", "data.download=false", "data.partition=dominant",
        "data.num_clients=3", "data.samples_per_client=32", "model.name=cnn2", "train.batch_size=16",
        "train.rounds=1", "train.local_steps=2", "runtime.progress=false", "runtime.executor=vectorized",
        "runtime.vmap_on_cpu=true", "runtime.conv_batching=per_client",
    ]))
    exp.round(exp.initial_server(), {}, 1, Reporter())
    assert seen and all(x and y for x, _, y in seen) and seen[0][1] == (3, 16)
    assert convs


def test_runs_with_either_executor_give_the_same_metrics(tmp_path):
    """(FedBR's min-max local game over hundreds of steps amplifies float32 rounding:
    there the two executors agree to ~1e-2 in loss after 500 steps, as two sequential
    runs from starts 1e-7 apart do. This run uses a well-conditioned method.)"""
    base = [*SYNTHETIC, "train.rounds=3", "algorithm.name=moon", "train.local_steps=10"]
    for executor in ("sequential", "vectorized"):
        Experiment(config.load(None, [*base, f"runtime.executor={executor}", "runtime.vmap_on_cpu=true"])).run(
            tmp_path / executor)
    lines = {e: [json.loads(x) for x in (tmp_path / e / "metrics.jsonl").read_text().splitlines()]
             for e in ("sequential", "vectorized")}
    for a, b in zip(lines["sequential"], lines["vectorized"], strict=True):
        for key in ("train_loss", "global_acc", "client_acc_mean", "global_loss"):
            assert a[key] == pytest.approx(b[key], abs=1e-4), key
        assert a["local_steps"] == b["local_steps"] and a["bytes_up"] == b["bytes_up"]


def test_a_step_of_one_client_runs_unbatched_and_gives_the_sequential_clients(monkeypatch):
    """Where one client of a group trains alone (the largest, after the others finished), its steps run
    the sequential step on its row, not ``vmap`` of one row; every wider step is vmapped; a group of one
    client (chunk size 1) stays vmapped, so that vmap still vets its step (the test below). Results:
    the sequential executor's."""
    widths = {"vmapped": [], "unbatched": 0}
    vmapped_step, step_gradients = vectorized.vmapped_step, vectorized.step_gradients

    def vmapped(*args, **kwargs):
        widths["vmapped"].append(args[8].shape[0])  # y: [width, size]
        return vmapped_step(*args, **kwargs)

    def unbatched(*args, **kwargs):
        widths["unbatched"] += 1
        return step_gradients(*args, **kwargs)

    monkeypatch.setattr(vectorized, "vmapped_step", vmapped)
    monkeypatch.setattr(vectorized, "step_gradients", unbatched)
    exp = Experiment(config.load(None, [*SYNTHETIC, "algorithm.name=scaffold", "train.momentum=0.5",
                                        "train.clients_per_round=6"]))
    compare_one_round(exp)
    assert widths["unbatched"] > 0 and widths["vmapped"] and min(widths["vmapped"]) > 1
    widths["vmapped"].clear()
    server = exp.initial_server()
    train_clients_vectorized(exp.algorithm, round_contexts(exp, server, {}, 1), exp.data, seed=exp.cfg.seed,
                             train_cfg=exp.cfg.train, chunk_size=1)
    assert set(widths["vmapped"]) == {1}


@pytest.mark.parametrize("chunk_size", [0, 1])
def test_a_step_that_cannot_be_vmapped_falls_back_with_a_reason(tmp_path, monkeypatch, chunk_size):
    """(Devices capped at 300 samples: the fallback is met at a group's first step, whatever the sizes.)"""
    from hetfl.algorithms.fedavg import FedAvg

    def loss_with_item(self, state, batch, ctx):
        logits = self.model.logits(state, batch.x)
        ce = torch.nn.functional.cross_entropy(logits, batch.y)
        if ce.item() > 1e9:  # data-dependent Python control flow: no batching rule
            ce = ce * 0
        return ce, {"ce": ce.detach()}

    monkeypatch.setattr(FedAvg, "loss", loss_with_item)
    exp = Experiment(config.load(None, [*SYNTHETIC, CAPPED, "algorithm.name=fedavg"]))
    server = exp.initial_server()
    notes: list[str] = []
    ctxs = round_contexts(exp, server, {}, 1)
    vec = train_clients_vectorized(exp.algorithm, ctxs, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train,
                                   log=notes.append, chunk_size=chunk_size)
    assert any("falling back" in n and "fedavg" in n for n in notes)
    seq = [train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
           for ctx in round_contexts(exp, server, {}, 1)]
    for a, b in zip(seq, vec, strict=True):
        assert all(torch.equal(a.state[n], b.state[n]) for n in a.state)


def test_personalised_evaluation_in_one_vmapped_pass_equals_per_client():
    from hetfl.engine.evaluate import accuracies_vectorized, accuracy_and_loss

    exp = Experiment(config.load(None, [*SYNTHETIC, "algorithm.name=fedper"]))
    base = exp.initial_server().model
    gen = torch.Generator().manual_seed(0)
    states = [{k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in base.items()} for _ in range(5)]
    tests = [exp.data.client_tests[c] for c in range(5)]
    assert len({len(t.y) for t in tests}) > 1  # unequal test splits: padding and masking are exercised
    got = accuracies_vectorized(exp.caller, states, [t.x for t in tests], [t.y for t in tests], exp.data, 64)
    want = [accuracy_and_loss(exp.caller, s, t.x, t.y, exp.data, 64)[1] for s, t in zip(states, tests, strict=True)]
    # both the exact fraction (correct / samples): the same numbers whichever way a client was evaluated
    assert got == want and all(a == round(a * len(t.y)) / len(t.y) for a, t in zip(got, tests, strict=True))
    reordered = [dict(reversed(list(s.items()))) for s in states]  # one structure whatever the dicts' order
    mixed = [reordered[0], *states[1:]]
    assert accuracies_vectorized(exp.caller, mixed, [t.x for t in tests], [t.y for t in tests], exp.data, 64) == got


def test_on_the_cpu_the_vectorized_executor_trains_clients_one_at_a_time_and_says_so(tmp_path):
    """vmap is slower than one client at a time on a CPU (benchmarks/vmap_cpu_profile.py): the
    vectorised executor runs clients sequentially there, with the sequential executor's numbers
    (devices capped at 300 samples and 4 local steps: the fallback's path does not depend on the clients'
    sizes or steps; two rounds, the second from the first's aggregate)."""
    base = [*SYNTHETIC, CAPPED, "train.rounds=2", "train.local_steps=4", "algorithm.name=fedprox",
            "runtime.device=cpu"]
    Experiment(config.load(None, [*base, "runtime.executor=sequential"])).run(tmp_path / "seq")
    exp = Experiment(config.load(None, [*base, "runtime.executor=vectorized"]))
    assert not exp.vmap_clients
    forced = Experiment(config.load(None, [*base, "runtime.executor=vectorized", "runtime.vmap_on_cpu=true"]))
    assert forced.vmap_clients
    exp.run(tmp_path / "vec")
    assert any("one at a time" in note for note in exp.__dict__["_notes"])
    drop = ("round_time_s", "eval_time_s")
    seq, vec = ((tmp_path / d / "metrics.jsonl").read_text().splitlines() for d in ("seq", "vec"))
    assert [{k: v for k, v in json.loads(x).items() if k not in drop} for x in seq] == \
        [{k: v for k, v in json.loads(x).items() if k not in drop} for x in vec]


@needs_shared_data
@pytest.mark.parametrize(("model", "options"), [("cnn2", "{}"),
                                                pytest.param("resnet18", NARROW_GN, marks=pytest.mark.slow)])
def test_channels_last_batches_give_the_nchw_clients(model, options):
    """Image batches laid out channels-last for cuDNN (runtime.channels_last) hold the same values:
    the clients equal those trained on NCHW batches to float rounding (two clients: the layout is one
    copy of the batch whatever the number of clients). (ResNet-18 with BatchNorm on
    batches of 16 amplifies a convolution's other summation order to 1e-3 within two steps, as the
    executor comparisons above note; one BatchNorm step agrees to 1e-7 in either layout.)"""
    exp = Experiment(config.load(None, [
        "data.dataset=mnist", f"data.root={MNIST}", "data.download=false", "data.partition=dominant",
        "data.samples_per_client=32", "data.num_clients=2", f"model.name={model}", f"model.options={options}",
        "train.batch_size=16", "train.local_steps=2", "train.lr=0.01", "train.momentum=0.9",
        "runtime.progress=false", "algorithm.name=fedavg", "runtime.device=cpu",
    ]))
    server = exp.initial_server()
    runs = [train_clients_vectorized(exp.algorithm, round_contexts(exp, server, {}, 1), exp.data, seed=0,
                                     train_cfg=exp.cfg.train, channels_last=layout) for layout in (False, True)]
    for a, b in zip(*runs, strict=True):
        for name in a.state:
            diff = (a.state[name].double() - b.state[name].double()).abs().max().item()
            assert diff <= 1e-4, f"{name} differs by {diff}"  # the tolerance of the executor tests (rounding)


def test_the_channels_last_copy_is_the_grouped_convolutions_nhwc_layout():
    from hetfl.engine.vectorized import channels_last_for_vmap

    x = torch.randn(4, 5, 3, 8, 8)  # clients, batch, C, H, W
    y = channels_last_for_vmap(x)
    assert torch.equal(x, y)
    folded = y.movedim(0, 1).reshape(5, 4 * 3, 8, 8)  # what vmap's grouped convolution sees: no copy
    assert folded.data_ptr() == y.data_ptr() and folded.is_contiguous(memory_format=torch.channels_last)
