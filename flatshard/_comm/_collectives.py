"""The only module that calls ``torch.distributed`` collectives.

Differences between torch versions and backends are settled here:

[Note: collectives per backend] On NCCL the flat collectives (all-gather into one tensor,
reduce-scatter of one tensor) are the fast paths. On gloo they are not: gloo's
all-gather-into-tensor copies through a temporary and is several times slower than its
list all-gather into views of the output, and its reduce-scatter exchanges the whole tensor
(as much traffic as an all-reduce). So on gloo the all-gather writes straight into views of
the output, and the reduce-scatter is an all-to-all of the chunks followed by a local sum:
the minimum traffic, (world - 1) / world of the tensor per rank.

[Note: pair exchange] With two ranks, both collectives reduce to swapping one chunk with the
peer, and on gloo that swap is cheapest as an all-to-all with split sizes that send nothing
to oneself: it writes the peer's chunk straight into its place, whereas gloo's all-gather
(list or flat) gathers through a temporary of the whole output and copies it out. Measured
on CPU with two ranks (``all_gather`` of 1-16 MiB): about half the CPU time and two thirds of
the wall time of the list all-gather. From three ranks on, the all-to-all would need a send
buffer holding the shard once per peer, and it measured no better, so those sizes keep the
general paths.

[Note: yield after a gloo wait] On the CPU the ranks' compute threads and gloo's threads
share the cores. A thread woken from a collective's wait goes straight back to computing,
while a gloo thread with work left (this rank's data still on its way to a peer that has not
finished) may be queued behind it on the same core; the scheduler need not preempt a
computing thread before its time slice ends (4 ms at 250 Hz), and the peer waits that long.
So after a gloo collective completes, the waiting thread yields once (``os.sched_yield``, a
system call that returns at once when nothing else is runnable on its core). Measured on
2 cores with 2 ranks and 25 units of 0.2M parameters (10 steps, three runs each way): forward
gathers that one rank issued more than 3 ms after the other went from 39-44 to 18-25 in 250,
and the step got 1-2% faster. It changes nothing but the order threads run in; NCCL waits do
not block the host and are left alone.

[Note: pair exchange over shared memory] Where a ``Communicator`` has been given a
shared-memory channel (``use_channel``; the runtime does so for the handles of two ranks on one
host), the two-rank swaps go through it instead of gloo: see [Note: shared-memory exchange] in
``_shared_memory``. Everything else keeps the paths above.

All collectives can run asynchronously: they return a ``Pending`` to ``wait()`` on right
before the result is needed (on CUDA, NCCL orders the work on its own stream and ``wait``
makes the current stream wait for it, without blocking the host).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pickle
import sys
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ._doubling import DOUBLING_FROM, SEND, SWAP, TAKE, ThreadWork, schedule
from ._peer_failures import together

ProcessGroup = dist.ProcessGroup

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_sched_yield: Optional[Callable[[], None]] = getattr(os, "sched_yield", None)  # (not on Windows)

# What any object using a (weakly held) group says once that group was destroyed.
GROUP_DESTROYED = (
    "the process group was destroyed (destroy_process_group); flatshard holds groups weakly, "
    "so this object cannot communicate any more"
)

# What a two-rank swap is part of (a shared-memory channel's records say which).
SWAP_GATHER = 1
SWAP_REDUCE = 2


def require_initialized() -> None:
    """Raise a clear error when no default process group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "ShardedDataParallel needs torch.distributed to be initialised: call "
            "torch.distributed.init_process_group(backend=...) on every rank before wrapping "
            "(or launch with torchrun and call init_process_group())"
        )


def default_group() -> ProcessGroup:
    return dist.group.WORLD  # type: ignore[return-value]


def rank_of(group: ProcessGroup) -> int:
    # (the group's own answer: a group passed in explicitly needs no default group, as in FSDP1)
    return group.rank()


def size_of(group: ProcessGroup) -> int:
    return group.size()


def global_rank() -> int:
    return dist.get_rank()


def default_store() -> Any:
    """The default process group's store (every rank of the job reaches it)."""
    return dist.distributed_c10d._get_default_store()


