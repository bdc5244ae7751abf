"""Deploying a hetfl run across processes: a Flower SuperLink, one SuperNode per client, ``flwr run``.

This is the machinery of ``examples/flower/deploy.py`` and of the deployment tests; on real
machines run the same three commands by hand (see ``examples/flower/README.md``):

1. ``flower-superlink`` (TLS by default: ``--ssl-ca-certfile``, ``--ssl-certfile``, ``--ssl-keyfile``;
   ``--insecure`` only on localhost);
2. on each client's machine ``flower-supernode --superlink HOST:PORT --root-certificates ca.pem
   --node-config 'partition-id=C num-partitions=N data-root="..." state-dir="..."'``;
3. ``flwr run APP_DIR SUPERLINK --run-config overrides.toml --stream`` where ``APP_DIR`` is
   :func:`write_app` 's folder and ``overrides.toml`` comes from :func:`write_run_config`.

Every process is started in its own session (process group) so that :meth:`Process.kill`
also ends what it spawned (a SuperNode's SuperExec and ClientApp processes).

:meth:`LocalFederation.run` is the watched form of :meth:`LocalFederation.submit`: it waits for
the SuperNodes to connect, starts ``flwr run`` and follows ``WORKDIR/flwr-run.log`` as it grows,
reporting the ServerApp's lines (one per round) as they come, and on failure says why: the
ServerApp's exception (``flwr run --stream`` exits 0 when the ServerApp raised: Flower 1.41 and 1.42 only
logs the traceback and "Exit Code: 201"), a SuperLink or SuperNode that died (exit code, last
lines of its log), or the phase a timeout was waiting for.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from hetfl import config as config_mod
from hetfl.algorithms import plugin_files
from hetfl.flower.app_plugins import PLUGINS_KEY, copy_plugins, plugins_listing

APP_PYPROJECT = """\
# A Flower App running hetfl: the code is the installed hetfl package (hetfl.flower);
# this folder only names its ServerApp and ClientApp. SuperLink and SuperNodes must run
# where `pip install "hetfl[flower]"` was done (runtime dependency installation off).
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "hetfl-app"
version = "1.0.0"
description = "hetfl methods on Flower"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "hetfl"

[tool.flwr.app.components]
serverapp = "hetfl.flower.server_app:app"
clientapp = "hetfl.flower.client_app:app"

[tool.flwr.app.config]
hetfl-config = ""   # the hetfl run configuration (TOML text)
run-dir = ""        # where the ServerApp writes config.toml, metrics.jsonl, summary.json, the checkpoint
resume = false      # continue the run in run-dir from its checkpoint
poll-s = 0.5        # seconds between the ServerApp's polls for replies
plugins = ""        # the plug-in files the app holds, with their sha256 (hetfl.flower.app_plugins)
"""


def write_app(folder: str | Path, plugins: Sequence[str | Path] = ()) -> Path:
    """A Flower App folder for ``flwr run``: a pyproject.toml naming hetfl's apps and the plug-in files
    (``--plugin FILE``) whose methods the run may use, which the ServerApp and the ClientApps load from it
    (:mod:`hetfl.flower.app_plugins`; give :func:`write_run_config` the same files)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(APP_PYPROJECT)
    copy_plugins(folder, plugins)
    return folder


def write_run_config(path: str | Path, config_text: str, run_dir: str | Path, *, resume: bool = False,
                     poll_s: float = 0.5, plugins: Sequence[str | Path] = ()) -> Path:
    """``flwr run --run-config`` overrides: the hetfl config, the run directory (absolute) and the plug-in files
    the app holds (:func:`write_app`), with their SHA-256."""
    path = Path(path)
    values: dict[str, Any] = {"hetfl-config": config_text, "run-dir": str(Path(run_dir).resolve()),
                              "resume": resume, "poll-s": poll_s}
    if plugins:
        values[PLUGINS_KEY] = plugins_listing(plugins)
    path.write_text(tomli_w.dumps(values))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


@dataclass
class TLSFiles:
    ca: Path  # the CA certificate nodes and the CLI trust (--root-certificates)
    cert: Path  # the SuperLink's certificate, signed by the CA
    key: Path  # the SuperLink's private key


