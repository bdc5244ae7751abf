"""A differential fuzz of the privacy accounting: the budget a run reports is never below the one it spent.

Random differentially private configurations (CCVR's statistics after FedAvg, FedProx, FedMix or FedBR, once or
every round; FedPAC's centroid statistics; epsilon, delta, clip norm, distributed or local noise, seeded or
operating-system noise, clients, rounds, client sampling, secure aggregation), run by the in-process engine
(sequential or vectorised executor) or by hetfl's Flower server on in-process loopback nodes (``LoopbackGrid`` /
``WireGrid`` from the Flower tests: no Ray, no waiting) with random node errors, refused replies and SecAgg+
dropouts, and, at random, killed (a ``KeyboardInterrupt`` at a round's start, or just after a release was
recorded) and resumed, once or twice.

The ground truth is computed apart from the code under test. ``MomentsMechanism.privatize`` (where every noisy
upload is drawn) is wrapped: the wrapper records every standard normal draw it makes (``torch.randn``), recomputes
the clean moments itself (its own clipping to the configured clip norm and its own per-class sums), and from
``released - clean = draw x std`` reads the standard deviation each part (counts, sums, outer products) actually
carried; a part whose noise is not one std times its draws is flagged. Each upload is then a Gaussian mechanism
whose privacy loss, for one sample added or removed at that client (a part moves by at most 1, C and C^2 in L2:
count, sum, upper triangle of the outer product), is ``mu = sqrt(sum_p (scale_p / std_p)^2)``: multiplier
``1 / mu``. A sum of uploads (secure aggregation) carries the summed variances. Per client, the uploads (or the
sums it is in) that the server received are composed with dp-accounting's PLD accountant (a different
accountant from hetfl's exact Gaussian composition; it is pessimistic by its discretisation, 0.12% at epsilon 4),
and the worst client is compared with ``summary.json``'s ``privacy``. An upload identical to an earlier one of
the same client and round (a seeded replay) is not counted again; two different uploads with the same noise
(seeded noise reused on other content) make the truth infinite.

Flags: reported below spent (beyond 1% + 0.001); a noise part not calibrated as drawn; an upload's noise below
the reported calibration (``noise_multiplier``, times ``sqrt(1 / m)`` for distributed noise); fewer ledger
releases than releases received (a release not in the ledger); a killed and resumed run reporting less than the
same configuration run uninterrupted. Over-reporting (reported above 1.5 x spent + 0.1) is listed, not flagged.

    python benchmarks/privacy_fuzz.py --count 60 --seed 0
    python benchmarks/privacy_fuzz.py --self-check   # three planted bugs: each must be flagged

Writes ``benchmarks/results/privacy_fuzz_cpu.md`` and ``privacy_fuzz_cpu.jsonl`` (one line per configuration,
appended as it goes).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as dt
import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the Flower loopback grids live in tests/

from hetfl import config  # noqa: E402
from hetfl.algorithms.dp_moments import MomentsMechanism  # noqa: E402
from hetfl.engine.experiment import Experiment  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MNIST = "/work/shared/datasets/mnist"  # --data
SLACK_REL, SLACK_ABS = 0.01, 1e-3  # PLD's pessimism at value_discretization_interval 1e-4 is ~0.1%

# ----------------------------------------------------------------------------------------- instrumentation
UPLOADS: list[dict[str, Any]] = []  # every noisy upload drawn, in order
MASKED: set[int] = set()  # sessions ended by a SecAgg+ protocol stop (their last attempt never unmasked)
STATE: dict[str, Any] = {"session": 0, "clip": None}
_ORIGINAL_PRIVATIZE = MomentsMechanism.privatize


def _caller() -> tuple[str, int, int]:
    """(method, round, client) of the privatize call, from the caller's frame (CCVR's ``moments_reply`` has
    ``client`` and ``round_``; FedPAC's ``centroid_statistics`` a client context)."""
    frame = sys._getframe(2)
    while frame is not None:
        loc = frame.f_locals
        owner = loc.get("self")
        name = getattr(owner, "name", None)
        if "client" in loc and "round_" in loc and name:
            return str(name), int(loc["round_"]), int(loc["client"])
        if "ctx" in loc and hasattr(loc["ctx"], "client_id") and name:
            return str(name), int(loc["ctx"].round), int(loc["ctx"].client_id)
        frame = frame.f_back
    return "?", -1, -1


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu", torch.float64).contiguous()
        h.update(str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).numpy().tobytes())
    return h.hexdigest()[:16]


