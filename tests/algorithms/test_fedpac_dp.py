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
from hetfl.cli import main
from hetfl.privacy import clip_rows, epsilon_spent
from tests.helpers import context, initial_state, tiny_setup


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


@pytest.mark.parametrize(("key", "value"), [("algorithm.dp_epsilon", "0"), ("algorithm.dp_delta", "1.5"),
                                            ("algorithm.clip_norm", "-1")])
def test_invalid_budget_exits_2_naming_the_key(key, value, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["run", "--set", "algorithm.name=fedpac", "--set", "model.name=mlp", "--set", f"{key}={value}",
                 "--set", "train.rounds=1", "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and key in err, err
    assert not out.exists()


@pytest.mark.slow
def test_fedpac_run_under_privacy_reports_its_budget(tmp_path):
    out = tmp_path / "run"
    assert main(["run", "--set", "algorithm.name=fedpac", "--set", "model.name=mlp", "--set", "algorithm.dp_epsilon=8",
                 "--set", "train.rounds=3", "--set", "train.local_steps=3", "--set", "data.num_clients=4",
                 "--set", "data.partition=dirichlet", "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["privacy"]["epsilon"] == pytest.approx(8.0, rel=1e-3) and summary["privacy"]["releases"] == 3
    assert summary["privacy"]["noise"] == "local" and math.isfinite(summary["final_client_acc_mean"])
