"""The construction options (``flatshard._base._options``): one list, matching the constructor.

In-process, no process group.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from torch import nn

from flatshard import ShardedDataParallel
from flatshard._base._options import NOT_PER_UNIT, OPTION_NAMES, ConstructionOptions
from flatshard.api import ShardingStrategy


def test_fields_are_the_constructor_arguments_with_their_defaults():
    # ``plan()`` builds options from the field defaults, the wrapper from its signature's:
    # they must be the same for the two to plan alike.
    arguments = list(inspect.signature(ShardedDataParallel.__init__).parameters.values())[2:]  # (self, module)
    fields = dataclasses.fields(ConstructionOptions)
    assert [a.name for a in arguments] == [f.name for f in fields] == list(OPTION_NAMES)
    assert [a.default for a in arguments] == [f.default for f in fields]
    assert set(NOT_PER_UNIT) <= set(OPTION_NAMES)


def test_a_signature_that_drifted_from_the_fields_is_refused():
    arguments = {name: None for name in OPTION_NAMES if name != "device_mesh"}
    arguments.update(self=object(), module=nn.Linear(1, 1), new_option=1)
    with pytest.raises(
        AssertionError,
        match=r"^the constructor's signature and ConstructionOptions differ: arguments without a field "
        r"\['new_option'\], fields without an argument \['device_mesh'\]$",
    ):
        ConstructionOptions.from_constructor(arguments)


def test_ignored_collections_are_read_once():
    layers = [nn.Linear(1, 1), nn.Linear(1, 1)]
    options = ConstructionOptions(ignored_modules=iter(layers), ignored_states=(p for p in layers[0].parameters()))
    assert options.ignored_modules == tuple(layers)
    assert options.ignored_states == tuple(layers[0].parameters())
    assert options.for_unit({}).ignored_modules == tuple(layers)  # (a replace re-reads the tuple)


def test_a_unit_gets_its_overrides_and_no_policy():
    root = ConstructionOptions(auto_wrap_policy=lambda *a, **k: True, forward_prefetch=True)
    unit = root.for_unit({"sharding_strategy": ShardingStrategy.NO_SHARD})
    assert unit == dataclasses.replace(
        root, auto_wrap_policy=None, sharding_strategy=ShardingStrategy.NO_SHARD
    )
    assert root.auto_wrap_policy is not None  # (frozen: the root's options are unchanged)
    with pytest.raises(dataclasses.FrozenInstanceError):
        root.forward_prefetch = False  # type: ignore[misc]
