"""Typed, validated settings: the one mechanism behind the run config and every
algorithm's hyperparameters.

A settings class is a frozen dataclass whose fields are declared with
:func:`setting`, which records the allowed range or choices. :func:`build`
turns a plain dict (from TOML or ``--set``) into an instance, rejecting unknown
keys, wrong types and out-of-range values with a :class:`ConfigError` that
names the key, the value and what is allowed. Float settings are finite: ``inf``
and ``nan`` (which TOML and ``--set`` accept as numbers) are refused unless a
field is declared with ``finite=False``, since a non-finite learning rate or
coefficient only turns a run into NaNs that exits 0.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

#: the largest float32: parameters and optimiser states are float32, so a step size or weight decay past it
#: cannot scale a gradient (torch.optim raises "value cannot be converted to type float without overflow");
#: such settings are declared with ``lt=FLOAT32_MAX``
FLOAT32_MAX = 3.4028234663852886e38
#: TOML's integers are 64-bit (a reader must refuse one it cannot hold): an integer setting stays in this range,
#: so that the run's config.toml is TOML every reader takes
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class ConfigError(ValueError):
    """An invalid configuration value; ``hetfl`` exits with code 2 on it."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key} = {shown_value(value)}: {allowed}")


def shown_value(value: Any) -> str:
    """``value`` as a message shows it: as written in a config file or ``--set`` for booleans (``true``, which
    ``--set`` takes; Python's ``True`` it refuses) and tuples (``[]``), also inside lists and tables
    (``[true, false]``, ``{'bn': true}``), else Python's ``repr`` (strings quoted)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(shown_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key!r}: {shown_value(item)}" for key, item in value.items()) + "}"
    return repr(value)


def did_you_mean(word: Any, options: Sequence[Any], prefix: str = "") -> str:
    """``"did you mean 'fedavg'? "`` for the option closest to ``word`` (letter case ignored, so ``FedAvg``
    finds ``fedavg``; :func:`difflib.get_close_matches`), ``prefix`` put before it (``train.`` for a key
    of that section); ``""`` when nothing is close. The start of an error's "what is allowed"."""
    by_lower = {str(option).lower(): option for option in options}
    close = difflib.get_close_matches(str(word).lower(), list(by_lower), n=1, cutoff=0.6)
    return f"did you mean {prefix + str(by_lower[close[0]])!r}? " if close else ""


@dataclasses.dataclass(frozen=True)
class Condition:
    """A condition on another setting's value, other than being one of some values (:func:`setting`'s
    ``when``): ``text`` says it after the setting's name (``> 0``), ``holds`` checks a value."""

    text: str
    holds: Callable[[Any], bool]


def above(bound: float) -> Condition:
    """The other setting is greater than ``bound`` (``when={"finetune_epochs": above(0)}``)."""
    return Condition(f"> {bound}", lambda value: value > bound)


#: the other setting is a finite number (``when={"dp_epsilon": FINITE}``: differential privacy is on)
FINITE = Condition("< inf", lambda value: math.isfinite(value))

#: a setting's condition: for each other setting of its class, the values under which it is read (a tuple),
#: or a :class:`Condition`; all of them must hold
When = Mapping[str, tuple[Any, ...] | Condition]


#: ``setting(former=...)`` not given: the setting's default is how hetfl computed before the setting existed
NO_FORMER: Any = type("NoFormer", (), {"__repr__": lambda self: "NO_FORMER"})()


