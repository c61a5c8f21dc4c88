"""``funcopt demo --zero 1|2|3`` / ``--fsdp2``: the demo MLP trained sharded, checked against one process.

* ``--zero 1``: DDP + :class:`funcopt.distributed.ZeroRedundancyOptimizer`
  (sharded optimizer state);
* ``--zero 2``: the same optimizer with ``zero_stage=2`` (sharded state and
  gradients, no DDP);
* ``--zero 3``: ``funcopt.distributed.Zero3Sequential`` of ``Zero3Layer``
  (parameters sharded too) with ``funcopt.Adam`` over its chunks;
* ``--fsdp2``: torch's ``fully_shard`` per Linear with ``funcopt.Adam`` (or
  ``--optimizer adafactor``: a whole-parameter rule, stepped on gathered
  parameters) over the DTensor shards;
* ``--checkpoint-dir DIR --checkpoint-every N``: a
  :class:`funcopt.distributed.Checkpointer` saves every N steps and a restarted
  job (``torchrun --max-restarts``) resumes from the newest good save; the last
  line, ``final state sha256: <hex>``, digests the final unsharded parameters,
  optimizer state and learning rates (:mod:`._resume`), the same however many
  restarts happened;
* ``--zero 1 --overlap``: also a copy trained with ``overlap_with_ddp=True``
  (``hook_with_zero_step``: the step inside backward), its median iteration
  time next to the plain run's; the exit code is 1 unless its parameters are
  bitwise the plain run's.

The ranks are ``--world-size`` local gloo processes, or the processes torchrun
started (see :mod:`funcopt.distributed.launch`).  Rank 0 shows a progress bar,
prints each rank's parameter, gradient and optimizer-state bytes next to the
unsharded figures, and the final loss next to a single-process
``torch.optim`` run (Adam, or ``--optimizer``'s class; ``--lr-schedule cosine``: with
``CosineAnnealingLR``) on the same global batches; the exit code is 1 when
they differ by more than a relative :data:`RTOL`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, List, Optional

from ._common import H1, H2, IN, make_data, make_model, rank_threads, table, tensor_bytes

# The all-reduce / reduce-scatter sums the per-rank gradient means in another
# order than one big batch does: the runs differ by rounding (about 1e-7
# relative here), not bitwise.
RTOL = 1e-5
COLLECTIVE_TIMEOUT = 120.0  # seconds per collective
HOW = {1: "DDP + ZeRO-1 (sharded optimizer state)",
       2: "ZeRO-2 (sharded optimizer state and gradients, no DDP)",
       3: "ZeRO-3 (sharded parameters, gradients and optimizer state)",
       "fsdp2": "FSDP2 fully_shard (sharded parameters, gradients and optimizer state)"}


def zero3_missing() -> Optional[str]:
    """Why ``--zero 3`` cannot run here (None when it can)."""
    try:
        from funcopt.distributed import Zero3Layer, Zero3Sequential  # noqa: F401
    except ImportError:
        return "funcopt demo: --zero 3: ZeRO-3 (funcopt.distributed.Zero3Sequential) is not available yet"
    return None


def run(args: argparse.Namespace, world: int) -> int:
    """Launch the ranks (or join torchrun's); the exit code."""
    from ..distributed.launch import launch, under_torchrun

    deadline = 120.0 + 5.0 * args.steps + 60.0 * world
    res = launch(_rank, world, args, timeout=COLLECTIVE_TIMEOUT, deadline=deadline, grace=5.0)
    if not res.ok:
        rank = int(os.environ.get("RANK", "0")) if under_torchrun() else 0
        if rank == 0 or not res.torchrun:
            flag = "--fsdp2" if getattr(args, "fsdp2", False) else f"--zero {args.zero}"
            print(f"funcopt demo {flag}: FAILED: {res.error_line()}", file=sys.stderr)
        return 1
    return int(next(iter(res.returns.values())))


def _model(torch: Any, mode: Any, seed: int) -> Any:
    model = make_model(seed)
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2], model[4]):
            fully_shard(layer)
        fully_shard(model)
        return model
    if mode != 3:
        return model
    from funcopt.distributed import Zero3Layer, Zero3Sequential

    m = list(model)  # Linear, ReLU, Linear, ReLU, Linear: one layer per Linear (+ its activation)
    return Zero3Sequential([Zero3Layer(torch.nn.Sequential(m[0], m[1])), Zero3Layer(torch.nn.Sequential(m[2], m[3])),
                            Zero3Layer(m[4])])


def algorithm(args: argparse.Namespace) -> Any:
    """The funcopt class the demo trains with (``--optimizer``; torch.optim's of the same name is the reference)."""
    import funcopt

    return {"adam": funcopt.Adam, "adafactor": funcopt.Adafactor}[getattr(args, "optimizer", "adam")]