def _part_std(noise: torch.Tensor, draw: torch.Tensor | None, clean_scale: float) -> tuple[float, bool]:
    """The std that ``noise`` carries as ``draw x std`` (0 without a draw), and whether every entry agrees."""
    if draw is None:
        return 0.0, bool(noise.abs().max() <= 1e-9 * (1 + clean_scale))
    draw = draw.to(torch.float64)
    mask = draw.abs() > 0.05
    ratios = noise[mask] / draw[mask]
    std = float(ratios.median())
    resid = float((noise - draw * std).abs().max())
    ok = resid <= 1e-7 * (1 + clean_scale) + 1e-9 * abs(std)
    if not ok:  # entries without the noise: take the smallest share as what protects
        std = float(ratios.abs().min())
    return std, ok


def privatize(self, features, labels, num_classes, generator):
    method, round_, client = _caller()
    draws: list[torch.Tensor] = []
    real = torch.randn

    def recorded(*args, **kwargs):
        t = real(*args, **kwargs)
        draws.append(t.detach().clone())
        return t

    torch.randn = recorded
    try:
        out = _ORIGINAL_PRIVATIZE(self, features, labels, num_classes, generator)
    finally:
        torch.randn = real
    clip = float(STATE["clip"])  # the configured clip norm, not the mechanism's
    x = features.detach().to("cpu", torch.float64)
    norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    x = x * torch.clamp(clip / norms, max=1.0)
    y = labels.detach().to("cpu").long()
    d = x.shape[1]
    counts = torch.bincount(y, minlength=num_classes).to(torch.float64)
    sums = torch.zeros(num_classes, d, dtype=torch.float64).index_add_(0, y, x)
    by_ndim = {}
    anomalies = []
    for t in draws:
        if t.ndim in by_ndim:
            anomalies.append(f"two draws of {t.ndim} dims")
        by_ndim[t.ndim] = t
    parts = {"counts": (out.counts.detach().cpu().double() - counts, by_ndim.get(1), 1.0, float(counts.max())),
             "sums": (out.sums.detach().cpu().double() - sums, by_ndim.get(2), clip, float(sums.abs().max()))}
    if method != "fedpac":  # CCVR uploads the outer products too
        outer = torch.zeros(num_classes, d, d, dtype=torch.float64).index_add_(0, y, x[:, :, None] * x[:, None, :])
        iu = torch.triu_indices(d, d)
        noise = (out.outer.detach().cpu().double() - outer)[:, iu[0], iu[1]]
        draw = by_ndim.get(3)
        parts["outer"] = (noise, None if draw is None else draw[:, iu[0], iu[1]], clip * clip, float(outer.abs().max()))
    stds, mu2 = {}, 0.0
    for name, (noise, draw, scale, clean_scale) in parts.items():
        std, ok = _part_std(noise, draw, clean_scale)
        stds[name] = std
        if not ok:
            anomalies.append(f"{name}: noise is not one std times its draws")
        mu2 += math.inf if std <= 0 else (scale / std) ** 2
    released = [out.counts, out.sums] + ([out.outer] if "outer" in parts else [])
    UPLOADS.append({"session": STATE["session"], "method": method, "round": round_, "client": client,
                    "stds": stds, "scales": {k: v[2] for k, v in parts.items()},
                    "z": 0.0 if mu2 == math.inf else 1.0 / math.sqrt(mu2),
                    "out": _digest(*released), "noise": _digest(*[d for d in draws]) + repr(sorted(stds.items())),
                    "anomalies": anomalies})
    return out


MomentsMechanism.privatize = privatize

# ----------------------------------------------------------------------------------------- accountant


def pld_epsilon(multipliers: list[float], delta: float) -> float:
    """Epsilon at ``delta`` of these Gaussian mechanisms composed by dp-accounting's PLD accountant."""
    if not multipliers:
        return 0.0
    if min(multipliers) <= 0:
        return math.inf
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    counts: dict[float, int] = {}
    for z in multipliers:
        counts[round(z, 12)] = counts.get(round(z, 12), 0) + 1
    for z, n in counts.items():
        acc.compose(dp_event.GaussianDpEvent(z), n)
    return float(acc.get_epsilon(delta))


