r"""Muon (Jordan et al. 2024, as ``torch.optim.Muon``): momentum, then Newton–Schulz
orthogonalisation of each 2-D update.

Update rule for each 2-D parameter :math:`p` (``A x B``) with gradient :math:`g`::

    b  = lerp(b, g, 1 - momentum)                    # momentum_buffer
    u  = lerp(g, b, momentum) if nesterov else b
    X  = bfloat16(u), transposed if A > B;  X /= max(||X||_F, eps)
    repeat ns_steps:                                 # (a, b, c) = ns_coefficients
        G = X @ X^T
        X = a * X + (b * G + c * G @ G) @ X
    p *= 1 - lr * weight_decay
    p -= lr * ratio * X (transposed back)            # ratio by adjust_lr_fn:
         # None / "original": sqrt(max(1, A / B)); "match_rms_adamw": 0.2 * sqrt(max(A, B));
         # "spectral_unclamped" (torch >= 2.15): sqrt(A / B)

torch has only a per-tensor implementation; this one is the same ops in the
same order (bitwise equal), scriptable and compilable.  Parameters must be
2-D (checked at construction, as torch); complex parameters and sparse
gradients are refused with torch's errors.  The rule needs each parameter
whole, so ZeRO places Muon's parameters whole (``partition="greedy"``).
"""
import math
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..base import Optimizer
from ._common import zeros_like

# torch.optim.Muon's defaults (Keller Jordan's coefficients)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7
NS_STEPS = 5
# adjust_lr_fn -> the float the scripted core sees
ADJUST_LR_CODES = {None: 0.0, "original": 1.0, "match_rms_adamw": 2.0, "spectral_unclamped": 3.0}


def newton_schulz(grad: Tensor, a: float, b: float, c: float, ns_steps: int, eps: float) -> Tensor:
    """Approximate orthogonalisation of the 2-D ``grad`` (in bfloat16), as torch's
    ``_zeropower_via_newtonschulz``."""
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if grad.dim() != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    ortho = grad.to(torch.bfloat16)  # grad.bfloat16(): the same tensor when grad is bfloat16
    tall = grad.size(0) > grad.size(1)
    if tall:
        ortho = ortho.t()
    ortho.div_(torch.clamp(torch.linalg.vector_norm(ortho, 2.0, None, False), min=eps))
    for _ in range(ns_steps):
        gram = torch.matmul(ortho, ortho.t())
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    if tall:
        ortho = ortho.t()
    return ortho


def adjusted_lr(lr: float, adjust_lr_fn: float, rows: int, cols: int) -> float:
    """``lr`` scaled for a ``rows x cols`` matrix (``adjust_lr_fn`` by its code in
    :data:`ADJUST_LR_CODES`)."""
    if adjust_lr_fn == 0.0 or adjust_lr_fn == 1.0:
        ratio = math.sqrt(max(1.0, rows / cols))
    elif adjust_lr_fn == 2.0:
        ratio = 0.2 * math.sqrt(float(max(rows, cols)))
    elif adjust_lr_fn == 3.0:
        ratio = math.sqrt(rows / cols)
    else:
        ratio = 1.0
    return lr * ratio


def muon(
    params: List[Tensor],
    grads: List[Tensor],
    momentum_buffers: List[Tensor],
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: Tuple[float, float, float],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: float,
) -> None:
    """Functional Muon over aligned lists of 2-D tensors, updated in place, one
    tensor at a time (torch has no foreach Muon; same ops, same order)."""
    a, b, c = ns_coefficients
    for i in range(len(params)):
        param = params[i]
        grad = grads[i]
        if grad.dim() != 2:
            raise ValueError("Param gradient must be a 2D matrix")
        buf = momentum_buffers[i]
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if nesterov else buf
        update = newton_schulz(update, a, b, c, ns_steps, eps)
        lr_i = adjusted_lr(lr, adjust_lr_fn, param.size(0), param.size(1))
        decay = 1 - lr * weight_decay
        if param.dtype == torch.bfloat16 or param.dtype == torch.float16:
            # TorchScript's mul_(float) rounds the factor to the tensor's dtype first;
            # eager (torch.optim) multiplies in float: a 0-d float64 tensor does that in both
            param.mul_(torch.tensor(decay, dtype=torch.float64))
        else:
            param.mul_(decay)
        param.add_(update, alpha=-lr_i)


