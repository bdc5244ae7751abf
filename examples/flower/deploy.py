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
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path

from hetfl import config as config_mod
from hetfl.engine.experiment import CONFIG_NAME, SUMMARY_NAME
from hetfl.flower.deploy import LocalFederation, generate_tls, write_run_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", help="a hetfl TOML config (as for `hetfl run`)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--out", required=True, help="run directory")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    parser.add_argument("--data-root", default="", help="the nodes' dataset folder (default: data.root)")
    parser.add_argument("--workdir", default="",
                        help="logs, certificates, node state (default: a temporary folder; --resume needs the "
                             "first run's --workdir, where the nodes kept their clients' state)")
    parser.add_argument("--insecure", action="store_true", help="no TLS (loopback only)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before giving up on the run")
    parser.add_argument("--write-run-config", metavar="FILE", default="",
                        help="only write `flwr run --run-config` overrides for this config and --out (for a "
                             "SuperLink and SuperNodes you started yourself), start nothing")
    args = parser.parse_args(argv)
    # SIGTERM (and SIGINT, which shells ignore in background jobs) end the run through the
    # `with` below, which stops every process started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    out = Path(args.out).resolve()
    if args.resume:
        cfg = config_mod.load(out / CONFIG_NAME)
    else:
        cfg = config_mod.load(args.config, [*args.set, "runtime.executor=flower", "runtime.progress=false"])
    if args.write_run_config:
        write_run_config(args.write_run_config, config_mod.dumps(cfg), out, resume=args.resume)
        print(f"wrote {args.write_run_config}: flwr run examples/flower/app SUPERLINK --run-config "
              f"{args.write_run_config} --stream")
        return 0
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hetfl-flower-")).resolve()
    tls = None if args.insecure else generate_tls(workdir / "tls")
    fed = LocalFederation(workdir, cfg.data.num_clients, tls=tls, data_root=args.data_root,
                          state_dir=str(workdir / "state"))
    with fed:
        print(f"SuperLink on {fed.address} ({'TLS' if tls else 'insecure'}), {cfg.data.num_clients} SuperNodes; "
              f"logs in {workdir}; running (flwr run --stream > {workdir / 'flwr-run.log'})", flush=True)
        result = fed.submit(config_mod.dumps(cfg), out, resume=args.resume, timeout_s=args.timeout)
    if result.returncode != 0 or not (out / SUMMARY_NAME).exists():
        print(f"the run failed (flwr run exit code {result.returncode}); see {workdir}/*.log", file=sys.stderr)
        return 1
    summary = json.loads((out / SUMMARY_NAME).read_text())
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))
    print(f"run directory: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
