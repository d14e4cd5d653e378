"""One job of the clean-exit stress flow (``tests/test_clean_exit.py``), started as

    python -m tests._exit_flow WORLD save|load CHECKPOINT_DIR

It spawns WORLD gloo ranks that wrap and train a small model, then either save a sharded
checkpoint through ``torch.distributed.checkpoint`` or load one saved at another world size
and train on from it. Each rank ends the way docs/training.md ("Ending a job") says a job should:
``flatshard.destroy_process_group()`` after its last collective, which must free the default
group (no warning, no reference left). The process exits 0 only if every rank did.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import warnings
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, init: str, checkpoint: str, mode: str) -> None:
    import torch.distributed.checkpoint as dcp

    import flatshard
    from flatshard import ShardedDataParallel, StateDictType
    from tests._models import batch, build, lm_loss, local, make_optim, wrap

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    model = wrap(build(), "nested")
    optim = make_optim(model.parameters())
    if mode == "load":
        with ShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict()}
            dcp.load(state, checkpoint_id=checkpoint)
            model.load_state_dict(state["model"])
            del state  # (its DTensors hold the group: see flatshard.destroy_process_group)
    for step in range(2):
        tokens, targets = (local(t, rank) for t in batch(step, world))
        lm_loss(model(tokens), targets).backward()
        optim.step()
        optim.zero_grad()
    if mode == "save":
        with ShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            dcp.save({"model": model.state_dict()}, checkpoint_id=checkpoint)
    world = weakref.ref(dist.group.WORLD)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # (a group still held after the ending)
        flatshard.destroy_process_group()
    if world() is not None:
        raise AssertionError(f"[rank {rank}] the default process group outlived flatshard.destroy_process_group()")


def main(argv: list) -> None:
    world, mode, checkpoint = int(argv[0]), argv[1], argv[2]
    if mode not in ("save", "load"):
        raise ValueError(f"mode must be 'save' or 'load'; got {mode!r}")
    with tempfile.TemporaryDirectory() as scratch:
        mp.spawn(_rank, args=(world, os.path.join(scratch, "init"), checkpoint, mode), nprocs=world)


if __name__ == "__main__":
    main(sys.argv[1:])
