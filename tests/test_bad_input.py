"""Every bad value is refused before anything is allocated or written; data stays inside its root
(hetfl issue 16).

Each reproduction of the issue is a test here. The four that allocated without bound on the
old code (a billion synthetic devices, a billion-wide input or hidden layer, 10**12 local
steps) run ``hetfl`` in a child process whose heap is capped (``RLIMIT_DATA``) and whose time
is limited, so that a regression fails fast instead of exhausting the test machine.
"""

from __future__ import annotations

import io
import json
import os
import resource
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hetfl import config, reproduce
from hetfl.cli import main
from hetfl.data.base import DatasetError
from hetfl.data.datasets import load_dataset
from hetfl.data.datasets.synthetic import generate
from hetfl.engine.experiment import Experiment
from hetfl.params import ConfigError

QUICK = ["--set", "train.rounds=1", "--quiet"]
HEAP_CAP = 3 * 2**30  # bytes a child hetfl may allocate (torch itself needs well under 1 GB)


def _cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err.strip()


def _one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("hetfl: error: "), err
    for needle in needles:
        assert needle in err, (needle, err)


# Runs each argv through hetfl.cli.main in turn; a traceback counts as exit 1 with the traceback as stderr.
_CHILD = """
import contextlib, io, json, sys, traceback
from hetfl.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = main(argv)
    except BaseException:
        code = 1
        err.write(traceback.format_exc())
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def _capped_cli(argvs: list[list[str]], cwd: Path) -> list[tuple[int, str]]:
    """``hetfl ARGV`` for each argv, in one child process with a capped heap (``RLIMIT_DATA``) and
    120 s: an unbounded allocation fails fast there instead of exhausting the test machine."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (HEAP_CAP, HEAP_CAP))

    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # PYTHONPATH: this copy's sources first (conftest.py)
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(argvs)], cwd=cwd, capture_output=True,
                          text=True, timeout=120, preexec_fn=cap, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [(code, err.strip()) for code, err in json.loads(proc.stdout.strip().splitlines()[-1])]


# ------------------------------------------------------------------ non-finite numbers
@pytest.mark.parametrize("text", ["inf", "nan", "-inf", "+inf"])
def test_non_finite_float_settings_are_refused(text):
    with pytest.raises(ConfigError) as err:
        config.load(None, [f"train.lr={text}"])
    assert err.value.key == "train.lr" and "finite" in err.value.allowed
    with pytest.raises(ConfigError, match="finite"):
        config.load(None, [f"train.weight_decay={text}"])
    with pytest.raises(ConfigError) as err:  # inside a list
        config.load(None, [f"data.angles=[0, {text}]"])
    assert err.value.key == "data.angles[1]"


def test_lr_inf_exits_2_without_writing(tmp_path, capsys):
    out = tmp_path / "run"
    code, err = _cli(["run", "--out", str(out), "--set", "train.lr=inf", *QUICK], capsys)
    _one_line_error(code, err, "train.lr", "finite")
    assert not out.exists()


@pytest.mark.parametrize(("extra", "needle"), [
    (["--set", "algorithm.name=fedprox", "--set", "algorithm.mu=inf"], "algorithm.mu"),
    (["--set", "data.options={alpha = inf}"], "data.options.alpha"),
    (["--set", "data.options={beta = nan}"], "data.options.beta"),
])
def test_non_finite_method_and_dataset_settings_exit_2(extra, needle, tmp_path, capsys):
    out = tmp_path / "run"
    code, err = _cli(["run", "--out", str(out), *QUICK, *extra], capsys)
    _one_line_error(code, err, needle)
    assert not out.exists()


# ------------------------------------------------------------------ cross-key constraints
@pytest.mark.parametrize(("overrides", "key"), [
    (["data.partition=rotation"], "data.partition"),  # a traceback from rotate() on feature vectors before
    (["train.rounds=3", "runtime.save_client_models=[2, 5]"], "runtime.save_client_models"),  # never saved
    (["train.clients_per_round=31"], "train.clients_per_round"),  # now refused before the data is built
    (["runtime.threads=1000000"], "runtime.threads"),
])
def test_keys_that_contradict_each_other_are_refused_at_load(overrides, key):
    with pytest.raises(ConfigError) as err:
        config.load(None, overrides)
    assert err.value.key == key


