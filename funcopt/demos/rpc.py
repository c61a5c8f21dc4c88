"""``funcopt demo --rpc``: parameter-server training with funcopt's RPC DistributedOptimizer.

One process, the *parameter server* ``ps`` (rank 0), owns a small MLP.  N
*trainer* processes train it together over ``torch.distributed.rpc``:

1. forward: a trainer sends its batch to ``ps``, which runs the model on its
   own parameters and returns the output;
2. loss and backward on the trainer, through ``torch.distributed.autograd``:
   the gradients land on ``ps``, inside the trainer's autograd context;
3. ``opt.step(context_id)``: :class:`funcopt.distributed.DistributedOptimizer`
   asks ``ps`` to apply them.  On ``ps`` the gradient lookup and the fused
   Adam kernel run as one TorchScript call, without the GIL; a per-worker lock
   makes the trainers' steps apply one at a time, whole.

As with ``torch.distributed.optim.DistributedOptimizer``, every trainer's
optimizer is its own: the parameters are shared, but each trainer's Adam
moments and step count live on ``ps`` separately (N trainers, N Adam states).
The trainers pass ``torch.optim.Adam`` itself: the funcopt optimizer is a
drop-in for torch's.

Two schedules:

* ``--schedule async`` (the script's default): trainers step whenever they are
  ready, as a parameter server usually runs; not reproducible bit for bit.
* ``--schedule round-robin`` (what ``funcopt demo --rpc`` runs): the trainers
  take turns (global step g belongs to trainer ``g % N`` and waits for step
  g-1), so the run is deterministic, and ``ps`` checks it against a local run
  over the same batches in the same order, with one
  ``torch.optim.Adam(fused=True)`` per trainer: the parameters must be bitwise
  equal (the same fused kernel runs on both sides).

``ps`` shows a progress bar and prints the summary: final loss on a held-out
batch, optimizer steps per second, and the comparison with the local run.

The processes: 1 server + ``--trainers`` trainers spawned on this machine
(TensorPipe on loopback), or, under ``torchrun``, rank 0 is the server and
every other rank a trainer (:mod:`funcopt.distributed.launch`).  Failures end
in bounded time with one line: an error in a process (on a trainer, or raised
on the server and relayed to a trainer) stops every process and the server
prints ``rpc parameter server: FAILED: <process>: <error>`` (exit 1).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import nn

from ..distributed import DistributedOptimizer
from ..distributed.launch import launch, one_line, under_torchrun
from ._common import lr_problem

IN, H1, H2 = 64, 256, 128  # the MLP: 64 -> 256 -> 128 -> 1
PS = "ps"


def trainer_name(rank: int) -> str:
    return f"trainer{rank}"


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, H1), nn.ReLU(), nn.Linear(H1, H2), nn.ReLU(), nn.Linear(H2, 1))


def batch(seed: int, index: int, size: int):
    """Batch ``index`` of a synthetic regression task (a fixed random teacher)."""
    teacher = torch.randn(IN, 1, generator=torch.Generator().manual_seed(seed)) / IN**0.5
    g = torch.Generator().manual_seed(seed * 1_000_003 + index + 1)
    x = torch.randn(size, IN, generator=g)
    y = torch.tanh(x @ teacher) + 0.1 * x[:, :1] ** 2
    return x, y


HELD_OUT = -1  # index of the batch the final loss is measured on


# ================================================================= server side
class ParameterServer:
    """What lives in process ``ps``: the model, and a counter of applied steps."""

    def __init__(self, seed: int) -> None:
        self.model = make_model(seed)
        self.done = 0                     # optimizer steps finished, all trainers
        self.built = 0                    # trainers whose optimizer exists
        self.cond = threading.Condition()
        self.seconds: Dict[str, float] = {}  # trainer -> seconds it spent training
        self.failure: Optional[str] = None   # the first error any process reported: everyone stops


_SERVER: List[ParameterServer] = []
_SERVER_LOCK = threading.Lock()


def server(seed: int = 0) -> ParameterServer:
    with _SERVER_LOCK:  # the first trainer to ask creates it
        if not _SERVER:
            _SERVER.append(ParameterServer(seed))
        return _SERVER[0]


# The functions below run on ``ps``, called by the trainers through RPC.
def param_rrefs(seed: int) -> List[rpc.RRef]:
    """RRefs to the model's parameters (owned by ``ps``)."""
    return [rpc.RRef(p) for p in server(seed).model.parameters()]


