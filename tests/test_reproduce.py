"""Reproduction presets: every preset is a valid set of runs; tables are computed right."""

from __future__ import annotations

import json
import math

import pytest

from hetfl import config, reproduce, sweeps
from hetfl.algorithms import hyperparameters, parse_name, step_hyper
from hetfl.cli import main
from hetfl.models import model_options
from hetfl.params import ConfigError, inactive_settings
from tests.helpers.runs import PRESET, fake_run


@pytest.mark.parametrize("name", reproduce.available())
@pytest.mark.parametrize("quick", [False, True])
def test_every_preset_builds_valid_run_configs(name, quick):
    preset = reproduce.load_preset(name).variant(quick)
    specs = reproduce.run_specs(preset)
    assert specs, name
    for spec in set(specs.values()):
        cfg = reproduce.build_config(preset, spec, ["data.root=/nowhere"])
        hyperparameters(cfg.algorithm.name, cfg.algorithm.params)
        assert cfg.seed == spec.seed
        # model options the model takes (a quick variant that swaps the model resets them: "model.options" = {})
        assert set(cfg.model.options) <= set(model_options(cfg.model.name)), (cfg.model.name, cfg.model.options)
    for row in preset.rows:
        assert set(row.paper) <= {c.id for c in reproduce.load_preset(name).columns}, row.label


def test_rows_before_and_after_calibration_share_one_run():
    preset = reproduce.load_preset("ccvr-table2")
    specs = reproduce.run_specs(preset)
    assert specs[("FedAvg", "a0.1", 0)] == specs[("FedAvg + CCVR", "a0.1", 0)]
    assert specs[("FedProx", "a0.05", 0)] != specs[("FedProx", "a0.1", 0)]  # mu 0.01 vs 0.001
    prox = reproduce.build_config(preset, specs[("FedProx", "a0.05", 0)], [])
    assert prox.algorithm.params["mu"] == 0.01 and prox.data.alpha == 0.05
    assert len(set(specs.values())) == 120  # 5 columns x (4 trainers + 4 oracles) x 3 seeds


def test_ccvr_settings_vary_with_row_and_column_as_table_8():
    """Head re-training epochs depend on the method and the column (CCVR Table 8); a row's ``column_set``
    carries them, and the row before calibration keeps sharing its run with the calibrated row."""
    preset = reproduce.load_preset("ccvr-table2")
    specs = reproduce.run_specs(preset)
    epochs = {"FedAvg": (30, 10, 10, 30, 50), "FedProx": (30, 10, 10, 30, 50), "FedAvgM": (50, 10, 10, 10, 50),
              "MOON": (30, 10, 10, 10, 10)}
    columns = ("a0.5", "a0.1", "a0.05", "c100", "cinic10")
    for method, per_column in epochs.items():
        for column, expected in zip(columns, per_column, strict=True):
            assert specs[(method, column, 0)] == specs[(f"{method} + CCVR", column, 0)]
            cfg = reproduce.build_config(preset, specs[(f"{method} + CCVR", column, 0)], [])
            assert cfg.algorithm.params["ccvr"]["epochs"] == expected, (method, column)
    virtual = dict(zip(columns, (100, 2000, 2000, 500, 1000), strict=True))
    for column, m_c in virtual.items():
        cfg = reproduce.build_config(preset, specs[("MOON + CCVR", column, 0)], [])
        assert cfg.algorithm.params["ccvr"]["num_virtual"] == m_c
    c100 = reproduce.build_config(preset, specs[("FedAvg + CCVR", "c100", 0)], [])
    oracle = reproduce.build_config(preset, specs[("FedAvg + oracle calibration", "c100", 0)], [])
    assert c100.algorithm.params["ccvr"]["lr"] == 1e-5 and c100.model.name == "mobilenetv2"
    assert oracle.algorithm.params["ccvr"]["lr"] == 0.001 and oracle.algorithm.params["ccvr"]["epochs"] == 50
    cinic = reproduce.build_config(preset, specs[("FedProx", "cinic10", 0)], [])
    assert cinic.train.batch_size == 512 and cinic.algorithm.params["mu"] == 0.01


@pytest.mark.parametrize("name", reproduce.available())
@pytest.mark.parametrize("quick", [False, True])
def test_no_preset_run_holds_a_setting_its_method_does_not_read(name, quick):
    """A first day's `hetfl reproduce ccvr-table2 --quick` warned four times that algorithm.ccvr.num_virtual =
    2000 has no effect: the column sets it for every row, and the oracle rows calibrate on real features. A
    setting a column (or the preset's base) gives every row is left out of a row whose method does not read
    it, so no run's config.toml holds it and no run warns of it; a row's own setting stays (an inert one
    there is the preset's mistake, and warns)."""
    preset = reproduce.load_preset(name).variant(quick)
    for spec in set(reproduce.run_specs(preset).values()):
        cfg = reproduce.build_config(preset, spec, [])
        _, steps = parse_name(cfg.algorithm.name)
        notes = inactive_settings(hyperparameters(cfg.algorithm.name, cfg.algorithm.params), "algorithm.")
        for step in steps:
            notes += inactive_settings(step_hyper(step, cfg.algorithm.params.get(step, {})), f"algorithm.{step}.")
        assert notes + inactive_settings(cfg.runtime, "runtime.") == [], spec


def test_a_column_setting_an_oracle_row_does_not_read_is_left_out_of_it_only():
    preset = reproduce.load_preset("ccvr-table2")
    specs = reproduce.run_specs(preset)
    ccvr = reproduce.build_config(preset, specs[("FedAvg + CCVR", "a0.1", 0)], [])
    oracle = reproduce.build_config(preset, specs[("FedAvg + oracle calibration", "a0.1", 0)], [])
    assert ccvr.algorithm.params["ccvr"]["num_virtual"] == 2000
    assert "num_virtual" not in oracle.algorithm.params["ccvr"]
    assert oracle.algorithm.params["ccvr"]["epochs"] == 50 and oracle.algorithm.params["ccvr"]["oracle"] == "all"
    # what the user sets is the user's: kept, and the run says it has no effect
    mine = reproduce.build_config(preset, specs[("FedAvg + oracle calibration", "a0.1", 0)],
                                  ["algorithm.ccvr.num_virtual=50"])
    assert mine.algorithm.params["ccvr"]["num_virtual"] == 50
    # a --set that makes the oracle row calibrate on virtual features: the column's number is read again
    virtual = reproduce.build_config(preset, specs[("FedAvg + oracle calibration", "a0.1", 0)],
                                     ["algorithm.ccvr.oracle='none'"])
    assert virtual.algorithm.params["ccvr"]["num_virtual"] == 2000


SHARED_PRESET = """
[preset]
title = "toy"
paper = "nobody"
metric = "final_global_acc"
seeds = [0]
[base.runtime]
flower_timeout_s = 30.0
[[columns]]
id = "c"
label = "C"
set = { "algorithm.proxy_dataset" = "cifar100", "algorithm.ccvr.tukey_beta" = 0.3 }
[[rows]]
label = "proxy"
algorithm = "fedbr+ccvr"
set = { "algorithm.pseudo_source" = "proxy" }
[[rows]]
label = "plain"
algorithm = "fedbr+ccvr"
set = { "algorithm.ccvr.transform" = "none" }
"""


