"""Client-training throughput, four ways, side by side in one process and one run.

(a) peer: the loop of popular FL libraries: clients one after another, a
    ``DataLoader`` over CPU tensors per client, a deep copy of the model per
    client, ``torch.optim.SGD``, evaluation of the global model after the round;
(b) hetfl's sequential executor; (c) hetfl's vectorised executor (on a CPU it
    trains clients one at a time: see ``vmap_cpu_profile.py``), and (c') the same
    with the clients vmapped anyway (``runtime.vmap_on_cpu``; only on a CPU);
    On CUDA, (c) also runs with its steps captured as CUDA graphs (``runtime.cuda_graph``:
    "graph"), with that in bfloat16 autocast ("graph_bf16"), each of those with one ordinary
    convolution per client instead of a grouped one (``runtime.conv_batching = "per_client"``:
    "graph_pc", "graph_bf16_pc"), and, with ``--variants``, bf16 with image batches laid out
    channels-last (``runtime.channels_last = true``: "graph_bf16_cl") and with the steps compiled by
    ``torch.compile`` (``runtime.compile = true``: "graph_compiled", "graph_bf16_compiled"; their
    compiles, one per step shape, happen in the warm-up round, timed apart as ``warmup_s``); on a CPU
    (c') also runs with per-client convolutions ("vmap_pc") and, with ``--variants``, compiled
    ("vmap_compiled"). c/a, c/b and c/d use the fastest of the vectorised variants. On request, on
    CUDA, "vectorized_plain" (on a CPU "vmap_plain"): the eager step without hetfl's batching rules (a
    measurement of their host overhead, not a setting, and never the "best" variant), and
    "graph_bf16_plain": the same captured, what those rules do to the kernels' time; and "vectorized_cl":
    the eager step with channels-last image batches (``runtime.channels_last = true``), as session 11's
    "(c) vectorized" ran (that was the default then; off since): issue 29's eager step measured 2x slower
    in session 17 than in session 11 on an H100, whose host time on a CPU had not grown as much.
(d) the ceiling: one model trained with batches as large as all clients'
    batches of a step together (the same samples, no federation); on CUDA also
    (d') that ceiling in bfloat16 autocast, the like-for-like bound of the bf16
    variants (c/d, the issue's measure, compares the best variant with (d)).

Each is measured on the same round (CIFAR-10 or MNIST under Dirichlet 0.1,
one local epoch) after one untimed warm-up round: client-samples per second of
local training alone, and of the whole round including evaluation. Prints a
table with the ratios (c)/(a), (c)/(b), (c)/(d) and appends the results to
``benchmarks/results/throughput_<device>.json`` and ``.md``.

    python benchmarks/throughput.py --data ../shared/datasets --dataset cifar10 \
        --models simple_cnn cnn2 --clients 10 20 --batch-sizes 10 64
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from hetfl import config
from hetfl.engine import host_memory, vectorized
from hetfl.engine.experiment import Experiment
from hetfl.engine.summary import Reporter

ROOTS = {"cifar10": "cifar10-jpeg.tar.gz", "mnist": "mnist"}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def plain_layers(on: bool) -> contextlib.AbstractContextManager:
    """A measurement, not a setting: the vectorised step without hetfl's batching rules (its layers in
    their plain PyTorch forms under vmap, as before session 14), to tell whether their autograd Functions'
    host overhead is what slowed the eager step on a GPU since session 11."""
    return mock.patch.object(vectorized, "client_batching", lambda *_, **__: contextlib.nullcontext()) \
        if on else contextlib.nullcontext()


def no_plans_ahead(on: bool) -> contextlib.AbstractContextManager:
    """A measurement, not a setting: graph mode without the next round's plan drawn while a round runs
    (``VectorizedGroup.plan_ahead``, since session 19), so that each round's plan is drawn at its start,
    the device waiting, as before."""
    return mock.patch.object(vectorized.VectorizedGroup, "plan_ahead", lambda self: None) \
        if on else contextlib.nullcontext()


def hetfl_round(exp: Experiment) -> dict[str, float]:
    """(b)/(c): one warm-up round (timed too: the CUDA graphs' captures and torch.compile's compiles
    happen there), then one timed round, training and evaluation timed apart."""
    server, _, _ = exp.setup_round(exp.initial_server())
    clients: dict = {}
    first: dict = {}
    warmup_s = timed(lambda: first.update(exp.round(server, clients, 1, Reporter())))
    server = first["_server"]
    out: dict = {}
    train_s = timed(lambda: out.update(exp.round(server, clients, 2, Reporter())))
    eval_s = timed(lambda: exp.evaluate(out["_server"], clients, 2))
    return {"train_s": train_s, "eval_s": eval_s, "warmup_s": warmup_s, "samples": sum(exp.data.client_sizes)}


def peer_round(exp: Experiment, batch_size: int, lr: float) -> dict[str, float]:
    """(a): the peer-style loop on the same clients and model."""
    device = exp.device
    global_model = copy.deepcopy(exp.model)
    data = exp.data
    loaders = []
    for c in range(data.num_clients):
        x, y = data.client_train_split(c)
        loaders.append(DataLoader(TensorDataset(data.prepare(x).cpu(), y.cpu()), batch_size=batch_size,
                                  shuffle=True))

    def train() -> None:
        states = []
        for loader in loaders:
            local = copy.deepcopy(global_model).train()
            opt = torch.optim.SGD(local.parameters(), lr=lr, momentum=0.9)
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                opt.zero_grad()
                F.cross_entropy(local(x), y).backward()
                opt.step()
            states.append(local.state_dict())
        total = sum(len(loader.dataset) for loader in loaders)
        avg = {k: sum(s[k].float() * len(ld.dataset) for s, ld in zip(states, loaders, strict=True)) / total
               for k in states[0]}
        global_model.load_state_dict({k: v.to(global_model.state_dict()[k].dtype) for k, v in avg.items()})

    def evaluate() -> None:
        global_model.eval()
        with torch.no_grad():
            for i in range(0, len(data.test_x), 1024):
                global_model(data.prepare(data.test_x[i : i + 1024])).argmax(1)
        global_model.train()

    train()  # warm-up
    train_s = timed(train)
    return {"train_s": train_s, "eval_s": timed(evaluate), "samples": sum(data.client_sizes)}


def ceiling_round(exp: Experiment, batch_size: int, lr: float, bf16: bool = False) -> dict[str, float]:
    """(d): one model, batches of clients x batch_size samples, the same number of samples; ``bf16``:
    the forward pass under bfloat16 autocast (d')."""
    model = copy.deepcopy(exp.model).train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    data = exp.data
    big = batch_size * data.num_clients
    n = sum(data.client_sizes)

    def train() -> None:
        order = torch.randperm(len(data.train_x), device=data.device)[:n]
        for i in range(0, n, big):
            idx = order[i : i + big]
            opt.zero_grad()
            with torch.autocast(data.device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(model(data.prepare(data.train_x[idx])), data.train_y[idx])
            loss.backward()
            opt.step()

    train()
    return {"train_s": timed(train), "eval_s": 0.0, "samples": n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", default="../shared/datasets")
    parser.add_argument("--dataset", default="cifar10", choices=list(ROOTS))
    parser.add_argument("--models", nargs="+", default=["simple_cnn"])
    parser.add_argument("--clients", type=int, nargs="+", default=[10])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64])
    parser.add_argument("--skip-peer", action="store_true", help="skip (a) (slow on CPU)")
    parser.add_argument("--augment", default="none", choices=("none", "auto", "crop_flip", "flip"),
                        help="hetfl's data.augment (the peer loop never augments: none compares like with like)")
    parser.add_argument("--no-graph", action="store_true", help="on CUDA, skip the CUDA-graph variants")
    parser.add_argument("--variants", nargs="+", choices=[*GRAPH_VARIANTS, *CPU_VARIANTS], default=None,
                        help="the CUDA-graph variants (CUDA) or vmapped variants (CPU) to run besides "
                             f"sequential and vectorized (default: all but {', '.join(ON_REQUEST)})")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch's CPU thread count for every variant, hetfl's (runtime.threads) and the loops "
                             "(a) and (d) alike (default: torch's count at start). hetfl's own default, "
                             "runtime.threads = 0, runs a small CPU step on one thread: left to it, (b) and (c) "
                             "would run on another count than (a) and (d)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)  # recorded with the machine
    # on a CPU, freed memory kept in the process for every variant, (a) and (d) alike (hetfl's runs set it
    # anyway, process-wide; set here so that the loops do not depend on which ran first); recorded too
    kept = host_memory.keep_freed_memory() if device == "cpu" else None
    rows: list[dict] = []
    save = recorder(args, device, rows, kept)
    for model in args.models:
        for clients in args.clients:
            for bs in args.batch_sizes:
                base = [f"data.dataset={args.dataset}", f"data.root={args.data}/{ROOTS[args.dataset]}",
                        "data.partition=dirichlet", "data.alpha=0.1", f"data.num_clients={clients}",
                        f"model.name={model}", f"train.batch_size={bs}", "train.local_epochs=1", "train.lr=0.01",
                        "train.momentum=0.9", "runtime.progress=false", "runtime.checkpoint_every=0",
                        f"data.augment={args.augment}", f"runtime.threads={threads}"]
                res = {}
                variants = {"sequential": ["runtime.executor=sequential"],
                            "vectorized": ["runtime.executor=vectorized", "runtime.cuda_graph=false"]}
                extra = CPU_VARIANTS if device == "cpu" else {} if args.no_graph else GRAPH_VARIANTS
                for name, keys in extra.items():
                    if name in (args.variants or [v for v in extra if v not in ON_REQUEST]):
                        variants[name] = keys
                for name, keys in variants.items():
                    exp = Experiment(config.load(None, [*base, *keys]))
                    with plain_layers(name in PLAIN_LAYERS), no_plans_ahead(name in NO_PLANS_AHEAD):
                        res[name] = hetfl_round(exp)
                torch.set_num_threads(threads)  # (a) and (d) on the count every variant ran on
                if not args.skip_peer:
                    res["peer"] = peer_round(exp, bs, 0.01)
                res["ceiling"] = ceiling_round(exp, bs, 0.01)
                if device == "cuda":
                    res["ceiling_bf16"] = ceiling_round(exp, bs, 0.01, bf16=True)
                rate = {k: v["samples"] / v["train_s"] for k, v in res.items()}
                whole = {k: v["samples"] / (v["train_s"] + v["eval_s"]) for k, v in res.items()}
                row = {"model": model, "clients": clients, "batch_size": bs, "train_samples_per_s": rate,
                       "round_samples_per_s": whole, "raw": res}
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "raw"}), flush=True)
                save()