class MuonKernel:
    """Muon for the shared core (slot: momentum_buffer)."""

    def __init__(self) -> None:
        self.name = "Muon"

    def init(self, p: Tensor, fused: bool, h: Dict[str, float]) -> List[Tensor]:
        return [zeros_like(p)]

    def check(self, params: List[Tensor], idx: List[int], grads: List[Tensor], h: Dict[str, float],
              odd: bool) -> None:
        for i in idx:
            if params[i].is_complex():
                raise RuntimeError("Muon does not support complex parameters")
        for g in grads:
            if g.dim() != 2:
                raise ValueError("Param gradient must be a 2D matrix")
        if "ns_coefficients2" not in h or "ns_coefficients3" in h:
            raise ValueError("Coefficients must be a tuple of exactly 3 values")
        if h["ns_steps"] >= 100:
            raise ValueError("Number of steps must be less than 100 for computational efficiency")

    def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
              h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor]) -> None:
        muon(params, grads, state[0], h["lr"], h["weight_decay"], h["momentum"], h["nesterov"] != 0.0,
             (h["ns_coefficients0"], h["ns_coefficients1"], h["ns_coefficients2"]), int(h["ns_steps"]),
             h["eps"], h["adjust_lr_fn"])

    def single(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
               h: Dict[str, float], first: bool) -> List[List[Tensor]]:
        # torch's only formula is per tensor: the same as dense (not reached by the core:
        # sparse gradients are refused and Muon has no differentiable=True)
        self.dense(params, grads, state, h, False, first, None, None)
        return state


class Muon(Optimizer):
    r"""Muon, as ``torch.optim.Muon``, with a functional, scriptable step.

    Args:
      params: iterable of 2-D tensors, of ``(name, tensor)`` pairs, or of param-group
        dicts (biases, embeddings and other parameters belong to another optimizer).
      lr: learning rate (default ``1e-3``).
      weight_decay: decoupled decay, ``p *= 1 - lr * weight_decay`` (default ``0.1``).
      momentum: momentum factor (default ``0.95``).
      nesterov: Nesterov momentum (default ``True``).
      ns_coefficients: ``(a, b, c)`` of the quintic Newton–Schulz iteration
        (default ``(3.4445, -4.7750, 2.0315)``).
      eps: floor of the Frobenius norm the update is divided by (default ``1e-7``).
      ns_steps: Newton–Schulz iterations, fewer than 100 (default ``5``).
      adjust_lr_fn: ``None`` or ``"original"`` (``sqrt(max(1, A/B))``) or
        ``"match_rms_adamw"`` (``0.2 * sqrt(max(A, B))``) or ``"spectral_unclamped"``
        (``sqrt(A/B)``; accepted where the installed torch accepts it, 2.15 on) (default ``None``).
      impl: ``"auto"`` or ``"foreach"`` (both: the per-tensor formula; torch has no other).

    Example::

        >>> import torch, funcopt
        >>> w = torch.eye(2, requires_grad=True)
        >>> opt = funcopt.Muon([w], lr=0.1, weight_decay=0.0)
        >>> opt.step([torch.eye(2)])
        >>> w
        tensor([[0.8875, 0.0000],
                [0.0000, 0.8875]], requires_grad=True)
    """

    torch_class = torch.optim.Muon
    kernel_class = MuonKernel
    sparse_msg = "Muon does not support sparse gradients"
    slots = (("momentum_buffer", None),)
    hyper_codes = {"adjust_lr_fn": ADJUST_LR_CODES}
    whole_params = True
    probe_shape = (1, 1)

    def __init__(self, params: Any, lr: Any = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: Tuple[float, float, float] = NS_COEFFICIENTS,
                 eps: float = EPS, ns_steps: int = NS_STEPS, adjust_lr_fn: Optional[str] = None,
                 *, impl: str = "auto") -> None:
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                      ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                                      adjust_lr_fn=adjust_lr_fn), impl)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(
                        f"Muon only supports 2D parameters whereas we found a parameter with size: {p.size()}"
                    )
