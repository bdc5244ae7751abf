"""The ``hetfl`` command line: run, compare, partition, list.

Exit codes: 0 success, 2 bad input (configuration, dataset files, checkpoint,
run directory; the one-line message names the key, the value and what is
allowed), 1 any other failure, 130 interrupted. Bad input is detected before
anything is written.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from hetfl import __version__
from hetfl import config as config_mod
from hetfl.console import (  # noqa: F401  (summary_table, PIPED_WIDTH: hetfl.cli's names before hetfl.console)
    PIPED_WIDTH,
    RichReporter,
    check_new_run_dir,
    check_output_dir,
    default_run_dir,
    make_console,
    summary_table,
)
from hetfl.files import atomic_write_text
from hetfl.params import ConfigError, describe, did_you_mean

# The commands import the subsystems they use inside their functions: `hetfl --help`, `hetfl --version` and a
# mistyped option answer at once, without loading torch, the engine or matplotlib. Every such import goes down
# the layers (docs/architecture.md; checked by lint-imports), never up.


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean bad input (exit code 2)."""
    from hetfl.algorithms.base import MethodError
    from hetfl.analysis.run import AnalysisError
    from hetfl.data.base import DatasetError
    from hetfl.data.partition import PartitionError
    from hetfl.engine.checkpoint import CheckpointError
    from hetfl.engine.rundir import RunDirError
    from hetfl.models import ModelError
    from hetfl.report import ReportError

    return (ConfigError, DatasetError, PartitionError, ModelError, CheckpointError, RunDirError, AnalysisError,
            ReportError, MethodError)


def _is_method_error(err: BaseException) -> bool:
    """Whether ``err`` is a method's broken interface met during a run (not while loading its plug-in)."""
    from hetfl.algorithms.base import MethodError

    return isinstance(err, MethodError) and not str(err).startswith("--plugin ")


def _stopped_errors() -> tuple[type[Exception], ...]:
    """Exception types of a run stopped by its federation (too few Flower clients answered a phase: exit code 1,
    the message and how to continue; the run's checkpoint is kept)."""
    from hetfl.engine.federation import PhaseStopped

    return (PhaseStopped,)


def _calibration_errors() -> tuple[type[Exception], ...]:
    """Exception types reported by their message, exit code 1: a calibration on non-finite statistics, and a
    run of ``--jobs N`` that failed in its worker (:class:`hetfl.jobs.RunFailed`: its message names the run, its
    folder and the worker's error; a traceback would show only this process's waiting for it)."""
    from hetfl.algorithms.gaussian_stats import NonFiniteStatistics
    from hetfl.jobs import RunFailed

    return (NonFiniteStatistics, RunFailed)


def _changes_no_number(assignment: str) -> bool:
    """Whether a ``--set KEY=VALUE`` names a key a resumed run may change: one outside the run's identity
    (progress bars, tracking, where the data cache lives: :data:`~hetfl.engine.identity.PRESENTATION_KEYS`)."""
    from hetfl.engine.identity import PRESENTATION_KEYS

    key = assignment.partition("=")[0].strip()
    return key in PRESENTATION_KEYS or key.startswith("tracking.")


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    from hetfl import api, runtimes
    from hetfl.engine.experiment import CONFIG_NAME
    from hetfl.engine.identity import PRESENTATION_KEYS, load_run_config
    from hetfl.engine.rundir import RunDirError, check_unlocked

    if args.resume:
        run_dir = Path(args.resume)
        changing = [s.partition("=")[0].strip() for s in args.set if not _changes_no_number(s)]
        if args.config or args.out or changing:
            here = f" (here: {', '.join(changing)})" if changing else ""
            others = sorted(k for k in PRESENTATION_KEYS if not k.startswith("tracking."))
            raise ConfigError("--resume", str(run_dir), f"takes no CONFIG, --out, or --set of a key that changes the "
                                                        f"numbers{here}: the run's config.toml is used; --set takes "
                                                        f"tracking.KEY=VALUE and {', '.join(others)}")
        check_unlocked(run_dir)  # another process running there: named now, before the set-up's work
        if not (run_dir / CONFIG_NAME).is_file():
            raise RunDirError(f"--resume {run_dir}: no {CONFIG_NAME} there; is it a hetfl run directory?")
        cfg = load_run_config(run_dir / CONFIG_NAME, args.set)  # tracking keys: not part of the run's identity
    else:
        cfg = api.make_config(args.config, args.set)
        run_dir = Path(args.out) if args.out else default_run_dir(cfg)
        check_unlocked(run_dir)
        check_new_run_dir(run_dir)
    args.run_dir = run_dir  # named by the hint after Ctrl-C (interrupted_hint)
    if args.quiet:
        cfg = _with(cfg, runtime={"progress": False})
    exp = runtimes.set_up(cfg)  # the whole configuration, in one pass down the layers
    reporter = RichReporter(console, exp.cfg.runtime.progress)
    try:
        runtimes.run_experiment(exp, run_dir, resume=bool(args.resume), reporter=reporter)
    finally:
        reporter.close()
    print(f"run directory: {run_dir}")
    return 0