def test_shared_settings_are_left_out_where_the_trainer_its_step_or_the_runtime_does_not_read_them(tmp_path):
    """The trainer's (FedBR's proxy_dataset without pseudo_source = "proxy"), a post-hoc step's (CCVR's
    tukey_beta without its transform) and the runtime's (a Flower timeout in an in-process run) settings that
    the base or the column gives every row: kept where read, left out where not."""
    path = tmp_path / "shared.toml"
    path.write_text(SHARED_PRESET)
    preset = reproduce.load_preset(str(path))
    specs = reproduce.run_specs(preset)
    proxy = reproduce.build_config(preset, specs[("proxy", "c", 0)], [])
    plain = reproduce.build_config(preset, specs[("plain", "c", 0)], [])
    assert proxy.algorithm.params["proxy_dataset"] == "cifar100" and proxy.algorithm.params["ccvr"]["tukey_beta"] == 0.3
    assert "proxy_dataset" not in plain.algorithm.params and "tukey_beta" not in plain.algorithm.params["ccvr"]
    assert proxy.runtime.flower_timeout_s == plain.runtime.flower_timeout_s == 600.0  # the default: not on Flower
    on_flower = reproduce.build_config(preset, specs[("plain", "c", 0)], ["runtime.executor=flower"])
    assert on_flower.runtime.flower_timeout_s == 30.0
    # the user's own --set of a shared setting stays, also with an '=' in its value (its key is before the first)
    mine = reproduce.build_config(preset, specs[("plain", "c", 0)], ["algorithm.proxy_dataset='x=y'"])
    assert mine.algorithm.params["proxy_dataset"] == "x=y"
    assert reproduce.unread_settings(config.load(None, ["algorithm.name=fedavg+ccvr"])) == []  # no step table


def test_a_preset_name_is_refused_with_the_presets_there_are(tmp_path):
    for name in ("a-table", "b-table"):
        (tmp_path / f"{name}.toml").write_text("")
    with pytest.raises(ConfigError) as info:
        reproduce.preset_path("a-tabel", tmp_path)
    assert str(info.value) == ("reproduce NAME = 'a-tabel': no such preset; did you mean 'a-table'? available: "
                               "a-table, b-table")
    with pytest.raises(ConfigError, match=r"available: none$"):
        reproduce.preset_path("a-table", tmp_path / "empty")
    with pytest.raises(ConfigError, match="no such preset"):  # a .toml name that is no file is no preset file
        reproduce.preset_path("missing.toml", tmp_path)


def test_a_metric_without_values_is_nan_and_one_not_in_the_summary_is_named(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"round": 1, "train_loss": 1.0}\n')
    assert math.isnan(reproduce.metric_value(tmp_path, "best5:global_acc"))
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(ConfigError) as info:
        reproduce.metric_value(tmp_path, "final_x")
    assert str(info.value) == f"preset metric = 'final_x': not in {tmp_path / 'summary.json'}"


def test_a_location_or_runtime_set_is_no_change_of_setting_even_with_an_equals_sign_in_its_value():
    assert reproduce.setting_changes(["data.root=/data/a=b", "runtime.threads=2"]) == []
    assert reproduce.setting_changes(["train.lr=0.1", "data.root=x"]) == ["train.lr=0.1"]


def test_the_ordering_counts_pairs_a_point_apart_skips_closer_ones_and_a_tie_is_not_in_order():
    def cell(paper, ours):
        return {"c": {"paper": paper, "ours": ours}}

    # A-B half a point apart: skipped (the first pair: the others are still compared); D-E exactly a point apart
    # (0.01 - 0.0): separated, and tied here, so not in order
    table = {"A": cell(0.5, 0.6), "B": cell(0.505, 0.6), "C": cell(0.515, 0.7), "D": cell(0.0, 0.1),
             "E": cell(0.01, 0.1)}
    order = reproduce.ordering(table, "c")
    assert (order["separated_pairs"], order["in_order"]) == (9, 8)
    assert order["out_of_order"] == [{"above": "E", "below": "D", "paper": [0.01, 0.0], "ours": [0.1, 0.1]}]


def test_an_unused_step_table_is_an_error_not_silently_ignored():
    """Why a column ``set`` of ``algorithm.ccvr.*`` may only be used when every row runs ``+ccvr``."""
    with pytest.raises(ConfigError, match="algorithm.ccvr"):
        hyperparameters("fedavg", {"ccvr": {"epochs": 30}})


def test_table_means_diffs_and_best5(tmp_path):
    path = tmp_path / "toy.toml"
    path.write_text(PRESET)
    preset = reproduce.load_preset(str(path))
    accs = {"fedavg": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], "fedprox": [0.9, 0.1, 0.8, 0.2, 0.7, 0.6]}
    result = reproduce.reproduce(preset, tmp_path / "out", fake_run(accs))
    a, b = result["table"]["A"]["c"], result["table"]["B"]["c"]
    # fractions, as every hetfl file; sample std of 0.60, 0.61
    assert a["ours"] == pytest.approx(0.605) and a["std"] == pytest.approx(0.5 ** 0.5 / 100)
    assert a["diff"] == pytest.approx(0.105) and a["paper"] == pytest.approx(0.5)
    assert b["ours"] == pytest.approx((0.9 + 0.8 + 0.7 + 0.6 + 0.2) / 5 + 0.005)  # 5 best, seed mean
    assert b["paper"] is None
    assert (a["metric"], b["metric"]) == ("final_global_acc", "best5:global_acc")  # each row's own metric
    md = (tmp_path / "out" / "reproduction.md").read_text()
    assert "+10.50" in md and "| U |" in md and f"| 60.50 ± {100 * a['std']:.2f} |" in md
    quick = reproduce.reproduce(preset.variant(True), tmp_path / "q", fake_run(accs))
    assert quick["table"]["A"]["c"]["seeds"] == [0]
    quick_md = (tmp_path / "q" / "reproduction.md").read_text()
    assert "+10.50" not in quick_md  # no diffs for a quick variant
    rows = [line for line in quick_md.splitlines() if line.startswith(("| A |", "| B |"))]
    assert len(rows) == 2 and "| 60.00 |" in rows[0]
    assert not any("±" in row for row in rows)  # one seed: the value alone, no spread


def test_reproduce_command_runs_a_preset_end_to_end(tmp_path, capsys):
    path = tmp_path / "toy.toml"
    path.write_text(PRESET.replace("rounds = 6", "rounds = 2"))
    out = tmp_path / "out"
    assert main(["reproduce", str(path), "--quick", "--out", str(out), "--quiet"]) == 0
    result = json.loads((out / "reproduction.json").read_text())
    assert 0 < result["table"]["A"]["c"]["ours"] <= 1
    assert main(["reproduce", "no-such-preset"]) == 2
    assert "available" in capsys.readouterr().err
    assert main(["reproduce", "--list"]) == 0


def test_a_preset_without_rows_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[preset]\ntitle = "x"\n')
    with pytest.raises(ConfigError, match="preset bad.toml"):
        reproduce.load_preset(str(path))


def test_run_directory_names_are_plain():
    """Overrides become part of a run's folder name: no quotes, slashes or spaces in it."""
    from hetfl.reproduce import load_preset, run_specs

    for name in ("ccvr-table2", "fedbr-table1"):
        for spec in run_specs(load_preset(name)).values():
            assert not set(spec.dirname) & set('"/ '), spec.dirname