def setting(
    default: Any,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: Sequence[Any] | None = None,
    finite: bool = True,
    when: When | None = None,
    former: Any = NO_FORMER,
    doc: str = "",
) -> Any:
    """A dataclass field with validation metadata (range, choices, help text).

    ``finite=False`` lets a float setting (or the floats of a list setting) be ``inf`` or ``nan``;
    by default they are refused. ``when`` declares the mode in which the setting is read at all
    (``when={"pseudo_source": ("proxy",)}``: only under ``pseudo_source = "proxy"``); moved from its
    default in another mode, it changes nothing, and :func:`inactive_settings` says so.
    ``former``: for a setting added to hetfl with a default that changed what runs compute, the value
    that gives the computation of the hetfl before it; a run written then (its resolved configuration
    does not name the setting) is read with it (:func:`former_values`), so that it resumes as it started
    and is never taken for a run of the new default.
    """
    meta = {"ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices, "finite": finite, "doc": doc,
            "when": dict(when or {}), "former": former}
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def former_values(cls: type) -> dict[str, Any]:
    """``{name: value}`` of the settings of the dataclass ``cls`` declared with ``former`` (:func:`setting`):
    what a configuration written before each of them existed ran with."""
    return {f.name: f.metadata["former"] for f in dataclasses.fields(cls)
            if f.metadata.get("former", NO_FORMER) is not NO_FORMER}


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _toml_value(value: Any) -> str:
    """``value`` as TOML writes it (for an example in a message): strings quoted, booleans lower case."""
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


def _inline_table(text: str) -> str:
    """``norm=gn,width=2`` as the TOML inline table meant, ``{norm = 'gn', width = 2}`` (for a message)."""
    pairs = []
    for part in text.split(","):
        name, _, raw = part.partition("=")
        try:
            tomllib.loads(f"v = {raw.strip()}")
            item = raw.strip()
        except tomllib.TOMLDecodeError:
            item = repr(raw.strip().strip("'\""))
        pairs.append(f"{name.strip()} = {item}")
    return "{" + ", ".join(pairs) + "}"


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert ``value`` to the annotated type ``tp`` or raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(key, value, option)
            except ConfigError as err:
                errors.append(err.allowed)
        raise ConfigError(key, value, " or ".join(errors))
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            items = (value.strip().removeprefix("[").removesuffix("]") if isinstance(value, str) and "," in value
                     else _toml_value(value))  # "[0,90" (a bracket lost) is meant as [0,90], not [[0,90]
            raise ConfigError(key, value, f"must be a list, in brackets: --set \"{key}=[{items}]\" ([] for none)")
        (item_type, *_) = typing.get_args(tp) or (Any,)
        items = [_coerce(f"{key}[{i}]", v, item_type) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            example = _inline_table(value) if isinstance(value, str) and "=" in value else "{name = value, ...}"
            raise ConfigError(key, value, f"must be a table of key = value pairs, in braces (strings quoted): "
                                          f"--set \"{key}={example}\"")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, value, "must be true or false")
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            if not INT64_MIN <= value <= INT64_MAX:  # config.toml could not hold it (TOML's integers)
                raise ConfigError(key, value, f"must be a 64-bit integer (at most {INT64_MAX})")
            return value
        raise ConfigError(key, value, "must be an integer")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(key, value, "must be a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(key, value, "must be a string")
    raise ConfigError(key, value, f"must be of type {_type_name(tp)}")


def _check_finite(key: str, value: Any) -> None:
    """Refuse ``inf``/``nan`` in a float or in the floats of a list (``key[i]``)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, value, "must be a finite number (not inf or nan)")
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_finite(f"{key}[{i}]", item)


def _check_range(key: str, value: Any, meta: Mapping[str, Any]) -> None:
    if meta.get("finite", True):
        _check_finite(key, value)
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(key, value, did_you_mean(value, choices) + "allowed: " + ", ".join(map(str, choices)))
    if not isinstance(value, int | float) or isinstance(value, bool):
        return
    bounds = [
        ("ge", lambda b: value >= b, ">="),
        ("gt", lambda b: value > b, ">"),
        ("le", lambda b: value <= b, "<="),
        ("lt", lambda b: value < b, "<"),
    ]
    for name, ok, symbol in bounds:
        bound = meta.get(name)
        if bound is not None and not ok(bound):
            raise ConfigError(key, value, f"must be {symbol} {bound}")


def build(cls: type[T], values: Mapping[str, Any], prefix: str = "") -> T:
    """Instantiate settings class ``cls`` from ``values``, validating every key.

    Nested settings classes are built recursively from nested mappings.
    ``prefix`` is the dotted path of ``cls`` inside the whole config, used in
    error messages (``train.lr``).
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    for key in values:
        if key not in fields:
            allowed = ", ".join(sorted(fields)) or "(none: this method has no settings)"
            hint = did_you_mean(key, list(fields), prefix)
            raise ConfigError(prefix + key, values[key], f"unknown key; {hint}allowed: {allowed}")
    kwargs = {}
    for name, fld in fields.items():
        if name not in values:
            continue
        key, tp = prefix + name, hints[name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(values[name], Mapping):
                raise ConfigError(key, values[name], "must be a table")
            kwargs[name] = build(tp, values[name], key + ".")
            continue
        value = _coerce(key, values[name], tp)
        _check_range(key, value, fld.metadata)
        kwargs[name] = value
    instance = cls(**kwargs)
    for name, fld in fields.items():  # defaults obey the same rules
        if name not in values and not dataclasses.is_dataclass(hints[name]):
            _check_range(prefix + name, getattr(instance, name), fld.metadata)
    check = getattr(instance, "check", None)
    if callable(check):
        check(prefix)
    return instance


def to_dict(instance: Any) -> dict[str, Any]:
    """Settings instance -> plain nested dict (lists for tuples; None dropped, as TOML has no null)."""

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                    if getattr(value, f.name) is not None}
        if isinstance(value, tuple | list):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items() if v is not None}
        return value

    return plain(instance)


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def _condition_text(key: str, condition: tuple[Any, ...] | Condition, prefix: str = "") -> str:
    """``algorithm.pseudo_source = 'proxy'``, ``... is 'both' or 'features'``, ``... > 0``."""
    if isinstance(condition, Condition):
        return f"{prefix}{key} {condition.text}"
    values = " or ".join(_toml_value(v) for v in condition)
    return f"{prefix}{key} {'=' if len(condition) == 1 else 'is'} {values}"


