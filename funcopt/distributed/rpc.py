"""DistributedOptimizer: a parameter-server optimizer over ``torch.distributed.rpc``.

The trainer holds RRefs to parameters that live on other workers.  For each
owner, :class:`DistributedOptimizer` creates (over RPC) that owner's optimizer
of the parameters it owns (a :class:`_Shard`).  ``step(context_id)`` asks every
owner, concurrently, to fetch its gradients from the distributed autograd
context and apply them.

* A funcopt algorithm (or the matching ``torch.optim`` class) runs scripted:
  on the owner the whole step (gradient lookup and the fused or foreach
  kernel) is one TorchScript call, which runs without the GIL.  On a torch
  where TorchScript does not work, the same funcopt optimizer steps eagerly
  (same results; one ``EagerFallbackWarning`` per process on the owner).
* Any other optimizer class whose update is per parameter (a custom
  ``torch.optim.Optimizer`` subclass) runs eagerly on the owner, as torch's
  ``_LocalOptimizer`` does: the context's gradients are put in ``p.grad`` for
  the duration of ``opt.step()``.  ``torch.optim.LBFGS`` and
  ``torch.optim.SparseAdam`` are refused at construction (``TypeError``).

A per-worker lock makes concurrent trainers apply whole steps one at a time.
Errors raised on an owner come back to the caller as an exception of the same
type, naming the worker and carrying the worker's message.
"""
from __future__ import annotations

import itertools
import logging
import pickle
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor
from torch.distributed.rpc.constants import UNSET_RPC_TIMEOUT
from torch.profiler import record_function

from .. import registry, state_format
from . import _local
from ..script import quiet_jit, script_object

logger = logging.getLogger(__name__)

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


class _EagerApply:
    """:class:`_Apply` for a funcopt optimizer stepped eagerly (a torch that cannot script):
    the same gradient lookup, then the optimizer's own ``step(grads)``."""

    def __init__(self, opt: Any, params: List[Tensor]) -> None:
        self.opt = opt
        self.params = params

    def step(self, context_id: int) -> None:
        found = dist_autograd.get_gradients(context_id)
        self.opt.step([found.get(p) for p in self.params])


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


def _hyper_of(opt: Any) -> Dict[str, Any]:
    """The hyperparameters of ``opt``'s first group, if they can travel by RPC."""
    group = state_format.hyperparameters(opt.param_groups[0])
    try:
        pickle.dumps(group)
    except Exception:
        return {}
    return group


