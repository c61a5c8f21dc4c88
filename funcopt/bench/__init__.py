"""What ``funcopt bench`` runs; everything ships in the package.

* :mod:`funcopt.bench.step`: one optimizer step, funcopt against torch.optim
  (for-loop, foreach, fused), torch's scripted functional optimizers and the
  ATen fused kernel; the GIL figure (``benchmarks/step.py``);
* :mod:`funcopt.bench.zero`: ZeRO-1/2 step+sync time and per-rank memory
  against DDP and torch's ZeroRedundancyOptimizer (``benchmarks/zero.py``);
* :mod:`funcopt.bench.rpc`: the RPC parameter server, funcopt's
  DistributedOptimizer against torch's (``benchmarks/rpc.py``).

``funcopt bench`` runs all three (``--quick``: a first look in under a
minute) and ends with one summary table: every ratio with its spread (min-max
over repeats), a target marked met only when the whole spread meets it.
``funcopt bench step|zero|rpc [options]`` runs one with all its options.
Importing this package imports nothing heavy.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional, Sequence

LAYERS = ("step", "zero", "rpc")


def _module(layer: str):
    return importlib.import_module(f"{__name__}.{layer}")


def layer_parser(layer: str, prog: str) -> argparse.ArgumentParser:
    """The option parser of one benchmark (its module's ``add_arguments``)."""
    from ..cli import OneLineParser

    mod = _module(layer)
    p = OneLineParser(prog=prog, description=mod.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mod.add_arguments(p)
    return p


def main_layer(layer: str, argv: Sequence[str], prog: Optional[str] = None) -> int:
    """Parse ``argv`` for benchmark ``layer`` and run it; the exit code (2: bad option, one line)."""
    prog = prog or f"funcopt bench {layer}"
    p = layer_parser(layer, prog)
    args = p.parse_args(list(argv))
    mod = _module(layer)
    problem = mod.check(args)
    if problem:
        p.error(problem)
    return int(mod.run(args) or 0)


def add_all_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``funcopt bench`` without a layer."""
    p.add_argument("--quick", action="store_true",
                   help="a first look in under a minute: few sizes, few repeats, small models")
    p.add_argument("--only", default=",".join(LAYERS),
                   help="comma list of the layers to run (default: %(default)s)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="also write torch.profiler traces (TensorBoard, torch-tb-profiler) into DIR")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.add_argument("--json", default=None, help="also write the summary rows to this JSON file")


def run_all(args: argparse.Namespace) -> int:
    """``funcopt bench``: each layer with its defaults (or quick ones), then the summary table."""
    import json
    import time

    from ._report import print_summary

    layers = [x.strip() for x in args.only.split(",") if x.strip()]
    bad = [x for x in layers if x not in LAYERS]
    if bad or not layers:
        print(f"funcopt bench: --only {args.only!r}: choose from {', '.join(LAYERS)}", file=sys.stderr)
        return 2
    rows: List[dict] = []
    code = 0
    t0 = time.perf_counter()
    for layer in layers:
        mod = _module(layer)
        argv = list(mod.QUICK if args.quick else ())
        if args.no_progress:
            argv.append("--no-progress")
        if args.trace:
            argv += ["--trace", args.trace]
        ns = layer_parser(layer, f"funcopt bench {layer}").parse_args(argv)
        print(f"\n=== funcopt bench {layer} {' '.join(argv)}".rstrip(), flush=True)
        got = mod.run(ns)
        if got:
            code = got
        rows += getattr(ns, "summary_rows", [])
    print_summary(rows, title=f"funcopt bench{' --quick' if args.quick else ''}: summary "
                              f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return code
