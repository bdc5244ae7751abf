"""Fixtures of the executor tests."""

from __future__ import annotations

import pytest

from hetfl.engine import vectorized
from hetfl.engine.vectorized import CompiledCall


@pytest.fixture
def compiled_runs(monkeypatch):
    """Counts the compiled calls run in static or graph mode and the padded ones among them."""
    counts = {"runs": 0, "padded": 0, "blocks": 0}
    original = CompiledCall.run

    def counting(self, call):
        counts["runs"] += not self.eager
        counts["blocks"] += call.steps > 1
        counts["padded"] += call.rows is not None and bool((call.rows == self.group.buffers.k).any())
        return original(self, call)

    monkeypatch.setattr(CompiledCall, "run", counting)
    return counts


@pytest.fixture
def compiled_calls(monkeypatch):
    """How many steps ran through the compiled function (not the uncompiled fallback)."""
    calls = {"n": 0}
    real = vectorized.run_compiled

    def counted(*args):  # type: ignore[no-untyped-def]
        out = real(*args)
        calls["n"] += 1
        return out

    monkeypatch.setattr(vectorized, "run_compiled", counted)
    return calls
