"""FedBR: the behaviours that mutation testing (benchmarks/mutation.py) found untested.

Each test kills mutants of ``src/hetfl/algorithms/fedbr.py`` that the first tests let pass: the
user-facing errors, ``L_con`` over the last axis, where random numbers come from, which device the
pseudo-data and the head land on (the ``meta`` device stands in for a GPU), the proxy loader, the
Mixture and Mixup paths of the min and max steps, short batches, per-step draws, and one local round
through the engine. The mutants that no input can tell apart are listed, with reasons, in
``benchmarks/results/mutation/fedbr.equivalent.md``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetfl import config
from hetfl.algorithms import build_algorithm
from hetfl.algorithms import fedbr as fedbr_module
from hetfl.algorithms.base import SHARED, ClientContext, ModelCaller, ServerState, Setup, Upload
from hetfl.algorithms.fedbr import (
    GLOBAL_FEATURES,
    HEAD,
    MIX_INDEX,
    PSEUDO,
    PSEUDO_Q,
    FedBRHyper,
    contrastive_loss,
    init_head,
    load_proxy,
    project,
)
from hetfl.algorithms.mixup import LAM, PERM
from hetfl.algorithms.pseudo_data import draw_plan, plan_means
from hetfl.config import TrainConfig
from hetfl.engine.experiment import Experiment
from hetfl.engine.local import train_client
from hetfl.engine.schedule import lr_at
from hetfl.params import ConfigError
from hetfl.rng import method_generator
from tests.helpers import initial_state, perturbed
from tests.helpers.fedbr import client_context, data_batch, fake_proxy, make, ready, set_up, sized_setup

pytestmark = pytest.mark.usefixtures("one_thread")

META = torch.device("meta")


# ---------------------------------------------------------------- user-facing errors
def test_setting_errors_name_the_key_the_value_and_what_is_allowed():
    with pytest.raises(ConfigError) as err:
        make(pseudo_source="proxy")  # no proxy_dataset
    assert (err.value.key, err.value.value) == ("algorithm.proxy_dataset", "")
    assert str(err.value) == ("algorithm.proxy_dataset = '': must name a dataset (e.g. \"cifar10\") when "
                              'algorithm.pseudo_source = "proxy"')
    with pytest.raises(ConfigError) as err:
        make(pseudo_refresh="every_round")  # with the default pseudo_source = "rsm_clients"
    assert (err.value.key, err.value.value) == ("algorithm.pseudo_refresh", "every_round")
    assert str(err.value) == ("algorithm.pseudo_refresh = 'every_round': with algorithm.pseudo_source = "
                              '"rsm_clients" only "once" (every client would have to send new means each round); '
                              'use pseudo_source = "proxy" or "per_client"')


def test_a_proxy_of_the_wrong_shape_is_refused_with_its_shape(monkeypatch):
    proxy = torch.randn(30, 5, generator=torch.Generator().manual_seed(0))  # the tiny model takes 4 inputs
    monkeypatch.setattr(fedbr_module, "load_proxy", lambda hp, seed, cache_dir="": (proxy, lambda raw: raw))
    with pytest.raises(ConfigError) as err:
        make(pseudo_source="proxy", proxy_dataset="wide")
    assert (err.value.key, err.value.value) == ("algorithm.proxy_dataset", "wide")
    assert "its inputs of shape (5,) do not fit the model" in str(err.value)


# ---------------------------------------------------------------- L_con
def test_contrastive_loss_takes_cosines_over_the_last_axis():
    """Pairs laid out as [2, 3, d] give the mean over the six pairs of the [6, d] layout."""
    gen = torch.Generator().manual_seed(1)
    local, glob, real = (torch.randn(2, 3, 5, generator=gen) for _ in range(3))
    flat = contrastive_loss(local.reshape(6, 5), glob.reshape(6, 5), real.reshape(6, 5), 0.5, 0.25)
    assert contrastive_loss(local, glob, real, 0.5, 0.25).item() == pytest.approx(flat.item(), rel=1e-6)


# ---------------------------------------------------------------- random streams
def test_the_head_is_drawn_from_its_own_stream_in_float64():
    torch.manual_seed(1)
    first = init_head(8, torch.Generator().manual_seed(5), torch.float32, torch.device("cpu"))
    torch.manual_seed(2)  # the global generator plays no part
    again = init_head(8, torch.Generator().manual_seed(5), torch.float32, torch.device("cpu"))
    assert all(torch.equal(first[k], again[k]) for k in first)
    # drawn in float64: a float64 head has full double precision, not float32 values widened
    wide = init_head(8, torch.Generator().manual_seed(5), torch.float64, torch.device("cpu"))
    assert all(wide[k].dtype == torch.float64 for k in wide)
    assert not torch.equal(wide[HEAD + "0.weight"], wide[HEAD + "0.weight"].float().double())
    torch.testing.assert_close(wide[HEAD + "0.weight"].float(), first[HEAD + "0.weight"], rtol=0, atol=0)


def test_the_servers_head_comes_from_the_seeds_fedbr_head_stream():
    setup, algo, _ = make()
    state = initial_state(setup)
    torch.manual_seed(10)
    one = algo.init_server(state).model
    torch.manual_seed(11)
    two = algo.init_server(state).model
    expected = init_head(8, method_generator(setup.seed, "fedbr.head"), torch.float32, torch.device("cpu"))
    for name in algo.head_names():
        assert torch.equal(one[name], two[name])
        assert torch.equal(one[name], expected[name])


def test_per_client_pseudo_data_comes_from_the_fedbr_own_pseudo_stream():
    setup, algo, server = make(sized_setup(), pseudo_source="per_client")
    ctx = client_context(1, server, algo, 3)
    x = ctx.inputs().x
    plan = draw_plan([len(x)], 4, 10, method_generator(setup.seed, "fedbr.own_pseudo", 1))
    torch.testing.assert_close(algo.begin(ctx)[PSEUDO], plan_means(plan, 0, x), rtol=0, atol=0)
    setup, algo, server = make(sized_setup(), pseudo_source="per_client", pseudo_refresh="every_round")
    plan = draw_plan([len(x)], 4, 10, method_generator(setup.seed, "fedbr.own_pseudo", 1, 3))
    torch.testing.assert_close(algo.begin(client_context(1, server, algo, 3))[PSEUDO], plan_means(plan, 0, x),
                               rtol=0, atol=0)


# ---------------------------------------------------------------- devices (meta stands in for a GPU)
def test_the_head_and_the_pseudo_data_go_to_the_models_device(monkeypatch):
    assert all(t.device == META for t in init_head(4, torch.Generator(), torch.float32, META).values())
    setup, algo, server = make(sized_setup(), components="classifier")
    on_meta = {k: v.to(META) for k, v in initial_state(setup).items()}
    assert all(algo.init_server(on_meta).model[name].device == META for name in algo.head_names())
    # rsm_clients: D_p assembled from the clients' uploads lands on the server model's device
    _, replies = set_up(algo, server)
    meta_server = ServerState(model=on_meta)
    assert algo.setup_aggregate(meta_server, replies).extra[SHARED + PSEUDO].device == META
    # a client whose D_p arrived on its device makes its labels 1/C there
    ctx = ClientContext(0, 1, 10, 0.1, server.model, {}, shared={PSEUDO: torch.zeros(4, 4, device=META)})
    assert algo.begin(ctx)[PSEUDO_Q].device == META
    # proxy: drawn on the server's device, once and for every round
    fake_proxy(monkeypatch)
    _, algo, _ = make(sized_setup(), pseudo_source="proxy", proxy_dataset="x", pseudo_refresh="every_round")
    assert algo.proxy_pseudo(2, META).device == META
    first = algo.setup_aggregate(meta_server, {})
    assert first.extra[PSEUDO].device == META
    upload = Upload(0, {k: v.clone() for k, v in initial_state(setup).items()}, 10, 1)
    assert algo.aggregate(first, [upload], 1).extra[PSEUDO].device == META


class ShiftedNet(nn.Module):
    """4 -> 8 -> 3 with a learned input shift: its first operation needs the input on the model's device."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shift = nn.Parameter(torch.zeros(4))
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.classifier = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, return_features: bool = False):
        z = self.encoder(x + self.shift)
        logits = self.classifier(z)
        return (z, logits) if return_features else logits


