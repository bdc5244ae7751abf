"""The budget a run reports is the one its most exposed client spent: a client's samples are in the releases of
the rounds it was asked in, not in those of rounds it sat out.

The reproduction (the privacy fuzz of session 36, benchmarks/privacy_fuzz.py): FedPAC under differential privacy
with one client of two sampled a round reported epsilon 20.84 where its worst client had spent 13.47: every
round's release was counted for every client. Client sampling is drawn from the run's seed, before and apart from
the data (``hetfl.engine.schedule.sampled_clients``), so who took part in a round is public and a release a client
sat out reveals nothing about its samples (no amplification by sampling is claimed either: the server knows who
is sampled). A client asked counts whether its reply came, came late, or was refused."""

from __future__ import annotations

import contextlib
import json
import math
from collections import Counter

import pytest
import torch

from hetfl import config
from hetfl.algorithms.dp_moments import MomentsMechanism
from hetfl.engine.federation import InProcessFederation
from hetfl.engine.ledger import PrivacyLedger
from hetfl.engine.schedule import sampled_clients
from hetfl.privacy import (
    Release,
    composed_multiplier,
    epsilon_spent,
    noise_multiplier,
    participation,
    worst_client_multipliers,
)
from hetfl.rng import most_rounds_asked
from hetfl.runtimes import set_up
from tests.helpers import needs_accountant

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["data.partition=iid", "data.num_clients=4", "data.options={num_devices=8, max_samples=60}",
        "runtime.progress=false", "runtime.threads=1", "runtime.device=cpu", "algorithm.name=fedpac",
        "model.name=mlp", "algorithm.dp_epsilon=4", "train.rounds=4", "train.local_steps=1",
        "train.clients_per_round=2"]


def rounds_taken_by(seed: int, rounds: int, clients: int, per_round: int) -> Counter:
    return Counter(c for r in range(1, rounds + 1) for c in sampled_clients(seed, r, clients, per_round))


def rounds_taken(seed: int) -> Counter:
    return rounds_taken_by(seed, 4, 4, 2)


def run(tmp_path, seed: int, monkeypatch=None, drop_round: int | None = None) -> tuple[dict, list[dict]]:
    """A run of ``TINY`` with ``seed``; in ``drop_round`` the last sampled client's reply is lost."""
    cfg = config.load(None, [*TINY, f"seed={seed}"])
    with contextlib.ExitStack() as stack:
        if drop_round is not None:
            train = InProcessFederation.train

            def trained(self, server, clients, sampled, round_, lr, reporter):
                updates, down = train(self, server, clients, sampled, round_, lr, reporter)
                return (updates[:-1] if round_ == drop_round else updates), down

            stack.enter_context(monkeypatch.context()).setattr(InProcessFederation, "train", trained)
        set_up(cfg).run(tmp_path / "run")
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return json.loads((tmp_path / "run" / "summary.json").read_text())["privacy"], lines


@needs_accountant
def test_a_sampled_run_reports_what_its_most_exposed_client_spent(tmp_path):
    """Seed 1: client 3 is asked in rounds 1, 3 and 4, the others in two rounds or fewer. The noise is calibrated
    for three releases (the most one client takes part in, known from the seed before any data is read), and
    client 3's three uploads (each with the whole local noise) spend the target, reported; every round's line
    says what had been spent by then. Before, the noise was calibrated for all four rounds and every round
    counted for every client: 4.0 reported for 3.39 spent."""
    taken = rounds_taken(1)
    assert taken.most_common(1) == [(3, 3)] and sorted(taken.values()) == [1, 2, 2, 3]
    privacy, lines = run(tmp_path, seed=1)
    z = privacy["noise_multiplier"]
    assert z == noise_multiplier(4.0, 1e-5, 3)
    assert privacy["releases"] == 4 and privacy["client_releases"] == 3
    assert privacy["epsilon"] == epsilon_spent([z] * 3, privacy["delta"]) == privacy["epsilon_per_upload"]
    assert privacy["epsilon"] == pytest.approx(4.0, rel=1e-9)
    assert epsilon_spent([noise_multiplier(4.0, 1e-5, 4)] * 3, 1e-5) == pytest.approx(3.392, abs=1e-3)  # the docs
    worst_by_round = [1, 2, 2, 3]  # the most rounds one client was asked in, after each round (client 1, then 3)
    assert [x["dp_client_releases"] for x in lines] == worst_by_round
    assert [x["dp_epsilon"] for x in lines] == [epsilon_spent([z] * k, privacy["delta"]) for k in worst_by_round]
    ledger = json.loads((tmp_path / "run" / "privacy_ledger.json").read_text())["releases"]
    assert [e["clients"] for e in ledger] == [sampled_clients(1, r, 4, 2) for r in (1, 2, 3, 4)]


