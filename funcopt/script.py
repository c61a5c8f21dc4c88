"""Scripting helpers.

Nothing is scripted at import time.  ``torch.jit.script`` warns that
TorchScript is deprecated (a ``DeprecationWarning`` in torch 2.13, a
``FutureWarning`` from 2.14 on); we silence exactly that notice, only around
our own calls, and nothing else (see :mod:`funcopt._compat`, the one place
that knows how torch releases differ).  Where a torch release refuses to
script, :func:`script` raises :class:`TorchScriptUnavailableError` and leaves
the optimizer as it was: eager, and compilable with ``torch.compile``.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, TypeVar

import torch

from ._compat import TorchScriptUnavailableError, ignore_jit_deprecation, require_scripting

__all__ = ["TorchScriptUnavailableError", "quiet_jit", "script", "script_object"]

T = TypeVar("T")


@contextlib.contextmanager
def quiet_jit() -> Iterator[None]:
    """Silence torch's own TorchScript deprecation notice, nothing else.

    Works on every supported torch (the notice's category changed in 2.14).
    Every other warning, funcopt's own included, still surfaces.
    """
    with warnings.catch_warnings():
        ignore_jit_deprecation()
        yield


def script_object(obj: Any) -> Any:
    """``torch.jit.script`` of a module, function or class instance, quietly.

    Raises:
      TorchScriptUnavailableError: this torch refuses to script.
    """
    require_scripting("funcopt: torch.jit.script")
    with quiet_jit():
        return torch.jit.script(obj)


def script(opt: T) -> T:
    """Compile a funcopt optimizer's step to TorchScript, in place; returns ``opt``.

    The optimizer keeps its Python API (``step``, ``param_groups``,
    ``state_dict``, ``load_state_dict``, LR schedulers); ``step`` then runs in
    the TorchScript interpreter, without the GIL, over the same parameter and
    state tensors.

    Raises:
      TorchScriptUnavailableError: this torch (or Python) refuses to script;
        ``opt`` is left unchanged and keeps working eagerly and under
        ``torch.compile``.
      TypeError: ``opt`` is not a funcopt optimizer; for ``torch.optim.LBFGS``
        and ``torch.optim.SparseAdam`` the message says why funcopt has none.

    Example::

        >>> import torch, funcopt
        >>> w = torch.zeros(3, requires_grad=True)
        >>> opt = funcopt.script(funcopt.Adam([w], lr=0.1))
        >>> opt.step([torch.ones(3)])
        >>> bool((w < 0).all())
        True
    """
    from . import registry

    # LBFGS / SparseAdam (class, subclass or instance): why, before anything else
    registry.refuse_out_of_scope(opt, "funcopt.script", also=" (funcopt.<Name>(...) instances)")
    require_scripting(f"funcopt.script({type(opt).__name__})")
    if not callable(getattr(opt, "_script", None)):
        raise TypeError(
            f"funcopt.script expects a funcopt optimizer (funcopt.SGD, funcopt.Adam, ...), got "
            f"{type(opt).__module__}.{type(opt).__name__}; build the funcopt class of the same name instead"
        )
    opt._script()  # type: ignore[attr-defined]
    return opt
