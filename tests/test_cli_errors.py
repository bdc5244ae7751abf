"""Bad input: each case exits with code 2, prints one clear line, and writes nothing."""

from __future__ import annotations

import pytest

from hetfl.cli import main

QUICK = ["--set", "train.rounds=1", "--quiet"]


def _checkpoint_garbage(tmp_path):
    run = tmp_path / "old"
    run.mkdir()
    (run / "config.toml").write_text('[train]\nrounds = 2\n[runtime]\nprogress = false\n')
    (run / "checkpoint.safetensors").write_bytes(b"\x00\x01 not a checkpoint")
    return ["run", "--resume", str(run)]


def _out_exists(tmp_path):
    out = tmp_path / "used"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    return ["run", "--out", str(out), *QUICK]


def _bad_toml(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[train\nlr = 1\n")
    return ["run", str(path)]


CASES = {
    "unknown key": (["--set", "train.lrr=0.1"], "train.lrr"),
    "negative lr": (["--set", "train.lr=-0.1"], "train.lr"),
    "alpha <= 0": (["--set", "data.alpha=0"], "data.alpha"),
    "zero rounds": (["--set", "train.rounds=0"], "train.rounds"),
    "unknown algorithm": (["--set", "algorithm.name=fedfoo"], "algorithm.name"),
    "unknown post-hoc step": (["--set", "algorithm.name=fedavg+foo"], "algorithm.name"),
    "a post-hoc step named as the method": (["--set", "algorithm.name=ccvr"], "e.g. fedavg+ccvr"),
    "a post-hoc step before the method": (["--set", "algorithm.name=ccvr+fedavg"], "e.g. fedavg+ccvr"),
    "unknown method setting": (["--set", "algorithm.name=fedprox", "--set", "algorithm.muu=1"], "algorithm.muu"),
    "bad method setting": (["--set", "algorithm.name=fedprox", "--set", "algorithm.mu=-1"], "algorithm.mu"),
    "unknown model": (["--set", "model.name=transformer9000"], "model"),
    "model does not fit the data": (["--set", "model.name=simple_cnn"], "simple_cnn"),
    "unknown dataset option": (["--set", "data.options={colour = 1}"], "colour"),
    "more clients than samples": (
        ["--set", "data.partition=iid", "--set", "data.num_clients=1000000"], "num_clients"),
    "natural split with wrong client count": (["--set", "data.num_clients=5"], "num_clients"),
    "impossible minimum client size": (
        ["--set", "data.partition=dirichlet", "--set", "data.min_size=100000"], "min_size"),
    "more sampled than clients": (["--set", "train.clients_per_round=31"], "train.clients_per_round"),
    "augmentation of feature vectors": (["--set", "data.augment=crop_flip"], "data.augment"),
    "malformed --set": (["--set", "train.lr"], "KEY=VALUE"),
    "bad boolean": (["--set", "runtime.progress=perhaps"], "runtime.progress"),
    "unknown partition": (["--set", "data.partition=zipf"], "data.partition"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_run_settings(case, tmp_path, capsys):
    extra, needle = CASES[case]
    out = tmp_path / "run"
    code = main(["run", "--out", str(out), "--set", "train.rounds=1", "--quiet", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("hetfl: error: ")
    assert needle in err
    assert not out.exists(), "nothing may be written on bad input"


def test_missing_dataset_files_say_what_to_put_where(tmp_path, capsys):
    root = tmp_path / "empty"
    root.mkdir()
    out = tmp_path / "run"
    code = main(["run", "--out", str(out), "--set", "data.dataset=mnist", "--set", f"data.root={root}",
                 "--set", "data.download=false", *QUICK])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "train-images-idx3-ubyte" in err and str(root) in err
    assert not out.exists()


@pytest.mark.parametrize("make", [_checkpoint_garbage, _out_exists, _bad_toml])
def test_bad_files(make, tmp_path, capsys):
    argv = make(tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("hetfl: error: ")
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_resume_needs_a_run_directory(tmp_path, capsys):
    assert main(["run", "--resume", str(tmp_path / "nowhere")]) == 2
    assert "config.toml" in capsys.readouterr().err


def test_compare_rejects_bad_seeds(tmp_path, capsys):
    assert main(["compare", "--methods", "fedavg", "--seeds", "a,b", "--out", str(tmp_path / "c")]) == 2
    assert "--seeds" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(("option", "methods", "seeds"), [
    ("--seeds", "fedavg", "1,,2"), ("--seeds", "fedavg", "0,1,"), ("--seeds", "fedavg", ",0"),
    ("--methods", "fedavg,,fedprox", "0"), ("--methods", "fedavg,", "0")])
def test_compare_refuses_an_empty_item_in_a_list(tmp_path, capsys, option, methods, seeds):
    """``--seeds 1,,2`` is a typo (a seed left out?), not the seeds 1 and 2: refused, naming the option and the
    value, before anything is planned or written."""
    no_run = ["--set", "train.rounds=1", "--out", str(tmp_path / "c")]
    assert main(["compare", "--methods", methods, "--seeds", seeds, *no_run]) == 2
    err = capsys.readouterr()
    assert f"{option} = '{methods if option == '--methods' else seeds}'" in err.err and "empty" in err.err
    assert "plan:" not in err.out
    assert not (tmp_path / "c").exists()



# ----------------------------------------------------------------- docs audit: name what the user typed
@pytest.mark.parametrize("command", [["run", "--out"], ["partition", "--json"],
                                     ["compare", "--methods", "fedavg", "--seeds", "0", "--out"]])
def test_a_set_without_a_value_names_the_option_typed(command, tmp_path, capsys):
    """``--set train.lr`` (the value left out) names ``--set``, the option on the command line, not ``overrides``,
    the Python API's argument the CLI hands it to."""
    assert main([*command, str(tmp_path / "r"), "--set", "train.lr"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hetfl: error: --set = 'train.lr'") and "KEY=VALUE" in err
    assert "overrides" not in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(("command", "model"), [(["run"], "simple_cnn"), (["run"], "cct"), (["run"], "resnet18"),
                                               (["compare", "--methods", "fedavg", "--seeds", "0"], "cct")])
def test_an_image_model_on_feature_vectors_names_model_name_and_the_datas_shape(command, model, tmp_path, capsys):
    """A model that does not fit the dataset is refused naming the key the user set (``model.name``), its value,
    what the data is and what would fit, not an internal argument (``input_shape``); ``hetfl compare`` as
    ``hetfl run`` (its planning checks each run on the meta device)."""
    assert main([*command, "--out", str(tmp_path / "r"), *QUICK, "--set", f"model.name={model}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hetfl: error: model.name = '{model}': "), err
    assert "(60,)" in err and "mlp" in err and "input_shape" not in err


@pytest.mark.parametrize(("value", "hint"), [("0,90", "[0,90]"), ("[0,90", "[0,90]"), ("0,90]", "[0,90]"),
                                             ("45", "[45]")])
def test_a_list_setting_without_its_brackets_is_shown_with_them_once(value, hint, tmp_path, capsys):
    """``--set data.angles=[0,90`` (a bracket lost) is not shown as ``[[0,90]``: the hint is the list meant."""
    assert main(["run", "--out", str(tmp_path / "r"), *QUICK, "--set", f"data.angles={value}"]) == 2
    err = capsys.readouterr().err.strip()
    assert f'--set "data.angles={hint}"' in err, err