def forward(x: torch.Tensor) -> torch.Tensor:
    return server().model(x)


def wait_turn(g: int, timeout: float) -> str:
    """Round-robin: block (at most ``timeout`` s) until step ``g - 1`` is done.
    Returns "go", "wait" (not yet) or "abort" (a process failed: stop)."""
    s = server()
    with s.cond:
        s.cond.wait_for(lambda: s.failure is not None or s.done == g, timeout)
        return _status(s, s.done == g)


def wait_built(n: int, timeout: float) -> str:
    """Block (at most ``timeout`` s) until ``n`` trainers have built their optimizer;
    "go", "wait" or "abort"."""
    s = server()
    with s.cond:
        s.cond.wait_for(lambda: s.failure is not None or s.built >= n, timeout)
        return _status(s, s.built >= n)


def _status(s: ParameterServer, ready: bool) -> str:
    return "abort" if s.failure is not None else "go" if ready else "wait"


def optimizer_built() -> None:
    s = server()
    with s.cond:
        s.built += 1
        s.cond.notify_all()


def step_done() -> str:
    """Count a finished step; "abort" when a process failed meanwhile, else "go"."""
    s = server()
    with s.cond:
        s.done += 1
        s.cond.notify_all()
        return _status(s, True)


def trainer_finished(name: str, seconds: float) -> None:
    s = server()
    with s.cond:
        s.seconds[name] = seconds
        s.cond.notify_all()


def report_failure(name: str, message: str) -> None:
    """A process failed: record the first failure and wake everyone (they stop)."""
    s = server()
    with s.cond:
        if s.failure is None:
            s.failure = f"{name}: {message}"
        s.cond.notify_all()


class Aborted(Exception):
    """Another process failed; this one stops (the server reports why)."""


# ================================================================ trainer side
def train(rank: int, n_trainers: int, args: argparse.Namespace) -> int:
    """Trainer ``rank`` (1..N) does global steps rank-1, rank-1+N, ... of ``args.steps``.

    Any error (here, or raised on ``ps`` and relayed by RPC) is reported to the
    server, which stops everyone and prints it; returns 0 once reported."""
    try:
        _train(rank, n_trainers, args)
        return 0
    except Aborted:
        return 0  # someone else failed; the server says who
    except Exception as e:
        try:
            rpc.rpc_sync(PS, report_failure, args=(trainer_name(rank), one_line(e)), timeout=10)
            return 0
        except Exception:
            print(f"rpc parameter server: {trainer_name(rank)} failed: {one_line(e)}", file=sys.stderr)
            return 1


def _go(status: str) -> bool:
    if status == "abort":
        raise Aborted()
    return status == "go"


