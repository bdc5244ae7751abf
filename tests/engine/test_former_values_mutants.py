"""``setting`` and ``former_values`` (hetfl.params) checked field by field, for mutation testing.

``setting`` runs when a method's ``Hyper`` class is defined (at import, before any test), so a mutant of it
is seen only by a test that defines a class itself: these tests define small ``Hyper`` classes in their
bodies and compare what ``setting`` stored and what ``former_values`` reads back with dicts written out by
hand (``benchmarks/mutation.py``, target ``params_former``).
"""

from __future__ import annotations

import dataclasses

from hetfl.params import NO_FORMER, former_values, setting


def test_setting_stores_every_check_and_its_former_value_as_given():
    @dataclasses.dataclass(frozen=True)
    class Hyper:
        rate: float = setting(0.5, ge=0.1, gt=0.0, le=2.0, lt=3.0, choices=(0.5, 1.0), finite=False,
                              when={"mode": ("a",)}, former=1.0, doc="the rate")
        plain: int = setting(3)

    rate, plain = dataclasses.fields(Hyper)
    assert dict(rate.metadata) == {"ge": 0.1, "gt": 0.0, "le": 2.0, "lt": 3.0, "choices": (0.5, 1.0),
                                   "finite": False, "doc": "the rate", "when": {"mode": ("a",)}, "former": 1.0}
    assert dict(plain.metadata) == {"ge": None, "gt": None, "le": None, "lt": None, "choices": None,
                                    "finite": True, "doc": "", "when": {}, "former": NO_FORMER}
    assert (Hyper().rate, Hyper().plain) == (0.5, 3)


def test_a_list_or_dict_default_is_a_fresh_copy_per_instance():
    given_list, given_dict = [1, 2], {"a": 1}

    @dataclasses.dataclass
    class Hyper:
        items: list = setting(given_list, former=[])
        table: dict = setting(given_dict)

    one, two = Hyper(), Hyper()
    assert (one.items, one.table) == ([1, 2], {"a": 1})
    assert one.items is not two.items and one.items is not given_list
    assert one.table is not two.table and one.table is not given_dict
    one.items.append(3)
    assert two.items == [1, 2] and given_list == [1, 2]


def test_former_values_are_those_declared_none_included_and_only_those():
    """``former=None`` is a value (a run before the setting computed with None); a setting without ``former``
    and a plain dataclass field (no metadata at all) have none."""

    @dataclasses.dataclass(frozen=True)
    class Hyper:
        a: float = setting(1.0, former=0.5)
        b: str = setting("x")
        c: bool = setting(True, former=False)
        d: object = setting("auto", former=None)
        e: int = 7

    assert former_values(Hyper) == {"a": 0.5, "c": False, "d": None}


def test_a_class_without_former_values_has_none():
    @dataclasses.dataclass(frozen=True)
    class Hyper:
        a: float = setting(1.0)
        e: int = 7

    assert former_values(Hyper) == {}
