"""ZeRO step+sync time and per-rank memory: funcopt against DDP and torch's ZeroRedundancyOptimizer.

The benchmark launches its own ``--world-size`` processes (``torch.multiprocessing``
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

    funcopt bench zero                          # W=2, 16M parameters
    funcopt bench zero --params 64M --iters 10 --peers ddp_adam,torch_zero,f_flat,f_flat_bv
    funcopt bench zero --peers ddp_adam,f_flat --profile   # TensorBoard trace in runs/zero
    torchrun --standalone --nproc-per-node 2 benchmarks/zero.py   # the script, under torchrun
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any, List, Optional

from ._report import print_summary

PEER_KEYS = ("ddp_adam", "torch_zero", "torch_zero_bv", "f_flat", "f_greedy", "f_flat_bv", "f_z2", "f_z2_bv")
# what `funcopt bench --quick` runs of this layer
QUICK = ("--params", "2M", "--width", "512", "--iters", "5", "--warmup", "2",
         "--peers", "ddp_adam,f_flat,f_z2", "--no-breakdown")


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1000, "M": 1000_000, "G": 1000_000_000}.get(s[-1:], 1)
    try:
        n = int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a parameter count (16M, 500K, ...)") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: the model needs at least 1 parameter")
    return n


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of ``funcopt bench zero`` / ``benchmarks/zero.py``."""
    ap.add_argument("--world-size", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    ap.add_argument("--params", type=parse_size, default=parse_size("16M"),
                    help="model size, e.g. 16M, 64M (default 16M)")
    ap.add_argument("--width", type=int, default=1024, help="Linear layer width (default 1024)")
    ap.add_argument("--batch", type=int, default=32, help="batch per rank (default 32)")
    ap.add_argument("--iters", type=int, default=20, help="timed steps per peer (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default cores // W)")
    ap.add_argument("--bucket-size-mb", type=int, default=25, help="funcopt bucket size (default 25)")
    ap.add_argument("--grad-as-bucket-view", action="store_true", help="DDP(gradient_as_bucket_view=True)")
    ap.add_argument("--peers", default=",".join(PEER_KEYS), help=f"comma-separated subset of {','.join(PEER_KEYS)}")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the profiler breakdown and the collective floors")
    ap.add_argument("--profile", action="store_true", help="write a TensorBoard trace of --profile-peer")
    ap.add_argument("--profile-peer", default="f_flat", help="peer to trace (default f_flat)")
    ap.add_argument("--profile-dir", default="runs/zero")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="write a TensorBoard trace of --profile-peer (default f_flat) into DIR")
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    ap.add_argument("--timeout", type=float, default=600, help="process-group timeout in seconds")
    ap.add_argument("--no-progress", "--quiet", dest="no_progress", action="store_true",
                    help="no progress bar on stderr")