def _with(cfg: config_mod.RunConfig, **sections: dict[str, Any]) -> config_mod.RunConfig:
    tree = config_mod.to_tree(cfg)
    for name, values in sections.items():
        tree.setdefault(name, {}).update(values)
    return config_mod.from_dict(tree)


def parse_target(text: str | None) -> float | None:
    """``--target``: an accuracy as a fraction in (0, 1] (``0.6``, the unit of every file and object) or in
    percent with a ``%`` sign (``60%``, the unit the tables show); a ConfigError naming both otherwise."""
    if text is None:
        return None
    raw = str(text).strip()
    is_percent = raw.endswith("%")
    try:
        value = float(raw.removesuffix("%").strip())
    except ValueError:
        value = float("nan")
    fraction = value / 100 if is_percent else value
    if not 0 < fraction <= 1:  # NaN fails too
        raise ConfigError("--target", text, "must be an accuracy: a fraction in (0, 1] such as 0.6, or a percent "
                                            "with its sign such as 60%")
    return fraction


def list_items(option: str, text: str, what: str) -> list[str]:
    """The comma-separated items of ``option``'s ``text``, stripped; an empty item (``1,,2``, ``0,1,``) is a
    ConfigError: a typo, perhaps a value left out, not to be guessed past. An empty ``text`` gives no items."""
    if not text.strip():
        return []
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise ConfigError(option, text, f"has an empty item; give comma-separated {what}, none empty")
    return items


def cmd_compare(args: argparse.Namespace, console: Console) -> int:
    from hetfl import api
    from hetfl.sweeps import grid_from_cli

    methods = list_items("--methods", args.methods, "method names, e.g. fedavg,fedprox")
    seed_items = list_items("--seeds", args.seeds, "integers, e.g. 0,1,2")
    try:
        seeds = [int(s) for s in seed_items]
    except ValueError:
        raise ConfigError("--seeds", args.seeds, "must be comma-separated integers, e.g. 0,1,2") from None
    if not methods or not seeds:
        raise ConfigError("--methods/--seeds", f"{args.methods} / {args.seeds}", "need at least one of each")
    if len(set(seeds)) < len(seeds) or len(set(methods)) < len(methods):
        raise ConfigError("--methods/--seeds", f"{args.methods} / {args.seeds}", "must not repeat a method or seed")
    target = parse_target(args.target)
    grid = grid_from_cli(args.grid, args.sweep, args.set)  # checked before anything is written
    out = Path(args.out)
    # planning, the checks of every folder before any run, running and the tables: shared with hetfl.compare()
    result = api.run_comparison(methods, seeds, lambda extra: api.make_config(args.config, [*args.set, *extra]), out,
                            target, progress=False if args.quiet else None, console=console, grid=grid,
                            jobs=args.jobs, **({"max_runs": None} if args.yes else {}))
    console.print(result.markdown)
    curves = f"; curves: {out / 'curves.png'}" if (out / "curves.png").is_file() else ""
    print(f"tables: {out / 'comparison.md'}, {out / 'comparison.csv'}{curves}")
    return 0


