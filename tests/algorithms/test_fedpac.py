"""FedPAC's statistics, centroids, classifier combination and personalised heads, against golden
values from the authors' code.

Golden values: JianXu95/FedPAC at commit 7cf08f3e22ac209789757253d8a679791c96db86, functions
``LocalUpdate_FedPAC.statistics_extraction`` / ``prior_label`` / ``size_label`` /
``get_local_protos`` (methods/fedpac.py) and ``protos_aggregation``, ``get_head_agg_weight``,
``agg_classifier_weighted_p`` (tools.py), transcribed into a scratch script outside this
repository (torch.eig, removed from torch, replaced by numpy's eig) and run with cvxpy 1.9.3
(solver CLARABEL; cvxpy's default OSQP gives weights within 2.3e-6) on the fixed input built by
:func:`features` and :func:`heads` below (float32, as the authors). Weights are the code's
thresholded weights divided by their sum, as ``agg_classifier_weighted_p`` does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hetfl.algorithms import build_algorithm
from hetfl.algorithms import fedpac as fedpac_module
from hetfl.algorithms.base import Batch, ModelCaller, Setup, Upload
from hetfl.algorithms.fedpac import (
    CENTROID_SUMS,
    CENTROIDS,
    COUNTS,
    HAS_CENTROID,
    class_means,
    class_sums,
    combination_weights,
    feature_statistics,
    global_centroids,
    qp_matrix,
    threshold_weights,
)
from hetfl.algorithms.simplex_qp import SimplexQPResult, drop_small_eigenvalues
from hetfl.config import TrainConfig
from hetfl.params import ConfigError
from tests.helpers import context, initial_state, perturbed, tiny_setup

pytestmark = pytest.mark.usefixtures("one_thread")

C, D = 3, 5
LABELS = [[0, 0, 0, 0, 1, 1, 2, 2], [0, 0, 0, 0, 0, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 2, 2], [2, 2, 2, 2, 2, 2, 0]]

# ---- golden values (authors' code, see the module docstring) ----
V = [3.80847168, 3.06143757, 3.68221576, 9.72303626]
H = [
    [[1.71875, 0.78125, 0.65625, 0.75, 0.65625], [0.21875, 1.40625, 0.5, 0.5, 0.40625],
     [0.5625, 0.3125, 1.875, 0.34375, 0.21875]],
    [[1.82500005, 0.925000012, 0.675000012, 0.725000024, 0.75],
     [0.325000018, 0.975000024, 0.275000006, 0.300000012, 0.25],
     [0.400000036, 0.574999988, 2.2750001, 0.425000012, 0.425000012]],
    [[0, 0, 0, 0, 0], [1.03571439, 3.82142854, 1.32142866, 1.17857146, 1],
     [0.357142866, 0.428571463, 2.10714293, 0.25, 0.464285731]],
    [[1.42857146, 0.857142925, 0.285714298, 0.0714285746, 0.214285731], [0, 0, 0, 0, 0],
     [2.28571439, 2.42857146, 13.1428566, 2.64285707, 2.71428585]],
]
# global centroids from the clients' features after "training" (features(..., shift=0.5))
CENTROIDS_GOLDEN = [[4.30000019, 2.3499999, 1.70000005, 1.77499998, 1.92499995],
                    [1.46111107, 5.50555563, 2.07777786, 2.09444451, 1.91666663],
                    [2.17692304, 2.37307692, 11.4153843, 2.49615383, 2.67307687]]
# row i: client i's combination weights; client 2's weight 6.9e-4 on client 3 is thresholded away
ALPHA = [[0.401692533, 0.465473335, 0.132834132, 0], [0.384029176, 0.542741614, 0.045922226, 0.0273069839],
         [0.128766752, 0.0552719876, 0.81596126, 0], [0, 0.0646657434, 0, 0.935334257]]
HEAD_W = [
    [[-0.276952833, 0.0980471671, -0.516083658, -0.141083658, -0.0483561978],
     [0.348047137, -0.266083658, 0.108916342, 0.20164381, -0.276952833],
     [-0.0160836503, 0.0766438022, 0.451643795, -0.0269528553, 0.348047137]],
    [[-0.170414925, 0.146557748, -0.631768167, -0.256768167, 0.0206470825],
     [0.396557719, -0.381768197, -0.00676818704, 0.270647079, -0.170414925],
     [-0.131768182, 0.145647064, 0.520647109, 0.0215577111, 0.396557719]],
    [[-0.414025217, -0.0390252285, 0.218521804, 0.593521774, -0.76539588],
     [0.210974768, 0.468521804, 0.843521833, -0.51539588, -0.414025217],
     [0.718521774, -0.64039588, -0.26539588, -0.164025232, 0.210974768]],
    [[0.959583938, -0.653001368, -0.415416062, -0.0404160917, 0.334583879],
     [-0.403001368, -0.165416092, 0.209583923, 0.584583938, 0.959583938],
     [0.0845839083, 0.459583908, 0.834583938, -0.778001368, -0.403001368]],
]
HEAD_B = [[-0.117686473, -0.199528128, 0.134429201], [-0.054156255, -0.266716987, 0.175880224],
          [-0.254555702, 0.176354319, -0.343597263], [0.483833581, -0.266166449, 0.233833566]]
# indefinite case: statistics 0.05 * H, variances (0.004, 0.02, -0.001, 0.03). Client 2's matrix has
# eigenvalue < 0 and is repaired (eigen-components < 0.01 dropped); the others are left as they are.
V_INDEFINITE = [0.004, 0.02, -0.001, 0.03]
P_REPAIRED = [[0.0368878879, 0.0366837159, 0, 0.0333378501], [0.0366837159, 0.0621257387, 0, 0.0528635271],
              [0, 0, 0, 0], [0.0333378501, 0.0528635271, 0, 0.437534958]]
ALPHA_INDEFINITE = [[0.734144584, 0.15401479, 0.110443847, 0.00139677938], [0.770638469, 0.190145268, 0, 0.0392162625],
                    [0, 0, 1, 0], [0.0104702333, 0.0587796978, 0.00723231197, 0.923517757]]


def features(client: int, shift: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The pinned input: client ``client``'s features [n, 5] and labels (exact small rationals)."""
    labels = LABELS[client]
    n = len(labels)
    i = torch.arange(n).unsqueeze(1)
    j = torch.arange(D).unsqueeze(0)
    x = ((i * 7 + j * 3 + client * 5) ** 2 % 13).float() / 4.0
    y = torch.tensor(labels)
    x[torch.arange(n), y] += 2.0 * (y.float() + 1)
    x = x * (2.0 if client == 3 else 1.0)
    return x + shift * (j.float() + 1) / D, y


