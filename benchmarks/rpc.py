"""Parameter-server optimizer steps: funcopt's RPC DistributedOptimizer vs torch's.

One parameter server (``ps``, rank 0) owns the parameters; 1, 2 and 4 trainer
processes step them concurrently through ``torch.distributed.rpc``
(TensorPipe, loopback).  Each iteration of a trainer is: a forward RPC to
``ps`` (``dot(cat(p_i), k)``), ``dist_autograd.backward`` (the
gradients, dense, land on ``ps``), then ``opt.step(context_id)``.  Peers:

* ``funcopt``: ``funcopt.distributed.DistributedOptimizer`` -- on ``ps`` one
  TorchScript call looks the gradients up and runs the fused kernel, under a
  per-worker lock (concurrent trainers' steps apply one at a time);
* ``torch``: ``torch.distributed.optim.DistributedOptimizer`` -- for SGD and
  Adam it runs torch's scripted functional optimizer (for-loop kernels), with
  no lock (concurrent steps on the same parameters may lose updates).

Models: ``small`` = 500 tensors x 1024 floats (small-tensor heavy) and
``large`` = 4 tensors x 4M floats.  Optimizers: SGD(lr=0.01) and Adam(lr=1e-3).

Reported per (model, optimizer, trainers): optimizer steps per second over all
trainers (iterations finished / wall time of the stepping window; the forward
and backward are the same for both peers) and the median latency of one
``opt.step`` call on a trainer.  GIL figures (``--gil-models``, default: the
small model): each configuration runs a second time while a pure-Python counter
thread spins on ``ps``; reported are the peers' steps/s meanwhile, and the
counter's iteration rate during the run relative to its rate with ``ps`` idle
just before -- what the server's Python work (RPC handlers hold the GIL) left
to it.  On a machine with fewer cores than processes CPU contention lowers it
too.

Peers alternate within every repetition (the order flips each time) and every
figure is a median over repetitions; ratios are funcopt / torch (> 1: funcopt
faster).

Run::

    python benchmarks/rpc.py                      # ~3.5 minutes on a busy 2-core machine
    python benchmarks/rpc.py --iters-small 30 --iters-large 4 --gil-models small,large  # ~8 minutes there
    python benchmarks/rpc.py --models small --optims adam --trainers 1,4
    python benchmarks/rpc.py --profile            # also a TensorBoard trace per peer in runs/rpc
    tensorboard --logdir runs/rpc                 # with torch-tb-profiler installed
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing

MODELS = {"small": (500, 1024), "large": (4, 4 << 20)}
OPTIMS = {"sgd": (torch.optim.SGD, dict(lr=0.01)), "adam": (torch.optim.Adam, dict(lr=1e-3))}
PEERS = ("funcopt", "torch")
PS = "ps"


def trainer_name(rank: int) -> str:
    return f"t{rank}"


# ===================================================================== on ps
_PARAMS: Dict[str, List[torch.Tensor]] = {}
_COEF: Dict[str, torch.Tensor] = {}


def _make_models(names: List[str]) -> None:
    g = torch.Generator().manual_seed(0)
    for name in names:
        n, numel = MODELS[name]
        _PARAMS[name] = [torch.randn(numel, generator=g).requires_grad_() for _ in range(n)]
        _COEF[name] = torch.randn(n * numel, generator=g)


def param_rrefs(name: str) -> List[rpc.RRef]:
    return [rpc.RRef(p) for p in _PARAMS[name]]


def forward(name: str) -> torch.Tensor:
    """dot(cat(p_i), k): a few autograd nodes whatever the tensor count; the
    gradient of p_i is its slice of k, dense."""
    return torch.dot(torch.cat(_PARAMS[name]), _COEF[name])


class Counter(threading.Thread):
    """A pure-Python loop: it runs only while it holds the GIL (and has a core).
    It counts only while ``on`` (otherwise it sleeps and leaves the GIL alone)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.n = 0
        self.on = False
        self.stop = False

    def run(self) -> None:
        while not self.stop:
            if not self.on:
                time.sleep(0.01)
                continue
            for _ in range(1000):
                self.n += 1

    def rate(self, seconds: float) -> float:
        n0, t0 = self.n, time.perf_counter()
        time.sleep(seconds)
        return (self.n - n0) / (time.perf_counter() - t0)


