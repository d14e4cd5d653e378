"""Running a fuzz case sharded (in the rank processes) and as single-process training (the
truth), and comparing the two event by event.

Both sides run the same loop (``Run.train``): per step, ``requires_grad`` toggles (per unit,
per parameter), parameter edits, zero_grad, extra forwards, micro-batches (all but the last
under ``no_sync`` on the sharded side; plain gradient accumulation in the reference; gradient
edits and parameter edits between them), a planned backward failure caught by the loop, more
extra forwards, parameter and gradient edits, clipping and the optimizer step; then the EMA
copy is updated and evaluated and a deep copy trains. The same code writes to both models
(``model.parameters()``, and with use_orig_params ``named_parameters()``: the unwrapped
model's names). Every forward's loss, every clip norm and (at the end, after loading a
checkpoint, optionally after every step, and for each copy) all parameters and buffers
become *events*; the test process compares them in order and reports the first difference.

The reference follows FSDP1's documented semantics where they differ from a plain model:
a ``FlatParameter`` that receives a gradient in a step gives a zero gradient to those of its
original parameters that got none (so the optimizer steps them), and a model resumed from a
checkpoint starts without gradients. Which original parameters share a ``FlatParameter`` and
which belong to a unit comes from the sharded model, per model it built (a checkpoint loaded
into the other use_orig_params mode changes a unit's parameters where a tie crosses units;
checked to partition the parameters).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import os
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

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
from flatshard._base._common import clean_name, join_name
from tests._fuzz import Case, orig_at, pick_names
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
        self.ema: Optional[Tuple[nn.Module, bool]] = None  # (the AveragedModel, evaluated in eval mode)
        self.step_now = 0

    # -- the loop shared by both sides ----------------------------------------------------

    def train(self, start: int, end: int) -> None:
        case = self.case
        for step in range(start, end):
            self.step_now = step
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
            for t in plan["ptoggles"]:
                for p in self.params_for(self.model, t["key"]):
                    p.requires_grad_(t["flag"])
            self.edit_params(plan, "start")
            self.set_overlap(plan["overlap"])
            if plan["zero_grad"]:
                self.optim.zero_grad(set_to_none=case.set_to_none)
            for i, op in enumerate(plan["pre"]):
                self.extra_forward(op, step, f"step {step} {op} forward before micro-batches", i)
            self.micro_batches(step, plan)
            for i, op in enumerate(plan["post"]):
                self.extra_forward(op, step, f"step {step} {op} forward after backward", 10 + i)
            self.edit_params(plan, "backward")
            for g in plan["grad_edits"]:
                self.edit_grads(g)
            if plan["clip"] is not None:
                self.events.append(("clip", step, f"step {step} clip_grad_norm_({plan['clip']})", self.clip(plan["clip"])))
            self.optim.step()
            if case.check_every_step or step == len(case.steps) - 1:
                self.snapshot(step, f"after step {step}")
            self.copies(step, plan)

    def micro_batches(self, step: int, plan: Dict[str, Any]) -> None:
        n = len(plan["micro"])
        for m, micro in enumerate(plan["micro"]):
            quiet = plan["no_sync"] and m < n - 1
            with self.no_sync() if quiet else contextlib.nullcontext():
                self.micro_batch(step, m, n, micro)
            edit = plan["nosync_edits"][m] if quiet and m < len(plan["nosync_edits"]) else None
            if edit is not None and edit["how"] == "zero":
                self.optim.zero_grad(set_to_none=self.case.set_to_none)
                if self.case.set_to_none:
                    self.grads_dropped()
            elif edit is not None:
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(edit["s"])
            if m == 0:
                self.edit_params(plan, "micro")

    def micro_batch(self, step: int, m: int, n: int, micro: Dict[str, Any]) -> None:
        tokens, targets = self.data(step, m, "train")
        out = self.model(tokens, skip=tuple(micro["skip"]), fail=micro["fail"])
        loss = loss_of(self.model, out, targets) / n
        self.events.append(("loss", step, f"step {step} micro-batch {m} loss", loss.item()))
        if not loss.requires_grad:  # everything it depends on is frozen
            self.events.append(("loss", step, f"step {step} micro-batch {m}: no backward (loss needs no gradient)", 0.0))
            return
        try:
            loss.backward()
        except Exception as exc:  # noqa: BLE001 - only the planned failure is caught
            if PLANNED_FAILURE not in str(exc):
                raise
            self.events.append(("loss", step, f"step {step} micro-batch {m} backward failed (zero_grad, continue)", 0.0))
            # set_to_none=True: a backward that raised leaves partial gradients on the
            # parameters autograd finished before the error; zeroing them in place would
            # keep zero gradients on exactly those, which a FlatParameter (all of its
            # parameters, or none) cannot mirror (docs/training.md, "After a backward that raised").
            self.optim.zero_grad(set_to_none=True)
            self.grads_dropped()

    def extra_forward(self, op: str, step: int, label: str, index: int) -> None:
        tokens, targets = self.data(step, index, "extra")
        if op in ("eval", "evalgrad"):
            self.model.eval()
        context = {"eval": torch.no_grad, "nograd": torch.no_grad, "inference": torch.inference_mode}.get(op, contextlib.nullcontext)
        with context():
            loss = loss_of(self.model, self.model(tokens), targets)
        self.model.train()
        self.events.append(("loss", step, label, loss.item()))

    # -- writes to parameters, gradients, and copies of the model (the same on both sides) --

    @staticmethod
    def params_for(model: nn.Module, key: Optional[int]) -> List[nn.Parameter]:
        """``model.parameters()`` (``key`` None), or those of ``named_parameters()`` that
        ``pick_names`` chooses (with use_orig_params the unwrapped model's names)."""
        if key is None:
            return list(model.parameters())
        named = dict(model.named_parameters())
        return [named[n] for n in pick_names(list(named), key)]

    def edit_params(self, plan: Dict[str, Any], at: str) -> None:
        for e in plan["edits"]:
            if e["at"] != at:
                continue
            params, a, b = self.params_for(self.model, e["key"]), e["a"], e["b"]
            if e["how"] == "data":
                for p in params:
                    p.data = p.data * a + b
            elif e["how"] == "inplace":
                with torch.no_grad():
                    for p in params:
                        p.mul_(a).add_(b)
            elif e["how"] == "vec":
                if params:
                    vector_to_parameters(parameters_to_vector(params) * a + b, params)
            else:
                self.replace_params(params, a, b)

    def replace_params(self, params: List[nn.Parameter], a: float, b: float) -> None:
        """Register ``nn.Parameter(p * a + b)`` wherever each of ``params`` is registered, and
        move the optimizer (its param groups and state) to the new objects."""
        for old in params:
            new = nn.Parameter(old.detach() * a + b, requires_grad=old.requires_grad)
            for module in self.model.modules():
                for attr, held in list(module._parameters.items()):
                    if held is old:
                        setattr(module, attr, new)
            for group in self.optim.param_groups:
                group["params"][:] = [new if q is old else q for q in group["params"]]
            if old in self.optim.state:
                self.optim.state[new] = self.optim.state.pop(old)

    def edit_grads(self, g: Dict[str, Any]) -> None:
        s, o = g["s"], g["o"]
        for p in self.params_for(self.model, g["key"]):
            if p.grad is None:
                continue
            if g["how"] == "rebind":
                p.grad = p.grad * s + o
            elif g["how"] == "data":
                p.grad.data = p.grad.data * s + o
            elif g["how"] == "inplace":
                p.grad.mul_(s).add_(o)
            else:
                p.grad = None

    def copies(self, step: int, plan: Dict[str, Any]) -> None:
        """After the optimizer step: the EMA copy is updated and evaluated (or made), a deep
        copy trains for a step; the EMA's parameters are compared when it is dropped (at the
        end, or before a checkpoint is loaded)."""
        if self.ema is not None:
            self.ema[0].update_parameters(self.model)
            self.eval_ema(step, "updated")
        if plan["ema"]:
            average = AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(plan["ema"]["decay"]))
            self.ema = (average, plan["ema"]["eval"])
            self.eval_ema(step, "made")
        if plan["copy"]:
            self.train_copy(step, plan["copy"])
        ck = self.case.checkpoint
        if self.ema is not None and (step == len(self.case.steps) - 1 or (ck is not None and ck["step"] == step + 1)):
            self.snapshot_of(self.ema[0].module, step, f"EMA after step {step}")
            self.ema = None

    def eval_ema(self, step: int, what: str) -> None:
        average, in_eval = self.ema
        tokens, targets = self.data(step, 30, "extra")
        if in_eval:
            average.eval()
        with torch.no_grad():
            loss = loss_of(average, average(tokens), targets)
        average.train()
        self.events.append(("loss", step, f"step {step} EMA ({what}) loss", loss.item()))

    def train_copy(self, step: int, spec: Dict[str, Any]) -> None:
        clone = copy.deepcopy(self.model)
        with torch.no_grad():
            for p in clone.parameters():
                p.mul_(spec["factor"])
        optim = make_optim(self.case, clone.parameters())
        if spec["zero_grad"]:
            optim.zero_grad(set_to_none=True)
        tokens, targets = self.data(step, 40, "extra")
        loss = loss_of(clone, clone(tokens), targets)
        self.events.append(("loss", step, f"step {step} deep copy's loss", loss.item()))
        if loss.requires_grad:
            loss.backward()
            self.fill_grads(clone)
            optim.step()
        self.snapshot_of(clone, step, f"deep copy after its step {step}")
        del clone, optim
        gc.collect()

    # -- per side -------------------------------------------------------------------------

    def data(self, step: int, index: int, kind: str) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def no_sync(self) -> Any:
        return contextlib.nullcontext()

    def set_overlap(self, on: bool) -> None:
        """This step's communication overlap: the wrapped model's (the reference has none)."""

    def toggle(self, index: int, flag: bool, via: str) -> None:
        raise NotImplementedError

    def clip(self, max_norm: float) -> float:
        raise NotImplementedError

    def fill_grads(self, model: nn.Module) -> None:
        pass

    def grads_dropped(self) -> None:
        pass  # every .grad was set to None mid-step

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
        self.snapshot_of(self.model, step, label)

    def snapshot_of(self, model: nn.Module, step: int, label: str) -> None:
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


