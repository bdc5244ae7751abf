"""FedPAC's centroid statistics under differential privacy (hetfl issue 19, item 3): clipped features, noisy
dense counts and sums, classes whose noisy total is noise get no centroid, the budget over the rounds."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import Upload
from hetfl.algorithms.fedpac import CENTROID_SUMS, CENTROIDS, COUNTS, DP_RELEASES, HAS_CENTROID
from hetfl.algorithms.gaussian_stats import NonFiniteStatistics
from hetfl.cli import main
from hetfl.privacy import Release, accountant_name, clip_rows, epsilon_spent, refused_digest
from tests.helpers import context, initial_state, needs_accountant, release_digest_reference, tiny_setup


def _uploads(algo, server, data):
    """Each client's finish() upload (its counts and sums from ``data[c]`` = (features, labels))."""
    uploads = []
    for c, (x, y) in enumerate(data):
        ctx = context(c, algo.payload(server, c), algo.init_client_state(c, server))
        ctx.features = lambda state, x=x, y=y: (x, y)
        ctx.extras = {"h": torch.zeros(3, x.shape[1], dtype=torch.float64), "v": torch.tensor(1.0)}
        upload, _ = algo.finish(ctx, dict(server.model), 1)
        uploads.append(Upload(c, upload, len(y), 1))
    return uploads


def _data(seed: int = 0, absent: int | None = 2):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(4):
        y = torch.arange(300) % 3
        if absent is not None:
            y = torch.where(y == absent, (y + 1) % 3, y)
        out.append((torch.randn(300, 8, generator=gen) * 2 + 1, y))
    return out


@needs_accountant
def test_private_uploads_are_clipped_noisy_and_dense():
    setup = tiny_setup(num_clients=4)
    plain = build_algorithm("fedpac", {}, setup)
    private = build_algorithm("fedpac", {"dp_epsilon": 4.0, "clip_norm": 2.0}, setup)
    server = plain.init_server(initial_state(setup))
    data = _data()
    clean, noisy = _uploads(plain, server, data), _uploads(private, server, data)
    for c, (x, y) in enumerate(data):
        assert clean[c].tensors[COUNTS][2] == 0 and noisy[c].tensors[COUNTS][2] != 0  # noise on the absent class
        clipped_sum = clip_rows(x.double(), 2.0)[y == 0].sum(0)
        error = noisy[c].tensors[CENTROID_SUMS][0] - clipped_sum
        std = private.mechanism.upload_std()["sums"]  # local noise: each upload the whole budget
        assert private.mechanism.share == 1.0 and error.abs().max() < 5 * std
        assert (noisy[c].tensors[CENTROID_SUMS][0] - clean[c].tensors[CENTROID_SUMS][0]).abs().max() > 5 * std


@needs_accountant
def test_a_class_whose_noisy_total_is_noise_gets_no_centroid():
    """Class 2 is held by nobody: its noisy total count is a few noise standard deviations at most, below the
    threshold; classes 0 and 1 (1200 and 800 samples) get centroids near the clipped features' means."""
    setup = tiny_setup(num_clients=4, rounds=1)  # the whole budget on this round
    algo = build_algorithm("fedpac", {"dp_epsilon": 8.0, "clip_norm": 20.0}, setup)
    server = algo.init_server(initial_state(setup))
    data = _data()
    new = algo.aggregate(server, _uploads(algo, server, data), 1)
    assert new.extra[HAS_CENTROID].tolist() == [1.0, 1.0, 0.0]
    for seed in range(1, 7):  # other noise draws: the absent class's noisy total is as often positive as not
        other = build_algorithm("fedpac", {"dp_epsilon": 8.0, "clip_norm": 20.0}, replace(setup, seed=seed))
        assert other.aggregate(server, _uploads(other, server, data), 1).extra[HAS_CENTROID].tolist()[2] == 0.0
    x = torch.cat([d[0] for d in data]).double()
    y = torch.cat([d[1] for d in data])
    for c in (0, 1):
        want = clip_rows(x[y == c], 20.0).mean(0)
        noise = algo.mechanism.upload_std()["sums"] * 2 / int((y == c).sum())  # std of the centroid's noise
        torch.testing.assert_close(new.extra[CENTROIDS][c].double(), want, atol=5 * noise, rtol=0)