def check(args: argparse.Namespace) -> Optional[str]:
    """The first bad option as one line, or None."""
    for name in ("world_size", "width", "batch", "iters", "bucket_size_mb"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    if args.warmup < 0:
        return f"--warmup must be at least 0, got {args.warmup}"
    if args.threads is not None and args.threads < 1:
        return f"--threads must be at least 1, got {args.threads}"
    if not args.timeout > 0:
        return f"--timeout must be positive, got {args.timeout:g}"
    if not (args.lr >= 0):
        return f"--lr {args.lr:g}: Invalid learning rate: {args.lr}"
    keys = [k.strip() for k in args.peers.split(",") if k.strip()]
    bad = [k for k in keys if k not in PEER_KEYS]
    if bad or not keys:
        return f"--peers: unknown peer {bad[0] if bad else args.peers!r}; choose from {', '.join(PEER_KEYS)}"
    if (args.profile or args.trace) and args.profile_peer not in keys:
        return f"--profile-peer {args.profile_peer} is not among --peers"
    return None


def run(args: argparse.Namespace) -> int:
    """Launch the ranks (or join torchrun's); rank 0 prints the tables and the summary; the exit code."""
    problem = check(args)
    if problem:
        print(f"funcopt bench zero: {problem}", file=sys.stderr)
        return 2
    from ..distributed.launch import launch

    res = launch(_rank, args.world_size, args, timeout=args.timeout, deadline=args.timeout + 600, grace=10.0)
    if not res.ok:
        print(f"funcopt bench zero: FAILED: {res.error_line()}", file=sys.stderr)
        return 1
    rows = res.returns.get(0) or []
    args.summary_rows = rows
    if rows:
        print_summary(rows, title="funcopt bench zero: summary (median ratio over timed steps, min-max; a target "
                                  "is met only when the whole spread meets it)")
    return 0


# ------------------------------------------------------------------------ one rank
def _rank(rank: int, world: int, args: argparse.Namespace) -> Any:
    """One rank (its gloo group is up): every peer, interleaved; rank 0 reports and returns the summary rows."""
    import torch
    import torch.distributed as dist

    from ._zero_parts import (Peer, build_model, comm_floors, make_batches, make_peer, memcpy_floor,
                              step_breakdown, train_step, write_trace)
    from ._zero_report import report

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # ranks sharing this machine
    threads = args.threads or max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    say = print if rank == 0 else (lambda *a, **k: None)
    keys = [k.strip() for k in args.peers.split(",") if k.strip()]
    base = build_model(args.params, args.width, args.seed)
    n_params = sum(p.numel() for p in base.parameters())
    n_tensors = len(list(base.parameters()))
    batches = make_batches(4, world, rank, args.batch, args.width, args.seed)
    ddp_kw = dict(gradient_as_bucket_view=args.grad_as_bucket_view)
    say(f"# funcopt bench zero: W={world}, {n_params:,} fp32 parameters in {n_tensors} tensors "
        f"({n_tensors // 2} x Linear({args.width},{args.width})), batch {args.batch}/rank, {threads} thread(s)/rank, "
        f"gloo, torch {torch.__version__}, {platform.machine()} {os.cpu_count()} cores, "
        f"iters {args.iters} after {args.warmup} warm-up, bucket {args.bucket_size_mb} MiB, "
        f"load average {os.getloadavg()[0]:.1f}", flush=True)
    t = time.perf_counter()
    peers = [make_peer(k, base, args.lr, args.bucket_size_mb, ddp_kw) for k in keys]
    say(f"# built {len(peers)} peers in {time.perf_counter() - t:.1f} s", flush=True)

    total = args.warmup + args.iters
    measure_at = args.warmup - 1 if args.warmup > 0 else 0
    from tqdm import tqdm

    bar = tqdm(range(total), desc="zero iterations", unit="it", file=sys.stderr,
               disable=args.no_progress or rank != 0)
    for it in bar:
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
    bar.close()

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

    if args.profile or args.trace:
        target = next((p for p in peers if p.key == args.profile_peer), peers[0])
        out_dir = args.trace or args.profile_dir
        write_trace(target, batches, out_dir, rank)
        say(f"# TensorBoard trace of {target.name} written to {args.profile_dir}/ "
            f"(tensorboard --logdir {out_dir})", flush=True)

    mine = {p.key: dict(fb=p.fb, st=p.st, state=p.state_bytes(), grad=p.grad_bytes, grad_pending=p.grad_pending,
                     grad_peak=p.grad_peak)
            for p in peers}
    import resource
    mine["_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    return report(args, world, n_params, n_tensors, peers, everyone, diffs, breakdown, floors, copy_s)




def main(argv: Optional[List[str]] = None) -> int:
    """``benchmarks/zero.py``: the same as ``funcopt bench zero``."""
    from . import main_layer

    return main_layer("zero", sys.argv[1:] if argv is None else argv, prog=os.path.basename(sys.argv[0]) or None)
