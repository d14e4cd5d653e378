"""``flatshard.destroy_process_group()`` frees the groups while Python still runs ([Note: ending
cleanly] in ``flatshard/teardown.py``).

Each case runs ``tests/_teardown_flow.py`` (two gloo ranks that train, save and resume through
``RunCheckpoints``, run a ``DTensor`` redistribution and make a subgroup) in a fresh process,
ended one way, and reads what each rank saw.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

ROOT = Path(__file__).resolve().parents[1]

_STILL_HELD = (
    "RuntimeWarning: flatshard.destroy_process_group: the default process group is still referenced after "
    "it was destroyed (by {holders}). With gloo, a group that lives until interpreter exit can abort the "
    "process ('terminate called without an active exception'). Drop these references before exit{hint}."
)


def _ended(mode: str, tmp_path: Path) -> List[Dict]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "tests._teardown_flow", mode, str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the {mode} job exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


def _meshes_hold_their_groups() -> bool:
    from torch.distributed.device_mesh import DeviceMesh

    return "_pg_registry" in getattr(DeviceMesh, "__annotations__", {})


@pytest.mark.skipif(not _meshes_hold_their_groups(), reason="this torch's DeviceMesh does not hold its process groups")
def test_torch_destroy_alone_leaves_the_default_group_to_interpreter_exit(tmp_path):
    # Why flatshard's ending exists: with torch 2.13, the DTensor caches keep the mesh, and so the
    # default group, after torch's destroy_process_group() (the subgroup, never on a mesh, goes).
    for seen in _ended("torch", tmp_path):
        assert seen == {"world_alive": True, "sub_alive": False, "warnings": []}


def test_flatshard_destroy_frees_every_group_while_model_and_checkpoints_are_still_held(tmp_path):
    for seen in _ended("flatshard", tmp_path):
        assert seen == {"world_alive": False, "sub_alive": False, "warnings": []}


def test_a_group_held_by_the_user_is_named_in_a_warning(tmp_path):
    message = _STILL_HELD.format(holders="the global 'HELD' of module __mp_main__", hint="")
    for seen in _ended("held", tmp_path):
        assert seen == {"world_alive": True, "sub_alive": False, "warnings": [message]}


def test_a_local_variable_still_holding_the_group_is_named_in_a_warning(tmp_path):
    message = _STILL_HELD.format(holders="the local variable 'kept' of _rank() (_teardown_flow.py)", hint="")
    for seen in _ended("held_local", tmp_path):
        assert seen == {"world_alive": True, "sub_alive": False, "warnings": [message]}


def test_a_sharded_state_dict_still_held_is_named_in_a_warning(tmp_path):
    holders = "2 DeviceMeshes over it, held by DTensors (a sharded state dict, another DTensor, or a torch cache holding their specs)"
    message = _STILL_HELD.format(holders=holders, hint="")
    for seen in _ended("held_state", tmp_path):
        assert seen == {"world_alive": True, "sub_alive": False, "warnings": [message]}


def test_importing_flatshard_after_init_process_group_is_named_with_the_fix(tmp_path):
    message = _STILL_HELD.format(
        holders="default arguments of torch.distributed.nn.functional (broadcast, gather, scatter, ...)",
        hint=" (here: import flatshard or torch.distributed.checkpoint before init_process_group)",
    )
    for seen in _ended("late_import", tmp_path):
        assert seen == {"world_alive": True, "sub_alive": False, "warnings": [message]}


def test_destroying_without_a_process_group_is_a_clear_error():
    import flatshard
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    with pytest.raises(ValueError, match=r"^flatshard\.destroy_process_group: there is no process group to destroy \(torch\.distributed is not initialized\)$"):
        flatshard.destroy_process_group()
