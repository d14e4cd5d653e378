"""Run-time state of the units: one ``Unit`` per wrapper, one ``RootContext`` per root.

The root (the outermost wrapper) is known structurally: each wrapper adopts the units nested
in it when it is constructed. At the root's first forward the runtime (``_forward.lazy_init``)
binds all of them to one shared context -- a ``RootContext`` holding the per-root state, whose
subclass in ``_runtime`` does the work -- after ``check_same_units`` checked, with one
collective, that every rank built the same units.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from .._comm._collectives import CollectiveEvent, Communicator, ProcessGroup, all_ranks_agree, differences, gather_if_different, mesh_of
from .._comm._guard import Guard, make_guard
from .._comm._peer_failures import together
from .._base._common import TrainingState, copy_fields, display_name, guard_transition, rank_prefix
from .._base._errors import DivergedRanksError
from .._flat._exec_order import ExecOrder
from .._comm._host_checks import host_check_comm
from ..api import (
    BackwardPrefetch,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictSettings,
    StateDictType,
)
from .._flat._flat_param import FlatParamHandle


@dataclass(frozen=True)
class UnitConfig:
    """A unit's runtime options, as given to its constructor."""

    sharding_strategy: ShardingStrategy
    backward_prefetch: Optional[BackwardPrefetch]
    forward_prefetch: bool
    limit_all_gathers: bool
    offload_params: bool = False
    mixed_precision: Optional[MixedPrecision] = None
    # A module class MixedPrecision keeps in full precision (BatchNorm): the unit computes in
    # its parameters' dtype, casting its inputs to it and its outputs back.
    full_precision: bool = False
    # Original parameters stay registered, as views of the shards (see [Note: original
    # parameters] in ``_orig_params``).
    use_orig_params: bool = False

    def describe(self) -> str:
        prefetch = self.backward_prefetch.name if self.backward_prefetch else "None"
        return f"{self.sharding_strategy.name}, backward_prefetch={prefetch}, forward_prefetch={self.forward_prefetch}"


class BackwardState(Enum):
    """Whether a backward of the root is running (its end-of-backward callback is queued)."""

    IDLE = auto()
    CALLBACK_QUEUED = auto()


class Tracer(Protocol):
    """What a test's recorder implements to see a root's work (``Unit.set_trace``)."""

    def event(self, kind: str, label: str) -> None:
        """``kind`` (forward, gather, free, pre-backward, post-backward, reduce, reduced) of
        the unit or handle ``label``."""

    def collective(self, event: CollectiveEvent) -> None:
        """A collective issued by one of the root's units or handles."""


