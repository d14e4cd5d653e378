"""Optimizer state: full and sharded optimizer state dicts per original parameter, save and
resume at any world size, plain-model and torch FSDP1 interchange, errors.

Truth is single-process training of the unwrapped model with the same optimizer on the global
batch. The global batch has 12 rows at every world size, so runs at different world sizes
train on the same data."""

import os
import shutil
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.fsdp as torch_fsdp
from expecttest import TestCase

from flatshard._comm._collectives import broadcast_object
from flatshard import FullStateDictConfig, ModuleWrapPolicy, OptimStateKeyType, ShardedDataParallel, StateDictType
from tests._memory import track_allocations
from tests._models import Block, batch, build, error_text, guarded_comm, lm_loss, step_on_global_batch

GLOBAL_ROWS = 12
OPTIMIZERS = {
    "Adam": lambda groups: torch.optim.Adam(groups, lr=1e-2),
    "AdamW": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.05),
    "SGD": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9),
    "Adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.05),
}
FORMS = ("full", "sharded")
K = 2
TOL = dict(rtol=1e-5, atol=1e-6)


def _wrapped(seed=0, orig=False, **options):
    return ShardedDataParallel(build(seed, **options), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=orig)


def _groups(named):
    """Two param groups: the blocks (own learning rate) and the rest, each in model order."""
    named = [(n.replace("_fsdp_wrapped_module.", ""), p) for n, p in named]
    blocks = [p for n, p in named if n.startswith("blocks.")]
    rest = [p for n, p in named if not n.startswith("blocks.")]
    return [{"params": rest}, {"params": blocks, "lr": 0.02}]


def _step(model, optim, step, rank=None, world_size=1):
    step_on_global_batch(model, optim, step, rank, world_size, rows=GLOBAL_ROWS)


def _reference(name, steps, **model_options):
    plain = build(0, **model_options)
    optim = OPTIMIZERS[name](_groups(plain.named_parameters()))
    for step in range(steps):
        _step(plain, optim, step)
    return plain, optim


def _assert_params(model, plain, where):
    with ShardedDataParallel.summon_full_params(model):
        actual = {name: param.detach().clone() for name, param in model.named_parameters()}
    for name, expected in plain.named_parameters():
        torch.testing.assert_close(actual[name], expected, **TOL, msg=lambda m: f"{where}: {name}: {m}")


def _assert_full_osd(actual, expected, where):
    if list(actual["state"]) != list(expected["state"]):
        raise AssertionError(f"{where}: state keys {list(actual['state'])} vs {list(expected['state'])}")
    for name, state in expected["state"].items():
        if list(actual["state"][name]) != list(state):
            raise AssertionError(f"{where}: {name}: state names {list(actual['state'][name])} vs {list(state)}")
        for key, value in state.items():
            torch.testing.assert_close(actual["state"][name][key], value, **TOL, msg=lambda m: f"{where}: {name}.{key}: {m}")
    if actual["param_groups"] != expected["param_groups"]:
        raise AssertionError(f"{where}: param groups {actual['param_groups']} vs {expected['param_groups']}")


def _save(rank, world_size, directory, orig=False):
    """Train K steps with every optimizer, compare the full optimizer state with the plain
    optimizer's, and save model + optimizer in both forms (``orig``: use_orig_params)."""
    for name in OPTIMIZERS:
        model = _wrapped(orig=orig)
        optim = OPTIMIZERS[name](_groups(model.named_parameters()))
        for step in range(K):
            _step(model, optim, step, rank, world_size)
        full_osd = ShardedDataParallel.full_optim_state_dict(model, optim)
        config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with ShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            full_sd = model.state_dict()
        if rank == 0:
            plain, plain_optim = _reference(name, K)
            expected = ShardedDataParallel.rekey_optim_state_dict(plain_optim.state_dict(), OptimStateKeyType.PARAM_NAME, plain, optim=plain_optim)
            _assert_full_osd(full_osd, expected, f"{name} at world size {world_size}")
            torch.save({"model": full_sd, "optim": full_osd}, os.path.join(directory, f"{name}-full-{world_size}.pt"))
        else:
            assert full_osd == {} and full_sd == {}, "rank0_only"
        with ShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "optim": ShardedDataParallel.optim_state_dict(model, optim)}
            dcp.save(state, checkpoint_id=os.path.join(directory, f"{name}-sharded-{world_size}"))
    dist.barrier()
    return True


