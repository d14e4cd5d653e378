"""Pure tier: where the ranks' lists first differ (``flatshard._collectives.differences``), the
comparison every rank-agreement check reports from (see [Note: rank agreement]); and finding a
module's unit (``flatshard._checkpointing.unit_of``)."""

import torch
from expecttest import TestCase

from flatshard._checkpointing import unit_of
from flatshard._collectives import RankDifference, differences, item_at


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
