"""Model state dicts: FULL, SHARDED (torch.distributed.checkpoint, any world size) and LOCAL;
state-dict types; their errors."""

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from expecttest import TestCase
from torch import nn

from flatshard import (
    FullStateDictConfig,
    LocalStateDictConfig,
    ModuleWrapPolicy,
    ShardedDataParallel,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from tests._memory import track_allocations
from tests._models import RTOL, ATOL, Block, batch, build, full_params, lm_loss, local, wrap

FULL, SHARDED, LOCAL = StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT
KINDS = ["nested", "auto", "frozen"]


def _model(kind, seed=0, **options):
    """``nested``: a unit per block, the tied embedding/head in the root; ``auto``: auto-wrapped
    blocks and embedding (the tie goes to the root); ``frozen``: one unit with a frozen block
    (two FlatParameters)."""
    if kind == "auto":
        return ShardedDataParallel(build(seed), auto_wrap_policy=ModuleWrapPolicy({Block, nn.Embedding}), **options)
    if kind == "frozen":
        return wrap(build(seed, frozen_blocks=(1,)), "single", **options)
    return wrap(build(seed), kind, **options)


def _perturb_buffer(model, seed):
    with torch.no_grad():
        model.module.pos.add_(0.25 * (seed + 1))


def _same(a, b):
    """Bit-exact equality of two state-dict values."""
    if hasattr(a, "local_shards"):  # (torch.equal on ShardedTensors needs an accelerator)
        shards_a, shards_b = a.local_shards(), b.local_shards()
        return (
            type(a) is type(b) and a.metadata() == b.metadata() and len(shards_a) == len(shards_b)
            and all(x.metadata == y.metadata and torch.equal(x.tensor, y.tensor) for x, y in zip(shards_a, shards_b))
        )
    if hasattr(a, "to_local"):
        return type(a) is type(b) and a.placements == b.placements and a.shape == b.shape and torch.equal(a.to_local(), b.to_local())
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _assert_same_dict(expected, actual, where):
    if list(actual) != list(expected):
        raise AssertionError(f"{where}: keys differ: {list(actual)} vs {list(expected)}")
    for key in expected:
        if not _same(expected[key], actual[key]):
            raise AssertionError(f"{where}: values of {key} differ: {actual[key]} vs {expected[key]}")


def _round_trips(rank, world_size):
    """Every type and model kind, with every sharding strategy for the nested kind."""
    checked = []
    cases = [(kind, ShardingStrategy.FULL_SHARD) for kind in KINDS]
    cases += [("nested", ShardingStrategy.SHARD_GRAD_OP), ("nested", ShardingStrategy.NO_SHARD)]
    for kind, strategy in cases:
        for kind_of_dict in (FULL, SHARDED, LOCAL):
            source = _model(kind, 0, sharding_strategy=strategy)
            _perturb_buffer(source, 0)
            fresh = _model(kind, 1, sharding_strategy=strategy)
            with ShardedDataParallel.state_dict_type(source, kind_of_dict):
                saved = source.state_dict()
            with ShardedDataParallel.state_dict_type(fresh, kind_of_dict):
                fresh.load_state_dict(saved)
                again = fresh.state_dict()
            where = f"{kind}/{strategy.name}/{kind_of_dict.name}/world {world_size}"
            _assert_same_dict(saved, again, where)
            expected, actual = full_params(source), full_params(fresh)
            for name in expected:
                if not torch.equal(expected[name], actual[name]):
                    raise AssertionError(f"{where}: {name} differs after loading")
            if not torch.equal(source.module.pos, fresh.module.pos):
                raise AssertionError(f"{where}: the buffer was not loaded")
            checked.append(where)
    return checked


def _full_matches_plain_model(rank, world_size):
    """FULL keys, order and values are the unwrapped model's; the dict loads into a plain
    model with strict=True, which then computes what the wrapped model computes."""
    reports = {}
    for kind in KINDS:
        plain = build(frozen_blocks=(1,)) if kind == "frozen" else build()
        model = _model(kind)
        _train(model, rank, world_size, 0, 2, torch.optim.SGD(model.parameters(), lr=0.1))
        config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with ShardedDataParallel.state_dict_type(model, FULL, config):
            saved = model.state_dict()
        tokens, _ = batch(7, world_size)
        model.eval()
        with torch.no_grad():
            wrapped_out = model(tokens)
        if rank != 0:
            reports[kind] = saved
            continue
        if list(saved) != list(plain.state_dict()):
            raise AssertionError(f"{kind}: keys {list(saved)} vs {list(plain.state_dict())}")
        plain.load_state_dict(saved, strict=True)
        plain.eval()
        with torch.no_grad():
            torch.testing.assert_close(plain(tokens), wrapped_out, rtol=0, atol=0)
        reports[kind] = saved["head.weight"].data_ptr() == saved["embed.weight"].data_ptr()
    return reports


def _train(model, rank, world_size, start, stop, optim):
    for step in range(start, stop):
        tokens, targets = batch(step, world_size)
        lm_loss(model(local(tokens, rank)), local(targets, rank)).backward()
        optim.step()
        optim.zero_grad()


def _resume(rank, world_size, form, directory, k=2):
    """Train k steps, save, load into a fresh model in a fresh process group, train k more:
    the same weights as 2k uninterrupted steps (SGD without momentum has no optimizer state)."""
    uninterrupted = _model("auto", 0)
    _train(uninterrupted, rank, world_size, 0, 2 * k, torch.optim.SGD(uninterrupted.parameters(), lr=0.1))
    expected = full_params(uninterrupted)
    first = _model("auto", 0)
    _train(first, rank, world_size, 0, k, torch.optim.SGD(first.parameters(), lr=0.1))
    path = os.path.join(directory, form)
    if form == "full":
        with ShardedDataParallel.state_dict_type(first, FULL, FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            state = first.state_dict()
        if rank == 0:
            torch.save(state, path)
    else:
        with ShardedDataParallel.state_dict_type(first, SHARDED):
            dcp.save(first.state_dict(), checkpoint_id=path)
    dist.barrier()
    del first
    group = dist.new_group(list(range(world_size)))
    second = _model("auto", 5, process_group=group)
    if form == "full":
        second.load_state_dict(torch.load(path, weights_only=True))
    else:
        with ShardedDataParallel.state_dict_type(second, SHARDED):
            state = second.state_dict()
            dcp.load(state, checkpoint_id=path)
            second.load_state_dict(state)
    _train(second, rank, world_size, k, 2 * k, torch.optim.SGD(second.parameters(), lr=0.1))
    actual = full_params(second)
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{form}: {name}: {m}")
    return sorted(expected)


def _dcp_save(rank, world_size, kind, path):
    model = _model(kind, 0)
    _perturb_buffer(model, 3)
    _train(model, rank, world_size, 0, 1, torch.optim.SGD(model.parameters(), lr=0.1))
    with ShardedDataParallel.state_dict_type(model, SHARDED):
        dcp.save(model.state_dict(), checkpoint_id=path)
    return {k: v.clone() for k, v in model.state_dict().items()}  # FULL, for comparing


def _dcp_load(rank, world_size, kind, path, expected):
    model = _model(kind, 9)
    with ShardedDataParallel.state_dict_type(model, SHARDED):
        state = model.state_dict()
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state)
    _assert_same_dict(expected, model.state_dict(), f"{kind} at world size {world_size}")
    return True


def _full_memory(rank, world_size):
    """Peak bytes while gathering a FULL rank0_only + offload state dict."""
    model = _model("nested", 0)  # build(): dim 8 is tiny; memory is about proportions
    handles = [h for m in ShardedDataParallel.fsdp_modules(model) for h in m.handles]
    largest_unit = max(sum(h.padded_numel * h.flat_param.element_size() for h in m.handles) for m in ShardedDataParallel.fsdp_modules(model))
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with ShardedDataParallel.state_dict_type(model, FULL, config):
        with track_allocations() as tracker:
            for h in handles:
                tracker.watch(h._full_data)
            state = model.state_dict()
            output = sum({v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for v in state.values()}.values())
            param_output = sum(
                {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for k, v in state.items() if k != "pos"}.values()
            )
    return tracker.peak_bytes, param_output, output, largest_unit, len(state)


def _mid_iteration_and_parts(rank, world_size):
    """A state dict between forward and backward (the root unit is still gathered) leaves the
    iteration intact; a nested unit's state dict has its module's keys; keep_vars gives
    Parameters."""
    plain, model = build(), _model("nested")
    tokens, targets = batch(0, world_size)
    loss = lm_loss(model(local(tokens, rank)), local(targets, rank))
    saved = model.state_dict()
    loss.backward()
    plain_loss = lm_loss(plain(tokens), targets)
    plain_loss.backward()
    for name, param in plain.named_parameters():
        if not torch.equal(saved[name], param.detach()):
            raise AssertionError(f"{name} differs from the plain model's")
    grads = {n: p.grad.clone() for n, p in plain.named_parameters()}
    with ShardedDataParallel.summon_full_params(model, with_grads=True):
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, grads[name], rtol=RTOL, atol=ATOL)
    block = model.blocks[0].state_dict(keep_vars=True)
    return list(block), {type(v).__name__ for v in block.values()}, block["fc1.weight"].requires_grad