def cmd_partition(args: argparse.Namespace, console: Console) -> int:
    from hetfl.api import make_config
    from hetfl.data.datasets import load_dataset
    from hetfl.data.partition_report import format_table, partition_table, plot_partition
    from hetfl.engine.setup import build_partition, resolve

    cfg = make_config(args.config, args.set)
    for flag, target in (("--plot", args.plot), ("--json", args.json)):
        if target:
            check_output_dir(Path(target).parent, flag)
    dataset = load_dataset(cfg.data.dataset, cfg.data.root or None, download=cfg.data.download,
                           cache_dir=cfg.data.cache_dir, seed=cfg.seed, **cfg.data.options)
    cfg = resolve(cfg, dataset)
    part = build_partition(cfg, dataset)
    train_y, test_y = dataset.train.y.numpy(), dataset.test.y.numpy()
    rows = partition_table(part, train_y, test_y, dataset.info.num_classes)
    console.print(format_table(rows))
    if args.plot:
        title = f"{cfg.data.dataset}, {cfg.data.partition}, {cfg.data.num_clients} clients"
        plot_partition(part, train_y, dataset.info.num_classes, args.plot, class_names=list(dataset.info.classes),
                       title=title)
        print(f"heat map: {args.plot}")
    if args.json:
        atomic_write_text(Path(args.json), json.dumps(rows, indent=2, default=float) + "\n")
    return 0


LIST_TOPICS = ("all", "algorithms", "datasets", "partitions", "models", "config")
METHOD_SETTINGS_HINT = "a method's settings with their meaning: hetfl list METHOD (e.g. hetfl list feduv)"


def method_settings_table(full_name: str) -> Table:
    """``hetfl list METHOD``: the settings of a method (and of its post-hoc steps), each as the key to set, its
    default and its meaning."""
    from hetfl import algorithms
    from hetfl.params import describe

    trainer, steps = algorithms.parse_name(full_name)
    cls = algorithms.algorithm_class(trainer)
    table = Table(title=f"{full_name}: {cls.citation} (--set KEY=VALUE)")
    for col in ("key", "default", "meaning"):
        table.add_column(col)
    for name, default, doc in describe(cls.Hyper):
        table.add_row(f"algorithm.{name}", default, doc)
    for step in steps:
        for name, default, doc in describe(algorithms.posthoc_class(step).Hyper):
            table.add_row(f"algorithm.{step}.{name}", default, doc)
    if not table.rows:
        table.add_row("-", "-", f"{full_name} has no settings of its own")
    return table


def cmd_list(args: argparse.Namespace, console: Console) -> int:
    from hetfl import algorithms
    from hetfl.data.datasets import DATASETS
    from hetfl.data.partition import PARTITIONS
    from hetfl.models import MODELS
    from hetfl.params import describe, did_you_mean

    what = args.what
    if what not in LIST_TOPICS:
        if what in DATASETS or what in MODELS or what in PARTITIONS:
            for part in component_tables(what):
                console.print(part)
            return 0
        trainer = what.split("+")[0]
        if trainer not in algorithms.available():
            names = [*LIST_TOPICS, *algorithms.available(), *DATASETS, *MODELS, *PARTITIONS]
            raise ConfigError("hetfl list", what, did_you_mean(what, names)
                              + "allowed: " + ", ".join(LIST_TOPICS) + ", or the name of a method, dataset, model "
                              "or partition (hetfl list all)")
        console.print(method_settings_table(what))
        return 0
    if what in ("all", "algorithms"):
        table = Table(title="algorithms (algorithm.name; settings under algorithm.)")
        for col in ("name", "paper", "settings (default)"):
            table.add_column(col)
        for name in algorithms.available():
            cls = algorithms.algorithm_class(name)
            settings = ", ".join(f"{n}={d}" for n, d, _ in describe(cls.Hyper)) or "-"
            table.add_row(name, cls.citation, settings)
        console.print(table)
        console.print(posthoc_table())
        console.print(METHOD_SETTINGS_HINT)
    if what in ("all", "datasets"):
        console.print("datasets (data.dataset): " + ", ".join(DATASETS))
    if what in ("all", "partitions"):
        console.print("partitions (data.partition): " + ", ".join(PARTITIONS))
    if what in ("all", "models"):
        console.print("models (model.name): " + ", ".join(MODELS))
    if what in ("all", "config"):
        table = Table(title="configuration keys (--set KEY=VALUE)")
        for col in ("key", "default", "meaning"):
            table.add_column(col)
        table.add_row("seed", "0", "seed of every random stream")
        table.add_row("algorithm.name", "'fedavg'", "method; post-hoc steps join with +")
        for section, cls in config_mod.SECTIONS.items():
            for name, default, doc in describe(cls, f"{section}."):
                table.add_row(f"{section}.{name}", default, doc)
        console.print(table)
        console.print(f"algorithm.* (method settings): {METHOD_SETTINGS_HINT}")
    return 0


