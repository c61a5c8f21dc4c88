"""Small scriptable helpers the algorithm files share."""
from typing import List, Optional, Union

import torch
from torch import Tensor

# TorchScript's ``Scalar[]`` (``List[number]``): a ``List[float]`` does not match
# the per-tensor-scalar overloads of the ``_foreach_*`` ops, this does.
Scalars = List[Union[int, float, complex]]


def scalars(xs: List[float]) -> List[Union[int, float, complex]]:
    out: List[Union[int, float, complex]] = []
    for x in xs:
        out.append(x)
    return out


def step_values(steps: List[Tensor]) -> List[float]:
    """Host values of per-parameter step counters (CPU tensors on the foreach path)."""
    return [float(s.item()) for s in steps]


def bump(steps: List[Tensor], base: Optional[Tensor] = None) -> None:
    """``steps += 1``.  ``base``: a tensor whose elements are exactly ``steps``
    (``Slots.step_base``): one op.  Otherwise, for CPU counters the one-tensor
    overload is ~5x faster than the Scalar one (which wraps the scalar once per
    tensor), as torch.optim also does; same float32 result."""
    if base is not None:
        base.add_(1.0)
    elif len(steps) > 0 and steps[0].is_cpu:
        torch._foreach_add_(steps, torch.ones(()), alpha=1.0)
    else:
        torch._foreach_add_(steps, 1.0)


def grad_prelude(params: List[Tensor], grads: List[Tensor], maximize: bool, weight_decay: float,
                 decoupled: bool = False, lr: float = 0.0) -> List[Tensor]:
    """The gradient prelude of torch's foreach formulas: ``g = -g`` when
    ``maximize``; weight decay coupled (``g += weight_decay * p``) or decoupled
    (``p *= 1 - lr * weight_decay``).  Never writes into the caller's gradients
    (in place only into the list ``maximize`` made); returns the gradients to use."""
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0:
        if decoupled:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        elif maximize:
            torch._foreach_add_(grads, params, alpha=weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    return grads


def skip_step(found_inf: Optional[Tensor]) -> bool:
    """foreach path only: the fused kernels check ``found_inf`` on device."""
    if found_inf is None:
        return False
    return bool(found_inf.item() != 0)


def unscale(grads: List[Tensor], grad_scale: Optional[Tensor]) -> List[Tensor]:
    if grad_scale is None:
        return grads
    # 0-d: a one-element tensor of another shape would take part in type
    # promotion (float16 gradients / float32[1] -> float32)
    return torch._foreach_div(grads, grad_scale.reshape([]))


def found_inf_flag(found_inf: Optional[Tensor]) -> Optional[Tensor]:
    """``found_inf`` as exactly 0.0 or 1.0 (float32, same device), computed on
    device with no host sync: torch's fused kernels skip only on exactly 1.0,
    and the step counters are corrected by subtracting it.  Any nonzero value,
    NaN included (NaN != 0), means "skip"."""
    if found_inf is None:
        return None
    return torch.ne(found_inf, 0.0).to(torch.float32).reshape([])


def real_views(ts: List[Tensor]) -> List[Tensor]:
    """``torch.view_as_real`` of every tensor (complex parameters are updated
    through real views, as torch.optim does)."""
    return [torch.view_as_real(t) for t in ts]


def check_differentiable(params: List[Tensor], idx: List[int]) -> None:
    """``differentiable=True`` runs the step eagerly with grad enabled, as
    torch.optim; refused under TorchScript.  A leaf parameter that requires
    grad cannot be updated in place with grad enabled: torch.optim fails on it
    mid-step (autograd's error); we raise the same error before any change."""
    if torch.jit.is_scripting():
        raise RuntimeError(
            "funcopt: differentiable=True cannot run in a scripted optimizer (funcopt.script): "
            "the scripted step runs without autograd; use the eager optimizer"
        )
    else:
        for i in idx:
            p = params[i]
            if p.is_leaf and p.requires_grad:
                raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")


# State allocation ends with an in-place fill on purpose: TorchScript's
# common-subexpression elimination merges identical pure allocations whose
# later writes it cannot see (they happen through lists), which would make two
# state tensors one.  A tensor written by ``fill_``/``zero_`` is never merged.


def step_tensor(p: Tensor, fused: bool) -> Tensor:
    """A fresh step counter, where torch.optim keeps it: on the parameter's
    device for the fused kernels, on the CPU otherwise."""
    if fused:
        return torch.empty((), dtype=torch.float32, device=p.device).zero_()
    return torch.empty((), dtype=torch.float32).zero_()


def zeros_like(p: Tensor) -> Tensor:
    return torch.empty_like(p, memory_format=torch.preserve_format).zero_()


def full_like(p: Tensor, value: float) -> Tensor:
    return torch.empty_like(p, memory_format=torch.preserve_format).fill_(value)