def test_cosine_floor_above_lr_is_refused(tmp_path, capsys):
    with pytest.raises(ConfigError) as err:
        config.load(None, ["train.lr_schedule=cosine", "train.lr=0.05", "train.lr_min=5"])
    assert err.value.key == "train.lr_min" and "train.lr" in err.value.allowed
    out = tmp_path / "run"
    code, err_text = _cli(["run", "--out", str(out), "--set", "train.lr_schedule=cosine", "--set", "train.lr_min=5",
                           *QUICK], capsys)
    _one_line_error(code, err_text, "train.lr_min")
    assert not out.exists()


def test_cosine_floor_at_or_below_lr_and_constant_schedule_are_fine():
    assert config.load(None, ["train.lr_schedule=cosine", "train.lr_min=0.05"]).train.lr_min == 0.05
    assert config.load(None, ["train.lr_schedule=cosine", "train.lr_min=0.001"]).train.lr_min == 0.001
    assert config.load(None, ["train.lr_min=5"]).train.lr_min == 5.0  # unused by the constant schedule


# ------------------------------------------------------------------ memory
MEMORY_CASES = {  # the reproductions (and one more found alike): "; "-joined overrides -> the key named
    "data.options={num_devices = 1000000000}": "data.options.num_devices",
    "data.options={dim = 1000000000}": "data.options.dim",
    "model.options={hidden = [1000000000]}": "model.options",
    "train.local_steps=1000000000000": "train.local_steps",
    "data.partition=dominant; data.dominant_groups=1000000000": "data.dominant_groups",
    # the sizes a method's settings give its own state (a hypernetwork, a virtual dataset, a discriminator, the
    # virtual features of CCVR): once allocated after the run folder was written, in round 1 or after the last
    # round's training, ending in torch's "DefaultCPUAllocator: can't allocate memory" traceback (exit 1)
    "algorithm.name=pfedhn; algorithm.embed_dim=1000000000": "algorithm.embed_dim",
    "algorithm.name=pfedhn; algorithm.hidden=1000000000": "algorithm.hidden",
    "algorithm.name=pfedhn; algorithm.n_hidden=1000000000": "algorithm.n_hidden",
    "algorithm.name=pfedhn; algorithm.chunk_size=1000000000": "algorithm.chunk_size",
    "algorithm.name=pfedhn; algorithm.chunk_embed_dim=1000000000": "algorithm.chunk_embed_dim",
    "algorithm.name=vhl; algorithm.num_virtual=1000000000": "algorithm.num_virtual",
    "algorithm.name=vhl; algorithm.virtual_batch=1000000000": "algorithm.virtual_batch",
    "algorithm.name=dann; model.options={hidden = [8]}; algorithm.hidden=1000000000": "algorithm.hidden",
    "algorithm.name=fedetf; model.options={hidden = [8]}; algorithm.etf_dim=1000000000": "algorithm.etf_dim",
    "algorithm.name=fedavg+ccvr; model.options={hidden = [8]}; algorithm.ccvr.num_virtual=1000000000":
        "algorithm.ccvr.num_virtual",
}


def _memory_refusal_problems(override: str, code: int, err: str, out: Path) -> list[str]:
    """What is wrong with one memory case's outcome (nothing when it was refused as it should be)."""
    problems = []
    if code != 2:
        problems.append(f"exit {code}, not 2")
    if len(err.splitlines()) != 1 or not err.startswith("hetfl: error: "):
        problems.append("not a one-line 'hetfl: error: ' message")
    if MEMORY_CASES[override] not in err or "GB" not in err or "available" not in err:
        problems.append(f"the message does not name {MEMORY_CASES[override]}, its GB and what is available")
    if out.exists():
        problems.append("something was written")
    return [f"{override}: {problem}\n    {err[-2000:]}" for problem in problems]


@pytest.mark.slow  # one child process for the cases: ~3 s, most of it importing torch
def test_what_cannot_fit_in_memory_is_refused_before_allocating(tmp_path):
    """Every memory case, run in one capped child (one import of torch for all: as 15 parametrised tests
    sharing a module fixture, the child ran again whenever another module's test came between two of them: under
    pytest-xdist, and serially too, as conftest.py interleaves the slow tests). The failure lists
    each case that was not refused, with what was wrong and its error text."""
    outs = {override: tmp_path / f"run{i}" for i, override in enumerate(MEMORY_CASES)}
    argvs = [["run", "--out", str(out), *(a for o in override.split("; ") for a in ("--set", o)),
              "--set", "train.rounds=1", "--quiet"] for override, out in outs.items()]
    results = _capped_cli(argvs, tmp_path)
    assert len(results) == len(MEMORY_CASES)
    problems = [problem for (override, out), (code, err) in zip(outs.items(), results, strict=True)
                for problem in _memory_refusal_problems(override, code, err, out)]
    assert not problems, "\n".join(problems)


