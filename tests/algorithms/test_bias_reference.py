"""FedBR's bias-reduction baselines and FedETF through the engine, against hand loops of their papers.

DANN (Ganin et al. 2016, clients as domains as FedBR's code), Group DRO (Sagawa et al. 2020, Algorithm 1 over
each client's classes; and FedBR's version over clients), Mixup (Zhang et al. 2018, eq. 1), FedMix (Yoon et al.
2021, the first-order approximation of global Mixup), VHL (Tang et al. 2022: virtual cross-entropy and the
supervised contrastive calibration) and FedETF (Li et al. 2023: fixed simplex ETF, projection, normalised
features, balanced softmax, the personalisation's alternating fine-tuning).

A tiny federation (Synthetic data, 5 devices of 4 classes, an MLP 8 -> 6 -> 4), 3 rounds of 2 sampled clients,
every local step on the client's whole training set (batch 1,000), plain SGD. Each reference below has its own
forward pass and re-derives every gradient step from the paper's equation with plain autograd; where a method
draws random numbers (Mixup's lambda and permutation, FedMix's and VHL's picks) the reference reads the draws
(and the batch order they pair) that the sequential run's steps received, and recomputes everything else. Both
executors (sequential; vectorised, vmap forced on the CPU) must give the reference's server model to float
rounding (``ATOL``): the draws are the same in both by design (each client's own stream, drawn in order).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hetfl import config
from hetfl.algorithms.vhl import generate_virtual
from hetfl.engine.experiment import Experiment
from hetfl.engine.summary import Reporter
from tests.helpers.reference import B1, B2, EXECUTORS, PARAMS, W1, W2, features, logits, tiny_federation

ATOL = 2e-5
ROUNDS, STEPS, LR, C = 3, 3, 0.1, 4
BASE = tiny_federation(ROUNDS, STEPS, LR)


# ------------------------------------------------------------------ the reference's own model and calculus
def grads(value_fn, p, names):
    """d value_fn(p) / d p[n] for ``names`` (zero where the value does not depend on p[n])."""
    leaves = {n: p[n].detach().clone().requires_grad_() for n in names}
    value = value_fn({**p, **leaves})
    got = torch.autograd.grad(value, [leaves[n] for n in names], allow_unused=True)
    return {n: torch.zeros_like(p[n]) if g is None else g for n, g in zip(names, got, strict=True)}


def sgd(p, g, lr=LR):
    return {**p, **{n: p[n] - lr * g[n] for n in g}}


def mean(models, weights, names):
    total = sum(weights)
    return {n: sum(w / total * m[n] for m, w in zip(models, weights, strict=True)) for n in names}


class Federation:
    """What the reference knows of the federation: the initial model, the clients' data, who is sampled."""

    def __init__(self, exp: Experiment, names=PARAMS):
        self.init = {n: t.detach().clone() for n, t in exp.initial_server().model.items() if n in names}
        self.clients = range(exp.data.num_clients)
        self.train = {c: (exp.client_inputs(c).x, exp.client_inputs(c).y) for c in self.clients}
        self.test = {c: (exp.data.prepare(exp.data.client_tests[c].x), exp.data.client_tests[c].y)
                     for c in self.clients}
        self.size = {c: exp.data.client_sizes[c] for c in self.clients}
        self.sampled = {r: exp.sample_clients(r) for r in range(1, ROUNDS + 1)}


def make(method: str, params: dict, executor: str) -> Experiment:
    sets = [f"algorithm.{k}={v}" for k, v in params.items()]
    return Experiment(config.load(None, [*BASE, f"algorithm.name={method}", *sets, *EXECUTORS[executor]]))


def run_rounds(exp: Experiment):
    server, clients = exp.initial_server(), {}
    server, _, _ = exp.setup_round(server)
    for r in range(1, ROUNDS + 1):
        server = exp.round(server, clients, r, Reporter())["_server"]
    return server, clients