def test_the_proxy_fit_check_runs_on_the_models_device(monkeypatch):
    proxy = torch.randn(30, 4, generator=torch.Generator().manual_seed(3))  # on the CPU, as loaded
    monkeypatch.setattr(fedbr_module, "load_proxy", lambda hp, seed, cache_dir="": (proxy, lambda raw: raw))
    model = ShiftedNet().to(META)
    names = [n for n, _ in model.named_parameters()]
    setup = Setup(model=ModelCaller(model), groups={p: [n for n in names if n.startswith(p)] for p in
                                                    ("encoder", "classifier")},
                  num_clients=4, num_classes=3, client_sizes=[10] * 4, train=TrainConfig(batch_size=4), seed=0)
    algo = build_algorithm("fedbr", {"pseudo_source": "proxy", "proxy_dataset": "x"}, setup)  # fits: no error
    assert algo.proxy[0] is proxy


# ---------------------------------------------------------------- the proxy loader
def test_load_proxy_uses_the_runs_seed_and_keeps_float_inputs_as_they_are():
    from hetfl.data.datasets import load_dataset

    hp = FedBRHyper(pseudo_source="proxy", proxy_dataset="synthetic")  # generated from the seed
    x, prepare = load_proxy(hp, 3)
    assert torch.equal(x, torch.as_tensor(load_dataset("synthetic", seed=3).train.x))
    assert not torch.equal(x[:100], torch.as_tensor(load_dataset("synthetic", seed=0).train.x)[:100])
    assert x.dtype == torch.float32 and torch.equal(prepare(x[:5]), x[:5])  # feature vectors: no normalisation


