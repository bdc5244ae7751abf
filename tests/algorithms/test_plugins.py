"""A researcher's own methods (plug-ins): the mistakes of a first plug-in are named, and the executors give a
plug-in's method the numbers they give a built-in one (session 27's audit, benchmarks/results/plugin_audit.md)."""

from __future__ import annotations

import json
import re

import pytest

from hetfl import algorithms, config
from hetfl.algorithms import base, register
from hetfl.algorithms.base import Algorithm, MethodError, cross_entropy
from hetfl.engine.experiment import Experiment
from hetfl.engine.local import train_client
from hetfl.engine.vectorized import train_clients_vectorized
from tests.helpers.executors import ATOL, SYNTHETIC, round_contexts
from tests.helpers.plugins import EMA_PLUGIN


@pytest.fixture
def registry():
    """The method registry, which a test's plug-ins register into (restored after every test by
    tests/conftest.py's own_method_registry)."""
    return algorithms._CLASSES


class SizeWeighted(Algorithm):
    """A loss that reads the client's plain values in its step: weighted by the client's size and id."""

    name = "sizeweighted"
    citation = "a test"

    def loss(self, state, batch, ctx):
        ce = cross_entropy(self.model.logits(state, batch.x), batch.y)
        weight = 1.0 + ctx.num_samples / 100.0 + ctx.client_id % 2
        return weight * ce, {"ce": ce.detach()}


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_a_step_reading_the_clients_size_or_id_gets_its_own_values_when_vectorised(registry, mode):
    """The vectorised executor runs one step for a group of clients, whose sizes and ids differ: a step that
    reads ctx.num_samples or ctx.client_id saw 0 and -1 there (session 27: train_loss 2.52 against the
    sequential 33.95 in round 1, silently). It now runs those clients one at a time, with the sequential
    numbers, and says which value the step read."""
    register(SizeWeighted)
    exp = Experiment(config.load(None, [*SYNTHETIC, "algorithm.name=sizeweighted", "train.local_steps=3"]))
    server, _, _ = exp.setup_round(exp.initial_server())
    seq = [train_client(exp.algorithm, ctx, exp.data, seed=exp.cfg.seed, train_cfg=exp.cfg.train)
           for ctx in round_contexts(exp, server, {}, 1)]
    notes: list[str] = []
    vec = train_clients_vectorized(exp.algorithm, round_contexts(exp, server, {}, 1), exp.data, seed=exp.cfg.seed,
                                   train_cfg=exp.cfg.train, step_mode=mode, log=notes.append)
    for a, b in zip(seq, vec, strict=True):
        assert b.loss_sum == pytest.approx(a.loss_sum, rel=1e-5)
        for name in a.state:
            assert (a.state[name] - b.state[name]).abs().max().item() <= ATOL
    said = [n for n in notes if "falling back" in n]
    assert said and "ctx.num_samples" in said[0] and "begin" in said[0], notes
    assert f"(at {__file__}:" in said[0] and "in loss)" in said[0]  # where: the plug-in's line


def test_a_compiled_step_cannot_read_the_clients_size_or_id_either():
    """runtime.compile's steps see a StepContext built from the group's template: its client_id and num_samples
    were the template's -1 and 0; now reading them refuses, and the stage runs uncompiled, then per client."""
    from hetfl.algorithms.base import ClientContext
    from hetfl.engine.compiled_step import PerClientValueRead, StepContext

    base = ClientContext(client_id=-1, round=3, num_samples=0, lr=0.1, payload={}, state={})
    ctx = StepContext(base, {}, {}, {})
    assert (ctx.round, ctx.lr) == (3, 0.1)
    for name in ("client_id", "num_samples", "features", "inputs"):
        with pytest.raises(PerClientValueRead, match=f"ctx.{name}"):
            getattr(ctx, name)


