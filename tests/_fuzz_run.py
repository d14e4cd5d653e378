"""Running a fuzz case sharded (in the rank processes) and as single-process training (the
truth), and comparing the two event by event.

Both sides run the same loop (``Run.train``): per step, ``requires_grad`` toggles, zero_grad,
extra forwards, micro-batches (all but the last under ``no_sync`` on the sharded side; plain
gradient accumulation in the reference), a planned backward failure caught by the loop, more
extra forwards, clipping and the optimizer step. Every forward's loss, every clip norm and
(at the end, after loading a checkpoint and optionally after every step) all parameters and
buffers become *events*; the test process compares them in order and reports the first
difference.

The reference follows FSDP1's documented semantics where they differ from a plain model:
a ``FlatParameter`` that receives a gradient in a step gives a zero gradient to those of its
original parameters that got none (so the optimizer steps them), and a model resumed from a
checkpoint starts without gradients. Which original parameters share a ``FlatParameter`` and
which belong to a unit comes from the sharded model (checked to partition the parameters).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from flatshard import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ModuleWrapPolicy,
    ShardedDataParallel as FSDP,
    ShardingStrategy,
    StateDictType,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    comm_hooks,
    transformer_auto_wrap_policy,
)
from flatshard._common import clean_name, join_name
from tests._fuzz import Case
from tests._fuzz_model import PLANNED_FAILURE, POLICY_CLASSES, VOCAB, build_model, loss_of

RTOL = 1e-5
ATOL = 1e-6
# A clip norm is one float32 reduction over every gradient element, summed per shard on the
# ranks and per tensor in the reference: its rounding differs by more than one element's.
CLIP_RTOL = 1e-4
# AdamW divides each update by the root of the gradient's second moment: an element whose
# gradient is near zero moves by lr * (its rounding noise / its size), about 1e-6 at lr 1e-2
# (seen once in ~400 cases); a real bug moves parameters by 1e-3 and more.
ADAMW_ATOL = 1e-5

Event = Tuple[str, int, str, Any]  # (kind, step, label, value)


def batch(case: Case, step: int, index: int, kind: str, world_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one forward (every rank makes the same; each slices its part)."""
    gen = torch.Generator().manual_seed(case.seed * 7919 + step * 131 + index * 17 + (5 if kind == "extra" else 0))
    shape = (world_size * case.per_rank, case.spec["seq"])
    return torch.randint(0, VOCAB, shape, generator=gen), torch.randint(0, VOCAB, shape, generator=gen)


def world_size_at(case: Case, step: int) -> int:
    ck = case.checkpoint
    return ck["world_size"] if ck is not None and step >= ck["step"] else case.world_size


def make_optim(case: Case, params: Any) -> torch.optim.Optimizer:
    o = case.optim
    if o["kind"] == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=o["weight_decay"])
    # eps: AdamW's first steps move a parameter by about lr * g / (|g| + eps), so a gradient
    # that is zero but for rounding (1e-9 here, 1.2e-9 there: sums in another order) would move
    # by a sizeable fraction of lr; an eps well above rounding noise keeps the comparison exact
    # for every real gradient.
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=o["weight_decay"], eps=1e-3)


