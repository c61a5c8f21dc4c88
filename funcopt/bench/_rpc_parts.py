"""Processes, peers, GIL sampling and reports of ``funcopt bench rpc`` (see :mod:`funcopt.bench.rpc`)."""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from ._report import quiet_profiler

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


class GilSampler:
    """``py-spy record --gil`` on this process while the ``with`` block runs.

    py-spy keeps a sample only when some thread of the process holds the GIL,
    so (kept samples) / (rate x seconds) is the share of the time the process
    held the GIL; the stacks say which Python code held it.  ``--nonblocking``:
    the process is not paused to be sampled.  Needs the ``py-spy`` executable
    (``pip install py-spy``) and permission to read this process's memory."""

    RATE = 500

    def __init__(self, out_dir: str, tag: str) -> None:
        self.path = os.path.join(out_dir, f"pyspy-{tag}-{os.getpid()}.txt")
        self.stacks: Dict[str, int] = {}
        self.seconds = 0.0

    @staticmethod
    def available() -> bool:
        return shutil.which("py-spy") is not None

    def __enter__(self) -> "GilSampler":
        cmd = ["py-spy", "record", "--pid", str(os.getpid()), "--gil", "--nonblocking", "--rate", str(self.RATE),
               "--format", "raw", "--output", self.path]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first = self.proc.stdout.readline()  # "py-spy> Sampling process ..." once attached
        if "Sampling" not in first:
            self.proc.kill()
            raise RuntimeError(f"py-spy did not start: {first.strip()} {self.proc.stdout.read().strip()}")
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.proc.send_signal(signal.SIGINT)
        self.proc.communicate(timeout=60)
        for line in Path(self.path).read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            self.stacks[stack] = self.stacks.get(stack, 0) + int(n)

    def share(self, *markers: str) -> float:
        """Share of the time the GIL was held (by stacks containing any of ``markers``; all if none)."""
        n = sum(c for st, c in self.stacks.items() if not markers or any(m in st for m in markers))
        return n / (self.RATE * self.seconds)


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
        with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=iters - 1),
                     on_trace_ready=handler, record_shapes=False) as prof:
            for _ in range(iters):
                _iteration(opt, model, steps)
                prof.step()
    else:
        for _ in range(iters):
            _iteration(opt, model, steps)
    return dict(start=t0, end=time.time(), steps=steps)


# ==================================================================== driver
STEP_FRAMES = ("_shard_step", "_local_optimizer_step")  # the Python step handlers on ps (funcopt, torch eager)
FORWARD_FRAMES = (";forward (",)


def _phase(args: argparse.Namespace, model: str, optim: str, peer: str, n: int,
           iters: int, profile_dir: Optional[str] = None, gil: bool = False) -> Dict[str, Any]:
    for r in range(1, n + 1):  # build the optimizers first, one trainer after the other
        if (model, optim, peer, r) not in _SEEN:
            rpc.rpc_sync(trainer_name(r), prepare, args=(model, optim, peer, 2), timeout=args.rpc_timeout)
            _SEEN.add((model, optim, peer, r))
    warmup = 1
    start_at = time.time() + 0.2 + (0.5 if model == "large" else 0.05) * warmup * n
    futs = [rpc.rpc_async(trainer_name(r), run_phase, args=(model, optim, peer, iters, warmup, start_at, profile_dir),
                          timeout=args.rpc_timeout) for r in range(1, n + 1)]
    time.sleep(max(0.0, start_at - time.time()))
    if gil:  # py-spy on ps (this process) over the stepping window
        with GilSampler(args.tmp, f"{model}-{optim}-{n}-{peer}") as g:
            res = [f.wait() for f in futs]
    else:
        res = [f.wait() for f in futs]
    start, end = min(r["start"] for r in res), max(r["end"] for r in res)
    steps = [s for r in res for s in r["steps"]]
    out = dict(steps_per_s=len(steps) / (end - start), step_ms=statistics.median(steps) * 1e3)
    if gil:
        per = g.seconds / len(steps) * 1e6  # us of window per optimizer step
        out.update(gil_share=g.share(), gil_step_us=g.share(*STEP_FRAMES) * per,
                   gil_fwd_us=g.share(*FORWARD_FRAMES) * per, gil_all_us=g.share() * per)
    return out


_SEEN: set = set()


