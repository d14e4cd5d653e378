"""Lightning's FSDP flows with flatshard, one rank of two (run by tests/test_framework_lightning.py).

Usage (one process per rank; the test starts both):
    RANK=r LOCAL_RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \\
        python tests/_fw_lightning.py flows --workdir DIR --ports P1,P2,... --variants V1,V2,...
    python tests/_fw_lightning.py export --workdir DIR --variants V1,V2,...   (one process, no process group)

``flows`` runs each variant on this rank and rank 0 writes ``DIR/<variant>/result.pt``:
- ``full-orig``, ``full-flat``, ``sharded-orig``, ``sharded-flat``: ``FSDPStrategy`` with
  ``state_dict_type`` "full"/"sharded" and ``use_orig_params`` True/False, auto-wrapping each
  ``Block``. Three runs, each in a process group of its own (the previous one destroyed, the
  next one on a new port, everything built anew): ``--epochs`` epochs straight;
  ``--resume-after`` epochs and ``trainer.save_checkpoint``; ``trainer.fit(ckpt_path=...)`` on
  to ``--epochs`` and a final ``trainer.save_checkpoint`` (the export).
- ``full-orig-bf16``: "full-orig" with ``precision="bf16-mixed"``.
- ``prewrapped-patched``: the user wraps the model with flatshard in ``configure_model``;
  Lightning must see it as wrapped and not wrap it again; then as "full-orig".
- ``wrapapi-full``: as ``prewrapped-patched``, wrapped with torch's ``wrap()`` in
  ``configure_model`` (Lightning's manual wrapping: the strategy's ``enable_wrap``).
- ``prewrapped-unpatched``: the ``prewrapped-patched`` model without ``patch_torch_fsdp()``: Lightning wraps again in
  torch's FSDP1 (let onto CPU by the test shim), which must raise flatshard's ``RewrapError``;
  its type and text are recorded.
- ``fabric-full``, ``fabric-sharded``: Fabric's ``FSDPStrategy`` (state_dict_type
  "full"/"sharded"), the same three runs with ``fabric.save`` and ``fabric.load``.

``export`` loads each variant's final checkpoint without torch.distributed: a "full" file with
``torch.load``; a "sharded" folder through Lightning's consolidation (with ``--cli`` its command
line, ``python -m lightning.pytorch.utilities.consolidate_checkpoint``, else the functions that
command runs), into a plain ``FlowModule``, and writes ``DIR/<variant>/export.pt`` (the plain
model's parameters; for the "full" checkpoints with use_orig_params also the checkpoint's
optimizer state loaded into a plain AdamW).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed.fsdp.fully_sharded_data_parallel as _torch_fsdp1  # noqa: E402

try:
    import lightning as L
    from lightning.fabric.utilities.load import _load_distributed_checkpoint
    from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint
except ImportError as error:
    raise SystemExit("Lightning is not installed: the Lightning flows need the frameworks extra (pip install -e '.[frameworks]')") from error

import flatshard  # noqa: E402
from flatshard import ShardedDataParallel  # noqa: E402
from tests._cpu_shim_lightning import CPUFabricFSDPStrategy, CPUFSDPStrategy, torch_fsdp1_on_cpu  # noqa: E402
from tests._fw_lightning_model import (  # noqa: E402
    LOCAL_BATCH,
    STEPS_PER_EPOCH,
    Block,
    build_net,
    make_optimizer,
    rank_rows,
)

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*FSDP.*is deprecated.*")

# torch's own class, kept where patch_torch_fsdp() does not look (it rebinds module-level names
# that hold torch's class), to count the torch FSDP1 instances left in a trained model
TORCH_FSDP1 = {"class": _torch_fsdp1.FullyShardedDataParallel}


class FlowModule(L.LightningModule):
    """``Net`` as a LightningModule: MSE loss, AdamW with a per-step LambdaLR; records each
    step's loss on this rank."""

    def __init__(self, use_orig_params: bool = True, prewrap: str = "") -> None:
        super().__init__()
        self.net = build_net()
        self.use_orig_params = use_orig_params
        self.prewrap = prewrap
        self.losses: List[torch.Tensor] = []

    def configure_model(self) -> None:
        if isinstance(self.net, ShardedDataParallel):
            return
        if self.prewrap == "flatshard":  # the README's migration: the user wraps with flatshard
            self.net = flatshard.FullyShardedDataParallel(
                self.net, auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}), use_orig_params=True
            )
        elif self.prewrap == "wrap":
            # Lightning's manual wrapping: torch's wrap() inside the strategy's enable_wrap
            # (wrapper_cls=torch.distributed.fsdp...FullyShardedDataParallel, the strategy's kwargs)
            from torch.distributed.fsdp.wrap import wrap

            self.net = wrap(self.net)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> Any:
        # use_orig_params=False: the optimizer must hold the FlatParameters (Lightning's rule)
        params = self.parameters() if self.use_orig_params else self.trainer.model.parameters()
        optimizer, scheduler = make_optimizer(params)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def loader(rank: int) -> torch.utils.data.DataLoader:
    x, y = rank_rows(rank)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=LOCAL_BATCH, shuffle=False)


