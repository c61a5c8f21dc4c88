"""Command line: ``funcopt demo``, ``funcopt bench`` and ``funcopt --version`` (also ``python -m funcopt``).

Everything the commands run ships in the package (:mod:`funcopt.demos`,
:mod:`funcopt.bench`).  Bad arguments are refused before anything is spawned
or computed: one line on stderr, exit code 2.  Importing this module imports
neither torch nor anything that scripts.

* ``funcopt demo``: torch.optim.Adam(fused=True) against scripted
  funcopt.Adam on a small MLP; exit 1 unless bitwise equal
  (:mod:`funcopt.demos.local`).
* ``funcopt demo --zero 1|2|3 [--world-size N]``: the MLP trained sharded over
  N gloo ranks (or torchrun's), memory per rank and the final loss against a
  single-process run (:mod:`funcopt.demos.zero`).
* ``funcopt demo --rpc [--trainers N]``: a parameter server and N trainers with
  funcopt's RPC DistributedOptimizer, bitwise against a local run
  (:mod:`funcopt.demos.rpc`).
* ``funcopt bench [--quick] [--trace DIR]``: the step, ZeRO and RPC
  benchmarks, one summary table of ratios with their spread;
  ``funcopt bench step|zero|rpc [options]`` runs one with all its options
  (:mod:`funcopt.bench`).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn, Optional, Sequence

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
BENCH_LAYERS = ("step", "zero", "rpc")


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``prog: message``) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def _version() -> str:
    import platform

    import torch

    import funcopt

    return f"funcopt {funcopt.__version__} (torch {torch.__version__}, Python {platform.python_version()})"


def _build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="funcopt",
                           description="funcopt: functional, TorchScript-compatible optimizers for PyTorch.")
    parser.add_argument("--version", action="store_true", help="print funcopt's and torch's versions and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)

    demo = sub.add_parser(
        "demo", help="train a small MLP with torch.optim and funcopt and compare (also --zero 1|2|3, --rpc)",
        description=(
            "Train a small MLP on synthetic regression data twice, from identical weights and batches: with "
            "torch.optim.Adam(fused=True) and with funcopt.script(funcopt.Adam(...)); the final losses must be "
            "bitwise equal (exit 1 otherwise). With --zero 1|2|3: train it sharded with funcopt's ZeRO on "
            "--world-size local gloo processes (or torchrun's: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set), "
            "print each rank's parameter, gradient and optimizer-state bytes next to the unsharded figures and "
            "compare the final loss with a single-process torch.optim.Adam run (exit 1 beyond a relative 1e-5). "
            "With --rpc: a parameter server and --trainers trainers over torch.distributed.rpc with funcopt's "
            "DistributedOptimizer, taking turns, bitwise against a local run."))
    demo.add_argument("--steps", type=int, default=None,
                      help="training steps (default: 200; 100 with --zero; 40 with --rpc)")
    demo.add_argument("--batch-size", type=int, default=None, help="batch size (default: 256; 64 with --rpc)")
    demo.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default: 1e-3)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.add_argument("--threads", type=int, default=None,
                      help="torch intra-op threads (per process; default: torch's, shared among local ranks)")
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    demo.add_argument("--zero", type=int, choices=(1, 2, 3), default=None,
                      help="train sharded: 1 = optimizer state (under DDP), 2 = state and gradients, "
                           "3 = parameters too (Zero3Sequential)")
    demo.add_argument("--overlap", action="store_true",
                      help="with --zero 1: also train with overlap_with_ddp=True (the step inside backward, "
                           "hook_with_zero_step) next to the plain run; they must be bitwise equal")
    demo.add_argument("--world-size", type=int, default=None,
                      help="with --zero: local gloo processes to spawn (default: 2); under torchrun, torchrun's")
    demo.add_argument("--rpc", action="store_true",
                      help="train with funcopt's RPC DistributedOptimizer: 1 parameter server + --trainers "
                           "trainer processes, checked against a local run")
    demo.add_argument("--trainers", type=int, default=None,
                      help="with --rpc: trainer processes to spawn (default: 2); under torchrun every rank but 0")
    demo.add_argument("--fsdp2", action="store_true",
                      help="train sharded with torch's FSDP2 (fully_shard) and a funcopt optimizer, like --zero")
    demo.add_argument("--optimizer", choices=("adam", "adafactor"), default="adam",
                      help="with --zero 1|2 or --fsdp2: the algorithm (default: adam; adafactor needs whole "
                           "parameters: greedy ZeRO placement, gathered under FSDP2)")
    demo.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                      help="with --zero/--fsdp2: constant, or CosineAnnealingLR over --steps (default: constant)")
    demo.add_argument("--checkpoint-dir", default=None,
                      help="with --zero/--fsdp2: save here every --checkpoint-every steps and resume from the "
                           "newest good save when started again (funcopt.distributed.Checkpointer)")
    demo.add_argument("--checkpoint-every", type=int, default=None,
                      help="with --checkpoint-dir: steps between saves (default: 10)")
    demo.add_argument("--checkpoint-keep", type=int, default=None,
                      help="with --checkpoint-dir: saves kept (default: 2)")
    demo.add_argument("--events", default=None, help=argparse.SUPPRESS)  # benchmarks/chaos.py: JSON-lines log
    demo.add_argument("--chaos-plan", default=None, help=argparse.SUPPRESS)  # benchmarks/chaos.py: kills to inject
    demo.set_defaults(func=_cmd_demo)

    bench = sub.add_parser(
        "bench", help="benchmarks: optimizer step, ZeRO, RPC (funcopt bench step|zero|rpc --help for each)",
        description=(
            "Without a layer: run the step, ZeRO and RPC benchmarks one after the other and end with one "
            "summary table (each ratio with its min-max spread over repeats; a target is met only when the "
            "whole spread meets it). 'funcopt bench step|zero|rpc [options]' runs one benchmark with all its "
            "options (see 'funcopt bench step --help')."))
    from .bench import add_all_arguments

    add_all_arguments(bench)
    bench.set_defaults(func=_cmd_bench_all)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``funcopt`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in BENCH_LAYERS:
        from .bench import main_layer

        return main_layer(argv[1], argv[2:], prog=f"funcopt bench {argv[1]}")
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.version:
        print(_version())
        return 0
    if args.command is None:
        parser.error("the following arguments are required: COMMAND (demo or bench; --help lists them)")
    return int(args.func(args) or 0)


# ---------------------------------------------------------------------- demo
def _fail(message: str) -> int:
    print(f"funcopt demo: {message}", file=sys.stderr)
    return 2


def demo_problem(args: argparse.Namespace) -> Optional[str]:
    """The first bad ``funcopt demo`` option as one line, or None; checks only, runs nothing."""
    from .demos._common import lr_problem

    if args.rpc and args.zero is not None:
        return "--rpc and --zero are separate demos; pass one of them"
    if args.world_size is not None and args.zero is None and not args.fsdp2:
        return "--world-size is for --zero; --rpc takes --trainers" if args.rpc else "--world-size needs --zero"
    if args.trainers is not None and not args.rpc:
        return "--trainers is for --rpc"
    if getattr(args, "overlap", False) and args.zero != 1:
        return "--overlap is for --zero 1 (ZeRO-1 with DDP)"
    sharded = args.zero is not None or args.fsdp2
    if args.fsdp2 and (args.zero is not None or args.rpc):
        return "--fsdp2 is its own demo; pass it without --zero and --rpc"
    for flag, value, default in (("--optimizer", args.optimizer, "adam"), ("--lr-schedule", args.lr_schedule, "constant"),
                                 ("--checkpoint-dir", args.checkpoint_dir, None), ("--events", args.events, None),
                                 ("--chaos-plan", args.chaos_plan, None)):
        if value != default and not sharded:
            return f"{flag} is for --zero 1|2|3 and --fsdp2"
    if args.optimizer == "adafactor" and args.zero == 3:
        return ("--optimizer adafactor needs each parameter whole, and ZeRO-3 steps flat chunks of several "
                "parameters; use --zero 1|2 or --fsdp2")
    for flag, value in (("--checkpoint-every", args.checkpoint_every), ("--checkpoint-keep", args.checkpoint_keep)):
        if value is not None and args.checkpoint_dir is None:
            return f"{flag} needs --checkpoint-dir"
    if args.checkpoint_dir is not None and getattr(args, "overlap", False):
        return "--overlap and --checkpoint-dir do not go together (the overlapped copy is not checkpointed)"
    for name in ("steps", "batch_size", "threads", "world_size", "trainers", "checkpoint_every", "checkpoint_keep"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {value}"
    problem = lr_problem(args.lr)
    if problem:
        return f"--lr {args.lr:g}: {problem}"
    return None


def _cmd_demo(args: argparse.Namespace) -> int:
    problem = demo_problem(args)
    if problem:  # before anything is spawned: one line, exit 2
        return _fail(problem)
    if args.steps is None:
        args.steps = 40 if args.rpc else 100 if args.zero is not None or args.fsdp2 else 200
    if args.batch_size is None:
        args.batch_size = 64 if args.rpc else 256
    if args.rpc:
        from .demos import rpc

        ns = argparse.Namespace(trainers=args.trainers or 2, steps=args.steps, schedule="round-robin",
                                batch_size=args.batch_size, lr=args.lr, seed=args.seed, threads=args.threads or 1,
                                rpc_timeout=60.0, timeout=600.0, no_progress=args.no_progress)
        return rpc.run(ns)
    if args.checkpoint_dir is not None:
        args.checkpoint_every = args.checkpoint_every or 10
        args.checkpoint_keep = args.checkpoint_keep or 2
    if args.zero is not None or args.fsdp2:
        return _demo_zero(args)
    from .demos import local

    return local.run(args)


def _demo_zero(args: argparse.Namespace) -> int:
    from .demos import zero

    if args.zero == 3:
        missing = zero.zero3_missing()
        if missing:
            print(missing, file=sys.stderr)
            return 2
    if all(k in os.environ for k in _TORCHRUN_ENV):
        world = int(os.environ["WORLD_SIZE"])
        if args.world_size is not None and args.world_size != world and os.environ["RANK"] == "0":
            print(f"funcopt demo: launched by torchrun with WORLD_SIZE={world}; ignoring --world-size "
                  f"{args.world_size}", file=sys.stderr)
        if args.batch_size % world:
            return _fail(f"--batch-size {args.batch_size} is not divisible by the world size {world}")
    else:
        world = args.world_size or 2
        if args.batch_size % world:
            return _fail(f"--batch-size {args.batch_size} is not divisible by --world-size {world}")
    return zero.run(args, world)


# --------------------------------------------------------------------- bench
def _cmd_bench_all(args: argparse.Namespace) -> int:
    from .bench import run_all

    return run_all(args)
