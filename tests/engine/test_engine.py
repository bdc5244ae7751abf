"""End-to-end behaviour of the engine: learning, determinism, resume after a kill."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hetfl import config
from hetfl.algorithms import available
from hetfl.algorithms.base import ServerState
from hetfl.cli import main
from hetfl.engine.checkpoint import Checkpoint, load_checkpoint, load_tensors, save_checkpoint, save_tensors
from hetfl.engine.experiment import Experiment
from hetfl.engine.rundir import LOCK_NAME
from hetfl.params import ConfigError

TIME_KEYS = {"round_time_s", "eval_time_s"}


def metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIME_KEYS} for line in lines]


def quick(*overrides: str) -> config.RunConfig:
    return config.load(None, ["train.rounds=3", "runtime.progress=false", *overrides])


def test_default_run_writes_the_run_directory_contract(tmp_path):
    code = main(["run", "--out", str(tmp_path / "r"), "--set", "train.rounds=2", "--quiet"])
    assert code == 0
    run = tmp_path / "r"
    assert {"config.toml", "metrics.jsonl", "summary.json", "checkpoint.safetensors"} <= {
        p.name for p in run.iterdir()}
    lines = metrics(run)
    assert [m["round"] for m in lines] == [1, 2]
    for m in lines:
        assert {"train_loss", "global_acc", "client_acc_mean", "bytes_up", "bytes_down"} <= set(m)
        assert 0 <= m["global_acc"] <= 1
    summary = json.loads((run / "summary.json").read_text())
    for key in ("final_global_acc", "best_global_acc", "final_client_acc_mean", "wall_time_s", "config"):
        assert key in summary
    assert config.load(run / "config.toml").data.partition == "natural"  # resolved, not "auto"
    assert not [p for p in run.iterdir() if p.name.startswith(".")], "no temporary files left"


def test_the_summary_records_what_a_constant_prediction_scores_on_the_global_test_set(tmp_path):
    """``chance_global_acc``: the largest class share of the labels global_acc is measured on (what a model
    that predicts one class scores; ``hetfl reproduce`` marks cells at it)."""
    exp = Experiment(quick("train.rounds=1", "train.local_steps=1"))
    summary = exp.run(tmp_path / "r")
    labels = exp.data.test_y.tolist()
    assert summary["chance_global_acc"] == max(labels.count(c) for c in set(labels)) / len(labels)
    assert 0 < summary["chance_global_acc"] < 1


def test_same_seed_same_metrics_and_other_seed_differs(tmp_path):
    cfg = quick()
    Experiment(cfg).run(tmp_path / "a")
    Experiment(cfg).run(tmp_path / "b")
    assert metrics(tmp_path / "a") == metrics(tmp_path / "b")
    Experiment(quick("seed=1")).run(tmp_path / "c")
    assert metrics(tmp_path / "a") != metrics(tmp_path / "c")


def test_client_sampling_and_cosine_schedule(tmp_path):
    cfg = quick("train.clients_per_round=5", "train.lr_schedule=cosine", "train.eval_every=2")
    Experiment(cfg).run(tmp_path / "s")
    lines = metrics(tmp_path / "s")
    assert all(m["clients"] == 5 for m in lines)
    # CosineAnnealingLR(T_max=rounds) stepped once per round: the last round still trains
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.train.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.train.rounds, eta_min=cfg.train.lr_min)
    expected = []
    for _ in lines:
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert [m["lr"] for m in lines] == pytest.approx(expected, rel=1e-12)
    assert lines[0]["lr"] == cfg.train.lr and lines[-1]["lr"] > cfg.train.lr_min
    assert "global_acc" not in lines[0] and "global_acc" in lines[1] and "global_acc" in lines[2]


def test_a_diverging_run_is_named_in_the_log_and_the_summary(tmp_path, caplog):
    Experiment(quick("train.lr=1e36")).run(tmp_path / "bad")  # steps past float32: inf, then NaN
    summary = json.loads((tmp_path / "bad" / "summary.json").read_text())
    first = next(m["round"] for m in metrics(tmp_path / "bad") if not math.isfinite(m["train_loss"]))
    assert summary["diverged_round"] == first
    warnings = [r.message for r in caplog.records if "training diverged" in r.message]
    assert len(warnings) == 1 and f"from round {first}" in warnings[0]
    Experiment(quick()).run(tmp_path / "good")
    assert json.loads((tmp_path / "good" / "summary.json").read_text())["diverged_round"] is None


@pytest.mark.slow
def test_kill_and_resume_gives_identical_metrics(tmp_path):
    """A ``hetfl run`` SIGKILLed after its third round's line, resumed: the uninterrupted run's metrics.
    Rounds of one epoch of a 64-unit MLP (about 0.1 s of CPU each; three epochs of 256 units took 0.4 s)
    still leave the five remaining rounds far longer than the 20-ms poll that finds the third line."""
    args = ["--set", "train.rounds=8", "--set", "train.local_epochs=1", "--set", "model.options={hidden = [64]}",
            "--set", "runtime.progress=false"]
    Experiment(config.load(None, [a for a in args if a != "--set"])).run(tmp_path / "full")
    run = tmp_path / "killed"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "hetfl.cli", "run", "--out", str(run), *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline:
        path = run / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= 3:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = len((run / "metrics.jsonl").read_text().splitlines())
    assert killed_at < 8, "the run finished before it could be killed; make rounds slower"
    assert main(["run", "--resume", str(run), "--quiet"]) == 0
    assert metrics(run) == metrics(tmp_path / "full")
    full = json.loads((tmp_path / "full" / "summary.json").read_text())
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["final_global_acc"] == full["final_global_acc"]


README_PLUGIN = '''
from dataclasses import dataclass

import torch.nn.functional as F

from hetfl.algorithms import register
from hetfl.algorithms.base import Algorithm
from hetfl.params import setting


@dataclass(frozen=True)
class FeatureNormHyper:
    """weight: strength of the feature-norm penalty."""
    weight: float = setting(0.01, ge=0.0, doc="penalty weight")


@register
class FeatureNorm(Algorithm):
    name = "featnorm"
    Hyper = FeatureNormHyper
    citation = "an example"

    def loss(self, state, batch, ctx):
        features, logits = self.model.features_and_logits(state, batch.x)
        ce = F.cross_entropy(logits, batch.y)
        penalty = features.pow(2).sum(1).mean()
        return ce + self.hp.weight * penalty, {"ce": ce.detach(), "penalty": penalty.detach()}
'''


def test_readme_plugin_example_runs(tmp_path, monkeypatch):
    from hetfl import algorithms

    # the plug-in registers for this test only: another test's copy of the example is another file (another class)
    monkeypatch.setattr(algorithms, "_CLASSES", dict(algorithms._CLASSES))
    monkeypatch.setattr(algorithms, "_PLUGIN_FILES", dict(algorithms._PLUGIN_FILES))
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert "class FeatureNorm(Algorithm)" in readme, "keep this test in sync with the README example"
    plugin = tmp_path / "my_method.py"
    plugin.write_text(README_PLUGIN)
    out = tmp_path / "r"
    code = main(["run", "--plugin", str(plugin), "--set", "algorithm.name=featnorm", "--set", "algorithm.weight=0.05",
                 "--set", "train.rounds=2", "--out", str(out), "--quiet"])
    assert code == 0
    source = f"my_method.py sha256:{hashlib.sha256(README_PLUGIN.encode()).hexdigest()[:16]}"  # the file's code
    assert json.loads((out / "summary.json").read_text())["config"]["algorithm"] == \
        {"name": "featnorm", "weight": 0.05, "plugin_source": source}


# A resume meets client states saved in different rounds: 6 of 30 clients a round, a small MLP, 3 local steps.
# Found in session 22 (4 rounds of 6 steps, 300 samples a client at most), each 1e-8 or less from the
# uninterrupted run before its fix:
# - pFedHN (sequential): its generated models are matrix-vector products of hypernetwork weights read from the
#   checkpoint; a CPU kernel rounds by a tensor's address, and a safetensors file holds tensors at 8-byte offsets
#   (hetfl.engine.checkpoint.load_tensors);
# - MOON and FedPAC (vmapped): the executor kept, per group structure, the size of the group when first met (the
#   clients with a previous model: one in round 2), so the uninterrupted run trained them one at a time from
#   then on, the resumed run together (vectorized.clients_that_fit);
# - Local (vmapped): a safetensors file lists its tensors sorted by name, so resumed states had another order
#   than new ones, which the batched evaluation refused: each model evaluated alone, its accuracy a float32 mean.
# Whether a cause shows here depends on incidentals (the header's length moves every tensor's offset in the file;
# exact accuracies on both paths hide the second order), so each has its own test below as well.
# Evaluated in the last round only: the round trained after the resume, its clients' states read from the
# checkpoint and new ones together (rounds 1 and 2 are evaluated before the crash, the same in both runs;
# their evaluations of 30 clients were a fifth of the test's time).
RESUME = ["train.rounds=3", "data.options={max_samples = 150}", "train.clients_per_round=6",
          "model.options={hidden = [16]}", "train.local_steps=3", "train.eval_every=3"]
EXECUTORS = {"sequential": [], "vmapped": ["runtime.executor=vectorized", "runtime.vmap_on_cpu=true"]}
# fewer of the methods' own inner epochs and steps: the suite's time (the same code runs)
METHOD_SETTINGS = {"fedetf": ["algorithm.pers_cycles=1", "algorithm.pers_epochs=1"],
                   "pfedme": ["algorithm.inner_steps=2"], "fedbabu": ["algorithm.finetune_epochs=1"],
                   "fedavg+ccvr(every round)": ["algorithm.name=fedavg+ccvr", "algorithm.ccvr.every_round=true"]}


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("method", [*available(), "fedavg+ccvr", "fedavg+ccvr(every round)"])
def test_every_method_resumes_to_the_bit(method, executor, tmp_path, monkeypatch):
    """Client state (control variates, previous models, personal heads) and server state survive a crash:
    the resumed run's metrics are the uninterrupted run's, to the bit. The crash: the run directory as the
    uninterrupted run left it when round 3 began (two rounds written and checkpointed), copied aside, which
    another Experiment resumes (a separate run interrupted there wrote the same files, in two more rounds of
    the test's time: a third of it)."""
    cfg = quick(*RESUME, f"algorithm.name={method}", *METHOD_SETTINGS.get(method, []), *EXECUTORS[executor])
    copy_when_round_3_starts(tmp_path / "full", tmp_path / "crashed", monkeypatch)
    Experiment(cfg).run(tmp_path / "full")
    assert len(metrics(tmp_path / "crashed")) == 2 and not (tmp_path / "crashed" / "summary.json").exists()
    Experiment(cfg).run(tmp_path / "crashed", resume=True)
    assert metrics(tmp_path / "crashed") == metrics(tmp_path / "full")


def copy_when_round_3_starts(run_dir: Path, copy: Path, monkeypatch) -> None:
    """Copy ``run_dir`` to ``copy`` when the run there starts round 3, its lock file left out: what a crash
    there leaves (rounds 1 and 2 written, their checkpoint taken, nothing of round 3)."""
    original = Experiment.round

    def round_(self, server, clients, round_, reporter):
        if round_ == 3 and self.run_dir == run_dir:
            shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns(LOCK_NAME))
        return original(self, server, clients, round_, reporter)

    monkeypatch.setattr(Experiment, "round", round_)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("method", ["scaffold", "fedavgm", "ditto", "fedavg+ccvr"])