class Ports:
    """A new rendezvous port for each process group (both ranks take them in the same order)."""

    def __init__(self, ports: List[int]) -> None:
        self._ports = list(ports)

    def next_group(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ["MASTER_PORT"] = str(self._ports.pop(0))


def trainer_for(max_epochs: int, precision: str = "32-true", **strategy: Any) -> L.Trainer:
    # [Note: epochs, not max_steps] Training runs whole epochs and the checkpoint is taken at an
    # epoch's end, as Lightning advises for loaders without state. With ``max_steps`` Lightning
    # treats every resume as mid-epoch (fit_loop.py, the ``restarting`` setter: "or
    # self._iteration_based_training()"): resumed after a finished epoch it keeps that epoch's
    # batch count, so the next epoch ends after one batch and training sees other data than the
    # uninterrupted run (Lightning's behaviour, with any FSDP or none).
    return L.Trainer(
        accelerator="cpu", devices=2, num_nodes=1, strategy=CPUFSDPStrategy(**strategy), max_epochs=max_epochs,
        precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0,
    )


def sharding_facts(model: nn.Module) -> Dict[str, Any]:
    """Check 1: what wraps what in the framework's model."""
    wrappers = [m for m in model.modules() if isinstance(m, ShardedDataParallel)]
    return {
        "root": type(model).__name__,
        "root_is_flatshard": isinstance(model, ShardedDataParallel),
        "torch_fsdp1_instances": sum(isinstance(m, TORCH_FSDP1["class"]) for m in model.modules()),
        "units": [type(w.module).__name__ for w in wrappers],
    }


def full_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The trained parameters, whole, on every rank, by the plain model's names."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType

    with flatshard.FullyShardedDataParallel.state_dict_type(
        model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
    ):
        state = model.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


def gathered_losses(losses: List[torch.Tensor]) -> torch.Tensor:
    """[rank, step]: each rank's local loss at each step of this run."""
    mine = torch.stack(losses) if losses else torch.zeros(0)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return torch.stack(everyone)


def run_strategy_variant(name: str, args: argparse.Namespace, ports: Ports, rank: int) -> Dict[str, Any]:
    """``<state_dict_type>-<orig|flat>[-bf16]`` (``-bf16``: Lightning's ``precision="bf16-mixed"``,
    which the strategy passes on as torch's ``MixedPrecision`` in bf16); or "full" with use_orig_params and the model wrapped in
    ``configure_model``: by the user with flatshard (``prewrapped-patched``) or with torch's
    ``wrap()`` (``wrapapi-full``)."""
    prewrap = {"prewrapped-patched": "flatshard", "wrapapi-full": "wrap"}.get(name, "")
    state_dict_type, kind, *bf16 = ("full", "orig") if prewrap else name.split("-")
    options = dict(auto_wrap_policy={Block}, state_dict_type=state_dict_type, use_orig_params=kind == "orig",
                   precision="bf16-mixed" if bf16 else "32-true")
    where = Path(args.workdir) / name
    ckpt_k = where / ("step_k.ckpt" if state_dict_type == "full" else "step_k")
    ckpt_final = where / ("final.ckpt" if state_dict_type == "full" else "final")
    result: Dict[str, Any] = {}

    def fresh(epochs: int) -> Tuple[FlowModule, L.Trainer]:
        L.seed_everything(0, verbose=False)
        return FlowModule(use_orig_params=options["use_orig_params"], prewrap=prewrap), trainer_for(epochs, **options)

    ports.next_group()  # 1. straight through
    module, trainer = fresh(args.epochs)
    trainer.fit(module, loader(rank))
    result["sharding"] = sharding_facts(trainer.strategy.model)
    result["optimizer_holds_flat_params"] = all(
        getattr(p, "_fsdp_flattened", False) for g in trainer.optimizers[0].param_groups for p in g["params"]
    )
    result["straight_losses"] = gathered_losses(module.losses)
    result["straight_params"] = full_params(trainer.strategy.model)

    ports.next_group()  # 2. the first epochs, and a checkpoint
    module, trainer = fresh(args.resume_after)
    trainer.fit(module, loader(rank))
    trainer.save_checkpoint(ckpt_k)
    result["part_losses"] = gathered_losses(module.losses)

    ports.next_group()  # 3. a new group, everything anew: resume from the checkpoint
    module, trainer = fresh(args.epochs)
    trainer.fit(module, loader(rank), ckpt_path=ckpt_k)
    result["resumed_global_step"] = trainer.global_step
    result["resumed_losses"] = gathered_losses(module.losses)
    result["resumed_params"] = full_params(trainer.strategy.model)
    trainer.save_checkpoint(ckpt_final)
    result["checkpoint"] = str(ckpt_final)
    return result


def run_unpatched(args: argparse.Namespace, ports: Ports, rank: int) -> Dict[str, Any]:
    """The model wrapped with flatshard first, without ``patch_torch_fsdp()``: Lightning does not
    recognise it and wraps it in torch's FSDP1."""
    result: Dict[str, Any] = {}
    ports.next_group()
    L.seed_everything(0, verbose=False)
    module = FlowModule(prewrap="flatshard")
    trainer = trainer_for(args.epochs, auto_wrap_policy={Block})
    try:
        with torch_fsdp1_on_cpu():
            trainer.fit(module, loader(rank))
    except Exception as error:  # recorded, and judged by the test
        result["error_type"] = f"{type(error).__module__}.{type(error).__qualname__}"
        result["error"] = str(error)
    else:
        result["error_type"] = None
    result["trained_steps"] = len(module.losses)
    return result


def run_fabric(name: str, args: argparse.Namespace, ports: Ports, rank: int) -> Dict[str, Any]:
    state_dict_type = name.split("-")[1]
    where = Path(args.workdir) / name
    ckpt_k = where / ("step_k.ckpt" if state_dict_type == "full" else "step_k")
    ckpt_final = where / ("final.ckpt" if state_dict_type == "full" else "final")
    x, y = rank_rows(rank)
    result: Dict[str, Any] = {}

    def train(last: int, load_from: Any = None, save_to: Any = None) -> Dict[str, Any]:
        ports.next_group()
        L.seed_everything(0, verbose=False)
        fabric = L.Fabric(accelerator="cpu", devices=2, num_nodes=1,
                          strategy=CPUFabricFSDPStrategy(auto_wrap_policy={Block}, state_dict_type=state_dict_type))
        fabric.launch()
        model = fabric.setup_module(build_net())
        optimizer, scheduler = make_optimizer(model.parameters())
        optimizer = fabric.setup_optimizers(optimizer)
        state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
        if load_from is not None:
            fabric.load(load_from, state)
            if state["scheduler"] is not scheduler:
                # Fabric's sharded load puts the saved state dict in place of a stateful object
                # that is neither module nor optimizer (fabric/strategies/fsdp.py:593,
                # "state[key] = metadata.pop(key)"); its full load calls load_state_dict
                scheduler.load_state_dict(state["scheduler"])
                state["scheduler"] = scheduler
        losses = []
        for step in range(state["step"], last):
            s = step % (len(x) // LOCAL_BATCH)
            loss = nn.functional.mse_loss(model(x[s * LOCAL_BATCH:(s + 1) * LOCAL_BATCH]), y[s * LOCAL_BATCH:(s + 1) * LOCAL_BATCH])
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            scheduler.step()
            losses.append(loss.detach().clone())
            state["step"] = step + 1
        if save_to is not None:
            fabric.save(save_to, state)
        return {"model": model, "losses": gathered_losses(losses), "params": full_params(model)}

    steps, resume_at = args.epochs * STEPS_PER_EPOCH, args.resume_after * STEPS_PER_EPOCH
    straight = train(steps)
    result["fabric_root"] = type(straight["model"]).__name__
    result["sharding"] = sharding_facts(straight["model"]._forward_module)
    result["straight_losses"] = straight["losses"]
    result["straight_params"] = {f"net.{k}": v for k, v in straight["params"].items()}
    part = train(resume_at, save_to=ckpt_k)
    result["part_losses"] = part["losses"]
    resumed = train(steps, load_from=ckpt_k, save_to=ckpt_final)
    result["resumed_losses"] = resumed["losses"]
    result["resumed_params"] = {f"net.{k}": v for k, v in resumed["params"].items()}
    result["checkpoint"] = str(ckpt_final)
    return result


def flows(args: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    ports = Ports([int(p) for p in args.ports.split(",")])
    for name in args.variants.split(","):
        (Path(args.workdir) / name).mkdir(parents=True, exist_ok=True)
        if name == "prewrapped-unpatched":
            result = run_unpatched(args, ports, rank)
        else:
            # Lightning builds torch.distributed.fsdp.FullyShardedDataParallel: make it flatshard's
            with flatshard.patch_torch_fsdp():
                if name.startswith("fabric"):
                    result = run_fabric(name, args, ports, rank)
                else:
                    result = run_strategy_variant(name, args, ports, rank)
        if rank == 0:
            torch.save(result, Path(args.workdir) / name / "result.pt")
        print(f"rank {rank}: {name} done", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def consolidated(folder: Path, fabric: bool, cli: bool) -> Dict[str, Any]:
    """A "sharded" checkpoint folder as one checkpoint, the way Lightning consolidates it: its
    command line (``python -m lightning.pytorch.utilities.consolidate_checkpoint FOLDER``, or
    Fabric's) with ``cli``, else the two functions that command runs, in this process."""
    if cli:
        single = folder.with_name(folder.name + ".consolidated")
        module = "lightning.fabric" if fabric else "lightning.pytorch"
        done = subprocess.run([sys.executable, "-m", f"{module}.utilities.consolidate_checkpoint", str(folder), "--output_file", str(single)],
                              capture_output=True, text=True, timeout=240)
        if done.returncode != 0:
            raise RuntimeError(f"consolidating {folder} failed:\n{done.stdout}{done.stderr}")
        return torch.load(single, map_location="cpu", weights_only=False)
    checkpoint = _load_distributed_checkpoint(folder)
    return checkpoint if fabric else _format_checkpoint(checkpoint)


def export(args: argparse.Namespace) -> None:
    """Check 5, in a process that never initialises torch.distributed."""
    for name in args.variants.split(","):
        where = Path(args.workdir) / name
        fabric = name.startswith("fabric")
        ckpt = Path(torch.load(where / "result.pt", weights_only=False)["checkpoint"])
        if ckpt.is_dir():  # "sharded"
            checkpoint = consolidated(ckpt, fabric, args.cli)
        else:  # "full": one file
            checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False)
        state = {f"net.{k}": v for k, v in checkpoint["model"].items()} if fabric else checkpoint["state_dict"]
        plain = FlowModule()
        plain.load_state_dict(state, strict=True)
        out: Dict[str, Any] = {"params": {k: v.detach().clone() for k, v in plain.named_parameters()}}
        if name.startswith(("full-orig", "full-flat")) or name in ("prewrapped-patched", "wrapapi-full"):
            # Lightning keys a full checkpoint's optimizer state by parameter ID ("standard
            # format"): the plain model's parameter order, with use_orig_params or without (a
            # FlatParameter stands for its original parameters, in the plain model's order)
            optimizer, _ = make_optimizer(plain.parameters())
            optimizer.load_state_dict(checkpoint["optimizer_states"][0])
            out["plain_optimizer_exp_avg_shapes"] = [tuple(optimizer.state[p]["exp_avg"].shape) for p in plain.parameters()]
            out["plain_optimizer_steps"] = [float(optimizer.state[p]["step"]) for p in plain.parameters()]
        out["distributed_initialized"] = dist.is_initialized()
        torch.save(out, where / "export.pt")
        print(f"export: {name} done", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["flows", "export"])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--variants", required=True)
    parser.add_argument("--ports", default="")
    parser.add_argument("--cli", action="store_true", help="export: consolidate with Lightning's command line")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--resume-after", type=int, default=1, help="epochs before the checkpoint")
    args = parser.parse_args()
    torch.set_num_threads(1)
    (flows if args.mode == "flows" else export)(args)


if __name__ == "__main__":
    main()
