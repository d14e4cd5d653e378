"""Pure tier: the shared helpers of ``flatshard._base._common``: user-facing names, nested-output
traversal, guarded state transitions, and translating torch FSDP1's enums and configs."""

import collections
import dataclasses
from typing import Any, Dict

import torch
import torch.distributed.fsdp as torch_fsdp
from expecttest import TestCase

from flatshard import MixedPrecision, ShardingStrategy
from flatshard._base._common import (
    HandleState,
    TrainingState,
    clean_name,
    coerce_config,
    coerce_enum,
    guard_transition,
    iter_tensors,
    join_name,
    map_tensors,
)

Pair = collections.namedtuple("Pair", "first second")


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    extra: Dict[str, Any]


class NamesTest(TestCase):
    def test_clean_name_removes_every_wrapper_prefix(self):
        cases = {
            "_fsdp_wrapped_module": "",
            "_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.fc1.weight": "blocks.0.fc1.weight",
            "blocks.0._fsdp_wrapped_module": "blocks.0",
            "blocks.0.fc1.weight": "blocks.0.fc1.weight",
            "": "",
        }
        self.assertEqual({name: clean_name(name) for name in cases}, cases)

    def test_join_name(self):
        self.assertEqual(
            [join_name(a, b) for a, b in (("", ""), ("", "w"), ("blocks.0", ""), ("blocks.0", "fc1.weight"))],
            ["", "w", "blocks.0", "blocks.0.fc1.weight"],
        )


class NestedTensorsTest(TestCase):
    def test_iter_tensors_finds_every_tensor_in_order(self):
        a, b, c, d = (torch.full((1,), float(i)) for i in range(4))
        nested = {"x": [a, ("tag", b)], "y": Output(c, {"z": Pair(d, 3)}), "n": None}
        self.assertEqual([id(t) for t in iter_tensors(nested)], [id(a), id(b), id(c), id(d)])
        self.assertEqual(list(iter_tensors({a})), [a])
        self.assertEqual(list(iter_tensors(["no", 1, None])), [])

    def test_map_tensors_rebuilds_the_containers(self):
        a, b = torch.ones(1), torch.zeros(1)
        inputs = (
            [a, "keep"],
            collections.OrderedDict(first=b),
            Pair(a, 7),
            Output(b, {"k": (a,)}),
        )
        out = map_tensors(lambda t: t + 10, inputs)
        self.assertIs(type(out), tuple)
        self.assertEqual(out[0][1], "keep")
        self.assertIs(type(out[1]), collections.OrderedDict)
        self.assertIsInstance(out[2], Pair)
        self.assertEqual(out[2].second, 7)
        self.assertIsInstance(out[3], Output)
        self.assertEqual([t.item() for t in iter_tensors(out)], [11.0, 10.0, 11.0, 10.0, 11.0])
        self.assertEqual([t.item() for t in iter_tensors(inputs)], [1.0, 0.0, 1.0, 0.0, 1.0])  # not in place


class GuardTransitionTest(TestCase):
    def test_allowed_transition_returns_the_target(self):
        state = guard_transition(HandleState.SHARDED, (HandleState.SHARDED,), HandleState.GATHERING, "unshard")
        self.assertIs(state, HandleState.GATHERING)

    def test_refused_transition_names_where_from_and_to(self):
        with self.assertRaises(AssertionError) as caught:
            guard_transition(TrainingState.FORWARD, (TrainingState.IDLE, TrainingState.BACKWARD_POST), TrainingState.FORWARD, "pre-forward of unit 'layers.0'")
        self.assertExpectedInline(
            str(caught.exception),
            """pre-forward of unit 'layers.0': cannot move to FORWARD from FORWARD (expected one of IDLE, BACKWARD_POST)""",
        )


class CoerceTest(TestCase):
    def test_torch_fsdp1_enum_members_are_translated(self):
        got = coerce_enum(torch_fsdp.ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy, "sharding_strategy")
        self.assertIs(got, ShardingStrategy.SHARD_GRAD_OP)
        self.assertIs(coerce_enum(ShardingStrategy.NO_SHARD, ShardingStrategy, "sharding_strategy"), ShardingStrategy.NO_SHARD)
        self.assertIsNone(coerce_enum(None, ShardingStrategy, "sharding_strategy", allow_none=True))

    def test_other_values_are_refused_naming_the_argument(self):
        with self.assertRaises(TypeError) as caught:
            coerce_enum(None, ShardingStrategy, "sharding_strategy")
        self.assertExpectedInline(
            str(caught.exception),
            """sharding_strategy must be one of ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD, ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2; got None""",
        )

    def test_torch_fsdp1_config_is_copied_field_by_field(self):
        theirs = torch_fsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, keep_low_precision_grads=True)
        ours = coerce_config(theirs, MixedPrecision, "mixed_precision")
        self.assertIsInstance(ours, MixedPrecision)
        self.assertEqual(
            {f.name: getattr(ours, f.name) for f in dataclasses.fields(MixedPrecision)},
            {f.name: getattr(theirs, f.name) for f in dataclasses.fields(MixedPrecision)},
        )
        mine = MixedPrecision()
        self.assertIs(coerce_config(mine, MixedPrecision, "mixed_precision"), mine)
        self.assertIsNone(coerce_config(None, MixedPrecision, "mixed_precision"))
        with self.assertRaisesRegex(TypeError, r"^mixed_precision must be a MixedPrecision or None; got 3$"):
            coerce_config(3, MixedPrecision, "mixed_precision")
