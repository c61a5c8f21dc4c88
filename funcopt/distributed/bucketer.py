"""ReduceScatterBucketer: batch many small reduce-scatters into few large ones.

Same interface as fairscale's ``ReduceScatterBucketer``.  Small inputs are
copied into a per-(dtype, device, group) bucket of ``world x capacity``
elements; when the next input does not fit, or on ``flush()``, the bucket is
reduce-scattered together and each input's callback receives its
slice of the result.  Inputs at least as large as a bucket shard go straight
through.  Bucket buffers are allocated on first use and released after each
flush, so they exist only while in use.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

from ._comm import reduce_scatter


class _Bucket:
    def __init__(self, data: Tensor, group: Any):
        self.data = data  # [world, capacity]
        self.group = group
        self.offset = 0
        self.callbacks: List[Callable[[], None]] = []
        self.output: Optional[Tensor] = None

    def flush(self) -> None:
        if self.offset == 0:
            return
        with record_function("funcopt::bucketer/reduce_scatter"):
            used = self.data[:, : self.offset]
            self.output = torch.empty(self.offset, dtype=self.data.dtype, device=self.data.device)
            reduce_scatter(self.output, list(used.unbind(0)), self.group, owned=True)
        for cb in self.callbacks:
            cb()
        self.offset = 0
        self.callbacks = []
        self.output = None


class ReduceScatterBucketer:
    """Helper for bucketing multiple reduce-scatter operations on small inputs.

    Args:
      bucket_size_mb: target bucket size in MiB (default 25); ``0`` disables
        bucketing (every input goes straight through).

    Usage::

        bucketer = ReduceScatterBucketer(bucket_size_mb=25)
        for chunks in per_tensor_chunks:          # each: world tensors, equal shapes
            bucketer.reduce_scatter_async(chunks, group, callback_fn=store)
        bucketer.flush()                          # every callback has run now
        bucketer.free()

    .. warning:: collective: call with the same sequence of inputs on every rank.
    """

    def __init__(self, bucket_size_mb: int = 25):
        if bucket_size_mb < 0:
            raise ValueError(f"bucket_size_mb must be >= 0, got {bucket_size_mb}")
        self.bucket_size_mb = bucket_size_mb
        self.buckets: Dict[Tuple[torch.dtype, torch.device, Any], _Bucket] = {}

    @torch.no_grad()
    def reduce_scatter_async(
        self,
        input_list: Sequence[Tensor],
        group: Any = None,
        callback_fn: Optional[Callable[[Tensor], Any]] = None,
    ) -> None:
        """Reduce-scatter ``input_list`` (one tensor per rank, all the same shape).

        ``callback_fn(result)`` receives this rank's summed tensor after the
        reduction, which may be delayed until the bucket fills or ``flush()``;
        callbacks may run in a different order than the calls.
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
                reduce_scatter(output, input_list, group)
            if callback_fn is not None:
                callback_fn(output)
            return
        key = (first.dtype, first.device, group)
        bucket = self.buckets.get(key)
        if bucket is not None and numel > bucket.data.size(1) - bucket.offset:
            bucket.flush()
        if bucket is None:
            data = torch.empty(world, capacity, dtype=first.dtype, device=first.device)
            bucket = self.buckets[key] = _Bucket(data, group)
        off = bucket.offset
        for r, t in enumerate(input_list):
            bucket.data[r, off : off + numel].copy_(t.reshape(-1))
        bucket.offset += numel
        if callback_fn is not None:
            def deliver(b: _Bucket = bucket, o: int = off, shape: Any = first.shape) -> None:
                assert b.output is not None
                callback_fn(b.output[o : o + numel].view(shape))

            bucket.callbacks.append(deliver)

    @torch.no_grad()
    def flush(self) -> None:
        """Reduce-scatter every partially filled bucket and run its callbacks; frees the buffers."""
        for key in list(self.buckets):
            self.buckets[key].flush()
        self.buckets.clear()

    @torch.no_grad()
    def free(self) -> None:
        """Release bucket memory; everything must have been flushed."""
        for bucket in self.buckets.values():
            if bucket.offset != 0 or bucket.callbacks:
                raise RuntimeError("ReduceScatterBucketer.free() with unflushed data; call flush() first")
        self.buckets.clear()

    def _shard_size(self, element_size: int, world: int) -> int:
        if self.bucket_size_mb <= 0:
            return 0
        return max(1, self.bucket_size_mb * 1024 * 1024 // (element_size * world))
