"""``hetfl analyze RUN_DIR``: every analysis on a finished (or interrupted) run.

Rebuilds the run's data and model from its ``config.toml``, loads the last
checkpoint (global model, client states) and, when the run saved them
(``runtime.save_client_models``), the clients' local models. Each analysis
writes a PNG and the numbers behind it into ``RUN_DIR/analysis/``; an
``index.json`` lists what was written and what was skipped, and why, with the
run's ``setting_id`` / ``run_id``. A checkpoint written by another configuration
than ``config.toml`` (an edited config) is refused rather than analysed against
data and a model rebuilt from the other one.

- ``curves``: accuracy, per-client spread, train loss, traffic (``metrics.jsonl``).
- ``weight_norms``: classifier row norms of each saved local model against that
  client's class counts (CCVR Fig. 3); of the global model without saved ones.
- ``spectrum``: singular values of the feature covariance of the global model
  on the test set, and of each saved local model (dimensional collapse, FedUV).
- ``cka``: linear CKA of each layer between saved local models on the same
  probe data, mean over client pairs per layer (CCVR Figs. 1-2); the classifier's output is
  the logits the local models compute (clsnorm: with its L2-normalised rows). A model without a
  hidden layer (logistic regression) has only its logits compared: its input layer's
  CKA would be 1 for any models (they all see the same inputs); ``index.json`` notes it.
- ``swd``: sliced Wasserstein distance between the clients' class-conditional
  feature distributions (per-class Gaussians under the global encoder; CCVR appendix).
- ``tsne``: t-SNE of global-model features of a seeded random sample of each client's training data,
  coloured by class and by client (needs scikit-learn).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetfl.algorithms.base import HEAD_TRANSFORMS, Tensors
from hetfl.analysis.cka import mean_pairwise_cka, pairwise_cka
from hetfl.analysis.classifier import class_weight_norms
from hetfl.analysis.plots import (
    json_safe,
    plot_cka,
    plot_curves,
    plot_spectrum,
    plot_swd_matrix,
    plot_tsne,
    plot_weight_norms,
)
from hetfl.analysis.spectrum import effective_rank, singular_values
from hetfl.analysis.swd import GaussianMixture, sliced_wasserstein_matrix
from hetfl.analysis.tsne import tsne_embedding
from hetfl.engine import identity
from hetfl.engine.checkpoint import load_checkpoint, load_tensors
from hetfl.engine.experiment import CLIENT_MODELS_DIR, CONFIG_NAME, METRICS_NAME, Experiment
from hetfl.files import atomic_write_text
from hetfl.params import ConfigError
from hetfl.rng import torch_generator

ANALYSES = ("curves", "weight_norms", "spectrum", "cka", "swd", "tsne")
OUT_DIR = "analysis"
NO_HIDDEN_LAYER = "the model has no hidden layer"


class AnalysisError(ValueError):
    """The run directory cannot be analysed (no config, no checkpoint...)."""


def saved_client_models(run_dir: Path, state_names: Sequence[str]) -> tuple[int, dict[int, Tensors]]:
    """The latest saved round of local models: (round, {client: state}); (0, {}) if none."""
    files = sorted((run_dir / CLIENT_MODELS_DIR).glob("round_*.safetensors"))
    if not files:
        return 0, {}
    tensors = load_tensors(files[-1])
    clients: dict[int, Tensors] = {}
    for key, value in tensors.items():
        client, name = key.split("/", 1)
        clients.setdefault(int(client), {})[name] = value
    clients = {c: s for c, s in clients.items() if all(n in s for n in state_names)}
    return int(files[-1].stem.split("_")[1]), dict(sorted(clients.items()))


def check_same_run(run_dir: Path, checkpoint_config: dict[str, Any] | None, config: dict[str, Any]) -> None:
    """The checkpoint (whose model is analysed) must come from the run ``config.toml`` describes (from
    which data, partition and model are rebuilt); otherwise the analyses would mix two runs."""
    if checkpoint_config is None:
        return  # a checkpoint written before checkpoints recorded their configuration
    try:
        saved = identity.canonical_tree(checkpoint_config)
    except ConfigError:
        saved = checkpoint_config
    diffs = identity.differing_keys(saved, config)
    if diffs:
        raise AnalysisError(f"{run_dir}: the checkpoint was written by another configuration than {CONFIG_NAME} "
                            f"({'; '.join(diffs[:4])}; checkpoint -> {CONFIG_NAME}); analyse the run whose "
                            f"{CONFIG_NAME} is unchanged")


class RunAnalysis:
    """A run directory with its experiment rebuilt and its last state loaded."""

    def __init__(self, run_dir: str | Path, *, device: str = "cpu", probe: int = 512, seed: int = 0) -> None:
        self.run_dir = Path(run_dir)
        check_probe(probe)
        if not (self.run_dir / CONFIG_NAME).is_file():
            raise AnalysisError(f"{self.run_dir}: no {CONFIG_NAME}; is this a hetfl run directory?")
        cfg = identity.load_run_config(self.run_dir / CONFIG_NAME,
                                       [f"runtime.device={device}", "runtime.progress=false"])
        self.exp = Experiment(cfg)
        ckpt = load_checkpoint(self.run_dir, self.exp.device)
        if ckpt is None:
            raise AnalysisError(f"{self.run_dir}: no checkpoint to analyse (runtime.checkpoint_every = 0?)")
        self.config = identity.saved_tree(self.run_dir) or {}
        check_same_run(self.run_dir, ckpt.info.get("config"), self.config)
        self.server, self.clients, self.round = ckpt.server, ckpt.clients, ckpt.round
        caller = self.exp.caller
        self.local_round, self.local_models = saved_client_models(self.run_dir, caller.state_names)
        self.local_models = {c: {n: t.to(self.exp.device) for n, t in s.items()} for c, s in self.local_models.items()}
        self.out = self.run_dir / OUT_DIR
        gen = torch_generator(seed, "eval", 0)
        test_x = self.exp.data.test_x
        pick = torch.randperm(len(test_x), generator=gen)[: min(probe, len(test_x))].to(test_x.device)
        self.probe_x = self.exp.data.prepare(test_x[pick])
        self.probe_y = self.exp.data.test_y[pick]

    # --------------------------------------------------------------- helpers
    def features(self, state: Tensors, x: torch.Tensor) -> torch.Tensor:
        model = self.exp.caller
        was = model.module.training
        model.module.eval()
        try:
            with torch.no_grad():
                return torch.cat([model.features_and_logits(state, x[i : i + 1024])[0] for i in range(0, len(x), 1024)])
        finally:
            model.module.train(was)

    def check_finite(self, tensors: torch.Tensor | Tensors, what: str) -> None:
        """An AnalysisError when ``tensors`` (features, or a model state's floating tensors) hold a NaN or an
        infinity: a diverged run has nothing to analyse, and its NaNs would otherwise end the command in a
        traceback (SVD, t-SNE) or become silent NaNs (or ``rho = 1``) in the figures and ``index.json``."""
        items = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors.values())
        if all(bool(torch.isfinite(t).all()) for t in items if t.is_floating_point()):
            return
        diverged = None
        summary = self.run_dir / "summary.json"
        if summary.is_file():
            try:
                diverged = json.loads(summary.read_text()).get("diverged_round")
            except (ValueError, AttributeError):
                diverged = None
        why = (f"the run diverged in round {diverged} (summary.json: diverged_round)" if diverged is not None else
               "the model diverged")
        raise AnalysisError(f"{what} are not finite (NaN or inf): {why}; nothing to analyse (try a lower train.lr "
                            "or train.max_grad_norm)")

    def as_trained(self, state: Tensors) -> Tensors:
        """A local model's state with the classifier rows it computes its logits with. A method's weight head
        transform (clsnorm's L2-normalised rows: :class:`~hetfl.algorithms.base.HeadTransform`) is a flag in the
        model state that the saved local models do not carry; the run's global model does, and every client
        trained under it. The classifier layer's CKA hooks the module, which would use the raw rows."""
        active = [(key, t) for key, t in HEAD_TRANSFORMS.items()
                  if t.weight is not None and (key in state or key in self.server.model)]
        if not active:
            return state
        weight = state["classifier.weight"]
        for key, t in active:  # in the registry's order, as ModelCaller applies them
            weight = t.weight(weight, state[key] if key in state else self.server.model[key])
        return {**state, "classifier.weight": weight}

    def client_counts(self, client: int) -> np.ndarray:
        labels = self.exp.data.client_train_split(client)[1]
        return np.bincount(labels.cpu().numpy(), minlength=self.exp.dataset.info.num_classes)

    def context(self, round_: int | None = None) -> str:
        """Which run (and round) a figure shows: ``"<dir>: <method> on <dataset> (<model>), round R"``."""
        cfg = self.exp.cfg
        run = f"{self.run_dir.resolve().name}: {cfg.algorithm.name} on {cfg.data.dataset} ({cfg.model.name})"
        return run if round_ is None else f"{run}, round {round_}"

    def has_hidden_layer(self) -> bool:
        """Whether anything with parameters runs before the classifier. Without (logistic regression:
        the encoder is a flatten) the "features" are the inputs themselves, the same for every model."""
        module = self.exp.model
        return any(True for _ in module.encoder.parameters()) or getattr(module, "projector", None) is not None

    def feature_layer(self) -> str:
        """What the features are, for titles: the classifier's input and where it comes from."""
        d = self.exp.model.feature_dim
        transforms = self.feature_transforms()
        after = f" after the feature transform {', '.join(transforms)}" if transforms else ""
        if not self.has_hidden_layer():
            return f"features = the inputs{after} (d={d}; {NO_HIDDEN_LAYER})"
        source = "projector" if getattr(self.exp.model, "projector", None) is not None else "encoder"
        return f"features = classifier input ({source} output{after}, d={d})"

    def feature_transforms(self) -> list[str]:
        """The global model's feature head transforms (CCVR's ReLU + Tukey after calibration), which the
        features of the spectrum, SWD and t-SNE (the classifier's input) have been through."""
        return [key for key, t in HEAD_TRANSFORMS.items() if t.features is not None and key in self.server.model]

    # --------------------------------------------------------------- analyses
    def curves(self) -> dict[str, Any]:
        return plot_curves(self.run_dir / METRICS_NAME, self.out, context=self.context())

    def weight_norms(self) -> dict[str, Any]:
        if self.local_models:
            clients = list(self.local_models)[:12]  # a readable figure
            for c in clients:
                self.check_finite(self.local_models[c]["classifier.weight"], f"client {c}'s classifier weights")
            norms = torch.stack([class_weight_norms(self.local_models[c]["classifier.weight"]) for c in clients])
            counts = np.stack([self.client_counts(c) for c in clients])
            labels = [f"client {c} local model" for c in clients]
            context = self.context(self.local_round)
        else:
            self.check_finite(self.server.model["classifier.weight"], "the global classifier's weights")
            norms = class_weight_norms(self.server.model["classifier.weight"])[None]
            counts = np.stack([self.client_counts(c) for c in range(self.exp.data.num_clients)]).sum(0)[None]
            labels = ["global model (all clients' counts)"]
            context = self.context(self.round)
        result = plot_weight_norms(norms.cpu(), counts, self.out, client_labels=labels, context=context)
        transforms = [key for key, t in HEAD_TRANSFORMS.items() if t.weight is not None and key in self.server.model]
        if transforms:  # clsnorm: the logits use rows of norm 1, whatever the stored rows' norms
            result["note"] = (f"the classifier computes its logits with its rows transformed ({', '.join(transforms)}: "
                              "clsnorm's rows are L2-normalised, each of norm 1); the norms shown are the stored "
                              "rows', which that normalisation divides out")
        return result

    def spectrum(self) -> dict[str, Any]:
        global_features = self.features(self.server.model, self.probe_x).cpu()
        self.check_finite(global_features, "the global model's features")
        note = None
        if self.has_hidden_layer():
            spectra = {"global": singular_values(global_features)}
            for c, state in list(self.local_models.items())[:8]:
                local = self.features(state, self.probe_x).cpu()
                self.check_finite(local, f"client {c}'s local model's features")
                spectra[f"client {c}"] = singular_values(local)
        else:  # every model's features are the probe inputs: one curve, the data's own spectrum
            spectra = {"probe inputs": singular_values(global_features)}
            note = f"{NO_HIDDEN_LAYER}: the features are the inputs, the same for every model; one curve"
        if self.feature_transforms():
            note = "; ".join(filter(None, [note, f"global model's {self.feature_layer()}"]))
        rounds = f"{self.round}" if len(spectra) < 2 or self.local_round == self.round else \
            f"{self.round} (local models: round {self.local_round})"
        result = plot_spectrum(spectra, self.out, context=f"{self.context()}, round {rounds}", note=note)
        result["effective_rank_global"] = effective_rank(global_features)
        if note:
            result["note"] = note
        return result

    def cka(self) -> dict[str, Any]:
        if len(self.local_models) < 2:
            raise AnalysisError("needs local models of two or more clients: run with runtime.save_client_models, "
                                f"e.g. --set \"runtime.save_client_models=[{self.round}]\" for this run's last "
                                "round")
        module = self.exp.model
        layers = [f"encoder.{name}" for name, child in module.encoder.named_children()
                  if any(True for _ in child.parameters())]  # layers that compute something
        if not layers and any(True for _ in module.encoder.parameters()):
            layers = ["encoder"]  # an encoder that is one module with parameters
        note = None if layers else (f"{NO_HIDDEN_LAYER}: the input layer's CKA is trivially 1 (every model sees "
                                    "the same probe inputs) and is left out; only the logits are compared")
        if getattr(module, "projector", None) is not None:
            layers.append("projector")
        layers.append("classifier")
        states = [self.as_trained(state) for state in self.local_models.values()]
        for c, state in self.local_models.items():
            self.check_finite(state, f"client {c}'s local model weights")
        cka = pairwise_cka(states, module, self.probe_x, layers)
        result = plot_cka(cka, self.out, model_labels=[f"client {c}" for c in self.local_models],
                          context=self.context(self.local_round), note=note)
        result["mean_cka"] = mean_pairwise_cka(cka)
        if note:
            result["note"] = note
        return result

    def swd(self) -> dict[str, Any]:
        num_classes = self.exp.dataset.info.num_classes
        mixtures, labels = [], []
        for c in range(self.exp.data.num_clients):
            feats, y = self.exp.client_features(self.server.model, c)
            self.check_finite(feats, f"the global model's features of client {c}'s data")
            if len(y) < 2:
                continue
            mixtures.append(GaussianMixture.from_features(feats.cpu(), y.cpu(), num_classes, eps=1e-6))
            labels.append(str(c))
        matrix = sliced_wasserstein_matrix(mixtures, num_projections=64)
        return plot_swd_matrix(matrix, self.out, labels=labels, round=self.round, context=self.context(),
                               title="Sliced W2 distance between clients' class-conditional feature laws "
                                     "(Gaussian per class, global model)",
                               layer=self.feature_layer())

    def tsne(self) -> dict[str, Any]:
        per_client = max(1, 1500 // self.exp.data.num_clients)
        feats, labels, clients = [], [], []
        for c in range(self.exp.data.num_clients):
            f, y = self.exp.client_features(self.server.model, c)
            self.check_finite(f, f"the global model's features of client {c}'s data")
            # a seeded random sample: a client's split is stored in an order (by class, for some partitions)
            # whose first samples would misstate its class mix
            pick = torch.randperm(len(y), generator=torch_generator(0, "eval", 1, c))[:per_client].sort().values
            feats.append(f.cpu()[pick])
            labels.append(y.cpu()[pick])
            clients.append(torch.full((len(labels[-1]),), c))
        embedding = tsne_embedding(torch.cat(feats), seed=0)
        what = ("global-model features of training samples" if self.has_hidden_layer() else
                f"the inputs of training samples (= the features: {NO_HIDDEN_LAYER})")
        if self.feature_transforms():
            what += f" ({self.feature_layer()})"
        return plot_tsne(embedding, torch.cat(labels), self.out, clients=torch.cat(clients),
                         context=self.context(self.round), what=what)


def check_probe(probe: Any, option: str = "probe") -> int:
    """``probe`` as a number of test samples: at least 2 (CKA, spectra and t-SNE compare samples' features),
    else a ConfigError naming ``option`` (a negative number used to take all but that many, 0 a traceback)."""
    if isinstance(probe, bool) or not isinstance(probe, int) or probe < 2:
        raise ConfigError(option, probe, "must be a number of test samples >= 2 (the analyses compare the probe "
                                         "samples' features)")
    return probe


def analyze_run(
    run_dir: str | Path, only: Sequence[str] | None = None, *, device: str = "cpu", probe: int = 512,
    option: str = "probe",
) -> dict[str, Any]:
    """Run the analyses ``only`` (default: all) on ``run_dir``; returns and writes ``analysis/index.json``.
    ``probe``: test samples fed through the models (:func:`check_probe`; ``option`` names it in the error)."""
    unknown = [a for a in (only or ()) if a not in ANALYSES]
    if unknown:
        raise AnalysisError(f"unknown analysis {unknown[0]!r}; allowed: {', '.join(ANALYSES)}")
    check_probe(probe, option)
    run = RunAnalysis(run_dir, device=device, probe=probe)
    run.out.mkdir(exist_ok=True)
    index: dict[str, Any] = {"round": run.round, "local_models_round": run.local_round,
                             "setting_id": identity.setting_id(run.config), "run_id": identity.run_id(run.config),
                             "written": {}, "skipped": {}}
    for name in only or ANALYSES:
        try:
            result = getattr(run, name)()
        except (AnalysisError, ImportError) as err:
            index["skipped"][name] = str(err)
            continue
        index["written"][name] = {k: str(v) if isinstance(v, Path) else v for k, v in result.items()}
    # non-finite numbers (a constant layer's CKA) as null: index.json stays JSON that any reader parses
    atomic_write_text(run.out / "index.json", json.dumps(json_safe(index), indent=2, default=float) + "\n")
    return index
