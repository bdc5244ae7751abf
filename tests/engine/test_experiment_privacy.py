"""How a run hands its differentially private releases to the privacy ledger (``hetfl.engine.experiment``).

The ledger's own rules (what a release adds to, which rounds reused seeded noise) are tested in
``test_ledger.py``; the whole runs killed and resumed in ``test_privacy_edges.py`` and ``test_ledger.py``.
Here, the experiment's side, one piece at a time (session 44: mutation testing of these functions left
the user-facing half untested): a round released a second time with other content is named with what it
does to the epsilon reported (and a replay, or a first release, is not); a phase that stopped the run
records what it had received, or the uploads it refused when nothing was usable, for the clients it asked;
a resume names the releases made after the checkpoint whose noise cannot be replayed; a round released
twice under the same seeded noise turns the reported epsilons (whole and per upload) into inf, said once.
"""

from __future__ import annotations

import logging
import math

import pytest

from hetfl import config
from hetfl.engine.federation import PhaseStopped
from hetfl.engine.ledger import PrivacyLedger
from hetfl.privacy import Release
from hetfl.runtimes import set_up
from tests.helpers import needs_accountant

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["data.partition=iid", "data.num_clients=4", "data.options={num_devices=8, max_samples=60}",
        "model.name=mlp", "runtime.progress=false", "runtime.threads=1", "runtime.device=cpu"]


class Method:
    """A releasing method reduced to what the experiment asks of it: its name, the release in what the server
    received or refused, and the server state accounting for the releases before one (returned as it was
    handed, to be read)."""

    name = "fake"

    def dp_release(self, received):
        return Release(2.0, f"used {received}", "os") if received else None

    def dp_refused(self, refused):
        return Release(3.0, f"refused {sorted(refused.items())}", "os")

    def dp_with_past(self, server, multipliers, clients):
        return {"server": server, "past": multipliers, "clients": clients}


class Reporter:
    """A terminal display that shows notes (``shows_notes``): every note is collected here, none logged."""

    shows_notes = True

    def __init__(self) -> None:
        self.notes: list[str] = []

    def note(self, message: str) -> None:
        self.notes.append(message)


@pytest.fixture(scope="module")
def experiment_factory():
    cfg = config.load(None, [*TINY, "algorithm.name=fedpac", "algorithm.dp_epsilon=4", "train.rounds=3"])

    def make():
        return set_up(cfg)

    return make


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "hetfl" and r.levelno == logging.WARNING]


@needs_accountant
def test_a_release_recorded_without_a_run_goes_to_a_ledger_in_memory(experiment_factory):
    """The pieces driven without ``run()`` (no run directory): the first release opens a ledger kept in
    memory; each release then accounts for the method's earlier ones and names the clients of all."""
    exp, method = experiment_factory(), Method()
    assert exp.ledger is None
    first = exp.record_release(method, Release(2.0, "a", "os", clients=(0, 1)), 1, "server")
    assert isinstance(exp.ledger, PrivacyLedger) and exp.ledger.path is None
    assert first == {"server": "server", "past": [], "clients": [(0, 1)]}
    second = exp.record_release(method, Release(5.0, "b", "os", clients=(2,)), 2, "server")
    assert second == {"server": "server", "past": [2.0], "clients": [(0, 1), (2,)]}
    assert exp.record_release(method, None, 3, "server") == "server"  # no release: the state as it was
    assert [(e.round, e.digest) for e in exp.ledger.entries] == [(1, "a"), (2, "b")]


@pytest.mark.parametrize(("first", "again", "consequence"), [
    (Release(2.0, "a", "os"), Release(2.0, "b", "os"), "both count in the epsilon reported"),
    (Release(2.0, "a", "seed"), Release(2.0, "b", "seed"),
     "both carry the same seeded noise, so their difference is noiseless: the epsilon reported is inf"),
    (Release(2.0, "a", "seed", uploads={0: "x"}), Release(2.0, "b", "seed", uploads={0: "x", 1: "y"}),
     "every client's upload in both is the same (seeded noise on the same content), so nothing new reached the "
     "server; both count in the epsilon reported"),
], ids=["os noise", "seeded noise, other content", "seeded noise, the same uploads and one more"])
@needs_accountant
def test_a_round_released_again_with_other_content_is_named_with_what_it_does_to_the_epsilon(
        experiment_factory, caplog, first, again, consequence):
    exp, method = experiment_factory(), Method()
    with caplog.at_level(logging.WARNING, logger="hetfl"):
        exp.record_release(method, Release(1.0, "r1", again.noise_source), 1, None)
        exp.record_release(method, first, 2, None)
        assert warnings_of(caplog) == []  # first releases of their rounds: nothing to say
        exp.record_release(method, first, 2, None)
        assert warnings_of(caplog) == []  # a replay (a resume's seeded round run again): nothing new, not named
        past = exp.record_release(method, again, 2, None)["past"]
    assert warnings_of(caplog) == [
        f"privacy: fake released round 2 again and it differs from the release the ledger holds (noise source "
        f"{again.noise_source!r}): {consequence}"]
    assert past == [1.0, 2.0]  # the release it differs from counts
    assert [e.digest for e in exp.ledger.entries] == ["r1", "a", "b"]


