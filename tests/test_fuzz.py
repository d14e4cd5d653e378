"""Differential fuzzing: random models, wrappings and training schedules, each checked step by
step against single-process training of the unwrapped model on the global batch.

What a case is (``tests/_fuzz.py``): a random module tree (nesting depth 1-3; Linear,
LayerNorm, Embedding, MLP / residual / gated-by-eval blocks, ``nn.Sequential``, ``ModuleList``
and ``ModuleDict`` containers; a module called twice, a module registered in two containers,
registered-but-unused modules and parameters, the embedding tied to the head, a weight shared at
two depths, float / int / non-persistent buffers and a forward counter, modules frozen at
construction, MoE-style side-channel losses, outputs in tuples / dicts / dataclasses, activation
checkpointing, meta-device construction); a wrapping (no policy, every auto-wrap policy, or
manual nesting with per-unit strategies; every ``ShardingStrategy``, hybrid layouts 2x2, shard
groups of size 1 and of all ranks; every ``backward_prefetch``, ``forward_prefetch``,
``limit_all_gathers``; world sizes 1-4); a schedule (AdamW or SGD with momentum; micro-batches
with and without ``no_sync``; branches skipped per micro-batch; eval / ``no_grad`` /
``inference_mode`` forwards and grad-enabled forwards without backward; ``requires_grad``
toggled on whole units; a backward that raises, caught by the loop; ``clip_grad_norm_``; a
checkpoint saved and loaded mid-run - full, full via ``optim_state_dict``, rank-0-only, or
sharded through ``torch.distributed.checkpoint`` - in the same pool task or in a new one at
another world size, optionally into a model wrapped in the other ``use_orig_params`` mode;
``use_orig_params`` on or off) and what loops write to the model between steps and between
micro-batches (parameters changed in place, by rebinding ``.data`` or by
``vector_to_parameters`` - all of them, or with ``use_orig_params`` a subset by name - or
replaced by new ``nn.Parameter``s the optimizer is moved to; ``requires_grad`` of single
parameters; gradients rebound, ``.grad.data`` rebound, changed in place or dropped between
backward and step; local gradients scaled or zeroed between ``no_sync`` micro-batches; an
``AveragedModel`` EMA copy updated and evaluated after each step; a deep copy trained apart;
weights clamped in place by their module in forwards without autograd). The truth (``tests/_fuzz_run.py``) is the same schedule trained in one
process; losses (averaged over the ranks), clip norms, and all parameters and buffers are
compared (RTOL 1e-5, ATOL 1e-6). A float32 mismatch is run again in float64: if that passes, the
difference is rounding that the model amplifies (e.g. a LayerNorm of nearly constant input), and
long mode logs it apart instead of counting it as a failure.

The suite runs ``SEEDS`` x ``WORLD_SIZES`` (32 fixed cases, about 35 s on 2 cores);
``test_fixed_seeds_cover_everything`` checks (in-process, no ranks) that they exercise every
feature, strategy, policy, checkpoint form and kind of write (``tests._fuzz.coverage``).

Environment variables:

- ``FLATSHARD_FUZZ_SEED=123`` (optionally ``FLATSHARD_FUZZ_WORLD_SIZE=3``): run only that case
  (a failure prints this line, with the case's description). ``FLATSHARD_FUZZ_CASE=case.json``
  runs a case saved with ``tests._fuzz.to_json`` (e.g. a minimised one).
- ``FLATSHARD_FUZZ_FEATURES``: ``-aux,-toggle`` disables features (``-known`` disables every
  feature that exercises a known bug: issue 14's items, and the W-x items of issue 28, see
  ``tests._fuzz.KNOWN``); ``aux,nosync`` enables only those. The other random choices of a seed
  stay the same. Names: ``tests._fuzz.FEATURES``.
- Long mode: ``FLATSHARD_FUZZ_SECONDS=600`` and/or ``FLATSHARD_FUZZ_CASES=200`` run new seeds
  (from ``FLATSHARD_FUZZ_START``, default 10000) for that long, then print a summary: cases run,
  and per failure its seed, verdict (known item(s) of issue 14, or NEW) and a one-line
  description. ``FLATSHARD_FUZZ_SHRINK=1`` also minimises each failure;
  ``FLATSHARD_FUZZ_REPORT=file`` writes the summary there too. Run it with ``-s`` to see
  progress, e.g. ``FLATSHARD_FUZZ_SECONDS=600 python -m pytest -s tests/test_fuzz.py -k long``.
"""

