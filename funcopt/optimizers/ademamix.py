r"""AdEMAMix (Pagliardini et al. 2024, "The AdEMAMix Optimizer: Better,
Faster, Older", arXiv:2409.03137).

Adam plus a second, slow momentum ``m2`` mixed into the update with weight
``alpha``.  With ``t`` the group's step counter (``group['step']``, 1 on the
first step), ``maximize`` negating ``g`` and weight decay ``wd`` applied
first (coupled: ``g += wd * p``; decoupled: ``p *= 1 - wd * lr``, or
``1 - wd`` with ``fixed_decay``)::

    m1 = m1 + (1 - beta1) * (g - m1)                  # lerp
    v  = beta2 * v + (1 - beta2) * g * g
    m2 = m2 + (1 - beta3_t) * (g - m2)
    p  = p - lr * (m1 / (1 - beta1^t) + alpha_t * m2) / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Without ``t_alpha_beta3`` (``None``), ``alpha_t = alpha`` and ``beta3_t =
beta3``; with it (``T``), both warm up::

    alpha_t = min(t * alpha / T, alpha)
    beta3_t = min(exp(log(beta1) * log(beta3) / ((1 - t / T) * log(beta3) + (t / T) * log(beta1))), beta3)

The oracle is ``pytorch_optimizer.AdEMAMix`` (pytorch-optimizer 4.1.0, a test
dependency): same arguments and defaults, same state (``exp_avg``,
``exp_avg_sq``, ``exp_avg_slow``, all three from the first step), the step
counter per param group (``group['step']``, bumped on every ``step()`` for
every group).  The foreach formula runs the oracle's foreach operations in
its order, with the per-step scalars computed on the host as the oracle does:
bitwise equal in float32 and float64 (float16/bfloat16: the oracle's
divide-then-add form, also taken here).  Complex parameters and sparse
gradients are refused, as the oracle refuses them.  The oracle's
per-parameter path (``foreach=False``) rounds ``exp_avg_sq`` differently from
its foreach path in float16/bfloat16; funcopt always runs the foreach formula
(``foreach=False`` is recorded only).  ``maximize`` is in ``param_groups``
here (the oracle keeps it on the instance); ``state_dict()`` leaves it out of
a group where it equals the constructor's, and a loaded group without it
takes the constructor's, so state dicts move both ways.

Where funcopt is stricter than the oracle (which fails at the first step):
``t_alpha_beta3`` must be positive (``0`` divides by zero) and, with it set,
``beta1`` and ``beta3`` must be positive (the schedule takes their
logarithms).  A group's ``t_alpha_beta3`` can go from ``None`` to a number
between steps, not back (the kernel's hyperparameters are numbers; set
``t_alpha_beta3`` at construction or with ``load_state_dict``).
"""
import math
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..base import Optimizer
from ._common import zeros_like
from ._core import StepCounter
from .adopt import _number, check_range, fill_instance_keys, strip_instance_keys

# options the oracle keeps on its instance, not in its param groups (see adopt.strip_instance_keys)
INSTANCE_KEYS = ("maximize",)


def ademamix(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    exp_avg_slows: List[Tensor],
    step: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    beta3: float,
    alpha: float,
    t_alpha_beta3: float,
    eps: float,
    weight_decay: float,
    weight_decouple: bool,
    fixed_decay: bool,
    maximize: bool,
) -> None:
    """Functional AdEMAMix over aligned tensor lists of one device and dtype,
    updated in place.  ``step``: the group's counter (a 0-d tensor, already
    bumped for this step).  ``t_alpha_beta3 <= 0``: no warm-up (the class
    refuses 0, so ``-1.0`` stands for ``None``).

    Eagerly and scripted, the oracle's foreach operations in its order with
    its host-computed scalars (bitwise equal); under ``torch.compile`` the
    scalars are tensors computed from ``step`` (no host read)."""
    if len(params) == 0:
        return
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0.0:
        if weight_decouple:
            factor = 1.0 - weight_decay if fixed_decay else 1.0 - weight_decay * lr
            torch._foreach_mul_(params, factor)
        elif maximize:  # our own list: in place
            torch._foreach_add_(grads, params, alpha=weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    low_precision = params[0].dtype == torch.float16 or params[0].dtype == torch.bfloat16
    if torch.compiler.is_compiling():
        _ademamix_compiled(params, grads, exp_avgs, exp_avg_sqs, exp_avg_slows, step, lr, beta1, beta2, beta3,
                           alpha, t_alpha_beta3, eps, low_precision)
        return
    t = float(step.reshape([]))
    bias_correction1 = 1.0 - math.pow(beta1, t)
    bias_correction2_sq = math.sqrt(1.0 - math.pow(beta2, t))
    alpha_t = alpha
    beta3_t = beta3
    if t_alpha_beta3 > 0.0:
        alpha_t = min(t * alpha / t_alpha_beta3, alpha)
        log_beta1 = math.log(beta1)
        log_beta3 = math.log(beta3)
        frac = t / t_alpha_beta3
        beta3_t = min(math.exp(log_beta1 * log_beta3 / ((1.0 - frac) * log_beta3 + frac * log_beta1)), beta3)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    torch._foreach_lerp_(exp_avg_slows, grads, 1.0 - beta3_t)
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denoms, bias_correction2_sq)
    torch._foreach_add_(denoms, eps)
    updates = torch._foreach_div(exp_avgs, bias_correction1)
    torch._foreach_add_(updates, exp_avg_slows, alpha=alpha_t)
    if low_precision:
        torch._foreach_div_(updates, denoms)
        torch._foreach_add_(params, updates, alpha=-lr)
    else:
        torch._foreach_addcdiv_(params, updates, denoms, -lr)


