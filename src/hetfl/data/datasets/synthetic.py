"""FedProx's Synthetic(alpha, beta) data (Li et al., "Federated Optimization in Heterogeneous Networks",
MLSys 2020, section 5.1; reference code: github.com/litian96/FedProx, data/synthetic_*/generate_synthetic.py).

Per device k: ``u_k ~ N(0, alpha)``, ``B_k ~ N(0, beta)``; the device's model
``W_k`` (classes x dim) and ``b_k`` have entries ``~ N(u_k, 1)``; its input
mean ``v_k`` has entries ``~ N(B_k, 1)``; inputs ``x ~ N(v_k, Sigma)`` with
``Sigma = diag(j^-1.2)``, j = 1..dim; labels ``y = argmax softmax(W_k x + b_k)``.
alpha controls how much local models differ, beta how much local inputs
differ. The IID variant shares ``W, b ~ N(0, 1)`` and draws ``x ~ N(0, Sigma)``.

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

import numpy as np

from hetfl.data.base import Dataset, DatasetInfo
from hetfl.data.datasets.common import Context, split


def sigma_diagonal(dim: int) -> np.ndarray:
    """The input covariance's diagonal, ``j^-1.2`` for j = 1..dim."""
    return np.arange(1, dim + 1, dtype=np.float64) ** -1.2


def _child_seed(seed: int, index: int) -> np.random.SeedSequence:
    """Child ``index`` of ``SeedSequence(seed).spawn(...)``, made on its own: the same stream without
    holding a seed object per device in memory at once (a million devices would hold a million)."""
    return np.random.SeedSequence(seed, spawn_key=(index,))


def generate(alpha: float, beta: float, num_devices: int, dim: int, num_classes: int, iid: bool, seed: int,
             max_samples: int = 5000) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features float32 ``[N, dim]``, labels int64 ``[N]``, device ids int64 ``[N]``)."""
    shared = np.random.default_rng(_child_seed(seed, 0))
    w_shared = shared.normal(0.0, 1.0, (num_classes, dim))
    b_shared = shared.normal(0.0, 1.0, num_classes)
    std = np.sqrt(sigma_diagonal(dim))
    xs, ys, groups = [], [], []
    for k in range(num_devices):
        rng = np.random.default_rng(_child_seed(seed, k + 1))
        n = int(rng.lognormal(4, 2)) + 50
        n = min(n, max_samples) if max_samples else n
        u_k = rng.normal(0.0, np.sqrt(alpha))
        b_k = rng.normal(0.0, np.sqrt(beta))
        if iid:
            w, b, v = w_shared, b_shared, np.zeros(dim)
        else:
            w = rng.normal(u_k, 1.0, (num_classes, dim))
            b = rng.normal(u_k, 1.0, num_classes)
            v = rng.normal(b_k, 1.0, dim)
        x = v + rng.standard_normal((n, dim)) * std
        xs.append(x.astype(np.float32))
        ys.append(np.argmax(x @ w.T + b, axis=1).astype(np.int64))  # softmax is monotone: argmax of the logits
        groups.append(np.full(n, k, dtype=np.int64))
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(groups)


def split_by_group(groups: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per group, ``round(test_fraction * n)`` random samples for test; returns sorted (train, test) indices."""
    rng = np.random.default_rng([seed, 1])
    train, test = [], []
    for g in np.unique(groups):
        index = rng.permutation(np.flatnonzero(groups == g))
        n_test = round(test_fraction * len(index))
        test.append(index[:n_test])
        train.append(index[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def load_synthetic(ctx: Context, alpha: float, beta: float, num_devices: int, dim: int, num_classes: int,
                   iid: bool, test_fraction: float, max_samples: int) -> Dataset:
    """Synthetic(alpha, beta) (or the IID variant) as a feature dataset; ``group`` = device index."""
    x, y, g = generate(alpha, beta, num_devices, dim, num_classes, iid, ctx.seed, max_samples)
    train, test = split_by_group(g, test_fraction, ctx.seed)
    info = DatasetInfo("synthetic", tuple(str(c) for c in range(num_classes)), (dim,),
                       groups=tuple(f"device{k}" for k in range(num_devices)))
    kind = "IID" if iid else f"alpha={alpha}, beta={beta}"
    return Dataset(info, split(x[train], y[train], g[train]), split(x[test], y[test], g[test]),
                   notes=[f"FedProx Synthetic({kind}), {num_devices} devices, {len(y)} samples, seed {ctx.seed}"])
