"""What tests/distributed/test_checkpoint_atomic.py runs: saves that crash or fail part-way.

* :func:`killed_save` runs alone in a process of its own (a 1-rank group): it
  commits a save, then SIGKILLs itself while DCP writes a second one over it.
* :func:`worker` (2 ranks) loads that, then for each fault commits a save A,
  trains on, attempts a save B that crashes or fails, and loads what the
  directory holds at world size 2.  Saves at world size 1 run on the process
  group of rank 0 alone (rank 1 waits), so a crash on rank 0 leaves no peer
  inside a collective.
"""
from __future__ import annotations

import contextlib
import copy
import datetime
import os
import resource
import signal
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from funcopt.distributed import ZeroRedundancyOptimizer
from funcopt.distributed.checkpoint import COMMIT, TMP_PREFIX

import _dist_zero_work as Z
from _dist_harness import Net, run_cases

CASE = Z._case("fault", "Adam")
A_STEPS, B_STEPS = 3, 2


class Crash(BaseException):
    """Stands for the process dying here: nothing in save_sharded catches it."""


def _zero(params: Any, group: Any, lr_factor: float = 1.0) -> ZeroRedundancyOptimizer:
    hyper = dict(CASE["hyper"], lr=CASE["hyper"]["lr"] * lr_factor)
    return ZeroRedundancyOptimizer(params, torch.optim.Adam, process_group=group, **hyper)


def _consolidated(opt: ZeroRedundancyOptimizer) -> Optional[Dict[str, Any]]:
    opt.consolidate_state_dict(0)
    return copy.deepcopy(opt.state_dict()) if opt.rank == 0 else None