def _resume(rank, world_size, directory, saved_at, orig=False):
    """Load each checkpoint into a fresh model and optimizer, train K more steps: the same
    weights as 2K uninterrupted single-process steps."""
    for name in OPTIMIZERS:
        for form in FORMS:
            model = _wrapped(seed=7, orig=orig)
            optim = OPTIMIZERS[name](_groups(model.named_parameters()))
            if form == "full":
                checkpoint = torch.load(os.path.join(directory, f"{name}-full-{saved_at}.pt"), weights_only=False) if rank == 0 else None
                model.load_state_dict(_broadcast_model(checkpoint, model))
                optim.load_state_dict(
                    ShardedDataParallel.scatter_full_optim_state_dict(checkpoint["optim"] if rank == 0 else None, model, optim=optim)
                )
            else:
                with ShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                    before = len(optim.state)  # (Adagrad makes its state in its constructor)
                    state = {"model": model.state_dict(), "optim": ShardedDataParallel.optim_state_dict(model, optim)}
                    if len(optim.state) != before or len(state["optim"]["state"]) != 21:
                        raise AssertionError("the template must be complete and leave the optimizer as it was")
                    dcp.load(state, checkpoint_id=os.path.join(directory, f"{name}-sharded-{saved_at}"))
                    model.load_state_dict(state["model"])
                    optim.load_state_dict(ShardedDataParallel.optim_state_dict_to_load(model, optim, state["optim"]))
            for step in range(K, 2 * K):
                _step(model, optim, step, rank, world_size)
            plain, _ = _reference(name, 2 * K)
            _assert_params(model, plain, f"{name}, {form}, saved at {saved_at}, resumed at {world_size}")
    return True


def _broadcast_model(checkpoint, model):
    """The full model state dict on every rank (torch.save'd by rank 0)."""
    return broadcast_object(checkpoint["model"] if checkpoint is not None else None, guarded_comm())


def _plain_interchange(rank, world_size):
    """A plain optimizer's state (rekeyed to names) loads into the wrapped model, and the
    wrapped model's full state (rekeyed to IDs) into a plain optimizer; both continue like
    uninterrupted training. A parameter that never had a gradient has no plain state and is
    zero-filled (Adam without weight decay, so zero moments are exact)."""
    options = dict(unused=True)
    plain = build(0, **options)
    plain_optim = torch.optim.Adam(_groups(plain.named_parameters()), lr=1e-2)
    for step in range(K):
        _step(plain, plain_optim, step)
    named = ShardedDataParallel.rekey_optim_state_dict(plain_optim.state_dict(), OptimStateKeyType.PARAM_NAME, plain, optim=plain_optim)
    model = _wrapped(seed=3, **options)
    optim = torch.optim.Adam(_groups(model.named_parameters()), lr=1e-2)
    model.load_state_dict(plain.state_dict())
    optim.load_state_dict(ShardedDataParallel.shard_full_optim_state_dict(named, model, optim=optim))
    back = ShardedDataParallel.full_optim_state_dict(model, optim, rank0_only=False)
    plain_state = {k: v.clone() for k, v in plain.state_dict().items()}
    for step in range(K, 2 * K):
        _step(model, optim, step, rank, world_size)
        _step(plain, plain_optim, step)
    _assert_params(model, plain, "plain -> wrapped")
    other = build(5, **options)
    other_optim = torch.optim.Adam(_groups(other.named_parameters()), lr=1e-2)
    other.load_state_dict(plain_state)
    other_optim.load_state_dict(ShardedDataParallel.rekey_optim_state_dict(back, OptimStateKeyType.PARAM_ID, other, optim=other_optim))
    for step in range(K, 2 * K):
        _step(other, other_optim, step)
    for (name, expected), (_, actual) in zip(plain.named_parameters(), other.named_parameters()):
        torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"wrapped -> plain: {name}: {m}")
    return sorted(named["state"]), sorted(back["state"])


