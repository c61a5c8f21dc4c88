"""ZeroRedundancyOptimizer: optimizer state (ZeRO-1) and gradients (ZeRO-2) sharded over ranks.

Each rank owns a part of every dtype's flat parameter space (see
:mod:`funcopt.distributed.layout`), runs a scripted funcopt optimizer over
views of just that part, and bucketed broadcasts bring every rank's
updated part to every rank.  The update rule is never reimplemented here: the
local optimizer is the registry's funcopt class, over its shard.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

from .. import registry
from ..script import script
from . import _comm, checkpoint
from .bucketer import ReduceScatterBucketer
from .layout import Layout, Segment, chunks, make_layout


def _align(nbytes: int) -> int:
    return (nbytes + 15) // 16 * 16


def _flat(t: Tensor) -> Tensor:
    if not t.is_contiguous():
        raise ValueError("ZeroRedundancyOptimizer needs contiguous parameters")
    return t.view(-1)


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    r"""Shard optimizer state (and optionally gradients) over the ranks of a process group.

    A drop-in for ``torch.distributed.optim.ZeroRedundancyOptimizer``: same
    constructor, ``step(closure=None)`` reading ``p.grad`` (after DDP's
    all-reduce), ``param_groups`` that LR schedulers drive, ``add_param_group``,
    ``consolidate_state_dict(to)``, ``state_dict()``, ``load_state_dict()``.

    Args:
      params: tensors or param-group dicts, identical on every rank.
      optimizer_class: a funcopt class or the matching ``torch.optim`` class
        (mapped through the registry); the shard always steps through the
        funcopt core, scripted, fused where available.
      process_group: default: the world.
      parameters_as_bucket_view: make ``p.data`` views into one flat buffer
        per dtype, so the sync writes straight into the parameters.
      overlap_with_ddp: not supported yet (raises ``NotImplementedError``).
      partition: ``"flat"`` (even contiguous ranges, default) or ``"greedy"``
        (torch's whole-parameter partition).
      zero_stage: ``1`` (gradients all-reduced by DDP) or ``2``: gradients are
        reduce-scattered in buckets during backward (hooks on gradient
        accumulation); no DDP.  After backward each rank holds only its shard.
      bucket_size_mb: parameter-sync / reduce-scatter bucket size (default 25).
      **defaults: hyperparameters of ``optimizer_class``.

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
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type,
        process_group: Any = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        *,
        partition: str = "flat",
        zero_stage: int = 1,
        bucket_size_mb: int = 25,
        **defaults: Any,
    ):
        if overlap_with_ddp:
            raise NotImplementedError("overlap_with_ddp=True lands with the optimizer-in-backward work")
        if zero_stage not in (1, 2):
            raise ValueError(f"zero_stage must be 1 or 2, got {zero_stage}")
        self.spec = registry.get(optimizer_class)
        self.optimizer_class = optimizer_class
        self.process_group = process_group
        self.rank, self.world_size = _comm.rank_and_size(process_group)
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self.partition = partition
        self.zero_stage = zero_stage
        self.bucket_size_mb = bucket_size_mb
        probe = self.spec.cls([torch.zeros(1, requires_grad=True)], **defaults)  # validates, fills defaults
        self._impl = probe.impl
        self._local: Any = None
        self._all_state_dicts: Optional[Dict[str, Any]] = None
        self._hooks: List[Any] = []
        super().__init__(params, dict(probe.defaults))
        self._rebuild(carry_state=False)

    # ----------------------------------------------------------- structure
    def _params(self) -> List[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _describe(self) -> List[Any]:
        return [[(tuple(p.shape), str(p.dtype)) for p in g["params"]] for g in self.param_groups]

    def _rebuild(self, carry_state: bool) -> None:
        """(Re)compute the layout and the local optimizer.  Collective."""
        with record_function("funcopt::zero/partition"):
            _comm.check_same((self._describe(), self.partition, self.zero_stage, self.spec.name),
                             self.process_group, "ZeroRedundancyOptimizer parameter set")
            pieces = self._gather_pieces() if carry_state else None
            params = self._params()
            self.layout: Layout = make_layout(
                [p.numel() for p in params], [p.dtype for p in params],
                [len(g["params"]) for g in self.param_groups], self.world_size, self.partition)
            self._segments: List[Segment] = self.layout.segments(self.rank)
            if self.parameters_as_bucket_view:
                self._make_bucket_views(params)
            self._build_local(params)
            if pieces is not None:
                self._load_pieces(pieces)
            self._plan_sync()
            if self.zero_stage == 2:
                self._setup_zero2(params)

    def _make_bucket_views(self, params: List[Tensor]) -> None:
        self._buffers: Dict[str, Tensor] = {}
        for key, space in self.layout.spaces.items():
            buf = torch.empty(self.world_size * space.shard, dtype=space.dtype, device=self._device(params, space))
            placed = set()
            for r, segs in enumerate(space.ranks):
                for s in segs:
                    if s.param not in placed:
                        placed.add(s.param)
                        p = params[s.param]
                        at = r * space.shard + s.offset - s.start
                        view = buf[at: at + p.numel()].view_as(p)
                        view.copy_(p.detach())
                        p.data = view
            self._buffers[key] = buf

    @staticmethod
    def _device(params: List[Tensor], space: Any) -> torch.device:
        for segs in space.ranks:
            for s in segs:
                return params[s.param].device
        return torch.device("cpu")

    def _build_local(self, params: List[Tensor]) -> None:
        groups: List[Dict[str, Any]] = []
        gid = [g for g, group in enumerate(self.param_groups) for _ in group["params"]]
        for g, group in enumerate(self.param_groups):
            hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            groups.append(dict(hyper, params=[]))
        for s in self._segments:
            groups[gid[s.param]]["params"].append(_flat(params[s.param].detach())[s.start: s.start + s.length])
        self._local_gid = [gid[s.param] for s in self._segments]
        self._local = script(self.spec.cls(groups, impl=self._impl))

    def _sync_hyper(self) -> None:
        for group, local in zip(self.param_groups, self._local.param_groups):
            for k, v in group.items():
                if k not in ("params", "param_names") and local.get(k) is not v:
                    local[k] = v

    # ----------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, **kwargs: Any) -> Optional[float]:
        """Update this rank's shard, then bring every shard to every rank.  Collective."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._params()
        with record_function("funcopt::zero/local_step"):
            self._sync_hyper()
            grads = self._local_grads(params)
            self._local.step(grads, **kwargs)
        with record_function("funcopt::zero/sync_params"):
            self._sync_params(params)
        return loss

    def _local_grads(self, params: List[Tensor]) -> List[Optional[Tensor]]:
        if self.zero_stage == 2:
            return self._zero2_grads(params)
        out: List[Optional[Tensor]] = []
        for s in self._segments:
            g = params[s.param].grad
            out.append(None if g is None else g.reshape(-1)[s.start: s.start + s.length])
        return out

    def _plan_sync(self) -> None:
        """Precompute the parameter sync: per space and bucket-sized range of the
        shards, each owner's broadcast and the views it lands in."""
        params = self._params()
        self._sync_plan = []
        self._sync_buf: Optional[Tensor] = None
        for key, space in self.layout.spaces.items():
            for lo, hi in chunks(space.shard, self._chunk_elems(space)):
                for r in range(self.world_size):
                    pieces = [(params[s.param], s.start + skip, take, s.offset + skip - lo)
                              for s, skip, take in space.overlapping(r, lo, hi)]
                    if pieces:
                        n = max(at + take for _, _, take, at in pieces)
                        self._sync_plan.append((key, space, lo, r, n, pieces))

    def _chunk_elems(self, space: Any) -> int:
        """Elements per rank in one bucket; ``bucket_size_mb=0``: the whole shard."""
        if self.bucket_size_mb <= 0:
            return max(1, space.shard)
        elem = torch.empty((), dtype=space.dtype).element_size()
        return max(1, self.bucket_size_mb * 1024 * 1024 // (elem * self.world_size))

    def _sync_params(self, params: List[Tensor]) -> None:
        """Bring every owner's updated range to every rank: one broadcast per owner
        and bucket (gloo's broadcast moved the same bytes 3-4x faster than its
        all-gather on loopback, see docs/benchmarks.md).  With bucket views the
        broadcast lands in the parameters; otherwise the owner packs its range into
        a reused buffer and the receivers copy it out."""
        if self.world_size == 1:
            return
        group = self.process_group
        works, unpack = [], []
        used = 0
        if not self.parameters_as_bucket_view and self._sync_plan:
            need = sum(_align(n * torch.empty((), dtype=space.dtype).element_size()) for _, space, _, _, n, _ in self._sync_plan)
            if self._sync_buf is None or self._sync_buf.numel() < need:
                self._sync_buf = torch.empty(need, dtype=torch.uint8, device=params[0].device)
        for key, space, lo, r, n, pieces in self._sync_plan:
            src = r if group is None else dist.get_global_rank(group, r)
            if self.parameters_as_bucket_view:
                at = r * space.shard + lo
                works.append(dist.broadcast(self._buffers[key][at: at + n], src=src, group=group, async_op=True))
                continue
            nbytes = n * torch.empty((), dtype=space.dtype).element_size()
            buf = self._sync_buf[used: used + nbytes].view(space.dtype)
            used += _align(nbytes)
            views = [_flat(p.detach())[a: a + take] for p, a, take, _ in pieces]
            slots = [buf[at: at + take] for _, _, take, at in pieces]
            if r == self.rank:
                torch._foreach_copy_(slots, views)
            else:
                unpack.append((views, slots))
            works.append(dist.broadcast(buf, src=src, group=group, async_op=True))
        for w in works:
            w.wait()
        for views, slots in unpack:
            torch._foreach_copy_(views, slots)

    # --------------------------------------------------------------- ZeRO-2
    def _setup_zero2(self, params: List[Tensor]) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._bucketer = ReduceScatterBucketer(self.bucket_size_mb)
        self._grad_shards: Dict[str, Tensor] = {}
        self._z2_chunks: List[Tuple[str, Any, int, int, List[Any], List[int]]] = []
        for key, space in self.layout.spaces.items():
            step = self._chunk_elems(space)
            for lo, hi in chunks(space.shard, step):
                plan = [[(s.param, s.start + skip, take, s.offset + skip - lo) for s, skip, take in
                         space.overlapping(r, lo, hi)] for r in range(self.world_size)]
                members = sorted({c[0] for rank_plan in plan for c in rank_plan})
                self._z2_chunks.append((key, space, lo, hi, plan, members))
        self._had_grad = [False] * len(params)  # since the last step, on this rank
        self._chunks_of: Dict[int, List[int]] = {}
        for j, c in enumerate(self._z2_chunks):
            for i in c[5]:
                self._chunks_of.setdefault(i, []).append(j)
        for i, p in enumerate(params):
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))
        self._reset_backward()

    def _reset_backward(self) -> None:
        params = self._params()
        self._pending = [sum(1 for i in c[5] if params[i].requires_grad) for c in self._z2_chunks]
        self._issued = [False] * len(self._z2_chunks)
        self._next = len(self._z2_chunks) - 1  # chunks are issued in descending order on every rank
        self._round_active = False  # a backward has started feeding this round of chunks
        self._seen = [False] * len(params)

    def _make_hook(self, i: int) -> Callable[[Tensor], None]:
        def hook(p: Tensor) -> None:
            self._had_grad[i] = True
            if not self._round_active:
                # like DDP: finish the round when this backward ends, whatever got a gradient
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            if self._seen[i]:
                # a second gradient for i: a new backward (gradient accumulation)
                # began before this round completed (some trainable parameter got
                # no gradient); finish the round first, missing gradients as zero
                self._issue_ready(force=True)
            self._seen[i] = True
            self._round_active = True
            for j in self._chunks_of.get(i, ()):
                self._pending[j] -= 1
            self._issue_ready(force=False)
        return hook

    def _end_of_backward(self) -> None:
        if self._round_active:
            self._issue_ready(force=True)

    @torch.no_grad()
    def _issue_ready(self, force: bool) -> None:
        params = self._params()
        while self._next >= 0 and (force or self._pending[self._next] <= 0):
            j = self._next
            key, space, lo, hi, plan, members = self._z2_chunks[j]
            n = hi - lo
            dev = params[members[0]].device if members else torch.device("cpu")
            inputs = torch.zeros(self.world_size, n, dtype=space.dtype, device=dev)
            for r in range(self.world_size):
                for i, a, take, at in plan[r]:
                    g = params[i].grad
                    if g is not None:
                        inputs[r, at: at + take].copy_(g.reshape(-1)[a: a + take])
            shard = self._grad_shards.get(key)
            if shard is None:
                shard = self._grad_shards[key] = torch.zeros(space.shard, dtype=space.dtype, device=dev)
            target = shard[lo:hi]
            with record_function("funcopt::zero2/reduce_scatter"):
                self._bucketer.reduce_scatter_async(
                    list(inputs.unbind(0)), self.process_group,
                    callback_fn=lambda out, t=target: t.add_(out.div_(self.world_size)))
            self._issued[j] = True
            self._next -= 1
            for i in members:  # free full gradients whose chunks are all issued
                if all(self._issued[k] for k in self._chunks_of[i]):
                    params[i].grad = None
        if self._next < 0:
            # round complete: reduce what still waits in the bucketer now, so that
            # after backward a rank holds only its shard; a further backward
            # (gradient accumulation) starts a new round adding into the same shard
            self._bucketer.flush()
            self._reset_backward()

    def _zero2_grads(self, params: List[Tensor]) -> List[Optional[Tensor]]:
        if self._round_active:  # chunks whose gradients never all arrived: missing ones count as zero
            self._issue_ready(force=True)
        self._bucketer.flush()
        # a parameter that got a gradient on no rank is skipped, as torch.optim skips a None grad
        flags = torch.tensor(self._had_grad, dtype=torch.int32, device=_comm.comm_device(self.process_group))
        if self.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group)
        had = flags.tolist()
        self._had_grad = [False] * len(params)
        out: List[Optional[Tensor]] = []
        for s in self._segments:
            p = params[s.param]
            shard = self._grad_shards.get(str(p.dtype).replace("torch.", ""))
            if not p.requires_grad or shard is None or not had[s.param]:
                out.append(None)
                continue
            out.append(shard[s.offset: s.offset + s.length])
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self.zero_stage == 2:
            self._grad_shards = {}
            self._had_grad = [False] * len(self._had_grad)
            self._reset_backward()

    def grad_shard_bytes(self) -> int:
        """Bytes of gradient this rank holds (ZeRO-2: its shard only)."""
        if self.zero_stage == 2:
            own = sum(t.numel() * t.element_size() for t in self._grad_shards.values())
        else:
            own = 0
        full = sum(p.grad.numel() * p.grad.element_size() for p in self._params() if p.grad is not None)
        return own + full

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        return sum(t.numel() * t.element_size() for e in self._local.state_dict()["state"].values()
                   for t in e.values() if isinstance(t, Tensor))

    # ------------------------------------------------------------ param groups
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a group (collective); the partition is recomputed and state moves with it."""
        super().add_param_group(param_group)
        if self._local is not None:
            try:
                self._rebuild(carry_state=True)  # checks agreement before changing anything
            except Exception:
                del self.param_groups[-1]
                raise

    # ------------------------------------------------------------------ state
    def _local_pieces(self) -> List[Tuple[int, int, int, Dict[str, Tensor]]]:
        """This rank's state as (param, start, length, {name: tensor}) pieces."""
        out = []
        state = self._local.state_dict()["state"]
        for k, s in enumerate(self._segments):
            if k in state:
                out.append((s.param, s.start, s.length, {n: t.detach().cpu() for n, t in state[k].items()}))
        return out

    # public surface of the sharded state, for funcopt.distributed.checkpoint
    def shard_state(self) -> List[Tuple[int, int, int, Dict[str, Tensor]]]:
        """This rank's optimizer state as ``(param, start, length, {name: tensor})`` pieces.

        ``param`` indexes the parameters in ``param_groups`` order; the tensors
        are flat ranges ``[start, start + length)`` of the flattened parameter's
        state (0-d tensors, such as ``step``, whole).  Local, no communication.
        """
        return self._local_pieces()

    def stage_shard_state(self, pieces: List[Tuple[int, int, int, Dict[str, Tensor]]],
                          param_groups: List[Dict[str, Any]]) -> Any:
        """Check pieces covering this rank's ranges (as :meth:`shard_state` gives them) and the
        hyperparameters of ``param_groups``; returns what :meth:`commit_shard_state` applies.
        Changes nothing; raises ``ValueError`` (or the core's error) on bad input.  Local."""
        if len(param_groups) != len(self.param_groups):
            raise ValueError(f"{len(param_groups)} param groups given, optimizer has {len(self.param_groups)}")
        hyper = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in param_groups]
        local_sd = self._local_state_from_pieces(pieces)
        for gi, h in enumerate(hyper):
            local_sd["param_groups"][gi].update(h)
        return hyper, self._local.stage_state(local_sd)

    def commit_shard_state(self, staged: Any) -> None:
        """Apply what :meth:`stage_shard_state` returned.  Local."""
        hyper, local = staged
        for group, h in zip(self.param_groups, hyper):
            group.update(h)
        self._local.commit_state(local)

    def _gather_pieces(self) -> List[Tuple[int, int, int, Dict[str, Tensor]]]:
        return [piece for part in _comm.all_gather_object(self._local_pieces(), self.process_group) for piece in part]

    def _load_pieces(self, pieces: List[Tuple[int, int, int, Dict[str, Tensor]]]) -> None:
        self._local.commit_state(self._local.stage_state(self._local_state_from_pieces(pieces)))

    def _local_state_from_pieces(self, pieces: List[Tuple[int, int, int, Dict[str, Tensor]]]) -> Dict[str, Any]:
        """The local optimizer's state dict, cut from any pieces covering our segments."""
        by_param: Dict[int, List[Tuple[int, int, Dict[str, Tensor]]]] = {}
        for i, start, length, entry in pieces:
            by_param.setdefault(i, []).append((start, length, entry))
        state: Dict[int, Dict[str, Tensor]] = {}
        for k, s in enumerate(self._segments):
            have = sorted(by_param.get(s.param, []), key=lambda x: x[0])
            if not have:
                continue
            entry: Dict[str, Tensor] = {}
            for name, first in have[0][2].items():
                if first.dim() == 0:
                    entry[name] = first.clone()
                    continue
                parts, pos = [], s.start
                for start, length, e in have:
                    a, b = max(pos, start), min(s.start + s.length, start + length)
                    if a < b and a == pos:
                        parts.append(e[name].reshape(-1)[a - start: b - start])
                        pos = b
                if pos != s.start + s.length:
                    raise ValueError(f"state '{name}' of parameter {s.param} does not cover elements "
                                     f"[{s.start}, {s.start + s.length})")
                entry[name] = torch.cat(parts) if parts else first.new_empty(0)
            state[k] = entry
        groups = [dict({k: v for k, v in g.items() if k != "params"}, params=[]) for g in self._local.param_groups]
        for k, gi in enumerate(self._local_gid):
            groups[gi]["params"].append(k)
        return {"state": state, "param_groups": groups}

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full torch.optim-format state on rank ``to``, one shard at a time.  Collective."""
        with record_function("funcopt::zero/consolidate"):
            mine = self._local_pieces()
            if self.rank == to:
                pieces = list(mine)
                for r in range(self.world_size):
                    if r != to:
                        pieces.extend(_comm.recv_object(r, self.process_group))
                self._all_state_dicts = self._full_state(pieces)
            else:
                _comm.send_object(mine, to, self.process_group)
                self._all_state_dicts = None

    def _full_state(self, pieces: List[Tuple[int, int, int, Dict[str, Tensor]]]) -> Dict[str, Any]:
        params = self._params()
        by_param: Dict[int, List[Tuple[int, int, Dict[str, Tensor]]]] = {}
        for i, start, length, entry in pieces:
            by_param.setdefault(i, []).append((start, length, entry))
        state: Dict[int, Dict[str, Tensor]] = {}
        for i, have in sorted(by_param.items()):
            have.sort(key=lambda x: x[0])
            entry = {}
            for name, first in have[0][2].items():
                if first.dim() == 0:
                    entry[name] = first
                else:
                    entry[name] = torch.cat([e[name].reshape(-1) for _, _, e in have]).view(params[i].shape)
            state[i] = entry
        groups, start = [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def save_sharded(self, path: str) -> None:
        """Each rank writes its own shard under directory ``path``.  Collective.

        See :mod:`funcopt.distributed.checkpoint`; loads at any world size
        with :meth:`load_sharded`.
        """
        checkpoint.save_sharded(self, path)

    def load_sharded(self, path: str) -> None:
        """Load a :meth:`save_sharded` checkpoint from any world size.  Collective."""
        checkpoint.load_sharded(self, path)

    def state_dict(self) -> Dict[str, Any]:
        """The consolidated state (torch.optim format) on the rank it was consolidated to."""
        if self._all_state_dicts is None:
            raise RuntimeError(
                f"Optimizer state has not been consolidated on this rank. Please call "
                f"`consolidate_state_dict(to={self.rank})` on all ranks beforehand if you meant to save the global state."
            )
        return self._all_state_dicts

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a full torch.optim-format state dict (from any world size).  Collective.

        Every rank checks its part; if any rank finds a problem, every rank
        raises and nothing changes anywhere.
        """
        error, staged = None, None
        try:
            staged = self._stage_full(state_dict)
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            error = f"{type(e).__name__}: {e}"
        _comm.agree(error, self.process_group, "ZeroRedundancyOptimizer.load_state_dict")
        assert staged is not None
        groups, local_staged = staged
        for group, saved in zip(self.param_groups, groups):
            for k, v in saved.items():
                if k not in ("params", "param_names"):
                    group[k] = v
        self._local.commit_state(local_staged)

    def _stage_full(self, state_dict: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], Any]:
        if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
            raise ValueError("expected a dict with keys 'state' and 'param_groups'")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(groups)} param groups, optimizer has {len(self.param_groups)}")
        params, ids, flat = self._params(), {}, 0
        for g, (mine, saved) in enumerate(zip(self.param_groups, groups)):
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError(f"param group {g} has {len(saved['params'])} params, optimizer has {len(mine['params'])}")
            for sid in saved["params"]:
                ids[sid] = flat
                flat += 1
        pieces = []
        for sid, entry in state_dict["state"].items():
            if sid not in ids:
                raise ValueError(f"state for unknown parameter id {sid!r}")
            i = ids[sid]
            p = params[i]
            for name, t in entry.items():
                if isinstance(t, Tensor) and t.dim() > 0 and t.shape != p.shape:
                    raise ValueError(f"'{name}' of parameter {sid!r} has shape {tuple(t.shape)}, parameter has {tuple(p.shape)}")
            pieces.append((i, 0, p.numel(), {n: (t if isinstance(t, Tensor) else torch.tensor(float(t))) for n, t in entry.items()}))
        local_sd = self._local_state_from_pieces(pieces)
        for gi, saved in enumerate(groups):
            local_sd["param_groups"][gi].update({k: v for k, v in saved.items() if k not in ("params", "param_names")})
        return groups, self._local.stage_state(local_sd)