def test_ccvr_and_its_oracle_row_train_once_per_trainer():
    """Issue 27, item 11: the quick CCVR preset's 8 runs are 4 trainings; each oracle row and its "X + CCVR"
    row share one (same trainer and settings; only algorithm.ccvr.* differ)."""
    preset = reproduce.load_preset("ccvr-table2").variant(True)
    specs = reproduce.run_specs(preset)
    order = sorted(set(specs.values()), key=lambda s: (s.column, s.seed, s.algorithm, s.overrides))
    configs = [reproduce.build_config(preset, spec, []) for spec in order]
    def training_sources(cfgs):
        return {order[i]: order[j] for i, j in sweeps.training_sources([sweeps.training_key(c) for c in cfgs]).items()}

    sources = training_sources(configs)
    assert len(order) == 8 and len(sources) == 4
    for method in ("FedAvg", "FedProx", "FedAvgM", "MOON"):
        oracle, ccvr = specs[(f"{method} + oracle calibration", "a0.1", 0)], specs[(f"{method} + CCVR", "a0.1", 0)]
        assert sources.get(oracle) == ccvr or sources.get(ccvr) == oracle, method  # one trains, one calibrates
    # a preset run on Flower, or calibrating every round, trains each run itself
    flower = [reproduce.build_config(preset, spec, ["runtime.executor=flower"]) for spec in order]
    assert training_sources(flower) == {}
    every = [reproduce.build_config(preset, spec, ["algorithm.ccvr.every_round=true"]) for spec in order]
    assert training_sources(every) == {}


ORACLE_PRESET = """
[preset]
title = "toy calibration"
paper = "nobody"
metric = "final_global_acc"
seeds = [0]
[base.data]
num_clients = 4
partition = "dirichlet"
alpha = 0.1
[base.model]
name = "mlp"
options = { hidden = [16] }
[base.train]
rounds = 3
local_steps = 5
[[columns]]
id = "c"
label = "C"
[[rows]]
label = "FedAvg"
algorithm = "fedavg+ccvr"
metric = "final_global_acc_before_ccvr"
[[rows]]
label = "FedAvg + CCVR"
algorithm = "fedavg+ccvr"
[[rows]]
label = "FedAvg + oracle"
algorithm = "fedavg+ccvr"
set = { "algorithm.ccvr.oracle" = "all", "algorithm.ccvr.epochs" = 4 }
"""


