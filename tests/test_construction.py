"""Construction options: deferred (meta-device) initialisation unit by unit,
sync_module_states, ignored modules and states, already-wrapped submodules."""

import torch
from expecttest import TestCase
from torch import nn

from flatshard import FlatParameter, ShardedDataParallel
from flatshard.wrap import ModuleWrapPolicy
from tests._memory import track_allocations
from tests._models import (
    Block,
    TinyLM,
    assert_same_training,
    batch,
    build,
    full_params,
    lm_loss,
    local,
    train_reference,
    unit_tree,
)

BLOCKS = ModuleWrapPolicy({Block})


def _stack(blocks=16, dim=32):
    return nn.Sequential(*[Block(dim) for _ in range(blocks)])


def _deferred_memory(rank, world_size, deferred):
    """Peak bytes allocated while building a 16-block stack, wrapped by block."""
    with track_allocations() as tracker:
        if deferred:
            with torch.device("meta"):
                module = _stack()
        else:
            module = _stack()
        model = ShardedDataParallel(module, auto_wrap_policy=BLOCKS)
    full_bytes = sum(h.numel * 4 for m in ShardedDataParallel.fsdp_modules(model) for h in m.handles)
    layer_norm = model.module[3].module.norm
    return {
        "peak_over_full": tracker.peak_bytes / full_bytes,
        "kept_over_full": tracker.live_bytes() / full_bytes,
        "units": len(ShardedDataParallel.fsdp_modules(model)),
        "initialised": bool(_gathered_equal(model, layer_norm)),
    }


def _gathered_equal(model, layer_norm):
    """reset_parameters() ran: LayerNorm weights are ones and biases zeros."""
    params = full_params(model)
    return all(torch.equal(params[f"{i}.norm.weight"], torch.ones(32)) for i in range(16)) and all(
        torch.equal(params[f"{i}.norm.bias"], torch.zeros(32)) for i in range(16)
    )


def _linspace_init(module):
    """A deterministic param_init_fn: materialise the module's own tensors, fill each with a
    ramp that depends only on its size."""
    module.to_empty(device="cpu", recurse=False)
    with torch.no_grad():
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            tensor.copy_(torch.linspace(-0.5, 0.5, tensor.numel()).view_as(tensor))


def _deferred_with_init_fn(rank, world_size):
    """A tied-embedding model built on the meta device, materialised by param_init_fn unit by
    unit, equals the same model built eagerly and initialised the same way, and trains the same."""
    reference = TinyLM()
    reference.apply(_linspace_init)
    with torch.device("meta"):
        module = TinyLM()
    model = ShardedDataParallel(module, auto_wrap_policy=BLOCKS, param_init_fn=_linspace_init)
    expected = {n: p.detach().clone() for n, p in reference.named_parameters(remove_duplicate=False)}
    got = full_params(model)
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)
    torch.testing.assert_close(model.module.pos, reference.pos, rtol=0, atol=0)
    tokens, targets = batch(0, world_size)
    loss = lm_loss(model(local(tokens, rank)), local(targets, rank))
    torch.testing.assert_close(loss, lm_loss(reference(local(tokens, rank)), local(targets, rank)))


def _deferred_without_reset_parameters(rank, world_size):
    with torch.device("meta"):
        module = TinyLM()  # its own buffer 'pos' is on the meta device, and it has no reset_parameters()
    ShardedDataParallel(module, auto_wrap_policy=BLOCKS)


def _sync_module_states(rank, world_size):
    """Ranks build different weights and buffers; sync_module_states makes rank 0's win."""
    module = build(seed=rank)
    module.pos.add_(rank)
    model = ShardedDataParallel(module, auto_wrap_policy=BLOCKS, sync_module_states=True)
    expected = build(seed=0)
    torch.testing.assert_close(model.module.pos, expected.pos, rtol=0, atol=0)
    got = full_params(model)
    for name, param in expected.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(got[name], param.detach(), rtol=0, atol=0)
    # and trains like one process from rank 0's initialisation
    from tests._models import _train

    losses = _train(model, world_size, 3, 1, rank)
    assert_same_training(train_reference(world_size, steps=3), (losses, full_params(model)))


