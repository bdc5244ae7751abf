"""The suite's own settings (tests/conftest.py): what makes it fast, and what makes it give the same
result on a machine with CUDA, and under pytest-xdist, as on one CPU process."""

from __future__ import annotations

import os
import string
import tomllib
from pathlib import Path

import pytest
import torch

from hetfl import config
from hetfl.engine.experiment import Experiment
from hetfl.engine.setup import AUTO_DEVICE_ENV, pick_device
from hetfl.params import ConfigError

PRINTABLE = set(string.printable) - set("\t\n\r\x0b\x0c")


def test_test_ids_are_plain_text(request):
    """pytest-xdist runs a test only when every worker collected the same ids; an id made from bytes
    (gzip output holds a time stamp) or from an object's address differs between workers. Checks every
    test this session collected (the whole suite under ``pytest -q``)."""
    bad = [item.nodeid for item in request.session.items
           if set(item.nodeid) - PRINTABLE or "\\x" in item.nodeid or " object at 0x" in item.nodeid]
    assert not bad, bad[:5]


def test_every_test_runs_on_one_torch_thread():
    assert torch.get_num_threads() == 1


def test_a_thread_count_set_by_one_test_does_not_reach_the_next_part_1():
    torch.set_num_threads(2)


def test_a_thread_count_set_by_one_test_does_not_reach_the_next_part_2():
    assert torch.get_num_threads() == 1


def test_runtime_device_auto_is_the_cpu_under_the_tests():
    """Tests that pin numbers run on the CPU also where CUDA is present; the processes the tests start
    (CLI subprocesses, Flower's nodes) inherit the setting."""
    assert os.environ[AUTO_DEVICE_ENV] == "cpu"
    assert pick_device("auto") == torch.device("cpu")
    exp = Experiment(config.load(None, ["data.options={num_devices=4, max_samples=40}", "data.num_clients=4",
                                        "train.rounds=1", "runtime.progress=false"]))
    assert exp.device == torch.device("cpu") and exp.cfg.runtime.device == "auto"


def test_a_device_env_that_names_no_device_is_refused_with_its_name(monkeypatch):
    monkeypatch.setenv(AUTO_DEVICE_ENV, "gpu")
    with pytest.raises(ConfigError) as err:
        pick_device("auto")
    assert err.value.key == "runtime.device" and AUTO_DEVICE_ENV in err.value.allowed and "'gpu'" in err.value.allowed
    assert pick_device("cpu") == torch.device("cpu")  # a run that names its device does not read it


def test_ci_runs_exactly_the_readmes_test_command_with_one_process_per_core():
    """.ci/run's command is the README's command 2, which runs the suite under pytest-xdist; the test
    extra installs pytest-xdist."""
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text(encoding="utf-8")
    command = (root / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    assert command in readme.splitlines() and command.endswith("-m pytest -q -n auto")
    extra = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    assert any(req.startswith("pytest-xdist") for req in extra["test"])
