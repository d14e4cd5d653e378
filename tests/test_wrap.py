"""Auto-wrap policies and ``select_units``, checked against torch's FSDP1 as the oracle.

FSDP1 applies a callable policy by wrapping in place (``_recursive_wrap``); we run it on a deep
copy with a recording wrapper whose child attribute is FSDP1's ``_fsdp_wrapped_module``, so
``clean_name`` turns the wrapped copy's module names back into the original paths. For
``ModuleWrapPolicy``/``CustomPolicy`` the oracle is their ``_run_policy``. Single process, no
process group.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Dict, Iterable, List, Tuple

import torch
import torch.distributed.fsdp.wrap as torch_wrap
from expecttest import TestCase
from torch import nn

from flatshard._base._common import WRAPPED_MODULE, clean_name
from flatshard.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    _or_policy,
    always_wrap_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    select_units,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)

VOCAB, DIM, LAYERS = 32, 8, 3


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    """Numels: embed 256 (tied to head), each layer 872 (attn 288, mlp 552 = 288 + 264,
    norms 16 each), norm 16; 2888 in all."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class Recorder(nn.Module):
    """A stand-in wrapper: keeps the module under FSDP1's attribute name, and the kwargs."""

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        setattr(self, WRAPPED_MODULE, module)
        self.kwargs = kwargs


def not_wrapped(module: nn.Module) -> bool:
    return False


def select(model: nn.Module, policy: Any, is_wrapped=not_wrapped, ignored_modules=(), ignored_params=()):
    return select_units(
        model, policy, is_wrapped=is_wrapped, ignored_modules=set(ignored_modules), ignored_params=set(ignored_params)
    )


def paths_of(root: nn.Module) -> Dict[int, str]:
    return {id(m): name for name, m in root.named_modules()}


def ours(
    model: nn.Module, policy: Any, ignored_modules: Iterable[str] = (), ignored_params: Iterable[str] = (),
    is_wrapped: Callable[[nn.Module], bool] = not_wrapped,
) -> Dict[str, Dict[str, Any]]:
    units = select_units(
        model,
        policy,
        is_wrapped=is_wrapped,
        ignored_modules={model.get_submodule(p) for p in ignored_modules},
        ignored_params={model.get_parameter(p) for p in ignored_params},
    )
    names = paths_of(model)
    return {names[id(m)]: overrides for m, overrides in units.items()}


def _fsdp1_ignored(model: nn.Module, ignored_modules: Iterable[str], ignored_params: Iterable[str]):
    # As FSDP1's constructor passes them: ignored modules expanded to their subtrees, and
    # their parameters among the ignored parameters.
    modules = {m for p in ignored_modules for m in model.get_submodule(p).modules()}
    params = {model.get_parameter(p) for p in ignored_params} | {p for m in modules for p in m.parameters()}
    return modules, params


def fsdp1_recursive(model: nn.Module, policy: Callable, ignored_modules=(), ignored_params=()) -> List[str]:
    """The paths FSDP1's recursive wrapping wraps, in ``named_modules`` order."""
    clone = copy.deepcopy(model)
    modules, params = _fsdp1_ignored(clone, ignored_modules, ignored_params)
    torch_wrap._recursive_wrap(clone, policy, Recorder, modules, params, only_wrap_children=True)
    return [clean_name(name) for name, m in clone.named_modules() if isinstance(m, Recorder)]


def fsdp1_run_policy(model: nn.Module, policy: Any, ignored_modules=()) -> Dict[str, Dict[str, Any]]:
    """The targets (root excluded) of FSDP1's ModuleWrapPolicy/CustomPolicy, with their kwargs."""
    clone = copy.deepcopy(model)
    modules, _ = _fsdp1_ignored(clone, ignored_modules, ())
    targets = policy._run_policy(clone, modules, {})
    names = paths_of(clone)
    return {names[id(m)]: kwargs for m, kwargs in targets.items() if m is not clone}


def call_log(model: nn.Module, policy: Callable) -> Tuple[Callable, List[Tuple[str, bool, int]]]:
    """``policy`` wrapped to record (path, recurse, nonwrapped_numel) of every question."""
    names = paths_of(model)
    log: List[Tuple[str, bool, int]] = []

    def recording(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        log.append((names[id(module)], recurse, nonwrapped_numel))
        return policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel)

    return recording, log


