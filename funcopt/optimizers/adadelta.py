r"""Adadelta (Zeiler 2012).

Update rule for each parameter :math:`p` with gradient :math:`g` (``maximize``
negates :math:`g`; ``weight_decay`` adds :math:`\lambda p` to :math:`g`)::

    v_t  = rho * v_{t-1} + (1 - rho) * g * g
    d_t  = sqrt(u_{t-1} + eps) / sqrt(v_t + eps) * g
    u_t  = rho * u_{t-1} + (1 - rho) * d_t * d_t
    p   -= lr * d_t

(``v``: ``square_avg``, ``u``: ``acc_delta``.)  Complex parameters are updated
through real views (``torch.view_as_real``), as in torch; sparse gradients are
refused with torch's error.
"""
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from ..base import Optimizer
from ._common import grad_prelude, step_tensor, zeros_like


def adadelta(
    params: List[Tensor],
    grads: List[Tensor],
    square_avgs: List[Tensor],
    acc_deltas: List[Tensor],
    lr: float,
    rho: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """Functional Adadelta over aligned tensor lists, updated in place, with
    ``torch._foreach_*`` ops in the order of torch's foreach implementation
    (bitwise equal to ``torch.optim.Adadelta(foreach=True)``).  No
    step-dependent scalars: nothing is read from the host, so the same code
    runs under ``torch.compile``."""
    if len(params) == 0:
        return
    grads = grad_prelude(params, grads, maximize, weight_decay)
    torch._foreach_mul_(square_avgs, rho)
    torch._foreach_addcmul_(square_avgs, grads, grads, 1 - rho)
    std = torch._foreach_add(square_avgs, eps)
    torch._foreach_sqrt_(std)
    deltas = torch._foreach_add(acc_deltas, eps)
    torch._foreach_sqrt_(deltas)
    torch._foreach_div_(deltas, std)
    torch._foreach_mul_(deltas, grads)
    torch._foreach_mul_(acc_deltas, rho)
    torch._foreach_addcmul_(acc_deltas, deltas, deltas, 1 - rho)
    torch._foreach_add_(params, deltas, alpha=-lr)


def adadelta_differentiable(
    params: List[Tensor],
    grads: List[Tensor],
    square_avgs: List[Tensor],
    acc_deltas: List[Tensor],
    lr: float,
    rho: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """``differentiable=True`` (eager only, grad enabled): torch's single-tensor
    formula in its differentiable form, so autograd sees the same graph."""
    for i in range(len(params)):
        param = params[i]
        grad = grads[i] if not maximize else -grads[i]
        square_avg = square_avgs[i]
        acc_delta = acc_deltas[i]
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        is_complex = torch.is_complex(param)
        if is_complex:
            square_avg = torch.view_as_real(square_avg)
            acc_delta = torch.view_as_real(acc_delta)
            grad = torch.view_as_real(grad)
        square_avg.mul_(rho).addcmul_(grad, grad, value=1 - rho)
        std = square_avg.add(eps).sqrt_()
        delta = acc_delta.add(eps).sqrt_().clone()
        delta.div_(std).mul_(grad)
        acc_delta.mul_(rho).addcmul_(delta, delta, value=1 - rho)
        if is_complex:
            delta = torch.view_as_complex(delta)
        param.add_(delta, alpha=-lr)


class AdadeltaKernel:
    """Adadelta for the shared core (slots: step, square_avg, acc_delta)."""

    def __init__(self) -> None:
        self.name = "Adadelta"

    def init(self, p: Tensor, fused: bool, h: Dict[str, float]) -> List[Tensor]:
        return [step_tensor(p, fused), zeros_like(p), zeros_like(p)]

    def check(self, params: List[Tensor], idx: List[int], grads: List[Tensor], h: Dict[str, float],
              odd: bool) -> None:
        pass

    def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
              h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor]) -> None:
        adadelta(params, grads, state[1], state[2], h["lr"], h["rho"], h["eps"], h["weight_decay"],
                 h["maximize"] != 0.0)

    def single(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
               h: Dict[str, float], first: bool) -> List[List[Tensor]]:
        if not torch.jit.is_scripting():  # differentiable=True only (sparse gradients are refused)
            adadelta_differentiable(params, grads, state[1], state[2], h["lr"], h["rho"], h["eps"],
                                    h["weight_decay"], h["maximize"] != 0.0)
        return state


class Adadelta(Optimizer):
    r"""Adadelta, as ``torch.optim.Adadelta``, with a functional, scriptable step.

    Args:
      params: iterable of tensors, of ``(name, tensor)`` pairs, or of param-group dicts.
      lr: scale applied to the delta (default ``1.0``).
      rho: decay of the running averages of squared gradients and deltas (default ``0.9``).
      eps: added inside both square roots (default ``1e-6``).
      weight_decay: L2 penalty added to the gradient (default ``0``).
      foreach: ``foreach=True`` means ``impl="foreach"``.
      capturable: accepted and recorded for state-dict compatibility.
      maximize: ascend instead of descend (default ``False``).
      differentiable: run the step with autograd (eager only, torch's single-tensor
        formula, as ``torch.optim``; ``funcopt.script`` refuses it).
      impl: ``"auto"`` (the native one-pass rule, ``adadelta.cpp``, for float32/float64
        CPU tensors where :mod:`funcopt.native` loads; else foreach), ``"native"``
        (the same, an error where the library is unavailable) or ``"foreach"``
        (torch's foreach formula: bitwise ``torch.optim.Adadelta(foreach=True)``;
        torch has no fused Adadelta kernel).

    Example::

        >>> import torch, funcopt
        >>> w = torch.ones(2, requires_grad=True)
        >>> opt = funcopt.Adadelta([w], eps=1e-2)
        >>> opt.step([torch.ones(2)])
        >>> w
        tensor([0.6985, 0.6985], requires_grad=True)
    """

    torch_class = torch.optim.Adadelta
    kernel_class = AdadeltaKernel
    sparse_msg = "Adadelta does not support sparse gradients"
    slots = (("step", None), ("square_avg", None), ("acc_delta", None))
    fused_devices = ()
    native_rule = ("adadelta", ("lr", "rho", "eps", "weight_decay", "maximize"))

    def __init__(self, params: Any, lr: Any = 1.0, rho: float = 0.9, eps: float = 1e-6,
                 weight_decay: float = 0, foreach: Optional[bool] = None, *, capturable: bool = False,
                 maximize: bool = False, differentiable: bool = False, impl: str = "auto") -> None:
        super().__init__(params, dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, maximize=maximize,
                                      capturable=capturable, foreach=foreach,
                                      differentiable=differentiable), impl)
