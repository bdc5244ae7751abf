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

Core hetfl never imports this package unless the Flower executor is asked for.
"""

from __future__ import annotations

import os

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
