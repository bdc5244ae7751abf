"""hetfl.engine.federation: the in-process clients' side of a round, checked against the pieces it is made of
(the method's hooks and ``train_client``), found by mutation testing (benchmarks/mutation.py, target
engine_federation): which clients train and in which order, with which state, what they upload and the bytes
sent down, the set-up round's replies, the post-hoc replies and the per-client accuracies."""

from __future__ import annotations

import pytest
import torch

from hetfl import config
from hetfl.engine.experiment import Experiment
from hetfl.engine.local import train_client
from hetfl.engine.messages import nbytes
from hetfl.engine.schedule import lr_at
from hetfl.engine.summary import Reporter

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ["data.num_clients=30", "data.options={max_samples = 80}", "train.batch_size=16", "train.local_steps=2",
         "runtime.progress=false", "model.options={hidden = [8]}"]


def experiment(*more: str) -> Experiment:
    return Experiment(config.load(None, [*SMALL, *more]))


def by_hand(exp: Experiment, server, clients, sampled, round_, lr):  # type: ignore[no-untyped-def]
    """The round's client side from the method's hooks: (client, upload, samples, steps, loss, parts, new state)."""
    algo, out = exp.algorithm, []
    for c in sampled:
        state = clients[c] if c in clients else algo.init_client_state(c, server)
        ctx = exp.client_context(c, round_, lr, algo.payload(server, c), state, server)
        result = train_client(algo, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
        upload, new_state = algo.finish(ctx, result.state, result.steps)
        out.append((c, upload, exp.data.client_sizes[c], result.steps, result.loss_sum, result.metric_sums, new_state))
    return out


@pytest.mark.parametrize("method", ["fedavg", "scaffold"])
def test_a_round_trains_the_sampled_clients_in_order_from_their_own_state(method):
    exp = experiment(f"algorithm.name={method}")
    server = exp.initial_server()
    clients: dict = {}
    updates, down = exp.federation.train(server, clients, [4, 1], 1, 0.05, Reporter())
    want = by_hand(exp, server, {}, [4, 1], 1, 0.05)
    assert down == sum(nbytes(exp.algorithm.payload(server, c)) for c in (4, 1)) > 0
    assert [u.client_id for u in updates] == [4, 1]
    for u, (c, upload, samples, steps, loss, parts, _) in zip(updates, want, strict=True):
        assert (u.num_samples, u.steps, u.loss_sum, u.part_sums) == (samples, steps, loss, parts) and steps == 2
        assert u.upload.keys() == upload.keys() and all(torch.equal(u.upload[k], upload[k]) for k in upload), c
    # a method with client state keeps what finish returned (SCAFFOLD's control variates); FedAvg keeps none
    assert sorted(clients) == ([1, 4] if method == "scaffold" else [])
    for c, *_, new_state in want:
        assert all(torch.equal(clients[c][k], new_state[k]) for k in new_state)
    # round 2: client 4 starts from the state it kept, client 0 from the method's initial one
    kept = {c: {k: v.clone() for k, v in s.items()} for c, s in clients.items()}
    updates, _ = exp.federation.train(server, clients, [0, 4], 2, 0.05, Reporter())
    again = by_hand(exp, server, kept, [0, 4], 2, 0.05)
    for u, (c, upload, *_) in zip(updates, again, strict=True):
        assert all(torch.equal(u.upload[k], upload[k]) for k in upload), c


def test_the_set_up_round_asks_every_client_at_round_0_with_round_1s_learning_rate():
    exp = experiment("algorithm.name=fedmix", "train.lr_schedule=cosine", "train.rounds=4")
    server = exp.initial_server()
    replies = exp.federation.setup_replies(server)
    assert sorted(replies) == list(range(30))
    for c in range(30):
        ctx = exp.client_context(c, 0, lr_at(exp.cfg, 1), {}, {}, server)
        want = exp.algorithm.setup_query(ctx)
        assert replies[c].keys() == want.keys() and all(torch.equal(replies[c][k], want[k]) for k in want), c


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_personal_models_are_evaluated_on_each_clients_own_test_split(executor):
    from hetfl.engine.evaluate import accuracy_and_loss

    exp = experiment("algorithm.name=local", f"runtime.executor={executor}", "runtime.vmap_on_cpu=true")
    server = exp.initial_server()
    clients: dict = {}
    exp.federation.train(server, clients, [0, 3], 1, 0.5, Reporter())  # two clients now hold their own models
    assert sorted(clients) == [0, 3]
    accs = exp.federation.client_accuracies(server, clients, 1, None)
    algo, data = exp.algorithm, exp.data
    want = {}
    for c in range(data.num_clients):
        test = data.client_tests[c]
        if len(test.y):
            model = algo.client_model(server, clients.get(c) or algo.init_client_state(c, server), c)
            want[c] = accuracy_and_loss(exp.caller, model, test.x, test.y, data, exp.cfg.train.eval_batch_size)[1]
    assert accs == pytest.approx(want, abs=1e-12)
    assert accs[0] != accs[1] or accs[3] != accs[1]  # the trained clients are evaluated with their own models


def per_client(exp: Experiment, server, clients) -> dict[int, float]:  # type: ignore[no-untyped-def]
    """Each client's evaluated model (the method's client_model) on its own test split, one by one."""
    from hetfl.engine.evaluate import accuracy_and_loss

    algo, data, want = exp.algorithm, exp.data, {}
    for c in range(data.num_clients):
        test = data.client_tests[c]
        if len(test.y):
            model = algo.client_model(server, clients.get(c) or algo.init_client_state(c, server), c)
            want[c] = accuracy_and_loss(exp.caller, model, test.x, test.y, data, exp.cfg.train.eval_batch_size)[1]
    return want


def test_the_global_models_accuracies_come_from_its_correctness_only_when_it_is_given_and_fits(monkeypatch):
    exp = experiment("algorithm.name=fedavg")
    server = exp.initial_server()
    want = per_client(exp, server, {})
    assert exp.federation.client_accuracies(server, {}, 1, None) == pytest.approx(want, abs=1e-12)  # not given
    correct = torch.rand(len(exp.data.test_y), generator=torch.Generator().manual_seed(0)) < 0.5
    monkeypatch.setattr(exp, "client_accuracy", lambda *a, **k: pytest.fail("per-client work for the global model"))
    got = exp.federation.client_accuracies(server, {}, 1, correct)  # given: from the correctness, no client's work
    assert got == exp.data.client_test_accuracies(correct)


def test_a_personalised_method_is_evaluated_with_its_own_models_even_given_the_global_correctness():
    exp = experiment("algorithm.name=local")
    server = exp.initial_server()
    clients: dict = {}
    exp.federation.train(server, clients, [0, 3], 1, 0.5, Reporter())
    everything_right = torch.ones(len(exp.data.test_y), dtype=torch.bool)
    accs = exp.federation.client_accuracies(server, clients, 1, everything_right)
    assert accs == pytest.approx(per_client(exp, server, clients), abs=1e-12) and min(accs.values()) < 1.0


def test_only_a_method_with_one_global_model_and_the_base_evaluation_hooks_is_evaluated_with_it():
    from hetfl.algorithms.base import Algorithm
    from hetfl.engine.federation import GLOBAL_EVAL_HOOKS, evaluates_with_global_model

    def method(personalized: bool, **hooks):  # type: ignore[no-untyped-def]
        cls = type("Method", (Algorithm,), {"personalized": personalized, **hooks})
        return object.__new__(cls)  # the test reads the class and the flag only

    assert evaluates_with_global_model(method(False))
    assert not evaluates_with_global_model(method(True))
    for hook in GLOBAL_EVAL_HOOKS:
        assert not evaluates_with_global_model(method(False, **{hook: lambda self, *a: None})), hook


def test_post_hoc_replies_are_each_clients_query_on_its_own_features_and_summed_only_under_secure_aggregation():
    from types import SimpleNamespace

    from hetfl.algorithms.base import without_feature_transforms

    exp = experiment("algorithm.name=fedavg+ccvr")
    raw = without_feature_transforms(exp.initial_server().model)
    calls = []

    def query(raw_, feats, labels, *, client, round_):  # type: ignore[no-untyped-def]
        calls.append((raw_, client, round_))
        want_feats, want_labels = exp.client_features(raw, client)
        assert torch.equal(feats, want_feats) and torch.equal(labels, want_labels)
        return {"n": torch.tensor([float(len(labels))])}

    step = SimpleNamespace(additive=True, client_query=query)  # additive, but no secure aggregation asked
    replies = exp.federation.posthoc_replies(step, raw, 7)
    assert type(replies) is dict and sorted(replies) == list(range(exp.data.num_clients))
    assert [(r is raw, c, rnd) for r, c, rnd in calls] == [(True, c, 7) for c in range(exp.data.num_clients)]
    assert all(float(replies[c]["n"]) == exp.data.client_sizes[c] for c in replies)


def test_the_set_up_rounds_context_is_round_0_with_round_1s_rate_and_nothing_received_yet(monkeypatch):
    exp = experiment("algorithm.name=fedmix", "train.lr_schedule=cosine", "train.rounds=4")
    seen = []
    monkeypatch.setattr(exp.algorithm, "setup_query", lambda ctx: seen.append(ctx) or {})
    exp.federation.setup_replies(exp.initial_server())
    assert [ctx.client_id for ctx in seen] == list(range(exp.data.num_clients))
    assert lr_at(exp.cfg, 1) != lr_at(exp.cfg, 2)
    assert {(ctx.round, ctx.lr, len(ctx.payload), len(ctx.state)) for ctx in seen} == {(0, lr_at(exp.cfg, 1), 0, 0)}
    assert all(isinstance(ctx.payload, dict) and isinstance(ctx.state, dict) for ctx in seen)


def test_a_stopped_phase_carries_its_message_what_was_received_and_what_was_refused():
    from hetfl.engine.federation import PhaseStopped

    stop = PhaseStopped("2 of 5 clients answered", received=["update"], refused={3: "ab12"})
    assert str(stop) == "2 of 5 clients answered" and stop.received == ["update"] and stop.refused == {3: "ab12"}
    assert (PhaseStopped("x").received, PhaseStopped("x").refused) == (None, None)


def test_deferred_personal_models_are_scored_in_one_batch_or_one_by_one_when_they_cannot_be(monkeypatch):
    from hetfl.engine import federation

    exp = experiment("algorithm.name=local", "runtime.executor=vectorized", "runtime.vmap_on_cpu=true")
    server = exp.initial_server()
    clients: dict = {}
    exp.federation.train(server, clients, [0, 3], 1, 0.5, Reporter())
    want = per_client(exp, server, clients)
    initialised, batches = [], []
    init = exp.algorithm.init_client_state
    monkeypatch.setattr(exp.algorithm, "init_client_state", lambda c, s: initialised.append(c) or init(c, s))
    batched = federation.accuracies_vectorized
    monkeypatch.setattr(federation, "accuracies_vectorized", lambda caller, states, *a: batches.append(len(states))
                        or batched(caller, states, *a))
    one_by_one = federation.accuracy_and_loss
    monkeypatch.setattr(federation, "accuracy_and_loss", lambda *a: pytest.fail("scored one by one"))
    assert exp.federation.client_accuracies(server, clients, 1, None) == pytest.approx(want, abs=1e-12)
    assert batches == [len(want)] and initialised == [c for c in range(exp.data.num_clients) if c not in (0, 3)]
    # models that cannot be stacked (accuracies_vectorized says None): each scored on its own
    monkeypatch.setattr(federation, "accuracies_vectorized", lambda *a: None)
    monkeypatch.setattr(federation, "accuracy_and_loss", one_by_one)
    assert exp.federation.client_accuracies(server, clients, 1, None) == pytest.approx(want, abs=1e-12)


def test_a_client_without_state_starts_from_the_methods_initial_state_for_that_client(monkeypatch):
    exp = experiment("algorithm.name=scaffold")
    server = exp.initial_server()
    asked = []
    init = exp.algorithm.init_client_state
    monkeypatch.setattr(exp.algorithm, "init_client_state", lambda c, s: asked.append(c) or init(c, s))
    clients: dict = {}
    exp.federation.train(server, clients, [4, 1], 1, 0.05, Reporter())
    exp.federation.train(server, clients, [0, 4], 2, 0.05, Reporter())
    assert asked == [4, 1, 0]


def test_models_fine_tuned_at_evaluation_are_tuned_in_the_round_evaluated():
    # the fine-tuning's batches come from the client's stream of that round (hetfl.rng): another round tunes
    # on other batches and scores otherwise
    exp = experiment("algorithm.name=fedavg_ft", "train.lr_schedule=cosine", "train.rounds=4")
    server = exp.initial_server()
    accs = {r: exp.federation.client_accuracies(server, {}, r, None) for r in (2, 3)}
    for r in (2, 3):
        want = {}
        for c in range(exp.data.num_clients):
            acc, _ = exp.client_accuracy(c, server, exp.algorithm.init_client_state(c, server), r)
            if acc is not None:
                want[c] = acc
        assert accs[r] == want
    assert accs[2] != accs[3]


def test_each_client_gets_its_own_payload():
    exp = experiment("algorithm.name=pfedhn")  # the server sends each client the model its embedding generates
    server = exp.initial_server()
    updates, _ = exp.federation.train(server, {}, [4, 1], 1, 0.05, Reporter())
    want = by_hand(exp, server, {}, [4, 1], 1, 0.05)
    for u, (c, upload, *_) in zip(updates, want, strict=True):
        assert all(torch.equal(u.upload[k], upload[k]) for k in upload), c
    p4, p1 = exp.algorithm.payload(server, 4), exp.algorithm.payload(server, 1)
    assert any(not torch.equal(p4[k], p1[k]) for k in p4)


def test_client_models_are_saved_only_in_the_rounds_asked(tmp_path):
    exp = experiment("algorithm.name=fedavg", "runtime.save_client_models=[2]")
    exp.run_dir = tmp_path
    server = exp.initial_server()
    exp.federation.train(server, {}, [4, 1], 1, 0.05, Reporter())
    assert not (tmp_path / "client_models").exists()
    exp.federation.train(server, {}, [4, 1], 2, 0.05, Reporter())
    assert [p.name for p in (tmp_path / "client_models").iterdir()] == ["round_0002.safetensors"]
