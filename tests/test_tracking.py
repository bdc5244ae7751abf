"""TensorBoard and MLflow tracking (hetfl.tracking), tested with the real packages and their real local
stores: TensorBoard's event files read back with TensorBoard's own reader, a local MLflow file store
queried with ``MlflowClient``. Each run is a 2-4 round logistic regression on 4 tiny synthetic clients
(a few ms a round); the MLflow import (~3 s) is paid once per module."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

mlflow = pytest.importorskip("mlflow", reason="tracking tests need the 'mlflow' extra (part of the test extra)")
pytest.importorskip("tensorboard", reason="tracking tests need the 'tensorboard' extra (part of the test extra)")

from mlflow.tracking import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.util import tensor_util  # noqa: E402

from hetfl import config, tracking  # noqa: E402
from hetfl.cli import main  # noqa: E402
from hetfl.config import TrackingConfig  # noqa: E402
from hetfl.engine import identity  # noqa: E402
from hetfl.engine.experiment import Experiment  # noqa: E402
from hetfl.params import ConfigError  # noqa: E402
from hetfl.runtimes import set_up  # noqa: E402
from tests.helpers.runs import interrupted  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["data.partition=iid", "data.num_clients=4", "data.options={num_devices=8, max_samples=60}",
        "runtime.progress=false", "runtime.threads=1"]
TRACKING_KEYS = [f"tracking.{name}" for name in TrackingConfig.__dataclass_fields__]


@pytest.fixture(autouse=True)
def file_store_allowed(monkeypatch):
    """MLflow 3 refuses its file store unless this is set; the tests use a file store in tmp_path."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


def tiny(*overrides: str) -> config.RunConfig:
    return config.load(None, [*TINY, *overrides])


def store(tmp_path: Path) -> str:
    return f"tracking.mlflow_uri={tmp_path / 'mlruns'}"


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def numeric(line: dict) -> dict[str, float]:
    """What a tracker logs of a metrics line: its scalar numbers, the round being the step."""
    return {k: float(v) for k, v in line.items() if k != "round" and isinstance(v, int | float)}


# ------------------------------------------------------------------ readers
def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of a TensorBoard folder as [(step, value)], read by TensorBoard's own accumulator
    (which drops events a later session purged, as TensorBoard's UI does)."""
    acc = EventAccumulator(str(folder))
    acc.Reload()
    out = {}
    for tag in acc.Tags()["tensors"]:
        if acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars":
            out[tag] = [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in acc.Tensors(tag)]
    return out


def mlflow_runs(tmp_path: Path, experiment: str = "hetfl") -> tuple[MlflowClient, list]:
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    exp = client.get_experiment_by_name(experiment)
    return client, ([] if exp is None else client.search_runs([exp.experiment_id]))


def mlflow_history(client: MlflowClient, run_id: str, keys) -> dict[str, list[tuple[int, float]]]:
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}


