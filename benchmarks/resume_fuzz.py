"""A differential fuzz of crash-and-resume: random configurations (``config_fuzz.draw``'s, plus the settings
a resume meets: checkpoints every 0-3 rounds, evaluation every 1, 2 or only the last round, the vmapped
executor, differential privacy of FedPAC and CCVR, secure aggregation, client-model saves), each run

- twice uninterrupted (``a``, ``b``): same config and seed on the same machine, the same numbers;
- once crashed at a drawn point and resumed (``Experiment(cfg).run(dir, resume=True)``), twice: the folder
  the interrupted process left (``KeyboardInterrupt``, as Ctrl-C: context managers run), and a copy taken at
  the crash point, its lock left out (what a kill leaves). The crash points: the start of round r (a round
  boundary), after the k-th client of round r trained (in the middle of a round; the vmapped executor
  reports its clients at once), at round r's evaluation (its post-hoc steps and their releases done, its line
  not written), and the end of round r (its line and any checkpoint written).

Each resumed folder is compared with ``a``, and ``b`` with ``a``: the files present, ``metrics.jsonl`` line by
line (``*time_s`` fields aside), ``client_metrics.jsonl``, ``config.toml``, ``privacy_ledger.json``,
``summary.json`` (``wall_time_s`` aside), and the tensors of ``checkpoint.safetensors``,
``trained.safetensors`` and ``client_models/`` bitwise. A crash of a resume is a finding too.

Real datasets are drawn with the ``dominant`` partition of 40-80 training samples a client (a full MNIST or
CIFAR-10 client makes FedPAC's and CCVR's feature passes minutes long on a CPU); the partitions' variety is
the synthetic data's. Not a test (minutes to hours); one command:

    python benchmarks/resume_fuzz.py --data ../shared/datasets --count 100 --seed 0

Writes ``benchmarks/results/resume_fuzz_<device>.md`` and a ``.jsonl`` beside it, one line per configuration,
appended as it goes.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))

import fuzz_common
from config_fuzz import DATASETS, draw, refusal

from hetfl import config
from hetfl.engine.experiment import Experiment
from hetfl.engine.rundir import LOCK_NAME
from hetfl.engine.summary import Reporter

TENSOR_FILES = ("checkpoint.safetensors", "trained.safetensors")
KINDS = ("start", "clients", "eval", "end")


def put(sets: list[str], key: str, value: Any) -> list[str]:
    """``sets`` with ``key=value`` in place of any setting of ``key``."""
    return [*(s for s in sets if not s.startswith(key + "=")), f"{key}={value}"]


def draw_resume(rng: random.Random, datasets: list[str],
                methods: list[str] | None = None) -> tuple[list[str], dict[str, Any]]:
    """A configuration (``config_fuzz.draw``'s with a resume's settings; of ``methods`` only, when given: drawn
    until one of them comes) and a crash point."""
    while True:
        sets = draw(rng, datasets)
        get = dict(s.split("=", 1) for s in sets)
        method = get["algorithm.name"]
        if not methods or method in methods:
            break
    rounds = rng.choice([3, 4])
    sets = put(sets, "train.rounds", rounds)
    sets = put(sets, "train.eval_every", rng.choice([1, 2, 100]))
    sets.append(f"runtime.checkpoint_every={rng.choice([0, 1, 1, 2, 3])}")
    if get.get("data.dataset", "synthetic") != "synthetic":
        sets = put(sets, "data.partition", "dominant")
        sets += [f"data.samples_per_client={rng.choice([40, 80])}", "data.test_per_client=20"]
    if rng.random() < 0.5:
        sets += ["runtime.executor=vectorized", "runtime.vmap_on_cpu=true"]
    if method.endswith("+ccvr"):
        if rng.random() < 0.5:
            sets += [f"algorithm.ccvr.dp_epsilon={rng.choice([4, 50])}",
                     f"algorithm.ccvr.dp_noise={rng.choice(['local', 'distributed'])}"]
        if rng.random() < 0.3:
            sets.append("runtime.secure_aggregation=true")
        if rng.random() < 0.3:
            sets.append("algorithm.ccvr.every_round=true")
    if method == "fedpac" and rng.random() < 0.5:
        sets += [f"algorithm.dp_epsilon={rng.choice([4, 50])}", "algorithm.dp_noise=local"]
    if rng.random() < 0.3:
        sets.append("runtime.client_metrics_every=2")
    if rng.random() < 0.2:
        sets.append("runtime.save_client_models=[2]")
    crash = {"kind": rng.choice(KINDS), "round": rng.randint(1, rounds), "client": rng.randint(1, 3)}
    return sets, crash


class Crash(KeyboardInterrupt):
    """The drawn crash (a KeyboardInterrupt, as Ctrl-C)."""


class Crashing(Experiment):
    """An Experiment that crashes at ``point``, first copying its run directory to ``killed`` (its lock left
    out: what a kill at that point leaves)."""

    def __init__(self, cfg: config.RunConfig, point: dict[str, Any], killed: Path) -> None:
        super().__init__(cfg)
        self.point, self.killed, self.clients_done = point, killed, 0

    def crash(self, where: str) -> None:
        shutil.copytree(self.run_dir, self.killed, ignore=shutil.ignore_patterns(LOCK_NAME))
        raise Crash(where)

    def due(self, kind: str, round_: int) -> bool:
        return self.point["kind"] == kind and round_ == self.point["round"]

    def round(self, server, clients, round_, reporter):
        if self.due("start", round_):
            self.crash(f"start of round {round_}")
        self.current = round_
        return super().round(server, clients, round_, reporter)

    def evaluate(self, server, clients, round_):
        if self.point["kind"] == "eval" and round_ >= self.point["round"]:
            self.crash(f"evaluation of round {round_}")
        return super().evaluate(server, clients, round_)


class CrashReporter(Reporter):
    """Crashes ``exp`` after its k-th trained client of round r, or at the end of round r."""

    def __init__(self) -> None:
        self.exp: Crashing | None = None

    def client_done(self) -> None:
        exp = self.exp
        if exp is not None and exp.due("clients", exp.current):
            exp.clients_done += 1
            if exp.clients_done == exp.point["client"]:
                exp.crash(f"client {exp.clients_done} of round {exp.current}")

    def round_end(self, line: dict[str, Any]) -> None:
        if self.exp is not None and self.exp.due("end", line["round"]):
            self.exp.crash(f"end of round {line['round']}")


def tensors(path: Path) -> dict[str, bytes]:
    """Each tensor of a safetensors file as its bytes (a bitwise comparison, NaNs included)."""
    return {k: bytes(v.contiguous().view(-1).view(torch.uint8).numpy()) for k, v in load_file(path).items()}


def lines(path: Path) -> list[str]:
    """``metrics.jsonl``'s lines without their wall-time fields, as canonical JSON (NaN equal to NaN)."""
    out = []
    for text in path.read_text().splitlines():
        line = {k: v for k, v in json.loads(text).items() if not k.endswith("time_s")}
        out.append(json.dumps(line, sort_keys=True))
    return out


