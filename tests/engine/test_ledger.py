"""hetfl.engine.ledger: what a release reports it adds to, after resumes that replayed or re-released rounds.

The reproduction (an audit of session 16; failed on 8adeee3): seeded noise, a checkpoint every 3 rounds;
session 1 releases rounds 1-5 and is killed before round 5's checkpoint; session 2 resumes, round 4 comes out
different (a client's reply lost), so rounds 4' and 5' are appended, and it is killed again; session 3
resumes and replays session 1's rounds 4 and 5 exactly. The server received 7 releases; the summary
reported 5 (epsilon 4.0 where 4.86 was spent)."""

from __future__ import annotations

import contextlib
import json
import math

import pytest

from hetfl import config
from hetfl.engine import rundir
from hetfl.engine.federation import InProcessFederation
from hetfl.engine.ledger import PrivacyLedger
from hetfl.engine.rundir import RunDirError
from hetfl.privacy import Release, epsilon_spent
from hetfl.runtimes import set_up
from tests.helpers import needs_accountant

pytestmark = pytest.mark.usefixtures("one_thread")


def release(name: str, multiplier: float = 2.0) -> Release:
    return Release(multiplier=multiplier, digest=name, noise_source="seed")


def added_to(ledger: PrivacyLedger, method: str, round_: int, r: Release) -> list[float]:
    """The multipliers of the releases recording ``r`` adds to."""
    return [e.multiplier for e in ledger.record(method, round_, r)]


def test_a_first_release_adds_to_every_earlier_release_of_its_method():
    ledger = PrivacyLedger()
    assert added_to(ledger, "ccvr", 1, release("r1", 2.0)) == []
    assert added_to(ledger, "fedpac", 1, release("p1", 5.0)) == []
    assert added_to(ledger, "ccvr", 2, release("r2", 3.0)) == [2.0]
    assert added_to(ledger, "ccvr", 3, release("r3", 4.0)) == [2.0, 3.0]
    assert ledger.multipliers("ccvr") == [2.0, 3.0, 4.0]


def test_which_rounds_were_released_and_which_releases_a_checkpoint_does_not_know():
    ledger = PrivacyLedger()
    for method, round_, name in [("ccvr", 1, "a"), ("fedpac", 1, "b"), ("ccvr", 2, "c"), ("fedpac", 3, "d")]:
        ledger.record(method, round_, release(name))
    assert ledger.released("ccvr", 2) and not ledger.released("ccvr", 3) and not ledger.released("fedpac", 2)
    assert [e.digest for e in ledger.after("ccvr", 1)] == ["c"]
    assert [e.digest for e in ledger.after("fedpac", 1)] == ["d"]
    assert ledger.after("ccvr", 5) == []


def test_a_ledger_file_that_cannot_be_read_is_named_and_refused(tmp_path):
    (tmp_path / "privacy_ledger.json").write_text(json.dumps({"version": 2, "releases": []}))
    with pytest.raises(RunDirError, match=r"privacy_ledger.json: not a readable privacy ledger \(version 2, "
                                          r"expected 1\); the budget spent cannot be known, so the run is not "
                                          r"resumed$"):
        PrivacyLedger(tmp_path)
    (tmp_path / "new").mkdir()
    ledger = PrivacyLedger(tmp_path / "new")  # none yet: an empty ledger, written at its first release
    ledger.record("ccvr", 1, release("a", 2.5))
    assert PrivacyLedger(tmp_path / "new").entries == ledger.entries


def test_a_replay_of_an_uninterrupted_history_adds_to_what_the_uninterrupted_run_did():
    """Session 1 released rounds 1-5; the resumed session replays 4 and 5: each reports what it did then
    (the run's numbers are the uninterrupted run's), and nothing is written again."""
    ledger = PrivacyLedger()
    for r in range(1, 6):
        ledger.record("ccvr", r, release(f"r{r}", float(r)))
    assert added_to(ledger, "ccvr", 4, release("r4", 4.0)) == [1.0, 2.0, 3.0]
    assert added_to(ledger, "ccvr", 5, release("r5", 5.0)) == [1.0, 2.0, 3.0, 4.0]
    assert len(ledger.entries) == 5


