"""A simulated network on one GPU: torch's fake process group, with each collective's time on the wire.

    python bench/simnet.py --self-check --json out/simnet_check.json            # on a CUDA GPU
    python bench/simnet.py --self-check --device cpu --json out/simnet_check.json  # the CPU dry run

torch's fake process group (backend ``"fake"``) runs one process as rank r of N: every collective
returns at once and moves no data. It measures a rank's compute and memory, but it hides
communication, so it cannot show whether communication overlaps compute. The ``"fake_simnet"``
backend registered here is the fake group plus a model of the network:

- every collective on CUDA tensors enqueues a kernel that lasts as long as the collective would
  on the network (``Network.seconds``), on a stream of the group's own, ordered the way
  ProcessGroupNCCL orders its work (see [Note: NCCL's ordering]);
- ``Work.wait()`` makes the current stream wait for that kernel; the host never waits;
- the data is what the fake group leaves (nothing is exchanged): the fake group's own method runs
  first, and its outputs are kept as they are ([Note: the fake group's data]);
- collectives on CPU tensors (flatshard's per-step agreement checks, which take the host's path,
  and everything in the CPU dry run) enqueue nothing: they complete at once and are only counted.

Every collective is counted in a ``Ledger`` (per device type: how many, the bytes, the modelled
seconds; on CUDA also the kernels' measured durations), which the benchmark reads per step.
The kernel is ``torch.cuda._sleep(cycles)``, a one-thread kernel that spins for a number of
clock cycles; ``SleepClock`` calibrates cycles per millisecond with CUDA events.

``--self-check`` proves the model before any number is taken from it: see ``self_check``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from torch._C._distributed_c10d import FakeProcessGroup, Work

BACKEND = "fake_simnet"  # (contains "fake": flatshard treats it as a group that exchanges no data)


@dataclass(frozen=True)
class Network:
    """A network's cost model: ``bus_bandwidth`` in bytes per second per rank (NCCL's "bus
    bandwidth", the figure nccl-tests report) and ``alpha_s``, the latency of one collective.

    [Note: the cost model] A ring collective over N ranks moves (N-1)/N of its data through each
    rank's link, so an all-gather (of its output) and a reduce-scatter (of its input) or an
    all-to-all (of its input) take alpha + bytes * (N-1)/N / bandwidth. An all-reduce is a
    reduce-scatter followed by an all-gather: twice that, latency included; a barrier is an
    all-reduce of nothing (2 alpha). A broadcast, a reduce, a gather or a scatter pipelines the
    whole tensor through the ring: alpha + bytes / bandwidth. One rank alone sends nothing: alpha.
    """

    name: str
    bus_bandwidth: float
    alpha_s: float

    def seconds(self, kind: str, nbytes: int, world: int) -> float:
        """How long collective ``kind`` of ``nbytes`` takes over ``world`` ranks (see [Note: the cost model]).

        Args:
            kind: one of ``KINDS``.
            nbytes: the collective's size: an all-gather's output, the input of the others.
            world: the number of ranks in the group.
        """
        if kind not in KINDS:
            raise ValueError(f"unknown collective kind {kind!r}; expected one of {KINDS}")
        ring = nbytes * (world - 1) / world / self.bus_bandwidth
        if kind in ("all_reduce", "barrier"):
            return 2 * (self.alpha_s + ring)
        if kind in ("broadcast", "reduce", "gather", "scatter"):
            return self.alpha_s + nbytes / self.bus_bandwidth
        return self.alpha_s + ring


KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "barrier", "broadcast", "reduce", "gather", "scatter")
# NVLink-like: an H100 node's all-gather bus bandwidth as nccl-tests measure it; InfiniBand-like:
# one 400 Gb/s NIC per GPU (50 GB/s on the wire, about 45 GB/s of bus bandwidth for the ring).
NETWORKS: Dict[str, Network] = {
    "nvlink": Network("nvlink", 360e9, 20e-6),
    "ib": Network("ib", 45e9, 20e-6),
}


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class Ledger:
    """What the simulated groups were asked to do since the last ``take``: per device type and
    kind (``"cuda:all_gather"``, ``"cpu:all_reduce"``, ...) how many collectives, their bytes and
    their modelled seconds; on CUDA, each kernel's start and end events (read with
    ``measured_seconds`` once the GPU has finished them)."""

    entries: Dict[str, List[float]] = field(default_factory=dict)  # "device:kind" -> [count, bytes, seconds]
    events: List[Tuple[Any, Any]] = field(default_factory=list)

    def add(self, device_type: str, kind: str, nbytes: int, seconds: float) -> None:
        entry = self.entries.setdefault(f"{device_type}:{kind}", [0, 0, 0.0])
        entry[0] += 1
        entry[1] += nbytes
        entry[2] += seconds

    def total(self, device_type: str, what: str = "seconds") -> float:
        """The sum over kinds on ``device_type`` of ``what``: ``"count"``, ``"bytes"`` or ``"seconds"``."""
        index = ("count", "bytes", "seconds").index(what)
        return sum(v[index] for k, v in self.entries.items() if k.split(":")[0] == device_type)

    def measured_seconds(self) -> float:
        """The CUDA kernels' summed durations (synchronise first: each end event must be done)."""
        return sum(start.elapsed_time(end) for start, end in self.events) / 1e3

    def take(self) -> "Ledger":
        """Everything counted so far, as a ledger of its own; this one starts again from zero."""
        taken = Ledger(self.entries, self.events)
        self.entries, self.events = {}, []
        return taken


