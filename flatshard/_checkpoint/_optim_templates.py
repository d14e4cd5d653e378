"""Optimizer state templates: an entry for every parameter in a sharded optimizer state dict,
and how a loader tells an entry that was never stepped (see [Note: optimizer state templates]).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator, Mapping, Sequence

import torch

__all__ = ["STEP_NAMES", "makes_state_when_built", "never_stepped", "template_state"]

# The per-parameter step counts of torch's optimizers.
STEP_NAMES = frozenset({"step"})


@contextlib.contextmanager
def template_state(optim: torch.optim.Optimizer) -> Iterator[None]:
    """Inside, every parameter of ``optim`` without state has a template of it (see
    [Note: optimizer state templates]); the templates are removed on exit.

    [Note: optimizer state templates] ``torch.distributed.checkpoint`` loads into the tensors
    of the state dict it is given, so a sharded optimizer state dict must have an entry for
    every parameter a checkpoint may hold state for: also for a fresh optimizer, or for a
    parameter that has not been stepped yet (a frozen or unused unit). Such a parameter gets a
    template from one step, which no step hook sees, in which only the stateless parameters
    have (zero) gradients, with a zero learning rate and no weight decay (no parameter changes
    and the positional state stays at its initial zeros), each step count then taken back by
    one, to 0. So every sharded optimizer state dict has the same entries whatever was stepped
    (a checkpoint loads into the template of a fresh optimizer), and an entry saved from a
    template says "never stepped": loading it (``flatten_optim_state``, see
    ``LoadTarget.loads_unstepped``) leaves the parameter without state, as it was, so
    resuming equals not having stopped. (Optimizers without a step count, SGD, keep a zero
    momentum buffer instead, which SGD's first step treats as no buffer when ``dampening`` is
    0, its default.)
    """
    params = [p for group in optim.param_groups for p in group["params"]]
    stateless = [p for p in params if not optim.state.get(p)]
    if stateless:
        _step_templates(optim, params, stateless)
    try:
        yield
    finally:
        for p in stateless:
            optim.state.pop(p, None)


def _step_templates(optim: torch.optim.Optimizer, params: Sequence[torch.Tensor], stateless: Sequence[torch.Tensor]) -> None:
    grads = [p.grad for p in params]
    saved = [{k: group[k] for k in ("lr", "weight_decay") if k in group} for group in optim.param_groups]
    wanted = {id(p) for p in stateless}
    try:
        for p in params:
            p.grad = torch.zeros_like(p) if id(p) in wanted else None
        for group in optim.param_groups:
            group.update({k: 0.0 for k in ("lr", "weight_decay") if k in group})
        _unhooked_step(optim)
    finally:
        for group, values in zip(optim.param_groups, saved):
            group.update(values)
        for p, grad in zip(params, grads):
            p.grad = grad
    for p in stateless:
        entry = optim.state.get(p, {})
        for key in STEP_NAMES & set(entry):
            entry[key] = entry[key] - 1


def _unhooked_step(optim: torch.optim.Optimizer) -> None:
    """``optim.step()`` without the step hooks: a template is no step. The hooks would take it
    for one -- flatshard's own count of the model's steps (templates are made on the ranks
    whose parameters lack state, which need not be every rank: the next forward would find
    the ranks' counts differ), and the user's (an EMA update after each step, a counter).
    torch runs the hooks in a wrapper it puts around the class's ``step``
    (``Optimizer.profile_hook_step``, marked ``hooked``); this calls what it wraps."""
    step = type(optim).step
    inner = getattr(step, "__wrapped__", None) if getattr(step, "hooked", False) else None
    if inner is None:
        optim.step()
    else:
        inner(optim)


def never_stepped(names: Sequence[str], state: Mapping[str, Any]) -> bool:
    """Whether the saved state of ``names`` is a template (see [Note: optimizer state
    templates]): step counts of 0."""
    steps = [entry[key] for entry in (state.get(n) for n in names) if entry for key in STEP_NAMES & set(entry)]
    return bool(steps) and all(float(step) == 0 for step in steps)


def makes_state_when_built(optim: torch.optim.Optimizer) -> bool:
    """Whether ``optim``'s class makes state for its parameters when it is built (Adagrad), by
    building one over a single parameter with those of ``optim``'s defaults its constructor
    takes; ``True`` where that fails (a class that needs more arguments), so state is kept."""
    cls = type(optim)
    try:
        accepted = inspect.signature(cls.__init__).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        options = {k: v for k, v in optim.defaults.items() if takes_any or k in accepted}
        probe = cls([torch.zeros(1, requires_grad=True)], **options)
    except Exception:  # noqa: BLE001 - any failure: assume it does (the cautious side)
        return True
    return bool(probe.state)