def exchanges_no_data(group: ProcessGroup) -> bool:
    """Whether ``group`` is torch's fake process group.

    [Note: the fake process group] torch's fake process group (``FakeProcessGroup``, the
    ``"fake"`` backend; ``init_fake_world``) runs one process as rank r of N: collectives
    return at once and leave their outputs as they were.
    flatshard runs on it for memory and scale measurements (``flatshard.plan(measure=True)``,
    the scale tests). Its own exchanges fill their outputs with this rank's contribution
    before the collective, so on the fake group every rank is taken to have sent what this
    one did: the ranks' agreement checks agree, and metadata exchanges see uniform ranks, as
    in an SPMD job. What needs data only another rank has (an object broadcast from the first
    rank: a rank0-only optimizer state dict, ``broadcast_from_rank0``) raises there instead
    of going on with this rank's own values. Parameter values gathered on it are undefined.
    """
    return "fake" in backend_of(group).lower()


def init_fake_world(rank: int, world_size: int) -> None:
    """Make torch's fake process group the default group, this process standing for ``rank`` of
    ``world_size`` (see [Note: the fake process group]). torch registers the ``"fake"`` backend
    only in its test utilities, so it is registered here where nothing has yet, through the
    extended backend API where torch has it (older torch constructs the group directly)."""
    from torch._C._distributed_c10d import FakeProcessGroup

    if "fake" not in dist.Backend.backend_list:
        extended = hasattr(FakeProcessGroup, "_create_internal")
        dist.Backend.register_backend("fake", _make_fake_group, extended_api=extended, devices=["cpu", "cuda"])
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=dist.HashStore())


def _make_fake_group(*args: Any) -> Any:
    """The ``"fake"`` backend's constructor, for either form of torch's backend API."""
    from torch._C._distributed_c10d import FakeProcessGroup

    if hasattr(FakeProcessGroup, "_create_internal"):
        common, backend_options = args
        return FakeProcessGroup._create_internal(common.group_rank, common.group_size, backend_options)
    _store, rank, world_size, _timeout = args
    return FakeProcessGroup(rank, world_size)


def backend_of(group: ProcessGroup) -> str:
    """The group's backend name; ``"unknown"`` for a group torch does not know (no default
    group yet, or a stand-in object such as a test's dummy group with only rank and size)."""
    if not (dist.is_available() and dist.is_initialized()) or not isinstance(group, dist.ProcessGroup):
        return "unknown"
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return "unknown"


def timeout_of(group: ProcessGroup) -> timedelta:
    """The timeout ``group``'s collectives give up after: its CPU backend's, else its CUDA
    backend's (a plain NCCL group has only that one); torch's default where neither says."""
    for device in ("cpu", "cuda"):
        try:
            timeout = group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return dist.default_pg_timeout


class Pending:
    """A collective in flight. ``wait()`` completes it, then runs its finishing step (e.g.
    dividing a sum into a mean); waiting again does nothing."""

    def __init__(self, work: Any, finish: Optional[Callable[[], None]] = None, host_threads: bool = False, watch: Optional[Any] = None, what: str = "") -> None:
        self._work = work
        self._finish = finish
        # A gloo wait runs in slices that look at the peers' failures ([Note: peer failures]).
        self._watch = watch if host_threads else None
        self._what = what
        # ``host_threads``: the collective runs on threads that share the cores with the
        # caller (gloo); the caller then yields once after waiting for it
        self._yield = _sched_yield if host_threads and work is not None else None

    def wait(self) -> None:
        self.drain()
        if self._yield is not None:
            give_way, self._yield = self._yield, None
            give_way()  # see [Note: yield after a gloo wait]
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()

    def drain(self) -> None:
        """Complete the collective but skip its finishing step (its result is not wanted;
        the collective itself must still complete on every rank)."""
        if self._work is not None:
            work, self._work = self._work, None
            if self._watch is not None:
                self._watch.wait(work, self._what)
            else:
                work.wait()


@dataclass(frozen=True)
class CollectiveEvent:
    """One collective as an observer of a ``Communicator`` sees it: its kind (``all_gather``,
    ``reduce_scatter``, ``all_reduce``, ``broadcast``), the ``torch.distributed`` function
    called, the bytes this rank sends (what the algorithm gloo uses for it must send), and
    whether it is a small agreement check rather than data."""

    kind: str
    op: str
    nbytes: int
    check: bool = False


