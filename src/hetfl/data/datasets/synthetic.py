"""FedProx's Synthetic(alpha, beta) data (Li et al., "Federated Optimization in Heterogeneous Networks",
MLSys 2020, section 5.1; reference code: github.com/litian96/FedProx, data/synthetic_*/generate_synthetic.py).

Per device k: ``u_k ~ N(0, alpha)``, ``B_k ~ N(0, beta)``; the device's model
``W_k`` (classes x dim) and ``b_k`` have entries ``~ N(u_k, 1)``; its input
mean ``v_k`` has entries ``~ N(B_k, 1)``; inputs ``x ~ N(v_k, Sigma)`` with
``Sigma = diag(j^-1.2)``, j = 1..dim; labels ``y = argmax softmax(W_k x + b_k)``.
alpha controls how much local models differ, beta how much local inputs
differ. The IID variant shares ``W, b ~ N(0, 1)`` and draws ``x ~ N(0, Sigma)``.

alpha does not change the data, here as in the reference code: ``W_k, b_k``
having entries ``~ N(u_k, 1)`` adds ``u_k (sum_j x_j + 1)`` to every class's
logit alike, which leaves the argmax, the label, unchanged, and ``u_k`` takes
one draw of the device's generator whatever its variance. Synthetic(0, 0),
(0.5, 0.5) and (1, 1) differ through beta alone (the inputs' means); the
local models still differ through their ``N(0, 1)`` parts.

alpha and beta are variances, as in the paper (the reference code passes them
to ``np.random.normal`` as standard deviations; identical at the usual
alpha = beta = 1 and at 0). Device sizes follow the reference code's power
law, ``lognormal(4, 2) + 50`` samples, capped at ``max_samples`` (default
5000; 0 = no cap): the lognormal's tail reaches tens of thousands, and the cap
only touches the ~1% largest devices while bounding memory and round time.

Randomness: every device draws from its own generator spawned from
``SeedSequence(seed)``, so a seed gives the same data on every machine, and
device k's data does not depend on ``num_devices``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from hetfl.data.base import Dataset, DatasetInfo
from hetfl.data.datasets.common import Context, split
from hetfl.data.partition import group_slices


def sigma_diagonal(dim: int) -> np.ndarray:
    """The input covariance's diagonal, ``j^-1.2`` for j = 1..dim."""
    return np.arange(1, dim + 1, dtype=np.float64) ** -1.2


def _child_seed(seed: int, index: int) -> np.random.SeedSequence:
    """Child ``index`` of ``SeedSequence(seed).spawn(...)``, made on its own: the same stream without
    holding a seed object per device in memory at once (a million devices would hold a million)."""
    return np.random.SeedSequence(seed, spawn_key=(index,))


def device_sizes(num_devices: int, seed: int, max_samples: int = 5000) -> np.ndarray:
    """Each device's sample count, the first draw of its own generator: ``lognormal(4, 2) + 50``,
    capped at ``max_samples`` (0 = no cap). Known before any data is drawn, so the arrays can be
    allocated once at their final size instead of concatenated from per-device pieces."""
    sizes = np.empty(num_devices, dtype=np.int64)
    for k in range(num_devices):
        sizes[k] = _size(np.random.default_rng(_child_seed(seed, k + 1)), max_samples)
    return sizes


def _size(rng: np.random.Generator, max_samples: int) -> int:
    n = int(rng.lognormal(4, 2)) + 50
    return min(n, max_samples) if max_samples else n


