"""hetfl's functional SGD (:mod:`hetfl.optim`): the update of :class:`torch.optim.SGD` (to float32
rounding: its step is ``p - g * lr``, torch's ``p + (-lr) * g``), as a pure function (the sequential
executor, one client) and, equal to it to the last bit, in place with multi-tensor kernels and a
learning rate held in a tensor (the vectorised executor, a row per client)."""

from __future__ import annotations

import pytest
import torch

from hetfl.optim import SGDConfig, sgd_init, sgd_update, sgd_update_

CONFIGS = [SGDConfig(lr=0.1), SGDConfig(lr=0.05, momentum=0.9), SGDConfig(lr=0.05, momentum=0.9, weight_decay=1e-3),
           SGDConfig(lr=0.01, momentum=0.5, weight_decay=5e-4, nesterov=True)]


def tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(7, 5, generator=gen), "b": torch.randn(5, generator=gen),
            "k": torch.randn(3, 2, 2, 2, generator=gen)}


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_sgd_update_is_torch_sgd_to_float32_rounding(cfg):
    params = tensors(0)
    torch_params = {n: p.clone().requires_grad_() for n, p in params.items()}
    opt = torch.optim.SGD(list(torch_params.values()), lr=cfg.lr, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay, nesterov=cfg.nesterov, foreach=False)
    state = sgd_init(params, cfg)
    for step in range(4):
        grads = tensors(10 + step)
        for n, p in torch_params.items():
            p.grad = grads[n].clone()
        opt.step()
        params, state = sgd_update(params, grads, state, cfg, first_step=step == 0)
        for n, p in torch_params.items():
            torch.testing.assert_close(params[n], p.detach(), rtol=2e-7, atol=2e-7, msg=f"{cfg} {step} {n}")


@pytest.mark.parametrize("rate", ["float", "tensor"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_the_in_place_multi_tensor_update_equals_the_functional_one(cfg, rate):
    """What the vectorised executor runs on its stacked rows (the rate in a tensor, which a CUDA graph
    reads when replayed) equals, bit for bit on the CPU, what the sequential executor runs per client:
    the executors stay equal."""
    params, state = tensors(1), sgd_init(tensors(1), SGDConfig(lr=0.1, momentum=0.9))
    state = {n: t + 1.0 for n, t in state.items()}  # a momentum buffer from earlier steps
    names = list(params)
    for first in (True, False):
        grads = tensors(2)
        want, want_state = sgd_update(params, grads, state if cfg.momentum else {}, cfg, first_step=first)
        got = {n: p.clone() for n, p in params.items()}
        got_state = {n: b.clone() for n, b in state.items()}
        bufs = [got_state[n] for n in names] if cfg.momentum else []
        lr = torch.tensor(cfg.lr) if rate == "tensor" else None
        sgd_update_([got[n] for n in names], [grads[n] for n in names], bufs, cfg, first_step=first, lr=lr)
        for n in names:
            assert torch.equal(got[n], want[n]), (cfg, first, n)
            if cfg.momentum:
                assert torch.equal(got_state[n], want_state[n]), (cfg, first, n)


def test_the_rate_given_to_the_in_place_update_overrides_the_configs():
    """The vectorised executor passes the round's rate (a cosine schedule's, in a tensor) with a config
    that still holds the starting ``lr``: the step must use the rate given, as ``sgd_update`` with that lr."""
    cfg = SGDConfig(lr=0.1, momentum=0.9, weight_decay=1e-3)
    params, grads, names = tensors(3), tensors(4), list(tensors(3))
    for rate in (torch.tensor(0.025), 0.025):
        want, _ = sgd_update(params, grads, {}, SGDConfig(lr=0.025, momentum=0.9, weight_decay=1e-3), first_step=True)
        got = {n: p.clone() for n, p in params.items()}
        bufs = [torch.zeros_like(params[n]) for n in names]
        sgd_update_([got[n] for n in names], [grads[n] for n in names], bufs, cfg, first_step=True, lr=rate)
        for n in names:
            assert torch.equal(got[n], want[n]), (rate, n)


def test_optimiser_state_is_a_zero_buffer_per_parameter_only_with_momentum():
    params = tensors(5)
    assert sgd_init(params, SGDConfig(lr=0.1)) == {}
    state = sgd_init(params, SGDConfig(lr=0.1, momentum=0.9))
    assert state.keys() == params.keys()
    assert all(torch.equal(state[n], torch.zeros_like(p)) for n, p in params.items())