# =============================================================== on a trainer
_OPTS: Dict[tuple, Any] = {}
_RREFS: Dict[str, List[rpc.RRef]] = {}


def _optimizer(model: str, optim: str, peer: str) -> Any:
    key = (model, optim, peer)
    if key not in _OPTS:
        if model not in _RREFS:
            _RREFS[model] = rpc.rpc_sync(PS, param_rrefs, args=(model,))
        cls, kw = OPTIMS[optim]
        if peer == "funcopt":
            from funcopt.distributed import DistributedOptimizer
        else:
            from torch.distributed.optim import DistributedOptimizer
        _OPTS[key] = DistributedOptimizer(cls, _RREFS[model], **kw)
    return _OPTS[key]


def _iteration(opt: Any, model: str, step_times: Optional[List[float]]) -> None:
    with dist_autograd.context() as ctx:
        loss = rpc.rpc_sync(PS, forward, args=(model,))
        dist_autograd.backward(ctx, [loss])
        t0 = time.perf_counter()
        opt.step(ctx)
        if step_times is not None:
            step_times.append(time.perf_counter() - t0)


def prepare(model: str, optim: str, peer: str, warmup: int) -> None:
    """Build the optimizer and run a few steps alone: TorchScript's profiling
    executor optimizes a scripted function during its first calls."""
    opt = _optimizer(model, optim, peer)
    for _ in range(warmup):
        _iteration(opt, model, None)


def run_phase(model: str, optim: str, peer: str, iters: int, warmup: int, start_at: float,
              profile_dir: Optional[str]) -> Dict[str, Any]:
    """Runs in an RPC handler thread of the trainer; ``start_at`` is a shared wall-clock time."""
    opt = _optimizer(model, optim, peer)
    for _ in range(warmup):
        _iteration(opt, model, None)
    time.sleep(max(0.0, start_at - time.time()))
    steps: List[float] = []
    t0 = time.time()
    if profile_dir:
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        handler = tensorboard_trace_handler(profile_dir, worker_name=f"{rpc.get_worker_info().name}-{peer}-{model}-{optim}")
        with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=iters - 1),
                     on_trace_ready=handler, record_shapes=False) as prof:
            for _ in range(iters):
                _iteration(opt, model, steps)
                prof.step()
    else:
        for _ in range(iters):
            _iteration(opt, model, steps)
    return dict(start=t0, end=time.time(), steps=steps)


# ==================================================================== driver
def _phase(args: argparse.Namespace, counter: Counter, model: str, optim: str, peer: str, n: int,
           iters: int, profile_dir: Optional[str] = None, gil: bool = False) -> Dict[str, Any]:
    for r in range(1, n + 1):  # build the optimizers first, one trainer after the other
        if (model, optim, peer, r) not in _SEEN:
            rpc.rpc_sync(trainer_name(r), prepare, args=(model, optim, peer, 2), timeout=args.rpc_timeout)
            _SEEN.add((model, optim, peer, r))
    warmup = 1
    idle = 0.0
    if gil:
        counter.on = True
        idle = counter.rate(0.2)  # the GIL counter with ps idle, just before
    start_at = time.time() + 0.2 + (0.5 if model == "large" else 0.05) * warmup * n
    futs = [rpc.rpc_async(trainer_name(r), run_phase, args=(model, optim, peer, iters, warmup, start_at, profile_dir),
                          timeout=args.rpc_timeout) for r in range(1, n + 1)]
    # the GIL counter's rate in the stepping window (from the common start)
    time.sleep(max(0.0, start_at - time.time()))
    c0, w0 = counter.n, time.perf_counter()
    res = [f.wait() for f in futs]
    c1, w1 = counter.n, time.perf_counter()
    counter.on = False
    start, end = min(r["start"] for r in res), max(r["end"] for r in res)
    steps = [s for r in res for s in r["steps"]]
    return dict(steps_per_s=len(steps) / (end - start), step_ms=statistics.median(steps) * 1e3,
                counter=(c1 - c0) / (w1 - w0) / idle if gil else None, idle=idle)


