"""The wrapper's construction options: every constructor argument but ``module``, typed.

[Note: one list of options] The fields of ``ConstructionOptions`` are the one list of the
constructor's options. The constructor keeps FSDP1's explicit signature (users and tools read
it) and hands its ``locals()`` to ``ConstructionOptions.from_constructor``, which refuses a
signature and a field list that drifted apart; ``wrap`` names the arguments a ``CustomPolicy``
may return from these fields, and the planner applies a unit's overrides with
``dataclasses.replace``. The options are only carried here; ``_init.check_options`` checks them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Tuple

from torch import nn

from ..api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy

__all__ = ["ConstructionOptions", "OPTION_NAMES", "NOT_PER_UNIT"]


@dataclasses.dataclass(frozen=True)
class ConstructionOptions:
    """The constructor arguments of one wrapper, in the signature's order and with its
    defaults. The ignored collections are read once, into tuples, since both the plan and
    every unit read them."""

    process_group: Any = None  # a group, a (shard, replicate) pair, or None
    sharding_strategy: Optional[ShardingStrategy] = None
    cpu_offload: Optional[CPUOffload] = None
    auto_wrap_policy: Optional[Callable[..., Any]] = None
    backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE
    mixed_precision: Optional[MixedPrecision] = None
    ignored_modules: Optional[Tuple[nn.Module, ...]] = None
    param_init_fn: Optional[Callable[[nn.Module], None]] = None
    device_id: Any = None  # an int, a str or a torch.device
    sync_module_states: bool = False
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    use_orig_params: bool = False
    ignored_states: Optional[Tuple[Any, ...]] = None
    device_mesh: Any = None  # a DeviceMesh

    def __post_init__(self) -> None:
        # (unchecked here: a non-iterable fails as ``list()`` of it did before)
        for name in ("ignored_modules", "ignored_states"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))

    @classmethod
    def from_constructor(cls, arguments: Mapping[str, Any]) -> "ConstructionOptions":
        """The options from the constructor's ``locals()`` taken on entry (which hold ``self``,
        ``module`` and, for ``super()``, ``__class__`` besides the options)."""
        extra = sorted(set(arguments) - set(OPTION_NAMES) - {"self", "module", "__class__"})
        missing = [name for name in OPTION_NAMES if name not in arguments]
        if extra or missing:
            raise AssertionError(
                f"the constructor's signature and ConstructionOptions differ: arguments without a "
                f"field {extra}, fields without an argument {missing}"
            )
        return cls(**{name: arguments[name] for name in OPTION_NAMES})

    def for_unit(self, overrides: Mapping[str, Any]) -> "ConstructionOptions":
        """The options of an inner unit of a plan: these with ``overrides`` (a policy's, by
        field name) and without the policy."""
        return dataclasses.replace(self, **{**overrides, "auto_wrap_policy": None})


# The option names in the signature's order (an unknown CustomPolicy override lists them).
OPTION_NAMES: Tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ConstructionOptions))

# Options that hold for the whole plan: a policy cannot set them for one unit.
NOT_PER_UNIT: Tuple[str, ...] = ("auto_wrap_policy", "ignored_modules", "ignored_states", "use_orig_params")
