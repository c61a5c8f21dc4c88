"""The interface every funcopt optimizer satisfies.

:class:`Optimizer` is the Python face of an algorithm: it is a
``torch.optim.Optimizer`` (so LR schedulers, step hooks and ``zero_grad``
work), keeps ``param_groups`` exactly like torch, and converts state to and
from the torch.optim ``state_dict`` format.  The numbers live in a small
TorchScript-compatible *core* object (``opt.core``): a :class:`~funcopt._slots.Slots`
plus the algorithm's ``step``.  The core is what ``funcopt.script`` compiles
and what a ``torch.jit.script``-ed module can hold as an attribute.

A subclass declares, as class attributes:

* ``torch_class``: the matching ``torch.optim`` class.  It is the oracle for
  defaults, hyperparameter validation (a throw-away instance on a one-element
  tensor raises exactly torch's errors) and the state format.
* ``core_class``: the scriptable core, constructed as ``core_class(slots)``.
* ``slots``: state names in torch's order, each with the group flag that must
  be truthy for it to exist (``None`` = always), e.g. ``max_exp_avg_sq`` only
  with ``amsgrad``.
* ``fused_devices``: device types on which the ATen fused kernel exists.
"""
from __future__ import annotations

import functools
import inspect
import math
import re
from collections.abc import Iterable
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ._slots import Slots

IMPLS = ("auto", "foreach", "fused")
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# torch's own group keys that choose torch's implementation; we keep them in
# param_groups (the state_dict format) but they do not feed the core.
_IMPL_KEYS = ("foreach", "fused", "capturable")
_JIT_MSG = re.compile(r"ValueError: (funcopt: [^\n]*)")


def _flatten_hyper(group: Dict[str, Any]) -> Dict[str, float]:
    """Group dict -> the core's ``Dict[str, float]`` (tuples as key0, key1...)."""
    out: Dict[str, float] = {}
    for key, value in group.items():
        if key in ("params", "param_names") or key in _IMPL_KEYS or value is None:
            continue
        if isinstance(value, (tuple, list)):
            for j, v in enumerate(value):
                out[f"{key}{j}"] = float(v)
        elif isinstance(value, (bool, int, float, Tensor)):
            out[key] = float(value)
    return out


@functools.lru_cache(maxsize=None)
def _torch_kwargs(cls: type) -> frozenset:
    return frozenset(inspect.signature(cls.__init__).parameters) - {"self", "params"}


