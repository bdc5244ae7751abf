"""CCVR under differential privacy (hetfl issue 19, item 3): clipped features, the Gaussian mechanism on
the moments (hetfl.algorithms.dp_moments), the PSD repair, the budget accounted and recorded."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest
import torch

from hetfl.algorithms import build_posthoc
from hetfl.algorithms.base import ServerState
from hetfl.algorithms.ccvr import DP_RELEASES
from hetfl.algorithms.dp_moments import MomentsMechanism, nearest_psd
from hetfl.algorithms.gaussian_stats import class_moments
from hetfl.algorithms.posthoc import SummedReplies
from hetfl.cli import main
from hetfl.params import ConfigError
from hetfl.privacy import clip_rows, epsilon_spent, noise_multiplier
from tests.helpers import initial_state, needs_accountant, release_digest_reference, tiny_setup
from tests.helpers.runs import interrupted

F64 = torch.float64


def _step(rounds: int = 20, **params):
    setup = tiny_setup(num_clients=4, rounds=rounds)
    (step,) = build_posthoc("fedavg+ccvr", {"ccvr": params}, setup)
    return step, ServerState(initial_state(setup), {})


def _secure_step(**params):
    """CCVR under secure aggregation, clients of 10, 25, 7 and 3 samples."""
    setup = dataclasses.replace(tiny_setup(num_clients=4), secure_aggregation=True, client_sizes=[10, 25, 7, 3])
    (step,) = build_posthoc("fedavg+ccvr", {"ccvr": {"epochs": 1, **params}}, setup)
    return step, ServerState(initial_state(setup), {})


def _scaled(moments, c: int, clip: float) -> torch.Tensor:
    """Class c's (count, sum / C, upper(Q) / C^2): the vector whose sensitivity the mechanism assumes."""
    iu = torch.triu_indices(moments.sums.shape[1], moments.sums.shape[1])
    return torch.cat([moments.counts[c:c + 1], moments.sums[c] / clip, moments.outer[c][iu[0], iu[1]] / clip**2])


def test_one_sample_moves_the_scaled_moments_by_at_most_sqrt3():
    """The sensitivity the noise is calibrated for: adding one (clipped) sample, however large, to a client's
    data moves (count, sum / C, upper(Q) / C^2) of its class by at most sqrt(3), and no other class."""
    gen = torch.Generator().manual_seed(0)
    clip = 2.0
    for trial in range(20):
        x = torch.randn(30, 6, generator=gen, dtype=F64) * (1 + 10 * trial)
        y = torch.randint(0, 3, (30,), generator=gen)
        extra = torch.randn(1, 6, generator=gen, dtype=F64) * 100
        before = class_moments(clip_rows(x, clip), y, 3)
        after = class_moments(clip_rows(torch.cat([x, extra]), clip), torch.cat([y, torch.tensor([1])]), 3)
        assert (_scaled(after, 1, clip) - _scaled(before, 1, clip)).norm() <= math.sqrt(3) + 1e-12
        for c in (0, 2):
            assert torch.equal(_scaled(after, c, clip), _scaled(before, c, clip))


@needs_accountant
@pytest.mark.parametrize("noise", ["distributed", "local"])
def test_noise_has_the_calibrated_spread_per_tensor(noise):
    """Each upload's noise: std z sqrt(3) sqrt(share) times 1, C, C^2 on counts, sums and the outer products'
    upper triangle, with share 1/m (distributed) or 1 (local); measured over the entries of many uploads."""
    mech = MomentsMechanism(4.0, 1e-5, clip_norm=3.0, clients=10, noise=noise)
    z = noise_multiplier(4.0, 1e-5)
    share = 0.1 if noise == "distributed" else 1.0
    features = torch.randn(40, 12, generator=torch.Generator().manual_seed(1), dtype=F64)
    labels = torch.arange(40) % 2
    clean = class_moments(clip_rows(features, 3.0), labels, 5)
    draws = [mech.privatize(features, labels, 5, torch.Generator().manual_seed(s)) for s in range(40)]
    base = z * math.sqrt(3) * math.sqrt(share)
    iu = torch.triu_indices(12, 12)
    for name, scale in (("counts", 1.0), ("sums", 3.0), ("outer", 9.0)):
        noise_values = torch.stack([getattr(d, name) - getattr(clean, name) for d in draws])
        if name == "outer":
            assert torch.equal(noise_values, noise_values.transpose(-1, -2))
            noise_values = noise_values[..., iu[0], iu[1]]
        assert noise_values.std().item() == pytest.approx(base * scale, rel=0.12), name
        assert abs(noise_values.mean().item()) < 0.1 * base * scale


