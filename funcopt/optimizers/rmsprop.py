r"""RMSprop (Hinton's lecture 6; the centered variant of Graves 2013).

Update rule for each parameter :math:`p` with gradient :math:`g` (``maximize``
negates :math:`g`; ``weight_decay`` adds :math:`\lambda p` to :math:`g`)::

    v_t   = alpha * v_{t-1} + (1 - alpha) * g * g
    a_t   = alpha * a_{t-1} + (1 - alpha) * g       # centered only
    d_t   = sqrt(v_t - a_t * a_t) + eps             # centered
          = sqrt(v_t) + eps                         # otherwise
    b_t   = momentum * b_{t-1} + g / d_t            # momentum > 0 only
    p    -= lr * b_t                                # momentum > 0
    p    -= lr * g / d_t                            # otherwise

Complex parameters are updated through real views (``torch.view_as_real``), as
in torch; sparse gradients are refused with torch's error.
"""
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from ..base import Optimizer
from ._common import grad_prelude, step_tensor, zeros_like


def rmsprop(
    params: List[Tensor],
    grads: List[Tensor],
    square_avgs: List[Tensor],
    grad_avgs: List[Tensor],
    momentum_buffers: List[Tensor],
    lr: float,
    alpha: float,
    eps: float,
    weight_decay: float,
    momentum: float,
    centered: bool,
    maximize: bool,
) -> None:
    """Functional RMSprop over aligned tensor lists, updated in place, with
    ``torch._foreach_*`` ops in the order of torch's foreach implementation
    (bitwise equal to ``torch.optim.RMSprop(foreach=True)``).  ``grad_avgs``
    is used only when ``centered``, ``momentum_buffers`` only when
    ``momentum > 0``.  No step-dependent scalars: nothing is read from the
    host, so the same code runs under ``torch.compile``."""
    if len(params) == 0:
        return
    grads = grad_prelude(params, grads, maximize, weight_decay)
    torch._foreach_mul_(square_avgs, alpha)
    torch._foreach_addcmul_(square_avgs, grads, grads, 1 - alpha)
    if centered:
        torch._foreach_lerp_(grad_avgs, grads, 1 - alpha)
        avg = torch._foreach_addcmul(square_avgs, grad_avgs, grad_avgs, -1.0)
        torch._foreach_sqrt_(avg)
        torch._foreach_add_(avg, eps)
    else:
        avg = torch._foreach_sqrt(square_avgs)
        torch._foreach_add_(avg, eps)
    if momentum > 0:
        torch._foreach_mul_(momentum_buffers, momentum)
        torch._foreach_addcdiv_(momentum_buffers, grads, avg, 1.0)
        torch._foreach_add_(params, momentum_buffers, alpha=-lr)
    else:
        torch._foreach_addcdiv_(params, grads, avg, -lr)


def rmsprop_differentiable(
    params: List[Tensor],
    grads: List[Tensor],
    square_avgs: List[Tensor],
    grad_avgs: List[Tensor],
    momentum_buffers: List[Tensor],
    lr: float,
    alpha: float,
    eps: float,
    weight_decay: float,
    momentum: float,
    centered: bool,
    maximize: bool,
) -> None:
    """``differentiable=True`` (eager only, grad enabled): torch's single-tensor
    formula in its differentiable form, so autograd sees the same graph."""
    for i in range(len(params)):
        param = params[i]
        grad = grads[i] if not maximize else -grads[i]
        square_avg = square_avgs[i]
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        is_complex = torch.is_complex(param)
        if is_complex:
            param = torch.view_as_real(param)
            grad = torch.view_as_real(grad)
            square_avg = torch.view_as_real(square_avg)
        square_avg.mul_(alpha).addcmul_(grad, grad, value=1 - alpha)
        if centered:
            grad_avg = grad_avgs[i]
            if is_complex:
                grad_avg = torch.view_as_real(grad_avg)
            grad_avg.lerp_(grad, 1 - alpha)
            avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_()
        else:
            avg = square_avg.sqrt()
        avg = avg.add(eps)
        if momentum > 0:
            buf = momentum_buffers[i]
            if is_complex:
                buf = torch.view_as_real(buf)
            buf.mul_(momentum).addcdiv_(grad, avg)
            param.add_(buf, alpha=-lr)
        else:
            param.addcdiv_(grad, avg, value=-lr)


