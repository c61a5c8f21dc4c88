#!/usr/bin/env python
"""ZeRO-3 per-rank memory and iteration time: funcopt against DDP and torch's FSDP2.

The script launches its own ``--world-size`` processes through
``funcopt.distributed.launch`` (spawn, gloo, ``file://`` rendezvous, a timeout
on every collective; ``--world-size 2,4`` runs W=2, then W=4), or, under
``torchrun``, joins the group from the environment.  Every process builds the same model -- a stack of
``--layers`` ``nn.TransformerEncoderLayer(d_model, heads, ffn, dropout=0,
batch_first=True, norm_first=True)`` -- and one copy of it per peer; every peer
sees the same synthetic batches (each rank its slice of the global batch,
``--batch`` sequences of ``--seq`` tokens per rank), MSE loss against a random
target.

Peers, interleaved in the same processes (every iteration runs one training
iteration of every peer in turn, the starting peer rotating, a barrier before
each), so background load hits all peers alike:

* ``ddp``       DDP(gradient_as_bucket_view=True) + ``torch.optim.Adam(fused=True)``
* ``fsdp2``     ``torch.distributed.fsdp.fully_shard`` on every layer and on the
                root + ``torch.optim.Adam(fused=True)`` over the sharded (DTensor)
                parameters
* ``f_zero3``   funcopt ``Zero3Sequential([Zero3Layer(layer), ...])`` +
                ``funcopt.Adam`` (eager; the fused kernel) over ``model.parameters()``
* ``f_zero3_s`` the same with ``funcopt.script(funcopt.Adam(...))``

(the funcopt peers need ``funcopt.distributed.Zero3Layer``; where it is
missing they are left out with a note.)

An iteration is ``zero_grad`` + forward + backward + ``step``; its time is the
slowest rank's.  Printed: per peer the median and min..max over ``--iters``
iterations after ``--warmup``, and the ratios to DDP and to FSDP2 computed
iteration by iteration (median, min..max), since the peers ran side by side.

Memory (one extra, untimed iteration per peer): the bytes of parameters,
gradients and optimizer state this rank holds, counted tensor by tensor (each
storage once; DTensors by their local shard): the optimizer's parameters, the
module's parameters as registered at that moment (FSDP2 swaps in its
unsharded parameters while a layer runs), for funcopt the layers' original
parameters (whose storage is empty while a layer is not fetched), their
``.grad``, and the tensors in the optimizer's ``state``.  Sampled before
every layer's forward, when every layer's output gradient arrives in backward,
after backward and after ``step``; "peak" is the largest sample.  Not counted
(invisible to this count): communication buffers in flight (all-gather inputs,
reduce-scatter buckets), activations.  DDP's gradients are its reducer's
buckets (``gradient_as_bucket_view=True``: ``p.grad`` are views into them,
held for the whole run).

Also per peer: the growth of the process's resident memory over the same
iteration (peak sample minus the sample before ``zero_grad``), which does see
activations and communication buffers.  It is meaningful with ``--rss`` only:
the children then run with ``MALLOC_MMAP_THRESHOLD_=131072``, so that every
tensor of 128 KiB or more is its own mapping, returned to the system when
freed.  That makes every large allocation page-fault afresh, which slows the
peers that allocate per layer (ZeRO-3, FSDP2) far more than DDP: take times
from a run without ``--rss``.

Targets (issue 10): per-rank model state <= DDP's / W + two layers, where a
layer is what a gathered layer holds in backward: its full parameters and
full gradients, fp32, 8 bytes per layer parameter (the figure is also printed
in MiB and in layers); iteration time <= FSDP2's and <= 1.5x DDP's at W=2.

Hardware limit of the step: the Adam update reads and writes 28 bytes per
fp32 parameter (param, grad read; exp_avg, exp_avg_sq read and written; param
written), over the P/W parameters a sharded rank owns; the script measures
the machine's bandwidth on rank 0 alone (best of 5 ``a.add_(b)`` over 16M
floats, 12 bytes per element, as ``benchmarks/step.py`` does) and prints each
peer's step time against ``28 * P/W / bandwidth`` (``28 * P`` for DDP).

After the run every peer's parameters are compared with DDP's (gathered with
``full_tensor()`` / ``full_state_dict()``).  ``--profile DIR`` also writes a
torch.profiler trace per peer (TensorBoard, torch-tb-profiler) and prints the
top operators of one profiled iteration of each peer on rank 0.

Examples::

    python benchmarks/zero3.py                          # W=2 then W=4, 12 x d_model 512
    python benchmarks/zero3.py --world-size 2 --iters 20
    python benchmarks/zero3.py --peers ddp,fsdp2 --profile runs/zero3
    torchrun --standalone --nproc-per-node 2 benchmarks/zero3.py
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PEERS = {
    "ddp": "DDP + Adam(fused)",
    "fsdp2": "FSDP2 fully_shard + Adam(fused)",
    "f_zero3": "funcopt ZeRO-3 + funcopt.Adam",
    "f_zero3_s": "funcopt ZeRO-3 + scripted funcopt.Adam",
}
MiB = 1024 * 1024


def rss_bytes() -> int:
    """This process's resident memory now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def bandwidth(n: int = 16 * 1000 * 1000, reps: int = 5) -> float:
    """Best ``a.add_(b)`` over n floats, in bytes/s (read a, b; write a: 12 bytes per element)."""
    a, b = torch.randn(n), torch.randn(n)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a.add_(b)
        best = min(best, time.perf_counter() - t)
    return 12 * n / best


