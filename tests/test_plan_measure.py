"""``python -m flatshard.plan ... --measure`` and ``flatshard.plan(measure=True)``: one rank of a
world of N measured on torch's fake process group, and its predictions for another N held to
within 10% of a measurement there ([Note: measuring a plan] in ``flatshard/plan/_measure.py``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Tuple

import pytest
import torch
from expecttest import TestCase

ROOT = Path(__file__).resolve().parents[1]
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_PHASES = ("forward peak", "backward peak", "optimizer step peak", "between steps")


def _measure(world: int, *extra: str) -> str:
    cmd = [
        sys.executable, "-m", "flatshard.plan", "tests._scale_run:Decoder", "--world-size", str(world),
        "--transformer-layer", "tests._scale_run:Block", "--measure", "--input", "tests._scale_run:example_tokens",
        "--loss", "tests._scale_run:lm_loss", *extra,
    ]
    out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * _UNITS[unit]


def _measured(out: str) -> Dict[str, Tuple[str, float]]:
    """phase -> (planned column, measured bytes) of the measurement table."""
    rows = {}
    for line in out.splitlines():
        m = re.match(r"  (\w[\w ]*?)\s{2,}(\S+(?: \S+)?)\s+(\d+(?:\.\d+)? \w+)$", line)
        if m:
            rows[m.group(1).strip()] = (m.group(2), _bytes(m.group(3)))
    return rows


def _predicted(out: str, world: int) -> Dict[str, float]:
    line = next(l for l in out.splitlines() if re.match(rf"\s+{world}\s", l))
    values = re.findall(r"(\d+(?:\.\d+)? (?:B|KiB|MiB|GiB))", line)
    return dict(zip(("parameter shards",) + _PHASES, (_bytes(v) for v in values)))


@pytest.fixture(scope="module")
def measured() -> Dict[int, str]:
    return {8: _measure(8, "--at", "64"), 64: _measure(64)}


def test_the_measurement_sets_each_phase_beside_the_planners_numbers(measured):
    out = measured[8]
    assert "measured: rank 7 of 8 on torch's fake process group (cpu), step 2 of 2" in out, out
    rows = _measured(out)
    # the shards and their gradients are what the planner says, to the byte (as printed)
    for name in ("parameter shards", "gradient shards"):
        assert _bytes(rows[name][0]) == rows[name][1], (name, rows[name])
    # AdamW: two moments per trainable element; between steps a rank holds shards + moments
    assert rows["optimizer state"][1] == 2 * rows["parameter shards"][1], rows
    assert _bytes(rows["between steps"][0]) == rows["between steps"][1], rows
    assert rows["between steps"][1] == pytest.approx(3 * rows["parameter shards"][1], rel=1e-3), rows  # (as printed)
    assert rows["backward peak"][1] > rows["forward peak"][1] > rows["between steps"][1], rows
    assert "not measured: steps that need data only another rank has" in out, out


def test_the_prediction_for_another_world_size_is_within_ten_percent_of_measuring_there(measured):
    predicted = _predicted(measured[8], 64)
    there = _measured(measured[64])
    assert predicted["parameter shards"] == there["parameter shards"][1], (predicted, there)
    for phase in _PHASES:
        assert abs(predicted[phase] - there[phase][1]) <= 0.10 * there[phase][1], (phase, predicted[phase], there[phase][1])


MIXED = ("--mixed-precision", "param_dtype=bfloat16,reduce_dtype=float32")


@pytest.fixture(scope="module")
def measured_mixed() -> Dict[int, str]:
    return {8: _measure(8, "--at", "64", *MIXED), 64: _measure(64, *MIXED)}


def _estimate(out: str) -> Dict[str, float]:
    """The planner's estimate, by component (as printed)."""
    line = next(l for l in out.splitlines() if l.startswith("estimated peak per rank"))
    parts = re.findall(r"(?:= |\+ )([a-z][a-z ]*?) (\d+(?:\.\d+)? (?:B|KiB|MiB|GiB))", line)
    return {name: _bytes(value) for name, value in parts}


def test_with_mixed_precision_at_the_root_the_measurement_agrees_with_the_plan(measured_mixed):
    out = measured_mixed[8]
    assert "<root>    Decoder  FULL_SHARD       2    16,384   64.0 KiB   8.0 KiB  float32 as bfloat16 2p/16,384" in out, out
    rows = _measured(out)
    for name in ("parameter shards", "gradient shards", "between steps"):
        assert _bytes(rows[name][0]) == rows[name][1], (name, rows[name])
    predicted, there = _predicted(out, 64), _measured(measured_mixed[64])
    assert predicted["parameter shards"] == there["parameter shards"][1], (predicted, there)
    for phase in _PHASES:
        assert abs(predicted[phase] - there[phase][1]) <= 0.10 * there[phase][1], (phase, predicted[phase], there[phase][1])


def test_mixed_precision_changes_the_estimate_as_its_dtypes_say(measured, measured_mixed):
    plain, mixed = _estimate(measured[8]), _estimate(measured_mixed[8])
    assert set(plain) == {"parameter shards", "gradient shards", "gathered parameters", "unsharded gradient"}, plain
    # the shards and their gradients stay float32; gathered in bfloat16; each unsharded gradient
    # made in bfloat16 and copied to float32 for its reduction
    assert mixed["parameter shards"] == plain["parameter shards"] and mixed["gradient shards"] == plain["gradient shards"], (plain, mixed)
    assert mixed["gathered parameters"] == pytest.approx(plain["gathered parameters"] / 2, rel=1e-3), (plain, mixed)
    assert mixed["unsharded gradient"] == pytest.approx(plain["unsharded gradient"] * 1.5, rel=1e-3), (plain, mixed)
    # and the saving on gathered parameters is there in the measured forward (whose
    # activations shrink too)
    saved = _measured(measured[8])["forward peak"][1] - _measured(measured_mixed[8])["forward peak"][1]
    assert saved >= plain["gathered parameters"] - mixed["gathered parameters"], (saved, plain, mixed)


def _inside_a_process_group(rank: int, world_size: int) -> str:
    import flatshard
    from tests._scale_run import Decoder, example_tokens

    try:
        flatshard.plan(Decoder(), world_size=8, measure=True, example_input=example_tokens(), print_table=False)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


class MeasureArgumentsTest(TestCase):
    def test_measuring_needs_a_batch(self) -> None:
        import flatshard
        from tests._scale_run import Decoder

        with self.assertRaisesRegex(ValueError, r"plan\(measure=True\) needs example_input: one batch to train on"):
            flatshard.plan(Decoder(), world_size=8, measure=True, print_table=False)
        with self.assertRaisesRegex(ValueError, r"world_size must be at least 2; got 1"):
            flatshard.plan(Decoder(), world_size=1, measure=True, example_input=torch.zeros(1, 2, dtype=torch.long), print_table=False)
        with self.assertRaisesRegex(ValueError, r"rank must be an int in 0..7; got 8"):
            flatshard.plan(Decoder(), world_size=8, measure=True, example_input=torch.zeros(1, 2, dtype=torch.long), rank=8, print_table=False)

    def test_measuring_inside_a_process_group_says_how_to_do_it(self) -> None:
        self.assertExpectedInline(self.pool.run(_inside_a_process_group, 2)[0], """plan(measure=True) runs this process as one rank of world_size on torch's fake process group, which must be the only one: call it before init_process_group (or run python -m flatshard.plan ... --measure in a process of its own)""")