def test_a_replay_counts_the_releases_of_an_abandoned_resume_up_to_its_round():
    """The reproduction's ledger: 1, 2, 3, 4, 5 (session 1), 4', 5' (session 2). Session 3 replays 4, then 5:
    the server has received 4' and 5' too, so round 4 adds to 1-3 and 4', round 5 to 1-4, 4' and 5': every
    release the ledger holds counts by the last round."""
    ledger = PrivacyLedger()
    for r in range(1, 6):
        ledger.record("ccvr", r, release(f"r{r}", float(r)))
    ledger.record("ccvr", 4, release("r4'", 40.0))
    ledger.record("ccvr", 5, release("r5'", 50.0))
    assert sorted(added_to(ledger, "ccvr", 4, release("r4", 4.0))) == [1.0, 2.0, 3.0, 40.0]
    assert sorted(added_to(ledger, "ccvr", 5, release("r5", 5.0))) == [1.0, 2.0, 3.0, 4.0, 40.0, 50.0]


def test_the_checkpoints_releases_may_lie_anywhere_in_the_ledger():
    """A checkpoint of session 3 accounts for 1-4 and 4' (a replay that counted an abandoned release): the
    ledger covers it though 4' is not its fifth entry; one the ledger lacks is refused."""
    ledger = PrivacyLedger()
    for r, z in [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0), (4, 40.0), (5, 50.0)]:
        ledger.record("ccvr", r, release(f"r{r}-{z}", z))
    ledger.check_covers("ccvr", [1.0, 2.0, 3.0, 40.0, 4.0])
    with pytest.raises(RunDirError, match=r"holds 0 matching ones \(of 7\); without it the budget spent cannot "
                                          r"be known, so the run is not resumed \(start a new run\)$"):
        ledger.check_covers("ccvr", [1.0 + 1e-10])  # a multiplier is matched exactly (float64 both ways)
    with pytest.raises(RunDirError, match=r"holds 5 matching ones \(of 7\)"):
        ledger.check_covers("ccvr", [1.0, 2.0, 3.0, 40.0, 4.0, 6.0])
    with pytest.raises(RunDirError):
        ledger.check_covers("ccvr", [1.0, 1.0])


TINY = ["data.partition=iid", "data.num_clients=4", "data.options={num_devices=8, max_samples=60}",
        "runtime.progress=false", "runtime.threads=1", "runtime.device=cpu"]


class Killed(KeyboardInterrupt):
    pass


def session(monkeypatch, cfg, run, *, resume: bool, kill_after: int | None = None,
            drop_round: int | None = None) -> None:
    """One process's part of the run: killed right after round ``kill_after``'s metrics line (its release made,
    its checkpoint not written), one client's reply lost in round ``drop_round``."""
    append, train = rundir.MetricsLog.append, InProcessFederation.train

    def appended(self, line):
        append(self, line)
        if line["round"] == kill_after:
            raise Killed

    def trained(self, server, clients, sampled, round_, lr, reporter):
        updates, down = train(self, server, clients, sampled, round_, lr, reporter)
        return (updates[:-1] if round_ == drop_round else updates), down

    with monkeypatch.context() as m:
        m.setattr(rundir.MetricsLog, "append", appended)
        m.setattr(InProcessFederation, "train", trained)
        with contextlib.suppress(Killed):
            set_up(cfg).run(run, resume=resume)


