"""Optimizer state as *pieces*: who holds which elements of which parameter's state.

A piece is ``(param, start, length, {name: value})``: the state of elements
``[start, start + length)`` of parameter ``param`` (global index, in
``param_groups`` order).  A *whole* piece (``start == 0``, ``length == numel``)
keeps its values as the local optimizer holds them (parameter-shaped tensors,
or anything an eager ``torch.optim`` class stores); a partial piece holds
1-D element tensors.  0-d tensors of a partial piece (``step``) are per-piece
scalars, equal on every piece of a parameter.

These functions cut pieces into a rank's local state and assemble them into
the full ``torch.optim`` state; ZeRO's consolidation, ``load_state_dict``,
``add_param_group`` and the sharded checkpoints all go through them.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .layout import Segment

Piece = Tuple[int, int, int, Dict[str, Any]]


def is_whole(start: int, length: int, numel: int) -> bool:
    return start == 0 and length == numel


def local_pieces(segments: Sequence[Segment], local_state: Dict[Any, Dict[str, Any]]) -> List[Piece]:
    """A local optimizer's ``state_dict()["state"]`` (keyed by local index, one per
    segment) as pieces, tensors detached and on the CPU."""
    out: List[Piece] = []
    for k, s in enumerate(segments):
        if k in local_state:
            entry = {n: (t.detach().cpu() if isinstance(t, Tensor) else t) for n, t in local_state[k].items()}
            out.append((s.param, s.start, s.length, entry))
    return out


# (param, slot name) -> the slot's shape in the full state (None: the parameter's); see
# ShardState: Prodigy keeps s and p0 flattened, as prodigyopt does
SlotShape = Optional[Callable[[int, str], Optional[Tuple[int, ...]]]]


def element_shape(i: int, name: str, shape: Tuple[int, ...], slot_shape: SlotShape) -> Tuple[int, ...]:
    """The shape slot ``name`` of parameter ``i`` (of ``shape``) has as one value per element."""
    if slot_shape is not None:
        want = slot_shape(i, name)
        if want is not None and numel_of(want) == numel_of(shape):
            return tuple(want)
    return tuple(shape)


def _shape_like(t: Tensor, shape: Tuple[int, ...]) -> Tensor:
    """A flat element tensor of a whole parameter in ``shape`` (the parameter's or its slot's)."""
    if t.dim() == 1 and tuple(t.shape) != tuple(shape) and t.numel() == numel_of(shape):
        return t.reshape(shape)
    return t


def numel_of(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def segment_state(s: Segment, have: List[Tuple[int, int, Dict[str, Any]]], shape: Tuple[int, ...],
                  local_shape: Tuple[int, ...], slot_shape: SlotShape = None) -> Dict[str, Any]:
    """The state of segment ``s`` (of a parameter of ``shape``) cut from the pieces
    ``have`` = [(start, length, entry)] of that parameter; element tensors come out
    in ``local_shape`` (the parameter's or its slot's shape for a whole segment, else 1-D)."""
    numel = numel_of(shape)
    have = sorted(have, key=lambda x: x[0])
    if is_whole(s.start, s.length, numel):
        for start, length, entry in have:
            if is_whole(start, length, numel):
                return {n: (_shape_like(v, element_shape(s.param, n, local_shape, slot_shape)).clone()
                            if isinstance(v, Tensor) else v) for n, v in entry.items()}
    out: Dict[str, Any] = {}
    for name, first in have[0][2].items():
        if not isinstance(first, Tensor) or first.dim() == 0:
            out[name] = first.clone() if isinstance(first, Tensor) else first
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
        flat = torch.cat(parts) if parts else first.new_empty(0)
        out[name] = flat.view(local_shape)
    return out


def full_state(pieces: Sequence[Piece], shapes: Sequence[Tuple[int, ...]],
               slot_shape: SlotShape = None) -> Dict[int, Dict[str, Any]]:
    """The ``torch.optim`` ``state`` (keyed by global parameter index) assembled from pieces;
    element tensors in their slot's shape (``slot_shape``), by default the parameter's."""
    by_param: Dict[int, List[Tuple[int, int, Dict[str, Any]]]] = {}
    for i, start, length, entry in pieces:
        by_param.setdefault(i, []).append((start, length, entry))
    state: Dict[int, Dict[str, Any]] = {}
    for i, have in sorted(by_param.items()):
        shape = tuple(shapes[i])
        numel = numel_of(shape)
        whole = [e for start, length, e in have if is_whole(start, length, numel)]
        if whole:
            state[i] = {n: (_shape_like(v, element_shape(i, n, shape, slot_shape)) if isinstance(v, Tensor) else v)
                        for n, v in whole[0].items()}
            continue
        have.sort(key=lambda x: x[0])
        entry: Dict[str, Any] = {}
        for name, first in have[0][2].items():
            if not isinstance(first, Tensor) or first.dim() == 0:
                entry[name] = first
            else:
                entry[name] = torch.cat([e[name].reshape(-1) for _, _, e in have]).view(
                    element_shape(i, name, shape, slot_shape))
        state[i] = entry
    return state