@needs_accountant
def test_the_budget_composes_over_the_rounds_and_is_reported():
    setup = tiny_setup(num_clients=4, rounds=3)
    algo = build_algorithm("fedpac", {"dp_epsilon": 2.0}, setup)
    server = algo.init_server(initial_state(setup))
    assert algo.mechanism.releases == 3 and not algo.mechanism.with_outer
    for round_ in (1, 2, 3):
        uploads = _uploads(algo, server, _data(round_))
        server = algo.aggregate(server, uploads, round_)
        info = algo.round_info(server, uploads, round_)
        assert info["dp_releases"] == round_
    assert info["dp_epsilon"] == pytest.approx(2.0, rel=1e-3) == info["dp_epsilon_per_upload"]
    assert "not the sample count n_i" in info["dp_covers"] and "h_i" in info["dp_covers"]
    assert info["dp_accountant"].startswith("dp-accounting")
    assert info["dp_secure_aggregation"] is False  # a report reads it: without it the server saw each upload
    z = algo.mechanism.multiplier
    assert server.extra[DP_RELEASES].tolist() == [pytest.approx(2 * z)] * 3  # the sum of 4 local noises: 2z
    # three uploads of four in a round: their sum carries three local noises; each upload still the whole noise
    s = algo.aggregate(algo.init_server(initial_state(setup)), _uploads(algo, server, _data())[:3], 1)
    assert s.extra[DP_RELEASES].tolist() == [pytest.approx(z * math.sqrt(3))]
    assert epsilon_spent([z], 1e-5) < 2.0  # one of three planned releases


def test_without_privacy_nothing_changes():
    setup = tiny_setup(num_clients=4)
    algo = build_algorithm("fedpac", {}, setup)
    server = algo.init_server(initial_state(setup))
    uploads = _uploads(algo, server, _data())
    new = algo.aggregate(server, uploads, 1)
    assert algo.mechanism is None and DP_RELEASES not in new.extra and algo.round_info(new, uploads, 1) == {}


@needs_accountant
def test_a_huge_clip_norm_is_refused_naming_only_what_fedpac_uploads():
    """FedPAC uploads counts and feature sums, no outer products: its set-up refusal named "the derived noise
    std of outer" (a tensor it never sends) and refused clip_norm = 1e160, whose sums' noise is finite. Now the
    clip norm is refused only where a bound of what it uploads overflows, naming that bound and the largest
    clip norm the budget allows."""
    from hetfl.params import ConfigError

    setup = tiny_setup(num_clients=4)
    accepted = build_algorithm("fedpac", {"dp_epsilon": 4.0, "clip_norm": 1e160}, setup)
    std = accepted.mechanism.upload_std()
    assert set(std) == {"counts", "sums"} and std["sums"] == std["counts"] * 1e160
    with pytest.raises(ConfigError) as refused:
        build_algorithm("fedpac", {"dp_epsilon": 4.0, "clip_norm": 1e308}, setup)
    limit = torch.finfo(torch.float64).max / std["counts"]
    assert refused.value.key == "algorithm.clip_norm" and refused.value.value == 1e308
    assert str(refused.value) == (
        "algorithm.clip_norm = 1e+308: the derived noise std of sums (counts and sums are what FedPAC uploads) is "
        f"not a finite float64; must be at most {limit:.3g} at this budget; choose a clip norm near the "
        "features' norms")
    assert "outer" not in str(refused.value)



