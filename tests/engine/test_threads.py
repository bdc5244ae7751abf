"""``runtime.threads``: a count > 0 as given; 0 (auto) one thread for a small training step on a CPU
device, the process's count otherwise (issue 27: the default run was 14x slower on torch's default
count on a busy 2-core machine)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hetfl import config
from hetfl.engine import threads
from hetfl.engine.experiment import Experiment
from hetfl.models import build_model

TINY = ["data.options={num_devices=4, max_samples=40}", "data.num_clients=4", "train.rounds=1",
        "runtime.progress=false"]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def two_threads():
    """The process starts on 2 threads (torch's default on a 2-core machine)."""
    torch.set_num_threads(2)


@pytest.mark.parametrize(("name", "shape", "options"), [
    ("mlp", (60,), {"hidden": []}), ("mlp", (784,), {"hidden": [200, 200]}), ("cnn2", (1, 28, 28), {}),
    ("simple_cnn", (3, 32, 32), {}), ("fedpac_cnn", (3, 32, 32), {}), ("resnet18", (3, 32, 32), {"norm": "gn"}),
])
def test_forward_flops_are_torchs_count_of_the_matrix_products_and_convolutions(name, shape, options):
    model = build_model(name, shape, 10, **options)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.eval()(torch.zeros((1, *shape)))
    assert threads.forward_flops(model.train(), shape) == counter.get_total_flops()


def test_counting_changes_nothing_in_the_model():
    """A pass in eval mode without gradients: batch norm's running statistics stay, the mode is put back,
    no random number is drawn."""
    model = build_model("resnet18", (3, 32, 32), 10).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    assert threads.forward_flops(model, (3, 32, 32)) > 0
    assert model.training and torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_logistic_regression_is_two_flops_per_weight():
    assert threads.forward_flops(build_model("mlp", (60,), 10, hidden=[]), (60,)) == 2 * 60 * 10


def test_the_default_run_trains_on_one_thread(two_threads):
    """The default Synthetic run (logistic regression, batch 32) on a process with 2 threads."""
    exp = Experiment(config.load(None, TINY))
    assert exp.cfg.runtime.threads == 0 and exp.device == CPU
    assert torch.get_num_threads() == 1


def test_a_thread_count_that_is_set_is_used_as_given():
    Experiment(config.load(None, [*TINY, "runtime.threads=2"]))
    assert torch.get_num_threads() == 2


@pytest.fixture
def process_started_on_two(monkeypatch):
    """As in a process that started on 2 threads (the tests' processes start on one: tests/conftest.py)."""
    monkeypatch.setattr(threads, "PROCESS_THREADS", 2)


def test_a_large_step_gets_the_processs_starting_count(process_started_on_two):
    """ResNet-18 at batch 32 on 32x32 images: ~3.6e10 forward FLOPs a step, where threads pay."""
    cfg = config.load(None, ["model.name=resnet18", "train.batch_size=32"])
    model = build_model("resnet18", (3, 32, 32), 10)
    assert threads.step_flops(cfg, model, (3, 32, 32), vmap=False) > threads.ONE_THREAD_BELOW_FLOPS
    assert threads.auto_threads(cfg, CPU, model, (3, 32, 32), vmap=False) == 2


def test_a_large_run_after_a_small_one_in_the_same_process_gets_the_same_count_as_alone(process_started_on_two):
    """A sweep or a notebook: the default run goes down to one thread; a ResNet-18 run after it must not
    stay there (its numbers would depend on what ran before it)."""
    Experiment(config.load(None, TINY))
    assert torch.get_num_threads() == 1
    cfg = config.load(None, ["model.name=resnet18", "train.batch_size=32"])
    assert threads.fit_threads(cfg, CPU, build_model("resnet18", (3, 32, 32), 10), (3, 32, 32), vmap=False) == 2
    assert torch.get_num_threads() == 2


def test_small_steps_use_one_thread_on_the_cpu_only(process_started_on_two):
    cfg = config.load(None, ["model.name=cnn2", "train.batch_size=32"])
    model = build_model("cnn2", (1, 28, 28), 10)
    assert threads.auto_threads(cfg, CPU, model, (1, 28, 28), vmap=False) == 1
    assert threads.auto_threads(cfg, CUDA, model, (1, 28, 28), vmap=False) == 2  # the work is on the GPU


def test_vmapped_clients_count_as_one_step(process_started_on_two):
    """vmap on the CPU steps a round's clients as one computation: the step is that many times larger."""
    cfg = config.load(None, ["model.name=cnn2", "train.batch_size=32", "data.num_clients=30",
                             "runtime.executor=vectorized", "runtime.vmap_on_cpu=true"])
    model = build_model("cnn2", (1, 28, 28), 10)
    one = threads.step_flops(cfg, model, (1, 28, 28), vmap=False)
    assert threads.step_flops(cfg, model, (1, 28, 28), vmap=True) == 30 * one
    assert threads.auto_threads(cfg, CPU, model, (1, 28, 28), vmap=True) == 2


def test_a_model_whose_pass_cannot_be_counted_gets_the_processs_starting_count(process_started_on_two):
    """A plug-in model that takes another input than the dataset's samples: no estimate, torch's count."""
    cfg = config.load(None, [])
    assert threads.auto_threads(cfg, CPU, build_model("cnn2", (1, 28, 28), 10), (60,), vmap=False) == 2