def our_log(model: nn.Module, policy: Callable, ignored_modules=(), ignored_params=(), is_wrapped=not_wrapped):
    """The questions ``select_units`` asks ``policy``."""
    recording, log = call_log(model, policy)
    ours(model, recording, ignored_modules, ignored_params, is_wrapped)
    return log


def fsdp1_log(model: nn.Module, policy: Callable, ignored_modules=(), ignored_params=()):
    """The questions FSDP1 asks ``policy`` (on a copy, so paths are looked up there)."""
    clone = copy.deepcopy(model)
    recording, log = call_log(clone, policy)
    modules, params = _fsdp1_ignored(clone, ignored_modules, ignored_params)
    torch_wrap._recursive_wrap(clone, recording, Recorder, modules, params, only_wrap_children=True)
    return log


def logs(model: nn.Module, policy: Callable, ignored_modules=(), ignored_params=()):
    mine = our_log(model, policy, ignored_modules, ignored_params)
    return mine, fsdp1_log(model, policy, ignored_modules, ignored_params)


def is_layer_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm)


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear)


CALLABLE_POLICIES: Dict[str, Callable] = {
    "always": always_wrap_policy,
    "size_100": functools.partial(size_based_auto_wrap_policy, min_num_params=100),
    "size_280": functools.partial(size_based_auto_wrap_policy, min_num_params=280),
    "size_280_no_leaf": functools.partial(size_based_auto_wrap_policy, min_num_params=280, force_leaf_modules=set()),
    "size_1000": functools.partial(size_based_auto_wrap_policy, min_num_params=1000),
    "size_1000_no_exclude": functools.partial(
        size_based_auto_wrap_policy, min_num_params=1000, exclude_wrap_modules=set()
    ),
    "size_default": size_based_auto_wrap_policy,
    "transformer": functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Layer}),
    "transformer_embed": functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Layer, nn.Embedding}),
    "lambda_linear": functools.partial(lambda_auto_wrap_policy, lambda_fn=is_linear),
    "or": functools.partial(
        _or_policy,
        policies=[
            functools.partial(lambda_auto_wrap_policy, lambda_fn=is_layer_norm),
            functools.partial(size_based_auto_wrap_policy, min_num_params=500),
        ],
    ),
    "module_wrap_policy_as_callable": functools.partial(_or_policy, policies=[ModuleWrapPolicy({nn.LayerNorm})]),
}


def custom_fn(module: nn.Module) -> Any:
    if isinstance(module, nn.Embedding):
        return {"forward_prefetch": True, "limit_all_gathers": False}
    if isinstance(module, Layer):
        return True
    if isinstance(module, nn.Sequential):
        return {}  # an empty dict means "not a unit"
    return False