def drive(args: argparse.Namespace) -> Dict[str, Any]:
    results: Dict[str, Any] = {}
    configs = [(m, o, n) for m in args.models for o in args.optims for n in args.trainers]
    from tqdm import tqdm

    bar = tqdm(total=args.reps * len(configs), desc="rpc configurations", unit="cfg", file=sys.stderr,
               disable=args.no_progress)
    for rep in range(args.reps):
        for i, (m, o, n) in enumerate(configs):
            order = PEERS if (rep + i) % 2 == 0 else PEERS[::-1]
            for peer in order:
                iters = args.iters_small if m == "small" else args.iters_large
                r = _phase(args, m, o, peer, n, iters)
                results.setdefault(f"{m}/{o}/{n}/{peer}", []).append(r)
                if m in args.gil_models:  # again, longer, under py-spy
                    r = _phase(args, m, o, peer, n, iters * args.gil_factor, gil=True)
                    results.setdefault(f"{m}/{o}/{n}/{peer}/gil", []).append(r)
            bar.update()
    bar.close()
    profiles = []
    if args.profile or args.trace:
        out = str(Path(args.trace or args.profile_dir).resolve())
        os.makedirs(out, exist_ok=True)
        for peer in PEERS:
            _phase(args, "small", "adam", peer, 1, 12, profile_dir=out)
        profiles = sorted(str(p) for p in Path(out).glob("*.pt.trace.json"))
    return dict(results=results, profiles=profiles)


def _report(args: argparse.Namespace, out: Dict[str, Any], setup_s: float, total_s: float) -> None:
    res = out["results"]
    print()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, python {platform.python_version()}; load average at the end "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"processes: 1 parameter server + {max(args.trainers)} trainers, {args.threads} intra-op thread(s) each; "
          f"{args.reps} repetitions, peers alternating; medians; set-up {setup_s:.0f} s, total {total_s:.0f} s")
    if args.gil_models:
        print(f"GIL on ps ({', '.join(args.gil_models)}): each configuration is run a second time under py-spy --gil "
              f"(nonblocking, {GilSampler.RATE} Hz, {args.gil_factor}x the iterations); 'GIL %' = share of the stepping window some ps thread held "
              f"the GIL; 'step us' = of that, in the Python step handler (funcopt: _shard_step), per optimizer step; "
              f"'all us' = everything (RPC decoding, the forward's handler...), per trainer iteration")
    for m in args.models:
        n, numel = MODELS[m]
        for o in args.optims:
            print()
            print(f"{m} model ({n} x {numel:,} floats), {o}: iters/trainer {args.iters_small if m == 'small' else args.iters_large}")
            gil_on = m in args.gil_models
            head = (f"{'trainers':>8} | {'funcopt steps/s':>15} {'torch steps/s':>13} {'ratio':>6} | "
                    f"{'funcopt step ms':>15} {'torch step ms':>13}")
            if gil_on:
                head += (f" | {'GIL %: funcopt':>14} {'torch':>6} | {'step us: funcopt':>16} {'torch':>6} | "
                         f"{'all us: funcopt':>15} {'torch':>6}")
            print(head)
            for k in args.trainers:
                row, gil = {}, {}
                for peer in PEERS:
                    rs = res[f"{m}/{o}/{k}/{peer}"]
                    row[peer] = (statistics.median(r["steps_per_s"] for r in rs),
                                 statistics.median(r["step_ms"] for r in rs))
                    if gil_on:
                        gs = res[f"{m}/{o}/{k}/{peer}/gil"]
                        gil[peer] = [statistics.median(r[key] for r in gs)
                                     for key in ("gil_share", "gil_step_us", "gil_all_us")]
                f, t = row["funcopt"], row["torch"]
                line = f"{k:>8} | {f[0]:>15.1f} {t[0]:>13.1f} {f[0] / t[0]:>6.2f} | {f[1]:>15.2f} {t[1]:>13.2f}"
                if gil_on:
                    gf, gt = gil["funcopt"], gil["torch"]
                    line += (f" | {gf[0]:>14.1%} {gt[0]:>6.1%} | {gf[1]:>16.0f} {gt[1]:>6.0f} | "
                             f"{gf[2]:>15.0f} {gt[2]:>6.0f}")
                print(line)
    if out["profiles"]:
        print()
        print("TensorBoard traces (tensorboard --logdir " + (args.trace or args.profile_dir) + "):")
        for p in out["profiles"]:
            print("  " + p)


