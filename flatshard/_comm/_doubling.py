"""Agreement in about log2(N) rounds: the schedule of a recursive-doubling maximum, and the
thread its point-to-point messages are waited on.

[Note: agreement by recursive doubling] ``Communicator.agree`` takes the maximum of two
integers over the ranks. gloo's all-reduce is a ring whatever the size: for two integers one
chunk travels around the ring twice (reduce, then gather), about 2 (N - 1) messages one after
another, so at 4096 ranks a check of 16 bytes costs thousands of network latencies, twice per
step. So over gloo (from ``DOUBLING_FROM`` ranks) the maximum is taken by recursive doubling, in messages
of 16 bytes between pairs of ranks:

- with P the largest power of two <= N, rank P + i (for i < N - P) first sends its value to
  rank i, which folds it into its own;
- then, for each bit b < P, ranks r and r ^ b of the first P swap their values and keep the
  larger: after the round of bit b each holds the maximum of its block of 2b ranks;
- last, rank i hands the result back to rank P + i.

That is log2(P) rounds, two more where N is not a power of two (12 at 4096 ranks, against
8190 for the ring), and at most log2(P) + 1 messages sent per rank. ``schedule`` gives each
rank its steps; ``tests/test_host_checks_scale.py`` runs every rank's schedule at N = 4096
and counts the rounds.

Below ``DOUBLING_FROM`` ranks the ring stays: each of its hops is a message between gloo's own
threads, whereas each round here is Python on both sides, and a thread started per check.
Measured on 2 shared cores with 4-16 local processes (``bench/host_checks.py``), the ring took
1-10 ms per check and the doubling 7-17 ms; the ring grows by a hop per rank, the doubling by a
round per doubling of the ranks, and on a network each hop costs a latency, not a wakeup on a
shared core. So the doubling starts at 64 ranks, where the ring makes 126 hops one after
another and the doubling 6 rounds: at most log2(N) + 2 rounds beyond that, and at most 126
hops below.

A wait on a gloo point-to-point operation cannot be cut into slices: its timeout closes the
connection to the peer (gloo: "Application timeout caused pair closure"). But the agreement
must be waited on in slices like any other gloo collective, so that a peer that left the
call is heard within one ([Note: peer failures] in ``_peer_failures``). So the steps run on a
thread of their own (``ThreadWork``), which waits on each message without a timeout of its
own (gloo's is the process group's), while the caller waits on the thread in slices. A rank
that gives up on the wait (a peer left) is stuck from then on and issues nothing more; its
thread ends when gloo's timeout does. The thread costs its start, once per check.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Callable, List, NamedTuple, Optional

__all__ = ["DOUBLING_FROM", "FOLD", "SEND", "SWAP", "TAKE", "Step", "ThreadWork", "rounds", "schedule"]

DOUBLING_FROM = 64  # the fewest ranks whose agreement takes its maximum by recursive doubling

SEND = "send"  # send this rank's value to the peer
FOLD = "fold"  # receive the peer's value; keep the larger
SWAP = "swap"  # send this rank's value to the peer and receive its; keep the larger
TAKE = "take"  # receive the peer's value in place of this rank's (the result)


class Step(NamedTuple):
    """One step of a rank's schedule: what it does (``SEND``, ``FOLD``, ``SWAP``, ``TAKE``)
    with which peer (a rank of the group)."""

    kind: str
    peer: int


def schedule(rank: int, world: int) -> List[Step]:
    """Rank ``rank``'s steps of a maximum over ``world`` ranks (see [Note: agreement by
    recursive doubling]); every rank's schedule pairs with its peers'."""
    if not 0 <= rank < world:
        raise ValueError(f"schedule: rank must be in [0, {world}); got {rank}")
    low = 1 << (world.bit_length() - 1)  # the largest power of two <= world
    if rank >= low:
        return [Step(SEND, rank - low), Step(TAKE, rank - low)]
    extra = rank + low if rank + low < world else None
    steps = [] if extra is None else [Step(FOLD, extra)]
    bit = 1
    while bit < low:
        steps.append(Step(SWAP, rank ^ bit))
        bit <<= 1
    if extra is not None:
        steps.append(Step(SEND, extra))
    return steps


def rounds(world: int) -> int:
    """The most steps a rank takes in a maximum over ``world`` ranks: a bound on the messages
    that follow one another (one less where the ranks that fold start their swaps late)."""
    low = 1 << (world.bit_length() - 1)
    return (low.bit_length() - 1) + (2 if world > low else 0)


class ThreadWork:
    """``body`` run on a daemon thread of its own, waited on like a gloo ``Work``: ``wait``
    with a timeout raises ``RuntimeError`` when it passes (``is_completed()`` is then still
    false, and the wait can be made again); once ``body`` has ended, ``wait`` raises what it
    raised, if anything."""

    def __init__(self, body: Callable[[], None], name: str) -> None:
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(body,), name=name, daemon=True)
        self._thread.start()

    def _run(self, body: Callable[[], None]) -> None:
        try:
            body()
        except BaseException as error:  # noqa: BLE001 - handed to the waiter
            self._error = error
        finally:
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError(f"{self._thread.name}: not done within {timeout}")
        if self._error is not None:
            raise self._error
        return True
