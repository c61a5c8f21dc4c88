r"""Adamax (Kingma & Ba 2015, section 7.1: Adam with the infinity norm).

Update rule for each parameter :math:`p` with gradient :math:`g` at step :math:`t`
(``maximize`` negates :math:`g`; ``weight_decay`` adds :math:`\lambda p` to
:math:`g`)::

    m_t = beta1 * m_{t-1} + (1 - beta1) * g
    u_t = max(beta2 * u_{t-1}, |g| + eps)
    p  -= lr / (1 - beta1^t) * m_t / u_t

Complex parameters are updated through real views (``torch.view_as_real``), as
in torch; sparse gradients are refused with torch's error.
"""
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..base import Optimizer
from ._common import grad_prelude, scalars, step_tensor, step_values, zeros_like


def adamax(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_infs: List[Tensor],
    steps: List[Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """Functional Adamax over aligned tensor lists, updated in place; ``steps``
    already bumped for this step.  ``torch._foreach_*`` ops in the order of
    torch's foreach implementation (bitwise equal to
    ``torch.optim.Adamax(foreach=True)``)."""
    if len(params) == 0:
        return
    grads = grad_prelude(params, grads, maximize, weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_infs, beta2)
    if not maximize and weight_decay == 0:
        grads = torch._foreach_abs(grads)  # the caller's gradients: a copy
    else:
        torch._foreach_abs_(grads)  # already our own copy
    torch._foreach_add_(grads, eps)
    torch._foreach_maximum_(exp_infs, grads)
    if torch.compiler.is_compiling():
        # no host reads under torch.compile: -(1 - beta1^t) / lr as tensors
        bc = torch._foreach_pow(beta1, steps)
        torch._foreach_sub_(bc, 1.0)
        torch._foreach_div_(bc, lr)
        denom = torch._foreach_mul(exp_infs, bc)
        torch._foreach_addcdiv_(params, exp_avgs, denom)
        return
    step_size = [(lr / (1 - beta1**s)) * -1 for s in step_values(steps)]
    torch._foreach_addcdiv_(params, exp_avgs, exp_infs, scalars(step_size))


def adamax_differentiable(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_infs: List[Tensor],
    steps: List[Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """``differentiable=True`` (eager only, grad enabled): torch's single-tensor
    formula in its differentiable form (``steps`` already bumped)."""
    for i in range(len(params)):
        param = params[i]
        grad = grads[i] if not maximize else -grads[i]
        exp_avg = exp_avgs[i]
        exp_inf = exp_infs[i]
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        if torch.is_complex(param):
            param = torch.view_as_real(param)
            grad = torch.view_as_real(grad)
            exp_avg = torch.view_as_real(exp_avg)
            exp_inf = torch.view_as_real(exp_inf)
        exp_avg.lerp_(grad, 1 - beta1)
        norm_buf = torch.cat([exp_inf.mul_(beta2).unsqueeze(0), grad.abs().add_(eps).unsqueeze_(0)], 0)
        exp_inf.copy_(torch.amax(norm_buf, 0, keepdim=False))
        clr = lr / (1 - beta1 ** steps[i].item())
        param.addcdiv_(exp_avg, exp_inf, value=-clr)


class AdamaxKernel:
    """Adamax for the shared core (slots: step, exp_avg, exp_inf)."""

    def __init__(self) -> None:
        self.name = "Adamax"

    def init(self, p: Tensor, fused: bool, h: Dict[str, float]) -> List[Tensor]:
        return [step_tensor(p, fused), zeros_like(p), zeros_like(p)]

    def check(self, params: List[Tensor], idx: List[int], grads: List[Tensor], h: Dict[str, float],
              odd: bool) -> None:
        pass

    def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
              h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor]) -> None:
        adamax(params, grads, state[1], state[2], state[0], h["lr"], h["betas0"], h["betas1"], h["eps"],
               h["weight_decay"], h["maximize"] != 0.0)

    def single(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
               h: Dict[str, float], first: bool) -> List[List[Tensor]]:
        if not torch.jit.is_scripting():  # differentiable=True only (sparse gradients are refused)
            adamax_differentiable(params, grads, state[1], state[2], state[0], h["lr"], h["betas0"],
                                  h["betas1"], h["eps"], h["weight_decay"], h["maximize"] != 0.0)
        return state


class Adamax(Optimizer):
    r"""Adamax, as ``torch.optim.Adamax``, with a functional, scriptable step.

    Args:
      params: iterable of tensors, of ``(name, tensor)`` pairs, or of param-group dicts.
      lr: learning rate (default ``2e-3``).
      betas: ``(beta1, beta2)``: decay of the first moment and of the infinity
        norm (default ``(0.9, 0.999)``).
      eps: added to ``|g|`` before the maximum (default ``1e-8``).
      weight_decay: L2 penalty added to the gradient (default ``0``).
      foreach: ``foreach=True`` means ``impl="foreach"``.
      maximize: ascend instead of descend (default ``False``).
      differentiable: run the step with autograd (eager only, torch's single-tensor
        formula, as ``torch.optim``; ``funcopt.script`` refuses it).
      capturable: accepted and recorded for state-dict compatibility.
      impl: ``"auto"`` (the native one-pass rule, ``adamax.cpp``, for float32/float64
        CPU tensors where :mod:`funcopt.native` loads; else foreach), ``"native"``
        (the same, an error where the library is unavailable) or ``"foreach"``
        (torch's foreach formula: bitwise ``torch.optim.Adamax(foreach=True)``;
        torch has no fused Adamax kernel).

    Example::

        >>> import torch, funcopt
        >>> w = torch.ones(2, requires_grad=True)
        >>> opt = funcopt.Adamax([w], lr=0.1)
        >>> opt.step([torch.ones(2)])
        >>> w
        tensor([0.9000, 0.9000], requires_grad=True)
    """

    torch_class = torch.optim.Adamax
    kernel_class = AdamaxKernel
    sparse_msg = "Adamax does not support sparse gradients"
    slots = (("step", None), ("exp_avg", None), ("exp_inf", None))
    fused_devices = ()
    native_rule = ("adamax", ("lr", "betas0", "betas1", "eps", "weight_decay", "maximize"))

    def __init__(self, params: Any, lr: Any = 2e-3, betas: Tuple[Any, Any] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, foreach: Optional[bool] = None, *, maximize: bool = False,
                 differentiable: bool = False, capturable: bool = False, impl: str = "auto") -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach,
                                      maximize=maximize, differentiable=differentiable,
                                      capturable=capturable), impl)
