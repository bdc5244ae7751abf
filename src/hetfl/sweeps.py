"""Sweeps: methods x seeds x a grid over any configuration keys, one table row per cell, and the run
counter with its time estimate that ``hetfl compare``, sweeps and ``hetfl reproduce`` print.

A grid maps dotted configuration keys (``--set`` names) to lists of values; its cells are the cartesian
product (the first key varies slowest). Methods and seeds stay their own axes, so a grid may not name
``seed`` or ``algorithm.name``. Three ways in, one machinery:

- ``hetfl compare --methods fedavg,fedprox --seeds 0,1 --grid train.lr=0.01,0.1 --grid data.alpha=0.1,0.5``:
  each ``--grid KEY=V1,V2`` value is parsed as ``--set`` parses one (TOML, else a bare string;
  commas inside quotes, ``[...]`` and ``{...}`` do not split);
- ``hetfl compare --methods fedavg --sweep sweep.toml``: a TOML file whose ``[grid]`` table maps keys to
  lists (``"train.lr" = [0.01, 0.1]``; unquoted dotted keys work too);
- ``hetfl.sweep(grid={"train.lr": [0.01, 0.1]}, methods=[...], seeds=[...], out=...)`` (values as Python
  values).

Run folders: ``OUT/<method>/<cell>/seed<k>`` where ``<cell>`` is ``key=value`` pairs in key order joined
by ``,`` (``train.lr=0.01,data.alpha=0.1`` becomes ``data.alpha=0.1,train.lr=0.01``), so a folder's
name depends on its own values only: reordering the ``--grid`` options or adding a value to a grid
keeps every existing folder, and re-running runs only the new cells. A value whose text is not safe in
a file name (quotes, slashes, spaces, brackets) or a name over 120 characters is shortened and given
a hash of the exact values (``-h1a2b3c4d``); ``cell.json`` beside the seed folders holds the values
either way. An empty grid is ``hetfl compare`` as it always was: ``OUT/<method>-seed<k>``.

Every cell x method x seed is configured and checked before any run starts (ConfigError naming the key,
the value and what is allowed; a folder holding another configuration is a RunDirError naming the keys).
The plan is counted first (methods x cells x seeds, without listing them) and said; above ``max_runs``
(default :data:`MAX_RUNS`) it is refused before any planning unless asked for (``hetfl compare --yes``,
``max_runs=None`` in Python). Planning is lazy: the cells are generated one by one, each run is configured
once to be checked (its configuration is not kept) and again just before it runs, and a cell's folder and
``cell.json`` are made when its first run starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import time
import tomllib
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.text import Text

from hetfl import config as config_mod
from hetfl import runs, runtimes, tables
from hetfl.algorithms import algorithm_class, hyperparameters, parse_name, settings_by_prefix
from hetfl.console import check_output_dir
from hetfl.engine import identity
from hetfl.engine.experiment import keeps_trained_model
from hetfl.files import atomic_write_text
from hetfl.jobs import Job, check_jobs, check_shippable, format_duration, run_jobs, trained_folder
from hetfl.params import ConfigError, inactive_settings
from hetfl.runs import CompareResult, RunResult

if TYPE_CHECKING:
    from rich.console import Console

    from hetfl.config import RunConfig

__all__ = ["Cell", "RunCounter", "cells", "check_grid", "grid_from_cli", "parse_grid_option", "read_sweep_file",
           "run_cost", "toml_literal"]

#: axes of their own, never grid keys: what to use instead
OWN_AXES = {"seed": "seeds are their own axis: use --seeds (seeds= in Python)",
            "algorithm.name": "methods are their own axis: use --methods (methods= in Python)"}
#: rounds of the first run measured before the counter estimates the time left from them
EARLY_ROUNDS = 3
#: longest cell folder name before it is shortened and hashed
MAX_NAME = 120
#: runs a plan may have without being asked for explicitly (``hetfl compare --yes``, ``max_runs=None``)
MAX_RUNS = 1000
#: runs configured and checked together (their dataset loaded once): bounds the memory planning holds
CHECK_CHUNK = 256
_SAFE = re.compile(r"[^A-Za-z0-9._+\-]")


# ----------------------------------------------------------------- values
def toml_literal(value: Any) -> str:
    """``value`` as the TOML text ``--set`` parses back to it (``0.01``, ``"sgd"``, ``[1, 2]``,
    ``{alpha = 1.0}``); a value TOML cannot hold is a ConfigError."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_literal(v)}" for k, v in value.items()) + "}"
    raise ConfigError("grid", value, "values must be numbers, booleans, strings, lists or tables")


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def split_values(text: str) -> list[str]:
    """``V1,V2,...`` split at the commas outside quotes, ``[...]`` and ``{...}``."""
    parts, depth, quote, start, i = [], 0, "", 0, 0
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\" and quote == '"':
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    parts.append(text[start:])
    return [p.strip() for p in parts]