def test_synthetic_estimate_bounds_what_generate_allocates():
    """The estimate is of the right size: at least the generated arrays, at most a few times them."""
    from hetfl.engine import resources

    opts = {"alpha": 1.0, "beta": 1.0, "num_devices": 200, "dim": 60, "num_classes": 10, "iid": False,
            "test_fraction": 0.2, "max_samples": 5000}
    x, y, g = generate(1.0, 1.0, 200, 60, 10, False, seed=0)
    actual = x.nbytes + y.nbytes + g.nbytes
    estimate = resources.synthetic_bytes(opts)
    assert actual <= estimate <= 4 * actual, (actual, estimate)
    bigger = resources.synthetic_bytes({**opts, "num_devices": 400})
    assert 1.8 * estimate < bigger < 2.2 * estimate  # linear in the number of devices
    wider = resources.synthetic_bytes({**opts, "dim": 120})
    assert 1.8 * estimate < wider < 2.2 * estimate  # and in the input dimension


def test_model_estimate_counts_parameters_without_allocating():
    from hetfl.engine import resources

    n = resources.count_parameters("mlp", (60,), 10, {"hidden": [10**9]})
    assert n == 60 * 10**9 + 10**9 + 10**9 * 10 + 10  # a 280 GB model counted on the meta device
    assert resources.count_parameters("mlp", (60,), 10, {"hidden": []}) == 610


def test_model_copies_are_host_memory_on_the_cpu_and_device_memory_on_cuda():
    """On an accelerator the host holds the one copy built there first; the copies of the run are on the
    device (checked against its memory), so a big GPU run is not refused for the host's size."""
    import torch

    from hetfl.engine import resources

    options = {"hidden": [1000]}
    count = 60 * 1000 + 1000 + 1000 * 10 + 10
    host, device = resources.model_needs("mlp", options, (60,), 10, torch.device("cpu"))
    assert [n[2] for n in host] == [4 * count * resources.MODEL_COPIES] and device == []
    assert host[0][:2] == ("model.options", options)
    host, device = resources.model_needs("mlp", options, (60,), 10, torch.device("cuda"))
    assert [n[2] for n in host] == [4 * count] and [n[2] for n in device] == [4 * count * resources.MODEL_COPIES]


def test_step_plan_estimate_grows_with_steps_and_epochs():
    from hetfl.engine import resources

    small = resources.plan_bytes(local_steps=50, local_epochs=1, batch_size=32, client_sizes=[500], clients=1)
    assert small < 2**20  # a normal plan is kilobytes
    huge = resources.plan_bytes(local_steps=10**12, local_epochs=1, batch_size=32, client_sizes=[500], clients=1)
    assert huge > 10**13
    epochs = resources.plan_bytes(local_steps=0, local_epochs=10**9, batch_size=32, client_sizes=[10, 500], clients=1)
    assert epochs >= 10**9 * 500 * 8  # a permutation of the largest client per epoch


def test_refusal_names_the_driving_key_and_the_estimate():
    from hetfl.engine import resources

    with pytest.raises(ConfigError) as err:
        resources.require([("train.local_steps", 10**12, 64 * 10**12, "the local step plan")], available=8 * 2**30)
    assert err.value.key == "train.local_steps" and err.value.value == 10**12
    assert "64000.0 GB" in err.value.allowed and "8.6 GB available" in err.value.allowed
    resources.require([("train.local_steps", 50, 10**6, "the local step plan")], available=8 * 2**30)
    resources.require([("train.local_steps", 50, 10**15, "the local step plan")], available=None)  # unknown: allow


def test_available_memory_is_plausible():
    from hetfl.engine import resources

    avail = resources.available_memory()
    assert avail is None or 2**26 < avail < 2**50


