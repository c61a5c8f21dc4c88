"""ZeRO overlapped with DDP: each bucket steps and syncs as its all-reduce returns.

``ZeroRedundancyOptimizer(..., overlap_with_ddp=True)`` with
``ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))``
(torch's registration pattern and names, from
``torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook``).  Per DDP
gradient bucket:

1. the wrapped hook (e.g. ``allreduce_hook``) averages the bucket;
2. when it returns, every rank steps the element ranges *it owns* of the
   bucket's parameters (``optim.step(grads)`` over its segments, ``None``
   for the others: the same scripted kernel as ``step()``), on the thread
   that completed the all-reduce, while backward goes on;
3. the bucket's parameter sync (one broadcast per owner) starts
   asynchronously, issued from the autograd thread in bucket order (so every
   rank issues the same collectives in the same order, which gloo needs):
   with :func:`hook_with_zero_step_interleaved` from the next bucket's hook,
   with :func:`hook_with_zero_step` from the last bucket's;
4. by default (torch's semantics) every sync is waited for at the end of
   backward, in a callback queued on the autograd engine from the last
   bucket's hook: when ``backward()`` returns, every parameter is current on
   every rank, and the syncs overlapped whatever backward had left to do
   (with the interleaved hook: most of it).  With ``sync_in_forward=True``
   the wait moves to forward (and ``state_dict``) pre-hooks, per module, just
   before the next forward uses those parameters (and to ``zero_grad``,
   ``step``, ``consolidate_state_dict``, ``wait_sync``, the next backward: a
   forward that raised leaves nothing pending); until then the parameters
   are not to be read.

The first iteration already steps: nothing depends on DDP's bucket rebuild
(the plan is keyed by the bucket's parameters and rebuilt when they change).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.profiler import record_function

from ._sync import Flight

__all__ = ["ZeroOverlap", "hook_with_zero_step", "hook_with_zero_step_interleaved"]


class _Sync:
    """One bucket's parameter sync in flight: a broadcast per owner (``_sync.Flight``,
    each unpacked into the homes when waited for)."""

    def __init__(self, params: List[int]):
        self.params = params
        self.flights: List[Flight] = []

    def wait(self) -> None:
        with record_function("funcopt::zero_overlap/wait_sync"):
            for f in self.flights:
                f.wait()


class ZeroOverlap:
    """The per-bucket step and sync of one ZeroRedundancyOptimizer (built by it).

    Args:
      segments: this rank's segments (``(param, start, length, ...)``).
      all_segments: every rank's segments, ``all_segments[r]``.
      params: the ZeRO optimizer's parameters in ``param_groups`` order.
      homes: each parameter's contiguous 1-D home.
      local: the local (funcopt) optimizer over ``segments``.
      local_shapes: per segment, the shape its gradient takes (None: 1-D range).
      before_step: called (on the autograd thread) before a backward's first
        bucket steps: hyperparameters to the local optimizer.
      process_group: the ZeRO optimizer's process group.
      rank: this rank in it.
      world: its size.
    """

    def __init__(self, segments: Sequence[Any], all_segments: Sequence[Sequence[Any]], params: List[Tensor],
                 homes: List[Tensor], local: Any, local_shapes: List[Optional[tuple]],
                 before_step: Callable[[], None], process_group: Any, rank: int, world: int):
        self.segments = list(segments)
        self.all_segments = all_segments
        self.params = params
        self.homes = homes
        self.local = local
        self.local_shapes = local_shapes
        self.before_step = before_step
        self.group, self.rank, self.world = process_group, rank, world
        self.index = {id(p): i for i, p in enumerate(params)}
        self.mine: Dict[int, List[int]] = {}  # param -> positions in self.segments
        for k, s in enumerate(self.segments):
            self.mine.setdefault(s.param, []).append(k)
        self.pending: Dict[int, _Sync] = {}  # param -> its sync in flight
        self.queued: List[Tuple[torch.futures.Future, List[int]]] = []  # stepped, sync not started
        self.buckets_stepped = 0
        self.hooked_modules: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self.roots: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._plans: Dict[Tuple[int, ...], List[Tuple[int, List[Tuple[int, int, int]]]]] = {}

    # ----------------------------------------------------------- the step
    def step_bucket(self, params: List[int], grads: List[Tensor], used: Optional[List[int]]) -> None:
        """Step this rank's ranges of ``params`` (their averaged gradients ``grads``)."""
        local_grads: List[Optional[Tensor]] = [None] * len(self.segments)
        any_grad = False
        for j, (i, g) in enumerate(zip(params, grads)):
            if used is not None and not used[j]:
                continue  # no rank has a gradient for it: DDP leaves .grad None, step() skips it
            for k in self.mine.get(i, ()):
                s, shape = self.segments[k], self.local_shapes[k]
                local_grads[k] = g.view(shape) if shape is not None else g.reshape(-1)[s.start: s.start + s.length]
                any_grad = True
        if any_grad:
            with record_function("funcopt::zero_overlap/bucket_step"), torch.no_grad():
                self.local.step(local_grads)
        self.buckets_stepped += 1

    # ----------------------------------------------------------- the sync
    def _plan(self, params: List[int]) -> List[Tuple[int, List[Tuple[int, int, int]]]]:
        """Per owner rank: the (param, start, length) ranges of ``params`` it owns."""
        key = tuple(params)
        plan = self._plans.get(key)
        if plan is None:
            wanted = set(params)
            plan = []
            for r in range(self.world):
                pieces = [(s.param, s.start, s.length) for s in self.all_segments[r] if s.param in wanted]
                if pieces:
                    plan.append((r, pieces))
            self._plans[key] = plan
        return plan

    def start_sync(self, params: List[int]) -> None:
        """Broadcast every owner's updated ranges of ``params`` (async).  Collective, autograd thread."""
        sync = _Sync(params)
        for i in params:
            old = self.pending.get(i)
            if old is not None:
                old.wait()
        if self.world > 1:
            with record_function("funcopt::zero_overlap/start_sync"):
                for r, pieces in self._plan(params):
                    views = [self.homes[i][a: a + n] for i, a, n in pieces]
                    sizes = [n for _, _, n in pieces]
                    unpack = None
                    if r == self.rank:
                        buf = torch.cat(views) if len(views) > 1 else views[0].clone()
                    else:
                        buf = torch.empty(sum(sizes), dtype=views[0].dtype, device=views[0].device)
                        unpack = (views, list(torch.split(buf, sizes)))
                    src = r if self.group is None else dist.get_global_rank(self.group, r)
                    sync.flights.append(Flight(dist.broadcast(buf, src=src, group=self.group, async_op=True),
                                                unpack))
        for i in params:
            self.pending[i] = sync

    def launch_queued(self, keep_last: bool) -> None:
        """Start the syncs of stepped buckets (waiting for their steps), oldest first."""
        while len(self.queued) > (1 if keep_last else 0):
            fut, params = self.queued.pop(0)
            fut.wait()  # the step ran (re-raises its error)
            self.start_sync(params)

    def wait_params(self, params: Sequence[Tensor]) -> None:
        """Wait for the pending parameter syncs of ``params`` (a forward pre-hook calls this)."""
        for p in params:
            sync = self.pending.pop(self.index.get(id(p), -1), None)
            if sync is not None:
                sync.wait()

    def wait_all(self) -> None:
        """Finish everything in flight: queued steps, their syncs, pending unpacks."""
        queued, self.queued = self.queued, []
        error: Optional[BaseException] = None
        for fut, params in queued:
            try:
                fut.wait()
            except BaseException as e:  # a failed step: still start the sync the other ranks started
                error = error or e
            self.start_sync(params)
        for sync in list(self.pending.values()):
            sync.wait()
        self.pending.clear()
        if error is not None:
            raise error

    # ---------------------------------------------------- forward pre-hooks
    def hook_forward(self, module: torch.nn.Module, current: Callable[[], Optional["ZeroOverlap"]]) -> None:
        """Forward pre-hooks: on ``module`` (start the syncs still queued) and on every
        submodule holding parameters (wait for their sync).  ``current()`` gives the
        live :class:`ZeroOverlap` (rebuilt by ``add_param_group``); idempotent
        through ``hooked_modules``, which a rebuilt one inherits."""
        for m in module.modules():
            own = list(m.parameters(recurse=False))
            if not own or m in self.hooked_modules:
                continue
            self.hooked_modules.add(m)
            hook = _make_pre_hook(current, own)
            m.register_forward_pre_hook(hook)
            m.register_state_dict_pre_hook(hook)  # a checkpoint of the model waits too
        if module not in self.roots:
            self.roots.add(module)
            module.register_forward_pre_hook(lambda m, a: _root_pre_hook(current))


