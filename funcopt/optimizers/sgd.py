r"""SGD with momentum, dampening, Nesterov, weight decay and maximize.

Update rule (``g`` negated when ``maximize``; ``g += weight_decay * p``)::

    b_1 = g ;  b_t = momentum * b_{t-1} + (1 - dampening) * g     # momentum != 0
    d   = g + momentum * b_t  (nesterov)  |  b_t  |  g (no momentum)
    p  -= lr * d
"""
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from .._slots import Slots
from ..base import Optimizer
from ._common import skip_step, unscale


def sgd(
    params: List[Tensor],
    grads: List[Tensor],
    momentum_buffers: List[Tensor],
    first_step: bool,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    fused: bool,
    grad_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
) -> None:
    """Functional SGD over aligned lists, in place.

    ``momentum_buffers`` is empty when ``momentum == 0``; with ``first_step``
    the buffers are (allocated, uninitialised) and receive the gradient, as
    torch.optim does on a parameter's first step.  ``fused=True`` calls
    ``torch._fused_sgd_`` (bitwise equal to ``torch.optim.SGD(fused=True)``);
    otherwise torch's foreach order (bitwise equal to ``foreach=True``).
    """
    if len(params) == 0:
        return
    if fused and torch.compiler.is_compiling():
        fused = False  # torch 2.13 has no fake kernel for this fused op; the foreach formula compiles
    if fused:
        torch._fused_sgd_(params, grads, momentum_buffers, weight_decay=weight_decay, momentum=momentum,
                          lr=lr, dampening=dampening, nesterov=nesterov, maximize=maximize,
                          is_first_step=first_step, grad_scale=grad_scale, found_inf=found_inf)
        return
    if skip_step(found_inf):
        return
    grads = unscale(grads, grad_scale)
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0:
        if maximize:
            torch._foreach_add_(grads, params, alpha=weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    if momentum != 0:
        if first_step:
            torch._foreach_copy_(momentum_buffers, grads)
        else:
            torch._foreach_mul_(momentum_buffers, momentum)
            torch._foreach_add_(momentum_buffers, grads, alpha=1 - dampening)
        if nesterov:  # out of place: never write into the caller's gradients
            grads = torch._foreach_add(grads, momentum_buffers, alpha=momentum)
        else:
            grads = momentum_buffers
    torch._foreach_add_(params, grads, alpha=-lr)


class SGDCore:
    """Scriptable SGD state and step (slot: momentum_buffer)."""

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
                momentum = h["momentum"]
                new = s.missing(b, idx[b])
                if len(new) > 0 and skip_step(found_inf):
                    # a skipped first step must leave no buffer behind (the next
                    # real step is the first); one host read, on first steps only
                    continue
                if len(new) > 0:
                    # parameters on their first step get their buffer from the gradient
                    gnew: List[Tensor] = []
                    for i in new:
                        p = s.params[i]
                        buf = torch.empty_like(p, memory_format=torch.preserve_format).zero_() if momentum != 0 else torch.empty(0)
                        s.init(i, [buf])
                        gnew.append(gs[b][idx[b].index(i)])
                    self._apply(b, new, gnew, True, fused, h, grad_scale, found_inf)
                    if len(new) == len(idx[b]):
                        continue
                    old: List[int] = []
                    gold: List[Tensor] = []
                    for j in range(len(idx[b])):
                        if idx[b][j] not in new:
                            old.append(idx[b][j])
                            gold.append(gs[b][j])
                    self._apply(b, old, gold, False, fused, h, grad_scale, found_inf)
                else:
                    self._apply(b, idx[b], gs[b], False, fused, h, grad_scale, found_inf)
        s.release()

    def _apply(self, b: int, idx: List[int], grads: List[Tensor], first: bool, fused: bool,
               h: Dict[str, float], grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
        L = self.slots.lists(b, idx)
        momentum = h["momentum"]
        sgd(L[0], grads, L[1] if momentum != 0 else self.slots.keep([]), first, h["lr"], momentum,
            h["dampening"], h["weight_decay"], h["nesterov"] != 0.0, h["maximize"] != 0.0, fused,
            grad_scale, found_inf)


class SGD(Optimizer):
    r"""Stochastic gradient descent, as ``torch.optim.SGD``, with a functional, scriptable step.

    Args:
      params: iterable of tensors, of ``(name, tensor)`` pairs, or of param-group dicts.
      lr: learning rate (default ``1e-3``).
      momentum: momentum factor (default ``0``).
      dampening: dampening for momentum (default ``0``).
      weight_decay: L2 penalty (default ``0``).
      nesterov: Nesterov momentum (default ``False``; needs momentum and zero dampening).
      maximize: ascend instead of descend (default ``False``).
      foreach, fused: torch's switches; ``fused=True`` means ``impl="fused"``.
      differentiable: must be ``False``.
      impl: ``"auto"`` | ``"foreach"`` | ``"fused"``.

    Example::

        >>> import torch, funcopt
        >>> w = torch.ones(2, requires_grad=True)
        >>> opt = funcopt.SGD([w], lr=0.5, momentum=0.9)
        >>> opt.step([torch.ones(2)])
        >>> w
        tensor([0.5000, 0.5000], requires_grad=True)
    """

    torch_class = torch.optim.SGD
    core_class = SGDCore
    slots = (("momentum_buffer", "momentum"),)
    fused_devices = ("cpu", "cuda", "mps", "xpu")

    def __init__(self, params: Any, lr: Any = 1e-3, momentum: float = 0, dampening: float = 0,
                 weight_decay: Any = 0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, differentiable: bool = False,
                 fused: Optional[bool] = None, impl: str = "auto") -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov, maximize=maximize, foreach=foreach,
                                      differentiable=differentiable, fused=fused), impl)
