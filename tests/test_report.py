"""`hetfl report`: a self-contained HTML page (checked in a real headless browser) and its Markdown twin."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import urllib.parse
from pathlib import Path

import pytest

from hetfl.cli import main
from hetfl.report import build_report

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """Four runs (two methods, two seeds each) on a small Synthetic(1,1) (8 devices of at most 60 samples: the
    four runs take 0.3 s, not 1.8 s), one analysed, and their report."""
    root = tmp_path_factory.mktemp("runs")
    runs = []
    for method in ("fedavg", "fedprox"):
        for seed in (0, 1):
            run_dir = root / f"{method}-{seed}"
            assert main(["run", "--set", "train.rounds=3", "--set", f"seed={seed}", "--set",
                         f"algorithm.name={method}", "--set", "data.options={num_devices=8, max_samples=60}",
                         "--set", "data.num_clients=8", "--out", str(run_dir), "--quiet"]) == 0
            runs.append(run_dir)
    assert main(["analyze", str(runs[0]), "--only", "curves", "--only", "spectrum"]) == 0
    out = root / "report"
    assert main(["report", *map(str, runs), "--out", str(out), "--target", "0.5", "--title", "Two methods"]) == 0
    return out


def test_html_is_self_contained_with_table_curves_partition_and_analyses(report):
    page = (report / "report.html").read_text()
    assert "<title>Two methods</title>" in page
    assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing fetched from anywhere
    images = re.findall(r'src="data:image/png;base64,', page)
    assert len(images) >= 5  # curves, 2 partition heat maps, 2 analyses
    rows = re.findall(r"<tr><td>(fedavg|fedprox)</td><td>global</td><td>2</td>", page)  # mu: fedprox's default
    assert rows == ["fedavg", "fedprox"]  # one row per setting, two seeds each
    assert "Analyses of fedavg-0" in page and "spectrum" in page


def test_markdown_twin_links_existing_images(report):
    md = (report / "report.md").read_text()
    assert "| fedavg | global | 2 |" in md and "Rows differ in: method;" in md
    for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md):
        assert (report / target).is_file(), target  # relative, or absolute (joining keeps it)


@pytest.mark.skipif(BROWSER is None, reason="no headless browser (apt install chromium)")
def test_the_page_renders_in_headless_chromium(report, tmp_path):
    args = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files"]
    url = (report / "report.html").as_uri()
    dom = subprocess.run([*args, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    assert "Comparison" in dom and dom.count("<tr>") >= 3
    shot = tmp_path / "shot.png"
    subprocess.run([*args, f"--screenshot={shot}", "--window-size=1200,1600", url], capture_output=True,
                   timeout=120, check=True)
    assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 20_000


def test_report_on_a_folder_that_is_not_a_run_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.strip() == (f"hetfl: error: {tmp_path}: no config.toml, so no hetfl run, and no run "
                                               "folder under it; give run directories written by hetfl run, or the "
                                               "--out folder of hetfl compare")
    assert not (tmp_path / "r").exists()


def test_a_folder_of_runs_stands_for_the_runs_under_it(report, tmp_path):
    """``hetfl report runs/cmp`` (the --out of hetfl compare) reports what ``hetfl report runs/cmp/*/`` does."""
    assert main(["report", str(report.parent), "--out", str(tmp_path / "r"), "--target", "0.5", "--title",
                 "Two methods"]) == 0
    table = lambda folder: (folder / "report.md").read_text().split("## Curves")[0]
    assert table(tmp_path / "r") == table(report) and "4 run(s), 2 setting(s)." in table(report)


# A note with characters HTML and Markdown must escape, given to a fake analysis that reuses a real figure.
FAKE_NOTE = "logistic regression has no hidden layer: only the classifier <fc> & its inputs_x are compared"
FAKE_NOTE_MD = "logistic regression has no hidden layer: only the classifier &lt;fc&gt; &amp; its inputs_x are compared"
IMAGE_LINK = re.compile(r"!\[[^\]]*\]\(([^)]+)\)")


@pytest.fixture(scope="module")
def moved(report, tmp_path_factory):
    """A report over a copy of the analysed run (with a fake ``cka`` analysis and its note added to
    ``analysis/index.json``), built in ``before/report`` and then moved, run and all, to ``after/``."""
    before = tmp_path_factory.mktemp("moved") / "before"
    shutil.copytree(report.parent / "fedavg-0", before / "fedavg-0")
    analysis = before / "fedavg-0" / "analysis"
    index = json.loads((analysis / "index.json").read_text())
    shutil.copyfile(analysis / "curves.png", analysis / "cka.png")
    index["written"]["cka"] = {"png": str(analysis / "cka.png"), "note": FAKE_NOTE}
    index["written"]["curves"].pop("note", None)  # an analysis without a note shows none
    (analysis / "index.json").write_text(json.dumps(index))
    build_report([before / "fedavg-0"], before / "report")
    after = before.parent / "after"
    shutil.move(before, after)
    return after / "report", index


def test_markdown_links_are_relative_and_survive_moving_the_folder(moved):
    out, _ = moved
    targets = IMAGE_LINK.findall((out / "report.md").read_text())
    assert len(targets) == 5  # curves, partition heat map, 3 analyses (curves, spectrum, cka)
    for target in targets:
        path = Path(urllib.parse.unquote(target))
        assert not path.is_absolute() and ".." not in path.parts, target
        assert (out / path).is_file(), target  # resolves after the move, next to report.md


def _section(page: str, analysis: str) -> str:
    """What report.html shows under ``analysis``'s heading, up to the next heading or the end."""
    return re.split(r"<h\d|</body>", page.split(f"<h4>{analysis}</h4>", 1)[1], maxsplit=1)[0]


def test_each_analysis_note_is_shown_under_its_figure(moved):
    out, index = moved
    page, md = (out / "report.html").read_text(), (out / "report.md").read_text()
    spectrum_note = index["written"]["spectrum"]["note"]
    for name, note, note_md in (("cka", FAKE_NOTE, FAKE_NOTE_MD), ("spectrum", spectrum_note, spectrum_note)):
        section = _section(page, name)
        shown = re.fullmatch(r'<img [^>]+><p class="muted">Note: ([^<]*)</p>', section)
        assert shown is not None and shown.group(1) == html.escape(note)
        lines = md.splitlines()
        link = next(i for i, line in enumerate(lines) if line.startswith(f"![{name}]("))
        assert lines[link + 1:link + 3] == ["", f"*Note:* {note_md}"]
    assert re.fullmatch(r"<img [^>]+>", _section(page, "curves"))  # no note recorded, none shown


EVIL = "<img src=x onerror=alert(1)>|**b**"


def _unescaped_pipes(line: str) -> int:
    return len(re.findall(r"(?<!\\)\|", line))


def _outside_code(markdown: str) -> str:
    """The Markdown text outside fenced code blocks (a block shows its text literally: config.toml's values)."""
    return re.sub(r"^(`{3,})[^\n]*\n.*?^\1\s*$", "", markdown, flags=re.M | re.S)


@pytest.fixture(scope="module")
def evil_sweep(tmp_path_factory):
    """Issue 26, item 9: a swept value holding HTML and Markdown table syntax (two tiny runs)."""
    import hetfl
    from tests.helpers.runs import TINY

    out = tmp_path_factory.mktemp("evil")
    hetfl.sweep({"data.root": [EVIL, "plain"]}, overrides=TINY, out=out / "sweep")
    runs = sorted((out / "sweep" / "fedavg").glob("*/seed0"))
    build_report(runs, out / "report", title=f"report of {EVIL}")
    return out


