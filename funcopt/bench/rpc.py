"""Parameter-server optimizer steps: funcopt's RPC DistributedOptimizer vs torch's.

One parameter server (``ps``, rank 0) owns the parameters; 1, 2 and 4 trainer
processes step them concurrently through ``torch.distributed.rpc``
(TensorPipe, loopback).  Each iteration of a trainer is: a forward RPC to
``ps`` (``dot(cat(p_i), k)``), ``dist_autograd.backward`` (the
gradients, dense, land on ``ps``), then ``opt.step(context_id)``.  Peers:

* ``funcopt``: ``funcopt.distributed.DistributedOptimizer`` -- on ``ps`` a
  Python RPC handler takes the worker's step lock (concurrent trainers' steps
  apply one at a time) and makes one TorchScript call that looks the gradients
  up and runs the fused kernel without the GIL;
* ``torch``: ``torch.distributed.optim.DistributedOptimizer`` -- for SGD and
  Adam the step RPC is a TorchScript call into torch's scripted functional
  optimizer (for-loop kernels), with no lock (concurrent steps on the same
  parameters may lose updates).

Models: ``small`` = 500 tensors x 1024 floats (small-tensor heavy) and
``large`` = 4 tensors x 4M floats.  Optimizers: SGD(lr=0.01) and Adam(lr=1e-3).

Reported per (model, optimizer, trainers): optimizer steps per second over all
trainers (iterations finished / wall time of the stepping window; the forward
and backward are the same for both peers) and the median latency of one
``opt.step`` call on a trainer.

The GIL on the server, two ways (both need ``py-spy`` on PATH for the GIL
figures; ``pip install py-spy``; without it they are skipped):

* trainer runs (``--gil-models``): each configuration runs a second time with
  ``py-spy record --gil`` sampling ``ps``: the share of the window some ps
  thread held the GIL, and the GIL time per optimizer step spent in the Python
  step handler (funcopt) -- torch's scripted step RPC has none.
* server alone (``--server also|only|no``): on one process with RPC up, the
  exact handler a step runs on ``ps`` (funcopt's, torch's scripted one, and
  torch's eager ``_LocalOptimizer`` as the control) in a loop: step time alone,
  GIL held per step (py-spy), and step time with a pure-Python thread spinning
  next to it.

Peers alternate within every repetition (the order flips each time) and every
figure is a median over repetitions; ratios are funcopt / torch (> 1: funcopt
faster).

Run::

    funcopt bench rpc                      # everything (see docs/benchmarks.md for times)
    funcopt bench rpc --server only        # the server-alone GIL table only
    funcopt bench rpc --models small --optims adam --trainers 1,4 --server no
    funcopt bench rpc --profile            # also a TensorBoard trace per peer in runs/rpc
    funcopt bench rpc --trace DIR          # the same traces, into DIR
    tensorboard --logdir runs/rpc                 # with torch-tb-profiler installed
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from ._report import print_summary, ratio_row

MODEL_NAMES = ("small", "large")
OPTIM_NAMES = ("sgd", "adam")
# what `funcopt bench --quick` runs of this layer
QUICK = ("--models", "small", "--optims", "adam", "--trainers", "1", "--reps", "2", "--iters-small", "10",
         "--server", "no", "--gil-models", "")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``funcopt bench rpc`` / ``benchmarks/rpc.py``."""
    p.add_argument("--trainers", default="1,2,4", help="trainer counts (default: 1,2,4)")
    p.add_argument("--models", default="small,large", help="small (500 x 1024), large (4 x 4M)")
    p.add_argument("--optims", default="sgd,adam")
    p.add_argument("--reps", type=int, default=3, help="repetitions (default: 3)")
    p.add_argument("--iters-small", type=int, default=15, help="iterations per trainer per run, small model (15)")
    p.add_argument("--iters-large", type=int, default=2, help="iterations per trainer per run, large model (2)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process (default: 1)")
    p.add_argument("--rpc-timeout", type=float, default=120.0)
    p.add_argument("--gil-models", default="small,large",
                   help="models whose configurations run a second time under py-spy --gil on ps (default: "
                        "small,large; '' for none; skipped when py-spy is not installed)")
    p.add_argument("--gil-factor", type=int, default=5,
                   help="the py-spy runs are this many times longer than the timed ones, for enough samples (5)")
    p.add_argument("--profile", action="store_true", help="also write TensorBoard traces of trainer t1")
    p.add_argument("--profile-dir", default="runs/rpc")
    p.add_argument("--trace", default=None, metavar="DIR", help="write the TensorBoard traces of trainer t1 into DIR")
    p.add_argument("--server", choices=("also", "only", "no"), default="also",
                   help="also/only/no: time the step handler on the server alone, with and without a busy "
                        "Python thread, for the GIL held per step (default: also)")
    p.add_argument("--server-seconds", type=float, default=1.0, help="length of each server-alone loop (1.0)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--json", default=None, help="write the raw results here")


