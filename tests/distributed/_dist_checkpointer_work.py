"""Spawned ranks of ``test_checkpointer.py``: :class:`funcopt.distributed.Checkpointer` at W > 1.

* :func:`killed` (its own 2 processes): ZeRO-1 over DDP with funcopt Adam, saves
  every 2 steps (keep 1); the save of step 4 SIGKILLs one rank at one of
  :data:`~funcopt.distributed.checkpointer.PHASES`.
* :func:`reference` / :func:`resumed` (pooled, W=2): the uninterrupted run (the
  states after steps 2, 4, 6), and fresh jobs that resume a killed job's
  directory and train on to step 6.
* :func:`ws_save` (W=2) / :func:`ws_resume` (any W): ZeRO-2, ZeRO-3
  (``Zero3Sequential``) and FSDP2 (``fully_shard``), each with funcopt Adam, save
  at W=2 and resume at another world size; each rank's full state (gathered
  parameters, consolidated optimizer state) and RNG state.
* :func:`disk_full` (W=2): the save of step 4 meets a full disk (a rank's DCP file
  is a symlink to ``/dev/full``: ENOSPC from the kernel) on rank 1.
"""
from __future__ import annotations

import copy
import os
import signal
import time
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import funcopt
from funcopt.distributed import (Checkpointer, CheckpointWarning, DistributedError, Zero3Layer, Zero3Sequential,
                                 ZeroRedundancyOptimizer)
from funcopt.distributed.checkpointer import TMP_PREFIX

from _dist_harness import BATCH, Net, batch, local_slice, run_cases, save

HYPER = dict(lr=0.02, weight_decay=0.01)
KILL_AT = 4  # the save that is killed (the one before: step 2)
TOTAL = 6    # the resumed jobs train to here
WS_SAVE, WS_MORE = 3, 2  # world-size change: save after 3 steps, then 2 more
# plain DDP with a scripted funcopt optimizer (torch's get_state_dict path, replicated state), and a
# whole-parameter rule (Adafactor: factored rows/columns) sharded greedily by ZeRO-1 and gathered by FSDP2
WS_KINDS = ("zero2", "zero3", "fsdp2", "ddp", "zero1-adafactor", "fsdp2-adafactor")


def perturbed(model: nn.Module, by: float) -> nn.Module:
    """Another starting point (a resume must overwrite every parameter)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)
    return model


def make_net(kind: str = "small", perturb: float = 0.0) -> Net:
    """The harness's Net (it seeds torch with 0 to build), the caller's RNG stream untouched."""
    with torch.random.fork_rng(devices=[]):
        return perturbed(Net(kind), perturb)


def listing(d: str) -> List[str]:
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def step_once(model: nn.Module, wrapped: nn.Module, opt: Any, step: int, rank: int, world: int) -> None:
    x, y = batch(step, model)
    opt.zero_grad()
    torch.nn.functional.mse_loss(wrapped(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    opt.step()


# --------------------------------------------------------- ZeRO-1 over DDP
def zero1(perturb: float = 0.0) -> tuple:

    model = make_net("small", perturb)
    ddp = DDP(model)
    return model, ddp, ZeroRedundancyOptimizer(ddp.parameters(), funcopt.Adam, **HYPER)


def zero1_state(model: nn.Module, opt: ZeroRedundancyOptimizer) -> Dict[str, Any]:
    """The full parameters and the consolidated optimizer state (rank 0's; None elsewhere)."""
    opt.consolidate_state_dict(0)
    sd = copy.deepcopy(opt.state_dict()) if opt.rank == 0 else None
    return dict(params=[p.detach().clone() for p in model.parameters()], optim=sd)


def killed(rank: int, world: int, out_dir: str, ck_dir: str, phase: str, victim: int) -> None:
    """Save at step 2, then die: ``victim`` SIGKILLs itself at ``phase`` of the save of step 4."""
    model, ddp, opt = zero1()
    seen: List[tuple] = []

    def on_phase(p: str, step: int) -> None:
        seen.append((p, step))
        save(out_dir, rank, seen, "phases")
        if p == phase and step == KILL_AT and rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)

    ck = Checkpointer(ck_dir, ddp, opt, every=2, keep=1, on_phase=on_phase)
    assert ck.resume() == 0
    for step in range(KILL_AT):
        step_once(model, ddp, opt, step, rank, world)
        ck.step()
    raise AssertionError(f"rank {rank}: the save of step {KILL_AT} finished, nobody was killed at {phase}")


