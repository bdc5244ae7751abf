"""Federated methods. ``build_algorithm("fedprox", params, setup)`` makes one.

A method name may carry post-hoc steps joined with ``+`` (``fedavg+ccvr``);
their settings live in a sub-table of ``algorithm`` named after the step.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import sys
import traceback
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any

import torch

from hetfl.algorithms.base import (
    MODEL_PARTS,
    Algorithm,
    MethodError,
    Setup,
    check_hooks_callable,
    checked_hooks,
    model_provides,
)
from hetfl.algorithms.posthoc import PostHoc
from hetfl.models import MODELS, build_model, model_options, param_groups
from hetfl.models.meta import NoRandomInit
from hetfl.params import ConfigError, build, did_you_mean, former_values

# name -> "module:Class"; modules are imported on first use.
_REGISTRY: dict[str, str] = {
    "fedavg": "hetfl.algorithms.fedavg:FedAvg",
    "fedavgm": "hetfl.algorithms.fedavgm:FedAvgM",
    "fedprox": "hetfl.algorithms.fedprox:FedProx",
    "scaffold": "hetfl.algorithms.scaffold:Scaffold",
    "feddyn": "hetfl.algorithms.feddyn:FedDyn",
    "fednova": "hetfl.algorithms.fednova:FedNova",
    "moon": "hetfl.algorithms.moon:Moon",
    "local": "hetfl.algorithms.personalized:LocalOnly",
    "freeze": "hetfl.algorithms.freeze:Freeze",
    "fedbabu": "hetfl.algorithms.freeze:FedBABU",
    "feduv": "hetfl.algorithms.feduv:FedUV",
    "fedpac": "hetfl.algorithms.fedpac:FedPAC",
    "fedbr": "hetfl.algorithms.fedbr:FedBR",
    "mixup": "hetfl.algorithms.mixup:Mixup",
    "fedmix": "hetfl.algorithms.fedmix:FedMix",
    "clsnorm": "hetfl.algorithms.classifier_reg:ClsNorm",
    "clsprox": "hetfl.algorithms.classifier_reg:ClsProx",
    "fedavg_ft": "hetfl.algorithms.finetune:FedAvgFT",
    "fedper": "hetfl.algorithms.partial_sharing:FedPer",
    "fedrep": "hetfl.algorithms.partial_sharing:FedRep",
    "lgfedavg": "hetfl.algorithms.partial_sharing:LGFedAvg",
    "ditto": "hetfl.algorithms.ditto:Ditto",
    "apfl": "hetfl.algorithms.apfl:APFL",
    "fedrod": "hetfl.algorithms.fedrod:FedRoD",
    "pfedme": "hetfl.algorithms.pfedme:PFedMe",
    "knnper": "hetfl.algorithms.knnper:KNNPer",
    "fedfomo": "hetfl.algorithms.fedfomo:FedFomo",
    "pfedhn": "hetfl.algorithms.pfedhn:PFedHN",
    "fedlc": "hetfl.algorithms.logit_adjust:FedLC",
    "fedrs": "hetfl.algorithms.logit_adjust:FedRS",
    "feddecorr": "hetfl.algorithms.feddecorr:FedDecorr",
    "vhl": "hetfl.algorithms.vhl:VHL",
    "dann": "hetfl.algorithms.dann:DANN",
    "groupdro": "hetfl.algorithms.groupdro:GroupDRO",
    "fedetf": "hetfl.algorithms.fedetf:FedETF",
}
# methods registered at run time (plugins, notebooks) with @register
_CLASSES: dict[str, type[Algorithm]] = {}
# post-hoc steps composable with any trainer via "+" (CCVR lands with the seed methods)
_POSTHOC: dict[str, str] = {"ccvr": "hetfl.algorithms.ccvr:CCVR"}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: make a method available as ``algorithm.name = cls.name``."""
    if not cls.name or "+" in cls.name:
        raise MethodError(f"{cls.__name__}.name must be a non-empty name without '+', got {cls.name!r}")
    if not is_dataclass(cls.Hyper):
        raise MethodError(f"{cls.__name__}.Hyper must be a dataclass of the method's settings "
                          "(@dataclass(frozen=True), each field with a default: `weight: float = setting(0.01, "
                          "doc=...)`)")
    no_default = [f.name for f in fields(cls.Hyper) if f.default is MISSING and f.default_factory is MISSING]
    if no_default:
        raise MethodError(f"{cls.__name__}.Hyper.{no_default[0]} needs a default (`{no_default[0]}: float = "
                          f"setting(0.01, doc=...)`): a run that does not set algorithm.{no_default[0]} takes it, "
                          "and hetfl list shows it")
    check_hooks_callable(cls)  # before the loss's signature is read
    if cls.loss is not Algorithm.loss:
        try:
            inspect.signature(cls.loss).bind(None, "state", "batch", "ctx")
        except TypeError:
            raise MethodError(f"{cls.__name__}.loss{inspect.signature(cls.loss)} must take (self, state, batch, "
                              "ctx): the state dict it trains, the batch (batch.x, batch.y) and the client's "
                              "context") from None
    check_name_free(cls)
    checked_hooks(cls)
    _CLASSES[cls.name] = cls
    return cls


