r"""Adagrad.

Update rule (``g`` negated when ``maximize``; ``g += weight_decay * p``)::

    clr  = lr / (1 + (t - 1) * lr_decay)
    s_t  = s_{t-1} + g * g                 # s_0 = initial_accumulator_value
    p   -= clr * g / (sqrt(s_t) + eps)
"""
from typing import Any, List, Optional

import torch
from torch import Tensor

from .._slots import Slots
from ..base import Optimizer
from ._common import bump, full_like, scalars, skip_step, step_tensor, step_values, unscale


def adagrad(
    params: List[Tensor],
    grads: List[Tensor],
    state_sums: List[Tensor],
    steps: List[Tensor],
    lr: float,
    lr_decay: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    fused: bool,
    grad_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    step_base: Optional[Tensor] = None,
) -> None:
    """Functional Adagrad over aligned lists, in place (``torch._fused_adagrad_``
    when ``fused``, else torch's foreach order: bitwise equal to torch.optim)."""
    if len(params) == 0:
        return
    if fused and torch.compiler.is_compiling():
        fused = False  # torch 2.13 has no fake kernel for this fused op; the foreach formula compiles
    if fused:
        bump(steps, step_base)
        torch._fused_adagrad_(params, grads, state_sums, steps, lr=lr, lr_decay=lr_decay,
                              weight_decay=weight_decay, eps=eps, maximize=maximize,
                              grad_scale=grad_scale, found_inf=found_inf)
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
        if maximize:
            torch._foreach_add_(grads, params, alpha=weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    torch._foreach_addcmul_(state_sums, grads, grads, 1.0)
    std = torch._foreach_sqrt(state_sums)
    torch._foreach_add_(std, eps)
    if torch.compiler.is_compiling():
        # no host reads under torch.compile: -lr / (1 + (t - 1) * lr_decay) as tensors
        clr = torch._foreach_sub(steps, 1.0)
        torch._foreach_mul_(clr, lr_decay)
        torch._foreach_add_(clr, 1.0)
        torch._foreach_div_(clr, -lr)
        numerator = torch._foreach_div(grads, clr)
    else:
        minus_clr = [-lr / (1 + (t - 1) * lr_decay) for t in step_values(steps)]
        if weight_decay != 0 or maximize:
            torch._foreach_mul_(grads, scalars(minus_clr))
            numerator = grads
        else:
            numerator = torch._foreach_mul(grads, scalars(minus_clr))
    torch._foreach_addcdiv_(params, numerator, std)


class AdagradCore:
    """Scriptable Adagrad state and step (slots: step, sum).

    State exists from construction, as in torch; constructing a core over
    slots that already hold state keeps it."""

    def __init__(self, slots: Slots):
        self.slots = slots
        has = slots.has_state
        params = slots.params
        fused = slots.bucket_fused
        buckets = slots.buckets
        for b in range(len(buckets)):
            init = slots.hp(b)["initial_accumulator_value"]
            for i in buckets[b]:
                if not has[i]:
                    slots.init(i, [step_tensor(params[i], fused[b]), full_like(params[i], init)])

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
                L = s.lists(b, idx[b])
                adagrad(L[0], gs[b], L[2], L[1], h["lr"], h["lr_decay"], h["weight_decay"], h["eps"],
                        h["maximize"] != 0.0, s.bucket_fused[b], grad_scale, found_inf, s.step_base(b, idx[b]))
        s.release()


class Adagrad(Optimizer):
    r"""Adagrad, as ``torch.optim.Adagrad``, with a functional, scriptable step.

    Args:
      params: iterable of tensors, of ``(name, tensor)`` pairs, or of param-group dicts.
      lr: learning rate (default ``1e-2``).
      lr_decay: learning-rate decay (default ``0``).
      weight_decay: L2 penalty (default ``0``).
      initial_accumulator_value: starting value of the sum of squares (default ``0``).
      eps: added to the denominator (default ``1e-10``).
      foreach, fused: torch's switches; ``fused=True`` means ``impl="fused"`` (CPU only in torch 2.13).
      maximize: ascend instead of descend (default ``False``).
      differentiable: must be ``False``.
      impl: ``"auto"`` | ``"foreach"`` | ``"fused"``.

    Example::

        >>> import torch, funcopt
        >>> w = torch.ones(2, requires_grad=True)
        >>> opt = funcopt.Adagrad([w], lr=0.5)
        >>> opt.step([torch.ones(2)])
        >>> w
        tensor([0.5000, 0.5000], requires_grad=True)
    """

    torch_class = torch.optim.Adagrad
    core_class = AdagradCore
    slots = (("step", None), ("sum", None))
    fused_devices = ("cpu",)

    def __init__(self, params: Any, lr: Any = 1e-2, lr_decay: float = 0, weight_decay: float = 0,
                 initial_accumulator_value: float = 0, eps: float = 1e-10, foreach: Optional[bool] = None, *,
                 maximize: bool = False, differentiable: bool = False, fused: Optional[bool] = None,
                 impl: str = "auto") -> None:
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value, foreach=foreach,
                                      maximize=maximize, differentiable=differentiable, fused=fused), impl)
