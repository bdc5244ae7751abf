"""``train.weighting``: the server's weights of the round's clients, by data size ("size", the default) or
uniform 1/M ("uniform", FedBR's Algorithm 1 and the authors' code, LINs-lab/FedBR train_fed.py: every method's
``p = 1`` normalised over the round's clients, GroupDRO's aside).

The methods that average by ``num_samples`` honour it; those with a weighting rule of their own keep it:
SCAFFOLD and FedDyn average uniformly whatever the key says (their papers' 1/|S|), GroupDRO over clients
weights by its q, FedBR's ``algorithm.weighting`` wins and a contradiction is refused, FedNova refuses
"uniform" (its p_i = n_i / n enter the normalised step and tau_eff).
"""

from __future__ import annotations

import json

import pytest
import torch

from hetfl import config, reproduce
from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import Upload
from hetfl.params import ConfigError
from tests.helpers import initial_state, perturbed, tiny_setup

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = (10, 30)


def two_uploads(setup, method_keys=()):
    """Two clients of 10 and 30 samples whose models differ (and any extra tensors a method uploads)."""
    init = initial_state(setup)
    return init, [Upload(c, {**perturbed(init, 0.5, c), **{k: torch.tensor(1.0) for k in method_keys}}, n, 2)
                  for c, n in enumerate(SIZES)]


def expected_mean(uploads, names, weights):
    total = sum(weights)
    return {n: sum(u.tensors[n].double() * w / total for u, w in zip(uploads, weights, strict=True)).float()
            for n in names}


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "mixup"])
@pytest.mark.parametrize("weighting", ["size", "uniform"])
def test_fedavg_style_methods_average_by_the_chosen_weights(method, weighting):
    """Two clients of 10 and 30 samples: "uniform" gives (w_1 + w_2) / 2 (exactly, weights 1/2 each), "size"
    (w_1 10 + w_2 30) / 40."""
    setup = tiny_setup(weighting=weighting)
    algo = build_algorithm(method, {}, setup)
    init, uploads = two_uploads(setup)
    got = algo.aggregate(algo.init_server(init), uploads, 1).model
    weights = [1.0, 1.0] if weighting == "uniform" else [float(n) for n in SIZES]
    want = expected_mean(uploads, setup.model.param_names, weights)
    for n in setup.model.param_names:
        assert torch.allclose(got[n], want[n], atol=1e-7, rtol=0), n
    if weighting == "uniform":
        n = setup.model.param_names[0]
        assert torch.equal(got[n], uploads[0].tensors[n] * 0.5 + uploads[1].tensors[n] * 0.5)
    other = expected_mean(uploads, setup.model.param_names, [float(n) for n in SIZES] if weighting == "uniform"
                          else [1.0, 1.0])
    assert not torch.allclose(got[setup.model.param_names[0]], other[setup.model.param_names[0]], atol=1e-4)


def test_the_hook_returns_the_sample_counts_or_one_each():
    """``Algorithm.client_weights``, the hook a plug-in calls for the run's weights, returns what it documents:
    each upload's sample count ("size") or 1 each ("uniform"), as floats, in the uploads' order."""
    for weighting, want in (("size", [10.0, 30.0]), ("uniform", [1.0, 1.0])):
        setup = tiny_setup(weighting=weighting)
        _, uploads = two_uploads(setup)
        got = build_algorithm("fedavg", {}, setup).client_weights(uploads)
        assert got == want and all(type(w) is float for w in got), weighting
        assert build_algorithm("fedavg", {}, setup).client_weights(uploads[::-1]) == want[::-1]


@pytest.mark.parametrize("weighting", ["size", "uniform"])
def test_fedavgm_and_fedper_and_fedpac_average_by_the_chosen_weights(weighting):
    """Other aggregation paths: FedAvgM's server step from the weighted mean (first round: no momentum yet),
    FedPer's shared part, FedPAC's encoder."""
    weights = [1.0, 1.0] if weighting == "uniform" else [float(n) for n in SIZES]
    setup = tiny_setup(weighting=weighting)
    init, uploads = two_uploads(setup)
    mean = expected_mean(uploads, setup.model.param_names, weights)
    fedavgm = build_algorithm("fedavgm", {"server_lr": 1.0}, setup)
    got = fedavgm.aggregate(fedavgm.init_server(init), uploads, 1).model
    for n in setup.model.param_names:
        assert torch.allclose(got[n], mean[n], atol=1e-6, rtol=0), n
    fedper = build_algorithm("fedper", {}, setup)
    shared = fedper.shared_names()
    fedper_uploads = [Upload(u.client_id, {n: u.tensors[n] for n in shared}, u.num_samples, 2) for u in uploads]
    got = fedper.aggregate(fedper.init_server(init), fedper_uploads, 1).model
    for n in shared:
        assert torch.allclose(got[n], mean[n], atol=1e-7, rtol=0), n
    fedpac = build_algorithm("fedpac", {}, setup)
    pac_uploads = [Upload(u.client_id, {**u.tensors, "fedpac.counts": torch.ones(3, dtype=torch.float64),
                                        "fedpac.centroid_sums": torch.ones(3, 8, dtype=torch.float64),
                                        "fedpac.h": torch.rand(3, 8, dtype=torch.float64),
                                        "fedpac.v": torch.tensor(0.1)}, u.num_samples, 2) for u in uploads]
    got = fedpac.aggregate(fedpac.init_server(init), pac_uploads, 1).model
    for n in fedpac.encoder_names():
        assert torch.allclose(got[n], mean[n], atol=1e-7, rtol=0), n


