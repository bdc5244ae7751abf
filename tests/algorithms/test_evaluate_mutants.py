"""Evaluation (:mod:`hetfl.engine.evaluate`), on a linear model whose logits are computed by hand here:
every reported accuracy and loss of every method goes through these functions, so each is checked
against an independent computation (predictions in order across batches, eval mode during the forward
and the caller's mode restored, the exact fraction of correct samples, the mean cross-entropy, the
personalised accuracies of padded, masked chunks)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hetfl.engine.evaluate import accuracies_vectorized, accuracy_and_loss, predict

CLASSES = 3


class Linear:
    """A stand-in for ``ModelCaller``: logits ``prepare(x) @ state["w"]``; records the module's mode at each
    forward."""

    def __init__(self) -> None:
        self.module = torch.nn.Module()
        self.modes: list[bool] = []

    def logits(self, state, inputs):
        self.modes.append(self.module.training)
        return inputs @ state["w"]


def data():
    """``prepare`` doubles its inputs: a forward on unprepared inputs gives other logits."""
    return SimpleNamespace(prepare=lambda x: 2.0 * x, info=SimpleNamespace(num_classes=CLASSES))


def sample(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(CLASSES, (n,), generator=gen)
    state = {"w": torch.randn(4, CLASSES, generator=gen, dtype=torch.float64)}
    return x, y, state


@pytest.mark.parametrize("training", [True, False])
def test_predict_is_the_prepared_forward_in_eval_mode_in_order_and_restores_the_mode(training):
    x, _, state = sample(7, 0)
    model = Linear()
    model.module.train(training)
    labels, logits = predict(model, state, x, data(), batch_size=3)
    want = (2.0 * x) @ state["w"]
    assert torch.equal(logits, want) and torch.equal(labels, want.argmax(1))
    assert model.modes == [False, False, False]  # batches 3 + 3 + 1, all in eval mode
    assert model.module.training is training


def test_predict_restores_the_mode_when_the_forward_fails():
    x, _, state = sample(4, 1)
    model = Linear()

    def broken(inputs):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        predict(model, state, x, data(), 2, predictor=broken)
    assert model.module.training is True


def test_predict_uses_the_predictor_when_given_and_no_inputs_give_no_rows():
    x, _, state = sample(5, 2)
    model = Linear()
    labels, logits = predict(model, state, x, data(), 2, predictor=lambda inputs: -inputs[:, :CLASSES])
    assert torch.equal(logits, -(2.0 * x)[:, :CLASSES]) and model.modes == []
    labels, logits = predict(model, state, x[:0], data(), 2)
    assert logits.shape == (0, CLASSES) and labels.shape == (0,) and logits.device == x.device


def test_accuracy_and_loss_are_the_exact_fraction_and_the_mean_cross_entropy():
    x, y, state = sample(9, 3)
    logits = (2.0 * x) @ state["w"]
    y[:2] = logits[:2].argmax(1)  # at least two right
    y[2] = (logits[2].argmax() + 1) % CLASSES  # at least one wrong
    correct, acc, loss = accuracy_and_loss(Linear(), state, x, y, data(), batch_size=4)
    want_correct = logits.argmax(1) == y
    assert torch.equal(correct, want_correct)
    assert acc == int(want_correct.sum()) / 9 and 0 < acc < 1
    # cross-entropy by hand: mean over samples of logsumexp(logits) - logit of the label
    by_hand = sum(math.log(sum(math.exp(v) for v in row.tolist())) - row[t].item()
                  for row, t in zip(logits, y.tolist(), strict=True)) / 9
    assert loss == pytest.approx(by_hand, rel=1e-6)
    assert loss == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-6)


def test_an_empty_test_set_has_no_accuracy_and_no_loss():
    x, y, state = sample(3, 4)
    correct, acc, loss = accuracy_and_loss(Linear(), state, x[:0], y[:0], data(), 4)
    assert correct.numel() == 0 and math.isnan(acc) and math.isnan(loss)


@pytest.mark.parametrize("training", [True, False])
def test_personalised_accuracies_are_each_state_on_its_own_samples(training):
    """Three clients with 150, 70 and 1 samples: chunks of max(64, batch_size // k) samples, the shorter
    sets padded and masked; each accuracy the exact fraction of its own correct samples."""
    sizes = (150, 70, 1)
    xs, ys, states = zip(*(sample(n, 10 + i) for i, n in enumerate(sizes)), strict=True)
    ys = list(ys)
    for x, y, s in zip(xs, ys, states, strict=True):  # make about half right, so that masking shows
        y[::2] = ((2.0 * x) @ s["w"]).argmax(1)[::2]
    model = Linear()
    model.module.train(training)
    got = accuracies_vectorized(model, list(states), list(xs), ys, data(), batch_size=30)
    want = [int((((2.0 * x) @ s["w"]).argmax(1) == y).sum()) / len(y) for x, y, s in zip(xs, ys, states, strict=True)]
    assert got == want
    assert model.module.training is training and not any(model.modes)
    assert len(model.modes) == 3  # 150 samples in chunks of 64: three vmapped forwards


def test_a_large_batch_is_shared_among_the_clients_chunks():
    """batch_size 400 over 2 clients: chunks of 200 samples, one forward for 150 samples each."""
    xs, ys, states = zip(*(sample(150, 20 + i) for i in range(2)), strict=True)
    model = Linear()
    got = accuracies_vectorized(model, list(states), list(xs), list(ys), data(), batch_size=400)
    assert len(model.modes) == 1
    assert got == [accuracy_and_loss(Linear(), s, x, y, data(), 400)[1] for x, y, s in zip(xs, ys, states, strict=True)]


def test_personalised_accuracies_need_one_structure_and_samples_everywhere():
    (x1, y1, s1), (x2, y2, s2) = sample(5, 30), sample(5, 31)
    other = {"v": s2["w"]}
    assert accuracies_vectorized(Linear(), [s1, other], [x1, x2], [y1, y2], data(), 8) is None
    assert accuracies_vectorized(Linear(), [s1, {**s2, "extra": s2["w"]}], [x1, x2], [y1, y2], data(), 8) is None
    assert accuracies_vectorized(Linear(), [s1, s2], [x1, x2[:0]], [y1, y2[:0]], data(), 8) is None
    assert accuracies_vectorized(Linear(), [s1, s2], [x1, x2], [y1, y2], data(), 8) is not None


def test_accuracy_and_loss_evaluate_the_predictor_when_given():
    """A method's own predictor (FedRoD's personal head, kNN-Per's mixture) is what is scored, not the state."""
    x, y, state = sample(8, 5)
    flipped = {"w": -state["w"]}
    want = accuracy_and_loss(Linear(), flipped, x, y, data(), 3)
    got = accuracy_and_loss(Linear(), state, x, y, data(), 3, predictor=lambda inputs: inputs @ flipped["w"])
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]
    assert got[2] != accuracy_and_loss(Linear(), state, x, y, data(), 3)[2]
