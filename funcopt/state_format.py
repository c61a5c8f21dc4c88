"""The ``torch.optim`` state-dict format, in one place.

A ``torch.optim`` state dict is ``{"state": {id: {slot: value}}, "param_groups":
[{hyperparameters..., "params": [id, ...], "param_names": [...]?}]}``.  Ids are
assigned in ``param_groups`` order, a parameter that appears twice keeps its
first id, and keys of ``optimizer.state`` that are not parameters are kept as
they are.  Every funcopt layer that reads or writes this format (the
optimizers, ZeRO's consolidated and sharded checkpoints, the RPC optimizer)
goes through the functions here:

* :func:`pack`: ``param_groups`` + a ``{param: entry}`` mapping -> state dict;
* :func:`check_container` and :func:`match_groups`: the structural checks of a
  load (group count and sizes, ids), each failure a ``ValueError`` that names
  the bad entry;
* :func:`merge_group`: the group a load installs (saved hyperparameters,
  defaults for keys an older release did not save, the live ``params``,
  ``param_names`` as torch keeps them);
* :func:`convert_entry`: one parameter's saved state -> tensors shaped,
  typed and placed like the parameter (``step`` as a float32 scalar).

Nothing here mutates an optimizer: loads validate everything first and
install the result afterwards (see :meth:`funcopt.Optimizer.load_state_dict`).
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

# keys of a param group that are not hyperparameters
NON_HYPER = ("params", "param_names")


def param_ids(param_groups: Sequence[Mapping[str, Any]]) -> Tuple[Dict[int, int], List[List[int]]]:
    """torch's id assignment: ``({id(param): state id}, per-group id lists)``."""
    mapping: Dict[int, int] = {}
    per_group: List[List[int]] = []
    start = 0
    for group in param_groups:
        params = group["params"]
        for i, p in enumerate(params, start):
            mapping.setdefault(id(p), i)
        per_group.append([mapping[id(p)] for p in params])
        start += len(params)
    return mapping, per_group


def hyperparameters(group: Mapping[str, Any]) -> Dict[str, Any]:
    """A param group without its parameters (``params``, ``param_names``)."""
    return {k: v for k, v in group.items() if k not in NON_HYPER}


