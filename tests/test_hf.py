"""Hugging Face models end to end: training like one process, generate(), saving through the
wrapped model (save_pretrained -> from_pretrained). Tiny GPT-2 and Llama configs built in
place (nothing downloaded), world size 2; truth is the unwrapped model in one process.

Needs transformers (the ``hf`` extra: ``pip install -e ".[hf]"``); skipped without it."""

from __future__ import annotations

import functools
import importlib
import tempfile
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from expecttest import TestCase

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: the Hugging Face tests need the hf extra (pip install -e '.[hf]')"
)

from flatshard import (  # noqa: E402
    MixedPrecision,
    ShardedDataParallel,
    StateDictType,
    transformer_auto_wrap_policy,
)

VOCAB, SEQ, STEPS = 100, 12, 3


def tiny(kind: str) -> Tuple[torch.nn.Module, type]:
    """A tiny causal LM built from a config (seeded: the same weights on every rank) and its
    decoder layer class."""
    torch.manual_seed(0)
    ids = dict(bos_token_id=0, eos_token_id=1, pad_token_id=1)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids)
        model = transformers.GPT2LMHeadModel(config)
        return model, type(model.transformer.h[0])
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=64, **ids)
    model = transformers.LlamaForCausalLM(config)
    return model, type(model.model.layers[0])


def wrapped(kind: str, checkpointing: bool = False, **options: Any) -> Tuple[torch.nn.Module, ShardedDataParallel]:
    """(the plain model, a wrapped copy of it with a unit per decoder layer); with
    ``checkpointing``, Hugging Face's activation checkpointing per decoder layer in both."""
    model, layer = tiny(kind)
    plain, _ = tiny(kind)
    if checkpointing:
        for each in (model, plain):
            each.activation_checkpointing_enable({"use_reentrant": False})
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer})
    return plain, ShardedDataParallel(model, auto_wrap_policy=policy, **options)


def batch(step: int) -> torch.Tensor:
    """The global batch of a step: 4 sequences; rank r takes rows 2r, 2r+1."""
    return torch.randint(2, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(step))


def train(model: torch.nn.Module, rank: Any, steps: int = STEPS) -> List[float]:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        tokens = batch(step) if rank is None else batch(step)[2 * rank: 2 * rank + 2]
        loss = model(input_ids=tokens, labels=tokens).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


def _parity(rank: int, world_size: int, kind: str, orig: bool, checkpointing: bool) -> float:
    plain, model = wrapped(kind, checkpointing, use_orig_params=orig)
    train(plain, None)
    train(model, rank)
    with ShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full = model.state_dict()
    reference = plain.state_dict()
    if set(full) != set(reference):
        raise AssertionError(f"keys differ: {sorted(set(full) ^ set(reference))}")
    return max((full[k] - reference[k]).abs().max().item() for k in reference)


def _generate(rank: int, world_size: int, kind: str, orig: bool) -> List[bool]:
    plain, model = wrapped(kind, use_orig_params=orig)
    train(plain, None, steps=1)
    train(model, rank, steps=1)
    prompt = torch.tensor([[5, 6, 7 + rank]])
    expected = plain.generate(prompt, max_new_tokens=6, do_sample=False)
    through_wrapper = model.generate(prompt, max_new_tokens=6, do_sample=False)
    with ShardedDataParallel.summon_full_params(model, writeback=False):
        summoned = model.generate(prompt, max_new_tokens=6, do_sample=False)
    model(input_ids=prompt).logits.sum().backward()  # training goes on after generating
    # transformers (and libraries testing the same attribute) see FSDP-managed modules
    is_managed = importlib.import_module("transformers.distributed.fsdp").is_fsdp_managed_module
    managed = all(is_managed(m) for m in (model, model.module, *model.module.modules()))
    return [torch.equal(through_wrapper, expected), torch.equal(summoned, expected), managed]


def _unequal_lengths(rank: int, world_size: int) -> Tuple[int, int, str]:
    plain, model = wrapped("gpt2")
    prompt = torch.tensor([[5, 6, 7]])
    length = 3 + 5 * rank  # rank 1 generates 5 more tokens than rank 0
    out = model.generate(prompt, max_new_tokens=length, do_sample=False)
    same = torch.equal(out, plain.generate(prompt, max_new_tokens=length, do_sample=False))
    try:  # refusing the synchronisation: an error on every rank, not a hang
        model.generate(prompt, max_new_tokens=length, do_sample=False, synced_gpus=False)
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    return out.shape[1] - 3, int(same), error


