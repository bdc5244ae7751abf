"""One experiment: set-up (everything validated before any file is written) and
the round loop (sample, train clients, aggregate, evaluate, log, checkpoint).

The run directory contract (DESIGN.md): ``config.toml`` (resolved config),
``metrics.jsonl`` (one line per round, of a size that does not grow with the
clients), ``client_metrics.jsonl`` (each client's accuracy on evaluated rounds),
``summary.json``, and ``checkpoint.safetensors`` for ``hetfl run --resume``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetfl import config as config_mod
from hetfl import tracking
from hetfl.algorithms import build_algorithm, build_posthoc, hyperparameters, parse_name, step_hyper
from hetfl.algorithms.base import (
    SHARED,
    Algorithm,
    Batch,
    ClientContext,
    ModelCaller,
    ServerState,
    Setup,
    Tensors,
    Upload,
    check_model_parts,
    without_feature_transforms,
)
from hetfl.config import RunConfig
from hetfl.data.base import Dataset
from hetfl.data.datasets import load_dataset
from hetfl.data.partition import Partition, make_partition
from hetfl.engine import resources
from hetfl.engine.checkpoint import (
    Checkpoint,
    atomic_write_text,
    load_checkpoint,
    save_checkpoint,
    save_tensors,
)
from hetfl.engine.data import FederatedData
from hetfl.engine.evaluate import accuracies_vectorized, accuracy_and_loss
from hetfl.engine.identity import differing_keys
from hetfl.engine.local import LocalResult, run_stages, train_client
from hetfl.engine.rundir import (
    HISTORY_KEY,
    History,
    MetricsLog,
    RunDirError,
    check_no_run,
    lock_run_dir,
    restore_metrics,
)
from hetfl.engine.vectorized import train_clients_vectorized
from hetfl.models import build_model
from hetfl.models.base import param_groups
from hetfl.params import ConfigError, to_dict
from hetfl.rng import derive_seed, numpy_generator

METRICS_NAME = "metrics.jsonl"
SUMMARY_NAME = "summary.json"
CONFIG_NAME = "config.toml"
CLIENT_MODELS_DIR = "client_models"
#: the key under which ``evaluate`` returns each client's accuracy (taken out of the metrics line, written
#: to ``client_metrics.jsonl``); the line keeps their summary, ``client_acc_<SPREAD_KEYS>``
CLIENT_ACC_KEY = "_client_acc"
SPREAD_KEYS = ("min", "q25", "median", "q75", "max")
#: the Algorithm hooks that decide which model a client is evaluated with (``client_accuracy``); a method
#: that overrides none of them is evaluated with the global model on every client. (``init_client_state``
#: and ``payload`` are called there too, but only feed these; their draws, like every draw, come from
#: hetfl.rng's keyed streams, so leaving the calls out changes no later number.)
GLOBAL_EVAL_HOOKS = ("client_model", "personalize_stages", "predictor")


def pick_device(name: str) -> torch.device:
    """The device of ``runtime.device`` (auto, cpu, cuda, cuda:N), checked against this machine's GPUs.
    A device index becomes the current CUDA device, so that what runs on the current device (the
    vectorised executor's CUDA streams and graphs) runs on the chosen one."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ConfigError("runtime.device", name, "CUDA is not available on this machine; use auto or cpu")
    count = torch.cuda.device_count()
    if device.index is not None:
        if device.index >= count:
            present = ", ".join(f"cuda:{i}" for i in range(count))
            raise ConfigError("runtime.device", name, f"this machine has {count} CUDA device{'s' * (count != 1)} "
                                                      f"({present}); use one of them, cuda or auto")
        torch.cuda.set_device(device)
    return device


def vmap_clients(runtime: config_mod.RuntimeConfig, device: torch.device) -> bool:
    """Whether a round's clients are vmapped: the vectorised executor on an accelerator,
    or on the CPU when asked. On the CPU a vmapped step does the same arithmetic as the
    clients' steps one after another, through grouped convolutions and batched matrix
    products that are 1.5-2.5x slower there than the per-client kernels
    (``benchmarks/vmap_cpu_profile.py``), and a CPU has no idle parallel units for the
    batching to fill; so the vectorised executor runs clients one at a time on the CPU.
    """
    return runtime.executor == "vectorized" and (device.type != "cpu" or runtime.vmap_on_cpu)


def auto_model(dataset: Dataset) -> tuple[str, dict[str, Any]]:
    """The default model for a dataset: logistic regression for Synthetic (as FedProx),
    the 2-conv CNN for 28x28 images, MOON's simple CNN for 32x32, ResNet-18 beyond."""
    info = dataset.info
    if not info.is_image:
        return "mlp", {"hidden": [] if info.name == "synthetic" else [200, 200]}
    if info.input_shape[-1] <= 28:
        return "cnn2", {}
    if info.input_shape[-1] <= 32:
        return "simple_cnn", {}
    return "resnet18", {"norm": "gn"}


def resolve(cfg: RunConfig, dataset: Dataset) -> RunConfig:
    """Replace every ``auto`` by its value for this dataset, and fill the method's defaults."""
    data, model = cfg.data, cfg.model
    if data.partition == "auto":
        data = dataclasses.replace(data, partition="natural" if dataset.info.groups else "dirichlet")
    if model.name == "auto":
        name, options = auto_model(dataset)
        model = dataclasses.replace(model, name=name, options={**options, **model.options})
    params = cfg.algorithm.params
    _, steps = parse_name(cfg.algorithm.name)
    hyper = to_dict(hyperparameters(cfg.algorithm.name, params))
    full_params = {**hyper, **{s: to_dict(step_hyper(s, params.get(s, {}))) for s in steps}}
    algorithm = dataclasses.replace(cfg.algorithm, params=full_params)
    return dataclasses.replace(cfg, data=data, model=model, algorithm=algorithm)


def build_partition(cfg: RunConfig, dataset: Dataset) -> Partition:
    d = cfg.data
    group = dataset.train.group
    test_group = dataset.test.group
    return make_partition(
        d.partition,
        dataset.train.y.numpy(),
        dataset.test.y.numpy(),
        d.num_clients,
        seed=derive_seed(cfg.seed, "partition"),
        num_classes=dataset.info.num_classes,
        train_groups=None if group is None else group.numpy(),
        test_groups=None if test_group is None else test_group.numpy(),
        alpha=d.alpha,
        min_size=d.min_size,
        classes_per_client=d.classes_per_client,
        uniform_share=d.uniform_share,
        samples_per_client=d.samples_per_client,
        test_per_client=d.test_per_client or None,
        dominant_groups=d.dominant_groups,
        classes_per_group=d.classes_per_group,
        quantity_sigma=d.quantity_sigma,
        clients_per_domain=d.clients_per_domain,
        angles=list(d.angles) or None,
        base=d.base,
        concept_groups=d.concept_groups,
    )


def lr_at(cfg: RunConfig, round_: int) -> float:
    """Client learning rate of a 1-based round under the schedule.

    ``cosine`` is PyTorch's ``CosineAnnealingLR`` with ``T_max = rounds`` stepped once per
    round, as in FedUV's code: round r trains at ``lr_min + (lr - lr_min)(1 + cos(pi (r-1) / R)) / 2``,
    so the last round still trains (above ``lr_min``) and ``lr_min`` is where it would go next.
    """
    t = cfg.train
    if t.lr_schedule == "cosine":
        return t.lr_min + (t.lr - t.lr_min) * 0.5 * (1 + math.cos(math.pi * (round_ - 1) / t.rounds))
    return t.lr


def nbytes(tensors: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@dataclasses.dataclass
class ClientUpdate:
    """What the server receives from one client after its local round (``Algorithm.finish``'s
    upload and the numbers the round's metrics need)."""

    client_id: int
    upload: Tensors
    num_samples: int
    steps: int
    loss_sum: float


def check_flower(cfg: RunConfig) -> None:
    """A missing Flower, and settings the Flower executor cannot honour, as ConfigErrors before any output."""
    try:
        import flwr  # noqa: F401
    except ImportError:
        raise ConfigError("runtime.executor", "flower",
                          'needs Flower, which is not installed: pip install "hetfl[flower]"') from None
    if cfg.runtime.save_client_models:
        raise ConfigError("runtime.save_client_models", list(cfg.runtime.save_client_models),
                          "is not supported with runtime.executor = flower (local models stay on the nodes)")


def config_changes(saved: dict[str, Any] | None, cfg: RunConfig) -> list[str]:
    """How ``cfg`` differs from the configuration a checkpoint was written with, as
    ``"key: saved -> now"`` lines (empty: the same run). The saved configuration is read
    through today's defaults first, so that a key added to hetfl after the checkpoint was
    written (with a default that leaves old runs unchanged) does not stop them resuming.
    Keys that change only what the terminal shows (``identity.PRESENTATION_KEYS``, e.g.
    ``--quiet``'s ``runtime.progress``) are not changes."""
    if saved is None:
        return ["the checkpoint records no configuration"]
    try:
        saved = config_mod.to_tree(config_mod.from_dict(saved))
    except ConfigError as err:
        return [f"the checkpoint's configuration is no longer valid: {err}"]
    return differing_keys(saved, config_mod.to_tree(cfg))


def check_method_fits_model(cfg: RunConfig, info: Any) -> None:
    """The set-up's method x model check (:func:`check_model_parts`) on the model built on the meta
    device, for planning: ``hetfl compare``, sweeps and ``hetfl reproduce`` refuse a method the model
    cannot serve (FedPAC on logistic regression) before their first run starts."""
    model = resources.meta_model(cfg.model.name, info.input_shape, info.num_classes, cfg.model.options)
    if model is not None:
        check_model_parts(cfg.algorithm.name, cfg.model, param_groups(model), info.input_shape, info.num_classes)


class Experiment:
    """A prepared experiment; :meth:`run` executes it into a run directory."""

    def __init__(self, cfg: RunConfig) -> None:
        """Load data, partition, build model and method. Raises a ConfigError,
        DatasetError, PartitionError or ModelError on bad input, before any output."""
        self.device = pick_device(cfg.runtime.device)
        if cfg.runtime.threads:
            torch.set_num_threads(cfg.runtime.threads)
        parse_name(cfg.algorithm.name)
        hyperparameters(cfg.algorithm.name, cfg.algorithm.params)  # fail fast on bad settings
        tracking.check(cfg)  # tracking switched on without its package: named before any work
        vmap = vmap_clients(cfg.runtime, self.device)
        resources.check_config(cfg, vmap)  # a dataset or step plan that cannot fit: refused before allocating
        root = cfg.data.root or None
        self.dataset = load_dataset(cfg.data.dataset, root, download=cfg.data.download, cache_dir=cfg.data.cache_dir,
                                    seed=cfg.seed, **cfg.data.options)
        self.cfg = cfg = resolve(cfg, self.dataset)
        bad_rounds = [r for r in cfg.runtime.save_client_models if not isinstance(r, int) or r < 1]
        if bad_rounds:
            raise ConfigError("runtime.save_client_models", list(cfg.runtime.save_client_models),
                              "must be a list of rounds >= 1")
        if cfg.runtime.executor == "flower":
            check_flower(cfg)
        if cfg.train.clients_per_round > cfg.data.num_clients:
            raise ConfigError("train.clients_per_round", cfg.train.clients_per_round,
                              f"must be <= data.num_clients = {cfg.data.num_clients} (0 = all)")
        self.partition = build_partition(cfg, self.dataset)
        resources.check_plan(cfg, [len(idx) for idx in self.partition.train], vmap)
        self.data = FederatedData(self.dataset, self.partition, self.device, cfg.data.augment)
        info = self.dataset.info
        resources.check_model(cfg, info.input_shape, info.num_classes, self.device)  # counted on the meta device
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(cfg.seed, "init"))
            self.model = build_model(cfg.model.name, info.input_shape, info.num_classes, **cfg.model.options)
        check_model_parts(cfg.algorithm.name, cfg.model, param_groups(self.model), info.input_shape, info.num_classes)
        self.model.to(self.device).train()
        self.caller = ModelCaller(self.model)
        self.setup = Setup(
            model=self.caller,
            groups=param_groups(self.model),
            num_clients=cfg.data.num_clients,
            num_classes=info.num_classes,
            client_sizes=self.data.client_sizes,
            train=cfg.train,
            seed=cfg.seed,
        )
        self.algorithm = build_algorithm(cfg.algorithm.name, cfg.algorithm.params, self.setup)
        self.posthoc = build_posthoc(cfg.algorithm.name, cfg.algorithm.params, self.setup)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.vmap_clients = vmap_clients(cfg.runtime, self.device)
        self.chunk_sizes: dict = {}  # vectorized: clients at once per group structure, found in round 1
        self.run_dir: Path | None = None
        # where the clients' side runs: None = in this process (sequential / vectorized executors);
        # a hetfl.flower federation sends it to Flower nodes (hetfl/flower/server.py)
        self.federation: Any = None
        # where the numbers are also sent (hetfl.tracking: TensorBoard, MLflow); set for the run by run_locked
        self.tracker: tracking.Tracking = tracking.NO_TRACKING

    # --------------------------------------------------------------- pieces
    def initial_server(self) -> ServerState:
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return self.algorithm.init_server(state)

    def sample_clients(self, round_: int) -> list[int]:
        n, k = self.cfg.data.num_clients, self.cfg.train.clients_per_round
        if k == 0 or k >= n:
            return list(range(n))
        rng = numpy_generator(self.cfg.seed, "sample", round_)
        return sorted(int(c) for c in rng.choice(n, size=k, replace=False))

    def evaluate(self, server: ServerState, clients: dict[int, Tensors], round_: int) -> dict[str, Any]:
        cfg, algo, data = self.cfg, self.algorithm, self.data
        bs = cfg.train.eval_batch_size
        out: dict[str, Any] = {}
        global_correct = None
        if not algo.personalized:
            global_correct, acc, loss = accuracy_and_loss(self.caller, server.model, data.test_x, data.test_y, data, bs)
            out["global_acc"], out["global_loss"] = acc, loss
        if self.federation is not None:
            by_client = self.federation.client_accuracies(server, round_, global_correct)
        else:
            by_client = self.client_accuracies(server, clients, round_, global_correct)
        out.update(client_acc_summary([by_client[c] for c in sorted(by_client)]))
        out[CLIENT_ACC_KEY] = by_client  # the per-client file's row, taken out of the line by round_loop
        return out

    def client_accuracies(self, server: ServerState, clients: dict[int, Tensors], round_: int,
                          global_correct: torch.Tensor | None) -> dict[int, float]:
        """Each client's evaluated model on its own test split (clients without test samples left out).
        A method evaluated with the global model everywhere (:func:`evaluates_with_global_model`) gets all
        clients' accuracies at once from the global model's per-sample correctness: no per-client work."""
        data, bs = self.data, self.cfg.train.eval_batch_size
        if global_correct is not None and not data.transformed and evaluates_with_global_model(self.algorithm):
            return data.client_test_accuracies(global_correct)
        accs: dict[int, float] = {}
        own_models: dict[int, Tensors] = {}  # plain personalised models: evaluated together when vectorised
        for c in range(data.num_clients):
            state_c = clients.get(c) or self.algorithm.init_client_state(c, server)
            acc, deferred = self.client_accuracy(c, server, state_c, round_, global_correct, defer=self.vmap_clients)
            if deferred is not None:
                own_models[c] = deferred
            elif acc is not None:
                accs[c] = acc
        if own_models:
            order = list(own_models)
            batched = accuracies_vectorized(self.caller, [own_models[c] for c in order],
                                            [data.client_tests[c].x for c in order],
                                            [data.client_tests[c].y for c in order], data, bs)
            for i, c in enumerate(order):
                test = data.client_tests[c]
                accs[c] = batched[i] if batched is not None else accuracy_and_loss(
                    self.caller, own_models[c], test.x, test.y, data, bs)[1]
        return accs

    def client_accuracy(
        self,
        c: int,
        server: ServerState,
        state_c: Tensors,
        round_: int,
        global_correct: torch.Tensor | None = None,
        *,
        payload: Tensors | None = None,
        defer: bool = False,
    ) -> tuple[float | None, Tensors | None]:
        """Client ``c``'s evaluated model (``client_model``, then ``personalize_stages`` and
        ``predictor``) on its own test split: (accuracy, None); (None, None) for an empty test split;
        (None, model) when ``defer`` and the model is a plain one to evaluate batched with others.
        ``global_correct`` (the global model's per-sample correctness on the global test set) is
        reused when the client is evaluated with the global model itself."""
        cfg, algo, data = self.cfg, self.algorithm, self.data
        bs = cfg.train.eval_batch_size
        model_c = algo.client_model(server, state_c, c)
        if payload is None:
            payload = algo.payload(server, c)
        ctx = self.client_context(c, round_, lr_at(cfg, round_), payload, state_c, server)
        tune = algo.personalize_stages(ctx)
        if tune:
            model_c = run_stages(tune, model_c, ctx, data, seed=cfg.seed, batch_size=cfg.train.batch_size,
                                 drop_last=cfg.train.drop_last, stream=1, buffers=self.caller.buffer_names).state
        test = data.client_tests[c]
        if len(test.y) == 0:
            return None, None
        predictor = algo.predictor(model_c, ctx)
        if predictor is None and model_c is server.model and global_correct is not None and not data.transformed:
            return global_correct[data.client_test_idx[c].to(self.device)].float().mean().item(), None
        if predictor is None and defer:
            return None, model_c
        return accuracy_and_loss(self.caller, model_c, test.x, test.y, data, bs, predictor)[1], None

    # ------------------------------------------------------------------ run
    def run(self, run_dir: str | Path, *, resume: bool = False, reporter: Reporter | None = None) -> dict[str, Any]:
        """Run (or continue) the experiment in ``run_dir``; returns the summary.

        The whole run holds the directory's lock (:mod:`hetfl.engine.rundir`): a second process
        is refused naming this one. A new run needs a directory holding no run, checked under the
        lock; a resumed one checks ``metrics.jsonl`` against the checkpoint before continuing."""
        run_dir = Path(run_dir)
        with lock_run_dir(run_dir) as taken:
            if taken and not resume:
                check_no_run(run_dir)
            if self.cfg.runtime.executor == "flower" and self.federation is None:
                from hetfl.flower.simulation import run_simulation  # the clients on Flower's simulation engine

                return run_simulation(self, run_dir, resume=resume, reporter=reporter)
            return self.run_locked(run_dir, resume, reporter or Reporter())

    def run_locked(self, run_dir: Path, resume: bool, reporter: Reporter) -> dict[str, Any]:
        """The body of :meth:`run`, with the run directory's lock held."""
        cfg = self.cfg
        self.run_dir = run_dir
        ckpt = load_checkpoint(run_dir, self.device) if resume else None
        if ckpt is not None:
            changed = config_changes(ckpt.info.get("config"), cfg)
            if changed:
                raise RunDirError(f"{run_dir}: the checkpoint belongs to a different configuration "
                                  f"({'; '.join(changed[:5])})")
        if resume and (run_dir / SUMMARY_NAME).exists():
            return self.finished(run_dir, ckpt, reporter)
        start = ckpt.round if ckpt else 0
        tracker = tracking.open_tracking(cfg, run_dir)  # its stores checked; writes nothing yet
        metrics_log = restore_metrics(run_dir / METRICS_NAME, start, ckpt.info.get(HISTORY_KEY) if ckpt else None)
        with metrics_log:
            if not resume or not (run_dir / CONFIG_NAME).exists():
                atomic_write_text(run_dir / CONFIG_NAME, config_mod.dumps(cfg))
            with tracker.session(cfg, run_dir, metrics_log.history) as self.tracker:
                return self.round_loop(run_dir, ckpt, metrics_log, reporter)

    def finished(self, run_dir: Path, ckpt: Checkpoint | None, reporter: Reporter) -> dict[str, Any]:
        """A resumed run that has its summary: check its history, say so, and return the summary
        (rewritten only if unreadable); nothing is recomputed."""
        rounds = self.cfg.train.rounds
        if ckpt is not None and ckpt.round != rounds:
            raise RunDirError(f"{run_dir}: {SUMMARY_NAME} says the run finished but the checkpoint is at round "
                              f"{ckpt.round} of {rounds}")
        record = ckpt.info.get(HISTORY_KEY) if ckpt else None
        with restore_metrics(run_dir / METRICS_NAME, rounds, record) as metrics_log:
            history = metrics_log.history
        self.note(f"{run_dir}: the run already finished ({rounds} rounds, {SUMMARY_NAME}); nothing to do", reporter)
        try:
            summary = json.loads((run_dir / SUMMARY_NAME).read_text())
        except (OSError, ValueError):
            wall = float(ckpt.info.get("wall_time_s", 0.0)) if ckpt else 0.0
            summary = make_summary(self.cfg, history, wall, self)
            atomic_write_text(run_dir / SUMMARY_NAME, json.dumps(summary, indent=2) + "\n")
        reporter.finish(summary)
        return summary

    def round_loop(self, run_dir: Path, ckpt: Checkpoint | None, metrics_log: MetricsLog,
                   reporter: Reporter) -> dict[str, Any]:
        """Rounds after the checkpoint's (all, without one) to the last; then the summary."""
        cfg = self.cfg
        server = ckpt.server if ckpt else self.initial_server()
        if self.federation is not None:
            self.federation.start(run_dir, ckpt.round if ckpt else 0, ckpt.info if ckpt else {})
        setup_up = setup_down = 0
        if ckpt is None:
            server, setup_up, setup_down = self.setup_round(server)
        clients: dict[int, Tensors] = ckpt.clients if ckpt else {}
        start = ckpt.round if ckpt else 0
        wall = float(ckpt.info.get("wall_time_s", 0.0)) if ckpt else 0.0
        history = metrics_log.history
        reporter.start(cfg, start, self)
        for round_ in range(start + 1, cfg.train.rounds + 1):
            t0 = time.perf_counter()
            line = self.round(server, clients, round_, reporter)
            server = line.pop("_server")
            if round_ == 1:  # the set-up round's traffic counts with round 1
                line["bytes_up"] += setup_up
                line["bytes_down"] += setup_down
            server = self.run_posthoc(server, round_, line)
            by_client = None
            if round_ % cfg.train.eval_every == 0 or round_ == cfg.train.rounds:
                t_eval = time.perf_counter()
                line.update(self.evaluate(server, clients, round_))
                by_client = line.pop(CLIENT_ACC_KEY)
                line["eval_time_s"] = round(time.perf_counter() - t_eval, 4)
            if self.federation is not None:
                line.update(self.federation.round_info(round_))
            line["round_time_s"] = round(time.perf_counter() - t0, 4)
            wall += line["round_time_s"]
            metrics_log.append(line)
            self.write_client_metrics(metrics_log, round_, by_client)
            self.tracker.log_round(round_, line)
            if not math.isfinite(line["train_loss"]) and diverged_round(history) == round_:
                self.note(f"training diverged: the train loss is {line['train_loss']} from round {round_} on "
                          "(summary.json: diverged_round); try a lower train.lr or train.max_grad_norm",
                          reporter)
            every = cfg.runtime.checkpoint_every
            if every and (round_ % every == 0 or round_ == cfg.train.rounds):
                info = {"config": config_mod.to_tree(cfg), "wall_time_s": wall, HISTORY_KEY: metrics_log.record()}
                if self.federation is not None:
                    info.update(self.federation.checkpoint_info())
                save_checkpoint(run_dir, Checkpoint(round_, server, clients, info))
                if self.federation is not None:
                    self.federation.committed(round_)
            reporter.round_end(line)
        summary = make_summary(cfg, history, wall, self)
        atomic_write_text(run_dir / SUMMARY_NAME, json.dumps(summary, indent=2) + "\n")
        self.tracker.finish(summary, run_dir)
        reporter.finish(summary)
        return summary

    def write_client_metrics(self, metrics_log: MetricsLog, round_: int, by_client: dict[int, float] | None) -> None:
        """An evaluated round's per-client accuracies as a line of ``client_metrics.jsonl``, on the rounds
        ``runtime.client_metrics_every`` picks (its multiples, and the last round; 0: never)."""
        every = self.cfg.runtime.client_metrics_every
        if by_client is None or not every or (round_ % every and round_ != self.cfg.train.rounds):
            return
        metrics_log.clients.append(client_row(round_, by_client, self.data.num_clients))

    def client_context(
        self, client: int, round_: int, lr: float, payload: Tensors, state: Tensors, server: ServerState
    ) -> ClientContext:
        """What client ``client`` sees in round ``round_``, with its data accessors."""
        shared = {k[len(SHARED):]: v for k, v in server.extra.items() if k.startswith(SHARED)}
        return ClientContext(client, round_, self.data.client_sizes[client], lr, payload, state,
                             features=lambda model_state: self.client_features(model_state, client),
                             inputs=lambda: self.client_inputs(client), shared=shared)

    def setup_round(self, server: ServerState) -> tuple[ServerState, int, int]:
        """The method's set-up round before round 1 (FedMix's averaged data), if it has one:
        (server state, bytes up, bytes down)."""
        algo = self.algorithm
        if not algo.has_setup_round():
            return server, 0, 0
        if self.federation is not None:
            replies = self.federation.setup_replies(server)
        else:
            replies = {}
            for c in range(self.data.num_clients):
                ctx = self.client_context(c, 0, lr_at(self.cfg, 1), {}, {}, server)
                replies[c] = algo.setup_query(ctx)
        server = algo.setup_aggregate(server, replies)
        shared = {k: v for k, v in server.extra.items() if k.startswith(SHARED)}
        return server, sum(nbytes(r) for r in replies.values()), nbytes(shared) * self.data.num_clients

    def client_inputs(self, client: int) -> Batch:
        """A client's training data as model inputs (normalised, no augmentation) and labels."""
        x, y = self.data.client_train_split(client)
        return Batch(self.data.prepare(x), y)

    def client_features(self, state: Tensors, client: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Features (classifier input) of a client's training data under ``state``: eval mode, no augmentation."""
        x, y = self.data.client_train_split(client)
        bs = self.cfg.train.eval_batch_size
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                feats = [self.caller.features_and_logits(state, self.data.prepare(x[i : i + bs]))[0]
                         for i in range(0, len(x), bs)]
        finally:
            self.model.train(was_training)
        return (torch.cat(feats) if feats else torch.zeros(0, self.model.feature_dim, device=self.device)), y

    def run_posthoc(self, server: ServerState, round_: int, line: dict[str, Any]) -> ServerState:
        """Post-hoc steps due after ``round_`` (the last round, or every round); logs accuracy before each."""
        last = round_ == self.cfg.train.rounds
        for step in self.posthoc:
            if not (last or step.every_round):
                continue
            if not self.algorithm.personalized:
                data = self.data
                acc = accuracy_and_loss(self.caller, server.model, data.test_x, data.test_y, data,
                                        self.cfg.train.eval_batch_size)[1]
                line[f"global_acc_before_{step.name}"] = acc
            raw = without_feature_transforms(server.model)
            if self.federation is not None:
                replies = self.federation.posthoc_replies(step, raw, round_)
            else:
                replies = {}
                for c in range(self.data.num_clients):
                    feats, labels = self.client_features(raw, c)
                    replies[c] = step.client_query(raw, feats, labels)
            line["bytes_up"] += sum(nbytes(r) for r in replies.values())
            line["bytes_down"] += nbytes(raw) * self.data.num_clients  # the encoder goes to every client
            server, info = step.apply(server, replies, round_)
            line.update(info)
        return server

    def note(self, message: str, reporter: Reporter) -> None:
        """Tell the user once per run how the run executes (an executor's fallback, and why)."""
        notes = self.__dict__.setdefault("_notes", set())
        if message in notes:
            return
        notes.add(message)
        logging.getLogger("hetfl").warning(message)
        if hasattr(reporter, "note"):
            reporter.note(message)

    def save_client_models(self, round_: int, ctxs: list[ClientContext], results: list[LocalResult]) -> None:
        """``client_models/round_XXXX.safetensors``: each trained client's local model after ``round_``
        (keys ``<client>/<tensor>``), for layer-wise comparisons of local models (CCVR's CKA)."""
        folder = self.run_dir / CLIENT_MODELS_DIR  # type: ignore[operator]
        folder.mkdir(exist_ok=True)
        tensors = {f"{ctx.client_id}/{name}": result.state[name]
                   for ctx, result in zip(ctxs, results, strict=True) for name in self.caller.state_names}
        save_tensors(folder / f"round_{round_:04d}.safetensors", tensors, {"round": str(round_)})

    def train_clients(self, ctxs: list[ClientContext], reporter: Reporter) -> list[LocalResult]:
        """Local training of one round's clients with the configured executor."""
        cfg = self.cfg
        if cfg.runtime.executor == "vectorized" and not self.vmap_clients:
            self.note("vectorized: clients are trained one at a time on the CPU, which is faster there than vmap "
                      "(set runtime.vmap_on_cpu = true to vmap them anyway)", reporter)
        if self.vmap_clients:
            graph = cfg.runtime.cuda_graph and self.data.device.type == "cuda"
            if cfg.runtime.cuda_graph and not graph:
                self.note("vectorized: runtime.cuda_graph applies on a CUDA device only; steps run eagerly", reporter)
            results = train_clients_vectorized(self.algorithm, ctxs, self.data, seed=cfg.seed, train_cfg=cfg.train,
                                               chunk_size=cfg.runtime.chunk_size,
                                               step_mode="graph" if graph else "eager",
                                               log=lambda message: self.note(message, reporter),
                                               memo=self.chunk_sizes)
            for _ in results:
                reporter.client_done()
            return results
        results = []
        for ctx in ctxs:
            results.append(train_client(self.algorithm, ctx, self.data, seed=cfg.seed, train_cfg=cfg.train))
            reporter.client_done()
        return results

    def train_sampled(
        self, server: ServerState, clients: dict[int, Tensors], sampled: list[int], round_: int, lr: float,
        reporter: Reporter,
    ) -> tuple[list[ClientUpdate], int]:
        """The client side of a round for the ``sampled`` clients (``begin``, stages, ``finish``;
        ``clients`` updated in place): their updates in ``sampled`` order, and the bytes sent down."""
        cfg, algo = self.cfg, self.algorithm
        bytes_down = 0
        ctxs = []
        for c in sampled:
            state_c = clients.get(c)
            if state_c is None:
                state_c = algo.init_client_state(c, server)
            payload = algo.payload(server, c)
            bytes_down += nbytes(payload)
            ctxs.append(self.client_context(c, round_, lr, payload, state_c, server))
        results = self.train_clients(ctxs, reporter)
        if round_ in cfg.runtime.save_client_models and self.run_dir is not None:
            self.save_client_models(round_, ctxs, results)
        updates = []
        for ctx, result in zip(ctxs, results, strict=True):
            c = ctx.client_id
            upload, new_state = algo.finish(ctx, result.state, result.steps)
            if new_state:
                clients[c] = new_state
            updates.append(ClientUpdate(c, upload, self.data.client_sizes[c], result.steps, result.loss_sum))
        return updates, bytes_down

    def round(self, server: ServerState, clients: dict[int, Tensors], round_: int, reporter: Reporter) -> dict:
        cfg, algo = self.cfg, self.algorithm
        sampled = self.sample_clients(round_)
        lr = lr_at(cfg, round_)
        reporter.round_start(round_, len(sampled))
        if self.federation is not None:
            updates, bytes_down = self.federation.train(server, sampled, round_, lr, reporter)
        else:
            updates, bytes_down = self.train_sampled(server, clients, sampled, round_, lr, reporter)
        uploads: list[Upload] = []
        bytes_up = 0
        loss_sum = 0.0
        steps_total = 0
        for u in updates:
            bytes_up += nbytes(u.upload)
            uploads.append(Upload(u.client_id, u.upload, u.num_samples, u.steps,
                                  {"loss": u.loss_sum / max(u.steps, 1)}))
            loss_sum += u.loss_sum
            steps_total += u.steps
        new_server = algo.aggregate(server, uploads, round_)
        return {
            "round": round_,
            "train_loss": loss_sum / max(steps_total, 1),
            "lr": lr,
            "clients": len(sampled),
            "local_steps": steps_total,
            "bytes_up": bytes_up,
            "bytes_down": bytes_down,
            "_server": new_server,
        }


def client_acc_summary(accs: list[float]) -> dict[str, Any]:
    """The metrics line's constant-size summary of the evaluated clients' accuracies (in client order):
    mean and standard deviation (as before), the number of clients, and the quartiles with min and max of
    the accuracies rounded to 6 decimals (numpy's default linear interpolation): the numbers
    ``analysis.curves.client_spread`` used to compute from the per-client list the line carried."""
    out: dict[str, Any] = {"client_acc_mean": float(np.mean(accs)), "client_acc_std": float(np.std(accs)),
                           "clients_evaluated": len(accs)}
    if accs:
        values = np.percentile(np.asarray([round(a, 6) for a in accs], dtype=np.float64), [0, 25, 50, 75, 100])
        out.update({f"client_acc_{k}": float(v) for k, v in zip(SPREAD_KEYS, values, strict=True)})
    return out


def client_row(round_: int, by_client: dict[int, float], num_clients: int) -> dict[str, Any]:
    """A line of ``client_metrics.jsonl``: each client's accuracy (6 decimals) by client id, None (null)
    for a client not evaluated (no test split, or no reply from a Flower node)."""
    return {"round": round_, "client_acc": [None if c not in by_client else round(by_client[c], 6)
                                            for c in range(num_clients)]}


def evaluates_with_global_model(algo: Algorithm) -> bool:
    """Whether every client of ``algo`` is evaluated with the global model itself: a method with one
    global model that keeps the base class's evaluation hooks (:data:`GLOBAL_EVAL_HOOKS`), whose
    per-client accuracies then follow from the global model's correctness on the global test set."""
    return not algo.personalized and all(getattr(type(algo), hook) is getattr(Algorithm, hook)
                                         for hook in GLOBAL_EVAL_HOOKS)


def diverged_round(history: Sequence[dict[str, Any]]) -> int | None:
    """The first round whose train loss is inf or NaN (``metrics.jsonl`` lines), or None."""
    if isinstance(history, History):  # tracked as its lines were added: no parse of every line each round
        return history.first_nonfinite
    return next((m["round"] for m in history if not math.isfinite(m["train_loss"])), None)


def make_summary(cfg: RunConfig, history: Sequence[dict[str, Any]], wall: float, exp: Experiment) -> dict[str, Any]:
    evaluated = [m for m in history if "client_acc_mean" in m]
    summary: dict[str, Any] = {
        "algorithm": cfg.algorithm.name,
        "rounds": len(history),
        "wall_time_s": round(wall, 3),
        "num_params": exp.num_params,
        "bytes_up_total": sum(m["bytes_up"] for m in history),
        "bytes_down_total": sum(m["bytes_down"] for m in history),
    }
    if evaluated and "global_acc" in evaluated[-1]:
        summary["final_global_acc"] = evaluated[-1]["global_acc"]
        summary["best_global_acc"] = max(m["global_acc"] for m in evaluated)
    for key in (history[-1] if history else {}):
        if key.startswith("global_acc_before_"):
            summary["final_" + key] = history[-1][key]
    if evaluated:
        summary["final_client_acc_mean"] = evaluated[-1]["client_acc_mean"]
        summary["best_client_acc_mean"] = max(m["client_acc_mean"] for m in evaluated)
    summary["final_train_loss"] = history[-1]["train_loss"] if history else None
    summary["diverged_round"] = diverged_round(history)
    summary["config"] = config_mod.to_tree(cfg)
    from hetfl.engine.identity import run_id, setting_id  # the run's identity (what compare/report decide by)

    summary["setting_id"] = setting_id(summary["config"])
    summary["run_id"] = run_id(summary["config"])
    return summary


class Reporter:
    """Progress callbacks of a run; the base class is silent (see hetfl.cli for the rich one)."""

    def start(self, cfg: RunConfig, start_round: int, exp: Experiment) -> None: ...
    def round_start(self, round_: int, num_clients: int) -> None: ...
    def client_done(self) -> None: ...
    def round_end(self, line: dict[str, Any]) -> None: ...
    def finish(self, summary: dict[str, Any]) -> None: ...

    def note(self, message: str) -> None:
        """A remark about how the run executes (an executor's fallback); shown once per run."""


def run_experiment(cfg: RunConfig, run_dir: str | Path, **kwargs: Any) -> dict[str, Any]:
    """Prepare and run in one call (library use)."""
    return Experiment(cfg).run(run_dir, **kwargs)


__all__ = ["ClientUpdate", "Experiment", "Reporter", "RunDirError", "run_experiment"]