def heads(client: int) -> dict[str, torch.Tensor]:
    k = torch.arange(C).unsqueeze(1)
    j = torch.arange(D).unsqueeze(0)
    w = ((client * 11 + k * 5 + j * 3) % 17).float() / 8.0 - 1.0
    b = ((client * 3 + torch.arange(C) * 7) % 5).float() / 4.0 - 0.5
    return {"classifier.weight": w, "classifier.bias": b}


def golden_statistics(scale: float = 1.0) -> tuple[list[torch.Tensor], list[float]]:
    stats = [feature_statistics(*features(c), num_classes=C) for c in range(4)]
    return [scale * h for h, _ in stats], [v for _, v in stats]


class Net5(nn.Module):
    """4 -> 5 encoder, 5 -> 3 classifier: the shapes of the pinned input."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(4, D)
        self.classifier = nn.Linear(D, C)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)

    def forward(self, x, return_features: bool = False):
        z = self.features(x)
        logits = self.classifier(z)
        return (z, logits) if return_features else logits


def net5_setup() -> Setup:
    model = Net5()
    names = [n for n, _ in model.named_parameters()]
    groups = {part: [n for n in names if n.startswith(part + ".")] for part in ("encoder", "classifier")}
    return Setup(ModelCaller(model), groups, num_clients=4, num_classes=C, client_sizes=[len(y) for y in LABELS],
                 train=TrainConfig(), seed=0)


# ------------------------------------------------------------------ statistics (client step 1)
def test_feature_statistics_by_hand():
    z = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [0.0, 2.0]])
    y = torch.tensor([0, 0, 1, 1])
    h, v = feature_statistics(z, y, num_classes=3)
    # pi = (1/2, 1/2, 0); mu_0 = (2, 0), mu_1 = (0, 2); h_k = pi_k mu_k
    assert torch.allclose(h, torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=torch.float64))
    # tr E[zz^T|0] = (1 + 9)/2 = 5, tr E[zz^T|1] = 4; v = [(5 + 4)/2 - (4 + 4)/4] / 4 = 2.5 / 4
    assert v == pytest.approx(2.5 / 4)


def test_feature_statistics_match_the_authors_code():
    h, v = golden_statistics()
    for c in range(4):
        assert v[c] == pytest.approx(V[c], rel=1e-6)
        assert torch.allclose(h[c], torch.tensor(H[c], dtype=torch.float64), atol=1e-6)


# ------------------------------------------------------------------ the QP (server)
def test_qp_matrix_is_variance_plus_bias_gram():
    h, v = golden_statistics()
    p = qp_matrix(h, v, 1)
    j1, j2 = 0, 3
    bias = sum(float((h[1][k] - h[j1][k]) @ (h[1][k] - h[j2][k])) for k in range(C))
    assert float(p[j1, j2]) == pytest.approx(bias, rel=1e-12)
    assert float(p[2, 2]) == pytest.approx(v[2] + float(((h[1] - h[2]) ** 2).sum()), rel=1e-12)
    assert float(p[1, 1]) == pytest.approx(v[1], rel=1e-12)  # no bias against itself


def test_combination_weights_match_the_authors_code():
    h, v = golden_statistics()
    for i in range(4):
        alpha = combination_weights(h, v, i)
        assert torch.allclose(alpha, torch.tensor(ALPHA[i], dtype=torch.float64), atol=1e-6), (i, alpha)
    # client 2's exact optimum keeps 6.9e-4 on client 3: the authors' threshold (1e-3) removes it
    exact = combination_weights(h, v, 2, min_weight=0.0)
    assert 5e-4 < float(exact[3]) < 1e-3 and abs(float(exact.sum()) - 1) < 1e-12


def test_repair_of_an_indefinite_matrix_matches_the_authors_code():
    h, _ = golden_statistics(scale=0.05)
    repaired, changed = drop_small_eigenvalues(qp_matrix(h, V_INDEFINITE, 2), 0.01)
    assert changed and torch.allclose(repaired, torch.tensor(P_REPAIRED, dtype=torch.float64), atol=1e-8)
    same, changed = drop_small_eigenvalues(qp_matrix(h, V_INDEFINITE, 0), 0.01)  # PSD: left alone
    assert not changed and torch.equal(same, qp_matrix(h, V_INDEFINITE, 0))
    for i in range(4):
        alpha = combination_weights(h, V_INDEFINITE, i)
        assert torch.allclose(alpha, torch.tensor(ALPHA_INDEFINITE[i], dtype=torch.float64), atol=5e-6), (i, alpha)


def test_threshold_zeroes_small_weights_and_renormalises():
    alpha = torch.tensor([0.5, 0.0009, 0.001, 0.4981], dtype=torch.float64)
    out = threshold_weights(alpha, 1e-3)
    assert out.tolist() == pytest.approx([0.5 / 0.9981, 0.0, 0.0, 0.4981 / 0.9981])  # <= 1e-3 goes, as the code
    assert threshold_weights(torch.full((4,), 0.25, dtype=torch.float64), 0.3) is None
    assert torch.equal(threshold_weights(alpha, 0.0), alpha / alpha.sum())


def test_identical_clients_share_equally_and_unique_ones_keep_their_own():
    h = [torch.ones(3, 2) for _ in range(4)]
    alpha = combination_weights(h, [1.0] * 4, 0)
    assert torch.allclose(alpha, torch.full((4,), 0.25, dtype=torch.float64), atol=1e-8)
    far = [torch.zeros(3, 2)] + [torch.full((3, 2), 100.0) for _ in range(3)]
    alpha = combination_weights(far, [1e-3] * 4, 0)
    assert alpha.tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("failure", ["not converged", "nan"])
def test_no_solution_keeps_the_clients_own_classifier(monkeypatch, failure):
    def broken(p, *args, **kwargs):
        n = p.shape[0]
        if failure == "nan":
            return SimplexQPResult(torch.full((n,), float("nan"), dtype=torch.float64), float("nan"), 1, True)
        return SimplexQPResult(torch.full((n,), 1.0 / n, dtype=torch.float64), 0.0, 1000, False)

    monkeypatch.setattr(fedpac_module, "solve_simplex_qp", broken)
    h, v = golden_statistics()
    assert combination_weights(h, v, 2).tolist() == [0.0, 0.0, 1.0, 0.0]


# ------------------------------------------------------------------ client hooks
def client_context(algo, server, client: int):
    """Client ``client``'s context whose ``features`` give the pinned features under the received
    model and the shifted ones ("after training") under any other encoder."""
    payload = algo.payload(server, client)
    ctx = context(client, payload, algo.init_client_state(client, server))

    def feats(state):
        trained = not torch.equal(state["encoder.weight"], payload["encoder.weight"])
        return features(client, shift=0.5 if trained else 0.0)

    ctx.features = feats
    return ctx


def test_client_statistics_before_training_and_centroids_after():
    setup = net5_setup()
    algo = build_algorithm("fedpac", {}, setup)
    server = algo.init_server(initial_state(setup))
    for c in range(4):
        ctx = client_context(algo, server, c)
        ctx.extras = algo.begin(ctx)
        assert float(ctx.extras["v"]) == pytest.approx(V[c], rel=1e-6)
        assert torch.allclose(ctx.extras["h"], torch.tensor(H[c], dtype=torch.float64), atol=1e-6)
        local = dict(algo.start_state(ctx))
        local["encoder.weight"] = local["encoder.weight"] + 1.0  # "trained"
        upload, _ = algo.finish(ctx, local, steps=1)
        counts, means = class_means(*features(c, shift=0.5), C)
        assert upload[COUNTS].dtype == upload[CENTROID_SUMS].dtype == torch.float64  # additive, exact counts
        assert torch.equal(upload[COUNTS], counts.double()) and CENTROIDS not in upload
        assert torch.allclose(upload[CENTROID_SUMS], counts.double().unsqueeze(1) * means.double(), atol=1e-5)
        assert torch.equal(upload["fedpac.h"], ctx.extras["h"])  # statistics of the received model
        assert torch.equal(upload["encoder.weight"], local["encoder.weight"])


def golden_centroids_context():
    """FedPAC on Net5 with the server's golden centroids for classes 0 and 2 (none for class 1): client 1's
    context."""
    setup = net5_setup()
    algo = build_algorithm("fedpac", {}, setup)
    server = algo.init_server(initial_state(setup))
    server.extra[CENTROIDS] = torch.tensor(CENTROIDS_GOLDEN)
    server.extra[HAS_CENTROID] = torch.tensor([1.0, 0.0, 1.0])
    return algo, client_context(algo, server, 1)


def test_alignment_targets_global_centroids_else_own_class_means():
    algo, ctx = golden_centroids_context()
    extras = algo.begin(ctx)
    _, own = class_means(*features(1), C)
    assert torch.equal(extras["target"][0], torch.tensor(CENTROIDS_GOLDEN[0]))
    assert torch.equal(extras["target"][1], own[1])  # no global centroid of class 1
    assert torch.equal(extras["target"][2], torch.tensor(CENTROIDS_GOLDEN[2]))
    assert float(extras["align"]) == 1.0


def test_alignment_loss_value():
    setup = net5_setup()
    algo = build_algorithm("fedpac", {"lam": 2.5}, setup)
    state = initial_state(setup)
    x = torch.linspace(-1, 2, 24).reshape(6, 4)
    y = torch.tensor([0, 0, 0, 1, 2, 2])  # unbalanced: a permutation of the targets changes the loss
    targets = torch.tensor(CENTROIDS_GOLDEN)
    ctx = context(0, {})
    ctx.extras = {"target": targets, "align": torch.tensor(1.0)}
    loss, info = algo.alignment_loss(state, Batch(x, y), ctx)
    z, logits = setup.model.features_and_logits(state, x)
    ce = F.cross_entropy(logits, y)
    align = ((z - targets[y]) ** 2).sum(1).mean() / D  # (1/n) sum_l (1/d) ||f(x_l) - c_{y_l}||^2
    assert float(loss) == pytest.approx(float(ce + 2.5 * align), rel=1e-6)
    assert float(info["alignment"]) == pytest.approx(float(align), rel=1e-6)
    ctx.extras["align"] = torch.tensor(0.0)  # first round: no centroids yet
    assert float(algo.alignment_loss(state, Batch(x, y), ctx)[0]) == pytest.approx(float(ce), rel=1e-6)


def test_stages_train_head_then_encoder_with_alignment_off_until_centroids_exist():
    setup = tiny_setup()
    algo = build_algorithm("fedpac", {"lam": 2.0}, setup)
    server = algo.init_server(initial_state(setup))
    ctx = context(0, algo.payload(server, 0), algo.init_client_state(0, server))
    ctx.features = lambda state: (setup.model.module.features(torch.randn(6, 4)).detach(), torch.tensor([0, 1, 2] * 2))
    ctx.extras = algo.begin(ctx)
    head, encoder = algo.stages(ctx)
    assert head.name == "classifier" and encoder.name == "encoder"
    assert set(head.trainable) == {"classifier.weight", "classifier.bias"}
    assert (head.sgd.lr, head.sgd.momentum, head.sgd.weight_decay, head.epochs) == (0.1, 0.5, 5e-4, 1)
    assert set(encoder.trainable) == set(setup.model.param_names) - set(head.trainable)
    assert encoder.loss == algo.alignment_loss and head.loss != algo.alignment_loss
    assert ctx.extras["align"] == 0  # no global centroids in the first round


# ------------------------------------------------------------------ server aggregation
def golden_uploads(setup: Setup, server) -> list[Upload]:
    uploads = []
    for c in range(4):
        counts, sums = class_sums(*features(c, shift=0.5), C)
        h, v = feature_statistics(*features(c), C)
        encoder = {n: server.model[n] + c for n in setup.model.state_names if n.startswith("encoder.")}
        tensors = {**encoder, **heads(c), COUNTS: counts, CENTROID_SUMS: sums, "fedpac.h": h,
                   "fedpac.v": torch.tensor(v)}
        uploads.append(Upload(c, tensors, len(LABELS[c]), 1))
    return uploads


def test_class_sums_stay_on_the_features_device_whatever_torchs_default_device():
    """With another default device ("meta" standing in for a user's CUDA default) the uploads of CPU features
    are made on the CPU, with the same values."""
    z, y = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 8.0]]), torch.tensor([0, 0, 2])
    with torch.device("meta"):
        counts, sums = class_sums(z, y, 3)
    assert (counts.device.type, sums.device.type) == ("cpu", "cpu")
    torch.testing.assert_close(sums, torch.tensor([[4.0, 6.0], [0.0, 0.0], [5.0, 8.0]], dtype=torch.float64))


def test_aggregation_matches_the_authors_centroids_and_personalised_heads():
    setup = net5_setup()
    algo = build_algorithm("fedpac", {}, setup)
    server = algo.init_server(initial_state(setup))
    new = algo.aggregate(server, golden_uploads(setup, server), 1)
    assert torch.allclose(new.extra[CENTROIDS], torch.tensor(CENTROIDS_GOLDEN), atol=1e-6)
    assert new.extra[HAS_CENTROID].tolist() == [1.0, 1.0, 1.0]
    assert new.extra[HAS_CENTROID].dtype == server.extra[HAS_CENTROID].dtype  # float flags, as checkpointed
    for c in range(4):
        assert torch.allclose(new.extra[f"head.{c}/classifier.weight"], torch.tensor(HEAD_W[c]), atol=2e-6), c
        assert torch.allclose(new.extra[f"head.{c}/classifier.bias"], torch.tensor(HEAD_B[c]), atol=2e-6), c
    sizes = torch.tensor([float(len(y)) for y in LABELS])
    shift = float((sizes * torch.arange(4.0)).sum() / sizes.sum())  # data-size-weighted encoder
    assert torch.allclose(new.model["encoder.weight"], server.model["encoder.weight"] + shift, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), clients=st.integers(1, 5), d=st.integers(1, 6),
       sizes=st.lists(st.sampled_from([0, 1, 2, 3, 17, 40]), min_size=4, max_size=4))
def test_centroids_from_summed_sums_equal_the_count_weighted_mean_of_client_centroids(seed, clients, d, sizes):
    """The additive upload (per-class counts and feature sums) gives the centroids of the authors'
    ``protos_aggregation``: ``sum_i n_ik c_ik / sum_i n_ik`` over the clients holding class k, with ``c_ik`` the
    client's class mean (float64 here); classes no client holds have none. Summing two clients' uploads first
    gives the same centroids (what a secure aggregation hands the server).

    Tolerance: 8 eps max_l ||z_l||_inf over the class's features (float64 rounding of the same sums in another
    order, as tests/algorithms/test_gaussian_stats.py measures for the means: up to 0.8 units); a client left out
    moves a centroid by the difference of class means, 1e14 units and more."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(len(sizes)).repeat_interleave(torch.tensor(sizes, dtype=torch.long))
    z = (torch.randn(len(y), d, generator=gen) * 3 + 5 * torch.randn(len(sizes), d, generator=gen)[y])
    owner = torch.randint(0, clients, (len(y),), generator=gen)
    parts = [class_sums(z[owner == k], y[owner == k], len(sizes)) for k in range(clients)]
    got, has = global_centroids([n for n, _ in parts], [s for _, s in parts])
    assert has.tolist() == [n > 0 for n in sizes]
    means = [class_means(z[owner == k].double(), y[owner == k], len(sizes)) for k in range(clients)]
    counts = torch.stack([n for n, _ in means])
    total = counts.sum(0)
    want = (counts.unsqueeze(2) * torch.stack([m for _, m in means])).sum(0) / total.clamp(min=1).unsqueeze(1)
    merged = [parts[0][0] + parts[-1][0]], [parts[0][1] + parts[-1][1]]
    for k in range(len(sizes)):
        if sizes[k] == 0:
            assert torch.count_nonzero(got[k]) == 0
            continue
        unit = torch.finfo(torch.float64).eps * float(z[y == k].abs().max())
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=8 * unit)
    if clients == 2:  # two clients' uploads summed into one: the same sums, the same centroids
        assert torch.equal(global_centroids(*merged)[0], got)