@dataclass(frozen=True)
class _Spec:
    """What every device's draws depend on besides its index."""

    alpha: float
    beta: float
    dim: int
    num_classes: int
    iid: bool
    seed: int
    max_samples: int

    def shared(self) -> tuple[np.ndarray, np.ndarray]:
        """The IID variant's shared ``W, b ~ N(0, 1)`` (child 0; drawn for both variants)."""
        rng = np.random.default_rng(_child_seed(self.seed, 0))
        return rng.normal(0.0, 1.0, (self.num_classes, self.dim)), rng.normal(0.0, 1.0, self.num_classes)

    def device(self, k: int, shared: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Device ``k``'s inputs (float64 ``[n, dim]``; stored as float32) and labels, drawn from its
        own generator in the reference code's order: n, u_k, B_k, (W_k, b_k, v_k), x."""
        rng = np.random.default_rng(_child_seed(self.seed, k + 1))
        n = _size(rng, self.max_samples)
        u_k = rng.normal(0.0, np.sqrt(self.alpha))
        b_k = rng.normal(0.0, np.sqrt(self.beta))
        if self.iid:
            (w, b), v = shared, np.zeros(self.dim)
        else:
            w = rng.normal(u_k, 1.0, (self.num_classes, self.dim))
            b = rng.normal(u_k, 1.0, self.num_classes)
            v = rng.normal(b_k, 1.0, self.dim)
        x = rng.standard_normal((n, self.dim))  # x = v + z * sqrt(Sigma), in place (the same floats)
        x *= np.sqrt(sigma_diagonal(self.dim))
        x += v
        return x, np.argmax(x @ w.T + b, axis=1)  # softmax is monotone: argmax of the logits


def generate(alpha: float, beta: float, num_devices: int, dim: int, num_classes: int, iid: bool, seed: int,
             max_samples: int = 5000) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features float32 ``[N, dim]``, labels int64 ``[N]``, device ids int64 ``[N]``), devices in order.
    Each device's rows are written straight into arrays allocated once (no per-device pieces kept)."""
    spec = _Spec(alpha, beta, dim, num_classes, iid, seed, max_samples)
    sizes = device_sizes(num_devices, seed, max_samples)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    x = np.empty((int(starts[-1]), dim), dtype=np.float32)
    y = np.empty(int(starts[-1]), dtype=np.int64)
    shared = spec.shared()
    for k in range(num_devices):
        x[starts[k]:starts[k + 1]], y[starts[k]:starts[k + 1]] = spec.device(k, shared)
    return x, y, np.repeat(np.arange(num_devices, dtype=np.int64), sizes)


def split_by_group(groups: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per group, ``round(test_fraction * n)`` random samples for test; returns sorted (train, test) indices."""
    rng = np.random.default_rng([seed, 1])
    _, order, starts = group_slices(groups)
    is_test = np.zeros(len(groups), dtype=bool)
    for a, b in itertools.pairwise(starts):
        index = rng.permutation(order[a:b])
        is_test[index[:round(test_fraction * len(index))]] = True
    return np.flatnonzero(~is_test), np.flatnonzero(is_test)


def load_synthetic(ctx: Context, alpha: float, beta: float, num_devices: int, dim: int, num_classes: int,
                   iid: bool, test_fraction: float, max_samples: int) -> Dataset:
    """Synthetic(alpha, beta) (or the IID variant) as a feature dataset; ``group`` = device index.

    The same arrays as ``generate`` followed by ``split_by_group`` and indexing, made without
    them: each device's rows go straight to their places in the train and test arrays, so the
    data is held once (not as pieces, a concatenation and two indexed copies)."""
    spec = _Spec(alpha, beta, dim, num_classes, iid, ctx.seed, max_samples)
    sizes = device_sizes(num_devices, ctx.seed, max_samples)
    n_test = np.array([round(test_fraction * int(n)) for n in sizes], dtype=np.int64)
    n_train = sizes - n_test
    train_start = np.concatenate([[0], np.cumsum(n_train)])
    test_start = np.concatenate([[0], np.cumsum(n_test)])
    train_x = np.empty((int(train_start[-1]), dim), dtype=np.float32)
    test_x = np.empty((int(test_start[-1]), dim), dtype=np.float32)
    train_y, test_y = np.empty(len(train_x), dtype=np.int64), np.empty(len(test_x), dtype=np.int64)
    split_rng = np.random.default_rng([ctx.seed, 1])  # split_by_group's stream: one permutation per device
    shared = spec.shared()
    for k in range(num_devices):
        x, y = spec.device(k, shared)
        is_test = np.zeros(len(x), dtype=bool)
        is_test[split_rng.permutation(len(x))[: n_test[k]]] = True
        train, test = slice(train_start[k], train_start[k + 1]), slice(test_start[k], test_start[k + 1])
        train_x[train], train_y[train] = x[~is_test], y[~is_test]
        test_x[test], test_y[test] = x[is_test], y[is_test]
    devices = np.arange(num_devices, dtype=np.int64)
    info = DatasetInfo("synthetic", tuple(str(c) for c in range(num_classes)), (dim,),
                       groups=tuple(f"device{k}" for k in range(num_devices)))
    kind = "IID" if iid else f"alpha={alpha}, beta={beta}"
    return Dataset(info, split(train_x, train_y, np.repeat(devices, n_train)),
                   split(test_x, test_y, np.repeat(devices, n_test)),
                   notes=[f"FedProx Synthetic({kind}), {num_devices} devices, {int(sizes.sum())} samples, "
                          f"seed {ctx.seed}"])
