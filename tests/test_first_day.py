"""A researcher's first day (issue 27): one unit for accuracies, tables that show what was varied, hints that
name the real thing, files others can read, piped output that is never cut."""

from __future__ import annotations

import json
import re

import pytest

from hetfl import tables
from hetfl.engine import identity


def _record(method: str, seed: int, final: float, best: float | None = None, **settings: object) -> tables.RunRecord:
    """A finished run of ``method`` (its resolved configuration: defaults plus ``settings``, dotted keys
    with ``__`` for ``.``) without training: what the tables read."""
    tree: dict = {"algorithm": {"name": method}, "seed": seed}
    for key, value in settings.items():
        *parents, last = key.split("__")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    summary = {"final_global_acc": final, "best_global_acc": best if best is not None else final,
               "wall_time_s": 1.0}
    metrics = [{"round": 1, "global_acc": final / 2}, {"round": 2, "global_acc": final}]
    return tables.RunRecord(method, seed, summary, metrics, identity.canonical_tree(tree))


# ----------------------------------------------------------------- item 5: one unit
def test_table_rows_hold_fractions_as_run_results_do_and_the_rendered_table_percent():
    records = [_record("fedavg", 0, 0.75), _record("fedavg", 1, 0.77, best=0.8)]
    (row,) = tables.table_rows(records, target=0.7)
    assert row["final_mean"] == pytest.approx(0.76)  # the unit of RunResult.final_accuracy and summary.json
    assert row["best_mean"] == pytest.approx(0.775)
    assert row["final_std"] == pytest.approx(0.0141421356, rel=1e-6)
    markdown = tables.to_markdown([row], target=0.7)
    assert "76.00 ± 1.41" in markdown and "final acc (%)" in markdown and "rounds to 70%" in markdown
    assert "0.76" in tables.to_csv([row]).splitlines()[1]


def test_reproduction_json_holds_fractions_and_its_markdown_percent(tmp_path):
    from hetfl import reproduce
    from tests.helpers.runs import PRESET, fake_run

    (tmp_path / "toy.toml").write_text(PRESET)
    preset = reproduce.load_preset("toy", tmp_path)
    accs = {"fedavg": [0.2, 0.4, 0.6], "fedprox": [0.1, 0.9, 0.8, 0.7, 0.6, 0.2]}
    result = reproduce.reproduce(preset, tmp_path / "out", fake_run(accs), resolve=lambda cfgs: cfgs)
    cell = json.loads((tmp_path / "out" / "reproduction.json").read_text())["table"]["A"]["c"]
    assert cell["ours"] == pytest.approx(0.605) and cell["paper"] == pytest.approx(0.5)
    assert cell["diff"] == pytest.approx(0.105) and cell["std"] == pytest.approx(0.5 ** 0.5 / 100)
    assert "| A | 60.50 ± 0.71 | 50.00 | +10.50 |" in reproduce.markdown(result)


@pytest.mark.parametrize(("text", "fraction"), [("0.6", 0.6), ("60%", 0.6), ("82.5 %", 0.825), ("1", 1.0)])
def test_target_takes_a_fraction_or_the_tables_percent(text, fraction):
    from hetfl.cli import parse_target

    assert parse_target(text) == pytest.approx(fraction)


@pytest.mark.parametrize("text", ["60", "0", "120%", "-0.1", "sixty"])
def test_target_out_of_range_names_both_units(text, capsys):
    from hetfl.cli import main

    assert main(["report", "nowhere", "--target", text]) == 2
    error = capsys.readouterr().err
    assert "--target" in error and "0.6" in error and "60%" in error


# ----------------------------------------------------------------- item 4: what was varied
def test_comparison_of_two_methods_shows_no_column_for_either_methods_defaults():
    rows = tables.table_rows([_record("fedavg+ccvr", 0, 0.5), _record("fedpac", 0, 0.6)], target=None)
    assert tables.key_columns(rows) == []
    markdown = tables.to_markdown(rows, None)
    assert markdown.splitlines()[0].startswith("| method | metric |")
    assert "Rows differ in: method;" in markdown
    scaffold = tables.table_rows([_record("fedavg", 0, 0.5), _record("scaffold", 0, 0.6)], target=None)
    assert "algorithm.server_lr" not in tables.to_markdown(scaffold, None)


def test_a_setting_the_user_changed_gets_its_column():
    records = [_record("fedavg", 0, 0.5), _record("fedprox", 0, 0.6),
               _record("fedprox", 0, 0.6, algorithm__mu=0.1), _record("fedavg", 0, 0.4, train__lr=0.1)]
    rows = tables.table_rows(records, target=None)
    assert tables.key_columns(rows) == ["algorithm.mu", "train.lr"]
    assert [r["algorithm.mu"] for r in rows] == ["-", "0.01", "0.1", "-"]


