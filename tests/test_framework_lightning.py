"""Lightning's FSDP with flatshard: ``FSDPStrategy`` (and Fabric's) build flatshard's wrapper after
``flatshard.patch_torch_fsdp()``, on 2 CPU ranks over gloo (issue 45).

Each flow runs in tests/_fw_lightning.py, one process per rank (Lightning's own environment:
RANK/LOCAL_RANK/WORLD_SIZE set, so it starts no processes itself); rank 0 writes the results and
this file judges them against one process training the same model on the combined batch
(tests/_fw_lightning_model.py). Checked for each ``FSDPStrategy`` variant:
1. the model is sharded once: Lightning's model is flatshard's wrapper, no torch FSDP1 anywhere,
   a unit per ``Block`` (the ``auto_wrap_policy``) and the root;
2. losses and final parameters equal one process's (fp32: rtol 1e-5, atol 1e-6);
3. ``trainer.save_checkpoint`` saves ("full": a file; "sharded": a folder);
4. ``trainer.fit(ckpt_path=...)`` in a new process group resumes bit-identically
   (``torch.equal`` on every rank's losses and on the final parameters);
5. the final checkpoint loads into a plain model in a process without torch.distributed.
Also: a model the user wrapped with flatshard first trains under the patch and is refused
without it (``RewrapError`` naming ``patch_torch_fsdp()``).

The full-checkpoint flows need flatshard to take Lightning's lazily loaded tensors
(``_NotYetLoadedTensor``) in ``load_state_dict``, as torch does (``LoadSink.materialized``), and
``rekey_optim_state_dict`` with a wrapped model.

The default run covers "full" with ``use_orig_params=True`` (Lightning's default), "sharded" with
``use_orig_params=False``, and the model wrapped first; ``FLATSHARD_FRAMEWORKS_ALL=1`` adds the
other two combinations, "full" with ``precision="bf16-mixed"``, torch's ``wrap()`` in ``configure_model``, Fabric's ``FSDPStrategy``
("full" and "sharded") and the sharded exports through Lightning's consolidation command line.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import torch

pytest.importorskip("lightning", reason="Lightning is not installed: these flows need the frameworks extra (pip install -e '.[frameworks]')")

from tests._fw_lightning_model import STEPS_PER_EPOCH, reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FLOW = str(ROOT / "tests" / "_fw_lightning.py")
ALL = os.environ.get("FLATSHARD_FRAMEWORKS_ALL") == "1"
ALL_REASON = "a longer Lightning variant: run with FLATSHARD_FRAMEWORKS_ALL=1"
EPOCHS, RESUME_AFTER = 2, 1
STEPS = EPOCHS * STEPS_PER_EPOCH

STRATEGY_DEFAULT = ["full-orig", "sharded-flat"]
STRATEGY_ALL = ["full-flat", "sharded-orig", "full-orig-bf16"]
FABRIC = ["fabric-full", "fabric-sharded"]
PREWRAPPED = ["prewrapped-patched", "prewrapped-unpatched"]
WRAP_API = ["wrapapi-full"]


def _free_ports(count: int) -> List[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _env(**extra: str) -> Dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1", **extra)


def _launch(workdir: Path, variants: List[str]) -> None:
    """The flows of ``variants`` on 2 ranks; each rank's output in workdir/rank<r>.log."""
    ports = ",".join(map(str, _free_ports(3 * len(variants))))  # a process group per run
    procs, logs = [], []
    for rank in range(2):
        log = open(workdir / f"rank{rank}.log", "w")
        logs.append(log)
        env = _env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
        cmd = [sys.executable, FLOW, "flows", "--workdir", str(workdir), "--variants", ",".join(variants), "--ports", ports,
               "--epochs", str(EPOCHS), "--resume-after", str(RESUME_AFTER)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    if codes != [0, 0]:
        text = "\n".join(f"--- rank {r} ---\n" + (workdir / f"rank{r}.log").read_text()[-6000:] for r in range(2))
        raise AssertionError(f"the Lightning flows exited with {codes}:\n{text}")


def _export(workdir: Path, variants: List[str], cli: bool) -> None:
    cmd = [sys.executable, FLOW, "export", "--workdir", str(workdir), "--variants", ",".join(variants)] + (["--cli"] if cli else [])
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def _run(variants: List[str], exported: List[str], cli: bool) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="flatshard-lightning-") as tmp:
        workdir = Path(tmp)
        _launch(workdir, variants)
        _export(workdir, exported, cli)
        yield workdir


