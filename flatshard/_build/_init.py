"""Construction of one unit: check the options, find the parameters the unit owns, check
them, pick the device, and flatten.

By default a unit owns every parameter in its module's tree that no nested wrapper (built
before it) owns and that is not ignored; a plan (auto-wrapping) may assign them explicitly.
Errors name parameters and modules relative to the module being wrapped.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

import torch.distributed as dist

from .._comm._collectives import (
    Communicator,
    ProcessGroup,
    backend_of,
    default_group,
    first_difference,
    object_device,
    size_of,
    require_initialized,
)
from .._comm._guard import Guard, make_guard
from .._comm._peer_failures import together
from .._base._common import FLAT_PARAM, coerce_config, coerce_enum, describe_module, display_name, join_name
from .._base._errors import ArgumentTypeError
from ._materialize import has_meta, materialize, retie
from .._base._options import ConstructionOptions
from .._engine._unit import Unit, UnitConfig, unit_of
from ..api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from .._flat._flat_param import FlatParameter, FlatParamHandle, OrigParam, Precision

_Buffers = List[Tuple[str, nn.Module, str, torch.Tensor]]  # (name, module, attribute, buffer)


def construction_guard(options: ConstructionOptions) -> Guard:
    """The guard of one constructor call ([Note: one guarded path] in ``_comm/_guard``): over the
    groups the options name (both of a hybrid pair, a mesh's), else the default group. The root
    it builds keeps it. Options that name no usable group get the default group's (or none,
    without a default group), so that their error is raised inside the call, on every rank."""
    try:
        groups = _groups_named(options)
    except Exception:  # noqa: BLE001 - reported by build_unit, inside the call
        groups = []
    if not groups and dist.is_available() and dist.is_initialized():
        groups = [default_group()]
    comms = [Communicator(g) for g in groups]
    return make_guard(comms, object_device(groups[0]) if groups else torch.device("cpu"))


def _groups_named(options: ConstructionOptions) -> List[ProcessGroup]:
    mesh, group = options.device_mesh, options.process_group
    if mesh is not None:
        return [mesh.get_group(d) for d in range(mesh.ndim)][::-1]
    if isinstance(group, (tuple, list)):
        return [g for g in group if isinstance(g, dist.ProcessGroup)]
    return [group] if isinstance(group, dist.ProcessGroup) else []


def build_unit(
    module: nn.Module,
    options: ConstructionOptions,
    owned: Optional[List[OrigParam]] = None,
    name: str = "",
    guard: Optional[Guard] = None,
) -> Unit:
    """Check ``options`` (the wrapper's constructor arguments) and flatten ``module``'s
    parameters into a new unit. ``owned``: the
    registrations this unit flattens, if a plan decided them (tied parameters placed in the
    lowest unit containing all their users); by default every parameter in ``module``'s tree
    outside nested units and ignored states. ``name``: the unit's path in a plan, for errors.
    ``guard``: the constructor's call's (see ``construction_guard``)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module; got {type(module).__name__}")
    if unit_of(module) is not None:
        raise ValueError(
            f"module is already a {type(module).__name__} (of {type(module.module).__name__}); "
            f"wrap each module once"
        )
    if options.auto_wrap_policy is not None:
        raise AssertionError("auto_wrap_policy must be planned before building a unit")
    config = check_options(options)
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward:
        # (FSDP1's words, which code written for it matches)
        warnings.warn(
            f"FSDP will not all-gather parameters for containers that do not implement forward: a "
            f"{type(module).__name__} is never called, so its unit's parameters are never gathered for "
            f"compute; wrap the modules inside it instead",
            stacklevel=4,
        )
    if options.process_group is None and options.device_mesh is None:
        require_initialized()  # (an explicit group is all a unit needs, as in FSDP1)
    group, replicate_group = _resolve_groups(config.sharding_strategy, options.process_group, options.device_mesh)
    ignored = resolve_ignored(module, options.ignored_modules, options.ignored_states)
    found, buffers, nested, modules = collect(module, ignored)
    _check_ignored_not_meta(ignored)
    params = found if owned is None else owned
    check_ties(params, nested, name)
    check_params(params, name)
    device = _resolve_device(options.device_id, params, buffers, nested, group)
    if has_meta(params, modules):
        params = materialize(params, modules, device, options.param_init_fn, name)
        buffers = [(b, m, attr, m._buffers[attr]) for b, m, attr, _ in buffers]
    else:  # a tie this unit owns may have been materialised by the inner units holding it
        params = retie(params, name)
    _move_buffers(device, buffers)
    if options.sync_module_states:
        _check_same_on_all_ranks(params, buffers, Communicator(group, guard), device, name)
        comms = ([Communicator(replicate_group, guard)] if replicate_group is not None else []) + [Communicator(group, guard)]
        for _, _, _, buf in buffers:
            for comm in comms:  # (hybrid: across the replicas, then within the shard group)
                comm.broadcast_from_first(buf)
    config = _one_rank_strategy(config, group)
    sharded = config.sharding_strategy is not ShardingStrategy.NO_SHARD
    if config.offload_params and not sharded and device.type != "cpu":
        raise NotImplementedError("cpu_offload=CPUOffload(offload_params=True) with sharding_strategy=NO_SHARD on a non-CPU device is not supported")
    config, precision = unit_precision(config, module)
    handles = [
        FlatParamHandle(
            members, module, device, group, sharded, _attr_name(i), options.sync_module_states, replicate_group,
            config.offload_params, precision, config.use_orig_params, guard,
        )
        for i, members in enumerate(group_params(params))
    ]
    _check_same_mode(config, nested, name)
    mesh = options.device_mesh
    unit = Unit(
        handles, config, group, device, replicate_group, _cast_buffers(config, buffers),
        mesh if mesh is not None and mesh.ndim == 1 else None, guard,
    )
    unit.adopt(nested)
    return unit


def _one_rank_strategy(config: UnitConfig, group: ProcessGroup) -> UnitConfig:
    """A group of one rank has nothing to shard: like FSDP1, the unit runs as ``NO_SHARD``
    and says so (hybrid strategies keep theirs: their replicas still average gradients;
    offloaded parameters too: offloading is a sharded unit's)."""
    strategy = config.sharding_strategy
    if size_of(group) != 1 or strategy is ShardingStrategy.NO_SHARD or strategy in HYBRID or config.offload_params:
        return config
    # (FSDP1's words, which code written for it matches)
    warnings.warn(f"FSDP is switching to use `NO_SHARD` instead of {strategy} since the world size is 1.", stacklevel=4)
    return dataclasses.replace(config, sharding_strategy=ShardingStrategy.NO_SHARD)


def _check_same_mode(config: UnitConfig, nested: Sequence[Tuple[str, Unit]], name: str) -> None:
    """Every unit of a model keeps original parameters or none does (an optimizer steps one
    kind of parameter; state dicts and optimizer state are converted one way)."""
    for inner_name, inner in nested:
        if inner.config.use_orig_params != config.use_orig_params:
            raise ValueError(
                f"use_orig_params must be the same for every unit of a model: the unit at "
                f"'{join_name(name, inner_name) or '(root)'}' was built with use_orig_params={inner.config.use_orig_params}, "
                f"the unit wrapping it{f' at {name!r}' if name else ''} with use_orig_params={config.use_orig_params}"
            )


def unit_precision(config: UnitConfig, module: nn.Module) -> Tuple[UnitConfig, Optional[Precision]]:
    """The unit's mixed precision: none for modules MixedPrecision keeps in full precision
    (BatchNorm), which compute in their parameters' dtype instead."""
    mp = config.mixed_precision
    if mp is None:
        return config, None
    dtypes = (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype)
    if any(d is not None for d in dtypes) and isinstance(module, tuple(mp._module_classes_to_ignore)):
        # (whichever dtype is given: FSDP1 applies none of them to such a module)
        return dataclasses.replace(config, full_precision=True), None
    if mp.param_dtype is None and mp.reduce_dtype is None:
        return config, None
    return config, Precision(mp.param_dtype, mp.reduce_dtype, mp.keep_low_precision_grads)


def _cast_buffers(config: UnitConfig, buffers: _Buffers) -> List[Tuple[nn.Module, str, torch.dtype]]:
    """Cast the unit's floating-point buffers to MixedPrecision.buffer_dtype, in place."""
    mp = config.mixed_precision
    if mp is None or mp.buffer_dtype is None or config.full_precision:
        return []
    cast = []
    for _, module, attr, _ in buffers:
        buf = module._buffers[attr]  # (as moved to the device)
        if buf is not None and buf.is_floating_point() and buf.dtype != mp.buffer_dtype:
            module._buffers[attr] = buf.to(mp.buffer_dtype)
            cast.append((module, attr, buf.dtype))
    return cast


def _attr_name(index: int) -> str:
    return FLAT_PARAM if index == 0 else f"{FLAT_PARAM}_{index}"


def group_params(params: List[OrigParam]) -> List[List[OrigParam]]:
    """One group per (dtype, requires_grad), in order of first appearance: each becomes one
    FlatParameter, so frozen parameters get no gradient and no reduction."""
    groups: Dict[Tuple[torch.dtype, bool], List[OrigParam]] = {}
    for p in params:
        groups.setdefault((p.param.dtype, p.param.requires_grad), []).append(p)
    return list(groups.values())


def _check_same_on_all_ranks(
    params: List[OrigParam], buffers: _Buffers, comm: Communicator, device: torch.device, prefix: str
) -> None:
    """Before broadcasting (``sync_module_states``): mismatched broadcasts would hang."""
    layout = [f"{join_name(prefix, p.name)} {tuple(p.param.shape)} {p.param.dtype}" for p in params]
    layout += [f"{join_name(prefix, name)} {tuple(b.shape)} {b.dtype}" for name, _, _, b in buffers]
    difference = first_difference(layout, comm, device)
    if difference is not None:
        raise together(ValueError(
            f"[rank {comm.rank}] sync_module_states: the ranks built different modules to wrap, so rank 0's "
            f"parameters and buffers cannot be broadcast: rank 0 has {difference.reference}, rank {difference.rank} "
            f"has {difference.theirs}"
        ))


# -- options ------------------------------------------------------------------------------

_LATER = "is not supported yet"


def check_options(o: ConstructionOptions) -> UnitConfig:
    """The unit's runtime options, after checking every constructor argument."""
    strategy = coerce_enum(o.sharding_strategy, ShardingStrategy, "sharding_strategy", allow_none=True)
    strategy = strategy or ShardingStrategy.FULL_SHARD
    _check_hybrid_groups(strategy, o.process_group, o.device_mesh)
    offload = coerce_config(o.cpu_offload, CPUOffload, "cpu_offload")
    offload_params = offload is not None and offload.offload_params
    if not isinstance(offload_params, bool):
        raise TypeError(f"cpu_offload.offload_params must be a bool; got {offload_params!r}")
    prefetch = coerce_enum(o.backward_prefetch, BackwardPrefetch, "backward_prefetch", allow_none=True)
    mp = coerce_config(o.mixed_precision, MixedPrecision, "mixed_precision")
    if mp is not None:
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            dtype = getattr(mp, field)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise TypeError(f"mixed_precision.{field} must be a floating-point torch.dtype or None; got {dtype!r}")
    if o.param_init_fn is not None and not callable(o.param_init_fn):
        raise ArgumentTypeError(f"param_init_fn must be callable; got {o.param_init_fn!r}")
    for name in ("sync_module_states", "forward_prefetch", "limit_all_gathers", "use_orig_params"):
        value = getattr(o, name)
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool; got {value!r}")
    return UnitConfig(strategy, prefetch, o.forward_prefetch, o.limit_all_gathers, offload_params, mp, use_orig_params=o.use_orig_params)


HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


def _check_hybrid_groups(strategy: ShardingStrategy, process_group: Any, device_mesh: Any) -> None:
    """Hybrid sharding needs two groups (a pair or a 2-D mesh); the others need one."""
    hybrid = strategy in HYBRID
    if device_mesh is not None:
        if process_group is not None:
            raise ValueError("pass either process_group or device_mesh, not both")
        if hybrid and device_mesh.ndim != 2:
            raise ValueError(
                f"sharding_strategy=ShardingStrategy.{strategy.name} needs a 2-D device_mesh (replicate, shard); "
                f"got a {device_mesh.ndim}-D one"
            )
        if not hybrid and device_mesh.ndim != 1:
            raise ValueError(
                f"a {device_mesh.ndim}-D device_mesh is for hybrid sharding (sharding_strategy=HYBRID_SHARD or "
                f"_HYBRID_SHARD_ZERO2); pass a 1-D mesh"
            )
    elif hybrid:
        # (none at all: the default groups per node, given by the constructor before building)
        if process_group is not None and not (isinstance(process_group, tuple) and len(process_group) == 2 and all(g is not None for g in process_group)):
            raise ValueError(
                f"sharding_strategy=ShardingStrategy.{strategy.name} needs process_group=(shard_group, "
                f"replicate_group) or a 2-D device_mesh (replicate, shard); got process_group={process_group!r}"
            )
    elif isinstance(process_group, tuple):
        raise ValueError(
            "process_group as a (shard_group, replicate_group) pair needs sharding_strategy=HYBRID_SHARD or "
            "_HYBRID_SHARD_ZERO2"
        )


def _resolve_groups(strategy: ShardingStrategy, process_group: Any, device_mesh: Any) -> Tuple[ProcessGroup, Optional[ProcessGroup]]:
    """(the group to shard over, the group of replicas to average over under hybrid sharding);
    the arguments are checked already (``_check_hybrid_groups``)."""
    hybrid = strategy in HYBRID
    if device_mesh is not None:
        return (device_mesh.get_group(1), device_mesh.get_group(0)) if hybrid else (device_mesh.get_group(), None)
    if hybrid:
        if process_group is None:
            raise AssertionError(f"hybrid sharding reached a unit without its groups (the constructor gives the default ones); strategy {strategy.name}")
        return process_group[0], process_group[1]
    return (process_group if process_group is not None else default_group()), None


# -- parameters ---------------------------------------------------------------------------


Ignored = Tuple[Dict[int, nn.Module], Dict[int, nn.Parameter]]


def resolve_ignored(module: nn.Module, ignored_modules: Any, ignored_states: Any) -> Ignored:
    """The ignored modules (with everything under them) and ignored parameters, by id: their
    states stay ordinary, unsharded and unreduced."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError("pass either ignored_modules or ignored_states, not both")
    items = list(ignored_modules if ignored_modules is not None else ignored_states or [])
    modules: Dict[int, nn.Module] = {}
    params: Dict[int, nn.Parameter] = {}
    for item in items:
        if isinstance(item, nn.Parameter) and ignored_states is not None:
            params[id(item)] = item
        elif unit_of(item) is not None:
            raise ValueError(f"ignored modules must not be {type(item).__name__} units; got one wrapping {type(item.module).__name__}")
        elif isinstance(item, nn.Module):
            if item is module:
                warnings.warn(
                    f"Trying to ignore the top-level module passed into the FSDP constructor itself will "
                    f"result in all parameters being ignored: the {type(module).__name__} being wrapped is "
                    f"in ignored_modules, so none of its parameters or buffers is sharded (its nested units still are)",
                    stacklevel=4,
                )
            modules.update((id(m), m) for m in item.modules())
            # also where another (managed) module shares them: they must stay whole
            params.update((id(p), p) for p in item.parameters())
        else:
            what = "ignored_states must hold nn.Parameters or nn.Modules" if ignored_states is not None else "ignored_modules must hold nn.Modules"
            raise ArgumentTypeError(f"{what}; got {type(item).__name__}")
    return modules, params


def _check_ignored_not_meta(ignored: Ignored) -> None:
    modules, params = ignored
    tensors = list(params.values()) + [t for m in modules.values() for t in list(m.parameters(False)) + list(m.buffers(False))]
    if any(t.is_meta for t in tensors):
        raise ValueError(
            "an ignored module or parameter is on the meta device; ignored states are not "
            "materialised, so build them on a real device"
        )


_Nested = List[Tuple[str, Unit]]
_Named = List[Tuple[str, nn.Module]]


def collect(module: nn.Module, ignored: Ignored) -> Tuple[List[OrigParam], _Buffers, _Nested, _Named]:
    """What ``module``'s tree has outside nested units and ignored states: parameter
    registrations, buffers and the modules themselves (named); plus every nested unit (any
    depth, named)."""
    ignored_modules, ignored_params = ignored
    params: List[OrigParam] = []
    buffers: _Buffers = []
    nested: _Nested = []
    modules: _Named = []
    seen: Set[int] = set()

    def visit(mod: nn.Module, prefix: str) -> None:
        if id(mod) in seen:
            return
        seen.add(id(mod))
        # (an ignored module's states stay ordinary, but units nested in it are still this
        # unit's, as FSDP1 keeps its wrappers out of the ignored set)
        if id(mod) not in ignored_modules:
            modules.append((prefix, mod))
            params.extend(
                OrigParam(join_name(prefix, attr), prefix, mod, attr, param)
                for attr, param in mod._parameters.items()
                if param is not None and id(param) not in ignored_params
            )
            buffers.extend((join_name(prefix, attr), mod, attr, buf) for attr, buf in mod._buffers.items() if buf is not None)
        for child_name, child in mod._modules.items():
            if child is None:
                continue
            child_prefix = join_name(prefix, child_name)
            child_unit = unit_of(child)
            if child_unit is not None:
                nested.append((child_prefix, child_unit))
                nested.extend((join_name(child_prefix, name), unit) for name, unit in child_unit.descendants)
            else:
                visit(child, child_prefix)

    visit(module, "")
    return params, buffers, nested, modules


def check_params(params: List[OrigParam], prefix: str = "") -> None:
    """What a unit cannot flatten (names are relative to the unit's module at ``prefix``)."""
    for p in params:
        name = join_name(prefix, p.name)
        if isinstance(p.param, FlatParameter):
            raise ValueError(
                f"{describe_module(join_name(prefix, p.module_name), p.module)} is already wrapped by "
                f"a ShardedDataParallel (it holds a FlatParameter); wrap each module once, and put "
                f"the wrapper in its parent's place (e.g. model.block = ShardedDataParallel(model.block))"
            )
        if p.param.numel() == 0:
            raise ValueError(
                f"parameter '{name}' has no elements. If it is tied to a parameter that another "
                f"ShardedDataParallel already flattened (which empties the original), wrap one module "
                f"that contains all of its users instead; zero-size parameters are not supported"
            )
        if not p.param.is_floating_point():
            raise TypeError(
                f"parameter '{name}' has dtype {p.param.dtype}; ShardedDataParallel shards "
                f"floating-point parameters only (register integer or boolean state as a buffer)"
            )


def check_ties(params: List[OrigParam], nested: List[Tuple[str, Unit]], prefix: str = "") -> None:
    """A parameter that a nested unit flattened must not be used outside it (the outer unit
    would flatten it again and the two copies would train apart)."""
    owner: Dict[int, Tuple[str, str]] = {}
    for unit_name, unit in nested:
        for handle in unit.handles:
            for param, name in handle.originals():
                owner[id(param)] = (join_name(prefix, unit_name), join_name(prefix, join_name(unit_name, name)))
    for p in params:
        hit = owner.get(id(p.param))
        if hit is not None:
            raise ValueError(
                f"parameter '{hit[1]}' is shared with '{join_name(prefix, p.name)}', but the nested unit "
                f"{display_name(hit[0])} already flattened it while module "
                f"{display_name(join_name(prefix, p.module_name))} outside that unit also uses it; do not "
                f"wrap {display_name(hit[0])} separately (or wrap a module that contains both users)"
            )


# -- device -------------------------------------------------------------------------------


def _as_device(device_id: Any) -> torch.device:
    if isinstance(device_id, (int, str, torch.device)) and not isinstance(device_id, bool):
        device = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device_id is {device_id!r} but CUDA is not available on this machine")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    raise TypeError(f"device_id must be an int, a torch.device or None; got {device_id!r}")


def _resolve_device(
    device_id: Any,
    params: List[OrigParam],
    buffers: _Buffers,
    nested: List[Tuple[str, Unit]],
    group: ProcessGroup,
) -> torch.device:
    """The compute device: ``device_id`` if given (parameters on the CPU move there), else
    the device the parameters are on."""
    placed = [(f"'{p.name}'", p.param.device) for p in params] + [(f"'{n}'", b.device) for n, _, _, b in buffers]
    if not params:  # all its parameters are in nested units: compute where they do
        placed += [(f"unit {display_name(n)}", unit.device) for n, unit in nested]
    placed = [(what, d) for what, d in placed if d.type not in ("cpu", "meta")]
    on_cpu = any(p.param.device.type == "cpu" for p in params)
    if device_id is not None:
        device = _as_device(device_id)
        wrong = [(what, d) for what, d in placed if d != device]
        if wrong:
            raise ValueError(f"device_id is {device} but {wrong[0][0]} is on {wrong[0][1]}; move the module to the CPU or to {device}")
    elif placed:
        device = placed[0][1]
        wrong = [(what, d) for what, d in placed if d != device]
        if wrong:
            raise ValueError(
                f"the module is spread over devices: {placed[0][0]} is on {device} but {wrong[0][0]} "
                f"is on {wrong[0][1]}; move it to one device or pass device_id"
            )
    elif "nccl" not in backend_of(group):
        device = torch.device("cpu")
    elif on_cpu:
        raise ValueError(
            "the module is on the CPU but the process group's backend is nccl, which "
            "communicates CUDA tensors only; pass device_id (e.g. torch.cuda.current_device())"
        )
    else:  # built on the meta device: materialise on this rank's GPU
        device = torch.device("cuda", torch.cuda.current_device())
    for name, unit in nested:
        if unit.device != device:
            raise ValueError(f"nested unit {display_name(name)} computes on {unit.device} but this unit on {device}")
    return device


def _move_buffers(device: torch.device, buffers: _Buffers) -> None:
    """Buffers stay on their modules, so they move here; parameters move as they are
    flattened onto ``device``."""
    for _, module, attr, buf in buffers:
        if buf.device != device:
            module._buffers[attr] = buf.to(device)