class Communicator:
    """The collectives of one process group (see [Note: collectives per backend]).

    [Note: weak process group] The group is held weakly. Units reference each other and their
    hooks in cycles that only the garbage collector frees; were the group held strongly, a
    model alive after ``destroy_process_group()`` would keep the group until interpreter
    shutdown, where destroying gloo's threads can abort the process.
    """

    def __init__(self, group: ProcessGroup, guard: Optional[Any] = None) -> None:
        self._group = weakref.ref(group)
        self.rank = rank_of(group)
        self.world_size = size_of(group)
        backend = backend_of(group)
        self.gloo = "gloo" in backend
        # Whether its collectives reach other ranks (not alone, not torch's fake group): only
        # then must they run inside a guarded call.
        self.live = self.world_size > 1 and "fake" not in backend.lower()
        # Told about every collective issued (tests' trace of a step); see ``observe``.
        self._observer: Optional[Callable[[CollectiveEvent], None]] = None
        # Carries the two-rank swaps when set: [Note: pair exchange over shared memory].
        self.channel: Optional[Any] = None
        self.channel_label = ""  # what this communicator's chunks are of (the peer's must match)
        # From how many ranks ``agree`` takes its maximum by recursive doubling over gloo
        # ([Note: agreement by recursive doubling] in ``_doubling``; tests lower it).
        self.doubling_from = DOUBLING_FROM
        # The ``Guard`` whose calls its collectives belong to ([Note: one guarded path] in
        # ``_guard``; bound by the guard), and what its collectives are of, for messages.
        self.guard: Optional[Any] = guard
        self.label = ""
        # The CUDA stream chained collectives are issued from ([Note: chained all-reduce]),
        # made at the first one.
        self._chain_stream: Optional[Any] = None

    def __deepcopy__(self, memo: Dict[int, Any]) -> "Communicator":
        """A copied model talks over the same group, through an exchange and a guard of its own
        (made for its first call) and unobserved: see [Note: deep copies] in ``_deepcopy``."""
        new = Communicator(self.group)
        memo[id(self)] = new
        return new

    def sibling(self, group: ProcessGroup) -> "Communicator":
        """A communicator over ``group`` whose collectives belong to this one's guard."""
        return Communicator(group, self.guard)

    @property
    def watch(self) -> Optional[Any]:
        """The guard's ``StepWatch`` (see [Note: peer failures]), if any."""
        return self.guard.watch if self.guard is not None else None

    def use_channel(self, channel: Optional[Any], label: str = "") -> None:
        """Swap chunks with the peer through ``channel`` (a ``SharedMemoryChannel`` of this
        group) where it takes them, as chunks of ``label`` (e.g. a unit: the peer's exchange
        must be of the same); ``None``: gloo again."""
        self.channel = channel
        self.channel_label = label
        if channel is not None:
            channel.name(label)

    def observe(self, observer: Optional[Callable[[CollectiveEvent], None]]) -> None:
        """Call ``observer`` with a ``CollectiveEvent`` for each collective issued from now on
        (``None``: stop)."""
        self._observer = observer

    def _note(self, kind: str, op: str, nbytes: int, check: bool = False) -> None:
        """Before each collective: its guard's turn ([Note: one guarded path] in ``_guard``),
        then the observer's."""
        what = f"{'an agreement check' if check else kind} ({self.label or 'the root'})"
        if self.guard is not None:
            self.guard.before_collective(what)
        elif self.live:
            raise AssertionError(
                f"[rank {self.rank}] flatshard issued a collective ({what}) through a communicator that belongs "
                f"to no guard: every flatshard operation that communicates must run as a call of its Guard "
                f"([Note: one guarded path])"
            )
        if self._observer is not None:
            self._observer(CollectiveEvent(kind, op, nbytes, check))

    def global_ranks(self) -> List[int]:
        """The group's ranks in the default group, in group order."""
        return list(dist.get_process_group_ranks(self.group))

    @property
    def group(self) -> ProcessGroup:
        group = self._group()
        if group is None:
            raise RuntimeError(GROUP_DESTROYED)
        return group

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False, check: bool = False) -> Pending:
        """Fill ``output`` (``world_size * shard.numel()`` elements) with every rank's shard, in rank order."""
        sent = shard.numel() * shard.element_size() * (self.world_size - 1)
        if self._pairwise(output, shard):
            halves = output.chunk(2)
            if self.channel is not None and self.channel.takes(shard):
                self._note("all_gather", "shared_memory", sent, check)
                halves[self.rank].copy_(shard)
                exchange = self.channel.exchange(SWAP_GATHER, shard, halves[1 - self.rank].copy_, self.channel_label)
                return _maybe_wait(Pending(exchange), async_op)
            self._note("all_gather", "all_to_all_single", sent, check)
            work = self._swap_with_peer(halves[1 - self.rank], shard)
            halves[self.rank].copy_(shard)
        elif self.gloo:
            self._note("all_gather", "all_gather", sent, check)
            work = dist.all_gather(list(output.chunk(self.world_size)), shard, group=self.group, async_op=True)
        else:
            self._note("all_gather", _all_gather_flat.__name__, sent, check)
            work = _all_gather_flat(output, shard, group=self.group, async_op=True)
        return _maybe_wait(self._pending(work), async_op)

    def _pending(self, work: Any, finish: Optional[Callable[[], None]] = None) -> Pending:
        what = self.watch.last[-1][2] if self.watch is not None and self.watch.last else ""
        return Pending(work, finish, host_threads=self.gloo, watch=self.watch, what=what)

    def _pairwise(self, whole: torch.Tensor, part: torch.Tensor) -> bool:
        """Whether the two-rank exchange applies to ``whole`` (all chunks) and ``part`` (one
        chunk): see [Note: pair exchange]. Anything else takes the general path, whose checks
        report a rank's own mismatched sizes (sizes that differ between ranks are not detected
        on either path)."""
        return (
            self.gloo and self.world_size == 2 and whole.numel() == 2 * part.numel()
            and all(t.dim() == 1 and t.is_contiguous() for t in (whole, part))
        )

    def _swap_with_peer(self, received: torch.Tensor, sent: torch.Tensor) -> Any:
        """Two ranks: send ``sent`` to the peer and receive its equally long chunk into ``received``."""
        sizes = [0, 0]
        sizes[1 - self.rank] = sent.numel()
        return dist.all_to_all_single(received, sent, sizes, sizes, group=self.group, async_op=True)

    def reduce_scatter_mean(self, output: torch.Tensor, full: torch.Tensor, async_op: bool = False) -> Pending:
        """Set ``output`` to this rank's chunk of the mean of ``full`` over the ranks."""
        return self._reduce_scatter(output, full, self.world_size, async_op)

    def reduce_scatter_sum(self, output: torch.Tensor, full: torch.Tensor) -> None:
        """Set ``output`` to this rank's chunk of the sum of ``full`` over the ranks."""
        self._reduce_scatter(output, full, 1, async_op=False)

    def _reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, divisor: int, async_op: bool) -> Pending:
        world = self.world_size
        if world == 1:
            output.copy_(full)
            return Pending(None)
        sent = full.numel() * full.element_size() // world * (world - 1)  # every chunk but ours
        if self._pairwise(full, output):
            return _maybe_wait(self._reduce_with_peer(output, full, divisor, sent), async_op)
        self._note("reduce_scatter", "all_to_all_single" if self.gloo else _reduce_scatter_flat.__name__, sent)
        if self.gloo:
            received = torch.empty_like(full)
            work = dist.all_to_all_single(received, full, group=self.group, async_op=True)
            # chunk r of what arrives: what rank r holds of our part
            return _maybe_wait(self._pending(work, _summing(output, received.chunk(world), divisor)), async_op)
        work = _reduce_scatter_flat(output, full, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return _maybe_wait(self._pending(work, _dividing(output, divisor)), async_op)

    def _reduce_with_peer(self, output: torch.Tensor, full: torch.Tensor, divisor: int, sent: int) -> Pending:
        """Two ranks swap the chunk the peer keeps for the one we keep ([Note: pair exchange]),
        through the shared-memory channel where it takes it. Detached: under
        ``backward(create_graph=True)`` the gradient requires grad while the reduced shard is
        data, as what gloo hands back is."""
        halves = full.detach().chunk(2)
        ours, theirs = halves[self.rank], halves[1 - self.rank]
        if self.channel is not None and self.channel.takes(theirs):
            self._note("reduce_scatter", "shared_memory", sent)
            exchange = self.channel.exchange(SWAP_REDUCE, theirs, lambda peer: torch.add(ours, peer, out=output), self.channel_label)
            return Pending(exchange, _dividing(output, divisor))
        self._note("reduce_scatter", "all_to_all_single", sent)
        received = torch.empty_like(ours)
        work = self._swap_with_peer(received, theirs)
        return self._pending(work, _summing(output, (ours, received), divisor))

    def all_reduce_mean(self, tensor: torch.Tensor, async_op: bool = False) -> Pending:
        """Replace ``tensor`` by its mean over the ranks, in place."""
        self._note("all_reduce", "all_reduce", self._ring_bytes(tensor))
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return _maybe_wait(self._pending(work, lambda: tensor.div_(self.world_size)), async_op)

    def all_reduce_mean_after(self, before: Pending, tensor: torch.Tensor) -> Optional[Pending]:
        """Issue now the mean of ``tensor`` over the ranks, to run once ``before`` (the
        collective that writes ``tensor``) has completed, without the current stream waiting
        for either; ``None`` where that cannot be done (not CUDA): see [Note: chained
        all-reduce].

        [Note: chained all-reduce] Under hybrid sharding a gradient is reduce-scattered in its
        shard group and the result then averaged over the replicas. Issued only after the
        reduce-scatter was waited for on the compute stream, the all-reduce would start after
        the compute queued before that wait, and the compute queued after it would wait for it.
        On CUDA the chain goes through a side stream instead: the side stream waits for the
        compute stream (the gradient is complete there), waits for the reduce-scatter and runs
        its finishing step, and the all-reduce is issued from it, so NCCL orders it after the
        reduce-scatter and the compute stream waits for the pair only where the result is
        used. Every tensor of the chain was allocated on the compute stream and is referenced
        until that wait, which orders every later use of its memory after the chain: no
        ``record_stream`` is needed. A host-driven backend (gloo) can only issue the all-reduce
        once the reduce-scatter has completed on the host, so the runtime issues it at its next
        wait point (``HandleGrads.advance_reduction``)."""
        if tensor.device.type != "cuda" or self.world_size == 1:
            return None
        if self._chain_stream is None:
            self._chain_stream = torch.cuda.Stream(device=tensor.device)
        side = self._chain_stream
        side.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(side):
            before.wait()
            return self.all_reduce_mean(tensor, async_op=True)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """Replace ``tensor`` in place by its elementwise ``"sum"`` or ``"max"`` over the ranks."""
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        if op not in ops:
            raise ValueError(f"all_reduce: op must be 'sum' or 'max'; got {op!r}")
        if self.world_size > 1:
            self._note("all_reduce", "all_reduce", self._ring_bytes(tensor))
            self._pending(dist.all_reduce(tensor, op=ops[op], group=self.group, async_op=True)).wait()

    def _ring_bytes(self, tensor: torch.Tensor) -> int:
        """What a ring all-reduce sends per rank: 2 (world - 1) / world of the tensor."""
        return 2 * tensor.numel() * tensor.element_size() * (self.world_size - 1) // self.world_size

    def broadcast_from_first(self, tensor: torch.Tensor) -> None:
        """Overwrite ``tensor`` on every rank with the group's first rank's ``tensor``."""
        if self.world_size > 1:
            self._note("broadcast", "broadcast", tensor.numel() * tensor.element_size() if self.rank == 0 else 0)
            self._pending(dist.broadcast(tensor, src=dist.get_global_rank(self.group, 0), group=self.group, async_op=True)).wait()

    def agree(self, value: int, device: torch.device) -> bool:
        """Whether every rank passed the same ``value`` (a 63-bit integer, e.g. a
        ``fingerprint``). Collective, of two integers: two ranks swap their values (through
        the pair exchange), more take the maximum of ``value`` and of ``-value``, which are
        each other's negation exactly when the smallest value equals the largest. Over gloo
        that maximum takes about log2(N) rounds of messages rather than gloo's ring ([Note:
        agreement by recursive doubling] in ``_doubling``); elsewhere it is one all-reduce."""
        if self.world_size == 1:
            return True
        if self.world_size == 2:
            first, second = self.gather_ints(value, device)
            return first == second
        both = torch.tensor([value, -value], dtype=torch.int64, device=device)
        if self.gloo and both.device.type == "cpu" and self.world_size >= self.doubling_from:
            self._maximum_by_doubling(both)
        else:
            self._note("all_reduce", "all_reduce", self._ring_bytes(both), True)
            self._pending(dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group, async_op=True)).wait()
        largest, negated_smallest = both.tolist()
        return largest == -negated_smallest

    def _maximum_by_doubling(self, values: torch.Tensor) -> None:
        """Replace ``values`` (a CPU tensor) by its elementwise maximum over the ranks, in
        point-to-point messages on a thread of their own, waited on like a gloo collective."""
        steps = schedule(self.rank, self.world_size)
        group = self.group
        peers = [dist.get_global_rank(group, step.peer) for step in steps]
        sends = sum(step.kind in (SEND, SWAP) for step in steps)
        self._note("all_reduce", "send_recv", sends * values.numel() * values.element_size(), True)

        def run() -> None:
            for step, peer in zip(steps, peers):
                _step_of_maximum(step.kind, values, peer, group)

        self._pending(ThreadWork(run, f"flatshard agreement check (rank {self.rank})")).wait()

    def gather_ints(self, value: int, device: torch.device) -> List[int]:
        """Every rank's ``value`` (one small synchronous all-gather)."""
        if self.world_size == 1:
            return [value]
        mine = torch.tensor([value], dtype=torch.int64, device=device)
        # (filled with ours: what a process group that exchanges no data, torch's fake one,
        # leaves there -- see [Note: the fake process group])
        everyone = torch.full((self.world_size,), value, dtype=torch.int64, device=device)
        self.all_gather(everyone, mine, check=True)
        return [int(v) for v in everyone.tolist()]


