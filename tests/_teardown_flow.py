"""One job of ``tests/test_teardown.py``, started as

    python -m tests._teardown_flow MODE OUT_DIR

Two gloo ranks train a small model, save and resume through ``RunCheckpoints`` (sharded
``torch.distributed.checkpoint``), run a ``DTensor`` redistribution (``full_tensor``), make a
subgroup (destroyed first, explicitly, in every mode but ``torch``), and end. The model, optimizer and ``RunCheckpoints`` stay referenced from module
globals to the end, as in a script without a ``main()``. MODE says how the job ends:

- ``torch``: ``torch.distributed.destroy_process_group()`` alone;
- ``flatshard``: ``flatshard.destroy_process_group()``;
- ``held``: the same, while a global still holds the default group;
- ``held_state``: the same, while a global still holds a sharded state dict;
- ``held_local``: the same, while a local variable of the rank's function holds the group;
- ``late_import``: the same, with flatshard first imported after ``init_process_group``.

Each rank writes ``OUT_DIR/rank{r}.json``: whether the default group and the subgroup were
still alive after the ending, and the warnings it raised. No flatshard import at module level
(``late_import`` needs to control when it happens).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import tempfile
import warnings
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

KEPT = {}  # what a script keeps in globals until it exits
HELD = None  # the ``held`` modes' stray reference to the default group or a state dict


def _rank(rank: int, world: int, init: str, out: str, mode: str) -> None:
    torch.set_num_threads(1)
    if mode != "late_import":
        importlib.import_module("flatshard")  # (before init_process_group, as a script imports at its top)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    import flatshard
    from tests._models import batch, build, lm_loss, local, make_optim, wrap

    global HELD
    model = wrap(build(), "nested")
    optim = make_optim(model.parameters())
    checkpoints = flatshard.RunCheckpoints(os.path.join(out, "checkpoints"), model, optim)
    KEPT.update(model=model, optim=optim, checkpoints=checkpoints)
    for step in range(2):
        tokens, targets = (local(t, rank) for t in batch(step, world))
        lm_loss(model(tokens), targets).backward()
        optim.step()
        optim.zero_grad()
    checkpoints.save(step)
    checkpoints.resume()
    with flatshard.ShardedDataParallel.state_dict_type(model, flatshard.StateDictType.SHARDED_STATE_DICT):
        shard = next(v for v in model.state_dict().values() if hasattr(v, "full_tensor"))
        shard.full_tensor()  # a DTensor redistribution: torch caches its plan
        (shard + shard).sum()  # DTensor arithmetic: torch caches its sharding and mesh topology
        del shard
    sub = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1), group=sub)
    world_ref, sub_ref = weakref.ref(dist.group.WORLD), weakref.ref(sub)
    if mode != "torch":
        flatshard.destroy_process_group(sub)  # (given explicitly: destroyed, not checked)
    del sub
    kept = dist.group.WORLD if mode == "held_local" else None  # (a local still holding it)
    if mode == "held":
        HELD = dist.group.WORLD
    if mode == "held_state":
        with flatshard.ShardedDataParallel.state_dict_type(model, flatshard.StateDictType.SHARDED_STATE_DICT):
            HELD = model.state_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if mode == "torch":
            dist.destroy_process_group()
            gc.collect()
        else:
            flatshard.destroy_process_group()
    del kept
    result = {
        "world_alive": world_ref() is not None,
        "sub_alive": sub_ref() is not None,
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    HELD = None
    if mode == "torch":
        # The default group is still alive here, which can abort the interpreter's exit
        # (flatshard/teardown.py): this mode shows that it is alive, not how the job ends.
        os._exit(0)


def main(argv: list) -> None:
    mode, out = argv[0], argv[1]
    if mode not in ("torch", "flatshard", "held", "held_state", "held_local", "late_import"):
        raise ValueError(f"mode must be torch, flatshard, held, held_state, held_local or late_import; got {mode!r}")
    with tempfile.TemporaryDirectory() as scratch:
        mp.spawn(_rank, args=(2, os.path.join(scratch, "init"), out, mode), nprocs=2)


if __name__ == "__main__":
    main(sys.argv[1:])
