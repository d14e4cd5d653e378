"""The optimizer-state module: between the optimizer's view (state per ``FlatParameter``
shard) and the user's (state per original parameter, keyed by its name).

[Note: optimizer state per original parameter] The optimizer steps on each unit's
``FlatParameter`` shard, so its state tensors (Adam's ``exp_avg``, ...) are flat and sharded
like the parameter: *positional* state. Zero-dim tensors (``step``) and other values are the
same for every element: *scalar* state. Unflattening gathers each positional tensor of one
unit (an all-gather of the shards), splits it along the unit's layout into tensors shaped like
the original parameters and gives each of them a copy of the scalar state; the result is what
a plain optimizer on the unwrapped model holds, keyed by parameter names, in the plain model's
parameter order. Flattening is the inverse: for this rank it copies, parameter by parameter,
the part of each positional value that its shard holds, so a full value never has to be
gathered. Units are converted one at a time, so beyond the output no rank holds more than one
unit's full optimizer state.

A parameter without state (a plain optimizer creates none until a parameter has a gradient)
is zero-filled when another parameter of its ``FlatParameter`` has state. That is exact for
optimizers whose initial state is zero (Adam, AdamW, SGD with momentum, ...), which is what
flat training keeps for a parameter that never had a gradient; for others (Adagrad's
``initial_accumulator_value``, Rprop's step sizes) it is an approximation. Parameters of one
``FlatParameter`` must have the same state names, and scalar state -- the optimizer
parameter's, one value for the whole ``FlatParameter`` -- equal in value and dtype, or
flattening raises an error naming them and their values, as FSDP1 does. That refuses state
stepped apart: with ``use_orig_params`` a parameter frozen for some steps, or added to the
optimizer later, counts fewer steps than the others of its ``FlatParameter``, and no one count
is right for all of them (a model with ``use_orig_params`` loads it, per parameter). A
parameter never stepped (step counts of 0: a template, see [Note: optimizer state templates],
or Adagrad's state as built) takes the scalar state of those that were, like a parameter
without state; FSDP1 refuses both, flatshard keeps them loadable (a plain model's unused
parameter, a sharded dict's template entry) with the exactness said above.

[Note: optimizer state of original parameters] With ``use_orig_params`` the optimizer steps
the original parameters, each a piece of a shard, so its state is already per parameter:
each positional tensor is this rank's piece (1-D, possibly empty) of the parameter's full
state, scalar state is the parameter's own. Unflattening assembles the pieces of one handle
into one shard-shaped tensor per state name and gathers that (one collective per handle and
name, as in the flat case); flattening gives each parameter the piece of the saved value its
range of the shard holds. No state is shared between parameters, so nothing is zero-filled
and step counts may differ.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from ._checkpointing import agree_on_load, as_dtensor, full_value, named_units
from .._comm._collectives import all_gather_object, broadcast_object, first_difference
from .._comm._peer_failures import together
from .._base._common import clean_name, join_name
from ._optim_templates import STEP_NAMES, makes_state_when_built, never_stepped, template_state
from ._plain_view import plain_view
from .._engine._unit import Unit
from ..api import OptimStateKeyType
from .._flat._flat_param import FlatParameter, FlatParamHandle

__all__ = ["OptimStateIndex", "gather_optim_state", "flatten_optim_state", "scatter_optim_state", "optimizer_names", "rekey", "template_state"]

_SCALAR_NAMES = frozenset({"step", "mu_product", "eta", "mu"})  # torch optimizers' per-parameter scalars


class OptimStateIndex:
    """What the optimizer's parameters of ``model`` are: the handle and original parameter
    names of each ``FlatParameter``, the name of each plain (ignored) parameter, and the
    plain model's parameter order and shapes."""

    def __init__(self, model: nn.Module) -> None:
        named = named_units(model)
        if not named:
            raise ValueError(f"{type(model).__name__} contains no ShardedDataParallel module")
        self.root: Unit = named[0][1]
        self.units = [unit for _, unit in named]
        self.flat: Dict[int, Tuple[FlatParamHandle, Tuple[str, ...], Unit]] = {}
        # use_orig_params: each original parameter -> (its handle, its index there, its name).
        self.views: Dict[int, Tuple[FlatParamHandle, int, str]] = {}
        self.view_handles: List[Tuple[FlatParamHandle, Tuple[str, ...], Unit]] = []
        for path, unit in named:
            for handle in unit.handles:
                # (names recorded at wrapping hold wrappers that were inside the unit then)
                names = tuple(clean_name(join_name(path, info.name)) for info in handle.param_infos)
                self.flat[id(handle.flat_param)] = (handle, names, unit)
                if handle.orig is not None:
                    self.view_handles.append((handle, names, unit))
                    for i, param in enumerate(handle.orig.params):
                        self.views[id(param)] = (handle, i, names[i])
        self.plain: Dict[int, str] = {}
        for name, param in model.named_parameters():
            if not isinstance(param, FlatParameter) and id(param) not in self.views:
                self.plain[id(param)] = clean_name(name)
        handles = [h for unit in self.units for h in unit.handles]
        sinks = {h: [torch.empty(i.shape, dtype=h.dtype, device="meta") for i in h.param_infos] for h in handles}
        with plain_view(model, handles, sinks) as inner:
            named_params = list(inner.named_parameters())
        self.order = {name: i for i, (name, _) in enumerate(named_params)}
        self.shapes = {name: tuple(p.shape) for name, p in named_params}

    def names_of(self, param: torch.Tensor) -> Tuple[str, ...]:
        """The user-facing names of what ``param`` (an optimizer parameter) holds."""
        if id(param) in self.flat:
            return self.flat[id(param)][1]
        if id(param) in self.views:
            return (self.views[id(param)][2],)
        if id(param) in self.plain:
            return (self.plain[id(param)],)
        raise ValueError(
            f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not a parameter of the "
            f"model; build the optimizer from the ShardedDataParallel model's parameters()"
        )

    def sort(self, names: Iterable[str]) -> List[str]:
        return sorted(names, key=lambda n: self.order.get(n, len(self.order)))