class Run:
    """One side of a case; subclasses say how data, no_sync, toggles, clipping, state and
    checkpoints work on their side."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self.events: List[Event] = []
        self.model: nn.Module = nn.Module()
        self.optim: Optional[torch.optim.Optimizer] = None

    # -- the loop shared by both sides ----------------------------------------------------

    def train(self, start: int, end: int) -> None:
        case = self.case
        for step in range(start, end):
            ck = case.checkpoint
            if ck is not None and ck["step"] == step and not ck["new_task"]:
                self.roundtrip(step)
            plan = case.steps[step]
            if plan["reload"]:
                self.reload(plan["reload"])
            if plan["summon"]:
                self.summon_write(*plan["summon"])
            for toggle in plan["toggles"]:
                self.toggle(*toggle)
            if plan["zero_grad"]:
                self.optim.zero_grad(set_to_none=case.set_to_none)
            for i, op in enumerate(plan["pre"]):
                self.extra_forward(op, step, f"step {step} {op} forward before micro-batches", i)
            self.micro_batches(step, plan)
            for i, op in enumerate(plan["post"]):
                self.extra_forward(op, step, f"step {step} {op} forward after backward", 10 + i)
            if plan["clip"] is not None:
                self.events.append(("clip", step, f"step {step} clip_grad_norm_({plan['clip']})", self.clip(plan["clip"])))
            self.before_step()
            self.optim.step()
            if case.check_every_step or step == len(case.steps) - 1:
                self.snapshot(step, f"after step {step}")

    def micro_batches(self, step: int, plan: Dict[str, Any]) -> None:
        n = len(plan["micro"])
        for m, micro in enumerate(plan["micro"]):
            tokens, targets = self.data(step, m, "train")
            quiet = plan["no_sync"] and m < n - 1
            with self.no_sync() if quiet else contextlib.nullcontext():
                out = self.model(tokens, skip=tuple(micro["skip"]), fail=micro["fail"])
                loss = loss_of(self.model, out, targets) / n
                self.events.append(("loss", step, f"step {step} micro-batch {m} loss", loss.item()))
                if not loss.requires_grad:  # everything it depends on is frozen
                    self.events.append(("loss", step, f"step {step} micro-batch {m}: no backward (loss needs no gradient)", 0.0))
                    continue
                try:
                    loss.backward()
                except Exception as exc:  # noqa: BLE001 - only the planned failure is caught
                    if PLANNED_FAILURE not in str(exc):
                        raise
                    self.events.append(("loss", step, f"step {step} micro-batch {m} backward failed (zero_grad, continue)", 0.0))
                    # set_to_none=True: a backward that raised leaves partial gradients on the
                    # parameters autograd finished before the error; zeroing them in place would
                    # keep zero gradients on exactly those, which a FlatParameter (all of its
                    # parameters, or none) cannot mirror (README, "Things to know").
                    self.optim.zero_grad(set_to_none=True)

    def extra_forward(self, op: str, step: int, label: str, index: int) -> None:
        tokens, targets = self.data(step, index, "extra")
        if op in ("eval", "evalgrad"):
            self.model.eval()
        context = {"eval": torch.no_grad, "nograd": torch.no_grad, "inference": torch.inference_mode}.get(op, contextlib.nullcontext)
        with context():
            loss = loss_of(self.model, self.model(tokens), targets)
        self.model.train()
        self.events.append(("loss", step, label, loss.item()))

    # -- per side -------------------------------------------------------------------------

    def data(self, step: int, index: int, kind: str) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def no_sync(self) -> Any:
        return contextlib.nullcontext()

    def toggle(self, index: int, flag: bool, via: str) -> None:
        raise NotImplementedError

    def clip(self, max_norm: float) -> float:
        raise NotImplementedError

    def before_step(self) -> None:
        pass

    def reload(self, kind: str) -> None:
        pass  # the reference: loading what was just saved changes nothing

    def summon_write(self, index: int, factor: float) -> None:
        raise NotImplementedError

    @staticmethod
    def _scale_one(model: nn.Module, index: int, factor: float) -> None:
        named = list(model.named_parameters())
        with torch.no_grad():
            named[index % len(named)][1].mul_(factor)

    def snapshot(self, step: int, label: str) -> None:
        raise NotImplementedError

    def roundtrip(self, step: int) -> None:
        raise NotImplementedError


# -- the sharded side (in a rank process) -------------------------------------------------


def _tagged(module: nn.Module) -> bool:
    return bool(getattr(module, "wrap_tag", False))


def make_policy(wrap: Dict[str, Any]) -> Any:
    classes = {POLICY_CLASSES[name] for name in wrap["classes"]}
    kind = wrap["policy"]
    if kind == "module":
        return ModuleWrapPolicy(classes)
    if kind == "transformer":
        return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes)
    if kind == "size":
        return functools.partial(size_based_auto_wrap_policy, min_num_params=wrap["min_params"])
    if kind == "lambda":
        return functools.partial(lambda_auto_wrap_policy, lambda_fn=_tagged)
    return always_wrap_policy


def _init_fn(module: nn.Module) -> None:
    module.to_empty(device="cpu", recurse=False)
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def manual_targets(case: Case, model: nn.Module, built: Dict[int, nn.Module]) -> List[Tuple[str, nn.Module, int]]:
    """The nodes to wrap by hand that are registered once and hold every user of each of
    their parameters (wrapping others would split a tie: refused by design), deepest first."""
    paths: Dict[int, List[str]] = {}
    holders: Dict[int, List[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(path)
        for _, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append(path)
    chosen = []
    for node_id in case.wrap["manual"]:
        module = built.get(node_id)
        if module is None or len(paths.get(id(module), [])) != 1:
            continue
        path = paths[id(module)][0]
        inside = lambda h: h == path or h.startswith(path + ".")  # noqa: E731
        if all(inside(h) for p in module.parameters() for h in holders[id(p)]):
            chosen.append((path, module, node_id))
    return sorted(chosen, key=lambda t: -t[0].count("."))


def process_group(case: Case, rank: int, world_size: int) -> Any:
    if case.strategy not in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        return None
    if case.hybrid == "grid" and world_size == 4:
        shard = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        replicate = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        return shard[rank // 2], replicate[rank % 2]
    own = [dist.new_group([r]) for r in range(world_size)]
    everyone = dist.new_group(list(range(world_size)))
    return (own[rank], everyone) if case.hybrid == "rep" else (everyone, own[rank])


class ShardedRun(Run):
    def __init__(self, case: Case, rank: int, world_size: int, directory: str) -> None:
        super().__init__(case)
        self.rank, self.world_size, self.directory = rank, world_size, directory
        self.group = process_group(case, rank, world_size)
        self.build()

    def build(self) -> None:
        case = self.case
        model, built = build_model(case.spec, "meta" if case.meta else None, with_nodes=True)
        opts: Dict[str, Any] = {
            "sharding_strategy": ShardingStrategy[case.strategy],
            "backward_prefetch": BackwardPrefetch[case.backward_prefetch] if case.backward_prefetch else None,
            "forward_prefetch": case.forward_prefetch,
            "limit_all_gathers": case.limit_all_gathers,
        }
        if self.group is not None:
            opts["process_group"] = self.group
        if case.meta == "init_fn":
            opts["param_init_fn"] = _init_fn
        if case.options["offload"]:
            opts["cpu_offload"] = CPUOffload(offload_params=True)
        if case.options.get("orig"):
            opts["use_orig_params"] = True
        if case.options["sync_states"]:
            opts["sync_module_states"] = True
            if self.rank != 0:  # only rank 0's values may survive
                gen = torch.Generator().manual_seed(self.rank)
                with torch.no_grad():
                    for t in list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]:
                        t.add_(torch.randn(t.shape, generator=gen))
        w = case.wrap
        if w["mode"] == "manual":
            for path, module, node_id in manual_targets(case, model, built):
                parent_path, _, attr = path.rpartition(".")
                inner = dict(opts)
                if str(node_id) in w["strategies"]:
                    inner["sharding_strategy"] = ShardingStrategy[w["strategies"][str(node_id)]]
                setattr(model.get_submodule(parent_path), attr, FSDP(module, **inner))
        if w["mode"] == "policy":
            opts["auto_wrap_policy"] = make_policy(w)
        self.model = FSDP(model, **opts)
        if case.options["comm_hook"]:
            no_shard = case.strategy == "NO_SHARD" or self.world_size == 1  # FSDP1 calls hook(state, grad) then
            hook = comm_hooks.allreduce_hook if no_shard else comm_hooks.reduce_scatter_hook
            self.model.register_comm_hook(comm_hooks.DefaultState(self.model.process_group), hook)
        self.optim = make_optim(case, self.model.parameters())

    def units(self) -> Tuple[List[List[str]], List[List[str]]]:
        """Per unit (``fsdp_modules`` order) every original parameter name in its subtree; per
        FlatParameter its original names."""
        prefixes = {id(m): clean_name(n) for n, m in self.model.named_modules() if isinstance(m, FSDP)}
        groups_of: Dict[int, List[List[str]]] = {}
        for unit in FSDP.fsdp_modules(self.model):
            prefix = prefixes[id(unit)]
            groups_of[id(unit)] = [
                [join_name(prefix, i.name) for i in h.param_infos] + [join_name(prefix, s.name) for s in h.shared_param_infos]
                for h in unit.handles
            ]
        units = [sorted(n for m in FSDP.fsdp_modules(u) for g in groups_of[id(m)] for n in g) for u in FSDP.fsdp_modules(self.model)]
        if self.case.options.get("orig"):
            # The unit's parameters are the originals in its subtree: a tie partner owned by an
            # enclosing unit is the same object, so toggling the unit toggles it too.
            units = [
                sorted(join_name(prefixes[id(u)], clean_name(n)) for n, _ in u.named_parameters(remove_duplicate=False))
                for u in FSDP.fsdp_modules(self.model)
            ]
        return units, [g for u in FSDP.fsdp_modules(self.model) for g in groups_of[id(u)]]

    def data(self, step: int, index: int, kind: str) -> Tuple[torch.Tensor, torch.Tensor]:
        tokens, targets = batch(self.case, step, index, kind, self.world_size)
        part = slice(self.rank * self.case.per_rank, (self.rank + 1) * self.case.per_rank)
        return tokens[part], targets[part]

    def no_sync(self) -> Any:
        return self.model.no_sync()

    def toggle(self, index: int, flag: bool, via: str) -> None:
        units = FSDP.fsdp_modules(self.model)
        unit = units[index % len(units)]
        if via == "wrapper":
            unit.requires_grad_(flag)
        elif via == "module":
            unit.module.requires_grad_(flag)
        else:
            for p in unit.parameters():
                p.requires_grad_(flag)

    def clip(self, max_norm: float) -> float:
        return float(self.model.clip_grad_norm_(max_norm))

    def summon_write(self, index: int, factor: float) -> None:
        with FSDP.summon_full_params(self.model):
            self._scale_one(self.model, index, factor)

    def reload(self, kind: str) -> None:
        model, optim = self.model, self.optim
        sd_type = StateDictType.SHARDED_STATE_DICT if kind == "sharded" else StateDictType.FULL_STATE_DICT
        with FSDP.state_dict_type(model, sd_type):
            state, osd = model.state_dict(), FSDP.optim_state_dict(model, optim)
            model.load_state_dict(state)
            optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, osd))

    def snapshot(self, step: int, label: str) -> None:
        with FSDP.summon_full_params(self.model, writeback=False):
            params = {n: p.detach().clone() for n, p in self.model.named_parameters()}
            buffers = {n: b.detach().clone() for n, b in self.model.named_buffers()}
        self.events.append(("state", step, label, (params, buffers)))

    # -- checkpoints ----------------------------------------------------------------------

    def leader(self) -> bool:
        """Rank 0 of the shard group: where rank0_only outputs land (README, hybrid)."""
        if self.group is None:
            return self.rank == 0
        return dist.get_rank(self.group[0]) == 0

    def roundtrip(self, step: int) -> None:
        self.save(step)
        self.model, self.optim = nn.Module(), None
        gc.collect()
        self.build()
        self.replay_toggles(step)
        self.load(step)

    def replay_toggles(self, step: int) -> None:
        for plan in self.case.steps[:step]:
            for toggle in plan["toggles"]:
                self.toggle(*toggle)

    def save(self, step: int) -> None:
        mode = self.case.checkpoint["mode"]
        if mode == "sharded" and any(p.requires_grad and not self.optim.state.get(p) for p in self.model.parameters()):
            mode = "full"  # README: units without optimizer state resume through the full form
        model, optim = self.model, self.optim
        if mode == "sharded":
            import torch.distributed.checkpoint as dcp

            with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
                dcp.save(state, checkpoint_id=os.path.join(self.directory, "dcp"))
        else:
            if mode == "full":
                sd, osd = model.state_dict(), FSDP.full_optim_state_dict(model, optim)
            else:
                rank0 = mode == "full_osd_rank0"
                with FSDP.state_dict_type(
                    model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=rank0, rank0_only=rank0), FullOptimStateDictConfig(offload_to_cpu=rank0, rank0_only=rank0)
                ):
                    sd, osd = model.state_dict(), FSDP.optim_state_dict(model, optim)
            if self.rank == 0:
                torch.save({"model": sd, "optim": osd}, os.path.join(self.directory, "full.pt"))
        if self.rank == 0:
            with open(os.path.join(self.directory, "mode"), "w") as f:
                f.write(mode)
        dist.barrier()

    def load(self, step: int) -> None:
        with open(os.path.join(self.directory, "mode")) as f:
            mode = f.read()
        model, optim = self.model, self.optim
        if mode == "sharded":
            import torch.distributed.checkpoint as dcp

            with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
                dcp.load(state, checkpoint_id=os.path.join(self.directory, "dcp"))
                model.load_state_dict(state["model"])
                optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, state["optim"]))
        else:
            blob = torch.load(os.path.join(self.directory, "full.pt"), weights_only=False)
            model.load_state_dict(blob["model"])
            if mode == "full":
                local = FSDP.scatter_full_optim_state_dict(blob["optim"] if self.leader() else None, model, optim=optim)
            else:
                rank0 = mode == "full_osd_rank0"
                given = blob["optim"] if self.leader() or not rank0 else {}
                with FSDP.state_dict_type(
                    model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=rank0, rank0_only=rank0), FullOptimStateDictConfig(offload_to_cpu=rank0, rank0_only=rank0)
                ):
                    local = FSDP.optim_state_dict_to_load(model, optim, given)
            optim.load_state_dict(local)
        self.snapshot(step, f"after loading the checkpoint ({mode}) before step {step}")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def rank_part(rank: int, world_size: int, case: Case, part: str, directory: str, dtype: torch.dtype = torch.float32) -> Dict[str, Any]:
    """Rank function: ``part`` is ``all`` (the whole case), ``before`` (the steps before the
    checkpoint, then save) or ``after`` (a fresh model loads it and runs the rest); the model is
    built in ``dtype``."""
    with default_dtype(dtype):
        return _rank_part(rank, world_size, case, part, directory)


def _rank_part(rank: int, world_size: int, case: Case, part: str, directory: str) -> Dict[str, Any]:
    torch.manual_seed(0)
    run = ShardedRun(case, rank, world_size, directory)
    n, ck = len(case.steps), case.checkpoint
    if part == "all":
        run.train(0, n)
    elif part == "before":
        run.train(0, ck["step"])
        run.save(ck["step"])
    else:
        run.replay_toggles(ck["step"])
        run.load(ck["step"])
        run.train(ck["step"], n)
    units, groups = run.units()
    events = run.events
    del run
    gc.collect()
    return {"events": events, "units": units, "groups": groups}


# -- the reference (single process) -------------------------------------------------------


class ReferenceRun(Run):
    def __init__(self, case: Case, units: List[List[str]], groups: List[List[str]]) -> None:
        super().__init__(case)
        torch.manual_seed(0)
        self.model = build_model(case.spec)
        self.optim = make_optim(case, self.model.parameters())
        self.named = dict(self.model.named_parameters(remove_duplicate=False))
        self.units, self.groups = units, groups
        self.step = 0

    def train(self, start: int, end: int) -> None:
        for step in range(start, end):
            ck = self.case.checkpoint
            if ck is not None and ck["step"] == step and ck["new_task"]:
                self.roundtrip(step)
            super().train(step, step + 1)

    def data(self, step: int, index: int, kind: str) -> Tuple[torch.Tensor, torch.Tensor]:
        return batch(self.case, step, index, kind, world_size_at(self.case, step))

    def toggle(self, index: int, flag: bool, via: str) -> None:
        for name in self.units[index % len(self.units)]:
            self.named[name].requires_grad_(flag)

    def summon_write(self, index: int, factor: float) -> None:
        self._scale_one(self.model, index, factor)

    def clip(self, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.grad is not None], max_norm))

    def before_step(self) -> None:
        """FSDP1's flat-parameter rule: a FlatParameter with a gradient gives zeros to its
        originals that got none."""
        for group in self.groups:
            params = [self.named[n] for n in group]
            if any(p.grad is not None for p in params):
                for p in params:
                    if p.grad is None and p.requires_grad:
                        p.grad = torch.zeros_like(p)

    def snapshot(self, step: int, label: str) -> None:
        params = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        buffers = {n: b.detach().clone() for n, b in self.model.named_buffers()}
        self.events.append(("state", step, label, (params, buffers)))

    def roundtrip(self, step: int) -> None:
        for p in self.model.parameters():
            p.grad = None  # a resumed model starts without gradients
        mode = "?"
        self.snapshot(step, f"after loading the checkpoint ({mode}) before step {step}")


def check_units(named: Dict[str, torch.Tensor], groups: List[List[str]]) -> Optional[str]:
    """The sharded model's account of its FlatParameters must cover every parameter of the
    plain model once (a module registered twice holds its parameters once)."""
    owner: Dict[int, int] = {}
    for index, group in enumerate(groups):
        for name in group:
            if name not in named:
                return f"FlatParameter {index} holds {name!r}, which the plain model does not have"
            if owner.setdefault(id(named[name]), index) != index:
                return f"{name!r} is in FlatParameters {owner[id(named[name])]} and {index}"
    missing = sorted(n for n, p in named.items() if id(p) not in owner)
    return f"no FlatParameter holds {missing}" if missing else None


# -- comparison -----------------------------------------------------------------------------


def _close(actual: float, expected: float, rtol: float = RTOL) -> bool:
    return abs(actual - expected) <= ATOL + rtol * abs(expected)


def compare(reference: List[Event], ranks: List[List[Event]], atol: float = ATOL) -> Optional[str]:
    """The first difference between the reference's events and the ranks' (None if none).
    Losses are averaged over the ranks (each computed on its slice); clip norms, parameters
    and buffers must match on every rank."""
    for r, events in enumerate(ranks):
        labels = [(e[0], _norm(e[2])) for e in events]
        expected = [(e[0], _norm(e[2])) for e in reference]
        if labels != expected:
            first = next((i for i in range(min(len(labels), len(expected))) if labels[i] != expected[i]), min(len(labels), len(expected)))
            got = labels[first][1] if first < len(labels) else "nothing"
            want = expected[first][1] if first < len(expected) else "nothing"
            return f"rank {r} ran a different schedule: event {first} is '{got}', the reference has '{want}'"
    for i, (kind, step, label, want) in enumerate(reference):
        got = [events[i][3] for events in ranks]
        if kind == "loss":
            mean = sum(got) / len(got)
            if not _close(mean, want):
                return f"{label}: mean over ranks {mean:.8g} (per rank {[f'{g:.8g}' for g in got]}), reference {want:.8g}"
        elif kind == "clip":
            for r, g in enumerate(got):
                if not _close(g, want, CLIP_RTOL):
                    return f"{label}: rank {r} got norm {g:.8g}, reference {want:.8g}"
        else:
            message = _compare_state(label, want, got, atol)
            if message:
                return message
    return None


def _norm(label: str) -> str:
    # the reference does not know which checkpoint form the ranks used
    return label.split(" (")[0] if label.startswith("after loading") else label


def _compare_state(label: str, want: Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]], got: List[Any], atol: float) -> Optional[str]:
    for r, state in enumerate(got):
        for what, expected, actual in (("parameter", want[0], state[0]), ("buffer", want[1], state[1])):
            if sorted(expected) != sorted(actual):
                return f"{label}: rank {r} {what} names {sorted(actual)}, reference {sorted(expected)}"
            worst = None
            for name, e in expected.items():
                a = actual[name]
                if a.shape != e.shape or a.dtype != e.dtype:
                    return f"{label}: rank {r} {what} {name} is {a.dtype}{tuple(a.shape)}, reference {e.dtype}{tuple(e.shape)}"
                if a.is_floating_point():
                    diff = (a.double() - e.double()).abs()
                    bad = diff > atol + RTOL * e.double().abs()
                    if bad.any() and (worst is None or diff.max() > worst[1]):
                        worst = (name, float(diff.max()), float(e.double().abs().max()))
                elif not torch.equal(a, e):
                    return f"{label}: rank {r} {what} {name} = {a.tolist()}, reference {e.tolist()}"
            if worst is not None:
                return f"{label}: rank {r} {what} {worst[0]} differs by up to {worst[1]:.3g} (values up to {worst[2]:.3g})"
    return None


# -- one case, end to end (in the test process) ---------------------------------------------


class Failure:
    """Why a case failed: ``summary`` (one line) and ``details``."""

    def __init__(self, summary: str, details: str = "") -> None:
        self.summary, self.details = summary, details
        self.rounding = False  # a float32 mismatch that float64 does not reproduce

    def __str__(self) -> str:
        return self.summary + ("\n" + self.details if self.details else "")


def check(pool: Any, case: Case, timeout: float = 60.0, dtype: torch.dtype = torch.float32) -> Optional[Failure]:
    """Run ``case`` on the pool's ranks and as single-process training, with the model in
    ``dtype``; the first difference (or error) as a ``Failure``, else None. A float32 mismatch
    that float64 does not reproduce is rounding, amplified (e.g. by a LayerNorm of nearly
    constant input): ``Failure.rounding`` says so."""
    failure = _check(pool, case, timeout, dtype)
    if failure is not None and dtype == torch.float32 and failure.summary.startswith("mismatch"):
        failure.rounding = _check(pool, case, timeout, torch.float64) is None
    return failure


def _check(pool: Any, case: Case, timeout: float, dtype: torch.dtype) -> Optional[Failure]:
    import shutil
    import tempfile
    import traceback

    directory = tempfile.mkdtemp(prefix="flatshard-fuzz-")
    ck = case.checkpoint
    try:
        try:
            if ck is not None and ck["new_task"]:
                parts = [pool.run(rank_part, case.world_size, case, "before", directory, dtype, timeout=timeout)]
                parts.append(pool.run(rank_part, ck["world_size"], case, "after", directory, dtype, timeout=timeout))
            else:
                parts = [pool.run(rank_part, case.world_size, case, "all", directory, dtype, timeout=timeout)]
        except BaseException as exc:  # noqa: BLE001 - any error of the ranks is a finding
            text = "".join(traceback.format_exception(exc))
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return Failure(f"error: {type(exc).__name__}: {first[:200]}", text)
        with default_dtype(dtype):
            return _compare_parts(case, parts)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _compare_parts(case: Case, parts: List[List[Dict[str, Any]]]) -> Optional[Failure]:
    units, groups = parts[0][0]["units"], parts[0][0]["groups"]
    for p, results in enumerate(parts):
        for r, result in enumerate(results):
            if result["units"] != units or result["groups"] != groups:
                return Failure(f"part {p} rank {r} reports other units than rank 0: {result['groups']} vs {groups}")
    reference = ReferenceRun(case, units, groups)
    problem = check_units(reference.named, groups)
    if problem:
        return Failure(f"unit report: {problem}")
    reference.train(0, len(case.steps))
    ck = case.checkpoint
    split = ck["step"] if ck is not None and ck["new_task"] else len(case.steps) + 1
    pieces = [[e for e in reference.events if e[1] < split], [e for e in reference.events if e[1] >= split]]
    for p, results in enumerate(parts):
        atol = ADAMW_ATOL if case.optim["kind"] == "adamw" else ATOL
        message = compare(pieces[p], [r["events"] for r in results], atol)
        if message:
            where = f" (world size {len(results)}{', after resuming' if p else ''})"
            return Failure(f"mismatch{where}: {message}")
    return None
