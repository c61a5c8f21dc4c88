r"""RAdam (rectified Adam; ``decoupled_weight_decay=True``: RAdamW).

Update rule for each parameter :math:`p` with gradient :math:`g` at step :math:`t`
(``maximize`` negates :math:`g`; coupled ``weight_decay`` adds
:math:`\lambda p` to :math:`g`, decoupled multiplies :math:`p` by
:math:`1 - \eta\lambda`)::

    m_t = beta1 * m_{t-1} + (1 - beta1) * g
    v_t = beta2 * v_{t-1} + (1 - beta2) * g * g
    rho_inf = 2 / (1 - beta2) - 1
    rho_t   = rho_inf - 2 t beta2^t / (1 - beta2^t)
    if rho_t > 5:
        r  = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t))
        p -= lr / (1 - beta1^t) * m_t * r * sqrt(1 - beta2^t) / (sqrt(v_t) + eps)
    else:
        p -= lr / (1 - beta1^t) * m_t

Complex parameters are updated through real views; sparse gradients are
refused with torch's error.
"""
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..base import Optimizer
from ._common import grad_prelude, scalars, step_tensor, step_values, zeros_like


def radam(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    steps: List[Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
) -> None:
    """Functional RAdam over aligned tensor lists, updated in place; ``steps``
    already bumped for this step.  torch's ``_multi_tensor_radam`` op order
    (bitwise equal to ``torch.optim.RAdam(foreach=True)``)."""
    if len(params) == 0:
        return
    # torch negates, reads the steps, then decays; the step reads touch neither list
    grads = grad_prelude(params, grads, maximize, weight_decay, decoupled_weight_decay, lr)
    rho_inf = 2 / (1 - beta2) - 1
    compiling = torch.compiler.is_compiling()
    t: List[float] = []
    rho_t_list: List[float] = []
    if not compiling:
        t = step_values(steps)
        rho_t_list = [rho_inf - 2 * s * (beta2**s) / (1 - beta2**s) for s in t]
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    if compiling:
        # no host reads under torch.compile: torch's capturable formula (tensors),
        # in float64 like eager's host doubles (in float32, rho_inf - 2 t beta2^t /
        # (1 - beta2^t) cancels: ~1e-5 relative error in the update at beta2=0.999)
        steps = [s.to(torch.float64) for s in steps]
        bc1 = torch._foreach_pow(beta2, steps)
        torch._foreach_neg_(bc1)
        torch._foreach_add_(bc1, 1.0)
        rho_t = torch._foreach_pow(beta2, steps)
        torch._foreach_mul_(rho_t, steps)
        torch._foreach_mul_(rho_t, 2.0)
        torch._foreach_div_(rho_t, bc1)
        torch._foreach_neg_(rho_t)
        torch._foreach_add_(rho_t, rho_inf)
        num = torch._foreach_sub(rho_t, 4.0)
        sub2 = torch._foreach_sub(rho_t, 2.0)
        torch._foreach_mul_(num, sub2)
        torch._foreach_mul_(num, rho_inf)
        den = torch._foreach_mul(rho_t, (rho_inf - 4) * (rho_inf - 2))
        torch._foreach_div_(num, den)
        torch._foreach_sqrt_(num)
        rect = [torch.where(rho_t[j] > 5.0, num[j], 0.0) for j in range(len(num))]
        unrect = [torch.where(r > 0, 0.0, 1.0) for r in rect]
        torch._foreach_mul_(unrect, lr)
        bc1 = torch._foreach_pow(beta1, steps)
        torch._foreach_neg_(bc1)
        torch._foreach_add_(bc1, 1.0)
        torch._foreach_div_(unrect, bc1)
        torch._foreach_neg_(unrect)
        bc2 = torch._foreach_pow(beta2, steps)
        torch._foreach_neg_(bc2)
        torch._foreach_add_(bc2, 1.0)
        torch._foreach_sqrt_(bc2)
        torch._foreach_mul_(bc2, lr)
        torch._foreach_mul_(bc2, rect)
        torch._foreach_neg_(bc2)
        torch._foreach_div_(bc2, bc1)
        buffer = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(buffer, eps)
        torch._foreach_div_(buffer, bc2)
        torch._foreach_reciprocal_(buffer)
        torch._foreach_add_(buffer, unrect)
        torch._foreach_addcmul_(params, exp_avgs, buffer)
        return
    unrect_size: List[float] = []
    rect_size: List[float] = []
    for j in range(len(t)):
        rho = rho_t_list[j]
        r = 0.0
        if rho > 5:
            r = ((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho)) ** 0.5
        bc1 = 1 - beta1 ** t[j]
        unrect_size.append((lr * (0.0 if r > 0 else 1.0) / bc1) * -1)
        rect_size.append(((1 - beta2 ** t[j]) ** 0.5) * (lr * r / bc1) * -1)
    buffer = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(buffer, eps)
    torch._foreach_div_(buffer, scalars(rect_size))
    torch._foreach_reciprocal_(buffer)
    torch._foreach_add_(buffer, scalars(unrect_size))
    # buffer = sqrt(1 - beta2^t) * rect_step_size / (sqrt(v) + eps) + unrect_step_size
    torch._foreach_addcmul_(params, exp_avgs, buffer)


def radam_differentiable(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    steps: List[Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
) -> None:
    """``differentiable=True`` (eager only, grad enabled): torch's single-tensor
    formula in its differentiable form (``steps`` already bumped)."""
    for i in range(len(params)):
        param = params[i]
        grad = grads[i] if not maximize else -grads[i]
        exp_avg = exp_avgs[i]
        exp_avg_sq = exp_avg_sqs[i]
        if torch.is_complex(param):
            param = torch.view_as_real(param)
            grad = torch.view_as_real(grad)
            exp_avg = torch.view_as_real(exp_avg)
            exp_avg_sq = torch.view_as_real(exp_avg_sq)
        step = steps[i].item()
        if weight_decay != 0:
            if decoupled_weight_decay:
                param.mul_(1 - lr * weight_decay)
            else:
                grad = grad.add(param, alpha=weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        bias_corrected_exp_avg = exp_avg / bias_correction1
        rho_inf = 2 / (1 - beta2) - 1
        rho_t = rho_inf - 2 * step * (beta2**step) / bias_correction2
        if rho_t > 5.0:
            rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
            adaptive_lr = (bias_correction2**0.5) / exp_avg_sq.sqrt().add(eps)
            param.add_(bias_corrected_exp_avg * lr * adaptive_lr * rect, alpha=-1.0)
        else:
            param.add_(bias_corrected_exp_avg * lr, alpha=-1.0)


class RAdamKernel:
    """RAdam for the shared core (slots: step, exp_avg, exp_avg_sq)."""

    def __init__(self) -> None:
        self.name = "RAdam"

    def init(self, p: Tensor, fused: bool, h: Dict[str, float]) -> List[Tensor]:
        return [step_tensor(p, fused), zeros_like(p), zeros_like(p)]

    def check(self, params: List[Tensor], idx: List[int], grads: List[Tensor], h: Dict[str, float],
              odd: bool) -> None:
        pass

    def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
              h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor]) -> None:
        radam(params, grads, state[1], state[2], state[0], h["lr"], h["betas0"], h["betas1"], h["eps"],
              h["weight_decay"], h["decoupled_weight_decay"] != 0.0, h["maximize"] != 0.0)

    def single(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
               h: Dict[str, float], first: bool) -> List[List[Tensor]]:
        if not torch.jit.is_scripting():  # differentiable=True only (sparse gradients are refused)
            radam_differentiable(params, grads, state[1], state[2], state[0], h["lr"], h["betas0"], h["betas1"],
                                 h["eps"], h["weight_decay"], h["decoupled_weight_decay"] != 0.0,
                                 h["maximize"] != 0.0)
        return state


class RAdam(Optimizer):
    r"""RAdam, as ``torch.optim.RAdam``, with a functional, scriptable step.

    Args:
      params: iterable of tensors, of ``(name, tensor)`` pairs, or of param-group dicts.
      lr: learning rate (default ``1e-3``).
      betas: ``(beta1, beta2)`` moving-average coefficients (default ``(0.9, 0.999)``).
      eps: added to the denominator (default ``1e-8``).
      weight_decay: weight decay (default ``0``): an L2 penalty added to the
        gradient, or with ``decoupled_weight_decay`` a shrink of the parameter.
      decoupled_weight_decay: RAdamW's decay (default ``False``).
      foreach: ``foreach=True`` means ``impl="foreach"``.
      maximize: ascend instead of descend (default ``False``).
      capturable: accepted and recorded for state-dict compatibility.
      differentiable: run the step with autograd (eager only, torch's single-tensor
        formula, as ``torch.optim``; ``funcopt.script`` refuses it).
      impl: ``"auto"`` (the native one-pass rule, ``radam.cpp``, for float32/float64
        CPU tensors where :mod:`funcopt.native` loads; else foreach), ``"native"``
        (the same, an error where the library is unavailable) or ``"foreach"``
        (torch's foreach formula: bitwise ``torch.optim.RAdam(foreach=True)``;
        torch has no fused RAdam kernel).

    Example::

        >>> import torch, funcopt
        >>> w = torch.ones(2, requires_grad=True)
        >>> opt = funcopt.RAdam([w], lr=0.1)
        >>> opt.step([torch.ones(2)])
        >>> w
        tensor([0.9000, 0.9000], requires_grad=True)
    """

    torch_class = torch.optim.RAdam
    kernel_class = RAdamKernel
    sparse_msg = "RAdam does not support sparse gradients"
    slots = (("step", None), ("exp_avg", None), ("exp_avg_sq", None))
    fused_devices = ()
    native_rule = ("radam", ("lr", "betas0", "betas1", "eps", "weight_decay", "decoupled_weight_decay",
                             "maximize"))

    def __init__(self, params: Any, lr: Any = 1e-3, betas: Tuple[Any, Any] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, decoupled_weight_decay: bool = False, *,
                 foreach: Optional[bool] = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, impl: str = "auto") -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize,
                                      foreach=foreach, capturable=capturable,
                                      decoupled_weight_decay=decoupled_weight_decay,
                                      differentiable=differentiable), impl)