def per_round(lines: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as the trackers should hold it: each number's (round, value), in round order."""
    out: dict[str, list[tuple[int, float]]] = {}
    for line in lines:
        for key, value in numeric(line).items():
            out.setdefault(key, []).append((line["round"], value))
    return out


def without_times(history: dict[str, list]) -> dict[str, list]:
    """A metric history less the wall-clock times (round_time_s, eval_time_s), which a recomputed round
    measures anew."""
    return {k: v for k, v in history.items() if not k.endswith("_time_s")}


# ------------------------------------------------------------------ TensorBoard
def test_tensorboard_events_hold_each_round_of_metrics_jsonl(tmp_path):
    """2 rounds: one scalar per number of each metrics line, step = round, the very values (double
    precision); the config as text at step 0; the summary's numbers as summary/<key> at the last round."""
    run = tmp_path / "run"
    summary = set_up(tiny("train.rounds=2", "tracking.tensorboard=true")).run(run)
    lines = metrics(run)
    scalars = tensorboard_scalars(run / "tensorboard")
    per_round_tags = {k: v for k, v in scalars.items() if not k.startswith("summary/")}
    assert per_round_tags == per_round(lines)
    assert {k for k in per_round_tags} >= {"train_loss", "global_acc", "client_acc_mean", "bytes_up", "lr"}
    assert scalars["summary/final_global_acc"] == [(2, summary["final_global_acc"])]
    assert scalars["summary/bytes_up_total"] == [(2, summary["bytes_up_total"])]
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    (text,) = acc.Tensors("config/text_summary")
    assert text.step == 0 and "rounds = 2" in tensor_util.make_ndarray(text.tensor_proto).item().decode()
    assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")
    assert json.loads((run / tracking.STATE_NAME).read_text())["tensorboard"] == {
        "dir": str((run / "tensorboard").absolute()), "rounds": 2}


def test_shared_tensorboard_root_gives_each_run_its_folder(tmp_path):
    """tracking.tensorboard_dir is a root shared by runs (events in <root>/<run name>); a second run of the
    same name would mix its steps into the first one's: refused naming tracking.run_name, before writing."""
    root = tmp_path / "tb"
    for name in ("a", "b"):
        set_up(tiny("train.rounds=1", "tracking.tensorboard=true", f"tracking.tensorboard_dir={root}")).run(
            tmp_path / name)
    assert sorted(p.name for p in root.iterdir()) == ["a", "b"]
    assert [s for s, _ in tensorboard_scalars(root / "a")["train_loss"]] == [1]
    with pytest.raises(ConfigError, match=r"tracking\.run_name.*already holds TensorBoard events"):
        set_up(tiny("train.rounds=1", "tracking.tensorboard=true", f"tracking.tensorboard_dir={root}",
                        "tracking.run_name=a")).run(tmp_path / "c")
    assert not (tmp_path / "c").exists()


# ------------------------------------------------------------------ MLflow
def test_mlflow_run_holds_config_rounds_summary_and_files(tmp_path):
    """One MLflow run: params = the resolved config flattened; each metric's history = metrics.jsonl's
    numbers per round; the summary's numbers; the run folder's files as artifacts; status FINISHED."""
    run = tmp_path / "run"
    exp = set_up(tiny("train.rounds=2", "tracking.mlflow=true", store(tmp_path), "tracking.run_name=demo"))
    summary = exp.run(run)
    client, runs = mlflow_runs(tmp_path)
    (found,) = runs
    flat = identity.flatten(config.to_tree(exp.cfg))
    assert found.data.params == {k: v if isinstance(v, str) else json.dumps(v) for k, v in flat.items()}
    assert found.data.params["model.name"] == "mlp", "the resolved config (auto replaced), not the given one"
    expected = per_round(metrics(run))
    assert mlflow_history(client, found.info.run_id, expected) == expected
    assert found.data.metrics["summary/final_global_acc"] == summary["final_global_acc"]
    assert found.data.metrics["summary/bytes_down_total"] == summary["bytes_down_total"]
    kept = {a.path for a in client.list_artifacts(found.info.run_id)}
    assert kept == {p.name for p in tracking.artifacts(run)} >= {"config.toml", "metrics.jsonl", "summary.json"}
    downloaded = Path(client.download_artifacts(found.info.run_id, "metrics.jsonl", str(tmp_path)))
    assert downloaded.read_bytes() == (run / "metrics.jsonl").read_bytes()
    assert found.info.run_name == "demo" and found.info.status == "FINISHED"
    assert found.data.tags["hetfl.run_id"] == summary["run_id"]
    assert found.data.tags["hetfl.setting_id"] == summary["setting_id"]
    assert json.loads((run / tracking.STATE_NAME).read_text())["mlflow"]["run_id"] == found.info.run_id


def test_mlflow_artifacts_include_the_run_folders_plots(tmp_path):
    """PNGs in the run folder when the run finishes (a run writes none itself) go along as artifacts,
    in their subfolder, and every per-round log; the TensorBoard folder, checkpoint and state do not."""
    files = tracking.artifacts
    run = tmp_path / "run"
    (run / "analysis").mkdir(parents=True)
    (run / "tensorboard").mkdir()
    for name in ("config.toml", "metrics.jsonl", "client_metrics.jsonl", "summary.json", "checkpoint.safetensors",
                 "tracking.json", "analysis/cka.png", "tensorboard/x.png"):
        (run / name).write_text("x")
    assert [p.relative_to(run).as_posix() for p in files(run)] == [
        "config.toml", "metrics.jsonl", "client_metrics.jsonl", "summary.json", "analysis/cka.png"]


# ------------------------------------------------------------------ resume
def test_resume_continues_the_same_mlflow_run_and_tensorboard_folder(tmp_path, monkeypatch):
    """4 rounds, checkpoints every 2, interrupted in round 4: rounds 1-3 are logged, the checkpoint is at
    round 2, so round 3 is recomputed on resume. The resumed run continues the one MLflow run (KILLED
    in between, FINISHED after) and the TensorBoard folder: every round once, with metrics.jsonl's values."""
    run = tmp_path / "run"
    cfg = tiny("train.rounds=4", "runtime.checkpoint_every=2", "tracking.mlflow=true", "tracking.tensorboard=true",
               store(tmp_path))
    interrupted(run, 3, monkeypatch, cfg)
    client, runs = mlflow_runs(tmp_path)
    (first,) = runs
    assert first.info.status == "KILLED"
    assert [m.step for m in client.get_metric_history(first.info.run_id, "train_loss")] == [1, 2, 3]
    assert main(["run", "--resume", str(run), "--quiet"]) == 0
    client, runs = mlflow_runs(tmp_path)
    (found,) = runs
    assert found.info.run_id == first.info.run_id and found.info.status == "FINISHED"
    expected = per_round(metrics(run))
    assert [s for s, _ in expected["train_loss"]] == [1, 2, 3, 4]
    logged = mlflow_history(client, found.info.run_id, expected)
    assert {k: [s for s, _ in v] for k, v in logged.items()} == {k: [s for s, _ in v] for k, v in expected.items()}
    # round 3 keeps the values logged first: the same numbers, but for the times measured while it ran
    assert without_times(logged) == without_times(expected), "each round once, with metrics.jsonl's values"
    scalars = tensorboard_scalars(run / "tensorboard")
    assert {k: v for k, v in scalars.items() if not k.startswith("summary/")} == expected, "purged, then rewritten"


def test_tracking_switched_on_at_resume_is_the_same_run(tmp_path, monkeypatch, capsys):
    """Tracking keys are not part of a run's identity: a run started without tracking, interrupted after
    round 1, resumes (`hetfl run --resume DIR --set tracking.KEY=VALUE`) with both backends on; they get
    round 1 from metrics.jsonl, then rounds 2-3. Other keys stay refused with --resume."""
    run = tmp_path / "run"
    interrupted(run, 1, monkeypatch, tiny("train.rounds=3"))
    assert main(["run", "--resume", str(run), "--quiet", "--set", "train.lr=0.1"]) == 2
    assert "tracking.KEY=VALUE" in capsys.readouterr().err
    on = ["tracking.mlflow=true", "tracking.tensorboard=true", store(tmp_path)]
    assert main(["run", "--resume", str(run), "--quiet", *[a for o in on for a in ("--set", o)]]) == 0
    summary = json.loads((run / "summary.json").read_text())
    plain = config.to_tree(set_up(tiny("train.rounds=3")).cfg)  # resolved, tracking off
    assert summary["run_id"] == identity.run_id(plain) and summary["setting_id"] == identity.setting_id(plain)
    expected = per_round(metrics(run))
    client, runs = mlflow_runs(tmp_path)
    (found,) = runs
    assert mlflow_history(client, found.info.run_id, expected) == expected
    assert {k: v for k, v in tensorboard_scalars(run / "tensorboard").items()
            if not k.startswith("summary/")} == expected


def test_tracking_keys_are_presentation_keys_listed_by_hetfl_list(capsys):
    """Every tracking key is left out of a run's identity and is listed by `hetfl list config`."""
    assert set(TRACKING_KEYS) <= identity.PRESENTATION_KEYS
    off, on = config.to_tree(tiny()), config.to_tree(tiny(
        "tracking.mlflow=true", "tracking.tensorboard=true", "tracking.mlflow_uri=sqlite:///x.db",
        "tracking.experiment=other", "tracking.run_name=r", "tracking.tensorboard_dir=tb"))
    assert identity.run_id(off) == identity.run_id(on) and identity.differing_keys(off, on) == []
    assert main(["list", "config"]) == 0
    listed = capsys.readouterr().out
    assert all(key in listed for key in TRACKING_KEYS), [k for k in TRACKING_KEYS if k not in listed]


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(("key", "module", "extra"), [("mlflow", "mlflow", "mlflow"),
                                                      ("tensorboard", "tensorboard", "tensorboard")])
def test_missing_package_names_the_extra_before_writing(key, module, extra, tmp_path, monkeypatch, capsys):
    """A backend switched on without its package: exit 2 naming the key and the extra; no folder is made."""
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    out = tmp_path / "run"
    argv = ["run", "--out", str(out), "--quiet", *[a for o in [*TINY, f"tracking.{key}=true", store(tmp_path)]
                                                   for a in ("--set", o)]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"tracking.{key}" in err and f"pip install 'hetfl[{extra}]'" in err
    assert not out.exists() and not (tmp_path / "mlruns").exists()


def test_mlflow_file_store_refused_by_mlflow_is_named_before_writing(tmp_path, monkeypatch):
    """MLflow 3 refuses a file store without MLFLOW_ALLOW_FILE_STORE: said up front, naming the key and the
    variable, with nothing written (not MLflow's exception after config.toml)."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    with pytest.raises(ConfigError, match=r"tracking\.mlflow_uri.*MLFLOW_ALLOW_FILE_STORE=true"):
        set_up(tiny("train.rounds=1", "tracking.mlflow=true", store(tmp_path))).run(tmp_path / "run")
    assert not (tmp_path / "run").exists() and not (tmp_path / "mlruns").exists()


@pytest.mark.parametrize(("override", "key"), [
    ("tracking.experiment=''", "tracking.experiment"),
    ("tracking.run_name='a/b'", "tracking.run_name"),
    ("tracking.mlflow='yes'", "tracking.mlflow"),
    ("tracking.mlflow_uri=' sqlite:///x.db'", "tracking.mlflow_uri"),
    ("tracking.uri='x'", "tracking.uri"),
])
def test_bad_tracking_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        tiny(override)
    assert err.value.key == key


def test_store_uris_are_made_absolute(tmp_path, monkeypatch):
    """A store named relative to the current folder is remembered absolute (a resume from elsewhere
    continues in the same store); server URIs stay as given."""
    monkeypatch.chdir(tmp_path)
    assert tracking.absolute_uri("mlruns") == (tmp_path / "mlruns").as_uri()
    assert tracking.absolute_uri("file:mlruns") == (tmp_path / "mlruns").as_uri()
    assert tracking.absolute_uri("sqlite:///mlflow.db") == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert tracking.absolute_uri("sqlite:////abs/m.db") == "sqlite:////abs/m.db"
    assert tracking.absolute_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert tracking.absolute_uri("databricks") == "databricks"


# ------------------------------------------------------------------ stores checked before anything is written
def _text_file(tmp_path: Path) -> Path:
    path = tmp_path / "notes.db"
    path.write_text("not a database\n")
    return path


@pytest.mark.parametrize(("overrides", "key", "says"), [
    (["tracking.mlflow=true", "tracking.mlflow_uri='bogus://x'"], "tracking.mlflow_uri", "scheme 'bogus'"),
    (["tracking.mlflow=true", "tracking.mlflow_uri='http://127.0.0.1:1'"], "tracking.mlflow_uri",
     "cannot connect to 127.0.0.1:1"),
    (["tracking.mlflow=true", "tracking.mlflow_uri='sqlite:////proc/x.db'"], "tracking.mlflow_uri", "/proc"),
    (["tracking.mlflow=true", "tracking.mlflow_uri='sqlite:///{db}'"], "tracking.mlflow_uri",
     "not an SQLite database"),
    (["tracking.mlflow=true", "tracking.mlflow_uri='{file}/mlruns'"], "tracking.mlflow_uri", "not a folder"),
    (["tracking.tensorboard=true", "tracking.tensorboard_dir='/proc/tb'"], "tracking.tensorboard_dir", "/proc"),
    (["tracking.tensorboard=true", "tracking.tensorboard_dir='{file}/tb'"], "tracking.tensorboard_dir",
     "not a folder"),
])
def test_an_unusable_store_is_a_config_error_before_the_run_folder_exists(tmp_path, capsys, overrides, key, says):
    """Issue 26, items 5-8: a store that cannot be used (an unknown scheme, a server that does not answer, a
    database or folder that cannot be made, a file that is no database) is exit 2 naming the key, from the set-up
    (a bounded connection attempt, never a hang), with no run folder made."""
    db = _text_file(tmp_path)
    filled = [o.format(db=db, file=db) for o in overrides]
    with pytest.raises(ConfigError) as err:
        set_up(tiny("train.rounds=1", *filled))
    assert err.value.key == key and says in str(err.value), str(err.value)
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), "--quiet", *[a for o in [*TINY, *filled] for a in ("--set", o)]]) == 2
    assert key in capsys.readouterr().err
    assert not out.exists()


def test_usable_stores_pass_the_check_and_write_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tracking.check(tiny("tracking.mlflow=true", f"tracking.mlflow_uri='sqlite:///{tmp_path / 'new' / 'm.db'}'"))
    tracking.check(tiny("tracking.mlflow=true", f"tracking.mlflow_uri='{tmp_path / 'a' / 'mlruns'}'"))
    tracking.check(tiny("tracking.tensorboard=true", f"tracking.tensorboard_dir='{tmp_path / 'a' / 'tb'}'"))
    assert sorted(p.name for p in tmp_path.rglob("*")) == []


def test_a_store_failing_mid_run_loses_no_data_and_is_said_once(tmp_path, monkeypatch, caplog):
    """MLflow's store goes away after round 1: the run finishes, metrics.jsonl and summary.json hold every
    round, and one warning says the tracking stopped (not one per round, not a traceback)."""
    import logging

    from mlflow.exceptions import MlflowException

    original = MlflowClient.log_batch
    calls = []

    def flaky(self, run_id, metrics=(), params=(), tags=(), **kwargs):
        if metrics:
            calls.append(1)
            if len(calls) > 1:
                raise MlflowException("API request failed: connection refused")
        return original(self, run_id, metrics=metrics, params=params, tags=tags, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", flaky)
    with caplog.at_level(logging.WARNING, logger="hetfl"):
        summary = set_up(tiny("train.rounds=4", "tracking.mlflow=true", store(tmp_path))).run(tmp_path / "run")
    assert [m["round"] for m in metrics(tmp_path / "run")] == [1, 2, 3, 4]
    assert summary["rounds"] == 4 and (tmp_path / "run" / "summary.json").is_file()
    said = [r.getMessage() for r in caplog.records if "mlflow" in r.getMessage().lower()]
    assert len(said) == 1 and "connection refused" in said[0] and "metrics.jsonl" in said[0], said


# ------------------------------------------------------------------ the engine is handed its trackers
def test_the_engine_tracks_only_with_the_trackers_it_is_handed(tmp_path):
    """The engine knows no backend (issue 28): an Experiment set up without trackers refuses a configuration that
    switches tracking on, naming the key, before anything is written; hetfl.runtimes.set_up hands hetfl's."""
    cfg = tiny("train.rounds=1", "tracking.tensorboard=true")
    with pytest.raises(ConfigError) as err:
        Experiment(cfg).run(tmp_path / "run")
    assert err.value.key == "tracking.tensorboard" and "hetfl.runtimes.set_up" in str(err.value)
    assert not (tmp_path / "run").exists()
    assert set_up(cfg).trackers is tracking.TRACKERS
    Experiment(tiny("train.rounds=1")).run(tmp_path / "untracked")  # tracking off: nothing to hand
