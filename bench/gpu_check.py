"""The GPU check (``bench/gpu_check.sh OUT``): CUDA tests, a throughput and memory table against
torch FSDP1, FSDP2 and the plain model, a profile of one flatshard step, and the three on a
simulated network, in one command.

    bash bench/gpu_check.sh OUT              # on a machine with a CUDA GPU (about 6 minutes on an H100)
    bash bench/gpu_check.sh --rounds 3 OUT   # each throughput run three times, in rotating order
    bash bench/gpu_check.sh --dry-run OUT    # on CPU: the same steps at tiny size, no tests run

Each part runs in its own process with its own time limit, so one that fails or hangs still
leaves the others' results; every part writes JSON into OUT, and the last step prints one
summary table (also ``OUT/summary.md``). The dry run checks the arguments, imports and model
building on CPU (the suite runs it, so the script cannot rot between GPU runs).

The network part (``bench/simnet.py``, ``bench/gpu_network.py``) first runs the simulated
network's self-check; only if it passes does it train flatshard, FSDP1 and FSDP2 at batch
8 x 2048 on each network (``NETWORKS``), one process each, until its own time budget
(``NETWORK_BUDGET_S``) is spent. In the dry run the self-check checks only the accounting (no
kernels on CPU), and one process trains all three on every network at tiny size.
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
TIME_LIMITS = {"tests": 240, "throughput": 100, "profile": 90, "network_check": 90, "network": 75}
NETWORK_IMPLS = ("flatshard", "fsdp1", "fsdp2")
NETWORKS = ("none", "nvlink", "ib")  # (none first: the others' exposed time is measured against it)
NETWORK_BUDGET_S = 240  # the whole network part's; a run not started by then is skipped


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
    parts += run_network(out, dry_run, _run)
    return parts


def run_network(out: Path, dry_run: bool, run: Any) -> List[Dict[str, Any]]:
    """The network part: the self-check, then (if it passed) each implementation on each network."""
    py = sys.executable
    start = time.monotonic()
    device = ["--device", "cpu"] if dry_run else []
    check = run("network_check", [py, "bench/simnet.py", "--self-check", "--json", str(out / "simnet_check.json"), *device], out, TIME_LIMITS["network_check"])
    parts = [check]
    if dry_run:
        size = ["--config", "tiny", "--batch", "2", "--seq", "32", "--warmup", "1", "--steps", "2", *device]
        runs = [("network", ",".join(NETWORK_IMPLS), ",".join(NETWORKS))]
    else:
        size = []
        runs = [(f"network_{impl}_{network}", impl, network) for impl in NETWORK_IMPLS for network in NETWORKS]
    for name, impls, networks in runs:
        if check["status"] != "ok":
            parts.append({"part": name, "status": "skipped (the self-check failed)", "seconds": 0})
        elif time.monotonic() - start > NETWORK_BUDGET_S:
            parts.append({"part": name, "status": f"skipped (the network part's {NETWORK_BUDGET_S} s were spent)", "seconds": 0})
        else:
            cmd = [py, "bench/gpu_network.py", "--impl", impls, "--networks", networks, "--json-dir", str(out), *size]
            parts.append(run(name, cmd, out, TIME_LIMITS["network"]))
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
    lines += network_lines(out)
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


def network_lines(out: Path) -> List[str]:
    """The network part's summary: the self-check's verdict, then one row per implementation and
    network, its exposed time against the same implementation's on no network."""
    sys.path.insert(0, str(ROOT / "bench"))
    from simnet import describe

    check_path = out / "simnet_check.json"
    if not check_path.exists():
        return []
    lines = ["", "Simulated network: " + describe(json.loads(check_path.read_text())), ""]
    runs = {(r["impl"], r["network"]): r for r in (json.loads(p.read_text()) for p in sorted(out.glob("network_*.json")))}
    if not runs:
        return lines
    first = next(iter(runs.values()))
    lines += [
        f"On a simulated network: Llama-style {first['config']} ({first['params'] / 1e9:.2f}B parameters), bf16 compute, fp32 reduction, "
        f"batch {first['batch']} x {first['seq']} tokens, rank 0 of {first['world']}, median of {first['steps']} steps; nvlink: 360 GB/s bus bandwidth, "
        "20 us per collective; ib: 45 GB/s, 20 us; none: torch's fake group. comm: the collectives' time per step by the model (kernels: as the GPU ran them); "
        "exposed: the phase's time minus the same implementation's on no network; overlap = 1 - exposed step / comm (model)",
        "",
        "| network | implementation | tokens/s | MFU | step ms | comm ms (model) | comm ms (kernels) | exposed ms forward | exposed ms backward | exposed ms step | overlap | peak allocated GiB | peak reserved GiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for network in NETWORKS:
        for impl in NETWORK_IMPLS:
            if (impl, network) in runs:
                lines.append(_network_row(runs[(impl, network)], runs.get((impl, "none"))))
    if first["device"] == "cpu":
        lines += ["", "(on CPU, the dry run, collectives are only counted and take no time: its exposed time and overlap are noise)"]
    off = [f"{r['impl']} on {r['network']} ({r['comm_measured_s'] / r['comm_modelled_s']:.2f}x)" for r in runs.values()
           if r.get("comm_measured_s") and r["comm_modelled_s"] > 0 and abs(r["comm_measured_s"] / r["comm_modelled_s"] - 1) > 0.1]
    if off:
        lines += ["", "WARNING: the simulated collectives ran more than 10% off the model (the GPU's clock under load?): " + ", ".join(off)]
    return lines + [""]


def _network_row(r: Dict[str, Any], base: Optional[Dict[str, Any]]) -> str:
    ms = lambda v: "-" if v is None else f"{1e3 * v:.1f}"  # noqa: E731
    exposed: List[Optional[float]] = [None, None, None]
    overlap = "-"
    if base is not None and r["network"] != "none":
        exposed = [r["phase_s"]["forward"] - base["phase_s"]["forward"], r["phase_s"]["backward"] - base["phase_s"]["backward"], r["step_s"] - base["step_s"]]
        if r["comm_modelled_s"] > 0:
            overlap = f"{100 * (1 - exposed[2] / r['comm_modelled_s']):.0f}%"
    mem = [f"{r[k]:.2f}" if k in r else "-" for k in ("peak_allocated_gib", "peak_reserved_gib")]
    comm = [ms(r["comm_modelled_s"]), ms(r.get("comm_measured_s"))] if r["network"] != "none" else ["-", "-"]
    return (f"| {r['network']} | {r['impl']} | {r['tokens_per_s']:.0f} | {100 * r['mfu']:.1f}% | {ms(r['step_s'])} | {comm[0]} | {comm[1]} | "
            f"{' | '.join(ms(e) for e in exposed)} | {overlap} | {mem[0]} | {mem[1]} |")


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
    stale_names = ("profile.json", "tests.xml", "summary.md", "simnet_check.json")
    for stale in [*args.out.glob("throughput_*.json"), *args.out.glob("network_*.json"), *args.out.glob("*.log"), *(args.out / n for n in stale_names)]:
        stale.unlink(missing_ok=True)  # (the summary reads only what this run writes)
    parts = run_all(args.out, args.dry_run, args.rounds)
    print(summarize(args.out, parts), flush=True)
    return 0 if all(part["status"] == "ok" for part in parts) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