def test_load_proxy_normalises_uint8_images_with_the_proxys_own_statistics(monkeypatch):
    import hetfl.data.datasets as datasets

    images = np.array([[[[0, 51], [102, 255]]], [[[255, 0], [204, 153]]]], dtype=np.uint8)  # [2, 1, 2, 2]
    fake = SimpleNamespace(info=SimpleNamespace(mean=(0.5,), std=(0.25,)), train=SimpleNamespace(x=images))
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: fake)
    x, prepare = load_proxy(FedBRHyper(pseudo_source="proxy", proxy_dataset="images"), 0)
    assert x.dtype == torch.uint8
    expected = (torch.tensor(images, dtype=torch.float32) / 255 - 0.5) / 0.25  # (x / 255 - mean) / std
    torch.testing.assert_close(prepare(x), expected)
    assert prepare(x)[0, 0, 0, 0].item() == pytest.approx(-2.0) and prepare(x)[0, 0, 1, 1].item() == pytest.approx(2.0)


def test_missing_proxy_files_are_a_config_error_and_never_downloaded(monkeypatch, tmp_path):
    import hetfl.data.datasets.download as download
    from hetfl.data.base import DatasetError

    fetched = []

    def no_network(remote, root):
        fetched.append(remote.name)
        raise DatasetError("no network in this test")

    monkeypatch.setattr(download, "fetch", no_network)
    hp = FedBRHyper(pseudo_source="proxy", proxy_dataset="mnist", proxy_root=str(tmp_path))  # empty folder
    with pytest.raises(ConfigError) as err:
        load_proxy(hp, 0)
    assert fetched == []
    assert (err.value.key, err.value.value) == ("algorithm.proxy_root", str(tmp_path))
    assert str(err.value).startswith(f"algorithm.proxy_root = {str(tmp_path)!r}: must hold the files of "
                                     "algorithm.proxy_dataset = 'mnist' (mnist: ")


