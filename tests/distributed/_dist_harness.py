"""Shared machinery of the distributed tests: spawning ranks, the model, the data.

Not a test module (pytest collects only ``test_*.py``).  The spawned children
import this module and the ``_dist_*_work`` modules by name; ``conftest.py``
puts this directory on ``sys.path`` and spawn hands ``sys.path`` to children.

Rules every multi-process test here follows:

* ``torch.multiprocessing`` with the *spawn* start method, gloo, a ``file://``
  rendezvous in the test's temporary directory;
* every collective is bounded by the process group's timeout
  (:data:`COLLECTIVE_TIMEOUT`), the whole spawn by :func:`spawn`'s deadline and
  every test by ``pytest.mark.timeout``;
* ``destroy_process_group`` in ``finally``;
* children return results with ``torch.save`` to a file (never a queue) and
  write their traceback to ``error-rank<r>.txt``, which the parent turns into a
  test failure;
* one intra-op thread per child.
"""
from __future__ import annotations

import datetime
import math
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from funcopt.distributed.launch import launch

import _oracles  # noqa: E402  (tests/: on sys.path in the test process and, by spawn, in its children)

_oracles.install()  # the oracles outside torch used as their docs say (tests/_oracles.py)

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=30)

# float32 tolerance for "same as single-process torch.optim": the all-reduce
# (DDP) / reduce-scatter (ZeRO-2) sum the per-rank gradients in another order
# than one full-batch backward does, so the last bits differ; 10-13 steps of
# Adam/SGD/Adagrad on O(1) values stay far inside this.
RTOL, ATOL = 1e-5, 1e-7
# funcopt's native one-pass rules (funcopt/optimizers/<name>.cpp) round sqrt
# correctly where torch's CPU sqrt (MKL) is off by an ulp now and then: against
# torch.optim they get the tolerance torch's own fused-vs-foreach tests use
# (torch.testing.assert_close's float32 defaults), still far below any real error.
NATIVE_RTOL, NATIVE_ATOL = 1.3e-6, 1e-5


def tol(algo: str, rtol: float = RTOL, atol: float = ATOL) -> Dict[str, float]:
    """``rtol``/``atol`` for comparing ``algo``'s funcopt run with torch.optim:
    the given ones, widened to torch's fused-vs-foreach tolerance where funcopt
    steps ``algo`` with its native rule in this environment."""
    from funcopt import native
    from funcopt.registry import REGISTRY

    spec = REGISTRY.get(algo)
    if spec is not None and spec.native_rule and native.available():
        return dict(rtol=max(rtol, NATIVE_RTOL), atol=max(atol, NATIVE_ATOL))
    return dict(rtol=rtol, atol=atol)


# ----------------------------------------------------------------- spawning
@dataclass
class SpawnResult:
    world: int
    out_dir: Path
    exitcodes: List[Optional[int]]
    errors: Dict[int, str]
    seconds: float
    killed: bool = False

    def report(self) -> str:
        lines = [f"spawn of {self.world} ranks in {self.out_dir} took {self.seconds:.1f}s; "
                 f"exit codes {self.exitcodes}{' (killed at the deadline)' if self.killed else ''}"]
        for r, text in sorted(self.errors.items()):
            lines.append(f"---- rank {r} traceback ----\n{text}")
        return "\n".join(lines)

    @property
    def ok(self) -> bool:
        return not self.errors and not self.killed and all(c == 0 for c in self.exitcodes)

    def check(self) -> None:
        assert self.ok, self.report()

    def load(self, rank: int, name: str = "result") -> Any:
        file = self.out_dir / f"{name}-rank{rank}.pt"
        assert file.exists(), f"rank {rank} wrote no {file.name}\n" + self.report()
        return torch.load(file, weights_only=False)


def spawn(fn: Callable, world: int, workdir: Path, *args: Any, deadline: float = 150.0,
          own: bool = False) -> SpawnResult:
    """Run ``fn(rank, world, workdir, *args)`` on ``world`` ranks; wait at most ``deadline`` s.

    By default on the session's reusable ranks (:mod:`_dist_pool`: started once
    per world size, gloo, ``file://`` rendezvous, :data:`COLLECTIVE_TIMEOUT`,
    one thread per rank; a job that fails or passes its deadline is reported
    with each rank's traceback and the pool is rebuilt for the next one).
    ``own=True`` (or ``FUNCOPT_TEST_POOL=0``): fresh processes through
    :func:`funcopt.distributed.launch.launch` (spawn, ``destroy_process_group``
    in ``finally``, each rank's traceback in ``error-rank<r>.txt``), for jobs
    that kill a rank or must own the group; no early kill after a failure
    (fault tests let the other ranks fail by themselves), only at the
    deadline."""
    import _dist_pool

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    assert not (workdir / "rendezvous").exists()
    if not own and _dist_pool.enabled():
        pool = _dist_pool.get(world, COLLECTIVE_TIMEOUT.total_seconds())
        ok, errors, why, seconds = pool.run(fn, workdir, args, deadline)
        codes: List[Optional[int]] = [0] * world if ok else [None] * world
        if not ok and not errors:
            errors = {0: f"pooled job failed: {why}"}
        return SpawnResult(world, workdir, codes, errors, seconds, killed=(why == "deadline"))
    res = launch(fn, world, str(workdir), *args, workdir=workdir, timeout=COLLECTIVE_TIMEOUT.total_seconds(),
                 deadline=deadline, grace=None, threads=1, torchrun=False)
    return SpawnResult(world, workdir, [res.exitcodes.get(r) for r in range(world)], dict(res.errors), res.seconds,
                       bool(res.killed))


