"""make_layout: who owns which elements (no processes needed).

The greedy partition is compared with torch's own ``ZeroRedundancyOptimizer``
partition: a torch ZeRO built on a one-process gloo group in this process,
its ``world_size`` then set to the size under test (``_partition_parameters``
only reads ``world_size`` and ``param_groups``).
"""
from __future__ import annotations

import datetime
from typing import List, Sequence

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from funcopt.distributed import make_layout
from funcopt.distributed.layout import chunks

pytestmark = pytest.mark.timeout(120)

F32, F64, F16 = torch.float32, torch.float64, torch.float16


def _check_invariants(layout, numels: Sequence[int], dtypes: Sequence[torch.dtype], world: int) -> None:
    assert layout.world == world
    assert set(layout.spaces) == {str(d).replace("torch.", "") for d in dtypes}, "one space per dtype"
    owned: List[List[tuple]] = [[] for _ in numels]
    for key, space in layout.spaces.items():
        assert len(space.ranks) == world
        for r, segs in enumerate(space.ranks):
            off = 0
            for s in segs:
                assert dtypes[s.param] == space.dtype, f"param {s.param} ({dtypes[s.param]}) in the {key} space"
                assert s.offset == off, f"rank {r} space {key}: segments not packed ({s})"
                assert 0 <= s.start and s.start + s.length <= numels[s.param] and s.length >= 0
                off += s.length
                owned[s.param].append((s.start, s.length, r))
            assert off <= space.shard
        assert space.shard == max(sum(s.length for s in segs) for segs in space.ranks), "shard = the largest rank"
    for i, pieces in enumerate(owned):  # every element of every parameter owned exactly once
        pos = 0
        for start, length, _ in sorted(pieces):
            assert start == pos, f"param {i}: elements [{pos}, {start}) unowned or owned twice: {sorted(pieces)}"
            pos += length
        assert pos == numels[i], f"param {i}: {pos} of {numels[i]} elements owned"
    for r in range(world):
        segs = layout.segments(r)
        assert [(s.param, s.start) for s in segs] == sorted((s.param, s.start) for s in segs)
        assert layout.state_elements(r) == sum(s.length for s in segs)