def test_round_trip_of_personalised_heads_and_centroids():
    setup = tiny_setup(num_clients=2)
    algo = build_algorithm("fedpac", {}, setup)
    server = algo.init_server(initial_state(setup))
    assert server.extra[HAS_CENTROID].sum() == 0
    uploads = []
    for c, shift in ((0, 0.0), (1, 5.0)):
        local = perturbed(server.model, 0.3, c)
        counts = torch.tensor([4.0 + 8 * c, 0.0, 2.0])
        cents = torch.full((3, 8), shift)
        tensors = {**{n: local[n] for n in setup.model.state_names}, COUNTS: counts,
                   CENTROID_SUMS: counts.unsqueeze(1) * cents,
                   "fedpac.h": torch.rand(3, 8, dtype=torch.float64), "fedpac.v": torch.tensor(0.1)}
        uploads.append(Upload(c, tensors, 10 * (c + 1), 3))
    new = algo.aggregate(server, uploads, 1)
    assert new.extra[HAS_CENTROID].tolist() == [1.0, 0.0, 1.0]
    assert torch.allclose(new.extra[CENTROIDS][0], torch.full((8,), 5.0 * 12 / 16))  # weighted by class counts
    for c in (0, 1):
        head = new.extra[f"head.{c}/classifier.weight"]
        lo = torch.minimum(uploads[0].tensors["classifier.weight"], uploads[1].tensors["classifier.weight"])
        hi = torch.maximum(uploads[0].tensors["classifier.weight"], uploads[1].tensors["classifier.weight"])
        assert ((head >= lo - 1e-6) & (head <= hi + 1e-6)).all()  # a convex combination of the uploaded heads
    payload = algo.payload(new, 1)
    assert "fedpac.head/classifier.weight" in payload and "classifier.weight" not in payload
    state = algo.start_state(context(1, payload, algo.init_client_state(1, new)))
    assert torch.equal(state["classifier.weight"], new.extra["head.1/classifier.weight"])
    assert torch.equal(algo.client_model(new, {}, 1)["classifier.weight"], new.extra["head.1/classifier.weight"])


