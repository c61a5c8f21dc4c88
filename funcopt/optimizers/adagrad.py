r"""Adagrad.

Update rule (``g`` negated when ``maximize``; ``g += weight_decay * p``)::

    clr  = lr / (1 + (t - 1) * lr_decay)
    s_t  = s_{t-1} + g * g                 # s_0 = initial_accumulator_value
    p   -= clr * g / (sqrt(s_t) + eps)

Sparse COO gradients update only the rows they hold (torch's single-tensor
path; refused with weight decay, as in torch); complex parameters are updated
through real views (``s_0 = complex(init, init)``), as in torch.
"""
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from ..base import Optimizer
from . import _compile_ops  # noqa: F401  (registers the ops the compiled path calls)
from ._common import full_like, grad_prelude, scalars, step_tensor, step_values


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
) -> None:
    """Functional Adagrad over aligned lists, in place, ``steps`` already bumped
    (``torch._fused_adagrad_`` when ``fused``, else torch's foreach order:
    bitwise equal to torch.optim)."""
    if len(params) == 0:
        return
    if not torch.jit.is_scripting():  # not compiled by TorchScript: saved graphs keep ATen ops only
        if fused and torch.compiler.is_compiling():
            # one opaque in-place call in the compiled graph (funcopt/optimizers/_compile_ops.py)
            torch.ops.funcopt_aten.fused_adagrad_(params, grads, state_sums, steps, lr, lr_decay, weight_decay, eps,
                                                  maximize, grad_scale, found_inf)
            return
    if fused:
        torch._fused_adagrad_(params, grads, state_sums, steps, lr=lr, lr_decay=lr_decay,
                              weight_decay=weight_decay, eps=eps, maximize=maximize,
                              grad_scale=grad_scale, found_inf=found_inf)
        return
    grads = grad_prelude(params, grads, maximize, weight_decay)
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


def adagrad_single(
    params: List[Tensor],
    grads: List[Tensor],
    state_sums: List[Tensor],
    steps: List[Tensor],
    lr: float,
    lr_decay: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    differentiable: bool,
) -> None:
    """torch's single-tensor Adagrad, in place, ``steps`` already bumped: sparse
    COO gradients (only the rows present are updated; no weight decay,
    checked by the caller) and the differentiable step."""
    for j in range(len(params)):
        param = params[j]
        state_sum = state_sums[j]
        step = steps[j].item()
        grad = grads[j] if not maximize else -grads[j]
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        clr = lr / (1 + (step - 1) * lr_decay)
        if grad.is_sparse:
            grad = grad.coalesce()  # the update is non-linear so indices must be unique
            grad_indices = grad._indices()
            grad_values = grad._values()
            size = grad.size()
            state_sum.add_(torch.sparse_coo_tensor(grad_indices, grad_values.pow(2), size))
            std = state_sum.sparse_mask(grad)
            std_values = std._values().sqrt_().add_(eps)
            param.add_(torch.sparse_coo_tensor(grad_indices, grad_values / std_values, size), alpha=-clr)
        else:
            if torch.is_complex(param):
                grad = torch.view_as_real(grad)
                state_sum = torch.view_as_real(state_sum)
                param = torch.view_as_real(param)
            state_sum.addcmul_(grad, grad, value=1)
            if differentiable:
                std = state_sum.sqrt() + eps
            else:
                std = state_sum.sqrt().add_(eps)
            param.addcdiv_(grad, std, value=-clr)


class AdagradKernel:
    """Adagrad for the shared core (slots: step, sum; state from construction, as torch)."""

    def __init__(self) -> None:
        self.name = "Adagrad"

    def init(self, p: Tensor, fused: bool, h: Dict[str, float]) -> List[Tensor]:
        init = h["initial_accumulator_value"]
        if p.is_complex():  # torch: complex(init, init)
            acc = torch.empty_like(p, memory_format=torch.preserve_format)
            torch.view_as_real(acc).fill_(init)
        else:
            acc = full_like(p, init)
        return [step_tensor(p, fused), acc]

    def check(self, params: List[Tensor], idx: List[int], grads: List[Tensor], h: Dict[str, float],
              odd: bool) -> None:
        if odd and h["weight_decay"] != 0:
            for g in grads:
                if g.is_sparse:
                    raise RuntimeError("weight_decay option is not compatible with sparse gradients")

    def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
              h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor]) -> None:
        adagrad(params, grads, state[1], state[0], h["lr"], h["lr_decay"], h["weight_decay"], h["eps"],
                h["maximize"] != 0.0, fused, grad_scale, found_inf)

    def single(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
               h: Dict[str, float], first: bool) -> List[List[Tensor]]:
        adagrad_single(params, grads, state[1], state[0], h["lr"], h["lr_decay"], h["weight_decay"], h["eps"],
                       h["maximize"] != 0.0, h.get("differentiable", 0.0) != 0.0)
        return state


class Adagrad(Optimizer):
    r"""Adagrad, as ``torch.optim.Adagrad``, with a functional, scriptable step.

    Args:
      params: iterable of tensors, of ``(name, tensor)`` pairs, or of param-group dicts.
      lr: learning rate (default ``1e-2``).
      lr_decay: learning-rate decay (default ``0``).
      weight_decay: L2 penalty (default ``0``).
      initial_accumulator_value: starting value of the sum of squares (default ``0``).
      eps: added to the denominator (default ``1e-10``).
      foreach: torch's switch; ``foreach=True`` means ``impl="foreach"``.
      fused: torch's switch; ``fused=True`` means ``impl="fused"`` (CPU only in torch 2.13).
      maximize: ascend instead of descend (default ``False``).
      differentiable: run the step with autograd (eager only, torch's single-tensor
        formula, as ``torch.optim``; ``funcopt.script`` refuses it).
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
    kernel_class = AdagradKernel
    init_at_construction = True
    slots = (("step", None), ("sum", None))
    fused_devices = ("cpu",)

    def __init__(self, params: Any, lr: Any = 1e-2, lr_decay: float = 0, weight_decay: float = 0,
                 initial_accumulator_value: float = 0, eps: float = 1e-10, foreach: Optional[bool] = None, *,
                 maximize: bool = False, differentiable: bool = False, fused: Optional[bool] = None,
                 impl: str = "auto") -> None:
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value, foreach=foreach,
                                      maximize=maximize, differentiable=differentiable, fused=fused), impl)
