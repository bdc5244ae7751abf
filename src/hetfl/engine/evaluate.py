"""Evaluation: a model state on a set of inputs, in large batches, no grad."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hetfl.algorithms.base import ModelCaller, Tensors
from hetfl.engine.data import FederatedData

Predictor = Callable[[torch.Tensor], torch.Tensor]


@torch.no_grad()
def predict(
    model: ModelCaller,
    state: Tensors,
    x: torch.Tensor,
    data: FederatedData,
    batch_size: int,
    predictor: Predictor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(predicted labels, logits) of model ``state`` (or of ``predictor``, a function of
    prepared inputs) for raw inputs ``x``, in eval mode."""
    forward = predictor or (lambda inputs: model.logits(state, inputs))
    was_training = model.module.training
    model.module.eval()
    try:
        logits = torch.cat(
            [forward(data.prepare(x[i : i + batch_size])) for i in range(0, len(x), batch_size)]
        ) if len(x) else torch.zeros(0, data.info.num_classes, device=x.device)
    finally:
        model.module.train(was_training)
    return logits.argmax(1), logits


def accuracy_and_loss(
    model: ModelCaller,
    state: Tensors,
    x: torch.Tensor,
    y: torch.Tensor,
    data: FederatedData,
    batch_size: int,
    predictor: Predictor | None = None,
) -> tuple[torch.Tensor, float, float]:
    """(per-sample correctness, accuracy, mean cross-entropy) of ``state`` (or ``predictor``) on ``(x, y)``."""
    preds, logits = predict(model, state, x, data, batch_size, predictor)
    correct = preds == y
    if len(y) == 0:
        return correct, float("nan"), float("nan")
    loss = torch.nn.functional.cross_entropy(logits.float(), y).item()
    return correct, int(correct.sum()) / len(y), loss  # the exact fraction, as accuracies_vectorized gives


@torch.no_grad()
def accuracies_vectorized(
    model: ModelCaller,
    states: list[Tensors],
    xs: list[torch.Tensor],
    ys: list[torch.Tensor],
    data: FederatedData,
    batch_size: int,
) -> list[float] | None:
    """Accuracy of each model ``states[i]`` on its own ``(xs[i], ys[i])``, all clients in one
    ``vmap``-ed forward per chunk of samples (the personalised evaluation of a round in a few
    calls). Shorter test sets are padded and masked. None when the states hold different tensor
    names (in any order; the caller then evaluates them one by one)."""
    names = tuple(states[0])
    if any(s.keys() != states[0].keys() for s in states) or any(len(y) == 0 for y in ys):
        return None
    stacked = {n: torch.stack([s[n] for s in states]) for n in names}
    k, longest = len(states), max(len(y) for y in ys)
    chunk = max(64, batch_size // k)
    correct = torch.zeros(k, device=ys[0].device)

    def logits(state: Tensors, x: torch.Tensor) -> torch.Tensor:
        return model.logits(state, data.prepare(x))

    was_training = model.module.training
    model.module.eval()
    try:
        for start in range(0, longest, chunk):
            end = min(start + chunk, longest)
            xb = torch.stack([_padded(x, start, end) for x in xs])
            yb = torch.stack([_padded(y, start, end) for y in ys])
            valid = torch.stack([torch.arange(start, end, device=yb.device) < len(y) for y in ys])
            pred = torch.func.vmap(logits)(stacked, xb).argmax(-1)
            correct += ((pred == yb) & valid).sum(1)
    finally:
        model.module.train(was_training)
    return [float(c) / len(y) for c, y in zip(correct.tolist(), ys, strict=True)]


def _padded(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows ``start:end`` of ``t``, padded with copies of row 0 past its end (masked by the caller)."""
    part = t[start:end]
    if len(part) == end - start:
        return part
    return torch.cat([part, t[:1].expand(end - start - len(part), *t.shape[1:])])
