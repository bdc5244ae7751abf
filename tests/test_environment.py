"""The tests of an optional extra are skipped where it is not installed (a user's machine, a lent GPU machine
without a registry); CI installs ``[test]``, and there a missing extra would turn its tests into silent skips:
there it fails instead."""

from __future__ import annotations

import os
from importlib.util import find_spec

import pytest

#: the modules whose absence skips tests (pytest.importorskip, tests.helpers.needs_accountant), and the extra
#: of pyproject.toml that brings each
SKIPPED_WITHOUT = {"dp_accounting": "privacy", "flwr": "flower", "ray": "flower", "PIL": "images"}


@pytest.mark.skipif(not os.environ.get("CI"), reason="only in CI (CI set), which installs hetfl[test]")
@pytest.mark.parametrize("module", sorted(SKIPPED_WITHOUT))
def test_ci_has_every_extra_whose_absence_skips_tests(module):
    assert find_spec(module) is not None, (
        f"{module} is missing: the tests that need it were skipped (pip install -e \".[test]\", "
        f"which brings hetfl[{SKIPPED_WITHOUT[module]}])")