@needs_accountant
def test_private_reply_is_dense_and_names_no_class():
    step, server = _step(dp_epsilon=4.0)
    labels = torch.zeros(10, dtype=torch.long)  # the client holds class 0 only
    reply = step.client_query(server.model, torch.randn(10, 8), labels, client=0, round_=1)
    assert set(reply) == {"counts", "sums", "outer"}
    assert reply["counts"].shape == (3,) and reply["sums"].shape == (3, 8) and reply["outer"].shape == (3, 8, 8)
    assert torch.count_nonzero(reply["counts"][1:]) == 2  # noise on the classes it does not hold too


@needs_accountant
def test_noise_streams_are_per_client_and_round_and_repeat_under_the_seed():
    step, server = _step(dp_epsilon=4.0)
    x, y = torch.randn(10, 8), torch.arange(10) % 3

    def reply(client, round_):
        return step.client_query(server.model, x, y, client=client, round_=round_)["sums"]

    def full(client, round_):
        return step.client_query(server.model, x, y, client=client, round_=round_)

    first, again = full(0, 1), full(0, 1)
    assert all(torch.equal(first[k], again[k]) for k in ("counts", "sums", "outer"))  # every tensor's noise
    assert not torch.equal(reply(0, 1), reply(1, 1)) and not torch.equal(reply(0, 1), reply(0, 2))
    os_step, _ = _step(dp_epsilon=4.0, dp_noise_source="os")
    a = os_step.client_query(server.model, x, y, client=0, round_=1)["sums"]
    b = os_step.client_query(server.model, x, y, client=0, round_=1)["sums"]
    assert not torch.equal(a, b)


def test_nearest_psd_repairs_only_what_is_indefinite():
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(5, 5, generator=gen, dtype=F64)
    psd = a @ a.T
    same, removed = nearest_psd(psd.unsqueeze(0))
    torch.testing.assert_close(same[0], psd)
    assert removed < 1e-14
    indefinite = torch.diag(torch.tensor([3.0, 1.0, -2.0], dtype=F64))
    fixed, removed = nearest_psd(indefinite.unsqueeze(0))
    torch.testing.assert_close(fixed[0], torch.diag(torch.tensor([3.0, 1.0, 0.0], dtype=F64)))
    assert removed == pytest.approx(2.0 / 6.0)
    # a batch of covariances: each repaired one is exactly symmetric, and the share removed is a share (scale-free)
    b = torch.randn(4, 6, 6, generator=gen, dtype=F64)
    batch = b + b.transpose(-1, -2)
    fixed, removed = nearest_psd(batch)
    assert torch.equal(fixed, fixed.transpose(-1, -2)) and torch.linalg.eigvalsh(fixed).min() > -1e-12
    assert 0.2 < removed < 0.8
    assert nearest_psd(1e-3 * batch)[1] == pytest.approx(removed, rel=1e-9)


@needs_accountant
def test_each_class_gets_its_own_noise():
    """Independent noise per class: with one draw shared by the classes, the noisy moments of a class the client
    does not hold (pure noise) would give away the noise on the classes it holds, whose difference is noise-free."""
    mech = MomentsMechanism(4.0, 1e-5, clip_norm=1.0, clients=1, noise="local")
    features = torch.randn(10, 6, generator=torch.Generator().manual_seed(6), dtype=F64)
    draws = [mech.privatize(features, torch.zeros(10, dtype=torch.long), 3, torch.Generator().manual_seed(s))
             for s in range(40)]
    clean = class_moments(clip_rows(features, 1.0), torch.zeros(10, dtype=torch.long), 3)
    std = mech.upload_std()
    for name in ("counts", "sums", "outer"):
        values = torch.stack([getattr(d, name) for d in draws])
        leak = values[:, 0] - values[:, 1] - getattr(clean, name)[0]  # held minus absent, less the true moments
        assert leak.std().item() == pytest.approx(math.sqrt(2) * std[name], rel=0.3), name


