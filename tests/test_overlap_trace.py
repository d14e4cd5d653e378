"""Every all-gather and gradient reduction is issued before compute it can run behind, and waited
for after that compute was dispatched ([Note: overlap] in ``_engine/_runtime.py``), measured by
dispatch order as rank 0 of 8 on torch's fake process group ([Note: dispatch-order trace] in
``tests/_overlap_trace.py``).

Each entry of a trace is one data collective of a training step, in issue order: f/b (issued in
forward or backward), AG/RS/AR (all-gather, reduce-scatter, all-reduce) and how many matrix
products were dispatched between its issue and its first wait; 0 is a collective fully exposed.
The model: a root with an input projection (or an embedding) and a head, five block units.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from expecttest import TestCase

ROOT = Path(__file__).resolve().parents[1]


def _traces():
    env = dict(os.environ, OMP_NUM_THREADS="1", FLATSHARD_SHARED_MEMORY="0")
    env.pop("TORCH_DISTRIBUTED_DEBUG", None)
    done = subprocess.run([sys.executable, "-m", "tests._overlap_trace"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _exposed(trace):
    return [(i, entry) for i, entry in enumerate(trace.split()) if entry.endswith("0")]


class OverlapTraceTest(TestCase):
    @classmethod
    def setUpClass(cls):
        cls.traces = _traces()

    def test_only_the_first_gather_and_the_last_reduction_are_exposed(self):
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
            trace = self.traces[strategy].split()
            exposed = _exposed(self.traces[strategy])
            first_gather = [(0, trace[0])] if trace[0] == "fAG0" else []
            self.assertEqual(exposed, first_gather + [(len(trace) - 1, trace[-1])], (strategy, trace))
        self.assertExpectedInline(self.traces["FULL_SHARD"], """fAG0 fAG1 fAG2 fAG2 fAG2 fAG2 bAG2 bAG4 bRS4 bAG4 bRS4 bAG4 bRS4 bAG4 bRS4 bRS1 bRS0""")
        self.assertExpectedInline(self.traces["SHARD_GRAD_OP"], """fAG0 fAG1 fAG2 fAG2 fAG2 fAG2 bRS4 bRS4 bRS4 bRS4 bRS1 bRS0""")
        self.assertExpectedInline(self.traces["NO_SHARD"], """bAR4 bAR4 bAR4 bAR4 bAR1 bAR0""")

    def test_hybrid_sharding_overlaps_the_all_reduce_over_the_replicas(self):
        # On a host-driven backend the all-reduce of a unit is issued once its reduce-scatter was
        # waited for, at the next unit's post-backward, and waited for at the one after: only the
        # last two units' all-reduces have no compute behind them ([Note: chained all-reduce];
        # on CUDA the chain is issued with the reduce-scatter and only the last unit's remains).
        trace = self.traces["HYBRID_SHARD"].split()
        self.assertEqual([e for _, e in _exposed(self.traces["HYBRID_SHARD"])], ["fAG0", "bAR0", "bRS0", "bAR0"])
        self.assertEqual(trace[-2:], ["bRS0", "bAR0"])  # the last unit's reduction
        self.assertExpectedInline(self.traces["HYBRID_SHARD"], """fAG0 fAG1 fAG2 fAG2 fAG2 fAG2 bAG2 bAG4 bRS4 bAG4 bAR4 bRS4 bAG4 bAR4 bRS4 bAG4 bAR4 bRS4 bAR1 bRS1 bAR0 bRS0 bAR0""")

    def test_a_unit_behind_an_embedding_has_no_matrix_product_to_hide_behind(self):
        # (the first block's gather and reduction run behind the embedding's lookup and its
        # backward, which are no matrix products)
        self.assertExpectedInline(self.traces["FULL_SHARD embedding"], """fAG0 fAG0 fAG2 fAG2 fAG2 fAG2 bAG2 bAG4 bRS4 bAG4 bRS4 bAG4 bRS4 bAG4 bRS4 bRS0 bRS0""")

    def test_without_overlap_forward_gathers_and_reductions_are_exposed(self):
        # set_communication_overlap(False): FSDP1's lowest peak, every forward gather and every
        # reduction waited for right away (what the default was before)
        self.assertExpectedInline(self.traces["FULL_SHARD without overlap"], """fAG0 fAG0 fAG0 fAG0 fAG0 fAG0 bAG2 bAG4 bRS0 bAG4 bRS0 bAG4 bRS0 bAG4 bRS0 bRS1 bRS0""")
        self.assertExpectedInline(self.traces["HYBRID_SHARD without overlap"], """fAG0 fAG0 fAG0 fAG0 fAG0 fAG0 bAG2 bAG4 bRS0 bAR0 bAG4 bRS0 bAR0 bAG4 bRS0 bAR0 bAG4 bRS0 bAR0 bRS1 bAR0 bRS0 bAR0""")
