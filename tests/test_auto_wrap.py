"""Auto-wrap policies build the unit tree FSDP1 would, place tied parameters where they train
right, group frozen and mixed-dtype parameters, and train identically to one process."""

import functools

import torch
from expecttest import TestCase
from torch import nn

from flatshard import BackwardPrefetch, ShardedDataParallel, ShardingStrategy
from flatshard.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    _or_policy,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from tests._models import (
    Layer,
    assert_same_training,
    batch,
    full_params,
    global_mean,
    lm_loss,
    local,
    make_optim,
    sample_transformer,
    unit_tree,
)
from tests._spy import recording


def _is_sequential(module):
    return isinstance(module, nn.Sequential)


def _is_embedding(module):
    return isinstance(module, nn.Embedding)


def _layers_zero2(module):
    return {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP} if isinstance(module, Layer) else False


POLICIES = {
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


def _train_with_policy(rank, world_size, policy_name, model_options=None, steps=1, **options):
    """Wrap a sample transformer by the policy; train ``steps`` AdamW steps next to the
    single-process reference; return the unit tree."""
    model_options = model_options or {}
    reference = sample_transformer(**model_options)
    model = ShardedDataParallel(sample_transformer(**model_options), auto_wrap_policy=POLICIES[policy_name](), **options)
    ref_optim, optim = make_optim(reference.parameters()), make_optim(model.parameters())
    ref_losses, losses = [], []
    for step in range(steps):
        tokens, targets = batch(step, world_size)
        for m, o, out, x, y in ((reference, ref_optim, ref_losses, tokens, targets), (model, optim, losses, local(tokens, rank), local(targets, rank))):
            o.zero_grad()
            loss = lm_loss(m(x), y)
            loss.backward()
            o.step()
            out.append(loss.item() if m is reference else global_mean(loss))
    ref_params = {n: p.detach().clone() for n, p in reference.named_parameters(remove_duplicate=False)}
    assert_same_training((ref_losses, ref_params), (losses, full_params(model)))
    return unit_tree(model)


class PolicyTreeTest(TestCase):
    def tree(self, policy_name, **kwargs):
        trees = self.pool.run(_train_with_policy, 2, policy_name, **kwargs)
        self.assertEqual(trees[0], trees[1])
        return trees[0]

    def test_always_wrap_policy(self):
        self.assertExpectedInline(self.tree("always"), """\
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
        # embed and head both become units; their shared weight goes to the lowest unit
        # containing both (the root) and trains like single-process (FSDP1 trains it wrong)
        self.assertExpectedInline(self.tree("size_based_100"), """\
<root>: SampleTransformer [float32 11p/184]
embed: Embedding [no parameters]
layers.0.attn: Attention [float32 7p/280]
layers.0.mlp.0: Linear [float32 2p/144]
layers.0.mlp.2: Linear [float32 2p/136]
layers.1.attn: Attention [float32 7p/280]
layers.1.mlp.0: Linear [float32 2p/144]
layers.1.mlp.2: Linear [float32 2p/136]
head: Linear [no parameters]""")

    def test_transformer_policy(self):
        self.assertExpectedInline(self.tree("transformer"), """\
<root>: SampleTransformer [float32 3p/120]
layers.0: Layer [float32 15p/592]
layers.1: Layer [float32 15p/592]""")

    def test_lambda_policy(self):
        self.assertExpectedInline(self.tree("lambda"), """\
<root>: SampleTransformer [float32 25p/744]
layers.0.mlp: Sequential [float32 4p/280]
layers.1.mlp: Sequential [float32 4p/280]""")

    def test_or_policy(self):
        self.assertExpectedInline(self.tree("or"), """\
<root>: SampleTransformer [float32 3p/120]
embed: Embedding [no parameters]
layers.0: Layer [float32 15p/592]
layers.1: Layer [float32 15p/592]""")

    def test_module_wrap_policy(self):
        self.assertExpectedInline(self.tree("module_wrap"), """\
<root>: SampleTransformer [float32 3p/120]
layers.0: Layer [float32 15p/592]
layers.1: Layer [float32 15p/592]""")

    def test_custom_policy_with_per_unit_overrides(self):
        self.assertExpectedInline(self.tree("custom"), """\
<root>: SampleTransformer [float32 3p/120]
layers.0: Layer [float32 15p/592] SHARD_GRAD_OP
layers.1: Layer [float32 15p/592] SHARD_GRAD_OP""")


class FrozenAndMixedTest(TestCase):
    """Part of each layer frozen (attention) and a float64 parameter next to float32 ones:
    each unit gets one FlatParameter per (dtype, requires_grad) group."""

    def test_parity_with_frozen_and_mixed_dtype_parameters_in_each_unit(self):
        options = {"frozen_attention": True, "float64_gain": True}
        for world_size in (2, 3):
            trees = self.pool.run(_train_with_policy, world_size, "transformer", model_options=options, steps=3)
        self.assertExpectedInline(trees[0], """\
<root>: SampleTransformer [float32 3p/120]
layers.0: Layer [float64 1p/8, float32 8p/312, float32 frozen 7p/280]
layers.1: Layer [float64 1p/8, float32 8p/312, float32 frozen 7p/280]""")

    def test_frozen_groups_get_no_gradient_and_no_reduction(self):
        (report,) = self.pool.run(_frozen_group_report, 2)[:1]
        self.assertExpectedInline(report, """\
collectives: {'all_gather': 9, 'reduce_scatter': 3}
<root> _flat_param: requires_grad=True grad=(60,)
layers.0 _flat_param: requires_grad=True grad=(156,)
layers.0 _flat_param_1: requires_grad=False grad=none
layers.1 _flat_param: requires_grad=True grad=(156,)
layers.1 _flat_param_1: requires_grad=False grad=none""")


def _frozen_group_report(rank, world_size):
    with recording() as rec:
        model = ShardedDataParallel(
            sample_transformer(frozen_attention=True),
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Layer}),
        )
        rec.attach(model)
        tokens, targets = (local(t, rank) for t in batch(0, world_size))
        lm_loss(model(tokens), targets).backward()
    lines = [f"collectives: {dict(rec.collectives)}"]
    for m in ShardedDataParallel.fsdp_modules(model):
        for h in m.handles:
            lines.append(
                f"{m._unit.name or '<root>'} {h.attr_name}: requires_grad={h.requires_grad} "
                f"grad={'none' if h.flat_param.grad is None else tuple(h.flat_param.grad.shape)}"
            )
    return "\n".join(lines)


class Gain(nn.Module):
    """Frozen and trainable parameters, and a second input that is a leaf (its gradient is
    complete before the frozen parameter's work is done)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8), requires_grad=False)
        self.gain = nn.Parameter(torch.linspace(-1.0, 1.0, 8))
        self.fc = nn.Linear(8, 8)

    def forward(self, x, z):
        return self.fc(x) * (self.scale * self.gain) + z


class LeafInputModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = Gain()
        self.out = nn.Linear(8, 8)

    def forward(self, x, z):
        return self.out(self.g(x, z))


class SharedBlock(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.own = nn.Linear(8, 8)
        self.shared = shared

    def forward(self, x):
        return torch.tanh(self.shared(self.own(x)))


class SharedModuleModel(nn.Module):
    """One Linear registered inside two blocks that become separate units."""

    def __init__(self):
        super().__init__()
        shared = nn.Linear(8, 8)
        self.a = SharedBlock(shared)
        self.b = SharedBlock(shared)

    def forward(self, x, z=None):
        return self.b(self.a(x))


def _tied_across_layers():
    model = sample_transformer()
    model.layers[1].mlp[2].bias = model.layers[0].mlp[2].bias  # lowest common unit: the ModuleList
    return model


SMALL_MODELS = {"leaf_input": LeafInputModel, "shared_module": SharedModuleModel}


def _small_parity(rank, world_size, name, policy, steps=3, **options):
    """Float-input models: MSE against targets, 3 SGD-momentum steps next to one process."""
    torch.manual_seed(0)
    reference = SMALL_MODELS[name]()
    torch.manual_seed(0)
    model = ShardedDataParallel(SMALL_MODELS[name](), auto_wrap_policy=policy, **options)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(7)
    for step in range(steps):
        x, z, y = (torch.randn(world_size * 2, 8, generator=gen) for _ in range(3))
        ref_optim.zero_grad()
        torch.nn.functional.mse_loss(reference(x, z.requires_grad_()), y).backward()
        ref_optim.step()
        optim.zero_grad()
        part = slice(rank * 2, rank * 2 + 2)
        torch.nn.functional.mse_loss(model(x[part], z[part].detach().requires_grad_()), y[part]).backward()
        optim.step()
    expected = {n: p.detach() for n, p in reference.named_parameters(remove_duplicate=False)}
    got = full_params(model)
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    return unit_tree(model)


def _tied_container_parity(rank, world_size):
    reference, model = _tied_across_layers(), _tied_across_layers()
    model = ShardedDataParallel(model, auto_wrap_policy=always_wrap_policy)
    ref_optim, optim = make_optim(reference.parameters()), make_optim(model.parameters())
    for step in range(2):
        tokens, targets = batch(step, world_size)
        ref_optim.zero_grad()
        lm_loss(reference(tokens), targets).backward()
        ref_optim.step()
        optim.zero_grad()
        lm_loss(model(local(tokens, rank)), local(targets, rank)).backward()
        optim.step()
    got = full_params(model)
    for n, p in reference.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(got[n], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    return [(m._unit.name, s.name) for m in ShardedDataParallel.fsdp_modules(model) for h in m.handles for s in h.shared_param_infos]


class HarderCasesTest(TestCase):
    def test_frozen_and_mixed_groups_with_every_prefetch_mode(self):
        options = {"frozen_attention": True, "float64_gain": True}
        for prefetch in (None, BackwardPrefetch.BACKWARD_POST):
            self.pool.run(_train_with_policy, 3, "transformer", model_options=options, steps=2, backward_prefetch=prefetch)

    def test_frozen_and_mixed_unit_used_twice(self):
        options = {"frozen_attention": True, "float64_gain": True, "reuse_first_layer": True}
        for prefetch in (None, BackwardPrefetch.BACKWARD_PRE):
            self.pool.run(_train_with_policy, 2, "transformer", model_options=options, steps=2, backward_prefetch=prefetch)

    def test_leaf_input_into_a_unit_with_frozen_parameters(self):
        tree = self.pool.run(_small_parity, 2, "leaf_input", ModuleWrapPolicy({Gain}))[0]
        self.assertExpectedInline(tree, """\
<root>: LeafInputModel [float32 2p/72]
g: Gain [float32 frozen 1p/8, float32 3p/80]""")

    def test_module_shared_by_two_units_is_owned_by_their_common_unit(self):
        tree = self.pool.run(_small_parity, 2, "shared_module", ModuleWrapPolicy({SharedBlock}))[0]
        self.assertExpectedInline(tree, """\
<root>: SharedModuleModel [float32 2p/72]
a: SharedBlock [float32 2p/72]
b: SharedBlock [float32 2p/72]""")

    def test_tie_whose_common_unit_is_a_container_goes_to_the_unit_around_it(self):
        # (always_wrap makes the ModuleList a unit, but it never runs: the root owns the tie)
        shared = self.pool.run(_tied_container_parity, 2)[0]
        self.assertIn(("", "layers.1.mlp.2.bias"), shared)