class SleepClock:
    """How many cycles of ``torch.cuda._sleep`` last a given time on one GPU.

    [Note: calibrating the sleep] ``_sleep(cycles)`` spins one thread on the SM clock, so its
    duration is ``launch + cycles / rate``; both are fitted from CUDA-event timings of two
    lengths (the median of several of each), after a warm-up that lets the clocks settle. The
    SM clock can drop under load (power capping), which lengthens every sleep: the ledger's
    measured durations show it, and the benchmark prints them next to the modelled ones.
    """

    def __init__(self, device: torch.device, cycles_per_s: float, launch_s: float) -> None:
        self.device = device
        self.cycles_per_s = cycles_per_s
        self.launch_s = launch_s

    @classmethod
    def calibrate(cls, device: torch.device, repeats: int = 5) -> "SleepClock":
        """Time ``_sleep`` on ``device`` (a CUDA device; synchronises it).

        Args:
            device: the GPU to calibrate.
            repeats: timings per length (their median is used).
        """
        with torch.cuda.device(device):
            torch.cuda._sleep(50_000_000)  # (warm-up: the clocks leave idle)
            short, long = 2_000_000, 20_000_000
            medians = [statistics.median(_time_sleep(cycles) for _ in range(repeats)) for cycles in (short, long)]
        rate = (long - short) / (medians[1] - medians[0])
        launch = max(0.0, medians[0] - short / rate)
        if not (1e8 < rate < 1e10):
            raise RuntimeError(f"simnet: implausible GPU clock from calibrating torch.cuda._sleep: {rate:.3g} cycles/s (timings {medians} s)")
        return cls(device, rate, launch)

    def cycles(self, seconds: float) -> int:
        """The ``_sleep`` argument whose kernel lasts ``seconds`` (0 for what the launch alone covers)."""
        return max(0, round((seconds - self.launch_s) * self.cycles_per_s))