@needs_accountant
def test_a_stopped_phase_records_what_it_received_for_the_clients_it_asked(experiment_factory):
    """Replies it could use: their release, for every client asked (replied or not); nothing usable but
    refused uploads: those, as a release of their own; neither: nothing."""
    exp, method = experiment_factory(), Method()
    exp.account_stop(method, PhaseStopped("2 of 5 answered", received=["u"], refused={4: "h4"}), ["u"], 1,
                     None, asked=[4, 1, 3])
    exp.account_stop(method, PhaseStopped("0 of 5 answered", refused={3: "h3", 1: "h1"}), None, 2, None,
                     asked=[3, 1])
    exp.account_stop(method, PhaseStopped("0 of 5 answered"), None, 3, None, asked=[0])
    exp.account_stop(method, PhaseStopped("0 of 5 answered", refused={2: "h2"}), [], 4, None)
    assert [(e.round, e.multiplier, e.digest, e.clients) for e in exp.ledger.entries] == [
        (1, 2.0, "used ['u']", (1, 3, 4)),
        (2, 3.0, "refused [(1, 'h1'), (3, 'h3')]", (1, 3)),
        (4, 3.0, "refused [(2, 'h2')]", None),  # a post-hoc step asks every client
    ]


@needs_accountant
def test_a_resume_names_the_releases_after_its_checkpoint_whose_noise_cannot_be_replayed(
        experiment_factory, tmp_path):
    """The ledger holds fedpac releases the checkpoint (none here) does not account for: those with noise
    from the operating system are named with their rounds (run again, they release fresh noise and both
    count); seeded ones are replayed as they were and are not."""
    written = PrivacyLedger(tmp_path)
    for round_, source in [(1, "seed"), (2, "os"), (3, "seed"), (4, "os")]:
        written.record("fedpac", round_, Release(2.0, f"r{round_}", source))
    exp, reporter = experiment_factory(), Reporter()
    ledger = exp.open_ledger(tmp_path, None, reporter)
    assert len(ledger.entries) == 4
    assert reporter.notes == [
        "privacy: 2 release(s) of fedpac (round(s) 2, 4) reached the server after the last checkpoint; their "
        "noise came from the operating system, so the rounds run again release fresh noise and every release "
        "counts: the epsilon reported (summary.json privacy.epsilon) will exceed the target"]
    seeded = tmp_path / "seeded"
    seeded.mkdir()
    PrivacyLedger(seeded).record("fedpac", 1, Release(2.0, "r1", "seed"))
    experiment_factory().open_ledger(seeded, None, quiet := Reporter())
    assert quiet.notes == []


@needs_accountant
def test_a_round_released_twice_under_one_seeded_noise_makes_every_reported_epsilon_inf_said_once(
        experiment_factory):
    exp, reporter = experiment_factory(), Reporter()
    line = {"dp_epsilon": 3.0, "dp_epsilon_per_upload": 5.0}
    exp.mark_reused_noise(line, reporter)  # no ledger (pieces driven without run()): nothing to mark
    assert line == {"dp_epsilon": 3.0, "dp_epsilon_per_upload": 5.0} and reporter.notes == []
    exp.ledger = PrivacyLedger()
    for round_, digest in [(1, "a"), (1, "a'"), (2, "b"), (3, "c"), (3, "c'")]:
        exp.ledger.record("fedpac", round_, Release(2.0, digest, "seed"))
    assert exp.ledger.reused_seeded_noise() == [1, 3]

    line = {"dp_epsilon": 3.0, "dp_epsilon_per_upload": 5.0}
    exp.mark_reused_noise(line, reporter)
    assert line == {"dp_epsilon": math.inf, "dp_epsilon_per_upload": math.inf, "dp_noise_reused_rounds": [1, 3]}
    assert reporter.notes == [
        "privacy: round(s) 1, 3 reached the server twice with different content and the same noise, drawn from "
        "the run's seed (dp_noise_source = 'seed'): their difference carries no noise, so no finite epsilon "
        "holds (summary.json privacy.epsilon = inf); runs meant to protect data use dp_noise_source = 'os'"]

    exp.ledger.record("fedpac", 2, Release(2.0, "b'", "seed"))  # a later round reused too: marked, not said again
    whole_only = {"dp_epsilon": 3.0}  # a method that reports no per-upload epsilon (a secure sum's)
    exp.mark_reused_noise(whole_only, reporter)
    assert whole_only == {"dp_epsilon": math.inf, "dp_noise_reused_rounds": [1, 2, 3]}
    assert len(reporter.notes) == 1
    no_privacy = {"global_acc": 0.5}
    exp.mark_reused_noise(no_privacy, reporter)
    assert no_privacy == {"global_acc": 0.5}