def truth(uploads: list[dict], delta: float, masked: set[int] = frozenset()) -> dict[str, Any]:
    """The budget spent, per client, from the uploads drawn (see the module's docstring). ``masked``: sessions
    that a SecAgg+ protocol stop ended, whose last attempt's uploads reached the server masked and were never
    unmasked (they reveal nothing)."""
    for session in masked:
        mine = [u for u in uploads if u["session"] == session]
        if mine:
            last = (mine[-1]["method"], mine[-1]["round"])
            uploads = [u for u in uploads if u["session"] != session or (u["method"], u["round"]) != last]
    seen: dict[tuple, str] = {}
    reused = False
    kept = []
    for u in uploads:
        key = (u["method"], u["round"], u["client"], u["out"])
        if key in seen:
            continue  # a replay: the very numbers the server already received
        seen[key] = u["out"]
        kept.append(u)
    noise_seen: dict[tuple, set] = {}
    for u in kept:  # the same noise on two different uploads (of one client, or of two): a noiseless difference
        noise_seen.setdefault((u["method"], u["noise"]), set()).add(u["out"])
    reused = any(len(v) > 1 for v in noise_seen.values())
    clients = sorted({u["client"] for u in kept})
    per_upload = {c: pld_epsilon([u["z"] for u in kept if u["client"] == c], delta) for c in clients}
    groups: dict[tuple, list[dict]] = {}
    for u in uploads:  # a sum is over the uploads of one attempt (a session's round), replays included
        groups.setdefault((u["session"], u["method"], u["round"]), []).append(u)
    distinct, sums = [], []
    for key, members in groups.items():
        sig = (key[1], key[2], tuple(sorted((m["client"], m["out"]) for m in members)))
        if sig in distinct:
            continue
        distinct.append(sig)
        mu2 = 0.0
        for part in members[0]["stds"]:
            var = sum(m["stds"][part] ** 2 for m in members)
            mu2 += math.inf if var <= 0 else members[0]["scales"][part] ** 2 / var
        sums.append((key, {m["client"] for m in members}, 0.0 if mu2 == math.inf else 1 / math.sqrt(mu2)))
    per_sum = {c: pld_epsilon([z for _, who, z in sums if c in who], delta) for c in clients}
    # two different sums of one round that share an identical (seeded) upload: their difference is the other
    # uploads with their own noise only; bound it by the per-upload view
    correlated = False
    for i, (mi, ri, members_i) in enumerate(distinct):
        for mj, rj, members_j in distinct[i + 1:]:
            if (mi, ri) == (mj, rj) and set(members_i) & set(members_j):
                correlated = True
    if correlated:
        per_sum = {c: max(per_sum[c], per_upload[c]) for c in clients}
    return {"reused": reused, "correlated_sums": correlated, "uploads": len(uploads), "distinct_uploads": len(kept),
            "releases": len(sums),
            "release_rounds": [k[2] for k, _, _ in sums], "sum_multipliers": [z for _, _, z in sums],
            "eps_upload": max(per_upload.values(), default=0.0), "eps_sum": max(per_sum.values(), default=0.0),
            "min_upload_z": min((u["z"] for u in uploads), default=math.inf),
            "anomalies": sorted({a for u in uploads for a in u["anomalies"]})}


# ----------------------------------------------------------------------------------------- configurations


