"""Reproduction presets: one TOML file per table of the seed papers, run in one command.

A preset (``configs/<name>.toml``) holds:

``[preset]``
    ``title``, ``paper`` (where the numbers come from), ``metric`` (the paper's
    metric; see :func:`metric_value`), ``seeds``, cost estimates
    (``gpu_minutes``: rough, not measured; ``quick_cpu_minutes``, with
    ``quick_cpu_measured`` saying how it was measured, else it is shown as
    rough) and ``notes`` (every known deviation from the paper's setting).
``[base]``
    a run configuration, as for ``hetfl run``.
``[[columns]]``
    the table's columns: ``id``, ``label``, ``set`` (dotted keys -> values).
``[[rows]]``
    the table's rows: ``label``, ``algorithm``, optional ``set``,
    ``column_set`` (per-column overrides), ``metric`` (overrides the preset's)
    and ``paper`` (column id -> published number, in % as the paper prints it;
    ``reproduction.json`` holds it as a fraction, as every hetfl file does). Rows whose runs are
    identical share them: "FedAvg" and "FedAvg + CCVR" read the accuracy
    before and after calibration of one ``fedavg+ccvr`` run. Runs that differ only in their post-hoc
    steps' settings ("FedAvg + CCVR" and "FedAvg + oracle calibration") train once: the others
    calibrate the first one's model before calibration (:func:`hetfl.sweeps.training_sources`).
``[quick]``
    a small CPU variant: ``set``, ``columns`` and ``seeds`` replacing the full ones, and ``column_set``
    (column id -> dotted keys -> values, applied after ``set`` to that column only), so that a table varying
    a costly setting per column keeps the variation at quick scale (FedUV Table 3: E = 10 / 20 / 40 -> 1 / 2 / 4).

``hetfl reproduce NAME [--quick]`` runs every distinct run (resuming interrupted
ones and reusing finished ones of the same resolved configuration; a run folder
holding another configuration is an error naming the keys) and writes
``reproduction.md`` / ``.json``: our mean ± std over seeds beside the paper's
number and the difference (fractions in the JSON, percent in the Markdown
table; no difference for a quick variant, whose ``[quick]`` settings both files
record, nor where a ``--set`` changes the setting: :func:`setting_changes`), and per
column ``curves_<column id>.png`` (+ ``.csv``): each row's curves
as mean ± std bands over seeds, linked from ``reproduction.md``.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any

from hetfl import config as config_mod
from hetfl import runtimes
from hetfl.algorithms import settings_by_prefix
from hetfl.analysis.curves import default_accuracy_key, load_metrics
from hetfl.analysis.plots import plot_seed_bands
from hetfl.engine import identity
from hetfl.engine.resolve import resolve_configs
from hetfl.files import atomic_write_text
from hetfl.jobs import Job, check_jobs, check_shippable, run_jobs, trained_folder
from hetfl.params import ConfigError, did_you_mean, inactive_keys
from hetfl.sweeps import RunCounter, planned_run, posthoc_only, training_key, training_sources
from hetfl.tables import at_chance, chance_line, markdown_text, mean_std, percent, with_spread

PRESET_DIR = Path(__file__).resolve().parents[2] / "configs"


@dataclass
class Column:
    id: str
    label: str
    set: dict[str, Any] = field(default_factory=dict)


@dataclass
class Row:
    label: str
    algorithm: str
    set: dict[str, Any] = field(default_factory=dict)
    column_set: dict[str, dict[str, Any]] = field(default_factory=dict)
    metric: str | None = None
    paper: dict[str, float] = field(default_factory=dict)


@dataclass
class Preset:
    name: str
    title: str
    paper: str
    metric: str
    seeds: list[int]
    base: dict[str, Any]
    columns: list[Column]
    rows: list[Row]
    notes: str = ""
    gpu_minutes: float = 0.0
    quick_cpu_minutes: float = 0.0
    quick: dict[str, Any] = field(default_factory=dict)
    is_quick: bool = False
    #: how quick_cpu_minutes was measured ("" = not measured: the estimate is rough)
    quick_cpu_measured: str = ""

    def variant(self, quick: bool) -> Preset:
        """The preset itself, or its quick CPU variant (which keeps its ``[quick]`` table in ``quick``, so that
        its outputs say what it changed)."""
        if not quick or self.is_quick:
            return self
        q = self.quick
        keep = set(q.get("columns", [c.id for c in self.columns]))
        per_column = q.get("column_set", {})
        columns = [Column(c.id, c.label, {**c.set, **q.get("set", {}), **per_column.get(c.id, {})})
                   for c in self.columns if c.id in keep]
        return Preset(self.name, self.title + " (quick CPU variant)", self.paper, self.metric,
                      list(q.get("seeds", self.seeds[:1])), self.base, columns, self.rows, self.notes,
                      self.gpu_minutes, self.quick_cpu_minutes, q, is_quick=True,
                      quick_cpu_measured=self.quick_cpu_measured)


def preset_path(name: str, directory: Path = PRESET_DIR) -> Path:
    path = Path(name)
    if path.suffix == ".toml" and path.is_file():
        return path
    path = directory / f"{name}.toml"
    if not path.is_file():
        allowed = ", ".join(available(directory)) or "none"
        raise ConfigError("reproduce NAME", name,
                          f"no such preset; {did_you_mean(name, available(directory))}available: {allowed}")
    return path


def preset_name(path: Path, directory: Path = PRESET_DIR) -> str:
    """How ``hetfl reproduce`` is told to run the preset file ``path``: its name for a preset of ``directory``
    (``ccvr-table2``), else its path."""
    return path.stem if path.resolve() == (directory / f"{path.stem}.toml").resolve() else str(path)


def available(directory: Path = PRESET_DIR) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.toml"))


def load_preset(name: str, directory: Path = PRESET_DIR) -> Preset:
    path = preset_path(name, directory)
    tree = tomllib.loads(path.read_text())
    meta = tree.get("preset", {})
    try:
        preset = Preset(
            name=path.stem,
            title=meta["title"],
            paper=meta["paper"],
            metric=meta["metric"],
            seeds=list(meta.get("seeds", [0, 1, 2])),
            base=tree.get("base", {}),
            columns=[Column(**c) for c in tree.get("columns", [{"id": "all", "label": ""}])],
            rows=[Row(**r) for r in tree["rows"]],
            notes=meta.get("notes", ""),
            gpu_minutes=float(meta.get("gpu_minutes", 0)),
            quick_cpu_minutes=float(meta.get("quick_cpu_minutes", 0)),
            quick_cpu_measured=str(meta.get("quick_cpu_measured", "")),
            quick=tree.get("quick", {}),
        )
    except (KeyError, TypeError) as err:
        raise ConfigError(f"preset {path.name}", str(err), "a preset needs [preset] title/paper/metric and "
                          "[[rows]] with label and algorithm (see hetfl.reproduce)") from None
    check_column_ids(preset, path.name)
    return preset


def check_column_ids(preset: Preset, file: str) -> None:
    """A ConfigError for a column id in a row's ``column_set``, ``[quick] columns`` or ``[quick] column_set``
    that is not a column of the preset: a misspelt id would silently never apply its settings, or drop a
    column from the quick run."""
    ids = [c.id for c in preset.columns]
    named = [(f"[[rows]] {row.label!r} column_set", row.column_set) for row in preset.rows]
    named += [(f"[quick] {key}", preset.quick.get(key, ())) for key in ("columns", "column_set")]
    for where, keys in named:
        unknown = [cid for cid in keys if cid not in ids]
        if unknown:
            raise ConfigError(f"{file}: {where}", unknown[0], f"not a column of the preset; its columns are "
                              f"{', '.join(ids)}")


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


@dataclass(frozen=True)
class RunSpec:
    """One distinct run of a preset: a column, an algorithm with its overrides, a seed."""

    column: str
    algorithm: str
    overrides: tuple[tuple[str, str], ...]
    seed: int

    @property
    def dirname(self) -> str:
        parts = [self.algorithm.replace("+", "-")] + [f"{k.split('.')[-1]}{v}" for k, v in self.overrides]
        name = "_".join(parts).replace("/", "-").replace(" ", "").replace('"', "")
        return name + f"-seed{self.seed}"


def run_specs(preset: Preset) -> dict[tuple[str, str, int], RunSpec]:
    """(row label, column id, seed) -> the run it reads; identical runs are one spec."""
    specs: dict[tuple[str, str, int], RunSpec] = {}
    for row in preset.rows:
        for column in preset.columns:
            over = {**row.set, **row.column_set.get(column.id, {})}
            frozen = tuple(sorted((k, json.dumps(v)) for k, v in over.items()))
            for seed in preset.seeds:
                specs[(row.label, column.id, seed)] = RunSpec(column.id, row.algorithm, frozen, seed)
    return specs


def build_config(preset: Preset, spec: RunSpec, user_set: list[str]) -> config_mod.RunConfig:
    """The configuration of run ``spec``: the preset's base, its column's settings, its row's, its seed, then
    the user's ``--set``. A setting the base or the column gives every row that this row's method does not
    read (:func:`unread_settings`: CCVR's ``num_virtual`` in an oracle row, which calibrates on real
    features) is left out, so that the run's config.toml holds only what it reads and the run does not warn
    of a setting nobody asked it for; a row's own setting and the user's stay (an inert one warns)."""
    tree = copy.deepcopy(preset.base)
    column = next(c for c in preset.columns if c.id == spec.column)
    for key, value in column.set.items():
        set_dotted(tree, key, value)
    set_dotted(tree, "algorithm.name", spec.algorithm)
    for key, value in spec.overrides:
        set_dotted(tree, key, json.loads(value))
    tree["seed"] = spec.seed
    for assignment in user_set:
        config_mod.apply_override(tree, assignment)
    cfg = config_mod.from_dict(copy.deepcopy(tree))  # with the user's settings: one may make a shared setting read
    mine = {key for key, _ in spec.overrides} | {a.split("=", 1)[0].strip() for a in user_set}
    shared = (set(identity.flatten(preset.base)) | set(column.set)) - mine
    unread = [key for key in unread_settings(cfg) if key in shared]
    for key in unread:
        unset_dotted(tree, key)
    return config_mod.from_dict(tree) if unread else cfg


def unread_settings(cfg: config_mod.RunConfig) -> list[str]:
    """The keys of ``cfg``'s method, post-hoc step and runtime settings moved from their defaults that its
    mode does not read (:func:`hetfl.params.inactive_settings`; each run warns of them)."""
    settings = [*settings_by_prefix(cfg.algorithm.name, cfg.algorithm.params), ("runtime.", cfg.runtime)]
    return [key for prefix, hyper in settings for key in inactive_keys(hyper, prefix)]


def unset_dotted(tree: dict[str, Any], key: str) -> None:
    """Remove ``key`` (dotted) from ``tree``: its default then applies."""
    *parents, last = key.split(".")
    node = tree
    for part in parents:
        node = node[part]
    del node[last]


def metric_value(run_dir: Path, metric: str) -> float:
    """A run's value of ``metric``: a key of ``summary.json``, or ``best5:<key>``, the mean of
    the five highest per-round values of a metrics key (FedBR's Table 1 convention)."""
    if metric.startswith("best5:"):
        key = metric.split(":", 1)[1]
        values = [json.loads(line).get(key) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        values = sorted((v for v in values if v is not None), reverse=True)[:5]
        return mean(values) if values else math.nan
    summary = json.loads((run_dir / "summary.json").read_text())
    if metric not in summary:
        raise ConfigError("preset metric", metric, f"not in {run_dir / 'summary.json'}")
    return float(summary[metric])


def is_global_accuracy(metric: str) -> bool:
    """Whether ``metric`` (a summary key, or ``best5:`` a metrics key) is an accuracy on the global test set:
    the final or best one, or the one before a post-hoc step (``final_global_acc_before_ccvr``)."""
    name = metric.removeprefix("best5:").removeprefix("final_").removeprefix("best_")
    return name == "global_acc" or name.startswith("global_acc_before_")


def chance_value(run_dir: Path, metric: str) -> float | None:
    """The accuracy at chance of a run's global test set (``summary.json``'s ``chance_global_acc``) where
    ``metric`` is a global accuracy (also the model's before a post-hoc step: ``final_global_acc_before_ccvr``);
    None for other metrics (a personalised accuracy's chance differs per client) and for runs written before
    hetfl recorded it."""
    if not is_global_accuracy(metric):
        return None
    value = json.loads((run_dir / "summary.json").read_text()).get("chance_global_acc")
    return None if value is None else float(value)


def run_diverged(run_dir: Path) -> bool:
    """Whether a run's train loss became inf or NaN (``summary.json``'s ``diverged_round`` set), as
    :func:`hetfl.tables.diverged_count` counts a compare row's runs."""
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary.get("diverged_round") is not None


def reproduce(
    preset: Preset,
    out: Path,
    run: Callable[[config_mod.RunConfig, Path, bool], None],
    user_set: list[str] | None = None,
    resolve: Callable[[list[config_mod.RunConfig]], list[config_mod.RunConfig]] | None = None,
    say: Callable[[str], None] | None = None,
    clock: Callable[[], float] | None = None,
    jobs: int = 1,
) -> dict[str, Any]:
    """Run (or reuse) every distinct run of ``preset`` under ``out`` with ``run(cfg, run_dir, resume)``
    (``run(cfg, run_dir, False, trained=FOLDER)`` for a new run that calibrates the model an earlier run of
    the same training kept: :func:`hetfl.sweeps.training_sources`), then write ``reproduction.json`` / ``.md``.

    Configs are all validated, and every run folder checked against the resolved config of the
    run planned there (``resolve``, default :func:`hetfl.engine.resolve.resolve_configs`), before
    any run: a folder holding the same run is reused (finished) or resumed (``resume=True``); one
    holding another configuration is a RunDirError naming the differing keys. Before each run that
    computes, ``say`` gets ``run k of n (column, method, seed s): about M min left``
    (:class:`hetfl.sweeps.RunCounter`; before any run has finished, the preset's estimate, labelled rough).
    ``jobs`` > 1: that many runs at once, each in a worker process (:mod:`hetfl.jobs`; ``run`` is not called
    then: a worker runs each as :func:`hetfl.runs.execute` does, and ``say`` gets a line as each starts and ends)."""
    specs = run_specs(preset)
    configs = {spec: build_config(preset, spec, user_set or []) for spec in set(specs.values())}
    if check_jobs(jobs) > 1:
        check_shippable((cfg.algorithm.name for cfg in configs.values()), jobs)
    for cfg in configs.values():  # the executor's own checks (Flower installed, ...) before the first run
        runtimes.check_runtime(cfg)
    order = sorted(configs, key=lambda s: (s.column, s.seed, s.algorithm, s.overrides))
    resolved = (resolve or resolve_configs)([configs[spec] for spec in order])
    folder = {spec: out / spec.column / spec.dirname for spec in order}
    states = {spec: identity.check_run_dir(folder[spec], config_mod.to_tree(full))
              for spec, full in zip(order, resolved, strict=True)}
    sources = {order[i]: order[j] for i, j in training_sources([training_key(cfg) for cfg in resolved]).items()}
    counter = run_counter(preset, [(spec, configs[spec], folder[spec], states[spec], sources.get(spec))
                                   for spec in order], say, clock)
    if jobs > 1:
        todo = [spec for spec in order if states[spec] != "finished"]
        index = {spec: k for k, spec in enumerate(todo)}
        cost = {spec: planned.cost for spec, planned in zip(order, counter.runs, strict=True)}
        run_jobs([Job(spec_label(spec), config_mod.to_tree(configs[spec]), folder[spec], states[spec], cost[spec],
                      folder[sources[spec]] if spec in sources else None,
                      index.get(sources[spec]) if spec in sources else None) for spec in todo], jobs, say)
    for i, spec in enumerate(order if jobs == 1 else ()):
        if states[spec] == "finished":
            continue
        counter.start(i)
        trained = trained_folder(states[spec], folder[sources[spec]] if spec in sources else None)
        if trained is not None:
            run(configs[spec], folder[spec], False, trained=trained)  # its post-hoc steps only
        else:
            run(configs[spec], folder[spec], states[spec] == "unfinished")
        counter.done(i)
    changed = setting_changes(user_set or [])
    compared = not preset.is_quick and not changed  # the paper's setting: differences are meaningful
    table = reproduction_table(preset, specs, out, compared)
    result = {"preset": preset.name, "title": preset.title, "paper": preset.paper, "notes": preset.notes,
              "quick": preset.is_quick, "quick_settings": preset.quick if preset.is_quick else None,
              "user_set": list(user_set or []), "setting_changed": changed,
              "columns": {c.id: c.label for c in preset.columns}, "table": table,
              "ordering": {c.id: ordering(table, c.id) for c in preset.columns}}
    out.mkdir(parents=True, exist_ok=True)
    result["curves"] = draw_curves(preset, specs, out)  # one mean ± std figure per column, linked from the .md
    atomic_write_text(out / "reproduction.json", json.dumps(result, indent=2) + "\n")
    atomic_write_text(out / "reproduction.md", markdown(result))
    return result


def reproduction_table(preset: Preset, specs: dict[tuple[str, str, int], RunSpec], out: Path,
                       compared: bool) -> dict[str, dict[str, dict[str, Any]]]:
    """Row label -> column id -> the cell: our mean over the seeds' runs under ``out`` of the row's metric
    (:func:`metric_value`), its sample std, the values, the paper's number (a fraction) and, where ``compared``
    (the paper's setting: no quick variant, no ``--set`` that changes it), the difference; how many of the runs
    diverged (kept in the mean: dropping them would flatter it) and whether the mean is at chance."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for row in preset.rows:
        metric = row.metric or preset.metric
        for column in preset.columns:
            dirs = [out / column.id / specs[(row.label, column.id, s)].dirname for s in preset.seeds]
            values = [metric_value(d, metric) for d in dirs]
            ours = mean(values)
            chance, chance_reached = at_chance(ours, [chance_value(d, metric) for d in dirs])
            printed = row.paper.get(column.id)  # the paper's number as printed, in %
            paper = None if printed is None else printed / 100
            table.setdefault(row.label, {})[column.id] = {
                "ours": ours, "std": mean_std(values)[1], "seeds": preset.seeds, "values": values,
                "paper": paper, "diff": None if paper is None or not compared else ours - paper, "metric": metric,
                "diverged": sum(run_diverged(d) for d in dirs), "chance": chance, "at_chance": chance_reached,
            }
    return table


#: ``--set`` keys that say where the data are or how the runs execute, not what they compute: a preset run with
#: only these is still the paper's setting (``runtime.*``: executor, threads, device, ...)
LOCATION_KEYS = ("data.root", "data.cache_dir", "data.download")


def setting_changes(user_set: list[str]) -> list[str]:
    """The ``--set`` assignments that change a preset's setting (every key but :data:`LOCATION_KEYS` and
    ``runtime.*``): with any of them the runs are not the paper's setting, so no differences are given."""
    keys = [(assignment, assignment.split("=", 1)[0].strip()) for assignment in user_set]
    return [a for a, key in keys if key not in LOCATION_KEYS and not key.startswith("runtime.")]


#: two rows whose published accuracies are closer than this (a point) are not ordered by the paper: the gap is
#: within the spread over seeds that the papers report for these tables
SEPARATING_GAP = 0.01


def ordering(table: dict[str, dict[str, dict[str, Any]]], column: str) -> dict[str, Any]:
    """How the rows of ``column`` are ordered against the paper's: of the pairs of rows with a published
    number that the paper separates by :data:`SEPARATING_GAP` or more, how many are in the paper's order
    here (higher accuracy above), and each pair that is not (``above``/``below``: the paper's order, with
    both numbers, the paper's and ours). A pair tied here is not in order. This is what a quick variant,
    whose numbers are not the paper's setting, can be compared on."""
    rows = [(label, cells[column]) for label, cells in table.items()
            if cells[column]["paper"] is not None and math.isfinite(cells[column]["ours"])]
    separated = in_order = 0
    out_of_order = []
    for (label_a, a), (label_b, b) in itertools.combinations(rows, 2):
        if abs(a["paper"] - b["paper"]) < SEPARATING_GAP:
            continue
        (above, hi), (below, lo) = ((label_a, a), (label_b, b)) if a["paper"] > b["paper"] else \
            ((label_b, b), (label_a, a))
        separated += 1
        if hi["ours"] > lo["ours"]:
            in_order += 1
        else:
            out_of_order.append({"above": above, "below": below, "paper": [hi["paper"], lo["paper"]],
                                 "ours": [hi["ours"], lo["ours"]]})
    return {"separated_pairs": separated, "in_order": in_order, "out_of_order": out_of_order,
            "gap": SEPARATING_GAP}


def ordering_lines(result: dict[str, Any]) -> list[str]:
    """The Markdown section of :func:`ordering`, a line per column (and the pairs out of order, at most 10)."""
    lines = []
    for cid, label in result["columns"].items():
        order = (result.get("ordering") or {}).get(cid)
        if not order or not order["separated_pairs"]:
            continue
        gap = percent(order["gap"])
        at_chance = [label for label, by_col in result["table"].items() if by_col[cid].get("at_chance")]
        lines += ["", f"{markdown_text(label or cid)}: {order['in_order']} of the {order['separated_pairs']} pairs of "
                  f"rows the paper separates by {gap:g} point{'s' if gap != 1 else ''} or more are in its order here."
                  + (f" {len(at_chance)} of its rows {'is' if len(at_chance) == 1 else 'are'} at chance "
                     f"({', '.join(map(markdown_text, at_chance))})."
                     if at_chance else "")]
        for pair in order["out_of_order"][:10]:
            (p_hi, p_lo), (o_hi, o_lo) = pair["paper"], pair["ours"]
            lines.append(f"- {markdown_text(pair['above'])} above {markdown_text(pair['below'])} in the paper "
                         f"({percent(p_hi):.2f} against {percent(p_lo):.2f}), "
                         f"{'tied with' if o_hi == o_lo else 'below'} it here ({percent(o_hi):.2f} against "
                         f"{percent(o_lo):.2f})")
        if len(order["out_of_order"]) > 10:
            lines.append(f"- and {len(order['out_of_order']) - 10} more (reproduction.json, \"ordering\")")
    return ["", "## Ordering against the paper", *lines] if lines else []


def estimate_minutes(preset: Preset) -> tuple[float, str]:
    """The preset's estimate of its whole run time in minutes (the quick variant's on 2 idle CPU cores,
    else the GPU one) and what it is (measured when the preset says how, ``quick_cpu_measured``)."""
    if preset.is_quick:
        basis = f"measured: {preset.quick_cpu_measured}" if preset.quick_cpu_measured else "not measured"
        return preset.quick_cpu_minutes, f"the preset's estimate, {basis}"
    return preset.gpu_minutes, "the preset's GPU estimate, not measured"


def spec_label(spec: RunSpec) -> str:
    """A run's name in the counter's line: column, method, the row's own settings (``algorithm.`` left out:
    ``ccvr.oracle=all``), seed; so two runs of one method (CCVR and its oracle) never read the same."""
    settings = ", ".join(f"{key.removeprefix('algorithm.')}={json.loads(value)}" for key, value in spec.overrides)
    return f"{spec.column}, {spec.algorithm}" + (f" ({settings})" if settings else "") + f", seed {spec.seed}"


def run_counter(preset: Preset, plan: list[tuple[RunSpec, config_mod.RunConfig, Path, str, RunSpec | None]],
                say: Callable[[str], None] | None, clock: Callable[[], float] | None) -> Any:
    """The run counter of a preset's plan (:class:`hetfl.sweeps.RunCounter`) with the preset's estimate
    as its prior. A run that starts from another's training (the plan's last item, :func:`training_sources`)
    says so and counts as its last round only."""
    minutes, basis = estimate_minutes(preset)
    index = {item[0]: i for i, item in enumerate(plan)}
    runs = []
    for spec, cfg, run_dir, state, source in plan:
        planned = planned_run(spec_label(spec), cfg, run_dir, state)
        runs.append(planned if source is None or state != "new" else posthoc_only(planned, cfg, index[source]))
    return RunCounter(runs, say, clock or time.monotonic, prior_s=60 * minutes or None, prior_label=basis)


def markdown(result: dict[str, Any]) -> str:
    cols = result["columns"]
    md = markdown_text  # the preset's own strings (title, paper, labels, notes) shown literally
    lines = [f"# {md(result['title'])}", "", f"Paper numbers: {md(result['paper'])}. Ours: mean ± sample std "
             "(n − 1) over seeds (the value alone for one seed), in %; diff = ours - paper.", "",
             "| method | " + " | ".join(f"{md(label)} ours | paper | diff" for label in cols.values()) + " |",
             "|---|" + "---|---|---|" * len(cols)]
    for label, by_col in result["table"].items():
        cells = []
        for cid in cols:
            cell = by_col[cid]
            paper = "U" if cell["paper"] is None else f"{percent(cell['paper']):.2f}"
            diff = "" if cell["diff"] is None else f"{percent(cell['diff']):+.2f}"
            ours = with_spread(percent(cell["ours"]), percent(cell["std"]), len(cell["values"]))
            if cell.get("diverged"):
                ours += f" ({cell['diverged']} of {len(cell['values'])} diverged)"
            if cell.get("at_chance"):
                ours += " (chance)"
            cells.append(f"{ours} | {paper} | {diff}")
        lines.append(f"| {md(label)} | " + " | ".join(cells) + " |")
    if result["quick"]:
        lines += ["", "Quick variant: fewer rounds, one seed, a subset of columns, possibly a smaller model or "
                  "another dataset (see the preset's [quick] table). Compare the ordering of methods, not the "
                  "numbers (\"Ordering against the paper\" below): the paper's are for the full setting, so no "
                  "differences are given."]
        if result.get("quick_settings"):
            lines += ["", "This run's [quick] settings: " + md(quick_settings_text(result["quick_settings"])) + "."]
    if result.get("user_set"):
        lines += ["", "Run with --set " + ", ".join(md(a) for a in result["user_set"]) + "."]
    if result.get("setting_changed"):
        lines += ["", "These --set values change the preset, so the runs are not the paper's setting: "
                  + ", ".join(md(a) for a in result["setting_changed"]) + ". No differences are given; "
                  "compare the ordering of methods (below)."]
    if any(cell.get("diverged") for by_col in result["table"].values() for cell in by_col.values()):
        lines += ["", "Diverged: seeds whose train loss became inf or NaN (summary.json: diverged_round); they are "
                  "kept in the cell's mean and std, as evaluated, so that a method is not flattered by dropping "
                  "its failures."]
    chance = chance_line([cell for by_col in result["table"].values() for cell in by_col.values()])
    if chance:
        lines += ["", chance]
    if result["notes"]:
        lines += ["", "Notes: " + md(result["notes"])]
    lines += ordering_lines(result)
    lines += curve_lines(result)
    return "\n".join(lines) + "\n"


def quick_settings_text(quick: dict[str, Any]) -> str:
    """A quick variant's ``[quick]`` table in one line: ``columns = [...]; seeds = [...]; key = value, ...``
    (values as JSON, so ``train.rounds = 5`` and ``model.name = "simple_cnn"``), then its per-column values
    (``column_set = {"e40": {"train.local_epochs": 4}}``)."""
    parts = [f"{key} = {json.dumps(quick[key])}" for key in ("columns", "seeds") if key in quick]
    parts += [f"{key} = {json.dumps(value)}" for key, value in quick.get("set", {}).items()]
    if quick.get("column_set"):
        parts.append(f"column_set = {json.dumps(quick['column_set'])}")
    return "; ".join(parts)


# ----------------------------------------------------------------- curves over seeds
CURVE_KEYS = ("global_acc", "client_acc_mean")


def curve_key(metric: str, runs: dict[int, list[dict[str, Any]]]) -> str:
    """The per-round accuracy a row's curve shows: the one its metric is read from (``final_X``, ``best_X``,
    ``best5:X`` with X ``global_acc`` or ``client_acc_mean``) when its runs log it, else the runs' default
    (:func:`hetfl.analysis.curves.default_accuracy_key`; e.g. ``final_global_acc_before_ccvr``, logged
    only in the last round, is drawn as the ``global_acc`` curve)."""
    key = metric.removeprefix("best5:").removeprefix("final_").removeprefix("best_")
    if key in CURVE_KEYS and all(any(m.get(key) is not None for m in rows) for rows in runs.values()):
        return key
    return default_accuracy_key([m for rows in runs.values() for m in rows])


def column_groups(preset: Preset, specs: dict[tuple[str, str, int], RunSpec], out: Path,
                  column: Column) -> tuple[dict[str, dict[int, list[dict[str, Any]]]], dict[str, str]]:
    """A column's runs for :func:`~hetfl.analysis.plots.plot_seed_bands`: label -> seed -> metrics, and
    label -> accuracy key (:func:`curve_key`). Rows that read the same runs and the same accuracy
    (e.g. "FedAvg" and "FedAvg + CCVR", one run before and after calibration) are one label."""
    merged: dict[tuple[tuple[str, ...], str], list[str]] = {}
    loaded: dict[tuple[str, ...], dict[int, list[dict[str, Any]]]] = {}
    for row in preset.rows:
        dirs = tuple(specs[(row.label, column.id, s)].dirname for s in preset.seeds)
        if dirs not in loaded:
            loaded[dirs] = {s: load_metrics(out / column.id / d) for s, d in zip(preset.seeds, dirs, strict=True)}
        merged.setdefault((dirs, curve_key(row.metric or preset.metric, loaded[dirs])), []).append(row.label)
    labels = {key: ", ".join(rows) + (": same runs" if len(rows) > 1 else "") for key, rows in merged.items()}
    return {labels[key]: loaded[key[0]] for key in merged}, {labels[key]: key[1] for key in merged}


def draw_curves(preset: Preset, specs: dict[tuple[str, str, int], RunSpec], out: Path) -> dict[str, dict[str, str]]:
    """Per column, ``out/curves_<column id>.png`` (+ ``.csv``): each row's accuracy and train loss over
    rounds, mean ± sample std over seeds (as the table's std), rows as labels (:func:`column_groups`).
    Returns column id -> ``{"png", "csv"}`` file names (relative to ``out``), or ``{"error": why}`` for a
    column whose runs could not be drawn (the table stands without its figure)."""
    import re

    figures: dict[str, dict[str, str]] = {}
    for column in preset.columns:
        try:
            groups, keys = column_groups(preset, specs, out, column)
            written = plot_seed_bands(groups, out, name="curves_" + re.sub(r"[^A-Za-z0-9._-]", "_", column.id),
                                      metric=keys, ddof=1, context=f"{preset.title}: {column.label or column.id}")
        except (ValueError, OSError) as err:
            figures[column.id] = {"error": str(err)}
            continue
        figures[column.id] = {"png": written["png"].name, "csv": written["data"].name}
    return figures


def curve_lines(result: dict[str, Any]) -> list[str]:
    """The Markdown section linking each column's curves (relative links, beside reproduction.md)."""
    import urllib.parse

    curves = result.get("curves") or {}
    if not curves:
        return []
    lines = ["", "## Curves over seeds", "", "Each row's accuracy and train loss per round: mean ± std over seeds "
             "(sample std, n - 1, as the table); rows that read the same runs share one band."]
    for cid, label in result["columns"].items():
        drawn = curves.get(cid, {})
        name = label or cid
        if "png" in drawn:
            lines += ["", f"![{name}]({urllib.parse.quote(drawn['png'])})"]
        elif "error" in drawn:
            lines += ["", f"{name}: curves not drawn: {drawn['error']}"]
    return lines

