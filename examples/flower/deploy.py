"""Deploy a hetfl run on Flower on this machine: a SuperLink, one SuperNode per client, ``flwr run``.

    python examples/flower/deploy.py --out runs/deployed \\
        --set algorithm.name=scaffold --set data.num_clients=3 --set data.partition=dirichlet \\
        --set train.rounds=5

Every SuperNode is a separate process holding one client's partition of the dataset found in
``--data-root`` (default: the config's ``data.root``). TLS is on: a throw-away CA and SuperLink
certificate are made in ``WORKDIR/tls`` (``--insecure`` turns TLS off, for the loopback only).
The run directory (``config.toml``, ``metrics.jsonl``, ``summary.json``, the checkpoint) is
written by the ServerApp; each node keeps its client's state in ``WORKDIR/state/node_C`` so that
``--resume`` continues a stateful method exactly. Everything started is stopped at the end
(also on Ctrl-C). See README.md next to this file for the same steps across machines.

The run is checked first exactly as ``hetfl run`` checks it (configuration, run directory,
memory, method against model, dataset and partition: the experiment is set up once here), so
bad input exits 2 with ``hetfl run``'s one-line message before any process starts. While it runs
the script prints what happens (SuperLink up, SuperNodes connected, one line per round as the
ServerApp logs it); a failed run exits 1 naming its cause (the ServerApp's exception, a process
that died, or the phase a timeout was waiting for).

A method of your own (``--plugin FILE``, as for ``hetfl run``) travels inside the Flower App that
``flwr run`` sends: the ServerApp and every ClientApp load the file from it (its SHA-256 is checked).

Every SuperNode is a Python process, and each message it gets starts another (a ClientApp that
imports torch and loads the dataset): one node per client on one machine is for small
federations (a handful of clients on a laptop; 30 nodes on 2 cores spend minutes starting).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import tempfile
from pathlib import Path

from hetfl import config as config_mod
from hetfl.config import RunConfig
from hetfl.engine.experiment import CONFIG_NAME
from hetfl.engine.identity import load_run_config
from hetfl.flower.deploy import LocalFederation, generate_tls, write_app, write_run_config


def say(message: str) -> None:
    print(message, flush=True)


def checked_config(args: argparse.Namespace, out: Path) -> RunConfig:
    """The run's configuration, checked as ``hetfl run`` checks it before writing anything (the CLI's
    and the engine's own checks: run directory free and writable, then the whole set-up of the
    experiment, which refuses a method whose model lacks a part it needs, a dataset or partition
    that does not fit, a plan that cannot fit in memory). Raises what ``hetfl run`` raises."""
    from hetfl.console import check_new_run_dir
    from hetfl.engine.experiment import Experiment
    from hetfl.engine.rundir import check_unlocked
    from hetfl.runtimes import check_runtime

    check_unlocked(out)
    cfg = run_config(args, out)
    if not args.resume:
        check_new_run_dir(out)
    check_runtime(cfg)  # the Flower executor's own checks (settings it cannot honour)
    Experiment(cfg)  # the ServerApp sets the same experiment up; here its errors come before any process
    return cfg


def run_config(args: argparse.Namespace, out: Path) -> RunConfig:
    """The run's configuration: CONFIG with the ``--set`` overrides; with ``--resume``, ``--out``'s own
    config.toml, as ``hetfl run --resume`` reads it: a CONFIG or a ``--set`` of a key that changes the
    numbers is refused (it would be ignored: the run goes on as it started), one that changes none is
    taken (tracking, ``runtime.client_metrics_every`` ...). Raises ``hetfl run``'s errors."""
    from hetfl.cli import _changes_no_number
    from hetfl.engine.identity import PRESENTATION_KEYS
    from hetfl.params import ConfigError

    forced = ["runtime.executor=flower", "runtime.progress=false"]  # the ServerApp has no terminal
    if not args.resume:
        return config_mod.load(args.config, [*args.set, *forced])
    changing = [s.partition("=")[0].strip() for s in args.set if not _changes_no_number(s)]
    if args.config or changing:
        given = ", ".join([*([f"CONFIG {args.config}"] if args.config else []), *(f"--set {k}" for k in changing)])
        others = sorted(k for k in PRESENTATION_KEYS if not k.startswith("tracking."))
        raise ConfigError("--resume", str(out), f"takes no CONFIG or --set of a key that changes the numbers (here: "
                                                f"{given}): the run's config.toml is used; --set takes "
                                                f"tracking.KEY=VALUE and {', '.join(others)}")
    return load_run_config(out / CONFIG_NAME, [*args.set, *forced])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", help="a hetfl TOML config (as for `hetfl run`)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--out", required=True, help="run directory")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its checkpoint, with its own config.toml "
                             "(no CONFIG; --set only of keys that change no number)")
    parser.add_argument("--data-root", default="", help="the nodes' dataset folder (default: data.root)")
    parser.add_argument("--workdir", default="",
                        help="logs, certificates, node state (default: a temporary folder; --resume needs the "
                             "first run's --workdir, where the nodes kept their clients' state)")
    parser.add_argument("--insecure", action="store_true", help="no TLS (loopback only)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before giving up on the run")
    parser.add_argument("--write-run-config", metavar="FILE", default="",
                        help="only write `flwr run --run-config` overrides for this config and --out (for a "
                             "SuperLink and SuperNodes you started yourself), start nothing")
    parser.add_argument("--plugin", action="append", default=[], metavar="FILE",
                        help="Python file that registers extra methods with @hetfl.algorithms.register (as for "
                             "`hetfl run`); shipped to the nodes inside the Flower App")
    parser.add_argument("--app-dir", default="", metavar="DIR",
                        help="with --write-run-config: write the Flower App there (with the --plugin files) "
                             "for `flwr run DIR ...` (default: examples/flower/app, which holds no plug-in)")
    args = parser.parse_args(argv)
    # SIGTERM (and SIGINT, which shells ignore in background jobs) end the run through the
    # `finally` of deploy(), which stops every process started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = Path(args.out).resolve()
    try:
        from hetfl.algorithms import load_plugin
        from hetfl.flower.app_plugins import check_shippable

        check_shippable(args.plugin)  # before anything starts: the nodes would never see such a file
        for plugin in args.plugin:
            load_plugin(plugin)
        if args.write_run_config:
            return write_only(args, out)
        cfg = checked_config(args, out)
    except _user_errors() as err:
        print(f"hetfl: error: {err}", file=sys.stderr)
        return 2
    return deploy(cfg, args, out)