@pytest.mark.slow  # three runs end to end
def test_reproduce_calibrates_the_oracle_row_on_the_ccvr_runs_training(tmp_path, capsys, monkeypatch):
    """The oracle row's run starts from the CCVR run's training (one training, said in the counter line) and
    its number is the one a run trained itself gives."""
    from hetfl.engine.experiment import Experiment

    path = tmp_path / "toy.toml"
    path.write_text(ORACLE_PRESET)
    trained_in: list = []
    real_run = Experiment.run
    monkeypatch.setattr(Experiment, "run", lambda self, run_dir, **kw: trained_in.append(kw.get("trained"))
                        or real_run(self, run_dir, **kw))
    out = tmp_path / "out"
    assert main(["reproduce", str(path), "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert len(trained_in) == 2 and trained_in[0] is None and trained_in[1] == out / "c" / "fedavg-ccvr-seed0"
    assert "post-hoc steps only, on run 1's training" in " ".join(printed.split())  # wrapped at COLUMNS
    table = json.loads((out / "reproduction.json").read_text())["table"]
    alone = Experiment(reproduce.build_config(reproduce.load_preset(str(path)), reproduce.run_specs(
        reproduce.load_preset(str(path)))[("FedAvg + oracle", "c", 0)], [])).run(tmp_path / "alone")
    assert table["FedAvg + oracle"]["c"]["ours"] == alone["final_global_acc"]
    assert table["FedAvg"]["c"]["ours"] == alone["final_global_acc_before_ccvr"]
    assert table["FedAvg + CCVR"]["c"]["ours"] != table["FedAvg + oracle"]["c"]["ours"]


ORDER_PRESET = PRESET.replace('paper = { "c" = 50.0 }', 'paper = { "c" = 50.0 }\nmetric = "best5:global_acc"').replace(
    '''metric = "best5:global_acc"
[quick]''', '''metric = "best5:global_acc"
paper = { "c" = 60.0 }
[[rows]]
label = "M"
algorithm = "moon"
metric = "best5:global_acc"
paper = { "c" = 60.5 }
[quick]''')


def test_the_ordering_of_rows_is_compared_with_the_papers_on_the_pairs_it_separates(tmp_path):
    """A quick variant gives no differences, so it says how the rows' ordering compares with the paper's:
    of the pairs of rows the paper separates by a point or more (A 50 < B 60, A 50 < M 60.5; B and M are 0.5
    apart, a tie), how many are in the paper's order, and which are not."""
    path = tmp_path / "toy.toml"
    path.write_text(ORDER_PRESET)
    preset = reproduce.load_preset(str(path)).variant(True)
    accs = {"fedavg": [0.5] * 6, "fedprox": [0.4] * 6, "moon": [0.7] * 6}  # B below A: against the paper
    result = reproduce.reproduce(preset, tmp_path / "q", fake_run(accs))
    order = result["ordering"]["c"]
    assert order["separated_pairs"] == 2 and order["in_order"] == 1
    assert order["out_of_order"] == [{"above": "B", "below": "A", "paper": [0.6, 0.5], "ours": [0.4, 0.5]}]
    md = (tmp_path / "q" / "reproduction.md").read_text()
    assert "1 of the 2 pairs of rows the paper separates by 1 point or more are in its order" in md
    assert "B above A in the paper (60.00 against 50.00), below it here (40.00 against 50.00)" in md
    agree = reproduce.reproduce(preset, tmp_path / "q2", fake_run({**accs, "fedprox": [0.6] * 6}))
    assert agree["ordering"]["c"]["in_order"] == 2 and agree["ordering"]["c"]["out_of_order"] == []


def _resolved(name, row, column):
    """The (config, hyper-parameters) a preset's row runs in ``column`` (first seed)."""
    preset = reproduce.load_preset(name)
    cfg = reproduce.build_config(preset, reproduce.run_specs(preset)[(row, column, preset.seeds[0])], [])
    return cfg, hyperparameters(cfg.algorithm.name, cfg.algorithm.params)


@pytest.mark.parametrize(("name", "columns"), [("fedbr-table1", ("rotmnist", "cifar10", "cifar100")),
                                               ("fedbr-table5", ("cifar10-100",))])
def test_fedbr_presets_run_the_baselines_as_the_authors_code(name, columns):
    """FedBR's tables came from LINs-lab/FedBR's code (fedbr/algorithms.py, hparams_registry.py), which the
    presets follow: Mixup's mixing weight Beta(0.2, 0.2) (``mixup_alpha``; the "FedBR + Mixup" row already
    used 0.2), FedMix's lambda 0.1 over means of M = 10 samples, FedProx's mu 0.1 (set in its optimiser's
    step) and MOON's mu 0.01 (tau 0.5), not hetfl's defaults (1.0; 0.05 and 5; 0.01; 1.0)."""
    for column in columns:
        assert _resolved(name, "FedAvg + Mixup", column)[1].alpha == 0.2, column
        fedmix = _resolved(name, "FedMix", column)[1]
        assert (fedmix.lam, fedmix.mash_size) == (0.1, 10), column
        assert _resolved(name, "FedProx", column)[1].mu == 0.1, column
        assert _resolved(name, "FedBR + Mixup" if name == "fedbr-table1" else "FedBR", column)[1].mixup_alpha == 0.2
        if name == "fedbr-table1":
            moon = _resolved(name, "MOON", column)[1]
            assert (moon.mu, moon.temperature) == (0.01, 0.5), column


@pytest.mark.parametrize(("name", "column"), [("fedbr-table1", "cifar10"), ("fedbr-table2", "cifar10"),
                                              ("fedbr-table5", "cifar10-100")])
def test_fedbr_cifar10_columns_train_without_augmentation_as_the_authors_code(name, column):
    """The code's CIFAR-10 loader (fedbr/datasets.py, MultipleEnvironmentCifar10) has its random crop and flip
    commented out (ToTensor only); hetfl's default for 32 px RGB images is crop + flip."""
    preset = reproduce.load_preset(name)
    for (row, col, seed), spec in reproduce.run_specs(preset).items():
        if col == column and seed == preset.seeds[0]:
            assert reproduce.build_config(preset, spec, []).data.augment == "none", row
    cifar100 = _resolved("fedbr-table1", "FedAvg", "cifar100")[0]
    assert cifar100.data.augment == "auto"  # the code's CIFAR-100 loader crops and flips


def test_a_quick_reproduction_gives_no_differences_anywhere_and_records_its_settings(tmp_path):
    """A quick variant's numbers are not the paper's setting: reproduction.json gives no ours - paper
    difference either (only the .md left it out), and it records the [quick] settings it ran with (it
    recorded them for the full preset, where they were not used, and None for the quick run)."""
    path = tmp_path / "toy.toml"
    path.write_text(PRESET.replace("seeds = [0]\n", 'seeds = [0]\nset = { "train.rounds" = 3 }\n'))
    preset = reproduce.load_preset(str(path))
    accs = {"fedavg": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], "fedprox": [0.9, 0.1, 0.8, 0.2, 0.7, 0.6]}
    quick = reproduce.reproduce(preset.variant(True), tmp_path / "q", fake_run(accs))
    saved = json.loads((tmp_path / "q" / "reproduction.json").read_text())
    for result in (quick, saved):
        cell = result["table"]["A"]["c"]
        assert result["quick"] is True and cell["paper"] == pytest.approx(0.5) and cell["diff"] is None
        assert result["quick_settings"] == {"seeds": [0], "set": {"train.rounds": 3}}
    assert "train.rounds = 3" in (tmp_path / "q" / "reproduction.md").read_text()
    full = reproduce.reproduce(preset, tmp_path / "f", fake_run(accs))
    assert full["quick"] is False and full["quick_settings"] is None
    assert full["table"]["A"]["c"]["diff"] == pytest.approx(0.105)


def test_feduv_resnet18_columns_have_the_papers_512_wide_projector():
    """FedUV section 4.1: "For CIFAR-100 and [HAM10000], we used a ResNet-18 ... adding the projector with 512
    neurons" (the small CNN's has 256). The authors' code takes the width from ``--out_dim`` (default 256, the
    STL-10 setting, as its ``--std_coeff`` default 2.5 is lambda = D/4 for 10 classes), so the preset sets it."""
    from hetfl.models import build_model

    preset = reproduce.load_preset("feduv-table1")
    for column, model, width in (("c100-a0.01", "feduv_resnet18", 512), ("c100-a1", "feduv_resnet18", 512),
                                 ("ham", "feduv_resnet18", 512), ("stl-a0.01", "feduv_cnn", 256),
                                 ("pacs", "feduv_cnn", 256)):
        for row in ("FedAvg", "FedUV"):
            cfg = _resolved("feduv-table1", row, column)[0]
            built = build_model(cfg.model.name, (3, 32, 32), 10, **cfg.model.options)
            assert (cfg.model.name, built.classifier.in_features) == (model, width), (row, column)
    assert reproduce.build_config(preset.variant(True), next(iter(reproduce.run_specs(preset.variant(True)).values())),
                                  []).model.options == {}


@pytest.mark.parametrize(("name", "columns"), [("feduv-table1", ("tiny-a0.01", "tiny-a1", "officehome")),
                                               ("feduv-table2", ("oh-r0.25", "oh-r0.5", "oh-r1")),
                                               ("feduv-table3", ("oh-e10", "oh-e20", "oh-e40"))])
def test_feduv_resnet50_columns_run_the_authors_resnet50_with_the_papers_2048_wide_projector(name, columns):
    """FedUV section 4.1: ResNet-50 for Tiny-ImageNet and Office-Home "with 2048 neurons" in the projector; the
    authors' ResNet_50 (sonhamin/FedUV nets/models.py) has a 7x7 stride-2 stem, no max pool and a 2-layer BN
    projector: ``feduv_resnet50``, not hetfl's CIFAR-stem ``resnet50`` without projector (the presets' departure
    until the models audit)."""
    from hetfl.models import build_model

    for column in columns:
        for row in ("FedAvg", "FedUV"):
            cfg = _resolved(name, row, column)[0]
            assert (cfg.model.name, cfg.model.options) == ("feduv_resnet50", {"out_dim": 2048}), (row, column)
    built = build_model("feduv_resnet50", (3, 96, 96), 65, **cfg.model.options)
    assert built.feature_dim == 2048 and built.projector is not None


def test_fedbr_rotatedmnist_runs_the_authors_cnn_and_its_quick_variant_the_cheaper_cnn2():
    """FedBR's RotatedMNIST network is DomainBed's MNIST_CNN (LINs-lab/FedBR fedbr/networks.py): hetfl's
    ``fedbr_cnn`` (the preset ran ``cnn2`` for want of it until the models audit); the quick variant keeps
    ``cnn2``, about a seventeenth of its multiply-adds, so its measured CPU minutes still hold."""
    preset = reproduce.load_preset("fedbr-table1")
    for quick, model in ((False, "fedbr_cnn"), (True, "cnn2")):
        variant = preset.variant(quick)
        specs = reproduce.run_specs(variant)
        names = {reproduce.build_config(variant, spec, []).model.name
                 for (row, column, seed), spec in specs.items() if column == "rotmnist"}
        assert names == {model}, (quick, names)


def test_fedbr_rows_send_one_batch_of_pseudo_samples_as_algorithm_1_and_the_latest_code():
    """|D_p| = B (Algorithm 1; the slides' "32 pseudo-data" are CIFAR-10's batch): the authors' latest code
    (d382a37, train_fed.py) draws ``hparams['batch_size']`` means, 64 for RotatedMNIST (its first commit
    hard-coded 32)."""
    for name, rows, columns in (("fedbr-table1", ("FedBR", "FedBR + Mixup"), ("rotmnist", "cifar10", "cifar100")),
                                ("fedbr-table2", ("FedBR (32 pseudo)",), ("cifar10",)),
                                ("fedbr-table5", ("FedBR",), ("cifar10-100",))):
        for row in rows:
            for column in columns:
                cfg, hp = _resolved(name, row, column)
                expected = 64 if column == "rotmnist" else 32
                assert (hp.num_pseudo or cfg.train.batch_size) == expected == cfg.train.batch_size, (name, row, column)


@pytest.mark.parametrize("name", ["fedbr-table1", "fedbr-table2", "fedbr-table5"])
def test_fedbr_best5_is_taken_over_evaluations_every_2_rounds_as_the_code(name):
    """FedBR's metric is the mean of the 5 best accuracies over rounds; the code (train_fed.py) evaluates every
    CHECKPOINT_FREQ = 100 steps, every 2 rounds of 50 steps, so the 5 best come from 500 evaluations in 1000
    rounds. Evaluating every 10 rounds drew them from 100, which lowers the best-5 mean of a noisy curve."""
    preset = reproduce.load_preset(name)
    assert preset.metric.startswith("best5:")
    for spec in set(reproduce.run_specs(preset).values()):
        cfg = reproduce.build_config(preset, spec, [])
        assert (cfg.train.eval_every, cfg.train.local_steps) == (2, 50), spec


def test_a_set_that_changes_the_papers_setting_removes_the_differences_and_is_recorded(tmp_path):
    """``hetfl reproduce NAME --set train.rounds=3`` is not the paper's setting: its files said nothing of the
    override and gave ours - paper as for the preset. Now every --set is recorded, and one that changes the
    setting (anything but where the data are and runtime.*) gives no differences, as a quick variant."""
    path = tmp_path / "toy.toml"
    path.write_text(PRESET)
    preset = reproduce.load_preset(str(path))
    accs = {"fedavg": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], "fedprox": [0.9, 0.1, 0.8, 0.2, 0.7, 0.6]}
    changed = reproduce.reproduce(preset, tmp_path / "c", fake_run(accs), ["train.rounds=3", "data.root=/x"])
    assert changed["table"]["A"]["c"]["diff"] is None and changed["table"]["A"]["c"]["paper"] == pytest.approx(0.5)
    assert changed["user_set"] == ["train.rounds=3", "data.root=/x"]
    assert changed["setting_changed"] == ["train.rounds=3"]
    md = (tmp_path / "c" / "reproduction.md").read_text()
    assert "+10.50" not in md and "train.rounds=3" in md and "not the paper's setting" in md
    located = reproduce.reproduce(preset, tmp_path / "l", fake_run(accs),
                                  ["data.root=/x", "data.cache_dir=/y", "runtime.threads=1"])
    assert located["setting_changed"] == [] and located["table"]["A"]["c"]["diff"] == pytest.approx(0.105)
    assert "not the paper's setting" not in (tmp_path / "l" / "reproduction.md").read_text()


