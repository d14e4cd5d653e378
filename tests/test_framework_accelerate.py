"""Hugging Face accelerate with its FSDP1 plugin, with flatshard in torch's place (issue 45).

Each flow (tests/_fw_accelerate_flow.py) runs under ``torch.distributed.run`` with 2 CPU ranks
over gloo; tests/_cpu_shim_accelerate.py opens accelerate's FSDP path on CPU (test-only). The
flow calls ``flatshard.patch_torch_fsdp()`` before ``Accelerator(...)`` and builds the tiny
Llama with ``FullyShardedDataParallelPlugin(fsdp_version=1, auto_wrap_policy=
"transformer_based_wrap", ...)``, a unit per decoder layer. Checked for each variant:

1. sharded exactly once: the prepared model is flatshard's wrapper (root + one unit per decoder
   layer), no torch FSDP1 instance anywhere;
2. training (``accelerator.backward``, ``accelerator.clip_grad_norm_``, AdamW) equals one process
   training the combined batch with plain torch, the same clipping and the same AdamW;
3. ``accelerator.save_state`` writes accelerate's FSDP checkpoint;
4. ``load_state`` in a new process group, into a model built from another seed, then training on:
   losses and parameters bit-identical to the uninterrupted run;
5. the exports (``get_state_dict`` + ``save_pretrained``, and ``save_model``) read back in a
   process without torch.distributed give the trained parameters.

The default run: bf16 mixed precision with SHARDED_STATE_DICT on a model loaded in bf16 (so
accelerate's upcast block in ``prepare_model`` really upcasts: ``_has_params``, ``_flat_param``,
``_flat_param._fqns``, ``_handle._orig_param_dtype``), and a model wrapped with flatshard first,
with and without the patch. fp32 and bf16 with SHARDED and FULL state dicts, and bf16 FULL on a
bf16 model, run with FLATSHARD_FRAMEWORKS_ALL=1, and bf16 SHARDED with the plugin built from the environment as
``accelerate launch --use_fsdp --fsdp_version 1`` sets it, and fp32 SHARDED accumulating gradients
over two micro-batches (``accelerator.accumulate``: FSDP1's ``no_sync``), and use_orig_params=True
with ``prepare(model, optimizer)`` in one call (fp32 FULL; bf16 SHARDED on a bf16 model).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

pytest.importorskip("accelerate", reason="accelerate is not installed: the accelerate flows need the frameworks extra (pip install -e '.[frameworks]')")
pytest.importorskip("transformers", reason="transformers is not installed: the accelerate flows need the frameworks extra (pip install -e '.[frameworks]')")

ROOT = Path(__file__).resolve().parents[1]
FLOW = str(ROOT / "tests" / "_fw_accelerate_flow.py")
ALL = bool(os.environ.get("FLATSHARD_FRAMEWORKS_ALL"))
ALL_REASON = "the longer accelerate variants run with FLATSHARD_FRAMEWORKS_ALL=1 (the suite's time budget)"

DEFAULT_VARIANTS = ["bf16-SHARDED-bf16model"]
# (-env: the plugin built by Accelerator() from what `accelerate launch --use_fsdp --fsdp_version 1`
# puts in the environment; -accum: accelerator.accumulate over two micro-batches, FSDP1's no_sync;
# -together: use_orig_params=True and prepare(model, optimizer) in one call, the optimizer built
# before wrapping -- with a bf16 model, the upcast then rebinds what that optimizer holds)
ALL_VARIANTS = ["fp32-SHARDED", "fp32-FULL", "bf16-SHARDED", "bf16-FULL", "bf16-FULL-bf16model", "bf16-SHARDED-env",
                "fp32-SHARDED-accum", "fp32-FULL-together", "bf16-SHARDED-bf16model-together"]
STEPS, RESUME_AT = 4, 2  # as in the flow


def _env() -> Dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


def _launch(out: Path, names: List[str]) -> Dict[str, Any]:
    """One 2-rank launch running ``names`` in turn, then the export check in a plain process."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", FLOW, str(out), *names]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-12000:]
    results = json.loads((out / "results.json").read_text())
    exported = [n for n in names if not n.startswith("prewrapped")]
    if exported:
        done = subprocess.run([sys.executable, FLOW, "--export", str(out), *exported], cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=200)
        assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-12000:]
        results["export"] = json.loads((out / "export.json").read_text())
    return results


@pytest.fixture(scope="module")
def default_run():
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp), _launch(Path(tmp), DEFAULT_VARIANTS + ["prewrapped", "prewrapped_unpatched"])


@pytest.fixture(scope="module")
def all_run():
    if not ALL:
        pytest.skip(ALL_REASON)
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp), _launch(Path(tmp), ALL_VARIANTS)


