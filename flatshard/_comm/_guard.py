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

from .._base._common import guard_transition
from .._base._errors import DivergedRanksError
from ._collectives import Communicator, all_gather_object, backend_of, default_store, fingerprint, global_rank, timeout_of
from ._host_checks import check_device
from ._peer_failures import PeerFailedError, StepWatch, make_watch, mark_raised_together

__all__ = ["CallFailedError", "EntryState", "Guard", "Position", "make_guard", "places"]

# What the ranks exchange to explain a failed position check: (where the rank is, its call
# count there or None, what the check compared, the failure it carries or None, whether it
# checks every collective).
Position = Tuple[str, Optional[int], List[str], Optional[str], bool]
# Explains a failed check: every rank's position, by global rank -> text, or None for the
# guard's own words.
Explain = Callable[[List[Tuple[int, Position]]], Optional[str]]


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
        self._collective = True  # the open call communicates on every rank (see ``call``)

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
    def call(self, name: str, exit_check: bool = True, clears: bool = False, collective: bool = True) -> Iterator["Guard"]:
        """Run the ``with`` block as the call ``name`` (see [Note: one guarded path]).

        Args:
            name: the operation, as errors name it (e.g. ``"clip_grad_norm_()"``).
            exit_check: end with an exit check on success.
            clears: the call restores the model (a load): a failure this rank carries does not
                stop it, and is cleared when it succeeds.
            collective: the call communicates on every rank when it succeeds (``False``: it may
                not, so an error before its first collective is this rank's alone).
        """
        opened = self.open(name, exit_check=exit_check, ignore_carried=clears, collective=collective)
        # (a call inside a call closes too: ``close`` then takes back only its depth)
        try:
            yield self
        except BaseException as error:
            self.close(error, name)
            raise
        self.close(None, name)
        if opened and clears:
            self.carried = None

    def open(self, name: str, eager: bool = False, exit_check: bool = True, ignore_carried: bool = False, collective: bool = True) -> bool:
        """Open the call ``name``; ``False`` if a call is open already (this one is part of it,
        and its ``close`` only takes back its depth). ``eager``: make the entry check now rather
        than before the first collective."""
        if self.depth:
            self.depth += 1
            return False
        if self.watch is not None:
            self.watch.enter()
        self.name, self.depth, self.exit_check = name, 1, exit_check
        self._move((EntryState.CLOSED,), EntryState.PENDING)
        self._ignore_carried = ignore_carried
        self._collective = collective
        if eager:
            self.check_entry()
        return True

    def close(self, error: Optional[BaseException], where: str) -> None:
        """Close the call opened last: with ``error``, tell the peers (before its first
        collective through the entry check, which raises on every rank; after it through the
        watch, which settles with them); without, make the exit check if the call communicated
        and asked for one."""
        if self.depth > 1:
            self.depth -= 1
            if error is not None and self.entry in (EntryState.CHECKING, EntryState.CHECKED):
                # (the peers hear it now: code that runs while it unwinds, such as a finally
                # block, must not make collectives they would pair with theirs)
                self._leave(f"{where} (call #{self.count})", error)
            return
        entry, name = self.entry, self.name or where
        try:
            if error is None:
                if entry is EntryState.CHECKED and self.exit_check:
                    self._check_exit(name, where)
            elif entry is EntryState.PENDING and self._collective:
                try:
                    self._check_entry_with(error)
                except (DivergedRanksError, CallFailedError):  # (the peers heard; this rank raises its own error)
                    mark_raised_together(error)
            elif entry in (EntryState.CHECKING, EntryState.CHECKED):
                self._leave(f"{where} (call #{self.count})", error)
        finally:
            self.depth, self.name = 0, None
            self.entry = EntryState.CLOSED  # (from any state: the call is over)

    def _leave(self, where: str, error: BaseException) -> None:
        if self.watch is not None:
            self.watch.leave(where, error)

    def _check_exit(self, name: str, where: str) -> None:
        """The exit check; this rank raising during it (not the check's own verdict, which every
        rank reaches) leaves the call like any other error after its entry check."""
        try:
            self.position(f"at the end of {name}", [], count=self.count)
        except BaseException as error:
            self._leave(f"{where} (call #{self.count})", error)
            raise

    def abandon(self, text: str) -> None:
        """Close the open call as one this rank left after its entry check, for the reason
        ``text`` (it names the rank): e.g. a backward that raised, seen only afterwards."""
        try:
            if self.entry in (EntryState.CHECKING, EntryState.CHECKED) and self.watch is not None:
                self.watch.leave_with(text)
        finally:
            self.depth, self.name = 0, None
            self.entry = EntryState.CLOSED  # (from any state: the call is over)

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
        self._move((EntryState.PENDING,), EntryState.CHECKING)
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
            self._move((EntryState.CHECKING,), EntryState.RAISED)  # (every rank raises here alike)
            raise
        if failure is not None:  # (every rank agreed: only possible if all carry the same)
            self._move((EntryState.CHECKING,), EntryState.RAISED)
            if error is None:
                raise CallFailedError(f"[rank {self._rank()}] {failure}")
            mark_raised_together(error)
            return
        self._move((EntryState.CHECKING,), EntryState.CHECKED)

    def _move(self, allowed_from: Sequence[EntryState], target: EntryState) -> None:
        self.entry = guard_transition(self.entry, allowed_from, target, f"[rank {self._rank()}] the call {self.name}")

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
        ``items`` and no ``failure``, or every rank raises.

        One constant-size agreement per check group, in order, each carrying whether the groups
        before it agreed: a shard group's verdict reaches every replica, so every rank of every
        group reaches the same verdict and makes the same collectives whatever it is. On a
        difference, an object all-gather per group (of what the groups before gathered) gives
        every rank every rank's position, by global rank, to name them."""
        if not self.live:
            if failure is not None:
                raise CallFailedError(f"[rank {self._rank()}] {failure}")
            return
        # (whether a rank checks every collective is part of every position: ranks that differ
        # there would pair one's per-collective checks with another's data)
        digest = fingerprint("\n".join([kind, str(count), *items, f"failed: {failure}" if failure else "ok", str(self.checking)]))
        agreed = True
        for comm in self.checks:
            agreed = bool(comm.agree(digest if agreed else digest ^ 1, check_device(comm, self.device))) and agreed
        if agreed:
            return
        everyone: List[Tuple[int, Position]] = [(self._rank(), (kind, count, list(items), failure, self.checking))]
        for comm in self.checks:
            everyone = [entry for share in all_gather_object(everyone, comm) for entry in share]
        error = _diverged(self._rank(), sorted(dict(everyone).items()), explain)
        mark_raised_together(error)
        raise error

    def _rank(self) -> int:
        return self.watch.rank if self.watch is not None else (global_rank() if dist.is_initialized() else 0)


