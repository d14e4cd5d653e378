"""Pure tier: how a flat tensor is padded and split over ranks, and which original parameters
(and which of their elements) each rank's shard holds. No process group."""

import itertools
import math
import random
from typing import List, Sequence, Tuple

import torch
from expecttest import TestCase

from flatshard._flat._layout import ParamInfo, ShardParamInfo, shard_param_infos, shard_sizes


def infos(numels: Sequence[int]) -> Tuple[ParamInfo, ...]:
    """Parameters ``p0, p1, ...`` of the given sizes laid out back to back, as a handle does."""
    out, offset = [], 0
    for i, numel in enumerate(numels):
        out.append(ParamInfo(f"p{i}", "", f"p{i}", torch.Size([numel]), numel, offset))
        offset += numel
    return tuple(out)


def element_by_element(numels: Sequence[int], shard_numel: int, rank: int) -> Tuple[ShardParamInfo, ...]:
    """The oracle: walk ``rank``'s shard one element at a time, noting which parameter (and
    which of its elements) sits there; padding belongs to no parameter."""
    owners = [(index, element) for index, numel in enumerate(numels) for element in range(numel)]
    pieces: List[List[int]] = []  # [index, param_offset, shard_offset, numel]
    for position in range(shard_numel):
        flat = rank * shard_numel + position
        if flat >= len(owners):
            break
        index, element = owners[flat]
        if pieces and pieces[-1][0] == index:
            pieces[-1][3] += 1
        else:
            pieces.append([index, element, position, 1])
    return tuple(ShardParamInfo(*piece) for piece in pieces)


class ShardSizesTest(TestCase):
    def test_examples(self):
        cases = {
            (13, 3, True): (15, 5),  # ceil(13 / 3) = 5 per rank, 2 elements of padding
            (12, 3, True): (12, 4),  # an exact multiple needs no padding
            (12, 4, True): (12, 3),
            (5, 2, True): (6, 3),
            (2, 4, True): (4, 1),  # fewer elements than ranks: one each, two ranks only padding
            (1, 4, True): (4, 1),
            (0, 4, True): (0, 0),  # a group without elements stays empty
            (13, 1, True): (13, 13),  # one rank: nothing to shard, nothing to pad
            (13, 4, False): (13, 13),  # NO_SHARD: whole, unpadded, at any world size
            (1, 3, False): (1, 1),
        }
        for (numel, world_size, sharded), expected in cases.items():
            self.assertEqual(shard_sizes(numel, world_size, sharded), expected, (numel, world_size, sharded))

    def test_padding_is_the_least_that_makes_equal_shards(self):
        for numel, world_size in itertools.product(range(0, 40), range(1, 5)):
            padded, shard = shard_sizes(numel, world_size, True)
            where = (numel, world_size)
            self.assertEqual(padded, shard * world_size, where)
            self.assertEqual(shard, math.ceil(numel / world_size), where)
            self.assertTrue(numel <= padded < numel + world_size, where)
            self.assertEqual(shard_sizes(numel, world_size, False), (numel, numel), where)


class ShardParamInfosTest(TestCase):
    def test_tied_module_at_world_size_3(self):
        # The layout tests/test_flat_param.py builds on three ranks: vec (5), lin.weight (2x3),
        # lin.bias (2): 13 elements in shards of 5. Rank 0: vec; rank 1: weight[0:5]; rank 2:
        # weight[5], the bias, then 2 elements of padding.
        layout = infos([5, 6, 2])
        _, shard = shard_sizes(13, 3, True)
        self.assertEqual(
            [[(s.index, s.param_offset, s.shard_offset, s.numel) for s in shard_param_infos(layout, shard, r)] for r in range(3)],
            [[(0, 0, 0, 5)], [(1, 0, 0, 5)], [(1, 5, 0, 1), (2, 0, 1, 2)]],
        )

    def test_fewer_elements_than_ranks(self):
        layout = infos([2])
        _, shard = shard_sizes(2, 4, True)
        self.assertEqual(
            [shard_param_infos(layout, shard, r) for r in range(4)],
            [(ShardParamInfo(0, 0, 0, 1),), (ShardParamInfo(0, 1, 0, 1),), (), ()],
        )

    def test_shard_boundaries_on_parameter_boundaries_leave_no_empty_pieces(self):
        layout = infos([4, 4])
        self.assertEqual(shard_param_infos(layout, 4, 0), (ShardParamInfo(0, 0, 0, 4),))
        self.assertEqual(shard_param_infos(layout, 4, 1), (ShardParamInfo(1, 0, 0, 4),))

    def test_empty_parameters_are_held_by_no_rank(self):
        layout = infos([0, 3, 0, 3, 0])
        self.assertEqual(shard_param_infos(layout, 3, 0), (ShardParamInfo(1, 0, 0, 3),))
        self.assertEqual(shard_param_infos(layout, 3, 1), (ShardParamInfo(3, 0, 0, 3),))

    def test_unsharded_holds_every_parameter_whole(self):
        layout = infos([5, 6, 2])
        _, shard = shard_sizes(13, 4, False)
        self.assertEqual(
            shard_param_infos(layout, shard, 0),
            (ShardParamInfo(0, 0, 0, 5), ShardParamInfo(1, 0, 5, 6), ShardParamInfo(2, 0, 11, 2)),
        )

    def test_matches_an_element_by_element_walk(self):
        rng = random.Random(0)
        layouts = [[1], [7], [3, 3], [5, 6, 2], [0, 1, 0]] + [
            [rng.choice((0, 1, 2, 3, 5, 8)) for _ in range(rng.randint(1, 6))] for _ in range(40)
        ]
        for numels in layouts:
            for world_size in (1, 2, 3, 4):
                _, shard = shard_sizes(sum(numels), world_size, True)
                held = [0] * len(numels)
                for rank in range(world_size):
                    got = shard_param_infos(infos(numels), shard, rank)
                    self.assertEqual(got, element_by_element(numels, shard, rank), (numels, world_size, rank))
                    for piece in got:
                        held[piece.index] += piece.numel
                # every element of every parameter is held by exactly one rank
                self.assertEqual(held, list(numels), (numels, world_size))
