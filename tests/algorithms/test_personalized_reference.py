"""Each personalised method through the engine, against a hand loop of its paper's equations.

A tiny federation (Synthetic data, 5 devices of 4 classes, an MLP 8 -> 6 -> 4), 3 rounds of which 2 of the 5
clients are sampled in each (so some clients skip rounds and one may never train), every local step on the
client's whole training set (batch 1,000 > any client: the batch order cannot matter), plain SGD. The
reference below re-derives, in plain autograd with its own forward pass, what each paper prescribes: the
server's model, every client's personalised model after the last round (whether it took part in it or not)
and its accuracy on its own test split, which is what ``client_acc_mean`` averages (unweighted). Both
executors (sequential; vectorised, vmap forced on the CPU) must give it to float rounding (``ATOL``).

The one-step rules are pinned in ``test_personalized_baselines.py``; this file checks what those do not:
that the engine strings them together (personal state kept over rounds a client skips, the personal model
evaluated on the client's own split, a never-trained client's model) as the papers do.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from hetfl import config
from hetfl.engine.experiment import Experiment
from hetfl.engine.summary import Reporter
from tests.helpers.reference import B2, ENCODER, EXECUTORS, HEAD, PARAMS, W2, features, logits, tiny_federation

ATOL = 2e-5
ROUNDS, STEPS, LR = 3, 3, 0.1
BASE = tiny_federation(ROUNDS, STEPS, LR)


# ------------------------------------------------------------------ the reference's own model and calculus
def ce(p, data):
    x, y = data
    return F.cross_entropy(logits(p, x), y)


def grad(fn, p, names=PARAMS):
    """d fn(p) / d p[n] for ``names`` (the others held fixed)."""
    leaves = {n: p[n].detach().clone().requires_grad_() for n in names}
    value = fn({**p, **leaves})
    return dict(zip(names, torch.autograd.grad(value, [leaves[n] for n in names]), strict=True))


def gd(p, fn, steps=STEPS, names=PARAMS, lr=LR):
    """``steps`` plain gradient steps on ``fn`` over ``names``."""
    p = dict(p)
    for _ in range(steps):
        g = grad(fn, p, names)
        p.update({n: p[n] - lr * g[n] for n in names})
    return p


def mean(models, weights, names=PARAMS):
    total = sum(weights)
    return {n: sum(w / total * m[n] for m, w in zip(models, weights, strict=True)) for n in names}


def accuracy(predict, data):
    x, y = data
    return int((predict(x).argmax(1) == y).sum()) / len(y)


class Federation:
    """What the reference knows of the federation: the initial model, the clients' data, who is sampled."""

    def __init__(self, exp: Experiment):
        self.exp = exp
        self.init = {n: t.detach().clone() for n, t in exp.initial_server().model.items() if n in PARAMS}
        self.clients = range(exp.data.num_clients)
        self.train = {c: (exp.client_inputs(c).x, exp.client_inputs(c).y) for c in self.clients}
        self.test = {c: (exp.data.prepare(exp.data.client_tests[c].x), exp.data.client_tests[c].y)
                     for c in self.clients}
        self.size = {c: exp.data.client_sizes[c] for c in self.clients}
        self.sampled = {r: exp.sample_clients(r) for r in range(1, ROUNDS + 1)}


def run_engine(method: str, params: dict, executor: str, *extra: str):
    sets = [f"algorithm.{k}={v}" for k, v in params.items()]
    exp = Experiment(config.load(None, [*BASE, f"algorithm.name={method}", *sets, *EXECUTORS[executor], *extra]))
    server, clients = exp.initial_server(), {}
    for r in range(1, ROUNDS + 1):
        server = exp.round(server, clients, r, Reporter())["_server"]
    return exp, server, clients, exp.evaluate(server, clients, ROUNDS)


def evaluated_model(exp, server, clients, c):
    algo = exp.algorithm
    return algo.client_model(server, clients.get(c) or algo.init_client_state(c, server), c)


def assert_close(engine, hand, what, names=PARAMS):
    for n in names:
        diff = (engine[n].double() - hand[n].double()).abs().max().item()
        assert diff <= ATOL, f"{what}: {n} differs from the reference by {diff:.2e}"


