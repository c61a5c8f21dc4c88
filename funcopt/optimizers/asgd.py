r"""ASGD (averaged stochastic gradient descent, Polyak & Juditsky 1992).

Update rule for each parameter :math:`p` with gradient :math:`g` at step :math:`t`
(``maximize`` negates :math:`g`; ``weight_decay`` adds :math:`\lambda_w p` to :math:`g`;
``lambd`` is :math:`\lambda`)::

    p    -= eta_{t-1} * (g + lambd * p)
    ax   += mu_{t-1} * (p - ax)                   # the averaged parameter
    eta_t = lr / (1 + lambd * lr * t)^alpha
    mu_t  = 1 / max(1, t - t0)

State per parameter: ``step``, ``eta`` and ``mu`` (float32 scalar tensors on
the parameter's device, as torch.optim keeps them) and ``ax``.  This is
torch's foreach formula, which differs in float64 from torch's for-loop one:
``eta_t`` is computed with float32 tensor ops from the step counter (the
for-loop computes it in double and rounds), and the parameter update is one
``addcmul`` of ``g + lambd * p`` (the for-loop scales ``p`` first).  Complex
parameters are updated through real views; sparse gradients are refused with
torch's error.
"""
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from ..base import Optimizer
from ._common import step_values, zeros_like


def asgd(
    params: List[Tensor],
    grads: List[Tensor],
    axs: List[Tensor],
    mus: List[Tensor],
    etas: List[Tensor],
    steps: List[Tensor],
    lr: float,
    lambd: float,
    alpha: float,
    t0: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """Functional ASGD over aligned tensor lists, updated in place; ``steps``
    already bumped for this step.  torch's ``_multi_tensor_asgd`` op order
    (bitwise equal to ``torch.optim.ASGD(foreach=True)``)."""
    if len(params) == 0:
        return
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0:
        if maximize:
            torch._foreach_add_(grads, params, alpha=weight_decay)
            inter = grads
        else:
            inter = torch._foreach_add(grads, params, alpha=weight_decay)
        torch._foreach_add_(inter, params, alpha=lambd)
    else:
        inter = torch._foreach_add(grads, params, alpha=lambd)
    torch._foreach_addcmul_(params, inter, etas, value=-1)
    diff = torch._foreach_sub(params, axs)
    torch._foreach_addcmul_(axs, diff, mus)
    # eta_t = lr / (1 + lambd * lr * t)^alpha with torch's tensor ops (float32, as
    # torch computes it from the step tensor: ``lr / x`` is ``x.reciprocal() * lr``)
    new_etas = torch._foreach_mul(steps, lambd * lr)
    torch._foreach_add_(new_etas, 1.0)
    torch._foreach_pow_(new_etas, alpha)
    torch._foreach_reciprocal_(new_etas)
    torch._foreach_mul_(new_etas, lr)
    torch._foreach_copy_(etas, new_etas)
    if torch.compiler.is_compiling():
        # no host reads under torch.compile: mu_t from the step tensors (float32)
        new_mus = torch._foreach_sub(steps, t0)
        torch._foreach_maximum_(new_mus, 1.0)
        torch._foreach_reciprocal_(new_mus)
        torch._foreach_copy_(mus, new_mus)
        return
    t = step_values(steps)
    # torch.as_tensor of the host double: a float32 tensor, then copied
    new_mus = [torch.full([], 1.0 / max(1.0, t[j] - t0), dtype=torch.float32, device=mus[j].device)
               for j in range(len(t))]
    torch._foreach_copy_(mus, new_mus)


def asgd_differentiable(
    params: List[Tensor],
    grads: List[Tensor],
    axs: List[Tensor],
    mus: List[Tensor],
    etas: List[Tensor],
    steps: List[Tensor],
    lr: float,
    lambd: float,
    alpha: float,
    t0: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """``differentiable=True`` (eager only, grad enabled): torch's single-tensor
    formula (``steps`` already bumped)."""
    for i in range(len(params)):
        param = params[i]
        grad = grads[i] if not maximize else -grads[i]
        mu = mus[i]
        ax = axs[i]
        eta = etas[i]
        if torch.is_complex(param):
            grad = torch.view_as_real(grad)
            param = torch.view_as_real(param)
            ax = torch.view_as_real(ax)
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        eta_value = eta.item()
        param.mul_(1 - lambd * eta_value)
        param.add_(grad, alpha=-eta_value)
        if mu.item() != 1:
            ax.add_(param.sub(ax).mul_(mu))
        else:
            ax.copy_(param)
        step = steps[i].item()
        eta.copy_(torch.as_tensor(lr / ((1 + lambd * lr * step) ** alpha)))
        mu.copy_(torch.as_tensor(1 / max(1, step - t0)))


class ASGDKernel:
    """ASGD for the shared core (slots: step, eta, mu, ax)."""

    def __init__(self) -> None:
        self.name = "ASGD"

    def init(self, p: Tensor, fused: bool, h: Dict[str, float]) -> List[Tensor]:
        # torch keeps step, eta and mu on the parameter's device
        step = torch.empty((), dtype=torch.float32, device=p.device).zero_()
        eta = torch.empty((), dtype=torch.float32, device=p.device).fill_(h["lr"])
        mu = torch.empty((), dtype=torch.float32, device=p.device).fill_(1.0)
        return [step, eta, mu, zeros_like(p)]

    def check(self, params: List[Tensor], idx: List[int], grads: List[Tensor], h: Dict[str, float],
              odd: bool) -> None:
        pass

    def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
              h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor]) -> None:
        asgd(params, grads, state[3], state[2], state[1], state[0], h["lr"], h["lambd"], h["alpha"], h["t0"],
             h["weight_decay"], h["maximize"] != 0.0)

    def single(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
               h: Dict[str, float], first: bool) -> List[List[Tensor]]:
        if not torch.jit.is_scripting():  # differentiable=True only (sparse gradients are refused)
            asgd_differentiable(params, grads, state[3], state[2], state[1], state[0], h["lr"], h["lambd"],
                                h["alpha"], h["t0"], h["weight_decay"], h["maximize"] != 0.0)
        return state