def _check_flat(layout, numels, dtypes, world) -> None:
    """The doc's rule: per dtype, the concatenation (in order) cut into W equal contiguous ranges."""
    for key, space in layout.spaces.items():
        idx = [i for i, d in enumerate(dtypes) if d == space.dtype]
        total = sum(numels[i] for i in idx)
        per = -(-total // world)
        begin = {}
        pos = 0
        for i in idx:
            begin[i] = pos
            pos += numels[i]
        for r, segs in enumerate(space.ranks):
            expect_lo, expect_hi = min(r * per, total), min((r + 1) * per, total)
            got = [(begin[s.param] + s.start, begin[s.param] + s.start + s.length) for s in segs if s.length]
            covered = sorted(got)
            assert (covered[0][0] if covered else expect_lo) == expect_lo and \
                (covered[-1][1] if covered else expect_hi) == expect_hi, f"rank {r}: {covered}"
            for (a, b), (c, _) in zip(covered, covered[1:]):
                assert b == c
            for s in segs:  # the offset is the position in the rank's range
                assert s.offset == begin[s.param] + s.start - r * per
        sizes = [sum(s.length for s in segs) for segs in space.ranks]
        assert max(sizes) - min(sizes) <= world - 1
        assert space.shard * world - total <= world - 1, "padding of at most W-1 elements"


def _check_greedy_whole(layout, numels) -> List[int]:
    """Whole parameters only; returns each parameter's rank."""
    rank_of = [-1] * len(numels)
    for space in layout.spaces.values():
        for r, segs in enumerate(space.ranks):
            for s in segs:
                assert s.start == 0 and s.length == numels[s.param], f"greedy split parameter {s.param}: {s}"
                assert rank_of[s.param] == -1
                rank_of[s.param] = r
    assert -1 not in rank_of
    return rank_of


@pytest.fixture(scope="module")
def torch_greedy(tmp_path_factory):
    """torch ZeroRedundancyOptimizer's partition: ranks of each parameter for given sizes/groups/world
    (funcopt's greedy keeps torch's rule across dtypes: one running size per rank)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('layout') / 'rdv'}",
                                rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))

    def partition(numels, dtypes, group_sizes, world):
        # torch's ZeRO refuses mixed dtypes; its partition looks at sizes only, so one dtype here
        params = [torch.zeros(n, requires_grad=True) for n in numels]
        groups, first = [], 0
        for g in group_sizes:
            groups.append(dict(params=params[first:first + g]))
            first += g
        z = ZeroRedundancyOptimizer(groups, torch.optim.SGD, lr=0.1)
        z.world_size = world
        z._partition_parameters_cache = []
        rank_of = [-1] * len(params)
        for r, rank_groups in enumerate(z._partition_parameters()):
            for group in rank_groups:
                for p in group["params"]:
                    rank_of[next(i for i, q in enumerate(params) if q is p)] = r
        return rank_of

    try:
        yield partition
    finally:
        if mine:
            dist.destroy_process_group()


# ------------------------------------------------------------------ examples
def test_flat_straddling_parameters():
    lay = make_layout([3, 7, 2], [F32] * 3, [3], 4, "flat")  # 12 elements, 3 per rank
    got = [[(s.param, s.start, s.length, s.offset) for s in segs] for segs in lay.spaces["float32"].ranks]
    assert got == [[(0, 0, 3, 0)], [(1, 0, 3, 0)], [(1, 3, 3, 0)], [(1, 6, 1, 0), (2, 0, 2, 1)]]
    assert lay.spaces["float32"].shard == 3
    _check_invariants(lay, [3, 7, 2], [F32] * 3, 4)


def test_flat_padding():
    lay = make_layout([5], [F32], [1], 4, "flat")  # 2, 2, 1, 0
    assert [sum(s.length for s in segs) for segs in lay.spaces["float32"].ranks] == [2, 2, 1, 0]
    assert lay.spaces["float32"].shard == 2


def test_greedy_whole_parameters_torch_rule(torch_greedy):
    numels, dtypes, groups = [5, 3, 7, 7, 1], [F32] * 5, [3, 2]
    lay = make_layout(numels, dtypes, groups, 3, "greedy")
    rank_of = _check_greedy_whole(lay, numels)
    assert rank_of == [1, 2, 0, 2, 1]  # group 0 by size: 7->r0, 5->r1, 3->r2; group 1: 7->r2, 1->r1
    assert rank_of == torch_greedy(numels, dtypes, groups, 3)
    _check_invariants(lay, numels, dtypes, 3)


@pytest.mark.parametrize("partition", ["flat", "greedy"])
def test_mixed_dtypes_separate_spaces(partition):
    numels = [4, 6, 10, 3, 5]
    dtypes = [F32, F64, F32, F16, F64]
    lay = make_layout(numels, dtypes, [5], 2, partition)
    assert sorted(lay.spaces) == ["float16", "float32", "float64"]
    for key, space in lay.spaces.items():
        assert space.dtype == getattr(torch, key)
    _check_invariants(lay, numels, dtypes, 2)
    if partition == "flat":
        _check_flat(lay, numels, dtypes, 2)
        assert lay.spaces["float32"].shard == 7 and lay.spaces["float64"].shard == 6 and lay.spaces["float16"].shard == 2


def test_world_one_owns_everything():
    for partition in ("flat", "greedy"):
        lay = make_layout([4, 0, 9], [F32, F32, F64], [3], 1, partition)
        assert sum(s.length for s in lay.segments(0)) == 13


def test_invalid_arguments():
    with pytest.raises(ValueError, match="partition"):
        make_layout([3], [F32], [1], 2, "round-robin")
    with pytest.raises(ValueError, match="world"):
        make_layout([3], [F32], [1], 0, "flat")


def test_overlapping_and_chunks():
    lay = make_layout([3, 7, 2], [F32] * 3, [3], 2, "flat")  # rank 1: p1[3:7] at 0..4, p2[0:2] at 4..6
    sp = lay.spaces["float32"]
    got = [(s.param, skip, take) for s, skip, take in sp.overlapping(1, 2, 5)]
    assert got == [(1, 2, 2), (2, 0, 1)]
    assert chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunks(3, 0) == [(0, 1), (1, 2), (2, 3)]
    assert chunks(0, 4) == []


# ---------------------------------------------------------------- properties
_sizes = st.lists(st.integers(0, 40), min_size=1, max_size=10)


@st.composite
def _problems(draw):
    numels = draw(_sizes)
    dtypes = draw(st.lists(st.sampled_from([F32, F64]), min_size=len(numels), max_size=len(numels)))
    cuts = sorted(draw(st.sets(st.integers(1, len(numels) - 1), max_size=3))) if len(numels) > 1 else []
    bounds = [0] + cuts + [len(numels)]
    groups = [b - a for a, b in zip(bounds, bounds[1:])]
    world = draw(st.integers(1, 8))
    return numels, dtypes, groups, world


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_problems())
def test_flat_property(problem):
    numels, dtypes, groups, world = problem
    lay = make_layout(numels, dtypes, groups, world, "flat")
    _check_invariants(lay, numels, dtypes, world)
    _check_flat(lay, numels, dtypes, world)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(_problems())
def test_greedy_property_matches_torch(torch_greedy, problem):
    numels, dtypes, groups, world = problem
    lay = make_layout(numels, dtypes, groups, world, "greedy")
    _check_invariants(lay, numels, dtypes, world)
    assert _check_greedy_whole(lay, numels) == torch_greedy(numels, dtypes, groups, world)
