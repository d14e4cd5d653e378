"""accelerate's FSDP1 plugin with flatshard in torch's place: one rank of a 2-rank CPU run.

Launched by tests/test_framework_accelerate.py under ``torch.distributed.run`` (2 processes).
Each variant named on the command line runs here in turn, each in process groups of its own:

1. a new process group and a new ``Accelerator``; the tiny Llama prepared (after
   ``flatshard.patch_torch_fsdp()``), STEPS steps trained, ``save_state`` after RESUME_AT steps,
   the full state dict exported (``get_state_dict`` + ``save_pretrained``, and ``save_model``);
2. that group destroyed, accelerate's state reset; a new group, a new ``Accelerator``, a model
   built from another seed, ``load_state``, the remaining steps trained.

Rank 0 writes what the test asserts: results.json (per variant: the losses and gradient norms of
both runs and of one process training the combined batch with plain torch, what the wrapping
produced, the upcast warnings), and per variant full.pt (the trained full state dict),
resumed.pt (after the resume) and reference.pt (the one-process parameters). ``prewrapped`` and ``prewrapped_unpatched`` are the model wrapped with flatshard first.

Usage: _fw_accelerate_flow.py OUT_DIR VARIANT [VARIANT ...], a variant being
``<fp32|bf16>-<SHARDED|FULL>[-bf16model][-env][-accum][-together]`` (``-env``: the plugin from the
environment, as ``accelerate launch`` configures it; ``-accum``: each rank's rows in two
micro-batches, ``accelerator.accumulate``; ``-together``: use_orig_params=True and
``prepare(model, optimizer)`` in one call), ``prewrapped`` or ``prewrapped_unpatched``; then,
in a plain process (no launcher, no process group), ``_fw_accelerate_flow.py --export OUT_DIR
VARIANT ...`` reads the exports back.
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

try:  # the frameworks extra (the test skips without it)
    import transformers
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers.modeling_utils import load_state_dict as read_weights_file
except ImportError as missing:
    raise SystemExit(f"tests/_fw_accelerate_flow.py needs the frameworks extra (pip install -e '.[frameworks]'): {missing}")

from torch.distributed.fsdp import fully_sharded_data_parallel as _torch_fsdp1

import flatshard
from tests import _cpu_shim_accelerate

# torch's own FSDP1 class, held where patch_torch_fsdp() does not reach (it rebinds module-level
# names bound to the class, this module's included).
_TORCH_FSDP1 = {"class": _torch_fsdp1.FullyShardedDataParallel}

_OUT: List[Path] = []  # the output directory (set by main)
_GROUPS: List[int] = []  # one entry per process group made so far
_PATCH: List[Any] = []  # the one patch_torch_fsdp() call that replaced torch's class

STEPS, RESUME_AT, LR = 4, 2, 1e-2
MAX_NORM = 1.0  # below the gradients' norms here: clipping changes every step
VOCAB, SEQ, PER_RANK = 128, 8, 2


def tiny_llama(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return transformers.LlamaForCausalLM(config).to(dtype)


def batch(step: int) -> torch.Tensor:
    """The combined batch of one step (both ranks' rows); rank r trains rows [r*PER_RANK, (r+1)*PER_RANK)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(2, VOCAB, (2 * PER_RANK, SEQ), generator=gen)


def plain_state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def reference(precision: str, model_dtype: torch.dtype) -> Tuple[List[float], List[float], Dict[str, torch.Tensor]]:
    """One process, plain torch, the combined batch, the same AdamW on fp32 parameters (what
    accelerate's upcast leaves, also for a model loaded in bf16): the truth for training.

    bf16 does by hand what the FSDP1 plugin's ``MixedPrecision(param_dtype=bf16,
    reduce_dtype=bf16, buffer_dtype=bf16)`` and accelerate's CPU autocast do: each half of the
    batch runs forward and backward on a bf16 copy of the parameters and buffers under autocast,
    and the two bf16 gradients are halved and summed in bf16 (FSDP1's pre-division at world size
    2), then applied to the fp32 parameters."""
    model = tiny_llama(0, model_dtype).to(torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses: List[float] = []
    norms: List[float] = []
    for step in range(STEPS):
        ids = batch(step)
        if precision == "fp32":
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
        else:
            halves = []
            for rank in range(2):
                low = copy.deepcopy(model).to(torch.bfloat16)
                part = ids[rank * PER_RANK:(rank + 1) * PER_RANK]
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = low(input_ids=part, labels=part).loss
                loss.float().backward()
                halves.append((loss.float().item(), {n: p.grad for n, p in low.named_parameters()}))
            losses.append(sum(loss for loss, _ in halves) / 2)
            for name, param in model.named_parameters():
                param.grad = (halves[0][1][name] / 2 + halves[1][1][name] / 2).to(torch.float32)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
    return losses, norms, plain_state(model)


# What `accelerate launch --use_fsdp --fsdp_version 1 ...` puts in the environment for
# Accelerator() to build its FSDP plugin from (accelerate/utils/launch.py; accelerator.py's
# "init from env variables"), and the CPU and precision switches (ACCELERATE_USE_CPU,
# ACCELERATE_MIXED_PRECISION). The "-env" variants configure accelerate this way.
_LAUNCH_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "1",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
    "FSDP_USE_ORIG_PARAMS": "false",
    "ACCELERATE_USE_CPU": "true",
}


def new_accelerator(precision: str, state_dict_type: str, patch: bool = True, from_env: bool = False, micro: int = 1,
                    orig_params: bool = False) -> Any:
    """A new process group and a new Accelerator with the FSDP1 plugin (accelerate's state reset
    first); ``from_env``: ``Accelerator()`` builds the plugin from the environment; ``micro``:
    gradient accumulation steps; ``orig_params``: the plugin's use_orig_params."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    _cpu_shim_accelerate.open_fsdp_on_cpu()
    if patch:
        made = flatshard.patch_torch_fsdp()
        if made.active:
            _PATCH.append(made)
    else:
        while _PATCH:
            _PATCH.pop().undo()
    if from_env:
        os.environ.update(_LAUNCH_ENV, FSDP_STATE_DICT_TYPE=state_dict_type + "_STATE_DICT",
                          ACCELERATE_MIXED_PRECISION="bf16" if precision == "bf16" else "no")
        _connect()
        return Accelerator()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=1,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        state_dict_type=state_dict_type + "_STATE_DICT",
        use_orig_params=orig_params,
    )
    _connect()
    # cpu=True: what `accelerate launch --cpu` sets (ACCELERATE_USE_CPU); without it accelerate
    # on a machine without accelerators makes DistributedType.NO and prepares nothing.
    return Accelerator(cpu=True, mixed_precision="bf16" if precision == "bf16" else "no", fsdp_plugin=plugin,
                       gradient_accumulation_steps=micro)


def _connect() -> None:
    """A new default process group. Each rendezvouses through a file of its own (accelerate uses
    a group it finds): a second group on torchrun's agent store would find the first group's
    gloo addresses there and hang connecting to them."""
    _GROUPS.append(0)
    dist.init_process_group("gloo", init_method=f"file://{_OUT[0]}/group{len(_GROUPS)}", rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=datetime.timedelta(seconds=120))


def end_group(accelerator: Any) -> None:
    accelerator.wait_for_everyone()
    dist.destroy_process_group()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def wrapping(model: torch.nn.Module) -> Dict[str, Any]:
    """What the framework's model is made of: flatshard's units, and any torch FSDP1 instance."""
    names = [name for name, m in model.named_modules() if isinstance(m, flatshard.ShardedDataParallel)]
    torch_fsdp = [name for name, m in model.named_modules() if isinstance(m, _TORCH_FSDP1["class"])]
    return {"root_is_flatshard": isinstance(model, flatshard.ShardedDataParallel), "units": names,
            "torch_fsdp1": torch_fsdp}


def train(accelerator: Any, model: Any, optimizer: Any, steps: range) -> Tuple[List[float], List[float]]:
    """(the losses, averaged over the ranks; the gradient norms before clipping)."""
    rank = dist.get_rank()
    losses: List[float] = []
    norms: List[float] = []
    micro = accelerator.gradient_accumulation_steps  # rows of a rank's batch per backward
    for step in steps:
        ids = batch(step)[rank * PER_RANK:(rank + 1) * PER_RANK]
        total = torch.zeros(())
        for part in ids.split(PER_RANK // micro):
            # (accumulating: accelerate runs all but the last backward under FSDP1's root no_sync()
            # and skips the optimizer's step and zero_grad until the last)
            with accelerator.accumulate(model):
                loss = model(input_ids=part, labels=part).loss
                accelerator.backward(loss)  # (divides by the accumulation steps)
                if accelerator.sync_gradients:
                    # FSDP1's root clip_grad_norm_ (accelerator.clip_grad_norm_ calls model.clip_grad_norm_)
                    norms.append(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM).item())
                optimizer.step()
                optimizer.zero_grad()
            total += loss.detach().float() / micro
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses, norms


def count_no_sync(model: Any) -> List[int]:
    """A one-element list that counts the calls of the wrapper's ``no_sync`` (what accelerate's
    ``accumulate`` enters on the FSDP1 root between synchronising steps)."""
    calls = [0]
    original = model.no_sync

    def no_sync() -> Any:
        calls[0] += 1
        return original()

    model.no_sync = no_sync
    return calls


def prepared(accelerator: Any, seed: int, model_dtype: torch.dtype, together: bool = False) -> Tuple[Any, Any, List[str]]:
    """(the prepared model, its prepared AdamW, the upcast warnings accelerate gave).
    ``together``: the optimizer built from the unwrapped model and prepared with it in one call
    (needs use_orig_params=True, as with torch's FSDP1); otherwise built from the prepared model."""
    model = tiny_llama(seed, model_dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if together:
            model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
        else:
            model = accelerator.prepare(model)
    upcasts = [str(w.message) for w in caught if "Upcasted low precision parameters" in str(w.message)]
    if not together:
        optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=LR))
    return model, optimizer, upcasts


