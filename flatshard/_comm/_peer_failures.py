"""No rank waits alone: a rank that leaves a call tells the others through the store.

[Note: peer failures] A rank whose flatshard call raises after the call's first collective
(a forward or backward that raised, a state dict, a clip, a checkpoint: see [Note: one guarded
path] in ``_guard``) leaves its peers inside that call's collectives: they would wait for it
until the process group's timeout, or pair their next collectives with the wrong ones (gloo
aborts the process on a size mismatch). (A call that raises before its first collective tells
its peers through the call's entry check instead, and the process group stays usable.) So every
``Guard`` has a ``StepWatch``:

- a rank that leaves a call (its forward raised: ``abandon_forward``; its backward raised: the
  next call's ``settle``; any other guarded call raised after its entry check; a collective of
  its own failed) writes one record in the default store: LEFT, with the call's tag and what
  it raised, where; then it settles at once, before its error reaches the caller: it waits
  until every peer has a record for that call. Every peer that left the same call too (every
  rank raised alike in its own code, nothing left in flight: e.g. a forward that raises alike
  on every rank, see [Note: a forward that raised]) -- then each writes CLEARED and the ranks
  go on. Else the rank is stuck. Settling at once means the rank makes no other collective
  (of another object over the same group, say) while a peer still waits in the one it left;
- waits on gloo collectives and on the shared-memory exchange run in slices of ``SLICE_S``; a
  wait that outlasts a slice looks at the peers' records, and a LEFT of a call this rank did
  not leave alike, or a STUCK, ends the wait with an error naming that rank, what it raised
  and where. The rank that raised it is then stuck: its process group holds a collective that
  can never complete;
- a stuck rank raises at every later call of its guard, and of every other flatshard object
  of its process ([Note: a stuck process]): none of them makes another collective.

The records live under one key per rank for the whole job, so every flatshard object sees them
(a second model, a ``RunCheckpoints``, a ``ShardedGradScaler``): a rank that waits in one
object's call learns of a peer that left another's. Tags name the object (its number among this
rank's watches, the same on every rank when the ranks make the same objects in the same order)
and its call count.

While nothing fails nothing touches the store: a wait shorter than a slice costs what it did,
and a longer one costs one store request per slice, whatever the number of ranks ([Note: one
counter of changes]). A wait that reaches the process group's timeout raises a report instead
(``timeout_report``): this rank's last collectives, the peers that reached the same collective
and those that did not, and the step.

[Note: one counter of changes] Every record written bumps one job-wide counter in the store
(``_CHANGES``), after the record is set. A waiting rank reads the counter once per slice
(``add(key, 0)``) and reads the peers' records only when it moved since its last full read,
keeping that read's verdict otherwise: the verdict depends on nothing but the records and
this rank's ``left_tag``, and a record that is set is counted before anyone can see the count
move. So one slow rank (rank 0 writing a checkpoint) costs each of the N - 1 waiting ranks one
request per slice, not N - 1 (N^2 requests per slice on one TCPStore at N ranks). Each watch
makes one full read first, however the counter stands, so the records that were in the store
before it was made (a peer stuck in another object's call) are read as they were before; a
store that cannot answer the counter gets a full read, as before. The process keys that tell
a peer's host and pid (written once, when the peer makes its watch) are read once per peer.

Which waits can still only end at the timeout: NCCL's (a NCCL wait does not block the host;
the host blocks later, in a synchronisation flatshard does not own), those inside
``torch.distributed.checkpoint``'s own collectives, and a peer that stops without raising and
without exiting (a deadlock in user code, an endless loop): it writes no record, so the others
learn nothing before the timeout report.
"""

from __future__ import annotations

import gc
import os
import socket
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple, TypeVar

__all__ = ["PeerFailedError", "RecordState", "StepWatch", "SLICE_S", "make_watch", "mark_raised_together", "raised_together", "together"]

_E = TypeVar("_E", bound=BaseException)

