"""DTensor parameters (FSDP2 ``fully_shard``, tensor parallel): step the local shards.

An elementwise update rule (every funcopt algorithm that is not
``whole_params``) gives each element a value that depends only on that
element's parameter, gradient and state.  So a DTensor parameter is stepped
by stepping its local tensor (``to_local()``, a plain tensor that shares the
DTensor's storage) with the local tensor of its gradient, through the same
fused/foreach/scripted kernels as any plain tensor: no DTensor dispatch, no
collective, the same numbers as torch.optim (which dispatches each foreach op
through DTensor).  A gradient laid out differently from its parameter (e.g.
``Partial`` after a tensor-parallel backward) is redistributed to the
parameter's placements first, the only communication.

A rule that needs each parameter whole (``whole_params``: Adafactor's
row/column statistics, Muon's orthogonalization) gets the whole parameter
(:class:`GatherView`): before each step every rank all-gathers the parameter
and its gradient (``full_tensor()``), steps the full tensors through the same
kernels (same numbers as a single process; state kept whole, replicated on
every rank), and writes its own shard back.  It costs one all-gather of
parameter and gradient per step and full-size state on every rank, the price
of a rule no shard can compute alone (torch.optim runs these rules through
DTensor dispatch instead: Muon rounds differently from a single process,
Adafactor raises).

The state the kernels hold is local too; ``opt.state`` and ``state_dict()``
show it as DTensors laid out like the parameter (torch.optim's format, what
``torch.distributed.checkpoint`` saves shard by shard), and a loaded entry --
a DTensor in any layout, or a full plain tensor -- is cut to this rank's
shard without communication where it can be.

Usage (nothing to do: a funcopt optimizer detects DTensor parameters)::

    >>> from torch.distributed.fsdp import fully_shard      # doctest: +SKIP
    >>> fully_shard(model)                                  # doctest: +SKIP
    >>> opt = funcopt.Adam(model.parameters(), lr=1e-3)     # doctest: +SKIP
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

_MODULE = "torch.distributed.tensor"  # imported by whoever makes a DTensor, never here (0.9 s per process)


def _api() -> Any:
    """torch.distributed.tensor, once a DTensor exists (only then is it asked for)."""
    import torch.distributed.tensor as api
    return api


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor.  Never imports torch.distributed.tensor: a DTensor can only
    exist once that module has been imported (by FSDP2, ``distribute_tensor``, DCP...)."""
    api = sys.modules.get(_MODULE)
    return api is not None and isinstance(t, api.DTensor)


def local(t: Tensor) -> Tensor:
    """The local tensor of a DTensor: the very object the DTensor holds (``to_local()``
    without grad, which for a ``Parameter(DTensor)`` wraps it in a new Parameter)."""
    inner = getattr(t, "_local_tensor", None)
    if isinstance(inner, Tensor) and not is_dtensor(inner):
        return inner
    with torch.no_grad():
        return t.to_local()