def parse_grid_option(text: str) -> tuple[str, list[Any]]:
    """One ``--grid KEY=V1,V2`` option: the key and its values, each parsed as ``--set`` parses one."""
    if "=" not in text:
        raise ConfigError("--grid", text, "must look like KEY=VALUE1,VALUE2, e.g. train.lr=0.01,0.1")
    key, _, values = text.partition("=")
    items = split_values(values)
    if any(not item for item in items):
        raise ConfigError(key.strip() or "--grid", values, "needs comma-separated values, none empty, e.g. 0.01,0.1")
    return key.strip(), [config_mod.parse_value(item) for item in items]


def _flatten_grid(table: Mapping[str, Any], prefix: str, origin: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten_grid(value, name + ".", origin))
        elif isinstance(value, list):
            out[name] = value
        else:
            raise ConfigError(name, value, f"in {origin}: a grid key takes a list of values, e.g. [0.01, 0.1]")
    return out


def read_sweep_file(path: str | os.PathLike[str]) -> dict[str, list[Any]]:
    """The grid of a sweep file: a TOML file with one ``[grid]`` table of keys -> lists of values."""
    origin = f"--sweep {path}"
    try:
        tree = tomllib.loads(Path(path).read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError("--sweep", str(path), "no such file") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise ConfigError("--sweep", str(path), f"not a readable UTF-8 TOML file ({err})") from None
    extra = sorted(set(tree) - {"grid"})
    if extra or not isinstance(tree.get("grid"), dict):
        raise ConfigError("--sweep", str(path), f"must hold one [grid] table of KEY = [values] (found: "
                                                f"{', '.join(extra) or 'no [grid]'})")
    return _flatten_grid(tree["grid"], "", origin)


# ----------------------------------------------------------------- keys
def _dict_setting(cls: type, name: str) -> bool:
    hint = typing.get_type_hints(cls).get(name)
    return hint is dict or typing.get_origin(hint) is dict


def check_key(key: Any, values: Any) -> None:
    """A grid key must be a configuration key that is a sweep axis: a ConfigError naming it otherwise."""
    if not isinstance(key, str) or not key or not all(key.split(".")):
        raise ConfigError("grid", key, "keys are dotted configuration keys, e.g. train.lr")
    if key in OWN_AXES:
        raise ConfigError(key, values, OWN_AXES[key])
    if key in identity.PRESENTATION_KEYS:
        raise ConfigError(key, values, "does not change a run's numbers, so it is no sweep axis")
    section, *rest = key.split(".")
    if section == "algorithm" and rest:
        return  # a method's setting: validated by each method when the cells are configured
    if section not in config_mod.SECTIONS or not rest:
        raise ConfigError(key, values, "not a configuration key (see hetfl list config); sections: algorithm.*, "
                                       + ", ".join(f"{s}.*" for s in config_mod.SECTIONS))
    cls = config_mod.SECTIONS[section]
    names = [f.name for f in fields(cls)]
    if rest[0] not in names:
        raise ConfigError(key, values, f"not a configuration key; {section}. has: {', '.join(names)}")
    if len(rest) > 1 and not _dict_setting(cls, rest[0]):
        raise ConfigError(key, values, f"not a configuration key: {section}.{rest[0]} is a value, not a table")


def _overlaps(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def check_grid(grid: Mapping[str, Any] | None, overrides: Sequence[str] = ()) -> dict[str, list[Any]]:
    """A validated copy of ``grid``: configuration keys (:func:`check_key`), each with a non-empty list of
    distinct values; no key within another (``data.options`` and ``data.options.alpha``), none also set by
    ``overrides`` (``--set``). ConfigErrors name the key and the value."""
    if grid is None:
        return {}
    if not isinstance(grid, Mapping):
        raise ConfigError("grid", grid, "must map configuration keys to lists of values, "
                                        "e.g. {'train.lr': [0.01, 0.1]}")
    checked: dict[str, list[Any]] = {}
    for key, values in grid.items():
        check_key(key, values)
        if isinstance(values, str | bytes) or not isinstance(values, Sequence):
            raise ConfigError(key, values, "takes a list of values, e.g. [0.01, 0.1]")
        if not values:
            raise ConfigError(key, list(values), "needs at least one value")
        seen = set()
        for value in values:
            toml_literal(value)
            if _canonical(value) in seen:
                raise ConfigError(key, list(values), f"the value {value!r} is given twice")
            seen.add(_canonical(value))
        clash = next((k for k in checked if _overlaps(k, key)), None)
        if clash is not None:
            raise ConfigError(key, list(values), f"given twice in the grid (with {clash})")
        set_keys = [a.partition("=")[0].strip() for a in overrides]
        clash = next((k for k in set_keys if _overlaps(k, key)), None)
        if clash is not None:
            raise ConfigError(key, list(values), f"is also set with --set {clash}=...: a key is either fixed "
                                                 "or swept; drop one")
        checked[key] = list(values)
    return checked


def grid_from_cli(options: Sequence[str], sweep_file: str | None, overrides: Sequence[str]) -> dict[str, list[Any]]:
    """The grid of ``--grid`` options and a ``--sweep`` file together, validated by :func:`check_grid`
    (a key in both, or twice among the options, is an error)."""
    pairs: list[tuple[str, list[Any]]] = [parse_grid_option(o) for o in options]
    if sweep_file:
        pairs += list(read_sweep_file(sweep_file).items())
    grid: dict[str, list[Any]] = {}
    for key, values in pairs:
        if key in grid:
            raise ConfigError(key, values, "given twice (--grid options and the --sweep file together)")
        grid[key] = values
    return check_grid(grid, overrides)


# ----------------------------------------------------------------- cells
@dataclass(frozen=True)
class Cell:
    """One combination of grid values (keys in the grid's order)."""

    values: tuple[tuple[str, Any], ...] = ()

    def assignments(self) -> list[str]:
        """The cell as ``--set`` assignments."""
        return [f"{key}={toml_literal(value)}" for key, value in self.values]

    @property
    def label(self) -> str:
        """``train.lr=0.1, data.alpha=0.5`` (for the counter)."""
        return ", ".join(f"{key}={_shown(value)}" for key, value in self.values)

    @property
    def dirname(self) -> str:
        """The folder name: ``key=value`` pairs in key order, a hash of the values added when a value had
        to be shortened to be safe in a file name (a name depends on the cell's values only)."""
        ordered = sorted(self.values)
        parts = [f"{_SAFE.sub('_', k)}={_SAFE.sub('_', _shown(v))}" for k, v in ordered]
        name = ",".join(parts)
        exact = ",".join(f"{k}={_shown(v)}" for k, v in ordered)
        if name != exact or len(name) > MAX_NAME:
            digest = hashlib.sha256(_canonical(dict(ordered)).encode()).hexdigest()[:8]
            name = name[:MAX_NAME - 10] + f"-h{digest}"
        return name


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else toml_literal(value)


def cells(grid: Mapping[str, list[Any]]) -> list[Cell]:
    """The cartesian product of ``grid``'s values (the first key varies slowest); ``[Cell()]`` for no grid."""
    return list(iter_cells(grid))


def iter_cells(grid: Mapping[str, list[Any]]) -> Iterator[Cell]:
    """:func:`cells`, one at a time (a grid of a million cells is never listed)."""
    keys = list(grid)
    for combo in itertools.product(*(grid[k] for k in keys)):
        yield Cell(tuple(zip(keys, combo, strict=True)))


def count_cells(grid: Mapping[str, list[Any]]) -> int:
    """How many cells ``grid`` has (the product of its value counts; 1 for no grid), without making them."""
    return math.prod(len(values) for values in grid.values())


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def describe_plan(methods: Sequence[str], seeds: Sequence[int], grid: Mapping[str, list[Any]]) -> str:
    """``1600 runs (1 method x 1600 grid cells x 1 seed)``."""
    total = len(methods) * count_cells(grid) * len(seeds)
    parts = [_plural(len(methods), "method"), *([_plural(count_cells(grid), "grid cell")] if grid else []),
             _plural(len(seeds), "seed")]
    return f"{_plural(total, 'run')} ({' x '.join(parts)})"


def check_plan_size(total: int, max_runs: int | None, option: str, what: str) -> None:
    """A plan of more than ``max_runs`` runs is a ConfigError (``--yes`` on the command line, ``max_runs`` in
    Python), raised before any run is configured. None: no limit."""
    if max_runs is None or total <= max_runs:
        return
    key, how = ("--yes", "pass --yes to run them all") if option.startswith("--") else \
        ("max_runs", "pass max_runs=None (or a larger number) to run them all")
    raise ConfigError(key, max_runs if key == "max_runs" else False,
                      f"the plan has {what}, more than {max_runs} (max_runs); {how}, or make the grid smaller")


# ----------------------------------------------------------------- counter and time left
def run_cost(cfg: RunConfig, done_rounds: int = 0) -> float:
    """Work of a run still to do, in client-rounds of local work: rounds left x clients per round x
    local epochs (or local steps). A proxy: it compares the runs of one plan, on one machine."""
    t = cfg.train
    clients = t.clients_per_round or cfg.data.num_clients
    return max(t.rounds - done_rounds, 0) * clients * (t.local_steps or t.local_epochs)


def rounds_done(run_dir: Path) -> int:
    """Rounds an interrupted run has written (lines of ``metrics.jsonl``)."""
    path = run_dir / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.is_file() else 0


@dataclass
class PlannedRun:
    """One run of a plan, for the counter: what it is, its work still to do, and how it stands."""

    label: str
    cost: float
    state: str  # new | unfinished | finished
    recorded_s: float | None = None  # a finished run's recorded wall time (summary.json)
    rounds: int = 0  # rounds still to compute (0: unknown, no estimate from its first rounds)


@dataclass
class RunCounter:
    """``run 7 of 24 (fedprox, seed 1, train.lr=0.1): about 12 min left`` before each run that computes.

    The time left is the measured seconds per unit of :func:`run_cost` of the runs computed so far in
    this invocation, times the cost of the runs still to do (this one included). Runs found finished
    count as done and add nothing to the rate. Before any run here has finished, the estimate is rough
    and says so: from the recorded times of runs found finished in the plan, else ``prior_s`` (a
    preset's estimate of the whole plan, shared out by cost), else none; and once the first run has
    measured :data:`EARLY_ROUNDS` rounds (:meth:`round_done`), from those rounds, said once, so a long
    plan's cost is known minutes into it rather than after its first run."""

    runs: list[PlannedRun]
    say: Callable[[str], None] | None = None
    clock: Callable[[], float] = time.monotonic
    prior_s: float | None = None
    prior_label: str = "the preset's estimate"
    _spent: float = 0.0
    _done_cost: float = 0.0
    _started: float | None = field(default=None, repr=False)
    _round_ends: list[float] = field(default_factory=list, repr=False)  # this run's round end times
    _early_said: bool = field(default=False, repr=False)

    def start(self, index: int) -> str:
        """Say (and return) the counter line of run ``index`` (0-based), and start its clock."""
        left = sum(r.cost for r in self.runs[index:] if r.state != "finished")
        message = f"run {index + 1} of {len(self.runs)} ({self.runs[index].label}): {self.time_left(left)}"
        if self.say is not None:
            self.say(message)
        self._started = self.clock()
        self._round_ends = []
        return message

    def round_done(self, index: int) -> str | None:
        """A round of run ``index`` has ended. While no run of this invocation has finished, the end of its
        :data:`EARLY_ROUNDS`-th round says (once, and returns) the time left from the rounds after the first
        (the first carries the set-up: data, model, warm-up): their seconds per round times the rounds left
        in this run, plus the later runs' cost at this run's seconds per unit of cost."""
        run = self.runs[index]
        if (self._started is None or self._done_cost > 0 or self._early_said or run.rounds < EARLY_ROUNDS
                or run.cost <= 0):
            return None
        self._round_ends.append(self.clock())
        if len(self._round_ends) < EARLY_ROUNDS:
            return None
        per_round = (self._round_ends[-1] - self._round_ends[0]) / (len(self._round_ends) - 1)
        later = sum(r.cost for r in self.runs[index + 1:] if r.state != "finished")
        left = per_round * (run.rounds - len(self._round_ends)) + later * per_round * run.rounds / run.cost
        self._early_said = True
        message = (f"run {index + 1} of {len(self.runs)} ({run.label}): about {format_duration(left)} left "
                   f"(rough: from rounds 2-{len(self._round_ends)} of this run)")
        if self.say is not None:
            self.say(message)
        return message

    def done(self, index: int) -> None:
        """Run ``index`` has finished: its seconds and cost go into the rate."""
        if self._started is not None:
            self._spent += self.clock() - self._started
            self._done_cost += self.runs[index].cost
            self._started = None

    def time_left(self, cost_left: float) -> str:
        if self._done_cost > 0:
            return f"about {format_duration(cost_left * self._spent / self._done_cost)} left"
        recorded = [r for r in self.runs if r.state == "finished" and r.recorded_s is not None and r.cost > 0]
        if recorded:
            rate = sum(r.recorded_s or 0.0 for r in recorded) / sum(r.cost for r in recorded)
            return (f"about {format_duration(cost_left * rate)} left (rough: from the times of {len(recorded)} "
                    "run(s) found finished)")
        total = sum(r.cost for r in self.runs)
        if self.prior_s and total > 0:
            return f"about {format_duration(self.prior_s * cost_left / total)} left (rough: {self.prior_label})"
        return "time left known once a run has finished"


def recorded_seconds(run_dir: Path) -> float | None:
    """A finished run's ``wall_time_s`` from its ``summary.json`` (None when absent)."""
    try:
        return float(json.loads((run_dir / identity.SUMMARY_NAME).read_text())["wall_time_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def planned_run(label: str, cfg: RunConfig, run_dir: Path, state: str) -> PlannedRun:
    """A run of a plan with its cost still to do (an interrupted run's written rounds left out)."""
    done = cfg.train.rounds if state == "finished" else rounds_done(run_dir) if state == "unfinished" else 0
    recorded = recorded_seconds(run_dir) if state == "finished" else None
    return PlannedRun(label, run_cost(cfg) if state == "finished" else run_cost(cfg, done), state, recorded,
                      max(cfg.train.rounds - done, 0))


# ----------------------------------------------------------------- plan and run
@dataclass(frozen=True)
class PlanItem:
    method: str
    cell: Cell
    seed: int
    cfg: RunConfig
    run_dir: Path

    @property
    def label(self) -> str:
        return ", ".join(p for p in (self.method, f"seed {self.seed}", self.cell.label) if p)


def run_dir_for(out: Path, method: str, cell: Cell, seed: int) -> Path:
    """``out/<method>-seed<k>`` without a grid (``hetfl compare``'s layout), else ``out/<method>/<cell>/seed<k>``."""
    name = method.replace("+", "-")
    return out / f"{name}-seed{seed}" if not cell.values else out / name / cell.dirname / f"seed{seed}"


def as_configured(cell: Cell, cfg: RunConfig) -> Cell:
    """``cell`` with each value as the configuration holds it (``train.lr = 1`` is the float ``1.0``), so a
    folder's name does not depend on how a value was typed (``--grid train.lr=1`` and ``{"train.lr": [1.0]}``)."""
    flat = identity.flatten(config_mod.to_tree(cfg))
    return Cell(tuple((key, flat.get(key, value)) for key, value in cell.values))


def check_distinct(item: PlanItem, seen: dict[Path, Cell]) -> None:
    """Two cells that give one configuration (``--grid train.lr=1,1.0``) would share a folder: a ConfigError.
    ``seen``: the folders of the runs checked before, and their cells (``item``'s is added)."""
    if item.run_dir in seen:
        key = next((k for k, _ in item.cell.values), "grid")
        raise ConfigError(key, item.cell.label, f"two grid cells give the same configuration ({item.run_dir}); "
                                                "give each value once")
    seen[item.run_dir] = item.cell


def _write_cell_file(item: PlanItem) -> None:
    """``cell.json`` beside a cell's seed folders (made with the cell's folder, when its first run starts)."""
    if not item.cell.values:
        return
    path = item.run_dir.parent / "cell.json"
    text = json.dumps({"method": item.method, "grid": dict(item.cell.values)}, indent=2) + "\n"
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)


def method_settings(method: str) -> set[str]:
    """The ``algorithm.*`` keys ``method`` takes: its trainer's settings and its post-hoc steps' tables."""
    trainer, steps = parse_name(method)
    return {f.name for f in fields(algorithm_class(trainer).Hyper)} | set(steps)


def settings_elsewhere(methods: list[str], cfg: RunConfig, grid: Mapping[str, list[Any]]) -> list[str]:
    """The ``algorithm.*`` settings of ``cfg`` (set for the whole plan: ``--set``, the config file) that
    ``cfg``'s method does not take but another method of the plan does (``--set algorithm.mu=0.1`` with
    ``fedavg,fedprox``): they are meant for those. A setting no method takes stays, for its error; a grid key
    stays (its cells would be one run for a method without it)."""
    if len(methods) < 2:
        return []
    own = method_settings(cfg.algorithm.name)
    others = set().union(*(method_settings(m) for m in methods if m != cfg.algorithm.name))
    return [k for k in cfg.algorithm.params if k not in own and k in others and f"algorithm.{k}" not in grid]


def without_settings(cfg: RunConfig, keys: list[str]) -> RunConfig:
    params = {k: v for k, v in cfg.algorithm.params.items() if k not in keys}
    return dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, params=params))


def plan_items(methods: list[str], seeds: list[int], grid: Mapping[str, list[Any]],
               configure: Callable[[list[str]], RunConfig], out: Path, progress: bool | None) -> Iterator[PlanItem]:
    """Every method x cell x seed, configured (``configure`` plus the method's and the runtime's checks) one
    at a time, in the plan's order; the same items each time it is called. A method setting set for the plan
    goes to the methods that take it (:func:`settings_elsewhere`)."""
    for method in methods:
        for cell in iter_cells(grid):
            for seed in seeds:
                cfg = runs.with_progress(configure([f"algorithm.name={method}", f"seed={seed}", *cell.assignments()]),
                                         progress)
                cfg = without_settings(cfg, settings_elsewhere(methods, cfg, grid))
                hyperparameters(cfg.algorithm.name, cfg.algorithm.params)
                runtimes.check_runtime(cfg)  # e.g. runtime.executor = flower without Flower: refused before run 1
                named = as_configured(cell, cfg)
                yield PlanItem(method, named, seed, cfg, run_dir_for(out, method, named, seed))


@dataclass(frozen=True)
class CheckedRun:
    """What a plan keeps of a run once checked: its counter entry, its state (new | unfinished | finished),
    its training (:func:`training_key`) and its folder; not its configuration."""

    planned: PlannedRun
    state: str
    training: str | None
    run_dir: Path


def check_plan(items: Iterator[PlanItem], option: str) -> list[CheckedRun]:
    """Check every item (configuration, distinct folders, what each folder holds) before any run starts,
    ``CHECK_CHUNK`` at a time."""
    seen: dict[Path, Cell] = {}
    checked: list[CheckedRun] = []
    while chunk := list(itertools.islice(items, CHECK_CHUNK)):
        for item in chunk:
            check_distinct(item, seen)
        states = runs.plan_states([p.cfg for p in chunk], [p.run_dir for p in chunk], option)
        checked += [CheckedRun(planned_run(p.label, p.cfg, p.run_dir, s), s, training_key(p.cfg), p.run_dir)
                    for p, s in zip(chunk, states, strict=True)]
    return checked


def training_key(cfg: RunConfig) -> str | None:
    """The training a run of ``cfg`` may share with other runs of a plan (:func:`hetfl.engine.identity.training_id`:
    its configuration but for its post-hoc steps' settings), or None when it keeps no model before those steps
    (:func:`hetfl.engine.experiment.keeps_trained_model`)."""
    return identity.training_id(config_mod.to_tree(cfg)) if keeps_trained_model(cfg) else None


def training_sources(keys: Sequence[str | None]) -> dict[int, int]:
    """Runs of a plan (by index) that start from an earlier run's training -> that run: of the runs with one
    :func:`training_key` (e.g. ``fedavg+ccvr`` with two ``algorithm.ccvr.epochs``, or CCVR's and the oracle's
    rows of a preset) the first trains and keeps its model before calibration; the others calibrate it."""
    first: dict[str, int] = {}
    sources: dict[int, int] = {}
    for i, key in enumerate(keys):
        if key is None:
            continue
        if key in first:
            sources[i] = first[key]
        else:
            first[key] = i
    return sources


def posthoc_only(planned: PlannedRun, cfg: RunConfig, source: int) -> PlannedRun:
    """A new run's counter entry when it starts from run ``source``'s training (0-based): it says so, and counts
    as its last round only."""
    return PlannedRun(f"{planned.label}; post-hoc steps only, on run {source + 1}'s training",
                      run_cost(cfg, cfg.train.rounds - 1), planned.state, rounds=1)


def settings_notes(methods: list[str], configure: Callable[[list[str]], RunConfig],
                   grid: Mapping[str, list[Any]]) -> list[str]:
    """A line per method setting that only some of the plan's methods take: which ones it goes to."""
    skipped: dict[str, list[str]] = {}
    for method in methods:
        for key in settings_elsewhere(methods, configure([f"algorithm.name={method}"]), grid):
            skipped.setdefault(key, []).append(method)
    return [f"algorithm.{key}: set for {', '.join(m for m in methods if m not in without)} only "
            f"({', '.join(without)} {'has' if len(without) == 1 else 'have'} no such setting)"
            for key, without in skipped.items()]


def inactive_notes(items: list[PlanItem]) -> list[str]:
    """A line per method setting of the plan that its runs' mode does not read (:func:`hetfl.params.
    inactive_settings`: FedBR's ``proxy_dataset`` without ``pseudo_source = "proxy"``), once per method and
    setting, said before the first run (each run says it again when it starts)."""
    notes: dict[str, None] = {}
    for item in items:
        found = [note for prefix, hyper in settings_by_prefix(item.cfg.algorithm.name, item.cfg.algorithm.params)
                 for note in inactive_settings(hyper, prefix)]
        notes.update(dict.fromkeys(f"{item.method}: {note}" for note in found))
    return list(notes)


def run_plan(methods: list[str], seeds: list[int], grid: Mapping[str, list[Any]],
             configure: Callable[[list[str]], RunConfig], out: Path, target: float | None, *,
             progress: bool | None, console: Console | None, option: str = "--out",
             clock: Callable[[], float] = time.monotonic, max_runs: int | None = MAX_RUNS,
             jobs: int = 1) -> CompareResult:
    """Every method x cell x seed into its folder (:func:`run_dir_for`), then ``comparison.md``/``.csv``
    with one row per method and cell: the machinery of :func:`hetfl.api.run_comparison`, which
    ``hetfl compare``, :func:`hetfl.compare` and :func:`hetfl.sweep` call. ``grid``: checked by :func:`check_grid`;
    ``clock``: the counter's time source (tests give a fake one). The plan is counted and said first, and
    refused above ``max_runs`` runs (None: no limit) before any run is configured (:func:`check_plan_size`).
    ``jobs`` > 1: that many runs at once, each in a worker process (:mod:`hetfl.jobs`: the same numbers, lines
    instead of progress bars)."""
    check_output_dir(out, option)
    say = None if console is None else _printer(console)
    what = describe_plan(methods, seeds, grid)
    if say is not None:
        say(f"plan: {what}")
    check_plan_size(len(methods) * count_cells(grid) * len(seeds), max_runs, option, what)
    jobs_option = "--jobs" if option == "--out" else "jobs"  # the command line's name, or the API's
    if check_jobs(jobs, jobs_option) > 1:
        check_shippable(methods, jobs, jobs_option)
    checked = check_plan(plan_items(methods, seeds, grid, configure, out, progress), option)
    if say is not None:
        for line in settings_notes(methods, configure, grid):
            say(line)
    sources = training_sources([c.training for c in checked])
    items = list(plan_items(methods, seeds, grid, configure, out, progress))  # configured once more, kept
    if say is not None:
        for line in inactive_notes(items):
            say(line)
    if jobs > 1:
        statuses = _run_parallel(items, checked, sources, jobs, say, console)
    else:
        statuses = _run_in_turn(items, checked, sources, say, console, clock)
    results, records = [], []
    for item, status in zip(items, statuses, strict=True):
        result = RunResult.load(item.run_dir, status=status)
        results.append(result)
        records.append(result.record(item.method))
    rows = tables.table_rows(records, target)
    markdown = tables.to_markdown(rows, target)
    atomic_write_text(out / "comparison.md", markdown)
    atomic_write_text(out / "comparison.csv", tables.to_csv(rows))
    return CompareResult(out, results, rows, markdown, target)


def _run_in_turn(items: list[PlanItem], checked: list[CheckedRun], sources: dict[int, int],
                 say: Callable[[str], None] | None, console: Console | None,
                 clock: Callable[[], float]) -> list[str]:
    """The plan's runs one after another in this process (progress bars, the run counter): their statuses."""
    counter = RunCounter([c.planned for c in checked], say, clock)
    statuses = []
    for i, (item, check) in enumerate(zip(items, checked, strict=True)):
        trained = trained_folder(check.state, checked[sources[i]].run_dir if i in sources else None)
        if trained is not None:
            counter.runs[i] = posthoc_only(check.planned, item.cfg, sources[i])
        if check.state != "finished":
            counter.start(i)
        _write_cell_file(item)
        statuses.append(runs.execute(item.cfg, item.run_dir, check.state, console,
                                     on_round=lambda _line, i=i: counter.round_done(i), trained=trained))
        counter.done(i)
    return statuses


def _run_parallel(items: list[PlanItem], checked: list[CheckedRun], sources: dict[int, int], workers: int,
                  say: Callable[[str], None] | None, console: Console | None) -> list[str]:
    """The plan's runs that compute, ``workers`` at once (:func:`hetfl.jobs.run_jobs`); finished ones reused."""
    todo = [i for i, check in enumerate(checked) if check.state != "finished"]
    index = {i: k for k, i in enumerate(todo)}
    plan = []
    for item in items:
        _write_cell_file(item)
    for i in todo:
        item, check = items[i], checked[i]
        source = checked[sources[i]].run_dir if i in sources else None
        cost = posthoc_only(check.planned, item.cfg, sources[i]).cost if source and check.state == "new" else \
            check.planned.cost
        plan.append(Job(item.label, config_mod.to_tree(item.cfg), item.run_dir, check.state, cost, source,
                                 index.get(sources[i]) if i in sources else None))
    for check in checked:
        if check.state == "finished" and console is not None:
            console.print(f"{check.run_dir}: finished earlier, reusing (same configuration)")
    done = run_jobs(plan, workers, say)
    return ["reused" if check.state == "finished" else done[index[i]] for i, check in enumerate(checked)]


def _printer(console: Console) -> Callable[[str], None]:
    """Print a line as text (never as rich markup: a value may hold square brackets)."""
    return lambda message: console.print(Text(message, style="bold"))
