"""Freeze and FedBABU: the orthogonal head's draw, its settings, the refusal and the server state.

Written for the survivors of ``python benchmarks/mutation.py --only freeze`` (session 26)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import ServerState, Upload
from hetfl.algorithms.freeze import orthogonal_
from hetfl.params import ConfigError
from hetfl.rng import derive_seed
from tests.helpers import context, initial_state, tiny_setup


def head(name="freeze", params=None, seed=0):
    setup = dataclasses.replace(tiny_setup(), seed=seed)
    algo = build_algorithm(name, params or {}, setup)
    return algo, algo.init_server(initial_state(setup))


@pytest.mark.parametrize("shape", [(3, 8), (8, 3), (4, 4)])
def test_orthogonal_is_orthonormal_at_the_default_gain_and_drawn_from_the_generator(shape):
    w = orthogonal_(torch.empty(shape), torch.Generator().manual_seed(1))
    assert w.shape == shape
    small = w @ w.T if shape[0] <= shape[1] else w.T @ w  # orthonormal rows (wide) or columns (tall)
    torch.testing.assert_close(small, torch.eye(min(shape)), atol=1e-6, rtol=0)
    torch.manual_seed(123)  # the global stream is not used: the same generator state gives the same matrix
    again = orthogonal_(torch.empty(shape), torch.Generator().manual_seed(1))
    assert torch.equal(w, again)
    assert not torch.equal(w, orthogonal_(torch.empty(shape), torch.Generator().manual_seed(2)))


def test_orthogonal_is_orthonormal_to_the_weights_precision():
    """Drawn and factorised in float64: a float64 weight is orthonormal to float64 precision."""
    w = orthogonal_(torch.empty(3, 8, dtype=torch.float64), torch.Generator().manual_seed(1), gain=1.0)
    assert w.dtype == torch.float64
    assert (w @ w.T - torch.eye(3, dtype=torch.float64)).abs().max().item() < 1e-13


def test_the_frozen_head_has_the_configured_gain_and_is_a_function_of_the_seed():
    _, server = head(params={"gain": 2.0})
    weight = server.model["classifier.weight"]
    torch.testing.assert_close(weight @ weight.T, 4.0 * torch.eye(3), atol=1e-5, rtol=0)  # rows of norm 2
    torch.testing.assert_close(server.model["classifier.bias"], torch.zeros(3))
    torch.manual_seed(7)  # the head does not come from the global stream
    _, again = head(params={"gain": 2.0})
    assert torch.equal(again.model["classifier.weight"], weight)
    _, other = head(params={"gain": 2.0}, seed=1)
    assert not torch.equal(other.model["classifier.weight"], weight)


def test_the_frozen_head_does_not_reuse_the_model_initialisations_stream():
    """The engine seeds the model's initialisation with ``derive_seed(seed, "init")``; the head has a stream of
    its own (coordinate 1), so its draws are independent of the encoder's initial weights."""
    _, server = head()
    shared = orthogonal_(torch.empty(3, 8), torch.Generator().manual_seed(derive_seed(0, "init")))
    assert not torch.allclose(server.model["classifier.weight"], shared)


def test_freeze_refuses_a_model_without_an_encoder_naming_the_setting():
    setup = tiny_setup()
    everything = [n for group in setup.groups.values() for n in group]
    with pytest.raises(ConfigError) as err:
        build_algorithm("freeze", {}, dataclasses.replace(setup, groups={"classifier": everything}))
    assert str(err.value) == ("algorithm.name = 'freeze': the model has no parameters outside its classifier "
                              "(logistic regression?): nothing to train; use a model with an encoder")
    assert (err.value.key, err.value.value) == ("algorithm.name", "freeze")


def test_aggregation_keeps_the_servers_method_tensors():
    algo, server = head()
    extra = {"other.tensor": torch.arange(3.0)}
    server = ServerState(server.model, extra)
    ctx = context(0, server.model)
    upload, _ = algo.finish(ctx, dict(server.model), 1)
    new = algo.aggregate(server, [Upload(0, upload, 10, 1)], 1)
    assert new.extra.keys() == extra.keys() and torch.equal(new.extra["other.tensor"], extra["other.tensor"])


def test_fedbabu_fine_tunes_at_the_configured_lr():
    algo, server = head("fedbabu", {"finetune_lr": 0.03})
    (stage,) = algo.personalize_stages(context(0, server.model))
    assert stage.sgd.lr == 0.03
    algo, server = head("fedbabu", {})
    (stage,) = algo.personalize_stages(context(0, server.model))
    assert stage.sgd.lr == algo.setup.train.lr  # 0: the run's lr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_orthogonal_follows_the_weights_device():
    w = orthogonal_(torch.empty(3, 8, device="cuda"), torch.Generator().manual_seed(1))
    assert w.device.type == "cuda"