def component_tables(name: str) -> list[Text | Table]:
    """What ``hetfl list NAME`` shows for a dataset, model or partition: a line on what it is, then the
    settings it takes (a dataset's ``data.options``, a model's ``model.options``, the ``data.*`` keys a
    partition reads) with their defaults."""
    from hetfl.data.datasets import DATASETS, describe_dataset
    from hetfl.data.partition import PARTITION_DOCS, PARTITIONS, partition_keys
    from hetfl.models import MODELS, describe_model, model_options

    def settings(columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> Table:
        table = Table()
        for col in columns:
            table.add_column(col)
        for row in rows or [("(none)",) + ("",) * (len(columns) - 1)]:
            table.add_row(*row)
        return table

    shown: list[Text | Table] = []
    if name in DATASETS:
        text, options = describe_dataset(name)
        shown += [Text(f"dataset {name} (data.dataset): {text}"),
                  settings(("data.options key", "default", "allowed"),
                           [(key, repr(default), allowed) for key, default, allowed in options])]
    if name in MODELS:
        shown += [Text(f"model {name} (model.name): {describe_model(name)}"),
                  settings(("model.options key", "default"),
                           [(key, repr(default)) for key, default in model_options(name).items()])]
    if name in PARTITIONS:
        reads = partition_keys(name, "dirichlet")  # rotation / concept: alpha and min_size with data.base dirichlet
        shown += [Text(f"partition {name} (data.partition): {PARTITION_DOCS[name]}"),
                  settings(("key it reads", "default", "meaning"),
                           [(f"data.{key}", default, doc)
                            for key, default, doc in describe(config_mod.DataConfig, "data.") if key in reads])]
    return shown


def posthoc_table() -> Table:
    """The post-hoc steps (CCVR and its side studies' settings), each with its ``algorithm.<step>.<key>`` settings."""
    from hetfl import algorithms
    from hetfl.params import describe

    table = Table(title="post-hoc steps (after a method: algorithm.name = METHOD+STEP, e.g. fedavg+ccvr; "
                        "settings under algorithm.STEP.)")
    for col in ("name", "paper", "settings (default)"):
        table.add_column(col)
    for step in algorithms._POSTHOC:
        cls = algorithms.posthoc_class(step)
        settings = ", ".join(f"algorithm.{step}.{n}={d}" for n, d, _ in describe(cls.Hyper)) or "-"
        table.add_row(step, cls.citation, settings)
    return table


def cmd_analyze(args: argparse.Namespace, console: Console) -> int:
    from hetfl.analysis.run import analyze_run

    index = analyze_run(args.run_dir, args.only or None, device=args.device, probe=args.probe, option="--probe")
    table = Table(title=f"analyses of {args.run_dir} (round {index['round']})")
    table.add_column("analysis")
    table.add_column("files or reason skipped")
    for name, result in index["written"].items():
        table.add_row(name, ", ".join(str(v) for k, v in result.items() if k in ("png", "data")))
    for name, why in index["skipped"].items():
        table.add_row(name, Text.assemble(("skipped", "yellow"), f": {why}"))
    console.print(table)
    return 0


def cmd_reproduce(args: argparse.Namespace, console: Console) -> int:
    from hetfl import reproduce
    from hetfl.engine.experiment import CONFIG_NAME
    from hetfl.engine.identity import load_run_config
    from hetfl.runtimes import run_experiment

    if args.list or not args.name:
        table = Table(title="reproduction presets (hetfl reproduce NAME [--quick])")
        for col in ("name", "table", "runs (full)", "est. GPU min", "est. quick CPU min"):
            table.add_column(col)
        for name in reproduce.available():
            preset = reproduce.load_preset(name)
            runs = len(set(reproduce.run_specs(preset).values()))
            quick = (f"{preset.quick_cpu_minutes:.0f} (measured): {preset.quick_cpu_measured}"
                     if preset.quick_cpu_measured
                     else f"~{preset.quick_cpu_minutes:.0f} (rough)")
            table.add_row(name, preset.title, str(runs), f"~{preset.gpu_minutes:.0f} (rough, not measured)", quick)
        table.caption = ("quick CPU minutes: the --quick variant on 2 idle CPU cores; 'measured' ones say how in "
                         "their preset (quick_cpu_measured), 'rough' ones are not measured; GPU minutes: not measured")
        console.print(table)
        return 0
    preset = reproduce.load_preset(args.name).variant(args.quick)
    out = Path(args.out or f"runs/reproduce/{preset.name}{'-quick' if args.quick else ''}")
    check_output_dir(out)

    def run(cfg: config_mod.RunConfig, run_dir: Path, resume: bool, trained: Path | None = None) -> None:
        console.print(str(run_dir) + (f" (calibrates the model trained in {trained})" if trained else ""),
                      style="bold")
        reporter = RichReporter(console, enabled=not args.quiet)
        if resume:  # an interrupted run of this configuration goes on from its own config.toml (hetfl run --resume)
            cfg = load_run_config(run_dir / CONFIG_NAME)
        try:
            run_experiment(cfg, run_dir, resume=resume, reporter=reporter, trained=trained)
        finally:
            reporter.close()

    say = lambda message: console.print(Text(message, style="bold"))  # text, never rich markup
    result = reproduce.reproduce(preset, out, run, args.set, say=say, jobs=args.jobs)
    console.print(reproduce.markdown(result))
    print(f"tables: {out / 'reproduction.md'}, {out / 'reproduction.json'}")
    return 0


def default_report_dir(run_dirs: list[str]) -> Path:
    """``hetfl report``'s folder when no ``--out`` is given: ``RUN_DIR/report`` for one run; for several,
    ``report`` in the deepest folder holding them all (the ``--out`` folder of ``hetfl compare``)."""
    if len(run_dirs) == 1:
        return Path(run_dirs[0]) / "report"
    common = Path(os.path.commonpath([os.path.abspath(p) for p in run_dirs]))
    if common.is_relative_to(Path.cwd()):
        common = common.relative_to(Path.cwd())
    return common / "report"


def cmd_report(args: argparse.Namespace, console: Console) -> int:
    from hetfl.report import build_report

    target = parse_target(args.target)
    out = Path(args.out) if args.out else default_report_dir(args.run_dirs)
    check_output_dir(out)
    html_path, md_path = build_report(args.run_dirs, out, target=target, title=args.title,
                                      per_seed=args.per_seed)
    print(f"report: {html_path} (self-contained), {md_path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetfl", description="Federated learning on heterogeneous clients.")
    parser.add_argument("--version", action="version", version=f"hetfl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_plugin_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--plugin", action="append", default=[], metavar="FILE",
                       help="Python file that registers extra methods with @hetfl.algorithms.register")

    def add_config_args(p: argparse.ArgumentParser) -> None:
        add_plugin_arg(p)
        p.add_argument("config", nargs="?", help="TOML config file (default: built-in defaults)")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set train.lr=0.01 (repeatable)")

    run = sub.add_parser("run", help="run one experiment")
    add_config_args(run)
    run.add_argument("--out", help="run directory (default: runs/<time>-<method>-<dataset>-seed<k>)")
    run.add_argument("--resume", metavar="DIR", help="continue the interrupted run in DIR (with it, --set takes "
                                                         "only keys that change no number: tracking.*, "
                                                         "runtime.progress, ...)")
    run.add_argument("--quiet", action="store_true", help="no progress bars")
    run.set_defaults(func=cmd_run, command_parser=run)

    cmp = sub.add_parser(
        "compare", help="several methods x seeds on one setting: mean ± std table",
        description="Run every method x seed into OUT/<method>-seed<k> and table mean ± std over seeds. A folder "
                    "that already holds a run of the same resolved configuration is reused (finished) or resumed "
                    "(interrupted); one that holds a run of another configuration is an error naming the "
                    "differing keys: give another --out for the new setting. Each table row is one setting "
                    "(runs differing only in the seed), with its setting id; keys that vary between rows get "
                    "a column each. With --grid or --sweep: every method x grid cell x seed into "
                    "OUT/<method>/<key=value,...>/seed<k>, one row per method and cell.")
    add_config_args(cmp)
    cmp.add_argument("--methods", required=True, help="comma-separated, e.g. fedavg,fedprox,scaffold")
    cmp.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    cmp.add_argument("--target", default=None, help="accuracy for rounds-to-target: a fraction (0.8) or, as the "
                     "table shows it, a percent (80%%)")
    cmp.add_argument("--out", required=True, help="folder for the runs and comparison.md/.csv (runs of the same "
                     "configuration there are reused; another configuration there is an error)")
    cmp.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                     help="sweep a config key over values, parsed as --set parses one, e.g. --grid "
                          "train.lr=0.01,0.1 (repeatable: the cartesian product; not a key also given with --set)")
    cmp.add_argument("--sweep", metavar="FILE", help="TOML file with a [grid] table of KEY = [values] (as --grid)")
    cmp.add_argument("--yes", action="store_true", help="run a plan of more than 1000 runs (methods x grid cells x "
                                                        "seeds; refused without it, before anything is planned)")
    cmp.add_argument("--jobs", type=int, default=1, metavar="N",
                     help="runs at once, each in its own worker process (default 1: one after another). The same "
                     "numbers (a CPU run's torch threads are shared out: see hetfl.jobs); a line per run "
                     "started and finished instead of progress bars")
    cmp.add_argument("--quiet", action="store_true", help="no progress bars")
    cmp.set_defaults(func=cmd_compare, command_parser=cmp)

    part = sub.add_parser("partition", help="show how a dataset is split over clients")
    add_config_args(part)
    part.add_argument("--plot", metavar="FILE", help="write a PNG heat map of class counts per client")
    part.add_argument("--json", metavar="FILE", help="write the per-client statistics as JSON")
    part.set_defaults(func=cmd_partition, command_parser=part)

    rep = sub.add_parser(
        "reproduce", help="run a paper table's preset and compare with the published numbers",
        description="Run every distinct run of a preset under OUT/<column>/<run> and write reproduction.md/.json. "
                    "A run folder that already holds a run of the same resolved configuration is reused "
                    "(finished) or resumed (interrupted); one that holds a run of another configuration (say, "
                    "other --set values) is an error naming the differing keys: give another --out.")
    rep.add_argument("name", nargs="?", help="preset name (see --list) or a preset .toml file")
    rep.add_argument("--list", action="store_true", help="list the presets with their estimated cost")
    rep.add_argument("--quick", action="store_true", help="the small CPU variant (minutes): ordering, not numbers")
    rep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a key in every run, e.g. --set data.root=../shared/datasets/cifar10-jpeg.tar.gz")
    rep.add_argument("--out", help="folder for the runs and reproduction.md (default runs/reproduce/NAME, "
                                    "runs/reproduce/NAME-quick with --quick)")
    rep.add_argument("--jobs", type=int, default=1, metavar="N",
                     help="runs at once, each in its own worker process (default 1: one after another). The same "
                     "numbers (a CPU run's torch threads are shared out: see hetfl.jobs); a line per run "
                     "started and finished instead of progress bars")
    rep.add_argument("--quiet", action="store_true", help="no progress bars")
    add_plugin_arg(rep)
    rep.set_defaults(func=cmd_reproduce, command_parser=rep)

    rpt = sub.add_parser("report", help="one self-contained HTML page (and Markdown) for one or more runs")
    rpt.add_argument("run_dirs", nargs="+", help="run directories; runs whose resolved configurations differ "
                     "only in the seed share a table row, and the keys that vary between rows get a column each")
    rpt.add_argument("--out", help="folder for report.html, report.md and their images (default: RUN_DIR/report "
                     "for one run; for several, report/ in the folder that holds them all, e.g. the --out of "
                     "hetfl compare)")
    rpt.add_argument("--target", default=None, help="accuracy for rounds-to-target: a fraction (0.8) or, as the "
                     "table shows it, a percent (80%%)")
    rpt.add_argument("--title", default="hetfl report")
    rpt.add_argument("--per-seed", action="store_true", help="draw each seed as a thin line in the mean ± std "
                     "bands, and add the per-run curves (accuracy, client spread, loss, traffic)")
    add_plugin_arg(rpt)
    rpt.set_defaults(func=cmd_report, command_parser=rpt)

    ana = sub.add_parser("analyze", help="CKA, weight norms, spectra, SWD, t-SNE, curves of a run directory")
    ana.add_argument("run_dir", help="a run directory written by hetfl run")
    ana.add_argument("--only", action="append", metavar="NAME",
                     help="curves, weight_norms, spectrum, cka, swd or tsne (repeatable; default: all)")
    ana.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ana.add_argument("--probe", type=int, default=512, help="test samples used as probe data (CKA, spectra)")
    add_plugin_arg(ana)
    ana.set_defaults(func=cmd_analyze, command_parser=ana)

    lst = sub.add_parser("list", help="list algorithms, datasets, partitions, models, config keys; a method's "
                                      "settings with their meaning")
    lst.add_argument("what", nargs="?", default="all", metavar="{" + ",".join(LIST_TOPICS) + ",NAME}",
                     help="what to list; a method's name (feduv, fedavg+ccvr) lists its algorithm.* settings with "
                          "their defaults and meaning; a dataset's (cifar10), model's (resnet18) or partition's "
                          "(dirichlet) what it is and the settings it takes")
    add_plugin_arg(lst)
    lst.set_defaults(func=cmd_list, command_parser=lst)
    return parser