def optimizer_groups(model: nn.Module, optim: Optional[torch.optim.Optimizer], optim_input: Any) -> List[List[torch.Tensor]]:
    """The optimizer's parameters, by group: from ``optim``, else ``optim_input`` (parameters
    or param-group dicts), else ``model.parameters()`` (see ``LoadTarget.from_model``)."""
    if optim is not None:
        return [list(group["params"]) for group in optim.param_groups]
    if optim_input is None:
        return [list(model.parameters())]
    items = list(optim_input)
    if items and isinstance(items[0], dict):
        return [list(group["params"]) for group in items]
    return [items]


class LoadTarget:
    """The optimizer a state dict is flattened for: its parameters by group, and the optimizer
    itself when the caller gave it.

    Without ``optim`` or ``optim_input`` the parameters are guessed from the model (FSDP1's
    rule); then a frozen parameter that none of the saved param groups names is left out, since
    an optimizer built from the trainable parameters only (the usual way) never held it.
    """

    def __init__(self, model: nn.Module, optim: Optional[torch.optim.Optimizer], optim_input: Any = None, base_rates: bool = False) -> None:
        self.groups = optimizer_groups(model, optim, optim_input)
        self.optim = optim
        self.from_model = optim is None and optim_input is None
        # The param groups whose base rates loaded groups without ``initial_lr`` get
        # (``optim_state_dict_to_load``: see [Note: initial_lr in param groups]); else none.
        self.base_groups: List[Dict[str, Any]] = optim.param_groups if base_rates and optim is not None else []
        self.builds_state = optim is not None and makes_state_when_built(optim)

    def loads_unstepped(self, param: torch.Tensor) -> bool:
        """Whether a never-stepped entry (a template, see [Note: optimizer state templates]) is
        loaded for ``param`` rather than leaving it without state, as it was when saved: where
        the optimizer makes state when it is built (Adagrad) and holds some for ``param``. An
        optimizer that makes state at its first step (Adam) gets none, also where it has
        stepped since the save, as torch's ``load_state_dict`` of a fresh optimizer's state
        dict leaves it."""
        return self.builds_state and self.optim is not None and bool(self.optim.state.get(param))

    def groups_for(self, index: "OptimStateIndex", osd: Mapping[str, Any]) -> List[List[torch.Tensor]]:
        if not self.from_model:
            return self.groups
        saved = {name for group in osd["param_groups"] for name in group["params"]}
        return [[p for p in group if p.requires_grad or any(n in saved for n in index.names_of(p))] for group in self.groups]


# -- unflattening (optimizer -> per original parameter) ------------------------------------


def _kind(key: str, value: Any, shape: Tuple[int, ...]) -> str:
    """``positional`` (shaped like the parameter), ``scalar`` (shared by all its elements)."""
    if not isinstance(value, torch.Tensor):
        return "scalar"
    if value.dim() == 0 and (len(shape) > 0 or key in STEP_NAMES):
        return "scalar"
    return "positional"


def _copy(value: Any, offload: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True) if offload else value.detach().clone()
    return copy.deepcopy(value)


