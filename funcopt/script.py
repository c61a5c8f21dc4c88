"""Scripting helpers.

Nothing is scripted at import time.  ``torch.jit.script`` warns a
``DeprecationWarning`` in torch 2.13; we silence exactly that warning, only
around our own calls, and nothing else.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, TypeVar

import torch

T = TypeVar("T")

_TORCH_JIT_DEPRECATION = r"`torch\.jit\.(script|save|load|trace|interface)` is deprecated"


@contextlib.contextmanager
def quiet_jit() -> Iterator[None]:
    """Silence torch's own TorchScript deprecation warning, nothing else."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TORCH_JIT_DEPRECATION, category=DeprecationWarning)
        yield


def script_object(obj: Any) -> Any:
    """``torch.jit.script`` of a module, function or class instance, quietly."""
    with quiet_jit():
        return torch.jit.script(obj)


def script(opt: T) -> T:
    """Compile a funcopt optimizer's step to TorchScript, in place; returns ``opt``.

    The optimizer keeps its Python API (``step``, ``param_groups``,
    ``state_dict``, ``load_state_dict``, LR schedulers); ``step`` then runs in
    the TorchScript interpreter, without the GIL, over the same parameter and
    state tensors.

    Example::

        >>> import torch, funcopt
        >>> w = torch.zeros(3, requires_grad=True)
        >>> opt = funcopt.script(funcopt.Adam([w], lr=0.1))
        >>> opt.step([torch.ones(3)])
        >>> bool((w < 0).all())
        True
    """
    opt._script()  # type: ignore[attr-defined]
    return opt
