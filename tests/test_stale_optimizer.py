"""An optimizer built before wrapping raises at its first step, naming a parameter as the user
does (its path from the outermost wrapper at that moment); optimizers built after wrapping, and
optimizers of other models, are left alone; the check looks at an optimizer's parameters only
when its param groups change; the global hook goes away with the model, also when the model is
collected in the middle of another optimizer's step."""

import gc
import weakref
from unittest import mock

import torch
from expecttest import TestCase
from torch import nn
from torch.optim import optimizer as torch_optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

import flatshard._engine._stale_optimizer as stale_optimizer
from flatshard import ModuleWrapPolicy, ShardedDataParallel
from tests._models import Block, batch, build, error_text, lm_loss, local, wrap

LR = 0.1


def _global_hooks():
    """How many global optimizer step pre-hooks torch holds."""
    return len(torch_optimizer._global_optimizer_pre_hooks)


def _backward(model, rank, world_size):
    tokens, targets = batch(0, world_size)
    lm_loss(model(local(tokens, rank)), local(targets, rank)).backward()


def _wrapped(model, how):
    if how == "single":
        return ShardedDataParallel(model)
    if how == "auto":
        return ShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    return wrap(model, "nested")  # each block by hand, then the root


def _built_before_wrapping(rank, world_size, how):
    """Two optimizers built before wrapping (the whole model, block 1): each one's first step
    raises, and so does the next; the messages are the same however the model was wrapped."""
    gc.collect()
    hooks = _global_hooks()
    model = build()
    whole = torch.optim.SGD(model.parameters(), lr=LR)
    block = torch.optim.AdamW(model.blocks[1].parameters(), lr=LR)
    model = _wrapped(model, how)
    registered = _global_hooks() - hooks  # one per root: the nested wrappers' are gone
    _backward(model, rank, world_size)
    messages = [error_text(optim.step, ValueError) for optim in (whole, block, whole)]
    return messages, registered


def _nested_later(rank, world_size):
    """An optimizer of block 0's parameters, built before anything was wrapped: stepped after
    block 0 was wrapped by hand, then after the model around it was wrapped too."""
    gc.collect()
    hooks = _global_hooks()
    model = build()
    optim = torch.optim.SGD(model.blocks[0].parameters(), lr=LR)
    model.blocks[0] = ShardedDataParallel(model.blocks[0])
    inner_only = (error_text(optim.step, ValueError), _global_hooks() - hooks)
    model = ShardedDataParallel(model)
    _backward(model, rank, world_size)
    return inner_only, (error_text(optim.step, ValueError), _global_hooks() - hooks)


class BuiltBeforeWrappingTest(TestCase):
    def test_first_step_raises_naming_a_parameter(self):
        for how in ("single", "auto", "nested"):
            for messages, registered in self.pool.run(_built_before_wrapping, 2, how):
                whole, block, again = messages
                self.assertExpectedInline(
                    whole,
                    """SGD.step(): this optimizer holds parameter 'embed.weight' of the wrapped TinyLM (and 20 more of its parameters) as it was before ShardedDataParallel wrapped the model; wrapping moved its values into a FlatParameter and left it empty (0 elements), so this optimizer would train nothing. Create the optimizer after wrapping, from the wrapped model's parameters: SGD(model.parameters(), ...)""",
                )
                self.assertExpectedInline(
                    block,
                    """AdamW.step(): this optimizer holds parameter 'blocks.1.norm.weight' of the wrapped TinyLM (and 5 more of its parameters) as it was before ShardedDataParallel wrapped the model; wrapping moved its values into a FlatParameter and left it empty (0 elements), so this optimizer would train nothing. Create the optimizer after wrapping, from the wrapped model's parameters: AdamW(model.parameters(), ...)""",
                )
                self.assertEqual(again, whole)
                self.assertEqual(registered, 1, how)

    def test_names_follow_later_nesting(self):
        for inner_only, nested in self.pool.run(_nested_later, 2):
            self.assertExpectedInline(
                inner_only[0],
                """SGD.step(): this optimizer holds parameter 'norm.weight' of the wrapped Block (and 5 more of its parameters) as it was before ShardedDataParallel wrapped the model; wrapping moved its values into a FlatParameter and left it empty (0 elements), so this optimizer would train nothing. Create the optimizer after wrapping, from the wrapped model's parameters: SGD(model.parameters(), ...)""",
            )
            self.assertExpectedInline(
                nested[0],
                """SGD.step(): this optimizer holds parameter 'blocks.0.norm.weight' of the wrapped TinyLM (and 5 more of its parameters) as it was before ShardedDataParallel wrapped the model; wrapping moved its values into a FlatParameter and left it empty (0 elements), so this optimizer would train nothing. Create the optimizer after wrapping, from the wrapped model's parameters: SGD(model.parameters(), ...)""",
            )
            self.assertEqual((inner_only[1], nested[1]), (1, 1))  # the block's hook gave way to the root's


