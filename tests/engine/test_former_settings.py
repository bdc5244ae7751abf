"""Settings added with a default that changed the computation (``setting(former=...)``).

MOON's ``reference_mode`` (2026-11-28: the global and previous models in eval mode, as the authors' code; hetfl
ran them in training mode before) and FedUV's ``sigma_grad`` (2026-11-25: gradient through the median bandwidth;
detached before) changed what a run computes when they were added. A run written before names neither in its
``config.toml`` or its checkpoint; read through today's defaults, it would resume under the new rule (its rounds
computed by two rules, tabled as one run), and ``hetfl compare`` / ``reproduce`` would reuse it as a run of the
new default. Read as written (:func:`hetfl.engine.identity.as_written`), it resumes as it started and is told
apart from the new default's runs.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import hetfl.engine.experiment as experiment_mod
from hetfl import config as config_mod
from hetfl.algorithms import _POSTHOC, algorithm_class, available, posthoc_class
from hetfl.cli import main
from hetfl.engine import identity
from hetfl.engine.checkpoint import load_checkpoint, save_checkpoint
from hetfl.engine.rundir import RunDirError
from hetfl.engine.setup import config_changes
from hetfl.params import build, former_values
from tests.helpers.images import random_images
from tests.helpers.runs import interrupted

# MOON on a BatchNorm network, where the reference models' mode changes the numbers: 2 clients of 32 random
# 1x16x16 images (64 of 4 classes, 32 to test), ResNet-18 at width 4, 2 local steps a round
MOON_BN = ["algorithm.name=moon", "data.dataset=mnist", "data.download=false", "data.partition=iid",
           "data.num_clients=2", "model.name=resnet18", "model.options={norm = \"bn\", width = 4}",
           "train.batch_size=16", "train.local_steps=2", "train.rounds=3", "train.lr=0.05", "train.momentum=0.9",
           "runtime.checkpoint_every=1", "runtime.progress=false", "runtime.threads=1"]


def test_the_settings_that_changed_the_computation_name_what_runs_before_them_computed():
    assert former_values(algorithm_class("moon").Hyper) == {"reference_mode": "train"}
    assert former_values(algorithm_class("feduv").Hyper) == {"sigma_grad": False}
    assert former_values(algorithm_class("fedpac").Hyper) == {"first_head": "server"}
    assert former_values(algorithm_class("fedbr").Hyper) == {"max_forward": "separate"}


@pytest.mark.parametrize("hyper", [algorithm_class(n).Hyper for n in available()]
                         + [posthoc_class(s).Hyper for s in _POSTHOC], ids=lambda h: h.__qualname__)
def test_every_former_value_is_a_valid_setting_other_than_the_default(hyper):
    """A former value is one the setting accepts (the old run is read through the same checks), and not the
    default (else the setting changed nothing and needs none)."""
    former = former_values(hyper)
    build(hyper, former, prefix="algorithm.")
    defaults = {f.name: f.default for f in dataclasses.fields(hyper)}
    assert all(former[k] != defaults[k] for k in former), former


def as_old_hetfl_wrote(tree: dict, key: str) -> dict:
    """``tree`` without ``algorithm.<key>``, as a hetfl from before the setting wrote it."""
    return {**tree, "algorithm": {k: v for k, v in tree["algorithm"].items() if k != key}}


def test_a_users_config_without_the_setting_gets_the_default_and_a_runs_gets_the_former_value(tmp_path):
    """Only a configuration a run wrote (which names every setting of its method) is read as written; a
    user's file that leaves the setting out asks for the default."""
    user = tmp_path / "mine.toml"
    user.write_text('[algorithm]\nname = "moon"\nmu = 5.0\n')
    assert config_mod.load(user).algorithm.params.get("reference_mode", "eval") == "eval"
    run_config = tmp_path / "config.toml"
    written = identity.canonical_tree(config_mod.to_tree(config_mod.load(None, ["algorithm.name=feduv"])))
    run_config.write_text(config_mod.dumps(config_mod.from_dict(as_old_hetfl_wrote(written, "sigma_grad"))))
    assert identity.load_run_config(run_config).algorithm.params["sigma_grad"] is False
    assert identity.as_written(as_old_hetfl_wrote(written, "sigma_grad"))["algorithm"]["sigma_grad"] is False
    # a composed name reads the trainer's settings as written too, and leaves the step's table alone
    composed = identity.canonical_tree(config_mod.to_tree(config_mod.load(None, ["algorithm.name=moon+ccvr"])))
    read = identity.as_written(as_old_hetfl_wrote(composed, "reference_mode"))["algorithm"]
    assert read["reference_mode"] == "train" and read["ccvr"] == composed["algorithm"]["ccvr"]


def metrics(run_dir):
    return [{k: v for k, v in json.loads(line).items() if not k.endswith("time_s")}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_moon_run_written_before_reference_mode_resumes_as_it_started_and_is_not_reused_as_eval_mode(
        tmp_path, monkeypatch):
    """A MOON run on a BatchNorm network, interrupted after round 1 by a hetfl that ran the reference models in
    training mode (its config.toml and checkpoint name no reference_mode), resumed by today's: its rounds 2-3
    are computed in training mode as round 1 was (the numbers of the uninterrupted training-mode run; before,
    they switched to eval mode). ``hetfl compare`` into its folder with today's default refuses it, naming
    the setting."""
    from hetfl.runtimes import set_up

    monkeypatch.setattr(experiment_mod, "load_dataset", random_images(64, 32, 16, 4))
    train_mode = set_up(config_mod.load(None, [*MOON_BN, "algorithm.reference_mode=train"])).cfg
    set_up(train_mode).run(tmp_path / "uninterrupted")
    old = tmp_path / "old"
    interrupted(old, 1, monkeypatch, train_mode)
    (old / "config.toml").write_text(config_mod.dumps(config_mod.from_dict(
        as_old_hetfl_wrote(config_mod.to_tree(train_mode), "reference_mode"))))
    ckpt = load_checkpoint(old, torch.device("cpu"))
    ckpt.info["config"] = as_old_hetfl_wrote(ckpt.info["config"], "reference_mode")
    save_checkpoint(old, ckpt)
    assert "reference_mode" not in (old / "config.toml").read_text()
    assert load_checkpoint(old, torch.device("cpu")).info["config"]["algorithm"].get("reference_mode") is None

    today = set_up(config_mod.load(None, MOON_BN)).cfg  # resolved: reference_mode = "eval", the default
    assert config_changes(ckpt.info["config"], today) == ["algorithm.reference_mode: 'train' -> 'eval'"]
    assert config_changes(ckpt.info["config"], set_up(identity.load_run_config(old / "config.toml")).cfg) == []

    assert main(["run", "--resume", str(old), "--quiet"]) == 0
    assert metrics(old) == metrics(tmp_path / "uninterrupted")
    eval_mode = tmp_path / "eval"
    set_up(today).run(eval_mode)
    assert metrics(eval_mode)[1:] != metrics(old)[1:]  # the setting changes these numbers: the check can fail

    assert identity.check_run_dir(old, config_mod.to_tree(train_mode)) == "finished"
    with pytest.raises(RunDirError, match=r"algorithm\.reference_mode: 'train' -> 'eval'"):
        identity.check_run_dir(old, config_mod.to_tree(today))
