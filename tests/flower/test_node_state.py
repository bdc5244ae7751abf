"""A client's state on its Flower node (:class:`hetfl.flower.node.StateStore`): which version a message of round r
starts from, what is pruned and what a resume still needs, and the kept state against the server's initial one.
Node code called directly, no Ray, no processes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("flwr", reason='Flower is not installed: pip install "hetfl[flower]"')

import torch
from flwr.app import RecordDict

from hetfl.flower import node
from hetfl.flower import protocol as P
from hetfl.flower.codec import to_record
from hetfl.flower.node import NodeError, StateStore
from tests.flower.test_flower_node_trust import context, header

SESSION = "a1b2c3d4e5f6"


def store(ctx, state_dir: Path | None = None, **h) -> StateStore:
    if state_dir is not None:
        ctx.node_config["state-dir"] = str(state_dir)
    return StateStore(ctx, header(**h), 0, "cpu")


def weight(state: dict | None) -> float | None:
    return None if state is None else float(state["w"][0])


def files(state_dir: Path) -> list[str]:
    folder = state_dir / "0123456789abcdef" / "client_0000"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_a_round_starts_from_the_version_before_it_also_when_asked_again(tmp_path):
    """A round asked again (a resumed server, a lost reply) must not start from what the node wrote in that
    very round: version r serves messages of rounds after r only. A node restarted within the session (a new
    context, the same state folder) reads the same versions from its files."""
    s = store(context(), tmp_path)
    for version in (1, 2):
        s.save({"w": torch.full((2,), float(version))}, version)
    assert [weight(s.load(r)) for r in (1, 2, 3)] == [None, 1.0, 2.0]
    restarted = store(context(), tmp_path)  # this session's versions after its checkpoint (start 0) are valid
    assert [weight(restarted.load(r)) for r in (1, 2, 3)] == [None, 1.0, 2.0]


def test_a_version_the_server_did_not_count_is_skipped():
    """A straggler's version of round 3, written after the server went on without it (state-round 2)."""
    s = store(context(), **{"state-round": 2})
    for version in (1, 2, 3):
        s.save({"w": torch.full((2,), float(version))}, version)
    assert weight(s.load(4)) == 2.0


def test_what_a_resume_needs_is_kept_and_older_versions_are_pruned(tmp_path):
    """The folder keeps the newest version up to the server's last checkpoint (committed round 2: a resume goes
    back to it) and those after; Flower's context (a new one for every resume) only the newest the server
    counts."""
    s = store(context(), tmp_path, committed=2)
    for version in (1, 2, 3, 4):
        s.save({"w": torch.full((2,), float(version))}, version)
    assert files(tmp_path) == [f"round_{v:05d}-{SESSION}.safetensors" for v in (2, 3, 4)]
    assert s._kept() == [(4, SESSION)]
    assert sorted(k for k in s.context.state if ".state." in k) == [f"hetfl.0123456789abcdef.0.state.4-{SESSION}"]


def test_a_version_an_earlier_session_wrote_after_the_checkpoint_is_dropped(tmp_path):
    """The server resumed from round 2's checkpoint: the old session's version 3 (its round 3 was never
    committed) is neither used nor kept; the new session's own version 3 is."""
    ctx = context()
    old = store(ctx, tmp_path, session="0000000000aa")
    for version in (1, 2, 3):
        old.save({"w": torch.full((2,), 10.0 + version)}, version)
    new = store(ctx, tmp_path, start=2, committed=2)
    assert weight(new.load(4)) == 12.0  # the old session's version 2, before the checkpoint
    new.save({"w": torch.full((2,), 3.0)}, 3)
    assert new._kept() == [(3, SESSION)]
    assert weight(new.load(4)) == 3.0
    assert "round_00003-0000000000aa.safetensors" not in files(tmp_path)


def test_the_kept_state_or_the_servers_initial_one_or_a_refusal_in_words():
    s = store(context())
    init = SimpleNamespace(content=RecordDict({P.INIT: to_record({"w": torch.zeros(2)})}))
    state, kept = node.client_state(s, init, 2, "cpu")
    assert (weight(state), kept) == (0.0, False)
    s.save({"w": torch.ones(2)}, 1)
    state, kept = node.client_state(s, init, 2, "cpu")
    assert (weight(state), kept) == (1.0, True)
    with pytest.raises(NodeError) as info:
        node.client_state(store(context()), SimpleNamespace(content=RecordDict({})), 2, "cpu")
    assert str(info.value) == ("client 0: the server expects this node to hold the client's state, and it has none "
                               "(node restarted without a state-dir?)")


def test_a_header_of_an_older_server_without_state_round_refuses_no_version():
    s = store(context())
    s.save({"w": torch.full((2,), 200.0)}, 200)
    assert weight(s.load(201)) == 200.0


def test_the_state_and_the_shared_tensors_arrive_on_the_nodes_device(tmp_path):
    """Kept state (from Flower's context or, after a restart, from the state folder), the server's initial state
    and the shared tensors go to the device the node trains on (PyTorch's ``meta`` device stands in for a GPU:
    a tensor left on the CPU shows)."""
    s = store(context(), tmp_path)
    s.save({"w": torch.ones(2)}, 1)
    on_meta = StateStore(s.context, header(), 0, "meta")
    assert on_meta.load(2)["w"].device.type == "meta"  # from the context
    assert StateStore(context(**{"state-dir": str(tmp_path)}), header(), 0, "meta").load(2)["w"].is_meta  # files
    init = SimpleNamespace(content=RecordDict({P.INIT: to_record({"w": torch.zeros(2)})}))
    assert node.client_state(StateStore(context(), header(), 0, "meta"), init, 2, "meta")[0]["w"].is_meta
    shared = SimpleNamespace(content=RecordDict({P.SHARED: to_record({"m": torch.zeros(2)})}))
    ctx = context()
    assert node.shared_tensors(shared, ctx, header(), "meta")["m"].is_meta
    kept = SimpleNamespace(content=RecordDict({}))  # a later message: the shared tensors kept from the first
    assert node.shared_tensors(kept, ctx, header(), "meta")["m"].is_meta