def _unflatten(
    handle: FlatParamHandle, names: Sequence[str], unit: Unit, flat_state: Mapping[str, Any], keep: bool, offload: bool, sharded: bool
) -> Dict[str, Dict[str, Any]]:
    """One ``FlatParameter``'s state as per-parameter state (see [Note: optimizer state per
    original parameter]); collective when sharded. ``keep=False``: gather, keep nothing."""
    out: Dict[str, Dict[str, Any]] = {name: {} for name in names}
    for key, value in flat_state.items():
        if _kind(key, value, tuple(handle.flat_param.shape)) == "scalar":
            for name in names:
                out[name][key] = _copy(value, offload) if keep else None
            continue
        if tuple(value.shape) != tuple(handle.flat_param.shape):
            raise ValueError(
                f"optimizer state '{key}' of the FlatParameter of unit '{unit.name}' has shape "
                f"{tuple(value.shape)}; positional state must be shaped like the parameter, {tuple(handle.flat_param.shape)}"
            )
        full = handle.gather_padded(value)
        if not keep:
            continue
        for name, part in zip(names, handle.split_full(full)):
            if sharded:
                out[name][key] = as_dtensor(part, unit, offload)
            else:
                out[name][key] = _copy(part, offload)
    return out


def _unflatten_views(
    handle: FlatParamHandle,
    names: Sequence[str],
    unit: Unit,
    states: Sequence[Optional[Mapping[str, Any]]],
    keep: bool,
    offload: bool,
    sharded: bool,
) -> Dict[str, Dict[str, Any]]:
    """The state of a handle's original parameters (``states``, one per parameter, ``None``
    without) with full positional values; see [Note: optimizer state of original parameters]."""
    out: Dict[str, Dict[str, Any]] = {name: {} for name, s in zip(names, states) if s}
    keys = list(dict.fromkeys(key for s in states if s for key in s))
    for key in keys:
        having = [(i, s[key]) for i, s in enumerate(states) if s and key in s]
        i0, v0 = having[0]
        if _kind(key, v0, tuple(handle.param_infos[i0].shape)) == "scalar":
            for i, value in having:
                out[names[i]][key] = _copy(value, offload) if keep else None
            continue
        shard = torch.zeros(handle.flat_param.shape, dtype=v0.dtype, device=handle.device)
        for held in handle.shard_param_infos:
            value = states[held.index][key] if states[held.index] and key in states[held.index] else None  # type: ignore[index]
            if value is not None:
                shard[held.shard_offset : held.shard_offset + held.numel].copy_(value.detach().reshape(-1))
        full = handle.gather_padded(shard)
        if not keep:
            continue
        parts = handle.split_full(full)
        for i, _ in having:
            out[names[i]][key] = as_dtensor(parts[i], unit, offload) if sharded else _copy(parts[i], offload)
    return out


def _piece(handle: FlatParamHandle, index: int, full: torch.Tensor) -> torch.Tensor:
    """The part of original parameter ``index``'s full value (e.g. a state tensor) that this
    rank's shard holds, shaped like the parameter (see [Note: original parameters])."""
    flat = full.detach().reshape(-1).to(handle.flat_param.device)
    if not handle.sharded:
        return flat.clone().view(handle.param_infos[index].shape)
    for held in handle.shard_param_infos:
        if held.index == index:
            return flat[held.param_offset : held.param_offset + held.numel].clone()
    return flat[:0].clone()


def _with_state_of_parameters_not_held(
    index: OptimStateIndex, params: Sequence[torch.Tensor], states: Sequence[Optional[Mapping[str, Any]]]
) -> List[Optional[Mapping[str, Any]]]:
    """[Note: state of parameters a rank does not hold] With ``use_orig_params`` a parameter
    with no part in this rank's shard gets no gradient (as in FSDP1), so this rank's optimizer
    does not step it: it has no state for it, or (after loading) state that no step updates.
    The ranks that hold parts of it have its true state. So before the ranks compare and gather
    their states, such a parameter gets here the state a rank holding it has: empty positional
    tensors and that rank's scalar state (step counts; the holders step it alike), or none if
    they have none. Loading (``flatten_optim_state``) gives such a parameter no state, as
    training does. Collective: an object all-gather of the names concerned, and one of their
    state layouts if there are any."""
    not_held = {index.names_of(p)[0] for p in params if id(p) in index.views and p.numel() == 0}
    wanted = set().union(*all_gather_object(sorted(not_held), index.root.comm))
    if not wanted:
        return list(states)
    mine: Dict[str, List[Tuple[str, bool, Any]]] = {}
    for p, state in zip(params, states):
        name = index.names_of(p)[0] if id(p) in index.views else None
        if state and name in wanted and name not in not_held:
            kinds = [(key, value, _kind(key, value, (1,)) == "scalar") for key, value in state.items()]
            mine[name] = [(key, scalar, value if scalar else value.dtype) for key, value, scalar in kinds]
    layouts: Dict[str, List[Tuple[str, bool, Any]]] = {}
    for theirs in all_gather_object(mine, index.root.comm):
        for name, layout in theirs.items():
            layouts.setdefault(name, layout)
    filled = list(states)
    for i, p in enumerate(params):
        if id(p) in index.views and p.numel() == 0:
            layout = layouts.get(index.names_of(p)[0])
            filled[i] = None if layout is None else {
                key: value if scalar else torch.empty(0, dtype=value, device=p.device) for key, scalar, value in layout
            }
    return filled


