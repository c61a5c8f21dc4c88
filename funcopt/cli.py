"""Command line: ``funcopt demo`` and ``funcopt bench`` (also ``python -m funcopt``).

``demo`` trains one small MLP twice from identical weights on identical
batches: once with ``torch.optim.Adam(fused=True)`` and once with
``funcopt.script(funcopt.Adam(...))``.  funcopt's default CPU path calls the
same fused ATen kernel, so both runs must end bitwise equal; the command exits
nonzero when they do not.  Only ``optimizer.step`` is timed, interleaved.

``demo --zero {1,2} [--world-size N]`` trains the same MLP data-parallel with
:class:`funcopt.distributed.ZeroRedundancyOptimizer` (ZeRO-1 under DDP, or
ZeRO-2 without DDP) on N local gloo processes, or, when launched by
``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set), on
the processes torchrun started, on one machine or many.  Rank 0 prints each
rank's optimizer-state and gradient bytes next to the unsharded figures, and
the final loss next to a single-process ``torch.optim.Adam`` run on the same
global batches; the command exits nonzero when they differ by more than a tight
tolerance.

Scripting happens only inside ``demo`` (through :func:`funcopt.script`);
importing this module compiles nothing.
"""
from __future__ import annotations

import argparse
import os
import runpy
import statistics
import sys
import time
from pathlib import Path
from typing import Any, List, Optional, Sequence