def check(args: argparse.Namespace) -> Optional[str]:
    """The first bad option as one line (None: fine); turns the comma lists into lists."""
    from ._rpc_parts import GilSampler

    try:
        args.trainers = [int(x) for x in str(args.trainers).split(",")] if isinstance(args.trainers, str) \
            else args.trainers
    except ValueError:
        return f"--trainers {args.trainers!r}: a comma list of trainer counts (1,2,4)"
    if isinstance(args.models, str):
        args.models = [m for m in args.models.split(",") if m]
        args.optims = [o for o in args.optims.split(",") if o]
        args.gil_models = [m for m in args.gil_models.split(",") if m]
    if not args.trainers or min(args.trainers) < 1:
        return "--trainers: every trainer count must be at least 1"
    if not args.models or not set(args.models) <= set(MODEL_NAMES):
        return f"--models: choose from {', '.join(MODEL_NAMES)}"
    if not args.optims or not set(args.optims) <= set(OPTIM_NAMES):
        return f"--optims: choose from {', '.join(OPTIM_NAMES)}"
    for name in ("reps", "iters_small", "iters_large", "threads", "gil_factor"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    for name in ("rpc_timeout", "server_seconds"):
        if not getattr(args, name) > 0:
            return f"--{name.replace('_', '-')} must be positive, got {getattr(args, name):g}"
    if args.gil_models and not GilSampler.available():
        print("funcopt bench rpc: py-spy not found (pip install py-spy): no GIL figures", file=sys.stderr)
        args.gil_models = []
    return None


def summary_rows(args: argparse.Namespace, out: Dict[str, Any]) -> List[Dict[str, Any]]:
    """funcopt / torch optimizer steps per second, per repetition (> 1: funcopt faster)."""
    rows = []
    res = out.get("results", {})
    for m in args.models:
        for o in args.optims:
            for k in args.trainers:
                f, t = res.get(f"{m}/{o}/{k}/funcopt", []), res.get(f"{m}/{o}/{k}/torch", [])
                rows.append(ratio_row("rpc", f"{m} {o}, {k} trainer(s): funcopt / torch steps/s",
                                      [a["steps_per_s"] / b["steps_per_s"] for a, b in zip(f, t)], None, "higher"))
    return rows


def _rank(rank: int, world: int, args: argparse.Namespace) -> Any:
    """One process (its RPC agent is up): ``ps`` drives every configuration; trainers serve its calls."""
    from ._rpc_parts import drive

    args.tmp = tempfile.mkdtemp(prefix="funcopt_bench_rpc_")
    if rank != 0:
        return None
    return drive(args)


def _rpc_name(rank: int) -> str:
    from ._rpc_parts import PS, trainer_name

    return PS if rank == 0 else trainer_name(rank)


def _server_rank(rank: int, world: int, args: argparse.Namespace) -> Any:
    from ._rpc_parts import server_gil

    _quiet_torch_functional_notice()
    return server_gil(args, tempfile.mkdtemp(prefix="funcopt_bench_rpc_"))


def _quiet_torch_functional_notice() -> None:
    """torch's DistributedOptimizer (the peer) scripts torch's functional optimizers on ``ps`` and
    warns that this is deprecated (forced with ``simplefilter("always")``): drop that notice only.
    Where funcopt scripts, funcopt silences its own (funcopt.script)."""
    import warnings

    from funcopt._compat import ignore_jit_deprecation

    ignore_jit_deprecation()
    orig = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "support for functional optimizers is deprecated" not in str(message):
            orig(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def _make(rank: int, world: int, args: argparse.Namespace) -> Any:
    from ._rpc_parts import _make_models

    _quiet_torch_functional_notice()  # this process is the benchmark's own
    if rank == 0:
        _make_models(args.models)
    return _rank(rank, world, args)


def run(args: argparse.Namespace) -> int:
    """The benchmark: the server-alone table (``--server``), then the trainer runs; prints the summary."""
    problem = check(args) if isinstance(args.models, str) else None
    if problem:
        print(f"funcopt bench rpc: {problem}", file=sys.stderr)
        return 2
    from ..distributed.launch import launch
    from ._rpc_parts import _report, _report_server

    world = 1 + max(args.trainers)
    t0 = time.perf_counter()
    server: Dict[str, Any] = {}
    common = dict(backend="rpc", rpc_name=_rpc_name, timeout=args.rpc_timeout, threads=args.threads,
                  deadline=7200.0, grace=10.0, torchrun=False)
    if args.server != "no":
        res = launch(_server_rank, 1, args, **common)
        if not res.ok:
            print(f"funcopt bench rpc: FAILED: {res.error_line()}", file=sys.stderr)
            return 1
        server = res.returns[0]
        _report_server(args, server, time.perf_counter() - t0)
        if args.server == "only":
            if args.json:
                Path(args.json).write_text(json.dumps(dict(args=vars(args), server=server), indent=1, default=str))
            args.summary_rows = []
            return 0
    t0 = time.perf_counter()
    res = launch(_make, world, args, **common)
    if not res.ok or 0 not in res.returns:
        print(f"funcopt bench rpc: FAILED: {res.error_line() or 'the server returned nothing'}", file=sys.stderr)
        return 1
    out = res.returns[0]
    total = time.perf_counter() - t0
    _report(args, out, 0.0, total)
    rows = summary_rows(args, out)
    args.summary_rows = rows
    print_summary(rows, title="funcopt bench rpc: summary (median ratio over repetitions, min-max)")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args={k: v for k, v in vars(args).items()}, server=server,
                                                   **out), indent=1, default=str))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """``benchmarks/rpc.py``: the same as ``funcopt bench rpc``."""
    from . import main_layer

    return main_layer("rpc", sys.argv[1:] if argv is None else argv, prog=os.path.basename(sys.argv[0]) or None)