def interrupted_hint(args: argparse.Namespace, argv: list[str]) -> str:
    """What to do after Ctrl-C, naming the real thing: ``hetfl run --resume`` with the run's folder (once it
    holds its config.toml), the same command again for ``compare`` and ``reproduce`` (which reuse finished
    runs and resume the interrupted one), nothing for the commands that only read."""
    if args.command == "run":
        run_dir = getattr(args, "run_dir", None) or (Path(args.resume) if args.resume else None)
        if run_dir is None or not (run_dir / "config.toml").is_file():
            return "nothing was written; run the command again"
        plugins = "".join(f" --plugin {shlex.quote(p)}" for p in args.plugin)
        return f"continue with `hetfl run --resume {shlex.quote(str(run_dir))}{plugins}`"
    if args.command in ("compare", "reproduce"):
        return (f"run the same command again to continue (`{shlex.join(['hetfl', *argv])}`): it reuses the "
                "finished runs and resumes the interrupted ones")
    return "nothing to continue"


def parse_arguments(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, except that an unknown option is reported by its subcommand's parser (its
    usage, not the top level's) with the nearest option it has (``--sett``: did you mean --set?)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        command: argparse.ArgumentParser = args.command_parser
        options = [s for action in command._actions for s in action.option_strings]
        hints = [did_you_mean(word.partition("=")[0], options).strip() for word in extra if word.startswith("-")]
        command.error(f"unrecognized arguments: {' '.join(extra)}" + "".join(f" ({h})" for h in hints if h))
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_arguments(build_parser(), argv)
    console = make_console()
    try:
        from hetfl.algorithms import load_plugin

        for plugin in args.plugin:
            load_plugin(plugin)
        for assignment in getattr(args, "set", None) or ():  # named as typed, before the API calls it `overrides`
            if "=" not in assignment:
                raise ConfigError("--set", assignment, "must look like KEY=VALUE, e.g. train.lr=0.01")
        return int(args.func(args, console))
    except _user_errors() as err:
        print(f"hetfl: error: {err}", file=sys.stderr)
        if _is_method_error(err):  # raised while a run trained: its folder holds what was done so far
            print(f"hetfl: once the method is fixed, {interrupted_hint(args, argv)}", file=sys.stderr)
        return 2
    except _calibration_errors() as err:  # overflowed features, a parallel run's failure: stopped, with the cause
        print(f"hetfl: error: {err}", file=sys.stderr)
        return 1
    except _stopped_errors() as err:  # too few clients answered: an operational failure, not a bug (no traceback)
        print(f"hetfl: error: {err}", file=sys.stderr)
        print(f"hetfl: once the clients can answer, {interrupted_hint(args, argv)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"hetfl: interrupted; {interrupted_hint(args, argv)}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
