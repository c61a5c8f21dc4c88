r"""Adam (and, with ``decoupled=True``, AdamW).

Update rule for each parameter :math:`p` with gradient :math:`g` at step :math:`t`
(``maximize`` negates :math:`g`; coupled ``weight_decay`` adds
:math:`\lambda p` to :math:`g`, decoupled multiplies :math:`p` by
:math:`1 - \eta\lambda`)::

    m_t = beta1 * m_{t-1} + (1 - beta1) * g
    v_t = beta2 * v_{t-1} + (1 - beta2) * g * g
    vmax_t = max(vmax_{t-1}, v_t)                 # amsgrad only
    p -= lr / (1 - beta1^t) * m_t / (sqrt(v_t or vmax_t) / sqrt(1 - beta2^t) + eps)
"""
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from .._slots import Slots
from ..base import Optimizer
from ._common import bump, scalars, skip_step, step_tensor, step_values, unscale, zeros_like


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
    step_base: Optional[Tensor] = None,
) -> None:
    """Functional Adam/AdamW over aligned tensor lists, updated in place.

    ``fused=True`` calls ``torch._fused_adam_`` / ``torch._fused_adamw_``
    (bitwise equal to ``torch.optim.Adam(fused=True)``); otherwise the formula
    below runs with ``torch._foreach_*`` ops in the order of torch's foreach
    implementation (bitwise equal to ``foreach=True``).  All lists must share
    one device and dtype; ``max_exp_avg_sqs`` may be empty unless ``amsgrad``.
    ``step_base``: optional tensor whose elements are exactly ``steps`` (one
    op bumps them all).
    """
    if len(params) == 0:
        return
    if fused:
        bump(steps, step_base)
        if torch.compiler.is_compiling() and not amsgrad:
            # torch 2.13 cannot functionalize the in-place fused op with an empty
            # max_exp_avg_sqs list; its out-of-place twin (same kernel) compiles
            if decoupled:
                outs = torch.ops.aten._fused_adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                                                   lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                                                   eps=eps, amsgrad=amsgrad, maximize=maximize,
                                                   grad_scale=grad_scale, found_inf=found_inf)
            else:
                outs = torch.ops.aten._fused_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                                                  lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                                                  eps=eps, amsgrad=amsgrad, maximize=maximize,
                                                  grad_scale=grad_scale, found_inf=found_inf)
            torch._foreach_copy_(params, outs[0])
            torch._foreach_copy_(exp_avgs, outs[2])
            torch._foreach_copy_(exp_avg_sqs, outs[3])
        elif decoupled:
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                                lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                                amsgrad=amsgrad, maximize=maximize, grad_scale=grad_scale, found_inf=found_inf)
        else:
            torch._fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                               lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                               amsgrad=amsgrad, maximize=maximize, grad_scale=grad_scale, found_inf=found_inf)
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf for _ in steps])
        return
    if skip_step(found_inf):
        return
    grads = unscale(grads, grad_scale)
    if maximize:
        grads = torch._foreach_neg(grads)
    bump(steps, step_base)
    if weight_decay != 0:
        if decoupled:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        elif maximize:
            torch._foreach_add_(grads, params, alpha=weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
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


class AdamCore:
    """Scriptable Adam state and step (slots: step, exp_avg, exp_avg_sq, max_exp_avg_sq)."""

    def __init__(self, slots: Slots):
        self.slots = slots

    def step(
        self,
        grads: List[Optional[Tensor]],
        grad_scale: Optional[Tensor] = None,
        found_inf: Optional[Tensor] = None,
    ) -> None:
        s = self.slots
        idx, gs = s.select(grads)
        with torch.no_grad():
            for b in range(len(idx)):
                if len(idx[b]) == 0:
                    continue
                h = s.hp(b)
                fused = s.bucket_fused[b]
                amsgrad = h["amsgrad"] != 0.0
                for i in s.missing(b, idx[b]):
                    p = s.params[i]
                    vmax = zeros_like(p) if amsgrad else torch.empty(0)
                    s.init(i, [step_tensor(p, fused), zeros_like(p), zeros_like(p), vmax])
                L = s.lists(b, idx[b])
                adam(L[0], gs[b], L[2], L[3], L[4] if amsgrad else s.keep([]), L[1],
                     h["lr"], h["betas0"], h["betas1"], h["eps"], h["weight_decay"],
                     amsgrad, h["maximize"] != 0.0, h["decoupled_weight_decay"] != 0.0,
                     fused, grad_scale, found_inf, s.step_base(b, idx[b]))
        s.release()


class Adam(Optimizer):
    r"""Adam, as ``torch.optim.Adam``, with a functional, scriptable step.

    Args:
      params: iterable of tensors, of ``(name, tensor)`` pairs, or of param-group dicts.
      lr: learning rate (default ``1e-3``).
      betas: ``(beta1, beta2)`` moving-average coefficients (default ``(0.9, 0.999)``).
      eps: added to the denominator (default ``1e-8``).
      weight_decay: L2 penalty added to the gradient (default ``0``).
      amsgrad: use the running maximum of ``v`` (default ``False``).
      foreach, fused: torch's implementation switches; ``fused=True`` means
        ``impl="fused"``, ``foreach=True`` means ``impl="foreach"``.
      maximize: ascend instead of descend (default ``False``).
      capturable: accepted and recorded for state-dict compatibility.
      differentiable: must be ``False``.
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
    core_class = AdamCore
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
