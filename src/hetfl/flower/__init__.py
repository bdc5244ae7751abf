"""hetfl on Flower: any hetfl method as a Flower app, simulated on Ray or deployed across processes.

The algorithm code is unchanged: the same hooks run, only where they run differs. The server
(:mod:`hetfl.flower.server`, a ``ServerApp``) keeps the round loop of
:class:`hetfl.engine.experiment.Experiment` (sampling, ``payload``, ``aggregate``, post-hoc
``apply``, global evaluation, metrics, checkpoints); every client-side hook (``begin``,
``stages``, ``finish``, ``setup_query``, post-hoc ``client_query``, personalised evaluation)
runs on the node holding that client's partition (:mod:`hetfl.flower.node`, one ``ClientApp``).

- ``hetfl run --set runtime.executor=flower``: Flower's simulation engine, in one command
  (:mod:`hetfl.flower.simulation`).
- deployment: ``flower-superlink`` + one ``flower-supernode`` per client + ``flwr run``
  (:mod:`hetfl.flower.deploy`, ``examples/flower/``).

Core hetfl never imports this package unless the Flower executor is asked for (:mod:`hetfl.runtimes`
picks it; the engine itself never imports it).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from hetfl.params import ConfigError

if TYPE_CHECKING:
    from hetfl.config import RunConfig

INSTALL_HINT = 'pip install "hetfl[flower]"'


def offline_defaults() -> None:
    """No telemetry, no update check (unless the user set these variables themselves)."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")


def require_flwr() -> None:
    """Raise a clear ImportError naming the extra when Flower is not installed."""
    try:
        import flwr  # noqa: F401
    except ImportError as err:
        raise ImportError(f"hetfl's Flower executor needs Flower: {INSTALL_HINT}") from err


def check_flower(cfg: RunConfig) -> None:
    """A missing Flower, and settings the Flower executor cannot honour, as ConfigErrors before any output."""
    try:
        import flwr  # noqa: F401
    except ImportError:
        raise ConfigError("runtime.executor", "flower",
                          'needs Flower, which is not installed: pip install "hetfl[flower]"') from None
    if cfg.runtime.save_client_models:
        raise ConfigError("runtime.save_client_models", list(cfg.runtime.save_client_models),
                          "is not supported with runtime.executor = flower (local models stay on the nodes)")
