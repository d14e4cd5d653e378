"""Every public FSDP1 import path works with ``torch.distributed.fsdp`` replaced by ``flatshard``.

The surface is read from torch itself: the ``__all__`` of ``torch.distributed.fsdp`` and of its
public FSDP1 modules (``sharded_grad_scaler`` has no ``__all__``: its public names are the ones it
defines). Each name must resolve under the same module path in flatshard to a working equivalent:
an enum with the same members, a dataclass with the same fields and defaults, a class with the
same public methods, functions accepting the same parameters. FSDP2's names, which torch 2.13
also exports from ``torch.distributed.fsdp``, are out of scope (flatshard is FSDP1).
"""

import dataclasses
import enum
import importlib
import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp._fully_shard as torch_fsdp2

from flatshard._engine._fsdp1_surface import SignedForward

ROOT = Path(__file__).resolve().parents[1]

FSDP1_MODULES = [
    "torch.distributed.fsdp",
    "torch.distributed.fsdp.fully_sharded_data_parallel",
    "torch.distributed.fsdp.api",
    "torch.distributed.fsdp.wrap",
    "torch.distributed.fsdp.sharded_grad_scaler",
]

# FSDP2 (``fully_shard``) names in ``torch.distributed.fsdp.__all__``: not FSDP1, not flatshard's.
FSDP2_OUT_OF_SCOPE = {
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "fully_shard",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "register_fsdp_forward_method",
    "UnshardHandle",
    "share_comm_ctx",
}


def _flatshard_path(torch_path):
    return torch_path.replace("torch.distributed.fsdp", "flatshard", 1)


def _public_names(module):
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return sorted(
        name for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
    )


def _surface():
    return [
        (path, name)
        for path in FSDP1_MODULES
        for name in _public_names(importlib.import_module(path))
        if not (path == "torch.distributed.fsdp" and name in FSDP2_OUT_OF_SCOPE)
    ]


def _comparable(value):
    if isinstance(value, enum.Enum):
        return (type(value).__name__, value.name)
    return value


def _comparable_default(value):
    """A default compared by value where that is meaningful (not e.g. a process group object)."""
    value = _comparable(value)
    if value is None or isinstance(value, (bool, int, float, str, tuple)):
        return value
    return "<object>"