@pytest.fixture(scope="module")
def default_flows() -> Iterator[Path]:
    yield from _run(STRATEGY_DEFAULT + PREWRAPPED, STRATEGY_DEFAULT + PREWRAPPED[:1], cli=False)


@pytest.fixture(scope="module")
def all_flows() -> Iterator[Path]:
    if not ALL:
        pytest.skip(ALL_REASON)
    yield from _run(STRATEGY_ALL + WRAP_API + FABRIC, STRATEGY_ALL + WRAP_API + FABRIC, cli=True)


@pytest.fixture(scope="module")
def truth() -> Any:
    return reference(STEPS)


def _result(workdir: Path, variant: str, name: str = "result.pt") -> Dict[str, Any]:
    return torch.load(workdir / variant / name, weights_only=False)


# bf16 keeps 8 significant bits (relative steps of 2**-8 = 0.4%): the forward, backward and the
# gradients' reduction run in bf16 against the fp32 truth, and 4 AdamW steps of up to lr = 1e-2
# each move the weights by a few of those steps
FP32 = dict(rtol=1e-5, atol=1e-6)
BF16 = dict(rtol=2e-2, atol=4e-2)


def _check_trains_like_one_process(result: Dict[str, Any], truth: Any, tolerance: Dict[str, float] = FP32) -> None:
    ref_losses, ref_params = truth
    losses = result["straight_losses"]  # [rank, step]: each rank's loss on its half of the batch
    assert losses.shape == (2, STEPS)
    torch.testing.assert_close(losses.float().mean(0), torch.tensor(ref_losses), **tolerance)  # (bf16: bf16 losses)
    params = result["straight_params"]
    assert sorted(params) == sorted(f"net.{k}" for k in ref_params)
    for name, value in ref_params.items():
        assert params[f"net.{name}"].dtype == torch.float32, name  # (bf16 computes; the parameters stay fp32)
        torch.testing.assert_close(params[f"net.{name}"], value, **tolerance, msg=name)


WRAPPED_BY_LIGHTNING = {
    "root": "ShardedDataParallel", "root_is_flatshard": True, "torch_fsdp1_instances": 0, "units": ["FlowModule", "Block", "Block"],
}


def _check_strategy_flow(workdir: Path, variant: str, truth: Any, sharding: Dict[str, Any] = WRAPPED_BY_LIGHTNING) -> None:
    result = _result(workdir, variant)
    state_dict_type, kind, *bf16 = ("full", "orig") if variant in ("prewrapped-patched", "wrapapi-full") else variant.split("-")
    # 1. sharded once, by flatshard, a unit per Block
    assert result["sharding"] == sharding
    if kind == "flat":  # Lightning's check that the optimizer holds FSDP's flat parameters
        assert result["optimizer_holds_flat_params"] is True
    # 2. like one process on the combined batch
    _check_trains_like_one_process(result, truth, BF16 if bf16 else FP32)
    # 3. the checkpoint, in Lightning's form for the state-dict type
    final = Path(result["checkpoint"])
    if state_dict_type == "full":
        assert final.is_file()
    else:
        assert final.is_dir() and (final / "meta.pt").is_file() and (final / ".metadata").is_file()
    # 4. resumed in a new process group: bit-identical
    assert result["resumed_global_step"] == STEPS
    assert torch.equal(torch.cat([result["part_losses"], result["resumed_losses"]], dim=1), result["straight_losses"])
    assert sorted(result["resumed_params"]) == sorted(result["straight_params"])
    for name, value in result["straight_params"].items():
        assert torch.equal(result["resumed_params"][name], value), name
    # 5. the export, without a process group
    exported = _result(workdir, variant, "export.pt")
    assert exported["distributed_initialized"] is False
    assert sorted(exported["params"]) == sorted(result["straight_params"])
    for name, value in result["straight_params"].items():
        assert torch.equal(exported["params"][name], value), name
    if state_dict_type == "full":  # the optimizer state, keyed by ID, loads into a plain optimizer (either kind)
        assert exported["plain_optimizer_exp_avg_shapes"] == [tuple(v.shape) for v in truth[1].values()]
        assert exported["plain_optimizer_steps"] == [float(STEPS)] * len(truth[1])


@pytest.mark.parametrize("variant", STRATEGY_DEFAULT)
def test_fsdp_strategy_trains_checkpoints_and_resumes_like_one_process(default_flows: Path, truth: Any, variant: str) -> None:
    _check_strategy_flow(default_flows, variant, truth)


