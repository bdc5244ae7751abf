"""The layering rule: algorithms know nothing of the runtime, and the engine imports no runtime (the
CLI, the API and ``hetfl.runtimes`` pick one). Checked on the source with ``ast``, every import
counted (module level, in functions, under ``TYPE_CHECKING``); then the engine's refusal to run a
Flower experiment in-process, and ``hetfl.runtimes.run_experiment`` against ``Experiment.run``."""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest

from hetfl import config
from hetfl.engine.experiment import Experiment
from hetfl.engine.federation import Federation, InProcessFederation
from hetfl.params import ConfigError
from hetfl.runtimes import run_experiment
from tests.helpers.imports import import_statements

pytestmark = pytest.mark.usefixtures("one_thread")

SRC = Path(__file__).resolve().parents[2] / "src"
#: the layers below the runtimes, and what they must not import
LOWER = ("hetfl/engine", "hetfl/algorithms")
FORBIDDEN = ("hetfl.flower", "flwr", "hetfl.cli", "hetfl.api", "hetfl.runtimes",
             "hetfl.tracking", "hetfl.console", "hetfl.runs")  # handed to the engine, never imported (issue 28)
TIME_KEYS = {"round_time_s", "eval_time_s", "wall_time_s"}


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """(line, module name) of every import in ``source`` (the module ``module``): ``import a.b`` gives
    ``a.b``; ``from a import b`` gives ``a`` and ``a.b`` (``b`` may be a module); relative imports are
    made absolute; ``importlib.import_module("a.b")`` and ``__import__("a.b")`` with a literal name count."""
    found: list[tuple[int, str]] = []
    for line, base, names in import_statements(ast.parse(source), module.rsplit(".", 1)[0]):
        found += [(line, base), *((line, f"{base}.{name}") for name in names)]
    return found


def forbidden_imports(source: str, module: str) -> list[str]:
    return [f"{module}:{line} imports {name}" for line, name in imported_modules(source, module)
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)]


def test_the_engine_and_the_algorithms_import_no_runtime_cli_or_api():
    files = sorted(f for layer in LOWER for f in (SRC / layer).rglob("*.py"))
    assert len(files) > 20  # the layers were found
    bad = []
    for path in files:
        module = ".".join(path.relative_to(SRC).with_suffix("").parts)  # a package's: hetfl.engine.__init__
        bad += forbidden_imports(path.read_text(), module)
    assert bad == [], "a lower layer imports a runtime, the CLI or the API:\n" + "\n".join(bad)


@pytest.mark.parametrize("code", [
    "import flwr",
    "from flwr.app import Message",
    "def f():\n    from hetfl.flower.simulation import run_simulation",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hetfl.cli import RichReporter",
    "from hetfl import api",
    "from .. import runtimes",
    "from ..flower import server",
    "import importlib\nimportlib.import_module('hetfl.flower.server')",
])
def test_the_check_sees_every_form_of_import(code):
    assert forbidden_imports(code, "hetfl.engine.example")


def test_the_check_lets_the_engines_own_imports_pass():
    assert not forbidden_imports("from hetfl.engine.federation import Federation\nfrom . import rundir\n"
                                 "from hetfl.flowers import x\nimport hetfl.apix", "hetfl.engine.example")


def test_the_federations_have_the_protocols_methods():
    """InProcessFederation and FlowerFederation take what the round loop passes (the same parameters)."""
    methods = [name for name, _ in inspect.getmembers(Federation, inspect.isfunction) if not name.startswith("_")]
    assert set(methods) == {"start", "setup_replies", "train", "posthoc_replies", "client_accuracies",
                            "round_info", "checkpoint_info", "committed"}
    classes = [InProcessFederation]
    try:
        from hetfl.flower.server import FlowerFederation
    except ImportError:  # Flower not installed: the in-process one alone
        pass
    else:
        classes.append(FlowerFederation)
    for cls in classes:
        for name in methods:
            assert list(inspect.signature(getattr(cls, name)).parameters) == \
                list(inspect.signature(getattr(Federation, name)).parameters), (cls.__name__, name)


def tiny(*overrides: str) -> config.RunConfig:
    return config.load(None, ["train.rounds=2", "runtime.progress=false", *overrides])


def test_experiment_run_refuses_the_flower_executor_and_writes_nothing(tmp_path):
    exp = Experiment(tiny("runtime.executor=flower"))
    run = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        exp.run(run)
    assert err.value.key == "runtime.executor" and err.value.value == "flower"
    assert "hetfl.runtimes.run_experiment" in str(err.value) and "hetfl run" in str(err.value)
    assert not run.exists() and list(tmp_path.iterdir()) == []


def lines(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIME_KEYS}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_run_experiment_gives_experiment_runs_numbers(tmp_path):
    cfg = tiny()
    direct = Experiment(cfg).run(tmp_path / "direct")
    through_config = run_experiment(cfg, tmp_path / "config")
    through_experiment = run_experiment(Experiment(cfg), tmp_path / "experiment")
    numbers = {k: v for k, v in direct.items() if k not in TIME_KEYS}
    assert "final_global_acc" in numbers and "final_client_acc_mean" in numbers
    for summary, name in ((through_config, "config"), (through_experiment, "experiment")):
        assert {k: v for k, v in summary.items() if k not in TIME_KEYS} == numbers
        assert lines(tmp_path / name) == lines(tmp_path / "direct")


@pytest.mark.parametrize(("overrides", "key"), [
    (["runtime.device=cuda:99"], "runtime.device"),
    (["algorithm.name=fedprox", "algorithm.mu=-1"], "algorithm.mu"),
    (["runtime.secure_aggregation=true"], "runtime.secure_aggregation"),
    (["tracking.tensorboard=true"], "tracking.tensorboard"),
    (["data.options={num_devices=100000000}"], "data.options.num_devices"),
])
def test_every_key_that_needs_no_data_is_checked_before_any_data_is_read(monkeypatch, overrides, key):
    """Issue 28, one pass: engine.experiment.check_config checks each key that needs no data, by its owner
    (the method's registry, secure_sum, the handed trackers, resources), before the set-up reads the data
    (here reading it is an error: the test fails if it comes first)."""
    import sys

    import hetfl.engine.experiment as experiment_mod
    from hetfl import tracking

    def no_reading(*_, **__):
        raise AssertionError("data read before the configuration was checked")

    cfg = tiny(*overrides)  # valid as a configuration: the set-up refuses it
    monkeypatch.setattr(experiment_mod, "load_dataset", no_reading)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    with pytest.raises(ConfigError) as err:
        Experiment(cfg, trackers=tracking.TRACKERS)
    assert err.value.key == key, str(err.value)