def test_a_simulated_flower_node_loads_the_plugins_the_server_loaded(registry, tmp_path, monkeypatch):
    """A simulated node is a Ray worker process: it knew only the built-in methods, so every client of a
    plug-in's run failed ('unknown method') and the run stopped. The simulation lists the server's plug-in files
    in the nodes' environment, and a node loads them before building its experiment."""
    pytest.importorskip("flwr", reason='Flower is not installed: pip install "hetfl[flower]"')
    from hetfl.flower import node
    from hetfl.flower.protocol import PLUGINS_ENV

    plugin = tmp_path / "ema_plugin.py"
    plugin.write_text(EMA_PLUGIN)
    monkeypatch.setenv(PLUGINS_ENV, str(plugin))
    node.load_listed_plugins()
    assert "emaprox_test" in algorithms._CLASSES
    algorithms._CLASSES.pop("emaprox_test")
    node.load_listed_plugins()  # loaded once per process: a plug-in file it holds is not run again
    assert "emaprox_test" not in algorithms._CLASSES


def test_a_method_registered_outside_a_plugin_file_is_refused_on_flower_before_anything_runs(registry, tmp_path):
    """A notebook's method cannot reach the simulation's node processes: refused naming it, nothing written."""
    pytest.importorskip("flwr")
    from hetfl.flower.simulation import check_nodes_know
    from hetfl.params import ConfigError

    register(SizeWeighted)
    with pytest.raises(ConfigError, match="sizeweighted.*--plugin FILE"):
        check_nodes_know(["sizeweighted"])
    check_nodes_know(["fedavg", "scaffold"])


# A plug-in's method on Flower's simulation gives the sequential numbers: in tests/flower/test_flower.py's
# test_the_readmes_flower_command_gives_the_sequential_numbers (it shares that test's Ray start).


# ------------------------------------------------------------------ loading a plug-in: a first plug-in's mistakes
def _plugin(folder, name: str, text: str):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


DOUBLED_FEDAVG = '''
from hetfl.algorithms import register
from hetfl.algorithms.base import Algorithm, cross_entropy


@register
class MyAvg(Algorithm):
    name = "NAME"
    citation = "a test"

    def loss(self, state, batch, ctx):
        ce = 2 * cross_entropy(self.model.logits(state, batch.x), batch.y)
        return ce, {"ce": ce.detach()}
'''


