"""The fuzzer's long mode and its helpers: run new seeds for a time or a number of cases,
classify each failure against the known bugs of issue 14, and minimise failing cases.

Classification: a failing case is re-run without each known-bug feature in turn
(``tests/_fuzz.KNOWN``); the features whose removal makes it pass name the known items. A
case that still fails with every known feature removed is NEW.

Minimising (greedy): drop steps, whole features, schedule operations (and the writes of each
step: parameter and gradient edits, toggles, copies), options, tree nodes and ties one at a
time, keeping a change when the case still fails the same way (same error type, or still a
mismatch).
"""

from __future__ import annotations

import copy
import re
import time
from typing import Any, Callable, Iterator, List, Tuple

from tests._fuzz import ALL, KNOWN, Case, adds, describe, generate, one_line, restrict, walk
from tests._fuzz_run import Failure, check


def kind_of(failure: Failure) -> str:
    """What makes two failures 'the same' while minimising."""
    if failure.summary.startswith("error:"):
        return re.sub(r"[0-9]+", "N", failure.summary.split(":")[1].strip())
    return failure.summary.split(":")[0].split(" (")[0]


def classify(pool: Any, case: Case, failure: Failure) -> Tuple[str, List[str]]:
    """``("NEW", [])`` if the case still fails with every known-bug feature removed; else
    ``("known", items)``: the items whose feature, removed alone, makes the case pass or fail
    differently (the first failure is theirs; all present if none alone changes it)."""
    present = [f for f in KNOWN if f in case.features and _adds_something(case, f)]
    if not present or check(pool, restrict(case, set(case.features) - set(KNOWN))) is not None:
        return "NEW", []
    changed = []
    for feature in present:
        got = check(pool, restrict(case, set(case.features) - {feature}))
        if got is None or got.summary != failure.summary:
            changed.append(KNOWN[feature])
    return "known", sorted(changed) or sorted(KNOWN[f] for f in present)


def _adds_something(case: Case, feature: str) -> bool:
    return adds(case, feature)


def shrink(pool: Any, case: Case, failure: Failure, budget: int = 200, log: Callable[[str], None] = lambda s: None) -> Tuple[Case, Failure]:
    """A smaller case failing like ``case`` (at most ``budget`` re-runs)."""
    wanted = kind_of(failure)
    progress = True
    while progress and budget > 0:
        progress = False
        for candidate in _candidates(case):
            candidate = restrict(candidate, candidate.features)
            if budget <= 0:
                break
            budget -= 1
            got = check(pool, candidate)
            if got is not None and kind_of(got) == wanted:
                case, failure, progress = candidate, got, True
                log(f"  shrunk: {one_line(case)}")
                break
    return case, failure


