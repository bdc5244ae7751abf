"""The run's random streams pinned (session 43, mutation testing of hetfl.rng): a stream's seed is a function of
``(seed, purpose, *coords)`` that no release may change, since a run resumed by a later hetfl, and every
published number, re-derives its streams from it; the client sampling that privacy budgets are calibrated on."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from hetfl.rng import (
    derive_seed,
    method_generator,
    most_rounds_asked,
    numpy_generator,
    sampled_clients,
    torch_generator,
)


def test_stream_seeds_are_pinned():
    """Values of this release (the first word shifted by 31 bits, xor the second, kept to 63 bits): a change of
    the derivation would give every existing run other streams on resume."""
    assert derive_seed(0, "init") == 7518656201426917601
    assert derive_seed(7, "batches", 3, 12) == 471651330273601655
    assert derive_seed(2**40, "eval") == 883088316625865256
    first, second = np.random.SeedSequence([0, zlib.crc32(b"init")]).generate_state(2, dtype=np.uint32)
    assert derive_seed(0, "init") == ((int(first) << 31) ^ int(second)) & (2**63 - 1)


def test_every_coordinate_and_purpose_gives_its_own_stream():
    seeds = {derive_seed(s, p, *c) for s in (0, 1) for p in ("batches", "augment", "draws")
             for c in ((1,), (2,), (0, 1), (1, 1), (1, 0, 1), (2, 3, 4))}
    assert len(seeds) == 2 * 3 * 6
    assert all(0 <= s < 2**63 for s in seeds) and max(seeds) >= 2**62  # the top bits are used


def test_coordinates_that_differ_by_trailing_zeros_are_one_stream():
    """NumPy's SeedSequence pads its entropy with zeros, so ``(a,)`` and ``(a, 0)`` are the same stream:
    each purpose's streams give their coordinates one fixed arity (``derive_seed``'s docstring)."""
    assert derive_seed(4, "batches", 2) == derive_seed(4, "batches", 2, 0)
    assert derive_seed(4, "batches", 2) != derive_seed(4, "batches", 0, 2)


def test_an_unknown_purpose_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError) as refused:
        derive_seed(0, "shuffle")
    assert str(refused.value) == ("unknown random stream 'shuffle'; known: init, sample, batches, augment, draws, "
                                  "algorithm, partition, eval")


def test_the_generators_are_seeded_by_their_stream():
    assert torch_generator(3, "augment", 2, 5).initial_seed() == derive_seed(3, "augment", 2, 5)
    assert torch_generator(3, "augment").device.type == "cpu"
    assert numpy_generator(3, "sample", 4).integers(2**62) == np.random.default_rng(
        derive_seed(3, "sample", 4)).integers(2**62)
    want = derive_seed(3, "algorithm", zlib.crc32(b"fedbr.pseudo"), 2)
    assert method_generator(3, "fedbr.pseudo", 2).initial_seed() == want
    assert method_generator(3, "fedbr.pseudo").initial_seed() != method_generator(3, "fedbr.own_pseudo").initial_seed()


def test_a_rounds_clients_are_drawn_from_the_rounds_own_stream():
    rng = numpy_generator(5, "sample", 3)
    assert sampled_clients(5, 3, 10, 4) == sorted(int(c) for c in rng.choice(10, size=4, replace=False))
    assert sampled_clients(5, 3, 10, 10) == sampled_clients(5, 3, 10, 0) == list(range(10))
    assert sampled_clients(5, 3, 10, 9) != list(range(10))[:9] or sampled_clients(5, 4, 10, 9) != list(range(9))


@pytest.mark.parametrize(("seed", "rounds", "clients", "per_round"),
                         [(1, 4, 4, 2), (2, 7, 5, 1), (3, 12, 9, 4), (4, 1, 5, 2)])  # one round: 1, not 0
def test_most_rounds_asked_is_the_most_any_client_takes_part_in(seed, rounds, clients, per_round):
    """The number a per-client privacy budget is divided by: never below what a client really takes part in."""
    taken = np.zeros(clients, dtype=int)
    for r in range(1, rounds + 1):
        taken[sampled_clients(seed, r, clients, per_round)] += 1
    assert most_rounds_asked(seed, rounds, clients, per_round) == taken.max()
    assert most_rounds_asked(seed, 0, clients, per_round) == 0
    assert most_rounds_asked(seed, rounds, clients, clients) == most_rounds_asked(seed, rounds, clients, 0) == rounds
