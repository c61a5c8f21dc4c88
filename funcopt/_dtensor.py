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

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

try:  # torch.distributed may be built without DTensor
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # pragma: no cover - such a torch has no DTensor parameters either
    DTensor = None  # type: ignore[assignment,misc]
    distribute_tensor = None  # type: ignore[assignment]


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


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
        if not is_dtensor(p) or name == "step" or value.shape != self.step_params[i].shape:
            return value
        hit = cache.get(id(value))
        if hit is not None and hit[0] is value:
            return hit[1]
        wrapped = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False,
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
                v = to_shard(v, p)
            out[name] = v
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
            return distribute_tensor(v.detach().to(p.device), p.device_mesh, p.placements,
                                     src_data_rank=None).to_local()
    return v


def view_for(params: Sequence[Tensor], owner: str, whole_params: bool, differentiable: bool) -> Optional[LocalView]:
    """A :class:`LocalView` when ``params`` hold DTensors; ``None`` for plain tensors, or
    for ``differentiable=True`` groups (stepped through DTensor dispatch, as torch.optim
    does).  A rule that needs each parameter whole (``whole_params``: Adafactor's
    row/column statistics, Muon's orthogonalization) is refused on DTensor parameters,
    before anything changes: a shard is not the whole parameter, and the global
    reductions it would need are not implemented yet."""
    if DTensor is None or not any(is_dtensor(p) for p in params):
        return None
    if whole_params:
        raise NotImplementedError(
            f"{owner}: DTensor parameters (FSDP2 fully_shard, tensor parallel) are not supported: {owner}'s "
            "update needs each parameter whole and each rank holds a shard; use an elementwise rule "
            "(Adam, AdamW, SGD, ...) or step the full parameters")
    if differentiable:
        return None
    return LocalView(params)