def _rekey_wrapped(rank, world_size, orig):
    """Lightning's full optimizer checkpoint: ``optim_state_dict`` rekeyed to IDs with the
    wrapped model (no optimizer given: the model's parameters), then back to names, loads and
    trains on like uninterrupted training. With original parameters the IDs are the plain
    optimizer's, so the dict also loads into a plain optimizer on the plain model."""
    model = _wrapped(orig=orig)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    plain = build(0)
    plain_optim = torch.optim.Adam(plain.parameters(), lr=1e-2)
    for step in range(K):
        _step(model, optim, step, rank, world_size)
        _step(plain, plain_optim, step)
    with ShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        named = ShardedDataParallel.optim_state_dict(model, optim)
    by_id = ShardedDataParallel.rekey_optim_state_dict(named, OptimStateKeyType.PARAM_ID, model)
    back = ShardedDataParallel.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, model)
    # The IDs are a plain optimizer's (the root unit's parameters come first in flattening order,
    # not in the model): the plain optimizer's own dict names the same parameters either way.
    plain_ids = plain_optim.state_dict()
    plain_names = ShardedDataParallel.rekey_optim_state_dict(plain_ids, OptimStateKeyType.PARAM_NAME, plain, optim=plain_optim)
    wrapped_names = ShardedDataParallel.rekey_optim_state_dict(plain_ids, OptimStateKeyType.PARAM_NAME, model)
    assert list(wrapped_names["state"]) == list(plain_names["state"]), (list(wrapped_names["state"]), list(plain_names["state"]))
    assert all(wrapped_names["state"][n] is plain_names["state"][n] for n in plain_names["state"])
    assert sorted(by_id["state"]) == sorted(plain_ids["state"])
    for pid, state in by_id["state"].items():
        torch.testing.assert_close(state["exp_avg"], plain_ids["state"][pid]["exp_avg"], **TOL)
    assert sorted(back["state"]) == sorted(named["state"]) and sorted(back["param_groups"][0]["params"]) == sorted(named["param_groups"][0]["params"])
    fresh = _wrapped(seed=4, orig=orig)
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    with ShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full = model.state_dict()
    with ShardedDataParallel.state_dict_type(fresh, StateDictType.FULL_STATE_DICT):
        fresh.load_state_dict(full)
        fresh_optim.load_state_dict(ShardedDataParallel.optim_state_dict_to_load(fresh, fresh_optim, back))
    if orig:
        other = build(5)
        other.load_state_dict(plain.state_dict())
        other_optim = torch.optim.Adam(other.parameters(), lr=1e-2)
        other_optim.load_state_dict(by_id)
    for step in range(K, 2 * K):
        _step(fresh, fresh_optim, step, rank, world_size)
        _step(plain, plain_optim, step)
        if orig:
            _step(other, other_optim, step)
    _assert_params(fresh, plain, "rekeyed with the wrapped model")
    if orig:
        for (name, expected), (_, actual) in zip(plain.named_parameters(), other.named_parameters()):
            torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"by ID into a plain optimizer: {name}: {m}")
    return len(by_id["state"]), sorted(by_id["state"])[:3]


