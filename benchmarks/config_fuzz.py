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
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import fuzz_common

from hetfl import config
from hetfl.algorithms import available
from hetfl.engine.experiment import Experiment

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
        fuzz_common.note_exception(out, err, refusal(err))
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
    lines = fuzz_common.report_head("Config fuzz: both executors on random configurations (benchmarks/config_fuzz.py)",
                                    command, records, "seq")
    lines += fuzz_common.two_run_table(records, "seq", "vec", "s (seq / vec)")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fuzz_common.add_arguments(parser, count=50, datasets=fuzz_common.DEFAULT_DATASETS, dataset_names=list(DATASETS),
                              out="config_fuzz_cpu.md")
    args = parser.parse_args(argv)
    root = str(Path(args.data).resolve())
    records = fuzz_common.run_trials(
        args, lambda rng, scratch: check(draw(rng, args.datasets), root, scratch), "seq",
        lambda r: " ".join(s for s in r["sets"] if s.startswith(("algorithm.", "model."))))
    write_markdown(records, Path(args.out), fuzz_common.command_line("config_fuzz.py", argv))
    return 1 if any(r["findings"] for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
