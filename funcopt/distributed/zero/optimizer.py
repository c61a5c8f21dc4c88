"""ZeroRedundancyOptimizer: optimizer state (ZeRO-1) and gradients (ZeRO-2) sharded over ranks.

Each rank owns a part of every dtype's flat parameter space (see
:mod:`funcopt.distributed.zero.layout`), runs a scripted funcopt optimizer over
views of just that part, and bucketed broadcasts bring every rank's
updated part to every rank.  The update rule is never reimplemented here: the
local optimizer is the registry's funcopt class, over its shard.

This module is the optimizer only; the jobs it composes live next to it:
the partition (``layout``), the parameter homes and sync (``_sync.ParamSync``),
ZeRO-2's gradient shards (``_grads.GradShards``), the sharded state
(``state.ShardState``) and the checkpoints (``checkpoint``).
"""
from __future__ import annotations

import functools

import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.profiler import record_function

from ... import _hyper, registry
from ... import state_format
from .. import _comm, _local
from . import _clip, checkpoint, forward_sync
from ._grads import GradShards
from ._sync import ParamSync
from .overlap import ZeroOverlap
from .layout import PARTITIONS, Layout, Segment, make_layout
from .state import Piece, ShardState, cut_problem, hyperparameters

_NOT_HYPER = state_format.NON_HYPER


