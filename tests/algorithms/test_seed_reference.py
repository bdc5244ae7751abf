"""The four seed methods through the engine, against hand loops of their papers' equations.

A tiny federation (Synthetic data, 5 devices of 4 classes, an MLP 8 -> 6 -> 4), 2 rounds of which 2 of the 5
clients are sampled in each, every local epoch one step on the client's whole training set (batch 1,000 > any
client), plain SGD unless a method prescribes its own optimiser. The reference re-derives, in plain autograd
with its own forward pass, what each paper prescribes:

- CCVR (Luo et al. 2021, Algorithm 1, eq. 2-4) after FedAvg, FedProx and MOON: the per-client per-class means
  and unbiased covariances (N_ck - 1), pooled by eq. 3-4 (N_c - 1), M_c virtual features per class (fixed or
  proportional to N_c / N), ReLU + Tukey, the classifier re-trained alone (SGD with momentum and weight decay,
  shuffled mini-batches) and that calibrated classifier is what ``global_acc`` reports;
- FedUV (Son et al. 2024, eq. 2-4): CE + lam L_V + mu L_U;
- FedBR (Guo et al. 2023, Algorithm 1): per step a max (ascent) step of the projection head on L_con, then a
  min step of the model on CE + lam softCE(pseudo, 1/C) + mu L_con;
- FedPAC (Xu et al. 2023, Algorithm 1): the classifier stage, then the encoder stage with the alignment term
  towards the server's global centroids (the client's own class means where the server has none).

What the reference takes from hetfl is the plumbing audited elsewhere: the data, the sampled clients, the
initial model (FedBR's head with it), the batch order where it matters (FedBR pairs pseudo sample i with
real sample i), FedBR's pseudo data D_p (its RSM draw is pinned against the authors' code in test_fedbr.py),
FedPAC's personalised heads (its QP is checked in test_personalized_reference.py) and CCVR's random stream:
the standard normal draws and batch permutations of the step's stream, turned into N(mu_c, Sigma_c) draws by
the eigen-factor ``V diag(sqrt(lambda))`` of Sigma_c (any L with L L^T = Sigma_c draws from the paper's
Gaussian; the draw order is plumbing). Both executors (sequential; vectorised, vmap forced on the CPU).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from hetfl import config
from hetfl.algorithms.posthoc import stream
from hetfl.engine.experiment import Experiment
from hetfl.engine.schedule import batch_schedule
from hetfl.engine.summary import Reporter
from hetfl.rng import torch_generator
from tests.helpers.reference import B2, ENCODER, EXECUTORS, HEAD, PARAMS, W1, W2, features, logits, tiny_federation

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 2e-5
ROUNDS, STEPS, LR, C = 2, 3, 0.1, 4
BASE = tiny_federation(ROUNDS, STEPS, LR)


# ------------------------------------------------------------------ the reference's own model and calculus
def grad(fn, p, names):
    leaves = {n: p[n].detach().clone().requires_grad_() for n in names}
    value = fn({**p, **leaves})
    return dict(zip(names, torch.autograd.grad(value, [leaves[n] for n in names]), strict=True))


def gd(p, fn, steps=STEPS, names=PARAMS, lr=LR):
    p = dict(p)
    for _ in range(steps):
        g = grad(fn, p, names)
        p.update({n: p[n] - lr * g[n] for n in names})
    return p


def sgd(p, fn, steps, names, lr, momentum, wd):
    """PyTorch's SGD: d = g + wd w; b = d on the first step, then b = momentum b + d; w -= lr b."""
    p, buf = dict(p), {}
    for _ in range(steps):
        g = grad(fn, p, names)
        for n in names:
            d = g[n] + wd * p[n]
            buf[n] = d if n not in buf else momentum * buf[n] + d
            p[n] = p[n] - lr * buf[n]
    return p


def mean(models, weights, names=PARAMS):
    total = sum(weights)
    return {n: sum(w / total * m[n] for m, w in zip(models, weights, strict=True)) for n in names}


def ce(p, x, y):
    return F.cross_entropy(logits(p, x), y)


def assert_close(engine, hand, what, names=PARAMS, atol=ATOL):
    for n in names:
        diff = (engine[n].double() - hand[n].double()).abs().max().item()
        assert diff <= atol, f"{what}: {n} differs from the reference by {diff:.2e}"


