"""The console both the command line and the library use: progress bars and the summary table of a run
(:class:`RichReporter`, the engine's ``Reporter``), the terminal console (:func:`make_console`), the default
run folder and the checks of an output folder before anything is written.

It lives below :mod:`hetfl.api`, :mod:`hetfl.sweeps` and :mod:`hetfl.cli` (all three show progress and check
folders), above the engine whose ``Reporter`` protocol it implements (see docs/architecture.md, "Layers").
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from hetfl import config as config_mod
from hetfl.engine.rundir import RunDirError

__all__ = ["PIPED_WIDTH", "RichReporter", "check_new_run_dir", "check_output_dir", "default_run_dir",
           "make_console", "summary_table"]


# ----------------------------------------------------------------- progress
class RichReporter:
    """Progress bars for rounds and clients, and a summary table at the end."""

    def __init__(self, console: Console, enabled: bool,
                 on_round: Callable[[dict[str, Any]], object] | None = None) -> None:
        self.console, self.enabled, self.on_round = console, enabled, on_round
        self.progress: Progress | None = None

    def start(self, cfg: config_mod.RunConfig, start_round: int, exp: Any) -> None:
        if not self.enabled:
            return
        c = cfg
        self.console.print(Text.assemble(
            ("hetfl", "bold"),
            f" {c.algorithm.name} on {c.data.dataset} ({c.data.partition}, "
            f"{c.data.num_clients} clients), model {c.model.name} ({exp.num_params:,} parameters), "
            f"device {exp.device}" + where_it_starts(start_round, getattr(exp, "trained_in", None)),
        ))
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"), console=self.console, transient=False,
        )
        self.progress.start()
        self.rounds = self.progress.add_task("rounds", total=c.train.rounds, completed=start_round, status="")
        self.clients = self.progress.add_task("  clients", total=1, status="")

    def round_start(self, round_: int, num_clients: int) -> None:
        if self.progress:
            self.progress.reset(self.clients, total=num_clients, status=f"round {round_}")

    def client_done(self) -> None:
        if self.progress:
            self.progress.advance(self.clients)

    @property
    def shows_notes(self) -> bool:
        """Whether :meth:`note` prints (the run's notes are then not also logged)."""
        return self.enabled

    def note(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, style="yellow")

    def round_end(self, line: dict[str, Any]) -> None:
        if self.on_round is not None:  # whether shown or not (the run counter's early estimate)
            self.on_round(line)
        if not self.progress:
            return
        parts = [f"loss {line['train_loss']:.3f}"]
        if "global_acc" in line:
            parts.append(f"global {100 * line['global_acc']:.2f}%")
        if "client_acc_mean" in line:
            parts.append(f"clients {100 * line['client_acc_mean']:.2f}%")
        self.progress.update(self.rounds, advance=1, status=", ".join(parts))

    def finish(self, summary: dict[str, Any]) -> None:
        if self.progress:
            self.progress.stop()
        if self.enabled:
            self.console.print(summary_table(summary))

    def close(self) -> None:
        if self.progress:
            self.progress.stop()


def summary_table(summary: dict[str, Any]) -> Table:
    table = Table(title=f"summary: {summary['algorithm']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    before = sorted(k for k in summary if k.startswith("final_global_acc_before_"))  # a post-hoc step's input
    for key in (*before, "final_global_acc", "best_global_acc", "final_client_acc_mean", "best_client_acc_mean"):
        if key in summary:
            table.add_row(key, f"{100 * summary[key]:.2f}%")
    table.add_row("rounds", str(summary["rounds"]))
    table.add_row("wall_time_s", f"{summary['wall_time_s']:.1f}")
    up, down = summary["bytes_up_total"] / 1e6, summary["bytes_down_total"] / 1e6
    table.add_row("MB up / down", f"{up:.1f} / {down:.1f}")
    if "privacy" in summary:  # the budget the run's private releases spent, as its server faced it
        from hetfl.privacy import budget_text, server_epsilon  # (imports torch: not at `hetfl --help`)

        epsilon, per_upload = server_epsilon(summary["privacy"])
        table.add_row("privacy: epsilon (delta)", budget_text(epsilon, float(summary["privacy"]["delta"]), per_upload))
    return table


# ----------------------------------------------------------------- run folders
def default_run_dir(cfg: config_mod.RunConfig) -> Path:
    """``runs/<time>-<method>-<dataset>-seed<k>``, the time to the second; a run started in a second whose
    folder exists already (a loop of tiny runs, two runs started at once) takes ``<time>.2``, ``<time>.3``...,
    so that each run the user did not name gets its own folder (in the order they started)."""
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = cfg.algorithm.name.replace("+", "-")
    rest = f"{name}-{cfg.data.dataset}-seed{cfg.seed}"
    path, n = Path("runs") / f"{stamp}-{rest}", 1
    while path.exists() or path.is_symlink():
        n += 1
        path = Path("runs") / f"{stamp}.{n}-{rest}"
    return path


def _writable_dir(path: Path) -> bool:
    """A folder we may create files in: write and search permission, and a write bit at all (root can
    write into a read-only folder, but a folder marked read-only is not meant to be written)."""
    return os.access(path, os.W_OK | os.X_OK) and bool(path.stat().st_mode & 0o222)


def check_output_dir(path: Path, flag: str = "--out") -> None:
    """An output folder (which may exist: compare, reproduce and report add to theirs) must be a
    folder, below folders (not files), and writable: a RunDirError (exit 2) otherwise, before
    anything is written."""
    try:
        existing = next(p for p in (path, *path.parents) if p.exists() or p.is_symlink())
        if not existing.is_dir():
            raise RunDirError(f"{flag} {path}: {existing} is not a folder; choose another {flag}")
        if not _writable_dir(existing):
            raise RunDirError(f"{flag} {path}: {existing} is not writable; choose another {flag}")
    except OSError as err:
        raise RunDirError(f"{flag} {path}: cannot be used ({err.strerror or err}); choose another {flag}") from None


def check_new_run_dir(path: Path) -> None:
    """``--out`` of a new run must be absent or an empty folder, below folders (not files), and writable:
    a RunDirError (exit 2) otherwise, before anything is written."""
    try:
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise RunDirError(f"--out {path}: already exists and is not empty; use --resume {path} or another --out")
    except OSError as err:
        raise RunDirError(f"--out {path}: cannot be used ({err.strerror or err}); choose another --out") from None
    check_output_dir(path)


#: the width of output that goes to a pipe or a file: wide enough that no table or line is cut or wrapped
PIPED_WIDTH = 100_000


def make_console() -> Console:
    """The terminal console of the commands: text goes out as it is (no rich markup, no emoji codes),
    so that square brackets in names, notes and messages (``hetfl[flower]``, a preset's ``[quick]``)
    are shown, not taken for styles; styles are given explicitly (``style=``, :class:`rich.text.Text`).
    Output that is not a terminal (piped, redirected) is never cut or wrapped: rich would fit it to 80
    columns, ellipsing the names one types (``runtime.secagg_reconstructio…``) and breaking table rows.
    ``COLUMNS`` in the environment still sets a width; a notebook keeps rich's own."""
    console = Console(stderr=False, markup=False, emoji=False)
    if console.is_terminal or console.is_jupyter or os.environ.get("COLUMNS"):
        return console
    return Console(stderr=False, markup=False, emoji=False, width=PIPED_WIDTH)


def where_it_starts(start_round: int, trained_in: str | None) -> str:
    """The run header's tail: from round 1 (nothing), resumed, or the post-hoc steps on another run's training."""
    if trained_in:
        return f", post-hoc steps on the model trained in {trained_in} (rounds 1-{start_round + 1})"
    return f", resuming after round {start_round}" if start_round else ""

