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
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

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
"""


def write_app(folder: str | Path) -> Path:
    """A Flower App folder for ``flwr run`` (only a pyproject.toml naming hetfl's apps)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(APP_PYPROJECT)
    return folder


def write_run_config(path: str | Path, config_text: str, run_dir: str | Path, *, resume: bool = False,
                     poll_s: float = 0.5) -> Path:
    """``flwr run --run-config`` overrides: the hetfl config and the run directory (absolute)."""
    path = Path(path)
    path.write_text(tomli_w.dumps({"hetfl-config": config_text, "run-dir": str(Path(run_dir).resolve()),
                                   "resume": resume, "poll-s": poll_s}))
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
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(grace_s)
        self.kill(signal.SIGKILL)  # children the leader left behind too
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(grace_s)


def start(name: str, args: list[str], workdir: Path, env: dict[str, str]) -> Process:
    log = workdir / f"{name}.log"
    with open(log, "w") as out:
        popen = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                                 start_new_session=True)
    return Process(name, popen, log)


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
            self.stop()
            raise RuntimeError(f"the SuperLink did not start; see {self.superlink.log}")
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
        app = write_app(self.workdir / "app")
        overrides = write_run_config(self.workdir / "run-config.toml", config_text, run_dir, resume=resume,
                                     poll_s=poll_s)
        with open(self.workdir / "flwr-run.log", "a") as out:
            return subprocess.run([_bin("flwr"), "run", str(app), "hetfl", "--run-config", str(overrides), "--stream"],
                                  stdout=out, stderr=subprocess.STDOUT, env=self.cli_env(), cwd=self.workdir,
                                  timeout=timeout_s, check=False)

    def stop(self) -> None:
        for process in [*self.nodes, *([self.superlink] if self.superlink else [])]:
            process.stop()

    def __enter__(self) -> LocalFederation:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_for(predicate: Any, timeout_s: float, poll_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return bool(predicate())
