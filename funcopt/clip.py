r"""Gradient clipping by global norm, functional and scriptable.

``clip_grad_norm_(grads, max_norm)`` scales every gradient in place by
``min(1, max_norm / (total + 1e-6))`` where ``total`` is the ``norm_type``-norm
of all gradients taken together (the norm of the per-tensor norms)::

    total = || [ ||g_1||_p, ||g_2||_p, ... ] ||_p        # p = inf: max |g|
    g_i  *= clamp(max_norm / (total + 1e-6), max=1)

It is ``torch.nn.utils.clip_grad_norm_`` over a gradient list instead of
parameters: the same ops (``torch._foreach_norm`` per device and dtype, the
norms stacked on the first gradient's device, one multiply by a 0-d tensor
with no host sync), so the same values (bitwise; for gradients of several
dtypes or devices the per-group norms are stacked in first-appearance order
when scripted, where torch's order is its grouping's, so the total may differ
in the last bit).

TorchScript.  ``clip_grad_norm_`` is declared with two TorchScript overloads
(``torch.jit._overload``, as torch declares ``torch.functional.norm``), so
scripted code calls it with a ``List[Tensor]`` (gradients it collected) or a
``List[Optional[Tensor]]`` (what ``torch.autograd.grad`` returns there); both
compile to the same body.  TorchScript lists are invariant, so one signature
over ``List[Optional[Tensor]]`` alone would refuse a ``List[Tensor]``.  An
overloaded function cannot be compiled on its own, so
``torch.jit.script(funcopt.clip_grad_norm_)`` compiles
:func:`funcopt._clip_script.clip_grad_norm_` instead (the
``List[Optional[Tensor]]`` signature, which takes any Python list of tensors
and ``None``): the redirect ``torch.jit._script_if_tracing`` uses, which
``torch.compile`` follows as well.  Nothing is compiled at import time.

``error_if_nonfinite=True`` raises before any gradient changes, with the same
text eagerly and scripted: eagerly a ``RuntimeError``; from a scripted
function or module a ``torch.jit.Error`` (on torch 2.13 a subclass of
``Exception``, not of ``RuntimeError``) whose message ends with
``builtins.RuntimeError: `` and that text.
"""
import math
from typing import Iterable, List, Optional, Union

import torch
from torch import Tensor
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

__all__ = ["clip_grad_norm_", "total_norm", "clip_grads_with_norm_"]


def _groups(tensors: List[Tensor]) -> List[List[Tensor]]:
    """``tensors`` split by (device, dtype), order kept within a group."""
    if not torch.jit.is_scripting():
        return _torch_groups(tensors)
    keys: List[str] = []
    out: List[List[Tensor]] = []
    for t in tensors:
        key = str(t.device) + "/" + str(t.dtype)
        found = -1
        for k in range(len(keys)):
            if keys[k] == key:
                found = k
        if found < 0:
            keys.append(key)
            out.append([t])
        else:
            out[found].append(t)
    return out


@torch.jit.unused
def _torch_groups(tensors: List[Tensor]) -> List[List[Tensor]]:
    """Eager: torch's own grouping, so the norms are stacked in torch's order."""
    return [g[0][0] for g in _group_tensors_by_device_and_dtype([tensors]).values()]


def _fmt(x: float) -> str:
    """``str(x)`` as Python writes a float (TorchScript writes ``2.`` for 2.0)."""
    if not torch.jit.is_scripting():
        return str(float(x))
    if math.isfinite(x) and x == float(int(x)) and abs(x) < 1e16:
        return str(int(x)) + ".0"
    return str(x)


