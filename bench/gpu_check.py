"""The GPU check (``bench/gpu_check.sh OUT``): CUDA tests, a throughput and memory table against
torch FSDP1, FSDP2 and the plain model, and a profile of one flatshard step, in one command.

    bash bench/gpu_check.sh OUT              # on a machine with a CUDA GPU (about 3 minutes on an H100)
    bash bench/gpu_check.sh --rounds 3 OUT   # each throughput run three times, in rotating order
    bash bench/gpu_check.sh --dry-run OUT    # on CPU: the same steps at tiny size, no tests run

Each part runs in its own process with its own time limit, so one that fails or hangs still
leaves the others' results; every part writes JSON into OUT, and the last step prints one
summary table (also ``OUT/summary.md``). The dry run checks the arguments, imports and model
building on CPU (the suite runs it, so the script cannot rot between GPU runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
IMPLS = ("flatshard", "fsdp1", "fsdp2", "plain")
TIME_LIMITS = {"tests": 240, "throughput": 100, "profile": 90}


def _run_part(name: str, cmd: List[str], out: Path, limit: float) -> Dict[str, Any]:
    """Run one part; its output goes to ``OUT/<name>.log``."""
    start = time.monotonic()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), PYTHONUNBUFFERED="1")
    with open(out / f"{name}.log", "w") as log:
        try:
            rc: Optional[int] = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = None
    seconds = time.monotonic() - start
    status = "timed out" if rc is None else ("ok" if rc == 0 else f"exit {rc}")
    print(f"[gpu_check] {name}: {status} in {seconds:.0f} s", flush=True)
    return {"part": name, "status": status, "seconds": round(seconds, 1)}


def _summarizing(out: Path, parts: List[Dict[str, Any]]) -> Any:
    """``_run`` that also rewrites ``OUT/summary.md`` after each part (a check cut off by an
    outer time limit still leaves the summary of what finished)."""

    def run(name: str, cmd: List[str], out_: Path, limit: float) -> Dict[str, Any]:
        part = _run_part(name, cmd, out_, limit)
        summarize(out, parts + [part])
        return part

    return run


def run_all(out: Path, dry_run: bool, rounds: int) -> List[Dict[str, Any]]:
    py = sys.executable
    parts: List[Dict[str, Any]] = []
    _run = _summarizing(out, parts)
    if dry_run:
        parts.append(_run("tests", [py, "-m", "pytest", "-q", "--collect-only", "tests/test_gpu.py"], out, TIME_LIMITS["tests"]))
        size = ["--config", "tiny", "--device", "cpu", "--seq", "32", "--warmup", "1"]
    else:
        parts.append(_run("tests", [py, "-m", "pytest", "-q", "-rs", "tests/test_gpu.py", f"--junitxml={out / 'tests.xml'}"], out, TIME_LIMITS["tests"]))
        size = []
    steps = ["--steps", "2"] if dry_run else []
    for round_ in range(rounds):
        # each round in another order: a machine that drifts (clocks, the host's load) favours no one
        for impl in IMPLS[round_ % len(IMPLS):] + IMPLS[: round_ % len(IMPLS)]:
            name = f"throughput_{impl}_r{round_}"
            parts.append(_run(name, [py, "bench/gpu_throughput.py", "--impl", impl, "--json", str(out / f"{name}.json"), *size, *steps], out, TIME_LIMITS["throughput"]))
    steps = ["--steps", "1"] if dry_run else []
    parts.append(_run("profile", [py, "bench/gpu_profile.py", "--json", str(out / "profile.json"), *size, *steps], out, TIME_LIMITS["profile"]))
    return parts


def _tests_line(out: Path) -> str:
    log = (out / "tests.log").read_text() if (out / "tests.log").exists() else ""
    lines = [line for line in log.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def summarize(out: Path, parts: List[Dict[str, Any]]) -> str:
    import torch

    rows = []
    results = {}
    for impl in IMPLS:
        runs = [json.loads(path.read_text()) for path in sorted(out.glob(f"throughput_{impl}_r*.json"))]
        if runs:
            # the run with the median tokens/s stands for the implementation; every run's is listed
            runs.sort(key=lambda r: r["tokens_per_s"])
            results[impl] = dict(runs[(len(runs) - 1) // 2], rounds=[round(r["tokens_per_s"]) for r in runs])
    ours = results.get("flatshard")
    device = next((r["device"] for r in results.values()), "?")
    lines = [
        f"GPU check, {time.strftime('%Y-%m-%d')}: {device}, torch {torch.__version__}, python {platform.python_version()}",
        "",
        "| part | status | seconds |",
        "| --- | --- | --- |",
        *(f"| {p['part']} | {p['status']} | {p['seconds']} |" for p in parts),
        "",
        f"CUDA tests: {_tests_line(out)}",
        "",
    ]
    if results:
        first = next(iter(results.values()))
        lines += [
            f"Throughput: Llama-style {first['config']} ({first['params'] / 1e9:.2f}B parameters), bf16 compute, fp32 reduction, "
            f"batch {first['batch']} x {first['seq']} tokens, rank 0 of {max(r['world'] for r in results.values())} on the fake backend "
            f"(plain: the unwrapped model under autocast), median of {first['steps']} steps; of the rounds, the median (of two, the slower)",
            "",
            "| implementation | tokens/s | each round | MFU | step ms | host ms | peak allocated GiB | peak reserved GiB | alloc retries | flatshard tokens/s ratio |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for impl, r in results.items():
            ratio = f"{ours['tokens_per_s'] / r['tokens_per_s']:.3f}" if ours else "-"
            mem = [f"{r[k]:.2f}" if k in r else "-" for k in ("peak_allocated_gib", "peak_reserved_gib")]
            rows.append(f"| {impl} | {r['tokens_per_s']:.0f} | {', '.join(map(str, r['rounds']))} | {100 * r['mfu']:.1f}% | {1e3 * r['step_s']:.1f} | {1e3 * r['host_s']:.1f} | {mem[0]} | {mem[1]} | {r.get('alloc_retries', '-')} | {ratio} |")
        lines += rows + [""]
    if results:
        lines += ["host ms: until the step's Python returns (the GPU may still be running); near the step time, the host is the bottleneck", ""]
    if (out / "profile.json").exists():
        prof = json.loads((out / "profile.json").read_text())
        lines.append("Profile of one flatshard step: " + ", ".join(f"{k} = {v}" for k, v in prof.items()))
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny models on CPU, tests collected but not run")
    p.add_argument("--rounds", type=int, default=2, help="throughput runs per implementation, in rotating order (default 2)")
    p.add_argument("out", type=Path, help="folder for the JSON results, logs and summary")
    args = p.parse_args(argv)
    import torch

    if args.rounds < 1:
        p.error(f"--rounds must be >= 1; got {args.rounds}")
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device here; use --dry-run for the CPU check of the script")
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in [*args.out.glob("throughput_*.json"), *args.out.glob("*.log"), *(args.out / n for n in ("profile.json", "tests.xml", "summary.md"))]:
        stale.unlink(missing_ok=True)  # (the summary reads only what this run writes)
    parts = run_all(args.out, args.dry_run, args.rounds)
    print(summarize(args.out, parts), flush=True)
    return 0 if all(part["status"] == "ok" for part in parts) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