# ---------------------------------------------------------------- engine: a local round
SYNTHETIC = ["data.num_clients=30", "train.batch_size=16", "runtime.progress=false", "model.options={hidden = [16]}",
             "algorithm.name=fedbr"]


def local_round(*overrides: str, client: int = 0):
    """One local round of client ``client`` through the engine (set-up round first)."""
    exp = Experiment(config.load(None, [*SYNTHETIC, *overrides]))
    server, _, _ = exp.setup_round(exp.initial_server())
    algo = exp.algorithm
    ctx = exp.client_context(client, 1, lr_at(exp.cfg, 1), algo.payload(server, client),
                             algo.init_client_state(client, server), server)
    return exp, train_client(algo, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train), ctx


def test_a_local_round_runs_the_configured_steps_and_logs_both_steps_metrics():
    exp, result, ctx = local_round("train.local_steps=3")
    assert result.steps == 3
    # the max step's L_con is reported under the adversary stage's name
    assert set(result.metric_sums) == {"max/contrastive", "ce", "pseudo_ce", "contrastive"}
    (stage,) = exp.algorithm.stages(ctx)
    assert (stage.name, stage.adversary.name) == ("min", "max")  # the paper's min and max steps, as logged
    exp, result, _ = local_round("train.local_epochs=2")
    n = exp.data.client_sizes[0]
    assert result.steps == 2 * math.ceil(n / 16)  # two passes over the client's data


def test_the_proxy_is_loaded_with_the_runs_seed():
    from hetfl.data.datasets import load_dataset

    exp = Experiment(config.load(None, [*SYNTHETIC, "seed=3", "algorithm.pseudo_source=proxy",
                                        "algorithm.proxy_dataset=synthetic"]))
    assert torch.equal(exp.algorithm.proxy[0], torch.as_tensor(load_dataset("synthetic", seed=3).train.x))


# ---------------------------------------------------------------- min and max steps off the default path
def moved(algo, ctx, scale: float = 0.3, seed: int = 9):
    """A local state a few steps away from the received global model (so f differs from f_g)."""
    state = algo.start_state(ctx)
    params = perturbed({n: state[n] for n in algo.model.param_names}, scale, seed)
    return {**state, **params}


def soft_ce(logits, q):
    return -(q * F.log_softmax(logits, 1)).sum(1).mean()


def test_mixture_min_and_max_steps_use_global_features_of_the_steps_mixtures():
    setup, algo, _server, ctx = ready({"pseudo": "mixture", "lam": 0.7, "mu": 0.3})
    batch = data_batch(4, seed=7)
    batch.draws = {MIX_INDEX: torch.tensor([3, 3, 0, 1])}
    state = moved(algo, ctx)
    mixed = (ctx.extras[PSEUDO] + batch.x[[3, 3, 0, 1]]) / 2
    q = (1 / 3 + F.one_hot(batch.y[[3, 3, 0, 1]], 3).float()) / 2
    z, logits = setup.model.features_and_logits(state, batch.x)
    zp, lp = setup.model.features_and_logits(state, mixed)
    zg = setup.model.reference_features(ctx.payload, mixed)  # f_g of this step's mixtures
    con = contrastive_loss(project(state, zp), project(state, zg), project(state, z), 0.5, 0.5)
    expected = F.cross_entropy(logits, batch.y) + 0.7 * soft_ce(lp, q) + 0.3 * con
    loss, metrics = algo.loss(state, batch, ctx)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert metrics["contrastive"].item() == pytest.approx(con.item(), rel=1e-6)
    assert con.item() > 0.1 and abs(F.cosine_similarity(project(state, zp), project(state, zg)).mean() - 1) > 1e-3
    max_loss, max_metrics = algo.max_loss(state, batch, ctx)
    assert max_loss.item() == pytest.approx(-con.item(), rel=1e-6)
    assert set(max_metrics) == {"contrastive"}