def _optimizer(torch: Any, mode: Any, model: Any, params: List[Any], args: argparse.Namespace) -> Any:
    from funcopt.distributed import ZeroRedundancyOptimizer

    cls = algorithm(args)
    if mode in (3, "fsdp2"):  # a funcopt optimizer over this rank's chunks / DTensor shards
        return cls(params, lr=args.lr)
    return ZeroRedundancyOptimizer(params, cls, zero_stage=mode, lr=args.lr)


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _rank(rank: int, world: int, args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from ._resume import ChaosPlan, Events, state_digest

    t_start = time.perf_counter()
    launcher = "torchrun" if "LOCAL_WORLD_SIZE" in os.environ else "spawned"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(rank_threads(args.threads, local_world))
    mode: Any = "fsdp2" if getattr(args, "fsdp2", False) else args.zero
    steps, per_rank = args.steps, args.batch_size // world
    xs, ys = make_data(args.seed, steps, args.batch_size)
    loss_fn = torch.nn.functional.mse_loss
    model = _model(torch, mode, args.seed)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in make_model(args.seed).parameters())
    opt = _optimizer(torch, mode, model, params, args)
    net = torch.nn.parallel.DistributedDataParallel(model) if mode == 1 else model
    sched = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
             if getattr(args, "lr_schedule", "constant") == "cosine" else None)
    ov = _overlapped(torch, args, model) if getattr(args, "overlap", False) else None
    events = Events(getattr(args, "events", None), rank)
    chaos = ChaosPlan(getattr(args, "chaos_plan", None), rank, events)
    ckpt, start = None, 0
    if getattr(args, "checkpoint_dir", None):
        from funcopt.distributed import Checkpointer

        chaos.directory = args.checkpoint_dir
        ckpt = Checkpointer(args.checkpoint_dir, net, opt, every=args.checkpoint_every, keep=args.checkpoint_keep,
                            scheduler=sched, on_phase=chaos)
        start = ckpt.resume()
    events("start", step=start, world=world)
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    t_built = time.perf_counter()
    name = algorithm(args).__name__
    if rank == 0:
        print(f"funcopt demo {_flag(mode)}: MLP {IN}-{H1}-{H2}-1 ({n_params:,} parameters), {HOW[mode]}, "
              f"{world} gloo processes ({launcher}), {steps} steps, global batch {args.batch_size} "
              f"({per_rank}/rank), {name} lr={args.lr:g}{', cosine schedule' if sched else ''}, seed {args.seed}, "
              f"{torch.get_num_threads()} thread(s)/rank", flush=True)
        if ckpt is not None:
            print(f"checkpoints: {args.checkpoint_dir}, every {args.checkpoint_every} steps, keep "
                  f"{args.checkpoint_keep}; " + (f"resumed from step {start}" if start else "starting fresh"),
                  flush=True)
    bar = tqdm(range(start, steps), desc="training", unit="step", file=sys.stderr,
               disable=args.no_progress or rank != 0, initial=start, total=steps)
    times: List[float] = []
    grad_bytes = 0
    for k in bar:
        chaos("step-begin", k)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(xs[k, lo:hi]), ys[k, lo:hi])
        loss.backward()
        if k == steps - 1:  # what this rank holds after backward
            grad_bytes = (opt.grad_shard_bytes() if mode == 2
                          else tensor_bytes(_local(p.grad) for p in params if p.grad is not None))
        chaos("mid-step", k)
        opt.step()
        if sched is not None:
            sched.step()
        times.append(time.perf_counter() - t0)
        events("step", step=k + 1, loss=float(loss.item()).hex())
        if ckpt is not None and ckpt.step():
            events("saved", step=k + 1)
        if ov is not None:  # the same iteration with the step inside backward
            t0 = time.perf_counter()
            ov["zero"].zero_grad(set_to_none=True)
            loss_fn(ov["ddp"](xs[k, lo:hi]), ys[k, lo:hi]).backward()  # steps inside; no step() call
            ov["times"].append(time.perf_counter() - t0)
        if rank == 0 and not args.no_progress and (k % 10 == 0 or k == steps - 1):
            bar.set_postfix(loss=f"{loss.item():.4g}")
    bar.close()
    t_trained = time.perf_counter()
    if mode in (1, 2):
        state_bytes = int(opt.state_bytes())
    else:
        state_bytes = tensor_bytes(_local(t) for st in opt.state.values() for t in st.values()
                                   if isinstance(t, torch.Tensor))
    param_bytes = tensor_bytes(_local(p) for p in params)
    with torch.no_grad():  # the full last batch (ZeRO-3 / FSDP2 gather each layer on every rank)
        final = loss_fn(model(xs[-1]), ys[-1]).item()
    full = ([p.full_tensor().detach().clone() for p in params] if mode == "fsdp2"
            else [p.detach().clone() for p in params] if mode != 3 else None)
    digest = state_digest(torch, mode, model, opt, params)
    mine = (param_bytes, grad_bytes, state_bytes, statistics.median(times) if times else float("nan"))
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    verdict: List[Any] = [None]
    if rank == 0:
        verdict[0] = _report(torch, args, world, full, final, everyone)
        print(f"rank 0 wall time: {t_built - t_start:.1f} s set-up, {t_trained - t_built:.1f} s training, "
              f"{time.perf_counter() - t_trained:.1f} s single-process reference")
    if ov is not None:
        ov["zero"].step()  # finishes the last parameter syncs
        same = all(torch.equal(a, b) for a, b in zip(params, ov["model"].parameters()))
        if rank == 0:
            plain, over = statistics.median(times), statistics.median(ov["times"])
            print(f"overlap_with_ddp=True (hook_with_zero_step): median iteration {over * 1e3:.2f} ms vs "
                  f"{plain * 1e3:.2f} ms plain ({over / plain:.2f}x); parameters bitwise equal to the plain "
                  f"run: {'yes' if same else 'NO'}; skipped steps: 0")
        flags = [None] * world
        dist.all_gather_object(flags, same)
        if not all(flags):
            verdict[0] = 1
    dist.broadcast_object_list(verdict, src=0)
    events("done", step=steps, digest=digest, verdict=int(verdict[0]))
    events.close()
    if rank == 0:
        print(f"final state sha256: {digest}", flush=True)
    return int(verdict[0])