def _step_of_maximum(kind: str, values: torch.Tensor, peer: int, group: ProcessGroup) -> None:
    """One step of a recursive-doubling maximum with ``peer`` (a global rank), waited on
    without a timeout of its own (see [Note: agreement by recursive doubling])."""
    if kind == SEND:
        dist.isend(values, dst=peer, group=group, tag=_AGREEMENT_TAG).wait()
        return
    theirs = torch.empty_like(values)
    sending = dist.isend(values, dst=peer, group=group, tag=_AGREEMENT_TAG) if kind == SWAP else None
    dist.irecv(theirs, src=peer, group=group, tag=_AGREEMENT_TAG).wait()
    if sending is not None:
        sending.wait()  # (before ``values`` changes under it)
    if kind == TAKE:
        values.copy_(theirs)
    else:
        torch.maximum(values, theirs, out=values)


# The tag of the agreement's messages (a user's point-to-point messages on the same group, with
# torch's default tag 0, are not matched with them).
_AGREEMENT_TAG = 0x46534147


def _dividing(output: torch.Tensor, divisor: int) -> Optional[Callable[[], None]]:
    """The finishing step that turns a sum in ``output`` into a mean (none for a sum)."""
    return (lambda: output.div_(divisor)) if divisor != 1 else None


def _summing(output: torch.Tensor, parts: Sequence[torch.Tensor], divisor: int) -> Callable[[], None]:
    """The finishing step of a reduce-scatter over gloo: ``output`` = the sum of ``parts`` in
    rank order (divided by ``divisor``)."""
    def finish() -> None:
        torch.add(parts[0], parts[1], out=output)
        for part in parts[2:]:
            output.add_(part)
        if divisor != 1:
            output.div_(divisor)

    return finish


