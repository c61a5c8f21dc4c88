"""ZeRO-3 layers: parameters sharded over ranks, gathered only while a layer runs.

A :class:`Zero3Layer` flattens the parameters of the module it wraps into two
padded 1-D chunks per rank -- the trainable parameters and the frozen ones --
and keeps ``1/W`` of each.  The original parameters stay the objects the module
uses, but while the layer is not *fetched* their storage has zero bytes.  Just
before the module runs, the chunks are all-gathered into one flat buffer per
kind (the original parameters are views into it); right after, the buffer's
storage is released.  Backward gathers the layer again (a hook on its outputs),
and as soon as every trainable parameter of the layer has its gradient, the
gradients are flattened and reduce-scattered (through
:class:`~funcopt.distributed.ReduceScatterBucketer`, asynchronously) into the
trainable chunk's ``.grad``, averaged over ranks (``grad_reduce="mean"``) or
summed (``"sum"``), adding to what is there (gradient accumulation).

Layers that belong to one root (:class:`~funcopt.distributed.Zero3Sequential`
or what :func:`~funcopt.distributed.zero3` returns) share a :class:`Zero3Schedule`:
the execution order (prefetch the next layer in forward, the previous one in
backward), one bucketer, and the end-of-backward callback that completes every
reduction and frees whatever is still gathered.

Device-agnostic: every collective is issued with ``async_op=True`` and waited
on before use.  On CPU + gloo that overlaps communication (gloo's threads) with
compute; on CUDA + NCCL the collectives run on NCCL's own streams and
``wait()`` orders them before the compute stream (no extra stream of ours).
The CUDA path is untested (no GPU in CI).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_unflatten

from .._comm import check_same, comm_device, rank_and_size
from .schedule3 import (FROZEN, GRAD_REDUCE, KINDS, TRAINABLE, ChunkInfo, ParamEntry, PostBackward, Zero3Schedule,
                        owned_parameters, state_entries)

__all__ = ["ChunkInfo", "Zero3Layer", "Zero3Schedule"]


class Zero3Layer(nn.Module):
    """One layer of a ZeRO-3 model: its parameters are sharded over the ranks.

    The trainable parameters of ``module`` are flattened into one padded 1-D
    chunk and the frozen ones into another; each rank keeps ``1/W`` of each
    (``trainable_chunk``, an ``nn.Parameter`` the optimizer steps, and
    ``frozen_chunk``), initialized from rank 0's module.  While the layer is not
    fetched its original parameters hold no memory
    (``p.untyped_storage().nbytes() == 0``).  A forward all-gathers them, runs
    ``module`` and frees them; backward gathers them again, and the layer's
    gradients are reduce-scattered into ``trainable_chunk.grad`` as soon as its
    backward is done (accumulating across backwards until ``zero_grad()``).

    Call on every rank, with the same module structure everywhere (checked:
    ranks whose modules differ get ``DistributedError`` naming the difference).

    Limits: every rank must run the same layers in the same order (gathers and
    reductions are collectives); a trainable parameter that gets no gradient
    while others of its layer do gets a zero gradient in the chunk (the chunk
    is one tensor to the optimizer), where torch would skip it; move or cast
    the module before wrapping it (``.to()`` after reaches only the chunks), and
    set ``requires_grad`` before (later changes are not seen); activation
    checkpointing inside a layer and ``torch.compile`` are untested; the CUDA +
    NCCL path is untested (no GPU in CI).

    Args:
      module: the module to shard.  Its parameters move into the chunks (they
        no longer appear in ``module.parameters()``); buffers stay replicated.
      rank: as in labml.ai's ``Zero3Layer`` (positional); defaults to (and
        must equal) this process's rank in the process group.
      world_size: defaults to (and must equal) the process group's size.
      device: where the chunks live (default: the parameters' device).
      dtype: the chunks' dtype (default: the parameters' dtype, which must then
        be one dtype).
      process_group: the group to shard over (default: the default group).
      grad_reduce: ``"mean"`` (default, DDP's gradient) or ``"sum"`` over ranks.
      compute_dtype: e.g. ``torch.bfloat16``: gathered parameters are cast to it
        (the all-gather moves compute-dtype bytes) and floating-point inputs
        are cast too; chunks, gradients in the chunk and optimizer state stay
        in ``dtype``.

    Example::

        layers = [Zero3Layer(nn.Linear(8, 8), rank, world_size, device, torch.float32) for _ in range(4)]
        model = Zero3Sequential(layers)
        opt = funcopt.Adam(model.parameters(), lr=1e-3)   # 1/W of the state per rank
        model(x).pow(2).mean().backward()
        opt.step()
    """

    zero3_layer = True  # marks a ZeRO-3 layer: an enclosing layer leaves its parameters alone

    def __init__(self, module: nn.Module, rank: Optional[int] = None, world_size: Optional[int] = None,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None, *,
                 process_group: Any = None, grad_reduce: str = "mean",
                 compute_dtype: Optional[torch.dtype] = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"Zero3Layer: module must be an nn.Module, got {type(module).__name__}")
        if grad_reduce not in GRAD_REDUCE:
            raise ValueError(f"Zero3Layer: grad_reduce must be one of {GRAD_REDUCE}, got {grad_reduce!r}")
        if not dist.is_initialized():
            raise RuntimeError("Zero3Layer: call torch.distributed.init_process_group first")
        group = process_group
        g_rank, g_world = rank_and_size(group)
        refs = owned_parameters(module)
        problems: List[str] = []
        if rank is not None and int(rank) != g_rank:
            problems.append(f"rank={rank} but this process is rank {g_rank} of the process group")
        if world_size is not None and int(world_size) != g_world:
            problems.append(f"world_size={world_size} but the process group has {g_world} ranks")
        unique: Dict[int, int] = {}
        for _, _, _, p in refs:
            unique.setdefault(id(p), len(unique))
        params = list({id(p): p for _, _, _, p in refs}.values())
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in params})
        if dtype is None and len(dtypes) > 1:
            problems.append(f"parameters of several dtypes ({', '.join(dtypes)}); pass dtype=")
        if dtype is None:
            dtype = params[0].dtype if params else torch.get_default_dtype()
        if not dtype.is_floating_point:
            problems.append(f"dtype must be a floating-point dtype, got {dtype}")
        if compute_dtype is not None and not compute_dtype.is_floating_point:
            problems.append(f"compute_dtype must be a floating-point dtype, got {compute_dtype}")
        devices = {p.device for p in params}
        if device is None:
            device = devices.pop() if len(devices) == 1 else comm_device(group)
        device = torch.device(device)
        description = dict(
            params={name: f"shape {tuple(p.shape)} {str(p.dtype).replace('torch.', '')}"
                    f"{'' if p.requires_grad else ' frozen'} (parameter #{unique[id(p)]})" for name, _, _, p in refs},
            buffers={k: f"shape {tuple(v[0]._buffers[v[1]].shape)}" for k, kind, v in state_entries(module)
                     if kind == "buffer"},
            world=g_world, dtype=str(dtype), compute_dtype=str(compute_dtype), grad_reduce=grad_reduce,
            problems=problems)
        with record_function("funcopt::zero3/init"):
            check_same(description, group, f"Zero3Layer({type(module).__name__})")
            if problems:  # the same on every rank
                raise ValueError("Zero3Layer: " + "; ".join(problems))

            self.module = module
            self.process_group = group
            self.rank, self.world_size = g_rank, g_world
            self.device, self.dtype = device, dtype
            self.compute_dtype = compute_dtype
            self.grad_reduce = grad_reduce
            self.layer_idx = -1  # position in the root's execution order
            self.label = type(module).__name__  # how errors name this layer (roots set its path)
            self._state = state_entries(module)
            # one entry per unique parameter, in kind order
            entries: List[ParamEntry] = []
            sizes = [0, 0]
            by_id: Dict[int, ParamEntry] = {}
            for name, owner, attr, p in refs:
                e = by_id.get(id(p))
                if e is None:
                    kind = TRAINABLE if p.requires_grad else FROZEN
                    e = by_id[id(p)] = ParamEntry(name, kind, sizes[kind], p.shape, p)
                    sizes[kind] += p.numel()
                    entries.append(e)
                e.aliases.append((owner, attr))
            self.entries = [e for k in (TRAINABLE, FROZEN) for e in entries if e.kind == k]
            self.numels = sizes
            self.chunk_size = [-(-n // g_world) for n in sizes]  # labml's name: per-rank chunk lengths
            self._init_chunks()
            self._init_views()

        self._gather_work: List[Any] = []
        self._gather_inputs: List[Tensor] = []
        self._fetched = False
        self._bw_started = False
        self._bw_finished = False
        self._grads_ready = 0
        self.n_trainable = sum(1 for e in self.entries if e.kind == TRAINABLE)
        self._hooks = [e.param.register_post_accumulate_grad_hook(self._grad_ready)
                       for e in self.entries if e.kind == TRAINABLE]
        self.schedule = Zero3Schedule(group, root=self)

    # ------------------------------------------------------------ construction
    @torch.no_grad()
    def _init_chunks(self) -> None:
        """Rank 0's values, scattered: rank r gets elements [r*c, (r+1)*c) of each flat."""
        ct, cf = self.chunk_size
        local = torch.zeros(ct + cf, dtype=self.dtype, device=self.device)
        if ct + cf:
            scatter_list = None
            if self.rank == 0:
                flats = []
                for kind in (TRAINABLE, FROZEN):
                    flat = torch.zeros(self.chunk_size[kind] * self.world_size, dtype=self.dtype, device=self.device)
                    for e in self.entries:
                        if e.kind == kind:
                            flat[e.offset:e.offset + e.numel].copy_(e.param.detach().reshape(-1))
                    flats.append(flat.view(self.world_size, -1))
                scatter_list = list(torch.cat(flats, dim=1).unbind(0))
            dist.scatter(local, scatter_list, group=self.process_group, group_src=0)
        t, f = local.split([ct, cf])
        self.trainable_chunk: Optional[nn.Parameter]
        self.frozen_chunk: Optional[nn.Parameter]
        if ct:
            self.trainable_chunk = nn.Parameter(t.clone(), requires_grad=True)
            # several parameters' elements: a funcopt rule that needs each parameter whole refuses it
            self.trainable_chunk.funcopt_flat_chunk = True  # type: ignore[attr-defined]
            # the ranks holding the other chunks: a rule summing over every parameter (Prodigy) sums here
            self.trainable_chunk.funcopt_process_group = self.process_group  # type: ignore[attr-defined]
        else:
            self.register_parameter("trainable_chunk", None)
        if cf:
            self.frozen_chunk = nn.Parameter(f.clone(), requires_grad=False)
        else:
            self.register_parameter("frozen_chunk", None)

    @torch.no_grad()
    def _init_views(self) -> None:
        """Original parameters become views of one gathered flat per kind, whose
        storage is empty while not fetched; they leave their owners' ``_parameters``."""
        cd = self.compute_dtype or self.dtype
        self._flats = [torch.empty(c * self.world_size, dtype=cd, device=self.device) for c in self.chunk_size]
        for e in self.entries:
            e.param.data = self._flats[e.kind][e.offset:e.offset + e.numel].view(e.shape)
            for owner, attr in e.aliases:
                if owner._parameters.get(attr) is e.param:
                    del owner._parameters[attr]
                owner.__dict__[attr] = e.param  # the module still finds it as an attribute
        for flat in self._flats:
            flat.untyped_storage().resize_(0)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if name == "module" or inner is None:
                raise
            return getattr(inner, name)

    # ------------------------------------------------------------------ API
    def get_trainable_chunk(self) -> List[nn.Parameter]:
        """``[trainable_chunk]``, or ``[]`` when the layer has no trainable parameters."""
        return [self.trainable_chunk] if self.trainable_chunk is not None else []

    @property
    def is_fetched(self) -> bool:
        """Whether the full parameters are materialized."""
        return self._fetched

    def prefetch(self) -> None:
        """Start gathering the full parameters (asynchronously); no-op if under way or done."""
        if self._fetched or self._gather_work:
            return
        with record_function("funcopt::zero3/all_gather"), torch.no_grad():
            chunks = [self.trainable_chunk, self.frozen_chunk]
            for kind, flat in enumerate(self._flats):
                c = self.chunk_size[kind]
                if c == 0:
                    continue
                flat.untyped_storage().resize_(flat.numel() * flat.element_size())
                src = chunks[kind].detach()
                if self.compute_dtype is not None and src.dtype != self.compute_dtype:
                    src = src.to(self.compute_dtype)
                self._gather_inputs.append(src)
                # straight into the flat (the parameters' storage): no list of outputs to copy from
                self._gather_work.append(_ALL_GATHER_INTO(flat, src, group=self.process_group, async_op=True))
            if not self._gather_work:
                self._fetched = True

    def fetch_params(self) -> None:
        """Gather the full parameters now (waits for a prefetch under way)."""
        self.prefetch()
        self._wait_gather()

    def _wait_gather(self) -> None:
        if self._gather_work:
            with record_function("funcopt::zero3/wait_gather"):
                for w in self._gather_work:
                    w.wait()
            self._gather_work = []
            self._gather_inputs = []
            self._fetched = True

    def free_params(self) -> None:
        """Release the full parameters (waits for a gather under way first)."""
        self._wait_gather()
        if self._fetched:
            for flat in self._flats:
                flat.untyped_storage().resize_(0)
            self._fetched = False

    def attach(self, schedule: Zero3Schedule) -> None:
        """Join a root's schedule (roots call this; a layer belongs to one root)."""
        if schedule.group is not self.process_group and not _same_group(schedule.group, self.process_group):
            raise ValueError("Zero3Layer: every layer of a root must use the root's process group")
        self.schedule = schedule

    # ------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Gather the parameters, run the module, free them (see the class docstring)."""
        sched = self.schedule
        standalone = sched.root is self and sched.outer is None
        if standalone:
            sched.begin_forward()
        with record_function("funcopt::zero3/forward"):
            out = self.run_forward(self.module, args, kwargs)
        if standalone:
            sched.end_forward()
        return out

    def run_forward(self, fn: Callable[..., Any], args: tuple, kwargs: Dict[str, Any]) -> Any:
        """Gather, prefetch the next layer, ``fn(*args, **kwargs)``, set up backward, free."""
        sched = self.schedule
        sched.saw_forward(self)
        if self.compute_dtype is not None:
            args, kwargs = _cast_inputs((args, kwargs), self.compute_dtype)
        self.fetch_params()
        nxt = sched.next_of(self)
        if nxt is not None:
            nxt.prefetch()
        grad = torch.is_grad_enabled()
        if grad and self.n_trainable == 0:
            args, kwargs = self._hook_inputs(args, kwargs)
        out = fn(*args, **kwargs)
        needs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor) and t.requires_grad] if grad else []
        if needs:
            sched.ran_with_grad(self)
            for t in needs:
                t.register_hook(self._pre_backward)
        if not (needs and sched.keep_after_forward(self)):
            self.free_params()
        return out

    def _hook_inputs(self, args: tuple, kwargs: Dict[str, Any]) -> Tuple[tuple, Dict[str, Any]]:
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, Tensor) and t.requires_grad]
        if not idx:
            return args, kwargs
        outs = PostBackward.apply(self, *[flat[i] for i in idx])
        outs = outs if isinstance(outs, tuple) else (outs,)
        for i, t in zip(idx, outs):
            flat[i] = t
        return tree_unflatten(flat, spec)

    # ------------------------------------------------------------- backward
    def _pre_backward(self, grad: Tensor) -> None:
        sched = self.schedule
        sched.enter_backward()
        if self._bw_started or self._bw_finished:
            return None
        self._bw_started = True
        with record_function("funcopt::zero3/pre_backward"):
            self.fetch_params()
            prev = sched.prev_of(self)
            if prev is not None:
                prev.prefetch()
        return None

    def _grad_ready(self, p: Tensor) -> None:
        if self._bw_finished:  # a gradient after this layer was reduced (e.g. a second backward)
            self._grads_ready = 0
            self._bw_finished = False
            self.schedule.enter_backward()
            self.schedule.ran_with_grad(self)
        self._grads_ready += 1
        if self._grads_ready == self.n_trainable:
            self.finish_backward()

    def backward_done(self) -> None:
        """A frozen-only layer's backward produced its input gradients."""
        if not self._bw_finished:
            self.finish_backward()

    @property
    def backward_finished(self) -> bool:
        """Whether this iteration's gradients of the layer have been handed to the reduction."""
        return self._bw_finished

    @torch.no_grad()
    def finish_backward(self) -> None:
        """Reduce-scatter this layer's gradients (if any) and free it."""
        with record_function("funcopt::zero3/reduce_grads"):
            self._bw_finished = True
            c = self.chunk_size[TRAINABLE]
            trainable = [e for e in self.entries if e.kind == TRAINABLE]
            if c and any(e.param.grad is not None for e in trainable):
                # every element is written once: a copied gradient, or zero (padding, no gradient)
                flat = torch.empty(c * self.world_size, dtype=self.dtype, device=self.device)
                for e in trainable:
                    piece = flat[e.offset:e.offset + e.numel]
                    if e.param.grad is not None:
                        piece.copy_(e.param.grad.reshape(-1))
                        e.param.grad = None  # each gradient goes as soon as it is in the flat
                    else:
                        piece.zero_()
                flat[self.numels[TRAINABLE]:].zero_()
                nbytes = flat.numel() * flat.element_size()
                sched = self.schedule
                sched.grad_handed(nbytes)

                def receive(reduced: Tensor) -> None:
                    sched.grad_reduced(nbytes)
                    self._receive_grad(reduced)

                # waits for the previous layer's reduce-scatter (the bucketer keeps one in flight)
                sched.bucketer.reduce_scatter_async(list(flat.view(self.world_size, c).unbind(0)),
                                                    self.process_group, receive)
                del flat
            self.free_params()

    @torch.no_grad()
    def _receive_grad(self, reduced: Tensor) -> None:
        chunk = self.trainable_chunk
        assert chunk is not None
        if self.grad_reduce == "mean" and self.world_size > 1:
            reduced.div_(self.world_size)
        if chunk.grad is None:
            grad = reduced.to(chunk.dtype).reshape(-1)
            whole = grad.is_contiguous() and grad.untyped_storage().nbytes() == grad.numel() * grad.element_size()
            # a tensor of its own (a direct reduce-scatter's output, or the cast) is kept as
            # it is; a slice of a bucket's output is copied so the bucket can go
            chunk.grad = grad if whole and grad.data_ptr() != chunk.data_ptr() else grad.clone()
        else:
            chunk.grad.add_(reduced.reshape(-1).to(chunk.grad.dtype))

    def reset_iteration(self) -> None:
        """Forget an iteration's backward state and free the parameters."""
        self.free_params()
        self._bw_started = False
        self._bw_finished = False
        self._grads_ready = 0
        for e in self.entries:
            if e.kind == TRAINABLE and e.param.grad is not None:
                e.param.grad = None  # a partial backward's leftovers: never seen by the optimizer

    # ------------------------------------------------- full state, sharded view
    def full_state(self, to: int = 0) -> Dict[str, Tensor]:
        """This layer's module ``state_dict()`` (original keys, shapes, dtypes),
        gathered on group rank ``to``; ``{}`` elsewhere.  Collective."""
        with record_function("funcopt::zero3/full_state"), torch.no_grad():
            flats: List[Optional[Tensor]] = [None, None]
            for kind, chunk in enumerate((self.trainable_chunk, self.frozen_chunk)):
                c = self.chunk_size[kind]
                if c == 0:
                    continue
                gathered = [torch.empty_like(chunk) for _ in range(self.world_size)] if self.rank == to else None
                dist.gather(chunk.detach(), gathered, group=self.process_group, group_dst=to)
                if gathered is not None:
                    flats[kind] = torch.cat(gathered)
            if self.rank != to:
                return {}
            values = {}
            for e in self.entries:
                flat = flats[e.kind]
                assert flat is not None
                values[id(e.param)] = flat[e.offset:e.offset + e.numel].view(e.shape).clone()
            out: Dict[str, Tensor] = {}
            for key, kind, ref in self._state:
                if kind == "param":
                    out[key] = values[id(ref)]
                else:
                    owner, attr = ref
                    out[key] = owner._buffers[attr].detach().clone()
            return out

    def full_state_keys(self) -> List[Tuple[str, Tuple[int, ...], torch.dtype]]:
        """``(key, shape, dtype)`` of every entry :meth:`full_state` returns."""
        out = []
        for key, kind, ref in self._state:
            if kind == "param":
                out.append((key, tuple(ref.shape), self.dtype))
            else:
                b = ref[0]._buffers[ref[1]]
                out.append((key, tuple(b.shape), b.dtype))
        return out

    @torch.no_grad()
    def load_full_state(self, state: Dict[str, Tensor], src: int = 0) -> None:
        """Scatter a validated full state (this layer's keys, on rank ``src``)
        into the chunks; broadcast the buffers.  Collective."""
        with record_function("funcopt::zero3/load_full_state"):
            ct, cf = self.chunk_size
            local = torch.empty(ct + cf, dtype=self.dtype, device=self.device)
            if ct + cf:
                scatter_list = None
                if self.rank == src:
                    by_id: Dict[int, Tensor] = {}
                    for key, kind, ref in self._state:
                        if kind == "param":
                            by_id[id(ref)] = state[key]  # tied names: the last wins, as in torch
                    flats = []
                    for kind in (TRAINABLE, FROZEN):
                        flat = torch.zeros(self.chunk_size[kind] * self.world_size, dtype=self.dtype,
                                           device=self.device)
                        for e in self.entries:
                            if e.kind == kind:
                                flat[e.offset:e.offset + e.numel].copy_(by_id[id(e.param)].reshape(-1))
                        flats.append(flat.view(self.world_size, -1))
                    scatter_list = list(torch.cat(flats, dim=1).unbind(0))
                dist.scatter(local, scatter_list, group=self.process_group, group_src=src)
            t, f = local.split([ct, cf])
            if self.trainable_chunk is not None:
                self.trainable_chunk.copy_(t)
            if self.frozen_chunk is not None:
                self.frozen_chunk.copy_(f)
            for key, kind, ref in self._state:
                if kind == "buffer":
                    buf = ref[0]._buffers[ref[1]]
                    if self.rank == src:
                        buf.copy_(state[key])
                    dist.broadcast(buf, group=self.process_group, group_src=src)
            self.free_params()

    def chunk_infos(self, prefix: str = "", key_prefix: str = "") -> List[ChunkInfo]:
        """This rank's chunks: names ``prefix + "trainable_chunk"`` / ``"frozen_chunk"``."""
        out = []
        for kind, chunk in enumerate((self.trainable_chunk, self.frozen_chunk)):
            if chunk is None:
                continue
            c = self.chunk_size[kind]
            offset = self.rank * c
            names = {id(ref): key for key, k, ref in self._state if k == "param"}
            params = tuple((key_prefix + names.get(id(e.param), e.name), e.offset, tuple(e.shape))
                           for e in self.entries if e.kind == kind)
            out.append(ChunkInfo(name=f"{prefix}{KINDS[kind]}_chunk", tensor=chunk, trainable=kind == TRAINABLE,
                                 offset=offset, length=c, valid=max(0, min(c, self.numels[kind] - offset)),
                                 numel=self.numels[kind], world=self.world_size, params=params))
        return out

    def extra_repr(self) -> str:
        """Rank, world size, chunk sizes and dtypes, for ``repr``."""
        return (f"rank={self.rank}, world_size={self.world_size}, chunk_size={self.chunk_size}, "
                f"dtype={self.dtype}, compute_dtype={self.compute_dtype}, grad_reduce={self.grad_reduce!r}")


# all_gather_single is all_gather_into_tensor's newer name (the old one warns in torch >= 2.13)
_ALL_GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _cast_inputs(tree: Any, dtype: torch.dtype) -> Any:
    flat, spec = tree_flatten(tree)
    flat = [t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t for t in flat]
    return tree_unflatten(flat, spec)


def _same_group(a: Any, b: Any) -> bool:
    wa = dist.get_world_size(a)
    return wa == dist.get_world_size(b) and all(
        dist.get_global_rank(a, r) == dist.get_global_rank(b, r) for r in range(wa)) if (a and b) else a is b