def _root_pre_hook(current: Callable[[], Optional[ZeroOverlap]]) -> None:
    ov = current()
    if ov is not None and ov.queued:
        ov.launch_queued(keep_last=False)


def _make_pre_hook(current: Callable[[], Optional[ZeroOverlap]], params: List[Tensor]) -> Callable:
    def pre_hook(module: Any, *args: Any) -> None:
        ov = current()
        if ov is not None and (ov.pending or ov.queued):
            if ov.queued:
                ov.launch_queued(keep_last=False)
            ov.wait_params(params)
    return pre_hook


def _used_flags(params: List[Tensor]) -> Tensor:
    return torch.tensor([p.grad is not None for p in params], dtype=torch.int32)


def _wait_at_end_of_backward(ov: ZeroOverlap) -> None:
    """Every parameter current when backward returns: wait for all the syncs in
    a callback at the end of this backward (on the autograd thread, after the
    work backward still had; bounded by the process group's timeout), or at
    once when the hook runs outside a backward (DDP's join shadow pass)."""
    def finish() -> None:
        with record_function("funcopt::zero_overlap/wait_sync"), torch.no_grad():
            ov.wait_all()

    if torch._C._current_graph_task_id() == -1:
        finish()
    else:
        torch.autograd.Variable._execution_engine.queue_callback(finish)


