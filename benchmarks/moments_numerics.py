"""How far CCVR's Gaussians derived from additive moments are from the paper's pooling (eq. 2-4).

Clients can upload per-class moments (count, sum of z, sum of z z^T), which pool by addition
(secure aggregation), instead of (count, mean, unbiased covariance), which pool by eq. 3-4.
Both give the same Gaussians in exact arithmetic; in float64 the raw-moment form
``S = (Q - n mu mu^T) / (n - 1)`` cancels when |mu| is large against the spread. This script
measures, per case, for the per-class means and covariances pooled over 10 clients
(Dirichlet 0.1 label split, so classes with 0, 1 or a few samples at a client):

- ``moments vs eq. 2-4``: max over classes of max_ij |S_mom - S_eq| / max_ij |S_eq| (normwise);
- ``worst variance``: max over classes and coordinates with a positive variance of the relative
  difference of the diagonal (a coordinate's own variance, however small);
- both forms against a two-pass reference in extended precision (numpy longdouble, 64-bit
  significand on x86-64), to tell which form is off.

Cases: the features (classifier input) of an MLP [64] trained two epochs on MNIST (ReLU), of
FedPAC's CNN (random initialisation, 128-d, LeakyReLU) on MNIST, the MLP's features shifted by ``k`` times their
per-coordinate standard deviation (k = 10, 100, 1000), and Gaussians with mean 1e4 x std
(the adversarial case).

    python benchmarks/moments_numerics.py --data ../shared/datasets [--samples 20000]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import numpy as np
import torch

from hetfl.algorithms.gaussian_stats import (
    class_moments,
    class_statistics,
    pool_statistics,
    stats_from_moments,
    sum_moments,
)
from hetfl.data.datasets.idx import read_pair
from hetfl.models import build_model

NUM_CLASSES, CLIENTS = 10, 10
NOTE = """Covariances of each class pooled over 10 clients (Dirichlet 0.1 label split of the MNIST samples).
Normwise: max over classes of max_ij |difference| / max_ij |S_c|. Worst variance: max over classes and
coordinates of the relative difference of a positive variance. Reference: two-pass mean and covariance in
numpy longdouble. In the shifted cases the worst variance is that of a coordinate whose spread within a class
is far below the shift (k times its standard deviation over all classes).
"""


def reference(z: torch.Tensor, y: torch.Tensor) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Two-pass mean and unbiased covariance per class in numpy longdouble (the float64 input is exact there)."""
    means, covs = [], []
    x = z.numpy().astype(np.longdouble)
    for c in range(NUM_CLASSES):
        rows = x[(y == c).numpy()]
        mu = rows.mean(0)
        centred = rows - mu
        means.append(mu)
        covs.append(centred.T @ centred / (len(rows) - 1) if len(rows) > 1 else np.zeros((z.shape[1],) * 2))
    return means, covs


def errors(a: torch.Tensor, b, ref: list[np.ndarray], counts: torch.Tensor) -> tuple[float, float]:
    """(normwise, worst relative variance) difference of covariances ``a`` against ``b``, classes with N_c >= 2;
    the variances compared are those positive in the reference ``ref`` (a constant coordinate has none)."""
    norm = diag = 0.0
    for c in range(NUM_CLASSES):
        if counts[c] < 2:
            continue
        other = np.asarray(b[c], dtype=np.longdouble)
        diff = np.abs(a[c].numpy().astype(np.longdouble) - other)
        norm = max(norm, float(diff.max() / np.abs(other).max()))
        positive = np.diag(ref[c]) > 0
        if positive.any():
            diag = max(diag, float((np.diag(diff)[positive] / np.abs(np.diag(other)[positive])).max()))
    return norm, diag


