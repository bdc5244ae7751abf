"""What a server that received a client's reply over a network (Flower) accepts before a method reads it:
CCVR's ``check_reply`` (its statistics in the clear, under differential privacy, the oracle's features) and the
set-up rounds' ``check_setup_reply`` (FedMix's averaged data, FedBR's pseudo-data). The replies the clients make
pass; each way a reply can be malformed is refused naming what is wrong (the server then leaves that client
out: tests/flower/test_server_replies.py)."""

from __future__ import annotations

import pytest
import torch

from hetfl import config
from hetfl.algorithms.base import without_feature_transforms
from hetfl.engine.experiment import Experiment
from tests.helpers import needs_accountant

SMALL = ["data.num_clients=3", "data.partition=dirichlet", "data.alpha=0.1", "train.rounds=1",
         "train.batch_size=16", "model.options={hidden = [8]}", "runtime.progress=false", "runtime.threads=1"]
DIM, CLASSES = 8, 10


def replies(*overrides: str):
    """(the CCVR step, the model it queried, every client's reply) of a fresh FedAvg + CCVR run's start."""
    exp = Experiment(config.load(None, [*SMALL, "algorithm.name=fedavg+ccvr", *overrides]))
    step, raw = exp.posthoc[0], without_feature_transforms(exp.initial_server().model)
    out = {}
    for c in range(3):
        features, labels = exp.client_features(raw, c)
        out[c] = step.client_query(raw, features, labels, client=c, round_=1)
    return step, raw, out


@pytest.fixture(scope="module")
def clear():
    return replies()


def refused(step, raw, reply, why: str) -> None:
    with pytest.raises(ValueError) as err:
        step.check_reply(reply, raw)
    assert str(err.value) == why


def test_the_replies_clients_make_in_the_clear_pass(clear):
    step, raw, got = clear
    assert raw["classifier.weight"].shape == (CLASSES, DIM)
    assert any(len(r["classes"]) < CLASSES for r in got.values())  # a client without some classes
    for reply in got.values():
        step.check_reply(reply, raw)


def test_a_reply_in_the_clear_with_another_form_is_refused_naming_it(clear):
    step, raw, got = clear
    reply = got[0]
    held = len(reply["classes"])
    refused(step, raw, {k: v for k, v in reply.items() if k != "outer"}, "the reply lacks 'outer'")
    refused(step, raw, {k: v for k, v in reply.items() if k != "classes"}, "the reply lacks 'classes'")
    refused(step, raw, {**{k: v for k, v in reply.items() if k != "outer"}, "extra": torch.zeros(1)},
            "the reply lacks 'outer'; has 'extra', which is no part of it")
    refused(step, raw, {**reply, "extra": torch.zeros(1)}, "the reply has 'extra', which is no part of it")
    refused(step, raw, {**reply, "classes": reply["classes"].double()},
            f"'classes' must be a 1-D tensor of torch.int64 class indices, not torch.float64 of shape [{held}]")
    refused(step, raw, {**reply, "classes": reply["classes"][None]},
            f"'classes' must be a 1-D tensor of torch.int64 class indices, not torch.int64 of shape [1, {held}]")
    bad = reply["classes"].clone()
    bad[-1] = CLASSES
    refused(step, raw, {**reply, "classes": bad},
            f"'classes' holds {int(bad.min())}..{CLASSES}, outside the classes 0..{CLASSES - 1}")
    bad[-1] = -1
    refused(step, raw, {**reply, "classes": bad}, f"'classes' holds -1..{int(bad.max())}, outside the classes 0..9")
    twice = reply["classes"].clone()
    twice[-1] = twice[0]
    refused(step, raw, {**reply, "classes": twice}, "'classes' names a class more than once")
    refused(step, raw, {**reply, "sums": reply["sums"][:, :-1]},
            f"'sums' has shape [{held}, {DIM - 1}], expected [{held}, {DIM}]")
    refused(step, raw, {**reply, "outer": reply["outer"][:-1]},
            f"'outer' has shape [{held - 1}, {DIM}, {DIM}], expected [{held}, {DIM}, {DIM}]")
    refused(step, raw, {**reply, "counts": reply["counts"].float()},
            "'counts' is torch.float32, expected torch.float64")
    nan = reply["sums"].clone()
    nan[0, 0] = float("nan")
    refused(step, raw, {**reply, "sums": nan}, "'sums' holds values that are not finite")
    for counts in (reply["counts"] - reply["counts"] + 0.5, reply["counts"] * 0):
        refused(step, raw, {**reply, "counts": counts},
                "'counts' must be whole numbers of at least 1 (the classes the client holds)")


@needs_accountant
def test_private_replies_hold_every_class_and_are_checked_so():
    step, raw, got = replies("algorithm.ccvr.dp_epsilon=4.0", "algorithm.ccvr.clip_norm=5.0")
    for reply in got.values():
        assert set(reply) == {"counts", "sums", "outer"}
        step.check_reply(reply, raw)
    reply = got[0]
    refused(step, raw, {**reply, "classes": torch.arange(CLASSES)},
            "the reply has 'classes', which is no part of it")
    refused(step, raw, {**reply, "counts": reply["counts"][:-1]},
            f"'counts' has shape [{CLASSES - 1}], expected [{CLASSES}]")
    refused(step, raw, {**reply, "outer": reply["outer"][..., :-1]},
            f"'outer' has shape [{CLASSES}, {DIM}, {DIM - 1}], expected [{CLASSES}, {DIM}, {DIM}]")
    step.check_reply({**reply, "counts": reply["counts"] - 100.5}, raw)  # noisy counts: any finite value


