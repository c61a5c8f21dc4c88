"""Gradient shards (ZeRO-2): gradients reduce-scattered during backward, each rank keeps its shard.

Hooks on gradient accumulation feed a :class:`ReduceScatterBucketer`; each
chunk of a dtype's flat space is reduce-scattered as soon as all its
gradients exist, in the same (descending) order on every rank, and a
parameter's full ``.grad`` is dropped once all its chunks are on their way.
``torch.amp.GradScaler`` is served here too: the shards are unscaled and the
inf check is agreed over ranks (see :meth:`GradShards.unscale`).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

from .. import _comm
from ..bucketer import ReduceScatterBucketer
from .layout import Layout, Segment, chunk_elems, chunks


class GradShards:
    """This rank's gradient shard of every dtype space, filled during backward.

    Args:
      params: the parameters, in ``param_groups`` order (the same on every rank).
      layout: who owns which elements.
      rank: this rank in ``process_group`` (``None``: the world).
      bucket_size_mb: reduce-scatter chunk size per rank (``0``: one chunk per space).

    Hooks are registered on ``params`` at construction; :meth:`remove` takes them off.
    """

    def __init__(self, params: List[Tensor], layout: Layout, rank: int, process_group: Any, bucket_size_mb: int):
        self.params, self.layout, self.rank, self.world = params, layout, rank, layout.world
        self.process_group = process_group
        self._bucketer = ReduceScatterBucketer(bucket_size_mb)
        self.shards: Dict[str, Tensor] = {}
        self._chunks: List[Tuple[str, Any, int, int, List[Any], List[int]]] = []
        for key, space in layout.spaces.items():
            for lo, hi in chunks(space.shard, chunk_elems(space, self.world, bucket_size_mb)):
                plan = [[(s.param, s.start + skip, take, s.offset + skip - lo) for s, skip, take in
                         space.overlapping(r, lo, hi)] for r in range(self.world)]
                members = sorted({c[0] for rank_plan in plan for c in rank_plan})
                self._chunks.append((key, space, lo, hi, plan, members))
        self._had_grad = [False] * len(params)  # since the last step, on this rank
        self._chunks_of: Dict[int, List[int]] = {}
        for j, c in enumerate(self._chunks):
            for i in c[5]:
                self._chunks_of.setdefault(i, []).append(j)
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                       for i, p in enumerate(params) if p.requires_grad]
        self._reset_backward()

    def remove(self) -> None:
        """Take the hooks off the parameters (this object stops collecting)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _reset_backward(self) -> None:
        self._pending = [sum(1 for i in c[5] if self.params[i].requires_grad) for c in self._chunks]
        self._issued = [False] * len(self._chunks)
        self._next = len(self._chunks) - 1  # chunks are issued in descending order on every rank
        self._round_active = False  # a backward has started feeding this round of chunks
        self._seen = [False] * len(self.params)

    def _make_hook(self, i: int) -> Callable[[Tensor], None]:
        ref = weakref.ref(self)  # the parameters must not keep a dropped optimizer alive (or feeding)

        def hook(p: Tensor) -> None:
            self = ref()
            if self is None:
                return
            self._had_grad[i] = True
            if not self._round_active:
                # like DDP: finish the round when this backward ends, whatever got a gradient
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            if self._seen[i]:
                # a second gradient for i: a new backward (gradient accumulation)
                # began before this round completed (some trainable parameter got
                # no gradient); finish the round first, missing gradients as zero
                self._issue_ready(force=True)
            self._seen[i] = True
            self._round_active = True
            for j in self._chunks_of.get(i, ()):
                self._pending[j] -= 1
            self._issue_ready(force=False)
        return hook

    def _end_of_backward(self) -> None:
        if self._round_active:
            self._issue_ready(force=True)

    @torch.no_grad()
    def _issue_ready(self, force: bool) -> None:
        params = self.params
        while self._next >= 0 and (force or self._pending[self._next] <= 0):
            j = self._next
            key, space, lo, hi, plan, members = self._chunks[j]
            n = hi - lo
            dev = params[members[0]].device if members else torch.device("cpu")
            inputs = torch.zeros(self.world, n, dtype=space.dtype, device=dev)
            for r in range(self.world):
                for i, a, take, at in plan[r]:
                    g = params[i].grad
                    if g is not None:
                        if g.layout != torch.strided:
                            g = g.to_dense()
                        inputs[r, at: at + take].copy_(g.reshape(-1)[a: a + take])
            shard = self.shards.get(key)
            if shard is None:
                shard = self.shards[key] = torch.zeros(space.shard, dtype=space.dtype, device=dev)
            target = shard[lo:hi]
            with record_function("funcopt::zero2/reduce_scatter"):
                self._bucketer.reduce_scatter_async(
                    list(inputs.unbind(0)), self.process_group,
                    callback_fn=lambda out, t=target: t.add_(out.div_(self.world)))
            self._issued[j] = True
            self._next -= 1
            for i in members:  # free full gradients whose chunks are all issued
                if all(self._issued[k] for k in self._chunks_of[i]):
                    params[i].grad = None
        if self._next < 0:
            # round complete: reduce what still waits in the bucketer now, so that
            # after backward a rank holds only its shard; a further backward
            # (gradient accumulation) starts a new round adding into the same shard
            self._bucketer.flush()
            self._reset_backward()

    def grads(self, segments: Sequence[Segment], shapes: Sequence[Optional[Tuple[int, ...]]]) -> List[Optional[Tensor]]:
        """This rank's gradient, one per segment (``None``: no rank had a gradient).
        ``shapes[k]``: the shape of segment k's local tensor (``None``: 1-D).  Collective."""
        if self._round_active:  # chunks whose gradients never all arrived: missing ones count as zero
            self._issue_ready(force=True)
        self._bucketer.flush()
        # a parameter that got a gradient on no rank is skipped, as torch.optim skips a None grad
        flags = torch.tensor(self._had_grad, dtype=torch.int32, device=_comm.comm_device(self.process_group))
        if self.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group)
        had = flags.tolist()
        self._had_grad = [False] * len(self.params)
        out: List[Optional[Tensor]] = []
        for s, shape in zip(segments, shapes):
            p = self.params[s.param]
            shard = self.shards.get(str(p.dtype).replace("torch.", ""))
            if not p.requires_grad or shard is None or not had[s.param]:
                out.append(None)
                continue
            g = shard[s.offset: s.offset + s.length]
            out.append(g if shape is None else g.view(shape))
        return out

    @torch.no_grad()
    def unscale(self, grad_scaler: Any, key: int) -> bool:
        """``torch.amp.GradScaler`` on the gradient shards: unscale them, check for
        inf/NaN, agree over ranks (all-reduce MAX of found_inf) and record the result
        where ``grad_scaler.update()`` reads it (under optimizer id ``key``).
        True: skip this step (on every rank).  Collective."""
        with record_function("funcopt::zero2/amp_unscale"):
            scale = grad_scaler._get_scale_async()
            if scale is None:
                raise RuntimeError("GradScaler has no scale: call scaler.scale(loss) before backward")
            dev = _comm.comm_device(self.process_group)
            found = torch.zeros((), dtype=torch.float32, device=dev)
            for shard in self.shards.values():
                inv = scale.double().reciprocal().float().to(shard.device)
                here = torch.zeros((), dtype=torch.float32, device=shard.device)
                torch._amp_foreach_non_finite_check_and_unscale_([shard], here, inv)
                found = torch.maximum(found, here.to(dev))
            if self.world > 1:
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.process_group)
            # GradScaler.update() reads the per-device found_inf of every optimizer it stepped
            grad_scaler._per_optimizer_states[key]["found_inf_per_device"] = {scale.device: found.to(scale.device)}
            return bool(found.item())

    def ready(self) -> Dict[str, Tensor]:
        """Finish every pending reduce-scatter (chunks whose gradients never all
        arrived count them as zero, as :meth:`grads` does) and return the shards,
        ``{dtype space: this rank's flat shard}`` (padding is zero).  Collective."""
        if self._round_active:
            self._issue_ready(force=True)
        self._bucketer.flush()
        return self.shards

    def clear(self) -> None:
        """Drop the shards (``zero_grad``)."""
        self.shards = {}
        self._had_grad = [False] * len(self.params)
        self._reset_backward()

    def nbytes(self) -> int:
        """Bytes of the shards this rank holds."""
        return sum(t.numel() * t.element_size() for t in self.shards.values())