def _flag(mode: Any) -> str:
    return "--fsdp2" if mode == "fsdp2" else f"--zero {mode}"


def _overlapped(torch: Any, args: argparse.Namespace, model: Any) -> dict:
    """A copy of the model with ZeRO-1 ``overlap_with_ddp=True`` stepping inside backward."""
    import copy

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from funcopt.distributed import ZeroRedundancyOptimizer, hook_with_zero_step

    twin = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(twin)
    zero = ZeroRedundancyOptimizer(list(twin.parameters()), torch.optim.Adam, overlap_with_ddp=True, lr=args.lr)
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    return dict(model=twin, ddp=ddp, zero=zero, times=[])


def _report(torch: Any, args: argparse.Namespace, world: int, full: Optional[List[Any]], final: float,
            everyone: List[Any]) -> int:
    """Rank 0: the single-process reference, the memory table, the verdict (exit code)."""
    xs, ys = make_data(args.seed, args.steps, args.batch_size)
    ref = make_model(args.seed)
    ref_params = list(ref.parameters())
    name = algorithm(args).__name__
    opt = getattr(torch.optim, name)(ref_params, lr=args.lr)
    sched = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
             if getattr(args, "lr_schedule", "constant") == "cosine" else None)
    loss_fn = torch.nn.functional.mse_loss
    ref_grad = 0
    for k in range(args.steps):
        opt.zero_grad(set_to_none=True)
        loss_fn(ref(xs[k]), ys[k]).backward()
        if k == args.steps - 1:
            ref_grad = tensor_bytes(p.grad for p in ref_params if p.grad is not None)
        opt.step()
        if sched is not None:
            sched.step()
    ref_state = tensor_bytes(t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor))
    ref_param = tensor_bytes(ref_params)
    with torch.no_grad():
        ref_final = loss_fn(ref(xs[-1]), ys[-1]).item()

    print()
    print(f"per-rank memory after the last backward (bytes; unsharded = single-process torch.optim.{name}):")
    rows = []
    for r, (pb, gb, sb, t) in enumerate(everyone):
        rows.append((r, pb, ref_param, f"{pb / ref_param:.3f}", gb, ref_grad, f"{gb / ref_grad:.3f}",
                     sb, ref_state, f"{sb / ref_state:.3f}", f"{t * 1e3:.2f}"))
    for line in table(("rank", "param_bytes", "unsharded_param_bytes", "param_ratio", "grad_bytes",
                       "unsharded_grad_bytes", "grad_ratio", "state_bytes", "unsharded_state_bytes",
                       "state_ratio", "median_step_ms"), rows):
        print(line)
    sharded = {1: "optimizer state", 2: "optimizer state and gradients",
               3: "parameters, gradients and optimizer state",
               "fsdp2": "parameters, gradients and optimizer state"}["fsdp2" if getattr(args, "fsdp2", False) else args.zero]
    print(f"target per rank: 1/{world} of the unsharded {sharded} (plus padding)")
    print()
    rel = abs(final - ref_final) / max(abs(ref_final), 1e-30)
    ok = rel <= RTOL and final == final
    label = "FSDP2" if getattr(args, "fsdp2", False) else f"ZeRO-{args.zero}"
    print(f"final loss, {label} on {world} ranks:".ljust(48) + f"{final!r}")
    print(f"final loss, torch.optim.{name} in 1 process:".ljust(48) + f"{ref_final!r}")
    print(f"relative difference: {rel:.2e} (tolerance {RTOL:g}): {'OK' if ok else 'MISMATCH'}")
    if full is not None:
        max_diff = max((a - b.detach()).abs().max().item() for a, b in zip(full, ref_params))
        print(f"max |parameter difference|: {max_diff:.2e}")
    if not ok:
        print("funcopt demo: FAILED: the sharded run and the single-process reference diverged", file=sys.stderr)
        return 1
    return 0
