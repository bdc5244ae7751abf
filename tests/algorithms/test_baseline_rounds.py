"""Three whole rounds of each baseline, recomputed by hand from its paper's update rule, against hetfl's
rounds with both executors (sequential, and vectorized with vmap forced on the CPU).

The federation is chosen where implementations usually go wrong: 4 clients of unequal sizes (quantity
skew: 13, 22, 14, 15 samples at batch 7, so 2, 4, 2, 3 local steps; with ``drop_last`` 1, 3, 2, 2), 2
sampled per round (rounds 1-3 sample {2, 3}, {0, 3}, {2, 3}: client 2 sits round 2 out and comes back with
the state of its round 1, client 0 starts late), client SGD with momentum and weight decay, and a cosine
learning-rate schedule stepped per round (0.1, 0.075, 0.025), so that a rule reading the wrong rate, the
wrong count of steps or samples, the wrong clients' state or the wrong sign shows in the numbers.

The reference below is written from the papers only: its own forward pass of the 60-5-10 MLP, its own
SGD (PyTorch's semantics: ``d = g + wd w``, ``b = d`` on the first step then ``b = rho b + d``,
``w -= lr b``), each method's local objective, client state and server rule. What it takes from hetfl is
the plumbing under audit elsewhere: the data, the sampled clients, each client's batch indices (their
seeded stream, ``batch_schedule``) and the initial model.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hetfl import config
from hetfl.engine.experiment import Experiment
from hetfl.engine.schedule import batch_schedule
from hetfl.engine.summary import Reporter
from hetfl.rng import torch_generator
from tests.helpers import MNIST, needs_shared_data
from tests.helpers.executors import compare_one_round

pytestmark = pytest.mark.usefixtures("one_thread")

ROUNDS, LR, MOMENTUM, WD, BATCH = 3, 0.1, 0.5, 0.01, 7
BASE = ["data.num_clients=4", "data.options={num_devices=4, max_samples=20}", "data.partition=quantity",
        "model.name=mlp", "model.options={hidden = [5]}", f"train.rounds={ROUNDS}", f"train.batch_size={BATCH}",
        "train.clients_per_round=2", f"train.lr={LR}", "train.lr_schedule=cosine", "train.lr_min=0.0",
        f"train.momentum={MOMENTUM}", f"train.weight_decay={WD}", "runtime.progress=false", "runtime.threads=1"]
W1, B1, WC, BC = "encoder.1.weight", "encoder.1.bias", "classifier.weight", "classifier.bias"
PARAMS = (W1, B1, WC, BC)
EXECUTORS = ("sequential", "vectorized")


def experiment(method: str, executor: str, extra: list[str]) -> Experiment:
    vmap = ["runtime.vmap_on_cpu=true"] if executor == "vectorized" else []
    return Experiment(config.load(None, [*BASE, f"algorithm.name={method}", f"runtime.executor={executor}",
                                         *vmap, *extra]))


def hetfl_rounds(exp: Experiment) -> tuple[list, dict]:
    """The server state after each round, and the client store after the last."""
    server, _, _ = exp.setup_round(exp.initial_server())
    clients: dict = {}
    servers = []
    for r in range(1, ROUNDS + 1):
        server = exp.round(server, clients, r, Reporter())["_server"]
        servers.append(server)
    return servers, clients


# ----------------------------------------------------------------------------------- the reference
def features(w: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w[W1].T + w[B1])


def logits(w: dict, x: torch.Tensor, normalize_rows: bool = False) -> torch.Tensor:
    weight = F.normalize(w[WC], dim=1) if normalize_rows else w[WC]
    return features(w, x) @ weight.T + w[BC]


def round_lr(r: int) -> float:
    """CosineAnnealingLR with T_max = rounds, stepped once per round, lr_min = 0."""
    return LR * 0.5 * (1 + math.cos(math.pi * (r - 1) / ROUNDS))


class Reference:
    """One federation computed by hand: ``loss(w, x, y, client, round)`` is the local objective,
    ``correct(g, client)`` SCAFFOLD's gradient correction, ``trainable`` the names SGD updates."""

    def __init__(self, exp: Experiment, drop_last: bool = False) -> None:
        self.exp = exp
        self.drop_last = drop_last
        self.sizes = exp.data.client_sizes
        self.w = {n: t.detach().clone() for n, t in exp.initial_server().model.items()}
        self.trainable = PARAMS

    def batches(self, client: int, r: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        data = self.exp.client_inputs(client)
        gen = torch_generator(self.exp.cfg.seed, "batches", r, client, 0)
        schedule = batch_schedule(self.sizes[client], BATCH, 1, 0, self.drop_last, gen)
        return [(data.x[idx], data.y[idx]) for idx in schedule]

    def local(self, start: dict, client: int, r: int, loss, correct=None) -> tuple[dict, int]:
        """Local SGD with momentum and weight decay (PyTorch's rule) on ``loss``; returns (model, steps)."""
        w = {n: t.clone() for n, t in start.items()}
        bufs: dict = {}
        lr = round_lr(r)
        steps = 0
        for x, y in self.batches(client, r):
            leaves = {n: w[n].clone().requires_grad_() for n in self.trainable}
            value = loss({**w, **leaves}, x, y)
            grads = dict(zip(leaves, torch.autograd.grad(value, list(leaves.values())), strict=True))
            if correct is not None:
                grads = correct(grads)
            for n in self.trainable:
                d = grads[n] + WD * w[n]
                bufs[n] = d if n not in bufs else MOMENTUM * bufs[n] + d
                w[n] = w[n] - lr * bufs[n]
            steps += 1
        return w, steps


def assert_close(got: dict, want: dict, names=PARAMS, atol: float = 2e-6) -> None:
    for n in names:
        diff = (got[n].double() - want[n].double()).abs().max().item()
        assert diff <= atol, f"{n} differs by {diff}"


def sampled(exp: Experiment) -> list[list[int]]:
    rounds = [exp.sample_clients(r) for r in range(1, ROUNDS + 1)]
    assert rounds == [[2, 3], [0, 3], [2, 3]]  # the situation the module docstring describes
    return rounds


def ce(w, x, y):
    return F.cross_entropy(logits(w, x), y)


# --------------------------------------------------------------------------------- FedAvg, FedAvgM
@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("drop_last", [False, True])
def test_fedavg_weights_by_samples_not_steps(executor, drop_last):
    """McMahan et al. 2017, Alg. 1: w <- sum_k n_k / n_S w_k over the sampled clients S, n_k the client's
    training samples (13, 14, 15 for clients 0, 2, 3), whatever its steps (2, 2, 3; with drop_last 1, 2, 2)."""
    exp = experiment("fedavg", executor, [f"train.drop_last={str(drop_last).lower()}"])
    ref = Reference(exp, drop_last)
    for r, clients in enumerate(sampled(exp), start=1):
        locals_ = [ref.local(ref.w, c, r, ce)[0] for c in clients]
        n = [ref.sizes[c] for c in clients]
        ref.w = {k: sum(nk * wk[k] for nk, wk in zip(n, locals_, strict=True)) / sum(n) for k in PARAMS}
    servers, _ = hetfl_rounds(exp)
    assert_close(servers[-1].model, ref.w)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_fedavgm_server_momentum_and_server_lr(executor):
    """Hsu et al. 2019, sec. 3: Delta = w - sum_k n_k/n w_k, v <- beta v + Delta, w <- w - eta_s v, with v
    kept over the rounds (beta = 0.6, eta_s = 0.7 so that neither can hide)."""
    beta, eta = 0.6, 0.7
    exp = experiment("fedavgm", executor, [f"algorithm.server_momentum={beta}", f"algorithm.server_lr={eta}"])
    ref = Reference(exp)
    v = {k: torch.zeros_like(ref.w[k]) for k in PARAMS}
    for r, clients in enumerate(sampled(exp), start=1):
        locals_ = [ref.local(ref.w, c, r, ce)[0] for c in clients]
        n = [ref.sizes[c] for c in clients]
        for k in PARAMS:
            delta = ref.w[k] - sum(nk * wk[k] for nk, wk in zip(n, locals_, strict=True)) / sum(n)
            v[k] = beta * v[k] + delta
            ref.w[k] = ref.w[k] - eta * v[k]
    servers, _ = hetfl_rounds(exp)
    assert_close(servers[-1].model, ref.w)
    assert_close(servers[-1].extra, v)


# ---------------------------------------------------------------------------------------- FedProx
@pytest.mark.parametrize("executor", EXECUTORS)
def test_fedprox_proximal_term_beside_weight_decay(executor):
    """Li et al. 2020, eq. (2): h_k(w) = F_k(w) + mu/2 ||w - w^t||^2 (gradient mu (w - w^t)), the anchor
    being the round's global model; the run's weight decay acts besides it. mu = 0.5."""
    mu = 0.5
    exp = experiment("fedprox", executor, [f"algorithm.mu={mu}"])
    ref = Reference(exp)
    for r, clients in enumerate(sampled(exp), start=1):
        anchor = ref.w

        def loss(w, x, y, anchor=anchor):
            return ce(w, x, y) + mu / 2 * sum(((w[k] - anchor[k]) ** 2).sum() for k in PARAMS)

        locals_ = [ref.local(ref.w, c, r, loss)[0] for c in clients]
        n = [ref.sizes[c] for c in clients]
        ref.w = {k: sum(nk * wk[k] for nk, wk in zip(n, locals_, strict=True)) / sum(n) for k in PARAMS}
    servers, _ = hetfl_rounds(exp)
    assert_close(servers[-1].model, ref.w)


# --------------------------------------------------------------------------------------- SCAFFOLD
@pytest.mark.parametrize("executor", EXECUTORS)
def test_scaffold_option_two_under_partial_participation(executor):
    """Karimireddy et al. 2020, Alg. 1: local steps with g - c_i + c (line 10; the corrected gradient is
    what the run's momentum-SGD is fed); option II c_i+ = c_i - c + (x - y_i) / (K_i eta_l), K_i the
    client's own steps and eta_l the round's rate (cosine: 0.1, 0.075, 0.025); server x <- x + eta_g
    mean_S(y_i - x) and c <- c + |S|/N mean_S(c_i+ - c_i) = c + (1/N) sum_S dc_i. Client 2 keeps its
    c_i through round 2, which it sits out. eta_g = 0.8."""
    eta_g, num = 0.8, 4
    exp = experiment("scaffold", executor, [f"algorithm.server_lr={eta_g}"])
    ref = Reference(exp)
    c = {k: torch.zeros_like(ref.w[k]) for k in PARAMS}
    c_i = {i: {k: torch.zeros_like(ref.w[k]) for k in PARAMS} for i in range(num)}
    for r, clients in enumerate(sampled(exp), start=1):
        ys, dcs = [], []
        for i in clients:
            y, steps = ref.local(ref.w, i, r, ce, correct=lambda g, i=i, c=c: {k: g[k] - c_i[i][k] + c[k] for k in g})
            new = {k: c_i[i][k] - c[k] + (ref.w[k] - y[k]) / (steps * round_lr(r)) for k in PARAMS}
            dcs.append({k: new[k] - c_i[i][k] for k in PARAMS})
            c_i[i] = new
            ys.append(y)
        ref.w = {k: ref.w[k] + eta_g * sum(y[k] - ref.w[k] for y in ys) / len(ys) for k in PARAMS}
        c = {k: c[k] + len(clients) / num * sum(d[k] for d in dcs) / len(dcs) for k in PARAMS}
    servers, store = hetfl_rounds(exp)
    assert_close(servers[-1].model, ref.w)
    assert_close(servers[-1].extra, c, atol=2e-5)  # (x - y) / (K lr) divides by lr = 0.025 in round 3
    for i in (0, 2, 3):
        assert_close(store[i], c_i[i], atol=2e-5)
    assert 1 not in store  # never sampled: no state


# ----------------------------------------------------------------------------------------- FedDyn
@pytest.mark.parametrize("executor", EXECUTORS)
def test_feddyn_state_and_server_correction_under_partial_participation(executor):
    """Acar et al. 2021, Alg. 1: client k minimises L_k(th) - <g_k, th> + alpha/2 ||th - th^{t-1}||^2 (the
    run's weight decay besides), then g_k <- g_k - alpha (th_k - th^{t-1}); the server
    h <- h - alpha/m sum_{k in P} (th_k - th^{t-1}) with m = 4 (all clients) and
    th^t = mean_P th_k - h / alpha. alpha = 0.1."""
    alpha, m = 0.1, 4
    exp = experiment("feddyn", executor, [f"algorithm.alpha={alpha}"])
    ref = Reference(exp)
    h = {k: torch.zeros_like(ref.w[k]) for k in PARAMS}
    g = {i: {k: torch.zeros_like(ref.w[k]) for k in PARAMS} for i in range(m)}
    for r, clients in enumerate(sampled(exp), start=1):
        prev = ref.w
        thetas = []
        for i in clients:
            def loss(w, x, y, i=i, prev=prev):
                linear = sum((g[i][k] * w[k]).sum() for k in PARAMS)
                return ce(w, x, y) - linear + alpha / 2 * sum(((w[k] - prev[k]) ** 2).sum() for k in PARAMS)

            theta, _ = ref.local(prev, i, r, loss)
            g[i] = {k: g[i][k] - alpha * (theta[k] - prev[k]) for k in PARAMS}
            thetas.append(theta)
        h = {k: h[k] - alpha / m * sum(t[k] - prev[k] for t in thetas) for k in PARAMS}
        ref.w = {k: sum(t[k] for t in thetas) / len(thetas) - h[k] / alpha for k in PARAMS}
    servers, store = hetfl_rounds(exp)
    assert_close(servers[-1].model, ref.w, atol=5e-6)
    assert_close(servers[-1].extra, h)
    for i in (0, 2, 3):
        assert_close(store[i], g[i])


# ----------------------------------------------------------------------------------------- FedNova
def momentum_normaliser(tau: int, rho: float) -> float:
    """a_i of FedNova with momentum: the sum over the tau steps of the momentum buffer's cumulative weight
    of each step's gradient, sum_{k=1..tau} (1 - rho^k) / (1 - rho) (Wang et al. 2020, App. (momentum))."""
    return sum((1 - rho**k) / (1 - rho) for k in range(1, tau + 1))


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("drop_last", [False, True])
def test_fednova_normalised_averaging_with_unequal_steps(executor, drop_last):
    """Wang et al. 2020, eq. (6)-(7): w <- w - eta_s tau_eff sum_i p_i (w - w_i) / a_i, p_i = n_i / n_S,
    tau_eff = sum_i p_i a_i, a_i the momentum normaliser of client i's own steps (clients 0, 2, 3: 2, 2, 3; with
    drop_last 1, 2, 2). eta_s = 0.9."""
    eta = 0.9
    exp = experiment("fednova", executor, [f"algorithm.server_lr={eta}", f"train.drop_last={str(drop_last).lower()}"])
    ref = Reference(exp, drop_last)
    steps_seen = set()
    for r, clients in enumerate(sampled(exp), start=1):
        results = [ref.local(ref.w, c, r, ce) for c in clients]
        n = [ref.sizes[c] for c in clients]
        p = [nk / sum(n) for nk in n]
        a = [momentum_normaliser(steps, MOMENTUM) for _, steps in results]
        steps_seen |= {steps for _, steps in results}
        tau_eff = sum(pi * ai for pi, ai in zip(p, a, strict=True))
        ref.w = {k: ref.w[k] - eta * tau_eff * sum(pi / ai * (ref.w[k] - wi[k])
                                                   for pi, ai, (wi, _) in zip(p, a, results, strict=True))
                 for k in PARAMS}
    assert len(steps_seen) > 1  # unequal local steps really occur
    servers, _ = hetfl_rounds(exp)
    assert_close(servers[-1].model, ref.w)


# -------------------------------------------------------------------------------------------- MOON
@pytest.mark.parametrize("executor", EXECUTORS)
def test_moon_previous_model_across_skipped_rounds(executor):
    """Li et al. 2021, eq. (2)-(3): CE + mu l_con, l_con = -log(e^{cos(z, z_glob)/tau} / (e^{cos(z, z_glob)/tau}
    + e^{cos(z, z_prev)/tau})) on the classifier input (here the MLP's hidden layer: it has no projector),
    z_glob from the round's global model, z_prev from the client's own last trained model, however many
    rounds ago (client 2: its round-1 model in round 3); no term in a client's first round (client 0 in
    round 2). mu = 2, tau = 0.5."""
    mu, tau = 2.0, 0.5
    exp = experiment("moon", executor, [f"algorithm.mu={mu}", f"algorithm.temperature={tau}"])
    ref = Reference(exp)
    prev: dict = {}
    for r, clients in enumerate(sampled(exp), start=1):
        glob = ref.w
        locals_ = []
        for i in clients:
            def loss(w, x, y, i=i, glob=glob):
                value = ce(w, x, y)
                if i not in prev:
                    return value
                z = features(w, x)
                pos = F.cosine_similarity(z, features(glob, x).detach(), dim=-1) / tau
                neg = F.cosine_similarity(z, features(prev[i], x).detach(), dim=-1) / tau
                return value + mu * (-(pos - torch.logaddexp(pos, neg))).mean()

            w_i, _ = ref.local(glob, i, r, loss)
            locals_.append(w_i)
        for i, w_i in zip(clients, locals_, strict=True):
            prev[i] = w_i
        n = [ref.sizes[c] for c in clients]
        ref.w = {k: sum(nk * wk[k] for nk, wk in zip(n, locals_, strict=True)) / sum(n) for k in PARAMS}
    servers, store = hetfl_rounds(exp)
    assert_close(servers[-1].model, ref.w)
    for i in (0, 2, 3):
        assert_close({k: store[i]["moon.prev/" + k] for k in PARAMS}, prev[i])


# ------------------------------------------------------------- regularisers on a FedAvg server
def decorrelation(z: torch.Tensor) -> torch.Tensor:
    """FedDecorr's penalty as the authors' loss.py computes it (Shi et al. 2023): standardise each feature
    with the unbiased variance (+1e-8), C = Z^T Z, mean of the squared off-diagonal entries, divided by N;
    0 for a batch of one (client 3's 15 samples at batch 7 end on one)."""
    n, d = z.shape
    if n == 1:
        return torch.zeros(())
    z = z - z.mean(0)
    z = z / torch.sqrt(1e-8 + z.var(0, unbiased=True))
    corr = z.T @ z
    off = corr[~torch.eye(d, dtype=torch.bool)]
    return (off**2).mean() / n


def counts_of(exp: Experiment, client: int) -> torch.Tensor:
    return torch.bincount(exp.client_inputs(client).y, minlength=10).float()


REGULARISED = {
    # name: (settings, local loss (w, x, y, anchor, counts) -> value, trainable, classifier rows normalised)
    "feddecorr": (["algorithm.beta=0.5"],
                  lambda w, x, y, g, n: ce(w, x, y) + 0.5 * decorrelation(features(w, x)), PARAMS, False),
    "fedlc": (["algorithm.tau=0.7"],  # Zhang et al. 2022: CE of z_c - tau n_c^(-1/4), absent classes at n = 1e-8
              lambda w, x, y, g, n: F.cross_entropy(logits(w, x) - 0.7 * n.clamp(min=1e-8) ** -0.25, y),
              PARAMS, False),
    "fedrs": (["algorithm.alpha=0.3"],  # Li & Zhan 2021: absent classes' logits scaled by alpha
              lambda w, x, y, g, n: F.cross_entropy(logits(w, x) * torch.where(n > 0, 1.0, 0.3), y), PARAMS, False),
    "clsprox": (["algorithm.mu=0.5"],  # Luo et al. 2021, sec. 3.3: mu/2 ||phi - phi_g||^2 on the classifier only
                lambda w, x, y, g, n: ce(w, x, y) + 0.25 * sum(((w[k] - g[k]) ** 2).sum() for k in (WC, BC)),
                PARAMS, False),
    "clsnorm": ([],  # Luo et al. 2021, sec. 3.3: phi_i^T z / ||phi_i||, in training (and at inference)
                lambda w, x, y, g, n: F.cross_entropy(logits(w, x, normalize_rows=True), y), PARAMS, True),
    "freeze": ([],  # FedUV's Freeze: the classifier never trains (no weight decay on it either)
               lambda w, x, y, g, n: ce(w, x, y), (W1, B1), False),
}


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("method", sorted(REGULARISED))
def test_local_regularisers_over_fedavg_rounds(method, executor):
    """Each method's local objective (its paper's, or its authors' code where hetfl follows the code) over
    three FedAvg rounds: w <- sum_k n_k / n_S w_k of the sampled clients."""
    settings, objective, trainable, normalised = REGULARISED[method]
    exp = experiment(method, executor, settings)
    ref = Reference(exp)
    ref.trainable = trainable
    counts = {c: counts_of(exp, c) for c in range(4)}
    for r, clients in enumerate(sampled(exp), start=1):
        anchor = ref.w
        locals_ = [ref.local(ref.w, c, r, lambda w, x, y, c=c, anchor=anchor: objective(w, x, y, anchor, counts[c]))[0]
                   for c in clients]
        n = [ref.sizes[c] for c in clients]
        ref.w = {k: sum(nk * wk[k] for nk, wk in zip(n, locals_, strict=True)) / sum(n) for k in PARAMS}
    servers, _ = hetfl_rounds(exp)
    assert_close(servers[-1].model, ref.w)
    if normalised:  # the global model is evaluated with normalised rows too
        assert "classifier_transform/normalize" in servers[-1].model
    if trainable != PARAMS:
        assert torch.equal(servers[-1].model[WC], exp.initial_server().model[WC])


# ------------------------------------------------------------------------- BatchNorm in MOON's reference models
class NormedNet(torch.nn.Module):
    """4 -> 3 linear, BatchNorm1d, 3 -> 2 classifier."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        self.classifier = torch.nn.Linear(3, 2)

    def forward(self, x, return_features: bool = False):  # type: ignore[no-untyped-def]
        z = self.encoder(x)
        return (z, self.classifier(z)) if return_features else self.classifier(z)


def normed_setup():
    from hetfl.algorithms.base import ModelCaller, Setup
    from hetfl.config import TrainConfig

    model = NormedNet().train()
    names = [n for n, _ in model.named_parameters()]
    groups = {"encoder": [n for n in names if n.startswith("encoder.")], "projector": [],
              "classifier": [n for n in names if n.startswith("classifier.")]}
    return Setup(ModelCaller(model), groups, 3, 2, [10] * 3, TrainConfig(), seed=0)


def normed_state(seed: int) -> dict:
    """NormedNet's tensors, drawn, with running statistics far from any batch's."""
    gen = torch.Generator().manual_seed(seed)
    return {"encoder.0.weight": torch.randn(3, 4, generator=gen), "encoder.0.bias": torch.randn(3, generator=gen),
            "encoder.1.weight": 1 + 0.3 * torch.randn(3, generator=gen),
            "encoder.1.bias": torch.randn(3, generator=gen),
            "encoder.1.running_mean": torch.randn(3, generator=gen),
            "encoder.1.running_var": 0.5 + torch.rand(3, generator=gen),
            "encoder.1.num_batches_tracked": torch.tensor(7),
            "classifier.weight": torch.randn(2, 3, generator=gen), "classifier.bias": torch.randn(2, generator=gen)}


def bn_features(w: dict, x: torch.Tensor, training: bool) -> torch.Tensor:
    h = x @ w["encoder.0.weight"].T + w["encoder.0.bias"]
    if training:
        mean, var = h.mean(0), h.var(0, unbiased=False)
    else:
        mean, var = w["encoder.1.running_mean"], w["encoder.1.running_var"]
    return (h - mean) / torch.sqrt(var + 1e-5) * w["encoder.1.weight"] + w["encoder.1.bias"]


def test_moon_reference_models_use_their_running_statistics():
    """MOON's authors' code (QinbinLi/MOON main.py) puts the global model and the previous models in eval
    mode (``global_model.eval()``, ``net.eval()`` for the pool) while the local model trains: z_glob and
    z_prev come from BatchNorm with the reference model's running statistics, z from the batch's."""
    from hetfl.algorithms import build_algorithm
    from hetfl.algorithms.base import Batch, ClientContext
    from hetfl.algorithms.moon import PREV

    setup = normed_setup()
    algo = build_algorithm("moon", {"mu": 1.0, "temperature": 0.5}, setup)
    glob, prev, local = normed_state(1), normed_state(2), normed_state(3)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(4))
    y = torch.tensor([0, 1, 0, 1, 1, 0])
    ctx = ClientContext(0, 2, 10, 0.1, glob, {PREV + n: t for n, t in prev.items()})
    ctx.extras = algo.begin(ctx)
    _, metrics = algo.loss(local, Batch(x, y), ctx)
    z = bn_features(local, x, training=True)
    pos = F.cosine_similarity(z, bn_features(glob, x, training=False), dim=-1) / 0.5
    neg = F.cosine_similarity(z, bn_features(prev, x, training=False), dim=-1) / 0.5
    want = (-(pos - torch.logaddexp(pos, neg))).mean()
    torch.testing.assert_close(metrics["contrastive"], want, rtol=1e-5, atol=1e-6)
    # reference_mode = "train" (hetfl before): the reference models normalise by the batch's statistics
    algo = build_algorithm("moon", {"mu": 1.0, "temperature": 0.5, "reference_mode": "train"}, setup)
    _, metrics = algo.loss(local, Batch(x, y), ctx)
    pos = F.cosine_similarity(z, bn_features(glob, x, training=True), dim=-1) / 0.5
    neg = F.cosine_similarity(z, bn_features(prev, x, training=True), dim=-1) / 0.5
    batch_stats = (-(pos - torch.logaddexp(pos, neg))).mean()
    assert abs(batch_stats - want) > 0.1  # the case tells the two modes apart (2.09 and 1.66)
    torch.testing.assert_close(metrics["contrastive"], batch_stats, rtol=1e-5, atol=1e-6)
    assert setup.model.module.training  # the model itself stays in training mode


@needs_shared_data
def test_moon_with_batchnorm_gives_the_same_clients_with_either_executor():
    """The reference models' eval-mode BatchNorm (:class:`hetfl.models.layers.InferenceBatchNorm`) under
    vmap: ResNet-18 with BatchNorm, a round with previous models, eager and static (CUDA-graph) steps.

    IID clients: under ``data.partition = dominant`` (until session 42) a client's batches of 16 images, most of
    them one digit, leave some of ResNet's channels with a near-zero batch variance, whose standardisation
    magnifies the last bit of a reduction: on one 2-core machine (AVX-512 with FP16) the two executors' first
    convolution then ended one step 3e-5 apart (0.7% of its update; FedAvg alike, and none with GroupNorm) and
    the round of two steps 3.5e-4, past the tolerance, where earlier machines agreed within it. With IID clients
    both executors agree to 6e-7."""
    exp = Experiment(config.load(None, [
        "data.dataset=mnist", f"data.root={MNIST}", "data.download=false", "data.partition=iid",
        "data.samples_per_client=32", "data.num_clients=2", "model.name=resnet18",
        "model.options={norm = \"bn\", width = 16}", "train.batch_size=16", "train.local_steps=2",
        "train.lr=0.01", "train.momentum=0.9", "runtime.progress=false", "algorithm.name=moon"]))
    compare_one_round(exp, rounds_before=1, step_mode=("eager", "static"))


def test_fedavgm_with_server_lr_one_minus_beta_is_the_niid_bench_damped_momentum():
    """The docstring's claim: the NIID-Bench / MOON code's v <- beta v + (1 - beta) Delta, w <- w - v equals
    Hsu et al.'s rule with eta_s = 1 - beta, over rounds of different client updates (beta = 0.1)."""
    beta = 0.1
    exp = experiment("fedavgm", "sequential", [f"algorithm.server_momentum={beta}", f"algorithm.server_lr={1 - beta}"])
    ref = Reference(exp)
    v = {k: torch.zeros_like(ref.w[k]) for k in PARAMS}
    for r, clients in enumerate(sampled(exp), start=1):
        locals_ = [ref.local(ref.w, c, r, ce)[0] for c in clients]
        n = [ref.sizes[c] for c in clients]
        for k in PARAMS:
            delta = ref.w[k] - sum(nk * wk[k] for nk, wk in zip(n, locals_, strict=True)) / sum(n)
            v[k] = beta * v[k] + (1 - beta) * delta
            ref.w[k] = ref.w[k] - v[k]
    servers, _ = hetfl_rounds(exp)
    assert_close(servers[-1].model, ref.w)


BUFFERS = ("encoder.1.running_mean", "encoder.1.running_var")


@pytest.mark.parametrize(("method", "settings", "by_samples"), [
    ("fedavg", {}, True), ("fedavgm", {"server_momentum": 0.5, "server_lr": 0.7}, True),
    ("fednova", {"server_lr": 0.8}, True), ("scaffold", {"server_lr": 0.8}, False),
    ("feddyn", {"alpha": 0.1}, False), ("fedprox", {"mu": 0.1}, True), ("moon", {}, True)])
def test_batchnorm_statistics_are_averaged_never_corrected(method, settings, by_samples):
    """Running statistics are not parameters: the server averages them with the weights it averages the
    models with (n_k / n, or uniform where the paper's server mean is uniform: SCAFFOLD, FedDyn), through no
    server learning rate, momentum, normalisation or correction (FedDyn's h / alpha, SCAFFOLD's eta_g), in a
    round whose server state is not at its start (FedAvgM's velocity, FedDyn's h, SCAFFOLD's c non-zero);
    num_batches_tracked takes the largest count."""
    from hetfl.algorithms import build_algorithm
    from hetfl.algorithms.base import Upload

    setup = normed_setup()
    algo = build_algorithm(method, settings, setup)
    server = algo.init_server(normed_state(0))
    server.extra = {k: torch.full_like(v, 0.3) for k, v in server.extra.items()}  # a later round's state
    ups = [Upload(i, {**normed_state(10 + i), "encoder.1.num_batches_tracked": torch.tensor(5 + 4 * i)}, n, s)
           for i, (n, s) in enumerate([(30, 2), (10, 5)])]
    if method == "scaffold":
        for u in ups:
            u.tensors.update({"scaffold.c/" + k: torch.ones_like(v) for k, v in server.extra.items()})
    new = algo.aggregate(server, ups, 2)
    w = (0.75, 0.25) if by_samples else (0.5, 0.5)
    for name in BUFFERS:
        torch.testing.assert_close(new.model[name], w[0] * ups[0].tensors[name] + w[1] * ups[1].tensors[name])
    assert new.model["encoder.1.num_batches_tracked"].item() == 9


@pytest.mark.parametrize("returning", [False, True])
def test_moon_flag_lives_on_the_models_device(returning):
    """``begin``'s 0/1 flag is made on the device of the model it stands beside (the payload in a first round,
    the stored previous model later): checked on the meta device, which a CPU-only machine has, so that a
    flag made on the default device (the CPU: a device mismatch in a CUDA step) fails here too."""
    from hetfl.algorithms import build_algorithm
    from hetfl.algorithms.base import ClientContext
    from hetfl.algorithms.moon import HAS_PREV, PREV

    setup = normed_setup()
    algo = build_algorithm("moon", {}, setup)
    on_meta = {n: t.to("meta") for n, t in normed_state(0).items()}
    state = {PREV + n: t for n, t in on_meta.items()} if returning else {}
    payload = {n: torch.zeros(t.shape) for n, t in on_meta.items()} if returning else on_meta
    extras = algo.begin(ClientContext(0, 2, 10, 0.1, payload, state))
    assert extras[HAS_PREV].device.type == "meta"