def recorder(args: argparse.Namespace, device: str, rows: list[dict], kept: bool | None) -> Callable[[], None]:
    """A function that writes the results recorded so far (this run's entry, holding ``rows``, after the
    earlier runs' entries): called after every row, so a run cut at a time limit keeps its finished rows."""
    machine = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
               "threads": torch.get_num_threads(), "torch": torch.__version__, "freed_memory_kept": kept}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"throughput_{device}"
    entries = json.loads(stem.with_suffix(".json").read_text()) if stem.with_suffix(".json").exists() else []
    command = "python benchmarks/throughput.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items() if k not in ("out", "data") and v not in (False, None))
    entries.append({"machine": machine, "command": command, "dataset": args.dataset, "rows": rows})

    def save() -> None:
        stem.with_suffix(".json").write_text(json.dumps(entries, indent=2) + "\n")
        stem.with_suffix(".md").write_text(render(entries, device))

    return save


def render(entries: list[dict], device: str) -> str:
    """The Markdown tables of all recorded entries, each with its reading (a ``reading``
    string added to the entry by whoever interpreted the run)."""
    lines = [f"# Client-training throughput ({device})", "",
             "Samples/s of local training (whole round incl. evaluation in brackets); ratios of training rates.", ""]
    for e in entries:
        kept = {True: ", freed memory kept", False: ", freed memory given back"}.get(
            e["machine"].get("freed_memory_kept"), "")
        lines += [f"`{e['command']}` on {e['machine']['device']} ({e['machine']['threads']} threads, torch "
                  f"{e['machine']['torch']}{kept}), {e['dataset']}", ""]
        variants = [v for v in COLUMNS if any(v in r["train_samples_per_s"] for r in e["rows"])]
        bf16 = any("ceiling_bf16" in r["train_samples_per_s"] for r in e["rows"])
        lines += ["| model | clients | batch | " + " | ".join(COLUMNS[v] for v in variants)
                  + " | best (c) | c/a | c/b | c/d |" + (" c/d' |" if bf16 else ""),
                  "|---" * (len(variants) + 7 + bf16) + "|"]
        for r in e["rows"]:
            t, w = r["train_samples_per_s"], r["round_samples_per_s"]
            best = max((v for v in VECTORIZED if v in t), key=lambda v: t[v])
            cells = [f"{t[v]:,.0f} ({w[v]:,.0f})" if v in t else "-" for v in variants]
            ca = f"{t[best] / t['peer']:.2f}" if "peer" in t else "-"
            cd2 = f" {t[best] / t['ceiling_bf16']:.2f} |" if "ceiling_bf16" in t else (" - |" if bf16 else "")
            lines.append(f"| {r['model']} | {r['clients']} | {r['batch_size']} | {' | '.join(cells)} | {best} | "
                         f"{ca} | {t[best] / t['sequential']:.2f} | {t[best] / t['ceiling']:.2f} |{cd2}")
        lines.append("")
        if e.get("reading"):
            lines += [e["reading"], ""]
    return "\n".join(lines)