@contextlib.contextmanager
def patched(obj: Any, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    orig = getattr(obj, name)
    setattr(obj, name, make(orig))
    try:
        yield
    finally:
        setattr(obj, name, orig)


def after_dcp_wrote(then: Callable[[], None]) -> Any:
    """Patch DCP's writer: once this rank's data file is written, ``then()`` (before .metadata and the commit)."""
    def make(orig: Any) -> Any:
        def write_data(self: Any, plan: Any, planner: Any) -> Any:
            fut = orig(self, plan, planner)
            fut.wait()
            then()
            return fut
        return write_data
    return patched(FileSystemWriter, "write_data", make)


def _is_tmp_dir(path: Any) -> bool:
    """The save's temporary directory itself (not DCP's own .metadata rename inside it)."""
    return os.path.basename(str(path)).startswith(TMP_PREFIX)


# ------------------------------------------------------------ killed save
def killed_save(out_dir: str) -> None:
    """Alone, world size 1: commit save A, then die (SIGKILL) while save B is being written."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'rv-killed')}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=30))
    ck = os.path.join(out_dir, "ck-killed")
    model = Net()
    opt = _zero(model.parameters(), None)
    Z.train(CASE, model, opt, range(0, A_STEPS))
    opt.save_sharded(ck)
    torch.save(_consolidated(opt), os.path.join(out_dir, "killed-A.pt"))
    Z.train(CASE, model, opt, range(A_STEPS, A_STEPS + B_STEPS))
    with after_dcp_wrote(lambda: os.kill(os.getpid(), signal.SIGKILL)):
        opt.save_sharded(ck)
    raise AssertionError("not killed")  # pragma: no cover


# ----------------------------------------------------------------- worker
CRASHES = {  # point: (world size of the save, what must be committed afterwards)
    "during-dcp-write": (2, "A"),
    "before-rename": (1, "A"),
    "before-commit": (1, "A"),
    "after-commit": (1, "B"),
}
FAILURES = ["disk-full-on-rank-1", "exception-on-rank-1", "permission-on-rank-0", "path-is-a-file"]


class Worker:
    def __init__(self, rank: int, out_dir: str):
        self.rank, self.out = rank, out_dir
        self.groups = {2: dist.group.WORLD, 1: dist.new_group([0])}
        self.rank1_alone = dist.new_group([1])  # group rank 0 is global rank 1

    def path(self, name: str) -> str:
        return os.path.join(self.out, name)

    def listing(self, ck: str) -> List[str]:
        return sorted(os.listdir(ck)) if os.path.isdir(ck) else []

    def load_here(self, ck: str) -> Dict[str, Any]:
        """A fresh 2-rank optimizer (other lr) loads ``ck``; its consolidated state."""
        model = Net()
        opt = _zero(model.parameters(), None, lr_factor=3.0)
        res = Z._catch(lambda: opt.load_sharded(ck))
        res["sd"] = _consolidated(opt)
        return res

    def killed(self, case: Dict[str, Any]) -> Dict[str, Any]:
        ck = self.path("ck-killed")
        out: Dict[str, Any] = {"before": self.listing(ck)}
        dist.barrier()
        out["loaded"] = self.load_here(ck)
        model = Net()
        opt = _zero(model.parameters(), None)
        opt.save_sharded(ck)  # a later save clears what the killed one left
        out["after"] = self.listing(ck)
        dist.barrier()
        return out

    def _a_then_b(self, ck: str, world: int) -> tuple:
        """On ranks [0, world): commit save A, train on; the optimizer and both states."""
        model = Net()
        opt = _zero(model.parameters(), self.groups[world])
        Z.train(CASE, model, opt, range(0, A_STEPS), self.rank, world)
        opt.save_sharded(ck)
        sd_a = _consolidated(opt)
        Z.train(CASE, model, opt, range(A_STEPS, A_STEPS + B_STEPS), self.rank, world)
        return opt, sd_a, _consolidated(opt)

    def crash(self, case: Dict[str, Any]) -> Dict[str, Any]:
        point = case["point"]
        world, _ = CRASHES[point]
        ck = self.path(f"ck-crash-{point}")
        out: Dict[str, Any] = {}
        if self.rank < world:
            opt, out["A"], out["B"] = self._a_then_b(ck, world)

            def crash() -> None:
                raise Crash(point)

            if point == "during-dcp-write":
                fault = after_dcp_wrote(crash)
            elif point == "before-rename":
                fault = patched(os, "rename", lambda orig: lambda a, b: crash() if _is_tmp_dir(a) else orig(a, b))
            elif point == "before-commit":
                fault = patched(os, "replace", lambda orig: lambda a, b: crash() if str(b).endswith(COMMIT) else orig(a, b))
            else:
                fault = patched(os, "replace", lambda orig: lambda a, b: (orig(a, b), crash() if str(b).endswith(COMMIT) else None))
            try:
                with fault:
                    opt.save_sharded(ck)
                out["raised"] = None
            except BaseException as e:  # noqa: B036 -- Crash, or what DCP made of it
                out["raised"] = type(e).__name__
            out["files"] = self.listing(ck)
        dist.barrier()
        out["loaded"] = self.load_here(ck)
        return out

    def subgroup(self, case: Dict[str, Any]) -> Dict[str, Any]:
        """Saved by the group of global rank 1 alone (its rank 0, DCP's coordinator), loaded by both."""
        ck = self.path("ck-subgroup")
        out: Dict[str, Any] = {}
        if self.rank == 1:
            model = Net()
            opt = _zero(model.parameters(), self.rank1_alone)
            Z.train(CASE, model, opt, range(0, A_STEPS))
            opt.save_sharded(ck)
            out["A"] = _consolidated(opt)
            out["files"] = self.listing(ck)
        dist.barrier()
        out["loaded"] = self.load_here(ck)
        return out

    def failure(self, case: Dict[str, Any]) -> Dict[str, Any]:
        kind = case["kind_of"]
        ck = self.path(f"ck-{kind}")
        opt, sd_a, _ = self._a_then_b(ck, 2)
        out: Dict[str, Any] = {"A": sd_a}
        target = ck
        fault: Any = contextlib.nullcontext()
        if kind == "disk-full-on-rank-1" and self.rank == 1:
            fault = file_size_limit(1024)
        elif kind == "exception-on-rank-1" and self.rank == 1:
            fault = patched(opt, "shard_state", lambda orig: lambda: (_ for _ in ()).throw(RuntimeError("injected on rank 1")))
        elif kind == "permission-on-rank-0" and self.rank == 0:
            def make(orig: Any) -> Any:
                def rename(a: Any, b: Any) -> None:
                    if _is_tmp_dir(a):
                        raise PermissionError(13, "Permission denied", str(b))
                    orig(a, b)
                return rename
            fault = patched(os, "rename", make)
        elif kind == "path-is-a-file":
            target = os.path.join(ck, COMMIT)  # a file where the checkpoint directory should go
        dist.barrier()
        with fault:
            out["save"] = Z._catch(lambda: opt.save_sharded(target))
        out["files"] = self.listing(ck)
        dist.barrier()
        out["loaded"] = self.load_here(ck)
        return out


@contextlib.contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """This process may write no file beyond ``nbytes`` (writes fail with EFBIG): a full disk."""
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)


def cases() -> List[Dict[str, Any]]:
    return ([dict(name="killed", kind="killed"), dict(name="subgroup", kind="subgroup")]
            + [dict(name=f"crash-{p}", kind="crash", point=p) for p in CRASHES]
            + [dict(name=k, kind="failure", kind_of=k) for k in FAILURES])


def worker(rank: int, world: int, out_dir: str) -> None:
    assert world == 2
    w = Worker(rank, out_dir)
    run_cases(rank, out_dir, cases(), lambda c: getattr(w, c["kind"])(c))