def _origin(cls: type) -> str:
    """Where ``cls`` is defined: its plug-in file (or module) and qualified name."""
    module = sys.modules.get(cls.__module__)
    return f"{cls.__qualname__} of {getattr(module, '__file__', None) or cls.__module__}"


def check_name_free(cls: type[Algorithm]) -> None:
    """Refuse a method name that is taken: by a built-in method or post-hoc step (the plug-in's class would
    replace it in every run of the process, silently), or by another class (a second plug-in file). The same
    class defined again (its file loaded again, a notebook's cell run again) replaces itself."""
    kind = "method" if cls.name in _REGISTRY else "post-hoc step" if cls.name in _POSTHOC else None
    if kind is not None:
        raise MethodError(f"{cls.__name__}.name = {cls.name!r} is the name of hetfl's built-in {kind}; give the "
                          f"method a name of its own (e.g. name = \"my_{cls.name}\"); to change how {cls.name} "
                          f"works, subclass it under another name")
    known = _CLASSES.get(cls.name)
    if known is not None and _origin(known) != _origin(cls):
        raise MethodError(f"{cls.__name__}.name = {cls.name!r} is already registered by {_origin(known)}; give "
                          "each method a name of its own")


def available() -> list[str]:
    """Names of every method: built in (when its module is installed) and registered."""
    names = [n for n, target in _REGISTRY.items() if importlib.util.find_spec(target.split(":")[0])]
    return names + [n for n in _CLASSES if n not in _REGISTRY]


def algorithm_class(name: str) -> type[Algorithm]:
    if name in _CLASSES:
        return _CLASSES[name]
    if name in _POSTHOC:  # the likely first try for CCVR: a step that runs after a method's training
        raise ConfigError("algorithm.name", name,
                          f"{name!r} is a post-hoc step, not a training method: it runs after a method's "
                          f"training and is named after it with '+', e.g. fedavg+{name} (the method list: "
                          "hetfl list algorithms)")
    if name not in available():
        raise ConfigError("algorithm.name", name, "unknown method; " + did_you_mean(name, available())
                          + "allowed: " + ", ".join(available()) + "; " + _plugin_hint(name))
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def _plugin_hint(name: str) -> str:
    """What to do about a method ``name`` that nothing registered: pass its plug-in file, or, where a loaded
    plug-in file defines a class of that name without registering it, add @register."""
    if not _PLUGIN_FILES:
        return "a method defined in a plug-in file needs --plugin FILE (plugins= in Python), also when resuming its run"
    unregistered = [f"{cls.__qualname__} in {_PLUGIN_FILES[module]}" for module in _PLUGIN_FILES
                    for cls in vars(sys.modules[module]).values()
                    if inspect.isclass(cls) and issubclass(cls, Algorithm) and cls.__module__ == module
                    and cls.name == name and _CLASSES.get(name) is not cls]
    if unregistered:
        return (f"{', '.join(unregistered)} has name = {name!r} but is not registered: put @register (from "
                "hetfl.algorithms) on the line above its class statement")
    registered = sorted(n for n, cls in _CLASSES.items() if cls.__module__ in _PLUGIN_FILES)
    return (f"the plug-in files loaded ({', '.join(_PLUGIN_FILES.values())}) registered "
            f"{', '.join(registered) if registered else 'none'}: a method of a plug-in needs @register on its class "
            "and its file in --plugin FILE, also when resuming its run")


