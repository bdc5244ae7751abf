"""The calibration step of the post-hoc methods by hand (session 43, mutation testing of
hetfl.algorithms.posthoc): CCVR's Algorithm 1, last line, re-trains the classifier on fixed virtual features
with SGD (momentum, weight decay) in shuffled mini-batches; each step has its own random stream."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from hetfl.algorithms.posthoc import ClassifierTraining, retrain_classifier, stream
from hetfl.rng import torch_generator
from tests.helpers import tiny_setup


def _by_hand(w0, b0, x, y, cfg: ClassifierTraining, seed: int):
    """SGD written out: per epoch a permutation from the generator, batches of ``batch_size`` in its order
    (the last one short), g = grad CE + wd * p, v = m v + g (v = g at the first step), p -= lr v."""
    gen = torch.Generator().manual_seed(seed)
    params = [w0.clone()] + ([b0.clone()] if b0 is not None else [])
    velocity: list[torch.Tensor | None] = [None] * len(params)
    for _ in range(cfg.epochs):
        order = torch.randperm(len(y), generator=gen)
        for start in range(0, len(y), cfg.batch_size):
            idx = order[start:start + cfg.batch_size]
            live = [p.clone().requires_grad_() for p in params]
            loss = F.cross_entropy(F.linear(x[idx], live[0], live[1] if b0 is not None else None), y[idx])
            grads = torch.autograd.grad(loss, live)
            for i, (p, g) in enumerate(zip(params, grads, strict=True)):
                g = g + cfg.weight_decay * p
                velocity[i] = g if velocity[i] is None else cfg.momentum * velocity[i] + g
                params[i] = p - cfg.lr * velocity[i]
    return params[0], (params[1] if b0 is not None else None)


def _problem(n: int = 10, d: int = 4, c: int = 3):
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(c, d, generator=gen), torch.randn(c, generator=gen), torch.randn(n, d, generator=gen),
            torch.randint(0, c, (n,), generator=gen))


@pytest.mark.parametrize("with_bias", [True, False])
def test_shuffled_mini_batches_over_epochs_by_hand(with_bias):
    """10 samples in batches of 4 (4, 4, 2) for 3 epochs, each epoch reshuffled from the same generator."""
    w0, b0, x, y = _problem()
    b0 = b0 if with_bias else None
    cfg = ClassifierTraining(epochs=3, lr=0.2, momentum=0.8, weight_decay=0.05, batch_size=4)
    w, b = retrain_classifier(w0, b0, x, y, cfg, torch.Generator().manual_seed(11))
    ww, bb = _by_hand(w0, b0, x, y, cfg, 11)
    torch.testing.assert_close(w, ww)
    assert (b is None) == (not with_bias)
    if with_bias:
        torch.testing.assert_close(b, bb)
    # another shuffle, another result: the order is drawn from the generator given
    w_other, _ = retrain_classifier(w0, b0, x, y, cfg, torch.Generator().manual_seed(12))
    assert not torch.allclose(w, w_other)


def test_the_start_is_left_as_it_was_and_the_result_holds_no_graph():
    w0, b0, x, y = _problem()
    before = (w0.clone(), b0.clone())
    w, b = retrain_classifier(w0, b0, x, y, ClassifierTraining(1, 0.5, 0.9, 0.0, 3), torch.Generator())
    assert torch.equal(w0, before[0]) and torch.equal(b0, before[1])
    assert not w.requires_grad and not b.requires_grad and w.grad_fn is None and b.grad_fn is None
    assert w.data_ptr() != w0.data_ptr() and b.data_ptr() != b0.data_ptr()


def test_it_trains_under_no_grad_and_in_the_weights_dtype():
    """The engine calls post-hoc steps without autograd (evaluation mode): the step turns it on for itself.
    Features arrive in float64 (the sampled Gaussians) and are cast to the classifier's dtype; labels as given."""
    w0, b0, x, y = _problem()
    cfg = ClassifierTraining(2, 0.1, 0.5, 0.01, 4)
    with torch.no_grad():
        w, b = retrain_classifier(w0, b0, x.double(), y, cfg, torch.Generator().manual_seed(3))
    ww, bb = _by_hand(w0, b0, x, y, cfg, 3)
    assert w.dtype == torch.float32 and b.dtype == torch.float32
    torch.testing.assert_close(w, ww)
    torch.testing.assert_close(b, bb)


def test_zero_epochs_keep_the_classifier():
    w0, b0, x, y = _problem()
    w, b = retrain_classifier(w0, b0, x, y, ClassifierTraining(0, 0.1, 0.9, 0.1, 4), torch.Generator())
    assert torch.equal(w, w0) and torch.equal(b, b0)


def test_a_steps_stream_is_its_own():
    """``stream``: the run's seed, the round and the step's name (CRC-32) under the purpose "algorithm"."""
    setup = tiny_setup()
    want = torch_generator(setup.seed, "algorithm", 3, zlib.crc32(b"ccvr")).initial_seed()
    assert stream(setup, 3, "ccvr").initial_seed() == want
    seeds = {stream(setup, r, name).initial_seed() for r in (1, 2) for name in ("ccvr", "fedpac")}
    assert len(seeds) == 4


def test_it_trains_on_the_classifiers_device():
    """The sampled features and their labels arrive on the CPU; the classifier may be on a GPU: they are moved
    to its device (and dtype). On the ``meta`` device, which stands in for a GPU without one: a tensor left on
    the CPU would meet the classifier in a product and fail."""
    w0, b0, x, y = _problem()
    meta = torch.device("meta")
    w, b = retrain_classifier(w0.to(meta), b0.to(meta), x.double(), y, ClassifierTraining(2, 0.1, 0.9, 0.01, 4),
                              torch.Generator())
    assert (w.device, b.device, w.dtype, w.shape) == (meta, meta, torch.float32, w0.shape)
