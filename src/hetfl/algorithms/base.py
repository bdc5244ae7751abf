"""The algorithm interface: what a federated method is made of.

A method is a small class with hooks named for when they run (the shape of
FedJAX's ``client_init / client_step / client_final`` and of Flower strategies):

server side
    ``init_server``   the round-0 server state (model + method tensors)
    ``payload``       what the server sends to one client (counted as bytes down)
    ``aggregate``     new server state from the clients' uploads
client side
    ``begin``         per-round client set-up, before training (e.g. MOON's flag)
    ``start_state``   the local model the client starts from
    ``stages``        the local procedure: a list of :class:`Stage`, each a loss,
                      the tensors it optimises and its SGD settings
    ``finish``        what the client uploads (counted as bytes up) and its new
                      persistent state
evaluation
    ``client_model``  the model a client is evaluated with (personalised methods)

Every hook is a plain function of tensors and dicts: the algorithm never sees
how clients are executed (sequentially, vectorised, or on Flower), never holds
per-client state in hidden attributes (it lives in the engine's client store
and in checkpoints), and never draws random numbers from global state.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from hetfl.models.layers import inference_copy
from hetfl.models.low_precision import low_precision_names, substitute
from hetfl.optim import SGDConfig
from hetfl.privacy import Release, participation

Tensors = dict[str, torch.Tensor]


class MethodError(ValueError):
    """A method (typically a plug-in's) that breaks the interface of :class:`Algorithm`: the message names the
    hook, what it did and what the interface expects. ``hetfl`` exits with code 2 on it, without a traceback."""


LOSS_CONTRACT = ("must return (loss, parts): a scalar tensor and a dict of name -> tensor, each part logged as "
                 "train_<name>, e.g. `return ce + w * pen, {\"ce\": ce.detach(), \"pen\": pen.detach()}`")


def check_loss_output(stage: Stage, out: Any) -> tuple[torch.Tensor, Mapping[str, torch.Tensor]]:
    """``out``, the value ``stage``'s loss returned, as ``(loss, parts)``; a :class:`MethodError` naming the loss
    function and what it returned when it is not a scalar tensor and a dict of tensors. Runs at every step:
    the message is built only for an error."""

    def broken(what: str) -> MethodError:
        where = f"{getattr(stage.loss, '__qualname__', 'the loss')} (stage {stage.name!r})"
        return MethodError(f"{where} {LOSS_CONTRACT}; {what}")

    if not (isinstance(out, tuple) and len(out) == 2):
        raise broken(f"it returned {f'a tuple of {len(out)}' if isinstance(out, tuple) else f'a {type(out).__name__}'}")
    loss, parts = out
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}"
        raise broken(f"its loss is {got} (a mean over the batch is a scalar)")
    if not isinstance(parts, Mapping):
        raise broken(f"its parts are a {type(parts).__name__}")
    for name, part in parts.items():
        if not isinstance(part, torch.Tensor):
            hint = " (`.item()` reads a value on the host: return `x.detach()`, a loss is a pure tensor function)" \
                if isinstance(part, (int, float)) else ""
            raise broken(f"its part {name!r} is a {type(part).__name__}{hint}")
    return loss, parts


# ------------------------------------------------------- what a plug-in's hooks must return
def _kind(value: Any) -> str:
    """``None`` or ``a TYPE``: what a hook gave instead of what it must return."""
    return "None" if value is None else f"a {type(value).__name__}"


def _returned(value: Any) -> str:
    return f"it returned {_kind(value)}"


def _tensor_dict_problem(value: Any, what: str = "it") -> str | None:
    """Why ``value`` is not a dict of name -> tensor (``what`` names it in the answer), or None."""
    if not isinstance(value, Mapping):
        return _returned(value) if what == "it" else f"{what} is {_kind(value)}"
    for name, tensor in value.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            return f"its entry {name!r} is a {type(tensor).__name__}"
    return None


def _server_problem(value: Any) -> str | None:
    if not isinstance(value, ServerState):
        return _returned(value)
    return _tensor_dict_problem(value.model, "its model") or _tensor_dict_problem(value.extra, "its extra")


def _stages_problem(value: Any) -> str | None:
    if not isinstance(value, list):
        return _returned(value)
    wrong = [type(s).__name__ for s in value if not isinstance(s, Stage)]
    return f"it holds a {wrong[0]}" if wrong else None


def _finish_problem(value: Any) -> str | None:
    if not (isinstance(value, tuple) and len(value) == 2):
        return f"it returned a tuple of {len(value)}" if isinstance(value, tuple) else _returned(value)
    return _tensor_dict_problem(value[0], "its upload") or _tensor_dict_problem(value[1], "its state")


def _client_model_problem(value: Any, method: Any) -> str | None:
    problem = _tensor_dict_problem(value)
    if problem is None:
        missing = [n for n in method.model.state_names if n not in value]
        problem = f"it lacks {missing[0]!r}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "") \
            if missing else None
    return problem


TENSORS = "a dict of name -> tensor"
SERVER = "a ServerState(model=..., extra=...) of dicts of name -> tensor"
#: the hooks whose values a plug-in's class is checked for (:func:`checked_hooks`): what each must return and
#: why a value is not that (``(value, method) -> problem or None``)
HOOK_CONTRACTS: dict[str, tuple[str, Callable[[Any, Any], str | None]]] = {
    "init_server": (SERVER, lambda v, m: _server_problem(v)),
    "payload": (TENSORS, lambda v, m: _tensor_dict_problem(v)),
    "aggregate": (SERVER, lambda v, m: _server_problem(v)),
    "setup_query": (TENSORS, lambda v, m: _tensor_dict_problem(v)),
    "setup_aggregate": (SERVER, lambda v, m: _server_problem(v)),
    "init_client_state": (TENSORS, lambda v, m: _tensor_dict_problem(v)),
    "begin": (TENSORS, lambda v, m: _tensor_dict_problem(v)),
    "start_state": (TENSORS, lambda v, m: _tensor_dict_problem(v)),
    "stages": ("a list of Stage", lambda v, m: _stages_problem(v)),
    "personalize_stages": ("a list of Stage", lambda v, m: _stages_problem(v)),
    "finish": ("(upload, state): two dicts of name -> tensor", lambda v, m: _finish_problem(v)),
    "client_model": (f"{TENSORS} holding the model's every tensor", _client_model_problem),
}


def _where(fn: Callable[..., Any]) -> str:
    """``FILE:LINE`` of ``fn``'s definition, or its qualified name where the source is not to be found."""
    try:
        return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (OSError, TypeError):
        return getattr(fn, "__qualname__", "?")


def checked_hook(hook: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, a method's ``hook``, checked for what it returns (:data:`HOOK_CONTRACTS`): a
    :class:`MethodError` naming the class, the hook, where it is defined, what it must return and what it
    returned, instead of a failure deep in the engine or a run that goes on with a wrong value."""
    what, problem_of = HOOK_CONTRACTS[hook]
    where = _where(fn)

    @functools.wraps(fn)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = fn(self, *args, **kwargs)
        problem = problem_of(out, self)
        if problem is not None:
            raise MethodError(f"{type(self).__name__}.{hook} ({where}) must return {what}; {problem}")
        return out

    checked.__hetfl_checked__ = True  # type: ignore[attr-defined]
    return checked


def checked_hooks(cls: type) -> None:
    """Check the values of the hooks of ``cls`` that code outside hetfl defines (a plug-in's, a notebook's):
    hetfl's own methods are tested, a researcher's first plug-in is not (``register`` calls this)."""
    for hook in HOOK_CONTRACTS:
        fn = getattr(cls, hook)
        # a function made by exec with bare globals has __module__ = None: a plug-in's like any other
        if getattr(fn, "__hetfl_checked__", False) or (getattr(fn, "__module__", None) or "").startswith("hetfl."):
            continue
        setattr(cls, hook, checked_hook(hook, fn))


@dataclass(frozen=True)
class NoHyper:
    """Settings of a method without hyperparameters."""


@dataclass
class Batch:
    x: torch.Tensor  # prepared model input (float, normalised, augmented)
    y: torch.Tensor  # int64 labels
    # random numbers of this step, drawn by the executor from the client's own stream
    # with the stage's ``draws`` function (Mixup's lambda and permutation)
    draws: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class HeadTransform:
    """A method's change to how the classifier is applied, carried in the model state.

    A state holding ``key`` (a scalar tensor: the transform's parameter) is called with
    ``features(z, value)`` applied to the encoder's output and ``weight(W, value)`` to the
    classifier's rows, in training and at inference alike, so that a model keeps the head a method
    gave it through aggregation, checkpoints and evaluation. The method that owns a transform
    defines and registers it in its own module (:func:`register_head_transform`): CCVR's ReLU +
    Tukey on features, clsnorm's L2-normalised rows.
    """

    key: str
    features: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    weight: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


# a state key in these namespaces is a head transform's; one nobody registered is an error, never ignored
HEAD_TRANSFORM_NAMESPACES = ("feature_transform/", "classifier_transform/")
HEAD_TRANSFORMS: dict[str, HeadTransform] = {}


def register_head_transform(transform: HeadTransform) -> HeadTransform:
    """Make :class:`ModelCaller` apply ``transform`` to every state that holds its key."""
    if not transform.key.startswith(HEAD_TRANSFORM_NAMESPACES):
        raise ValueError(f"head transform key {transform.key!r} must start with one of {HEAD_TRANSFORM_NAMESPACES}")
    HEAD_TRANSFORMS[transform.key] = transform
    return transform


def without_feature_transforms(state: Tensors) -> Tensors:
    """``state`` without the transforms that change features: the model whose encoder gives raw
    features (what a post-hoc step's clients compute statistics of)."""
    return {k: v for k, v in state.items()
            if not (k in HEAD_TRANSFORMS and HEAD_TRANSFORMS[k].features is not None)}


def _active_transforms(state: Mapping[str, torch.Tensor]) -> list[HeadTransform]:
    unknown = [k for k in state if k.startswith(HEAD_TRANSFORM_NAMESPACES) and k not in HEAD_TRANSFORMS]
    if unknown:
        raise KeyError(f"the model state holds head transform(s) {unknown} that no loaded method registered; "
                       "import the method that wrote them (e.g. hetfl.algorithms.ccvr)")
    return [t for key, t in HEAD_TRANSFORMS.items() if key in state]


class ModelCaller:
    """Calls the model with an explicit state dict (``functional_call``).

    The state dict may hold more than the model's tensors (method tensors such
    as control variates): only the model's own names are passed through. A
    state that carries a registered :class:`HeadTransform`'s key is applied
    with that transform (CCVR's calibrated classifier sees the ReLU + Tukey
    features it was trained on; clsnorm's rows are L2-normalised).
    """

    def __init__(self, model: nn.Module) -> None:
        self.module = model
        self.param_names = tuple(name for name, _ in model.named_parameters())
        self.buffer_names = tuple(name for name, _ in model.named_buffers())
        self.state_names = self.param_names + self.buffer_names
        # the parameters a bf16 step reads from bfloat16 copies (hetfl.models.low_precision)
        self.low_precision_names = low_precision_names(model)
        # the model in eval mode, for reference models run in inference mode (MOON's, as its authors' code)
        self.inference_module = inference_copy(model)

    def __call__(
        self, state: Tensors, x: torch.Tensor, features: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # in a bf16 step, the trained float32 weights' bfloat16 copies (hetfl.models.low_precision)
        own = substitute({name: state[name] for name in self.state_names})
        transforms = _active_transforms(state)
        if not transforms:
            return functional_call(self.module, own, (x,), {"return_features": features})
        z, _ = functional_call(self.module, own, (x,), {"return_features": True})
        weight = state["classifier.weight"]
        for t in transforms:
            if t.features is not None:
                z = t.features(z, state[t.key])
            if t.weight is not None:
                weight = t.weight(weight, state[t.key])
        logits = F.linear(z, weight, state.get("classifier.bias"))
        return (z, logits) if features else logits

    def logits(self, state: Tensors, x: torch.Tensor) -> torch.Tensor:
        return self(state, x)  # type: ignore[return-value]

    def features_and_logits(self, state: Tensors, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self(state, x, features=True)  # type: ignore[return-value]

    def reference_features(self, state: Tensors, x: torch.Tensor, eval_mode: bool = False) -> torch.Tensor:
        """Features of a fixed reference model (MOON's global and previous models, FedBR's global encoder):
        no gradient. In the module's mode (training: BatchNorm normalises by the batch's statistics and
        updates copies of the running ones, never ``state``'s), or with ``eval_mode`` in eval mode
        (BatchNorm by ``state``'s running statistics, dropout off), whatever the module's mode."""
        with torch.no_grad():
            if eval_mode:
                own = {n: state[n] for n in self.state_names}
                feats, _ = functional_call(self.inference_module, own, (x,), {"return_features": True})
                return feats
            own = {n: state[n].clone() if n in self.buffer_names else state[n] for n in self.state_names}
            feats, _ = functional_call(self.module, own, (x,), {"return_features": True})
        return feats


@dataclass
class Setup:
    """What a method may know about the federation it runs in."""

    model: ModelCaller
    groups: dict[str, list[str]]  # "encoder" / "projector" / "classifier" -> parameter names
    num_clients: int
    num_classes: int
    client_sizes: list[int]  # training samples per client
    train: Any  # hetfl.config.TrainConfig
    seed: int
    cache_dir: str = ""  # data.cache_dir: where a method's own datasets (FedBR's proxy) are cached ('' = default)
    # runtime.secure_aggregation: the server learns only the sum of an additive post-hoc step's replies, which
    # must then be dense and bounded (CCVR clips its features to clip_norm)
    secure_aggregation: bool = False
    input_shape: tuple[int, ...] = ()  # one sample's model input (``[C, H, W]``, ``[features]``); () where unknown

    def sgd(self, lr: float, *, momentum: float | None = None, weight_decay: float | None = None) -> SGDConfig:
        """The run's client SGD settings at learning rate ``lr`` (overridable per stage)."""
        return SGDConfig(
            lr=lr,
            momentum=self.train.momentum if momentum is None else momentum,
            weight_decay=self.train.weight_decay if weight_decay is None else weight_decay,
        )


@dataclass
class ClientContext:
    """Everything one client's local training sees in one round."""

    client_id: int
    round: int  # 1-based
    num_samples: int
    lr: float  # this round's client learning rate (after the schedule)
    payload: Tensors  # what the server sent
    state: Tensors  # the client's persistent state at the start of the round
    extras: Tensors = field(default_factory=dict)  # computed by Algorithm.begin
    # features (classifier input) and labels of the client's own training data under a
    # model state, eval mode, no augmentation; given by the executor (FedPAC's statistics)
    features: Callable[[Tensors], tuple[torch.Tensor, torch.Tensor]] | None = None
    # the client's own training data as model inputs (normalised, no augmentation) and
    # labels; given by the executor (FedBR's pseudo-data, FedFomo's validation losses)
    inputs: Callable[[], Batch] | None = None
    # data every client received once, before round 1 (FedMix's averaged data): the
    # server's ``extra`` entries named ``shared/<name>``, without the prefix
    shared: Tensors = field(default_factory=dict)


LossFn = Callable[[Tensors, Batch, ClientContext], tuple[torch.Tensor, Tensors]]
GradFn = Callable[[Tensors, Tensors, ClientContext], Tensors]
DrawFn = Callable[[torch.Generator, int], Tensors]
SHARED = "shared/"


@dataclass
class Stage:
    """One phase of local training: SGD on ``trainable`` tensors of the local state.

    Attributes:
        name: for logs ("local", "classifier", "encoder" ...).
        loss: ``(state, batch, ctx) -> (loss, metrics)``; ``state`` holds every
            local tensor, trainable or not.
        trainable: names of the tensors this stage optimises.
        sgd: optimiser settings; the optimiser state starts at zero per stage.
        epochs: passes over the client's data (ignored if ``steps`` > 0).
        steps: a fixed number of steps instead of epochs.
        grad_transform: ``(grads, state, ctx) -> grads`` applied before the
            update (SCAFFOLD's correction).
        draws: ``(generator, batch_size) -> tensors`` of random numbers a step
            needs, drawn on the CPU from the client's own stream before each step
            and passed as ``batch.draws`` (the loss itself never draws).
        adversary: a stage whose step runs on the same batch before each step
            of this one, with its own optimiser state kept over the stage
            (FedBR's max step; its loss is the negative of what it maximises).
            Its ``epochs``/``steps`` are ignored.
    """

    name: str
    loss: LossFn
    trainable: tuple[str, ...]
    sgd: SGDConfig
    epochs: int = 1
    steps: int = 0
    grad_transform: GradFn | None = None
    draws: DrawFn | None = None
    adversary: Stage | None = None


def _stage_where(stage: Stage) -> str:
    """``stage 'NAME' of CLASS``: the stage and the method whose loss it runs, for an error's message."""
    owner = getattr(stage.loss, "__self__", None)
    method = type(owner).__name__ if owner is not None else getattr(stage.loss, "__qualname__", "?").split(".")[0]
    return f"stage {stage.name!r} of {method}"


def check_stage_start(stages: Sequence[Stage], start: Mapping[str, torch.Tensor]) -> None:
    """A :class:`MethodError` when a stage (or its adversary) trains a tensor that the state it starts from
    (``start_state``) does not hold: a typo in ``trainable``, named before the first step."""
    for stage in stages:
        for part in (stage, stage.adversary):
            missing = [] if part is None else [n for n in part.trainable if n not in start]
            if missing:
                raise MethodError(f"{_stage_where(part)} trains {missing[0]!r}, which the state it starts from "
                                  f"(start_state) does not hold; it holds {', '.join(list(start)[:6])}"
                                  f"{', ...' if len(start) > 6 else ''} (self.setup.groups names the model's parts)")


def checked_stage_output(stage: Stage, part: str, value: Any) -> Any:
    """``value``, what ``stage``'s ``part`` (``draws``, ``grad_transform``) returned, when it is a dict of name ->
    tensor; else a :class:`MethodError` naming the stage, the method and what it returned."""
    problem = _tensor_dict_problem(value)
    if problem is not None:
        raise MethodError(f"{_stage_where(stage)}: its {part} must return {TENSORS}; {problem}")
    return value


@dataclass
class Upload:
    """What one client sends back after a round."""

    client_id: int
    tensors: Tensors
    num_samples: int
    steps: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class ServerState:
    """The server's state: the global model state dict plus method tensors."""

    model: Tensors
    extra: Tensors = field(default_factory=dict)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` ``[n, classes]`` against integer ``labels`` ``[n]``: what
    ``F.cross_entropy(logits, labels)`` computes.

    Inside ``torch.func`` transforms (the vectorised executor's ``vmap`` of ``grad``) and under
    ``torch.compile``, it is the mean negative log-softmax of each label's logit: its gradient equals
    F.cross_entropy's to the last bit (the value can differ in the last bit: another summation), and
    under ``vmap`` it runs 10 operations where F.cross_entropy's batching rule, which masks
    ``ignore_index``, runs 26: tiny kernels, and the number of kernels a step launches is what a
    small-batch round on a GPU waits on. Elsewhere (a client's step under plain autograd: the
    sequential executor's, and the vectorised executor's step of one client alone) it is
    F.cross_entropy itself, whose fused loss takes 5 operations (this form: 10). The local objectives
    use it; evaluation and the server's own training keep F.cross_entropy. Half-precision logits
    (bfloat16 autocast) are taken to float32 first, as autocast runs F.cross_entropy."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(logits):
        return -logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).mean()
    return F.cross_entropy(logits, labels)


def cross_entropy_loss(model: ModelCaller) -> LossFn:
    """Plain cross-entropy: the local objective of FedAvg."""

    def loss(state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        logits = model.logits(state, batch.x)
        ce = cross_entropy(logits, batch.y)
        return ce, {"ce": ce.detach()}

    return loss


def check_reply_form(reply: Tensors, shapes: Mapping[str, tuple[int, ...]],
                     dtypes: Mapping[str, tuple[torch.dtype, ...]]) -> None:
    """A ValueError unless ``reply`` holds exactly the tensors ``shapes`` names, each of its shape, of one of
    its ``dtypes`` and (floating point) finite: the form a step's ``check_reply`` asks of a client's reply."""
    if set(reply) != set(shapes):
        missing, extra = sorted(set(shapes) - set(reply)), sorted(set(reply) - set(shapes))
        raise ValueError("the reply " + "; ".join([*(f"lacks {k!r}" for k in missing),
                                                    *(f"has {k!r}, which is no part of it" for k in extra)]))
    for name, shape in shapes.items():
        t = reply[name]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name!r} has shape {list(t.shape)}, expected {list(shape)}")
        if t.dtype not in dtypes[name]:
            raise ValueError(f"{name!r} is {t.dtype}, expected {' or '.join(map(str, dtypes[name]))}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name!r} holds values that are not finite")


def check_class_indices(name: str, indices: torch.Tensor, num_classes: int, *, distinct: bool) -> None:
    """A ValueError unless ``indices`` (int64, 1-D) are class indices in ``[0, num_classes)`` (each once when
    ``distinct``)."""
    if indices.dtype != torch.int64 or indices.ndim != 1:
        raise ValueError(f"{name!r} must be a 1-D tensor of torch.int64 class indices, not {indices.dtype} of shape "
                         f"{list(indices.shape)}")
    if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= num_classes):
        raise ValueError(f"{name!r} holds {int(indices.min())}..{int(indices.max())}, outside the classes "
                         f"0..{num_classes - 1}")
    if distinct and len(torch.unique(indices)) != len(indices):
        raise ValueError(f"{name!r} names a class more than once")


def weighted_mean(states: Sequence[Tensors], weights: Sequence[float]) -> Tensors:
    """Weighted average of state dicts (FedAvg, McMahan et al. 2017, eq. in Alg. 1).

    Floating tensors are averaged with weights normalised to sum to one;
    integer buffers (BatchNorm's ``num_batches_tracked``) take the maximum.
    """
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weighted_mean needs a positive total weight")
    out: Tensors = {}
    for name, first in states[0].items():
        if first.is_floating_point():
            acc = torch.zeros_like(first)
            for s, w in zip(states, weights, strict=True):
                acc.add_(s[name], alpha=w / total)
            out[name] = acc
        else:
            out[name] = torch.stack([s[name] for s in states]).amax(0)
    return out


# ------------------------------------------------------- what a method needs of the model
#: The model parts a method or post-hoc step may require (its ``model_requires``), and what each is.
#: A part counts when it holds trainable parameters: logistic regression (``mlp`` with ``hidden = []``)
#: has an encoder that is a bare ``Flatten``, so no encoder to train apart from the classifier.
MODEL_PARTS: dict[str, str] = {
    "encoder": "an encoder with trainable parameters before the classifier",
    "projector": "a projection head between the encoder and the classifier (model.projector)",
}


def model_provides(groups: Mapping[str, Sequence[str]]) -> frozenset[str]:
    """The parts of :data:`MODEL_PARTS` a model has, from its parameter groups (``param_groups``)."""
    return frozenset(part for part in MODEL_PARTS if groups.get(part))


#: the server-state extra (``dp_releases_key`` + this) that says who was asked in each release (a boolean matrix)
PARTICIPATION_SUFFIX = "/taken_part"


class PrivateReleases:
    """Hooks of a method (trainer or post-hoc step) that makes differentially private releases, for the
    run's privacy ledger (``hetfl.engine.ledger``): the engine records each release durably before the
    server uses it, then hands the method the multipliers of the releases made before it, so that what
    the method reports spent counts every release the server ever received (a resumed run's too), each for
    the clients its phase asked (:meth:`dp_participation`: a client counts the releases it took part in).

    A method that releases sets ``dp_releases_key`` (the server-state extra that lists its releases'
    multipliers) and implements :meth:`dp_release`; the rest is generic."""

    dp_releases_key: ClassVar[str | None] = None
    #: the tensors of a trainer's upload that carry its noise (what a node with a privacy floor counts)
    dp_upload_keys: ClassVar[tuple[str, ...]] = ()

    def dp_release(self, received: Any) -> Release | None:
        """The release in what the server just received (a step's replies, a round's uploads); None: none."""
        return None

    def dp_refused(self, refused: Mapping[int, str]) -> Release | None:
        """The release in noisy uploads the server received and refused, when it received nothing usable in that
        attempt of the phase (``refused``: client -> SHA-256 of the upload's bytes, as the federation read them);
        None: the method releases nothing. Such uploads reached the server all the same: a round run again after
        them releases again, and both count."""
        return None

    def dp_recorded(self, server: ServerState) -> list[float]:
        """The multipliers of the releases ``server`` (e.g. a checkpoint's state) accounts for."""
        key = self.dp_releases_key
        return [] if key is None or key not in server.extra else [float(z) for z in server.extra[key].tolist()]

    def dp_with_past(self, server: ServerState, multipliers: list[float],
                     clients: Sequence[Sequence[int] | None] | None = None) -> ServerState:
        """``server`` accounting for exactly ``multipliers``: the releases made before the one at hand; and, in
        :meth:`dp_participation`'s key, who was asked in each of them and in the one at hand (``clients``, one
        row more than ``multipliers``: the method appends the multiplier of the one at hand when it uses it).
        ``clients`` None, or no row naming clients: every client in every release (the key is dropped)."""
        key = self.dp_releases_key
        if key is None:
            return server
        taken_part = None if clients is None else participation(clients)
        extra = {k: v for k, v in server.extra.items() if k not in (key, key + PARTICIPATION_SUFFIX)}
        if multipliers:
            extra[key] = torch.tensor(multipliers, dtype=torch.float64)
        if taken_part is not None:
            extra[key + PARTICIPATION_SUFFIX] = taken_part
        return ServerState(model=server.model, extra=extra)

    def dp_participation(self, server: ServerState, releases: int) -> torch.Tensor | None:
        """Who was asked in each of ``server``'s ``releases`` releases (:func:`hetfl.privacy.participation`'s
        matrix, kept by :meth:`dp_with_past`), for the method's guarantee; None (every client in every
        release, the conservative reading) where the state has no such matrix or one of another length (a
        checkpoint written before hetfl kept it)."""
        key = self.dp_releases_key
        taken_part = None if key is None else server.extra.get(key + PARTICIPATION_SUFFIX)
        return taken_part if taken_part is not None and taken_part.shape[0] == releases else None

    def privacy_notice(self) -> str | None:
        """What the server sees of the method's private uploads, when the headline epsilon does not say it
        (shown as the run's first line); None: nothing to add."""
        return None


class Algorithm(PrivateReleases):
    """Base class: FedAvg behaviour at every hook; methods override a few.

    Subclasses set ``name``, ``Hyper`` (a frozen dataclass of settings built
    with :func:`hetfl.params.setting`, docstring citing the paper) and
    ``citation``; a method that works on a part of the model that not every
    model has (an encoder to train apart from the classifier) names it in
    ``model_requires`` (:data:`MODEL_PARTS`), and a run with a model without
    it is refused at set-up (:func:`check_model_parts`).
    """

    name: ClassVar[str] = ""
    Hyper: ClassVar[type] = NoHyper
    citation: ClassVar[str] = ""
    personalized: ClassVar[bool] = False  # no single global model -> no global_acc
    # model parts (keys of MODEL_PARTS) the method cannot work without; checked when a run is set up
    model_requires: ClassVar[tuple[str, ...]] = ()
    # which of a client context's per-client dicts ("payload", "state") a stage's loss, gradient transform
    # or draws read. The vectorised executor stacks only those, so that clients whose other dicts differ
    # in structure (a sampled round's first-timers, with no persistent state yet, and returning clients)
    # still train as one batched group; a step that reads an undeclared one fails naming this attribute.
    step_reads: ClassVar[frozenset[str]] = frozenset({"payload", "state"})
    # every client's upload (``finish``) holds the same tensor names, shapes and dtypes in a round, as every
    # built-in method's does: a Flower server then refuses an upload whose form differs from the round's other
    # uploads (a node of another hetfl version, a faulty plug-in) before ``aggregate`` reads it. A method whose
    # uploads differ by client sets False (the server then checks the model's tensors only)
    uniform_upload: ClassVar[bool] = True

    def __init__(self, hyper: Any, setup: Setup) -> None:
        self.hp = hyper
        self.setup = setup
        self.model = setup.model

    # ----------------------------------------------------------------- server
    def init_server(self, model_state: Tensors) -> ServerState:
        return ServerState(model=model_state)

    def payload(self, server: ServerState, client_id: int) -> Tensors:
        return server.model

    def aggregate(self, server: ServerState, uploads: list[Upload], round: int) -> ServerState:
        model = weighted_mean([u.tensors for u in uploads], self.client_weights(uploads))
        return ServerState(model=model, extra=server.extra)

    def client_weights(self, uploads: list[Upload]) -> list[float]:
        """The server's weights of the round's uploads (``train.weighting``): their sample counts ("size",
        FedAvg's ``n_i / n`` once normalised) or 1 each ("uniform", ``1/M``: FedBR's Algorithm 1 and the
        authors' code). Methods with a weighting rule of their own (SCAFFOLD, FedDyn, GroupDRO over clients,
        FedBR, FedNova) do not call it and say so."""
        if self.setup.train.weighting == "uniform":
            return [1.0] * len(uploads)
        return [float(u.num_samples) for u in uploads]

    def memory_needs(self, input_shape: tuple[int, ...], feature_dim: int) -> list[tuple[str, Any, int, str]]:
        """Host memory the method's size settings make it hold beyond the model's copies (a hypernetwork, a
        virtual dataset, a discriminator), for inputs of ``input_shape`` and features of ``feature_dim``
        entries, as ``(key, value, bytes, what)``: ``hetfl.engine.resources.require`` refuses a total past the
        machine's memory when a run is set up, naming the key, before anything is written; none by default."""
        return []

    def run_notes(self) -> list[str]:
        """What the user should hear when a run of this method starts: a cost that its settings hide (FedETF's
        personalisation before every evaluation); none by default."""
        return []

    def round_info(self, server: ServerState, uploads: list[Upload], round: int) -> dict[str, Any]:
        """Numbers of the round for its metrics line, after ``aggregate`` made ``server`` (e.g. FedPAC's
        privacy budget spent so far); none by default."""
        return {}

    def setup_query(self, ctx: ClientContext) -> Tensors:
        """Client side of the set-up round, once before round 1: what the client
        shares (FedMix's averaged data). Default: nothing, and no set-up round."""
        return {}

    def setup_aggregate(self, server: ServerState, replies: dict[int, Tensors]) -> ServerState:
        """Server side of the set-up round: fold the clients' replies into the server
        state; entries of ``extra`` named ``shared/<name>`` reach every client as
        ``ctx.shared`` (sent once, counted once)."""
        return server

    def check_setup_reply(self, client: int, reply: Tensors) -> None:
        """What the server checks of client ``client``'s set-up reply before ``setup_aggregate`` reads it, where
        the reply crossed a network (a Flower node may run another hetfl version or a faulty plug-in): a
        ValueError saying what in ``reply`` is not what ``setup_query`` returns, so that the server leaves that
        client out instead of stopping in ``setup_aggregate``. Accepts any reply by default."""

    def setup_reply_needed(self, client: int) -> bool:
        """Whether ``setup_aggregate`` cannot go on without client ``client``'s set-up reply (FedBR's pseudo-data
        plan assigns it samples): a federation whose client did not answer then stops the run, resumable, instead
        of aggregating without it. False by default (FedMix shares the means of the clients that answered)."""
        return False

    def has_setup_round(self) -> bool:
        return type(self).setup_query is not Algorithm.setup_query

    # ----------------------------------------------------------------- client
    def init_client_state(self, client_id: int, server: ServerState) -> Tensors:
        return {}

    def begin(self, ctx: ClientContext) -> Tensors:
        return {}

    def start_state(self, ctx: ClientContext) -> Tensors:
        return {name: ctx.payload[name] for name in self.model.state_names}

    def trainable_names(self) -> tuple[str, ...]:
        return self.model.param_names

    def running_buffers(self) -> tuple[str, ...]:
        """Names of the local state's tensors that a forward pass in training mode updates (BatchNorm running
        statistics): the model's buffers, and those of a method's own copy of the model that its loss calls
        (Ditto's personal model, APFL's local model). A step updates them on copies made inside the
        differentiated function (``hetfl.engine.local.step_gradients``): an update in place of a tensor the
        step reads is refused by ``torch.func`` transforms, and the vectorised executor would train the
        round's clients one after the other."""
        return self.model.buffer_names

    def loss(self, state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        return cross_entropy_loss(self.model)(state, batch, ctx)

    def stages(self, ctx: ClientContext) -> list[Stage]:
        train = self.setup.train
        return [
            Stage(
                name="local",
                loss=self.loss,
                trainable=self.trainable_names(),
                sgd=self.setup.sgd(ctx.lr),
                epochs=train.local_epochs,
                steps=train.local_steps,
            )
        ]

    def finish(self, ctx: ClientContext, local: Tensors, steps: int) -> tuple[Tensors, Tensors]:
        """(upload, new persistent client state). Default: upload the local model."""
        return {name: local[name] for name in self.model.state_names}, ctx.state

    # ------------------------------------------------------------- evaluation
    def client_model(self, server: ServerState, client_state: Tensors, client_id: int) -> Tensors:
        """The model state client ``client_id`` is evaluated with (default: the global model)."""
        return server.model

    def predictor(self, state: Tensors, ctx: ClientContext) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A function from prepared test inputs to logits for client ``ctx.client_id``,
        used instead of ``model(state, x)`` at evaluation (kNN-Per's interpolation
        with a local datastore). ``state`` is the client's evaluated model (after
        ``personalize_stages``). Default: None, the plain model."""
        return None

    def personalize_stages(self, ctx: ClientContext) -> list[Stage]:
        """Local training run on a copy of ``client_model`` before evaluating it
        (fine-tuning: FedBABU, FedAvg+FT). Default: none."""
        return []

    def finetune_stages(self, epochs: int, part: str, lr: float) -> list[Stage]:
        """Cross-entropy fine-tuning of the classifier (``part = "head"``) or of the whole model
        for ``epochs`` at ``lr`` (0 = the run's ``train.lr``): the ``personalize_stages`` of
        FedBABU and FedAvg+FT. None for 0 epochs."""
        if epochs == 0:
            return []
        names = tuple(self.setup.groups["classifier"]) if part == "head" else self.model.param_names
        return [Stage("finetune", self.loss, names, self.setup.sgd(lr or self.setup.train.lr), epochs=epochs)]


#: every hook of a method (the functions :class:`Algorithm` and :class:`PrivateReleases` define for a method to
#: override): each must stay callable in a plug-in's class and instance (:func:`check_hooks_callable`)
HOOKS = ("init_server", "payload", "aggregate", "client_weights", "memory_needs", "run_notes", "round_info",
         "setup_query", "check_setup_reply", "setup_reply_needed", "setup_aggregate", "has_setup_round",
         "init_client_state", "begin", "start_state", "trainable_names", "running_buffers", "loss", "stages",
         "finish", "client_model", "predictor",
         "personalize_stages", "finetune_stages", "dp_release", "dp_refused", "dp_recorded", "dp_with_past",
         "dp_participation", "privacy_notice")


def check_hooks_callable(method: Any) -> None:
    """Refuse a hook set to a value that cannot be called (``payload = {...}`` in a plug-in's class body,
    ``self.aggregate = "mean"`` in its ``__init__``): a :class:`MethodError` naming the class, the method, the
    hook, the value's type and what a hook must be, when the class is registered (``method`` a class) or built
    (an instance), instead of "TypeError: 'dict' object is not callable" from the first round that calls it."""
    cls = method if isinstance(method, type) else type(method)
    for hook in HOOKS:
        value = getattr(method, hook)
        if callable(value):
            continue
        where = "" if isinstance(method, type) or hook not in vars(method) else " (set on the instance)"
        params = ", ".join(inspect.signature(getattr(Algorithm, hook)).parameters)
        raise MethodError(f"{cls.__name__}.{hook} of method {cls.name!r}{where} is {_kind(value)}, not callable: "
                          f"a hook must be a method, `def {hook}({params})` as in Algorithm.{hook} (a value "
                          "assigned to a hook's name replaces the hook)")
