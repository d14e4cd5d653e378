"""TEST-ONLY: let accelerate's FSDP plugin run on CPU ranks (gloo). Never import this in flatshard/.

accelerate turns FSDP on only for accelerator devices: in ``AcceleratorState.__init__``
(accelerate 1.15.0 state.py:986-1016) the branch that sets ``DistributedType.FSDP`` runs only
when the distributed type is one of MULTI_GPU / MULTI_NPU / MULTI_XPU / ...; on CPU ranks
(``Accelerator(cpu=True)``, accelerate's own switch, or ``accelerate launch --cpu``) the type is
MULTI_CPU, the plugin is dropped without a word, and ``Accelerator.prepare_model`` wraps the
model in DistributedDataParallel.

``open_fsdp_on_cpu()`` wraps ``AcceleratorState.__init__``: when the state came out MULTI_CPU
with an FSDP plugin given, it does what that branch does on a GPU (distributed type FSDP, the
plugin's mixed precision set from the accelerator's, the plugin kept on the state, the type
recorded on the shared PartialState). That is all
it opens; everything after it (prepare_model, save_state, load_state, get_state_dict) is
accelerate's own code, unchanged.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

try:  # the frameworks extra (the tests that use this skip without it)
    from accelerate import state as accelerate_state
    from accelerate.utils import DistributedType
except ImportError as missing:
    raise ImportError(f"tests/_cpu_shim_accelerate.py shims accelerate, which is not installed: {missing}") from missing

_PATCHED = "_flatshard_test_cpu_fsdp"


def open_fsdp_on_cpu() -> None:
    """Idempotent; call before constructing ``Accelerator``."""
    cls = accelerate_state.AcceleratorState
    if getattr(cls.__init__, _PATCHED, False):
        return
    original: Callable[..., None] = cls.__init__

    @functools.wraps(original)
    def init(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            # (as that branch's end does: every later AcceleratorState() copies PartialState's)
            accelerate_state.PartialState._shared_state["distributed_type"] = self.distributed_type

    setattr(init, _PATCHED, True)
    cls.__init__ = init