def reference(rank: int, world: int, out_dir: str, ck_dir: str) -> None:
    """The uninterrupted run (saving as the killed jobs do): the state after steps 2, 4 and 6,
    and the phases every rank saw."""
    model, ddp, opt = zero1()
    seen: List[tuple] = []
    ck = Checkpointer(ck_dir, ddp, opt, every=2, keep=1, on_phase=lambda p, s: seen.append((p, s)))
    assert ck.resume() == 0
    out: Dict[str, Any] = {}
    for step in range(TOTAL):
        step_once(model, ddp, opt, step, rank, world)
        if ck.step():
            out[step + 1] = zero1_state(model, opt)
    out["phases"] = seen
    out["listing"] = listing(ck_dir)
    save(out_dir, rank, out)


def resumed(rank: int, world: int, out_dir: str, ck_dir: str) -> None:
    """A fresh job on a killed job's directory: resume (another starting point), train to step 6."""
    out: Dict[str, Any] = dict(before=listing(ck_dir))
    model, ddp, opt = zero1(perturb=0.5)
    ck = Checkpointer(ck_dir, ddp, opt, every=2, keep=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["step"] = start = ck.resume()
    out["warned"] = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    out["after"] = listing(ck_dir)
    out["loaded"] = zero1_state(model, opt)
    for step in range(start, TOTAL):
        step_once(model, ddp, opt, step, rank, world)
        ck.step()
    out["final"] = zero1_state(model, opt)
    out["end"] = listing(ck_dir)
    save(out_dir, rank, out)


# -------------------------------------------------- world size changes
def ws_build(kind: str, perturb: float = 0.0) -> tuple:
    """(the unsharded module for data shapes, the trained module, optimizer)."""
    net = make_net("small", perturb)
    if kind == "zero2":
        return net, net, ZeroRedundancyOptimizer(net.parameters(), funcopt.Adam, zero_stage=2, **HYPER)
    if kind == "zero3":
        root = Zero3Sequential([Zero3Layer(nn.Sequential(net.l1, nn.Tanh())),
                                Zero3Layer(nn.Sequential(net.l2, nn.Tanh())), Zero3Layer(net.l3)])
        return net, root, funcopt.Adam(root.parameters(), **HYPER)
    if kind in ("fsdp2", "fsdp2-adafactor"):
        from torch.distributed.fsdp import fully_shard

        for layer in (net.l1, net.l2, net.l3):
            fully_shard(layer)
        fully_shard(net)
        return net, net, (funcopt.Adafactor if kind == "fsdp2-adafactor" else funcopt.Adam)(net.parameters(), **HYPER)
    if kind == "ddp":
        ddp = DDP(net)
        return net, ddp, funcopt.script(funcopt.Adam(ddp.parameters(), **HYPER))
    if kind == "zero1-adafactor":
        return net, DDP(net), ZeroRedundancyOptimizer(net.parameters(), funcopt.Adafactor, **HYPER)
    raise ValueError(kind)


def ws_full_state(kind: str, model: nn.Module, opt: Any) -> Optional[Dict[str, Any]]:
    """The whole training state, unsharded, on rank 0 (None elsewhere): the model's full
    state dict and the optimizer's state with every sharded tensor whole."""
    rank = dist.get_rank()
    if kind == "ddp":  # every rank holds it all
        sd = copy.deepcopy(opt.state_dict())
        return dict(model={k: v.clone() for k, v in model.module.state_dict().items()}, optim=sd) if rank == 0 else None
    if kind in ("zero2", "zero1-adafactor"):
        opt.consolidate_state_dict(0)
        sd = copy.deepcopy(opt.state_dict()) if rank == 0 else None
        return dict(model={k: v.clone() for k, v in model.state_dict().items()}, optim=sd) if rank == 0 else None
    if kind in ("fsdp2", "fsdp2-adafactor"):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        return dict(model=copy.deepcopy(msd), optim=copy.deepcopy(osd)) if rank == 0 else None
    # ZeRO-3: the model through full_state_dict; each chunk's optimizer state put together
    # from every rank's valid part, at its offset in the chunk's unpadded flat
    msd = model.full_state_dict(to=0)
    mine = []
    for info in model.sharded_chunks():
        if not info.trainable:
            continue
        st = opt.state.get(info.tensor, {})
        mine.append((info.name, info.numel, info.offset, info.valid,
                     {k: (v[:info.valid].clone() if k != "step" else v.clone()) for k, v in st.items()}))
    parts: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    if rank != 0:
        return None
    optim: Dict[str, Dict[str, torch.Tensor]] = {}
    for part in parts:
        for name, numel, offset, valid, st in part:
            entry = optim.setdefault(name, {})
            for k, v in st.items():
                if k == "step":
                    entry.setdefault("step", v)
                    assert torch.equal(entry["step"], v), f"{name}: step differs between ranks"
                    continue
                full = entry.setdefault(k, torch.full((numel,), float("nan"), dtype=v.dtype))
                full[offset:offset + valid] = v
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return dict(model=msd, optim=optim, groups=groups)


def ws_train(kind: str, net: nn.Module, model: nn.Module, opt: Any, steps: range, ck: Any = None) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        step_once(net, model, opt, step, rank, world)
        if ck is not None:
            ck.step()


def ws_save(rank: int, world: int, out_dir: str, root: str) -> None:
    """At W=2: train 3 steps, save (every=3), then 2 more steps (the uninterrupted run)."""
    def run(case: Dict[str, Any]) -> Dict[str, Any]:
        kind = case["name"]
        torch.manual_seed(500 + rank)  # each rank its own RNG stream
        net, model, opt = ws_build(kind)
        ck = Checkpointer(os.path.join(root, kind), model, opt, every=WS_SAVE)
        assert ck.resume() == 0
        ck.extra["kind"] = kind
        ws_train(kind, net, model, opt, range(WS_SAVE), ck)
        out = dict(rng=torch.get_rng_state(), saved=ws_full_state(kind, model, opt), steps=ck.saved_steps())
        ws_train(kind, net, model, opt, range(WS_SAVE, WS_SAVE + WS_MORE))
        out["more"] = ws_full_state(kind, model, opt)
        return out
    run_cases(rank, out_dir, [dict(name=k) for k in WS_KINDS], run)


def ws_resume(rank: int, world: int, out_dir: str, root: str) -> None:
    """At another W: a fresh (other starting point) model and optimizer resume the W=2 save;
    the full state as loaded, this rank's RNG state, and (when the batch splits evenly) the
    state after the same 2 more steps."""
    def run(case: Dict[str, Any]) -> Dict[str, Any]:
        kind = case["name"]
        torch.manual_seed(900 + rank)
        net, model, opt = ws_build(kind, perturb=0.5)
        ck = Checkpointer(os.path.join(root, kind), model, opt, every=WS_SAVE)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = dict(step=ck.resume(), rng=torch.get_rng_state(), extra=dict(ck.extra))
        out["warned"] = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
        out["loaded"] = ws_full_state(kind, model, opt)
        if BATCH % world == 0:
            ws_train(kind, net, model, opt, range(WS_SAVE, WS_SAVE + WS_MORE))
            out["more"] = ws_full_state(kind, model, opt)
        return out
    run_cases(rank, out_dir, [dict(name=k) for k in WS_KINDS], run)


# ------------------------------------------------------------ full disk
DISK_FULL_KINDS = {"zero1": "sharded", "fsdp2": "state"}  # the kind, and where rank 1's data file goes


def _dev_full_on(rank: int, victim: int, ck_dir: str, sub: str) -> Any:
    def on_phase(phase: str, step: int) -> None:
        if phase != "save-begin" or step != 4 or rank != victim:
            return
        [tmp] = [n for n in os.listdir(ck_dir) if n.startswith(TMP_PREFIX)]
        os.makedirs(os.path.join(ck_dir, tmp, sub), exist_ok=True)
        os.symlink("/dev/full", os.path.join(ck_dir, tmp, sub, f"__{rank}_0.distcp"))
    return on_phase


def disk_full(rank: int, world: int, out_dir: str, root: str) -> None:
    """Saves at step 2; the save of step 4 hits ENOSPC on rank 1; a fresh model resumes."""
    def run(case: Dict[str, Any]) -> Dict[str, Any]:
        kind = case["name"]
        ck_dir = os.path.join(root, kind)
        if kind == "zero1":
            net, model, opt = zero1()
        else:
            net, model, opt = ws_build("fsdp2")
        ck = Checkpointer(ck_dir, model, opt, every=2, on_phase=_dev_full_on(rank, 1, ck_dir, DISK_FULL_KINDS[kind]))
        out: Dict[str, Any] = {}
        for step in range(2):
            step_once(net, model, opt, step, rank, world)
            ck.step()
        out["at2"] = (zero1_state(net, opt) if kind == "zero1" else ws_full_state(kind, model, opt))
        for step in range(2, 4):
            step_once(net, model, opt, step, rank, world)
            t0 = time.monotonic()
            try:
                ck.step()
                out["error"] = None
            except DistributedError as e:
                out["error"] = str(e)
            out["seconds"] = time.monotonic() - t0
        dist.barrier()  # rank 0 removes the failed save's directory after raising
        out["after"] = listing(ck_dir)
        if kind == "zero1":
            net2, model2, opt2 = zero1(perturb=0.5)
        else:
            net2, model2, opt2 = ws_build("fsdp2", perturb=0.5)
        ck2 = Checkpointer(ck_dir, model2, opt2, every=2)
        out["step"] = ck2.resume()
        out["loaded"] = zero1_state(net2, opt2) if kind == "zero1" else ws_full_state(kind, model2, opt2)
        return out
    run_cases(rank, out_dir, [dict(name=k) for k in DISK_FULL_KINDS], run)