class Federation:
    def __init__(self, exp: Experiment):
        self.exp = exp
        self.init = {n: t.detach().clone() for n, t in exp.initial_server().model.items()}
        self.clients = range(exp.data.num_clients)
        self.train = {c: (exp.client_inputs(c).x, exp.client_inputs(c).y) for c in self.clients}
        self.size = {c: exp.data.client_sizes[c] for c in self.clients}
        self.sampled = {r: exp.sample_clients(r) for r in range(1, ROUNDS + 1)}

    def order(self, c, r):
        """The client's batch of each local epoch (one a pass: batch 1,000), in the engine's order."""
        gen = torch_generator(self.exp.cfg.seed, "batches", r, c, 0)
        return batch_schedule(self.size[c], 1000, STEPS, 0, False, gen)


def experiment(method, params, executor, *extra):
    sets = [f"algorithm.{k}={v}" for k, v in params.items()]
    return Experiment(config.load(None, [*BASE, f"algorithm.name={method}", *sets, *EXECUTORS[executor], *extra]))


def engine_rounds(exp):
    """The server state after each round (set-up round first, as ``Experiment.run``), the client store."""
    server, _, _ = exp.setup_round(exp.initial_server())
    clients, servers, lines = {}, [], []
    for r in range(1, ROUNDS + 1):
        line = exp.round(server, clients, r, Reporter())
        server = line.pop("_server")
        servers.append(server)
        lines.append(line)
    return servers, clients, lines


# ------------------------------------------------------------------------------------------------ trainers
def fedavg_reference(fed, local_loss):
    """FedAvg rounds with ``local_loss(p, c, global, prev)`` (prev: the client's last trained model or None);
    returns the global model and every client's last trained model."""
    w, prev = {n: fed.init[n] for n in PARAMS}, {}
    for r in range(1, ROUNDS + 1):
        locals_ = []
        for c in fed.sampled[r]:
            x, y = fed.train[c]
            locals_.append(gd(w, lambda p, x=x, y=y, c=c, g=w: local_loss(p, x, y, g, prev.get(c))))
        prev.update(zip(fed.sampled[r], locals_, strict=True))
        w = mean(locals_, [fed.size[c] for c in fed.sampled[r]])
    return w


def fedprox_loss(mu):
    def loss(p, x, y, g, prev):
        return ce(p, x, y) + mu / 2 * sum(((p[n] - g[n]) ** 2).sum() for n in PARAMS)
    return loss


def moon_loss(mu, tau):
    def loss(p, x, y, g, prev):
        if prev is None:
            return ce(p, x, y)
        z = features(p, x)
        pos = F.cosine_similarity(z, features(g, x).detach(), dim=-1) / tau
        neg = F.cosine_similarity(z, features(prev, x).detach(), dim=-1) / tau
        return ce(p, x, y) - mu * (pos - torch.logaddexp(pos, neg)).mean()
    return loss


TRAINERS = {"fedavg": ({}, lambda p, x, y, g, prev: ce(p, x, y)),
            "fedprox": ({"mu": 0.5}, fedprox_loss(0.5)),
            "moon": ({"mu": 2.0, "temperature": 0.5}, moon_loss(2.0, 0.5))}


# -------------------------------------------------------------------------------------------------- CCVR
def tukey(z, beta):
    return F.relu(z) ** beta


def pooled_gaussians(fed, w):
    """Eq. 2 per client and class (mean; unbiased covariance, N_ck - 1), pooled by eq. 3-4 (N_c - 1), from
    the features of every client's training data under the global encoder: {class: (N_c, mu_c, Sigma_c)} for
    the classes with N_c >= 2 (a covariance needs two samples), and N_c of every class."""
    d = w[W1].shape[0]
    stats = {c: [] for c in range(C)}
    for k in fed.clients:
        x, y = fed.train[k]
        z = features(w, x).double()
        for c in range(C):
            zc = z[y == c]
            if len(zc):
                cov = torch.cov(zc.T, correction=1) if len(zc) > 1 else torch.zeros(d, d, dtype=torch.float64)
                stats[c].append((len(zc), zc.mean(0), cov))
    pooled, counts = {}, [sum(p[0] for p in stats[c]) for c in range(C)]
    for c, parts in stats.items():
        n = counts[c]
        if n < 2:
            continue
        mu = sum(nk * mk for nk, mk, _ in parts) / n
        sigma = (sum((nk - 1) / (n - 1) * sk for nk, _, sk in parts)
                 + sum(nk / (n - 1) * torch.outer(mk, mk) for nk, mk, _ in parts) - n / (n - 1) * torch.outer(mu, mu))
        pooled[c] = (n, mu, sigma)
    return pooled, counts


