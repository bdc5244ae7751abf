"""summary.json names what computed the run's rounds (hetfl.engine.provenance)."""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path

import pytest
import torch

import hetfl
from hetfl import config as config_mod
from hetfl.cli import main
from hetfl.engine import identity, provenance
from hetfl.runtimes import set_up
from tests.helpers.runs import interrupted

TINY = ["data.partition=dirichlet", "data.num_clients=6", "train.rounds=3", "runtime.checkpoint_every=1",
        "runtime.progress=false", "runtime.threads=1"]


def environments(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "summary.json").read_text())["environment"]


def test_a_run_names_hetfl_torch_python_and_the_device_that_computed_it(tmp_path):
    set_up(config_mod.load(None, TINY)).run(tmp_path / "run")
    [env] = environments(tmp_path / "run")
    assert env == {"from_round": 1, "hetfl": hetfl.__version__, "hetfl_commit": env["hetfl_commit"],
                   "python": platform.python_version(), "torch": str(torch.__version__), "device": "cpu",
                   "platform": f"{platform.system()}-{platform.machine()}"}
    root = Path(hetfl.__file__).resolve().parents[2]
    if (root / ".git").exists():  # a checkout (CI's clean clone, this one): its commit, edits marked
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        assert env["hetfl_commit"].removesuffix("+edits") == head[:12]
    else:
        assert env["hetfl_commit"] is None


def test_a_run_resumed_elsewhere_names_both_environments_and_from_which_round(tmp_path, monkeypatch):
    """Interrupted after round 1 and resumed by another torch: two entries, the second from round 2; that
    process interrupted after round 2 and resumed in the same environment adds none. The run's identity is
    its configuration only."""
    cfg = config_mod.load(None, TINY)
    run_dir = tmp_path / "run"
    interrupted(run_dir, 1, monkeypatch, cfg)
    here = provenance.environment(torch.device("cpu"))
    monkeypatch.setattr(provenance, "environment", lambda device: {**here, "torch": "9.9.9"})
    interrupted(run_dir, 2, monkeypatch, identity.load_run_config(run_dir / "config.toml"), resume=True)
    assert main(["run", "--resume", str(run_dir), "--quiet"]) == 0
    got = environments(run_dir)
    assert got == [{"from_round": 1, **here}, {"from_round": 2, **here, "torch": "9.9.9"}]
    set_up(cfg).run(tmp_path / "whole")
    assert identity.run_dir_ids(run_dir) == identity.run_dir_ids(tmp_path / "whole")


@pytest.mark.parametrize(("earlier", "expected_length"), [([], 1), ([{"from_round": 1, "torch": "1"}], 1),
                                                           ([{"from_round": 1, "torch": "0"}], 2)])
def test_an_environment_is_added_only_where_it_changes(earlier, expected_length):
    got = provenance.extend(earlier, {"torch": "1"}, 4)
    assert len(got) == expected_length and got[-1]["torch"] == "1"
    assert got[-1]["from_round"] == (1 if earlier and earlier[0]["torch"] == "1" else 4)