_SEEN: set = set()


def drive(args: argparse.Namespace) -> Dict[str, Any]:
    counter = Counter()
    counter.start()
    results: Dict[str, Any] = {}
    configs = [(m, o, n) for m in args.models for o in args.optims for n in args.trainers]
    t_all = time.perf_counter()
    for rep in range(args.reps):
        for i, (m, o, n) in enumerate(configs):
            order = PEERS if (rep + i) % 2 == 0 else PEERS[::-1]
            for peer in order:
                iters = args.iters_small if m == "small" else args.iters_large
                r = _phase(args, counter, m, o, peer, n, iters)
                results.setdefault(f"{m}/{o}/{n}/{peer}", []).append(r)
                if m in args.gil_models:  # again, with the busy Python thread on ps
                    r = _phase(args, counter, m, o, peer, n, iters, gil=True)
                    results.setdefault(f"{m}/{o}/{n}/{peer}/gil", []).append(r)
        print(f"  repetition {rep + 1}/{args.reps} done ({time.perf_counter() - t_all:.0f} s)", file=sys.stderr,
              flush=True)
    profiles = []
    if args.profile:
        out = str(Path(args.profile_dir).resolve())
        os.makedirs(out, exist_ok=True)
        for peer in PEERS:
            _phase(args, counter, "small", "adam", peer, 1, 12, profile_dir=out)
        profiles = sorted(str(p) for p in Path(out).glob("*.pt.trace.json"))
    counter.stop = True
    return dict(results=results, profiles=profiles)


def _report(args: argparse.Namespace, out: Dict[str, Any], setup_s: float, total_s: float) -> None:
    res = out["results"]
    idle = statistics.median([r["idle"] for rs in res.values() for r in rs if r["idle"]] or [0.0])
    print()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, python {platform.python_version()}; load average at the end "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"processes: 1 parameter server + {max(args.trainers)} trainers, {args.threads} intra-op thread(s) each; "
          f"{args.reps} repetitions, peers alternating; medians; set-up {setup_s:.0f} s, total {total_s:.0f} s")
    if args.gil_models:
        print(f"GIL runs ({', '.join(args.gil_models)}): each configuration is run a second time with a pure-Python counter thread busy on ps; "
              f"'counter' = its iteration rate during the run / its rate with ps idle just before "
              f"(median idle rate {idle / 1e6:.2f} M/s); 'steps/s w/ counter' = the peers' throughput meanwhile")
    for m in args.models:
        n, numel = MODELS[m]
        for o in args.optims:
            print()
            print(f"{m} model ({n} x {numel:,} floats), {o}: iters/trainer {args.iters_small if m == 'small' else args.iters_large}")
            gil_on = m in args.gil_models
            head = (f"{'trainers':>8} | {'funcopt steps/s':>15} {'torch steps/s':>13} {'ratio':>6} | "
                    f"{'funcopt step ms':>15} {'torch step ms':>13}")
            if gil_on:
                head += f" | {'w/ counter: funcopt':>19} {'torch':>6} {'ratio':>6} | {'counter: funcopt':>16} {'torch':>6}"
            print(head)
            for k in args.trainers:
                row, gil = {}, {}
                for peer in PEERS:
                    rs = res[f"{m}/{o}/{k}/{peer}"]
                    row[peer] = (statistics.median(r["steps_per_s"] for r in rs),
                                 statistics.median(r["step_ms"] for r in rs))
                    if gil_on:
                        gs = res[f"{m}/{o}/{k}/{peer}/gil"]
                        gil[peer] = (statistics.median(r["steps_per_s"] for r in gs),
                                     statistics.median(r["counter"] for r in gs))
                f, t = row["funcopt"], row["torch"]
                line = f"{k:>8} | {f[0]:>15.1f} {t[0]:>13.1f} {f[0] / t[0]:>6.2f} | {f[1]:>15.2f} {t[1]:>13.2f}"
                if gil_on:
                    gf, gt = gil["funcopt"], gil["torch"]
                    line += f" | {gf[0]:>19.1f} {gt[0]:>6.1f} {gf[0] / gt[0]:>6.2f} | {gf[1]:>16.0%} {gt[1]:>6.0%}"
                print(line)
    if out["profiles"]:
        print()
        print("TensorBoard traces (tensorboard --logdir " + args.profile_dir + "):")
        for p in out["profiles"]:
            print("  " + p)