# ============================================== the server alone: GIL per step
def _server_step_fns(model: str, optim: str, rrefs: List[rpc.RRef]) -> Dict[str, Any]:
    """What an RPC handler on ``ps`` runs for one ``opt.step(ctx)``, per peer."""
    from torch.distributed.optim import optimizer as tdo
    from torch.distributed.optim.utils import functional_optim_map

    from funcopt.distributed.rpc import _Shard, _shard_step

    cls, kw = OPTIMS[optim]
    shard = _Shard(cls.__name__, rrefs, (), dict(kw))
    scripted = tdo._new_script_local_optimizer(functional_optim_map[cls], rrefs, **kw)
    eager = tdo._new_local_optimizer(cls, rrefs, **kw)
    return {
        # funcopt: a Python RPC handler takes the worker lock and makes one TorchScript call
        "funcopt": lambda ctx: _shard_step(shard.id, ctx, None),
        # torch, SGD/Adam: a TorchScript function (the RPC itself is a script call)
        "torch": lambda ctx: tdo._script_local_optimizer_step(scripted, ctx),
        # the control: torch's eager local optimizer (what it uses for other classes)
        "torch eager": lambda ctx: tdo._local_optimizer_step(eager, ctx),
    }


def _loop(fn: Any, ctx: int, seconds: float, times: List[float]) -> None:
    end = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        fn(ctx)
        t1 = time.perf_counter()
        times.append(t1 - t0)
        if t1 >= end:
            return


def server_gil(args: argparse.Namespace, out_dir: str) -> Dict[str, Any]:
    """On one process with RPC up (world size 1), for each peer, the server-side
    step handler in a loop three times: alone (step time); under py-spy (the GIL
    held per step); with a pure-Python thread busy next to it (what other Python
    work on the server does to the step: every GIL hand-back waits up to
    ``sys.getswitchinterval()``)."""
    counter = Counter()
    counter.start()
    spy = GilSampler.available()
    out: Dict[str, Any] = {}
    for model in args.models:
        _make_models([model])
        rrefs = param_rrefs(model)
        for optim in args.optims:
            fns = _server_step_fns(model, optim, rrefs)
            with dist_autograd.context() as ctx:  # gradients for every parameter, kept in the context
                dist_autograd.backward(ctx, [forward(model)])
                for fn in fns.values():  # warm-up: TorchScript's profiling executor, state allocation
                    for _ in range(3):
                        fn(ctx)
                for rep in range(args.reps):
                    order = list(fns) if rep % 2 == 0 else list(fns)[::-1]
                    for peer in order:
                        r: Dict[str, Any] = {}
                        alone: List[float] = []
                        _loop(fns[peer], ctx, args.server_seconds, alone)
                        r["step_ms"] = statistics.median(alone) * 1e3
                        if spy:
                            sampled: List[float] = []
                            with GilSampler(out_dir, f"{model}-{optim}-{peer.replace(' ', '_')}") as g:
                                _loop(fns[peer], ctx, args.server_seconds, sampled)
                            r["gil_share"] = g.share()
                            r["gil_us"] = g.share() * g.seconds / len(sampled) * 1e6
                        counter.on = True
                        busy: List[float] = []
                        _loop(fns[peer], ctx, args.server_seconds, busy)
                        counter.on = False
                        r["step_ms_busy"] = statistics.median(busy) * 1e3
                        out.setdefault(f"{model}/{optim}/{peer}", []).append(r)
        _PARAMS.pop(model)
        _COEF.pop(model)
    counter.stop = True
    return out


def _report_server(args: argparse.Namespace, res: Dict[str, Any], total_s: float) -> None:
    spy = all("gil_us" in r for rs in res.values() for r in rs)
    print()
    print(f"server alone: the handler one opt.step(ctx) runs on ps, in a loop on one process with RPC up "
          f"({args.reps} repetitions x {args.server_seconds} s per column, peers alternating, medians; {total_s:.0f} s)")
    print("  step ms: alone | GIL held: py-spy --gil samples / (rate x time), per step and as a share of the loop"
          + ("" if spy else " (py-spy not found: not measured)")
          + " | step ms w/ busy thread: a pure-Python thread spinning next to the loop")
    print(f"{'model':>6} {'optim':>5} {'peer':>12} | {'step ms':>8} | {'GIL held/step':>13} {'share':>6} | "
          f"{'step ms w/ busy thread':>22}")
    for key, rs in res.items():
        model, optim, peer = key.split("/")
        gil = (f"{statistics.median(r['gil_us'] for r in rs):>10.0f} us "
               f"{statistics.median(r['gil_share'] for r in rs):>6.1%}") if spy else f"{'-':>13} {'-':>6}"
        print(f"{model:>6} {optim:>5} {peer:>12} | {statistics.median(r['step_ms'] for r in rs):>8.2f} | {gil} | "
              f"{statistics.median(r['step_ms_busy'] for r in rs):>22.2f}")


