"""Modules that can be called like their function of the same name: ``flatshard.plan(...)``.

[Note: callable modules]
FSDP1's ``torch.distributed.fsdp.wrap`` is a module, and code written for it does
``from torch.distributed.fsdp import wrap; wrap.ModuleWrapPolicy(...)`` or
``import torch.distributed.fsdp.wrap as W``. Both spellings read the package's attribute
``wrap``, so that attribute must be the submodule, not the function ``wrap`` it defines (a
package attribute is one object: re-exporting the function from ``flatshard/__init__`` shadowed
the module). flatshard also promises ``flatshard.plan(...)`` as a function while ``flatshard.plan``
is a subpackage (``python -m flatshard.plan``), and ``wrap(module)`` inside ``enable_wrap`` has
always worked after ``from flatshard import wrap``. So the module object itself is made
callable: its class becomes a ``types.ModuleType`` subclass whose ``__call__`` calls the module's
function named like the module (``flatshard.plan.plan``, ``flatshard.wrap.wrap``). Everything
else about the module is unchanged (it is still a module for ``import``, ``from ... import``,
``inspect.ismodule`` and pickling by reference).
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any, Callable

__all__ = ["make_callable"]


class _CallableModule(types.ModuleType):
    """A module whose calls go to its function named like the module's last component."""

    def _function(self) -> Callable[..., Any]:
        return getattr(self, self.__name__.rpartition(".")[2])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._function()(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        # ``inspect.signature(flatshard.plan)`` shows the function's parameters, not (*args, **kwargs).
        return inspect.signature(self._function())


def make_callable(module_name: str) -> None:
    """Make the (already executing) module ``module_name`` callable; see [Note: callable modules].

    Args:
        module_name: the module's ``__name__``; it must define a function named like its last
            component (``wrap`` for ``flatshard.wrap``).
    """
    module = sys.modules[module_name]
    function_name = module_name.rpartition(".")[2]
    if not callable(getattr(module, function_name, None)):
        raise AssertionError(f"module {module_name} must define a function {function_name!r} to be callable")
    module.__class__ = _CallableModule
