"""The public types have FSDP1's names, members, fields and defaults, and import from flatshard."""

import dataclasses
import enum
import inspect

import pytest
import torch.distributed.fsdp as torch_fsdp

import flatshard

TYPES = [
    "ShardingStrategy",
    "BackwardPrefetch",
    "MixedPrecision",
    "CPUOffload",
    "StateDictType",
    "StateDictConfig",
    "FullStateDictConfig",
    "ShardedStateDictConfig",
    "LocalStateDictConfig",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "StateDictSettings",
    "OptimStateKeyType",
]


def _shape(cls):
    if issubclass(cls, enum.Enum):
        return [(m.name, m.value) for m in cls]
    return [(f.name, f.default, f.default_factory) for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("name", TYPES)
def test_public_type_matches_torch_fsdp1(name):
    ours, theirs = getattr(flatshard, name), getattr(torch_fsdp, name)
    assert name in flatshard.__all__
    assert _shape(ours) == _shape(theirs)
    if dataclasses.is_dataclass(ours):
        ours_bases = [b.__name__ for b in ours.__mro__[1:-1]]
        theirs_bases = [b.__name__ for b in theirs.__mro__[1:-1]]
        assert ours_bases == theirs_bases


def test_constructor_signature_matches_torch_fsdp1():
    ours = inspect.signature(flatshard.ShardedDataParallel.__init__).parameters
    theirs = inspect.signature(torch_fsdp.FullyShardedDataParallel.__init__).parameters
    assert list(ours) == list(theirs)
    for name in theirs:
        default = theirs[name].default
        if isinstance(default, enum.Enum):
            assert ours[name].default.name == default.name, name
        else:
            assert ours[name].default == default, name


def test_fsdp1_class_name_is_an_alias():
    assert flatshard.FullyShardedDataParallel is flatshard.ShardedDataParallel


def test_everything_in_all_is_importable():
    for name in flatshard.__all__:
        assert hasattr(flatshard, name), name