@pytest.mark.parametrize("variant", STRATEGY_ALL)
def test_fsdp_strategy_other_variants(all_flows: Path, truth: Any, variant: str) -> None:
    _check_strategy_flow(all_flows, variant, truth)


@pytest.mark.parametrize("variant", FABRIC)
def test_fabric_fsdp_strategy_saves_loads_and_resumes_like_one_process(all_flows: Path, truth: Any, variant: str) -> None:
    result = _result(all_flows, variant)
    assert result["fabric_root"] == "_FabricModule"  # Fabric's own wrapper, around flatshard's
    assert result["sharding"] == {
        "root": "ShardedDataParallel", "root_is_flatshard": True, "torch_fsdp1_instances": 0,
        "units": ["Net", "Block", "Block"],
    }
    _check_trains_like_one_process(result, truth)
    assert torch.equal(torch.cat([result["part_losses"], result["resumed_losses"]], dim=1), result["straight_losses"])
    exported = _result(all_flows, variant, "export.pt")
    assert exported["distributed_initialized"] is False
    for name, value in result["straight_params"].items():
        assert torch.equal(result["resumed_params"][name], value), name
        assert torch.equal(exported["params"][name], value), name


def test_model_wrapped_with_flatshard_first_is_recognised_under_the_patch(default_flows: Path, truth: Any) -> None:
    """Wrapped by the user in ``configure_model``; "full", use_orig_params: all five checks."""
    # Lightning saw the flatshard wrapper inside (isinstance against the patched name) and did
    # not wrap the LightningModule again: its model is the LightningModule, holding the user's wrapper
    wrapped_by_user = {"root": "FlowModule", "root_is_flatshard": False, "torch_fsdp1_instances": 0, "units": ["Net", "Block", "Block"]}
    _check_strategy_flow(default_flows, "prewrapped-patched", truth, sharding=wrapped_by_user)


def test_torch_wrap_in_configure_model_builds_flatshard_units(all_flows: Path, truth: Any) -> None:
    """Lightning's manual wrapping: ``torch.distributed.fsdp.wrap.wrap`` in ``configure_model``,
    inside the strategy's ``enable_wrap(wrapper_cls=FullyShardedDataParallel, ...)``, builds
    flatshard's wrapper (with the strategy's ``auto_wrap_policy``); all five checks."""
    wrapped_in_configure_model = {"root": "FlowModule", "root_is_flatshard": False, "torch_fsdp1_instances": 0, "units": ["Net", "Block", "Block"]}
    _check_strategy_flow(all_flows, "wrapapi-full", truth, sharding=wrapped_in_configure_model)


def test_model_wrapped_with_flatshard_first_is_refused_without_the_patch(default_flows: Path) -> None:
    result = _result(default_flows, "prewrapped-unpatched")
    assert result["error_type"] == "flatshard._base._fsdp_markers.RewrapError"
    assert "patch_torch_fsdp()" in result["error"]
    assert "must not be sharded twice" in result["error"]
    assert result["trained_steps"] == 0


def test_a_lazily_loaded_full_checkpoint_loads_into_the_sharded_model(rank_pool: Any, tmp_path: Path) -> None:
    """Lightning's full-checkpoint resume (pytorch/strategies/fsdp.py:632, ``_load_raw_module_state``
    with ``_lazy_load``'s values): flatshard takes tensor-likes that are no ``torch.Tensor``, as
    ``nn.Module.load_state_dict`` does (it raised "'_NotYetLoadedTensor' object has no attribute
    'detach'"). With use_orig_params True and False."""
    from tests._fw_lightning_lazy import load_lazily_loaded_full_state_dict
    from tests._fw_lightning_model import build_net

    path = tmp_path / "full.pt"
    torch.save({name: value + 1.0 for name, value in build_net().state_dict().items()}, path)  # not the initial values
    for per_rank in rank_pool.run(load_lazily_loaded_full_state_dict, 2, str(path)):
        wrong = per_rank.pop("wrong shape")
        assert wrong == (
            "RuntimeError: Error(s) in loading state_dict for Net:\n\tsize mismatch for embed.weight: copying a param with "
            "shape torch.Size([1, 8]) from checkpoint, the shape in current model is torch.Size([16, 8])."
        ), wrong
        assert sorted(per_rank) == [False, True]
        for kind, exact in per_rank.values():
            assert kind == "_NotYetLoadedTensor"
            assert len(exact) == len(build_net().state_dict()) and all(exact.values()), exact