def check(fed, exp, server, clients, line, personal, hand_global=None, predictors=None):
    """The engine against the reference: the global model (where there is one), every client's evaluated
    model, every client's accuracy on its own test split, and the unweighted mean of those."""
    if hand_global is not None:
        assert_close(server.model, hand_global, "global model")
    assert ("global_acc" in line) == (not exp.algorithm.personalized)
    hand_acc = {}
    for c in fed.clients:
        if personal is not None:
            assert_close(evaluated_model(exp, server, clients, c), personal[c], f"client {c}'s evaluated model")
        predict = predictors[c] if predictors else (lambda x, p=personal[c]: logits(p, x))
        hand_acc[c] = accuracy(predict, fed.test[c])
    assert line["_client_acc"] == pytest.approx(hand_acc, abs=1e-9)
    assert line["client_acc_mean"] == pytest.approx(sum(hand_acc.values()) / len(hand_acc), abs=1e-9)


def never_and_skipped(fed):
    """The clients that never trained and those that skipped the last round (the cases this file is for)."""
    trained = {c for r in fed.sampled for c in fed.sampled[r]}
    return set(fed.clients) - trained, set(trained) - set(fed.sampled[ROUNDS])


def test_the_federation_has_the_cases_the_references_are_about():
    exp = Experiment(config.load(None, [*BASE, "algorithm.name=fedavg"]))
    fed = Federation(exp)
    never, skipped = never_and_skipped(fed)
    assert never and skipped, fed.sampled  # a client that never trained, one whose state waits a round
    assert len(set(fed.size.values())) > 1  # data-size weights differ from uniform ones


# ------------------------------------------------------------------------------------------------ Ditto
def ditto_reference(fed, lam):
    """Li et al. 2021, Algorithm 1: w_k = SGD on F_k from w^t; v_k <- v_k - eta (grad F_k(v_k) + lam (v_k - w^t)),
    v_k starting at the global model of the client's first round; clients evaluated with v_k (never trained: w)."""
    w, v = dict(fed.init), {}
    for r in range(1, ROUNDS + 1):
        locals_ = []
        for c in fed.sampled[r]:
            locals_.append(gd(w, lambda p, c=c: ce(p, fed.train[c])))
            anchor = w
            prox = lambda p, c=c, a=anchor: ce(p, fed.train[c]) + lam / 2 * sum(
                ((p[n] - a[n]) ** 2).sum() for n in PARAMS)
            v[c] = gd(v.get(c, w), prox)
        w = mean(locals_, [fed.size[c] for c in fed.sampled[r]])
    return w, {c: v.get(c, w) for c in fed.clients}


@pytest.mark.parametrize("executor", EXECUTORS)
def test_ditto_follows_algorithm_1(executor):
    exp, server, clients, line = run_engine("ditto", {"lam": 0.5}, executor)
    fed = Federation(exp)
    w, personal = ditto_reference(fed, 0.5)
    check(fed, exp, server, clients, line, personal, w)


# ------------------------------------------------------------------------------------------------- APFL
def mixed(v, w, alpha):
    return {n: alpha * v[n] + (1 - alpha) * w[n] for n in PARAMS}


def apfl_reference(fed, every):
    """Deng et al. 2020, Algorithm 1: from the same point, w_i <- w_i - eta grad f(w_i),
    v_i <- v_i - eta grad_v f(alpha v_i + (1 - alpha) w_i),
    alpha <- P_[0,1](alpha - eta <v_i - w_i, grad f(v_bar_i)>) (every step, or once at the round's start with
    w_i = w^t); evaluated with alpha v_i + (1 - alpha) w (w: the global model now)."""
    w, v, alpha = dict(fed.init), {}, {}
    for r in range(1, ROUNDS + 1):
        locals_ = []
        for c in fed.sampled[r]:
            data = fed.train[c]
            wi, vi, a = dict(w), dict(v.get(c, w)), alpha.get(c, 0.5)

            def alpha_grad(vi, wi, a, data=data):
                t = torch.tensor(a, requires_grad=True)
                (g,) = torch.autograd.grad(ce(mixed(vi, wi, t), data), t)
                return float(g)

            if every == "round":
                a = min(max(a - LR * alpha_grad(vi, wi, a), 0.0), 1.0)
            for _ in range(STEPS):
                gw = grad(lambda p, data=data: ce(p, data), wi)
                gv = grad(lambda p, wi=wi, a=a, data=data: ce(mixed(p, wi, a), data), vi)
                ga = alpha_grad(vi, wi, a) if every == "step" else 0.0
                wi = {n: wi[n] - LR * gw[n] for n in PARAMS}
                vi = {n: vi[n] - LR * gv[n] for n in PARAMS}
                a = min(max(a - LR * ga, 0.0), 1.0)
            locals_.append(wi)
            v[c], alpha[c] = vi, a
        w = mean(locals_, [fed.size[c] for c in fed.sampled[r]])
    return w, {c: mixed(v[c], w, alpha[c]) if c in v else w for c in fed.clients}


