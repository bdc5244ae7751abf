"""``train.precision = "bf16"``: local training under bfloat16 autocast.

Checks that autocast is really on (the result differs from float32's), that it stays
close to float32 and learns, that parameters and optimiser state stay float32, and that
the vectorised executor gives the sequential executor's bf16 result.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetfl import config
from hetfl.engine.experiment import Experiment
from hetfl.engine.local import train_client
from hetfl.engine.vectorized import train_clients_vectorized
from tests.helpers import needs_shared_data
from tests.helpers.executors import round_contexts

MNIST = Path(__file__).resolve().parents[3] / "shared" / "datasets" / "mnist"
BASE = ["data.dataset=mnist", f"data.root={MNIST}", "data.download=false", "data.partition=dominant",
        "data.num_clients=3", "data.samples_per_client=200", "model.name=cnn2", "train.batch_size=32",
        "train.lr=0.05", "runtime.progress=false", "runtime.device=cpu", "runtime.checkpoint_every=0"]
pytestmark = needs_shared_data


def first_round(precision: str, executor: str = "sequential", settings: tuple[str, ...] = (),
                log: list[str] | None = None):
    exp = Experiment(config.load(None, [*BASE, f"train.precision={precision}", "algorithm.name=fedprox", *settings]))
    server = exp.initial_server()
    ctxs = round_contexts(exp, server, {}, 1)
    if executor == "sequential":
        return [train_client(exp.algorithm, ctx, exp.data, seed=0, train_cfg=exp.cfg.train) for ctx in ctxs]
    return train_clients_vectorized(exp.algorithm, ctxs, exp.data, seed=0, train_cfg=exp.cfg.train,
                                    log=None if log is None else log.append)


def test_bf16_autocast_is_on_close_to_fp32_and_keeps_float32_state():
    fp32, bf16 = first_round("fp32"), first_round("bf16")
    for a, b in zip(fp32, bf16, strict=True):
        assert all(t.dtype == torch.float32 for t in b.state.values() if t.is_floating_point())
        diffs = [(a.state[n] - b.state[n]).abs().max().item() for n in a.state]
        assert max(diffs) > 1e-5, "bf16 gave float32's numbers: autocast was not applied"
        w = "classifier.weight"
        rel = (a.state[w] - b.state[w]).norm() / a.state[w].norm()
        assert rel < 0.05
        assert b.loss_sum == pytest.approx(a.loss_sum, rel=0.05)


def test_bf16_vectorised_equals_sequential():
    seq, vec = first_round("bf16"), first_round("bf16", "vectorized")
    for a, b in zip(seq, vec, strict=True):
        assert a.steps == b.steps
        for name in a.state:
            # bf16 rounds each product to 8 bits of mantissa; batched kernels reassociate sums
            assert (a.state[name] - b.state[name]).abs().max().item() < 2e-2, name


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_a_batchnorm_model_vmaps_in_bf16_and_gives_the_sequential_clients(device):
    """BatchNorm2d and BatchNorm1d (FedUV's CNN has both) under vmap in bf16: the vmapped step trains, it does
    not fall back to sequential clients. PyTorch's batching rule for a batch norm with per-client running
    statistics calls the CPU kernel without the weight, and that kernel then refuses a bfloat16 input with
    float32 statistics ("expected scalar type BFloat16 but found Float"), where the same layer outside vmap
    (the sequential step) takes them: every BatchNorm model in bf16 fell back (a config fuzz found it).
    One step: its loss is the forward pass at the start (bf16 rounding apart), and the executors' weights
    after it differ by less than bf16's differ from float32's (this CNN amplifies any rounding within steps:
    two float32 runs on one and two threads are 1e-2 apart after two). On CUDA, where PyTorch's kernel takes
    the mix under vmap, the layer is left as it is: the test checks that it does not fall back there either."""
    settings = (f"runtime.device={device}", "model.name=feduv_cnn", "data.samples_per_client=64",
                "train.batch_size=16", "train.local_steps=1")
    notes: list[str] = []
    seq, vec = first_round("bf16", settings=settings), first_round("bf16", "vectorized", settings, notes)
    assert not [n for n in notes if "falling back" in n], notes
    fp32 = first_round("fp32", settings=settings)

    def gap(xs, ys) -> float:  # the largest difference of any weight or running statistic
        return max((a.state[n] - b.state[n]).abs().max().item() for a, b in zip(xs, ys, strict=True)
                   for n in a.state if a.state[n].is_floating_point())

    assert [a.steps for a in seq] == [b.steps for b in vec] == [1, 1, 1]
    for a, b in zip(seq, vec, strict=True):
        assert b.loss_sum == pytest.approx(a.loss_sum, rel=4e-3)
    assert gap(seq, vec) < gap(seq, fp32)


@pytest.mark.slow  # two 3-round cnn2 runs; fast cover: the first-round test above
def test_bf16_run_learns_as_fp32_does(tmp_path):
    acc = {}
    for precision in ("fp32", "bf16"):
        cfg = config.load(None, [*BASE, f"train.precision={precision}", "train.rounds=3", "train.eval_every=3",
                                 "algorithm.name=fedavg"])
        acc[precision] = Experiment(cfg).run(tmp_path / precision)["final_global_acc"]
    assert acc["bf16"] > 0.2  # chance is 0.1; 3 clients of 200 samples, 3 rounds
    assert acc["bf16"] == pytest.approx(acc["fp32"], abs=0.05)