def test_scaffold_and_feddyn_keep_their_uniform_rule_whatever_the_key():
    """SCAFFOLD (Algorithm 1: 1/|S| for the model and the control variates) and FedDyn (1/m over the
    participants) average uniformly already: the key changes nothing there."""
    for method in ("scaffold", "feddyn"):
        results = []
        for weighting in ("size", "uniform"):
            setup = tiny_setup(weighting=weighting)
            algo = build_algorithm(method, {}, setup)
            init = initial_state(setup)
            server = algo.init_server(init)
            extra_keys = [f"scaffold.c/{n}" for n in setup.model.param_names] if method == "scaffold" else []
            uploads = [Upload(c, {**perturbed(init, 0.5, c), **{k: torch.full_like(init[k.split("/", 1)[1]], c + 1.0)
                                                                for k in extra_keys}}, n, 2)
                       for c, n in enumerate(SIZES)]
            results.append(algo.aggregate(server, uploads, 1))
        for n in results[0].model:
            assert torch.equal(results[0].model[n], results[1].model[n]), (method, n)


def test_groupdro_over_clients_keeps_its_q_weights_whatever_the_key():
    """GroupDRO over clients (FedBR's baseline) weights the uploads by its q (softmax of the clients' summed
    losses), not by size: the key changes nothing there."""
    results = []
    for weighting in ("size", "uniform"):
        setup = tiny_setup(weighting=weighting)
        algo = build_algorithm("groupdro", {"groups": "clients"}, setup)
        init = initial_state(setup)
        uploads = [Upload(c, {**perturbed(init, 0.5, c), "groupdro.loss": torch.tensor(1.0 + c)}, n, 2)
                   for c, n in enumerate(SIZES)]
        results.append(algo.aggregate(algo.init_server(init), uploads, 1).model)
    for n in results[0]:
        assert torch.equal(results[0][n], results[1][n]), n


def test_fedbrs_own_weighting_wins_and_a_contradiction_is_refused():
    init_setup = tiny_setup(weighting="size")
    assert build_algorithm("fedbr", {}, init_setup).hp.weighting == "uniform"  # its own default: 1/M
    build_algorithm("fedbr", {"weighting": "uniform"}, tiny_setup(weighting="uniform"))
    build_algorithm("fedbr", {"weighting": "size"}, tiny_setup(weighting="size"))
    with pytest.raises(ConfigError, match=r"train\.weighting = 'uniform'.*algorithm\.weighting = 'size'"):
        build_algorithm("fedbr", {"weighting": "size"}, tiny_setup(weighting="uniform"))


def test_fednova_refuses_uniform_weights_naming_the_key():
    build_algorithm("fednova", {}, tiny_setup(weighting="size"))
    with pytest.raises(ConfigError, match=r"train\.weighting = 'uniform'.*FedNova"):
        build_algorithm("fednova", {}, tiny_setup(weighting="uniform"))


def test_the_key_defaults_to_size_and_a_bad_value_is_refused_naming_it():
    assert config.load(None, []).train.weighting == "size"
    assert config.load(None, ["train.weighting=uniform"]).train.weighting == "uniform"
    with pytest.raises(ConfigError, match=r"train\.weighting = 'equal'.*size.*uniform"):
        config.load(None, ["train.weighting=equal"])


@pytest.mark.parametrize("name", ["fedbr-table1", "fedbr-table2", "fedbr-table5"])
@pytest.mark.parametrize("quick", [False, True])
def test_the_fedbr_table_presets_average_uniformly_as_the_authors_code(name, quick):
    """FedBR's Algorithm 1 and train_fed.py (weights = p / sum p, p = 1 for every method but GroupDRO): every
    baseline of the FedBR tables averages its clients with weights 1/M."""
    preset = reproduce.load_preset(name).variant(quick)
    for spec in set(reproduce.run_specs(preset).values()):
        cfg = reproduce.build_config(preset, spec, ["data.root=/nowhere"])
        assert cfg.train.weighting == "uniform", (name, spec)


def test_a_run_resumed_under_uniform_weights_gives_the_uninterrupted_run(tmp_path, monkeypatch):
    """The key is part of the run's configuration (checkpointed with it); a run resumed after round 1 gives
    the uninterrupted run's numbers, which differ from the size-weighted run's."""
    from hetfl.runtimes import set_up
    from tests.helpers.runs import interrupted

    base = ["data.num_clients=4", "data.options={num_devices = 4, max_samples = 90, dim = 8, num_classes = 4}",
            "model.name=mlp", "model.options={hidden = [6]}", "train.rounds=3", "train.local_steps=2",
            "runtime.checkpoint_every=1", "runtime.progress=false", "runtime.threads=1"]
    uniform = config.load(None, [*base, "train.weighting=uniform"])
    set_up(uniform).run(tmp_path / "whole")
    set_up(config.load(None, base)).run(tmp_path / "size")
    interrupted(tmp_path / "cut", 1, monkeypatch, uniform)
    set_up(uniform).run(tmp_path / "cut", resume=True)

    def lines(d):
        return [{k: v for k, v in json.loads(x).items() if not k.endswith("time_s")}
                for x in (d / "metrics.jsonl").read_text().splitlines()]

    assert lines(tmp_path / "cut") == lines(tmp_path / "whole")
    assert lines(tmp_path / "size") != lines(tmp_path / "whole")  # sizes differ: the key changes the numbers
