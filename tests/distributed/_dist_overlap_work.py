"""Rank-side work of test_overlap.py: ddp_step_hook against DDP + optimizer.step().

Every case trains two copies of one model side by side in the same ranks:
the reference (DDP's built-in all-reduce, then ``opt.step()``) and the
overlapped one (``ddp_step_hook``), and compares parameters bitwise after
every iteration and the optimizer state at the end.  A case returns
``{"mismatch": None or where, "buckets": ..., "moved": ...}``.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import funcopt
from funcopt.distributed import ddp_step_hook
from funcopt.registry import REGISTRY
from _dist_harness import run_cases

STEPS = 5
WIDTH = 12


class Branchy(nn.Module):
    """A frozen input layer, three trainable layers, a branch used by some ranks
    on some steps only, and a parameter no rank ever uses."""

    def __init__(self, never: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.l1 = nn.Linear(WIDTH, WIDTH)
        self.l2 = nn.Linear(WIDTH, WIDTH)
        self.side = nn.Linear(WIDTH, 1)
        self.never = nn.Parameter(torch.randn(3)) if never else None
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        h = torch.tanh(self.l2(torch.tanh(self.l1(self.frozen(x)))))
        out = self.head(h)
        if use_side:
            out = out + self.side(h)
        return out


def trained(spec: Any, model: nn.Module) -> List[nn.Parameter]:
    """The parameters an algorithm takes (matrix-only ones, e.g. Muon: the 2-D weights)."""
    return [p for p in model.parameters() if p.requires_grad and p.dim() >= len(spec.probe_shape)]


def data(step: int, rank: int, micro: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 + 100 * step + 10 * rank + micro)
    return torch.randn(4, WIDTH, generator=g)


def first_mismatch(a: nn.Module, b: nn.Module, step: int) -> Optional[str]:
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        if not torch.equal(p, q):
            return f"step {step}: {n} differs by {(p - q).abs().max().item():.3g}"
    return None


def state_mismatch(o_ref: Any, o: Any) -> Optional[str]:
    sr, s = o_ref.state_dict(), o.state_dict()
    if sr["param_groups"] != s["param_groups"]:
        return "param_groups differ"
    if set(sr["state"]) != set(s["state"]):
        return f"state ids {sorted(s['state'])} vs {sorted(sr['state'])}"
    for i, e in sr["state"].items():
        for k, v in e.items():
            if not _same(v, s["state"][i][k]):
                return f"state[{i}][{k}] differs"
    return None


def _same(v: Any, w: Any) -> bool:
    """Bitwise equal state values; lists element by element (SOAP's GG / Q: a matrix, or [], per dimension)."""
    if isinstance(v, (list, tuple)):
        return isinstance(w, (list, tuple)) and len(v) == len(w) and all(map(_same, v, w))
    if isinstance(v, torch.Tensor):
        return isinstance(w, torch.Tensor) and torch.equal(v, w)
    return v == w


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = REGISTRY[case.get("algo", "Adam")]
    kw = dict(spec.rich)
    find_unused = case["kind"] in ("unused", "scaler")
    base = Branchy(never=find_unused)
    m_ref, m = base, copy.deepcopy(base)
    ddp_kw = dict(bucket_cap_mb=600 / 2 ** 20, find_unused_parameters=find_unused)
    d_ref, d = DDP(m_ref, **ddp_kw), DDP(m, **ddp_kw)
    start = 0 if case["kind"] != "add-group" else 2  # the first two trained tensors added later

    def opt_for(model: nn.Module) -> Any:
        ps = trained(spec, model)
        return spec.cls(ps[start:] if start else ps, **kw)

    o_ref, o = opt_for(m_ref), opt_for(m)
    if case.get("scripted"):
        funcopt.script(o_ref)
        funcopt.script(o)
    sched = [torch.optim.lr_scheduler.StepLR(x, step_size=2, gamma=0.5) for x in (o_ref, o)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for _ in range(2)] \
        if case["kind"] == "scaler" else [None, None]
    hook = ddp_step_hook(d, o, grad_scaler=scalers[1])
    init = [p.detach().clone() for p in m.parameters()]
    skipped: List[float] = []
    out: Dict[str, Any] = {"mismatch": None}
    for step in range(STEPS):
        use_side = (rank + step) % 2 == 0 if find_unused else True
        if case["kind"] == "add-group" and step == 2:
            for model, opt in ((m_ref, o_ref), (m, o)):
                ps = trained(spec, model)
                opt.add_param_group({"params": ps[:start], "lr": 0.02})
        if case["kind"] == "checkpoint" and step == 3:
            o_ref.load_state_dict(copy.deepcopy(o_ref.state_dict()))
            o.load_state_dict(copy.deepcopy(o.state_dict()))
        for k, (ddp, opt) in enumerate(((d_ref, o_ref), (d, o))):
            micro = 2 if case["kind"] == "no-sync" else 1
            for j in range(micro):
                sync = j == micro - 1
                with (contextlib.nullcontext() if sync else ddp.no_sync()):
                    loss = ddp(data(step, rank, j), use_side).pow(2).mean()
                    if case["kind"] == "scaler" and step == 2 and rank == world - 1:
                        loss = loss * float("inf")  # one rank overflows: every rank must skip
                    if scalers[k] is not None:
                        loss = scalers[k].scale(loss)
                    loss.backward()
            if k == 0:
                if scalers[0] is not None:
                    scalers[0].step(opt)
                    scalers[0].update()
                else:
                    opt.step()
            else:
                if scalers[1] is not None:
                    skipped.append(float(hook.found_inf.item()))
                    scalers[1].update()
                try:
                    opt.step()
                    out["mismatch"] = "optimizer.step() after an overlapped backward did not raise"
                except RuntimeError as e:
                    if "already ran inside backward" not in str(e):
                        raise
            opt.zero_grad()
        for s in sched:
            s.step()
        out["mismatch"] = out["mismatch"] or first_mismatch(m_ref, m, step)
        if out["mismatch"]:
            return out
    out["mismatch"] = state_mismatch(o_ref, o)
    if scalers[0] is not None and scalers[0].get_scale() != scalers[1].get_scale():
        out["mismatch"] = f"scale {scalers[1].get_scale()} vs {scalers[0].get_scale()}"
    out["buckets"] = hook.steps
    out["skipped"] = skipped
    out["moved"] = [n for (n, p), q in zip(m.named_parameters(), init) if not torch.equal(p, q)]
    out["trained"] = [n for n, p in m.named_parameters() if n != "never" and any(p is q for q in trained(spec, m))]
    hook.remove()
    o.step()  # allowed again once removed
    return out


def cases(world: int = 2) -> List[Dict[str, Any]]:
    """Every algorithm at W=2; at W=1 and W=4 the algorithms with a fused kernel
    and half of the foreach-only ones each, rotating (every algorithm at two
    world sizes; FUNCOPT_FULL_GRID=1: every algorithm at every world size)."""
    import os

    full = os.environ.get("FUNCOPT_FULL_GRID") == "1"
    names = []
    k = 0
    for name, spec in REGISTRY.items():
        if spec.cls.group_state or spec.cls.phases != 1:
            continue  # a rule with per-step group values: ddp_step_hook refuses it (test_backward)
        fused = "cpu" in spec.fused_devices
        if full or world == 2 or fused or k % 2 == (0 if world == 4 else 1):
            names.append(name)
        if not fused:
            k += 1
    out = [dict(kind="plain", algo=name, name=f"plain-{name}") for name in names]
    out.append(dict(kind="plain", algo="Adam", scripted=True, name="plain-Adam-scripted"))
    for kind in ("unused", "no-sync", "scaler", "add-group", "checkpoint"):
        out.append(dict(kind=kind, name=kind))
    return out


def work(rank: int, world: int, out_dir: str) -> None:
    run_cases(rank, out_dir, cases(world), run_case)
