r"""Rprop (resilient backpropagation, Riedmiller & Braun 1993).

Per element, with gradient :math:`g` (negated when ``maximize``) and the
previous step's (masked) gradient :math:`g'`; ``s_0 = lr``::

    f   = etaplus  if g * g' > 0
          etaminus if g * g' < 0
          1        otherwise
    s_t = clamp(s_{t-1} * f, step_size_min, step_size_max)
    g   = 0 where f == etaminus          # skip the step after a sign change
    p  -= sign(g) * s_t
    g'  = g

(``g'``: ``prev``, ``s``: ``step_size``.)  Complex parameters are updated
through real views (``torch.view_as_real``; ``s_0 = complex(lr, lr)``), as in
torch; sparse gradients are refused with torch's error.
"""
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..base import Optimizer
from ._common import full_like, step_tensor, zeros_like


def rprop(
    params: List[Tensor],
    grads: List[Tensor],
    prevs: List[Tensor],
    step_sizes: List[Tensor],
    step_size_min: float,
    step_size_max: float,
    etaminus: float,
    etaplus: float,
    maximize: bool,
) -> None:
    """Functional Rprop over aligned tensor lists, updated in place, in the
    op order of torch's foreach implementation (bitwise equal to
    ``torch.optim.Rprop(foreach=True)``; torch's boolean-mask assignments are
    ``masked_fill_`` here, the same values without a data-dependent shape, so
    the code also runs under ``torch.compile`` with no host reads)."""
    if len(params) == 0:
        return
    signs = torch._foreach_mul(grads, prevs)
    if maximize:
        torch._foreach_neg_(signs)
    # prev ends the step holding this step's masked gradient: use its memory
    torch._foreach_copy_(prevs, grads)
    if maximize:
        torch._foreach_neg_(prevs)
    torch._foreach_sign_(signs)
    for sign in signs:
        sign.masked_fill_(sign.gt(0), etaplus)
        sign.masked_fill_(sign.lt(0), etaminus)
        sign.masked_fill_(sign.eq(0), 1.0)
    torch._foreach_mul_(step_sizes, signs)
    for step_size in step_sizes:
        step_size.clamp_(step_size_min, step_size_max)
    for i in range(len(prevs)):
        prevs[i].masked_fill_(signs[i].eq(etaminus), 0.0)
    grad_signs = [g.sign() for g in prevs]
    torch._foreach_addcmul_(params, grad_signs, step_sizes, -1.0)


def rprop_differentiable(
    params: List[Tensor],
    grads: List[Tensor],
    prevs: List[Tensor],
    step_sizes: List[Tensor],
    step_size_min: float,
    step_size_max: float,
    etaminus: float,
    etaplus: float,
    maximize: bool,
) -> None:
    """``differentiable=True`` (eager only, grad enabled): torch's single-tensor
    formula in its differentiable form, so autograd sees the same graph."""
    for i in range(len(params)):
        param = params[i]
        grad = grads[i] if not maximize else -grads[i]
        prev = prevs[i]
        step_size = step_sizes[i]
        if torch.is_complex(param):
            grad = torch.view_as_real(grad)
            prev = torch.view_as_real(prev)
            param = torch.view_as_real(param)
            step_size = torch.view_as_real(step_size)
        sign = grad.mul(prev.clone()).sign()
        sign[sign.gt(0)] = etaplus
        sign[sign.lt(0)] = etaminus
        sign[sign.eq(0)] = 1
        step_size.mul_(sign).clamp_(step_size_min, step_size_max)
        grad = grad.clone(memory_format=torch.preserve_format)
        grad[sign.eq(etaminus)] = 0
        param.addcmul_(grad.sign(), step_size, value=-1)
        prev.copy_(grad)


class RpropKernel:
    """Rprop for the shared core (slots: step, prev, step_size)."""

    def __init__(self) -> None:
        self.name = "Rprop"

    def init(self, p: Tensor, fused: bool, h: Dict[str, float]) -> List[Tensor]:
        lr = h["lr"]
        if p.is_complex():  # torch: complex(lr, lr)
            step_size = torch.empty_like(p, memory_format=torch.preserve_format)
            torch.view_as_real(step_size).fill_(lr)
        else:
            step_size = full_like(p, lr)
        return [step_tensor(p, fused), zeros_like(p), step_size]

    def check(self, params: List[Tensor], idx: List[int], grads: List[Tensor], h: Dict[str, float],
              odd: bool) -> None:
        pass

    def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
              h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor]) -> None:
        rprop(params, grads, state[1], state[2], h["step_sizes0"], h["step_sizes1"], h["etas0"], h["etas1"],
              h["maximize"] != 0.0)

    def single(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
               h: Dict[str, float], first: bool) -> List[List[Tensor]]:
        if not torch.jit.is_scripting():  # differentiable=True only (sparse gradients are refused)
            rprop_differentiable(params, grads, state[1], state[2], h["step_sizes0"], h["step_sizes1"],
                                 h["etas0"], h["etas1"], h["maximize"] != 0.0)
        return state


class Rprop(Optimizer):
    r"""Rprop, as ``torch.optim.Rprop``, with a functional, scriptable step.

    Args:
      params: iterable of tensors, of ``(name, tensor)`` pairs, or of param-group dicts.
      lr: initial per-element step size (default ``1e-2``).
      etas: ``(etaminus, etaplus)``: step-size factors after a sign change and
        after no change, ``0 < etaminus < 1 < etaplus`` (default ``(0.5, 1.2)``).
      step_sizes: ``(min, max)`` bounds of the step size (default ``(1e-6, 50)``).
      capturable: accepted and recorded for state-dict compatibility.
      foreach: ``foreach=True`` means ``impl="foreach"``.
      maximize: ascend instead of descend (default ``False``).
      differentiable: run the step with autograd (eager only, torch's single-tensor
        formula, as ``torch.optim``; ``funcopt.script`` refuses it).
      impl: ``"auto"`` (the native one-pass rule, ``rprop.cpp``, for float32/float64
        CPU tensors where :mod:`funcopt.native` loads; else foreach), ``"native"``
        (the same, an error where the library is unavailable) or ``"foreach"``
        (torch's foreach formula: bitwise ``torch.optim.Rprop(foreach=True)``;
        torch has no fused Rprop kernel).

    Example::

        >>> import torch, funcopt
        >>> w = torch.ones(2, requires_grad=True)
        >>> opt = funcopt.Rprop([w], lr=0.1)
        >>> opt.step([torch.tensor([1.0, -1.0])])
        >>> opt.step([torch.tensor([1.0, 1.0])])
        >>> w
        tensor([0.7800, 1.1000], requires_grad=True)
    """

    torch_class = torch.optim.Rprop
    kernel_class = RpropKernel
    sparse_msg = "Rprop does not support sparse gradients"
    slots = (("step", None), ("prev", None), ("step_size", None))
    fused_devices = ()
    native_rule = ("rprop", ("step_sizes0", "step_sizes1", "etas0", "etas1", "maximize"))

    def __init__(self, params: Any, lr: Any = 1e-2, etas: Tuple[float, float] = (0.5, 1.2),
                 step_sizes: Tuple[float, float] = (1e-6, 50), *, capturable: bool = False,
                 foreach: Optional[bool] = None, maximize: bool = False, differentiable: bool = False,
                 impl: str = "auto") -> None:
        super().__init__(params, dict(lr=lr, etas=etas, step_sizes=step_sizes, foreach=foreach,
                                      maximize=maximize, differentiable=differentiable,
                                      capturable=capturable), impl)