def _errors(rank, world_size):
    model = _wrapped()
    optim = torch.optim.Adam(_groups(model.named_parameters()), lr=1e-2)
    _step(model, optim, 0, rank, world_size)
    good = ShardedDataParallel.full_optim_state_dict(model, optim, rank0_only=False)
    messages = []

    def expect(make):
        osd = make({"state": {k: dict(v) for k, v in good["state"].items()}, "param_groups": [dict(g) for g in good["param_groups"]]})
        try:
            ShardedDataParallel.shard_full_optim_state_dict(osd, model, optim=optim)
            messages.append("no error")
        except ValueError as exc:
            messages.append(str(exc))

    def unknown(osd):
        osd["state"]["blocks.7.fc1.weight"] = osd["state"]["blocks.0.fc1.weight"]
        return osd

    def missing(osd):
        osd["param_groups"][1]["params"] = [n for n in osd["param_groups"][1]["params"] if n != "blocks.1.fc2.bias"]
        return osd

    def shape(osd):
        osd["state"]["blocks.0.fc1.bias"]["exp_avg"] = torch.zeros(3)
        return osd

    def names(osd):
        osd["state"]["blocks.0.fc1.bias"] = {"step": osd["state"]["blocks.0.fc1.bias"]["step"], "momentum_buffer": torch.zeros(16)}
        return osd

    def steps(osd):  # one step count per FlatParameter
        osd["state"]["blocks.2.norm.weight"]["step"] = torch.tensor(5.0)
        return osd

    def step_dtype(osd):  # the same count, another dtype
        osd["state"]["blocks.2.fc2.bias"]["step"] = osd["state"]["blocks.2.fc2.bias"]["step"].double()
        return osd

    def group_count(osd):
        osd["param_groups"] = osd["param_groups"][:1]
        return osd

    for make in (unknown, missing, shape, names, steps, step_dtype, group_count):
        expect(make)
    for call in (
        lambda: ShardedDataParallel.full_optim_state_dict(model, "optim"),
        lambda: ShardedDataParallel.shard_full_optim_state_dict([1], model, optim=optim),
        lambda: ShardedDataParallel.rekey_optim_state_dict({"state": {"nope.weight": {}}, "param_groups": [{"params": ["nope.weight"]}]}, OptimStateKeyType.PARAM_ID, model, optim=optim),
        lambda: ShardedDataParallel.optim_state_dict_to_load(model, optim, good, is_named_optimizer=True),
    ):
        try:
            call()
            messages.append("no error")
        except (TypeError, ValueError, NotImplementedError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
    return messages


def _unsupported(rank, world_size):
    """What the optimizer state-dict methods refuse, each with NotImplementedError."""
    model = _wrapped()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    _step(model, optim, 0, rank, world_size)
    messages = []

    def expect(call):
        try:
            call()
            messages.append("no error")
        except NotImplementedError as exc:
            messages.append(str(exc))

    expect(lambda: ShardedDataParallel.full_optim_state_dict(model, optim, optim_input=list(model.parameters())))
    with ShardedDataParallel.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        expect(lambda: ShardedDataParallel.optim_state_dict(model, optim))
    return messages


def _disagreeing_ranks(rank, world_size):
    """Rank 1's optimizer never stepped block 0 (its gradient was dropped there), so the ranks
    hold different state: gathering it is an error on every rank, not a hang."""
    model = _wrapped()
    optim = torch.optim.Adam(_groups(model.named_parameters()), lr=1e-2)
    tokens, targets = batch(0, 1, per_rank=GLOBAL_ROWS)
    lm_loss(model(tokens), targets).backward()
    if rank == 1:
        model.module.blocks[0].zero_grad(set_to_none=True)
    optim.step()
    try:
        ShardedDataParallel.full_optim_state_dict(model, optim)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def _split_group(rank, world_size):
    """A saved dict whose param groups split the originals of one FlatParameter."""
    model = _wrapped()
    optim = torch.optim.Adam(_groups(model.named_parameters()), lr=1e-2)
    _step(model, optim, 0, rank, world_size)
    osd = ShardedDataParallel.full_optim_state_dict(model, optim, rank0_only=False)
    rest, blocks = osd["param_groups"]
    blocks["params"].remove("blocks.0.fc1.weight")
    rest["params"].append("blocks.0.fc1.weight")
    try:
        ShardedDataParallel.shard_full_optim_state_dict(osd, model, optim=optim)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _step_skipping(model, optim, step, skipped, rank=None, world_size=1):
    """``_step``, except that the parameters named in ``skipped`` get no gradient: the
    optimizer does not step them (a user freezing them for this step)."""
    tokens, targets = batch(step, 1, per_rank=GLOBAL_ROWS)
    if rank is not None:
        mine = GLOBAL_ROWS // world_size
        tokens, targets = tokens[rank * mine : (rank + 1) * mine], targets[rank * mine : (rank + 1) * mine]
    lm_loss(model(tokens), targets).backward()
    for name, param in model.named_parameters():
        if name.replace("_fsdp_wrapped_module.", "") in skipped:
            param.grad = None
    optim.step()
    optim.zero_grad()


def _stepped_apart(rank, world_size, skipped):
    """A use_orig_params=True model and AdamW after K steps, the parameters ``skipped`` left
    out of the first: (model, optimizer, full and sharded optimizer state dicts)."""
    model = _wrapped(orig=True)
    optim = OPTIMIZERS["AdamW"](_groups(model.named_parameters()))
    _step_skipping(model, optim, 0, skipped, rank, world_size)
    for step in range(1, K):
        _step(model, optim, step, rank, world_size)
    full = ShardedDataParallel.full_optim_state_dict(model, optim, rank0_only=False)
    with ShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = ShardedDataParallel.optim_state_dict(model, optim)
    return model, optim, full, sharded


def _differing_steps_refused(rank, world_size):
    """AdamW state of a use_orig_params=True model in which 'blocks.0.fc1.weight' missed the
    first step (step 1, the others of its FlatParameter 2) loads into a model without
    original parameters -- one optimizer parameter, one step count per FlatParameter -- by
    none of the three loaders: each raises on every rank."""
    _, _, full, sharded = _stepped_apart(rank, world_size, {"blocks.0.fc1.weight"})
    if full["state"]["blocks.0.fc1.weight"]["step"].item() != K - 1 or full["state"]["blocks.0.fc1.bias"]["step"].item() != K:
        raise AssertionError("the skipped parameter must have counted one step fewer")
    target = _wrapped(seed=3)
    target_optim = OPTIMIZERS["AdamW"](_groups(target.named_parameters()))
    messages = [
        error_text(lambda: ShardedDataParallel.shard_full_optim_state_dict(full, target, optim=target_optim), ValueError),
        error_text(lambda: ShardedDataParallel.scatter_full_optim_state_dict(full if rank == 0 else None, target, optim=target_optim), ValueError),
    ]
    with ShardedDataParallel.state_dict_type(target, StateDictType.SHARDED_STATE_DICT):
        messages.append(error_text(lambda: ShardedDataParallel.optim_state_dict_to_load(target, target_optim, sharded), ValueError))
    if target_optim.state:
        raise AssertionError("a refused load must leave the optimizer as it was")
    return messages


def _equal_steps_load(rank, world_size):
    """As above, but block 1 misses the first step as a whole: step counts differ between
    FlatParameters, not within one. Both forms load into a model without original
    parameters and continue like single-process training that skipped block 1 the same way."""
    skipped = {name for name, _ in build(0).named_parameters() if name.startswith("blocks.1.")}
    source, _, full, sharded = _stepped_apart(rank, world_size, skipped)
    model_state = source.state_dict()
    plain = build(0)
    plain_optim = OPTIMIZERS["AdamW"](_groups(plain.named_parameters()))
    _step_skipping(plain, plain_optim, 0, skipped)
    for step in range(1, 2 * K):
        _step(plain, plain_optim, step)
    steps = {}
    for form, osd in (("full", full), ("sharded", sharded)):
        model = _wrapped(seed=7)
        optim = OPTIMIZERS["AdamW"](_groups(model.named_parameters()))
        model.load_state_dict(model_state)
        if form == "full":
            optim.load_state_dict(ShardedDataParallel.shard_full_optim_state_dict(osd, model, optim=optim))
        else:
            with ShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                optim.load_state_dict(ShardedDataParallel.optim_state_dict_to_load(model, optim, osd))
        steps[form] = sorted({state["step"].item() for state in optim.state.values()})
        for step in range(K, 2 * K):
            _step(model, optim, step, rank, world_size)
        _assert_params(model, plain, f"{form}, use_orig_params=True -> False")
    return steps


def _fsdp1(seed, orig=False):
    return torch_fsdp.FullyShardedDataParallel(
        build(seed), auto_wrap_policy=torch_fsdp.wrap.ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
        use_orig_params=orig,
    )


def _fsdp1_interchange(rank, world_size, orig=False):
    """Full optimizer state dicts of torch FSDP1 load into flatshard and vice versa; both
    continue like uninterrupted single-process training (AdamW, two groups)."""
    warnings.filterwarnings("ignore")
    make = OPTIMIZERS["AdamW"]
    results = []
    # (With use_orig_params=True, torch FSDP1's full optimizer state dicts on CPU hold
    # exp_avg_sq's values under exp_avg as well, so only flatshard -> FSDP1 can be checked.)
    for source_kind in ("fsdp1", "flatshard") if not orig else ("flatshard",):
        source = _fsdp1(0, orig) if source_kind == "fsdp1" else _wrapped(0, orig)
        source_optim = make(_groups(source.named_parameters()))
        for step in range(K):
            _step(source, source_optim, step, rank, world_size)
        if source_kind == "fsdp1":
            config = torch_fsdp.FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
            with torch_fsdp.FullyShardedDataParallel.state_dict_type(source, torch_fsdp.StateDictType.FULL_STATE_DICT, config):
                model_state = source.state_dict()
            osd = torch_fsdp.FullyShardedDataParallel.full_optim_state_dict(source, source_optim, rank0_only=False)
            target = _wrapped(4, orig)
            target_optim = make(_groups(target.named_parameters()))
            target.load_state_dict(model_state)
            target_optim.load_state_dict(ShardedDataParallel.shard_full_optim_state_dict(osd, target, optim=target_optim))
        else:
            model_state = source.state_dict()
            osd = ShardedDataParallel.full_optim_state_dict(source, source_optim, rank0_only=False)
            target = _fsdp1(4, orig)
            target_optim = make(_groups(target.named_parameters()))
            config = torch_fsdp.FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
            with torch_fsdp.FullyShardedDataParallel.state_dict_type(target, torch_fsdp.StateDictType.FULL_STATE_DICT, config):
                target.load_state_dict(model_state)
            target_optim.load_state_dict(torch_fsdp.FullyShardedDataParallel.shard_full_optim_state_dict(osd, target, optim=target_optim))
        for step in range(K, 2 * K):
            _step(target, target_optim, step, rank, world_size)
        plain, _ = _reference("AdamW", 2 * K)
        if source_kind == "fsdp1":
            _assert_params(target, plain, "FSDP1 -> flatshard")
        else:
            with torch_fsdp.FullyShardedDataParallel.summon_full_params(target):
                actual = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in target.named_parameters()}
            for name, expected in plain.named_parameters():
                torch.testing.assert_close(actual[name], expected, **TOL, msg=lambda m: f"flatshard -> FSDP1: {name}: {m}")
        results.append(f"{source_kind}: {len(osd['state'])} parameters with state")
    return results