COLUMNS = {"peer": "(a) peer", "sequential": "(b) sequential", "vectorized": "(c) vectorized",
           "vmap": "(c') vmap on CPU", "graph": "(c) + CUDA graph", "graph_bf16": "(c) + graph, bf16",
           "graph_bf16_cl": "(c) + graph, bf16, channels-last", "graph_pc": "(c) + graph, per-client convs",
           "graph_bf16_pc": "(c) + graph, bf16, per-client convs", "vmap_pc": "(c') vmap, per-client convs",
           "graph_compiled": "(c) + graph, compiled", "graph_bf16_compiled": "(c) + graph, bf16, compiled",
           "vmap_compiled": "(c') vmap, compiled", "vectorized_plain": "(c) vectorized, plain layers",
           "vectorized_cl": "(c) vectorized, channels-last",
           "vmap_plain": "(c') vmap, plain layers", "graph_bf16_b16": "(c) + graph, bf16, 16 steps a graph",
           "graph_bf16_noahead": "(c) + graph, bf16, plan not drawn ahead",
           "graph_bf16_plain": "(c) + graph, bf16, plain layers",
           "ceiling": "(d) ceiling", "ceiling_bf16": "(d') ceiling, bf16"}
# the hetfl vectorised variants; (c') is not one: on a CPU the executor does not vmap
VECTORIZED = ("vectorized", "graph", "graph_bf16", "graph_bf16_cl", "graph_pc", "graph_bf16_pc", "graph_compiled",
              "graph_bf16_compiled", "graph_bf16_b16", "graph_bf16_noahead")
