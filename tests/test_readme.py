"""The README's examples, run as written (shortened where marked), so the README cannot drift.

Every fenced ``bash``, ``python`` and ``toml`` block of README.md is preceded by a marker comment,
invisible once rendered, that says what the test does with it::

    <!-- readme-test: run                      a bash block's lines run in bash, in order; a python
                                               block runs in the environment's Python
    train.rounds=20 => train.rounds=1          optional: literal substitutions that shorten it
    -->
    <!-- readme-test: file my.toml -->         the block is that file of the user's folder
    <!-- readme-test: skip WHY -->             not run here, and why (e.g. CI runs it already)

The blocks run in a scratch folder laid out like a clone (``configs/`` and ``examples/`` linked,
``../shared`` beside it when this checkout has one) with the environment's ``bin`` first on PATH,
as after the README's set-up commands and ``source .venv/bin/activate``. ``file`` blocks are
written before any ``run`` block. A substitution that no longer matches, a block without a
marker, or a command that exits non-zero fails the test, naming the README line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import SHARED_DATASETS, needs_accountant
from tests.helpers.readme import README, REPO, TESTED_LANGUAGES, readme_blocks

BLOCKS = readme_blocks(README.read_text(encoding="utf-8"))


def test_every_example_block_says_how_it_is_tested():
    tested = [b for b in BLOCKS if b.language in TESTED_LANGUAGES]
    assert len(tested) >= 10
    for b in tested:
        assert b.action in {"run", "file", "skip"}, (
            f"README.md:{b.line}: a ```{b.language} block needs a marker comment just before it: "
            "<!-- readme-test: run | file NAME | skip WHY -->")
        assert b.action != "skip" or b.argument, f"README.md:{b.line}: say why the block is skipped"
        assert b.action != "file" or b.argument, f"README.md:{b.line}: name the file"
    assert [b.line for b in BLOCKS if b.action == "run" and b.language not in {"bash", "python"}] == []


def test_blocks_left_to_other_tests_are_run_by_them():
    """A block marked ``skip run by tests/X.py::test_y`` is run by those tests (through
    :func:`tests.helpers.readme.readme_command`, so they run the README's text, not a copy)."""
    import ast
    import re

    named = 0
    for b in BLOCKS:
        if b.action != "skip" or not b.argument.startswith("run by"):
            continue
        for path, name in re.findall(r"(tests/[\w/]+\.py)::(\w+)", b.argument):
            tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
            test = next((f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == name), None)
            assert test is not None, f"README.md:{b.line}: {path} has no test {name}"
            assert "readme_command(" in ast.unparse(test), f"README.md:{b.line}: {name} does not run the README's text"
            named += 1
    assert named >= 3


def test_markers_substitutions_still_match():
    for b in BLOCKS:
        b.shortened()


RUN_BLOCKS = [b for b in BLOCKS if b.action == "run"]


@pytest.fixture(scope="module")
def readme_home(tmp_path_factory) -> Path:
    """A folder laid out like the clone the README's commands run in, with the README's files written."""
    root = tmp_path_factory.mktemp("readme")
    home = root / "hetfl"
    home.mkdir()
    for name in ("configs", "examples"):
        (home / name).symlink_to(REPO / name)
    (root / "shared").symlink_to(SHARED_DATASETS.parent)
    for b in BLOCKS:
        if b.action == "file":
            (home / b.argument).write_text(b.shortened(), encoding="utf-8")
    return home


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.skipif(not SHARED_DATASETS.exists(), reason=f"{SHARED_DATASETS} absent: the README's examples read MNIST "
                    "and CIFAR-10 from it")
@needs_accountant
def test_the_readmes_examples_run_as_written(readme_home):
    """Every ``run`` block, in the README's order, in one test: later blocks use what earlier ones wrote
    (my.toml, runs/a...), so they cannot be spread over pytest-xdist's workers. A failure names the block."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1"}
    for block in RUN_BLOCKS:
        if block.language == "python":
            script = block.shortened()
            command = [sys.executable, "-c", script]
        else:
            script = "set -euo pipefail\n" + block.shortened()
            command = ["bash", "-c", script]
        done = subprocess.run(command, cwd=readme_home, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, (f"README.md:{block.line}: the block exited {done.returncode}\n{script}\n"
                                      f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")
