"""What a run's final global model does on the test set: the numbers behind a method's accuracy.

For each run directory given: accuracy, mean feature norm (classifier input), mean
largest logit, the entropy of the predicted-class histogram (log 10 = every class
predicted equally often; 0 = one class for everything), how many classes the model
ever predicts, the per-class recall, and the effective rank of the feature covariance.
Used to see why one method's global model trails another's (the FedUV findings).

    python benchmarks/global_model_diagnostics.py RUN_DIR [RUN_DIR ...] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from hetfl.analysis.run import RunAnalysis
from hetfl.analysis.spectrum import effective_rank


def diagnose(run_dir: Path, limit: int) -> dict:
    run = RunAnalysis(run_dir, probe=limit)
    exp, state = run.exp, run.server.model
    model = exp.caller
    model.module.eval()
    feats, logits = [], []
    with torch.no_grad():
        for i in range(0, len(run.probe_x), 1000):
            f, z = model.features_and_logits(state, run.probe_x[i : i + 1000])
            feats.append(f)
            logits.append(z)
    f, z, y = torch.cat(feats), torch.cat(logits), run.probe_y
    pred = z.argmax(1)
    num_classes = z.shape[1]
    hist = torch.bincount(pred, minlength=num_classes).double()
    p = hist / hist.sum()
    entropy = float(-(p[p > 0] * p[p > 0].log()).sum())
    recall = [float((pred[y == k] == k).double().mean()) if (y == k).any() else None for k in range(num_classes)]
    return {
        "run": str(run_dir), "round": run.round, "samples": len(y),
        "accuracy": float((pred == y).double().mean()),
        "feature_norm_mean": float(f.norm(dim=1).mean()),
        "max_logit_mean": float(z.max(1).values.mean()),
        "prediction_entropy": entropy, "prediction_entropy_max": math.log(num_classes),
        "classes_predicted": int((hist > 0).sum()),
        "per_class_recall": recall,
        "effective_rank": float(effective_rank(f.cpu())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--limit", type=int, default=10_000, help="test samples used")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = [diagnose(r, args.limit) for r in args.runs]
    for row in rows:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                          if k != "per_class_recall"}))
        print("  recall per class:", [None if r is None else round(r, 2) for r in row["per_class_recall"]])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
