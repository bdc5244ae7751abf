"""Client partitions: which samples each client holds.

Every scheme is a small function of the training labels (or natural groups)
and a seeded ``numpy.random.Generator``, so the same seed gives the same split
and no global random state is touched. Each client gets

* a training split: sorted indices into the training set, disjoint across
  clients (every scheme except ``dominant`` hands out every sample);
* a personal test split: indices into the global test set whose label
  distribution follows the client's own training label distribution (the
  evaluation protocol of personalised FL, e.g. FedPAC); test splits of
  different clients may overlap. For ``domain`` / ``natural`` it is the
  client's own group's test data instead.

Transforming schemes also return per-client rotation angles (``rotation``) or
label permutations (``concept``); the engine applies them to the client's
train and test samples.

References:
    McMahan et al., Communication-Efficient Learning of Deep Networks from
    Decentralized Data, AISTATS 2017 (IID and pathological shard splits).
    Hsu, Qi & Brown, Measuring the Effects of Non-Identical Data Distribution
    for Federated Visual Classification, 2019 (Dirichlet label skew).
    Li, Diao, Chen & He, Federated Learning on Non-IID Data Silos: An
    Experimental Study (NIID-Bench), ICDE 2022; its code is the Dirichlet split
    used by MOON (CVPR 2021) and CCVR (NeurIPS 2021).
    Xu, Tong & Huang, Personalized Federated Learning with Feature Alignment
    and Classifier Collaboration (FedPAC), ICLR 2023.
    Guo, Tang & Lin, FedBR: Improving Federated Learning on Heterogeneous Data
    via Local Learning Bias Reduction, ICML 2023 (RotatedMNIST clients).
    Li et al., Federated Optimization in Heterogeneous Networks (FedProx),
    MLSys 2020 (natural devices, log-normal client sizes).
    Sattler, Müller & Samek, Clustered Federated Learning, IEEE TNNLS 2021, and
    Kairouz et al., Advances and Open Problems in Federated Learning, 2021,
    sec. 3.1 (concept shift: same inputs, different labels per client group).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetfl.params import shown_value

PARTITIONS: tuple[str, ...] = (
    "iid", "dirichlet", "shards", "dominant", "quantity", "domain", "natural", "rotation", "concept",
)
BASES: tuple[str, ...] = ("iid", "dirichlet")  # label splits under ``rotation`` / ``concept``
#: one line on each scheme (``hetfl list PARTITION``)
PARTITION_DOCS: dict[str, str] = {
    "iid": "every client an equal, uniformly random share of the training set",
    "dirichlet": "label skew: each class spread over the clients by Dirichlet(alpha) proportions, redrawn until "
                 "every client holds min_size samples (NIID-Bench's split, used by MOON and CCVR; Hsu et al. 2019)",
    "shards": "pathological label skew: classes_per_client shards of sorted labels per client (McMahan et al. 2017)",
    "dominant": "FedPAC's split: client groups, each dominated by classes_per_group classes, with uniform_share "
                "of each client's samples drawn over all classes, samples_per_client per client",
    "quantity": "quantity skew: IID labels, client sizes log-normal with quantity_sigma",
    "domain": "feature shift: clients_per_domain clients per natural domain of the dataset (PACS, Office-Home, "
              "DomainNet, HAM10000), each with its domain's own test data",
    "natural": "the dataset's own devices or groups as clients (Synthetic(alpha, beta)'s devices), each with its "
               "own test data",
    "rotation": "feature shift on a label split (data.base): each client's images rotated by its angle (FedBR's "
                "RotatedMNIST)",
    "concept": "concept shift on a label split (data.base): concept_groups groups of clients, each with its own "
               "permutation of the labels",
}

#: the ``data.<key>`` settings of the partitions (each read by some schemes only: :func:`partition_keys`)
PARTITION_SETTINGS: tuple[str, ...] = (
    "alpha", "min_size", "classes_per_client", "uniform_share", "samples_per_client", "test_per_client",
    "dominant_groups", "classes_per_group", "group_classes", "reuse_samples", "quantity_sigma", "clients_per_domain",
    "angles", "base", "concept_groups",
)


def partition_keys(name: str, base: str = "iid") -> frozenset[str]:
    """The settings of :data:`PARTITION_SETTINGS` that scheme ``name`` reads (``base``: the label split under
    ``rotation`` / ``concept``), as :func:`make_partition` uses them."""
    split = base if name in ("rotation", "concept") else name
    keys = {"alpha", "min_size"} if split == "dirichlet" else set()
    keys |= {"min_size", "quantity_sigma"} if split == "quantity" else set()
    keys |= {"classes_per_client"} if split == "shards" else set()
    if split == "dominant":
        keys |= {"uniform_share", "samples_per_client", "dominant_groups", "classes_per_group", "group_classes",
                 "reuse_samples"}
    keys |= {"clients_per_domain"} if name == "domain" else set()
    keys |= {"angles", "base"} if name == "rotation" else set()
    keys |= {"concept_groups", "base"} if name == "concept" else set()
    if name not in ("domain", "natural"):  # these keep each group's own test samples
        keys.add("test_per_client")
    return frozenset(keys)


def unused_settings(name: str, base: str, values: dict, defaults: dict) -> list[str]:
    """A note for each partition setting that ``values`` (a run's ``data`` table) moves from ``defaults`` but
    the ``name`` scheme never reads: a ``data.alpha = 0.1`` under the natural or IID split changes nothing."""
    used = partition_keys(name, base)
    notes = []
    for key in PARTITION_SETTINGS:
        if key in used or values.get(key) == defaults.get(key):
            continue
        readers = [p for p in PARTITIONS if key in partition_keys(p)]
        readers += [f"{p} with data.base = 'dirichlet'" for p in ("rotation", "concept")
                    if key in partition_keys(p, "dirichlet") - partition_keys(p)]
        notes.append(f"data.{key} = {values.get(key)!r} has no effect: the {name} partition does not use it "
                     f"(it is read by {', '.join(readers)}); set data.partition to one of those to use it")
    return notes


# FedBR's RotatedMNIST rotates its 10 clients by 0, 15, ..., 135 degrees; the
# default angles spread the clients evenly over the same range [0, 150).
DEFAULT_ANGLE_RANGE = 150.0
DEFAULT_DOMINANT_SAMPLES = 600  # FedPAC: 600 training samples per client (and 300 test)


class PartitionError(ValueError):
    """A partition that cannot be made.

    The message is one line: the parameter (its config key, ``data.<name>``,
    where it has one), its value, and what is allowed or what went wrong.
    """


def _error(key: str, value: object, what: str) -> PartitionError:
    shown = value if isinstance(value, str) and value.startswith("<") else shown_value(value)  # "<...>": a description
    return PartitionError(f"{key} = {shown}: {what}")


@dataclass
class Partition:
    """Per-client sample indices (and the transforms some schemes add).

    Attributes:
        train: per client, sorted int64 indices into the training split.
        test: per client, sorted int64 indices into the test split (its
            personal test set; may overlap other clients' test sets).
        rotation: per-client rotation angle in degrees (``rotation``), else None.
        label_perm: per-client label permutation, client label = ``perm[label]``
            (``concept``), else None.
        group: per-client group id where the scheme defines one (the natural
            group / domain id for ``domain`` and ``natural``, the FedPAC group
            for ``dominant``, the concept group for ``concept``), else None.
        scheme: name of the scheme that made it ('' if built by hand).
    """

    train: list[np.ndarray]
    test: list[np.ndarray]
    rotation: list[float] | None = None
    label_perm: list[np.ndarray] | None = None
    group: list[int] | None = None
    scheme: str = ""

    def __post_init__(self) -> None:
        k = len(self.train)
        for key, value in (("test", self.test), ("rotation", self.rotation), ("label_perm", self.label_perm),
                           ("group", self.group)):
            if value is not None and len(value) != k:
                raise _error(f"Partition.{key}", f"<{len(value)} entries>", f"needs one entry per client ({k})")

    @property
    def num_clients(self) -> int:
        return len(self.train)

    def summary(self, train_labels: np.ndarray | None = None, num_classes: int | None = None) -> str:
        """One line for logs: client and sample counts, plus classes per client
        (given the training labels), groups, angles or permutations."""
        sizes = np.array([len(p) for p in self.train])
        tests = np.array([len(p) for p in self.test])
        head = f"{self.scheme} partition: " if self.scheme else ""
        if self.num_clients == 0:
            return f"{head}0 clients"
        parts = [
            f"{head}{self.num_clients} clients",
            f"train {sizes.sum()} samples ({sizes.min()}-{sizes.max()} per client, mean {sizes.mean():.1f})",
            f"test {tests.min()}-{tests.max()} per client",
        ]
        if train_labels is not None:
            labels = np.asarray(train_labels)
            c = int(num_classes or labels.max(initial=0) + 1)
            held = [np.count_nonzero(np.bincount(labels[p], minlength=c)) for p in self.train]
            parts.append(f"classes per client {np.mean(held):.2f} of {c}")
        if self.group is not None:
            parts.append(f"{len(set(self.group))} groups")
        if self.rotation is not None:
            parts.append(f"angles {min(self.rotation):g}-{max(self.rotation):g} deg")
        if self.label_perm is not None:
            parts.append(f"{len({tuple(np.asarray(p).tolist()) for p in self.label_perm})} label permutations")
        return "; ".join(parts)


# --------------------------------------------------------------------- helpers
def _by_owner(owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Indices grouped by ``owner[i]`` (client of sample i, -1 = nobody), each sorted."""
    assigned = np.flatnonzero(owner >= 0)
    clients = owner[assigned]
    order = np.argsort(clients, kind="stable")  # stable: indices stay ascending within a client
    cuts = np.cumsum(np.bincount(clients, minlength=num_clients))[:-1]
    return [part.astype(np.int64) for part in np.split(assigned[order], cuts)]


def _apportion(total: int, weights: np.ndarray) -> np.ndarray:
    """Integers proportional to ``weights`` that sum to ``total`` (largest
    remainders, Hamilton's method): each is the floor or ceiling of its exact share. Equal remainders favour the
    earlier weights (a stable sort: numpy's default sort orders equal keys its own way, which may vary by CPU)."""
    exact = total * weights / weights.sum()
    out = np.floor(exact).astype(np.int64)
    short = int(total - out.sum())
    if short > 0:
        out[np.argsort(out - exact, kind="stable")[:short]] += 1
    return out


def _class_index(labels: np.ndarray, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices sorted by class (stable) and the start offset of each class in it."""
    order = np.argsort(labels, kind="stable")
    starts = np.concatenate(([0], np.cumsum(np.bincount(labels, minlength=num_classes))))
    return order, starts


# ---------------------------------------------------------------- label schemes
def split_iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """IID split (McMahan et al. 2017): a random permutation cut into
    ``num_clients`` parts whose sizes differ by at most one."""
    n = len(labels)
    owner = np.empty(n, dtype=np.int64)
    owner[rng.permutation(n)] = np.arange(n) * num_clients // n
    return _by_owner(owner, num_clients)


def split_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    alpha: float,
    min_size: int,
    max_retries: int,
) -> list[np.ndarray]:
    """Dirichlet label skew (Hsu et al. 2019) as coded in NIID-Bench (Li et al.,
    ICDE 2022) and reused by MOON and CCVR.

    For each class, the proportions of its samples over clients are drawn from
    ``Dir(alpha)``; a client that already holds ``>= N / num_clients`` samples
    gets none of the next class (the reference code's balancing rule); a class
    whose draw falls wholly on such full clients is split evenly over the open
    ones (the reference code divides 0 by 0 there). Small
    alpha: few classes per client; large alpha: close to IID. The whole split
    is redrawn until every client holds at least ``min_size`` samples (the
    reference loops forever; here at most ``max_retries`` times, then an error
    that reports the smallest client reached).
    """
    n = len(labels)
    order, starts = _class_index(labels, int(labels.max(initial=0)) + 1)
    classes = [order[a:b] for a, b in itertools.pairwise(starts) if b > a]
    cap = n / num_clients
    best = -1
    for _ in range(max_retries):
        owner = np.empty(n, dtype=np.int64)
        sizes = np.zeros(num_clients, dtype=np.int64)
        for idx in classes:
            open_ = sizes < cap
            p = np.nan_to_num(rng.dirichlet(np.full(num_clients, alpha))) * open_
            p = p / p.sum() if p.sum() > 0 else open_ / open_.sum()
            cuts = np.clip((np.cumsum(p)[:-1] * len(idx)).astype(np.int64), 0, len(idx))
            counts = np.diff(np.concatenate(([0], cuts, [len(idx)])))
            owner[rng.permutation(idx)] = np.repeat(np.arange(num_clients), counts)
            sizes += counts
        best = max(best, int(sizes.min()))
        if sizes.min() >= min_size:
            return _by_owner(owner, num_clients)
    raise PartitionError(
        f"data.min_size = {min_size}: no Dirichlet(alpha={alpha}) split of {n} samples over {num_clients} clients "
        f"gave every client that many samples in {max_retries} tries (best smallest client: {best}); "
        f"use a larger data.alpha, a smaller data.min_size or fewer clients"
    )


def _deal_distinct(
    shard_class: np.ndarray, num_clients: int, k: int, rng: np.random.Generator
) -> np.ndarray:
    """``[num_clients, k]`` shard ids: a random deal in which no client gets two
    shards of one class (needs at most ``num_clients`` shards per class).

    Deals at random, then repairs each duplicate by swapping it with a shard of
    a client that lacks that class and whose shard's class the first client
    lacks (each swap removes one duplicate and adds none). If no such swap
    exists, falls back to dealing the class-sorted shards round-robin, which
    never repeats a class because a class occupies at most ``num_clients``
    consecutive positions.
    """
    deal = rng.permutation(len(shard_class)).reshape(num_clients, k)
    for _ in range(len(shard_class) + 1):
        cls = shard_class[deal]
        srt = np.sort(cls, axis=1)
        rows = np.flatnonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))
        if len(rows) == 0:
            return deal
        i = int(rows[0])
        row = cls[i]
        a = next(b for b in range(1, k) if row[b] in row[:b])  # a repeated position
        has_c = (cls == row[a]).any(axis=1)
        ok = ~np.isin(cls, row) & ~has_c[:, None]
        candidates = np.argwhere(ok)
        if len(candidates) == 0:
            break
        j, b = candidates[rng.integers(len(candidates))]
        deal[i, a], deal[j, b] = deal[j, b], deal[i, a]
    # fallback: shards sorted by class, position p -> client p mod num_clients
    ordered = np.argsort(shard_class, kind="stable")
    return ordered.reshape(k, num_clients).T[rng.permutation(num_clients)]


def split_shards(labels: np.ndarray, num_clients: int, rng: np.random.Generator, k: int) -> list[np.ndarray]:
    """Pathological non-IID split (McMahan et al. 2017, sec. 3: sort by label,
    cut into ``num_clients * k`` shards, give each client ``k`` shards).

    Two refinements make every client hold exactly ``k`` classes: shards are
    cut within classes (each class gets a number of shards proportional to its
    size, at least one and at most ``num_clients``, so shards do not straddle
    two classes), and the deal gives no client two shards of the same class.
    Within a class the samples are shuffled before cutting. On balanced data
    (MNIST, CIFAR-10: 100 clients, k = 2 -> 200 shards of 300 / 250 samples)
    this is McMahan's split with the same-class collisions removed.
    """
    present, counts = np.unique(labels, return_counts=True)
    total = num_clients * k
    if k > len(present):
        raise _error("data.classes_per_client", k, f"only {len(present)} classes occur in the training labels")
    if total < len(present):
        raise _error("data.classes_per_client", k, f"{num_clients} clients x {k} shards cannot cover the "
                     f"{len(present)} classes; use more clients or more classes per client")
    cap = np.minimum(counts, num_clients)
    if cap.sum() < total:
        raise _error("data.classes_per_client", k, f"the class sizes {counts.tolist()} cannot give each of "
                     f"{num_clients} clients {k} distinct classes; use fewer clients or classes per client")
    exact = total * counts / counts.sum()
    per_class = np.ones(len(present), dtype=np.int64)
    # capped largest-deficit apportionment, one shard at a time: the next shard goes to the class furthest below
    # its exact share that still has room (handing one to each of the `short` largest deficits at once gave
    # classes already over their share more shards: 3, 3, 2 for classes of 600, 300, 100 and 8 shards)
    for _ in range(total - int(per_class.sum())):
        deficit = np.where(per_class < cap, exact - per_class, -np.inf)
        per_class[int(np.argmax(deficit))] += 1  # the first of equal deficits, as a stable sort
    shard_class = np.repeat(np.arange(len(present)), per_class)
    deal = _deal_distinct(shard_class, num_clients, k, rng)
    client_of_shard = np.empty(total, dtype=np.int64)
    client_of_shard[deal.ravel()] = np.repeat(np.arange(num_clients), k)
    owner = np.empty(len(labels), dtype=np.int64)
    first = np.concatenate(([0], np.cumsum(per_class)))
    for c, label in enumerate(present):
        idx = rng.permutation(np.flatnonzero(labels == label))
        local = np.arange(len(idx)) * per_class[c] // len(idx)  # equal-sized shards within the class
        owner[idx] = client_of_shard[first[c] + local]
    return _by_owner(owner, num_clients)


def dominant_classes(num_classes: int, groups: int, per_group: int) -> list[list[int]]:
    """FedPAC's dominant classes per client group: group g holds ``per_group``
    consecutive classes starting at ``g * (num_classes // groups)``, wrapping;
    for 10 classes, 5 groups, 3 per group: {0,1,2}, {2,3,4}, {4,5,6}, {6,7,8},
    {8,9,0}, the sets hard-coded in the authors' code (JianXu95/FedPAC,
    ``cifar_noniid_s``)."""
    step = max(1, num_classes // groups)
    return [[(g * step + j) % num_classes for j in range(per_group)] for g in range(groups)]


def _spread(total: int, classes: Sequence[int], num_classes: int, rng: np.random.Generator) -> np.ndarray:
    """``total`` samples over ``classes`` as evenly as possible; the remainder
    goes one each to randomly chosen classes (the authors' code gives it all to
    the last class; random avoids favouring one class)."""
    out = np.zeros(num_classes, dtype=np.int64)
    cls = np.asarray(classes, dtype=np.int64)
    out[cls] = total // len(cls)
    out[rng.choice(cls, total % len(cls), replace=False)] += 1
    return out


def split_dominant(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    num_classes: int,
    samples: int,
    uniform_share: float,
    groups: int,
    per_group: int,
    group_classes: list[list[int]] | None = None,
    reuse: bool = False,
) -> tuple[list[np.ndarray], np.ndarray]:
    """FedPAC's split (Xu et al., ICLR 2023, sec. 5.1; authors' ``*_noniid_s``).

    Every client holds exactly ``samples`` training samples: ``round(samples *
    uniform_share)`` spread evenly over all classes, the rest spread evenly over
    the dominant classes of its group (client i in group i mod the number of
    groups). The groups are ``group_classes`` where given (EMNIST's digits /
    upper / lower case in the authors' ``emnist_noniid_s``), else ``groups``
    runs of ``per_group`` consecutive classes (:func:`dominant_classes`). With
    the paper's 600 samples and s = 20 %: 12 per class plus 160 per dominant
    class. Samples are drawn without replacement across clients, and a class
    that runs short is an error, unless ``reuse``: then a short class's samples
    are handed out again, as the authors' code does once a class runs out (it
    starts the class over), every sample once before any twice and none twice
    to one client (:func:`_deal_again`). Returns the client indices and the
    ``[num_clients, num_classes]`` counts.
    """
    group_classes = group_classes or dominant_classes(num_classes, groups, per_group)
    n_uniform = round(samples * uniform_share)
    wanted = np.stack([
        _spread(n_uniform, range(num_classes), num_classes, rng)
        + _spread(samples - n_uniform, group_classes[i % len(group_classes)], num_classes, rng)
        for i in range(num_clients)
    ])
    need = wanted.sum(axis=0)
    have = np.bincount(labels, minlength=num_classes)
    short = np.flatnonzero(need > have)
    if len(short) and not reuse:
        c = int(short[0])
        raise _error("data.samples_per_client", samples, f"{num_clients} clients need {need[c]} training samples "
                     f"of class {c} but only {have[c]} exist; use fewer clients, fewer samples per client or a "
                     f"larger data.uniform_share, or set data.reuse_samples = true to hand samples out again "
                     f"(the authors' code)")
    order, starts = _class_index(labels, num_classes)
    if len(short):
        return _deal_again(order, starts, wanted, samples, rng), wanted
    owner = np.full(len(labels), -1, dtype=np.int64)
    for c in range(num_classes):
        if need[c]:
            pool = rng.permutation(order[starts[c] : starts[c + 1]])[: need[c]]
            owner[pool] = np.repeat(np.arange(num_clients), wanted[:, c])
    return _by_owner(owner, num_clients), wanted


def _deal_again(
    order: np.ndarray, starts: np.ndarray, wanted: np.ndarray, samples: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """The dominant split's draw when some class runs short and may be handed out again: per class, clients in
    order take their ``wanted[i, c]`` samples from a shuffled deck of the class's samples; when the deck runs
    out mid-client, a new deck is shuffled with the samples that client already took from the old one at its
    end, so every sample is dealt once before any twice and no client gets one sample twice. A class that does
    not run short is dealt from one deck, each sample once at most, as without reuse (the draws differ: the
    short classes' extra decks use the same stream). Returns each client's sorted indices."""
    num_clients, num_classes = wanted.shape
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(num_classes):
        idx = order[starts[c] : starts[c + 1]]
        if not wanted[:, c].any():
            continue
        if wanted[:, c].max() > len(idx):
            raise _error("data.samples_per_client", samples, f"a client needs {wanted[:, c].max()} training "
                         f"samples of class {c} but only {len(idx)} exist, and no client holds a sample twice; "
                         "use fewer samples per client or a larger data.uniform_share")
        deck, pos = rng.permutation(idx), 0
        for i in np.flatnonzero(wanted[:, c]):
            take = deck[pos : pos + wanted[i, c]]
            pos += len(take)
            if len(take) < wanted[i, c]:  # the deck ran out: the rest from a new one, not repeating `take`
                deck = np.concatenate([rng.permutation(np.setdiff1d(idx, take)), rng.permutation(take)])
                pos = int(wanted[i, c]) - len(take)
                take = np.concatenate([take, deck[:pos]])
            parts[i].append(take)
    return [np.sort(np.concatenate(p)).astype(np.int64) if p else np.zeros(0, dtype=np.int64) for p in parts]


def check_group_classes(value: object, num_classes: int) -> list[list[int]]:
    """``data.group_classes`` as lists of ints: at least one group, each a non-empty list of distinct classes in
    ``[0, num_classes)`` (groups may share classes, as FedPAC's CIFAR-10 groups do); else a PartitionError
    naming the group and the class."""
    key = "data.group_classes"
    value = value.tolist() if isinstance(value, np.ndarray) else value
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) == 0:
        raise _error(key, value, "needs at least one group: a list of lists of classes, e.g. [[0, 1], [2, 3]]")
    groups: list[list[int]] = []
    for g, group in enumerate(value):
        if not isinstance(group, Sequence) or isinstance(group, str):
            raise _error(key, value, f"group {g} = {group!r} is not a list of classes; give one list per group")
        if len(group) == 0:
            raise _error(key, value, f"group {g} is empty; each group needs at least one dominant class")
        for c in group:
            if not isinstance(c, int | np.integer) or isinstance(c, bool):
                raise _error(key, value, f"class {c!r} of group {g} must be an integer class index")
            if not 0 <= c < num_classes:
                raise _error(key, value, f"class {c} of group {g} is not a class: allowed 0 to {num_classes - 1}")
        if len(set(group)) < len(group):
            twice = next(c for c in group if list(group).count(c) > 1)
            raise _error(key, value, f"group {g} lists class {twice} twice; each class once per group")
        groups.append([int(c) for c in group])
    return groups


def split_quantity(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, sigma: float, min_size: int
) -> list[np.ndarray]:
    """Quantity skew with IID labels: client sizes proportional to draws from
    ``LogNormal(0, sigma)`` on top of ``min_size`` each (the log-normal sizes of
    FedProx's reference data generator; NIID-Bench's quantity skew is the same
    idea with Dirichlet proportions). ``sigma = 0`` gives equal sizes."""
    n = len(labels)
    weights = rng.lognormal(0.0, sigma, num_clients)
    with np.errstate(over="ignore"):
        if not np.isfinite(weights.sum() * n):  # exp(sigma z) past float64: NaN shares
            raise _error("data.quantity_sigma", sigma, "the log-normal client sizes overflow (exp(sigma x a normal "
                                                       "draw)); use a smaller sigma (at 5 one client already holds "
                                                       "most samples)")
    sizes = min_size + _apportion(n - min_size * num_clients, weights)
    owner = np.empty(n, dtype=np.int64)
    owner[rng.permutation(n)] = np.repeat(np.arange(num_clients), sizes)
    return _by_owner(owner, num_clients)


# ---------------------------------------------------------------- group schemes
def group_slices(groups: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(group ids ascending, sample indices ordered by group, offsets into that order with a final end):
    group ``ids[i]``'s samples are ``order[starts[i]:starts[i + 1]]``, ascending: the same as
    ``np.flatnonzero(groups == ids[i])``, found for every group by one stable sort instead of one
    scan of all samples per group (which made set-up quadratic in the number of devices)."""
    groups = np.asarray(groups)
    order = np.argsort(groups, kind="stable")
    ids, counts = np.unique(groups[order], return_counts=True)
    return ids, order, np.concatenate([[0], np.cumsum(counts)])


def split_groups(
    groups: np.ndarray, rng: np.random.Generator, clients_per_group: int
) -> tuple[list[np.ndarray], list[int]]:
    """Feature shift by domain / natural device: each group's samples split IID
    over ``clients_per_group`` clients (one client per domain is the usual
    PACS / Office-Home / DomainNet setting, e.g. FedBN, Li et al. ICLR 2021;
    one client per device is FedProx's synthetic data). Returns the client
    indices and each client's group id. Draws one permutation per group, in
    group order."""
    ids, order, starts = group_slices(groups)
    small = np.flatnonzero(np.diff(starts) < clients_per_group)
    if len(small):
        g = small[0]
        raise _error("data.clients_per_domain", clients_per_group,
                     f"group {int(ids[g])} has only {int(starts[g + 1] - starts[g])} training samples")
    owner = np.empty(len(groups), dtype=np.int64)
    for slot in range(len(ids)):
        idx = rng.permutation(order[starts[slot]:starts[slot + 1]])
        owner[idx] = slot * clients_per_group + np.arange(len(idx)) * clients_per_group // len(idx)
    return _by_owner(owner, len(ids) * clients_per_group), [int(g) for g in np.repeat(ids, clients_per_group)]


def group_test(test_groups: np.ndarray, owner: list[int], rng: np.random.Generator) -> list[np.ndarray]:
    """Each client's test split: its group's test samples, split IID among the
    clients of that group (disjoint within a group). Draws one permutation per
    group, in group order."""
    owner_arr = np.asarray(owner, dtype=np.int64)
    out: list[np.ndarray] = [np.zeros(0, dtype=np.int64) for _ in owner]
    if not len(owner_arr):
        return out
    groups, client_order, client_starts = group_slices(owner_arr)
    test_ids, test_order, test_starts = group_slices(np.asarray(test_groups, dtype=np.int64))
    where = np.searchsorted(test_ids, groups)  # group i's test samples: slice where[i] of test_order, if present
    present = where < len(test_ids)
    present[present] = test_ids[where[present]] == groups[present]
    empty = np.zeros(0, dtype=np.int64)
    for i in range(len(groups)):
        clients = client_order[client_starts[i]:client_starts[i + 1]]
        idx = test_order[test_starts[where[i]]:test_starts[where[i] + 1]] if present[i] else empty
        shuffled = rng.permutation(idx)
        if len(clients) == 1:  # the sorted whole: the group's indices as found (the draw is kept for the stream)
            out[clients[0]] = idx.astype(np.int64)
            continue
        for c, chunk in zip(clients, np.array_split(shuffled, len(clients)), strict=True):
            out[c] = np.sort(chunk).astype(np.int64)
    return out


# ----------------------------------------------------------- transform schemes
def rotation_angles(num_clients: int, angles: Sequence[float] | None) -> list[float]:
    """Per-client rotation angles in degrees (RotatedMNIST as FedBR uses it:
    client i of 10 rotated by 15 * i degrees, LINs-lab/FedBR ``RotatedMNIST``).

    Given ``angles``: one per client. Default: evenly spaced over [0, 150),
    ``150 * i / num_clients``, which for FedBR's 10 clients is exactly its
    0, 15, ..., 135 and for other client counts keeps the same range.
    """
    if angles is None:
        return [DEFAULT_ANGLE_RANGE * i / num_clients for i in range(num_clients)]
    return [float(a) for a in angles]


def concept_permutations(num_classes: int, groups: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Label maps of the concept-shift groups (Sattler et al. 2021 swap labels
    per client cluster; FedPAC's concept-shift experiment): group 0 keeps the
    labels, every other group gets its own random permutation, distinct from
    the identity and from the other groups'."""
    perms = [np.arange(num_classes, dtype=np.int64)]
    seen = {tuple(perms[0].tolist())}
    while len(perms) < groups:
        p = rng.permutation(num_classes).astype(np.int64)
        if tuple(p.tolist()) not in seen:
            seen.add(tuple(p.tolist()))
            perms.append(p)
    return perms


# ------------------------------------------------------------ personal tests
def personal_test(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    parts: list[np.ndarray],
    num_classes: int,
    per_client: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Per client, about ``per_client`` test samples whose labels follow the
    client's training label distribution (FedPAC's evaluation: the local test
    set has the local training distribution).

    Class c gets ``per_client * p_i(c)`` samples rounded by largest remainders
    (each count is the floor or ceiling of its exact share, and they sum to
    ``per_client``), drawn without replacement within the client; a class with
    fewer test samples gives all it has.
    """
    order, starts = _class_index(test_labels, num_classes)
    have = np.diff(starts)
    out = []
    for idx in parts:
        counts = np.bincount(train_labels[idx], minlength=num_classes)
        if counts.sum() == 0:
            out.append(np.zeros(0, dtype=np.int64))
            continue
        wanted = np.minimum(_apportion(per_client, counts.astype(np.float64)), have)
        picked = [order[starts[c] + rng.choice(have[c], wanted[c], replace=False)] for c in np.flatnonzero(wanted)]
        out.append(np.sort(np.concatenate(picked)).astype(np.int64) if picked else np.zeros(0, dtype=np.int64))
    return out


# ----------------------------------------------------------------- validation
def _labels(key: str, values: np.ndarray) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise _error(key, f"<array of shape {arr.shape}>", "must be 1-D")
    integral = np.issubdtype(arr.dtype, np.integer) or (  # float labels: finite whole numbers (inf is no label)
        np.issubdtype(arr.dtype, np.floating) and bool(np.all(np.isfinite(arr) & (arr == np.round(arr)))))
    if arr.size and not integral:
        raise _error(key, f"<{arr.dtype} array>", "must hold integer labels")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        raise _error(key, f"<array with minimum {arr.min()}>", "labels must be >= 0")
    return arr


def _int(key: str, value: object, low: int, high: int | None = None, why: str = "") -> int:
    ok = isinstance(value, int | np.integer) and not isinstance(value, bool)
    if not ok or value < low or (high is not None and value > high):
        allowed = f"must be an integer in [{low}, {high}]" if high is not None else f"must be an integer >= {low}"
        raise _error(key, value, allowed + (f" ({why})" if why else ""))
    return int(value)  # type: ignore[arg-type]


def _float(key: str, value: object, low: float, high: float | None = None, *, open_low: bool = False) -> float:
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        x = math.nan
    bad = not math.isfinite(x) or (x <= low if open_low else x < low) or (high is not None and x > high)
    if bad:
        lo = f"> {low:g}" if open_low else f">= {low:g}"
        raise _error(key, value, f"must be a finite number {lo}" + (f" and <= {high:g}" if high is not None else ""))
    return x


# ------------------------------------------------------------------------ entry
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
    group_classes: Sequence[Sequence[int]] | None = None,
    reuse_samples: bool = False,
    quantity_sigma: float = 1.0,
    clients_per_domain: int = 1,
    angles: Sequence[float] | None = None,
    base: str = "iid",
    concept_groups: int = 2,
) -> Partition:
    """Split a dataset over ``num_clients`` clients with scheme ``name``.

    Args:
        name: one of :data:`PARTITIONS`.
        train_labels, test_labels: 1-D integer labels of the two splits.
        num_clients: number of clients.
        seed: the only source of randomness (``numpy.random.default_rng``);
            the training split, the test splits and the label permutations use
            separate child streams, so e.g. changing ``test_per_client`` does
            not change the training split.
        num_classes: number of classes (default: largest label + 1).
        train_groups, test_groups: natural group ids of the samples (domains,
            devices); needed by ``domain`` and ``natural``.
        alpha: Dirichlet concentration (``dirichlet``; ``base="dirichlet"``).
        min_size: minimum training samples per client (``dirichlet``, ``quantity``).
        max_retries: Dirichlet redraws allowed to reach ``min_size``.
        classes_per_client: classes per client (``shards``).
        uniform_share: share of each client's samples drawn uniformly over all
            classes (``dominant``; FedPAC's s = 20 %).
        samples_per_client: training samples per client (``dominant``; default 600).
        test_per_client: personal test samples per client (label schemes);
            default ``len(test) // num_clients``, for ``dominant``
            ``samples_per_client // 2`` (FedPAC: 600 train / 300 test); 0 = default.
        dominant_groups, classes_per_group: FedPAC's client groups and the
            dominant classes of each (``dominant``; 5 and 3 for 10 classes).
        group_classes: the dominant classes of each group, listed (``dominant``;
            FedPAC's EMNIST: digits, upper, lower case); replaces the
            consecutive groups of ``dominant_groups`` / ``classes_per_group``
            (None or ``[]``: those).
        reuse_samples: hand a short class's samples out again instead of
            refusing the split (``dominant``; the authors' code does).
        quantity_sigma: log-normal sigma of client sizes (``quantity``).
        clients_per_domain: clients per domain (``domain``).
        angles: per-client rotation in degrees (``rotation``; default
            :func:`rotation_angles`).
        base: label split under ``rotation`` / ``concept``: ``iid`` or ``dirichlet``.
        concept_groups: client groups with distinct label maps (``concept``;
            client i in group i mod ``concept_groups``).

    Raises:
        PartitionError: a bad setting or an impossible split; the message names
            the parameter (as its ``data.<key>`` config key where it has one).
    """
    if name not in PARTITIONS:
        raise _error("data.partition", name, "allowed: " + ", ".join(PARTITIONS))
    if not isinstance(seed, int | np.integer) or isinstance(seed, bool) or seed < 0:
        raise _error("seed", seed, "must be a non-negative integer")
    train_labels = _labels("train_labels", train_labels)
    test_labels = _labels("test_labels", test_labels)
    n = len(train_labels)
    if n == 0:
        raise _error("train_labels", "<empty array>", "there are no training samples to split")
    top = int(max(train_labels.max(initial=0), test_labels.max(initial=0))) + 1
    num_classes = top if num_classes is None else _int("num_classes", num_classes, top, why="largest label + 1")
    num_clients = _int("data.num_clients", num_clients, 1, n, f"at most the {n} training samples")
    alpha = _float("data.alpha", alpha, 0.0, open_low=True)
    min_size = _int("data.min_size", min_size, 0)
    max_retries = _int("max_retries", max_retries, 1)
    uniform_share = _float("data.uniform_share", uniform_share, 0.0, 1.0)
    quantity_sigma = _float("data.quantity_sigma", quantity_sigma, 0.0)
    dominant_groups = _int("data.dominant_groups", dominant_groups, 1)
    classes_per_group = _int("data.classes_per_group", classes_per_group, 1)
    clients_per_domain = _int("data.clients_per_domain", clients_per_domain, 1)
    concept_groups = _int("data.concept_groups", concept_groups, 1)
    classes_per_client = _int("data.classes_per_client", classes_per_client, 1)
    if samples_per_client is not None:
        samples_per_client = _int("data.samples_per_client", samples_per_client, 1)
    if test_per_client is not None:
        test_per_client = _int("data.test_per_client", test_per_client, 0)
    if base not in BASES:
        raise _error("data.base", base, "allowed: " + ", ".join(BASES))
    label_split = base if name in ("rotation", "concept") else name
    if label_split in ("dirichlet", "quantity") and min_size * num_clients > n:
        raise _error("data.min_size", min_size, f"{num_clients} clients x {min_size} exceeds the {n} training samples")

    train_rng, test_rng, perm_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))
    rotation: list[float] | None = None
    label_perm: list[np.ndarray] | None = None
    group: list[int] | None = None
    default_test = max(1, len(test_labels) // num_clients)

    if name in ("domain", "natural"):
        if train_groups is None or test_groups is None:
            missing = "train_groups" if train_groups is None else "test_groups"
            raise _error("data.partition", name, f"needs a dataset with natural groups (domains or devices); "
                         f"{missing} is None")
        tr_groups = _labels("train_groups", train_groups)
        te_groups = _labels("test_groups", test_groups)
        if len(tr_groups) != n or len(te_groups) != len(test_labels):
            raise _error("train_groups", f"<{len(tr_groups)} / {len(te_groups)} ids>",
                         f"needs one group id per train / test sample ({n} / {len(test_labels)})")
        n_groups = len(np.unique(tr_groups))
        per_group = clients_per_domain if name == "domain" else 1
        if num_clients != n_groups * per_group:
            if name == "natural":
                what = (f"the natural partition makes one client per group and this dataset has {n_groups} groups; "
                        f"set data.num_clients = {n_groups}")
            else:
                what = (f"{n_groups} domains x {per_group} clients per domain (data.clients_per_domain) "
                        f"= {n_groups * per_group} clients")
                if num_clients % n_groups == 0:
                    what += f"; set data.clients_per_domain = {num_clients // n_groups} for {num_clients} clients"
            raise _error("data.num_clients", num_clients, what)
        train, group = split_groups(tr_groups, train_rng, per_group)
        return Partition(train, group_test(te_groups, group, test_rng), group=group, scheme=name)

    if label_split == "iid":
        train = split_iid(train_labels, num_clients, train_rng)
    elif label_split == "dirichlet":
        train = split_dirichlet(train_labels, num_clients, train_rng, alpha, min_size, max_retries)
    elif label_split == "shards":
        if classes_per_client > num_classes:
            raise _error("data.classes_per_client", classes_per_client, f"must be in [1, {num_classes}]")
        train = split_shards(train_labels, num_clients, train_rng, classes_per_client)
    elif label_split == "quantity":
        train = split_quantity(train_labels, num_clients, train_rng, quantity_sigma, min_size)
    else:  # dominant
        given = group_classes is not None and not (isinstance(group_classes, Sequence) and len(group_classes) == 0)
        listed = check_group_classes(group_classes, num_classes) if given else None  # [] = the config's default
        if listed is None and classes_per_group > num_classes:
            raise _error("data.classes_per_group", classes_per_group, f"must be in [1, {num_classes}]")
        samples = samples_per_client or DEFAULT_DOMINANT_SAMPLES
        train, _ = split_dominant(train_labels, num_clients, train_rng, num_classes, samples, uniform_share,
                                  dominant_groups, classes_per_group, listed, bool(reuse_samples))
        group = [i % (dominant_groups if listed is None else len(listed)) for i in range(num_clients)]
        default_test = max(1, samples // 2)

    if name == "rotation":
        if angles is not None:
            angles = list(angles)
            if len(angles) != num_clients:
                raise _error("data.angles", angles, f"needs one angle per client ({num_clients})")
            if not all(isinstance(a, int | float | np.number) and math.isfinite(a) for a in angles):
                raise _error("data.angles", angles, "angles must be finite numbers (degrees)")
        rotation = rotation_angles(num_clients, angles)
    elif name == "concept":
        limit = math.factorial(min(num_classes, 20))  # past 20 classes: more maps than any number of clients
        if concept_groups > min(num_clients, limit):
            maps = limit if num_classes <= 20 else f"{num_classes}!"  # the true count, not the cap
            raise _error("data.concept_groups", concept_groups,
                         f"must be at most the {num_clients} clients and the {maps} label permutations of "
                         f"{num_classes} classes")
        perms = concept_permutations(num_classes, concept_groups, perm_rng)
        group = [i % concept_groups for i in range(num_clients)]
        label_perm = [perms[g].copy() for g in group]

    per_client = test_per_client or default_test
    test = personal_test(train_labels, test_labels, train, num_classes, per_client, test_rng)
    return Partition(train, test, rotation=rotation, label_perm=label_perm, group=group, scheme=name)
