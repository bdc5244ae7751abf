"""Freed CPU tensor memory kept in the process for the next step (``runtime.keep_freed_memory``).

PyTorch takes CPU tensors from the C library's ``malloc``. By default glibc serves a large request (above
its mmap threshold: 128 KiB at start, raised by what is freed up to 32 MiB) with a fresh mapping that it
unmaps on ``free``, and gives the top of its heap back to the system once more than the trim threshold
is free there. A training step allocates and frees the same activations and gradients at every step, so
the same memory goes back to the system and returns as new pages, each zeroed on its first touch: a round
of the 2-conv CNN at batch 64 on two CPU threads took 0.3 to 1.0 million minor page faults and was 1.2x
as long as with the memory kept (``benchmarks/host_memory.py``, ``benchmarks/results/host_memory_cpu.md``).
PyTorch's CPU performance guide advises another allocator (jemalloc, tcmalloc) for this reason; glibc's
own ``mallopt`` does the same here, with no new dependency: no chunk is mapped apart (``M_MMAP_MAX = 0``)
and the heap is trimmed only above 2 GiB free (``M_TRIM_THRESHOLD``).

The setting is process-wide, made once, and changes no number (where a tensor lives in memory is not what
a kernel computes: PyTorch aligns every CPU tensor to 64 bytes either way). The process keeps its peak
heap while it runs; :func:`release_freed_memory` gives the free part back (``malloc_trim``) when a run
ends. Nothing is changed off glibc, or where the user chose the allocator's behaviour: a ``MALLOC_*``
variable, ``GLIBC_TUNABLES`` naming a malloc tunable, or another allocator in ``LD_PRELOAD``.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Mapping

#: mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
#: free bytes at the heap's top above which glibc still gives memory back while a run goes on: the largest
#: value mallopt takes (a C int)
TRIM_THRESHOLD = 2**31 - 1

_kept = False


def allocator_choice(env: Mapping[str, str]) -> str | None:
    """Where the environment ``env`` already chooses how malloc behaves, what does (to leave it so); else None."""
    for name in sorted(env):
        if name.startswith("MALLOC_"):  # glibc's MALLOC_ARENA_MAX, MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_MAX_...
            return name
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    preload = env.get("LD_PRELOAD", "")
    if "malloc" in preload:  # libjemalloc, libtcmalloc, libmimalloc...
        return f"LD_PRELOAD={preload}"
    return None


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def keep_freed_memory(env: Mapping[str, str] | None = None) -> bool:
    """Make glibc's malloc keep freed memory in the process (module docstring); True when the process now
    does (also when an earlier call made it so), False where nothing was changed (not glibc, or the
    environment chose: :func:`allocator_choice`)."""
    global _kept
    if _kept:
        return True
    libc = _glibc()
    if libc is None or allocator_choice(os.environ if env is None else env) is not None:
        return False
    # mallopt returns 1 on success; the trim threshold first: setting either ends glibc's dynamic thresholds
    _kept = bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(libc.mallopt(M_MMAP_MAX, 0))
    return _kept


def kept() -> bool:
    """Whether this process keeps freed memory (:func:`keep_freed_memory` changed malloc)."""
    return _kept


def release_freed_memory() -> None:
    """Give the free memory the process kept back to the system (glibc's ``malloc_trim(0)``), e.g. when a
    run ends in a notebook; nothing where :func:`keep_freed_memory` changed nothing."""
    libc = _glibc() if _kept else None
    if libc is not None:
        libc.malloc_trim(0)
