"""Scale: per-round output that does not grow with the devices that do not take part, the
per-client file (``client_metrics.jsonl``) and its resume, set-up without per-device scans
(checked against the per-device code it replaced), and readers of old run folders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hetfl import config
from hetfl.analysis.curves import client_spread, run_curves
from hetfl.cli import main
from hetfl.data import partition
from hetfl.data.datasets import synthetic
from hetfl.data.datasets.common import Context
from hetfl.engine import federation, identity, summary
from hetfl.engine.checkpoint import load_checkpoint, save_checkpoint
from hetfl.engine.data import FederatedData
from hetfl.engine.experiment import Experiment
from hetfl.engine.rundir import CLIENT_METRICS_NAME, CLIENT_RECORD_KEY, HISTORY_KEY, RunDirError
from hetfl.params import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

SUMMARY_KEYS = ("clients_evaluated", "client_acc_min", "client_acc_q25", "client_acc_median", "client_acc_q75",
                "client_acc_max")
TIME_KEYS = ("round_time_s", "eval_time_s")


def synthetic_cfg(devices: int, *overrides: str) -> config.RunConfig:
    return config.load(None, [f"data.options={{num_devices = {devices}}}", f"data.num_clients={devices}",
                              "train.clients_per_round=5", "train.rounds=2", "model.name=mlp",
                              "model.options={hidden = [16]}", "runtime.progress=false", *overrides])


def lines(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(raw) for raw in (run_dir / name).read_text().splitlines()]


def without_times(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIME_KEYS} for row in rows]


# ------------------------------------------------------------ the metrics line
def test_the_metrics_line_does_not_grow_with_devices_that_do_not_take_part(tmp_path):
    for devices in (50, 500):
        Experiment(synthetic_cfg(devices, "runtime.checkpoint_every=0")).run(tmp_path / str(devices))
    small, large = (lines(tmp_path / str(n)) for n in (50, 500))
    assert [set(m) for m in small] == [set(m) for m in large]
    assert all(set(SUMMARY_KEYS) <= set(m) and "client_acc" not in m for m in large)
    assert [m["clients_evaluated"] for m in large] == [500, 500]
    size = [len((tmp_path / str(n) / "metrics.jsonl").read_bytes()) for n in (50, 500)]
    assert size[1] < 1.2 * size[0], size  # the per-client list made it ~10x larger
    rows = lines(tmp_path / "500", CLIENT_METRICS_NAME)
    assert [r["round"] for r in rows] == [1, 2] and all(len(r["client_acc"]) == 500 for r in rows)


def test_the_per_client_file_holds_each_clients_accuracy_and_the_line_their_summary(tmp_path):
    Experiment(synthetic_cfg(40, "train.rounds=5", "runtime.client_metrics_every=2")).run(tmp_path / "r")
    metrics, rows = lines(tmp_path / "r"), lines(tmp_path / "r", CLIENT_METRICS_NAME)
    assert [r["round"] for r in rows] == [2, 4, 5]  # multiples of 2, and the last round
    for row in rows:
        line = metrics[row["round"] - 1]
        accs = [a for a in row["client_acc"] if a is not None]
        assert len(row["client_acc"]) == 40 and len(accs) == line["clients_evaluated"] == 40
        assert np.mean(accs) == pytest.approx(line["client_acc_mean"], abs=1e-6)
        quartiles = np.percentile(np.asarray(accs, dtype=np.float64), [0, 25, 50, 75, 100]).tolist()
        assert quartiles == [line[k] for k in SUMMARY_KEYS[1:]]
    Experiment(synthetic_cfg(40, "runtime.client_metrics_every=0")).run(tmp_path / "none")
    assert not (tmp_path / "none" / CLIENT_METRICS_NAME).exists()
    assert all(set(SUMMARY_KEYS) <= set(m) for m in lines(tmp_path / "none"))


@pytest.mark.parametrize("method", ["fedavg", "scaffold"])
def test_accuracies_from_the_global_models_correctness_equal_the_per_client_evaluation(tmp_path, monkeypatch, method):
    """The vectorised path (all clients from one correctness vector) against the per-client loop."""
    cfg = synthetic_cfg(30, "train.rounds=2", f"algorithm.name={method}")
    assert federation.evaluates_with_global_model(Experiment(cfg).algorithm)
    Experiment(cfg).run(tmp_path / "vectorised")
    monkeypatch.setattr(federation, "evaluates_with_global_model", lambda algo: False)
    Experiment(cfg).run(tmp_path / "loop")
    for name in ("metrics.jsonl", CLIENT_METRICS_NAME):
        assert without_times(lines(tmp_path / "vectorised", name)) == without_times(lines(tmp_path / "loop", name))


def test_client_test_accuracies_reproduce_torch_mean_per_client():
    gen = torch.Generator().manual_seed(0)
    correct = torch.rand(500, generator=gen) < 0.37
    tests = [np.sort(np.random.default_rng(c).choice(500, size=c % 7 * 13, replace=False)) for c in range(25)]
    data = FederatedData.__new__(FederatedData)  # only the test indices matter here
    data.client_test_idx = [torch.as_tensor(t, dtype=torch.long) for t in tests]
    data.device, data._test_segments = torch.device("cpu"), None
    got = data.client_test_accuracies(correct)
    want = {c: correct[torch.as_tensor(t)].float().mean().item() for c, t in enumerate(tests) if len(t)}
    assert got == want and set(got) == {c for c, t in enumerate(tests) if len(t)}  # exact floats, empty left out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.mean is sum * (1/n) there)")
def test_client_test_accuracies_reproduce_torch_mean_per_client_on_cuda():
    device = torch.device("cuda")
    correct = (torch.rand(100_000, generator=torch.Generator().manual_seed(1)) < 0.61).to(device)
    tests = [np.arange(c * 97, c * 97 + 1 + c * 37 % 911) for c in range(300)]
    data = FederatedData.__new__(FederatedData)
    data.client_test_idx = [torch.as_tensor(t, dtype=torch.long) for t in tests]
    data.device, data._test_segments = device, None
    want = {c: correct[torch.as_tensor(t, device=device)].float().mean().item() for c, t in enumerate(tests)}
    assert data.client_test_accuracies(correct) == want


# ------------------------------------------------------------ resume
def interrupted(tmp_path: Path, monkeypatch, cfg: config.RunConfig, die_at: int) -> Path:
    """A run killed at the start of round ``die_at`` (its last checkpoint before that round)."""
    original = Experiment.round

    def round_(self, server, clients, round_, reporter):
        if round_ == die_at:
            raise KeyboardInterrupt
        return original(self, server, clients, round_, reporter)

    run = tmp_path / "run"
    monkeypatch.setattr(Experiment, "round", round_)
    with pytest.raises(KeyboardInterrupt):
        Experiment(cfg).run(run)
    monkeypatch.setattr(Experiment, "round", original)
    return run


def test_the_per_client_file_is_cut_back_to_the_checkpoint_and_recomputed_on_resume(tmp_path, monkeypatch):
    cfg = synthetic_cfg(20, "train.rounds=5", "runtime.checkpoint_every=2")
    Experiment(cfg).run(tmp_path / "full")
    run = interrupted(tmp_path, monkeypatch, cfg, die_at=4)  # checkpoint at 2, lines of round 3 written
    assert [r["round"] for r in lines(run, CLIENT_METRICS_NAME)] == [1, 2, 3]
    with open(run / CLIENT_METRICS_NAME, "ab") as fh:
        fh.write(b'{"round":4,"client_a')  # a cut line after the checkpoint, as a kill leaves it
    Experiment(cfg).run(run, resume=True)
    full = (tmp_path / "full" / CLIENT_METRICS_NAME).read_bytes()
    assert (run / CLIENT_METRICS_NAME).read_bytes() == full


def test_a_per_client_file_that_differs_from_the_checkpoints_record_is_refused(tmp_path, monkeypatch):
    cfg = synthetic_cfg(20, "train.rounds=5", "runtime.checkpoint_every=2")
    run = interrupted(tmp_path, monkeypatch, cfg, die_at=4)
    path = run / CLIENT_METRICS_NAME
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b'"round":1', b'"round":7', 1))
    with pytest.raises(RunDirError, match=r"client_metrics\.jsonl: the file is shorter than or differs"):
        Experiment(cfg).run(run, resume=True)
    path.write_bytes(raw[:40])  # cut before the checkpoint's bytes
    with pytest.raises(RunDirError, match="checkpoint of round 2 recorded"):
        Experiment(cfg).run(run, resume=True)


def test_a_checkpoint_without_the_per_client_record_keeps_whole_lines_up_to_its_round(tmp_path, monkeypatch):
    """Checkpoints written before the per-client file: its lines of rounds <= the checkpoint's are kept."""
    cfg = synthetic_cfg(20, "train.rounds=5", "runtime.checkpoint_every=2")
    Experiment(cfg).run(tmp_path / "full")
    run = interrupted(tmp_path, monkeypatch, cfg, die_at=4)
    ckpt = load_checkpoint(run, torch.device("cpu"))
    del ckpt.info[HISTORY_KEY][CLIENT_RECORD_KEY]
    save_checkpoint(run, ckpt)
    Experiment(cfg).run(run, resume=True)
    assert (run / CLIENT_METRICS_NAME).read_bytes() == (tmp_path / "full" / CLIENT_METRICS_NAME).read_bytes()