def _norm(v: Any) -> Any:
    """A hyperparameter value as a plain, picklable, rank-independent description."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list)):
        return tuple(_norm(x) for x in v)
    if isinstance(v, Tensor):
        return ("tensor", str(v.dtype), v.tolist() if v.numel() <= 16 else tuple(v.shape))
    return type(v).__qualname__


class _ZeroJoinHook(JoinHook):
    """A joined rank keeps stepping (its shard update and the parameter sync) until all ranks join."""

    def __init__(self, zero: "ZeroRedundancyOptimizer"):
        self.zero = zero
        super().__init__()

    def main_hook(self) -> None:
        self.zero.step()


def _call(ref: Any, method: str, *args: Any) -> None:
    zero = ref()
    if zero is not None:
        getattr(zero, method)(*args)


_EAGER_TOO = ("; or any other torch.optim.Optimizer subclass whose update is per parameter "
              "(run eagerly over each rank's whole parameters, partition='greedy')")


class ZeroRedundancyOptimizer(torch.optim.Optimizer, Joinable):
    r"""Shard optimizer state (and optionally gradients) over the ranks of a process group.

    A drop-in for ``torch.distributed.optim.ZeroRedundancyOptimizer``: same
    constructor, ``step(closure=None, **kwargs)`` reading ``p.grad`` (after
    DDP's all-reduce), ``optim`` (this rank's local optimizer),
    ``param_groups`` that LR schedulers drive, ``add_param_group``,
    ``consolidate_state_dict(to)``, ``state_dict()``, ``load_state_dict()``,
    ``join_hook()`` for uneven inputs (``torch.distributed.algorithms.join.Join``).

    Args:
      params: tensors or param-group dicts, identical on every rank.
      optimizer_class: a funcopt class or the matching ``torch.optim`` class
        (mapped through the registry: the shard steps through the funcopt
        core, scripted, fused where available; eagerly, with one
        ``EagerFallbackWarning``, where this torch cannot script), or any other
        ``torch.optim.Optimizer`` subclass whose update is per parameter
        (run eagerly over this rank's whole parameters, as torch does).
        ``torch.optim.LBFGS`` and ``torch.optim.SparseAdam`` (and their
        subclasses) raise ``TypeError`` here, on every rank, before any
        collective: per shard they would not be that algorithm on the model.
      process_group: default: the world.
      parameters_as_bucket_view: make ``p.data`` views into one flat buffer
        per dtype, so the sync writes straight into the parameters
        (non-contiguous parameters keep their strides and are copied).
      overlap_with_ddp: step inside DDP's backward: register
        ``hook_with_zero_step`` (or ``_interleaved``) from
        :mod:`funcopt.distributed.zero.overlap` as the DDP comm hook; each
        bucket's owned ranges step as its all-reduce returns and, as with
        torch's, every parameter is current when ``backward()`` returns (the
        hook's ``sync_in_forward=True`` defers that to the next forward); no
        iteration is skipped, and ``step()`` is then a no-op (ZeRO-1, funcopt
        algorithms only).
      partition: ``"flat"`` (even contiguous ranges; the default for funcopt
        algorithms) or ``"greedy"`` (torch's whole-parameter partition; the
        default, and the only choice, for other optimizer classes).
      zero_stage: ``1`` (gradients all-reduced by DDP) or ``2``: gradients are
        reduce-scattered in buckets during backward (hooks on gradient
        accumulation); no DDP.  After backward each rank holds only its shard;
        ``torch.amp.GradScaler`` unscales the shards and skips a step with
        inf/NaN gradients on every rank.
      bucket_size_mb: parameter-sync / reduce-scatter bucket size (default 25).
      **defaults: hyperparameters of ``optimizer_class``, the same on every rank.

    Usage::

        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        model = DDP(build_model())
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
        loss_fn(model(x)).backward(); opt.step()
        opt.consolidate_state_dict(to=0)
        if dist.get_rank() == 0:
            torch.save(opt.state_dict(), "opt.pt")

    .. warning:: collective: construct it, ``step``, ``add_param_group``,
       ``consolidate_state_dict``, ``load_state_dict`` and the sharded
       checkpoint calls on every rank of the group, in the same order.
       Construction and ``add_param_group`` check that every rank passed the
       same parameters and hyperparameters (``DistributedError`` naming the
       difference, on every rank).
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type,
        process_group: Any = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        *,
        partition: Optional[str] = None,
        zero_stage: int = 1,
        bucket_size_mb: int = 25,
        **defaults: Any,
    ):
        if overlap_with_ddp and zero_stage != 1:
            raise ValueError("overlap_with_ddp=True is ZeRO-1 with DDP's all-reduce; zero_stage=2 "
                             "reduce-scatters its own gradients (use one or the other)")
        if zero_stage not in (1, 2):
            raise ValueError(f"zero_stage must be 1 or 2, got {zero_stage}")
        # LBFGS / SparseAdam: refused here, on every rank alike, before any collective
        registry.refuse_out_of_scope(optimizer_class, "ZeroRedundancyOptimizer", also=_EAGER_TOO)
        try:
            self.spec: Optional[registry.AlgorithmSpec] = registry.get(optimizer_class)
        except KeyError:
            if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
                raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass or a funcopt "
                                f"algorithm, got {optimizer_class!r}") from None
            self.spec = None  # run eagerly, as torch's ZeroRedundancyOptimizer does
        if partition is None:  # algorithms that need whole parameters (Adafactor, Muon): greedy
            partition = "flat" if self.spec is not None and not self.spec.whole_params else "greedy"
        if partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}")
        if self.spec is None and partition != "greedy":
            raise ValueError(
                f"partition={partition!r} cuts parameters into element ranges, which only funcopt's "
                f"algorithms ({', '.join(registry.REGISTRY)}) can step; {optimizer_class.__qualname__} "
                "runs eagerly over whole parameters: use partition='greedy'")
        if overlap_with_ddp and self.spec is not None and (self.spec.cls.group_state or self.spec.cls.phases != 1):
            raise ValueError(
                f"overlap_with_ddp steps each DDP bucket's parameters separately inside backward, but "
                f"{self.spec.name} keeps per-group counters (and Prodigy sums over every parameter) that "
                f"advance once per step: use overlap_with_ddp=False (ZeRO-1/2 step after backward)")
        if self.spec is not None and self.spec.whole_params and partition != "greedy":
            raise ValueError(
                f"partition={partition!r} cuts parameters into element ranges, but {self.spec.name}'s update "
                "needs each parameter whole: use partition='greedy' (its default)")
        self.optimizer_class = optimizer_class
        self.process_group = process_group
        self.rank, self.world_size = _comm.rank_and_size(process_group)
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self.partition = partition
        self.zero_stage = zero_stage
        self.bucket_size_mb = bucket_size_mb
        self.overlap_with_ddp = overlap_with_ddp
        self._overlap: Optional[ZeroOverlap] = None
        self._overlap_ddp: Any = None
        self._forward_syncs = 0  # sync_in_forward handles not removed: step() leaves the sync running
        self._has_state = False  # a step or a load happened (the same on every rank)
        self._state_shown: Any = None  # what self.state was last built from
        self._optim_defaults = dict(defaults)
        # validates the hyperparameters with the class's own errors and fills its defaults
        if self.spec is not None:
            probe = self.spec.cls([torch.zeros(self.spec.probe_shape, requires_grad=True)], **defaults)
            self._impl = probe.impl
        else:
            probe = optimizer_class([torch.zeros(1, requires_grad=True)], **defaults)
        self._state: Optional[ShardState] = None
        self._grads: Optional[GradShards] = None
        self._all_state_dicts: Optional[Dict[str, Any]] = None
        self._consolidated = False  # consolidate_state_dict ran since the last step (every rank)
        torch.optim.Optimizer.__init__(self, params, dict(probe.defaults))
        Joinable.__init__(self)
        # torch.amp.GradScaler hands itself to step() (grad_scaler=) when this is set: ZeRO-2
        # gradients live in shards that only the optimizer can unscale and check
        self._step_supports_amp_scaling = zero_stage == 2
        self._rebuild(carry_state=False)

    # ----------------------------------------------------------- structure
    @property
    def optim(self) -> torch.optim.Optimizer:
        """This rank's local optimizer (over the parameters, or element ranges, it owns)."""
        return self._state.optim if self._state is not None else None

    @property
    def _all_params(self) -> List[Tensor]:  # torch's name; its tests and join hooks read it
        return self._params()

    @property
    def _eager(self) -> bool:
        return self.spec is None

    @property
    def scripted(self) -> bool:
        """Whether the local optimizer is a scripted funcopt optimizer (``False``: a
        ``torch.optim`` class run eagerly, or a funcopt one where this torch cannot script)."""
        return self._scripted

    def _params(self) -> List[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def algorithm(self) -> str:
        """The registry name of the algorithm, or ``module.Class`` of an optimizer class run eagerly."""
        if self.spec is not None:
            return self.spec.name
        return f"{self.optimizer_class.__module__}.{self.optimizer_class.__qualname__}"

    def owned_ranges(self) -> List[Tuple[int, int, int]]:
        """``(param, start, length)`` element ranges this rank owns, ``param`` indexing the
        parameters in ``param_groups`` order, ordered by (param, start).  Local."""
        return [(s.param, s.start, s.length) for s in self._segments]

    def _describe(self) -> Dict[str, Any]:
        """What every rank must agree on (compared by digest, explained on mismatch)."""
        return dict(
            optimizer=self.algorithm(), partition=self.partition, zero_stage=self.zero_stage,
            parameters_as_bucket_view=self.parameters_as_bucket_view,
            params=[[(tuple(p.shape), str(p.dtype), str(p.layout)) for p in g["params"]] for g in self.param_groups],
            hyperparameters=[{k: _norm(v) for k, v in sorted(g.items()) if k not in _NOT_HYPER}
                             for g in self.param_groups])

    def _rebuild(self, carry_state: bool) -> None:
        """(Re)compute the layout, homes, local optimizer and gradient shards.  Collective."""
        with record_function("funcopt::zero/partition"):
            _comm.check_same(self._describe(), self.process_group, "ZeroRedundancyOptimizer")
            params = self._params()
            for p in params:  # the same on every rank now
                if p.layout != torch.strided:
                    raise ValueError(f"ZeroRedundancyOptimizer supports dense (strided) parameters only, got {p.layout}")
            pieces = self._gather_pieces() if carry_state else None
            if getattr(self, "_sync", None) is not None:
                self._sync.wait_all()
            layout = make_layout(
                [p.numel() for p in params], [p.dtype for p in params],
                [len(g["params"]) for g in self.param_groups], self.world_size, self.partition)
            if not self._eager:  # judged on every rank over every rank's segments: one verdict
                problem = cut_problem(self.spec.cls, [s for r in range(self.world_size)
                                                      for s in layout.segments(r)], params, self.param_groups)
                if problem is not None:
                    raise ValueError(problem)
            self.layout: Layout = layout
            self._segments: List[Segment] = self.layout.segments(self.rank)
            self._sync = ParamSync(params, self.layout, self.rank, self.process_group,
                                   self.parameters_as_bucket_view, self.bucket_size_mb)
            self._state = ShardState(self._segments, params, self.param_groups, self._sync.homes,
                                     self._sync.shadowed, self._make_local, self._eager)
            if pieces is not None:
                self._state.commit(self._state.stage(pieces))
            if self._grads is not None:
                self._grads.remove()
                self._grads = None
            if self.zero_stage == 2:
                self._grads = GradShards(params, self.layout, self.rank, self.process_group, self.bucket_size_mb)
            if self._overlap_ddp is not None:
                self._build_overlap()
            self._show_state()

    def _show_state(self, has_state: bool = False, force: bool = True) -> None:
        """``self.state`` once stepped or loaded (on every rank alike: torch's DCP helpers
        step an optimizer whose ``state`` is empty, collectively); see ``ShardState.view``."""
        self._has_state = self._has_state or has_state
        # a step (force=False) rebuilds it only when the local state gained entries
        key = (id(self._state), len(self._state.optim.state))
        if self._has_state and (force or key != self._state_shown):
            self.state = self._state.view(self._params())
            self._state_shown = key

    # ------------------------------------------------------------- overlap
    def _attach_overlap(self, ddp: Any) -> None:
        """Called by ``overlap.hook_with_zero_step``: build the per-bucket step and sync."""
        if self.spec is None:
            raise ValueError(f"overlap_with_ddp steps element ranges inside backward, which only funcopt's "
                             f"algorithms can; {self.algorithm()} cannot (use a funcopt class)")
        if self._sync.shadowed:
            raise ValueError("overlap_with_ddp: non-contiguous parameters (channels_last, transposed) are not "
                             "supported; make them contiguous")
        self._overlap_ddp = ddp
        self._build_overlap()

    def _build_overlap(self) -> None:
        old = self._overlap
        if old is not None:
            old.wait_all()
        params = self._params()

        def before_step() -> None:
            self._sync_groups(self.param_groups, self._state.optim.param_groups)

        self._overlap = ZeroOverlap(self._segments, [self.layout.segments(r) for r in range(self.world_size)],
                                    params, self._sync.homes, self._state.optim, self._state.local_shapes,
                                    before_step, self.process_group, self.rank, self.world_size)
        if old is not None:  # the hooks placed read the live one through `current`
            self._overlap.hooked_modules, self._overlap.roots = old.hooked_modules, old.roots
        ref = weakref.ref(self)
        self._overlap.hook_forward(self._overlap_ddp.module, lambda: getattr(ref(), "_overlap", None))

    def _make_local(self, groups: List[Dict[str, Any]]) -> Any:
        if self._eager:
            self._scripted = False
            return self.optimizer_class(groups, **self._optim_defaults)
        opt, self._scripted = _local.scripted_or_eager(lambda: self.spec.cls(groups, impl=self._impl),
                                                       "ZeroRedundancyOptimizer")
        if self.spec.cls.phases == 2:  # Prodigy: its sums run over every rank's shard
            opt.sum_partials = functools.partial(_comm.all_sum, group=self.process_group)
        return opt

    @staticmethod
    def _sync_groups(src: List[Dict[str, Any]], dst: List[Dict[str, Any]]) -> None:
        """Copy every hyperparameter (not ``params``) of ``src``'s groups to ``dst``'s."""
        for a, b in zip(src, dst):
            for k, v in a.items():
                if k not in _NOT_HYPER and b.get(k) is not v:
                    b[k] = v

    # ----------------------------------------------------------------- step
    def step(self, closure: Optional[Callable[[], float]] = None, *, grad_scaler: Any = None,
             **kwargs: Any) -> Optional[float]:
        """Update this rank's shard, then bring every shard to every rank.  Collective.

        ``closure`` and ``kwargs`` as in torch (an eager local optimizer gets
        them as torch's ZeroRedundancyOptimizer passes them).  ``grad_scaler``:
        passed by ``torch.amp.GradScaler.step`` under ZeRO-2 (do not pass it
        yourself): the gradient shards are unscaled and a step with inf/NaN
        gradients on any rank is skipped on every rank.
        """
        if self.overlap_with_ddp:
            if self._overlap is None:
                raise RuntimeError("ZeroRedundancyOptimizer(overlap_with_ddp=True): register the DDP comm hook "
                                   "ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero)); "
                                   "the step then runs inside backward")
            # as torch's: the step already ran inside backward; step() only finishes the syncs
            self._overlap.wait_all()
            self._show_state(has_state=True, force=False)
            return closure() if closure is not None else None
        Join.notify_join_context(self)
        if grad_scaler is not None and self.zero_stage != 2:
            raise ValueError("grad_scaler= is for zero_stage=2; with zero_stage=1 GradScaler unscales p.grad itself")
        if self.zero_stage == 2 and grad_scaler is None and getattr(self, "found_inf", None) is not None:
            raise RuntimeError(
                "ZeRO-2 with torch.amp.GradScaler: the scaler must reach ZeroRedundancyOptimizer.step as "
                "grad_scaler= (a subclass overriding step() must accept and forward grad_scaler)")
        self._sync.wait_all()  # a sync still running (sync_in_forward, a forward that raised)
        params = self._params()
        local = self._state.optim
        loss = None
        if self.zero_stage == 2 or not self._eager:
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            closure = None
            grads = self._collect_grads(params)
            if self._grads is not None and grad_scaler is not None and self._grads.unscale(grad_scaler, id(self)):
                return loss  # inf/NaN gradients on some rank: every rank skips the step
        with record_function("funcopt::zero/local_step"):
            if self._eager:
                out = self._eager_local_step(closure, grads if self.zero_stage == 2 else None, kwargs)
                loss = out if loss is None else loss
            else:
                with torch.no_grad():
                    self._sync.refresh_mine(params)
                    self._sync_groups(self.param_groups, local.param_groups)
                    local.step(grads, **kwargs)  # checks the hyperparameters first: refused, nothing stepped
                    self._state.note_groups()
                    _comm.group_state_back(local, self.param_groups)  # step counters, d... (the same on every rank)
        # a consolidated state is of the past now (not before: a refused step changes nothing)
        self._consolidated, self._all_state_dicts = False, None
        with record_function("funcopt::zero/sync_params"), torch.no_grad():
            if self._forward_syncs:  # waited for per module by the next forward
                self._sync.start(params, updated_in_place=self._eager)
            else:
                self._sync.sync(params, updated_in_place=self._eager)
        self._show_state(has_state=True, force=False)
        return loss

    # -------------------------------------------------------- train / eval
    def train(self) -> None:
        """Train mode (Schedule-Free: the parameters become the interpolated point y).
        Each rank swaps its shard, then every rank gets every shard.  Collective.  A
        no-op for algorithms without modes (frameworks call it whenever it exists)."""
        self._set_mode(True)

    def eval(self) -> None:
        """Eval mode (Schedule-Free: the parameters become the average x); see :meth:`train`."""
        self._set_mode(False)

    def _set_mode(self, train: bool) -> None:
        if self.spec is None or not self.spec.cls.has_modes:
            return
        if self.overlap_with_ddp and self._overlap is not None:
            self._overlap.wait_all()
        self._sync.wait_all()
        params = self._params()
        local = self._state.optim
        with record_function("funcopt::zero/mode"), torch.no_grad():
            self._sync.refresh_mine(params)
            local.train() if train else local.eval()
            _comm.group_state_back(local, self.param_groups)
            self._sync.sync(params, updated_in_place=False)
        self._consolidated, self._all_state_dicts = False, None

    # ------------------------------------------------------ sync in forward
    def sync_in_forward(self, module: torch.nn.Module) -> Any:
        """Let the parameter sync after :meth:`step` run behind the next forward.

        ``step()`` then returns once its broadcasts are issued, and each
        submodule of ``module`` holding parameters waits, in a forward
        pre-hook, for just the broadcasts that write them (same collectives,
        same numbers as the plain sync); so does each submodule's
        ``state_dict()``.  ``step``, ``zero_grad``, the state and checkpoint
        calls and :meth:`wait_sync` wait for all of it.  A forward reading
        parameters of a submodule it does not call must call
        :meth:`wait_sync` first.  Returns a handle; ``handle.remove()``
        restores the plain sync.  Call it on every rank.

        Example (each rank)::

            zero = ZeroRedundancyOptimizer(ddp.parameters(), funcopt.AdamW, lr=1e-3)
            zero.sync_in_forward(ddp)
            for x, y in loader:
                zero.zero_grad()
                loss_fn(ddp(x), y).backward()
                zero.step()          # returns before the parameters arrive
        """
        if self.overlap_with_ddp:
            raise ValueError("sync_in_forward: with overlap_with_ddp=True the parameter sync runs inside "
                             "backward; to wait for it in the next forward instead, pass sync_in_forward=True "
                             "to hook_with_zero_step / hook_with_zero_step_interleaved")
        ref = weakref.ref(self)

        def on_remove() -> None:
            zero = ref()
            if zero is not None:
                zero._forward_syncs -= 1
                zero.wait_sync()

        handle = forward_sync.install(module, self._params(), lambda own: _call(ref, "wait_params", own), on_remove)
        self._forward_syncs += 1
        return handle

    def wait_params(self, params: List[Tensor]) -> None:
        """Wait for the parts of a running parameter sync that write ``params`` (the
        forward pre-hooks of :meth:`sync_in_forward` call this).  Local."""
        if self._sync.pending:
            with record_function("funcopt::zero/wait_sync"), torch.no_grad():
                self._sync.wait_params(params)

    def wait_sync(self) -> None:
        """Wait for a parameter sync still running (:meth:`sync_in_forward`, or the
        overlapped step of ``overlap_with_ddp`` with the hook's
        ``sync_in_forward=True``).  Local: each rank waits for its own receives."""
        if self._overlap is not None:
            self._overlap.wait_all()
        with torch.no_grad():
            self._sync.wait_all()

    def _collect_grads(self, params: List[Tensor]) -> List[Optional[Tensor]]:
        """One gradient per local segment, shaped like its local tensor (contiguous)."""
        with torch.no_grad():
            shapes = self._state.local_shapes
            if self._grads is not None:
                return self._grads.grads(self._segments, shapes)
            out: List[Optional[Tensor]] = []
            for s, shape in zip(self._segments, shapes):
                g = params[s.param].grad
                if g is None:
                    out.append(None)
                elif shape is not None:  # whole: the local tensor is contiguous
                    out.append(g if g.layout != torch.strided or g.is_contiguous() else g.contiguous())
                else:
                    dense = g if g.layout == torch.strided else g.to_dense()
                    out.append(dense.reshape(-1)[s.start: s.start + s.length])
            return out

    def _eager_local_step(self, closure: Optional[Callable[[], float]], grads: Optional[List[Optional[Tensor]]],
                          kwargs: Dict[str, Any]) -> Any:
        """Step a torch.optim-style local optimizer as torch's ZeRO does: hyperparameters
        synced both ways, ``closure``/``kwargs`` passed on.  ZeRO-2: the gradient shards
        are lent to the owned parameters' ``.grad`` for the step."""
        local, tensors = self._state.optim, self._state.tensors
        if grads is not None:
            for t, g in zip(tensors, grads):
                t.grad = g
        self._sync_groups(self.param_groups, local.param_groups)
        try:
            loss = local.step(**kwargs) if closure is None else local.step(closure=closure, **kwargs)
        finally:
            if grads is not None:
                for t in tensors:
                    t.grad = None
        self._sync_groups(local.param_groups, self.param_groups)
        with torch.no_grad():
            self._sync.refresh_mine(self._params())  # the eager step updated the parameter itself
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; ZeRO-2 also drops the gradient shards."""
        self.wait_sync()  # nothing left pending (e.g. after a forward that raised)
        super().zero_grad(set_to_none)
        if self._grads is not None:
            self._grads.clear()

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the gradients by their global norm over every rank; returns the norm
        before clipping (fairscale OSS's method).  Collective: call it on every rank
        after backward, before :meth:`step`.

        Each rank takes the norm of the gradient it owns (ZeRO-2: its shards) and
        one all-reduce combines them; each rank then scales what it holds by
        ``min(1, max_norm / (total + 1e-6))``.  Same result as
        ``torch.nn.utils.clip_grad_norm_`` over the unsharded gradients (to
        rounding).  ``norm_type``: ``p > 0`` or ``float('inf')``."""
        if self._overlap is not None:
            raise RuntimeError("clip_grad_norm with overlap_with_ddp=True: each bucket steps as its all-reduce "
                               "returns, before the global norm is known")
        return _clip.clip_grad_norm(self, max_norm, norm_type)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        return self._state.nbytes()

    def grad_shard_bytes(self) -> int:
        """Bytes of gradient this rank holds (ZeRO-2: its shard only)."""
        own = self._grads.nbytes() if self._grads is not None else 0
        return own + sum(p.grad.numel() * p.grad.element_size() for p in self._params() if p.grad is not None)

    # ----------------------------------------------------------------- join
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """For ``torch.distributed.algorithms.join.Join``: a joined rank keeps taking
        part in the steps of the others (its gradients must be set, e.g. to zero,
        as torch's).  ZeRO-1 only: ZeRO-2's reduce-scatters run inside backward."""
        if self.zero_stage == 2:
            raise NotImplementedError("Join (uneven inputs) with zero_stage=2: the reduce-scatters run "
                                      "during backward, which a joined rank does not run")
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._params()[0].device

    @property
    def join_process_group(self) -> Any:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    # ------------------------------------------------------------ param groups
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a group (collective); the partition is recomputed and state moves with it."""
        super().add_param_group(param_group)
        if self._state is not None:
            try:
                if self.spec is not None:  # its hyperparameters, before the partition changes
                    _hyper.validate(self.spec.cls, self.param_groups[-1])
                self._rebuild(carry_state=True)  # checks agreement before changing anything
            except Exception:
                del self.param_groups[-1]
                raise

    # ------------------------------------------------------------------ state
    # the public surface of the sharded state, for funcopt.distributed.zero.checkpoint
    def shard_state(self) -> List[Tuple[int, int, int, Dict[str, Tensor]]]:
        """This rank's optimizer state as ``(param, start, length, {name: tensor})`` pieces.

        ``param`` indexes the parameters in ``param_groups`` order; the tensors
        are flat ranges ``[start, start + length)`` of the flattened parameter's
        state (0-d tensors, such as ``step``, whole).  Local, no communication.
        """
        self.wait_sync()
        return self._state.flat_pieces()

    def stage_shard_state(self, pieces: List[Tuple[int, int, int, Dict[str, Tensor]]],
                          param_groups: List[Dict[str, Any]]) -> Any:
        """Check pieces covering this rank's ranges (as :meth:`shard_state` gives them) and the
        hyperparameters of ``param_groups``; returns what :meth:`commit_shard_state` applies.
        Changes nothing; raises ``ValueError`` (or the core's error) on bad input.  Local."""
        if len(param_groups) != len(self.param_groups):
            raise ValueError(f"{len(param_groups)} param groups given, optimizer has {len(self.param_groups)}")
        hyper = [hyperparameters(g) for g in param_groups]
        return hyper, self._state.stage(pieces, hyper)

    def commit_shard_state(self, staged: Any) -> None:
        """Apply what :meth:`stage_shard_state` returned.  Local."""
        hyper, local = staged
        self.wait_sync()
        for group, h in zip(self.param_groups, hyper):
            group.update(h)
        self._state.commit(local)
        self._show_state(has_state=True)

    def _gather_pieces(self) -> List[Piece]:
        return [piece for part in _comm.all_gather_object(self._state.pieces(), self.process_group) for piece in part]

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full torch.optim-format state on rank ``to``, one shard at a time.  Collective."""
        self.wait_sync()
        with record_function("funcopt::zero/consolidate"):
            mine = self._state.pieces()
            if self.rank == to:
                pieces = list(mine)
                for r in range(self.world_size):
                    if r != to:
                        pieces.extend(_comm.recv_object(r, self.process_group))
                self._all_state_dicts = self._state.full_state(pieces, self.param_groups)
            else:
                _comm.send_object(mine, to, self.process_group)
                self._all_state_dicts = None
        self._consolidated = True

    def save_sharded(self, path: str) -> None:
        """Each rank writes its own shard under directory ``path``.  Collective.

        See :mod:`funcopt.distributed.zero.checkpoint`; loads at any world size
        with :meth:`load_sharded`.
        """
        checkpoint.save_sharded(self, path)

    def load_sharded(self, path: str) -> None:
        """Load a :meth:`save_sharded` checkpoint from any world size.  Collective."""
        checkpoint.load_sharded(self, path)

    def state_dict(self) -> Dict[str, Any]:
        """The whole state in the torch.optim format.

        After :meth:`consolidate_state_dict` (and before the next step): the
        consolidated state on the rank it went to; other ranks raise, as torch's.
        Otherwise (torch's ZeRO raises) it is collective: every rank gathers every
        shard and returns the whole state, so ``torch.distributed.checkpoint``'s
        ``get_state_dict`` / ``dcp.save`` (which call it on every rank and write
        replicated values once), ``set_state_dict`` and :meth:`load_state_dict` work.
        That holds the whole state on every rank for the moment; for large models
        :meth:`save_sharded` / :meth:`load_sharded` move each rank's shard only."""
        if self._consolidated and self._all_state_dicts is None:
            raise RuntimeError(
                f"Optimizer state has not been consolidated on this rank. Please call "
                f"`consolidate_state_dict(to={self.rank})` on all ranks beforehand if you meant to save the global state."
            )
        if self._all_state_dicts is None:
            self.wait_sync()
            with record_function("funcopt::zero/gather_state_dict"):
                return self._state.full_state(self._gather_pieces(), self.param_groups)
        return self._all_state_dicts

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a full torch.optim-format state dict (from any world size).  Collective.

        Every rank checks its part; if any rank finds a problem, every rank
        raises and nothing changes anywhere.
        """
        self.wait_sync()
        error, staged = None, None
        try:
            staged = self._state.stage_full(state_dict, self.param_groups)
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            error = f"{type(e).__name__}: {e}"
        # typed: where every failing rank refused with a ValueError (TypeError: a hyperparameter of the
        # wrong type, funcopt/_hyper.py), the error on every rank is also one
        _comm.agree(error, self.process_group, "ZeroRedundancyOptimizer.load_state_dict", typed=True)
        assert staged is not None
        groups, local_staged = staged
        for group, saved in zip(self.param_groups, groups):
            for k, v in saved.items():
                if k not in _NOT_HYPER:
                    group[k] = v
        self._state.commit(local_staged)
        self._show_state(has_state=True)