class SelectionTest(TestCase):
    def setUp(self) -> None:
        self.model = Transformer()

    def test_callable_policies_match_fsdp1(self) -> None:
        for name, policy in CALLABLE_POLICIES.items():
            with self.subTest(policy=name):
                units = ours(self.model, policy)
                self.assertEqual(list(units), fsdp1_recursive(self.model, policy))
                self.assertTrue(all(overrides == {} for overrides in units.values()))
                mine, theirs = logs(self.model, policy)
                self.assertEqual(mine, theirs)

    def test_target_policies_match_fsdp1(self) -> None:
        cases = {
            "module_wrap": (
                ModuleWrapPolicy({Layer, nn.LayerNorm}),
                torch_wrap.ModuleWrapPolicy({Layer, nn.LayerNorm}),
            ),
            "custom": (CustomPolicy(custom_fn), torch_wrap.CustomPolicy(custom_fn)),
        }
        for name, (mine, theirs) in cases.items():
            for ignored in ((), ("layers.1",), ("layers.0.mlp", "embed")):
                with self.subTest(policy=name, ignored=ignored):
                    expected = fsdp1_run_policy(self.model, theirs, ignored)
                    self.assertEqual(list(ours(self.model, mine, ignored).items()), list(expected.items()))
                    # torch's own policy objects are accepted too.
                    self.assertEqual(ours(self.model, theirs, ignored), expected)

    def test_custom_policy_overrides(self) -> None:
        self.assertExpectedInline(
            "\n".join(f"{p}: {o}" for p, o in ours(self.model, CustomPolicy(custom_fn)).items()),
            """\
embed: {'forward_prefetch': True, 'limit_all_gathers': False}
layers.0: {}
layers.1: {}
layers.2: {}""",
        )

    def test_custom_policy_sees_the_root_first(self) -> None:
        seen: List[str] = []
        names = paths_of(self.model)

        def fn(module: nn.Module) -> bool:
            seen.append(names.get(id(module), "?"))
            return True  # the root is a unit anyway: never returned

        units = ours(self.model, CustomPolicy(fn), ignored_modules=("layers.1",))
        self.assertEqual(seen[0], "")
        self.assertEqual(seen, [""] + list(units))
        self.assertNotIn("", units)
        self.assertFalse(any(n.startswith("layers.1") for n in seen))

    def test_transformer_selection(self) -> None:
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Layer, nn.Embedding})
        self.assertExpectedInline("\n".join(ours(self.model, policy)), """\
embed
layers.0
layers.1
layers.2""")

    def test_size_based_selection(self) -> None:
        def show(name: str) -> str:
            return " ".join(ours(self.model, CALLABLE_POLICIES[name])) or "(none)"

        self.assertExpectedInline(
            show("size_100"),
            """embed layers.0 layers.0.mlp.0 layers.0.mlp.2 layers.1 layers.1.mlp.0 layers.1.mlp.2 layers.2 layers.2.mlp.0 layers.2.mlp.2 head""",
        )
        # attention (288 elements) is a forced leaf: never looked into, never a unit itself.
        self.assertExpectedInline(
            show("size_280"), """layers.0 layers.0.mlp.0 layers.1 layers.1.mlp.0 layers.2 layers.2.mlp.0"""
        )
        self.assertExpectedInline(
            show("size_280_no_leaf"),
            """layers.0 layers.0.attn layers.0.mlp.0 layers.1 layers.1.attn layers.1.mlp.0 layers.2 layers.2.attn layers.2.mlp.0""",
        )
        # Each layer (872) is below 1000; the ModuleList holding them (2616) is never a unit.
        self.assertExpectedInline(show("size_1000"), """(none)""")
        self.assertExpectedInline(show("size_1000_no_exclude"), """layers""")
        self.assertExpectedInline(show("size_default"), """(none)""")

    def test_size_based_defaults_are_fsdp1s(self) -> None:
        self.assertEqual(set(size_based_auto_wrap_policy.FORCE_LEAF_MODULES), {nn.MultiheadAttention})
        self.assertEqual(set(size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES), {nn.ModuleList, nn.ModuleDict})
        theirs = torch_wrap.size_based_auto_wrap_policy
        self.assertEqual(set(size_based_auto_wrap_policy.FORCE_LEAF_MODULES), theirs.FORCE_LEAF_MODULES)
        self.assertEqual(set(size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES), theirs.EXCLUDE_WRAP_MODULES)

    def test_module_wrap_policy_is_callable(self) -> None:
        policy = ModuleWrapPolicy([Layer])
        layer, norm = self.model.layers[0], self.model.norm
        for module in (layer, norm):
            self.assertTrue(policy(module=module, recurse=True, nonwrapped_numel=0))
        self.assertTrue(policy(module=layer, recurse=False, nonwrapped_numel=0))
        self.assertFalse(policy(module=norm, recurse=False, nonwrapped_numel=0))
        self.assertExpectedInline(repr(policy), """ModuleWrapPolicy({Layer})""")

    def test_policy_answers_match_fsdp1_functions(self) -> None:
        pairs = [
            (always_wrap_policy, torch_wrap.always_wrap_policy, {}),
            (size_based_auto_wrap_policy, torch_wrap.size_based_auto_wrap_policy, {"min_num_params": 300}),
            (transformer_auto_wrap_policy, torch_wrap.transformer_auto_wrap_policy, {"transformer_layer_cls": {Layer}}),
            (lambda_auto_wrap_policy, torch_wrap.lambda_auto_wrap_policy, {"lambda_fn": is_linear}),
        ]
        for mine, theirs, kwargs in pairs:
            for module in self.model.modules():
                for recurse in (True, False):
                    for numel in (0, 299, 300, 10**9):
                        args = dict(module=module, recurse=recurse, nonwrapped_numel=numel, **kwargs)
                        where = (mine.__name__, type(module), recurse, numel)
                        self.assertEqual(mine(**args), bool(theirs(**args)), where)