def generate_tls(folder: str | Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"), days: int = 7) -> TLSFiles:
    """A throw-away CA and a SuperLink certificate for ``hosts`` (``cryptography``, which Flower needs)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder = Path(folder).resolve()  # the processes that read these files run in their own folders
    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hetfl test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    files = TLSFiles(folder / "ca.pem", folder / "server.pem", folder / "server.key")
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_private(files.key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return files


def write_private(path: Path, data: bytes) -> None:
    """Write a private key readable by its owner only (mode 0600 from creation, never briefly wider):
    into a new temporary file created 0600, then renamed over ``path``, so that an older key file with
    wider permissions is replaced, not rewritten in place with its old mode."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def flower_env(home: str | Path) -> dict[str, str]:
    """Environment of a Flower process: its own FLWR_HOME, offline, no dependency installation,
    this interpreter's scripts first on PATH (SuperLink/SuperNode start flwr-serverapp etc. by name)."""
    env = dict(os.environ)
    env.update({"FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
                "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "PYTHONUNBUFFERED": "1",
                "PATH": str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")})
    Path(home).mkdir(parents=True, exist_ok=True)
    return env


def _bin(name: str) -> str:
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


@dataclass
class Process:
    """A started Flower process (leader of its own process group) and its log file."""

    name: str
    popen: subprocess.Popen
    log: Path

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (the process and everything it started)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def stop(self, grace_s: float = 5.0) -> None:
        self.kill(signal.SIGTERM)
        self.reap(grace_s)

    def reap(self, grace_s: float = 5.0) -> None:
        """After a SIGTERM: wait up to ``grace_s`` for the process to end, then SIGKILL its group (children
        the leader left behind too)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(grace_s)
        self.kill(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(grace_s)

    def exit_report(self, lines: int = 12) -> str:
        """Why it is gone, for a person: its exit code (or signal) and the last lines of its log."""
        return f"{self.name} (pid {self.popen.pid}) {exit_description(self.popen.poll())}\n" + \
            log_tail(self.log, lines, f"last lines of {self.log}")


def exit_description(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name} (exit code {code})"
    return f"exited with code {code}"


ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def plain(text: str) -> str:
    """A log line without its colour codes."""
    return ANSI.sub("", text)


def log_tail(path: Path, lines: int = 12, title: str = "") -> str:
    """The last ``lines`` lines of a log file (colour codes removed), indented, under ``title``."""
    try:
        text = plain(path.read_text(errors="replace"))
    except OSError as err:
        return f"  ({path}: {err.strerror or err})"
    tail = [x for x in text.splitlines() if x.strip()][-lines:] or ["(empty)"]
    return (f"{title}:\n" if title else "") + "\n".join(f"  {x}" for x in tail)


def start(name: str, args: list[str], workdir: Path, env: dict[str, str], *, append: bool = False) -> Process:
    log = workdir / f"{name}.log"
    with open(log, "a" if append else "w") as out:
        popen = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                                 start_new_session=True)
    return Process(name, popen, log)


# what Flower 1.41 and 1.42 log: a SuperNode once the SuperLink registered it; the ServerApp's exception
NODE_CONNECTED = "SuperNode ID:"
SERVERAPP_RAISED = "ServerApp raised an exception"
LEVEL_LINE = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)\s*:\s+(?P<message>.*)$")
FLOWER_EXIT_CODE = re.compile(r"Exit Code: (\d+)")


class LogFollower:
    """The complete lines a growing log file gained since the last call (a partial last line waits)."""

    def __init__(self, path: Path, offset: int = 0) -> None:
        self.path, self.start, self.offset, self.rest = path, offset, offset, b""

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *complete, self.rest = (self.rest + data).split(b"\n")
        return [plain(x.decode(errors="replace")).rstrip() for x in complete]

    def since_start(self) -> str:
        """Everything the file gained since this follower was made (the current run's part of the log)."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.start)
                return fh.read().decode(errors="replace")
        except FileNotFoundError:
            return ""


def serverapp_error(log_text: str) -> str:
    """The ServerApp's exception in a ``flwr run --stream`` log, as ``Type: message`` with the
    traceback's last frames; "" if the log holds none. Flower prints "ServerApp raised an
    exception", the traceback, then "Exit Code: 201" and exits 0 itself."""
    lines = plain(log_text).splitlines()
    starts = [i for i, x in enumerate(lines) if x.strip().startswith("Traceback (most recent call last)")]
    if not starts:
        return ""
    block = lines[starts[-1]:]
    end = next((i for i, x in enumerate(block[1:], 1) if x.strip() and not x.startswith((" ", "\t"))), None)
    if end is None:
        return "\n".join(block[-12:])
    exception = [block[end]]
    for x in block[end + 1:]:  # a message over several lines, up to the next log line
        if not x.strip() or LEVEL_LINE.match(x) or FLOWER_EXIT_CODE.search(x):
            break
        exception.append(x)
    frames = [x for x in block[1:end] if x.strip().startswith("File ")][-3:]
    where = "".join(f"\n  {x.strip()}" for x in frames)
    code = next((m.group(1) for x in block[end:] if (m := FLOWER_EXIT_CODE.search(x))), None)
    flower = f" (Flower exit code {code})" if code else ""
    return "\n".join(exception) + flower + (f"\n  where:{where}" if where else "")


@dataclass
class LocalFederation:
    """A SuperLink and SuperNodes on this machine (loopback), for examples and tests."""

    workdir: Path
    num_nodes: int
    tls: TLSFiles | None = None
    data_root: str = ""
    state_dir: str = ""
    superlink_port: int = 0
    superlink: Process | None = None
    nodes: list[Process] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.superlink_port}"

    def start(self) -> LocalFederation:
        self.workdir = Path(self.workdir).resolve()  # every process runs in it: relative paths would break
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.superlink_port = self.superlink_port or free_port()
        security = (["--ssl-ca-certfile", str(self.tls.ca), "--ssl-certfile", str(self.tls.cert),
                     "--ssl-keyfile", str(self.tls.key)] if self.tls else ["--insecure"])
        self.superlink = start("superlink", [_bin("flower-superlink"), *security, "--host", "127.0.0.1",
                                             "--port", str(self.superlink_port),
                                             "--disable-runtime-dependency-installation"],
                               self.workdir, flower_env(self.workdir / "home-superlink"))
        if not wait_for(lambda: port_open(self.superlink_port) or not self.superlink.alive, 120, poll_s=0.2) \
                or not self.superlink.alive:
            why = (self.superlink.exit_report() if not self.superlink.alive else
                   f"port {self.superlink_port} not open after 120 s\n" + log_tail(self.superlink.log))
            self.stop()
            raise RuntimeError(f"the SuperLink did not start: {why}")
        for c in range(self.num_nodes):
            self.nodes.append(self.start_node(c))
        return self

    def start_node(self, client: int) -> Process:
        security = ["--root-certificates", str(self.tls.ca)] if self.tls else ["--insecure"]
        node_config = f"partition-id={client} num-partitions={self.num_nodes}"
        if self.data_root:
            node_config += f' data-root="{self.data_root}"'
        if self.state_dir:
            node_config += f' state-dir="{Path(self.state_dir) / f"node_{client}"}"'
        return start(f"supernode-{client}", [
            _bin("flower-supernode"), *security, "--superlink", self.address, "--port", str(free_port()),
            "--node-config", node_config], self.workdir, flower_env(self.workdir / f"home-node-{client}"))

    def cli_env(self) -> dict[str, str]:
        """The ``flwr`` CLI's environment, with a config naming this SuperLink as ``hetfl``."""
        home = self.workdir / "home-cli"
        env = flower_env(home)
        connection: dict[str, Any] = {"address": self.address}
        if self.tls:
            connection["root-certificates"] = str(self.tls.ca.resolve())
        else:
            connection["insecure"] = True
        (home / "config.toml").write_text(tomli_w.dumps({"superlink": {"default": "hetfl", "hetfl": connection}}))
        return env

    def submit(self, config_text: str, run_dir: str | Path, *, resume: bool = False, timeout_s: float = 600.0,
               poll_s: float = 0.5) -> subprocess.CompletedProcess:
        """``flwr run`` the hetfl app with this config; blocks (``--stream``) until the run ends."""
        app, overrides = self._write_app(config_text, run_dir, resume=resume, poll_s=poll_s)
        with open(self.workdir / "flwr-run.log", "a") as out:
            return subprocess.run([_bin("flwr"), "run", str(app), "hetfl", "--run-config", str(overrides), "--stream"],
                                  stdout=out, stderr=subprocess.STDOUT, env=self.cli_env(), cwd=self.workdir,
                                  timeout=timeout_s, check=False)

    def launch(self, config_text: str, run_dir: str | Path, *, resume: bool = False,
               poll_s: float = 0.5) -> Process:
        """Start ``flwr run`` the hetfl app with this config, without waiting: its output goes to
        ``WORKDIR/flwr-run.log`` (appended to), its process group is ended by :meth:`Process.stop`."""
        app, overrides = self._write_app(config_text, run_dir, resume=resume, poll_s=poll_s)
        return start("flwr-run", [_bin("flwr"), "run", str(app), "hetfl", "--run-config", str(overrides), "--stream"],
                     self.workdir, self.cli_env(), append=True)

    def _write_app(self, config_text: str, run_dir: str | Path, *, resume: bool, poll_s: float) -> tuple[Path, Path]:
        """The app folder and the run config of a run, with every plug-in file this process loaded (the nodes
        load them: their methods are the run's, as on the simulation)."""
        plugins = plugin_files()
        app = write_app(self.workdir / "app", plugins)
        return app, write_run_config(self.workdir / "run-config.toml", config_text, run_dir, resume=resume,
                                     poll_s=poll_s, plugins=plugins)

    def connected(self) -> list[Process]:
        """The SuperNodes the SuperLink has registered, as far as their logs say (``SuperNode ID:``)."""
        return [p for p in self.nodes if _log_has(p.log, NODE_CONNECTED)]

    def wait_connected(self, timeout_s: float, report: Callable[[str], None] = print) -> str:
        """Wait until every SuperNode is registered, reporting each new count; "" when they are, else
        why not (a SuperLink or SuperNode that died: its exit code and log; a timeout: who is missing)."""
        deadline, shown = time.monotonic() + timeout_s, -1
        while True:
            up = self.connected()
            if len(up) != shown:
                shown = len(up)
                report(f"SuperNodes connected: {shown}/{len(self.nodes)}")
            if shown == len(self.nodes):
                return ""
            if self.superlink is not None and not self.superlink.alive:
                return f"the SuperLink died while the SuperNodes were connecting: {self.superlink.exit_report()}"
            dead = [p for p in self.nodes if not p.alive]
            if dead:
                return "a SuperNode died before connecting: " + "\n".join(p.exit_report() for p in dead)
            if time.monotonic() > deadline:
                missing = [p for p in self.nodes if p not in up]
                return (f"timed out after {timeout_s:g} s waiting for the SuperNodes to connect ({shown}/"
                        f"{len(self.nodes)} connected; still waiting for {', '.join(p.name for p in missing)})\n"
                        + "\n".join(log_tail(p.log, 5, f"last lines of {p.log}") for p in missing[:3]))
            time.sleep(0.2)

    def run(self, config_text: str, run_dir: str | Path, *, resume: bool = False, timeout_s: float = 3600.0,
            poll_s: float = 0.5, report: Callable[[str], None] = print) -> RunOutcome:
        """Run the hetfl app on this federation and watch it: wait for the SuperNodes to connect,
        ``flwr run`` (:meth:`launch`), then follow ``flwr-run.log`` as it grows, passing what happens
        to ``report`` as one line each (the ServerApp's start, one line per round, client failures,
        SuperNodes that died) until ``flwr run`` ends or ``timeout_s`` (all phases together) passes.

        The log, not ``metrics.jsonl``, is followed: it carries the rounds (the ServerApp logs each
        round's ``metrics.jsonl`` line) and also what happens before round 1 and what goes wrong,
        which ``metrics.jsonl`` cannot show. A run succeeds when ``flwr run`` exits 0 and the run
        wrote ``summary.json``; otherwise :attr:`RunOutcome.cause` says why (:meth:`failure_cause`)."""
        deadline = time.monotonic() + timeout_s
        failure = self.wait_connected(timeout_s, report)
        if failure:
            return RunOutcome(False, failure)
        summary_path = Path(run_dir) / "summary.json"
        before = _mtime(summary_path)
        log = self.workdir / "flwr-run.log"
        follower = LogFollower(log, log.stat().st_size if log.exists() else 0)
        watch = RunWatch(report, _rounds(config_text))
        flwr = self.launch(config_text, run_dir, resume=resume, poll_s=poll_s)
        report(f"run submitted: flwr run --stream > {log}")
        try:
            failure = self._follow(flwr, follower, watch, deadline, timeout_s, _dead_node_wait(config_text))
        finally:
            flwr.stop()
        for line in follower.new_lines():  # what came between the last poll and the end
            watch.feed(line)
        # a resumed run that had finished logs "finished" and leaves summary.json as it was
        fresh = _mtime(summary_path) not in (None, before) or (watch.finished and summary_path.exists())
        if not failure and flwr.popen.returncode == 0 and fresh and not watch.raised:
            return RunOutcome(True, "", 0, json.loads(summary_path.read_text()))
        cause = failure or self.failure_cause(flwr.popen.returncode, follower.since_start(), summary_path)
        return RunOutcome(False, cause, flwr.popen.returncode)

    def _follow(self, flwr: Process, follower: LogFollower, watch: RunWatch, deadline: float, timeout_s: float,
                dead_node_wait: str = "") -> str:
        """Feed the log's new lines to ``watch`` until ``flwr run`` exits: "" then, or why it was stopped
        (``dead_node_wait``: what a phase that asks a dead node waits for, said when one dies)."""
        dead_nodes: set[str] = set()
        while flwr.alive:
            for line in follower.new_lines():
                watch.feed(line)
            if self.superlink is not None and not self.superlink.alive:
                return f"the SuperLink died during the run: {self.superlink.exit_report()}"
            for node in self.nodes:
                if not node.alive and node.name not in dead_nodes:  # the run may go on without it
                    dead_nodes.add(node.name)
                    watch.report(f"warning: {node.exit_report().splitlines()[0]}; its client counts as failed "
                                 f"when asked{dead_node_wait} (see {node.log})")
            if time.monotonic() > deadline:
                return (f"timed out after {timeout_s:g} s (--timeout) waiting for {watch.phase}\n"
                        + log_tail(follower.path, 10, f"last lines of {follower.path}"))
            time.sleep(0.2)
        return ""

    def failure_cause(self, returncode: int | None, log_text: str, summary_path: Path) -> str:
        """Why a run that ended did not succeed, from its part of ``flwr-run.log`` and the processes:
        the ServerApp's exception, else ``flwr run``'s own failure, else a run that ended without a
        summary; with the exit codes and last log lines of SuperNodes or the SuperLink that died."""
        error = serverapp_error(log_text)
        tail = "\n".join(f"  {x}" for x in [x for x in plain(log_text).splitlines() if x.strip()][-12:])
        if error:
            cause = f"the ServerApp failed: {error}"
        elif returncode:
            cause = f"flwr run {exit_description(returncode)}; last lines of its log:\n{tail}"
        else:
            cause = (f"flwr run ended (exit code {returncode}) but the run wrote no {summary_path}; "
                     f"last lines of its log:\n{tail}")
        gone = [p for p in [*([self.superlink] if self.superlink else []), *self.nodes] if not p.alive]
        return cause + "".join(f"\n{p.exit_report(6)}" for p in gone)

    def stop(self) -> None:
        """End every process: all are sent SIGTERM first, then waited for (each takes about a second to shut
        down; one after the other, a federation of a SuperLink and 3 SuperNodes took ~4 s to stop)."""
        processes = [*self.nodes, *([self.superlink] if self.superlink else [])]
        for process in processes:
            process.kill(signal.SIGTERM)
        for process in processes:
            process.reap()

    def __enter__(self) -> LocalFederation:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class RunOutcome:
    """How :meth:`LocalFederation.run` ended: ``ok`` with the run's ``summary.json``, or ``cause``
    (for a person: the ServerApp's exception, a process that died, the phase a timeout waited for)."""

    ok: bool
    cause: str = ""
    returncode: int | None = None  # flwr run's (None: it was not started)
    summary: dict[str, Any] | None = None


class RunWatch:
    """Turns ``flwr run --stream`` log lines into progress lines for a person, and keeps the phase
    the run is in (what a timeout was waiting for)."""

    def __init__(self, report: Callable[[str], None], rounds: int | None = None) -> None:
        self.report, self.rounds = report, rounds
        self.phase = "the SuperLink to accept the run (flwr run)"
        self.raised = False  # the ServerApp raised (flwr run still exits 0)
        self.finished = False  # the ServerApp logged its summary

    def feed(self, line: str) -> None:
        if line.startswith("Successfully started run"):
            self.report(f"SuperLink: {line.removeprefix('Successfully ')}; starting the ServerApp")
            self.phase = "the ServerApp to start (it loads the dataset and builds the model)"
            return
        # Flower's own lines carry a level ("ERROR :  ..."); the ServerApp's hetfl lines come bare
        match = LEVEL_LINE.match(line.strip())
        message = match.group("message") if match else line.strip()
        if match and match.group("level") == "ERROR" and SERVERAPP_RAISED in message:
            self.raised = True
            self.report("ServerApp raised an exception (the run stops; the cause follows when flwr run ends)")
        elif message.startswith("hetfl on Flower:"):
            self.report(f"ServerApp: {message.removeprefix('hetfl on Flower: ')}; greeting the nodes")
            self.phase = self._round_phase(1)
        elif message.startswith("hetfl: finished, "):
            self.report("ServerApp finished; the summary follows when flwr run ends")
            self.finished = True
            self.phase = "flwr run to end after the ServerApp finished"
        elif message.startswith("hetfl: {"):
            self._round(message.removeprefix("hetfl: "))
        elif message.startswith(("hetfl: ", "flower: ")):
            self.report(f"ServerApp: {message.split(': ', 1)[1]}")
        elif match and match.group("level") == "ERROR" and not FLOWER_EXIT_CODE.search(message):
            self.report(f"Flower: {message}")

    def _round(self, text: str) -> None:
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            self.report(f"ServerApp: {text}")
            return
        r = int(line.get("round", 0))
        parts = [f"round {r}" + (f"/{self.rounds}" if self.rounds else "")]
        if "train_loss" in line:
            parts.append(f"loss {line['train_loss']:.4f}")
        for key, name in (("global_acc", "global acc"), ("client_acc_mean", "client acc")):
            if key in line:
                parts.append(f"{name} {100 * line[key]:.2f}%")
        if line.get("failed_clients"):
            parts.append(f"failed clients {line['failed_clients']}")
        if "round_time_s" in line:
            parts.append(f"{line['round_time_s']:.1f} s")
        self.report(f"{parts[0]}: {', '.join(parts[1:])}")
        self.phase = self._round_phase(r + 1)

    def _round_phase(self, r: int) -> str:
        if self.rounds and r > self.rounds:
            return "the run to finish (summary, checkpoint)"
        return f"round {r}" + (f" of {self.rounds}" if self.rounds else "") + " (the ServerApp's next log line)"


def _rounds(config_text: str) -> int | None:
    try:
        return int(tomllib.loads(config_text)["train"]["rounds"])
    except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError):
        return None


def _dead_node_wait(config_text: str) -> str:
    """What a phase that asks a dead node waits for under the run's config, for the warning that one died: with
    no grace (the default), until Flower reports the node gone or the timeout, and how to wait less."""
    defaults = config_mod.RuntimeConfig()
    try:
        runtime = tomllib.loads(config_text).get("runtime", {})
        grace = float(runtime.get("flower_grace_s", defaults.flower_grace_s))
        timeout = float(runtime.get("flower_timeout_s", defaults.flower_timeout_s))
    except (tomllib.TOMLDecodeError, TypeError, ValueError, AttributeError):
        return ""
    if grace < timeout:
        return f"; a phase waits at most {grace:g} s for it once its quorum has answered (runtime.flower_grace_s)"
    return (f"; a phase that asks it waits until Flower reports the node gone (two missed heartbeats, about a "
            f"minute) or runtime.flower_timeout_s = {timeout:g} s passes: runtime.flower_grace_s = G ends the wait G s "
            f"after the quorum answered")


def _log_has(path: Path, text: str) -> bool:
    try:
        return text in path.read_text(errors="replace")
    except OSError:
        return False


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def wait_for(predicate: Any, timeout_s: float, poll_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return bool(predicate())