class Unit:
    """Run-time state of one wrapper: its handles (one per group of parameters sharing dtype
    and ``requires_grad``; none if it owns no parameters), its options, its training state,
    and the units around it."""

    def __init__(
        self,
        handles: Sequence[FlatParamHandle],
        config: UnitConfig,
        group: ProcessGroup,
        device: torch.device,
        replicate_group: Optional[ProcessGroup] = None,
        cast_buffers: Sequence[Tuple[Any, str, torch.dtype]] = (),
        device_mesh: Optional[Any] = None,
        guard: Optional[Guard] = None,
    ) -> None:
        self.handles = list(handles)
        self.config = config
        # The guard of this unit's calls while it is a root ([Note: one guarded path] in
        # ``_guard``): the one its constructor ran in, or made at its first call (``root_guard``).
        self.guard = guard
        self.comm = Communicator(group, guard)
        self.rank = self.comm.rank
        self.world_size = self.comm.world_size
        self.device = device
        self.name = ""  # user-facing module path from the root, set when an outer unit adopts it
        self.training_state = TrainingState.IDLE
        self.ctx: Optional[RootContext] = None
        self.parent: Optional[Unit] = None  # the nearest enclosing unit
        self.descendants: List[Tuple[str, Unit]] = []  # every unit under this one, named
        self.sync_gradients = True
        # Whether, while this unit is a root, communication overlaps compute ([Note: overlap]
        # in ``_runtime``; ``ShardedDataParallel.set_communication_overlap``).
        self.overlap_communication = True
        # Handles whose backward has not finished yet in the current backward.
        self.pending: Set[FlatParamHandle] = set()
        # Input-gradient hooks of this iteration's forwards that have not fired yet (they
        # signal when frozen handles are no longer needed; see _runtime).
        self.open_input_hooks = 0
        # Post-accumulate-grad hook registrations per handle (registered once the handle
        # requires grad; they live as long as the unit).
        self.grad_hooks: Dict[FlatParamHandle, object] = {}
        # What state_dict() / load_state_dict() produce and take (set_state_dict_type).
        self.state_dict_settings = StateDictSettings(
            StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()
        )
        # The 1-D DeviceMesh of ``group`` that sharded state dicts put their DTensors on: the
        # user's device_mesh, else one made on use and held weakly (``mesh()``): a mesh holds
        # its group strongly (see [Note: weak process group] in ``_collectives``).
        self._device_mesh = device_mesh
        self._made_mesh: Optional[Callable[[], Any]] = None
        # Hybrid sharding: the ranks holding the same shards as this one (gradients averaged).
        self.replicate = Communicator(replicate_group, guard) if replicate_group is not None else None
        # Buffers cast to MixedPrecision.buffer_dtype: (module, name, original dtype), for
        # state dicts, which give them in their original dtype.
        self.cast_buffers: List[Tuple[Any, str, torch.dtype]] = list(cast_buffers)
        # A test's recorder of what the root does (set on the root, see ``set_trace``).
        self.tracer: Optional[Tracer] = None
        # Whose state dict the wrapped module's ``state_dict()`` is part of right now:
        # ``None`` (a caller outside the wrapper), ``IN_PLAIN_VIEW`` or ``ROUTED`` (see
        # [Note: the wrapped module's state dict] in ``_module_state_dict``).
        self.state_dict_route: Optional[str] = None

    def __deepcopy__(self, memo: Dict[int, Any]) -> "Unit":
        """The unit of a copied model (see [Note: deep copies] in ``_deepcopy``): the same
        groups and mesh; no runtime, hooks or tracer until its root's first forward."""
        if self.training_state is not TrainingState.IDLE:
            raise AssertionError(f"{self.where()}: copied while {self.training_state.name}")
        fresh = {"ctx": None, "guard": None, "grad_hooks": {}, "pending": set(), "open_input_hooks": 0, "tracer": None, "state_dict_route": None}
        shared = {"_device_mesh": self._device_mesh, "_made_mesh": self._made_mesh}
        return copy_fields(self, memo, {**fresh, **shared})

    @property
    def group(self) -> ProcessGroup:
        return self.comm.group

    @property
    def replicate_group(self) -> Optional[ProcessGroup]:
        """Hybrid sharding: the group of the ranks holding the same shards as this one."""
        return self.replicate.group if self.replicate is not None else None

    @property
    def trainable(self) -> List[FlatParamHandle]:
        """The handles whose parameters require grad now (see [Note: requires_grad follows
        the FlatParameter] in ``flat_param``)."""
        return [h for h in self.handles if h.requires_grad]

    @property
    def frozen(self) -> List[FlatParamHandle]:
        return [h for h in self.handles if not h.requires_grad]

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def label(self) -> str:
        """The unit's name in traces: its module path, ``root`` for the root."""
        return self.name or "root"

    def members(self) -> List["Unit"]:
        """This unit and every unit under it."""
        return [self] + [unit for _, unit in self.descendants]

    def bind(self, ctx: Optional["RootContext"]) -> None:
        """Join the context of a root (``None``: leave it, e.g. when adopted by an outer unit)."""
        self.ctx = ctx
        for handle in self.handles:
            handle.runtime_made = ctx is not None

    def mesh(self) -> Any:
        """The 1-D ``DeviceMesh`` of the unit's group: the user's ``device_mesh``, else the one
        made before while anything (a state dict's ``DTensor``) still holds it, else a new one."""
        if self._device_mesh is not None:
            return self._device_mesh
        mesh = self._made_mesh() if self._made_mesh is not None else None
        if mesh is None:
            mesh = mesh_of(self.group, self.device)
            self._made_mesh = weakref.ref(mesh)
        return mesh

    def use_state_dict_settings(self, settings: StateDictSettings) -> None:
        """What ``state_dict()`` / ``load_state_dict()`` produce and take from now on."""
        self.state_dict_settings = settings

    def set_trace(self, tracer: Optional[Tracer]) -> None:
        """Report to ``tracer`` what this unit's tree does (for tests; ``None``: stop): the
        runtime's events of the root this unit is, and every collective of its units and
        handles."""
        self.tracer = tracer
        observer = tracer.collective if tracer is not None else None
        for member in self.members():
            comms = [member.comm, member.replicate] + [c for h in member.handles for c in (h.comm, h.replicate)]
            for comm in comms:
                if comm is not None:
                    comm.observe(observer)

    def adopt(self, nested: Sequence[Tuple[str, "Unit"]]) -> None:
        """Become the enclosing unit of ``nested`` (every unit under this one, any depth,
        named relative to this unit's module). They are initialised again by their root, and
        named as the user names their modules (relative to the outermost unit, the root)."""
        for name, unit in nested:
            if unit.training_state is not TrainingState.IDLE:
                raise AssertionError(f"{unit.where()}: wrapped into an outer unit while {unit.training_state.name}")
            if unit.parent is None:
                unit.parent = self
            unit.bind(None)
            unit.guard = None  # (its root's guard guards it from now on)
            unit.name = name
            for handle in unit.handles:
                handle.set_name_prefix(name)
        self.descendants = list(nested)

    def where(self) -> str:
        return rank_prefix(self.rank, self.name)

    def move(self, allowed_from: Sequence[TrainingState], target: TrainingState) -> None:
        self.training_state = guard_transition(self.training_state, allowed_from, target, self.where())