VARIANTS = [pytest.param((name, "default_run"), id=name) for name in DEFAULT_VARIANTS] + [
    pytest.param((name, "all_run"), id=name, marks=pytest.mark.skipif(not ALL, reason=ALL_REASON)) for name in ALL_VARIANTS
]


# The variant tests reach the launches through request.getfixturevalue, which tests/conftest.py's
# classifier cannot follow: every test here starts processes (see [Note: test tiers]).
pytestmark = [pytest.mark.multirank, pytest.mark.subprocess]


@pytest.fixture
def variant(request):
    name, run = request.param
    out, results = request.getfixturevalue(run)
    return name, out / name, results[name], results["export"][name], results["export"]


def _load(path: Path) -> Dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def _tolerances(name: str) -> Dict[str, float]:
    # fp32: the same arithmetic up to the order of sums (the gradient over the two ranks, the
    # clipping norm over the shards); AdamW divides each gradient element by its own running
    # magnitude, so an element whose gradient is near AdamW's eps (1e-8) moves by a few 1e-6
    # from a last-bit difference (seen: 1.2e-6; 3.3e-6 accumulating over two micro-batches,
    # one more sum) -- 1/1000 of one step (lr = 1e-2) is allowed.
    # bf16: the reference repeats in one process what the plugin's MixedPrecision(bf16, bf16,
    # bf16) does (bf16 copies of the fp32 parameters and buffers under CPU autocast, each half of
    # the batch's bf16 gradient halved and summed in bf16), so it agrees closely too (seen:
    # 1.2e-7); the looser bound leaves room for a last-bit fp32 difference that lands a bf16
    # copy of a parameter or a bf16 gradient element on the other side of a rounding step (0.4%
    # of it), which AdamW turns into up to ~lr * 0.4% = 4e-5 of a parameter: 1/100 of one step.
    return dict(rtol=1e-5, atol=1e-5) if name.startswith("fp32") else dict(rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS, indirect=True)
def test_sharded_exactly_once_by_flatshard(variant):
    name, _, result, _, _ = variant
    assert result["is_fsdp"] == "DistributedType.FSDP"
    assert result["plugin"] == {"fsdp_version": 1, "state_dict_type": name.split("-")[1] + "_STATE_DICT"}
    assert result["wrapping"] == {
        "root_is_flatshard": True,
        "units": ["", "_fsdp_wrapped_module.model.layers.0", "_fsdp_wrapped_module.model.layers.1"],
        "torch_fsdp1": [],
    }
    assert result["unwrapped_is_plain"]  # accelerator.unwrap_model reaches the LlamaForCausalLM
    assert result["patched_names"][:2] == ["torch.distributed.fsdp.FullyShardedDataParallel",
                                           "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel"]