def test_curve_labels_name_the_method_and_what_the_user_varied():
    from hetfl.report import record_groups

    labels = list(record_groups([_record("fedavg+ccvr", 0, 0.5), _record("fedpac", 0, 0.6),
                                 _record("fedavg", 0, 0.4, train__lr=0.1)]))
    assert labels == ["fedavg+ccvr (train.lr=0.05)", "fedpac (train.lr=0.05)", "fedavg (train.lr=0.1)"]


# ----------------------------------------------------------------- item 8: hints that name the real thing
TINY_RUN = ["--set", "data.partition=iid", "--set", "data.num_clients=4",
            "--set", "data.options={num_devices=8, max_samples=60}", "--set", "train.rounds=2",
            "--set", "train.local_steps=2", "--set", "runtime.threads=1"]


def test_ctrl_c_in_hetfl_run_names_the_folder_to_resume(tmp_path, monkeypatch, capsys):
    import hetfl.runtimes
    from hetfl.cli import main

    def interrupted(target, run_dir, **_):
        run_dir.mkdir(parents=True)
        (run_dir / "config.toml").write_text("seed = 0\n")
        raise KeyboardInterrupt

    monkeypatch.setattr(hetfl.runtimes, "run_experiment", interrupted)
    run_dir = tmp_path / "my run"
    assert main(["run", "--out", str(run_dir), "--quiet"]) == 130
    error = capsys.readouterr().err
    assert f"hetfl run --resume '{run_dir}'" in error and "DIR" not in error


