"""The fault fuzzer's cases: a seeded generator of short runs in which one rank fails at a
random flatshard call site, a readable description, and what a case covers.

A ``FaultCase`` is plain data (picklable, printable), made by ``generate(seed)``. Its model,
wrapping, sharding strategy and optimizer are the differential fuzzer's (``tests/_fuzz.py``)
case of a seed drawn here, restricted to ``MODEL_FEATURES`` (what shapes the model and its
wrapping; none of the features that exercise known bugs); its schedule is 4-8 operations
(training steps, some with ``clip_grad_norm_``; ``RunCheckpoints.save`` and ``resume``; full
state dicts and optimizer state dicts; ``summon_full_params``; ``flatshard.state_dict``'s
getters); its fault is one rank, the operation in which the fault is armed, which of that
operation's collectives on that rank it replaces (``pick``: a fraction of the count a run
without the fault makes there; or none, past the last: ``fires`` false), and what it does
(``kind``, see ``tests/_faults.py``); and what a rank does after its error (``after``:
``stop``, as a script that the exception ends; ``go_on``, one more training step, as a loop
that catches it). Running a case is ``tests/_fault_fuzz_run.py``.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Dict, List, Optional

from tests import _fuzz
from tests._fuzz import Case

# What the model, its wrapping and the optimizer may use (tests/_fuzz.FEATURES).
MODEL_FEATURES = frozenset({
    "reuse", "share", "unused", "tie_head", "tie_deep", "buffers", "frozen", "out_containers", "act_ckpt",
    "eval_bypass", "policy", "manual", "mixed_strategy", "hybrid", "prefetch", "sgd", "offload", "comm_hook",
    "sync_states", "orig", "no_overlap",
})
KINDS = ["error", "oserror", "interrupt", "kill"]
# The operations of a schedule, with the weights they are drawn with.
OPERATIONS = {
    "step": 4,
    "save": 3,
    "state_dict": 1,
    "optim_state_dict": 1,
    "summon": 1,
    "get_state_dict": 1,
    "resume": 1,
}
CLIP_NORMS = [0.05, 1.0]


@dataclasses.dataclass
class FaultCase:
    seed: int
    world_size: int
    model: Case  # the differential fuzzer's case: model, wrapping, strategy, optimizer, batch
    ops: List[Dict[str, Any]]
    keep: Optional[int]  # RunCheckpoints(keep=...)
    fault: Dict[str, Any]  # {"rank", "op", "pick", "fires", "kind"}
    after: str  # what a rank does after its error: "stop" (returns) or "go_on" (one more training step)


def generate(seed: int) -> FaultCase:
    """The fault case of ``seed`` (the same on every rank and in the test process)."""
    rng = random.Random(seed)
    world_size = rng.randint(2, 4)
    orig = rng.random() < 0.5
    model = _fuzz.generate(rng.randrange(10**6), world_size=world_size, features=MODEL_FEATURES)
    model.options["orig"] = orig
    model.checkpoint = None
    ops = [_gen_op(rng) for _ in range(rng.randint(4, 8))]
    keep = rng.choice([None, 1, 2])
    fault = {
        "rank": rng.randrange(world_size),
        "op": rng.randrange(len(ops)),
        "pick": rng.random(),
        "fires": rng.random() < 0.9,
        "kind": rng.choice(KINDS),
    }
    after = rng.choice(["stop", "go_on"])
    return FaultCase(seed, world_size, model, ops, keep, fault, after)


def _gen_op(rng: random.Random) -> Dict[str, Any]:
    kind = rng.choices(list(OPERATIONS), weights=list(OPERATIONS.values()))[0]
    # (every draw is made whatever the kind, so that one op's kind does not shift the next's)
    clip = rng.choice(CLIP_NORMS) if rng.random() < 0.4 else None
    rank0 = rng.random() < 0.5
    write = [rng.randrange(1000), rng.choice([0.5, 1.1])] if rng.random() < 0.5 else None
    what, full = rng.choice(["model", "optim"]), rng.random() < 0.5
    if kind == "step":
        return {"kind": kind, "clip": clip}
    if kind == "state_dict":
        return {"kind": kind, "rank0": rank0}
    if kind == "summon":
        return {"kind": kind, "write": write}
    if kind == "get_state_dict":
        return {"kind": kind, "what": what, "full": full}
    return {"kind": kind}


def collective_number(case: FaultCase, count: int) -> int:
    """Which collective of the faulted operation the fault replaces, given how many it makes on
    the faulty rank in a run without the fault (``count + 1``: none, it does not fire)."""
    if not case.fault["fires"] or count == 0:
        return count + 1
    return 1 + min(count - 1, int(case.fault["pick"] * count))


# -- description --------------------------------------------------------------------------


def describe_op(op: Dict[str, Any]) -> str:
    kind = op["kind"]
    if kind == "step":
        return "training step: zero_grad, forward, backward" + (f", clip_grad_norm_({op['clip']})" if op["clip"] is not None else "") + ", optimizer step"
    if kind == "save":
        return "RunCheckpoints.save(steps so far, state={'op': this op})"
    if kind == "resume":
        return "RunCheckpoints.resume() (the step count continues from the checkpoint's)"
    if kind == "state_dict":
        return f"FULL_STATE_DICT model.state_dict() (rank0_only={op['rank0']}, offload_to_cpu={op['rank0']})"
    if kind == "optim_state_dict":
        return "optim_state_dict(model, optim) (full)"
    if kind == "summon":
        if op["write"] is None:
            return "summon_full_params(writeback=False): the parameters read"
        return f"summon_full_params(): parameter[{op['write'][0]} % count] *= {op['write'][1]}"
    return f"flatshard.state_dict.get_{'model' if op['what'] == 'model' else 'optimizer'}_state_dict(full_state_dict={op['full']})"


def describe(case: FaultCase, collective: Optional[int] = None, count: Optional[int] = None) -> str:
    """A readable account of the case (with the faulted collective's number and the count of
    the operation's collectives, where known)."""
    f = case.fault
    lines = [
        f"fault case seed={case.seed} world_size={case.world_size}: {one_line(case)}",
        f"  re-run alone: FLATSHARD_FUZZ_FAULT_SEED={case.seed} python -m pytest -q -p no:cacheprovider tests/test_fault_fuzz.py -k seed",
        f"  model (the differential fuzzer's case {case.model.seed}, features {', '.join(sorted(MODEL_FEATURES))}):",
        f"    {_model_line(case.model)}",
        f"    optimizer {case.model.optim}, per-rank batch {case.model.per_rank}"
        + "".join(f", {k}" for k, v in sorted(case.model.options.items()) if v),
    ]
    lines += ["      " + line for line in _fuzz._tree_lines(case.model.spec["body"], 0)]
    lines.append(f"  RunCheckpoints(keep={case.keep}); schedule:")
    for index, op in enumerate(case.ops):
        mark = "  <- fault armed" if index == f["op"] else ""
        lines.append(f"    op {index}: {describe_op(op)}{mark}")
    where = f"collective #{collective}" if collective is not None else f"the collective at fraction {f['pick']:.3f}"
    of = f" of its {count}" if count is not None else ""
    fires = where + of if f["fires"] else f"none: armed past the last ({where}{of})"
    lines.append(f"  fault: rank {f['rank']}, op {f['op']}, {fires}, kind {f['kind']}")
    lines.append("  after its error a rank " + ("stops" if case.after == "stop" else "goes on: one more training step"))
    return "\n".join(lines)


def _model_line(m: Case) -> str:
    layout = f" (layout {m.hybrid})" if "HYBRID" in m.strategy else ""
    return (
        f"{m.strategy}{layout}, {_fuzz.describe_wrap(m)}, backward_prefetch={m.backward_prefetch}, "
        f"forward_prefetch={m.forward_prefetch}, limit_all_gathers={m.limit_all_gathers}"
    )


def one_line(case: FaultCase) -> str:
    """A one-line summary, for the long mode's report."""
    f = case.fault
    mode = "orig" if case.model.options["orig"] else "flat"
    ops = ",".join(op["kind"] + ("+clip" if op.get("clip") is not None else "") for op in case.ops)
    fires = f"{f['kind']}" if f["fires"] else f"{f['kind']} (not firing)"
    return (
        f"ws{case.world_size} {case.model.strategy} {mode} {_fuzz.describe_wrap(case.model)}; ops {ops}; "
        f"fault {fires} on rank {f['rank']} in op {f['op']} ({case.ops[f['op']]['kind']}), then {case.after}"
    )


# -- coverage -----------------------------------------------------------------------------


def faulted_kind(case: FaultCase) -> str:
    op = case.ops[case.fault["op"]]
    return "clip" if op["kind"] == "step" and op["clip"] is not None else op["kind"]


def coverage(case: FaultCase) -> frozenset:
    """What ``case`` exercises (``tests/test_fault_fuzz.py`` checks the fixed seeds cover
    ``everything()``)."""
    items = {f"world_size:{case.world_size}", "mode:orig" if case.model.options["orig"] else "mode:flat", f"after:{case.after}"}
    if case.fault["fires"]:
        items |= {f"kind:{case.fault['kind']}", f"faulted:{faulted_kind(case)}"}
    else:
        items.add("not_firing")
    before = case.ops[: case.fault["op"]]
    if any(op["kind"] == "save" for op in before):
        items.add("saved_before_fault")
    return frozenset(items)


def everything() -> frozenset:
    faulted = set(OPERATIONS) | {"clip"}
    items = {f"world_size:{ws}" for ws in (2, 3, 4)} | {"mode:orig", "mode:flat", "not_firing", "saved_before_fault", "after:stop", "after:go_on"}
    return frozenset(items | {f"kind:{k}" for k in KINDS} | {f"faulted:{k}" for k in faulted})