@pytest.mark.parametrize("name", ["sweep/comparison.md", "report/report.md"])
def test_user_strings_in_markdown_are_escaped_and_add_no_column(evil_sweep, name):
    text = _outside_code((evil_sweep / name).read_text())
    assert "<img" not in text and "**b**" not in text
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table) == 4  # header, rule, two rows
    assert {_unescaped_pipes(line) for line in table} == {_unescaped_pipes(table[0])}


def test_the_setting_heading_and_title_of_report_md_are_escaped(evil_sweep):
    md = (evil_sweep / "report" / "report.md").read_text()
    headings = [line for line in md.splitlines() if line.startswith("#")]
    assert len([h for h in headings if h.startswith("## Setting: ")]) == 2
    for heading in headings:
        assert "<img" not in heading and "**b**" not in heading


def test_the_html_table_is_built_from_the_rows_not_from_the_markdown(evil_sweep):
    page = (evil_sweep / "report" / "report.html").read_text()
    assert "<img src=x" not in page
    table = page[page.index("<table>"):page.index("</table>")]
    rows = re.findall(r"<tr>(.*?)</tr>", table)
    widths = {len(re.findall(r"<t[hd]>", row)) for row in rows}
    assert len(rows) == 3 and len(widths) == 1, widths
    assert f"<td>{html.escape(EVIL)}</td>" in table  # the value whole, in one cell


