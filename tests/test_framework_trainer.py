"""Hugging Face ``transformers.Trainer`` with FSDP version 1 trains, checkpoints and resumes with
flatshard after ``flatshard.patch_torch_fsdp()`` (issue 45).

The flows run in tests/_fw_trainer_flow.py, 2 CPU ranks over gloo under torchrun, with the
Trainer's FSDP1 recipe: ``fsdp="full_shard auto_wrap"``, ``fsdp_config={"version": 1,
"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}``. accelerate turns FSDP on only on
accelerator devices; tests/_cpu_shim_trainer.py (test-only) opens that path on CPU.

The checks: the model is sharded exactly once (flatshard's wrapper, no torch FSDP1, one unit per
decoder layer); training equals a single process on the combined batch; the Trainer's checkpoint
saves; ``trainer.train(resume_from_checkpoint=...)`` in new processes and a new process group is
bit-identical to the uninterrupted run; ``save_model`` + ``AutoModelForCausalLM.from_pretrained``
in a process without a process group gives the trained parameters; ``remove_unused_columns``
keeps the model's columns; a model wrapped with flatshard first is recognised after the patch and
refused loudly (RewrapError naming patch_torch_fsdp()) without it; gradient accumulation goes
through the root's ``no_sync()`` and equals one process.

fp32 (with the Trainer's default FULL_STATE_DICT checkpoints) runs by default. With
FLATSHARD_FRAMEWORKS_ALL=1 also: bf16 (``bf16=True`` with a bfloat16 model, which accelerate
upcasts through FSDP1's private attributes), and fp32 with ``fsdp_config["state_dict_type"] =
"SHARDED_STATE_DICT"`` (torch.distributed.checkpoint shards; ``save_model`` writes no weights then,
so it has no export check).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the Trainer flows need transformers (pip install flatshard[frameworks])")
pytest.importorskip("accelerate", reason="the Trainer's FSDP needs accelerate (pip install flatshard[frameworks])")
pytest.importorskip("safetensors", reason="the export check reads safetensors (installed with transformers)")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FLOW = str(ROOT / "tests" / "_fw_trainer_flow.py")
ALL = os.environ.get("FLATSHARD_FRAMEWORKS_ALL") == "1"
VARIANTS = ["fp32", "bf16", "fp32-sharded"] if ALL else ["fp32"]
NEEDS_ALL = "the bf16 and SHARDED_STATE_DICT Trainer flows are long; run them with FLATSHARD_FRAMEWORKS_ALL=1"
STEPS, SAVE_EVERY = 4, 2  # as in _fw_trainer_flow
UNITS = ["<root>", "model.layers.0", "model.layers.1"]
MODEL_COLUMNS = ["attention_mask", "input_ids", "labels"]


def _launch(args, two_ranks=True):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if two_ranks else [sys.executable]
    done = subprocess.run(launcher + [FLOW, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{args}:\n{done.stdout[-6000:]}\n{done.stderr[-12000:]}"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Runs every flow once: per variant the uninterrupted run (with checkpoints) and the resume
    in new processes, then the check without a process group."""
    work = tmp_path_factory.mktemp("trainer_flows")
    for variant in VARIANTS:
        _launch(["full", str(work), variant])
        _launch(["resume", str(work), variant])
    _launch(["check", str(work), ",".join(VARIANTS)], two_ranks=False)
    return work


def _json(work, name):
    return json.loads((work / name).read_text())


def _ranks(work, phase, precision):
    return [_json(work, f"{phase}_{precision}_rank{rank}.json") for rank in range(2)]


def _params(work, name):
    return torch.load(work / f"params_{name}.pt")


_long = pytest.mark.skipif(not ALL, reason=NEEDS_ALL)
precisions = pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=_long)])
variants = pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=_long), pytest.param("fp32-sharded", marks=_long)])


