"""Config loading, overrides and validation."""

from __future__ import annotations

import pytest

from hetfl import config
from hetfl.params import ConfigError


def test_defaults_are_the_offline_experiment():
    cfg = config.load()
    assert cfg.algorithm.name == "fedavg"
    assert cfg.data.dataset == "synthetic"
    assert cfg.runtime.executor == "sequential"


def test_set_overrides_parse_toml_values(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('seed = 3\n[train]\nlr = 0.1\n[algorithm]\nname = "fedprox"\nmu = 0.5\n')
    cfg = config.load(path, ["train.lr=0.02", "train.rounds=7", "data.angles=[0, 90]", "model.name=mlp",
                             "data.download=false"])
    assert cfg.seed == 3
    assert cfg.train.lr == 0.02 and cfg.train.rounds == 7
    assert cfg.data.angles == [0.0, 90.0]
    assert cfg.model.name == "mlp" and cfg.data.download is False
    assert cfg.algorithm.name == "fedprox" and cfg.algorithm.params == {"mu": 0.5}


def test_round_trip_through_toml(tmp_path):
    cfg = config.load(None, ["algorithm.name=fedprox", "algorithm.mu=0.1", "data.options={alpha = 0.5}"])
    path = tmp_path / "r.toml"
    path.write_text(config.dumps(cfg))
    assert config.load(path) == cfg


@pytest.mark.parametrize(
    ("override", "key", "hint"),
    [
        ("train.lrr=0.1", "train.lrr", "unknown key"),
        ("train.lr=-0.1", "train.lr", "> 0.0"),
        ("train.lr=abc", "train.lr", "number"),
        ("train.lr=1e39", "train.lr", "< 3.4028"),  # past float32: a step could not scale a gradient by it
        ("train.rounds=0", "train.rounds", ">= 1"),
        ("train.rounds=2.5", "train.rounds", "integer"),
        ("data.alpha=0", "data.alpha", "> 0.0"),
        ("data.partition=weird", "data.partition", "allowed: auto, iid"),
        ("data.dataset=imagenet22k", "data.dataset", "allowed:"),
        ("runtime.device=tpu", "runtime.device", "allowed: auto, cpu, cuda"),
        ("train.momentum=1.0", "train.momentum", "< 1.0"),
        ("bogus=1", "bogus", "unknown key"),
        ("data.uniform_share=1.5", "data.uniform_share", "<= 1.0"),
        ("runtime.progress=maybe", "runtime.progress", "true or false"),
        ("train.lr=inf", "train.lr", "finite"),
        ("train.momentum=nan", "train.momentum", "finite"),
        ("data.angles=[0, -inf]", "data.angles[1]", "finite"),
        # a section given the name it should hold (a traceback from dict() for algorithm before)
        ("algorithm=fedprox", "algorithm", "did you mean algorithm.name = 'fedprox'? must be a table"),
        ("data=mnist", "data", "did you mean data.dataset = 'mnist'?"),
        ("model=resnet18", "model", "did you mean model.name = 'resnet18'?"),
        ("train=3", "train", "must be a table of settings"),
        # a list or table without its brackets (the shell's quoting forgotten): the --set that was meant
        ("data.angles=0,90", "data.angles", 'must be a list, in brackets: --set "data.angles=[0,90]"'),
        ("runtime.save_client_models=5", "runtime.save_client_models", '"runtime.save_client_models=[5]"'),
        ("model.options=norm=gn", "model.options", "--set \"model.options={norm = 'gn'}\""),
    ],
)
def test_bad_values_name_key_value_and_allowed(override, key, hint):
    with pytest.raises(ConfigError) as err:
        config.load(None, [override])
    message = str(err.value)
    assert message.startswith(key) and hint in message


@pytest.mark.parametrize("value", ["fedavg", "5", "[1, 2]", "true"])
def test_algorithm_given_a_value_instead_of_a_table_is_a_config_error(value, tmp_path):
    """``--set algorithm=fedavg`` (or ``algorithm = "fedavg"`` at a TOML file's top) names the key, like any
    other section given a value (it once ended in a ValueError/TypeError traceback from ``dict(...)``)."""
    with pytest.raises(ConfigError) as err:
        config.load(None, [f"algorithm={value}"])
    assert err.value.key == "algorithm" and "must be a table" in str(err.value) and "algorithm.name" in str(err.value)
    path = tmp_path / "c.toml"
    path.write_text('algorithm = "fedavg"\n')
    meant = r"^algorithm = 'fedavg': did you mean algorithm.name = 'fedavg'\? must be a table"
    with pytest.raises(ConfigError, match=meant):
        config.load(path)


def optimiser_scalars() -> list[tuple[str, str]]:
    """(method, key) of every step size and weight decay: the run's, each method's (algorithm.*) and each
    post-hoc step's (algorithm.<step>.*)."""
    import dataclasses
    import typing

    from hetfl.algorithms import algorithm_class, available, step_hyper

    found = [("fedavg", "train.lr"), ("fedavg", "train.weight_decay")]
    hypers = [(m, "algorithm.", algorithm_class(m).Hyper) for m in available()]
    hypers.append(("fedavg+ccvr", "algorithm.ccvr.", type(step_hyper("ccvr", {}))))
    for method, prefix, hyper in hypers:
        hints = typing.get_type_hints(hyper)
        found += [(method, prefix + f.name) for f in dataclasses.fields(hyper)
                  if hints[f.name] is float and (f.name.endswith("lr") or f.name.endswith("weight_decay"))]
    return found


@pytest.mark.parametrize(("method", "key"), optimiser_scalars())
def test_step_sizes_and_weight_decays_past_float32_are_refused(method, key):
    """A step size or weight decay is a float32 scalar in the step (torch.optim casts it): past float32's
    largest value torch raises 'value cannot be converted to type float without overflow', once after the
    whole training (algorithm.ccvr.lr, .weight_decay) or in round 1 (train.weight_decay,
    algorithm.head_weight_decay of FedPAC), with a traceback, exit 1 and a run folder left behind. Refused at
    load like train.lr, naming the key."""
    from hetfl.algorithms import hyperparameters, step_hyper

    with pytest.raises(ConfigError) as err:
        cfg = config.load(None, [f"algorithm.name={method}", f"{key}=1e39"])
        hyperparameters(cfg.algorithm.name, cfg.algorithm.params)
        step_hyper("ccvr", cfg.algorithm.params.get("ccvr", {}))
    assert err.value.key == key and "< 3.4028" in str(err.value)


def test_weight_decay_past_float32_exits_2_without_writing(tmp_path, capsys):
    from hetfl.cli import main

    out = tmp_path / "r"
    sets = ["--set", "train.rounds=1", "--set", "train.weight_decay=1e39"]
    assert main(["run", "--out", str(out), "--quiet", *sets]) == 2
    assert "train.weight_decay = 1e+39" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("override", ["seed=1e20", "seed=18446744073709551616", "train.rounds=1e19",
                                      "train.eval_every=9223372036854775808", "runtime.checkpoint_every=1e300"])
def test_integers_past_tomls_64_bit_range_are_refused(override, tmp_path):
    """config.toml is TOML, whose integers are 64-bit ("an integer that cannot be represented losslessly must
    be an error"): a setting past that range (``seed=1e20``, a float made an integer) once ran and wrote a
    config.toml other TOML readers refuse. The largest 64-bit integer is fine and round-trips."""
    key = override.partition("=")[0]
    with pytest.raises(ConfigError) as err:
        config.load(None, [override])
    assert err.value.key == key and "64-bit" in str(err.value)
    with pytest.raises(ConfigError, match="algorithm.ccvr.num_virtual.*64-bit"):
        from hetfl.algorithms import hyperparameters

        hyperparameters("fedavg+ccvr", {"ccvr": {"num_virtual": 2**64}})
    cfg = config.load(None, [f"seed={2**63 - 1}"])
    (tmp_path / "c.toml").write_text(config.dumps(cfg))
    assert config.load(tmp_path / "c.toml").seed == 2**63 - 1


def test_malformed_set_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        config.load(None, ["train.lr"])
    with pytest.raises(ConfigError, match="no such file"):
        config.load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nlr=1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(bad)
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b"# r\xe9glages\n[train]\nlr = 0.1\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        config.load(latin1)


def test_quantity_sigma_zero_is_the_equal_sizes_control():
    """data.quantity_sigma = 0 gives clients of equal sizes (the partition's documented control for a sweep over
    sigma), which the partition accepts: the config refused it (``gt=0``) where the partition's own check is >= 0;
    a negative sigma stays refused, naming the key."""
    cfg = config.load(None, ["data.partition=quantity", "data.quantity_sigma=0"])
    assert cfg.data.quantity_sigma == 0.0
    with pytest.raises(ConfigError, match="data.quantity_sigma"):
        config.load(None, ["data.partition=quantity", "data.quantity_sigma=-0.5"])


def test_an_errors_value_is_shown_as_a_config_file_writes_it_inside_lists_and_tables_too():
    """``--set`` takes ``true``, not Python's ``True``: a message shows booleans as it takes them, also inside a
    list or a table (session 48: ``runtime.progress = [True]`` before)."""
    from hetfl.params import shown_value

    assert shown_value(True) == "true" and shown_value(()) == "[]"
    assert shown_value([True, 1, "a", (2, 3)]) == "[true, 1, 'a', [2, 3]]"
    assert shown_value({"bn": False, "hidden": [16]}) == "{'bn': false, 'hidden': [16]}"
    assert str(ConfigError("runtime.progress", [True, False], "x")) == "runtime.progress = [true, false]: x"