def test_a_resume_that_recomputes_a_round_after_the_checkpoint_is_the_uninterrupted_run(method, executor, tmp_path,
                                                                                         monkeypatch):
    """Checkpoints every 2 rounds of 5 (the last one too), evaluation every 2, a cosine schedule, 6 of 30
    clients a round: a crash in round 4 finds round 3's line after round 2's checkpoint, drops it and
    recomputes it; metrics, client metrics and summary (wall time aside) are the uninterrupted run's."""
    cfg = quick(*RESUME, "train.rounds=5", "runtime.checkpoint_every=2", "train.eval_every=2",
                "train.lr_schedule=cosine", f"algorithm.name={method}", *EXECUTORS[executor])
    Experiment(cfg).run(tmp_path / "full")
    original = Experiment.round

    def crash_in_round_4(self, server, clients, round_, reporter):
        if round_ == 4:
            raise KeyboardInterrupt
        return original(self, server, clients, round_, reporter)

    monkeypatch.setattr(Experiment, "round", crash_in_round_4)
    with pytest.raises(KeyboardInterrupt):
        Experiment(cfg).run(tmp_path / "crashed")
    monkeypatch.setattr(Experiment, "round", original)
    assert len(metrics(tmp_path / "crashed")) == 3  # round 3's line is after the checkpoint of round 2
    Experiment(cfg).run(tmp_path / "crashed", resume=True)
    assert metrics(tmp_path / "crashed") == metrics(tmp_path / "full")
    for name in ("client_metrics.jsonl", "config.toml"):
        assert (tmp_path / "crashed" / name).read_bytes() == (tmp_path / "full" / name).read_bytes()
    full, resumed = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("full", "crashed"))
    assert {**full, "wall_time_s": 0} == {**resumed, "wall_time_s": 0}