def total_norm(grads: List[Tensor], norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
    """The ``norm_type``-norm of ``grads`` taken together (``torch.tensor(0.)`` for
    an empty list), as ``torch.nn.utils.get_total_norm``.

    Raises ``RuntimeError`` (torch's text) if ``error_if_nonfinite`` and the
    norm is NaN or infinite (one host read)."""
    if len(grads) == 0:
        return torch.tensor(0.0)
    first_device = grads[0].device
    norms: List[Tensor] = []
    for group in _groups(grads):
        norms.extend(torch._foreach_norm(group, norm_type))
    total = torch.linalg.vector_norm(torch.stack([n.to(first_device) for n in norms]), norm_type)
    if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
        raise RuntimeError(
            "The total norm of order " + _fmt(norm_type) + " for gradients from `parameters` is non-finite, "
            "so it cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
            "anyway, set `error_if_nonfinite=False`"
        )
    return total


def clip_grads_with_norm_(grads: List[Tensor], max_norm: float, total: Tensor) -> None:
    """Scale ``grads`` in place by ``clamp(max_norm / (total + 1e-6), max=1)`` (no host sync)."""
    if len(grads) == 0:
        return
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for group in _groups(grads):
        c = coef.to(group[0].device)
        if torch.jit.is_scripting():
            # TorchScript drops an in-place foreach op on a freshly built list
            # (funcopt/_slots.py); per tensor: the same multiply
            for g in group:
                g.mul_(c)
        else:
            torch._foreach_mul_(group, c)


def _clip_present(grads: List[Tensor], max_norm: float, norm_type: float, error_if_nonfinite: bool) -> Tensor:
    """The clipping itself, over the gradients present: the norm (raising, if asked,
    before anything changes), then one scaling.  Both entry points end here."""
    total = total_norm(grads, norm_type, error_if_nonfinite)
    clip_grads_with_norm_(grads, max_norm, total)
    return total


@torch.jit.unused
def _clip_eager(grads: Union[Tensor, Iterable[Optional[Tensor]]], max_norm: float, norm_type: float,
                error_if_nonfinite: bool) -> Tensor:
    """The Python entry: a single tensor or any iterable of tensors and ``None``;
    anything else is refused before a gradient changes."""
    if isinstance(grads, Tensor):
        present: List[Tensor] = [grads]  # one gradient, as torch.nn.utils.clip_grad_norm_ takes one parameter
    else:
        try:
            items = iter(grads)
        except TypeError:
            raise TypeError(
                f"funcopt.clip_grad_norm_: grads must be a tensor or an iterable of tensors and None "
                f"(e.g. [p.grad for p in model.parameters()]), got {type(grads).__name__}"
            ) from None
        present = []
        for i, g in enumerate(items):
            if g is None:
                continue
            if not isinstance(g, Tensor):
                raise TypeError(
                    f"funcopt.clip_grad_norm_: grads[{i}] is a {type(g).__name__}; each entry must be a "
                    f"gradient tensor or None (e.g. [p.grad for p in model.parameters()])"
                )
            present.append(g)
    if torch.is_grad_enabled():
        for i, g in enumerate(present):
            if g.is_leaf and g.requires_grad:
                # in place on it would fail after the norm, and it is a parameter, not a gradient
                raise TypeError(
                    f"funcopt.clip_grad_norm_: grads[{i}] is a leaf tensor that requires grad (a parameter?); "
                    f"pass the gradients ([p.grad for p in params]), or the parameters to "
                    f"torch.nn.utils.clip_grad_norm_"
                )
    return _clip_present(present, float(max_norm), float(norm_type), error_if_nonfinite)


# The two signatures scripted code may call (TorchScript picks one by the
# argument's type; eagerly only the definition below exists).
@torch.jit._overload
def clip_grad_norm_(grads: List[Tensor], max_norm: float, norm_type: float = 2.0,  # noqa: F811
                    error_if_nonfinite: bool = False) -> Tensor:
    ...


@torch.jit._overload
def clip_grad_norm_(grads: List[Optional[Tensor]], max_norm: float, norm_type: float = 2.0,  # noqa: F811
                    error_if_nonfinite: bool = False) -> Tensor:
    ...


def clip_grad_norm_(grads: Union[Tensor, Iterable[Optional[Tensor]]], max_norm: float,  # noqa: F811
                    norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
    r"""Clip gradients in place by their global norm; returns the norm before clipping.

    ``torch.nn.utils.clip_grad_norm_`` for a list of gradients (``None``
    entries skipped), scriptable, so it can sit inside a
    ``torch.jit.script``-ed ``train_step`` next to a scripted funcopt step.

    Args:
      grads: gradients, ``None`` for parameters without one. Eagerly a single
        tensor or any iterable; in TorchScript a ``List[Tensor]`` or a
        ``List[Optional[Tensor]]`` (what ``torch.autograd.grad`` returns there).
      max_norm: the largest norm the gradients may have after clipping.
      norm_type: ``p`` of the norm, ``float('inf')`` for the max norm (default ``2.0``).
      error_if_nonfinite: raise if the total norm is NaN or infinite, before
        any gradient changes (default ``False``: the gradients are scaled by it
        anyway). Eagerly the error is a ``RuntimeError``; called from scripted
        code it reaches Python as a ``torch.jit.Error`` carrying the same text.

    Returns:
      The total norm (a 0-d tensor on the first gradient's device; ``tensor(0.)``
      when there is no gradient).

    Raises:
      TypeError: (eagerly) ``grads`` is not a tensor or an iterable of tensors
        and ``None``, or holds a leaf tensor that requires grad (a parameter
        passed instead of its gradient) while grad mode is on; nothing changes.

    Example::

        >>> import torch, funcopt
        >>> grads = [torch.tensor([3.0]), None, torch.tensor([4.0])]
        >>> funcopt.clip_grad_norm_(grads, max_norm=1.0)
        tensor(5.)
        >>> grads[0], grads[2]
        (tensor([0.6000]), tensor([0.8000]))
    """
    if not torch.jit.is_scripting():
        return _clip_eager(grads, max_norm, norm_type, error_if_nonfinite)
    # TorchScript types `p.grad` as Tensor, so in a List[Tensor] collected as
    # `g = p.grad; if g is not None: grads.append(g)` the test is folded away
    # and a missing gradient arrives as an undefined tensor; read through a
    # List[Optional[Tensor]] it is None, and skipped as torch skips it
    entries: List[Optional[Tensor]] = []
    for g in grads:
        entries.append(g)
    present: List[Tensor] = []
    for e in entries:
        if e is not None:
            present.append(e)
    return _clip_present(present, float(max_norm), float(norm_type), error_if_nonfinite)


# torch.jit.script(clip_grad_norm_) compiles this List[Optional[Tensor]] twin
# (torch.jit._script_if_tracing's redirect; torch.compile traces the twin,
# which is eagerly the same function)
from . import _clip_script  # noqa: E402  (it imports the helpers above)

clip_grad_norm_.__original_fn = _clip_script.clip_grad_norm_  # type: ignore[attr-defined]
clip_grad_norm_.__script_if_tracing_wrapper = True  # type: ignore[attr-defined]
