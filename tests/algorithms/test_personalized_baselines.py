"""The defining rule of each personalised baseline of FedPAC's comparison, on a tiny model.

Each rule is checked against an independent computation (autograd of the
paper's formula, a hand-built case); a last group runs every method through
two rounds with a miniature executor and checks that all per-client and
method state lives in the client store and ``ServerState.extra`` (a fresh
instance resumed from a checkpoint gives the same result).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from hetfl.algorithms import build_algorithm
from hetfl.algorithms.base import Batch, ClientContext, ModelCaller, ServerState, Setup, Upload
from hetfl.algorithms.fedfomo import fomo_weights
from hetfl.algorithms.fedrod import log_class_prior
from hetfl.algorithms.knnper import interpolated_log_probs, knn_probabilities
from hetfl.engine.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from hetfl.engine.local import sgd_step
from hetfl.optim import sgd_init
from hetfl.params import ConfigError
from tests.helpers import TinyNet, context, initial_state, perturbed, tiny_setup

GEN = torch.Generator().manual_seed(1)
BATCH = Batch(torch.randn(6, 4, generator=GEN), torch.tensor([0, 1, 2, 0, 1, 2]))
PARAMS = ("encoder.0.weight", "encoder.0.bias", "projector.0.weight", "projector.0.bias", "classifier.weight",
          "classifier.bias")


def make(name, params=None, **setup_kw):
    setup = tiny_setup(**setup_kw)
    algo = build_algorithm(name, params or {}, setup)
    return algo, setup, algo.init_server(initial_state(setup))


def with_data(ctx: ClientContext, algo, batch: Batch = BATCH) -> ClientContext:
    """Give a test context the data accessors the executor provides."""
    ctx.inputs = lambda: batch
    ctx.features = lambda state: (algo.model.features_and_logits(state, batch.x)[0].detach(), batch.y)
    return ctx


def ce(model, state, batch=BATCH):
    return F.cross_entropy(model.logits(state, batch.x), batch.y)


def grad_of(fn, state, names):
    leaves = {n: state[n].detach().clone().requires_grad_() for n in names}
    value = fn({**state, **leaves})
    return dict(zip(names, torch.autograd.grad(value, [leaves[n] for n in names]), strict=True))


def one_step(stage, state, ctx, batch=BATCH):
    new, _, loss, metrics = sgd_step(stage, dict(state), sgd_init({n: state[n] for n in stage.trainable}, stage.sgd),
                                     batch, ctx, True)
    return {**state, **new}, loss, metrics


# --------------------------------------------------------------------- FedAvg+FT
def test_fedavg_ft_fine_tunes_a_copy_of_the_global_model():
    algo, _, server = make("fedavg_ft")
    assert not algo.personalized  # the global model is evaluated as well
    (stage,) = algo.personalize_stages(context(0, server.model))
    assert stage.trainable == algo.model.param_names and stage.epochs == 1
    head, _, _ = make("fedavg_ft", {"finetune_part": "head", "finetune_epochs": 3})
    (stage,) = head.personalize_stages(context(0, server.model))
    assert set(stage.trainable) == {"classifier.weight", "classifier.bias"} and stage.epochs == 3
    none, _, _ = make("fedavg_ft", {"finetune_epochs": 0})
    assert none.personalize_stages(context(0, server.model)) == []
    # training is FedAvg's
    assert algo.client_model(server, {}, 0) is server.model


# ------------------------------------------------------------ partial sharing
def test_fedper_shares_the_base_and_keeps_the_classifier_local():
    algo, _, server = make("fedper")
    head = {"classifier.weight", "classifier.bias"}
    assert set(algo.payload(server, 0)) == set(algo.model.state_names) - head
    state = algo.init_client_state(0, server)
    assert set(state) == {"fedper.personal/" + n for n in head}
    ctx = context(0, algo.payload(server, 0), state)
    (stage,) = algo.stages(ctx)
    assert stage.trainable == algo.model.param_names  # FedPer trains base and head jointly
    local = perturbed(algo.start_state(ctx), 0.1, 3)
    upload, new_state = algo.finish(ctx, local, 2)
    assert set(upload) == set(algo.model.state_names) - head
    assert torch.equal(new_state["fedper.personal/classifier.weight"], local["classifier.weight"])
    other = perturbed(server.model, 0.1, 4)
    agg = algo.aggregate(server, [Upload(0, upload, 30, 1), Upload(1, {n: other[n] for n in upload}, 10, 1)], 1)
    n0 = "encoder.0.weight"
    assert torch.allclose(agg.model[n0], 0.75 * local[n0] + 0.25 * other[n0])
    assert torch.equal(agg.model["classifier.weight"], server.model["classifier.weight"])
    evaluated = algo.client_model(agg, new_state, 0)
    assert torch.equal(evaluated["classifier.weight"], local["classifier.weight"])
    assert torch.equal(evaluated[n0], agg.model[n0])
    two, _, _ = make("fedper", {"personal": "projector+classifier"})
    assert set(two.personal_names()) == head | {"projector.0.weight", "projector.0.bias"}


def test_fedrep_trains_the_head_with_the_body_frozen_then_the_body_with_the_head_frozen():
    algo, _, server = make("fedrep")
    ctx = context(0, algo.payload(server, 0), algo.init_client_state(0, server))
    head_stage, body_stage = algo.stages(ctx)
    assert (head_stage.epochs, body_stage.epochs) == (10, 1)
    assert set(head_stage.trainable) == {"classifier.weight", "classifier.bias"}
    assert set(body_stage.trainable) == set(PARAMS) - {"classifier.weight", "classifier.bias"}
    start = algo.start_state(ctx)
    after_head, _, _ = one_step(head_stage, start, ctx)
    for n in PARAMS:
        changed = not torch.equal(after_head[n], start[n])
        assert changed == n.startswith("classifier"), n  # the body is frozen in the head stage
    after_body, _, _ = one_step(body_stage, after_head, ctx)
    assert torch.equal(after_body["classifier.weight"], after_head["classifier.weight"])
    assert not torch.equal(after_body["encoder.0.weight"], after_head["encoder.0.weight"])
    # the head step is plain SGD on the head's cross-entropy gradient
    g = grad_of(lambda s: ce(algo.model, s), start, ("classifier.weight",))
    assert torch.allclose(after_head["classifier.weight"], start["classifier.weight"] - 0.1 * g["classifier.weight"])
    upload, _ = algo.finish(ctx, after_body, 2)
    assert not any(n.startswith("classifier") for n in upload)  # only the body is averaged
    steps_mode, _, _ = make("fedrep", {"body_epochs": 0, "head_epochs": 0}, local_steps=7)
    (body,) = steps_mode.stages(ctx)
    assert body.steps == 7


def test_lgfedavg_keeps_the_representation_local_and_averages_the_head():
    algo, _, server = make("lgfedavg")
    assert set(algo.personal_names()) == {"encoder.0.weight", "encoder.0.bias"}
    assert set(algo.payload(server, 0)) == set(PARAMS) - {"encoder.0.weight", "encoder.0.bias"}
    ctx = context(0, algo.payload(server, 0), algo.init_client_state(0, server))
    local = perturbed(algo.start_state(ctx), 0.1, 5)
    upload, state = algo.finish(ctx, local, 1)
    assert set(state) == {"lgfedavg.personal/encoder.0.weight", "lgfedavg.personal/encoder.0.bias"}
    agg = algo.aggregate(server, [Upload(0, upload, 10, 1)], 1)
    assert torch.equal(agg.model["classifier.weight"], local["classifier.weight"])
    assert torch.equal(agg.model["encoder.0.weight"], server.model["encoder.0.weight"])


# ---------------------------------------------------------------------- Ditto
def test_ditto_personal_gradient_is_ce_plus_lambda_pull_to_the_global_model():
    algo, _, server = make("ditto", {"lam": 0.7})
    w = server.model
    v = perturbed(w, 0.2, 6)
    state = {"ditto.personal/" + n: t for n, t in v.items()}
    ctx = context(0, w, state)
    global_stage, personal_stage = algo.stages(ctx)
    start = algo.start_state(ctx)
    after, _, _ = one_step(personal_stage, start, ctx)
    g = grad_of(lambda s: ce(algo.model, s), v, PARAMS)
    for n in PARAMS:  # v <- v - eta (grad F(v) + lam (v - w^t))
        expected = v[n] - 0.1 * (g[n] + 0.7 * (v[n] - w[n]))
        assert torch.allclose(after["ditto.personal/" + n], expected, atol=1e-6), n
        assert torch.equal(after[n], w[n])  # the global copy is not touched by the personal stage
    fedavg = build_algorithm("fedavg", {}, algo.setup)
    plain, _, _ = one_step(fedavg.stages(ctx)[0], w, ctx)
    ours, _, _ = one_step(global_stage, start, ctx)
    for n in PARAMS:  # the global model is trained exactly as FedAvg
        assert torch.equal(ours[n], plain[n])
    upload, new_state = algo.finish(ctx, after, 2)
    assert set(upload) == set(algo.model.state_names)
    assert torch.equal(algo.client_model(server, new_state, 0)["classifier.weight"],
                       after["ditto.personal/classifier.weight"])


# ----------------------------------------------------------------------- APFL
def test_apfl_gradients_and_mixture():
    algo, _, server = make("apfl", {"alpha": 0.3, "alpha_every": "step"})
    w = perturbed(server.model, 0.1, 7)
    v = perturbed(server.model, 0.3, 8)
    alpha = torch.tensor(0.3)
    state = {**{"apfl.local/" + n: t for n, t in v.items()}, "apfl.alpha": alpha}
    ctx = context(0, w, state, lr=0.05)
    start = algo.start_state(ctx)
    names = tuple(start)
    g = grad_of(lambda s: algo.loss(s, BATCH, ctx)[0], start, names)
    mix = {n: alpha * v[n] + (1 - alpha) * w[n] for n in PARAMS}
    g_mix = grad_of(lambda s: ce(algo.model, s), mix, PARAMS)
    g_w = grad_of(lambda s: ce(algo.model, s), w, PARAMS)
    for n in PARAMS:
        assert torch.allclose(g[n], g_w[n], atol=1e-6)  # w: its own gradient only
        assert torch.allclose(g["apfl.local/" + n], alpha * g_mix[n], atol=1e-6)  # v: alpha grad f(v_bar)
    inner = sum((v[n] - w[n]).flatten() @ g_mix[n].flatten() for n in PARAMS)
    assert torch.allclose(g["apfl.alpha"], inner, atol=1e-6)  # alpha: <v - w, grad f(v_bar)>
    # the projected step: a huge alpha step lands on the boundary
    transformed = algo.alpha_step({"apfl.alpha": torch.tensor(1e6 * float(torch.sign(inner)))}, start, ctx)
    (stage,) = algo.stages(ctx)
    assert "apfl.alpha" in stage.trainable
    new_alpha = alpha - 0.05 * transformed["apfl.alpha"]
    assert torch.allclose(new_alpha, torch.tensor(0.0 if inner > 0 else 1.0), atol=1e-6)
    # evaluation: alpha v + (1 - alpha) w with the current global model
    evaluated = algo.client_model(ServerState(model=w), state, 0)
    for n in PARAMS:
        assert torch.allclose(evaluated[n], mix[n])


def test_apfl_round_mode_takes_one_projected_alpha_step_before_training():
    algo, _, server = make("apfl", {"alpha": 0.4, "alpha_lr": 0.5})
    assert not algo.personalized
    v = perturbed(server.model, 0.3, 9)
    state = {**{"apfl.local/" + n: t for n, t in v.items()}, "apfl.alpha": torch.tensor(0.4)}
    ctx = with_data(context(0, server.model, state), algo)
    mix = {n: 0.4 * v[n] + 0.6 * server.model[n] for n in PARAMS}
    g_mix = grad_of(lambda s: ce(algo.model, s), mix, PARAMS)
    inner = sum((v[n] - server.model[n]).flatten() @ g_mix[n].flatten() for n in PARAMS)
    assert torch.allclose(algo.alpha_gradient(ctx), inner, atol=1e-6)
    extras = algo.begin(ctx)
    assert torch.allclose(extras["apfl.alpha"], (0.4 - 0.5 * inner).clamp(0, 1), atol=1e-6)
    ctx.extras = extras
    assert torch.equal(algo.start_state(ctx)["apfl.alpha"], extras["apfl.alpha"])
    (stage,) = algo.stages(ctx)
    assert "apfl.alpha" not in stage.trainable
    fixed, _, _ = make("apfl", {"learn_alpha": False})
    assert fixed.begin(ctx) == {} and "apfl.alpha" not in fixed.stages(ctx)[0].trainable


# --------------------------------------------------------------------- Fed-RoD
def test_fedrod_balanced_softmax_generic_head_and_detached_personal_head():
    algo, _, server = make("fedrod")
    labels = torch.tensor([0, 0, 0, 1])
    prior = log_class_prior(labels, 3)
    assert torch.allclose(prior[:2], torch.log(torch.tensor([0.75, 0.25])))
    assert prior[2] < -20  # an absent class: (almost) zero prior, finite
    head = {"fedrod.head/classifier.weight": 0.3 * torch.randn(3, 8, generator=GEN),
            "fedrod.head/classifier.bias": 0.3 * torch.randn(3, generator=GEN)}
    ctx = with_data(context(0, server.model, head), algo)
    ctx.extras = algo.begin(ctx)
    assert torch.allclose(ctx.extras["log_prior"], torch.log(torch.full((3,), 1 / 3)))
    ctx.extras = {"log_prior": torch.log(torch.tensor([0.5, 0.3, 0.2]))}
    start = algo.start_state(ctx)
    names = tuple(algo.stages(ctx)[0].trainable)
    g = grad_of(lambda s: algo.loss(s, BATCH, ctx)[0], start, names)

    def bsm(s):
        return F.cross_entropy(algo.model.logits(s, BATCH.x) + ctx.extras["log_prior"], BATCH.y)

    g_bsm = grad_of(bsm, start, PARAMS)
    for n in PARAMS:  # shared parts: balanced softmax only
        assert torch.allclose(g[n], g_bsm[n], atol=1e-6), n
    z, generic = algo.model.features_and_logits(start, BATCH.x)

    def personal(s):
        p = F.linear(z.detach(), s["fedrod.head/classifier.weight"], s["fedrod.head/classifier.bias"])
        return F.cross_entropy(generic.detach() + p, BATCH.y)

    g_p = grad_of(personal, start, tuple(head))
    for n in head:
        assert torch.allclose(g[n], g_p[n], atol=1e-6)
    # evaluation: generic + personal logits
    evaluated = algo.client_model(server, head, 0)
    p = F.linear(z, head["fedrod.head/classifier.weight"], head["fedrod.head/classifier.bias"])
    assert torch.allclose(algo.model.logits(evaluated, BATCH.x), generic + p, atol=1e-5)
    assert torch.equal(algo.init_client_state(0, server)["fedrod.head/classifier.weight"], torch.zeros(3, 8))


# ---------------------------------------------------------------------- pFedMe
def test_pfedme_step_is_lambda_pull_to_the_inner_solution():
    lam, k, plr, lr = 2.0, 3, 0.05, 0.1
    algo, _, server = make("pfedme", {"lam": lam, "inner_steps": k, "personal_lr": plr})
    w = server.model
    ctx = context(0, w, {}, lr=lr)
    start = algo.start_state(ctx)
    theta0 = perturbed({n: w[n] for n in PARAMS}, 0.1, 10)
    start.update({"pfedme.theta/" + n: theta0[n] for n in PARAMS})
    theta = dict(theta0)  # the inner problem by hand: K steps of GD on f + lam/2 ||theta - w||^2
    for _ in range(k):
        g = grad_of(lambda s: ce(algo.model, s) + lam / 2 * sum(((s[n] - w[n]) ** 2).sum() for n in PARAMS),
                    {**w, **theta}, PARAMS)
        theta = {n: theta[n] - plr * g[n] for n in PARAMS}
    (stage,) = algo.stages(ctx)
    after, loss, _ = one_step(stage, start, ctx)
    for n in PARAMS:
        assert torch.allclose(after["pfedme.theta/" + n], theta[n], atol=1e-5), n  # theta <- theta_hat
        assert torch.allclose(after[n], w[n] - lr * lam * (w[n] - theta[n]), atol=1e-5), n  # w <- w - eta lam (w - th)
    envelope = ce(algo.model, {**w, **theta}) + lam / 2 * sum(((theta[n] - w[n]) ** 2).sum() for n in PARAMS)
    assert torch.allclose(loss, envelope, atol=1e-5)
    _, new_state = algo.finish(ctx, after, 1)
    assert torch.equal(algo.client_model(server, new_state, 0)["classifier.weight"],
                       after["pfedme.theta/classifier.weight"])


def test_pfedme_server_mixes_old_and_averaged_models():
    algo, _, server = make("pfedme", {"beta": 1.5})
    a, b = perturbed(server.model, 0.1, 11), perturbed(server.model, 0.1, 12)
    new = algo.aggregate(server, [Upload(0, a, 10, 1), Upload(1, b, 30, 1)], 1)
    n = "encoder.0.weight"
    assert torch.allclose(new.model[n], -0.5 * server.model[n] + 1.5 * (0.25 * a[n] + 0.75 * b[n]), atol=1e-6)


# --------------------------------------------------------------------- kNN-Per
def test_knn_probabilities_on_a_hand_built_datastore():
    keys = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [5.0, 5.0]])
    labels = torch.tensor([0, 1, 1, 2])
    query = torch.tensor([[0.0, 0.0]])
    p = knn_probabilities(query, keys, labels, k=3, num_classes=3, scale=1.0)
    s = torch.exp(-torch.tensor([0.0, 1.0, 4.0]) / 2)  # exp(-d^2 / (dim * scale)), dim = 2
    assert torch.allclose(p, torch.tensor([[s[0], s[1] + s[2], 0.0]]) / s.sum())
    one = knn_probabilities(query, keys, labels, k=1, num_classes=3, scale=1.0)
    assert torch.equal(one, torch.tensor([[1.0, 0.0, 0.0]]))
    far = knn_probabilities(torch.tensor([[100.0, 100.0]]), keys, labels, k=2, num_classes=3, scale=1e-3)
    assert torch.isfinite(far).all() and torch.allclose(far.sum(), torch.tensor(1.0))  # no underflow to 0/0


def test_knnper_interpolates_model_and_memory():
    algo, _, server = make("knnper", {"k": 2, "lam": 0.0})
    ctx = with_data(context(0, server.model), algo)
    predict = algo.predictor(server.model, ctx)
    logits = algo.model.logits(server.model, BATCH.x)
    assert torch.equal(predict(BATCH.x), F.log_softmax(logits, dim=1))  # lam = 0: the model
    algo, _, _ = make("knnper", {"k": 2, "lam": 0.3})
    out = algo.predictor(server.model, ctx)(BATCH.x)
    feats, labels = ctx.features(server.model)
    p_knn = knn_probabilities(feats, feats, labels, 2, 3, 1.0)
    expected = 0.3 * p_knn + 0.7 * torch.softmax(logits, dim=1)
    assert torch.allclose(out.exp(), expected, atol=1e-6)
    assert torch.allclose(interpolated_log_probs(logits, p_knn, 1.0), torch.log(p_knn))


# --------------------------------------------------------------------- FedFomo
def test_fomo_weights_on_a_constructed_case():
    w = fomo_weights(torch.tensor(1.0), torch.tensor([0.5, 1.5, 0.2]), torch.tensor([1.0, 1.0, 2.0]))
    assert torch.allclose(w, torch.tensor([5 / 9, 0.0, 4 / 9]))  # raw (0.5, 0, 0.4), normalised
    none = fomo_weights(torch.tensor(1.0), torch.tensor([1.5, 2.0]), torch.tensor([1.0, 1.0]))
    assert torch.equal(none, torch.zeros(2))
    same = fomo_weights(torch.tensor(1.0), torch.tensor([0.5]), torch.tensor([0.0]))
    assert torch.equal(same, torch.zeros(1))  # a model identical to one's own carries no information


def test_fedfomo_downloads_others_models_and_combines_them_by_weight():
    algo, _, server = make("fedfomo", {"num_models": 2, "val_fraction": 1.0}, num_clients=4)
    assert algo.payload(server, 0)["fedfomo.candidate_ids"].numel() == 0  # nothing stored yet
    models = {c: perturbed(server.model, 0.2, 20 + c) for c in range(4)}
    server = algo.aggregate(server, [Upload(c, models[c], 10, 1) for c in range(4)], 1)
    chosen = algo.payload(server, 1)["fedfomo.candidate_ids"].tolist()
    assert len(chosen) == 2 and 1 not in chosen
    again = build_algorithm("fedfomo", {"num_models": 2, "val_fraction": 1.0}, algo.setup)
    assert again.payload(server, 1)["fedfomo.candidate_ids"].tolist() == chosen  # deterministic
    everyone = build_algorithm("fedfomo", {"num_models": 9}, algo.setup)
    assert everyone.payload(server, 1)["fedfomo.candidate_ids"].tolist() == [0, 2, 3]  # all when fewer than M
    own = {n: models[1][n] for n in algo.model.state_names}
    ctx = with_data(context(1, algo.payload(server, 1), {"fedfomo.model/" + n: t for n, t in own.items()}), algo)
    extras = algo.begin(ctx)
    cands = [models[c] for c in chosen]
    own_loss = ce(algo.model, own)
    raw = torch.stack([
        (own_loss - ce(algo.model, m)) / torch.cat([(m[n] - own[n]).flatten() for n in PARAMS]).norm()
        for m in cands]).clamp(min=0)
    assert raw.sum() > 0  # the case exercises a real combination
    expected = raw / raw.sum()
    assert torch.allclose(extras["weights"], expected, atol=1e-6)
    ctx.extras = extras
    start = algo.start_state(ctx)
    for n in PARAMS:
        combined = own[n] + sum(wt * (m[n] - own[n]) for wt, m in zip(expected, cands, strict=True))
        assert torch.allclose(start[n], combined, atol=1e-6)
    # a client whose own model is the best keeps it
    best = {n: t for n, t in own.items()}
    worse = build_algorithm("fedfomo", {"num_models": 2, "val_fraction": 1.0}, algo.setup)
    bad = ServerState(model=server.model, extra={**server.extra, **{
        f"fedfomo.client{c}/{n}": t + 5.0 for c in (0, 2, 3) for n, t in best.items()}})
    ctx = with_data(context(1, worse.payload(bad, 1), {"fedfomo.model/" + n: t for n, t in best.items()}), algo)
    ctx.extras = worse.begin(ctx)
    assert torch.equal(ctx.extras["weights"], torch.zeros(2))
    assert all(torch.equal(worse.start_state(ctx)[n], best[n]) for n in PARAMS)


# ---------------------------------------------------------------------- pFedHN
@pytest.mark.parametrize("chunk_size", [16, 0])
def test_pfedhn_hypernetwork_gradient_is_the_vector_jacobian_product(chunk_size):
    params = {"chunk_size": chunk_size, "server_momentum": 0.0, "server_weight_decay": 0.0, "max_grad_norm": 0.0,
              "server_lr": 0.1, "hidden": 12}
    algo, _, server = make("pfedhn", params)
    payload = algo.payload(server, 2)
    assert set(payload) == set(algo.model.state_names)
    for n in PARAMS:
        assert payload[n].shape == server.model[n].shape
    local = perturbed(payload, 0.1, 30)
    ctx = context(2, payload, {})
    upload, _ = algo.finish(ctx, local, 3)
    for n in PARAMS:
        assert torch.allclose(upload["pfedhn.delta/" + n], local[n] - payload[n])
    # independent: autograd of <theta(phi, v), theta_generated - theta_local>
    net = {k: t.detach().clone().requires_grad_() for k, t in algo.hypernetwork(server).items()}
    embed = server.extra["pfedhn.embed"].detach().clone().requires_grad_()
    theta = algo.generate(net, embed[2], algo.scales(server))
    inner = sum((theta[n] * (payload[n] - local[n])).sum() for n in PARAMS)
    expected = torch.autograd.grad(inner, [*net.values(), embed])
    g_net, g_embed = algo.gradients(server, Upload(2, upload, 10, 3))
    for (k, g), e in zip(g_net.items(), expected[:-1], strict=True):
        assert torch.allclose(g, e, atol=1e-6), k
    assert torch.allclose(g_embed, expected[-1][2], atol=1e-6)
    assert torch.count_nonzero(expected[-1][torch.arange(4) != 2]) == 0
    # server step: phi <- phi - lr grad; only the participant's embedding moves
    new = algo.aggregate(server, [Upload(2, upload, 10, 3)], 1)
    for k, g in g_net.items():
        assert torch.allclose(new.extra["pfedhn.hn/" + k], server.extra["pfedhn.hn/" + k] - 0.1 * g, atol=1e-6)
    old_e, new_e = server.extra["pfedhn.embed"], new.extra["pfedhn.embed"]
    assert torch.allclose(new_e[2], old_e[2] - 0.1 * g_embed, atol=1e-6)
    assert torch.equal(new_e[[0, 1, 3]], old_e[[0, 1, 3]])
    # evaluation uses the generated model of the updated hypernetwork
    assert torch.equal(algo.client_model(new, {}, 2)["classifier.weight"], algo.payload(new, 2)["classifier.weight"])


def test_pfedhn_initialisation_is_deterministic_and_small_for_real_models():
    from hetfl.models import build_model
    from hetfl.models.base import param_groups

    _, _, server_a = make("pfedhn")
    _, _, server_b = make("pfedhn")
    assert server_a.extra.keys() == server_b.extra.keys()
    assert all(torch.equal(server_a.extra[k], server_b.extra[k]) for k in server_a.extra)
    assert server_a.extra["pfedhn.embed"].shape == (4, 2)  # 1 + 4 clients / 4
    for name, options in (("mlp", {"hidden": [128]}), ("cnn2", {})):
        model = build_model(name, (1, 28, 28), 10, **options)
        setup = Setup(ModelCaller(model), param_groups(model), 20, 10, [10] * 20, tiny_setup().train, 0)
        algo = build_algorithm("pfedhn", {}, setup)
        extra = algo.init_hypernetwork(torch.device("cpu"))
        size = sum(t.numel() for t in extra.values())
        assert size < 1_000_000, (name, size)
        generated = algo.generate(algo.hypernetwork(ServerState(model={}, extra=extra)), extra["pfedhn.embed"][0])
        assert all(generated[n].shape == p.shape for n, p in model.named_parameters())


@pytest.mark.parametrize("output_scale", ["init", "none"])
def test_pfedhn_output_scale_starts_each_generated_tensor_at_its_targets_initial_rms(output_scale):
    """Unscaled, the hypernetwork emits every tensor at RMS ~0.1 whatever its fan-in (the 2-conv
    CNN's 1024-input layer is initialised at 0.018): the generated CNN's logits start far too large.
    Scaled, each tensor's RMS over the clients equals its target's initial RMS."""
    from hetfl.models import build_model
    from hetfl.models.base import param_groups

    model = build_model("cnn2", (1, 28, 28), 10)
    setup = Setup(ModelCaller(model), param_groups(model), 20, 10, [10] * 20, tiny_setup().train, 0)
    algo = build_algorithm("pfedhn", {"output_scale": output_scale}, setup)
    server = ServerState(model={}, extra=algo.init_hypernetwork(torch.device("cpu")))
    generated = [algo.generated_model(server, c) for c in range(20)]
    for name, p in model.named_parameters():
        rms = (sum(float(g[name].pow(2).mean()) for g in generated) / 20) ** 0.5
        target = float(p.detach().pow(2).mean().sqrt())
        if output_scale == "init":
            assert rms == pytest.approx(target, rel=1e-4), name
        else:
            assert 0.03 < rms < 0.3, (name, rms)  # the same spread for every tensor
    if output_scale == "none":  # the fan-in 1024 layer starts 5x or more above its own init
        weight = next(n for n, p in model.named_parameters() if p.dim() == 2 and p.shape[1] > 1000)
        unscaled = (sum(float(g[weight].pow(2).mean()) for g in generated) / 20) ** 0.5
        assert unscaled > 5 * float(dict(model.named_parameters())[weight].detach().pow(2).mean().sqrt())


# ------------------------------------------------------------------ settings
@pytest.mark.parametrize(("name", "params", "key"), [
    ("fedavg_ft", {"finetune_part": "encoder"}, "algorithm.finetune_part"),
    ("fedper", {"personal": "encoder"}, "algorithm.personal"),
    ("fedrep", {"head_epochs": -1}, "algorithm.head_epochs"),
    ("lgfedavg", {"local": "classifier"}, "algorithm.local"),
    ("ditto", {"lam": -0.1}, "algorithm.lam"),
    ("apfl", {"alpha": 1.5}, "algorithm.alpha"),
    ("apfl", {"alpha_every": "epoch"}, "algorithm.alpha_every"),
    ("fedrod", {"balanced": "yes"}, "algorithm.balanced"),
    ("pfedme", {"inner_steps": 0}, "algorithm.inner_steps"),
    ("knnper", {"lam": 2.0}, "algorithm.lam"),
    ("fedfomo", {"val_fraction": 0.0}, "algorithm.val_fraction"),
    ("pfedhn", {"chunk_size": -1}, "algorithm.chunk_size"),
    ("pfedhn", {"bogus": 1}, "algorithm.bogus"),
])
def test_settings_are_validated(name, params, key):
    with pytest.raises(ConfigError) as err:
        make(name, params)
    assert err.value.key == key
    assert repr(next(iter(params.values()))) in str(err.value)


def test_partial_sharing_needs_parameters_on_both_sides():
    setup = tiny_setup()
    setup.groups = {**setup.groups, "encoder": []}  # a model whose encoder has no parameters
    with pytest.raises(ConfigError) as err:
        build_algorithm("lgfedavg", {}, setup)
    assert err.value.key == "algorithm.local"


# ------------------------------------------------------- state lives in the store
METHODS = ["fedavg_ft", "fedper", "fedrep", "lgfedavg", "ditto", "apfl", "fedrod", "pfedme", "knnper", "fedfomo",
           "pfedhn"]
SMALL = {"fedrep": {"head_epochs": 2}, "fedfomo": {"num_models": 2}, "pfedhn": {"chunk_size": 32, "hidden": 8}}
CLIENTS = 3


def bn_setup() -> Setup:
    model = TinyNet(projector=False, batchnorm=True)
    names = [n for n, _ in model.named_parameters()]
    groups = {part: [n for n in names if n.startswith(part + ".")] for part in ("encoder", "projector", "classifier")}
    return Setup(ModelCaller(model), groups, CLIENTS, 3, [8] * CLIENTS, tiny_setup().train, 0)


def client_data(c: int) -> tuple[Batch, Batch]:
    gen = torch.Generator().manual_seed(100 + c)
    x = torch.randn(8, 4, generator=gen)
    y = torch.tensor([c % 3, c % 3, c % 3, (c + 1) % 3, c % 3, c % 3, (c + 2) % 3, c % 3])
    return Batch(x[:4], y[:4]), Batch(x[4:], y[4:])


def mini_context(algo, server, clients, c, round_):
    state = clients.get(c) or algo.init_client_state(c, server)
    halves = client_data(c)
    full = Batch(torch.cat([h.x for h in halves]), torch.cat([h.y for h in halves]))
    return with_data(ClientContext(c, round_, 8, 0.1, algo.payload(server, c), state), algo, full), halves


def mini_round(algo, server, clients, round_):
    """What the engine does in a round, with two fixed half-batches per epoch."""
    uploads = []
    for c in range(CLIENTS):
        ctx, halves = mini_context(algo, server, clients, c, round_)
        ctx.extras = algo.begin(ctx)
        state = {k: v.detach().clone() for k, v in algo.start_state(ctx).items()}
        steps = 0
        for stage in algo.stages(ctx):
            opt = sgd_init({n: state[n] for n in stage.trainable}, stage.sgd)
            for i in range(stage.steps or 2 * stage.epochs):
                new, opt, _, _ = sgd_step(stage, state, opt, halves[i % 2], ctx, i == 0)
                state.update(new)
                steps += 1
        upload, new_state = algo.finish(ctx, state, steps)
        if new_state:
            clients[c] = new_state
        uploads.append(Upload(c, upload, 8, steps))
    return algo.aggregate(server, uploads, round_)


def mini_evaluate(algo, server, clients, round_):
    """Each client's test logits, as the engine's evaluation computes them."""
    out = []
    for c in range(CLIENTS):
        ctx, halves = mini_context(algo, server, clients, c, round_)
        model_c = algo.client_model(server, ctx.state, c)
        for stage in algo.personalize_stages(ctx):
            model_c = {k: v.detach().clone() for k, v in model_c.items()}
            opt = sgd_init({n: model_c[n] for n in stage.trainable}, stage.sgd)
            for i in range(stage.steps or 2 * stage.epochs):
                new, opt, _, _ = sgd_step(stage, model_c, opt, halves[i % 2], ctx, i == 0)
                model_c = {**model_c, **new}
        test = torch.randn(5, 4, generator=torch.Generator().manual_seed(200 + c))
        predict = algo.predictor(model_c, ctx)
        with torch.no_grad():
            out.append(predict(test) if predict else algo.model.logits(model_c, test))
    return out


@pytest.mark.parametrize("batchnorm", [False, True], ids=["plain", "batchnorm"])
@pytest.mark.parametrize("name", METHODS)
def test_state_lives_in_the_store_and_survives_a_checkpoint(name, batchnorm, tmp_path):
    setup = bn_setup() if batchnorm else tiny_setup(num_clients=CLIENTS)
    algo = build_algorithm(name, SMALL.get(name, {}), setup)
    attributes = copy.copy(vars(algo))
    server = algo.init_server(initial_state(setup))
    clients: dict = {}
    server = mini_round(algo, server, clients, 1)
    # everything the method keeps is a tensor named after the method, and checkpointable
    prefix = name.replace("_ft", "") + "."
    for state in clients.values():
        assert all(isinstance(t, torch.Tensor) and k.startswith(prefix) for k, t in state.items()), list(state)
    assert all(isinstance(t, torch.Tensor) and k.startswith(prefix) for k, t in server.extra.items())
    save_checkpoint(tmp_path, Checkpoint(1, server, clients, {}))
    ckpt = load_checkpoint(tmp_path, torch.device("cpu"))
    # the original instance goes on ...
    server_a = mini_round(algo, server, clients, 2)
    logits_a = mini_evaluate(algo, server_a, clients, 2)
    assert vars(algo).keys() == attributes.keys()
    assert all(vars(algo)[k] is v for k, v in attributes.items())  # nothing stored on the object
    # ... and a fresh instance resumed from the checkpoint does exactly the same
    fresh = build_algorithm(name, SMALL.get(name, {}), setup)
    server_b = mini_round(fresh, ckpt.server, ckpt.clients, 2)
    logits_b = mini_evaluate(fresh, server_b, ckpt.clients, 2)
    for a, b in zip(logits_a, logits_b, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    for k, t in server_a.model.items():
        assert torch.allclose(t, server_b.model[k], atol=1e-6), k
    assert all(torch.isfinite(t).all() for t in logits_a)