@needs_accountant
def test_counts_and_sums_only_have_sensitivity_sqrt2_and_the_outer_products_stay_clean():
    """FedPAC's uploads (with_outer=False): sensitivity sqrt(2), noise on counts and sums only; the default noise is
    distributed (share 1/m)."""
    mech = MomentsMechanism(4.0, 1e-5, clip_norm=3.0, clients=10, with_outer=False)
    assert mech.noise == "distributed" and mech.sensitivity == pytest.approx(math.sqrt(2))
    z = noise_multiplier(4.0, 1e-5)
    features = torch.randn(40, 12, generator=torch.Generator().manual_seed(5), dtype=F64)
    labels = torch.arange(40) % 2
    clean = class_moments(clip_rows(features, 3.0), labels, 5)
    draws = [mech.privatize(features, labels, 5, torch.Generator().manual_seed(s)) for s in range(40)]
    sums_noise = torch.stack([d.sums - clean.sums for d in draws])
    assert sums_noise.std().item() == pytest.approx(z * math.sqrt(2) * math.sqrt(0.1) * 3.0, rel=0.06)
    assert all(torch.equal(d.outer, clean.outer) for d in draws)


@needs_accountant
def test_features_far_beyond_the_clip_norm_in_half_precision_are_clipped_not_zeroed():
    """A half-precision encoder's features whose norm overflows float16 (6e4 * sqrt(2) > 65504) are still scaled
    to norm C in their direction: the clipping is done in float64."""
    mech = MomentsMechanism(4.0, 1e-5, clip_norm=1.0, clients=1, noise="local")
    features = torch.full((100, 2), 6e4, dtype=torch.float16)
    got = mech.privatize(features, torch.zeros(100, dtype=torch.long), 2, torch.Generator().manual_seed(0))
    std = mech.upload_std()["sums"]
    torch.testing.assert_close(got.sums[0], torch.full((2,), 100 / math.sqrt(2), dtype=F64), atol=5 * std, rtol=0)


@needs_accountant
def test_apply_records_the_budget_and_its_accountant():
    step, server = _step(dp_epsilon=2.0, dp_delta=1e-6)
    gen = torch.Generator().manual_seed(3)
    replies = {k: step.client_query(server.model, torch.randn(30, 8, generator=gen), torch.arange(30) % 3,
                                    client=k, round_=1) for k in range(4)}
    new, info = step.apply(server, replies, round_=1)
    assert info["dp_epsilon"] == pytest.approx(2.0, rel=1e-3) and info["dp_delta"] == 1e-6
    assert info["dp_accountant"].startswith("dp-accounting") and info["dp_summed_clients"] == 4
    assert info["dp_epsilon_target"] == 2.0 and info["dp_noise"] == "distributed"
    assert info["dp_clip_norm"] == step.hp.clip_norm
    # a server that saw each upload (no secure aggregation) gets 1/sqrt(m) of the noise per upload
    z = info["dp_noise_multiplier"]
    assert info["dp_epsilon_per_upload"] == pytest.approx(epsilon_spent([z / 2], 1e-6))
    assert info["dp_epsilon_per_upload"] > 2 * info["dp_epsilon"]
    # the release's multiplier kept exactly (float64), so that a resumed run accounts the very same budget
    assert new.extra[DP_RELEASES].tolist() == [info["dp_noise_multiplier"]]
    assert "_dp_multipliers" not in info
    # fewer uploads summed than the noise shares assume: less noise, a larger epsilon spent
    _, fewer = step.apply(server, {k: replies[k] for k in range(2)}, round_=1)
    assert fewer["dp_epsilon"] == pytest.approx(epsilon_spent([z * math.sqrt(2 / 4)], 1e-6))
    assert fewer["dp_epsilon"] > 1.4 * info["dp_epsilon"]


@needs_accountant
def test_local_noise_gives_each_upload_the_budget():
    step, server = _step(dp_epsilon=2.0, dp_noise="local")
    replies = {k: step.client_query(server.model, torch.randn(30, 8), torch.arange(30) % 3, client=k, round_=1)
               for k in range(4)}
    _, info = step.apply(server, replies, round_=1)
    assert info["dp_epsilon"] == pytest.approx(2.0, rel=1e-3) == info["dp_epsilon_per_upload"]