def fmt(n: float) -> str:
    return f"{n / MiB:,.1f}"


def has_zero3() -> bool:
    import funcopt.distributed as fd

    return hasattr(fd, "Zero3Layer") and hasattr(fd, "Zero3Sequential")


# ------------------------------------------------------------------ model / data
def build_layers(args: argparse.Namespace) -> List[nn.Module]:
    torch.manual_seed(args.seed)
    return [nn.TransformerEncoderLayer(args.d_model, args.heads, args.ffn, dropout=0.0, batch_first=True,
                                       norm_first=True) for _ in range(args.layers)]


def make_batches(n: int, world: int, rank: int, args: argparse.Namespace) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for k in range(n):
        g = torch.Generator().manual_seed(args.seed * 1000 + k)
        x = torch.randn(world * args.batch, args.seq, args.d_model, generator=g)
        y = torch.randn(world * args.batch, args.seq, args.d_model, generator=g)
        sl = slice(rank * args.batch, (rank + 1) * args.batch)
        out.append((x[sl].contiguous(), y[sl].contiguous()))
    return out


# ------------------------------------------------------------------------ peers
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _add(seen: Dict[int, int], t: Optional[torch.Tensor]) -> None:
    if t is None or not isinstance(t, torch.Tensor):
        return
    t = _local(t)
    s = t.untyped_storage()
    if s.nbytes() and s.data_ptr() not in seen:
        seen[s.data_ptr()] = s.nbytes()


class Peer:
    def __init__(self, key: str, model: nn.Module, layers: List[nn.Module], opt: Any,
                 originals: List[torch.Tensor], set_to_none: bool = True, units: Optional[List[nn.Module]] = None):
        self.key, self.name = key, PEERS[key]
        self.model, self.layers, self.opt = model, layers, opt
        self.units = units or layers         # the modules whose forward the sharding wraps
        self.opt_params = [p for g in opt.param_groups for p in g["params"]]
        self.originals = originals           # funcopt: the layers' own parameters (empty when not fetched)
        self.set_to_none = set_to_none
        self.times: List[float] = []
        self.step_times: List[float] = []
        self.samples: List[Tuple[str, int, int, int, int]] = []

    def held(self) -> Tuple[int, int, int]:
        """(parameter, gradient, optimizer-state) bytes this rank holds now, each storage once."""
        tensors = self.opt_params + list(self.model.parameters()) + self.originals
        ps: Dict[int, int] = {}
        gs: Dict[int, int] = {}
        ss: Dict[int, int] = {}
        for t in tensors:
            _add(ps, t)
            _add(gs, t.grad)
        state = getattr(self.opt, "state", {})
        for st in state.values():
            for v in st.values():
                _add(ss, v)
        # a storage counted as a parameter is not counted again as a gradient or state
        return sum(ps.values()), sum(v for k, v in gs.items() if k not in ps), \
            sum(v for k, v in ss.items() if k not in ps and k not in gs)

    def sample(self, where: str) -> None:
        self.samples.append((where,) + self.held() + (rss_bytes(),))