def crash_in_round_3_and_resume(cfg: config.RunConfig, run_dir: Path, monkeypatch) -> None:
    """Run ``cfg`` in ``run_dir``, interrupted at the start of round 3 (two rounds written), then resume it."""
    original = Experiment.round

    def crash_in_round_3(self, server, clients, round_, reporter):
        if round_ == 3:
            raise KeyboardInterrupt
        return original(self, server, clients, round_, reporter)

    monkeypatch.setattr(Experiment, "round", crash_in_round_3)
    with pytest.raises(KeyboardInterrupt):
        Experiment(cfg).run(run_dir)
    monkeypatch.setattr(Experiment, "round", original)
    assert len(metrics(run_dir)) == 2
    Experiment(cfg).run(run_dir, resume=True)


@pytest.mark.parametrize("every", [0, 5])
def test_a_resume_before_any_checkpoint_refuses_another_config_naming_the_keys(every, tmp_path, monkeypatch):
    """A run interrupted before its first checkpoint (``checkpoint_every = 0``, or a kill in round 1) has only
    its ``config.toml`` to say what it is: resumed with another configuration (``run_experiment``,
    ``Experiment.run(resume=True)``) it is refused naming the keys, nothing written. It once recomputed the
    rounds with the other configuration under the old ``config.toml``: a folder whose metrics and summary
    were of lr 0.5 FedProx and whose config.toml said lr 0.05 FedAvg. The same configuration resumes."""
    from hetfl.engine.rundir import RunDirError

    cfg = quick(*RESUME, f"runtime.checkpoint_every={every}")
    run = tmp_path / "r"
    original = Experiment.round

    def crash_in_round_3(self, server, clients, round_, reporter):
        if round_ == 3:
            raise KeyboardInterrupt
        return original(self, server, clients, round_, reporter)

    monkeypatch.setattr(Experiment, "round", crash_in_round_3)
    with pytest.raises(KeyboardInterrupt):
        Experiment(cfg).run(run)
    monkeypatch.setattr(Experiment, "round", original)
    crash_before = {path.name: path.read_bytes() for path in run.iterdir()}
    other = quick(*RESUME, f"runtime.checkpoint_every={every}", "train.lr=0.5", "algorithm.name=fedprox")
    with pytest.raises(RunDirError, match=r"config.toml.*algorithm.name: 'fedavg' -> 'fedprox'.*train.lr: 0.05 -> 0.5"):
        Experiment(other).run(run, resume=True)
    assert {path.name: path.read_bytes() for path in run.iterdir()} == crash_before, "nothing written"
    Experiment(cfg).run(run, resume=True)
    Experiment(cfg).run(tmp_path / "full")
    assert metrics(run) == metrics(tmp_path / "full")