# ------------------------------------------------------------------ details the golden cases above leave open
def test_statistics_of_one_sample_and_of_thirds_by_hand():
    # one sample: pi = 1, h = its features at its class, no variance left
    h, v = feature_statistics(torch.tensor([[3.0, 4.0]], dtype=torch.float64), torch.tensor([1]), num_classes=2)
    assert h.tolist() == [[0.0, 0.0], [3.0, 4.0]] and v == 0.0
    # n = 3: pi = (2/3, 1/3) is not a float32 number, so the statistics must stay in float64 throughout
    z = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 3.0]], dtype=torch.float64)
    y = torch.tensor([0, 0, 1])
    counts, _ = class_means(z, y, 2)
    assert counts.dtype == torch.float64 and counts.tolist() == [2.0, 1.0]
    h, v = feature_statistics(z, y, num_classes=2)
    # mu = (1.5, 0), (0, 3); tr E[zz^T|k] = 2.5, 9; v = [(2/3 2.5 + 1/3 9) - (4/9 2.25 + 1/9 9)] / 3 = 8/9
    assert v == pytest.approx(8 / 9, rel=1e-14)
    assert torch.allclose(h, torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64), rtol=0, atol=1e-15)


def test_client_tensors_stay_on_the_features_device_not_torchs_default():
    """A CUDA run has its features on the GPU while torch's default device is the CPU; here the
    default device is switched to ``meta`` instead, so a tensor made without the features' (or
    the model's) device lands elsewhere and the arithmetic fails or moves off the inputs' device."""
    z = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [0.0, 2.0]])
    y = torch.tensor([0, 0, 1, 1])
    setup = net5_setup()
    algo = build_algorithm("fedpac", {}, setup)
    state = initial_state(setup)
    with torch.device("meta"):
        counts, means = class_means(z, y, 3)
        h, v = feature_statistics(z, y, num_classes=3)
        server = algo.init_server(state)
    assert counts.device.type == means.device.type == h.device.type == "cpu"
    assert means.tolist() == [[2.0, 0.0], [0.0, 2.0], [0.0, 0.0]] and v == pytest.approx(2.5 / 4)
    assert server.extra[CENTROIDS].device.type == server.extra[HAS_CENTROID].device.type == "cpu"