def draw(rng: random.Random) -> dict[str, Any]:
    """One random private configuration: ``sets`` (config overrides) and how it is run."""
    clients = rng.choice([2, 3, 4, 5])
    rounds = rng.choice([1, 2, 3, 4])
    eps = round(math.exp(rng.uniform(math.log(0.3), math.log(30))), 3)
    delta = rng.choice([1e-5, 1e-6, 1e-3, 1e-9])
    clip = rng.choice([1.0, 3.0, 10.0])
    source = rng.choice(["seed", "os"])
    flower = rng.random() < 0.35
    secagg = rng.random() < 0.35
    sets = [f"data.num_clients={clients}", f"train.rounds={rounds}",
            "train.batch_size=16", f"train.local_steps={rng.choice([1, 2, 3])}", "model.options={hidden = [16]}",
            "runtime.progress=false", "runtime.threads=1", f"seed={rng.randint(0, 99)}",
            f"runtime.checkpoint_every={rng.choice([0, 1, 1, 2])}", "train.eval_every=100"]
    if rng.random() < 0.3:  # MNIST: 60 training samples a client, two groups of dominant classes
        sets += ["data.dataset=mnist", f"data.root={MNIST}", "data.download=false", "data.partition=dominant",
                 "data.samples_per_client=60", f"data.dominant_groups={min(2, clients)}", "model.name=mlp"]
    else:
        sets += ["data.partition=dirichlet",
                 f"data.options={{max_samples={rng.choice([40, 80])}, num_devices={clients}}}"]
    if rng.random() < 0.35:
        sets.append(f"train.clients_per_round={rng.randint(1, clients)}")
    if rng.random() < 0.35:
        method = "fedpac"
        sets += ["algorithm.name=fedpac", f"algorithm.dp_epsilon={eps}", f"algorithm.dp_delta={delta}",
                 f"algorithm.clip_norm={clip}", f"algorithm.dp_noise_source={source}",
                 f"algorithm.dp_noise={'distributed' if rng.random() < 0.05 else 'local'}", "algorithm.head_epochs=1"]
        secagg = secagg and rng.random() < 0.3
    else:
        trainer = rng.choice(["fedavg", "fedavg", "fedprox", "fedmix", "fedbr"])
        method = f"{trainer}+ccvr"
        noise = rng.choice(["distributed", "local"])
        sets += [f"algorithm.name={method}", f"algorithm.ccvr.dp_epsilon={eps}", f"algorithm.ccvr.dp_delta={delta}",
                 f"algorithm.ccvr.clip_norm={clip}", f"algorithm.ccvr.dp_noise_source={source}",
                 f"algorithm.ccvr.dp_noise={noise}", f"algorithm.ccvr.every_round={str(rng.random() < 0.6).lower()}",
                 "algorithm.ccvr.epochs=1"]
        if trainer == "fedbr" and rng.random() < 0.5:
            sets.append("algorithm.pseudo_source=rsm_clients")
    if secagg:
        sets.append("runtime.secure_aggregation=true")
        if clients == 2:  # the default threshold (3) needs 3 clients
            sets.append("runtime.secagg_reconstruction_threshold=2")
    executor = "flower" if flower else rng.choice(["sequential", "vectorized"])
    if executor == "vectorized":
        sets.append("runtime.vmap_on_cpu=true")
    plan: dict[str, Any] = {"executor": executor, "clip": clip, "delta": delta, "method": method, "secagg": secagg,
                            "sources": source, "crashes": []}
    for _ in range(rng.choice([0, 1, 1, 2])):
        if rng.random() < 0.5:
            plan["crashes"].append(["round", rng.randint(1, rounds)])  # KeyboardInterrupt as round r starts
        else:
            plan["crashes"].append(["release", rng.randint(1, max(1, rounds))])  # just after the k-th release
    if flower:
        sets.append(f"runtime.flower_min_replies={rng.choice([0, 1, clients - 1])}")
        faults = []
        for _ in range(rng.choice([0, 1, 2])):
            node = rng.randrange(clients)
            if secagg:
                faults.append(["secagg", node, rng.choice(["share_keys", "collect_masked_vectors", "unmask"])])
            else:
                kind = "train" if method == "fedpac" else rng.choice(["train", "query.posthoc"])
                cases = ["error", "other data", "undecodable"]
                cases += ["num-samples", "oversized"] if kind == "train" else []
                faults.append([kind, node, rng.randint(1, rounds), rng.choice(cases)])
        plan["faults"] = faults
    plan["sets"] = sets
    return plan


# ----------------------------------------------------------------------------------------- running


