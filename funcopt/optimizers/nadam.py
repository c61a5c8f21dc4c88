r"""NAdam (Adam with Nesterov momentum; ``decoupled_weight_decay=True``: NAdamW).

Update rule for each parameter :math:`p` with gradient :math:`g` at step :math:`t`
(``maximize`` negates :math:`g`; coupled ``weight_decay`` adds
:math:`\lambda p` to :math:`g`, decoupled multiplies :math:`p` by
:math:`1 - \eta\lambda`; :math:`\psi` is ``momentum_decay``)::

    mu_t      = beta1 * (1 - 0.5 * 0.96^(t * psi))
    mu_{t+1}  = beta1 * (1 - 0.5 * 0.96^((t + 1) * psi))
    P_t       = P_{t-1} * mu_t                       # state "mu_product", P_0 = 1
    m_t = beta1 * m_{t-1} + (1 - beta1) * g
    v_t = beta2 * v_{t-1} + (1 - beta2) * g * g
    d   = sqrt(v_t) / sqrt(1 - beta2^t) + eps
    p  -= lr * (1 - mu_t) / (1 - P_t) * g / d
    p  -= lr * mu_{t+1} / (1 - P_t * mu_{t+1}) * m_t / d

``mu_product`` is a float32 scalar tensor per parameter, as in torch.optim
(on the CPU; a loaded state dict puts it on the parameter's device and dtype,
as torch's ``load_state_dict`` does).  Complex parameters are updated through
real views; sparse gradients are refused with torch's error.
"""
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..base import Optimizer
from ._common import grad_prelude, scalars, step_tensor, step_values, zeros_like


