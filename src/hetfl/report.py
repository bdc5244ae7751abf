"""``hetfl report RUN_DIR [RUN_DIR ...]``: one self-contained HTML page and its Markdown twin.

The page holds, for the given runs: the comparison table (one row per setting,
i.e. runs whose resolved configurations differ only in the seed, with mean ± std
over seeds, the setting id and a column per key that varies between rows), learning curves (one run: accuracy,
client spread, loss and traffic; several: mean ± std bands over each setting's seeds), each distinct
setting's configuration and partition heat map, and the analyses a run has
(``hetfl analyze``), each figure with the note its analysis recorded (``written.<name>.note`` in
``analysis/index.json``, e.g. why CKA on logistic regression shows only the classifier layer).
Images are embedded as base64 PNG and the style is inline: the file opens offline, in any
browser, and can be mailed as one file. The Markdown twin links the same PNGs, all written next
to it (an analysis figure is copied from its run directory) and linked by relative path, so the
output folder can be moved or shared whole.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import json
import re
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetfl import tables
from hetfl.analysis.plots import plot_curves, plot_seed_bands
from hetfl.data.datasets import load_dataset
from hetfl.data.partition_report import plot_partition
from hetfl.engine import identity
from hetfl.engine.experiment import CONFIG_NAME, METRICS_NAME, SUMMARY_NAME
from hetfl.engine.setup import build_partition, resolve
from hetfl.files import atomic_write_bytes, atomic_write_text

if TYPE_CHECKING:
    from hetfl.runs import CompareResult

STYLE = """
body { font-family: system-ui, -apple-system, Segoe UI, Roboto, sans-serif; margin: 2rem auto; max-width: 1100px;
       color: #1b1f24; line-height: 1.45; padding: 0 1rem; }
h1 { font-size: 1.7rem; } h2 { margin-top: 2.2rem; border-bottom: 1px solid #d0d7de; padding-bottom: .3rem; }
table { border-collapse: collapse; margin: 1rem 0; font-size: .92rem; }
th, td { border: 1px solid #d0d7de; padding: .35rem .6rem; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f6f8fa; }
img { max-width: 100%; border: 1px solid #eaeef2; margin: .5rem 0; }
pre { background: #f6f8fa; padding: .8rem; overflow-x: auto; font-size: .85rem; }
.muted { color: #57606a; font-size: .9rem; }
"""


class ReportError(ValueError):
    """A folder given to ``hetfl report`` is not a finished run directory."""


@dataclass
class Run:
    path: Path
    config_text: str
    config: dict[str, Any]  # the resolved configuration, read through today's defaults (identity.saved_tree)
    summary: dict[str, Any]

    @property
    def setting_id(self) -> str:
        """Hash of the resolved config without its seed: runs with equal ids share a table row."""
        return identity.setting_id(self.config)

    @property
    def run_id(self) -> str:
        return identity.run_id(self.config)

    @property
    def seed(self) -> int:
        return int(self.config.get("seed", 0))


def expand_run_dirs(paths: list[Path]) -> list[Path]:
    """Each path that holds a run (its ``config.toml``) as it is; a folder that holds none stands for the run
    folders under it, in sorted order (the ``--out`` of ``hetfl compare`` or ``hetfl reproduce``: ``hetfl report
    runs/cmp`` as ``hetfl report runs/cmp/*/``); a path with neither is a ReportError."""
    expanded: list[Path] = []
    for path in paths:
        if (path / CONFIG_NAME).is_file():
            expanded.append(path)
            continue
        found = sorted(p.parent for p in path.rglob(CONFIG_NAME)) if path.is_dir() else []
        if not found:
            raise ReportError(f"{path}: no {CONFIG_NAME}, so no hetfl run, and no run folder under it; give run "
                              "directories written by hetfl run, or the --out folder of hetfl compare")
        expanded += found
    return expanded


def read_runs(run_dirs: list[Path]) -> list[Run]:
    """The runs, each given once (:func:`expand_run_dirs`: a folder of runs stands for them): two folders
    holding the same run (equal run ids) are an error, as a row's "seeds" would count one seed twice."""
    runs: list[Run] = []
    for path in expand_run_dirs(run_dirs):
        for name in (SUMMARY_NAME, METRICS_NAME):
            if not (path / name).is_file():
                raise ReportError(f"{path}: no {name}: the run has not finished; continue it with "
                                  f"`hetfl run --resume {path}`, then report it")
        tree = identity.saved_tree(path)
        if tree is None:
            raise ReportError(f"{path}: {CONFIG_NAME} is not readable TOML; give finished run directories")
        run = Run(path, (path / CONFIG_NAME).read_text(), tree, json.loads((path / SUMMARY_NAME).read_text()))
        twin = next((r for r in runs if r.run_id == run.run_id), None)
        if twin is not None:
            raise ReportError(f"{twin.path} and {path} are the same run (run id {run.run_id}: same configuration, "
                              f"seed {run.seed}); give each run once")
        runs.append(run)
    return runs


def labels_for(groups: dict[str, list[Run]]) -> dict[str, str]:
    """A label per setting: the method, plus the keys the table shows (:func:`hetfl.tables.shown_keys`)."""
    varying = tables.shown_keys([g[0].config for g in groups.values()])
    return {key: _setting_label(runs[0].config.get("algorithm", {}).get("name", "?"), runs[0].config, varying)
            for key, runs in groups.items()}


def _setting_label(method: str, config: dict[str, Any], varying: list[str]) -> str:
    """``method (key=value, ...)`` over the keys that vary between settings."""
    flat = identity.flatten(config)
    extra = ", ".join(f"{k}={flat[k]}" for k in varying if k in flat)
    return method + (f" ({extra})" if extra else "")


def record_groups(records: Sequence[tables.RunRecord]) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """The runs of each row of :func:`hetfl.tables.table_rows` (a setting; a method where a run's config is
    unknown), as ``label -> seed -> metrics`` for :func:`~hetfl.analysis.plots.plot_seed_bands`; the label
    is the row's method and the keys its table shows (+ the setting id if two labels would match)."""
    rows: dict[str, list[tables.RunRecord]] = {}
    for r in records:
        rows.setdefault(r.setting_id or f"method:{r.method}", []).append(r)
    varying = tables.shown_keys([rs[0].config for rs in rows.values() if rs[0].config])
    out: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for rs in rows.values():
        label = _setting_label(rs[0].method, rs[0].config, varying)
        out[label if label not in out else f"{label} [{rs[0].setting_id}]"] = {r.seed: r.metrics for r in rs}
    return out


def comparison_curves(records: Sequence[tables.RunRecord], out: Path, target: float | None) -> str:
    """``out/curves.png`` and ``curves.csv``: one mean ± std band over seeds per row of ``comparison.md``
    (sample std, as the table); returns the Markdown that ``comparison.md`` adds under its table: a
    relative link to the figure, or why it was not drawn (the table stands without it)."""
    try:
        written = plot_seed_bands(record_groups(records), out, name="curves", target=target,
                                  context=f"{len(records)} run(s) in {out.name}")
    except ValueError as err:
        return f"\nCurves not drawn: {err}\n"
    png = written["png"].name
    return (f"\n![Learning curves over seeds, mean ± std]({urllib.parse.quote(png)})\n\n"
            f"Curves: `{png}`, mean ± sample std over each row's seeds; numbers in `{written['data'].name}`.\n")


def with_curves(result: CompareResult) -> CompareResult:
    """``result`` (from ``hetfl compare`` / :func:`hetfl.compare`) with its curves drawn
    (:func:`comparison_curves`) and linked under the table in ``comparison.md`` and ``.markdown``."""
    methods = {row["setting_id"]: row["method"] for row in result.rows}  # each band named as its table row
    records = [run.record(methods.get(run.setting_id)) for run in result.runs]
    markdown = result.markdown + comparison_curves(records, result.out, result.target)
    atomic_write_text(result.out / "comparison.md", markdown)
    return dataclasses.replace(result, markdown=markdown)


def _curve_figures(groups: dict[str, list[Run]], labels: dict[str, str], out: Path, target: float | None,
                   per_seed: bool) -> list[tuple[str, Path]]:
    """The report's curves, as ``(alt text, png)``: one run gets the four-panel :func:`plot_curves`;
    several get mean ± std bands over seeds per setting (``seed_bands.png``; with ``per_seed``, each
    seed as a thin line, followed by the four-panel figure with one line per run, as before bands)."""
    per_run = {f"{labels[key]} seed {r.seed}": r.path / METRICS_NAME for key, rs in groups.items() for r in rs}
    if len(per_run) == 1:
        return [("curves", Path(plot_curves(per_run, out, target=target)["png"]))]
    bands = plot_seed_bands({labels[key]: {r.seed: r.path / METRICS_NAME for r in rs} for key, rs in groups.items()},
                            out, name="seed_bands", per_seed=per_seed, target=target)
    figures = [("curves over seeds, mean ± std", Path(bands["png"]))]
    if per_seed:
        figures.append(("curves per run", Path(plot_curves(per_run, out, target=target)["png"])))
    return figures


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}">'


def _md_img(alt: str, png: Path, out: Path) -> str:
    """A Markdown image link to ``png`` (inside ``out``) relative to ``out``, where report.md is."""
    rel = Path(png).resolve().relative_to(out.resolve()).as_posix()
    return f"![{alt}]({urllib.parse.quote(rel)})"


def _copy_in(png: Path, out: Path, name: str) -> Path:
    """``png`` copied into ``out`` as ``name`` (characters other than letters, digits, ``._-`` replaced), so
    report.md's folder holds every image it links."""
    target = out / re.sub(r"[^A-Za-z0-9._-]", "_", name)
    atomic_write_bytes(target, Path(png).read_bytes())
    return target


def _fence(text: str) -> str:
    """A Markdown code fence longer than any run of backticks in ``text`` (which then cannot close it)."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def _note_parts(result: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The HTML and Markdown lines of an analysis's note (``written.<name>.note``; none if it has none), on
    one line each."""
    note = " ".join(str(result.get("note") or "").split())
    if not note:
        return [], []
    return [f'<p class="muted">Note: {html.escape(note)}</p>'], [f"*Note:* {tables.markdown_text(note)}", ""]


def partition_plot(run: Run, out: Path) -> Path | None:
    """The run's partition heat map (rebuilt from its config), or None if its data is unavailable."""
    try:
        cfg = identity.load_run_config(run.path / CONFIG_NAME)
        dataset = load_dataset(cfg.data.dataset, cfg.data.root or None, download=False, cache_dir=cfg.data.cache_dir,
                               seed=cfg.seed, **cfg.data.options)
    except Exception:  # data moved or offline: the report goes on without the heat map
        return None
    cfg = resolve(cfg, dataset)
    target = out / f"partition_{run.run_id}.png"  # one per run: folders of different runs may share a name
    plot_partition(build_partition(cfg, dataset), dataset.train.y.numpy(), dataset.info.num_classes, target,
                   title=f"{cfg.data.dataset}, {cfg.data.partition}, {cfg.data.num_clients} clients")
    return target


def partition_note(shown: Run, group: list[Run]) -> str:
    """Which run's split a setting's heat map shows (:func:`partition_plot` draws its first run's): a split is
    drawn from the run's seed (``derive_seed(seed, "partition")``), so the row's other seeds may split otherwise."""
    others = [r.seed for r in group if r is not shown]
    note = f"The split of the run with seed {shown.seed}"
    if not others:
        return note + "."
    which = "the run with seed" if len(others) == 1 else "the runs with seeds"
    return (f"{note}; partitions are drawn from a run's seed, so {which} {', '.join(map(str, others))} may split "
            "differently.")


def build_report(run_dirs: list[str | Path], out: str | Path, *, target: float | None = None,
                 title: str = "hetfl report", per_seed: bool = False) -> tuple[Path, Path]:
    """Write ``out/report.html`` (self-contained) and ``out/report.md`` (+ PNGs); return both paths.
    Several runs' curves are mean ± std bands over seeds per setting; ``per_seed`` adds each seed
    (:func:`_curve_figures`)."""
    runs = read_runs([Path(p) for p in run_dirs])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.setting_id, []).append(run)
    labels = labels_for(groups)
    records = [tables.read_run(r.path, r.config.get("algorithm", {}).get("name", "?"), r.seed)
               for rs in groups.values() for r in rs]
    rows = tables.table_rows(records, target)
    table_md = tables.to_markdown(rows, target)
    differences = tables.differences_line(rows)
    md = tables.markdown_text  # every user string in report.md: a run's values, paths, names, the title
    figures = _curve_figures(groups, labels, out, target, per_seed)
    html_parts = [f"<h1>{html.escape(title)}</h1>",
                  f'<p class="muted">{len(runs)} run(s), {len(groups)} setting(s).</p>',
                  "<h2>Comparison</h2>", _table_html(*tables.table_cells(rows, target)),
                  f'<p class="muted">{html.escape(differences)}</p>',
                  *(f'<p class="muted">{html.escape(line)}</p>' for line in (tables.aggregation_line(rows, target),
                                                                             tables.diverged_line(rows),
                                                                             tables.chance_line(rows),
                                                                             tables.privacy_line(rows)) if line),
                  "<h2>Curves</h2>", *(_img(png) for _, png in figures)]
    md_parts = [f"# {md(title)}", "", f"{len(runs)} run(s), {len(groups)} setting(s).", "", "## Comparison", "",
                table_md, "## Curves", "", *(line for alt, png in figures for line in (_md_img(alt, png, out), ""))]
    for key, group in groups.items():
        first = group[0]
        name = f"{labels[key]} [{key}]"
        html_parts += [f"<h2>Setting: {html.escape(name)}</h2>",
                       f'<p class="muted">runs: {html.escape(", ".join(str(r.path) for r in group))}</p>',
                       "<h3>Configuration</h3>", f"<pre>{html.escape(first.config_text)}</pre>"]
        fence = _fence(first.config_text)
        md_parts += [f"## Setting: {md(name)}", "", "runs: " + ", ".join(md(r.path) for r in group), "",
                     fence + "toml", first.config_text.rstrip(), fence, ""]
        heat = partition_plot(first, out)
        if heat is not None:
            which = partition_note(first, group)
            html_parts += ["<h3>Partition</h3>", f'<p class="muted">{html.escape(which)}</p>', _img(heat)]
            md_parts += [which, "", _md_img("partition", heat, out), ""]
        for run in group:
            index_path = run.path / "analysis" / "index.json"
            if not index_path.is_file():
                continue
            index = json.loads(index_path.read_text())
            if index.get("run_id", run.run_id) != run.run_id:  # written for another configuration in this folder
                note = f"analyses of {run.path.name} skipped: written for another configuration; rerun hetfl analyze"
                html_parts.append(f'<p class="muted">{html.escape(note)}</p>')
                md_parts += [md(note), ""]
                continue
            html_parts.append(f"<h3>Analyses of {html.escape(run.path.name)} (round {index['round']})</h3>")
            md_parts += [f"### Analyses of {md(run.path.name)} (round {md(index['round'])})", ""]
            for analysis, result in index["written"].items():
                png = run.path / "analysis" / Path(result["png"]).name
                if png.is_file():
                    note_html, note_md = _note_parts(result)
                    local = _copy_in(png, out, f"analysis_{run.run_id}_{analysis}.png")
                    html_parts += [f"<h4>{html.escape(analysis)}</h4>", _img(png), *note_html]
                    md_parts += [_md_img(md(analysis), local, out), "", *note_md]
            for analysis, why in index.get("skipped", {}).items():
                html_parts.append(f'<p class="muted">{html.escape(analysis)} skipped: {html.escape(why)}</p>')
                md_parts += [f"{md(analysis)} skipped: {md(why)}", ""]
    page = (f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>{''.join(html_parts)}</body></html>\n")
    html_path, md_path = out / "report.html", out / "report.md"
    atomic_write_text(html_path, page)
    atomic_write_text(md_path, "\n".join(md_parts) + "\n")
    return html_path, md_path


def _table_html(head: list[str], body: list[list[str]]) -> str:
    """The comparison table (:func:`hetfl.tables.table_cells`) as HTML, every cell escaped."""
    out = ["<table><thead><tr>", *(f"<th>{html.escape(h)}</th>" for h in head), "</tr></thead><tbody>"]
    for row in body:
        out += ["<tr>", *(f"<td>{html.escape(c)}</td>" for c in row), "</tr>"]
    out.append("</tbody></table>")
    return "".join(out)
