"""Memory a configuration needs, estimated from its sizes before anything is allocated.

A size in the configuration can ask for more memory than the machine has (a
billion synthetic devices, a billion-wide hidden layer, 10**12 local steps).
Left alone, such a run allocates until the operating system or Python gives up,
minutes later, with a traceback and a half-written run directory. Here each
large allocation is estimated from the configuration and the sizes known before
it happens, and :func:`require` refuses with a :class:`ConfigError` naming the
key that drives the estimate, the estimate in GB and the memory available.

The estimates are deliberately low (what the allocation needs at least), and
the comparison is against all the memory the process could get (available RAM
plus free swap, capped by a cgroup limit or an rlimit): only what clearly cannot
fit is refused. Legitimate big runs on a GPU machine are unaffected: the model's
copies are counted in host memory only on the CPU device; on CUDA the host holds
one copy (the model is built there first) and the device must hold the copies.

What is estimated, and when ``Experiment.__init__`` checks it:

* the dataset (before it is built): FedProx's Synthetic data from its options
  (:func:`synthetic_bytes`), image datasets from their fixed sample counts and
  the image side (:func:`known_dataset`);
* the dominant partition's per-group class lists (before the dataset);
* the local step plan (before the dataset in step mode, after the partition in
  epoch mode): ``engine.schedule.batch_schedule`` materialises every step's index
  tensor of a client's stage at once (:func:`plan_bytes`);
* the model (before it is built): parameters counted on PyTorch's ``meta``
  device, which allocates nothing (:func:`count_parameters`).

Activation memory (batch size x layer widths) and per-client states kept by
stateful methods are not estimated: they depend on the method and fail inside
training, where the vectorised executor already halves its chunk on running out.
"""

from __future__ import annotations

import math
import os
import resource
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hetfl.data.datasets import checked_options, dataset_options
from hetfl.data.datasets.idx import EMNIST_CLASSES
from hetfl.models.meta import meta_model
from hetfl.params import ConfigError

GB = 1e9
#: (key that drives it, the key's value, bytes, what needs it)
Need = tuple[str, Any, int, str]

#: Bytes per step of a materialised step plan beyond its indices: one index tensor view (the Python
#: object and its TensorImpl) in the plan's list. Measured with RSS over 200,000-step plans: 62-78
#: bytes per step with large clients, more with small ones (a permutation per pass); 64 is the floor.
STEP_BYTES = 64
#: Copies of the model's parameters a run holds at once (float32): the model, the server state,
#: a client's working state, and its gradients (momentum and method states come on top).
MODEL_COPIES = 4
#: Bytes per synthetic device beyond its samples: its group name, its client's index arrays in the
#: partition and their tensors (train and test indices, the test split's two views).
DEVICE_BYTES = 2048


# ------------------------------------------------------------------ what is available
def _meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (empty where there is none)."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            out[name] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return out


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (cgroup v2) = no limit