class _Shard:
    """The optimizer of the parameters one worker owns (lives on that worker).

    ``optimizer`` is a registry name (scripted funcopt optimizer) or any
    optimizer class (run eagerly, as torch's ``_LocalOptimizer``).
    """

    def __init__(self, optimizer: Any, param_rrefs: List[rpc.RRef], args: Tuple[Any, ...], kwargs: Dict[str, Any]):
        self.params = [r.local_value() for r in param_rrefs]
        self.scripted = isinstance(optimizer, str)
        self._make = (optimizer, args, kwargs)
        self._staged: Any = None
        self._prepared: Optional[Tuple[int, Any]] = None  # (seq, undo) of an applied, uncommitted change
        self._aborted: set = set()                          # seqs aborted before their prepare arrived
        self.compiled = False  # the funcopt optimizer runs scripted (False: eager, where torch cannot script)
        self._phase = threading.Lock()  # a two-phase step between its passes (Prodigy)
        if self.scripted:
            with _STEP_LOCK:  # TorchScript compilation is not safe from concurrent RPC threads
                cls = registry.get(optimizer).cls
                self.opt, self.compiled = _local.scripted_or_eager(lambda: cls(self.params, *args, **kwargs),
                                                                   "DistributedOptimizer")
                self._core = self.opt.core
                self.apply = _scripted_apply(self._core, self.params) if self.compiled else _EagerApply(self.opt, self.params)
        else:
            self.opt = optimizer(self.params, *args, **kwargs)  # the class's own errors reach the caller
        with _STEP_LOCK:
            self.id = next(_SHARD_IDS)
            _SHARDS[self.id] = self

    def ready(self) -> Dict[str, Any]:
        """This shard's id, and (eager classes) its hyperparameters for the trainer."""
        out: Dict[str, Any] = {"id": self.id}
        if not self.scripted:
            defaults = getattr(self.opt, "defaults", {})
            try:
                pickle.dumps(defaults)
            except Exception:
                defaults = {}
            out.update(group=_hyper_of(self.opt), defaults=dict(defaults))
        return out

    # -- hyperparameter changes: applied, checked, undone when refused
    def _refresh(self) -> None:
        """After ``param_groups`` changed: sync them into the core (checked)."""
        if not self.scripted:
            return
        core = self.opt.core  # funcopt checks the change here
        if self.compiled and core is not self._core:
            self._core, self.apply = core, _scripted_apply(core, self.params)

    def _apply_hyper(self, hyper: Dict[str, Any]) -> Any:
        """Set ``hyper`` in every group; refused (ValueError) with nothing changed, or
        the undo record.  Caller holds the lock."""
        groups = [dict(g) for g in self.opt.param_groups]
        saved = self.opt.state_dict() if self.scripted else None  # tensors by reference
        for g in self.opt.param_groups:
            g.update(hyper)
        try:
            self._refresh()  # funcopt checks the change against the state it holds
        except Exception:
            self._restore_groups(groups)
            raise
        return groups, saved

    def _restore_groups(self, groups: List[Dict[str, Any]]) -> None:
        for g, old in zip(self.opt.param_groups, groups):
            g.clear()
            g.update(old)

    def _undo(self, undo: Any) -> None:
        groups, saved = undo
        if saved is not None:
            # groups and state exactly as before (a flag switched on may have reset state)
            self.opt.load_state_dict(saved)
        else:
            self._restore_groups(groups)
        self._refresh()

    def prepare(self, seq: int, hyper: Dict[str, Any]) -> None:
        """Phase 1 of a hyperparameter change the owner may refuse: apply and check it;
        :meth:`step` with ``seq`` commits it, :meth:`abort` undoes it."""
        with _STEP_LOCK:
            if seq in self._aborted:
                self._aborted.discard(seq)
                raise RuntimeError(f"hyperparameter change {seq} was aborted before it arrived")
            if self._prepared is not None:  # a change its trainer never finished: undo it first
                self._undo(self._prepared[1])
                self._prepared = None
            self._prepared = (seq, self._apply_hyper(hyper))

    def abort(self, seq: int) -> None:
        with _STEP_LOCK:
            if self._prepared is not None and self._prepared[0] == seq:
                undo, self._prepared = self._prepared[1], None
                self._undo(undo)
            else:
                self._aborted.add(seq)  # its prepare may still be queued: refuse it when it comes

    # -- the step
    def step(self, context_id: int, hyper: Optional[Dict[str, Any]], seq: Optional[int] = None) -> None:
        with _STEP_LOCK:
            if seq is not None:  # commit the prepared change (it is already in place)
                if self._prepared is None or self._prepared[0] != seq:
                    raise RuntimeError(f"hyperparameter change {seq} is not prepared on this worker")
                self._prepared = None
            elif hyper:
                self._apply_hyper(hyper)
            if self.scripted:
                self.apply.step(context_id)  # TorchScript, without the GIL
            else:
                self._eager_step(context_id)

    # -- a two-phase rule (Prodigy): its sums over every owner's parameters
    def begin(self, context_id: int, hyper: Optional[Dict[str, Any]], seq: Optional[int], timeout: float) -> Tensor:
        """The first pass over this owner's parameters; returns its partial sums.  Holds
        this shard's two-phase lock until :meth:`finish` (or :meth:`abort_phase`): a
        second trainer's step waits (up to ``timeout`` seconds, then fails)."""
        if not self._phase.acquire(timeout=max(timeout, 1.0)):
            raise RuntimeError("another trainer's two-phase step is still pending on this worker")
        try:
            with _STEP_LOCK:
                if seq is not None:
                    if self._prepared is None or self._prepared[0] != seq:
                        raise RuntimeError(f"hyperparameter change {seq} is not prepared on this worker")
                    self._prepared = None
                elif hyper:
                    self._apply_hyper(hyper)
                found = dist_autograd.get_gradients(context_id)
                core = self.opt.step_core
                core.begin([found.get(p) for p in self.params], None, None)
                return core.partials()
        except BaseException:
            self._phase.release()
            raise

    def finish(self, total: Tensor) -> None:
        try:
            with _STEP_LOCK:
                self.opt.step_core.finish(total)
        finally:
            self._phase.release()

    def abort_phase(self) -> None:
        """The trainer gave up between the passes: drop the pending step (the first pass's
        moments stay advanced; the parameters are unchanged) and free the lock."""
        if self._phase.locked():
            self._phase.release()

    def set_mode(self, train: bool) -> None:
        with _STEP_LOCK:
            if getattr(type(self.opt), "has_modes", False):
                self.opt.train() if train else self.opt.eval()

    def _eager_step(self, context_id: int) -> None:
        """As torch's ``_LocalOptimizer.step``: gradients in ``p.grad``, then ``opt.step()``.
        A parameter without a gradient in this context has ``grad=None`` (never a
        stale one); every ``p.grad`` is restored afterwards."""
        found = dist_autograd.get_gradients(context_id)
        before = [p.grad for p in self.params]
        try:
            for p in self.params:
                p.grad = found.get(p)
            self.opt.step()
        finally:
            for p, g in zip(self.params, before):
                p.grad = g

    # -- state
    def state_dict(self) -> Dict[str, Any]:
        with _STEP_LOCK:
            sd = self.opt.state_dict()
            state = {i: {k: v.clone() if isinstance(v, Tensor) else v for k, v in e.items()}
                     for i, e in sd["state"].items()}
            return {"state": state, "param_groups": sd["param_groups"]}

    def stage_load(self, state_dict: Dict[str, Any]) -> None:
        """Check ``state_dict`` and keep the result; changes nothing."""
        with _STEP_LOCK:
            if self.scripted:
                self._staged = self.opt.stage_state(state_dict)
                return
            # an eager class checks a load only by doing it: on a scratch copy
            # (the same class and arguments over clones of the parameters)
            cls, args, kwargs = self._make
            scratch = cls([p.detach().clone().requires_grad_(p.requires_grad) for p in self.params],
                          *args, **kwargs)
            scratch.load_state_dict(state_dict)
            self._staged = state_dict

    def commit_load(self) -> None:
        with _STEP_LOCK:
            staged, self._staged = self._staged, None
            if staged is None:
                raise RuntimeError("commit_load without a staged state")
            if self.scripted:
                self.opt.commit_state(staged)
            else:
                self.opt.load_state_dict(staged)
            self._refresh()