def test_begins_extras_are_made_on_the_features_device_not_torchs_default():
    """Step 1's extras (``v`` and the alignment switch are made from Python floats) on the features' device,
    with torch's default device switched to ``meta`` (standing in for a CUDA run's CPU default): a tensor made
    without the features' device lands on ``meta`` and a step could not read it with the CPU batch."""
    algo, ctx = golden_centroids_context()
    pinned = features(1)  # made here: under "meta" the pinned input itself would be made there
    ctx.features = lambda state: pinned
    with torch.device("meta"):
        extras = algo.begin(ctx)
    assert {k: t.device.type for k, t in extras.items()} == {"h": "cpu", "v": "cpu", "target": "cpu", "align": "cpu"}
    assert float(extras["v"]) == pytest.approx(V[1], rel=1e-6) and float(extras["align"]) == 1.0


def test_first_round_server_state_payload_and_client_start():
    setup = net5_setup()
    algo = build_algorithm("fedpac", {}, setup)
    server = algo.init_server(initial_state(setup))
    assert server.extra[CENTROIDS].shape == (C, D) and not server.extra[CENTROIDS].any()
    assert server.extra[HAS_CENTROID].shape == (C,) and not server.extra[HAS_CENTROID].any()
    own = {"fedpac.local_head/classifier.weight": torch.full((C, D), 7.0),
           "fedpac.local_head/classifier.bias": torch.full((C,), -7.0)}
    ctx = context(2, algo.payload(server, 2), own)  # no personalised head from the server yet
    state = algo.start_state(ctx)
    assert torch.equal(state["classifier.weight"], own["fedpac.local_head/classifier.weight"])
    assert torch.equal(state["classifier.bias"], own["fedpac.local_head/classifier.bias"])
    assert torch.equal(state["encoder.weight"], server.model["encoder.weight"])
    # evaluation of a client the server has not combined a head for: its own classifier
    model = algo.client_model(server, own, 2)
    assert torch.equal(model["classifier.weight"], own["fedpac.local_head/classifier.weight"])


