"""Children of test_group_rules.py: the rules with per-group values (issue 23) under
ZeroRedundancyOptimizer -- Schedule-Free's train()/eval() swapping each rank's shard and
bringing every shard to every rank, Prodigy's d summed over the ranks' shards -- against one
process running the same funcopt class on the whole model with the full batch."""
from __future__ import annotations

from typing import Any, Dict, List

import torch

import funcopt
from _dist_harness import Net, allreduce_mean_grads, batch, local_slice, run_cases, snapshot
from funcopt.distributed import ZeroRedundancyOptimizer

STEPS = 6
HYPER = {
    "AdamWScheduleFree": dict(lr=0.02, weight_decay=0.01, warmup_steps=2),
    "SGDScheduleFree": dict(lr=0.2, momentum=0.8),
    "Prodigy": dict(lr=1.0, d_coef=3.0, weight_decay=0.01, use_bias_correction=True),
}


def cases() -> List[Dict[str, Any]]:
    return [dict(name=f"{algo}-zero{stage}-{partition}", algo=algo, stage=stage, partition=partition)
            for algo in HYPER for stage in (1, 2) for partition in ("flat", "greedy")]


def _loss(model: Net, step: int, rank: int, world: int) -> torch.Tensor:
    x, y = batch(step, model)
    return (model(local_slice(x, rank, world)) - local_slice(y, rank, world)).pow(2).mean()


def run(case: Dict[str, Any], rank: int = 0, world: int = 1) -> Dict[str, Any]:
    """Train STEPS steps; eval() (and the eval-mode loss), train() and one more step; the
    parameters after each phase, the per-group values, on every rank."""
    model = Net("small")
    cls = getattr(funcopt, case["algo"])
    if world == 1:
        opt: Any = cls(model.parameters(), **HYPER[case["algo"]])
    else:
        opt = ZeroRedundancyOptimizer(model.parameters(), cls, partition=case["partition"],
                                      zero_stage=case["stage"], **HYPER[case["algo"]])
    out: Dict[str, Any] = {}
    params = list(model.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, step, rank, world).backward()
        if world > 1 and case["stage"] == 1:  # (ZeRO-2 reduce-scatters the gradients' mean itself)
            allreduce_mean_grads(params)
        opt.step()
    out["trained"] = snapshot(params)
    modes = hasattr(opt, "eval")  # (ZeroRedundancyOptimizer has both for every rule: a no-op without modes)
    if modes:
        opt.eval()
    out["eval"] = snapshot(params)
    with torch.no_grad():
        out["eval_loss"] = _loss(model, 100, 0, 1).item()
    if modes:
        opt.train()
    out["back"] = snapshot(params)
    out["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return out


def refuse_overlap() -> Dict[str, Any]:
    """ZeRO's overlap_with_ddp steps per DDP bucket inside backward: refused at construction
    for every rule with per-step group values (the same verdict on every rank)."""
    out = {}
    for algo in HYPER:
        model = Net("small")
        try:
            ZeroRedundancyOptimizer(model.parameters(), getattr(funcopt, algo), overlap_with_ddp=True,
                                    **HYPER[algo])
            out[algo] = None
        except ValueError as e:
            out[algo] = str(e)
    return out


def worker(rank: int, world: int, out_dir: str, todo: List[Dict[str, Any]]) -> None:
    run_cases(rank, out_dir, todo + [dict(name="refuse-overlap")],
              lambda c: refuse_overlap() if c["name"] == "refuse-overlap" else run(c, rank, world))