def test_mixture_with_the_classifier_component_only_draws_positions_and_mixes():
    setup, algo, _server, ctx = ready({"pseudo": "mixture", "components": "classifier"})
    (stage,) = algo.stages(ctx)
    batch = data_batch(4, seed=8)
    batch.draws = stage.draws(torch.Generator().manual_seed(4), 4)
    index = batch.draws[MIX_INDEX]
    state = moved(algo, ctx)
    mixed = (ctx.extras[PSEUDO] + batch.x[index]) / 2
    q = (1 / 3 + F.one_hot(batch.y[index], 3).float()) / 2
    expected = F.cross_entropy(setup.model.logits(state, batch.x), batch.y) + soft_ce(
        setup.model.logits(state, mixed), q)
    assert algo.loss(state, batch, ctx)[0].item() == pytest.approx(expected.item(), rel=1e-6)


def test_mixture_labels_have_every_class_even_if_the_batch_lacks_the_last():
    _setup, algo, _server, ctx = ready({"pseudo": "mixture"})
    batch = data_batch(4, seed=5)
    batch.y = torch.tensor([0, 1, 1, 0])  # class 2 absent from the batch
    batch.draws = {MIX_INDEX: torch.tensor([0, 1, 2, 3])}
    _, q, _ = algo.pseudo_batch(batch, ctx)
    torch.testing.assert_close(q, torch.tensor([[2 / 3, 1 / 6, 1 / 6], [1 / 6, 2 / 3, 1 / 6],
                                                [1 / 6, 2 / 3, 1 / 6], [2 / 3, 1 / 6, 1 / 6]]))


def test_a_short_batch_pairs_only_its_samples_with_the_first_pseudo_samples():
    setup, algo, _server, ctx = ready({"lam": 0.5, "mu": 0.5})
    batch = data_batch(3, seed=11)  # 3 real samples, 4 pseudo samples
    state = moved(algo, ctx)
    z, logits = setup.model.features_and_logits(state, batch.x)
    zp, lp = setup.model.features_and_logits(state, ctx.extras[PSEUDO])
    zg = ctx.extras[GLOBAL_FEATURES]
    con = contrastive_loss(project(state, zp[:3]), project(state, zg[:3]), project(state, z), 0.5, 0.5)
    expected = F.cross_entropy(logits, batch.y) + 0.5 * soft_ce(lp, torch.full((4, 3), 1 / 3)) + 0.5 * con
    assert algo.loss(state, batch, ctx)[0].item() == pytest.approx(expected.item(), rel=1e-6)
    assert algo.max_loss(state, batch, ctx)[0].item() == pytest.approx(-con.item(), rel=1e-6)


def test_fedbr_mixup_takes_the_mixup_cross_entropy_of_the_mixed_batch():
    setup, algo, _server, ctx = ready({"mixup": True, "lam": 0.0, "components": "classifier"})  # CE only
    (stage,) = algo.stages(ctx)
    batch = data_batch(4, seed=12)
    batch.draws = stage.draws(torch.Generator().manual_seed(3), 4)
    batch.draws[PERM], batch.draws[LAM] = torch.tensor([2, 3, 0, 1]), torch.tensor(0.3)
    state = moved(algo, ctx)
    logits = setup.model.logits(state, 0.3 * batch.x + 0.7 * batch.x[[2, 3, 0, 1]])
    expected = 0.3 * F.cross_entropy(logits, batch.y) + 0.7 * F.cross_entropy(logits, batch.y[[2, 3, 0, 1]])
    loss, metrics = algo.loss(state, batch, ctx)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert metrics["ce"].item() == pytest.approx(expected.item(), rel=1e-6)