def test_one_class_with_a_global_centroid_switches_alignment_on():
    setup = net5_setup()
    algo = build_algorithm("fedpac", {}, setup)
    server = algo.init_server(initial_state(setup))
    server.extra[HAS_CENTROID] = torch.tensor([0.0, 1.0, 0.0])
    server.extra[CENTROIDS][1] = 3.0
    extras = algo.begin(client_context(algo, server, 0))
    assert float(extras["align"]) == 1.0 and extras["target"][1].tolist() == [3.0] * D


def test_alignment_loss_logs_its_terms_by_name():
    setup = net5_setup()
    algo = build_algorithm("fedpac", {}, setup)
    state = initial_state(setup)
    x, y = torch.linspace(-1, 2, 12).reshape(3, 4), torch.tensor([0, 1, 2])
    ctx = context(0, {})
    ctx.extras = {"target": torch.tensor(CENTROIDS_GOLDEN), "align": torch.tensor(1.0)}
    _, info = algo.alignment_loss(state, Batch(x, y), ctx)
    _, logits = setup.model.features_and_logits(state, x)
    assert set(info) == {"ce", "alignment"}  # the names metrics.jsonl shows
    assert float(info["ce"]) == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-6)


def test_stages_take_their_settings_from_the_options_and_the_round():
    setup = tiny_setup(local_epochs=3, local_steps=5, momentum=0.7)
    algo = build_algorithm("fedpac", {"head_epochs": 2}, setup)
    server = algo.init_server(initial_state(setup))
    ctx = context(0, algo.payload(server, 0), algo.init_client_state(0, server), lr=0.037)  # a decayed lr
    head, encoder = algo.stages(ctx)
    assert head.epochs == 2
    assert (encoder.epochs, encoder.steps) == (3, 5)
    assert (encoder.sgd.lr, encoder.sgd.momentum, encoder.sgd.weight_decay) == (0.037, 0.7, setup.train.weight_decay)
    # the classifier stage minimises plain cross-entropy
    state = initial_state(setup)
    x, y = torch.linspace(-1, 1, 12).reshape(3, 4), torch.tensor([2, 0, 1])
    loss, _ = head.loss(state, Batch(x, y), ctx)
    with torch.no_grad():
        expected = F.cross_entropy(setup.model.module(x), y)
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    # no classifier stage at all with head_epochs = 0
    only = build_algorithm("fedpac", {"head_epochs": 0}, setup).stages(ctx)
    assert [s.name for s in only] == ["encoder"]


def test_uploads_from_finish_aggregate_to_the_golden_heads():
    setup = net5_setup()
    algo = build_algorithm("fedpac", {}, setup)
    server = algo.init_server(initial_state(setup))
    uploads = []
    for c in range(4):
        ctx = client_context(algo, server, c)
        ctx.extras = algo.begin(ctx)
        local = {**algo.start_state(ctx), **heads(c)}
        upload, _ = algo.finish(ctx, local, steps=1)
        assert float(upload["fedpac.v"]) == pytest.approx(V[c], rel=1e-6)
        uploads.append(Upload(c, upload, len(LABELS[c]), 1))
    new = algo.aggregate(server, uploads, 1)
    for c in range(4):
        assert torch.allclose(new.extra[f"head.{c}/classifier.weight"], torch.tensor(HEAD_W[c]), atol=2e-6), c


def test_a_class_seen_once_has_a_global_centroid():
    setup = tiny_setup(num_clients=2)
    algo = build_algorithm("fedpac", {}, setup)
    server = algo.init_server(initial_state(setup))
    uploads = []
    for c, counts in ((0, [1.0, 0.0, 2.0]), (1, [0.0, 0.0, 3.0])):
        tensors = {**{n: server.model[n] for n in setup.model.state_names}, COUNTS: torch.tensor(counts),
                   CENTROID_SUMS: torch.tensor(counts).unsqueeze(1) * (2.0 + c) * torch.ones(3, 8),
                   "fedpac.h": torch.rand(3, 8, dtype=torch.float64),
                   "fedpac.v": torch.tensor(0.1)}
        uploads.append(Upload(c, tensors, 10, 1))
    new = algo.aggregate(server, uploads, 1)
    assert new.extra[HAS_CENTROID].tolist() == [1.0, 0.0, 1.0]
    assert new.extra[CENTROIDS][0].tolist() == [2.0] * 8  # client 0's single sample of class 0
    assert torch.allclose(new.extra[CENTROIDS][2], torch.full((8,), (2 * 2.0 + 3 * 3.0) / 5))


