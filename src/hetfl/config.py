"""The run configuration: one typed object, loaded from TOML, overridden by ``--set``.

Keys are the outside contract of DESIGN.md (``seed``, ``algorithm.name``,
``data.dataset``, ``train.lr`` ...). Every key is validated before anything is
written: unknown keys and out-of-range values raise :class:`ConfigError`.
Method hyperparameters live under ``algorithm.`` (``algorithm.mu``); the
settings of a post-hoc step live in a sub-table named after it
(``algorithm.ccvr.num_virtual``) and are validated by the method itself.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from hetfl.params import FLOAT32_MAX, ConfigError, build, did_you_mean, setting, to_dict

DATASET_NAMES = (
    "synthetic", "mnist", "fmnist", "emnist", "cifar10", "cifar100", "cinic10", "stl10",
    "tinyimagenet", "imagefolder", "pacs", "officehome", "domainnet", "ham10000",
)
PARTITION_NAMES = (
    "auto", "iid", "dirichlet", "shards", "dominant", "quantity", "domain", "natural",
    "rotation", "concept",
)


@dataclass(frozen=True)
class DataConfig:
    dataset: str = setting("synthetic", choices=DATASET_NAMES, doc="dataset name")
    root: str = setting("", doc="local folder with the dataset files ('' = ~/.cache/hetfl/data/<name>)")
    cache_dir: str = setting("", doc="folder for decoded datasets, keyed by a fingerprint of the source files "
                                     "('' = $XDG_CACHE_HOME/hetfl/datasets, else ~/.cache/hetfl/datasets), and "
                                     "for generated ones (VHL's virtual set); never written next to the data, "
                                     "which may be read-only")
    download: bool = setting(True, doc="download missing files from the official source")
    options: dict = setting({}, doc="loader options, e.g. {alpha = 1.0, beta = 1.0} for synthetic")
    partition: str = setting("auto", choices=PARTITION_NAMES,
                             doc="client split; auto = natural for datasets with groups, else dirichlet")
    num_clients: int = setting(30, ge=1, doc="number of clients")
    alpha: float = setting(0.5, gt=0.0, doc="Dirichlet concentration (dirichlet, rotation/concept base)")
    min_size: int = setting(10, ge=0, doc="minimum training samples per client (dirichlet, quantity)")
    classes_per_client: int = setting(2, ge=1, doc="classes per client (shards)")
    uniform_share: float = setting(0.2, ge=0.0, le=1.0, doc="share drawn uniformly over classes (dominant)")
    samples_per_client: int = setting(600, ge=1, doc="training samples per client (dominant)")
    test_per_client: int = setting(0, ge=0, doc="personal test samples per client (0 = scheme default)")
    dominant_groups: int = setting(5, ge=1, doc="client groups (dominant)")
    classes_per_group: int = setting(3, ge=1, doc="dominant classes per group (dominant)")
    group_classes: list[list[int]] = setting(
        [], doc="the dominant classes of each group, listed, e.g. [[0, 1, 2], [3, 4]] (dominant; [] = "
                "dominant_groups runs of classes_per_group consecutive classes)")
    reuse_samples: bool = setting(
        False, doc="hand a class's samples out again when the clients need more than exist, none twice to one "
                   "client, as FedPAC's code does (dominant; false: such a split is an error)")
    quantity_sigma: float = setting(1.0, ge=0.0, doc="log-normal sigma of client sizes (quantity; 0: equal sizes)")
    clients_per_domain: int = setting(1, ge=1, doc="clients per domain (domain)")
    angles: list[float] = setting([], doc="per-client rotation angles in degrees (rotation; [] = spread)")
    base: str = setting("iid", choices=("iid", "dirichlet"), doc="label split under rotation/concept")
    concept_groups: int = setting(2, ge=1, doc="client groups with distinct label permutations (concept)")
    augment: str = setting("auto", choices=("auto", "none", "crop_flip", "flip"),
                           doc="batched train augmentation; auto = crop_flip for RGB images of 32-96 px")

    def check(self, prefix: str = "data.") -> None:
        """Explicit dominant groups replace the consecutive ones: ``dominant_groups`` and ``classes_per_group``
        moved as well would be ignored, so that is refused (the classes themselves are checked against the
        dataset by :func:`hetfl.data.partition.make_partition`)."""
        if not self.group_classes:
            return
        for key, default in (("dominant_groups", 5), ("classes_per_group", 3)):
            if getattr(self, key) != default:
                raise ConfigError(prefix + key, getattr(self, key),
                                  f"has no effect with {prefix}group_classes set (its {len(self.group_classes)} "
                                  f"lists are the groups and their classes); leave {prefix}{key} at {default}")


@dataclass(frozen=True)
class ModelConfig:
    name: str = setting("auto", doc="model name (see `hetfl list`); auto = picked for the dataset")
    options: dict = setting({}, doc="model options, e.g. {norm = 'gn'} or {hidden = []}")


@dataclass(frozen=True)
class TrainConfig:
    rounds: int = setting(20, ge=1, doc="communication rounds")
    clients_per_round: int = setting(0, ge=0, doc="clients sampled per round (0 = all)")
    local_epochs: int = setting(1, ge=1, doc="local epochs per round")
    local_steps: int = setting(0, ge=0, doc="fixed local steps per round instead of epochs (0 = epochs)")
    batch_size: int = setting(32, ge=1, doc="local batch size")
    drop_last: bool = setting(False, doc="drop each client's last incomplete batch")
    lr: float = setting(0.05, gt=0.0, lt=FLOAT32_MAX, doc="client learning rate")
    lr_schedule: str = setting("constant", choices=("constant", "cosine"),
                               doc="client lr over rounds")
    lr_min: float = setting(0.0, ge=0.0, doc="floor of the cosine schedule (reached after the last round)")
    momentum: float = setting(0.0, ge=0.0, lt=1.0, doc="client SGD momentum")
    weight_decay: float = setting(0.0, ge=0.0, lt=FLOAT32_MAX, doc="client SGD weight decay")
    max_grad_norm: float = setting(0.0, ge=0.0, doc="clip each client's gradient norm (0 = off)")
    weighting: str = setting(
        "size", choices=("size", "uniform"),
        doc="server weights of a round's clients in the methods that average by data size: size (n_i / n, "
            "FedAvg's) or uniform (1/M, FedBR's Algorithm 1 and its code); SCAFFOLD, FedDyn and GroupDRO over "
            "clients keep their own weights, FedBR's algorithm.weighting wins (a contradiction is refused), "
            "FedNova refuses uniform")
    precision: str = setting("fp32", choices=("fp32", "bf16"),
                             doc="local training's forward pass: float32, or bfloat16 autocast (parameters, "
                                 "gradients and optimiser stay float32)")
    eval_every: int = setting(1, ge=1, doc="evaluate every this many rounds (and at the last)")
    eval_batch_size: int = setting(1024, ge=1, doc="batch size of evaluation")

    def check(self, prefix: str = "train.") -> None:
        """Constraints between keys: the cosine schedule decays from ``lr`` down to ``lr_min``
        (a floor above the start would make the lr climb, to 2.5 from 0.05 with ``lr_min = 5``)."""
        if self.lr_schedule == "cosine" and self.lr_min > self.lr:
            raise ConfigError(prefix + "lr_min", self.lr_min,
                              f"must be <= {prefix}lr = {self.lr} under the cosine schedule (it is the floor)")


#: when the Flower executor's settings are read (``setting(when=...)``; a run elsewhere notes them as having no effect)
ON_FLOWER = {"executor": ("flower",)}
SECAGG_ON_FLOWER = {"executor": ("flower",), "secure_aggregation": (True,)}


@dataclass(frozen=True)
class RuntimeConfig:
    executor: str = setting("sequential", choices=("sequential", "vectorized", "flower"),
                            doc="clients one after another, a round's clients as one vmapped computation, "
                                "or the clients on Flower's simulation engine (pip install \"hetfl[flower]\")")
    chunk_size: int = setting(0, ge=0, doc="vectorized: most clients trained at once (0 = as many as fit in the "
                                           "free GPU memory, halved on running out; all of a round on a CPU)")
    cuda_graph: bool = setting(True, doc="vectorized on CUDA: capture each block of steps as a CUDA graph, kept "
                                         "across rounds and checked once against an eager run (falls back to "
                                         "eager steps with a logged reason); ignored on other devices")
    graph_steps: int = setting(
        4, ge=1, le=1024,
        doc="vectorized: most steps of one call (one CUDA graph on CUDA): longer calls launch less often, shorter "
            "ones are fewer shapes to capture in the first round, each run twice in Python there (the same "
            "numbers either way; benchmarks/graph_shapes.py counts both)")
    channels_last: bool = setting(
        False, doc="vectorized on CUDA: image batches laid out channels-last for cuDNN (the same values; off: "
                   "measured 7-15% slower on an H100 with cnn2, benchmarks/results/throughput_cuda.md)")
    conv_batching: str = setting(
        "grouped", choices=("grouped", "per_client"),
        doc="vectorized: how vmap runs a convolution of per-client weights: one grouped convolution (PyTorch's "
            "rule), or one ordinary convolution per client (the kernels of a sequential step; "
            "benchmarks/throughput.py measures which is faster on a device)")
    compile: bool = setting(
        False, doc="vectorized: each step's gradients by torch.compile (Inductor fuses the step's elementwise ops, "
                   "pooling and layout copies into few kernels; a compile of seconds per step shape of full batches, "
                   "in the first rounds; a step it cannot compile runs uncompiled, with the reason logged; "
                   "torch >= 2.5)")
    vmap_on_cpu: bool = setting(
        False, doc="vectorized on a CPU device: vmap the clients anyway (default: one at a time, which is "
                   "faster on CPU; see benchmarks/vmap_cpu_profile.py)")
    device: str = setting("auto", doc="auto (the environment variable HETFL_DEVICE when set, else cuda when "
                                      "present), cpu, cuda, or cuda:N (GPU N of those present)")
    checkpoint_every: int = setting(1, ge=0, doc="checkpoint every this many rounds (0 = never)")
    client_metrics_every: int = setting(
        1, ge=0, doc="write every client's accuracy to client_metrics.jsonl on the evaluated rounds that are "
                     "multiples of this, and the last (0 = never; metrics.jsonl always has their mean, std "
                     "and quartiles). Output only: not part of a run's identity")
    threads: int = setting(0, ge=0, le=1024, doc="torch CPU threads, process-wide (0 = auto: one thread for a small "
                                                 "training step on a CPU device, torch's default for a large one)")
    keep_freed_memory: bool = setting(
        True, doc="on a CPU device with glibc's malloc: keep the memory of freed tensors in the process for the "
                  "next step (mallopt), instead of giving it back to the system and page-faulting it in again at "
                  "every step (1.2x a round of a small CNN); process-wide, given back when a run ends; left as it "
                  "is where MALLOC_* variables, GLIBC_TUNABLES or LD_PRELOAD choose. Changes no number")
    progress: bool = setting(True, doc="progress bars and summary table on the terminal")
    save_client_models: tuple[int, ...] = setting(
        (), doc="rounds after which every participating client's local model is saved (layer-wise CKA)")
    flower_timeout_s: float = setting(600.0, gt=0.0, when=ON_FLOWER,
                                      doc="flower: seconds the server waits for a phase's replies")
    flower_min_replies: int = setting(1, ge=0, when=ON_FLOWER, doc="flower: fewest clients of a round that must "
                                                                   "answer for the run to go on (0 = all of them)")
    flower_grace_s: float = setting(
        math.inf, ge=0.0, finite=False, when=ON_FLOWER,
        doc="flower: once flower_min_replies clients have answered a phase, seconds it waits for the others "
            "before it goes on without them (a straggler or a dead node then costs this, not flower_timeout_s; "
            "which clients a round counts then depends on timing). inf = every reply, up to flower_timeout_s")
    flower_client_cpus: float = setting(1.0, gt=0.0, when=ON_FLOWER, doc="flower simulation: CPUs per client (Ray)")
    flower_client_gpus: float = setting(0.0, ge=0.0, when=ON_FLOWER, doc="flower simulation: GPUs per client (Ray)")
    secure_aggregation: bool = setting(
        False, doc="sum an additive post-hoc step's replies (CCVR's statistics) under secure aggregation: the "
                   "server learns their sum only (Flower's SecAgg+ on the flower executor, simulated exactly in "
                   "process otherwise); entries in fixed point within a public bound (docs/secure_aggregation.md)")
    secagg_num_shares: int = setting(
        5, ge=3, when=SECAGG_ON_FLOWER,
        doc="secure aggregation on flower: SecAgg+'s neighbours per client, itself included (the shares of its keys; "
            "all clients when >= data.num_clients). More: more dropouts survived, more work")
    secagg_reconstruction_threshold: int = setting(
        3, ge=2, when=SECAGG_ON_FLOWER,
        doc="secure aggregation on flower: shares needed to rebuild a client's keys; < secagg_num_shares and <= "
            "data.num_clients. Every client must keep this many of its neighbours through the protocol; fewer than "
            "this many colluding with the server learn nothing of a client's reply. Defaults 5 / 3: one dropout "
            "among 10 clients is survived")

    def check(self, prefix: str = "runtime.") -> None:
        """The form of ``device`` (whether GPU N is present is checked when the run is set up)."""
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            gpu = re.fullmatch(r"(?i)gpu(:[0-9]+)?", self.device)  # PyTorch calls a GPU cuda
            meant = (f"did you mean 'cuda{gpu.group(1) or ''}'? " if gpu
                     else did_you_mean(self.device, ("auto", "cpu", "cuda")))
            raise ConfigError(prefix + "device", self.device, meant + "allowed: auto, cpu, cuda, cuda:N (N = 0, 1, "
                                                                      "...: the index of a GPU present)")
        if self.secure_aggregation and self.secagg_reconstruction_threshold >= self.secagg_num_shares:
            raise ConfigError(prefix + "secagg_reconstruction_threshold", self.secagg_reconstruction_threshold,
                              f"must be < {prefix}secagg_num_shares = {self.secagg_num_shares} (and >= 2)")


@dataclass(frozen=True)
class TrackingConfig:
    """Optional experiment tracking (:mod:`hetfl.tracking`): what a run also sends to TensorBoard and
    MLflow. Off by default; none of these keys changes a run's numbers, so none is part of its identity
    (``identity.PRESENTATION_KEYS``): a run resumed or compared with tracking switched on is the same run."""

    tensorboard: bool = setting(False, doc="also write TensorBoard events: each round's numbers (step = round), "
                                           "the config as text, the summary as hparams (pip install "
                                           "\"hetfl[tensorboard]\")")
    tensorboard_dir: str = setting("", doc="TensorBoard log root shared by runs: events go to <it>/<run name> "
                                           "('' = <run folder>/tensorboard)")
    mlflow: bool = setting(False, doc="also log to MLflow: config as params, each round's numbers (step = "
                                      "round), the summary, the run's files as artifacts (pip install "
                                      "\"hetfl[mlflow]\")")
    mlflow_uri: str = setting("", doc="MLflow tracking URI or store path ('' = MLflow's own choice: "
                                      "$MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the current folder, "
                                      "the store `mlflow ui` opens there)")
    experiment: str = setting("hetfl", doc="MLflow experiment the run is logged under")
    run_name: str = setting("", doc="name of the MLflow run and TensorBoard subfolder ('' = the run folder's name)")

    def check(self, prefix: str = "tracking.") -> None:
        """Names MLflow and TensorBoard can hold: a non-empty experiment, a run name of at most 250
        characters (MLflow's limit), no surrounding blanks (they would make two names look alike)."""
        if not self.experiment.strip():
            raise ConfigError(prefix + "experiment", self.experiment, "must be a non-empty MLflow experiment name")
        for key in ("experiment", "run_name", "mlflow_uri", "tensorboard_dir"):
            value = getattr(self, key)
            if value != value.strip():
                raise ConfigError(prefix + key, value, "must not start or end with blanks")
        if len(self.run_name) > 250 or "/" in self.run_name:
            raise ConfigError(prefix + "run_name", self.run_name,
                              "must be at most 250 characters without '/' ('' = the run folder's name)")


@dataclass(frozen=True)
class AlgorithmConfig:
    name: str = "fedavg"
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RunConfig:
    seed: int = setting(0, ge=0, doc="seed of every random stream")
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


SECTIONS = {"data": DataConfig, "model": ModelConfig, "train": TrainConfig, "runtime": RuntimeConfig,
            "tracking": TrackingConfig}


def parse_value(text: str) -> Any:
    """A ``--set`` value: TOML syntax when it parses (numbers, booleans, lists,
    quoted strings, inline tables), otherwise the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(tree: dict[str, Any], assignment: str) -> None:
    """Apply one ``KEY=VALUE`` override (dotted key) to a nested dict in place."""
    if "=" not in assignment:
        raise ConfigError("--set", assignment, "must look like KEY=VALUE, e.g. train.lr=0.01")
    key, _, text = assignment.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError("--set", assignment, "the key must be dotted names, e.g. train.lr")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[: i + 1]), child, "is a value, not a table")
        node = child
    node[parts[-1]] = parse_value(text.strip())


#: the key that names what a section is (``algorithm = "fedprox"`` means ``algorithm.name = "fedprox"``)
_NAMING_KEY = {"algorithm": "name", "data": "dataset", "model": "name"}


def _not_a_table(section: str, value: Any) -> ConfigError:
    """The error for a section given a plain value (``--set algorithm=fedprox``), with the key likely meant."""
    key = _NAMING_KEY.get(section)
    meant = f"did you mean {section}.{key} = {value!r}? " if key and isinstance(value, str) else ""
    example = f", such as {section}.{key}" if key else ""
    return ConfigError(section, value, f"{meant}must be a table of settings ({section}.KEY=VALUE with --set{example}, "
                                       f"[{section}] in a TOML file)")


def from_dict(tree: dict[str, Any]) -> RunConfig:
    """Validate a nested dict into a RunConfig (algorithm params validated later by the method)."""
    allowed = {"seed", "algorithm", *SECTIONS}
    for key in tree:
        if key not in allowed:
            raise ConfigError(key, tree[key], "unknown key; " + did_you_mean(key, sorted(allowed)) + "allowed: "
                              + ", ".join(sorted(allowed)))
    sections = {}
    for name, cls in SECTIONS.items():
        value = tree.get(name, {})
        if not isinstance(value, dict):
            raise _not_a_table(name, value)
        sections[name] = build(cls, value, prefix=name + ".")
    algo = tree.get("algorithm", {})
    if not isinstance(algo, dict):
        raise _not_a_table("algorithm", algo)
    algo = dict(algo)
    name = algo.pop("name", "fedavg")
    if not isinstance(name, str):
        raise ConfigError("algorithm.name", name, "must be a string such as 'fedavg' or 'fedavg+ccvr'")
    top = build(_Top, {k: v for k, v in tree.items() if k == "seed"})
    cfg = RunConfig(seed=top.seed, algorithm=AlgorithmConfig(name, algo), **sections)
    check_across(cfg)
    return cfg


def check_across(cfg: RunConfig) -> None:
    """Constraints between keys of different sections, as ConfigErrors naming the key to change
    (those within one section are the section's ``check``)."""
    t, d = cfg.train, cfg.data
    if t.clients_per_round > d.num_clients:
        raise ConfigError("train.clients_per_round", t.clients_per_round,
                          f"must be <= data.num_clients = {d.num_clients} (0 = all)")
    if d.partition == "rotation" and d.dataset == "synthetic":
        raise ConfigError("data.partition", d.partition, "rotates images; synthetic has feature vectors")
    rt = cfg.runtime
    if rt.secure_aggregation and rt.secagg_reconstruction_threshold > d.num_clients:
        raise ConfigError("runtime.secagg_reconstruction_threshold", rt.secagg_reconstruction_threshold,
                          f"must be <= data.num_clients = {d.num_clients} under runtime.secure_aggregation "
                          "(every client needs this many of its neighbours), and >= 2")
    late = [r for r in cfg.runtime.save_client_models if not 1 <= r <= t.rounds]
    if late:
        raise ConfigError("runtime.save_client_models", list(cfg.runtime.save_client_models),
                          f"must be rounds between 1 and train.rounds = {t.rounds} ({late} never happen)")


@dataclass(frozen=True)
class _Top:
    seed: int = setting(0, ge=0)


def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a TOML file (optional), apply ``--set`` overrides, validate."""
    return from_tree({} if path is None else read_tree(path), overrides)


def read_tree(path: str | Path) -> dict[str, Any]:
    """A configuration file's TOML as a tree, unvalidated; ConfigError naming the file where it cannot be read."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("CONFIG", str(path), "no such file")
    try:
        tree = tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError("CONFIG", str(path), f"not UTF-8 text (byte {err.start}: {err.reason}); TOML files "
                                               "are UTF-8, save it with that encoding") from None
    except OSError as err:
        raise ConfigError("CONFIG", str(path), f"cannot be read ({err.strerror or err})") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError("CONFIG", str(path), f"not valid TOML ({err})") from None
    if isinstance(tree.get("preset"), dict):
        raise PresetFileError(path)
    return tree


def from_tree(tree: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """A configuration tree with ``--set`` overrides applied (to the tree itself), validated."""
    for assignment in overrides:
        apply_override(tree, assignment)
    return from_dict(tree)


class PresetFileError(ConfigError):
    """A reproduction preset (a TOML file with a ``[preset]`` table, see :mod:`hetfl.reproduce`) given where a run
    configuration is expected. The message names the command that runs it: ``hetfl reproduce NAME``, where
    ``name`` is the preset's name for a preset of the presets' folder (which :mod:`hetfl.reproduce` knows and
    :func:`hetfl.api.make_config` asks; the configuration does not know where presets live), else its path."""

    def __init__(self, path: Path, name: str | None = None) -> None:
        self.path = path
        super().__init__("CONFIG", str(path),
                         f"a reproduction preset (hetfl reproduce NAME), not a run configuration; run it with "
                         f"`hetfl reproduce {name or path}` (add --quick for its small CPU variant)")


def to_tree(cfg: RunConfig) -> dict[str, Any]:
    """RunConfig -> nested dict in the TOML layout (algorithm params flattened in)."""
    tree = to_dict(cfg)
    algo = tree.pop("algorithm")
    tree["algorithm"] = {"name": algo["name"], **algo.get("params", {})}
    return tree


def dumps(cfg: RunConfig) -> str:
    return tomli_w.dumps(to_tree(cfg))
