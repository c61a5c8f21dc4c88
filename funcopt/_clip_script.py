"""What ``torch.jit.script(funcopt.clip_grad_norm_)`` compiles.

``funcopt.clip_grad_norm_`` carries two TorchScript overloads (``List[Tensor]``
and ``List[Optional[Tensor]]``), and torch refuses to compile an overloaded
function on its own.  ``funcopt/clip.py`` therefore points
``torch.jit.script`` at this function instead (the ``__original_fn`` redirect of
``torch.jit._script_if_tracing``): the ``List[Optional[Tensor]]`` signature,
which takes any Python list of tensors and ``None`` (empty lists included).
It must be named ``clip_grad_norm_`` (torch compiles it under the public
function's name) and live in another module (torch looks overloads up by
module and name).  Eagerly, and under ``torch.compile`` (which follows the same
redirect), it is the public function.
"""
from typing import List, Optional

import torch
from torch import Tensor

from .clip import _clip_eager, _clip_present

__all__: List[str] = []


def clip_grad_norm_(grads: List[Optional[Tensor]], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> Tensor:
    """``funcopt.clip_grad_norm_`` over a ``List[Optional[Tensor]]``, scriptable on its own."""
    if not torch.jit.is_scripting():
        return _clip_eager(grads, max_norm, norm_type, error_if_nonfinite)
    present: List[Tensor] = []
    for g in grads:
        if g is not None:
            present.append(g)
    return _clip_present(present, float(max_norm), float(norm_type), error_if_nonfinite)