def _time_sleep(cycles: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


@dataclass
class Config:
    """What groups made by the ``"fake_simnet"`` backend use (set by ``init_world``): the
    network, the ledger they count in, the calibrated clock of the GPU (``None`` on CPU) and
    whether they record each kernel's events (``Ledger.measured_seconds``)."""

    network: Network
    ledger: Ledger
    clock: Optional[SleepClock] = None
    timing: bool = True


_config: Optional[Config] = None


class SimWork(Work):
    """One simulated collective: done when ``end`` (an event after its kernel on the group's
    stream; ``None`` on CPU) is. ``wait`` makes the current stream wait for it and never blocks
    the host, except for a barrier (ProcessGroupNCCL's barrier blocks the host too). Holds the
    collective's inputs until waited on and its outputs while it lives, as ProcessGroupNCCL's work
    does for an asynchronous collective."""

    def __init__(self, end: Optional[Any], outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor] = (),
                 device: Optional[torch.device] = None, future_stream: Optional[Any] = None, blocking: bool = False) -> None:
        super().__init__()
        self._end = end
        self._device = device
        self._outputs = list(outputs)  # (for ``result`` and the future, as long as the work lives)
        self._inputs: Optional[List[torch.Tensor]] = list(inputs)
        self._future_stream = future_stream
        self._blocking = blocking

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if self._end is not None:
            torch.cuda.current_stream(self._device).wait_event(self._end)
            if self._blocking:
                self._end.synchronize()
        self._inputs = None
        return True

    synchronize = wait
    block_current_stream = wait

    def is_completed(self) -> bool:
        return self._end is None or self._end.query()

    def is_success(self) -> bool:
        return True

    def exception(self) -> Optional[BaseException]:
        return None

    def result(self) -> List[torch.Tensor]:
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        """A future of the collective's tensors; on CUDA its ``wait`` makes the current stream
        wait for the kernel (its value is set on a stream that waited for ``end``)."""
        if self._end is None:
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(self._outputs)
            return future
        future = torch.futures.Future(devices=[self._device])
        self._future_stream.wait_event(self._end)
        with torch.cuda.stream(self._future_stream):
            future.set_result(self._outputs)
        return future


def _fake_group(rank: int, size: int) -> Any:
    if hasattr(FakeProcessGroup, "_create_internal"):
        return FakeProcessGroup._create_internal(rank, size)
    return FakeProcessGroup(rank, size)  # (older torch)