def _preset_configs():
    """One config per distinct (preset variant, column, row overrides): the algorithm and the seed
    change no size."""
    for name in reproduce.available():
        preset = reproduce.load_preset(name)
        for variant in (preset, preset.variant(True)):
            seen = set()
            for spec in reproduce.run_specs(variant).values():
                if (spec.column, spec.overrides) not in seen:
                    seen.add((spec.column, spec.overrides))
                    yield f"{variant.name}:{spec.column}:{spec.algorithm}", reproduce.build_config(variant, spec, [])


def test_presets_and_the_default_run_fit():
    """No preset in configs/ (full and quick) nor the default run trips the estimates: on this machine,
    and on a 16 GB one."""
    from hetfl.engine import resources

    configs = [("default", config.load()), *_preset_configs()]
    assert len(configs) > 10
    for label, cfg in configs:
        for key, value, need, what in resources.config_estimates(cfg):
            assert need < 8 * 2**30, (label, key, value, need, what)
        known = resources.known_dataset(cfg.data.dataset, cfg.data.options)
        if known is not None and cfg.model.name != "auto":  # the model copies on the CPU device
            n = resources.count_parameters(cfg.model.name, known.input_shape, known.num_classes,
                                           dict(cfg.model.options))
            assert n * 4 * resources.MODEL_COPIES < 8 * 2**30, (label, n)


@pytest.mark.parametrize("method", ["pfedhn", "vhl", "dann", "fedetf", "fedavg+ccvr"])
def test_a_methods_own_memory_at_its_defaults_is_small(method):
    """The estimates of the methods' own state at their default settings, on CIFAR-100-sized inputs (100
    classes, 512 features, 3 x 32 x 32 inputs, 100 clients): far below any machine's memory."""
    import dataclasses

    from hetfl.algorithms import build_algorithm, build_posthoc
    from tests.helpers import tiny_setup

    setup = dataclasses.replace(tiny_setup(num_clients=100), num_classes=100)
    steps = [build_algorithm(method, {}, setup)] if "+" not in method else build_posthoc(method, {}, setup)
    needs = [n for step in steps for n in (step.memory_needs((3, 32, 32), 512) if "+" not in method
                                            else step.memory_needs(512))]
    assert needs and all(0 <= need < 2 * 2**30 for _, _, need, _ in needs), needs


def test_default_experiment_is_not_refused():
    exp = Experiment(config.load(None, ["runtime.progress=false"]))
    assert exp.num_params > 0


# ------------------------------------------------------------------ files and folders
def test_non_utf8_config_file_exits_2(tmp_path, capsys):
    path = tmp_path / "latin1.toml"
    path.write_bytes("# r\xe9glages\n[train]\nlr = 0.1\n".encode("latin-1"))
    out = tmp_path / "run"
    code, err = _cli(["run", str(path), "--out", str(out), *QUICK], capsys)
    _one_line_error(code, err, str(path), "UTF-8")
    assert not out.exists()
    with pytest.raises(ConfigError, match="UTF-8"):
        config.load(path)


def test_out_below_a_regular_file_exits_2(tmp_path, capsys):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file, not a folder\n")
    code, err = _cli(["run", "--out", str(blocker / "run"), *QUICK], capsys)
    _one_line_error(code, err, "--out", str(blocker))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    code, err = _cli(["run", "--out", str(blocker / "a" / "b"), *QUICK], capsys)
    _one_line_error(code, err, "--out", str(blocker))