@pytest.mark.parametrize("name", ["fedavg", "ccvr"])
def test_a_plugin_method_named_like_a_built_in_one_is_refused(registry, tmp_path, capsys, name):
    """A plug-in whose method is called 'fedavg' replaced hetfl's FedAvg in every run of that process, silently
    (session 27: `hetfl run --plugin clash.py` ran the plug-in's loss as FedAvg, exit 0)."""
    from hetfl.cli import main

    plugin = _plugin(tmp_path, "clash.py", DOUBLED_FEDAVG.replace("NAME", name))
    assert main(["run", "--plugin", str(plugin), "--set", "train.rounds=1", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hetfl: error: --plugin {plugin}: MyAvg.name = {name!r} is ")
    assert "built-in" in err and "a name of its own" in err
    assert not (tmp_path / "r").exists()
    assert algorithms.algorithm_class("fedavg").__module__ == "hetfl.algorithms.fedavg"


def test_two_plugins_registering_one_name_are_refused_and_loading_one_twice_is_not(registry, tmp_path):
    """Two files giving one method name: the second replaced the first, silently; one file loaded twice (a
    notebook calling hetfl.run(plugins=...) again) is the same method, loaded again."""
    from hetfl.algorithms.base import MethodError

    first = _plugin(tmp_path / "a", "variant.py", DOUBLED_FEDAVG.replace("NAME", "mine"))
    second = _plugin(tmp_path / "b", "other.py", DOUBLED_FEDAVG.replace("NAME", "mine"))
    algorithms.load_plugin(str(first))
    algorithms.load_plugin(str(first))
    with pytest.raises(MethodError, match=f"--plugin {second}: MyAvg.name = 'mine' is already registered by "
                                          f"MyAvg of {first}"):
        algorithms.load_plugin(str(second))


def test_two_plugin_files_of_one_name_in_two_folders_both_reach_the_workers(registry, tmp_path):
    """Both were imported as the module hetfl_plugin_<stem>: the second took the first's place in the list of
    plug-in files that --jobs workers and Flower's nodes load, so the first's methods were unknown there."""
    first = _plugin(tmp_path / "a", "method.py", DOUBLED_FEDAVG.replace("NAME", "mine_a"))
    second = _plugin(tmp_path / "b", "method.py", DOUBLED_FEDAVG.replace("NAME", "mine_b"))
    algorithms.load_plugin(str(first))
    algorithms.load_plugin(str(second))
    assert algorithms.plugin_files()[-2:] == [str(first.resolve()), str(second.resolve())]
    assert algorithms.registered_outside_files(["mine_a", "mine_b"]) == []


def test_a_plugin_class_without_register_is_named_with_the_fix(registry, tmp_path, capsys):
    """The error said that a plug-in's method needs --plugin FILE, which was given: it names the class the file
    defines with that name and the missing @register."""
    from hetfl.cli import main

    plugin = _plugin(tmp_path, "noreg.py", DOUBLED_FEDAVG.replace("@register\n", "").replace("NAME", "noreg"))
    assert main(["run", "--plugin", str(plugin), "--set", "algorithm.name=noreg", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"MyAvg in {plugin} has name = 'noreg' but is not registered: put @register" in err, err
    assert main(["run", "--plugin", str(plugin), "--set", "algorithm.name=other", "--out", str(tmp_path / "r")]) == 2
    assert f"the plug-in files loaded ({plugin}) registered none: " in capsys.readouterr().err


IMPORT_ERRORS = {
    "import numpyy\n": ("ModuleNotFoundError: No module named 'numpyy'", 2),
    "x = 1\ny = undefined_name\n": ("NameError: name 'undefined_name' is not defined", 3),
    "x = 1\ndef f(:\n    pass\n": ("SyntaxError", 3),
}


@pytest.mark.parametrize("body", IMPORT_ERRORS)
def test_a_plugin_that_fails_to_import_says_which_file_line_and_error(registry, tmp_path, capsys, body):
    """A plug-in that raised on import gave a Python traceback and exit code 1: now one line naming the file, the
    line and the error, exit code 2 (in Python the MethodError keeps the original error as its cause)."""
    from hetfl.algorithms.base import MethodError
    from hetfl.cli import main

    said, line = IMPORT_ERRORS[body]
    plugin = _plugin(tmp_path, "broken.py", "from hetfl.algorithms import register\n" + body)
    assert main(["list", "--plugin", str(plugin), "algorithms"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hetfl: error: --plugin {plugin}: importing it failed at {plugin}:{line}: {said}"), err
    with pytest.raises(MethodError) as raised:
        algorithms.load_plugin(str(plugin))
    assert raised.value.__cause__ is not None
    assert not [m for m in __import__("sys").modules if m.startswith("hetfl_plugin_broken")]


# ------------------------------------------------------------------ hooks that return the wrong thing
WRONG_HOOKS = '''
from hetfl.algorithms import register
from hetfl.algorithms.base import Algorithm

WRONG = "HOOK"


@register
class Wrong(Algorithm):
    name = "wrong_hooks"
    citation = "a test"

    def init_server(self, model_state):
        out = super().init_server(model_state)
        return out.model if WRONG == "init_server" else out

    def payload(self, server, client_id):
        out = super().payload(server, client_id)
        return list(out.values()) if WRONG == "payload" else out

    def init_client_state(self, client_id, server):
        return None if WRONG == "init_client_state" else {}

    def begin(self, ctx):
        return None if WRONG == "begin" else {}

    def start_state(self, ctx):
        out = super().start_state(ctx)
        return {**out, "step": 3} if WRONG == "start_state" else out

    def stages(self, ctx):
        out = super().stages(ctx)
        return out[0] if WRONG == "stages" else out

    def finish(self, ctx, local, steps):
        upload, state = super().finish(ctx, local, steps)
        if WRONG == "finish":
            return upload
        return (upload, None) if WRONG == "finish_state" else (upload, state)

    def aggregate(self, server, uploads, round):
        out = super().aggregate(server, uploads, round)
        return out.model if WRONG == "aggregate" else out

    def client_model(self, server, client_state, client_id):
        out = super().client_model(server, client_state, client_id)
        return {k: v for k, v in list(out.items())[1:]} if WRONG == "client_model" else out
'''
HOOK_ERRORS = {
    "init_server": "must return a ServerState(model=..., extra=...) of dicts of name -> tensor; it returned a dict",
    "payload": "must return a dict of name -> tensor; it returned a list",
    "init_client_state": "must return a dict of name -> tensor; it returned None",
    "begin": "must return a dict of name -> tensor; it returned None",
    "start_state": "must return a dict of name -> tensor; its entry 'step' is a int",
    "stages": "must return a list of Stage; it returned a Stage",
    "finish": "must return (upload, state): two dicts of name -> tensor; it returned a dict",
    "finish_state": "must return (upload, state): two dicts of name -> tensor; its state is None",
    "aggregate": "must return a ServerState(model=..., extra=...) of dicts of name -> tensor; it returned a dict",
    "client_model": "must return a dict of name -> tensor holding the model's every tensor; it lacks",
}


@pytest.mark.parametrize("hook", HOOK_ERRORS)
def test_a_plugin_hook_returning_the_wrong_thing_stops_the_run_naming_the_hook_and_its_line(tmp_path, capsys,
                                                                                            hook):
    """Only `loss` was checked: another hook's wrong value failed deep in the engine with a traceback
    ("'dict' object has no attribute 'model'" for an aggregate that returned the model), or ran on (a begin or
    init_client_state returning None). Now one line names the class, the hook, its file and line, what it must
    return and what it returned; exit code 2."""
    from hetfl.cli import main

    plugin = _plugin(tmp_path, "wrong.py", WRONG_HOOKS.replace("HOOK", hook))
    argv = ["run", "--plugin", str(plugin), "--set", "algorithm.name=wrong_hooks", "--set", "train.rounds=1",
            "--set", "train.local_steps=1", "--quiet", "--out", str(tmp_path / "r")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    method = hook.removesuffix("_state") if hook == "finish_state" else hook
    line = next(n for n, text in enumerate(plugin.read_text().splitlines(), 1) if f"def {method}(" in text)
    assert err.startswith(f"hetfl: error: Wrong.{method} ({plugin}:{line}) {HOOK_ERRORS[hook]}"), err


def test_a_plugin_whose_hooks_return_the_right_things_runs_as_before(tmp_path):
    from hetfl.cli import main

    plugin = _plugin(tmp_path, "right.py", WRONG_HOOKS.replace("HOOK", "none"))
    assert main(["run", "--plugin", str(plugin), "--set", "algorithm.name=wrong_hooks", "--set", "train.rounds=1",
                 "--set", "train.local_steps=1", "--quiet", "--out", str(tmp_path / "r")]) == 0


# ------------------------------------------------------------------ hooks that are not callable
NOT_CALLABLE = '''
from hetfl.algorithms import register
from hetfl.algorithms.base import Algorithm


@register
class NotCallable(Algorithm):
    name = "not_callable"
    citation = "a test"
    payload = {"w": 1}
'''


def _not_callable(cls: str, hook: str, kind: str, where: str = "") -> str:
    params = ", ".join(__import__("inspect").signature(getattr(Algorithm, hook)).parameters)
    return (f"{cls}.{hook} of method 'not_callable'{where} is {kind}, not callable: a hook must be a method, "
            f"`def {hook}({params})` as in Algorithm.{hook} (a value assigned to a hook's name replaces the hook)")


def test_a_plugin_hook_that_is_not_callable_is_refused_when_the_file_loads(tmp_path, capsys):
    """`payload = {"w": 1}` on a plug-in's class (a value where a hook belongs) ran until the first round called
    it: "TypeError: 'dict' object is not callable", a traceback from deep in the engine, the run folder already
    written. Now refused when the file registers the class: one line naming the class, the method, the hook, the
    value's type and what a hook must be; exit 2, nothing written."""
    from hetfl.cli import main

    plugin = _plugin(tmp_path, "not_callable.py", NOT_CALLABLE)
    out = tmp_path / "r"
    assert main(["run", "--plugin", str(plugin), "--set", "algorithm.name=not_callable", "--set", "train.rounds=1",
                 "--set", "train.local_steps=1", "--quiet", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hetfl: error: --plugin {plugin}: {_not_callable('NotCallable', 'payload', 'a dict')}"), err
    assert not out.exists()


@pytest.mark.parametrize("hook", base.HOOKS)
def test_every_hook_set_to_a_value_is_refused_at_registration(registry, hook):
    cls = type("NotCallable", (Algorithm,), {"name": "not_callable", "citation": "a test", hook: None})
    with pytest.raises(MethodError) as refused:
        register(cls)
    assert str(refused.value) == _not_callable("NotCallable", hook, "None")
    assert "not_callable" not in registry


def test_a_hook_replaced_by_a_value_on_the_instance_is_refused_at_set_up(registry):
    """A class that passes registration and sets a hook to a value in its __init__ (`self.aggregate = "mean"`)
    is refused when the method is built, before any round."""
    from tests.helpers import tiny_setup

    @register
    class NotCallable(Algorithm):
        name = "not_callable"
        citation = "a test"

        def __init__(self, hyper, setup):
            super().__init__(hyper, setup)
            self.aggregate = "mean"

    with pytest.raises(MethodError) as refused:
        algorithms.build_algorithm("not_callable", {}, tiny_setup())
    assert str(refused.value) == _not_callable("NotCallable", "aggregate", "a str", " (set on the instance)")


def test_hetfls_own_methods_have_every_hook_callable():
    """HOOKS holds every function a method may override (a hook added to Algorithm must be listed there)."""
    import inspect

    defined = {n for k in (Algorithm, base.PrivateReleases) for n, v in vars(k).items()
               if inspect.isfunction(v) and not n.startswith("_") and "mutmut" not in n}
    assert set(base.HOOKS) == defined
    for name in algorithms.available():
        cls = algorithms.algorithm_class(name)
        assert all(callable(getattr(cls, hook)) for hook in base.HOOKS), name


class ReadsUndeclared(Algorithm):
    """Declares that its steps read only the payload, and reads its client state in the loss."""

    name = "reads_undeclared"
    citation = "a test"
    step_reads = frozenset({"payload"})

    def init_client_state(self, client_id, server):
        return {"anchor/" + n: server.model[n].clone() for n in self.model.param_names}

    def loss(self, state, batch, ctx):
        ce = cross_entropy(self.model.logits(state, batch.x), batch.y)
        prox = sum((state[n] - ctx.state["anchor/" + n]).pow(2).sum() for n in self.model.param_names)
        return ce + 0.01 * prox, {"ce": ce.detach()}


def test_a_step_reading_a_dict_its_step_reads_leaves_out_is_a_method_error_naming_the_line(registry):
    """The refusal was a LookupError: `hetfl run` printed a traceback and exited 1, as for a bug of hetfl's. It is
    a method's broken declaration: a MethodError (exit 2, one line, the --resume hint) naming the loss's line."""
    from hetfl.algorithms.base import MethodError

    register(ReadsUndeclared)
    exp = Experiment(config.load(None, [*SYNTHETIC, "algorithm.name=reads_undeclared", "train.local_steps=2"]))
    server, _, _ = exp.setup_round(exp.initial_server())
    with pytest.raises(MethodError, match=r"\(at .*test_plugins\.py:\d+, in .*\), but its algorithm.s step_reads "
                                         r"leaves .state. out"):
        train_clients_vectorized(exp.algorithm, round_contexts(exp, server, {}, 1), exp.data, seed=exp.cfg.seed,
                                 train_cfg=exp.cfg.train)


BAD_STAGE = '''
import dataclasses

from hetfl.algorithms import register
from hetfl.algorithms.base import Algorithm

WRONG = "HOW"


@register
class BadStage(Algorithm):
    name = "bad_stage"
    citation = "a test"

    def stages(self, ctx):
        (stage,) = super().stages(ctx)
        if WRONG == "trainable":
            return [dataclasses.replace(stage, trainable=("classifier.weights",))]
        if WRONG == "draws":
            return [dataclasses.replace(stage, draws=lambda generator, size: {"lam": 0.5})]
        return [dataclasses.replace(stage, grad_transform=lambda grads, state, ctx: None)]
'''
STAGE_ERRORS = {
    "trainable": "stage 'local' of BadStage trains 'classifier.weights', which the state it starts from "
                 "(start_state) does not hold",
    "draws": "stage 'local' of BadStage: its draws must return a dict of name -> tensor; its entry 'lam' is a float",
    "grad_transform": "stage 'local' of BadStage: its grad_transform must return a dict of name -> tensor; it "
                      "returned None",
}


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
@pytest.mark.parametrize("how", STAGE_ERRORS)
def test_a_plugin_stage_with_a_wrong_name_draw_or_gradient_transform_is_named(tmp_path, capsys, how, executor):
    """A trainable name the state lacks (a typo) was a KeyError, draws of a float an AttributeError ('float' object
    has no attribute 'to'), a gradient transform returning None a TypeError, each with a traceback from the
    engine: now one line naming the stage, the method and what is wrong, exit 2."""
    from hetfl.cli import main

    plugin = _plugin(tmp_path, "stage.py", BAD_STAGE.replace("HOW", how))
    argv = ["run", "--plugin", str(plugin), "--set", "algorithm.name=bad_stage", "--set", "train.rounds=1",
            "--set", "train.local_steps=1", "--set", f"runtime.executor={executor}", "--set",
            "runtime.vmap_on_cpu=true", "--quiet", "--out", str(tmp_path / "r")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert STAGE_ERRORS[how] in err, err


SCALED_PLUGIN = '''
from hetfl.algorithms import register
from hetfl.algorithms.base import Algorithm, cross_entropy

SCALE = {scale}


@register
class Scaled(Algorithm):
    name = "scaledce"
    citation = "a test"

    def loss(self, state, batch, ctx):
        ce = cross_entropy(self.model.logits(state, batch.x), batch.y)
        return SCALE * ce, {{"ce": ce.detach()}}
'''


def test_a_run_of_an_edited_plugin_is_not_taken_for_the_run_of_its_old_code(tmp_path):
    """A run's identity was its resolved configuration alone, which does not see a plug-in's code: after the
    plug-in file was edited, ``hetfl.run`` into the same folder handed back the old code's numbers as this
    code's (session 27's audit: 64.34% reused where the edited method gives 60.25%), and ``hetfl compare`` and
    sweeps reused such runs likewise. The file's content is now part of the identity
    (``algorithm.plugin_source``): the unchanged file reuses its run, an edited one is refused naming the key,
    also when resuming."""
    import hetfl
    from hetfl.engine.rundir import RunDirError

    plugin = tmp_path / "scaled.py"
    plugin.write_text(SCALED_PLUGIN.format(scale=1.0))
    overrides = ["algorithm.name=scaledce", "train.rounds=2", "train.local_steps=2"]
    first = hetfl.run(overrides=overrides, out=tmp_path / "run", plugins=[plugin])
    assert first.status == "ran"
    recorded = (tmp_path / "run" / "config.toml").read_text()
    assert 'plugin_source = "scaled.py sha256:' in recorded
    assert hetfl.run(overrides=overrides, out=tmp_path / "run", plugins=[plugin]).status == "reused"

    plugin.write_text(SCALED_PLUGIN.format(scale=0.5))  # the researcher edits the method
    with pytest.raises(RunDirError, match="algorithm.plugin_source: 'scaled.py sha256:"):
        hetfl.run(overrides=overrides, out=tmp_path / "run", plugins=[plugin])
    with pytest.raises(RunDirError, match="algorithm.plugin_source"):
        hetfl.run(tmp_path / "run" / "config.toml", out=tmp_path / "run", resume=True, plugins=[plugin])
    edited = hetfl.run(overrides=overrides, out=tmp_path / "edited", plugins=[plugin])
    assert edited.status == "ran" and edited.summary["setting_id"] != first.summary["setting_id"]


def test_a_built_in_methods_identity_holds_no_plugin_source():
    """Built-in methods' configurations (and so every run written before plug-ins had a source) are unchanged."""
    from hetfl.engine.identity import canonical_tree

    cfg = config.load(None, ["algorithm.name=fedavg+ccvr"])
    assert "plugin_source" not in canonical_tree(config.to_tree(cfg))["algorithm"]
    assert algorithms.plugin_source("fedavg+ccvr") == ""


def test_a_checkpoint_of_the_old_plugin_code_is_not_continued_with_the_new(tmp_path, capsys, monkeypatch):
    """A run stopped after a checkpoint, then resumed after its plug-in was edited, would be rounds of the old
    code continued by the new one: refused, saying so. Stopped before any checkpoint (the README's first-method
    mistake, fixed, then ``--resume``), it starts again from round 1 under the new code, which its config.toml
    then records."""
    from hetfl.cli import main
    from hetfl.engine import experiment as experiment_mod

    plugin = tmp_path / "scaled.py"
    plugin.write_text(SCALED_PLUGIN.format(scale=1.0))
    out = tmp_path / "run"
    argv = ["--plugin", str(plugin), "--set", "algorithm.name=scaledce", "--set", "train.rounds=3",
            "--set", "train.local_steps=2", "--quiet"]
    real_round = experiment_mod.Experiment.round

    def stop_in_round_3(self, server, clients, r, reporter):
        if r == 3:
            raise KeyboardInterrupt
        return real_round(self, server, clients, r, reporter)

    monkeypatch.setattr(experiment_mod.Experiment, "round", stop_in_round_3)
    assert main(["run", *argv, "--out", str(out)]) == 130  # stopped as by Ctrl-C, two rounds written
    monkeypatch.setattr(experiment_mod.Experiment, "round", real_round)
    plugin.write_text(SCALED_PLUGIN.format(scale=0.5))
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "--plugin", str(plugin), "--quiet"]) == 2
    err = " ".join(capsys.readouterr().err.split())  # the terminal's line breaks undone
    assert re.fullmatch(rf"hetfl: error: {re.escape(str(out))}: its checkpoint's rounds were computed by another "
                        r"version of the plug-in file \(algorithm\.plugin_source: 'scaled\.py sha256:[0-9a-f]{16}' -> "
                        r"'scaled\.py sha256:[0-9a-f]{16}'; there -> now\); continuing them with this code would mix "
                        r"the two in one run: run it afresh \(another --out, or delete the folder\)", err), err

    fresh = tmp_path / "fresh"
    argv0 = [*argv, "--set", "runtime.checkpoint_every=0"]
    plugin.write_text(SCALED_PLUGIN.format(scale=1.0))
    monkeypatch.setattr(experiment_mod.Experiment, "round", stop_in_round_3)
    assert main(["run", *argv0, "--out", str(fresh)]) == 130
    monkeypatch.setattr(experiment_mod.Experiment, "round", real_round)
    plugin.write_text(SCALED_PLUGIN.format(scale=0.5))
    assert main(["run", "--resume", str(fresh), "--plugin", str(plugin), "--quiet"]) == 0
    assert algorithms.plugin_source("scaledce") in (fresh / "config.toml").read_text()
    rerun = tmp_path / "rerun"
    assert main(["run", *argv0, "--out", str(rerun)]) == 0
    assert (fresh / "metrics.jsonl").read_text().count("\n") == 3
    strip = lambda line: {k: v for k, v in json.loads(line).items() if not k.endswith("time_s")}
    assert [strip(x) for x in (fresh / "metrics.jsonl").read_text().splitlines()] == \
        [strip(x) for x in (rerun / "metrics.jsonl").read_text().splitlines()]
