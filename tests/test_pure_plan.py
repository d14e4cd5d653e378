"""Pure tier: ``flatshard.plan`` (the planner the wrapper builds from) without a process group:
the units of every policy, where tied parameters go, the peak memory estimate, and the same
refusals as the wrapper.

The unit trees and error texts expected here are the ones tests/test_auto_wrap.py and
tests/test_errors.py assert for the real wrapper on the rank pool, so the pure tier checks the
planner against what the wrapper builds.
"""

import contextlib
import functools
import inspect
import io
import types

import torch
from expecttest import TestCase
from torch import nn

import flatshard
from flatshard import BackwardPrefetch, CPUOffload, MixedPrecision, ShardedDataParallel, ShardingStrategy
from flatshard._base._options import OPTION_NAMES
from flatshard.plan import main as plan_main
from flatshard.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    _or_policy,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from tests._models import Layer, sample_transformer


def _is_sequential(module):
    return isinstance(module, nn.Sequential)


def _is_embedding(module):
    return isinstance(module, nn.Embedding)


def _layers_zero2(module):
    return {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP} if isinstance(module, Layer) else False


POLICIES = {  # the policies of tests/test_auto_wrap.py
    "always": lambda: always_wrap_policy,
    "size_based_100": lambda: functools.partial(size_based_auto_wrap_policy, min_num_params=100),
    "transformer": lambda: functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Layer}),
    "lambda": lambda: functools.partial(lambda_auto_wrap_policy, lambda_fn=_is_sequential),
    "or": lambda: functools.partial(
        _or_policy,
        policies=[
            functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Layer}),
            functools.partial(lambda_auto_wrap_policy, lambda_fn=_is_embedding),
        ],
    ),
    "module_wrap": lambda: ModuleWrapPolicy({Layer}),
    "custom": lambda: CustomPolicy(_layers_zero2),
}


def plan(model, policy=None, world_size=2, **options):
    return flatshard.plan(model, policy, world_size=world_size, print_table=False, **options)


def tree(planned) -> str:
    """The plan in the format of ``tests._models.unit_tree`` (which renders a wrapped model)."""
    lines = []
    for u in planned.units:
        groups = ", ".join(
            f"{str(g.dtype).replace('torch.', '')}{'' if g.requires_grad else ' frozen'} {g.params}p/{g.numel}"
            for g in u.groups
        )
        strategy = "" if u.sharding_strategy is ShardingStrategy.FULL_SHARD else f" {u.sharding_strategy.name}"
        lines.append(f"{u.name or '<root>'}: {u.module_type} [{groups or 'no parameters'}]{strategy}")
    return "\n".join(lines)


def meta_transformer(**options):
    with torch.device("meta"):
        return sample_transformer(**options)


