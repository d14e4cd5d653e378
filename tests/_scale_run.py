"""One rank of a large world on torch's fake process group, for ``tests/test_scale.py``.

    python -m tests._scale_run WORLD_SIZE RANK            # what main() saw
    python -m tests._scale_run WORLD_SIZE RANK --peaks    # peaks(): flatshard's against FSDP1's
    python -m tests._scale_run WORLD_SIZE RANK --load CHECKPOINT   # load(): load_pretrained

builds a small decoder on the meta device, wraps it (``param_init_fn``, one unit per block),
trains three steps and goes through every state dict and optimizer state dict, saving and
loading each back; prints one JSON line of what it saw. Also the model, batch and loss of
``tests/test_plan_measure.py``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist
from torch import nn

DIM, BLOCKS, VOCAB = 64, 4, 128


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(*[Block() for _ in range(BLOCKS)])
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def example_tokens() -> torch.Tensor:
    """A batch for ``python -m flatshard.plan tests._scale_run:Decoder ... --measure``."""
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


def lm_loss(logits: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), example_tokens().flatten())


def _init(module: nn.Module) -> None:
    module.to_empty(device="cpu", recurse=False)
    with torch.no_grad():
        for p in module.parameters(recurse=False):
            p.normal_(0.0, 0.02)


def _step(model: nn.Module, optim: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    logits = model(tokens)
    nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _flatshard_calls(run: Callable[[], None]) -> int:
    """Python function calls into flatshard's own code while ``run`` runs."""
    import flatshard

    root = os.path.dirname(flatshard.__file__)
    count = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(root):
            count[0] += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return count[0]


def _attempt(fn: Callable[[], Any]) -> str:
    try:
        fn()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"


def main(world: int, rank: int) -> Dict[str, Any]:

    from flatshard import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        ShardedDataParallel,
        StateDictType,
    )
    from flatshard._comm._collectives import init_fake_world
    from flatshard._base._memory_timeline import MemoryTimeline
    from flatshard.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from flatshard.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    init_fake_world(rank, world)
    tokens = torch.randint(0, VOCAB, (2, 16))
    with torch.device("meta"):
        meta = Decoder()
    with MemoryTimeline(torch.device("cpu")) as timeline:
        with timeline.phase("construct"):
            model = ShardedDataParallel(meta, auto_wrap_policy=ModuleWrapPolicy({Block}), param_init_fn=_init)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with timeline.phase("train"):
            first_step_calls = _flatshard_calls(lambda: _step(model, optim, tokens))
            _step(model, optim, tokens)
    shards = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for s in optim.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    result: Dict[str, Any] = {
        "resting": timeline.phases["train"].end,
        "shards_and_state": shards + state,
        "calls_per_step": _flatshard_calls(lambda: _step(model, optim, tokens)),
        "first_step_calls": first_step_calls,
    }
    outcomes: Dict[str, str] = {}
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"):
        with ShardedDataParallel.state_dict_type(model, StateDictType[kind]):
            sd = model.state_dict()
            outcomes[f"{kind} keys"] = str(len(sd))
            outcomes[f"{kind} load"] = _attempt(lambda: model.load_state_dict(sd))
            if kind != "LOCAL_STATE_DICT":
                osd = ShardedDataParallel.optim_state_dict(model, optim)
                outcomes[f"{kind} optimizer load"] = _attempt(lambda: optim.load_state_dict(ShardedDataParallel.optim_state_dict_to_load(model, optim, osd)))
    full = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with ShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, full, FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        osd = ShardedDataParallel.optim_state_dict(model, optim)
        outcomes["rank0_only optimizer load"] = _attempt(lambda: optim.load_state_dict(ShardedDataParallel.optim_state_dict_to_load(model, optim, osd)))
    msd, posd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    outcomes["broadcast_from_rank0"] = _attempt(
        lambda: set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=posd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    )
    _step(model, optim, tokens)  # (still trains after all of it)
    result["outcomes"] = outcomes
    dist.destroy_process_group()
    return result