def make_peer(key: str, base_layers: List[nn.Module], args: argparse.Namespace) -> Peer:
    layers = [copy.deepcopy(m) for m in base_layers]
    if key == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        seq = nn.Sequential(*layers)
        model = DDP(seq, gradient_as_bucket_view=True)
        opt = torch.optim.Adam(seq.parameters(), lr=args.lr, fused=True)
        return Peer(key, model, layers, opt, [], set_to_none=False)
    if key == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        seq = nn.Sequential(*layers)
        for m in layers:
            fully_shard(m)
        fully_shard(seq)
        opt = torch.optim.Adam(seq.parameters(), lr=args.lr, fused=True)
        return Peer(key, seq, layers, opt, [])
    if key in ("f_zero3", "f_zero3_s"):
        import funcopt
        from funcopt.distributed import Zero3Layer, Zero3Sequential

        originals = [p for m in layers for p in m.parameters()]
        units = [Zero3Layer(m) for m in layers]
        model = Zero3Sequential(units)
        opt = funcopt.Adam(model.parameters(), lr=args.lr)
        if key == "f_zero3_s":
            opt = funcopt.script(opt)
        return Peer(key, model, layers, opt, originals, units=units)
    raise ValueError(key)


def iteration(peer: Peer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One training iteration; returns the seconds ``step()`` took."""
    peer.opt.zero_grad(set_to_none=peer.set_to_none)
    loss = nn.functional.mse_loss(peer.model(x), y)
    loss.backward()
    t = time.perf_counter()
    peer.opt.step()
    return time.perf_counter() - t


def memory_iteration(peer: Peer, x: torch.Tensor, y: torch.Tensor) -> None:
    """One untimed iteration with the counter sampled at every layer, in forward and backward.

    Forward: when the layer's own module starts (its parameters gathered, the next
    layer's gather under way).  Backward: when the gradient of the layer's output
    arrives (a hook registered on the output by a forward hook of the sharding
    unit, so it runs after the sharding's own pre-backward hook: the layer is
    gathered again) and when the gradient of its input is computed (its backward
    done, its full gradients produced)."""
    hooks = []
    for i, (m, u) in enumerate(zip(peer.layers, peer.units)):
        hooks.append(m.register_forward_pre_hook(lambda _m, _a, i=i: peer.sample(f"fwd {i}")))

        def on_in(_m: nn.Module, args: Any, i: int = i) -> None:
            for a in args:
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    a.register_hook(lambda g, i=i: peer.sample(f"bwd {i} done"))

        def on_out(_m: nn.Module, _a: Any, out: Any, i: int = i) -> None:
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g, i=i: peer.sample(f"bwd {i}"))

        hooks.append(u.register_forward_pre_hook(on_in))
        hooks.append(u.register_forward_hook(on_out))
    peer.samples = []
    try:
        peer.opt.zero_grad(set_to_none=peer.set_to_none)
        peer.sample("start")
        loss = nn.functional.mse_loss(peer.model(x), y)
        loss.backward()
        peer.sample("after backward")
        peer.opt.step()
        peer.sample("after step")
    finally:
        for h in hooks:
            h.remove()


def full_params(peer: Peer) -> Dict[str, torch.Tensor]:
    """The whole model's parameters on every rank (collective), keyed as nn.Sequential's."""
    if peer.key == "ddp":
        return {k: v.detach().clone() for k, v in peer.model.module.named_parameters()}
    if peer.key == "fsdp2":
        return {k: v.full_tensor().detach() for k, v in peer.model.named_parameters()}
    sd = peer.model.full_state_dict(to=0)
    return dict(sd)


def profile_peer(peer: Peer, batches: List[Tuple[torch.Tensor, torch.Tensor]], out_dir: str, rank: int) -> str:
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    handler = tensorboard_trace_handler(out_dir, worker_name=f"{peer.key}_rank{rank}")
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=2),
                 on_trace_ready=handler, acc_events=True) as prof:
        for k in range(3):
            x, y = batches[k % len(batches)]
            dist.barrier()
            iteration(peer, x, y)
            prof.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50)


# ------------------------------------------------------------------------ worker
def run(rank: int, world: int, args: argparse.Namespace) -> None:
    say = print if rank == 0 else (lambda *a, **k: None)
    keys = [k.strip() for k in args.peers.split(",") if k.strip()]
    for k in keys:
        if k not in PEERS:
            raise SystemExit(f"unknown peer {k!r}; choose from {', '.join(PEERS)}")
    notes = []
    if not has_zero3():
        dropped = [k for k in keys if k.startswith("f_zero3")]
        keys = [k for k in keys if not k.startswith("f_zero3")]
        if dropped:
            notes.append(f"funcopt.distributed.Zero3Layer not in this tree: {', '.join(dropped)} left out")
    base = build_layers(args)
    layer_params = sum(p.numel() for p in base[0].parameters())
    n_params = layer_params * len(base)
    batches = make_batches(4, world, rank, args)
    commit = os.environ.get("BENCH_COMMIT") or os.popen(
        "git -C %s rev-parse --short HEAD 2>/dev/null" % os.path.dirname(os.path.abspath(__file__))).read().strip()
    say(f"# benchmarks/zero3.py: W={world}, {args.layers} x TransformerEncoderLayer(d_model={args.d_model}, "
        f"heads={args.heads}, ffn={args.ffn}) = {n_params:,} fp32 parameters ({layer_params:,} per layer), "
        f"batch {args.batch} x seq {args.seq} per rank, {args.threads} thread(s)/rank, gloo, torch {torch.__version__}, "
        f"{platform.machine()} {os.cpu_count()} cores, commit {commit or '?'}, iters {args.iters} after "
        f"{args.warmup} warm-up, load average {os.getloadavg()[0]:.1f}", flush=True)
    for n in notes:
        say(f"# NOTE: {n}", flush=True)
    t = time.perf_counter()
    peers = [make_peer(k, base, args) for k in keys]
    say(f"# built {len(peers)} peers in {time.perf_counter() - t:.1f} s", flush=True)

    total = args.warmup + args.iters
    bar = None
    if rank == 0 and not args.quiet:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total, desc=f"W={world}", unit="it", file=sys.stderr, leave=False)
        except ImportError:
            bar = None
    for it in range(total):
        x, y = batches[it % len(batches)]
        for j in range(len(peers)):
            peer = peers[(it + j) % len(peers)]
            dist.barrier()
            t0 = time.perf_counter()
            st = iteration(peer, x, y)
            dt = time.perf_counter() - t0
            if it >= args.warmup:
                peer.times.append(dt)
                peer.step_times.append(st)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()

    for peer in peers:
        dist.barrier()
        memory_iteration(peer, *batches[0])

    # Agreement: every peer made the same steps on the same data as DDP.
    diffs: Dict[str, float] = {}
    ref = {}
    fulls = {}
    for peer in peers:
        fulls[peer.key] = full_params(peer)
    if "ddp" in fulls and rank == 0:
        ref = fulls["ddp"]
        for k, f in fulls.items():
            if k != "ddp" and f:
                common = [n for n in ref if n in f]
                diffs[k] = max((ref[n] - f[n]).abs().max().item() for n in common) if common else float("nan")
                if len(common) != len(ref):
                    notes.append(f"{k}: {len(common)} of {len(ref)} parameter names matched DDP's")
    del fulls, ref

    dist.barrier()
    bw = bandwidth() if rank == 0 else 0.0
    dist.barrier()

    tables = {}
    if args.profile:
        for peer in peers:
            tables[peer.key] = profile_peer(peer, batches, args.profile, rank)

    import resource

    mine = {p.key: dict(times=p.times, steps=p.step_times, samples=p.samples) for p in peers}
    mine["_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return
    report(args, world, n_params, layer_params, peers, everyone, diffs, tables, notes, commit, bw)


# ------------------------------------------------------------------------ report
def _start_total(samples: List[Tuple[str, int, int, int, int]]) -> int:
    s = next(s for s in samples if s[0] == "start")
    return s[1] + s[2] + s[3]


def _spread(xs: List[float]) -> str:
    return f"{statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})"


def report(args, world, n_params, layer_params, peers, everyone, diffs, tables, notes, commit, bw) -> None:
    keys = [p.key for p in peers]
    names = {p.key: p.name for p in peers}
    it_times = {k: [max(everyone[r][k]["times"][i] for r in range(world)) for i in range(args.iters)] for k in keys}
    print()
    print(f"## W={world}: iteration time (forward + backward + step), ms, slowest rank, {args.iters} iterations")
    print()
    print("| peer | median ms | min..max ms | / DDP: median (min-max) | / FSDP2: median (min-max) "
          "| step() ms | step / Adam-traffic limit |")
    print("|---|--:|--:|--:|--:|--:|--:|")
    ratios: Dict[str, Dict[str, List[float]]] = {}
    for k in keys:
        ts = it_times[k]
        ratios[k] = {}
        cells = []
        for ref in ("ddp", "fsdp2"):
            if ref in it_times:
                ratios[k][ref] = [a / b for a, b in zip(ts, it_times[ref])]
                cells.append(_spread(ratios[k][ref]))
            else:
                cells.append("-")
        steps = [max(everyone[r][k]["steps"][i] for r in range(world)) for i in range(args.iters)]
        owned = n_params if k == "ddp" else n_params / world
        limit = 28 * owned / bw if bw else float("nan")
        print(f"| {names[k]} | {statistics.median(ts) * 1e3:.0f} | {min(ts) * 1e3:.0f}..{max(ts) * 1e3:.0f} | "
              f"{cells[0]} | {cells[1]} | {statistics.median(steps) * 1e3:.1f} | "
              f"{statistics.median(steps) / limit:.2f}x ({limit * 1e3:.1f} ms) |")
    print()
    print(f"(bandwidth on rank 0 alone, best a.add_(b) over 16M floats: {bw / 1e9:.1f} GB/s; the limit is "
          f"28 bytes x the parameters a rank steps / that bandwidth)")

    layer_bytes = 8 * layer_params         # a gathered layer in backward: full params + full grads, fp32
    mem: Dict[str, Dict[str, Any]] = {}
    for k in keys:
        per_rank = []
        for r in range(world):
            samples = everyone[r][k]["samples"]
            peak = max(samples, key=lambda s: s[1] + s[2] + s[3])
            after = next(s for s in samples if s[0] == "after step")
            start = next(s for s in samples if s[0] == "start")
            rss = max(s[4] for s in samples) - start[4]
            per_rank.append((peak, after, rss))
        mem[k] = dict(per_rank=per_rank,
                      peak=max(p[0][1] + p[0][2] + p[0][3] for p in per_rank),
                      after=max(p[1][1] + p[1][2] + p[1][3] for p in per_rank))
    ddp_after = mem["ddp"]["after"] if "ddp" in mem else None
    print()
    print(f"## W={world}: model state per rank, MiB (parameters + gradients + Adam state; fp32 model "
          f"{fmt(4 * n_params)} MiB; one layer's parameters + gradients {fmt(layer_bytes)} MiB)")
    print()
    print("| peer | after step: params / grads / state = total | peak: params / grads / state = total (where) "
          "| peak / DDP | peak - DDP/W: MiB (layers) | RSS growth over the iteration | start + RSS growth "
          "- DDP/W: MiB (layers) |")
    print("|---|--:|--:|--:|--:|--:|--:|")
    for k in keys:
        (pk, af, _) = max(mem[k]["per_rank"], key=lambda pa: pa[0][1] + pa[0][2] + pa[0][3])
        rss = max(pa[2] for pa in mem[k]["per_rank"])
        mem[k]["rss_peak"] = max(_start_total(everyone[r][k]["samples"]) + mem[k]["per_rank"][r][2] for r in range(world))
        tot_pk = pk[1] + pk[2] + pk[3]
        tot_af = af[1] + af[2] + af[3]
        vs = f"{tot_pk / ddp_after:.3f}" if ddp_after else "-"
        over = (f"{fmt(tot_pk - ddp_after / world)} ({(tot_pk - ddp_after / world) / layer_bytes:+.2f})"
                if ddp_after else "-")
        rp = mem[k]["rss_peak"]
        over_rss = f"{fmt(rp - ddp_after / world)} ({(rp - ddp_after / world) / layer_bytes:+.2f})" if ddp_after else "-"
        print(f"| {names[k]} | {fmt(af[1])} / {fmt(af[2])} / {fmt(af[3])} = {fmt(tot_af)} | "
              f"{fmt(pk[1])} / {fmt(pk[2])} / {fmt(pk[3])} = {fmt(tot_pk)} ({pk[0]}) | {vs} | {over} | {fmt(rss)} "
              f"| {over_rss} |")
    if args.samples:
        for k in keys:
            print()
            print(f"{names[k]}, rank 0, every sample (MiB): where: params / grads / state / RSS growth")
            s0 = everyone[0][k]["samples"]
            base = s0[0][4]
            print("    " + "; ".join(f"{s[0]}: {fmt(s[1])}/{fmt(s[2])}/{fmt(s[3])}/{fmt(s[4] - base)}" for s in s0))
    if not args.rss:
        print()
        print("(the RSS columns need --rss: without it freed memory stays with the allocator and RSS does not "
              "follow live tensors)")
    print()
    print("(largest rank shown; counted tensor by tensor, each storage once; communication buffers in flight and "
          "activations are not counted, nor FSDP2's prefetched all-gather output before its layer runs; DDP's "
          "gradients are its reducer's buckets, held for the whole run; RSS growth: resident memory at the "
          "highest sample minus before zero_grad, activations and buffers included)")

    if diffs:
        print()
        print(f"## W={world}: agreement with DDP after the same iterations (max |parameter difference|)")
        print()
        for k, v in diffs.items():
            print(f"- {names[k]}: {v:.1e}")

    for k, table in tables.items():
        print()
        print(f"## W={world}: profile of {names[k]} (rank 0, 2 iterations; trace in {args.profile})")
        print()
        print(table)

    print()
    print(f"## W={world}: targets")
    print()
    for k in keys:
        if not k.startswith("f_"):
            continue
        if ddp_after:
            limit = ddp_after / world + 2 * layer_bytes
            ok = mem[k]["peak"] <= limit
            line = (f"- {names[k]}: peak model state per rank <= DDP/W + two layers (params + grads): "
                    f"{fmt(mem[k]['peak'])} vs {fmt(ddp_after / world)} + {fmt(2 * layer_bytes)} MiB -> "
                    f"{'MET' if ok else 'MISSED'}")
            if args.rss:
                line += (f"; counting every allocation (state at start + RSS growth, activations included): "
                         f"{fmt(mem[k]['rss_peak'])} MiB -> {'MET' if mem[k]['rss_peak'] <= limit else 'MISSED'}")
            print(line)
        if "fsdp2" in ratios[k]:
            rs = ratios[k]["fsdp2"]
            verdict = "MET (whole spread)" if max(rs) <= 1.0 else ("MET (median)" if statistics.median(rs) <= 1.0 else "MISSED")
            print(f"- {names[k]}: iteration time <= FSDP2's: {_spread(rs)} -> {verdict}")
        if "ddp" in ratios[k] and world == 2:
            rs = ratios[k]["ddp"]
            verdict = "MET (whole spread)" if max(rs) <= 1.5 else ("MET (median)" if statistics.median(rs) <= 1.5 else "MISSED")
            print(f"- {names[k]}: iteration time <= 1.5x DDP's at W=2: {_spread(rs)} -> {verdict}")
    for n in notes:
        print(f"- note: {n}")
    print()
    print(f"# load average at the end: {os.getloadavg()[0]:.1f}; peak RSS per process (all peers together): "
          + " / ".join(fmt(everyone[r]["_rss"]) + " MiB" for r in range(world)), flush=True)
    if args.json:
        path = args.json.replace("{W}", str(world))
        with open(path, "w") as f:
            json.dump(dict(args=vars(args), world=world, commit=commit, n_params=n_params, layer_params=layer_params,
                           times=it_times, bandwidth=bw, memory={k: v["per_rank"] for k, v in mem.items()}, diffs=diffs), f, indent=1)


# -------------------------------------------------------------------------- main
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", default="2,4", help="process counts to run one after another (default 2,4; "
                                                       "ignored under torchrun)")
    ap.add_argument("--layers", type=int, default=12, help="transformer layers (default 12)")
    ap.add_argument("--d-model", type=int, default=512, help="d_model (default 512)")
    ap.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    ap.add_argument("--ffn", type=int, default=2048, help="feed-forward width (default 2048)")
    ap.add_argument("--seq", type=int, default=32, help="sequence length (default 32)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank (default 2)")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations per peer (default 10)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations first (default 2)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated subset of {','.join(PEERS)}")
    ap.add_argument("--profile", default=None, metavar="DIR", help="also write torch.profiler traces to DIR")
    ap.add_argument("--json", default=None, help="also write the raw figures here ({W} is replaced by W)")
    ap.add_argument("--timeout", type=float, default=900, help="process-group timeout in seconds (default 900)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--samples", action="store_true", help="print every memory sample of rank 0")
    ap.add_argument("--rss", action="store_true", help="make the RSS growth column exact (MALLOC_MMAP_THRESHOLD_); "
                                                       "slows per-layer allocations: not for timing")
    args = ap.parse_args(argv)
    if args.layers < 1 or args.iters < 1 or args.d_model % args.heads:
        ap.error("--layers and --iters must be >= 1 and --d-model a multiple of --heads")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.rss:
        # every tensor of 128 KiB or more its own mapping, unmapped when freed: RSS follows live tensors
        # (and every large allocation page-faults afresh: times from such a run are not comparable)
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    from funcopt.distributed.launch import launch, under_torchrun

    worlds = [1] if under_torchrun() else [int(w) for w in str(args.world_size).split(",") if w.strip()]
    for world in worlds:
        launch(run, world, args, timeout=args.timeout, deadline=None, grace=30, threads=args.threads).check()


if __name__ == "__main__":
    main()