def _check_layouts_agree(index: OptimStateIndex, params: Sequence[torch.Tensor], states: Sequence[Optional[Mapping[str, Any]]]) -> None:
    """The ranks must hold state for the same FlatParameters under the same names before
    gathering it (one collective; see [Note: load agreement] in ``_checkpointing``)."""
    mine = []
    for param, state in zip(params, states):
        if id(param) in index.flat or id(param) in index.views:
            keys = sorted((state or {}).keys())
            mine.append(f"{index.names_of(param)[0]}: {', '.join(keys) if state else 'no state'}")
    root = index.root
    difference = first_difference(mine, root.comm, root.device)
    if difference is not None:
        raise together(RuntimeError(
            f"[rank {root.rank}] the ranks' optimizers hold different state (every rank must step the same "
            f"parameters): rank 0 has [{difference.reference}], rank {difference.rank} has [{difference.theirs}]"
        ))


# [Note: initial_lr in param groups] An LR scheduler records each group's base rate as
# ``initial_lr``; one built after a resume takes it from the loaded groups, or, without one, the
# current -- loaded, already decayed -- ``lr``, and silently restarts its schedule from there.
# A resume that loads into a template (``optim_state_dict`` of the fresh optimizer, filled by
# ``torch.distributed.checkpoint``) loads only the keys the template has, and a fresh optimizer
# has no ``initial_lr`` until a scheduler is built on it. Adding the key to the templates would
# make ``torch.distributed.checkpoint`` refuse every checkpoint saved without a scheduler
# ("Missing key"), as torch's own state-dict functions and FSDP1 write them. So the loader
# fills it instead: a loaded group without ``initial_lr`` whose ``lr`` differs from the live
# group's base rate -- its ``initial_lr``, or, without a scheduler, its ``lr`` as the optimizer
# was built: the rate the run was configured with, which the original run's scheduler recorded
# too -- gets that base rate. (Where the rates agree a scheduler built later records the same
# value anyway, and the loaded state stays exactly what was saved.) Only
# ``optim_state_dict_to_load`` does this, the loader a template's contents go to; the full-dict
# loaders give back what they were given.


def gather_optim_state(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    source: Optional[Mapping[str, Any]],
    rank0_only: bool,
    offload: bool,
    sharded: bool,
) -> Dict[str, Any]:
    """The optimizer's state per original parameter, keyed by name: full tensors (on rank 0
    only with ``rank0_only``; ``{}`` elsewhere) or, ``sharded``, ``DTensor`` parts. ``source``:
    a state dict of ``optim`` to use instead of ``optim.state_dict()``."""
    index = OptimStateIndex(model)
    source = optim.state_dict() if source is None else source
    params = [p for group in optimizer_groups(model, optim, None) for p in group]
    states = [source["state"].get(i) for i in range(len(params))]
    states = _with_state_of_parameters_not_held(index, params, states)
    _check_layouts_agree(index, params, states)
    keep = not rank0_only or index.root.rank == 0
    state: Dict[str, Dict[str, Any]] = {}
    by_param = {id(p): s for p, s in zip(params, states) if s}
    for handle, names, unit in index.view_handles:  # (the same order on every rank)
        states_here = [by_param.get(id(p)) for p in handle.orig.params]  # type: ignore[union-attr]
        if any(states_here):
            state.update(_unflatten_views(handle, names, unit, states_here, keep, offload, sharded))
    for param, flat_state in zip(params, states):
        names = index.names_of(param)
        if not flat_state or id(param) in index.views:
            continue
        if id(param) in index.flat:
            handle, _, unit = index.flat[id(param)]
            state.update(_unflatten(handle, names, unit, flat_state, keep, offload, sharded))
        elif keep:
            state[names[0]] = {key: _copy(value, offload) for key, value in flat_state.items()}
    if not keep:
        return {}
    groups = []
    for group, saved in zip(optimizer_groups(model, optim, None), source["param_groups"]):
        names = [name for p in group for name in index.names_of(p)]
        groups.append({**{k: copy.deepcopy(v) for k, v in saved.items() if k != "params"}, "params": index.sort(names)})
    # Ordered as a plain optimizer whose groups list the parameters in model order.
    ordered = [name for group in groups for name in group["params"] if name in state]
    return {"state": {name: state[name] for name in ordered}, "param_groups": groups}


