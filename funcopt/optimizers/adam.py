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

from .._slots import Slots
from ..base import Optimizer
from ._common import (bump, check_differentiable, found_inf_flag, real_views, scalars, skip_step, step_tensor,
                      step_values, unscale, zeros_like)


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
        if found_inf is not None:  # 0.0 or 1.0 (found_inf_flag): undo the bump on a skipped step
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
    formula in its differentiable form, so autograd sees the same graph."""
    for i in range(len(params)):
        param = params[i]
        grad = grads[i] if not maximize else -grads[i]
        exp_avg = exp_avgs[i]
        exp_avg_sq = exp_avg_sqs[i]
        step_t = steps[i]
        step_t += 1
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
        # every check first (gradients, grad_scale/found_inf, differentiable), then changes
        idx, gs, odd = s.select(grads, grad_scale, found_inf,
                                 "Adam does not support sparse gradients, please consider SparseAdam instead")
        for b in range(len(idx)):
            if len(idx[b]) > 0 and s.hp(b).get("differentiable", 0.0) != 0.0:
                check_differentiable(s.params, idx[b])
        found_inf = found_inf_flag(found_inf)
        for b in range(len(idx)):
            if len(idx[b]) == 0:
                continue
            h = s.hp(b)
            fused = s.bucket_fused[b]
            amsgrad = h["amsgrad"] != 0.0
            diff = h.get("differentiable", 0.0) != 0.0
            with torch.no_grad():
                for i in s.missing(b, idx[b]):
                    p = s.params[i]
                    vmax = zeros_like(p) if amsgrad else torch.empty(0)
                    s.init(i, [step_tensor(p, fused), zeros_like(p), zeros_like(p), vmax])
            if diff:
                if not torch.jit.is_scripting():
                    self._differentiable(b, idx[b], gs[b], h, grad_scale, found_inf)
            elif odd[b]:
                fi, fg, si, sg, _pi, _pg = s.partition(b, idx[b], gs[b])
                with torch.no_grad():
                    self._apply(b, fi, fg, fused, h, grad_scale, found_inf)
                    self._apply(b, si, sg, False, h, grad_scale, found_inf)
            else:
                with torch.no_grad():
                    self._apply(b, idx[b], gs[b], fused, h, grad_scale, found_inf)
        s.release()

    def _apply(self, b: int, idx: List[int], grads: List[Tensor], fused: bool, h: Dict[str, float],
               grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
        if len(idx) == 0:
            return
        s = self.slots
        amsgrad = h["amsgrad"] != 0.0
        L = s.lists(b, idx)
        params, exp_avgs, exp_avg_sqs = L[0], L[2], L[3]
        vmax = L[4] if amsgrad else s.keep([])
        if params[0].is_complex():  # one dtype per bucket; never fused
            params, exp_avgs, exp_avg_sqs = s.keep(real_views(params)), s.keep(real_views(exp_avgs)), s.keep(real_views(exp_avg_sqs))
            grads = real_views(grads)
            if amsgrad:
                vmax = s.keep(real_views(vmax))
        adam(params, grads, exp_avgs, exp_avg_sqs, vmax, L[1],
             h["lr"], h["betas0"], h["betas1"], h["eps"], h["weight_decay"],
             amsgrad, h["maximize"] != 0.0, h["decoupled_weight_decay"] != 0.0,
             fused, grad_scale, found_inf, s.step_base(b, idx))

    @torch.jit.unused
    def _differentiable(self, b: int, idx: List[int], grads: List[Tensor], h: Dict[str, float],
                        grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
        if skip_step(found_inf):
            return
        grads = unscale(grads, grad_scale)
        L = self.slots.lists(b, idx)
        amsgrad = h["amsgrad"] != 0.0
        with torch.enable_grad():
            adam_differentiable(L[0], grads, L[2], L[3], L[4] if amsgrad else [], L[1],
                                h["lr"], h["betas0"], h["betas1"], h["eps"], h["weight_decay"],
                                amsgrad, h["maximize"] != 0.0, h["decoupled_weight_decay"] != 0.0)


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