def test_ctrl_c_before_a_run_wrote_anything_says_to_start_again(tmp_path, monkeypatch, capsys):
    import hetfl.runtimes
    from hetfl.cli import main

    def interrupted(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr(hetfl.runtimes, "run_experiment", interrupted)
    assert main(["run", "--out", str(tmp_path / "r"), "--quiet"]) == 130
    error = capsys.readouterr().err
    assert "--resume" not in error and "nothing was written" in error


def test_ctrl_c_in_compare_says_to_rerun_the_same_command(tmp_path, monkeypatch, capsys):
    import hetfl.api
    from hetfl.cli import main

    def interrupted(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr(hetfl.api, "run_comparison", interrupted)
    out = tmp_path / "cmp"
    assert main(["compare", "--methods", "fedavg,fedprox", "--seeds", "0", "--out", str(out)]) == 130
    error = capsys.readouterr().err
    assert "hetfl run --resume" not in error
    assert f"hetfl compare --methods fedavg,fedprox --seeds 0 --out {out}" in error


def test_report_on_an_unfinished_run_says_to_resume_it(tmp_path, capsys):
    from hetfl.cli import main

    run_dir = tmp_path / "half"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text("seed = 0\n")
    (run_dir / "metrics.jsonl").write_text('{"round": 1}\n')
    assert main(["report", str(run_dir), "--out", str(tmp_path / "rep")]) == 2
    error = capsys.readouterr().err
    assert f"hetfl run --resume {run_dir}" in error and "--out DIR" not in error


def test_the_apis_occupied_folder_error_mentions_overwrite(tmp_path, one_thread):
    import hetfl
    from hetfl.engine.rundir import RunDirError
    from tests.helpers.runs import TINY

    hetfl.run(overrides=TINY, out=tmp_path / "r")
    with pytest.raises(RunDirError, match="overwrite=True"):
        hetfl.run(overrides=[*TINY, "train.lr=0.1"], out=tmp_path / "r")


def test_resuming_a_finished_run_says_nothing_to_do_once(tmp_path, capsys, monkeypatch, one_thread):
    import logging

    from hetfl.cli import main

    monkeypatch.setattr(logging.root, "handlers", [])  # as on the command line: a warning goes to stderr
    run_dir = tmp_path / "r"
    assert main(["run", *TINY_RUN, "--out", str(run_dir)]) == 0
    capsys.readouterr()
    assert main(["run", "--resume", str(run_dir)]) == 0
    seen = capsys.readouterr()
    assert (seen.out + seen.err).count("nothing to do") == 1


def test_a_mistyped_option_shows_the_subcommands_usage_and_the_near_option(capsys):
    from hetfl.cli import main

    with pytest.raises(SystemExit) as info:
        main(["run", "--sett", "train.rounds=2"])
    assert info.value.code == 2
    error = capsys.readouterr().err
    assert "usage: hetfl run" in error and "--sett" in error and "did you mean '--set'?" in error


@pytest.mark.parametrize(("assignment", "meant"), [("algorithm.name=fedavgg", "'fedavg'"),
                                                    ("algorithm.name=FedAvg", "'fedavg'"),
                                                    ("algorithm.name=fedprx", "'fedprox'"),
                                                    ("algorithm.name=fedavg+ccrv", "'ccvr'"),
                                                    ("train.rouns=3", "'train.rounds'"),
                                                    ("trian.rounds=3", "'train'"),
                                                    ("data.partition=dirichlett", "'dirichlet'")])
def test_a_typo_gets_a_did_you_mean(assignment, meant):
    from hetfl.algorithms import parse_name
    from hetfl.api import make_config
    from hetfl.params import ConfigError

    with pytest.raises(ConfigError) as info:
        parse_name(make_config(None, [assignment]).algorithm.name)
    assert f"did you mean {meant}?" in str(info.value)


@pytest.mark.parametrize(("assignment", "meant"), [("runtime.device=gpu", "'cuda'"),
                                                    ("runtime.device=gpu:1", "'cuda:1'"),
                                                    ("runtime.device=cpuu", "'cpu'"),
                                                    ("model.name=resnet", "'resnet"),
                                                    ("model.name=simplecnn", "'simple_cnn'")])
def test_a_device_or_model_typo_gets_a_did_you_mean(assignment, meant):
    """Not only method and key names: a researcher asking for a 'gpu' or a 'resnet' is told the name hetfl knows."""
    from hetfl.api import make_config
    from hetfl.models import ModelError, build_model
    from hetfl.params import ConfigError

    with pytest.raises((ConfigError, ModelError)) as info:
        cfg = make_config(None, [assignment])
        build_model(cfg.model.name, (1, 28, 28), 10)
    assert f"did you mean {meant}" in str(info.value)


def test_a_setting_of_another_method_names_the_methods_that_take_it():
    """`--set algorithm.mu=0.1` with algorithm.name left at fedavg said only "allowed: (none: this method has no
    settings)"; it names the methods with a mu, so the forgotten algorithm.name is plain."""
    from hetfl.algorithms import hyperparameters
    from hetfl.params import ConfigError

    with pytest.raises(ConfigError) as info:
        hyperparameters("fedavg", {"mu": 0.1})
    assert str(info.value).startswith("algorithm.mu = 0.1: unknown key")
    assert "fedavg has no mu, which is a setting of fedprox, moon" in str(info.value)
    # where the methods come from --methods (hetfl compare), algorithm.name alone pointed at the wrong option
    assert str(info.value).endswith("name the method meant (algorithm.name; hetfl compare: --methods)")
    with pytest.raises(ConfigError) as info:  # a typo of the method's own setting keeps its did-you-mean
        hyperparameters("fedprox", {"muu": 0.1})
    assert "did you mean 'algorithm.mu'?" in str(info.value) and "setting of" not in str(info.value)


def test_a_method_only_a_plugin_defines_says_to_pass_the_plugin():
    from hetfl.algorithms import algorithm_class
    from hetfl.params import ConfigError

    with pytest.raises(ConfigError, match="--plugin FILE"):
        algorithm_class("featnorm_from_no_plugin")


def test_resuming_a_plugin_run_without_its_file_names_the_file_it_recorded():
    """`hetfl run --resume DIR` of a plug-in's run without --plugin said that a plug-in needs --plugin FILE; the
    run's config.toml records the file (algorithm.plugin_source), so the error names it."""
    from hetfl.algorithms import hyperparameters
    from hetfl.params import ConfigError

    with pytest.raises(ConfigError) as info:
        hyperparameters("featnorm_from_no_plugin", {"plugin_source": "my_method.py sha256:" + "0" * 64, "w": 1})
    assert str(info.value).endswith("this run's method came from the plug-in file my_method.py "
                                    "(algorithm.plugin_source): pass --plugin my_method.py")
    from hetfl import config
    from hetfl.engine.experiment import check_config

    resumed = config.load(None, ["algorithm.name=featnorm_from_no_plugin",
                                 "algorithm.plugin_source='my_method.py sha256:00'"])
    with pytest.raises(ConfigError, match=r"pass --plugin my_method\.py$"):  # the run's own check says it too
        check_config(resumed)


def test_a_preset_name_typo_gets_a_did_you_mean():
    from hetfl.params import ConfigError
    from hetfl.reproduce import preset_path

    with pytest.raises(ConfigError, match=r"no such preset; did you mean 'ccvr-table2'\? available: "):
        preset_path("ccvr-tabel2")


# ----------------------------------------------------------------- item 6: a post-hoc step's before and after
def test_the_terminal_summary_shows_the_accuracy_before_and_after_ccvr():
    from rich.console import Console

    from hetfl.cli import summary_table

    summary = {"algorithm": "fedavg+ccvr", "final_global_acc": 0.275, "best_global_acc": 0.275,
               "final_global_acc_before_ccvr": 0.21, "rounds": 3, "wall_time_s": 1.0, "bytes_up_total": 0,
               "bytes_down_total": 0}
    console = Console(width=200, record=True)
    console.print(summary_table(summary))
    text = console.export_text()
    assert "final_global_acc_before_ccvr" in text and "21.00%" in text and "27.50%" in text
    assert "privacy" not in text  # a run without a private release has no budget row


def test_the_terminal_summary_shows_the_budget_the_server_faced():
    from rich.console import Console

    from hetfl.cli import summary_table

    summary = {"algorithm": "fedavg+ccvr", "final_global_acc": 0.275, "best_global_acc": 0.275, "rounds": 3,
               "wall_time_s": 1.0, "bytes_up_total": 0, "bytes_down_total": 0,
               "privacy": {"epsilon": 3.99999, "epsilon_per_upload": 33.7155, "delta": 1e-5, "noise": "distributed",
                           "secure_aggregation": False}}
    console = Console(width=200, record=True)
    console.print(summary_table(summary))
    assert re.search(r"privacy: epsilon \(delta\)\s+│\s+33\.8 per upload \(1e-05\)", console.export_text())
    summary["privacy"]["secure_aggregation"] = True
    console = Console(width=200, record=True)
    console.print(summary_table(summary))
    assert re.search(r"privacy: epsilon \(delta\)\s+│\s+4 \(1e-05\)", console.export_text())  # 3.99999, up


def test_the_comparison_table_shows_the_accuracy_before_a_post_hoc_step():
    with_ccvr = _record("fedavg+ccvr", 0, 0.275)
    with_ccvr.summary["final_global_acc_before_ccvr"] = 0.21
    rows = tables.table_rows([with_ccvr, _record("fedavg", 0, 0.22)], target=None)
    assert rows[0]["final_before_ccvr_mean"] == pytest.approx(0.21) and rows[1]["final_before_ccvr_mean"] is None
    head, _, first, second = tables.to_markdown(rows, None).splitlines()[:4]
    assert "| final before ccvr (%) | final acc (%) |" in head
    assert "| 21.00 | 27.50 |" in first and "| - | 22.00 |" in second


# ----------------------------------------------------------------- item 9: files others can read
@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_a_run_folders_files_follow_the_umask(tmp_path, umask, one_thread):
    import os
    import stat

    import hetfl
    from tests.helpers.runs import TINY

    before = os.umask(umask)
    try:
        hetfl.run(overrides=TINY, out=tmp_path / "r")
    finally:
        os.umask(before)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "r").iterdir() if p.is_file()}
    assert {"config.toml", "metrics.jsonl", "summary.json", "checkpoint.safetensors"} <= set(modes)
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)


