"""A differential fuzz of the Flower executor: random configurations (``config_fuzz.draw``: methods, post-hoc
steps, data, partitions, models, training settings), each run in process by the sequential executor and through
hetfl's Flower ServerApp and ClientApp, on a Grid whose nodes are ClientApp calls in this process (one node per
client, no Ray, no network: the messages, their encoding, the nodes' state and the server's decoding are
Flower's and hetfl's own).

Every drawn configuration is checked for

- a crash of either run that is not one of hetfl's refusals, or a refusal by one executor only;
- a difference: the Flower run's ``metrics.jsonl`` must be the sequential run's to the bit, every line, every
  key but the times and Flower's byte counts (``tests/flower/test_flower_logic.py`` pins this method by method
  on one setting; here the settings meet);
- a client left out (``failed_clients`` not empty) although every node answers.

Not a test (minutes to hours); one command:

    python benchmarks/flower_fuzz.py --data ../shared/datasets --count 40 --seed 0

Writes ``benchmarks/results/flower_fuzz_cpu.md`` and a ``.jsonl`` beside it (one line per configuration,
appended as it goes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

import fuzz_common
from config_fuzz import DATASETS, draw, refusal
from flwr.app import Context, Error, Message, RecordDict

from hetfl import config
from hetfl.engine.experiment import Experiment
from hetfl.flower.client_app import app as client_app
from hetfl.flower.protocol import NODES_DIR, TRUSTED_ROOTS_ENV
from hetfl.flower.server import FlowerFederation

#: per-line keys that differ between the executors by design: times, and the Flower run's own traffic and failures
UNCOMPARED = {"round_time_s", "eval_time_s", "failed_clients", "flower_bytes_down", "flower_bytes_up"}


class InProcessGrid:
    """A Flower Grid whose nodes are calls of hetfl's ClientApp in this process, each with its own Context (the
    node's partition and state), answering every message at once; a ClientApp's exception becomes an error
    reply, as Flower's runtime makes it."""

    def __init__(self, num_nodes: int) -> None:
        from flwr.supercore.task_identity import TaskIdentity

        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # what a ServerApp runner sets
        self.ids = [1000 + i for i in range(num_nodes)]
        self.contexts = {n: Context(run_id=1, node_id=n, node_config={"partition-id": i, "num-partitions": num_nodes},
                                    state=RecordDict(), run_config={}) for i, n in enumerate(self.ids)}
        self.replies: dict[str, Message] = {}

    def get_node_ids(self) -> list[int]:
        return list(self.ids)

    def push_messages(self, messages: list[Message]) -> list[str]:
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            ids.append(message.metadata.message_id)
            try:
                answer = client_app(message, self.contexts[message.metadata.dst_node_id])
            except Exception as err:  # Flower's runtime answers any exception with an error reply
                answer = Message(Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=message)
            self.replies[message.metadata.message_id] = answer
        return ids

    def pull_messages(self, message_ids: list[str]) -> list[Message]:
        return [self.replies.pop(i) for i in message_ids if i in self.replies]


def run_once(sets: list[str], flower: bool, folder: Path) -> dict:
    """One run, sequential in process or on the in-process nodes: its outcome and metrics lines."""
    start = time.perf_counter()
    out: dict = {}
    try:
        common = ["runtime.progress=false", "runtime.device=cpu", "runtime.checkpoint_every=0", "runtime.threads=1"]
        cfg = config.load(None, [*sets, *common, f"runtime.executor={'flower' if flower else 'sequential'}"])
        exp = Experiment(cfg)
        if flower:
            exp.federation = FlowerFederation(exp, InProcessGrid(cfg.data.num_clients), poll_s=0.001,
                                              state_root=str(folder / NODES_DIR))
        exp.run(folder)
        out.update(outcome="ok", lines=[json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()])
    except Exception as err:  # every kind is the point
        fuzz_common.note_exception(out, err, refusal(err))
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def first_difference(seq: list[dict], flo: list[dict]) -> str | None:
    """Where the Flower run's metrics first differ from the sequential run's (None: nowhere)."""
    if len(seq) != len(flo):
        return f"{len(flo)} metrics lines, sequential {len(seq)}"
    for a, b in zip(seq, flo, strict=True):
        for key in sorted((set(a) | set(b)) - UNCOMPARED):
            if a.get(key) != b.get(key) and not (a.get(key) != a.get(key) and b.get(key) != b.get(key)):  # NaN == NaN
                return f"round {a.get('round')} {key}: sequential {a.get(key)!r}, Flower {b.get(key)!r}"
    return None


