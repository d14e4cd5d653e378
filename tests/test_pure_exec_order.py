"""Pure tier: the execution order of units (forward order frozen after the first forward,
post-forward order for backward prefetch) and the order-check tokens and their messages.
No process group: units are plain strings here."""

from expecttest import TestCase

from flatshard._flat._exec_order import END_OF_BACKWARD, GATHER, REDUCE, ExecOrder, describe, token

NAMES = ["<root>", "layers.0", "layers.1"]


def run_forward(order: ExecOrder, units, first: bool = False) -> None:
    """One root forward that starts ``units`` in this order (as the pre-forward hooks do)."""
    order.start_forward()
    for unit in units:
        order.record_pre_forward(unit)
    if first:
        order.freeze_forward_order()


def everything(unit) -> bool:
    return True


class ForwardOrderTest(TestCase):
    def test_first_forward_order_lists_each_unit_once(self):
        order = ExecOrder()
        run_forward(order, ["root", "a", "b", "a", "c"])
        self.assertEqual(order.first_forward(), ["root", "a", "b", "c"])
        self.assertEqual(order.this_forward(), ["root", "a", "b", "a", "c"])  # repeats kept here

    def test_forward_order_is_frozen_after_the_first_forward(self):
        order = ExecOrder()
        run_forward(order, ["root", "a", "b"], first=True)
        run_forward(order, ["root", "c", "b", "a"])  # c did not run in the first forward
        self.assertEqual(order.first_forward(), ["root", "a", "b"])
        self.assertEqual(order.this_forward(), ["root", "c", "b", "a"])
        self.assertIsNone(order.next_in_forward("c"))

    def test_start_forward_forgets_the_previous_forward(self):
        order = ExecOrder()
        run_forward(order, ["root", "a"], first=True)
        order.start_forward()
        self.assertEqual(order.this_forward(), [])
        self.assertEqual(order.first_forward(), ["root", "a"])

    def test_lists_returned_are_copies(self):
        order = ExecOrder()
        run_forward(order, ["root", "a"], first=True)
        order.first_forward().append("x")
        order.this_forward().append("x")
        self.assertEqual((order.first_forward(), order.this_forward()), (["root", "a"], ["root", "a"]))

    def test_freezing_again_keeps_the_first_order(self):
        order = ExecOrder()
        run_forward(order, ["root", "a", "b"], first=True)
        run_forward(order, ["root", "b"], first=True)  # the hook that freezes runs every forward
        self.assertEqual(order.first_forward(), ["root", "a", "b"])

    def test_next_in_forward(self):
        order = ExecOrder()
        run_forward(order, ["root", "a", "b", "a", "c"], first=True)
        order.start_forward()  # (a later forward, before any unit of it ran)
        self.assertEqual(
            [order.next_in_forward(u) for u in ("root", "a", "b", "c", "unknown")],
            ["a", "b", "c", None, None],
        )
        # a unit that already ran in this forward is no prefetch target
        order.record_pre_forward("root")
        order.record_pre_forward("b")
        self.assertEqual([order.next_in_forward(u) for u in ("root", "a", "b")], ["a", None, "c"])


class BackwardOrderTest(TestCase):
    def order_after_forward(self, finished):
        """An order whose units finished their forward in ``finished`` order."""
        order = ExecOrder()
        for unit in finished:
            order.record_post_forward(unit)
        return order

    def test_next_in_backward_is_the_unit_that_finished_its_forward_just_before(self):
        order = self.order_after_forward(["a", "b", "c"])
        self.assertEqual(
            [order.next_in_backward(u, everything) for u in ("c", "b", "a", "unknown")],
            ["b", "a", None, None],
        )

    def test_first_finish_counts_and_repeats_are_ignored(self):
        order = self.order_after_forward(["a", "b", "a", "c", "b"])
        self.assertEqual(order.next_in_backward("c", everything), "b")
        self.assertEqual(order.next_in_backward("b", everything), "a")

    def test_wanted_filters_units_that_already_started_their_backward(self):
        order = self.order_after_forward(["root", "a", "b", "c"])
        self.assertEqual(order.next_in_backward("c", lambda u: u != "b"), "a")
        self.assertEqual(order.next_in_backward("c", lambda u: u == "root"), "root")
        self.assertIsNone(order.next_in_backward("c", lambda u: False))
        seen = []
        order.next_in_backward("c", lambda u: seen.append(u) or u == "root")
        self.assertEqual(seen, ["b", "a", "root"])  # nearest first, stopping at the first wanted

    def test_end_iteration_clears_the_post_forward_order(self):
        order = self.order_after_forward(["a", "b"])
        order.end_iteration()
        self.assertIsNone(order.next_in_backward("b", everything))
        order.record_post_forward("b")
        order.record_post_forward("a")
        self.assertEqual(order.next_in_backward("a", everything), "b")

    def test_post_forward_order_does_not_touch_the_forward_order(self):
        order = ExecOrder()
        run_forward(order, ["root", "a", "b"], first=True)
        order.record_post_forward("b")
        order.record_post_forward("a")
        order.end_iteration()
        order.start_forward()
        self.assertEqual(order.first_forward(), ["root", "a", "b"])
        self.assertEqual(order.next_in_forward("a"), "b")


class OrderCheckTest(TestCase):
    def test_tokens_of_different_collectives_differ(self):
        values = [token(kind, index) for kind in (GATHER, REDUCE) for index in range(50)] + [token(END_OF_BACKWARD)]
        self.assertEqual(len(set(values)), len(values))
        self.assertTrue(all(v < 2**40 for v in values))  # below the forward hashes' range

    def test_describe(self):
        self.assertExpectedInline(
            "\n".join(
                describe(v, NAMES)
                for v in (token(GATHER, 0), token(GATHER, 2), token(REDUCE, 1), token(END_OF_BACKWARD), 2**40 + 12345)
            ),
            """\
gathering the parameters of unit <root>
gathering the parameters of unit layers.1
reducing the gradients of unit layers.0
at the end of its backward
at the end of its forward""",
        )

    def test_describe_a_unit_index_beyond_the_names_as_a_forward(self):
        # a forward's hash can look like a unit token of an index no unit has
        self.assertEqual(describe(token(GATHER, len(NAMES)), NAMES), "at the end of its forward")

    def test_ranks_at_different_per_collective_checks_are_named_by_where_they_are(self):
        # (under DETAIL each collective's check is a position of the guard: the report names
        # each rank's, another check's included)
        from flatshard._engine._agreement import _units_differ

        positions = [(r, (describe(t, NAMES), None, [], None, True)) for r, t in enumerate((token(REDUCE, 0), token(END_OF_BACKWARD), token(GATHER, 2)))]
        positions.append((3, ("at the start of its forward", 7, [], None, True)))
        self.assertExpectedInline(
            _units_differ(positions),
            """the ranks ran different units (every rank must run the same units in the same order, e.g. no data-dependent skipping): rank 0 is reducing the gradients of unit <root>; rank 1 is at the end of its backward; rank 2 is gathering the parameters of unit layers.1; rank 3 is at the start of its forward""",
        )
