"""No rank waits alone: a rank that leaves a step tells the others through the store.

[Note: peer failures] A rank whose forward or backward raises leaves the step; its peers are in
the same step's collectives and would wait for it until the process group's timeout (or pair
their next collectives with the wrong ones). So every root has a ``StepWatch``:

- a rank that leaves step k (its forward raised: ``abandon_forward``; its backward raised: the
  next forward's ``settle``; a collective of its own failed) writes one record under the
  root's key in the process group's store: the step, what it raised, where, and whether it
  left a collective in flight that can never complete ("stuck");
- waits on gloo collectives and on the shared-memory exchange run in slices of ``SLICE_S``; a
  wait that outlasts a slice looks at the peers' records, and one for its own step ends the
  wait with an error naming that rank, what it raised, the unit and the phase. The rank that
  raised it is then stuck (its collective can never complete) and says so in its own record;
- the rank that left raises at its next flatshard collective unless every peer left the same
  step cleanly (each raised in its own code and nothing was left in flight: a forward that
  raises alike on every rank leaves the model usable, see [Note: a forward that raised]). It
  waits for the peers' records for up to the process group's timeout to decide.
- A stuck rank raises at every later collective: its process group holds a collective that
  will never complete, and gloo would pair the next ones with the wrong partners.

While nothing fails nothing touches the store: a wait shorter than a slice costs what it did,
and a longer one costs one store lookup per peer per slice. A wait that reaches the process
group's timeout raises a report instead (``timeout_report``): this rank's last collectives, the
peers that reached the same collective and those that did not, and the step.

Which waits can still only end at the timeout: NCCL's (a NCCL wait does not block the host;
the host blocks later, in a synchronisation flatshard does not own), and a peer that stops
without raising and without exiting (a deadlock in user code, an endless loop): it writes no
record, so the others learn nothing before the timeout report.
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Deque, Dict, List, Optional, Tuple

__all__ = ["PeerFailedError", "StepWatch", "SLICE_S", "make_watch"]

# How long a wait runs before it looks at the peers' records (and between looks).
SLICE_S = 1.0
# How often the rank that left a step looks for its peers' records while it decides.
_POLL_S = 0.05
_LAST = 8  # collectives remembered for the timeout report


class PeerFailedError(RuntimeError):
    """A peer left the step this rank is in (its error says which and why), or this rank's
    process group is stuck since."""


@dataclass(frozen=True)
class _Record:
    step: int
    stuck: bool
    text: str

    def encode(self) -> bytes:
        return f"{self.step}|{int(self.stuck)}|{self.text}".encode()

    @staticmethod
    def decode(raw: bytes) -> "_Record":
        step, stuck, text = raw.decode(errors="replace").split("|", 2)
        return _Record(int(step), stuck == "1", text)


class StepWatch:
    """One root's view of its peers' failures (see [Note: peer failures]).

    Args:
        store: a store every rank reaches (``torch.distributed.Store``).
        key: this root's prefix in the store, the same on every rank.
        rank: this rank (global); ``peers``: the other ranks of the root's groups (global).
        timeout: the process group's timeout.
    """

    def __init__(self, store: Any, key: str, rank: int, peers: List[int], timeout: timedelta) -> None:
        self.store = store
        self.key = key
        self.rank = rank
        self.peers = list(peers)
        self.timeout_s = timeout.total_seconds()
        self.step = 0
        # The step this rank left (with what it said), not yet settled with the peers.
        self.left: Optional[_Record] = None
        # Why this rank's process group can no longer be used.
        self.stuck: Optional[str] = None
        self.issued = 0  # collectives issued through this root
        self.last: Deque[Tuple[int, int, str]] = deque(maxlen=_LAST)  # (number, step, what)

    # -- the steady state ---------------------------------------------------------------------

    def begin_step(self) -> None:
        self.step += 1

    def issue(self, what: str) -> None:
        """Before each collective: raise if this rank cannot take part (see the Note)."""
        if self.stuck is not None:
            raise PeerFailedError(self.stuck)
        if self.left is not None:
            self._settle_left()
        self.issued += 1
        self.last.append((self.issued, self.step, what))

    # -- leaving a step -------------------------------------------------------------------------

    def leave(self, where: str, error: BaseException) -> None:
        """This rank leaves the current step: its ``where`` (unit and phase) raised ``error``."""
        if isinstance(error, PeerFailedError) or self.stuck is not None:
            return  # (its record says so already)
        if self.left is not None and self.left.step == self.step:
            return  # (an enclosing unit's forward, which the same error leaves)
        self.leave_with(f"rank {self.rank} raised {type(error).__name__}({_short(error)}) in {where} of step {self.step}")

    def leave_with(self, text: str) -> None:
        """This rank leaves the current step, for the reason ``text`` (it names the rank)."""
        if self.stuck is None and (self.left is None or self.left.step != self.step):
            self.left = _Record(self.step, False, text)
            self._write(self.left)

    def _settle_left(self) -> None:
        """Continue only if every peer left the same step cleanly; else raise."""
        left = self.left
        self.left = None
        if left is None:
            return
        deadline = time.monotonic() + self.timeout_s
        pending = list(self.peers)
        while pending:
            for peer in list(pending):
                record = self._read(peer)
                if record is None or record.step < left.step:
                    continue
                if record.stuck or record.step > left.step:
                    self._raise_stuck(left.step, f"{left.text}; rank {peer} could not go on: {record.text}")
                pending.remove(peer)
            if pending and time.monotonic() > deadline:
                self._raise_stuck(
                    left.step,
                    f"{left.text}, and ranks {pending} did not leave that step within the process group's "
                    f"timeout ({self.timeout_s:.0f} s)",
                )
            if pending:
                time.sleep(_POLL_S)

    def _raise_stuck(self, step: int, why: str) -> None:
        self.stuck = f"[rank {self.rank}] the ranks cannot go on together: {why}"
        self._write(_Record(step, True, self.stuck))
        raise PeerFailedError(self.stuck)

    # -- waiting ----------------------------------------------------------------------------------

    def wait(self, work: Any, what: str) -> None:
        """Wait for ``work`` (a gloo ``Work``) in slices, looking at the peers' records."""
        if self.stuck is not None:
            raise PeerFailedError(self.stuck)
        started = time.monotonic()
        while True:
            try:
                work.wait(timeout=timedelta(seconds=SLICE_S))
                return
            except RuntimeError as exc:
                if work.is_completed():  # (failed, not a slice that ran out)
                    self._fail_collective(what, exc)
            self.look(started, what)

    def _fail_collective(self, what: str, exc: BaseException) -> None:
        """This rank's collective failed. A peer that left the step (and then, say, closed
        its connections: gloo's "Connection closed by peer") wrote its record before it did,
        so the records come first, naming that rank; else the peers whose process exited."""
        failure = f"its collective {what} failed: {type(exc).__name__}: {_short(exc)}"
        record = self._left_this_step()
        if record is not None:
            self.fail_wait(f"{record.text}, while rank {self.rank} waited in {what} ({failure})")
        gone = "; ".join(self._exited_peers())
        self.fail_wait(f"{gone + ': ' if gone else ''}{failure}")

    def _left_this_step(self) -> Optional[_Record]:
        """A peer's record of leaving this step (the rank that left first, before those it left
        stuck), or ``None``."""
        records = [r for r in map(self._read, self.peers) if r is not None and r.step == self.step]
        return min(records, key=lambda r: r.stuck) if records else None

    def look(self, started: float, what: str) -> None:
        """Between slices of a wait: raise if a peer left this step or the timeout passed."""
        record = self._left_this_step()
        if record is not None:
            self.fail_wait(f"{record.text}, while rank {self.rank} waited in {what}")
        if time.monotonic() - started > self.timeout_s:
            self.fail_wait(self.timeout_report(what, time.monotonic() - started))

    def fail_wait(self, why: str) -> None:
        """A wait of this rank ends in an error: its collective can never complete."""
        self.stuck = f"[rank {self.rank}] {why}"
        self._write(_Record(self.step, True, self.stuck))
        raise PeerFailedError(self.stuck)

    def timeout_report(self, what: str, waited: float) -> str:
        """What a rank that waited the whole timeout says: its last collectives, which peers
        reached the same one, and the step."""
        mine = f"{self.step}:{self.issued}"
        self.store.set(f"{self.key}/at/{self.rank}", f"{mine}|{what}".encode())
        deadline = time.monotonic() + min(2 * SLICE_S, self.timeout_s)
        theirs: Dict[int, str] = {}
        while time.monotonic() < deadline and len(theirs) < len(self.peers):
            for peer in self.peers:
                if peer not in theirs and self.store.check([f"{self.key}/at/{peer}"]):
                    theirs[peer] = self.store.get(f"{self.key}/at/{peer}").decode(errors="replace")
            time.sleep(_POLL_S)
        joined = [p for p, v in theirs.items() if v.split("|", 1)[0] == mine]
        behind = [p for p in self.peers if p not in joined]
        where = [f"rank {p} waits in {theirs[p].split('|', 1)[1]} (step:collective {theirs[p].split('|', 1)[0]})" for p in behind if p in theirs]
        lines = [
            f"waited {waited:.0f} s (the process group's timeout) in {what}, collective #{self.issued} of step {self.step}",
            f"ranks that reached it too: {joined or 'none'}; ranks that did not: {behind or 'none'}"
            + (" (" + "; ".join(where) + ")" if where else ""),
            "this rank's last collectives: " + "; ".join(f"#{n} (step {s}) {w}" for n, s, w in self.last),
        ]
        return "\n".join(lines)

    def _exited_peers(self) -> List[str]:
        """The peers on this host whose process has exited (a peer elsewhere cannot be looked at)."""
        gone = []
        for peer in self.peers:
            key = f"{self.key}/process/{peer}"
            try:
                if not self.store.check([key]):
                    continue
                host, pid = self.store.get(key).decode().rsplit(":", 1)
            except Exception:  # noqa: BLE001
                continue
            if host == socket.gethostname() and not _alive(int(pid)):
                gone.append(f"rank {peer} (process {pid}) exited")
        return gone

    # -- the store ----------------------------------------------------------------------------------

    def _write(self, record: _Record) -> None:
        try:
            self.store.set(f"{self.key}/left/{self.rank}", record.encode())
        except Exception:  # noqa: BLE001 - the store itself is gone: nothing left to tell
            pass

    def _read(self, peer: int) -> Optional[_Record]:
        key = f"{self.key}/left/{peer}"
        try:
            if not self.store.check([key]):
                return None
            return _Record.decode(self.store.get(key))
        except Exception:  # noqa: BLE001 - a store that cannot answer tells nothing
            return None


def make_watch(store: Any, rank: int, peers: List[int], timeout: timedelta) -> Optional[StepWatch]:
    """A new root's ``StepWatch``: its key is this rank's count of roots so far, the same on
    every rank (roots start at their first forward, which the ranks run alike)."""
    if not peers:
        return None
    number = store.add(f"flatshard/roots/{rank}", 1)
    watch = StepWatch(store, f"flatshard/root{number}", rank, peers, timeout)
    store.set(f"{watch.key}/process/{rank}", f"{socket.gethostname()}:{os.getpid()}".encode())
    return watch


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