def _process_vm(field: str) -> int:
    """A ``/proc/self/status`` size (``VmSize``, ``VmData``) in bytes; 0 where unknown."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def available_memory() -> int | None:
    """Bytes this process could still obtain, or None where that is unknown (then nothing is refused).

    Linux: ``MemAvailable`` plus free swap, capped by the cgroup's memory limit (v2 ``memory.max``,
    v1 ``memory.limit_in_bytes``) and by the headroom under ``RLIMIT_AS``/``RLIMIT_DATA``. Other
    POSIX systems: the physical memory (``os.sysconf``), available pages where reported.
    """
    limits: list[int] = []
    info = _meminfo()
    if "MemAvailable" in info:
        limits.append(info["MemAvailable"] + info.get("SwapFree", 0))
    else:
        try:
            name = "SC_AVPHYS_PAGES" if "SC_AVPHYS_PAGES" in os.sysconf_names else "SC_PHYS_PAGES"
            limits.append(os.sysconf(name) * os.sysconf("SC_PAGE_SIZE"))
        except (AttributeError, ValueError, OSError):
            pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        limit = _read_int(path)
        if limit is not None and limit < 2**60:  # v1 writes a huge number for "no limit"
            limits.append(limit)
    for which, field in ((resource.RLIMIT_AS, "VmSize"), (getattr(resource, "RLIMIT_DATA", None), "VmData")):
        if which is None:
            continue
        soft, _ = resource.getrlimit(which)
        if soft != resource.RLIM_INFINITY:
            limits.append(max(0, soft - _process_vm(field)))
    return min(limits) if limits else None


_AUTO: Any = object()


def require(needs: Iterable[Need], available: int | None = _AUTO) -> None:
    """Refuse ``needs`` whose total exceeds ``available`` (default: :func:`available_memory`) with a
    ConfigError naming the key of the largest need, the estimate and what is available."""
    needs = [n for n in needs if n[2] > 0]
    if not needs:
        return
    if available is _AUTO:
        available = available_memory()
    total = sum(n[2] for n in needs)
    if available is None or total <= available:
        return
    key, value, need, what = max(needs, key=lambda n: n[2])
    rest = total - need
    others = f" (with {_size(rest)} more for the rest)" if rest >= 0.05 * GB else ""
    raise ConfigError(key, value, f"{what} needs about {_size(need)} of memory{others}, more than the "
                                  f"{_size(available)} available on this machine; lower it")


def _size(nbytes: float) -> str:
    """Bytes as GB with one decimal (MB below 0.1 GB)."""
    return f"{nbytes / GB:.1f} GB" if nbytes >= 0.1 * GB else f"{nbytes / 1e6:.1f} MB"


# ------------------------------------------------------------------ datasets
def expected_device_samples(max_samples: int) -> float:
    """Mean samples of a synthetic device: ``E[min(floor(L) + 50, max_samples)]``, ``L ~ lognormal(4, 2)``
    (FedProx's power law, see ``hetfl.data.datasets.synthetic``); ``max_samples = 0``: no cap."""
    mu, sigma = 4.0, 2.0
    mean = math.exp(mu + sigma**2 / 2)
    if max_samples == 0:
        return mean + 50
    cap = max_samples - 50
    if cap <= 0:
        return float(max_samples)

    def phi(z: float) -> float:
        return 0.5 * (1 + math.erf(z / math.sqrt(2)))

    log_cap = math.log(cap)
    below = mean * phi((log_cap - mu - sigma**2) / sigma)  # E[L; L < cap]
    return below + cap * (1 - phi((log_cap - mu) / sigma)) + 50


def synthetic_bytes(options: Mapping[str, Any]) -> int:
    """Peak bytes of generating FedProx's Synthetic data with these (resolved) loader options, and
    splitting it over its devices.

    Each device's rows are written straight into the train and test arrays (allocated once), so
    the float32 features exist once, next to int64 labels and device ids and the partition's
    int64 index of every sample with its sort's transients (three int64 a sample); then the
    per-device overhead and the float64 temporaries of one device (its model ``W_k`` and the
    shared one, ``classes x dim`` each; its samples before the float32 cast). Measured at 10,000
    devices (``benchmarks/device_scale.py``): peak RSS less the
    interpreter's is 1.2x the arrays; this estimate is 1.09x them.
    """
    devices, dim, classes = int(options["num_devices"]), int(options["dim"]), int(options["num_classes"])
    max_samples = int(options["max_samples"])
    samples = devices * expected_device_samples(max_samples)
    largest = max_samples or 50_000
    data = samples * (4 * dim + 2 * 8 + 3 * 8)  # features, label and device id; partition index and sort
    temporaries = 8 * (2 * classes * dim + 3 * dim + 2 * min(largest, samples) * dim)
    return int(data + temporaries + devices * DEVICE_BYTES)


@dataclass(frozen=True)
class KnownDataset:
    """Sizes of a dataset known without reading it: input shape, classes, samples (train + test; a lower
    bound where the files decide)."""

    input_shape: tuple[int, ...]
    num_classes: int
    samples: int

    @property
    def nbytes(self) -> int:
        return self.samples * math.prod(self.input_shape)  # uint8 images


# (channels, native side, classes, train + test samples); side 0 = the first image's, samples 1 = at least one
_IMAGES: dict[str, tuple[int, int, int, int]] = {
    "mnist": (1, 28, 10, 70_000), "fmnist": (1, 28, 10, 70_000),
    "cifar10": (3, 32, 10, 60_000), "cifar100": (3, 32, 100, 60_000), "cinic10": (3, 32, 10, 180_000),
    "stl10": (3, 96, 10, 13_000), "tinyimagenet": (3, 64, 200, 110_000),
    "pacs": (3, 96, 7, 9_991), "officehome": (3, 96, 65, 15_588), "domainnet": (3, 96, 345, 586_575),
    "imagefolder": (3, 0, 2, 1),
}
_EMNIST_SAMPLES = {"balanced": 131_600, "byclass": 814_255, "bymerge": 814_255, "letters": 145_600,
                   "digits": 280_000, "mnist": 70_000}


def known_dataset(name: str, options: Mapping[str, Any]) -> KnownDataset | None:
    """Sizes of dataset ``name`` with (raw, validated or not) ``options``; None where unknown."""
    opts = checked_options(name, options)
    if name == "synthetic":
        samples = int(opts["num_devices"] * expected_device_samples(opts["max_samples"]))
        return KnownDataset((opts["dim"],), opts["num_classes"], samples)
    if name == "emnist":
        split = opts["split"]
        return KnownDataset((1, 28, 28), len(EMNIST_CLASSES[split]), _EMNIST_SAMPLES[split])
    if name not in _IMAGES:
        return None
    channels, side, classes, samples = _IMAGES[name]
    channels = opts.get("channels", channels)
    side = opts.get("image_size") or side
    return KnownDataset((channels, side, side), classes, samples) if side else None


def dataset_needs(name: str, options: Mapping[str, Any]) -> list[Need]:
    """The dataset's memory, blamed on the option that, put back to its default, shrinks it most."""
    opts = checked_options(name, options)

    def size(values: Mapping[str, Any]) -> int:
        if name == "synthetic":
            return synthetic_bytes(values)
        known = known_dataset(name, values)
        return known.nbytes if known is not None else 0

    need = size(opts)
    if need == 0:
        return []
    defaults = dataset_options(name)
    candidates = [k for k in options if k in defaults and options[k] != defaults[k]]
    shrunk = {k: size({**opts, k: defaults[k]}) for k in candidates}
    key = min(shrunk, key=lambda k: shrunk[k]) if shrunk else None
    if key is None:
        return [("data.dataset", name, need, f"the {name} data")]
    return [(f"data.options.{key}", options[key], need, f"the {name} data")]


# ------------------------------------------------------------------ step plan
def plan_bytes(local_steps: int, local_epochs: int, batch_size: int, client_sizes: Iterable[int] | None,
               clients: int) -> int:
    """Bytes of the materialised local step plans of ``clients`` clients trained at once.

    Step mode: ``local_steps`` index views of ``min(batch_size, n)`` int64 indices each (the
    permutation they view is spread over its batches). Epoch mode: a permutation of the client's
    ``n`` samples and its ``ceil(n / batch_size)`` views per epoch. ``n`` is the largest client
    (unknown before the partition: the views alone).
    """
    n = max(client_sizes, default=0) if client_sizes is not None else 0
    if local_steps:
        per_client = local_steps * (STEP_BYTES + 8 * min(batch_size, n))
    else:
        per_client = local_epochs * (8 * n + STEP_BYTES * math.ceil(n / batch_size))
    return per_client * max(clients, 1)


def plan_need(train: Any, client_sizes: Iterable[int] | None, clients: int) -> Need:
    """The step plan as a need, blamed on ``train.local_steps`` or ``train.local_epochs``."""
    need = plan_bytes(train.local_steps, train.local_epochs, train.batch_size, client_sizes, clients)
    if train.local_steps:
        return ("train.local_steps", train.local_steps, need, "the local step plan")
    return ("train.local_epochs", train.local_epochs, need, "the local step plan")


def clients_at_once(cfg: Any, vmap: bool) -> int:
    """Clients whose step plans exist together: one, or a round's chunk when they are vmapped."""
    if not vmap:
        return 1
    per_round = cfg.train.clients_per_round or cfg.data.num_clients
    return min(per_round, cfg.runtime.chunk_size or per_round)


# ------------------------------------------------------------------ model
def count_parameters(name: str, input_shape: tuple[int, ...], num_classes: int, options: Mapping[str, Any]) -> int:
    """Parameters of model ``name`` counted on the ``meta`` device (nothing allocated).

    A ModelError for bad options propagates (the same the real build would raise); -1 where a
    model cannot be built on the meta device (then nothing is refused).
    """
    model = meta_model(name, input_shape, num_classes, options)
    if model is None:
        return -1
    return sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())