#: plug-in files imported by :func:`load_plugin`: module name -> absolute path (what another process loads
#: to know the same methods: ``hetfl compare --jobs``, Flower's simulated nodes)
_PLUGIN_FILES: dict[str, str] = {}


def plugin_module_name(file: Path) -> str:
    """The module name a plug-in file is imported as: its stem and a digest of its absolute path, so that two
    files of one name in two folders are two modules (and both are listed by :func:`plugin_files`)."""
    digest = hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:10]
    return f"hetfl_plugin_{file.stem}_{digest}"


def load_plugin(path: str) -> None:
    """Import a Python file that registers methods (``hetfl run --plugin FILE``). A :class:`MethodError` names
    the file when the import fails (with the line and the error; the error is its ``__cause__``) or a method it
    registers breaks the interface."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError("--plugin", path, "no such file")
    name = plugin_module_name(file)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except MethodError as err:
        sys.modules.pop(name, None)
        raise MethodError(f"--plugin {path}: {err}") from None
    except Exception as err:  # anything the researcher's file raises: one line naming where, not a traceback
        sys.modules.pop(name, None)
        raise MethodError(f"--plugin {path}: importing it failed at {_failed_line(err, file)}: "
                          f"{type(err).__name__}: {err}") from err
    _PLUGIN_FILES[name] = str(file.resolve())


def _failed_line(err: Exception, file: Path) -> str:
    """``FILE:LINE`` of ``file`` where importing it raised ``err`` (a syntax error's own line)."""
    if isinstance(err, SyntaxError) and err.lineno is not None:
        return f"{file}:{err.lineno}"
    resolved = str(file.resolve())
    lines = [f.lineno for f in traceback.extract_tb(err.__traceback__) if str(Path(f.filename).resolve()) == resolved]
    return f"{file}:{lines[-1]}" if lines else str(file)


#: the resolved configuration's key (``algorithm.plugin_source``) that holds a plug-in method's code, as
#: :func:`plugin_source` gives it: part of the run's identity (:mod:`hetfl.engine.identity`)
PLUGIN_SOURCE = "plugin_source"


def plugin_source(full_name: str) -> str:
    """The code of the method ``full_name`` as far as it is no part of hetfl: ``"FILE sha256:DIGEST"`` of the
    plug-in file that registered its trainer (its name and the first 16 hex digits of its content's SHA-256), or
    ``""`` for hetfl's own methods and for a class registered outside a plug-in file (a notebook's cell: no file
    to read). A run's identity is its resolved configuration, which holds this, so that a run of a plug-in is
    not reused, resumed or tabled as the run of the same plug-in file edited since. Only that file is read:
    modules it imports are not."""
    trainer, _ = parse_name(full_name)
    cls = _CLASSES.get(trainer)
    path = None if cls is None else _PLUGIN_FILES.get(cls.__module__)
    if path is None:
        return ""
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    return f"{Path(path).name} sha256:{digest}"


def plugin_files() -> list[str]:
    """The plug-in files this process has loaded, in load order."""
    return list(_PLUGIN_FILES.values())


def registered_outside_files(full_names: Iterable[str]) -> list[str]:
    """The methods among ``full_names`` (``trainer+step``) registered by code that no plug-in file holds (a
    notebook, a script's ``__main__``): another process cannot know them."""
    trainers = {name.split("+")[0] for name in full_names}
    return sorted(n for n in trainers if n in _CLASSES and _CLASSES[n].__module__ not in _PLUGIN_FILES)


def parse_name(full_name: str) -> tuple[str, list[str]]:
    """'fedavg+ccvr' -> ('fedavg', ['ccvr']), validating each part and the composition
    (:func:`composition_error`)."""
    trainer, *steps = full_name.split("+")
    trainer_cls = algorithm_class(trainer)
    for n, step in enumerate(steps):
        if step not in _POSTHOC:
            allowed = ", ".join(_POSTHOC) or "none yet"
            raise ConfigError("algorithm.name", full_name, f"unknown post-hoc step {step!r}; "
                                                           f"{did_you_mean(step, list(_POSTHOC))}allowed: {allowed}")
        if step in steps[:n]:
            raise ConfigError("algorithm.name", full_name,
                              f"post-hoc step {step!r} is given twice; each step runs once, its settings in "
                              f"algorithm.{step}")
        problem = composition_error(trainer_cls, posthoc_class(step))
        if problem:
            raise ConfigError("algorithm.name", full_name, problem)
    return trainer, steps


def composition_error(trainer: type[Algorithm], step: type[PostHoc]) -> str | None:
    """Why ``trainer+step`` makes no sense, or None when it does.

    A step that works on the server's single global model (``PostHoc.needs_global_model``,
    e.g. CCVR re-training the global classifier) cannot follow a personalised method
    (``Algorithm.personalized``): such a method keeps a classifier (or a whole model) per
    client and evaluates each client with its own (FedPAC, FedPer, FedRep, LG-FedAvg,
    FedFomo, pFedHN, local); its server model, if it has one, is never evaluated and
    holds no trained global classifier (local: the initial model; LG-FedAvg: no global
    encoder), so the calibration would change nothing that is measured.
    """
    if step.needs_global_model and trainer.personalized:
        return (f"{trainer.name} is personalised (each client is evaluated with its own model; there is no "
                f"global model to calibrate), so the post-hoc step {step.name!r}, which works on the server's "
                f"global model, cannot follow it; use {step.name} with a method that trains a global model "
                f"(e.g. fedavg+{step.name}) or drop '+{step.name}'")
    return None


def posthoc_class(name: str) -> type[PostHoc]:
    module, cls = _POSTHOC[name].split(":")
    return getattr(importlib.import_module(module), cls)


def hyperparameters(full_name: str, params: dict[str, Any]) -> Any:
    """Validated settings of the trainer of ``full_name`` (unknown keys are errors);
    the settings of each post-hoc step (sub-table ``algorithm.<step>``) are validated too.
    ``algorithm.plugin_source`` (:func:`plugin_source`) is no setting of the method: left out."""
    recorded = str(params.get(PLUGIN_SOURCE, "")).split(" sha256:")[0]
    try:
        trainer, steps = parse_name(full_name)
    except ConfigError as err:
        if err.key != "algorithm.name" or not recorded:
            raise
        # a plug-in's run (its config.toml, which records the file), resumed without the file
        raise ConfigError(err.key, err.value, f"{err.allowed}; this run's method came from the plug-in file "
                                              f"{recorded} (algorithm.{PLUGIN_SOURCE}): pass --plugin {recorded}"
                          ) from None
    own = {k: v for k, v in params.items() if k not in steps and k != PLUGIN_SOURCE}
    for step in steps:
        step_hyper(step, params.get(step, {}))
    try:
        return build(algorithm_class(trainer).Hyper, own, prefix="algorithm.")
    except ConfigError as err:
        key = err.key.removeprefix("algorithm.")
        takers = [] if not err.allowed.startswith("unknown key") else \
            [n for n in available() if n != trainer and key in {f.name for f in fields(algorithm_class(n).Hyper)}]
        if not takers:
            raise
        raise ConfigError(err.key, err.value, f"{err.allowed}; {trainer} has no {key}, which is a setting of "
                                              f"{', '.join(takers)}: name the method meant (algorithm.name; "
                                              "hetfl compare: --methods)") from None


def settings_by_prefix(full_name: str, params: dict[str, Any]) -> list[tuple[str, Any]]:
    """``(prefix, settings)`` of the trainer of ``full_name`` (``"algorithm."``, :func:`hyperparameters`) and of
    each of its post-hoc steps (``"algorithm.ccvr."``, :func:`step_hyper`), validated: what a run's notes of
    unread settings (:func:`hetfl.params.inactive_settings`) go through."""
    _, steps = parse_name(full_name)
    return [("algorithm.", hyperparameters(full_name, params)),
            *((f"algorithm.{step}.", step_hyper(step, params.get(step, {}))) for step in steps)]


def as_written_params(full_name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The method settings of a configuration that a run wrote (its resolved ``config.toml``, which names
    every setting of its method and steps), with each setting it does not name because it was added to
    hetfl later, and whose default changed the computation (``setting(former=...)``: MOON's
    ``reference_mode``, FedUV's ``sigma_grad``), set to the value the run computed with. A name this hetfl
    does not know is left to the checks that name it."""
    try:
        trainer, steps = parse_name(full_name)
    except ConfigError:
        return params
    out = {**former_values(algorithm_class(trainer).Hyper), **params}
    for step in steps:
        former = former_values(posthoc_class(step).Hyper)
        if former and isinstance(params.get(step, {}), dict):
            out[step] = {**former, **params.get(step, {})}
    return out


def step_hyper(step: str, values: Any) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"algorithm.{step}", values, "must be a table of the step's settings")
    return build(posthoc_class(step).Hyper, values, prefix=f"algorithm.{step}.")


def build_posthoc(full_name: str, params: dict[str, Any], setup: Setup) -> list[PostHoc]:
    """The post-hoc steps of ``full_name``, in order."""
    _, steps = parse_name(full_name)
    return [posthoc_class(s)(step_hyper(s, params.get(s, {})), setup) for s in steps]


def build_algorithm(full_name: str, params: dict[str, Any], setup: Setup) -> Algorithm:
    trainer, _ = parse_name(full_name)
    method = algorithm_class(trainer)(hyperparameters(full_name, params), setup)
    check_hooks_callable(method)  # a hook its __init__ replaced by a value: refused before any round
    return method


# ------------------------------------------------------------------ a method's model parts
def models_that_fit(requires: Iterable[str], input_shape: tuple[int, ...], num_classes: int) -> list[str]:
    """The registered models that, with their default options, take inputs of ``input_shape`` and
    have every part in ``requires``; built on the ``meta`` device (nothing allocated, milliseconds)."""
    needed = set(requires)
    fits = []
    for name in MODELS:
        try:
            with torch.random.fork_rng(devices=[]), torch.device("meta"), NoRandomInit():
                model = build_model(name, tuple(input_shape), num_classes)
        except Exception:  # a model that cannot take this data (ModelError) or be built on meta does not fit
            continue
        if needed <= model_provides(param_groups(model)):
            fits.append(name)
    return fits


def check_model_parts(method: str, model: Any, groups: Mapping[str, Sequence[str]], input_shape: tuple[int, ...],
                      num_classes: int) -> None:
    """Refuse a model that lacks a part the method ``method`` (``trainer+step...``) requires: a
    ConfigError naming ``model.name``, what is missing and the models that fit, raised when the run
    is set up (before anything is written) instead of a failure mid-run (FedPAC's encoder stage on
    logistic regression has no parameters to differentiate). ``model`` is the run's ModelConfig."""
    trainer, *steps = method.split("+")
    parts = [(trainer, algorithm_class(trainer).model_requires)]
    parts += [(step, posthoc_class(step).model_requires) for step in steps]
    have = model_provides(groups)
    for who, requires in parts:
        missing = [part for part in requires if part not in have]
        if not missing:
            continue
        options = f" with model.options = {dict(model.options)}" if model.options else ""
        fitting = models_that_fit(requires, input_shape, num_classes)
        need = " and ".join(MODEL_PARTS[part] for part in missing)
        hint = ""
        if model.options and model.name in fitting:  # the options took the part away (auto's logistic regression)
            hint = f"{model.name} has it with its default options: --set \"{default_options_setting(model)}\"; "
        raise ConfigError("model.name", model.name, f"{who} needs {need}, and {model.name}{options} has none; {hint}"
                                                    f"models that fit this data (with their default options): "
                                                    f"{', '.join(fitting) or 'none'}")


def default_options_setting(model: Any) -> str:
    """``model.options={...}`` in ``--set`` syntax with the model's defaults for the options ``model`` sets
    (Synthetic's automatic ``mlp`` is logistic regression, ``hidden = []``: its default is ``[200, 200]``)."""
    defaults = model_options(model.name)
    values = {key: defaults.get(key, value) for key, value in dict(model.options).items()}
    inline = ", ".join(f"{key} = {json.dumps(list(v) if isinstance(v, tuple) else v)}" for key, v in values.items())
    return f"model.options={{{inline}}}"
