"""Global-norm gradient clipping for ZeroRedundancyOptimizer (``clip_grad_norm``).

Each rank takes the norm of the gradient elements it owns -- ZeRO-1: its
segments of ``p.grad``; ZeRO-2: its gradient shards -- and one all-reduce
combines them (sum of ``p``-th powers in float64, max for ``inf``).  Every
rank then scales what it holds (ZeRO-1: every ``p.grad``, which DDP made equal
on all ranks; ZeRO-2: its shards) by ``min(1, max_norm / (total + 1e-6))``,
the coefficient ``torch.nn.utils.clip_grad_norm_`` uses, computed in the same
dtype.  The norm equals that of the unsharded gradients to rounding (the sum
runs in another order).
"""
from __future__ import annotations

import functools
import math
from typing import Any, List

import torch
import torch.distributed as dist
from torch import Tensor

from ...clip import clip_grads_with_norm_, total_norm
from .. import _comm


def _owned(zero: Any) -> List[Tensor]:
    """The gradient elements this rank owns (no copies where avoidable)."""
    if zero._grads is not None:
        return list(zero._grads.ready().values())
    params = zero._params()
    out: List[Tensor] = []
    for s in zero._segments:
        g = params[s.param].grad
        if g is None:
            continue
        if g.layout != torch.strided:
            g = g.to_dense()
        if s.start == 0 and s.length == g.numel():
            out.append(g)
        else:
            out.append(g.reshape(-1)[s.start: s.start + s.length])
    return out


@torch.no_grad()
def clip_grad_norm(zero: Any, max_norm: float, norm_type: float = 2.0) -> Tensor:
    """See :meth:`ZeroRedundancyOptimizer.clip_grad_norm`.  Collective."""
    norm_type = float(norm_type)
    max_norm = float(max_norm)
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm: norm_type must be > 0 (or inf), got {norm_type}")
    params = zero._params()
    dtype = functools.reduce(torch.promote_types, [p.dtype for p in params])
    mine = _owned(zero)
    local = total_norm(mine, norm_type).double().reshape(1)
    dev = _comm.comm_device(zero.process_group)
    if math.isinf(norm_type):
        combined = local.to(dev)
        if zero.world_size > 1:
            dist.all_reduce(combined, op=dist.ReduceOp.MAX, group=zero.process_group)
        total = combined
    else:
        combined = local.pow(norm_type).to(dev)
        if zero.world_size > 1:
            dist.all_reduce(combined, op=dist.ReduceOp.SUM, group=zero.process_group)
        total = combined.pow(1.0 / norm_type)
    total = total.reshape(()).to(device=params[0].device, dtype=dtype)
    if zero._grads is not None:
        clip_grads_with_norm_(mine, max_norm, total)
        return total
    grads = [p.grad for p in params if p.grad is not None]
    clip_grads_with_norm_([g for g in grads if g.layout == torch.strided], max_norm, total)
    sparse = [g for g in grads if g.layout != torch.strided]
    if sparse:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in sparse:
            g.mul_(coef.to(g.device))
    return total
