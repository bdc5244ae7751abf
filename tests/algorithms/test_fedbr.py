"""FedBR (Guo et al. 2023): contrastive term, shared pseudo-data, max/min steps, server weights, ablations.

Golden values come from the authors' functions, transcribed outside this repository and run on the
fixed inputs built here (LINs-lab/FedBR):
- ``fedbr/scripts/train_fed.py`` at d382a37a779dcbf3ec8a714a0b7f41b056206613:
  ``get_augmentation_mean_data`` (RSM over the clients) and ``get_augmentation_proxy_data``;
- ``fedbr/algorithms.py`` at 3e24f7fa1b71eb67a57222d568d3e77ae80fc378: ``FedBR.update`` (its two
  ``disc_loss`` expressions, the max and the min step) with ``FedBR.sim`` and the head
  ``fedbr/networks.py`` ``MLP`` (3e24f7fa); the code multiplies cosines by ``tau`` = 1 / our ``tau``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hetfl.algorithms import fedbr as fedbr_module
from hetfl.algorithms.base import SHARED, Upload
from hetfl.algorithms.fedbr import (
    GLOBAL_FEATURES,
    HEAD,
    MIX_INDEX,
    PSEUDO,
    PSEUDO_Q,
    contrastive_loss,
    project,
)
from hetfl.algorithms.mixup import LAM, PERM, mixup_draws
from hetfl.algorithms.pseudo_data import assemble, draw_plan, plan_means, proxy_means
from hetfl.engine.local import sgd_step
from hetfl.params import ConfigError
from tests.helpers import MNIST, TinyNet, needs_shared_data
from tests.helpers.fedbr import (
    SIZES,
    client_context,
    client_data,
    data_batch,
    fake_proxy,
    make,
    ready,
    set_up,
    sized_setup,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- L_con and golden values
def test_contrastive_loss_two_sample_case_by_hand():
    # pair 1: local pseudo feature equals the global one (cos 1) and is orthogonal to the real one (cos 0)
    # pair 2: opposite to the global one (cos -1) and equal to the real one (cos 1)
    local = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    glob = torch.tensor([[3.0, 0.0], [0.0, -1.0]])
    real = torch.tensor([[0.0, 5.0], [0.0, 1.0]])
    tau1, tau2 = 0.5, 2.0
    pair1 = -math.log(math.exp(1 / tau1) / (math.exp(1 / tau1) + math.exp(0 / tau2)))
    pair2 = -math.log(math.exp(-1 / tau1) / (math.exp(-1 / tau1) + math.exp(1 / tau2)))
    assert contrastive_loss(local, glob, real, tau1, tau2).item() == pytest.approx((pair1 + pair2) / 2, rel=1e-6)


def golden_inputs():
    """The fixed inputs of the golden script, drawn in its order from one generator."""
    g = torch.Generator().manual_seed(100)
    data = [torch.randn(n, 3, generator=g) for n in (5, 7, 3)]
    proxy = torch.randn(9, 3, generator=g)
    shapes = [(6, 3), (6,), (6, 6), (6,), (3, 6), (3,)]  # MLP(3, 3, width 6): input, hiddens[0], output
    params = [torch.rand(s, generator=g) - 0.5 for s in shapes]
    head = {f"{HEAD}{i // 2}.{'weight' if i % 2 == 0 else 'bias'}": p for i, p in enumerate(params)}
    z = [torch.randn(4, 3, generator=g) for _ in range(3)]  # pseudo (local), pseudo (global), real
    return data, proxy, head, z


# L_con of the authors' FedBR.update (min step) at their tau1 = tau2 = 2 and at tau1 = 2, tau2 = 3
GOLDEN_LCON = {(2.0, 2.0): 0.7199445962905884, (2.0, 3.0): 1.3379061222076416}
# at tau1 = 2, tau2 = 3: d L_con / d z_pseudo, d L_con / d z_real, d L_con / d head output weight,
# and d (max-step loss) / d head input weight
GOLDEN_DZ_PSEUDO = [[0.0024113983381539583, -0.0030501901637762785, 0.0008973799413070083],
                    [-0.0006029242649674416, 0.0023685593623667955, -0.0014483254635706544],
                    [0.01386638730764389, -0.028952091932296753, -0.028704801574349403],
                    [0.002536055399104953, -0.005176595412194729, -0.005165587645024061]]
GOLDEN_DZ_REAL = [[-0.022864608094096184, 0.008943162858486176, -0.007889240980148315],
                  [-0.006314259488135576, 0.012408383190631866, 0.012968061491847038],
                  [-5.0221849960507825e-05, -0.00011035690840799361, -9.249958384316415e-05],
                  [-0.003016300732269883, -0.004144002683460712, 0.003232304472476244]]
GOLDEN_DHEAD_OUT = [[0.009366350248456001, 0.0, 0.05261516943573952, 0.0, 0.0, 0.0001911161234602332],
                    [-0.024087682366371155, 0.0, 0.03257392346858978, 0.0, 0.0, -0.0026466164272278547],
                    [-0.07026536762714386, 0.0, 0.163884237408638, 0.0, 0.0, -0.009713961742818356]]
GOLDEN_MAX_DHEAD_IN = [[-0.040984731167554855, 0.012844032607972622, 0.03813442587852478],
                       [0.0018978056032210588, 0.007500052452087402, 0.016062600538134575],
                       [-0.1058899313211441, -0.097116619348526, -0.09821749478578568],
                       [-0.001495292061008513, -0.0015807545278221369, 0.007093688938766718],
                       [0.010157905519008636, -0.006514685228466988, -0.028337880969047546],
                       [-0.004693231545388699, 0.001959994900971651, 0.03694549947977066]]


def test_contrastive_loss_and_its_gradients_match_the_authors_code():
    _, _, head, (zp, zg, zr) = golden_inputs()
    for (t1, t2), value in GOLDEN_LCON.items():
        loss = contrastive_loss(project(head, zp), project(head, zg), project(head, zr), 1 / t1, 1 / t2)
        assert loss.item() == pytest.approx(value, rel=1e-5)
    head = {k: v.clone().requires_grad_() for k, v in head.items()}
    zp, zr = zp.clone().requires_grad_(), zr.clone().requires_grad_()
    loss = contrastive_loss(project(head, zp), project(head, zg), project(head, zr), 0.5, 1 / 3)
    d_zp, d_zr, d_out = torch.autograd.grad(loss, [zp, zr, head[HEAD + "2.weight"]])
    torch.testing.assert_close(d_zp, torch.tensor(GOLDEN_DZ_PSEUDO), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(d_zr, torch.tensor(GOLDEN_DZ_REAL), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(d_out, torch.tensor(GOLDEN_DHEAD_OUT), rtol=1e-4, atol=1e-6)
    # the max step minimises -L_con (the code's disc_loss without the minus): the opposite head gradient
    (d_in,) = torch.autograd.grad(-contrastive_loss(project(head, zp.detach()), project(head, zg),
                                                    project(head, zr.detach()), 0.5, 1 / 3), [head[HEAD + "0.weight"]])
    torch.testing.assert_close(d_in, torch.tensor(GOLDEN_MAX_DHEAD_IN), rtol=1e-4, atol=1e-6)


GOLDEN_RSM_CLIENTS = [[-0.3415520191192627, -1.0479254722595215, 0.039997197687625885],
                      [-0.7802755236625671, 0.317791610956192, 0.11299611628055573],
                      [0.14672726392745972, 0.18128547072410583, -1.37740957736969],
                      [-0.8822613954544067, 0.22990791499614716, -0.20930513739585876],
                      [0.26126202940940857, 0.17783087491989136, -1.2622708082199097],
                      [0.025863610208034515, -0.5869279503822327, 0.5502659678459167]]
GOLDEN_PROXY = [[-0.039215490221977234, 0.3031061291694641, -0.43085405230522156],
                [-0.15220952033996582, 0.07020093500614166, 0.02781553566455841],
                [0.4861178994178772, -0.3006485402584076, -0.25952041149139404],
                [0.7227661609649658, 0.19900770485401154, -0.5870286226272583]]


def test_rsm_over_clients_matches_the_authors_get_augmentation_mean_data():
    data, _, _, _ = golden_inputs()
    plan = draw_plan([len(x) for x in data], 6, 10, torch.Generator().manual_seed(7))  # the code: manual_seed(7)
    means = {c: plan_means(plan, c, x) for c, x in enumerate(data)}  # each client from its own data only
    assert sum(len(m) for m in means.values()) == 6
    torch.testing.assert_close(assemble(plan, means), torch.tensor(GOLDEN_RSM_CLIENTS), rtol=0, atol=1e-6)


def test_proxy_means_match_the_authors_get_augmentation_proxy_data():
    _, proxy, _, _ = golden_inputs()
    means = proxy_means(proxy, 4, 10, torch.Generator().manual_seed(11))
    torch.testing.assert_close(means, torch.tensor(GOLDEN_PROXY), rtol=0, atol=1e-6)


def test_plan_skips_empty_clients_and_assemble_checks_counts():
    plan = draw_plan([0, 4], 5, 3, torch.Generator().manual_seed(0))
    assert {slot.client for slot in plan} == {1}
    x = torch.arange(4.0).unsqueeze(1)
    with pytest.raises(ValueError, match="client 1 sent 4"):
        assemble(plan, {1: torch.zeros(4, 1)})
    assert torch.equal(assemble(plan, {1: plan_means(plan, 1, x)}), plan_means(plan, 1, x))


# ---------------------------------------------------------------- D_p: shared, once, sources
def test_head_is_initialised_from_the_seed_and_shaped_d_2d_2d_d():
    _setup, algo, server = make()
    d = server.model["classifier.weight"].shape[1]
    assert server.model[HEAD + "0.weight"].shape == (2 * d, d)
    assert server.model[HEAD + "1.weight"].shape == (2 * d, 2 * d)
    assert server.model[HEAD + "2.weight"].shape == (d, 2 * d)
    assert server.model[HEAD + "0.weight"].abs().max() <= 1 / math.sqrt(d)
    _, _, again = make()
    assert all(torch.equal(server.model[k], again.model[k]) for k in algo.head_names())


def test_one_pseudo_dataset_built_from_the_clients_is_shared_by_every_client_once():
    setup, algo, server = make(sized_setup())
    data = client_data()
    server, replies = set_up(algo, server, data)
    plan = draw_plan(list(SIZES), 4, 10, fedbr_module.method_generator(setup.seed, "fedbr.pseudo"))
    expected = assemble(plan, {c: plan_means(plan, c, data[c].x) for c in range(len(SIZES))})
    assert sum(len(r[PSEUDO]) for r in replies.values()) == 4  # B = batch size samples uploaded in all
    assert set(server.extra) == {SHARED + PSEUDO}  # sent once, through the set-up round
    assert torch.equal(server.extra[SHARED + PSEUDO], expected)
    assert PSEUDO not in algo.payload(server, 0)  # not sent again with the model
    seen = []
    for c, round_ in ((0, 1), (2, 1), (3, 5)):
        ctx = client_context(c, server, algo, round_, data)
        ctx.inputs = None  # nothing of a client's own data goes into D_p at training time
        ctx.extras = algo.begin(ctx)
        seen.append(ctx.extras[PSEUDO])
        assert torch.allclose(ctx.extras[PSEUDO_Q], torch.full((4, 3), 1 / 3))
        glob = setup.model.reference_features(ctx.payload, expected)
        assert torch.allclose(ctx.extras[GLOBAL_FEATURES], glob)
    assert all(torch.equal(s, expected) for s in seen)  # two clients, and later rounds, see the same D_p
    after = algo.aggregate(server, [Upload(0, dict(server.model), 10, 1)], 1)
    assert torch.equal(after.extra[SHARED + PSEUDO], expected)  # not refreshed when "once"


def test_proxy_source_draws_on_the_server_once_or_every_round(monkeypatch):
    proxy = fake_proxy(monkeypatch)
    setup, algo, server = make(sized_setup(), pseudo_source="proxy", proxy_dataset="x")
    server, replies = set_up(algo, server)
    assert all(r == {} for r in replies.values())  # nothing of the clients' goes up
    gen = fedbr_module.method_generator(setup.seed, "fedbr.proxy", 1)
    expected = proxy_means(2 * proxy, 4, 10, gen)  # transformed (normalised) before averaging
    torch.testing.assert_close(server.extra[SHARED + PSEUDO], expected)
    after = algo.aggregate(server, [Upload(0, dict(server.model), 10, 1)], 1)
    assert torch.equal(after.extra[SHARED + PSEUDO], expected)
    # Figure 6(b): a new D_p each round, in each round's payload
    _, algo, server = make(sized_setup(), pseudo_source="proxy", proxy_dataset="x", pseudo_refresh="every_round")
    server, _ = set_up(algo, server)
    assert set(server.extra) == {PSEUDO}
    torch.testing.assert_close(algo.payload(server, 2)[PSEUDO], expected)
    round2 = algo.aggregate(server, [Upload(0, dict(server.model), 10, 1)], 1)
    gen = fedbr_module.method_generator(setup.seed, "fedbr.proxy", 2)
    torch.testing.assert_close(algo.payload(round2, 0)[PSEUDO], proxy_means(2 * proxy, 4, 10, gen))
    assert not torch.equal(round2.extra[PSEUDO], expected)
    ctx = client_context(1, round2, algo, 2)
    assert torch.equal(algo.begin(ctx)[PSEUDO], round2.extra[PSEUDO])


def test_per_client_source_builds_from_own_data_fixed_or_redrawn():
    _setup, algo, server = make(sized_setup(), pseudo_source="per_client")
    server, replies = set_up(algo, server)
    assert server.extra == {} and all(r == {} for r in replies.values())
    data = client_data()
    first = algo.begin(client_context(1, server, algo, 1, data))[PSEUDO]
    assert torch.equal(algo.begin(client_context(1, server, algo, 7, data))[PSEUDO], first)
    assert not torch.equal(algo.begin(client_context(2, server, algo, 1, data))[PSEUDO], first)
    _, algo, server = make(sized_setup(), pseudo_source="per_client", pseudo_refresh="every_round")
    assert not torch.equal(algo.begin(client_context(1, server, algo, 2, data))[PSEUDO],
                           algo.begin(client_context(1, server, algo, 3, data))[PSEUDO])


@needs_shared_data
def test_a_proxy_that_does_not_fit_the_model_is_refused_before_training():
    with pytest.raises(ConfigError, match="algorithm.proxy_dataset.*do not fit the model"):
        make(pseudo_source="proxy", proxy_dataset="mnist", proxy_root=str(MNIST))  # 28x28 images, 4-input model
    with pytest.raises(ConfigError, match="algorithm.proxy_root"):
        make(pseudo_source="proxy", proxy_dataset="mnist", proxy_root=str(MNIST / "missing"))


# ---------------------------------------------------------------- server weights
def test_server_weights_participants_uniformly_by_default_or_by_size():
    _setup, algo, server = make()
    ups = [Upload(c, {k: v * scale for k, v in server.model.items()}, num_samples=n, steps=1)
           for c, (scale, n) in enumerate(((1.0, 10), (4.0, 30)))]
    new = algo.aggregate(server, ups, 1)
    for name in (*algo.head_names(), "classifier.weight"):
        assert torch.allclose(new.model[name], 2.5 * server.model[name])  # (1 + 4) / 2, whatever the sizes
    _, algo, _ = make(weighting="size")
    new = algo.aggregate(server, ups, 1)
    assert torch.allclose(new.model["classifier.weight"], 3.25 * server.model["classifier.weight"])


# ---------------------------------------------------------------- min and max steps
def reference_min_loss(setup, state, batch, ctx, lam, mu):
    """CE + lam softCE(pseudo, 1/C) + mu L_con with every term attached (eq. 3)."""
    z, logits = setup.model.features_and_logits(state, batch.x)
    zp, lp = setup.model.features_and_logits(state, ctx.extras[PSEUDO])
    ce = F.cross_entropy(logits, batch.y)
    pseudo_ce = -(F.log_softmax(lp, 1) / 3).sum(1).mean()
    con = contrastive_loss(project(state, zp), project(state, ctx.extras[GLOBAL_FEATURES]), project(state, z),
                           0.5, 0.5)
    return ce + lam * pseudo_ce + mu * con, (ce, pseudo_ce, con)


def test_min_step_loss_and_gradient_are_ce_plus_pseudo_ce_plus_contrastive():
    setup, algo, _server, ctx = ready({"lam": 0.7, "mu": 0.3})
    batch = data_batch(4, seed=1)
    state = algo.start_state(ctx)
    loss, metrics = algo.loss(state, batch, ctx)
    expected, (_ce, pseudo_ce, con) = reference_min_loss(setup, state, batch, ctx, 0.7, 0.3)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert set(metrics) == {"ce", "pseudo_ce", "contrastive"}
    assert pseudo_ce.item() > 0.5 and con.item() > 0.1  # every term weighs in the comparison
    names = algo.model.param_names
    params = {n: state[n].clone().requires_grad_() for n in names}

    def grads(fn):
        return dict(zip(names, torch.autograd.grad(fn({**state, **params}), list(params.values()),
                                                    allow_unused=True, materialize_grads=True), strict=True))

    ours = grads(lambda s: algo.loss(s, batch, ctx)[0])
    ref = grads(lambda s: reference_min_loss(setup, s, batch, ctx, 0.7, 0.3)[0])
    con_only = grads(lambda s: reference_min_loss(setup, s, batch, ctx, 0.7, 0.3)[1][2])
    for name in names:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-5, atol=1e-7)
    # the contrastive term moves the encoder through both the pseudo and the real features
    assert con_only["encoder.0.weight"].abs().sum() > 1e-3


def test_max_step_is_one_ascent_step_of_the_head_on_the_contrastive_loss():
    _setup, algo, _server, ctx = ready()
    (stage,) = algo.stages(ctx)
    adversary = stage.adversary
    assert adversary is not None and set(adversary.trainable) == set(algo.head_names())
    assert adversary.sgd.momentum == 0.0 and adversary.sgd.lr == ctx.lr  # the run's SGD (tiny_setup: none)
    state = algo.start_state(ctx)
    batch = data_batch(4, seed=2)
    head = {n: state[n].clone().requires_grad_() for n in algo.head_names()}
    con = -algo.max_loss({**state, **head}, batch, ctx)[0]
    ascent = dict(zip(head, torch.autograd.grad(con, list(head.values())), strict=True))
    new, _, _, _ = sgd_step(adversary, state, {}, batch, ctx, first_step=True)
    assert set(new) == set(algo.head_names())
    for name in algo.head_names():  # theta + lr * dL_con/dtheta: up the contrastive loss
        torch.testing.assert_close(new[name], state[name] + ctx.lr * ascent[name], rtol=1e-5, atol=1e-7)
    after = -algo.max_loss({**state, **new}, batch, ctx)[0]
    assert after > con.detach()
    # its features are the local model's on the step's pseudo and real batch, detached
    z_pseudo = algo.model.features_and_logits(state, ctx.extras[PSEUDO])[0]
    z_real = algo.model.features_and_logits(state, batch.x)[0]
    expected = contrastive_loss(project(state, z_pseudo), project(state, ctx.extras[GLOBAL_FEATURES]),
                                project(state, z_real), 0.5, 0.5)
    assert con.item() == pytest.approx(expected.item(), rel=1e-6)
    # the min step does not touch the head
    new, *_ = sgd_step(stage, state, {}, batch, ctx, first_step=True)
    assert not set(new) & set(algo.head_names())


def test_ablations_switch_components():
    batch = data_batch(4, seed=3)
    _, algo, _, ctx = ready({"components": "classifier"})
    (stage,) = algo.stages(ctx)
    assert stage.adversary is None
    assert set(algo.loss(algo.start_state(ctx), batch, ctx)[1]) == {"ce", "pseudo_ce"}
    _, algo, _, ctx = ready({"components": "features"})
    assert algo.stages(ctx)[0].adversary is not None
    assert set(algo.loss(algo.start_state(ctx), batch, ctx)[1]) == {"ce", "contrastive"}
    _, algo, _, ctx = ready({"max_step": False})
    assert algo.stages(ctx)[0].adversary is None


def test_mixture_mixes_each_pseudo_sample_with_a_drawn_batch_position():
    _setup, algo, _server, ctx = ready({"pseudo": "mixture"})
    assert GLOBAL_FEATURES not in ctx.extras  # computed at each step from the step's mixtures
    (stage,) = algo.stages(ctx)
    draws = stage.draws(torch.Generator().manual_seed(0), 3)
    assert draws[MIX_INDEX].shape == (4,) and int(draws[MIX_INDEX].max()) < 3
    batch = data_batch(3, seed=4)
    batch.draws = {MIX_INDEX: torch.tensor([2, 0, 2, 1])}
    pseudo, q, pairs = algo.pseudo_batch(batch, ctx)
    assert pairs == 3
    torch.testing.assert_close(pseudo, (ctx.extras[PSEUDO] + batch.x[[2, 0, 2, 1]]) / 2)
    torch.testing.assert_close(q, (1 / 3 + F.one_hot(batch.y[[2, 0, 2, 1]], 3)) / 2)


def test_fedbr_mixup_uses_beta_0_2_by_default_and_mixes_labels_of_the_mixture():
    _setup, algo, _server, ctx = ready({"mixup": True, "pseudo": "mixture"})
    assert algo.hp.mixup_alpha == 0.2
    (stage,) = algo.stages(ctx)
    ours = stage.draws(torch.Generator().manual_seed(5), 4)
    theirs = mixup_draws(0.2)(torch.Generator().manual_seed(5), 4)
    assert torch.equal(ours[PERM], theirs[PERM]) and torch.equal(ours[LAM], theirs[LAM])
    batch = data_batch(4, seed=6)
    batch.draws = {PERM: torch.tensor([1, 0, 3, 2]), LAM: torch.tensor(0.3), MIX_INDEX: torch.tensor([0, 1, 2, 3])}
    mixed = 0.3 * batch.x + 0.7 * batch.x[[1, 0, 3, 2]]
    pseudo, q, _ = algo.pseudo_batch(batch, ctx)
    torch.testing.assert_close(pseudo, (ctx.extras[PSEUDO] + mixed) / 2)
    onehot = F.one_hot(batch.y, 3).float()
    torch.testing.assert_close(q, (1 / 3 + 0.3 * onehot + 0.7 * onehot[[1, 0, 3, 2]]) / 2)


def test_settings_are_validated():
    with pytest.raises(ConfigError, match="algorithm.pseudo"):
        make(pseudo="gan")
    with pytest.raises(ConfigError, match="algorithm.tau1"):
        make(tau1=0.0)
    with pytest.raises(ConfigError, match="algorithm.proxy_dataset"):
        make(pseudo_source="proxy")
    with pytest.raises(ConfigError, match="algorithm.pseudo_refresh.*rsm_clients"):
        make(pseudo_refresh="every_round")
    with pytest.raises(ConfigError, match="algorithm.weighting"):
        make(weighting="loss")


def bn_ready(params):
    """FedBR on a BatchNorm TinyNet (4 clients of SIZES samples, batch 4) after its set-up round: client 0's
    context."""
    from hetfl.algorithms import build_algorithm
    from hetfl.algorithms.base import ModelCaller

    setup = sized_setup()
    model = TinyNet(projector=False, batchnorm=True).train()
    names = [n for n, _ in model.named_parameters()]
    setup.model = ModelCaller(model)
    setup.groups = {"encoder": [n for n in names if n.startswith("encoder.")], "projector": [],
                    "classifier": [n for n in names if n.startswith("classifier.")]}
    algo = build_algorithm("fedbr", params, setup)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["encoder.1.running_mean"] += 2.0  # running statistics far from any batch's
    server = algo.init_server(state)
    server, _ = set_up(algo, server)
    ctx = client_context(0, server, algo)
    ctx.extras = algo.begin(ctx)
    return algo, ctx


def copied(state):
    """A copy of ``state`` that a training-mode forward may update (BatchNorm statistics) in place."""
    return {k: v.clone() for k, v in state.items()}


def test_max_step_reads_the_steps_features_and_leaves_batchnorm_statistics_to_the_min_step():
    """The authors' code runs the encoder once a step (FedBR.update: all_unlabeled_z, all_self_z on the whole
    pseudo set and batch); its max step projects those features, detached, and so updates no BatchNorm
    statistics of its own. Here the max step comes first (its own forward): it must give the head the ascent
    step of L_con on the features of the min step's forward (whole pseudo set, whole batch: BatchNorm by their
    batch statistics), then the first pairs, and leave the running statistics to the min step."""
    algo, ctx = bn_ready({"num_pseudo": 3})  # 3 pseudo samples, batches of 4: 3 pairs
    (stage,) = algo.stages(ctx)
    state = algo.start_state(ctx)
    batch = data_batch(4, seed=2)
    buffers = algo.model.buffer_names
    new, _, _, _ = sgd_step(stage.adversary, state, {}, batch, ctx, first_step=True, buffers=buffers)
    for name in ("encoder.1.running_mean", "encoder.1.running_var", "encoder.1.num_batches_tracked"):
        assert torch.equal(new[name], state[name]), name  # no update by the max step
    pseudo = ctx.extras[PSEUDO]
    z_pseudo = algo.model.features_and_logits(copied(state), pseudo)[0].detach()[:3]  # the min step's forward
    z_real = algo.model.features_and_logits(copied(state), batch.x)[0].detach()[:3]
    head = {n: state[n].clone().requires_grad_() for n in algo.head_names()}
    con = contrastive_loss(project(head, z_pseudo), project(head, ctx.extras[GLOBAL_FEATURES][:3]),
                           project(head, z_real), 0.5, 0.5)
    ascent = dict(zip(head, torch.autograd.grad(con, list(head.values())), strict=True))
    for name in algo.head_names():  # theta + lr * dL_con/dtheta
        torch.testing.assert_close(new[name], state[name] + ctx.lr * ascent[name], rtol=1e-5, atol=1e-7)
    # the min step updates them, once
    new, *_ = sgd_step(stage, state, {}, batch, ctx, first_step=True, buffers=buffers)
    assert new["encoder.1.num_batches_tracked"].item() == state["encoder.1.num_batches_tracked"].item() + 2
    assert not torch.equal(new["encoder.1.running_mean"], state["encoder.1.running_mean"])


def test_the_former_separate_forward_updates_batchnorm_statistics_and_equals_step_without_them():
    """``max_forward = "separate"`` (what runs before the setting computed): the max step's own forward of
    the first pairs updates the running statistics. On a network without BatchNorm, with as many pseudo
    samples as the batch, both rules give the same head to the bit (the presets' VGG-11, simple CNN, CCT
    and fedbr_cnn have none: their numbers do not change)."""
    algo, ctx = bn_ready({"num_pseudo": 3, "max_forward": "separate"})
    (stage,) = algo.stages(ctx)
    state = algo.start_state(ctx)
    batch = data_batch(4, seed=2)
    new, *_ = sgd_step(stage.adversary, state, {}, batch, ctx, first_step=True, buffers=algo.model.buffer_names)
    assert not torch.equal(new["encoder.1.running_mean"], state["encoder.1.running_mean"])
    heads = []
    for rule in ("step", "separate"):
        _, algo, _, ctx = ready({"max_forward": rule})
        (stage,) = algo.stages(ctx)
        new, *_ = sgd_step(stage.adversary, algo.start_state(ctx), {}, data_batch(4, seed=2), ctx, first_step=True)
        heads.append(new)
    assert all(torch.equal(heads[0][n], heads[1][n]) for n in algo.head_names())
