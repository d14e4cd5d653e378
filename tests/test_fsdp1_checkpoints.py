"""Checkpoints are interchangeable with torch FSDP1: full state dicts directly, sharded ones
through torch.distributed.checkpoint, in both directions. (FSDP1 on CPU needs
``device_id=torch.device("cpu")``; its FULL_STATE_DICT with ``offload_to_cpu=True`` crashes on
CPU, so FSDP1's side uses ``offload_to_cpu=False``.)"""

import os
import shutil
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.fsdp as torch_fsdp
from expecttest import TestCase

from flatshard import ModuleWrapPolicy, ShardedDataParallel, StateDictType
from tests._models import Block, batch, build, lm_loss, local

FULL, SHARDED = StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT


def _ours(seed, orig=False):
    return ShardedDataParallel(build(seed), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=orig)


def _fsdp1(seed, orig=False):
    return torch_fsdp.FullyShardedDataParallel(
        build(seed), auto_wrap_policy=torch_fsdp.wrap.ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
        use_orig_params=orig,
    )


def _trained(model, rank, world_size):
    """One SGD step, so that the values differ from any initialisation."""
    tokens, targets = batch(0, world_size)
    lm_loss(model(local(tokens, rank)), local(targets, rank)).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return model


def _full(model):
    """The FULL state dict of either implementation (FSDP1 without offloading)."""
    if isinstance(model, ShardedDataParallel):
        return model.state_dict()
    config = torch_fsdp.FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    with torch_fsdp.FullyShardedDataParallel.state_dict_type(model, torch_fsdp.StateDictType.FULL_STATE_DICT, config):
        return model.state_dict()


def _sharded_type(model):
    if isinstance(model, ShardedDataParallel):
        return ShardedDataParallel.state_dict_type(model, SHARDED)
    return torch_fsdp.FullyShardedDataParallel.state_dict_type(model, torch_fsdp.StateDictType.SHARDED_STATE_DICT)


def _load_full(model, state):
    if isinstance(model, ShardedDataParallel):
        return model.load_state_dict(state)
    config = torch_fsdp.FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    with torch_fsdp.FullyShardedDataParallel.state_dict_type(model, torch_fsdp.StateDictType.FULL_STATE_DICT, config):
        return model.load_state_dict(state)


def _exchange(rank, world_size, directory, orig=False):
    """For each direction and form: save with one implementation, load into a fresh model of
    the other, and compare the loaded model's full state dict with the saved model's."""
    warnings.filterwarnings("ignore")  # FSDP1's deprecation warnings
    results = {}
    makers = {"flatshard": _ours, "fsdp1": _fsdp1}
    for source_name, target_name in (("fsdp1", "flatshard"), ("flatshard", "fsdp1")):
        for form in ("full", "sharded"):
            source = _trained(makers[source_name](0, orig), rank, world_size)
            expected = {k: v.clone() for k, v in _full(source).items()}
            target = makers[target_name](1, orig)
            if form == "full":
                _load_full(target, _full(source))
            else:
                path = os.path.join(directory, f"{source_name}-{form}-{orig}")
                with _sharded_type(source):
                    dcp.save(source.state_dict(), checkpoint_id=path)
                with _sharded_type(target):
                    state = target.state_dict()
                    dcp.load(state, checkpoint_id=path)
                    target.load_state_dict(state)
            actual = _full(target)
            if list(actual) != list(expected):
                raise AssertionError(f"{source_name} -> {target_name} ({form}): keys {list(actual)} vs {list(expected)}")
            differing = [k for k in expected if not torch.equal(actual[k], expected[k])]
            results[f"{source_name} -> {target_name} ({form})"] = differing
            if target_name == "flatshard":  # and it computes what the source computes
                tokens, _ = batch(3, world_size)
                with torch.no_grad():
                    torch.testing.assert_close(target(tokens), source(tokens), rtol=0, atol=0)
    return results


class Fsdp1CheckpointTest(TestCase):
    def _check_exchange(self, orig):
        directory = tempfile.mkdtemp(prefix="flatshard-fsdp1-")
        self.addCleanup(shutil.rmtree, directory, True)
        expected = {
            f"{source} -> {target} ({form})": []
            for source, target in (("fsdp1", "flatshard"), ("flatshard", "fsdp1"))
            for form in ("full", "sharded")
        }
        for rank_results in self.pool.run(_exchange, 2, directory, orig):
            self.assertEqual(rank_results, expected)

    def test_full_and_sharded_checkpoints_load_across_implementations(self):
        self._check_exchange(orig=False)

    def test_checkpoints_with_original_parameters_load_across_implementations(self):
        """Both sides with use_orig_params=True."""
        self._check_exchange(orig=True)