def peaks(world: int, rank: int) -> Dict[str, Dict[str, int]]:
    """Each phase's peak bytes of a training step (the second), flatshard's (with overlap and
    without: ``set_communication_overlap``) and torch FSDP1's, one after the other in this
    process, counted from before each model is built; and the bytes of one block's full
    parameters ("block")."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from flatshard import ShardedDataParallel
    from flatshard._comm._collectives import init_fake_world
    from flatshard._base._memory_timeline import MemoryTimeline
    from flatshard.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    init_fake_world(rank, world)
    tokens = torch.randint(0, VOCAB, (2, 16))
    found = {}
    for name in ("flatshard", "flatshard without overlap", "fsdp1"):
        gc.collect()  # (the model before is gone before this one's timeline starts)
        with MemoryTimeline(torch.device("cpu")) as timeline:
            with torch.device("meta"):
                meta = Decoder()
            policy = ModuleWrapPolicy({Block})
            if name.startswith("flatshard"):
                model: nn.Module = ShardedDataParallel(meta, auto_wrap_policy=policy, param_init_fn=_init)
                model.set_communication_overlap(name == "flatshard")
            else:
                model = FullyShardedDataParallel(meta, auto_wrap_policy=policy, param_init_fn=_init, device_id=torch.device("cpu"))
            optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
            _step(model, optim, tokens)
            with timeline.phase("forward"):
                loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            with timeline.phase("backward"):
                loss.backward()
                del loss
            with timeline.phase("optimizer step"):
                optim.step()
                optim.zero_grad(set_to_none=True)
        found[name] = {phase: m.peak for phase, m in timeline.phases.items()}
        del model, optim, meta
    dist.destroy_process_group()
    found["block"] = {"bytes": sum(p.numel() * p.element_size() for p in Block().parameters())}
    return found


def source() -> Decoder:
    """The model ``load`` reads (the test writes it to the checkpoint)."""
    torch.manual_seed(5)
    return Decoder()


def load(world: int, rank: int, checkpoint: str) -> Dict[str, Any]:
    """``load_pretrained`` into the meta-built model, wrapped with ``empty_init``: the peak
    bytes allocated while loading, the shards' bytes, and whether every shard holds its part
    of ``source()``."""
    from flatshard import ShardedDataParallel, empty_init, load_pretrained
    from flatshard._checkpoint._checkpointing import named_units
    from flatshard._comm._collectives import init_fake_world
    from flatshard._base._memory_timeline import MemoryTimeline
    from flatshard.wrap import ModuleWrapPolicy

    init_fake_world(rank, world)
    with torch.device("meta"):
        meta = Decoder()
    model = ShardedDataParallel(meta, auto_wrap_policy=ModuleWrapPolicy({Block}), param_init_fn=empty_init("cpu"))
    gc.collect()
    with MemoryTimeline(torch.device("cpu")) as timeline:
        with timeline.phase("load"):
            load_pretrained(model, checkpoint)
    phase = timeline.phases["load"]
    values = source().state_dict()
    wrong = []
    for path, unit in named_units(model):
        for handle in unit.handles:
            flat = torch.cat([values[f"{path}.{info.name}" if path else info.name].reshape(-1) for info in handle.param_infos])
            start = min(rank * handle.shard_numel, flat.numel())
            mine = flat[start : start + handle.shard_numel]
            if not torch.equal(handle.flat_param.detach()[: mine.numel()], mine):
                wrong.append(handle.describe())
    dist.destroy_process_group()
    return {
        "peak_above_start": phase.peak - phase.start,
        "shards": sum(p.numel() * p.element_size() for p in model.parameters()),
        "largest_parameter": max(v.numel() * v.element_size() for v in values.values()),
        "wrong": wrong,
    }


if __name__ == "__main__":
    if sys.argv[3:4] == ["--load"]:
        print(json.dumps(load(int(sys.argv[1]), int(sys.argv[2]), sys.argv[4])))
    elif sys.argv[3:] == ["--peaks"]:
        print(json.dumps(peaks(int(sys.argv[1]), int(sys.argv[2]))))
    else:
        print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]))))