def _memory(rank, world_size):
    """Peak bytes while building a rank-0-only full optimizer state dict (Adam: two positional
    states per FlatParameter), the output's bytes, and one unit's full optimizer state."""
    model = _wrapped()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    _step(model, optim, 0, rank, world_size)
    units = ShardedDataParallel.fsdp_modules(model)
    largest = max(sum(2 * h.padded_numel * h.flat_param.element_size() for h in unit.handles) for unit in units)
    with track_allocations() as tracker:
        osd = ShardedDataParallel.full_optim_state_dict(model, optim)
        output = sum(v.untyped_storage().nbytes() for state in osd.get("state", {}).values() for v in state.values())
    return tracker.peak_bytes, output, largest


class _ScalarFirst(torch.nn.Module):
    """A 0-dim parameter first in its FlatParameter (its state looks like step counts)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(1.5))
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * self.scale


def _unusual_state(rank, world_size):
    """NAdam/ASGD scalar state with a 0-dim parameter first; a plain Adagrad whose unused
    parameter kept step 0 loads into the wrapped model and continues like the plain one."""
    torch.manual_seed(0)
    out = {}
    for make in (torch.optim.NAdam, torch.optim.ASGD):
        model = ShardedDataParallel(_ScalarFirst())
        optim = make(model.parameters(), lr=1e-2)
        model(torch.randn(3, 4)).sum().backward()
        optim.step()
        full = ShardedDataParallel.full_optim_state_dict(model, optim, rank0_only=False)
        optim.load_state_dict(ShardedDataParallel.shard_full_optim_state_dict(full, model, optim=optim))
        again = ShardedDataParallel.full_optim_state_dict(model, optim, rank0_only=False)
        _assert_full_osd(again, full, make.__name__)
        out[make.__name__] = sorted(full["state"]["scale"])
    plain = build(0, unused=True)
    plain_optim = torch.optim.Adagrad(_groups(plain.named_parameters()), lr=0.05)
    for step in range(K):
        _step(plain, plain_optim, step)
    named = ShardedDataParallel.rekey_optim_state_dict(plain_optim.state_dict(), OptimStateKeyType.PARAM_NAME, plain, optim=plain_optim)
    model = _wrapped(seed=3, unused=True)
    optim = torch.optim.Adagrad(_groups(model.named_parameters()), lr=0.05)
    model.load_state_dict(plain.state_dict())
    optim.load_state_dict(ShardedDataParallel.shard_full_optim_state_dict(named, model, optim=optim))
    for step in range(K, 2 * K):
        _step(model, optim, step, rank, world_size)
        _step(plain, plain_optim, step)
    _assert_params(model, plain, "Adagrad, plain -> wrapped")
    return out


class OptimStateTest(TestCase):
    def setUp(self):
        self.directory = tempfile.mkdtemp(prefix="flatshard-optim-")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def test_resume_full_and_sharded_at_the_same_and_other_world_sizes(self):
        """Every optimizer and form: saved at 2 ranks, resumed at 2, 3, 4; saved at 3, resumed at 1."""
        self.pool.run(_save, 2, self.directory)
        self.pool.run(_save, 3, self.directory)
        for saved_at, world_size in ((2, 2), (2, 3), (2, 4), (3, 1)):
            with self.subTest(saved_at=saved_at, world_size=world_size):
                self.pool.run(_resume, world_size, self.directory, saved_at)

    def test_resume_with_original_parameters(self):
        """use_orig_params=True: saved at 2 ranks, resumed at 2 and 3 (optimizer state per
        original parameter, each a piece of a shard); saved at 3, resumed at 1."""
        self.pool.run(_save, 2, self.directory, True)
        self.pool.run(_save, 3, self.directory, True)
        for saved_at, world_size in ((2, 2), (2, 3), (3, 1)):
            with self.subTest(saved_at=saved_at, world_size=world_size):
                self.pool.run(_resume, world_size, self.directory, saved_at, True)

    def test_resume_across_modes(self):
        """Checkpoints saved without original parameters load with them and vice versa."""
        self.pool.run(_save, 2, self.directory, False)
        self.pool.run(_resume, 3, self.directory, 2, True)
        self.pool.run(_save, 2, self.directory, True)
        self.pool.run(_resume, 2, self.directory, 2, False)

    def test_plain_optimizer_state_interchange_and_zero_fill(self):
        named, back = self.pool.run(_plain_interchange, 2)[0]
        self.assertNotIn("unused_param", named)  # the plain optimizer never stepped it
        self.assertEqual(sorted(named + ["unused_param"]), back)  # zero-filled in its FlatParameter

    def test_rekey_with_the_wrapped_model_round_trips_and_trains_on(self):
        for orig in (False, True):
            with self.subTest(use_orig_params=orig):
                count, first = self.pool.run(_rekey_wrapped, 2, orig)[0]
                self.assertEqual((count, first), (21, [0, 1, 2]))

    def test_fsdp1_full_optimizer_state_dicts_interchange(self):
        results = self.pool.run(_fsdp1_interchange, 2)
        self.assertEqual(results[0], ["fsdp1: 21 parameters with state", "flatshard: 21 parameters with state"])

    def test_fsdp1_full_optimizer_state_dicts_interchange_with_original_parameters(self):
        results = self.pool.run(_fsdp1_interchange, 2, True)
        self.assertEqual(results[0], ["flatshard: 21 parameters with state"])

    def test_rank0_full_dict_holds_at_most_one_units_state_beyond_the_output(self):
        (peak0, output0, largest), (peak1, output1, _) = self.pool.run(_memory, 2)
        self.assertEqual(output1, 0)
        self.assertGreater(output0, largest)
        self.assertLessEqual(peak0, output0 + largest)
        self.assertLessEqual(peak1, largest)

    def test_scalar_state_of_0_dim_parameters_and_differing_step_counts(self):
        out = self.pool.run(_unusual_state, 2)[0]
        self.assertEqual(out, {"NAdam": ["exp_avg", "exp_avg_sq", "mu_product", "step"], "ASGD": ["ax", "eta", "mu", "step"]})

    def test_optim_input_and_local_state_dicts_are_not_implemented(self):
        messages = self.pool.run(_unsupported, 1)[0]
        self.assertExpectedInline("\n".join(messages), """\