class BNNet5(Net5):
    """Net5 with a batch-norm layer in the encoder: float buffers and an integer step counter."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, D), nn.BatchNorm1d(D))


def test_aggregation_keeps_each_tensors_dtype():
    model = BNNet5().double()
    names = [n for n, _ in model.named_parameters()]
    groups = {part: [n for n in names if n.startswith(part + ".")] for part in ("encoder", "classifier")}
    setup = Setup(ModelCaller(model), groups, num_clients=4, num_classes=C, client_sizes=[len(y) for y in LABELS],
                  train=TrainConfig(), seed=0)
    algo = build_algorithm("fedpac", {}, setup)
    server = algo.init_server(initial_state(setup))
    uploads = []
    for c, up in enumerate(golden_uploads(setup, server)):
        tensors = {**up.tensors, **{n: t.double() for n, t in heads(c).items()},
                   "encoder.1.num_batches_tracked": torch.tensor(8 * (c + 1))}
        uploads.append(Upload(c, tensors, up.num_samples, 1))
    new = algo.aggregate(server, uploads, 1)
    assert new.model["encoder.1.num_batches_tracked"].dtype == torch.int64
    # an integer buffer is a counter: the most advanced one, as FedAvg's weighted_mean (not a truncated mean: 19)
    assert int(new.model["encoder.1.num_batches_tracked"]) == 32
    sizes = torch.tensor([float(len(y)) for y in LABELS], dtype=torch.float64)
    shift = float((sizes * torch.arange(4.0, dtype=torch.float64)).sum() / sizes.sum())
    weight = new.model["encoder.0.weight"]
    assert weight.dtype == torch.float64
    assert torch.allclose(weight, server.model["encoder.0.weight"] + shift, atol=1e-6)
    assert new.extra["head.0/classifier.weight"].dtype == torch.float64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_aggregation_follows_the_uploads_device():
    """Uploaded models on the GPU, sizes and QP weights made on the CPU: the weights must be moved
    to the uploads' device; the encoder mean and the personalised heads stay there. (``meta`` could
    stand in for the GPU, but its first ``torch.stack`` costs ~14 s of imports.)"""
    setup = net5_setup()
    algo = build_algorithm("fedpac", {}, setup)
    server = algo.init_server(initial_state(setup))
    uploads = []
    for up in golden_uploads(setup, server):
        tensors = {n: (t.to("cuda") if n in setup.model.state_names else t) for n, t in up.tensors.items()}
        uploads.append(Upload(up.client_id, tensors, up.num_samples, 1))
    new = algo.aggregate(server, uploads, 1)
    assert new.model["encoder.weight"].device.type == "cuda"
    for c in range(4):
        head = new.extra[f"head.{c}/classifier.weight"]
        assert head.device.type == "cuda" and torch.allclose(head.cpu(), torch.tensor(HEAD_W[c]), atol=2e-6), c
    assert torch.allclose(new.extra[CENTROIDS], torch.tensor(CENTROIDS_GOLDEN), atol=1e-6)


def indefinite_uploads(setup: Setup, server) -> list[Upload]:
    """Client 1's statistics close to client 0's and a (rounding-like) negative variance: client 0's
    QP matrix has eigenvalues -0.0027 and 0.004, client 1's -0.003 (the others are PSD)."""
    h, _ = golden_statistics(scale=0.05)
    h[1] = h[0] + 0.01 * torch.arange(C * D, dtype=torch.float64).reshape(C, D) / (C * D)
    v = [0.004, -0.003, 0.02, 0.03]
    uploads = golden_uploads(setup, server)
    for c, up in enumerate(uploads):
        up.tensors.update({"fedpac.h": h[c], "fedpac.v": torch.tensor(v[c])})
    return uploads


def combined(uploads: list[Upload], alpha: torch.Tensor) -> torch.Tensor:
    return sum(float(a) * u.tensors["classifier.weight"] for a, u in zip(alpha, uploads, strict=True))


def test_eigenvalue_floor_and_weight_threshold_options_reach_the_server():
    setup = net5_setup()
    # default floor 0.01 drops client 0's eigenvalue 0.004 as well: it keeps its own classifier
    algo = build_algorithm("fedpac", {}, setup)
    server = algo.init_server(initial_state(setup))
    uploads = indefinite_uploads(setup, server)
    new = algo.aggregate(server, uploads, 1)
    assert torch.allclose(new.extra["head.0/classifier.weight"], heads(0)["classifier.weight"], atol=1e-7)
    # floor 0 keeps it: client 0 now leans on client 1's classifier
    algo = build_algorithm("fedpac", {"qp_eig_floor": 0.0}, setup)
    new = algo.aggregate(server, uploads, 1)
    h, v = [u.tensors["fedpac.h"] for u in uploads], [float(u.tensors["fedpac.v"]) for u in uploads]
    alpha = combination_weights(h, v, 0, eig_floor=0.0)
    assert 0.9 < float(alpha[1]) < 1.0
    assert torch.allclose(new.extra["head.0/classifier.weight"], combined(uploads, alpha), atol=1e-6)
    # min_weight = 0 keeps client 2's weight 6.9e-4 on client 3 that the default 1e-3 removes
    algo = build_algorithm("fedpac", {"min_weight": 0.0}, setup)
    uploads = golden_uploads(setup, server)
    new = algo.aggregate(server, uploads, 1)
    h, v = golden_statistics()
    alpha = combination_weights(h, v, 2, min_weight=0.0)
    assert float(alpha[3]) > 5e-4
    assert torch.allclose(new.extra["head.2/classifier.weight"], combined(uploads, alpha), atol=1e-6)
    assert not torch.allclose(new.extra["head.2/classifier.weight"], torch.tensor(HEAD_W[2]), atol=1e-5)


