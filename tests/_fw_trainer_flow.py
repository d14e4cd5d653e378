"""Hugging Face ``transformers.Trainer`` flows with flatshard, run by
tests/test_framework_trainer.py.

Launched with 2 CPU ranks (``python -m torch.distributed.run --standalone --nproc-per-node 2
tests/_fw_trainer_flow.py PHASE WORK VARIANT``), except ``check``, which runs in one plain
process with no process group. Each phase writes what it saw to JSON (and tensors to ``.pt``) under
WORK; the test asserts on them. VARIANT is ``fp32``, ``bf16`` (``bf16=True``, the model held in
bfloat16) or ``fp32-sharded`` (fp32, checkpoints with ``state_dict_type="SHARDED_STATE_DICT"``).

Phases:
- ``full``: Trainer with ``fsdp="full_shard auto_wrap"`` and ``fsdp_config={"version": 1,
  "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}`` after ``flatshard.patch_torch_fsdp()``;
  trains ``STEPS`` steps uninterrupted with a checkpoint every ``SAVE_EVERY`` steps, then
  ``trainer.save_model`` (not for ``fp32-sharded``: the Trainer writes no weights then).
- ``resume``: new processes, new process group: the same Trainer resumes from the checkpoint at
  step ``SAVE_EVERY`` (``trainer.train(resume_from_checkpoint=...)``) and trains to ``STEPS``.
  In fp32 it then runs the wrapped-first flows: a model the user wrapped with flatshard, passed to
  the Trainer, first without the patch (the error), then with it (trains); and gradient
  accumulation (``gradient_accumulation_steps=ACCUMULATE``, FSDP1's ``no_sync``).
- ``check VARIANTS`` (no process group): ``AutoModelForCausalLM.from_pretrained`` of the exports, and the
  single-process reference: the same model, data, AdamW, linear schedule and clipping in a plain
  torch loop on the combined batch of both ranks.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp

import flatshard
from flatshard.wrap import ModuleWrapPolicy

try:  # the frameworks extra (pip install flatshard[frameworks]); the test skips without it
    from safetensors import safe_open
    from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments,
                              get_linear_schedule_with_warmup)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
except ImportError as missing:
    raise SystemExit(f"the Trainer flows need transformers (pip install flatshard[frameworks]): {missing}") from None

STEPS = 4
SAVE_EVERY = 2
ACCUMULATE = 2  # micro-batches per step in the gradient-accumulation flow (STEPS // ACCUMULATE steps)
PER_RANK_BATCH = 2
WORLD = 2
SEQ = 16
VOCAB = 128
LR = 1e-2
MAX_GRAD_NORM = 1.0
MODEL_COLUMNS = ("input_ids", "attention_mask", "labels")
VARIANTS = ("fp32", "bf16", "fp32-sharded")  # fp32-sharded: fp32 with fsdp_config state_dict_type SHARDED_STATE_DICT
EXTRA_COLUMN = "sample_note"  # a dataset column the model does not take: remove_unused_columns drops it


def tiny_llama(variant: str = "fp32") -> "torch.nn.Module":
    """The same tiny Llama in every process (fixed seed, no dropout). For ``bf16`` it is held in
    bfloat16, as ``from_pretrained(..., dtype=torch.bfloat16)`` gives it: with ``bf16=True``
    accelerate then upcasts each FlatParameter to float32 through FSDP1's private attributes."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16) if variant == "bf16" else model


def samples() -> List[torch.Tensor]:
    """Fixed token sequences, one per sample: STEPS steps of WORLD * PER_RANK_BATCH each."""
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (STEPS * WORLD * PER_RANK_BATCH, SEQ), generator=generator)
    return list(tokens)


class TokenDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.rows = samples()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        ids = self.rows[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(), EXTRA_COLUMN: i}


def clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def _write(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


# --------------------------------------------------------------------------------------------
# The distributed phases


def _trainer_class() -> type:
    class RecordingTrainer(Trainer):
        """Records each step's loss exactly as computed (Trainer's logs round it to 4 digits)."""

        recorded: List[float]

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[no-untyped-def]
            result = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
            loss = result[0] if return_outputs else result
            self.recorded.append(float(loss.detach()))
            return result

    return RecordingTrainer


def _arguments(output_dir: Path, variant: str, **overrides: Any) -> Any:
    options: Dict[str, Any] = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        max_steps=STEPS,
        per_device_train_batch_size=PER_RANK_BATCH,
        learning_rate=LR,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=MAX_GRAD_NORM,
        optim="adamw_torch",
        save_strategy="steps",
        save_steps=SAVE_EVERY,
        logging_steps=1,
        report_to=[],
        seed=0,
        # The dataset's order, no shuffling: the resume comparison and the single-process reference
        # need the same batches (rank r gets batch 2 * step + r, accelerate's batch sharding).
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        disable_tqdm=True,
        bf16=variant == "bf16",
        # The Trainer's FSDP1 recipe: the sharding strategy and auto-wrap in `fsdp`, version 1 and
        # the decoder layer class in `fsdp_config` (Trainer's default version is now 2).
        fsdp="full_shard auto_wrap",
        fsdp_config={"version": 1, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    )
    if variant == "fp32-sharded":  # checkpoints as torch.distributed.checkpoint shards (the default is FULL_STATE_DICT)
        options["fsdp_config"]["state_dict_type"] = "SHARDED_STATE_DICT"
    options.update(overrides)
    return TrainingArguments(**options)


def _seen_columns(model: torch.nn.Module, seen: List[List[str]]) -> None:
    """Record the keyword arguments each forward of the HF model receives."""
    def hook(module: torch.nn.Module, args: Any, kwargs: Dict[str, Any]) -> None:
        seen.append(sorted(kwargs))

    model.register_forward_pre_hook(hook, with_kwargs=True)


def _full_parameters(wrapper: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The full (unsharded) parameters, by the HF model's names, through summon_full_params (a
    route independent of the state dict that save_model and the checkpoints use)."""
    with flatshard.FullyShardedDataParallel.summon_full_params(wrapper, writeback=False):
        return {clean(n): p.detach().clone() for n, p in wrapper.named_parameters()}


def _structure(trainer: Any, torch_fsdp_class: type) -> Dict[str, Any]:
    """Check 1: the Trainer's model is flatshard's wrapper, with no torch FSDP1 anywhere."""
    wrapped = trainer.model_wrapped
    units = [clean(n) or "<root>" for n, m in wrapped.named_modules() if isinstance(m, flatshard.FullyShardedDataParallel)]
    managing = [m for m in flatshard.FullyShardedDataParallel.fsdp_modules(wrapped) if m._has_params]
    return {
        "wrapper_type": f"{type(wrapped).__module__}.{type(wrapped).__qualname__}",
        "trainer_model_is_wrapper": trainer.model is wrapped,
        "torch_fsdp1_modules": sum(isinstance(m, torch_fsdp_class) for m in wrapped.modules()),
        "units": units,
        "signature": list(inspect.signature(wrapped.forward).parameters)[:12],
        # What accelerate's upcast under mixed precision reads and writes (FSDP1's private surface).
        "flat_param_dtypes": sorted({str(m._flat_param.dtype) for m in managing}),
        "orig_param_dtypes": sorted({str(m._handle._orig_param_dtype) for m in managing}),
        "fqns": [list(m._flat_param._fqns) for m in managing],
    }


def _train(trainer: Any, **kwargs: Any) -> List[float]:
    trainer.recorded = []
    trainer.train(**kwargs)
    return trainer.recorded


def phase_full(work: Path, variant: str) -> None:
    torch_fsdp_class = torch_fsdp.FullyShardedDataParallel
    patch = flatshard.patch_torch_fsdp()
    rank = int(os.environ["RANK"])
    model = tiny_llama(variant)
    seen: List[List[str]] = []
    _seen_columns(model, seen)
    trainer = _trainer_class()(model=model, args=_arguments(work / f"run_{variant}", variant), train_dataset=TokenDataset())
    losses = _train(trainer)
    result = {"losses": losses, "columns": seen, "replaced": patch.replaced, **_structure(trainer, torch_fsdp_class),
              "checkpoints": sorted(p.name for p in (work / f"run_{variant}").glob("checkpoint-*"))}
    params = _full_parameters(trainer.model_wrapped)
    if variant != "fp32-sharded":  # (under SHARDED_STATE_DICT, save_model writes no weights)
        trainer.save_model(str(work / f"export_{variant}"))
    if rank == 0:
        torch.save(params, work / f"params_full_{variant}.pt")
    _write(work / f"full_{variant}_rank{rank}.json", result)


def phase_resume(work: Path, variant: str) -> None:
    rank = int(os.environ["RANK"])
    torch_fsdp_class = torch_fsdp.FullyShardedDataParallel
    result: Dict[str, Any] = {}
    if variant == "fp32":
        # Before any patch: a model the user wrapped with flatshard, passed to an unpatched Trainer.
        result["unpatched"] = _wrapped_first(work, variant, patched=False)
    flatshard.patch_torch_fsdp()
    checkpoint = work / f"run_{variant}" / f"checkpoint-{SAVE_EVERY}"
    trainer = _trainer_class()(model=tiny_llama(variant), args=_arguments(work / f"resumed_{variant}", variant),
                               train_dataset=TokenDataset())
    result["losses"] = _train(trainer, resume_from_checkpoint=str(checkpoint))
    result["global_step"] = trainer.state.global_step
    result.update(_structure(trainer, torch_fsdp_class))
    params = _full_parameters(trainer.model_wrapped)
    if rank == 0:
        torch.save(params, work / f"params_resumed_{variant}.pt")
    if variant == "fp32":
        result["patched"] = _wrapped_first(work, variant, patched=True, torch_fsdp_class=torch_fsdp_class)
        result["accumulation"] = _accumulation(work)
    dist.barrier()
    _write(work / f"resume_{variant}_rank{rank}.json", result)


def _user_wrapped_model() -> torch.nn.Module:
    """What README's migration section suggests: the user wraps the model with flatshard first."""
    return flatshard.FullyShardedDataParallel(tiny_llama(), auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                                              use_orig_params=True, device_id=torch.device("cpu"))


def _wrapped_first(work: Path, variant: str, patched: bool, torch_fsdp_class: Any = None) -> Dict[str, Any]:
    rank = int(os.environ["RANK"])
    tag = "patched" if patched else "unpatched"
    # TrainingArguments first: it starts the process group (accelerate's PartialState), which the
    # user's wrap needs.
    args = _arguments(work / f"wrapped_first_{tag}", variant, save_strategy="no")
    wrapper = _user_wrapped_model()
    inner = wrapper.module
    seen: List[List[str]] = []
    _seen_columns(inner, seen)
    trainer = _trainer_class()(model=wrapper, args=args, train_dataset=TokenDataset())
    if not patched:
        try:
            _train(trainer)
        except Exception as error:  # noqa: BLE001 (the test asserts the type and text)
            return {"error_type": type(error).__name__, "error": str(error), "mro": [c.__name__ for c in type(error).__mro__]}
        return {"error_type": None, "error": None, "losses": trainer.recorded}
    try:
        losses = _train(trainer)
    except Exception as error:  # noqa: BLE001 (the test shows it; the other flows' results still count)
        return {"error": f"{type(error).__name__}: {error}"}
    result = {"losses": losses, "columns": seen, "same_wrapper": trainer.model_wrapped is wrapper,
              **_structure(trainer, torch_fsdp_class)}
    params = _full_parameters(trainer.model_wrapped)
    if rank == 0:
        torch.save(params, work / f"params_wrapped_first_{variant}.pt")
    return result


def _accumulation(work: Path) -> Dict[str, Any]:
    """Gradient accumulation: ACCUMULATE micro-batches per step, all but the last under
    accelerate's ``no_sync`` (FSDP1's ``no_sync()`` on the root). Counts the ``no_sync`` calls,
    since syncing every micro-batch would train the same."""
    rank = int(os.environ["RANK"])
    entered: List[int] = []
    original = flatshard.FullyShardedDataParallel.no_sync

    def counting_no_sync(self: Any) -> Any:
        entered.append(1)
        return original(self)

    flatshard.FullyShardedDataParallel.no_sync = counting_no_sync  # type: ignore[method-assign]
    try:
        args = _arguments(work / "accumulation", "fp32", save_strategy="no", max_steps=STEPS // ACCUMULATE,
                          gradient_accumulation_steps=ACCUMULATE)
        trainer = _trainer_class()(model=tiny_llama(), args=args, train_dataset=TokenDataset())
        losses = _train(trainer)
    finally:
        flatshard.FullyShardedDataParallel.no_sync = original  # type: ignore[method-assign]
    params = _full_parameters(trainer.model_wrapped)
    if rank == 0:
        torch.save(params, work / "params_accumulation_fp32.pt")
    return {"losses": losses, "no_sync_calls": len(entered)}


# --------------------------------------------------------------------------------------------
# The check without a process group


def _reference(work: Path, variant: str, accumulate: int = 1) -> List[float]:
    """The single-process reference: one process, the combined batch of both ranks (and of all
    ``accumulate`` micro-batches) at each step, in float32 from the run's initial weights (for
    bf16, the bfloat16 weights upcast, as accelerate upcasts them)."""
    model = tiny_llama(variant).float()
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, work / f"params_initial_{variant}.pt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    steps, size = STEPS // accumulate, WORLD * PER_RANK_BATCH * accumulate
    schedule = get_linear_schedule_with_warmup(optimizer, 0, steps)
    rows = torch.stack(samples())
    losses = []
    for step in range(steps):
        batch = rows[step * size:(step + 1) * size]
        loss = model(input_ids=batch, attention_mask=torch.ones_like(batch), labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    name = variant if accumulate == 1 else f"accumulation_{variant}"
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, work / f"params_reference_{name}.pt")
    return losses


def phase_check(work: Path, variants: List[str]) -> None:
    result: Dict[str, Any] = {"process_group": dist.is_available() and dist.is_initialized()}
    exported = [v for v in variants if v != "fp32-sharded"]
    for variant in exported:  # (fp32-sharded trains as fp32: the same reference)
        result[f"reference_losses_{variant}"] = _reference(work, variant)
    if "fp32" in variants:
        result["reference_losses_accumulation_fp32"] = _reference(work, "fp32", accumulate=ACCUMULATE)
    # Check 5: the exports load with no process group and hold the trained parameters.
    for variant in exported:
        export = work / f"export_{variant}"
        loaded = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
        with safe_open(str(export / "model.safetensors"), framework="pt") as stored:
            stored_dtypes = sorted({str(stored.get_slice(k).get_dtype()) for k in stored.keys()})
        trained = torch.load(work / f"params_full_{variant}.pt")
        names = {n for n, _ in loaded.named_parameters()}
        result[f"export_{variant}"] = {
            "names_match": names == set(trained),
            "equal": sorted(n for n, p in loaded.named_parameters() if n in trained and torch.equal(p, trained[n])),
            "differ": sorted(n for n, p in loaded.named_parameters() if n in trained and not torch.equal(p, trained[n])),
            "stored_dtypes": stored_dtypes,
        }
    result["process_group_after"] = dist.is_available() and dist.is_initialized()
    _write(work / "check.json", result)


def main(argv: List[str]) -> None:
    phase, work = argv[0], Path(argv[1])
    if phase == "check":
        phase_check(work, argv[2].split(","))
        return
    variant = argv[2]
    if variant not in VARIANTS:
        raise SystemExit(f"variant must be one of {VARIANTS}, got {variant!r}")
    from tests import _cpu_shim_trainer  # (test-only: opens accelerate's FSDP path on CPU ranks)

    _cpu_shim_trainer.install()
    {"full": phase_full, "resume": phase_resume}[phase](work, variant)


if __name__ == "__main__":
    main(sys.argv[1:])
