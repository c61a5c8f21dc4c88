"""Reusable ranks for the distributed tests: a world of W processes started once, sent jobs.

Starting W spawned processes, importing torch and funcopt in each, forming a
gloo group and compiling the same TorchScript kernels again cost seconds per
spawn; most distributed test modules spawn once per world size.  A
:class:`Pool` starts its W ranks once (per test session, per world size), each
joins one gloo group (``file://`` rendezvous, :data:`_dist_harness.COLLECTIVE_TIMEOUT`
on every collective, one intra-op thread) and then runs jobs:
``fn(rank, world, workdir, *args)``, exactly what a fresh spawn would run.

Bounds and isolation:

* every job has a deadline; a job that raises on any rank, or does not finish
  on every rank within its deadline, is reported with each rank's traceback
  (``error-rank<r>.txt`` in the job's work directory, as a spawn writes it)
  and the pool is torn down (killed, by handle): the next job gets a fresh
  world, so a hung or half-finished collective never reaches another test;
* before a job the ranks agree on its number with one all-gather (a rank left
  out of step fails at once instead of pairing with the wrong collective);
* a rank that dies (segfault, ``os._exit``) ends the job at once.

Not for jobs that must own their processes: faults that kill a rank or tear
the group down (``tests/distributed/test_checkpoint_atomic.py``), RPC agent
lifecycles (``test_rpc*.py``), ``torchrun``, fresh interpreters.  Those call
:func:`_dist_harness.spawn` with ``own=True`` (or ``launch`` directly).

``FUNCOPT_TEST_POOL=0`` makes every :func:`_dist_harness.spawn` a fresh spawn
again (to rule the pool out when a test fails).
"""
from __future__ import annotations

import atexit
import datetime
import os
import shutil
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

_POOLS: Dict[int, "Pool"] = {}


def enabled() -> bool:
    return os.environ.get("FUNCOPT_TEST_POOL", "1") != "0"


# ------------------------------------------------------------------ one rank
def _rank_main(rank: int, world: int, rendezvous: str, timeout: float, conn: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        conn.send(("ready", None))
        while True:
            msg = conn.recv()
            if msg is None:
                break
            job_id, fn, workdir, args = msg
            t0 = time.monotonic()
            try:
                ids = [None] * world
                dist.all_gather_object(ids, job_id)
                if any(i != job_id for i in ids):
                    raise RuntimeError(f"pool ranks out of step: job ids {ids}")
                torch.manual_seed(67280421310721)  # a fresh process's default seed
                fn(rank, world, workdir, *args)
                status = "ok"
            except BaseException as e:  # noqa: BLE001 -- reported to the parent, the pool is then rebuilt
                Path(workdir, f"error-rank{rank}.txt").write_text(traceback.format_exc())
                Path(workdir, f"error-rank{rank}.line").write_text(f"{type(e).__name__}: {e}"[:1000])
                status = "error"
            conn.send((status, time.monotonic() - t0))
            if status != "ok":
                break  # the group may be out of step: this world is done
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


# -------------------------------------------------------------------- pool
class Pool:
    """W ranks in one gloo group, waiting for jobs."""

    def __init__(self, world: int, timeout: float, start_deadline: float = 120.0) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.world = world
        self.dir = tempfile.mkdtemp(prefix=f"funcopt_pool_w{world}_")
        self.jobs = 0
        self.conns: List[Any] = []
        self.procs: List[Any] = []
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(r, world, os.path.join(self.dir, "rendezvous"), timeout, child),
                            name=f"funcopt-pool-w{world}-rank{r}")
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        replies, why = self._collect(time.monotonic() + start_deadline)
        if why is not None or any(s != "ready" for s, _ in replies.values()):
            self.close()
            raise RuntimeError(f"pool of {world} ranks did not start: {why or replies}")

    def _collect(self, kill_at: float) -> Tuple[Dict[int, Tuple[str, Any]], Optional[str]]:
        """Each rank's reply; stops at the deadline or when a rank died without replying."""
        replies: Dict[int, Tuple[str, Any]] = {}
        while len(replies) < self.world:
            now = time.monotonic()
            if now >= kill_at:
                return replies, "deadline"
            waiting = {self.conns[r]: r for r in range(self.world) if r not in replies}
            sentinels = {self.procs[r].sentinel: r for r in waiting.values()}
            ready = wait(list(waiting) + list(sentinels), timeout=min(1.0, kill_at - now))
            for obj in ready:
                if obj in waiting:
                    r = waiting[obj]
                    try:
                        replies[r] = obj.recv()
                    except (EOFError, OSError):
                        return replies, f"rank {r} died (exit code {self.procs[r].exitcode})"
            for obj in ready:
                if obj in sentinels and sentinels[obj] not in replies:
                    r = sentinels[obj]
                    if self.conns[r].poll():
                        continue  # its reply is there: read on the next pass
                    return replies, f"rank {r} died (exit code {self.procs[r].exitcode})"
        return replies, None

    def run(self, fn: Callable, workdir: Path, args: tuple, deadline: float) -> Tuple[bool, Dict[int, str], str, float]:
        """Run ``fn(rank, world, workdir, *args)`` on every rank.

        Returns (ok, {rank: traceback}, why, seconds); on failure the pool is closed."""
        t0 = time.monotonic()
        self.jobs += 1
        for c in self.conns:
            c.send((self.jobs, fn, str(workdir), args))
        replies, why = self._collect(t0 + deadline)
        ok = why is None and all(s == "ok" for s, _ in replies.values())
        errors: Dict[int, str] = {}
        for r in range(self.world):
            f = Path(workdir, f"error-rank{r}.txt")
            if f.exists():
                errors[r] = f.read_text()
        if not ok:
            if why is None:
                why = "a rank raised"
            self.close()
        return ok, errors, why or "", time.monotonic() - t0

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def close(self, grace: float = 5.0) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except (OSError, ValueError):
                pass
        end = time.monotonic() + grace
        for p in self.procs:
            p.join(max(0.0, end - time.monotonic()))
        for p in self.procs:  # only our own children, by handle
            if p.is_alive():
                p.kill()
                p.join(10)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []
        shutil.rmtree(self.dir, ignore_errors=True)


def get(world: int, timeout: float) -> Pool:
    """The session's pool of ``world`` ranks (started, or restarted after a failed job)."""
    pool = _POOLS.get(world)
    if pool is None or not pool.alive:
        if pool is not None:
            pool.close()
        pool = _POOLS[world] = Pool(world, timeout)
    return pool


def close_all() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()


atexit.register(close_all)