def pack_groups(param_groups: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """``param_groups`` as a state dict writes them (ids instead of tensors)."""
    _, ids = param_ids(param_groups)
    out = []
    for group, gids in zip(param_groups, ids):
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = gids
        out.append(packed)
    return out


def pack(param_groups: Sequence[Mapping[str, Any]], state: Mapping[Any, Any]) -> Dict[str, Any]:
    """The state dict of ``param_groups`` and ``state`` (``{param: entry}``;
    non-tensor keys are kept as they are).  Tensors are returned by reference,
    as torch does."""
    mapping, _ = param_ids(param_groups)
    groups = pack_groups(param_groups)
    packed_state: Dict[Any, Any] = {}
    for key, entry in state.items():
        if isinstance(key, Tensor):
            if id(key) in mapping and entry:
                packed_state[mapping[id(key)]] = dict(entry)  # a plain dict: weights_only loads it
        else:
            packed_state[key] = entry
    return {"state": packed_state, "param_groups": groups}


def check_container(owner: str, state_dict: Any) -> Tuple[List[Dict[str, Any]], Dict[Any, Any]]:
    """``(saved param_groups, saved state)`` after checking the outer structure."""
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError(f"{owner}.load_state_dict: expected a dict with keys 'state' and 'param_groups'")
    groups, state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(groups, (list, tuple)) or not isinstance(state, Mapping):
        raise ValueError(f"{owner}.load_state_dict: 'param_groups' must be a list and 'state' a dict")
    for g, saved in enumerate(groups):
        if not isinstance(saved, Mapping) or "params" not in saved:
            raise ValueError(f"{owner}.load_state_dict: param group {g} has no 'params'")
        if not isinstance(saved["params"], (list, tuple)):
            raise ValueError(f"{owner}.load_state_dict: param group {g}: 'params' must be a list of ids")
    return list(groups), dict(state)


def match_groups(owner: str, saved_groups: Sequence[Mapping[str, Any]],
                 groups: Sequence[Mapping[str, Any]]) -> Dict[Any, Tuple[int, int]]:
    """Check group count and sizes; ``{saved id: (group, position)}``.

    A saved id may repeat (torch writes a parameter that appears in two groups
    with its first id); it then maps to its first position."""
    if len(saved_groups) != len(groups):
        raise ValueError(
            f"{owner}.load_state_dict: state dict has {len(saved_groups)} param groups, "
            f"optimizer has {len(groups)}"
        )
    id_map: Dict[Any, Tuple[int, int]] = {}
    for g, (saved, group) in enumerate(zip(saved_groups, groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"{owner}.load_state_dict: param group {g} has {len(saved['params'])} params in the "
                f"state dict but {len(group['params'])} in the optimizer"
            )
        for j, sid in enumerate(saved["params"]):
            try:
                first = id_map.setdefault(sid, (g, j))
            except TypeError:
                raise ValueError(f"{owner}.load_state_dict: param group {g} has an unhashable id {sid!r}") from None
            if first != (g, j) and groups[first[0]]["params"][first[1]] is not group["params"][j]:
                raise ValueError(
                    f"{owner}.load_state_dict: parameter id {sid!r} appears twice in the state dict "
                    f"(groups {first[0]} and {g}) for two different parameters"
                )
    return id_map


def missing_keys(saved: Mapping[str, Any], defaults: Mapping[str, Any]) -> List[str]:
    """Hyperparameters a saved group lacks that no default may stand in for.

    torch fills only its switches (``maximize``, ``foreach``, ``fused``,
    ``capturable``, ``differentiable``, ``amsgrad``...: booleans or None) for
    checkpoints of older releases; a group without ``lr`` or ``betas`` is not
    this optimizer's."""
    return sorted(k for k, v in defaults.items()
                  if k not in saved and not (v is None or isinstance(v, bool)))


def merge_group(saved: Mapping[str, Any], group: Mapping[str, Any], defaults: Mapping[str, Any]) -> Dict[str, Any]:
    """The group a load installs: the saved hyperparameters, ``defaults`` for
    keys the saved group lacks (checkpoints of older releases, as torch's
    ``__setstate__`` fills them), the live ``params``; ``param_names`` from the
    state dict, else the optimizer's own (torch's rule)."""
    new = {k: v for k, v in defaults.items()}
    new.update({k: v for k, v in saved.items() if k != "params"})
    new["params"] = group["params"]
    if "param_names" not in saved and "param_names" in group:
        new["param_names"] = group["param_names"]
    return new


def convert_entry(owner: str, sid: Any, p: Tensor, entry: Any, slots: Sequence[Tuple[str, bool]],
                  step_on_param_device: bool, keep: bool = False,
                  shapes: Optional[Mapping[str, Any]] = None) -> List[Tensor]:
    """One parameter's saved state as tensors in slot order (``torch.empty(0)``
    for absent slots); raises ``ValueError`` naming the bad item.

    ``slots``: ``(name, present)`` per slot.  ``step`` (a tensor or number)
    becomes a float32 scalar on the CPU, or on the parameter's device with
    ``step_on_param_device`` (fused kernels).  Other state must have the
    parameter's shape and a floating (or, for complex parameters, complex)
    dtype; it is copied into a tensor laid out like the parameter, with the
    parameter's dtype and device (torch.optim also casts floating state).
    ``keep`` (``differentiable=True`` groups): a tensor that already has the
    parameter's dtype, device and strides is used as it is, so gradients flow
    through state the caller supplied, as in torch.  ``shapes``: a slot's shape
    where it is not the parameter's (Adafactor's factored ``row_var``/``col_var``)."""
    expected = {name for name, on in slots if on}
    if not isinstance(entry, Mapping) or set(entry) != expected:
        got = sorted(map(str, entry)) if isinstance(entry, Mapping) else type(entry).__name__
        raise ValueError(
            f"{owner}.load_state_dict: state of parameter {sid!r} has keys {got}, expected {sorted(expected)}"
        )
    vals: List[Tensor] = []
    for name, on in slots:
        if not on:
            vals.append(torch.empty(0))
            continue
        v = entry[name]
        if name == "step":
            if isinstance(v, Tensor):
                if v.numel() != 1 or v.is_complex():
                    raise ValueError(f"{owner}.load_state_dict: 'step' of parameter {sid!r} must be a scalar")
                val = v.detach().reshape(())
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                val = torch.tensor(float(v))
            else:
                raise ValueError(f"{owner}.load_state_dict: 'step' of parameter {sid!r} is {type(v).__name__}")
            device = p.device if step_on_param_device else torch.device("cpu")
            vals.append(val.to(dtype=torch.float32, device=device).clone())
            continue
        if not isinstance(v, Tensor):
            raise ValueError(f"{owner}.load_state_dict: '{name}' of parameter {sid!r} is not a tensor")
        want = tuple(p.shape) if shapes is None or shapes.get(name) is None else tuple(shapes[name])
        if tuple(v.shape) != want:
            raise ValueError(
                f"{owner}.load_state_dict: '{name}' of parameter {sid!r} has shape {tuple(v.shape)}, "
                + (f"parameter has {tuple(p.shape)}" if want == tuple(p.shape) else f"expected {want}")
            )
        # real state shaped otherwise than a complex parameter (NAdam's mu_product,
        # ASGD's eta and mu: 0-d) stays real, in its dtype, as torch keeps it
        real_aside = want != tuple(p.shape) and p.is_complex() and v.is_floating_point()
        if not (v.is_floating_point() or v.is_complex()) or (v.is_complex() != p.is_complex() and not real_aside):
            raise ValueError(
                f"{owner}.load_state_dict: '{name}' of parameter {sid!r} has dtype {v.dtype}, "
                f"parameter has {p.dtype}"
            )
        if want != tuple(p.shape):
            out = torch.empty(want, dtype=v.dtype if real_aside else p.dtype, device=p.device)
            out.copy_(v.detach())
            vals.append(out)
            continue
        if keep and v.dtype == p.dtype and v.device == p.device and v.stride() == p.stride():
            vals.append(v)
            continue
        # laid out like the parameter (a fused kernel reads both as flat memory)
        out = torch.empty_like(p, memory_format=torch.preserve_format)
        out.copy_(v.detach())
        vals.append(out)
    return vals


def entries_equal(a: Any, b: Any) -> bool:
    """Identity comparison of two ``{slot: tensor}`` entries (no tensor reads)."""
    if not isinstance(a, Mapping) or not isinstance(b, Mapping) or set(a) != set(b):
        return False
    return all(a[k] is b[k] for k in a)


def iter_params(param_groups: Iterable[Mapping[str, Any]]) -> List[Tensor]:
    """Every parameter of ``param_groups``, in order."""
    return [p for g in param_groups for p in g["params"]]


def find_duplicate(params: Sequence[Tensor]) -> Optional[int]:
    """Index of the first parameter that already appeared, or None."""
    seen = set()
    for i, p in enumerate(params):
        if id(p) in seen:
            return i
        seen.add(id(p))
    return None