@needs_accountant
def test_every_round_calibration_splits_the_budget_over_the_rounds():
    step, server = _step(rounds=3, dp_epsilon=2.0, every_round=True)
    assert step.mechanism.releases == step.setup.train.rounds
    replies = {k: step.client_query(server.model, torch.randn(30, 8), torch.arange(30) % 3, client=k, round_=1)
               for k in range(4)}
    for round_ in range(1, step.setup.train.rounds + 1):
        server, info = step.apply(server, replies, round_)
    assert info["dp_releases"] == step.setup.train.rounds
    assert info["dp_epsilon"] == pytest.approx(2.0, rel=1e-3)


@pytest.mark.parametrize(("key", "value", "needle"), [
    ("algorithm.ccvr.dp_epsilon", "0", "must be > 0"), ("algorithm.ccvr.dp_epsilon", "-1", "must be > 0"),
    ("algorithm.ccvr.dp_epsilon", "nan", "must be > 0"), ("algorithm.ccvr.dp_delta", "0", "must be > 0"),
    ("algorithm.ccvr.dp_delta", "1", "must be < 1"), ("algorithm.ccvr.clip_norm", "0", "must be > 0"),
    ("algorithm.ccvr.oracle", "all", "cannot be private"),
])
def test_invalid_privacy_settings_exit_2_naming_the_key_and_write_nothing(key, value, needle, tmp_path, capsys):
    out = tmp_path / "run"
    extra = ["--set", "algorithm.ccvr.dp_epsilon=4"] if key == "algorithm.ccvr.oracle" else []
    code = main(["run", "--set", "algorithm.name=fedavg+ccvr", "--set", f"{key}={value}", *extra,
                 "--set", "train.rounds=1", "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and key in err and needle in err, err
    assert not out.exists()


@needs_accountant
@pytest.mark.slow
def test_run_reports_its_privacy_and_resumes_to_the_same_budget(tmp_path, monkeypatch, capsys):
    """The issue's command (on the default Synthetic federation, shortened): the summary reports epsilon, delta
    and the accountant; a run interrupted and resumed spends the same budget and ends on the same model."""
    argv = ["--set", "algorithm.name=fedavg+ccvr", "--set", "algorithm.ccvr.dp_epsilon=4",
            "--set", "algorithm.ccvr.every_round=true", "--set", "train.rounds=4", "--quiet"]
    assert main(["run", *argv, "--out", str(tmp_path / "a")]) == 0
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    privacy = summary["privacy"]
    assert privacy["epsilon"] == pytest.approx(4.0, rel=1e-3) and privacy["delta"] == 1e-5
    assert privacy["releases"] == 4 and privacy["accountant"].startswith("dp-accounting")
    assert summary["final_global_acc"] > 0.3  # Synthetic(1, 1), 10 classes: calibrated under noise, still learning

    from hetfl import config as config_mod

    cfg = config_mod.load(None, ["algorithm.name=fedavg+ccvr", "algorithm.ccvr.dp_epsilon=4",
                                 "algorithm.ccvr.every_round=true", "train.rounds=4"])
    interrupted(tmp_path / "b", 2, monkeypatch, cfg)
    assert main(["run", "--resume", str(tmp_path / "b"), "--quiet"]) == 0
    resumed = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert resumed["privacy"] == privacy
    assert resumed["final_global_acc"] == summary["final_global_acc"]


@needs_accountant
def test_noisy_pooled_statistics_are_psd_and_centred_on_the_clipped_statistics():
    """Strong noise (epsilon 0.5): every pooled covariance is PSD after the repair; weak noise (epsilon 20): the
    pooled Gaussians are those of the clipped features (noise unbiased, clipping at clip_norm applied)."""
    gen = torch.Generator().manual_seed(4)
    data = [(torch.randn(200, 8, generator=gen) * 3 + 2, torch.arange(200) % 3) for _ in range(4)]
    strong, server = _step(dp_epsilon=0.5)
    pooled = strong.pooled_statistics({k: strong.client_query(server.model, x, y, client=k, round_=1)
                                       for k, (x, y) in enumerate(data)})
    assert torch.linalg.eigvalsh(pooled.covs).min() > -1e-9
    weak, _ = _step(dp_epsilon=20.0, clip_norm=5.0)
    noisy = weak.pooled_statistics({k: weak.client_query(server.model, x, y, client=k, round_=1)
                                    for k, (x, y) in enumerate(data)})
    x, y = torch.cat([d[0] for d in data]).to(F64), torch.cat([d[1] for d in data])
    for c in range(3):
        clipped = clip_rows(x[y == c], 5.0)
        torch.testing.assert_close(noisy.means[c], clipped.mean(0), atol=0.05, rtol=0)
        torch.testing.assert_close(noisy.covs[c], torch.cov(clipped.T), atol=0.2, rtol=0)
        assert (noisy.means[c] - x[y == c].mean(0)).norm() > 0.2  # unclipped means are elsewhere


@needs_accountant
def test_under_secure_aggregation_features_are_clipped_and_the_reply_bounds_are_reached_but_never_exceeded():
    """The bounds of the fixed-point code: the largest client (25 samples) holding one class only, every feature far
    beyond clip_norm along one axis, reaches them exactly (count 25, sum 25 C, outer 25 C^2); under differential
    privacy they leave 8 standard deviations of the client's noise on top."""
    step, server = _secure_step(clip_norm=2.0)
    features = torch.zeros(25, 8)
    features[:, 3] = 100.0
    labels = torch.ones(25, dtype=torch.long)
    bounds = step.reply_bounds()
    assert bounds == {"counts": 25.0, "sums": 50.0, "outer": 100.0}
    reply = step.dense_reply(step.client_query(server.model, features, labels, client=1, round_=1))
    assert reply["counts"][1].item() == 25
    assert reply["sums"][1, 3].item() == pytest.approx(50.0) and reply["outer"][1, 3, 3].item() == pytest.approx(100.0)
    # a half-precision encoder's features whose norm overflows float16 (6e4 * sqrt(2) > 65504): clipped in float64
    half = torch.zeros(25, 8, dtype=torch.float16)
    half[:, :2] = 6e4
    sums = step.dense_reply(step.client_query(server.model, half, labels, client=1, round_=1))["sums"]
    torch.testing.assert_close(sums[1, :2], torch.full((2,), 50 / math.sqrt(2), dtype=F64))
    private, _ = _secure_step(clip_norm=2.0, dp_epsilon=4.0)
    std = private.mechanism.upload_std()
    assert private.reply_bounds() == pytest.approx({k: bounds[k] + 8 * std[k] for k in bounds})
    noisy = private.client_query(server.model, features, labels, client=1, round_=1)
    assert all(noisy[k].abs().max() <= private.reply_bounds()[k] for k in bounds)
    assert noisy["sums"][1, 3].item() == pytest.approx(50.0, abs=5 * std["sums"])  # clipped before the noise


@needs_accountant
def test_a_securely_summed_private_round_is_pooled_from_the_sum_and_accounted_for_the_clients_in_it():
    step, server = _secure_step(dp_epsilon=0.5)
    gen = torch.Generator().manual_seed(7)
    replies = {k: step.client_query(server.model, torch.randn(30, 8, generator=gen), torch.arange(30) % 3,
                                    client=k, round_=1) for k in range(4)}
    summed = SummedReplies({name: sum(replies[k][name] for k in range(3)) for name in ("counts", "sums", "outer")},
                           (0, 1, 2))
    moments = step.summed_moments(summed)
    assert all(torch.equal(getattr(moments, name), summed.total[name]) for name in ("counts", "sums", "outer"))
    _, info = step.apply(server, summed, round_=1)
    assert info["dp_summed_clients"] == 3 and info["dp_secure_aggregation"] is True
    z = info["dp_noise_multiplier"]
    assert info["dp_epsilon"] == pytest.approx(epsilon_spent([z * math.sqrt(3 / 4)], 1e-5))
    assert info["ccvr_floats_per_client"] == 3 + 3 * 8 + 3 * 64
    assert info["dp_psd_removed"] > 0.01  # epsilon 0.5 on 90 samples: noisy covariances far from PSD, repaired
    # what the guarantee covers and what not, whole (commit 01c0a4d's text was untested: mutation, session 33)
    assert info["dp_covers"] == ("CCVR's per-class statistics; not the training rounds' model updates, nor what a "
                                 "set-up round uploads (FedMix's and FedBR's rsm_clients averaged inputs)")


@needs_accountant
@pytest.mark.parametrize("private", [False, True])
def test_a_release_without_virtual_features_keeps_the_model_and_still_records_its_budget(private):
    """One sample per class in all: no class has the two samples a covariance needs, so no virtual feature is drawn
    and the model is kept as it is; under differential privacy the release still spent budget, which the server
    state records for a resumed run."""
    step, server = _step(dp_epsilon=20.0) if private else _step()  # epsilon 20: counts noise std 0.43 in all
    replies = {k: step.client_query(server.model, torch.randn(1, 8), torch.tensor([k]), client=k, round_=1)
               for k in range(3)}
    new, info = step.apply(server, replies, round_=1)
    assert info["ccvr_virtual_features"] == 0 and info["ccvr_classes_without_virtual"] == 3
    assert new.model.keys() == server.model.keys()
    assert all(torch.equal(new.model[k], server.model[k]) for k in server.model)
    if private:
        assert new.extra[DP_RELEASES].tolist() == [pytest.approx(info["dp_noise_multiplier"] * math.sqrt(3 / 4))]
    else:
        assert new.extra == server.extra


def test_private_ccvr_without_the_accountant_is_a_config_error_saying_how_to_install_it(monkeypatch):
    """Refused when the step is built (before anything is written), naming the key; plain CCVR needs no accountant."""
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # import dp_accounting then raises ImportError
    with pytest.raises(ConfigError, match=r"^algorithm\.ccvr\.dp_epsilon = 4\.0: differential privacy needs the "
                                          r"accountant: .*hetfl\[privacy\]") as err:
        _step(dp_epsilon=4.0)
    assert err.value.key == "algorithm.ccvr.dp_epsilon"
    _step()


def test_the_oracle_cannot_be_private():
    message = (r"^algorithm\.ccvr\.oracle = 'all': the oracle uploads the clients' raw features: it cannot be "
               r"private \(algorithm\.ccvr\.dp_epsilon must stay inf\)$")
    with pytest.raises(ConfigError, match=message):
        _step(dp_epsilon=4.0, oracle="all")


@needs_accountant
def test_a_release_is_its_sums_multiplier_and_a_digest_of_exactly_what_the_server_received():
    """dp_release, what the run's ledger records before the server uses a release: the noise multiplier of
    the sum of the uploads received, and a digest of those uploads by client, or (secure aggregation) of
    their sum and of which clients it holds. A resumed run recomputes the digests of the releases it makes
    again and compares them with the ledger's, which an earlier version may have written: the digests of
    one input are pinned (float64 and int64 bytes: the same on every machine)."""
    from hetfl.algorithms.posthoc import SummedReplies

    step, _ = _step(rounds=1, dp_epsilon=4.0)

    def t(*values: float) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64)

    replies = {2: {"counts": t(1.0, 0.0), "sums": t(0.5, -1.0), "outer": t(0.25, 2.0)},
               0: {"counts": t(3.0, 1.0), "sums": t(1.5, 0.0), "outer": t(4.0, -0.5)}}
    total = {"counts": t(4.0, 1.0), "sums": t(2.0, -1.0), "outer": t(4.25, 1.5)}
    by_client, summed = step.dp_release(replies), step.dp_release(SummedReplies(total, (0, 2)))
    assert by_client.multiplier == summed.multiplier == step.mechanism.sum_multiplier(2)
    assert by_client.noise_source == summed.noise_source == "seed"
    assert by_client.digest == "33856aa7e87e5dbf3a28b44281ac6b530cfa48100e7eedda8676f6bb5f9ac42f"
    assert summed.digest == "7eb14bf2d996a31ff2c14921a9d0b0d8b76a80c661e1de9fc2ae86da525977fc"
    assert step.dp_release(dict(reversed(replies.items()))).digest == by_client.digest  # by client id, not order
    assert step.dp_release(SummedReplies(total, (0, 3))).digest != summed.digest  # which clients are in the sum
    assert by_client.uploads == {c: release_digest_reference(sorted(r.items())) for c, r in replies.items()}
    assert summed.uploads is None  # a secure sum: no client's upload reached the server
    assert _step(rounds=1)[0].dp_release(replies) is None  # no privacy, no release


@pytest.mark.parametrize(("secure", "noise", "sees", "notice"), [
    (False, "distributed", "each upload (no secure aggregation), with 1/sqrt(clients) of the noise: the guarantee "
     "it faces is epsilon_per_upload; epsilon holds for the sum alone",
     "privacy: algorithm.ccvr.dp_epsilon = 4 holds for the SUM of the uploads only; without secure aggregation the "
     "server sees each upload, at epsilon 9.09 per upload (set runtime.secure_aggregation = true, or "
     "algorithm.ccvr.dp_noise = 'local')"),
    (False, "local", "each upload, each carrying the whole noise: epsilon is the guarantee of every upload",
     "privacy: without secure aggregation the server sees each client's upload; each is (4, 1e-05)-DP on its own "
     "(algorithm.ccvr.dp_noise = 'local')"),
    (True, "distributed", "the sum of the uploads only (secure aggregation): epsilon is the guarantee it faces", None),
    (True, "local", "the sum of the uploads only (secure aggregation): epsilon is the guarantee it faces", None),
])
@needs_accountant
def test_what_the_server_sees_and_the_runs_first_line_state_the_guarantee_it_faces(secure, noise, sees, notice):
    """The words a private run prints first and records (``dp_server_sees``), whole: 4 clients, 3 releases
    (every round), epsilon 4 for the sum. Without secure aggregation and with distributed noise each upload
    carries half the noise (1/sqrt(4)), so the server faces epsilon 9.09 per upload; with local noise, 4."""
    setup = dataclasses.replace(tiny_setup(num_clients=4, rounds=3), secure_aggregation=secure)
    (step,) = build_posthoc("fedavg+ccvr", {"ccvr": {"dp_epsilon": 4.0, "dp_noise": noise, "every_round": True}},
                            setup)
    assert (step.server_sees(), step.privacy_notice()) == (sees, notice)
    assert _step(rounds=3)[0].privacy_notice() is None  # no privacy, nothing to say


# ------------------------------------------------ set-up refusals and refused uploads (mutation, session 33)
def test_a_clip_norm_whose_power_overflows_is_refused_naming_that_power_and_its_largest_value():
    """check_settings' whole message (the tests matched 'not a finite' only): CCVR names C^2, the outer
    products' bound, and its largest value sqrt(float64 max); without outer products (FedPAC) C itself, whose
    largest value is float64's max (the message said 1e300, a bound the check never applied)."""
    from hetfl.algorithms.dp_moments import check_settings

    fmax = torch.finfo(torch.float64).max
    with pytest.raises(ConfigError) as outer:
        check_settings("algorithm.ccvr.", 4.0, 1e-5, 1e300, with_outer=True)
    assert str(outer.value) == ("algorithm.ccvr.clip_norm = 1e+300: clip_norm^2 (the outer products' bound) is not a "
                                f"finite float64; must be at most {math.sqrt(fmax):.3g}")
    with pytest.raises(ConfigError) as plain:
        check_settings("algorithm.", 4.0, 1e-5, math.inf, with_outer=False)
    assert str(plain.value) == ("algorithm.clip_norm = inf: clip_norm is not a finite float64; "
                                f"must be at most {fmax:.3g}")
    check_settings("algorithm.", 4.0, 1e-5, 1e300, with_outer=False)  # C finite, no C^2 uploaded: accepted
    check_settings("algorithm.ccvr.", 4.0, 1e-5, 1e150, with_outer=True)


@needs_accountant
@pytest.mark.parametrize("noise", ["local", "distributed"])
def test_refused_uploads_are_released_as_their_sum_with_the_refused_digest(noise):
    """MomentsMechanism.refused_release (no test reached it in the mutation run): the uploads the server refused
    count as the sum of that many uploads' noise, their digest the refused one, the run's noise source kept;
    CCVR's dp_refused gives it under differential privacy and nothing without."""
    from hetfl.privacy import Release, refused_digest

    mech = MomentsMechanism(4.0, 1e-5, clip_norm=3.0, clients=10, noise=noise)
    refused = {4: "dd", 2: "bb", 7: "ee"}
    release = mech.refused_release(refused, "os")
    assert release == Release(mech.sum_multiplier(3), refused_digest(refused), "os")
    share = 1.0 if noise == "local" else 0.1
    assert math.isclose(release.multiplier, mech.multiplier * math.sqrt(3 * share), rel_tol=1e-12)
    step, _ = _step(dp_epsilon=4.0, dp_noise=noise)
    assert step.dp_refused(refused) == Release(step.mechanism.sum_multiplier(3), refused_digest(refused), "seed")
    assert _step()[0].dp_refused(refused) is None