@needs_accountant
@pytest.mark.parametrize("source", ["seed", "os"])
def test_a_release_is_the_sums_multiplier_and_a_digest_of_each_uploads_counts_and_sums(source):
    """dp_release, what the run's ledger records before the server uses a round's uploads: the multiplier of
    the noise in the sum of the uploads received (three of four clients: sqrt(3) local noises), the digest of
    exactly the private tensors of each upload as received (client/counts, client/sums), the noise's source,
    and each client's upload's own digest (what tells a client's two different uploads under seeded noise)."""
    setup = tiny_setup(num_clients=4, rounds=2)
    algo = build_algorithm("fedpac", {"dp_epsilon": 4.0, "dp_noise_source": source}, setup)
    server = algo.init_server(initial_state(setup))
    received = [u for u in _uploads(algo, server, _data()) if u.client_id != 1]
    release = algo.dp_release(received)
    assert release == Release(algo.mechanism.sum_multiplier(3),
                              release_digest_reference([(f"{u.client_id}/{k}", u.tensors[k]) for u in received
                                       for k in (COUNTS, CENTROID_SUMS)]), source,
                              uploads={u.client_id: release_digest_reference([(k, u.tensors[k])
                                                                              for k in (COUNTS, CENTROID_SUMS)])
                                       for u in received})
    assert math.isclose(release.multiplier, algo.mechanism.multiplier * math.sqrt(3), rel_tol=1e-12)
    assert build_algorithm("fedpac", {}, setup).dp_release(received) is None  # no privacy, no release


@needs_accountant
@pytest.mark.parametrize("source", ["seed", "os"])
def test_refused_uploads_are_released_as_their_sum_with_the_refused_digest(source):
    """dp_refused: noisy uploads the server received and refused in a round with nothing usable count as the
    sum of that many local noises, with the refused uploads' digest and the run's noise source; nothing
    without privacy."""
    setup = tiny_setup(num_clients=10)
    algo = build_algorithm("fedpac", {"dp_epsilon": 4.0, "dp_noise_source": source}, setup)
    refused = {4: "dd", 2: "bb", 7: "ee"}
    release = algo.dp_refused(refused)
    assert release == Release(algo.mechanism.sum_multiplier(3), refused_digest(refused), source)
    assert math.isclose(release.multiplier, algo.mechanism.multiplier * math.sqrt(3), rel_tol=1e-12)
    assert build_algorithm("fedpac", {}, setup).dp_refused(refused) is None


@needs_accountant
def test_round_info_states_the_whole_guarantee_once_a_release_is_recorded():
    """The metrics line's privacy entries, whole: the mechanism's guarantee over the recorded releases, the
    accountant, how many uploads the round's sum held, never securely aggregated, what the guarantee covers.
    Nothing before the first release, nor without privacy (a state holding releases all the same)."""
    setup = tiny_setup(num_clients=4, rounds=3)
    algo = build_algorithm("fedpac", {"dp_epsilon": 2.0}, setup)
    server = algo.init_server(initial_state(setup))
    uploads = _uploads(algo, server, _data())[:3]
    assert algo.round_info(server, uploads, 1) == {}  # no release recorded yet
    server = algo.aggregate(server, uploads, 1)
    multipliers = server.extra[DP_RELEASES]  # float64, as the mechanism computes them: the accounting's input
    assert multipliers.dtype == torch.float64 and multipliers.tolist() == [algo.mechanism.sum_multiplier(3)]
    assert algo.round_info(server, uploads, 1) == {
        **algo.mechanism.guarantee([algo.mechanism.sum_multiplier(3)]), "dp_accountant": accountant_name(),
        "dp_summed_clients": 3, "dp_secure_aggregation": False,
        "dp_covers": "per-class counts and feature sums (the centroids); not the sample count n_i (the aggregation "
                     "weight), h_i, v_i, the classifiers or the encoder"}
    assert build_algorithm("fedpac", {}, setup).round_info(server, uploads, 1) == {}


