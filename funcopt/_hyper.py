"""Hyperparameter values: one verdict per kind of value, wherever it enters.

A value reaches an optimizer through its constructor, an ``add_param_group``,
a ``param_groups`` edit picked up by the next ``step()`` (eager or scripted),
``load_state_dict`` (and, under ZeRO, the same through the local optimizer
over each rank's shard).  Every one of them calls :func:`validate` before it
changes anything, so a value gets the same verdict wherever it enters: refused
with a ``TypeError``/``ValueError`` that names the key and the value, or
accepted and then stepped with ``torch.optim``'s numbers.

The kind of each hyperparameter is read from the optimizer class's signature
(its default and annotation; the registry's classes and any registered one
alike), and whether a tensor may stand for a number from the matching
``torch.optim`` class's annotation:

* **flag** (a ``bool`` default: ``amsgrad``, ``maximize``, ``nesterov``...):
  ``True``/``False`` or a bool-like integer ``0``/``1`` (torch steps them the
  same).  A string is refused (``TypeError``): torch.optim tests ``if amsgrad:``,
  so ``"no"`` and ``"False"`` would silently mean *on*.  ``None``, other
  numbers and tensors are refused too.  ``differentiable`` takes a ``bool``
  only (torch hands it to ``torch.set_grad_enabled``, which refuses anything
  else at the first step).  ``foreach``/``fused`` (default ``None``) also take
  ``None``.
* **number** (an ``int``/``float`` default: ``lr``, ``eps``, ``weight_decay``...):
  an ``int``/``float`` (numpy scalars too) or a real 0-d tensor; a tensor of
  one element and more dimensions only where torch.optim declares the key a
  ``Tensor`` (``lr``; ``betas`` of Adam/AdamW; SGD's ``weight_decay``); a tensor
  of several elements is a ``ValueError``.  ``bool`` is refused (``TypeError``;
  torch fails on ``weight_decay=True`` mid-step).  NaN is refused
  (``ValueError``) for every key: torch refuses it where it checks the range
  and steps NaN parameters (or ignores it) where it does not.  Ranges
  (negative ``lr``, ``beta >= 1``...) are torch's own constructor checks,
  asked on a throw-away one-element parameter; their message gets the key
  and value appended.
* **integer** (an ``int`` annotation: Muon's ``ns_steps``): an ``int`` (or
  0-d integer tensor); ``2.5`` and ``True`` are refused.
* **tuple** (a tuple default: ``betas``, ``etas``, ``step_sizes``, Adafactor's
  ``eps``, Muon's ``ns_coefficients``): a tuple or list of exactly the
  default's length (``ValueError`` otherwise: torch raises ``IndexError`` for
  one value and fails mid-step for three), each element a number as above,
  or ``None`` where the default has ``None`` (Adafactor's ``eps[0]``).
* **coded option** (the class's ``hyper_codes``: Muon's ``adjust_lr_fn``): one
  of the values torch accepts *and* the kernel has a code for.

Keys the class does not declare (a scheduler's ``initial_lr``, a user's own
bookkeeping) are left alone, as torch leaves them.
"""
from __future__ import annotations

import functools
import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Tuple

import torch
from torch import Tensor

FLAG, NUMBER, INTEGER, TUPLE, CODE = "flag", "number", "integer", "tuple", "code"
# keys of a param group that hold no hyperparameter
_NOT_HYPER = ("params", "param_names")


@dataclass(frozen=True)
class Kind:
    """How one hyperparameter is checked (see the module docstring)."""

    kind: str
    optional: bool = False  # FLAG: None allowed (foreach, fused)
    strict: bool = False  # FLAG: a bool only (differentiable)
    any_shape: bool = False  # NUMBER: a 1-element tensor of any dimension (torch declares a Tensor)
    none_ok: bool = False  # a tuple element that may be None
    elements: Tuple["Kind", ...] = ()  # TUPLE: one Kind per element


def _mentions_tensor(annotation: Any) -> bool:
    return annotation is not inspect.Parameter.empty and "Tensor" in str(annotation)


