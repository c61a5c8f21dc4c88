"""Rank-side work of test_overlap.py: ZeRO overlapped with DDP, from step 1.

Every case trains three copies side by side: plain DDP + the funcopt
optimizer's ``step()`` over the whole model; DDP + the non-overlapped
``ZeroRedundancyOptimizer`` (``step()`` after backward, same partition); and
``ZeroRedundancyOptimizer(overlap_with_ddp=True)`` registered through
``hook_with_zero_step`` (or ``_interleaved``) before the first iteration.
Every parameter is read right after each ``backward()`` (before anything
else runs: no ``zero.step()``, no ``zero_grad()``, no forward), as an EMA
update or a checkpoint would: by default it must already hold this
iteration's update on every rank.  With ``sync_in_forward=True`` (the
opt-in deferral) that read must be stale on some parameter at W > 1 (the
syncs are still pending), and the next forward (its pre-hooks) or the
model's ``state_dict()`` must bring them.  Against the non-overlapped ZeRO
every iteration's loss and every parameter must be bitwise equal; against
plain DDP the largest difference is returned: 0 with the foreach formula, at most an ulp or so with CPU fused kernels, which
round the scalar tail of a vectorized loop differently when the flat
partition cuts a parameter at an unaligned element (the same for ZeRO with
or without overlap).  Zero skipped steps: the first iteration already moves
the parameters.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from funcopt.distributed import ZeroRedundancyOptimizer, hook_with_zero_step, hook_with_zero_step_interleaved
from funcopt.registry import REGISTRY
from _dist_harness import run_cases
from _dist_overlap_work import Branchy, data, first_mismatch, trained

STEPS = 5


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = REGISTRY[case.get("algo", "Adam")]
    kw = dict(spec.rich, **case.get("impl", {}))
    find_unused = case["kind"] == "unused"
    base = Branchy(never=find_unused)
    m_ref, m, m_z = base, copy.deepcopy(base), copy.deepcopy(base)
    ddp_kw = dict(bucket_cap_mb=600 / 2 ** 20, find_unused_parameters=find_unused,
                  gradient_as_bucket_view=case.get("view", False))
    d_ref, d, d_z = DDP(m_ref, **ddp_kw), DDP(m, **ddp_kw), DDP(m_z, **ddp_kw)
    o_ref = spec.cls(trained(spec, m_ref), **kw)
    zero = ZeroRedundancyOptimizer(trained(spec, m), spec.cls, overlap_with_ddp=True, **kw)
    # the non-overlapped path: the same partition, step() after backward
    z_ref = ZeroRedundancyOptimizer(trained(spec, m_z), spec.cls, **kw)
    make = hook_with_zero_step_interleaved if case.get("interleaved") else hook_with_zero_step
    deferred = case.get("deferred", False)
    d.register_comm_hook(None, make(allreduce_hook, d, zero, sync_in_forward=deferred) if deferred
                         else make(allreduce_hook, d, zero))  # the default: torch's call, unchanged
    sched = [torch.optim.lr_scheduler.StepLR(x, step_size=2, gamma=0.5) for x in (o_ref, zero, z_ref)]
    init = [p.detach().clone() for p in m.parameters()]
    out: Dict[str, Any] = {"mismatch": None, "pending_after_forward": [], "vs_plain": 0.0,
                           "pending_after_backward": [], "stale_after_backward": []}
    waits_in_step = case.get("step", True)
    forward_brings = None  # deferred, no step(): what the next forward's pre-hooks must bring
    for step in range(STEPS):
        use_side = (rank + step) % 2 == 0 if find_unused else True
        x = data(step, rank)
        o_ref.zero_grad()
        loss_ref = d_ref(x, use_side).pow(2).mean()
        loss_ref.backward()
        o_ref.step()
        z_ref.zero_grad()
        loss_z = d_z(x, use_side).pow(2).mean()
        loss_z.backward()
        z_ref.step()
        if case["kind"] == "raise" and step == 2:
            try:  # a forward that raises half-way, with syncs pending: the next zero_grad finishes them
                d(torch.zeros(4, 3), use_side)
            except RuntimeError:
                pass
            zero.zero_grad()
        else:
            m.zero_grad()  # the module's: nothing waited here, the forward pre-hooks wait
        loss = d(x, use_side).pow(2).mean()
        out["pending_after_forward"].append(len(zero._overlap.pending))
        if not torch.equal(loss, loss_z):
            out["mismatch"] = f"step {step}: loss {loss.item()} vs {loss_z.item()}"
            return out
        if forward_brings is not None:  # every module ran: each waited for its own parameters
            out["mismatch"] = first_mismatch_list(forward_brings, m, f"step {step - 1}, after the next forward")
            if out["mismatch"]:
                return out
            if step == 1:
                out["moved_at_step_1"] = [n for (n, p), q in zip(m.named_parameters(), init) if not torch.equal(p, q)]
        out["vs_plain"] = max(out["vs_plain"], (loss - loss_ref).abs().item())
        loss.backward()
        # read every parameter right after backward, before anything can wait for a sync
        read = [p.detach().clone() for p in m.parameters()]
        out["pending_after_backward"].append(len(zero._overlap.pending) + len(zero._overlap.queued))
        stale = [n for (n, p), q in zip(m_z.named_parameters(), read) if not torch.equal(p, q)]
        out["stale_after_backward"].append(stale)
        if not deferred:
            if stale:
                out["mismatch"] = f"step {step}: read right after backward, {stale} differ from the reference"
                return out
            out["vs_plain"] = max([out["vs_plain"]] + [(p - q).abs().max().item()
                                                        for p, q in zip(m_ref.parameters(), read)])
        elif step == 1:  # the model's state_dict waits for the syncs of the parameters it returns
            sd = d.module.state_dict()
            diff = [n for n, p in m_z.named_parameters() if not torch.equal(p, sd[n])]
            if diff:
                out["mismatch"] = f"step {step}: state_dict() right after backward: {diff} differ"
                return out
        if waits_in_step:
            zero.step()  # a no-op (as torch's, no update here); with the deferral it finishes the syncs
        if deferred and not waits_in_step:
            forward_brings = [p.detach().clone() for p in m_z.parameters()]
        else:
            out["mismatch"] = first_mismatch(m_z, m, step)
            out["vs_plain"] = max([out["vs_plain"]] + [(p - q).abs().max().item()
                                                        for p, q in zip(m_ref.parameters(), m.parameters())])
            if out["mismatch"]:
                return out
            if step == 0:
                out["moved_at_step_1"] = [n for (n, p), q in zip(m.named_parameters(), init) if not torch.equal(p, q)]
        for s in sched:
            s.step()
    if forward_brings is not None:
        zero.wait_sync()
        out["mismatch"] = first_mismatch(m_z, m, STEPS - 1)
        if out["mismatch"]:
            return out
    if case["kind"] == "checkpoint":
        zero.consolidate_state_dict(to=0)
        z_ref.consolidate_state_dict(to=0)
        if rank == 0:
            sd, sr = zero.state_dict(), z_ref.state_dict()
            for i, e in sr["state"].items():
                for k, v in e.items():
                    if not torch.equal(v, sd["state"][i][k]):
                        out["mismatch"] = f"state[{i}][{k}] differs"
    out["buckets"] = zero._overlap.buckets_stepped
    out["trained"] = [n for n, p in m.named_parameters() if n != "never" and any(p is q for q in trained(spec, m))]
    return out


def first_mismatch_list(want: List[torch.Tensor], model: torch.nn.Module, when: str) -> Optional[str]:
    for (n, p), q in zip(model.named_parameters(), want):
        if not torch.equal(p, q):
            return f"{when}: {n} differs by {(p - q).abs().max().item():.3g}"
    return None


def cases() -> List[Dict[str, Any]]:
    # (not the rules with per-step group values: overlap_with_ddp refuses them at construction)
    out = [dict(kind="plain", algo=name, name=f"zero-{name}") for name, spec in REGISTRY.items()
           if not (spec.cls.group_state or spec.cls.phases != 1)]
    out.append(dict(kind="unused", algo="Adam", impl=dict(foreach=True), name="zero-unused-foreach"))
    out += [dict(kind="plain", algo="Adam", interleaved=True, name="zero-interleaved"),
            dict(kind="plain", algo="SGD", view=True, interleaved=True, name="zero-bucket-view"),
            dict(kind="unused", algo="Adam", name="zero-unused"),
            dict(kind="raise", algo="Adam", interleaved=True, name="zero-raise"),
            dict(kind="checkpoint", algo="Adam", name="zero-checkpoint"),
            # without zero.step(): backward alone must leave every parameter current
            dict(kind="plain", algo="AdamW", step=False, name="zero-no-step"),
            dict(kind="plain", algo="SGD", view=True, step=False, name="zero-bucket-view-no-step"),
            # the opt-in deferral: syncs pending after backward, waited for by the next forward
            dict(kind="plain", algo="Adam", deferred=True, step=False, name="zero-deferred"),
            dict(kind="unused", algo="Adam", deferred=True, interleaved=True, name="zero-deferred-interleaved"),
            dict(kind="raise", algo="Adam", deferred=True, interleaved=True, name="zero-deferred-raise")]
    return out


def case(name: str) -> Dict[str, Any]:
    return next(c for c in cases() if c["name"] == name)


def work(rank: int, world: int, out_dir: str) -> None:
    run_cases(rank, out_dir, cases(), run_case, name="zero")
