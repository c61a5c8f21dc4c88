"""Differences between the torch releases funcopt supports, in one place.

funcopt supports torch 2.13 through 2.15 (``SUPPORTED``).  What differs
between those releases, as far as funcopt sees it:

* TorchScript's deprecation notice.  Every ``torch.jit.script`` /
  ``script_method`` / ``interface`` / ``save`` / ``load`` / ``trace`` call
  warns that TorchScript is deprecated: a ``DeprecationWarning`` in torch
  2.13, a ``FutureWarning`` from torch 2.14 on (same text).  Scripting one
  optimizer makes dozens of such calls (torch scripts every class and method
  it reaches), so funcopt silences exactly that notice, only around its own
  scripting calls (:func:`ignore_jit_deprecation`), and nothing else.
* TorchScript itself.  All supported releases still script.  A release (or
  a Python version) where ``torch.jit.script`` refuses even a one-line
  function gets one clear error from ``funcopt.script``
  (:func:`scripting_unavailable`, :class:`TorchScriptUnavailableError`);
  the eager and ``torch.compile`` paths do not depend on TorchScript.

Everything else funcopt uses (the fused ``torch._fused_*_`` kernels, the
``torch.optim`` state_dict format, ``torch.distributed``) is the same in
2.13, 2.14 and 2.15; ``tests/test_torch_versions.py`` checks each point on
the torch it runs on, so a new release that changes one fails there first.
"""
from __future__ import annotations

import functools
import re
import threading
import warnings
from typing import Optional, Tuple, Type

import torch

__all__ = [
    "SUPPORTED",
    "TORCH_VERSION",
    "JIT_DEPRECATION_CATEGORY",
    "JIT_DEPRECATION_MESSAGE",
    "JIT_MODULE",
    "TorchScriptUnavailableError",
    "ignore_jit_deprecation",
    "scripting_unavailable",
    "require_scripting",
]

# oldest and newest (major, minor) release funcopt is tested on; keep in sync
# with pyproject.toml's torch requirement and README's "Supported versions"
SUPPORTED: Tuple[Tuple[int, int], Tuple[int, int]] = ((2, 13), (2, 15))


def _parse(version: str) -> Tuple[int, int, int]:
    """``"2.15.0+cu132"`` -> ``(2, 15, 0)``; pre-release tags are dropped."""
    nums = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if nums is None:
        raise ValueError(f"funcopt: cannot read the torch version {version!r}")
    return int(nums.group(1)), int(nums.group(2)), int(nums.group(3) or 0)


TORCH_VERSION: Tuple[int, int, int] = _parse(torch.__version__)

# torch's notice, e.g. "`torch.jit.script` is deprecated. Please switch to ..."
# (on Python 3.14+: "`torch.jit.script` is not supported in Python 3.14+ and
# may break. ...").  Matched from the start of the message.
JIT_DEPRECATION_MESSAGE = r"`torch\.jit\.\w+` is (deprecated|not supported in Python 3\.\d+\+)"
# the module that warns: torch's own TorchScript frontend, never funcopt's
JIT_MODULE = r"torch\.jit(\.|$)"
JIT_DEPRECATION_CATEGORY: Type[Warning] = DeprecationWarning if TORCH_VERSION[:2] < (2, 14) else FutureWarning


def ignore_jit_deprecation() -> None:
    """Add a filter for torch's TorchScript deprecation notice, nothing else.

    Call inside ``warnings.catch_warnings()``: the filter lasts as long as that
    block.  It matches the notice's text, its category on this torch and the
    module that warns (``torch.jit.*``), so a warning of funcopt's own, or a
    different warning from torch, still surfaces.
    """
    warnings.filterwarnings(
        "ignore", message=JIT_DEPRECATION_MESSAGE, category=JIT_DEPRECATION_CATEGORY, module=JIT_MODULE
    )


class TorchScriptUnavailableError(RuntimeError):
    """This torch (or Python) refuses to script; use funcopt eagerly or with ``torch.compile``."""


def _probe(x: torch.Tensor) -> torch.Tensor:
    return x + 1


_PROBE_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def _probe_scripting() -> Optional[str]:
    with _PROBE_LOCK, warnings.catch_warnings():
        ignore_jit_deprecation()
        try:
            fn = torch.jit.script(_probe)
            ok = bool(torch.equal(fn(torch.zeros(1)), torch.ones(1)))
        except Exception as e:  # whatever a release that removed TorchScript raises
            return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}".rstrip(": ")
    if not ok:
        return "torch.jit.script returned a function that computes wrong results"
    return None


def scripting_unavailable() -> Optional[str]:
    """Why ``torch.jit.script`` does not work on this torch, or ``None`` if it does.

    Scripts a one-line function once per process (a few milliseconds) and
    remembers the answer.
    """
    return _probe_scripting()


def require_scripting(what: str) -> None:
    """Raise :class:`TorchScriptUnavailableError` naming ``what`` if this torch cannot script.

    Call before changing anything, so an optimizer that cannot be scripted
    stays exactly as it was (eager).
    """
    reason = scripting_unavailable()
    if reason is not None:
        raise TorchScriptUnavailableError(
            f"{what}: TorchScript does not work with torch {torch.__version__} "
            f"({reason}); step the optimizer eagerly, or compile its step with "
            f"torch.compile(opt.step), which give the same results"
        )