def virtual_counts(pooled, counts, hp):
    """M_c: num_virtual, or (proportional) num_virtual * C * N_c / N, N all training samples (sec. 4: the
    fraction N_c / |D|); none for a class without a covariance."""
    return {c: round(hp["num_virtual"] * C * pooled[c][0] / sum(counts)) if hp["proportional"]
            else hp["num_virtual"] for c in sorted(pooled)}


def ccvr_reference(fed, w, hp):
    """Algorithm 1, lines 12-16 and the re-training of sec. 4: returns the calibrated classifier."""
    pooled, counts = pooled_gaussians(fed, w)
    gen = stream(fed.exp.setup, ROUNDS, "ccvr")
    feats, labels = [], []
    for c, m in virtual_counts(pooled, counts, hp).items():
        _, mu, sigma = pooled[c]
        # a direction of rounding-level variance (a ReLU unit dead for the class: 4e-17 of the largest
        # eigenvalue here; float32 features carry 6e-8 relative precision) has none: Tukey's x^0.5 would
        # blow its 1e-9 draws up to 3e-5
        values, vectors = torch.linalg.eigh(sigma)
        values = torch.where(values > 1e-8 * values.abs().max(), values, torch.zeros_like(values))
        factor = vectors * values.sqrt()
        noise = torch.randn(m, mu.numel(), generator=gen, dtype=torch.float64)
        feats.append(mu + noise @ factor.T)
        labels.append(torch.full((m,), c))
    z, y = torch.cat(feats).float(), torch.cat(labels)
    if hp["transform"] == "relu_tukey":
        z = tukey(z, hp["tukey_beta"])
    head = {n: w[n].clone() for n in HEAD}
    buf: dict = {}
    for _ in range(hp["epochs"]):
        order = torch.randperm(len(y), generator=gen)
        for s in range(0, len(y), hp["batch_size"]):
            idx = order[s: s + hp["batch_size"]]
            g = grad(lambda p, idx=idx: F.cross_entropy(F.linear(z[idx], p[W2], p[B2]), y[idx]), head, HEAD)
            for n in HEAD:
                dn = g[n] + hp["weight_decay"] * head[n]
                buf[n] = dn if n not in buf else hp["momentum"] * buf[n] + dn
                head[n] = head[n] - hp["lr"] * buf[n]
    return head


def accuracy_on_test(exp, p, transform=None):
    x, y = exp.data.prepare(exp.data.test_x), exp.data.test_y
    z = features(p, x)
    if transform is not None:
        z = tukey(z, transform)
    return int((F.linear(z, p[W2], p[B2]).argmax(1) == y).sum()) / len(y)


def ccvr_sets(hp):
    return [f"algorithm.ccvr.{k}={str(v).lower() if isinstance(v, bool) else repr(v)}".replace("'", '"')
            for k, v in hp.items()]


CCVR = {"num_virtual": 20, "proportional": False, "transform": "relu_tukey", "tukey_beta": 0.5, "epochs": 3,
        "lr": 0.05, "momentum": 0.9, "weight_decay": 0.001, "batch_size": 16}
# num_virtual = 26, proportional: class 0's M_0 = round(26 * 4 * 40 / 333) = 12, where N without the class of
# one sample (332) would give 13
CCVR_CASES = [("fedavg", "sequential", {}), ("fedavg", "vectorized", {}),
              ("fedprox", "sequential", {"proportional": True, "num_virtual": 26}),
              ("moon", "vectorized", {"transform": "none"}),
              ("moon", "sequential", {"tukey_beta": 0.7, "proportional": True})]