@pytest.mark.parametrize(("name", "column"), [("fedbr-table1", "cifar10"), ("fedbr-table2", "cifar10"),
                                              ("fedbr-table5", "cifar10-100")])
def test_fedbr_vgg11_is_the_codes_9_2_million_parameter_network(name, column):
    """FedBR's VGG-11 (code: fedbr/networks.py CIFAR_Vgg, torchvision's vgg11 features, global average pool, one
    linear classifier; slides Table 7: 9.2 M parameters with FedAvg), not FedMA's with two hidden fc layers
    (9.75 M)."""
    from hetfl.models import build_model

    preset = reproduce.load_preset(name)
    for (row, col, seed), spec in reproduce.run_specs(preset).items():
        if col == column and seed == preset.seeds[0]:
            cfg = reproduce.build_config(preset, spec, [])
            model = build_model(cfg.model.name, (3, 32, 32), 10, **cfg.model.options)
            assert sum(p.numel() for p in model.parameters()) == 9_225_610, row


def test_fedbr_table5_runs_feddecorr_as_fedbrs_code_did():
    """Table 5's FedDecorr number came from FedBR's code (fedbr/algorithms.py FedDeCorr.new_loss): features
    standardised per dimension, K = Z^T Z / N, loss mean(K^2) = ||K||_F^2 / d^2, beta 0.1: hetfl's "paper"
    form, not FedDecorr's own code's form (about N times stronger at the same beta)."""
    import torch

    from hetfl.algorithms.feddecorr import decorrelation_loss

    hp = _resolved("fedbr-table5", "FedDecorr", "cifar10-100")[1]
    assert (hp.form, hp.beta) == ("paper", 0.1)
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(32, 8, generator=gen) @ torch.randn(8, 8, generator=gen)  # correlated features
    code = (z - z.mean(0)) / (z.std(0) + 1e-4)  # FedBR's new_loss, verbatim
    fedbr = ((code.t() @ code / len(z)) ** 2).mean()
    assert decorrelation_loss(z, hp.eps, hp.form).item() == pytest.approx(fedbr.item(), rel=0.08)


def test_a_cell_with_diverged_seeds_counts_them_in_every_output(tmp_path):
    """A seed whose train loss became inf stays in the cell's mean (dropping it would flatter the method), and
    the cell says how many of its seeds diverged, as hetfl compare's tables do (tables.diverged_count)."""
    path = tmp_path / "toy.toml"
    path.write_text(PRESET)
    preset = reproduce.load_preset(str(path))
    accs = {"fedavg": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], "fedprox": [0.9, 0.1, 0.8, 0.2, 0.7, 0.6]}
    base = fake_run(accs)

    def run(cfg, run_dir, resume):
        base(cfg, run_dir, resume)
        if cfg.algorithm.name == "fedavg" and cfg.seed == 1:  # seed 1 of row A diverged in round 3
            summary = json.loads((run_dir / "summary.json").read_text())
            (run_dir / "summary.json").write_text(json.dumps({**summary, "diverged_round": 3}))

    result = reproduce.reproduce(preset, tmp_path / "out", run)
    assert result["table"]["A"]["c"]["diverged"] == 1 and result["table"]["B"]["c"]["diverged"] == 0
    assert result["table"]["A"]["c"]["ours"] == pytest.approx(0.605)  # still in the mean
    saved = json.loads((tmp_path / "out" / "reproduction.json").read_text())
    assert saved["table"]["A"]["c"]["diverged"] == 1
    md = (tmp_path / "out" / "reproduction.md").read_text()
    row_a = next(line for line in md.splitlines() if line.startswith("| A |"))
    row_b = next(line for line in md.splitlines() if line.startswith("| B |"))
    assert "1 of 2 diverged" in row_a and "diverged" not in row_b
    assert "Diverged:" in md  # what the count means


def test_a_reproduction_without_diverged_seeds_says_nothing_of_divergence(tmp_path):
    path = tmp_path / "toy.toml"
    path.write_text(PRESET)
    accs = {"fedavg": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], "fedprox": [0.9, 0.1, 0.8, 0.2, 0.7, 0.6]}
    reproduce.reproduce(reproduce.load_preset(str(path)), tmp_path / "out", fake_run(accs))
    assert "iverged" not in (tmp_path / "out" / "reproduction.md").read_text()


