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
  tensor raises torch's errors, the key and value appended; the types and
  lengths torch is lax about are funcopt's verdicts, ``funcopt/_hyper.py``)
  and the state format.
* ``core_class``: the scriptable core, constructed as ``core_class(slots)``.
* ``slots``: state names in torch's order, each with the group flag that must
  be truthy for it to exist (``None`` = always), e.g. ``max_exp_avg_sq`` only
  with ``amsgrad``.
* ``fused_devices``: device types on which the ATen fused kernel exists.

``opt.state`` is a live ``defaultdict(dict)`` keyed by parameter, as in
torch: its tensors *are* the core's state (in-place edits are seen by the next
step), and entries written or deleted through it are checked and pushed into
the core before the next step.  Steps, ``funcopt.script``, ``state_dict`` and
``load_state_dict`` of one optimizer are serialized by a lock; different
optimizers step in parallel (a scripted step runs without the GIL).
"""
from __future__ import annotations

import functools
import inspect
import math
import re
import threading
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _dtensor, _hyper, native as _native, state_format
from ._slots import Slots

IMPLS = ("auto", "foreach", "fused", "native")
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# torch's own group keys that choose torch's implementation; we keep them in
# param_groups (the state_dict format) but they do not feed the core.
_IMPL_KEYS = ("foreach", "fused", "capturable")
# our own errors raised inside a scripted core (funcopt/_slots.py, funcopt/optimizers/*),
# re-raised with their Python type: torch.jit.Error is not a RuntimeError
_JIT_MSG = re.compile(
    r"(ValueError|RuntimeError|TypeError): "
    r"((?:funcopt: |\w+ does not support |weight_decay option is not|Param gradient must be)[^\n]*)"
)
# TorchScript prints a dtype as its c10::ScalarType number; the names, in order
_SCALAR_TYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                 torch.float32, torch.float64, torch.complex32, torch.complex64, torch.complex128,
                 torch.bool, torch.qint8, torch.quint8, torch.qint32, torch.bfloat16)
_DTYPE_NUM = re.compile(r"\bdtype (\d+)\b")
_SHAPE_LIST = re.compile(r"\bshape \[([\d, ]*)\]")
_INDEX = re.compile(r"\b(gradient|parameter) (\d+)\b")
_ERRORS = {"ValueError": ValueError, "RuntimeError": RuntimeError, "TypeError": TypeError}


def _flag(group: Dict[str, Any], cond: str) -> Any:
    """``group[cond]``; for ``key<j>`` absent from a raw group, element j of its tuple ``key``."""
    if cond in group:
        return group[cond]
    head, tail = cond.rstrip("0123456789"), cond[len(cond.rstrip("0123456789")):]
    value = group.get(head)
    if tail and isinstance(value, (tuple, list)) and int(tail) < len(value):
        return value[int(tail)]
    return None


def oracle_name(cls: type) -> str:
    """The name of ``cls.torch_class``: a class, or ``"module:Class"`` for an oracle
    outside torch (a test-only package, imported by ``funcopt.registry`` on use)."""
    oracle = cls.torch_class
    return oracle.rsplit(":", 1)[-1] if isinstance(oracle, str) else oracle.__name__


def _flatten_hyper(group: Dict[str, Any], codes: Optional[Dict[str, Dict[Any, float]]] = None,
                   skip: Tuple[str, ...] = ()) -> Dict[str, float]:
    """Group dict -> the core's ``Dict[str, float]``: booleans as 0/1, tuples as
    key0, key1... (``None`` inside a tuple as NaN), and values listed in
    ``codes`` (the class's ``hyper_codes``, e.g. a string option) by their code.
    ``skip``: the class's ``group_state`` keys (the core keeps them itself)."""
    out: Dict[str, float] = {}
    for key, value in group.items():
        if key in ("params", "param_names") or key in _IMPL_KEYS or key in skip:
            continue
        if codes and key in codes:
            table = codes[key]
            if value not in table:  # a value the constructor let through but the kernel cannot run
                raise ValueError(f"{key}={value!r} is not supported by funcopt (supported: "
                                 f"{', '.join(repr(v) for v in table)})")
            out[key] = float(table[value])
            continue
        if value is None:
            continue
        if isinstance(value, (tuple, list)):
            for j, v in enumerate(value):
                if v is None:
                    out[f"{key}{j}"] = math.nan
                elif isinstance(v, (bool, int, float, Tensor)):
                    out[f"{key}{j}"] = float(v)
        elif isinstance(value, (bool, int, float, Tensor)):
            out[key] = float(value)
    return out


@functools.lru_cache(maxsize=None)
def _compile_kernel_class(cls: type) -> None:
    from ._compat import scripting_unavailable

    if scripting_unavailable() is None:
        from .optimizers._core import ensure_interface
        from .script import quiet_jit

        ensure_interface()
        with quiet_jit():
            torch.jit.script(cls())  # an instance: compiles the class with its module's globals


class _Flag:
    """Shared "the user wrote to ``opt.state``" marker."""

    __slots__ = ("dirty",)

    def __init__(self) -> None:
        self.dirty = False


class _Entry(dict):
    """One parameter's state in ``opt.state``: a dict that marks writes."""

    __slots__ = ("_flag",)

    def __init__(self, flag: _Flag, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._flag = flag

    def _mark(self) -> None:
        self._flag.dirty = True

    def __setitem__(self, k: Any, v: Any) -> None:
        self._mark()
        super().__setitem__(k, v)

    def __delitem__(self, k: Any) -> None:
        self._mark()
        super().__delitem__(k)

    def clear(self) -> None:
        self._mark()
        super().clear()

    def pop(self, *a: Any) -> Any:
        self._mark()
        return super().pop(*a)

    def popitem(self) -> Any:
        self._mark()
        return super().popitem()

    def setdefault(self, k: Any, d: Any = None) -> Any:
        self._mark()
        return super().setdefault(k, d)

    def update(self, *a: Any, **kw: Any) -> None:
        self._mark()
        super().update(*a, **kw)

    def __reduce__(self) -> Any:  # pickles and deep-copies as a plain dict
        return (dict, (dict(self),))


class _LiveState(defaultdict):
    """``opt.state``: ``defaultdict(dict)`` keyed by parameter, writes marked."""

    def __init__(self, flag: _Flag) -> None:
        super().__init__(functools.partial(_Entry, flag))
        self._flag = flag

    def __setitem__(self, k: Any, v: Any) -> None:
        self._flag.dirty = True
        if isinstance(v, dict) and not isinstance(v, _Entry):
            v = _Entry(self._flag, v)
        super().__setitem__(k, v)

    def __delitem__(self, k: Any) -> None:
        self._flag.dirty = True
        super().__delitem__(k)

    def clear(self) -> None:
        self._flag.dirty = True
        super().clear()

    def pop(self, *a: Any) -> Any:
        self._flag.dirty = True
        return super().pop(*a)

    def popitem(self) -> Any:
        self._flag.dirty = True
        return super().popitem()

    def setdefault(self, k: Any, d: Any = None) -> Any:
        self._flag.dirty = True
        return super().setdefault(k, d)

    def update(self, *a: Any, **kw: Any) -> None:
        for k, v in dict(*a, **kw).items():
            self[k] = v

    def _set_quiet(self, k: Any, v: Dict[str, Any]) -> None:
        entry = dict.get(self, k)
        if isinstance(entry, _Entry):
            dict.clear(entry)
            dict.update(entry, v)
        else:
            dict.__setitem__(self, k, _Entry(self._flag, v))

    def __reduce__(self) -> Any:  # a plain defaultdict(dict) of plain dicts
        return (defaultdict, (dict,), None, None, iter((k, dict(v) if isinstance(v, dict) else v)
                                                         for k, v in self.items()))

    def __repr__(self) -> str:
        return repr(dict(self))


class Optimizer(torch.optim.Optimizer):
    """Base class of funcopt optimizers (see the module docstring).

    ``step(grads, grad_scale=None, found_inf=None)`` takes one gradient (or
    ``None``) per parameter, in ``param_groups`` order.  ``step()``,
    ``step(closure)`` or ``step(closure=closure)`` reads ``p.grad`` instead,
    so a funcopt optimizer is also a drop-in ``torch.optim`` optimizer.
    """

    torch_class: type = torch.optim.Optimizer
    kernel_class: type = object
    slots: Tuple[Tuple[str, Optional[str]], ...] = ()
    fused_devices: Tuple[str, ...] = ()
    # the kernel's declarations, read by the shared core (funcopt/optimizers/_core.py)
    sparse_msg: str = ""  # error for a sparse gradient ("" = sparse COO accepted, via Kernel.single)
    split_first: bool = False  # first steps get their own kernel call (SGD's buffer = gradient)
    init_at_construction: bool = False  # state for every parameter at construction (Adagrad)
    hyper_codes: Dict[str, Dict[Any, float]] = {}  # non-numeric options -> floats for the core
    whole_params: bool = False  # the rule needs each parameter whole (ZeRO: no flat partition; no cache-blocked chunks)
    probe_shape: Tuple[int, ...] = (1,)  # a parameter torch_class accepts (Muon: 2-D), to ask it about options
    # the native one-pass rule (funcopt/optimizers/<name>.cpp, funcopt.native): its name and the
    # hyperparameters it reads, in order; None: the algorithm has none (an ATen fused kernel, or a
    # whole-parameter rule)
    native_rule: Optional[Tuple[str, Tuple[str, ...]]] = None
    # values the rule keeps per param group, as (name, initial value), in the oracle's
    # param_groups keys (``group['step']``, Schedule-Free's ``k``...): stored in param_groups
    # (the state_dict format) and, in the core, as one float64 vector per group that the
    # kernel's GroupRule methods update (funcopt/optimizers/_core.py); written back into
    # param_groups after each step, a user's (or load_state_dict's) change pushed before the next
    group_state: Tuple[Tuple[str, Any], ...] = ()
    # more elements of each group's vector, after group_state's: the rule's own per-step
    # values (Prodigy's d of the step's start, its partial sums), never in param_groups
    group_hidden: int = 0
    # group_state keys the oracle adds to a group only at its first step (Prodigy's d_denom, d_hat):
    # absent from param_groups while the group's first value (its step counter) is 0
    group_state_lazy: Tuple[str, ...] = ()
    # complex parameters: not the oracle's numbers by decision (funcopt refuses them, or steps
    # real views where the oracle does complex arithmetic): said in the module docstring
    complex_differs_from_oracle: bool = False
    # hyperparameters that shape the state (Prodigy's slice_p): refused in a param_groups edit
    # once the group has state (the oracle fails mid-step on the shapes)
    fixed_once_stepped: Tuple[str, ...] = ()
    # the core bumps the slot named "step" before the kernel runs; False: the kernel counts it
    # itself (Prodigy: in its second pass, which a step may not reach)
    core_bumps_step: bool = True
    # 2: a sum over every parameter between two passes of the step (Prodigy's d): the core's
    # begin / GroupRule.partial / finish; ``sum_partials`` (a distributed layer's all-reduce)
    # adds the partial sums up across ranks
    phases: int = 1
    # train()/eval() swap the parameters (Schedule-Free): the core's set_mode, GroupRule.mode
    has_modes: bool = False
    # the GroupRule of a rule with group state (funcopt/optimizers/_core.py): a shared one
    # (_core.StepCounter: group['step'] only), or None: the kernel class implements it itself
    group_rule_class: Optional[type] = None

    @classmethod
    def adapt_entry(cls, p: Tensor, entry: Any, group: Dict[str, Any]) -> Any:
        """A loaded state entry in the oracle's form, as funcopt keeps it (default: as is).
        Prodigy: the oracle's 0-d ``p0`` of an all-zero parameter becomes the strided copy."""
        return entry

    @classmethod
    def slot_shape(cls, name: str, p: Tensor, group: Any = None) -> Optional[Tuple[int, ...]]:
        """Shape of state slot ``name`` for parameter ``p`` of param group ``group``
        (its hyperparameters, raw or as the core's floats; may be None); ``None``: ``p``
        has no such slot.  Default: ``step`` 0-d, every other slot shaped like ``p``.
        Adafactor overrides it (factored row/column state for matrices), Prodigy
        (``slice_p``-strided statistics)."""
        return () if name == "step" else tuple(p.shape)

    def __init__(self, params: Any, defaults: Dict[str, Any], impl: str = "auto") -> None:
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if impl == "native" and self.native_rule is None:
            raise ValueError(f"{type(self).__name__} has no native rule (impl='native'); use impl='auto'")
        self._validate_hyper(defaults)
        if defaults.get("fused") and impl == "foreach":
            raise ValueError("fused=True conflicts with impl='foreach'")
        if defaults.get("foreach") and impl == "fused":
            raise ValueError("foreach=True conflicts with impl='fused'")
        if impl == "auto":
            impl = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "auto"
        self.impl = impl
        self._init_private()
        super().__init__(params, defaults)
        self._build_core({})
        # Adagrad-like: the core creates every parameter's state up front
        slots = self._slots
        self._state_at_construction = len(slots.params) > 0 and all(
            slots.state_present(i) for i in range(len(slots.params)))

    def _init_private(self) -> None:
        d = self.__dict__
        d["_lock"] = threading.RLock()
        d["_state_flag"] = _Flag()
        d["state"] = _LiveState(d["_state_flag"])
        d["_core"] = None
        d["_scripted"] = False
        d["_structure"] = ()
        d["_epoch"] = -1
        d["_fused_unavailable"] = None
        d["_native"] = False  # the core's kernel is a NativeKernel (some bucket runs the native rule)
        d["_portable"] = None  # opt.core when _native: the same slots, ATen ops only
        d["_dup_error"] = None
        d["_state_at_construction"] = False
        d["_dt"] = None  # DTensor parameters: the local shards the core steps (funcopt/_dtensor.py)
        d["_dt_cache"] = {}
        d["_group_keys"] = tuple(name for name, _ in type(self).group_state)
        d["_group_seen"] = []  # per group: the group_state values last written to / read from param_groups
        # a two-phase rule (phases = 2): a function that sums the partial-sum vector across the
        # ranks that share the parameters (set by ZeRO / the RPC optimizer); None: one process
        d["sum_partials"] = None
        d["_shard_sum"] = None  # the same, found from the parameters (ZeRO-3 chunks, FSDP2 DTensors)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "state" and "_state_flag" in self.__dict__:
            live = _LiveState(self._state_flag)
            for k, v in dict(value or {}).items():
                dict.__setitem__(live, k, _Entry(self._state_flag, v) if isinstance(v, dict) else v)
            self._state_flag.dirty = True
            value = live
        object.__setattr__(self, name, value)

    # ------------------------------------------------------------- pickling
    def __getstate__(self) -> Dict[str, Any]:
        with self._lock:
            self._prepare(refresh=True)
            if self.group_state:
                self._mirror_groups()
            return {
                "defaults": self.defaults,
                "param_groups": self.param_groups,
                "state": {k: dict(v) if isinstance(v, dict) else v for k, v in self.state.items()},
                "impl": self.impl,
                "scripted": self._scripted,
            }

    def __setstate__(self, state: Dict[str, Any]) -> None:
        saved_state = state.get("state", {})
        scripted = state.get("scripted", False)
        self._init_private()
        torch.optim.Optimizer.__setstate__(self, {
            "defaults": state["defaults"], "param_groups": state["param_groups"],
            "impl": state.get("impl", "auto"),
        })
        with self._lock:
            self._build_core({})
            slots = self._slots
            self._state_at_construction = len(slots.params) > 0 and all(
                slots.state_present(i) for i in range(len(slots.params)))
            for k, v in saved_state.items():
                self.state[k] = v
            self._push_state()
            if scripted:
                self._script()

    # ------------------------------------------------------------------ setup
    def _flat_params(self) -> List[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _validate_hyper(self, group: Dict[str, Any]) -> None:
        """Refuse a group's invalid hyperparameters (``TypeError``/``ValueError``
        naming the key and value; torch's own error and words for its range
        checks), changing nothing: the one check every entry point runs
        (funcopt/_hyper.py)."""
        _hyper.validate(type(self), group)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a param group, as ``torch.optim.Optimizer.add_param_group``."""
        params = param_group.get("params")
        if params is not None and not isinstance(params, (Tensor, set)):
            param_group = dict(param_group, params=list(params))  # a generator is read once
        with self._lock:
            if self._core is not None:
                self._prepare(refresh=True)
            # torch's checks: leaf tensors, duplicates, defaults filled in.
            n_before = len(self.param_groups)
            super().add_param_group(param_group)
            try:
                self._validate_hyper(self.param_groups[-1])
            except Exception:
                del self.param_groups[n_before:]
                raise
            if self._core is not None:
                self._rebuild()

    def _bucket(self, params: List[Tensor], group_of: List[int]) -> Tuple[List[List[int]], List[bool]]:
        keys: Dict[Tuple[int, str, torch.dtype], int] = {}
        buckets: List[List[int]] = []
        fused: List[bool] = []
        unavailable: List[int] = []
        message = None
        native = self._native_available(params)
        self._native = False
        for i, p in enumerate(params):
            key = (group_of[i], str(p.device), p.dtype)
            if key not in keys:
                keys[key] = len(buckets)
                can_fuse = (p.device.type in self.fused_devices and p.dtype in _FUSED_DTYPES)
                if native and p.device.type == "cpu" and p.dtype in _native.NATIVE_DTYPES:
                    can_fuse = True  # the bucket's fast path: the native rule
                    self._native = True
                if self.impl == "fused" and not can_fuse and message is None:
                    message = (
                        "`fused=True` requires all the params to be floating point Tensors of supported "
                        f"devices: {list(self.fused_devices)} but {p.dtype} and {p.device.type} "
                        f"({type(self).__name__}, parameter {i})"
                    )
                buckets.append([])
                fused.append(can_fuse and self.impl != "foreach")
            buckets[keys[key]].append(i)
            if self.impl == "fused" and not (p.device.type in self.fused_devices and p.dtype in _FUSED_DTYPES):
                unavailable.append(i)
        # torch.optim raises this at the first step that has such a gradient, not at construction
        self._fused_unavailable = (unavailable, message) if unavailable else None
        return buckets, fused

    def _native_available(self, params: List[Tensor]) -> bool:
        """Whether this optimizer's buckets may run its native rule: it has one,
        ``impl`` allows it, a parameter could take it, and the library loads
        (built on first use; ``impl='native'`` makes a failure an error)."""
        if self.native_rule is None or self.impl not in ("auto", "native"):
            return False
        if not any(p.device.type == "cpu" and p.dtype in _native.NATIVE_DTYPES for p in params):
            return False
        if _native.load() is not None:
            return True
        if self.impl == "native":
            raise RuntimeError(f"{type(self).__name__}(impl='native'): funcopt's native kernels are unavailable: "
                               f"{_native.status()['error']}")
        return False

    def _kernel(self) -> Any:
        """A fresh kernel for the core: the class's own, or (when a bucket runs
        the native rule) a NativeKernel over it."""
        if not self._native:
            return self.kernel_class()
        from .optimizers._core import NativeKernel

        rule, keys = self.native_rule
        base = self.kernel_class()
        if self._scripted:
            from .script import script_object

            base = script_object(base)
        return NativeKernel(base, rule, list(keys))

    def _structure_key(self) -> Tuple[Any, ...]:
        return tuple((g, g["params"], len(g["params"])) for g in self.param_groups)

    def _structure_changed(self) -> bool:
        cur = self.param_groups
        old = self._structure
        if len(cur) != len(old):
            return True
        for g, (og, op, on) in zip(cur, old):
            if g is not og or g.get("params") is not op or len(op) != on:
                return True
        return False

    def _build_core(self, carry: Dict[int, List[Tensor]]) -> None:
        """(Re)build the slots and core over the current ``param_groups``;
        ``carry`` maps ``id(param)`` to state (slot order) that carries over."""
        params = self._flat_params()
        if self.whole_params and any(getattr(p, "funcopt_flat_chunk", False) for p in params):
            # a ZeRO-3 chunk is this rank's range of several parameters laid end to end: a rule that
            # needs each parameter whole would step it as one vector -- another algorithm, silently
            raise TypeError(f"{type(self).__name__} needs each parameter whole, and a ZeRO-3 layer's "
                            f"trainable chunk (Zero3Layer / Zero3Sequential / zero3) is a flat range of "
                            f"several parameters: use ZeroRedundancyOptimizer (ZeRO-1/2, greedy placement) or "
                            f"FSDP2 for {type(self).__name__}, or an elementwise rule with ZeRO-3")
        # DTensor parameters (FSDP2, tensor parallel): an elementwise rule steps their local shards
        self._dt = _dtensor.view_for(params, type(self).__name__, self.whole_params,
                                     any(g.get("differentiable") for g in self.param_groups))
        # a two-phase rule over ZeRO-3 chunks or FSDP2 shards: its sums run over their ranks
        self._shard_sum = _dtensor.partial_sum(params, type(self).__name__) if self.phases == 2 else None
        self._dt_cache = {}
        dup = state_format.find_duplicate(params)
        # torch only warns about a repeated parameter (and steps it twice); a
        # state_dict() of it works, a step is refused
        self._dup_error = None if dup is None else (
            f"{type(self).__name__}.step: parameter {dup} appears more than once in param_groups; "
            "each parameter may appear once (in one group) to be stepped"
        )
        group_of = [g for g, group in enumerate(self.param_groups) for _ in group["params"]]
        buckets, fused = self._bucket(params, group_of)
        hyper = [_flatten_hyper(g, self.hyper_codes, self._group_keys) for g in self.param_groups]
        names = [name for name, _ in self.slots]
        step_params = params if self._dt is None else self._dt.step_params
        slots = Slots(step_params, group_of, buckets, fused, hyper, len(self.slots),
                      names.index("step") if "step" in names and self.core_bumps_step else -1)
        for i, p in enumerate(params):
            vals = carry.get(id(p))
            if vals is not None:
                slots.set_state(i, vals, True)
        if self.group_state:
            self._group_seen = []
            for g, group in enumerate(self.param_groups):
                for name, init in self.group_state:
                    if name not in self.group_state_lazy:
                        group.setdefault(name, init)
                vals = self._group_values(g, group) + [0.0] * self.group_hidden
                slots.set_group(g, torch.tensor(vals, dtype=torch.float64))
                self._group_seen.append(tuple(group.get(name, init) for name, init in self.group_state))
        self._hyper_cache = hyper
        self._hyper_sig = [_hyper.signature(g) for g in self.param_groups]
        self._group_of = group_of
        self._structure = self._structure_key()
        self._install(slots)
        self._refresh_state()

    def _carry(self) -> Dict[int, List[Tensor]]:
        slots = self.__dict__.get("_slots")
        if slots is None:
            return {}
        out: Dict[int, List[Tensor]] = {}
        for i, p in enumerate(slots.params if self._dt is None else self._dt.params):
            if slots.state_present(i):
                out[id(p)] = [slots.get_state(k, i) for k in range(len(self.slots))]
        return out

    def _rebuild(self) -> None:
        """New core over the current ``param_groups``; state carried by parameter."""
        if self.group_state and "_slots" in self.__dict__:
            # a user's edit, then what the core counted (compiled steps too), before a rebuild reads param_groups
            self._push_groups()
            self._mirror_groups()
        for group in self.param_groups:  # raw dicts appended to param_groups
            for k, v in self.defaults.items():
                group.setdefault(k, v)
            if not isinstance(group.get("params"), list):
                group["params"] = [group["params"]] if isinstance(group.get("params"), Tensor) else list(group["params"])
            for p in group["params"]:
                if not isinstance(p, Tensor):
                    raise TypeError(f"{type(self).__name__}: param_groups hold {type(p).__name__}, expected tensors")
            self._validate_hyper(group)
        self._build_core(self._carry())

    def _install(self, slots: Any) -> None:
        """Make ``slots`` (and a core over it) current, scripted if the optimizer is.

        A scripted core must be built over an already scripted ``Slots``: the
        wrapper keeps that very object (``self._slots``) for state and
        hyperparameter access.  Reading ``core.slots`` from Python would give a
        converted *copy*, and writes to it would be lost.
        """
        if self._scripted:
            from .optimizers._core import ensure_interface
            from .script import script_object

            ensure_interface()

            if not isinstance(slots, torch.jit.RecursiveScriptClass):
                self._make_core(slots, self.kernel_class())  # eager constructor work (Adagrad's initial state)
                slots = script_object(slots)
            core = script_object(self._make_core(slots, script_object(self._kernel()), self._native))
        else:
            core = self._make_core(slots, self._kernel(), self._native)
        self._slots = slots
        self._core = core
        self._portable = None
        self._epoch = -1

    def _make_core(self, slots: Any, kernel: Any, native: bool = False) -> Any:
        from .optimizers import _core

        # impl="auto": a CPU bucket that runs the foreach formula (no fused kernel, no native
        # rule there) runs it cache-blocked, bitwise the same (Core._blocked); impl="foreach"
        # keeps torch's call sequence, and a whole-parameter rule cannot be cut
        # (nor a two-phase rule: its sums over each parameter keep the oracle's order)
        block = _core.BLOCK_BYTES if self.impl == "auto" and not self.whole_params and self.phases == 1 else 0
        # an ATen fused kernel (fused_devices) takes grad_scale / found_inf itself; a native
        # rule's buckets get unscaled, checked gradients (a NativeKernel: Core.native)
        fused_amp = self.native_rule is None or len(self.fused_devices) > 0
        grouped = len(self.group_state) > 0
        if self.group_rule_class is None and (grouped or self.phases != 1 or self.has_modes):
            rule = kernel  # the kernel class implements GroupRule too
        else:  # a shared GroupRule (StepCounter), or none
            rule = self.group_rule_class() if self.group_rule_class is not None else _core.NoGroups()
            if isinstance(kernel, torch.jit.RecursiveScriptClass):
                from .script import script_object

                rule = script_object(rule)
        return _core.Core(slots, kernel, self.sparse_msg, self.split_first, self.init_at_construction,
                          rule, fused_amp, block, native, grouped, self.phases)

    def _script(self) -> None:
        with self._lock:
            if not self._scripted:
                self._prepare(refresh=True)
                if any(g.get("differentiable") for g in self.param_groups):
                    raise ValueError(
                        f"{type(self).__name__}: differentiable=True steps run eagerly only; "
                        "funcopt.script compiles a no-grad step"
                    )
                self._scripted = True
                try:
                    self._install(self._slots)
                except BaseException:
                    self._scripted = False
                    self._install(self._slots)
                    raise
                self._refresh_state()

    @property
    def core(self) -> Any:
        """The scriptable core (a TorchScript object after ``funcopt.script``).

        A core embedded in a user's ScriptModule is stepped by that module,
        outside this object's lock: the module must not step it from two
        threads at once, nor while this optimizer steps.

        An eager core's kernel class is compiled here (once per process,
        quietly; not where this torch cannot script), because
        ``torch.jit.script`` of a module holding the core can only convert
        the kernel to the core's ``Kernel`` interface when its class is
        already known to TorchScript."""
        with self._lock:
            self._prepare(refresh=True)
            if not self._native:
                if not self._scripted:
                    _compile_kernel_class(type(self._core.kernel))
                    _compile_kernel_class(type(self._core.rule))  # NoGroups, or the kernel itself
                return self._core
            if self._portable is None:
                # the same slots, stepped with the foreach formula: ATen ops only
                if self._scripted:
                    from .optimizers._core import ensure_interface
                    from .script import script_object

                    ensure_interface()
                    self._portable = script_object(self._make_core(self._slots, script_object(self.kernel_class())))
                else:
                    _compile_kernel_class(self.kernel_class)
                    self._portable = self._make_core(self._slots, self.kernel_class())
                    _compile_kernel_class(type(self._portable.rule))
            return self._portable

    @property
    def uses_native(self) -> bool:
        """Whether some of this optimizer's parameters are stepped by its native
        one-pass rule (:mod:`funcopt.native`): the class has one, ``impl`` is
        ``"auto"`` or ``"native"``, a parameter is a float32/float64 CPU tensor
        and the library loaded.  Strided tensors still take the foreach formula."""
        with self._lock:
            self._prepare()
            return bool(self._native)

    @property
    def step_core(self) -> Any:
        """The core ``step`` runs (a TorchScript object after ``funcopt.script``).

        Unlike :attr:`core` it may call funcopt's native op
        (``torch.ops.funcopt.step_``, :mod:`funcopt.native`): for stepping in
        this process (the RPC optimizer's workers, hooks), not for saving in a
        module that must load without funcopt.  The same thread-safety rules as
        :attr:`core` apply."""
        with self._lock:
            self._prepare(refresh=True)
            return self._core

    # -------------------------------------------------------- synchronization
    def _prepare(self, refresh: bool = False, grads: Optional[List[Any]] = None) -> None:
        """Bring the core up to date with ``param_groups`` and ``state``
        (structure, user-written state, hyperparameters), checking first."""
        if self._structure_changed():
            self._rebuild()
        elif self._fused_unavailable is not None:
            self._rebuild()  # the parameters may have moved (e.g. meta -> cpu)
        if self._state_flag.dirty:
            self._push_state()
        self._sync_hyper(grads)
        if self.group_state:
            self._push_groups()
        if refresh and self._epoch != self._slots.epoch:
            self._refresh_state()

    def _refresh_state(self) -> None:
        """``opt.state`` := the core's state (same tensors), other keys kept."""
        live = self.state
        slots = self._slots
        params = slots.params if not isinstance(slots, torch.jit.RecursiveScriptClass) else self._flat_params()
        if self._dt is not None:
            params = self._dt.params
        for i, p in enumerate(params):
            entry = self._state_entry(i, p)
            if entry:
                live._set_quiet(p, entry)
            elif dict.get(live, p) is not None:
                dict.__delitem__(live, p)
        current = {id(p) for p in params}
        for k in [k for k in dict.keys(live) if isinstance(k, Tensor) and id(k) not in current]:
            dict.__delitem__(live, k)
        self._state_flag.dirty = False
        self._epoch = slots.epoch

    def _push_state(self) -> None:
        """Check ``opt.state`` as written by the user, then install it in the core."""
        live = self.state
        name = type(self).__name__
        slots = self._slots
        staged: Dict[int, Tuple[List[Tensor], bool]] = {}
        for i, p in enumerate(self._flat_params()):
            entry = dict.get(live, p)
            current = self._state_entry(i, p)
            if not entry:
                if current:
                    if self._state_at_construction:
                        raise ValueError(
                            f"{name}: parameter {i} cannot lose its state: {name} keeps state for every "
                            "parameter from construction (torch.optim fails at the next step); write a "
                            "full entry instead"
                        )
                    staged[i] = ([torch.empty(0) for _ in self.slots], False)
                continue
            if state_format.entries_equal(entry, current):
                continue
            group = self.param_groups[self._group_of[i]]
            vals = self._convert_entry(i, p, entry, group)
            staged[i] = (vals, True)
        for i, (vals, present) in staged.items():
            slots.set_state(i, vals, present)
        if staged and name:
            self._epoch = -1
        self._refresh_state()

    def _sync_hyper(self, grads: Optional[List[Any]] = None) -> None:
        """Push changed ``param_groups`` values into the core (checked first).

        With ``grads`` (a step), a group none of whose parameters has a
        gradient is left as it is: torch reads a group's hyperparameters only
        when it steps it (a scheduler may set, say, beta1 = 22 on a group that
        never steps); the check runs when the group next has a gradient."""
        start = 0
        for g, group in enumerate(self.param_groups):
            n = len(group["params"])
            try:
                flat: Optional[Dict[str, float]] = _flatten_hyper(group, self.hyper_codes, self._group_keys)
            except (ValueError, TypeError):
                flat = None  # a value the check below names
            cached = self._hyper_cache[g]
            # the value types too (True -> "yes" is caught by the floats, 0.5 -> tensor([0.5]) only by
            # this); not under torch.compile, whose traced types need not be Python's
            sig = self._hyper_sig[g] if torch.compiler.is_compiling() else _hyper.signature(group)
            if flat == cached and sig == self._hyper_sig[g]:
                start += n
                continue
            if grads is not None and all(x is None for x in grads[start:start + n]):
                try:
                    self._validate_hyper(group)
                except (ValueError, RuntimeError, TypeError):
                    start += n
                    continue
            start += n
            self._validate_hyper(group)  # before anything changes; names the key and the value
            if flat is None:
                flat = _flatten_hyper(group, self.hyper_codes, self._group_keys)
            missing = set(cached) - set(flat)
            if missing:
                raise ValueError(f"param_groups[{g}] lost hyperparameters {sorted(missing)}")
            for key in self.fixed_once_stepped:
                if cached.get(key) != flat.get(key) and any(
                        self._slots.state_present(i) for i, gi in enumerate(self._group_of) if gi == g):
                    raise ValueError(f"param_groups[{g}]: {key}={group.get(key)!r} cannot change after the first "
                                     f"step (it shapes the state; was {cached.get(key)!r}); set it at construction")
            reset = self._slots_switched_on(g, cached, flat)
            for i in reset:
                self._slots.set_state(i, [torch.empty(0) for _ in self.slots], False)
            for k, v in flat.items():  # new keys too, e.g. a scheduler's "initial_lr"
                old = cached.get(k)
                if old is None or (old != v and not (math.isnan(v) and math.isnan(old))):
                    self._slots.set_hyper(g, k, v)
            self._hyper_cache[g] = flat
            self._hyper_sig[g] = sig

    # ------------------------------------------------------------ group state
    def _group_values(self, g: int, group: Dict[str, Any]) -> List[float]:
        """``group``'s ``group_state`` values as floats for the core, checked
        (a real number or a bool each; a ``TypeError`` naming the key otherwise)."""
        out = []
        for name, init in self.group_state:
            v = group.get(name, init)
            if isinstance(v, Tensor) and v.numel() == 1 and not v.is_complex():
                v = v.item()
            if not isinstance(v, (bool, int, float)) and not (type(v).__module__ == "numpy" and hasattr(v, "item")):
                raise TypeError(f"{type(self).__name__}: param_groups[{g}][{name!r}] is {self.__class__.__name__}'s "
                                f"own per-group value and must be a number, got {v!r} ({type(v).__name__})")
            v = float(v)
            if math.isnan(v):
                raise ValueError(f"{type(self).__name__}: param_groups[{g}][{name!r}] must not be NaN")
            out.append(v)
        return out

    def _mirror_groups(self) -> None:
        """param_groups := the core's per-group values (after a step; before
        state_dict, pickling and a rebuild).  Not under torch.compile (a host
        read): compiled steps are caught up by the next eager step or state_dict."""
        slots = self._slots
        for g, group in enumerate(self.param_groups):
            if g >= len(self._group_seen):
                break
            vals = slots.get_group(g).tolist()
            first = vals[0] == 0  # the step counter: nothing stepped yet
            for (name, init), v in zip(self.group_state, vals):
                if first and name in self.group_state_lazy and name not in group:
                    continue
                group[name] = bool(v) if isinstance(init, bool) else int(v) if isinstance(init, int) else v
            self._group_seen[g] = tuple(group.get(name, init) for name, init in self.group_state)

    def _push_groups(self) -> None:
        """A group_state value changed in param_groups (by the user, a
        scheduler, load_state_dict) since the core last wrote it: into the core."""
        slots = self._slots
        for g, group in enumerate(self.param_groups):
            if g >= len(self._group_seen):
                break
            seen = self._group_seen[g]
            now = tuple(group.get(name, init) for name, init in self.group_state)
            if now != seen:
                vals = self._group_values(g, dict(group, **{n: v for (n, _), v in zip(self.group_state, now)}))
                slots.get_group(g)[:len(vals)].copy_(torch.tensor(vals, dtype=torch.float64))
                self._group_seen[g] = now

    def _set_mode(self, train: bool) -> None:
        """Train or eval mode of a rule that has both (``has_modes``): every
        param group's parameters swapped by the kernel (GroupRule.mode), the
        mode written into param_groups."""
        with self._lock:
            self._prepare(refresh=True)
            self._core.set_mode(train)
            if self._dt is not None:
                self._dt.after_step()
            self._mirror_groups()

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
            group = self.param_groups[g]
            flags = ", ".join(f"{cond}={group.get(cond)!r}" for name, cond in self.slots if name in turned_on)
            raise ValueError(
                f"param_groups[{g}]: {flags} cannot switch on the state {turned_on} after the first step "
                f"(the group already has {others}); set it at construction"
            )
        return members

    # ------------------------------------------------------------------- step
    def step(  # type: ignore[override]
        self,
        grads: Optional[Sequence[Optional[Tensor]] | Callable[[], Any]] = None,
        grad_scale: Optional[Tensor] = None,
        found_inf: Optional[Tensor] = None,
        closure: Optional[Callable[[], Any]] = None,
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
          closure: as ``torch.optim``'s (also accepted as ``grads``).
        """
        loss = None
        if callable(grads):
            if closure is not None:
                raise TypeError("step() got two closures")
            grads, closure = None, grads
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if torch.compiler.is_compiling():
            # Dynamo traces no lock; the live ``opt.state`` view catches up at
            # the next eager step or state_dict()
            grads = self._grads(grads)
            self._prepare(grads=grads)
            self._run(grads, grad_scale, found_inf)
        else:
            with self._lock:
                grads = self._grads(grads)
                self._prepare(grads=grads)
                try:
                    self._run(grads, grad_scale, found_inf)
                finally:
                    if self._epoch != self._slots.epoch:
                        self._refresh_state()
                    if self.group_state:
                        self._mirror_groups()
        return loss

    def _grads(self, grads: Any) -> List[Optional[Tensor]]:
        if self._structure_changed():
            self._rebuild()
        if grads is None:
            grads = [p.grad for p in self._flat_params()]
        elif isinstance(grads, Tensor):
            raise TypeError(
                f"{type(self).__name__}.step: grads must be a list with one tensor (or None) per "
                f"parameter, got a single tensor; pass [grad]"
            )
        elif type(grads).__module__ == "numpy":
            raise TypeError(
                f"{type(self).__name__}.step: grads must be a list of torch tensors (or None), one per "
                f"parameter, got a numpy array; pass [torch.from_numpy(a) for a in arrays]"
            )
        elif not isinstance(grads, list):
            is_iterator = iter(grads) is grads
            grads = list(grads)
            n = sum(len(g["params"]) for g in self.param_groups)
            if is_iterator and len(grads) == 0 and n > 0:
                raise TypeError(
                    f"{type(self).__name__}.step: the gradient iterator gave nothing (already consumed?); "
                    f"pass a list with one tensor (or None) per parameter ({n})"
                )
        dt = self._dt
        if dt is not None:
            if dt.stale():
                self._rebuild()
                dt = self._dt
            if dt is not None:
                grads = dt.grads(grads)
        return grads

    def _not_tensors(self, grads: List[Any]) -> None:
        """After a failed step (checked only then: no per-step cost): a clear
        error for an entry that is not a tensor, e.g. a numpy array."""
        for i, g in enumerate(grads):
            if g is not None and not isinstance(g, Tensor):
                raise TypeError(self._explain(
                    f"funcopt: gradient {i} is a {type(g).__module__}.{type(g).__name__}, not a torch tensor; "
                    "pass torch tensors (torch.as_tensor(...)) or None"
                )) from None

    def _run(self, grads: List[Optional[Tensor]], grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
        if self._dup_error is not None:
            raise ValueError(self._dup_error)
        if self._fused_unavailable is not None:
            bad, message = self._fused_unavailable
            if any(i < len(grads) and grads[i] is not None for i in bad):
                raise RuntimeError(message)
        try:
            reduce = self.sum_partials if self.sum_partials is not None else self._shard_sum
            if self.phases == 2 and reduce is not None:
                core = self._core
                core.begin(grads, grad_scale, found_inf)
                core.finish(reduce(core.partials()))
            else:
                self._core.step(grads, grad_scale, found_inf)
            if self._dt is not None:
                self._dt.after_step()  # a whole-parameter rule: this rank's shard of the stepped copy
        except torch.jit.Error as e:  # scripted core: our own errors, as eager raises them
            m = _JIT_MSG.search(str(e))
            if m:
                raise _ERRORS[m.group(1)](self._explain(m.group(2))) from None
            self._not_tensors(grads)
            raise
        except (ValueError, RuntimeError, TypeError, AttributeError) as e:
            self._not_tensors(grads)
            msg = str(e)
            if msg.startswith("funcopt: ") and type(e) in _ERRORS.values():
                raise type(e)(self._explain(msg)) from None
            raise

    def _explain(self, msg: str) -> str:
        """One wording for eager and scripted errors: dtypes by name and shapes
        as torch.Size (TorchScript prints numbers and lists), and a flat index
        with its group and position when there are several groups."""
        def dtype(m: "re.Match[str]") -> str:
            k = int(m.group(1))
            return f"dtype {_SCALAR_TYPES[k]}" if k < len(_SCALAR_TYPES) else m.group(0)

        msg = _DTYPE_NUM.sub(dtype, msg)
        msg = _SHAPE_LIST.sub(lambda m: f"shape torch.Size([{m.group(1)}])", msg)
        where = [(g, j) for g, group in enumerate(self.param_groups) for j in range(len(group["params"]))]

        def index(m: "re.Match[str]") -> str:
            i = int(m.group(2))
            if i < len(where) and len(self.param_groups) > 1:
                return f"{m.group(1)} {i} (param_groups[{where[i][0]}], position {where[i][1]})"
            return m.group(0)

        return _INDEX.sub(index, msg, count=1)

    # ------------------------------------------------------------------ state
    def _present(self, group: Dict[str, Any]) -> List[bool]:
        """Which slots exist for ``group`` (raw, or the core's floats): a slot's
        flag may name a tuple element as the core does (``betas0``)."""
        return [cond is None or bool(_flag(group, cond)) for _, cond in self.slots]

    def _state_entry(self, i: int, p: Optional[Tensor] = None) -> Dict[str, Any]:
        slots = self._slots
        if not slots.state_present(i):
            return {}
        present = self._present(self._hyper_cache[self._group_of[i]])  # as last synced to the core
        if type(self).slot_shape.__func__ is not Optimizer.slot_shape.__func__:  # slots that depend on p
            p = self._flat_params()[i] if p is None else p
            hyper = self._hyper_cache[self._group_of[i]]
            present = [on and self.slot_shape(name, p, hyper) is not None for on, (name, _) in zip(present, self.slots)]
        entry = {name: slots.get_state(k, i) for k, (name, _) in enumerate(self.slots) if present[k]}
        if self._dt is not None:  # per-element state of a DTensor parameter, as a DTensor like it
            entry = {name: self._dt.wrap(i, name, v, self._dt_cache) for name, v in entry.items()}
        return entry

    def state_dict(self) -> Dict[str, Any]:
        """The exact ``state_dict`` format of ``torch_class`` (tensors by
        reference), with torch's state-dict hooks."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        with self._lock:
            if not self._state_flag.dirty and not self._structure_changed() and self._epoch != self._slots.epoch:
                self._refresh_state()
            if self.group_state and not self._structure_changed():
                self._mirror_groups()
            state_dict = state_format.pack(self.param_groups, self.state)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a funcopt or torch.optim state dict; all checks run before any change.

        Raises ``ValueError`` naming what is wrong (group count or sizes,
        unknown or missing state keys, shapes, non-floating state, invalid
        hyperparameters) and leaves the optimizer untouched.  Keys a state dict
        of an older torch release lacks take this optimizer's defaults; torch's
        load-state-dict hooks run before and after.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        with self._lock:
            self.commit_state(self.stage_state(state_dict))
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def stage_state(self, state_dict: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], Dict[Any, Any]]:
        """The checking half of :meth:`load_state_dict`: validates and converts,
        changes nothing; :meth:`commit_state` applies the result.  (The
        distributed layers check on every rank before any rank commits.)"""
        name = type(self).__name__
        with self._lock:
            if self._structure_changed():
                self._rebuild()
            saved_groups, saved_state = state_format.check_container(name, state_dict)
            id_map = state_format.match_groups(name, saved_groups, self.param_groups)
            new_groups = []
            for g, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
                missing = state_format.missing_keys(saved, self.defaults)
                if missing:
                    raise ValueError(
                        f"{name}.load_state_dict: param group {g} lacks hyperparameters {missing}; "
                        f"is this a {oracle_name(type(self))} state dict?"
                    )
                new = state_format.merge_group(saved, group, self.defaults)
                try:
                    self._validate_hyper(new)  # the same verdict as the constructor's and step()'s
                except (ValueError, RuntimeError, TypeError) as e:
                    kind = TypeError if type(e) is TypeError else ValueError
                    msg = str(e)
                    msg = msg[len(name) + 2:] if msg.startswith(f"{name}: ") else msg
                    raise kind(f"{name}.load_state_dict: param group {g}: {msg}") from None
                new_groups.append(new)
            offsets = [0]
            for group in self.param_groups:
                offsets.append(offsets[-1] + len(group["params"]))
            params = self._flat_params()
            staged: Dict[Any, Any] = {}
            for sid, entry in saved_state.items():
                if sid not in id_map:
                    if isinstance(sid, int):
                        raise ValueError(f"{name}.load_state_dict: state for unknown parameter id {sid!r}")
                    staged[("opaque", sid)] = entry  # torch keeps keys that are not parameter ids
                    continue
                g, j = id_map[sid]
                i = offsets[g] + j
                if not entry:
                    continue
                staged[i] = self._convert_entry(sid, params[i], entry, new_groups[g])
            return new_groups, staged

    def commit_state(self, staged: Tuple[List[Dict[str, Any]], Dict[Any, Any]]) -> None:
        """Install what :meth:`stage_state` checked; cannot fail."""
        new_groups, state = staged
        with self._lock:
            for g, new in enumerate(new_groups):
                self.param_groups[g].clear()
                self.param_groups[g].update(new)
            self.state.clear()
            self._build_core({})
            slots = self._slots
            for i, vals in state.items():
                if isinstance(i, int):
                    slots.set_state(i, vals, True)
            self._refresh_state()
            for key, entry in state.items():
                if isinstance(key, tuple):
                    dict.__setitem__(self.state, key[1], entry)

    def _convert_entry(self, sid: Any, p: Tensor, entry: Dict[str, Any], group: Dict[str, Any]) -> List[Tensor]:
        if self._dt is not None and _dtensor.is_dtensor(p):  # checked and stored as this rank's shard
            p, entry = self._dt.unwrap_entry(p, entry)
        entry = self.adapt_entry(p, entry, group)
        fused = bool(group.get("fused")) or self._uses_fused(p)
        names = [n for n, _ in self.slots]
        shapes = {n: self.slot_shape(n, p, group) for n in names}
        slots = [(n, on and shapes[n] is not None) for n, on in zip(names, self._present(group))]
        try:
            return state_format.convert_entry(type(self).__name__, sid, p, entry, slots, fused,
                                              shapes=shapes,
                                              keep=bool(group.get("differentiable")))
        except ValueError as e:
            # state names that a flag adds or removes: say which flag, as the group has it
            have = set(entry) if isinstance(entry, dict) else set()
            flags = [f"{cond}={group.get(cond)!r}" for (n, cond), (_, on) in zip(self.slots, slots)
                     if cond is not None and (n in have) != on]
            if not flags:
                raise
            raise ValueError(f"{e} (the group has {', '.join(flags)})") from None

    def _uses_fused(self, p: Tensor) -> bool:
        return self.impl != "foreach" and p.device.type in self.fused_devices and p.dtype in _FUSED_DTYPES
