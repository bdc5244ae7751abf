"""Secure aggregation of an additive post-hoc step's replies (CCVR's moments): the fixed-point codec,
and its simulation in one process.

Secure aggregation (Flower's SecAgg+, Bell et al. CCS 2020) sums vectors of integers modulo ``M``
so that the server learns the sum and nothing else. A reply of floats therefore goes through a
fixed-point code, the same one in this process (:func:`simulate`) and on Flower
(``hetfl.flower.secagg``), so that both give the same sum bit for bit:

encoding (each client, each entry ``v`` of tensor ``name``, public bound ``b = bounds[name]``)
    ``u = clamp(v / b, -1, 1)`` (entries with ``|v| > b`` are *clipped*, and counted; a NaN is
    counted and encoded as 0), then ``j = round((u + 1) * T / 2)``, an integer in ``[0, T]``
    (round half to even: deterministic, no random rounding).
sum
    ``S = sum_i j_i`` over the ``n`` clients summed, exact: ``n * T < M`` (:func:`quantization_range`).
decoding
    ``b * (2 S / T - n)``: the sum of the clients' decoded entries ``b * (2 j_i / T - 1)``.

Quantisation error: ``|j - (u + 1) T / 2| <= 1/2``, so each client's decoded entry is within
``b / T`` of its clipped value (half a grid step, ``2 b / T``), and the decoded sum within
``n * b / T`` of the plain sum of the clipped values (plus float64 rounding, ~1e-16 relative). With
``M = 2**32`` and 10 clients ``T = 2**28``: ``b / T`` is 3.7e-9 of the bound.

On Flower's grid. Flower's SecAgg+ client quantises floats itself (``quantize``: clip to
``[-c, c]``, scale by ``T / (2 c)``, *stochastic* rounding from NumPy's global random state). A
client here hands it the float ``x = j * 2 c / T - c`` (:func:`to_grid`) with ``c``
(:data:`CLIPPING_RANGE`) and ``T`` powers of two: ``x`` is exact in float64 and
``(x + c) * T / (2 c)`` is the integer ``j`` again, so stochastic rounding has nothing to round and
Flower sums exactly the integers of this code. Flower's server returns the sum as a weighted
average over the ``n`` survivors; :func:`from_grid_average` recovers ``S`` from it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hetfl.algorithms.base import Tensors
from hetfl.algorithms.posthoc import SummedReplies
from hetfl.params import ConfigError

#: Flower's ``clipping_range`` ``c``: the half-width of the float grid handed to SecAgg+ (a power of
#: two, so that the grid's points are exact floats; any power of two gives the same integers)
CLIPPING_RANGE = 1.0
#: Flower's ``modulus_range`` ``M`` (its default): masks and sums are taken modulo it
MODULUS_RANGE = 2**32
#: the largest ``T`` Flower can take: its ``quantize`` casts the quantised values to int32
MAX_QUANTIZATION_RANGE = 2**30
#: bytes of one entry of a client's upload: Flower's masked vectors are int64
ENTRY_BYTES = 8


def quantization_range(num_clients: int, modulus: int = MODULUS_RANGE) -> int:
    """``T``: the largest power of two with ``num_clients * T < modulus`` (the sum of every client's
    integers in ``[0, T]``, and of Flower's per-client weight factor ``T``, never wraps) and
    ``T <= 2**30``. Fixed by the number of clients asked, before anyone answers."""
    if num_clients < 1:
        raise ValueError(f"secure aggregation needs at least one client, not {num_clients}")
    t = 1 << (((modulus - 1) // num_clients).bit_length() - 1)
    if t < 2:
        raise ValueError(f"{num_clients} clients do not fit a modulus of {modulus}")
    return min(t, MAX_QUANTIZATION_RANGE)


@dataclass(frozen=True)
class Encoded:
    """One client's reply in fixed point: ``values`` (int64 in ``[0, T]``, the dense reply's names and
    shapes) and ``clipped``, how many of its entries were beyond their bound."""

    values: Tensors
    clipped: int


def encode(dense: Tensors, bounds: dict[str, float], levels: int) -> Encoded:
    """A dense reply (``PostHoc.dense_reply``) on the grid of ``levels`` = ``T`` steps: see the module's
    docstring. ``bounds``: the public bound of each tensor's entries (``PostHoc.reply_bounds``)."""
    values, clipped = {}, 0
    for name in sorted(dense):
        bound = float(bounds[name])
        u = dense[name].detach().to("cpu", torch.float64) / bound
        nan = torch.isnan(u)
        clipped += int((u.abs() > 1).sum()) + int(nan.sum())
        u = torch.where(nan, torch.zeros_like(u), u.clamp(-1.0, 1.0))
        values[name] = torch.round((u + 1.0) * (levels / 2)).to(torch.int64)
    return Encoded(values, clipped)


