"""What a Flower node does not take from the server (issue 26, item 12): the paths it writes under (its state
folder confines them; a server-chosen root only where the node's environment trusts it) and the privacy it
requires (its own ``dp-epsilon``/``dp-delta``/``dp-noise-source`` floor wins over the server's configuration).
Node code called directly, no Ray, no processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason='Flower is not installed: pip install "hetfl[flower]"')

import torch
from flwr.app import Context, RecordDict

from hetfl import config
from hetfl.flower import node
from hetfl.flower.node import TRUSTED_ROOTS_ENV, NodeError, StateStore
from tests.helpers import needs_accountant

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["data.partition=iid", "data.num_clients=2", "data.options={num_devices=4, max_samples=40}",
        "train.rounds=2", "train.local_steps=1", "runtime.threads=1"]


def context(**node_config) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 2, **node_config},
                   state=RecordDict(), run_config={})


def header(**extra) -> dict:
    return {"run": "0123456789abcdef", "session": "a1b2c3d4e5f6", "start": 0, "committed": 0, **extra}


def files_under(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("field", ["run", "session"])
@pytest.mark.parametrize("value", ["../../x", "/tmp/abs", "a/b", "..", ""])
def test_a_server_chosen_run_or_session_cannot_leave_the_nodes_state_folder(tmp_path, field, value):
    state_dir = tmp_path / "node" / "state"
    with pytest.raises(NodeError, match=field):
        StateStore(context(**{"state-dir": str(state_dir)}), header(**{field: value}), 0, "cpu").save(
            {"w": torch.ones(2)}, 1)
    assert files_under(tmp_path) == []


def test_the_node_writes_and_prunes_only_inside_its_state_folder(tmp_path):
    state_dir = tmp_path / "state"
    outside = tmp_path / "outside" / "client_0000"
    outside.mkdir(parents=True)
    (outside / "round_00001-ffffffffffff.safetensors").write_bytes(b"the user's")  # a prune target if reached
    store = StateStore(context(**{"state-dir": str(state_dir)}), header(**{"state-root": str(tmp_path / "outside")}),
                       0, "cpu")
    store.save({"w": torch.ones(2)}, 1)
    assert files_under(state_dir) == ["0123456789abcdef/client_0000/round_00001-a1b2c3d4e5f6.safetensors"]
    assert (outside / "round_00001-ffffffffffff.safetensors").read_bytes() == b"the user's"


def test_a_server_chosen_state_root_is_used_only_where_the_nodes_environment_trusts_it(tmp_path, monkeypatch):
    """A deployed node without a state-dir keeps its state in Flower's context only; the simulation's nodes
    (whose environment lists the run folders' node stores) write where the server says."""
    root = tmp_path / "server-chosen"
    monkeypatch.delenv(TRUSTED_ROOTS_ENV, raising=False)
    ctx = context()
    store = StateStore(ctx, header(**{"state-root": str(root)}), 0, "cpu")
    store.save({"w": torch.ones(2)}, 1)
    assert not root.exists()
    assert torch.equal(store.load(2)["w"], torch.ones(2))  # kept in the context

    monkeypatch.setenv(TRUSTED_ROOTS_ENV, str(root))
    StateStore(context(), header(**{"state-root": str(root)}), 0, "cpu").save({"w": torch.ones(2)}, 1)
    assert files_under(root) == ["0123456789abcdef/client_0000/round_00001-a1b2c3d4e5f6.safetensors"]


def server_config(*overrides: str) -> str:
    return config.dumps(config.load(None, [*TINY, *overrides]))


@needs_accountant
def test_a_nodes_privacy_floor_wins_over_the_servers_settings():
    ctx = context(**{"dp-epsilon": 2.0, "dp-delta": 1e-6, "dp-noise-source": "os"})
    weak = server_config("algorithm.name=fedavg+ccvr", "algorithm.ccvr.dp_epsilon=8", "algorithm.ccvr.dp_delta=1e-5")
    step = node.runtime(weak, ctx).posthoc[0]
    assert (step.hp.dp_epsilon, step.hp.dp_delta, step.hp.dp_noise_source) == (2.0, 1e-6, "os")

    off = server_config("algorithm.name=fedavg+ccvr")  # the server switched privacy off: the node refuses
    with pytest.raises(NodeError, match=r"algorithm\.ccvr\.dp_epsilon = inf"):
        node.runtime(off, ctx)

    strict = server_config("algorithm.name=fedpac", "model.options={hidden = [8]}", "algorithm.dp_epsilon=0.5")
    assert node.runtime(strict, ctx).algorithm.hp.dp_epsilon == 0.5  # a stricter server setting is kept


@needs_accountant
def test_a_nodes_seeded_noise_never_weakens_the_servers_operating_system_noise():
    """A floor only strengthens: noise the server's run config could recompute ("seed") in place of the fresh
    noise the server asked for ("os") would let the server strip this node's noise while its ledger records
    "os" and its epsilon (an audit's reproduction, failed on 8adeee3: the server recovered the node's exact
    per-class counts)."""
    fresh = server_config("algorithm.name=fedavg+ccvr", "algorithm.ccvr.dp_epsilon=4",
                          "algorithm.ccvr.dp_noise_source=os")
    step = node.runtime(fresh, context(**{"dp-noise-source": "seed"})).posthoc[0]
    assert step.hp.dp_noise_source == "os"
    seeded = server_config("algorithm.name=fedavg+ccvr", "algorithm.ccvr.dp_epsilon=4")
    assert node.runtime(seeded, context(**{"dp-noise-source": "os"})).posthoc[0].hp.dp_noise_source == "os"
    assert node.runtime(seeded, context(**{"dp-noise-source": "seed"})).posthoc[0].hp.dp_noise_source == "seed"


@needs_accountant
def test_a_nodes_floor_holds_for_its_own_upload_where_the_server_sees_each_upload():
    """Distributed noise without secure aggregation gives each upload 1/sqrt(clients) of the noise: the server,
    which sees each upload, faces epsilon 7.6 per upload where the node asked for at most 4. A node with a
    dp-epsilon floor then adds the whole noise itself (local); under secure aggregation (the server sees the
    sum only) it keeps its share."""
    plain = server_config("algorithm.name=fedavg+ccvr", "algorithm.ccvr.dp_epsilon=4")
    step = node.runtime(plain, context(**{"dp-epsilon": 4.0})).posthoc[0]
    assert step.hp.dp_noise == "local" and step.hp.dp_epsilon == 4.0
    assert step.mechanism.guarantee([step.mechanism.sum_multiplier(2)])["dp_epsilon_per_upload"] <= 4.0 + 1e-9
    secure = server_config("algorithm.name=fedavg+ccvr", "algorithm.ccvr.dp_epsilon=4",
                           "runtime.secure_aggregation=true", "runtime.secagg_reconstruction_threshold=2")
    assert node.runtime(secure, context(**{"dp-epsilon": 4.0})).posthoc[0].hp.dp_noise == "distributed"
    assert node.runtime(plain, context(**{"dp-noise-source": "os"})).posthoc[0].hp.dp_noise == "distributed"


def test_a_node_that_requires_privacy_refuses_a_method_without_it():
    with pytest.raises(NodeError, match="dp-epsilon"):
        node.runtime(server_config("algorithm.name=fedavg"), context(**{"dp-epsilon": 2.0}))


@pytest.mark.parametrize(("key", "value", "allowed"), [("dp-epsilon", 0.0, "must be a number > 0"),
                                                       ("dp-epsilon", "x", "must be a number > 0"),
                                                       ("dp-delta", 1.0, "must be a number > 0 and < 1"),
                                                       ("dp-noise-source", "dice", "must be one of seed, os")])
def test_a_bad_node_privacy_setting_is_named(key, value, allowed):
    with pytest.raises(NodeError) as info:
        node.runtime(server_config("algorithm.name=fedavg+ccvr", "algorithm.ccvr.dp_epsilon=8"),
                     context(**{key: value}))
    assert str(info.value) == f"node config {key} = {value!r}: {allowed}"


def test_a_node_trains_only_its_own_partitions_client():
    """A message for another client than the node's partition-id (a server's mistake, or a message meant for
    another node) is refused: the node holds only its own client's data and state."""
    assert node.own_client({"client": 3}, context(**{"partition-id": 3})) == 3
    with pytest.raises(NodeError) as info:
        node.own_client({"client": 1}, context())  # partition-id 0
    assert str(info.value) == "a message for client 1 reached the node of partition-id 0"
    bare = context()
    del bare.node_config["partition-id"]
    with pytest.raises(NodeError, match="partition-id None"):
        node.own_client({"client": 0}, bare)


def test_a_nodes_floor_admits_repeats_and_the_planned_answers_and_refuses_more(tmp_path):
    """A node with a floor answers a round again only with its earlier answer (nothing new), or within the
    releases its noise is calibrated for; beyond them it refuses and records nothing (an audit's reproduction,
    failed on 8adeee3: a resumed server's re-asked rounds made a node with dp-epsilon = 2 spend 2.27)."""
    floor = {"dp_epsilon": 2.0}
    ctx = context(**{"dp-epsilon": 2.0, "state-dir": str(tmp_path / "state")})
    answers = node.PrivateAnswers(ctx, header())
    for round_, digest in [(1, "a"), (2, "b"), (2, "b"), (3, "c")]:
        answers.admit("ccvr", round_, digest, 4, floor)
    answers.admit("ccvr", 3, "c2", 4, floor)  # round 3 asked again after a crash: fresh noise, the fourth release
    answers.admit("fedpac", 1, "x", 1, floor)  # another method counts apart
    with pytest.raises(NodeError, match=r"covers the 4 release\(s\) of ccvr the run plans; it has answered 4 "
                                        r"\(round\(s\) 1, 2, 3, 3\), and another answer for round 4"):
        answers.admit("ccvr", 4, "d", 4, floor)
    answers.admit("ccvr", 2, "b", 4, floor)  # a repeat is still admitted
    # a node restarted (a new context) reads the count from its state folder
    restarted = node.PrivateAnswers(context(**{"state-dir": str(tmp_path / "state")}), header())
    with pytest.raises(NodeError, match="dp-epsilon = 2"):
        restarted.admit("ccvr", 4, "d", 4, floor)
    assert files_under(tmp_path / "state") == ["0123456789abcdef/private_answers.json"]


def test_a_node_without_a_floor_or_a_method_without_noise_counts_nothing(tmp_path):
    class Step:
        name, mechanism = "ccvr", None

    h = {**header(), "round": 1}
    node.admit_private_answer(context(**{"dp-epsilon": 2.0}), h, Step(), {"t": torch.ones(2)})
    ctx = context()
    node.admit_private_answer(ctx, h, type("Private", (), {"name": "ccvr", "mechanism": object()})(),
                              {"t": torch.ones(2)})
    assert not any(k.endswith("private-answers") for k in ctx.state)


def test_a_node_without_a_state_folder_counts_its_answers_in_its_context(monkeypatch):
    """A deployed node without a state-dir (and no trusted server root) still holds its floor over the run: the
    answers it gave are counted in Flower's context, which a second reading of the same context sees; the
    refusal lists the rounds answered in round order (10 after 2)."""
    monkeypatch.delenv(TRUSTED_ROOTS_ENV, raising=False)
    floor = {"dp_epsilon": 2.0}
    ctx = context(**{"dp-epsilon": 2.0})
    answers = node.PrivateAnswers(ctx, header(**{"state-root": "/nowhere-trusted"}))
    assert answers.path is None
    answers.admit("ccvr", 10, "a", 2, floor)
    answers.admit("ccvr", 2, "b", 2, floor)
    with pytest.raises(NodeError, match=r"it has answered 2 \(round\(s\) 2, 10\), and another answer for round 11"):
        node.PrivateAnswers(ctx, header()).admit("ccvr", 11, "c", 2, floor)
    node.PrivateAnswers(ctx, header()).admit("ccvr", 10, "a", 2, floor)  # a repeat, read from the context


@needs_accountant
def test_the_floor_leaves_the_servers_configuration_as_it_was():
    """The floored configuration is a copy: the server's (which the node decodes a secure sum with,
    :func:`hetfl.flower.node.server_step`) keeps the server's settings."""
    cfg = config.load(None, [*TINY, "algorithm.name=fedavg+ccvr", "algorithm.ccvr.dp_epsilon=8"])
    before = config.to_tree(cfg)
    floored = node.with_privacy_floor(cfg, {"dp_epsilon": 2.0, "dp_delta": 1e-6})
    assert floored.algorithm.params["ccvr"]["dp_epsilon"] == 2.0
    assert config.to_tree(cfg) == before


def test_a_node_that_requires_privacy_refuses_a_trainer_run_without_it():
    """A method that can train under differential privacy (FedPAC's released statistics) run with it off:
    the refusal names the trainer's setting and the node's whole floor."""
    with pytest.raises(NodeError, match=r"requires differential privacy \(dp-epsilon = 2\.0, dp-delta = 1e-06\); "
                                        r"the run has none for algorithm \(algorithm\.dp_epsilon = inf\)"):
        node.runtime(server_config("algorithm.name=fedpac", "model.options={hidden = [8]}"),
                     context(**{"dp-epsilon": 2.0, "dp-delta": 1e-6}))


@needs_accountant
def test_a_node_logs_each_setting_its_floor_changes_and_only_those(caplog, monkeypatch):
    """What the node's floor overrode is in its log, with the server's value beside the node's: the operator's
    record that its upload is noisier than the server's run config says."""
    monkeypatch.setattr(node, "_RUNTIME", {})  # built (and logged) here, not taken from an earlier test's
    weak = server_config("algorithm.name=fedavg+ccvr", "algorithm.ccvr.dp_epsilon=8", "algorithm.ccvr.dp_delta=1e-6")
    with caplog.at_level("WARNING", logger="hetfl"):
        node.runtime(weak, context(**{"dp-epsilon": 2.0, "dp-delta": 1e-6, "dp-noise-source": "seed"}))
    assert [r.getMessage() for r in caplog.records if r.name == "hetfl"] == [
        "hetfl node: algorithm.ccvr.dp_epsilon = 2.0 (the server's 8): the node's privacy floor",
        "hetfl node: algorithm.ccvr.dp_noise = 'local' (the server's 'distributed'): without secure aggregation the "
        "server sees each upload, and the node's dp-epsilon floor holds for its own upload only with the whole "
        "noise in it"]
    caplog.clear()
    local = server_config("algorithm.name=fedavg+ccvr", "algorithm.ccvr.dp_epsilon=2",
                          "algorithm.ccvr.dp_noise='local'")
    with caplog.at_level("WARNING", logger="hetfl"):
        node.runtime(local, context(**{"dp-epsilon": 2.0}))
    # nothing overridden: the server's own local noise is read as such (not as the default, distributed)
    assert [r.getMessage() for r in caplog.records if r.name == "hetfl"] == []


def test_an_answer_beyond_the_planned_releases_is_refused_naming_the_floor(tmp_path):
    class Mechanism:
        releases = 1

    class Step:
        name, mechanism = "ccvr", Mechanism()

    ctx = context(**{"dp-epsilon": 2.0, "state-dir": str(tmp_path)})
    node.admit_private_answer(ctx, {**header(), "round": 1}, Step(), {"t": torch.ones(2)})
    with pytest.raises(NodeError, match=r"^this node's privacy floor \(dp-epsilon = 2\.0\) covers the 1 release\(s\) "
                                        r"of ccvr the run plans; it has answered 1 \(round\(s\) 1\)"):
        node.admit_private_answer(ctx, {**header(), "round": 2}, Step(), {"t": torch.zeros(2)})


def test_a_header_without_a_run_or_session_name_is_refused_in_words():
    h = header()
    del h["session"]
    with pytest.raises(NodeError) as info:
        node.plain_name(h, "session")
    assert str(info.value) == ("the server's session name '' is not a plain hexadecimal name; refused (this node "
                               "writes only inside its own state folder)")


def test_the_trusted_roots_are_a_path_list_and_no_root_is_offered_by_a_header_without_one(tmp_path, monkeypatch):
    """TRUSTED_ROOTS_ENV lists folders as PATH does (os.pathsep); a header that offers no state-root gets none,
    even where the environment trusts the working folder."""
    first, second = tmp_path / "a", tmp_path / "b"
    monkeypatch.setenv(TRUSTED_ROOTS_ENV, os.pathsep.join([str(first), str(second)]))
    assert node.state_root(context(), header(**{"state-root": str(second / "run")})) == second / "run"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(TRUSTED_ROOTS_ENV, str(tmp_path))
    assert node.state_root(context(), header()) is None