class ScopeTest(TestCase):
    def setUp(self) -> None:
        self.model = Transformer()

    def test_tied_parameter_counted_once(self) -> None:
        mine, theirs = logs(self.model, always_wrap_policy)
        self.assertEqual(mine, theirs)
        unique = sum(p.numel() for p in {id(p): p for p in self.model.parameters()}.values())
        self.assertEqual(unique, 2888)
        self.assertEqual(mine[0], ("", True, 2888))
        # The head's subtree holds the tied weight once more; like FSDP1 we count per subtree.
        self.assertIn(("head", True, 256), mine)

    def test_ignored_modules_and_params(self) -> None:
        cases = [
            (("layers.1",), ()),
            (("layers.0.attn", "norm"), ()),
            ((), ("embed.weight",)),
            ((), ("layers.2.mlp.0.weight", "layers.2.mlp.0.bias")),
            (("layers.0",), ("layers.1.norm1.weight",)),
        ]
        for name, policy in CALLABLE_POLICIES.items():
            for modules, params in cases:
                with self.subTest(policy=name, modules=modules, params=params):
                    units = ours(self.model, policy, modules, params)
                    self.assertEqual(list(units), fsdp1_recursive(self.model, policy, modules, params))
                    for ignored in modules:
                        self.assertFalse(any(u == ignored or u.startswith(ignored + ".") for u in units))
                    mine, theirs = logs(self.model, policy, modules, params)
                    self.assertEqual(mine, theirs)

    def test_ignored_module_parameters_need_not_be_listed(self) -> None:
        # Given only the module, its parameters still count toward no size (FSDP1 counts them
        # unless the caller lists them among the ignored parameters too).
        log = our_log(self.model, always_wrap_policy, ignored_modules=("layers.1",))
        self.assertEqual(log[0], ("", True, 2888 - 872))

    def test_ignored_root(self) -> None:
        units = select_units(
            self.model, always_wrap_policy, is_wrapped=not_wrapped, ignored_modules={self.model}, ignored_params=set()
        )
        self.assertEqual(units, {})

    def test_already_wrapped_submodules_are_left_alone(self) -> None:
        self.model.layers[1] = Recorder(self.model.layers[1])
        wrapped = self.model.layers[1]

        def is_wrapped(module: nn.Module) -> bool:
            return isinstance(module, Recorder)

        seen: List[nn.Module] = []

        def custom(module: nn.Module) -> bool:
            seen.append(module)
            return True

        inside = {id(m) for m in wrapped.modules()}
        policies = {**CALLABLE_POLICIES, "module_wrap": ModuleWrapPolicy({Layer}), "custom": CustomPolicy(custom)}
        for name, policy in policies.items():
            with self.subTest(policy=name):
                units = select(self.model, policy, is_wrapped=is_wrapped)
                self.assertFalse(any(id(m) in inside for m in units))
        self.assertFalse(any(id(m) in inside for m in seen))
        # To a callable policy a wrapped module is as good as ignored: FSDP1 with it ignored agrees.
        for name, policy in CALLABLE_POLICIES.items():
            with self.subTest(policy=name):
                as_ignored = {"ignored_modules": ("layers.1",)}
                self.assertEqual(
                    our_log(self.model, policy, is_wrapped=is_wrapped), fsdp1_log(self.model, policy, **as_ignored)
                )
                units = ours(self.model, policy, is_wrapped=is_wrapped)
                self.assertEqual(units, ours(self.model, policy, **as_ignored))

    def test_shared_module_selected_once(self) -> None:
        shared = nn.Linear(4, 4)
        model = nn.Sequential(nn.Sequential(shared, nn.ReLU()), nn.Sequential(nn.Linear(4, 4), shared))
        units = select(model, always_wrap_policy)
        self.assertExpectedInline(" ".join(paths_of(model)[id(m)] for m in units), """0 0.0 0.1 1 1.0""")
        self.assertIn(shared, units)

    def test_pure(self) -> None:
        model = self.model
        before_modules = [(n, id(m), m.training) for n, m in model.named_modules(remove_duplicate=False)]
        before_params = [
            (n, id(p), p.detach().clone(), p.requires_grad) for n, p in model.named_parameters(remove_duplicate=False)
        ]
        policies = list(CALLABLE_POLICIES.values()) + [ModuleWrapPolicy({Layer}), CustomPolicy(custom_fn)]
        for policy in policies:
            select(model, policy, ignored_modules={model.layers[0]}, ignored_params={model.norm.weight})
        after_modules = [(n, id(m), m.training) for n, m in model.named_modules(remove_duplicate=False)]
        self.assertEqual(after_modules, before_modules)
        after_params = list(model.named_parameters(remove_duplicate=False))
        self.assertEqual([(n, id(p)) for n, p in after_params], [(n, i) for n, i, _, _ in before_params])
        for (_, p), (_, _, value, requires_grad) in zip(after_params, before_params):
            self.assertTrue(torch.equal(p, value))
            self.assertEqual(p.requires_grad, requires_grad)
        for m in model.modules():
            self.assertFalse(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks)

    def test_order_is_named_modules_order(self) -> None:
        units = select(self.model, always_wrap_policy)
        order = [m for m in self.model.modules() if m is not self.model]
        self.assertEqual([id(m) for m in units], [id(m) for m in order])


