"""Exception classes that code written for FSDP1 still catches.

[Note: FSDP1's exception classes] Where flatshard and FSDP1 refuse the same misuse with
different built-in classes, flatshard raises a class deriving from both: its own choice
(what its messages and tests always raised) and FSDP1's, so that an ``except`` written for
either catches it. The messages stay flatshard's.
"""

from __future__ import annotations

__all__ = ["ArgumentTypeError", "ConfigTypeError", "DivergedRanksError", "UnsupportedCombinationError", "WrongStateError"]


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type, where FSDP1 raises ``ValueError`` (``param_init_fn``,
    ``ignored_modules``)."""


class ConfigTypeError(TypeError, RuntimeError):
    """A state-dict config of the wrong type for its state-dict type (FSDP1: ``RuntimeError``)."""


class UnsupportedCombinationError(ValueError, NotImplementedError):
    """Options that cannot be combined, where FSDP1 raises ``NotImplementedError``
    (``summon_full_params(rank0_only=True, writeback=True)``)."""


class WrongStateError(RuntimeError, AssertionError):
    """A call made while the units are in a state that forbids it (``summon_full_params`` in
    forward or backward, or inside another one), where FSDP1 raises ``AssertionError``."""


class DivergedRanksError(RuntimeError, ValueError):
    """The ranks built or ran different units where they must agree (FSDP1 raises
    ``RuntimeError`` for a first iteration's order that differs across ranks)."""
