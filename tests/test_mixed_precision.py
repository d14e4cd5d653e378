"""Mixed precision: computation in param_dtype, reduction in reduce_dtype, full-precision
parameters for the optimizer, buffers in buffer_dtype, input casting, BatchNorm kept in full
precision; state dicts and summon_full_params in full precision.

The reference is single-process training that performs the same casts: an fp32 master model
whose values are copied into a low-precision compute model for each step's forward and
backward; the compute model's gradients, cast to fp32, drive the master's optimizer."""

import copy

import torch
from expecttest import TestCase
from torch import nn

from flatshard import MixedPrecision, ModuleWrapPolicy, ShardedDataParallel, ShardingStrategy, comm_hooks
from tests._models import batch, build, lm_loss, local, wrap

BF16 = torch.bfloat16
STEPS = 3
LR = 0.1


def _compute_copy(master, param_dtype, buffer_dtype):
    compute = copy.deepcopy(master)
    for param in compute.parameters():
        param.data = param.data.to(param_dtype)
    for module in compute.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point() and buffer_dtype is not None:
                module._buffers[name] = buf.to(buffer_dtype)
    return compute


def _reference(world_size, param_dtype, buffer_dtype, make=build, data=None):
    """SGD on the fp32 master with gradients from the low-precision compute copy."""
    master = make()
    optim = torch.optim.SGD(master.parameters(), lr=LR)
    for step in range(STEPS):
        compute = _compute_copy(master, param_dtype, buffer_dtype)
        inputs, targets = data(step, world_size) if data else batch(step, world_size)
        if inputs.is_floating_point():
            inputs = inputs.to(param_dtype)
        _loss(compute(inputs), targets).backward()
        for p, q in zip(master.parameters(), compute.parameters()):
            p.grad = q.grad.to(p.dtype)
        optim.step()
        optim.zero_grad()
    return {n: p.detach().clone() for n, p in master.named_parameters()}


def _loss(output, targets):
    if targets.is_floating_point():
        return ((output.float() - targets) ** 2).mean()
    return lm_loss(output.float(), targets)


def _train(model, rank, world_size, data=None):
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        inputs, targets = data(step, world_size) if data else batch(step, world_size)
        rows = inputs.shape[0] // world_size
        _loss(model(local(inputs, rank, rows)), local(targets, rank, rows)).backward()
        optim.step()
        optim.zero_grad()
    return model.state_dict()  # full precision, by the plain names


def _compare(actual, expected, tol, where):
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=tol, atol=tol, msg=lambda m: f"{where}: {name}: {m}")


def _parity(rank, world_size, tol):
    """bf16 compute with fp32 or bf16 reduction, every strategy; fp16 compute, NO_SHARD."""
    cases = [
        ("FULL_SHARD", MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32, buffer_dtype=BF16)),
        ("SHARD_GRAD_OP", MixedPrecision(param_dtype=BF16, buffer_dtype=BF16)),
        ("NO_SHARD", MixedPrecision(param_dtype=BF16, buffer_dtype=BF16)),
        ("FULL_SHARD", MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32, buffer_dtype=torch.float16)),
    ]
    for strategy, mp in cases:
        expected = _reference(world_size, mp.param_dtype, mp.buffer_dtype)
        model = wrap(build(), "nested", sharding_strategy=ShardingStrategy[strategy], mixed_precision=mp)
        _compare(_train(model, rank, world_size), expected, tol, f"{strategy}, {mp.param_dtype}")
    return True


def _dtypes(rank, world_size):
    """What is in which dtype, and when."""
    mp = MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32, buffer_dtype=BF16)
    model = wrap(build(), "nested", mixed_precision=mp)
    seen = {}
    model.blocks[0].module.fc1.register_forward_pre_hook(
        lambda module, args: seen.update(weight=module.weight.dtype, input=args[0].dtype)
    )
    reduced = []

    def recording(state, grad, output):
        reduced.append(grad.dtype)
        comm_hooks.reduce_scatter_hook(state, grad, output)

    model.register_comm_hook(comm_hooks.DefaultState(model.process_group), recording)
    tokens, targets = batch(0, world_size)
    seen["buffer"] = model.module.pos.dtype
    lm_loss(model(local(tokens, rank)).float(), local(targets, rank)).backward()
    seen["reduced"] = sorted({str(d) for d in reduced})
    seen["flat_param"] = model.blocks[0].module._flat_param.dtype
    seen["grad"] = model.blocks[0].module._flat_param.grad.dtype
    state = model.state_dict()
    seen["state_dict"] = sorted({str(v.dtype) for v in state.values()})
    with ShardedDataParallel.summon_full_params(model, with_grads=True):
        seen["summoned"] = sorted({str(p.dtype) for p in model.parameters()})
        seen["summoned_grads"] = sorted({str(p.grad.dtype) for p in model.parameters()})
    plain = build()
    plain.load_state_dict(state)  # full precision, loads into the plain model
    low = wrap(build(), "nested", mixed_precision=MixedPrecision(param_dtype=BF16, buffer_dtype=BF16, keep_low_precision_grads=True))
    lm_loss(low(local(tokens, rank)).float(), local(targets, rank)).backward()
    seen["low_grad"] = low.blocks[0].module._flat_param.grad.dtype
    torch.optim.SGD(low.parameters(), lr=LR).step()  # SGD accepts the low-precision gradient
    return {k: str(v) if isinstance(v, torch.dtype) else v for k, v in seen.items()}


