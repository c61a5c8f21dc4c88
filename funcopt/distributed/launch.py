"""Run one function on every rank: local spawned processes, or the processes torchrun started.

:func:`launch` is the one multi-process launcher of funcopt's command line
(``funcopt demo --zero``, ``funcopt demo --rpc``, ``funcopt bench``), its
example and benchmark scripts and its distributed tests:

* locally, it starts ``world_size`` processes with the *spawn* start method;
  each one joins a process group (gloo, or ``backend="rpc"``: a TensorPipe RPC
  agent) through a ``file://`` rendezvous in a fresh temporary directory, with
  ``timeout`` on every collective (or RPC), runs ``fn(rank, world_size,
  *args)`` and leaves the group in ``finally`` (``destroy_process_group`` /
  ``rpc.shutdown``);
* a rank that raises writes its traceback (``error-rank<r>.txt`` in the work
  directory) and a one-line ``Type: message``; the parent collects both;
* the whole run is bounded: after ``deadline`` seconds, or ``grace`` seconds
  after the first rank failed, the parent kills the processes it started (by
  handle, nothing else), so a dead rank never hangs the caller;
* under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
  ``MASTER_PORT`` set), nothing is spawned: this process is one rank, joins on
  ``env://`` and runs ``fn`` in-process, on one machine or many.

CUDA + NCCL is untested (no GPU on the machines funcopt is tested on):
``backend`` is passed to ``torch.distributed.init_process_group`` unchanged.

Example (a file run as a script; spawned children re-import it, so the
launch sits under ``if __name__ == "__main__"``)::

    import torch
    import torch.distributed as dist
    from funcopt.distributed.launch import launch

    def total(rank, world_size, base):
        t = torch.tensor([float(base + rank)])
        dist.all_reduce(t)          # bounded by launch's timeout
        return t.item()             # the parent gets every rank's return value

    if __name__ == "__main__":
        result = launch(total, 2, 10, timeout=30, deadline=120)
        result.check()              # raises with each failed rank's one-line error
        print(result.returns)       # {0: 21.0, 1: 21.0}
"""
from __future__ import annotations

import datetime
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

__all__ = ["LaunchError", "LaunchResult", "TORCHRUN_ENV", "init_method", "launch", "one_line", "under_torchrun"]

#: The variables torchrun sets; all four present means "launched by torchrun".
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_INIT_METHOD: List[str] = []  # this process's rendezvous, while fn runs


class LaunchError(RuntimeError):
    """A launched run failed: a rank raised or exited nonzero, or the deadline passed."""


def under_torchrun() -> bool:
    """True when ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are all set."""
    return all(k in os.environ for k in TORCHRUN_ENV)


def init_method() -> str:
    """The rendezvous of the rank running now (``file://...`` or ``env://``).

    Call it inside ``fn`` (with ``backend=None``, ``fn`` sets up its own group
    or RPC agent with it).  Outside a launched ``fn``: ``RuntimeError``."""
    if not _INIT_METHOD:
        raise RuntimeError("funcopt.distributed.launch.init_method() is only defined inside a launched function")
    return _INIT_METHOD[-1]


