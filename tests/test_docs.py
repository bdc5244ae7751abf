"""What the prose of README.md, docs/ and examples/ names exists (issue: the docs audit): every configuration key,
method setting, repository file and test it points to, every default it states in a ``key (default value)`` form
or a settings table, and every model and dataset the code offers is named in the README. The README's fenced
blocks are run by tests/test_readme.py; nothing else reads the prose, so a renamed key or a moved file would
otherwise leave the docs pointing at nothing."""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
import tomllib
from pathlib import Path

import pytest

from hetfl import config
from hetfl.algorithms import _POSTHOC, _REGISTRY

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "examples").rglob("*.md")),
        *sorted((REPO / "examples").rglob("*.py"))]
#: settings of the README's own plug-in example (``featnorm``), and the key hetfl adds for a plug-in's source
PLUGIN_EXAMPLE_KEYS = {"weight", "plugin_source"}
#: ```KEY` (default `V``` in prose
STATED_DEFAULT = re.compile(r"`((?:data|train|runtime|tracking|model|algorithm\.ccvr)\.[a-z_0-9]+)`\s*"
                            r"\(default[:,]?\s*`([^`]+)`")


def _doc_texts() -> list[tuple[Path, str]]:
    return [(path, path.read_text(encoding="utf-8")) for path in DOCS]


def _where(path: Path, text: str, position: int) -> str:
    return f"{path.relative_to(REPO)}:{text.count(chr(10), 0, position) + 1}"


def _hyper_fields(target: str) -> dict[str, dataclasses.Field]:
    module, cls = target.split(":")
    return {f.name: f for f in dataclasses.fields(getattr(importlib.import_module(module), cls).Hyper)}


def _section_docs() -> dict[str, str]:
    """Every ``section.key``'s meaning (what ``hetfl list config`` prints)."""
    return {f"{section}.{f.name}": f.metadata.get("doc", "") for section, cls in config.SECTIONS.items()
            for f in dataclasses.fields(cls)}


def _section_defaults() -> dict[str, object]:
    """Every ``section.key`` of the schema with its default, plus ``seed`` and ``algorithm.name``."""
    keys: dict[str, object] = {"seed": 0, "algorithm.name": "fedavg"}
    for section, cls in config.SECTIONS.items():
        for f in dataclasses.fields(cls):
            keys[f"{section}.{f.name}"] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return keys


def _step_defaults() -> dict[str, object]:
    """Every post-hoc step's setting (``algorithm.ccvr.dp_epsilon``) with its default."""
    return {f"algorithm.{step}.{name}": f.default for step, target in _POSTHOC.items()
            for name, f in _hyper_fields(target).items()}


def test_every_section_key_the_docs_name_is_a_key_of_the_configuration():
    keys = _section_defaults()
    wrong = []
    for path, text in _doc_texts():
        for m in re.finditer(r"(?<![\w.])(data|train|runtime|tracking|model)\.([a-z_][a-z0-9_]*)\b(?![.(])", text):
            key = f"{m.group(1)}.{m.group(2)}"
            if key not in keys and key not in {"tracking.json", "tracking.py"}:  # a run folder's file, a module
                wrong.append(f"{_where(path, text, m.start())}: {key}")
    assert wrong == [], "keys named in the docs that `hetfl list config` does not have:\n" + "\n".join(wrong)


def test_every_method_setting_the_docs_name_is_a_setting_of_some_method_or_post_hoc_step():
    method_keys = set().union(*(_hyper_fields(t) for t in _REGISTRY.values()))
    step_keys = {step: set(_hyper_fields(t)) for step, t in _POSTHOC.items()}
    wrong = []
    for path, text in _doc_texts():
        for m in re.finditer(r"(?<![\w.])algorithm\.([a-z_][a-z0-9_]*)(?:\.([a-z_][a-z0-9_]*))?", text):
            first, second = m.groups()
            if first in step_keys:
                ok = second is None or second in step_keys[first]
            else:
                ok = first == "name" or first in method_keys or first in PLUGIN_EXAMPLE_KEYS
            if not ok:
                wrong.append(f"{_where(path, text, m.start())}: {m.group(0)}")
    assert wrong == [], "method settings named in the docs that no method has:\n" + "\n".join(wrong)


