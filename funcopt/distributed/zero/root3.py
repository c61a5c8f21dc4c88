"""ZeRO-3 roots: :class:`Zero3Sequential` and what both roots share.

A root owns the schedule of its layers (execution order, prefetch, one
gradient bucketer, the end-of-backward callback) and the whole-model
operations: the unsharded ``state_dict`` gathered to one rank and loaded from
one rank, gradient clipping over every rank's shards with one all-reduce, and
the list of this rank's chunks that sharded checkpoints are built on.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.profiler import record_function

from .._comm import agree, comm_device, rank_and_size
from .schedule3 import ChunkInfo, Zero3Schedule
from .stage3 import Zero3Layer


class Zero3Root:
    """Whole-model operations of a ZeRO-3 root (mixed into the root modules).

    A root lists its layers as ``(key prefix, layer)`` pairs (:meth:`zero3_units`);
    the unsharded model's ``state_dict`` key of a layer entry is the prefix
    followed by the key within the layer's module.
    """

    process_group: Any

    def zero3_units(self) -> List[Tuple[str, Zero3Layer]]:  # pragma: no cover - abstract
        """``(state-dict key prefix, layer)`` for every layer of the root."""
        raise NotImplementedError

    def full_key_order(self) -> Optional[List[str]]:
        """The unsharded model's key order, when it is not the units' order."""
        return None

    def get_trainable_chunk(self) -> List[nn.Parameter]:
        """Every layer's trainable chunk (what this rank's optimizer steps)."""
        return [layer.trainable_chunk for _, layer in self.zero3_units() if layer.trainable_chunk is not None]

    # ---------------------------------------------------------- full state
    def full_state_dict(self, to: int = 0) -> Dict[str, Tensor]:
        """The unsharded model's ``state_dict()`` on group rank ``to``; ``{}`` elsewhere.

        Original names, shapes and dtypes; gathered layer by layer (rank ``to``
        holds the result, the others only one layer's chunk at a time).
        Call on every rank.

        Example::

            sd = model.full_state_dict(to=0)
            if rank == 0:
                torch.save(sd, "model.pt")   # loads into the unwrapped model
        """
        rank, world = rank_and_size(self.process_group)
        if not 0 <= to < world:
            raise ValueError(f"full_state_dict: to={to} is not a rank of the group (size {world})")
        out: Dict[str, Tensor] = {}
        with record_function("funcopt::zero3/full_state_dict"):
            for prefix, layer in self.zero3_units():
                for key, value in layer.full_state(to).items():
                    out[prefix + key] = value
        order = self.full_key_order()
        if rank == to and order is not None:
            out = {k: out[k] for k in order if k in out}
        return out

    def _expected_keys(self) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
        return {prefix + key: (shape, dtype) for prefix, layer in self.zero3_units()
                for key, shape, dtype in layer.full_state_keys()}

    def load_full_state_dict(self, state_dict: Dict[str, Tensor], src: int = 0) -> None:
        """Load the unsharded model's ``state_dict`` passed on group rank ``src``.

        The other ranks may pass ``{}``.  Works whatever world size wrote it
        (it is the unwrapped model's format).  Everything is checked on ``src``
        first (exact keys, shapes, tensors); a problem raises
        ``DistributedError`` on every rank and changes nothing.
        Call on every rank.

        Example::

            model.load_full_state_dict(torch.load("model.pt") if rank == 0 else {}, src=0)
        """
        rank, world = rank_and_size(self.process_group)
        if not 0 <= src < world:
            raise ValueError(f"load_full_state_dict: src={src} is not a rank of the group (size {world})")
        error = None
        if rank == src:
            error = _check_state(state_dict, self._expected_keys())
        agree(error, self.process_group, "load_full_state_dict")
        with record_function("funcopt::zero3/load_full_state_dict"):
            for prefix, layer in self.zero3_units():
                part = {}
                if rank == src:
                    n = len(prefix)
                    part = {k[n:]: v for k, v in state_dict.items() if k.startswith(prefix)}
                layer.load_full_state(part, src)

    # ----------------------------------------------------------- gradients
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the gradients of the whole (unsharded) model by their global norm.

        The same norm and the same clipping as ``torch.nn.utils.clip_grad_norm_``
        on the unsharded model: each rank reduces its gradient shards to one
        number, one all-reduce (sum, or max for ``inf``) combines them, and
        every shard is scaled by ``min(1, max_norm / (norm + 1e-6))``.
        Call on every rank (after backward, before the step).

        Args:
          max_norm: the largest norm allowed.
          norm_type: the p of the p-norm (default 2.0); ``float("inf")`` for the max norm.

        Returns:
          the total norm (a scalar tensor, the same on every rank).

        Example::

            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
        """
        norm_type = float(norm_type)
        grads = [c.grad for c in self.get_trainable_chunk() if c.grad is not None]
        device = grads[0].device if grads else comm_device(self.process_group)
        with record_function("funcopt::zero3/clip_grad_norm"):
            if math.isinf(norm_type):
                local = torch.stack([g.abs().max() for g in grads if g.numel()]).max() if grads else None
                part = torch.zeros((), dtype=torch.float32, device=device) if local is None else local.float()
                dist.all_reduce(part, op=dist.ReduceOp.MAX, group=self.process_group)
                total = part
            else:
                part = torch.zeros((), dtype=torch.float32, device=device)
                for g in grads:
                    part += torch.linalg.vector_norm(g.float(), norm_type) ** norm_type
                dist.all_reduce(part, group=self.process_group)
                total = part ** (1.0 / norm_type)
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.to(g.dtype))
        return total

    # ------------------------------------------------------------ shards
    def sharded_chunks(self) -> List[ChunkInfo]:
        """This rank's chunks with their place in the global flats (no communication).

        One :class:`~funcopt.distributed.zero.schedule3.ChunkInfo` per chunk, named
        by its name in ``named_parameters()`` (so in the optimizer's order):
        ``offset``/``length`` place the local chunk in the padded global flat,
        ``valid`` says how many of its elements are real, ``numel`` is the
        flat's unpadded size, ``params`` the full state-dict keys, flat offsets
        and shapes of the parameters in it.  Sharded checkpoints build on this.
        """
        names = {id(p): n for n, p in self.named_parameters()}  # type: ignore[attr-defined]
        out = []
        for prefix, layer in self.zero3_units():
            for info in layer.chunk_infos(key_prefix=prefix):
                out.append(ChunkInfo(name=names.get(id(info.tensor), info.name), tensor=info.tensor,
                                     trainable=info.trainable, offset=info.offset, length=info.length,
                                     valid=info.valid, numel=info.numel, world=info.world, params=info.params))
        return out

    def save_sharded(self, path: str, optimizer: Any = None) -> None:
        """Write this rank's chunks (and ``optimizer``'s state for them) under directory ``path``.

        The same checkpoint layer as ZeRO-1/2
        (:func:`funcopt.distributed.zero.checkpoint.save_sharded`: DCP, one
        commit record, published atomically): each rank writes only its
        pieces of every chunk, at their offsets in the unpadded flat, so the
        checkpoint loads at any world size.

        Args:
          path: a directory (created if missing).
          optimizer: default ``None``; an optimizer over ``self.parameters()``
            (funcopt or ``torch.optim``) whose state and hyperparameters are
            saved with the model.

        Raises:
          DistributedError: on every rank if any rank failed; the checkpoint
            committed before (if any) is still the one ``path`` holds.

        Call on every rank.

        Example::

            model.save_sharded("ckpt", optimizer=opt)       # at W=4
            model.load_sharded("ckpt", optimizer=opt)       # later, at any W
        """
        from . import checkpoint
        checkpoint.save_sharded(self, path, optimizer)

    def load_sharded(self, path: str, optimizer: Any = None) -> None:
        """Load a :meth:`save_sharded` checkpoint, written at any world size.

        All or nothing: every file is checked against the commit record and
        the checkpoint must be for this model (chunk names, sizes, dtypes,
        buffers) and, given ``optimizer``, for its algorithm and groups.

        Args:
          path: the checkpoint directory.
          optimizer: default ``None`` (the model only); the optimizer over
            ``self.parameters()`` to load the saved optimizer state into.

        Raises:
          DistributedError: on every rank, with the same message, if any rank
            found a problem; nothing has changed on any rank.

        Call on every rank.
        """
        from . import checkpoint
        checkpoint.load_sharded(self, path, optimizer)


def _check_state(state: Any, expected: Dict[str, Tuple[Tuple[int, ...], torch.dtype]]) -> Optional[str]:
    if not isinstance(state, dict):
        return f"expected a dict, got {type(state).__name__}"
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    problems = []
    if missing:
        problems.append(f"missing keys {missing[:5]}" + (" ..." if len(missing) > 5 else ""))
    if unexpected:
        problems.append(f"unexpected keys {unexpected[:5]}" + (" ..." if len(unexpected) > 5 else ""))
    for k, (shape, _) in expected.items():
        v = state.get(k)
        if k not in state:
            continue
        if not isinstance(v, Tensor):
            problems.append(f"{k}: expected a tensor, got {type(v).__name__}")
        elif tuple(v.shape) != tuple(shape):
            problems.append(f"{k}: shape {tuple(v.shape)}, expected {tuple(shape)}")
    return "; ".join(problems) if problems else None


class Zero3Sequential(Zero3Root, nn.Module):
    """Run :class:`Zero3Layer` layers in order, prefetching the next one.

    The ZeRO-3 root for a straight stack (labml.ai's ``Zero3Sequential``):
    ``parameters()`` yields exactly the layers' chunks, so an optimizer built on
    ``model.parameters()`` keeps ``1/W`` of the state per rank.  Forward gathers
    layer ``i + 1`` while layer ``i`` runs; backward gathers layer ``i - 1``
    while layer ``i``'s gradients are computed, and each layer's gradients are
    reduce-scattered as soon as its backward is done.  ``full_state_dict()``
    has exactly the keys of ``nn.Sequential(m0, m1, ...).state_dict()``.
    Call on every rank.

    Args:
      layers: the :class:`Zero3Layer` s, in execution order (one process group).

    Example::

        model = Zero3Sequential([Zero3Layer(m, rank, world_size, device, dtype) for m in modules])
        opt = funcopt.AdamW(model.parameters(), lr=1e-3)
        for x, y in data:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            model.clip_grad_norm_(1.0)
            opt.step()
    """

    def __init__(self, layers: Sequence[Zero3Layer]):
        nn.Module.__init__(self)
        layers = list(layers)
        if not layers:
            raise ValueError("Zero3Sequential: no layers")
        for i, layer in enumerate(layers):
            if not isinstance(layer, Zero3Layer):
                raise TypeError(f"Zero3Sequential: layer {i} is a {type(layer).__name__}, not a Zero3Layer")
        if len({id(layer) for layer in layers}) != len(layers):
            raise ValueError("Zero3Sequential: a layer appears twice")
        self.process_group = layers[0].process_group
        self.module_list = nn.ModuleList(layers)
        schedule = Zero3Schedule(self.process_group, order=layers, root=self)
        for i, layer in enumerate(layers):
            layer.layer_idx = i
            layer.label = str(i)
            layer.attach(schedule)
        self.schedule = schedule

    def zero3_units(self) -> List[Tuple[str, Zero3Layer]]:
        """``("i.", layer i)``: the keys of ``nn.Sequential(m0, m1, ...)``."""
        return [(f"{i}.", layer) for i, layer in enumerate(self.module_list)]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The first layer gets the arguments, each next layer the previous output."""
        self.schedule.begin_forward()
        x = self.module_list[0](*args, **kwargs)
        for layer in list(self.module_list)[1:]:
            x = layer(x)
        self.schedule.end_forward()
        return x
