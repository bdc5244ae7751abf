"""Partial sharing's split of buffers, its refusals and FedRep's stages (mutation testing, session 26;
FedPer, FedRep: Collins et al. ICML 2021 Algorithm 1, LG-FedAvg)."""

from __future__ import annotations

import pytest
import torch

from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import ServerState, Upload
from hetfl.params import ConfigError
from tests.algorithms.test_personalized_baselines import bn_setup
from tests.helpers import context, initial_state, perturbed, tiny_setup

BN_BUFFERS = {"encoder.1.running_mean", "encoder.1.running_var", "encoder.1.num_batches_tracked"}


def make(name, params=None, setup=None, **train):
    setup = setup or tiny_setup(**train)
    algo = build_algorithm(name, params or {}, setup)
    return algo, algo.init_server(initial_state(setup))


def test_a_buffer_goes_with_the_part_its_module_belongs_to():
    """LG-FedAvg keeps the encoder (with its BatchNorm statistics) local; FedPer shares them."""
    lg, server = make("lgfedavg", setup=bn_setup())
    assert set(lg.personal_names()) == {"encoder.0.weight", "encoder.0.bias", "encoder.1.weight", "encoder.1.bias",
                                        *BN_BUFFERS}
    assert set(lg.payload(server, 0)) == {"classifier.weight", "classifier.bias"}
    assert set(lg.init_client_state(0, server)) == {"lgfedavg.personal/" + n for n in lg.personal_names()}
    per, _ = make("fedper", setup=bn_setup())
    assert set(per.personal_names()) == {"classifier.weight", "classifier.bias"}
    assert set(per.shared_names()) >= BN_BUFFERS
    assert set(per.shared_params()) == {"encoder.0.weight", "encoder.0.bias", "encoder.1.weight", "encoder.1.bias"}
    assert per.personal_params() == ("classifier.weight", "classifier.bias")


def test_a_split_with_nothing_personal_or_nothing_shared_is_refused_with_the_whole_reason():
    setup = tiny_setup()
    setup.groups = {**setup.groups, "encoder": []}
    with pytest.raises(ConfigError) as err:
        build_algorithm("lgfedavg", {}, setup)
    assert str(err.value) == "algorithm.local = 'encoder': the model has no parameters in that part"
    setup = tiny_setup()
    names = [n for group in setup.groups.values() for n in group]
    setup.groups = {"encoder": [], "projector": [], "classifier": names}
    with pytest.raises(ConfigError) as err:
        build_algorithm("fedper", {}, setup)
    assert str(err.value) == "algorithm.personal = 'classifier': nothing of the model would be shared"


def test_fedrep_stages_head_then_body_with_their_epochs_and_names():
    algo, server = make("fedrep", {"head_epochs": 3, "body_epochs": 2}, local_steps=7)
    ctx = context(0, algo.payload(server, 0), algo.init_client_state(0, server), lr=0.02)
    head, body = algo.stages(ctx)
    assert (head.name, head.epochs, head.steps) == ("head", 3, 0)
    assert (body.name, body.epochs, body.steps) == ("body", 2, 0)
    assert head.sgd.lr == body.sgd.lr == 0.02
    assert (head.loss, body.loss) == (algo.loss, algo.loss)
    no_head, _ = make("fedrep", {"head_epochs": 0, "body_epochs": 0}, local_epochs=4)
    (fallback,) = no_head.stages(ctx)  # body_epochs = 0: the run's epochs, otherwise the same body stage
    assert (fallback.name, fallback.epochs, fallback.steps) == ("body", 4, 0)
    assert (fallback.loss, fallback.trainable, fallback.sgd) == (no_head.loss, body.trainable, body.sgd)
    assert set(body.trainable) == set(algo.shared_params())


def test_the_shared_part_is_the_data_size_weighted_mean_and_the_server_keeps_its_other_tensors():
    algo, server = make("fedper")
    server = ServerState(model=server.model, extra={"kept": torch.arange(2)})
    a, b = perturbed(server.model, 0.1, 1), perturbed(server.model, 0.1, 2)
    shared = algo.shared_names()
    new = algo.aggregate(server, [Upload(0, {n: a[n] for n in shared}, 10, 1),
                                  Upload(1, {n: b[n] for n in shared}, 30, 1)], 1)
    for n in shared:
        assert torch.allclose(new.model[n], 0.25 * a[n] + 0.75 * b[n])
    assert torch.equal(new.extra["kept"], torch.arange(2))