class RootContext:
    """State shared by all units of one root."""

    def __init__(self, root: Unit) -> None:
        self.root = root
        units = root.members()
        self.units = units
        self.index = {unit: i for i, unit in enumerate(units)}
        self.comm = root.comm
        self.guard = root_guard(root)
        # The groups order checks run over: the root's, and under hybrid sharding its
        # replicas' too (together they connect every rank that exchanges data with another).
        # They gather CPU tensors: see [Note: agreement checks on the host].
        self.check_comms = [host_check_comm(c) for c in (self.comm, root.replicate) if c is not None and c.world_size > 1]
        self.guard.use_checks(self.check_comms)
        # Which unit and handle own each full flat tensor that can be freed, by storage (see
        # [Note: saved parameters] in _saved).
        self.freeable: Dict[int, Tuple[Unit, FlatParamHandle]] = {
            handle.storage_key(): (unit, handle) for unit in units for handle in unit.handles if handle.separate_full
        }
        self.exec_order: ExecOrder[Unit] = ExecOrder()
        self.backward_state = BackwardState.IDLE
        # Units gathered during the current root forward (by their forward or a forward
        # prefetch): what a forward without autograd may free again, and nothing else.
        self.gathered_in_forward: Set[Unit] = set()
        # Units gathered ahead of their use by a prefetch (bounded by limit_all_gathers).
        self.prefetched: List[Unit] = []
        # Handles whose gradient reduction is in flight (with their units), oldest first.
        self.reducing: List[Tuple[Unit, FlatParamHandle]] = []
        # Whether every collective is preceded by an order check (see [Note: order check]):
        # under TORCH_DISTRIBUTED_DEBUG=DETAIL always, else only while generating unsynced.
        self.every_collective_checked = dist.get_debug_level() == dist.DebugLevel.DETAIL
        self.checking = self.every_collective_checked

    @property
    def checking(self) -> bool:
        """Whether every collective is preceded by an order check now (the guard's agreements
        then pair with those checks)."""
        return self.guard.checking

    @checking.setter
    def checking(self, value: bool) -> None:
        self.guard.checking = value

    def move(self, allowed_from: Sequence[BackwardState], target: BackwardState) -> None:
        self.backward_state = guard_transition(self.backward_state, allowed_from, target, self.root.where())