# ------------------------------------------------------------ readers of old runs
def test_client_spread_reads_old_lines_with_client_acc_and_new_lines_alike():
    accs = [[0.5, 0.25, 1.0, 0.75], [0.1, 0.2, 0.3]]
    old = [{"round": r, "train_loss": 1.0, "client_acc_mean": float(np.mean(a)), "client_acc": a}
           for r, a in enumerate(accs, start=1)]
    new = [{"round": r, "train_loss": 1.0, **summary.client_acc_summary(a)} for r, a in enumerate(accs, start=1)]
    assert client_spread(old) == client_spread(new)
    spread = client_spread(new)
    want = {"min": [0.25, 0.1], "q25": [0.4375, 0.15], "median": [0.625, 0.2], "q75": [0.8125, 0.25], "max": [1.0, 0.3]}
    assert spread["round"] == [1, 2] and spread["num_clients"] == [4, 3]
    assert all(spread[k] == pytest.approx(v, abs=1e-12) for k, v in want.items())
    assert client_spread([*old[:1], {"round": 2, "train_loss": 1.0}])["round"] == [1]  # not evaluated: left out


def test_an_old_run_folder_with_client_acc_in_its_lines_still_reads(tmp_path):
    Experiment(synthetic_cfg(12)).run(tmp_path / "r")
    new_spread = run_curves(tmp_path / "r")["spread"]
    rows = {r["round"]: r["client_acc"] for r in lines(tmp_path / "r", CLIENT_METRICS_NAME)}
    old_lines = []
    for m in lines(tmp_path / "r"):  # as written before client_metrics.jsonl
        m = {k: v for k, v in m.items() if k not in SUMMARY_KEYS}
        m["client_acc"] = [a for a in rows[m["round"]] if a is not None]
        old_lines.append(json.dumps(m))
    (tmp_path / "r" / "metrics.jsonl").write_text("\n".join(old_lines) + "\n")
    (tmp_path / "r" / CLIENT_METRICS_NAME).unlink()
    assert run_curves(tmp_path / "r")["spread"] == new_spread