class SimulatedGroup(dist.ProcessGroup):
    """torch's fake process group with the network's time on the GPU (see the module's doc).

    Each method runs the fake group's own, then ``_simulate`` enqueues the collective's time.

    [Note: the fake group's data] The outputs are what torch's fake group makes of them: torch
    2.13's copies this rank's input into place (an all-gather fills every chunk with it), older
    ones leave them. Those copies run on the issuing stream, before the collective's time, just as
    they do on the plain fake group: so the compute stream does the same work with and without a
    network, and the difference between the two step times is the network's alone.

    [Note: a Python process group] torch's c10d ``Backend`` cannot be subclassed in Python (it has
    no Python constructor), so the backend's constructor returns this ``ProcessGroup`` subclass,
    which ``init_process_group`` takes as the group itself (as torch's own "threaded" test group
    does). ``torch.distributed``'s functions call the group's methods from Python, so defining
    them here is enough; the fake group is also registered as its backend on CPU and CUDA, for
    callers that ask a group for its backend (``_get_backend``).

    Coalesced calls (``dist._coalescing_manager``) are not simulated. Both the names of torch 2.13
    (``all_gather_single``, ``reduce_scatter_single``, ``all_to_all_single``) and the older ones
    (``_allgather_base``, ``_reduce_scatter_base``, ``alltoall_base``) are defined: which one
    ``torch.distributed`` calls depends on its version.
    """

    def __init__(self, rank: int, size: int, config: Config) -> None:
        super().__init__(rank, size)
        self._fake = _fake_group(rank, size)
        self._config = config
        self._streams: Dict[torch.device, Tuple[Any, Any]] = {}
        # (``_get_backend``: FSDP2 asks its backend whether it allocates tensors; flatshard reads its timeout)
        for device in ("cpu", "cuda"):
            self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, self._fake)

    def getBackendName(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def _simulate(self, kind: str, nbytes: int, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor] = (), blocking: bool = False) -> SimWork:
        """Count the collective and, for CUDA tensors, enqueue its time.

        [Note: NCCL's ordering] ProcessGroupNCCL runs a collective on a stream of its own per
        group and device: at issue, that stream first waits for everything already queued on the
        issuing (current) stream, then runs the collective's kernel, then records an event; the
        work's ``wait()`` makes the stream current at that time wait for the event. So a
        collective issued behind compute on the same stream cannot start before that compute
        ends, and one issued from a stream with nothing queued starts at once. The kernel here
        takes the collective's place, with its duration from the network model.
        """
        tensors = [*outputs, *inputs]
        device = tensors[0].device if tensors else torch.device("cpu")
        config = self._config
        seconds = config.network.seconds(kind, nbytes, self.size())
        config.ledger.add(device.type, kind, nbytes, seconds)
        if device.type != "cuda":
            return SimWork(None, outputs, inputs)
        if config.clock is None:
            raise RuntimeError("simnet: a CUDA collective before the GPU's sleep clock was calibrated (init_world(..., device=cuda))")
        stream, future_stream = self._streams_of(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            start = torch.cuda.Event(enable_timing=True) if config.timing else None
            end = torch.cuda.Event(enable_timing=config.timing)
            if start is not None:
                start.record(stream)
            torch.cuda._sleep(config.clock.cycles(seconds))
            end.record(stream)
        if start is not None:
            config.ledger.events.append((start, end))
        return SimWork(end, outputs, inputs, device, future_stream, blocking)

    def _streams_of(self, device: torch.device) -> Tuple[Any, Any]:
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]

    # -- all-gathers: the size is the gathered output's
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimWork:
        self._fake._allgather_base(output, input, opts or c10d.AllgatherOptions())
        return self._simulate("all_gather", _nbytes([output]), [output], [input])

    _allgather_base = all_gather_single

    def allgather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any = None) -> SimWork:
        self._fake.allgather(output_lists, inputs, opts or c10d.AllgatherOptions())
        outputs = [t for outs in output_lists for t in outs]
        return self._simulate("all_gather", _nbytes(outputs), outputs, inputs)

    allgather_coalesced = allgather

    def all_gather_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any = None) -> SimWork:
        for output, input in zip(outputs, inputs):
            self._fake._allgather_base(output, input, opts or c10d.AllgatherOptions())
        return self._simulate("all_gather", _nbytes(outputs), outputs, inputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # -- reduce-scatters: the size is the full input's
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimWork:
        self._fake._reduce_scatter_base(output, input, opts or c10d.ReduceScatterOptions())
        return self._simulate("reduce_scatter", _nbytes([input]), [output], [input])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]], opts: Any = None) -> SimWork:
        self._fake.reduce_scatter(outputs, input_lists, opts or c10d.ReduceScatterOptions())
        inputs = [t for ins in input_lists for t in ins]
        return self._simulate("reduce_scatter", _nbytes(inputs), outputs, inputs)

    def reduce_scatter_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any = None) -> SimWork:
        for output, input in zip(outputs, inputs):
            self._fake._reduce_scatter_base(output, input, opts or c10d.ReduceScatterOptions())
        return self._simulate("reduce_scatter", _nbytes(inputs), outputs, inputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- all-reduces, all-to-alls, broadcasts, the rest
    def allreduce(self, tensors: Any, opts: Any = None) -> SimWork:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if not isinstance(opts, c10d.AllreduceOptions):  # (a bare ReduceOp, or none)
            op, opts = opts, c10d.AllreduceOptions()
            if op is not None:
                opts.reduceOp = op
        self._fake.allreduce(tensors, opts)
        return self._simulate("all_reduce", _nbytes(tensors), tensors)

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> SimWork:
        self._fake.allreduce_coalesced(tensors, opts or c10d.AllreduceCoalescedOptions())
        return self._simulate("all_reduce", _nbytes(tensors), tensors)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_splits: List[int], input_splits: List[int], opts: Any = None) -> SimWork:
        self._fake.alltoall_base(output, input, output_splits, input_splits, opts or c10d.AllToAllOptions())
        return self._simulate("all_to_all", _nbytes([input]), [output], [input])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any = None) -> SimWork:
        self._fake.alltoall(outputs, inputs, opts or c10d.AllToAllOptions())
        return self._simulate("all_to_all", _nbytes(inputs), outputs, inputs)

    def broadcast(self, tensors: Any, opts: Any = None) -> SimWork:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        self._fake.broadcast(tensors, opts if isinstance(opts, c10d.BroadcastOptions) else c10d.BroadcastOptions())
        return self._simulate("broadcast", _nbytes(tensors), tensors)

    def reduce(self, tensors: List[torch.Tensor], opts: Any = None) -> SimWork:
        self._fake.reduce(tensors, opts or c10d.ReduceOptions())
        return self._simulate("reduce", _nbytes(tensors), tensors)

    def gather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any = None) -> SimWork:
        self._fake.gather(output_lists, inputs, opts or c10d.GatherOptions())
        return self._simulate("gather", _nbytes(inputs) * self.size(), [t for outs in output_lists for t in outs], inputs)

    def scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]], opts: Any = None) -> SimWork:
        self._fake.scatter(outputs, input_lists, opts or c10d.ScatterOptions())
        return self._simulate("scatter", _nbytes(outputs) * self.size(), outputs, [t for ins in input_lists for t in ins])

    def barrier(self, opts: Any = None) -> SimWork:
        """Two latencies on the device ``opts`` names (the host's path when none), and a ``wait``
        that blocks the host, as ProcessGroupNCCL's barrier does."""
        device = getattr(opts, "device", None)
        self._fake.barrier(opts or c10d.BarrierOptions())
        marker = [torch.empty(0, device=device)] if device is not None and device.type == "cuda" else []
        return self._simulate("barrier", 0, marker, blocking=True)


