"""Random streams derived from ``(seed, purpose, round, client)``.

Every random draw of a run (model initialisation, client sampling, batch order,
augmentation) comes from a generator seeded by a hash of the run seed and the
draw's coordinates, never from global state. Results therefore do not depend
on the order in which clients are executed, on the executor, or on whether a
run was interrupted and resumed: a resumed run re-derives exactly the streams
the uninterrupted run would have used, so no generator state needs saving.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

_PURPOSES = ("init", "sample", "batches", "augment", "draws", "algorithm", "partition", "eval")


def derive_seed(seed: int, purpose: str, *coords: int) -> int:
    """A 63-bit seed for one stream, stable across processes and platforms.

    Coordinates that differ only by trailing zeros give the same seed (NumPy's ``SeedSequence`` pads its
    entropy with zeros: ``(r, c)`` is ``(r, c, 0)``), so the streams of one purpose give their coordinates
    one fixed arity in a run (``batches``: round, client, stream; a method's own: :func:`method_generator`'s name
    first, then its own fixed coordinates)."""
    if purpose not in _PURPOSES:
        raise ValueError(f"unknown random stream {purpose!r}; known: {', '.join(_PURPOSES)}")
    entropy = [seed, zlib.crc32(purpose.encode()), *coords]
    state = np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & ((1 << 63) - 1)


def torch_generator(seed: int, purpose: str, *coords: int) -> torch.Generator:
    """A CPU torch generator for one stream (CPU so that draws are device-independent)."""
    gen = torch.Generator()
    gen.manual_seed(derive_seed(seed, purpose, *coords))
    return gen


def numpy_generator(seed: int, purpose: str, *coords: int) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, purpose, *coords))


def method_generator(seed: int, name: str, *coords: int) -> torch.Generator:
    """A CPU generator for a method's own draws (``name`` such as ``"fedbr.pseudo"``),
    independent of every engine stream and of every other name."""
    return torch_generator(seed, "algorithm", zlib.crc32(name.encode()), *coords)


def sampled_clients(seed: int, round_: int, num_clients: int, per_round: int) -> list[int]:
    """The clients of a 1-based round, sorted: all of them if ``per_round`` is 0 or at least
    ``num_clients``, else ``per_round`` drawn without replacement from the round's own stream."""
    if per_round == 0 or per_round >= num_clients:
        return list(range(num_clients))
    rng = numpy_generator(seed, "sample", round_)
    return sorted(int(c) for c in rng.choice(num_clients, size=per_round, replace=False))


def most_rounds_asked(seed: int, rounds: int, num_clients: int, per_round: int) -> int:
    """The most rounds any one client is asked in over rounds 1..``rounds`` (:func:`sampled_clients`): drawn from
    the run's seed before and apart from any data, so a method may calibrate a per-client budget with it."""
    if per_round == 0 or per_round >= num_clients:
        return rounds
    counts = np.zeros(num_clients, dtype=np.int64)
    for r in range(1, rounds + 1):
        counts[sampled_clients(seed, r, num_clients, per_round)] += 1
    return int(counts.max()) if rounds > 0 else 0