def model_needs(name: str, options: Mapping[str, Any], input_shape: tuple[int, ...], num_classes: int,
                device: torch.device) -> tuple[list[Need], list[Need]]:
    """(host needs, device needs) of the model's float32 copies: all on the CPU device; on an
    accelerator one on the host (built there first) and :data:`MODEL_COPIES` on the device."""
    count = count_parameters(name, input_shape, num_classes, options)
    if count <= 0:
        return [], []
    key, value = ("model.options", dict(options)) if options else ("model.name", name)
    what = f"the model {name} ({count:,} parameters)"
    if device.type == "cpu":
        return [(key, value, 4 * count * MODEL_COPIES, what)], []
    return [(key, value, 4 * count, what)], [(key, value, 4 * count * MODEL_COPIES, what)]


def device_memory(device: torch.device) -> int | None:
    """Total memory of an accelerator (None for the CPU or where unknown)."""
    if device.type != "cuda":
        return None
    try:
        return int(torch.cuda.get_device_properties(device).total_memory)
    except (RuntimeError, AssertionError):
        return None


# ------------------------------------------------------------------ partition
def partition_needs(data: Any) -> list[Need]:
    """The dominant split's class lists: one list of ``classes_per_group`` ints per group
    (``data.partition.dominant_classes``; 64 bytes per list and 8 per entry at least), or the lists
    ``data.group_classes`` gives (already held by the configuration)."""
    if data.partition != "dominant" or data.group_classes:
        return []
    need = data.dominant_groups * (64 + 8 * data.classes_per_group)
    return [("data.dominant_groups", data.dominant_groups, need, "the dominant partition's groups")]


