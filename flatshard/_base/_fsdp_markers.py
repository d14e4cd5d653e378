"""The attributes other libraries read to tell an FSDP-managed module.

[Note: FSDP markers] Hugging Face transformers turns on ``synced_gpus`` in ``generate`` (every
rank keeps running forwards until all have finished, so ranks generating different lengths never
wait for each other forever) for modules whose ``_is_fsdp_managed_module`` attribute is true,
and other libraries test the same attribute. torch FSDP1 sets it (with
``_fsdp_use_orig_params``) on every module it manages. torch.compile reads it too, and then
treats the module as one of torch's FSDP's and traces its hooks as those of torch's FSDP --
wrong for flatshard, whose runtime must stay outside compiled graphs (see [Note:
torch.compile]). So flatshard's marker is an object that is true except while torch.compile
(or export) is compiling: libraries see an FSDP-managed module, the compiler sees a plain one.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ManagedFlag", "mark_fsdp_managed"]


class ManagedFlag:
    """True outside compilation, false while ``torch.compiler.is_compiling()`` (see [Note: FSDP
    markers]). Holds no state."""

    __slots__ = ()

    def __bool__(self) -> bool:
        return not torch.compiler.is_compiling()

    def __repr__(self) -> str:
        return "ManagedFlag()"


def mark_fsdp_managed(root: nn.Module, use_orig_params: bool) -> None:
    """Mark every module under ``root`` (itself included) as FSDP-managed, as torch FSDP1 does."""
    flag = ManagedFlag()
    for module in root.modules():
        module.__dict__["_is_fsdp_managed_module"] = flag
        module.__dict__["_fsdp_use_orig_params"] = use_orig_params