#: per method, what keeps a run short where its default would train for minutes (FedRep's 10 head epochs over a
#: whole MNIST client at batch 4): the numbers are compared, not the settings' defaults
SHORT = {"fedbabu": ["algorithm.finetune_epochs=1"], "pfedme": ["algorithm.inner_steps=1"],
         "fedetf": ["algorithm.pers_cycles=1"], "fedrep": ["algorithm.head_epochs=1"]}


def shortened(sets: list[str]) -> list[str]:
    """``sets`` and the shortening settings of its method (:data:`SHORT`)."""
    method = next(s.split("=", 1)[1] for s in sets if s.startswith("algorithm.name=")).split("+")[0]
    return [*sets, *SHORT.get(method, [])]


def check(drawn: list[str], root: str, scratch: Path) -> dict:
    """Both runs of one drawn configuration (``ROOT`` in it: the datasets folder ``root``)."""
    drawn = shortened(drawn)
    sets = [s.replace("ROOT", root) for s in drawn]
    seq = run_once(sets, False, scratch / "seq")
    record: dict = {"sets": drawn, "seq": seq}
    if seq["outcome"] != "crash":
        record["flower"] = run_once(sets, True, scratch / "flower")
    shutil.rmtree(scratch, ignore_errors=True)
    flo = record.get("flower", {})
    findings = [f"{name} crashed: {run['error']}" for name, run in (("sequential", seq), ("Flower", flo))
                if run.get("outcome") == "crash"]
    if flo and {seq["outcome"], flo["outcome"]} == {"ok", "refused"}:
        refused = seq if seq["outcome"] == "refused" else flo
        findings.append(f"refused by one executor only: {refused['error']}")
    if seq["outcome"] == flo.get("outcome") == "ok":
        if (difference := first_difference(seq["lines"], flo["lines"])) is not None:
            findings.append(difference)
        if left_out := [x["failed_clients"] for x in flo["lines"] if x.get("failed_clients")]:
            findings.append(f"clients left out although every node answered: {left_out}")
    for run in (seq, flo):
        run.pop("lines", None)
    record["findings"] = findings
    return record


def write_markdown(records: list[dict], path: Path, command: str) -> None:
    lines = fuzz_common.report_head(
        "Flower fuzz: in-process Flower nodes against the sequential executor (benchmarks/flower_fuzz.py)",
        command, records, "seq")
    lines += fuzz_common.two_run_table(records, "seq", "flower", "s (sequential / Flower)")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fuzz_common.add_arguments(parser, count=40, datasets=fuzz_common.DEFAULT_DATASETS, dataset_names=list(DATASETS),
                              out="flower_fuzz_cpu.md")
    args = parser.parse_args(argv)
    root = str(Path(args.data).resolve())

    def trusted(tmp: Path) -> None:  # the nodes keep client state where the server says, under tmp
        os.environ[TRUSTED_ROOTS_ENV] = str(tmp)

    records = fuzz_common.run_trials(
        args, lambda rng, scratch: check(draw(rng, args.datasets), root, scratch), "seq",
        lambda r: " ".join(s for s in r["sets"] if s.startswith(("algorithm.", "model."))), prepare=trusted)
    write_markdown(records, Path(args.out), fuzz_common.command_line("flower_fuzz.py", argv))
    return 1 if any(r["findings"] for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
