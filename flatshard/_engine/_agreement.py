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

from typing import Any, List

import torch

from .._comm._collectives import all_gather_object, differences, fingerprint, item_at
from .._base._common import display_name
from .._flat._exec_order import END_OF_BACKWARD, mismatch, token
from .._comm._host_checks import check_device
from ._unit import Unit
from .._flat._flat_param import FlatParamHandle

__all__ = ["AgreementChecks"]


class AgreementChecks:
    """Rank-agreement checks (see the module docstring)."""

    # (set by RootRuntime.__init__ and RootContext.__init__)
    checking: bool
    check_comms: List[Any]
    units: List[Unit]
    root: Unit
    optimizer_steps: int

    def _check_order(self, value: int) -> None:
        """One per-collective order check (a ``token``, see [Note: order check]) while
        checking: ``_agree`` raises on any difference, since this rank's value is a token."""
        if not self.checking:
            return
        for comm in self.check_comms:
            self._agree(comm, value)

    def _check_forward_order(self, order: List[Unit]) -> None:
        """The one check every root forward makes: did all ranks run the same units in order,
        after the same number of optimizer steps? See [Note: order check]."""
        names = [_label(u) for u in order]
        digest = fingerprint("\n".join(names + [f"optimizer steps: {self.optimizer_steps}"]))
        for comm in self.check_comms:
            if self._agree(comm, digest):
                continue
            everyone = all_gather_object((_FORWARD, names, self.optimizer_steps), comm.group)
            raise RuntimeError(f"[rank {comm.rank}] {_forward_difference(everyone)}")

    def _check_backward_agrees(self) -> None:
        """[Note: backward agreement] Ranks whose backward passes reach different units (one
        rank leaves a unit's output, or a side loss, out of its loss) would issue different
        gathers and reductions, which hang or pair the wrong tensors. So when a backward first
        reaches one of the root's units, the ranks compare a digest of which handles will
        receive a gradient in this backward (autograd knows which gradient accumulators its
        graph task will run); if they differ, every rank raises the same error before any
        collective of the backward."""
        if not self.check_comms:
            return
        reached = [
            _label(unit) + (f" (FlatParameter {h.attr_name})" if len(unit.handles) > 1 else "")
            for unit in self.units
            for h in unit.handles
            if _will_accumulate(h)
        ]
        for comm in self.check_comms:
            if self._agree(comm, fingerprint("\n".join(reached))):
                continue
            everyone = all_gather_object((_BACKWARD, reached), comm.group)
            raise RuntimeError(f"[rank {comm.rank}] {_backward_difference(everyone)}")

    def _agree(self, comm: Any, digest: int) -> bool:
        """Whether every rank of ``comm`` passed ``digest``. While every collective is checked
        (``checking``), through the same one-integer all-gather as those checks, which a rank at
        another check then pairs with (and is named by); else ``Communicator.agree``, whose cost
        does not grow with the world size."""
        device = check_device(comm, self.root.device)
        if not self.checking:
            return bool(comm.agree(digest, device))
        values = comm.gather_ints(digest, device)
        if all(v == values[0] for v in values):
            return True
        if any(v < token(END_OF_BACKWARD + 1) for v in values):  # some rank is at a per-collective check (a token)
            problem = mismatch(values, [_label(u) for u in self.units])
            raise RuntimeError(f"[rank {comm.rank}] the ranks ran different units ({_RULE}): {problem}")
        return False


# What the ranks exchange to explain a failed check: its kind first (a rank at another check
# than ours shows up with another kind), then what the check compared.
_FORWARD, _BACKWARD = "at the end of its forward", "at the start of its backward"
_RULE = "every rank must run the same units in the same order, e.g. no data-dependent skipping"


def _mixed_checks(everyone: List[Any]) -> str:
    """The ranks' positions, where they were not all at the same kind of check."""
    return "; ".join(f"rank {r} is {entry[0]}" for r, entry in enumerate(everyone))


def _forward_difference(everyone: List[Any]) -> str:
    if any(entry[0] != _FORWARD for entry in everyone):
        return f"the ranks ran different units ({_RULE}): {_mixed_checks(everyone)}"
    ran_lists = [names for _, names, _ in everyone]
    if all(names == ran_lists[0] for names in ran_lists):  # see [Note: steps agree]
        counts = "; ".join(f"rank {r}: {steps}" for r, (_, _, steps) in enumerate(everyone))
        return (
            f"the ranks called optimizer.step() on this model a different number of times before this "
            f"forward ({counts}): a rank that steps alone, or skips a step the others take, trains a "
            f"different model from then on (every rank must step together)"
        )
    first = min(d.index for d in differences(ran_lists, "nothing"))  # where any rank differs
    ran = "; ".join(f"rank {r} ran {item_at(names, first, 'nothing')}" for r, names in enumerate(ran_lists))
    return f"the ranks ran different units ({_RULE}): unit #{first} of this forward differs: {ran}"


def _backward_difference(everyone: List[Any]) -> str:
    if any(entry[0] != _BACKWARD for entry in everyone):
        return f"the ranks ran different units ({_RULE}): {_mixed_checks(everyone)}"
    per_rank = [reached for _, reached in everyone]
    union = sorted(set().union(*per_rank))
    lines = [f"rank {r}: {', '.join(n for n in union if n not in theirs) or 'none'}" for r, theirs in enumerate(per_rank)]
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
