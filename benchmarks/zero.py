#!/usr/bin/env python
"""ZeRO step+sync time and per-rank memory: funcopt against DDP and torch's ZeroRedundancyOptimizer.

The script launches its own ``--world-size`` processes (``torch.multiprocessing``
spawn, gloo, ``file://`` rendezvous), or, when ``RANK`` / ``WORLD_SIZE`` are set
(``torchrun``), joins the group from the environment.  Every process builds the
same model (a stack of ``Linear(width, width)`` layers, ``--params`` fp32
parameters in all) and one copy of it per peer; every peer sees the same
synthetic batches (each rank its slice of the global batch).

Peers, interleaved in the same processes (every iteration runs one training
step of every peer in turn, the starting peer rotating, a barrier before
each), so clock drift and background load hit all peers alike:

* ``ddp_adam``      DDP + ``torch.optim.Adam(fused=True)`` (state unsharded)
* ``torch_zero``    DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer(Adam, fused=True)``
* ``torch_zero_bv`` the same with ``parameters_as_bucket_view=True``
* ``f_flat``        DDP + funcopt ZeRO-1, ``partition="flat"``
* ``f_greedy``      DDP + funcopt ZeRO-1, ``partition="greedy"``
* ``f_flat_bv``     DDP + funcopt ZeRO-1 flat, ``parameters_as_bucket_view=True``
* ``f_z2``          funcopt ZeRO-2 (no DDP: gradients reduce-scattered during backward)
* ``f_z2_bv``       the same with ``parameters_as_bucket_view=True``

Each training step is timed in two parts: ``fwd+bwd`` (``zero_grad``, forward,
backward; for DDP peers it includes the gradient all-reduce, for ZeRO-2 the
reduce-scatters issued during backward) and ``step+sync`` (``opt.step()``: for
DDP+Adam the update only, for the ZeRO peers the update of the local shard plus
the parameter all-gather / broadcasts; for ZeRO-2 also the last reduce-scatter
flush).  A step's time is the slowest rank's; the figure is the median over
``--iters`` steps after ``--warmup``.

Also printed: per-rank optimizer-state bytes (torch peers: the tensors in the
(local) optimizer's ``state``; funcopt: ``opt.state_bytes()``), gradient bytes
held after backward (``p.grad`` bytes; funcopt ZeRO-2: ``opt.grad_shard_bytes()``)
and its peak during backward, next to the unsharded figures and the 1/W target;
a per-range breakdown of each ZeRO peer's ``step()`` (``torch.profiler``, the
``funcopt::zero/...`` ranges and the top ATen / gloo ops); and the raw
collective floors (gloo all-gather / all-reduce / broadcast of the same sizes).
At the end every peer's parameters are compared with DDP+Adam's.

Memory: every peer holds its own model, gradients, optimizer state (and DDP
buckets) in every process -- about 1.5 GB per peer per process at 64M
parameters (measured peak RSS is printed at the end); at 64M pick a few peers
with ``--peers``.

Examples::

    python benchmarks/zero.py                          # W=2, 16M parameters
    python benchmarks/zero.py --params 64M --iters 10 --peers ddp_adam,torch_zero,f_flat,f_flat_bv
    python benchmarks/zero.py --peers ddp_adam,f_flat --profile   # TensorBoard trace in runs/zero
    torchrun --standalone --nproc-per-node 2 benchmarks/zero.py
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PEERS = {
    "ddp_adam": "DDP + Adam(fused)",
    "torch_zero": "DDP + torch ZeRO",
    "torch_zero_bv": "DDP + torch ZeRO (bucket view)",
    "f_flat": "DDP + funcopt ZeRO-1 flat",
    "f_greedy": "DDP + funcopt ZeRO-1 greedy",
    "f_flat_bv": "DDP + funcopt ZeRO-1 flat (bucket view)",
    "f_z2": "funcopt ZeRO-2 (no DDP)",
    "f_z2_bv": "funcopt ZeRO-2 (no DDP, bucket view)",
}
MiB = 1024 * 1024


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1000, "M": 1000_000, "G": 1000_000_000}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def fmt_bytes(n: float) -> str:
    return f"{n / MiB:,.1f} MiB"


# ------------------------------------------------------------------ model / data
def build_model(n_params: int, width: int, seed: int) -> torch.nn.Module:
    layers = max(1, round(n_params / (width * width + width)))
    torch.manual_seed(seed)
    mods: List[torch.nn.Module] = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i + 1 < layers:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)


def make_batches(n: int, world: int, rank: int, batch: int, width: int, seed: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for k in range(n):
        g = torch.Generator().manual_seed(seed * 1000 + k)
        x = torch.randn(world * batch, width, generator=g)
        y = torch.randn(world * batch, width, generator=g)
        out.append((x[rank * batch:(rank + 1) * batch].contiguous(), y[rank * batch:(rank + 1) * batch].contiguous()))
    return out


# ------------------------------------------------------------------------ peers
class Peer:
    def __init__(self, key: str, model: torch.nn.Module, net: torch.nn.Module, opt: Any):
        self.key, self.name = key, PEERS[key]
        self.model, self.net, self.opt = model, net, opt
        self.params = list(model.parameters())
        self.fb: List[float] = []
        self.st: List[float] = []
        self.grad_bytes = 0
        self.grad_pending = 0
        self.grad_peak = 0

    def is_funcopt(self) -> bool:
        return self.key.startswith(("f_", "p_"))

    def state_bytes(self) -> int:
        if self.is_funcopt():
            return int(self.opt.state_bytes())
        optim = self.opt.optim if hasattr(self.opt, "optim") else self.opt  # torch ZeRO: its local optimizer
        return sum(t.numel() * t.element_size() for st in optim.state.values() for t in st.values()
                   if isinstance(t, torch.Tensor))

    def held_grad_bytes(self) -> int:
        if self.key.startswith("f_z2"):
            return int(self.opt.grad_shard_bytes())
        return sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)

    def bucket_bytes(self) -> int:
        """ZeRO-2: the reduce-scatter bucket still waiting for its flush (not in grad_shard_bytes())."""
        bucketer = getattr(self.opt, "_bucketer", None)
        if bucketer is None:
            return 0
        # the part holding data (world rows x offset); the buffer itself is allocated at full
        # capacity (world x bucket_size_mb / world), untouched pages beyond the offset aside
        return sum(b.data.size(0) * b.offset * b.data.element_size() for b in bucketer.buckets.values())


def make_peer(key: str, base: torch.nn.Module, lr: float, bucket_mb: int, ddp_kw: Dict[str, Any]) -> Peer:
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as DDP

    from funcopt.distributed import ZeroRedundancyOptimizer as FZero

    model = copy.deepcopy(base)
    if key == "ddp_adam":
        opt = torch.optim.Adam(model.parameters(), lr=lr, fused=True)
    elif key in ("torch_zero", "torch_zero_bv"):
        opt = TorchZero(model.parameters(), optimizer_class=torch.optim.Adam,
                        parameters_as_bucket_view=(key == "torch_zero_bv"), lr=lr, fused=True)
    elif key in ("f_flat", "f_greedy", "f_flat_bv"):
        opt = FZero(model.parameters(), torch.optim.Adam, parameters_as_bucket_view=(key == "f_flat_bv"),
                    partition="greedy" if key == "f_greedy" else "flat", bucket_size_mb=bucket_mb, lr=lr)
    elif key in ("f_z2", "f_z2_bv"):
        opt = FZero(model.parameters(), torch.optim.Adam, zero_stage=2, bucket_size_mb=bucket_mb, lr=lr,
                    parameters_as_bucket_view=(key == "f_z2_bv"))
    else:
        raise ValueError(key)
    # DDP after the optimizer: bucket views replace p.data, DDP must see the final storage.
    net = model if key.startswith("f_z2") else DDP(model, **ddp_kw)
    return Peer(key, model, net, opt)


def train_step(peer: Peer, x: torch.Tensor, y: torch.Tensor, between: Optional[Callable[[], None]] = None) -> Tuple[float, float]:
    t0 = time.perf_counter()
    peer.opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(peer.net(x), y)
    loss.backward()
    t1 = time.perf_counter()
    if between is not None:
        between()
    t2 = time.perf_counter()
    peer.opt.step()
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2


# ------------------------------------------------------------------ measurements
def comm_floors(n_params: int, world: int, bucket_mb: int, reps: int) -> Dict[str, Tuple[float, int]]:
    """Bare gloo collectives at this model's sizes: {what: (median seconds, bytes received per rank)}.

    ``P`` = all parameters, ``P/W`` = one rank's shard; "bucketed" cuts the
    shard into the same per-rank chunks as funcopt (``bucket_mb / W``).
    """
    shard = -(-n_params // world)
    per_rank = max(1, bucket_mb * MiB // world // 4)
    mine = torch.randn(shard)
    outs = list(torch.empty(world, shard).unbind(0))
    flat_out = torch.empty(world * shard)
    full = torch.randn(world * shard)
    rs_out = torch.empty(shard)
    gathered = (world - 1) * shard * 4
    rank = dist.get_rank()

    def ag_list() -> None:
        dist.all_gather(outs, mine)

    def ag_bucketed() -> None:
        for lo in range(0, shard, per_rank):
            hi = min(shard, lo + per_rank)
            dist.all_gather([o[lo:hi] for o in outs], mine[lo:hi].clone())

    def ag_single() -> None:
        dist.all_gather_into_tensor(flat_out, mine)

    def bcast() -> None:
        works = [dist.broadcast(outs[r][lo:lo + per_rank], src=r, async_op=True)
                 for lo in range(0, shard, per_rank) for r in range(world)]
        for w in works:
            w.wait()

    def p2p() -> None:
        ops = []
        for r in range(world):
            if r != rank:
                ops += [dist.P2POp(dist.isend, mine, r), dist.P2POp(dist.irecv, outs[r], r)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    def allreduce() -> None:
        step = 25 * MiB // 4
        for lo in range(0, n_params, step):
            dist.all_reduce(full[lo:min(lo + step, n_params)])

    def reduce_scatter() -> None:
        for lo in range(0, shard, per_rank):
            hi = min(shard, lo + per_rank)
            dist.reduce_scatter_tensor(rs_out[lo:hi], torch.cat([full[r * shard + lo: r * shard + hi] for r in range(world)]))

    def reduce_owner() -> None:
        works = [dist.reduce(full[r * shard + lo: r * shard + min(shard, lo + per_rank)], dst=r, async_op=True)
                 for lo in range(0, shard, per_rank) for r in range(world)]
        for w in works:
            w.wait()

    cases = [
        ("all_gather, list outputs, 1 call (P/W per rank)", ag_list, gathered),
        ("all_gather, list outputs, bucketed like funcopt", ag_bucketed, gathered),
        ("all_gather_into_tensor, 1 call", ag_single, gathered),
        ("broadcast from each owner, bucketed, async", bcast, gathered),
        ("isend/irecv of the shard to every peer", p2p, gathered),
        ("all_reduce of P in 25 MiB buckets (DDP's traffic)", allreduce, n_params * 4),
        ("reduce_scatter_tensor of P, bucketed (ZeRO-2's traffic)", reduce_scatter, shard * 4),
        ("reduce of each P/W range to its owner, bucketed, async", reduce_owner, shard * 4),
    ]
    res: Dict[str, Tuple[float, int]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # all_gather_into_tensor's rename notice
        for name, fn, nbytes in cases:
            ts = []
            for _ in range(reps):
                dist.barrier()
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            res[name] = (statistics.median(ts), nbytes)
    return res


def memcpy_floor(n_params: int, reps: int) -> float:
    a, b = torch.randn(n_params), torch.empty(n_params)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        b.copy_(a)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def step_breakdown(peers: List[Peer], batches: List[Tuple[torch.Tensor, torch.Tensor]], reps: int) -> Dict[str, Any]:
    """One profiler session over ``reps`` training steps of every peer.

    Each ``opt.step()`` runs inside a ``bench::step::<peer>`` range; every
    event (any thread: gloo runs its collectives on its own threads) that
    starts inside that range is charged to the peer's step.  Returns, per
    peer, {event name: (total ms, self ms, calls)} per step.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for k in range(reps):
            x, y = batches[k % len(batches)]
            for peer in peers:
                peer.opt.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(peer.net(x), y).backward()
                dist.barrier()
                with record_function(f"bench::step::{peer.key}"):
                    peer.opt.step()
    events = list(prof.events())
    windows = [(e.name[len("bench::step::"):], e.time_range.start, e.time_range.end)
               for e in events if e.name.startswith("bench::step::")]
    out: Dict[str, Dict[str, List[float]]] = {}
    for e in events:
        if e.name.startswith("bench::step::"):
            continue
        for key, lo, hi in windows:
            if lo <= e.time_range.start < hi:
                t = out.setdefault(key, {}).setdefault(e.name, [0.0, 0.0, 0])
                t[0] += e.cpu_time_total / 1e3
                t[1] += e.self_cpu_time_total / 1e3
                t[2] += 1
                break
    return {key: {n: (v[0] / reps, v[1] / reps, v[2] / reps) for n, v in rows.items()} for key, rows in out.items()}


