"""Construction errors: immediate, specific, naming parameters and modules as the user does."""

import gc

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh
from expecttest import TestCase
from torch import nn

from flatshard import MixedPrecision, ShardedDataParallel, ShardingStrategy
from flatshard.wrap import CustomPolicy
from tests._models import Block, build, wrap


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)


def _error(rank, world_size, case):
    """Run ``case`` and return (exception type name, message), or None if nothing was raised."""
    try:
        CASES[case]()
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return None


def _integer_param():
    module = Pair()
    module.a.steps = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    ShardedDataParallel(module)


def _complex_param():
    module = Pair()
    module.b.phase = nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    ShardedDataParallel(module)


def _wrap_wrapper():
    ShardedDataParallel(ShardedDataParallel(Pair()))


def _wrap_module_twice():
    module = Pair()
    ShardedDataParallel(module)
    ShardedDataParallel(module)


def _wrapped_child_not_put_back():
    model = build()
    ShardedDataParallel(model.blocks[1])  # the wrapper is dropped, the block keeps a FlatParameter
    ShardedDataParallel(model)


def _tie_split_inner_outer():
    model = build()
    model.embed = ShardedDataParallel(model.embed)  # head.weight is the same parameter
    ShardedDataParallel(model)


def _tie_split_siblings():
    model = build()
    model.embed = ShardedDataParallel(model.embed)
    gc.collect()  # nothing but the head module holds the original weight now
    model.head = ShardedDataParallel(model.head)


def _group_and_mesh():
    mesh = init_device_mesh("cpu", (1,))
    ShardedDataParallel(Pair(), process_group=dist.group.WORLD, device_mesh=mesh)


def _group_pair():
    ShardedDataParallel(Pair(), process_group=(dist.group.WORLD, dist.group.WORLD))


def _option(**options):
    return lambda: ShardedDataParallel(Pair(), **options)