def _save_pretrained(rank: int, world_size: int, kind: str, orig: bool, directory: str) -> Dict[str, Any]:
    plain, model = wrapped(kind, use_orig_params=orig, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    train(model, rank, steps=2)
    full = model.state_dict()  # FULL_STATE_DICT by default
    with ShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        inner = model.module.state_dict()  # through the wrapped module: still the full one
    model.save_pretrained(directory, is_main_process=rank == 0)  # the wrapped model's method
    dist.barrier()
    loaded = type(plain).from_pretrained(directory)
    result = {
        "inner_keys_equal": list(inner) == list(full),
        "inner_max_diff": max((inner[k] - full[k]).abs().max().item() for k in full),
        "loaded_max_diff": max((v - full[k]).abs().max().item() for k, v in loaded.state_dict().items()),
        "missing": sorted(set(full) - set(loaded.state_dict())),
    }
    prompt = torch.tensor([[5, 6, 7]])
    result["generate_equal"] = torch.equal(loaded.generate(prompt, max_new_tokens=4, do_sample=False),
                                           model.generate(prompt, max_new_tokens=4, do_sample=False))
    dist.barrier()
    return result


def _load_pretrained(rank: int, world_size: int, kind: str, directory: str) -> Dict[str, Any]:
    """A model built on the meta device reads save_pretrained's safetensors with
    load_pretrained: the plain from_pretrained model's values and tokens."""
    from flatshard import empty_init, load_pretrained

    plain = transformers.AutoModelForCausalLM.from_pretrained(directory)
    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    if kind == "llama":  # (its rotary table is a non-persistent buffer: built for real)
        meta.model.rotary_emb = type(meta.model.rotary_emb)(config=config)
    layer = type(meta.model.layers[0]) if kind == "llama" else type(meta.transformer.h[0])
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer})
    model = ShardedDataParallel(meta, auto_wrap_policy=policy, param_init_fn=empty_init("cpu"))
    result = load_pretrained(model, directory)
    full = model.state_dict()
    prompt = torch.tensor([[5, 6, 7]])
    return {
        "result": result,
        "equal": sorted(k for k, v in plain.state_dict().items() if torch.equal(full[k], v)) == sorted(full),
        "generate_equal": torch.equal(plain.generate(prompt, max_new_tokens=4, do_sample=False),
                                      model.generate(prompt, max_new_tokens=4, do_sample=False)),
    }


class HuggingFaceTest(TestCase):
    def test_load_pretrained_reads_save_pretrained_files_into_a_meta_built_model(self) -> None:
        for kind in ("gpt2", "llama"):
            with self.subTest(kind=kind), tempfile.TemporaryDirectory() as directory:
                model, _ = tiny(kind)
                model.save_pretrained(directory)
                for result in self.pool.run(_load_pretrained, 2, kind, directory):
                    self.assertEqual(result, {"result": ([], []), "equal": True, "generate_equal": True})

    def test_training_matches_a_single_process(self) -> None:
        for kind in ("gpt2", "llama"):
            with self.subTest(kind=kind):
                diffs = self.pool.run(_parity, 2, kind, kind == "llama", kind == "llama")
                self.assertLess(max(diffs), 1e-4)  # AdamW on float32 reductions in another order

    def test_generate_gives_the_unwrapped_models_tokens(self) -> None:
        for kind, orig in (("gpt2", False), ("gpt2", True), ("llama", False)):
            with self.subTest(kind=kind, use_orig_params=orig):
                self.assertEqual(self.pool.run(_generate, 2, kind, orig), [[True, True, True]] * 2)

    def test_ranks_generating_different_lengths_do_not_hang(self) -> None:
        (new0, same0, error0), (new1, same1, error1) = self.pool.run(_unequal_lengths, 2, timeout=120)
        self.assertEqual((new0, new1, same0, same1), (3, 8, 1, 1))
        for error in (error0, error1):
            self.assertIn("the ranks ran different units", error)

    def test_save_pretrained_through_the_wrapper_loads_with_from_pretrained(self) -> None:
        for kind, orig in (("gpt2", False), ("llama", True)):
            with self.subTest(kind=kind, use_orig_params=orig), tempfile.TemporaryDirectory() as directory:
                for result in self.pool.run(_save_pretrained, 2, kind, orig, directory):
                    self.assertEqual(result["missing"], [])
                    self.assertTrue(result["inner_keys_equal"])
                    self.assertEqual(result["inner_max_diff"], 0.0)
                    self.assertEqual(result["loaded_max_diff"], 0.0)
                    self.assertTrue(result["generate_equal"])