def _ignored(rank, world_size, how):
    """blocks.1 ignored: its parameters stay ordinary, full-size and local; the rest is
    sharded and reduced as usual."""
    module = build()
    ignored = module.blocks[1]
    options = {"ignored_modules": [ignored]} if how == "modules" else {"ignored_states": list(ignored.parameters())}
    model = ShardedDataParallel(module, auto_wrap_policy=BLOCKS, **options)
    plain = [(n, tuple(p.shape)) for n, p in model.named_parameters() if not isinstance(p, FlatParameter)]
    tokens, targets = batch(0, world_size)
    lm_loss(model(local(tokens, rank)), local(targets, rank)).backward()
    reference, local_reference = build(), build()
    lm_loss(reference(tokens), targets).backward()
    lm_loss(local_reference(local(tokens, rank)), local(targets, rank)).backward()
    # the ignored block's gradient is this rank's own (not averaged) ...
    for name, param in ignored.named_parameters():
        torch.testing.assert_close(param.grad, local_reference.blocks[1].get_parameter(name).grad)
    # ... every other gradient is the global one
    for m in ShardedDataParallel.fsdp_modules(model):
        for h in m.handles:
            ref = torch.cat([reference.get_parameter(_full(m, i.name)).grad.reshape(-1) for i in h.param_infos])
            ref = torch.nn.functional.pad(ref, (0, h.padded_numel - h.numel))
            torch.testing.assert_close(h.flat_param.grad, ref[rank * h.shard_numel : (rank + 1) * h.shard_numel])
    return unit_tree(model), plain


def _full(unit_module, name):
    return f"{unit_module._unit.name}.{name}" if unit_module._unit.name else name


def _already_wrapped_left_alone(rank, world_size):
    module = build()
    module.blocks[0] = ShardedDataParallel(module.blocks[0])
    first = module.blocks[0]
    model = ShardedDataParallel(module, auto_wrap_policy=BLOCKS)
    from tests._models import _train

    losses = _train(model, world_size, 2, 1, rank)
    assert_same_training(train_reference(world_size, steps=2), (losses, full_params(model)))
    return model.module.blocks[0] is first, unit_tree(model)


class DeferredInitTest(TestCase):
    def test_peak_memory_is_about_one_unit_beyond_the_shards(self):
        deferred = self.pool.run(_deferred_memory, 2, True)[0]
        eager = self.pool.run(_deferred_memory, 2, False)[0]
        self.assertEqual(deferred["units"], 17)
        self.assertTrue(deferred["initialised"])
        # the whole model never exists at once: shards (1/2) plus about one unit in flight
        self.assertLess(deferred["peak_over_full"], 0.7)
        self.assertAlmostEqual(deferred["kept_over_full"], 0.5, delta=0.02)
        # whereas building it first and then wrapping holds all of it
        self.assertGreaterEqual(eager["peak_over_full"], 1.0)

    def test_param_init_fn_materialises_unit_by_unit_keeping_ties(self):
        self.pool.run(_deferred_with_init_fn, 2)

    def test_meta_module_without_reset_parameters_is_refused(self):
        with self.assertRaises(ValueError) as caught:
            self.pool.run(_deferred_without_reset_parameters, 1)
        self.assertExpectedInline(str(caught.exception), """the module (TinyLM) was built on the meta device but neither it nor a module around it in its unit has reset_parameters() to initialise it; pass param_init_fn to ShardedDataParallel""")


class SyncModuleStatesTest(TestCase):
    def test_rank0_parameters_and_buffers_win(self):
        self.pool.run(_sync_module_states, 3)


class IgnoredTest(TestCase):
    def test_ignored_modules_stay_ordinary_and_unreduced(self):
        tree, plain = self.pool.run(_ignored, 2, "modules")[0]
        self.assertExpectedInline(tree, """\
<root>: TinyLM [float32 3p/120]
blocks.0: Block [float32 6p/296]
blocks.2: Block [float32 6p/296]""")
        self.assertExpectedInline(repr(plain), """[('_fsdp_wrapped_module.blocks.1.norm.weight', (8,)), ('_fsdp_wrapped_module.blocks.1.norm.bias', (8,)), ('_fsdp_wrapped_module.blocks.1.fc1.weight', (16, 8)), ('_fsdp_wrapped_module.blocks.1.fc1.bias', (16,)), ('_fsdp_wrapped_module.blocks.1.fc2.weight', (8, 16)), ('_fsdp_wrapped_module.blocks.1.fc2.bias', (8,))]""")

    def test_ignored_states_parameters(self):
        tree, plain = self.pool.run(_ignored, 2, "states")[0]
        self.assertExpectedInline(repr(plain), """[('_fsdp_wrapped_module.blocks.1._fsdp_wrapped_module.norm.weight', (8,)), ('_fsdp_wrapped_module.blocks.1._fsdp_wrapped_module.norm.bias', (8,)), ('_fsdp_wrapped_module.blocks.1._fsdp_wrapped_module.fc1.weight', (16, 8)), ('_fsdp_wrapped_module.blocks.1._fsdp_wrapped_module.fc1.bias', (16,)), ('_fsdp_wrapped_module.blocks.1._fsdp_wrapped_module.fc2.weight', (8, 16)), ('_fsdp_wrapped_module.blocks.1._fsdp_wrapped_module.fc2.bias', (8,))]""")

    def test_already_wrapped_submodules_are_left_alone(self):
        same, tree = self.pool.run(_already_wrapped_left_alone, 2)[0]
        self.assertTrue(same)
        self.assertExpectedInline(tree, """\
<root>: TinyLM [float32 3p/120]
blocks.0: Block [float32 6p/296]
blocks.1: Block [float32 6p/296]
blocks.2: Block [float32 6p/296]""")