@variants
def test_the_trainer_shards_with_flatshard_exactly_once(work, precision):
    for run in _ranks(work, "full", precision) + _ranks(work, "resume", precision):
        assert run["wrapper_type"] == "flatshard.sharded_data_parallel.ShardedDataParallel"
        assert run["trainer_model_is_wrapper"] is True
        assert run["torch_fsdp1_modules"] == 0
        assert run["units"] == UNITS  # the root and one unit per LlamaDecoderLayer
    replaced = _ranks(work, "full", precision)[0]["replaced"]
    assert "torch.distributed.fsdp.FullyShardedDataParallel" in replaced
    assert "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel" in replaced


@variants
def test_training_equals_one_process_on_the_combined_batch(work, precision):
    """Each rank's Trainer loss is its tokens' share of the global mean (Trainer scales by the
    token count over both ranks), so the ranks' mean is the combined batch's loss. bf16 is looser:
    the forward and the gradient reduction run in bfloat16 (FSDP's MixedPrecision from
    accelerate), the reference in float32, and Adam's first steps (about lr * sign(g) per
    element) turn the bfloat16 rounding of small gradients into whole-step differences."""
    like = "fp32" if precision == "fp32-sharded" else precision  # (the same training; only checkpoints differ)
    reference = _json(work, "check.json")[f"reference_losses_{like}"]
    runs = _ranks(work, "full", precision)
    losses = [(a + b) / 2 for a, b in zip(runs[0]["losses"], runs[1]["losses"])]
    assert len(losses) == STEPS
    trained = _params(work, f"full_{precision}")
    expected, initial = (_params(work, f"{kind}_{like}") for kind in ("reference", "initial"))
    assert set(trained) == set(expected)
    if like == "fp32":
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=1e-6)
        for name in expected:
            torch.testing.assert_close(trained[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    else:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=2e-3, atol=0)
        off = sum((trained[n] - expected[n]).norm() ** 2 for n in expected) ** 0.5
        moved = sum((expected[n] - initial[n]).norm() ** 2 for n in expected) ** 0.5
        assert off / moved < 0.2, f"bf16 training moved the parameters {off / moved:.3f} of the way off the reference"


@variants
def test_the_trainer_checkpoint_saves(work, precision):
    run = _ranks(work, "full", precision)[0]
    assert run["checkpoints"] == [f"checkpoint-{SAVE_EVERY}", f"checkpoint-{STEPS}"]
    checkpoint = work / f"run_{precision}" / f"checkpoint-{SAVE_EVERY}"
    for name in ("scheduler.pt", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"):
        assert (checkpoint / name).is_file(), name
    if precision == "fp32-sharded":  # torch.distributed.checkpoint directories, written by both ranks
        for name in ("pytorch_model_fsdp_0", "optimizer_0"):
            assert (checkpoint / name / ".metadata").is_file(), name
            assert len(list((checkpoint / name).glob("*.distcp"))) == 2, name
    else:  # full state dicts, written by rank 0
        for name in ("pytorch_model_fsdp.bin", "optimizer.bin"):
            assert (checkpoint / name).is_file(), name


@variants
def test_resume_from_checkpoint_in_new_processes_is_bit_identical(work, precision):
    for full, resumed in zip(_ranks(work, "full", precision), _ranks(work, "resume", precision)):
        assert resumed["global_step"] == STEPS
        assert resumed["losses"] == full["losses"][SAVE_EVERY:]  # exact floats
    uninterrupted, resumed = _params(work, f"full_{precision}"), _params(work, f"resumed_{precision}")
    assert set(uninterrupted) == set(resumed)
    differ = [name for name in uninterrupted if not torch.equal(uninterrupted[name], resumed[name])]
    assert not differ, differ


@precisions
def test_save_model_loads_with_from_pretrained_without_a_process_group(work, precision):
    check = _json(work, "check.json")
    assert check["process_group"] is False and check["process_group_after"] is False
    export = check[f"export_{precision}"]
    assert export["names_match"] is True
    assert export["differ"] == []
    assert len(export["equal"]) == len(_params(work, f"full_{precision}"))
    assert export["stored_dtypes"] == ["F32"]  # the float32 master weights, bf16 included (upcast)


def test_remove_unused_columns_keeps_the_models_columns(work):
    """``remove_unused_columns=True`` (the default) keeps the columns ``model.forward`` names. With
    a model the user wrapped first, the Trainer reads the wrapper's signature, which is the
    wrapped module's; the dataset's extra column is dropped."""
    for run in _ranks(work, "full", "fp32"):
        assert run["columns"] and all(seen == MODEL_COLUMNS + ["num_items_in_batch"] for seen in run["columns"])
    for run in _ranks(work, "resume", "fp32"):
        first = run["patched"]
        assert "error" not in first, first["error"]
        assert first["signature"][:2] == ["input_ids", "attention_mask"] and "labels" in first["signature"]
        assert len(first["columns"]) == STEPS
        assert all(seen == MODEL_COLUMNS + ["num_items_in_batch"] for seen in first["columns"])


@precisions
def test_fsdp1_private_attributes_of_the_trainers_model(work, precision):
    """FSDP1's private attributes on the Trainer's model have FSDP1's meaning: ``fsdp_modules``,
    ``_has_params``, ``_flat_param`` and its ``_fqns`` (names relative to the unit's module),
    ``_handle._orig_param_dtype``. In bf16 the model was bfloat16 and accelerate's
    prepare_model (mixed precision) read these, cast each FlatParameter's data to float32 and
    wrote ``_handle._orig_param_dtype``: the flat parameters train in float32."""
    for run in _ranks(work, "full", precision):
        assert run["flat_param_dtypes"] == ["torch.float32"]
        assert run["orig_param_dtypes"] == ["torch.float32"]
        layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                 "post_attention_layernorm.weight"]
        assert run["fqns"] == [["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"], layer, layer]


def test_a_model_wrapped_first_is_recognised_after_the_patch(work):
    full = _ranks(work, "full", "fp32")
    for rank, run in enumerate(_ranks(work, "resume", "fp32")):
        first = run["patched"]
        assert "error" not in first, first["error"]
        assert first["same_wrapper"] is True  # the Trainer kept the user's wrapper, did not wrap again
        assert first["torch_fsdp1_modules"] == 0
        assert first["units"] == UNITS
        assert first["losses"] == full[rank]["losses"]  # the same training as the Trainer's own wrap
    wrapped_first, trainer_wrapped = _params(work, "wrapped_first_fp32"), _params(work, "full_fp32")
    assert all(torch.equal(wrapped_first[n], trainer_wrapped[n]) for n in trainer_wrapped)


def test_gradient_accumulation_uses_no_sync_and_equals_one_process(work):
    """``gradient_accumulation_steps=2``: accelerate enters the root's ``no_sync()`` for the first
    micro-batch of each step; a step equals one single-process step on all 8 samples."""
    runs = [run["accumulation"] for run in _ranks(work, "resume", "fp32")]
    steps = STEPS // 2
    for run in runs:
        assert run["no_sync_calls"] == steps
        assert len(run["losses"]) == STEPS  # one per micro-batch
    # Each micro-batch loss is its tokens' share of the step's mean over both ranks and micro-batches.
    losses = [sum(run["losses"][2 * step] + run["losses"][2 * step + 1] for run in runs) / 2 for step in range(steps)]
    reference = _json(work, "check.json")["reference_losses_accumulation_fp32"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=1e-6)
    trained, expected = _params(work, "accumulation_fp32"), _params(work, "reference_accumulation_fp32")
    assert set(trained) == set(expected)
    for name in expected:
        torch.testing.assert_close(trained[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_model_wrapped_first_without_the_patch_is_refused_loudly(work):
    for run in _ranks(work, "resume", "fp32"):
        refused = run["unpatched"]
        assert refused["error_type"] == "RewrapError"
        assert "ValueError" in refused["mro"]
        assert "flatshard.patch_torch_fsdp()" in refused["error"]
        assert "must not be sharded twice" in refused["error"]
        assert "was removed from its module" not in refused["error"]
