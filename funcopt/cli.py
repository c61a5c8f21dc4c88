"""Command line: ``funcopt demo`` and ``funcopt bench`` (also ``python -m funcopt``).

``demo`` trains one small MLP twice from identical weights on identical
batches: once with ``torch.optim.Adam(fused=True)`` and once with
``funcopt.script(funcopt.Adam(...))``.  funcopt's default CPU path calls the
same fused ATen kernel, so both runs must end bitwise equal; the command exits
nonzero when they do not.  Only ``optimizer.step`` is timed, interleaved.

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
from typing import List, Optional, Sequence

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
            "Exits 1 if the two runs differ."
        ),
    )
    demo.add_argument("--steps", type=int, default=200, help="training steps (default: 200)")
    demo.add_argument("--batch-size", type=int, default=256, help="batch size (default: 256)")
    demo.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default: 1e-3)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.add_argument("--threads", type=int, default=None,
                      help="torch intra-op threads (default: torch's default, usually the core count)")
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    # Room for distributed variants (``--zero``, ``--rpc``) once those layers land.
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
    if args.steps < 1:
        print("funcopt demo: --steps must be at least 1", file=sys.stderr)
        return 2
    if args.threads is not None and args.threads < 1:
        print("funcopt demo: --threads must be at least 1", file=sys.stderr)
        return 2
    if args.batch_size < 1:
        print("funcopt demo: --batch-size must be at least 1", file=sys.stderr)
        return 2
    return _demo_local(args)


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