def _recursive_init(module):
    module.to_empty(device="cpu")  # recurse=True: would re-allocate the units built inside


def _deferred_recursive_init_fn(rank, world_size):
    with torch.device("meta"):
        module = TinyLM()
    ShardedDataParallel(module, auto_wrap_policy=BLOCKS, param_init_fn=_recursive_init)


def _deferred_ties_train(rank, world_size):
    """The tie survives deferred initialisation: one FlatParameter entry with an alias, and
    training (where a split tie would drift apart) matches one process."""
    with torch.device("meta"):
        module = TinyLM()
    model = ShardedDataParallel(module, auto_wrap_policy=BLOCKS, param_init_fn=_linspace_init)
    aliases = [s.name for s in model.handle.shared_param_infos]
    reference = TinyLM()
    reference.apply(_linspace_init)
    from tests._models import _train

    losses = _train(model, world_size, 3, 1, rank)
    ref_losses = _train(reference, world_size, 3, 1, None)
    ref_params = {n: p.detach().clone() for n, p in reference.named_parameters(remove_duplicate=False)}
    assert_same_training((ref_losses, ref_params), (losses, full_params(model)))
    return aliases


class Scaled(nn.Module):
    """Its own reset_parameters() initialises its child: it must win over the child's."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def reset_parameters(self):
        with torch.no_grad():
            self.fc.weight.fill_(0.25)
            self.fc.bias.zero_()

    def forward(self, x):
        return self.fc(x)


def _parent_reset_wins(rank, world_size):
    with torch.device("meta"):
        module = nn.Sequential(Scaled(), Scaled())
    model = ShardedDataParallel(module, auto_wrap_policy=ModuleWrapPolicy({Scaled}))
    params = full_params(model)
    return sorted({float(v) for name, t in params.items() if name.endswith("weight") for v in t.flatten()})


def _sync_mismatch(rank, world_size):
    module = Block(8 if rank == 0 else 12)
    ShardedDataParallel(module, sync_module_states=True)


def _ignored_generator(rank, world_size):
    module = build()
    model = ShardedDataParallel(module, auto_wrap_policy=BLOCKS, ignored_modules=(m for m in [module.blocks[1]]))
    return unit_tree(model)


class MoreConstructionTest(TestCase):
    def test_recursive_param_init_fn_is_refused(self):
        with self.assertRaises(NotImplementedError) as caught:
            self.pool.run(_deferred_recursive_init_fn, 1)
        self.assertIn("use module.to_empty(device=..., recurse=False)", str(caught.exception))

    def test_deferred_init_keeps_ties_through_training(self):
        aliases = self.pool.run(_deferred_ties_train, 2)[0]
        self.assertEqual(aliases, ["head.weight"])

    def test_reset_parameters_of_a_parent_wins(self):
        self.assertEqual(self.pool.run(_parent_reset_wins, 2)[0], [0.25])

    def test_sync_module_states_with_different_modules_is_an_error_not_a_hang(self):
        with self.assertRaises(ValueError) as caught:
            self.pool.run(_sync_mismatch, 2, timeout=60)
        self.assertExpectedInline(str(caught.exception), """[rank 0] sync_module_states: the ranks built different modules to wrap, so rank 0's parameters and buffers cannot be broadcast: rank 0 has norm.weight (8,) torch.float32, rank 1 has norm.weight (12,) torch.float32""")

    def test_ignored_modules_may_be_a_generator(self):
        tree = self.pool.run(_ignored_generator, 2)[0]
        self.assertNotIn("blocks.1", tree)