_GRAPH = ["runtime.executor=vectorized", "runtime.cuda_graph=true"]
_PER_CLIENT = "runtime.conv_batching=per_client"
_COMPILE = "runtime.compile=true"
GRAPH_VARIANTS = {"graph": _GRAPH, "graph_bf16": [*_GRAPH, "train.precision=bf16"],
                  "graph_pc": [*_GRAPH, _PER_CLIENT], "graph_bf16_pc": [*_GRAPH, "train.precision=bf16", _PER_CLIENT],
                  "graph_bf16_cl": [*_GRAPH, "train.precision=bf16", "runtime.channels_last=true"],
                  "graph_compiled": [*_GRAPH, _COMPILE],
                  "vectorized_plain": ["runtime.executor=vectorized", "runtime.cuda_graph=false"],
                  "vectorized_cl": ["runtime.executor=vectorized", "runtime.cuda_graph=false",
                                    "runtime.channels_last=true"],
                  "graph_bf16_compiled": [*_GRAPH, "train.precision=bf16", _COMPILE],
                  # calls of up to 16 steps (the default until session 19: 4), a graph each
                  "graph_bf16_b16": [*_GRAPH, "train.precision=bf16", "runtime.graph_steps=16"],
                  # each round's plan drawn at its start (no_plans_ahead), as before session 19
                  "graph_bf16_noahead": [*_GRAPH, "train.precision=bf16"],
                  # hetfl's layers in their plain forms (plain_layers), captured: what their batching rules do to
                  # the kernels' time (vmap_reference.py's "shrinking, hetfl's layers" asks it of the plain step)
                  "graph_bf16_plain": [*_GRAPH, "train.precision=bf16"]}
_VMAP = ["runtime.executor=vectorized", "runtime.vmap_on_cpu=true"]
CPU_VARIANTS = {"vmap": _VMAP, "vmap_pc": [*_VMAP, _PER_CLIENT], "vmap_compiled": [*_VMAP, _COMPILE],
                "vmap_plain": _VMAP}
# run only when --variants names them: channels-last (measured slower), compiled (a compile per step shape)
ON_REQUEST = ("graph_bf16_cl", "graph_compiled", "graph_bf16_compiled", "vmap_compiled", "vectorized_plain",
              "vectorized_cl", "vmap_plain", "graph_bf16_b16", "graph_bf16_noahead", "graph_bf16_plain")
# run with hetfl's layers in their plain forms inside the vmapped step (plain_layers)
PLAIN_LAYERS = ("vectorized_plain", "vmap_plain", "graph_bf16_plain")
# run without the next round's plan drawn ahead (no_plans_ahead)
NO_PLANS_AHEAD = ("graph_bf16_noahead",)


if __name__ == "__main__":
    main()
