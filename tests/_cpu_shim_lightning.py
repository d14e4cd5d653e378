"""Test-only: lets Lightning's ``FSDPStrategy`` run on CPU ranks (gloo). Never used by flatshard.

Lightning builds FSDP only on GPUs: ``lightning/pytorch/trainer/connectors/accelerator_connector.py``
(``_check_strategy_and_fallback``, line 431-438 in lightning 2.6.6) raises "The strategy `fsdp`
requires a GPU accelerator" when the strategy is the string ``"fsdp"`` or an object whose type is
exactly ``FSDPStrategy``, and the accelerator is not CUDA; ``lightning/fabric/connector.py``
(line 433-438) does the same for Fabric. Nothing else in the strategy needs a GPU: with a CPU
root device it passes ``device_id=None`` to the wrapper and picks the gloo backend.

What this opens: the gate tests the type with ``is``, so a subclass that changes nothing passes
it. ``CPUFSDPStrategy`` (and ``CPUFabricFSDPStrategy``) are exactly Lightning's strategies under
another name; no Lightning function is replaced.

``torch_fsdp1_on_cpu()`` is for the one flow that runs torch's own FSDP1 (a model wrapped with
flatshard first, without ``patch_torch_fsdp()``): Lightning passes ``device_id=root_device.index``,
``None`` for a CPU device, and torch's FSDP1 then refuses CPU ("FSDP needs a non-CPU accelerator
device", torch/distributed/fsdp/_init_utils.py, ``_init_device_handle``) before it reaches the
model. On a GPU it goes on to mark the modules it manages, where flatshard refuses. Within the
``with`` block torch's two public FSDP1 names hold a subclass of torch's class that passes
``device_id=torch.device("cpu")`` when given none, so the CPU run takes the GPU run's path.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed.fsdp
import torch.distributed.fsdp.fully_sharded_data_parallel as _fsdp1_module
try:
    from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
    from lightning.pytorch.strategies import FSDPStrategy
except ImportError as error:
    raise ImportError("Lightning is not installed: the Lightning flows need the frameworks extra (pip install -e '.[frameworks]')") from error

__all__ = ["CPUFSDPStrategy", "CPUFabricFSDPStrategy", "torch_fsdp1_on_cpu"]

_FSDP1_HOMES = (torch.distributed.fsdp, _fsdp1_module)


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy``, unchanged, under a name the GPU-only gate does not match."""


class CPUFabricFSDPStrategy(FabricFSDPStrategy):
    """Fabric's ``FSDPStrategy``, unchanged, under a name the GPU-only gate does not match."""


@contextlib.contextmanager
def torch_fsdp1_on_cpu() -> Iterator[None]:
    """Test-only: torch's FSDP1, given no ``device_id``, runs on CPU (see the module's docstring).
    Refuses to start while ``flatshard.patch_torch_fsdp()`` is in effect."""
    torch_class = _fsdp1_module.FullyShardedDataParallel
    if torch_class.__module__ != _fsdp1_module.__name__:
        raise RuntimeError(f"torch's FSDP1 name holds {torch_class.__module__}.{torch_class.__qualname__}: undo patch_torch_fsdp() first")

    class TorchFSDP1OnCPU(torch_class):  # type: ignore[misc, valid-type]
        def __init__(self, module: torch.nn.Module, *args: Any, device_id: Any = None, **kwargs: Any) -> None:
            super().__init__(module, *args, device_id=torch.device("cpu") if device_id is None else device_id, **kwargs)

    for home in _FSDP1_HOMES:
        home.FullyShardedDataParallel = TorchFSDP1OnCPU
    try:
        yield
    finally:
        for home in _FSDP1_HOMES:
            home.FullyShardedDataParallel = torch_class
