"""The checkpoint's round trip, by hand (session 38, mutation testing of hetfl.engine.checkpoint): every tensor
back under its scope and name, in the order it was saved, in memory of its own, the round and info, and the
refusals of a foreign, damaged or inconsistent file."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from hetfl.algorithms.base import ServerState
from hetfl.engine.checkpoint import (
    CHECKPOINT_NAME,
    FORMAT_VERSION,
    Checkpoint,
    CheckpointError,
    load_checkpoint,
    load_tensors,
    save_checkpoint,
    save_tensors,
)

CPU = torch.device("cpu")


def _ckpt() -> Checkpoint:
    g = torch.Generator().manual_seed(0)
    server = ServerState(model={"z.w": torch.randn(3, 2, generator=g), "a.b": torch.randn(4, generator=g)},
                         extra={"m": torch.randn(2, generator=g).t(), "c": torch.tensor(7)})
    clients = {3: {"y": torch.randn(2, 3, generator=g).t()}, 1: {"x": torch.arange(5.0), "a": torch.ones(1)}}
    return Checkpoint(round=12, server=server, clients=clients, info={"fingerprint": "abc", "n": [1, 2]})


def test_a_checkpoint_comes_back_as_it_was_saved_in_its_order(tmp_path):
    ck = _ckpt()
    save_checkpoint(tmp_path, ck)
    assert (tmp_path / CHECKPOINT_NAME).exists()
    assert not [p for p in tmp_path.iterdir() if p.name != CHECKPOINT_NAME]  # no temp file left
    back = load_checkpoint(tmp_path, CPU)
    assert back.round == 12 and back.info == {"fingerprint": "abc", "n": [1, 2]}
    assert list(back.server.model) == ["z.w", "a.b"] and list(back.server.extra) == ["m", "c"]
    assert list(back.clients) == [3, 1] and list(back.clients[1]) == ["x", "a"]
    for want, got in [(ck.server.model, back.server.model), (ck.server.extra, back.server.extra),
                      (ck.clients[3], back.clients[3]), (ck.clients[1], back.clients[1])]:
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k])
            assert got[k].data_ptr() % 64 == 0  # memory torch allocated, not the file's 8-byte offsets


def test_another_file_name_and_a_missing_checkpoint(tmp_path):
    assert load_checkpoint(tmp_path, CPU) is None
    save_checkpoint(tmp_path, _ckpt(), filename="trained.safetensors")
    assert load_checkpoint(tmp_path, CPU) is None
    assert load_checkpoint(tmp_path, CPU, filename="trained.safetensors").round == 12


def test_load_tensors_copies_every_tensor_into_aligned_memory(tmp_path):
    path = tmp_path / "t.safetensors"
    save_tensors(path, {"a": torch.arange(3.0), "b": torch.arange(6.0).reshape(2, 3).t()}, {"k": "v"})
    got = load_tensors(path)
    assert torch.equal(got["b"], torch.arange(6.0).reshape(2, 3).t())
    assert all(t.data_ptr() % 64 == 0 for t in got.values())
    assert [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]


def test_a_failed_write_leaves_no_temp_file(tmp_path):
    with pytest.raises(Exception):  # noqa: B017 - safetensors refuses tensors that share memory
        save_tensors(tmp_path / "t.safetensors", {"a": torch.ones(2), "b": object()})
    assert list(tmp_path.iterdir()) == []


def _raw(tmp_path, tensors, **meta):
    base = {"format": str(FORMAT_VERSION), "round": "2", "info": "{}"}
    base.update(meta)
    save_file(tensors, str(tmp_path / CHECKPOINT_NAME), metadata={k: v for k, v in base.items() if v is not None})


def test_refusals_name_the_file_and_the_fault(tmp_path):
    _raw(tmp_path, {"server.model/w": torch.ones(1)}, format="2")
    with pytest.raises(CheckpointError, match=r"format '2', expected 1"):
        load_checkpoint(tmp_path, CPU)
    _raw(tmp_path, {"server.model/w": torch.ones(1)}, order=json.dumps(["server.model/v"]))
    with pytest.raises(CheckpointError, match=r"corrupt or not a hetfl checkpoint \(ValueError: its tensors are "
                                              r"not the ones its metadata lists\); delete it to restart the run "
                                              r"from round 1$"):
        load_checkpoint(tmp_path, CPU)
    _raw(tmp_path, {"server.model/w": torch.ones(1)}, round=None)
    with pytest.raises(CheckpointError, match="KeyError"):
        load_checkpoint(tmp_path, CPU)
    _raw(tmp_path, {"other/w": torch.ones(1)})
    with pytest.raises(CheckpointError, match="unexpected tensor 'other/w'"):
        load_checkpoint(tmp_path, CPU)
    (tmp_path / CHECKPOINT_NAME).write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=r"\); delete it to restart the run from round 1$"):
        load_checkpoint(tmp_path, CPU)


def test_a_checkpoint_without_an_order_is_read_in_the_files_order(tmp_path):
    _raw(tmp_path, {"server.model/b": torch.ones(1), "server.model/a": torch.zeros(1),
                    "client.2/s": torch.full((1,), 2.0)})
    back = load_checkpoint(tmp_path, CPU)
    assert back.round == 2 and back.info == {}
    assert list(back.server.model) == ["a", "b"] and torch.equal(back.clients[2]["s"], torch.full((1,), 2.0))


def test_names_with_a_slash_keep_it(tmp_path):
    """A tensor's scope is what comes before its name's first "/": a state name may hold one itself."""
    ck = Checkpoint(round=1, server=ServerState(model={"block/w": torch.ones(1)}, extra={"a/b/c": torch.zeros(1)}),
                    clients={0: {"x/y": torch.full((1,), 3.0)}}, info={})
    save_checkpoint(tmp_path, ck)
    back = load_checkpoint(tmp_path, CPU)
    assert list(back.server.model) == ["block/w"] and list(back.server.extra) == ["a/b/c"]
    assert list(back.clients[0]) == ["x/y"]


def test_tensors_are_loaded_onto_the_device_asked_for(tmp_path):
    """The "meta" device stands for a GPU here: not the CPU, so each tensor is moved there."""
    save_checkpoint(tmp_path, _ckpt())
    back = load_checkpoint(tmp_path, torch.device("meta"))
    assert {t.device.type for t in back.server.model.values()} == {"meta"}
    assert {t.device.type for s in back.clients.values() for t in s.values()} == {"meta"}


def test_the_temp_file_is_hidden_beside_the_target_and_removed_when_the_write_fails(tmp_path, monkeypatch):
    import hetfl.engine.checkpoint as checkpoint

    seen = []

    def failing_save(tensors, filename, metadata=None):
        seen.append(filename)
        with open(filename, "wb") as fh:
            fh.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_tensors(tmp_path / "trained.safetensors", {"a": torch.ones(2)})
    (tmp,) = seen
    name = tmp.rsplit("/", 1)[-1]
    assert tmp.startswith(str(tmp_path) + "/") and name.startswith(".trained.safetensors.") and name.endswith(".tmp")
    assert list(tmp_path.iterdir()) == []