class FloatNet(nn.Module):
    """Float inputs (for input casting) and a BatchNorm (kept in full precision)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.inp(x))))


def _float_net():
    torch.manual_seed(0)
    return FloatNet()


def _float_data(step, world_size):
    gen = torch.Generator().manual_seed(50 + step)
    return torch.randn(4 * world_size, 6, generator=gen), torch.randn(4 * world_size, 3, generator=gen)


class _BatchNormInFp32(nn.Module):
    """The reference's BatchNorm: fp32 parameters, fp32 computation, output cast back."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x.float()).to(x.dtype)


def _batchnorm(rank, world_size):
    """With an auto-wrap policy, BatchNorm becomes its own unit in full precision, its input
    cast to fp32 and its output back; inputs are cast at the root."""
    mp = MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32)
    model = ShardedDataParallel(_float_net(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), mixed_precision=mp)
    seen = {}
    model.module.norm.module.register_forward_pre_hook(lambda m, args: seen.update(norm_in=str(args[0].dtype), norm_weight=str(m.weight.dtype)))
    model.module.inp.module.register_forward_pre_hook(lambda m, args: seen.update(root_cast=str(args[0].dtype)))
    model.module.out.module.register_forward_pre_hook(lambda m, args: seen.update(after_norm=str(args[0].dtype)))
    actual = _train(model, rank, world_size, data=_float_data)

    def reference_model():
        net = _float_net()
        return net

    master = reference_model()
    optim = torch.optim.SGD(master.parameters(), lr=LR)
    for step in range(STEPS):
        compute = copy.deepcopy(master)
        for module in (compute.inp, compute.out):
            for param in module.parameters():
                param.data = param.data.to(BF16)
        compute.norm = _BatchNormInFp32(compute.norm)
        inputs, targets = _float_data(step, world_size)
        out = torch.cat([compute(local(inputs, r, 4).to(BF16)) for r in range(world_size)])  # BatchNorm statistics per rank
        _loss(out, targets).backward()
        for p, q in zip(master.parameters(), compute.parameters()):
            p.grad = q.grad.to(p.dtype)
        optim.step()
        optim.zero_grad()
    expected = {n: p.detach() for n, p in master.named_parameters()}
    _compare(actual, expected, 2e-2, "BatchNorm in full precision")
    return seen


class MixedPrecisionTest(TestCase):
    def test_training_matches_the_same_casts_in_one_process(self):
        self.pool.run(_parity, 1, 1e-6)  # one rank: the same operations in the same dtypes
        self.pool.run(_parity, 2, 2e-2)  # two ranks: per-rank low-precision gradients, averaged

    def test_dtypes_of_compute_reduction_gradients_buffers_and_state(self):
        seen = self.pool.run(_dtypes, 2)[0]
        self.assertEqual(
            seen,
            {
                "weight": "torch.bfloat16",
                "input": "torch.bfloat16",
                "buffer": "torch.bfloat16",
                "reduced": ["torch.float32"],
                "flat_param": "torch.float32",
                "grad": "torch.float32",
                "state_dict": ["torch.float32"],
                "summoned": ["torch.float32"],
                "summoned_grads": ["torch.float32"],
                "low_grad": "torch.bfloat16",
            },
        )

    def test_batchnorm_stays_in_full_precision(self):
        seen = self.pool.run(_batchnorm, 2)[0]
        self.assertEqual(
            seen,
            {"root_cast": "torch.bfloat16", "norm_in": "torch.float32", "norm_weight": "torch.float32", "after_norm": "torch.bfloat16"},
        )
