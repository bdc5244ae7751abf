"""FedProx's Synthetic(alpha, beta) data (Li et al., MLSys 2020, section 5.1).

Per device k: ``u_k ~ N(0, alpha)``, ``B_k ~ N(0, beta)``; the device's model
``W_k`` (10 x 60) and ``b_k`` have entries ``~ N(u_k, 1)``; its input mean
``v_k`` has entries ``~ N(B_k, 1)``; inputs ``x ~ N(v_k, Sigma)`` with
``Sigma = diag(j^-1.2)``; labels ``y = argmax softmax(W_k x + b_k)``. alpha
sets how much local models differ, beta how much local inputs differ. The IID
variant shares ``W, b ~ N(0, 1)`` and draws ``x ~ N(0, Sigma)``.

As in the paper, alpha and beta are variances (the reference code passes
them as standard deviations; identical at the usual alpha = beta = 1). Device
sizes follow the reference code's power law, ``lognormal(4, 2) + 50``
samples (optionally capped by ``max_samples``).
"""

from __future__ import annotations

import numpy as np


def generate_synthetic(
    alpha: float, beta: float, num_devices: int, dim: int, num_classes: int, iid: bool, seed: int,
    max_samples: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features float32 [N, dim], labels int64 [N], device id int64 [N])."""
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(4, 2, num_devices).astype(np.int64) + 50
    if max_samples:
        sizes = np.minimum(sizes, max_samples)
    u = rng.normal(0.0, np.sqrt(alpha), num_devices)
    b_shift = rng.normal(0.0, np.sqrt(beta), num_devices)
    sigma_sqrt = np.arange(1, dim + 1, dtype=np.float64) ** (-1.2 / 2)
    if iid:
        w_shared = rng.normal(0.0, 1.0, (num_classes, dim))
        b_shared = rng.normal(0.0, 1.0, num_classes)
    xs, ys, groups = [], [], []
    for k in range(num_devices):
        if iid:
            w, b, v = w_shared, b_shared, np.zeros(dim)
        else:
            w = rng.normal(u[k], 1.0, (num_classes, dim))
            b = rng.normal(u[k], 1.0, num_classes)
            v = rng.normal(b_shift[k], 1.0, dim)
        x = v + rng.standard_normal((sizes[k], dim)) * sigma_sqrt
        xs.append(x.astype(np.float32))
        ys.append(np.argmax(x @ w.T + b, axis=1).astype(np.int64))  # softmax is monotone
        groups.append(np.full(sizes[k], k, dtype=np.int64))
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(groups)


def split_by_group(groups: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per group, a random ``test_fraction`` of the samples for test; returns (train idx, test idx)."""
    rng = np.random.default_rng(seed + 1)
    train, test = [], []
    for g in np.unique(groups):
        idx = rng.permutation(np.flatnonzero(groups == g))
        n_test = round(test_fraction * len(idx))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))