@pytest.mark.parametrize("every", ["round", "step"])
@pytest.mark.parametrize("executor", EXECUTORS)
def test_apfl_follows_algorithm_1(executor, every):
    exp, server, clients, line = run_engine("apfl", {"alpha_every": every}, executor)
    fed = Federation(exp)
    w, personal = apfl_reference(fed, every)
    check(fed, exp, server, clients, line, personal, w)


# ------------------------------------------------------------------------------------------------ pFedMe
PFEDME = {"lam": 5.0, "inner_steps": 2, "personal_lr": 0.05, "beta": 0.7}


def pfedme_reference(fed, lam, inner_steps, personal_lr, beta):
    """T. Dinh et al. 2020, Algorithm 1: per local step, K steps of
    theta <- theta - personal_lr (grad f(theta) + lam (theta - w_i)) (warm-started, from w^t at the round's
    start), then w_i <- w_i - eta lam (w_i - theta); server w <- (1 - beta) w + beta sum n_i/n w_i; clients
    evaluated with their last theta (never trained: w)."""
    w, theta = dict(fed.init), {}
    for r in range(1, ROUNDS + 1):
        locals_ = []
        for c in fed.sampled[r]:
            wi, th = dict(w), dict(w)
            for _ in range(STEPS):
                for _ in range(inner_steps):
                    g = grad(lambda p, c=c: ce(p, fed.train[c]), th)
                    th = {n: th[n] - personal_lr * (g[n] + lam * (th[n] - wi[n])) for n in PARAMS}
                wi = {n: wi[n] - LR * lam * (wi[n] - th[n]) for n in PARAMS}
            locals_.append(wi)
            theta[c] = th
        avg = mean(locals_, [fed.size[c] for c in fed.sampled[r]])
        w = {n: (1 - beta) * w[n] + beta * avg[n] for n in PARAMS}
    return w, {c: theta.get(c, w) for c in fed.clients}


@pytest.mark.parametrize("executor", EXECUTORS)
def test_pfedme_follows_algorithm_1(executor):
    exp, server, clients, line = run_engine("pfedme", PFEDME, executor)
    fed = Federation(exp)
    w, personal = pfedme_reference(fed, **PFEDME)
    check(fed, exp, server, clients, line, personal, w)


# ------------------------------------------------------------------------------------------------ Fed-RoD
def fedrod_reference(fed):
    """Chen & Chao 2022 (linear personal head): the shared model on the balanced softmax
    CE(g(f(x)) + log pi_i, y), the personal head p_i (from zero) on CE(stopgrad g(f(x)) + p_i(stopgrad f(x)), y),
    one step for both; evaluated with g + p_i (never trained: g)."""
    w, head = dict(fed.init), {}
    zero = {n: torch.zeros_like(fed.init[n]) for n in HEAD}
    for r in range(1, ROUNDS + 1):
        locals_ = []
        for c in fed.sampled[r]:
            x, y = fed.train[c]
            counts = torch.bincount(y, minlength=4).float()
            log_prior = torch.log((counts / counts.sum()).clamp(min=1e-12))
            wi, pi = dict(w), dict(head.get(c, zero))
            for _ in range(STEPS):
                gw = grad(lambda p, x=x, y=y, lp=log_prior: F.cross_entropy(logits(p, x) + lp, y), wi)
                z, g_logits = features(wi, x).detach(), logits(wi, x).detach()
                gp = grad(lambda p, z=z, g=g_logits, y=y: F.cross_entropy(g + F.linear(z, p[W2], p[B2]), y), pi,
                          HEAD)
                wi = {n: wi[n] - LR * gw[n] for n in PARAMS}
                pi = {n: pi[n] - LR * gp[n] for n in HEAD}
            locals_.append(wi)
            head[c] = pi
        w = mean(locals_, [fed.size[c] for c in fed.sampled[r]])
    personal = {c: {**w, **{n: w[n] + head.get(c, zero)[n] for n in HEAD}} for c in fed.clients}
    return w, personal


@pytest.mark.parametrize("executor", EXECUTORS)
def test_fedrod_follows_the_paper(executor):
    exp, server, clients, line = run_engine("fedrod", {}, executor)
    fed = Federation(exp)
    w, personal = fedrod_reference(fed)
    check(fed, exp, server, clients, line, personal, w)