def _candidates(case: Case) -> Iterator[Case]:
    n = len(case.steps)
    for keep in sorted({1, n // 2, n - 1}):
        if 0 < keep < n:
            yield _truncated(case, keep)
    for feature in sorted(case.features):  # whole features first: each removes much at once
        if adds(case, feature):
            yield restrict(case, set(case.features) - {feature})
    if case.checkpoint is not None:
        yield _with(case, checkpoint=None)
        if case.checkpoint.get("cross"):
            yield _with(case, checkpoint=dict(case.checkpoint, cross=False))
    if case.spec.get("clamp"):
        c = copy.deepcopy(case)
        c.spec["clamp"] = None
        yield c
    for index in range(n):
        yield from _step_candidates(case, index)
    for ws in range(1, case.world_size):
        c = _with(case, world_size=ws)
        if c.checkpoint is not None and c.checkpoint["world_size"] == case.world_size:
            c.checkpoint["world_size"] = ws
        yield c
    simpler = dict(meta=None, backward_prefetch="BACKWARD_PRE", forward_prefetch=False, limit_all_gathers=True,
                   check_every_step=False, set_to_none=True, strategy="FULL_SHARD")
    for field, value in simpler.items():
        if getattr(case, field) != value:
            yield _with(case, **{field: value})
    yield from _wrap_candidates(case)
    yield from _tree_candidates(case)


def _with(case: Case, **changes: Any) -> Case:
    c = copy.deepcopy(case)
    for key, value in changes.items():
        setattr(c, key, value)
    return c


def _truncated(case: Case, keep: int) -> Case:
    c = _with(case, steps=copy.deepcopy(case.steps[:keep]))
    if c.checkpoint is not None and c.checkpoint["step"] >= keep:
        c.checkpoint = None
    return c


def _step_candidates(case: Case, index: int) -> Iterator[Case]:
    step = case.steps[index]
    edits: List[Tuple[str, Any]] = []
    if len(step["micro"]) > 1:
        edits += [("micro", step["micro"][:i] + step["micro"][i + 1 :]) for i in range(len(step["micro"]))]
    for key, empty in (("toggles", []), ("pre", []), ("post", []), ("clip", None), ("no_sync", False), ("zero_grad", True), ("summon", None), ("reload", None),
                       ("ptoggles", []), ("grad_edits", []), ("ema", None), ("copy", None)):
        if step[key] != empty:
            edits.append((key, empty))
    for i in range(len(step["edits"])):
        edits.append(("edits", step["edits"][:i] + step["edits"][i + 1 :]))
        if step["edits"][i]["key"] is not None and step["edits"][i]["how"] != "replace":
            edits.append(("edits", step["edits"][:i] + [dict(step["edits"][i], key=None)] + step["edits"][i + 1 :]))
    if any(step["nosync_edits"]):
        edits.append(("nosync_edits", [None] * len(step["nosync_edits"])))
    for key, value in edits:
        c = copy.deepcopy(case)
        c.steps[index][key] = copy.deepcopy(value)
        yield c
    for m, micro in enumerate(step["micro"]):
        for key, empty in (("skip", []), ("fail", False)):
            if micro[key] != empty:
                c = copy.deepcopy(case)
                c.steps[index]["micro"][m][key] = empty
                yield c


def _wrap_candidates(case: Case) -> Iterator[Case]:
    w = case.wrap
    if w["mode"] != "none":
        c = copy.deepcopy(case)
        c.wrap["mode"] = "none"
        yield c
    for key in ("manual", "classes"):
        if w["mode"] != "none" and len(w[key]) > 1:
            for i in range(len(w[key])):
                c = copy.deepcopy(case)
                del c.wrap[key][i]
                yield c


def _tree_candidates(case: Case) -> Iterator[Case]:
    spec = case.spec
    for key, plain in (("ties", []), ("frozen", []), ("tie_head", False), ("head_bias", False), ("out", "tensor")):
        if spec[key] != plain:
            c = copy.deepcopy(case)
            c.spec[key] = plain
            yield c
    for node in list(walk(spec["body"])):
        for i in range(len(node.get("children", [])) if node["kind"] in ("list", "dict") else 0):
            if len(node["children"]) > 1:
                c = copy.deepcopy(case)
                target = next(n for n in walk(c.spec["body"]) if n["id"] == node["id"])
                del target["children"][i]
                yield c
        if node["kind"] not in ("lin", "list", "dict", "share", "fail"):
            c = copy.deepcopy(case)
            target = next(n for n in walk(c.spec["body"]) if n["id"] == node["id"])
            target.update(kind="lin", opts={k: v for k, v in target["opts"].items() if k in ("unused", "skip_name")})
            target.pop("children", None)
            yield c
        if any(v not in (None, False, "tensor") for k, v in node.get("opts", {}).items() if k != "leaves"):
            c = copy.deepcopy(case)
            target = next(n for n in walk(c.spec["body"]) if n["id"] == node["id"])
            target["opts"] = {k: v for k, v in target["opts"].items() if k == "leaves"}
            yield c


# -- long mode --------------------------------------------------------------------------------


def campaign(pool: Any, seconds: float, cases: int, start: int, features: Any, minimise: bool, log: Callable[[str], None]) -> Tuple[int, List[str]]:
    """Run new seeds from ``start`` until ``seconds`` pass or ``cases`` ran; returns (cases run,
    one summary block per failure)."""
    deadline = time.monotonic() + seconds if seconds else float("inf")
    ran, failures = 0, []
    seed = start
    while time.monotonic() < deadline and (not cases or ran < cases):
        case = generate(seed, features=features)
        failure = check(pool, case)
        ran += 1
        if failure is not None and failure.rounding:
            log(f"seed {seed}: float32 rounding only (passes in float64): {failure.summary}")
        elif failure is not None:
            verdict, items = classify(pool, case, failure)
            label = "NEW" if verdict == "NEW" else f"known: {', '.join(items)}"
            block = f"seed {seed} [{label}] {one_line(case)}\n    {failure.summary}"
            if minimise:
                small, small_failure = shrink(pool, case, failure, log=log)
                block += "\n    minimised:\n" + _indent(describe(small)) + "\n    " + small_failure.summary
            failures.append(block)
            log(block)
        seed += 1
    return ran, failures


def _indent(text: str) -> str:
    return "\n".join("      " + line for line in text.splitlines())


__all__ = ["campaign", "check", "classify", "kind_of", "shrink", "ALL"]