def write_trace(peer: Peer, batches: List[Tuple[torch.Tensor, torch.Tensor]], out_dir: str, rank: int) -> None:
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    handler = tensorboard_trace_handler(out_dir, worker_name=f"{peer.key}_rank{rank}")
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3),
                 on_trace_ready=handler, profile_memory=True, with_stack=False) as prof:
        for k in range(5):
            x, y = batches[k % len(batches)]
            dist.barrier()
            train_step(peer, x, y)
            prof.step()


# ------------------------------------------------------------------------ worker
def worker(rank: int, world: int, init_method: str, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        run(rank, world, args)
    finally:
        dist.destroy_process_group()


def run(rank: int, world: int, args: argparse.Namespace) -> None:
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # ranks sharing this machine
    threads = args.threads or max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    say = print if rank == 0 else (lambda *a, **k: None)
    keys = [k.strip() for k in args.peers.split(",") if k.strip()]
    for k in keys:
        if k not in PEERS:
            raise SystemExit(f"unknown peer {k!r}; choose from {', '.join(PEERS)}")
    base = build_model(args.params, args.width, args.seed)
    n_params = sum(p.numel() for p in base.parameters())
    n_tensors = len(list(base.parameters()))
    batches = make_batches(4, world, rank, args.batch, args.width, args.seed)
    ddp_kw = dict(gradient_as_bucket_view=args.grad_as_bucket_view)
    say(f"# benchmarks/zero.py: W={world}, {n_params:,} fp32 parameters in {n_tensors} tensors "
        f"({n_tensors // 2} x Linear({args.width},{args.width})), batch {args.batch}/rank, {threads} thread(s)/rank, "
        f"gloo, torch {torch.__version__}, {platform.machine()} {os.cpu_count()} cores, "
        f"iters {args.iters} after {args.warmup} warm-up, bucket {args.bucket_size_mb} MiB, "
        f"load average {os.getloadavg()[0]:.1f}", flush=True)
    t = time.perf_counter()
    peers = [make_peer(k, base, args.lr, args.bucket_size_mb, ddp_kw) for k in keys]
    say(f"# built {len(peers)} peers in {time.perf_counter() - t:.1f} s", flush=True)

    total = args.warmup + args.iters
    measure_at = args.warmup - 1 if args.warmup > 0 else 0
    for it in range(total):
        x, y = batches[it % len(batches)]
        for j in range(len(peers)):
            peer = peers[(it + j) % len(peers)]
            between = None
            if it == measure_at:
                def between(p: Peer = peer) -> None:
                    p.grad_bytes = p.held_grad_bytes()
                    p.grad_pending = p.bucket_bytes()
            dist.barrier()
            fb, st = train_step(peer, x, y, between)
            if it >= args.warmup:
                peer.fb.append(fb)
                peer.st.append(st)
        if rank == 0 and not args.quiet:
            print(f"\r# iteration {it + 1}/{total}", end="", file=sys.stderr, flush=True)
    if rank == 0 and not args.quiet:
        print(file=sys.stderr)

    # Peak gradient bytes during backward (one extra, untimed step per peer).
    for peer in peers:
        hooks = []
        peer.grad_peak = 0

        def sample(_p: torch.Tensor, pe: Peer = peer) -> None:
            pe.grad_peak = max(pe.grad_peak, pe.held_grad_bytes() + pe.bucket_bytes())

        for p in peer.params:
            hooks.append(p.register_post_accumulate_grad_hook(sample))
        x, y = batches[0]
        dist.barrier()
        train_step(peer, x, y)
        for h in hooks:
            h.remove()
    extra_steps = 1

    # Correctness: every peer did the same steps on the same data.
    ref = next((p for p in peers if p.key == "ddp_adam"), None)
    diffs = {}
    for peer in peers:
        if ref is not None:
            diffs[peer.key] = max((a.detach() - b.detach()).abs().max().item() for a, b in zip(ref.params, peer.params))

    breakdown = {}
    if not args.no_breakdown:
        breakdown = step_breakdown(peers, batches, 3)
        floors = comm_floors(n_params, world, args.bucket_size_mb, 5)
    else:
        floors = {}
    copy_s = memcpy_floor(n_params, 5)

    if args.profile:
        target = next((p for p in peers if p.key == args.profile_peer), None)
        if target is None:
            raise SystemExit(f"--profile-peer {args.profile_peer} is not among --peers")
        write_trace(target, batches, args.profile_dir, rank)
        say(f"# TensorBoard trace of {target.name} written to {args.profile_dir}/ "
            f"(tensorboard --logdir {args.profile_dir})", flush=True)

    mine = {p.key: dict(fb=p.fb, st=p.st, state=p.state_bytes(), grad=p.grad_bytes, grad_pending=p.grad_pending,
                     grad_peak=p.grad_peak)
            for p in peers}
    import resource
    mine["_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return
    report(args, world, n_params, n_tensors, peers, everyone, diffs, breakdown, floors, copy_s)


# ------------------------------------------------------------------------ report
def report(args, world, n_params, n_tensors, peers, everyone, diffs, breakdown, floors, copy_s) -> None:
    res: Dict[str, Any] = {}
    for peer in peers:
        k = peer.key
        fb = [max(everyone[r][k]["fb"][i] for r in range(world)) for i in range(args.iters)]
        st = [max(everyone[r][k]["st"][i] for r in range(world)) for i in range(args.iters)]
        tot = [max(everyone[r][k]["fb"][i] + everyone[r][k]["st"][i] for r in range(world)) for i in range(args.iters)]
        res[k] = dict(name=peer.name, fb=statistics.median(fb), st=statistics.median(st), total=statistics.median(tot),
                      st_min=min(st), st_max=max(st),
                      state=[everyone[r][k]["state"] for r in range(world)],
                      grad=[everyone[r][k]["grad"] for r in range(world)],
                      grad_pending=[everyone[r][k]["grad_pending"] for r in range(world)],
                      grad_peak=[everyone[r][k]["grad_peak"] for r in range(world)])
    ref = res.get("ddp_adam")
    tz = res.get("torch_zero")
    print()
    print(f"## Time per training step (ms; median over {args.iters} steps of the slowest rank)")
    print()
    hdr = "| peer | fwd+bwd | step+sync | step+sync min..max | total | step+sync / DDP+Adam | step+sync / torch ZeRO | total / DDP+Adam |"
    print(hdr)
    print("|" + "|".join(["---"] + ["--:"] * 7) + "|")
    for k, r in res.items():
        vs_ref = f"{r['st'] / ref['st']:.2f}x" if ref else "-"
        vs_tz = f"{r['st'] / tz['st']:.2f}x" if tz else "-"
        tot_ref = f"{r['total'] / ref['total']:.2f}x" if ref else "-"
        print(f"| {r['name']} | {r['fb'] * 1e3:.1f} | {r['st'] * 1e3:.1f} | {r['st_min'] * 1e3:.1f}..{r['st_max'] * 1e3:.1f} "
              f"| {r['total'] * 1e3:.1f} | {vs_ref} | {vs_tz} | {tot_ref} |")

    p_bytes = n_params * 4
    state_full = ref["state"][0] if ref else 2 * p_bytes + 4 * n_tensors
    grad_full = ref["grad"][0] if ref else p_bytes
    print()
    print(f"## Memory per rank (parameters: {fmt_bytes(p_bytes)}; unsharded Adam state {fmt_bytes(state_full)}, "
          f"1/W = {fmt_bytes(state_full / world)}; unsharded gradients {fmt_bytes(grad_full)}, 1/W = {fmt_bytes(grad_full / world)})")
    print()
    print("| peer | optimizer state per rank | state / unsharded | gradients held after backward | grads / unsharded "
          "| + pending reduce-scatter bucket | (grads + bucket) / unsharded | peak (grads + bucket) during backward |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    for k, r in res.items():
        st = " / ".join(fmt_bytes(b) for b in r["state"])
        gr = " / ".join(fmt_bytes(b) for b in r["grad"])
        pend = " / ".join(fmt_bytes(b) for b in r["grad_pending"])
        both = max(g + b for g, b in zip(r["grad"], r["grad_pending"]))
        pk = " / ".join(fmt_bytes(b) for b in r["grad_peak"])
        print(f"| {r['name']} | {st} | {max(r['state']) / state_full:.3f} | {gr} | {max(r['grad']) / grad_full:.3f} "
              f"| {pend} | {both / grad_full:.3f} | {pk} |")
    print()
    print("(per-rank figures are rank 0 / rank 1 / ...; the ratio uses the largest rank; gradients: sum of p.grad, "
          "for funcopt ZeRO-2 opt.grad_shard_bytes(); the pending bucket is funcopt ZeRO-2's ReduceScatterBucketer "
          "buffer: the part filled with gradients still unreduced after backward, until step() flushes it; "
          "grad_shard_bytes() leaves it out; the buffer is allocated at the full bucket size)")
    if args.grad_as_bucket_view:
        print("(DDP gradient_as_bucket_view=True: p.grad are views into DDP's buckets)")
    else:
        print(f"(DDP peers also hold DDP's reducer buckets, another {fmt_bytes(p_bytes)} of gradient copies, "
              "not counted above: DDP's default gradient_as_bucket_view=False)")

    if diffs:
        print()
        print("## Agreement with DDP+Adam after the same steps (max |parameter difference|)")
        print()
        for k, v in diffs.items():
            if k != "ddp_adam":
                print(f"- {res[k]['name']}: {v:.1e}")

    if floors:
        print()
        print(f"## Floors on this machine (ms, median of 5): gloo collectives at this model's sizes; "
              f"one {fmt_bytes(p_bytes)} memcpy = {copy_s * 1e3:.1f} ms ({p_bytes / copy_s / 1e9:.1f} GB/s)")
        print()
        for k, (v, moved) in floors.items():
            print(f"- {k}: {v * 1e3:.1f} ms ({moved / v / 1e9:.2f} GB/s of result per rank)")

    if breakdown:
        print()
        print("## Where step() spends its time (rank 0, torch.profiler, ms per step: total incl. children / self)")
        for k, rows in breakdown.items():
            if k not in res:
                continue
            print()
            print(f"{res[k]['name']}:")
            top = [(n, v) for n, v in rows.items() if n.startswith(("funcopt::", "Optimizer.step", "gloo:"))]
            other = sorted(((n, v) for n, v in rows.items() if not n.startswith(("funcopt::", "Optimizer.step", "gloo:"))),
                           key=lambda nv: -nv[1][1])[:6]
            for n, (tot, slf, cnt) in sorted(top, key=lambda nv: -nv[1][0]) + other:
                print(f"    {n:<45} {tot:9.2f} {slf:9.2f}   x{cnt:g}")

    verdicts = []
    if ref:
        for k in ("f_flat", "f_greedy", "f_flat_bv"):
            if k in res:
                ratio = res[k]["st"] / ref["st"]
                verdicts.append(f"{res[k]['name']} step+sync <= 1.1x DDP+Adam(fused): {ratio:.2f}x -> "
                                f"{'MET' if ratio <= 1.1 else 'MISSED'}")
    if tz:
        for k in ("f_flat", "f_greedy", "f_flat_bv"):
            if k in res:
                ratio = res[k]["st"] / tz["st"]
                verdicts.append(f"{res[k]['name']} step+sync faster than torch ZeRO: {ratio:.2f}x -> "
                                f"{'MET' if ratio < 1.0 else 'MISSED'}")
    bucket = args.bucket_size_mb * MiB
    for k in ("f_flat", "f_greedy", "f_flat_bv", "f_z2", "f_z2_bv"):
        if k in res:
            worst = max(res[k]["state"])
            ok = worst <= state_full / world + bucket
            verdicts.append(f"{res[k]['name']} state per rank <= 1/W + one bucket: {fmt_bytes(worst)} vs "
                            f"{fmt_bytes(state_full / world)} + {fmt_bytes(bucket)} -> {'MET' if ok else 'MISSED'} "
                            f"(excess over 1/W: {fmt_bytes(worst - state_full / world)})")
    if "f_z2" in res:
        worst = max(res["f_z2"]["grad"])
        ratio = worst / grad_full
        both = max(g + b for g, b in zip(res["f_z2"]["grad"], res["f_z2"]["grad_pending"])) / grad_full
        verdicts.append(f"funcopt ZeRO-2 gradient bytes per rank about 1/W: grad_shard_bytes() {ratio:.3f} of unsharded "
                        f"(1/W = {1 / world:.3f}) -> {'MET' if ratio <= 1 / world * 1.02 + 1e-9 else 'MISSED'}; "
                        f"counting the pending bucket {both:.3f} -> {'MET' if both <= 1 / world * 1.02 + 1e-9 else 'MISSED'}; "
                        f"peak during backward {max(res['f_z2']['grad_peak']) / grad_full:.3f}")
    print()
    print(f"# load average at the end: {os.getloadavg()[0]:.1f}; peak RSS per process (all peers together): "
          + " / ".join(fmt_bytes(everyone[r]["_rss"]) for r in range(world)))
    print()
    print("## Targets")
    print()
    for v in verdicts:
        print(f"- {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), world=world, n_params=n_params, results=res, floors=floors,
                           memcpy_s=copy_s, diffs=diffs), f, indent=1)


# -------------------------------------------------------------------------- main
def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    ap.add_argument("--params", type=parse_size, default=parse_size("16M"), help="model size, e.g. 16M, 64M (default 16M)")
    ap.add_argument("--width", type=int, default=1024, help="Linear layer width (default 1024)")
    ap.add_argument("--batch", type=int, default=32, help="batch per rank (default 32)")
    ap.add_argument("--iters", type=int, default=20, help="timed steps per peer (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default cores // W)")
    ap.add_argument("--bucket-size-mb", type=int, default=25, help="funcopt bucket size (default 25)")
    ap.add_argument("--grad-as-bucket-view", action="store_true", help="DDP(gradient_as_bucket_view=True)")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated subset of {','.join(PEERS)}")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the profiler breakdown and the collective floors")
    ap.add_argument("--profile", action="store_true", help="write a TensorBoard trace of --profile-peer")
    ap.add_argument("--profile-peer", default="f_flat", help="peer to trace (default f_flat)")
    ap.add_argument("--profile-dir", default="runs/zero")
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    ap.add_argument("--timeout", type=float, default=600, help="process-group timeout in seconds")
    ap.add_argument("--quiet", action="store_true", help="no iteration counter on stderr")
    args = ap.parse_args(argv)

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", args)
        return
    tmp = tempfile.mkdtemp(prefix="funcopt_zero_bench_")
    try:
        mp.spawn(worker, args=(args.world_size, f"file://{tmp}/rdzv", args), nprocs=args.world_size, join=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