# ----------------------------------------------------------------------------------- FedPAC's Table 1, all columns
#: FedPAC's EMNIST groups (JianXu95/FedPAC, data_loader.py emnist_noniid_s): digits, upper case, lower case of byclass
FEDPAC_EMNIST_GROUPS = [list(range(10)), list(range(10, 36)), list(range(36, 62))]
#: per column of fedpac-table1, from the authors' code: dataset, its loader options, clients, train / test samples
#: per client, the listed groups ([] = the 5 consecutive groups of 3), reuse of short classes, lr, batch, convs of
#: fedpac_cnn (data_loader.py, federated_main.py, options.py; batch 100 for EMNIST: the paper, Flower's config)
FEDPAC_COLUMNS = {
    "emnist-20": ("emnist", {"split": "byclass"}, 20, 1000, 600, FEDPAC_EMNIST_GROUPS, False, 0.01, 100, 2),
    "emnist-100": ("emnist", {"split": "byclass"}, 100, 1000, 600, FEDPAC_EMNIST_GROUPS, True, 0.01, 100, 2),
    "fmnist-20": ("fmnist", {}, 20, 600, 600, [], False, 0.01, 50, 2),
    "fmnist-100": ("fmnist", {}, 100, 600, 600, [], True, 0.01, 50, 2),
    "cifar10-20": ("cifar10", {}, 20, 600, 300, [], False, 0.02, 50, 3),
    "cifar10-100": ("cifar10", {}, 100, 600, 300, [], True, 0.02, 50, 3),
    "cinic10-20": ("cinic10", {}, 20, 600, 300, [], False, 0.02, 50, 3),
    "cinic10-100": ("cinic10", {}, 100, 600, 300, [], True, 0.02, 50, 3),
}
#: (input shape, classes) of each dataset and fedpac_cnn's parameters there (models/paper_cnns.py: the code's
#: CNN_FMNIST with 62 / 10 classes, CifarCNN)
FEDPAC_MODELS = {"emnist": ((1, 28, 28), 62, 123_774), "fmnist": ((1, 28, 28), 10, 117_066),
                 "cifar10": ((3, 32, 32), 10, 107_690), "cinic10": ((3, 32, 32), 10, 107_690)}


def test_fedpac_table1_runs_each_column_as_the_authors_code():
    """Every row of every column gets its column's dataset (EMNIST's byclass split), clients (all of them every
    round: the code's --frac 1.0), samples per client, groups, lr, batch and CNN (no conv64 for 1-channel sets),
    with the settings all columns share (200 rounds, E = 5, momentum 0.5, wd 5e-4, s = 20%)."""
    from hetfl.models import build_model

    preset = reproduce.load_preset("fedpac-table1")
    assert [c.id for c in preset.columns] == list(FEDPAC_COLUMNS)
    assert [(r.label, r.algorithm) for r in preset.rows] == [
        (r.label, r.algorithm) for r in reproduce.load_preset("fedpac-cifar10").rows]
    built = {}
    for (row, column, _seed), spec in reproduce.run_specs(preset).items():
        cfg = reproduce.build_config(preset, spec, [])
        dataset, options, clients, train, test, groups, reuse, lr, batch, convs = FEDPAC_COLUMNS[column]
        d, t = cfg.data, cfg.train
        assert (d.dataset, d.options, d.partition, d.num_clients) == (dataset, options, "dominant", clients), column
        assert (d.samples_per_client, d.test_per_client, d.uniform_share) == (train, test, 0.2), column
        assert (d.group_classes, d.reuse_samples, d.dominant_groups, d.classes_per_group) == (groups, reuse, 5, 3)
        assert (t.lr, t.batch_size, t.clients_per_round, t.rounds, t.local_epochs) == (lr, batch, 0, 200, 5), column
        assert (t.momentum, t.weight_decay) == (0.5, 5e-4)
        shape, classes, count = FEDPAC_MODELS[dataset]
        key = (cfg.model.name, str(cfg.model.options), dataset)
        if key not in built:  # one model per column's setting: building one for each of the 360 runs is slow
            model = build_model(cfg.model.name, shape, classes, **cfg.model.options)
            built[key] = (cfg.model.name, model.convs, sum(p.numel() for p in model.parameters()))
        assert built[key] == ("fedpac_cnn", convs, count), (row, column)


def test_fedpac_table1_cifar10_column_is_the_fedpac_cifar10_preset():
    """Users' scripts run fedpac-cifar10: its runs are the CIFAR-10 / 20-client column's, configuration for
    configuration (resolved for a CIFAR-10-shaped dataset as a run resolves them) and folder for folder, so either
    preset reuses the other's finished runs."""
    import torch

    from hetfl.config import to_tree
    from hetfl.data.base import Dataset, DatasetInfo, Split
    from hetfl.engine.setup import resolve

    split = Split(torch.zeros(10, 3, 32, 32, dtype=torch.uint8), torch.arange(10))
    cifar = Dataset(DatasetInfo("cifar10", tuple(map(str, range(10))), (3, 32, 32)), split, split)
    table, alone = reproduce.load_preset("fedpac-table1"), reproduce.load_preset("fedpac-cifar10")
    assert alone.seeds == table.seeds and [c.id for c in alone.columns] == ["cifar10-20"]
    specs = reproduce.run_specs(table)
    for key, spec in reproduce.run_specs(alone).items():
        assert specs[key] == spec and specs[key].dirname == spec.dirname, key
        ours, theirs = (reproduce.build_config(p, spec, ["data.root=/x"]) for p in (table, alone))
        assert to_tree(ours) == to_tree(theirs), key
        assert to_tree(resolve(ours, cifar)) == to_tree(resolve(theirs, cifar)), key


@pytest.mark.parametrize(("column", "per_class"), [("fmnist-100", (6000, 1000)), ("cifar10-100", (5000, 1000)),
                                                   ("cinic10-100", (9000, 9000)), ("cifar10-20", (5000, 1000)),
                                                   ("fmnist-20", (6000, 1000))])
def test_fedpac_table1_partitions_can_be_made_with_each_datasets_class_sizes(column, per_class):
    """100 clients of 600 need 7,600 samples of each class two groups share: more than CIFAR-10's 5,000 and
    FMNIST's 6,000, so those columns hand samples out again as the authors' code (data.reuse_samples); every
    client still gets its 600 (EMNIST byclass's per-class sizes are not checked here)."""
    import torch

    from hetfl.data.base import Dataset, DatasetInfo, Split
    from hetfl.engine.setup import build_partition

    preset = reproduce.load_preset("fedpac-table1")
    cfg = reproduce.build_config(preset, reproduce.run_specs(preset)[("FedPAC", column, 0)], [])
    train, test = (torch.arange(10).repeat_interleave(n) for n in per_class)
    dataset = Dataset(DatasetInfo(cfg.data.dataset, tuple(map(str, range(10))), (1, 1, 1)),
                      Split(torch.zeros(len(train), 1, 1, 1, dtype=torch.uint8), train),
                      Split(torch.zeros(len(test), 1, 1, 1, dtype=torch.uint8), test))
    part = build_partition(cfg, dataset)
    assert [len(p) for p in part.train] == [cfg.data.samples_per_client] * cfg.data.num_clients
    assert [len(p) for p in part.test] == [cfg.data.test_per_client] * cfg.data.num_clients


def test_fedpac_table1_quick_variant_runs_the_fmnist_column_on_mnist():
    """The development machines have MNIST, not FMNIST: the quick variant keeps the FMNIST column's CNN, lr, batch
    and groups on MNIST's identical format, and says so in its [quick] settings."""
    preset = reproduce.load_preset("fedpac-table1").variant(True)
    assert [c.id for c in preset.columns] == ["fmnist-20"] and preset.seeds == [0]
    for spec in set(reproduce.run_specs(preset).values()):
        cfg = reproduce.build_config(preset, spec, [])
        assert (cfg.data.dataset, cfg.model.options, cfg.train.lr, cfg.train.batch_size) == ("mnist", {"convs": 2},
                                                                                              0.01, 50)
        assert (cfg.data.test_per_client, cfg.data.group_classes, cfg.train.rounds) == (600, [], 5)
    assert preset.quick["set"]["data.dataset"] == "mnist"


