"""Two ranks on one host swap the chunks of their all-gathers and reduce-scatters through
shared memory instead of gloo's loopback sockets.

[Note: shared-memory exchange] With two ranks on gloo, every all-gather and reduce-scatter of
a flat parameter is a swap of one chunk with the peer ([Note: pair exchange] in
``_collectives``). Over loopback TCP that swap costs both ranks CPU on gloo's threads (the
kernel copies through socket buffers, and gloo's threads compete with the compute threads for
the cores) and wake-up delays. When both ranks run on the same x86 host, the runtime gives the
handles of a root one ``SharedMemoryChannel`` instead: each rank maps a segment of its own
and its peer's (files in ``/dev/shm``, unlinked as soon as both ranks mapped them, so nothing
is left behind however a process ends), publishes its chunk by copying it into its segment,
and copies (all-gather) or adds (reduce-scatter) the peer's chunk straight out of the peer's
segment. Measured on 2 cores, swapping 1.6 MB back and forth: gloo 1.8 ms per swap and 1.2 ms
of CPU per rank; shared memory 0.2 ms (polling) to 0.7 ms (sleeping on the FIFO between swaps).

- A segment is a table of publication records (sequence number, kind, dtype, bytes, offset,
  and a digest of what the chunk is of: the unit), a table of acknowledgements of the peer's
  publications, and an arena the chunks are copied into. Both ranks number their exchanges in
  the order they issue them (the order the collectives would have been issued in); a record
  becomes visible when its sequence number is written, after everything else (x86 keeps
  stores in order, which is why other machines keep gloo). A record whose kind, dtype, size or
  unit differs from the reader's own exchange of the same number is a disagreement between
  the ranks: an error naming both, not a silent mix-up of two units' chunks.
- The peer's chunk is taken as soon as both ranks have issued the exchange, whenever this rank
  is inside the channel (issuing, waiting, or blocked), not only when its own ``wait()`` comes.
- A rank with no room in its arena (the peer has not taken enough earlier chunks yet) keeps
  the chunk aside (a copy) and publishes it, in order, as soon as there is room: issuing never
  blocks, since the peer may take the earlier chunks only after a collective this rank is about
  to join. A ``wait()`` returns only once this rank's own chunk of that exchange is out as well:
  the peer needs it at the same point of the program, and this rank may block in something
  else right after (a gloo collective, another model's channel).
- A rank that must wait spins briefly, then sleeps on a FIFO the peer writes a byte to after
  every publication. When the peer exits (or frees its model) the FIFO reports end-of-file:
  the waiting rank raises at once instead of waiting for the process group's timeout, which
  still bounds any other wait.
- ``FLATSHARD_SHARED_MEMORY=0`` (on any rank) keeps gloo; so do ranks on different hosts or in
  different PID namespaces, and a ``/dev/shm`` that cannot hold the segments (found out when
  they are created: the arenas are allocated up front, never on first touch).
"""

from __future__ import annotations

import enum
import mmap
import os
import platform
import secrets
import select
import socket
import time
import weakref
from collections import deque
from datetime import timedelta
from types import MappingProxyType
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch

from ._collectives import GROUP_DESTROYED, SWAP_GATHER, SWAP_REDUCE, Communicator, all_gather_object, fingerprint, rank_of
from ._peer_failures import SLICE_S

ENV_SWITCH = "FLATSHARD_SHARED_MEMORY"
SHM_DIR = "/dev/shm"
# Machines whose stores become visible to other cores in program order (see the Note).
_IN_ORDER_STORES = ("x86_64", "AMD64", "i386", "i686")
_RECORDS = 64  # publications outstanding at once (record slots); more wait for room
_FIELDS = 6  # per record: sequence number, kind, dtype code, bytes, offset, what it is of (a digest)
_ACKS = _RECORDS * _FIELDS  # first word of the acknowledgement table
_DEFERRING = _ACKS + _RECORDS  # word: this rank holds chunks it could not publish yet
_HEADER_BYTES = 4096
_ALIGN = 64
_SPIN_S = 30e-6  # how long a wait polls before it sleeps on the FIFO
_SLEEP_S = 0.1  # longest sleep between checks (that the peer process still runs)
_MIN_ARENA = 1 << 20
_ROOMY_ARENA = 256 << 20  # beyond one largest chunk, the arena grows no larger than this

_CLOSED = "rank {peer} closed its end of the shared-memory exchange (its process exited or its model was freed)"
_KIND_NAMES = MappingProxyType({SWAP_GATHER: "all-gather", SWAP_REDUCE: "reduce-scatter"})


