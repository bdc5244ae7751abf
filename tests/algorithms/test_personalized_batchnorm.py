"""Personal copies of a BatchNorm model (Ditto's personal model, APFL's local model) on both executors.

A method that keeps a second copy of the model in the client's state (``ditto.personal/...``,
``apfl.local/...``) trains it with the model's forward pass, which in training mode updates that copy's
BatchNorm running statistics. The step must update them on copies inside the differentiated function, as
it does the model's own buffers (``Algorithm.running_buffers``): an update in place of a captured state
tensor is refused by ``torch.func`` transforms, and the vectorised executor then trained every client of
the round one after the other ("falling back to sequential clients"), on a GPU a round many times slower.
"""

from __future__ import annotations

import pytest
import torch

from hetfl import config
from hetfl.engine.experiment import Experiment
from hetfl.engine.local import train_client
from tests.helpers import MNIST, needs_shared_data
from tests.helpers.executors import compare_one_round, round_contexts

# FedUV's CNN (BatchNorm after every conv and in the projector) at 16 output features, two MNIST clients
BN_RUN = ["data.dataset=mnist", f"data.root={MNIST}", "data.download=false", "data.partition=dominant",
          "data.samples_per_client=16", "data.num_clients=2", "model.name=feduv_cnn", "model.options={out_dim = 16}",
          "train.batch_size=8", "train.local_steps=2", "train.lr=0.01", "runtime.progress=false", "runtime.threads=1"]
PERSONAL_COPY = {"ditto": "ditto.personal/", "apfl": "apfl.local/"}

pytestmark = needs_shared_data


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("method", PERSONAL_COPY)
def test_the_personal_copys_batchnorm_statistics_train_vectorised_as_sequentially(method):
    exp = Experiment(config.load(None, [*BN_RUN, f"algorithm.name={method}"]))
    compare_one_round(exp, rounds_before=1, step_mode=("eager", "static"))  # asserts no sequential fallback


@pytest.mark.parametrize("method", PERSONAL_COPY)
def test_the_personal_copys_running_statistics_move_and_the_start_state_does_not(method):
    """The copy's statistics are those of the batches it was trained on (they move); the client's stored
    state, which the step reads, is not written in place."""
    exp = Experiment(config.load(None, [*BN_RUN, f"algorithm.name={method}"]))
    server = exp.initial_server()
    (ctx, _) = round_contexts(exp, server, {}, 1)
    stored = {k: v.clone() for k, v in ctx.state.items()}
    result = train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
    name = PERSONAL_COPY[method] + "encoder.1.running_mean"
    assert name in exp.algorithm.running_buffers()
    assert not torch.equal(result.state[name], stored[name])
    assert all(torch.equal(ctx.state[k], v) for k, v in stored.items())