# -- flattening (per original parameter -> optimizer) --------------------------------------


def _check_state_dict(osd: Any, what: str) -> None:
    if not isinstance(osd, Mapping) or "state" not in osd or "param_groups" not in osd:
        raise ValueError(f"{what}: expected an optimizer state dict with 'state' and 'param_groups'; got {type(osd).__name__}")


def _check_names(index: OptimStateIndex, osd: Mapping[str, Any]) -> Dict[str, int]:
    """The saved group of each parameter name; an error for names the model does not have."""
    unknown = [name for name in osd["state"] if name not in index.order]
    group_of: Dict[str, int] = {}
    for number, group in enumerate(osd["param_groups"]):
        for name in group["params"]:
            if name not in index.order:
                unknown.append(name)
            group_of[name] = number
    if unknown:
        listed = ", ".join(repr(n) for n in dict.fromkeys(unknown))
        raise ValueError(f"the optimizer state dict has state for parameters the model does not have: {listed}")
    return group_of


def _entry_plan(
    names: Sequence[str], shapes: Mapping[str, Tuple[int, ...]], state: Mapping[str, Any], owner: str
) -> Optional[List[Tuple[str, str, Any]]]:
    """How to build one optimizer parameter's state from the per-parameter ``state``:
    ``[(key, kind, dtype or the scalar value)]``, or ``None`` if none of ``names`` has state.
    ``owner``: the optimizer parameter as messages name it."""
    present = [n for n in names if state.get(n)]
    if not present:
        return None
    first = present[0]
    keys = list(state[first])
    plan = []
    for name in present[1:]:
        if set(state[name]) != set(keys):
            raise ValueError(
                f"parameters '{first}' and '{name}' share a FlatParameter but have different optimizer states: "
                f"{sorted(keys)} vs {sorted(state[name])}"
            )
    # Never-stepped entries count as no state for the scalar state (see [Note: optimizer
    # state per original parameter]), unless no parameter was stepped.
    stepped = [n for n in present if not never_stepped((n,), state)] or present
    # A parameter with dimensions tells per-element from scalar state (a 0-dim parameter's
    # per-element state is 0-dim too); if there is none, scalar state is known by name.
    shaped = next((n for n in present if len(shapes[n]) > 0), None)
    for key in keys:
        if shaped is not None:
            kind = _kind(key, state[shaped][key], shapes[shaped])
        else:
            kind = "scalar" if key in _SCALAR_NAMES or not isinstance(state[first][key], torch.Tensor) else "positional"
        if kind == "scalar":
            plan.append((key, kind, _scalar_value(key, [(name, state[name][key]) for name in stepped], owner)))
            continue
        for name in present:
            value = state[name][key]
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shapes[name]:
                got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"optimizer state '{key}' of parameter '{name}' has {got}; the parameter has shape {shapes[name]}")
        plan.append((key, kind, state[first][key].dtype))
    return plan


def _scalar_value(key: str, values: Sequence[Tuple[str, Any]], owner: str) -> Any:
    """The one value of scalar state ``key`` (a step count, ...) of an optimizer parameter,
    from the values of the original parameters it holds, which must all be equal, in value and
    dtype; else an error naming them and their values. (FSDP1 refuses the same: one
    optimizer parameter has one step count, so parameters stepped apart cannot share it.)"""
    first = values[0][1]
    if all(_equal(value, first) for _, value in values[1:]):
        return first
    alike: List[Tuple[Any, List[str]]] = []
    for name, value in values:
        same = next((names for held, names in alike if _equal(held, value)), None)
        if same is None:
            alike.append((value, [name]))
        else:
            same.append(name)
    parts = [f"{_listed(names)} {'has' if len(names) == 1 else 'have'} {_shown(value)}" for value, names in alike]
    raise ValueError(
        f"the original parameters of {owner} must have optimizer state '{key}' with the same value and dtype, "
        f"but {', '.join(parts[:-1])} and {parts[-1]}; without use_orig_params the optimizer steps them as one "
        f"parameter (load this state into a model wrapped with use_orig_params=True to keep them apart)"
    )


def _listed(names: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names)} in all)"


