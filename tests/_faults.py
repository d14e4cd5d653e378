"""Faults injected into one rank at a flatshard call site (tests and the fault fuzzer).

A fault fires right before the n-th collective a rank issues through flatshard from the moment
it is armed (every flatshard collective goes through ``Communicator._note``: [Note: one guarded
path] in flatshard/_comm/_guard.py), so "a random flatshard call site" is a random n. It
raises an exception there, or ends the process as a kill would.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Dict, Iterator, Optional
from unittest import mock

from flatshard._comm._collectives import Communicator

KILLED_EXIT_CODE = 77


class Injected(RuntimeError):
    """The exception a fault raises (a stand-in for an out-of-memory or a bug on one rank)."""


def make_error(kind: str) -> BaseException:
    """The exception of fault ``kind``: ``"error"``, ``"oserror"`` or ``"interrupt"``."""
    if kind == "oserror":
        return OSError(5, "Input/output error (injected)")
    if kind == "interrupt":
        return KeyboardInterrupt("injected")
    return Injected("injected")


@contextlib.contextmanager
def fault_at(
    collective: Optional[int],
    kind: str = "error",
    when: Optional[Dict[str, float]] = None,
    on_fire: Optional[Callable[[Dict[str, Any]], None]] = None,
) -> Iterator[Dict[str, Any]]:
    """Within the block, the ``collective``-th flatshard collective of this rank (from 1) is
    not issued: the fault ``kind`` fires instead (an exception, or ``"kill"``: the process
    exits at once with ``KILLED_EXIT_CODE``). ``None``: no fault. The yielded dict tells
    whether it fired (``"fired"``) and when (``"at"``, ``time.monotonic()``); ``when``, if
    given, is filled the same way. ``on_fire(state)`` runs as it fires, before the exception
    or the exit (a kill leaves nothing else behind: write the time somewhere there)."""
    state: Dict[str, Any] = when if when is not None else {}
    state.update(fired=False, at=None, count=0)
    if collective is None:
        yield state
        return
    real: Callable[..., Any] = Communicator._note

    def note(self: Communicator, *args: Any, **kwargs: Any) -> None:
        state["count"] += 1
        if state["count"] == collective and not state["fired"]:
            state["fired"], state["at"] = True, time.monotonic()
            if on_fire is not None:
                on_fire(state)
            if kind == "kill":
                os._exit(KILLED_EXIT_CODE)
            raise make_error(kind)
        real(self, *args, **kwargs)

    with mock.patch.object(Communicator, "_note", note):
        yield state


def count_collectives(fn: Callable[[], Any]) -> int:
    """How many flatshard collectives ``fn()`` issues on this rank."""
    with fault_at(10**9) as state:
        fn()
    return int(state["count"])