# How long a wait runs before it looks at the peers' records (and between looks).
SLICE_S = 1.0
# Where every rank's record and its watches' count live in the default store.
_KEY = "flatshard/watch"
# Bumped after every record written ([Note: one counter of changes]).
_CHANGES = f"{_KEY}/changes"
# The note on an error every rank raised at once (``mark_raised_together``).
_TOGETHER = "(flatshard: every rank raised this together, before any collective could pair wrongly; the process group is usable)"
# How often the rank that left a call looks for its peers' records while it decides.
_POLL_S = 0.05
_LAST = 8  # collectives remembered for the timeout report


class PeerFailedError(RuntimeError):
    """A peer left the call this rank is in (its error says which and why), or this rank's
    process group is stuck since."""


class RecordState(Enum):
    """What a rank's record in the store says (see [Note: peer failures])."""

    LEFT = "left"  # it raised in the call of ``tag`` after its first collective
    CLEARED = "cleared"  # every rank left that call alike; the ranks went on together
    STUCK = "stuck"  # its process group holds a collective that can never complete


@dataclass(frozen=True)
class _Record:
    state: RecordState
    tag: str
    text: str

    def encode(self) -> bytes:
        return f"{self.state.value}|{self.tag}|{self.text}".encode()

    @staticmethod
    def decode(raw: bytes) -> "_Record":
        state, tag, text = raw.decode(errors="replace").split("|", 2)
        return _Record(RecordState(state), tag, text)