def _grid(plan: dict, clients: int):
    from flwr.app import Error, Message
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
    from tests.flower import test_flower_refused_privacy as refused
    from tests.flower.test_flower_secagg import WireGrid

    from hetfl.flower.client_app import app as client_app

    changes = {"other data": refused._other_data, "undecodable": refused._undecodable,
               "num-samples": refused._inflated_samples, "oversized": refused._oversized}

    class FuzzGrid(WireGrid):
        """Loopback nodes (a copy of each message, as after serialisation) with the plan's faults, each fired the
        first time its phase is sent (a resumed run then goes through)."""

        def __init__(self) -> None:
            super().__init__(clients)
            self.pending = [list(f) for f in plan.get("faults", [])]
            stages = {"share_keys": Stage.SHARE_KEYS, "collect_masked_vectors": Stage.COLLECT_MASKED_VECTORS,
                      "unmask": Stage.UNMASK}
            for f in self.pending:
                if f[0] == "secagg":
                    self.fail_at[self.ids[f[1]]] = stages[f[2]]

        def push_messages(self, messages):
            ids = []
            for message in messages:
                kind, group = message.metadata.message_type, message.metadata.group_id
                node = message.metadata.dst_node_id
                fault = next((f for f in self.pending if f[0] == kind and self.ids[f[1]] == node
                              and str(f[2]) == str(group)), None)
                if fault is None:
                    ids += self.answer(message)
                    continue
                self.pending.remove(fault)
                if fault[3] == "error":
                    message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
                    ids.append(message.metadata.message_id)
                    self.replies[ids[-1]] = Message(Error(code=0, reason="disk full"), reply_to=message)
                    continue
                ids += self.answer(message)
                reply = self.replies[ids[-1]]
                if not reply.has_error():
                    with contextlib.suppress(KeyError):  # a reply without that record: left as it is
                        changes[fault[3]](reply.content)
            return ids

        def answer(self, message):
            """WireGrid's answer, with a ClientApp's exception as an error reply (as Flower's runtime does)."""
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            mid, node = message.metadata.message_id, message.metadata.dst_node_id
            secagg = message.content.config_records.get(RECORD_KEY_CONFIGS)
            if secagg is not None and secagg.get(Key.STAGE) == self.fail_at.get(node):
                self.replies[mid] = Message(Error(code=0, reason="node crashed"), reply_to=message)
                return [mid]
            try:
                self.replies[mid] = client_app(copy.deepcopy(message), self.contexts[node])
            except Exception as err:
                self.errors.append(f"{type(err).__name__}: {err}")
                self.replies[mid] = Message(Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=message)
            return [mid]

    grid = FuzzGrid()
    grid.errors = []
    return grid


def one_run(plan: dict, run_dir: Path, crashes: list[list], grid=None) -> dict:
    """One configuration, killed at the plan's points and resumed after each; the last session's summary."""
    from hetfl.flower.protocol import NODES_DIR
    from hetfl.flower.server import FlowerFederation

    cfg_sets = list(plan["sets"])
    if plan["executor"] in ("sequential", "vectorized"):
        cfg_sets.append(f"runtime.executor={plan['executor']}")
    else:
        cfg_sets.append("runtime.executor=flower")
    cfg = config.load(None, cfg_sets)
    sessions, stops = 0, []
    pending = [list(c) for c in crashes]
    original_round, original_record = Experiment.round, Experiment.record_release
    while True:
        crash = pending.pop(0) if pending else None
        counter = {"n": 0}

        def round_(self, server, clients, r, reporter, _crash=crash):
            if _crash and _crash[0] == "round" and r == _crash[1]:
                raise KeyboardInterrupt
            return original_round(self, server, clients, r, reporter)

        def record(self, method, release, r, server, _crash=crash, counter=counter):
            result = original_record(self, method, release, r, server)
            if release is not None:
                counter["n"] += 1
                if _crash and _crash[0] == "release" and counter["n"] == _crash[1]:
                    raise KeyboardInterrupt
            return result

        Experiment.round, Experiment.record_release = round_, record
        STATE["session"] += 1
        try:
            exp = Experiment(cfg)
            if plan["executor"] == "flower":
                exp.federation = FlowerFederation(exp, grid, poll_s=0.01, state_root=str(run_dir / NODES_DIR))
            summary = exp.run(run_dir, resume=sessions > 0)
            return {"summary": summary, "sessions": sessions + 1, "stops": stops}
        except KeyboardInterrupt:
            stops.append(f"killed ({crash[0]} {crash[1]})")
        except Exception as err:
            from hetfl.flower.server import FlowerRoundError
            if not isinstance(err, FlowerRoundError) or sessions >= 4:
                raise
            stops.append(f"stopped: {str(err)[:120]}")
            if "SecAgg+ stopped" in str(err):
                MASKED.add(STATE["session"])
            if grid is not None:
                grid.fail_at.clear()  # a SecAgg+ dropout happens once: the resumed run goes through
        finally:
            Experiment.round, Experiment.record_release = original_round, original_record
        sessions += 1
        if sessions > 6:
            raise RuntimeError("too many sessions")


