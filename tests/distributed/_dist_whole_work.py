"""What the ranks of tests/distributed/test_zero_clip.py run, and the single-process oracle.

Two kinds of case, each a short training run of the harness's ``Net``:

* ``clip``: ZeroRedundancyOptimizer.clip_grad_norm before every step (ZeRO-1
  flat/greedy, ZeRO-2 flat/greedy, norms 2, 3, inf, a mixed-dtype model);
  the oracle clips the unsharded gradients with torch.nn.utils.clip_grad_norm_;
* ``whole``: every registry algorithm that needs whole parameters
  (``spec.whole_params``: Adafactor, Muon) through ZeRO with the default
  partition (greedy), stage 1 and 2, as the torch.optim and the funcopt class,
  over the parameters the class accepts (Muon: the matrices); the oracle is
  torch.optim on one process.  ``partition="flat"`` must be refused.

Every rank computes the loss of its slice of the batch; the gradient is
averaged over ranks (ZeRO-1: all-reduce here, as DDP would; ZeRO-2: the
optimizer's reduce-scatter), which is the full-batch gradient.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.nn.functional as F

from funcopt.distributed import ZeroRedundancyOptimizer
from funcopt.registry import REGISTRY

from _dist_harness import Net, allreduce_mean_grads, batch, local_slice, run_cases, snapshot

STEPS = 6


def accepted(name: str, params: List[torch.Tensor]) -> List[torch.Tensor]:
    """The parameters the algorithm's class takes (asked of the class itself: Muon refuses non-matrices)."""
    spec = REGISTRY[name]
    out = []
    for p in params:
        try:
            spec.cls([p.detach().clone().requires_grad_()], **spec.rich)
        except ValueError:
            continue
        out.append(p)
    return out


def clip_cases() -> List[Dict[str, Any]]:
    base = dict(kind="clip", algo="Adam", cls="funcopt", stage=1, partition="flat", norm=2.0, max_norm=0.05,
                model={}, bucket_mb=25)
    variants = [
        dict(name="clip-z1-flat-l2"),
        dict(name="clip-z1-greedy-inf", partition="greedy", norm=float("inf"), algo="SGD", cls="torch", max_norm=0.02),
        dict(name="clip-z1-flat-l3-mixed", norm=3.0, model=dict(mixed=True)),
        dict(name="clip-z2-flat-l2", stage=2),
        dict(name="clip-z2-greedy-inf", stage=2, partition="greedy", norm=float("inf"), max_norm=0.02),
        dict(name="clip-z2-flat-mixed-nobucket", stage=2, model=dict(mixed=True), bucket_mb=0, algo="SGD"),
        dict(name="clip-z2-large-max-norm", stage=2, max_norm=1e6),  # returns the norm, scales by 1
    ]
    return [dict(base, **v) for v in variants]


def whole_cases() -> List[Dict[str, Any]]:
    out = []
    for name, spec in REGISTRY.items():
        if not spec.whole_params:
            continue
        for stage, cls in ((1, "torch"), (2, "funcopt")):
            out.append(dict(kind="whole", name=f"whole-{name}-z{stage}", algo=name, cls=cls, stage=stage,
                            partition=None, norm=None, max_norm=None, model={}, bucket_mb=25))
        out.append(dict(kind="refuse-flat", name=f"refuse-flat-{name}", algo=name))
    return out


def cases_for(world: int) -> List[Dict[str, Any]]:
    return clip_cases() + (whole_cases() if world == 2 else [])


def _optimized(case: Dict[str, Any], model: Net) -> List[torch.Tensor]:
    return accepted(case["algo"], list(model.parameters()))


def _hyper(case: Dict[str, Any]) -> Dict[str, Any]:
    return dict(REGISTRY[case["algo"]].rich)


def reference(case: Dict[str, Any]) -> Dict[str, Any]:
    """torch.optim on one process, full batch, torch.nn.utils.clip_grad_norm_."""
    model = Net(**case["model"])
    params = _optimized(case, model)
    opt = REGISTRY[case["algo"]].torch_cls(params, **_hyper(case))
    norms = []
    for step in range(STEPS):
        x, y = batch(step, model)
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        if case["norm"] is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(params, case["max_norm"], case["norm"]))
        opt.step()
    return dict(params=snapshot(params), norms=norms, state=opt.state_dict())


def run_case(case: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    spec = REGISTRY[case["algo"]]
    if case["kind"] == "refuse-flat":
        model = Net()
        try:
            ZeroRedundancyOptimizer(_optimized(case, model), spec.cls, partition="flat", **spec.rich)
        except ValueError as e:
            return dict(error=str(e))
        return dict(error=None)
    model = Net(**case["model"])
    params = _optimized(case, model)
    cls = spec.torch_cls if case["cls"] == "torch" else spec.cls
    kw = {} if case["partition"] is None else dict(partition=case["partition"])
    opt = ZeroRedundancyOptimizer(params, cls, zero_stage=case["stage"], bucket_size_mb=case["bucket_mb"],
                                  **kw, **_hyper(case))
    norms = []
    for step in range(STEPS):
        x, y = batch(step, model)
        model.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        if case["stage"] == 1:
            allreduce_mean_grads(list(model.parameters()))
        if case["norm"] is not None:
            norms.append(opt.clip_grad_norm(case["max_norm"], case["norm"]))
        opt.step()
    opt.consolidate_state_dict(to=0)
    return dict(params=snapshot(params), norms=norms, partition=opt.partition,
                state=opt.state_dict() if rank == 0 else None)


def worker(rank: int, world: int, out_dir: str, cases: List[Dict[str, Any]]) -> None:
    run_cases(rank, out_dir, cases, lambda case: run_case(case, rank, world))
