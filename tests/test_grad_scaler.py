"""ShardedGradScaler: float16 training with loss scaling on sharded gradients.

Truth is one process running torch's own ``torch.amp.GradScaler("cpu")`` on the same float16
computation: an fp32 master model whose values are copied into a float16 compute model for
each step's forward and backward on the global batch; the compute model's float16 gradients,
cast to fp32, are unscaled, clipped with ``torch.nn.utils.clip_grad_norm_`` and stepped on the
master. The sharded run wraps the same model with ``MixedPrecision(param_dtype=float16)`` (so
gradients are reduced in float16) and uses ``ShardedGradScaler`` with ``model.clip_grad_norm_``.

Three kinds of overflow happen along the way: the first scale is far too large (every rank
overflows), at ``HEAVY_STEP`` the last rank's loss is multiplied by 1e6 (only that rank's own
backward overflows), and at ``INF_STEP`` one gradient element is set to inf on the one rank
whose shard holds it (only that rank finds it). Each must skip the step on every rank.
"""

import copy
import inspect
import math

import torch
import torch.distributed as dist
from expecttest import TestCase
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler

from flatshard import MixedPrecision
from flatshard.sharded_grad_scaler import ShardedGradScaler
from tests._models import batch, build, error_text, global_mean, lm_loss, local, wrap

FP16 = torch.float16
STEPS = 8
LR = 0.1
MAX_NORM = 5.0
# 2**40 overflows any gradient; one backoff of 2**-30 then gives 1024, after which the usual
# backoff of 0.5 applies (set after the first step, on both scalers).
SCALER = dict(init_scale=2.0**40, backoff_factor=2.0**-30, growth_factor=2.0, growth_interval=2)
HEAVY_STEP = 3
INF_STEP = 5
INF_PARAM = ("blocks.1", "fc2.bias")  # (unit, parameter): its last element is held by the last rank
EXPECTED_SKIPPED = [True, False, False, True, False, True, False, False]
EXPECTED_SCALES = [1024.0, 1024.0, 2048.0, 1024.0, 1024.0, 512.0, 512.0, 1024.0]
# Parameters, by keep_low_precision_grads (float16 gradients are unscaled in float16); the gradient
# norm (of float16-rounded, differently summed gradients). Measured: a quarter of these or less.
TOL = {False: 1e-3, True: 2e-3}
NORM_RTOL = 3e-3


def _weight(step, rank, world_size):
    """The factor on a rank's loss: 1e6 for the last rank at HEAVY_STEP (its float16 backward
    overflows; the others' do not)."""
    return 1e6 if step == HEAVY_STEP and rank == world_size - 1 else 1.0


def _mixed_precision(low_grads):
    return MixedPrecision(param_dtype=FP16, buffer_dtype=FP16, keep_low_precision_grads=low_grads)


def _step(scaler, optim, clip):
    """unscale_, clip, step, update: (the norm, the scale after the update, whether the step was skipped)."""
    scaler.unscale_(optim)
    norm = clip()
    before = scaler.get_scale()
    scaler.step(optim)
    scaler.update()
    return norm.item(), scaler.get_scale(), scaler.get_scale() < before


