"""Tensors <-> Flower records, bit-exact.

A dict of tensors travels as one ``ArrayRecord``. Tensors of a dtype NumPy has go the standard
way (``Array`` from a NumPy array, ``stype = "numpy.ndarray"``: readable by any Flower tool, e.g.
``ArrayRecord.to_torch_state_dict``); others (bfloat16, float8 ...) as their raw bytes with
``stype = "hetfl.torch"`` and the torch dtype's name. Either way the bytes of every element are
kept: decoding gives back a tensor ``torch.equal`` to the original with the same dtype and shape
(NaN payloads and signed zeros included).
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from hetfl.privacy import release_digest

Tensors = dict[str, torch.Tensor]
RAW_STYPE = "hetfl.torch"
NUMPY_STYPE = "numpy.ndarray"

_NUMPY_DTYPES = {
    torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128,
}


def encode_tensor(t: torch.Tensor) -> Array:
    t = t.detach().cpu()
    if t.dtype in _NUMPY_DTYPES:
        buffer = io.BytesIO()
        np.save(buffer, t.contiguous().numpy(), allow_pickle=False)
        return Array(dtype=str(t.numpy().dtype), shape=tuple(t.shape), stype=NUMPY_STYPE, data=buffer.getvalue())
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return Array(dtype=str(t.dtype), shape=tuple(t.shape), stype=RAW_STYPE, data=data)


def decode_tensor(a: Array, device: torch.device | str = "cpu") -> torch.Tensor:
    """``a`` as a tensor in memory torch allocated for it: aligned as torch aligns its own tensors (a
    CPU kernel's rounding can depend on the address, :func:`hetfl.engine.checkpoint.load_tensors`), so
    that a client computes on what it received exactly as on the sender's tensor."""
    if a.stype == NUMPY_STYPE:
        t = torch.tensor(np.load(io.BytesIO(a.data), allow_pickle=False))  # a copy (np.load's is read-only)
    elif a.stype == RAW_STYPE:
        dtype = getattr(torch, a.dtype.removeprefix("torch."))
        raw = torch.empty(len(a.data), dtype=torch.uint8)
        raw.numpy()[:] = np.frombuffer(a.data, dtype=np.uint8)
        t = raw.view(dtype).reshape(tuple(a.shape))
    else:
        raise ValueError(f"array of unknown serialisation {a.stype!r}")
    return t.to(device)


def to_record(tensors: Tensors) -> ArrayRecord:
    return ArrayRecord({name: encode_tensor(t) for name, t in tensors.items()})


def from_record(record: ArrayRecord | None, device: torch.device | str = "cpu") -> Tensors:
    if record is None:
        return {}
    return {name: decode_tensor(a, device) for name, a in record.items()}


def record_nbytes(records: Iterable[ArrayRecord]) -> int:
    """Bytes of the arrays' serialised data in ``records`` (what travels, headers included)."""
    return sum(len(a.data) for r in records for a in r.values())


def client_data_digest(data: Any, client: int) -> str:
    """A digest of the samples ``client`` holds in ``data`` (a :class:`~hetfl.engine.data.FederatedData`):
    its training split and its test split, images and labels, dtypes and shapes. A node sends it with every
    reply and the server compares it with its own: the split is defined over the dataset by the config's
    seed, so a node whose ``data-root`` holds other files (another dataset in the same format, a corrupted
    or reordered copy) would otherwise train on other samples under the same client's name, unnoticed
    wherever the client's sample count does not depend on the data (IID, fixed samples per client)."""
    train_x, train_y = data.client_train_split(client)
    test = data.client_tests[client]
    named = (("train.x", train_x), ("train.y", train_y), ("test.x", test.x), ("test.y", test.y))
    return release_digest(named)[:32]