def test_a_row_of_diverged_runs_says_so_in_the_report(tmp_path):
    """Runs whose train loss became NaN (``train.lr=1e38``) still end with an accuracy; the report's table counts
    them in a ``diverged`` column, with its note, in report.html and report.md alike."""
    import hetfl
    from tests.helpers.runs import TINY

    table = hetfl.sweep({"train.lr": [0.05, 1e38]}, seeds=[0, 1], overrides=TINY, out=tmp_path / "sweep")
    assert [row["diverged"] for row in table.rows] == [0, 2]
    build_report([tmp_path / "sweep"], tmp_path / "report")
    page = (tmp_path / "report" / "report.html").read_text()
    assert "<th>diverged</th>" in page and "<td>2 of 2</td>" in page and "<td>0 of 2</td>" in page
    assert "Diverged: a row" in page
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| 2 of 2 |" in md and "Diverged: a row" in md


def test_a_swept_value_with_dollar_signs_still_gets_its_curves(tmp_path):
    """A swept string (here ``data.root``) is a curve's label; matplotlib read ``$^$`` in it as mathtext and
    failed, so ``comparison.md`` said "Curves not drawn" and ``hetfl report`` stopped with a ParseException."""
    import hetfl
    from tests.helpers.runs import TINY

    value = "data$^$here"
    table = hetfl.sweep({"data.root": [value, "plain"]}, overrides=[*TINY, "train.rounds=1"], out=tmp_path / "sweep")
    assert "Curves not drawn" not in table.markdown and "![Learning curves" in table.markdown
    html_path, _ = build_report([tmp_path / "sweep"], tmp_path / "report")
    assert (tmp_path / "report" / "seed_bands.png").is_file() and "seed_bands" in html_path.read_text()


def test_the_report_says_how_its_table_aggregates_seeds(report):
    """report.md and report.html say, under the table, that ± is the sample std over seeds and how the rounds to
    the target are averaged (before, neither said which std, and the figure's title was the only place)."""
    md = (report / "report.md").read_text().replace("\\", "")
    page = html.unescape((report / "report.html").read_text())
    for text in (md, page):
        assert "sample std (n − 1) over the row's seeds" in text
        assert "first evaluated round whose accuracy is at or above 50%" in text


def test_the_partition_heat_map_says_which_seed_it_shows(report):
    """A setting's heat map is rebuilt from its first run's configuration, and a split is drawn from the run's seed
    (``derive_seed(seed, "partition")``): with seeds 0 and 1 it shows seed 0's split, and says so, rather than
    passing for the split of every seed of the row."""
    md = (report / "report.md").read_text()
    page = html.unescape((report / "report.html").read_text())
    for text in (md, page):
        assert text.count("The split of the run with seed 0; partitions are drawn from a run's seed, so the run "
                          "with seed 1 may split differently.") == 2  # one per setting