def _new_shard(optimizer: Any, param_rrefs: List[rpc.RRef], args: Tuple[Any, ...],
               kwargs: Dict[str, Any]) -> Tuple[rpc.RRef, Dict[str, Any]]:
    """Build this worker's shard: an RRef to it, and what the trainer needs to know."""
    shard = _Shard(optimizer, param_rrefs, args, kwargs)
    return rpc.RRef(shard), shard.ready()


def _shard_call(shard: rpc.RRef, method: str, *args: Any) -> Any:
    return getattr(shard.local_value(), method)(*args)


def _get_shard(shard_id: int) -> _Shard:
    shard = _SHARDS.get(shard_id)
    if shard is None:
        raise RuntimeError(f"no funcopt optimizer {shard_id} on this worker (its DistributedOptimizer was deleted)")
    return shard


def _shard_step(shard_id: int, context_id: int, hyper: Optional[Dict[str, Any]], seq: Optional[int] = None) -> None:
    """The step RPC (the hot path): the shard by id, then one locked step."""
    _get_shard(shard_id).step(context_id, hyper, seq)


def _shard_prepare(shard_id: int, seq: int, hyper: Dict[str, Any]) -> None:
    _get_shard(shard_id).prepare(seq, hyper)


def _shard_abort(shard_id: int, seq: int) -> None:
    _get_shard(shard_id).abort(seq)