class PolicyPlanTest(TestCase):
    """Each policy's plan is the unit tree tests/test_auto_wrap.py::PolicyTreeTest builds."""

    def policy_tree(self, name, **model_options):
        return tree(plan(meta_transformer(**model_options), POLICIES[name]()))

    def test_always_wrap_policy(self):
        self.assertExpectedInline(self.policy_tree("always"), """\
<root>: SampleTransformer [float32 1p/104]
embed: Embedding [no parameters]
layers: ModuleList [no parameters]
layers.0: Layer [no parameters]
layers.0.ln1: LayerNorm [float32 2p/16]
layers.0.attn: Attention [no parameters]
layers.0.attn.q: Linear [float32 2p/72]
layers.0.attn.k: Linear [float32 1p/64]
layers.0.attn.v: Linear [float32 2p/72]
layers.0.attn.o: Linear [float32 2p/72]
layers.0.ln2: LayerNorm [float32 2p/16]
layers.0.mlp: Sequential [no parameters]
layers.0.mlp.0: Linear [float32 2p/144]
layers.0.mlp.1: GELU [no parameters]
layers.0.mlp.2: Linear [float32 2p/136]
layers.1: Layer [no parameters]
layers.1.ln1: LayerNorm [float32 2p/16]
layers.1.attn: Attention [no parameters]
layers.1.attn.q: Linear [float32 2p/72]
layers.1.attn.k: Linear [float32 1p/64]
layers.1.attn.v: Linear [float32 2p/72]
layers.1.attn.o: Linear [float32 2p/72]
layers.1.ln2: LayerNorm [float32 2p/16]
layers.1.mlp: Sequential [no parameters]
layers.1.mlp.0: Linear [float32 2p/144]
layers.1.mlp.1: GELU [no parameters]
layers.1.mlp.2: Linear [float32 2p/136]
ln: LayerNorm [float32 2p/16]
head: Linear [no parameters]""")

    def test_size_based_policy_places_the_tied_embedding_in_the_root(self):
        self.assertExpectedInline(self.policy_tree("size_based_100"), """\
<root>: SampleTransformer [float32 11p/184]
embed: Embedding [no parameters]
layers.0.attn: Attention [float32 7p/280]
layers.0.mlp.0: Linear [float32 2p/144]
layers.0.mlp.2: Linear [float32 2p/136]
layers.1.attn: Attention [float32 7p/280]
layers.1.mlp.0: Linear [float32 2p/144]
layers.1.mlp.2: Linear [float32 2p/136]
head: Linear [no parameters]""")

    def test_transformer_and_module_wrap_policies(self):
        expected = """\
<root>: SampleTransformer [float32 3p/120]
layers.0: Layer [float32 15p/592]
layers.1: Layer [float32 15p/592]"""
        self.assertEqual(self.policy_tree("transformer"), expected)
        self.assertEqual(self.policy_tree("module_wrap"), expected)

    def test_lambda_policy(self):
        self.assertExpectedInline(self.policy_tree("lambda"), """\
<root>: SampleTransformer [float32 25p/744]
layers.0.mlp: Sequential [float32 4p/280]
layers.1.mlp: Sequential [float32 4p/280]""")

    def test_or_policy(self):
        self.assertExpectedInline(self.policy_tree("or"), """\
<root>: SampleTransformer [float32 3p/120]
embed: Embedding [no parameters]
layers.0: Layer [float32 15p/592]
layers.1: Layer [float32 15p/592]""")

    def test_custom_policy_with_per_unit_overrides(self):
        self.assertExpectedInline(self.policy_tree("custom"), """\
<root>: SampleTransformer [float32 3p/120]
layers.0: Layer [float32 15p/592] SHARD_GRAD_OP
layers.1: Layer [float32 15p/592] SHARD_GRAD_OP""")

    def test_frozen_and_mixed_dtype_parameters_get_one_flat_parameter_per_group(self):
        self.assertExpectedInline(self.policy_tree("transformer", frozen_attention=True, float64_gain=True), """\
<root>: SampleTransformer [float32 3p/120]
layers.0: Layer [float64 1p/8, float32 8p/312, float32 frozen 7p/280]
layers.1: Layer [float64 1p/8, float32 8p/312, float32 frozen 7p/280]""")

    def test_no_policy_is_one_unit_and_the_model_is_not_modified(self):
        model = sample_transformer()
        before = [(n, id(m)) for n, m in model.named_modules()] + [(n, id(p)) for n, p in model.named_parameters()]
        self.assertEqual(tree(plan(model)), "<root>: SampleTransformer [float32 33p/1304]")
        plan(model, POLICIES["always"]())
        after = [(n, id(m)) for n, m in model.named_modules()] + [(n, id(p)) for n, p in model.named_parameters()]
        self.assertEqual(after, before)

    def test_ignored_modules_are_left_out(self):
        model = meta_transformer()
        planned = plan(model, POLICIES["transformer"](), ignored_modules=[model.layers[1]])
        self.assertExpectedInline(tree(planned), """\
<root>: SampleTransformer [float32 3p/120]
layers.0: Layer [float32 15p/592]""")

    def test_shard_sizes_per_group(self):
        planned = plan(meta_transformer(frozen_attention=True, float64_gain=True), POLICIES["transformer"](), world_size=3)
        layer = planned.units[1]
        self.assertEqual(
            [(str(g.dtype), g.requires_grad, g.numel, g.padded_numel, g.shard_numel) for g in layer.groups],
            [("torch.float64", True, 8, 9, 3), ("torch.float32", True, 312, 312, 104), ("torch.float32", False, 280, 282, 94)],
        )
        self.assertEqual((layer.full_bytes, layer.shard_bytes), (9 * 8 + 312 * 4 + 282 * 4, 3 * 8 + 104 * 4 + 94 * 4))
        self.assertEqual((layer.trainable_full_bytes, layer.trainable_shard_bytes), (9 * 8 + 312 * 4, 3 * 8 + 104 * 4))