@pytest.mark.parametrize("name", ["fedpac-cifar10", "fedpac-table1"])
def test_fedpac_presets_run_pfedme_with_an_inner_step_that_learns_on_fedpacs_cnn(name):
    """hetfl's default inner step (0.1, pFedMe's MNIST MLP) diverges on FedPAC's CNN (NaN from round 1, or stuck
    at the dominant classes: benchmarks/results/pfedme_fedpac_cnn.md); the presets run 0.01, which learns."""
    preset = reproduce.load_preset(name)
    specs = [s for s in set(reproduce.run_specs(preset).values()) if s.algorithm == "pfedme"]
    assert specs
    for spec in specs:
        cfg = reproduce.build_config(preset, spec, ["data.root=/nowhere"])
        assert cfg.algorithm.params["personal_lr"] == 0.01


COLUMN_QUICK_PRESET = PRESET.replace('''[[rows]]
label = "A"''', '''[[columns]]
id = "d"
label = "D"
set = { "train.local_epochs" = 4 }
[[rows]]
label = "A"''').replace("[quick]\nseeds = [0]\n", '''[quick]
seeds = [0]
set = { "train.rounds" = 2 }
column_set = { "d" = { "train.local_epochs" = 2, "train.rounds" = 3 } }
''')


def test_a_quick_variant_can_scale_a_setting_per_column(tmp_path):
    """A table that varies a cost setting per column (FedUV Table 3: E = 10 / 20 / 40) keeps the variation in its
    quick variant only with per-column quick values: ``[quick] column_set`` applies after the quick ``set``, to
    its column only, and the outputs record it. Before, the key was silently ignored (column d kept E = 4)."""
    path = tmp_path / "toy.toml"
    path.write_text(COLUMN_QUICK_PRESET)
    preset = reproduce.load_preset(str(path))
    quick = preset.variant(True)
    specs = reproduce.run_specs(quick)
    c = reproduce.build_config(quick, specs[("A", "c", 0)], [])
    d = reproduce.build_config(quick, specs[("A", "d", 0)], [])
    assert (c.train.local_epochs, c.train.rounds) == (1, 2)
    assert (d.train.local_epochs, d.train.rounds) == (2, 3)
    full = reproduce.build_config(preset, reproduce.run_specs(preset)[("A", "d", 0)], [])
    assert (full.train.local_epochs, full.train.rounds) == (4, 6)  # the full preset is untouched
    accs = {"fedavg": [0.5] * 6, "fedprox": [0.4] * 6}
    reproduce.reproduce(quick, tmp_path / "q", fake_run(accs))
    assert 'column_set = {"d": {"train.local_epochs": 2, "train.rounds": 3}}' in (
        tmp_path / "q" / "reproduction.md").read_text()


@pytest.mark.parametrize(("quick", "key"), [('columns = ["c", "x"]', "[quick] columns"),
                                            ('column_set = { "x" = { "train.rounds" = 1 } }', "[quick] column_set")])
def test_a_quick_table_naming_an_unknown_column_is_a_clear_error(tmp_path, quick, key):
    """A misspelt column id in ``[quick]`` named no column: ``columns`` silently dropped it (a quick run of fewer
    columns than meant) and ``column_set`` would never apply. Now load_preset names the key, the id and the ids."""
    path = tmp_path / "toy.toml"
    path.write_text(PRESET.replace("[quick]\nseeds = [0]\n", f"[quick]\nseeds = [0]\n{quick}\n"))
    with pytest.raises(ConfigError) as err:
        reproduce.load_preset(str(path))
    assert key in str(err.value) and "'x'" in str(err.value) and "columns are c" in str(err.value)


def _tree(name, row, column):
    """The run configuration (as a tree) of a preset's ``row`` in ``column``, first seed."""
    from hetfl import config as config_mod

    return config_mod.to_tree(_resolved(name, row, column)[0])


def _without(tree, *keys):
    """``tree`` with the dotted ``keys`` removed (the settings a table varies)."""
    import copy

    tree = copy.deepcopy(tree)
    for key in keys:
        *parents, last = key.split(".")
        node = tree
        for part in parents:
            node = node[part]
        del node[last]
    return tree


#: the new presets' columns -> (their sibling preset's column, the keys the new table varies)
SIBLING_COLUMNS = {
    "ccvr-table4": ("ccvr-table2", {"n10": "a0.1", "n50": "a0.1", "n100": "a0.1"},
                    ("data.num_clients", "train.clients_per_round")),
    "feduv-table2": ("feduv-table1", {"stl-r0.1": "stl-a0.01", "stl-r0.5": "stl-a0.01", "stl-r1": "stl-a0.01",
                                      "oh-r0.25": "officehome", "oh-r0.5": "officehome", "oh-r1": "officehome"},
                     ("train.clients_per_round", "train.rounds")),
    "feduv-table3": ("feduv-table1", {"stl-e10": "stl-a0.01", "stl-e20": "stl-a0.01", "stl-e40": "stl-a0.01",
                                      "oh-e10": "officehome", "oh-e20": "officehome", "oh-e40": "officehome"},
                     ("train.local_epochs",)),
}


@pytest.mark.parametrize("name", sorted(SIBLING_COLUMNS))
def test_a_table_presets_settings_are_its_siblings_but_the_varied_ones(name):
    """CCVR Table 4 and FedUV Tables 2 and 3 vary one setting of a column of CCVR Table 2 / FedUV Table 1 (N; rho;
    E): every run of theirs is the sibling's run of the same row and column but for those keys (models,
    optimiser, Table 8's CCVR settings, FedUV's bandwidth "code", ...), so a fix to one preset must reach both."""
    sibling, columns, varied = SIBLING_COLUMNS[name]
    preset = reproduce.load_preset(name)
    assert [c.id for c in preset.columns] == list(columns)
    for row in preset.rows:
        for column, theirs in columns.items():
            assert _without(_tree(name, row.label, column), *varied) == \
                _without(_tree(sibling, row.label, theirs), *varied), (row.label, column)


@pytest.mark.parametrize("name", sorted(SIBLING_COLUMNS))
def test_a_table_preset_has_a_published_number_in_every_cell(name):
    """The three tables print every cell (CCVR Table 4: 6 rows x 3; FedUV Tables 2 and 3: 5 rows x 6)."""
    preset = reproduce.load_preset(name)
    assert len(preset.rows) == (6 if name == "ccvr-table4" else 5)
    for row in preset.rows:
        assert sorted(row.paper) == sorted(c.id for c in preset.columns), row.label
        assert all(0 < value < 100 for value in row.paper.values()), row.label