def _shard_begin(shard_id: int, context_id: int, hyper: Optional[Dict[str, Any]], seq: Optional[int],
                 timeout: float) -> Tensor:
    return _get_shard(shard_id).begin(context_id, hyper, seq, timeout)


def _shard_finish(shard_id: int, total: Tensor) -> None:
    _get_shard(shard_id).finish(total)


def _shard_abort_phase(shard_id: int) -> None:
    _get_shard(shard_id).abort_phase()


def _shard_mode(shard_id: int, train: bool) -> None:
    _get_shard(shard_id).set_mode(train)


def _is_tensor(rref: rpc.RRef) -> bool:
    return isinstance(rref.local_value(), Tensor)


# -------------------------------------------------------------- trainer side


def _reason(e: BaseException) -> str:
    """What went wrong, in one line.  An exception relayed by RPC reads
    "On WorkerInfo(...):", the exception's repr, then the worker's traceback,
    whose last lines are "Type: message": that is the reason.  Otherwise
    (a timeout, a dead worker) the whole text; plus a distinct cause."""
    lines = str(e).strip().splitlines()
    text = ""
    heads = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")]
    if lines and "On WorkerInfo" in lines[0] and heads:
        j = heads[-1] + 1
        while j < len(lines) and lines[j].startswith(" "):  # the frames
            j += 1
        tail = []
        for ln in lines[j:]:
            if ln.strip() == "At:":  # TorchScript's own location note
                break
            if ln.strip():
                tail.append(ln.strip())
        text = " ".join(tail)
    if not text:
        text = f"{type(e).__name__}: " + " | ".join(ln.strip() for ln in lines if ln.strip())
    if e.__cause__ is not None and str(e.__cause__) not in str(e):
        text += f" (caused by {type(e.__cause__).__name__}: {e.__cause__})"
    return text[-1000:]


def _relayed(e: BaseException, message: str) -> BaseException:
    """``message`` as an exception of ``e``'s type (as RPC itself rebuilds a
    worker's exception), or RuntimeError where that type cannot be rebuilt."""
    try:
        out = type(e)(message)
        if isinstance(out, Exception) and str(out) == message:
            return out
    except Exception:
        pass
    return RuntimeError(message)


def _wait_all(futs: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, BaseException]]:
    """Wait for every future (each has its own timeout); results and errors by worker."""
    done: Dict[str, Any] = {}
    failed: Dict[str, BaseException] = {}
    for w, f in futs.items():
        try:
            done[w] = f.wait()
        except Exception as e:  # dead, unreachable, timed out, or failed remotely
            failed[w] = e
    return done, failed


def _raise_failures(failed: Dict[str, BaseException], prefix: str) -> None:
    if not failed:
        return
    first = next(iter(failed.values()))
    text = "; ".join(f"worker {w!r}: {_reason(e)}" for w, e in failed.items())
    raise _relayed(first, f"{prefix} {text}") from first