class ASGD(Optimizer):
    r"""ASGD, as ``torch.optim.ASGD``, with a functional, scriptable step.

    Args:
      params: iterable of tensors, of ``(name, tensor)`` pairs, or of param-group dicts.
      lr: learning rate (default ``1e-2``).
      lambd: decay term (default ``1e-4``).
      alpha: power of the eta schedule (default ``0.75``).
      t0: step at which averaging starts (default ``1e6``).
      weight_decay: L2 penalty added to the gradient (default ``0``).
      foreach: ``foreach=True`` means ``impl="foreach"``.
      maximize: ascend instead of descend (default ``False``).
      differentiable: run the step with autograd (eager only, torch's single-tensor
        formula, as ``torch.optim``; ``funcopt.script`` refuses it).
      capturable: accepted and recorded for state-dict compatibility.
      impl: ``"auto"`` (the native one-pass rule, ``asgd.cpp``, for float32/float64
        CPU tensors where :mod:`funcopt.native` loads; else foreach), ``"native"``
        (the same, an error where the library is unavailable) or ``"foreach"``
        (torch's foreach formula: bitwise ``torch.optim.ASGD(foreach=True)``;
        torch has no fused ASGD kernel).

    Example::

        >>> import torch, funcopt
        >>> w = torch.ones(2, requires_grad=True)
        >>> opt = funcopt.ASGD([w], lr=0.1, t0=0)
        >>> opt.step([torch.ones(2)])
        >>> w, opt.state[w]["ax"]
        (tensor([0.9000, 0.9000], requires_grad=True), tensor([0.9000, 0.9000]))
    """

    torch_class = torch.optim.ASGD
    kernel_class = ASGDKernel
    sparse_msg = "ASGD does not support sparse gradients"
    slots = (("step", None), ("eta", None), ("mu", None), ("ax", None))
    fused_devices = ()
    native_rule = ("asgd", ("lr", "lambd", "alpha", "t0", "weight_decay", "maximize"))

    @classmethod
    def slot_shape(cls, name: str, p: Tensor, group: Any = None) -> Optional[tuple]:
        """``step``, ``eta`` and ``mu`` are scalars; ``ax`` is shaped like ``p``."""
        return () if name in ("step", "eta", "mu") else tuple(p.shape)

    def __init__(self, params: Any, lr: Any = 1e-2, lambd: float = 1e-4, alpha: float = 0.75, t0: float = 1e6,
                 weight_decay: float = 0, foreach: Optional[bool] = None, maximize: bool = False,
                 differentiable: bool = False, capturable: bool = False, *, impl: str = "auto") -> None:
        super().__init__(params, dict(lr=lr, lambd=lambd, alpha=alpha, t0=t0, weight_decay=weight_decay,
                                      foreach=foreach, maximize=maximize, differentiable=differentiable,
                                      capturable=capturable), impl)