def test_read_only_out_exits_2(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        code, err = _cli(["run", "--out", str(ro), *QUICK], capsys)  # an existing empty folder
        _one_line_error(code, err, "--out", "writable")
        code, err = _cli(["run", "--out", str(ro / "run"), *QUICK], capsys)  # a new folder inside it
        _one_line_error(code, err, "--out", "writable")
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


# ------------------------------------------------------------------ data stays inside its root
def _png(color: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((4, 4, 3), color, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _image_tree(tmp_path: Path) -> tuple[Path, Path]:
    """root/{train,test}/{a,b}/<k>.png, and a folder outside root with one more image."""
    root = tmp_path / "root"
    for split in ("train", "test"):
        for i, cls in enumerate(("a", "b")):
            (root / split / cls).mkdir(parents=True)
            for k in range(2):
                (root / split / cls / f"{k}.png").write_bytes(_png(40 * i + k))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.png").write_bytes(_png(255))
    return root, outside


def _load(root: Path, tmp_path: Path, **options):
    return load_dataset("imagefolder", root, download=False, cache_dir=tmp_path / "cache", **options)


def test_image_folder_without_links_loads(tmp_path):
    root, _ = _image_tree(tmp_path)
    assert len(_load(root, tmp_path).train.y) == 4


def test_file_link_leaving_the_root_is_refused(tmp_path):
    root, outside = _image_tree(tmp_path)
    link = root / "train" / "a" / "evil.png"
    link.symlink_to(outside / "secret.png")
    with pytest.raises(DatasetError) as err:
        _load(root, tmp_path)
    assert str(link) in str(err.value) and "follow_links" in str(err.value)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir()), "nothing cached"
    # an explicit option follows it
    assert len(_load(root, tmp_path, follow_links=True).train.y) == 5


def test_folder_link_leaving_the_root_is_refused_and_followed_when_allowed(tmp_path):
    root, outside = _image_tree(tmp_path)
    link = root / "train" / "b" / "more"
    link.symlink_to(outside, target_is_directory=True)
    with pytest.raises(DatasetError) as err:
        _load(root, tmp_path)
    assert str(link) in str(err.value)
    assert len(_load(root, tmp_path, follow_links=True).train.y) == 5


def test_links_inside_the_root_are_fine(tmp_path):
    root, _ = _image_tree(tmp_path)
    (root / "train" / "a" / "again.png").symlink_to(root / "test" / "a" / "0.png")
    assert len(_load(root, tmp_path).train.y) == 5


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_symlink_loop_is_a_clear_error(kind, tmp_path):
    root, _ = _image_tree(tmp_path)
    if kind == "file":
        link = root / "train" / "a" / "loop.png"
        link.symlink_to(link)
    else:
        link = root / "train" / "a" / "up"
        link.symlink_to(root / "train", target_is_directory=True)
    for options in ({}, {"follow_links": True}):
        with pytest.raises(DatasetError) as err:
            _load(root, tmp_path, **options)
        assert str(link) in str(err.value) and "loop" in str(err.value)


def test_link_leaving_the_root_exits_2_through_the_cli(tmp_path, capsys):
    root, outside = _image_tree(tmp_path)
    (root / "train" / "a" / "evil.png").symlink_to(outside / "secret.png")
    out = tmp_path / "run"
    code, err = _cli(["run", "--out", str(out), "--set", "data.dataset=imagefolder", "--set", f"data.root={root}",
                      "--set", "data.num_clients=2", "--set", "data.partition=iid", *QUICK], capsys)
    _one_line_error(code, err, "evil.png", "data.root")
    assert not out.exists()


# ------------------------------------------------------------------ TLS keys
@pytest.mark.parametrize("existing", [False, True])
def test_tls_private_key_is_owner_only(existing, tmp_path):
    pytest.importorskip("cryptography")
    from hetfl.flower.deploy import generate_tls

    folder = tmp_path / "workdir" / "tls"
    if existing:  # a key left by an earlier run with open permissions is replaced by an owner-only one
        folder.mkdir(parents=True)
        (folder / "server.key").write_text("old")
        (folder / "server.key").chmod(0o644)
    old = os.umask(0o022)
    try:
        files = generate_tls(folder)
    finally:
        os.umask(old)
    assert stat.S_IMODE(files.key.stat().st_mode) == 0o600
    assert files.key.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert stat.S_IMODE(files.ca.stat().st_mode) == 0o644  # certificates are public



@pytest.mark.parametrize("command", [
    ["compare", "--methods", "fedavg", "--seeds", "0", "--set", "train.rounds=1", "--out"],
    ["reproduce", "ccvr-table2", "--quick", "--out"],
    ["report", "RUN", "--out"],
    ["partition", "--plot"],
])
def test_every_output_flag_below_a_file_is_refused_before_anything_runs(command, tmp_path, capsys):
    """compare, reproduce, report and partition check their output path as run does: exit 2, one line."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    argv = [str(tmp_path) if part == "RUN" else part for part in command]
    target = blocker / "sub" / ("heat.png" if command[0] == "partition" else "out")
    assert main([*argv, str(target)]) == 2
    err = capsys.readouterr().err
    assert "is not a folder" in err and str(blocker) in err and "Traceback" not in err
    assert blocker.read_text() == "not a folder"
