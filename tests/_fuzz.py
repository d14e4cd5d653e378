"""The differential fuzzer's cases: a seeded generator of random models, wrappings and training
schedules, feature masks, and a readable description of a case.

A ``Case`` is plain data (picklable, printable). ``generate(seed)`` draws the same random
numbers whatever features are enabled; ``restrict(case, features)`` then removes what the
disabled features added, so a case with a feature switched off is the same case minus that
feature (``FLATSHARD_FUZZ_FEATURES=-aux`` re-runs a seed without its side-channel losses).
Running a case and comparing it with single-process training is ``tests/_fuzz_run.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from typing import Any, Dict, Iterable, List, Optional, Tuple

# Each feature, and what it adds to a case. ``KNOWN`` maps the features that exercise known
# bugs (issue 14's items; NEW-x and W-x: found by this fuzzer, W-x with issue 28's write
# features) to them, so that "-known" hunts for anything else. W-10 (use_orig_params=True,
# AdamW step counts that differ within a FlatParameter -- a parameter skipped by a step: .grad
# None, or replaced after the backward -- merged silently when the checkpoint loaded into a
# use_orig_params=False model) is refused since issue 43, as FSDP1 refuses it: such a case
# raises that refusal on every rank.
#
# Found and fixed while issue 28 was worked on: W-1 (use_orig_params=False, unsharded
# FlatParameter: a rebound .data was missed), W-2 (a parameter replaced between no_sync
# micro-batches raised), W-4 (use_orig_params=True with parameters frozen at wrapping: sharded
# checkpoints did not load into a fresh model), W-5 (a rebound .grad of a frozen parameter was
# dropped), W-6 (no_sync after a step without zero_grad raised), W-7 (rebound gradients kept
# into a forward under inference_mode: the next backward raised), W-8 (a parameter frozen with
# a kept .grad lost it at zero_grad(set_to_none=False) between no_sync micro-batches), W-9
# (after zero_grad(set_to_none=False), in-place changes of the local gradients between no_sync
# micro-batches raised). W-3 (in-place changes of the local gradients inside no_sync while
# they also hold an earlier step's gradient: missed it) is now refused with an error by design:
# not generated.
FEATURES: Dict[str, str] = {
    "reuse": "a module called twice in one forward",
    "share": "a module registered in two containers",
    "unused": "registered modules never called, parameters never used",
    "tie_head": "embedding weight tied to the output head",
    "tie_deep": "a Linear weight shared by two blocks at different depths",
    "buffers": "float / int / non-persistent buffers, a forward counter",
    "frozen": "modules frozen at construction",
    "aux": "side-channel loss terms stored by a module after its output (item 1)",
    "out_containers": "outputs in tuples, dicts, dataclasses",
    "act_ckpt": "non-reentrant activation checkpointing",
    "eval_bypass": "blocks that behave differently in eval mode",
    "policy": "auto-wrap policies",
    "manual": "manual nesting",
    "mixed_strategy": "different sharding strategies per manually wrapped unit",
    "hybrid": "HYBRID_SHARD / _HYBRID_SHARD_ZERO2",
    "hybrid1": "hybrid sharding with shard groups of size 1 (item 3)",
    "prefetch": "backward_prefetch / forward_prefetch / limit_all_gathers other than defaults",
    "meta": "meta-device construction (deferred initialisation) (item 5)",
    "nosync": "no_sync micro-batches",
    "nosync_absent": "a unit used under no_sync but absent from the synced backward (item 2)",
    "skip": "branches skipped in some forwards/backwards",
    "eval": "eval / no_grad / inference_mode forwards between steps",
    "metric": "grad-enabled forwards without backward (item 7)",
    "toggle": "requires_grad toggled on whole units between steps (item 4)",
    "fail": "a backward that raises, caught by the loop (item 6)",
    "clip": "clip_grad_norm_",
    "ckpt": "a checkpoint saved and loaded mid-run",
    "resize": "resuming the checkpoint at another world size",
    "osd_rank0": "optim_state_dict_to_load with rank0_only full dicts, {} on other ranks (item 8)",
    "sgd": "SGD with momentum (else AdamW)",
    "keep_grads": "zero_grad(set_to_none=False)",
    "every_step": "full parameters compared after every step (else at the end and at checkpoints)",
    "summon": "parameters changed inside summon_full_params (writeback) between steps",
    "reload": "state dicts saved and loaded back into the same model and optimizer between steps",
    "sync_states": "ranks start from different values, sync_module_states=True",
    "offload": "CPUOffload(offload_params=True)",
    "comm_hook": "the default communication hook registered explicitly",
    "fresh_osd": "a state-dict round trip before the first optimizer step (NEW-A)",
    "accumulate": "steps without zero_grad (gradients accumulate onto the previous step's)",
    "orig": "use_orig_params=True (the optimizer steps the original parameters)",
    "param_edit": "parameters changed in place or by rebinding .data (all, or with orig a subset by name) between steps",
    "vec_params": "vector_to_parameters(parameters_to_vector(params) * a + b, params) (all, or with orig a subset by name)",
    "edit_mid_step": "those parameter edits (param_edit, vec_params, param_replace) also between backward and step, and between micro-batches",
    "param_replace": "(orig) a new nn.Parameter registered on the modules of parameters chosen by name, the optimizer moved to it",
    "grad_edit": "gradients changed between backward and step: .grad rebound, .grad.data rebound, in place (scale and offset), set to None (orig, by name)",
    "grad_rebind": "those gradient edits also by rebinding .grad or .grad.data (else in place, or to None)",
    "ema": "an AveragedModel EMA (deep copy) made mid-run, updated after each step, evaluated under no_grad",
    "deepcopy": "a deep copy of the model, changed and trained for a step by its own optimizer",
    "toggle_param": "(orig) requires_grad toggled on single parameters by name between steps",
    "cross_mode": "the checkpoint loaded into a fresh model wrapped in the other use_orig_params mode (W-10)",
    "nosync_grad": "between no_sync micro-batches: the local gradients scaled in place (orig) or zero_grad()",
    "nosync_grad_kept": "those no_sync gradient edits also in steps without zero_grad (orig: only zero_grad(set_to_none=True), W-3)",
    "clamp": "Linear weights clamped in place by the module inside no_grad / inference_mode forwards",
    "no_overlap": "set_communication_overlap(False) in some steps (else every step overlaps, the default)",
}
KNOWN = {
    "aux": "1", "nosync_absent": "2", "hybrid1": "3", "toggle": "4", "meta": "5", "fail": "6", "metric": "7", "osd_rank0": "8",
    "fresh_osd": "NEW-A", "cross_mode": "W-10",
}
ALL = frozenset(FEATURES)

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]
BLOCK_KINDS = ["mlp", "aux", "scale", "perm", "count", "res", "twice", "list", "dict"]
LEAF_KINDS = ["lin", "norm", "seq", "mlp", "aux", "scale", "perm", "count"]
POLICY_CLASS_NAMES = ["Lin", "Norm", "Emb", "MLP", "Residual", "Twice", "AuxBlock", "ScaleBlock", "PermBlock", "CountBlock", "Stack", "Sequential"]


@dataclasses.dataclass
class Case:
    seed: int
    world_size: int
    features: Tuple[str, ...]
    spec: Dict[str, Any]  # the model: see tests/_fuzz_model.build_model
    wrap: Dict[str, Any]  # mode none | policy | manual, and its parameters
    strategy: str
    hybrid: str  # layout for hybrid strategies: grid (2x2 at 4 ranks) | rep (shard groups of 1) | shard (one shard group)
    backward_prefetch: Optional[str]
    forward_prefetch: bool
    limit_all_gathers: bool
    meta: Optional[str]  # None | "reset" (the wrapper's default) | "init_fn" (a param_init_fn)
    optim: Dict[str, Any]
    set_to_none: bool
    per_rank: int
    steps: List[Dict[str, Any]]
    checkpoint: Optional[Dict[str, Any]]  # {"step", "mode", "world_size", "new_task"}
    check_every_step: bool
    options: Dict[str, bool]  # sync_states, offload, comm_hook, orig


def parse_features(text: Optional[str]) -> frozenset:
    """``None``/empty: all; ``"a,b"``: only those; ``"-a,-known"``: all but those (``known``:
    every feature exercising a known bug of issue 14)."""
    if not text:
        return ALL
    names = [t.strip() for t in text.split(",") if t.strip()]
    removing = all(n.startswith("-") for n in names)
    chosen = set(ALL) if removing else set()
    for name in names:
        bare = name.lstrip("-+")
        group = set(KNOWN) if bare == "known" else {bare}
        unknown = group - ALL
        if unknown:
            raise ValueError(f"unknown fuzz feature(s) {sorted(unknown)}; known: {sorted(ALL)}")
        chosen = chosen - group if name.startswith("-") else chosen | group
    return frozenset(chosen)


# -- generation ---------------------------------------------------------------------------


def generate(seed: int, world_size: Optional[int] = None, features: Iterable[str] = ALL) -> Case:
    """The case of ``seed`` (the same on every rank), restricted to ``features``."""
    rng = random.Random(seed)
    ws = rng.randint(1, 4)
    ws = world_size if world_size is not None else ws
    spec = _gen_model(rng)
    wrap = _gen_wrap(rng, spec)
    strategy = rng.choice(STRATEGIES)
    hybrid = rng.choice(["grid", "rep", "shard"])
    prefetch = rng.choice(["BACKWARD_PRE", "BACKWARD_POST", None])
    fwd, limit = rng.random() < 0.4, rng.random() < 0.7
    meta = rng.choice([None, None, "reset", "init_fn"])
    optim = {"kind": rng.choice(["adamw", "adamw", "sgd"]), "weight_decay": rng.choice([0.0, 0.01, 0.1])}
    set_to_none = rng.random() < 0.7
    per_rank = rng.randint(1, 2)
    steps = _gen_schedule(rng, spec)
    checkpoint = None
    if rng.random() < 0.35 and len(steps) > 1:
        checkpoint = {
            "step": rng.randint(1, len(steps) - 1),
            "mode": rng.choice(["full", "full_osd", "sharded", "sharded", "full_osd_rank0"]),
            "world_size": rng.randint(1, 4),
            "new_task": rng.random() < 0.5,
        }
    every = rng.random() < 0.4
    for step in steps:
        step["zero_grad"] = rng.random() < 0.85
    extras = {"sync_states": rng.random() < 0.25, "offload": rng.random() < 0.2, "comm_hook": rng.random() < 0.2}
    extras["orig"] = rng.random() < 0.5  # (drawn after the above: the other draws of a seed stay as they were)
    _gen_writes(rng, spec, steps, checkpoint)  # (drawn after orig, for the same reason)
    for step in steps:  # (drawn last, for the same reason)
        step["overlap"] = rng.random() < 0.7
    case = Case(seed, ws, (), spec, wrap, strategy, hybrid, prefetch, fwd, limit, meta, optim, set_to_none, per_rank, steps, checkpoint, every, extras)
    return restrict(case, features)


def _gen_model(rng: random.Random) -> Dict[str, Any]:
    ids = iter(range(1, 10_000))
    depth = rng.randint(1, 3)
    body = _gen_container(rng, ids, depth, 1)
    nodes = list(walk(body))
    lins = [n for n in nodes if n["kind"] == "lin"]
    ties = []
    if len(lins) >= 2 and rng.random() < 0.6:
        a, b = rng.sample(lins, 2)
        ties.append([min(a["id"], b["id"]), max(a["id"], b["id"])])
    _add_share(rng, body, ids)
    with_params = [n["id"] for n in nodes if n["kind"] not in ("fail", "list", "dict")]
    frozen = sorted(rng.sample(with_params, min(len(with_params), rng.choice([0, 1, 1, 2]))))
    if rng.random() < 0.4:  # a fail point somewhere in a container
        stacks = [n for n in walk(body) if n["kind"] in ("list", "dict")]
        stack = rng.choice(stacks)
        stack["children"].insert(rng.randint(0, len(stack["children"])), {"id": next(ids), "kind": "fail", "opts": {}})
    return {
        "dim": rng.choice([4, 6, 8, 12, 16]),
        "seq": rng.randint(3, 4),
        "body": body,
        "tie_head": rng.random() < 0.5,
        "head_bias": rng.random() < 0.5,
        "out": rng.choice(["tensor", "tensor", "tuple", "dict", "data"]),
        "ties": ties,
        "frozen": frozen,
    }


def _gen_container(rng: random.Random, ids: Any, depth: int, level: int) -> Dict[str, Any]:
    node: Dict[str, Any] = {"id": next(ids), "kind": rng.choice(["list", "dict"]), "opts": {}, "children": []}
    for _ in range(rng.randint(2, 4)):
        child = _gen_node(rng, ids, depth, level + 1)
        child["opts"].update(_member_opts(rng, child))
        node["children"].append(child)
    return node


def _gen_node(rng: random.Random, ids: Any, depth: int, level: int) -> Dict[str, Any]:
    kinds = LEAF_KINDS + ["res", "twice"] + (["list", "dict"] if level <= depth else [])
    kind = rng.choice(kinds)
    if kind in ("list", "dict"):
        node = _gen_container(rng, ids, depth, level)
    elif kind in ("res", "twice"):
        node = {"id": next(ids), "kind": kind, "opts": {}}
        inner = _gen_node(rng, ids, depth, level + 1) if level < 3 else {"id": next(ids), "kind": rng.choice(["lin", "mlp", "norm"]), "opts": {}}
        node["children"] = [inner]
        ckpt_ok = all(n["kind"] in ("lin", "norm", "mlp", "seq", "scale") for n in walk(inner))
        node["opts"]["act_ckpt"] = ckpt_ok and rng.random() < 0.3
    else:
        node = {"id": next(ids), "kind": kind, "opts": {}}
        if kind == "seq":
            node["opts"]["leaves"] = [rng.choice(["lin", "norm", "tanh"]) for _ in range(rng.randint(1, 3))]
        if kind in ("lin", "mlp"):
            node["opts"]["bias"] = rng.random() < 0.7
        if kind == "mlp":
            node["opts"]["act_ckpt"] = rng.random() < 0.25
        if kind == "scale":
            node["opts"]["spare"] = rng.random() < 0.5
    if kind in BLOCK_KINDS:
        node["opts"]["out"] = rng.choice(["tensor", "tensor", "tuple", "dict", "data"])
        node["opts"]["wrap_tag"] = rng.random() < 0.4
    return node


def _member_opts(rng: random.Random, child: Dict[str, Any]) -> Dict[str, Any]:
    """Options a container member may have: skippable, registered-only, bypassed in eval."""
    skip, unused, bypass = rng.random() < 0.35, rng.random() < 0.12, rng.random() < 0.2
    if child["kind"] not in BLOCK_KINDS:
        return {"unused": unused} if unused else {}
    return {"skip_name": f"b{child['id']}" if skip else None, "unused": unused, "eval_bypass": bypass}


def _add_share(rng: random.Random, body: Dict[str, Any], ids: Any) -> None:
    """Register an earlier leaf module in a later container (called there, or not)."""
    if rng.random() >= 0.35:
        return
    leaves = [n for n in walk(body) if n["kind"] in ("lin", "norm", "mlp", "scale", "aux")]
    stacks = [n for n in walk(body) if n["kind"] in ("list", "dict")]
    if not leaves:
        return
    ref = rng.choice(leaves)
    later = [s for s in stacks if s["id"] > ref["id"]]
    if not later:
        return
    stack = rng.choice(later)
    share = {"id": next(ids), "kind": "share", "ref": ref["id"], "opts": {"unused": rng.random() < 0.3}}
    stack["children"].insert(rng.randint(0, len(stack["children"])), share)


def _gen_wrap(rng: random.Random, spec: Dict[str, Any]) -> Dict[str, Any]:
    mode = rng.choice(["none", "policy", "policy", "policy", "manual", "manual"])
    policy = rng.choice(["module", "transformer", "size", "lambda", "always"])
    classes = sorted(rng.sample(POLICY_CLASS_NAMES, rng.randint(1, 3)))
    min_params = rng.choice([8, 20, 40, 100, 200])
    nodes = [n for n in walk(spec["body"]) if n["kind"] not in ("share",)]
    manual = sorted(n["id"] for n in nodes if rng.random() < 0.4)
    strategies = {str(i): rng.choice(STRATEGIES[:3]) for i in manual if rng.random() < 0.4}
    return {"mode": mode, "policy": policy, "classes": classes, "min_params": min_params, "manual": manual, "strategies": strategies}


def _gen_schedule(rng: random.Random, spec: Dict[str, Any]) -> List[Dict[str, Any]]:
    skippable = sorted({n["opts"]["skip_name"] for n in walk(spec["body"]) if n.get("opts", {}).get("skip_name")})
    steps = []
    fail_step = rng.randrange(6) if rng.random() < 0.6 else -1
    for index in range(rng.randint(3, 6)):
        n_micro = rng.choice([1, 1, 2, 2, 3])
        micro = [{"skip": sorted(s for s in skippable if rng.random() < 0.4), "fail": False} for _ in range(n_micro)]
        if index == fail_step:
            micro[rng.randrange(n_micro)]["fail"] = True
        toggles = []
        if rng.random() < 0.3:
            toggles.append([rng.randrange(1000), rng.random() < 0.5, rng.choice(["wrapper", "module", "params"])])
        extras = ["eval", "nograd", "inference", "metric", "evalgrad"]
        summon = [rng.randrange(1000), rng.choice([0.5, 0.9, 1.1])] if rng.random() < 0.2 else None
        reload = rng.choice(["full", "sharded"]) if rng.random() < 0.2 else None
        steps.append({
            "summon": summon,
            "reload": reload,
            "toggles": toggles,
            "pre": [rng.choice(extras)] if rng.random() < 0.3 else [],
            "micro": micro,
            "no_sync": n_micro > 1 and rng.random() < 0.75,
            "post": [rng.choice(extras)] if rng.random() < 0.3 else [],
            "clip": rng.choice([0.05, 1.0]) if rng.random() < 0.2 else None,
        })
    return steps


EDIT_HOWS = ["data", "data", "inplace", "vec", "replace"]
EDIT_AT = ["start", "start", "backward", "micro"]
GRAD_HOWS = ["rebind", "data", "inplace", "none"]


def _gen_writes(rng: random.Random, spec: Dict[str, Any], steps: List[Dict[str, Any]], checkpoint: Optional[Dict[str, Any]]) -> None:
    """What the loop writes to parameters, gradients and copies of the model (features
    param_edit ... clamp). Every draw is made whatever the case holds, so the stream of a seed
    does not depend on earlier choices of this block either."""
    for step in steps:
        edits = []
        for _ in range(2):
            edit = {
                "how": rng.choice(EDIT_HOWS),
                "a": rng.choice([0.8, 0.9, 1.1]),
                "b": rng.choice([0.0, 0.01, -0.01]),
                "key": rng.randrange(1000),
                "at": rng.choice(EDIT_AT),
            }
            named = rng.random() < 0.5
            if rng.random() < 0.3:
                if not named and edit["how"] != "replace":
                    edit["key"] = None
                edits.append(edit)
        step["edits"] = edits
        grad_edit = {"how": rng.choice(GRAD_HOWS), "s": rng.choice([0.5, 2.0, -1.0]), "o": rng.choice([0.0, 0.0, 0.01]), "key": rng.randrange(1000)}
        named = rng.random() < 0.5
        if not named and grad_edit["how"] != "none":
            grad_edit["key"] = None
        step["grad_edits"] = [grad_edit] if rng.random() < 0.35 else []
        ptoggle = {"key": rng.randrange(1000), "flag": rng.random() < 0.5}
        step["ptoggles"] = [ptoggle] if rng.random() < 0.25 else []
        nosync = []
        for _ in range(len(step["micro"]) - 1):
            op = {"how": "zero"} if rng.random() < 0.3 else {"how": "scale", "s": rng.choice([0.5, 2.0, -1.0])}
            nosync.append(op if rng.random() < 0.5 else None)
        step["nosync_edits"] = nosync
        ema = {"decay": rng.choice([0.5, 0.8, 0.9]), "eval": rng.random() < 0.5}
        step["ema"] = ema if rng.random() < 0.15 else None
        clone = {"factor": rng.choice([0.9, 1.1]), "zero_grad": rng.random() < 0.5}
        step["copy"] = clone if rng.random() < 0.12 else None
    cross = rng.random() < 0.4
    if checkpoint is not None:
        checkpoint["cross"] = cross
    lins = [n["id"] for n in walk(spec["body"]) if n["kind"] == "lin"]
    clamped = [i for i in lins if rng.random() < 0.4]
    head = rng.random() < 0.3
    bound = rng.choice([0.2, 0.4])
    spec["clamp"] = {"nodes": clamped, "head": head, "bound": bound} if rng.random() < 0.35 and (clamped or head) else None


def orig_at(case: "Case", step: int) -> bool:
    """Whether the sharded model of ``step`` uses ``use_orig_params`` (a ``cross_mode``
    checkpoint switches the mode from its step on)."""
    ck = case.checkpoint
    crossed = ck is not None and bool(ck.get("cross")) and step >= ck["step"]
    return bool(case.options.get("orig")) != crossed


def pick_names(names: List[str], key: int) -> List[str]:
    """A subset of ``names`` chosen by ``key`` (never empty if ``names`` is not): the same on
    both sides when they name their parameters alike."""
    import zlib

    chosen = [n for n in names if zlib.crc32(f"{key}:{n}".encode()) % 3 == 0]
    return chosen or names[key % len(names) :][:1]


def walk(node: Dict[str, Any]) -> Iterable[Dict[str, Any]]:
    """The nodes of a spec subtree in pre-order (build order)."""
    yield node
    for child in node.get("children", []):
        yield from walk(child)


# -- feature masks ------------------------------------------------------------------------


_NO_BUFFERS = {"perm": "lin", "count": "norm", "scale": "norm"}


def restrict(case: Case, features: Iterable[str]) -> Case:
    """``case`` without what the features not in ``features`` add."""
    on = frozenset(features)
    c = copy.deepcopy(case)
    _fill_defaults(c)
    c.features = tuple(sorted(on))
    spec = c.spec
    _restrict_tree(spec["body"], on)
    if "share" not in on:
        _drop_nodes(spec["body"], lambda n: n["kind"] == "share")
    if "fail" not in on:
        _drop_nodes(spec["body"], lambda n: n["kind"] == "fail")
    live = {n["id"] for n in walk(spec["body"])}
    _drop_nodes(spec["body"], lambda n: n["kind"] == "share" and n["ref"] not in live)
    spec["ties"] = [t for t in spec["ties"] if "tie_deep" in on and set(t) <= live and _kind(spec, t[0]) == _kind(spec, t[1]) == "lin"]
    spec["tie_head"] = spec["tie_head"] and "tie_head" in on
    spec["frozen"] = [i for i in spec["frozen"] if i in live] if "frozen" in on else []
    if "out_containers" not in on:
        spec["out"] = "tensor"
    _restrict_wrap(c, on)
    _restrict_run(c, on)
    for index, step in enumerate(c.steps):
        _restrict_step(step, on, spec)
        if index == 0 and "fresh_osd" not in on:
            step["reload"] = None
    _restrict_writes(c, on)
    if "no_overlap" not in on:
        for step in c.steps:
            step["overlap"] = True
    return c


def _fill_defaults(c: Case) -> None:
    """Cases saved before the write features existed (JSON) have none of them."""
    for step in c.steps:
        for key, empty in (("edits", []), ("grad_edits", []), ("ptoggles", []), ("nosync_edits", []), ("ema", None), ("copy", None), ("overlap", True)):
            step.setdefault(key, empty)
    c.spec.setdefault("clamp", None)
    if c.checkpoint is not None:
        c.checkpoint.setdefault("cross", False)


_EDIT_FEATURE = {"data": "param_edit", "inplace": "param_edit", "vec": "vec_params", "replace": "param_replace"}


def _restrict_writes(c: Case, on: frozenset) -> None:
    lins = {n["id"] for n in walk(c.spec["body"]) if n["kind"] == "lin"}
    clamp = c.spec["clamp"]
    if clamp is not None:
        clamp["nodes"] = [i for i in clamp["nodes"] if i in lins]
        if "clamp" not in on or not (clamp["nodes"] or clamp["head"]):
            c.spec["clamp"] = None
    for step in c.steps:
        step["edits"] = [e for e in step["edits"] if _EDIT_FEATURE[e["how"]] in on and (e["at"] == "start" or "edit_mid_step" in on)]
        if "grad_edit" not in on:
            step["grad_edits"] = []
        if "grad_rebind" not in on:
            step["grad_edits"] = [g for g in step["grad_edits"] if g["how"] not in ("rebind", "data")]
        if "toggle_param" not in on:
            step["ptoggles"] = []
        n = len(step["micro"])
        allowed = step["no_sync"] and "nosync_grad" in on and (step["zero_grad"] or "nosync_grad_kept" in on)
        step["nosync_edits"] = (step["nosync_edits"] + [None] * n)[: n - 1] if allowed else [None] * (n - 1)
        if "ema" not in on:
            step["ema"] = None
        if "deepcopy" not in on:
            step["copy"] = None
    ck = c.checkpoint
    if ck is not None:
        # a fresh model in the other mode cannot take requires_grad changes made per unit or per
        # parameter in the first one (a unit's parameters differ between the modes when a tie
        # crosses units; single parameters exist only with orig): only untoggled models cross
        before = [s for s in c.steps[: ck["step"]]]
        toggled = any(s["toggles"] or (s["ptoggles"] and c.options.get("orig")) for s in before)
        ck["cross"] = bool(ck["cross"]) and "cross_mode" in on and not toggled
    for index, step in enumerate(c.steps):
        if orig_at(c, index):
            if not step["zero_grad"]:
                # the library refuses (raises) in-place changes of local gradients inside
                # no_sync while they also hold an earlier step's gradient
                step["nosync_edits"] = [op if op is None or (op["how"] == "zero" and c.set_to_none) else None for op in step["nosync_edits"]]
            continue  # what works on single parameters by name needs the original parameters
        step["edits"] = [e for e in step["edits"] if e["key"] is None and e["how"] != "replace"]
        step["grad_edits"] = [g for g in step["grad_edits"] if g["key"] is None and g["how"] != "none"]
        step["ptoggles"] = []
        step["nosync_edits"] = [None if op is not None and op["how"] == "scale" else op for op in step["nosync_edits"]]


def _kind(spec: Dict[str, Any], node_id: int) -> Optional[str]:
    return next((n["kind"] for n in walk(spec["body"]) if n["id"] == node_id), None)


def _restrict_tree(node: Dict[str, Any], on: frozenset) -> None:
    opts = node.setdefault("opts", {})
    if node["kind"] == "twice" and "reuse" not in on:
        node["kind"] = "res"
    if node["kind"] == "aux" and "aux" not in on:
        node["kind"] = "mlp"
    if node["kind"] in _NO_BUFFERS and "buffers" not in on:
        node["kind"] = _NO_BUFFERS[node["kind"]]
        for key in ("out", "wrap_tag", "skip_name", "eval_bypass", "act_ckpt"):
            opts.pop(key, None)
    if "unused" not in on:
        opts.pop("unused", None)
        opts.pop("spare", None)
    if "out_containers" not in on and "out" in opts:
        opts["out"] = "tensor"
    if "act_ckpt" not in on:
        opts.pop("act_ckpt", None)
    if "eval_bypass" not in on:
        opts.pop("eval_bypass", None)
    if "skip" not in on:
        opts.pop("skip_name", None)
    for child in node.get("children", []):
        _restrict_tree(child, on)


def _drop_nodes(node: Dict[str, Any], doomed: Any) -> None:
    if "children" in node and node["kind"] in ("list", "dict"):
        node["children"] = [c for c in node["children"] if not doomed(c)]
    for child in node.get("children", []):
        _drop_nodes(child, doomed)


def _restrict_wrap(c: Case, on: frozenset) -> None:
    w = c.wrap
    if (w["mode"] == "policy" and "policy" not in on) or (w["mode"] == "manual" and "manual" not in on):
        w["mode"] = "none"
    live = {n["id"] for n in walk(c.spec["body"])}
    w["manual"] = [i for i in w["manual"] if i in live]
    if "mixed_strategy" not in on or c.strategy.startswith(("HYBRID", "_HYBRID")) or w["mode"] != "manual":
        w["strategies"] = {}
    w["strategies"] = {k: v for k, v in w["strategies"].items() if int(k) in w["manual"]}


def _restrict_run(c: Case, on: frozenset) -> None:
    hybrid = c.strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
    if hybrid and "hybrid" not in on:
        c.strategy = "FULL_SHARD" if c.strategy == "HYBRID_SHARD" else "SHARD_GRAD_OP"
    if c.hybrid == "rep" and "hybrid1" not in on:
        c.hybrid = "grid"
    if "prefetch" not in on:
        c.backward_prefetch, c.forward_prefetch, c.limit_all_gathers = "BACKWARD_PRE", False, True
    if "meta" not in on:
        c.meta = None
    if "sgd" not in on:
        c.optim["kind"] = "adamw"
    if "keep_grads" not in on:
        c.set_to_none = True
    if "every_step" not in on:
        c.check_every_step = False
    for name in c.options:
        c.options[name] = c.options[name] and name in on
    if c.meta or "HYBRID" in c.strategy:
        c.options["sync_states"] = c.options["sync_states"] and not c.meta
        c.options["comm_hook"] = c.options["comm_hook"] and "HYBRID" not in c.strategy
    if c.wrap["strategies"]:
        c.options["comm_hook"] = False
    ck = c.checkpoint
    if ck is not None:
        if "ckpt" not in on:
            c.checkpoint = None
        else:
            if "resize" not in on:
                ck["world_size"] = c.world_size
            if ck["mode"] == "full_osd_rank0" and "osd_rank0" not in on:
                ck["mode"] = "full_osd"
            if ck["world_size"] != c.world_size:
                ck["new_task"] = True
    fail_used = any(m["fail"] for s in c.steps for m in s["micro"])
    if fail_used and not any(n["kind"] == "fail" for n in walk(c.spec["body"])):
        for s in c.steps:
            for m in s["micro"]:
                m["fail"] = False


def _restrict_step(step: Dict[str, Any], on: frozenset, spec: Dict[str, Any]) -> None:
    names = {n["opts"].get("skip_name") for n in walk(spec["body"])} - {None}
    for m in step["micro"]:
        m["skip"] = [s for s in m["skip"] if s in names] if "skip" in on else []
        m["fail"] = m["fail"] and "fail" in on
    if "nosync" not in on:
        step["no_sync"] = False
    if step["no_sync"] and "nosync_absent" not in on:
        # every branch used in a no_sync micro-batch runs in the synced one too
        common = set(step["micro"][0]["skip"])
        for m in step["micro"][1:]:
            common &= set(m["skip"])
        step["micro"][-1]["skip"] = sorted(common)
    if "toggle" not in on:
        step["toggles"] = []
    keep = ({"eval", "nograd", "inference"} if "eval" in on else set()) | ({"metric", "evalgrad"} if "metric" in on else set())
    if "summon" not in on:
        step["summon"] = None
    if "reload" not in on:
        step["reload"] = None
    step["pre"] = [op for op in step["pre"] if op in keep]
    step["post"] = [op for op in step["post"] if op in keep]
    if "clip" not in on:
        step["clip"] = None
    if "accumulate" not in on:
        step["zero_grad"] = True


# -- coverage -----------------------------------------------------------------------------


def adds(case: Case, feature: str) -> bool:
    """Whether ``feature`` changes ``case`` (the case without it differs)."""
    without = restrict(case, set(case.features) - {feature})
    return dataclasses.replace(without, features=()) != dataclasses.replace(case, features=())


def coverage(case: Case) -> frozenset:
    """What ``case`` exercises: ``feature:<name>`` for each feature it uses, and the strategy,
    policy, checkpoint form and kinds of writes, named alike (``tests/test_fuzz.py`` checks
    that the fixed seeds exercise everything in ``everything()``)."""
    items = {f"feature:{f}" for f in case.features if adds(case, f)}
    items.add(f"strategy:{case.strategy}")
    items.add(f"wrap:{case.wrap['mode']}" + (f":{case.wrap['policy']}" if case.wrap["mode"] == "policy" else ""))
    items.add("mode:orig" if case.options.get("orig") else "mode:flat")
    ck = case.checkpoint
    if ck is not None:
        items.add(f"ckpt:{ck['mode']}")
        if ck.get("cross"):
            items.add("cross:to_flat" if case.options.get("orig") else "cross:to_orig")
    for index, step in enumerate(case.steps):
        mode = "orig" if orig_at(case, index) else "flat"
        for e in step["edits"]:
            items.add(f"edit:{e['how']}:{mode}" + (":named" if e["key"] is not None else ""))
            items.add(f"edit_at:{e['at']}")
        for g in step["grad_edits"]:
            items.add(f"grad:{g['how']}:{mode}" + (":named" if g["key"] is not None else ""))
        for op in step["nosync_edits"]:
            if op is not None:
                items.add(f"nosync:{op['how']}:{mode}")
        if step["ema"]:
            items.add(f"ema:{mode}" + (":eval" if step["ema"]["eval"] else ""))
        if step["copy"]:
            items.add(f"copy:{mode}")
    return frozenset(items)


def everything() -> frozenset:
    """Every item ``coverage`` can report for a case (each should be in some fixed case)."""
    items = {f"feature:{f}" for f in FEATURES}
    items |= {f"strategy:{s}" for s in STRATEGIES} | {"mode:orig", "mode:flat", "wrap:none", "wrap:manual"}
    items |= {f"wrap:policy:{p}" for p in ["module", "transformer", "size", "lambda", "always"]}
    items |= {f"ckpt:{m}" for m in ["full", "full_osd", "sharded", "full_osd_rank0"]} | {"cross:to_flat", "cross:to_orig"}
    for mode in ("orig", "flat"):
        items |= {f"edit:{how}:{mode}" for how in ("data", "inplace", "vec")} | {f"grad:{how}:{mode}" for how in ("rebind", "data", "inplace")}
        items |= {f"nosync:zero:{mode}", f"ema:{mode}", f"ema:{mode}:eval", f"copy:{mode}"}
    items |= {f"edit:{how}:orig:named" for how in ("data", "inplace", "vec", "replace")} | {f"edit_at:{at}" for at in ("start", "backward", "micro")}
    items |= {f"grad:{how}:orig:named" for how in GRAD_HOWS} | {"nosync:scale:orig"}
    return frozenset(items)


# -- description --------------------------------------------------------------------------


def describe(case: Case) -> str:
    """A readable account of the case: how to re-run it, the model, the wrapping, the schedule."""
    off = sorted(ALL - set(case.features))
    env = f"FLATSHARD_FUZZ_SEED={case.seed} FLATSHARD_FUZZ_WORLD_SIZE={case.world_size}"
    if off:
        env += f" FLATSHARD_FUZZ_FEATURES={','.join('-' + f for f in off)}"
    s = case.spec
    lines = [
        f"fuzz case seed={case.seed} world_size={case.world_size}",
        f"  re-run alone: {env} python -m pytest -q -p no:cacheprovider tests/test_fuzz.py -k seed",
        f"  wrapping: {describe_wrap(case)}",
        f"  strategy {case.strategy}" + (f" (layout {case.hybrid})" if "HYBRID" in case.strategy else "")
        + f", backward_prefetch={case.backward_prefetch}, forward_prefetch={case.forward_prefetch}, limit_all_gathers={case.limit_all_gathers}"
        + (f", meta-device init via {case.meta}" if case.meta else "")
        + "".join(f", {k}" for k, v in sorted(case.options.items()) if v),
        f"  optimizer {case.optim}, zero_grad(set_to_none={case.set_to_none}), per-rank batch {case.per_rank}, seq {s['seq']}, dim {s['dim']}",
        f"  model: embed -> body -> norm -> head{' (tied to embed)' if s['tie_head'] else ''}{', head bias' if s['head_bias'] else ''}; output {s['out']}",
    ]
    lines += ["    " + line for line in _tree_lines(s["body"], 0)]
    if s["ties"]:
        lines.append("    weights tied: " + ", ".join(f"#{b}.weight = #{a}.weight" for a, b in s["ties"]))
    if s["frozen"]:
        lines.append("    frozen at construction: " + ", ".join(f"#{i}" for i in s["frozen"]))
    if s.get("clamp"):
        cl = s["clamp"]
        where = [f"#{i}" for i in cl["nodes"]] + (["head"] if cl["head"] else [])
        lines.append(f"    weights clamped to +-{cl['bound']} in place in forwards without grad: {', '.join(where)}")
    lines.append("  schedule:")
    for index, step in enumerate(case.steps):
        ck = case.checkpoint
        if ck is not None and ck["step"] == index:
            where = "in a new pool task" if ck["new_task"] else "in the same task"
            cross = f" wrapped with use_orig_params={not case.options.get('orig')}" if ck.get("cross") else ""
            lines.append(f"    checkpoint {ck['mode']} saved, loaded into a fresh model{cross} {where} at world size {ck['world_size']}")
        lines.append(f"    step {index}: " + describe_step(step))
    lines.append(f"  parameters compared {'after every step' if case.check_every_step else 'at the end and after loading'}")
    return "\n".join(lines)


def describe_wrap(case: Case) -> str:
    w = case.wrap
    if w["mode"] == "none":
        return "one unit (no policy)"
    if w["mode"] == "manual":
        mixed = f", strategies {w['strategies']}" if w["strategies"] else ""
        return f"manual nesting of nodes {w['manual']} (those that split no tie){mixed}"
    detail = {
        "module": f"ModuleWrapPolicy({w['classes']})",
        "transformer": f"transformer_auto_wrap_policy({w['classes']})",
        "size": f"size_based_auto_wrap_policy(min_num_params={w['min_params']})",
        "lambda": "lambda_auto_wrap_policy(wrap_tag)",
        "always": "always_wrap_policy",
    }[w["policy"]]
    return detail


def describe_step(step: Dict[str, Any]) -> str:
    parts = []
    if step["reload"]:
        parts.append(f"{step['reload']} state dicts (model, optimizer) saved and loaded back in place")
    if step["summon"]:
        parts.append(f"inside summon_full_params: parameter[{step['summon'][0]} % count] *= {step['summon'][1]}")
    for idx, flag, via in step["toggles"]:
        parts.append(f"requires_grad_({flag}) on unit[{idx} % units] via {via}")
    for t in step.get("ptoggles", []):
        parts.append(f"requires_grad_({t['flag']}) on the parameters picked by name with key {t['key']}")
    edits = step.get("edits", [])
    parts += [_edit_text(e) for e in edits if e["at"] == "start"]
    if not step["zero_grad"]:
        parts.append("no zero_grad")
    parts += [f"{op} forward" for op in step["pre"]]
    micro = []
    nosync = step.get("nosync_edits", [])
    for i, m in enumerate(step["micro"]):
        bits = ([f"skip {','.join(m['skip'])}"] if m["skip"] else []) + (["FAIL"] if m["fail"] else [])
        op = nosync[i] if i < len(nosync) else None
        if op is not None:
            bits.append("then zero_grad()" if op["how"] == "zero" else f"then every .grad.mul_({op['s']})")
        if i == 0:
            bits += ["then " + _edit_text(e) for e in edits if e["at"] == "micro"]
        micro.append("[" + " ".join(bits) + "]")
    sync = " (all but the last under no_sync)" if step["no_sync"] else ""
    parts.append(f"{len(step['micro'])} micro-batch(es) {' '.join(micro)}{sync}")
    parts += [f"{op} forward after backward" for op in step["post"]]
    parts += [_edit_text(e) for e in edits if e["at"] == "backward"]
    for g in step.get("grad_edits", []):
        which = "every .grad" if g["key"] is None else f"the .grad of the parameters picked by name with key {g['key']}"
        parts.append({
            "rebind": f"{which}: p.grad = p.grad * {g['s']} + {g['o']}",
            "data": f"{which}: p.grad.data = p.grad.data * {g['s']} + {g['o']}",
            "inplace": f"{which}: p.grad.mul_({g['s']}).add_({g['o']})",
            "none": f"{which}: p.grad = None",
        }[g["how"]])
    if step["clip"] is not None:
        parts.append(f"clip_grad_norm_({step['clip']})")
    text = "; ".join(parts) + "; step"
    if step.get("ema"):
        e = step["ema"]
        text += f"; AveragedModel EMA (decay {e['decay']}) made, then updated after each step and evaluated{' in eval mode' if e['eval'] else ''} under no_grad"
    if step.get("copy"):
        k = step["copy"]
        text += f"; deep copy: parameters *= {k['factor']}, {'zero_grad, ' if k['zero_grad'] else ''}one step of its own optimizer"
    return text


def _edit_text(e: Dict[str, Any]) -> str:
    which = "model.parameters()" if e["key"] is None else f"the parameters picked by name with key {e['key']}"
    affine = f"* {e['a']} {'-' if e['b'] < 0 else '+'} {abs(e['b'])}"
    return {
        "data": f"{which}: p.data = p.data {affine}",
        "inplace": f"{which}: p.mul_({e['a']}).add_({e['b']})",
        "vec": f"vector_to_parameters(parameters_to_vector(ps) {affine}, ps), ps = {which}",
        "replace": f"{which}: replaced by nn.Parameter(p {affine}) (the optimizer moved to it)",
    }[e["how"]]


def _tree_lines(node: Dict[str, Any], depth: int) -> List[str]:
    o = node.get("opts", {})
    label = f"#{node['id']} {node['kind']}" + (f" -> #{node['ref']}" if node["kind"] == "share" else "")
    flags = [f"{k}={v}" for k, v in sorted(o.items()) if v not in (None, False, "tensor") and k != "leaves"]
    if node["kind"] == "seq":
        flags.append("leaves=" + "/".join(o["leaves"]))
    lines = ["  " * depth + label + (f" ({', '.join(flags)})" if flags else "")]
    for child in node.get("children", []):
        lines += _tree_lines(child, depth + 1)
    return lines


def one_line(case: Case) -> str:
    """A one-line summary of a case, for the long mode's report."""
    kinds = sorted({n["kind"] for n in walk(case.spec["body"])})
    ck = case.checkpoint
    ckpt = f", ckpt {ck['mode']}@{ck['step']}->ws{ck['world_size']}{' cross-mode' if ck.get('cross') else ''}" if ck else ""
    orig = " orig" if case.options.get("orig") else ""
    return f"ws{case.world_size} {case.strategy}{orig} {describe_wrap(case)}; {len(case.steps)} steps; kinds {','.join(kinds)}{ckpt}"


def to_json(case: Case) -> str:
    """The case as JSON (``FLATSHARD_FUZZ_CASE=file.json`` runs it: e.g. a minimised case)."""
    import json

    return json.dumps(dataclasses.asdict(case), indent=1, sort_keys=True)


def from_json(text: str) -> Case:
    import json

    fields = json.loads(text)
    fields["features"] = tuple(fields["features"])
    return Case(**fields)
