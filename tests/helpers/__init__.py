"""Small shared pieces for the tests: a tiny model with the encoder/classifier split and a
small MNIST federation. Fixtures are in tests/conftest.py; helpers for one area of the tests
are in the modules of this package (executors, fedbr, datasets, figures, runs)."""

from __future__ import annotations

import hashlib
import os
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from torch import nn

from hetfl.algorithms.base import ClientContext, ModelCaller, Setup, Tensors
from hetfl.config import TrainConfig

SHARED_DATASETS = Path(__file__).resolve().parents[3] / "shared" / "datasets"
MNIST = SHARED_DATASETS / "mnist"
#: Tests on real data run wherever ../shared/datasets exists (the development machines and CI); they are
#: skipped only where that folder is absent altogether. A file missing inside it fails the test, not skips it.
needs_shared_data = pytest.mark.skipif(
    not SHARED_DATASETS.is_dir(),
    reason=f"real-data test not run: {SHARED_DATASETS} is absent on this machine",
)
# 5 clients x 200 MNIST samples (dominant-class split), an MLP, 3 rounds: learns in seconds
SMALL_MNIST = [
    "data.dataset=mnist", f"data.root={MNIST}", "data.download=false", "data.partition=dominant",
    "data.samples_per_client=200", "data.num_clients=5", "model.name=mlp", "model.options={hidden = [64]}",
    "train.rounds=3", "train.local_epochs=2", "train.batch_size=32", "train.lr=0.05", "runtime.progress=false",
]


class TinyNet(nn.Module):
    """4 -> 8 encoder (with BatchNorm1d before its ReLU if ``batchnorm``: running statistics as buffers),
    optional 8 -> 8 projector, 8 -> 3 classifier."""

    def __init__(self, projector: bool = True, seed: int = 0, batchnorm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        norm = [nn.BatchNorm1d(8)] if batchnorm else []
        self.encoder = nn.Sequential(nn.Linear(4, 8), *norm, nn.ReLU())
        self.projector = nn.Sequential(nn.Linear(8, 8), nn.ReLU()) if projector else None
        self.classifier = nn.Linear(8, 3)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        z = self.encoder(x)
        return self.projector(z) if self.projector is not None else z

    def forward(self, x, return_features: bool = False):
        z = self.features(x)
        logits = self.classifier(z)
        return (z, logits) if return_features else logits


def pythonpath_before(sources: Path) -> str:
    """``PYTHONPATH`` for a started process: ``sources`` first (this copy's hetfl, not an installed one), then
    the path the tests run with (where the dependencies may come from: a machine without a registry installs
    wheels into a folder and puts it on ``PYTHONPATH``)."""
    return os.pathsep.join([str(sources), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


#: the privacy accountant is an optional extra (``hetfl[privacy]``, in ``[test]``): tests that need it are
#: skipped without it, as Flower's are without Flower; CI, which installs ``[test]``, fails instead
#: (tests/test_environment.py)
needs_accountant = pytest.mark.skipif(find_spec("dp_accounting") is None,
                                      reason='the privacy accountant is not installed: pip install "hetfl[privacy]"')


def tiny_setup(num_clients: int = 4, momentum: float = 0.0, **train) -> Setup:
    model = TinyNet()
    names = [n for n, _ in model.named_parameters()]
    groups = {part: [n for n in names if n.startswith(part + ".")] for part in ("encoder", "projector", "classifier")}
    return Setup(
        model=ModelCaller(model),
        groups=groups,
        num_clients=num_clients,
        num_classes=3,
        client_sizes=[10] * num_clients,
        train=TrainConfig(momentum=momentum, **train),
        seed=0,
    )


def initial_state(setup: Setup) -> Tensors:
    return {k: v.detach().clone() for k, v in setup.model.module.state_dict().items()}


def context(client: int, payload: Tensors, state: Tensors | None = None, lr: float = 0.1) -> ClientContext:
    return ClientContext(client, 1, 10, lr, payload, state or {})


def perturbed(state: Tensors, scale: float, seed: int) -> Tensors:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in state.items()}


def release_digest_reference(named: list[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 of named tensors in order: name, dtype, shape, then the bytes; privacy.release_digest's layout,
    written out independently as the tests' reference."""
    h = hashlib.sha256()
    for name, t in named:
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()