class ChannelState(enum.Enum):
    UNTRIED = "untried"  # connects at the first exchange offered to it
    READY = "ready"
    UNAVAILABLE = "unavailable"  # gloo carries everything (see the Note for when)
    BROKEN = "broken"  # the ranks disagreed or the peer left: every wait raises


# The code a record gives each dtype torch has (a digest of its name, the same in every process).
_DTYPE_CODES = MappingProxyType({
    d: fingerprint(str(d)) for d in (getattr(torch, name) for name in dir(torch)) if isinstance(d, torch.dtype)
})


def _a(text: str) -> str:
    return ("an " if text[:1] in "aeiou" else "a ") + text


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


class Exchange:
    """One swap in flight: this rank's chunk is published (or waits for room); ``arrive`` is
    called with a view of the peer's chunk once it is there. ``label``: what the chunk is of
    (e.g. a unit), for messages."""

    __slots__ = ("channel", "seq", "kind", "dtype", "nbytes", "label", "key", "arrive", "done", "published")

    def __init__(self, channel: "SharedMemoryChannel", seq: int, kind: int, dtype: torch.dtype, nbytes: int, label: str, tag: int, arrive: Callable[[torch.Tensor], Any]) -> None:
        self.channel = channel
        self.seq = seq
        self.kind = kind
        self.dtype = dtype
        self.nbytes = nbytes
        self.label = label
        # What this rank's record says and the peer's record of the same exchange must say
        # (``tag``: the label's digest).
        self.key = (kind, _DTYPE_CODES.get(dtype) or fingerprint(str(dtype)), nbytes, tag)
        self.arrive = arrive
        self.done = False  # the peer's chunk has arrived
        self.published = False  # this rank's chunk is in the arena (not kept aside)

    def wait(self) -> None:
        self.channel.complete(self)

    def describe(self) -> str:
        return _describe(self.kind, self.label, self.nbytes, self.dtype)


def _describe(kind: int, label: str, nbytes: int, dtype: Any) -> str:
    of = f" of {label}" if label else ""
    return f"{_KIND_NAMES.get(kind, 'unknown collective')}{of} ({nbytes} bytes of {dtype})"


