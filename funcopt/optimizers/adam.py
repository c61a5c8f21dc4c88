r"""Adam (and, with ``decoupled=True``, AdamW).

Update rule for each parameter :math:`p` with gradient :math:`g` at step :math:`t`
(``maximize`` negates :math:`g`; coupled ``weight_decay`` adds
:math:`\lambda p` to :math:`g`, decoupled multiplies :math:`p` by
:math:`1 - \eta\lambda`)::

    m_t = beta1 * m_{t-1} + (1 - beta1) * g
    v_t = beta2 * v_{t-1} + (1 - beta2) * g * g
    vmax_t = max(vmax_{t-1}, v_t)                 # amsgrad only
    p -= lr / (1 - beta1^t) * m_t / (sqrt(v_t or vmax_t) / sqrt(1 - beta2^t) + eps)

Complex parameters are updated through real views (``torch.view_as_real``), as
in torch; sparse gradients are refused with torch's error.
"""
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..base import Optimizer
from . import _compile_ops  # noqa: F401  (registers the ops the compiled path calls)
from ._common import grad_prelude, scalars, step_tensor, step_values, zeros_like


def adam(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    max_exp_avg_sqs: List[Tensor],
    steps: List[Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    decoupled: bool,
    fused: bool,
    grad_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
) -> None:
    """Functional Adam/AdamW over aligned tensor lists, updated in place;
    ``steps`` already bumped for this step.

    ``fused=True`` calls ``torch._fused_adam_`` / ``torch._fused_adamw_``
    (bitwise equal to ``torch.optim.Adam(fused=True)``); otherwise the formula
    below runs with ``torch._foreach_*`` ops in the order of torch's foreach
    implementation (bitwise equal to ``foreach=True``).  All lists must share
    one device and dtype; ``max_exp_avg_sqs`` may be empty unless ``amsgrad``.
    """
    if len(params) == 0:
        return
    if not torch.jit.is_scripting():  # not compiled by TorchScript: saved graphs keep ATen ops only
        if fused and torch.compiler.is_compiling():
            # one opaque in-place call in the compiled graph (funcopt/optimizers/_compile_ops.py)
            torch.ops.funcopt_aten.fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1,
                                               beta2, weight_decay, eps, amsgrad, maximize, decoupled, grad_scale,
                                               found_inf)
            return
    if fused:
        if decoupled:
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                                lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                                amsgrad=amsgrad, maximize=maximize, grad_scale=grad_scale, found_inf=found_inf)
        else:
            torch._fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                               lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                               amsgrad=amsgrad, maximize=maximize, grad_scale=grad_scale, found_inf=found_inf)
        return
    grads = grad_prelude(params, grads, maximize, weight_decay, decoupled, lr)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    if amsgrad:
        torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
        denom = torch._foreach_sqrt(max_exp_avg_sqs)
    else:
        denom = torch._foreach_sqrt(exp_avg_sqs)
    if torch.compiler.is_compiling():
        # no host reads under torch.compile: bias corrections as tensors
        bc1 = torch._foreach_pow(beta1, steps)
        bc2 = torch._foreach_pow(beta2, steps)
        torch._foreach_sub_(bc1, 1.0)  # bc - 1 = -(1 - beta^t)
        torch._foreach_neg_(bc2)
        torch._foreach_add_(bc2, 1.0)
        torch._foreach_sqrt_(bc2)
        torch._foreach_div_(denom, bc2)
        torch._foreach_add_(denom, eps)
        torch._foreach_mul_(bc1, 1.0 / lr)  # -(1 - beta1^t) / lr
        torch._foreach_mul_(denom, bc1)
        torch._foreach_addcdiv_(params, exp_avgs, denom)
        return
    t = step_values(steps)
    step_size = [(lr / (1 - beta1**s)) * -1 for s in t]
    bc2_sqrt = [(1 - beta2**s) ** 0.5 for s in t]
    torch._foreach_div_(denom, scalars(bc2_sqrt))
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, scalars(step_size))


