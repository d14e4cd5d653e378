"""``bench/simnet.py``'s simulated network, on CPU: the cost model (alpha + bytes (N-1)/N /
bandwidth, twice that for an all-reduce), and a group made directly (no default group) whose
collectives are counted at the model's time, complete at once, wait, hand out futures, and leave
their outputs as torch's fake group does. The three implementations' training steps over it run
in ``tests/test_gpu_check.py``'s dry run; the overlap self-check needs a GPU."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _simnet() -> Any:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import simnet
    finally:
        sys.path.pop(0)
    return simnet


def test_modelled_durations():
    simnet = _simnet()
    net = simnet.Network("test", 100e9, 20e-6)
    nbytes = 8 * 2**20
    ring = nbytes * 7 / 8 / 100e9
    assert net.seconds("all_gather", nbytes, 8) == pytest.approx(20e-6 + ring, rel=1e-12)
    assert net.seconds("reduce_scatter", nbytes, 8) == pytest.approx(20e-6 + ring, rel=1e-12)
    assert net.seconds("all_to_all", nbytes, 8) == pytest.approx(20e-6 + ring, rel=1e-12)
    assert net.seconds("all_reduce", nbytes, 8) == pytest.approx(2 * (20e-6 + ring), rel=1e-12)
    assert net.seconds("barrier", 0, 8) == pytest.approx(40e-6, rel=1e-12)
    assert net.seconds("broadcast", nbytes, 8) == pytest.approx(20e-6 + nbytes / 100e9, rel=1e-12)
    assert net.seconds("all_gather", nbytes, 1) == pytest.approx(20e-6, rel=1e-12)  # (alone: nothing sent)
    with pytest.raises(ValueError, match="unknown collective kind 'gossip'"):
        net.seconds("gossip", 1, 8)
    nvlink, ib = simnet.NETWORKS["nvlink"], simnet.NETWORKS["ib"]
    assert (nvlink.bus_bandwidth, nvlink.alpha_s, ib.bus_bandwidth, ib.alpha_s) == (360e9, 20e-6, 45e9, 20e-6)
    # the self-check's network: its all-gather of CHECK_BYTES takes CHECK_COMM_S
    check = simnet.check_network(8)
    assert check.seconds("all_gather", simnet.CHECK_BYTES, 8) == pytest.approx(simnet.CHECK_COMM_S, rel=1e-9)


def test_cpu_group_counts_waits_and_leaves_the_fake_groups_outputs():
    simnet = _simnet()
    from torch._C import _distributed_c10d as c10d

    world, n = 8, 16
    net = simnet.Network("test", 10e9, 5e-6)
    config = simnet.Config(net, simnet.Ledger())
    group = simnet.SimulatedGroup(0, world, config)
    reference = simnet._fake_group(0, world)
    shard, full = torch.arange(float(n)), torch.arange(float(n * world))
    gathered, reduced, summed = torch.full((n * world,), -1.0), torch.full((n,), -1.0), torch.ones(n)
    want_gathered, want_reduced = gathered.clone(), reduced.clone()
    reference._allgather_base(want_gathered, shard, c10d.AllgatherOptions())
    reference._reduce_scatter_base(want_reduced, full, c10d.ReduceScatterOptions())
    works = [
        group.all_gather_single(gathered, shard),
        group.reduce_scatter_single(reduced, full),
        group.allreduce([summed]),
        group.allgather([list(torch.empty(n * world).chunk(world))], [shard]),
        group.broadcast([summed]),
        group.all_to_all_single(torch.empty(n * world), full, [], []),
        group.barrier(),
    ]
    assert all(w.wait() and w.is_completed() and w.is_success() for w in works)
    future = works[0].get_future()
    assert future.wait()[0] is gathered and works[0].result()[0] is gathered
    assert torch.equal(gathered, want_gathered) and torch.equal(reduced, want_reduced) and torch.equal(summed, torch.ones(n))
    # the legacy names reach the same collectives
    assert simnet.SimulatedGroup._allgather_base is simnet.SimulatedGroup.all_gather_single
    assert simnet.SimulatedGroup._reduce_scatter_base is simnet.SimulatedGroup.reduce_scatter_single
    ledger = config.ledger.take()
    size = 4 * n * world
    assert {k: v[:2] for k, v in ledger.entries.items()} == {
        "cpu:all_gather": [2, 2 * size], "cpu:reduce_scatter": [1, size], "cpu:all_reduce": [1, 4 * n],
        "cpu:broadcast": [1, 4 * n], "cpu:all_to_all": [1, size], "cpu:barrier": [1, 0],
    }
    expected = (2 * net.seconds("all_gather", size, world) + net.seconds("reduce_scatter", size, world) + net.seconds("all_reduce", 4 * n, world)
                + net.seconds("broadcast", 4 * n, world) + net.seconds("all_to_all", size, world) + net.seconds("barrier", 0, world))
    assert ledger.total("cpu") == pytest.approx(expected, rel=1e-12)
    assert ledger.total("cpu", "count") == 7 and ledger.total("cuda") == 0 and ledger.measured_seconds() == 0
    assert config.ledger.entries == {}  # (take started it again)


class _Recorder:
    """Stand-ins for ``torch.cuda``'s streams, events and ``_sleep`` that log what is done to them
    (a CPU build of torch has no CUDA: this checks the order the CUDA path issues its work in).
    Streams are named in the order they are made: ``compute`` first, then ``stream1``, ..."""

    def __init__(self, monkeypatch: Any) -> None:
        log: list = []
        made = iter(range(1000))
        events = iter(range(1000))

        class Stream:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                number = next(made)
                self.name = f"stream{number}" if number else "compute"

            def wait_stream(self, other: Any) -> None:
                log.append(("wait_stream", self.name, other.name))

            def wait_event(self, event: Any) -> None:
                log.append(("wait_event", self.name, event.name))

        stack = [Stream()]

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.name = f"event{next(events)}"

            def record(self, stream: Any = None) -> None:
                log.append(("record", self.name, (stream or stack[-1]).name))

        class StreamContext:
            def __init__(self, stream: Any) -> None:
                self.stream = stream

            def __enter__(self) -> None:
                stack.append(self.stream)

            def __exit__(self, *exc: Any) -> None:
                stack.pop()

        self.log = log
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stack[-1])
        monkeypatch.setattr(torch.cuda, "stream", StreamContext)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(("sleep", stack[-1].name, cycles)))


def test_cuda_path_orders_its_work_as_nccl_does(monkeypatch):
    """At issue the group's stream waits for the issuing stream, then runs the sleep between two
    events (the cycles from the calibrated clock); ``wait()`` makes the then current stream wait
    for the end event and returns without blocking; the ledger keeps the events."""
    simnet = _simnet()
    recorder = _Recorder(monkeypatch)
    cuda = torch.device("cuda", 0)
    clock = simnet.SleepClock(cuda, 2e9, 5e-6)
    assert clock.cycles(1e-3) == 1_990_000 and clock.cycles(1e-6) == 0
    net = simnet.Network("test", 10e9, 20e-6)
    config = simnet.Config(net, simnet.Ledger(), clock)
    group = simnet.SimulatedGroup(0, 8, config)

    class CudaTensor:
        device = cuda

    recorder.log.clear()
    work = group._simulate("all_gather", 8 * 10**6, [CudaTensor()], [CudaTensor()])
    seconds = net.seconds("all_gather", 8 * 10**6, 8)
    assert recorder.log == [  # (stream1: the group's; stream2: its futures')
        ("wait_stream", "stream1", "compute"),
        ("record", "event0", "stream1"),
        ("sleep", "stream1", clock.cycles(seconds)),
        ("record", "event1", "stream1"),
    ]
    assert [(s.name, e.name) for s, e in config.ledger.events] == [("event0", "event1")]
    assert config.ledger.total("cuda") == pytest.approx(seconds)
    recorder.log.clear()
    assert work.wait() is True
    assert recorder.log == [("wait_event", "compute", "event1")]
    # a second collective, issued from a side stream: the group's stream (the same) waits for that one
    side = torch.cuda.Stream(cuda)
    recorder.log.clear()
    with torch.cuda.stream(side):
        group._simulate("reduce_scatter", 100, [CudaTensor()])
    assert recorder.log[0] == ("wait_stream", "stream1", side.name) and side.name == "stream3"
    # without a calibrated clock, a CUDA collective is refused rather than given a wrong length
    bare = simnet.SimulatedGroup(0, 8, simnet.Config(net, simnet.Ledger()))
    with pytest.raises(RuntimeError, match="before the GPU's sleep clock was calibrated"):
        bare._simulate("all_gather", 100, [CudaTensor()])