@pytest.mark.parametrize(("trainer", "executor", "change"), CCVR_CASES)
def test_ccvr_calibrates_the_trainers_global_model_by_algorithm_1(trainer, executor, change):
    hp = {**CCVR, **change}
    trainer_params, local_loss = TRAINERS[trainer]
    exp = experiment(f"{trainer}+ccvr", trainer_params, executor, *ccvr_sets(hp))
    fed = Federation(exp)
    servers, clients, lines = engine_rounds(exp)
    trained, line = servers[-1], lines[-1]
    calibrated = exp.run_posthoc(trained, ROUNDS, line)
    line.update(exp.evaluate(calibrated, clients, ROUNDS))

    w = fedavg_reference(fed, local_loss)
    assert_close(trained.model, w, "the trainer's global model")
    head = ccvr_reference(fed, w, hp)
    assert_close(calibrated.model, {**w, **head}, "the calibrated model")  # the encoder unchanged
    beta = hp["tukey_beta"] if hp["transform"] == "relu_tukey" else None
    assert line["global_acc_before_ccvr"] == pytest.approx(accuracy_on_test(exp, w), abs=1e-9)
    assert line["global_acc"] == pytest.approx(accuracy_on_test(exp, {**w, **head}, beta), abs=1e-9)
    pooled, counts = pooled_gaussians(fed, w)
    assert line["ccvr_virtual_features"] == sum(virtual_counts(pooled, counts, hp).values())
    assert line["ccvr_classes_without_virtual"] == C - len(pooled) == 1  # class 2: one sample in all


# ------------------------------------------------------------------------------------------------- FedUV
def feduv_loss(lam, mu):
    """Son et al. 2024: CE + lam L_V + mu L_U. L_V (eq. 2-3) = mean_j max(0, 1/sqrt(D) - std_j), std_j the
    unbiased std over the batch of class j's softmax probability; L_U (eq. 4) = mean over pairs i < j of
    exp(-||z_i - z_j||^2 / (2 sigma)), sigma the median squared distance (lower median; gradient through it)."""
    def loss(p, x, y, g, prev):
        z = features(p, x)
        probs = F.softmax(F.linear(z, p[W2], p[B2]), dim=1)
        std = probs.std(dim=0, unbiased=True)
        lv = F.relu(1 / C**0.5 - std).mean()
        sq = torch.pdist(z) ** 2
        lu = torch.exp(-sq / (2 * sq.median())).mean()
        return ce(p, x, y) + lam * lv + mu * lu
    return loss


@pytest.mark.parametrize("executor", EXECUTORS)
def test_feduv_rounds_follow_eq_2_to_4(executor):
    exp = experiment("feduv", {"lam": 0.7, "mu": 0.5}, executor)
    fed = Federation(exp)
    servers, _, _ = engine_rounds(exp)
    assert_close(servers[-1].model, fedavg_reference(fed, feduv_loss(0.7, 0.5)), "global model")


# ------------------------------------------------------------------------------------------------- FedBR
FEDBR = {"lam": 1.0, "mu": 2.0, "tau1": 0.5, "tau2": 0.3, "num_pseudo": 8}
PROJ = tuple(f"fedbr.head/{i}.{k}" for i in range(3) for k in ("weight", "bias"))


def project(p, z):
    for i in range(3):
        z = F.linear(z, p[f"fedbr.head/{i}.weight"], p[f"fedbr.head/{i}.bias"])
        z = F.relu(z) if i < 2 else z
    return z


def l_con(p, zp, zg, zr, tau1, tau2):
    """Eq. 5-7: -log(f1 / (f1 + f2)), f1 = exp(cos(theta(z_p), theta(z_g)) / tau1),
    f2 = exp(cos(theta(z_p), theta(z_r)) / tau2), mean over the pairs."""
    hp, hg, hr = project(p, zp), project(p, zg), project(p, zr)
    f1 = torch.exp(F.cosine_similarity(hp, hg, dim=-1) / tau1)
    f2 = torch.exp(F.cosine_similarity(hp, hr, dim=-1) / tau2)
    return (-torch.log(f1 / (f1 + f2))).mean()