def _ademamix_compiled(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
                       exp_avg_slows: List[Tensor], step: Tensor, lr: float, beta1: float, beta2: float, beta3: float,
                       alpha: float, t_alpha_beta3: float, eps: float, low_precision: bool) -> None:
    """The rule under torch.compile: the bias corrections and the warm-up of
    ``alpha`` and ``beta3`` as float64 tensors from ``step`` (on the
    parameters' device, cast to their dtype where an op needs it).  Equal to
    eager to rounding."""
    dt = params[0].dtype
    t = step.reshape([]).to(device=params[0].device, dtype=torch.float64)
    bias_correction1 = torch.pow(beta1, t).neg().add(1.0).to(dt)
    bias_correction2_sq = torch.pow(beta2, t).neg().add(1.0).sqrt().to(dt)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    if t_alpha_beta3 > 0.0:
        log_beta1 = math.log(beta1)
        log_beta3 = math.log(beta3)
        frac = t / t_alpha_beta3
        beta3_t = torch.clamp(torch.exp(log_beta1 * log_beta3 / ((1.0 - frac) * log_beta3 + frac * log_beta1)),
                              max=beta3)
        weight = beta3_t.neg().add(1.0).to(dt)
        torch._foreach_lerp_(exp_avg_slows, grads, [weight for _ in exp_avg_slows])
    else:
        torch._foreach_lerp_(exp_avg_slows, grads, 1.0 - beta3)
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denoms, bias_correction2_sq)
    torch._foreach_add_(denoms, eps)
    updates = torch._foreach_div(exp_avgs, bias_correction1)
    if t_alpha_beta3 > 0.0:
        alpha_t = torch.clamp(t * (alpha / t_alpha_beta3), max=alpha).to(dt)
        torch._foreach_add_(updates, torch._foreach_mul(exp_avg_slows, alpha_t))
    else:
        torch._foreach_add_(updates, exp_avg_slows, alpha=alpha)
    if low_precision:
        torch._foreach_div_(updates, denoms)
        torch._foreach_add_(params, updates, alpha=-lr)
    else:
        torch._foreach_addcdiv_(params, updates, denoms, -lr)


class AdEMAMixKernel:
    """AdEMAMix for the shared core (slots: exp_avg, exp_avg_sq, exp_avg_slow; group
    state: step): a ``Kernel`` (funcopt/optimizers/_core.py; ``group["step"]``: ``StepCounter``)."""

    def __init__(self) -> None:
        self.name = "AdEMAMix"

    def init(self, p: Tensor, fused: bool, h: Dict[str, float]) -> List[Tensor]:
        return [zeros_like(p), zeros_like(p), zeros_like(p)]

    def check(self, params: List[Tensor], idx: List[int], grads: List[Tensor], h: Dict[str, float],
              odd: bool) -> None:
        for i in idx:
            if params[i].is_complex():
                raise RuntimeError("AdEMAMix does not support complex parameter.")

    def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
              h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor]) -> None:
        gs = state[len(state) - 1][0]
        ademamix(params, grads, state[0], state[1], state[2], gs[0], h["lr"], h["betas0"], h["betas1"], h["betas2"],
                 h["alpha"], h.get("t_alpha_beta3", -1.0), h["eps"], h["weight_decay"],
                 h["weight_decouple"] != 0.0, h["fixed_decay"] != 0.0, h["maximize"] != 0.0)

    def single(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
               h: Dict[str, float], first: bool) -> List[List[Tensor]]:
        return state  # never called: sparse gradients are refused, no differentiable=True