def adam_differentiable(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    max_exp_avg_sqs: List[Tensor],
    steps: List[Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    decoupled: bool,
) -> None:
    """``differentiable=True`` (eager only, grad enabled): torch's single-tensor
    formula in its differentiable form, so autograd sees the same graph
    (``steps`` already bumped)."""
    for i in range(len(params)):
        param = params[i]
        grad = grads[i] if not maximize else -grads[i]
        exp_avg = exp_avgs[i]
        exp_avg_sq = exp_avg_sqs[i]
        step_t = steps[i]
        if weight_decay != 0:
            if decoupled:
                param.mul_(1 - lr * weight_decay)
            else:
                grad = grad.add(param, alpha=weight_decay)
        vmax = max_exp_avg_sqs[i] if amsgrad else exp_avg_sq
        if torch.is_complex(param):
            grad = torch.view_as_real(grad)
            exp_avg = torch.view_as_real(exp_avg)
            exp_avg_sq = torch.view_as_real(exp_avg_sq)
            if amsgrad:
                vmax = torch.view_as_real(vmax)
            param = torch.view_as_real(param)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step_t
        bias_correction2 = 1 - beta2**step_t
        step_size_neg = (lr / bias_correction1).neg()
        bias_correction2_sqrt = bias_correction2.sqrt()
        if amsgrad:
            vmax.copy_(torch.maximum(vmax.clone(), exp_avg_sq))
            denom = (vmax.sqrt() / (bias_correction2_sqrt * step_size_neg)).add_(eps / step_size_neg)
        else:
            denom = (exp_avg_sq.sqrt() / (bias_correction2_sqrt * step_size_neg)).add_(eps / step_size_neg)
        param.addcdiv_(exp_avg.clone(), denom)


class AdamKernel:
    """Adam for the shared core (slots: step, exp_avg, exp_avg_sq, max_exp_avg_sq)."""

    def __init__(self) -> None:
        self.name = "Adam"

    def init(self, p: Tensor, fused: bool, h: Dict[str, float]) -> List[Tensor]:
        vmax = zeros_like(p) if h["amsgrad"] != 0.0 else torch.empty(0)
        return [step_tensor(p, fused), zeros_like(p), zeros_like(p), vmax]

    def check(self, params: List[Tensor], idx: List[int], grads: List[Tensor], h: Dict[str, float],
              odd: bool) -> None:
        pass

    def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
              h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor]) -> None:
        amsgrad = h["amsgrad"] != 0.0
        vmax = state[3] if amsgrad else torch.jit.annotate(List[Tensor], [])
        adam(params, grads, state[1], state[2], vmax, state[0],
             h["lr"], h["betas0"], h["betas1"], h["eps"], h["weight_decay"],
             amsgrad, h["maximize"] != 0.0, h["decoupled_weight_decay"] != 0.0,
             fused, grad_scale, found_inf)

    def single(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
               h: Dict[str, float], first: bool) -> List[List[Tensor]]:
        if not torch.jit.is_scripting():  # differentiable=True only (sparse gradients are refused)
            amsgrad = h["amsgrad"] != 0.0
            adam_differentiable(params, grads, state[1], state[2], state[3] if amsgrad else [], state[0],
                                h["lr"], h["betas0"], h["betas1"], h["eps"], h["weight_decay"],
                                amsgrad, h["maximize"] != 0.0, h["decoupled_weight_decay"] != 0.0)
        return state


class Adam(Optimizer):
    r"""Adam, as ``torch.optim.Adam``, with a functional, scriptable step.

    Args:
      params: iterable of tensors, of ``(name, tensor)`` pairs, or of param-group dicts.
      lr: learning rate (default ``1e-3``).
      betas: ``(beta1, beta2)`` moving-average coefficients (default ``(0.9, 0.999)``).
      eps: added to the denominator (default ``1e-8``).
      weight_decay: L2 penalty added to the gradient (default ``0``).
      amsgrad: use the running maximum of ``v`` (default ``False``).
      foreach: ``foreach=True`` means ``impl="foreach"``.
      fused: ``fused=True`` means ``impl="fused"``.
      maximize: ascend instead of descend (default ``False``).
      capturable: accepted and recorded for state-dict compatibility.
      differentiable: run the step with autograd (eager only, torch's single-tensor
        formula, as ``torch.optim``; ``funcopt.script`` refuses it).
      decoupled_weight_decay: AdamW's decay (default ``False``).
      impl: ``"auto"`` (fused ATen kernel where it exists for the device and
        dtype, else foreach), ``"foreach"`` or ``"fused"``.

    Example::

        >>> import torch, funcopt
        >>> w = torch.ones(2, requires_grad=True)
        >>> opt = funcopt.Adam([w], lr=0.1)
        >>> opt.step([torch.ones(2)])
        >>> w
        tensor([0.9000, 0.9000], requires_grad=True)
    """

    torch_class = torch.optim.Adam
    kernel_class = AdamKernel
    sparse_msg = "Adam does not support sparse gradients, please consider SparseAdam instead"
    slots = (("step", None), ("exp_avg", None), ("exp_avg_sq", None), ("max_exp_avg_sq", "amsgrad"))
    fused_devices = ("cpu", "cuda", "mps", "xpu")

    def __init__(self, params: Any, lr: Any = 1e-3, betas: Tuple[Any, Any] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, amsgrad: bool = False, *, foreach: Optional[bool] = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, decoupled_weight_decay: bool = False, impl: str = "auto") -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                                      maximize=maximize, foreach=foreach, capturable=capturable,
                                      differentiable=differentiable, fused=fused,
                                      decoupled_weight_decay=decoupled_weight_decay), impl)