def _train(rank: int, n_trainers: int, args: argparse.Namespace) -> None:
    params = rpc.rpc_sync(PS, param_rrefs, args=(args.seed,))
    # The trainers build their optimizers one after the other: on a worker that
    # has not compiled funcopt's TorchScript optimizer yet, concurrent first
    # compilations fail (a known funcopt bug, being fixed).
    while not _go(rpc.rpc_sync(PS, wait_built, args=(rank - 1, 5.0))):
        pass
    opt = DistributedOptimizer(torch.optim.Adam, params, lr=args.lr)
    rpc.rpc_sync(PS, optimizer_built)
    while not _go(rpc.rpc_sync(PS, wait_built, args=(n_trainers, 5.0))):
        pass  # start together: the steps/s then measure the trainers side by side
    t0 = time.perf_counter()
    for g in range(rank - 1, args.steps, n_trainers):
        if args.schedule == "round-robin":
            while not _go(rpc.rpc_sync(PS, wait_turn, args=(g, 5.0))):
                pass  # still someone else's turn
        x, y = batch(args.seed, g, args.batch_size)
        with dist_autograd.context() as ctx:
            loss = F.mse_loss(rpc.rpc_sync(PS, forward, args=(x,)), y)
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
        _go(rpc.rpc_sync(PS, step_done))
    rpc.rpc_sync(PS, trainer_finished, args=(trainer_name(rank), time.perf_counter() - t0))


# ===================================================== server: progress, summary
def serve(n_trainers: int, args: argparse.Namespace, launcher: str) -> int:
    """Process ``ps``: show progress while the trainers work, then the summary."""
    from tqdm import tqdm

    s = server(args.seed)
    n_params = sum(p.numel() for p in s.model.parameters())
    print(f"rpc parameter server: MLP {IN}-{H1}-{H2}-1 ({n_params:,} parameters) on '{PS}', "
          f"{n_trainers} trainer(s) ({launcher}), {args.steps} steps ({args.schedule}), batch {args.batch_size}, "
          f"funcopt DistributedOptimizer(torch.optim.Adam, lr={args.lr:g}), seed {args.seed}", flush=True)
    bar = tqdm(total=args.steps, desc="training", unit="step", file=sys.stderr, disable=args.no_progress)
    t0 = time.perf_counter()
    deadline = t0 + args.timeout
    with s.cond:
        while len(s.seconds) < n_trainers:
            failure = s.failure
            if failure is None and time.perf_counter() > deadline:
                failure = f"the trainers did not finish in {args.timeout:g} s ({s.done}/{args.steps} steps)"
                s.failure = failure  # the trainers stop
                s.cond.notify_all()
            if failure is not None:
                bar.close()
                print(f"rpc parameter server: FAILED: {failure}", file=sys.stderr)
                return 1
            s.cond.wait(0.1)
            if s.done > bar.n:
                bar.update(s.done - bar.n)
    bar.update(s.done - bar.n)
    bar.close()

    x, y = batch(args.seed, HELD_OUT, 1024)
    with torch.no_grad():
        final = F.mse_loss(s.model(x), y).item()
    train_s = max(s.seconds.values())
    print(f"final loss (held-out batch): {final:.6g}")
    print(f"steps/s: {args.steps / train_s:.1f} (all trainers, {args.steps} steps in {train_s:.2f} s; "
          + ", ".join(f"{n} {len(range(int(n[7:]) - 1, args.steps, n_trainers)) / t:.1f}"
                      for n, t in sorted(s.seconds.items())) + ")")
    if args.schedule != "round-robin":
        print("equal to a local run: not checked (asynchronous trainers: the order of the steps is not "
              "reproducible; --schedule round-robin checks it)")
        return 0
    # The same batches, in the same order, locally: one torch.optim.Adam(fused=True)
    # per trainer over the same parameters, as on the server.
    ref = make_model(args.seed)
    ref_opts = [torch.optim.Adam(ref.parameters(), lr=args.lr, fused=True) for _ in range(n_trainers)]
    for g in range(args.steps):
        xb, yb = batch(args.seed, g, args.batch_size)
        ref.zero_grad(set_to_none=True)
        F.mse_loss(ref(xb), yb).backward()
        ref_opts[g % n_trainers].step()
    with torch.no_grad():
        ref_final = F.mse_loss(ref(x), y).item()
    equal = all(torch.equal(a, b) for a, b in zip(s.model.parameters(), ref.parameters()))
    print(f"local run ({n_trainers} x torch.optim.Adam(fused=True), same batches, same order): "
          f"final loss {ref_final:.6g}")
    print(f"equal to a local run: {'yes' if equal else 'NO'} (parameters bitwise "
          f"{'equal' if equal else 'different'})")
    return 0 if equal else 1