def full_state(accelerator: Any, model: Any) -> Dict[str, torch.Tensor]:
    """accelerate's export of the full state dict (rank 0 holds it; the others get {})."""
    return {name: t.detach().clone() for name, t in accelerator.get_state_dict(model).items()}


def run_variant(name: str, out: Path) -> Dict[str, Any]:
    precision, sd_type, *rest = name.split("-")
    model_dtype = torch.bfloat16 if "bf16model" in rest else torch.float32
    from_env = "env" in rest
    micro = 2 if "accum" in rest else 1
    together = "together" in rest
    root = out / name
    ckpt = root / "ckpt"
    result: Dict[str, Any] = {}

    # 1. uninterrupted, with a save at RESUME_AT
    accelerator = new_accelerator(precision, sd_type, from_env=from_env, micro=micro, orig_params=together)
    result["plugin"] = {"fsdp_version": accelerator.state.fsdp_plugin.fsdp_version,
                        "state_dict_type": accelerator.state.fsdp_plugin.state_dict_type.name}
    model, optimizer, result["upcast_warnings"] = prepared(accelerator, 0, model_dtype, together)
    result["patched_names"] = [name for patch in _PATCH for name in patch.replaced]
    result["wrapping"] = wrapping(model)
    result["is_fsdp"] = str(accelerator.distributed_type)
    result["unwrapped_is_plain"] = type(accelerator.unwrap_model(model)) is transformers.LlamaForCausalLM
    result["flat_param_dtypes"] = sorted({str(m._flat_param.dtype) for m in flatshard.ShardedDataParallel.fsdp_modules(model)
                                          if m._has_params})
    result["orig_param_dtypes"] = sorted({str(m._handle._orig_param_dtype) for m in flatshard.ShardedDataParallel.fsdp_modules(model)
                                          if m._has_params})
    result["no_sync_calls"] = count_no_sync(model)
    losses, norms = train(accelerator, model, optimizer, range(RESUME_AT))
    accelerator.save_state(str(ckpt))
    more_losses, more_norms = train(accelerator, model, optimizer, range(RESUME_AT, STEPS))
    result["losses"], result["norms"] = losses + more_losses, norms + more_norms
    full = full_state(accelerator, model)
    if accelerator.is_main_process:
        torch.save(full, root / "full.pt")
        accelerator.unwrap_model(model).save_pretrained(str(root / "pretrained"), state_dict=dict(full),
                                                        safe_serialization=True)
    accelerator.save_model(model, str(root / "save_model"))
    end_group(accelerator)

    # 2. a new group, everything built anew from another seed, load_state, the rest
    accelerator = new_accelerator(precision, sd_type, from_env=from_env, micro=micro, orig_params=together)
    model, optimizer, _ = prepared(accelerator, 1, model_dtype, together)
    accelerator.load_state(str(ckpt))
    result["resumed_losses"], result["resumed_norms"] = train(accelerator, model, optimizer, range(RESUME_AT, STEPS))
    resumed = full_state(accelerator, model)
    if accelerator.is_main_process:
        torch.save(resumed, root / "resumed.pt")
        result["reference_losses"], result["reference_norms"], ref_params = reference(precision, model_dtype)
        torch.save(ref_params, root / "reference.pt")
    end_group(accelerator)
    return result