class LocalView:
    """The plain tensors a core steps in place of a parameter list with DTensors.

    ``params``: the optimizer's parameters (DTensors and plain tensors);
    ``step_params``: what the core is built over (each DTensor's local tensor).
    """

    __slots__ = ("params", "step_params", "index", "pos")
    whole = False

    def after_step(self) -> None:
        """Nothing: the core stepped the shards themselves."""

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.params = list(params)
        self.index = [i for i, p in enumerate(self.params) if is_dtensor(p)]
        self.pos = {id(self.params[i]): i for i in self.index}
        self.step_params = list(self.params)
        for i in self.index:
            self.step_params[i] = local(self.params[i])

    def stale(self) -> bool:
        """A DTensor got a new local tensor (FSDP2 re-points its shards at lazy init)."""
        params, mine = self.params, self.step_params
        return any(params[i]._local_tensor is not mine[i] for i in self.index)

    def grads(self, grads: List[Any]) -> List[Any]:
        """Each DTensor gradient as its local tensor, laid out like its parameter."""
        out = list(grads)
        params = self.params
        for i in self.index:
            if i >= len(out):
                break
            g = out[i]
            if g is None or not is_dtensor(g):
                continue
            p = params[i]
            if g.placements != p.placements or (g.device_mesh is not p.device_mesh and g.device_mesh != p.device_mesh):
                with torch.no_grad():
                    g = g.redistribute(p.device_mesh, p.placements)
            out[i] = local(g)
        return out

    def wrap(self, i: int, name: str, value: Tensor, cache: Dict[int, Tuple[Tensor, Tensor]]) -> Tensor:
        """State ``value`` (local) of parameter ``i`` as ``opt.state`` shows it:
        a DTensor like the parameter for per-element state, as it is otherwise
        (``step``).  ``cache`` keeps one wrapper per local tensor, so the entry
        is the same object from one look to the next."""
        p = self.params[i]
        if not is_dtensor(p) or name == "step":
            return value
        flat = _flat_state(value, self.step_params[i], p)
        if value.shape != self.step_params[i].shape and not flat:
            return value
        hit = cache.get(id(value))
        if hit is not None and hit[0] is value:
            return hit[1]
        if flat:  # per-element state of the flattened parameter (Prodigy's s, p0): shown in the
            # parameter's shape, sharded like it (a 1-D Shard(0) DTensor could not hold uneven row
            # shards: 3 + 2 rows of 10 are 30 + 20 elements, not 1-D's 25 + 25); loads either way
            wrapped = _api().DTensor.from_local(value.view(self.step_params[i].shape), p.device_mesh,
                                                p.placements, run_check=False, shape=p.shape, stride=p.stride())
        else:
            wrapped = _api().DTensor.from_local(value, p.device_mesh, p.placements, run_check=False,
                                                shape=p.shape, stride=p.stride())
        cache[id(value)] = (value, wrapped)
        return wrapped

    def unwrap_entry(self, p: Tensor, entry: Dict[str, Any]) -> Tuple[Tensor, Dict[str, Any]]:
        """A state entry to load for parameter ``p``: ``(parameter, entry)`` as the
        plain-tensor checks want them (this rank's shard and its state)."""
        i = self.pos.get(id(p))
        if i is None or not isinstance(entry, dict):
            return p, entry
        out: Dict[str, Any] = {}
        for name, v in entry.items():
            if isinstance(v, Tensor) and name != "step":
                if v.dim() == 1 and p.dim() > 1 and v.numel() == p.numel() and _row_sharded(p):
                    full = v.full_tensor() if is_dtensor(v) else v  # flattened per-element state
                    v = to_shard(full.reshape(p.shape), p).reshape(-1)
                else:
                    v = to_shard(v, p)
            out[name] = v
        return self.step_params[i], out


def _row_sharded(p: Tensor) -> bool:
    """A DTensor sharded along its first dimension only (FSDP2): its flattened local tensor
    is a contiguous range of the flattened whole."""
    return all((not pl.is_shard()) or pl.dim == 0 for pl in p.placements)


def _flat_state(value: Tensor, local_p: Tensor, p: Tensor) -> bool:
    """``value`` is per-element state of the flattened (row-sharded) parameter ``p``."""
    return (value.dim() == 1 and local_p.dim() > 1 and value.numel() == local_p.numel()
            and _row_sharded(p))


class GatherView(LocalView):
    """For a rule that needs each parameter whole: the core steps a full copy of each
    DTensor parameter (``step_params``), refreshed from the shards before every step
    (:meth:`grads`, collective) and cut back into this rank's shard after it
    (:meth:`after_step`, local).  Its state is whole, shown as a ``Replicate()``
    DTensor where it has the parameter's shape."""

    whole = True

    def __init__(self, params: Sequence[Tensor]) -> None:
        super().__init__(params)
        for i in self.index:
            with torch.no_grad():
                self.step_params[i] = self.params[i].full_tensor()  # collective, in parameter order

    def stale(self) -> bool:
        return False  # the shards are read and written afresh at every step

    def grads(self, grads: List[Any]) -> List[Any]:
        """Refresh the full parameters; each DTensor gradient whole.  Collective: every
        rank all-gathers the same parameters and gradients in the same order."""
        out = list(grads)
        with torch.no_grad():
            for i in self.index:
                self.step_params[i].copy_(self.params[i].full_tensor())
                if i < len(out) and out[i] is not None and is_dtensor(out[i]):
                    out[i] = out[i].full_tensor()
        return out

    def after_step(self) -> None:
        """This rank's shard of each stepped full parameter back into the DTensor (no communication)."""
        with torch.no_grad():
            for i in self.index:
                p = self.params[i]
                cut = _api().distribute_tensor(self.step_params[i], p.device_mesh, p.placements, src_data_rank=None)
                local(p).copy_(cut.to_local())

    def wrap(self, i: int, name: str, value: Tensor, cache: Dict[int, Tuple[Tensor, Tensor]]) -> Tensor:
        p = self.params[i]
        if not is_dtensor(p) or name == "step" or value.shape != p.shape:
            return value
        hit = cache.get(id(value))
        if hit is not None and hit[0] is value:
            return hit[1]
        api = _api()
        wrapped = api.DTensor.from_local(value, p.device_mesh, [api.Replicate()] * p.device_mesh.ndim, run_check=False)
        cache[id(value)] = (value, wrapped)
        return wrapped

    def unwrap_entry(self, p: Tensor, entry: Dict[str, Any]) -> Tuple[Tensor, Dict[str, Any]]:
        i = self.pos.get(id(p))
        if i is None or not isinstance(entry, dict):
            return p, entry
        out: Dict[str, Any] = {}
        with torch.no_grad():
            for name, v in entry.items():
                out[name] = v.full_tensor() if isinstance(v, Tensor) and is_dtensor(v) else v
        return self.step_params[i], out