@pytest.mark.parametrize("variant", VARIANTS, indirect=True)
def test_training_matches_one_process_on_the_combined_batch(variant):
    name, root, result, _, _ = variant
    tol = _tolerances(name)
    for kind in ("losses", "norms"):  # (norms: accelerator.clip_grad_norm_, FSDP1's root clip_grad_norm_)
        torch.testing.assert_close(torch.tensor(result[kind], dtype=torch.float64),
                                   torch.tensor(result["reference_" + kind], dtype=torch.float64), rtol=tol["rtol"], atol=0.0)
    assert min(result["norms"]) > 1.0  # (the clipping clipped)
    # accumulating, every step's first micro-batch ran under the root's no_sync (the flow counts
    # the first run, all STEPS steps)
    assert result["no_sync_calls"] == ([STEPS] if name.endswith("-accum") else [0])
    full, reference = _load(root / "full.pt"), _load(root / "reference.pt")
    assert sorted(full) == sorted(reference)
    for key in reference:
        assert full[key].dtype == torch.float32, key  # (bf16: the plugin keeps fp32 parameters)
        torch.testing.assert_close(full[key], reference[key], **tol, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("variant", VARIANTS, indirect=True)
def test_save_state_writes_accelerates_fsdp_checkpoint(variant):
    name, root, _, _, _ = variant
    files = sorted(str(p.relative_to(root / "ckpt")) for p in (root / "ckpt").rglob("*") if p.is_file())
    if "-SHARDED" in name:  # torch.distributed.checkpoint, a file per rank, for the model and the optimizer
        assert files == ["optimizer_0/.metadata", "optimizer_0/__0_0.distcp", "optimizer_0/__1_0.distcp",
                         "pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp",
                         "pytorch_model_fsdp_0/__1_0.distcp", "random_states_0.pkl", "random_states_1.pkl"], files
    else:  # full state dicts, written by rank 0
        assert files == ["optimizer.bin", "pytorch_model_fsdp.bin", "random_states_0.pkl", "random_states_1.pkl"], files
        saved = torch.load(root / "ckpt" / "pytorch_model_fsdp.bin", weights_only=True)
        assert sorted(saved) == sorted(_load(root / "full.pt"))


@pytest.mark.parametrize("variant", VARIANTS, indirect=True)
def test_load_state_in_a_new_process_group_resumes_bit_identically(variant):
    _, root, result, _, _ = variant
    assert result["resumed_losses"] == result["losses"][RESUME_AT:]
    assert result["resumed_norms"] == result["norms"][RESUME_AT:]
    full, resumed = _load(root / "full.pt"), _load(root / "resumed.pt")
    assert sorted(full) == sorted(resumed)
    different = [k for k in full if not torch.equal(full[k], resumed[k])]
    assert not different, different


@pytest.mark.parametrize("variant", VARIANTS, indirect=True)
def test_exports_load_without_a_process_group(variant):
    _, _, _, exported, everything = variant
    assert everything["distributed_initialized"] is False
    assert exported == {"pretrained_equal": True, "save_model_equal": True, "pretrained_dtype": "torch.float32"}


@pytest.mark.skipif(not ALL, reason=ALL_REASON)
def test_bf16_model_is_upcast_with_orig_params_too(all_run):
    _, results = all_run
    for name in ("bf16-FULL-bf16model", "bf16-SHARDED-bf16model-together"):
        result = results[name]
        assert len(result["upcast_warnings"]) == 2, name
        assert result["flat_param_dtypes"] == result["orig_param_dtypes"] == ["torch.float32"], name


def test_bf16_model_is_upcast_through_fsdp1s_surface(default_run):
    """accelerate's upcast block read _has_params, _flat_param, _flat_param._fqns and wrote
    _handle._orig_param_dtype: it warned naming each unit's parameters, and the FlatParameters
    and their handles are fp32 afterwards (training parity above shows the cast was adopted)."""
    _, results = default_run
    result = results["bf16-SHARDED-bf16model"]
    layer = ("Upcasted low precision parameters in LlamaDecoderLayer because mixed precision turned on in FSDP. Affects: "
             "self_attn.q_proj.weight, self_attn.k_proj.weight, self_attn.v_proj.weight, self_attn.o_proj.weight, "
             "mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, input_layernorm.weight, post_attention_layernorm.weight.")
    root = ("Upcasted low precision parameters in LlamaForCausalLM because mixed precision turned on in FSDP. Affects: "
            "model.embed_tokens.weight, model.norm.weight, lm_head.weight.")
    assert sorted(result["upcast_warnings"]) == sorted([root, layer])
    assert result["flat_param_dtypes"] == ["torch.float32"]
    assert result["orig_param_dtypes"] == ["torch.float32"]


@pytest.mark.skipif(not ALL, reason=ALL_REASON)
def test_fp32_model_under_bf16_is_not_upcast(all_run):
    _, results = all_run
    for name in ("bf16-SHARDED", "bf16-FULL", "bf16-SHARDED-env"):
        assert results[name]["upcast_warnings"] == [], name
        assert results[name]["orig_param_dtypes"] == ["torch.float32"], name


def test_model_wrapped_with_flatshard_first_is_not_wrapped_again(default_run):
    out, results = default_run
    result = results["prewrapped"]
    assert result["same_object"]  # accelerate saw a FullyShardedDataParallel and kept it
    assert result["wrapping"]["torch_fsdp1"] == []
    assert result["wrapping"]["units"] == ["", "_fsdp_wrapped_module.model.layers.0", "_fsdp_wrapped_module.model.layers.1"]
    for kind in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(result[kind], dtype=torch.float64),
                                   torch.tensor(result["reference_" + kind], dtype=torch.float64), rtol=1e-5, atol=0.0)
    full, reference = _load(out / "prewrapped" / "full.pt"), _load(out / "prewrapped" / "reference.pt")
    assert sorted(full) == sorted(reference)
    for key in reference:
        torch.testing.assert_close(full[key], reference[key], **_tolerances("fp32"))


def test_model_wrapped_with_flatshard_first_without_the_patch_is_refused(default_run):
    _, results = default_run
    result = results["prewrapped_unpatched"]
    assert result == {
        "error_type": "RewrapError",
        "error": "torch's FullyShardedDataParallel is wrapping a model that holds a flatshard ShardedDataParallel: a model "
                 "must not be sharded twice. Call flatshard.patch_torch_fsdp() before the framework runs (it makes torch's "
                 "FullyShardedDataParallel flatshard's), or pass the framework the unwrapped model",
    }