def _create_group(store: Any, rank: int, size: int, timeout: Any) -> SimulatedGroup:
    """The ``"fake_simnet"`` backend's constructor (torch's plain backend API)."""
    if _config is None:
        raise RuntimeError("simnet: make the group with simnet.init_world(...), which sets the network first")
    return SimulatedGroup(rank, size, _config)


def init_world(world: int, network: Network, device: torch.device, rank: int = 0, timing: bool = True) -> Config:
    """Make a ``"fake_simnet"`` group the default process group, this process standing for
    ``rank`` of ``world``; every group made after it (``new_group``) uses the same network and
    ledger. On CUDA, calibrates the GPU's sleep clock first (once per device and process).

    Args:
        world: the fake world size.
        network: the cost model (e.g. ``NETWORKS["nvlink"]``).
        device: where the model runs: on ``cuda`` the collectives take time on the GPU, on
            ``cpu`` they are only counted.
        rank: the rank this process stands for.
        timing: record each CUDA kernel's events (``Ledger.measured_seconds``).

    Returns:
        The groups' ``Config``: its ``ledger`` counts their collectives.
    """
    global _config
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create_group, devices=["cpu", "cuda"])
    clock = None
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        clock = _CLOCKS.get(device) or SleepClock.calibrate(device)
        _CLOCKS[device] = clock
    _config = Config(network, Ledger(), clock, timing)
    dist.init_process_group(BACKEND, rank=rank, world_size=world, store=dist.HashStore())
    return _config


_CLOCKS: Dict[torch.device, SleepClock] = {}


# -- the self-check -------------------------------------------------------------------------

# [Note: the overlap self-check] A loop of matmuls takes T_c on the compute stream, one
# all-gather of the check network T_m (a third of T_c) alone; a case's overlap is
# (T_c + T_m - T) / T_m for its time T. Issued from a side stream with nothing queued, the
# collective runs beside the matmuls (about 100%); issued after them on the same stream, it waits
# for them (about 0%); waited on (``wait()`` or ``get_future().wait()``) before the matmuls are
# issued, the matmuls wait for it (about 0%). The check also holds the alone time to the model
# (the calibration), the kernel's time beside the matmuls to the model within ``LOAD_RATIO`` (the
# SM clock under load; [Note: calibrating the sleep]) and the host's time to issue and wait to a
# fraction of T_m (``wait`` must not block the host). Any of these off, and the numbers the benchmark would print are wrong: the
# check exits non-zero and the benchmark's network part does not run.
CHECK_BYTES = 64 * 2**20  # the all-gather's output
CHECK_COMM_S = 0.010
LIMITS = {"side": (0.90, 1.10), "same": (-0.10, 0.10), "wait_first": (-0.10, 0.10), "future_first": (-0.10, 0.10)}
CALIBRATION_TOLERANCE = 0.05
LOAD_RATIO = (0.8, 1.25)  # the sleep's measured / modelled time beside the matmuls
HOST_FRACTION = 0.5


def check_network(world: int) -> Network:
    """A network on which the self-check's all-gather of ``CHECK_BYTES`` takes ``CHECK_COMM_S``."""
    alpha = 20e-6
    return Network("self-check", CHECK_BYTES * (world - 1) / world / (CHECK_COMM_S - alpha), alpha)