def sum_encoded(replies: list[Encoded]) -> Encoded:
    """The integers of several clients added (what secure aggregation gives the server)."""
    if not replies:
        raise ValueError("no replies to sum")
    names = list(replies[0].values)
    values = {k: torch.stack([r.values[k] for r in replies]).sum(0) for k in names}
    return Encoded(values, sum(r.clipped for r in replies))


def decode_sum(sums: Tensors, bounds: dict[str, float], count: int, levels: int) -> Tensors:
    """The sum of ``count`` clients' decoded replies from the sum ``sums`` of their integers (float64):
    ``b * (2 S / T - n)``, within ``count * b / T`` of the plain sum of their clipped values."""
    return {k: float(bounds[k]) * (s.to(torch.float64) * (2.0 / levels) - count) for k, s in sums.items()}


@dataclass(frozen=True)
class SecureSum(SummedReplies):
    """What the server learns from a secure-aggregation round: the decoded sum ``total`` of
    ``clients``' dense replies, how many entries were clipped over all of them, and the bytes each
    client uploaded (:func:`upload_bytes`)."""

    clipped: int = 0
    bytes_per_client: int = 0


def upload_bytes(values: Tensors) -> int:
    """Bytes of one client's masked vector on Flower's SecAgg+ (int64 entries): the reply's entries,
    the clipped-entry count and Flower's weight factor."""
    return ENTRY_BYTES * (sum(t.numel() for t in values.values()) + 2)


def simulate(step: Any, replies: dict[int, Tensors], levels: int) -> SecureSum:
    """Secure aggregation simulated in one process: each client's dense reply encoded, the integers
    summed exactly, the sum decoded; the server's view (:class:`SecureSum`)."""
    bounds = step.reply_bounds()
    clients = sorted(replies)
    encoded = [encode(step.dense_reply(replies[c]), bounds, levels) for c in clients]
    total = sum_encoded(encoded)
    return SecureSum(decode_sum(total.values, bounds, len(clients), levels), tuple(clients),
                     clipped=total.clipped, bytes_per_client=upload_bytes(total.values))


# --------------------------------------------------------------------- Flower's float grid
def to_grid(encoded: Encoded, levels: int, c: float = CLIPPING_RANGE) -> list[np.ndarray]:
    """The floats a client hands Flower's SecAgg+ (``x = j * 2 c / T - c``, exact), in the order of
    ``encoded.values`` (sorted names), then the clipped-entry count (saturated at ``T``) as one entry."""
    step = 2.0 * c / levels
    ints = [t.numpy() for t in encoded.values.values()] + [np.array([min(encoded.clipped, levels)], np.int64)]
    return [j.astype(np.float64) * step - c for j in ints]


def from_grid_average(average: list[np.ndarray], count: int, levels: int, c: float = CLIPPING_RANGE
                      ) -> list[np.ndarray]:
    """The integer sums back from the average Flower's SecAgg+ server computes over ``count`` survivors
    (``avg = (S * 2c / T - count * c) / count``): ``S = rint((avg * count + count * c) / (2c / T))``,
    exact (its float error is far below half an integer for ``S < 2**32``)."""
    step = 2.0 * c / levels
    out = []
    for avg in average:
        s = np.rint((np.asarray(avg, np.float64) * count + count * c) / step)
        if s.size and (s.min() < 0 or s.max() > count * levels):
            raise ValueError(f"a securely aggregated sum is outside [0, {count} * {levels}]: the average does not "
                             f"come from {count} clients on this grid")
        out.append(s.astype(np.int64))
    return out


def from_grid_sums(sums: list[np.ndarray], names: list[str]) -> Encoded:
    """Integer sums in :func:`to_grid`'s order as an :class:`Encoded` (tensors by ``names``, the clipped count)."""
    if len(sums) != len(names) + 1:
        raise ValueError(f"expected {len(names) + 1} summed arrays ({', '.join(names)}, clipped), got {len(sums)}")
    values = {k: torch.from_numpy(np.ascontiguousarray(s)) for k, s in zip(names, sums[:-1], strict=True)}
    return Encoded(values, int(sums[-1].sum()))


# --------------------------------------------------------------------- configuration
def check_config(cfg: Any, posthoc: list[Any]) -> None:
    """``runtime.secure_aggregation`` needs an additive post-hoc step to apply to (a ConfigError otherwise,
    raised while the experiment is set up: before anything is written)."""
    if not cfg.runtime.secure_aggregation:
        return
    if not any(step.additive for step in posthoc):
        names = [step.name for step in posthoc]
        why = (f"its post-hoc steps ({', '.join(names)}) need each client's reply, not only their sum "
               "(CCVR's oracle mode uploads raw features)") if names else "it has no post-hoc step"
        raise ConfigError("runtime.secure_aggregation", True,
                          f"applies to additive post-hoc steps (e.g. algorithm.name = 'fedavg+ccvr'); "
                          f"{cfg.algorithm.name!r}: {why}; set it to false")