UNIT_ATTR = "_unit"  # where a wrapper keeps its unit

# Values of ``Unit.state_dict_route``.
IN_PLAIN_VIEW = "in the wrapper's plain view"
ROUTED = "routed to the wrapper"


def unit_of(module: Any) -> Optional[Unit]:
    """The unit ``module`` wraps if it is a ``ShardedDataParallel`` wrapper, else ``None``: the
    one way every layer tells a wrapper from another module (no layer below the public class
    imports it)."""
    unit = getattr(module, "__dict__", {}).get(UNIT_ATTR)
    return unit if isinstance(unit, Unit) else None


def root_of(unit: Unit) -> Unit:
    """The outermost unit enclosing ``unit`` (``unit`` itself if it is not nested)."""
    while unit.parent is not None:
        unit = unit.parent
    return unit


def root_guard(unit: Unit) -> Guard:
    """The guard of ``unit``'s root ([Note: one guarded path] in ``_guard``): the one its
    constructor ran in, else (a deep copy) one made now, over the root's groups. Every
    communicator of the tree is bound to it."""
    root = root_of(unit)
    if root.guard is None:
        root.guard = make_guard([root.comm, root.replicate], root.device)
        bind_units(root.guard, root.members())
    return root.guard


def bind_units(guard: Guard, units: Sequence[Unit]) -> None:
    """Guard every communicator of ``units`` (their own, their handles', replicas included)
    by ``guard``, each labelled with its unit for messages."""
    for unit in units:
        label = f"unit {display_name(unit.name)}" if unit.name else "the root unit"
        for comm in (unit.comm, unit.replicate, *(c for h in unit.handles for c in (h.comm, h.replicate))):
            guard.bind(comm, label)


def _describe(unit: Unit) -> str:
    layout = " + ".join(h.describe() for h in unit.handles) or "no parameters"
    return f"{display_name(unit.name)} ({unit.config.describe()}; {layout})"


def check_same_units(root: Unit) -> None:
    """Raise on every rank unless every rank built the same units with the same options
    under ``root`` (one small collective; hybrid: also across the replicas)."""
    descriptions = [_describe(unit) for unit in root.members()]
    replicas = root.replicate_group
    if replicas is not None and not all_ranks_agree("\n".join(descriptions), root.replicate, root.device):  # type: ignore[arg-type]
        raise together(DivergedRanksError(
            f"[rank {root.rank}] the replicas of a hybrid-sharded model wrapped different models (every rank "
            f"must build the same units with the same parameters, shapes, dtypes and options)"
        ))
    per_rank = gather_if_different(descriptions, root.comm, root.device)
    if per_rank is None:
        return
    found = differences(per_rank, "(no such unit)")
    lines = [f"  unit #{d.index}: rank 0 has {d.reference}\n             rank {d.rank} has {d.theirs}" for d in found]
    hint = ""
    if all(_unnamed(d.reference) == _unnamed(d.theirs) for d in found):
        # (e.g. ranks ignoring different modules that sit between managed ones in a Sequential)
        hint = (
            "\nOnly the parameters' names differ. FSDP1 accepts that; flatshard does not, because it cannot "
            "tell it from ranks that wrapped different parameters of the same shapes, whose gradients would "
            "then be averaged together silently, and because the ranks' state dicts would have different keys. "
            "If the ranks ignore different modules, register them where they do not shift the managed "
            "parameters' names (e.g. in a container of their own)"
        )
    raise together(DivergedRanksError(
        f"[rank {root.rank}] the ranks wrapped different models (every rank must build the same "
        f"units with the same parameters, shapes, dtypes and options):\n" + "\n".join(lines) + hint
    ))


def _unnamed(description: str) -> str:
    """A unit's description (``_describe``) without its parameters' names."""
    return re.sub(r"[\w.]+ (?=\()", "", description.split(" (", 1)[-1])