def test_no_solution_fallback_is_float64_like_every_solution():
    h, v = golden_statistics()
    assert combination_weights(h, v, 0).dtype == torch.float64
    fallback = combination_weights(h, v, 0, min_weight=0.9)  # no weight survives the threshold
    assert fallback.dtype == torch.float64 and fallback.tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("bad", ["nan_v", "inf_h"])
def test_non_finite_statistics_fall_back_to_the_clients_own_head(bad):
    """A client whose variance or feature means are not finite gives no QP (eigh and LAPACK fail on them):
    every client's combination is then its own head, as the authors' code does when there is no solution."""
    h = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0])]
    v = [0.5, 0.5, 0.5]
    if bad == "nan_v":
        v[1] = float("nan")
    else:
        h[2] = torch.tensor([float("inf"), 0.0])
    for i in range(3):
        alpha = combination_weights(h, v, i)
        assert torch.equal(alpha, torch.nn.functional.one_hot(torch.tensor(i), 3).double()), (bad, i)


# ------------------------------------------------------------------ a client that has not taken part yet
def aggregated_round(first_head: str | None):
    """FedPAC (``first_head`` as given, else the default) after a round of clients 0 and 1 of 4, whose uploaded
    classifiers differ from the initial one: (algorithm, initial state, server after the round)."""
    setup = tiny_setup(num_clients=4)
    algo = build_algorithm("fedpac", {} if first_head is None else {"first_head": first_head}, setup)
    init = initial_state(setup)
    server = algo.init_server({n: t.clone() for n, t in init.items()})
    uploads = []
    for c in (0, 1):
        local = perturbed(server.model, 0.3, c)
        counts = torch.tensor([4.0 + 8 * c, 0.0, 2.0])
        tensors = {**{n: local[n] for n in setup.model.state_names}, COUNTS: counts,
                   CENTROID_SUMS: counts.unsqueeze(1) * torch.full((3, 8), 1.0 + c),
                   "fedpac.h": torch.rand(3, 8, dtype=torch.float64), "fedpac.v": torch.tensor(0.1)}
        uploads.append(Upload(c, tensors, 10 * (c + 1), 3))
    return algo, init, algo.aggregate(server, uploads, 1)


@pytest.mark.parametrize("first_head", [None, "initial", "server"])
def test_a_client_that_has_not_taken_part_starts_and_is_evaluated_with_the_chosen_head(first_head):
    """Authors' code (JianXu95/FedPAC, federated_main.py: every client's local model a copy of the initial
    model; running.py: the global encoder sent to all clients, a classifier only to the round's participants):
    a client that has not trained keeps the initial classifier ("initial", the default). "server": the
    server model's classifier, the data-size-weighted mean of the last round's uploaded ones."""
    algo, init, server = aggregated_round(first_head)
    heads = algo.head_names
    expected = init if first_head in (None, "initial") else server.model
    other = server.model if first_head in (None, "initial") else init
    for n in heads:  # the two choices differ here: the check can fail
        assert not torch.allclose(server.model[n], init[n]), n
    own = algo.init_client_state(3, server)
    state = algo.start_state(context(3, algo.payload(server, 3), own))
    evaluated = algo.client_model(server, own, 3)
    for n in heads:
        assert torch.equal(state[n], expected[n]) and not torch.equal(state[n], other[n]), n
        assert torch.equal(evaluated[n], expected[n]), n
    for n in algo.encoder_names():  # the encoder is the global one in both
        assert torch.equal(state[n], server.model[n]) and torch.equal(evaluated[n], server.model[n]), n


def test_the_initial_head_is_kept_in_the_server_state_and_not_aliased_to_the_model():
    """Kept in ``ServerState.extra`` (checkpointed with it), as a copy: a later change of the server model's
    tensors in place does not move it."""
    setup = tiny_setup(num_clients=4)
    algo = build_algorithm("fedpac", {}, setup)
    init = initial_state(setup)
    server = algo.init_server(init)
    kept = {k: v for k, v in server.extra.items() if k.startswith("fedpac.initial_head/")}
    assert set(kept) == {f"fedpac.initial_head/{n}" for n in algo.head_names}
    before = {k: v.clone() for k, v in kept.items()}
    for n in algo.head_names:
        init[n].add_(1.0)
    assert all(torch.equal(kept[k], before[k]) for k in kept)
    server_mode = build_algorithm("fedpac", {"first_head": "server"}, setup).init_server(initial_state(setup))
    assert not any(k.startswith("fedpac.initial_head/") for k in server_mode.extra)  # as before the setting


def test_first_head_is_validated_naming_the_key():
    with pytest.raises(ConfigError, match=r"algorithm\.first_head.*'global'.*initial.*server"):
        build_algorithm("fedpac", {"first_head": "global"}, tiny_setup(num_clients=4))