class RMSpropKernel:
    """RMSprop for the shared core (slots: step, square_avg, momentum_buffer, grad_avg)."""

    def __init__(self) -> None:
        self.name = "RMSprop"

    def init(self, p: Tensor, fused: bool, h: Dict[str, float]) -> List[Tensor]:
        buf = zeros_like(p) if h["momentum"] > 0 else torch.empty(0)
        grad_avg = zeros_like(p) if h["centered"] != 0.0 else torch.empty(0)
        return [step_tensor(p, fused), zeros_like(p), buf, grad_avg]

    def check(self, params: List[Tensor], idx: List[int], grads: List[Tensor], h: Dict[str, float],
              odd: bool) -> None:
        pass

    def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
              h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor]) -> None:
        rmsprop(params, grads, state[1], state[3], state[2], h["lr"], h["alpha"], h["eps"],
                h["weight_decay"], h["momentum"], h["centered"] != 0.0, h["maximize"] != 0.0)

    def single(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
               h: Dict[str, float], first: bool) -> List[List[Tensor]]:
        if not torch.jit.is_scripting():  # differentiable=True only (sparse gradients are refused)
            rmsprop_differentiable(params, grads, state[1], state[3], state[2], h["lr"], h["alpha"], h["eps"],
                                   h["weight_decay"], h["momentum"], h["centered"] != 0.0,
                                   h["maximize"] != 0.0)
        return state


class RMSprop(Optimizer):
    r"""RMSprop, as ``torch.optim.RMSprop``, with a functional, scriptable step.

    Args:
      params: iterable of tensors, of ``(name, tensor)`` pairs, or of param-group dicts.
      lr: learning rate (default ``1e-2``).
      alpha: smoothing constant of the squared-gradient average (default ``0.99``).
      eps: added to the denominator (default ``1e-8``).
      weight_decay: L2 penalty added to the gradient (default ``0``).
      momentum: momentum factor (default ``0``).
      centered: normalize by the estimated variance of the gradient (default ``False``).
      capturable: accepted and recorded for state-dict compatibility.
      foreach: ``foreach=True`` means ``impl="foreach"``.
      maximize: ascend instead of descend (default ``False``).
      differentiable: run the step with autograd (eager only, torch's single-tensor
        formula, as ``torch.optim``; ``funcopt.script`` refuses it).
      impl: ``"auto"`` (the native one-pass rule, ``rmsprop.cpp``, for float32/float64
        CPU tensors where :mod:`funcopt.native` loads; else foreach), ``"native"``
        (the same, an error where the library is unavailable) or ``"foreach"``
        (torch's foreach formula: bitwise ``torch.optim.RMSprop(foreach=True)``).

    Example::

        >>> import torch, funcopt
        >>> w = torch.ones(2, requires_grad=True)
        >>> opt = funcopt.RMSprop([w], lr=0.01)
        >>> opt.step([torch.ones(2)])
        >>> w
        tensor([0.9000, 0.9000], requires_grad=True)
    """

    torch_class = torch.optim.RMSprop
    kernel_class = RMSpropKernel
    sparse_msg = "RMSprop does not support sparse gradients"
    slots = (("step", None), ("square_avg", None), ("momentum_buffer", "momentum"), ("grad_avg", "centered"))
    fused_devices = ()
    native_rule = ("rmsprop", ("lr", "alpha", "eps", "weight_decay", "momentum", "centered", "maximize"))

    def __init__(self, params: Any, lr: Any = 1e-2, alpha: float = 0.99, eps: float = 1e-8,
                 weight_decay: float = 0, momentum: float = 0, centered: bool = False,
                 capturable: bool = False, foreach: Optional[bool] = None, maximize: bool = False,
                 differentiable: bool = False, *, impl: str = "auto") -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, alpha=alpha, eps=eps, centered=centered,
                                      weight_decay=weight_decay, capturable=capturable, foreach=foreach,
                                      maximize=maximize, differentiable=differentiable), impl)
