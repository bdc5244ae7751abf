"""A differential fuzz of configurations: random combinations of methods, data, partitions, models and
training settings, each run by the sequential executor and by the vectorised one (vmapped on the CPU, the
code a GPU runs), on small real data.

What a single test of one method misses is where settings meet: a model with a precision, a partition with
a post-hoc step, a method with a sampled federation. Every drawn configuration is checked for

- a crash: an exception that is not one of hetfl's refusals (its errors are ``ValueError`` s of hetfl's
  modules, naming the key, the value and what is allowed), in either executor;
- a fallback: the vectorised executor ran sequential clients (its "falling back" note), for a
  configuration whose method vmaps elsewhere;
- a gap: in float32, round 1's training loss of the two executors more than 1e-4 apart (relative). Later
  rounds are not compared: some models amplify a last-bit difference within steps (FedUV's CNN: 1e-5 after
  one step, 1e-2 after two, also between two sequential runs on one and two threads); in bf16 the
  executors' kernels round differently, so nothing is compared;
- a non-finite number in the metrics of a run that did not report divergence.

Found with it (session 35): every BatchNorm model's bf16 vmapped step fell back to sequential clients
(PyTorch's batching rule refuses a bfloat16 input with float32 running statistics on the CPU; fixed in
``hetfl.models.layers``). Not a test (minutes to hours); one command:

    python benchmarks/config_fuzz.py --data ../shared/datasets --count 100 --seed 0

Writes ``benchmarks/results/config_fuzz_<device>.md`` (findings, then every configuration's outcome) and a
``.jsonl`` beside it, one line per configuration, appended as it goes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import random
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from hetfl import config
from hetfl.algorithms import available
from hetfl.engine.experiment import Experiment

RESULTS = Path(__file__).resolve().parent / "results"

#: per dataset: its settings (ROOT: the datasets folder) and the models drawn for it (CPU-sized: no VGG-11,
#: MobileNetV2, ResNets or CCT, whose evaluation on 10,000 test images, and CCVR's features of the 50,000
#: training images, take minutes on a CPU: CCT's attention at eval batch 1,024 holds gigabytes)
DATASETS = {
    "synthetic": ([], ["mlp", "auto"]),
    "mnist": (["data.dataset=mnist", "data.root=ROOT/mnist", "data.download=false"],
              ["simple_cnn", "cnn2", "mlp", "fedpac_cnn", "feduv_cnn", "fedbr_cnn"]),
    "cifar10": (["data.dataset=cifar10", "data.root=ROOT/cifar10-jpeg.tar.gz", "data.download=false"],
                ["simple_cnn", "cnn2", "fedpac_cnn", "feduv_cnn", "fedbr_cnn"]),
}
PARTITIONS = {"synthetic": ["natural", "dirichlet", "iid", "shards", "quantity"],
              "mnist": ["dirichlet", "iid", "shards", "dominant", "quantity", "rotation", "concept"],
              "cifar10": ["dirichlet", "iid", "shards", "dominant", "quantity", "rotation"]}


def draw(rng: random.Random, datasets: list[str]) -> list[str]:
    """One configuration as ``--set`` overrides (some invalid on purpose: a refusal is a valid outcome)."""
    method = rng.choice(available())
    if rng.random() < 0.2 and method != "local":
        method += "+ccvr"
    dataset = rng.choice(datasets)
    base, models = DATASETS[dataset]
    clients = rng.choice([3, 4, 6])
    sets = [*base, f"algorithm.name={method}", f"model.name={rng.choice(models)}",
            f"data.partition={rng.choice(PARTITIONS[dataset])}", f"data.num_clients={clients}",
            f"train.rounds={rng.choice([2, 3])}", f"seed={rng.randint(0, 99)}",
            f"train.batch_size={rng.choice([4, 7, 16])}", f"train.lr={rng.choice([0.01, 0.05])}",
            "train.eval_every=100"]  # evaluated once, after the last round
    if dataset == "synthetic":
        sets.append(f"data.options={{max_samples=60, num_devices={clients}}}")
    if dataset != "synthetic" or rng.random() < 0.5:
        sets.append(f"train.local_steps={rng.choice([1, 2, 3])}")
    else:
        sets.append(f"train.local_epochs={rng.choice([1, 2])}")
    if rng.random() < 0.4:
        sets.append(f"train.clients_per_round={rng.randint(1, clients)}")
    optional = [(0.3, "train.drop_last=true"), (0.4, f"train.momentum={rng.choice([0.5, 0.9])}"),
                (0.3, "train.weight_decay=0.001"), (0.3, "train.max_grad_norm=1.0"), (0.25, "train.precision=bf16"),
                (0.3, "train.lr_schedule=cosine"), (0.2, "train.weighting=uniform")]
    sets += [setting for p, setting in optional if rng.random() < p]
    if dataset == "cifar10" and rng.random() < 0.5:
        sets.append(f"data.augment={rng.choice(['none', 'crop_flip'])}")
    return sets


def refusal(err: BaseException) -> bool:
    """hetfl's own refusal of a configuration (a ValueError of one of its modules), not a crash."""
    return isinstance(err, ValueError) and type(err).__module__.startswith("hetfl")


