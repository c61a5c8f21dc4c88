"""ZeRO-3 sharded checkpoint cases, run inside spawned ranks (see test_zero3_checkpoint.py).

Three jobs share one directory: ``save`` (W=4) trains, saves (with and without
the optimizer) and trains on, uninterrupted; ``load`` (W=2 and W=3) builds a
fresh model, loads and trains the same further steps; ``corrupt`` (W=2) loads
broken or foreign checkpoints and reports what every rank raised and whether
anything changed.  Models, data and optimizers are those of _dist_zero3_work.
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

import _dist_zero3_work as W
from _dist_harness import run_cases
from funcopt.distributed import DistributedError

FIRST, MORE = 3, 3  # steps before the save, steps after it

CASES = [
    dict(name="stack-adam-eager", model="stack", opt="Adam", impl="eager"),
    dict(name="stack-frozen-sgd-torch", model="stack", frozen=True, opt="SGD", impl="torch"),
    dict(name="branchy-adamw-scripted", model="branchy", opt="AdamW", impl="scripted"),
    dict(name="branchy-adagrad-eager", model="branchy", opt="Adagrad", impl="eager"),
]
BY_NAME = {c["name"]: c for c in CASES}


def _steps(model: Any, opt: Any, first: int, n: int, rank: int, world: int) -> None:
    per = W.BATCH // world
    for step in range(first, first + n):
        x, y = W.data(step)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def _fresh(case: Dict[str, Any], rank: int, world: int, opt: str = None) -> tuple:
    model = W.shard(case, W.build(case, rank), rank, world)
    c = dict(case, opt=opt) if opt else case
    return model, W.make_opt(c, model.parameters())


def _save(case: Dict[str, Any], rank: int, world: int, root: str) -> Dict[str, Any]:
    model, opt = _fresh(case, rank, world)
    _steps(model, opt, 0, FIRST, rank, world)
    at_save = model.full_state_dict(to=0)
    model.save_sharded(os.path.join(root, case["name"]), optimizer=opt)
    model.save_sharded(os.path.join(root, case["name"] + "-model"))
    _steps(model, opt, FIRST, MORE, rank, world)
    return dict(at_save=at_save, final=model.full_state_dict(to=0))


def _load(case: Dict[str, Any], rank: int, world: int, root: str) -> Dict[str, Any]:
    model, opt = _fresh(case, rank, world)
    model.load_sharded(os.path.join(root, case["name"]), optimizer=opt)
    loaded = model.full_state_dict(to=0)
    _steps(model, opt, FIRST, MORE, rank, world)
    other, _ = _fresh(case, rank, world)
    other.load_sharded(os.path.join(root, case["name"] + "-model"))  # the model alone
    return dict(loaded=loaded, final=model.full_state_dict(to=0), model_only=other.full_state_dict(to=0))


# ----------------------------------------------------------------- faults
def _file(d: str, name: str) -> str:
    [save] = [n for n in os.listdir(d) if n.startswith("save-")]
    return os.path.join(d, save, name)


def _prepare(kind: str, src: str, dst: str) -> None:
    """Rank 0: a copy of ``src`` broken in the way ``kind`` names."""
    shutil.copytree(src, dst)
    if kind == "truncated-shard":
        f = _file(dst, "__2_0.distcp")
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)
    elif kind == "missing-shard":
        os.remove(_file(dst, "__3_0.distcp"))
    elif kind == "edited-piece":
        f = _file(dst, "__1_0.distcp")
        with open(f, "r+b") as fh:
            fh.seek(os.path.getsize(f) // 2)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0xFF]))
    elif kind == "no-commit":
        os.remove(os.path.join(dst, "COMMIT.json"))


FAULTS = {
    # kind: (checkpoint copied from, model case, optimizer override)
    "truncated-shard": ("stack-adam-eager", "stack-adam-eager", None),
    "missing-shard": ("stack-adam-eager", "stack-adam-eager", None),
    "edited-piece": ("stack-adam-eager", "stack-adam-eager", None),
    "no-commit": ("stack-adam-eager", "stack-adam-eager", None),
    "other-model": ("stack-adam-eager", "stack-frozen-sgd-torch", "Adam"),
    "other-optimizer": ("stack-adam-eager", "stack-adam-eager", "SGD"),
    "no-optimizer-state": ("stack-adam-eager-model", "stack-adam-eager", None),
    "zero3-into-zero": ("stack-adam-eager", None, None),
}


def _snapshot(model: Any, opt: Any) -> List[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    out += [b.detach().clone() for b in model.buffers()]
    for entry in opt.state_dict()["state"].values():
        out += [t.detach().clone() for t in entry.values() if isinstance(t, torch.Tensor)]
    out += [torch.tensor(float(g["lr"])) for g in opt.param_groups]
    return out


def _fault(kind: str, rank: int, world: int, root: str) -> Dict[str, Any]:
    src, model_case, opt_name = FAULTS[kind]
    path = os.path.join(root, f"fault-{kind}")
    if rank == 0:
        _prepare(kind, os.path.join(root, src), path)
    dist.barrier()
    if model_case is None:  # a ZeRO-3 checkpoint into a ZeRO-1/2 optimizer
        from funcopt.distributed import ZeroRedundancyOptimizer
        net = W.build(BY_NAME["stack-adam-eager"])
        opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, lr=0.01)
        target, model, load = opt, net, (lambda: opt.load_sharded(path))
    else:
        case = dict(BY_NAME[model_case], mismatch=kind == "other-model")
        model, opt = _fresh(case, 1 if kind == "other-model" else rank, world, opt_name)
        if kind != "other-model":  # that model's layers do not compose: no forward
            _steps(model, opt, 0, 1, rank, world)
        load = lambda: model.load_sharded(path, optimizer=opt)  # noqa: E731
    if model_case is not None:
        before = _snapshot(model, opt)
    t0 = time.monotonic()
    try:
        load()
        res: Dict[str, Any] = dict(type=None, error=None)
    except Exception as e:  # noqa: BLE001 - the type is the result
        res = dict(type=type(e).__name__, error=str(e))
    res["seconds"] = time.monotonic() - t0
    if model_case is not None:
        after = _snapshot(model, opt)
        res["unchanged"] = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    return res


# ----------------------------------------------------------------- worker
def worker(rank: int, world: int, out_dir: str, role: str, root: str) -> None:
    if role == "corrupt":
        cases = [dict(name=k) for k in FAULTS]
        run_cases(rank, out_dir, cases, lambda c: _fault(c["name"], rank, world, root))
        return
    fn = _save if role == "save" else _load
    run_cases(rank, out_dir, CASES, lambda c: fn(c, rank, world, root))