def save(out_dir: str, rank: int, obj: Any, name: str = "result") -> None:
    tmp = Path(out_dir, f"{name}-rank{rank}.pt.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, Path(out_dir, f"{name}-rank{rank}.pt"))


def run_cases(rank: int, out_dir: str, cases: Sequence[Dict[str, Any]], runner: Callable[[Dict[str, Any]], Any],
              name: str = "result") -> None:
    """Run ``runner(case)`` for each case in order, saving ``{case name: result}``.

    An unexpected exception is recorded under the case's name (the parent shows
    it for that case) and re-raised: the group may be out of step, so the rank
    stops there; the cases after it are reported as not run.
    """
    results: Dict[str, Any] = {}
    seconds: Dict[str, float] = {}
    try:
        for case in cases:
            t0 = time.monotonic()
            try:
                results[case["name"]] = runner(case)
                seconds[case["name"]] = time.monotonic() - t0
            except BaseException:
                results[case["name"]] = {"__error__": traceback.format_exc()}
                raise
    finally:
        save(out_dir, rank, results, name)
        save(out_dir, rank, seconds, name + "-seconds")


def case_result(spawned: Any, results: Dict[Any, Dict[str, Any]], name: str, rank: Any = 0) -> Any:
    """The result of case ``name`` on ``rank`` (a rank, or a process name);
    fails with the child's traceback if it has none.  ``spawned.report()``
    describes the processes."""
    who = f"rank {rank}" if isinstance(rank, int) else str(rank)
    res = results.get(rank)
    if res is None or name not in res:
        raise AssertionError(f"case {name!r} did not run on {who}\n" + spawned.report())
    value = res[name]
    if isinstance(value, dict) and "__error__" in value:
        raise AssertionError(f"case {name!r} failed on {who}:\n{value['__error__']}\n" + spawned.report())
    return value


def load_all(spawned: SpawnResult, name: str = "result") -> Dict[int, Dict[str, Any]]:
    out = {}
    for r in range(spawned.world):
        f = spawned.out_dir / f"{name}-rank{r}.pt"
        if f.exists():
            out[r] = torch.load(f, weights_only=False)
    return out


# ------------------------------------------------------------- model, data
DIMS = {
    "small": (6, 10, 5, 3),   # 70 + 55 + 18 = 143 elements, 6 tensors
    "other": (6, 9, 5, 3),    # another model: different shapes
    "big": (64, 96, 64, 10),  # ~13k elements: sizes where the padding is negligible
    "wide": (256, 512, 128, 8),  # ~198k elements: several 1 MiB buckets at W=4
}


class UserRMSprop(torch.optim.RMSprop):
    """A user's own torch.optim subclass: no registry entry matches it, so the
    distributed layers run it eagerly (as torch does); same numbers as
    torch.optim.RMSprop.  (Every torch.optim update rule is in funcopt's
    registry, so the eager path is tested with a subclass.)"""


class Net(nn.Module):
    """Three tanh layers; ``mixed`` makes the middle one float64; ``extra`` adds a
    residual layer (the one added to the optimizer later); ``empty`` a
    zero-element parameter that still gets a (zero-size) gradient; ``unused`` a trainable
    parameter that forward never uses."""

    def __init__(self, kind: str = "small", mixed: bool = False, extra: bool = False, empty: bool = False,
                 unused: bool = False):
        super().__init__()
        torch.manual_seed(0)
        a, b, c, d = DIMS[kind]
        self.l1 = nn.Linear(a, b)
        self.l2 = nn.Linear(b, c)
        self.l3 = nn.Linear(c, d)
        self.extra = nn.Linear(d, d) if extra else None
        self.empty = nn.Parameter(torch.zeros(0)) if empty else None
        # trainable but never used by forward: its gradient stays None
        self.unused = nn.Parameter(torch.randn(5)) if unused else None
        if mixed:
            self.l2.double()
        self.n_in, self.n_out = a, d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        h = torch.tanh(self.l2(h.to(self.l2.weight.dtype))).to(x.dtype)
        h = self.l3(h)
        if self.extra is not None:
            h = h + self.extra(h)
        if self.empty is not None:
            h = h + self.empty.sum()
        return h


BATCH = 16  # divisible by every world size used


def batch(step: int, model: Net) -> tuple:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, model.n_in, generator=g), torch.randn(BATCH, model.n_out, generator=g)


