"""Convert a sharded checkpoint (torch.distributed.checkpoint) to one full file and back.

    python examples/convert_checkpoint.py to-full ckpt/ full.pt       # sharded -> one torch.save file
    python examples/convert_checkpoint.py to-sharded full.pt ckpt2/   # and back

Runs in one process, without a process group (nor the checkpoint's number of ranks), and
without the model's code. A sharded checkpoint such as each ``step-N`` directory of
``train_gpt.py --save`` (``flatshard.RunCheckpoints``) holds::

    with ShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict(),
                  "optim": ShardedDataParallel.optim_state_dict(model, optim), "step": step}, ...)

becomes the same nested dict with full tensors: ``torch.load("full.pt")["model"]`` loads into
the plain (unwrapped) model with ``strict=True``, and ``["optim"]`` is the full, name-keyed
optimizer state dict that ``ShardedDataParallel.shard_full_optim_state_dict`` /
``scatter_full_optim_state_dict`` take. Non-tensor entries (``step``, ``param_groups``) are
kept, and so is the order of every dict. ``to-sharded`` writes a checkpoint that a
``ShardedDataParallel`` model loads at any world size with the usual sharded recipe
(``dcp.load`` into ``model.state_dict()`` / ``optim_state_dict`` templates). Empty dicts are
not stored by torch.distributed.checkpoint, so they do not survive a round trip through it.
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata


def _nest(flat: Dict[str, Any], paths: Dict[str, Tuple[Any, ...]]) -> Dict[str, Any]:
    """Rebuild the nested dict from flat keys and their paths (an int step is a list index)."""
    out: Dict[str, Any] = {}
    for key, value in flat.items():
        path = paths.get(key, (key,))
        node: Any = out
        for step, next_step in zip(path, path[1:]):
            if isinstance(node, list):
                node.extend([None] * (step + 1 - len(node)))
                if node[step] is None:
                    node[step] = [] if isinstance(next_step, int) else {}
                node = node[step]
            else:
                node = node.setdefault(step, [] if isinstance(next_step, int) else {})
        if isinstance(node, list):
            node.extend([None] * (path[-1] + 1 - len(node)))
        node[path[-1]] = value
    return out


def to_full(sharded_dir: str, out_path: str) -> None:
    """Read every entry of a sharded checkpoint as a full tensor (or object); ``torch.save`` it."""
    metadata = dcp.FileSystemReader(sharded_dir).read_metadata()
    entries = metadata.state_dict_metadata
    paths = dict(metadata.planner_data or {})  # flat key -> nested path, in the saved dict's order
    order = [key for key in paths if key in entries] + [key for key in entries if key not in paths]
    flat: Dict[str, Any] = {}
    for key in order:
        entry = entries[key]
        flat[key] = torch.empty(entry.size, dtype=entry.properties.dtype) if isinstance(entry, TensorStorageMetadata) else None
    # flat keys already equal the checkpoint's: no flattening, non-tensors are filled in place
    dcp.load(flat, storage_reader=dcp.FileSystemReader(sharded_dir), planner=dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False), no_dist=True)
    torch.save(_nest(flat, paths), out_path)


def to_sharded(full_path: str, sharded_dir: str) -> None:
    """Write a full ``torch.save`` file as a checkpoint that any number of ranks can load."""
    state = torch.load(full_path, map_location="cpu", weights_only=True)  # tensors and plain data
    if not isinstance(state, dict):
        raise SystemExit(f"{full_path}: expected a dict, found {type(state).__name__}")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(sharded_dir), no_dist=True)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    full = commands.add_parser("to-full", help="sharded checkpoint directory -> one torch.save file")
    full.add_argument("sharded_dir", metavar="SHARDED_DIR")
    full.add_argument("out", metavar="OUT.pt")
    sharded = commands.add_parser("to-sharded", help="one torch.save file -> sharded checkpoint directory")
    sharded.add_argument("full", metavar="IN.pt")
    sharded.add_argument("sharded_dir", metavar="SHARDED_DIR")
    args = parser.parse_args(argv)
    # Running without a process group is the point here: torch.distributed.checkpoint warns
    # "torch.distributed is disabled, unavailable or uninitialized, ..." on every call even with
    # no_dist=True, so that one warning (and only it) is silenced.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
    if args.command == "to-full":
        if not os.path.isfile(os.path.join(args.sharded_dir, ".metadata")):
            full.error(f"{args.sharded_dir!r} is not a sharded checkpoint (no .metadata file in it)")
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
            full.error(f"the directory of {args.out!r} does not exist")
        to_full(args.sharded_dir, args.out)
    else:
        if not os.path.isfile(args.full):
            sharded.error(f"{args.full!r} does not exist")
        if os.path.isfile(args.sharded_dir) or os.path.isfile(os.path.join(args.sharded_dir, ".metadata")):
            sharded.error(f"{args.sharded_dir!r} is a file or already holds a checkpoint")
        os.makedirs(args.sharded_dir, exist_ok=True)
        to_sharded(args.full, args.sharded_dir)


if __name__ == "__main__":
    main()
