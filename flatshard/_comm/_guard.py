"""The one guarded path: every flatshard operation that communicates is a guarded call.

[Note: one guarded path] A collective that only some ranks enter waits for the others until the
process group's timeout, and one that ranks enter from different places pairs the wrong
tensors (gloo aborts the process on a size mismatch). So every flatshard operation that
communicates -- construction, each root forward and backward, state dicts, optimizer state,
``clip_grad_norm_``, ``summon_full_params``, ``apply``, checkpoints, ``load_pretrained``,
``generate``, the grad scaler -- runs as a call of a ``Guard`` (one per model root, per
``RunCheckpoints``, per scaler), and every collective checks that a call is open: a collective
issued outside one is an ``AssertionError`` naming it (``Communicator`` reports every
collective to its guard before issuing it), so a new operation that bypasses the guard fails
the first test that runs it. A call:

1. enters: raises at once if this rank's group is stuck, and settles a call this rank left
   ([Note: peer failures] in ``_peer_failures``);
2. right before its first collective, checks its position: one constant-size agreement (a
   digest of what the call is, its count, and a failure this rank carries, such as an
   optimizer step that raised) over the guard's groups. Every other place a rank can be at --
   another call's entry, the per-step checks of the runtime -- makes the same kind of
   agreement, so ranks that diverged (one skipped a backward, called a different operation,
   or carries a failure) meet in it and all raise, naming each rank's position, before any
   collective that could pair wrong;
3. if it raises before that check (a bad argument, an error on one rank only), makes the check
   with its error instead: every rank raises, naming the rank and what it raised, and the
   process group stays usable;
4. if it raises after the check, writes its record ([Note: peer failures]): its peers, waiting
   in the call's collectives, raise within a slice;
5. ends with an exit check on success, where the operation has no check of its own at its end:
   a peer that raised after its last collective is heard there, so a call returns on every
   rank or raises on every rank.

A call inside a call of the same guard is part of it. Calls that cannot communicate (a world
of one, torch's fake process group) are still opened and closed, without checks.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from enum import Enum, auto
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .._base._errors import DivergedRanksError
from ._collectives import Communicator, all_gather_object, backend_of, default_store, fingerprint, global_rank, timeout_of
from ._host_checks import check_device
from ._peer_failures import PeerFailedError, StepWatch, make_watch

__all__ = ["CallFailedError", "EntryState", "Guard", "Position", "make_guard"]

# What the ranks exchange to explain a failed position check: (where the rank is, its call
# count there or None, what the check compared, the failure it carries or None, whether it
# checks every collective).
Position = Tuple[str, Optional[int], List[str], Optional[str], bool]
# Explains a failed check: the ranks' positions -> text, or None for the guard's own words.
Explain = Callable[[List[Position]], Optional[str]]


class CallFailedError(PeerFailedError):
    """A peer raised in the call this rank is in, before the call's first collective: every
    rank raised instead of communicating, and the process group is still usable."""


class EntryState(Enum):
    """Where the open call is with its entry check ([Note: one guarded path])."""

    CLOSED = auto()  # no call is open
    PENDING = auto()  # made right before the call's first collective
    CHECKING = auto()  # being made
    CHECKED = auto()  # every rank is in this call
    RAISED = auto()  # it raised on every rank alike: nothing is left to tell anyone


class Guard:
    """The calls of one object that communicates (see [Note: one guarded path]).

    Args:
        watch: the ``StepWatch`` over the guard's ranks (``None``: nobody to watch).
        checks: the communicators the position checks run over, in order (a shard group, then
            a replicate group: together they reach every rank of the guard).
        device: where the checks' tensors live when a communicator's backend takes no CPU tensors.
        live: whether the guard's collectives reach other ranks (``False`` alone or on torch's
            fake process group: calls are tracked, nothing is checked).
    """

    def __init__(self, watch: Optional[StepWatch], checks: Sequence[Communicator], device: torch.device, live: bool) -> None:
        self.watch = watch
        self.checks = list(checks)
        self.device = device
        self.live = live
        self.name: Optional[str] = None  # the open call
        self.depth = 0  # calls open (those inside the first are part of it)
        self.entry = EntryState.CLOSED
        self.exit_check = True  # whether the open call ends with an exit check
        self.count = 0  # calls opened, to tell the same operation's calls apart
        # Every collective is preceded by a per-collective order check (TORCH_DISTRIBUTED_DEBUG
        # =DETAIL, an unsynced generate): part of every position, see ``position``.
        self.checking = dist.get_debug_level() == dist.DebugLevel.DETAIL if dist.is_available() else False
        # A failure this rank carries into every call until it is cleared (an optimizer step
        # that raised partway: [Note: a failed optimizer step] in ``_engine/_runtime``).
        self.carried: Optional[str] = None
        self._ignore_carried = False  # the open call restores the model (see ``call``)

    # -- binding ------------------------------------------------------------------------------

    def bind(self, comm: Optional[Communicator], label: str = "") -> None:
        """Guard ``comm``'s collectives (and those of its shared-memory channel)."""
        if comm is None:
            return
        comm.guard = self
        if label:
            comm.label = label
        if comm.channel is not None:
            comm.channel.watch = self.watch

    def use_checks(self, checks: Sequence[Communicator]) -> None:
        """Run the position checks over ``checks`` from now on (the runtime's host-side ones)."""
        for comm in checks:
            self.bind(comm, comm.label or "the agreement checks")
        self.checks = list(checks)

    # -- calls ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def call(self, name: str, exit_check: bool = True, clears: bool = False) -> Iterator["Guard"]:
        """Run the ``with`` block as the call ``name`` (see [Note: one guarded path]).

        Args:
            name: the operation, as errors name it (e.g. ``"clip_grad_norm_()"``).
            exit_check: end with an exit check on success.
            clears: the call restores the model (a load): a failure this rank carries does not
                stop it, and is cleared when it succeeds.
        """
        opened = self.open(name, exit_check=exit_check, ignore_carried=clears)
        # (a call inside a call is closed too: ``close`` only takes back its depth, so the
        # outer call still ends the guard's call)
        try:
            yield self
        except BaseException as error:
            self.close(error, name)
            raise
        self.close(None, name)
        if opened and clears:
            self.carried = None

    def open(self, name: str, eager: bool = False, exit_check: bool = True, ignore_carried: bool = False) -> bool:
        """Open the call ``name``; ``False`` if a call is open already (this one is part of it).
        ``eager``: make the entry check now rather than before the first collective."""
        if self.depth:
            self.depth += 1
            return False
        if self.watch is not None:
            self.watch.enter()
        self.name, self.depth, self.exit_check = name, 1, exit_check
        self.entry = EntryState.PENDING
        self._ignore_carried = ignore_carried
        if eager:
            self.check_entry()
        return True

    def close(self, error: Optional[BaseException], where: str) -> None:
        """Close the call opened last: with ``error``, tell the peers (before its first
        collective through the entry check, which raises on every rank; after it through the
        watch); without, make the exit check if the call communicated and asked for one."""
        if self.depth > 1:
            self.depth -= 1
            if error is not None and self.entry in (EntryState.CHECKING, EntryState.CHECKED) and self.watch is not None:
                # (the peers hear it now: code that runs while it unwinds, such as a finally
                # block, must not make collectives they would pair with theirs)
                self.watch.leave(f"{where} (call #{self.count})", error)
            return
        entry, name = self.entry, self.name or where
        try:
            if error is None:
                if entry is EntryState.CHECKED and self.exit_check:
                    self._check_exit(name, where)
            elif entry is EntryState.PENDING:
                try:
                    self._check_entry_with(error)
                except BaseException:  # noqa: BLE001 - the peers heard; this rank raises its own error
                    pass
            elif entry in (EntryState.CHECKING, EntryState.CHECKED) and self.watch is not None:
                self.watch.leave(f"{where} (call #{self.count})", error)
        finally:
            self.depth, self.name, self.entry = 0, None, EntryState.CLOSED

    def _check_exit(self, name: str, where: str) -> None:
        """The exit check; this rank raising during it (not the check's own verdict, which every
        rank reaches) leaves the call like any other error after its entry check."""
        try:
            self.position(f"at the end of {name}", [], count=self.count)
        except (DivergedRanksError, CallFailedError):
            raise
        except BaseException as error:
            if self.watch is not None:
                self.watch.leave(f"{where} (call #{self.count})", error)
            raise

    def abandon(self, text: str) -> None:
        """Close the open call as one this rank left after its entry check, for the reason
        ``text`` (it names the rank): e.g. a backward that raised, seen only afterwards."""
        if self.entry in (EntryState.CHECKING, EntryState.CHECKED) and self.watch is not None:
            self.watch.leave_with(text)
        self.depth, self.name, self.entry = 0, None, EntryState.CLOSED

    def check_entry(self) -> None:
        """Make the open call's entry check now (before collectives this guard does not see,
        e.g. ``torch.distributed.checkpoint``'s own)."""
        if self.entry is EntryState.PENDING:
            self._check_entry_with(None)

    def enter_at(self, kind: str, items: List[str], explain: Optional[Explain] = None) -> None:
        """A check of the ranks' position at ``kind`` with ``items`` (see ``position``); if the
        open call's entry check is still to come, it is this one (the runtime's forward and
        backward checks)."""
        if self.entry is EntryState.PENDING:
            self._check_entry_with(None, kind, items, explain)
        else:
            self.position(kind, items, explain=explain)

    def _check_entry_with(self, error: Optional[BaseException], kind: str = "", items: Sequence[str] = (), explain: Optional[Explain] = None) -> None:
        self.entry = EntryState.CHECKING
        self.count += 1  # (only calls that communicate count: a local call on one rank shifts nothing)
        if self.watch is not None:
            self.watch.next_call()
        failure = None
        if error is not None:
            failure = (
                f"rank {self._rank()} raised {type(error).__name__}({_short(error)}) in {self.name} before its "
                f"first collective: nothing was done, on any rank"
            )
        if failure is None and self.carried is not None and not self._ignore_carried:
            failure = self.carried
        try:
            self.position(kind or f"in {self.name}", list(items), failure, explain, self.count)
        except (DivergedRanksError, CallFailedError):
            self.entry = EntryState.RAISED  # (every rank raises here alike)
            raise
        if failure is not None:  # (every rank agreed: only possible if all carry the same)
            self.entry = EntryState.RAISED
            if error is None:
                raise CallFailedError(f"[rank {self._rank()}] {failure}")
            return
        self.entry = EntryState.CHECKED

    def before_collective(self, what: str) -> None:
        """Called for every collective of a guarded communicator, before it is issued."""
        if not self.live:
            return
        if self.depth == 0:
            raise AssertionError(
                f"[rank {self._rank()}] flatshard issued a collective ({what}) outside any guarded call: every "
                f"flatshard operation that communicates must run as a call of its Guard ([Note: one guarded path])"
            )
        if self.entry is EntryState.PENDING:
            self._check_entry_with(None)
        if self.watch is not None:
            self.watch.issue(what)

    # -- position checks ----------------------------------------------------------------------------

    def position(
        self, kind: str, items: List[str], failure: Optional[str] = None, explain: Optional[Explain] = None, count: Optional[int] = None
    ) -> None:
        """Every rank of the guard is at ``kind`` (its ``count``-th call, if given) with the same
        ``items`` and no ``failure``, or every rank raises: one constant-size agreement per check
        group; on a difference an object all-gather of every rank's position, to name it."""
        if not self.live:
            if failure is not None:
                raise CallFailedError(f"[rank {self._rank()}] {failure}")
            return
        # (whether a rank checks every collective is part of every position: ranks that differ
        # there would pair one's per-collective checks with another's data)
        digest = fingerprint("\n".join([kind, str(count), *items, f"failed: {failure}" if failure else "ok", str(self.checking)]))
        for comm in self.checks:
            if comm.agree(digest, check_device(comm, self.device)):
                continue
            everyone = all_gather_object((kind, count, list(items), failure, self.checking), comm)
            raise _diverged(comm.rank, everyone, explain)

    def _rank(self) -> int:
        return self.watch.rank if self.watch is not None else (global_rank() if dist.is_initialized() else 0)