class StepWatch:
    """One guard's view of its peers' failures (see [Note: peer failures]).

    Args:
        store: a store every rank reaches (``torch.distributed.Store``).
        number: which watch of this rank it is (the same on every rank).
        rank: this rank (global); ``peers``: the other ranks of the guard's groups (global).
        timeout: the process group's timeout.
    """

    def __init__(self, store: Any, number: int, rank: int, peers: List[int], timeout: timedelta) -> None:
        self.store = store
        self.number = number
        self.rank = rank
        self.peers = list(peers)
        self.timeout_s = timeout.total_seconds()
        self.step = 0  # root forwards (the "step" errors name)
        self.calls = 0  # calls counted (the tags' count)
        self.tag = self._tag()  # the call this rank is in, or was in last
        self.left_tag = ""  # the last call this rank left (its record written)
        self.settled_tag = ""  # the last call this rank left and settled with its peers
        # Why this rank's process group can no longer be used.
        self.stuck: Optional[str] = None
        self.issued = 0  # collectives issued through this guard
        self.last: Deque[Tuple[int, int, str]] = deque(maxlen=_LAST)  # (number, step, what)
        # The last full read of the peers' records: (the counter of changes, ``left_tag``)
        # then, and its verdict ([Note: one counter of changes]).
        self.seen: Optional[Tuple[int, str]] = None
        self.verdict: Optional[_Record] = None
        # The peers' processes as their watches wrote them: (host, pid), once read.
        self.processes: Dict[int, Tuple[str, int]] = {}

    def _tag(self) -> str:
        return f"{self.number}:{self.calls}"

    # -- the steady state ---------------------------------------------------------------------

    def begin_step(self) -> None:
        """A root forward starts (a new step, for the messages)."""
        self.step += 1

    def enter(self) -> None:
        """A call starts: raise if this rank cannot take part."""
        if self.stuck is not None:
            raise PeerFailedError(self._said(self.stuck))

    def next_call(self) -> None:
        """The call that started makes its first collective: it counts from now on."""
        self.calls += 1
        self.tag = self._tag()

    def issue(self, what: str) -> None:
        """Before each collective: raise if this rank cannot take part (see the Note)."""
        if self.stuck is not None:
            raise PeerFailedError(self._said(self.stuck))
        self.issued += 1
        self.last.append((self.issued, self.step, what))

    # -- leaving a call ---------------------------------------------------------------------------

    def leave(self, where: str, error: BaseException) -> None:
        """This rank leaves the current call: its ``where`` (what and which phase) raised
        ``error``. Settles with the peers before returning (see the Note); the caller raises."""
        if isinstance(error, PeerFailedError) or raised_together(error):
            return  # (its peers know: it is stuck, or every rank raised it at once)
        self.leave_with(f"rank {self.rank} raised {type(error).__name__}({_short(error)}) in {where}")

    def leave_with(self, text: str) -> None:
        """This rank leaves the current call, for the reason ``text`` (it names the rank), and
        settles with the peers (see the Note)."""
        if self.stuck is not None or self.settled_tag == self.tag:
            return
        self.announce(text)
        self.settled_tag = self.tag
        self._settle(_Record(RecordState.LEFT, self.tag, text))

    def announce(self, text: str) -> None:
        """Write that this rank leaves the current call, for the reason ``text``, without
        settling (a finalizer must not wait); ``leave_with`` settles later."""
        if self.stuck is None and self.left_tag != self.tag:
            self.left_tag = self.tag
            self._write(_Record(RecordState.LEFT, self.tag, text))

    def _settle(self, left: _Record) -> None:
        """Wait until every peer has a record of the call this rank left: go on (CLEARED) if
        every one left it too, else become stuck."""
        deadline = time.monotonic() + self.timeout_s
        pending = list(self.peers)
        read_at: Optional[int] = None  # the counter of changes at the last read of the records
        while pending:
            changes = self._changes()
            if changes is not None and changes == read_at:
                peers: List[int] = []  # (no record changed: [Note: one counter of changes])
            else:
                peers, read_at = list(pending), changes
            for peer in peers:
                record = self._read(peer)
                if record is None or (record.state is not RecordState.STUCK and record.tag != left.tag and not _later(record.tag, left.tag)):
                    continue  # (nothing yet about this call: it is still in it, or has not heard)
                if record.state is RecordState.STUCK or record.tag != left.tag:
                    self._become_stuck(f"the ranks cannot go on together: {left.text}; rank {peer} could not go on: {record.text}")
                    return
                pending.remove(peer)
            if pending and (time.monotonic() > deadline or self._exited_peers(pending)):
                gone = "; ".join(self._exited_peers(pending))
                self._become_stuck(
                    f"the ranks cannot go on together: {left.text}, and ranks {pending} did not leave that call "
                    + (f"({gone})" if gone else f"within the process group's timeout ({self.timeout_s:.0f} s)")
                )
                return
            if pending:
                time.sleep(_POLL_S)
        self._write(_Record(RecordState.CLEARED, left.tag, left.text))

    def _become_stuck(self, why: str) -> None:
        """This rank's groups hold, or a peer's hold, a collective that can never complete: say
        so, and stop every other flatshard object of this process too ([Note: a stuck process])."""
        self.stuck = why
        self._write(_Record(RecordState.STUCK, self.tag, why))
        _stop_other_watches(self, why)

    # -- waiting ----------------------------------------------------------------------------------

    def wait(self, work: Any, what: str) -> None:
        """Wait for ``work`` (a gloo ``Work``) in slices, looking at the peers' records."""
        if self.stuck is not None:
            raise PeerFailedError(self._said(self.stuck))
        started = time.monotonic()
        while True:
            try:
                work.wait(timeout=timedelta(seconds=SLICE_S))
                return
            except RuntimeError as exc:
                if work.is_completed():  # (failed, not a slice that ran out)
                    self._fail_collective(what, exc, started)
            self.look(started, what)

    def _fail_collective(self, what: str, exc: BaseException, started: float) -> None:
        """This rank's collective failed. A peer that left the call (and then, say, closed
        its connections: gloo's "Connection closed by peer") wrote its record before it did,
        so the records come first, naming that rank; then gloo's own timeout (the process
        group's, reached as this rank's): the timeout report; else the peers whose process
        exited."""
        failure = f"its collective {what} failed: {type(exc).__name__}: {_short(exc)}"
        record = self._peer_failure()
        if record is not None:
            self.fail_wait(f"{record.text}, while rank {self.rank} waited in {what} ({failure})")
        waited = time.monotonic() - started
        if "Timed out" in str(exc) or waited >= self.timeout_s:
            self.fail_wait(self.timeout_report(what, max(waited, self.timeout_s)))
        gone = "; ".join(self._exited_peers(self.peers))
        self.fail_wait(f"{gone + ': ' if gone else ''}{failure}")

    def _peer_failure(self) -> Optional[_Record]:
        """A peer's record that this rank cannot go on past: a LEFT of a call this rank did not
        leave alike (the rank that left first, before those it left stuck), or a STUCK. One
        store request while no record changed ([Note: one counter of changes])."""
        changes = self._changes()  # (before the records: a record set later moves it again)
        if changes is not None and self.seen == (changes, self.left_tag):
            return self.verdict
        verdict = self._read_failures()
        self.seen = None if changes is None else (changes, self.left_tag)
        self.verdict = verdict
        return verdict

    def _read_failures(self) -> Optional[_Record]:
        """``_peer_failure`` from every peer's record (a full read: one request or two per peer)."""
        found: List[_Record] = []
        mine: Optional[_Record] = None
        for record in map(self._read, self.peers):
            if record is None or record.state is RecordState.CLEARED:
                continue
            if record.state is RecordState.LEFT:
                if record.tag == self.left_tag:
                    continue  # (left alike: settling)
                mine = mine or self._read(self.rank) or _Record(RecordState.CLEARED, "", "")
                if mine.state is not RecordState.STUCK and mine.tag == record.tag:
                    continue  # (this rank left that call too, through another object's guard)
            found.append(record)
        return min(found, key=lambda r: r.state is RecordState.STUCK) if found else None

    def look(self, started: float, what: str) -> None:
        """Between slices of a wait: raise if a peer left or the timeout passed."""
        record = self._peer_failure()
        if record is not None:
            self.fail_wait(f"{record.text}, while rank {self.rank} waited in {what}")
        if time.monotonic() - started > self.timeout_s:
            self.fail_wait(self.timeout_report(what, time.monotonic() - started))

    def fail_wait(self, why: str) -> None:
        """A wait of this rank ends in an error: its collective can never complete."""
        self._become_stuck(why)
        raise PeerFailedError(self._said(why))

    def _said(self, why: str) -> str:
        return f"[rank {self.rank}] {why}"

    def timeout_report(self, what: str, waited: float) -> str:
        """What a rank that waited the whole timeout says: its last collectives, which peers
        reached the same one, and the step."""
        mine = f"{self.tag}:{self.issued}"
        self.store.set(f"{_KEY}/at/{self.rank}", f"{mine}|{what}".encode())
        deadline = time.monotonic() + min(2 * SLICE_S, self.timeout_s)
        theirs: Dict[int, str] = {}
        while time.monotonic() < deadline and len(theirs) < len(self.peers):
            for peer in self.peers:
                if peer not in theirs and self.store.check([f"{_KEY}/at/{peer}"]):
                    theirs[peer] = self.store.get(f"{_KEY}/at/{peer}").decode(errors="replace")
            time.sleep(_POLL_S)
        joined = [p for p, v in theirs.items() if v.split("|", 1)[0] == mine]
        behind = [p for p in self.peers if p not in joined]
        where = [f"rank {p} waits in {theirs[p].split('|', 1)[1]} (call:collective {theirs[p].split('|', 1)[0]})" for p in behind if p in theirs]
        lines = [
            f"waited {waited:.0f} s (the process group's timeout) in {what}, collective #{self.issued} of step {self.step}",
            f"ranks that reached it too: {joined or 'none'}; ranks that did not: {behind or 'none'}"
            + (" (" + "; ".join(where) + ")" if where else ""),
            "this rank's last collectives: " + "; ".join(f"#{n} (step {s}) {w}" for n, s, w in self.last),
        ]
        return "\n".join(lines)

    def _exited_peers(self, peers: Sequence[int]) -> List[str]:
        """Of ``peers``, those on this host whose process has exited (a peer elsewhere cannot
        be looked at)."""
        gone = []
        here = socket.gethostname()
        for peer in peers:
            process = self._process(peer)
            if process is not None and process[0] == here and not _alive(process[1]):
                gone.append(f"rank {peer} (process {process[1]}) exited")
        return gone

    def _process(self, peer: int) -> Optional[Tuple[str, int]]:
        """``peer``'s (host, pid), read from the store once it is there."""
        if peer not in self.processes:
            key = f"{_KEY}/process/{peer}"
            try:
                if not self.store.check([key]):
                    return None
                host, pid = self.store.get(key).decode().rsplit(":", 1)
                self.processes[peer] = (host, int(pid))
            except Exception:  # noqa: BLE001
                return None
        return self.processes[peer]

    # -- the store ----------------------------------------------------------------------------------

    def _write(self, record: _Record) -> None:
        try:
            self.store.set(f"{_KEY}/left/{self.rank}", record.encode())
            self.store.add(_CHANGES, 1)  # (after the record: see [Note: one counter of changes])
        except Exception:  # noqa: BLE001 - the store itself is gone: nothing left to tell
            pass

    def _changes(self) -> Optional[int]:
        """The job's counter of records written; ``None`` if the store cannot say."""
        try:
            return int(self.store.add(_CHANGES, 0))
        except Exception:  # noqa: BLE001 - then every look reads the records, as before
            return None

    def _read(self, rank: int) -> Optional[_Record]:
        key = f"{_KEY}/left/{rank}"
        try:
            if not self.store.check([key]):
                return None
            return _Record.decode(self.store.get(key))
        except Exception:  # noqa: BLE001 - a store that cannot answer tells nothing
            return None