CASES = {
    "integer_param": _integer_param,
    "complex_param": _complex_param,
    "wrap_wrapper": _wrap_wrapper,
    "wrap_module_twice": _wrap_module_twice,
    "wrapped_child_not_put_back": _wrapped_child_not_put_back,
    "tie_split_inner_outer": _tie_split_inner_outer,
    "tie_split_siblings": _tie_split_siblings,
    "not_a_module": lambda: ShardedDataParallel(torch.zeros(2)),
    "strategy_string": _option(sharding_strategy="FULL_SHARD"),
    "prefetch_string": _option(backward_prefetch="BACKWARD_PRE"),
    "flag_not_bool": _option(forward_prefetch=1),
    "device_id_type": _option(device_id=1.5),
    "device_id_cuda_missing": _option(device_id=0),
    "group_and_mesh": _group_and_mesh,
    "group_pair": _group_pair,
    "mesh_2d": lambda: ShardedDataParallel(Pair(), device_mesh=init_device_mesh("cpu", (1, 1))),
    "hybrid_1d_mesh": lambda: ShardedDataParallel(Pair(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=init_device_mesh("cpu", (1,))),
    "policy_type": _option(auto_wrap_policy=42),
    "policy_override": lambda: ShardedDataParallel(Pair(), auto_wrap_policy=CustomPolicy(_override_ignored)),
    "mixed_precision": _option(mixed_precision=MixedPrecision(param_dtype=torch.int32)),
    "ignored_both": _option(ignored_modules=[], ignored_states=[]),
    "ignored_wrapper": lambda: _ignored_wrapper(),
    "ignored_states_type": _option(ignored_states=[3]),
    "param_init_fn_type": _option(param_init_fn=3),
}


def _ignored_wrapper():
    module = Pair()
    module.a = ShardedDataParallel(module.a)
    ShardedDataParallel(module, ignored_modules=[module.a])


def _override_ignored(module):
    return {"ignored_modules": [module]} if isinstance(module, nn.Linear) else False


def _accepted(rank, world_size):
    """Options that are accepted: torch FSDP1's own enums/configs, and no-op configurations."""
    model = ShardedDataParallel(
        Pair(),
        sharding_strategy=torch_fsdp.ShardingStrategy.SHARD_GRAD_OP,
        backward_prefetch=torch_fsdp.BackwardPrefetch.BACKWARD_POST,
        cpu_offload=torch_fsdp.CPUOffload(offload_params=False),
        mixed_precision=MixedPrecision(),
        ignored_modules=[],
        device_id=torch.device("cpu"),
        limit_all_gathers=False,
    )
    return model.sharding_strategy, model.backward_prefetch, model.limit_all_gathers


def _no_sync_on_inner(rank, world_size):
    model = wrap(build(), "nested")
    with model.blocks[0].no_sync():
        pass


class ErrorTest(TestCase):
    def error(self, case):
        (result,) = self.pool.run(_error, 1, case)
        self.assertIsNotNone(result, f"{case} raised nothing")
        return ": ".join(result)

    def test_integer_and_other_non_floating_parameters(self):
        self.assertExpectedInline(
            self.error("integer_param"),
            """TypeError: parameter 'a.steps' has dtype torch.int64; ShardedDataParallel shards floating-point parameters only (register integer or boolean state as a buffer)""",
        )
        self.assertExpectedInline(
            self.error("complex_param"),
            """TypeError: parameter 'b.phase' has dtype torch.complex64; ShardedDataParallel shards floating-point parameters only (register integer or boolean state as a buffer)""",
        )

    def test_wrapping_twice(self):
        self.assertExpectedInline(
            self.error("wrap_wrapper"),
            """ValueError: module is already a ShardedDataParallel (of Pair); wrap each module once""",
        )
        self.assertExpectedInline(
            self.error("wrap_module_twice"),
            """ValueError: the module (Pair) is already wrapped by a ShardedDataParallel (it holds a FlatParameter); wrap each module once, and put the wrapper in its parent's place (e.g. model.block = ShardedDataParallel(model.block))""",
        )
        self.assertExpectedInline(
            self.error("wrapped_child_not_put_back"),
            """ValueError: module 'blocks.1' (Block) is already wrapped by a ShardedDataParallel (it holds a FlatParameter); wrap each module once, and put the wrapper in its parent's place (e.g. model.block = ShardedDataParallel(model.block))""",
        )

    def test_tied_parameter_split_across_units(self):
        self.assertExpectedInline(
            self.error("tie_split_inner_outer"),
            """ValueError: parameter 'embed.weight' is shared with 'head.weight', but the nested unit 'embed' already flattened it while module 'head' outside that unit also uses it; do not wrap 'embed' separately (or wrap a module that contains both users)""",
        )
        self.assertExpectedInline(
            self.error("tie_split_siblings"),
            """ValueError: parameter 'weight' has no elements. If it is tied to a parameter that another ShardedDataParallel already flattened (which empties the original), wrap one module that contains all of its users instead; zero-size parameters are not supported""",
        )

    def test_bad_option_values(self):
        self.assertExpectedInline(
            self.error("not_a_module"), """TypeError: module must be a torch.nn.Module; got Tensor"""
        )
        self.assertExpectedInline(
            self.error("strategy_string"),
            """TypeError: sharding_strategy must be one of ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD, ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2 or None; got 'FULL_SHARD'""",
        )
        self.assertExpectedInline(
            self.error("prefetch_string"),
            """TypeError: backward_prefetch must be one of BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST or None; got 'BACKWARD_PRE'""",
        )
        self.assertExpectedInline(
            self.error("flag_not_bool"), """TypeError: forward_prefetch must be a bool; got 1"""
        )
        self.assertExpectedInline(
            self.error("device_id_type"),
            """TypeError: device_id must be an int, a torch.device or None; got 1.5""",
        )
        self.assertExpectedInline(
            self.error("group_and_mesh"), """ValueError: pass either process_group or device_mesh, not both"""
        )
        if not torch.cuda.is_available():
            self.assertExpectedInline(
                self.error("device_id_cuda_missing"),
                """ValueError: device_id is 0 but CUDA is not available on this machine""",
            )

    def test_unsupported_options_raise_not_implemented_naming_the_option(self):
        expected = {
        }
        for case, message in expected.items():
            self.assertEqual(self.error(case), f"NotImplementedError: {message}", case)

    def test_hybrid_sharding_groups_given_in_the_wrong_form(self):
        # (hybrid sharding without groups builds: see tests/test_node_groups.py)
        self.assertExpectedInline(
            "\n".join(self.error(case) for case in ("group_pair", "mesh_2d", "hybrid_1d_mesh")),
            """\
ValueError: process_group as a (shard_group, replicate_group) pair needs sharding_strategy=HYBRID_SHARD or _HYBRID_SHARD_ZERO2
ValueError: a 2-D device_mesh is for hybrid sharding (sharding_strategy=HYBRID_SHARD or _HYBRID_SHARD_ZERO2); pass a 1-D mesh
ValueError: sharding_strategy=ShardingStrategy.HYBRID_SHARD needs a 2-D device_mesh (replicate, shard); got a 1-D one""",
        )

    def test_construction_option_errors(self):
        self.assertExpectedInline(self.error("policy_type"), """TypeError: auto_wrap_policy must be a callable policy (such as functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})), a ModuleWrapPolicy or a CustomPolicy; got an object of type int""")
        self.assertExpectedInline(self.error("policy_override"), """ValueError: the auto-wrap policy cannot override 'ignored_modules' for one unit (module 'a' (Linear))""")
        self.assertEqual(self.error("mixed_precision"), "TypeError: mixed_precision.param_dtype must be a floating-point torch.dtype or None; got torch.int32")
        self.assertExpectedInline(self.error("ignored_both"), """ValueError: pass either ignored_modules or ignored_states, not both""")
        self.assertExpectedInline(self.error("ignored_wrapper"), """ValueError: ignored modules must not be ShardedDataParallel units; got one wrapping Linear""")
        self.assertExpectedInline(self.error("ignored_states_type"), """ArgumentTypeError: ignored_states must hold nn.Parameters or nn.Modules; got int""")
        self.assertExpectedInline(self.error("param_init_fn_type"), """ArgumentTypeError: param_init_fn must be callable; got 3""")

    def test_torch_fsdp1_enums_and_no_op_configs_are_accepted(self):
        result = self.pool.run(_accepted, 2)[0]  # (at world size 1 a unit runs NO_SHARD)
        self.assertEqual(
            [str(v) for v in result], ["ShardingStrategy.SHARD_GRAD_OP", "BackwardPrefetch.BACKWARD_POST", "False"]
        )

    def test_no_sync_on_a_nested_unit(self):
        with self.assertRaisesRegex(RuntimeError, "no_sync\\(\\) must be called on the root ShardedDataParallel, not on the nested unit 'blocks.0'"):
            self.pool.run(_no_sync_on_inner, 1)

    def test_without_a_process_group(self):
        with self.assertRaisesRegex(RuntimeError, "needs torch.distributed to be initialised: call torch.distributed.init_process_group"):
            ShardedDataParallel(Block())