# ----------------------------------------------------------------- item 10: piped output is never cut
@pytest.fixture
def piped(monkeypatch):
    """Output to a pipe with no width asked for: pytest-xdist's workers inherit ``COLUMNS=80`` from the
    terminal, which (as documented) would set the width."""
    monkeypatch.delenv("COLUMNS", raising=False)


def test_piped_lists_show_every_name_whole(capsys, piped):
    from hetfl import reproduce
    from hetfl.cli import main

    assert main(["list", "config"]) == 0
    out = capsys.readouterr().out
    assert "runtime.secagg_reconstruction_threshold" in out and "…" not in out
    assert main(["reproduce", "--list"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out and all(name in out for name in reproduce.available())


def test_a_piped_comparison_table_keeps_each_row_on_one_line(tmp_path, monkeypatch, capsys, piped):
    import hetfl.api
    from hetfl.api import CompareResult
    from hetfl.cli import main

    rows = tables.table_rows([_record("fedavg", 0, 0.5, train__lr=0.123456789, data__alpha=0.123456789),
                              _record("fedprox", 0, 0.6, algorithm__mu=0.123456789)], target=0.4)
    markdown = tables.to_markdown(rows, 0.4)
    monkeypatch.setattr(hetfl.api, "run_comparison",
                        lambda *_, **__: CompareResult(tmp_path, [], rows, markdown, 0.4))
    assert main(["compare", "--methods", "fedavg,fedprox", "--seeds", "0", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in markdown.splitlines()) > 80
    assert markdown.strip() in out


# ----------------------------------------------------------------- item 3: the plug-in example shows its effect
def _readme_plugin_example(tmp_path) -> list[str]:
    """README's "Adding a method": its my_method.py written to ``tmp_path``, and its command's arguments."""
    import re
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(# my_method.py\n.*?)```", readme, re.S).group(1)
    (tmp_path / "my_method.py").write_text(code)
    command = next(line for line in readme.splitlines() if line.startswith("hetfl run --plugin my_method.py"))
    return shlex.split(command.replace("my_method.py", str(tmp_path / "my_method.py")))[1:]


def test_the_plugin_example_changes_the_run_and_logs_its_loss_parts(tmp_path, monkeypatch, one_thread):
    from hetfl import algorithms
    from hetfl.cli import main

    monkeypatch.setattr(algorithms, "_CLASSES", dict(algorithms._CLASSES))  # the plug-in registers for this test
    argv = [*_readme_plugin_example(tmp_path), "--set", "train.rounds=2", "--set", "runtime.threads=1", "--quiet"]
    assert "algorithm.weight=0.05" in argv
    off = [a.replace("algorithm.weight=0.05", "algorithm.weight=0") for a in argv]
    assert main([*argv, "--out", str(tmp_path / "on")]) == 0
    assert main([*off, "--out", str(tmp_path / "off")]) == 0
    on_line, off_line = (json.loads((tmp_path / d / "metrics.jsonl").read_text().splitlines()[-1])
                         for d in ("on", "off"))
    assert {"train_ce", "train_penalty"} <= set(on_line)  # the parts the method's loss returns
    assert on_line["train_penalty"] < 0.5 * off_line["train_penalty"]  # the penalty shrinks the features
    assert on_line["global_loss"] != off_line["global_loss"]  # and the model with them


# ----------------------------------------------------------------- item 12: method costs and defaults
def test_the_feduv_preset_runs_the_authors_code_bandwidth_and_says_so():
    from hetfl import reproduce

    preset = reproduce.load_preset("feduv-table1")
    specs = reproduce.run_specs(preset)
    feduv = reproduce.build_config(preset, specs[("FedUV", "stl-a0.01", 0)], [])
    assert feduv.algorithm.params["bandwidth"] == "code"
    assert "bandwidth" in preset.notes and "sigma" in preset.notes


def test_fedbrs_docstring_states_the_authors_latest_defaults():
    from hetfl.algorithms import fedbr

    text = " ".join(fedbr.__doc__.split())
    assert "01dc5c6" in text and "Mixup and Mixture off" in text and "without momentum" in text


def test_a_fedetf_run_says_what_its_personalisation_costs_when_it_starts(tmp_path, one_thread):
    from hetfl.api import make_config
    from hetfl.engine.experiment import Experiment
    from hetfl.engine.summary import Reporter
    from tests.helpers.runs import TINY

    class Notes(Reporter):
        def __init__(self) -> None:
            self.notes: list[str] = []

        def note(self, message: str) -> None:
            self.notes.append(message)

    reporter = Notes()
    cfg = make_config(None, [*TINY, "algorithm.name=fedetf", "model.name=mlp", "train.rounds=1",
                             "algorithm.pers_cycles=1", "algorithm.pers_epochs=1"])
    Experiment(cfg).run(tmp_path / "r", reporter=reporter)
    assert any("algorithm.pers_cycles" in n and "before every evaluation" in n for n in reporter.notes)


# ----------------------------------------------------------------- item 7: cost before a long job
def test_the_counter_estimates_from_the_first_rounds_before_any_run_has_finished():
    from hetfl import sweeps

    times = iter([0.0, 5.0, 6.0, 7.0, 8.0])  # start; round 1 ends (with the set-up), then a round a second
    said: list[str] = []
    runs = [sweeps.PlannedRun("a", 100, "new", rounds=10), sweeps.PlannedRun("b", 100, "new", rounds=10)]
    counter = sweeps.RunCounter(runs, said.append, lambda: next(times))
    assert counter.start(0).endswith("time left known once a run has finished")
    for _ in range(3):
        counter.round_done(0)
    assert said[-1] == "run 1 of 2 (a): about 17 s left (rough: from rounds 2-3 of this run)"
    counter.round_done(0)
    assert len(said) == 2  # said once


def test_compare_prints_the_early_estimate_while_its_first_run_goes_on(tmp_path, capsys, one_thread):
    import hetfl
    from tests.helpers.runs import TINY

    hetfl.compare(["fedavg"], seeds=[0, 1], overrides=[*TINY, "train.rounds=4"], out=tmp_path / "c", progress=True)
    out = capsys.readouterr().out
    assert "run 1 of 2 (fedavg, seed 0): time left known once a run has finished" in out
    assert "left (rough: from rounds 2-3 of this run)" in out


# ----------------------------------------------------------------- item 13: small things
def test_a_one_class_clients_entropy_is_zero_not_minus_zero():
    import math

    import numpy as np

    from hetfl.data.partition_report import _entropy_bits

    value = _entropy_bits(np.array([0, 12, 0]))
    assert value == 0.0 and math.copysign(1.0, value) == 1.0 and str(round(value, 4)) == "0.0"


def test_the_readme_explains_global_against_mean_client_accuracy_and_lists_eval_time():
    from pathlib import Path

    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    assert "`eval_time_s`" in readme
    assert "mean client accuracy is much lower" in readme


# ----------------------------------------------------------------- item 11: the quick CCVR preset
def test_the_quick_ccvr_presets_runs_have_distinct_progress_labels():
    from hetfl import reproduce

    preset = reproduce.load_preset("ccvr-table2").variant(True)
    labels = [reproduce.spec_label(spec) for spec in set(reproduce.run_specs(preset).values())]
    assert len(labels) == len(set(labels))
    assert any("ccvr.oracle=all" in label for label in labels)


def test_a_measured_quick_estimate_is_shown_with_its_machine_and_load(capsys, piped):
    from hetfl import reproduce
    from hetfl.cli import main

    preset = reproduce.load_preset("ccvr-table2")
    assert "busy" in preset.quick_cpu_measured and "idle" in preset.quick_cpu_measured
    assert main(["reproduce", "--list"]) == 0
    assert preset.quick_cpu_measured in capsys.readouterr().out
    _, basis = reproduce.estimate_minutes(preset.variant(True))
    assert preset.quick_cpu_measured in basis


def test_resuming_a_plugin_run_without_the_plugin_says_to_pass_it(tmp_path, monkeypatch, capsys, one_thread):
    from hetfl import algorithms
    from hetfl.cli import main

    monkeypatch.setattr(algorithms, "_CLASSES", dict(algorithms._CLASSES))
    monkeypatch.setattr(algorithms, "_PLUGIN_FILES", dict(algorithms._PLUGIN_FILES))
    argv = [*_readme_plugin_example(tmp_path), "--set", "train.rounds=1", "--set", "runtime.threads=1", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "r")]) == 0
    del algorithms._CLASSES["featnorm"]  # a new process: the plug-in is not loaded
    algorithms._PLUGIN_FILES.clear()
    (tmp_path / "r" / "summary.json").unlink()  # as if interrupted in its last round
    before = sorted(p.name for p in (tmp_path / "r").iterdir())
    capsys.readouterr()
    assert main(["run", "--resume", str(tmp_path / "r")]) == 2
    error = capsys.readouterr().err
    assert "'featnorm'" in error and "--plugin FILE" in error and "resuming" in error
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == before


def test_the_comparison_table_shows_the_budget_each_private_row_spent_as_its_server_faces_it():
    """A private run's accuracy means little without its epsilon: the table's privacy column shows, per row, the
    largest budget over the seeds, per upload where the server saw each upload (rounded up, never down)."""
    def private(seed: int, sum_eps: float, upload_eps: float, secure: bool) -> tables.RunRecord:
        record = _record("fedavg+ccvr", seed, 0.5, algorithm__ccvr__dp_epsilon=4.0)
        record.summary["privacy"] = {"epsilon": sum_eps, "epsilon_per_upload": upload_eps, "delta": 1e-5,
                                     "noise": "distributed", "secure_aggregation": secure,
                                     "covers": "CCVR's per-class statistics"}
        return record

    rows = tables.table_rows([private(0, 3.99, 33.71, False), private(1, 4.0, 33.72, False),
                              _record("fedavg", 0, 0.4)], target=None)
    assert rows[0]["dp_epsilon"] == 33.72 and rows[0]["dp_per_upload"] is True and rows[1]["dp_epsilon"] is None
    head, body = tables.table_cells(rows, None)
    column = head.index("privacy: epsilon (delta)")
    assert [cells[column] for cells in body] == ["33.8 per upload (1e-05)", "none"]
    assert "It covers: CCVR's per-class statistics." in tables.to_markdown(rows, None).replace("\\'", "'")
    secure = tables.table_rows([private(0, 3.99, 33.71, True), private(1, 4.0001, 33.7, True)], target=None)
    head, body = tables.table_cells(secure, None)
    assert body[0][head.index("privacy: epsilon (delta)")] == "4.01 (1e-05)"  # the sum's, rounded up
    lost = _record("fedavg+ccvr", 1, 0.5, algorithm__ccvr__dp_epsilon=4.0)  # the same setting, no release recorded
    (row,) = tables.table_rows([private(0, 3.99, 33.71, True), lost], target=None)
    assert tables.privacy_cell(row) == "no single budget (a seed made no private release)"
    unprivate = tables.table_rows([_record("fedavg", 0, 0.4)], target=None)
    assert "dp_epsilon" not in unprivate[0] and "privacy" not in tables.to_markdown(unprivate, None).lower()


# ----------------------------------------------------------------- audit 2: a plug-in that breaks the interface
_PENALTY_PLUGIN = '''
from dataclasses import dataclass

import torch.nn.functional as F

from hetfl.algorithms import register
from hetfl.algorithms.base import Algorithm
from hetfl.params import setting


@dataclass(frozen=True)
class ClsL2Hyper:
    """weight: L2 penalty on the classifier."""
    weight: float = setting(0.01, ge=0.0, doc="penalty weight")


@register
class ClsL2(Algorithm):
    name = "clsl2"
    Hyper = ClsL2Hyper

    def loss(self, state, batch, ctx):
        ce = F.cross_entropy(self.model.logits(state, batch.x), batch.y)
        pen = sum(state[n].pow(2).sum() for n in self.setup.groups["classifier"])
        return RETURN
'''


@pytest.mark.parametrize("returned, said", [
    ("ce + self.hp.weight * pen", "it returned a Tensor"),  # the parts forgotten
    ('ce + self.hp.weight * pen, {"ce": ce.detach(), "l2": pen.item()}', "its part 'l2' is a float (`.item()`"),
])
@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_a_plugin_loss_that_returns_the_wrong_thing_stops_with_one_line_naming_it(
        tmp_path, monkeypatch, capsys, one_thread, returned, said, executor):
    """A first method written from the README returns the loss alone, or its parts with .item(): the run stops
    with exit 2 and a message naming the hook and the expected return (before: a traceback from the engine,
    "iteration over a 0-d tensor"), and says how to continue once it is fixed."""
    from hetfl import algorithms
    from hetfl.cli import main

    monkeypatch.setattr(algorithms, "_CLASSES", dict(algorithms._CLASSES))
    plugin = tmp_path / "clsl2.py"
    plugin.write_text(_PENALTY_PLUGIN.replace("RETURN", returned))
    out = tmp_path / "r"
    argv = ["run", "--plugin", str(plugin), "--set", "algorithm.name=clsl2", "--set", "model.name=mlp",
            "--set", "train.rounds=1", "--set", f"runtime.executor={executor}", "--set", "runtime.vmap_on_cpu=true",
            "--set", "data.options={max_samples = 150}", "--quiet"]
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "ClsL2.loss (stage 'local') must return (loss, parts)" in err and said in err
    assert f"--resume {out} --plugin {plugin}" in err
    plugin.write_text(_PENALTY_PLUGIN.replace("RETURN", 'ce + self.hp.weight * pen, {"ce": ce.detach()}'))
    assert main(["run", "--resume", str(out), "--plugin", str(plugin), "--quiet"]) == 0  # fixed, it goes on


def test_a_plugin_loss_with_the_wrong_signature_is_refused_when_the_plugin_loads(tmp_path, monkeypatch, capsys):
    from hetfl import algorithms
    from hetfl.cli import main

    monkeypatch.setattr(algorithms, "_CLASSES", dict(algorithms._CLASSES))
    plugin = tmp_path / "clsl2_sig.py"
    plugin.write_text(_PENALTY_PLUGIN.replace("RETURN", "ce, {}").replace("(self, state, batch, ctx)",
                                                                           "(self, state, batch)"))
    assert main(["run", "--plugin", str(plugin), "--set", "algorithm.name=clsl2", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hetfl: error: --plugin {plugin}: ClsL2.loss(self, state, batch) must take "
                          "(self, state, batch, ctx)")
    assert not (tmp_path / "r").exists()



@pytest.mark.parametrize("hyper, said", [
    ('weight: float = setting(0.01, ge=0.0, doc="penalty weight")', None),
    ("weight: float", "ClsL2.Hyper.weight needs a default"),  # before: a TypeError at run, one in hetfl list
])
def test_a_plugin_setting_without_a_default_is_refused_when_the_plugin_loads(tmp_path, monkeypatch, capsys,
                                                                             hyper, said):
    from hetfl import algorithms
    from hetfl.cli import main

    monkeypatch.setattr(algorithms, "_CLASSES", dict(algorithms._CLASSES))
    plugin = tmp_path / "clsl2_hyper.py"
    plugin.write_text(_PENALTY_PLUGIN.replace("RETURN", "ce, {}").replace(
        'weight: float = setting(0.01, ge=0.0, doc="penalty weight")', hyper))
    code = main(["list", "--plugin", str(plugin), "algorithms"])
    if said is None:
        assert code == 0 and "clsl2" in capsys.readouterr().out
    else:
        assert code == 2 and capsys.readouterr().err.startswith(f"hetfl: error: --plugin {plugin}: {said}")


# ----------------------------------------------------------------- audit 2: a method setting in a comparison
def test_compare_gives_a_method_setting_to_the_methods_that_take_it(tmp_path, capsys, one_thread):
    """`hetfl compare --methods fedavg,fedprox --set algorithm.mu=0.1` stopped: "algorithm.mu = 0.1: unknown key"
    (FedAvg's), so FedProx's mu could not be set in a comparison with FedAvg. It goes to FedProx, and says so."""
    from hetfl.cli import main

    out = tmp_path / "cmp"
    argv = ["compare", "--methods", "fedavg,fedprox", "--seeds", "0", "--set", "algorithm.mu=0.1", "--set",
            "train.rounds=1", "--set", "data.options={max_samples = 150}", "--quiet", "--out", str(out)]
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert "algorithm.mu: set for fedprox only (fedavg has no such setting)" in said
    summaries = {m: json.loads((out / f"{m}-seed0" / "summary.json").read_text()) for m in ("fedavg", "fedprox")}
    assert summaries["fedavg"]["config"]["algorithm"] == {"name": "fedavg"}
    assert summaries["fedprox"]["config"]["algorithm"] == {"name": "fedprox", "mu": 0.1}
    # a setting no method takes is still an error, before anything runs
    assert main([*argv[:-1], str(tmp_path / "typo"), "--set", "algorithm.muu=0.1"]) == 2
    assert not (tmp_path / "typo" / "fedavg-seed0").exists()


def test_a_comparison_says_before_its_first_run_which_settings_its_runs_do_not_read(tmp_path, capsys, one_thread):
    """A plan's runs would each say it when they start; the plan says it once, before the first run, per method
    (here CCVR's Tukey beta without its transform)."""
    from hetfl.cli import main

    argv = ["compare", "--methods", "fedavg+ccvr", "--seeds", "0", "--set", "algorithm.ccvr.transform=none",
            "--set", "algorithm.ccvr.tukey_beta=0.3", "--set", "train.rounds=1", "--set",
            "data.options={max_samples = 150}", "--quiet", "--out", str(tmp_path / "cmp")]
    assert main(argv) == 0
    said = " ".join(capsys.readouterr().out.split())
    note = "fedavg+ccvr: algorithm.ccvr.tukey_beta = 0.3 has no effect: it is read only when algorithm.ccvr.transform"
    assert said.count(note) == 1 and said.index(note) < said.index("fedavg+ccvr, seed 0")


def test_a_compare_row_at_chance_is_marked_and_explained():
    """hetfl compare's table marks a row whose final accuracy is within half a point of what its runs' constant
    prediction scores (summary.json's chance_global_acc), as hetfl reproduce does; rows without the value (runs
    from before it, personalised metrics) are not."""
    at, above, old = ([_record(m, s, acc) for s in (0, 1)] for m, acc in
                      (("fedavg", 0.102), ("feduv", 0.2), ("moon", 0.1)))
    for record in [*at, *above]:
        record.summary["chance_global_acc"] = 0.1
    rows = tables.table_rows([*at, *above, *old], target=None)
    assert [(row["method"], row["at_chance"]) for row in rows] == [("fedavg", True), ("feduv", False), ("moon", False)]
    assert rows[0]["chance"] == pytest.approx(0.1) and rows[2]["chance"] is None
    markdown = tables.to_markdown(rows, target=None)
    assert [line.count("(chance)") for line in markdown.splitlines()[2:5]] == [1, 0, 0]
    assert ("(chance): the mean is within 0.5 point of what always predicting the test set's largest class scores "
            "(10.00%)") in markdown
    assert "(chance)" not in tables.to_markdown(rows[1:], target=None)