class AdEMAMix(Optimizer):
    r"""AdEMAMix (Pagliardini et al. 2024) with a functional, scriptable step;
    the oracle is ``pytorch_optimizer.AdEMAMix``.

    Args:
      params: iterable of tensors, of ``(name, tensor)`` pairs, or of param-group dicts.
      lr: learning rate (default ``1e-3``).
      betas: ``(beta1, beta2, beta3)``: decay of the fast momentum, of the
        second moment and of the slow momentum (default ``(0.9, 0.999, 0.9999)``).
      weight_decay: decay coefficient (default ``0``).
      weight_decouple: decoupled decay, ``p *= 1 - weight_decay * lr``
        (default ``False``: coupled, ``g += weight_decay * p``).
      fixed_decay: with ``weight_decouple``, ``p *= 1 - weight_decay``
        (not scaled by ``lr``; default ``False``).
      alpha: weight of the slow momentum in the update (default ``5.0``).
      t_alpha_beta3: steps over which ``alpha`` and ``beta3`` warm up
        (default ``None``: no warm-up); positive, and then ``beta1`` and
        ``beta3`` must be positive.
      eps: added to the denominator (default ``1e-8``).
      maximize: ascend instead of descend (default ``False``).
      foreach: ``foreach=True`` means ``impl="foreach"``.
      impl: ``"auto"`` (the foreach formula, cache-blocked on CPU: bitwise the
        same) or ``"foreach"`` (one foreach call per bucket); there is no
        fused or native AdEMAMix kernel.

    Example::

        >>> import torch, funcopt
        >>> w = torch.ones(2, requires_grad=True)
        >>> opt = funcopt.AdEMAMix([w], lr=0.1, alpha=1.0)
        >>> opt.step([torch.tensor([1.0, -2.0])])
        >>> w
        tensor([0.9000, 1.1000], requires_grad=True)
        >>> sorted(opt.state[w]), opt.param_groups[0]["step"]
        (['exp_avg', 'exp_avg_slow', 'exp_avg_sq'], 1)
    """

    torch_class = "pytorch_optimizer:AdEMAMix"
    complex_differs_from_oracle = True  # refused with a RuntimeError (the oracle: NoComplexParameterError)
    kernel_class = AdEMAMixKernel
    group_rule_class = StepCounter  # group['step'] += 1 each step
    sparse_msg = "AdEMAMix does not support sparse gradient."
    slots = (("exp_avg", None), ("exp_avg_sq", None), ("exp_avg_slow", None))
    group_state = (("step", 0),)
    group_state_lazy = ("step",)  # pytorch_optimizer adds group['step'] at the first step
    fused_devices = ()

    def __init__(self, params: Any, lr: Any = 1e-3, betas: Tuple[Any, Any, Any] = (0.9, 0.999, 0.9999),
                 weight_decay: float = 0.0, weight_decouple: bool = False, fixed_decay: bool = False,
                 alpha: float = 5.0, t_alpha_beta3: Optional[float] = None, eps: float = 1e-8,
                 maximize: bool = False, foreach: Optional[bool] = None, *, impl: str = "auto") -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, weight_decouple=weight_decouple,
                                      fixed_decay=fixed_decay, alpha=alpha, t_alpha_beta3=t_alpha_beta3, eps=eps,
                                      maximize=maximize, foreach=foreach), impl)

    def _validate_hyper(self, group: Dict[str, Any]) -> None:
        # the oracle's range checks first, as its constructor runs them (betas=(1.0, 0.9) is the
        # oracle's "beta1 must be in the range", not funcopt's tuple-length verdict)
        self.check_ranges(group)
        super()._validate_hyper(group)

    @staticmethod
    def check_ranges(group: Dict[str, Any]) -> None:
        """The oracle's range checks, and funcopt's for ``t_alpha_beta3`` (see the
        module docstring); funcopt/_hyper.py calls them wherever a value enters."""
        owner = "AdEMAMix"
        check_range(owner, group)
        t = group.get("t_alpha_beta3")
        if t is None:
            return
        if isinstance(t, bool) or not isinstance(t, (int, float, Tensor)) or (
                isinstance(t, Tensor) and (t.numel() != 1 or t.is_complex() or t.dtype == torch.bool)):
            raise TypeError(f"{owner}: t_alpha_beta3 must be a number or None, got t_alpha_beta3={t!r}")
        tv = float(t)
        if math.isnan(tv) or tv <= 0.0:
            raise ValueError(f"{owner}: t_alpha_beta3 must be positive or None, got t_alpha_beta3={t!r} "
                             f"(the warm-up divides by it)")
        betas = group.get("betas")
        if isinstance(betas, (tuple, list)) and len(betas) == 3:
            for j in (0, 2):
                if _number(betas[j]) == 0.0:
                    raise ValueError(f"{owner}: with t_alpha_beta3 set, beta{j + 1} must be positive (the beta3 "
                                     f"warm-up takes log(beta1) and log(beta3)), got betas={betas!r}")

    def state_dict(self) -> Dict[str, Any]:
        """The oracle's format: ``maximize`` only in a group that differs from
        this optimizer's default, ``step`` once a step ran
        (funcopt.optimizers.adopt.strip_instance_keys)."""
        return strip_instance_keys(self, super().state_dict(), INSTANCE_KEYS)

    def stage_state(self, state_dict: Dict[str, Any]) -> Any:
        """As :meth:`funcopt.Optimizer.stage_state`; a group without the options the oracle
        keeps on its instance (``INSTANCE_KEYS``) takes this optimizer's constructor values."""
        return super().stage_state(fill_instance_keys(self, state_dict, INSTANCE_KEYS))