class DistributedOptimizer(torch.optim.Optimizer):
    r"""Apply an optimizer step to parameters spread over RPC workers.

    A drop-in for ``torch.distributed.optim.DistributedOptimizer``:
    ``DistributedOptimizer(optimizer_class, params_rref, *args, **kwargs)`` and
    ``step(context_id)``.

    * A funcopt algorithm (``funcopt.Adam``) or the matching ``torch.optim``
      class (``torch.optim.Adam``): on every owner the optimizer is the
      scripted funcopt one (fused where available), stepped without the GIL.
      Invalid hyperparameters raise torch's own error here, on the caller.
    * Any other optimizer class whose update is per parameter (a custom
      ``torch.optim.Optimizer`` subclass, e.g. one of ``torch.optim.RMSprop``):
      constructed and stepped eagerly on every owner (under the owner's step
      lock), as torch does.
    * ``torch.optim.LBFGS`` and ``torch.optim.SparseAdam`` (and subclasses):
      ``TypeError`` here, before any RPC (each owner would run it on its own
      parameters only, which is not that algorithm on the model).

    An error raised on an owner (by the optimizer class, a refused
    hyperparameter change, a bad state) comes back as an exception of the same
    type, naming the worker and carrying its message; construction failures
    read "Error creating optimizer.", step failures "Error running optimizer.".

    Args:
      optimizer_class: e.g. ``funcopt.Adam``, ``torch.optim.Adam``, any
        ``torch.optim.Optimizer`` subclass, or a registry name (``"Adam"``).
      params_rref: RRefs to the parameters (on any workers, the caller's too).
      *args: the optimizer's positional hyperparameters.
      rpc_timeout: seconds to wait for a worker (keyword only; default: the
        RPC agent's timeout).  A worker that is dead or does not answer in
        time makes the call raise ``RuntimeError`` naming it.
      **kwargs: the optimizer's keyword hyperparameters.

    Usage::

        with dist_autograd.context() as ctx:
            loss = model(rref_inputs).sum()
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)

    Hyperparameters live in ``opt.param_groups[0]`` (one group); change them
    between steps (``opt.param_groups[0]["lr"] = 0.01``, or an LR scheduler)
    and the next ``step`` carries the change to every worker.  A change an
    owner may refuse (a flag that adds state, such as Adam's ``amsgrad``) is
    first checked on every owner; if any refuses, none changes and ``step``
    raises before any owner steps.

    .. warning:: ``step`` of several trainers on shared parameters is
       serialized per worker (no lost or torn updates), but the order of the
       trainers' steps is whatever order they arrive in.
    """

    def __init__(self, optimizer_class: Any, params_rref: Sequence[rpc.RRef], *args: Any,
                 rpc_timeout: float = UNSET_RPC_TIMEOUT, **kwargs: Any):
        self.rpc_timeout: float = rpc_timeout
        self.spec: Optional[registry.AlgorithmSpec]
        registry.refuse_out_of_scope(  # LBFGS / SparseAdam: refused here, before any RPC
            optimizer_class, "DistributedOptimizer",
            also="; or any other optimizer class whose update is per parameter (run eagerly on the owners)")
        try:
            self.spec = registry.get(optimizer_class)
        except KeyError as e:
            if isinstance(optimizer_class, str) or not callable(optimizer_class):
                raise ValueError(f"DistributedOptimizer: {e.args[0]}; or pass any optimizer class") from None
            self.spec = None  # run eagerly on the owners, as torch does
        self._cls_name = getattr(optimizer_class, "__name__", repr(optimizer_class))
        defaults: Dict[str, Any] = {}
        if self.spec is not None:
            probe = self.spec.cls([torch.zeros(self.spec.probe_shape, requires_grad=True)], *args, **kwargs)  # torch's errors, here
            defaults = dict(probe.defaults)
        rrefs = list(params_rref)
        if not rrefs:
            raise ValueError("DistributedOptimizer: params_rref is empty")
        by_owner: Dict[str, List[rpc.RRef]] = {}
        for r in rrefs:
            if not isinstance(r, rpc.PyRRef):
                raise TypeError(f"DistributedOptimizer: expected RRefs to tensors, got {type(r).__name__}")
            by_owner.setdefault(r.owner().name, []).append(r)
        if self.spec is None:
            logger.info("DistributedOptimizer: %s has no scripted funcopt version; it runs eagerly on the owners "
                        "(with the GIL)", self._cls_name)
        self._seq = itertools.count()
        with record_function("funcopt::rpc/create"):
            checks = {w: [rpc.rpc_async(w, _is_tensor, args=(r,), timeout=self.rpc_timeout) for r in rs]
                      for w, rs in by_owner.items()}
            for w, futs in checks.items():
                for k, ok in enumerate(self._wait(w, futs, "checking parameters")):
                    if not ok:
                        raise TypeError(f"DistributedOptimizer: RRef {k} on worker {w!r} does not hold a tensor")
            what = self.spec.name if self.spec is not None else optimizer_class
            done, failed = _wait_all({w: rpc.rpc_async(w, _new_shard, args=(what, rs, args, kwargs),
                                                       timeout=self.rpc_timeout)
                                      for w, rs in by_owner.items()})
            _raise_failures(failed, f"DistributedOptimizer: Error creating optimizer. {self._cls_name} on")
            self._shards: Dict[str, rpc.RRef] = {w: done[w][0] for w in by_owner}
            self._ids: Dict[str, int] = {w: done[w][1]["id"] for w in by_owner}
            self.workers = sorted(self._shards)
        group: Dict[str, Any] = {}
        if self.spec is None:  # the owners' own hyperparameters (same arguments: the first owner's)
            first = done[self.workers[0]][1]
            defaults, group = first["defaults"], first["group"]
        # a torch.optim.Optimizer (so LR schedulers drive it) whose one group holds
        # no local tensors: the parameters are behind RRefs
        torch.optim.Optimizer.__init__(self, [{"params": [torch.zeros(0, requires_grad=True)]}], defaults)
        self.param_groups[0].update(group)
        self.param_groups[0]["params"] = []
        self._sent = {k: v for k, v in self.param_groups[0].items() if k != "params"}

    def _wait(self, worker: str, futs: List[Any], what: str) -> List[Any]:
        out = []
        for f in futs:
            try:
                out.append(f.wait())
            except Exception as e:  # dead, unreachable, timed out, or failed remotely
                raise _relayed(e, f"DistributedOptimizer: worker {worker!r} failed while {what}: {_reason(e)}") from e
        return out

    def _changed(self) -> Optional[Dict[str, Any]]:
        group = self.param_groups[0]
        diff = {k: v for k, v in group.items() if k != "params" and (k not in self._sent or self._sent[k] != v)}
        return diff or None

    def _refusable(self, hyper: Dict[str, Any]) -> bool:
        """Whether an owner may refuse ``hyper`` because of the state it holds: a
        change of a flag that adds a state slot (Adam's amsgrad, SGD's momentum)."""
        if self.spec is None:
            return False  # an eager class checks nothing before its step
        flags = {cond for _, cond in getattr(self.spec.cls, "slots", ()) if cond}
        return bool(flags & set(hyper))

    def _prepare(self, hyper: Dict[str, Any]) -> int:
        """Every owner applies and checks ``hyper``; if any refuses (or does not
        answer), every owner undoes it and this raises.  Returns the change's seq."""
        seq = next(self._seq)
        with record_function("funcopt::rpc/prepare"):
            _, failed = _wait_all({w: rpc.rpc_async(w, _shard_prepare, args=(i, seq, hyper), timeout=self.rpc_timeout)
                                   for w, i in self._ids.items()})
            if failed:
                # undo where it was applied, and where it may still be (a worker that timed out
                # may apply it late: it finds the abort first); a worker that refused holds nothing
                undo = {w: i for w, i in self._ids.items()
                        if w not in failed or "On WorkerInfo" not in str(failed[w]).split("\n", 1)[0]}
                _wait_all({w: rpc.rpc_async(w, _shard_abort, args=(i, seq), timeout=self.rpc_timeout)
                           for w, i in undo.items()})
                _raise_failures(failed, f"DistributedOptimizer.step: the change {hyper} was refused, no worker "
                                        "changed and none stepped:")
        return seq

    def step(self, context_id: int) -> None:  # type: ignore[override]
        """Step every owner's optimizer with the gradients of ``context_id``, concurrently."""
        dist_autograd._is_valid_context(context_id)  # torch's check, before any worker is asked
        hyper = self._changed()
        seq: Optional[int] = None
        if hyper and self.spec is not None:
            self.spec.cls([torch.zeros(self.spec.probe_shape, requires_grad=True)], **dict(self.defaults, **{
                k: v for k, v in self.param_groups[0].items() if k in self.defaults}))
        if hyper and self._refusable(hyper):
            seq = self._prepare(hyper)
        if self.spec is not None and self.spec.cls.phases == 2:
            self._two_phase_step(context_id, hyper, seq)
        else:
            with record_function("funcopt::rpc/step"):
                args = (context_id, None, seq) if seq is not None else (context_id, hyper)
                _, failed = _wait_all({w: rpc.rpc_async(w, _shard_step, args=(i, *args), timeout=self.rpc_timeout)
                                       for w, i in self._ids.items()})
                _raise_failures(failed, f"DistributedOptimizer.step: Error running optimizer. {self._cls_name} on")
        if hyper:
            self._sent.update(hyper)

    def _two_phase_step(self, context_id: int, hyper: Optional[Dict[str, Any]], seq: Optional[int]) -> None:
        """A rule whose step sums over every parameter (Prodigy's ``d``): every owner's
        first pass, the partial sums added up here (in worker order), every owner's second."""
        timeout = self.rpc_timeout if self.rpc_timeout != UNSET_RPC_TIMEOUT else rpc.get_rpc_timeout()
        with record_function("funcopt::rpc/step_first_pass"):
            done, failed = _wait_all({w: rpc.rpc_async(w, _shard_begin, args=(i, context_id, hyper, seq, timeout),
                                                       timeout=self.rpc_timeout)
                                      for w, i in self._ids.items()})
            if failed:
                _wait_all({w: rpc.rpc_async(w, _shard_abort_phase, args=(self._ids[w],), timeout=self.rpc_timeout)
                           for w in done})
                _raise_failures(failed, f"DistributedOptimizer.step: Error running optimizer. {self._cls_name} on")
        total = None
        for w in self.workers:
            total = done[w] if total is None else total + done[w]
        with record_function("funcopt::rpc/step_second_pass"):
            _, failed = _wait_all({w: rpc.rpc_async(w, _shard_finish, args=(i, total), timeout=self.rpc_timeout)
                                   for w, i in self._ids.items()})
            _raise_failures(failed, f"DistributedOptimizer.step: Error running optimizer. {self._cls_name} on")

    def train(self) -> None:
        """Train mode on every owner (Schedule-Free: the parameters become the interpolated
        point); a no-op for algorithms without modes."""
        self._set_mode(True)

    def eval(self) -> None:
        """Eval mode on every owner (Schedule-Free: the parameters become the average)."""
        self._set_mode(False)

    def _set_mode(self, train: bool) -> None:
        if self.spec is None or not self.spec.cls.has_modes:
            return
        _, failed = _wait_all({w: rpc.rpc_async(w, _shard_mode, args=(i, train), timeout=self.rpc_timeout)
                               for w, i in self._ids.items()})
        _raise_failures(failed, f"DistributedOptimizer.{'train' if train else 'eval'}: {self._cls_name} on")

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
        hyper = state_format.hyperparameters(loaded)
        self.param_groups[0].update(hyper)
        self._sent = {k: v for k, v in self.param_groups[0].items() if k != "params"}
