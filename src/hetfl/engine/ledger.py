"""The privacy ledger: ``privacy_ledger.json`` in a run directory, every differentially private release
the server received, recorded durably BEFORE the server uses it.

Why. A checkpoint is taken every ``runtime.checkpoint_every`` rounds; a run killed between a release
and the next checkpoint is resumed from the checkpoint and makes the lost rounds' releases again. The
server saw the first ones: with noise from the operating system (``dp_noise_source = "os"``) the new
releases carry fresh noise and spend budget again (10 releases where 8 were planned: epsilon 4.55 for a
target of 4), which a budget kept only in the checkpoint would not count.

What. One entry per release, in the order the server received them: the method's name, the round,
the noise multiplier the method accounts it with, the noise source, a SHA-256 digest of what the
server received and the clients the phase asked (:class:`hetfl.privacy.Release`: a client counts the
releases it was asked in). The file is rewritten whole for each release
(temporary file, fsync, rename, fsync of the folder), so a kill at any moment leaves the previous or
the new ledger, and a release is on disk before its result is used.

How a resumed run accounts. A release identical (same method, round and digest) to one in the ledger
is a *replay*: seeded noise on the same data gives the same numbers, which reveal nothing new; it is
not recorded again. Any other release is appended, and every entry counts: a method reports, with each
release, the budget of the ledger's releases of that method that the server had received by that round
(:meth:`PrivacyLedger.record`), so by the last round every release in the ledger is counted and the
reported epsilon is never below what the server received. A replay of an uninterrupted history reports
what the uninterrupted run did (the run's numbers are its numbers); after an earlier resume that released
some rounds differently (a client's reply lost the second time), a replay also counts those releases, up
to its round. The checkpoint's own list is checked against the ledger when a run resumes: a ledger that
lacks any of the checkpoint's releases cannot say what was spent, and the resume is refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hetfl.engine.rundir import RunDirError
from hetfl.files import atomic_write_text, fsync_path
from hetfl.privacy import Release

LEDGER_NAME = "privacy_ledger.json"
LEDGER_VERSION = 1


@dataclass(frozen=True)
class Entry:
    """One release in the ledger. ``clients``: those its phase asked (:attr:`hetfl.privacy.Release.clients`;
    None in a ledger written before hetfl recorded them: every client); ``uploads``: the digest of each client's
    upload in it, where the server saw each (:attr:`hetfl.privacy.Release.uploads`; None: not known). Neither is
    part of what makes two entries the same release (a replay of an entry written without them is a replay)."""

    method: str
    round: int
    multiplier: float
    noise_source: str
    digest: str
    clients: tuple[int, ...] | None = field(default=None, compare=False)
    uploads: dict[int, str] | None = field(default=None, compare=False)


class PrivacyLedger:
    """``privacy_ledger.json`` of one run directory (created by the first release; none for a run without
    differential privacy); ``run_dir = None``: a ledger kept in memory (pieces of a run driven by hand)."""

    def __init__(self, run_dir: Path | None = None) -> None:
        self.path = None if run_dir is None else Path(run_dir) / LEDGER_NAME
        self.entries: list[Entry] = read_entries(self.path) if self.path and self.path.exists() else []

    def multipliers(self, method: str) -> list[float]:
        """The multipliers of every release of ``method`` in the ledger, in order."""
        return [e.multiplier for e in self.entries if e.method == method]

    def released(self, method: str, round_: int) -> bool:
        """Whether the ledger holds a release of ``method`` in round ``round_`` (a resumed run's lost round)."""
        return any(e.method == method and e.round == round_ for e in self.entries)

    def record(self, method: str, round_: int, release: Release) -> list[Entry]:
        """Record ``release`` (durably, before the caller uses it) unless it replays one already in the ledger;
        returns the releases of ``method`` it adds to: every release of ``method`` before it in the ledger,
        and, for a replay, those after it that belong to rounds up to ``round_`` (made by an earlier resume
        that released those rounds differently: the server received them). A replay does not count the later
        rounds of its own history, which it will replay (or, released differently, append) when it gets
        there."""
        clients = None if release.clients is None else tuple(sorted(int(c) for c in release.clients))
        uploads = None if release.uploads is None else {int(c): str(d) for c, d in sorted(release.uploads.items())}
        entry = Entry(method, round_, float(release.multiplier), release.noise_source, release.digest, clients,
                      uploads)
        if entry not in self.entries:
            self.entries.append(entry)
            self.write()
            return [e for e in self.entries[:-1] if e.method == method]
        position = self.entries.index(entry)  # a replay: the very numbers the server already received
        return [e for i, e in enumerate(self.entries)
                if e.method == method and i != position and (i < position or e.round <= round_)]

    def entry(self, method: str, round_: int, release: Release) -> Entry:
        """The ledger's entry for ``release`` (recorded): the one it replays, if it is a replay."""
        probe = Entry(method, round_, float(release.multiplier), release.noise_source, release.digest)
        return self.entries[self.entries.index(probe)]

    def reused_seeded_noise(self) -> list[int]:
        """The rounds in which a method released twice with noise drawn from the run's seed
        (``dp_noise_source = "seed"``) and different content: the noise of a (method, round, client) is the
        same in both, so their difference reaches the server without noise, and no finite epsilon holds.
        A replay (same digest) is no such pair. Where every such release of the round says what each client
        uploaded (``Entry.uploads``: the server saw each upload), the pair is a client's: two releases that
        differ only in who is in them (a phase stopped with some replies, then run again with all) carry each
        client's same upload, nothing new; one client's two different uploads are the noiseless difference."""
        seeded: dict[tuple[str, int], list[Entry]] = {}
        for e in self.entries:
            if e.noise_source == "seed":
                seeded.setdefault((e.method, e.round), []).append(e)
        return sorted({r for (_, r), entries in seeded.items() if _differ_under_one_noise(entries)})

    def after(self, method: str, recorded: int) -> list[Entry]:
        """The ledger's releases of ``method`` beyond the ``recorded`` a checkpoint accounts for (made after it,
        before the run stopped): its last ones."""
        mine = [e for e in self.entries if e.method == method]
        return mine[min(recorded, len(mine)):]

    def check_covers(self, method: str, recorded: list[float]) -> None:
        """A RunDirError unless the ledger holds every release a checkpoint accounts for (``recorded``, the
        multipliers in its server state; each matched by a release of its own, wherever it lies: a replay
        after an earlier resume counts releases of that resume): a ledger that lost any of them cannot say
        what was spent."""
        held = self.multipliers(method)
        unmatched = list(held)
        matched = 0
        for multiplier in recorded:
            found = next((i for i, m in enumerate(unmatched) if math.isclose(m, multiplier, rel_tol=1e-12)), None)
            if found is not None:
                unmatched.pop(found)
                matched += 1
        if matched < len(recorded):
            raise RunDirError(f"{self.path}: the checkpoint accounts for {len(recorded)} differentially private "
                              f"release(s) of {method} but the privacy ledger holds {matched} matching ones (of "
                              f"{len(held)}); without it the budget spent cannot be known, so the run is not resumed "
                              "(start a new run)")

    def write(self) -> None:
        """The whole ledger, atomically and durably (temporary file, fsync, rename, fsync of the folder)."""
        if self.path is None:
            return
        doc = {"version": LEDGER_VERSION, "releases": [asdict(e) for e in self.entries]}
        atomic_write_text(self.path, json.dumps(doc, indent=1) + "\n")
        fsync_path(self.path.parent)


def _differ_under_one_noise(entries: list[Entry]) -> bool:
    """Whether releases of one method and round, all under the same seeded noise, hold two different contents
    under it: different digests, and, where each names its clients' uploads, one client with two."""
    if len({e.digest for e in entries}) < 2:
        return False
    if any(e.uploads is None for e in entries):
        return True  # what differs cannot be told apart by client: take it as the noiseless difference
    seen: dict[int, str] = {}
    for e in entries:
        for client, digest in e.uploads.items():  # type: ignore[union-attr]
            if seen.setdefault(client, digest) != digest:
                return True
    return False


def read_entries(path: Path) -> list[Entry]:
    """The entries of a ledger file; a RunDirError naming the file if it cannot be read as one."""
    try:
        doc: Any = json.loads(path.read_text())
        if doc.get("version") != LEDGER_VERSION:
            raise ValueError(f"version {doc.get('version')!r}, expected {LEDGER_VERSION}")
        return [Entry(str(e["method"]), int(e["round"]), float(e["multiplier"]), str(e["noise_source"]),
                      str(e["digest"]), None if e.get("clients") is None else tuple(int(c) for c in e["clients"]),
                      None if e.get("uploads") is None else {int(c): str(d) for c, d in e["uploads"].items()})
                for e in doc["releases"]]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        raise RunDirError(f"{path}: not a readable privacy ledger ({err}); the budget spent cannot be "
                          "known, so the run is not resumed") from None


__all__ = ["LEDGER_NAME", "Entry", "PrivacyLedger"]