def test_every_repository_file_and_test_the_docs_point_to_exists():
    """``src/...``, ``tests/...``, ``benchmarks/...``, ``configs/...``, ``docs/...``, ``examples/...`` paths, and
    ``tests/X.py::test_name`` references (the README's markers are checked by test_readme.py; prose too here)."""
    missing = []
    for path, text in _doc_texts():
        for m in re.finditer(r"(?<![\w/.-])((?:src|tests|benchmarks|configs|docs|examples)/[\w./-]*\w)(?:::(\w+))?",
                             text):
            target, test = m.groups()
            file = REPO / target
            if not file.exists():
                missing.append(f"{_where(path, text, m.start())}: {target}")
            elif test and not re.search(rf"^\s*def {test}\(", file.read_text(encoding="utf-8"), re.MULTILINE):
                missing.append(f"{_where(path, text, m.start())}: {target} has no {test}")
    assert missing == [], "the docs point to files or tests that do not exist:\n" + "\n".join(missing)


def _same(stated: str, default: object) -> bool:
    """A default as the docs write it (``0``, ``true``, ``inf``, ``'sequential'``, ``600``) against the code's."""
    text = stated.strip().strip("`")
    if text in {"", "''", '""', "empty"}:
        return default in ("", (), [], {})
    if text == "inf":
        return isinstance(default, float) and math.isinf(default)
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip("'\"")
    if isinstance(default, bool) or isinstance(value, bool):
        return value is default
    if isinstance(default, int | float) and isinstance(value, int | float):
        return float(value) == float(default)
    return value == default


def _stated_defaults() -> list[tuple[str, str, str]]:
    """(where, key, stated default) for every ``KEY`` (default ``V``) in the prose and every settings table row
    ``| `KEY` | V | ...`` whose header's second column is ``default``."""
    stated = []
    for path, text in _doc_texts():
        for m in re.finditer(STATED_DEFAULT, text):
            stated.append((_where(path, text, m.start()), m.group(1), m.group(2)))
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if re.match(r"\|\s*(setting|key)\s*\|\s*default\s*\|", line):
                for row in lines[i + 2:]:
                    cells = [c.strip() for c in row.strip().strip("|").split("|")]
                    if not row.startswith("|") or len(cells) < 2:
                        break
                    key = cells[0].strip("`")
                    stated.append((f"{path.relative_to(REPO)}:{lines.index(row) + 1}", key, cells[1]))
    return stated


def test_every_default_the_docs_state_is_the_codes_default():
    defaults = {**_section_defaults(), **_step_defaults()}
    stated = _stated_defaults()
    assert len(stated) >= 5, "the patterns no longer find the docs' defaults; update this test"
    meanings = _section_docs()  # '' = what the key's meaning says it stands for (data.cache_dir's folder)
    wrong = [f"{where}: {key} default stated {value!r}, code {defaults.get(key, 'no such key')!r}"
             for where, key, value in stated if key not in defaults or not (
                 _same(value, defaults[key]) or (defaults[key] == "" and f"'' = {value}" in meanings.get(key, "")))]
    assert wrong == [], "\n".join(wrong)


@pytest.mark.parametrize("kind", ["models", "datasets", "partitions"])
def test_the_readme_names_every_model_dataset_and_partition_the_code_offers(kind):
    from hetfl.models import MODELS

    names = {"models": list(MODELS), "datasets": list(config.DATASET_NAMES),
             "partitions": [p for p in config.PARTITION_NAMES if p != "auto"]}[kind]
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert [n for n in names if f"`{n}`" not in readme] == []
