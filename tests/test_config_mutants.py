"""The configuration's refusals (``hetfl.config``), word for word: what mutation testing of the module
(``benchmarks/mutation.py`` target ``config``, session 42) showed the other tests leave unchecked.

Every refusal names the key, the value and what is allowed (the brief's rule for bad input); the other tests
mostly matched a part of the message, so a refusal that named another key, dropped the value or lost its
explanation passed. Here each is pinned whole, with the boundary each check draws (a value just inside is
accepted, one just outside refused): clients per round up to the number of clients, a SecAgg+ threshold up to
the number of clients and below the number of shares, the rounds a client model may be saved at, MLflow's
250-character run names.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hetfl import config
from hetfl.params import ConfigError

SECAGG = ["runtime.secure_aggregation=true", "algorithm.name=fedavg+ccvr"]
DEVICE_ALLOWED = "allowed: auto, cpu, cuda, cuda:N (N = 0, 1, ...: the index of a GPU present)"
RUN_NAME_RULE = "must be at most 250 characters without '/' ('' = the run folder's name)"


def refusal(overrides: list[str], tree: dict | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        config.from_tree(tree if tree is not None else {}, overrides)
    return err.value


@pytest.mark.parametrize(("overrides", "message"), [
    # --set
    (["train.lr"], "--set = 'train.lr': must look like KEY=VALUE, e.g. train.lr=0.01"),
    (["train..lr=1"], "--set = 'train..lr=1': the key must be dotted names, e.g. train.lr"),
    (["=1"], "--set = '=1': the key must be dotted names, e.g. train.lr"),
    # a section given a value
    (["algorithm=fedprox"], "algorithm = 'fedprox': did you mean algorithm.name = 'fedprox'? must be a table of "
                            "settings (algorithm.KEY=VALUE with --set, such as algorithm.name, [algorithm] in a TOML "
                            "file)"),
    (["data=3"], "data = 3: must be a table of settings (data.KEY=VALUE with --set, such as data.dataset, [data] in a "
                 "TOML file)"),
    (["train=5"], "train = 5: must be a table of settings (train.KEY=VALUE with --set, [train] in a TOML file)"),
    (["trian.lr=0.1"], "trian = {'lr': 0.1}: unknown key; did you mean 'train'? allowed: algorithm, data, model, "
                       "runtime, seed, tracking, train"),
    (["algorithm.name=3"], "algorithm.name = 3: must be a string such as 'fedavg' or 'fedavg+ccvr'"),
    # each section's own checks
    (["runtime.device=gpu:1"], f"runtime.device = 'gpu:1': did you mean 'cuda:1'? {DEVICE_ALLOWED}"),
    (["runtime.device=GPU"], f"runtime.device = 'GPU': did you mean 'cuda'? {DEVICE_ALLOWED}"),
    (["runtime.device=tpu"], f"runtime.device = 'tpu': did you mean 'cpu'? {DEVICE_ALLOWED}"),
    (["runtime.device=atuo"], f"runtime.device = 'atuo': did you mean 'auto'? {DEVICE_ALLOWED}"),
    (["runtime.device=CDUA"], f"runtime.device = 'CDUA': did you mean 'cuda'? {DEVICE_ALLOWED}"),
    (["runtime.device=quantum"], f"runtime.device = 'quantum': {DEVICE_ALLOWED}"),
    ([*SECAGG, "data.num_clients=10", "runtime.secagg_num_shares=4", "runtime.secagg_reconstruction_threshold=4"],
     "runtime.secagg_reconstruction_threshold = 4: must be < runtime.secagg_num_shares = 4 (and >= 2)"),
    (["tracking.experiment=' '"], "tracking.experiment = ' ': must be a non-empty MLflow experiment name"),
    (["tracking.experiment=' x'"], "tracking.experiment = ' x': must not start or end with blanks"),
    (["tracking.run_name='a '"], "tracking.run_name = 'a ': must not start or end with blanks"),
    (["tracking.mlflow_uri=' u'"], "tracking.mlflow_uri = ' u': must not start or end with blanks"),
    (["tracking.tensorboard_dir='d '"], "tracking.tensorboard_dir = 'd ': must not start or end with blanks"),
    (["tracking.run_name='a/b'"], f"tracking.run_name = 'a/b': {RUN_NAME_RULE}"),
    ([f"tracking.run_name='{'r' * 251}'"], f"tracking.run_name = '{'r' * 251}': {RUN_NAME_RULE}"),
    (["data.group_classes=[[0, 1], [2, 3]]", "data.dominant_groups=2"],
     "data.dominant_groups = 2: has no effect with data.group_classes set (its 2 lists are the groups and their "
     "classes); leave data.dominant_groups at 5"),
    (["data.group_classes=[[0, 1], [2, 3], [4]]", "data.classes_per_group=2"],
     "data.classes_per_group = 2: has no effect with data.group_classes set (its 3 lists are the groups and their "
     "classes); leave data.classes_per_group at 3"),
    (["train.lr_schedule=cosine", "train.lr=0.1", "train.lr_min=0.2"],
     "train.lr_min = 0.2: must be <= train.lr = 0.1 under the cosine schedule (it is the floor)"),
    # across sections
    (["data.num_clients=4", "train.clients_per_round=5"],
     "train.clients_per_round = 5: must be <= data.num_clients = 4 (0 = all)"),
    (["data.dataset=synthetic", "data.partition=rotation"],
     "data.partition = 'rotation': rotates images; synthetic has feature vectors"),
    ([*SECAGG, "data.num_clients=4", "runtime.secagg_num_shares=6", "runtime.secagg_reconstruction_threshold=5"],
     "runtime.secagg_reconstruction_threshold = 5: must be <= data.num_clients = 4 under runtime.secure_aggregation "
     "(every client needs this many of its neighbours), and >= 2"),
    (["train.rounds=3", "runtime.save_client_models=[0, 3]"],
     "runtime.save_client_models = [0, 3]: must be rounds between 1 and train.rounds = 3 ([0] never happen)"),
    (["train.rounds=3", "runtime.save_client_models=[1, 4, 2]"],
     "runtime.save_client_models = [1, 4, 2]: must be rounds between 1 and train.rounds = 3 ([4] never happen)"),
], ids=lambda value: value if isinstance(value, str) and len(value) < 40 else None)
def test_a_refusal_word_for_word(overrides, message):
    err = refusal(overrides)
    assert str(err) == message
    assert str(err).startswith(f"{err.key} = {err.value!r}: ") and err.allowed  # key, value and rule as fields


def test_a_key_under_a_value_names_the_value_it_would_replace():
    err = refusal(["algorithm.ccvr.epochs=1"], {"algorithm": {"ccvr": 5}})
    assert (err.key, err.value, str(err)) == ("algorithm.ccvr", 5, "algorithm.ccvr = 5: is a value, not a table")


@pytest.mark.parametrize("overrides", [
    ["data.num_clients=4", "train.clients_per_round=4"],
    [*SECAGG, "data.num_clients=4", "runtime.secagg_num_shares=5", "runtime.secagg_reconstruction_threshold=4"],
    [*SECAGG, "data.num_clients=10", "runtime.secagg_num_shares=4", "runtime.secagg_reconstruction_threshold=3"],
    ["train.rounds=3", "runtime.save_client_models=[1, 3]"],
    [f"tracking.run_name='{'r' * 250}'"],
    ["tracking.run_name=run-1", "tracking.experiment=x", "tracking.mlflow_uri=u", "tracking.tensorboard_dir=d"],
    ["train.lr_schedule=cosine", "train.lr=0.1", "train.lr_min=0.1"],
    ["data.dominant_groups=2", "data.classes_per_group=2"],  # without group_classes they are read
    ["data.group_classes=[[0, 1], [2, 3]]"],
    ["runtime.device=cuda:12"],
])
def test_a_value_just_inside_each_boundary_is_accepted(overrides):
    config.from_tree({}, overrides)


# ------------------------------------------------------------------ files
def refusal_of_file(path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        config.read_tree(path)
    return err.value


def test_a_configuration_file_that_cannot_be_used_is_named_with_why(tmp_path, monkeypatch):
    missing = tmp_path / "missing.toml"
    assert str(refusal_of_file(missing)) == f"CONFIG = '{missing}': no such file"
    assert str(refusal_of_file(tmp_path)) == f"CONFIG = '{tmp_path}': no such file"  # a folder
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b"seed = 1\n# caf\xe9\n")
    assert str(refusal_of_file(latin)) == (f"CONFIG = '{latin}': not UTF-8 text (byte 14: invalid continuation "
                                           "byte); TOML files are UTF-8, save it with that encoding")
    broken = tmp_path / "broken.toml"
    broken.write_text("seed = \n")
    assert str(refusal_of_file(broken)) == f"CONFIG = '{broken}': not valid TOML (Invalid value (at line 1, column 8))"
    locked = tmp_path / "locked.toml"
    locked.write_text("seed = 1\n")

    def denied(self: Path) -> bytes:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_bytes", denied)
    err = refusal_of_file(locked)
    assert (err.key, err.value, str(err)) == ("CONFIG", str(locked),
                                              f"CONFIG = '{locked}': cannot be read (Permission denied)")


def test_a_preset_given_as_a_configuration_names_the_command_that_runs_it(tmp_path):
    preset = tmp_path / "table.toml"
    preset.write_text('[preset]\nname = "table"\n')
    with pytest.raises(config.PresetFileError) as err:
        config.load(preset)
    assert err.value.path == preset
    assert str(err.value) == (f"CONFIG = '{preset}': a reproduction preset (hetfl reproduce NAME), not a run "
                              f"configuration; run it with `hetfl reproduce {preset}` (add --quick for its small CPU "
                              "variant)")
    assert str(config.PresetFileError(preset, "ccvr-table2")).endswith(
        "run it with `hetfl reproduce ccvr-table2` (add --quick for its small CPU variant)")
