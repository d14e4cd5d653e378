"""The private attributes of torch's FSDP1 wrapper that training frameworks read, given FSDP1's
meaning on flatshard's wrapper (``FSDP1Surface``), and the wrapped module's ``forward``
signature shown on the wrapper's (``show_forward_signature``).

[Note: FSDP1's private surface] Hugging Face accelerate (and through it Trainer) and Lightning
build torch's FSDP1 and then read a few of its private attributes. After
``flatshard.patch_torch_fsdp()`` they build flatshard's wrapper instead and read the same
names, which must not fall through to the wrapped module (``ShardedDataParallel.__getattr__``
forwards unknown names there, so ``_has_params`` would name the user's model in an
AttributeError). Each name here has FSDP1's meaning; docs/migrating.md lists them with the
framework and the line that reads them.

FSDP1 has one FlatParameter per wrapper (one dtype; with ``use_orig_params`` it may mix frozen
and trainable parameters, and then requires grad). A flatshard unit has one per dtype and
``requires_grad`` value, so a unit mixing frozen and trainable parameters (LoRA adapters beside a
frozen base) has two. ``_flat_param`` and ``_handle`` then give the trainable one, which is what
accelerate's mixed-precision upcast acts on (FSDP1's single FlatParameter requires grad); the
frozen one keeps its dtype, which the computation never sees (mixed precision casts both to
``param_dtype``). A unit with more than one trainable, or only frozen ones in several dtypes, has
nothing FSDP1 could have had: those raise and say why.
"""

from __future__ import annotations

import inspect
import types
from typing import Any, Callable, Optional

from torch import nn

from .._base._common import display_name
from .._base._fsdp_markers import refuse_marker_write
from .._flat._flat_param import FlatParameter, FlatParamHandle
from ._unit import Unit

__all__ = ["FSDP1Surface", "SignedForward", "show_forward_signature"]


class FSDP1Surface(nn.Module):
    """FSDP1's private attributes that frameworks read (see [Note: FSDP1's private surface]).
    A base of ``ShardedDataParallel``, which sets ``_unit``."""

    _unit: Unit

    @property
    def _has_params(self) -> bool:
        """Whether this unit owns parameters (FSDP1: whether it has a FlatParameter)."""
        return bool(self._unit.handles)

    @property
    def _handle(self) -> Optional[FlatParamHandle]:
        """This unit's ``FlatParamHandle`` (``None`` without parameters), as FSDP1's."""
        return _only_handle(self._unit, "_handle")

    @property
    def _flat_param(self) -> Optional[FlatParameter]:
        """This unit's ``FlatParameter`` (``None`` without parameters), as FSDP1's."""
        handle = _only_handle(self._unit, "_flat_param")
        return None if handle is None else handle.flat_param

    def __setattr__(self, name: str, value: Any) -> None:
        refuse_marker_write(self, name, value)  # see [Note: a second FSDP]
        super().__setattr__(name, value)


def _only_handle(unit: Unit, attribute: str) -> Optional[FlatParamHandle]:
    handles = unit.handles
    if len(handles) <= 1:
        return handles[0] if handles else None
    trainable = [h for h in handles if h.requires_grad]
    if len(trainable) == 1:  # (frozen beside trainable: see [Note: FSDP1's private surface])
        return trainable[0]
    kinds = ", ".join(f"{h.dtype} requires_grad={h.requires_grad}" for h in handles)
    raise ValueError(
        f"{attribute} of unit {display_name(unit.name)}: FSDP1 has one FlatParameter per wrapper, in one dtype; "
        f"this unit has {len(handles)} ({kinds}), so there is no one FlatParameter to give. Use .handles; code "
        f"written for FSDP1 that reads {attribute} (accelerate's prepare_model under mixed precision, "
        f"accelerator.py:2022) needs each unit's trainable parameters to share one dtype"
    )


_SIGNED = "_flatshard_signed_forward"  # (the instance's own copy of forward, in its __dict__)
_SELF = "_flatshard_wrapper"  # (the copy's first parameter: no name a forward could also use)


class SignedForward:
    """Decorates the wrapper's ``forward``: looked up on a wrapper, it is bound from that
    wrapper's own copy of the function, which carries the wrapped module's signature (see
    [Note: the forward signature]); on the class, it is the function itself."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.__doc__ = function.__doc__
        self.__name__ = function.__name__
        self.__qualname__ = function.__qualname__

    def __get__(self, instance: Optional[nn.Module], owner: Optional[type] = None) -> Any:
        if instance is None:
            return self.function
        return types.MethodType(instance.__dict__.get(_SIGNED, self.function), instance)


def show_forward_signature(wrapper: nn.Module, module: nn.Module) -> None:
    """Make ``inspect.signature(wrapper.forward)`` the wrapped module's ``forward`` signature.

    [Note: the forward signature] Hugging Face Trainer keeps only the dataset columns that
    ``model.forward``'s signature names; the wrapper's ``forward(*args, **kwargs)`` names none,
    so every column was dropped. ``inspect.signature`` of a bound method reads its function's
    ``__signature__``, which the class's function cannot have per instance. So the wrapper keeps,
    in its ``__dict__``, a copy of the class's ``forward`` function (the same code, run the same
    way) carrying the wrapped module's signature, and ``forward`` on the class is a
    ``SignedForward``, which binds that copy. Nothing in the wrapper's ``__dict__`` refers back to
    it, and replacing ``forward`` on the class (a profiler, ``mock.patch.object``) still reaches
    every wrapper. A subclass that defines its own ``forward`` keeps it as it is."""
    descriptor = inspect.getattr_static(type(wrapper), "forward", None)
    if not isinstance(descriptor, SignedForward):
        return
    function = descriptor.function
    try:
        signature = inspect.signature(module.forward)
        parameters = [inspect.Parameter(_SELF, inspect.Parameter.POSITIONAL_ONLY)] + list(signature.parameters.values())
        signed = signature.replace(parameters=parameters)
    except (TypeError, ValueError):  # (a builtin or C forward, or one taking a parameter of that name)
        return
    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__, function.__closure__)
    copy.__qualname__ = function.__qualname__
    copy.__doc__ = function.__doc__
    copy.__signature__ = signed  # type: ignore[attr-defined]
    wrapper.__dict__[_SIGNED] = copy