@needs_accountant
def test_seeded_noise_comes_from_the_runs_seed_alone_and_os_noise_is_never_repeated():
    """dp_noise_source = "seed": a client's noisy counts and sums are the same whatever the state of torch's
    global generator, which they leave untouched (the run's own stream, per seed, round and client: another
    seed, other noise); "os": two uploads of the same features carry different noise."""
    setup = tiny_setup(num_clients=4)
    data = _data()

    def uploads(hp, global_seed, run_seed=0):
        algo = build_algorithm("fedpac", hp, replace(setup, seed=run_seed))
        server = algo.init_server(initial_state(setup))
        torch.manual_seed(global_seed)
        before = torch.random.get_rng_state()
        out = _uploads(algo, server, data)
        return out, torch.equal(torch.random.get_rng_state(), before)

    (a, untouched), (b, _) = uploads({"dp_epsilon": 4.0}, 0), uploads({"dp_epsilon": 4.0}, 1)
    assert untouched
    for key in (COUNTS, CENTROID_SUMS):
        assert all(torch.equal(u.tensors[key], w.tensors[key]) for u, w in zip(a, b, strict=True)), key
        assert not torch.equal(a[0].tensors[key], a[1].tensors[key])  # each client its own noise
    other_seed, _ = uploads({"dp_epsilon": 4.0}, 0, run_seed=1)
    assert not torch.equal(other_seed[0].tensors[COUNTS], a[0].tensors[COUNTS])
    (x, _), (y, _) = (uploads({"dp_epsilon": 4.0, "dp_noise_source": "os"}, 0) for _ in range(2))
    assert not torch.equal(x[0].tensors[COUNTS], y[0].tensors[COUNTS])
    assert not torch.equal(x[0].tensors[COUNTS], a[0].tensors[COUNTS])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_noisy_uploads_are_on_the_features_device():
    """The mechanism draws on the CPU; the counts and sums go up from the features' device, as without
    privacy."""
    setup = tiny_setup(num_clients=4)
    algo = build_algorithm("fedpac", {"dp_epsilon": 4.0}, setup)
    server = algo.init_server(initial_state(setup))
    up = _uploads(algo, server, [(x.cuda(), y.cuda()) for x, y in _data()])[0]
    assert up.tensors[COUNTS].device.type == up.tensors[CENTROID_SUMS].device.type == "cuda"


@needs_accountant
def test_a_class_gets_a_centroid_only_when_its_noisy_total_exceeds_three_noise_stds():
    """The threshold is strict and at three standard deviations of the summed count noise (std per upload
    times sqrt(uploads)): one upload whose count of class 0 is exactly 3 std gets no centroid for it; 3.5 std
    (class 1) and 3 std plus one float step (class 2) do; over two uploads 3.5 std of their sum does."""
    setup = tiny_setup(num_clients=4, rounds=1)
    algo = build_algorithm("fedpac", {"dp_epsilon": 8.0, "clip_norm": 20.0}, setup)
    server = algo.init_server(initial_state(setup))
    std = algo.mechanism.upload_std()["counts"]
    ups = _uploads(algo, server, _data(absent=None))
    ups[0].tensors[COUNTS] = torch.tensor([3.0 * std, 3.5 * std, math.nextafter(3.0 * std, math.inf)],
                                          dtype=torch.float64)
    assert algo.aggregate(server, ups[:1], 1).extra[HAS_CENTROID].tolist() == [0.0, 1.0, 1.0]
    total = 3.5 * std * math.sqrt(2)
    for u in ups[:2]:
        u.tensors[COUNTS] = torch.full((3,), total / 2, dtype=torch.float64)
    assert algo.aggregate(server, ups[:2], 1).extra[HAS_CENTROID].tolist() == [1.0, 1.0, 1.0]