def _diverged(rank: int, everyone: List[Position], explain: Optional[Explain]) -> BaseException:
    """The error of a failed position check, on rank ``rank`` (the same text on every rank,
    but for the rank prefix): a failure some rank carried, else where each rank is."""
    failure = next((failure for _, _, _, failure, _ in everyone if failure is not None), None)
    if failure is not None:  # (each names its rank)
        return CallFailedError(f"[rank {rank}] {failure}")
    if len({checking for *_, checking in everyone}) > 1:
        levels = "; ".join(f"rank {r}: {'DETAIL' if checking else 'not DETAIL'}" for r, (*_, checking) in enumerate(everyone))
        return DivergedRanksError(
            f"[rank {rank}] the ranks' TORCH_DISTRIBUTED_DEBUG levels differ ({levels}): under DETAIL every "
            f"collective is checked, which only works when every rank checks; set it alike on every rank"
        )
    text = explain(everyone) if explain is not None else None
    if text is not None:
        return DivergedRanksError(f"[rank {rank}] {text}")
    places = "; ".join(
        f"rank {r} is {kind}" + (f" (call #{count})" if count is not None else "") for r, (kind, count, *_) in enumerate(everyone)
    )
    return DivergedRanksError(
        f"[rank {rank}] the ranks are at different places: {places}. Every rank must make the same flatshard "
        f"calls in the same order (a rank that skipped a backward, a call or a step the others made, or "
        f"made one they did not, has diverged)"
    )


def make_guard(comms: Sequence[Optional[Communicator]], device: torch.device) -> Guard:
    """A guard over the groups of ``comms`` (e.g. a shard group, then a replicate group), bound to
    each of them: its watch covers every rank they reach, its checks run over them in order."""
    present = [c for c in comms if c is not None]
    ranks = sorted({r for c in present for r in _ranks(c)})
    live = len(ranks) > 1 and not any("fake" in backend_of(c.group).lower() for c in present)
    watch = None
    if live and dist.is_initialized():
        me = global_rank()
        watch = make_watch(default_store(), me, [r for r in ranks if r != me], _timeout(present))
    guard = Guard(watch, [c for c in present if c.world_size > 1], device, live)
    for comm in present:
        guard.bind(comm)
    return guard


def _ranks(comm: Communicator) -> List[int]:
    try:
        return comm.global_ranks()
    except (RuntimeError, ValueError):  # (a group torch does not know: a test's stand-in)
        return list(range(comm.world_size))


def _timeout(comms: Sequence[Communicator]) -> timedelta:
    return timeout_of(comms[0].group) if comms else dist.default_pg_timeout


def _short(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return repr(text[:200])