def self_check(device: torch.device, world: int = 8) -> Dict[str, Any]:
    """Check the simulated group against [Note: the overlap self-check] (on CUDA) or its
    accounting (on CPU, where it enqueues nothing). Initialises and destroys the default group.

    Args:
        device: ``cuda`` for the full check, ``cpu`` for the dry run's.
        world: the fake world size.

    Returns:
        The measurements, ``ok`` and, where not ok, ``failures`` (the caller exits non-zero).
    """
    network = check_network(world)
    config = init_world(world, network, device)
    try:
        result = _accounting_check(config, device, world)
        if device.type == "cuda":
            overlap = _overlap_check(config, device)
            result.update(overlap, failures=result["failures"] + overlap["failures"])
    finally:
        dist.destroy_process_group()
    failures = result.setdefault("failures", [])
    result["ok"] = not failures
    return result


def _accounting_check(config: Config, device: torch.device, world: int) -> Dict[str, Any]:
    """One collective of each main kind through ``torch.distributed``: the ledger counts each
    at the model's time, each ``wait`` returns, and the outputs are what torch's fake group
    itself leaves (it copies the input into place in torch 2.13, leaves the output in older ones)."""
    failures: List[str] = []
    n = 1024
    shard, full = torch.arange(n, device=device, dtype=torch.float32), torch.arange(n * world, device=device, dtype=torch.float32)
    gathered, reduced = torch.full((n * world,), -1.0, device=device), torch.full((n,), -1.0, device=device)
    listed = torch.full((n * world,), -1.0, device=device)
    reference = _fake_group(dist.get_rank(), world)
    expected_gathered, expected_reduced, expected_listed = gathered.clone(), reduced.clone(), listed.clone()
    reference._allgather_base(expected_gathered, shard, c10d.AllgatherOptions())
    reference._reduce_scatter_base(expected_reduced, full, c10d.ReduceScatterOptions())
    reference.allgather([list(expected_listed.chunk(world))], [shard], c10d.AllgatherOptions())
    config.ledger.take()
    works = [
        dist.all_gather_into_tensor(gathered, shard, async_op=True),
        dist.reduce_scatter_tensor(reduced, full, async_op=True),
        dist.all_reduce(shard, async_op=True),
        dist.all_gather(list(listed.chunk(world)), shard, async_op=True),
        dist.broadcast(shard, src=0, async_op=True),
    ]
    if not all(w.wait() for w in works):
        failures.append("a Work.wait() returned False")
    works[0].get_future().wait()
    ledger = config.ledger.take()
    nbytes = 4 * n * world
    expected = sum(config.network.seconds(kind, size, world) for kind, size in (
        ("all_gather", nbytes), ("reduce_scatter", nbytes), ("all_reduce", 4 * n), ("all_gather", nbytes), ("broadcast", 4 * n)))
    modelled = ledger.total(device.type)
    if ledger.total(device.type, "count") != len(works) or abs(modelled - expected) > 1e-12:
        failures.append(f"the ledger counted {ledger.entries}; expected {len(works)} collectives on {device.type}, {expected} s")
    pairs = [(gathered, expected_gathered), (reduced, expected_reduced), (listed, expected_listed)]
    if not all(torch.equal(got, want) for got, want in pairs) or not torch.equal(shard, torch.arange(n, device=device, dtype=torch.float32)):
        failures.append("a collective left other outputs than torch's fake group does")
    return {"device": str(device), "world": world, "accounting_modelled_s": modelled, "failures": failures}