# ------------------------------------------------------------------------------------------------ kNN-Per
def fedavg_reference(fed, train_names=PARAMS):
    w = dict(fed.init)
    for r in range(1, ROUNDS + 1):
        locals_ = [gd(w, lambda p, c=c: ce(p, fed.train[c]), names=train_names) for c in fed.sampled[r]]
        w = mean(locals_, [fed.size[c] for c in fed.sampled[r]])
    return w


def knn_predictor(w, store, k, lam, scale):
    """Marfoq et al. 2022: lam p_kNN + (1 - lam) p_model, p_kNN from the k nearest stored features (the
    client's training set under w), weights exp(-||z - z_j||^2 / (d scale)) normalised; one query at a time."""
    keys, labels = features(w, store[0]), store[1]

    def predict(x):
        out = []
        for z, p_model in zip(features(w, x), F.softmax(logits(w, x), 1), strict=True):
            d2 = ((keys - z) ** 2).sum(1).tolist()
            nearest = sorted(range(len(d2)), key=d2.__getitem__)[:k]
            kernel = [math.exp(-d2[j] / (keys.shape[1] * scale)) for j in nearest]
            p_knn = torch.zeros(4)
            for j, s in zip(nearest, kernel, strict=True):
                p_knn[labels[j]] += s / sum(kernel)
            out.append(lam * p_knn + (1 - lam) * p_model)
        return torch.stack(out)

    return predict


@pytest.mark.parametrize("executor", EXECUTORS)
def test_knnper_interpolates_with_a_datastore_of_the_clients_own_training_set(executor):
    exp, server, clients, line = run_engine("knnper", {"k": 3, "lam": 0.6}, executor)
    fed = Federation(exp)
    w = fedavg_reference(fed)
    predictors = {c: knn_predictor(w, fed.train[c], 3, 0.6, 1.0) for c in fed.clients}
    check(fed, exp, server, clients, line, None, w, predictors)
    for c in fed.clients:  # the interpolated distribution itself, not only its argmax
        ctx = exp.client_context(c, ROUNDS, LR, exp.algorithm.payload(server, c), {}, server)
        with torch.no_grad():
            log_p = exp.algorithm.predictor(server.model, ctx)(fed.test[c][0])
        assert torch.allclose(log_p, predictors[c](fed.test[c][0]).log(), atol=1e-5), c


# ------------------------------------------------------------------------------------------------ FedFomo
def fedfomo_reference(fed):
    """Zhang et al. 2021, every other stored model downloaded, validated on the whole training set
    (val_fraction = 1): w_n = max(0, (L(theta_i) - L(theta_n)) / ||theta_n - theta_i||_2), normalised (all
    zero: none), theta_i <- theta_i + sum w_n (theta_n - theta_i), then local SGD; the server stores the
    upload. Clients evaluated with their own model (never trained: the initial model)."""
    own, stored = {}, {}
    for r in range(1, ROUNDS + 1):
        before = dict(stored)
        for c in fed.sampled[r]:
            mine = own.get(c, fed.init)
            others = [before[o] for o in sorted(before) if o != c]
            if others:
                loss = ce(mine, fed.train[c])
                raw = []
                for m in others:
                    dist = torch.sqrt(sum(((m[n] - mine[n]) ** 2).sum() for n in PARAMS))
                    raw.append(max(0.0, float((loss - ce(m, fed.train[c])) / dist)))
                if sum(raw) > 0:
                    mine = {n: mine[n] + sum(wn / sum(raw) * (m[n] - mine[n]) for wn, m in zip(raw, others,
                                                                                              strict=True))
                            for n in PARAMS}
            own[c] = gd(mine, lambda p, c=c: ce(p, fed.train[c]))
            stored[c] = own[c]
    return {c: own.get(c, fed.init) for c in fed.clients}


@pytest.mark.parametrize("per_round", [2, 4])
@pytest.mark.parametrize("executor", EXECUTORS)
def test_fedfomo_follows_the_paper(executor, per_round):
    """(4 clients a round: several downloaded models with a positive weight, whose ratio the distances set.)"""
    exp, server, clients, line = run_engine("fedfomo", {"num_models": 10, "val_fraction": 1.0}, executor,
                                            f"train.clients_per_round={per_round}")
    fed = Federation(exp)
    check(fed, exp, server, clients, line, fedfomo_reference(fed))