# ------------------------------------------------------------------ the checks
def config_estimates(cfg: Any, vmap: bool = False) -> list[Need]:
    """What the configuration alone says about memory: the dataset, the partition's groups, and the
    step plan in step mode."""
    needs = dataset_needs(cfg.data.dataset, cfg.data.options) + partition_needs(cfg.data)
    if cfg.train.local_steps:
        needs.append(plan_need(cfg.train, None, clients_at_once(cfg, vmap)))
    return needs


def check_config(cfg: Any, vmap: bool = False) -> None:
    """Before the dataset is built: refuse a dataset or step plan that cannot fit."""
    require(config_estimates(cfg, vmap))


def check_plan(cfg: Any, client_sizes: Iterable[int], vmap: bool) -> None:
    """After the partition: refuse a step plan (epochs over the largest client) that cannot fit."""
    require([plan_need(cfg.train, list(client_sizes), clients_at_once(cfg, vmap))])


def check_model(cfg: Any, input_shape: tuple[int, ...], num_classes: int, device: torch.device) -> None:
    """Before the model is built: refuse a model whose copies cannot fit in host (or device) memory."""
    host, on_device = model_needs(cfg.model.name, cfg.model.options, input_shape, num_classes, device)
    require(host)
    if on_device:
        require(on_device, device_memory(device))
