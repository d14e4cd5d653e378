"""The two-rank swaps over shared memory ([Note: shared-memory exchange] in
``flatshard._comm._shared_memory``): the values gloo would give, in flight, out of order and with
more chunks outstanding than the arena holds; a disagreement between the ranks, a peer that
leaves and a peer that never comes are errors on the waiting rank, never a hang; nothing is
left in ``/dev/shm``; ``FLATSHARD_SHARED_MEMORY=0`` on any rank keeps gloo; and training
through it is bit-identical to training through gloo."""

from __future__ import annotations

import gc
import glob
import os
import random
import time
import unittest
from unittest import mock
from datetime import timedelta
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from expecttest import TestCase
from torch import nn

from flatshard import ShardedDataParallel
from flatshard._comm._collectives import Communicator
from flatshard._comm._shared_memory import ENV_SWITCH, ChannelState, SharedMemoryChannel, _usable, available_here
from tests._models import guarded_comm
from tests._pool import COLLECTIVE_TIMEOUT_S

_TIMEOUT = timedelta(seconds=60)


def _channel_comm(hint: int = 0) -> Communicator:
    comm = guarded_comm()
    comm.use_channel(SharedMemoryChannel(comm.sibling(comm.group), hint, _TIMEOUT))
    return comm


def _swaps(rank: int, world_size: int) -> Dict[str, Any]:
    comm = _channel_comm()
    functions: List[str] = []
    comm.observe(lambda event: functions.append(event.op))
    shard = torch.arange(5.0) + 10 * rank
    gathered = torch.full((10,), -1.0)
    comm.all_gather(gathered, shard)
    full = torch.arange(8.0) + 100 * rank
    mean, total = torch.empty(4), torch.empty(4)
    comm.reduce_scatter_mean(mean, full)
    comm.reduce_scatter_sum(total, full)
    # 12 chunks of 256 KiB in flight (the 1 MiB arena holds 4; rank 1 starts once rank 0 has
    # issued all, so rank 0 must keep 8 aside), waited in reverse order, gathers and reductions
    # mixed: chunk i of rank r is i + 1000 r everywhere
    chunk = 1 << 16
    dist.barrier()  # (each rank has taken the other's chunks so far: the arenas are empty)
    if rank == 1:
        dist.barrier()
    outputs, pendings = [], []
    for i in range(12):
        mine = torch.full((chunk,), float(i + 1000 * rank))
        if i % 3 == 2:
            out = torch.empty(chunk)
            pendings.append(comm.reduce_scatter_mean(out, torch.cat([mine, mine]), async_op=True))
        else:
            out = torch.empty(2 * chunk)
            pendings.append(comm.all_gather(out, mine, async_op=True))
        outputs.append(out)
    if rank == 0:
        dist.barrier()
    for pending in reversed(pendings):
        pending.wait()
    in_flight = [sorted(set(out.tolist())) for out in outputs]
    return {
        "gathered": gathered.tolist(), "mean": mean.tolist(), "sum": total.tolist(),
        "in_flight": in_flight, "functions": sorted(set(functions)),
        "state": comm.channel.state, "capacity": comm.channel.capacity, "deferrals": comm.channel.deferrals,
        "left_in_dev_shm": glob.glob(comm.channel.prefix + "*"),  # (this channel's segments)
        "prefix": comm.channel.prefix,
    }


def _wait_then_gloo(rank: int, world_size: int) -> Dict[str, Any]:
    """Both ranks: issue 5 gathers (the arena holds 4), wait for the last, an all-reduce on
    gloo, wait for the rest; the ranks' timing differs. A wait must not return while the
    rank's own chunk of it is still kept aside: the peer would wait for it while this rank
    waits for the peer in gloo."""
    comm = _channel_comm()
    comm.all_gather(torch.empty(2), torch.ones(1))  # connected
    chunk = 1 << 16
    if rank == 0:
        time.sleep(0.3)
    outputs = [torch.empty(2 * chunk) for _ in range(5)]
    pendings = [comm.all_gather(out, torch.full((chunk,), float(10 * i + rank)), async_op=True) for i, out in enumerate(outputs)]
    if rank == 1:
        time.sleep(1.0)
    pendings[4].wait()
    total = torch.ones(1)
    dist.all_reduce(total)
    for pending in pendings[:4]:
        pending.wait()
    return {"values": [sorted(set(out.tolist())) for out in outputs], "total": total.item()}