def differences(a: Path, b: Path) -> list[str]:
    """How run folder ``b`` differs from ``a`` (empty: the same run)."""
    found = []
    files_a, files_b = ({str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and p.name != LOCK_NAME}
                        for d in (a, b))
    if files_a != files_b:
        found.append(f"files: only first {sorted(files_a - files_b)}, only second {sorted(files_b - files_a)}")
    for name in sorted(files_a & files_b):
        pa, pb = a / name, b / name
        if name == "metrics.jsonl":
            la, lb = lines(pa), lines(pb)
            if len(la) != len(lb):
                found.append(f"metrics.jsonl: {len(la)} lines, {len(lb)}")
            for i, (x, y) in enumerate(zip(la, lb, strict=False)):
                if x != y:
                    dx, dy = json.loads(x), json.loads(y)
                    keys = sorted(k for k in {*dx, *dy} if json.dumps(dx.get(k)) != json.dumps(dy.get(k)))
                    found.append(f"metrics.jsonl round {i + 1}: " + ", ".join(
                        f"{k} {dx.get(k)!r} vs {dy.get(k)!r}" for k in keys[:4]))
                    break
        elif name == "summary.json":
            sa, sb = ({k: v for k, v in json.loads(p.read_text()).items() if k != "wall_time_s"} for p in (pa, pb))
            if json.dumps(sa, sort_keys=True) != json.dumps(sb, sort_keys=True):
                keys = sorted(k for k in {*sa, *sb} if json.dumps(sa.get(k)) != json.dumps(sb.get(k)))
                found.append("summary.json: " + ", ".join(f"{k} {sa.get(k)!r} vs {sb.get(k)!r}" for k in keys[:4]))
        elif name.endswith(".safetensors"):
            ta, tb = tensors(pa), tensors(pb)
            if ta != tb:
                keys = sorted(k for k in {*ta, *tb} if ta.get(k) != tb.get(k))
                found.append(f"{name}: tensors differ: {keys[:6]}{' ...' if len(keys) > 6 else ''}")
        elif pa.read_bytes() != pb.read_bytes():
            found.append(f"{name}: differs")
    return found


