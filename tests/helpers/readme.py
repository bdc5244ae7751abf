"""The README's fenced blocks and their test markers (tests/test_readme.py), and single commands taken from
them for the tests that run a README command themselves to check its output (marker ``skip run by TEST``)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
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




def readme_command(prefix: str) -> list[str]:
    """The README's one bash command that starts with ``prefix`` (continuation lines joined, a trailing
    comment dropped), split as the shell would: for a test that runs it and checks what it prints."""
    found = []
    for block in readme_blocks(README.read_text(encoding="utf-8")):
        if block.language != "bash":
            continue
        for line in block.text.replace("\\\n", " ").splitlines():
            if line.startswith(prefix):
                found.append(shlex.split(line, comments=True))
    assert len(found) == 1, f"README.md has {len(found)} commands starting with {prefix!r}, expected one"
    return found[0]