def write_only(args: argparse.Namespace, out: Path) -> int:
    """``--write-run-config``: the overrides for a federation elsewhere, whose dataset need not be on
    this machine, so only the configuration is checked here (the ServerApp sets the run up there). With
    ``--plugin`` files, the app that carries them is written to ``--app-dir`` (required then)."""
    from hetfl.params import ConfigError

    if args.plugin and not args.app_dir:
        raise ConfigError("--app-dir", "", "is needed with --plugin and --write-run-config: the folder to write the "
                                           "Flower App holding the plug-in files, for `flwr run DIR ...`")
    cfg = run_config(args, out)
    app = write_app(args.app_dir, args.plugin) if args.app_dir else Path(__file__).parent / "app"
    write_run_config(args.write_run_config, config_mod.dumps(cfg), out, resume=args.resume, plugins=args.plugin)
    print(f"wrote {args.write_run_config}{f' and the app {app}' if args.app_dir else ''}: flwr run "
          f"{shlex.quote(str(app)) if args.app_dir else 'examples/flower/app'} SUPERLINK --run-config "
          f"{args.write_run_config} --stream")
    return 0


def deploy(cfg: RunConfig, args: argparse.Namespace, out: Path) -> int:
    """Start the federation, run, report; everything started is stopped on the way out."""
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hetfl-flower-")).resolve()
    tls = None if args.insecure else generate_tls(workdir / "tls")
    n = cfg.data.num_clients
    fed = LocalFederation(workdir, n, tls=tls, data_root=args.data_root, state_dir=str(workdir / "state"))
    rounds = cfg.train.rounds
    say(f"{cfg.algorithm.name} on {cfg.data.dataset}, {n} clients, {rounds} round{'s' * (rounds != 1)}; starting a "
        f"SuperLink and {n} SuperNodes (logs, certificates and node state in {workdir})")
    try:  # the finally stops what was started, also on Ctrl-C and SIGTERM (SystemExit) while starting
        try:
            fed.start()
        except RuntimeError as err:  # the SuperLink did not start: its exit code and log
            print(f"deploy: {err}", file=sys.stderr)
            return 1
        say(f"SuperLink up on {fed.address} ({'TLS' if tls else 'insecure, loopback only'}); "
            f"{n} SuperNodes started, waiting for them to connect")
        outcome = fed.run(config_mod.dumps(cfg), out, resume=args.resume, timeout_s=args.timeout, report=say)
    except (KeyboardInterrupt, SystemExit) as err:  # Ctrl-C, SIGTERM: what was started is stopped (finally)
        print(f"deploy: interrupted; every process started was stopped\n{continue_hint(args, out, workdir)}",
              file=sys.stderr)
        return 130 if isinstance(err, KeyboardInterrupt) else int(err.code or 1)
    finally:
        fed.stop()
    if not outcome.ok:
        print(f"deploy: the run failed: {outcome.cause}\nlogs: {workdir} (flwr-run.log, superlink.log, "
              f"supernode-C.log)\n{continue_hint(args, out, workdir)}", file=sys.stderr)
        return 1
    summary = outcome.summary or {}
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))
    print(f"run directory: {out}")
    return 0


def continue_hint(args: argparse.Namespace, out: Path, workdir: Path) -> str:
    """How to continue a run that stopped (too few clients answered, a timeout, Ctrl-C): this script with
    ``--resume`` and the same run directory, work folder (the nodes' client state), data root and TLS setting,
    once its cause is fixed; or, if the run wrote nothing yet, to start it again."""
    if not (out / CONFIG_NAME).is_file():
        return "deploy: the run wrote nothing yet; run the same command again once the cause is fixed"
    command = ["python", str(Path(__file__)), "--resume", "--out", str(out), "--workdir", str(workdir),
               *(["--data-root", args.data_root] if args.data_root else []), *(["--insecure"] if args.insecure else []),
               *[x for plugin in args.plugin for x in ("--plugin", plugin)]]
    return f"deploy: to continue from the run's last checkpoint once the cause is fixed: {shlex.join(command)}"


def _user_errors() -> tuple[type[BaseException], ...]:
    """What ``hetfl run`` exits 2 on (bad input), from the CLI itself."""
    from hetfl.cli import _user_errors as cli_user_errors

    return cli_user_errors()


if __name__ == "__main__":
    sys.exit(main())