# ================================================================== processes
def _entry(rank: int, world: int, init: str, args: argparse.Namespace, result_file: str) -> None:
    torch.set_num_threads(args.threads)
    name = PS if rank == 0 else trainer_name(rank)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=init, rpc_timeout=args.rpc_timeout)
    try:
        t0 = time.perf_counter()
        if rank == 0:
            _make_models(args.models)
        rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=opts)
        try:
            if rank == 0:
                setup = time.perf_counter() - t0
                out = drive(args)
                torch.save(dict(out=out, setup=setup), result_file)
        finally:
            rpc.shutdown()
    except BaseException:
        Path(result_file + f".error-{name}").write_text(traceback.format_exc())
        raise


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainers", default="1,2,4", help="trainer counts (default: 1,2,4)")
    p.add_argument("--models", default="small,large", help="small (500 x 1024), large (4 x 4M)")
    p.add_argument("--optims", default="sgd,adam")
    p.add_argument("--reps", type=int, default=3, help="repetitions (default: 3)")
    p.add_argument("--iters-small", type=int, default=15, help="iterations per trainer per run, small model (15)")
    p.add_argument("--iters-large", type=int, default=2, help="iterations per trainer per run, large model (2)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process (default: 1)")
    p.add_argument("--rpc-timeout", type=float, default=120.0)
    p.add_argument("--gil-models", default="small",
                   help="models whose configurations also run with a busy Python thread on ps (default: small; "
                        "'small,large' for both, '' for none)")
    p.add_argument("--profile", action="store_true", help="also write TensorBoard traces of trainer t1")
    p.add_argument("--profile-dir", default=str(ROOT / "runs" / "rpc"))
    p.add_argument("--json", default=None, help="write the raw results here")
    args = p.parse_args(argv)
    args.trainers = [int(x) for x in args.trainers.split(",")]
    args.models = args.models.split(",")
    args.optims = args.optims.split(",")
    args.gil_models = [m for m in args.gil_models.split(",") if m]
    if not set(args.models) <= set(MODELS) or not set(args.optims) <= set(OPTIMS) or min(args.trainers) < 1:
        p.error("unknown model/optimizer or a trainer count < 1")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    world = 1 + max(args.trainers)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="funcopt_bench_rpc_") as tmp:
        result_file = os.path.join(tmp, "result.pt")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_entry, args=(r, world, "file://" + os.path.join(tmp, "rdv"), args, result_file))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        errors = sorted(Path(tmp).glob("result.pt.error-*"))
        for e in errors:
            print(e.read_text(), file=sys.stderr)
        if errors or not os.path.exists(result_file):
            print(f"benchmarks/rpc.py: failed; exit codes {[p.exitcode for p in procs]}", file=sys.stderr)
            return 1
        data = torch.load(result_file, weights_only=False)
    total = time.perf_counter() - t0
    _report(args, data["out"], data["setup"], total)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args={k: v for k, v in vars(args).items()}, **data["out"]),
                                              indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