def attempt(fn: Any) -> dict[str, Any]:
    """``fn()``'s outcome: ok, refused (hetfl's ValueError), crashed (the drawn crash) or crash (a bug)."""
    start = time.perf_counter()
    out: dict[str, Any] = {}
    try:
        fn()
        out["outcome"] = "ok"
    except Crash as err:
        out.update(outcome="crashed", at=str(err))
    except Exception as err:  # every kind is the point
        fuzz_common.note_exception(out, err, refusal(err))
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def check(drawn: list[str], point: dict[str, Any], root: str, scratch: Path) -> dict[str, Any]:
    """One drawn configuration: two uninterrupted runs, a crashed one resumed as left and as killed."""
    cfg = config.load(None, [*(s.replace("ROOT", root) for s in drawn), "runtime.progress=false",
                             "runtime.device=cpu", "runtime.threads=1"])
    record: dict[str, Any] = {"sets": drawn, "crash": point}
    record["a"] = attempt(lambda: Experiment(cfg).run(scratch / "a"))
    findings = []
    if record["a"]["outcome"] == "ok":
        record["b"] = attempt(lambda: Experiment(cfg).run(scratch / "b"))
        reporter = CrashReporter()
        crashing = Crashing(cfg, point, scratch / "killed")
        reporter.exp = crashing
        record["crashed"] = attempt(lambda: crashing.run(scratch / "crashed", reporter=reporter))
        for name in ("crashed", "killed"):
            if (scratch / name).exists():
                record[f"resume_{name}"] = attempt(lambda n=name: Experiment(cfg).run(scratch / n, resume=True))
        for name in ("b", "crashed", "resume_crashed", "resume_killed"):
            run = record.get(name, {})
            if run.get("outcome") in ("crash", "refused"):
                findings.append(f"{name} {run['outcome']}: {run['error']}")
        if record["b"]["outcome"] == "ok":
            findings += [f"determinism: {d}" for d in differences(scratch / "a", scratch / "b")]
        for name in ("crashed", "killed"):
            if record.get(f"resume_{name}", {}).get("outcome") == "ok":
                findings += [f"resume ({name}): {d}" for d in differences(scratch / "a", scratch / name)]
    elif record["a"]["outcome"] == "crash":
        findings.append(f"a crash: {record['a']['error']}")
    shutil.rmtree(scratch, ignore_errors=True)
    record["findings"] = findings
    return record


def write_markdown(records: list[dict], path: Path, command: str) -> None:
    lines = fuzz_common.report_head(
        "Resume fuzz: crash-and-resume on random configurations (benchmarks/resume_fuzz.py)", command, records, "a",
        lambda r: f"`{' '.join(r['sets'])}`, crash {r['crash']}")
    lines += ["", "## Every configuration", "",
              "| # | method | model | executor | ckpt every | crash | outcome | s (a / b / crashed) |",
              "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(records):
        get = fuzz_common.settings(r)
        outcome = fuzz_common.table_outcome(r, "a")
        if outcome == "ok":
            outcome = "ok, " + (r["crashed"].get("at") or "crash point not reached")
        crash = f"{r['crash']['kind']} r{r['crash']['round']}" + (
            f" c{r['crash']['client']}" if r["crash"]["kind"] == "clients" else "")
        seconds = " / ".join(str(r.get(k, {}).get("seconds", "-")) for k in ("a", "b", "crashed"))
        lines.append(f"| {i} | {get.get('algorithm.name')} | {get.get('model.name')} | "
                     f"{get.get('runtime.executor', 'sequential')} | {get.get('runtime.checkpoint_every')} | "
                     f"{crash} | {outcome} | {seconds} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fuzz_common.add_arguments(parser, count=50, datasets=("synthetic", "synthetic", "synthetic", "mnist", "cifar10"),
                              dataset_names=list(DATASETS), out="resume_fuzz_cpu.md")
    parser.add_argument("--methods", nargs="+", help="only these algorithm.name values (e.g. fedpac fedavg+ccvr)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("hetfl").setLevel(logging.ERROR)  # the runs' notes, four times a configuration
    root = str(Path(args.data).resolve())

    def trial(rng: random.Random, scratch: Path) -> dict:
        sets, point = draw_resume(rng, args.datasets, args.methods)
        return check(sets, point, root, scratch)

    records = fuzz_common.run_trials(
        args, trial, "a",
        lambda r: " ".join(s for s in r["sets"] if s.startswith(("algorithm.name", "model."))) + f" {r['crash']}")
    write_markdown(records, Path(args.out), fuzz_common.command_line("resume_fuzz.py", argv))
    return 1 if any(r["findings"] for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
