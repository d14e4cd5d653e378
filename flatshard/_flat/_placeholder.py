"""What a module holds in place of an original parameter while its unit is sharded.

[Note: placeholders] A view into the full flat tensor must not outlive that tensor's
storage (reading it reads freed memory), yet modules look at their parameters outside
forward (``Linear.extra_repr`` checks ``self.bias is not None``) and users ask for shapes. So
while a unit is sharded, each original parameter is a ``ParamPlaceholder``: it answers
metadata questions (shape, dtype, size, ...) and refuses everything else with an error that
names the parameter, instead of silently computing on, or writing into, nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

import torch

_METADATA_PROPERTIES = frozenset({"shape", "dtype", "device", "ndim", "requires_grad", "layout", "is_meta"})
_METADATA_METHODS = frozenset({"size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "__len__"})


class ParamPlaceholder(torch.Tensor):
    """A shape-only stand-in (on the ``meta`` device) for a sharded original parameter."""

    param_name: str

    @staticmethod
    def __new__(cls, name: str, shape: torch.Size, dtype: torch.dtype, requires_grad: bool) -> "ParamPlaceholder":
        placeholder = torch.Tensor._make_subclass(cls, torch.empty(shape, dtype=dtype, device="meta"), requires_grad)
        placeholder.param_name = name
        return placeholder

    def __init__(self, name: str, shape: torch.Size, dtype: torch.dtype, requires_grad: bool) -> None:
        super().__init__()

    def __deepcopy__(self, memo: Dict[int, Any]) -> "ParamPlaceholder":
        """A copied model's placeholder (see [Note: deep copies] in ``_deepcopy``)."""
        with torch._C.DisableTorchFunctionSubclass():
            shape, dtype, requires_grad = self.shape, self.dtype, self.requires_grad
        new = ParamPlaceholder(self.param_name, shape, dtype, requires_grad)
        memo[id(self)] = new
        return new

    def __repr__(self, *, tensor_contents: Optional[str] = None) -> str:  # type: ignore[override]
        return f"ParamPlaceholder('{self.param_name}', shape={tuple(self.shape)}, dtype={self.dtype}; sharded)"

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Sequence[type], args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None
    ) -> Any:
        name = getattr(func, "__name__", "")
        descriptor = getattr(getattr(func, "__self__", None), "__name__", None)
        if (name == "__get__" and descriptor in _METADATA_PROPERTIES) or name in _METADATA_METHODS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        placeholder = next(a for a in _flat(args, kwargs) if isinstance(a, ParamPlaceholder))
        what = descriptor if name == "__get__" else name
        raise RuntimeError(
            f"parameter '{placeholder.param_name}' is sharded by ShardedDataParallel: its full value "
            f"exists only while its unit runs forward or backward, so '{what}' cannot be used on it "
            f"here (to read or change full parameters outside forward, use "
            f"ShardedDataParallel.summon_full_params(model)); optimizers work on model.parameters(), "
            f"the FlatParameter shards"
        )


def _flat(args: Sequence[Any], kwargs: Optional[Dict[str, Any]]) -> list:
    out: list = []
    for value in list(args) + list((kwargs or {}).values()):
        if isinstance(value, (list, tuple)):
            out.extend(value)
        else:
            out.append(value)
    return out