def _overlap_check(config: Config, device: torch.device) -> Dict[str, Any]:
    """The CUDA part of [Note: the overlap self-check]."""
    clock = config.clock
    world = dist.get_world_size()
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    gathered = torch.empty(CHECK_BYTES, dtype=torch.uint8, device=device)
    shard = gathered[: CHECK_BYTES // world]
    per_matmul = _timed(device, lambda: [torch.mm(a, a, out=c) for _ in range(20)])[0] / 20
    count = max(1, round(3 * CHECK_COMM_S / per_matmul))

    def matmuls() -> None:
        for _ in range(count):
            torch.mm(a, a, out=c)

    def issue() -> Any:
        return dist.all_gather_into_tensor(gathered, shard, async_op=True)

    side = torch.cuda.Stream(device)

    def on_side() -> None:
        with torch.cuda.stream(side):
            work = issue()
        matmuls()
        work.wait()

    cases: Dict[str, Callable[[], None]] = {
        "side": on_side,
        "same": lambda: (matmuls(), issue().wait()),
        "wait_first": lambda: (issue().wait(), matmuls()),
        "future_first": lambda: (issue().get_future().wait(), matmuls()),
    }
    compute_s = _timed(device, matmuls)[0]
    comm_s, comm_host_s = _timed(device, lambda: issue().wait())
    config.ledger.take()
    times = {"side": _timed(device, on_side)[0]}
    loaded = config.ledger.take()  # (the side case's kernels ran beside the matmuls)
    times.update((name, _timed(device, case)[0]) for name, case in cases.items() if name != "side")
    overlap = {name: (compute_s + comm_s - t) / comm_s for name, t in times.items()}
    modelled = config.network.seconds("all_gather", CHECK_BYTES, world)
    failures = [f"overlap {name} = {100 * overlap[name]:.1f}%, expected {100 * lo:.0f}% to {100 * hi:.0f}%"
                for name, (lo, hi) in LIMITS.items() if not lo <= overlap[name] <= hi]
    if abs(comm_s / modelled - 1) > CALIBRATION_TOLERANCE:
        failures.append(f"the collective alone took {1e3 * comm_s:.3f} ms, the model says {1e3 * modelled:.3f} ms (calibration off by more than {100 * CALIBRATION_TOLERANCE:.0f}%)")
    under_load = loaded.measured_seconds() / loaded.total("cuda")
    if not LOAD_RATIO[0] <= under_load <= LOAD_RATIO[1]:
        failures.append(f"beside the matmuls the collective's kernel ran {under_load:.2f}x its modelled time (the GPU's clock under load?): "
                        f"the benchmark's modelled communication would be off by as much")
    if comm_host_s > HOST_FRACTION * comm_s:
        failures.append(f"issuing and waiting took the host {1e3 * comm_host_s:.3f} ms of the collective's {1e3 * comm_s:.3f} ms: wait() blocks the host")
    return {
        "cycles_per_ms": clock.cycles_per_s / 1e3, "launch_us": 1e6 * clock.launch_s, "matmuls": count,
        "compute_ms": 1e3 * compute_s, "comm_ms": 1e3 * comm_s, "comm_modelled_ms": 1e3 * modelled, "comm_host_ms": 1e3 * comm_host_s,
        "case_ms": {k: 1e3 * v for k, v in times.items()}, "overlap": overlap,
        "sleep_under_load_ratio": under_load,
        "failures": failures,
    }


def _timed(device: torch.device, fn: Callable[[], Any], repeats: int = 3) -> Tuple[float, float]:
    """The median over ``repeats`` of ``fn``'s time on the current stream of ``device`` (CUDA
    events, from an idle GPU) and of the host's time to issue it."""
    gpu, host = [], []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        fn()
        end.record()
        host.append(time.perf_counter() - began)
        torch.cuda.synchronize(device)
        gpu.append(start.elapsed_time(end) / 1e3)
    return statistics.median(gpu), statistics.median(host)


def describe(result: Dict[str, Any]) -> str:
    """One line for a summary: the self-check's verdict and its main figures."""
    verdict = "ok" if result.get("ok") else "FAILED: " + "; ".join(result.get("failures", ["no result"]))
    if "overlap" not in result:
        return f"simulated network self-check on {result.get('device', '?')} (accounting only, no kernels): {verdict}"
    overlap = ", ".join(f"{name} {100 * v:.1f}%" for name, v in result["overlap"].items())
    return (f"simulated network self-check on {result['device']}: overlap {overlap} (expected side ~100%, others ~0%); "
            f"collective alone {result['comm_ms']:.2f} ms vs model {result['comm_modelled_ms']:.2f} ms; "
            f"host issue+wait {result['comm_host_ms']:.3f} ms; sleep under load {result['sleep_under_load_ratio']:.3f}x the model; "
            f"{result['cycles_per_ms']:.0f} cycles/ms; {verdict}")


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--self-check", action="store_true", required=True, help="run the self-check (the only action)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--json", type=Path, help="write the result here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    result = self_check(device, args.world)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(describe(result))
    if not result["ok"]:
        raise SystemExit("simnet self-check FAILED: " + "; ".join(result["failures"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