@functools.lru_cache(maxsize=None)
def kinds(cls: type) -> Dict[str, Kind]:
    """The kind of every hyperparameter of optimizer class ``cls``, from its
    signature (defaults, annotations), its ``hyper_codes`` and the
    annotations of ``cls.torch_class``."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return {}
    try:
        oracle = cls.torch_class
        torch_params = inspect.signature(oracle.__init__).parameters if isinstance(oracle, type) else {}
    except (AttributeError, TypeError, ValueError):
        torch_params = {}
    codes = getattr(cls, "hyper_codes", {}) or {}
    out: Dict[str, Kind] = {}
    for key, p in params.items():
        if key in ("self", "params", "impl") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        default, annotation = p.default, p.annotation
        tensor_ok = _mentions_tensor(torch_params[key].annotation) if key in torch_params else False
        if key in codes:
            out[key] = Kind(CODE)
        elif isinstance(default, bool):
            out[key] = Kind(FLAG, strict=key == "differentiable")
        elif default is None and (key in ("foreach", "fused") or "bool" in str(annotation)):
            out[key] = Kind(FLAG, optional=True)
        elif isinstance(default, tuple):
            out[key] = Kind(TUPLE, elements=tuple(Kind(NUMBER, any_shape=tensor_ok, none_ok=v is None)
                                                  for v in default))
        elif isinstance(default, int) and annotation in (int, "int"):
            out[key] = Kind(INTEGER)
        elif isinstance(default, (int, float)):
            out[key] = Kind(NUMBER, any_shape=tensor_ok)
    return out


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool) or (type(v).__module__ == "numpy" and type(v).__name__ in ("bool_", "bool"))


def _type(v: Any) -> str:
    t = type(v)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__name__}"


def check_flag(owner: str, key: str, value: Any, kind: Kind, nan: bool = True) -> None:
    """A boolean option: True/False, or 0/1 (``None`` too where the default is None)."""
    if _is_bool(value) or (kind.optional and value is None):
        return
    if not kind.strict and isinstance(value, numbers.Integral) and value in (0, 1):
        return
    allowed = "True or False" + ("" if kind.strict else " (or 0/1)") + (" or None" if kind.optional else "")
    why = ""
    if isinstance(value, str):
        why = ("; a string is refused: torch.optim would read any non-empty string, "
               "'no' and 'False' included, as True")
    elif kind.strict:
        why = "; torch passes it to torch.set_grad_enabled, which takes a bool only"
    raise TypeError(f"{owner}: {key} must be {allowed}, got {key}={value!r} ({_type(value)}){why}")


def check_number(owner: str, key: str, value: Any, kind: Kind, nan: bool = True) -> None:
    """A real number: int/float, or a real tensor of one element (0-d unless torch declares a Tensor);
    not NaN (checked only with ``nan``: :func:`validate` asks torch's constructor first)."""
    if _is_bool(value):
        raise TypeError(f"{owner}: {key} must be a number, got {key}={value!r} (bool)")
    if isinstance(value, Tensor):
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{owner}: {key} must be a real number, got {key}={value!r} ({value.dtype} tensor)")
        if value.numel() != 1:
            raise ValueError(f"Tensor {key} must be 1-element ({owner}: {key} has shape {tuple(value.shape)})")
        if value.dim() > 0 and not kind.any_shape:
            raise TypeError(
                f"{owner}: {key} must be a number or a 0-d tensor, got a tensor of shape {tuple(value.shape)} "
                f"({key}={value!r}); torch.optim declares {key} a float (pass {key}.reshape(()) or a float)")
        try:
            x = float(value)
        except (RuntimeError, NotImplementedError):  # a meta tensor: nothing to read
            return
    elif isinstance(value, numbers.Real):
        x = float(value)
    else:
        raise TypeError(f"{owner}: {key} must be a number, got {key}={value!r} ({_type(value)})")
    if nan and math.isnan(x):
        raise ValueError(f"{owner}: {key} must not be NaN, got {key}={value!r}")


def check_integer(owner: str, key: str, value: Any, kind: Kind, nan: bool = True) -> None:
    """A whole number: int (or a 0-d integer tensor)."""
    if isinstance(value, Tensor) and value.dim() == 0 and not value.is_floating_point() \
            and not value.is_complex() and value.dtype != torch.bool:
        return
    if isinstance(value, numbers.Integral) and not _is_bool(value):
        return
    raise TypeError(f"{owner}: {key} must be an integer, got {key}={value!r} ({_type(value)})")


def check_tuple(owner: str, key: str, value: Any, kind: Kind, nan: bool = True) -> None:
    """A fixed-length tuple (or list) of numbers (``None`` where the default has it)."""
    n = len(kind.elements)
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"{owner}: {key} must be a tuple of {n} numbers, got {key}={value!r} ({_type(value)})")
    if len(value) != n:
        raise ValueError(f"{owner}: {key} must have {n} values, got {len(value)}: {key}={value!r}")
    for j, (v, element) in enumerate(zip(value, kind.elements)):
        if v is None and element.none_ok:
            continue
        try:
            check_number(owner, f"{key}[{j}]", v, element, nan)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{e} (in {key}={value!r})") from None