@needs_accountant
def test_private_centroids_that_are_not_finite_stop_the_round_naming_the_cause():
    setup = tiny_setup(num_clients=4)
    algo = build_algorithm("fedpac", {"dp_epsilon": 4.0}, setup)
    server = algo.init_server(initial_state(setup))
    ups = _uploads(algo, server, _data())
    ups[2].tensors[CENTROID_SUMS][1, 3] = math.inf
    with pytest.raises(NonFiniteStatistics) as failed:
        algo.aggregate(server, ups, 7)
    assert str(failed.value) == ("FedPAC round 7: the private centroids are not finite (inf or NaN): the features "
                                 "overflowed (check algorithm.clip_norm and train_loss)")


def test_distributed_noise_and_a_budget_outside_the_range_are_refused_at_set_up_naming_the_key():
    """FedPAC's own refusal (its uploads are never securely aggregated) and the shared budget check, with the
    method's prefix, compared whole; distributed noise without privacy is no setting in effect: accepted."""
    from hetfl.params import ConfigError

    setup = tiny_setup(num_clients=4)
    with pytest.raises(ConfigError) as refused:
        build_algorithm("fedpac", {"dp_epsilon": 4.0, "dp_noise": "distributed"}, setup)
    assert (refused.value.key, refused.value.value) == ("algorithm.dp_noise", "distributed")
    assert str(refused.value) == (
        "algorithm.dp_noise = 'distributed': FedPAC's uploads are never securely aggregated: the server sees each "
        "one, and distributed noise would protect only their sum; use 'local' (each upload carries the whole "
        "noise and is (dp_epsilon, dp_delta)-DP on its own)")
    assert build_algorithm("fedpac", {"dp_noise": "distributed"}, setup).mechanism is None
    with pytest.raises(ConfigError) as budget:
        build_algorithm("fedpac", {"dp_epsilon": 1e-4}, setup)
    assert (budget.value.key, budget.value.value) == ("algorithm.dp_epsilon", 1e-4)


def test_privacy_without_the_accountant_is_refused_at_set_up_naming_dp_epsilon(monkeypatch):
    """Without Google's dp-accounting a private FedPAC is refused when it is built, naming algorithm.dp_epsilon,
    its value and how to install the accountant (the ImportError's text, whole)."""
    from hetfl.algorithms import fedpac as fedpac_module
    from hetfl.params import ConfigError

    def missing():
        raise ImportError("differential privacy needs the accountant: pip install 'hetfl[privacy]'")

    monkeypatch.setattr(fedpac_module, "require_accountant", missing)
    with pytest.raises(ConfigError) as refused:
        build_algorithm("fedpac", {"dp_epsilon": 4.0}, tiny_setup(num_clients=4))
    assert (refused.value.key, refused.value.value) == ("algorithm.dp_epsilon", 4.0)
    assert str(refused.value) == ("algorithm.dp_epsilon = 4.0: differential privacy needs the accountant: "
                                  "pip install 'hetfl[privacy]'")
    assert build_algorithm("fedpac", {}, tiny_setup(num_clients=4)).mechanism is None  # no privacy: not needed

@pytest.mark.parametrize(("key", "value"), [("algorithm.dp_epsilon", "0"), ("algorithm.dp_delta", "1.5"),
                                            ("algorithm.clip_norm", "-1")])
def test_invalid_budget_exits_2_naming_the_key(key, value, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["run", "--set", "algorithm.name=fedpac", "--set", "model.name=mlp", "--set", f"{key}={value}",
                 "--set", "train.rounds=1", "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and key in err, err
    assert not out.exists()


@needs_accountant
@pytest.mark.slow
def test_fedpac_run_under_privacy_reports_its_budget(tmp_path):
    out = tmp_path / "run"
    assert main(["run", "--set", "algorithm.name=fedpac", "--set", "model.name=mlp", "--set", "algorithm.dp_epsilon=8",
                 "--set", "train.rounds=3", "--set", "train.local_steps=3", "--set", "data.num_clients=4",
                 "--set", "data.partition=dirichlet", "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["privacy"]["epsilon"] == pytest.approx(8.0, rel=1e-3) and summary["privacy"]["releases"] == 3
    assert summary["privacy"]["noise"] == "local" and math.isfinite(summary["final_client_acc_mean"])
