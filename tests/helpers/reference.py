"""The tiny federation the hand-loop references run on (tests/algorithms/test_*_reference.py): 5 Synthetic
clients of 8 features and 4 classes, a 8-6-4 MLP trained in full batches, 2 clients sampled a round, and the
reference's own forward pass of that MLP (nothing of hetfl's model code)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

EXECUTORS = {"sequential": [], "vectorized": ["runtime.executor=vectorized", "runtime.vmap_on_cpu=true"]}
W1, B1, W2, B2 = "encoder.1.weight", "encoder.1.bias", "classifier.weight", "classifier.bias"
PARAMS = (W1, B1, W2, B2)
ENCODER, HEAD = (W1, B1), (W2, B2)


def tiny_federation(rounds: int, steps: int, lr: float) -> list[str]:
    """The settings: ``rounds`` rounds of ``steps`` full-batch local steps at learning rate ``lr``."""
    return ["data.num_clients=5", "data.options={num_devices = 5, max_samples = 90, dim = 8, num_classes = 4}",
            "model.name=mlp", "model.options={hidden = [6]}", "train.batch_size=1000", f"train.local_epochs={steps}",
            "train.clients_per_round=2", f"train.lr={lr}", f"train.rounds={rounds}", "runtime.progress=false",
            "runtime.threads=1"]


def features(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return F.relu(F.linear(x, p[W1], p[B1]))


def logits(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return F.linear(features(p, x), p[W2], p[B2])