def ledger(run_dir: Path) -> list[dict]:
    path = run_dir / "privacy_ledger.json"
    return json.loads(path.read_text())["releases"] if path.exists() else []


def check(plan: dict, scratch: Path) -> dict:
    """One drawn configuration: run (killed and resumed as planned) and, when killed, run uninterrupted too."""
    STATE["clip"] = plan["clip"]
    clients = int(next(s for s in plan["sets"] if s.startswith("data.num_clients=")).split("=")[1])
    record: dict[str, Any] = {"plan": plan, "flags": [], "notes": []}
    outcomes = {}
    variants = [("main", plan["crashes"])] + ([("uninterrupted", [])] if plan["crashes"] or plan.get("faults") else [])
    for name, crashes in variants:
        UPLOADS.clear()
        MASKED.clear()
        run_dir = scratch / name
        grid = _grid(plan if name == "main" else {}, clients) if plan["executor"] == "flower" else None
        start = time.perf_counter()
        try:
            result = one_run(plan, run_dir, crashes, grid)
        except Exception as err:
            refused = isinstance(err, ValueError) and type(err).__module__.startswith("hetfl")
            record[name] = {"outcome": "refused" if refused else "error",
                            "error": f"{type(err).__name__}: {err}"[:400]}
            if not refused:
                record[name]["trace"] = traceback.format_exc()[-1500:]
                record["notes"].append(f"{name}: {type(err).__name__}: {str(err)[:200]}")
            break
        summary = result["summary"]
        privacy = summary.get("privacy", {})
        t = truth(UPLOADS, plan["delta"], set(MASKED))
        entries = ledger(run_dir)
        out = {"outcome": "ok", "seconds": round(time.perf_counter() - start, 1), "sessions": result["sessions"],
               "stops": result["stops"], "truth": t, "ledger": [(e["round"], e["multiplier"]) for e in entries],
               "reported": {k: privacy.get(k) for k in ("epsilon", "epsilon_per_upload", "epsilon_target",
                                                         "noise_multiplier", "noise", "releases", "secure_aggregation",
                                                         "summed_clients", "noise_reused_rounds")}}
        record[name] = out
        outcomes[name] = out
        flags = judge(plan, out, clients)
        record["flags"] += [f"{name}: {f}" for f in flags["flags"]]
        record["notes"] += [f"{name}: {f}" for f in flags["notes"]]
    if "main" in outcomes and "uninterrupted" in outcomes:
        a, b = outcomes["main"]["reported"], outcomes["uninterrupted"]["reported"]
        for key in ("epsilon", "epsilon_per_upload"):
            if a.get(key) is not None and b.get(key) is not None and a[key] < b[key] * (1 - 1e-9):
                record["flags"].append(f"resumed run reports {key} {a[key]:.4g} < uninterrupted {b[key]:.4g}")
    return record