def test_tensors_read_back_from_a_file_lie_where_torch_puts_its_own(tmp_path):
    """load_tensors gives every tensor memory of its own, aligned as torch aligns what it allocates (64
    bytes on a CPU), whatever its offset in the file (safetensors: multiples of 8 bytes)."""
    tensors = {f"t{n}": torch.randn(n) for n in (1, 3, 5, 7, 33, 100)}
    save_tensors(tmp_path / "x.safetensors", tensors)
    loaded = load_tensors(tmp_path / "x.safetensors")
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert {k: t.data_ptr() % 64 for k, t in loaded.items() if t.data_ptr() % 64} == {}


def test_a_checkpoint_reaches_the_disk_before_it_replaces_the_previous_one(tmp_path, monkeypatch):
    """The new checkpoint's bytes are fsynced before the rename that makes it the checkpoint, and the rename
    itself after it (as metrics.jsonl's lines and the privacy ledger are): a power loss then leaves the old
    checkpoint or the new one. Without it the rename could reach the disk before the data, leaving an empty
    checkpoint.safetensors beside a metrics.jsonl that was fsynced up to its round: a run that cannot resume
    ("corrupt ... delete it to restart the run from round 1")."""
    events: list[tuple[str, int]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.fstat(fd).st_ino))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.stat(src).st_ino))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    save_tensors(tmp_path / "x.safetensors", {"w": torch.ones(3)})
    inode = (tmp_path / "x.safetensors").stat().st_ino
    assert ("fsync", inode) in events and ("replace", inode) in events
    assert events.index(("fsync", inode)) < events.index(("replace", inode))
    assert ("fsync", tmp_path.stat().st_ino) in events[events.index(("replace", inode)):], "the rename, durable"


