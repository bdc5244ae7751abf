"""hetfl on Flower's simulation engine: the codec, simulation = sequential, the one-command executor.

Skipped when Flower is not installed (``pip install "hetfl[flower]"``). Each simulation starts
Ray once (~15-30 s on 2 CPU cores), so the methods share one simulation.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason='Flower is not installed: pip install "hetfl[flower]"')
pytest.importorskip("ray", reason='Flower\'s simulation engine (Ray) is not installed: pip install "hetfl[flower]"')

import torch

from hetfl import config
from hetfl.algorithms.base import ServerState
from hetfl.cli import main
from hetfl.engine.checkpoint import load_checkpoint
from hetfl.engine.experiment import Experiment
from hetfl.flower.codec import decode_tensor, encode_tensor, from_record, to_record
from hetfl.flower.protocol import NODES_DIR
from hetfl.flower.server import _Reads
from hetfl.flower.simulation import run_simulations
from tests.helpers.plugins import EMA_PLUGIN
from tests.helpers.readme import readme_command

# 3 clients of FedProx's Synthetic(1,1) split by Dirichlet, a small MLP, 2 rounds of 10 local steps, 1 thread
SMALL = ["data.num_clients=3", "data.partition=dirichlet", "train.rounds=2", "train.batch_size=16",
         "train.local_steps=10", "model.options={hidden = [16]}", "runtime.progress=false", "runtime.threads=1"]
FLOWER_KEYS = {"failed_clients", "flower_bytes_down", "flower_bytes_up"}
TIME_KEYS = {"round_time_s", "eval_time_s"}


def metrics(run_dir: Path, drop: set[str] = TIME_KEYS | FLOWER_KEYS) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in drop} for line in lines]


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_tensors_round_trip_bit_exact_in_every_dtype():
    nan_payload = torch.tensor([0x7FC00001, -0x3EDCBA], dtype=torch.int32).view(torch.float32)  # quiet NaNs
    tensors = {
        "f32": torch.tensor([1.5, -0.0, float("inf"), 1e-45]), "nan": nan_payload,
        "f64": torch.randn(3, 2, dtype=torch.float64), "f16": torch.randn(4).half(),
        "bf16": torch.randn(2, 3).to(torch.bfloat16), "i64": torch.tensor([[1, -2], [3, 2**62]]),
        "bool": torch.tensor([True, False]), "u8": torch.arange(7, dtype=torch.uint8),
        "scalar": torch.tensor(0.25), "empty": torch.zeros(0, 5), "empty_bf16": torch.zeros(2, 0, dtype=torch.bfloat16),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
    }
    back = from_record(to_record(tensors))
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        got = back[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8) if got.numel() else got,
                           t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else t), name
    # in memory torch allocated, aligned as its own tensors (a CPU kernel's rounding can depend on the address)
    assert {name: t.data_ptr() % 64 for name, t in back.items() if t.numel() and t.data_ptr() % 64} == {}
    assert encode_tensor(tensors["f32"]).stype == "numpy.ndarray"  # readable by Flower's own tools
    assert decode_tensor(encode_tensor(tensors["bf16"])).dtype == torch.bfloat16


def test_the_server_sends_a_node_only_the_server_state_client_model_reads():
    """FedPAC's client_model reads the global model and that client's aggregated head only."""
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedpac"]))
    server = exp.initial_server()
    extra = {**server.extra, **{f"head.{c}/{n}": torch.zeros(1) for c in range(3) for n in exp.algorithm.head_names}}
    view = ServerState(_Reads(server.model), _Reads(extra))
    exp.algorithm.client_model(view, exp.algorithm.init_client_state(1, server), 1)
    assert view.model.read == set(server.model)
    assert {k for k in view.extra.read if k in extra} == {f"head.1/{n}" for n in exp.algorithm.head_names}


@pytest.mark.processes
@pytest.mark.slow  # ~20 s (Ray ~15); fast cover: test_flower_logic.py (the nodes' replies on a fake grid)
def test_the_readmes_flower_command_gives_the_sequential_numbers(tmp_path, monkeypatch):
    """The README's ``hetfl run --set runtime.executor=flower --set algorithm.name=scaffold --out ...`` (made
    small; the README test leaves it to this test) and, in the same simulation (one Ray start, ~15 s, serves
    them all: the command's call of run_simulation runs the other methods' jobs after its own), other methods.
    Same code on the same CPU: metrics, summary and final server state are bit-identical to the sequential
    executor's, in the run directory of the other executors.
    scaffold (control variates: server + node state, kept on each node), fedavg (plain), fedpac (statistics,
    per-client heads, personalised evaluation on the nodes), fedavg+ccvr (post-hoc query round), fedmix (set-up
    round, shared data), a plug-in's method (``--plugin FILE``, loaded as the CLI loads it: the simulated nodes,
    Ray's worker processes, load the file the server loaded; its client state kept on the nodes).
    (Crash and resume: tests/flower/test_flower_logic.py.)"""
    from hetfl.algorithms import load_plugin
    from hetfl.flower import simulation

    command = readme_command("hetfl run --set runtime.executor=flower --set algorithm.name=scaffold")
    assert command[:2] == ["hetfl", "run"] and "--out" in command
    args = command[1:]
    args[args.index("--out") + 1] = str(tmp_path / "flower-scaffold")
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    assert "runtime.executor=flower" in sets and "algorithm.name=scaffold" in sets
    Experiment(config.load(None, [*SMALL, *[x for x in sets if x != "runtime.executor=flower"]])).run(
        tmp_path / "seq-scaffold")
    plugin = tmp_path / "ema_plugin.py"
    plugin.write_text(EMA_PLUGIN)
    load_plugin(str(plugin))  # what --plugin does; the registry is put back after the test (tests/conftest.py)
    others = ["fedavg", "fedpac", "fedavg+ccvr", "fedmix", "emaprox_test"]
    for m in others:
        Experiment(config.load(None, [*SMALL, f"algorithm.name={m}"])).run(tmp_path / f"seq-{m}")
    jobs = [(Experiment(config.load(None, [*SMALL, f"algorithm.name={m}", "runtime.executor=flower"])),
             tmp_path / f"flower-{m}", False) for m in others]
    calls = []

    def with_the_others(exp, run_dir, *, resume=False, reporter=None):  # run_simulation's body, plus the others
        calls.append(run_dir)
        return run_simulations([(exp, run_dir, resume), *jobs], reporter=reporter)[0]

    monkeypatch.setattr(simulation, "run_simulation", with_the_others)
    assert main([*args, *[f"--set={x}" for x in SMALL], "--quiet"]) == 0
    assert len(calls) == 1, calls
    run = tmp_path / "flower-scaffold"
    assert {"config.toml", "metrics.jsonl", "summary.json", "checkpoint.safetensors", NODES_DIR} <= {
        p.name for p in run.iterdir()}  # NODES_DIR: SCAFFOLD's control variates, for resume
    assert config.load(run / "config.toml").runtime.executor == "flower"
    for m in ["scaffold", *others]:
        seq, flw = tmp_path / f"seq-{m}", tmp_path / f"flower-{m}"
        assert {"config.toml", "metrics.jsonl", "summary.json", "checkpoint.safetensors"} <= {
            p.name for p in flw.iterdir()}, m
        assert metrics(flw) == metrics(seq), m
        lines = [json.loads(x) for x in (flw / "metrics.jsonl").read_text().splitlines()]
        assert all(line["failed_clients"] == [] and line["flower_bytes_down"] > 0 for line in lines), m
        a, b = (json.loads((d / "summary.json").read_text()) for d in (seq, flw))
        for key in ("final_train_loss", "final_client_acc_mean", "final_global_acc", "bytes_up_total"):
            assert a.get(key) == b.get(key), (m, key)
        ca, cb = load_checkpoint(seq, torch.device("cpu")), load_checkpoint(flw, torch.device("cpu"))
        assert same_tensors(ca.server.model, cb.server.model) and same_tensors(ca.server.extra, cb.server.extra), m
        assert cb.clients == {}, m  # client state lives on the nodes
    assert metrics(tmp_path / "seq-emaprox_test")[-1]["train_prox"] > 0  # the plug-in's client state is used


def test_simulated_nodes_take_the_processs_thread_count_unless_runtime_threads_is_set():
    """torch's CPU kernels round differently with another thread count, and Ray starts actors with
    one thread per CPU: with runtime.threads=0 the nodes must use the hetfl process's count to give
    the sequential executor's numbers bit for bit (default synthetic run, 8 rounds: equal with this,
    different without; see server.node_config)."""
    from hetfl.flower.server import FlowerFederation, node_config

    default = config.load(None, ["runtime.progress=false"])
    assert default.runtime.threads == 0
    assert node_config(default, simulation=True).runtime.threads == torch.get_num_threads()
    assert node_config(default, simulation=False) == default  # a deployed node decides for itself
    one = config.load(None, ["runtime.threads=1"])
    assert node_config(one, simulation=True) == one
    sent = FlowerFederation(Experiment(default), grid=None, simulation=True).config_text
    assert config.from_dict(tomllib.loads(sent)).runtime.threads == torch.get_num_threads()