def judge(plan: dict, out: dict, clients: int) -> dict[str, list[str]]:
    flags, notes = [], []
    t, rep = out["truth"], out["reported"]
    if "algorithm.dp_noise=distributed" in plan["sets"]:
        flags.append("FedPAC with distributed noise ran (docs/privacy.md: refused, exit 2)")
    if t["uploads"] == 0:
        return {"flags": ["no noisy upload was drawn in a private run"] if rep.get("epsilon") else [], "notes": []}
    if rep.get("epsilon") is None:
        return {"flags": [f"{t['uploads']} noisy uploads drawn, no privacy in summary.json"], "notes": []}
    flags += [f"noise anomaly: {a}" for a in t["anomalies"]]
    eps, per_upload = float(rep["epsilon"]), rep.get("epsilon_per_upload")
    per_upload = eps if per_upload is None else float(per_upload)
    sum_only = plan["secagg"] and plan["method"] != "fedpac" and rep.get("noise") == "distributed"
    faced_truth = t["eps_sum"] if sum_only else t["eps_upload"]
    faced_reported = eps if sum_only else max(eps, per_upload)
    if t["reused"]:
        if math.isfinite(faced_reported):
            flags.append(f"seeded noise reused on different content, reported {faced_reported:.4g} (finite)")
    else:
        def below(truth_value: float, reported: float) -> bool:
            return truth_value > reported * (1 + SLACK_REL) + SLACK_ABS

        if below(faced_truth, faced_reported):
            flags.append(f"reported {faced_reported:.4g} < spent {faced_truth:.4g} (what the server faces)")
        if rep.get("noise") == "distributed" and below(t["eps_sum"], eps):
            flags.append(f"reported epsilon {eps:.4g} < spent on the sum {t['eps_sum']:.4g}")
        if rep.get("noise") == "local" and below(t["eps_upload"], eps):
            flags.append(f"reported epsilon {eps:.4g} < spent per upload {t['eps_upload']:.4g}")
        if faced_reported > 1.5 * faced_truth + 0.1:
            notes.append(f"over-reported: {faced_reported:.4g} for {faced_truth:.4g} spent"
                         + (f" (noise_reused_rounds {rep.get('noise_reused_rounds')})" if rep.get("noise_reused_rounds")
                            else ""))
    z_run = rep.get("noise_multiplier")
    if z_run:
        m = (int(next((s.split("=")[1] for s in plan["sets"] if s.startswith("train.clients_per_round=")), "0"))
             or clients) if plan["method"] == "fedpac" else clients
        share = 1.0 / m if rep.get("noise") == "distributed" else 1.0
        want = float(z_run) * math.sqrt(share)
        if t["min_upload_z"] < want * (1 - 1e-9):
            flags.append(f"an upload's noise multiplier {t['min_upload_z']:.6g} < the calibration's {want:.6g}")
    if len(out["ledger"]) < t["releases"]:
        flags.append(f"ledger holds {len(out['ledger'])} releases, the server received {t['releases']} "
                     f"(rounds {t['release_rounds']}; ledger {[r for r, _ in out['ledger']]})")
    elif len(out["ledger"]) > t["releases"]:
        notes.append(f"ledger holds {len(out['ledger'])} releases for {t['releases']} received")
    if rep.get("releases") is not None and rep["releases"] < t["releases"] and not t["reused"]:
        notes.append(f"summary counts {rep['releases']} releases for {t['releases']} received")
    return {"flags": flags, "notes": notes}


