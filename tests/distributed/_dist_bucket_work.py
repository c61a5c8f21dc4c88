"""What the ranks of tests/distributed/test_bucketer.py run.

Every input is a deterministic function of (rank, call, destination rank), so
the parent computes each callback's expected value -- the sum over ranks of
the chunk destined to this rank -- without any process group.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from funcopt.distributed import ReduceScatterBucketer

from _dist_harness import save

MB = 1  # bucket size used below: capacity = 1 MiB / (element size * W) elements per rank

# (shape, dtype) of the small inputs: several sizes and dtypes, all far below one bucket
SMALL: List[Tuple[Tuple[int, ...], torch.dtype]] = [
    ((1,), torch.float32), ((3, 4), torch.float32), ((17,), torch.float64), ((100,), torch.float32),
    ((5, 7), torch.float16), ((2, 3, 4), torch.bfloat16), ((9,), torch.int64), ((1000,), torch.float64),
    ((), torch.float32), ((33,), torch.int32), ((250,), torch.float32), ((8,), torch.float16),
]
LARGE = ((512, 256), torch.float32)  # 131072 elements >= a 1 MiB bucket's share at W=2 and 4
FILL = [((5000,), torch.float32)] * 30  # 150000 float32 elements: the bucket fills and flushes by itself


def make_input(rank: int, call: int, dest: int, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s chunk for ``dest`` in call ``call``: small integers, so every sum is exact in every dtype."""
    g = torch.Generator().manual_seed(rank * 1_000_003 + call * 1009 + dest)
    return torch.randint(-8, 9, shape, generator=g).to(dtype)


def expected(world: int, rank: int, call: int, shape: Tuple[int, ...], dtype: torch.dtype,
             members: Optional[List[int]] = None) -> torch.Tensor:
    members = list(range(world)) if members is None else members
    me = members.index(rank)
    total = sum(make_input(q, call, me, shape, torch.float64) for q in members)
    return total.to(dtype)


def _issue(b: ReduceScatterBucketer, specs, rank: int, world: int, group: Any, got: Dict[int, torch.Tensor],
           immediate: List[int], first_call: int = 0, grank: Optional[int] = None) -> None:
    me = rank if grank is None else grank
    for k, (shape, dtype) in enumerate(specs, start=first_call):
        inputs = [make_input(me, k, j, shape, dtype) for j in range(world)]

        def cb(out: torch.Tensor, k: int = k) -> None:
            assert k not in got, f"callback of call {k} ran twice"
            got[k] = out.clone()  # the bucket's output buffer is released after the flush

        b.reduce_scatter_async(inputs, group, callback_fn=cb)
        if k in got:
            immediate.append(k)


def _catch(fn) -> Optional[str]:
    try:
        fn()
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def worker(rank: int, world: int, out_dir: str) -> None:
    out: Dict[str, Any] = {}

    # 1. small inputs of several sizes and dtypes, then a large one that bypasses the bucket
    #    (max_in_flight=0: every issued reduce-scatter completes before the call returns)
    b = ReduceScatterBucketer(bucket_size_mb=MB, max_in_flight=0)
    got: Dict[int, torch.Tensor] = {}
    immediate: List[int] = []
    specs = SMALL + [LARGE]
    _issue(b, specs, rank, world, None, got, immediate)
    out["small"] = dict(before_flush=sorted(got), immediate=immediate, buckets_before=len(b.buckets),
                        buffers_before=sum(x.data.numel() for x in b.buckets.values()))
    b.flush()
    out["small"].update(got=got, buckets_after=len(b.buckets), free_after_flush=_catch(b.free))

    # 2. more than a bucket of small inputs: it flushes by itself when full
    b = ReduceScatterBucketer(bucket_size_mb=MB, max_in_flight=0)
    got, immediate = {}, []
    _issue(b, FILL, rank, world, None, got, immediate, first_call=100)
    out["fill"] = dict(before_flush=sorted(got))
    b.flush()
    out["fill"].update(got=got, buckets_after=len(b.buckets))

    # 3. free() with unflushed data raises; flush() afterwards still delivers; then free() works
    b = ReduceScatterBucketer(bucket_size_mb=MB)
    got, immediate = {}, []
    _issue(b, SMALL[:3], rank, world, None, got, immediate, first_call=200)
    out["free_unflushed"] = dict(error=_catch(b.free), before_flush=sorted(got))
    b.flush()
    out["free_unflushed"].update(got=got, free_after=_catch(b.free), buckets_after=len(b.buckets))

    # 4. wrong input count / mismatched inputs: ValueError, before any collective
    b = ReduceScatterBucketer(bucket_size_mb=MB)
    out["wrong_count"] = _catch(lambda: b.reduce_scatter_async([torch.ones(3)] * (world + 1), None))
    out["too_few"] = _catch(lambda: b.reduce_scatter_async([torch.ones(3)] * (world - 1), None))
    out["mismatched_shapes"] = _catch(lambda: b.reduce_scatter_async([torch.ones(3)] * (world - 1) + [torch.ones(4)], None))
    out["mismatched_dtypes"] = _catch(
        lambda: b.reduce_scatter_async([torch.ones(3)] * (world - 1) + [torch.ones(3, dtype=torch.float64)], None))
    out["after_errors_buckets"] = len(b.buckets)
    out["negative_size"] = _catch(lambda: ReduceScatterBucketer(bucket_size_mb=-1))
    out["negative_in_flight"] = _catch(lambda: ReduceScatterBucketer(max_in_flight=-1))

    # 5. bucket_size_mb=0: everything goes straight through
    b = ReduceScatterBucketer(bucket_size_mb=0, max_in_flight=0)
    got, immediate = {}, []
    _issue(b, SMALL, rank, world, None, got, immediate, first_call=300)
    out["nobucket"] = dict(immediate=immediate, buckets=len(b.buckets))
    b.flush()
    out["nobucket"].update(got=got)

    # 6. no callback: fine
    b = ReduceScatterBucketer(bucket_size_mb=MB)
    b.reduce_scatter_async([torch.ones(3)] * world, None)
    b.flush()
    out["no_callback_buckets"] = len(b.buckets)

    # 8. asynchronous (the default, 2 in flight): full buckets and large inputs are
    #    issued and left running; at most 2 outstanding; flush() completes them all
    b = ReduceScatterBucketer(bucket_size_mb=MB)
    got, immediate = {}, []
    most = 0
    specs = FILL + [LARGE] * 4
    for k, spec in enumerate(specs, start=500):
        _issue(b, [spec], rank, world, None, got, immediate, first_call=k)
        most = max(most, len(b.in_flight))
    out["async"] = dict(most_in_flight=most, in_flight_before_flush=len(b.in_flight), before_flush=sorted(got))
    b.flush()
    out["async"].update(got=got, in_flight_after=len(b.in_flight), free_after=_catch(b.free))

    # 7. (W=4) two groups interleaved: the world and this rank's pair, separate buckets
    if world == 4:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        pair = pairs[rank // 2]
        b = ReduceScatterBucketer(bucket_size_mb=MB)
        got, immediate = {}, []
        for k, spec in enumerate(SMALL[:6], start=400):
            _issue(b, [spec], rank, world, None, got, immediate, first_call=k)
            _issue(b, [spec], rank, 2, pair, got, immediate, first_call=k + 50, grank=rank % 2)
        out["groups"] = dict(buckets_before=len(b.buckets), before_flush=sorted(got))
        b.flush()
        out["groups"].update(got=got, buckets_after=len(b.buckets))
    save(out_dir, rank, out)
