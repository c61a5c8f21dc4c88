"""Spawned ranks of ``test_fsdp2_dcp.py``: FSDP2 (``fully_shard``) and DDP with every
registry algorithm, eager and scripted, checkpointed with torch.distributed.checkpoint.

Per case (``{mode}-{algorithm}-{eager|scripted}``): SAVE steps, ``get_state_dict`` +
``dcp.save``, TOTAL - SAVE more steps (the uninterrupted run); then a fresh model and
optimizer, ``get_state_dict`` + ``dcp.load`` + ``set_state_dict``, the same TOTAL -
SAVE steps (the resumed run).  Each rank returns both runs' full parameters and the
full optimizer state dict (``get_optimizer_state_dict(full_state_dict=True)``); the
parent compares them with a single-process torch.optim run on the full batch.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, get_state_dict,
                                                     set_state_dict)

from _dist_harness import Net, batch, local_slice, run_cases

import funcopt
from funcopt.registry import REGISTRY

SAVE, TOTAL = 2, 4
MODES = ("fsdp2", "ddp", "zero", "zero-dcp")


def cases() -> List[Dict[str, Any]]:
    """FSDP2 eager and scripted; DDP eager (a scripted step sees plain tensors there, as in
    the single-process tests); funcopt's ZeRO-1 (scripted by construction) stepped with
    ``step(closure)`` and ``step(closure=...)``, and checkpointed through DCP like the
    others (``zero-dcp``: ``get_state_dict`` gathers its shards on every rank)."""
    # the rules beyond torch (issue 23): FSDP2 and ZeRO through DCP (the modes whose state
    # layout is their own: DTensor shards, ZeRO's gathered pieces); DDP steps whole tensors
    # in every rank as one process does (tests/optimizers/ test them there)
    return [dict(name=f"{mode}-{name}-{'scripted' if s else 'eager'}", mode=mode, algo=name, scripted=s)
            for mode in MODES for name in REGISTRY
            if REGISTRY[name].oracle_package is None or mode in ("fsdp2", "zero-dcp")
            for s in ((False, True) if mode == "fsdp2" else (False,))]


def trainable(spec: Any, params: Any) -> List[torch.Tensor]:
    """All parameters, or the matrices for a rule defined on matrices (``probe_shape`` 2-D)."""
    params = list(params)
    return [p for p in params if p.dim() == len(spec.probe_shape)] if len(spec.probe_shape) >= 2 else params


def build(case: Dict[str, Any]):
    model = Net("small")
    if case["mode"] == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in (model.l1, model.l2, model.l3):
            fully_shard(layer)
        fully_shard(model)
        wrapped = model
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model)
    spec = REGISTRY[case["algo"]]
    if case["mode"] in ("zero", "zero-dcp"):
        from funcopt.distributed.zero import ZeroRedundancyOptimizer

        return model, wrapped, ZeroRedundancyOptimizer(trainable(spec, wrapped.parameters()), spec.cls, **spec.rich)
    opt = spec.cls(trainable(spec, wrapped.parameters()), **spec.rich)
    if case["scripted"]:
        funcopt.script(opt)
    return model, wrapped, opt


def train(model: Net, wrapped: Any, opt: Any, steps: range) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        x, y = batch(step, model)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(wrapped(local_slice(x, rank, world)), local_slice(y, rank, world))
        loss.backward()
        opt.step()


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def run_zero(case: Dict[str, Any]) -> Dict[str, Any]:
    """ZeRO stepped through a closure, by position on even steps and by keyword on odd ones."""
    model, wrapped, opt = build(case)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(TOTAL):
        x, y = batch(step, model)
        seen = []

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(wrapped(local_slice(x, rank, world)), local_slice(y, rank, world))
            loss.backward()
            seen.append(loss.detach())
            return loss

        got = opt.step(closure) if step % 2 == 0 else opt.step(closure=closure)
        losses.append((got.detach() if isinstance(got, torch.Tensor) else got, seen))
    return dict(straight=[full(p) for p in model.parameters()], losses=losses)


def run_case(case: Dict[str, Any], ckpt: str) -> Dict[str, Any]:
    if case["mode"] == "zero":
        return run_zero(case)
    model, wrapped, opt = build(case)
    train(model, wrapped, opt, range(0, SAVE))
    msd, osd = get_state_dict(wrapped, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    train(model, wrapped, opt, range(SAVE, TOTAL))
    straight = [full(p) for p in model.parameters()]
    osd_full = get_optimizer_state_dict(wrapped, opt, options=StateDictOptions(full_state_dict=True))
    state_types = sorted({type(v).__name__ for e in opt.state.values() for v in e.values()})

    model2, wrapped2, opt2 = build(case)
    msd2, osd2 = get_state_dict(wrapped2, opt2)
    sd = {"model": msd2, "optim": osd2}
    dcp.load(sd, checkpoint_id=ckpt)
    set_state_dict(wrapped2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    train(model2, wrapped2, opt2, range(SAVE, TOTAL))
    resumed = [full(p) for p in model2.parameters()]
    return dict(straight=straight, resumed=resumed, state_types=state_types,
                osd={"state": {k: {n: full(v) if isinstance(v, torch.Tensor) else v for n, v in e.items()}
                               for k, e in osd_full["state"].items()},
                     "param_groups": osd_full["param_groups"]})


def worker(rank: int, world: int, out_dir: str) -> None:
    def runner(case: Dict[str, Any]) -> Any:
        ckpt = os.path.join(out_dir, "ckpt", case["name"])
        return run_case(case, ckpt)

    run_cases(rank, out_dir, cases(), runner)
