r"""Lion (EvoLved Sign Momentum; Chen et al. 2023, "Symbolic Discovery of
Optimization Algorithms", arXiv:2302.06675).

Update rule for each parameter :math:`p` with gradient :math:`g`
(``maximize`` negates :math:`g`; :math:`\lambda` is ``weight_decay``)::

    u  = sign(beta1 * m + (1 - beta1) * g)
    p -= lr * (u + lambda * p)          # decay uses p before this update
    m  = beta2 * m + (1 - beta2) * g

torch.optim has no Lion: the oracle is :class:`LionReference`, a plain
per-tensor ``torch.optim.Optimizer`` written from the paper's formula (same
ops as the foreach kernel, one tensor at a time).  State: ``exp_avg`` (``m``),
no step counter.  Complex parameters are updated through real views (the sign
of each component); sparse gradients are refused.
"""
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..base import Optimizer
from ._common import zeros_like


def lion(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """Functional Lion over aligned tensor lists, updated in place (bitwise
    equal to :class:`LionReference`: the same ops, as foreach ops)."""
    if len(params) == 0:
        return
    if maximize:
        grads = torch._foreach_neg(grads)
    update = torch._foreach_mul(exp_avgs, beta1)
    torch._foreach_add_(update, grads, alpha=1 - beta1)
    torch._foreach_sign_(update)
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_add_(params, update, alpha=-lr)
    torch._foreach_mul_(exp_avgs, beta2)
    torch._foreach_add_(exp_avgs, grads, alpha=1 - beta2)


def _lion_one(param: Tensor, grad: Tensor, exp_avg: Tensor, lr: float, beta1: float, beta2: float,
              weight_decay: float, maximize: bool) -> None:
    """One tensor of the paper's rule (the reference, and ``differentiable=True``)."""
    if maximize:
        grad = -grad
    if torch.is_complex(param):
        param = torch.view_as_real(param)
        grad = torch.view_as_real(grad)
        exp_avg = torch.view_as_real(exp_avg)
    update = exp_avg.mul(beta1).add_(grad, alpha=1 - beta1).sign_()
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    param.add_(update, alpha=-lr)
    exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)


class LionKernel:
    """Lion for the shared core (slot: exp_avg)."""

    def __init__(self) -> None:
        self.name = "Lion"

    def init(self, p: Tensor, fused: bool, h: Dict[str, float]) -> List[Tensor]:
        return [zeros_like(p)]

    def check(self, params: List[Tensor], idx: List[int], grads: List[Tensor], h: Dict[str, float],
              odd: bool) -> None:
        pass

    def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
              h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor]) -> None:
        lion(params, grads, state[0], h["lr"], h["betas0"], h["betas1"], h["weight_decay"], h["maximize"] != 0.0)

    def single(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
               h: Dict[str, float], first: bool) -> List[List[Tensor]]:
        if not torch.jit.is_scripting():  # differentiable=True only (sparse gradients are refused)
            for j in range(len(params)):
                _lion_one(params[j], grads[j], state[0][j], h["lr"], h["betas0"], h["betas1"],
                          h["weight_decay"], h["maximize"] != 0.0)
        return state


def _check_hyper(lr: Any, betas: Tuple[Any, Any], weight_decay: float) -> None:
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


class LionReference(torch.optim.Optimizer):
    """The oracle for :class:`Lion`: the paper's rule, one tensor at a time, as
    a plain ``torch.optim.Optimizer`` (torch.optim's conventions: ``exp_avg``
    state, ``maximize``/``foreach``/``differentiable`` group keys, torch's
    ``ValueError`` messages for invalid hyperparameters).  ``foreach`` is
    recorded only (this class is the for-loop)."""

    def __init__(self, params: Any, lr: Any = 1e-4, betas: Tuple[Any, Any] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, foreach: Optional[bool] = None, maximize: bool = False,
                 differentiable: bool = False) -> None:
        _check_hyper(lr, betas, weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, foreach=foreach,
                                      maximize=maximize, differentiable=differentiable))

    def __setstate__(self, state: Any) -> None:  # checkpoints without the switches: their defaults
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("foreach", None)
            group.setdefault("maximize", False)
            group.setdefault("differentiable", False)

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.set_grad_enabled(bool(self.defaults["differentiable"])):
            for group in self.param_groups:
                beta1, beta2 = group["betas"]
                lr = float(group["lr"])
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.is_sparse:
                        raise RuntimeError("Lion does not support sparse gradients")
                    state = self.state[p]
                    if len(state) == 0:
                        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    _lion_one(p, p.grad, state["exp_avg"], lr, beta1, beta2, group["weight_decay"],
                              group["maximize"])
        return loss


class Lion(Optimizer):
    r"""Lion (Chen et al. 2023) with a functional, scriptable step; torch.optim
    has none, so its oracle is :class:`LionReference`.

    Args:
      params: iterable of tensors, of ``(name, tensor)`` pairs, or of param-group dicts.
      lr: learning rate (default ``1e-4``); Lion's update has unit size per
        element, so it wants a smaller lr than Adam (the paper: 3-10x).
      betas: ``(beta1, beta2)``: the interpolation that gives the update's
        sign and the momentum's decay (default ``(0.9, 0.99)``).
      weight_decay: decoupled decay, ``p -= lr * weight_decay * p`` with ``p``
        before the update (default ``0``).
      foreach: ``foreach=True`` means ``impl="foreach"``.
      maximize: ascend instead of descend (default ``False``).
      differentiable: run the step with autograd (eager only, the per-tensor
        formula; ``funcopt.script`` refuses it).
      impl: ``"auto"`` (the native one-pass rule, ``lion.cpp``, for float32/float64
        CPU tensors where :mod:`funcopt.native` loads; else foreach), ``"native"``
        (the same, an error where the library is unavailable) or ``"foreach"``
        (the foreach formula: bitwise :class:`LionReference`; there is no
        fused Lion kernel).

    Example::

        >>> import torch, funcopt
        >>> w = torch.ones(2, requires_grad=True)
        >>> opt = funcopt.Lion([w], lr=0.1, weight_decay=0.5)
        >>> opt.step([torch.tensor([1.0, -1.0])])
        >>> w
        tensor([0.8500, 1.0500], requires_grad=True)
    """

    torch_class = LionReference
    kernel_class = LionKernel
    sparse_msg = "Lion does not support sparse gradients"
    slots = (("exp_avg", None),)
    fused_devices = ()
    native_rule = ("lion", ("lr", "betas0", "betas1", "weight_decay", "maximize"))

    def __init__(self, params: Any, lr: Any = 1e-4, betas: Tuple[Any, Any] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, foreach: Optional[bool] = None, maximize: bool = False,
                 differentiable: bool = False, impl: str = "auto") -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, foreach=foreach,
                                      maximize=maximize, differentiable=differentiable), impl)