class Toy(nn.Module):
    """scale (3 elements) on the root, a: Linear(4, 4) (20), b: Linear(4, 2) (10)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(6))
        self.lin = nn.Linear(4, 4)


class Nested(nn.Module):
    """scale (3) on the root; outer: w (6) around outer.lin: Linear(4, 4) (20)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.outer = Outer()


LINEARS = ModuleWrapPolicy({nn.Linear})


class MemoryEstimateTest(TestCase):
    """[Note: peak estimate] worked by hand. Toy at world size 2 (float32): root 3 elements
    padded to 4 (16 B gathered, 8 B per rank), a 20 (80 B, 40 B), b 10 (40 B, 20 B)."""

    def memory(self, model, policy, world_size=2, **options):
        # (without overlap unless asked: the worked examples; test_overlap says what it adds)
        return dict(plan(model, policy, world_size, **{"overlap_communication": False, **options}).memory())

    def test_full_shard(self):
        self.assertEqual(
            self.memory(Toy(), LINEARS),
            # gathered: the root (kept) + a (the largest unit computing) + b (prefetched)
            {"parameter shards": 68, "gradient shards": 68, "gathered parameters": 16 + 80 + 40, "unsharded gradient": 80},
        )
        self.assertEqual(plan(Toy(), LINEARS, overlap_communication=False).peak_bytes, 68 + 68 + 136 + 80)

    def test_overlap_adds_a_unit_gathered_ahead_and_a_gradient_in_flight(self):
        # with overlap (the default) the forward gathers the next unit ahead whatever the
        # prefetch options, and b's unsharded gradient (40 B) is in flight while a's is computed
        overlap = self.memory(Toy(), LINEARS, backward_prefetch=None, overlap_communication=True)
        self.assertEqual(overlap, {"parameter shards": 68, "gradient shards": 68, "gathered parameters": 16 + 80 + 40, "unsharded gradient": 80 + 40})
        self.assertEqual(dict(plan(Toy(), LINEARS, backward_prefetch=None).memory()), overlap)
        with self.assertRaisesRegex(TypeError, r"^overlap_communication must be a bool; got str 'yes'$"):
            plan(Toy(), LINEARS, overlap_communication="yes")

    def test_prefetch_adds_the_second_largest_unit(self):
        without = self.memory(Toy(), LINEARS, backward_prefetch=None)
        self.assertEqual(without["gathered parameters"], 16 + 80)
        forward = self.memory(Toy(), LINEARS, backward_prefetch=None, forward_prefetch=True)
        self.assertEqual(forward["gathered parameters"], 16 + 80 + 40)
        post = self.memory(Toy(), LINEARS, backward_prefetch=BackwardPrefetch.BACKWARD_POST)
        self.assertEqual(post["gathered parameters"], 16 + 80 + 40)

    def test_shard_grad_op_keeps_every_unit_gathered(self):
        memory = self.memory(Toy(), LINEARS, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, backward_prefetch=None)
        self.assertEqual(memory["gathered parameters"], 16 + 80 + 40)
        self.assertEqual(memory["parameter shards"], 68)

    def test_no_shard_and_one_rank_keep_everything_whole(self):
        whole = {"parameter shards": 12 + 80 + 40, "gradient shards": 132, "gathered parameters": 0, "unsharded gradient": 0}
        self.assertEqual(self.memory(Toy(), LINEARS, sharding_strategy=ShardingStrategy.NO_SHARD), whole)
        self.assertEqual(self.memory(Toy(), LINEARS, world_size=1), whole)

    def test_frozen_units_have_no_gradient(self):
        model = Toy()
        model.b.requires_grad_(False)
        memory = self.memory(model, LINEARS)
        self.assertEqual((memory["gradient shards"], memory["unsharded gradient"]), (8 + 40, 80))

    def test_enclosing_units_stay_gathered_around_the_computing_unit(self):
        # outer: 6 elements (24 B gathered, 12 B per rank); outer.lin: 20 (80 B, 40 B). While
        # outer.lin computes, outer is gathered too (104 B); outer is prefetched (24 B).
        memory = self.memory(Nested(), ModuleWrapPolicy({Outer, nn.Linear}))
        self.assertEqual(
            memory,
            {"parameter shards": 8 + 12 + 40, "gradient shards": 60, "gathered parameters": 16 + 104 + 24, "unsharded gradient": 80},
        )