def _maybe_wait(pending: Pending, async_op: bool) -> Pending:
    if not async_op:
        pending.wait()
    return pending


def mesh_of(group: ProcessGroup, device: torch.device) -> Any:
    """A 1-D ``DeviceMesh`` over ``group`` (for the ``DTensor``s of sharded state dicts)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device.type)


def registered_groups() -> List[ProcessGroup]:
    """Every process group torch's registry holds now (the default group first; ``[]`` when
    none is initialised). Read through torch's private registry where it exists, else only
    the default group is known."""
    if not dist.is_initialized():
        return []
    world = dist.group.WORLD
    registry = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    others = [g for g in (registry or {}) if g is not world and isinstance(g, ProcessGroup)]
    return [world] + others


def release_cached_meshes() -> None:
    """Empty torch's process-wide ``DTensor`` caches, which keep every ``DeviceMesh`` they have
    seen, and with it its process groups, after ``destroy_process_group()`` (see [Note: ending
    cleanly] in ``teardown``): the ``functools`` caches defined in torch's ``DTensor`` modules
    (sharding propagation, redistribution plans, mesh topology, ...), the redistribution
    planners and the native sharding-propagation cache. Which caches exist differs between
    torch versions, so they are found rather than named; clearing one costs nothing but
    recomputation. A cache that cannot be cleared keeps its group, and ``teardown``'s check
    then names it."""
    prefixes = ("torch.distributed.tensor", "torch.distributed._tensor")
    if not any(name.startswith(prefixes) for name in sys.modules):
        return  # (no DTensor was ever used)
    try:
        from torch.distributed.tensor import debug as dtensor_debug
    except ImportError:  # (an older torch: its caches are found below)
        dtensor_debug = None
    clears = [getattr(dtensor_debug, "_clear_sharding_prop_cache", None),
              getattr(sys.modules.get("torch.distributed.tensor._redistribute"), "clear_redistribute_planner_cache", None)]
    for name, module in list(sys.modules.items()):
        if name.startswith(prefixes) and module is not None:
            try:
                clears.extend(_functools_caches(name, module))
            except Exception:  # (an odd module-level object: the check that follows reports what is left)
                continue
    for clear in clears:
        if clear is None:
            continue
        try:
            clear()
        except Exception:  # (see the docstring: the check that follows reports what is left)
            continue


def _functools_caches(module_name: str, module: Any) -> List[Callable[[], None]]:
    """The ``cache_clear`` of every ``functools`` cache defined in ``module``: its functions
    and the methods and static methods of its classes."""
    found = []
    for value in list(vars(module).values()):
        if getattr(value, "__module__", None) != module_name:
            continue
        members = list(vars(value).values()) if isinstance(value, type) else []
        for candidate in [value] + [getattr(m, "__func__", m) for m in members]:
            if type(candidate).__name__ == "_lru_cache_wrapper":
                found.append(candidate.cache_clear)
    return found


def fingerprint(text: str) -> int:
    """A 63-bit digest of ``text`` that is the same in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def all_ranks_agree(text: str, comm: Communicator, device: torch.device) -> bool:
    """Whether every rank passed the same ``text`` (``Communicator.agree`` of its digest)."""
    return comm.agree(fingerprint(text), device)


