"""Parameter homes and the parameter sync after a step (ZeRO-1/2).

Every parameter has a *home*: a contiguous 1-D tensor of its elements in
logical order, what the local step and the sync work on.  After the local
step, one broadcast per owner and bucket brings every rank's updated range to
every rank: waited for at once (:meth:`ParamSync.sync`), or started
(:meth:`ParamSync.start`) and waited for per parameter as the next forward
reaches it (:meth:`ParamSync.wait_params`, from forward pre-hooks).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .layout import Layout, Space, chunk_elems, chunks


def _align(nbytes: int) -> int:
    return (nbytes + 15) // 16 * 16


class Flight:
    """One broadcast in flight and, without bucket views, its unpack into the homes."""

    __slots__ = ("work", "unpack", "done")

    def __init__(self, work: Any, unpack: Optional[Tuple[List[Tensor], List[Tensor]]]):
        self.work, self.unpack, self.done = work, unpack, False

    def wait(self) -> None:
        if self.done:
            return
        self.done = True  # first: a failed wait is not retried (the error is raised once)
        self.work.wait()
        if self.unpack is not None:
            torch._foreach_copy_(*self.unpack)


class ParamSync:
    """The homes of a list of parameters under a layout, and the broadcast sync.

    Args:
      params: the parameters, in ``param_groups`` order (the same on every rank).
      layout: who owns which elements (:func:`~funcopt.distributed.zero.layout.make_layout`).
      rank: this rank in ``process_group``.
      process_group: ``None``: the world.
      bucket_view: make ``p.data`` views into one flat buffer per dtype, so the
        sync writes straight into the parameters.
      bucket_size_mb: broadcast bucket size (``0``: one bucket per owner).

    Attributes:
      homes: one contiguous 1-D tensor per parameter (the parameter itself, a
        view of it, or, for a *shadowed* non-contiguous parameter, a copy).
      shadowed: indices of shadowed parameters; ``shadowed_mine``: those this
        rank owns some elements of.
    """

    def __init__(self, params: List[Tensor], layout: Layout, rank: int, process_group: Any,
                 bucket_view: bool, bucket_size_mb: int):
        self.layout, self.rank, self.world = layout, rank, layout.world
        self.process_group = process_group
        self.bucket_view = bucket_view
        self.bucket_size_mb = bucket_size_mb
        self.buffers: Dict[str, Tensor] = {}
        self.index = {id(p): i for i, p in enumerate(params)}
        self._pending: Dict[int, List[Flight]] = {}  # param -> its broadcasts in flight
        self._copy_back: Dict[int, Tensor] = {}  # shadowed param -> the parameter, once its broadcasts end
        self._make_homes(params)
        self._plan()

    def _make_homes(self, params: List[Tensor]) -> None:
        """A contiguous parameter is its own home (with bucket views: ``p.data``
        becomes a view of its range of the buffer); a non-contiguous one
        (channels_last, transposed, a strided slice) keeps its strides and is
        *shadowed*: its home is a copy, refreshed before the local step and
        copied back after the sync."""
        self.homes: List[Tensor] = []
        self.shadowed: List[int] = []
        regions: Dict[int, Tensor] = {}
        if self.bucket_view:
            for key, space in self.layout.spaces.items():
                buf = torch.empty(self.world * space.shard, dtype=space.dtype, device=_device(params, space))
                for r, segs in enumerate(space.ranks):
                    for s in segs:
                        if s.param not in regions:
                            at = r * space.shard + s.offset - s.start
                            regions[s.param] = buf[at: at + params[s.param].numel()]
                self.buffers[key] = buf
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
                self.shadowed.append(i)
            self.homes.append(home)
        mine = {s.param for s in self.layout.segments(self.rank)}
        self.shadowed_mine = [i for i in self.shadowed if i in mine]

    def _plan(self) -> None:
        """Per space and bucket-sized range of the shards, each owner's broadcast and
        the home ranges it lands in."""
        self._steps: List[Tuple[str, Space, int, int, int, List[Tuple[int, int, int, int]]]] = []
        self._buf: Optional[Tensor] = None
        for key, space in self.layout.spaces.items():
            for lo, hi in chunks(space.shard, chunk_elems(space, self.world, self.bucket_size_mb)):
                for r in range(self.world):
                    pieces = [(s.param, s.start + skip, take, s.offset + skip - lo)
                              for s, skip, take in space.overlapping(r, lo, hi)]
                    if pieces:
                        n = max(at + take for _, _, take, at in pieces)
                        self._steps.append((key, space, lo, r, n, pieces))

    def refresh_mine(self, params: List[Tensor]) -> None:
        """Copy the shadowed parameters this rank owns into their homes (before a local step)."""
        for i in self.shadowed_mine:
            self.homes[i].view(params[i].shape).copy_(params[i].detach())

    @property
    def pending(self) -> bool:
        """Whether a started sync has parameters not waited for yet."""
        return bool(self._pending) or bool(self._copy_back)

    def sync(self, params: List[Tensor], updated_in_place: bool) -> None:
        """Bring every owner's updated range to every rank.  Collective.

        One broadcast per owner and bucket (gloo's broadcast moved the same
        bytes 3-4x faster than its all-gather on loopback, see
        docs/benchmarks.md).  With bucket views the broadcast lands in the
        parameters; otherwise the owner packs its range into a reused buffer
        and the receivers copy it out.  Shadowed parameters are then copied
        back from their homes, except this rank's own when the local step
        ``updated_in_place`` (an eager class steps the parameter itself).
        """
        self.start(params, updated_in_place)
        self.wait_all()

    def start(self, params: List[Tensor], updated_in_place: bool) -> None:
        """:meth:`sync`, but return once the broadcasts are issued; each parameter is
        current after :meth:`wait_params` (or :meth:`wait_all`) covers it.  Same
        collectives in the same order as :meth:`sync`, same numbers.  Collective."""
        self.wait_all()  # the previous sync's buffers are reused
        if self.world > 1:
            self._broadcast(params)
        mine = set(self.shadowed_mine) if updated_in_place else set()
        for i in self.shadowed:
            if i not in mine:
                self._copy_back[i] = params[i]
        for i in [i for i in self._copy_back if i not in self._pending]:
            self._finish(i)

    def wait_params(self, params: List[Tensor]) -> None:
        """Wait for the broadcasts that write ``params`` (parameters this sync does not
        hold are ignored)."""
        for p in params:
            i = self.index.get(id(p))
            if i is not None and (i in self._pending or i in self._copy_back):
                self._finish(i)

    def wait_all(self) -> None:
        """Wait for everything a started sync still has in flight."""
        error: Optional[BaseException] = None
        for i in list(self._pending) + list(self._copy_back):
            try:
                self._finish(i)
            except BaseException as e:  # finish the others; raise the first error
                error = error or e
        if error is not None:
            raise error

    def _finish(self, i: int) -> None:
        flights = self._pending.pop(i, ())
        param = self._copy_back.pop(i, None)
        for f in flights:
            f.wait()
        if param is not None:
            param.detach().copy_(self.homes[i].view(param.shape))

    def _broadcast(self, params: List[Tensor]) -> None:
        group = self.process_group
        used = 0
        if not self.bucket_view and self._steps:
            need = sum(_align(n * torch.empty((), dtype=space.dtype).element_size()) for _, space, _, _, n, _ in self._steps)
            if self._buf is None or self._buf.numel() < need:
                self._buf = torch.empty(need, dtype=torch.uint8, device=params[0].device)
        for key, space, lo, r, n, pieces in self._steps:
            src = r if group is None else dist.get_global_rank(group, r)
            unpack = None
            if self.bucket_view:
                at = r * space.shard + lo
                work = dist.broadcast(self.buffers[key][at: at + n], src=src, group=group, async_op=True)
            else:
                assert self._buf is not None
                nbytes = n * torch.empty((), dtype=space.dtype).element_size()
                buf = self._buf[used: used + nbytes].view(space.dtype)
                used += _align(nbytes)
                views = [self.homes[i][a: a + take] for i, a, take, _ in pieces]
                slots = [buf[at: at + take] for _, _, take, at in pieces]
                if r == self.rank:
                    torch._foreach_copy_(slots, views)
                else:
                    unpack = (views, slots)
                work = dist.broadcast(buf, src=src, group=group, async_op=True)
            flight = Flight(work, unpack)
            for i in {i for i, _, _, _ in pieces}:
                self._pending.setdefault(i, []).append(flight)


def _device(params: List[Tensor], space: Space) -> torch.device:
    for segs in space.ranks:
        for s in segs:
            return params[s.param].device
    return torch.device("cpu")