optim_input (FSDP1's deprecated alternative to optim) is not supported here; pass optim
optim_state_dict under StateDictType.LOCAL_STATE_DICT is not supported; use FULL or SHARDED""")

    def test_ranks_with_different_optimizer_state_fail_together(self):
        for rank, message in enumerate(self.pool.run(_disagreeing_ranks, 2, timeout=60)):
            self.assertEqual(
                message,
                f"[rank {rank}] the ranks' optimizers hold different state (every rank must step the same parameters): "
                "rank 0 has [blocks.0.norm.weight: exp_avg, exp_avg_sq, step], rank 1 has [blocks.0.norm.weight: no state]",
            )

    def test_originals_of_one_flat_parameter_in_two_saved_groups_are_refused(self):
        self.assertExpectedInline(self.pool.run(_split_group, 1)[0], """param group 1 of the optimizer holds parameters of the state dict's groups 1 and 0 (e.g. 'blocks.0.fc1.weight'); parameters of one FlatParameter or optimizer group must share a group""")

    def test_differing_step_counts_within_one_flat_parameter_are_refused(self):
        """(FSDP1 refuses the same: one optimizer parameter has one step count.)"""
        results = self.pool.run(_differing_steps_refused, 2, timeout=120)
        refusal = (
            "the original parameters of the FlatParameter of unit 'blocks.0' must have optimizer state "
            "'step' with the same value and dtype, but 'blocks.0.norm.weight', 'blocks.0.norm.bias', "
            "'blocks.0.fc1.bias', ... (5 in all) have 2.0 (torch.float32) and 'blocks.0.fc1.weight' has "
            "1.0 (torch.float32); without use_orig_params the optimizer steps them as one parameter "
            "(load this state into a model wrapped with use_orig_params=True to keep them apart)"
        )
        for rank, messages in enumerate(results):
            self.assertEqual(
                messages,
                [refusal, f"[rank {rank}] scatter_full_optim_state_dict: ValueError: {refusal}", refusal],
            )

    def test_equal_step_counts_within_each_flat_parameter_load_and_train_on(self):
        steps = self.pool.run(_equal_steps_load, 2, timeout=120)[0]
        self.assertEqual(steps, {"full": [K - 1, K], "sharded": [K - 1, K]})

    def test_errors_name_the_parameters(self):
        messages = self.pool.run(_errors, 2)[0]
        self.assertExpectedInline("\n".join(messages), """\
the optimizer state dict has state for parameters the model does not have: 'blocks.7.fc1.weight'
parameter 'blocks.1.fc2.bias' is in the optimizer but in none of the state dict's param groups
optimizer state 'exp_avg' of parameter 'blocks.0.fc1.bias' has shape (3,); the parameter has shape (16,)
parameters 'blocks.0.norm.weight' and 'blocks.0.fc1.bias' share a FlatParameter but have different optimizer states: ['exp_avg', 'exp_avg_sq', 'step'] vs ['momentum_buffer', 'step']
the original parameters of the FlatParameter of unit 'blocks.2' must have optimizer state 'step' with the same value and dtype, but 'blocks.2.norm.weight' has 5.0 (torch.float32) and 'blocks.2.norm.bias', 'blocks.2.fc1.weight', 'blocks.2.fc1.bias', ... (5 in all) have 1.0 (torch.float32); without use_orig_params the optimizer steps them as one parameter (load this state into a model wrapped with use_orig_params=True to keep them apart)
the original parameters of the FlatParameter of unit 'blocks.2' must have optimizer state 'step' with the same value and dtype, but 'blocks.2.norm.weight', 'blocks.2.norm.bias', 'blocks.2.fc1.weight', ... (5 in all) have 1.0 (torch.float32) and 'blocks.2.fc2.bias' has 1.0 (torch.float64); without use_orig_params the optimizer steps them as one parameter (load this state into a model wrapped with use_orig_params=True to keep them apart)
the optimizer has 2 param groups but the state dict has 1
TypeError: optim must be a torch.optim.Optimizer; got str
ValueError: shard_full_optim_state_dict: expected an optimizer state dict with 'state' and 'param_groups'; got list
ValueError: rekey_optim_state_dict: the state dict names a parameter the model's optimizer does not have: 'nope.weight'
NotImplementedError: optim_state_dict_to_load(is_named_optimizer=True) is not supported""")


def _templates_are_no_steps(rank, world_size):
    """Under ``use_orig_params`` rank 0's shard holds none of ``bias``: after a step only rank 1
    has state for it, so only rank 0 makes a template for a sharded optimizer state dict. A template
    is no step: neither the optimizer's hooks nor flatshard's step count see it (the ranks'
    counts would differ, and the next forward would raise)."""
    torch.manual_seed(0)
    model = ShardedDataParallel(torch.nn.Linear(4, 4), use_orig_params=True)  # (weight 16 + bias 4: rank 0 holds weight[:10])
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    hooked = []
    optim.register_step_post_hook(lambda *args: hooked.append("post"))
    losses = []
    for step in range(3):
        loss = model(torch.ones(2, 4) * (rank + step)).square().sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(float(loss))
        if step == 0:
            held = sorted(n for n, p in model.named_parameters() if optim.state.get(p))
            with ShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                ShardedDataParallel.optim_state_dict(model, optim)  # (sharded: templates)
    return held, len(hooked), len(losses)


class TemplatesAreNoStepsTest(TestCase):
    def test_a_template_made_on_one_rank_only_is_no_step(self):
        held = self.pool.run(_templates_are_no_steps, 2)
        self.assertEqual(held, [(["weight"], 3, 3), (["bias", "weight"], 3, 3)])


NEVER_STEPPED_OPTIMIZERS = {
    "Adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "SGD": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),  # (dampening 0: docs/limitations.md)
    "Adagrad": lambda params: torch.optim.Adagrad(params, lr=0.05, initial_accumulator_value=0.1),
}


def _never_stepped_entries_load(rank, world_size, kind, orig):
    """A sharded optimizer state dict of a fresh optimizer (every entry a template) loaded after
    one step. Under ``use_orig_params`` rank 0 holds no element of ``bias`` and so no state for
    it, rank 1 does: every rank must load alike (the entries are gathered: a collective). The
    next step is a fresh optimizer's, as in single-process training (where loading a fresh
    optimizer's state dict leaves Adam and SGD without state, and Adagrad with its built
    state)."""
    make = NEVER_STEPPED_OPTIMIZERS[kind]
    x = torch.arange(8.0).reshape(2, 4) / 8

    def step(model, optim):
        model(x).square().sum().backward()
        optim.step()
        optim.zero_grad()

    torch.manual_seed(0)
    plain = torch.nn.Linear(4, 4)
    torch.manual_seed(0)
    model = ShardedDataParallel(torch.nn.Linear(4, 4), use_orig_params=orig)
    optim = make(model.parameters())
    with ShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        fresh = ShardedDataParallel.optim_state_dict(model, optim)
        step(model, optim)
        optim.load_state_dict(ShardedDataParallel.optim_state_dict_to_load(model, optim, fresh))
    held = len(optim.state)  # (Adam: none, as torch leaves it; SGD: zero buffers, see the Note)
    step(model, optim)
    for _ in range(2):  # (the reference: a fresh optimizer for the second step)
        step(plain, make(plain.parameters()))
    with ShardedDataParallel.summon_full_params(model):
        same = {n: bool(torch.allclose(p, dict(plain.named_parameters())[n], **TOL)) for n, p in model.module.named_parameters()}
    return same, held


class NeverSteppedEntriesTest(TestCase):
    def test_they_load_alike_on_every_rank_and_as_a_fresh_optimizer(self):
        for kind in NEVER_STEPPED_OPTIMIZERS:
            for orig in (True, False):
                with self.subTest(kind=kind, orig=orig):
                    for same, held in self.pool.run(_never_stepped_entries_load, 2, kind, orig):
                        self.assertEqual(same, {"weight": True, "bias": True})
                        if kind == "Adam":
                            self.assertEqual(held, 0)