class Optimizer(torch.optim.Optimizer):
    """Base class of funcopt optimizers (see the module docstring).

    ``step(grads, grad_scale=None, found_inf=None)`` takes one gradient (or
    ``None``) per parameter, in ``param_groups`` order.  ``step()`` or
    ``step(closure)`` reads ``p.grad`` instead, so a funcopt optimizer is also a
    drop-in ``torch.optim`` optimizer.
    """

    torch_class: type = torch.optim.Optimizer
    core_class: type = object
    slots: Tuple[Tuple[str, Optional[str]], ...] = ()
    fused_devices: Tuple[str, ...] = ("cpu", "cuda")

    def __init__(self, params: Any, defaults: Dict[str, Any], impl: str = "auto") -> None:
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if defaults.get("fused") and impl == "foreach":
            raise ValueError("fused=True conflicts with impl='foreach'")
        if defaults.get("foreach") and impl == "fused":
            raise ValueError("foreach=True conflicts with impl='fused'")
        self._validate_hyper(defaults)
        if impl == "auto":
            impl = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "auto"
        self.impl = impl
        self._core: Any = None
        self._scripted = False
        super().__init__(params, defaults)
        self._build_core(None)

    # ------------------------------------------------------------------ setup
    @property
    def state(self) -> Dict[Tensor, Dict[str, Any]]:  # type: ignore[override]
        """A fresh ``{param: {name: tensor}}`` view of the core's state."""
        core = self.__dict__.get("_core")
        out: Dict[Tensor, Dict[str, Any]] = {}
        if core is None:
            return out
        for i, p in enumerate(self._flat_params()):
            entry = self._state_entry(i)
            if entry:
                out[p] = entry
        return out

    @state.setter
    def state(self, value: Any) -> None:
        if value:
            raise AttributeError("funcopt state is set through load_state_dict()")

    def _flat_params(self) -> List[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _validate_hyper(self, group: Dict[str, Any]) -> None:
        """Raise torch's own error for invalid hyperparameters."""
        accepted = _torch_kwargs(self.torch_class)
        kwargs = {k: v for k, v in group.items() if k in accepted}
        probe = torch.zeros(1, requires_grad=True)
        self.torch_class([probe], **kwargs)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        params = param_group.get("params")
        if params is not None and not isinstance(params, (Tensor, set)):
            param_group = dict(param_group, params=list(params))  # a generator is read once
            params = param_group["params"]
        # torch's checks: leaf tensors, duplicates, defaults filled in.
        n_before = len(self.param_groups)
        super().add_param_group(param_group)
        try:
            self._validate_hyper(self.param_groups[-1])
        except Exception:
            del self.param_groups[n_before:]
            raise
        if self.__dict__.get("_core") is not None:
            self._build_core(self._slots)

    def _bucket(self, params: List[Tensor], group_of: List[int]) -> Tuple[List[List[int]], List[bool]]:
        keys: Dict[Tuple[int, str, torch.dtype], int] = {}
        buckets: List[List[int]] = []
        fused: List[bool] = []
        for i, p in enumerate(params):
            key = (group_of[i], str(p.device), p.dtype)
            if key not in keys:
                keys[key] = len(buckets)
                can_fuse = p.device.type in self.fused_devices and p.dtype in _FUSED_DTYPES
                if self.impl == "fused" and not can_fuse:
                    raise ValueError(
                        f"{type(self).__name__}: impl='fused' (fused=True) is not available for "
                        f"{p.dtype} on {p.device.type}; fused kernels exist for "
                        f"{', '.join(self.fused_devices)} and floating dtypes"
                    )
                buckets.append([])
                fused.append(can_fuse and self.impl != "foreach")
            buckets[keys[key]].append(i)
        return buckets, fused

    def _build_core(self, old_slots: Any) -> None:
        """(Re)build the slots and core; ``old_slots`` state carries over by index
        (``add_param_group`` appends, so old indices stay valid)."""
        n_old = len(self.__dict__.get("_group_of", ()))
        params = self._flat_params()
        group_of = [g for g, group in enumerate(self.param_groups) for _ in group["params"]]
        buckets, fused = self._bucket(params, group_of)
        hyper = [_flatten_hyper(g) for g in self.param_groups]
        names = [name for name, _ in self.slots]
        slots = Slots(params, group_of, buckets, fused, hyper, len(self.slots),
                      names.index("step") if "step" in names else -1)
        if old_slots is not None:
            for i in range(n_old):
                if old_slots.state_present(i):
                    slots.set_state(i, [old_slots.get_state(k, i) for k in range(len(self.slots))], True)
        self._hyper_cache = hyper
        self._group_of = group_of
        self._install(slots)

    def _install(self, slots: Any) -> None:
        """Make ``slots`` (and a core over it) current, scripted if the optimizer is.

        A scripted core must be built over an already scripted ``Slots``: the
        wrapper keeps that very object (``self._slots``) for state and
        hyperparameter access.  Reading ``core.slots`` from Python would give a
        converted *copy*, and writes to it would be lost.
        """
        if self._scripted:
            from .script import script_object

            if not isinstance(slots, torch.jit.RecursiveScriptClass):
                self.core_class(slots)  # eager constructor work (e.g. Adagrad's initial state)
                slots = script_object(slots)
            self._slots = slots
            self._core = script_object(self.core_class(slots))
        else:
            self._slots = slots
            self._core = self.core_class(slots)

    def _script(self) -> None:
        if not self._scripted:
            self._scripted = True
            self._install(self._slots)

    @property
    def core(self) -> Any:
        """The scriptable core (a TorchScript object after ``funcopt.script``)."""
        self._sync_hyper()
        return self._core

    # ------------------------------------------------------------------- step
    def _sync_hyper(self) -> None:
        """Push changed ``param_groups`` values into the core (checked first)."""
        for g, group in enumerate(self.param_groups):
            flat = _flatten_hyper(group)
            cached = self._hyper_cache[g]
            if flat == cached:
                continue
            missing = set(cached) - set(flat)
            if missing:
                raise ValueError(f"param_groups[{g}] lost hyperparameters {sorted(missing)}")
            self._validate_hyper(group)
            reset = self._slots_switched_on(g, cached, flat)
            for i in reset:
                self._slots.set_state(i, [torch.empty(0) for _ in self.slots], False)
            for k, v in flat.items():  # new keys too, e.g. a scheduler's "initial_lr"
                old = cached.get(k)
                if old is None or (old != v and not (math.isnan(v) and math.isnan(old))):
                    self._slots.set_hyper(g, k, v)
            self._hyper_cache[g] = flat

    def _slots_switched_on(self, g: int, old: Dict[str, float], new: Dict[str, float]) -> List[int]:
        """Parameters whose state must restart because a flag now adds a slot.

        Turning on a flag that owns the *only* state slot (SGD's momentum) is
        what torch.optim allows: the buffer starts from the next gradient.  A
        flag that adds a slot next to existing state (Adam's amsgrad) cannot be
        honoured exactly -- torch.optim fails on it too -- so it is refused,
        before anything changes.
        """
        turned_on = [
            name for name, cond in self.slots
            if cond is not None and not old.get(cond, 0.0) and new.get(cond, 0.0)
        ]
        if not turned_on:
            return []
        members = [i for i, gi in enumerate(self._group_of) if gi == g and self._slots.state_present(i)]
        if not members:
            return []
        others = [name for name, cond in self.slots if name not in turned_on and (cond is None or old.get(cond, 0.0))]
        if others:
            raise ValueError(
                f"param_groups[{g}]: cannot switch on the state {turned_on} after the first step "
                f"(the group already has {others}); set it at construction"
            )
        return members

    def step(  # type: ignore[override]
        self,
        grads: Optional[Sequence[Optional[Tensor]] | Callable[[], Any]] = None,
        grad_scale: Optional[Tensor] = None,
        found_inf: Optional[Tensor] = None,
    ) -> Any:
        """One optimization step.

        Args:
          grads: one gradient or ``None`` per parameter (all groups, in
            order); ``None`` entries are skipped and keep their state.  When
            omitted or a closure, ``p.grad`` is used (the closure is called
            first, with grad enabled, and its loss returned).
          grad_scale: optional scalar tensor; gradients are divided by it.
          found_inf: optional scalar tensor; when nonzero the whole step is
            skipped (on device with the fused kernels, no host sync).
        """
        loss = None
        if grads is None or callable(grads):
            if grads is not None:
                with torch.enable_grad():
                    loss = grads()
            grads = [p.grad for p in self._flat_params()]
        elif not isinstance(grads, list):
            grads = list(grads)
        self._sync_hyper()
        try:
            self._core.step(grads, grad_scale, found_inf)
        except torch.jit.Error as e:  # scripted core: surface our own errors as ValueError
            m = _JIT_MSG.search(str(e))
            if m:
                raise ValueError(m.group(1)) from None
            raise
        return loss

    # ------------------------------------------------------------------ state
    def _present(self, group: Dict[str, Any]) -> List[bool]:
        return [cond is None or bool(group.get(cond)) for _, cond in self.slots]

    def _state_entry(self, i: int) -> Dict[str, Any]:
        slots = self._slots
        if not slots.state_present(i):
            return {}
        present = self._present(self._hyper_cache[self._group_of[i]])  # as last synced to the core
        return {name: slots.get_state(k, i) for k, (name, _) in enumerate(self.slots) if present[k]}

    def state_dict(self) -> Dict[str, Any]:
        """The exact ``state_dict`` format of ``torch_class`` (tensors by reference)."""
        groups, state, start = [], {}, 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            ids = list(range(start, start + len(group["params"])))
            packed["params"] = ids
            groups.append(packed)
            for i in ids:
                entry = self._state_entry(i)
                if entry:
                    state[i] = entry
            start += len(ids)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a funcopt or torch.optim state dict; all checks run before any change.

        Raises ``ValueError`` naming what is wrong (group count or sizes,
        unknown or missing state keys, shapes, non-floating state, invalid
        hyperparameters) and leaves the optimizer untouched.
        """
        self.commit_state(self.stage_state(state_dict))

    def stage_state(self, state_dict: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], Dict[int, List[Tensor]]]:
        """The checking half of :meth:`load_state_dict`: validates and converts,
        changes nothing; :meth:`commit_state` applies the result.  (The
        distributed layers check on every rank before any rank commits.)"""
        name = type(self).__name__
        if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
            raise ValueError(f"{name}.load_state_dict: expected a dict with keys 'state' and 'param_groups'")
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        if not isinstance(saved_groups, list) or not isinstance(saved_state, dict):
            raise ValueError(f"{name}.load_state_dict: 'param_groups' must be a list and 'state' a dict")
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"{name}.load_state_dict: state dict has {len(saved_groups)} param groups, "
                f"optimizer has {len(self.param_groups)}"
            )
        id_map: Dict[Any, int] = {}
        new_groups = []
        flat = 0
        for g, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if not isinstance(saved, dict) or "params" not in saved:
                raise ValueError(f"{name}.load_state_dict: param group {g} has no 'params'")
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"{name}.load_state_dict: param group {g} has {len(saved['params'])} params in the "
                    f"state dict but {len(group['params'])} in the optimizer"
                )
            missing = set(self.defaults) - set(saved)
            if missing:
                raise ValueError(
                    f"{name}.load_state_dict: param group {g} lacks hyperparameters {sorted(missing)}; "
                    f"is this a {self.torch_class.__name__} state dict?"
                )
            new = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
            new["params"] = group["params"]
            if "param_names" in group:
                new["param_names"] = group["param_names"]
            try:
                self._validate_hyper(new)
            except (ValueError, RuntimeError, TypeError) as e:
                raise ValueError(f"{name}.load_state_dict: param group {g}: {e}") from None
            for key, default in self.defaults.items():
                if isinstance(default, (tuple, list)) and len(new[key]) != len(default):
                    raise ValueError(f"{name}.load_state_dict: param group {g}: {key}={new[key]!r}")
            for sid in saved["params"]:
                if sid in id_map:
                    raise ValueError(f"{name}.load_state_dict: parameter id {sid!r} appears twice")
                id_map[sid] = flat
                flat += 1
            new_groups.append(new)
        params = self._flat_params()
        group_of = [g for g, group in enumerate(new_groups) for _ in group["params"]]
        staged: Dict[int, List[Tensor]] = {}
        for sid, entry in saved_state.items():
            if sid not in id_map:
                raise ValueError(f"{name}.load_state_dict: state for unknown parameter id {sid!r}")
            i = id_map[sid]
            p = params[i]
            group = new_groups[group_of[i]]
            expected = {n for (n, _), on in zip(self.slots, self._present(group)) if on}
            if not isinstance(entry, dict) or set(entry) != expected:
                got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
                raise ValueError(
                    f"{name}.load_state_dict: state of parameter {sid!r} has keys {got}, expected {sorted(expected)}"
                )
            staged[i] = self._convert_entry(sid, p, entry, group)
        return new_groups, staged

    def commit_state(self, staged: Tuple[List[Dict[str, Any]], Dict[int, List[Tensor]]]) -> None:
        new_groups, state = staged
        for g, new in enumerate(new_groups):
            self.param_groups[g].clear()
            self.param_groups[g].update(new)
        self._build_core(None)
        slots = self._slots
        for i, vals in state.items():
            slots.set_state(i, vals, True)

    def _convert_entry(self, sid: Any, p: Tensor, entry: Dict[str, Any], group: Dict[str, Any]) -> List[Tensor]:
        name = type(self).__name__
        fused = bool(group.get("fused")) or self._uses_fused(p)
        vals: List[Tensor] = []
        for (slot, _), on in zip(self.slots, self._present(group)):
            if not on:
                vals.append(torch.empty(0))
                continue
            v = entry[slot]
            if slot == "step":
                if isinstance(v, Tensor):
                    if v.numel() != 1 or v.is_complex():
                        raise ValueError(f"{name}.load_state_dict: 'step' of parameter {sid!r} must be a scalar")
                    val = v.detach().reshape(())
                elif isinstance(v, (int, float)):
                    val = torch.tensor(float(v))
                else:
                    raise ValueError(f"{name}.load_state_dict: 'step' of parameter {sid!r} is {type(v).__name__}")
                vals.append(val.to(dtype=torch.float32, device=p.device if fused else "cpu").clone())
                continue
            if not isinstance(v, Tensor):
                raise ValueError(f"{name}.load_state_dict: '{slot}' of parameter {sid!r} is not a tensor")
            if v.shape != p.shape:
                raise ValueError(
                    f"{name}.load_state_dict: '{slot}' of parameter {sid!r} has shape {tuple(v.shape)}, "
                    f"parameter has {tuple(p.shape)}"
                )
            if not v.is_floating_point():
                raise ValueError(f"{name}.load_state_dict: '{slot}' of parameter {sid!r} has dtype {v.dtype}")
            # like torch.optim: floating state follows the parameter's dtype and device
            vals.append(v.detach().to(dtype=p.dtype, device=p.device, copy=True))
        return vals

    def _uses_fused(self, p: Tensor) -> bool:
        return self.impl != "foreach" and p.device.type in self.fused_devices and p.dtype in _FUSED_DTYPES