# ------------------------------------------------------------------------- FedPer, FedRep, LG-FedAvg, Local
def partial_reference(fed, shared, stages):
    """The shared names averaged (data-size weights) over the round's clients, the others each client's own
    (from the initial model, kept over the rounds it skips); ``stages``: (names trained, steps) in order."""
    personal_names = tuple(n for n in PARAMS if n not in shared)
    w, mine = dict(fed.init), {}
    for r in range(1, ROUNDS + 1):
        locals_ = []
        for c in fed.sampled[r]:
            p = {**w, **mine.get(c, {n: fed.init[n] for n in personal_names})}
            for names, steps in stages:
                p = gd(p, lambda q, c=c: ce(q, fed.train[c]), steps, names)
            locals_.append(p)
            mine[c] = {n: p[n] for n in personal_names}
        if shared:
            w.update(mean(locals_, [fed.size[c] for c in fed.sampled[r]], shared))
    return {c: {**w, **mine.get(c, {n: fed.init[n] for n in personal_names})} for c in fed.clients}


PARTIAL = {  # method, settings: shared names, stages
    "fedper": ({}, ENCODER, [(PARAMS, STEPS)]),
    "fedrep": ({"head_epochs": 2, "body_epochs": 1}, ENCODER, [(HEAD, 2), (ENCODER, 1)]),
    "lgfedavg": ({}, HEAD, [(PARAMS, STEPS)]),
    "local": ({}, (), [(PARAMS, STEPS)]),
}


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("method", PARTIAL)
def test_partial_sharing_keeps_its_part_and_averages_the_rest(method, executor):
    params, shared, stages = PARTIAL[method]
    exp, server, clients, line = run_engine(method, params, executor)
    fed = Federation(exp)
    check(fed, exp, server, clients, line, partial_reference(fed, shared, stages))


# ------------------------------------------------------------------------------- FedBABU, FedAvg+FT
@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize(("method", "part"), [("fedbabu", "head"), ("fedbabu", "full"), ("fedavg_ft", "full"),
                                              ("fedavg_ft", "head")])
def test_fine_tuning_at_evaluation_starts_from_the_global_model_on_the_clients_own_data(method, part, executor):
    """FedBABU (Oh et al. 2022): the body trained and averaged, the head frozen at its initialisation; FedAvg+FT:
    FedAvg. At evaluation every client (trained or not) fine-tunes a copy of the global model on its own
    training set (2 full-batch steps here) and is evaluated with it; the global model is not changed."""
    exp, server, clients, line = run_engine(method, {"finetune_epochs": 2, "finetune_part": part}, executor)
    fed = Federation(exp)
    w = fedavg_reference(fed, ENCODER if method == "fedbabu" else PARAMS)
    tuned = {c: gd(w, lambda p, c=c: ce(p, fed.train[c]), 2, HEAD if part == "head" else PARAMS)
             for c in fed.clients}
    predictors = {c: (lambda x, p=tuned[c]: logits(p, x)) for c in fed.clients}
    check(fed, exp, server, clients, line, None, w, predictors)


# ------------------------------------------------------------------------------------------------ FedPAC
def simplex_qp_by_enumeration(p):
    """argmin a^T P a over the simplex, exactly: on every support S the stationary point
    a_S = P_S^-1 1 / (1^T P_S^-1 1); the feasible (a >= 0) one of least value."""
    n, best = p.shape[0], None
    for mask in range(1, 2**n):
        s = [i for i in range(n) if mask >> i & 1]
        sub = p[s][:, s]
        try:
            x = torch.linalg.solve(sub, torch.ones(len(s), dtype=p.dtype))
        except RuntimeError:
            continue
        a = torch.zeros(n, dtype=p.dtype)
        a[s] = x / x.sum()
        if (a >= -1e-12).all() and (best is None or a @ p @ a < best @ p @ best - 1e-15):
            best = a.clamp(min=0)
    return best


