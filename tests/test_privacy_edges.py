"""The reported privacy guarantee is the spent one, at the edges (hetfl issue 26, items 1-4).

Reproductions of the issue (each failed on 7c51bb8): a run with operating-system noise killed between a
release and its checkpoint and resumed reported 8 releases and epsilon 4.0 after 10 releases (4.55);
FedPAC accepted ``dp_noise = "distributed"`` with no secure aggregation; the accountant hung or took
gigabytes at extreme budgets or many releases; ``clip_norm = 1e300`` and ``dp_delta = 1e-300`` ruined a
run silently (exit 0). The fault-injection test kills a run with SIGKILL in a driver process at the
exact point (the round's release made and used, its checkpoint not yet written)."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch

from hetfl import config
from hetfl.algorithms import build_posthoc
from hetfl.algorithms.base import ServerState
from hetfl.cli import main
from hetfl.privacy import epsilon_spent, epsilon_text, noise_multiplier, require_accountant
from tests.helpers import initial_state, needs_accountant, tiny_setup
from tests.helpers.runs import interrupted

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["data.partition=iid", "data.num_clients=4", "data.options={num_devices=8, max_samples=60}",
        "runtime.progress=false", "runtime.threads=1", "runtime.device=cpu"]
CCVR_OS = ["algorithm.name=fedavg+ccvr", "algorithm.ccvr.dp_epsilon=4", "algorithm.ccvr.every_round=true",
           "algorithm.ccvr.epochs=1", "train.rounds=8", "train.local_steps=2", "runtime.checkpoint_every=3"]
TIME_KEYS = {"round_time_s", "eval_time_s"}
LEDGER_NAME = "privacy_ledger.json"  # hetfl.engine.ledger.LEDGER_NAME, the run directory's documented file

# hetfl's command line (argv[2:]) with a SIGKILL injected once the metrics line of round argv[1] is
# written (that round's release made and used, its checkpoint not yet taken); every CCVR release the
# server receives is appended to the file $HETFL_TEST_RELEASES (one round number a line)
DRIVER = r'''
import os, signal, sys
import hetfl.algorithms.ccvr as cc
import hetfl.engine.rundir as rd

at = int(sys.argv[1])
original_apply, original_append = cc.CCVR.apply, rd.MetricsLog.append


def apply(self, server, replies, round_):
    with open(os.environ["HETFL_TEST_RELEASES"], "a") as fh:
        fh.write(f"{round_}\n")
    return original_apply(self, server, replies, round_)


def append(self, line):
    original_append(self, line)
    if line["round"] == at:
        os.kill(os.getpid(), signal.SIGKILL)


cc.CCVR.apply, rd.MetricsLog.append = apply, append
from hetfl.cli import main

sys.exit(main(sys.argv[2:]))
'''


def cli_args(*overrides: str) -> list[str]:
    return [a for o in [*TINY, *overrides] for a in ("--set", o)]


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIME_KEYS} for line in lines]


def killed_after_round(tmp_path: Path, run_dir: Path, round_: int, releases: Path, *overrides: str) -> None:
    """``hetfl run`` SIGKILLed right after round ``round_``'s line, before its checkpoint."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HETFL_TEST_RELEASES": str(releases)}
    proc = subprocess.run([sys.executable, str(script), str(round_), "run", "--out", str(run_dir), "--quiet",
                           *cli_args(*overrides)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def counting_releases(monkeypatch, releases: Path) -> None:
    """Append every CCVR release of this process to ``releases``, as the driver does."""
    from hetfl.algorithms.ccvr import CCVR

    original = CCVR.apply

    def apply(self, server, replies, round_):
        with releases.open("a") as fh:
            fh.write(f"{round_}\n")
        return original(self, server, replies, round_)

    monkeypatch.setattr(CCVR, "apply", apply)


def sum_multiplier(run_dir: Path) -> float:
    """The noise multiplier of one round's sum of all clients' uploads (distributed noise: the run's ``z``)."""
    cfg = config.load(run_dir / "config.toml")
    ccvr = cfg.algorithm.params["ccvr"]
    return noise_multiplier(float(ccvr["dp_epsilon"]), float(ccvr.get("dp_delta", 1e-5)), cfg.train.rounds)


# ------------------------------------------------------------------ item 1: a resume never under-reports
@needs_accountant
@pytest.mark.slow
def test_a_run_killed_between_a_release_and_its_checkpoint_reports_every_release_it_made(tmp_path, monkeypatch,
                                                                                         caplog):
    """The issue's command (OS noise, calibration every round, 8 rounds, a checkpoint every 3) SIGKILLed after
    round 5 and resumed: rounds 4 and 5 are released again with fresh noise, so the server received 10
    releases; the reported epsilon is at least what they spend (4.55 > the target 4), never 4.0 for 8."""
    run, releases = tmp_path / "run", tmp_path / "releases.txt"
    killed_after_round(tmp_path, run, 5, releases, *CCVR_OS, "algorithm.ccvr.dp_noise_source=os")
    counting_releases(monkeypatch, releases)
    with caplog.at_level(logging.WARNING, logger="hetfl"):
        assert main(["run", "--resume", str(run), "--quiet"]) == 0
    received = [int(r) for r in releases.read_text().split()]
    assert received == [1, 2, 3, 4, 5, 4, 5, 6, 7, 8]
    spent = epsilon_spent([sum_multiplier(run)] * len(received), 1e-5)
    privacy = summary_of(run)["privacy"]
    assert privacy["epsilon"] >= spent * (1 - 1e-9) and spent > 4.5 > privacy["epsilon_target"]
    assert privacy["releases"] == len(received) == 10
    assert "2 release(s) of ccvr (round(s) 4, 5) reached the server after the last checkpoint" in caplog.text
    ledger = json.loads((run / LEDGER_NAME).read_text())["releases"]
    assert [e["round"] for e in ledger] == received and {e["noise_source"] for e in ledger} == {"os"}


@needs_accountant
@pytest.mark.slow
def test_with_seeded_noise_the_lost_releases_are_replayed_and_the_run_is_the_uninterrupted_one(tmp_path):
    """Seeded noise: the rounds run again release exactly what the server already received (same digest): a
    replay reveals nothing new, nothing is counted twice, and metrics and summary equal an uninterrupted run's."""
    full, run = tmp_path / "full", tmp_path / "run"
    assert main(["run", "--out", str(full), "--quiet", *cli_args(*CCVR_OS)]) == 0
    killed_after_round(tmp_path, run, 5, tmp_path / "releases.txt", *CCVR_OS)
    assert main(["run", "--resume", str(run), "--quiet"]) == 0
    assert metrics(run) == metrics(full)
    assert summary_of(run)["privacy"] == summary_of(full)["privacy"]
    assert summary_of(run)["privacy"]["releases"] == 8
    assert (run / LEDGER_NAME).read_text() == (full / LEDGER_NAME).read_text()


@needs_accountant
@pytest.mark.slow
def test_fedpac_with_os_noise_counts_the_rounds_run_again_after_a_crash(tmp_path, monkeypatch):
    """FedPAC releases its centroid statistics every round: a crash in round 6 after a checkpoint at round 3
    (an equivalent injected crash: an exception at the start of round 6) re-runs rounds 4 and 5; with OS noise
    the resumed run reports the 8 releases the server received, above the target."""
    overrides = [*TINY, "algorithm.name=fedpac", "model.name=mlp", "algorithm.dp_epsilon=4",
                 "algorithm.dp_noise_source=os", "train.rounds=6", "train.local_steps=2", "runtime.checkpoint_every=3"]
    run = tmp_path / "run"
    interrupted(run, 5, monkeypatch, config.load(None, overrides))
    assert main(["run", "--resume", str(run), "--quiet"]) == 0
    privacy = summary_of(run)["privacy"]
    z = noise_multiplier(4.0, 1e-5, 6)
    assert privacy["releases"] == 8
    assert privacy["epsilon"] == pytest.approx(epsilon_spent([z] * 8, 1e-5), rel=1e-9)
    assert privacy["epsilon"] > 4.0


@needs_accountant
def test_a_resume_whose_ledger_lost_releases_is_refused(tmp_path, monkeypatch, capsys):
    """A checkpoint that accounts for releases the ledger does not hold (deleted or cut): the budget spent
    cannot be known, so the resume exits 2 naming the ledger, and writes nothing."""
    overrides = [*TINY, "algorithm.name=fedavg+ccvr", "algorithm.ccvr.dp_epsilon=4", "algorithm.ccvr.every_round=true",
                 "algorithm.ccvr.epochs=1", "train.rounds=3", "train.local_steps=1", "runtime.checkpoint_every=1"]
    run = tmp_path / "run"
    interrupted(run, 2, monkeypatch, config.load(None, overrides))
    (run / LEDGER_NAME).unlink()
    before = sorted(p.name for p in run.iterdir())
    capsys.readouterr()
    assert main(["run", "--resume", str(run), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert LEDGER_NAME in err and "2 differentially private release(s) of ccvr" in err, err
    assert sorted(p.name for p in run.iterdir()) == before


@needs_accountant
def test_a_resume_before_the_first_checkpoint_with_other_privacy_settings_is_refused(tmp_path, monkeypatch):
    """Audit of session 27 (failed before its fix): a FedPAC run at dp_epsilon 50 (OS noise, no checkpoint yet)
    stopped after 2 of its 3 rounds, then resumed through the Python API with dp_epsilon 1. The resume had no
    checkpoint to compare configurations with, so it went on: the ledger held 2 releases at multiplier 0.52 and
    3 at 12.9, and the summary reported epsilon 1.32 (5 releases counted at the new multiplier) where 37.4 was
    spent; config.toml still said 50. Without a checkpoint the run's config.toml is the configuration to match."""
    from hetfl.engine.rundir import RunDirError
    from hetfl.runtimes import set_up

    base = [*TINY, "algorithm.name=fedpac", "model.name=mlp", "algorithm.dp_noise_source=os", "train.rounds=3",
            "train.local_steps=1", "runtime.checkpoint_every=0"]
    run = tmp_path / "run"
    interrupted(run, 2, monkeypatch, config.load(None, [*base, "algorithm.dp_epsilon=50"]))
    assert not (run / "checkpoint.safetensors").exists()
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(RunDirError, match=r"config.toml.*algorithm\.dp_epsilon: 50(\.0)? -> 1(\.0)?"):
        set_up(config.load(None, [*base, "algorithm.dp_epsilon=1"])).run(run, resume=True)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before  # nothing written
    # the same configuration resumes, and counts the two releases made before at their own multiplier
    summary = set_up(config.load(None, [*base, "algorithm.dp_epsilon=50"])).run(run, resume=True)
    assert summary["privacy"]["releases"] == 5
    assert summary["privacy"]["epsilon"] == pytest.approx(epsilon_spent([noise_multiplier(50.0, 1e-5, 3)] * 5, 1e-5),
                                                          rel=1e-9)


# ----------------------------------------------------------- item 2: the guarantee the server faces
def test_fedpac_with_distributed_noise_is_refused_naming_the_key(tmp_path, capsys):
    """FedPAC's uploads are never securely aggregated: distributed noise would give the server each upload at
    epsilon 33.7 while the summary said 4. Exit 2 naming algorithm.dp_noise, before anything is written."""
    out = tmp_path / "run"
    code = main(["run", "--out", str(out), "--quiet", *cli_args("algorithm.name=fedpac", "model.name=mlp",
                                                                 "algorithm.dp_epsilon=4",
                                                                 "algorithm.dp_noise=distributed")])
    err = capsys.readouterr().err
    assert code == 2 and "algorithm.dp_noise = 'distributed'" in err and "never securely aggregated" in err, err
    assert not out.exists()


@needs_accountant
@pytest.mark.slow
def test_ccvr_without_secure_aggregation_says_first_what_the_server_sees_per_upload(tmp_path, capsys):
    """Distributed noise without secure aggregation: the headline epsilon holds for the sum only; the run's
    first line says the per-upload epsilon the server faces, and the summary says what the server sees."""
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(["run", "--out", str(out), *cli_args("algorithm.name=fedavg+ccvr", "algorithm.ccvr.dp_epsilon=4",
                                                     "algorithm.ccvr.epochs=1", "train.rounds=1",
                                                     "train.local_steps=1", "runtime.progress=true")]) == 0
    shown = capsys.readouterr().out
    first = " ".join(shown.split("hetfl fedavg+ccvr on ")[0].split())  # the notice, as the console wrapped it
    privacy = summary_of(out)["privacy"]
    assert first.startswith("privacy: algorithm.ccvr.dp_epsilon = 4 holds for the SUM"), first
    shown_epsilon = float(first.split("at epsilon ")[1].split()[0])
    # three digits, rounded up: a guarantee shown never below the one computed (":.3g" showed 33.7155 as 33.7)
    assert privacy["epsilon_per_upload"] <= shown_epsilon <= privacy["epsilon_per_upload"] * (1 + 1e-2)
    assert privacy["epsilon_per_upload"] > 2 * privacy["epsilon"]  # 4 clients: half the noise per upload
    assert privacy["server_sees"].startswith("each upload (no secure aggregation)")


@pytest.mark.parametrize(("epsilon", "text"), [(33.71551, "33.8"), (81.401, "81.5"), (4.0, "4"), (0.0012341, "0.00124"),
                                               (123456.0, "1.24e+05"), (2.5, "2.5")])
def test_an_epsilon_is_shown_rounded_up(epsilon, text):
    assert epsilon_text(epsilon) == text and float(epsilon_text(epsilon)) >= epsilon


# ----------------------------------------------------------------- item 3: the accountant's range and cost
@pytest.mark.parametrize(("key", "value", "allowed"), [
    ("algorithm.ccvr.dp_epsilon", "1e9", "[0.001, 100]"), ("algorithm.ccvr.dp_epsilon", "1e300", "[0.001, 100]"),
    ("algorithm.ccvr.dp_delta", "0.999999", "[1e-15, 0.01]"), ("algorithm.ccvr.dp_delta", "1e-300", "[1e-15, 0.01]"),
    ("algorithm.dp_epsilon", "1e9", "[0.001, 100]"), ("algorithm.dp_delta", "1e-300", "[1e-15, 0.01]"),
])
def test_a_budget_outside_the_accountants_range_exits_2_before_any_work(key, value, allowed, tmp_path, capsys):
    """dp_epsilon = 1e9 (or 1e300, or dp_delta = 0.999999) trained, then hung in the calibration; dp_delta =
    1e-300 gave 40,000x the needed noise. Refused at once, naming the key, the value and the range."""
    method = ["algorithm.name=fedpac", "model.name=mlp", "algorithm.dp_epsilon=4"] if key.startswith("algorithm.dp") \
        else ["algorithm.name=fedavg+ccvr", "algorithm.ccvr.dp_epsilon=4"]
    out = tmp_path / "run"
    code = main(["run", "--out", str(out), "--quiet", *cli_args(*method, f"{key}={value}", "train.rounds=1")])
    err = capsys.readouterr().err
    assert code == 2 and f"{key} = {float(value)!r}" in err and allowed in err, err
    assert not out.exists()


@needs_accountant
def test_ten_thousand_releases_calibrate_in_one_exact_conversion():
    """noise_multiplier(4, 1e-5, 10000) took 6.6 GB and growing (the PLD accountant composed 10,000 copies):
    now ``sqrt(releases)`` times one release's multiplier, exactly, with a few kB of Python allocations."""
    noise_multiplier.cache_clear()
    require_accountant()
    tracemalloc.start()
    try:
        z = noise_multiplier(4.0, 1e-5, 10_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 5 * 2**20
    assert z == pytest.approx(100 * noise_multiplier(4.0, 1e-5, 1), rel=1e-12)
    assert epsilon_spent([z] * 10_000, 1e-5) == pytest.approx(4.0, rel=1e-6)


@needs_accountant
def test_the_budget_of_many_releases_costs_one_conversion(monkeypatch):
    """The guarantee was recomposed over all past releases every round (quadratic in the rounds): now the
    releases' multipliers fold into one, and one exact conversion gives epsilon, however many there are."""
    _, gaussian = require_accountant()
    calls = []
    original = gaussian.get_epsilon_gaussian
    monkeypatch.setattr(gaussian, "get_epsilon_gaussian", lambda *a, **k: calls.append(a) or original(*a, **k))
    for releases in (1, 200, 5000):
        epsilon_spent([7.0] * releases, 1e-5)
    assert len(calls) == 3


@needs_accountant
def test_exact_composition_agrees_with_the_pld_accountant_where_both_are_exact():
    """Mixed multipliers (a round with fewer clients among full ones): the exact Gaussian composition and
    dp-accounting's PLD accountant (pessimistic by its discretisation) agree to 0.5%."""
    dp, _ = require_accountant()
    from dp_accounting import pld

    for multipliers in ([1.2], [0.9, 1.5, 3.0], [4.0] * 8 + [2.5, 2.5]):
        accountant = pld.PLDAccountant()
        for z in multipliers:
            accountant.compose(dp.GaussianDpEvent(z))
        exact = epsilon_spent(multipliers, 1e-5)
        assert accountant.get_epsilon(1e-5) == pytest.approx(exact, rel=5e-3)
        assert accountant.get_epsilon(1e-5) >= exact * (1 - 1e-6)


@pytest.mark.parametrize(("epsilon", "delta"), [(1e9, 1e-5), (1e300, 1e-5), (4.0, 0.999999), (4.0, 1e-300),
                                                (1e-4, 1e-5)])
def test_the_accountant_refuses_budgets_outside_its_range_naming_it(epsilon, delta):
    with pytest.raises(ValueError, match=r"must lie in \["):
        noise_multiplier(epsilon, delta, 1)


# ------------------------------------------------------------- item 4: never a silent ruin
@pytest.mark.parametrize("secure", [False, True])
def test_a_clip_norm_whose_square_overflows_exits_2(secure, tmp_path, capsys):
    """clip_norm = 1e300 overflowed C^2: NaN covariances, accuracy 61.9% -> 0.77%, exit 0, with or without
    secure aggregation. Refused, naming the key."""
    out = tmp_path / "run"
    extra = ["runtime.secure_aggregation=true"] if secure else []
    code = main(["run", "--out", str(out), "--quiet", *cli_args("algorithm.name=fedavg+ccvr",
                                                                 "algorithm.ccvr.dp_epsilon=4",
                                                                 "algorithm.ccvr.clip_norm=1e300", *extra)])
    err = capsys.readouterr().err
    assert code == 2 and "algorithm.ccvr.clip_norm = 1e+300" in err and "not a finite" in err, err
    assert not out.exists()


@needs_accountant
def test_derived_bounds_that_overflow_are_refused_at_set_up():
    """A clip norm whose square is finite but whose noise or reply bounds are not (C^2 times the largest
    client's size or the noise multiplier): refused when the step is built."""
    from hetfl.params import ConfigError

    setup = tiny_setup(num_clients=4)
    advice = "are not finite; choose a clip norm near the features' norms (e.g. 10 for MNIST's MLP)"
    for epsilon, clip, bad in ((4.0, 1e154, "reply bound of outer"),
                               (0.01, 1.3e154, "noise std of outer, reply bound of outer")):
        with pytest.raises(ConfigError) as refused:
            build_posthoc("fedavg+ccvr", {"ccvr": {"dp_epsilon": epsilon, "clip_norm": clip}}, setup)
        assert str(refused.value) == f"algorithm.ccvr.clip_norm = {clip:g}: the derived {bad} {advice}"


POOLED = "the pooled per-class counts, means and covariances"


@pytest.mark.parametrize(("stage", "broken"), [
    (POOLED, "features"), (POOLED, "outer products"), (POOLED, "a lone sample"), (POOLED, "a corrupt count"),
    ("the covariances after the PSD repair", "psd_repair"),
    ("the virtual features", "sampling"),
    ("the re-trained classifier", "weight"),
    ("the re-trained classifier", "bias"),
])
@needs_accountant
def test_a_calibration_on_non_finite_statistics_fails_loudly_naming_the_stage(stage, broken, monkeypatch):
    """Overflowed features (inf, NaN) gave NaN covariances and a ruined classifier reported with exit 0: the
    calibration now raises, naming the first stage whose numbers are not finite (each stage broken here in
    turn: an inf feature; finite features whose outer products overflow (the covariances alone); an inf
    feature of a class's only sample (its mean alone: no covariance from one sample); a NaN count in one
    upload (a corrupt reply: the class's count alone, since a class of fewer than 2 gets no Gaussian); the PSD repair of
    private covariances; the sampling; the re-trained weight or bias)."""
    from hetfl.algorithms import ccvr, ccvr_statistics
    from hetfl.algorithms.gaussian_stats import NonFiniteStatistics

    def broken_copy(t: torch.Tensor) -> torch.Tensor:
        return t.clone().index_fill_(0, torch.tensor([0]), math.nan)

    if broken == "psd_repair":
        monkeypatch.setattr(ccvr_statistics, "nearest_psd", lambda covs: (broken_copy(covs), 0.0))
    if broken == "sampling":
        monkeypatch.setattr(ccvr, "sample_gaussian", lambda mean, cov, n, gen: torch.full((n, len(mean)), math.inf))
    if broken in ("weight", "bias"):
        retrain = ccvr.retrain_classifier
        def retrain_broken(*args):  # type: ignore[no-untyped-def]
            weight, bias = retrain(*args)
            return (broken_copy(weight), bias) if broken == "weight" else (weight, broken_copy(bias))

        monkeypatch.setattr(ccvr, "retrain_classifier", retrain_broken)
    setup = tiny_setup(num_clients=4)
    params = {"epochs": 1, **({"dp_epsilon": 50.0} if broken == "psd_repair" else {})}
    (step,) = build_posthoc("fedavg+ccvr", {"ccvr": params}, setup)
    server = ServerState(initial_state(setup), {})
    features, labels = torch.randn(30, 8), torch.arange(30) % 3
    if broken == "features":
        features[3] = math.inf
    if broken == "outer products":
        features = features.double() * 1e200  # finite in float64; their squares are not
    lone = broken == "a lone sample"
    if lone:  # class 2's only sample, on client 0; the others hold classes 0 and 1
        labels = torch.arange(30) % 2
    replies = {}
    for k in range(4):
        x, y = features.clone(), labels.clone()
        if lone and k == 0:
            x[0], y[0] = math.inf, 2
        replies[k] = step.client_query(server.model, x, y, client=k, round_=1)
    if broken == "a corrupt count":  # a class's count NaN in one upload (means and covariances stay finite)
        replies[0]["counts"][0] = math.nan
    with pytest.raises(NonFiniteStatistics) as failed:
        step.apply(server, replies, round_=1)
    assert str(failed.value) == (f"CCVR's calibration: {stage} are not finite (inf or NaN); the features overflowed "
                                 "(check algorithm.ccvr.clip_norm and the training's train_loss in metrics.jsonl); "
                                 "nothing was calibrated")


def test_a_classifier_without_a_bias_is_calibrated_without_one(monkeypatch):
    """The re-trained classifier's check reads its bias only where it has one."""
    from hetfl.algorithms import ccvr

    retrain = ccvr.retrain_classifier
    monkeypatch.setattr(ccvr, "retrain_classifier", lambda *args: (retrain(*args)[0], None))
    setup = tiny_setup(num_clients=4)
    (step,) = build_posthoc("fedavg+ccvr", {"ccvr": {"epochs": 1}}, setup)
    server = ServerState(initial_state(setup), {})
    replies = {k: step.client_query(server.model, torch.randn(30, 8), torch.arange(30) % 3, client=k, round_=1)
               for k in range(4)}
    new, _ = step.apply(server, replies, round_=1)
    assert torch.isfinite(new.model["classifier.weight"]).all()
    assert torch.equal(new.model["classifier.bias"], server.model["classifier.bias"])


@pytest.mark.slow
def test_a_run_whose_calibration_is_not_finite_exits_1_without_a_summary(tmp_path, monkeypatch, capsys):
    """The CLI: a calibration on overflowed features stops the run with exit 1 and a message, no summary."""
    from hetfl.engine.experiment import Experiment

    original = Experiment.client_features

    def overflowing(self, state, client):
        feats, labels = original(self, state, client)
        return feats * 1e200, labels

    monkeypatch.setattr(Experiment, "client_features", overflowing)
    out = tmp_path / "run"
    code = main(["run", "--out", str(out), "--quiet", *cli_args("algorithm.name=fedavg+ccvr", "train.rounds=1",
                                                                 "train.local_steps=1", "algorithm.ccvr.epochs=1")])
    err = capsys.readouterr().err
    assert code == 1 and "CCVR's calibration" in err and "not finite" in err, err
    assert not (out / "summary.json").exists()


@needs_accountant
def test_overwriting_a_run_that_made_private_releases_says_they_stay_spent(tmp_path, caplog):
    """overwrite=True deletes the run's privacy ledger with the run; the releases it recorded were made
    from the clients' data all the same, and the new run's report counts only its own: said, with the count."""
    from hetfl import api

    run_dir, keys = tmp_path / "dp", [*TINY, *CCVR_OS, "train.rounds=2"]
    api.run(None, overrides=keys, out=run_dir)
    recorded = len(json.loads((run_dir / LEDGER_NAME).read_text())["releases"])
    assert recorded >= 2
    with caplog.at_level(logging.WARNING, logger="hetfl"):
        api.run(None, overrides=keys, out=run_dir, overwrite=True)
    said = [r.getMessage() for r in caplog.records if "privacy ledger" in r.getMessage()]
    assert len(said) == 1 and f"recorded {recorded} differentially private release(s)" in said[0], said
    assert "does not undo them" in said[0]


def test_overwriting_a_run_without_private_releases_says_nothing_of_privacy(tmp_path, caplog):
    from hetfl import api

    run_dir, keys = tmp_path / "plain", [*TINY, "train.rounds=1", "train.local_steps=1"]
    api.run(None, overrides=keys, out=run_dir)
    with caplog.at_level(logging.WARNING, logger="hetfl"):
        api.run(None, overrides=keys, out=run_dir, overwrite=True)
    assert not [r for r in caplog.records if "privacy" in r.getMessage()]
