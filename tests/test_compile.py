"""torch.compile on sharded models, and forwards that raise.

A wrapped model compiled with ``torch.compile(model)`` or ``model.compile()``, and a model whose
blocks were compiled before wrapping, train like single-process (uncompiled) training: dynamo
compiles the modules' own code and leaves flatshard's runtime out of its graphs (see [Note:
torch.compile] in ``flatshard/_engine/_forward.py``). A forward that raises -- user code in the middle of
a unit, or a compiler failing -- leaves the model usable: the next steps train as if it had
never run. Compiling is slow, so the models are tiny, runs are three steps, most cases use the
``aot_eager`` backend (dynamo and AOT autograd without code generation) and one uses inductor.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from expecttest import TestCase
from torch import nn

from flatshard import ModuleWrapPolicy, ShardedDataParallel, ShardingStrategy
from flatshard._base._common import TrainingState
from tests._models import (
    Block,
    assert_same_training,
    batch,
    build,
    full_params,
    global_mean,
    lm_loss,
    local,
    make_optim,
    train_reference,
)

STEPS = 3
# How a case compiles: the wrapped model with torch.compile(model) or model.compile(), each
# block (the units' modules) with block.compile() before wrapping, or a training step that runs
# forward and backward (dynamo runs the backward, and so the runtime's hooks, with its frame
# hook installed).
HOW = ["torch.compile", "module.compile", "blocks", "step"]


class TripBlock(Block):
    """A ``Block`` whose forward raises halfway (between its two linear layers) while
    ``armed``: user code failing in the middle of a unit. (An attribute of the module, so a
    compiled forward sees it change.)"""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.fc1(self.norm(x)))
        if self.armed:
            raise ValueError("tripwire")
        return x + self.fc2(hidden)


def _wrapped(strategy: str, how: str = "none", backend: Any = "aot_eager", trip: bool = False, orig: bool = False) -> Tuple[ShardedDataParallel, Any]:
    """``build()``'s model with a unit per block (the root holds the tied embedding and
    head), and what to call it through: compiled as ``how`` says, or the model itself.
    ``trip``: the middle block (of three) is a ``TripBlock`` with the same parameters."""
    model = build()
    if trip:
        middle = TripBlock()
        middle.load_state_dict(model.blocks[1].state_dict())
        model.blocks[1] = middle
    if how == "blocks":
        for block in model.blocks:
            block.compile(backend=backend)
    wrapped = ShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy[strategy], use_orig_params=orig
    )
    if how == "torch.compile":
        return wrapped, torch.compile(wrapped, backend=backend)
    if how == "module.compile":
        wrapped.compile(backend=backend)
    return wrapped, wrapped


def _forward_backward(run: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = lm_loss(run(tokens), targets)
    loss.backward()
    return loss.detach()


def _step(run: Any, optim: torch.optim.Optimizer, step: int, rank: int, world_size: int, forward_backward: Any = _forward_backward) -> float:
    tokens, targets = (local(t, rank) for t in batch(step, world_size))
    optim.zero_grad()
    loss = forward_backward(run, tokens, targets)
    optim.step()
    return global_mean(loss)


def _all_idle(model: ShardedDataParallel) -> bool:
    return all(m.training_state is TrainingState.IDLE for m in ShardedDataParallel.fsdp_modules(model))


@contextlib.contextmanager
def _fresh_dynamo() -> Any:
    """Rank processes live for the whole session: each case starts and leaves with no
    compiled code, and inductor compiles in the rank process (no compile workers)."""
    import torch._dynamo
    import torch._inductor.config

    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(compile_threads=1):
            yield
    finally:
        torch._dynamo.reset()


# -- rank functions ---------------------------------------------------------------------------


def _compiled_parity(rank: int, world_size: int, how: str, strategy: str, backend: str, orig: bool = False) -> bool:
    reference = train_reference(world_size, steps=STEPS)
    with _fresh_dynamo():
        model, run = _wrapped(strategy, how, backend, orig=orig)
        compiled_step = torch.compile(_forward_backward, backend=backend) if how == "step" else _forward_backward
        optim = make_optim(model.parameters())
        losses = [_step(run, optim, step, rank, world_size, compiled_step) for step in range(STEPS)]
    assert_same_training(reference, (losses, full_params(model)))
    return True


def _raise_then_train(rank: int, world_size: int, strategy: str, how: str, orig: bool = False) -> List[bool]:
    """Before step 0 (the model's first forward) and before step 1 a forward raises in the
    middle unit; training goes on. Returns whether every unit was IDLE after each raise."""
    reference = train_reference(world_size, steps=STEPS)
    idle: List[bool] = []
    with _fresh_dynamo() if how != "none" else contextlib.nullcontext():
        model, run = _wrapped(strategy, how, trip=True, orig=orig)
        middle = model.module.blocks[1].module
        optim = make_optim(model.parameters())
        losses = []
        for step in range(STEPS):
            if step < 2:
                tokens = local(batch(step, world_size)[0], rank)
                middle.armed = True
                with pytest.raises(ValueError, match="tripwire"):
                    run(tokens)
                middle.armed = False
                idle.append(_all_idle(model))
            losses.append(_step(run, optim, step, rank, world_size))
    assert_same_training(reference, (losses, full_params(model)))
    return idle


class FailingBackend:
    """A dynamo backend that fails on every graph it is given. (The root's forward has started
    when the first graph, of the first block's unit, is compiled: the root unit is gathered.)"""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.graphs += 1
        raise RuntimeError("this backend compiles nothing")


def _compile_failure_then_eager(rank: int, world_size: int, strategy: str) -> bool:
    """The first forward, compiled by a backend that fails, raises; the model then trains
    eagerly like single-process training."""
    reference = train_reference(world_size, steps=STEPS)
    with _fresh_dynamo():
        backend = FailingBackend()
        model, run = _wrapped(strategy, "torch.compile", backend=backend)
        tokens = local(batch(0, world_size)[0], rank)
        with pytest.raises(Exception, match="this backend compiles nothing"):
            run(tokens)
        if backend.graphs != 1 or not _all_idle(model):
            raise AssertionError(f"{backend.graphs} graphs compiled; units left out of IDLE: {not _all_idle(model)}")
        optim = make_optim(model.parameters())
        losses = [_step(model, optim, step, rank, world_size) for step in range(STEPS)]
    assert_same_training(reference, (losses, full_params(model)))
    return True


def _inductor_unavailable() -> Optional[str]:
    """Why inductor cannot compile for the CPU here (``None`` if it can): it needs the C++
    compiler it would look up itself (``torch._inductor.config.cpp.cxx``, ``CXX``)."""
    from torch._inductor import cpp_builder, exc

    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler as error:
        return f"inductor finds no working C++ compiler ({error})"
    return None


# -- tests ------------------------------------------------------------------------------------


class CompileTest(TestCase):
    def test_compiled_model_trains_like_single_process(self) -> None:
        for how in HOW:
            for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
                with self.subTest(how=how, strategy=strategy):
                    self.assertEqual(self.pool.run(_compiled_parity, 2, how, strategy, "aot_eager"), [True, True])

    def test_inductor_compiled_model_trains_like_single_process(self) -> None:
        reason = _inductor_unavailable()
        if reason is not None:
            self.skipTest(reason)
        self.assertEqual(self.pool.run(_compiled_parity, 2, "torch.compile", "FULL_SHARD", "inductor"), [True, True])

    def test_compiled_model_with_original_parameters(self) -> None:
        for how, backend in (("torch.compile", "aot_eager"), ("blocks", "aot_eager")) + (
            (("torch.compile", "inductor"),) if _inductor_unavailable() is None else ()
        ):
            with self.subTest(how=how, backend=backend):
                self.assertEqual(self.pool.run(_compiled_parity, 2, how, "FULL_SHARD", backend, True), [True, True])
        self.assertEqual(self.pool.run(_raise_then_train, 2, "FULL_SHARD", "torch.compile", True), [[True, True]] * 2)


class ForwardExceptionTest(TestCase):
    def test_exception_in_a_middle_unit_leaves_the_model_training_like_single_process(self) -> None:
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
            with self.subTest(strategy=strategy):
                self.assertEqual(self.pool.run(_raise_then_train, 2, strategy, "none"), [[True, True]] * 2)

    def test_exception_in_a_compiled_middle_unit_leaves_the_model_training(self) -> None:
        self.assertEqual(self.pool.run(_raise_then_train, 2, "FULL_SHARD", "torch.compile"), [[True, True]] * 2)

    def test_failed_compile_then_eager_training_like_single_process(self) -> None:
        self.assertEqual(self.pool.run(_compile_failure_then_eager, 2, "FULL_SHARD"), [True, True])