def fedbr_reference(fed, pseudo, lam, mu, tau1, tau2):
    """Algorithm 1: per step, theta <- theta + eta grad_theta L_con (features detached), then
    w <- w - eta grad_w [CE(x, y) + lam softCE(g(f(P)), 1/C) + mu L_con]; pair i = (P_i, x_i) of the step's
    batch; z_g from the round's global model; server: uniform mean of the models and heads."""
    names = (*PARAMS, *PROJ)
    w = {n: fed.init[n] for n in names}
    q = torch.full((len(pseudo), C), 1.0 / C)
    for r in range(1, ROUNDS + 1):
        locals_ = []
        for c in fed.sampled[r]:
            p = dict(w)
            zg = features(w, pseudo).detach()
            for idx in fed.order(c, r):
                x, y = fed.train[c][0][idx], fed.train[c][1][idx]
                k = min(len(pseudo), len(y))
                zp, zr = features(p, pseudo[:k]).detach(), features(p, x[:k]).detach()
                g = grad(lambda h, zp=zp, zr=zr, zg=zg[:k]: l_con(h, zp, zg, zr, tau1, tau2), p, PROJ)
                p.update({n: p[n] + LR * g[n] for n in PROJ})

                def min_loss(h, x=x, y=y, k=k, zg=zg):
                    soft = -(q * F.log_softmax(logits(h, pseudo), dim=1)).sum(1).mean()
                    con = l_con(h, features(h, pseudo)[:k], zg[:k], features(h, x)[:k], tau1, tau2)
                    return ce(h, x, y) + lam * soft + mu * con

                g = grad(min_loss, p, PARAMS)
                p.update({n: p[n] - LR * g[n] for n in PARAMS})
            locals_.append(p)
        w = mean(locals_, [1.0] * len(locals_), names)
    return w


@pytest.mark.parametrize("executor", EXECUTORS)
def test_fedbr_max_then_min_step_follow_algorithm_1(executor):
    exp = experiment("fedbr", FEDBR, executor)
    fed = Federation(exp)
    servers, _, _ = engine_rounds(exp)
    pseudo = exp.setup_round(exp.initial_server())[0].extra["shared/fedbr.pseudo"]
    assert len(pseudo) == FEDBR["num_pseudo"] < min(fed.size.values())  # pairs: the first 8 of each batch
    hand = fedbr_reference(fed, pseudo, *(FEDBR[k] for k in ("lam", "mu", "tau1", "tau2")))
    assert_close(servers[-1].model, hand, "global model and head", (*PARAMS, *PROJ))


# ------------------------------------------------------------------------------------------------ FedPAC
FEDPAC = {"lam": 2.0, "head_epochs": 2, "head_lr": 0.2, "head_momentum": 0.5, "head_weight_decay": 0.01}


def class_means(z, y):
    return torch.stack([z[y == k].mean(0) if (y == k).any() else torch.zeros(z.shape[1]) for k in range(C)])


def fedpac_round(fed, start, r, centroids, has):
    """Algorithm 1's local procedure for round ``r``'s clients from their start models: the classifier alone
    (head_epochs steps of SGD, head_lr, head_momentum, head_weight_decay), then the encoder with the
    classifier frozen on CE + lam (1/d) mean ||f(x) - c_y||^2, c_y the server's global centroid of y (the
    client's own class mean under the received encoder where the server has none), the term on once the
    server has any centroid. Returns the trained models and the new global centroids (count-weighted)."""
    trained, sums, counts = {}, torch.zeros(C, 6, dtype=torch.float64), torch.zeros(C, dtype=torch.float64)
    for c in fed.sampled[r]:
        x, y = fed.train[c]
        target = torch.where(has[:, None], centroids, class_means(features(start[c], x), y))
        align = float(has.any())
        p = sgd(start[c], lambda h, x=x, y=y: ce(h, x, y), FEDPAC["head_epochs"], HEAD, FEDPAC["head_lr"],
                FEDPAC["head_momentum"], FEDPAC["head_weight_decay"])

        def loss(h, x=x, y=y, target=target, align=align):
            z = features(h, x)
            return ce(h, x, y) + FEDPAC["lam"] * align * ((z - target[y]) ** 2).sum(1).mean() / z.shape[1]

        trained[c] = gd(p, loss, names=ENCODER)
        z = features(trained[c], x).double()
        sums.index_add_(0, y, z)
        counts += torch.bincount(y, minlength=C).double()
    return trained, (sums / counts.clamp(min=1)[:, None]).float(), counts > 0