def measure(name: str, z: torch.Tensor, y: torch.Tensor, owner: torch.Tensor) -> dict:
    z = z.double()
    per_client = [(z[owner == k], y[owner == k]) for k in range(CLIENTS)]
    eq = pool_statistics([class_statistics(f, lab, NUM_CLASSES) for f, lab in per_client])
    mom = stats_from_moments(sum_moments([class_moments(f, lab, NUM_CLASSES) for f, lab in per_client]))
    _, ref = reference(z, y)
    # the ratio that sets the cancellation: |mu_c|^2 / tr S_c = mean square of the mean over mean variance
    ratio = max(float((z[y == c].mean(0).norm() ** 2 / z[y == c].var(0).sum()).sqrt()) for c in range(NUM_CLASSES))
    return {"case": name, "n": len(y), "d": z.shape[1], "mean_over_std": ratio,
            "moments_vs_eq": errors(mom.covs, eq.covs, ref, eq.counts),
            "moments_vs_ref": errors(mom.covs, ref, ref, eq.counts),
            "eq_vs_ref": errors(eq.covs, ref, ref, eq.counts),
            "means_moments_vs_eq": float((mom.means - eq.means).abs().max() / eq.means.abs().max())}


def load_mnist(root: Path, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = read_pair(root / "train-images-idx3-ubyte.gz", root / "train-labels-idx1-ubyte.gz")
    x = (torch.from_numpy(x[:samples].copy()).float().unsqueeze(1) / 255 - 0.1307) / 0.3081
    return x, torch.from_numpy(y[:samples])


def features(model, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return torch.cat([model.features(x[i : i + 2000]) for i in range(0, len(x), 2000)])


def trained_mlp(x: torch.Tensor, y: torch.Tensor) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model("mlp", (1, 28, 28), NUM_CLASSES, hidden=(64,))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        for idx in torch.randperm(len(y), generator=gen).split(64):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("../shared/datasets"))
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/moments_numerics.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, y = load_mnist(args.data / "mnist", args.samples)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # the Dirichlet draw uses the global stream
    shares = torch.distributions.Dirichlet(torch.full((CLIENTS,), 0.1)).sample((NUM_CLASSES,))  # [C, K]
    owner = torch.multinomial(shares[y], 1, generator=gen).flatten()
    rows = []
    mlp = features(trained_mlp(x, y), x)
    rows.append(measure("MLP [64], trained 2 epochs, ReLU features", mlp, y, owner))
    torch.manual_seed(0)
    cnn = features(build_model("fedpac_cnn", (1, 28, 28), NUM_CLASSES), x)
    rows.append(measure("FedPAC CNN, random init, LeakyReLU features", cnn, y, owner))
    std = mlp.double().std(0).clamp(min=1e-12)
    for k in (10, 100, 1000):
        rows.append(measure(f"MLP features + {k} x std", mlp.double() + k * std, y, owner))
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(len(y), 64, generator=g, dtype=torch.float64) + 1e4 * (1 + torch.rand(64, generator=g,
                                                                                             dtype=torch.float64))
    rows.append(measure("Gaussian, mean 1e4 x std", adv, y, owner))
    lines = ["| case | n, d | max_c norm(mu_c) / sqrt(tr S_c) | moments vs eq. 2-4: normwise, worst variance | "
             "moments vs reference | eq. 2-4 vs reference |", "|---|---|---|---|---|---|"]
    for r in rows:
        pair = {k: f"{r[k][0]:.1e}, {r[k][1]:.1e}" for k in ("moments_vs_eq", "moments_vs_ref", "eq_vs_ref")}
        lines.append(f"| {r['case']} | {r['n']}, {r['d']} | {r['mean_over_std']:.3g} | {pair['moments_vs_eq']} | "
                     f"{pair['moments_vs_ref']} | {pair['eq_vs_ref']} |")
    print("\n".join(lines))
    machine = f"torch {torch.__version__}, {platform.machine()}, numpy longdouble eps {np.finfo(np.longdouble).eps:.1e}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "samples": args.samples, "rows": rows}, indent=1) + "\n")
    command = f"python benchmarks/moments_numerics.py --samples {args.samples}"
    args.out.with_suffix(".md").write_text(f"# Additive moments against eq. 2-4\n\n`{command}` ({machine}).\n\n"
                                           + "\n".join(lines) + "\n\n" + NOTE)


if __name__ == "__main__":
    main()
