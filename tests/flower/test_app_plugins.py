"""A researcher's plug-in methods on a Flower deployment: the Flower App carries the ``--plugin`` files, the run
config lists them with their SHA-256, and the ServerApp and ClientApps load them from the installed app
(hetfl.flower.app_plugins). Before, a deployment's processes knew only hetfl's own methods. The end-to-end run
is tests/flower/test_flower_deploy.py's."""

from __future__ import annotations

import tomllib

import pytest

pytest.importorskip("flwr", reason='Flower is not installed: pip install "hetfl[flower]"')

from hetfl import algorithms
from hetfl.flower.app_plugins import PLUGINS_KEY, PluginShippingError, load_app_plugins
from hetfl.flower.deploy import write_app, write_run_config
from hetfl.params import ConfigError
from tests.helpers.plugins import EMA_PLUGIN

OTHER = EMA_PLUGIN.replace("emaprox_test", "emaprox_other").replace("EmaProx", "EmaOther")


def two_plugins_of_one_name(tmp_path):
    """Two plug-in files named ``method.py`` in two folders, registering two methods."""
    files = []
    for folder, text in (("a", EMA_PLUGIN), ("b", OTHER)):
        (tmp_path / folder).mkdir()
        files.append(tmp_path / folder / "method.py")
        files[-1].write_text(text)
    return files


def test_the_app_carries_the_plugins_and_the_app_process_loads_them_from_it(tmp_path):
    """Two files of one name are both shipped (neither overwrites the other), keep their names, and are loaded
    from the folder where Flower installed the app, not from where they were written."""
    files = two_plugins_of_one_name(tmp_path)
    app = write_app(tmp_path / "app", files)
    run_config = tomllib.loads(write_run_config(tmp_path / "run.toml", "", tmp_path / "run", plugins=files)
                               .read_text())
    shipped = sorted(p.relative_to(app).as_posix() for p in app.rglob("*.py"))
    assert shipped == ["hetfl_plugins/0/method.py", "hetfl_plugins/1/method.py"]
    for f in files:
        f.unlink()  # the node has only the app
    assert "emaprox_test" not in algorithms._CLASSES
    loaded = load_app_plugins(run_config, search=["", str(tmp_path / "elsewhere"), str(app)])
    assert sorted(loaded) == sorted(str(app / s) for s in shipped)
    assert {"emaprox_test", "emaprox_other"} <= set(algorithms._CLASSES)
    assert algorithms.plugin_source("emaprox_test").startswith("method.py sha256:")  # the run's identity keeps its name
    assert load_app_plugins(run_config, search=[str(app)]) == []  # once per process


def test_a_plugin_edited_after_the_run_config_was_written_is_refused_naming_both_digests(tmp_path):
    files = two_plugins_of_one_name(tmp_path)
    run_config = tomllib.loads(write_run_config(tmp_path / "run.toml", "", tmp_path / "run", plugins=files)
                               .read_text())
    files[1].write_text(OTHER + "\n# edited\n")
    app = write_app(tmp_path / "app", files)
    with pytest.raises(PluginShippingError, match=r"hetfl_plugins/1/method.py is not the one the run was started "
                                                  r"with \(sha256 [0-9a-f]{16}, the run lists [0-9a-f]{16}\)"):
        load_app_plugins(run_config, search=[str(app)])
    assert "emaprox_other" not in algorithms._CLASSES


def test_a_run_config_listing_plugins_that_the_app_lacks_says_how_to_write_the_app(tmp_path):
    """``flwr run examples/flower/app`` (no plug-ins) with a run config that lists one: the ServerApp stops."""
    files = two_plugins_of_one_name(tmp_path)
    run_config = tomllib.loads(write_run_config(tmp_path / "r.toml", "", tmp_path, plugins=files[:1]).read_text())
    with pytest.raises(PluginShippingError, match=r"hetfl_plugins/0/method.py .* is not in the Flower App .*--app-dir"):
        load_app_plugins(run_config, search=[str(write_app(tmp_path / "app"))])
    with pytest.raises(PluginShippingError, match="is not 'PATH sha256:HEX'"):
        load_app_plugins({PLUGINS_KEY: "method.py"}, search=[])


def test_a_run_without_plugins_lists_none_and_loads_nothing(tmp_path):
    run_config = tomllib.loads(write_run_config(tmp_path / "run.toml", "", tmp_path / "run").read_text())
    assert PLUGINS_KEY not in run_config and load_app_plugins(run_config, search=[]) == []


def test_a_plugin_file_that_flower_leaves_out_of_the_app_is_refused_by_name(tmp_path):
    """Flower's FAB build drops ``test_*.py`` and ``*_test.py``: the nodes would never see such a file."""
    plugin = tmp_path / "test_method.py"
    plugin.write_text(EMA_PLUGIN)
    with pytest.raises(ConfigError, match=r"--plugin.*test_method.py.*rename the file"):
        write_app(tmp_path / "app", [plugin])
    assert not (tmp_path / "app" / "hetfl_plugins").exists()


def test_the_deploy_script_refuses_such_a_file_before_starting_anything(script, tmp_path, capsys):
    plugin = tmp_path / "my_method_test.py"
    plugin.write_text(EMA_PLUGIN)
    code = script.main(["--plugin", str(plugin), "--set", "algorithm.name=emaprox_test", "--out", str(tmp_path / "run"),
                        "--workdir", str(tmp_path / "federation")])
    assert code == 2 and "hetfl: error: --plugin" in capsys.readouterr().err
    assert not (tmp_path / "federation").exists() and not (tmp_path / "run").exists()


def test_the_deploy_script_writes_the_app_with_the_plugins_for_a_federation_elsewhere(script, tmp_path, capsys):
    """``--write-run-config`` with ``--plugin``: the app folder goes to ``--app-dir`` (required: the static
    examples/flower/app holds no plug-in), and the run config lists what it holds."""
    plugin = tmp_path / "ema_method.py"
    plugin.write_text(EMA_PLUGIN)
    common = ["--plugin", str(plugin), "--set", "algorithm.name=emaprox_test", "--out", str(tmp_path / "run"),
              "--write-run-config", str(tmp_path / "run.toml")]
    assert script.main(common) == 2
    assert "hetfl: error: --app-dir" in capsys.readouterr().err and not (tmp_path / "run.toml").exists()
    assert script.main([*common, "--app-dir", str(tmp_path / "app")]) == 0
    assert f"flwr run {tmp_path / 'app'} SUPERLINK --run-config" in capsys.readouterr().out
    run_config = tomllib.loads((tmp_path / "run.toml").read_text())
    assert "emaprox_test" in run_config["hetfl-config"]
    algorithms._CLASSES.pop("emaprox_test")
    load_app_plugins(run_config, search=[str(tmp_path / "app")])
    assert "emaprox_test" in algorithms._CLASSES