import os

import pytest

from tests._fuzz import coverage, describe, everything, from_json, generate, parse_features
from tests._fuzz_run import check
from tests._fuzz_shrink import campaign

# chosen to cover every feature, strategy, policy, checkpoint form and kind of write (checked by
# test_fixed_seeds_cover_everything), and to pass: none hits a known bug (tests._fuzz.KNOWN)
SEEDS = [106, 258, 710, 1157, 2036, 2122, 2645, 2749]
WORLD_SIZES = [1, 2, 3, 4]
FEATURES = parse_features(os.environ.get("FLATSHARD_FUZZ_FEATURES"))
LONG = bool(os.environ.get("FLATSHARD_FUZZ_SECONDS") or os.environ.get("FLATSHARD_FUZZ_CASES"))


def _fixed_cases():
    if os.environ.get("FLATSHARD_FUZZ_CASE"):
        return [("case", None)]
    if os.environ.get("FLATSHARD_FUZZ_SEED"):
        ws = os.environ.get("FLATSHARD_FUZZ_WORLD_SIZE")
        return [(int(os.environ["FLATSHARD_FUZZ_SEED"]), int(ws) if ws else None)]
    return [(seed, ws) for seed in SEEDS for ws in WORLD_SIZES]


@pytest.mark.skipif(LONG, reason="long mode runs test_fuzz_long only")
@pytest.mark.parametrize("seed,world_size", _fixed_cases(), ids=lambda v: str(v))
def test_fuzz_seed(rank_pool, seed, world_size):
    if seed == "case":
        with open(os.environ["FLATSHARD_FUZZ_CASE"]) as f:
            case = from_json(f.read())
    else:
        case = generate(seed, world_size=world_size, features=FEATURES)
    failure = check(rank_pool, case)
    if failure is not None:
        rounding = " (float32 rounding only: the case passes in float64)" if failure.rounding else ""
        pytest.fail(f"{failure.summary}{rounding}\n\n{describe(case)}\n\n{failure.details}", pytrace=False)


def test_fixed_seeds_cover_everything():
    """The fixed cases exercise every feature, strategy, wrapping policy, checkpoint form
    (and mode crossing), and every kind of parameter, gradient and copy operation in each
    ``use_orig_params`` mode (``tests._fuzz.everything``)."""
    covered = set()
    for seed in SEEDS:
        for ws in WORLD_SIZES:
            covered |= coverage(generate(seed, world_size=ws))
    assert sorted(everything() - covered) == []


@pytest.mark.skipif(not LONG, reason="set FLATSHARD_FUZZ_SECONDS or FLATSHARD_FUZZ_CASES")
def test_fuzz_long(rank_pool, capsys):
    seconds = float(os.environ.get("FLATSHARD_FUZZ_SECONDS") or 0)
    cases = int(os.environ.get("FLATSHARD_FUZZ_CASES") or 0)
    start = int(os.environ.get("FLATSHARD_FUZZ_START") or 10000)
    minimise = os.environ.get("FLATSHARD_FUZZ_SHRINK") == "1"

    def log(text):
        with capsys.disabled():
            print(text, flush=True)

    ran, failures = campaign(rank_pool, seconds, cases, start, FEATURES, minimise, log)
    summary = f"flatshard fuzz: {ran} cases from seed {start}, {len(failures)} failed" + "".join("\n" + f for f in failures)
    log("\n" + summary)
    if os.environ.get("FLATSHARD_FUZZ_REPORT"):
        with open(os.environ["FLATSHARD_FUZZ_REPORT"], "w") as f:
            f.write(summary + "\n")
    if failures:
        pytest.fail(summary, pytrace=False)
