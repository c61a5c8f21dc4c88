"""Who owns which elements: the partition of parameters over ranks.

A *layout* splits the parameters into one flat space per dtype and gives each
rank a list of :class:`Segment` (a contiguous element range of one parameter).
Two partitions:

* ``"flat"`` (default): the parameters of a dtype, concatenated in
  ``param_groups`` order, are cut into ``world`` equal contiguous ranges; a
  parameter may straddle two ranks.  Per-rank state is exactly 1/W (+ padding
  of at most W-1 elements).
* ``"greedy"``: torch's ``ZeroRedundancyOptimizer`` partition -- whole
  parameters, each group sorted by size, every parameter to the rank with the
  fewest elements so far.

Each rank's segments, concatenated, form its *shard*; all shards of a space are
padded to the same length ``shard`` so one all-gather syncs them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import torch

PARTITIONS = ("flat", "greedy")


@dataclass(frozen=True)
class Segment:
    """One contiguous element range of one parameter that one rank owns."""

    param: int  # global index, in param_groups order
    start: int  # first element within the flattened parameter
    length: int
    offset: int  # position within the owning rank's shard


@dataclass
class Space:
    dtype: torch.dtype
    shard: int  # padded per-rank shard length
    ranks: List[List[Segment]] = field(default_factory=list)

    def overlapping(self, rank: int, lo: int, hi: int) -> List[Tuple[Segment, int, int]]:
        """Segments of ``rank`` meeting shard range [lo, hi), as (segment, skip, take)."""
        out = []
        for s in self.ranks[rank]:
            a, b = max(lo, s.offset), min(hi, s.offset + s.length)
            if a < b:
                out.append((s, a - s.offset, b - a))
        return out


@dataclass
class Layout:
    """Which rank owns which element ranges of every parameter, per dtype space."""

    world: int
    partition: str
    spaces: Dict[str, Space]

    def segments(self, rank: int) -> List[Segment]:
        """All segments of ``rank``, ordered by (param, start)."""
        segs = [s for sp in self.spaces.values() for s in sp.ranks[rank]]
        return sorted(segs, key=lambda s: (s.param, s.start))

    def state_elements(self, rank: int) -> int:
        """Number of parameter elements ``rank`` owns (its share of elementwise state)."""
        return sum(s.length for s in self.segments(rank))


def _space_key(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def make_layout(
    numels: Sequence[int],
    dtypes: Sequence[torch.dtype],
    group_sizes: Sequence[int],
    world: int,
    partition: str = "flat",
) -> Layout:
    """Partition parameters (given by size and dtype, in group order) over ``world`` ranks."""
    if partition not in PARTITIONS:
        raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}")
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    by_dtype: Dict[str, List[int]] = {}
    for i, dt in enumerate(dtypes):
        by_dtype.setdefault(_space_key(dt), []).append(i)
    owned: Dict[str, List[List[Tuple[int, int, int]]]] = {k: [[] for _ in range(world)] for k in by_dtype}
    if partition == "flat":
        for key, idx in by_dtype.items():
            total = sum(numels[i] for i in idx)
            per = -(-total // world)
            pos = 0
            for i in idx:
                n = numels[i]
                if n == 0:  # an empty parameter still gets (empty) state, like torch.optim
                    owned[key][min(pos // per, world - 1) if per else 0].append((i, 0, 0))
                    continue
                a = pos
                while a < pos + n:
                    r = a // per
                    b = min(pos + n, (r + 1) * per)
                    owned[key][r].append((i, a - pos, b - a))
                    a = b
                pos += n
    else:
        sizes = [0] * world
        first = 0
        for gsize in group_sizes:
            members = sorted(range(first, first + gsize), key=lambda i: numels[i], reverse=True)
            for i in members:
                r = min(range(world), key=lambda k: sizes[k])
                owned[_space_key(dtypes[i])][r].append((i, 0, numels[i]))
                sizes[r] += numels[i]
            first += gsize
    spaces: Dict[str, Space] = {}
    for key, idx in by_dtype.items():
        ranks: List[List[Segment]] = []
        for r in range(world):
            segs, off = [], 0
            for i, start, length in sorted(owned[key][r]):
                segs.append(Segment(i, start, length, off))
                off += length
            ranks.append(segs)
        shard = max(sum(s.length for s in segs) for segs in ranks)
        spaces[key] = Space(dtypes[idx[0]], shard, ranks)
    return Layout(world, partition, spaces)


def chunks(shard: int, chunk: int) -> List[Tuple[int, int]]:
    """[lo, hi) ranges of at most ``chunk`` elements covering a shard."""
    chunk = max(1, chunk)
    return [(lo, min(lo + chunk, shard)) for lo in range(0, shard, chunk)]


def chunk_elems(space: Space, world: int, bucket_size_mb: int) -> int:
    """Elements per rank in one bucket of ``space`` (the parameter sync's and ZeRO-2's
    reduce-scatter's unit); ``bucket_size_mb <= 0``: the whole shard."""
    if bucket_size_mb <= 0:
        return max(1, space.shard)
    elem = torch.empty((), dtype=space.dtype).element_size()
    return max(1, bucket_size_mb * 1024 * 1024 // (elem * world))
