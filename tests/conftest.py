"""Fixtures shared by the test modules. None is autouse: a module asks for one with
``pytestmark = pytest.mark.usefixtures("one_thread")`` or by naming it as a test's parameter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture
def one_thread():
    """Run a test on one torch thread (small models run faster on one thread than on two, and do
    not fight other jobs for the cores); the thread count is restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A private HOME without XDG_CACHE_HOME, so nothing lands in the real ~/.cache."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    return tmp_path / "home"
