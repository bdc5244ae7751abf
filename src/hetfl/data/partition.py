"""Client partitions: which samples each client holds.

Every scheme is a small function of the labels (and natural groups) and a
seeded ``numpy.random.Generator``: the same seed gives the same split. Each
client gets a training split (disjoint across clients) and a personal test
split drawn from the global test set with the client's own training label
distribution (for personalised evaluation; test splits of different clients
may overlap). Transforming schemes also return per-client rotations or label
permutations, which the engine applies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PARTITIONS: tuple[str, ...] = (
    "iid", "dirichlet", "shards", "dominant", "quantity", "domain", "natural", "rotation", "concept",
)


class PartitionError(ValueError):
    """A partition that cannot be made; the message names the setting and what is allowed."""


@dataclass
class Partition:
    """Per-client sample indices (and transforms).

    Attributes:
        train: per client, sorted int64 indices into the training split (disjoint).
        test: per client, int64 indices into the test split (its personal test set).
        rotation: per-client rotation angle in degrees (``rotation`` scheme).
        label_perm: per-client label permutation, client label = ``perm[label]`` (``concept``).
        group: per-client group / domain id where the scheme defines one.
    """

    train: list[np.ndarray]
    test: list[np.ndarray]
    rotation: list[float] | None = None
    label_perm: list[np.ndarray] | None = None
    group: list[int] | None = None

    @property
    def num_clients(self) -> int:
        return len(self.train)


def _fail(key: str, value: object, allowed: str) -> PartitionError:
    return PartitionError(f"{key} = {value!r}: {allowed}")


# ----------------------------------------------------------------- label schemes
def split_iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Uniformly random, (almost) equal-sized split."""
    return [np.sort(part) for part in np.array_split(rng.permutation(len(labels)), num_clients)]


def split_dirichlet(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, alpha: float, min_size: int, max_retries: int
) -> list[np.ndarray]:
    """Dirichlet label skew (Hsu et al. 2019; the NIID-Bench / MOON / CCVR code, Li et al. ICDE 2022).

    For every class, the proportions of its samples over clients are drawn
    from ``Dir(alpha)``; a client that already holds ``>= N / num_clients``
    samples gets no more (the reference code's balancing rule). The draw is
    repeated until every client holds ``min_size`` samples, at most
    ``max_retries`` times.
    """
    n = len(labels)
    classes = np.unique(labels)
    by_class = [np.flatnonzero(labels == c) for c in classes]
    smallest = 0
    for _ in range(max_retries):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for idx in by_class:
            idx = rng.permutation(idx)
            p = rng.dirichlet(np.full(num_clients, alpha))
            p = p * (sizes < n / num_clients)
            p = p / p.sum() if p.sum() > 0 else np.full(num_clients, 1 / num_clients)
            cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].extend(chunk.tolist())
                sizes[k] += len(chunk)
        smallest = int(sizes.min())
        if smallest >= min_size:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise PartitionError(
        f"data.min_size = {min_size}: no Dirichlet(alpha={alpha}) split over {num_clients} clients gave every client "
        f"that many samples in {max_retries} tries (smallest client: {smallest}); use a larger data.alpha, "
        f"a smaller data.min_size or fewer clients"
    )


def split_shards(labels: np.ndarray, num_clients: int, rng: np.random.Generator, k: int) -> list[np.ndarray]:
    """Pathological non-IID split (McMahan et al. 2017): sort by label, cut into
    ``num_clients * k`` shards, deal ``k`` shards to each client."""
    order = np.argsort(labels, kind="stable")
    shards = np.array_split(order, num_clients * k)
    deal = rng.permutation(len(shards))
    return [np.sort(np.concatenate([shards[s] for s in deal[i * k : (i + 1) * k]])) for i in range(num_clients)]


