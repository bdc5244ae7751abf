"""What computed a run: the software and device of each process that trained its rounds.

A run's numbers depend on more than its configuration: hetfl's own code (a method checked against its
authors' code and corrected, a bug fixed), torch's kernels, the device. ``summary.json`` therefore names,
under ``environment``, every environment that computed some of the run's rounds, in order: one entry for
a run made in one go, more where a run was resumed by another hetfl, torch or device. Each entry says
from which round on it computed (``from_round``), hetfl's version, the git commit of hetfl's source when it
runs from a git checkout (``+edits`` when that checkout's ``src`` differs from the commit; None for an
installed package), Python's and torch's versions, the device and the platform. The list travels in the
checkpoint, so a resumed run keeps the earlier entries. Under Flower it is the server's process: the nodes'
software and devices are their own.

The environment is not part of a run's identity (:mod:`hetfl.engine.identity`): the same configuration
resumed on another machine is the same run, and the file says that it was.
"""

from __future__ import annotations

import functools
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

import hetfl

#: the checkpoint's ``info`` key of the list of environments
ENVIRONMENTS_KEY = "environments"


@functools.cache
def source_commit() -> str | None:
    """The short git commit of the checkout hetfl runs from, ``+edits`` appended when its ``src`` differs from
    that commit; None when hetfl is not run from a git checkout (an installed package) or git is unavailable."""
    root = Path(hetfl.__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        edits = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--",
                                "src"], capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}+edits" if edits else commit or None


def device_name(device: torch.device) -> str:
    """``cpu``, or the accelerator's name (``cuda: NVIDIA H100 80GB HBM3``)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return device.type


def environment(device: torch.device) -> dict[str, Any]:
    """This process's environment (the entry :func:`extend` adds)."""
    return {"hetfl": hetfl.__version__, "hetfl_commit": source_commit(), "python": platform.python_version(),
            "torch": str(torch.__version__), "device": device_name(device),
            "platform": f"{platform.system()}-{platform.machine()}"}


def extend(earlier: list[dict[str, Any]], here: dict[str, Any], from_round: int) -> list[dict[str, Any]]:
    """``earlier`` (a checkpoint's list) with ``here`` appended as computing from ``from_round`` on, unless the
    last entry is the same environment (a resume on the same machine and code adds nothing)."""
    if earlier and {k: v for k, v in earlier[-1].items() if k != "from_round"} == here:
        return list(earlier)
    return [*earlier, {"from_round": from_round, **here}]
