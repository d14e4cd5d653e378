"""A rank's part of tests/test_framework_lightning.py's lazy-load test (run by the rank pool).

Lightning resumes a full checkpoint with ``_lazy_load`` (lightning/fabric/utilities/load.py):
its values are ``_NotYetLoadedTensor`` objects, tensor-likes that are no ``torch.Tensor`` and
load themselves in ``__torch_function__``; ``nn.Module.load_state_dict`` accepts them, and so
must a flatshard model under ``FULL_STATE_DICT``.
"""

from __future__ import annotations

from typing import Dict

import torch

import flatshard
from flatshard import FullStateDictConfig, StateDictType
from tests._fw_lightning_model import Block, build_net


def load_lazily_loaded_full_state_dict(rank: int, world_size: int, path: str) -> Dict[object, object]:
    """For use_orig_params True and False: (the type of the values Lightning hands over, whether
    each parameter loaded exactly); under "wrong shape", the error for a value of the wrong shape."""
    try:
        from lightning.fabric.utilities.load import _lazy_load
    except ImportError as error:
        raise ImportError("Lightning is not installed: the Lightning flows need the frameworks extra (pip install -e '.[frameworks]')") from error

    expected = torch.load(path, weights_only=True)
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
    out = {}
    for use_orig_params in (True, False):
        model = flatshard.FullyShardedDataParallel(build_net(), auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}), use_orig_params=use_orig_params)
        lazy = _lazy_load(path)
        kind = type(lazy["embed.weight"]).__name__
        with flatshard.FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            model.load_state_dict(lazy)
            loaded = model.state_dict()
        out[use_orig_params] = kind, {name: torch.equal(loaded[name], value) for name, value in expected.items()}
    # A lazily loaded value of the wrong shape is named as such (materialized in its own shape,
    # never broadcast into the parameter's).
    # (one file per rank: _lazy_load maps the file, and a peer rewriting it under the mapping
    # killed this rank with SIGBUS -- CI saw "Connection reset by peer" on the other rank)
    wrong = dict(expected, **{"embed.weight": expected["embed.weight"][:1].clone()})
    wrong_path = f"{path}.wrong{rank}"
    torch.save(wrong, wrong_path)
    model = flatshard.FullyShardedDataParallel(build_net(), auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}))
    try:
        with flatshard.FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            model.load_state_dict(_lazy_load(wrong_path))
        out["wrong shape"] = "no error"
    except (RuntimeError, ValueError) as error:
        out["wrong shape"] = f"{type(error).__name__}: {error}"
    return out
