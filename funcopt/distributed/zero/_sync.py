"""ZeRO's parameter homes and parameter sync (a mixin of ZeroRedundancyOptimizer).

Every parameter has a *home*: a contiguous 1-D tensor of its elements in
logical order, what the local step and the sync work on.  After the local
step, one broadcast per owner and bucket brings every rank's updated range to
every rank.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .layout import chunks


def _align(nbytes: int) -> int:
    return (nbytes + 15) // 16 * 16


class ParamSyncMixin:
    """Homes (bucket views, shadows of non-contiguous parameters) and the broadcast sync."""

    def _make_homes(self, params: List[Tensor]) -> None:
        """Each parameter's *home*: a contiguous 1-D tensor of its elements in logical
        order, what the local step and the sync work on.  A contiguous parameter is
        its own home (with bucket views: ``p.data`` becomes a view of its range of
        the buffer); a non-contiguous one (channels_last, transposed, a strided
        slice) keeps its strides and is *shadowed*: its home is a copy, refreshed
        before the local step and copied back after the sync."""
        self._homes: List[Tensor] = []
        self._shadowed: List[int] = []
        regions: Dict[int, Tensor] = {}
        if self.parameters_as_bucket_view:
            self._buffers: Dict[str, Tensor] = {}
            for key, space in self.layout.spaces.items():
                buf = torch.empty(self.world_size * space.shard, dtype=space.dtype, device=self._device(params, space))
                for r, segs in enumerate(space.ranks):
                    for s in segs:
                        if s.param not in regions:
                            at = r * space.shard + s.offset - s.start
                            regions[s.param] = buf[at: at + params[s.param].numel()]
                self._buffers[key] = buf
        for i, p in enumerate(params):
            region = regions.get(i)
            if p.is_contiguous():
                if region is None:
                    home = p.detach().view(-1)
                else:
                    region.copy_(p.detach().view(-1))
                    p.data = region.view_as(p)
                    home = region
            else:
                home = region if region is not None else torch.empty(p.numel(), dtype=p.dtype, device=p.device)
                home.view(p.shape).copy_(p.detach())
                self._shadowed.append(i)
            self._homes.append(home)
        mine = {s.param for s in self._segments}
        self._shadowed_mine = [i for i in self._shadowed if i in mine]

    @staticmethod
    def _device(params: List[Tensor], space: Any) -> torch.device:
        for segs in space.ranks:
            for s in segs:
                return params[s.param].device
        return torch.device("cpu")

    def _plan_sync(self) -> None:
        """Precompute the parameter sync: per space and bucket-sized range of the
        shards, each owner's broadcast and the home ranges it lands in."""
        self._sync_plan = []
        self._sync_buf: Optional[Tensor] = None
        for key, space in self.layout.spaces.items():
            for lo, hi in chunks(space.shard, self._chunk_elems(space)):
                for r in range(self.world_size):
                    pieces = [(s.param, s.start + skip, take, s.offset + skip - lo)
                              for s, skip, take in space.overlapping(r, lo, hi)]
                    if pieces:
                        n = max(at + take for _, _, take, at in pieces)
                        self._sync_plan.append((key, space, lo, r, n, pieces))

    def _chunk_elems(self, space: Any) -> int:
        """Elements per rank in one bucket; ``bucket_size_mb=0``: the whole shard."""
        if self.bucket_size_mb <= 0:
            return max(1, space.shard)
        elem = torch.empty((), dtype=space.dtype).element_size()
        return max(1, self.bucket_size_mb * 1024 * 1024 // (elem * self.world_size))

    def _sync_params(self, params: List[Tensor]) -> None:
        """Bring every owner's updated range to every rank: one broadcast per owner
        and bucket (gloo's broadcast moved the same bytes 3-4x faster than its
        all-gather on loopback, see docs/benchmarks.md).  With bucket views the
        broadcast lands in the parameters; otherwise the owner packs its range into
        a reused buffer and the receivers copy it out.  Shadowed (non-contiguous)
        parameters are then copied back from their homes."""
        if self.world_size > 1:
            self._broadcast_shards(params)
        mine = set(self._shadowed_mine) if self._eager else set()
        for i in self._shadowed:
            if i not in mine:
                params[i].detach().copy_(self._homes[i].view(params[i].shape))

    def _broadcast_shards(self, params: List[Tensor]) -> None:
        group = self.process_group
        works, unpack = [], []
        used = 0
        if not self.parameters_as_bucket_view and self._sync_plan:
            need = sum(_align(n * torch.empty((), dtype=space.dtype).element_size()) for _, space, _, _, n, _ in self._sync_plan)
            if self._sync_buf is None or self._sync_buf.numel() < need:
                self._sync_buf = torch.empty(need, dtype=torch.uint8, device=params[0].device)
        for key, space, lo, r, n, pieces in self._sync_plan:
            src = r if group is None else dist.get_global_rank(group, r)
            if self.parameters_as_bucket_view:
                at = r * space.shard + lo
                works.append(dist.broadcast(self._buffers[key][at: at + n], src=src, group=group, async_op=True))
                continue
            nbytes = n * torch.empty((), dtype=space.dtype).element_size()
            buf = self._sync_buf[used: used + nbytes].view(space.dtype)
            used += _align(nbytes)
            views = [self._homes[i][a: a + take] for i, a, take, _ in pieces]
            slots = [buf[at: at + take] for _, _, take, at in pieces]
            if r == self.rank:
                torch._foreach_copy_(slots, views)
            else:
                unpack.append((views, slots))
            works.append(dist.broadcast(buf, src=src, group=group, async_op=True))
        for w in works:
            w.wait()
        for views, slots in unpack:
            torch._foreach_copy_(views, slots)