def test_ccvr_table4_varies_the_number_of_clients_and_trains_10_a_round():
    """D.5: N = 10 / 50 / 100; Table 8's "clients per round: 10" (U for N > 10, stated in the notes): all 10 at
    N = 10 (ccvr-table2's a0.1 run), 10 sampled at N = 50 and 100. Each row before calibration reads its
    "+ CCVR" row's run."""
    expected = {"n10": (10, 0), "n50": (50, 10), "n100": (100, 10)}
    preset = reproduce.load_preset("ccvr-table4")
    specs = reproduce.run_specs(preset)
    for method in ("FedAvg", "FedProx", "MOON"):
        for column, (clients, per_round) in expected.items():
            cfg = _resolved("ccvr-table4", f"{method} + CCVR", column)[0]
            assert (cfg.data.num_clients, cfg.train.clients_per_round) == (clients, per_round), (method, column)
            assert specs[(method, column, 0)] == specs[(f"{method} + CCVR", column, 0)]
    assert _tree("ccvr-table4", "MOON", "n10") == _tree("ccvr-table2", "MOON", "a0.1")
    assert len(set(specs.values())) == 27  # 3 columns x 3 trainers x 3 seeds


def test_feduv_table2_samples_rho_of_the_clients_for_the_rounds_of_the_text():
    """rho = 0.1 / 0.5 / 1.0 of STL-10's 10 clients (1 / 5 / all) and 0.25 / 0.5 / 1.0 of Office-Home's 4 (1 / 2 /
    all: the paper's "1 client participating", "2 clients"), as the code's int(n_parties x sample_fraction);
    "100 aggregation rounds for STL-10 and 60 for Office-Home" (Table 1's Office-Home: 40)."""
    expected = {"stl-r0.1": (10, 1, 100), "stl-r0.5": (10, 5, 100), "stl-r1": (10, 0, 100),
                "oh-r0.25": (4, 1, 60), "oh-r0.5": (4, 2, 60), "oh-r1": (4, 0, 60)}
    for row in ("FedAvg", "FedUV"):
        for column, values in expected.items():
            cfg = _resolved("feduv-table2", row, column)[0]
            assert (cfg.data.num_clients, cfg.train.clients_per_round, cfg.train.rounds) == values, (row, column)
    assert _tree("feduv-table2", "FedUV", "stl-r1") == _tree("feduv-table1", "FedUV", "stl-a0.01")


def test_feduv_table3_varies_the_local_epochs_and_its_quick_variant_keeps_their_ratio():
    """E = 10 / 20 / 40 at the default rounds (STL-10 100, Office-Home 40); the quick variant keeps the 1 : 2 : 4
    ratio as 5 / 10 / 20 local steps ([quick] column_set), where one quick E would have erased the table's
    variation."""
    for row in ("FedAvg", "MOON", "FedUV"):
        for column, epochs, rounds in (("stl-e10", 10, 100), ("stl-e20", 20, 100), ("stl-e40", 40, 100),
                                       ("oh-e10", 10, 40), ("oh-e20", 20, 40), ("oh-e40", 40, 40)):
            cfg = _resolved("feduv-table3", row, column)[0]
            assert (cfg.train.local_epochs, cfg.train.local_steps, cfg.train.rounds) == (epochs, 0, rounds), column
    quick = reproduce.load_preset("feduv-table3").variant(True)
    specs = reproduce.run_specs(quick)
    steps = {c: reproduce.build_config(quick, specs[("FedUV", c, 0)], []).train.local_steps for c in
             ("stl-e10", "stl-e20", "stl-e40")}
    assert steps == {"stl-e10": 5, "stl-e20": 10, "stl-e40": 20}


def test_a_rows_column_set_naming_an_unknown_column_is_a_clear_error(tmp_path):
    """A row's ``column_set`` (CCVR's head epochs per method and column) keyed by a misspelt column id never
    applied, silently: the cell ran the row's plain settings. Now load_preset names the row, the id and the ids."""
    path = tmp_path / "toy.toml"
    path.write_text(PRESET.replace('algorithm = "fedprox"\n',
                                   'algorithm = "fedprox"\ncolumn_set = { "cc" = { "algorithm.mu" = 0.1 } }\n'))
    with pytest.raises(ConfigError) as err:
        reproduce.load_preset(str(path))
    assert "[[rows]] 'B' column_set" in str(err.value) and "'cc'" in str(err.value)
    assert "columns are c" in str(err.value)


def test_a_cell_at_chance_says_so_in_every_output(tmp_path):
    """FedUV's quick tables showed four baselines at exactly 10.00%, a global model that predicts one class, as if
    they were results to order; a cell within half a point of its runs' chance accuracy (summary.json's
    chance_global_acc, the test set's largest class share) is now marked, and the ordering says how many rows
    are at chance."""
    path = tmp_path / "toy.toml"
    with_b = 'metric = "best5:global_acc"\npaper = { "c" = 40.0 }'  # row B published too: one pair to order
    path.write_text(PRESET.replace('metric = "best5:global_acc"', with_b))
    accs = {"fedavg": [0.1, 0.1, 0.1, 0.1, 0.1, 0.098], "fedprox": [0.3, 0.4, 0.5, 0.6, 0.7, 0.6]}
    base = fake_run(accs)

    def run(cfg, run_dir, resume):
        base(cfg, run_dir, resume)
        summary = json.loads((run_dir / "summary.json").read_text())
        (run_dir / "summary.json").write_text(json.dumps({**summary, "chance_global_acc": 0.1}))

    result = reproduce.reproduce(reproduce.load_preset(str(path)), tmp_path / "out", run)
    a, b = result["table"]["A"]["c"], result["table"]["B"]["c"]
    assert (a["chance"], a["at_chance"]) == (pytest.approx(0.1), True)  # 0.098 and 0.108: mean 0.103
    assert (b["chance"], b["at_chance"]) == (pytest.approx(0.1), False)
    md = (tmp_path / "out" / "reproduction.md").read_text()
    row_a = next(line for line in md.splitlines() if line.startswith("| A |"))
    row_b = next(line for line in md.splitlines() if line.startswith("| B |"))
    assert "10.30 ± 0.71 (chance)" in row_a and "chance" not in row_b
    assert ("(chance): the mean is within 0.5 point of what always predicting the test set's largest class scores "
            "(10.00%)") in md
    assert ("C: 0 of the 1 pairs of rows the paper separates by 1 point or more are in its order here. 1 of its rows "
            "is at chance (A).") in md
    assert json.loads((tmp_path / "out" / "reproduction.json").read_text())["table"]["A"]["c"]["at_chance"] is True


@pytest.mark.parametrize(("metric", "expected"), [("final_global_acc", 0.25), ("best_global_acc", 0.25),
                                                  ("best5:global_acc", 0.25), ("final_client_acc_mean", None),
                                                  ("final_global_acc_before_ccvr", 0.25),
                                                  ("best5:global_acc_before_ccvr", 0.25),
                                                  ("best5:client_acc_mean", None), ("final_train_loss", None)])
def test_chance_is_read_for_global_accuracies_only(tmp_path, metric, expected):
    """The global test set's accuracy at chance holds for every global accuracy, also the model's before a
    post-hoc step (CCVR's Table 2 rows without CCVR: a first-day run found them never marked)."""
    (tmp_path / "summary.json").write_text(json.dumps({"chance_global_acc": 0.25}))
    assert reproduce.chance_value(tmp_path, metric) == expected
    (tmp_path / "summary.json").write_text(json.dumps({}))  # a run from before hetfl recorded it
    assert reproduce.chance_value(tmp_path, metric) is None
