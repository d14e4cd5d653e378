"""The main example (the README's first Set-up command) runs: by itself (2 spawned CPU ranks) and under torchrun."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "train_gpt.py")
TINY = ["--log-every", "1", "--layers", "2", "--dim", "32"]
SMALL = ["--steps", "3", *TINY]


def _run(cmd):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_example_without_arguments_starts_two_cpu_ranks():
    out = _run([sys.executable, EXAMPLE, *SMALL])
    assert out.startswith("2 ranks, ")
    losses = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) == 3
    assert "done: 3 steps" in out


def test_example_under_torchrun_uses_the_launchers_ranks_and_flags():
    flags = ["--strategy", "SHARD_GRAD_OP", "--backward-prefetch", "BACKWARD_POST", "--forward-prefetch", "--mixed-precision", "bf16"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", EXAMPLE, *SMALL, *flags]
    out = _run(cmd)
    assert out.startswith("3 ranks, ")
    assert "done: 3 steps" in out
    assert all("mem " in line for line in out.splitlines() if line.startswith("step"))


# One run of bench/bench.py for the three tests below (the suite's time): the comparison of
# flatshard and FSDP1, matching configurations of both, and the profile of a flatshard step.
MATCHING = "flatshard activation_checkpointing,fsdp1 activation_checkpointing,flatshard SHARD_GRAD_OP,fsdp1 SHARD_GRAD_OP"


@pytest.fixture(scope="module")
def bench_output():
    tiny = ["--layers", "2", "--dim", "32", "--heads", "2", "--seq", "16", "--batch", "2", "--vocab", "64",
            "--warmup", "1", "--steps", "1", "--rounds", "1", "--variants", f"flatshard,fsdp1,ddp,{MATCHING}", "--profile", "2"]
    return _run([sys.executable, str(ROOT / "bench" / "bench.py"), *tiny])


def test_benchmark_script_runs_and_prints_the_comparison(bench_output):
    out = bench_output
    rows = [line for line in out.splitlines() if line.startswith("| flatshard |") or line.startswith("| fsdp1 |")]
    assert len(rows) == 4, out  # the comparison, then the phase split
    assert "| CPU / rank / step: step thread + gloo threads | cores busy |" in out, out
    for row in rows[:2]:  # the step thread's and gloo's CPU per rank and step, and the cores' use
        cpu, busy = [c.strip() for c in row.strip("|").split("|")][5:7]
        step_thread, gloo = (float(part.split()[0]) for part in cpu.split("+"))
        assert step_thread > 0 and gloo >= 0 and float(busy.rstrip("%")) > 0, row
    assert "| forward: wall = CPU + runnable + asleep | backward: wall = CPU + runnable + asleep |" in out, out
    for row in rows[2:]:  # per phase: the step thread's wall time = on a core + waiting for one + asleep
        cells = [[float(x) for x in c.replace("=", "+").split("+")] for c in row.strip("|").split("|")[1:]]
        assert len(cells) == 4, row  # forward, backward, optimizer, the step
        for wall, cpu, runnable, asleep in cells:  # (each rounded to the millisecond)
            assert abs(wall - (cpu + runnable + asleep)) <= 2 and min(cpu, runnable, asleep) >= 0, row
        assert abs(cells[3][0] - sum(cell[0] for cell in cells[:3])) <= 2, row


def test_benchmark_script_runs_matching_configurations_of_flatshard_and_fsdp1(bench_output):
    # e.g. activation checkpointing applied after wrapping, as FSDP1 training recipes do
    for name in MATCHING.split(","):
        assert sum(line.startswith(f"| {name} |") for line in bench_output.splitlines()) == 2, (name, bench_output)


def _bench_script():
    spec = importlib.util.spec_from_file_location("bench_script", ROOT / "bench" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_phase_clock_splits_each_measured_phase_and_nothing_between_steps():
    """[Note: where the wall time goes], with the clocks replaced: readings of (wall, the
    thread's CPU, its time runnable), at each phase's start and at the step's end."""
    readings = iter([
        [0.0, 0.0, 0.0], [1.0, 0.5, 0.1], [3.0, 2.0, 0.2], [3.5, 2.4, 0.2],  # a warm-up step
        [10.0, 5.0, 1.0], [10.4, 5.3, 1.05], [11.4, 6.0, 1.15], [11.6, 6.2, 1.15],  # measured
        [20.0, 9.0, 2.0], [21.0, 9.5, 2.5], [21.5, 9.6, 2.5], [22.0, 9.7, 2.5],  # measured
    ])
    clock = _bench_script().PhaseClock(read=lambda: next(readings))
    for step in range(3):
        clock.on = step > 0  # (the time from one step's end to the next's start is never counted)
        for phase in ("forward", "backward", "optimizer", "end"):
            clock.mark(phase)
    expected = {  # wall, CPU, runnable, asleep (the rest), summed over the two measured steps
        "forward": [0.4 + 1.0, 0.3 + 0.5, 0.05 + 0.5, 0.05 + 0.0],
        "backward": [1.0 + 0.5, 0.7 + 0.1, 0.1 + 0.0, 0.2 + 0.4],
        "optimizer": [0.2 + 0.5, 0.2 + 0.1, 0.0, 0.0 + 0.4],
    }
    assert clock.totals.keys() == expected.keys()
    for phase, values in expected.items():
        assert clock.totals[phase] == pytest.approx(values), phase


def test_phase_clock_wall_time_contains_a_wait_between_its_readings():
    """A thread preempted between the wall and schedstat reads that end a phase: the wait
    (5 ms, runnable) lies inside the phase's wall time, never outside it (with one wall
    reading the forward was 2 ms of wall but 5 ms runnable)."""
    readings = iter([
        [0.0, 0.0, 0.0, 0.0],  # forward starts
        [0.002, 0.001, 0.005, 0.0071],  # forward ends, backward starts: 5 ms waited mid-reading
        [0.010, 0.003, 0.005, 0.010],  # backward ends
    ])
    clock = _bench_script().PhaseClock(read=lambda: next(readings))
    clock.on = True
    for phase in ("forward", "backward", "end"):
        clock.mark(phase)
    assert clock.totals["forward"] == pytest.approx([0.0071, 0.001, 0.005, 0.0011])
    assert clock.totals["backward"] == pytest.approx([0.008, 0.002, 0.0, 0.006])
    for wall, cpu, runnable, asleep in (clock.totals["forward"], clock.totals["backward"]):
        assert wall == pytest.approx(cpu + runnable + asleep)


def test_benchmark_profile_splits_a_flatshard_step_and_measures_the_loopback(bench_output):
    out = bench_output
    report = out.split("### flatshard: where a step goes", 1)[1]
    parts = {}
    for line in report.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 3 and cells[1].replace(".", "").isdigit():
            parts[cells[0]] = float(cells[1])
    for name in ("waiting on communication", "issuing communication", "copies", "runtime Python", "compute (the rest)"):
        assert name in parts, report
    assert parts["runtime Python"] > 0 and parts["compute (the rest)"] > 0, report
    # per entry point, calls per step: 3 units (2 blocks and the root), one handle each
    calls = {c[0]: c[2] for c in ([x.strip() for x in line.strip("|").split("|")] for line in report.splitlines())
             if len(c) == 3 and c[0].startswith(("pre-forward", "post-backward", "end of backward"))}
    assert calls == {"pre-forward (per unit forward)": "3", "post-backward hook (per handle)": "3", "end of backward (per step)": "1"}, report
    assert "MiB sent per rank per step; loopback " in report and "latency: a 4 KiB all-gather takes " in report, report
    assert "DDP's step in this run: " in report, report


def test_benchmark_script_runs_deepspeed_zero3_beside_flatshard_when_it_is_installed():
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip('the benchmark\'s deepspeed row needs DeepSpeed (pip install -e ".[deepspeed]")')
    # (an embedding of 4096 x 32 is above DeepSpeed's default size for keeping a parameter whole)
    tiny = ["--layers", "1", "--dim", "32", "--heads", "2", "--seq", "16", "--batch", "2", "--vocab", "4096",
            "--warmup", "1", "--steps", "2", "--rounds", "1", "--variants", "flatshard,deepspeed"]
    out = _run([sys.executable, str(ROOT / "bench" / "bench.py"), *tiny])
    rows = [line for line in out.splitlines() if line.startswith("| deepspeed |")]
    assert len(rows) == 2, out  # the comparison and the phase split
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[3].endswith(" MiB") and float(cells[3].split()[0]) >= 0.1, rows[0]  # it sent gathers and reductions


def test_benchmark_script_names_an_unknown_variant():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench.py"), "--variants", "flatshard,zero9"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown variant(s) ['zero9']; choose from: flatshard, " in proc.stderr, proc.stderr


def test_heap_trace_shows_each_ops_faults_and_heap_changes_per_phase():
    import ctypes

    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("bench/heap_trace.py needs glibc's mallinfo2 (glibc 2.33 or later)")
    small = ["--vocab", "64", "--batch", "2", "--seq", "16", "--warmup", "1", "--steps", "2", "--min-faults", "0"]
    out = _run([sys.executable, str(ROOT / "bench" / "heap_trace.py"), "--impl", "flatshard", *small])
    ops = [line.split() for line in out.splitlines() if line.startswith("step ")]
    assert {(op[1], op[2]) for op in ops} >= {(s, p) for s in "01" for p in ("forward", "backward", "optimizer")}, out
    assert any(op[3] == "aten.mm.default" for op in ops) and all(op[5] == "faults," for op in ops), out
    rows = [line for line in out.splitlines() if line.startswith(("| 0 |", "| 1 |"))]
    assert len(rows) == 2, out  # per traced step: faults, heap grew, heap shrank


def test_own_cpu_charges_each_runtime_function_its_exclusive_cpu_per_phase():
    small = ["--vocab", "64", "--batch", "2", "--seq", "16", "--warmup", "1", "--steps", "2"]
    out = _run([sys.executable, str(ROOT / "bench" / "own_cpu.py"), *small])
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 6 and cells[1][:1].isdigit():
            rows[cells[0]] = cells
    functions = {k: v for k, v in rows.items() if k not in ("**all measured**", "step thread, all of it")}
    assert {"RootRuntime.start_forward", "RootRuntime.post_backward", "Communicator.all_gather", "FlatParamHandle.use_views"} <= set(functions), out
    assert float(functions["RootRuntime.start_forward"][4]) == 9.0, out  # 9 units (8 blocks and the root), once each
    post_backward = functions["RootRuntime.post_backward"]
    assert float(post_backward[1]) == 0.0 < float(post_backward[2]), out  # backward only
    for phase in (1, 2, 3):  # the total row adds up the functions (to rounding), inside the step thread's time
        total = sum(float(cells[phase]) for cells in functions.values())
        assert abs(float(rows["**all measured**"][phase]) - total) <= 0.01 * len(functions), (phase, out)
        assert float(rows["**all measured**"][phase]) <= float(rows["step thread, all of it"][phase]), (phase, out)
    assert "ms per unit (9 units)" in out, out


@pytest.mark.parametrize("flag", [[], ["--no-yield"]])
def test_gather_waits_times_every_forward_gather_on_both_ranks(flag):
    small = ["--shape", "default", "--vocab", "64", "--batch", "2", "--seq", "16", "--warmup", "1", "--steps", "2"]
    out = _run([sys.executable, str(ROOT / "bench" / "gather_waits.py"), *small, *flag])
    assert "18 forward gathers in 2 steps (9 per step)" in out, out  # the root and 8 blocks, each step
    for name in ("from the later rank's issue to completion", "between the two ranks' issues"):
        row = next(line for line in out.splitlines() if line.startswith(f"| {name} |"))
        median, p90, most, over = [c.strip() for c in row.strip("|").split("|")[1:]]
        assert 0 <= float(median) <= float(p90) <= float(most) and 0 <= int(over) <= 18, row


def test_memory_script_shows_a_sharded_share_of_parameters_gradients_and_optimizer_state():
    out = _run([sys.executable, str(ROOT / "bench" / "memory.py"), "--world-sizes", "2"])
    row = next(line for line in out.splitlines() if line.startswith("| 2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4] == cells[5], row  # params + grads + AdamW state == 4 x total / 2
    gathered_units = float(cells[6].split("(")[1].rstrip(")"))
    assert gathered_units <= 3.0, row  # the root, the unit computing and the prefetched one
    arena_units = float(cells[7].split("(")[1].rstrip(")"))
    from flatshard._comm._shared_memory import available_here

    if available_here():
        assert 1.5 <= arena_units <= 1.6, row  # three of the largest shard (half a unit), 64-byte aligned


def _losses(out):
    return {line.split()[1]: line.split()[3] for line in out.splitlines() if line.startswith("step")}


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """Runs of 4 steps: uninterrupted; saved at step 2; resumed from it (saved at its end)."""
    tmp_path = tmp_path_factory.mktemp("resumed")
    whole = _losses(_run([sys.executable, EXAMPLE, "--steps", "4", *TINY]))
    ckpt, full = str(tmp_path / "ckpt"), str(tmp_path / "model.pt")
    first = _losses(_run([sys.executable, EXAMPLE, "--steps", "2", "--save", ckpt, *TINY]))
    second = _run([sys.executable, EXAMPLE, "--steps", "4", "--resume", ckpt, "--full-checkpoint", full, *TINY])
    return {"whole": whole, "first": first, "second": second, "ckpt": ckpt, "full": full}


def test_example_resumes_exactly_where_it_stopped_and_writes_a_plain_checkpoint(resumed_run):
    """A run of 4 steps saved at step 2 and resumed prints the uninterrupted run's losses."""
    second = resumed_run["second"]
    assert "resumed at step 3" in second
    assert {**resumed_run["first"], **_losses(second)} == resumed_run["whole"]
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from train_gpt import GPT
    finally:
        sys.path.pop(0)
    plain = GPT(64, 32, 2, 4, 32)
    plain.load_state_dict(torch.load(resumed_run["full"], weights_only=True), strict=True)


def test_example_resumed_past_its_steps_keeps_the_later_checkpoint(resumed_run):
    """A run resumed from a checkpoint of a later step than its --steps trains nothing and saves
    nothing: before, it saved the later weights as step --steps and removed the later checkpoint."""
    from flatshard.run_checkpoints import published_steps

    ckpt = resumed_run["ckpt"]
    assert [step for step, _ in published_steps(ckpt)] == [4, 2]  # (the resumed run saved at its end)
    _run([sys.executable, EXAMPLE, "--steps", "3", "--resume", ckpt, *TINY])
    assert [step for step, _ in published_steps(ckpt)] == [4, 2]


FINETUNE_HF = str(ROOT / "examples" / "finetune_hf.py")


def test_finetune_hf_resumes_writes_a_hugging_face_directory_and_generates(tmp_path):
    """The Hugging Face example (2 spawned CPU ranks, bf16, checkpointing): a sharded checkpoint
    at step 2, resumed to step 3; its save_pretrained directory loads with from_pretrained and
    generates what the wrapped model generated. Needs the hf extra."""
    transformers = pytest.importorskip("transformers", reason="examples/finetune_hf.py needs the hf extra (transformers)")
    small = ["--log-every", "1", "--seq", "16", "--batch", "2"]
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    first = _run([sys.executable, FINETUNE_HF, "--steps", "2", "--save", ckpt, "--save-every", "1", "--keep", "1", *small])
    assert first.startswith("2 ranks, LlamaForCausalLM, bf16")
    assert sorted(_losses(first)) == ["1", "2"]
    assert sorted(os.listdir(ckpt)) == ["step-00000002"]  # RunCheckpoints: every step, the newest kept
    second = _run([sys.executable, FINETUNE_HF, "--steps", "3", "--resume", ckpt, "--output", out, "--mixed-precision", "none", *small])
    assert "resumed at step 3" in second and sorted(_losses(second)) == ["3"]
    assert "(the same after from_pretrained)" in second, second
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "LlamaForCausalLM"