def local_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def allreduce_mean_grads(params: Sequence[torch.Tensor], group: Any = None) -> None:
    """What DDP does, for the cases DDP cannot run (trainability changing between steps)."""
    world = dist.get_world_size(group)
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(world)


def snapshot(params: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    return [p.detach().clone() for p in params]


def max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return max(((x.double() - y.double()).abs().max().item() if x.numel() else 0.0) for x, y in zip(a, b))


def assert_tensors_close(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], what: str,
                         rtol: float = RTOL, atol: float = ATOL) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} tensors, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, \
            f"{what}[{i}]: {tuple(g.shape)} {g.dtype}, expected {tuple(w.shape)} {w.dtype}"
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m: f"{what}[{i}]: {m}")


def groups_close(got: List[Dict[str, Any]], want: List[Dict[str, Any]], rtol: float) -> bool:
    """Equal param groups, except that float values may differ by ``rtol`` (a rule's own
    per-group values summed over ranks in another order: Prodigy's ``d``, ``d_numerator``)."""
    if len(got) != len(want):
        return False
    for a, b in zip(got, want):
        if a.keys() != b.keys():
            return False
        for k, v in b.items():
            w = a[k]
            if type(v) is float and type(w) is float:
                if not math.isclose(w, v, rel_tol=rtol, abs_tol=1e-12):
                    return False
            elif w != v:
                return False
    return True


def assert_state_dict_close(got: Dict[str, Any], want: Dict[str, Any], what: str,
                            rtol: float = RTOL, atol: float = ATOL) -> None:
    """Same torch.optim format (keys, groups, per-parameter entries, shapes, dtypes), close values."""
    assert set(got) == set(want) == {"state", "param_groups"}, f"{what}: top-level keys {sorted(got)}"
    assert groups_close(got["param_groups"], want["param_groups"], rtol), \
        f"{what}: param_groups differ:\n{got['param_groups']}\nexpected\n{want['param_groups']}"
    assert sorted(got["state"]) == sorted(want["state"]), \
        f"{what}: state ids {sorted(got['state'])}, expected {sorted(want['state'])}"
    for pid, entry in want["state"].items():
        mine = got["state"][pid]
        assert sorted(mine) == sorted(entry), f"{what}: state[{pid}] keys {sorted(mine)}, expected {sorted(entry)}"
        for name, w in entry.items():
            g = mine[name]
            if isinstance(w, (list, tuple)):  # SOAP's GG / Q: a matrix (or [], unpreconditioned) per dimension
                assert isinstance(g, (list, tuple)) and len(g) == len(w), f"{what}: state[{pid}][{name}] length"
                assert [isinstance(a, torch.Tensor) for a in g] == [isinstance(b, torch.Tensor) for b in w], \
                    f"{what}: state[{pid}][{name}] entries"
                for k, (a, b) in enumerate(zip(state_tensors(g), state_tensors(w))):
                    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: state[{pid}][{name}][{k}] shape"
                    torch.testing.assert_close(a, b, rtol=rtol, atol=atol,
                                               msg=lambda m: f"{what}: state[{pid}][{name}][{k}]: {m}")
                continue
            if not isinstance(w, torch.Tensor) and isinstance(g, torch.Tensor) and g.dim() == 0:
                w = torch.tensor(float(w), dtype=g.dtype)  # an oracle's int step (prodigyopt): torch's 0-d counter
            assert isinstance(g, torch.Tensor) == isinstance(w, torch.Tensor), f"{what}: state[{pid}][{name}] type"
            if not isinstance(w, torch.Tensor):
                assert g == w, f"{what}: state[{pid}][{name}] = {g}, expected {w}"
                continue
            assert g.shape == w.shape and g.dtype == w.dtype, \
                f"{what}: state[{pid}][{name}] is {tuple(g.shape)} {g.dtype}, expected {tuple(w.shape)} {w.dtype}"
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m: f"{what}: state[{pid}][{name}]: {m}")


def state_tensors(value: Any, key: str = "") -> List[torch.Tensor]:
    """The tensors state entry ``key`` holds as funcopt holds them: a tensor, the matrices of a
    list (SOAP's GG / Q), a Python number ``step`` as a 0-d float32 counter (prodigyopt's int
    step); other numbers are options (SOAP's per-parameter precondition_frequency), no tensor."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in state_tensors(v)]
    if key == "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return [torch.tensor(float(value))]
    return []


def state_tensor_bytes(sd: Dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for e in sd["state"].values() for k, v in e.items()
               for t in state_tensors(v, k))


def assert_sd_close(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], what: str,
                    rtol: float = RTOL, atol: float = ATOL) -> None:
    """Same keys in the same order, same shapes and dtypes, values within rtol/atol."""
    assert list(got) == list(want), f"{what}: keys {list(got)}, expected {list(want)}"
    for k in want:
        g, w = got[k], want[k]
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what}[{k}]: {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m: f"{what}[{k}]: {m}")
