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
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import SHARED_DATASETS

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"<!--\s*readme-test:\s*(.*?)-->", re.DOTALL)
TESTED_LANGUAGES = {"bash", "python", "toml"}


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    language: str
    text: str
    action: str = ""  # run | file | skip
    argument: str = ""  # the file name, or why a block is skipped
    substitutions: list[tuple[str, str]] = field(default_factory=list)

    def shortened(self) -> str:
        text = self.text
        for old, new in self.substitutions:
            if old not in text:
                raise AssertionError(f"README.md:{self.line}: the marker's substitution {old!r} no longer "
                                     "matches the block; update the marker")
            text = text.replace(old, new.replace("\\n", "\n"))
        return text


def parse_marker(body: str) -> tuple[str, str, list[tuple[str, str]]]:
    first, *rest = body.strip().splitlines()
    action, _, argument = first.strip().partition(" ")
    subs = []
    for line in rest:
        if line.strip():
            old, sep, new = line.strip().partition(" => ")
            if not sep:
                old, new = line.strip().removesuffix(" =>"), ""
            subs.append((old, new))
    return action, argument.strip(), subs


def readme_blocks(text: str) -> list[Block]:
    """The fenced blocks with their markers (the comment ending on the line before the fence)."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened or not opened.group(1):
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        block = Block(i + 1, opened.group(1), "\n".join(lines[i + 1:end]) + "\n")
        before = "\n".join(lines[max(0, i - 12):i])
        found = list(MARKER.finditer(before))
        if found and before[found[-1].end():].strip() == "":
            block.action, block.argument, block.substitutions = parse_marker(found[-1].group(1))
        blocks.append(block)
        i = end + 1
    return blocks


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


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_DATASETS.exists(), reason=f"{SHARED_DATASETS} absent: the README's examples read MNIST "
                    "and CIFAR-10 from it")
@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[f"README.md:{b.line}" for b in RUN_BLOCKS])
def test_the_readmes_examples_run_as_written(readme_home, block):
    """Each block in the README's order (later blocks use what earlier ones wrote: my.toml, runs/a...)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1"}
    if block.language == "python":
        script = block.shortened()
        command = [sys.executable, "-c", script]
    else:
        script = "set -euo pipefail\n" + block.shortened()
        command = ["bash", "-c", script]
    done = subprocess.run(command, cwd=readme_home, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (f"README.md:{block.line}: the block exited {done.returncode}\n{script}\n"
                                  f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")