def test_a_checkpoint_gives_back_every_dict_in_the_order_it_was_saved_in(tmp_path):
    """A safetensors file lists its tensors sorted by name; the checkpoint's metadata keeps the order of the
    server's dicts, of the clients and of each client's state, as they were in memory (the batched personalised
    evaluation once refused to batch states of different orders)."""
    def t():
        return torch.zeros(2)

    server = ServerState(model={"w": t(), "b": t()}, extra={"z": t(), "a": t()})
    clients = {10: {"prev/w": t(), "prev/b": t()}, 2: {"c": t(), "a": t()}}
    save_checkpoint(tmp_path, Checkpoint(round=3, server=server, clients=clients, info={}))
    back = load_checkpoint(tmp_path, torch.device("cpu"))
    assert (list(back.server.model), list(back.server.extra)) == (["w", "b"], ["z", "a"])
    assert [(c, list(state)) for c, state in back.clients.items()] == [(10, ["prev/w", "prev/b"]), (2, ["c", "a"])]


def test_saved_client_models_average_to_the_global_model(tmp_path):
    """FedAvg: the data-size-weighted mean of the saved local models is the next global model."""
    from safetensors.torch import load_file

    from hetfl.engine.checkpoint import load_checkpoint

    cfg = quick("train.rounds=1", "runtime.save_client_models=[1]", "model.options={hidden = [8]}")
    exp = Experiment(cfg)
    exp.run(tmp_path / "r")
    saved = load_file(tmp_path / "r" / "client_models" / "round_0001.safetensors")
    server = load_checkpoint(tmp_path / "r", torch.device("cpu")).server
    sizes = exp.data.client_sizes
    for name, value in server.model.items():
        mean = sum(sizes[c] * saved[f"{c}/{name}"] for c in range(len(sizes))) / sum(sizes)
        assert torch.allclose(mean, value, atol=1e-6), name
    with pytest.raises(ConfigError, match="runtime.save_client_models"):
        Experiment(quick("runtime.save_client_models=[0]"))


def test_a_checkpoint_from_before_a_new_config_key_still_resumes_and_a_changed_key_is_named():
    """Keys added to hetfl later (with defaults that leave old runs unchanged) must not stop a
    run from resuming; a real change of configuration is refused, naming the key."""
    from hetfl.engine.setup import config_changes

    cfg = config.load(None, ["train.lr=0.1"])
    saved = config.to_tree(cfg)
    assert config_changes(saved, cfg) == []
    older = config.to_tree(cfg)
    del older["runtime"]["flower_timeout_s"]  # a checkpoint written before this key existed
    assert config_changes(older, cfg) == []
    assert config_changes(saved, config.load(None, ["train.lr=0.05"])) == ["train.lr: 0.1 -> 0.05"]
    gone = {**saved, "runtime": {**saved["runtime"], "retired_key": 1}}
    assert "no longer valid" in config_changes(gone, cfg)[0] and "retired_key" in config_changes(gone, cfg)[0]