def _make(hook: Callable, ddp: Any, zero: Any, interleaved: bool, sync_in_forward: bool = False) -> Callable:
    if not getattr(zero, "overlap_with_ddp", False):
        raise ValueError("ZeroRedundancyOptimizer must be constructed with `overlap_with_ddp=True` to use this hook")
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"expected a DistributedDataParallel model, got {type(ddp).__name__}")
    zero._attach_overlap(ddp)
    find_unused = bool(ddp.find_unused_parameters)
    group = ddp.process_group

    def hook_with_zero_fn(state: Any, bucket):  # no annotation on bucket: DDP checks it
        ov: ZeroOverlap = zero._overlap
        first = bucket.index() == 0
        if first:
            ov.wait_all()  # a previous backward's leftovers (e.g. a forward that raised)
            ov.before_step()
        fut = hook(state, bucket)
        # parameters of the model the optimizer does not hold (as with DDP + an
        # optimizer over some of them) are all-reduced and left alone
        held = [(ov.index[id(p)], p, g) for p, g in zip(bucket.parameters(), bucket.gradients()) if id(p) in ov.index]
        params = [i for i, _, _ in held]
        grads = [g for _, _, g in held]
        futs = [fut]
        if find_unused:
            futs.append(dist.all_reduce(_used_flags([p for _, p, _ in held]), group=group,
                                        async_op=True).get_future())

        def step(f: torch.futures.Future) -> Tensor:
            results = f.value()
            reduced = results[0].value()
            used = results[1].value()[0].tolist() if len(results) > 1 else None
            ov.step_bucket(params, grads, used)
            return reduced

        stepped = torch.futures.collect_all(futs).then(step)
        ov.queued.append((stepped, params))
        if interleaved:
            ov.launch_queued(keep_last=True)  # the previous bucket's sync, behind this all-reduce
        if bucket.is_last():
            ov.launch_queued(keep_last=False)
            if not sync_in_forward:
                _wait_at_end_of_backward(ov)
        return stepped

    return hook_with_zero_fn