def _reference(world_size):
    """Single process: torch's GradScaler on a float16 copy of the fp32 master, global batch."""
    master = build(unused=True)
    optim = torch.optim.SGD(master.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    records = []
    for step in range(STEPS):
        if step == 1:
            scaler.set_backoff_factor(0.5)
        compute = copy.deepcopy(master)
        for param in compute.parameters():
            param.data = param.data.to(FP16)
        compute.pos = compute.pos.to(FP16)
        tokens, targets = batch(step, world_size)
        logits = compute(tokens).float()
        losses = [_weight(step, r, world_size) * lm_loss(local(logits, r), local(targets, r)) for r in range(world_size)]
        loss = sum(losses) / world_size
        scaler.scale(loss).backward()
        for p, q in zip(master.parameters(), compute.parameters()):
            p.grad = None if q.grad is None else q.grad.float()
        if step == INF_STEP:
            master.get_parameter(".".join(INF_PARAM)).grad[-1] = math.inf
        norm, scale, skipped = _step(scaler, optim, lambda: torch.nn.utils.clip_grad_norm_(master.parameters(), MAX_NORM))
        params = {n: p.detach().clone() for n, p in master.named_parameters(remove_duplicate=False)}
        records.append({"loss": loss.item(), "norm": norm, "scale": scale, "skipped": skipped, "params": params})
    return records


def _inject_inf(model, rank):
    """Set the last element of INF_PARAM's gradient to inf on the rank whose shard holds it;
    returns that rank."""
    unit, name = INF_PARAM
    handle = model.get_submodule(unit).handle
    info = next(i for i in handle.param_infos if i.name == name)
    index = info.offset + info.numel - 1  # in the flat parameter
    holder = index // handle.shard_numel
    if rank == holder:
        handle.flat_param.grad[index - rank * handle.shard_numel] = math.inf
    return holder


def _finite_here(optim):
    """Whether every gradient this rank's optimizer holds is finite (before unscaling)."""
    return all(bool(p.grad.isfinite().all()) for g in optim.param_groups for p in g["params"] if p.grad is not None)


def _sharded(rank, world_size, low_grads):
    """The same training, FULL_SHARD with float16 mixed precision and ShardedGradScaler."""
    model = wrap(build(unused=True), "nested", mixed_precision=_mixed_precision(low_grads))
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = ShardedGradScaler("cpu", **SCALER)
    records = []
    for step in range(STEPS):
        if step == 1:
            scaler.set_backoff_factor(0.5)
        optim.zero_grad()
        tokens, targets = batch(step, world_size)
        loss = lm_loss(model(local(tokens, rank)).float(), local(targets, rank)) * _weight(step, rank, world_size)
        scaler.scale(loss).backward()
        holder = _inject_inf(model, rank) if step == INF_STEP else None
        grads = [p.grad for p in model.parameters()]
        record = {"finite_here": _finite_here(optim), "holder": holder, "no_grad": sum(g is None for g in grads)}
        record["grad_dtypes"] = sorted({str(g.dtype) for g in grads if g is not None})
        norm, scale, skipped = _step(scaler, optim, lambda: model.clip_grad_norm_(MAX_NORM))
        state = model.state_dict()  # full precision, the plain names
        record.update(loss=global_mean(loss), norm=norm, scale=scale, skipped=skipped, params=state)
        records.append(record)
    return records


class ParityTest(TestCase):
    def _check(self, world_size, low_grads):
        expected = _reference(world_size)
        per_rank = self.pool.run(_sharded, world_size, low_grads)
        tol = TOL[low_grads]
        self.assertEqual([r["skipped"] for r in expected], EXPECTED_SKIPPED)
        self.assertEqual([r["scale"] for r in expected], EXPECTED_SCALES)
        for rank, records in enumerate(per_rank):
            where = f"world size {world_size}, rank {rank}"
            self.assertEqual([r["skipped"] for r in records], EXPECTED_SKIPPED, where)
            self.assertEqual([r["scale"] for r in records], EXPECTED_SCALES, where)
            for step, (got, ref) in enumerate(zip(records, expected)):
                at = f"{where}, step {step}"
                torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-3, atol=1e-3, msg=lambda m: f"{at}: loss: {m}")
                if ref["skipped"]:
                    self.assertFalse(math.isfinite(got["norm"]) or math.isfinite(ref["norm"]), at)
                else:
                    torch.testing.assert_close(got["norm"], ref["norm"], rtol=NORM_RTOL, atol=0.0, msg=lambda m: f"{at}: norm: {m}")
                for name, value in ref["params"].items():
                    torch.testing.assert_close(got["params"][name], value, rtol=tol, atol=tol, msg=lambda m: f"{at}: {name}: {m}")
                self.assertEqual(got["no_grad"], 1, f"{at}: the unused block's FlatParameter has no gradient")
                self.assertEqual(got["grad_dtypes"], ["torch.float16" if low_grads else "torch.float32"], at)
            # The HEAVY_STEP overflow came from the last rank's backward alone; at INF_STEP only the
            # last rank held an inf, yet every rank skipped.
            self.assertEqual(records[INF_STEP]["holder"], world_size - 1)
            self.assertEqual(records[INF_STEP]["finite_here"], rank != world_size - 1, where)
        # Every rank holds the same full parameters (no rank stepped alone).
        for records in per_rank[1:]:
            for got, first in zip(records, per_rank[0]):
                for name, value in first["params"].items():
                    torch.testing.assert_close(got["params"][name], value, rtol=0, atol=0)

    def test_fp16_training_matches_torch_grad_scaler_in_one_process(self):
        self._check(2, low_grads=False)
        self._check(3, low_grads=False)

    def test_fp16_gradients_with_keep_low_precision_grads(self):
        self._check(2, low_grads=True)


