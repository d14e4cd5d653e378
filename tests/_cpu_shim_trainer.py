"""TEST-ONLY shim: lets Hugging Face accelerate (and so ``transformers.Trainer``) turn FSDP on for
CPU ranks over gloo, so that the Trainer flows in tests/test_framework_trainer.py run on a machine
without accelerators. Never import it from flatshard/ or from user code.

What it opens, and nothing else (two gates):

1. accelerate's ``AcceleratorState.__init__`` sets
``distributed_type = DistributedType.FSDP`` only when the launch is a multi-accelerator one
(``MULTI_GPU``, ``MULTI_XPU``, ...; accelerate/state.py, the branch that tests
``fsdp_plugin is not None``). A 2-process CPU launch is ``MULTI_CPU``, so the plugin is dropped and
the model would be wrapped in DDP. After the original ``__init__``, this shim does what that branch
does for accelerators: on ``MULTI_CPU`` with an FSDP plugin it sets ``DistributedType.FSDP``
(in ``PartialState``'s shared state too, as the original does at its end), hands the
mixed-precision setting to the plugin and keeps the plugin. Everything downstream
(``prepare_model``, ``save_fsdp_model``, the Trainer's checkpoints) is accelerate's own code,
unchanged.
2. ``FullyShardedDataParallelPlugin.__post_init__`` (accelerate/utils/dataclasses.py), with
   ``sync_module_states=True`` (the Trainer's FSDP1 default), asks the accelerator for its current
   device to build ``param_init_fn = lambda m: m.to_empty(device=..., recurse=False)``, and raises
   "There are currently no available devices found" without one. The shim runs the original with
   ``sync_module_states`` off and then sets it back and builds the same ``param_init_fn`` for the
   CPU device, which is what that branch would have built on an accelerator.

``install()`` is idempotent and returns a function that undoes it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

try:  # the frameworks extra (pip install flatshard[frameworks]); the Trainer tests skip without it
    from accelerate import state as accelerate_state
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
except ImportError as missing:
    raise SystemExit(f"the CPU shim for accelerate needs accelerate (pip install flatshard[frameworks]): {missing}") from None

_MARK = "_flatshard_test_cpu_fsdp_shim"


def install() -> Callable[[], None]:
    """Open accelerate's FSDP path on ``MULTI_CPU`` (test-only; see the module docstring)."""
    cls = accelerate_state.AcceleratorState
    original = cls.__init__
    if getattr(original, _MARK, False):
        return lambda: None

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is None or self.distributed_type != DistributedType.MULTI_CPU:
            return
        self.distributed_type = DistributedType.FSDP
        if self._mixed_precision != "no":
            plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = plugin
        # As the original's last line: every later AcceleratorState() copies PartialState's
        # shared state over its own, so the FSDP type must be there too or it reverts.
        accelerate_state.PartialState._shared_state["distributed_type"] = self.distributed_type

    setattr(__init__, _MARK, True)
    cls.__init__ = __init__

    plugin_cls = FullyShardedDataParallelPlugin
    original_post_init = plugin_cls.__post_init__

    def __post_init__(self: Any) -> None:
        sync = self.sync_module_states
        self.sync_module_states = False
        original_post_init(self)
        if sync:
            self.sync_module_states = True
            cpu = torch.device("cpu")
            self.param_init_fn = lambda module: module.to_empty(device=cpu, recurse=False)

    plugin_cls.__post_init__ = __post_init__

    def undo() -> None:
        cls.__init__ = original
        plugin_cls.__post_init__ = original_post_init

    return undo
