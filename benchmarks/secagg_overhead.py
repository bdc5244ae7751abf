"""What SecAgg+ costs CCVR's statistics round on Flower, and how far its fixed point moves the statistics.

The same fedavg+ccvr configuration and seed runs twice in one Flower simulation (Ray starts once):
with plain post-hoc replies and with ``runtime.secure_aggregation = true`` (Flower's SecAgg+,
``hetfl.flower.secagg``). It records the wall time of the statistics round (the federation's
``posthoc_replies``: send the model, the clients' features and moments, the replies or the four
SecAgg+ stages, decoding), each run's total wall time, the bytes Flower carried in the last round,
and both runs' final accuracy (they differ in CCVR's last digits: the statistics are quantised, so
the virtual features drawn from them differ slightly). Each mode runs ``--repeats`` times, alternating.

Then, on the plain run's final encoder (its checkpoint), in one process: the clients' moments summed
plainly and through the secure code, compared entry by entry (``max |secure - plain| / bound``, the
stated bound being ``n / T``) and through the pooled per-class covariance CCVR samples from.

Default: MNIST, FedPAC's dominant-class split over 10 clients of 600 samples, the 2-conv CNN, 2 rounds
of 20 local steps, 1 torch thread per process. Writes ``benchmarks/results/secagg_overhead.{json,md}``.

    python benchmarks/secagg_overhead.py --data /work/shared/datasets
    python benchmarks/secagg_overhead.py --tiny      # synthetic data, a quick check that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from hetfl import config
from hetfl.algorithms.base import without_feature_transforms
from hetfl.algorithms.gaussian_stats import stats_from_moments as moments_to_stats
from hetfl.engine import secure_sum
from hetfl.engine.checkpoint import load_checkpoint
from hetfl.engine.experiment import Experiment

BASE = ["algorithm.name=fedavg+ccvr", "data.dataset=mnist", "data.root={data}/mnist", "data.partition=dominant",
        "data.samples_per_client=600", "data.num_clients=10", "model.name=cnn2", "train.rounds=2",
        "train.local_steps=20", "train.batch_size=32", "train.lr=0.05", "runtime.progress=false",
        "runtime.threads=1", "runtime.flower_timeout_s=900"]
TINY = ["algorithm.name=fedavg+ccvr", "data.dataset=synthetic", "data.partition=dirichlet", "data.num_clients=4",
        "model.options={hidden = [16]}", "train.rounds=2", "train.local_steps=5", "train.batch_size=16",
        "runtime.progress=false", "runtime.threads=1", "runtime.flower_timeout_s=300"]
TIMES: dict[bool, list[float]] = {False: [], True: []}


def timed_posthoc() -> None:
    """Time every FlowerFederation.posthoc_replies call (the statistics round), by secure_aggregation."""
    from hetfl.flower.server import FlowerFederation

    original = FlowerFederation.posthoc_replies

    def posthoc_replies(self: Any, step: Any, raw: Any, round_: int) -> Any:
        t0 = time.perf_counter()
        out = original(self, step, raw, round_)
        TIMES[bool(self.exp.cfg.runtime.secure_aggregation)].append(time.perf_counter() - t0)
        return out

    FlowerFederation.posthoc_replies = posthoc_replies  # type: ignore[method-assign]


def statistics_error(overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """The plain and the secure sum of the clients' moments on ``run_dir``'s final encoder, compared."""
    exp = Experiment(config.load(None, overrides))
    step = exp.posthoc[0]
    raw = without_feature_transforms(load_checkpoint(run_dir, exp.device).server.model)
    replies = {}
    for c in range(exp.data.num_clients):
        feats, labels = exp.client_features(raw, c)
        replies[c] = step.client_query(raw, feats, labels, client=c, round_=0)
    n, levels, bounds = len(replies), secure_sum.quantization_range(len(replies)), step.reply_bounds()
    secure = secure_sum.simulate(step, replies, levels)
    plain_m, secure_m = step.summed_moments(replies), step.summed_moments(secure)
    out: dict[str, Any] = {"clients": n, "levels_T": levels, "bounds": bounds, "clipped_entries": secure.clipped,
                           "stated_max_error_over_bound": n / levels}
    for name in ("counts", "sums", "outer"):
        diff = (getattr(secure_m, name) - getattr(plain_m, name)).abs()
        out[f"{name}_max_error_over_bound"] = diff.max().item() / bounds[name]
        out[f"{name}_max_abs_error"] = diff.max().item()
    plain_s, secure_s = moments_to_stats(plain_m), moments_to_stats(secure_m)
    ok = plain_m.counts >= 2
    cov_diff = (secure_s.covs[ok] - plain_s.covs[ok]).abs().max().item()
    out["cov_max_abs_error"] = cov_diff
    out["cov_max_abs_error_over_max_abs_cov"] = cov_diff / plain_s.covs[ok].abs().max().item()
    out["mean_max_abs_error"] = (secure_s.means[ok] - plain_s.means[ok]).abs().max().item()
    out["feature_norm_max"] = max(exp.client_features(raw, c)[0].norm(dim=1).max().item() for c in range(n))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="/work/shared/datasets", help="folder holding mnist/")
    parser.add_argument("--tiny", action="store_true", help="synthetic data: a quick check that it runs")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternating")
    parser.add_argument("--out", default="benchmarks/results", help="where the json and md go")
    parser.add_argument("--work", default="/tmp/hetfl_secagg_overhead", help="run directories (deleted first)")
    args = parser.parse_args()
    overrides = TINY if args.tiny else [o.format(data=args.data) for o in BASE]
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    timed_posthoc()
    from hetfl.flower.simulation import run_simulations

    torch.set_num_threads(1)
    jobs, order = [], []
    for rep in range(args.repeats):  # alternating, so that neither mode carries the nodes' start-up alone
        for secure in (False, True):
            flag = f"runtime.secure_aggregation={str(secure).lower()}"
            cfg = config.load(None, [*overrides, "runtime.executor=flower", flag])
            jobs.append((Experiment(cfg), work / f"{'secagg' if secure else 'plain'}_{rep}", False))
            order.append(secure)
    t0 = time.perf_counter()
    summaries = run_simulations(jobs)
    simulation_s = time.perf_counter() - t0
    runs: dict[str, Any] = {"plain": {}, "secagg": {}}
    for (_, run_dir, _), secure, summary in zip(jobs, order, summaries, strict=True):
        last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        entry = runs["secagg" if secure else "plain"]
        entry.setdefault("run_wall_time_s", []).append(summary["wall_time_s"])
        entry.setdefault("final_global_acc", []).append(summary["final_global_acc"])
        entry["last_round"] = {k: last.get(k) for k in ("bytes_up", "flower_bytes_up", "flower_bytes_down",
                                                         "failed_clients", "secagg_clients", "secagg_clipped_entries")}
    for secure in (False, True):
        entry = runs["secagg" if secure else "plain"]
        entry["statistics_round_s"] = TIMES[secure]
        entry["statistics_round_median_s"] = statistics.median(TIMES[secure])
        entry["run_wall_time_median_s"] = statistics.median(entry["run_wall_time_s"])
    result = {
        "command": "python benchmarks/secagg_overhead.py" + (" --tiny" if args.tiny else f" --data {args.data}"),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "flwr": __import__("flwr").__version__},
        "config": overrides, "simulation_wall_s": simulation_s, "runs": runs,
        "statistics_error": statistics_error(overrides, work / "plain_0"),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "secagg_overhead_tiny" if args.tiny else "secagg_overhead"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
