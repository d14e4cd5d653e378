"""``patch_torch_fsdp()``: training frameworks that build torch's FSDP1 build flatshard's.

Hugging Face accelerate (and Trainer through it) and Lightning construct
``torch.distributed.fsdp.FullyShardedDataParallel`` themselves and test models with
``isinstance`` against it. After ``flatshard.patch_torch_fsdp()`` that name is flatshard's
``FullyShardedDataParallel``; see docs/frameworks.md for each framework's recipe.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType, TracebackType
from typing import List, Optional, Sequence, Tuple, Type

from ._base._fsdp_markers import RewrapError
from .sharded_data_parallel import ShardedDataParallel

__all__ = ["FRAMEWORK_PACKAGES", "RewrapError", "TorchFSDPPatch", "patch_torch_fsdp"]

# The two public import paths of torch's FSDP1 class.
_TORCH_PATHS = ("torch.distributed.fsdp", "torch.distributed.fsdp.fully_sharded_data_parallel")
_CLASS_NAME = "FullyShardedDataParallel"

#: The training frameworks whose modules ``patch_torch_fsdp`` also looks into for a module-level
#: binding of torch's class made before the call (of these, transformers' ``trainer_seq2seq``
#: makes one at import time; the others import the class when they use it).
FRAMEWORK_PACKAGES = ("transformers", "accelerate", "lightning", "pytorch_lightning", "lightning_fabric", "peft", "trl")


class TorchFSDPPatch:
    """What one ``patch_torch_fsdp()`` call replaced; undone by ``undo()`` or at the end of a
    ``with`` block. A call that found torch already patched replaced nothing, and its ``undo``
    leaves the patch in place (the outermost one undoes it).

    Attributes:
        replaced: each name replaced, as ``"module.attribute"``, in the order replaced.
    """

    def __init__(self, torch_class: Optional[type], replaced: List[Tuple[ModuleType, str]]) -> None:
        self._torch_class = torch_class
        self._replaced = replaced
        self._undone = False

    @property
    def replaced(self) -> List[str]:
        return [f"{module.__name__}.{name}" for module, name in self._replaced]

    @property
    def active(self) -> bool:
        """Whether this call's replacements are in place."""
        return bool(self._replaced) and not self._undone

    def undo(self) -> None:
        """Put torch's class back under every name this call replaced (a no-op the second
        time, and for a call that replaced nothing). A name rebound since, by someone else, is
        left as it is."""
        if self._undone:
            return
        self._undone = True
        for module, name in reversed(self._replaced):
            namespace = _namespace(module)
            if namespace.get(name) is ShardedDataParallel:
                namespace[name] = self._torch_class

    def __enter__(self) -> "TorchFSDPPatch":
        return self

    def __exit__(self, kind: Optional[Type[BaseException]], error: Optional[BaseException], trace: Optional[TracebackType]) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self.active else ("undone" if self._undone else "found torch patched already")
        return f"TorchFSDPPatch({state}, replaced={self.replaced})"


def patch_torch_fsdp(packages: Sequence[str] = ()) -> TorchFSDPPatch:
    """Make torch's FSDP1 class flatshard's, so that frameworks that build
    ``torch.distributed.fsdp.FullyShardedDataParallel`` (Hugging Face accelerate and Trainer,
    Lightning's ``FSDPStrategy``) build and recognise flatshard's wrapper.

    Call it once, on every rank, before the framework wraps the model (before
    ``accelerator.prepare``, ``Trainer(...)``, ``trainer.fit``). It replaces exactly these
    names with ``flatshard.FullyShardedDataParallel``:

    - ``torch.distributed.fsdp.FullyShardedDataParallel``;
    - ``torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel``;
    - in the modules of the frameworks in ``FRAMEWORK_PACKAGES`` (and of ``packages``) imported
      before the call, any module-level name bound to torch's class (a framework that ran
      ``from torch.distributed.fsdp import FullyShardedDataParallel`` at import time);
      ``replaced`` lists them.

    Nothing else changes: torch's own modules keep their references to torch's class (FSDP2's
    ``fully_shard`` is not replaced), and so does your own code (a name you bound to torch's
    class stays torch's: import ``flatshard.FullyShardedDataParallel`` there). flatshard's
    configuration classes accept torch's (``ShardingStrategy``, ``MixedPrecision``,
    ``StateDictType``, ...).

    It is idempotent: a second call while torch is patched replaces nothing. The patch is
    undone by ``undo()`` on the returned object, or by using the call as a context manager::

        with flatshard.patch_torch_fsdp():
            trainer.fit(model)

    Args:
        packages: more top-level package names to look into, as for ``FRAMEWORK_PACKAGES``
            (a framework not listed there that binds torch's class when it is imported).

    Returns:
        A ``TorchFSDPPatch`` listing what was replaced.
    """
    if isinstance(packages, str) or not all(isinstance(p, str) for p in packages):
        raise TypeError(f"patch_torch_fsdp(packages=...) takes a sequence of package names; got {packages!r}")
    fsdp = importlib.import_module(_TORCH_PATHS[0])
    current = getattr(fsdp, _CLASS_NAME)
    if current is ShardedDataParallel:
        if packages:
            raise ValueError(
                f"patch_torch_fsdp(packages={list(packages)!r}): torch is patched already, by an earlier call; pass "
                f"the packages to that first call (this one would replace nothing)"
            )
        return TorchFSDPPatch(None, [])
    torch_class = importlib.import_module(_TORCH_PATHS[1]).__dict__[_CLASS_NAME]
    targets = [(importlib.import_module(path), _CLASS_NAME) for path in _TORCH_PATHS]
    for module, namespace in _framework_modules(FRAMEWORK_PACKAGES + tuple(packages)):
        targets.extend((module, name) for name, value in list(namespace.items()) if value is torch_class)
    patch = TorchFSDPPatch(torch_class, [])
    try:  # (all or nothing: a failure puts back what was replaced before it)
        for module, name in targets:
            namespace = _namespace(module)
            if namespace.get(name) is torch_class:
                namespace[name] = ShardedDataParallel
                patch._replaced.append((module, name))
    except BaseException:
        patch.undo()
        raise
    return patch


def _namespace(module: ModuleType) -> dict:  # type: ignore[type-arg]
    # Read without the module's own attribute access: a lazily loaded module
    # (importlib.util.LazyLoader) would load itself on any attribute read.
    return object.__getattribute__(module, "__dict__")


def _framework_modules(packages: Tuple[str, ...]) -> List[Tuple[ModuleType, dict]]:  # type: ignore[type-arg]
    """The imported modules (a snapshot) of ``packages``, with their namespaces."""
    found = []
    for name, module in list(sys.modules.items()):
        if name.partition(".")[0] not in packages or not isinstance(module, ModuleType):
            continue
        try:
            namespace = _namespace(module)
        except AttributeError:
            continue
        if isinstance(namespace, dict):
            found.append((module, namespace))
    return found