def test_the_oracles_features_and_labels_are_checked():
    step, raw, got = replies("algorithm.ccvr.oracle=all")
    for reply in got.values():
        step.check_reply(reply, raw)
    reply = got[0]
    rows = len(reply["labels"])
    refused(step, raw, {**reply, "features": reply["features"][:, :-1]},
            f"'features' has shape [{rows}, {DIM - 1}], expected [{rows}, {DIM}]")
    refused(step, raw, {**reply, "labels": reply["labels"][:-1]}, f"'features' has shape [{rows}, {DIM}], expected "
                                                                  f"[{rows - 1}, {DIM}]")
    refused(step, raw, {**reply, "features": reply["features"].double()},
            "'features' is torch.float64, expected torch.float32")
    refused(step, raw, {**reply, "labels": reply["labels"] + CLASSES},
            f"'labels' holds {int(reply['labels'].min()) + CLASSES}..{int(reply['labels'].max()) + CLASSES}, "
            f"outside the classes 0..{CLASSES - 1}")
    refused(step, raw, {"features": reply["features"]}, "the reply lacks 'labels'")


# ------------------------------------------------------------- the set-up rounds' replies (FedMix, FedBR)
def setup_replies(method: str, *overrides: str):
    exp = Experiment(config.load(None, [*SMALL, f"algorithm.name={method}", *overrides]))
    server = exp.initial_server()
    algo = exp.algorithm
    return algo, {c: algo.setup_query(exp.client_context(c, 0, 0.1, {}, {}, server)) for c in range(3)}


def setup_refused(algo, client, reply, why: str) -> None:
    with pytest.raises(ValueError) as err:
        algo.check_setup_reply(client, reply)
    assert str(err.value) == why


def test_fedmix_setup_replies_are_its_clients_averaged_data():
    algo, got = setup_replies("fedmix", "algorithm.mash_size=4")
    for c, reply in got.items():
        algo.check_setup_reply(c, reply)
        assert not algo.setup_reply_needed(c)  # the means of the clients that answered are shared
    x, y = got[0]["fedmix.x"], got[0]["fedmix.y"]
    groups = -(-algo.setup.client_sizes[0] // 4)
    assert x.shape == (groups, *algo.setup.input_shape) and y.shape == (groups, CLASSES)
    setup_refused(algo, 1, got[0], f"'fedmix.x' has shape {list(x.shape)}, expected "
                                   f"[{-(-algo.setup.client_sizes[1] // 4)}, {algo.setup.input_shape[0]}]")
    setup_refused(algo, 0, {**got[0], "fedmix.y": y * 2},
                  "'fedmix.y' must hold soft labels: rows of non-negative shares that sum to 1")
    negative = y.clone()
    negative[0, :2] = torch.tensor([-0.5, 0.5]) + negative[0, :2]
    setup_refused(algo, 0, {**got[0], "fedmix.y": negative},
                  "'fedmix.y' must hold soft labels: rows of non-negative shares that sum to 1")
    setup_refused(algo, 0, {"fedmix.x": x}, "the reply lacks 'fedmix.y'")
    algo.check_setup_reply(0, {**got[0], "fedmix.y": y * (1 + 1.5e-5)})  # float32 means: sums within 2e-5 of 1
    setup_refused(algo, 0, {**got[0], "fedmix.y": y * (1 + 3e-5)},
                  "'fedmix.y' must hold soft labels: rows of non-negative shares that sum to 1")


def test_fedbr_setup_replies_are_the_means_of_the_clients_slots_of_the_plan():
    algo, got = setup_replies("fedbr")
    slots = [sum(s.client == c for s in algo.plan()) for c in range(3)]
    for c, reply in got.items():
        assert len(reply["fedbr.pseudo"]) == slots[c]
        algo.check_setup_reply(c, reply)
    wrong = next(c for c in range(3) if slots[c] != slots[0])
    setup_refused(algo, wrong, got[0], f"'fedbr.pseudo' has shape [{slots[0]}, {algo.setup.input_shape[0]}], "
                                       f"expected [{slots[wrong]}, {algo.setup.input_shape[0]}]")
    setup_refused(algo, 0, {"fedbr.pseudo": got[0]["fedbr.pseudo"].double()},
                  "'fedbr.pseudo' is torch.float64, expected torch.float32")
    assert [algo.setup_reply_needed(c) for c in range(3)] == [n > 0 for n in slots]
    one, got_one = setup_replies("fedbr", "algorithm.num_pseudo=1")  # one slot: one client needed, two not
    holder = one.plan()[0].client
    assert [one.setup_reply_needed(c) for c in range(3)] == [c == holder for c in range(3)]
    assert [len(got_one[c]["fedbr.pseudo"]) for c in range(3)] == [int(c == holder) for c in range(3)]
    other, _ = setup_replies("fedbr", "algorithm.pseudo_source=per_client")
    assert not any(other.setup_reply_needed(c) for c in range(3))
    other.check_setup_reply(0, {})
    setup_refused(other, 0, got[0], "the reply has 'fedbr.pseudo', which is no part of it")


def test_a_form_with_several_allowed_dtypes_names_them_all():
    from hetfl.algorithms.base import check_reply_form

    dtypes = {"x": (torch.float32, torch.float64)}
    check_reply_form({"x": torch.zeros(2, dtype=torch.float64)}, {"x": (2,)}, dtypes)
    with pytest.raises(ValueError) as err:
        check_reply_form({"x": torch.zeros(2, dtype=torch.int64)}, {"x": (2,)}, dtypes)
    assert str(err.value) == "'x' is torch.int64, expected torch.float32 or torch.float64"
