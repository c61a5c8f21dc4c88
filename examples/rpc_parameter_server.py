"""Parameter-server training with funcopt's RPC DistributedOptimizer.

One process, the *parameter server* ``ps`` (rank 0), owns a small MLP.  N
*trainer* processes train it together over ``torch.distributed.rpc``:

1. forward: a trainer sends its batch to ``ps``, which runs the model on its
   own parameters and returns the output;
2. loss and backward on the trainer, through ``torch.distributed.autograd``:
   the gradients land on ``ps``, inside the trainer's autograd context;
3. ``opt.step(context_id)``: ``funcopt.distributed.DistributedOptimizer``
   asks ``ps`` to apply them.  On ``ps`` the gradient lookup and the fused
   Adam kernel run as one TorchScript call, without the GIL; a per-worker lock
   makes the trainers' steps apply one at a time, whole.

As with ``torch.distributed.optim.DistributedOptimizer``, every trainer's
optimizer is its own: the parameters are shared, but each trainer's Adam
moments and step count live on ``ps`` separately (N trainers, N Adam states).

The trainers pass ``torch.optim.Adam`` itself: the funcopt optimizer is a
drop-in for ``torch.distributed.optim.DistributedOptimizer``.

Two schedules:

* ``--schedule async`` (the default): trainers step whenever they are ready,
  as a parameter server usually runs.  The order of the steps is whatever
  order they arrive in, so the result is not reproducible bit for bit.
* ``--schedule round-robin``: the trainers take turns (global step g belongs
  to trainer ``g % N``, and waits for step g-1).  The run is then
  deterministic, and ``ps`` checks it against a local run over the same
  batches in the same order, with one ``torch.optim.Adam(fused=True)`` per
  trainer: the parameters must be bitwise equal (the same fused kernel runs on
  both sides).

``ps`` shows a progress bar and prints the summary: final loss on a held-out
batch, optimizer steps per second, and the comparison with the local run.

Run on one machine (spawns 1 server + N trainers, TensorPipe on loopback)::

    python examples/rpc_parameter_server.py --trainers 2 --steps 200
    python examples/rpc_parameter_server.py --trainers 2 --steps 200 --schedule round-robin

Run across machines with ``torchrun``: rank 0 is the parameter server, every
other rank a trainer (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` come from torchrun; ``--trainers`` is then ignored).  On each
of two machines, with ``HOST0`` the first one's address::

    TP_SOCKET_IFNAME=eth0 torchrun --nnodes 2 --nproc-per-node 2 --node-rank <0|1> \\
        --master-addr HOST0 --master-port 29500 examples/rpc_parameter_server.py --steps 400

(``TP_SOCKET_IFNAME`` names the network interface TensorPipe should use when
the default one is not reachable from the other machine.)  On one machine:
``torchrun --nproc-per-node 3 examples/rpc_parameter_server.py``.

``funcopt demo --rpc`` runs this script briefly (round-robin, checked).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from funcopt.distributed import DistributedOptimizer

IN, H1, H2 = 64, 256, 128  # the MLP: 64 -> 256 -> 128 -> 1
PS = "ps"
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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


def wait_turn(g: int, timeout: float) -> bool:
    """Round-robin: block (at most ``timeout`` s) until step ``g - 1`` is done."""
    s = server()
    with s.cond:
        return s.cond.wait_for(lambda: s.done == g, timeout)


def wait_built(n: int, timeout: float) -> bool:
    """Block (at most ``timeout`` s) until ``n`` trainers have built their optimizer."""
    s = server()
    with s.cond:
        return s.cond.wait_for(lambda: s.built >= n, timeout)


def optimizer_built() -> None:
    s = server()
    with s.cond:
        s.built += 1
        s.cond.notify_all()


def step_done() -> None:
    s = server()
    with s.cond:
        s.done += 1
        s.cond.notify_all()


def trainer_finished(name: str, seconds: float) -> None:
    s = server()
    with s.cond:
        s.seconds[name] = seconds
        s.cond.notify_all()


# ================================================================ trainer side
def train(rank: int, n_trainers: int, args: argparse.Namespace) -> None:
    """Trainer ``rank`` (1..N) does global steps rank-1, rank-1+N, ... of ``args.steps``."""
    params = rpc.rpc_sync(PS, param_rrefs, args=(args.seed,))
    # The trainers build their optimizers one after the other: on a worker that
    # has not compiled funcopt's TorchScript optimizer yet, concurrent first
    # compilations fail (a known funcopt bug, being fixed).
    while not rpc.rpc_sync(PS, wait_built, args=(rank - 1, 5.0)):
        pass
    opt = DistributedOptimizer(torch.optim.Adam, params, lr=args.lr)
    rpc.rpc_sync(PS, optimizer_built)
    while not rpc.rpc_sync(PS, wait_built, args=(n_trainers, 5.0)):
        pass  # start together: the steps/s then measure the trainers side by side
    t0 = time.perf_counter()
    for g in range(rank - 1, args.steps, n_trainers):
        if args.schedule == "round-robin":
            while not rpc.rpc_sync(PS, wait_turn, args=(g, 5.0)):
                pass  # still someone else's turn
        x, y = batch(args.seed, g, args.batch_size)
        with dist_autograd.context() as ctx:
            loss = F.mse_loss(rpc.rpc_sync(PS, forward, args=(x,)), y)
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
        rpc.rpc_sync(PS, step_done)
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
            if time.perf_counter() > deadline:
                bar.close()
                print(f"rpc parameter server: FAILED: the trainers did not finish in {args.timeout:g} s "
                      f"({s.done}/{args.steps} steps)", file=sys.stderr)
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
def run(rank: int, world: int, init_method: str, args: argparse.Namespace, launcher: str) -> int:
    """One process: rank 0 is the parameter server, ranks 1.. are trainers."""
    torch.set_num_threads(args.threads)
    name = PS if rank == 0 else trainer_name(rank)
    options = rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=args.rpc_timeout)
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)
    code = 0
    try:
        if rank == 0:
            code = serve(world - 1, args, launcher)
        else:
            train(rank, world - 1, args)
    finally:
        rpc.shutdown()  # waits for every process: the server outlives its trainers' calls
    return code


def _entry(rank: int, world: int, init_method: str, args: argparse.Namespace) -> None:
    sys.exit(run(rank, world, init_method, args, "spawned on this machine"))


def spawn(args: argparse.Namespace) -> int:
    """1 server + ``args.trainers`` trainers as local processes; the server's exit code."""
    world = args.trainers + 1
    with tempfile.TemporaryDirectory(prefix="funcopt_rpc_") as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_entry, args=(r, world, init, args), name=f"rpc-rank{r}") for r in range(world)]
        for p in procs:
            p.start()
        try:
            failed: Optional[mp.Process] = None
            while any(p.is_alive() for p in procs) and failed is None:
                for p in procs:
                    p.join(0.1)
                    if p.exitcode not in (None, 0):
                        failed = p
                        break
            if failed is not None:  # the others would wait for it until the RPC timeout
                time.sleep(1.0)
                for p in procs:
                    if p.is_alive():
                        p.terminate()
                print(f"rpc parameter server: process {failed.name} exited with code {failed.exitcode}",
                      file=sys.stderr)
                return failed.exitcode if failed.exitcode and failed.exitcode > 0 else 1
            return procs[0].exitcode or 0
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
    args = p.parse_args(argv)
    for name in ("trainers", "steps", "batch_size", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: Optional[Sequence[str]] = None, args: Optional[argparse.Namespace] = None) -> int:
    args = args if args is not None else parse_args(argv)
    if all(k in os.environ for k in TORCHRUN_ENV):  # launched by torchrun: one process of many
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world < 2:
            print("rpc parameter server: needs at least 2 processes (1 server + trainers)", file=sys.stderr)
            return 2
        return run(rank, world, "env://", args, "torchrun")
    return spawn(args)


if __name__ == "__main__":
    raise SystemExit(main())
