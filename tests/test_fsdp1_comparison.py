"""What README.md and docs/migrating.md say about torch FSDP1, checked against torch FSDP1 itself.

The "What is better" list compares flatshard with FSDP1: flatshard's own tests show the
flatshard side; each test here runs the same case under torch FSDP1 (``use_orig_params=False``,
on CPU with gloo) and asserts what FSDP1 does. Should a torch release change one of these,
its test fails and the README's comparison must change with it.

The training loops of ``tests/test_adversarial.py`` run unchanged, with FSDP1 put in place
of flatshard for the duration of the rank function (see ``_as_fsdp1``).
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
import warnings
from typing import Any, Dict, Iterator, List
from unittest import mock

import torch
import torch.distributed.fsdp as torch_fsdp
from expecttest import TestCase
from torch import nn

import tests._models as models
import tests.test_adversarial as adversarial
from tests._models import batch, build, lm_loss, local, make_optim, sample_transformer

FSDP1 = torch_fsdp.FullyShardedDataParallel
NOT_SINGLE_PROCESS = r"Tensor-likes are not close"


class _Fsdp1(FSDP1):
    """torch FSDP1 as the adversarial loops construct flatshard (FSDP1 on CPU needs its device)."""

    def __init__(self, module: nn.Module, **options: Any) -> None:
        options.setdefault("device_id", torch.device("cpu"))
        super().__init__(module, **options)


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def _full_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every original parameter of an FSDP1 model (tied ones under each name)."""
    with FSDP1.summon_full_params(model, writeback=False):
        return {_clean(n): p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


@contextlib.contextmanager
def _as_fsdp1() -> Iterator[None]:
    """Inside: the adversarial loops build torch FSDP1 with torch's enums and configs (the
    worker processes are reused, so everything is put back on exit)."""
    names = {
        "ShardedDataParallel": _Fsdp1,
        "full_params": _full_params,
        "ShardingStrategy": torch_fsdp.ShardingStrategy,
        "BackwardPrefetch": torch_fsdp.BackwardPrefetch,
        "MixedPrecision": torch_fsdp.MixedPrecision,
        "StateDictType": torch_fsdp.StateDictType,
        "FullStateDictConfig": torch_fsdp.FullStateDictConfig,
        "FullOptimStateDictConfig": torch_fsdp.FullOptimStateDictConfig,
        "ModuleWrapPolicy": torch_fsdp.wrap.ModuleWrapPolicy,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP1's deprecation warnings
        with mock.patch.multiple(adversarial, **names), mock.patch.multiple(models, ShardedDataParallel=_Fsdp1, full_params=_full_params):
            yield


def _adversarial(rank: int, world_size: int, name: str, *args: Any) -> Any:
    """Run ``tests.test_adversarial.<name>`` under FSDP1."""
    with _as_fsdp1():
        return getattr(adversarial, name)(rank, world_size, *args)


# -- ties, placeholders, state dicts -------------------------------------------------------------


def _size_based_ties(rank: int, world_size: int) -> Any:
    """FSDP1's units under size_based_auto_wrap_policy and how far its tied embedding/head end
    up from single-process training after two steps (flatshard: PolicyTreeTest)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = sample_transformer()
        policy = functools.partial(torch_fsdp.wrap.size_based_auto_wrap_policy, min_num_params=100)
        model = _Fsdp1(sample_transformer(), auto_wrap_policy=policy)
        units = [_clean(n) for n, m in model.named_modules() if isinstance(m, FSDP1)]
        ref_optim, optim = make_optim(reference.parameters()), make_optim(model.parameters())
        for step in range(2):
            tokens, targets = batch(step, world_size)
            ref_optim.zero_grad()
            lm_loss(reference(tokens), targets).backward()
            ref_optim.step()
            optim.zero_grad()
            lm_loss(model(local(tokens, rank)), local(targets, rank)).backward()
            optim.step()
        params = _full_params(model)
    expected = reference.embed.weight.detach()
    distance = {n: float((params[n] - expected).abs().max()) for n in ("embed.weight", "head.weight")}
    distance["embed.weight vs head.weight"] = float((params["embed.weight"] - params["head.weight"]).abs().max())
    return units, distance


def _parameter_outside_forward(rank: int, world_size: int) -> Any:
    """What a module holds as its weight between iterations under FSDP1 (flatshard: a
    ParamPlaceholder, StructureTest)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build()
        model.blocks[0] = _Fsdp1(model.blocks[0])
        model = _Fsdp1(model)
        tokens, targets = (local(t, rank) for t in batch(0, world_size))
        lm_loss(model(tokens), targets).backward()
        weight = model.module.blocks[0].module.fc1.weight
        # (reading it would read freed memory: it crashes the process)
        return type(weight).__name__, tuple(weight.shape), weight.untyped_storage().nbytes()


def _rank0_only_offloaded_full_state_dict(rank: int, world_size: int) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _Fsdp1(build())
        config = torch_fsdp.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP1.state_dict_type(model, torch_fsdp.StateDictType.FULL_STATE_DICT, config):
            return len(model.state_dict())


def _fresh_optimizer_state_dict(rank: int, world_size: int) -> List[int]:
    """Entries in FSDP1's sharded optimizer state dict of a fresh optimizer, and of the same
    optimizer after one step (flatshard: one per parameter either way)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _Fsdp1(build())
        optim = make_optim(model.parameters())
        counts = []
        for step in range(2):
            if step == 1:
                tokens, targets = (local(t, rank) for t in batch(0, world_size))
                lm_loss(model(tokens), targets).backward()
                optim.step()
            with FSDP1.state_dict_type(model, torch_fsdp.StateDictType.SHARDED_STATE_DICT):
                counts.append(len(FSDP1.optim_state_dict(model, optim)["state"]))
        return counts


def _parameter_names(rank: int, world_size: int) -> List[List[str]]:
    """``named_parameters()`` of the same nesting under flatshard and under FSDP1."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = models.wrap(build(), "nested")
        with mock.patch.object(models, "ShardedDataParallel", _Fsdp1):
            theirs = models.wrap(build(), "nested")
        return [[n for n, _ in m.named_parameters()] for m in (ours, theirs)]


def _orig_params_behaviour(rank: int, world_size: int) -> Dict[str, Any]:
    """use_orig_params=True under FSDP1 and flatshard: the names ``named_parameters()`` gives,
    whether Adam's two moments differ in the full optimizer state dict (they do in the
    optimizer), and the gradient elements this rank holds when each block's ``fc1`` is frozen
    (a fine-tuning case: frozen and trainable parameters in every unit)."""
    warnings.filterwarnings("ignore")
    out: Dict[str, Any] = {}
    for kind in ("flatshard", "fsdp1"):
        cls = models.ShardedDataParallel if kind == "flatshard" else _Fsdp1
        plain = build()
        for block in plain.blocks:
            block.fc1.requires_grad_(False)
        with mock.patch.object(models, "ShardedDataParallel", cls):
            model = models.wrap(plain, "nested", use_orig_params=True)
        optim = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        tokens, targets = batch(0, world_size)
        lm_loss(model(local(tokens, rank)), local(targets, rank)).backward()
        optim.step()
        osd = cls.full_optim_state_dict(model, optim, rank0_only=False)
        state = osd["state"]["blocks.0.fc2.weight"]
        if kind == "flatshard":
            flat = [h.flat_param for m in cls.fsdp_modules(model) for h in m.handles]
        else:
            flat = [m._handle.flat_param for m in cls.fsdp_modules(model) if m._handle is not None]
        out[kind] = {
            "first name": next(n for n, _ in model.named_parameters()),
            "moments differ": not torch.equal(state["exp_avg"], state["exp_avg_sq"]),
            "gradient elements": sum(f.grad.numel() for f in flat if f.grad is not None),
        }
    trainable = sum(p.numel() for p in build().parameters()) - sum(b.fc1.weight.numel() + b.fc1.bias.numel() for b in build().blocks)
    out["trainable elements / world size"] = trainable / world_size
    return out


def _frozen_and_trainable_in_one_unit(rank: int, world_size: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _Fsdp1(build(frozen_blocks=(1,)))


class FrozenTest(TestCase):
    def test_fsdp1_refuses_frozen_and_trainable_parameters_in_one_unit(self) -> None:
        # flatshard: tests/test_auto_wrap.py::FrozenAndMixedTest
        with self.assertRaisesRegex(ValueError, "Must flatten tensors with uniform `requires_grad`"):
            self.pool.run(_frozen_and_trainable_in_one_unit, 2)


class NamesTest(TestCase):
    def test_named_parameters_are_the_flat_parameters_as_in_fsdp1(self) -> None:
        ours, theirs = self.pool.run(_parameter_names, 2)[0]
        self.assertEqual(ours, theirs)
        self.assertEqual(ours[0], "_fsdp_wrapped_module._flat_param")


class OrigParamsTest(TestCase):
    def test_fsdp1_with_use_orig_params_prefixes_names_and_loses_a_moment(self) -> None:
        # flatshard: tests/test_orig_params.py (names, frozen memory),
        # tests/test_optim_state.py::OptimStateTest::test_resume_with_original_parameters
        result = self.pool.run(_orig_params_behaviour, 2)[0]
        ours, theirs = result["flatshard"], result["fsdp1"]
        self.assertEqual(
            (ours["first name"], ours["moments differ"], theirs["first name"], theirs["moments differ"]),
            ("embed.weight", True, "_fsdp_wrapped_module.embed.weight", False),
        )
        # flatshard holds gradients for the trainable parameters only (plus padding); FSDP1 for
        # every parameter of a unit with any trainable one
        self.assertLessEqual(ours["gradient elements"], result["trainable elements / world size"] + 8)
        self.assertGreater(theirs["gradient elements"], 1.5 * ours["gradient elements"])


class TiesTest(TestCase):
    def test_fsdp1_trains_a_tie_split_by_a_size_based_policy_as_two_copies(self) -> None:
        # flatshard: tests/test_auto_wrap.py::PolicyTreeTest::test_size_based_policy_places_the_tied_embedding_in_the_root
        units, distance = self.pool.run(_size_based_ties, 2)[0]
        self.assertIn("embed", units)
        self.assertIn("head", units)
        for name in ("embed.weight", "head.weight", "embed.weight vs head.weight"):
            self.assertGreater(distance[name], 1e-3, name)  # both off, and no longer one tensor


class PlaceholderTest(TestCase):
    def test_fsdp1_leaves_a_tensor_over_freed_storage_on_the_module(self) -> None:
        # flatshard: tests/test_runtime.py::StructureTest::test_root_nesting_and_forwarding
        for kind, shape, storage_bytes in self.pool.run(_parameter_outside_forward, 2):
            self.assertEqual((kind, shape, storage_bytes), ("Tensor", (16, 8), 0))


class StateDictTest(TestCase):
    def test_fsdp1_rank0_only_offloaded_full_state_dict_fails_on_cpu(self) -> None:
        # flatshard: tests/test_state_dict.py::MemoryTest
        with self.assertRaisesRegex(RuntimeError, "out of bounds for storage of size 0"):
            self.pool.run(_rank0_only_offloaded_full_state_dict, 2)

    def test_fsdp1_sharded_optimizer_state_dict_of_a_fresh_optimizer_is_empty(self) -> None:
        # flatshard: tests/test_optim_state.py::OptimStateTest::test_resume_full_and_sharded_at_the_same_and_other_world_sizes
        self.assertEqual(self.pool.run(_fresh_optimizer_state_dict, 2)[0], [0, 21])

    def test_fsdp1_resumes_a_checkpoint_with_frozen_units_wrong(self) -> None:
        # flatshard: tests/test_adversarial.py::OptimStateLoadTest::test_state_of_frozen_and_never_stepped_units_resumes_at_another_world_size
        with tempfile.TemporaryDirectory() as directory:
            uninterrupted = self.pool.run(_adversarial, 2, "_frozen_state_survives", "save", directory)[0]
            resumed = self.pool.run(_adversarial, 3, "_frozen_state_survives", "load", directory)[0]
        with self.assertRaisesRegex(AssertionError, NOT_SINGLE_PROCESS):
            adversarial._assert_close(resumed, uninterrupted, "FSDP1 resumed")

    def test_fsdp1_resumes_a_checkpoint_taken_before_the_first_step_right(self) -> None:
        # (so the README claims nothing better there)
        with tempfile.TemporaryDirectory() as directory:
            self.assertEqual(self.pool.run(_adversarial, 2, "_checkpoint_before_first_step", "adamw", directory), [True, True])


class TrainingLoopsTest(TestCase):
    """tests/test_adversarial.py's loops: under flatshard each trains like one process."""

    def test_aux_loss_after_the_output_reads_freed_memory_in_fsdp1(self) -> None:
        # FULL_SHARD with BACKWARD_POST: the ranks die (SIGSEGV), or, should the freed memory
        # still hold the values, train wrong
        # (a rank that dies first makes its peer's collective fail: the peer's RuntimeError is
        # what the pool raises when the peer is the lower rank)
        with self.assertRaisesRegex((AssertionError, RuntimeError), rf"died \(killed by signal|Connection (closed|reset) by peer|{NOT_SINGLE_PROCESS}"):
            self.pool.run(_adversarial, 2, "_aux_parity", "FULL_SHARD", "BACKWARD_POST", timeout=120)

    def test_unit_used_only_under_no_sync_crashes_or_trains_wrong_in_fsdp1(self) -> None:
        with self.assertRaisesRegex(AssertionError, "should use `_saved_grad_shard`"):
            self.pool.run(_adversarial, 2, "_no_sync_parity", "FULL_SHARD")
        with self.assertRaisesRegex(AssertionError, NOT_SINGLE_PROCESS):
            self.pool.run(_adversarial, 2, "_no_sync_parity", "NO_SHARD")

    def test_skipped_batch_whose_backward_raised_trains_wrong_in_fsdp1(self) -> None:
        with self.assertRaisesRegex(AssertionError, NOT_SINGLE_PROCESS):
            self.pool.run(_adversarial, 2, "_failed_backward_parity", "FULL_SHARD", True)

    def test_metric_without_no_grad_before_a_step_trains_wrong_in_fsdp1(self) -> None:
        with self.assertRaisesRegex(AssertionError, NOT_SINGLE_PROCESS):
            self.pool.run(_adversarial, 2, "_metric_parity", "FULL_SHARD")

    def test_hybrid_sharding_with_one_rank_per_shard_group_trains_wrong_in_fsdp1(self) -> None:
        with self.assertRaisesRegex(AssertionError, NOT_SINGLE_PROCESS):
            self.pool.run(_adversarial, 2, "_hybrid_single_rank_shards", "HYBRID_SHARD", "groups", False)

    def test_meta_device_ties_joining_units_of_their_own_train_wrong_in_fsdp1(self) -> None:
        with self.assertRaisesRegex(AssertionError, NOT_SINGLE_PROCESS):
            self.pool.run(_adversarial, 2, "_meta_ties")

    def test_staged_freezing_trains_right_in_fsdp1_too(self) -> None:
        # (so the README does not count it among FSDP1's failures)
        self.assertEqual(self.pool.run(_adversarial, 2, "_staged_parity", "FULL_SHARD", "BACKWARD_PRE"), [True, True])


# -- writes to original parameters -----------------------------------------------------------------


def _fsdp1_edits(rank: int, world_size: int) -> List[str]:
    """``tests/test_param_writes.py``'s edits between steps (``.data`` rebound,
    ``vector_to_parameters``, in place, new ``nn.Parameter``s, ``.grad`` rebound / ``.data`` /
    in place) under FSDP1 with ``use_orig_params=True``: it writes them back too, so training
    equals single-process training there as here."""
    import tests.test_param_writes as writes

    with _as_fsdp1(), mock.patch.multiple(writes, full_params=_full_params, _summoned=_full_params, ShardingStrategy=torch_fsdp.ShardingStrategy):
        return writes._edits_reach_the_shards(rank, world_size, True, "FULL_SHARD", "0")


class WritesTest(TestCase):
    def test_fsdp1_writes_back_what_the_loops_write_to_original_parameters(self) -> None:
        import tests.test_param_writes as writes

        done = self.pool.run(_fsdp1_edits, 2)[0]
        self.assertEqual(done, list(writes.EDITS) + list(writes.ORIG_ONLY_EDITS))