def nadam(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    mu_products: List[Tensor],
    steps: List[Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    momentum_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
) -> None:
    """Functional NAdam over aligned tensor lists, updated in place; ``steps``
    already bumped for this step.  torch's ``_multi_tensor_nadam`` op order
    (bitwise equal to ``torch.optim.NAdam(foreach=True)``)."""
    if len(params) == 0:
        return
    grads = grad_prelude(params, grads, maximize, weight_decay, decoupled_weight_decay, lr)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    if torch.compiler.is_compiling():
        # no host reads under torch.compile: torch's capturable formula (tensors)
        exponent = torch._foreach_mul(steps, momentum_decay)
        mus = torch._foreach_pow(0.96, exponent)
        torch._foreach_mul_(mus, -0.5)
        torch._foreach_add_(mus, 1.0)
        torch._foreach_mul_(mus, beta1)
        torch._foreach_add_(exponent, momentum_decay)
        mu_nexts = torch._foreach_pow(0.96, exponent)
        torch._foreach_mul_(mu_nexts, -0.5)
        torch._foreach_add_(mu_nexts, 1.0)
        torch._foreach_mul_(mu_nexts, beta1)
        bc2 = torch._foreach_pow(beta2, steps)
        torch._foreach_sub_(bc2, 1.0)
        torch._foreach_neg_(bc2)
        torch._foreach_sqrt_(bc2)
        torch._foreach_mul_(mu_products, mus)
        torch._foreach_div_(denom, bc2)
        torch._foreach_add_(denom, eps)
        torch._foreach_sub_(mus, 1.0)
        torch._foreach_mul_(mus, lr)
        one_minus = torch._foreach_sub(mu_products, 1.0)
        torch._foreach_neg_(one_minus)
        torch._foreach_div_(mus, one_minus)  # -lr * (1 - mu) / (1 - P)
        nxt = torch._foreach_mul(mu_products, mu_nexts)
        torch._foreach_mul_(mu_nexts, lr)
        torch._foreach_sub_(nxt, 1.0)
        torch._foreach_div_(mu_nexts, nxt)  # -lr * mu_next / (1 - P * mu_next)
        numerator = torch._foreach_mul(mus, grads)
        torch._foreach_addcmul_(numerator, mu_nexts, exp_avgs)
        torch._foreach_addcdiv_(params, numerator, denom)
        return
    t = step_values(steps)
    bc2_sqrt = [(1 - beta2**s) ** 0.5 for s in t]
    mus = [beta1 * (1.0 - 0.5 * (0.96 ** (s * momentum_decay))) for s in t]
    mu_nexts = [beta1 * (1.0 - 0.5 * (0.96 ** ((s + 1) * momentum_decay))) for s in t]
    torch._foreach_mul_(mu_products, scalars(mus))
    torch._foreach_div_(denom, scalars(bc2_sqrt))
    torch._foreach_add_(denom, eps)
    prods = step_values(mu_products)
    size_g: List[float] = []
    size_m: List[float] = []
    for j in range(len(prods)):
        size_g.append((lr * (1.0 - mus[j]) / (1.0 - prods[j])) * -1)
        size_m.append((lr * mu_nexts[j] / (1.0 - prods[j] * mu_nexts[j])) * -1)
    torch._foreach_addcdiv_(params, grads, denom, scalars(size_g))
    torch._foreach_addcdiv_(params, exp_avgs, denom, scalars(size_m))


def nadam_differentiable(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    mu_products: List[Tensor],
    steps: List[Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    momentum_decay: float,
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
        mu_product = mu_products[i]
        if torch.is_complex(param):
            param = torch.view_as_real(param)
            grad = torch.view_as_real(grad)
            exp_avg = torch.view_as_real(exp_avg)
            exp_avg_sq = torch.view_as_real(exp_avg_sq)
        step = steps[i].item()
        bias_correction2 = 1 - beta2**step
        if weight_decay != 0:
            if decoupled_weight_decay:
                param.mul_(1 - lr * weight_decay)
            else:
                grad = grad.add(param, alpha=weight_decay)
        mu = beta1 * (1.0 - 0.5 * (0.96 ** (step * momentum_decay)))
        mu_next = beta1 * (1.0 - 0.5 * (0.96 ** ((step + 1) * momentum_decay)))
        mu_product *= mu
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = exp_avg_sq.div(bias_correction2).sqrt().add(eps)
        mu_product_next = mu_product * mu_next
        grad = grad * (-lr * (1.0 - mu) / (1.0 - mu_product))
        exp_avg = exp_avg * (-lr * mu_next / (1.0 - mu_product_next))
        param.addcdiv_(grad, denom)
        param.addcdiv_(exp_avg, denom)


class NAdamKernel:
    """NAdam for the shared core (slots: step, mu_product, exp_avg, exp_avg_sq)."""

    def __init__(self) -> None:
        self.name = "NAdam"

    def init(self, p: Tensor, fused: bool, h: Dict[str, float]) -> List[Tensor]:
        mu_product = torch.empty((), dtype=torch.float32).fill_(1.0)
        return [step_tensor(p, fused), mu_product, zeros_like(p), zeros_like(p)]

    def check(self, params: List[Tensor], idx: List[int], grads: List[Tensor], h: Dict[str, float],
              odd: bool) -> None:
        pass

    def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
              h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor]) -> None:
        nadam(params, grads, state[2], state[3], state[1], state[0], h["lr"], h["betas0"], h["betas1"],
              h["eps"], h["weight_decay"], h["momentum_decay"], h["decoupled_weight_decay"] != 0.0,
              h["maximize"] != 0.0)

    def single(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
               h: Dict[str, float], first: bool) -> List[List[Tensor]]:
        if not torch.jit.is_scripting():  # differentiable=True only (sparse gradients are refused)
            nadam_differentiable(params, grads, state[2], state[3], state[1], state[0], h["lr"], h["betas0"],
                                 h["betas1"], h["eps"], h["weight_decay"], h["momentum_decay"],
                                 h["decoupled_weight_decay"] != 0.0, h["maximize"] != 0.0)
        return state


class NAdam(Optimizer):
    r"""NAdam, as ``torch.optim.NAdam``, with a functional, scriptable step.

    Args:
      params: iterable of tensors, of ``(name, tensor)`` pairs, or of param-group dicts.
      lr: learning rate (default ``2e-3``).
      betas: ``(beta1, beta2)`` moving-average coefficients (default ``(0.9, 0.999)``).
      eps: added to the denominator (default ``1e-8``).
      weight_decay: weight decay (default ``0``): an L2 penalty added to the
        gradient, or with ``decoupled_weight_decay`` a shrink of the parameter.
      momentum_decay: :math:`\psi` of the momentum schedule (default ``4e-3``).
      decoupled_weight_decay: NAdamW's decay (default ``False``).
      foreach: ``foreach=True`` means ``impl="foreach"``.
      maximize: ascend instead of descend (default ``False``).
      capturable: accepted and recorded for state-dict compatibility.
      differentiable: run the step with autograd (eager only, torch's single-tensor
        formula, as ``torch.optim``; ``funcopt.script`` refuses it).
      impl: ``"auto"`` (the native one-pass rule, ``nadam.cpp``, for float32/float64
        CPU tensors where :mod:`funcopt.native` loads; else foreach), ``"native"``
        (the same, an error where the library is unavailable) or ``"foreach"``
        (torch's foreach formula: bitwise ``torch.optim.NAdam(foreach=True)``;
        torch has no fused NAdam kernel).

    Example::

        >>> import torch, funcopt
        >>> w = torch.ones(2, requires_grad=True)
        >>> opt = funcopt.NAdam([w], lr=0.1)
        >>> opt.step([torch.ones(2)])
        >>> w
        tensor([0.8944, 0.8944], requires_grad=True)
    """

    torch_class = torch.optim.NAdam
    kernel_class = NAdamKernel
    sparse_msg = "NAdam does not support sparse gradients"
    slots = (("step", None), ("mu_product", None), ("exp_avg", None), ("exp_avg_sq", None))
    fused_devices = ()
    native_rule = ("nadam", ("lr", "betas0", "betas1", "eps", "weight_decay", "momentum_decay",
                             "decoupled_weight_decay", "maximize"))

    @classmethod
    def slot_shape(cls, name: str, p: Tensor, group: Any = None) -> Optional[Tuple[int, ...]]:
        """``step`` and ``mu_product`` are scalars; the moments are shaped like ``p``."""
        return () if name in ("step", "mu_product") else tuple(p.shape)

    def __init__(self, params: Any, lr: Any = 2e-3, betas: Tuple[Any, Any] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, momentum_decay: float = 4e-3, decoupled_weight_decay: bool = False,
                 *, foreach: Optional[bool] = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, impl: str = "auto") -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      momentum_decay=momentum_decay, decoupled_weight_decay=decoupled_weight_decay,
                                      maximize=maximize, foreach=foreach, capturable=capturable,
                                      differentiable=differentiable), impl)