def record_steps(exp: Experiment) -> dict:
    """Wrap the method's loss so that a sequential run records what each step received: per (round, client),
    the batch's inputs, labels and draws, in step order."""
    seen: dict = {}
    loss = exp.algorithm.loss

    def spy(state, batch, ctx):
        draws = {k: v.detach().clone() for k, v in (batch.draws or {}).items()}
        seen.setdefault((ctx.round, ctx.client_id), []).append((batch.x.detach().clone(), batch.y.clone(), draws))
        return loss(state, batch, ctx)

    exp.algorithm.loss = spy
    return seen


def assert_close(engine, hand, what, names):
    for n in names:
        diff = (engine[n].double() - hand[n].double()).abs().max().item()
        assert diff <= ATOL, f"{what}: {n} differs from the reference by {diff:.2e}"


def same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` is ``b`` up to the order of its rows (a step's batch is the client's data, shuffled)."""
    key = lambda t: sorted(map(tuple, t.flatten(1).tolist()))
    return len(a) == len(b) and key(a) == key(b)


def recorded_run(method, params):
    """A sequential run with its steps recorded: (the experiment, what its steps received)."""
    exp = make(method, params, "sequential")
    seen = record_steps(exp)
    run_rounds(exp)
    return exp, seen


# ------------------------------------------------------------------------------------------------- DANN
DANN_HEAD = tuple(f"dann.head/{i}.{k}" for i in range(3) for k in ("weight", "bias"))


def domain_logits(p, z):
    """G_d: Linear, ReLU, Linear, ReLU, Linear (DomainBed's MLP of depth 3)."""
    for i in range(3):
        z = F.linear(z, p[f"dann.head/{i}.weight"], p[f"dann.head/{i}.bias"])
        z = F.relu(z) if i < 2 else z
    return z


def dann_reference(fed, lam_of_round):
    """Ganin et al.'s saddle point by SGD: theta_y descends L_y, theta_d descends L_d, the feature extractor
    descends L_y - lam L_d (the reversed gradient); L_d = CE(G_d(f(x)), k) with k the client (its domain);
    the server averages everything, the domain classifier too, by data size."""
    names = (*PARAMS, *DANN_HEAD)
    w = dict(fed.init)
    for r in range(1, ROUNDS + 1):
        lam, locals_ = lam_of_round(r), []
        for c in fed.sampled[r]:
            x, y = fed.train[c]
            p = dict(w)
            for _ in range(STEPS):
                g_y = grads(lambda q, x=x, y=y: F.cross_entropy(logits(q, x), y), p, (W1, B1, W2, B2))
                g_d = grads(lambda q, x=x, c=c: F.cross_entropy(domain_logits(q, features(q, x)),
                                                                  torch.full((len(x),), c)), p, (W1, B1, *DANN_HEAD))
                step = {W2: g_y[W2], B2: g_y[B2], W1: g_y[W1] - lam * g_d[W1], B1: g_y[B1] - lam * g_d[B1]}
                p = sgd(p, {**step, **{n: g_d[n] for n in DANN_HEAD}})
            locals_.append(p)
        w = mean(locals_, [fed.size[c] for c in fed.sampled[r]], names)
    return w


@pytest.mark.parametrize("schedule", ["constant", "ganin"])
@pytest.mark.parametrize("executor", EXECUTORS)
def test_dann_follows_the_gradient_reversal_saddle_point(executor, schedule):
    params = {"lam": 0.5, "hidden": 5, "schedule": schedule}
    exp = make("dann", params, executor)
    server, _ = run_rounds(exp)
    fed = Federation(exp, (*PARAMS, *DANN_HEAD))

    def lam_of_round(r):  # the paper's ramp 2 / (1 + exp(-10 p)) - 1, p the progress (per round here)
        return 0.5 if schedule == "constant" else 0.5 * (2 / (1 + math.exp(-10 * (r - 1) / ROUNDS)) - 1)

    assert_close(server.model, dann_reference(fed, lam_of_round), "DANN", (*PARAMS, *DANN_HEAD))


# --------------------------------------------------------------------------------------------- Group DRO
def groupdro_classes_reference(fed, eta):
    """Sagawa et al., Algorithm 1 per client over the classes it holds, per step: q_g <- q_g exp(eta L_g),
    normalised; then theta <- theta - lr grad sum_g q_g L_g (q held fixed); q carried across the rounds a
    client takes part in (uniform at first); the server averages the models by data size."""
    w, q = dict(fed.init), {}
    for r in range(1, ROUNDS + 1):
        locals_ = []
        for c in fed.sampled[r]:
            x, y = fed.train[c]
            present = sorted(set(y.tolist()))
            qc = q.get(c, {g: 1 / len(present) for g in present})
            p = dict(w)
            for _ in range(STEPS):
                with torch.no_grad():
                    per = F.cross_entropy(logits(p, x), y, reduction="none")
                    losses = {g: per[y == g].mean().item() for g in present}
                total = sum(qc[g] * math.exp(eta * losses[g]) for g in present)
                qc = {g: qc[g] * math.exp(eta * losses[g]) / total for g in present}

                def robust(s, x=x, y=y, qc=qc, present=present):
                    per = F.cross_entropy(logits(s, x), y, reduction="none")
                    return sum(qc[g] * per[y == g].mean() for g in present)

                p = sgd(p, grads(robust, p, PARAMS))
            q[c] = qc
            locals_.append(p)
        w = mean(locals_, [fed.size[c] for c in fed.sampled[r]], PARAMS)
    return w, q


@pytest.mark.parametrize("executor", EXECUTORS)
def test_groupdro_over_classes_follows_algorithm_1(executor):
    exp = make("groupdro", {"eta": 2.0}, executor)  # a large eta: q moves visibly in 3 steps
    server, clients = run_rounds(exp)
    fed = Federation(exp)
    w, q = groupdro_classes_reference(fed, 2.0)
    assert_close(server.model, w, "GroupDRO (classes)", PARAMS)
    assert set(clients) == set(q)
    for c, qc in q.items():
        got = torch.softmax(clients[c]["groupdro.logq"].double().masked_fill(
            torch.tensor([g not in qc for g in range(C)]), -math.inf), 0)
        want = torch.tensor([qc.get(g, 0.0) for g in range(C)], dtype=torch.float64)
        assert torch.allclose(got, want, atol=1e-6), (c, got, want)
        assert max(qc.values()) - min(qc.values()) > 1e-3  # the weights did move


def groupdro_clients_reference(fed, eta):
    """FedBR's GroupDRO baseline (algorithms_fed.FedGroupDRO): plain local cross-entropy; the server keeps
    p_k = exp(eta sum_t L_k^t) per client, L_k^t the received model's loss on client k's data, and averages
    the round's models with weights p_k / sum p."""
    w, log_p = dict(fed.init), dict.fromkeys(fed.clients, 0.0)
    for r in range(1, ROUNDS + 1):
        locals_ = []
        for c in fed.sampled[r]:
            x, y = fed.train[c]
            with torch.no_grad():
                log_p[c] += eta * F.cross_entropy(logits(w, x), y).item()
            p = dict(w)
            for _ in range(STEPS):
                p = sgd(p, grads(lambda s, x=x, y=y: F.cross_entropy(logits(s, x), y), p, PARAMS))
            locals_.append(p)
        w = mean(locals_, [math.exp(log_p[c]) for c in fed.sampled[r]], PARAMS)
    return w


@pytest.mark.parametrize("executor", EXECUTORS)
def test_groupdro_over_clients_weights_the_average_by_exponentiated_losses(executor):
    exp = make("groupdro", {"eta": 3.0, "groups": "clients"}, executor)
    server, _ = run_rounds(exp)
    fed = Federation(exp)
    assert_close(server.model, groupdro_clients_reference(fed, 3.0), "GroupDRO (clients)", PARAMS)


# ------------------------------------------------------------------------------------ Mixup and FedMix
def local_loop(fed, seen, step_loss):
    """FedAvg by data size over the sampled clients, each step's loss from the recorded batch."""
    w = dict(fed.init)
    for r in range(1, ROUNDS + 1):
        locals_ = []
        for c in fed.sampled[r]:
            steps = seen[(r, c)]
            assert len(steps) == STEPS
            p = dict(w)
            for x, y, draws in steps:
                assert same_rows(x, fed.train[c][0])  # the client's own data, whole
                p = sgd(p, grads(lambda s, x=x, y=y, d=draws: step_loss(s, x, y, d), p, PARAMS))
            locals_.append(p)
        w = mean(locals_, [fed.size[c] for c in fed.sampled[r]], PARAMS)
    return w


def mixup_step(p, x, y, draws):
    """Zhang et al., eq. 1: lam CE(f(x~), y_i) + (1 - lam) CE(f(x~), y_j), x~ = lam x_i + (1 - lam) x_j."""
    lam, j = draws["mixup.lam"], draws["mixup.perm"]
    assert 0.0 <= float(lam) <= 1.0 and sorted(j.tolist()) == list(range(len(x)))
    out = logits(p, lam * x + (1 - lam) * x[j])
    return lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[j])


@pytest.mark.parametrize("executor", EXECUTORS)
def test_mixup_follows_eq_1(executor):
    params = {"alpha": 0.4}
    _, seen = recorded_run("mixup", params)
    exp = make("mixup", params, executor)
    server, _ = run_rounds(exp)
    fed = Federation(exp)
    lams = [float(d["mixup.lam"]) for steps in seen.values() for _, _, d in steps]
    assert len(set(lams)) == len(lams)  # one lambda per step
    assert_close(server.model, local_loop(fed, seen, mixup_step), "Mixup", PARAMS)


def fedmix_step(pool_x, pool_y, lam):
    """Yoon et al.'s approximation of global Mixup with a mean (x̄_j, ȳ_j) per sample, first order in lam:
    (1 - lam) CE(f((1 - lam) x_i), y_i) + lam CE(f((1 - lam) x_i), ȳ_j) + lam <d CE(f(u), y_i)/du, x̄_j>,
    u = (1 - lam) x_i, averaged over the batch, the input derivative differentiated through."""

    def step(p, x, y, draws):
        j = (draws["fedmix.pick"] * len(pool_y)).floor().long()
        u = ((1 - lam) * x).requires_grad_()
        out = logits(p, u)
        per = F.cross_entropy(out, y, reduction="none")
        (du,) = torch.autograd.grad(per.sum(), u, create_graph=True)  # row i: d CE_i / d u_i
        soft = -(pool_y[j] * F.log_softmax(out, 1)).sum(1)
        taylor = (du * pool_x[j]).sum(1)
        return ((1 - lam) * per + lam * soft + lam * taylor).mean()

    return step


@pytest.mark.parametrize("executor", EXECUTORS)
def test_fedmix_follows_the_first_order_approximation(executor):
    params = {"lam": 0.3, "mash_size": 4}
    exp_seq, seen = recorded_run("fedmix", params)
    exp = make("fedmix", params, executor)
    server, _ = run_rounds(exp)
    fed = Federation(exp)
    pooled, _, _ = exp_seq.setup_round(exp_seq.initial_server())
    pool_x, pool_y = pooled.extra["shared/fedmix.x"], pooled.extra["shared/fedmix.y"]
    # the pool: every client's data in disjoint groups of mash_size, each a mean of inputs and one-hot labels
    assert len(pool_y) == sum(math.ceil(fed.size[c] / 4) for c in fed.clients)
    assert torch.allclose(pool_y.sum(1), torch.ones(len(pool_y)))
    total_x = sum(fed.train[c][0].sum(0) for c in fed.clients)
    groups = [[4] * (fed.size[c] // 4) + ([fed.size[c] % 4] if fed.size[c] % 4 else []) for c in fed.clients]
    sizes = torch.tensor([n for g in groups for n in g], dtype=torch.float32)  # clients in order, last group short
    assert torch.allclose((pool_x * sizes[:, None]).sum(0), total_x, atol=1e-4)
    assert_close(server.model, local_loop(fed, seen, fedmix_step(pool_x, pool_y, 0.3)), "FedMix", PARAMS)


# -------------------------------------------------------------------------------------------------- VHL
VHL_HEAD = ("vhl.classifier.weight", "vhl.classifier.bias")


def supcon(z, labels, t):
    """Khosla et al.'s L^sup_out, one view, written per anchor: for anchor i with positives P(i) (the others
    of its class), -1/|P(i)| sum_p log(exp(z_i.z_p / t) / sum_{a != i} exp(z_i.z_a / t)) on unit vectors;
    averaged over all anchors, one without positives counting 0."""
    z = F.normalize(z, dim=1)
    terms = []
    for i in range(len(z)):
        others = [a for a in range(len(z)) if a != i]
        pos = [a for a in others if labels[a] == labels[i]]
        if not pos:
            terms.append(z.sum() * 0)
            continue
        log_den = torch.logsumexp(z[others] @ z[i] / t, 0)
        terms.append(-(z[pos] @ z[i] / t - log_den).mean())
    return torch.stack(terms).mean()


def vhl_step(virtual_x, virtual_y, alpha, align, virt, t):
    """Tang et al. (the authors' code's VHL_alignNoiseContrast): CE over C + C outputs (virtual class c is
    output C + c) on the real batch, alpha times on the virtual batch, align times the supervised contrastive
    loss of [f(x); sg(f(x_v))] with virtual class c matching real class c, virt times that of f(x_v) alone."""

    def step(p, x, y, draws):
        xv, yv = virtual_x[draws["vhl.pick"]], virtual_y[draws["vhl.pick"]]
        z, zv = features(p, x), features(p, xv)
        head = lambda h: torch.cat([F.linear(h, p[W2], p[B2]), F.linear(h, p[VHL_HEAD[0]], p[VHL_HEAD[1]])], 1)
        loss = F.cross_entropy(head(z), y) + alpha * F.cross_entropy(head(zv), yv + C)
        loss = loss + align * supcon(torch.cat([z, zv.detach()]), torch.cat([y, yv]), t)
        return loss + virt * supcon(zv, yv, t)

    return step


@pytest.mark.parametrize("executor", EXECUTORS)
def test_vhl_follows_the_virtual_ce_and_the_feature_calibration(executor):
    params = {"num_virtual": 40, "virtual_batch": 6, "alpha": 0.7, "align_weight": 0.8, "virtual_weight": 0.5,
              "temperature": 0.5}
    _, seen = recorded_run("vhl", params)
    exp = make("vhl", params, executor)
    server, _ = run_rounds(exp)
    names = (*PARAMS, *VHL_HEAD)
    fed = Federation(exp, names)
    vx, vy = generate_virtual(exp.cfg.seed, (8,), C, 10)  # shared by every client: a function of the seed
    step = vhl_step(vx, vy, 0.7, 0.8, 0.5, 0.5)
    w = dict(fed.init)
    for r in range(1, ROUNDS + 1):
        locals_ = []
        for c in fed.sampled[r]:
            p = dict(w)
            for x, y, draws in seen[(r, c)]:
                assert same_rows(x, fed.train[c][0]) and draws["vhl.pick"].shape == (6,)
                p = sgd(p, grads(lambda s, x=x, y=y, d=draws: step(s, x, y, d), p, names))
            locals_.append(p)
        w = mean(locals_, [fed.size[c] for c in fed.sampled[r]], names)
    assert_close(server.model, w, "VHL", names)


# ----------------------------------------------------------------------------------------------- FedETF
ETF, PW, PB, BETA = "fedetf.etf", "fedetf.proj.weight", "fedetf.proj.bias", "fedetf.beta"
TRAINED = (W1, B1, PW, PB, BETA)


def etf_logits(p, x):
    """beta <normalize(W_p f(x) + b_p), M_c> for every class c."""
    h = F.linear(features(p, x), p[PW], p[PB])
    return p[BETA] * (h / h.norm(dim=1, keepdim=True)) @ p[ETF]


def balanced(p, x, y):
    """Balanced softmax: CE(logits + log n_c, y), n_c the client's count of class c (1 where absent)."""
    counts = torch.bincount(y, minlength=C).clamp(min=1).float()
    return F.cross_entropy(etf_logits(p, x) + counts.log(), y)


def fedetf_reference(fed):
    """Li et al.: encoder, projection and beta trained on the balanced softmax, the ETF M fixed and not
    averaged; the server averages the trained tensors by data size."""
    w = dict(fed.init)
    for r in range(1, ROUNDS + 1):
        locals_ = []
        for c in fed.sampled[r]:
            x, y = fed.train[c]
            p = dict(w)
            for _ in range(STEPS):
                p = sgd(p, grads(lambda s, x=x, y=y: balanced(s, x, y), p, TRAINED))
            locals_.append(p)
        w = {**w, **mean(locals_, [fed.size[c] for c in fed.sampled[r]], TRAINED)}
    return w


def personalised(fed, w, c, cycles, epochs, etf_lr, proj_lr):
    """The code's Client_personalization: local training as above from the global model, then ``cycles`` of
    ``epochs`` of CE on the ETF alone (lr etf_lr) and ``epochs`` of CE on the projection alone (lr proj_lr)."""
    x, y = fed.train[c]
    p = dict(w)
    for _ in range(STEPS):
        p = sgd(p, grads(lambda s: balanced(s, x, y), p, TRAINED))
    ce = lambda s: F.cross_entropy(etf_logits(s, x), y)
    for _ in range(cycles):
        for _ in range(epochs):
            p = sgd(p, grads(ce, p, (ETF,)), etf_lr)
        for _ in range(epochs):
            p = sgd(p, grads(ce, p, (PW, PB)), proj_lr)
    return p


def test_fedetf_classifier_is_a_simplex_etf_of_unit_columns():
    exp = make("fedetf", {"personalize": "false"}, "sequential")
    m = exp.initial_server().model[ETF].double()
    d, c = m.shape
    assert (d, c) == (6, C)  # the model's feature dimension (>= C)
    gram = m.T @ m  # unit columns, pairwise cosine -1 / (C - 1): M^T M = C / (C - 1) (I - 11^T / C)
    want = C / (C - 1) * (torch.eye(C, dtype=torch.float64) - 1 / C)
    assert torch.allclose(gram, want, atol=1e-6)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_fedetf_trains_encoder_projection_and_beta_against_the_fixed_etf(executor):
    exp = make("fedetf", {"personalize": "false"}, executor)
    server, _ = run_rounds(exp)
    names = (*PARAMS, ETF, PW, PB, BETA)
    fed = Federation(exp, names)
    w = fedetf_reference(fed)
    assert_close(server.model, w, "FedETF", (*TRAINED, ETF))
    assert torch.equal(server.model[ETF], fed.init[ETF])  # never trained, never averaged
    # the model's own linear classifier predicts as FedETF: beta M^T W_p, beta M^T b_p
    folded = {W2: w[BETA] * w[ETF].T @ w[PW], B2: w[BETA] * w[ETF].T @ w[PB]}
    assert_close(server.model, folded, "folded classifier", (W2, B2))


@pytest.mark.parametrize("executor", EXECUTORS)
def test_fedetf_evaluates_each_client_after_the_codes_personalisation(executor):
    params = {"pers_cycles": 2, "pers_epochs": 2, "pers_etf_lr": 0.3, "pers_proj_lr": 0.2}
    exp = make("fedetf", params, executor)
    server, clients = run_rounds(exp)
    evaluated = {}
    predictor = exp.algorithm.predictor

    def spy(state, ctx):  # the model each client is evaluated with, after its personalisation
        evaluated[ctx.client_id] = {n: t.detach().clone() for n, t in state.items()}
        return predictor(state, ctx)

    exp.algorithm.predictor = spy
    line = exp.evaluate(server, clients, ROUNDS)
    fed = Federation(exp, (*PARAMS, ETF, PW, PB, BETA))
    w = fedetf_reference(fed)
    hand = {}
    assert set(evaluated) == set(fed.clients)
    for c in fed.clients:
        p = personalised(fed, w, c, 2, 2, 0.3, 0.2)
        assert_close(evaluated[c], p, f"client {c}'s personalised model", (*TRAINED, ETF))
        assert not torch.allclose(p[ETF], w[ETF])  # the ETF itself is fine-tuned locally
        x, y = fed.test[c]
        hand[c] = int((etf_logits(p, x).argmax(1) == y).sum()) / len(y)
    assert line["_client_acc"] == pytest.approx(hand, abs=1e-9)