def run_once(sets: list[str], executor: list[str], folder: Path) -> dict:
    """One run; its outcome, round-1 loss, metrics' non-finite keys and the executor's notes."""
    start = time.perf_counter()
    out: dict = {}
    try:
        exp = Experiment(config.load(None, [*sets, *executor, "runtime.progress=false", "runtime.device=cpu",
                                            "runtime.checkpoint_every=0"]))
        summary = exp.run(folder)
        lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        out.update(outcome="ok", loss1=lines[0].get("train_loss"), notes=sorted(exp.__dict__.get("_notes", ())),
                   nonfinite=[] if summary.get("diverged_round") is not None else
                   sorted({k for x in lines for k, v in x.items() if isinstance(v, float) and not math.isfinite(v)}))
    except Exception as err:  # every kind is the point
        out.update(outcome="refused" if refusal(err) else "crash", error=f"{type(err).__name__}: {err}"[:500])
        if out["outcome"] == "crash":
            out["trace"] = traceback.format_exc()[-2000:]
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def check(drawn: list[str], root: str, scratch: Path) -> dict:
    """Both executors on one drawn configuration (``ROOT`` in it: the datasets folder ``root``)."""
    sets = [s.replace("ROOT", root) for s in drawn]
    record: dict = {"sets": drawn, "seq": run_once(sets, ["runtime.executor=sequential"], scratch / "seq")}
    if record["seq"]["outcome"] == "ok":
        record["vec"] = run_once(sets, ["runtime.executor=vectorized", "runtime.vmap_on_cpu=true"], scratch / "vec")
    shutil.rmtree(scratch, ignore_errors=True)
    findings = []
    for name in ("seq", "vec"):
        run = record.get(name, {})
        if run.get("outcome") == "crash":
            findings.append(f"{name} crashed: {run['error']}")
        if run.get("nonfinite"):
            findings.append(f"{name}: non-finite {run['nonfinite']} without divergence")
    vec = record.get("vec", {})
    if any("falling back" in n for n in vec.get("notes", ())):
        findings.append("vectorised fell back: " + next(n for n in vec["notes"] if "falling back" in n))
    if vec.get("outcome") == "ok" and "train.precision=bf16" not in sets:
        a, b = record["seq"]["loss1"], vec["loss1"]
        if a is not None and b is not None and abs(a - b) > 1e-4 * max(1.0, abs(a)):
            findings.append(f"round 1 train_loss: sequential {a!r}, vectorised {b!r}")
    record["findings"] = findings
    return record


def write_markdown(records: list[dict], path: Path, command: str) -> None:
    counts: dict[str, int] = {}
    for r in records:
        key = "finding" if r["findings"] else r["seq"]["outcome"]
        counts[key] = counts.get(key, 0) + 1
    lines = ["# Config fuzz: both executors on random configurations (benchmarks/config_fuzz.py)", "",
             f"`{command}` on {platform.machine()} ({torch.get_num_threads()} threads, torch {torch.__version__}), "
             f"{dt.date.today()}: {len(records)} configurations; "
             + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), "", "## Findings", ""]
    found = [r for r in records if r["findings"]]
    lines += [f"- `{' '.join(r['sets'])}`: " + "; ".join(r["findings"]) for r in found] or ["none"]
    lines += ["", "## Every configuration", "", "| # | method | model | outcome | s (seq / vec) |",
              "|---|---|---|---|---|"]
    for i, r in enumerate(records):
        get = dict(s.split("=", 1) for s in r["sets"] if "=" in s)
        outcome = "finding" if r["findings"] else r["seq"]["outcome"]
        if outcome == "refused":
            outcome += ": " + r["seq"]["error"].split(":", 1)[0]
        seconds = f"{r['seq']['seconds']} / {r.get('vec', {}).get('seconds', '-')}"
        lines.append(f"| {i} | {get.get('algorithm.name')} | {get.get('model.name')} | {outcome} | {seconds} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="../shared/datasets", help="folder holding mnist/ and cifar10-jpeg.tar.gz")
    parser.add_argument("--count", type=int, default=50, help="configurations to draw")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws")
    parser.add_argument("--datasets", nargs="+", default=["synthetic", "synthetic", "mnist", "mnist", "cifar10"],
                        choices=sorted(DATASETS), help="drawn from, with repeats as weights")
    parser.add_argument("--budget-s", type=float, default=math.inf, help="stop drawing after this many seconds")
    parser.add_argument("--out", default=str(RESULTS / "config_fuzz_cpu.md"))
    args = parser.parse_args(argv)
    root = str(Path(args.data).resolve())
    rng = random.Random(args.seed)
    out = Path(args.out)
    log = out.with_suffix(".jsonl")
    records: list[dict] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.count):
            if time.perf_counter() - start > args.budget_s:
                break
            sets = draw(rng, args.datasets)
            record = check(sets, root, Path(tmp) / str(i))
            records.append(record)
            with log.open("a") as f:
                f.write(json.dumps({"seed": args.seed, "i": i, **record}) + "\n")
            print(i, "FINDING " + "; ".join(record["findings"]) if record["findings"] else record["seq"]["outcome"],
                  " ".join(s for s in sets if s.startswith(("algorithm.", "model."))), flush=True)
    write_markdown(records, out, "python benchmarks/config_fuzz.py " + " ".join(sys.argv[1:] if argv is None else argv))
    return 1 if any(r["findings"] for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