# ==================================================================== processes
def _rpc_name(rank: int) -> str:
    return PS if rank == 0 else trainer_name(rank)


def _rank(rank: int, world: int, args: argparse.Namespace, launcher: str) -> int:
    """One process (its RPC agent is up): rank 0 is the parameter server, ranks 1.. are trainers."""
    if rank != 0:
        return train(rank, world - 1, args)
    try:
        return serve(world - 1, args, launcher)
    except BaseException as e:  # the trainers must stop too, or the shutdown waits for them
        report_failure(PS, one_line(e))
        raise


def run(args: argparse.Namespace) -> int:
    """Spawn 1 server + ``args.trainers`` trainers (or join torchrun's processes); the exit code.

    Bounded: a process that fails gets the others stopped after a short grace,
    and the whole run is stopped ``args.timeout`` + 60 s after it started."""
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world < 2:
            print("rpc parameter server: needs at least 2 processes (1 server + trainers)", file=sys.stderr)
            return 2
        launcher = "torchrun"
    else:
        world, launcher = args.trainers + 1, "spawned on this machine"
    res = launch(_rank, world, args, launcher, backend="rpc", rpc_name=_rpc_name, timeout=args.rpc_timeout,
                 deadline=args.timeout + 60, grace=10.0, threads=args.threads)
    if 0 in res.returns and res.returns[0]:
        return int(res.returns[0])  # the server printed why
    if not res.ok:
        print(f"rpc parameter server: FAILED: {res.error_line()}", file=sys.stderr)
        return 1
    return int(next(iter(res.returns.values()), 0))


def add_arguments(p: argparse.ArgumentParser, demo: bool = False) -> None:
    """The options of the script (``demo=False``) or the ``--rpc``-only ones of ``funcopt demo``."""
    if demo:
        p.add_argument("--rpc", action="store_true",
                       help="train with funcopt's RPC DistributedOptimizer: 1 parameter server + --trainers "
                            "trainer processes, checked against a local run")
        p.add_argument("--trainers", type=int, default=None,
                       help="with --rpc: trainer processes to spawn (default: 2); under torchrun every rank "
                            "but 0 is a trainer")
        return
    p.add_argument("--trainers", type=int, default=2, help="trainer processes to spawn (default: 2)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all, over all trainers (default: 200)")
    p.add_argument("--schedule", choices=("async", "round-robin"), default="async",
                   help="async: trainers step when ready; round-robin: in turns, checked against a local run")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process (default: 1)")
    p.add_argument("--rpc-timeout", type=float, default=60.0, help="seconds (default: 60)")
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds (default: 600)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def check(args: argparse.Namespace) -> Optional[str]:
    """The first bad option, as one line (None when all are fine); nothing is spawned."""
    for name in ("trainers", "steps", "batch_size", "threads"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    for name in ("rpc_timeout", "timeout"):
        if not getattr(args, name) > 0:
            return f"--{name.replace('_', '-')} must be positive, got {getattr(args, name):g}"
    problem = lr_problem(args.lr)
    return f"--lr {args.lr:g}: {problem}" if problem else None


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The script's options; a bad one is one line on stderr and exit code 2."""
    p = argparse.ArgumentParser(prog="rpc_parameter_server", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    problem = check(args)
    if problem:
        print(f"rpc parameter server: {problem}", file=sys.stderr)
        raise SystemExit(2)
    return args


def main(argv: Optional[Sequence[str]] = None, args: Optional[argparse.Namespace] = None) -> int:
    """``examples/rpc_parameter_server.py``: parse the options (or take ``args``), run; the exit code."""
    return run(args if args is not None else parse_args(argv))