def broadcast_object(obj: Any, comm: Communicator) -> Any:
    """The group's first rank's ``obj`` on every rank (for metadata only; see
    [Note: object collectives])."""
    if comm.world_size == 1:
        return obj
    group = comm.group
    if comm.rank != 0 and exchanges_no_data(group):
        raise RuntimeError(
            f"[rank {comm.rank}] this step needs data that only the group's first rank has (an object it "
            f"broadcasts), and torch's fake process group exchanges no data: it runs one process as one "
            f"rank of {comm.world_size}. Measure this step on rank 0, or on a real process group"
        )
    device = object_device(group)
    payload = _to_bytes(obj, device) if comm.rank == 0 else torch.empty(0, dtype=torch.uint8, device=device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    comm.broadcast_from_first(size)
    if comm.rank != 0:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    comm.broadcast_from_first(payload)
    return _from_bytes(payload)


@dataclass(frozen=True)
class RankDifference:
    """Where one rank's list of items first differs from rank 0's: item ``index`` is
    ``reference`` on rank 0 and ``theirs`` on ``rank`` (an agreed placeholder where a list
    has run out)."""

    rank: int
    index: int
    reference: Any
    theirs: Any


def item_at(items: Sequence[Any], index: int, past_end: Any) -> Any:
    """``items[index]``, or ``past_end`` where ``items`` has run out."""
    return items[index] if index < len(items) else past_end


def differences(per_rank: Sequence[Sequence[Any]], past_end: Any) -> List[RankDifference]:
    """Every rank whose items differ from rank 0's, in rank order, each at its first
    differing item (``past_end`` stands for an item past the end of a list). Pure: the
    caller gathered ``per_rank``, every rank's list in rank order.

    [Note: rank agreement] Every check that the ranks agree (built the same units, ran the
    same units, called a collective operation the same way, loaded the same structure) finds
    the difference it reports here, so they all name the same rank and item for the same
    disagreement: the lowest rank that differs from rank 0, at its first differing item.
    """
    reference = list(per_rank[0])
    found = []
    for rank, items in enumerate(per_rank):
        items = list(items)
        width = max(len(reference), len(items))
        index = next((i for i in range(width) if reference[i : i + 1] != items[i : i + 1]), None)
        if index is not None:
            found.append(RankDifference(rank, index, item_at(reference, index, past_end), item_at(items, index, past_end)))
    return found


def gather_if_different(items: List[str], comm: Communicator, device: torch.device) -> Optional[List[List[str]]]:
    """``None`` if every rank passed the same ``items`` (``Communicator.agree`` of a digest);
    else every rank's ``items``, in rank order (an object all-gather)."""
    if comm.agree(fingerprint("\n".join(items)), device):
        return None
    return all_gather_object(list(items), comm)


def first_difference(items: List[str], comm: Communicator, device: torch.device) -> Optional[RankDifference]:
    """``None`` if every rank passed the same ``items``; else the first rank that differs
    from rank 0, at its first differing item ("nothing" past the end of a list)."""
    per_rank = gather_if_different(items, comm, device)
    if per_rank is None:
        return None
    return differences(per_rank, "nothing")[0]


def all_gather_object(obj: Any, comm: Communicator) -> List[Any]:
    """Every rank's ``obj``, in rank order (slow; for error reports and metadata only).

    [Note: object collectives] torch's own object collectives (``all_gather_object``,
    ``broadcast_object_list``) turn bytes back into objects through numpy, which torch does
    not install: without numpy they fail with "Numpy is not available" -- in flatshard's
    case, exactly on the error paths that are meant to explain a rank disagreement. So
    flatshard pickles into a byte tensor itself and reads the bytes back without numpy.
    """
    if comm.world_size == 1:
        return [obj]
    device = object_device(comm.group)
    payload = _to_bytes(obj, device)
    sizes = comm.gather_ints(payload.numel(), device)
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: payload.numel()].copy_(payload)
    everyone = padded.repeat(comm.world_size)  # (see [Note: the fake process group])
    comm.all_gather(everyone, padded)
    return [_from_bytes(chunk[:size]) for chunk, size in zip(everyone.chunk(comm.world_size), sizes)]