def hook_with_zero_step(hook: Callable, ddp: Any, zero: Any, shard_buckets: bool = False, *,
                        sync_in_forward: bool = False) -> Callable:
    """Wrap a DDP comm hook so that ZeRO steps and syncs each bucket inside backward.

    Same name and arguments as torch's
    ``torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook.hook_with_zero_step``
    and, by default, the same contract: when ``backward()`` returns, every
    parameter holds this iteration's update on every rank.  Unlike torch's,
    no iteration is skipped (torch's first two or three iterations wait for
    DDP's bucket rebuild and do not update), gloo is supported, any funcopt
    algorithm and any number of parameter groups.

    Each bucket's owned ranges step as soon as its all-reduce returns (on
    the thread that completed it, while backward goes on); the parameter
    syncs (one broadcast per owner and bucket) all start after the last
    bucket and are waited for at the end of backward (a callback queued on
    the autograd engine; each wait bounded by the process group's timeout).
    Prefer it when communication is slow next to computation;
    :func:`hook_with_zero_step_interleaved` starts each sync a bucket earlier,
    so more of it overlaps backward.

    Args:
      hook: the DDP comm hook averaging a bucket, e.g. ``allreduce_hook``
        (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``).
      ddp: the ``DistributedDataParallel`` model.
      zero: a :class:`ZeroRedundancyOptimizer` constructed with
        ``overlap_with_ddp=True`` over ``ddp.parameters()``.
      shard_buckets: accepted for torch compatibility; funcopt's flat
        partition already spreads every bucket over the ranks.
      sync_in_forward: (funcopt only, keyword) leave the syncs running after
        ``backward()`` returns and wait for them per module in the next
        forward of ``ddp`` (forward pre-hooks), so they also overlap the
        data loading and the start of the next forward.  Then, between
        ``backward()`` and the next forward, **do not read the parameters**:
        on the element ranges another rank owns they still hold the previous
        iteration's values (an EMA update, a norm, logging, ``torch.save``
        of ``p`` or of an optimizer-independent copy, a comparison with
        another model).  What waits for them: the next forward (each module
        for its own parameters), ``ddp.module.state_dict()`` or a
        submodule's (its own parameters), ``zero.wait_sync()``,
        ``zero.step()``, ``zero.zero_grad()``, ``consolidate_state_dict``,
        the next backward.  A forward that reads a parameter of a submodule
        it does not call must call ``zero.wait_sync()`` first.

    Returns:
      the hook to pass to ``ddp.register_comm_hook(None, ...)``.

    Example (each rank)::

        zero = ZeroRedundancyOptimizer(ddp.parameters(), funcopt.Adam, overlap_with_ddp=True, lr=1e-3)
        ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
        for x, y in loader:
            zero.zero_grad()
            loss_fn(ddp(x), y).backward()   # steps inside; no zero.step()
            ema.update(ddp.module)          # the parameters are current here
    """
    return _make(hook, ddp, zero, interleaved=False, sync_in_forward=sync_in_forward)


def hook_with_zero_step_interleaved(hook: Callable, ddp: Any, zero: Any, shard_buckets: bool = False, *,
                                    sync_in_forward: bool = False) -> Callable:
    """As :func:`hook_with_zero_step`, but each bucket's parameter sync starts
    from the next bucket's hook (interleaved with the remaining all-reduces)
    instead of after the last one: better when communication is fast next
    to computation.  Same arguments as torch's function of the same name,
    plus ``sync_in_forward`` (see :func:`hook_with_zero_step`: by default
    every parameter is current when ``backward()`` returns)."""
    return _make(hook, ddp, zero, interleaved=True, sync_in_forward=sync_in_forward)
