"""The names ``flatshard.destroy_process_group``'s warning gives to what still holds a group
([Note: finding holders] in ``flatshard/_base/_holders.py``), with a plain object standing in for
the group."""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Iterator

from flatshard._base._holders import UNSEEN, describe_holders


class Target:
    __slots__ = ("__weakref__",)  # (untracked-like: no __dict__ of its own)


class Owner:
    def __init__(self, held: object) -> None:
        self.group = held


@contextlib.contextmanager
def _module_with(name: str, **values: object) -> Iterator[types.ModuleType]:
    """A module ``name`` in ``sys.modules`` holding ``values`` as globals, for the block."""
    module = types.ModuleType(name)
    vars(module).update(values)
    sys.modules[name] = module
    try:
        yield module
    finally:
        del sys.modules[name]


def _describe(target: object) -> list:
    return describe_holders(target, [__file__])


def test_a_global_of_a_module_is_named():
    target = Target()
    with _module_with("holders_demo_global", GROUP=target):
        assert "the global 'GROUP' of module holders_demo_global" in _describe(target)


def test_containers_in_globals_are_named_one_level_down():
    target = Target()
    with _module_with("holders_demo_containers", PAIR=(target, 1), CONFIG={"pg": target}):
        found = _describe(target)
        assert "an item of the global 'PAIR' of module holders_demo_containers" in found
        assert "a value in the global 'CONFIG' of module holders_demo_containers" in found


def test_a_default_argument_is_named_by_its_module():
    target = Target()
    namespace: dict = {"__name__": "holders_demo_defaults"}
    exec("def send(tensor, group=None):\n    return group\n", namespace)
    namespace["send"].__defaults__ = (target,)
    with _module_with("holders_demo_defaults", send=namespace["send"]):
        assert "default arguments of holders_demo_defaults (send)" in _describe(target)


def test_an_attribute_a_local_variable_and_a_closure_are_named():
    target = Target()
    owner = Owner(target)

    def captured() -> object:
        return target

    assert set(describe_holders(target, [], limit=10)) == {
        "the local variable 'target' of test_an_attribute_a_local_variable_and_a_closure_are_named() (test_pure_holders.py)",
        "attribute 'group' of a Owner",
        "a variable captured by tests.test_pure_holders.test_an_attribute_a_local_variable_and_a_closure_are_named.<locals>.captured",
    }
    del owner, captured


def test_nothing_found_says_so():
    assert describe_holders(Target(), [__file__]) == [UNSEEN]


def test_looking_leaves_no_reference_cycle_behind():
    # (a frame kept in a list it is in is a cycle that keeps every caller's locals -- the
    # group looked for among them -- alive until the next garbage collection)
    import gc
    import weakref

    def look() -> "weakref.ref[Target]":
        target = Target()
        describe_holders(target, [])
        return weakref.ref(target)

    gc.collect()
    gc.disable()
    try:
        gone = look()
        assert gone() is None
        assert gc.collect() == 0
    finally:
        gc.enable()
