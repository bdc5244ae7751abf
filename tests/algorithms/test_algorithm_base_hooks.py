"""The checks of what a plug-in's hooks and stages return (``hetfl.algorithms.base``, session 27's plug-in
audit), called directly with every kind of wrong value; each message compared whole with one written out
here from the contract it states (mutation testing, ``benchmarks/mutation.py`` target ``algorithm_base``;
``tests/algorithms/test_plugins.py`` checks the same through whole runs, one wrong value per hook)."""

from __future__ import annotations

import functools

import pytest
import torch

from hetfl.algorithms import base
from hetfl.algorithms.base import Algorithm, MethodError, ServerState, Stage
from hetfl.optim import SGDConfig

T = torch.zeros(2)


def plain_loss(state, batch, ctx):
    return T.sum(), {}


def stage(name="local", trainable=("w",), loss=plain_loss, adversary=None):
    return Stage(name, loss, trainable, SGDConfig(lr=0.1), adversary=adversary)


@pytest.mark.parametrize(("value", "what", "problem"), [
    (None, "it", "it returned None"),
    ([T], "it", "it returned a list"),
    ({"a": 1}, "it", "its entry 'a' is a int"),
    ({1: T}, "it", "its entry 1 is a Tensor"),
    ({"a": T, "b": 2.0}, "it", "its entry 'b' is a float"),
    ({"a": T}, "it", None),
    ({}, "it", None),
    (None, "its upload", "its upload is None"),
    (5, "its model", "its model is a int"),
    ({"a": T}, "its state", None),
])
def test_what_a_dict_of_tensors_lacks_is_named(value, what, problem):
    assert base._tensor_dict_problem(value, what) == problem


@pytest.mark.parametrize(("value", "problem"), [
    (ServerState(model={"w": T}), None),
    (ServerState(model={"w": T}, extra=None), "its extra is None"),
    (ServerState(model=[T]), "its model is a list"),
    (ServerState(model={"w": 1}), "its entry 'w' is a int"),
    ({"w": T}, "it returned a dict"),
])
def test_a_server_state_is_checked_in_its_model_and_its_extra(value, problem):
    assert base._server_problem(value) == problem


@pytest.mark.parametrize(("value", "problem"), [
    ([], None), ([stage()], None), ([stage(), 3], "it holds a int"), ([3, "x"], "it holds a int"),
    ((stage(),), "it returned a tuple"), (stage(), "it returned a Stage"),
])
def test_stages_are_a_list_of_stages(value, problem):
    assert base._stages_problem(value) == problem


@pytest.mark.parametrize(("value", "problem"), [
    (({"u": T}, {"s": T}), None),
    (({"u": T},), "it returned a tuple of 1"),
    (({}, {}, {}), "it returned a tuple of 3"),
    ({"u": T}, "it returned a dict"),
    (None, "it returned None"),
    (([T], {}), "its upload is a list"),
    (({}, None), "its state is None"),
])
def test_finish_returns_an_upload_and_a_state(value, problem):
    assert base._finish_problem(value) == problem


class ThreeTensors:
    class model:  # stands for a ModelCaller: only its state names are read
        state_names = ("a", "b", "c")


@pytest.mark.parametrize(("value", "problem"), [
    ({"a": T, "b": T, "c": T}, None),
    ({"a": T, "b": T, "c": T, "extra": T}, None),
    ({"a": T, "b": T}, "it lacks 'c'"),
    ({"a": T}, "it lacks 'b' and 1 more"),
    ({}, "it lacks 'a' and 2 more"),
    (None, "it returned None"),
])
def test_a_client_model_must_hold_every_tensor_of_the_model(value, problem):
    assert base._client_model_problem(value, ThreeTensors()) == problem


def test_where_a_hook_is_defined_is_its_file_and_line_else_its_name():
    assert base._where(plain_loss) == f"{__file__}:{plain_loss.__code__.co_firstlineno}"
    assert base._where(len) == "len"  # built in: no source file
    assert base._where(functools.partial(plain_loss)) == "?"  # neither source nor a qualified name


class Mine(Algorithm):  # defined outside hetfl: its own hooks are checked
    def begin(self, ctx):
        return None

    def payload(self, server, client_id):
        return {"w": T}


def test_a_plugins_own_hooks_are_wrapped_once_and_hetfls_are_left_alone():
    original_begin, original_payload = Mine.__dict__["begin"], Mine.__dict__["payload"]
    base.checked_hooks(Mine)
    begin = Mine.__dict__["begin"]
    assert begin is not original_begin and begin.__wrapped__ is original_begin and begin.__hetfl_checked__
    base.checked_hooks(Mine)  # again (a plug-in loaded twice): not wrapped twice
    assert Mine.__dict__["begin"] is begin and Mine.__dict__["payload"].__wrapped__ is original_payload
    # the hooks it inherits are hetfl's own, tested: left on Algorithm, not wrapped on the class
    assert set(Mine.__dict__) & set(base.HOOK_CONTRACTS) == {"begin", "payload"}
    assert "aggregate" not in Mine.__dict__ and Algorithm.aggregate.__module__ == "hetfl.algorithms.base"
    method = object.__new__(Mine)
    assert Mine.payload(method, None, 0) == {"w": T}  # a right value passes through
    line = original_begin.__code__.co_firstlineno
    with pytest.raises(MethodError) as err:
        Mine.begin(method, None)
    assert str(err.value) == (f"Mine.begin ({__file__}:{line}) must return a dict of name -> tensor; "
                              "it returned None")