class WrapContextTest(TestCase):
    def test_wrap_outside_returns_the_module(self) -> None:
        linear = nn.Linear(2, 2)
        self.assertIs(wrap(linear), linear)
        self.assertIs(wrap(linear, sharding_strategy="x"), linear)

    def test_wrap_inside(self) -> None:
        linear = nn.Linear(2, 2)
        with enable_wrap(wrapper_cls=Recorder, forward_prefetch=True, limit_all_gathers=True):
            wrapped = wrap(linear, limit_all_gathers=False, device_id=0)
        self.assertIsInstance(wrapped, Recorder)
        self.assertIs(getattr(wrapped, WRAPPED_MODULE), linear)
        self.assertEqual(wrapped.kwargs, {"forward_prefetch": True, "limit_all_gathers": False, "device_id": 0})
        self.assertIs(wrap(linear), linear)

    def test_nested(self) -> None:
        linear = nn.Linear(2, 2)
        with enable_wrap(wrapper_cls=Recorder, forward_prefetch=True):
            with self.assertRaises(NotImplementedError) as caught:
                with enable_wrap(wrapper_cls=Recorder):
                    pass
            self.assertExpectedInline(
                str(caught.exception),
                """enable_wrap cannot be nested: this one is inside another enable_wrap (wrapper_cls=Recorder); leave the outer one first""",
            )
            self.assertEqual(wrap(linear).kwargs, {"forward_prefetch": True})  # the outer context is intact
        self.assertIs(wrap(linear), linear)
        with self.assertRaises(NotImplementedError):
            with torch_wrap.enable_wrap(wrapper_cls=Recorder):
                with torch_wrap.enable_wrap(wrapper_cls=Recorder):
                    pass

    def test_context_restored_after_an_exception(self) -> None:
        linear = nn.Linear(2, 2)
        with self.assertRaises(RuntimeError):
            with enable_wrap(wrapper_cls=Recorder):
                raise RuntimeError("boom")
        self.assertIs(wrap(linear), linear)
        with enable_wrap(wrapper_cls=Recorder):
            self.assertIsInstance(wrap(linear), Recorder)


