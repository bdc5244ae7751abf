"""Fixtures shared by the test modules, and two settings that hold for every test:

* **One torch CPU thread per test process** (``one_torch_thread``, autouse). The tests' models and
  batches are small: on one thread they run several times faster than on torch's default of a
  thread per core, which on a busy machine wait for each other at every operation; and under
  ``pytest -n N`` each of the N worker processes keeps to its core. A test that needs another count
  sets it (``runtime.threads`` or ``torch.set_num_threads``); it is put back to one before the next.
* **Processes a test starts import this hetfl**: the folder of the ``hetfl`` package the tests imported
  goes first on ``PYTHONPATH`` (a worktree's or a mutation tool's copy of the sources, not the installed one).
* **The tests' temporary folders are on a RAM file system where there is one** (Linux's ``/dev/shm`` with
  4 GiB free; ``PYTEST_DEBUG_TEMPROOT``, unless set). A run's checkpoint, metrics line and ledger each wait
  for ``fsync``, and the suite's runs make thousands of them: on the development VM's disk a durable write took
  0.6 ms when idle but 8 ms while other processes wrote (a mutation run, another suite), 0.03 ms on
  ``/dev/shm``. The writes are the same, only not waited for by a disk; the suite's time no longer depends
  on what else writes to it.
* **``runtime.device = "auto"`` is the CPU** (``HETFL_DEVICE=cpu``, set here for this process and
  every process it starts: CLI subprocesses, Flower's nodes). Tests that pin numbers or compare with
  a CPU computation then give the same result on a machine with CUDA as without. A CUDA test states
  its device (``runtime.device=cuda``, or tensors moved with ``.cuda()``) and is skipped where CUDA is
  absent; the suite has no test that relies on ``auto`` meaning CUDA.

Which tests run (:func:`pytest_collection_modifyitems`): **the tests marked ``slow`` only with ``--run-slow``**
(the whole suite, as CI runs it: ``.ci/run``), with a ``-m`` expression of one's own, or when tests are named by id
(``FILE::NAME``). ``pytest -q`` is the quick loop of development (about 2.5 minutes on 2 cores with ``-n auto``);
the 100 or so slow tests are end-to-end runs, Flower's deployments and the README's commands, which take about as
long again.

And one order for ``pytest -n N``, whose workers take the tests two at a time in this order
(:func:`pytest_configure`): **long tests first, the waiting ones spread among the others**, so that no worker waits
at the end for a long test that started last, and a worker waiting for Flower's or the README's processes (marked
``processes``) overlaps with one that computes, rather than with another that waits.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)  # before hetfl is imported: its "auto" threads (hetfl.engine.threads) start from here

import hetfl  # noqa: E402
from hetfl.engine.setup import AUTO_DEVICE_ENV  # noqa: E402

os.environ[AUTO_DEVICE_ENV] = "cpu"

#: the folder of the hetfl these tests import, first on every started process's PYTHONPATH: a ``hetfl run``,
#: a Flower node or a --jobs worker that a test starts runs the same sources as the test (a git worktree's, a
#: mutation tool's scratch copy), not whichever hetfl the environment has installed
HETFL_SOURCES = str(Path(hetfl.__file__).resolve().parent.parent)
_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != HETFL_SOURCES]
os.environ["PYTHONPATH"] = os.pathsep.join([HETFL_SOURCES, *_path])


#: where the tests' temporary folders go when PYTEST_DEBUG_TEMPROOT is unset: a RAM file system, if there is one
RAM_TEMPROOT, RAM_TEMPROOT_FREE = Path("/dev/shm"), 4 << 30


def ram_temproot() -> Path | None:
    """``/dev/shm`` when it is a writable folder with at least :data:`RAM_TEMPROOT_FREE` bytes free, else None
    (pytest's default, the system's temporary folder)."""
    try:
        stat = os.statvfs(RAM_TEMPROOT)
    except OSError:
        return None
    writable = RAM_TEMPROOT.is_dir() and os.access(RAM_TEMPROOT, os.W_OK | os.X_OK)
    return RAM_TEMPROOT if writable and stat.f_bavail * stat.f_frsize >= RAM_TEMPROOT_FREE else None


if "PYTEST_DEBUG_TEMPROOT" not in os.environ and (_root := ram_temproot()) is not None:
    os.environ["PYTEST_DEBUG_TEMPROOT"] = str(_root)  # read by pytest's tmp_path_factory, lazily


#: the option that runs the tests marked slow too
RUN_SLOW = "--run-slow"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(RUN_SLOW, action="store_true", default=False,
                     help="also run the tests marked slow (end-to-end runs, Flower's deployments, the README's "
                          "commands): the whole suite, as CI runs it")


def slow_tests_left_out(config: pytest.Config) -> bool:
    """Whether this session leaves out the tests marked slow: unless ``--run-slow`` is given, a ``-m``
    expression (which then says what runs) or a test named by id (``FILE::NAME``: run what was asked for)."""
    named = any("::" in str(arg) for arg in config.args)
    return not (config.getoption("run_slow") or config.option.markexpr or named)


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, hand the tests out two at a time (``--maxschedchunk 2``; unless given), in the order
    below: a worker never queues many tests behind a long one. Nothing without pytest-xdist."""
    if getattr(config.option, "maxschedchunk", 0) is None:
        config.option.maxschedchunk = 2


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests marked slow left out, unless :func:`slow_tests_left_out` says otherwise; then the tests that wait
    for processes, each followed by an equal share of the other slow tests, then the rest; each group in
    collection order, so every pytest-xdist worker collects the same list."""
    if slow_tests_left_out(config):
        left_out = [item for item in items if item.get_closest_marker("slow")]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]
    waiting = [item for item in items if item.get_closest_marker("processes")]
    slow = [item for item in items if item.get_closest_marker("slow") and not item.get_closest_marker("processes")]
    rest = [item for item in items if not item.get_closest_marker("slow") and not item.get_closest_marker("processes")]
    share = -(-len(slow) // max(len(waiting), 1))
    ordered: list[pytest.Item] = []
    for n, item in enumerate(waiting):
        ordered += [item, *slow[n * share : (n + 1) * share]]
    items[:] = [*ordered, *slow[len(waiting) * share :], *rest]


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Say that the slow tests were left out, and how to run them (under pytest-xdist, the controller says it)."""
    if slow_tests_left_out(config) and not hasattr(config, "workerinput"):
        terminalreporter.write_line(f"the tests marked slow were not run: {RUN_SLOW} runs them too (the whole "
                                    "suite, as CI does)")


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Every test starts on one torch thread (a test or a run that changed the count does not leak it)."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def own_method_registry():
    """Every test starts with the methods registered before it and no plug-in file a test loaded: a test's
    plug-in (a file in its tmp_path) neither clashes with another test's copy of it (one method name, two files:
    refused, hetfl.algorithms.check_name_free) nor is listed for the processes a later test starts (--jobs
    workers, Flower's simulated nodes load every plug-in file of the process)."""
    from hetfl import algorithms

    classes, files = dict(algorithms._CLASSES), dict(algorithms._PLUGIN_FILES)
    yield
    algorithms._CLASSES.clear()
    algorithms._CLASSES.update(classes)
    algorithms._PLUGIN_FILES.clear()
    algorithms._PLUGIN_FILES.update(files)


@pytest.fixture
def one_thread():
    """Run a test on one torch thread (now the default for every test: kept for the modules that ask
    for it); the thread count is restored afterwards."""
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