def _settings_and_errors(rank, world_size):
    model = _model("nested")
    out = {}
    default = ShardedDataParallel.get_state_dict_type(model)
    out["default"] = (default.state_dict_type.name, type(default.state_dict_config).__name__, type(default.optim_state_dict_config).__name__)
    previous = ShardedDataParallel.set_state_dict_type(model, SHARDED, ShardedStateDictConfig(offload_to_cpu=True))
    out["previous"] = previous.state_dict_type.name
    now = ShardedDataParallel.get_state_dict_type(model.blocks[0])
    out["now"] = (now.state_dict_type.name, now.state_dict_config.offload_to_cpu, type(now.optim_state_dict_config).__name__)
    with ShardedDataParallel.state_dict_type(model, LOCAL):
        out["inside"] = ShardedDataParallel.get_state_dict_type(model).state_dict_type.name
    out["restored"] = ShardedDataParallel.get_state_dict_type(model).state_dict_type.name
    errors = []

    def expect(fn):
        try:
            fn()
            errors.append("no error")
        except (TypeError, ValueError, RuntimeError, NotImplementedError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    expect(lambda: ShardedDataParallel.set_state_dict_type(model, FULL, ShardedStateDictConfig()))
    expect(lambda: ShardedDataParallel.set_state_dict_type(model, SHARDED, None, ShardedStateDictConfig()))
    expect(lambda: ShardedDataParallel.set_state_dict_type(model, "full"))
    ShardedDataParallel.set_state_dict_type(model.blocks[0], LOCAL, LocalStateDictConfig())
    expect(lambda: ShardedDataParallel.get_state_dict_type(model))
    expect(lambda: ShardedDataParallel.get_state_dict_type(nn.Linear(2, 2)))
    ShardedDataParallel.set_state_dict_type(model, FULL)
    full = model.state_dict()
    expect(lambda: model.load_state_dict(full, assign=True))
    expect(lambda: model.load_state_dict([1, 2]))
    missing = {k: v for k, v in full.items() if k not in ("blocks.1.fc1.weight", "pos")}
    expect(lambda: model.load_state_dict({**missing, "blocks.9.fc1.weight": torch.zeros(2)}))
    result = model.load_state_dict({**missing, "extra": torch.zeros(1)}, strict=False)
    out["non_strict"] = (result.missing_keys, result.unexpected_keys)
    expect(lambda: model.load_state_dict({**full, "blocks.0.fc1.weight": torch.zeros(16, 3), "head.weight": torch.zeros(2)}))
    outer = nn.Sequential(model)  # (loading through a plain parent: torch's key reports, prefixed)
    result = outer.load_state_dict({**{"0." + k: v for k, v in missing.items()}, "0.extra": torch.zeros(1)}, strict=False)
    out["outer_non_strict"] = (result.missing_keys, result.unexpected_keys)
    expect(lambda: outer.load_state_dict({"0." + k: v for k, v in missing.items()}))
    out["outer_keys"] = list(outer.state_dict())[:2]
    with ShardedDataParallel.summon_full_params(model):
        expect(lambda: model.state_dict())
    out["errors"] = errors
    return out


def _local_mismatch(rank, world_size, directory):
    """Loading a LOCAL state dict anywhere but where it was saved is refused: by torch when
    it unpickles another rank's ShardedTensors, by the layout record, and -- in a dict
    rebuilt by hand, which has lost the record -- by what the values say."""
    model = _model("nested")
    with ShardedDataParallel.state_dict_type(model, LOCAL):
        mine = model.state_dict()
        torch.save(mine, os.path.join(directory, f"local-{world_size}-{rank}"))
        dist.barrier()
        if world_size == 2:  # another rank's shards; a unit's shard under another unit's key
            swapped = {**mine, "_flat_param": mine["blocks.0._flat_param"]}
            sources = [lambda: torch.load(os.path.join(directory, f"local-2-{1 - rank}"), weights_only=False), lambda: swapped]
        else:  # saved at world size 2, loaded at 1
            sources = [lambda: torch.load(os.path.join(directory, "local-2-0"), weights_only=False)]
        errors = []
        for source in sources:
            try:
                model.load_state_dict(source())
                errors.append("no error")
            except RuntimeError as exc:
                errors.append(str(exc))
        return errors


def _divergent_load(rank, world_size):
    """Rank 1 passes a plain tensor where rank 0 passes a DTensor (gathering it would hang),
    then a value of the wrong shape that only rank 1's load rejects."""
    model = _model("nested")
    errors = []
    for kind_of_dict, key, value in ((SHARDED, "blocks.0.fc1.bias", torch.zeros(16)), (FULL, "norm.bias", torch.zeros(3))):
        with ShardedDataParallel.state_dict_type(model, kind_of_dict):
            state = model.state_dict()
            if rank == 1:
                state[key] = value
            try:
                model.load_state_dict(state)
                errors.append("no error")
            except (ValueError, RuntimeError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
    return errors


def _sharded_value_types(rank, world_size):
    """Type names of the values of sharded model and optimizer state dicts, with
    ``_use_dtensor`` (FSDP1's switch between ShardedTensor and DTensor) off and on."""
    model = _model("nested")
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, rank, world_size, 0, 1, optim)
    buffers = {name for name, _ in model.module.named_buffers()}
    types = {}
    for use_dtensor in (False, True):
        config = ShardedStateDictConfig(_use_dtensor=use_dtensor)
        with ShardedDataParallel.state_dict_type(model, SHARDED, config):
            state = model.state_dict()
            osd = ShardedDataParallel.optim_state_dict(model, optim)
        types[use_dtensor] = (
            {type(v).__name__ for k, v in state.items() if k not in buffers},
            {type(v).__name__ for k, v in state.items() if k in buffers},
            {type(v).__name__ for s in osd["state"].values() for k, v in s.items() if k != "step"},
        )
    return types


class RoundTripTest(TestCase):
    def test_every_type_round_trips_bit_exactly_at_world_sizes_1_to_4(self):
        for world_size in (1, 2, 3, 4):
            with self.subTest(world_size=world_size):
                results = self.pool.run(_round_trips, world_size)
                self.assertEqual(len(results[0]), 3 * 5)

    def test_full_state_dict_is_the_plain_models_and_loads_into_it(self):
        reports = self.pool.run(_full_matches_plain_model, 2)
        self.assertEqual(reports[0], {"nested": True, "auto": True, "frozen": True})  # ties alias, as in torch
        self.assertEqual(reports[1], {"nested": {}, "auto": {}, "frozen": {}})  # rank0_only

    def test_sharded_values_are_always_dtensors(self):
        for types in self.pool.run(_sharded_value_types, 2):
            # parameters and optimizer state: DTensor parts; buffers: the rank's full copy
            expected = ({"DTensor"}, {"Tensor"}, {"DTensor"})
            self.assertEqual(types, {False: expected, True: expected})


class ResumeTest(TestCase):
    def setUp(self):
        self.directory = tempfile.mkdtemp(prefix="flatshard-ckpt-")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def test_resume_from_full_and_sharded_checkpoints_equals_uninterrupted_training(self):
        for form in ("full", "sharded"):
            with self.subTest(form=form):
                self.pool.run(_resume, 2, form, self.directory)

    def test_sharded_checkpoint_saved_on_2_ranks_loads_on_1_3_and_4(self):
        for kind in ("nested", "auto"):
            path = os.path.join(self.directory, kind)
            expected = self.pool.run(_dcp_save, 2, kind, path)[0]
            for world_size in (1, 3, 4):
                with self.subTest(kind=kind, world_size=world_size):
                    self.assertEqual(self.pool.run(_dcp_load, world_size, kind, path, expected), [True] * world_size)

    def test_local_state_dict_refuses_another_rank_or_world_size(self):
        two = self.pool.run(_local_mismatch, 2, self.directory)
        one = self.pool.run(_local_mismatch, 1, self.directory)
        self.assertExpectedInline(
            "\n".join(two[0] + one[0]),
            """\
Local rank at save time was 1, but at load time was 0
LOCAL_STATE_DICT: flat shard '_flat_param' is part of a flat parameter of 296 elements; this one has 120; to change the world size, save and load a SHARDED_STATE_DICT (or FULL_STATE_DICT) instead
Local world size at save time was 2, but at load time was 1""",
        )


class MemoryTest(TestCase):
    def test_rank0_only_offload_holds_at_most_one_unit_beyond_the_output(self):
        (peak0, params0, output0, unit, count0), (peak1, _, output1, _, count1) = self.pool.run(_full_memory, 2)
        self.assertEqual((count0, count1, output1), (23, 0, 0))  # 21 parameters, the tie, the buffer
        self.assertGreater(params0, 0)
        self.assertLessEqual(peak0, params0 + unit)  # the buffer is the model's own, not a copy
        self.assertGreaterEqual(peak0, params0)
        self.assertLessEqual(peak1, unit)


class _TiedToOwnUnit(nn.Module):
    """The head is its own unit (auto-wrapped) but its weight is tied to the embedding, so the
    root flattens the tie while the head's unit flattens its bias."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 7)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mid(self.embed(tokens))))


class _OldFormat(nn.Module):
    """Accepts an old checkpoint format through a load pre-hook (the weight stored transposed)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.lin._register_load_state_dict_pre_hook(self._convert)

    @staticmethod
    def _convert(state_dict, prefix, *args):
        if prefix + "w_t" in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "w_t").t()

    def forward(self, x):
        return self.lin(x)


