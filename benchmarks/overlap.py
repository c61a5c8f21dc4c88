#!/usr/bin/env python
"""The step inside backward: whole-iteration time at W ranks (gloo), and step_in_backward's gradient memory.

Whole iterations (zero_grad + forward + backward + step + parameter sync), the
peers interleaved round by round in one run (each round runs one iteration of
every peer, in rotating order), each round's time divided by that round's
``ddp_adam``; the table gives the median ratio and its min-max over rounds:

* ``ddp_adam``: DDP + ``torch.optim.Adam(fused=True)`` (1.00)
* ``ddp_fadam``: DDP + scripted ``funcopt.Adam`` stepped after backward
* ``ddp_hook``: DDP + ``funcopt.distributed.ddp_step_hook`` (the step inside backward)
* ``torch_zero``: DDP + torch's ``ZeroRedundancyOptimizer`` (Adam fused)
* ``torch_zero_ov``: torch's ZeRO with ``overlap_with_ddp=True`` and its
  ``hook_with_zero_step`` (torch refuses gloo; ``--torch-overlap`` lifts that
  check for the measurement; its skipped steps are counted)
* ``f_z1``: DDP + funcopt ZeRO-1 (flat), ``step()`` after backward
* ``f_z1_ov`` / ``f_z1_ov_il``: funcopt ZeRO-1 ``overlap_with_ddp=True`` with
  ``hook_with_zero_step`` / ``hook_with_zero_step_interleaved`` (every
  parameter current when backward returns, torch's contract)
* ``f_z1_ov_fwd``: ``hook_with_zero_step(..., sync_in_forward=True)``: the
  syncs left running after backward, waited for by the next forward
* ``f_z1_fwd``: funcopt ZeRO-1, ``step()`` after backward, the parameter sync
  behind the next forward (``sync_in_forward``)
* ``f_z2`` / ``f_z2_fwd``: funcopt ZeRO-2, plain sync / ``sync_in_forward``

Each round times ``--block`` consecutive iterations of a peer and then waits
for whatever it left in flight (``wait_sync()``), so a sync cannot finish
for free while the other peers run.

Then, in this process, ``step_in_backward`` peak gradient bytes against plain
backward on a 12-layer model of the same width.

    python benchmarks/overlap.py                  # W=2, 16M parameters
    python benchmarks/overlap.py --params 4M --rounds 8 --torch-overlap
    python benchmarks/overlap.py --profile runs/overlap --profile-peers ddp_adam,f_z1_ov,f_z1_fwd

``--profile DIR``: after the timed rounds, each rank profiles ``--block``
iterations of every peer in ``--profile-peers`` (torch.profiler, TensorBoard
traces in ``DIR``, view with ``tensorboard --logdir DIR``, torch-tb-profiler)
and rank 0 prints, per peer, the CPU time in its main phases.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

import funcopt
from funcopt.bench._zero_parts import build_model, make_batches, parse_size
from funcopt.distributed.launch import launch

PEERS = ["ddp_adam", "ddp_fadam", "ddp_hook", "torch_zero", "torch_zero_ov", "f_z1", "f_z1_ov", "f_z1_ov_il",
         "f_z1_ov_fwd", "f_z1_fwd", "f_z2", "f_z2_fwd"]


def make(key: str, base: torch.nn.Module, lr: float, torch_overlap: bool) -> Dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as DDP

    from funcopt.distributed import (ZeroRedundancyOptimizer, ddp_step_hook, hook_with_zero_step,
                                     hook_with_zero_step_interleaved)

    model = copy.deepcopy(base)
    ddp = DDP(model)
    step = True
    if key == "ddp_adam":
        opt = torch.optim.Adam(model.parameters(), lr=lr, fused=True)
    elif key in ("ddp_fadam", "ddp_hook"):
        opt = funcopt.script(funcopt.Adam(model.parameters(), lr=lr))
        if key == "ddp_hook":
            ddp_step_hook(ddp, opt)
            step = False
    elif key == "torch_zero":
        opt = TorchZero(model.parameters(), optimizer_class=torch.optim.Adam, lr=lr, fused=True)
    elif key == "torch_zero_ov":
        if not torch_overlap:
            return {}
        opt = TorchZero(model.parameters(), optimizer_class=torch.optim.Adam, overlap_with_ddp=True, lr=lr)
        real = ddp_zero_hook.dist.get_backend
        ddp_zero_hook.dist.get_backend = lambda pg: "nccl"  # torch refuses gloo; measured anyway
        try:
            ddp.register_comm_hook(None, ddp_zero_hook.hook_with_zero_step(allreduce_hook, ddp, opt))
        finally:
            ddp_zero_hook.dist.get_backend = real
        step = False
    elif key in ("f_z1_fwd", "f_z2", "f_z2_fwd"):
        opt = ZeroRedundancyOptimizer(model.parameters(), funcopt.Adam, zero_stage=1 if key == "f_z1_fwd" else 2,
                                      lr=lr)
        if key.endswith("_fwd"):
            opt.sync_in_forward(ddp)
    else:
        opt = ZeroRedundancyOptimizer(model.parameters(), funcopt.Adam, overlap_with_ddp=key != "f_z1", lr=lr)
        if key != "f_z1":
            make_hook = hook_with_zero_step_interleaved if key == "f_z1_ov_il" else hook_with_zero_step
            ddp.register_comm_hook(None, make_hook(allreduce_hook, ddp, opt, sync_in_forward=key == "f_z1_ov_fwd"))
            step = False
    return dict(key=key, model=model, ddp=ddp, opt=opt, step=step, skipped=0)


def iterations(peer: Dict[str, Any], x: torch.Tensor, y: torch.Tensor, block: int) -> float:
    """Seconds per iteration over ``block`` consecutive iterations, then a wait
    for anything left in flight."""
    t0 = time.perf_counter()
    untimed = 0.0  # torch_zero_ov's skip check (a parameter copy and a compare)
    for _ in range(block):
        before = None
        if peer["key"] == "torch_zero_ov":
            tc = time.perf_counter()
            before = next(peer["model"].parameters()).detach().clone()
            untimed += time.perf_counter() - tc
        peer["opt"].zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(peer["ddp"](x), y)
        loss.backward()
        if peer["step"]:
            peer["opt"].step()
        if before is not None:
            tc = time.perf_counter()
            # torch's overlap syncs at the end of backward; an unchanged parameter: a skipped step
            peer["skipped"] += int(torch.equal(before, next(peer["model"].parameters())))
            untimed += time.perf_counter() - tc
    if hasattr(peer["opt"], "wait_sync"):
        peer["opt"].wait_sync()
    return (time.perf_counter() - t0 - untimed) / block


def rank_main(rank: int, world: int, args: argparse.Namespace) -> Dict[str, Any]:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    base = build_model(args.params, args.width, args.seed)
    peers = [p for p in (make(k, base, args.lr, args.torch_overlap) for k in args.peers) if p]
    batches = make_batches(args.warmup + args.rounds, world, rank, args.batch, args.width, args.seed)
    times: Dict[str, List[float]] = {p["key"]: [] for p in peers}
    for r, (x, y) in enumerate(batches):
        order = peers[r % len(peers):] + peers[:r % len(peers)]
        for p in order:
            dist.barrier()
            t = iterations(p, x, y, args.block)
            if r >= args.warmup:
                times[p["key"]].append(t)
    skipped = {p["key"]: p["skipped"] for p in peers if p["key"] == "torch_zero_ov"}
    phases: Dict[str, Dict[str, float]] = {}
    if args.profile:
        x, y = batches[-1]
        for p in peers:
            if p["key"] in args.profile_peers:
                dist.barrier()
                phases[p["key"]] = profile_peer(p, x, y, args.block, args.profile, rank)
    return dict(times=times, skipped=skipped, phases=phases)


PHASES = ("DistributedDataParallel.forward", "autograd::engine::evaluate_function", "Optimizer.step",
          "funcopt::", "gloo:", "aten::_fused_adam_", "aten::_foreach_", "ProfilerStep")


def profile_peer(peer: Dict[str, Any], x: torch.Tensor, y: torch.Tensor, block: int, out: str,
                 rank: int) -> Dict[str, float]:
    """``block`` iterations under torch.profiler: a TensorBoard trace in ``out`` and the
    CPU milliseconds per iteration of the events whose names start with a PHASES entry."""
    from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

    from funcopt.bench._report import quiet_profiler

    handler = tensorboard_trace_handler(out, worker_name=f"{peer['key']}-rank{rank}")
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], on_trace_ready=handler) as prof:
        iterations(peer, x, y, block)
    totals: Dict[str, float] = {}
    for ev in prof.key_averages():
        for ph in PHASES:
            if ev.key.startswith(ph):
                name = ev.key if ph.endswith(("::", ":", "_")) else ph
                totals[name] = totals.get(name, 0.0) + ev.cpu_time_total / 1e3 / block
    return totals


def grad_memory(width: int, layers: int = 12) -> Dict[str, int]:
    model = build_model(layers * (width * width + width), width, 0)
    params = list(model.parameters())
    seen: List[int] = []

    def observe(_p: torch.Tensor) -> None:
        seen.append(sum(q.grad.numel() * q.grad.element_size() for q in params if q.grad is not None))

    for p in params:
        p.register_post_accumulate_grad_hook(observe)
    x = torch.randn(8, width)
    model(x).square().mean().backward()
    plain = max(seen)
    for p in params:
        p.grad = None
    seen.clear()
    opt = funcopt.Adam(params, lr=1e-4)
    layer_mb = (width * width + width) * 4 / 2 ** 20
    handle = funcopt.step_in_backward(opt, bucket_mb=layer_mb)
    model(x).square().mean().backward()
    handle.remove()
    return dict(plain=plain, in_backward=max(seen), bucket_mb_layer=int(layer_mb * 2 ** 20))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--params", type=parse_size, default=parse_size("16M"))
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds (one iteration of every peer each)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--block", type=int, default=3, help="consecutive iterations of a peer per round")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--torch-overlap", action="store_true", help="measure torch's overlap_with_ddp on gloo")
    ap.add_argument("--profile", default=None, metavar="DIR", help="TensorBoard traces of --profile-peers into DIR")
    ap.add_argument("--profile-peers", default="ddp_adam,ddp_hook,f_z1,f_z1_ov,f_z1_fwd")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.peers = args.peers.split(",")
    args.profile_peers = args.profile_peers.split(",")
    res = launch(rank_main, args.world_size, args, timeout=300, deadline=1800)
    if not res.ok:
        print(res.error_line(), *res.errors.values(), sep="\n", file=sys.stderr)
        return 1
    out = res.returns[0]
    times = out["times"]
    ref = times["ddp_adam"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"W={args.world_size} gloo, {args.params / 1e6:.0f}M parameters (width {args.width}), batch {args.batch}/rank, "
          f"{args.rounds} rounds of {args.block} iterations after {args.warmup}, commit {commit}, torch {torch.__version__}, "
          f"{os.cpu_count()} cores")
    print(f"| peer | median s/iter | ratio to ddp_adam (median, min-max over rounds) |")
    print("|---|---|---|")
    for k, ts in times.items():
        ratios = [t / r for t, r in zip(ts, ref)]
        n = (args.warmup + args.rounds) * args.block
        note = f" (skipped {out['skipped'][k]} of {n} steps)" if k in out["skipped"] else ""
        print(f"| {k}{note} | {statistics.median(ts):.3f} | {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}) |")
    mem = grad_memory(args.width)
    print(f"step_in_backward, 12 x Linear({args.width}), bucket = one layer: peak gradient bytes "
          f"{mem['in_backward'] / 2 ** 20:.1f} MiB vs plain backward {mem['plain'] / 2 ** 20:.1f} MiB "
          f"({mem['in_backward'] / mem['plain']:.3f}x)")
    for key, totals in out.get("phases", {}).items():
        top = sorted(totals.items(), key=lambda kv: -kv[1])[:8]
        print(f"profile {key} (rank 0, CPU ms/iteration, nested ranges overlap): "
              + ", ".join(f"{k} {v:.1f}" for k, v in top))
    if args.profile:
        print(f"traces: {args.profile} (tensorboard --logdir {args.profile})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(times=times, skipped=out["skipped"], grad_memory=mem, args=vars(args)), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