def process_group(case: Case, rank: int, world_size: int, timeout: Optional[timedelta] = None) -> Any:
    """The (shard, replicate) groups of a hybrid strategy (``timeout``: theirs; ``None``:
    torch's default for new groups), else ``None``."""
    if case.strategy not in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        return None
    new_group = functools.partial(dist.new_group, timeout=timeout)
    if case.hybrid == "grid" and world_size == 4:
        shard = [new_group([0, 1]), new_group([2, 3])]
        replicate = [new_group([0, 2]), new_group([1, 3])]
        return shard[rank // 2], replicate[rank % 2]
    own = [new_group([r]) for r in range(world_size)]
    everyone = new_group(list(range(world_size)))
    return (own[rank], everyone) if case.hybrid == "rep" else (everyone, own[rank])


class ShardedRun(Run):
    def __init__(self, case: Case, rank: int, world_size: int, directory: str, first_step: int = 0, group_timeout: Optional[timedelta] = None) -> None:
        super().__init__(case)
        self.rank, self.world_size, self.directory = rank, world_size, directory
        self.group = process_group(case, rank, world_size, group_timeout)
        # The model's use_orig_params mode (a cross_mode checkpoint loads into the other one),
        # the first step it runs, and per model built (step, units, FlatParameter groups).
        self.orig, self.first_step = orig_at(case, first_step), first_step
        self.reports: List[Tuple[int, List[List[str]], List[List[str]]]] = []
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
        if self.orig:
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

    def set_overlap(self, on: bool) -> None:
        self.model.set_communication_overlap(on)

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
        if self.orig:
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

    def snapshot_of(self, model: nn.Module, step: int, label: str) -> None:
        with FSDP.summon_full_params(model, writeback=False):
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        self.events.append(("state", step, label, (params, buffers)))

    # -- checkpoints ----------------------------------------------------------------------

    def leader(self) -> bool:
        """Rank 0 of the shard group: where rank0_only outputs land (docs/training.md, "Hybrid sharding")."""
        if self.group is None:
            return self.rank == 0
        return dist.get_rank(self.group[0]) == 0

    def roundtrip(self, step: int) -> None:
        self.save(step)
        self.report()
        self.model, self.optim = nn.Module(), None
        gc.collect()
        self.orig, self.first_step = orig_at(self.case, step), step
        self.build()
        self.replay_toggles(step)
        self.load(step)

    def report(self) -> None:
        self.reports.append((self.first_step, *self.units()))

    def replay_toggles(self, step: int) -> None:
        for plan in self.case.steps[:step]:
            for toggle in plan["toggles"]:
                self.toggle(*toggle)
            for t in plan["ptoggles"]:
                for p in self.params_for(self.model, t["key"]):
                    p.requires_grad_(t["flag"])

    def save(self, step: int) -> None:
        mode = self.case.checkpoint["mode"]
        if mode == "sharded":
            # docs/checkpoints.md ("Optimizer state"): units without optimizer state resume through the full form (decided by
            # all ranks: with use_orig_params a parameter with no part in a rank's shard has no
            # gradient and no state there)
            stateless = any(p.requires_grad and p.numel() and not self.optim.state.get(p) for p in self.model.parameters())
            flag = torch.tensor([float(stateless)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            mode = "full" if flag.item() else mode
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
    n, ck = len(case.steps), case.checkpoint
    run = ShardedRun(case, rank, world_size, directory, ck["step"] if part == "after" else 0)
    if part == "all":
        run.train(0, n)
    elif part == "before":
        run.train(0, ck["step"])
        run.save(ck["step"])
    else:
        run.replay_toggles(ck["step"])
        run.load(ck["step"])
        run.train(ck["step"], n)
    run.report()
    events, reports = run.events, run.reports
    del run
    gc.collect()
    return {"events": events, "reports": reports}


# -- the reference (single process) -------------------------------------------------------


class ReferenceRun(Run):
    def __init__(self, case: Case, reports: List[Tuple[int, List[List[str]], List[List[str]]]]) -> None:
        super().__init__(case)
        torch.manual_seed(0)
        self.model = build_model(case.spec)
        self.optim = make_optim(case, self.model.parameters())
        self.reports = sorted(reports, key=lambda r: r[0])
        # the parameters that got a gradient in the last backward (see fill_grads), and those
        # hooked to say so (kept: their ids stay theirs)
        self.got_grad: set = set()
        self.hooked: Dict[int, nn.Parameter] = {}

    @property
    def named(self) -> Dict[str, nn.Parameter]:
        return dict(self.model.named_parameters(remove_duplicate=False))

    def report_at(self, step: int) -> Tuple[int, List[List[str]], List[List[str]]]:
        """The sharded model's units and FlatParameter groups at ``step`` (they differ between
        the use_orig_params modes when a tie crosses units)."""
        return [r for r in self.reports if r[0] <= step][-1]

    def train(self, start: int, end: int) -> None:
        for step in range(start, end):
            ck = self.case.checkpoint
            if ck is not None and ck["step"] == step and ck["new_task"]:
                self.roundtrip(step)
            super().train(step, step + 1)

    def data(self, step: int, index: int, kind: str) -> Tuple[torch.Tensor, torch.Tensor]:
        return batch(self.case, step, index, kind, world_size_at(self.case, step))

    def toggle(self, index: int, flag: bool, via: str) -> None:
        units, named = self.report_at(self.step_now)[1], self.named
        for name in units[index % len(units)]:
            named[name].requires_grad_(flag)

    def summon_write(self, index: int, factor: float) -> None:
        self._scale_one(self.model, index, factor)

    def clip(self, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.grad is not None], max_norm))

    def micro_batch(self, step: int, m: int, n: int, micro: Dict[str, Any]) -> None:
        for p in self.model.parameters():  # (new ones too: a parameter may have been replaced)
            if id(p) not in self.hooked and p.requires_grad:
                self.hooked[id(p)] = p
                p.register_post_accumulate_grad_hook(lambda t: self.got_grad.add(id(t)))
        self.got_grad.clear()
        super().micro_batch(step, m, n, micro)
        # (at each backward, as FSDP1 gives the zeros at each reduction: to the parameters of
        # that moment, not to one registered later; inside no_sync too, where the .grads are
        # views of the local full gradient)
        self.fill_grads(self.model)

    def grads_dropped(self) -> None:
        self.got_grad.clear()

    def fill_grads(self, model: nn.Module) -> None:
        """FSDP1's flat-parameter rule: a FlatParameter that gets a gradient in a backward
        gives zeros to its originals that got none (``self.model``: the parameters that got a
        gradient in the backward just run, none if it failed; a copy made without gradients:
        those that have one)."""
        named = dict(model.named_parameters(remove_duplicate=False))
        got = (lambda p: id(p) in self.got_grad) if model is self.model else (lambda p: p.grad is not None)
        for group in self.report_at(self.step_now)[2]:
            params = [named[n] for n in group]
            if any(got(p) for p in params):
                for p in params:
                    if p.grad is None and p.requires_grad:
                        p.grad = torch.zeros_like(p)

    def snapshot_of(self, model: nn.Module, step: int, label: str) -> None:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
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
    reports = []
    for p, results in enumerate(parts):
        for r, result in enumerate(results):
            if result["reports"] != results[0]["reports"]:
                return Failure(f"part {p} rank {r} reports other units than rank 0: {result['reports']} vs {results[0]['reports']}")
        reports += results[0]["reports"]
    reference = ReferenceRun(case, reports)
    for _, _, groups in reports:
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