def one_line(e: BaseException) -> str:
    """``Type: message`` on one line.  An error relayed by RPC (``On WorkerInfo(...)``
    and the remote traceback) is reduced to the remote traceback's last line."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    if lines and lines[0].startswith("On WorkerInfo") and any(ln.startswith("Traceback") for ln in lines):
        return lines[-1]
    text = f"{type(e).__name__}: {' '.join(lines)}" if lines else type(e).__name__
    return text[:1000]


@dataclass
class LaunchResult:
    """What :func:`launch` saw of every rank.

    ``returns``: rank -> ``fn``'s return value (ranks that returned);
    ``errors``: rank -> traceback text; ``messages``: rank -> one-line error;
    ``exitcodes``: rank -> process exit code (``None``: killed or still running
    at the end, never for a finished run); ``killed``: ranks this launcher
    killed; ``timed_out``: the deadline passed; ``torchrun``: run in-process
    under torchrun (the dicts then hold this rank only)."""

    world_size: int
    exitcodes: Dict[int, Optional[int]] = field(default_factory=dict)
    returns: Dict[int, Any] = field(default_factory=dict)
    errors: Dict[int, str] = field(default_factory=dict)
    messages: Dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0
    killed: List[int] = field(default_factory=list)
    timed_out: bool = False
    torchrun: bool = False
    workdir: Optional[str] = None
    deadline: Optional[float] = None

    @property
    def ok(self) -> bool:
        """No error, nothing killed, every exit code 0."""
        return (not self.errors and not self.killed and not self.timed_out
                and all(c == 0 for c in self.exitcodes.values()))

    def error_line(self) -> str:
        """One line naming the first failure ('' when :attr:`ok`)."""
        if self.ok:
            return ""
        for r in sorted(self.messages):
            return f"rank {r}: {self.messages[r]}"
        if self.timed_out:
            return f"the ranks did not finish within the {self.deadline:g} s deadline (killed: ranks {self.killed})"
        for r, c in sorted(self.exitcodes.items()):
            if c != 0:
                return f"rank {r} exited with code {c}" if c is not None else f"rank {r} was killed"
        return f"ranks {self.killed} were killed"

    def check(self) -> "LaunchResult":
        """Raise :class:`LaunchError` with :meth:`error_line` unless :attr:`ok`; returns ``self``."""
        if not self.ok:
            raise LaunchError(self.error_line())
        return self


# ------------------------------------------------------------------ one rank
def _setup(backend: Optional[str], rank: int, world: int, init: str, timeout: float,
           rpc_name: Callable[[int], str]) -> None:
    import torch.distributed as dist

    if backend is None:
        return
    if backend == "rpc":
        import warnings

        import torch.distributed.rpc as rpc

        # torch warns about its own internal use of a gloo group when RPC starts
        warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup",
                                category=UserWarning)
        opts = rpc.TensorPipeRpcBackendOptions(init_method=init, rpc_timeout=timeout)
        rpc.init_rpc(rpc_name(rank), rank=rank, world_size=world, rpc_backend_options=opts)
        return
    if init == "env://" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent keeps one store across restarts: keys the ranks of an earlier attempt
        # left there (their gloo addresses) would be read as this attempt's, and the new ranks
        # would connect to dead peers (seen: connection refused, or a hang).  One namespace per attempt.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"funcopt/attempt_{attempt}", store), rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout))
        return
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))


def _teardown(backend: Optional[str]) -> None:
    import torch.distributed as dist

    if backend == "rpc":
        import torch.distributed.rpc as rpc

        rpc.shutdown()
    elif backend is not None and dist.is_initialized():
        dist.destroy_process_group()


def _settle(backend: Optional[str]) -> None:
    """After ``fn`` returned on this rank: one barrier before the group is destroyed.

    A gloo worker thread may still be releasing the tensors of the last collective (e.g.
    ``broadcast_object_list``'s) when the interpreter shuts down; releasing them needs the
    GIL, which then ends that thread, and the process aborts ("terminate called without an
    active exception", SIGABRT) after ``fn`` succeeded -- about one run in 40 of the demo.
    While this rank waits in the barrier (GIL released) that thread finishes.  Only on the
    success path: after a failure a peer may be gone, and the barrier would wait for it.
    """
    import torch.distributed as dist

    if backend not in (None, "rpc") and dist.is_initialized():
        dist.barrier()


def _run_rank(fn: Callable, rank: int, world: int, args: tuple, backend: Optional[str], init: str,
              timeout: float, rpc_name: Callable[[int], str], threads: Optional[int]) -> Any:
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    _INIT_METHOD.append(init)
    try:
        _setup(backend, rank, world, init, timeout, rpc_name)
        try:
            value = fn(rank, world, *args)
            _settle(backend)
            return value
        finally:
            _teardown(backend)
    finally:
        _INIT_METHOD.pop()


def _child(rank: int, world: int, workdir: str, fn: Callable, args: tuple, backend: Optional[str],
           timeout: float, rpc_name: Callable[[int], str], threads: Optional[int]) -> None:
    init = "file://" + os.path.join(workdir, "rendezvous")
    try:
        value = _run_rank(fn, rank, world, args, backend, init, timeout, rpc_name, threads)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        sys.exit(code)
    except BaseException as e:
        Path(workdir, f"error-rank{rank}.txt").write_text(traceback.format_exc())
        Path(workdir, f"error-rank{rank}.line").write_text(one_line(e))
        # the error is on disk; after a peer died, interpreter shutdown can hang in gloo's threads
        # (seen: a rank that had raised still running at the deadline), so leave at once
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    tmp = Path(workdir, f"return-rank{rank}.pkl.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(value, f)
    os.replace(tmp, Path(workdir, f"return-rank{rank}.pkl"))


def _default_name(rank: int) -> str:
    return f"worker{rank}"


# -------------------------------------------------------------------- launch
def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: Optional[str] = "gloo",
           timeout: float = 60.0, deadline: Optional[float] = 600.0, grace: Optional[float] = 5.0,
           workdir: Union[str, os.PathLike, None] = None, threads: Optional[int] = None,
           rpc_name: Optional[Callable[[int], str]] = None, torchrun: Optional[bool] = None) -> LaunchResult:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; call it once, in the parent.

    Behaviour: see the module docstring.  ``fn`` and ``args`` must be
    picklable (a module-level function); ``fn``'s return value travels back
    pickled.

    Args:
      fn: the function every rank runs, after joining the group.
      world_size: local processes to spawn (>= 1); under torchrun ignored
        (torchrun's ``WORLD_SIZE`` counts).
      *args: passed to ``fn`` after ``rank, world_size``.
      backend: ``"gloo"`` (default) or any ``torch.distributed`` backend;
        ``"rpc"``: a TensorPipe RPC agent instead (``rpc_name(rank)`` names each
        worker); ``None``: join nothing (``fn`` may use :func:`init_method`).
      timeout: seconds, for every collective (the process group's timeout) or
        every RPC (default 60).
      deadline: seconds for the whole run; then the ranks still running are
        killed (default 600; ``None``: no deadline).
      grace: seconds the others get after a rank failed before they are killed
        (default 5; ``None``: wait for them, up to the deadline).
      workdir: a directory for the rendezvous file, the error files and the
        return values (it must not hold a ``rendezvous`` file); default: a
        temporary directory, removed afterwards.
      threads: ``torch.set_num_threads`` in every rank (default: torch's).
      rpc_name: with ``backend="rpc"``, rank -> worker name (default
        ``worker<rank>``).
      torchrun: force (``True``) or forbid (``False``) the in-process torchrun
        path; default: :func:`under_torchrun`.

    Returns:
      A :class:`LaunchResult`; call ``.check()`` to raise on failure.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"launch: world_size must be an int >= 1, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"launch: timeout must be positive, got {timeout!r}")
    if deadline is not None and not deadline > 0:
        raise ValueError(f"launch: deadline must be positive or None, got {deadline!r}")
    name = rpc_name or _default_name
    if torchrun if torchrun is not None else under_torchrun():
        return _in_process(fn, args, backend, timeout, name, threads)
    own = workdir is None
    work = tempfile.mkdtemp(prefix="funcopt_launch_") if own else os.fspath(workdir)
    os.makedirs(work, exist_ok=True)
    if os.path.exists(os.path.join(work, "rendezvous")):
        raise ValueError(f"launch: {work} already holds a rendezvous file (one launch per work directory)")
    try:
        return _spawn(fn, world_size, args, backend, timeout, deadline, grace, work, threads, name)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def _in_process(fn: Callable, args: tuple, backend: Optional[str], timeout: float,
                name: Callable[[int], str], threads: Optional[int]) -> LaunchResult:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    res = LaunchResult(world, torchrun=True)
    t0 = time.monotonic()
    try:
        res.returns[rank] = _run_rank(fn, rank, world, args, backend, "env://", timeout, name, threads)
        res.exitcodes[rank] = 0
    except SystemExit as e:
        res.exitcodes[rank] = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:
        res.errors[rank] = traceback.format_exc()
        res.messages[rank] = one_line(e)
        res.exitcodes[rank] = 1
    res.seconds = time.monotonic() - t0
    return res


def _spawn(fn: Callable, world: int, args: tuple, backend: Optional[str], timeout: float,
           deadline: Optional[float], grace: Optional[float], work: str, threads: Optional[int],
           name: Callable[[int], str]) -> LaunchResult:
    import multiprocessing
    from multiprocessing.connection import wait

    ctx = multiprocessing.get_context("spawn")
    t0 = time.monotonic()
    res = LaunchResult(world, workdir=work, deadline=deadline)
    procs = [ctx.Process(target=_child, args=(r, world, work, fn, args, backend, timeout, name, threads),
                         name=f"funcopt-rank{r}") for r in range(world)]
    try:
        for p in procs:
            p.start()
        kill_at = None if deadline is None else t0 + deadline
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if kill_at is not None and now >= kill_at:
                res.timed_out = deadline is not None and now >= t0 + deadline
                break
            failed = any(p.exitcode not in (None, 0) for p in procs)
            if failed and grace is not None:
                first_fail = now + grace
                kill_at = first_fail if kill_at is None else min(kill_at, first_fail)
            pending = [p.sentinel for p in procs if p.is_alive()]
            wait(pending, timeout=0.2 if kill_at is None else max(0.0, min(0.2, kill_at - now)))
    finally:
        for r, p in enumerate(procs):  # only our own children, by handle
            if p.is_alive():
                res.killed.append(r)
                p.kill()
        for p in procs:
            p.join(10)
    res.seconds = time.monotonic() - t0
    for r, p in enumerate(procs):
        res.exitcodes[r] = None if r in res.killed else p.exitcode
        tb, line, ret = (Path(work, f"{n}-rank{r}{ext}") for n, ext in
                         (("error", ".txt"), ("error", ".line"), ("return", ".pkl")))
        if tb.exists():
            res.errors[r] = tb.read_text()
            res.messages[r] = line.read_text() if line.exists() else res.errors[r].strip().splitlines()[-1]
        if ret.exists():
            with open(ret, "rb") as f:
                res.returns[r] = pickle.load(f)
    return res