def raise_on_every_rank(comms: Sequence[Communicator], error: Optional[BaseException], others: str, device: torch.device) -> None:
    """Raise on every rank if any rank has an ``error``: a rank its own, the others a
    ``RuntimeError`` saying ``others`` (``{rank}``: the first rank that failed, a global rank).
    Nothing happens if no rank has one.

    [Note: raising together] One all-reduce (max) of two integers per communicator -- whether
    some rank failed, and ``2**62 - rank`` of the first -- in order: with a shard group then a
    replicate group (hybrid sharding), after both every rank of every shard group has heard.
    Constant size, so it costs the same at any N. Every rank must pass the same ``comms``."""
    me = global_rank()
    first = me if error is not None else None
    for comm in comms:
        if comm.world_size == 1:
            continue
        flags = torch.tensor([0, 0] if first is None else [1, _BEYOND_RANKS - first], dtype=torch.int64, device=device)
        comm.all_reduce(flags, op="max")
        if int(flags[0]):
            first = _BEYOND_RANKS - int(flags[1])
    if error is not None:
        raise together(error)
    if first is not None:
        raise together(RuntimeError(f"[rank {me}] " + others.format(rank=first)))


_BEYOND_RANKS = 1 << 62  # (more than any rank: the first failing rank has the largest 2**62 - rank)


def object_device(group: ProcessGroup) -> torch.device:
    """Where object payloads travel: NCCL communicates CUDA tensors only."""
    if "nccl" in backend_of(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    data = bytearray(pickle.dumps(obj))
    return torch.frombuffer(data, dtype=torch.uint8).clone().to(device) if data else torch.empty(0, dtype=torch.uint8, device=device)


def _from_bytes(payload: torch.Tensor) -> Any:
    payload = payload.cpu().contiguous()
    return pickle.loads(ctypes.string_at(payload.data_ptr(), payload.numel()))
