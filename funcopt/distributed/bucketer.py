"""ReduceScatterBucketer: batch many small reduce-scatters into few large ones.

Same interface as fairscale's ``ReduceScatterBucketer``.  Small inputs are
copied into a per-(dtype, device, group) bucket of ``world x capacity``
elements; when the next input does not fit, or on ``flush()``, the bucket is
reduce-scattered together and each input's callback receives its
slice of the result.  Inputs at least as large as a bucket shard go straight
through.  Bucket buffers are allocated on first use and released after each
flush, so they exist only while in use.

The reduce-scatters are asynchronous: a full bucket (or a large input) is
issued and the caller goes on (e.g. the rest of backward) while it runs; at
most ``max_in_flight`` are outstanding (the oldest is waited for first), and
``flush()`` completes them all.  A callback runs when its reduce-scatter has
been waited for.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

from ._comm import Pending, reduce_scatter


class _Bucket:
    def __init__(self, data: Tensor, group: Any):
        self.data = data  # [world, capacity]
        self.group = group
        self.offset = 0
        self.callbacks: List[Callable[[Tensor], None]] = []  # each gets the bucket's output

    def issue(self, refill: bool) -> Optional[Tuple[Pending, List[Callable[[], None]]]]:
        """Start reducing what is in the bucket; the buffer goes with the
        operation.  ``refill``: the bucket starts over in a new buffer (when it
        filled up; not on a flush, which drops the bucket)."""
        if self.offset == 0:
            return None
        with record_function("funcopt::bucketer/reduce_scatter"):
            used = self.data[:, : self.offset]
            output = torch.empty(self.offset, dtype=self.data.dtype, device=self.data.device)
            pending = reduce_scatter(output, list(used.unbind(0)), self.group, owned=True, async_op=True)
        done = [lambda cb=cb: cb(output) for cb in self.callbacks]
        if refill:
            self.data = torch.empty_like(self.data)
        self.offset = 0
        self.callbacks = []
        assert pending is not None
        return pending, done


class ReduceScatterBucketer:
    """Helper for bucketing multiple reduce-scatter operations on small inputs.

    Args:
      bucket_size_mb: target bucket size in MiB (default 25); ``0`` disables
        bucketing (every input goes straight through).
      max_in_flight: reduce-scatters left running while the caller goes on
        (default 2); more overlap, more buffers alive.

    Usage::

        bucketer = ReduceScatterBucketer(bucket_size_mb=25)
        for chunks in per_tensor_chunks:          # each: world tensors, equal shapes
            bucketer.reduce_scatter_async(chunks, group, callback_fn=store)
        bucketer.flush()                          # every callback has run now
        bucketer.free()

    .. warning:: collective: call with the same sequence of inputs on every rank.
    """

    def __init__(self, bucket_size_mb: int = 25, max_in_flight: int = 2):
        if bucket_size_mb < 0:
            raise ValueError(f"bucket_size_mb must be >= 0, got {bucket_size_mb}")
        if max_in_flight < 0:
            raise ValueError(f"max_in_flight must be >= 0, got {max_in_flight}")
        self.bucket_size_mb = bucket_size_mb
        self.max_in_flight = max_in_flight
        self.buckets: Dict[Tuple[torch.dtype, torch.device, Any], _Bucket] = {}
        self.in_flight: Deque[Tuple[Pending, List[Callable[[], None]]]] = deque()

    def _launched(self, op: Optional[Tuple[Pending, List[Callable[[], None]]]]) -> None:
        if op is not None:
            self.in_flight.append(op)
        while len(self.in_flight) > self.max_in_flight:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        pending, done = self.in_flight.popleft()
        with record_function("funcopt::bucketer/wait"):
            pending.wait()
        for cb in done:
            cb()

    @torch.no_grad()
    def reduce_scatter_async(
        self,
        input_list: Sequence[Tensor],
        group: Any = None,
        callback_fn: Optional[Callable[[Tensor], Any]] = None,
    ) -> None:
        """Reduce-scatter ``input_list`` (one tensor per rank, all the same shape).

        ``callback_fn(result)`` receives this rank's summed tensor once its
        reduce-scatter has completed: after the bucket filled and was issued,
        when more than ``max_in_flight`` are outstanding, or in ``flush()`` at
        the latest; callbacks may run in a different order than the calls.
        """
        world = dist.get_world_size(group)
        if len(input_list) != world:
            raise ValueError(f"reduce_scatter_async: got {len(input_list)} inputs for a group of {world} ranks")
        first = input_list[0]
        for t in input_list[1:]:
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError("reduce_scatter_async: all inputs must have the same shape, dtype and device")
        numel = first.numel()
        capacity = self._shard_size(first.element_size(), world)
        if numel >= capacity:
            with record_function("funcopt::bucketer/reduce_scatter_direct"):
                output = torch.empty_like(first)
                pending = reduce_scatter(output, input_list, group, async_op=True)
            assert pending is not None
            done = [] if callback_fn is None else [lambda: callback_fn(output)]
            self._launched((pending, done))
            return
        key = (first.dtype, first.device, group)
        bucket = self.buckets.get(key)
        if bucket is not None and numel > bucket.data.size(1) - bucket.offset:
            self._launched(bucket.issue(refill=True))
        if bucket is None:
            data = torch.empty(world, capacity, dtype=first.dtype, device=first.device)
            bucket = self.buckets[key] = _Bucket(data, group)
        off = bucket.offset
        for r, t in enumerate(input_list):
            bucket.data[r, off : off + numel].copy_(t.reshape(-1))
        bucket.offset += numel
        if callback_fn is not None:
            def deliver(output: Tensor, o: int = off, shape: Any = first.shape) -> None:
                callback_fn(output[o : o + numel].view(shape))

            bucket.callbacks.append(deliver)

    @torch.no_grad()
    def flush(self) -> None:
        """Reduce-scatter every partially filled bucket, complete every reduce-scatter
        in flight and run all callbacks; frees the buffers."""
        for key in list(self.buckets):
            op = self.buckets[key].issue(refill=False)
            if op is not None:
                self.in_flight.append(op)
        self.buckets.clear()
        while self.in_flight:
            self._complete_oldest()

    @torch.no_grad()
    def free(self) -> None:
        """Release bucket memory; everything must have been flushed."""
        for bucket in self.buckets.values():
            if bucket.offset != 0 or bucket.callbacks:
                raise RuntimeError("ReduceScatterBucketer.free() with unflushed data; call flush() first")
        if self.in_flight:
            raise RuntimeError("ReduceScatterBucketer.free() with reduce-scatters in flight; call flush() first")
        self.buckets.clear()

    def _shard_size(self, element_size: int, world: int) -> int:
        if self.bucket_size_mb <= 0:
            return 0
        return max(1, self.bucket_size_mb * 1024 * 1024 // (element_size * world))
