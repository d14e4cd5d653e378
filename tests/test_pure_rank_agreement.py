"""Pure tier: where the ranks' lists first differ (``flatshard._comm._collectives.differences``), the
comparison every rank-agreement check reports from (see [Note: rank agreement]); and finding a
module's unit (``flatshard._checkpoint._checkpointing.unit_of``)."""

import torch
from expecttest import TestCase

from flatshard._checkpoint._checkpointing import unit_of
from flatshard._comm._collectives import RankDifference, differences, item_at


class DifferencesTest(TestCase):
    def test_agreeing_ranks_have_no_differences(self):
        self.assertEqual(differences([["a", "b"], ["a", "b"], ["a", "b"]], "nothing"), [])
        self.assertEqual(differences([[]], "nothing"), [])

    def test_every_differing_rank_at_its_first_differing_item(self):
        per_rank = [["a", "b", "c"], ["a", "b", "c"], ["a", "x", "y"], ["z"]]
        self.assertEqual(
            differences(per_rank, "nothing"),
            [RankDifference(2, 1, "b", "x"), RankDifference(3, 0, "a", "z")],
        )

    def test_a_list_that_runs_out_differs_at_its_end(self):
        self.assertEqual(differences([["a", "b"], ["a"]], "(no such unit)"), [RankDifference(1, 1, "b", "(no such unit)")])
        self.assertEqual(differences([["a"], ["a", "b"]], "nothing more"), [RankDifference(1, 1, "nothing more", "b")])

    def test_items_need_not_be_strings(self):
        self.assertEqual(differences([(1, 2), (1, 3)], None), [RankDifference(1, 1, 2, 3)])

    def test_item_at(self):
        self.assertEqual(item_at(["a"], 0, "nothing"), "a")
        self.assertEqual(item_at(["a"], 1, "nothing"), "nothing")


class UnitOfTest(TestCase):
    def test_a_plain_module_has_no_unit(self):
        self.assertIsNone(unit_of(torch.nn.Linear(2, 2)))

    def test_an_attribute_of_another_type_is_not_a_unit(self):
        module = torch.nn.Linear(2, 2)
        module._unit = "not a unit"
        self.assertIsNone(unit_of(module))


class CheckReportsTest(TestCase):
    """What the per-iteration checks report once the ranks' digests differ and they have
    exchanged what they compared ([Note: order check] in ``flatshard/_flat/_exec_order.py``)."""

    def test_ranks_at_different_checks_are_named_by_where_they_are(self):
        from flatshard._comm._guard import _diverged
        from flatshard._engine._agreement import _backward_difference, _forward_difference

        everyone = [(0, ("at the end of its forward", None, ["<root>", "a", "optimizer steps: 3"], None, False)), (1, ("at the start of its backward", 7, ["<root>"], None, False))]
        for explain in (_forward_difference, _backward_difference):
            self.assertExpectedInline(
                str(_diverged(1, everyone, explain)),
                """[rank 1] the ranks are at different places: rank 0 is at the end of its forward; rank 1 is at the start of its backward (call #7). Every rank must make the same flatshard calls in the same order (a rank that skipped a backward, a call or a step the others made, or made one they did not, has diverged)""",
            )

    def test_the_first_unit_that_differs_or_the_optimizer_steps(self):
        from flatshard._engine._agreement import _forward_difference

        ran = [(0, ("at the end of its forward", None, ["<root>", "a", "b", "optimizer steps: 2"], None, False)), (1, ("at the end of its forward", None, ["<root>", "b", "optimizer steps: 2"], None, False))]
        self.assertExpectedInline(_forward_difference(ran), """the ranks ran different units (every rank must run the same units in the same order, e.g. no data-dependent skipping): unit #1 of this forward differs: rank 0 ran a; rank 1 ran b""")
        steps = [(0, ("at the end of its forward", None, ["<root>", "optimizer steps: 2"], None, False)), (1, ("at the end of its forward", None, ["<root>", "optimizer steps: 3"], None, False))]
        self.assertExpectedInline(_forward_difference(steps), """the ranks called optimizer.step() on this model a different number of times before this forward (rank 0: 2; rank 1: 3): a rank that steps alone, or skips a step the others take, trains a different model from then on (every rank must step together)""")
