"""Plug-in methods on a Flower deployment: shipped inside the Flower App, loaded where the app runs.

A deployment's ServerApp and ClientApps are processes that Flower starts from the app's FAB (Flower App
Bundle: the app folder that ``flwr run`` packs and sends to the SuperLink, which hands it to every
SuperNode). They know hetfl's own methods, not those a researcher's ``--plugin FILE`` registered in the
process that started the run. So the app folder carries the plug-in files (:func:`copy_plugins`: under
``hetfl_plugins/<i>/``, keeping each file's name, which is part of the run's ``algorithm.plugin_source``),
the run config lists them with their SHA-256 (:data:`PLUGINS_KEY`, :func:`plugins_listing`), and the
ServerApp and every ClientApp load them before they build the experiment (:func:`load_app_plugins`), from
the installed FAB's folder (which Flower puts on ``sys.path``), refusing a file whose content is not the listed
one. This is Flower's own way to ship an app's code; the simulation (one machine) instead names the files
in the nodes' environment (:data:`hetfl.flower.protocol.PLUGINS_ENV`).
"""

from __future__ import annotations

import fnmatch
import hashlib
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from hetfl.algorithms import load_plugin, plugin_files
from hetfl.params import ConfigError

#: run config key (``flwr run --run-config``): the app's plug-in files, ``"PATH sha256:HEX"`` entries joined by
#: ``";"``, PATH relative to the app folder (Flower's run config holds strings, numbers and booleans only)
PLUGINS_KEY = "plugins"
#: the app folder's sub-folder that holds the plug-in files
APP_PLUGINS_DIR = "hetfl_plugins"
#: file names that Flower leaves out of a FAB (``flwr.common.constant.FAB_EXCLUDE_PATTERNS``: tests)
FAB_EXCLUDED_NAMES = ("test_*.py", "*_test.py")


class PluginShippingError(RuntimeError):
    """A plug-in file listed in the run config is not in the app, or is not the file the run was started with."""


def file_digest(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, in hex: what the run config lists and a node checks."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def app_path(index: int, file: str | Path) -> PurePosixPath:
    """Where the app folder holds the ``index``-th plug-in file: ``hetfl_plugins/<index>/NAME`` (two files of
    one name from different folders do not overwrite each other; the name itself is kept)."""
    return PurePosixPath(APP_PLUGINS_DIR, str(index), Path(file).name)


def plugins_listing(files: Sequence[str | Path]) -> str:
    """The run config's :data:`PLUGINS_KEY` value for ``files`` (as :func:`copy_plugins` lays them out)."""
    return ";".join(f"{app_path(i, f)} sha256:{file_digest(f)}" for i, f in enumerate(files))


def check_shippable(files: Sequence[str | Path]) -> None:
    """A ConfigError naming ``--plugin`` for a file that Flower would leave out of the app it sends (a name
    like a test's): the nodes would not find it. Checked before any process starts."""
    for file in files:
        if any(fnmatch.fnmatch(Path(file).name, pattern) for pattern in FAB_EXCLUDED_NAMES):
            raise ConfigError("--plugin", str(file), f"Flower leaves files named {' or '.join(FAB_EXCLUDED_NAMES)} "
                              "out of the app it sends to the nodes (as tests): rename the file")


def copy_plugins(app: str | Path, files: Sequence[str | Path]) -> None:
    """Copy ``files`` into the app folder ``app`` (:func:`app_path`), replacing what an earlier write left
    there; a file Flower would leave out of the app is refused first (:func:`check_shippable`)."""
    check_shippable(files)
    shutil.rmtree(Path(app) / APP_PLUGINS_DIR, ignore_errors=True)
    for i, file in enumerate(files):
        target = Path(app) / app_path(i, file)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, target)


def listed_plugins(run_config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The (relative path, sha256 hex) pairs of the run config's :data:`PLUGINS_KEY` (none if absent)."""
    pairs = []
    for entry in str(run_config.get(PLUGINS_KEY, "")).split(";"):
        if not entry.strip():
            continue
        relative, _, digest = entry.strip().rpartition(" sha256:")
        if not relative or not digest:
            raise PluginShippingError(f"run config {PLUGINS_KEY}: {entry!r} is not 'PATH sha256:HEX'")
        pairs.append((relative, digest))
    return pairs


def load_app_plugins(run_config: Mapping[str, Any], search: Sequence[str] | None = None) -> list[str]:
    """Load the plug-in files the run config lists from the app's folder: the first folder of ``search``
    (default ``sys.path``, where Flower puts the installed app) that holds the listed path. Returns the files
    loaded; a file this process loaded already is not run again. Raises :class:`PluginShippingError` naming
    the file when no folder holds it, or when its SHA-256 is not the listed one."""
    loaded, done = set(plugin_files()), []
    for relative, digest in listed_plugins(run_config):
        folders = [Path(p) for p in (sys.path if search is None else search) if p]
        found = next((f / relative for f in folders if (f / relative).is_file()), None)
        if found is None:
            raise PluginShippingError(f"the plug-in file {relative} that the run lists is not in the Flower App "
                                      f"this process runs (searched {len(folders)} folders of sys.path): write "
                                      "the app with the run's --plugin files (examples/flower/deploy.py "
                                      "--app-dir) and `flwr run` that folder")
        if (held := file_digest(found)) != digest:
            raise PluginShippingError(f"the plug-in file {found} is not the one the run was started with "
                                      f"(sha256 {held[:16]}, the run lists {digest[:16]}): write the "
                                      "app and the run config again from the same --plugin files")
        if str(found.resolve()) not in loaded:
            load_plugin(str(found))
            done.append(str(found))
    return done