def _one_rank_overflows(rank, world_size, scaler_cls):
    """After backward, the last rank alone sets one element of its gradient shard to inf."""
    model = wrap(build(), "nested", mixed_precision=_mixed_precision(False))
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = scaler_cls("cpu", init_scale=1024.0)
    outcome = {}
    for step in range(2):
        optim.zero_grad()
        tokens, targets = batch(step, world_size)
        try:
            loss = lm_loss(model(local(tokens, rank)).float(), local(targets, rank))
        except RuntimeError as exc:  # (the ranks stepped differently: [Note: steps agree])
            outcome[step] = {"error": str(exc)}
            break
        scaler.scale(loss).backward()
        if step == 0 and rank == world_size - 1:
            model.blocks[0].handle.flat_param.grad[0] = math.inf
        shards = [p.detach().clone() for p in model.parameters()]
        finite = _finite_here(optim)
        scaler.step(optim)
        scaler.update()
        changed = [not torch.equal(before, p.detach()) for before, p in zip(shards, model.parameters())]
        outcome[step] = {"finite_here": finite, "changed": any(changed), "scale": scaler.get_scale()}
    return outcome


class OneRankOverflowTest(TestCase):
    def test_inf_on_one_rank_skips_the_step_on_every_rank(self):
        for world_size in (2, 3):
            outcomes = self.pool.run(_one_rank_overflows, world_size, ShardedGradScaler)
            for rank, outcome in enumerate(outcomes):
                last = rank == world_size - 1
                self.assertEqual(
                    outcome,
                    {
                        0: {"finite_here": not last, "changed": False, "scale": 512.0},  # skipped everywhere
                        1: {"finite_here": True, "changed": True, "scale": 512.0},  # and training goes on
                    },
                    f"world size {world_size}, rank {rank}",
                )

    def test_torch_grad_scaler_alone_would_let_the_other_ranks_step(self):
        # The case above is a real test of the agreement: each rank deciding for itself
        # (torch's GradScaler) steps on the ranks without the inf.
        outcomes = self.pool.run(_one_rank_overflows, 2, torch.amp.GradScaler)
        self.assertEqual([o[0]["changed"] for o in outcomes], [True, False])
        self.assertEqual([o[0]["scale"] for o in outcomes], [1024.0, 512.0])
        # flatshard then refuses the next forward on every rank (see [Note: steps agree])
        for rank, outcome in enumerate(outcomes):
            self.assertIn(
                f"[rank {rank}] the ranks called optimizer.step() on this model a different number of times before "
                f"this forward (rank 0: 1; rank 1: 0)",
                outcome[1]["error"],
            )


class ApiTest(TestCase):
    def test_constructor_is_fsdp1s(self):
        ours = inspect.signature(ShardedGradScaler.__init__).parameters
        torchs = inspect.signature(TorchShardedGradScaler.__init__).parameters
        self.assertEqual([(p.name, p.default, p.kind) for p in ours.values()], [(p.name, p.default, p.kind) for p in torchs.values()])
        scaler = ShardedGradScaler("cpu", 8.0, 0.25, 4.0, 10)
        self.assertEqual((scaler.get_scale(), scaler.get_backoff_factor(), scaler.get_growth_factor(), scaler.get_growth_interval()), (8.0, 0.25, 4.0, 10))
        self.assertIsNone(scaler.process_group)
        self.assertIsInstance(scaler, torch.amp.GradScaler)

    def test_scaled_outputs_keep_their_dtype(self):
        scaler = ShardedGradScaler("cpu", init_scale=4.0)
        half = torch.tensor(1.5, dtype=FP16)
        self.assertEqual(scaler.scale(half).dtype, FP16)  # torch's GradScaler gives float32 here
        self.assertEqual(scaler.scale(half).item(), 6.0)
        pair = scaler.scale((half, torch.ones(2)))
        self.assertIsInstance(pair, tuple)
        self.assertEqual([t.dtype for t in pair], [FP16, torch.float32])
        self.assertEqual([t.tolist() for t in scaler.scale([torch.ones(1)])], [[4.0]])
        disabled = ShardedGradScaler("cpu", enabled=False)
        self.assertIs(disabled.scale(half), half)

    def test_needs_a_process_group(self):
        if dist.is_initialized():
            self.skipTest("the test process has a default process group")
        param = torch.nn.Parameter(torch.ones(2))
        optim = torch.optim.SGD([param], lr=LR)
        scaler = ShardedGradScaler("cpu")
        scaler.scale(param.sum()).backward()
        self.assertExpectedInline(
            error_text(lambda: scaler.step(optim), RuntimeError),
            """ShardedGradScaler needs torch.distributed to be initialised (the ranks agree on skipping a step): call torch.distributed.init_process_group() first, or use torch.amp.GradScaler in a single process""",
        )
