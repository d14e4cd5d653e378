"""TEST-ONLY shim: lets Hugging Face accelerate (and so ``transformers.Trainer``) turn FSDP on for
CPU ranks over gloo, so that the Trainer flows in tests/test_framework_trainer.py run on a machine
without accelerators. Never import it from flatshard/ or from user code.

What it opens, and nothing else (two gates):

1. accelerate's ``AcceleratorState.__init__`` sets ``DistributedType.FSDP`` only on accelerators:
   ``tests/_cpu_shim_accelerate.py`` (``open_fsdp_on_cpu``) opens it, as for the accelerate flows.
2. ``FullyShardedDataParallelPlugin.__post_init__`` (accelerate/utils/dataclasses.py), with
   ``sync_module_states=True`` (the Trainer's FSDP1 default), asks the accelerator for its current
   device to build ``param_init_fn = lambda m: m.to_empty(device=..., recurse=False)``, and raises
   "There are currently no available devices found" without one. The shim runs the original with
   ``sync_module_states`` off and then sets it back and builds the same ``param_init_fn`` for the
   CPU device, which is what that branch would have built on an accelerator.

``install()`` is idempotent. Everything downstream (``prepare_model``, ``save_fsdp_model``, the
Trainer's checkpoints) is accelerate's own code, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

try:  # the frameworks extra (pip install flatshard[frameworks]); the Trainer tests skip without it
    from accelerate.utils import FullyShardedDataParallelPlugin
except ImportError as missing:
    raise SystemExit(f"the CPU shim for accelerate needs accelerate (pip install flatshard[frameworks]): {missing}") from None

from tests import _cpu_shim_accelerate

_MARK = "_flatshard_test_cpu_fsdp_shim"


def install() -> None:
    """Open accelerate's FSDP path on ``MULTI_CPU`` for the Trainer (test-only; see the module
    docstring)."""
    _cpu_shim_accelerate.open_fsdp_on_cpu()
    plugin_cls = FullyShardedDataParallelPlugin
    original_post_init = plugin_cls.__post_init__
    if getattr(original_post_init, _MARK, False):
        return

    def __post_init__(self: Any) -> None:
        sync = self.sync_module_states
        self.sync_module_states = False
        original_post_init(self)
        if sync:
            self.sync_module_states = True
            cpu = torch.device("cpu")
            self.param_init_fn = lambda module: module.to_empty(device=cpu, recurse=False)

    setattr(__post_init__, _MARK, True)
    plugin_cls.__post_init__ = __post_init__