def _program(seed: int) -> List[Tuple[Any, ...]]:
    """The same random program on both ranks: gathers and reductions of mixed sizes issued in
    flight (often more than the 1 MiB arena holds), waits in random order, gloo collectives
    in between."""
    rnd = random.Random(seed)
    ops: List[Tuple[Any, ...]] = []
    for _ in range(rnd.randint(20, 60)):
        r = rnd.random()
        if r < 0.55:
            ops.append(("issue", rnd.choice("gr"), rnd.choice([1 << 14, 3 << 14, 1 << 16, 5 << 15, 100_000])))
        elif r < 0.85:
            ops.append(("wait", rnd.random()))
        elif r < 0.95:
            ops.append(("gloo",))
        else:
            ops.append(("wait all",))
    return ops + [("wait all",)]


def _fuzz(rank: int, world_size: int, seed: int) -> List[Tuple[int, str]]:
    """Run ``_program(seed)`` with per-rank random delays; the exchanges that came out wrong."""
    comm = _channel_comm()
    timing = random.Random(1000 * seed + rank)
    live: List[Tuple[Any, torch.Tensor, torch.Tensor]] = []
    wrong: List[Tuple[int, str]] = []
    for index, op in enumerate(_program(seed)):
        if timing.random() < 0.3:
            time.sleep(timing.random() * 0.01)
        if op[0] == "issue":
            mine = torch.full((op[2],), float(10 * index + rank))
            if op[1] == "g":
                out, expected = torch.empty(2 * op[2]), torch.cat([mine - rank, mine - rank + 1])
                live.append((comm.all_gather(out, mine, async_op=True), out, expected))
            else:
                out, expected = torch.empty(op[2]), torch.full((op[2],), 10.0 * index + 0.5)
                live.append((comm.reduce_scatter_mean(out, torch.cat([mine, mine]), async_op=True), out, expected))
        elif op[0] == "gloo":
            dist.all_reduce(torch.ones(1))
        else:
            chosen = list(live) if op[0] == "wait all" else [live[int(op[1] * len(live))]] if live else []
            for item in chosen:
                item[0].wait()
                live.remove(item)
                if not torch.equal(item[1], item[2]):
                    wrong.append((index, op[0]))
    return wrong


def _many(rank: int, world_size: int) -> List[float]:
    """More exchanges in flight than a channel has record slots (64), then many in a row:
    the slots are reused only once the peer has taken what they held."""
    comm = _channel_comm()
    outputs = [torch.empty(2) for _ in range(70)]
    pendings = [comm.all_gather(out, torch.full((1,), float(i + 100 * rank)), async_op=True) for i, out in enumerate(outputs)]
    for pending in pendings:
        pending.wait()
    for i in range(150):
        out = torch.empty(2)
        comm.all_gather(out, torch.full((1,), float(i + 100 * rank)))
        outputs.append(out)
    return [value for out in outputs for value in out.tolist()]