@needs_accountant
@pytest.mark.slow
@pytest.mark.parametrize("source", ["seed", "os"])
def test_three_sessions_report_every_release_the_server_received(tmp_path, monkeypatch, source):
    """Killed after round 5 (checkpoint at 3), resumed with a client's reply lost in round 4 and killed after
    round 5 again, resumed to the end. With noise from the operating system every release counts. With
    seeded noise round 5 reached the server twice with different content (the model that followed a round 4
    with a client fewer) and the same noise: their difference carries none, so no finite epsilon holds
    (reported 4.86 before the privacy audit of session 31). Round 4's second release held the same uploads
    as its first, one fewer: nothing new (named too until session 37, which compares the uploads by client)."""
    cfg = config.load(None, [*TINY, "algorithm.name=fedpac", "model.name=mlp", "algorithm.dp_epsilon=4",
                             f"algorithm.dp_noise_source={source}", "train.rounds=5", "train.local_steps=2",
                             "runtime.checkpoint_every=3"])
    run = tmp_path / "run"
    session(monkeypatch, cfg, run, resume=False, kill_after=5)
    session(monkeypatch, cfg, run, resume=True, kill_after=5, drop_round=4)
    session(monkeypatch, cfg, run, resume=True)
    ledger = json.loads((run / "privacy_ledger.json").read_text())["releases"]
    privacy = json.loads((run / "summary.json").read_text())["privacy"]
    if source == "seed":  # the last session replays the first's rounds 4 and 5: nothing new
        assert [e["round"] for e in ledger] == [1, 2, 3, 4, 5, 4, 5]
        assert privacy["epsilon"] == math.inf and privacy["noise_reused_rounds"] == [5]
        return
    assert [e["round"] for e in ledger] == [1, 2, 3, 4, 5, 4, 5, 4, 5] and "noise_reused_rounds" not in privacy
    # FedPAC adds its noise locally: each client's upload is one release of multiplier z (the headline epsilon)
    spent = epsilon_spent([privacy["noise_multiplier"]] * len(ledger), privacy["delta"])
    assert privacy["releases"] == 9
    assert privacy["epsilon"] == pytest.approx(spent, rel=1e-9) and spent > 4.8


def test_seeded_releases_of_a_round_that_differ_are_named_and_replays_are_not():
    ledger = PrivacyLedger()
    for method, round_, source, digest in [("ccvr", 1, "seed", "a"), ("ccvr", 2, "seed", "b"),
                                           ("ccvr", 2, "seed", "b"), ("fedpac", 2, "seed", "c"),
                                           ("ccvr", 3, "os", "d"), ("ccvr", 3, "os", "e")]:
        ledger.record(method, round_, Release(multiplier=1.0, digest=digest, noise_source=source))
    assert ledger.reused_seeded_noise() == []  # a replay, other methods' releases, fresh noise
    ledger.record("ccvr", 1, Release(multiplier=1.0, digest="a2", noise_source="seed"))
    assert ledger.reused_seeded_noise() == [1]


def test_a_rounds_releases_that_differ_only_in_who_is_in_them_are_no_noiseless_difference():
    """Seeded noise, uploads named by client: round 3 released with clients 0 and 1, then (resumed) with 0, 1
    and 2, each client's upload the same: nothing new. Client 1 uploading something else under the same noise
    is the noiseless difference; so is any difference where a release does not name its clients' uploads."""
    def seeded(digest: str, uploads: dict[int, str] | None) -> Release:
        return Release(multiplier=1.0, digest=digest, noise_source="seed", uploads=uploads)

    ledger = PrivacyLedger()
    ledger.record("fedpac", 3, seeded("ab", {0: "a", 1: "b"}))
    ledger.record("fedpac", 3, seeded("abc", {0: "a", 1: "b", 2: "c"}))
    assert len(ledger.entries) == 2 and ledger.reused_seeded_noise() == []
    ledger.record("fedpac", 3, seeded("ab'", {0: "a", 1: "b'"}))
    assert ledger.reused_seeded_noise() == [3]
    other = PrivacyLedger()
    other.record("fedpac", 3, seeded("ab", {0: "a", 1: "b"}))
    other.record("fedpac", 3, seeded("sum", None))  # a secure sum: what differs cannot be told by client
    assert other.reused_seeded_noise() == [3]


def test_a_ledger_keeps_each_clients_upload_digest(tmp_path):
    ledger = PrivacyLedger(tmp_path)
    ledger.record("fedpac", 1, Release(2.0, "a", "seed", clients=(0, 3), uploads={3: "d3", 0: "d0"}))
    (entry,) = PrivacyLedger(tmp_path).entries
    assert entry.uploads == {0: "d0", 3: "d3"} and entry.clients == (0, 3)