def run_prewrapped(patch: bool, out: Path) -> Dict[str, Any]:
    """The user wraps with flatshard first, then hands the wrapper to accelerate."""
    result: Dict[str, Any] = {}
    accelerator = new_accelerator("fp32", "SHARDED", patch=patch)
    try:
        layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer
        policy = functools.partial(flatshard.transformer_auto_wrap_policy, transformer_layer_cls={layer})
        mine = flatshard.ShardedDataParallel(tiny_llama(0), auto_wrap_policy=policy)
        try:
            model = accelerator.prepare(mine)
        except Exception as error:  # the unpatched case: what the user sees
            result["error_type"] = type(error).__name__
            result["error"] = str(error)
            return result
        result["same_object"] = model is mine
        result["wrapping"] = wrapping(model)
        optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=LR))
        result["losses"], result["norms"] = train(accelerator, model, optimizer, range(STEPS))
        full = full_state(accelerator, model)
        if accelerator.is_main_process:
            torch.save(full, out / "full.pt")
            result["reference_losses"], result["reference_norms"], ref_params = reference("fp32", torch.float32)
            torch.save(ref_params, out / "reference.pt")
        return result
    finally:
        end_group(accelerator)


def export_check(out: Path, names: List[str]) -> None:
    """In a process without torch.distributed: each variant's exports (``save_pretrained``
    with accelerate's full state dict, ``save_model``) read back, compared with the full
    state dict rank 0 held (bit for bit); writes export.json."""
    found: Dict[str, Any] = {"distributed_initialized": dist.is_available() and dist.is_initialized()}
    for name in names:
        root = out / name
        full = torch.load(root / "full.pt")
        loaded = transformers.LlamaForCausalLM.from_pretrained(str(root / "pretrained"))
        pretrained = dict(loaded.named_parameters())
        saved = read_weights_file(str(root / "save_model" / "model.safetensors"))
        found[name] = {
            "pretrained_equal": sorted(pretrained) == sorted(full) and all(torch.equal(pretrained[k], full[k]) for k in full),
            "save_model_equal": sorted(saved) == sorted(full) and all(torch.equal(saved[k], full[k]) for k in full),
            "pretrained_dtype": str(loaded.dtype),
        }
    (out / "export.json").write_text(json.dumps(found, indent=1))


def main() -> None:
    if sys.argv[1] == "--export":
        export_check(Path(sys.argv[2]), sys.argv[3:])
        return
    out = Path(sys.argv[1])
    _OUT.append(out)
    results: Dict[str, Any] = {}
    for name in sys.argv[2:]:
        (out / name).mkdir(parents=True, exist_ok=True)
        environ = dict(os.environ)  # (accelerate writes settings there; each variant starts clean)
        if name == "prewrapped":
            results[name] = run_prewrapped(True, out / name)
        elif name == "prewrapped_unpatched":
            results[name] = run_prewrapped(False, out / name)
        else:
            results[name] = run_variant(name, out)
        os.environ.clear()
        os.environ.update(environ)
    if int(os.environ["RANK"]) == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