def make_watch(store: Any, rank: int, peers: Sequence[int], timeout: timedelta) -> Optional[StepWatch]:
    """A new guard's ``StepWatch``: its number is this rank's count of watches so far, the
    same on every rank of its groups when the ranks make the same objects in the same order."""
    if not peers:
        return None
    number = store.add(f"{_KEY}/watches/{rank}", 1)
    watch = StepWatch(store, number, rank, [p for p in peers if p != rank], timeout)
    store.set(f"{_KEY}/process/{rank}", f"{socket.gethostname()}:{os.getpid()}".encode())
    return watch


def _stop_other_watches(stuck: StepWatch, why: str) -> None:
    """[Note: a stuck process] A rank becomes stuck in one object's call: a peer holds a
    collective this rank never issued (or this rank holds one a peer never will), on a group
    that other flatshard objects of this process may share (a second model, a
    ``RunCheckpoints``, a scaler, the same model's deep copy). The next collective any of them
    issues there would be paired with that orphan -- gloo aborts the process on the size
    mismatch (``gloo::EnforceNotMet``) -- so every watch of this process is stopped with it:
    each raises at its next call instead of communicating. They are found among the objects the
    garbage collector tracks (this runs once, when a rank gets stuck; there is no registry of
    watches, and none is needed while nothing fails)."""
    for other in gc.get_objects():
        if type(other) is StepWatch and other is not stuck and other.stuck is None and other.rank == stuck.rank:
            other.stuck = f"{why} (this rank stopped there, in another flatshard object's call)"


def raised_together(error: BaseException) -> bool:
    """Whether ``error`` was raised on every rank at once (by an entry check or a position
    check, see ``mark_raised_together``): its peers know, and the process group is usable."""
    return _TOGETHER in getattr(error, "__notes__", ())


def mark_raised_together(error: BaseException) -> None:
    """Note on ``error`` that every rank raised at once where this rank raised it."""
    if not raised_together(error):
        error.add_note(_TOGETHER)


def together(error: _E) -> _E:
    """``error``, marked as raised on every rank at once (``raise together(ValueError(...))``).

    Only at a ``raise`` that a collective has just decided alike on every rank: never around
    code that can still fail on one rank alone. (Marking every error out of a check that
    communicates marked a rank's failure inside the check's own collective as well, and its
    peers then waited in that collective for the timeout.)"""
    mark_raised_together(error)
    return error


def _later(tag: str, than: str) -> bool:
    """Whether call ``tag`` of an object came after call ``than`` of the same object."""
    number, calls = tag.split(":")
    other_number, other_calls = than.split(":")
    return number == other_number and int(calls) > int(other_calls)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # (a child that exited but was not reaped yet)
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _short(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return repr(text[:200])
