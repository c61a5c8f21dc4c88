"""Rank-side work of test_zero_forward_sync.py: ZeRO's parameter sync waited
for per module in the next forward (``ZeroRedundancyOptimizer.sync_in_forward``).

Every case trains two copies side by side under DDP: the plain ZeRO (the
sync waited for at the end of ``step()``) and the same ZeRO with
``sync_in_forward(ddp)``, small broadcast buckets so that a step issues many
broadcasts.  Every iteration's loss (a forward whose pre-hooks waited for
the sync) and every parameter must be bitwise equal.  It also records
whether ``step()`` returned with broadcasts still in flight (it must, at
W > 1: that is the overlap) and that none were left after the forward.
The plain ZeRO itself is checked against a single-process run in
test_zero.py; here the first iteration is also compared with plain DDP + the
same funcopt optimizer (to float32 rounding: fused CPU kernels round a
partition-cut tail differently, see _dist_zero_overlap_work).
"""
from __future__ import annotations

import copy
import os
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from funcopt.distributed import ZeroRedundancyOptimizer
from funcopt.registry import REGISTRY
from _dist_harness import run_cases
from _dist_overlap_work import Branchy, data, first_mismatch, state_mismatch, trained

STEPS = 4


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    rank = dist.get_rank()
    spec = REGISTRY[case.get("algo", "Adam")]
    kw = dict(spec.rich, **case.get("impl", {}))
    base = Branchy(never=False)
    if case["kind"] == "strided":  # a non-contiguous parameter: its home is a copy
        with torch.no_grad():
            w = base.l2.weight
            base.l2.weight = nn.Parameter(w.detach().t().contiguous().t())
    m_ref, m, m_plain = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    d_ref, d, d_plain = DDP(m_ref), DDP(m), DDP(m_plain)
    start = 2 if case["kind"] == "add-group" else 0
    zkw = dict(kw, zero_stage=case.get("stage", 1), bucket_size_mb=case.get("bucket_mb", 0),
               parameters_as_bucket_view=case.get("view", False))
    z_ref = ZeroRedundancyOptimizer(trained(spec, m_ref)[start:], spec.cls, **zkw)
    zero = ZeroRedundancyOptimizer(trained(spec, m)[start:], spec.cls, **zkw)
    plain = spec.cls(trained(spec, m_plain), **kw)
    handle = zero.sync_in_forward(d)
    sched = [torch.optim.lr_scheduler.StepLR(x, step_size=2, gamma=0.5) for x in (z_ref, zero)]
    out: Dict[str, Any] = {"mismatch": None, "in_flight_after_step": [], "in_flight_after_forward": []}
    for step in range(STEPS):
        x = data(step, rank)
        if case["kind"] == "add-group" and step == 2:
            for z, mm in ((z_ref, m_ref), (zero, m)):
                z.add_param_group({"params": trained(spec, mm)[:start]})
        z_ref.zero_grad()
        loss_ref = d_ref(x).pow(2).mean()
        loss_ref.backward()
        z_ref.step()
        if case["kind"] == "raise" and step == 1:
            try:  # a forward that raises half-way with broadcasts in flight
                d(torch.zeros(4, 3))
            except RuntimeError:
                pass
        zero.zero_grad()
        loss = d(x).pow(2).mean()
        out["in_flight_after_forward"].append(zero._sync.pending)
        if not torch.equal(loss, loss_ref):
            out["mismatch"] = f"step {step}: loss {loss.item()} vs {loss_ref.item()}"
            return out
        loss.backward()
        zero.step()
        out["in_flight_after_step"].append(zero._sync.pending)
        if step == 0 and start == 0:
            m_plain.zero_grad()
            d_plain(x).pow(2).mean().backward()
            plain.step()
            zero.wait_sync()
            out["vs_plain"] = max((p - q).abs().max().item() for p, q in zip(m_plain.parameters(), m.parameters()))
        for s in sched:
            s.step()
    if case["kind"] == "state_dict":  # the module's state_dict waits for the sync
        sd = m.state_dict()
        out["in_flight_after_state_dict"] = zero._sync.pending
        if any(not torch.equal(v, w) for v, w in zip(sd.values(), m_ref.state_dict().values())):
            out["mismatch"] = "module state_dict differs"
    zero.wait_sync()
    out["mismatch"] = out["mismatch"] or first_mismatch(m_ref, m, STEPS)
    zero.consolidate_state_dict(to=0)
    z_ref.consolidate_state_dict(to=0)
    if rank == 0 and out["mismatch"] is None:
        out["mismatch"] = state_mismatch(z_ref, zero)
    handle.remove()
    zero.zero_grad()
    d(data(STEPS, rank)).pow(2).mean().backward()
    zero.step()
    out["in_flight_after_remove"] = zero._sync.pending
    return out


def cases(world: int = 2) -> List[Dict[str, Any]]:
    """Every algorithm at W=2 (FUNCOPT_FULL_GRID=1: at every world size), the
    special cases at every world size."""
    full = world == 2 or os.environ.get("FUNCOPT_FULL_GRID") == "1"
    out = [dict(kind="plain", algo=name, name=f"fwd-{name}") for name in REGISTRY if full or name == "Adam"]
    out += [dict(kind="plain", algo="Adam", stage=2, name="fwd-zero2"),
            dict(kind="plain", algo="SGD", view=True, name="fwd-bucket-view"),
            dict(kind="plain", algo="Adam", stage=2, view=True, bucket_mb=1, name="fwd-zero2-view"),
            dict(kind="strided", algo="AdamW", name="fwd-strided"),
            dict(kind="add-group", algo="Adam", name="fwd-add-group"),
            dict(kind="raise", algo="Adam", name="fwd-raise"),
            dict(kind="state_dict", algo="SGD", name="fwd-state-dict")]
    return out


def work(rank: int, world: int, out_dir: str) -> None:
    run_cases(rank, out_dir, cases(world), run_case, name="fwd")