# Sizes of the demo MLP: 64 -> 256 -> 128 -> 1, 49,665 parameters.
_IN, _H1, _H2 = 64, 256, 128


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="funcopt",
        description="funcopt: functional, TorchScript-compatible optimizers for PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    demo = sub.add_parser(
        "demo",
        help="train a small MLP with torch.optim.Adam(fused=True) and scripted funcopt.Adam; compare",
        description=(
            "Train a small MLP on synthetic regression data twice, from identical weights and "
            "batches: with torch.optim.Adam(fused=True) and with funcopt.script(funcopt.Adam(...)). "
            "Prints final losses (which must be bitwise equal) and median optimizer-step times. "
            "Exits 1 if the two runs differ. "
            "With --zero 1|2: train it data-parallel with funcopt.distributed.ZeroRedundancyOptimizer on "
            "--world-size local gloo processes (or on the processes torchrun started, when RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT are set), print each rank's optimizer-state and gradient bytes next "
            "to the unsharded figures, and compare the final loss with a single-process torch.optim.Adam run "
            "on the same data (exit 1 if they differ beyond a relative 1e-5)."
        ),
    )
    demo.add_argument("--steps", type=int, default=None, help="training steps (default: 200; 100 with --zero)")
    demo.add_argument("--batch-size", type=int, default=256, help="batch size (default: 256)")
    demo.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default: 1e-3)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.add_argument("--threads", type=int, default=None,
                      help="torch intra-op threads (default: torch's default, usually the core count)")
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    demo.add_argument("--zero", type=int, choices=(1, 2), default=None,
                      help="train data-parallel with funcopt's ZeroRedundancyOptimizer: 1 = sharded optimizer "
                           "state under DDP, 2 = sharded state and gradients (no DDP)")
    demo.add_argument("--world-size", type=int, default=None,
                      help="with --zero: local gloo processes to spawn (default: 2); ignored under torchrun, "
                           "which sets the world size")
    from .rpc_demo import add_arguments as _add_rpc_arguments  # --rpc, --trainers

    _add_rpc_arguments(demo)
    demo.set_defaults(func=_cmd_demo)

    bench = sub.add_parser(
        "bench",
        help="run the optimizer-step benchmark (benchmarks/step.py); further arguments are passed on",
        description=(
            "Run benchmarks/step.py from a source checkout; every argument after 'bench' is passed "
            "to it unchanged (see 'funcopt bench -- --help' for its options)."
        ),
    )
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for benchmarks/step.py")
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``funcopt`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # ``bench`` hands everything after it, verbatim, to benchmarks/step.py
    # (argparse would reorder or reject options it does not know).
    if argv[:1] == ["bench"] and argv[1:2] not in (["-h"], ["--help"]):
        rest = argv[1:]
        if rest[:1] == ["--"]:
            rest = rest[1:]
        return _run_bench(rest)
    args = _build_parser().parse_args(argv)
    return int(args.func(args) or 0)


# ---------------------------------------------------------------------- demo
def _cmd_demo(args: argparse.Namespace) -> int:
    if args.steps is None:
        args.steps = 200 if args.zero is None else 100
    if args.steps < 1:
        print("funcopt demo: --steps must be at least 1", file=sys.stderr)
        return 2
    if args.threads is not None and args.threads < 1:
        print("funcopt demo: --threads must be at least 1", file=sys.stderr)
        return 2
    if args.batch_size < 1:
        print("funcopt demo: --batch-size must be at least 1", file=sys.stderr)
        return 2
    problem = _lr_problem(args.lr)
    if problem:  # before anything is spawned: one line, exit 2
        print(f"funcopt demo: --lr {args.lr:g}: {problem}", file=sys.stderr)
        return 2
    if args.rpc:
        from .rpc_demo import run as _demo_rpc

        return _demo_rpc(args)
    if args.zero is not None:
        return _demo_zero(args)
    if args.world_size is not None:
        print("funcopt demo: --world-size needs --zero", file=sys.stderr)
        return 2
    return _demo_local(args)


def _lr_problem(lr: float) -> Optional[str]:
    """torch.optim.Adam's own complaint about ``lr`` (every demo trains with Adam), or None."""
    import torch

    try:
        torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=lr)
    except ValueError as e:
        return str(e)
    return None


def _make_model(torch, seed: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(_IN, _H1),
        torch.nn.ReLU(),
        torch.nn.Linear(_H1, _H2),
        torch.nn.ReLU(),
        torch.nn.Linear(_H2, 1),
    )


def _demo_local(args: argparse.Namespace) -> int:
    import copy

    import torch
    from tqdm import tqdm

    import funcopt

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    steps, batch = args.steps, args.batch_size
    gen = torch.Generator().manual_seed(args.seed)
    # Synthetic regression: a fixed random nonlinear teacher plus noise.
    teacher_w = torch.randn(_IN, 1, generator=gen) / _IN**0.5
    xs = torch.randn(steps, batch, _IN, generator=gen)
    ys = torch.tanh(xs @ teacher_w) + 0.1 * xs[..., :1] ** 2 + 0.01 * torch.randn(steps, batch, 1, generator=gen)

    model_t = _make_model(torch, args.seed)
    model_f = copy.deepcopy(model_t)
    params_t = list(model_t.parameters())
    params_f = list(model_f.parameters())
    n_params = sum(p.numel() for p in params_t)

    opt_t = torch.optim.Adam(params_t, lr=args.lr, fused=True)
    t0 = time.perf_counter()
    opt_f = funcopt.script(funcopt.Adam(params_f, lr=args.lr))
    script_s = time.perf_counter() - t0

    loss_fn = torch.nn.functional.mse_loss
    times_t: List[float] = []
    times_f: List[float] = []
    loss_t = loss_f = float("nan")
    warmup = min(10, steps // 5)
    print(
        f"funcopt demo: MLP {_IN}-{_H1}-{_H2}-1 ({n_params:,} parameters), {steps} steps, "
        f"batch {batch}, Adam lr={args.lr:g}, seed {args.seed}, {torch.get_num_threads()} threads",
        flush=True,
    )
    bar = tqdm(range(steps), desc="training", unit="step", disable=args.no_progress, file=sys.stderr)
    for k in bar:
        x, y = xs[k], ys[k]
        # torch.optim: gradients through p.grad, as usual.
        opt_t.zero_grad(set_to_none=True)
        lt = loss_fn(model_t(x), y)
        lt.backward()
        # funcopt: the functional step, gradients passed explicitly.
        lf = loss_fn(model_f(x), y)
        grads = list(torch.autograd.grad(lf, params_f))
        # Time only the optimizer steps; alternate which goes first.
        # The first steps allocate state and, for the scripted step, let the
        # TorchScript profiling executor specialise the graph: not timed.
        order = (0, 1) if k % 2 == 0 else (1, 0)
        for which in order:
            s = time.perf_counter()
            if which == 0:
                opt_t.step()
            else:
                opt_f.step(grads)
            if k >= warmup:
                (times_t if which == 0 else times_f).append(time.perf_counter() - s)
        loss_t, loss_f = lt.item(), lf.item()
        if not args.no_progress and (k % 10 == 0 or k == steps - 1):
            bar.set_postfix(loss=f"{loss_f:.4g}")
    bar.close()

    # Loss of the trained models on the last batch (after the final step).
    with torch.no_grad():
        final_t = loss_fn(model_t(xs[-1]), ys[-1]).item()
        final_f = loss_fn(model_f(xs[-1]), ys[-1]).item()
    params_equal = all(torch.equal(a, b) for a, b in zip(params_t, params_f))
    losses_equal = final_t == final_f and loss_t == loss_f
    med_t = statistics.median(times_t) * 1e6
    med_f = statistics.median(times_f) * 1e6

    rows = [
        ("torch.optim.Adam(fused=True)", final_t, med_t),
        ("funcopt.script(funcopt.Adam)", final_f, med_f),
    ]
    name_w = max(len(r[0]) for r in rows)
    print()
    print(f"{'optimizer':<{name_w}}  {'final loss':>22}  {'median step (us)':>16}")
    print(f"{'-' * name_w}  {'-' * 22}  {'-' * 16}")
    for name, loss, med in rows:
        print(f"{name:<{name_w}}  {loss!r:>22}  {med:>16.1f}")
    print()
    print(f"step time ratio torch/funcopt: {med_t / med_f:.2f}x (>1: funcopt is faster; median over "
          f"{len(times_f)} steps after {warmup} warm-up steps; scripting took {script_s:.2f} s once)")
    print(f"final losses bitwise equal: {'yes' if losses_equal else 'NO'}")
    print(f"parameters bitwise equal: {'yes' if params_equal else 'NO'}")
    if not (losses_equal and params_equal):
        print("funcopt demo: FAILED: funcopt and torch.optim diverged", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------- demo --zero
# Relative tolerance between the final losses of the sharded run and the
# single-process reference: the all-reduce / reduce-scatter sums the per-rank
# gradient means in another order than one big batch does, so the runs differ
# by rounding (about 1e-7 relative here), not bitwise.
_ZERO_RTOL = 1e-5
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _launched_by_torchrun() -> bool:
    return all(k in os.environ for k in _TORCHRUN_ENV)


def _demo_zero(args: argparse.Namespace) -> int:
    if _launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if args.world_size is not None and args.world_size != world and int(os.environ["RANK"]) == 0:
            print(f"funcopt demo: launched by torchrun with WORLD_SIZE={world}; ignoring --world-size "
                  f"{args.world_size}", file=sys.stderr)
        if args.batch_size % world:
            print(f"funcopt demo: --batch-size {args.batch_size} is not divisible by the world size {world}",
                  file=sys.stderr)
            return 2
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return _zero_worker(int(os.environ["RANK"]), world, "env://", "torchrun", local_world, args)
    world = 2 if args.world_size is None else args.world_size
    if world < 1:
        print("funcopt demo: --world-size must be at least 1", file=sys.stderr)
        return 2
    if args.batch_size % world:
        print(f"funcopt demo: --batch-size {args.batch_size} is not divisible by --world-size {world}",
              file=sys.stderr)
        return 2
    return _spawn_zero(world, args)


def _spawn_zero(world: int, args: argparse.Namespace) -> int:
    """Run ``world`` local ranks as spawned processes; the exit code is rank 0's (or the first failure's)."""
    import multiprocessing
    import shutil
    import tempfile

    ctx = multiprocessing.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="funcopt_demo_")
    init = "file://" + os.path.join(tmp, "rendezvous")
    procs = [ctx.Process(target=_zero_entry, args=(r, world, init, args), name=f"funcopt-demo-rank{r}")
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        failed = None
        while any(p.is_alive() for p in procs):
            for p in procs:
                p.join(0.1)
                if p.exitcode not in (None, 0) and failed is None:
                    failed = p
            if failed is not None:
                # The others would wait for the dead rank until the process-group timeout.
                time.sleep(2.0)
                for p in procs:
                    if p.is_alive():
                        p.terminate()
                for p in procs:
                    p.join(5)
                break
        if failed is not None:
            print(f"funcopt demo: rank {procs.index(failed)} exited with code {failed.exitcode}", file=sys.stderr)
            return failed.exitcode if failed.exitcode and failed.exitcode > 0 else 1
        return procs[0].exitcode or 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def _zero_entry(rank: int, world: int, init: str, args: argparse.Namespace) -> None:
    sys.exit(_zero_worker(rank, world, init, "spawn", world, args))


def _zero_worker(rank: int, world: int, init: str, launcher: str, local_world: int, args: argparse.Namespace) -> int:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        return _zero_train(rank, world, launcher, local_world, args)
    finally:
        dist.destroy_process_group()


def _demo_data(torch, args: argparse.Namespace):
    gen = torch.Generator().manual_seed(args.seed)
    teacher_w = torch.randn(_IN, 1, generator=gen) / _IN**0.5
    xs = torch.randn(args.steps, args.batch_size, _IN, generator=gen)
    ys = torch.tanh(xs @ teacher_w) + 0.1 * xs[..., :1] ** 2 + 0.01 * torch.randn(args.steps, args.batch_size, 1, generator=gen)
    return xs, ys


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _zero_train(rank: int, world: int, launcher: str, local_world: int, args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from tqdm import tqdm

    from .distributed import ZeroRedundancyOptimizer

    t_start = time.perf_counter()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif "OMP_NUM_THREADS" not in os.environ:  # share the cores among this machine's ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    steps, per_rank = args.steps, args.batch_size // world
    xs, ys = _demo_data(torch, args)
    loss_fn = torch.nn.functional.mse_loss
    model = _make_model(torch, args.seed)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    stage = args.zero
    opt = ZeroRedundancyOptimizer(params, torch.optim.Adam, zero_stage=stage, lr=args.lr)
    net = DDP(model) if stage == 1 else model
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    t_built = time.perf_counter()
    if rank == 0:
        how = "DDP + ZeRO-1 (sharded optimizer state)" if stage == 1 else "ZeRO-2 (sharded optimizer state and gradients, no DDP)"
        print(f"funcopt demo --zero {stage}: MLP {_IN}-{_H1}-{_H2}-1 ({n_params:,} parameters), {how}, "
              f"{world} gloo processes ({launcher}), {steps} steps, global batch {args.batch_size} "
              f"({per_rank}/rank), Adam lr={args.lr:g}, seed {args.seed}, {torch.get_num_threads()} thread(s)/rank",
              flush=True)
    bar = tqdm(range(steps), desc="training", unit="step", file=sys.stderr,
               disable=args.no_progress or rank != 0)
    times: List[float] = []
    grad_bytes = 0
    for k in bar:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(xs[k, lo:hi]), ys[k, lo:hi])
        loss.backward()
        if k == steps - 1:  # what this rank holds after backward
            grad_bytes = (opt.grad_shard_bytes() if stage == 2
                          else _tensor_bytes(p.grad for p in params if p.grad is not None))
        opt.step()
        times.append(time.perf_counter() - t0)
        if rank == 0 and not args.no_progress and (k % 10 == 0 or k == steps - 1):
            bar.set_postfix(loss=f"{loss.item():.4g}")
    bar.close()
    t_trained = time.perf_counter()
    state_bytes = opt.state_bytes()
    with torch.no_grad():
        final = loss_fn(model(xs[-1]), ys[-1]).item()  # the full last batch, every rank's parameters are whole
    mine = (state_bytes, grad_bytes, statistics.median(times))
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    verdict: List[Any] = [None]
    if rank == 0:
        verdict[0] = _zero_report(torch, args, world, model, final, everyone)
        print(f"rank 0 wall time: {t_built - t_start:.1f} s set-up (the optimizer scripts its shard's update), "
              f"{t_trained - t_built:.1f} s training, {time.perf_counter() - t_trained:.1f} s single-process reference")
    dist.broadcast_object_list(verdict, src=0)
    return int(verdict[0])


def _zero_report(torch, args: argparse.Namespace, world: int, model, final: float, everyone: List[Any]) -> int:
    """Rank 0: the single-process reference, the memory table, the verdict (exit code)."""
    xs, ys = _demo_data(torch, args)
    ref = _make_model(torch, args.seed)
    ref_params = list(ref.parameters())
    opt = torch.optim.Adam(ref_params, lr=args.lr)
    loss_fn = torch.nn.functional.mse_loss
    for k in range(args.steps):
        opt.zero_grad(set_to_none=True)
        loss_fn(ref(xs[k]), ys[k]).backward()
        if k == args.steps - 1:
            ref_grad = _tensor_bytes(p.grad for p in ref_params if p.grad is not None)
        opt.step()
    ref_state = _tensor_bytes(t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor))
    with torch.no_grad():
        ref_final = loss_fn(ref(xs[-1]), ys[-1]).item()
    max_diff = max((a.detach() - b.detach()).abs().max().item() for a, b in zip(model.parameters(), ref_params))

    print()
    print("per-rank memory after the last backward (bytes; unsharded = single-process torch.optim.Adam):")
    cols = ("rank", "state_bytes", "unsharded_state_bytes", "state_ratio",
            "grad_bytes", "unsharded_grad_bytes", "grad_ratio", "median_step_ms")
    print("  ".join(f"{c:>{max(len(c), 4)}}" for c in cols))
    for r, (sb, gb, t) in enumerate(everyone):
        vals = (str(r), str(sb), str(ref_state), f"{sb / ref_state:.3f}", str(gb), str(ref_grad),
                f"{gb / ref_grad:.3f}", f"{t * 1e3:.2f}")
        print("  ".join(f"{v:>{max(len(c), 4)}}" for v, c in zip(vals, cols)))
    print(f"target per rank: state {ref_state / world:.0f} bytes (1/{world} of unsharded)"
          + (f", gradients {ref_grad / world:.0f} bytes (1/{world})" if args.zero == 2
             else "; gradients stay whole under ZeRO-1 (DDP all-reduces them)"))
    print()
    rel = abs(final - ref_final) / max(abs(ref_final), 1e-30)
    ok = rel <= _ZERO_RTOL and final == final
    print(f"final loss, ZeRO-{args.zero} on {world} ranks:        {final!r}")
    print(f"final loss, torch.optim.Adam in 1 process: {ref_final!r}")
    print(f"relative difference: {rel:.2e} (tolerance {_ZERO_RTOL:g}): {'OK' if ok else 'MISMATCH'}")
    print(f"max |parameter difference|: {max_diff:.2e}")
    if not ok:
        print("funcopt demo: FAILED: the sharded run and the single-process reference diverged", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------- bench
def _find_benchmark(name: str) -> Optional[Path]:
    """``benchmarks/<name>`` in the source checkout this package runs from, or under the cwd."""
    candidates = [
        Path(__file__).resolve().parent.parent / "benchmarks" / name,
        Path(os.getcwd()) / "benchmarks" / name,
    ]
    for path in candidates:
        if path.is_file():
            return path
    return None


def _cmd_bench(args: argparse.Namespace) -> int:
    return _run_bench(list(args.args))


def _run_bench(extra: List[str]) -> int:
    path = _find_benchmark("step.py")
    if path is None:
        print(
            "funcopt bench: benchmarks/step.py not found. The benchmarks ship with the source "
            "checkout, not the installed package: run this from a clone of the funcopt repository "
            "(pip install -e \".[bench]\").",
            file=sys.stderr,
        )
        return 2
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(path), *extra]
    sys.path.insert(0, str(path.parent))  # as `python benchmarks/step.py` would
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
    return 0