class _Segment:
    """One rank's mapped segment: header words and the arena as bytes."""

    def __init__(self, memory: mmap.mmap) -> None:
        self.memory = memory
        self.words = memoryview(memory)[:_HEADER_BYTES].cast("q")
        self.arena = torch.frombuffer(memory, dtype=torch.uint8)[_HEADER_BYTES:]

    def chunk(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return self.arena[offset : offset + nbytes].view(dtype)


def _quietly(action: Callable[[Any], Any], items: List[Any]) -> None:
    """``action(item)`` for each item, ignoring OS errors (cleaning up what may be gone)."""
    for item in items:
        try:
            action(item)
        except OSError:
            pass


class SharedMemoryChannel:
    """The shared-memory swaps between the two ranks of ``group`` (see [Note: shared-memory
    exchange]). ``capacity_hint``: the largest chunk in bytes the caller expects to swap; the
    arena holds three of them (at most 256 MiB more than one), and larger chunks stay on gloo."""

    def __init__(self, comm: Communicator, capacity_hint: int, timeout: timedelta) -> None:
        group = comm.group
        self._group = weakref.ref(group)
        # The connection's own collectives (a guarded communicator of the group, see [Note: one
        # guarded path] in ``_guard``).
        self._comm = comm
        self.rank = rank_of(group)
        self.peer = 1 - self.rank
        self.state = ChannelState.UNTRIED
        self.problem = ""  # why the channel broke
        self.capacity = 0  # arena bytes, agreed by both ranks at connection
        self.capacity_hint = capacity_hint
        self.prefix = ""  # the segments' path without the rank, once connecting
        self.timeout_s = timeout.total_seconds()
        self.watch: Optional[Any] = None  # the root's StepWatch ([Note: peer failures]), once bound
        self._mine: Optional[_Segment] = None
        self._theirs: Optional[_Segment] = None
        self._bell_in = -1  # read end of this rank's FIFO (the peer writes)
        self._bell_out = -1  # write end of the peer's FIFO
        self._peer_pid = 0
        self._peer_gone = ""  # why the peer will publish nothing more (its chunks already there still count)
        self._fds: List[int] = []
        self._seq = 0
        self._published: List[Tuple[int, int, int]] = []  # (seq, offset, aligned bytes) in the arena
        self._deferred: Deque[Tuple[Exchange, torch.Tensor]] = deque()  # (exchange, copy of its chunk)
        self._receiving: Deque[Exchange] = deque()  # issued here, peer's chunk not taken yet
        self._finalizer: Optional[weakref.finalize] = None
        self.deferrals = 0  # chunks that had to wait for room in the arena (diagnostics)
        self.published_bytes = 0  # all chunks this rank has given the peer (diagnostics)
        self._tags: Dict[str, int] = {}  # label -> digest, of what this rank exchanges (the peer's are named by it)
        self._poller: Optional[Any] = None  # waits on the FIFO (poll: no limit on fd numbers)

    # -- connecting ---------------------------------------------------------------------

    def takes(self, chunk: torch.Tensor) -> bool:
        """Whether ``chunk`` goes through shared memory (the same answer on both ranks: it
        depends on what both agreed and on sizes they share). Connects on first use
        (collective)."""
        if self.state is ChannelState.UNTRIED:
            self._connect()
        return (
            self.state is not ChannelState.UNAVAILABLE and chunk.device.type == "cpu"
            and chunk.numel() * chunk.element_size() <= self.capacity
        )

    def _connect(self) -> None:
        group = self._group()
        if group is None:
            raise RuntimeError(GROUP_DESTROYED)
        self.state = ChannelState.UNAVAILABLE  # (also if a collective below raises: never retried)
        everyone = all_gather_object(_local_facts(self.capacity_hint), self._comm)
        if not _usable(everyone):
            return
        largest = _aligned(max(f["hint"] for f in everyone))
        self.capacity = max(_MIN_ARENA, min(3 * largest, largest + _ROOMY_ARENA))
        token = everyone[0]["token"]
        self._peer_pid = everyone[self.peer]["pid"]
        self.prefix = os.path.join(SHM_DIR, f"flatshard-{token}-")
        paths = [f"{self.prefix}{r}" for r in (0, 1)]
        created = agreed = False
        try:
            created = self._create(paths[self.rank])
            opened = all(all_gather_object(created, self._comm)) and self._open_peer(paths[self.peer])
            agreed = all(all_gather_object(opened, self._comm))
        finally:
            if created:  # both ranks mapped both segments, or gave up, or failed: the names can go
                _quietly(os.unlink, [paths[self.rank], paths[self.rank] + ".bell"])
        if agreed:
            self.state = ChannelState.READY
        else:
            self._mine = self._theirs = self._poller = None
            _quietly(os.close, self._fds)
            del self._fds[:]  # (the finalizer holds this list)

    def _create(self, path: str) -> bool:
        """Make, size and map this rank's segment and its FIFO (``False``: not possible here;
        whatever was made is removed again)."""
        self._finalizer = weakref.finalize(self, _quietly, os.close, self._fds)
        size = _HEADER_BYTES + self.capacity
        made: List[str] = []
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            made.append(path)
            try:
                os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS on first touch
                self._mine = _Segment(mmap.mmap(fd, size))
            finally:
                os.close(fd)
            os.mkfifo(path + ".bell", 0o600)
            made.append(path + ".bell")
            self._bell_in = os.open(path + ".bell", os.O_RDONLY | os.O_NONBLOCK)
            self._fds.append(self._bell_in)
            self._poller = select.poll()
            self._poller.register(self._bell_in, select.POLLIN)
        except OSError:
            _quietly(os.unlink, made)
            return False
        return True

    def _open_peer(self, path: str) -> bool:
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                self._theirs = _Segment(mmap.mmap(fd, _HEADER_BYTES + self.capacity))
            finally:
                os.close(fd)
            self._bell_out = os.open(path + ".bell", os.O_WRONLY | os.O_NONBLOCK)
            self._fds.append(self._bell_out)
        except (OSError, ValueError):
            return False
        return True

    # -- exchanging ---------------------------------------------------------------------

    def name(self, label: str) -> int:
        """The digest exchanges of ``label`` carry; known from now on, so that an error can name
        ``label`` when it is what the peer exchanged, even before this rank exchanged it."""
        tag = self._tags.get(label)
        if tag is None:
            tag = self._tags[label] = fingerprint(label) if label else 0
        return tag

    def exchange(self, kind: int, chunk: torch.Tensor, arrive: Callable[[torch.Tensor], Any], label: str = "") -> Exchange:
        """Publish ``chunk`` (1-D, contiguous, on the CPU) for the peer and return the swap in
        flight; ``arrive(peer_chunk)`` runs once the peer's chunk of the same exchange is there
        (possibly during a later call into the channel, before ``wait()``). ``label`` names
        what the chunk is of; the peer's exchange must have the same."""
        self._check_usable()
        self._seq += 1
        tag = self.name(label)
        op = Exchange(self, self._seq, kind, chunk.dtype, chunk.numel() * chunk.element_size(), label, tag, arrive)
        self._receiving.append(op)
        self.published_bytes += op.nbytes
        if self._deferred or not self._publish(op, chunk):
            self._deferred.append((op, chunk.detach().clone()))
            self.deferrals += 1
            self._segment(self._mine).words[_DEFERRING] = 1
        self._progress()
        return op

    def complete(self, op: Exchange) -> None:
        """Return once ``op``'s peer chunk has arrived and this rank's is published (raise if
        the ranks disagree, the peer left, or the process group's timeout passes).

        Not before this rank's chunk is published: the peer may be waiting for it, and this
        rank may block elsewhere next (e.g. in a gloo collective the peer would only reach
        after this exchange)."""
        started = time.monotonic()
        spin_until = started + _SPIN_S
        look_at = started + SLICE_S
        while True:
            self._progress()
            if op.done and op.published:
                return
            if self.watch is not None and time.monotonic() > look_at:
                look_at += SLICE_S
                self._look(started, op)
            if self._peer_gone:
                self._break(f"{self._peer_gone} while rank {self.rank} waited for rank {self.peer}'s side of collective #{op.seq}, {_a(op.describe())}")
            self._check_usable()
            now = time.monotonic()
            if now < spin_until:
                continue
            if now - started > self.timeout_s:
                self._break(
                    f"[rank {self.rank}] waited {now - started:.1f} s (the process group's timeout) "
                    f"for rank {self.peer}'s side of collective #{op.seq}, {_a(op.describe())}, through shared memory"
                )
                self._check_usable()
            self._sleep()

    def _look(self, started: float, op: Exchange) -> None:
        """Between slices of a wait: the peers' failures ([Note: peer failures]); an exchange
        abandoned half-way leaves the channel unusable."""
        try:
            self.watch.look(started, f"collective #{op.seq}, {_a(op.describe())}, through shared memory")  # type: ignore[union-attr]
        except Exception as exc:
            self._break(str(exc))
            raise

    def _publish(self, op: Exchange, chunk: torch.Tensor) -> bool:
        """Copy ``chunk`` into the arena and write ``op``'s record, if there is room."""
        mine, theirs = self._segment(self._mine), self._segment(self._theirs)
        seq = op.seq
        slot = (seq % _RECORDS) * _FIELDS
        if seq > _RECORDS and theirs.words[_ACKS + seq % _RECORDS] < seq - _RECORDS:
            return False  # the record slot's last publication is not taken yet
        nbytes = chunk.numel() * chunk.element_size()
        offset = self._allocate(nbytes)
        if offset is None:
            return False
        mine.chunk(offset, nbytes, chunk.dtype).copy_(chunk.detach())
        words = mine.words
        kind, code, _, tag = op.key
        words[slot + 1], words[slot + 2], words[slot + 3], words[slot + 4], words[slot + 5] = kind, code, nbytes, offset, tag
        words[slot] = seq  # last: the record is visible from here on
        op.published = True
        self._published.append((seq, offset, _aligned(nbytes)))
        self._ring()
        return True

    def _allocate(self, nbytes: int) -> Optional[int]:
        """The lowest arena offset with room for ``nbytes`` (first fit), after dropping the
        chunks the peer has taken; ``None`` if there is none."""
        acks = self._segment(self._theirs).words
        self._published = [p for p in self._published if acks[_ACKS + p[0] % _RECORDS] < p[0]]
        need, start = _aligned(nbytes), 0
        for _, offset, size in sorted(self._published, key=lambda p: p[1]):
            if offset - start >= need:
                return start
            start = max(start, offset + size)
        return start if self.capacity - start >= need else None

    def _progress(self) -> None:
        """Publish what waited for room, then take every peer chunk that is there, in order."""
        if self.state is not ChannelState.READY:
            return
        while self._deferred:
            op, chunk = self._deferred[0]
            if not self._publish(op, chunk):
                break
            self._deferred.popleft()
            if not self._deferred:
                self._segment(self._mine).words[_DEFERRING] = 0
        theirs = self._segment(self._theirs)
        while self._receiving and self.state is ChannelState.READY:
            op = self._receiving[0]
            slot = (op.seq % _RECORDS) * _FIELDS
            if theirs.words[slot] != op.seq:
                return
            kind, code, nbytes, offset, tag = theirs.words[slot + 1 : slot + 6].tolist()
            if (kind, code, nbytes, tag) != op.key:
                dtype = next((str(d) for d, c in _DTYPE_CODES.items() if c == code), "an unknown dtype")
                label = next((text for text, t in self._tags.items() if t == tag), "something this rank does not know")
                said = {self.rank: op.describe(), self.peer: _describe(kind, label, nbytes, dtype)}
                self._break(
                    f"[rank {self.rank}] the ranks disagree on collective #{op.seq} of this model "
                    f"(every rank must run the same units in the same order, e.g. no data-dependent "
                    f"skipping): rank 0 issued {_a(said[0])}; rank 1 {_a(said[1])}"
                )
                return
            op.arrive(theirs.chunk(offset, nbytes, op.dtype))
            self._segment(self._mine).words[_ACKS + op.seq % _RECORDS] = op.seq
            op.done = True
            self._receiving.popleft()
            if theirs.words[_DEFERRING]:
                self._ring()  # the peer may be waiting for this room

    def _sleep(self) -> None:
        """Sleep until the peer rings (or ``_SLEEP_S``); end-of-file: the peer has gone.

        While chunks wait for room, sleep 1 ms at most: the peer rings after taking a chunk
        only if it sees this rank's flag, and its read of the flag may pass its write of the
        acknowledgement (x86 orders stores, not a store before a later load)."""
        if self._poller is None:
            raise AssertionError(f"[rank {self.rank}] shared-memory exchange waited before it was connected")
        ready = self._poller.poll(1 if self._deferred else int(_SLEEP_S * 1000))
        if not ready:
            # (a child the peer forked after connecting keeps the FIFO open when it dies)
            if _exited(self._peer_pid):
                self._peer_gone = f"rank {self.peer} (process {self._peer_pid}) exited"
            return
        try:
            while True:
                if not os.read(self._bell_in, 4096):
                    self._peer_gone = _CLOSED.format(peer=self.peer)
                    return
        except BlockingIOError:
            pass

    def _ring(self) -> None:
        try:
            os.write(self._bell_out, b"\0")
        except BlockingIOError:
            pass  # the FIFO is full of rings the peer has not read: it will look anyway
        except BrokenPipeError:
            self._peer_gone = _CLOSED.format(peer=self.peer)

    def _break(self, problem: str) -> None:
        if self.state is not ChannelState.BROKEN:
            self.state = ChannelState.BROKEN
            self.problem = problem

    def _check_usable(self) -> None:
        if self.state is ChannelState.BROKEN:
            raise RuntimeError(self.problem)
        if self.state is not ChannelState.READY:
            raise AssertionError(f"[rank {self.rank}] shared-memory exchange used while {self.state.name}")

    def _segment(self, segment: Optional[_Segment]) -> _Segment:
        if segment is None:
            raise AssertionError(f"[rank {self.rank}] shared-memory segment used before it was mapped")
        return segment


def _local_facts(hint: int) -> Dict[str, Any]:
    """What decides whether two ranks can share memory, as this rank sees it."""
    def read(path: str) -> str:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return ""

    def namespace() -> str:
        try:
            return os.readlink("/proc/self/ns/pid")
        except OSError:
            return ""

    return {
        "enabled": os.environ.get(ENV_SWITCH, "1").strip() not in ("0", "false", "no", "off"),
        "machine": platform.machine(),
        "host": (socket.gethostname(), read("/proc/sys/kernel/random/boot_id"), namespace()),
        "writable": available_here(),
        "token": secrets.token_hex(8),
        "pid": os.getpid(),
        "hint": hint,
    }


def available_here() -> bool:
    """Whether this process could share memory with a peer on its host (x86, a writable
    ``/dev/shm``, the system calls needed); the peer and the switch are asked at connection."""
    return (
        platform.machine() in _IN_ORDER_STORES and os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)
        and hasattr(os, "posix_fallocate") and hasattr(os, "mkfifo") and hasattr(select, "poll")
    )


def _exited(pid: int) -> bool:
    """Whether process ``pid`` (in this PID namespace) has exited, reaped or not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def _usable(everyone: List[Dict[str, Any]]) -> bool:
    return (
        len(everyone) == 2
        and all(f["enabled"] and f["machine"] in _IN_ORDER_STORES and f["writable"] and all(f["host"]) for f in everyone)
        and everyone[0]["host"] == everyone[1]["host"]
    )