def _check_signature(theirs, ours, where):
    """``ours`` accepts every call ``theirs`` accepts: the same parameter names in the same
    positions, optional where torch's are optional (with equal simple defaults), and nothing
    extra that is required."""
    t, o = inspect.signature(theirs).parameters, inspect.signature(ours).parameters
    o_kinds = {p.kind for p in o.values()}
    o_positional = [n for n, p in o.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    t_positional = [n for n, p in t.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if inspect.Parameter.VAR_POSITIONAL not in o_kinds:
        assert o_positional[: len(t_positional)] == t_positional, f"{where}: positional parameters {o_positional}, FSDP1's {t_positional}"
    for name, param in t.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            assert param.kind in o_kinds, f"{where}: FSDP1 accepts {param}, flatshard does not"
            continue
        if name not in o:
            assert inspect.Parameter.VAR_KEYWORD in o_kinds, f"{where}: no parameter {name!r}"
            continue
        if param.default is not param.empty:
            assert o[name].default is not param.empty, f"{where}: {name!r} is optional in FSDP1, required here"
            assert _comparable_default(o[name].default) == _comparable_default(param.default), f"{where}: default of {name!r}"
    for name, param in o.items():
        if name not in t and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            assert param.default is not param.empty, f"{where}: required parameter {name!r} that FSDP1 lacks"


def _own_members(theirs, ours):
    """FSDP1's public members (with ``__init__``/``__call__``) defined by classes of ``theirs``
    that ``ours`` does not simply inherit as well (nn.Module's or GradScaler's own methods)."""
    members = {}
    for klass in theirs.__mro__:
        if klass in ours.__mro__:
            break
        for name, value in vars(klass).items():
            if not name.startswith("_") or name in ("__init__", "__call__"):
                members.setdefault(name, value)
    return members


def _forwards_everything(function):
    kinds = [p.kind for p in inspect.signature(function).parameters.values()]
    return kinds == [inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]


def _check_class(theirs, ours, where):
    shared_base = next(k for k in theirs.__mro__ if k in ours.__mro__)
    for name, value in _own_members(theirs, ours).items():
        mine = inspect.getattr_static(ours, name, None)
        assert mine is not None, f"{where}.{name} is missing"
        if isinstance(mine, SignedForward):  # (the class's function, bound per wrapper with the wrapped module's signature)
            mine = mine.function
        assert type(mine) is type(value), f"{where}.{name}: a {type(value).__name__} in FSDP1, a {type(mine).__name__} here"
        if isinstance(value, property):
            continue
        reference = getattr(theirs, name)
        if _forwards_everything(reference) and hasattr(shared_base, name):
            # FSDP1's (self, *args, **kwargs) passes the call on to nn.Module's method.
            reference = getattr(shared_base, name)
        _check_signature(reference, getattr(ours, name), f"{where}.{name}")


def _fields(cls):
    return [
        (f.name, _comparable(f.default), f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        for f in dataclasses.fields(cls)
    ]


def _check_equivalent(theirs, ours, where):
    if not inspect.isclass(theirs):
        assert callable(theirs), where
        assert callable(ours) and not inspect.isclass(ours), f"{where}: a function in FSDP1, {ours!r} here"
        _check_signature(theirs, ours, where)
        return
    assert inspect.isclass(ours), f"{where}: a class in FSDP1, {ours!r} here"
    if issubclass(theirs, enum.Enum):
        assert issubclass(ours, enum.Enum), where
        assert [(m.name, m.value) for m in ours] == [(m.name, m.value) for m in theirs], where
    elif dataclasses.is_dataclass(theirs):
        assert dataclasses.is_dataclass(ours), where
        assert _fields(ours) == _fields(theirs), where
        assert [b.__name__ for b in ours.__mro__[1:-1]] == [b.__name__ for b in theirs.__mro__[1:-1]], where
    else:
        _check_class(theirs, ours, where)


def test_fsdp2_names_are_the_ones_torch_defines_in_fully_shard():
    fsdp2 = {n for n in torch_fsdp.__all__ if getattr(torch_fsdp2, n, None) is getattr(torch_fsdp, n)}
    assert fsdp2 == FSDP2_OUT_OF_SCOPE


def test_the_surface_is_fsdp1s():
    """A guard against walking nothing: the FSDP1 names this test expects to see in torch 2.13."""
    names = {name for _, name in _surface()}
    assert {"FullyShardedDataParallel", "ShardingStrategy", "OptimStateKeyType", "ModuleWrapPolicy", "wrap",
            "ShardedGradScaler", "StateDictSettings"} <= names


@pytest.mark.parametrize("torch_path,name", _surface(), ids=lambda v: v)
def test_fsdp1_name_resolves_under_flatshard(torch_path, name):
    path = _flatshard_path(torch_path)
    module = importlib.import_module(path)
    assert hasattr(module, name), f"{path}.{name} does not exist"
    if hasattr(importlib.import_module(torch_path), "__all__"):
        assert name in module.__all__, f"{name} is not in {path}.__all__"
    _check_equivalent(getattr(importlib.import_module(torch_path), name), getattr(module, name), f"{path}.{name}")


# Import spellings of FSDP1 code. Each runs in a fresh interpreter (module caching can hide a
# package attribute that shadows a submodule), first as written for torch, then with
# ``torch.distributed.fsdp`` replaced by ``flatshard``.
SPELLINGS = [
    "from torch.distributed.fsdp import wrap\nwrap.ModuleWrapPolicy; wrap.enable_wrap; wrap.size_based_auto_wrap_policy",
    "import torch.distributed.fsdp.wrap as W\nW.ModuleWrapPolicy; W.transformer_auto_wrap_policy",
    "from torch.distributed.fsdp.wrap import wrap, enable_wrap, ModuleWrapPolicy, _or_policy\n"
    "import torch\nm = torch.nn.Linear(2, 2)\nassert wrap(m) is m",
    "import torch.distributed.fsdp.wrap\nimport torch.distributed.fsdp\ntorch.distributed.fsdp.wrap.ModuleWrapPolicy",
    "import torch.distributed.fsdp as F\nF.wrap.CustomPolicy; F.api.ShardingStrategy; F.FullyShardedDataParallel",
    "from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel, OptimStateKeyType\n"
    "from torch.distributed.fsdp.fully_sharded_data_parallel import FullStateDictConfig, StateDictType, ShardingStrategy",
    "import torch.distributed.fsdp.fully_sharded_data_parallel as F\nF.FullyShardedDataParallel.state_dict_type",
    "from torch.distributed.fsdp.api import ShardingStrategy, MixedPrecision, StateDictSettings",
    "from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler",
    "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType",
]


def _swapped(code):
    return f"{code}\n# --- the same code, for flatshard:\n{code.replace('torch.distributed.fsdp', 'flatshard')}\n"


# [Note: spellings in forks] Each spelling must run in an interpreter that has imported neither
# flatshard nor torch.distributed.fsdp (what an import spelling sets up depends on what came
# before it). Starting an interpreter per spelling cost 2.5 s each, nearly all of it importing
# torch and its DTensor modules, which every spelling imports first anyway; so one interpreter
# imports those alone and runs each spelling in a child forked from it, checked to start
# without either package.
_FORKING_RUNNER = textwrap.dedent(
    """
    import json, os, sys, tempfile, traceback
    import torch
    import torch.distributed.tensor
    codes = json.load(sys.stdin)
    loaded = [m for m in sys.modules if m.split(".")[0] == "flatshard" or m.startswith("torch.distributed.fsdp")]
    if loaded:
        raise SystemExit(f"imported before the spellings: {loaded}")
    results = []
    for code in codes:
        with tempfile.TemporaryFile("w+") as err:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.dup2(err.fileno(), 2)
                try:
                    exec(compile(code, "<spelling>", "exec"), {"__name__": "__main__"})
                    status = 0
                except BaseException:
                    traceback.print_exc()
                    status = 1
                sys.stderr.flush()
                os._exit(status)
            _, waited = os.waitpid(pid, 0)
            err.seek(0)
            results.append([os.waitstatus_to_exitcode(waited), err.read()])
    print(json.dumps(results))
    """
)


def _in_forks(codes):
    """``[(exit code, stderr)]`` of each of ``codes``, each run in a fresh fork."""
    done = subprocess.run(
        [sys.executable, "-c", _FORKING_RUNNER], input=json.dumps(codes), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return [tuple(result) for result in json.loads(done.stdout.splitlines()[-1])]


@pytest.fixture(scope="module")
def spelling_outcomes():
    """``{code: (exit code, stderr)}`` of every spelling below."""
    codes = [_swapped(code) for code in SPELLINGS] + FLATSHARD_SPELLINGS
    return dict(zip(codes, _in_forks(codes)))


@pytest.mark.parametrize("code", SPELLINGS, ids=lambda c: c.splitlines()[0])
def test_import_spelling_works_with_the_package_name_swapped(code, spelling_outcomes):
    status, stderr = spelling_outcomes[_swapped(code)]
    assert status == 0, stderr


FLATSHARD_SPELLINGS = [
    # flatshard.plan is a subpackage and, called, the planner function (see [Note: callable modules]).
    "import flatshard, torch\np = flatshard.plan(torch.nn.Linear(2, 2), world_size=2, print_table=False)\n"
    "assert isinstance(p, flatshard.Plan) and p.units",
    "import flatshard.plan as P\nfrom flatshard.plan import Plan, plan\nassert P.Plan is Plan and P.plan is plan",
    "from flatshard import plan\nimport torch\nassert isinstance(plan(torch.nn.Linear(2, 2), print_table=False), plan.Plan)",
    "from flatshard import FlatParameter, FlatParamHandle, ShardedGradScaler, FullyShardedDataParallel\n"
    "import flatshard.sharded_grad_scaler as S\nassert S.ShardedGradScaler is ShardedGradScaler",
    # ``wrap`` keeps working as a function after ``from flatshard import wrap``.
    "from flatshard import enable_wrap, wrap\nimport torch\nm = torch.nn.Linear(2, 2)\n"
    "with enable_wrap(wrapper_cls=lambda module, **kw: (module, kw), x=1):\n    assert wrap(m, y=2) == (m, {'x': 1, 'y': 2})",
]


@pytest.mark.parametrize("code", FLATSHARD_SPELLINGS, ids=lambda c: c.splitlines()[0])
def test_flatshard_spelling(code, spelling_outcomes):
    status, stderr = spelling_outcomes[code]
    assert status == 0, stderr


def test_a_failing_spelling_fails_in_its_fork():
    # (the runner itself: a spelling that raises is reported with its traceback, and the next
    # fork starts without what the failed one imported)
    bad = "import flatshard\nraise ValueError('spelled wrong')"
    check = "import sys\nassert 'flatshard' not in sys.modules"
    (status, stderr), (next_status, next_stderr) = _in_forks([bad, check])
    assert status == 1 and "ValueError: spelled wrong" in stderr, stderr
    assert next_status == 0, next_stderr


def test_wrap_and_plan_are_the_submodules_and_callable():
    import flatshard
    import flatshard.plan
    import flatshard.wrap

    assert inspect.ismodule(flatshard.wrap) and flatshard.wrap.__name__ == "flatshard.wrap"
    assert inspect.ismodule(flatshard.plan) and flatshard.plan.__name__ == "flatshard.plan"
    assert inspect.signature(flatshard.plan) == inspect.signature(flatshard.plan.plan)
    assert inspect.signature(flatshard.wrap) == inspect.signature(flatshard.wrap.wrap)