def _disagree(rank: int, world_size: int, what: str) -> str:
    comm = _channel_comm()
    try:
        if what == "kind" and rank == 1:
            comm.reduce_scatter_mean(torch.empty(5), torch.ones(10))
        elif what == "dtype":
            comm.all_gather(torch.empty(20 // (rank + 1), dtype=torch.float64 if rank else torch.float32),
                            torch.ones(10 // (rank + 1), dtype=torch.float64 if rank else torch.float32))
        else:
            comm.all_gather(torch.empty(10 + 2 * rank * (what == "size")), torch.ones(5 + rank * (what == "size")))
    except RuntimeError as e:
        return str(e)
    return "no error"


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x: torch.Tensor, skip: int = -1) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i != skip:
                x = block(x)
        return x


def _diverge(rank: int, world_size: int, overlap: bool = True) -> str:
    """Rank 1 skips the second block in the third step."""
    net = _Blocks()
    for i, block in enumerate(net.blocks):
        net.blocks[i] = ShardedDataParallel(block)
    model = ShardedDataParallel(net)
    model.set_communication_overlap(overlap)
    try:
        for step in range(3):
            model(torch.ones(2, 8), skip=1 if step == 2 and rank == 1 else -1).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def _peer_leaves(rank: int, world_size: int) -> str:
    comm = _channel_comm()
    comm.all_gather(torch.empty(4), torch.ones(2))  # connected, one swap done
    if rank == 1:
        comm.use_channel(None)
        del comm
        gc.collect()
        dist.barrier()
        return "left"
    dist.barrier()
    try:
        comm.all_gather(torch.empty(4), torch.ones(2))
    except RuntimeError as e:
        return str(e)
    return "no error"


def _peer_never_comes(rank: int, world_size: int) -> str:
    comm = _channel_comm()
    comm.all_gather(torch.empty(4), torch.ones(2))
    outcome = "no error"
    if rank == 0:
        comm.channel.timeout_s = 0.3
        try:
            comm.all_gather(torch.empty(4), torch.ones(2))
        except RuntimeError as e:
            outcome = str(e)
    dist.barrier()
    return outcome


def _switched_off(rank: int, world_size: int) -> Dict[str, Any]:
    with mock.patch.dict(os.environ, {ENV_SWITCH: "0"} if rank == 1 else {}):
        comm = _channel_comm()
        functions: List[str] = []
        comm.observe(lambda event: functions.append(event.op))
        gathered = torch.empty(4)
        comm.all_gather(gathered, torch.full((2,), float(rank)))
    return {"state": comm.channel.state, "functions": functions, "gathered": gathered.tolist()}


def _no_room(rank: int, world_size: int) -> Dict[str, Any]:
    """Rank 1's /dev/shm has no room for its segment (as a container's small default can)."""
    real = os.posix_fallocate

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    if rank == 1:
        os.posix_fallocate = full
    try:
        comm = _channel_comm()
        gathered = torch.empty(4)
        comm.all_gather(gathered, torch.full((2,), float(rank)))
    finally:
        os.posix_fallocate = real
    return {"state": comm.channel.state, "gathered": gathered.tolist(), "left_in_dev_shm": glob.glob(comm.channel.prefix + "*"), "prefix": comm.channel.prefix}


def _train(rank: int, world_size: int, shared: bool) -> Dict[str, Any]:
    with mock.patch.dict(os.environ, {ENV_SWITCH: "1" if shared else "0"}):
        gen = torch.Generator().manual_seed(0)
        layers = [nn.Linear(16, 16) for _ in range(3)]
        for layer in layers:
            with torch.no_grad():
                layer.weight.copy_(torch.randn(16, 16, generator=gen))
        model = ShardedDataParallel(nn.Sequential(*[ShardedDataParallel(layer) for layer in layers]))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        data = torch.Generator().manual_seed(1 + rank)
        for _ in range(3):
            loss = model(torch.randn(4, 16, generator=data)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        with ShardedDataParallel.summon_full_params(model):
            params = [p.detach().clone() for p in model.parameters()]
        channels = [h.comm.channel for u in _units(model) for h in u.handles]
        states = sorted({c.state.name if c else "none" for c in channels})
        timeouts = sorted({c.timeout_s for c in channels if c})
    return {"params": params, "states": states, "timeouts": timeouts}


def _units(model: ShardedDataParallel) -> List[Any]:
    return [m._unit for m in model.modules() if isinstance(m, ShardedDataParallel)]


@unittest.skipUnless(available_here(), "needs an x86 machine with a writable /dev/shm")
class SharedMemoryExchangeTest(TestCase):
    def test_more_exchanges_than_record_slots(self) -> None:
        for rank, got in enumerate(self.pool.run(_many, 2)):
            expected = [[float(i), i + 100.0] for i in range(70)] + [[float(i), i + 100.0] for i in range(150)]
            self.assertEqual(got, [v for pair in expected for v in pair], rank)

    def test_swaps_give_what_gloo_gives_in_flight_and_beyond_the_arena(self) -> None:
        for rank, got in enumerate(self.pool.run(_swaps, 2)):
            self.assertEqual(got["state"], ChannelState.READY)
            self.assertEqual(got["capacity"], 1 << 20)
            self.assertEqual(got["functions"], ["shared_memory"])
            self.assertEqual(got["gathered"], [float(i) for i in range(5)] + [10.0 + i for i in range(5)])
            positions = range(4 * rank, 4 * rank + 4)
            self.assertEqual(got["sum"], [2.0 * p + 100 for p in positions])
            self.assertEqual(got["mean"], [p + 50.0 for p in positions])
            for i, values in enumerate(got["in_flight"]):
                expected = [i + 500.0] if i % 3 == 2 else [float(i), i + 1000.0]
                self.assertEqual(values, expected, (rank, i))
            self.assertTrue(got["prefix"].startswith("/dev/shm/flatshard-"), got["prefix"])
            self.assertEqual(got["left_in_dev_shm"], [])
            if rank == 0:
                self.assertEqual(got["deferrals"], 8)

    def test_a_wait_returns_only_once_its_own_chunk_is_out(self) -> None:
        for got in self.pool.run(_wait_then_gloo, 2, timeout=60):
            self.assertEqual(got["values"], [[10.0 * i, 10.0 * i + 1] for i in range(5)])
            self.assertEqual(got["total"], 2.0)

    def test_random_programs_neither_hang_nor_mix_up_chunks(self) -> None:
        # FLATSHARD_SHM_FUZZ_SEEDS=200 for a long run
        for seed in range(int(os.environ.get("FLATSHARD_SHM_FUZZ_SEEDS", "16"))):
            self.assertEqual(self.pool.run(_fuzz, 2, seed, timeout=60), [[], []], seed)

    def test_ranks_that_disagree_both_raise(self) -> None:
        kind = self.pool.run(_disagree, 2, "kind")
        self.assertEqual(kind[1], kind[0].replace("[rank 0]", "[rank 1]"))  # both ranks say the same
        self.assertExpectedInline(kind[0], """[rank 0] the ranks disagree on collective #1 of this model (every rank must run the same units in the same order, e.g. no data-dependent skipping): rank 0 issued an all-gather (20 bytes of torch.float32); rank 1 a reduce-scatter (20 bytes of torch.float32)""")
        dtype = self.pool.run(_disagree, 2, "dtype")
        self.assertEqual(dtype[1], dtype[0].replace("[rank 0]", "[rank 1]"))
        self.assertExpectedInline(dtype[0], """[rank 0] the ranks disagree on collective #1 of this model (every rank must run the same units in the same order, e.g. no data-dependent skipping): rank 0 issued an all-gather (40 bytes of torch.float32); rank 1 an all-gather (40 bytes of torch.float64)""")
        size = self.pool.run(_disagree, 2, "size")
        self.assertEqual(size[1], size[0].replace("[rank 0]", "[rank 1]"))
        self.assertExpectedInline(size[0], """[rank 0] the ranks disagree on collective #1 of this model (every rank must run the same units in the same order, e.g. no data-dependent skipping): rank 0 issued an all-gather (20 bytes of torch.float32); rank 1 an all-gather (24 bytes of torch.float32)""")

    def test_ranks_that_run_different_units_after_the_first_step_both_raise_naming_them(self) -> None:
        # (the first step's order checks would catch this; later, gloo would silently swap
        # the chunks of two units of the same size). Without overlap, the exchange's labels
        # differ at the first gather that differs:
        for rank, got in enumerate(self.pool.run(_diverge, 2, False)):
            self.assertRegex(got, rf"^\[rank {rank}\] the ranks disagree on collective #\d+ of this model \(every rank must run the same units in the same order, e.g. no data-dependent skipping\): rank 0 issued an all-gather of unit 'blocks.1' \(144 bytes of torch.float32\); rank 1 an all-gather of unit 'blocks.2' \(144 bytes of torch.float32\)$")
        # with overlap both ranks prefetched the same units (by the recorded order), and the
        # check at the end of the forward names the difference
        for rank, got in enumerate(self.pool.run(_diverge, 2)):
            self.assertEqual(got, f"[rank {rank}] the ranks ran different units (every rank must run the same units in the same order, e.g. no data-dependent skipping): unit #1 of this forward differs: rank 0 ran 'blocks.1'; rank 1 ran 'blocks.2'")

    def test_a_peer_that_leaves_is_an_error_at_once(self) -> None:
        got = self.pool.run(_peer_leaves, 2, timeout=60)
        self.assertEqual(got[1], "left")
        self.assertRegex(got[0], r"^rank 1 closed its end of the shared-memory exchange \(its process exited or its model was freed\)")

    def test_a_peer_that_never_comes_times_out(self) -> None:
        got = self.pool.run(_peer_never_comes, 2, timeout=60)
        self.assertEqual(got[1], "no error")
        self.assertRegex(got[0], r"^\[rank 0\] waited \d+\.\d s \(the process group's timeout\) for rank 1's side of collective #2, an all-gather \(8 bytes of torch.float32\), through shared memory$")

    def test_switched_off_on_one_rank_keeps_gloo_on_both(self) -> None:
        for rank, got in enumerate(self.pool.run(_switched_off, 2)):
            self.assertEqual(got["state"], ChannelState.UNAVAILABLE)
            self.assertEqual(got["functions"], ["all_to_all_single"])
            self.assertEqual(got["gathered"], [0.0, 0.0, 1.0, 1.0])

    def test_no_room_in_dev_shm_on_one_rank_keeps_gloo_on_both(self) -> None:
        for got in self.pool.run(_no_room, 2):
            self.assertEqual(got["state"], ChannelState.UNAVAILABLE)
            self.assertEqual(got["gathered"], [0.0, 0.0, 1.0, 1.0])
            self.assertTrue(got["prefix"].startswith("/dev/shm/flatshard-"), got["prefix"])
            self.assertEqual(got["left_in_dev_shm"], [])

    def test_training_through_shared_memory_is_bit_identical_to_gloo(self) -> None:
        shared = self.pool.run(_train, 2, True)
        gloo = self.pool.run(_train, 2, False)
        for rank in range(2):
            self.assertEqual(shared[rank]["states"], ["READY"])
            self.assertEqual(shared[rank]["timeouts"], [float(COLLECTIVE_TIMEOUT_S)])  # the process group's
            self.assertEqual(gloo[rank]["states"], ["UNAVAILABLE"])
            for a, b in zip(shared[rank]["params"], gloo[rank]["params"]):
                self.assertTrue(torch.equal(a, b))


class UsableTest(TestCase):
    def facts(self, **changes: Any) -> Dict[str, Any]:
        facts = {"enabled": True, "machine": "x86_64", "host": ("h", "boot", "pid:[1]"), "writable": True, "token": "t", "hint": 0}
        facts.update(changes)
        return facts

    def test_only_two_enabled_x86_ranks_on_one_host_share_memory(self) -> None:
        self.assertTrue(_usable([self.facts(), self.facts(token="u")]))
        self.assertFalse(_usable([self.facts(), self.facts(), self.facts()]))
        self.assertFalse(_usable([self.facts(), self.facts(enabled=False)]))
        self.assertFalse(_usable([self.facts(machine="aarch64"), self.facts(machine="aarch64")]))
        self.assertFalse(_usable([self.facts(), self.facts(host=("other", "boot", "pid:[1]"))]))
        self.assertFalse(_usable([self.facts(), self.facts(host=("h", "boot", "pid:[2]"))]))
        self.assertFalse(_usable([self.facts(writable=False), self.facts()]))

    def test_a_dead_peer_is_seen_dead_reaped_or_not(self) -> None:
        import subprocess
        import sys
        import time

        from flatshard._comm._shared_memory import _exited

        self.assertFalse(_exited(os.getpid()))
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        deadline = time.monotonic() + 30
        while not _exited(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertTrue(_exited(child.pid))  # a zombie: exited, not reaped yet
        child.wait()
        self.assertTrue(_exited(child.pid))