def test_the_calibration_counts_the_most_rounds_one_client_is_asked_in():
    assert most_rounds_asked(1, 4, 4, 2) == 3 and most_rounds_asked(8, 4, 4, 2) == 2
    assert most_rounds_asked(1, 4, 4, 0) == most_rounds_asked(1, 4, 4, 4) == 4  # every client, every round
    for seed in range(5):
        assert most_rounds_asked(seed, 30, 10, 3) == max(rounds_taken_by(seed, 30, 10, 3).values())


@needs_accountant
def test_a_client_asked_counts_though_its_reply_was_lost(tmp_path, monkeypatch):
    """Seed 1 with client 3's reply lost in round 1: the server may still hold it (a late reply, a refused one);
    the release of round 1 counts for client 3, as for every client asked."""
    privacy, _ = run(tmp_path, seed=1, monkeypatch=monkeypatch, drop_round=1)
    assert privacy["client_releases"] == 3
    assert privacy["epsilon"] == epsilon_spent([privacy["noise_multiplier"]] * 3, privacy["delta"])


def test_the_worst_client_composes_the_sums_it_is_in():
    """Distributed noise: each release is a sum, its multiplier set by how many uploads it holds. A client's
    samples are in the sums of the rounds it was asked in; the worst client is the one whose sums' precisions
    (z^-2) add up to the most, not the one in the most sums."""
    multipliers = [1.0, 4.0, 4.0, 4.0, 2.0]
    rows = [(0,), (1, 2), (1, 2), (1,), None]  # None: any client (a release whose clients are not known)
    matrix = participation(rows)
    assert matrix.dtype == torch.bool and matrix.tolist() == [[True, False, False], [False, True, True],
                                                              [False, True, True], [False, True, False],
                                                              [True, True, True]]
    assert worst_client_multipliers(multipliers, matrix) == [1.0, 2.0]  # client 0: 1 + 1/4 > client 1: 3/16 + 1/4
    assert participation([None] * 5) is None  # nothing to say beyond "every client"
    assert worst_client_multipliers(multipliers, None) == multipliers
    assert worst_client_multipliers([], None) == []
    assert worst_client_multipliers([3.0, 0.0], participation([(0,), (1,)])) == [0.0]  # no noise: infinite loss
    with pytest.raises(ValueError, match="participation has 2 rows for 3 releases"):
        worst_client_multipliers([1.0, 2.0, 3.0], participation([(0,), (1,)]))


# (releases' multipliers, the one client each release holds, the worst client): the exposure is sum z^-2
WORST_CASES = [
    ([0.9] + [2.0] * 10, [0] + [1] * 10, 1),  # ten releases of z = 2 (2.5) outweigh one of z = 0.9 (1.23)
    ([0.5] + [1.0] * 3, [0, 1, 1, 1], 0),  # one of z = 0.5 (4) outweighs three of z = 1 (3): z^-2, not clamped
    ([0.5] + [1.0] * 5, [0] + [1] * 5, 1),  # five of z = 1 (5) outweigh one of z = 0.5 (4): z^-2, not z^-3
    # float64: client 0's 2.000000075 > client 1's 2.000000015; in float32 they come out the other way round
    ([1.0000001925737232, 0.999999769802292, 0.7071067785830816], [0, 0, 1], 0),
    # within the 1e-12 of the first pass: the exact composition decides (client 1, by 1e-13), not list order
    ([1.0, math.sqrt(2 / (1 + 1e-13)), math.sqrt(2 / (1 + 1e-13))], [0, 1, 1], 1),
]


@pytest.mark.parametrize(("multipliers", "owners", "worst"), WORST_CASES)
def test_the_most_exposed_client_is_found_however_its_exposure_is_made(multipliers, owners, worst):
    """A reported budget must be the most exposed client's: under-reporting it is the one error a privacy
    accountant must not make. Each case has a client that a wrong weighing of releases (a clamp, another power,
    float32, list order) would pass over for one that spent less."""
    got = worst_client_multipliers(multipliers, participation([(c,) for c in owners]))
    assert got == [m for m, c in zip(multipliers, owners, strict=True) if c == worst]
    others = [[m for m, c in zip(multipliers, owners, strict=True) if c == other] for other in set(owners)]
    assert composed_multiplier(got) == min(composed_multiplier(col) for col in others)
    assert all(composed_multiplier(col) > composed_multiplier(got) for col in others if col != got)


