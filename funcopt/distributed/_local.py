"""The local optimizer of a distributed layer: scripted where torch scripts, eager otherwise.

ZeRO and the RPC optimizer step a funcopt optimizer over each shard, scripted
(``funcopt.script``) so the step runs without the GIL.  On a torch (or
Python) where TorchScript does not work (:func:`funcopt._compat.scripting_unavailable`),
they step the same funcopt optimizer eagerly instead: the same kernels, so
the same numbers, only with the GIL held.  That fallback is announced once per
process and layer with a :class:`EagerFallbackWarning`, never silently.
"""
from __future__ import annotations

import threading
import warnings
from typing import Any, Callable, Set, Tuple

import torch

from .. import _compat
from ..script import script


class EagerFallbackWarning(UserWarning):
    """funcopt stepped a distributed layer's local optimizer eagerly: this torch cannot script."""


_WARNED: Set[str] = set()
_LOCK = threading.Lock()


def scripted_or_eager(make: Callable[[], Any], layer: str) -> Tuple[Any, bool]:
    """``(funcopt.script(make()), True)``, or ``(make(), False)`` with a warning (once per
    process and ``layer``) where this torch cannot script."""
    reason = _compat.scripting_unavailable()
    if reason is None:
        return script(make()), True
    with _LOCK:
        first = layer not in _WARNED
        _WARNED.add(layer)
    if first:
        warnings.warn(
            f"funcopt: {layer} steps its local optimizer eagerly (same results, GIL held): "
            f"TorchScript does not work with torch {torch.__version__} ({reason})",
            EagerFallbackWarning, stacklevel=3)
    return make(), False
