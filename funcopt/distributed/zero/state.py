"""Sharded optimizer state: this rank's local optimizer over the segments it owns, and its
state as pieces (see :mod:`funcopt.distributed.zero._pieces`).

ZeRO's consolidation, ``load_state_dict``, ``add_param_group`` and the
sharded checkpoints all read and write the state through :class:`ShardState`.
"""
from __future__ import annotations

import collections

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ... import state_format
from . import _pieces
from .layout import Segment

_NOT_HYPER = state_format.NON_HYPER

# (param, start, length, {name: value}), see _pieces
Piece = _pieces.Piece


def hyperparameters(group: Dict[str, Any]) -> Dict[str, Any]:
    """A param group without ``params`` and the other non-hyperparameter keys."""
    return {k: v for k, v in group.items() if k not in _NOT_HYPER}


def cut_problem(cls: Any, segments: Sequence[Segment], params: List[Tensor],
                param_groups: List[Dict[str, Any]]) -> Optional[str]:
    """Why the funcopt class ``cls`` cannot step the element ranges ``segments`` (every
    rank's) cut from ``params``: a slot that is not one value per element (Prodigy's ``s``
    with ``slice_p > 1``: every slice_p-th element of the whole parameter); None if it can."""
    group_of = [g for g in param_groups for _ in g["params"]]
    for s in segments:
        p = params[s.param]
        if _pieces.is_whole(s.start, s.length, p.numel()):
            continue
        for name, _ in cls.slots:
            try:
                shape = cls.slot_shape(name, p, group_of[s.param])
            except (TypeError, ValueError):  # a bad option: refused by the class's own checks
                continue
            if shape is not None and len(shape) > 0 and _pieces.numel_of(shape) != p.numel():
                return (f"partition='flat' cuts parameter {s.param} (shape {tuple(p.shape)}) between ranks, but "
                        f"{cls.__name__}'s state '{name}' of it has shape {tuple(shape)}, not one value per "
                        f"element (its param group's options): use partition='greedy' (whole parameters)")
    return None