def self_check(scratch_root: Path, count: int = 6, seed: int = 7) -> dict[str, int]:
    """The fuzz's own sensitivity: three bugs put into the code under test (each upload's noise 0.9 of its
    calibration; round 2's releases not recorded; the reported guarantee that of the last release only), each run on
    ``count`` drawn in-process configurations of two rounds or more; how many of them each bug is flagged in."""
    original = {"upload_std": MomentsMechanism.upload_std, "record_release": Experiment.record_release,
                "guarantee": MomentsMechanism.guarantee}

    def weak_noise(self):
        return {k: 0.9 * v for k, v in original["upload_std"](self).items()}

    def round_2_unrecorded(self, method, release, r, server):
        if r == 2 and release is not None:
            return server
        return original["record_release"](self, method, release, r, server)

    def last_release_only(self, sum_multipliers, taken_part=None):
        return original["guarantee"](self, sum_multipliers[-1:], None if taken_part is None else taken_part[-1:])

    bugs = {"noise 0.9 x calibration": (MomentsMechanism, "upload_std", weak_noise),
            "round 2 not in the ledger": (Experiment, "record_release", round_2_unrecorded),
            "guarantee of the last release only": (MomentsMechanism, "guarantee", last_release_only)}
    rng, plans = random.Random(seed), []
    while len(plans) < count:
        plan = draw(rng)
        refused = "algorithm.dp_noise=distributed" in plan["sets"] or (plan["secagg"] and plan["method"] == "fedpac")
        if plan["executor"] != "flower" and "train.rounds=1" not in plan["sets"] and not refused:
            plans.append(plan)
    caught = {}
    for name, (owner, attr, bug) in bugs.items():
        setattr(owner, attr, bug)
        try:
            caught[name] = sum(bool(check(plan, scratch_root / f"{attr}{i}")["flags"]) for i, plan in enumerate(plans))
        finally:
            setattr(owner, attr, original[attr])
        print(f"self-check: {name}: flagged in {caught[name]} of {count}", flush=True)
    return caught


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=math.inf, help="stop drawing after this long")
    parser.add_argument("--out", type=Path, default=RESULTS / "privacy_fuzz_cpu")
    parser.add_argument("--only", type=int, nargs="*", help="run only these indices of the drawn sequence")
    parser.add_argument("--self-check", action="store_true", help="only check that three planted bugs are flagged")
    parser.add_argument("--data", default="/work/shared/datasets", help="folder with mnist/ (the shared datasets)")
    args = parser.parse_args(argv)
    global MNIST
    MNIST = str(Path(args.data) / "mnist")
    torch.set_num_threads(1)
    scratch_root = Path(tempfile.mkdtemp(prefix="hetfl-privfuzz-"))
    from hetfl.flower.protocol import TRUSTED_ROOTS_ENV
    os.environ[TRUSTED_ROOTS_ENV] = str(scratch_root)
    if args.self_check:
        caught = self_check(scratch_root)
        shutil.rmtree(scratch_root, ignore_errors=True)
        return 0 if all(caught.values()) else 1
    jsonl = args.out.with_suffix(".jsonl")
    rng = random.Random(args.seed)
    start = time.perf_counter()
    records = []
    for i in range(args.count):
        if (time.perf_counter() - start) / 60 > args.minutes:
            break
        plan = draw(rng)
        if args.only and i not in args.only:
            continue
        scratch = scratch_root / f"c{i}"
        record = check(plan, scratch)
        record["index"], record["seed"] = i, args.seed
        shutil.rmtree(scratch, ignore_errors=True)
        records.append(record)
        with jsonl.open("a") as f:
            f.write(json.dumps(record, default=str) + "\n")
        status = "FLAG" if record["flags"] else "ok"
        print(f"[{i}] {status} {plan['method']} {plan['executor']} crashes={plan['crashes']} "
              f"{record['flags'] or ''} {record['notes'] or ''}", flush=True)
    shutil.rmtree(scratch_root, ignore_errors=True)
    write_report(args.out.with_suffix(".md"), records, args)
    return 0


def write_report(path: Path, records: list[dict], args) -> None:
    flagged = [r for r in records if r["flags"]]
    lines = [f"# Privacy accounting fuzz ({dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, CPU)", "",
             f"`python benchmarks/privacy_fuzz.py --count {args.count} --seed {args.seed}`: {len(records)} "
             f"configurations, {len(flagged)} flagged. Method in the module docstring of benchmarks/privacy_fuzz.py.",
             "", "| seed/# | method | executor | secagg | noise source | crashes | outcome | spent (faced) | reported "
             "(faced) | ledger / received | flags / notes |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        p, m = r["plan"], r.get("main", {})
        t, rep = m.get("truth", {}), m.get("reported", {})
        sum_only = p["secagg"] and p["method"] != "fedpac" and rep.get("noise") == "distributed"
        spent = t.get("eps_sum" if sum_only else "eps_upload")
        eps, pu = rep.get("epsilon"), rep.get("epsilon_per_upload")
        faced = None if eps is None else (eps if sum_only else max(eps, pu if pu is not None else eps))
        noise = next((s.split("=")[1] for s in p["sets"] if "dp_noise=" in s), "")
        text = "; ".join(r["flags"] + r["notes"]).replace("|", "/")
        lines.append(f"| {r.get('seed', '')}/{r['index']} | {p['method']} ({noise}) | {p['executor']} | "
                     f"{p['secagg']} | {p['sources']} | "
                     f"{p['crashes'] or ''} | {m.get('outcome')} {m.get('error', '')[:80]} | "
                     f"{'' if spent is None else f'{spent:.4g}'} | {'' if faced is None else f'{faced:.4g}'} | "
                     f"{len(m.get('ledger', []))} / {t.get('releases', '')} | {text} |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