def _shown(value: Any) -> str:
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return f"{value.item()!r} ({value.dtype})"
    return f"{value!r} ({type(value).__name__})"


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
    return type(a) is type(b) and a == b


def _shard_of(handle: FlatParamHandle, names: Sequence[str], key: str, dtype: torch.dtype, state: Mapping[str, Any]) -> torch.Tensor:
    """This rank's part of positional state ``key`` of a FlatParameter, from per-parameter
    values (zeros where a parameter has none)."""
    shard = torch.zeros(handle.flat_param.shape, dtype=dtype, device=handle.device)
    values = {}
    for name in names:
        if state.get(name):
            values[name] = full_value(state[name][key], handle.comm).detach().reshape(-1)  # (collective for DTensors)
    for held in handle.shard_param_infos:
        value = values.get(names[held.index])
        if value is not None:
            shard[held.shard_offset : held.shard_offset + held.numel].copy_(value[held.param_offset : held.param_offset + held.numel])
    return shard


def _new_groups(
    index: OptimStateIndex, groups: Sequence[Sequence[torch.Tensor]], osd: Mapping[str, Any], group_of: Mapping[str, int], live: Sequence[Mapping[str, Any]]
) -> List[Dict[str, Any]]:
    """The optimizer's param groups with the saved hyperparameters and parameter IDs (and, where
    the saved ones have no ``initial_lr``, the live groups' base rate)."""
    if len(groups) != len(osd["param_groups"]):
        raise ValueError(f"the optimizer has {len(groups)} param groups but the state dict has {len(osd['param_groups'])}")
    out = []
    next_id = 0
    for number, group in enumerate(groups):
        saved = None
        for param in group:
            for name in index.names_of(param):
                where = group_of.get(name)
                if where is None:
                    raise ValueError(f"parameter '{name}' is in the optimizer but in none of the state dict's param groups")
                if saved is not None and where != saved:
                    raise ValueError(
                        f"param group {number} of the optimizer holds parameters of the state dict's groups {saved} "
                        f"and {where} (e.g. '{name}'); parameters of one FlatParameter or optimizer group must share a group"
                    )
                saved = where
        hyper = {k: copy.deepcopy(v) for k, v in osd["param_groups"][saved if saved is not None else number].items() if k != "params"}
        if number < len(live) and "lr" in hyper and "initial_lr" not in hyper:  # see [Note: initial_lr in param groups]
            base = live[number].get("initial_lr", live[number].get("lr"))
            if base is not None and not _same_value(base, hyper["lr"]):
                hyper["initial_lr"] = copy.deepcopy(base)
        out.append({**hyper, "params": list(range(next_id, next_id + len(group)))})
        next_id += len(group)
    return out


