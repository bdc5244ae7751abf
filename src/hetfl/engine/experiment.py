"""One experiment: set-up (everything validated before any file is written; the pieces are in
:mod:`hetfl.engine.setup`) and the round loop (sample, train clients, aggregate, evaluate, log,
checkpoint). The clients' side of each phase goes through ``Experiment.federation``
(:mod:`hetfl.engine.federation`: in this process by default); which runtime runs an experiment is
picked above the engine (:mod:`hetfl.runtimes`).

The run directory contract (DESIGN.md): ``config.toml`` (resolved config),
``metrics.jsonl`` (one line per round, of a size that does not grow with the
clients), ``client_metrics.jsonl`` (each client's accuracy on evaluated rounds),
``summary.json``, and ``checkpoint.safetensors`` for ``hetfl run --resume``; a run with differential
privacy also ``privacy_ledger.json`` (:mod:`hetfl.engine.ledger`: each release, recorded before it is used);
a run with post-hoc steps also ``trained.safetensors``, its model before them, from which runs that differ
only in the post-hoc settings start (``Experiment.run(..., trained=...)``; ``hetfl reproduce`` does).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hetfl import config as config_mod
from hetfl.algorithms import (
    PLUGIN_SOURCE,
    build_algorithm,
    build_posthoc,
    check_model_parts,
    hyperparameters,
    parse_name,
)
from hetfl.algorithms.base import (
    SHARED,
    Batch,
    ClientContext,
    ModelCaller,
    PrivateReleases,
    ServerState,
    Setup,
    Tensors,
    Upload,
    without_feature_transforms,
)
from hetfl.algorithms.posthoc import SummedReplies
from hetfl.config import RunConfig
from hetfl.data.datasets import check_run_splits, load_dataset
from hetfl.data.partition import unused_settings
from hetfl.engine import host_memory, provenance, resources, secure_sum, threads
from hetfl.engine.checkpoint import (
    TRAINED_NAME,
    Checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_tensors,
)
from hetfl.engine.compiled_step import unsupported as compile_unsupported
from hetfl.engine.data import FederatedData
from hetfl.engine.evaluate import accuracy_and_loss
from hetfl.engine.federation import Federation, InProcessFederation, PhaseStopped
from hetfl.engine.ledger import PrivacyLedger
from hetfl.engine.local import LocalResult, run_stages, train_client
from hetfl.engine.messages import nbytes
from hetfl.engine.rundir import (
    CLIENT_METRICS_NAME,
    CLIENT_RECORD_KEY,
    HISTORY_KEY,
    MetricsLog,
    RunDirError,
    check_no_run,
    lock_run_dir,
    restore_metrics,
    split_lines,
)
from hetfl.engine.schedule import lr_at, sampled_clients
from hetfl.engine.setup import (
    build_partition,
    config_changes,
    model_fits_data,
    pick_device,
    resolve,
    vmap_clients,
)
from hetfl.engine.summary import (
    Reporter,
    client_acc_summary,
    client_row,
    diverged_round,
    loss_parts,
    make_summary,
)
from hetfl.engine.tracker import NO_RUN_TRACKER, NO_TRACKERS, RunTracker, Trackers, untracked_switch
from hetfl.engine.vectorized import VectorizedCache, train_clients_vectorized
from hetfl.files import atomic_write_bytes, atomic_write_text
from hetfl.models import build_model
from hetfl.models.base import param_groups
from hetfl.params import ConfigError, inactive_settings
from hetfl.privacy import Release
from hetfl.rng import derive_seed

METRICS_NAME = "metrics.jsonl"
SUMMARY_NAME = "summary.json"
CONFIG_NAME = "config.toml"
CLIENT_MODELS_DIR = "client_models"
#: the key under which ``evaluate`` returns each client's accuracy (taken out of the metrics line, written
#: to ``client_metrics.jsonl``); the line keeps their summary (:func:`hetfl.engine.summary.client_acc_summary`)
CLIENT_ACC_KEY = "_client_acc"
#: the key of ``trained.safetensors``' info holding its round's metrics line before the post-hoc steps
PENDING_KEY = "before_posthoc"
#: the key of a checkpoint's info naming the run whose training it holds (``summary.json``: ``trained_in``)
TRAINED_IN_KEY = "trained_in"


def check_config(cfg: RunConfig, trackers: Trackers = NO_TRACKERS) -> torch.device:
    """The engine's share of resolving a run (:func:`hetfl.runtimes.set_up` gives the whole pass): every key
    that needs no data, each checked by the module that owns it, in this order, before any data is read or
    anything is written; returns the device. A ConfigError names the first bad key.

    1. ``runtime.device``: a device this machine has (:func:`hetfl.engine.setup.pick_device`);
    2. ``algorithm.*``: the method, its post-hoc steps and their settings (the methods' registry,
       :mod:`hetfl.algorithms`);
    3. ``runtime.secure_aggregation``: an additive post-hoc step to sum (:mod:`hetfl.engine.secure_sum`; the
       steps' settings decide, no data needed);
    4. ``tracking.*``: the handed trackers' packages and stores (:mod:`hetfl.tracking`);
    5. ``runtime.save_client_models``: rounds >= 1;
    6. the dataset and the step plan fit in memory (:mod:`hetfl.engine.resources`, with the dataset's options
       checked by :mod:`hetfl.data.datasets`).

    Before it, the configuration's syntax and types were checked when it was made (:mod:`hetfl.config`,
    :mod:`hetfl.params`) and the runtime's keys by the runtime (:mod:`hetfl.runtimes`); after it,
    :class:`Experiment` reads the data and checks what needs it (``auto`` model and partition, clients per
    round, the partition, the plan's and the model's memory, the model parts the method needs)."""
    device = pick_device(cfg.runtime.device)
    hyperparameters(cfg.algorithm.name, cfg.algorithm.params)  # the method's name first (parse_name)
    secure_sum.check_config(cfg, build_posthoc(cfg.algorithm.name, cfg.algorithm.params, None))  # type: ignore[arg-type]
    trackers.check(cfg)
    bad_rounds = [r for r in cfg.runtime.save_client_models if not isinstance(r, int) or r < 1]
    if bad_rounds:
        raise ConfigError("runtime.save_client_models", list(cfg.runtime.save_client_models),
                          "must be a list of rounds >= 1")
    resources.check_config(cfg, vmap_clients(cfg.runtime, device))  # refused before allocating
    return device



class Experiment:
    """A prepared experiment; :meth:`run` executes it into a run directory."""

    def __init__(self, cfg: RunConfig, *, trackers: Trackers = NO_TRACKERS) -> None:
        """Load data, partition, build model and method. Raises a ConfigError,
        DatasetError, PartitionError or ModelError on bad input, before any output. ``trackers``: where the
        run's numbers are also sent (:mod:`hetfl.engine.tracker`; :func:`hetfl.runtimes.set_up` hands
        :mod:`hetfl.tracking`'s), checked here with the rest of the configuration."""
        self.trackers = trackers
        self.device = check_config(cfg, trackers)  # every key that needs no data: before any data is read
        if cfg.runtime.threads:
            torch.set_num_threads(cfg.runtime.threads)
        vmap = vmap_clients(cfg.runtime, self.device)
        root = cfg.data.root or None
        self.dataset = load_dataset(cfg.data.dataset, root, download=cfg.data.download, cache_dir=cfg.data.cache_dir,
                                    seed=cfg.seed, **cfg.data.options)
        check_run_splits(cfg.data.dataset, cfg.data.options, self.dataset)  # no NaN accuracy, no empty training
        self.cfg = cfg = resolve(cfg, self.dataset)  # auto model and partition, the method's defaults
        if cfg.train.clients_per_round > cfg.data.num_clients:
            raise ConfigError("train.clients_per_round", cfg.train.clients_per_round,
                              f"must be <= data.num_clients = {cfg.data.num_clients} (0 = all)")
        self.partition = build_partition(cfg, self.dataset)
        resources.check_plan(cfg, [len(idx) for idx in self.partition.train], vmap)
        # Flower's nodes are a process each, several of which may share a GPU: no prepared copy of the images each
        prepared = False if cfg.runtime.executor == "flower" else None
        self.data = FederatedData(self.dataset, self.partition, self.device, cfg.data.augment, prepared)
        info = self.dataset.info
        with model_fits_data(cfg, info.input_shape):
            resources.check_model(cfg, info.input_shape, info.num_classes, self.device)  # counted on the meta device
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(cfg.seed, "init"))
            self.model = build_model(cfg.model.name, info.input_shape, info.num_classes, **cfg.model.options)
        threads.fit_threads(cfg, self.device, self.model, info.input_shape, vmap)  # runtime.threads; 0: fit to the step
        if cfg.runtime.keep_freed_memory and self.device.type == "cpu":
            host_memory.keep_freed_memory()  # no page faults for the memory each step frees and takes again
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
            cache_dir=cfg.data.cache_dir,
            secure_aggregation=cfg.runtime.secure_aggregation,
            input_shape=tuple(info.input_shape),
        )
        self.algorithm = build_algorithm(cfg.algorithm.name, cfg.algorithm.params, self.setup)
        self.posthoc = build_posthoc(cfg.algorithm.name, cfg.algorithm.params, self.setup)
        resources.require([*self.algorithm.memory_needs(info.input_shape, self.model.feature_dim),
                           *[need for step in self.posthoc for need in step.memory_needs(self.model.feature_dim)]])
        self.num_params = sum(p.numel() for p in self.model.parameters())
        # what always predicting the test set's largest class scores: global_acc at chance (summary.json)
        labels = self.data.test_y
        self.chance_acc = float(torch.bincount(labels).max()) / len(labels) if len(labels) else math.nan
        self.vmap_clients = vmap_clients(cfg.runtime, self.device)
        self.compile_steps = cfg.runtime.compile and not compile_unsupported()  # torch < 2.5 cannot (said per run)
        self.chunk_sizes: dict = {}  # vectorized: clients that fit at once, per group structure (None: no limit)
        self.vectorized_cache = VectorizedCache()  # vectorized: CUDA graphs and their buffers, across rounds
        self.run_dir: Path | None = None
        self.trained_in: str | None = None  # the run this one took its training from (run(trained=...))
        # where the clients' side runs: in this process (sequential / vectorized executors) by default;
        # a runtime above the engine may attach another (hetfl.flower's FlowerFederation: Flower nodes)
        self.federation: Federation = InProcessFederation(self)
        # where the numbers are also sent (the handed trackers: TensorBoard, MLflow); set for the run by run_locked
        self.tracker: RunTracker = NO_RUN_TRACKER
        self.ledger: PrivacyLedger | None = None  # the run directory's privacy ledger, opened by run_locked

    # --------------------------------------------------------------- pieces
    def initial_server(self) -> ServerState:
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return self.algorithm.init_server(state)

    def sample_clients(self, round_: int) -> list[int]:
        return sampled_clients(self.cfg.seed, round_, self.cfg.data.num_clients, self.cfg.train.clients_per_round)

    def evaluate(self, server: ServerState, clients: dict[int, Tensors], round_: int) -> dict[str, Any]:
        cfg, algo, data = self.cfg, self.algorithm, self.data
        bs = cfg.train.eval_batch_size
        out: dict[str, Any] = {}
        global_correct = None
        if not algo.personalized:
            global_correct, acc, loss = accuracy_and_loss(self.caller, server.model, data.test_x, data.test_y, data, bs)
            out["global_acc"], out["global_loss"] = acc, loss
        by_client = self.federation.client_accuracies(server, clients, round_, global_correct)
        out.update(client_acc_summary([by_client[c] for c in sorted(by_client)]))
        out[CLIENT_ACC_KEY] = by_client  # the per-client file's row, taken out of the line by round_loop
        return out

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
    def run(self, run_dir: str | Path, *, resume: bool = False, reporter: Reporter | None = None,
            trained: str | Path | None = None) -> dict[str, Any]:
        """Run (or continue) the experiment in ``run_dir``; returns the summary.

        ``trained``: the folder of a finished run whose configuration differs from this one only in the
        post-hoc steps' settings (``algorithm.ccvr.*``, not ``every_round``): this run starts from its
        ``trained.safetensors`` (the model after its last round's training, before the post-hoc steps) and
        only runs its own post-hoc steps and the last evaluation; its rounds' lines before are that run's,
        and so is the numbers' equality with a run trained here (tested). A RunDirError when that folder
        holds no such file or another training configuration.

        The whole run holds the directory's lock (:mod:`hetfl.engine.rundir`): a second process
        is refused naming this one. A new run needs a directory holding no run, checked under the
        lock; a resumed one checks ``metrics.jsonl`` against the checkpoint before continuing.

        The clients run where ``self.federation`` puts them; ``runtime.executor = "flower"`` needs a
        Flower federation attached (:func:`hetfl.runtimes.run_experiment` attaches one): a ConfigError
        otherwise, before anything is written."""
        if self.cfg.runtime.executor == "flower" and isinstance(self.federation, InProcessFederation):
            raise ConfigError("runtime.executor", "flower",
                              "Experiment.run runs the clients in this process only; run a Flower experiment "
                              "with hetfl.runtimes.run_experiment (or `hetfl run`), which starts Flower")
        untracked = untracked_switch(self.cfg, self.trackers)
        if untracked:
            raise ConfigError(untracked, True, "this Experiment was handed no trackers; run it with "
                                               "hetfl.runtimes.run_experiment (or `hetfl run`, hetfl.run), or set it "
                                               "up with hetfl.runtimes.set_up(cfg), which hands hetfl.tracking's")
        run_dir = Path(run_dir)
        if trained is not None and resume:
            raise ValueError("resume=True continues the run in run_dir from its own checkpoint; trained= starts "
                             "a new run from another's training: give one of them")
        trained_ckpt = self.trained_checkpoint(Path(trained)) if trained is not None else None
        with lock_run_dir(run_dir) as taken:
            if taken and not resume:
                check_no_run(run_dir)
            if trained_ckpt is not None:  # the trained model becomes this run's checkpoint, resumed below
                copy_history(Path(trained), run_dir, trained_ckpt)
                info = {**trained_ckpt.info, "config": config_mod.to_tree(self.cfg),
                        TRAINED_IN_KEY: str(Path(trained).resolve())}
                save_checkpoint(run_dir, Checkpoint(trained_ckpt.round, trained_ckpt.server, trained_ckpt.clients,
                                                    info))
                resume = True
            try:
                return self.run_locked(run_dir, resume, reporter or Reporter())
            finally:
                host_memory.release_freed_memory()

    def trained_checkpoint(self, trained_dir: Path) -> Checkpoint:
        """``trained_dir``'s model before its post-hoc steps, checked to be this run's training: the same
        configuration but for the post-hoc settings, no post-hoc step run every round, an in-process run,
        no differentially private release before it (the ledger it would need is that run's)."""
        if not isinstance(self.federation, InProcessFederation):
            raise ConfigError("runtime.executor", self.cfg.runtime.executor,
                              "a run that starts from another's training (trained=) runs in this process")
        every_round = [step.name for step in self.posthoc if step.every_round]
        if every_round:
            raise ConfigError(f"algorithm.{every_round[0]}.every_round", True,
                              "a step run after every round changes the training that follows it, so this run "
                              "cannot start from another's training (trained=)")
        if not self.posthoc:
            raise ConfigError("algorithm.name", self.cfg.algorithm.name,
                              "a run without post-hoc steps would repeat the other's run; trained= starts a run "
                              "whose post-hoc settings differ (e.g. fedavg+ccvr with other algorithm.ccvr.*)")
        ckpt = load_checkpoint(trained_dir, self.device, TRAINED_NAME)
        if ckpt is None or PENDING_KEY not in ckpt.info:
            raise RunDirError(f"{trained_dir}: no {TRAINED_NAME} (the model before the post-hoc steps) to start "
                              "from; it is written by a finished run with post-hoc steps and checkpoints on")
        changed = config_changes(ckpt.info.get("config"), self.cfg, training_only=True)
        if changed:
            raise RunDirError(f"{trained_dir}: its training is another configuration's ({'; '.join(changed[:5])}; "
                              "there -> now); only the post-hoc steps' settings may differ")
        steps = {step.name for step in self.posthoc}
        if any(entry.method not in steps for entry in PrivacyLedger(trained_dir).entries):
            raise RunDirError(f"{trained_dir}: its training made differentially private releases; a run started "
                              "from it would not account for them: train this run itself")
        return ckpt

    def keeps_trained(self) -> bool:
        """Whether this run keeps its last round's model before the post-hoc steps (:func:`keeps_trained_model`;
        and its clients run in this process)."""
        return keeps_trained_model(self.cfg) and isinstance(self.federation, InProcessFederation)

    def run_locked(self, run_dir: Path, resume: bool, reporter: Reporter) -> dict[str, Any]:
        """The body of :meth:`run`, with the run directory's lock held."""
        cfg = self.cfg
        self.run_dir = run_dir
        ckpt = load_checkpoint(run_dir, self.device) if resume else None
        self.trained_in = ckpt.info.get(TRAINED_IN_KEY) if ckpt else None
        code_edited = False  # the plug-in file edited since a run that made no checkpoint: it restarts under it
        if ckpt is not None:
            changed = config_changes(ckpt.info.get("config"), cfg)
            if changed and changed == plugin_edits(changed):
                raise RunDirError(f"{run_dir}: its checkpoint's rounds were computed by another version of the "
                                  f"plug-in file ({changed[0]}; there -> now); continuing them with this code would "
                                  "mix the two in one run: run it afresh (another --out, or delete the folder)")
            if changed:
                raise RunDirError(f"{run_dir}: the checkpoint belongs to a different configuration "
                                  f"({'; '.join(changed[:5])})")
        elif resume and (run_dir / CONFIG_NAME).exists():
            # no checkpoint yet (stopped before the first): the run's config.toml is the configuration it ran
            # with; another one would count the releases already made as its own (privacy_ledger.json). Only its
            # plug-in's code may differ (a first method fixed after its first step failed, as the error says):
            # the run starts from round 1 again, so no number of the old code is kept, and config.toml says so
            saved = saved_config(run_dir / CONFIG_NAME)
            changed = config_changes(saved, cfg) if saved is not None else [f"{CONFIG_NAME} cannot be read"]
            code_edited = bool(changed) and changed == plugin_edits(changed)
            if changed and not code_edited:
                raise RunDirError(f"{run_dir / CONFIG_NAME}: the interrupted run there (no checkpoint yet) has a "
                                  f"different configuration ({'; '.join(changed[:5])}; there -> now)")
        if resume and (run_dir / SUMMARY_NAME).exists():
            return self.finished(run_dir, ckpt, reporter)
        self.ledger = self.open_ledger(run_dir, ckpt, reporter)  # checked before anything is written
        start = lines_before(ckpt)
        for message in self.algorithm.run_notes():  # a cost the settings hide, said before it is paid
            self.note(message, reporter)
        data, defaults = dataclasses.asdict(cfg.data), dataclasses.asdict(config_mod.DataConfig())
        for message in unused_settings(cfg.data.partition, cfg.data.base, data, defaults):
            self.note(message, reporter)  # a setting the split ignores: the run would not be what was asked
        for prefix, hyper in [("runtime.", cfg.runtime), ("algorithm.", self.algorithm.hp),
                               *[(f"algorithm.{step.name}.", step.hp) for step in self.posthoc]]:
            for message in inactive_settings(hyper, prefix):
                self.note(message, reporter)  # a setting its mode does not read (``setting(when=...)``)
        tracker = self.trackers.open(cfg, run_dir)  # its stores checked; writes nothing yet
        metrics_log = restore_metrics(run_dir / METRICS_NAME, start, ckpt.info.get(HISTORY_KEY) if ckpt else None)
        with metrics_log:
            if not resume or not (run_dir / CONFIG_NAME).exists() or code_edited:
                atomic_write_text(run_dir / CONFIG_NAME, config_mod.dumps(cfg))
            with tracker.session(cfg, run_dir, metrics_log.history) as self.tracker:
                return self.round_loop(run_dir, ckpt, metrics_log, reporter)

    def releasing_methods(self) -> list[PrivateReleases]:
        """The trainer and the post-hoc steps: those whose releases the privacy ledger records."""
        return [self.algorithm, *self.posthoc]

    def open_ledger(self, run_dir: Path, ckpt: Checkpoint | None, reporter: Reporter) -> PrivacyLedger:
        """The run directory's privacy ledger, checked against the checkpoint (a RunDirError if it lost releases
        the checkpoint accounts for); releases made after the checkpoint are named: seeded ones will be
        replayed, those with operating-system noise cannot be and count again."""
        ledger = PrivacyLedger(run_dir)
        for method in self.releasing_methods():
            recorded = method.dp_recorded(ckpt.server) if ckpt else []
            ledger.check_covers(method.name, recorded)
            lost = ledger.after(method.name, len(recorded))
            fresh = [e for e in lost if e.noise_source != "seed"]
            if fresh:
                rounds = ", ".join(str(e.round) for e in fresh)
                self.note(f"privacy: {len(fresh)} release(s) of {method.name} (round(s) {rounds}) reached the server "
                          "after the last checkpoint; their noise came from the operating system, so the rounds "
                          "run again release fresh noise and every release counts: the epsilon reported "
                          "(summary.json privacy.epsilon) will exceed the target", reporter)
        return ledger

    def account_release(self, method: PrivateReleases, received: Any, round_: int, server: ServerState,
                        asked: Sequence[int] | None = None) -> ServerState:
        """Record the differentially private release in what the server just ``received`` (if any) in the
        ledger, durably, before the server uses it; ``server`` then accounts for every earlier release.
        ``asked``: the clients the phase asked (the round's sampled clients), whom the release counts for,
        replied or not; None: every client (a post-hoc step asks them all)."""
        return self.record_release(method, asked_release(method.dp_release(received), asked), round_, server)

    def account_stop(self, method: PrivateReleases, stop: PhaseStopped, received: Any, round_: int,
                     server: ServerState, asked: Sequence[int] | None = None) -> None:
        """Record what a phase that stopped the run had received (``received``: its usable replies, in the
        form :meth:`account_release` takes) before the stop propagates: the server has those uploads, and the
        resumed round releases again. With nothing usable, the uploads it received and refused
        (``stop.refused``) are a release of their own (``dp_refused``); with something usable, that release
        already counts one upload of every client asked in this attempt, the refused ones included."""
        if received:
            self.account_release(method, received, round_, server, asked)
        elif stop.refused:
            self.record_release(method, asked_release(method.dp_refused(stop.refused), asked), round_, server)

    def record_release(self, method: PrivateReleases, release: Release | None, round_: int,
                       server: ServerState) -> ServerState:
        """Record ``release`` (if any) in the ledger, durably, before the server uses it; ``server`` then
        accounts for every earlier release of ``method``."""
        if release is None:
            return server
        if self.ledger is None:  # the pieces driven without run(): a ledger kept in memory only
            self.ledger = PrivacyLedger()
        released_before = self.ledger.released(method.name, round_)
        count = len(self.ledger.entries)
        before = self.ledger.record(method.name, round_, release)
        if released_before and len(self.ledger.entries) > count:
            if release.noise_source != "seed":
                consequence = "both count in the epsilon reported"
            elif round_ in self.ledger.reused_seeded_noise():
                consequence = ("both carry the same seeded noise, so their difference is noiseless: the epsilon "
                               "reported is inf")
            else:  # the same clients' same uploads, with others or fewer: nothing new, counted all the same
                consequence = ("every client's upload in both is the same (seeded noise on the same content), so "
                               "nothing new reached the server; both count in the epsilon reported")
            logging.getLogger("hetfl").warning(
                f"privacy: {method.name} released round {round_} again and it differs from the release the ledger "
                f"holds (noise source {release.noise_source!r}): {consequence}")
        current = self.ledger.entry(method.name, round_, release)  # a replay: the entry it replays
        return method.dp_with_past(server, [e.multiplier for e in before], [e.clients for e in [*before, current]])

    def mark_reused_noise(self, line: dict[str, Any], reporter: Reporter) -> None:
        """A metrics line's budget once the ledger holds a round released twice, with different content, under
        noise drawn from the run's seed (:meth:`PrivacyLedger.reused_seeded_noise`: a resumed round whose
        clients or model differ): the two carry the same noise, so their difference reached the server
        without any, and ``dp_epsilon`` is inf (``dp_noise_reused_rounds`` names the rounds)."""
        reused = self.ledger.reused_seeded_noise() if self.ledger is not None else []
        if not reused or "dp_epsilon" not in line:
            return
        line["dp_epsilon"] = math.inf
        if "dp_epsilon_per_upload" in line:
            line["dp_epsilon_per_upload"] = math.inf
        line["dp_noise_reused_rounds"] = reused
        if not getattr(self, "_reuse_noted", False):
            self._reuse_noted = True
            self.note(f"privacy: round(s) {', '.join(map(str, reused))} reached the server twice with different "
                      "content and the same noise, drawn from the run's seed (dp_noise_source = 'seed'): their "
                      "difference carries no noise, so no finite epsilon holds (summary.json privacy.epsilon = "
                      "inf); runs meant to protect data use dp_noise_source = 'os'", reporter)

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
        except (OSError, ValueError):  # rebuilt from the checked history: what the run wrote at its end
            wall = sum(float(line.get("round_time_s", 0.0)) for line in history)
            environments = ckpt.info.get(provenance.ENVIRONMENTS_KEY, []) if ckpt else []
            summary = self.run_summary(history, wall, environments)
            atomic_write_text(run_dir / SUMMARY_NAME, json.dumps(summary, indent=2) + "\n")
        reporter.finish(summary)
        return summary

    def round_loop(self, run_dir: Path, ckpt: Checkpoint | None, metrics_log: MetricsLog,
                   reporter: Reporter) -> dict[str, Any]:
        """Rounds after the checkpoint's (all, without one) to the last; then the summary."""
        cfg = self.cfg
        server = ckpt.server if ckpt else self.initial_server()
        start = lines_before(ckpt)
        self.federation.start(run_dir, start, ckpt.info if ckpt else {})
        setup_up = setup_down = 0
        if ckpt is None:
            server, setup_up, setup_down = self.setup_round(server)
        clients: dict[int, Tensors] = ckpt.clients if ckpt else {}
        pending = ckpt.info.get(PENDING_KEY) if ckpt else None  # the last round trained in another run
        wall = float(ckpt.info.get("wall_time_s", 0.0)) if ckpt else 0.0
        environments = provenance.extend(ckpt.info.get(provenance.ENVIRONMENTS_KEY, []) if ckpt else [],
                                         provenance.environment(self.device), start + 1)
        history = metrics_log.history
        for method in self.releasing_methods():  # what the server sees of private uploads: the run's first line
            notice = method.privacy_notice()
            if notice:
                self.note(notice, reporter)
        reporter.start(cfg, start, self)
        for round_ in range(start + 1, cfg.train.rounds + 1):
            t0 = time.perf_counter()
            if pending is not None and round_ == ckpt.round:  # trained.safetensors' round: its line and time
                line = dict(pending["line"])
                t0 -= pending["train_time_s"]
            else:
                line = self.round(server, clients, round_, reporter)
                server = line.pop("_server")
                if round_ == 1:  # the set-up round's traffic counts with round 1
                    line["bytes_up"] += setup_up
                    line["bytes_down"] += setup_down
                if round_ == cfg.train.rounds and self.keeps_trained():
                    trained = {PENDING_KEY: {"line": line, "train_time_s": time.perf_counter() - t0},
                               "config": config_mod.to_tree(cfg), "wall_time_s": wall,
                               HISTORY_KEY: metrics_log.record(), provenance.ENVIRONMENTS_KEY: environments}
                    save_checkpoint(run_dir, Checkpoint(round_, server, clients, trained), TRAINED_NAME)
            server = self.run_posthoc(server, round_, line)
            by_client = None
            if round_ % cfg.train.eval_every == 0 or round_ == cfg.train.rounds:
                t_eval = time.perf_counter()
                line.update(self.evaluate(server, clients, round_))
                by_client = line.pop(CLIENT_ACC_KEY)
                line["eval_time_s"] = round(time.perf_counter() - t_eval, 4)
            line.update(self.federation.round_info(round_))
            self.mark_reused_noise(line, reporter)
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
                info = {"config": config_mod.to_tree(cfg), "wall_time_s": wall, HISTORY_KEY: metrics_log.record(),
                        provenance.ENVIRONMENTS_KEY: environments}
                info.update(self.federation.checkpoint_info())
                save_checkpoint(run_dir, Checkpoint(round_, server, clients, info))
                self.federation.committed(round_)
            reporter.round_end(line)
        summary = self.run_summary(history, wall, environments)
        atomic_write_text(run_dir / SUMMARY_NAME, json.dumps(summary, indent=2) + "\n")
        self.tracker.finish(summary, run_dir)
        reporter.finish(summary)
        return summary

    def run_summary(self, history: list[dict[str, Any]], wall: float,
                    environments: list[dict[str, Any]]) -> dict[str, Any]:
        """``summary.json`` of the run whose metrics lines are ``history``: the numbers (:func:`make_summary`),
        the environments that computed its rounds (``provenance``; none known for a run that kept no checkpoint
        and lost its summary) and the run it took its training from (``trained_in``, if any)."""
        summary = make_summary(self.cfg, history, wall, self)
        summary["environment"] = environments
        if self.trained_in is not None:
            summary[TRAINED_IN_KEY] = self.trained_in
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
        replies = self.federation.setup_replies(server)
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
            try:
                replies = self.federation.posthoc_replies(step, raw, round_)
            except PhaseStopped as err:  # the replies the server got before the stop are spent: recorded
                self.account_stop(step, err, err.received, round_, server)
                raise
            server = self.account_release(step, replies, round_, server)
            if isinstance(replies, SummedReplies):  # secure aggregation: each client uploaded its masked vector
                line["bytes_up"] += getattr(replies, "bytes_per_client", 0) * len(replies.clients)
                line["secagg_clients"] = len(replies.clients)
                line["secagg_clipped_entries"] = getattr(replies, "clipped", 0)
            else:
                line["bytes_up"] += sum(nbytes(r) for r in replies.values())
            line["bytes_down"] += nbytes(raw) * self.data.num_clients  # the encoder goes to every client
            server, info = step.apply(server, replies, round_)
            line.update(info)
        return server

    def note(self, message: str, reporter: Reporter) -> None:
        """Tell the user once per run how the run executes (an executor's fallback, and why): through the
        reporter where it shows notes (``shows_notes``: the terminal's progress display), else as a
        warning of the ``hetfl`` logger; never both, so a line is printed once."""
        notes = self.__dict__.setdefault("_notes", set())
        if message in notes:
            return
        notes.add(message)
        if hasattr(reporter, "note"):
            reporter.note(message)
        if not getattr(reporter, "shows_notes", False):
            logging.getLogger("hetfl").warning(message)

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
        if cfg.runtime.compile and not self.vmap_clients:
            self.note("runtime.compile compiles the vectorized executor's vmapped steps; these clients are trained "
                      "one at a time, uncompiled", reporter)
        if cfg.runtime.compile and self.vmap_clients and not self.compile_steps:
            self.note(compile_unsupported(), reporter)
        if self.vmap_clients:
            on_cuda = self.data.device.type == "cuda"
            graph = cfg.runtime.cuda_graph and on_cuda
            results = train_clients_vectorized(self.algorithm, ctxs, self.data, seed=cfg.seed, train_cfg=cfg.train,
                                               chunk_size=cfg.runtime.chunk_size,
                                               step_mode="graph" if graph else "eager",
                                               log=lambda message: self.note(message, reporter),
                                               memo=self.chunk_sizes, cache=self.vectorized_cache,
                                               channels_last=cfg.runtime.channels_last and on_cuda,
                                               conv_batching=cfg.runtime.conv_batching,
                                               compile_steps=self.compile_steps,
                                               block_steps=cfg.runtime.graph_steps)
            for _ in results:
                reporter.client_done()
            return results
        results = []
        for ctx in ctxs:
            results.append(train_client(self.algorithm, ctx, self.data, seed=cfg.seed, train_cfg=cfg.train))
            reporter.client_done()
        return results

    def round(self, server: ServerState, clients: dict[int, Tensors], round_: int, reporter: Reporter) -> dict:
        cfg, algo = self.cfg, self.algorithm
        sampled = self.sample_clients(round_)
        lr = lr_at(cfg, round_)
        reporter.round_start(round_, len(sampled))
        try:
            updates, bytes_down = self.federation.train(server, clients, sampled, round_, lr, reporter)
        except PhaseStopped as err:  # the uploads the server got before the stop are spent: recorded
            self.account_stop(algo, err, [Upload(u.client_id, u.upload, u.num_samples, u.steps)
                                          for u in err.received or []], round_, server, sampled)
            raise
        uploads: list[Upload] = []
        bytes_up = 0
        loss_sum = 0.0
        steps_total = 0
        part_sums: dict[str, float] = {}
        for u in updates:
            bytes_up += nbytes(u.upload)
            uploads.append(Upload(u.client_id, u.upload, u.num_samples, u.steps,
                                  {"loss": u.loss_sum / max(u.steps, 1)}))
            loss_sum += u.loss_sum
            steps_total += u.steps
            for key, value in u.part_sums.items():
                part_sums[key] = part_sums.get(key, 0.0) + value
        new_server = algo.aggregate(self.account_release(algo, uploads, round_, server, sampled), uploads, round_)
        return {
            **algo.round_info(new_server, uploads, round_),
            "round": round_,
            "train_loss": loss_sum / max(steps_total, 1),
            **loss_parts(part_sums, steps_total),
            "lr": lr,
            "clients": len(sampled),
            "local_steps": steps_total,
            "bytes_up": bytes_up,
            "bytes_down": bytes_down,
            "_server": new_server,
        }



