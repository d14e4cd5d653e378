"""The wrapped model's own generation loop (Hugging Face's ``generate``), run through the wrapper.

[Note: generate through the wrapper] ``model.generate(...)`` on a wrapped Hugging Face model
would reach the wrapped model's bound method (attribute forwarding), which calls the wrapped
model's forward directly, bypassing the root wrapper: the root unit's parameters (embeddings,
final norm, head) would be placeholders. So the wrapper has a ``generate`` of its own that
runs the wrapped model's as one root forward without autograd: the root's pre-forward
(cleanup of a failed backward, stale gathers), the root unit gathered once for the whole
call, every nested unit gathered for each of its forwards and freed right after (as in any
forward without autograd), and the root's post-forward (the order check over everything the
call ran, then everything freed). FSDP1 gets the same effect only when a forward happened
before (it keeps its root unsharded after forward).

Every rank must run the same forwards, but ranks stop generating at different lengths (an
end-of-sequence token). Hugging Face's ``synced_gpus=True`` keeps a finished rank running
dummy forwards until all are done; transformers turns it on itself for models it recognises as
FSDP-managed (see [Note: FSDP markers] in ``_fsdp_markers``). The wrapper's ``generate`` also
passes ``synced_gpus=True`` when other ranks share the model and the caller did not choose. A
caller who passes ``synced_gpus=False`` gets order checks on every gather of the call, so ranks
that diverge raise an error on every rank instead of waiting for each other forever.

Inside ``summon_full_params`` the modules hold full parameters already: ``generate`` runs the
wrapped model's method as it is (the fast path: no gathering per token).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch

from .._base._common import TrainingState
from ._forward import start_forward
from ._unit import Unit


def shares_ranks(unit: Unit) -> bool:
    """Whether other ranks run this model with this rank (sharded or replicated)."""
    return unit.world_size > 1 or (unit.replicate is not None and unit.replicate.world_size > 1)


def generate_gathered(unit: Unit, method: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """Run ``method`` (the wrapped model's ``generate``) as one root forward without
    autograd; see [Note: generate through the wrapper].

    Args:
        unit: the unit of the wrapper ``generate`` was called on.
        method: the wrapped model's bound ``generate``.
        args: its positional arguments.
        kwargs: its keyword arguments (``synced_gpus`` is added when several ranks share the
            model and it is missing).
    """
    if unit.training_state is TrainingState.SUMMON_FULL_PARAMS:
        return method(*args, **kwargs)
    several = shares_ranks(unit)
    if several and kwargs.get("synced_gpus") is None:
        kwargs = dict(kwargs, synced_gpus=True)
    with torch.no_grad():
        step = start_forward(unit, (), {}, check_every_collective=several and kwargs.get("synced_gpus") is False)
        try:
            output = method(*args, **kwargs)
        except BaseException as error:
            step.runtime.abandon_forward(step, error)
            raise
        return step.runtime.finish_forward(step, output)