@pytest.mark.parametrize("first_head", ["initial", "server"])
@pytest.mark.parametrize("executor", EXECUTORS)
def test_fedpac_local_stages_and_alignment_follow_algorithm_1(executor, first_head):
    exp = experiment("fedpac", {**FEDPAC, "first_head": first_head}, executor, "seed=1")
    fed = Federation(exp)
    # seed 1: rounds {1, 2}, {2, 3}; client 2 comes back with its personalised head, client 3 starts from the
    # initial model's classifier (first_head = "initial", the authors' code) or the server's ("server") and
    # holds a class (1) no client of round 1 held: it aligns that class to its own mean
    assert (fed.sampled[1], fed.sampled[2]) == ([1, 2], [2, 3])
    held = set(torch.cat([fed.train[c][1] for c in fed.sampled[1]]).tolist())
    assert 1 not in held and 1 in fed.train[3][1].tolist()
    servers, clients, _ = engine_rounds(exp)
    init = {n: fed.init[n] for n in PARAMS}
    centroids, has = torch.zeros(C, 6), torch.zeros(C, dtype=torch.bool)
    start = {c: init for c in fed.sampled[1]}
    trained, centroids, has = fedpac_round(fed, start, 1, centroids, has)
    encoder = mean([trained[c] for c in fed.sampled[1]], [fed.size[c] for c in fed.sampled[1]], ENCODER)
    heads = mean([trained[c] for c in fed.sampled[1]], [fed.size[c] for c in fed.sampled[1]], HEAD)
    assert_close(servers[0].model, {**encoder, **heads}, "round 1's server model")
    assert_close(servers[0].extra, {"fedpac.centroids": centroids}, "round 1's centroids", ("fedpac.centroids",))
    assert servers[0].extra["fedpac.has_centroid"].bool().tolist() == has.tolist()
    # round 2: a client of round 1 starts from its personalised head (the QP's, checked elsewhere), a new one
    # from the initial classifier or the server's (the size-weighted mean of round 1's classifiers)
    first = init if first_head == "initial" else heads
    personal = {c: {n: servers[0].extra.get(f"head.{c}/{n}", first[n]) for n in HEAD} for c in fed.sampled[2]}
    start = {c: {**encoder, **personal[c]} for c in fed.sampled[2]}
    trained2, _, _ = fedpac_round(fed, start, 2, centroids, has)
    encoder2 = mean([trained2[c] for c in fed.sampled[2]], [fed.size[c] for c in fed.sampled[2]], ENCODER)
    assert_close(servers[1].model, encoder2, "round 2's encoder", ENCODER)
    for c in fed.sampled[2]:
        assert_close({n: clients[c]["fedpac.local_head/" + n] for n in HEAD}, trained2[c], f"client {c}'s head",
                     HEAD)


def test_ccvr_run_reports_the_calibrated_accuracy_and_keeps_the_trainers_before_it(tmp_path):
    """``Experiment.run`` end to end: the last metrics line and summary.json report the accuracy of the hand's
    calibrated model as ``global_acc`` and of the trainer's model as ``global_acc_before_ccvr``."""
    hp = {**CCVR, "proportional": True, "num_virtual": 26}
    exp = experiment("fedavg+ccvr", {}, "sequential", *ccvr_sets(hp))
    fed = Federation(exp)
    summary = exp.run(tmp_path / "run")
    w = fedavg_reference(fed, TRAINERS["fedavg"][1])
    after = accuracy_on_test(exp, {**w, **ccvr_reference(fed, w, hp)}, hp["tukey_beta"])
    before = accuracy_on_test(exp, w)
    assert after > before + 0.2  # the calibration matters here (0.45 -> 0.87)
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert (line["global_acc"], line["global_acc_before_ccvr"]) == pytest.approx((after, before), abs=1e-9)
    assert (summary["final_global_acc"], summary["final_global_acc_before_ccvr"]) == pytest.approx((after, before),
                                                                                                  abs=1e-9)
