"""``funcopt demo --rpc``: a short run of ``examples/rpc_parameter_server.py``.

One parameter server and ``--trainers`` trainer processes (spawned here, or the
processes ``torchrun`` started) train a small MLP through
:class:`funcopt.distributed.DistributedOptimizer`.  The trainers take turns
(``--schedule round-robin``), so the run is deterministic and the server
checks it against a local run of the same batches in the same order: the
parameters must be bitwise equal.  The server shows a progress bar and prints
the final loss, the optimizer steps per second and that comparison; the
command exits nonzero when they differ.

Failures end in bounded time with one line: bad arguments (a negative
``--lr``, ...) are refused before anything is spawned (exit code 2, checked by
``funcopt demo`` itself); an error in a process during the run (on a trainer,
or raised on the server and relayed to a trainer) stops every process and the
server prints ``rpc parameter server: FAILED: <process>: <error>`` (exit 1).

The example ships with the source checkout, not with the installed package.
This module imports nothing heavy until the demo runs.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Optional

EXAMPLE = "rpc_parameter_server"


def add_arguments(demo: argparse.ArgumentParser) -> None:
    """The ``--rpc`` options of ``funcopt demo``."""
    demo.add_argument("--rpc", action="store_true",
                      help="train with funcopt's RPC DistributedOptimizer: 1 parameter server + --trainers "
                           "trainer processes (examples/rpc_parameter_server.py), checked against a local run")
    demo.add_argument("--trainers", type=int, default=None,
                      help="with --rpc: trainer processes to spawn (default: 2); under torchrun every rank "
                           "but 0 is a trainer")


def _find_example() -> Optional[Path]:
    for path in (Path(__file__).resolve().parent.parent / "examples" / f"{EXAMPLE}.py",
                 Path(os.getcwd()) / "examples" / f"{EXAMPLE}.py"):
        if path.is_file():
            return path
    return None


def run(args: argparse.Namespace) -> int:
    """Run the example with the demo's arguments; its exit code."""
    if getattr(args, "zero", None) is not None:
        print("funcopt demo: --rpc and --zero are separate demos; pass one of them", file=sys.stderr)
        return 2
    if getattr(args, "world_size", None) is not None:
        print("funcopt demo: --world-size is for --zero; --rpc takes --trainers", file=sys.stderr)
        return 2
    trainers = 2 if args.trainers is None else args.trainers
    if trainers < 1:
        print("funcopt demo: --trainers must be at least 1", file=sys.stderr)
        return 2
    path = _find_example()
    if path is None:
        print(f"funcopt demo --rpc: examples/{EXAMPLE}.py not found. The examples ship with the source "
              "checkout, not the installed package: run this from a clone of the funcopt repository.",
              file=sys.stderr)
        return 2
    # Imported as a module by name (not run as a file): the spawned processes
    # re-import it by that name, from the path the parent hands them.
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    example = importlib.import_module(EXAMPLE)
    argv = ["--schedule", "round-robin", "--trainers", str(trainers), "--steps", str(args.steps),
            "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--seed", str(args.seed),
            "--threads", str(args.threads or 1)]
    if args.no_progress:
        argv.append("--no-progress")
    return int(example.main(argv) or 0)