def _holds(condition: tuple[Any, ...] | Condition, value: Any) -> bool:
    return condition.holds(value) if isinstance(condition, Condition) else value in condition


def when_text(f: dataclasses.Field, prefix: str = "") -> str:
    """The condition under which field ``f`` is read, in words (``""``: always)."""
    when = f.metadata.get("when") or {}
    return " and ".join(_condition_text(key, cond, prefix) for key, cond in when.items())


def inactive_settings(instance: Any, prefix: str = "") -> list[str]:
    """A note for each setting of settings instance ``instance`` moved from its default while the condition
    declared with it (:func:`setting`'s ``when``) is not met: such a setting changes nothing in the run
    (``algorithm.proxy_dataset = 'cifar100' has no effect: ...``). ``prefix`` is the settings' place in the
    config (``algorithm.``)."""
    return [f"{prefix}{f.name} = {_toml_value(getattr(instance, f.name))} has no effect: it is read only when "
            f"{when_text(f, prefix)} (here {', '.join(unmet)})" for f, unmet in _inactive(instance, prefix)]


def inactive_keys(instance: Any, prefix: str = "") -> list[str]:
    """The keys (after ``prefix``) of the settings :func:`inactive_settings` names."""
    return [prefix + f.name for f, _ in _inactive(instance, prefix)]


def _inactive(instance: Any, prefix: str) -> list[tuple[dataclasses.Field, list[str]]]:
    """Each field of ``instance`` moved from its default whose ``when`` is unmet, with the unmet conditions'
    settings as ``key = value``."""
    found = []
    for f in dataclasses.fields(instance):
        when = f.metadata.get("when") or {}
        if not when or getattr(instance, f.name) == _default(f):
            continue
        unmet = [f"{prefix}{key} = {_toml_value(getattr(instance, key))}" for key, cond in when.items()
                 if not _holds(cond, getattr(instance, key))]
        if unmet:
            found.append((f, unmet))
    return found


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(name, default, doc) for each field of a settings class, for `hetfl list` (the doc followed by the
    condition under which the setting is read, if it has one; its keys after ``prefix``)."""
    rows = []
    for f in dataclasses.fields(cls):
        doc, when = f.metadata.get("doc", ""), when_text(f, prefix)
        rows.append((f.name, shown_value(_default(f)), f"{doc} (read only when {when})" if when else doc))
    return rows