def asked_release(release: Release | None, asked: Sequence[int] | None) -> Release | None:
    """``release`` naming the clients its phase asked (``Release.clients``); as it is for ``asked = None``."""
    if release is None or asked is None:
        return release
    return dataclasses.replace(release, clients=tuple(sorted(int(c) for c in asked)))


def plugin_edits(changed: list[str]) -> list[str]:
    """Of :func:`~hetfl.engine.setup.config_changes`' lines, those saying the plug-in file's code changed
    (``algorithm.plugin_source``, :func:`hetfl.algorithms.plugin_source`)."""
    return [line for line in changed if line.startswith(f"algorithm.{PLUGIN_SOURCE}:")]


def saved_config(path: Path) -> dict[str, Any] | None:
    """A run directory's ``config.toml`` as a tree (None if it cannot be read as TOML)."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None


def keeps_trained_model(cfg: RunConfig) -> bool:
    """Whether a run of ``cfg`` keeps its last round's model before the post-hoc steps (``trained.safetensors``),
    for runs that differ only in those steps' settings to start from: a run in this process (not Flower) with
    checkpoints on, whose post-hoc steps all run once, after the last round (none ``every_round``)."""
    steps = parse_name(cfg.algorithm.name)[1]
    every_round = any(cfg.algorithm.params.get(step, {}).get("every_round", False) for step in steps)
    return bool(steps) and not every_round and bool(cfg.runtime.checkpoint_every) and cfg.runtime.executor != "flower"


def lines_before(ckpt: Checkpoint | None) -> int:
    """The metrics lines a run holds before it goes on from ``ckpt``: its round, one fewer for a model
    kept before its round's post-hoc steps (``trained.safetensors``, whose round's line is still to write)."""
    if ckpt is None:
        return 0
    return ckpt.round - (PENDING_KEY in ckpt.info)


def copy_history(trained_dir: Path, run_dir: Path, ckpt: Checkpoint) -> None:
    """The lines of ``metrics.jsonl`` and ``client_metrics.jsonl`` that ``trained_dir`` had written when it
    kept ``ckpt`` (``trained.safetensors``), copied into ``run_dir``: the rounds a run started from it shares.
    The copies are checked against the checkpoint's record when the run opens them (:func:`restore_metrics`)."""
    record = ckpt.info.get(HISTORY_KEY) or {}
    lines = split_lines((trained_dir / METRICS_NAME).read_bytes())[: lines_before(ckpt)]
    atomic_write_bytes(run_dir / METRICS_NAME, b"".join(lines))
    client_bytes = (record.get(CLIENT_RECORD_KEY) or {}).get("bytes", 0)
    client_file = trained_dir / CLIENT_METRICS_NAME
    if client_bytes and client_file.exists():
        with client_file.open("rb") as fh:
            atomic_write_bytes(run_dir / CLIENT_METRICS_NAME, fh.read(client_bytes))


__all__ = ["Experiment", "Reporter", "keeps_trained_model"]