def _same_value(a: Any, b: Any) -> bool:
    """Equality of two hyperparameters, tensors (a fused optimizer's ``lr``) included."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)


def _describe(osd: Mapping[str, Any]) -> Dict[str, Any]:
    return {f"{name}.{key}": value for name, state in osd["state"].items() for key, value in state.items()}


def _plans(index: OptimStateIndex, target: LoadTarget, osd: Mapping[str, Any]) -> Tuple[List[List[torch.Tensor]], List[Dict[str, Any]], List[Any]]:
    """(the optimizer's parameters by group, its new param groups, each parameter's entry plan),
    after checking ``osd`` against the model."""
    groups = target.groups_for(index, osd)
    group_of = _check_names(index, osd)
    new_groups = _new_groups(index, groups, osd, group_of, target.base_groups)
    plans = []
    for param in (p for g in groups for p in g):
        names = index.names_of(param)
        fresh = never_stepped(names, osd["state"]) and not target.loads_unstepped(param)
        plans.append(None if fresh else _entry_plan(names, index.shapes, osd["state"], _owner(index, param)))
    return groups, new_groups, plans


def _planned_where_any_rank_plans(index: OptimStateIndex, osd: Mapping[str, Any], groups: Sequence[Sequence[torch.Tensor]], plans: List[Any]) -> List[Any]:
    """``plans``, with an entry planned on every rank where any rank planned one.

    [Note: skipped entries agree] A saved entry that was never stepped (a template) is loaded
    only where ``LoadTarget.loads_unstepped`` says so, which reads the optimizer's state for
    the parameter, and that can differ between ranks: under ``use_orig_params`` a parameter
    none of whose elements are in a rank's shard gets no gradient, and so no state, on that
    rank only (it matters for an optimizer that makes state when built, or whose class could
    not be probed). Loading an entry of ``DTensor`` values gathers them (a collective), so the
    ranks agree first -- one all-reduce (max) of a flag per parameter -- and load it everywhere
    if any rank loads it (a template in place of no state is the same first step: see
    [Note: optimizer state templates])."""
    root = index.root
    if root.world_size == 1:
        return plans
    params = [p for g in groups for p in g]
    wanted = torch.tensor([plan is not None for plan in plans], dtype=torch.int32, device=root.device)
    root.comm.all_reduce(wanted, op="max")
    return [
        plan if plan is not None or not want else _entry_plan(index.names_of(p), index.shapes, osd["state"], _owner(index, p))
        for p, plan, want in zip(params, plans, wanted.tolist())
    ]


def _owner(index: OptimStateIndex, param: torch.Tensor) -> str:
    if id(param) in index.flat:
        unit = index.flat[id(param)][2]
        which = "the FlatParameter" if len(unit.handles) == 1 else "a FlatParameter"  # (names tell which)
        return f"{which} of unit '{unit.name}'" if unit.name else f"{which} of the root module"
    return f"parameter '{index.names_of(param)[0]}'"


def flatten_optim_state(model: nn.Module, osd: Mapping[str, Any], target: LoadTarget, what: str, collective: bool) -> Dict[str, Any]:
    """A name-keyed optimizer state dict (full tensors or ``DTensor``s) as the state dict of
    ``target``'s optimizer, for this rank (keyed by parameter ID). ``collective``: the ranks
    check they were given the same structure first (needed for ``DTensor`` values)."""
    index = OptimStateIndex(model)
    error: Optional[BaseException] = None
    groups: List[List[torch.Tensor]] = []
    plans: List[Any] = []
    try:
        _check_state_dict(osd, what)
        groups, new_groups, plans = _plans(index, target, osd)
    except Exception as exc:  # noqa: BLE001 - malformed input: raised on every rank below, not a hang
        error = exc
    if collective:
        agree_on_load(index.root, _describe(osd) if error is None else {}, error, what)
        plans = _planned_where_any_rank_plans(index, osd, groups, plans)
    elif error is not None:
        raise error
    state: Dict[int, Dict[str, Any]] = {}
    for pid, (param, plan) in enumerate(zip((p for g in groups for p in g), plans)):
        if plan is None:
            continue
        names = index.names_of(param)
        if id(param) in index.views:
            handle, number, _ = index.views[id(param)]
            comm = handle.comm
            entry = {
                key: _copy(extra, False) if kind == "scalar" else _piece(handle, number, full_value(osd["state"][names[0]][key], comm)).to(extra)
                for key, kind, extra in plan
            }
            if param.numel() > 0:  # (see [Note: state of parameters a rank does not hold])
                state[pid] = entry
        elif id(param) in index.flat:
            handle = index.flat[id(param)][0]
            state[pid] = {
                key: _copy(extra, False) if kind == "scalar" else _shard_of(handle, names, key, extra, osd["state"])
                for key, kind, extra in plan
            }
        else:
            comm = index.root.comm
            state[pid] = {key: _copy(full_value(v, comm), False) for key, v in osd["state"][names[0]].items()}
    return {"state": state, "param_groups": new_groups}


def scatter_optim_state(model: nn.Module, osd: Optional[Mapping[str, Any]], target: LoadTarget, what: str) -> Dict[str, Any]:
    """``flatten_optim_state`` where only the first rank has ``osd``: it sends each rank its
    part, one FlatParameter state tensor at a time."""
    index = OptimStateIndex(model)
    root = index.root
    everything = [p for g in target.groups for p in g]
    skeleton: Any = None
    if root.rank == 0:
        try:
            _check_state_dict(osd, what)
            groups, new_groups, plans = _plans(index, target, osd)  # type: ignore[arg-type]
            kept = {id(p) for g in groups for p in g}
            skeleton = ("ok", new_groups, plans, [i for i, p in enumerate(everything) if id(p) in kept])
        except Exception as exc:  # noqa: BLE001 - malformed input: every rank raises, none waits
            skeleton = ("error", f"{type(exc).__name__}: {exc}", None, None)
    skeleton = broadcast_object(skeleton, root.comm)
    if skeleton[0] == "error":  # (rank 0's error, on every rank at once)
        raise together(ValueError(f"[rank {root.rank}] {what}: {skeleton[1]}"))
    _, new_groups, plans, kept_positions = skeleton
    params = [everything[i] for i in kept_positions]
    state: Dict[int, Dict[str, Any]] = {}
    for pid, (param, plan) in enumerate(zip(params, plans)):
        if plan is None:
            continue
        names = index.names_of(param)
        entry: Dict[str, Any] = {}
        for key, kind, extra in plan:
            if kind == "scalar":
                entry[key] = _copy(extra, False)
            elif id(param) in index.flat:
                entry[key] = _scatter_flat(index.flat[id(param)][0], names, key, extra, osd)
            elif id(param) in index.views:
                handle, number, name = index.views[id(param)]
                shape = index.shapes[name]
                value = osd["state"][name][key].to(handle.device) if root.rank == 0 else torch.empty(shape, dtype=extra, device=handle.device)  # type: ignore[index]
                root.comm.broadcast_from_first(value)
                entry[key] = _piece(handle, number, value)
            else:
                value = osd["state"][names[0]][key].to(param.device) if root.rank == 0 else torch.empty(param.shape, dtype=extra, device=param.device)  # type: ignore[index]
                root.comm.broadcast_from_first(value)
                entry[key] = value
        if id(param) not in index.views or param.numel() > 0:  # (see [Note: state of parameters a rank does not hold])
            state[pid] = entry
    return {"state": state, "param_groups": new_groups}


def _scatter_flat(handle: FlatParamHandle, names: Sequence[str], key: str, dtype: torch.dtype, osd: Optional[Mapping[str, Any]]) -> torch.Tensor:
    full = torch.zeros(handle.padded_numel, dtype=dtype, device=handle.device)
    if handle.rank == 0:
        for info, name in zip(handle.param_infos, names):
            value = osd["state"].get(name)  # type: ignore[index]
            if value:
                full[info.offset : info.offset + info.numel].copy_(value[key].reshape(-1))
    handle.comm.broadcast_from_first(full)
    if not handle.sharded:
        return full
    start = handle.rank * handle.shard_numel
    return full[start : start + handle.shard_numel].clone()


# -- keys ----------------------------------------------------------------------------------


def optimizer_names(model: nn.Module, groups: Sequence[Sequence[torch.Tensor]]) -> List[str]:
    """The names of the original parameters an optimizer over ``groups`` steps, in its order
    (without the prefixes of wrappers such as activation checkpointing's).

    [Note: parameter IDs of a wrapped model] FSDP1's ``rekey_optim_state_dict`` takes a wrapped
    model (Lightning passes one): a parameter's ID is its position in the optimizer's order.
    With ``use_orig_params`` the optimizer holds the original parameters, so that is FSDP1's
    rule as it is. Otherwise it holds FlatParameters, where FSDP1 raises as soon as one holds
    more than one parameter; here each stands for its original parameters, and a param group
    holding FlatParameters lists them in the plain model's order (a root unit's parameters come
    first in flattening order, but not in the model), so the IDs are those of a plain optimizer
    built from the same parameters, whatever ``use_orig_params`` was."""
    if named_units(model):
        index = OptimStateIndex(model)
        names: List[str] = []
        for group in groups:
            expanded = [name for param in group for name in index.names_of(param)]
            flat = any(isinstance(param, FlatParameter) for param in group)
            names.extend(index.sort(expanded) if flat else expanded)
        return names
    name_of = {id(p): clean_name(name) for name, p in model.named_parameters()}  # (checkpoint / compile wrappers)
    ordered = [p for g in groups for p in g]
    for pid, param in enumerate(ordered):
        if id(param) not in name_of:
            raise ValueError(f"rekey_optim_state_dict: optimizer parameter #{pid} (shape {tuple(param.shape)}) is not a parameter of the model")
    return [name_of[id(param)] for param in ordered]


def rekey(osd: Mapping[str, Any], key_type: OptimStateKeyType, names: Sequence[str]) -> Dict[str, Any]:
    """``osd`` keyed by parameter names (``PARAM_NAME``) or IDs (``PARAM_ID``: positions in
    ``names``, the optimizer's order from ``optimizer_names``)."""
    _check_state_dict(osd, "rekey_optim_state_dict")
    id_to_name = dict(enumerate(names))
    name_to_id = {name: pid for pid, name in id_to_name.items()}
    table = name_to_id if key_type is OptimStateKeyType.PARAM_ID else id_to_name

    def convert(key: Any) -> Any:
        if key in table:
            return table[key]
        if key in (id_to_name if key_type is OptimStateKeyType.PARAM_ID else name_to_id):
            return key  # keyed that way already
        raise ValueError(f"rekey_optim_state_dict: the state dict names a parameter the model's optimizer does not have: {key!r}")

    state = {convert(k): v for k, v in osd["state"].items()}
    groups_out = []
    for group in osd["param_groups"]:
        keys = [convert(k) for k in group["params"]]
        if key_type is OptimStateKeyType.PARAM_ID:
            keys = sorted(keys)
        groups_out.append({**group, "params": keys})
    return {"state": state, "param_groups": groups_out}