@pytest.mark.parametrize("executor", EXECUTORS)
def test_fedpac_combines_the_uploaded_classifiers_by_the_papers_qp(executor):
    """Xu et al. 2023, eq. 11, after round 1 (all 5 clients): from the features of each client's training set
    under the received (initial) encoder, h_i[k] = pi_k mu_k and v_i = [sum_k pi_k tr E[z z^T | k] -
    sum_k pi_k^2 ||mu_k||^2] / n_i; client i's weights minimise a^T (diag(v) + D_i) a on the simplex,
    D_i[j1, j2] = sum_k <h_i[k] - h_j1[k], h_i[k] - h_j2[k]> (weights <= 1e-3 dropped, the rest renormalised,
    as the authors' code); its head is sum_j a_j g_j over the uploaded classifiers, and it is evaluated with
    the global encoder and that head."""
    sets = ["algorithm.name=fedpac", "train.clients_per_round=0", "train.rounds=1", *EXECUTORS[executor]]
    exp = Experiment(config.load(None, [*BASE, *sets]))
    server, clients = exp.initial_server(), {}
    server = exp.round(server, clients, 1, Reporter())["_server"]
    line = exp.evaluate(server, clients, 1)
    fed = Federation(exp)
    h, v = [], []
    for c in fed.clients:
        x, y = fed.train[c]
        z = features(fed.init, x).double()
        pi = torch.bincount(y, minlength=4).double() / len(y)
        mu = torch.stack([z[y == k].mean(0) if (y == k).any() else torch.zeros(z.shape[1]) for k in range(4)])
        second = torch.stack([(z[y == k] ** 2).sum(1).mean() if (y == k).any() else torch.zeros(())
                              for k in range(4)])
        h.append(pi[:, None] * mu)
        v.append(float(((pi * second).sum() - (pi**2 * (mu**2).sum(1)).sum()) / len(y)))
    uploaded = [{n: clients[c]["fedpac.local_head/" + n].double() for n in HEAD} for c in fed.clients]
    personal = {}
    for i in fed.clients:
        d = torch.tensor([[float(((h[i] - h[a]) * (h[i] - h[b])).sum()) for b in fed.clients] for a in fed.clients],
                         dtype=torch.float64)
        alpha = simplex_qp_by_enumeration(torch.diag(torch.tensor(v, dtype=torch.float64)) + d)
        alpha = torch.where(alpha > 1e-3, alpha, torch.zeros_like(alpha))
        alpha = alpha / alpha.sum()
        assert (alpha >= 0).all() and float(alpha.sum()) == pytest.approx(1.0)
        head = {n: sum(a * g[n] for a, g in zip(alpha, uploaded, strict=True)).float() for n in HEAD}
        personal[i] = {**{n: server.model[n] for n in ENCODER}, **head}
    check(fed, exp, server, clients, line, personal)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("first_head", ["initial", "server"])
def test_fedpac_a_client_that_never_trained_is_evaluated_with_the_chosen_classifier(first_head, executor):
    """2 of 5 clients a round: a client never sampled is evaluated with the global encoder and, by default, the
    initial model's classifier (the authors' code: each client's model a copy of the initial one, its classifier
    replaced only when it takes part); ``first_head = "server"``: the server model's classifier."""
    exp, server, clients, line = run_engine("fedpac", {"first_head": first_head}, executor)
    fed = Federation(exp)
    never, _ = never_and_skipped(fed)
    assert never
    head = fed.init if first_head == "initial" else server.model
    other = server.model if first_head == "initial" else fed.init
    for c in never:
        model = evaluated_model(exp, server, clients, c)
        assert_close(model, {**server.model, **{n: head[n] for n in HEAD}}, f"client {c}'s evaluated model")
        assert any((model[n] - other[n]).abs().max() > 1e-3 for n in HEAD)  # the two rules differ here
        assert line["_client_acc"][c] == pytest.approx(accuracy(lambda x, p=model: logits(p, x), fed.test[c]),
                                                       abs=1e-9)


def test_fedpac_resumed_from_a_checkpoint_gives_the_uninterrupted_run(tmp_path, monkeypatch):
    """The initial classifier lives in the server state: a run resumed after round 1 (its checkpoint holds it)
    gives the uninterrupted run's metrics, a never-trained client's accuracy included."""
    from hetfl.engine.checkpoint import load_checkpoint
    from hetfl.runtimes import set_up
    from tests.helpers.runs import interrupted

    cfg = config.load(None, [*BASE, "algorithm.name=fedpac", "runtime.checkpoint_every=1"])
    set_up(cfg).run(tmp_path / "whole")
    interrupted(tmp_path / "cut", 1, monkeypatch, cfg)
    ckpt = load_checkpoint(tmp_path / "cut", torch.device("cpu"))
    assert {k for k in ckpt.server.extra if k.startswith("fedpac.initial_head/")} == {
        f"fedpac.initial_head/{n}" for n in HEAD}
    set_up(cfg).run(tmp_path / "cut", resume=True)

    def lines(d):
        return [{k: v for k, v in json.loads(x).items() if not k.endswith("time_s")}
                for x in (d / "metrics.jsonl").read_text().splitlines()]

    assert lines(tmp_path / "cut") == lines(tmp_path / "whole")