def _unusual_models(rank, world_size):
    torch.manual_seed(0)
    plain = _TiedToOwnUnit()
    torch.manual_seed(1)
    model = ShardedDataParallel(_TiedToOwnUnit(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    keys = list(model.state_dict())
    model.load_state_dict(plain.state_dict())
    tokens = torch.tensor([[1, 2, 3]])
    with ShardedDataParallel.summon_full_params(model), torch.no_grad():
        torch.testing.assert_close(model(tokens), plain(tokens), rtol=0, atol=0)
    old = ShardedDataParallel(_OldFormat())
    old.load_state_dict({"lin.w_t": torch.full((3, 4), 7.0), "lin.bias": torch.ones(4)})
    loaded = old.state_dict()
    return keys, list(plain.state_dict()), loaded["lin.weight"].unique().tolist(), loaded["lin.bias"].tolist()


def _mixed_settings(rank, world_size):
    model = _model("nested")
    ShardedDataParallel.set_state_dict_type(model.blocks[0], LOCAL)
    with ShardedDataParallel.state_dict_type(model, SHARDED):
        inside = {m._unit.state_dict_settings.state_dict_type.name for m in ShardedDataParallel.fsdp_modules(model)}
    after = [m._unit.state_dict_settings.state_dict_type.name for m in ShardedDataParallel.fsdp_modules(model)]
    ShardedDataParallel.set_state_dict_type(model, FULL if rank == 0 else SHARDED)
    try:
        model.state_dict()
        error = "no error"
    except RuntimeError as exc:
        error = str(exc)
    return inside, after, error


class UnusualModelsTest(TestCase):
    def test_a_tie_into_a_unit_keeps_that_units_other_parameters_and_load_hooks_apply(self):
        keys, plain_keys, weight_values, bias = self.pool.run(_unusual_models, 2)[0]
        self.assertEqual(keys, plain_keys)
        self.assertEqual((weight_values, bias), ([7.0], [1.0] * 4))

    def test_settings_restore_per_unit_and_ranks_with_different_types_fail(self):
        for rank, (inside, after, error) in enumerate(self.pool.run(_mixed_settings, 2)):
            self.assertEqual(inside, {"SHARDED_STATE_DICT"})
            self.assertEqual(after, ["FULL_STATE_DICT", "LOCAL_STATE_DICT", "FULL_STATE_DICT", "FULL_STATE_DICT"])
            self.assertEqual(
                error,
                f"[rank {rank}] state_dict() is collective, but the ranks called it differently: rank 0 has "
                "StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=False, rank0_only=False), "
                "rank 1 has StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=False, _use_dtensor=False)",
            )


class MidIterationTest(TestCase):
    def test_state_dict_between_forward_and_backward_and_of_a_nested_unit(self):
        keys, types, requires_grad = self.pool.run(_mid_iteration_and_parts, 2)[0]
        self.assertEqual(keys, ["norm.weight", "norm.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"])
        self.assertEqual((types, requires_grad), ({"Parameter"}, True))


class SettingsAndErrorsTest(TestCase):
    def test_state_dict_type_settings_and_errors(self):
        out = self.pool.run(_settings_and_errors, 1)[0]
        self.assertEqual(out["default"], ("FULL_STATE_DICT", "FullStateDictConfig", "FullOptimStateDictConfig"))
        self.assertEqual(out["previous"], "FULL_STATE_DICT")
        self.assertEqual(out["now"], ("SHARDED_STATE_DICT", True, "ShardedOptimStateDictConfig"))
        self.assertEqual((out["inside"], out["restored"]), ("LOCAL_STATE_DICT", "SHARDED_STATE_DICT"))
        self.assertEqual(out["non_strict"], (["pos", "blocks.1.fc1.weight"], ["extra"]))
        self.assertEqual(out["outer_keys"], ["0.pos", "0.embed.weight"])
        self.assertEqual(out["outer_non_strict"], (["0.pos", "0.blocks.1.fc1.weight"], ["0.extra"]))
        self.assertExpectedInline(
            "\n".join(out["errors"]),
            """\
ConfigTypeError: Expected state_dict_config of type FullStateDictConfig for StateDictType.FULL_STATE_DICT; got ShardedStateDictConfig
ConfigTypeError: Expected optim_state_dict_config of type ShardedOptimStateDictConfig for StateDictType.SHARDED_STATE_DICT; got ShardedStateDictConfig
TypeError: state_dict_type must be one of StateDictType.FULL_STATE_DICT, StateDictType.LOCAL_STATE_DICT, StateDictType.SHARDED_STATE_DICT; got 'full'
ValueError: the ShardedDataParallel units under ShardedDataParallel have different state-dict settings: the root module has StateDictSettings(state_dict_type=<StateDictType.SHARDED_STATE_DICT: 3>, state_dict_config=ShardedStateDictConfig(offload_to_cpu=True, _use_dtensor=False), optim_state_dict_config=ShardedOptimStateDictConfig(offload_to_cpu=True, _use_dtensor=False)), 'blocks.0' has StateDictSettings(state_dict_type=<StateDictType.LOCAL_STATE_DICT: 2>, state_dict_config=LocalStateDictConfig(offload_to_cpu=False), optim_state_dict_config=LocalOptimStateDictConfig(offload_to_cpu=False)); use set_state_dict_type on the whole model
ValueError: get_state_dict_type: Linear contains no ShardedDataParallel module
NotImplementedError: load_state_dict(assign=True) is not supported: the values are copied into the shards
TypeError: load_state_dict: state_dict must be a mapping (e.g. a dict); got list
RuntimeError: Error(s) in loading state_dict for TinyLM:
	Missing key(s) in state_dict: "pos", "blocks.1.fc1.weight". 
	Unexpected key(s) in state_dict: "blocks.9.fc1.weight". 
RuntimeError: Error(s) in loading state_dict for TinyLM:
	size mismatch for blocks.0.fc1.weight: copying a param with shape torch.Size([16, 3]) from checkpoint, the shape in current model is torch.Size([16, 8]).
	size mismatch for head.weight: copying a param with shape torch.Size([2]) from checkpoint, the shape in current model is torch.Size([13, 8]).
RuntimeError: Error(s) in loading state_dict for Sequential:
	Missing key(s) in state_dict: "0.pos", "0.blocks.1.fc1.weight". 
WrongStateError: [rank 0] unit the root module: state_dict() cannot be used inside summon_full_params (the unit's full parameters are already summoned)""",
        )

    def test_ranks_loading_different_state_dicts_fail_together(self):
        results = self.pool.run(_divergent_load, 2)
        self.assertExpectedInline("\n".join(results[0] + results[1]), """\
ValueError: [rank 0] load_state_dict: the ranks passed different state dicts (every rank must pass the same keys, types and shapes): entry #5 is 'blocks.0.fc1.bias: DTensor (16,)' on rank 0 but 'blocks.0.fc1.bias: Tensor (16,)' on rank 1
RuntimeError: [rank 0] load_state_dict failed on rank 1:
Error(s) in loading state_dict for TinyLM:
	size mismatch for norm.bias: copying a param with shape torch.Size([3]) from checkpoint, the shape in current model is torch.Size([8]).
ValueError: [rank 1] load_state_dict: the ranks passed different state dicts (every rank must pass the same keys, types and shapes): entry #5 is 'blocks.0.fc1.bias: DTensor (16,)' on rank 0 but 'blocks.0.fc1.bias: Tensor (16,)' on rank 1
RuntimeError: Error(s) in loading state_dict for TinyLM:
	size mismatch for norm.bias: copying a param with shape torch.Size([3]) from checkpoint, the shape in current model is torch.Size([8]).""")