# ------------------------------------------------------------ the config key
def test_client_metrics_every_is_validated_listed_and_not_part_of_the_identity(capsys):
    for bad in (-1, "often", 1.5):
        with pytest.raises(ConfigError, match="runtime.client_metrics_every"):
            config.load(None, [f"runtime.client_metrics_every={bad!r}" if isinstance(bad, str)
                               else f"runtime.client_metrics_every={bad}"])
    a, b = (config.to_tree(config.load(None, [f"runtime.client_metrics_every={k}"])) for k in (1, 0))
    assert identity.run_id(a) == identity.run_id(b) and identity.differing_keys(a, b) == []
    assert main(["list", "config"]) == 0
    assert "runtime.client_metrics_every" in capsys.readouterr().out


# ------------------------------------------------------------ set-up without per-device scans
def old_split_by_group(groups: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """synthetic.split_by_group before: one scan of all samples per group."""
    rng = np.random.default_rng([seed, 1])
    train, test = [], []
    for g in np.unique(groups):
        index = rng.permutation(np.flatnonzero(groups == g))
        n_test = round(test_fraction * len(index))
        test.append(index[:n_test])
        train.append(index[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def old_generate(alpha, beta, num_devices, dim, num_classes, iid, seed, max_samples=5000):  # type: ignore[no-untyped-def]
    """synthetic.generate before: per-device pieces, concatenated."""
    shared = np.random.default_rng(synthetic._child_seed(seed, 0))
    w_shared, b_shared = shared.normal(0.0, 1.0, (num_classes, dim)), shared.normal(0.0, 1.0, num_classes)
    std = np.sqrt(synthetic.sigma_diagonal(dim))
    xs, ys, groups = [], [], []
    for k in range(num_devices):
        rng = np.random.default_rng(synthetic._child_seed(seed, k + 1))
        n = int(rng.lognormal(4, 2)) + 50
        n = min(n, max_samples) if max_samples else n
        u_k, b_k = rng.normal(0.0, np.sqrt(alpha)), rng.normal(0.0, np.sqrt(beta))
        if iid:
            w, b, v = w_shared, b_shared, np.zeros(dim)
        else:
            w, b = rng.normal(u_k, 1.0, (num_classes, dim)), rng.normal(u_k, 1.0, num_classes)
            v = rng.normal(b_k, 1.0, dim)
        x = v + rng.standard_normal((n, dim)) * std
        xs.append(x.astype(np.float32))
        ys.append(np.argmax(x @ w.T + b, axis=1).astype(np.int64))
        groups.append(np.full(n, k, dtype=np.int64))
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(groups)


def old_split_groups(groups, rng, clients_per_group):  # type: ignore[no-untyped-def]
    ids = np.unique(groups)
    owner = np.empty(len(groups), dtype=np.int64)
    for slot, g in enumerate(ids):
        idx = rng.permutation(np.flatnonzero(groups == g))
        owner[idx] = slot * clients_per_group + np.arange(len(idx)) * clients_per_group // len(idx)
    return partition._by_owner(owner, len(ids) * clients_per_group), [int(g) for g in np.repeat(ids, clients_per_group)]


def old_group_test(test_groups, owner, rng):  # type: ignore[no-untyped-def]
    out = [np.zeros(0, dtype=np.int64) for _ in owner]
    for g in sorted(set(owner)):
        clients = [i for i, o in enumerate(owner) if o == g]
        idx = rng.permutation(np.flatnonzero(test_groups == g))
        for i, chunk in zip(clients, np.array_split(idx, len(clients)), strict=True):
            out[i] = np.sort(chunk).astype(np.int64)
    return out


def same_arrays(a, b) -> bool:  # type: ignore[no-untyped-def]
    return len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("args", "test_fraction"), [((1.0, 1.0, 60, 60, 10, False, 3, 5000), 0.2),
                                                     ((0.5, 2.0, 17, 7, 3, True, 1, 80), 0.5),
                                                     ((0.0, 0.0, 9, 5, 2, False, 2, 0), 0.0)])
def test_synthetic_data_written_in_place_equals_the_per_device_pieces(args, test_fraction):
    *options, seed, max_samples = args
    pieces = old_generate(*options, seed=seed, max_samples=max_samples)
    assert same_arrays(synthetic.generate(*options, seed=seed, max_samples=max_samples), pieces)
    x, y, g = pieces
    train, test = old_split_by_group(g, test_fraction, seed)
    assert same_arrays(synthetic.split_by_group(g, test_fraction, seed), (train, test))
    data = synthetic.load_synthetic(Context("synthetic", Path("."), False, Path("."), seed), *options[:5],
                                    options[5], test_fraction, max_samples)
    for split, index in ((data.train, train), (data.test, test)):
        assert same_arrays([split.x.numpy(), split.y.numpy(), split.group.numpy()], [x[index], y[index], g[index]])


def test_group_splits_by_one_sort_equal_the_per_group_scans():
    rng = np.random.default_rng(0)
    for trial in range(12):
        per_group = 1 + trial % 3
        ids = rng.choice(1000, size=int(rng.integers(1, 30)), replace=False)
        groups = np.repeat(ids, rng.integers(per_group, 20, len(ids)))
        rng.shuffle(groups)
        got, want = (f(groups, np.random.default_rng(trial), per_group) for f in (partition.split_groups,
                                                                                  old_split_groups))
        assert same_arrays(got[0], want[0]) and got[1] == want[1]
        test_groups = np.concatenate([rng.choice(ids, size=int(rng.integers(0, 80))), [5000]])  # 5000: no client
        for owner in (got[1], [int(o) for o in rng.permutation(got[1])]):
            a, b = np.random.default_rng(trial + 50), np.random.default_rng(trial + 50)
            assert same_arrays(partition.group_test(test_groups, owner, a), old_group_test(test_groups, owner, b))
            assert a.integers(1 << 40) == b.integers(1 << 40)  # the same draws were taken
    with pytest.raises(partition.PartitionError, match="group 2 has only 1 training samples"):
        partition.split_groups(np.array([1, 1, 2, 3, 3]), np.random.default_rng(0), 2)


def test_untransformed_client_tests_are_views_of_the_global_test_set_when_contiguous():
    exp = Experiment(synthetic_cfg(15))
    data, test = exp.data, exp.data.test_x
    span = test.untyped_storage().data_ptr(), test.untyped_storage().nbytes()
    for c, t in enumerate(data.client_tests):
        idx = data.client_test_idx[c]
        assert torch.equal(t.x, test[idx]) and torch.equal(t.y, data.test_y[idx])
        assert t.x.untyped_storage().data_ptr() == span[0]  # a view: the test set is held once


# ------------------------------------------------------------ the history in memory
def test_the_history_is_read_back_from_the_file_and_tracks_divergence(tmp_path):
    from hetfl.engine.rundir import History, restore_metrics

    rows = [{"round": r, "train_loss": loss, "global_acc": r / 10} for r, loss in
            enumerate([1.0, 0.5, float("nan"), float("inf")], start=1)]
    with restore_metrics(tmp_path / "metrics.jsonl", 0, None) as log:
        for row in rows[:2]:
            log.append(row)
    with restore_metrics(tmp_path / "metrics.jsonl", 2, None) as log:  # resumed: two lines restored
        for row in rows[2:]:
            log.append(row)
        history = log.history
        assert isinstance(history, History) and len(history) == 4
        assert json.dumps(list(history)) == json.dumps(rows) and json.dumps(history[1:3]) == json.dumps(rows[1:3])
        assert history[-1]["round"] == 4 and history[0]["train_loss"] == 1.0 and history[::2][1]["round"] == 3
        assert history.first_nonfinite == 3 == summary.diverged_round(history) == summary.diverged_round(list(history))
        with pytest.raises(IndexError):
            history[4]
    with restore_metrics(tmp_path / "metrics.jsonl", 4, None) as log:
        assert log.history.first_nonfinite == 3