def check_code(owner: str, key: str, value: Any, table: Mapping[Any, float]) -> None:
    """A value the kernel knows by a code (the class's ``hyper_codes``)."""
    try:
        known = value in table
    except TypeError:  # unhashable
        known = False
    if not known:
        raise ValueError(f"{owner}: {key}={value!r} is not supported by funcopt (supported: "
                         f"{', '.join(repr(v) for v in table)})")


_CHECKS = {FLAG: check_flag, NUMBER: check_number, INTEGER: check_integer, TUPLE: check_tuple}


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return False
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # a tuple holding tensors of several elements
        return False


def _torch_check(cls: type, group: Mapping[str, Any]) -> None:
    """Ask ``cls.torch_class`` (a throw-away instance over one probe parameter):
    torch's own range checks, its error type and words, with the key and value
    that caused it appended."""
    torch_cls = cls.torch_class
    accepted = _torch_kwargs(torch_cls)
    kwargs = {k: v for k, v in group.items() if k in accepted}
    shape = tuple(getattr(cls, "probe_shape", (1,)))

    def build(kw: Dict[str, Any]) -> None:
        torch_cls([torch.zeros(shape, requires_grad=True)], **kw)

    try:
        build(kwargs)
    except (ValueError, TypeError, RuntimeError) as e:
        culprit = None
        for k, v in kwargs.items():  # the key that fails on its own
            try:
                build({k: v})
            except Exception:
                culprit = {k: v}
                break
        if culprit is None:  # a combination: name what differs from torch's defaults
            defaults = inspect.signature(torch_cls.__init__).parameters
            culprit = {k: v for k, v in kwargs.items()
                       if k not in defaults or not _same(v, defaults[k].default)}
        if type(e) in (ValueError, TypeError, RuntimeError) and culprit:
            named = ", ".join(f"{k}={v!r}" for k, v in culprit.items())
            raise type(e)(f"{e} ({named})") from None
        raise


@functools.lru_cache(maxsize=None)
def _torch_kwargs(torch_cls: type) -> frozenset:
    return frozenset(inspect.signature(torch_cls.__init__).parameters) - {"self", "params"}


def validate(cls: type, group: Mapping[str, Any]) -> None:
    """Raise ``TypeError``/``ValueError`` naming the key and value if any
    hyperparameter of ``group`` is refused for optimizer class ``cls``;
    changes nothing.  Every entry point calls this before it mutates.

    Order: each value's type and shape (this module's verdicts), then
    torch's constructor (ranges, torch's words), then what only funcopt
    refuses among values torch takes (NaN, a coded option the kernel lacks)."""
    owner = cls.__name__
    table = kinds(cls)
    present = [(key, kind) for key, kind in table.items() if key in group]
    for key, kind in present:
        if kind.kind in _CHECKS:
            _CHECKS[kind.kind](owner, key, group[key], kind, False)
    if isinstance(getattr(cls, "torch_class", None), type):
        _torch_check(cls, group)
    ranges = getattr(cls, "check_ranges", None)
    if ranges is not None:  # an algorithm whose oracle is not torch's: its own range checks
        ranges(group)
    codes = getattr(cls, "hyper_codes", {}) or {}
    for key, kind in present:
        if kind.kind in (NUMBER, TUPLE):
            _CHECKS[kind.kind](owner, key, group[key], kind, True)
        elif kind.kind == CODE:
            check_code(owner, key, group[key], codes[key])


def signature(group: Mapping[str, Any]) -> Tuple[Any, ...]:
    """What, besides the float values, makes two groups' hyperparameters differ for
    :func:`validate`: each value's type (and a tuple's element types, a
    tensor's dimension and dtype).  The step path re-validates a group when its
    floats *or* this changed (``True`` -> ``1``, ``0.5`` -> ``tensor([0.5])``).
    Runs at every eager step (not under torch.compile): a tuple of types, no
    string building."""
    return tuple(_of(v) for k, v in group.items() if k not in _NOT_HYPER)


def _of(v: Any) -> Any:
    t = type(v)
    if t is Tensor or isinstance(v, Tensor):
        return (t, v.dim(), v.dtype)
    if t is tuple or t is list:
        return (t,) + tuple(_of(x) for x in v)
    return t
