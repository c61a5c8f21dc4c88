"""DistributedOptimizer: a parameter-server optimizer over ``torch.distributed.rpc``.

The trainer holds RRefs to parameters that live on other workers.  For each
owner, :class:`DistributedOptimizer` creates (over RPC) a scripted funcopt
optimizer of the parameters that worker owns.  ``step(context_id)`` asks every
owner, concurrently, to fetch its gradients from the distributed autograd
context and apply them; on the owner that whole step (gradient lookup and the
fused or foreach kernel) is one TorchScript call, which runs without the GIL.
A per-worker lock makes concurrent trainers apply whole steps one at a time.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor
from torch.distributed.rpc.constants import UNSET_RPC_TIMEOUT
from torch.profiler import record_function

from .. import registry
from ..script import quiet_jit, script, script_object

# --------------------------------------------------------------- worker side


class _StepCore:  # made a TorchScript interface on first use (nothing is scripted at import)
    def step(self, grads: List[Optional[Tensor]], grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
        pass


class _Apply:
    """One worker's step as a TorchScript object: look this worker's gradients up
    in the autograd context and step the core.  Holding ``params`` here keeps the
    per-step call from Python down to one int argument."""

    def __init__(self, core: _StepCore, params: List[Tensor]) -> None:
        self.core = core
        self.params = params

    def step(self, context_id: int) -> None:
        found = dist_autograd.get_gradients(context_id)
        grads: List[Optional[Tensor]] = []
        for p in self.params:
            grads.append(found.get(p))
        self.core.step(grads, None, None)


_STEP_LOCK = threading.Lock()  # one optimizer step at a time on this worker, whoever the trainer
# this worker's shards by id: a step RPC names its shard with an int (no RRef to
# pickle and resolve per step); the trainer's RRef keeps the shard alive
_SHARDS: "weakref.WeakValueDictionary[int, _Shard]" = weakref.WeakValueDictionary()
_SHARD_IDS = itertools.count()
_INTERFACE: List[bool] = []


def _scripted_apply(core: Any, params: List[Tensor]) -> Any:
    if not _INTERFACE:
        with quiet_jit():
            torch.jit.interface(_StepCore)
        _INTERFACE.append(True)
    return script_object(_Apply(core, params))


class _Shard:
    """The optimizer of the parameters one worker owns (lives on that worker)."""

    def __init__(self, name: str, param_rrefs: List[rpc.RRef], args: Tuple[Any, ...], kwargs: Dict[str, Any]):
        self.params = [r.local_value() for r in param_rrefs]
        self._staged: Any = None
        with _STEP_LOCK:  # TorchScript compilation is not safe from concurrent RPC threads
            self.opt = script(registry.get(name).cls(self.params, *args, **kwargs))
            self._core = self.opt.core
            self.apply = _scripted_apply(self._core, self.params)
            self.id = next(_SHARD_IDS)
            _SHARDS[self.id] = self

    def ready(self) -> int:
        return self.id

    def _refresh(self) -> None:
        """After ``param_groups`` changed: sync them into the core (checked)."""
        core = self.opt.core
        if core is not self._core:
            self._core, self.apply = core, _scripted_apply(core, self.params)

    def step(self, context_id: int, hyper: Optional[Dict[str, Any]]) -> None:
        with _STEP_LOCK:
            if hyper:
                for group in self.opt.param_groups:
                    group.update(hyper)
                self._refresh()
            self.apply.step(context_id)  # TorchScript, without the GIL

    def state_dict(self) -> Dict[str, Any]:
        with _STEP_LOCK:
            return {"state": {i: {k: v.clone() for k, v in e.items()} for i, e in self.opt.state_dict()["state"].items()},
                    "param_groups": self.opt.state_dict()["param_groups"]}

    def stage_load(self, state_dict: Dict[str, Any]) -> None:
        """Check ``state_dict`` and keep the converted result; changes nothing."""
        with _STEP_LOCK:
            self._staged = self.opt.stage_state(state_dict)

    def commit_load(self) -> None:
        with _STEP_LOCK:
            staged, self._staged = self._staged, None
            if staged is None:
                raise RuntimeError("commit_load without a staged state")
            self.opt.commit_state(staged)
            self._refresh()


def _shard_call(shard: rpc.RRef, method: str, *args: Any) -> Any:
    return getattr(shard.local_value(), method)(*args)


def _shard_step(shard_id: int, context_id: int, hyper: Optional[Dict[str, Any]]) -> None:
    """The step RPC (the hot path): the shard by id, then one locked TorchScript call."""
    shard = _SHARDS.get(shard_id)
    if shard is None:
        raise RuntimeError(f"no funcopt optimizer {shard_id} on this worker (its DistributedOptimizer was deleted)")
    shard.step(context_id, hyper)


def _is_tensor(rref: rpc.RRef) -> bool:
    return isinstance(rref.local_value(), Tensor)


# -------------------------------------------------------------- trainer side


def _reason(e: BaseException) -> str:
    """The whole text of an exception relayed by RPC (its first line only names
    the worker, "On WorkerInfo(...):"; the reason follows), plus its cause."""
    parts = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if e.__cause__ is not None and str(e.__cause__) not in str(e):
        parts.append(str(e.__cause__))
    return f"{type(e).__name__}: " + " | ".join(parts)[-800:]


class DistributedOptimizer(torch.optim.Optimizer):
    r"""Apply an optimizer step to parameters spread over RPC workers.

    A drop-in for ``torch.distributed.optim.DistributedOptimizer``:
    ``DistributedOptimizer(optimizer_class, params_rref, *args, **kwargs)`` and
    ``step(context_id)``.  ``optimizer_class`` is any funcopt algorithm or the
    matching ``torch.optim`` class; on every owner the optimizer is the
    scripted funcopt one (fused where available), stepped without the GIL.

    Args:
      optimizer_class: e.g. ``funcopt.Adam`` or ``torch.optim.Adam``.
      params_rref: RRefs to the parameters (on any workers, the caller's too).
      *args, **kwargs: the optimizer's hyperparameters, checked here first.
      rpc_timeout: seconds to wait for a worker (keyword only; default: the
        RPC agent's timeout).  A worker that is dead or does not answer in
        time makes ``step`` raise ``RuntimeError`` naming it.

    Usage::

        with dist_autograd.context() as ctx:
            loss = model(rref_inputs).sum()
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)

    Hyperparameters live in ``opt.param_groups[0]`` (one group); change them
    between steps (``opt.param_groups[0]["lr"] = 0.01``, or an LR scheduler)
    and the next ``step`` carries the change to every worker.

    .. warning:: ``step`` of several trainers on shared parameters is
       serialized per worker (no lost or torn updates), but the order of the
       trainers' steps is whatever order they arrive in.
    """

    def __init__(self, optimizer_class: type, params_rref: Sequence[rpc.RRef], *args: Any, **kwargs: Any):
        self.rpc_timeout: float = kwargs.pop("rpc_timeout", UNSET_RPC_TIMEOUT)
        try:
            self.spec = registry.get(optimizer_class)
        except KeyError as e:
            raise ValueError(f"DistributedOptimizer: {e.args[0]}") from None
        probe = self.spec.cls([torch.zeros(1, requires_grad=True)], *args, **kwargs)  # torch's errors, here
        # a torch.optim.Optimizer (so LR schedulers drive it) whose one group holds
        # no local tensors: the parameters are behind RRefs
        torch.optim.Optimizer.__init__(self, [{"params": [torch.zeros(0, requires_grad=True)]}], dict(probe.defaults))
        self.param_groups[0]["params"] = []
        self._sent = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        rrefs = list(params_rref)
        if not rrefs:
            raise ValueError("DistributedOptimizer: params_rref is empty")
        by_owner: Dict[str, List[rpc.RRef]] = {}
        for r in rrefs:
            if not isinstance(r, rpc.PyRRef):
                raise TypeError(f"DistributedOptimizer: expected RRefs to tensors, got {type(r).__name__}")
            by_owner.setdefault(r.owner().name, []).append(r)
        with record_function("funcopt::rpc/create"):
            checks = {w: [rpc.rpc_async(w, _is_tensor, args=(r,), timeout=self.rpc_timeout) for r in rs]
                      for w, rs in by_owner.items()}
            for w, futs in checks.items():
                for k, ok in enumerate(self._wait(w, futs, "checking parameters")):
                    if not ok:
                        raise TypeError(f"DistributedOptimizer: RRef {k} on worker {w!r} does not hold a tensor")
            self._shards: Dict[str, rpc.RRef] = {
                w: rpc.remote(w, _Shard, args=(self.spec.name, rs, args, kwargs), timeout=self.rpc_timeout)
                for w, rs in by_owner.items()}
            self.workers = sorted(self._shards)
            ready = {w: rpc.rpc_async(w, _shard_call, args=(s, "ready"), timeout=self.rpc_timeout)
                     for w, s in self._shards.items()}
            self._ids: Dict[str, int] = {w: self._wait(w, [f], "creating its optimizer")[0] for w, f in ready.items()}

    def _wait(self, worker: str, futs: List[Any], what: str) -> List[Any]:
        out = []
        for f in futs:
            try:
                out.append(f.wait())
            except Exception as e:  # dead, unreachable, timed out, or failed remotely
                raise RuntimeError(f"DistributedOptimizer: worker {worker!r} failed while {what}: {_reason(e)}") from e
        return out

    def _changed(self) -> Optional[Dict[str, Any]]:
        group = self.param_groups[0]
        diff = {k: v for k, v in group.items() if k != "params" and (k not in self._sent or self._sent[k] != v)}
        return diff or None

    def step(self, context_id: int) -> None:
        """Step every owner's optimizer with the gradients of ``context_id``, concurrently."""
        hyper = self._changed()
        if hyper:
            self.spec.cls([torch.zeros(1, requires_grad=True)], **dict(self.defaults, **{
                k: v for k, v in self.param_groups[0].items() if k in self.defaults}))
        with record_function("funcopt::rpc/step"):
            futs = {w: rpc.rpc_async(w, _shard_step, args=(i, context_id, hyper), timeout=self.rpc_timeout)
                    for w, i in self._ids.items()}
            failures = []
            for w, f in futs.items():
                try:
                    f.wait()
                except Exception as e:
                    failures.append(f"worker {w!r}: {_reason(e)}")
            if failures:
                raise RuntimeError("DistributedOptimizer.step failed on " + "; ".join(failures))
        if hyper:
            self._sent.update(hyper)

    def state_dicts(self) -> Dict[str, Dict[str, Any]]:
        """Every owner's optimizer state, torch.optim format, keyed by worker name
        (parameter ids follow the order of that worker's RRefs in ``params_rref``)."""
        futs = {w: rpc.rpc_async(w, _shard_call, args=(s, "state_dict"), timeout=self.rpc_timeout)
                for w, s in self._shards.items()}
        return {w: self._wait(w, [f], "reading its state")[0] for w, f in futs.items()}

    def load_state_dicts(self, state_dicts: Dict[str, Dict[str, Any]]) -> None:
        """Load what :meth:`state_dicts` returned (each owner checks before changing anything)."""
        missing = set(self._shards) - set(state_dicts)
        if missing:
            raise ValueError(f"DistributedOptimizer.load_state_dicts: no state for workers {sorted(missing)}")
        # all owners check first; only if every one accepts does any of them change
        futs = {w: rpc.rpc_async(w, _shard_call, args=(s, "stage_load", state_dicts[w]), timeout=self.rpc_timeout)
                for w, s in self._shards.items()}
        for w, f in futs.items():
            self._wait(w, [f], "checking its state")
        futs = {w: rpc.rpc_async(w, _shard_call, args=(s, "commit_load"), timeout=self.rpc_timeout)
                for w, s in self._shards.items()}
        for w, f in futs.items():
            self._wait(w, [f], "loading its state")
        # the trainer's hyperparameters follow what the workers now hold
        loaded = state_dicts[self.workers[0]]["param_groups"][0]
        hyper = {k: v for k, v in loaded.items() if k not in ("params", "param_names")}
        self.param_groups[0].update(hyper)
        self._sent = {k: v for k, v in self.param_groups[0].items() if k != "params"}


