#!/usr/bin/env python
"""Op-major (foreach) against tensor-major (per tensor) traversal of the same update ops.

The five ops of an RMSprop step over the tensors of the 16M-parameter model of
``benchmarks/step.py``, one intra-op thread: once as ``torch._foreach_*`` calls over all
tensors (each op streams every element before the next op starts), once tensor by tensor
(every op on one tensor while it is in cache).  Prints both medians::

    python benchmarks/foreach_locality.py
"""
import statistics
import time

import torch

from funcopt.bench._step_parts import case_shapes


def chain(p, g, a):
    torch._foreach_mul_(a, 0.99)
    torch._foreach_addcmul_(a, g, g, 0.01)
    d = torch._foreach_sqrt(a)
    torch._foreach_add_(d, 1e-8)
    torch._foreach_addcdiv_(p, g, d, -0.01)


def median_ms(fn, n=5):
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main():
    torch.set_num_threads(1)
    shapes = case_shapes("16M")
    ps = [torch.randn(s) for s in shapes]
    gs = [torch.randn(s) for s in shapes]
    avg = [torch.zeros(s) for s in shapes]
    whole = median_ms(lambda: chain(ps, gs, avg))
    per = median_ms(lambda: [chain([p], [g], [a]) for p, g, a in zip(ps, gs, avg)])
    print(f"{len(shapes)} tensors, {sum(p.numel() for p in ps):,} elements: foreach over all {whole:.1f} ms, "
          f"tensor by tensor {per:.1f} ms ({whole / per:.2f}x)")


if __name__ == "__main__":
    main()
