"""Keeping flatshard's runtime out of torch.compile's graphs (see [Note: torch.compile] in
``_runtime``): the autograd hooks and callbacks the runtime registers."""

from __future__ import annotations

import sys
from typing import Any, Callable, TypeVar

import torch

_F = TypeVar("_F", bound=Callable[..., Any])


def dynamo_loaded() -> bool:
    """Whether dynamo is imported: until it is, nothing can be compiling or tracing."""
    return "torch._dynamo" in sys.modules


def outside_graph(fn: _F) -> _F:
    """``fn`` to be registered as an autograd hook or callback: opaque to dynamo when dynamo is
    loaded (``torch.compiler.disable``), ``fn`` itself otherwise (importing dynamo costs a
    second). A backward run by a compiled function (one that calls ``loss.backward()``) calls
    the hooks with dynamo's frame hook installed; opaque, they run eagerly, and so does all
    they call."""
    if not dynamo_loaded():
        return fn
    return torch.compiler.disable(fn, reason="flatshard's runtime runs eagerly")
