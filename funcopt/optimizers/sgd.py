r"""SGD with momentum, dampening, Nesterov, weight decay and maximize.

Update rule (``g`` negated when ``maximize``; ``g += weight_decay * p``)::

    b_1 = g ;  b_t = momentum * b_{t-1} + (1 - dampening) * g     # momentum != 0
    d   = g + momentum * b_t  (nesterov)  |  b_t  |  g (no momentum)
    p  -= lr * d

Sparse COO gradients (``nn.Embedding(sparse=True)``) take torch's single-tensor
path, as in torch.optim (the momentum buffer of a sparse first step is
sparse; weight decay is refused with them); complex parameters need nothing
special (the update is linear).
"""
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from ..base import Optimizer
from . import _compile_ops  # noqa: F401  (registers the ops the compiled path calls)
from ._common import grad_prelude


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
    otherwise torch's foreach order (bitwise equal to ``foreach=True``; the
    caller has unscaled the gradients and checked ``found_inf``).
    """
    if len(params) == 0:
        return
    if not torch.jit.is_scripting():  # not compiled by TorchScript: saved graphs keep ATen ops only
        if fused and torch.compiler.is_compiling():
            # one opaque in-place call in the compiled graph (funcopt/optimizers/_compile_ops.py)
            torch.ops.funcopt_aten.fused_sgd_(params, grads, momentum_buffers, weight_decay, momentum, lr, dampening,
                                              nesterov, maximize, first_step, grad_scale, found_inf)
            return
    if fused:
        torch._fused_sgd_(params, grads, momentum_buffers, weight_decay=weight_decay, momentum=momentum,
                          lr=lr, dampening=dampening, nesterov=nesterov, maximize=maximize,
                          is_first_step=first_step, grad_scale=grad_scale, found_inf=found_inf)
        return
    grads = grad_prelude(params, grads, maximize, weight_decay)
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


def sgd_single(
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
) -> None:
    """torch's single-tensor SGD, in place: sparse COO gradients (a sparse
    gradient makes a sparse momentum buffer, as in torch.optim) and the
    differentiable step.  With ``first_step`` the buffers are created from the
    gradient and stored into ``momentum_buffers`` (empty when ``momentum == 0``)."""
    for j in range(len(params)):
        param = params[j]
        grad = grads[j] if not maximize else -grads[j]
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        if momentum != 0:
            if first_step:
                buf = grad.detach().clone()
                momentum_buffers[j] = buf
            else:
                buf = momentum_buffers[j]
                buf.mul_(momentum).add_(grad, alpha=1 - dampening)
            if nesterov:
                grad = grad.add(buf, alpha=momentum)
            else:
                grad = buf
        param.add_(grad, alpha=-lr)


class SGDKernel:
    """SGD for the shared core (slot: momentum_buffer, created from the first gradient)."""

    def __init__(self) -> None:
        self.name = "SGD"

    def init(self, p: Tensor, fused: bool, h: Dict[str, float]) -> List[Tensor]:
        if h["momentum"] != 0:
            return [torch.empty_like(p, memory_format=torch.preserve_format).zero_()]
        return [torch.empty(0)]

    def check(self, params: List[Tensor], idx: List[int], grads: List[Tensor], h: Dict[str, float],
              odd: bool) -> None:
        if odd and h["weight_decay"] != 0:
            for g in grads:
                if g.is_sparse:  # torch.optim.SGD fails on it too, mid-step
                    raise RuntimeError(
                        "funcopt: SGD's weight_decay is not compatible with sparse gradients "
                        "(torch.optim.SGD: add(sparse, dense) is not supported)"
                    )

    def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
              h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor]) -> None:
        momentum = h["momentum"]
        bufs = state[0] if momentum != 0 else torch.jit.annotate(List[Tensor], [])
        sgd(params, grads, bufs, first, h["lr"], momentum, h["dampening"], h["weight_decay"],
            h["nesterov"] != 0.0, h["maximize"] != 0.0, fused, grad_scale, found_inf)

    def single(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
               h: Dict[str, float], first: bool) -> List[List[Tensor]]:
        momentum = h["momentum"]
        bufs: List[Tensor] = []
        if momentum != 0:
            bufs = state[0]
        sgd_single(params, grads, bufs, first, h["lr"], momentum, h["dampening"], h["weight_decay"],
                   h["nesterov"] != 0.0, h["maximize"] != 0.0)
        if momentum != 0:
            return [bufs]
        return state


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
      foreach: torch's switch; ``foreach=True`` means ``impl="foreach"``.
      fused: torch's switch; ``fused=True`` means ``impl="fused"``.
      differentiable: run the step with autograd (eager only, torch's single-tensor
        formula, as ``torch.optim``; ``funcopt.script`` refuses it).
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
    kernel_class = SGDKernel
    split_first = True
    slots = (("momentum_buffer", "momentum"),)
    fused_devices = ("cpu", "cuda", "mps", "xpu")
    # float32/float64 CPU buckets (impl="auto"): the native one-pass rule (sgd.cpp), bitwise
    # torch.optim.SGD(foreach=True); other CPU dtypes and devices: torch's fused kernel
    native_rule = ("sgd", ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "first"))

    def __init__(self, params: Any, lr: Any = 1e-3, momentum: float = 0, dampening: float = 0,
                 weight_decay: Any = 0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, differentiable: bool = False,
                 fused: Optional[bool] = None, impl: str = "auto") -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov, maximize=maximize, foreach=foreach,
                                      differentiable=differentiable, fused=fused), impl)