class Normed(nn.Module):
    """lin: Linear(4, 4) (20 elements), norm: BatchNorm1d(4) (8), which MixedPrecision keeps in
    full precision."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)


class MixedPrecisionPlanTest(TestCase):
    """``plan(mixed_precision=...)``: the root and every unit gather and compute in
    ``param_dtype`` (see [Note: peak estimate] and [Note: the planner's options]). Toy at
    world size 2 as in MemoryEstimateTest; the shards stay float32."""

    def memory(self, model, policy, world_size=2, **options):
        # (without overlap unless asked: the worked examples; test_overlap says what it adds)
        return dict(plan(model, policy, world_size, **{"overlap_communication": False, **options}).memory())

    def test_the_root_gathers_in_param_dtype(self):
        # no policy: one unit, the root, of 33 elements padded to 34 (17 per rank)
        self.assertEqual(
            self.memory(Toy(), None),
            {"parameter shards": 68, "gradient shards": 68, "gathered parameters": 136, "unsharded gradient": 136},
        )
        self.assertEqual(
            self.memory(Toy(), None, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)),
            {"parameter shards": 68, "gradient shards": 68, "gathered parameters": 68, "unsharded gradient": 68},
        )

    def test_every_unit_with_a_reduce_dtype_and_with_low_precision_gradients(self):
        # gathered: the root (4 elements) + a (20, computing) + b (10, prefetched), in float16
        reduced = self.memory(Toy(), LINEARS, mixed_precision=MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32))
        # a's gradient in float16, and its float32 copy for the reduction
        self.assertEqual(reduced, {"parameter shards": 68, "gradient shards": 68, "gathered parameters": 8 + 40 + 20, "unsharded gradient": 20 * (2 + 4)})
        kept = self.memory(Toy(), LINEARS, mixed_precision=MixedPrecision(param_dtype=torch.float16, keep_low_precision_grads=True))
        self.assertEqual(kept, {"parameter shards": 68, "gradient shards": 34, "gathered parameters": 68, "unsharded gradient": 40})

    def test_unsharded_units_compute_on_a_cast_copy_kept_into_backward(self):
        mixed = self.memory(Toy(), LINEARS, sharding_strategy=ShardingStrategy.NO_SHARD, mixed_precision=MixedPrecision(param_dtype=torch.float16))
        self.assertEqual(mixed, {"parameter shards": 132, "gradient shards": 132, "gathered parameters": 6 + 40 + 20, "unsharded gradient": 40})
        # (original parameters need the copy too; without them or mixed precision, a unit
        # computes on its FlatParameter: see test_no_shard_and_one_rank_keep_everything_whole)
        orig = self.memory(Toy(), LINEARS, sharding_strategy=ShardingStrategy.NO_SHARD, use_orig_params=True)
        self.assertEqual(orig, {"parameter shards": 132, "gradient shards": 132, "gathered parameters": 12 + 80 + 40, "unsharded gradient": 80})

    def test_the_table_says_what_each_group_computes_in_and_batch_norm_keeps_full_precision(self):
        planned = plan(Normed(), ModuleWrapPolicy({nn.Linear}), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16))
        self.assertExpectedInline(str(planned), """\
flatshard plan: 3 units, world size 2
unit    module       strategy    params  elements  full  per rank  flat parameters
<root>  Normed       FULL_SHARD       0         0   0 B       0 B  -
lin     Linear       FULL_SHARD       2        20  80 B      40 B  float32 as bfloat16 2p/20
norm    BatchNorm1d  FULL_SHARD       2         8  32 B      16 B  float32 2p/8
estimated peak per rank (parameters + gradients): 256 B = parameter shards 56 B + gradient shards 56 B + gathered parameters 72 B + unsharded gradient 72 B""")

    def test_cpu_offload_without_offloading_parameters_changes_nothing(self):
        self.assertEqual(self.memory(Toy(), LINEARS, cpu_offload=CPUOffload(offload_params=False)), self.memory(Toy(), LINEARS))


class PlannerOptionsTest(TestCase):
    """``plan`` takes every constructor option, with the constructor's defaults, and refuses
    those it cannot honour by name ([Note: the planner's options])."""

    def test_every_constructor_option_with_its_default(self):
        planner = inspect.signature(flatshard.plan.plan).parameters
        constructor = inspect.signature(ShardedDataParallel.__init__).parameters
        self.assertEqual([name for name in OPTION_NAMES if name not in planner], [])
        self.assertEqual({name: planner[name].default for name in OPTION_NAMES}, {name: constructor[name].default for name in OPTION_NAMES})

    def test_options_it_cannot_honour_are_refused_by_name(self):
        def error(policy=None, **options):
            try:
                plan(Pair(), policy, **options)
            except NotImplementedError as exc:
                return str(exc)
            return "nothing raised"

        def offload_a(module):
            return {"cpu_offload": CPUOffload(offload_params=True)} if isinstance(module, nn.Linear) else False

        self.assertExpectedInline(
            "\n".join([
                error(process_group="group"),
                error(device_mesh=types.SimpleNamespace(ndim=1)),
                error(device_id=0),
                error(cpu_offload=CPUOffload(offload_params=True)),
                error(CustomPolicy(offload_a)),
            ]),
            """\
flatshard.plan does not support process_group='group': the planner needs no process group: world_size gives the number of ranks to shard over
flatshard.plan does not support device_mesh=namespace(ndim=1): the planner needs no device mesh: world_size gives the number of ranks to shard over
flatshard.plan does not support device_id=0: the planner needs no device: device= (with measure=True) says where a measurement runs
flatshard.plan does not support cpu_offload=CPUOffload(offload_params=True): it keeps the shards and their gradients in host memory, which the estimate does not tell from the device's
flatshard.plan does not support cpu_offload=CPUOffload(offload_params=True) (a CustomPolicy's, for the unit at 'a'): it keeps the shards and their gradients in host memory, which the estimate does not tell from the device's""",
        )


def _run_main(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            plan_main(list(argv))
        except SystemExit as exc:
            return f"exit {exc.code}: {err.getvalue().splitlines()[-1]}"
    return out.getvalue()


class MixedPrecisionCommandLineTest(TestCase):
    def test_mixed_precision_flag(self):
        self.assertExpectedInline(
            _run_main("tests._models:sample_transformer", "--transformer-layer", "tests._models:Layer",
                      "--mixed-precision", "param_dtype=bfloat16,reduce_dtype=float32"), """\
flatshard plan: 3 units, world size 2
unit      module             strategy    params  elements     full  per rank  flat parameters
<root>    SampleTransformer  FULL_SHARD       3       120    480 B     240 B  float32 as bfloat16 3p/120
layers.0  Layer              FULL_SHARD      15       592  2.3 KiB   1.2 KiB  float32 as bfloat16 15p/592
layers.1  Layer              FULL_SHARD      15       592  2.3 KiB   1.2 KiB  float32 as bfloat16 15p/592
tied parameters:
  embed.weight = head.weight  ->  <root>
estimated peak per rank (parameters + gradients): 14.6 KiB = parameter shards 2.5 KiB + gradient shards 2.5 KiB + gathered parameters 2.5 KiB + unsharded gradient 6.9 KiB
""")

    def test_bad_mixed_precision_flags(self):
        model = "tests._models:sample_transformer"
        self.assertExpectedInline(
            "\n".join(_run_main(model, "--mixed-precision", value) for value in (
                "bfloat16", "param_dtype=int8", "keep_low_precision_grads=yes", "param_dtype=float16,param_dtype=bfloat16",
            )),
            """\
exit 2: python -m flatshard.plan: error: --mixed-precision: expected FIELD=VALUE with FIELD one of param_dtype, reduce_dtype, buffer_dtype, keep_low_precision_grads, cast_forward_inputs, cast_root_forward_inputs; got 'bfloat16'
exit 2: python -m flatshard.plan: error: --mixed-precision: param_dtype must name a floating-point torch dtype (such as bfloat16); got 'int8'
exit 2: python -m flatshard.plan: error: --mixed-precision: keep_low_precision_grads must be true or false; got 'yes'
exit 2: python -m flatshard.plan: error: --mixed-precision: param_dtype is given twice""",
        )


class Twin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2, bias=False)
        self.b = nn.Linear(2, 2, bias=False)
        self.b.weight = self.a.weight


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 2)
        self.twin = Twin()
        self.head = nn.Linear(2, 5, bias=False)
        self.head.weight = self.embed.weight


class TiesTest(TestCase):
    """A tied parameter goes to the lowest unit containing all its users, never to a container
    (see [Note: tied parameters in a plan])."""

    def test_sibling_units_share_through_their_common_ancestor(self):
        planned = plan(TiedLM(), ModuleWrapPolicy({nn.Embedding, nn.Linear}))
        self.assertExpectedInline(tree(planned), """\
<root>: TiedLM [float32 2p/14]
embed: Embedding [no parameters]
twin.a: Linear [no parameters]
twin.b: Linear [no parameters]
head: Linear [no parameters]""")
        # twin is no unit here, so the root is also the lowest unit around twin.a and twin.b
        self.assertEqual(
            [(u.name, u.tied) for u in planned.units if u.tied],
            [("", (("embed.weight", "head.weight"), ("twin.a.weight", "twin.b.weight")))],
        )

    def test_a_tie_inside_one_unit_stays_there(self):
        planned = plan(TiedLM(), ModuleWrapPolicy({Twin}))
        self.assertEqual(tree(planned), "<root>: TiedLM [float32 1p/10]\ntwin: Twin [float32 1p/4]")
        self.assertEqual({u.name: u.tied for u in planned.units if u.tied}, {
            "": (("embed.weight", "head.weight"),),
            "twin": (("twin.a.weight", "twin.b.weight"),),
        })

    def test_a_tie_between_a_unit_and_a_unit_inside_it_goes_to_the_outer_one(self):
        model = Nested()
        model.outer.w = model.outer.lin.weight
        planned = plan(model, ModuleWrapPolicy({Outer, nn.Linear}))
        self.assertExpectedInline(tree(planned), """\
<root>: Nested [float32 1p/3]
outer: Outer [float32 1p/16]
outer.lin: Linear [float32 1p/4]""")
        self.assertEqual(planned.units[1].tied, (("outer.w", "outer.lin.weight"),))

    def test_a_tie_whose_common_unit_is_a_container_goes_above_it(self):
        model = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
        model[0][1].weight = model[0][0].weight
        planned = plan(model, always_wrap_policy)
        self.assertExpectedInline(tree(planned), """\
<root>: Sequential [float32 1p/4]
0: ModuleList [no parameters]
0.0: Linear [float32 1p/2]
0.1: Linear [float32 1p/2]""")
        self.assertEqual(planned.units[0].tied, (("0.0.weight", "0.1.weight"),))

    def test_a_tie_with_a_module_registered_in_two_places_goes_above_both_places(self):
        # a Linear tied to a sibling and also registered in another block runs outside the
        # siblings' block: the tie belongs to the unit around both blocks (found by the fuzzer)
        shared, first = nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False)
        shared.weight = first.weight
        model = nn.Sequential(
            nn.Sequential(nn.Sequential(first, shared), nn.Sequential(nn.Linear(2, 2, bias=False), shared))
        )
        planned = plan(model, always_wrap_policy)
        self.assertEqual([(u.name, u.tied) for u in planned.units if u.tied], [("0", (("0.0.0.weight", "0.0.1.weight"),))])
        # (and a module registered in two places keeps its own parameters)
        self.assertIn("0.0.1: Linear [no parameters]", tree(planned))

    def test_a_module_reachable_by_two_paths_is_one_unit(self):
        model = nn.Module()
        model.first = model.second = nn.Linear(2, 2)
        planned = plan(model, LINEARS)
        self.assertEqual(tree(planned), "<root>: Module [no parameters]\nfirst: Linear [float32 2p/6]")


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)


def _override_ignored(module):
    return {"ignored_modules": [module]} if isinstance(module, nn.Linear) else False


class RefusalTest(TestCase):
    """The plan refuses what the wrapper refuses, with the texts tests/test_errors.py::ErrorTest
    asserts for the wrapper."""

    def error(self, call):
        try:
            call()
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"
        self.fail("nothing raised")

    def test_bad_world_size(self):
        for bad in (0, -1, 2.0, None):
            self.assertEqual(self.error(lambda: plan(Pair(), world_size=bad)), f"ValueError: world_size must be a positive int; got {bad!r}")

    def test_same_texts_as_the_wrapper(self):
        def integer_param():
            module = Pair()
            module.a.steps = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
            plan(module)

        self.assertExpectedInline(
            "\n".join(
                self.error(call)
                for call in (
                    integer_param,
                    lambda: plan(Pair(), 42),
                    lambda: plan(Pair(), CustomPolicy(_override_ignored)),
                    lambda: plan(Pair(), sharding_strategy="FULL_SHARD"),
                    lambda: plan(Pair(), backward_prefetch="BACKWARD_PRE"),
                    lambda: plan(Pair(), ignored_modules=[], ignored_states=[]),
                    lambda: plan(Pair(), ignored_states=[3]),
                )
            ),
            """\
TypeError: parameter 'a.steps' has dtype torch.int64; ShardedDataParallel shards floating-point parameters only (register integer or boolean state as a buffer)
TypeError: auto_wrap_policy must be a callable policy (such as functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})), a ModuleWrapPolicy or a CustomPolicy; got an object of type int
ValueError: the auto-wrap policy cannot override 'ignored_modules' for one unit (module 'a' (Linear))
TypeError: sharding_strategy must be one of ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD, ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2 or None; got 'FULL_SHARD'
TypeError: backward_prefetch must be one of BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST or None; got 'BACKWARD_PRE'
ValueError: pass either ignored_modules or ignored_states, not both
ArgumentTypeError: ignored_states must hold nn.Parameters or nn.Modules; got int""",
        )