class ErrorTest(TestCase):
    def error(self, fn: Callable[[], Any]) -> str:
        with self.assertRaises(TypeError) as caught:
            fn()
        return str(caught.exception)

    def setUp(self) -> None:
        self.model = Transformer()

    def test_policy_of_the_wrong_type(self) -> None:
        self.assertExpectedInline(
            self.error(lambda: select(self.model, 3)),
            """auto_wrap_policy must be a callable policy (such as functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})), a ModuleWrapPolicy or a CustomPolicy; got an object of type int""",
        )
        self.assertExpectedInline(
            self.error(lambda: select(self.model, None)),
            """auto_wrap_policy must be a callable policy (such as functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})), a ModuleWrapPolicy or a CustomPolicy; got an object of type NoneType""",
        )

    def test_custom_policy_bad_result(self) -> None:
        model = self.model
        self.assertExpectedInline(
            self.error(lambda: select(model, CustomPolicy(lambda m: "yes" if m is model.layers[1].attn else False))),
            """CustomPolicy's lambda_fn must return True, False or a dict of constructor keyword arguments, but it returned 'yes' for module 'layers.1.attn' (MultiheadAttention)""",
        )
        self.assertExpectedInline(
            self.error(lambda: select(model, CustomPolicy(lambda m: 1))),
            """CustomPolicy's lambda_fn must return True, False or a dict of constructor keyword arguments, but it returned 1 for the root module (Transformer)""",
        )

    def test_custom_policy_names_wrapped_paths_cleanly(self) -> None:
        model = self.model
        model.layers[0].mlp = Recorder(model.layers[0].mlp)  # not "already wrapped" for this call
        self.assertExpectedInline(
            self.error(lambda: select(model, CustomPolicy(lambda m: None if isinstance(m, nn.GELU) else False))),
            """CustomPolicy's lambda_fn must return True, False or a dict of constructor keyword arguments, but it returned None for module 'layers.0.mlp.1' (GELU)""",
        )

    def test_custom_policy_bad_override(self) -> None:
        model = self.model
        self.assertExpectedInline(
            self.error(lambda: select(model, CustomPolicy(lambda m: isinstance(m, Layer) and {"sharding": 1}))),
            """CustomPolicy's lambda_fn returned the override 'sharding' for module 'layers.0' (Layer), which is not a constructor argument; the arguments are process_group, sharding_strategy, cpu_offload, auto_wrap_policy, backward_prefetch, mixed_precision, ignored_modules, param_init_fn, device_id, sync_module_states, forward_prefetch, limit_all_gathers, use_orig_params, ignored_states, device_mesh""",
        )
        self.assertExpectedInline(
            self.error(lambda: select(model, CustomPolicy(lambda m: {"module": m} if m is model.norm else False))),
            """CustomPolicy's lambda_fn returned an override of 'module' for module 'norm' (LayerNorm); the module of a unit is the module itself and cannot be overridden""",
        )

    def test_module_classes(self) -> None:
        model = self.model
        transformer = transformer_auto_wrap_policy
        self.assertExpectedInline(
            self.error(lambda: ModuleWrapPolicy(Layer)),
            """module_classes must be a set of nn.Module subclasses, e.g. {Layer}; got the class Layer itself""",
        )
        self.assertExpectedInline(
            self.error(lambda: ModuleWrapPolicy([Layer, int])),
            """module_classes must be a set of nn.Module subclasses; got [<class 'tests.test_wrap.Layer'>, <class 'int'>], which holds <class 'int'>, not an nn.Module subclass""",
        )
        self.assertExpectedInline(
            self.error(lambda: select(model, functools.partial(transformer, transformer_layer_cls=Layer))),
            """transformer_layer_cls must be a set of nn.Module subclasses, e.g. {Layer}; got the class Layer itself""",
        )
        self.assertExpectedInline(
            self.error(lambda: select(model, functools.partial(transformer, transformer_layer_cls="L"))),
            """transformer_layer_cls must be a set of nn.Module subclasses, e.g. {TransformerBlock}; got 'L'""",
        )
        self.assertExpectedInline(
            self.error(lambda: CustomPolicy({})),
            """CustomPolicy needs a callable lambda_fn (module -> bool or dict); got {}""",
        )
        self.assertExpectedInline(
            self.error(lambda: enable_wrap(wrapper_cls=None).__enter__()),
            """enable_wrap needs a wrapper class as wrapper_cls, e.g. ShardedDataParallel; got None""",
        )