def dominant_classes(num_classes: int, groups: int, per_group: int) -> list[list[int]]:
    """FedPAC's group classes: group g holds ``per_group`` consecutive classes from
    ``g * step``, wrapping; for 10 classes, 5 groups, 3 per group:
    {0,1,2}, {2,3,4}, {4,5,6}, {6,7,8}, {8,9,0} (the authors' code)."""
    step = max(1, num_classes // groups)
    return [[(g * step + j) % num_classes for j in range(per_group)] for g in range(groups)]


def split_dominant(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    num_classes: int,
    samples: int,
    uniform_share: float,
    groups: int,
    per_group: int,
) -> list[np.ndarray]:
    """FedPAC's split (Xu et al., ICLR 2023, sec. 5.1): every client has ``samples``
    training samples, ``uniform_share`` of them drawn uniformly over all classes,
    the rest from the dominant classes of its group (client i in group i mod G).
    Samples are drawn without replacement across clients."""
    pools = {c: list(rng.permutation(np.flatnonzero(labels == c))) for c in range(num_classes)}
    group_classes = dominant_classes(num_classes, groups, per_group)
    n_uniform = round(samples * uniform_share)
    out = []
    for i in range(num_clients):
        wanted = np.zeros(num_classes, dtype=np.int64)
        np.add.at(wanted, rng.integers(0, num_classes, n_uniform), 1)
        dominant = group_classes[i % groups]
        np.add.at(wanted, np.asarray(dominant)[rng.integers(0, len(dominant), samples - n_uniform)], 1)
        picked = []
        for c in range(num_classes):
            if wanted[c] > len(pools[c]):
                raise PartitionError(
                    f"data.samples_per_client = {samples}: client {i} needs {wanted[c]} samples of class {c} but "
                    f"only {len(pools[c])} are left; use fewer clients or fewer samples per client"
                )
            picked.extend(pools[c][: wanted[c]])
            del pools[c][: wanted[c]]
        out.append(np.sort(np.asarray(picked, dtype=np.int64)))
    return out


def split_quantity(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, sigma: float, min_size: int
) -> list[np.ndarray]:
    """Quantity skew: IID labels, client sizes proportional to ``LogNormal(0, sigma)``
    draws, each at least ``min_size``."""
    n = len(labels)
    if min_size * num_clients > n:
        raise _fail("data.min_size", min_size, f"{num_clients} clients x {min_size} exceeds the {n} samples")
    weights = rng.lognormal(0.0, sigma, num_clients)
    extra = np.floor(weights / weights.sum() * (n - min_size * num_clients)).astype(np.int64)
    extra[: (n - min_size * num_clients) - extra.sum()] += 1
    sizes = extra + min_size
    cuts = np.cumsum(sizes)[:-1]
    return [np.sort(p) for p in np.split(rng.permutation(n), cuts)]


def split_groups(
    groups: np.ndarray, num_clients: int, rng: np.random.Generator, clients_per_group: int, key: str
) -> tuple[list[np.ndarray], list[int]]:
    """Feature shift by domain: each natural group (domain, device) is split IID
    over ``clients_per_group`` clients. Returns (indices, group of each client)."""
    ids = np.unique(groups)
    if num_clients != len(ids) * clients_per_group:
        raise _fail(
            "data.num_clients", num_clients,
            f"must be {len(ids) * clients_per_group} here ({len(ids)} groups x {clients_per_group} clients per group)"
            if key == "domain" else f"must equal the dataset's {len(ids)} natural groups",
        )
    parts, owner = [], []
    for g in ids:
        idx = rng.permutation(np.flatnonzero(groups == g))
        for chunk in np.array_split(idx, clients_per_group):
            parts.append(np.sort(chunk))
            owner.append(int(g))
    return parts, owner


# ------------------------------------------------------------ personal test sets
def personal_test(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    parts: list[np.ndarray],
    num_classes: int,
    per_client: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Per client, ``per_client`` test samples whose labels follow the client's
    training label distribution (without replacement within a client)."""
    by_class = [np.flatnonzero(test_labels == c) for c in range(num_classes)]
    out = []
    for idx in parts:
        counts = np.bincount(train_labels[idx], minlength=num_classes)
        share = counts / max(counts.sum(), 1)
        wanted = np.floor(share * per_client).astype(np.int64)
        remainder = per_client - wanted.sum()
        if remainder > 0 and counts.sum() > 0:  # largest remainders first
            order = np.argsort(-(share * per_client - wanted), kind="stable")
            wanted[order[:remainder]] += 1
        picked = [rng.choice(by_class[c], size=min(int(wanted[c]), len(by_class[c])), replace=False)
                  for c in range(num_classes) if wanted[c] > 0]
        out.append(np.sort(np.concatenate(picked)).astype(np.int64) if picked else np.zeros(0, dtype=np.int64))
    return out


def group_test(test_groups: np.ndarray, owner: list[int], rng: np.random.Generator) -> list[np.ndarray]:
    """Each group's test samples, split IID among the clients of that group."""
    out: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * len(owner)
    for g in sorted(set(owner)):
        clients = [i for i, o in enumerate(owner) if o == g]
        idx = rng.permutation(np.flatnonzero(test_groups == g))
        for i, chunk in zip(clients, np.array_split(idx, len(clients)), strict=True):
            out[i] = np.sort(chunk).astype(np.int64)
    return out


# ---------------------------------------------------------------------- entry
def make_partition(
    name: str,
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    num_clients: int,
    *,
    seed: int,
    num_classes: int | None = None,
    train_groups: np.ndarray | None = None,
    test_groups: np.ndarray | None = None,
    alpha: float = 0.5,
    min_size: int = 10,
    max_retries: int = 100,
    classes_per_client: int = 2,
    uniform_share: float = 0.2,
    samples_per_client: int | None = None,
    test_per_client: int | None = None,
    dominant_groups: int = 5,
    classes_per_group: int = 3,
    quantity_sigma: float = 1.0,
    clients_per_domain: int = 1,
    angles: Sequence[float] | None = None,
    base: str = "iid",
    concept_groups: int = 2,
) -> Partition:
    """Split a dataset over ``num_clients`` clients with scheme ``name`` (see PARTITIONS)."""
    train_labels = np.asarray(train_labels, dtype=np.int64)
    test_labels = np.asarray(test_labels, dtype=np.int64)
    num_classes = int(num_classes or (max(train_labels.max(initial=0), test_labels.max(initial=0)) + 1))
    n = len(train_labels)
    if name not in PARTITIONS:
        raise _fail("data.partition", name, "allowed: " + ", ".join(PARTITIONS))
    if num_clients < 1 or num_clients > n:
        raise _fail("data.num_clients", num_clients, f"must be between 1 and the {n} training samples")
    if alpha <= 0:
        raise _fail("data.alpha", alpha, "must be > 0")
    if min_size < 0:
        raise _fail("data.min_size", min_size, "must be >= 0")
    if min_size * num_clients > n and name in ("dirichlet", "quantity"):
        raise _fail("data.min_size", min_size, f"{num_clients} clients x {min_size} exceeds the {n} samples")
    if not 0 <= uniform_share <= 1:
        raise _fail("data.uniform_share", uniform_share, "must be in [0, 1]")
    if base not in ("iid", "dirichlet"):
        raise _fail("data.base", base, "allowed: iid, dirichlet")
    rng = np.random.default_rng(seed)

    def label_split(scheme: str) -> list[np.ndarray]:
        if scheme == "dirichlet":
            return split_dirichlet(train_labels, num_clients, rng, alpha, min_size, max_retries)
        return split_iid(train_labels, num_clients, rng)

    rotation = label_perm = owner = None
    default_test = max(1, len(test_labels) // num_clients)
    if name in ("iid", "dirichlet"):
        train = label_split(name)
    elif name == "shards":
        if not 1 <= classes_per_client <= num_classes:
            raise _fail("data.classes_per_client", classes_per_client, f"must be in [1, {num_classes}]")
        train = split_shards(train_labels, num_clients, rng, classes_per_client)
    elif name == "dominant":
        if not 1 <= classes_per_group <= num_classes:
            raise _fail("data.classes_per_group", classes_per_group, f"must be in [1, {num_classes}]")
        samples = samples_per_client or 600
        train = split_dominant(train_labels, num_clients, rng, num_classes, samples, uniform_share,
                               dominant_groups, classes_per_group)
        owner = [i % dominant_groups for i in range(num_clients)]
        default_test = samples // 2
    elif name == "quantity":
        train = split_quantity(train_labels, num_clients, rng, quantity_sigma, min_size)
    elif name in ("domain", "natural"):
        if train_groups is None or test_groups is None:
            raise _fail("data.partition", name, "needs a dataset with natural groups (domains or devices)")
        per_group = clients_per_domain if name == "domain" else 1
        train, owner = split_groups(np.asarray(train_groups), num_clients, rng, per_group, name)
        test = group_test(np.asarray(test_groups), owner, rng)
        return Partition(train, test, group=owner)
    elif name == "rotation":
        train = label_split(base)
        if angles is not None and len(angles) != num_clients:
            raise _fail("data.angles", list(angles), f"needs one angle per client ({num_clients})")
        rotation = [float(a) for a in angles] if angles is not None else [
            float(a) for a in np.linspace(0.0, 180.0, num_clients, endpoint=False)]
    else:  # concept
        if not 1 <= concept_groups <= num_clients:
            raise _fail("data.concept_groups", concept_groups, f"must be in [1, {num_clients}]")
        train = label_split(base)
        perms = [np.arange(num_classes)] + [rng.permutation(num_classes) for _ in range(concept_groups - 1)]
        owner = [i % concept_groups for i in range(num_clients)]
        label_perm = [perms[g] for g in owner]
    per_client = test_per_client or default_test
    test = personal_test(train_labels, test_labels, train, num_classes, per_client, rng)
    return Partition(train, test, rotation=rotation, label_perm=label_perm, group=owner)