# ---------------------------------------------------------------- per-step draws
def test_per_step_draws_are_only_what_a_step_uses_from_the_steps_generator():
    _setup, algo, _server, ctx = ready()
    assert algo.stages(ctx)[0].draws is None  # "rsm" without Mixup: nothing random per step
    _setup, algo, _server, ctx = ready({"pseudo": "mixture"})
    draw = algo.stages(ctx)[0].draws
    torch.manual_seed(0)
    first = draw(torch.Generator().manual_seed(6), 5)
    torch.manual_seed(1)  # the global generator plays no part
    again = draw(torch.Generator().manual_seed(6), 5)
    assert set(first) == {MIX_INDEX}
    assert torch.equal(first[MIX_INDEX], again[MIX_INDEX])
    assert torch.equal(first[MIX_INDEX], torch.randint(0, 5, (4,), generator=torch.Generator().manual_seed(6)))
    # a batch of one sample: every pseudo sample is mixed with it
    assert torch.equal(draw(torch.Generator().manual_seed(6), 1)[MIX_INDEX], torch.zeros(4, dtype=torch.long))


def test_the_proxy_is_cached_where_the_run_caches_its_data(monkeypatch, tmp_path):
    """data.cache_dir reaches the proxy's loader through the run's Setup (it used to load the proxy into the
    default cache folder whatever the run's setting)."""
    import hetfl.data.datasets as datasets
    from hetfl import config
    from hetfl.engine.experiment import Experiment

    seen = []
    fake = SimpleNamespace(info=SimpleNamespace(mean=(0.5,), std=(0.25,)),
                           train=SimpleNamespace(x=np.zeros((2, 3), dtype=np.float32)))
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: seen.append(kwargs) or fake)
    load_proxy(FedBRHyper(pseudo_source="proxy", proxy_dataset="images"), 0, str(tmp_path / "cache"))
    load_proxy(FedBRHyper(pseudo_source="proxy", proxy_dataset="images"), 0)
    assert [kwargs["cache_dir"] for kwargs in seen] == [str(tmp_path / "cache"), None]
    monkeypatch.undo()
    exp = Experiment(config.load(None, ["train.rounds=1", f"data.cache_dir={tmp_path / 'c2'}"]))
    assert exp.setup.cache_dir == str(tmp_path / "c2")


def test_a_contradicting_run_wide_weighting_is_refused_with_the_whole_message():
    """``train.weighting = "uniform"`` with ``algorithm.weighting = "size"`` is refused by FedBR itself, naming
    the run-wide key, its value and why (compared whole: the mutation run's survivors changed the key, the
    compared value and the text); every other pair is accepted."""
    from tests.helpers import tiny_setup

    for run_wide in ("size", "uniform"):
        assert build_algorithm("fedbr", {"weighting": "uniform"}, tiny_setup(weighting=run_wide)).hp.weighting \
            == "uniform"
    assert build_algorithm("fedbr", {"weighting": "size"}, tiny_setup(weighting="size")).hp.weighting == "size"
    with pytest.raises(ConfigError) as refused:
        build_algorithm("fedbr", {"weighting": "size"}, tiny_setup(weighting="uniform"))
    assert (refused.value.key, refused.value.value) == ("train.weighting", "uniform")
    assert refused.value.allowed == ("contradicts algorithm.weighting = 'size'; FedBR's own key sets its server "
                                     "weights (its default, 'uniform', is 1/M as Algorithm 1): drop one of the two")


def test_the_proxy_is_loaded_into_the_runs_cache_folder_by_the_method(monkeypatch):
    """``FedBR.__init__`` hands the run's ``data.cache_dir`` (``Setup.cache_dir``) to ``load_proxy`` (the
    loader's own test calls it directly; this one goes through the method)."""
    calls = []
    proxy = torch.randn(30, 4, generator=torch.Generator().manual_seed(3))

    def recording(hp, seed, cache_dir=""):
        calls.append((hp.proxy_dataset, seed, cache_dir))
        return proxy, lambda raw: raw

    monkeypatch.setattr(fedbr_module, "load_proxy", recording)
    setup = sized_setup()
    setup.cache_dir = "/somewhere/cache"
    build_algorithm("fedbr", {"pseudo_source": "proxy", "proxy_dataset": "cifar10"}, setup)
    assert calls == [("cifar10", setup.seed, "/somewhere/cache")]