def test_a_plugin_hook_whose_module_is_unknown_is_checked_like_any_plugins():
    """A function made by ``exec`` with bare globals (generated code, some notebook tools) has ``__module__ =
    None``: it is a plug-in's hook like any other, wrapped and checked. It stopped ``register`` with
    "AttributeError: 'NoneType' object has no attribute 'startswith'"."""
    generated: dict = {}
    exec("def begin(self, ctx):\n    return None\n", generated)  # the case under test
    assert generated["begin"].__module__ is None

    class Generated(Algorithm):
        begin = generated["begin"]

    base.checked_hooks(Generated)
    assert Generated.__dict__["begin"].__wrapped__ is generated["begin"]
    with pytest.raises(MethodError, match=r"^Generated.begin \(.*\) must return a dict of name -> tensor; "
                                          "it returned None$"):
        Generated.begin(object.__new__(Generated), None)


def test_a_plugin_hook_without_a_module_attribute_is_wrapped():
    """A hook set to a callable implemented in C without ``__module__`` (a method descriptor such as
    ``dict.copy``) is a plug-in's hook too: wrapped (not an AttributeError at registration), its value checked,
    and named by its qualified name where it has no source file."""
    assert not hasattr(dict.copy, "__module__")

    class CHook(Algorithm):
        payload = dict.copy

    base.checked_hooks(CHook)
    assert CHook.__dict__["payload"].__wrapped__ is dict.copy
    assert CHook.payload({"w": T}) == {"w": T}  # called as the hook is: self first (here the dict copied)
    with pytest.raises(MethodError) as err:
        CHook.payload({"w": 1})
    assert str(err.value) == ("dict.payload (dict.copy) must return a dict of name -> tensor; "
                              "its entry 'w' is a int")


def test_a_stage_training_a_name_its_start_state_lacks_is_named_with_what_it_holds():
    few = {n: T for n in ("a", "b", "w")}
    many = {n: T for n in "abcdefgh"}
    with pytest.raises(MethodError) as err:
        base.check_stage_start([stage(trainable=("w", "zz"))], few)
    assert str(err.value) == ("stage 'local' of plain_loss trains 'zz', which the state it starts from "
                              "(start_state) does not hold; it holds a, b, w (self.setup.groups names the model's "
                              "parts)")
    with pytest.raises(MethodError) as err:
        base.check_stage_start([stage(trainable=("a",)), stage("max", trainable=("q",))], many)
    assert str(err.value) == ("stage 'max' of plain_loss trains 'q', which the state it starts from "
                              "(start_state) does not hold; it holds a, b, c, d, e, f, ... (self.setup.groups "
                              "names the model's parts)")
    six = {n: T for n in "abcdef"}
    with pytest.raises(MethodError, match=r"it holds a, b, c, d, e, f \(self"):
        base.check_stage_start([stage(trainable=("z",))], six)
    seven = {n: T for n in "abcdefg"}  # one more than the six shown: the dots say so
    with pytest.raises(MethodError, match=r"it holds a, b, c, d, e, f, \.\.\. \(self"):
        base.check_stage_start([stage(trainable=("z",))], seven)
    # a stage's adversary is checked too; stages that train what the state holds pass
    with pytest.raises(MethodError, match="stage 'adv' of plain_loss trains 'v'"):
        base.check_stage_start([stage(trainable=("w",), adversary=stage("adv", trainable=("v",)))], few)
    base.check_stage_start([stage(trainable=("w",), adversary=stage("adv", trainable=("a", "b")))], few)


class Losses:  # at module level: its functions' qualified names are "Losses.<name>"
    @staticmethod
    def contrastive(state, batch, ctx):
        return plain_loss(state, batch, ctx)


def test_a_stage_is_named_by_the_class_of_its_losss_method_or_its_function():
    class Owner:
        def loss(self, state, batch, ctx):
            return plain_loss(state, batch, ctx)

    assert base._stage_where(stage("enc", loss=Owner().loss)) == "stage 'enc' of Owner"
    assert base._stage_where(stage("enc", loss=plain_loss)) == "stage 'enc' of plain_loss"
    assert base._stage_where(stage("enc", loss=functools.partial(plain_loss))) == "stage 'enc' of ?"
    # a function of a class without an instance (a static method): named by its class, the qualified name's
    # first part ("Losses.contrastive")
    assert base._stage_where(stage("enc", loss=Losses.contrastive)) == "stage 'enc' of Losses"


def test_a_stages_draws_or_gradient_transform_returning_other_than_tensors_is_named():
    out = {"lam": T}
    assert base.checked_stage_output(stage(), "draws", out) is out
    with pytest.raises(MethodError) as err:
        base.checked_stage_output(stage(), "grad_transform", None)
    assert str(err.value) == ("stage 'local' of plain_loss: its grad_transform must return a dict of name -> "
                              "tensor; it returned None")