def _diverged(rank: int, everyone: List[Tuple[int, Position]], explain: Optional[Explain]) -> BaseException:
    """The error of a failed position check, on (global) rank ``rank`` (the same text on every
    rank, but for the rank prefix): a failure some rank carried, else where each rank is."""
    failure = next((p[3] for _, p in everyone if p[3] is not None), None)
    if failure is not None:  # (each names its rank)
        return CallFailedError(f"[rank {rank}] {failure}")
    if len({p[4] for _, p in everyone}) > 1:
        levels = "; ".join(f"rank {r}: {'DETAIL' if p[4] else 'not DETAIL'}" for r, p in everyone)
        return DivergedRanksError(
            f"[rank {rank}] the ranks' TORCH_DISTRIBUTED_DEBUG levels differ ({levels}): under DETAIL every "
            f"collective is checked, which only works when every rank checks; set it alike on every rank"
        )
    text = explain(everyone) if explain is not None else None
    if text is not None:
        return DivergedRanksError(f"[rank {rank}] {text}")
    return DivergedRanksError(
        f"[rank {rank}] the ranks are at different places: {places(everyone)}. Every rank must make the same "
        f"flatshard calls in the same order (a rank that skipped a backward, a call or a step the others made, "
        f"or made one they did not, has diverged)"
    )


def places(everyone: List[Tuple[int, Position]]) -> str:
    """Where each rank is, by global rank."""
    return "; ".join(f"rank {r} is {p[0]}" + (f" (call #{p[1]})" if p[1] is not None else "") for r, p in everyone)


def make_guard(comms: Sequence[Optional[Communicator]], device: torch.device) -> Guard:
    """A guard over the groups of ``comms`` (e.g. a shard group, then a replicate group), bound to
    each of them: its watch covers every rank they reach, its checks run over them in order."""
    present = [c for c in comms if c is not None]
    ranks = sorted({r for c in present for r in _ranks(c)})
    live = len(ranks) > 1 and not any("fake" in backend_of(c.group).lower() for c in present)
    guard = Guard(None, [c for c in present if c.world_size > 1], device, live)
    if live and dist.is_initialized():
        me = global_rank()
        guard.watch = make_watch(default_store(), me, [r for r in ranks if r != me], _timeout(present))
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
