"""Peak RSS per rank while loading a pretrained model into a sharded one, route by route.

    python bench/load_memory.py                        # 300m (1.2 GB fp32), 2 gloo ranks
    python bench/load_memory.py --model 1b --world-size 4

The model (a Llama, ``bench/llama.py``) is saved once, in fp32, as one safetensors file and
as a ``torch.distributed.checkpoint`` directory (by one process, so each tensor is one saved
chunk). Then, for each route, ``--world-size`` fresh gloo processes on this host load it into
a model wrapped with one unit per decoder layer:

- ``sync_module_states``: rank 0 builds the model on the CPU and reads the whole checkpoint
  into it (in place, one tensor at a time); the other ranks build it on the meta device
  (``param_init_fn`` ``to_empty``); wrapping broadcasts rank 0's values unit by unit.
- ``sharded state dict + dcp.load``: every rank builds on the meta device (``empty_init``),
  takes its ``SHARDED_STATE_DICT``, ``dcp.load``s into it and loads it back.
- ``load_pretrained (dcp)`` and ``load_pretrained (safetensors)``: every rank builds on the
  meta device (``empty_init``) and reads its shards' elements only.

Each process reports the growth of its peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` after the process group is up, so imports do not count) over the
whole route and over its load step alone (after wrapping; for ``sync_module_states`` the
wrapping is the load step), and the bytes of its shards; every route's shards are checked against the first one's (a float64 sum
per rank). The result table goes to stdout (and, with ``--results``, appended to a file).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
ROUTES = ["sync_module_states", "sharded state dict + dcp.load", "load_pretrained (dcp)", "load_pretrained (safetensors)"]


def _status(field: str) -> int:
    """A ``/proc/self/status`` size field, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _save(model_name: str, directory: str) -> None:
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from flatshard._readers._safetensors import write_safetensors
    from llama import CONFIGS, Llama

    torch.manual_seed(0)
    state = Llama(CONFIGS[model_name]).state_dict()
    write_safetensors(os.path.join(directory, "model.safetensors"), state)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=os.path.join(directory, "dcp"))


def _rank(route: str, model_name: str, directory: str, rank: int, world: int, init_file: str) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from flatshard import ShardedDataParallel, StateDictType, empty_init, load_pretrained
    from flatshard._readers._safetensors import SafetensorsReader
    from flatshard._readers._stored import Piece
    from flatshard.wrap import ModuleWrapPolicy
    from llama import CONFIGS, DecoderLayer, Llama

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cfg = CONFIGS[model_name]
    policy = ModuleWrapPolicy({DecoderLayer})
    safetensors = os.path.join(directory, "model.safetensors")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # (the peak resident set starts again from here)
    base = _status("VmRSS")
    start = time.perf_counter()
    if route == "sync_module_states":
        if rank == 0:
            with torch.device("meta"):
                plain = Llama(cfg)
            plain.to_empty(device="cpu")
            reader = SafetensorsReader(safetensors)
            with torch.no_grad():
                reader.read([Piece(k, 0, t.view(-1)) for k, t in plain.state_dict().items()])
        else:
            with torch.device("meta"):
                plain = Llama(cfg)
        model = ShardedDataParallel(
            plain, auto_wrap_policy=policy, sync_module_states=True, param_init_fn=lambda m: m.to_empty(device="cpu", recurse=False)
        )
        del plain
    else:
        with torch.device("meta"):
            plain = Llama(cfg)
        model = ShardedDataParallel(plain, auto_wrap_policy=policy, param_init_fn=empty_init("cpu"))
        del plain
        wrapped = _status("VmHWM") - base
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        if route == "sharded state dict + dcp.load":
            with ShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                state = model.state_dict()
                dcp.load(state, checkpoint_id=os.path.join(directory, "dcp"))
                model.load_state_dict(state)
                del state
        else:
            path = os.path.join(directory, "dcp") if route == "load_pretrained (dcp)" else safetensors
            load_pretrained(model, path)
    seconds = time.perf_counter() - start
    last = _status("VmHWM") - base
    peak = last if route == "sync_module_states" else max(wrapped, last)
    shards = sum(p.numel() * p.element_size() for p in model.parameters())
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    dist.destroy_process_group()
    return {"peak": peak, "load": last, "shards": shards, "checksum": checksum, "seconds": seconds}


def _route(route: str, model_name: str, directory: str, world: int) -> List[Dict[str, Any]]:
    init_file = tempfile.mktemp(prefix="flatshard-load-memory-")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "bench")]))
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", json.dumps([route, model_name, directory, rank, world, init_file])],
            env=env, stdout=subprocess.PIPE, text=True,
        )
        for rank in range(world)
    ]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{route}: a rank failed (exit codes {[p.returncode for p in procs]})")
    return [json.loads(next(line for line in out.splitlines() if line.startswith("{"))) for out in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="300m")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--directory", help="where to save the checkpoints (default: a temporary directory)")
    parser.add_argument("--results", help="append the table to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_rank(*json.loads(args.child))))
        return
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    from llama import CONFIGS

    directory = args.directory or tempfile.mkdtemp(prefix="flatshard-load-memory-")
    os.makedirs(directory, exist_ok=True)
    if not os.path.exists(os.path.join(directory, "model.safetensors")):
        _save(args.model, directory)
    size = CONFIGS[args.model].parameters() * 4
    runs = {route: _route(route, args.model, directory, args.world_size) for route in ROUTES}
    reference = [r["checksum"] for r in runs[ROUTES[0]]]
    lines = [
        f"Loading a pretrained {args.model} ({size / MIB:.0f} MiB fp32) into {args.world_size} gloo ranks, "
        f"one unit per decoder layer: peak RSS growth per rank (MiB)",
        "",
        "| route | peak, " + " / ".join(f"rank {r}" for r in range(args.world_size))
        + " | of which in the load step | shards per rank | seconds | same values |",
        "|---|---|---|---|---|---|",
    ]
    for route, ranks in runs.items():
        same = all(abs(r["checksum"] - c) <= 1e-6 * max(1.0, abs(c)) for r, c in zip(ranks, reference))
        lines.append(
            f"| {route} | " + " / ".join(f"{r['peak'] / MIB:.0f}" for r in ranks)
            + " | " + " / ".join(f"{r['load'] / MIB:.0f}" for r in ranks)
            + f" | {ranks[0]['shards'] / MIB:.0f} | {max(r['seconds'] for r in ranks):.1f} | {'yes' if same else 'NO'} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.results:
        with open(args.results, "a") as f:
            f.write("\n" + table + "\n")


if __name__ == "__main__":
    main()
