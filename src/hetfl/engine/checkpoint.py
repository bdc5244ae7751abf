"""Checkpoints: one safetensors file per run, replaced atomically.

Tensors (server model, server method state, every client's persistent state)
are stored as safetensors; everything else (round, wall time, a fingerprint of
the config) as JSON in the safetensors header's metadata. One file means one
atomic ``os.replace``: a kill at any moment leaves either the previous or the
new checkpoint, never a mix. RNG states need no saving: every stream is
derived from ``(seed, round, client)`` (see :mod:`hetfl.rng`).

A resumed run is the uninterrupted one to the bit, so a checkpoint gives back
the state as it was in memory: the values, the order of every dict (a
safetensors file lists its tensors sorted by name; the order they were saved in
is kept in the metadata, ``order``), and memory of each tensor's own
(:func:`load_tensors`). Code may read a dict's order (the batched personalised
evaluation once refused states of another order), and CPU kernels round by a
tensor's address: either difference once made resumed rounds 1e-8 apart from
uninterrupted ones.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from hetfl.algorithms.base import ServerState, Tensors
from hetfl.files import follow_umask, fsync_path

CHECKPOINT_NAME = "checkpoint.safetensors"
#: the model and client states after the last round's training, before the post-hoc steps (CCVR's
#: calibration) changed them, with that round's training metrics: another run that differs only in its
#: post-hoc settings starts from it instead of training again (``Experiment.run(..., trained=...)``)
TRAINED_NAME = "trained.safetensors"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint cannot be used (corrupt, from another config, another version)."""


@dataclass
class Checkpoint:
    round: int
    server: ServerState
    clients: dict[int, Tensors]
    info: dict[str, Any]


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` to a safetensors file atomically (temp file + rename; mode as the umask says)."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        follow_umask(tmp)  # after the write: the mode mkstemp gave may be the one save_file keeps
        fsync_path(tmp)  # the bytes on disk before the rename makes them the file (a power loss)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)  # and the rename itself, as metrics.jsonl's lines are


def load_tensors(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A safetensors file's tensors on ``device``, each in memory torch allocated for it.

    ``safetensors`` gives CPU tensors that lie at their offsets in the file's bytes, 8-byte aligned,
    where torch aligns what it allocates to 64 bytes. A CPU's vectorised kernels choose their path by a
    tensor's address: a matrix-vector product with an unaligned weight rounds differently (by up to 8e-6
    for a 4096 x 100 weight on the development CPU). A run resumed from such tensors would then not be
    the uninterrupted run to the bit (pFedHN's generated models were 1e-8 apart after one round), so
    every tensor is copied once (a CUDA device's copy is its upload)."""
    tensors = load_file(str(path))
    if torch.device(device).type == "cpu":
        return {k: v.clone() for k, v in tensors.items()}
    return {k: v.to(device) for k, v in tensors.items()}


def save_checkpoint(run_dir: Path, ckpt: Checkpoint, filename: str = CHECKPOINT_NAME) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for name, t in ckpt.server.model.items():
        tensors[f"server.model/{name}"] = t
    for name, t in ckpt.server.extra.items():
        tensors[f"server.extra/{name}"] = t
    for cid, state in ckpt.clients.items():
        for name, t in state.items():
            tensors[f"client.{cid}/{name}"] = t
    meta = {"format": str(FORMAT_VERSION), "round": str(ckpt.round), "info": json.dumps(ckpt.info),
            "order": json.dumps(list(tensors))}
    save_tensors(run_dir / filename, tensors, meta)


def load_checkpoint(run_dir: Path, device: torch.device, filename: str = CHECKPOINT_NAME) -> Checkpoint | None:
    """The run's checkpoint (or its file ``filename``), or None if it has none yet."""
    path = run_dir / filename
    if not path.exists():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
        tensors = load_tensors(path, device)
        if meta.get("format") != str(FORMAT_VERSION):
            raise CheckpointError(f"{path}: checkpoint format {meta.get('format')!r}, expected {FORMAT_VERSION}")
        round_ = int(meta["round"])
        info = json.loads(meta["info"])
        if "order" in meta:  # the order the tensors were saved in (a checkpoint of before session 22 has none)
            order = json.loads(meta["order"])
            if sorted(order) != sorted(tensors):
                raise ValueError("its tensors are not the ones its metadata lists")
            tensors = {k: tensors[k] for k in order}
    except CheckpointError:
        raise
    except (SafetensorError, OSError, KeyError, ValueError, json.JSONDecodeError) as err:
        raise CheckpointError(
            f"{path} is corrupt or not a hetfl checkpoint ({type(err).__name__}: {err}); "
            "delete it to restart the run from round 1"
        ) from None
    server = ServerState(model={}, extra={})
    clients: dict[int, Tensors] = {}
    for key, t in tensors.items():
        scope, _, name = key.partition("/")
        if scope == "server.model":
            server.model[name] = t
        elif scope == "server.extra":
            server.extra[name] = t
        elif scope.startswith("client."):
            clients.setdefault(int(scope.removeprefix("client.")), {})[name] = t
        else:
            raise CheckpointError(f"{path}: unexpected tensor {key!r}; delete it to restart the run")
    return Checkpoint(round=round_, server=server, clients=clients, info=info)
