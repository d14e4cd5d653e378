"""The ranks' agreement checks of a root's runtime: the same units in the same order, the same
units reached by the backward, the same number of optimizer steps.

``AgreementChecks`` is a mixin of ``RootRuntime`` (which sets every attribute it uses in its
constructor), so that the runtime's file holds the forward and backward machinery and this one
the checks that turn ranks which diverge into errors on every rank.

[Note: steps agree] A rank that calls ``optimizer.step()`` on a step the others skip (or skips
one they take) issues no collective that could tell: the step is local to each shard. Its
shards then train a different model from that point on, silently. So the runtime counts the
optimizer steps that touch the model (the optimizer step pre-hook, see ``_stale_optimizer``),
and the check every root forward makes compares the count along with the units it ran: the
next forward after such a step raises on every rank, naming each rank's count.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

from .._comm._collectives import differences, item_at
from .._comm._guard import Guard, Position
from .._base._common import display_name
from .._flat._exec_order import describe
from ._unit import Unit
from .._flat._flat_param import FlatParamHandle

__all__ = ["AgreementChecks", "RULE"]


class AgreementChecks:
    """Rank-agreement checks (see the module docstring). Every check is a position check of
    the root's guard ([Note: one guarded path] in ``_comm/_guard``), so a rank at any other
    check or call entry pairs with it and is named."""

    # (set by RootRuntime.__init__ and RootContext.__init__)
    guard: Guard
    checking: bool
    check_comms: List[Any]
    units: List[Unit]
    root: Unit
    optimizer_steps: int

    def _check_order(self, value: int) -> None:
        """One per-collective order check (a ``token``, see [Note: order check]) while
        checking: a position check of the guard at the collective the token names."""
        if self.checking:
            self.guard.position(describe(value, [_label(u) for u in self.units]), [_PER_COLLECTIVE], explain=_units_differ)

    def _check_forward_order(self, order: List[Unit]) -> None:
        """The one check every root forward makes at its end: did all ranks run the same units
        in order, after the same number of optimizer steps? See [Note: order check]."""
        names = [_label(u) for u in order]
        self.guard.position(_FORWARD, names + [f"optimizer steps: {self.optimizer_steps}"], explain=_forward_difference)

    def _check_backward_agrees(self) -> None:
        """[Note: backward agreement] Ranks whose backward passes reach different units (one
        rank leaves a unit's output, or a side loss, out of its loss) would issue different
        gathers and reductions, which hang or pair the wrong tensors. So when a backward first
        reaches one of the root's units, the ranks compare a digest of which handles will
        receive a gradient in this backward (autograd knows which gradient accumulators its
        graph task will run); if they differ, every rank raises the same error before any
        collective of the backward. It is the entry check of the backward's guarded call."""
        reached = [
            _label(unit) + (f" (FlatParameter {h.attr_name})" if len(unit.handles) > 1 else "")
            for unit in self.units
            for h in unit.handles
            if _will_accumulate(h)
        ]
        self.guard.enter_at(_BACKWARD, reached, explain=_backward_difference)


# Where a rank is at each check (a rank at another check than ours shows up with another).
_FORWARD, _BACKWARD = "at the end of its forward", "at the start of its backward"
RULE = "every rank must run the same units in the same order, e.g. no data-dependent skipping"
_PER_COLLECTIVE = "(a per-collective check)"  # what such a check compares: the rest is its kind


Ranked = List[Tuple[int, Position]]  # every rank's position, by global rank


def _units_differ(everyone: Ranked) -> str:
    """Ranks at different per-collective checks, or one at such a check and one elsewhere."""
    return f"the ranks ran different units ({RULE}): " + "; ".join(f"rank {r} is {p[0]}" for r, p in everyone)


def _elsewhere(everyone: Ranked) -> Optional[str]:
    """For a check some rank is not at: the units differ if a rank is at a per-collective
    check; else ``None`` (the guard names where each rank is)."""
    return _units_differ(everyone) if any(p[2] == [_PER_COLLECTIVE] for _, p in everyone) else None


def _forward_difference(everyone: Ranked) -> Optional[str]:
    if len({p[0] for _, p in everyone}) > 1:
        return _elsewhere(everyone)
    ranks = [r for r, _ in everyone]
    ran_lists = [p[2][:-1] for _, p in everyone]
    steps = [p[2][-1].split(": ", 1)[-1] for _, p in everyone]
    if all(names == ran_lists[0] for names in ran_lists):  # see [Note: steps agree]
        counts = "; ".join(f"rank {r}: {n}" for r, n in zip(ranks, steps))
        return (
            f"the ranks called optimizer.step() on this model a different number of times before this "
            f"forward ({counts}): a rank that steps alone, or skips a step the others take, trains a "
            f"different model from then on (every rank must step together)"
        )
    first = min(d.index for d in differences(ran_lists, "nothing"))  # where any rank differs
    ran = "; ".join(f"rank {r} ran {item_at(names, first, 'nothing')}" for r, names in zip(ranks, ran_lists))
    return f"the ranks ran different units ({RULE}): unit #{first} of this forward differs: {ran}"


def _backward_difference(everyone: Ranked) -> Optional[str]:
    if len({p[0] for _, p in everyone}) > 1:
        return _elsewhere(everyone)
    per_rank = [(r, p[2]) for r, p in everyone]
    union = sorted(set().union(*(reached for _, reached in per_rank)))
    lines = [f"rank {r}: {', '.join(n for n in union if n not in theirs) or 'none'}" for r, theirs in per_rank]
    return (
        "the ranks' backward passes differ: they reach different units' parameters, so their gradient "
        "reductions cannot be matched (every rank's loss must use the same units and outputs, e.g. no "
        "auxiliary loss left out on some ranks). Units without a gradient on each rank: " + "; ".join(lines)
    )


def _label(unit: Unit) -> str:
    return display_name(unit.name)


def _will_accumulate(handle: FlatParamHandle) -> bool:
    """Whether the running backward will accumulate a gradient into ``handle``'s full flat tensor."""
    leaf = handle.grad_leaf
    if not leaf.requires_grad:
        return False
    node = torch.autograd.graph.get_gradient_edge(leaf).node
    return bool(torch._C._will_engine_execute_node(node))
