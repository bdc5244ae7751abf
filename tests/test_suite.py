"""The suite's own settings (tests/conftest.py): what makes it fast, and what makes it give the same
result on a machine with CUDA, and under pytest-xdist, as on one CPU process."""

from __future__ import annotations

import os
import string
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

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
    test this session collected (the whole suite under ``--run-slow``, as CI runs it)."""
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
    """.ci/run's command is the README's command 2, which runs the whole suite (the slow tests too) under
    pytest-xdist; the test extra installs pytest-xdist."""
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text(encoding="utf-8")
    command = (root / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    assert command in readme.splitlines() and command.endswith("-m pytest -q -n auto --run-slow")
    extra = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    assert any(req.startswith("pytest-xdist") for req in extra["test"])


def session_config(args: list[str], *, run_slow: bool = False, markexpr: str = "") -> SimpleNamespace:
    """What :func:`tests.conftest.slow_tests_left_out` reads of a pytest session's config."""
    return SimpleNamespace(args=args, option=SimpleNamespace(markexpr=markexpr),
                           getoption=lambda name: {"run_slow": run_slow}[name])


@pytest.mark.parametrize(("args", "run_slow", "markexpr", "left_out"), [
    ([], False, "", True),  # plain pytest: the quick loop
    (["tests/flower", "tests/test_readme.py"], False, "", True),  # folders and files: their quick tests
    ([], True, "", False),  # --run-slow: the whole suite (CI)
    (["tests/test_readme.py"], False, "slow", False),  # -m says what runs
    (["tests/test_readme.py"], False, "not slow", False),
    (["tests/test_readme.py::test_the_readmes_examples_run_as_written"], False, "", False),  # named: run it
    (["tests/engine", "tests/test_readme.py::test_markers_substitutions_still_match"], False, "", False),
])
def test_the_slow_tests_are_left_out_unless_asked_for(args, run_slow, markexpr, left_out):
    from tests.conftest import slow_tests_left_out

    assert slow_tests_left_out(session_config(args, run_slow=run_slow, markexpr=markexpr)) is left_out


def test_left_out_slow_tests_are_reported_as_deselected_and_the_rest_keep_their_order():
    from tests.conftest import pytest_collection_modifyitems

    def item(name: str, *marks: str) -> SimpleNamespace:
        return SimpleNamespace(name=name, get_closest_marker=lambda mark: mark if mark in marks else None)

    def collected() -> list[SimpleNamespace]:
        return [item("a"), item("slow1", "slow"), item("waits", "processes"), item("b"),
                item("slow2", "slow", "processes")]

    deselected: list[list[str]] = []
    hook = SimpleNamespace(pytest_deselected=lambda items: deselected.append([x.name for x in items]))
    items = collected()
    quick = session_config([])
    quick.hook = hook
    pytest_collection_modifyitems(quick, items)
    assert deselected == [["slow1", "slow2"]]
    assert [x.name for x in items] == ["waits", "a", "b"]  # the waiting test first, then the rest in their order
    whole = session_config([], run_slow=True)
    whole.hook = hook
    items = collected()
    pytest_collection_modifyitems(whole, items)
    assert deselected == [["slow1", "slow2"]]  # nothing more deselected
    assert [x.name for x in items] == ["waits", "slow1", "slow2", "a", "b"]


@pytest.mark.processes
def test_plain_pytest_deselects_the_slow_tests_and_says_how_to_run_them(tmp_path):
    """The real hooks, in a pytest of its own: a file's slow test is deselected and the run says ``--run-slow``."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                           "tests/test_readme.py"], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "test_the_readmes_examples_run_as_written" not in done.stdout
    assert "tests/test_readme.py::test_markers_substitutions_still_match" in done.stdout
    assert "(1 deselected)" in done.stdout
    assert "the tests marked slow were not run: --run-slow runs them too" in done.stdout
