"""Fixtures of the Flower tests."""

from __future__ import annotations

import importlib.util
import signal
from pathlib import Path

import pytest

DEPLOY_SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "flower" / "deploy.py"


@pytest.fixture
def script():
    """examples/flower/deploy.py as a module; the SIGTERM handler its main() installs is put back after."""
    spec = importlib.util.spec_from_file_location("hetfl_flower_deploy_example", DEPLOY_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    handler = signal.getsignal(signal.SIGTERM)
    yield module
    signal.signal(signal.SIGTERM, handler)