def _counting():
    """``_stale_params`` patched to count its calls (each is a look at an optimizer's parameters)."""
    calls = []
    original = stale_optimizer._stale_params

    def counted(unit, groups):
        calls.append(len(groups))
        return original(unit, groups)

    return mock.patch.object(stale_optimizer, "_stale_params", counted), calls


def _after_wrapping(rank, world_size):
    """Optimizers built after wrapping, and one of a plain model, step normally; the parameters
    are looked at once per optimizer and change of param groups; a stale parameter added by
    add_param_group is caught at the next step."""
    gc.collect()  # (models of earlier tasks in this process, with their hooks)
    model = build()
    stale = model.norm.weight
    model = wrap(model, "nested")
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    plain = nn.Linear(3, 2)
    plain_optim = torch.optim.SGD(plain.parameters(), lr=LR)
    patch, calls = _counting()
    seen = {}
    with patch:
        for step in range(3):
            _backward(model, rank, world_size)
            before = [p.detach().clone() for p in model.parameters()]
            optim.step()
            optim.zero_grad()
            seen.setdefault("wrapped_trains", []).append(all(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
            plain(torch.ones(1, 3)).sum().backward()
            expected = [p.detach() - LR * p.grad for p in plain.parameters()]
            plain_optim.step()
            plain_optim.zero_grad()
            seen.setdefault("plain_trains", []).append(all(torch.equal(e, p) for e, p in zip(expected, plain.parameters())))
        seen["looks"] = list(calls)  # (the hook runs for every optimizer: each looked at once)
        optim.add_param_group({"params": [stale], "lr": 0.0})
        seen["added"] = error_text(optim.step, ValueError)
        plain_optim.step()
        seen["looks_after"] = list(calls)
    return seen


class BuiltAfterWrappingTest(TestCase):
    def test_trains_and_is_checked_once_per_param_groups(self):
        seen = self.pool.run(_after_wrapping, 1)[0]
        self.assertEqual(seen["wrapped_trains"], [True, True, True])
        self.assertEqual(seen["plain_trains"], [True, True, True])
        self.assertEqual(seen["looks"], [1, 1])
        self.assertEqual(seen["looks_after"], [1, 1, 2])  # add_param_group: looked at again
        self.assertExpectedInline(
            seen["added"],
            """SGD.step(): this optimizer holds parameter 'norm.weight' of the wrapped TinyLM as it was before ShardedDataParallel wrapped the model; wrapping moved its values into a FlatParameter and left it empty (0 elements), so this optimizer would train nothing. Create the optimizer after wrapping, from the wrapped model's parameters: SGD(model.parameters(), ...)""",
        )


def _lifetime(rank, world_size):
    """The hooks of deleted models go away: at a collection outside any optimizer step, and
    when the collection runs inside another optimizer's step (there, after the next one)."""
    gc.collect()
    hooks = _global_hooks()
    counts = {}
    models = [wrap(build(), "nested"), ShardedDataParallel(build(), auto_wrap_policy=ModuleWrapPolicy({Block}))]
    refs = [weakref.ref(m) for m in models]
    counts["two models"] = _global_hooks() - hooks
    del models
    gc.collect()
    counts["deleted"] = _global_hooks() - hooks
    counts["collected"] = all(ref() is None for ref in refs)

    holder = [wrap(build(), "nested")]
    ref = weakref.ref(holder[0])
    param = nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    optim = torch.optim.SGD([param], lr=LR)

    def collect_inside_the_step(optimizer, args, kwargs):
        holder.clear()
        gc.collect()  # the model dies while torch iterates the global hooks

    # (torch notices a removal during its loop over the hooks only if another hook follows)
    user_hooks = [register_optimizer_step_pre_hook(fn) for fn in (collect_inside_the_step, lambda *args: None)]
    optim.step()  # must not fail with "OrderedDict mutated during iteration"
    for user_hook in user_hooks:
        user_hook.remove()
    counts["collected in a step"] = ref() is None
    counts["stepped"] = torch.equal(param.detach(), torch.ones(2) - LR)
    gc.collect()
    counts["after the next collection"] = _global_hooks() - hooks
    return counts


class LifetimeTest(TestCase):
    def test_hooks_go_away_with_their_models(self):
        counts = self.pool.run(_lifetime, 1)[0]
        self.assertEqual(
            counts,
            {
                "two models": 2,
                "deleted": 0,
                "collected": True,
                "collected in a step": True,
                "stepped": True,
                "after the next collection": 0,
            },
        )


# -- weight-decay groups chosen by p.dim() after wrapping ----------------------------------------


def _groups_by_dim(model):
    """nanoGPT's grouping: matrices decay, the rest do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _decay_by_dim_warning(rank, world_size, orig, by_name):
    """The warning once per model, naming a matrix and the fix; none for groups chosen by name."""
    import warnings

    model = wrap(build(), "nested", use_orig_params=orig)
    if by_name:
        named = list(model.named_parameters())
        groups = [
            {"params": [p for n, p in named if n.endswith("weight") and "norm" not in n], "weight_decay": 0.1},
            {"params": [p for n, p in named if not (n.endswith("weight") and "norm" not in n)], "weight_decay": 0.0},
        ]
    else:
        groups = _groups_by_dim(model)
    optim = torch.optim.AdamW(groups, lr=LR)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            _backward(model, rank, world_size)
            optim.step()
            optim.zero_grad()
        if not by_name:
            torch.optim.AdamW(_groups_by_dim(model), lr=LR).step()  # another optimizer, same model: warned already
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning) and "p.dim()" in str(w.message)]


class DecayGroupsByDimTest(TestCase):
    def test_groups_chosen_by_dim_after_wrapping_warn_once_naming_the_fix(self):
        orig, flat = self.pool.run(_decay_by_dim_warning, 2, True, False)[0], self.pool.run(_decay_by_dim_warning, 2, False, False)[0]
        self.assertExpectedInline(
            "\n".join(orig + flat),
            """\
AdamW param group 0 (weight_decay=0.1) holds no parameters, while group 1 (weight_decay=0.0) holds 'embed.weight', a matrix before wrapping: groups chosen by p.dim() after wrapping see every sharded parameter as 1-D and decay nothing (as with FSDP1); choose the groups by name (named_parameters() gives the unwrapped model's names), or build the optimizer before wrapping
AdamW param group 0 (weight_decay=0.1) holds no parameters, while group 1 (weight_decay=0.0) holds 'embed.weight', a matrix before wrapping: groups chosen by p.dim() after wrapping see every sharded parameter as 1-D and decay nothing (as with FSDP1); wrap with use_orig_params=True and choose the groups by name, or build the optimizer before wrapping with use_orig_params=True""",
        )
        self.assertEqual(self.pool.run(_decay_by_dim_warning, 2, True, True), [[], []])