def test_participation_of_releases_that_name_no_client_and_the_mismatch_refused():
    """A release that names its clients and holds none (a round whose replies were all lost) is a row of
    False; the matrix is as wide as the largest client named, one column at least."""
    assert participation([(), None]).tolist() == [[False], [True]]
    assert participation([(), ()]).tolist() == [[False], [False]]
    with pytest.raises(ValueError) as refused:
        worst_client_multipliers([1.0, 2.0, 3.0], participation([(0,), (5,)]))
    assert str(refused.value) == "participation has 2 rows for 3 releases"


@needs_accountant
def test_the_mechanisms_guarantee_counts_per_client():
    mech = MomentsMechanism(4.0, 1e-5, 1.0, clients=4, releases=4, noise="distributed")
    sums = [mech.sum_multiplier(2)] * 4
    rows = [(0, 1), (0, 2), (1, 2), (0, 3)]
    got = mech.guarantee(sums, participation(rows))
    assert got["dp_releases"] == 4 and got["dp_client_releases"] == 3  # client 0
    assert got["dp_epsilon"] == epsilon_spent(sums[:3], 1e-5)
    assert got["dp_epsilon_per_upload"] == epsilon_spent([mech.upload_multiplier()] * 3, 1e-5)
    everyone = mech.guarantee(sums)
    assert everyone["dp_client_releases"] == 4 and everyone["dp_epsilon"] == epsilon_spent(sums, 1e-5)
    assert got["dp_epsilon"] < everyone["dp_epsilon"]


def test_a_ledger_keeps_who_was_asked_and_reads_one_that_did_not(tmp_path):
    """The clients asked are in the ledger; a ledger written before they were (no ``clients``) counts each of
    its releases for every client, and a replay of such a release is still a replay."""
    ledger = PrivacyLedger(tmp_path)
    ledger.record("fedpac", 1, Release(2.0, "a", "seed", clients=(0, 3)))
    assert PrivacyLedger(tmp_path).entries[0].clients == (0, 3)
    doc = json.loads((tmp_path / "privacy_ledger.json").read_text())
    del doc["releases"][0]["clients"]
    (tmp_path / "privacy_ledger.json").write_text(json.dumps(doc))
    old = PrivacyLedger(tmp_path)
    assert old.entries[0].clients is None
    assert old.record("fedpac", 1, Release(2.0, "a", "seed", clients=(0, 3))) == []  # a replay: nothing before it
    assert len(old.entries) == 1 and math.isfinite(old.entries[0].multiplier)


@needs_accountant
@pytest.mark.parametrize("source", ["seed", "os"])
def test_a_killed_and_resumed_sampled_run_reports_what_it_spent(tmp_path, monkeypatch, source):
    """Killed after round 3's line (checkpoint at round 2), resumed: with seeded noise round 3 is replayed and
    the numbers are the uninterrupted run's; with noise from the operating system round 3 reached the server
    twice, each time counted for the clients it asked (2 and 3): client 3 took part in 4 releases."""
    from tests.engine.test_ledger import session

    cfg = config.load(None, [*TINY, "seed=1", f"algorithm.dp_noise_source={source}", "runtime.checkpoint_every=2"])
    session(monkeypatch, cfg, tmp_path / "killed", resume=False, kill_after=3)
    session(monkeypatch, cfg, tmp_path / "killed", resume=True)
    set_up(cfg).run(tmp_path / "whole")
    got, whole = (json.loads((tmp_path / d / "summary.json").read_text())["privacy"] for d in ("killed", "whole"))
    z = whole["noise_multiplier"]
    assert whole["client_releases"] == 3 and whole["epsilon"] == pytest.approx(4.0, rel=1e-9)
    if source == "seed":
        assert got == whole
        return
    assert got["releases"] == 5 and got["client_releases"] == 4  # round 3 ([2, 3]) twice: client 3 in 4
    assert got["epsilon"] == epsilon_spent([z] * 4, got["delta"]) > whole["epsilon"]