class ShardState:
    """The local optimizer over ``segments`` and the conversions of its state.

    Args:
      segments: this rank's segments (``Layout.segments(rank)``).
      params: all parameters, in ``param_groups`` order.
      param_groups: the ZeRO optimizer's groups (hyperparameters are copied).
      homes: each parameter's contiguous 1-D home (see ``_sync.ParamSync``).
      shadowed: indices of parameters whose home is a copy.
      make_optimizer: builds the local optimizer from torch-style param groups.
      eager: the local optimizer is a ``torch.optim`` class run eagerly (it
        steps whole parameters in place and keeps its own state format).
    """

    def __init__(self, segments: Sequence[Segment], params: List[Tensor], param_groups: List[Dict[str, Any]],
                 homes: List[Tensor], shadowed: Sequence[int], make_optimizer: Callable[[List[Dict[str, Any]]], Any],
                 eager: bool):
        self.segments = list(segments)
        self.eager = eager
        self.shapes = [tuple(p.shape) for p in params]
        gid = [g for g, group in enumerate(param_groups) for _ in group["params"]]
        groups: List[Dict[str, Any]] = [dict(hyperparameters(g), params=[]) for g in param_groups]
        shadow = set(shadowed)
        # a whole parameter is the parameter itself (as in torch; ``optim.state[p]`` works),
        # except a shadowed one under a funcopt algorithm (its home in the parameter's
        # shape); a partial segment is a 1-D view of the home
        self.tensors: List[Tensor] = []
        self.local_shapes: List[Optional[Tuple[int, ...]]] = []  # None: a 1-D element range
        for s in self.segments:
            p = params[s.param]
            if _pieces.is_whole(s.start, s.length, p.numel()):
                t = p if (eager or s.param not in shadow) else homes[s.param].view(p.shape)
                self.local_shapes.append(tuple(p.shape))
            else:
                t = homes[s.param][s.start: s.start + s.length]
                self.local_shapes.append(None)
            self.tensors.append(t)
            groups[gid[s.param]]["params"].append(t)
        self.local_gid = [gid[s.param] for s in self.segments]
        self.optim = make_optimizer(groups)
        # the full state keeps each slot in the class's shape (Prodigy's flattened s and p0)
        self._slot_shape: _pieces.SlotShape = None
        # the groups of the last step (or build, or load) that went through: an option a user
        # edited since (refused by the next step, or not yet stepped) does not reshape the state
        self._groups_seen: List[Dict[str, Any]] = []
        self.note_groups()
        if not eager:
            cls, seen = type(self.optim), self._groups_seen
            names = {name for name, _ in cls.slots}  # not the state dict's other keys (SOAP's GG list)
            self._slot_shape = lambda i, name: (cls.slot_shape(name, params[i], seen[gid[i]])
                                                if name in names else None)

    def note_groups(self) -> None:
        """Record the local optimizer's options after a step or load that went through.  Local."""
        self._groups_seen[:] = [{k: v for k, v in g.items() if k != "params"} for g in self.optim.param_groups]

    def view(self, params: List[Tensor]) -> Dict[Any, Dict[str, Any]]:
        """What ZeRO shows as ``state``: every parameter, with the local optimizer's
        entry where this rank owns it whole and ``{}`` elsewhere."""
        out: Dict[Any, Dict[str, Any]] = collections.defaultdict(dict)
        for p in params:
            out[p] = {}
        local = self.optim.state
        for s, t in zip(self.segments, self.tensors):
            if t is params[s.param] and t in local:
                out[t] = local[t]
        return out

    # ------------------------------------------------------------ pieces
    def pieces(self) -> List[Piece]:
        """This rank's state as pieces, tensors detached and on the CPU.  Local."""
        return _pieces.local_pieces(self.segments, self.optim.state_dict()["state"])

    def flat_pieces(self) -> List[Piece]:
        """:meth:`pieces` with every element tensor (one value per element of the piece)
        flattened to 1-D; 0-d tensors and a whole piece's slots of their own shape
        (Adafactor's factored rows and columns) kept as they are."""
        return [(i, start, length, {n: (t.reshape(-1) if isinstance(t, Tensor) and t.dim() > 0
                                        and t.numel() == length else t)
                                    for n, t in entry.items()})
                for i, start, length, entry in self.pieces()]

    def local_state_dict(self, pieces: Sequence[Piece]) -> Dict[str, Any]:
        """The local optimizer's state dict, cut from any pieces covering our segments."""
        by_param: Dict[int, List[Tuple[int, int, Dict[str, Any]]]] = {}
        for i, start, length, entry in pieces:
            by_param.setdefault(i, []).append((start, length, entry))
        state: Dict[int, Dict[str, Any]] = {}
        for k, (s, shape) in enumerate(zip(self.segments, self.local_shapes)):
            have = by_param.get(s.param)
            if have:
                state[k] = _pieces.segment_state(s, have, self.shapes[s.param],
                                                 shape if shape is not None else (s.length,), self._slot_shape)
        groups = [dict({k: v for k, v in g.items() if k != "params"}, params=[]) for g in self.optim.param_groups]
        for k, gi in enumerate(self.local_gid):
            groups[gi]["params"].append(k)
        return {"state": state, "param_groups": groups}

    def stage(self, pieces: Sequence[Piece], hyper: Optional[List[Dict[str, Any]]] = None) -> Any:
        """Check the state cut from ``pieces`` (and group hyperparameters ``hyper``) without
        changing anything; returns what :meth:`commit` applies.  Raises ``ValueError`` (or
        the core's error) on bad input.  Local."""
        local_sd = self.local_state_dict(pieces)
        for gi, h in enumerate(hyper or []):
            local_sd["param_groups"][gi].update(h)
        # funcopt: the core's stage_state; an eager torch.optim class checks in its load_state_dict
        return local_sd if self.eager else self.optim.stage_state(local_sd)

    def commit(self, staged: Any) -> None:
        """Apply what :meth:`stage` returned.  Local."""
        if self.eager:
            self.optim.load_state_dict(staged)
        else:
            self.optim.commit_state(staged)
        self.note_groups()

    # --------------------------------------------------------- torch format
    def full_state(self, pieces: Sequence[Piece], param_groups: List[Dict[str, Any]]) -> Dict[str, Any]:
        """The ``torch.optim`` state dict assembled from every rank's pieces."""
        return {"state": _pieces.full_state(pieces, self.shapes, self._slot_shape),
                "param_groups": state_format.pack_groups(param_groups)}

    def stage_full(self, state_dict: Dict[str, Any], param_groups: List[Dict[str, Any]]) -> Tuple[List[Dict[str, Any]], Any]:
        """Check a full ``torch.optim`` state dict (from any world size) and cut this rank's
        part; returns (saved groups, staged local state).  Changes nothing.  Local."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
            raise ValueError("expected a dict with keys 'state' and 'param_groups'")
        groups = state_dict["param_groups"]
        if len(groups) != len(param_groups):
            raise ValueError(f"state dict has {len(groups)} param groups, optimizer has {len(param_groups)}")
        ids, flat = {}, 0
        for g, (mine, saved) in enumerate(zip(param_groups, groups)):
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError(f"param group {g} has {len(saved['params'])} params, optimizer has {len(mine['params'])}")
            for sid in saved["params"]:
                ids[sid] = flat
                flat += 1
        cut_params = {s.param for s in self.segments
                      if not _pieces.is_whole(s.start, s.length, _pieces.numel_of(self.shapes[s.param]))}
        pieces = []
        for sid, entry in state_dict["state"].items():
            if sid not in ids:
                raise ValueError(f"state for unknown parameter id {sid!r}")
            i = ids[sid]
            shape = self.shapes[i]
            numel = _pieces.numel_of(shape)
            if not isinstance(entry, dict):
                raise ValueError(f"state of parameter {sid!r} is a {type(entry).__name__}, not a dict")
            if self.eager:  # the class's own state: whole parameters, kept as they are
                pieces.append((i, 0, numel, dict(entry)))
                continue
            # a range of the parameter is cut from parameter-shaped tensors only; a segment
            # holding the whole parameter is checked by the local optimizer (slot shapes:
            # Adafactor's factored rows and columns)
            cut = i in cut_params
            for name, t in entry.items():
                if not (cut and isinstance(t, Tensor) and t.dim() > 0):
                    continue
                want = _pieces.element_shape(i, name, shape, self._slot_shape)
                if tuple(t.shape) != want:
                    raise ValueError(f"'{name}' of parameter {sid!r} has shape {tuple(t.shape)}, expected {want}")
            # a number (torch's old float step, prodigyopt's int step) as a 0-d tensor; lists (SOAP's
            # GG / Q) and other values go to the local optimizer's checks as they are
            pieces.append((i, 0, numel, {n: (torch.tensor(float(t)) if isinstance(t, (int, float))
                                             and not isinstance(t, bool) else t) for n, t in entry.items()}))
        return groups, self.stage(pieces, [hyperparameters(g) for g in groups])

    def nbytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        def tensors(v: Any) -> List[Tensor]:  # a tensor, or a list of them (SOAP's GG / Q)
            return [v] if isinstance(v, Tensor) else [t for t in v if isinstance(t, Tensor)] \
                if isinstance(v, (list, tuple)) else []
        return sum(t.numel() * t.element_size() for e in self.optim.state_dict()["state"].values()
                   for v in e.values() for t in tensors(v))
