"""Flower is optional: core hetfl never imports it, and asking for it without it says how to get it.

Runs whether or not Flower is installed (the missing case is simulated in a subprocess)."""

from __future__ import annotations

import subprocess
import sys


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)


def test_core_hetfl_does_not_import_flower(tmp_path):
    out = run_python(
        "import sys\n"
        "from hetfl.cli import main\n"
        f"assert main(['run', '--out', r'{tmp_path / 'r'}', '--set', 'train.rounds=1', '--set', 'data.num_clients=3', "
        "'--set', 'data.partition=dirichlet', '--set', 'runtime.threads=1', '--quiet']) == 0\n"
        "import hetfl.engine.experiment, hetfl.tables, hetfl.reproduce\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('flwr', 'ray')))\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_flower_executor_without_flower_names_the_extra(tmp_path):
    out = run_python(
        "import sys\n"
        "sys.modules['flwr'] = None  # as if not installed\n"
        "from hetfl.cli import main\n"
        f"sys.exit(main(['run', '--out', r'{tmp_path / 'r'}', '--set', 'runtime.executor=flower', '--quiet']))\n")
    assert out.returncode == 2, out.stderr
    assert 'pip install "hetfl[flower]"' in out.stderr
    assert not (tmp_path / "r").exists()


def test_the_example_app_folder_is_the_one_the_deploy_helpers_write():
    from pathlib import Path

    from hetfl.flower.deploy import APP_PYPROJECT

    example = Path(__file__).resolve().parents[2] / "examples" / "flower" / "app" / "pyproject.toml"
    assert example.read_text() == APP_PYPROJECT