def to_shard(v: Tensor, p: Tensor) -> Tensor:
    """This rank's piece of ``v`` laid out like DTensor ``p``: a DTensor is
    redistributed (a collective only when its layout differs), a plain tensor
    of ``p``'s full shape is cut locally (every rank holds it whole); anything
    else is returned as it is, for the shape check to name."""
    with torch.no_grad():
        if is_dtensor(v):
            if v.placements != p.placements or v.device_mesh != p.device_mesh:
                v = v.redistribute(p.device_mesh, p.placements)
            return v.to_local()
        if tuple(v.shape) == tuple(p.shape):
            return _api().distribute_tensor(v.detach().to(p.device), p.device_mesh, p.placements,
                                            src_data_rank=None).to_local()
    return v


def partial_sum(params: Sequence[Tensor], owner: str) -> Optional[Any]:
    """For a two-phase rule (Prodigy): a function summing its partial sums over the ranks
    that hold the other shards of ``params`` -- a ZeRO-3 layer's chunks (their
    ``funcopt_process_group``) or DTensors sharded over a device mesh (every mesh
    dimension they are ``Shard``-ed on) -- or None (nothing sharded: one process's sums).
    Raises ``ValueError`` for sharded and replicated parameters mixed (a replicated one
    would be counted once per rank) or shards over different groups."""
    import torch.distributed as dist

    groups = []
    plain = 0
    for p in params:
        if getattr(p, "funcopt_flat_chunk", False):
            groups.append(("chunk", getattr(p, "funcopt_process_group", None)))
        elif is_dtensor(p):
            mesh = p.device_mesh
            dims = tuple(d for d, pl in enumerate(p.placements) if pl.is_shard())
            groups.append(("mesh", (mesh, dims)) if dims else ("plain", None))
            plain += 0 if dims else 1
        else:
            plain += 1
    sharded = [g for g in groups if g[0] != "plain"]
    if not sharded:
        return None
    if plain:
        raise ValueError(f"{owner} sums over every parameter, and {plain} of them are replicated on every rank "
                         f"while the others are sharded (each rank would count the replicated ones once): "
                         f"give {owner} the sharded parameters only, or none")
    first = sharded[0]
    if any(g[0] != first[0] or g[1] is not first[1] and g[1] != first[1] for g in sharded):
        raise ValueError(f"{owner}: its parameters are sharded over different process groups or meshes; "
                         f"its sums need one")
    if first[0] == "chunk":
        pg = first[1]
        pgs = [pg]
    else:
        mesh, dims = first[1]
        pgs = [mesh.get_group(d) for d in dims]

    def total(t: Tensor) -> Tensor:
        buf = t.clone()
        for pg in pgs:
            backend = dist.get_backend(pg)
            x = buf.to(torch.device("cuda", torch.cuda.current_device())) if backend == "nccl" else buf
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=pg)
            buf = x.to(t.device)
        return buf

    return total


def view_for(params: Sequence[Tensor], owner: str, whole_params: bool, differentiable: bool) -> Optional[LocalView]:
    """A :class:`LocalView` when ``params`` hold DTensors (a :class:`GatherView` for a
    rule that needs each parameter whole, ``whole_params``: collective, call on every
    rank); ``None`` for plain tensors, or for ``differentiable=True`` groups (stepped
    through DTensor dispatch, as torch.optim does)."""
    if not any(is_dtensor(p) for p in params):
        return None
    if differentiable:
        return None
    return GatherView(params) if whole_params else LocalView(params)
